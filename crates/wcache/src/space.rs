//! Where a cache's bytes may go, and how much room is left there: the cache folder rule,
//! the free space of its file system (`statvfs`), the cache's real capacity and the percent
//! in use, and a rate limit for the log lines a full cache would otherwise repeat.
//!
//! Invariants:
//! - A cache folder the user names is created only when its parent exists: a typo such as
//!   `/nonexistent/dir` is refused with the path and what to do, never created with all
//!   its parents ([`prepare_cache_dir`]). Default folders the program picks may be created
//!   whole ([`DirRule::CreateAll`]).
//! - The capacity of a cache is the least of its configured limit and what its file system
//!   can still give it (`used + free`); `used_percent` is measured against that, never
//!   against the vDisk's size ([`Capacity`]).
//! - Space checks at attach warn while the free space is below what the cache may use, and
//!   refuse only below [`MIN_FREE`] (one cannot even hold one overflow unit and the
//!   metadata), unless the caller overrides.

use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::{CacheConfig, CacheType, StatsSnapshot};

/// Free bytes below which an attach (or `serve-image`) refuses a cache folder: 64 MiB,
/// room for a few 2 MiB overflow units, a persistent cache's journal reserve and its map.
pub const MIN_FREE: u64 = 64 << 20;

/// What went wrong with a cache folder; the message names the path and what to do.
#[derive(Debug, thiserror::Error)]
pub enum CacheDirError {
    #[error("the cache folder {dir} does not exist, nor does its parent {parent}: check the path for a typo, or create the parent first (mkdir -p {parent})")]
    NoParent { dir: PathBuf, parent: PathBuf },
    #[error("the cache folder {dir} exists but is not a folder: name a folder")]
    NotADir { dir: PathBuf },
    #[error("cannot create the cache folder {dir}: {source}; check its parent's permissions, or name another folder")]
    Create { dir: PathBuf, source: io::Error },
    #[error("cannot read the free space of {dir}: {source}")]
    Statvfs { dir: PathBuf, source: io::Error },
    #[error(
        "the file system of the cache folder {dir} has {free} bytes free, less than the {min} bytes a cache needs to start: \
         free space there, name another folder, or override the check (--allow-low-space)"
    )]
    TooLittleSpace { dir: PathBuf, free: u64, min: u64 },
}

/// How [`prepare_cache_dir`] may create a missing folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirRule {
    /// A folder the user named: created only when its parent exists (mode 0700).
    ParentMustExist,
    /// A default folder the program chose: created with its parents (mode 0700).
    CreateAll,
}

/// Makes sure `dir` is a folder a cache can use, creating it by `rule`. The one check every
/// cache-folder option goes through (`serve-image --overflow-dir`, `target attach
/// --overflow-dir`, the agent's default folder).
pub fn prepare_cache_dir(dir: &Path, rule: DirRule) -> Result<(), CacheDirError> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.as_os_str().is_empty() {
        return Ok(()); // the current folder
    }
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(_) => {
            return Err(CacheDirError::NotADir {
                dir: dir.to_path_buf(),
            })
        }
        Err(_) => {}
    }
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if rule == DirRule::ParentMustExist && !parent.is_dir() {
        return Err(CacheDirError::NoParent {
            dir: dir.to_path_buf(),
            parent,
        });
    }
    std::fs::DirBuilder::new()
        .recursive(rule == DirRule::CreateAll)
        .mode(0o700)
        .create(dir)
        .or_else(|e| {
            if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() {
                Ok(())
            } else {
                Err(e)
            }
        })
        .map_err(|source| CacheDirError::Create {
            dir: dir.to_path_buf(),
            source,
        })
}

/// Space of the file system that holds a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsSpace {
    /// Bytes an unprivileged writer may still take (`f_bavail`).
    pub free: u64,
    /// Size of the file system.
    pub total: u64,
}

/// `statvfs(2)` of the file system holding `path`.
pub fn fs_space(path: &Path) -> io::Result<FsSpace> {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: an all-zero statvfs is a valid value of this plain C struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path that outlives the call; `st` is a valid,
    // writable statvfs.
    let r = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    let unit = st.f_frsize as u64;
    Ok(FsSpace {
        free: (st.f_bavail as u64).saturating_mul(unit),
        total: (st.f_blocks as u64).saturating_mul(unit),
    })
}

/// Refuses `dir` when its file system has less than [`MIN_FREE`] free (unless `allow_low`),
/// and otherwise says, as a warning line, when it has less than `may_use` bytes free (what
/// the cache may grow to). `Ok(None)`: room enough.
pub fn check_free_space(
    dir: &Path,
    may_use: u64,
    allow_low: bool,
) -> Result<Option<String>, CacheDirError> {
    let space = fs_space(dir).map_err(|source| CacheDirError::Statvfs {
        dir: dir.to_path_buf(),
        source,
    })?;
    if space.free < MIN_FREE && !allow_low {
        return Err(CacheDirError::TooLittleSpace {
            dir: dir.to_path_buf(),
            free: space.free,
            min: MIN_FREE,
        });
    }
    Ok((space.free < may_use).then(|| {
        format!(
            "the file system of the cache folder {} has {} bytes free, less than the {may_use} bytes the cache may use \
             (its limit): the cache can grow by at most {} bytes, then writes to new blocks fail with ENOSPC; free space \
             there, or name a larger folder",
            dir.display(),
            space.free,
            space.free
        )
    }))
}

/// The most a cache's file (overflow or cache file) may grow to: `None` for the types
/// without one (`device-ram`, `private`).
pub fn file_limit(kind: CacheType, max_file: Option<u64>, vdisk_size: u64) -> Option<u64> {
    match kind {
        CacheType::DeviceRam | CacheType::Private => None,
        _ => Some(max_file.unwrap_or(vdisk_size)),
    }
}

/// The RAM budget a cache type uses (0 for the types without RAM pages).
pub fn ram_limit(kind: CacheType, ram: u64) -> u64 {
    if matches!(kind, CacheType::DeviceRam | CacheType::RamOverflow) {
        ram
    } else {
        0
    }
}

/// The check every attach and `serve-image` runs on a cache's folder before opening it:
/// the folder rule of [`prepare_cache_dir`] (with `rule`), then the free space of its file
/// system against what the cache may use. Refuses below [`MIN_FREE`] unless `allow_low` or
/// the cache is a persistent one that already exists (its data is there: a full file system
/// must not keep it from being served); `Ok(Some(warning))` when the cache may outgrow the
/// free space. Types without a file (`device-ram`, `private`) have no folder to check
/// (`Ok(None)`).
pub fn check_cache_room(
    kind: CacheType,
    cfg: &CacheConfig,
    rule: DirRule,
    vdisk_size: u64,
    allow_low: bool,
) -> Result<Option<String>, CacheDirError> {
    let Some(may_use) = file_limit(kind, cfg.max_file, vdisk_size) else {
        return Ok(None);
    };
    prepare_cache_dir(&cfg.dir, rule)?;
    let existing =
        kind.is_persistent() && crate::names::cache_paths(&cfg.dir, &cfg.target)[1].exists();
    check_free_space(&cfg.dir, may_use, allow_low || existing)
}

/// What a cache can hold, and how full it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capacity {
    /// The configured limit: RAM budget plus the file's cap (or the vDisk's size without one).
    pub limit: u64,
    /// Free bytes on the file system of the cache's file; `None` for RAM-only caches or when
    /// `statvfs` failed.
    pub fs_free: Option<u64>,
    /// The least of `limit` and what the file system can still give: RAM limit + min(file
    /// limit, file used + free).
    pub capacity: u64,
    /// RAM + file in use.
    pub used: u64,
}

impl Capacity {
    /// Of a cache of `kind` configured with `ram` and `max_file`, over a vDisk of
    /// `vdisk_size` bytes, with its file in `dir`, using what `stats` say. The one place
    /// `used_percent` comes from (agent status, `serve-image`'s exit report).
    pub fn of(
        kind: CacheType,
        ram: u64,
        max_file: Option<u64>,
        dir: &Path,
        vdisk_size: u64,
        stats: &StatsSnapshot,
    ) -> Capacity {
        let file = file_limit(kind, max_file, vdisk_size);
        let fs_free = file.and_then(|_| fs_space(dir).ok()).map(|s| s.free);
        Capacity::new(
            ram_limit(kind, ram),
            stats.ram_bytes,
            file.unwrap_or(0),
            stats.file_bytes,
            fs_free,
        )
    }

    /// From the limits and use of the RAM and file parts and the free space of the file's
    /// file system (ignored when the file limit is 0: RAM only).
    pub fn new(
        ram_limit: u64,
        ram_used: u64,
        file_limit: u64,
        file_used: u64,
        fs_free: Option<u64>,
    ) -> Capacity {
        let fs_free = fs_free.filter(|_| file_limit > 0);
        let file_room = fs_free.map_or(file_limit, |f| file_limit.min(file_used.saturating_add(f)));
        Capacity {
            limit: ram_limit.saturating_add(file_limit),
            fs_free,
            capacity: ram_limit.saturating_add(file_room),
            used: ram_used.saturating_add(file_used),
        }
    }

    /// Percent of the capacity in use (0 when there is no capacity), one decimal.
    pub fn used_percent(&self) -> f64 {
        if self.capacity == 0 {
            return 0.0;
        }
        (self.used as f64 * 1000.0 / self.capacity as f64).round() / 10.0
    }
}

/// How often a full cache repeats its log line.
pub const FULL_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// The limiter of a cache's "file system full" lines: one a minute per kind.
pub fn full_log() -> vdstream_blockdev::lograte::LogLimiter {
    vdstream_blockdev::lograte::LogLimiter::every(FULL_LOG_EVERY)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_is_the_least_of_the_limit_and_the_free_space() {
        // 10 GiB cap, 1 GiB used, 2 GiB free: 3 GiB can be held, a third is used.
        let c = Capacity::new(0, 0, 10 << 30, 1 << 30, Some(2 << 30));
        assert_eq!((c.limit, c.capacity, c.used), (10 << 30, 3 << 30, 1 << 30));
        assert_eq!(c.used_percent(), 33.3);
        // Plenty of free space: the cap rules.
        let c = Capacity::new(0, 0, 4 << 20, 1 << 20, Some(1 << 40));
        assert_eq!((c.capacity, c.used_percent()), (4 << 20, 25.0));
        // RAM plus file: RAM counts whole; the file part is bounded by the disk.
        let c = Capacity::new(256 << 20, 256 << 20, 1 << 30, 0, Some(256 << 20));
        assert_eq!((c.capacity, c.used_percent()), (512 << 20, 50.0));
        // RAM only: free space does not matter.
        let c = Capacity::new(64 << 20, 16 << 20, 0, 0, Some(0));
        assert_eq!(
            (c.fs_free, c.capacity, c.used_percent()),
            (None, 64 << 20, 25.0)
        );
        // A full file system: the cache is 100% used.
        let c = Capacity::new(0, 0, 1 << 30, 8 << 20, Some(0));
        assert_eq!(c.used_percent(), 100.0);
        assert_eq!(Capacity::default().used_percent(), 0.0);
    }

    #[test]
    fn a_named_cache_folder_needs_its_parent() {
        let tmp = tempfile::tempdir().unwrap();
        let typo = tmp.path().join("nonexistent").join("dir");
        let err = prepare_cache_dir(&typo, DirRule::ParentMustExist).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&typo.display().to_string()) && msg.contains("mkdir -p"),
            "{msg}"
        );
        assert!(
            !typo.exists() && !typo.parent().unwrap().exists(),
            "nothing may be created"
        );
        // Parent exists: created, private.
        let ok = tmp.path().join("cache");
        prepare_cache_dir(&ok, DirRule::ParentMustExist).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&ok).unwrap().permissions().mode() & 0o777,
            0o700
        );
        // Existing folder: fine; a file: refused.
        prepare_cache_dir(&ok, DirRule::ParentMustExist).unwrap();
        let file = tmp.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(
            prepare_cache_dir(&file, DirRule::ParentMustExist),
            Err(CacheDirError::NotADir { .. })
        ));
        // A default folder is created whole.
        prepare_cache_dir(&typo, DirRule::CreateAll).unwrap();
        assert!(typo.is_dir());
    }

    #[test]
    fn free_space_is_read_and_checked() {
        let tmp = tempfile::tempdir().unwrap();
        let s = fs_space(tmp.path()).unwrap();
        assert!(s.total > 0 && s.free <= s.total);
        let warn = check_free_space(tmp.path(), u64::MAX, true)
            .unwrap()
            .expect("nothing has that much room");
        assert!(warn.contains(&tmp.path().display().to_string()), "{warn}");
        assert!(check_free_space(tmp.path(), 0, true).unwrap().is_none());
        assert!(fs_space(&tmp.path().join("missing")).is_err());
    }

    #[test]
    fn the_room_check_skips_ram_caches_and_refuses_a_typo() {
        let tmp = tempfile::tempdir().unwrap();
        let typo = tmp.path().join("no").join("dir");
        let cfg = CacheConfig {
            dir: typo.clone(),
            ..CacheConfig::new("t")
        };
        assert!(check_cache_room(
            CacheType::DeviceRam,
            &cfg,
            DirRule::ParentMustExist,
            1 << 30,
            false
        )
        .unwrap()
        .is_none());
        assert!(!typo.exists());
        let err = check_cache_room(
            CacheType::RamOverflow,
            &cfg,
            DirRule::ParentMustExist,
            1 << 30,
            false,
        )
        .unwrap_err();
        assert!(matches!(err, CacheDirError::NoParent { .. }), "{err}");
        let cfg = CacheConfig {
            dir: tmp.path().join("ok"),
            max_file: Some(1 << 20),
            ..CacheConfig::new("t")
        };
        check_cache_room(
            CacheType::DeviceDisk,
            &cfg,
            DirRule::ParentMustExist,
            1 << 50,
            true,
        )
        .unwrap();
        assert!(cfg.dir.is_dir());
    }
}
