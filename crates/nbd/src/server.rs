//! The NBD server: the API the rest of vdstream uses, the accept loop, and graceful drain.
//!
//! A [`Server`] serves the exports an [`Exports`] implementation names, on a unix or TCP
//! [`Listener`], until its [`ShutdownSignal`] fires. Each connection runs in its own task:
//! the handshake ([`crate::handshake`]), then the transmission phase
//! ([`crate::session`]). Invariants: one connection's failure (bad bytes, a panicking
//! device, a stalled client) ends that connection only; after shutdown starts no
//! connection is accepted and no new request is read, every request already read is
//! answered, and [`Server::serve`] returns only when every connection has closed.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;

use crate::handshake::{Handshaken, TlsPeer};
use crate::session::SessionError;
use crate::state::Shared;
pub use crate::state::{
    is_out_of_fds, ExportInfo, Exports, OpenError, OpenPurpose, OpenRequest, OpenedExport,
    ServerConfig, ServerStats, ShutdownSignal, ShutdownTrigger, TlsMode, DEFAULT_DEAD_PEER_TIMEOUT,
    DEFAULT_MAX_REQUEST_MEMORY, REVOCATION_CHECK_INTERVAL,
};

/// Where a server accepts connections.
#[derive(Debug)]
pub enum Listener {
    Unix(tokio::net::UnixListener),
    Tcp(tokio::net::TcpListener),
}

/// Most connections answered "server full" at once; more are closed right after accept.
const MAX_REFUSING: usize = 32;

/// How long a connection answered "server full" may take over its handshake.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(5);

/// An NBD server (fixed newstyle handshake, TLS by `NBD_OPT_STARTTLS` when configured).
/// See the module docs.
pub struct Server {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

/// Decrements the active-connection count when a connection task ends, even by panic.
struct ActiveGuard(Arc<ServerStats>);
impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.connections_active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Frees a "server full" answering slot when its task ends, even by panic.
struct RefusingGuard(Arc<Shared>);
impl Drop for RefusingGuard {
    fn drop(&mut self) {
        self.0.refusing.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Server {
    pub fn new(exports: Arc<dyn Exports>, config: ServerConfig) -> Server {
        Server {
            shared: Arc::new(Shared {
                exports,
                stats: Arc::new(ServerStats::default()),
                log: crate::lograte::LogLimiter::default(),
                refusing: std::sync::atomic::AtomicUsize::new(0),
                penalties: crate::penalty::Penalties::new(config.penalty.clone()),
                memory: Arc::new(crate::memory::MemoryPool::new(config.max_request_memory)),
                config,
            }),
        }
    }

    /// The server's counters.
    pub fn stats(&self) -> Arc<ServerStats> {
        self.shared.stats.clone()
    }

    /// The memory its connections' requests hold ([`crate::memory`]).
    pub fn request_memory(&self) -> Arc<crate::memory::MemoryPool> {
        self.shared.memory.clone()
    }

    /// Accepts connections on `listener` until `shutdown` fires, then drains: returns once
    /// every connection has answered its in-flight requests and closed. Errors only if the
    /// listener itself fails persistently; a failed connection is logged and forgotten.
    pub async fn serve(&self, listener: Listener, mut shutdown: ShutdownSignal) -> io::Result<()> {
        let mut sessions = JoinSet::new();
        let mut accept_errors = 0u32;
        loop {
            let accepted = tokio::select! {
                biased;
                _ = shutdown.wait() => break,
                Some(done) = sessions.join_next(), if !sessions.is_empty() => {
                    if let Err(e) = done {
                        log::error!("an NBD connection task failed: {e}");
                    }
                    continue;
                }
                a = accept(&listener, self.shared.config.dead_peer_timeout) => a,
            };
            match accepted {
                Ok((conn, peer, source)) => {
                    accept_errors = 0;
                    let stats = &self.shared.stats;
                    stats.connections_accepted.fetch_add(1, Ordering::Relaxed);
                    if let Some(left) = source.and_then(|ip| {
                        self.shared
                            .penalties
                            .penalized(ip, std::time::Instant::now())
                    }) {
                        // Closed before any handshake work is done for it.
                        stats.connections_penalized.fetch_add(1, Ordering::Relaxed);
                        self.shared.log.log(log::Level::Info, module_path!(), "penalized source",
                            format_args!("NBD client {peer}: connection closed at accept: its address failed too many handshakes, {}s of its penalty left (--handshake-penalty)", left.as_secs().max(1)));
                        drop(conn);
                        continue;
                    }
                    let active = stats.connections_active.load(Ordering::Relaxed) as usize;
                    if active >= self.shared.config.max_connections {
                        stats.connections_refused.fetch_add(1, Ordering::Relaxed);
                        let full = OpenError::Full(format!(
                            "{active} connections (--max-connections {}): connect to another server, or retry later",
                            self.shared.config.max_connections
                        ));
                        self.refuse(conn, peer, full, &mut sessions, &shutdown);
                        continue;
                    }
                    stats.connections_active.fetch_add(1, Ordering::Relaxed);
                    let guard = ActiveGuard(stats.clone());
                    let shared = self.shared.clone();
                    let signal = shutdown.clone();
                    sessions.spawn(async move {
                        let _guard = guard;
                        let failed = match conn {
                            Conn::Unix(s) => run_connection(s, &shared, signal, &peer, None).await,
                            Conn::Tcp(s) => run_connection(s, &shared, signal, &peer, None).await,
                        };
                        if let (HandshakeOutcome::Failed, Some(ip)) = (failed, source) {
                            penalize(&shared, ip, &peer);
                        }
                    });
                }
                Err(e) => {
                    // EMFILE and friends: the connection waits in the backlog until a
                    // descriptor frees; back off rather than spin, and never give up for
                    // it (connections end, and the cap keeps it rare). Anything else
                    // that persists ends the listener.
                    let resource = matches!(
                        e.raw_os_error(),
                        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                    );
                    if !resource {
                        accept_errors += 1;
                    }
                    self.shared.log.log(log::Level::Warn, module_path!(),
                        "accept failed",
                        format_args!(
                            "accepting an NBD connection failed: {e}{}",
                            if resource { " (out of file descriptors: lower --max-connections or raise the limit, `ulimit -n`)" } else { "" }
                        ),
                    );
                    if accept_errors > 100 {
                        return Err(e);
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        log::info!("NBD server draining {} connection(s)", sessions.len());
        while let Some(done) = sessions.join_next().await {
            if let Err(e) = done {
                log::error!("an NBD connection task failed: {e}");
            }
        }
        Ok(())
    }

    /// Answers a connection the server has no room for: the handshake runs (briefly) so the
    /// client learns why, every export it asks for is refused with `why`, and it is closed.
    /// At most [`MAX_REFUSING`] such connections are answered at once; beyond that they
    /// are closed at once (the client sees the connection end).
    fn refuse(
        &self,
        conn: Conn,
        peer: String,
        why: OpenError,
        sessions: &mut JoinSet<()>,
        shutdown: &ShutdownSignal,
    ) {
        let shared = self.shared.clone();
        if shared.refusing.fetch_add(1, Ordering::Relaxed) >= MAX_REFUSING {
            shared.refusing.fetch_sub(1, Ordering::Relaxed);
            shared.log.log(
                log::Level::Warn,
                module_path!(),
                "open refused",
                format_args!("NBD client {peer}: connection closed at once: {why}"),
            );
            return;
        }
        let signal = shutdown.clone();
        sessions.spawn(async move {
            let _slot = RefusingGuard(shared.clone());
            match conn {
                Conn::Unix(s) => run_connection(s, &shared, signal, &peer, Some(why)).await,
                Conn::Tcp(s) => run_connection(s, &shared, signal, &peer, Some(why)).await,
            };
        });
    }

    /// Serves one connected unix socket (handshake, then transmission) until it closes,
    /// exactly as [`Server::serve`] serves an accepted one. Fuzzing and tests use it with
    /// one end of a socket pair.
    pub async fn serve_unix_stream(
        &self,
        stream: tokio::net::UnixStream,
        shutdown: ShutdownSignal,
    ) {
        run_connection(stream, &self.shared, shutdown, "unix", None).await;
    }

    /// Serves the transmission phase of a connection whose handshake happened elsewhere, on
    /// the calling thread (and the workers it starts), until the peer sends DISC or closes
    /// the stream. The Linux kernel's NBD driver is such a peer: its socket is configured by
    /// ioctl (size, `params.flags`), and it speaks simple replies and fixed request headers
    /// only, so `params.structured` and `params.base_allocation` must be false for it.
    /// Requests are validated against `params` exactly as after a handshake that sent
    /// those flags; the request core is the one [`Server::serve`] runs.
    pub fn serve_negotiated(
        &self,
        sock: std::os::fd::OwnedFd,
        export_name: &str,
        device: Arc<dyn vdstream_blockdev::BlockDev>,
        params: crate::validate::ExportParams,
    ) -> io::Result<()> {
        let sock = BlockingSocket::new(sock)?;
        self.shared
            .stats
            .connections_accepted
            .fetch_add(1, Ordering::Relaxed);
        self.shared
            .stats
            .connections_active
            .fetch_add(1, Ordering::Relaxed);
        let _guard = ActiveGuard(self.shared.stats.clone());
        let negotiated = crate::handshake::Negotiated {
            export_name: export_name.to_string(),
            device,
            params,
            close: None,
        };
        match crate::session::run(sock.clone(), sock, negotiated, &self.shared) {
            Ok(()) => Ok(()),
            Err(SessionError::Io(e)) => Err(e),
            Err(e @ SessionError::Protocol(_)) => {
                Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
            }
        }
    }
}

/// A connected socket in blocking mode. Its clones share one file descriptor: a connection
/// costs one descriptor for its socket, not one per thread that uses it.
#[derive(Clone)]
struct BlockingSocket(Arc<socket2::Socket>);

/// A socket whose handshake ran on tokio and whose transmission phase runs blocking.
trait Transport: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static {
    fn into_fd(self) -> io::Result<std::os::fd::OwnedFd>;
}

impl Transport for tokio::net::UnixStream {
    fn into_fd(self) -> io::Result<std::os::fd::OwnedFd> {
        Ok(self.into_std()?.into())
    }
}

impl Transport for tokio::net::TcpStream {
    fn into_fd(self) -> io::Result<std::os::fd::OwnedFd> {
        Ok(self.into_std()?.into())
    }
}

/// The whole handshake may take this many `handshake_timeout`s.
const HANDSHAKE_READS_ALLOWED: u32 = 4;

/// How long a blocked reply write may wait for a client that stopped reading.
const REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(120);

impl BlockingSocket {
    fn new(fd: std::os::fd::OwnedFd) -> io::Result<BlockingSocket> {
        let sock = socket2::Socket::from(fd);
        sock.set_nonblocking(false)?;
        sock.set_write_timeout(Some(REPLY_WRITE_TIMEOUT))?;
        Ok(BlockingSocket(Arc::new(sock)))
    }
}

impl io::Read for BlockingSocket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self.0).read(buf)
    }
}

impl io::Write for BlockingSocket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self.0).write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Runs the request core ([`crate::session::run`]) on a thread of its own (which starts
/// more workers if the device may sleep), over the plain socket or over TLS. When a drain
/// starts, or the export's own `close` fires, it shuts the socket's read side, so the
/// threads answer what they read and end.
/// A TLS session whose client certificate `ca-crl.pem` comes to revoke is closed within
/// [`REVOCATION_CHECK_INTERVAL`]. Invariant: no thread outlives its connection: this
/// returns after the session thread has ended, and if the future is dropped first (its
/// task cancelled), [`SessionThread`] shuts the socket so the thread ends at its next read
/// or write instead of serving a connection nobody owns.
async fn run_on_threads(
    sock: BlockingSocket,
    handshaken: Handshaken,
    shared: Arc<Shared>,
    mut shutdown: ShutdownSignal,
    peer: &str,
) -> Result<(), SessionError> {
    let waker = sock.clone();
    let Handshaken {
        mut negotiated,
        tls,
    } = handshaken;
    // This connection's own end (a move to another server), beside the server's drain.
    let mut close = negotiated.close.take();
    let (done_tx, mut done_rx) = tokio::sync::oneshot::channel();
    let mut revocable = None;
    let builder = std::thread::Builder::new().name("nbd-session".into());
    let handle = match tls {
        None => {
            let shared = shared.clone();
            builder.spawn(move || {
                let writer = sock.clone();
                let _ = done_tx.send(crate::session::run(sock, writer, negotiated, &shared));
            })?
        }
        Some(TlsPeer {
            conn,
            identity,
            serial,
        }) => {
            if let (Some(serial), Some(tls)) = (serial, shared.config.tls.clone()) {
                revocable = Some((tls, serial, identity));
            }
            let (reader, writer) = crate::tlsio::split(sock.0, conn);
            let shared = shared.clone();
            builder.spawn(move || {
                let result = crate::session::run(reader, writer.clone(), negotiated, &shared);
                writer.close();
                let _ = done_tx.send(result);
            })?
        }
    };
    let mut thread = SessionThread(waker, Some(handle));
    let mut check = tokio::time::interval(REVOCATION_CHECK_INTERVAL);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let finished = loop {
        tokio::select! {
            r = &mut done_rx => break Some(r),
            _ = shutdown.wait() => break None,
            _ = async { match close.as_mut() { Some(c) => c.wait().await, None => std::future::pending().await } } => break None,
            _ = check.tick(), if revocable.is_some() => {
                if let Some((tls, serial, identity)) = &revocable {
                    if tls.is_revoked(serial) {
                        log::warn!("NBD client {peer} ({identity}): its certificate was revoked (ca-crl.pem); closing its session");
                        let _ = thread.0 .0.shutdown(std::net::Shutdown::Both);
                        break Some((&mut done_rx).await);
                    }
                }
            }
        }
    };
    let result = match finished {
        Some(r) => r,
        None => {
            // A read blocked on the socket returns end-of-file.
            let _ = thread.0 .0.shutdown(std::net::Shutdown::Read);
            done_rx.await
        }
    };
    // The thread has sent its result (or panicked): all that is left is its exit.
    let _ = thread.1.take().map(std::thread::JoinHandle::join);
    result.unwrap_or_else(|_| {
        Err(SessionError::Io(io::Error::other(
            "the session thread panicked",
        )))
    })
}

/// A connection's socket and its session thread, until joined. Dropped unjoined (the task
/// was cancelled), it ends the session (reads see end-of-file, writes fail) without
/// waiting here for a device the thread may be inside.
struct SessionThread(BlockingSocket, Option<std::thread::JoinHandle<()>>);

impl Drop for SessionThread {
    fn drop(&mut self) {
        if self.1.is_some() {
            let _ = self.0 .0.shutdown(std::net::Shutdown::Both);
        }
    }
}

enum Conn {
    Unix(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream),
}

/// Accepts one connection: the connection, how the log names its peer, and its source
/// address (TCP only: unix-socket clients are local and never penalized).
async fn accept(
    listener: &Listener,
    dead_peer_timeout: Option<Duration>,
) -> io::Result<(Conn, String, Option<std::net::IpAddr>)> {
    match listener {
        Listener::Unix(l) => {
            let (s, _) = l.accept().await?;
            Ok((Conn::Unix(s), "unix".to_string(), None))
        }
        Listener::Tcp(l) => {
            let (s, addr) = l.accept().await?;
            if let Err(e) = s.set_nodelay(true) {
                log::debug!("TCP_NODELAY on {addr}: {e}");
            }
            if let Some(t) = dead_peer_timeout {
                if let Err(e) = crate::listen::set_dead_peer_timeout(&s, t) {
                    log::warn!("cannot set TCP keepalive on the connection from {addr} ({e}); if its machine vanishes, the connection is held until the server stops");
                }
            }
            Ok((Conn::Tcp(s), addr.to_string(), Some(addr.ip())))
        }
    }
}

/// How a connection's handshake ended, for [`crate::penalty`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HandshakeOutcome {
    /// It negotiated an export, the client ended it (politely or not), or it failed for a
    /// reason that does not count against the client's address.
    Done,
    /// It failed in a way that counts against the client's address: a refused
    /// certificate, a stall past the timeout, bytes that are not NBD.
    Failed,
}

/// Counts a failed handshake against its source; a source that starts a penalty is named
/// in the log (through the limiter: a crowd of sources cannot flood it).
fn penalize(shared: &Shared, ip: std::net::IpAddr, peer: &str) {
    if let crate::penalty::Failure::Penalized { penalty, strike } =
        shared.penalties.failed(ip, std::time::Instant::now())
    {
        let c = shared.penalties.config();
        shared.log.log(log::Level::Warn, module_path!(), "source penalized", format_args!(
            "NBD clients from {ip} (last {peer}): {} failed handshakes within {}s; their new connections are closed at accept for {}s (penalty {strike}; --handshake-penalty, --handshake-penalty-exempt)",
            c.max_failures, c.window.as_secs(), penalty.as_secs()
        ));
    }
}

/// One connection, start to end. Failures are logged here; the result says whether the
/// handshake failed (a source's failures can penalize it).
/// `refusal`: the server has no room for it; every export it asks for is refused so.
async fn run_connection<S: Transport>(
    mut stream: S,
    shared: &Arc<Shared>,
    shutdown: ShutdownSignal,
    peer: &str,
    refusal: Option<OpenError>,
) -> HandshakeOutcome {
    // Each handshake read is bounded by handshake_timeout; the whole handshake by a few of
    // them, so a client dribbling a byte at a time cannot hold a slot either.
    let whole = if refusal.is_some() {
        REFUSAL_TIMEOUT
    } else {
        shared.config.handshake_timeout * HANDSHAKE_READS_ALLOWED
    };
    let negotiated = match tokio::time::timeout(
        whole,
        crate::handshake::negotiate(&mut stream, shared, &shutdown, peer, refusal.as_ref()),
    )
    .await
    .unwrap_or(Err(crate::handshake::HandshakeError::Timeout(whole)))
    {
        Ok(Some(h)) => h,
        Ok(None) => {
            log::debug!("NBD client {peer} ended the handshake");
            return HandshakeOutcome::Done;
        }
        Err(e) => {
            shared
                .stats
                .handshakes_failed
                .fetch_add(1, Ordering::Relaxed);
            // A stranger can fail handshakes at will (a storm of foreign certificates):
            // through the limiter, so the log shows them while rare and a count once they flood.
            shared.log.log(
                log::Level::Info,
                module_path!(),
                "handshake failed",
                format_args!("NBD handshake with {peer} failed: {e}"),
            );
            return if e.counts_against_source() {
                HandshakeOutcome::Failed
            } else {
                HandshakeOutcome::Done
            };
        }
    };
    log::debug!(
        "NBD client {peer} uses export {:?} ({})",
        negotiated.negotiated.export_name,
        negotiated.negotiated.device.describe()
    );
    let result = match stream.into_fd().and_then(BlockingSocket::new) {
        Ok(sock) => run_on_threads(sock, negotiated, shared.clone(), shutdown, peer).await,
        Err(e) => Err(e.into()),
    };
    match result {
        Err(SessionError::Io(e)) if e.raw_os_error() == Some(libc::ETIMEDOUT) => log::warn!(
            "NBD connection from {peer} ended: the peer stopped answering (connection timed out; see --dead-peer-timeout), so what it held is let go"
        ),
        Err(e) => log::info!("NBD connection from {peer} ended: {e}"),
        Ok(()) => {}
    }
    HandshakeOutcome::Done
}
