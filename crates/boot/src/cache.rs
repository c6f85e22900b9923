//! The boot cache: a version's kernel and initramfs, built once, kept under the store.
//!
//! ```text
//! STORE/boot-cache/VDISK/TAG/.lock          flock: one builder per version at a time
//! STORE/boot-cache/VDISK/TAG/KEY/vmlinuz    the version's kernel
//! STORE/boot-cache/VDISK/TAG/KEY/initrd.img the initramfs
//! STORE/boot-cache/VDISK/TAG/KEY/kver       the kernel's version string
//! ```
//!
//! TAG is `base` or `vN`. KEY is a hash of everything the files depend on besides the
//! version's number: the version's top file (path, size, modification time: a maintenance
//! version changes), the `vdstream` binary and busybox named in the options (path, size,
//! modification time), the extra modules, and the /init and udhcpc scripts. A changed key
//! builds a new directory and removes the old ones of that version.
//!
//! Invariants: a KEY directory is complete when it exists (it is built under a temporary
//! name and renamed into place while the lock is held); readers never take the lock.

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The three files of a complete cache entry.
pub const KERNEL: &str = "vmlinuz";
pub const INITRD: &str = "initrd.img";
pub const KVER: &str = "kver";

/// Feeds a file's identity (path, size, modification time) into the key; a missing file
/// feeds its path only.
pub fn hash_file_id(h: &mut Sha256, p: &Path) {
    h.update(p.as_os_str().as_encoded_bytes());
    h.update([0]);
    if let Ok(m) = std::fs::metadata(p) {
        use std::os::unix::fs::MetadataExt;
        h.update(m.len().to_le_bytes());
        h.update(m.mtime().to_le_bytes());
        h.update(m.mtime_nsec().to_le_bytes());
        h.update(m.ino().to_le_bytes());
    }
}

/// The first 16 hex digits of a finished hash.
pub fn short_hex(h: Sha256) -> String {
    h.finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether `dir` holds a complete entry.
pub fn complete(dir: &Path) -> bool {
    [KERNEL, INITRD, KVER].iter().all(|f| dir.join(f).is_file())
}

/// An exclusive `flock` on a file, released when dropped.
#[derive(Debug)]
pub struct Lock {
    _file: File,
}

impl Lock {
    /// Waits for the exclusive lock on `path` (created if missing).
    pub fn exclusive(path: &Path) -> std::io::Result<Lock> {
        let f =
            vdstream_blockdev::storefile::open_rw(path, vdstream_blockdev::storefile::SHARED_READ)?;
        loop {
            // SAFETY: flock on a file descriptor this function owns for the call's length.
            let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
            if r == 0 {
                return Ok(Lock { _file: f });
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// Removes the other KEY directories (and leftovers of failed builds) of a version's
/// directory, keeping `keep`. Best effort: a file open elsewhere stays readable.
pub fn prune(version_dir: &Path, keep: &str) {
    let Ok(rd) = std::fs::read_dir(version_dir) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name != keep && name != ".lock" && e.path().is_dir() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// A temporary directory name for a build of `key` beside its final place.
pub fn temp_dir(version_dir: &Path, key: &str) -> PathBuf {
    version_dir.join(format!(".{key}.tmp-{}", std::process::id()))
}
