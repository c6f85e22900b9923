//! Version commands: new, promote, revert, override. Each is one metadata transaction
//! (see `Store::update`), so it is atomic, locked and audited.
//!
//! Life of a version (PVS semantics):
//!
//! ```text
//!   version new ──► maintenance ──promote──► test ──promote──► production [--at TIME]
//!                      ▲   │  └──────promote --to production──────┘  │
//!                      │   └─revert─► discarded (file retired)      │
//!                      └──revert (newest only)── test ◄──revert─────┘
//! ```
//!
//! Rules: at most one maintenance version, always the newest; a maintenance version with a
//! writer attached cannot be promoted (its writer may hold unflushed data); the override
//! is a test or production version and cannot be reverted while it is the override.

use serde_json::json;

use crate::error::{io, Result, StoreError};
use crate::fsutil;
use crate::meta::{Access, DiskAccess, LayerFormat, Stamp, VdiskMeta, Version};
use crate::store::Store;
use crate::time::Timestamp;

/// What `version revert` did.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Reverted {
    /// Back to this access.
    To(Access),
    /// A maintenance version was dropped; its file is retired.
    Discarded,
}

fn no_version(meta: &VdiskMeta, n: u32) -> StoreError {
    let have: Vec<String> = meta.versions.iter().map(|v| v.number.to_string()).collect();
    StoreError::UnknownVersion {
        vdisk: meta.name.clone(),
        version: n,
        have: if have.is_empty() {
            "none (only the base)".into()
        } else {
            have.join(", ")
        },
    }
}

impl Store {
    /// `version new NAME`: a maintenance version over the newest layer.
    ///
    /// The file is written under a temporary name and renamed into place; when anything
    /// fails (a full file system while writing it or the metadata), nothing is left behind.
    pub fn new_version(&self, name: &str, note: Option<String>) -> Result<Version> {
        if let Some(n) = &note {
            crate::names::validate_text("a version note", n)?;
        }
        let made = std::cell::Cell::new(None);
        let result = self.new_version_in(name, note, &made);
        if result.is_err() {
            if let Some(file) = made.take() {
                self.drop_unlisted(name, &file);
            }
        }
        result
    }

    /// Removes `file` of vDisk `name` if the metadata does not list it (checked under the
    /// exclusive lock: a failed command may have failed after saving the metadata).
    fn drop_unlisted(&self, name: &str, file: &str) {
        let Ok(_l) = self.lock(fsutil::LockMode::Exclusive) else {
            return;
        };
        let listed = match self.load(name) {
            Ok(m) => {
                m.base.file == file
                    || m.versions.iter().any(|v| v.file == file)
                    || m.retired.iter().any(|f| f == file)
            }
            Err(_) => true, // cannot tell: leave it to `vdisk gc`
        };
        if !listed {
            let p = self.file_path(name, file);
            match std::fs::remove_file(&p) {
                Ok(()) => log::info!("removed {} left by the failed command", p.display()),
                Err(e) => log::warn!(
                    "cannot remove {} left by the failed command: {e}; `vdstream vdisk gc` will",
                    p.display()
                ),
            }
        }
    }

    fn new_version_in(
        &self,
        name: &str,
        note: Option<String>,
        made: &std::cell::Cell<Option<String>>,
    ) -> Result<Version> {
        self.update(name, "version.new", |m| {
            if m.access == DiskAccess::Private {
                return Err(StoreError::Refused(format!(
                    "vDisk {name} has private access, which has no versions: switch it to standard first (`vdstream vdisk set {name} --access standard`)")));
            }
            if let Some(v) = m.maintenance() {
                return Err(StoreError::Refused(format!(
                    "vDisk {name} already has version {} in maintenance (one at a time): promote it (`vdstream version promote {name} {} --to test`) or discard it (`vdstream version revert {name} {}`)",
                    v.number, v.number, v.number)));
            }
            let number = m.next_version;
            let file = format!("{name}.{number}.qcow2");
            let (parent, format) = match m.newest() {
                Some(v) => (v.file.clone(), LayerFormat::Qcow2),
                None => (m.base.file.clone(), m.base.format),
            };
            let path = self.file_path(name, &file);
            if path.exists() {
                return Err(StoreError::Refused(format!(
                    "{} exists but the metadata does not list it (a leftover of a crash): run `vdstream vdisk gc`, which deletes it, and try again", path.display())));
            }
            let parent_path = self.file_path(name, &parent);
            if !parent_path.exists() {
                return Err(StoreError::MissingFile { path: parent_path, advice: "the new version would sit on it: restore it from backup first".into() });
            }
            let tmp = fsutil::temp_beside(&path);
            let _ = std::fs::remove_file(&tmp);
            let written = vdstream_qcow2::create(&tmp, m.size, Some((&parent, format.image_format())), 16)
                .map_err(StoreError::from)
                .and_then(|()| std::fs::rename(&tmp, &path).map_err(io("move into place", &path)));
            if let Err(e) = written {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
            made.set(Some(file.clone()));
            fsutil::sync_dir(&self.vdisk_dir(name))?;
            let v = Version {
                number,
                file,
                access: Access::Maintenance,
                created: Timestamp::now(),
                created_by: self.actor().who(),
                promoted: None,
                scheduled_at: None,
                note: note.clone(),
                merged_from: vec![],
            };
            m.versions.push(v.clone());
            m.next_version += 1;
            Ok((v, json!({"version": number, "file": &m.versions.last().expect("pushed").file, "backing": parent, "note": note})))
        })
    }

    /// `version promote NAME V --to test|production [--at TIME]`.
    pub fn promote(
        &self,
        name: &str,
        number: u32,
        to: Access,
        at: Option<Timestamp>,
    ) -> Result<Version> {
        if to == Access::Maintenance {
            return Err(StoreError::BadInput(
                "promote goes --to test or --to production".into(),
            ));
        }
        if at.is_some() && to != Access::Production {
            return Err(StoreError::Inconsistent(
                "--at schedules a release to production: use it with --to production".into(),
            ));
        }
        self.update(name, "version.promote", |m| {
            let file = self.file_path(name, &m.version(number).ok_or_else(|| no_version(m, number))?.file);
            let v = m.version_mut(number).expect("checked");
            let from = v.access;
            if from >= to {
                return Err(StoreError::Refused(format!(
                    "version {number} of {name} is already {}; promotion goes maintenance → test → production", from.name())));
            }
            if from == Access::Maintenance && fsutil::in_use(&file)? {
                return Err(StoreError::Refused(format!(
                    "version {number} of {name} is still open by its maintenance target ({}): shut that target down before promoting",
                    fsutil::describe_holders(&file))));
            }
            v.access = to;
            v.scheduled_at = if to == Access::Production { at } else { None };
            v.promoted = Some(Stamp { time: Timestamp::now(), by: self.actor().who() });
            let v = v.clone();
            Ok((v, json!({"version": number, "from": from, "to": to, "at": at})))
        })
    }

    /// `version revert NAME V`: production → test, test → maintenance (newest only),
    /// maintenance → discarded.
    pub fn revert(&self, name: &str, number: u32) -> Result<Reverted> {
        self.update(name, "version.revert", |m| {
            let idx = m.versions.iter().position(|v| v.number == number).ok_or_else(|| no_version(m, number))?;
            if m.override_version == Some(number) {
                return Err(StoreError::Refused(format!(
                    "version {number} of {name} is the override production targets boot: clear it first (`vdstream version override {name} --clear`)")));
            }
            let newest = idx + 1 == m.versions.len();
            let v = &mut m.versions[idx];
            let from = v.access;
            let done = match from {
                Access::Production => {
                    v.access = Access::Test;
                    v.scheduled_at = None;
                    Reverted::To(Access::Test)
                }
                Access::Test if !newest => {
                    return Err(StoreError::Refused(format!(
                        "version {number} of {name} has newer versions on top of it; only the newest version can go back to maintenance")));
                }
                Access::Test => {
                    v.access = Access::Maintenance;
                    Reverted::To(Access::Maintenance)
                }
                Access::Maintenance => {
                    let v = m.versions.remove(idx);
                    m.retired.push(v.file);
                    Reverted::Discarded
                }
            };
            Ok((done, json!({"version": number, "from": from, "result": done})))
        })
    }

    /// `version override NAME V` pins what production targets boot; `None` clears it.
    pub fn set_override(&self, name: &str, number: Option<u32>) -> Result<Option<u32>> {
        self.update(name, "version.override", |m| {
            if let Some(n) = number {
                let v = m.version(n).ok_or_else(|| no_version(m, n))?;
                if v.access == Access::Maintenance {
                    return Err(StoreError::Refused(format!(
                        "version {n} of {name} is in maintenance; production can be pinned only to a test or production version")));
                }
            }
            let from = m.override_version;
            m.override_version = number;
            Ok((number, json!({"from": from, "to": number})))
        })
    }
}
