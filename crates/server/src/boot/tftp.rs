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
//! - At most [`MAX_TRANSFERS`] transfers run at once; past it a request is refused with a
//!   TFTP error the ROM shows (it retries), and logged.

use std::net::SocketAddr;
use std::path::{Component, Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use async_tftp::packet;
use async_tftp::server::handlers::{DirHandler, DirHandlerMode};
use async_tftp::server::{Handler, TftpServerBuilder};
use futures_lite::AsyncRead;
use vdstream_blockdev::lograte::LogLimiter;

/// Transfers served at once, at most.
pub const MAX_TRANSFERS: usize = 64;

/// The handler: a read-only `DirHandler` behind the name check and the transfer cap.
pub struct IpxeFiles {
    dir: PathBuf,
    inner: DirHandler,
    running: Arc<AtomicUsize>,
    log: Arc<LogLimiter>,
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
            .field("running", &self.running)
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

/// A reader that counts as a running transfer until dropped.
pub struct Counted<R> {
    inner: R,
    running: Arc<AtomicUsize>,
}

impl<R> std::fmt::Debug for Counted<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counted")
            .field("running", &self.running)
            .finish_non_exhaustive()
    }
}

impl<R> Drop for Counted<R> {
    fn drop(&mut self) {
        self.running.fetch_sub(1, Ordering::AcqRel);
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
        if self.running.fetch_add(1, Ordering::AcqRel) >= MAX_TRANSFERS {
            self.running.fetch_sub(1, Ordering::AcqRel);
            self.log.log(
                log::Level::Warn,
                module_path!(),
                "tftp-busy",
                format_args!(
                    "TFTP: refused {client} {name:?}: {MAX_TRANSFERS} transfers running, its limit"
                ),
            );
            return Err(packet::Error::Msg(format!(
                "server busy ({MAX_TRANSFERS} transfers); try again"
            )));
        }
        let running = self.running.clone();
        let name = dnsmasq_name(&self.dir, name);
        match self.inner.read_req_open(client, Path::new(&name)).await {
            Ok((r, len)) => {
                log::info!(
                    "TFTP: sending {} to {client}",
                    self.dir.join(name).display()
                );
                Ok((Counted { inner: r, running }, len))
            }
            Err(e) => {
                running.fetch_sub(1, Ordering::AcqRel);
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
        running: Arc::new(AtomicUsize::new(0)),
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
}
