//! Where an agent keeps things by default, by target id: its socket, status file and lock
//! in the run directory, its cache files in a per-target cache directory.
//!
//! | what                  | default                                                        |
//! | --------------------- | -------------------------------------------------------------- |
//! | run directory         | `$VDSTREAM_RUN_DIR`, else `$XDG_RUNTIME_DIR/vdstream`, else `/run/vdstream` (root), else `/tmp/vdstream-UID` |
//! | socket                | `RUN/ID.sock`                                                  |
//! | status (JSON)         | `RUN/ID.status.json`, rewritten atomically every second        |
//! | lock (one agent per id) | `RUN/ID.lock` (`flock`, holds the pid)                       |
//! | cache directory       | `$VDSTREAM_CACHE_DIR/ID`, else `/var/tmp/vdstream/ID` (on disk, kept across reboots for the persistent type) |
//!
//! Invariant: a target id is 1-64 characters of `A-Z a-z 0-9 . _ -`, not starting with
//! `.` or `-`, so it is safe in a file name and an export name.

use std::path::PathBuf;

use crate::AgentError;

/// Checks a target id (see the module docs).
pub fn check_target_id(id: &str) -> Result<(), AgentError> {
    let bad = |reason: &str| {
        Err(AgentError::BadTarget {
            id: id.to_string(),
            reason: reason.to_string(),
        })
    };
    if id.is_empty() || id.len() > 64 {
        return bad("use 1 to 64 characters");
    }
    if id.starts_with('.') || id.starts_with('-') {
        return bad("it may not start with '.' or '-'");
    }
    if !id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        return bad("use letters, digits, '.', '_' and '-' only");
    }
    Ok(())
}

/// The run directory (see the module docs).
pub fn run_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("VDSTREAM_RUN_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("vdstream");
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if uid == 0 {
        PathBuf::from("/run/vdstream")
    } else {
        PathBuf::from(format!("/tmp/vdstream-{uid}"))
    }
}

pub fn socket_path(id: &str) -> PathBuf {
    run_dir().join(format!("{id}.sock"))
}

pub fn status_path(id: &str) -> PathBuf {
    run_dir().join(format!("{id}.status.json"))
}

pub fn lock_path(id: &str) -> PathBuf {
    run_dir().join(format!("{id}.lock"))
}

/// The default folder for the target's overflow or cache file.
pub fn cache_dir(id: &str) -> PathBuf {
    match std::env::var_os("VDSTREAM_CACHE_DIR").filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d).join(id),
        None => PathBuf::from("/var/tmp/vdstream").join(id),
    }
}

/// The pid of the agent of target `id` that runs on this host, if one does: it holds
/// `RUN/ID.lock` (see the module docs). `None` when no lock file exists or nobody holds it.
/// An agent on another host is known only to the server it reports to.
pub fn running_agent(id: &str) -> Option<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    use vdstream_blockdev::flock::{try_lock, LockMode};
    check_target_id(id).ok()?;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(lock_path(id))
        .ok()?;
    // A shared lock is refused while the agent holds its exclusive one; taking it does
    // not disturb an agent that starts now (it waits out LOCK_PATIENCE).
    match try_lock(&f, LockMode::Shared, std::time::Duration::ZERO) {
        Ok(true) | Err(_) => None,
        Ok(false) => {
            let mut pid = String::new();
            let _ = f.read_to_string(&mut pid);
            Some(pid.trim().to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_ids() {
        for ok in ["t1", "vm-042", "lab.pc_7"] {
            check_target_id(ok).unwrap();
        }
        for bad in ["", ".hidden", "-x", "a/b", "a b", &"x".repeat(65)] {
            assert!(check_target_id(bad).is_err(), "{bad:?}");
        }
    }
}
