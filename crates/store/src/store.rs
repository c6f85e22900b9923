//! [`Store`]: the store directory, its lock, and metadata transactions.
//!
//! ```text
//! STORE/store.json               format marker and version
//! STORE/.lock                    flock: shared to read metadata, exclusive to change it
//! STORE/audit.log                JSON lines, see audit.rs
//! STORE/vdisks/NAME/vdisk.json   see meta.rs
//! STORE/vdisks/NAME/NAME.base.{raw,qcow2}, NAME.N.qcow2, NAME.base-N.qcow2
//! ```
//!
//! Invariants:
//! - Every change of metadata is one [`Store::update`]: under the exclusive lock, load,
//!   change, check, write atomically, append to the audit trail. Two processes can
//!   never lose each other's change.
//! - Files are opened for serving under the shared lock (see open.rs), and a retired file
//!   is deleted only under the exclusive lock and only when nobody holds a `flock` on it,
//!   so a file still read by a target is never deleted under it. Every update retries the
//!   retired files of the vDisk it changes; `vdisk gc` retries all of them.

use std::fs::File;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::audit::{self, AuditEntry};
use crate::error::{io, Result, StoreError};
use crate::fsutil::{self, Actor, LockMode};
use crate::meta::{self, StoreMeta, VdiskMeta, FORMAT_VERSION, STORE_FORMAT};
use crate::names::validate_name;
use crate::time::Timestamp;

/// The file that marks a folder as a server's mirror of a store in object storage: its
/// metadata comes from there, so changes made in it are refused.
pub const MIRROR_MARKER: &str = "mirror.json";

/// Where the store is when neither `--store` nor `$VDSTREAM_STORE` says.
pub const DEFAULT_STORE: &str = "/var/lib/vdstream/store";

/// The store directory from `--store`, else `$VDSTREAM_STORE`, else [`DEFAULT_STORE`].
/// `file:///PATH` is taken as `/PATH`; any other `SCHEME://` is left as it is, for
/// [`check_location`] (called by [`Store::open`] and friends) to refuse.
pub fn store_dir(flag: Option<&Path>) -> PathBuf {
    let p = match flag {
        Some(p) => p.to_path_buf(),
        None => std::env::var_os("VDSTREAM_STORE")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_STORE)),
    };
    match p.to_str().and_then(|s| s.strip_prefix("file://")) {
        Some(rest) if rest.starts_with('/') => PathBuf::from(rest),
        _ => p,
    }
}

/// The schemes a store location may have: a plain path, or `file:///PATH`.
pub const STORE_SCHEMES: &str =
    "a local folder, given as a path (/srv/vdstream) or as file:///srv/vdstream";

/// Refuses a store location with a URL scheme vdstream does not serve (`s3://…`,
/// `http://…`, `file://` with a relative path), before anything is created: the store
/// is a local folder, and `s3://bucket` would otherwise become a folder named `s3:`.
/// The topmost folder of `dir`'s path that does not exist yet (`dir` itself when only it is
/// missing; `None` when it exists): what creating `dir` with its parents would create.
pub fn first_missing_dir(dir: &Path) -> Option<PathBuf> {
    if dir.exists() {
        return None;
    }
    let mut top = dir.to_path_buf();
    while let Some(parent) = top
        .parent()
        .filter(|p| !p.as_os_str().is_empty() && !p.exists())
    {
        top = parent.to_path_buf();
    }
    Some(top)
}

/// Removes `dir` and its parents up to and including `top`, stopping at the first one
/// that is not empty (or cannot be removed).
pub fn remove_empty_dirs(dir: &Path, top: &Path) {
    let mut d = dir;
    while std::fs::remove_dir(d).is_ok() && d != top {
        match d.parent() {
            Some(p) if d.starts_with(top) => d = p,
            _ => break,
        }
    }
}

pub fn check_location(root: &Path) -> Result<()> {
    let Some(text) = root.to_str() else {
        return Ok(());
    };
    if let Some((scheme, _)) = text.split_once("://") {
        let is_scheme = !scheme.is_empty()
            && scheme
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic())
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
        if is_scheme {
            return Err(StoreError::BadInput(format!(
                "store {text:?}: this command works on {STORE_SCHEMES} (--store DIR or VDSTREAM_STORE); an s3:// store is served by `vdstream server --store s3://BUCKET/PREFIX`, changed by the one started with --metadata-writer (and by the commands on its host), and filled by `vdstream store copy`")));
        }
    }
    Ok(())
}

/// `STORE/cache/`, created if missing: the server-side write caches (`server`,
/// `server-persistent`), one set of files per target, named after it. `serve-image --vdisk`
/// and the store server's `target/ID` exports keep them there.
pub fn server_cache_dir(root: &Path) -> std::io::Result<PathBuf> {
    check_location(root)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    let dir = root.join("cache");
    vdstream_blockdev::storefile::create_dir_all(&dir).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!(
                "cannot create the store's cache folder {}: {e}",
                dir.display()
            ),
        )
    })?;
    Ok(dir)
}

/// An open store.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
    actor: Actor,
    /// The generation of the vDisk's metadata a change was decided on (see
    /// [`Store::expecting`]).
    expect: Option<u64>,
}

/// A held store lock; released on drop.
#[derive(Debug)]
pub struct StoreLock {
    _file: File,
}

impl Store {
    /// Opens an existing store.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self> {
        let root = root.into();
        check_location(&root)?;
        let marker = root.join("store.json");
        if !marker.exists() {
            return Err(StoreError::NoStore { dir: root });
        }
        meta::load_store(&marker)?;
        Ok(Store {
            root,
            actor: Actor::current(),
            expect: None,
        })
    }

    /// Opens the store, creating it when there is none; `true` when it was created.
    pub fn open_or_create(root: impl Into<PathBuf>) -> Result<(Self, bool)> {
        let root = root.into();
        check_location(&root)?;
        if root.join("store.json").exists() {
            return Ok((Self::open(root)?, false));
        }
        fsutil::create_dir_all(&root.join("vdisks"))?;
        let store = Store {
            root: root.clone(),
            actor: Actor::current(),
            expect: None,
        };
        let _lock = store.lock(LockMode::Exclusive)?;
        let marker = root.join("store.json");
        if marker.exists() {
            return Ok((Self::open(root)?, false));
        }
        let m = StoreMeta {
            format: STORE_FORMAT.into(),
            format_version: FORMAT_VERSION,
            created: Timestamp::now(),
        };
        fsutil::write_atomic(&marker, &serde_json::to_vec_pretty(&m).expect("serializes"))?;
        Ok((store, true))
    }

    /// Undoes [`Store::open_or_create`] for a command that created the store and then
    /// failed, so that a failed command leaves nothing behind: removes the store's own
    /// entries (`vdisks/`, `store.json`, `audit.log`, `.lock`), then the store folder and
    /// each folder above it up to `created_from` (the topmost folder the command created;
    /// `None`: the folder existed before, so it stays), each only while it is empty.
    /// Nothing is removed while `vdisks/` holds anything (a vDisk another command made in
    /// the meantime): `Ok(false)` then.
    pub fn remove_new(self, created_from: Option<&Path>) -> Result<bool> {
        {
            let _lock = self.lock(LockMode::Exclusive)?;
            let vdisks = self.root.join("vdisks");
            match std::fs::remove_dir(&vdisks) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                // (ErrorKind::DirectoryNotEmpty needs Rust 1.83; the workspace supports 1.80.)
                Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => return Ok(false),
                Err(e) => return Err(io("remove the new store's vdisks folder", &vdisks)(e)),
            }
            for f in ["store.json", "audit.log", ".lock"] {
                let p = self.root.join(f);
                match std::fs::remove_file(&p) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io("remove a file of the new store", &p)(e)),
                }
            }
        }
        if let Some(top) = created_from {
            remove_empty_dirs(&self.root, top);
        }
        Ok(true)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The same store, with changes recorded in the audit trail as made for `client` (the
    /// address of an API client, `ip:port`).
    pub fn with_client(mut self, client: impl Into<String>) -> Self {
        self.actor.client = Some(client.into());
        self
    }

    /// The same store, whose changes to a vDisk are refused ([`StoreError::Changed`]) unless
    /// its metadata is still at `generation` when the change takes the lock: two admins (or
    /// two servers) deciding on what they read cannot both act, one gets a conflict.
    pub fn expecting(mut self, generation: Option<u64>) -> Self {
        self.expect = generation;
        self
    }

    pub fn actor(&self) -> &Actor {
        &self.actor
    }

    /// Takes the store lock, waiting for it.
    pub fn lock(&self, mode: LockMode) -> Result<StoreLock> {
        if mode == LockMode::Exclusive && self.root.join(MIRROR_MARKER).exists() {
            return Err(StoreError::Refused(format!(
                "{} is a server's mirror of a store in object storage (see its {MIRROR_MARKER}): the mirror serves, it is not changed; \
                 changes go to the store's metadata writer (its API, which this server's API forwards to, or any command given \
                 --store s3://BUCKET/PREFIX on the writer's host)",
                self.root.display())));
        }
        let p = self.root.join(".lock");
        let f = vdstream_blockdev::storefile::open_rw(&p, fsutil::SHARED_READ)
            .map_err(io("open the store lock", &p))?;
        fsutil::lock_wait(&f, mode).map_err(io("lock", &p))?;
        Ok(StoreLock { _file: f })
    }

    pub fn vdisk_dir(&self, name: &str) -> PathBuf {
        self.root.join("vdisks").join(name)
    }

    /// The path of a file of vDisk `name`.
    pub fn file_path(&self, name: &str, file: &str) -> PathBuf {
        self.vdisk_dir(name).join(file)
    }

    pub fn audit_path(&self) -> PathBuf {
        self.root.join("audit.log")
    }

    /// Names of the vDisks, sorted (folders whose name is not a valid vDisk name are skipped).
    pub fn names(&self) -> Result<Vec<String>> {
        let dir = self.root.join("vdisks");
        let mut out = Vec::new();
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(io("list", &dir)(e)),
        };
        for e in entries {
            let e = e.map_err(io("list", &dir))?;
            let name = e.file_name().to_string_lossy().into_owned();
            if validate_name(&name).is_ok() && e.path().is_dir() {
                out.push(name);
            }
        }
        out.sort();
        Ok(out)
    }

    /// Loads `vdisk.json` of `name`; the caller holds the lock.
    pub fn load(&self, name: &str) -> Result<VdiskMeta> {
        validate_name(name)?;
        // A vDisk's folder replaced by a link would lead every file below it elsewhere.
        vdstream_blockdev::storefile::refuse_symlinked_dir(&self.vdisk_dir(name))
            .map_err(io("open the vDisk folder", &self.vdisk_dir(name)))?;
        if !self.vdisk_dir(name).is_dir() {
            let names = self.names()?;
            let known = if names.is_empty() {
                "the store has no vDisks yet; create one with `vdstream vdisk create` or `vdstream vdisk import`".to_string()
            } else {
                format!("known vDisks: {}", names.join(", "))
            };
            return Err(StoreError::UnknownVdisk {
                name: name.into(),
                store: self.root.clone(),
                known,
            });
        }
        meta::load_vdisk(&self.vdisk_dir(name).join("vdisk.json"), name)
    }

    /// Loads `name` for a change; the caller holds the exclusive lock. A merge cut short by
    /// a crash (`pending_merge`) is finished or undone first (merge.rs, `recover`).
    pub(crate) fn load_for_change(&self, name: &str) -> Result<VdiskMeta> {
        let mut meta = self.load(name)?;
        if let Some(expected) = self.expect.filter(|g| *g != meta.generation) {
            return Err(StoreError::Changed {
                vdisk: name.to_string(),
                expected,
                now: meta.generation,
            });
        }
        if meta.pending_merge.is_some() {
            self.recover(&mut meta)?;
        }
        Ok(meta)
    }

    /// Loads `name` under the shared lock.
    pub fn get(&self, name: &str) -> Result<VdiskMeta> {
        let _l = self.lock(LockMode::Shared)?;
        self.load(name)
    }

    /// Every vDisk, each loaded or with the error that stopped it.
    pub fn list(&self) -> Result<Vec<(String, Result<VdiskMeta>)>> {
        let _l = self.lock(LockMode::Shared)?;
        Ok(self
            .names()?
            .into_iter()
            .map(|n| {
                let m = self.load(&n);
                (n, m)
            })
            .collect())
    }

    /// Writes `meta` (checked, generation bumped) atomically; the caller holds the lock.
    pub(crate) fn save(&self, meta: &mut VdiskMeta) -> Result<()> {
        meta.generation += 1;
        let path = self.vdisk_dir(&meta.name).join("vdisk.json");
        meta.check().map_err(|detail| StoreError::Corrupt {
            path: path.clone(),
            detail: format!("refusing to write it: {detail}"),
            advice: "this is a bug in vdstream; nothing was changed".into(),
        })?;
        fsutil::write_atomic(&path, &serde_json::to_vec_pretty(meta).expect("serializes"))
    }

    /// Records an event that changes nothing in the store (a refused NBD open) in the audit
    /// trail, under the exclusive lock like every other line.
    pub fn audit_event(&self, action: &str, vdisk: &str, details: Value) -> Result<()> {
        let _l = self.lock(LockMode::Exclusive)?;
        self.audit(action, vdisk, details)
    }

    /// Appends to the audit trail; the caller holds the exclusive lock.
    pub(crate) fn audit(&self, action: &str, vdisk: &str, details: Value) -> Result<()> {
        audit::append(
            &self.audit_path(),
            &AuditEntry::new(&self.actor, action, vdisk, details),
        )
    }

    /// One metadata transaction on vDisk `name`: `change` edits the metadata and returns
    /// its result and the audit details; then retired files nobody uses are deleted, the
    /// metadata is saved if it changed, and `action` is audited.
    pub fn update<T>(
        &self,
        name: &str,
        action: &str,
        change: impl FnOnce(&mut VdiskMeta) -> Result<(T, Value)>,
    ) -> Result<T> {
        let _l = self.lock(LockMode::Exclusive)?;
        let mut meta = self.load_for_change(name)?;
        let before = meta.clone();
        let (out, details) = change(&mut meta)?;
        self.collect_retired(&mut meta)?;
        if meta != before {
            self.save(&mut meta)?;
        }
        self.audit(action, name, details)?;
        Ok(out)
    }

    /// Deletes the retired files of `meta` that no process holds; keeps the rest listed.
    /// Returns the deleted names. The caller holds the exclusive lock.
    pub(crate) fn collect_retired(&self, meta: &mut VdiskMeta) -> Result<Vec<String>> {
        let mut deleted = Vec::new();
        let mut kept = Vec::new();
        for f in std::mem::take(&mut meta.retired) {
            let p = self.file_path(&meta.name, &f);
            if fsutil::in_use(&p)? {
                kept.push(f);
                continue;
            }
            match std::fs::remove_file(&p) {
                Ok(()) => deleted.push(f),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => deleted.push(f),
                Err(e) => {
                    log::warn!(
                        "cannot delete retired file {}: {e}; will retry",
                        p.display()
                    );
                    kept.push(f);
                }
            }
        }
        meta.retired = kept;
        Ok(deleted)
    }

    /// `vdisk gc`: retries every retired file of every vDisk, deletes layer files the
    /// metadata does not list (left by a command that crashed between writing a file and
    /// saving the metadata) once nobody holds them, and removes temporary files left by
    /// processes that died. Returns `(vdisk, file)` for each file deleted.
    pub fn gc(&self) -> Result<Vec<(String, String)>> {
        let _l = self.lock(LockMode::Exclusive)?;
        let mut out = Vec::new();
        for name in self.names()? {
            let mut meta = self.load_for_change(&name)?;
            let mut deleted = self.collect_retired(&mut meta)?;
            let retired_changed = !deleted.is_empty();
            deleted.extend(self.remove_orphans(&meta)?);
            if retired_changed {
                self.save(&mut meta)?;
            }
            if !deleted.is_empty() {
                self.audit("vdisk.gc", &name, serde_json::json!({ "deleted": deleted }))?;
            }
            out.extend(deleted.into_iter().map(|f| (name.clone(), f)));
            out.extend(
                remove_stale_temps(&self.vdisk_dir(&name))
                    .into_iter()
                    .map(|f| (name.clone(), f)),
            );
        }
        out.extend(
            remove_stale_temps(&self.root.join("vdisks"))
                .into_iter()
                .map(|f| (String::new(), f)),
        );
        Ok(out)
    }
}

impl Store {
    /// Layer files of `meta`'s folder (`NAME.*.qcow2`, `NAME.*.raw`) that the metadata
    /// lists nowhere (base, versions, retired, a pending merge) and nobody holds: deleted.
    /// Under the exclusive lock, where every command that makes such a file lists it
    /// before letting the lock go, so an unlisted file is a crash's leftover.
    fn remove_orphans(&self, meta: &VdiskMeta) -> Result<Vec<String>> {
        let dir = self.vdisk_dir(&meta.name);
        let mut listed: Vec<&str> = vec![meta.base.file.as_str()];
        listed.extend(meta.versions.iter().map(|v| v.file.as_str()));
        listed.extend(meta.retired.iter().map(String::as_str));
        listed.extend(meta.pending_merge.iter().map(|p| p.file.as_str()));
        let mut out = Vec::new();
        let prefix = format!("{}.", meta.name);
        for e in std::fs::read_dir(&dir).map_err(io("list", &dir))? {
            let e = e.map_err(io("list", &dir))?;
            let file = e.file_name().to_string_lossy().into_owned();
            let layer_like =
                file.starts_with(&prefix) && (file.ends_with(".qcow2") || file.ends_with(".raw"));
            if !layer_like
                || listed.contains(&file.as_str())
                || !e.file_type().is_ok_and(|t| t.is_file())
            {
                continue;
            }
            let p = e.path();
            if fsutil::in_use(&p)? {
                log::warn!(
                    "{} is not listed in the metadata of {} but is open ({}); kept",
                    p.display(),
                    meta.name,
                    fsutil::describe_holders(&p)
                );
                continue;
            }
            match std::fs::remove_file(&p) {
                Ok(()) => out.push(file),
                Err(e) => log::warn!(
                    "cannot delete {}, which the metadata of {} does not list: {e}",
                    p.display(),
                    meta.name
                ),
            }
        }
        Ok(out)
    }
}

/// Whether process `pid` runs and started before `mtime` (so it may be the one that
/// wrote a file last modified then). A process that started later has only reused the
/// pid of the dead writer.
fn writer_alive(pid: i32, mtime: Option<std::time::SystemTime>) -> bool {
    // SAFETY: kill with signal 0 only checks whether the process exists.
    let exists = unsafe { libc::kill(pid, 0) } == 0
        || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    if !exists {
        return false;
    }
    match (mtime, process_start(pid)) {
        // One second of slack: /proc gives the start in clock ticks, mtime may be coarse.
        (Some(m), Some(start)) => m + std::time::Duration::from_secs(1) >= start,
        _ => true,
    }
}

/// When process `pid` started, from `/proc/PID/stat` (field 22, clock ticks after boot)
/// and `btime` of `/proc/stat`.
fn process_start(pid: i32) -> Option<std::time::SystemTime> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: fields after ')'.
    let ticks: u64 = stat
        .rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()?;
    let btime: u64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())?;
    // SAFETY: sysconf takes an integer and reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as u64 } else { 100 };
    Some(
        std::time::UNIX_EPOCH
            + std::time::Duration::from_secs(btime)
            + std::time::Duration::from_millis(ticks * 1000 / hz),
    )
}

/// Removes `.X.tmp-PID` files and `.X.import-PID` folders whose process is gone (or whose
/// pid now belongs to a process that started after the file was last written).
fn remove_stale_temps(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with('.') {
            continue;
        }
        let Some(pid) = name.rsplit_once("-").and_then(|(head, pid)| {
            (head.ends_with(".tmp") || head.ends_with(".import"))
                .then(|| pid.parse::<i32>().ok())
                .flatten()
        }) else {
            continue;
        };
        let p = e.path();
        if pid == std::process::id() as i32
            || writer_alive(
                pid,
                std::fs::symlink_metadata(&p)
                    .and_then(|m| m.modified())
                    .ok(),
            )
        {
            continue;
        }
        let ok = if p.is_dir() {
            std::fs::remove_dir_all(&p).is_ok()
        } else {
            std::fs::remove_file(&p).is_ok()
        };
        if ok {
            out.push(name);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_is_a_local_folder_and_other_schemes_are_refused_before_anything_is_made() {
        let dir = tempfile::tempdir().unwrap();
        let cwd = std::env::current_dir().unwrap();
        for bad in [
            "s3://bucket/prefix",
            "http://host/x",
            "nfs://srv/export",
            "file://relative/x",
        ] {
            let e = Store::open_or_create(bad).unwrap_err();
            assert!(matches!(e, StoreError::BadInput(_)), "{bad}: {e}");
            let text = e.to_string();
            assert!(
                text.contains(bad.split("://").next().unwrap())
                    && text.contains("file:///")
                    && text.contains("local folder"),
                "{text}"
            );
            assert!(
                Store::open(bad).is_err() && server_cache_dir(Path::new(bad)).is_err(),
                "{bad}"
            );
        }
        assert!(
            !cwd.join("s3:").exists() && !cwd.join("http:").exists(),
            "a refused location made a folder"
        );
        let url = format!("file://{}", dir.path().join("s").display());
        let root = store_dir(Some(Path::new(&url)));
        assert_eq!(root, dir.path().join("s"));
        let (s, created) = Store::open_or_create(&root).unwrap();
        assert!(created && s.root().join("store.json").is_file());
        check_location(Path::new("/srv/a:b/c")).unwrap();
        check_location(Path::new("relative/dir")).unwrap();
    }
}
