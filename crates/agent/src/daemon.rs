//! `target attach --kernel-nbd DEV --daemon`: the agent as the backend of a network-booted
//! target's root device, which must outlive the initramfs that starts it and the system's
//! shutdown that would kill it.
//!
//! The command starts itself again as a child (before it starts any thread, so no fork
//! of a threaded process): argv[0] `@vdstream` (systemd's convention for root-storage
//! daemons: its killing spree at shutdown spares a process whose argv[0] starts with '@'),
//! in a new session (`setsid`: no controlling terminal, no SIGHUP from it), stdin from
//! /dev/null, stdout and stderr kept (the console). The parent waits on a pipe: the child
//! writes `ready` once the kernel device is connected and serving, and the parent exits 0;
//! if the child exits first, the parent exits with its status (the child has printed why).
//! [`crate::service::run`] makes these steps.
//!
//! The child ([`become_daemon`]) ignores SIGTERM, SIGINT and SIGHUP while it backs the
//! device (the way to stop it: `vdstream target detach ID`, or the device disconnecting),
//! sets its `oom_score_adj` to -1000 and locks its memory (so the kernel never has to page
//! in the process that serves its own page-ins). [`io_flusher`] applies to any
//! `--kernel-nbd` agent.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;

use crate::AgentError;

/// The child learns from this variable that it is the daemon, and which descriptor to
/// write `ready` to.
const READY_FD_ENV: &str = "VDSTREAM_DAEMON_READY_FD";

/// What argv[0] the daemon runs under.
pub const DAEMON_ARGV0: &str = "@vdstream";

/// `PR_SET_IO_FLUSHER` of include/uapi/linux/prctl.h (Linux 5.6); not in `libc` yet.
const PR_SET_IO_FLUSHER: libc::c_int = 57;

/// In the daemon child: the descriptor to report readiness on (taken from the environment
/// once, so later children do not inherit the duty).
pub fn ready_fd() -> Option<OwnedFd> {
    let fd: i32 = std::env::var(READY_FD_ENV).ok()?.parse().ok()?;
    // Called once, before any thread starts.
    std::env::remove_var(READY_FD_ENV);
    // SAFETY: the parent passed this descriptor, the write end of its pipe, open across
    // exec for this process alone; nothing else here owns it.
    (fd > 2).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// How the daemon child started, seen from the parent.
#[derive(Debug)]
pub enum Started {
    /// It is ready: its device is connected and served.
    Ready { pid: u32 },
    /// It ended before its device was up (it has printed why), with this status.
    Ended(std::process::ExitStatus),
}

/// In the parent: starts the daemon child and waits until it is ready or ends.
pub fn start() -> Result<Started, AgentError> {
    let io = |what: &str| {
        let what = what.to_string();
        move |err| AgentError::Io { what, err }
    };
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io("cannot make the daemon's readiness pipe")(
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: pipe2 succeeded: both descriptors are new and owned here alone.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let exe = std::env::current_exe()
        .map_err(io("cannot find the vdstream binary to start the daemon"))?;
    let w = write_end.as_raw_fd();
    let mut cmd = std::process::Command::new(&exe);
    cmd.arg0(DAEMON_ARGV0)
        .args(std::env::args_os().skip(1))
        .env(READY_FD_ENV, w.to_string())
        .stdin(std::process::Stdio::null());
    // SAFETY: between fork and exec only async-signal-safe calls: setsid, and fcntl to
    // keep the pipe's write end open across exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::fcntl(w, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(io(&format!("cannot start the daemon ({})", exe.display())))?;
    drop(write_end);
    let mut said = String::new();
    let _ = std::fs::File::from(read_end).read_to_string(&mut said);
    if said.trim() == "ready" {
        return Ok(Started::Ready { pid: child.id() });
    }
    let status = child.wait().map_err(io("cannot wait for the daemon"))?;
    Ok(Started::Ended(status))
}

/// In the daemon child, before any thread starts: signals, OOM score, memory lock.
pub fn become_daemon(id: &str) {
    // Every catchable signal whose default would end the process: the root disk's backend
    // must not die of a stray `kill -USR1` or a terminal's QUIT (SIGKILL and SIGSTOP cannot
    // be ignored; SIGPIPE is ignored by Rust already).
    for sig in [
        libc::SIGTERM,
        libc::SIGINT,
        libc::SIGHUP,
        libc::SIGQUIT,
        libc::SIGUSR1,
        libc::SIGUSR2,
        libc::SIGALRM,
        libc::SIGVTALRM,
        libc::SIGPROF,
        libc::SIGIO,
        libc::SIGPWR,
        libc::SIGXCPU,
        libc::SIGXFSZ,
        libc::SIGSTKFLT,
    ] {
        // SAFETY: SIG_IGN is a valid disposition for these signals; no handler runs.
        unsafe { libc::signal(sig, libc::SIG_IGN) };
    }
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", "-1000") {
        log::warn!("target {id}: cannot set oom_score_adj to -1000 ({e}): the OOM killer may pick the process behind the root disk");
    }
    // SAFETY: mlockall takes flags only.
    if unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE | libc::MCL_ONFAULT) } != 0 {
        log::warn!("target {id}: cannot lock the agent's memory ({}): under memory pressure it may be paged out", std::io::Error::last_os_error());
    }
}

/// Tells the parent that the device is up; it exits 0 and the daemon goes on.
pub fn report_ready(fd: OwnedFd) {
    let mut f = std::fs::File::from(fd);
    let _ = f.write_all(b"ready\n");
}

/// Marks the process as one in the block I/O path (`PR_SET_IO_FLUSHER`): its memory
/// allocations do not recurse into I/O on the device it serves. Called before threads
/// start, so that they inherit it. Needs CAP_SYS_RESOURCE; a failure is only logged.
pub fn io_flusher(id: &str) {
    // SAFETY: prctl with integer arguments only.
    if unsafe {
        libc::prctl(
            PR_SET_IO_FLUSHER,
            1 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    } != 0
    {
        log::warn!(
            "target {id}: cannot mark the agent as an I/O flusher ({}): under memory pressure, writing back to its own device may stall",
            std::io::Error::last_os_error()
        );
    }
}
