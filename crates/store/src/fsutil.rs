//! File-system primitives of the store: atomic replacement of a file, `flock` locks, who
//! holds a lock (from `/proc/locks`), and who is acting (user, host, pid).
//!
//! Every store file is opened here or through [`vdstream_blockdev::storefile`]: without
//! following a symbolic link (one is refused, by name), and created with an owner-only
//! mode whatever the umask ([`SHARED_READ`] for metadata and layers, [`PRIVATE`] for
//! secrets and a target's writes, [`FOLDER`] for folders).
//!
//! Atomic write: the bytes go to a temporary file in the same folder, which is fsynced,
//! renamed over the target, and the folder is fsynced, so a reader (or a crash) sees the
//! old file or the new one, never a mix.
//!
//! Locks are `flock` locks, which belong to an open file description: they are released
//! when the `File` is dropped or the process dies, so a crash never leaves a stale lock.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{io, Result};
use vdstream_blockdev::storefile;
pub use vdstream_blockdev::storefile::{FOLDER, PRIVATE, SHARED_READ};

/// Writes `bytes` to `path` atomically (tmp, fsync, rename, fsync folder), the file
/// readable by the owner's group ([`SHARED_READ`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_mode(path, bytes, SHARED_READ)
}

/// [`write_atomic`] with the file's mode (the umask can only take bits away).
pub fn write_atomic_mode(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        // Made afresh: a leftover of a crash, or a link planted in its place, goes first.
        let mut f = storefile::create_fresh(&tmp, mode).map_err(io("create", &tmp))?;
        f.write_all(bytes).map_err(io("write", &tmp))?;
        f.sync_all().map_err(io("fsync", &tmp))?;
        std::fs::rename(&tmp, path).map_err(io("rename into place", path))?;
        sync_dir(dir)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// fsyncs a folder, so renames and creations in it are durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("fsync folder", dir))
}

/// Opens a store file read-only, without following a link.
pub fn open_read(path: &Path) -> Result<File> {
    storefile::open_read(path).map_err(io("open", path))
}

/// Copies store file `src` to a new file `dst` (which must not exist) with the same
/// permission bits, neither path followed if it is a link; fsyncs the copy.
pub fn copy_file(src: &Path, dst: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut from = open_read(src)?;
    let mode = from
        .metadata()
        .map_err(io("stat", src))?
        .permissions()
        .mode()
        & 0o777;
    let mut to = storefile::create_new(dst, mode & SHARED_READ).map_err(io("create", dst))?;
    std::io::copy(&mut from, &mut to).map_err(io("copy into", dst))?;
    to.sync_all().map_err(io("fsync", dst))
}

/// Takes away the permission bits store file `path` has beyond `mode` (a file another
/// program made, such as qemu-img's output, with the umask's mode).
pub fn restrict(path: &Path, mode: u32) -> Result<()> {
    let f = open_read(path)?;
    storefile::tighten(&f, mode)
        .map(|_| ())
        .map_err(io("set the mode of", path))
}

/// Creates a store folder and its missing parents ([`FOLDER`] mode), refusing a link.
pub fn create_dir_all(dir: &Path) -> Result<()> {
    storefile::create_dir_all(dir).map_err(io("create the folder", dir))
}

use vdstream_blockdev::flock::{self, LOCK_PATIENCE};
pub use vdstream_blockdev::flock::{lock_wait, LockMode};

/// Tries a lock on `file` without waiting: `Ok(false)` when another open file holds a
/// conflicting one. For probes ("is anyone using this?").
pub fn try_lock(file: &File, mode: LockMode) -> std::io::Result<bool> {
    flock::try_lock(file, mode, std::time::Duration::ZERO)
}

/// Takes a lock on `file` for this process's own use: like [`try_lock`], but a conflict
/// that clears within [`LOCK_PATIENCE`] (a forked child on its way to `exec` holding a
/// copy of a descriptor whose lock was just released) is waited out.
pub fn take_lock(file: &File, mode: LockMode) -> std::io::Result<bool> {
    flock::try_lock(file, mode, LOCK_PATIENCE)
}

/// Opens `path` and takes a shared lock on it, so that the store does not delete it while
/// this process uses it. `Ok(None)` when a writer holds it exclusively.
pub fn hold_shared(path: &Path) -> Result<Option<File>> {
    let f = open_read(path)?;
    Ok(
        if take_lock(&f, LockMode::Shared).map_err(io("lock", path))? {
            Some(f)
        } else {
            None
        },
    )
}

/// Whether some process holds a lock on `path` (tried without waiting, released at once).
/// Call it only under the store's exclusive lock, where no opener of store files runs.
pub fn in_use(path: &Path) -> Result<bool> {
    let f = match storefile::open_read(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io("open", path)(e)),
    };
    Ok(!try_lock(&f, LockMode::Exclusive).map_err(io("lock", path))?)
}

/// Who has a file open, as far as `flock` tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holders {
    Nobody,
    /// Shared locks only: targets (or exports) reading it.
    Readers,
    /// An exclusive lock: a writer (a maintenance target).
    Writer,
}

/// Who holds `path` (tried without waiting, released at once). Call it only under the
/// store's exclusive lock, where no opener of store files runs.
pub fn holders_of(path: &Path) -> Result<Holders> {
    let f = match storefile::open_read(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Holders::Nobody),
        Err(e) => return Err(io("open", path)(e)),
    };
    if !try_lock(&f, LockMode::Shared).map_err(io("lock", path))? {
        return Ok(Holders::Writer);
    }
    // Upgrading our own shared lock succeeds only when nobody else holds one.
    Ok(
        if try_lock(&f, LockMode::Exclusive).map_err(io("lock", path))? {
            Holders::Nobody
        } else {
            Holders::Readers
        },
    )
}

/// Processes holding `flock` locks on `path`, as "pid N (command line)", read from
/// `/proc/locks` (best effort: empty when it cannot tell).
pub fn holders(path: &Path) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::metadata(path) else {
        return vec![];
    };
    let Ok(locks) = std::fs::read_to_string("/proc/locks") else {
        return vec![];
    };
    let (major, minor) = (libc::major(meta.dev()), libc::minor(meta.dev()));
    let want = format!("{major:02x}:{minor:02x}:{}", meta.ino());
    let mut out = Vec::new();
    for line in locks.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        // "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (blocked waiters carry "->").
        if f.len() >= 6 && f[1] == "FLOCK" && f[5] == want {
            let pid = f[4];
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| {
                    String::from_utf8_lossy(&c)
                        .split('\0')
                        .filter(|s| !s.is_empty())
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_default();
            let kind = if f[3] == "WRITE" {
                "read-write"
            } else {
                "read-only"
            };
            let who = if cmd.is_empty() {
                format!("pid {pid} ({kind})")
            } else {
                format!("pid {pid} ({kind}: {cmd})")
            };
            if !out.contains(&who) {
                out.push(who);
            }
        }
    }
    out
}

/// "held by pid 12 (…)" or "held by another process".
pub fn describe_holders(path: &Path) -> String {
    let h = holders(path);
    if h.is_empty() {
        "held by another process".to_string()
    } else {
        format!("held by {}", h.join(", "))
    }
}

/// Who is acting, for metadata and the audit trail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    pub user: String,
    pub host: String,
    pub pid: u32,
    /// The remote client on whose behalf this process acts (the API's `ip:port`), if any.
    pub client: Option<String>,
}

impl Actor {
    /// The current process.
    pub fn current() -> Self {
        Actor {
            user: user_name(),
            host: host_name(),
            pid: std::process::id(),
            client: None,
        }
    }

    /// `user@host`, as recorded in `created_by` and `promoted.by`.
    pub fn who(&self) -> String {
        format!("{}@{}", self.user, self.host)
    }
}

fn user_name() -> String {
    // SAFETY: getuid has no arguments and cannot fail.
    let uid = unsafe { libc::getuid() };
    let mut pw: libc::passwd = unsafe_zeroed_passwd();
    let mut buf = vec![0 as libc::c_char; 4096];
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is to a live local of the right type and `buf.len()` is its size;
    // getpwuid_r writes only into `pw` and `buf` and sets `result`.
    let rc = unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr(), buf.len(), &mut result) };
    if rc == 0 && !result.is_null() && !pw.pw_name.is_null() {
        // SAFETY: on success pw_name points at a NUL-terminated string inside `buf`.
        let name = unsafe { std::ffi::CStr::from_ptr(pw.pw_name) };
        return name.to_string_lossy().into_owned();
    }
    std::env::var("USER").unwrap_or_else(|_| format!("uid{uid}"))
}

fn unsafe_zeroed_passwd() -> libc::passwd {
    // SAFETY: passwd is a plain C struct of pointers and integers; all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the pointer and length describe `buf`, which gethostname fills.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown-host".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// A temporary file name next to `path` for this process: `.<name>.tmp-<pid>`.
pub fn temp_beside(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_whole_files_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two two");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        let e = write_atomic(&dir.path().join("no/such/m.json"), b"x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot create") && e.contains("no/such"), "{e}");
    }

    #[test]
    fn locks_tell_who_uses_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("v.qcow2");
        std::fs::write(&p, b"x").unwrap();
        assert!(!in_use(&p).unwrap());
        assert_eq!(holders_of(&p).unwrap(), Holders::Nobody);
        let held = hold_shared(&p).unwrap().expect("nobody writes it");
        assert!(in_use(&p).unwrap());
        assert_eq!(holders_of(&p).unwrap(), Holders::Readers);
        let who = describe_holders(&p);
        assert!(
            who.contains(&format!("pid {}", std::process::id())),
            "{who}"
        );
        drop(held);
        assert!(!in_use(&p).unwrap());
        let writer = File::open(&p).unwrap();
        assert!(try_lock(&writer, LockMode::Exclusive).unwrap());
        assert_eq!(holders_of(&p).unwrap(), Holders::Writer);
        drop(writer);
        assert!(!in_use(&dir.path().join("gone")).unwrap());
    }

    #[test]
    fn the_actor_has_a_name() {
        let a = Actor::current();
        assert!(!a.user.is_empty() && !a.host.is_empty() && a.who().contains('@'));
    }
}
