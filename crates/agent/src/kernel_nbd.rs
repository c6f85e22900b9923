//! `--kernel-nbd /dev/nbdN`: the attached disk (the remote vDisk under the local write
//! cache, exactly what the unix socket export serves) presented to the Linux kernel's NBD
//! driver as a block device, so a network-booted target mounts it as its root, with no
//! `nbd-client` and no handshake.
//!
//! ```text
//!  kernel (ext4 on /dev/nbd0) ──socketpair──▶ vdstream_nbd::Server::serve_negotiated
//!        ▲ configured by ioctl                   (the request core) ─▶ WriteCache ─▶ RemoteBase
//!        └─ thread "nbd-do-it": NBD_DO_IT blocks until the device disconnects
//! ```
//!
//! **ioctl, not netlink.** The netlink interface (`NBD_CMD_CONNECT`) adds what an agent
//! does not need: the kernel's own reconnect (`NBD_CMD_RECONFIGURE`, dead-connection
//! timeout) and dynamic device numbers. The agent's socket is one end of a socket pair it
//! owns; server failover happens behind it (`remote`), so the kernel never sees a
//! connection break. The ioctls are a handful of calls through `libc` on every kernel
//! since 2.6, with no generic-netlink library, and the thread blocked in `NBD_DO_IT` tells
//! the agent exactly when the device goes away.
//!
//! **Not ublk.** ublk (io_uring `URING_CMD`, kernel 6.0+) would save the socket copy, but
//! Debian's 6.1 cloud kernel, the one the golden images boot, ships `nbd.ko` and not
//! `ublk_drv.ko`.
//!
//! Invariants:
//! - The setup runs in the order of [`setup_sequence`]: `NBD_CLEAR_SOCK` (a configuration
//!   a dead process left is dropped), `NBD_SET_BLKSIZE` (512), `NBD_SET_SIZE`,
//!   `NBD_SET_FLAGS`, `NBD_SET_TIMEOUT` (0), `NBD_SET_SOCK`; then `NBD_DO_IT` in its own
//!   thread; at the end `NBD_CLEAR_QUE` and `NBD_CLEAR_SOCK`. The first failing step stops
//!   the setup and is named in the error.
//! - The flags given to the kernel are the export's transmission flags (derived from the
//!   device's capabilities, `vdstream_nbd::flags`) that the kernel understands; requests
//!   are validated against exactly those flags.
//! - Timeout 0: the kernel never fails a request for slowness (it logs "Possible stuck
//!   request" every 30 s and waits). The agent itself reconnects and re-sends on server
//!   failover, and `--retry-for` is the one place an outage turns into EIO.
//! - The `NBD_DO_IT` thread blocks every signal: a signal delivered to it would end the
//!   kernel's wait and tear the device down (`nbd_start_device_ioctl`).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vdstream_blockdev::BlockDev;
use vdstream_nbd::proto::{
    FLAG_CAN_MULTI_CONN, FLAG_HAS_FLAGS, FLAG_READ_ONLY, FLAG_SEND_FLUSH, FLAG_SEND_FUA,
    FLAG_SEND_TRIM, FLAG_SEND_WRITE_ZEROES,
};
use vdstream_nbd::validate::ExportParams;
use vdstream_nbd::Server;

use crate::AgentError;

/// The ioctl type of the NBD driver: every request of include/uapi/linux/nbd.h is
/// `_IO( 0xab, nr )`.
const NBD_IOCTL_TYPE: u64 = 0xab;

/// `_IO(type, nr)` of include/uapi/asm-generic/ioctl.h: no direction and no size bits, so
/// the number is `(type << 8) | nr`.
const fn nbd_io(nr: u64) -> u64 {
    (NBD_IOCTL_TYPE << 8) | nr
}

// The requests, as include/uapi/linux/nbd.h numbers them.
/// `#define NBD_SET_SOCK _IO( 0xab, 0 )`
const NBD_SET_SOCK: u64 = nbd_io(0);
/// `#define NBD_SET_BLKSIZE _IO( 0xab, 1 )`
const NBD_SET_BLKSIZE: u64 = nbd_io(1);
/// `#define NBD_SET_SIZE _IO( 0xab, 2 )`
const NBD_SET_SIZE: u64 = nbd_io(2);
/// `#define NBD_DO_IT _IO( 0xab, 3 )`
const NBD_DO_IT: u64 = nbd_io(3);
/// `#define NBD_CLEAR_SOCK _IO( 0xab, 4 )`
const NBD_CLEAR_SOCK: u64 = nbd_io(4);
/// `#define NBD_CLEAR_QUE _IO( 0xab, 5 )`
const NBD_CLEAR_QUE: u64 = nbd_io(5);
/// `#define NBD_DISCONNECT _IO( 0xab, 8 )`
const NBD_DISCONNECT: u64 = nbd_io(8);
/// `#define NBD_SET_TIMEOUT _IO( 0xab, 9 )`
const NBD_SET_TIMEOUT: u64 = nbd_io(9);
/// `#define NBD_SET_FLAGS _IO( 0xab, 10)`
const NBD_SET_FLAGS: u64 = nbd_io(10);

/// `#define NBD_MAJOR 43` of include/uapi/linux/major.h: every /dev/nbdN has it.
const NBD_MAJOR: u32 = 43;

/// The transmission flags the kernel's driver acts on (include/uapi/linux/nbd.h:
/// `NBD_FLAG_HAS_FLAGS`, `READ_ONLY`, `SEND_FLUSH`, `SEND_FUA`, `SEND_TRIM`,
/// `CAN_MULTI_CONN`, and `SEND_WRITE_ZEROES` since Linux 6.11; older kernels ignore
/// that bit and never send the command). Structured replies, block status, cache and
/// fast-zero are not in the kernel's protocol.
pub const KERNEL_FLAGS: u16 = FLAG_HAS_FLAGS
    | FLAG_READ_ONLY
    | FLAG_SEND_FLUSH
    | FLAG_SEND_FUA
    | FLAG_SEND_TRIM
    | FLAG_SEND_WRITE_ZEROES
    | FLAG_CAN_MULTI_CONN;

/// The logical block size given to the kernel: 512, so that partition tables written
/// with 512-byte sectors (MBR, GPT) read right; the page cache still moves 4 KiB pages.
pub const KERNEL_BLOCK_SIZE: u64 = 512;

/// How long the kernel may take to bring the device up after `NBD_DO_IT`.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// What the kernel gets for an export: its size and the flags it understands, and so
/// what requests are validated against.
pub fn kernel_params(dev: &dyn BlockDev) -> ExportParams {
    let flags = vdstream_nbd::flags::transmission_flags(&dev.caps(), false) & KERNEL_FLAGS;
    ExportParams {
        size: dev.size(),
        flags,
        structured: false,
        base_allocation: false,
    }
}

/// One step of the device's setup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setup {
    ClearSock,
    SetBlksize(u64),
    SetSize(u64),
    SetFlags(u16),
    SetTimeout(u64),
    /// The kernel's end of the socket pair.
    SetSock,
}

impl Setup {
    pub fn name(&self) -> &'static str {
        match self {
            Setup::ClearSock => "NBD_CLEAR_SOCK",
            Setup::SetBlksize(_) => "NBD_SET_BLKSIZE",
            Setup::SetSize(_) => "NBD_SET_SIZE",
            Setup::SetFlags(_) => "NBD_SET_FLAGS",
            Setup::SetTimeout(_) => "NBD_SET_TIMEOUT",
            Setup::SetSock => "NBD_SET_SOCK",
        }
    }

    fn request(&self) -> u64 {
        match self {
            Setup::ClearSock => NBD_CLEAR_SOCK,
            Setup::SetBlksize(_) => NBD_SET_BLKSIZE,
            Setup::SetSize(_) => NBD_SET_SIZE,
            Setup::SetFlags(_) => NBD_SET_FLAGS,
            Setup::SetTimeout(_) => NBD_SET_TIMEOUT,
            Setup::SetSock => NBD_SET_SOCK,
        }
    }

    fn arg(&self, sock: RawFd) -> u64 {
        match *self {
            Setup::ClearSock => 0,
            Setup::SetBlksize(n) | Setup::SetSize(n) | Setup::SetTimeout(n) => n,
            Setup::SetFlags(f) => u64::from(f),
            Setup::SetSock => sock as u64,
        }
    }
}

/// The setup of a device for an export of `size` bytes with transmission `flags`, in the
/// order it runs (see the module docs).
pub fn setup_sequence(size: u64, flags: u16) -> [Setup; 6] {
    [
        Setup::ClearSock,
        Setup::SetBlksize(KERNEL_BLOCK_SIZE),
        Setup::SetSize(size),
        Setup::SetFlags(flags),
        Setup::SetTimeout(0),
        Setup::SetSock,
    ]
}

fn err(device: &Path, message: String) -> AgentError {
    AgentError::KernelNbd {
        device: device.to_path_buf(),
        message,
    }
}

fn not_nbd(device: &Path, what: &str) -> AgentError {
    err(device, format!("is not an NBD device ({what}): load the nbd module (modprobe nbd) and give one of its devices, /dev/nbd0 to /dev/nbd15"))
}

/// Opens `device` for the ioctls, after checking that it is an NBD block device: a
/// missing node, another file or another block device is refused with what to do.
pub fn open_device(device: &Path) -> Result<File, AgentError> {
    let meta = match std::fs::metadata(device) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(err(device, "does not exist: it is not an NBD device yet; load the nbd module (modprobe nbd) and give one of its devices, /dev/nbd0 to /dev/nbd15".into()))
        }
        Err(e) => return Err(err(device, format!("cannot be read: {e}"))),
    };
    let kind = meta.file_type();
    if !kind.is_block_device() {
        let what = if kind.is_file() {
            "a regular file"
        } else if kind.is_dir() {
            "a directory"
        } else if kind.is_char_device() {
            "a character device"
        } else {
            "not a block device"
        };
        return Err(not_nbd(device, what));
    }
    let major = libc::major(meta.rdev());
    if major != NBD_MAJOR {
        return Err(not_nbd(
            device,
            &format!("a block device of major {major}; NBD devices have major {NBD_MAJOR}"),
        ));
    }
    std::fs::OpenOptions::new().read(true).write(true).open(device).map_err(|e| match e.kind() {
        io::ErrorKind::PermissionDenied => err(device, "cannot be opened: permission denied: configuring a kernel NBD device needs root (CAP_SYS_ADMIN)".into()),
        _ => err(device, format!("cannot be opened: {e}")),
    })
}

/// One ioctl with an integer argument.
fn nbd_ioctl(ctl: &File, request: u64, arg: u64) -> io::Result<()> {
    // SAFETY: every NBD request of include/uapi/linux/nbd.h takes an integer argument (a
    // size, flags, seconds or a file descriptor) or none, never a pointer; `ctl` is an
    // open descriptor for the whole call.
    let r = unsafe {
        libc::ioctl(
            ctl.as_raw_fd(),
            request as libc::Ioctl,
            arg as libc::c_ulong,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Runs [`setup_sequence`] on `ctl` (the device `device`), stopping at the first step the
/// kernel refuses, which the error names.
pub fn configure(
    ctl: &File,
    device: &Path,
    sock: RawFd,
    params: &ExportParams,
) -> Result<(), AgentError> {
    for step in setup_sequence(params.size, params.flags) {
        if let Err(e) = nbd_ioctl(ctl, step.request(), step.arg(sock)) {
            return Err(match e.raw_os_error() {
                Some(libc::ENOTTY) | Some(libc::EINVAL) if step == Setup::ClearSock => not_nbd(device, &format!("{} answers {e}", step.name())),
                Some(libc::EBUSY) => err(
                    device,
                    format!(
                        "is busy: {} failed: the device is in use by another connection (nbd-client, another agent): disconnect it first \
                         (vdstream target detach ID, or nbd-client -d {}), or give another /dev/nbdN",
                        step.name(),
                        device.display()
                    ),
                ),
                _ => err(device, format!("could not be set up: {} failed: {e}", step.name())),
            });
        }
    }
    Ok(())
}

/// Asks the kernel to disconnect `device` (`NBD_DISCONNECT`): it sends `NBD_CMD_DISC` to
/// whoever serves it, which answers what it read, flushes and ends. `vdstream target
/// detach` and the agent's own shutdown use it.
pub fn disconnect(device: &Path) -> Result<(), AgentError> {
    let ctl = open_device(device)?;
    nbd_ioctl(&ctl, NBD_DISCONNECT, 0).map_err(|e| {
        err(
            device,
            format!("could not be disconnected: NBD_DISCONNECT failed: {e}"),
        )
    })
}

/// Makes a socket pair and serves the transmission phase on one end, in a thread of its
/// own, through `server`'s request core ([`Server::serve_negotiated`]) with `params`; the
/// other end, returned, is what the kernel gets (`NBD_SET_SOCK`). The thread ends when the
/// peer sends DISC or closes its end.
pub fn serve_pair(
    server: Arc<Server>,
    dev: Arc<dyn BlockDev>,
    params: ExportParams,
) -> io::Result<(std::os::unix::net::UnixStream, JoinHandle<io::Result<()>>)> {
    let (ours, kernels) = std::os::unix::net::UnixStream::pair()?;
    let ours: OwnedFd = ours.into();
    let serving = std::thread::Builder::new()
        .name("nbd-kernel".into())
        .spawn(move || server.serve_negotiated(ours, "", dev, params))?;
    Ok((kernels, serving))
}

/// The process of thread `tid` (`Tgid:` in /proc/TID/status).
fn process_of(tid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The pid of the process that serves `device`, if it is up. The kernel's
/// `/sys/block/NAME/pid` names the thread in `NBD_DO_IT`; this is its process.
pub fn server_pid(device: &Path) -> Option<u32> {
    let name = std::fs::canonicalize(device)
        .ok()?
        .file_name()?
        .to_string_lossy()
        .into_owned();
    let tid = std::fs::read_to_string(format!("/sys/block/{name}/pid"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    process_of(tid)
}

/// The NBD device process `pid` serves, if any (`/sys/block/nbd*/pid` names a thread of it).
pub fn device_served_by(pid: u32) -> Option<PathBuf> {
    let mut found = None;
    for entry in std::fs::read_dir("/sys/block").ok()?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let tid = std::fs::read_to_string(entry.path().join("pid"))
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok());
        if name.starts_with("nbd") && tid.and_then(process_of) == Some(pid) {
            found = Some(PathBuf::from("/dev").join(name));
            break;
        }
    }
    found
}

/// Blocks every signal in the calling thread.
fn block_signals() {
    // SAFETY: `set` is a local sigset_t that sigfillset initialises before use;
    // pthread_sigmask only changes the calling thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// A connected kernel NBD device and the threads behind it. See the module docs.
#[derive(Debug)]
pub struct KernelNbd {
    device: PathBuf,
    ctl: Arc<File>,
    do_it: Option<JoinHandle<io::Result<()>>>,
    serving: Option<JoinHandle<io::Result<()>>>,
}

impl KernelNbd {
    /// Configures `device` for `dev` and starts serving it: the request core on one end of
    /// a socket pair (through `server`), `NBD_DO_IT` with the other. Returns once the kernel
    /// has the device up (its `/sys/block/NAME/pid` appeared), or with the reason it refused.
    pub fn start(
        device: &Path,
        server: Arc<Server>,
        dev: Arc<dyn BlockDev>,
    ) -> Result<KernelNbd, AgentError> {
        let ctl = Arc::new(open_device(device)?);
        let params = kernel_params(dev.as_ref());
        if params.size % KERNEL_BLOCK_SIZE != 0 {
            log::warn!(
                "{}: the vDisk's size {} is not a multiple of {KERNEL_BLOCK_SIZE}: the kernel device ends at {} bytes",
                device.display(),
                params.size,
                params.size / KERNEL_BLOCK_SIZE * KERNEL_BLOCK_SIZE
            );
        }
        let (kernels, serving) = serve_pair(server, dev, params)
            .map_err(|e| err(device, format!("cannot be served: {e}")))?;
        if let Err(e) = configure(&ctl, device, kernels.as_raw_fd(), &params) {
            drop(kernels);
            let _ = serving.join();
            return Err(e);
        }
        let do_it = {
            let ctl = ctl.clone();
            std::thread::Builder::new()
                .name("nbd-do-it".into())
                .spawn(move || {
                    block_signals();
                    // The kernel holds its own reference to the socket from NBD_SET_SOCK on;
                    // ours is dropped when the device is done.
                    let _kernels = kernels;
                    nbd_ioctl(&ctl, NBD_DO_IT, 0)
                })
                .map_err(|e| {
                    err(
                        device,
                        format!("cannot be started: no thread for NBD_DO_IT: {e}"),
                    )
                })?
        };
        let mut k = KernelNbd {
            device: device.to_path_buf(),
            ctl,
            do_it: Some(do_it),
            serving: Some(serving),
        };
        k.wait_started()?;
        Ok(k)
    }

    /// Waits until the kernel reports the device up: `/sys/block/NAME/pid` exists (it holds
    /// the id of the thread in `NBD_DO_IT`; a system without sysfs: `NBD_DO_IT` still
    /// blocking after 500 ms), or `NBD_DO_IT` returned (an error).
    fn wait_started(&mut self) -> Result<(), AgentError> {
        let name = std::fs::canonicalize(&self.device)
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
        let sys = name.map(|n| PathBuf::from(format!("/sys/block/{n}")));
        let started = Instant::now();
        loop {
            if self.do_it.as_ref().is_some_and(JoinHandle::is_finished) {
                let why = match self.do_it.take().map(JoinHandle::join) {
                    Some(Ok(Err(e))) => format!("was refused by the kernel: NBD_DO_IT failed: {e}"),
                    _ => "was ended by the kernel at once (NBD_DO_IT returned)".to_string(),
                };
                self.stop_serving();
                return Err(err(&self.device, why));
            }
            let up = match &sys {
                Some(dir) if dir.is_dir() => dir.join("pid").exists(),
                _ => started.elapsed() >= Duration::from_millis(500),
            };
            if up {
                return Ok(());
            }
            if started.elapsed() >= START_TIMEOUT {
                let _ = nbd_ioctl(&self.ctl, NBD_DISCONNECT, 0);
                return Err(err(
                    &self.device,
                    format!(
                        "was not brought up by the kernel within {START_TIMEOUT:?} (no {}/pid)",
                        sys.map(|d| d.display().to_string()).unwrap_or_default()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn device(&self) -> &Path {
        &self.device
    }

    /// Whether the kernel still has the device (`NBD_DO_IT` has not returned).
    pub fn connected(&self) -> bool {
        self.do_it.as_ref().is_some_and(|h| !h.is_finished())
    }

    /// Asks the kernel to disconnect (it sends DISC; the request core answers what it read
    /// and ends), then waits for both threads and clears the device. Idempotent.
    pub fn stop(&mut self) {
        if self.connected() {
            if let Err(e) = nbd_ioctl(&self.ctl, NBD_DISCONNECT, 0) {
                log::warn!("{}: NBD_DISCONNECT failed: {e}", self.device.display());
            }
        }
        if let Some(h) = self.do_it.take() {
            match h.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => log::warn!(
                    "{}: the kernel ended the device: {e}",
                    self.device.display()
                ),
                Err(_) => log::error!("{}: the NBD_DO_IT thread panicked", self.device.display()),
            }
            for (name, request) in [
                ("NBD_CLEAR_QUE", NBD_CLEAR_QUE),
                ("NBD_CLEAR_SOCK", NBD_CLEAR_SOCK),
            ] {
                if let Err(e) = nbd_ioctl(&self.ctl, request, 0) {
                    log::debug!("{}: {name}: {e}", self.device.display());
                }
            }
        }
        self.stop_serving();
    }

    fn stop_serving(&mut self) {
        if let Some(h) = self.serving.take() {
            match h.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    log::warn!("{}: serving the kernel ended: {e}", self.device.display())
                }
                Err(_) => log::error!(
                    "{}: the thread serving the kernel panicked",
                    self.device.display()
                ),
            }
        }
    }
}

impl Drop for KernelNbd {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_requests_are_those_of_linux_nbd_h() {
        // The values `_IO(0xab, nr)` has on x86_64, as strace prints them.
        assert_eq!(NBD_SET_SOCK, 0xab00);
        assert_eq!(NBD_DO_IT, 0xab03);
        assert_eq!(NBD_SET_FLAGS, 0xab0a);
    }

    #[test]
    fn the_setup_runs_in_order_and_ends_with_the_socket() {
        let seq = setup_sequence(1 << 30, FLAG_HAS_FLAGS | FLAG_SEND_FLUSH);
        let names: Vec<_> = seq.iter().map(Setup::name).collect();
        assert_eq!(
            names,
            [
                "NBD_CLEAR_SOCK",
                "NBD_SET_BLKSIZE",
                "NBD_SET_SIZE",
                "NBD_SET_FLAGS",
                "NBD_SET_TIMEOUT",
                "NBD_SET_SOCK"
            ]
        );
        assert_eq!(seq[1].arg(7), 512);
        assert_eq!(seq[2].arg(7), 1 << 30);
        assert_eq!(seq[3].arg(7), u64::from(FLAG_HAS_FLAGS | FLAG_SEND_FLUSH));
        assert_eq!(
            seq[4].arg(7),
            0,
            "timeout 0: the kernel never fails a request during a failover"
        );
        assert_eq!(seq[5].arg(7), 7, "the kernel's end of the socket pair");
    }

    #[test]
    fn files_that_are_not_nbd_devices_are_refused_with_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("nbd0");
        std::fs::write(&file, b"x").unwrap();
        for (path, what) in [
            (file.as_path(), "a regular file"),
            (dir.path(), "a directory"),
            (Path::new("/dev/null"), "a character device"),
        ] {
            let e = open_device(path).unwrap_err().to_string();
            assert!(
                e.contains("is not an NBD device")
                    && e.contains(what)
                    && e.contains("modprobe nbd"),
                "{e}"
            );
        }
        if Path::new("/dev/loop0").exists() {
            let e = open_device(Path::new("/dev/loop0"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("/dev/loop0 is not an NBD device")
                    && e.contains("major 7")
                    && e.contains("modprobe nbd"),
                "{e}"
            );
        }
        let e = open_device(&dir.path().join("nbd9"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("does not exist") && e.contains("modprobe nbd"),
            "{e}"
        );
    }

    #[test]
    fn the_first_ioctl_on_a_file_that_is_not_an_nbd_device_says_so() {
        // configure() is what runs after open_device(); on any other file the kernel
        // refuses the very first request, and nothing after it is tried.
        let f = tempfile::tempfile().unwrap();
        let (_a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let params = ExportParams {
            size: 1 << 20,
            flags: FLAG_HAS_FLAGS,
            structured: false,
            base_allocation: false,
        };
        let e = configure(&f, Path::new("/x/nbd0"), b.as_raw_fd(), &params)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/x/nbd0")
                && e.contains("is not an NBD device")
                && e.contains("NBD_CLEAR_SOCK")
                && e.contains("modprobe nbd"),
            "{e}"
        );
    }
}
