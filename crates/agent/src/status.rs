//! The figures an agent publishes: the same [`Status`] document is the status file that
//! `vdstream target status ID` reads and, once the store server exists, what the agent
//! reports to its API.
//!
//! Invariants: the file is replaced atomically (write a temporary file, rename), so a
//! reader sees a whole document or the previous one; rates (`iops`, `bytes_per_sec`) are
//! over the last status interval; counters only grow during an attach.

use std::path::Path;

pub use vdstream_contract::status::*;

use crate::AgentError;

/// Milliseconds since the epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The status file of a running agent, written through its folder as it was opened at
/// attach: a network-booted machine's initramfs moves `/run` under the new root before
/// `switch_root`, and the agent, left in the old root, goes on writing the same folder
/// (`/run/vdstream/ID.status.json` of the booted system) rather than a path that is gone.
#[derive(Debug)]
pub struct StatusFile {
    dir: std::fs::File,
    name: std::ffi::CString,
    tmp: std::ffi::CString,
    path: std::path::PathBuf,
}

impl StatusFile {
    /// Opens the folder of `path` (which must exist) and keeps it.
    pub fn open(path: &Path) -> Result<StatusFile, AgentError> {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::fs::OpenOptionsExt;
        let bad = |err| AgentError::Io {
            what: format!("cannot use the status file {}", path.display()),
            err,
        };
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(bad(std::io::Error::from(std::io::ErrorKind::InvalidInput)));
        };
        let parent = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        let dir = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(parent)
            .map_err(bad)?;
        let cstr = |b: &[u8]| {
            std::ffi::CString::new(b)
                .map_err(|_| bad(std::io::Error::from(std::io::ErrorKind::InvalidInput)))
        };
        let mut tmp = name.as_bytes().to_vec();
        tmp.extend_from_slice(b".tmp");
        Ok(StatusFile {
            dir,
            name: cstr(name.as_bytes())?,
            tmp: cstr(&tmp)?,
            path: path.to_path_buf(),
        })
    }

    /// Replaces the file atomically: a fresh temporary file beside it, then a rename.
    pub fn write(&self, status: &Status) -> Result<(), AgentError> {
        use std::os::fd::{AsRawFd, FromRawFd};
        let io = |what: &str, err| AgentError::Io {
            what: format!("{what} {}", self.path.display()),
            err,
        };
        let text = serde_json::to_vec_pretty(status).expect("a status always serializes");
        let dir = self.dir.as_raw_fd();
        // SAFETY: dir is an open directory fd and tmp a NUL-terminated name; unlinkat
        // only removes a leftover temporary file of an earlier write.
        unsafe { libc::unlinkat(dir, self.tmp.as_ptr(), 0) };
        // SAFETY: as above; O_EXCL|O_NOFOLLOW: made afresh, never through a link.
        let fd = unsafe {
            libc::openat(
                dir,
                self.tmp.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                vdstream_blockdev::storefile::SHARED_READ as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(io(
                "cannot write the status file",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: fd was just opened and is owned by nothing else.
        let mut f = unsafe { std::fs::File::from_raw_fd(fd) };
        std::io::Write::write_all(&mut f, &text)
            .map_err(|e| io("cannot write the status file", e))?;
        drop(f);
        // SAFETY: both names are NUL-terminated and relative to the open directory.
        if unsafe { libc::renameat(dir, self.tmp.as_ptr(), dir, self.name.as_ptr()) } != 0 {
            return Err(io(
                "cannot replace the status file",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

/// Reads a status file.
pub fn read(id: &str, path: &Path) -> Result<Status, AgentError> {
    let text = std::fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => AgentError::NoStatus {
            id: id.to_string(),
            path: path.to_path_buf(),
        },
        _ => AgentError::Io {
            what: format!("cannot read {}", path.display()),
            err: e,
        },
    })?;
    serde_json::from_slice(&text).map_err(|e| AgentError::Io {
        what: format!("{} is not an agent status file", path.display()),
        err: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
    })
}

/// Whether process `pid` is alive.
pub fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks that the process exists; no signal is sent.
    pid > 0
        && (unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// The status as text for a person. `alive`: whether the agent process still runs.
pub fn render(s: &Status, alive: bool) -> String {
    let state = match (s.state.as_str(), alive) {
        ("running", true) => "running".to_string(),
        ("running" | STATE_LOST, false) => format!(
            "not running (agent pid {} is gone; figures are from its last status)",
            s.pid
        ),
        (STATE_LOST, true) => format!(
            "CACHE LOST: {}",
            s.server.lost.as_deref().unwrap_or(
                "the server lost the target's cache; every guest request fails with EIO"
            )
        ),
        (other, _) => other.to_string(),
    };
    let io = |x: &IoStatus| {
        format!(
            "{} reads ({}), {} writes ({}); now {:.0} IOPS, {}/s",
            x.read_ops,
            human_bytes(x.read_bytes),
            x.write_ops,
            human_bytes(x.write_bytes),
            x.iops,
            human_bytes(x.bytes_per_sec as u64)
        )
    };
    let c = &s.cache;
    format!(
        "target {}: {state} (pid {})\n\
         export:    {}{}\n\
         vDisk:     export {:?}, {} bytes{}\n\
         server:    {} ({}); {} retries, {} reconnects, {} failovers, {} gave up\n\
         servers:   {}\n{}\
         cache:     {}: RAM {} of {}, file {} of {} ({:.1}% used of {}{}); {} hits, {} misses, {} evictions, {} refused for space\n\
         guest:     {}\n\
         storage:   {}\n{}",
        s.target,
        s.pid,
        if s.socket.is_empty() { "no socket (a kernel NBD device, --kernel-nbd)".to_string() } else { format!("nbd+unix:///?socket={}", s.socket) },
        s.listen.as_ref().map(|l| format!(" and nbd://{l}/")).unwrap_or_default(),
        s.vdisk.export,
        s.vdisk.size,
        s.vdisk.description.as_ref().map(|d| format!(" ({d})")).unwrap_or_default(),
        s.server.endpoint,
        if s.server.connected { "connected" } else { "NOT connected" },
        s.server.retries,
        s.server.reconnects,
        s.server.failovers,
        s.server.gave_up,
        s.server.endpoints.join(", "),
        s.server.journal.as_ref().map_or(String::new(), |j| format!(
            "journal:   {} answered changes ({}) kept until a flush; {} sent again after reconnects, {} refused\n",
            j.changes,
            human_bytes(j.bytes),
            j.replayed,
            j.replay_errors
        )),
        c.kind,
        human_bytes(c.ram_bytes),
        human_bytes(c.ram_limit),
        human_bytes(c.file_bytes),
        human_bytes(c.file_limit),
        c.used_percent,
        human_bytes(c.capacity_bytes),
        c.fs_free_bytes.map_or(String::new(), |f| format!(", {} free on its file system", human_bytes(f))),
        c.hits,
        c.misses,
        c.evictions,
        c.nospace_errors,
        io(&s.guest),
        io(&s.storage),
        s.migration.as_ref().map_or(String::new(), |m| format!(
            "migration: {} {} ({}): {} rounds, {} of cache moved ({} on the wire), {} dirty, final delta {}, fenced {} ms, held {} ms{}{}\n",
            m.role,
            m.phase,
            m.peer,
            m.rounds,
            human_bytes(m.data_bytes),
            human_bytes(m.wire_bytes),
            human_bytes(m.dirty_bytes),
            human_bytes(m.final_bytes),
            m.fenced_ms,
            m.held_ms,
            m.qemu_downtime_ms.map(|d| format!(", qemu's downtime {d} ms")).unwrap_or_default(),
            m.error.as_ref().map(|e| format!("; {e}")).unwrap_or_default()
        )),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The file is written through its folder as opened: once the folder is moved (as an
    /// initramfs moves /run under the new root), the writes land where it went.
    #[test]
    fn writes_follow_a_moved_folder() {
        let top = tempfile::tempdir().unwrap();
        let run = top.path().join("run");
        std::fs::create_dir(&run).unwrap();
        let file = StatusFile::open(&run.join("t1.status.json")).unwrap();
        let mut s = Status {
            target: "t1".into(),
            state: "running".into(),
            ..Status::default()
        };
        file.write(&s).unwrap();
        let moved = top.path().join("newroot-run");
        std::fs::rename(&run, &moved).unwrap();
        s.state = "stopped".into();
        file.write(&s).unwrap();
        assert_eq!(
            read("t1", &moved.join("t1.status.json")).unwrap().state,
            "stopped"
        );
        assert!(!run.exists());
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(&moved)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("t1.status.json")]);
    }

    #[test]
    fn round_trip_and_render() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t1.status.json");
        let mut s = Status {
            target: "t1".into(),
            pid: std::process::id(),
            state: "running".into(),
            ..Status::default()
        };
        s.guest = IoStatus {
            read_ops: 10,
            write_ops: 30,
            read_bytes: 40960,
            write_bytes: 122880,
            ..IoStatus::default()
        };
        s.guest.rate_from(&IoStatus::default(), 2.0);
        assert_eq!(s.guest.iops, 20.0);
        StatusFile::open(&path).unwrap().write(&s).unwrap();
        let back = read("t1", &path).unwrap();
        assert_eq!(back, s);
        let text = render(&back, pid_alive(back.pid));
        assert!(text.contains("target t1: running"), "{text}");
        assert!(text.contains("20 IOPS"), "{text}");
        s.state = STATE_LOST.into();
        s.server.lost = Some("target t1: the server lost this target's cache: …; every request of the guest now fails with EIO".into());
        let text = render(&s, true);
        assert!(
            text.contains("target t1: CACHE LOST: target t1: the server lost this target's cache"),
            "{text}"
        );
        let err = read("t2", &dir.path().join("t2.status.json"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("is it attached"), "{err}");
    }
}
