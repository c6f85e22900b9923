//! TFTP for legacy PXE ROMs (`vdstream server --tftp ADDR`): hands out the iPXE binaries of
//! one folder (`--boot-ipxe DIR`, default Debian's `/usr/lib/ipxe`), read-only, with the
//! maintained `async-tftp` crate (its `DirHandler` in read-only mode does the transfers).
//!
//! Invariants:
//! - Only a plain file name directly in the folder is served (`undionly.kpxe`, also asked
//!   for as `/undionly.kpxe`): no `..`, no sub-folder, no absolute path; anything else is
//!   refused with TFTP's access violation and logged (rate-limited).
//! - Write requests are refused (illegal operation).
//! - `NAME.0` (what dnsmasq's `pxe-service=x86PC,…,NAME` makes a BIOS ROM ask for) is
//!   `NAME.kpxe` when the folder has no `NAME.0`.
//! - At most [`MAX_TRANSFERS`] transfers run at once, and at most [`MAX_PER_ADDRESS`] for
//!   one client address (a ROM asks for one file at a time); past either a request is
//!   refused with a TFTP error the ROM shows (it retries), and logged (rate-limited).
//! - A transfer whose client stops acknowledging gives its slot back: each block is sent
//!   again after [`BLOCK_TIMEOUT`] without its acknowledgement, [`BLOCK_RETRIES`] times,
//!   then the transfer is dropped ([`MAX_UNACKED`] at most). The client's `timeout` option
//!   (RFC 2349, up to 255 s) is ignored, so a client cannot stretch that.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Component, Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use async_tftp::packet;
use async_tftp::server::handlers::{DirHandler, DirHandlerMode};
use async_tftp::server::{Handler, TftpServerBuilder};
use futures_lite::AsyncRead;
use vdstream_blockdev::lograte::LogLimiter;

/// Transfers served at once, at most.
pub const MAX_TRANSFERS: usize = 64;
/// Transfers one client address (an IPv6 client: its /64) may hold at once: a PXE ROM asks
/// for one file at a time, and a few more cover its retries from new ports while an old
/// transfer times out.
pub const MAX_PER_ADDRESS: usize = 4;
/// How long a block waits for its acknowledgement before it is sent again (TFTP's usual
/// per-block timeout is 1 to 5 s).
pub const BLOCK_TIMEOUT: Duration = Duration::from_secs(2);
/// How many times a block is sent again before the transfer is given up.
pub const BLOCK_RETRIES: u32 = 2;
/// The longest a transfer whose client acknowledges nothing holds its slot.
pub const MAX_UNACKED: Duration =
    Duration::from_secs(BLOCK_TIMEOUT.as_secs() * (BLOCK_RETRIES as u64 + 1));

/// The handler: a read-only `DirHandler` behind the name check and the transfer caps.
pub struct IpxeFiles {
    dir: PathBuf,
    inner: DirHandler,
    slots: Arc<Slots>,
    log: Arc<LogLimiter>,
}

/// The running transfers: how many in all, and per client address.
#[derive(Debug, Default)]
pub struct Slots {
    held: Mutex<(usize, HashMap<IpAddr, usize>)>,
}

/// Why a transfer got no slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Busy {
    /// [`MAX_TRANSFERS`] are running.
    Server,
    /// [`MAX_PER_ADDRESS`] are running for this client's address.
    Address,
}

/// A transfer's place under the caps, given back when dropped.
#[derive(Debug)]
pub struct Slot {
    slots: Arc<Slots>,
    ip: IpAddr,
}

impl Slots {
    /// A slot for a transfer to `ip`, if both caps allow one.
    pub fn take(self: &Arc<Self>, ip: IpAddr) -> Result<Slot, Busy> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let (total, by_addr) = &mut *held;
        if *total >= MAX_TRANSFERS {
            return Err(Busy::Server);
        }
        let mine = by_addr.entry(ip).or_insert(0);
        if *mine >= MAX_PER_ADDRESS {
            return Err(Busy::Address);
        }
        *mine += 1;
        *total += 1;
        Ok(Slot {
            slots: self.clone(),
            ip,
        })
    }

    /// Transfers running now.
    pub fn running(&self) -> usize {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).0
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.slots.held.lock().unwrap_or_else(|p| p.into_inner());
        let (total, by_addr) = &mut *held;
        *total = total.saturating_sub(1);
        if let Some(n) = by_addr.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                // Only addresses with a transfer running are remembered.
                by_addr.remove(&self.ip);
            }
        }
    }
}

/// The file name a request may read, if it is one plain name.
pub fn plain_name(path: &Path) -> Option<&std::ffi::OsStr> {
    let mut parts = path
        .components()
        .filter(|c| !matches!(c, Component::RootDir | Component::CurDir));
    match (parts.next(), parts.next()) {
        (Some(Component::Normal(name)), None) => Some(name),
        _ => None,
    }
}

impl std::fmt::Debug for IpxeFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpxeFiles")
            .field("dir", &self.dir)
            .field("running", &self.slots.running())
            .finish_non_exhaustive()
    }
}

/// dnsmasq's `pxe-service` asks for `BASENAME.0` on BIOS: when the folder has no such
/// file, `BASENAME.kpxe` (Debian's undionly.kpxe) answers it.
fn dnsmasq_name(dir: &Path, name: &std::ffi::OsStr) -> std::ffi::OsString {
    let text = name.to_string_lossy();
    if let Some(stem) = text.strip_suffix(".0") {
        let kpxe = format!("{stem}.kpxe");
        if !dir.join(name).exists() && dir.join(&kpxe).is_file() {
            return kpxe.into();
        }
    }
    name.to_os_string()
}

/// A reader that holds its transfer's slot until dropped (the transfer ended, or was
/// given up).
pub struct Counted<R> {
    inner: R,
    _slot: Slot,
}

impl<R> std::fmt::Debug for Counted<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counted")
            .field("slot", &self._slot)
            .finish_non_exhaustive()
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Counted<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl Handler for IpxeFiles {
    type Reader = Counted<<DirHandler as Handler>::Reader>;
    type Writer = <DirHandler as Handler>::Writer;

    async fn read_req_open(
        &mut self,
        client: &SocketAddr,
        path: &Path,
    ) -> Result<(Self::Reader, Option<u64>), packet::Error> {
        let Some(name) = plain_name(path) else {
            self.log.log(
                log::Level::Warn,
                module_path!(),
                "tftp-refused",
                format_args!(
                    "TFTP: refused {client} the path {:?}: only the file names of {} are served",
                    path,
                    self.dir.display()
                ),
            );
            return Err(packet::Error::PermissionDenied);
        };
        let slot = match self
            .slots
            .take(vdstream_nbd::penalty::source_key(client.ip()))
        {
            Ok(slot) => slot,
            Err(Busy::Server) => {
                self.log.log(log::Level::Warn, module_path!(), "tftp-busy", format_args!("TFTP: refused {client} {name:?}: {MAX_TRANSFERS} transfers running, its limit (a transfer not acknowledged for {} s gives its place back)", MAX_UNACKED.as_secs()));
                return Err(packet::Error::Msg(format!(
                    "server busy ({MAX_TRANSFERS} transfers); try again"
                )));
            }
            Err(Busy::Address) => {
                self.log.log(log::Level::Warn, module_path!(), "tftp-busy-address", format_args!("TFTP: refused {client} {name:?}: {MAX_PER_ADDRESS} transfers running from this address, the most one machine may have"));
                return Err(packet::Error::Msg(format!("{MAX_PER_ADDRESS} transfers from your address are running; try again when one ends")));
            }
        };
        let name = dnsmasq_name(&self.dir, name);
        match self.inner.read_req_open(client, Path::new(&name)).await {
            Ok((r, len)) => {
                log::info!(
                    "TFTP: sending {} to {client}",
                    self.dir.join(name).display()
                );
                Ok((
                    Counted {
                        inner: r,
                        _slot: slot,
                    },
                    len,
                ))
            }
            Err(e) => {
                self.log.log(
                    log::Level::Warn,
                    module_path!(),
                    "tftp-missing",
                    format_args!(
                        "TFTP: {client} asked for {name:?}, not in {}: {e:?}",
                        self.dir.display()
                    ),
                );
                Err(e)
            }
        }
    }

    async fn write_req_open(
        &mut self,
        client: &SocketAddr,
        path: &Path,
        _size: Option<u64>,
    ) -> Result<Self::Writer, packet::Error> {
        self.log.log(
            log::Level::Warn,
            module_path!(),
            "tftp-write",
            format_args!(
                "TFTP: refused {client} a write of {path:?}: this server only hands out iPXE"
            ),
        );
        Err(packet::Error::IllegalOperation)
    }
}

/// A TFTP server bound and ready.
pub struct Tftp {
    pub addr: SocketAddr,
    server: async_tftp::server::TftpServer<IpxeFiles>,
}

/// Binds `addr` to serve the files of `dir`; the error names the folder or address.
pub async fn bind(addr: SocketAddr, dir: &Path) -> Result<Tftp, String> {
    let inner = DirHandler::new(dir, DirHandlerMode::ReadOnly).map_err(|e| {
        format!("cannot serve iPXE over TFTP from {}: {e}; install Debian's ipxe package (apt-get install ipxe) or give a folder with --boot-ipxe DIR", dir.display())
    })?;
    let handler = IpxeFiles {
        dir: dir.to_path_buf(),
        inner,
        slots: Arc::new(Slots::default()),
        log: Arc::new(LogLimiter::default()),
    };
    let socket = std::net::UdpSocket::bind(addr).map_err(|e| {
        format!(
            "cannot listen for TFTP on {addr}: {e} (port 69 needs root or CAP_NET_BIND_SERVICE)"
        )
    })?;
    let addr = socket.local_addr().map_err(|e| e.to_string())?;
    let server = TftpServerBuilder::with_handler(handler)
        .std_socket(socket)
        .map_err(|e| format!("cannot listen for TFTP on {addr}: {e}"))?
        .timeout(BLOCK_TIMEOUT)
        .max_send_retries(BLOCK_RETRIES)
        .ignore_client_timeout()
        .build()
        .await
        .map_err(|e| format!("cannot start TFTP on {addr}: {e}"))?;
    Ok(Tftp { addr, server })
}

impl std::fmt::Debug for Tftp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tftp")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Tftp {
    /// Serves until the future is dropped (abort its task to stop).
    pub async fn serve(self) {
        if let Err(e) = self.server.serve().await {
            log::error!("TFTP on {} stopped: {e}", self.addr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_names_pass() {
        for ok in ["undionly.kpxe", "/undionly.kpxe", "./ipxe.efi"] {
            assert!(plain_name(Path::new(ok)).is_some(), "{ok}");
        }
        for bad in [
            "../etc/passwd",
            "/../x",
            "a/b",
            "/etc/passwd",
            "",
            "/",
            "..",
            "sub/../x",
            "./../x",
        ] {
            assert!(plain_name(Path::new(bad)).is_none(), "{bad}");
        }
    }

    #[test]
    fn one_address_holds_a_few_transfers_and_every_slot_comes_back() {
        let slots = Arc::new(Slots::default());
        let a: IpAddr = "192.0.2.7".parse().unwrap();
        let held: Vec<Slot> = (0..MAX_PER_ADDRESS)
            .map(|_| slots.take(a).unwrap())
            .collect();
        assert_eq!(
            slots.take(a).unwrap_err(),
            Busy::Address,
            "a flood from one address stops at its share"
        );
        // Other machines fill the rest of the server, then it is full for everyone.
        let others: Vec<Slot> = (0..MAX_TRANSFERS - MAX_PER_ADDRESS)
            .map(|i| slots.take(IpAddr::from([198, 51, 100, i as u8])).unwrap())
            .collect();
        assert_eq!(
            slots.take("203.0.113.1".parse().unwrap()).unwrap_err(),
            Busy::Server
        );
        drop(others);
        drop(held);
        assert_eq!(slots.running(), 0);
        assert!(
            slots.held.lock().unwrap().1.is_empty(),
            "addresses without a transfer are forgotten"
        );
        assert!(slots.take(a).is_ok());
    }
}
