//! The metadata of a vDisk (`vdisks/NAME/vdisk.json`) and of the store (`store.json`):
//! the serde schema, loading with errors that name the file and the line, and the checks
//! that turn a parseable but impossible document into a "corrupt" error too.
//!
//! Invariants [`VdiskMeta::check`] enforces on every load and before every save:
//! - `versions` is in chain order (each layer's backing file is the one before it, the
//!   first one's is the base) and numbers are unique; a merged version carries a new
//!   number and may sit below versions with smaller numbers (numbers tell contents apart,
//!   the list gives the order);
//! - at most one version is in `maintenance`, and it is the newest;
//! - `next_version` is above every number ever used, so a number (and file name) is never
//!   reused, not even while a retired file of that name still waits to be deleted;
//! - `override` names an existing version that is not in maintenance;
//! - every file name is a plain name inside the vDisk's folder (no `/`);
//! - a `pending_merge` (a merge cut short between its steps, see merge.rs) names a number
//!   below `next_version`, merged versions that exist, and a version above them that exists.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{io, Result, StoreError};
use crate::time::Timestamp;

/// `format` of `vdisk.json`.
pub const VDISK_FORMAT: &str = "vdstream-vdisk";
/// `format` of `store.json`.
pub const STORE_FORMAT: &str = "vdstream-store";
/// The metadata format version this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;
/// `max_versions` when `vdisk create` is not told otherwise.
pub const DEFAULT_MAX_VERSIONS: u32 = 5;

/// How targets use a vDisk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum DiskAccess {
    /// Shared and read-only; every target writes to its own write cache.
    Standard,
    /// One target reads and writes the vDisk itself, with no cache and no versions.
    Private,
}

/// Who may see a version.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Access {
    /// Writable by one maintenance target; seen by nobody else.
    Maintenance,
    /// Seen by test targets.
    Test,
    /// Seen by production targets (from `scheduled_at`, when set).
    Production,
}

impl Access {
    pub fn name(self) -> &'static str {
        match self {
            Access::Maintenance => "maintenance",
            Access::Test => "test",
            Access::Production => "production",
        }
    }
}

/// The on-disk format of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum LayerFormat {
    Raw,
    Qcow2,
}

impl LayerFormat {
    pub fn image_format(self) -> vdstream_qcow2::ImageFormat {
        match self {
            LayerFormat::Raw => vdstream_qcow2::ImageFormat::Raw,
            LayerFormat::Qcow2 => vdstream_qcow2::ImageFormat::Qcow2,
        }
    }

    pub fn name(self) -> &'static str {
        self.image_format().name()
    }
}

pub use vdstream_contract::time::Stamp;

/// The bottom layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Base {
    pub file: String,
    pub format: LayerFormat,
    pub created: Timestamp,
    pub created_by: String,
}

/// One version: a qcow2 file over the layer below it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Version {
    pub number: u32,
    pub file: String,
    pub access: Access,
    pub created: Timestamp,
    pub created_by: String,
    /// The last promotion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promoted: Option<Stamp>,
    /// Production targets get this version only from this time on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduled_at: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// The versions a merge folded into this one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub merged_from: Vec<u32>,
}

/// `vdisks/NAME/vdisk.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VdiskMeta {
    pub format: String,
    pub format_version: u32,
    pub name: String,
    /// Guest size in bytes.
    pub size: u64,
    pub access: DiskAccess,
    pub max_versions: u32,
    pub base: Base,
    #[serde(default)]
    pub versions: Vec<Version>,
    pub next_version: u32,
    /// The version production targets boot, whatever else is promoted.
    #[serde(default, rename = "override", skip_serializing_if = "Option::is_none")]
    pub override_version: Option<u32>,
    /// Files no longer part of the vDisk, deleted as soon as nobody has them open.
    #[serde(default)]
    pub retired: Vec<String>,
    /// Bumped on every change; long operations check it did not move under them.
    pub generation: u64,
    pub created: Timestamp,
    pub created_by: String,
    /// A merge between its commit steps; present on disk only after a crash (see merge.rs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_merge: Option<PendingMerge>,
}

/// Which merge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum MergeKind {
    /// The versions up to production's into one new version over the same base.
    Updates,
    /// The base and the versions up to production's into a new (qcow2) base.
    Base,
}

/// A merge whose new layer is named before anything points at it, so that a crash between
/// the commit steps can be finished or undone by the next command (merge.rs, `recover`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PendingMerge {
    pub kind: MergeKind,
    pub automatic: bool,
    /// The versions folded in, bottom first (a base merge folds the base in too).
    pub merged: Vec<u32>,
    /// The number the merge took from `next_version`.
    pub number: u32,
    /// The new layer's file.
    pub file: String,
    /// The first version left above the merged ones, re-pointed onto `file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub above: Option<u32>,
    pub started: Timestamp,
}

/// `store.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreMeta {
    pub format: String,
    pub format_version: u32,
    pub created: Timestamp,
}

const VDISK_ADVICE: &str = "restore it from backup or re-import the vDisk";

impl VdiskMeta {
    /// The newest version, if any.
    pub fn newest(&self) -> Option<&Version> {
        self.versions.last()
    }

    pub fn version(&self, number: u32) -> Option<&Version> {
        self.versions.iter().find(|v| v.number == number)
    }

    pub fn version_mut(&mut self, number: u32) -> Option<&mut Version> {
        self.versions.iter_mut().find(|v| v.number == number)
    }

    /// The version in maintenance, if any (always the newest).
    pub fn maintenance(&self) -> Option<&Version> {
        self.versions
            .last()
            .filter(|v| v.access == Access::Maintenance)
    }

    /// Every file the vDisk uses, base first.
    pub fn live_files(&self) -> Vec<&str> {
        std::iter::once(self.base.file.as_str())
            .chain(self.versions.iter().map(|v| v.file.as_str()))
            .collect()
    }

    /// Checks the invariants listed at the top of this module.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.format != VDISK_FORMAT {
            return Err(format!("format is {:?}, not {VDISK_FORMAT:?}", self.format));
        }
        if self.format_version != FORMAT_VERSION {
            return Err(format!(
                "format_version {} is not {FORMAT_VERSION}, the one this vdstream reads",
                self.format_version
            ));
        }
        if self.max_versions == 0 {
            return Err("max_versions is 0".into());
        }
        let plain = |f: &str| !f.is_empty() && !f.contains('/') && f != "." && f != "..";
        for f in self
            .live_files()
            .into_iter()
            .chain(self.retired.iter().map(String::as_str))
        {
            if !plain(f) {
                return Err(format!("file name {f:?} is not a plain file name"));
            }
        }
        let mut last = 0;
        let mut seen = std::collections::BTreeSet::new();
        for (i, v) in self.versions.iter().enumerate() {
            if v.number == 0 || !seen.insert(v.number) {
                return Err(format!("version {} is listed twice (or is 0)", v.number));
            }
            last = last.max(v.number);
            if v.access == Access::Maintenance && i + 1 != self.versions.len() {
                return Err(format!(
                    "version {} is in maintenance but is not the newest",
                    v.number
                ));
            }
        }
        if self.next_version <= last {
            return Err(format!(
                "next_version {} is not above version {last}",
                self.next_version
            ));
        }
        if let Some(p) = &self.pending_merge {
            if !plain(&p.file) {
                return Err(format!(
                    "pending merge file {:?} is not a plain file name",
                    p.file
                ));
            }
            if p.number >= self.next_version {
                return Err(format!(
                    "pending merge number {} is not below next_version {}",
                    p.number, self.next_version
                ));
            }
            if let Some(n) = p
                .merged
                .iter()
                .chain(p.above.iter())
                .find(|&&n| self.version(n).is_none())
            {
                return Err(format!(
                    "pending merge names version {n}, which does not exist"
                ));
            }
        }
        if self.access == DiskAccess::Private && !self.versions.is_empty() {
            return Err("a private vDisk has versions".into());
        }
        if let Some(o) = self.override_version {
            match self.version(o) {
                None => return Err(format!("override names version {o}, which does not exist")),
                Some(v) if v.access == Access::Maintenance => {
                    return Err(format!(
                        "override names version {o}, which is in maintenance"
                    ))
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}

/// Reads and parses a JSON metadata file; a missing or unparsable file is an error naming
/// it (with line and column) and saying what to do.
pub fn load_json<T: for<'de> Deserialize<'de>>(path: &Path, advice: &str) -> Result<T> {
    let bytes = match vdstream_blockdev::storefile::open_read(path).and_then(|mut f| {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut f, &mut b).map(|_| b)
    }) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(StoreError::MissingFile {
                path: path.to_path_buf(),
                advice: advice.to_string(),
            })
        }
        Err(e) => return Err(io("read", path)(e)),
    };
    serde_json::from_slice(&bytes).map_err(|e| {
        let text = e.to_string();
        let what = text.split(" at line ").next().unwrap_or(&text);
        StoreError::Corrupt {
            path: path.to_path_buf(),
            detail: format!("line {}, column {}: {what}", e.line(), e.column()),
            advice: advice.to_string(),
        }
    })
}

/// Loads and checks `vdisk.json`.
pub fn load_vdisk(path: &Path, name: &str) -> Result<VdiskMeta> {
    let meta: VdiskMeta = load_json(path, VDISK_ADVICE)?;
    let corrupt = |detail: String| StoreError::Corrupt {
        path: path.to_path_buf(),
        detail,
        advice: VDISK_ADVICE.to_string(),
    };
    meta.check().map_err(corrupt)?;
    if meta.name != name {
        return Err(corrupt(format!(
            "it names vDisk {:?} but sits in the folder of {name:?}",
            meta.name
        )));
    }
    Ok(meta)
}

/// Loads and checks `store.json`.
pub fn load_store(path: &Path) -> Result<StoreMeta> {
    let advice = "restore it from backup, or write {\"format\": \"vdstream-store\", \"format_version\": 1, \"created\": \"<now, RFC 3339>\"} into it";
    let meta: StoreMeta = load_json(path, advice)?;
    if meta.format != STORE_FORMAT || meta.format_version != FORMAT_VERSION {
        return Err(StoreError::Corrupt {
            path: path.to_path_buf(),
            detail: format!(
                "format {:?} version {}, expected {STORE_FORMAT:?} version {FORMAT_VERSION}",
                meta.format, meta.format_version
            ),
            advice: advice.to_string(),
        });
    }
    Ok(meta)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample() -> VdiskMeta {
        let t = Timestamp(1_700_000_000);
        let v = |number, access| Version {
            number,
            file: format!("w.{number}.qcow2"),
            access,
            created: t,
            created_by: "root@h".into(),
            promoted: None,
            scheduled_at: None,
            note: None,
            merged_from: vec![],
        };
        VdiskMeta {
            format: VDISK_FORMAT.into(),
            format_version: FORMAT_VERSION,
            name: "w".into(),
            size: 64 << 20,
            access: DiskAccess::Standard,
            max_versions: 5,
            base: Base {
                file: "w.base.raw".into(),
                format: LayerFormat::Raw,
                created: t,
                created_by: "root@h".into(),
            },
            versions: vec![
                v(1, Access::Production),
                v(2, Access::Test),
                v(3, Access::Maintenance),
            ],
            next_version: 4,
            override_version: None,
            retired: vec![],
            generation: 1,
            created: t,
            created_by: "root@h".into(),
            pending_merge: None,
        }
    }

    #[test]
    fn metadata_round_trips_through_json() {
        let mut m = sample();
        m.versions[0].scheduled_at = Some(Timestamp(1_800_000_000));
        m.override_version = Some(1);
        let text = serde_json::to_string_pretty(&m).unwrap();
        assert!(
            text.contains("\"override\": 1") && text.contains("\"access\": \"maintenance\""),
            "{text}"
        );
        let back: VdiskMeta = serde_json::from_str(&text).unwrap();
        assert_eq!(back, m);
        back.check().unwrap();
    }

    #[test]
    fn impossible_documents_are_refused() {
        let mut m = sample();
        m.versions[1].number = 1;
        assert!(m.check().unwrap_err().contains("listed twice"));
        let mut m = sample();
        m.versions[1].access = Access::Maintenance;
        assert!(m.check().unwrap_err().contains("not the newest"));
        let mut m = sample();
        m.next_version = 3;
        assert!(m.check().unwrap_err().contains("next_version"));
        let mut m = sample();
        m.override_version = Some(3);
        assert!(m.check().unwrap_err().contains("maintenance"));
        let mut m = sample();
        m.versions[0].file = "../x".into();
        assert!(m.check().unwrap_err().contains("plain file name"));
    }

    #[test]
    fn corrupt_and_missing_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("vdisk.json");
        let e = load_vdisk(&p, "w").unwrap_err().to_string();
        assert!(
            e.contains("vdisk.json is missing") && e.contains("restore"),
            "{e}"
        );
        std::fs::write(
            &p,
            "{\n \"format\": \"vdstream-vdisk\",\n \"size\": oops\n}",
        )
        .unwrap();
        let e = load_vdisk(&p, "w").unwrap_err().to_string();
        assert!(
            e.contains("vdisk.json is corrupt (line 3, column 10: expected value)")
                && e.contains("re-import"),
            "{e}"
        );
        std::fs::write(&p, serde_json::to_vec(&sample()).unwrap()).unwrap();
        let e = load_vdisk(&p, "other").unwrap_err().to_string();
        assert!(e.contains("folder of \"other\""), "{e}");
    }
}
