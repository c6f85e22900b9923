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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::handshake::Negotiated;
use crate::session::SessionError;
use vdstream_blockdev::BlockDev;

/// One export as shown to `NBD_OPT_LIST` and `NBD_INFO_DESCRIPTION`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    pub description: String,
}

/// Why an export could not be opened. The message is sent to the client (with
/// `NBD_OPT_GO`/`NBD_OPT_INFO`), so say what is wrong and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// No such export (`NBD_REP_ERR_UNKNOWN`).
    #[error("unknown export: {0}")]
    Unknown(String),
    /// Policy forbids this client the export (`NBD_REP_ERR_POLICY`).
    #[error("refused by policy: {0}")]
    Policy(String),
    /// The export exists but cannot be opened now, e.g. a maintenance version that already
    /// has its one writer (`NBD_REP_ERR_POLICY`).
    #[error("export busy: {0}")]
    Busy(String),
    /// The server is shutting down (`NBD_REP_ERR_SHUTDOWN`).
    #[error("server shutting down: {0}")]
    Shutdown(String),
    /// Opening failed (I/O, corrupt store...) (`NBD_REP_ERR_UNKNOWN`, with this message).
    #[error("export could not be opened: {0}")]
    Failed(String),
    /// The server has no room for this connection now: its connection cap
    /// ([`ServerConfig::max_connections`]) is reached, or it ran out of file descriptors
    /// (`EMFILE`/`ENFILE`) opening the export (`NBD_REP_ERR_SHUTDOWN`: "not here, not now",
    /// so a client with another server moves on, and may come back later).
    #[error("server full: {0}")]
    Full(String),
}

impl OpenError {
    /// The kind of refusal, one word, for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            OpenError::Unknown(_) => "unknown export",
            OpenError::Policy(_) => "policy",
            OpenError::Busy(_) => "busy",
            OpenError::Shutdown(_) => "shutting down",
            OpenError::Failed(_) => "failed",
            OpenError::Full(_) => "server full",
        }
    }
}

/// Whether `e` (or an error it wraps) is the process or the system running out of file
/// descriptors: then an open failed for want of room, not for anything about the export.
pub fn is_out_of_fds(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<io::Error>() {
            if matches!(io.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) {
                return true;
            }
        }
        cur = err.source();
    }
    false
}

/// Why an export is being opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenPurpose {
    /// `NBD_OPT_INFO`: the device is dropped right after its size and caps are read.
    Info,
    /// `NBD_OPT_GO` / `NBD_OPT_EXPORT_NAME`: the connection uses the device until it closes.
    Session,
}

/// One request to open an export, with what the server knows of the client.
#[derive(Debug, Clone, Copy)]
pub struct OpenRequest<'a> {
    /// The export name the client asked for ("" = the default export).
    pub name: &'a str,
    /// `unix` for a unix socket, else the peer's `IP:PORT`.
    pub peer: &'a str,
    pub purpose: OpenPurpose,
}

/// An opened export: the device and the description that goes with it. Returned
/// together so that an export resolved at connect time (a vDisk's production version)
/// describes exactly the device the client got.
#[derive(Debug)]
pub struct OpenedExport {
    pub device: Arc<dyn BlockDev>,
    pub description: Option<String>,
    /// This connection holds the export alone: another connection to it is refused while
    /// this one is open (a maintenance version's one writer). `CAN_MULTI_CONN` is then not
    /// advertised, whatever the device could do, so that clients such as nbdcopy and
    /// nbdfuse open one connection instead of being refused their second.
    pub exclusive: bool,
}

/// The set of exports a server offers.
pub trait Exports: Send + Sync + 'static {
    /// The exports shown to `NBD_OPT_LIST`.
    fn list(&self) -> Vec<ExportInfo>;

    /// Opens export `name` ("" = the default export). Called once per connection at
    /// `NBD_OPT_GO` / `NBD_OPT_EXPORT_NAME`, and for each `NBD_OPT_INFO` (whose device is
    /// dropped right after its size and caps are read). Return the same `Arc` for every
    /// connection that should share one device.
    fn open(&self, name: &str) -> Result<Arc<dyn BlockDev>, OpenError>;

    /// The description sent as `NBD_INFO_DESCRIPTION` for export `name` (clients such as
    /// the agent compare it across reconnects to know they still read the same vDisk
    /// version). The default looks `name` up in [`Exports::list`]; an implementation where
    /// "" is an alias of a listed export should answer for "" too.
    fn description(&self, name: &str) -> Option<String> {
        self.list().into_iter().find(|e| e.name == name).map(|e| e.description)
    }

    /// Opens an export for one connection, knowing its peer and why. The device lives as
    /// long as the connection uses it (for [`OpenPurpose::Session`], until the connection
    /// closes), so an implementation can tie per-connection state to it. The default
    /// calls [`Exports::open`] and [`Exports::description`].
    fn open_export(&self, req: &OpenRequest<'_>) -> Result<OpenedExport, OpenError> {
        let device = self.open(req.name)?;
        Ok(OpenedExport { device, description: self.description(req.name), exclusive: false })
    }
}

/// Tunables of a server. `Default` gives production values.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Each handshake read or write must finish within this time, or the connection is
    /// dropped (a stalled client cannot hold a slot forever).
    pub handshake_timeout: Duration,
    /// Payload bytes (read data, write data) one connection may have in flight before
    /// the server stops reading its requests (backpressure).
    pub max_in_flight_bytes: usize,
    /// Size of each connection's request read buffer.
    pub read_buffer_size: usize,
    /// Connections beyond this (over all listeners of the server) are answered
    /// [`OpenError::Full`] to whatever export they ask for, then closed.
    pub max_connections: usize,
    /// Worker threads per connection for devices that may sleep (files, caches): how many
    /// of one connection's requests run at once.
    pub threads_per_connection: usize,
    /// TCP connections whose peer stops answering (its machine lost or cut off without
    /// closing the connection) are dropped after about this long: TCP keepalive probes
    /// while idle, `TCP_USER_TIMEOUT` while data waits for an acknowledgement. `None`:
    /// the system's defaults (keepalive off; a dead idle peer is never noticed).
    pub dead_peer_timeout: Option<Duration>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            handshake_timeout: Duration::from_secs(30),
            max_in_flight_bytes: 64 << 20,
            read_buffer_size: 256 << 10,
            max_connections: 4096,
            threads_per_connection: 16,
            dead_peer_timeout: Some(DEFAULT_DEAD_PEER_TIMEOUT),
        }
    }
}

/// Counters over the life of a server; read them with `load(Ordering::Relaxed)`.
/// Sessions add to them once per batch of requests, not per request.
#[derive(Debug, Default)]
pub struct ServerStats {
    pub connections_accepted: AtomicU64,
    pub connections_active: AtomicU64,
    pub connections_refused: AtomicU64,
    pub handshakes_failed: AtomicU64,
    pub requests: AtomicU64,
    pub request_errors: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    /// Worker threads the threaded engine runs now, over all connections (it starts them
    /// as requests need them: an idle connection has one).
    pub workers: AtomicU64,
}

/// Starts a graceful drain when [`ShutdownTrigger::shutdown`] is called.
#[derive(Debug)]
pub struct ShutdownTrigger {
    tx: watch::Sender<bool>,
}

impl ShutdownTrigger {
    /// Starts the drain: stop accepting, stop reading requests, answer those in flight,
    /// close. Idempotent.
    pub fn shutdown(&self) {
        self.tx.send_replace(true);
    }
}

/// The receiving side of a shutdown; cheap to clone, one per connection.
/// Dropping the [`ShutdownTrigger`] without calling `shutdown` never triggers it.
#[derive(Debug, Clone)]
pub struct ShutdownSignal {
    rx: watch::Receiver<bool>,
}

impl ShutdownSignal {
    /// A new trigger and its signal.
    pub fn new() -> (ShutdownTrigger, ShutdownSignal) {
        let (tx, rx) = watch::channel(false);
        (ShutdownTrigger { tx }, ShutdownSignal { rx })
    }

    /// A signal that never fires (for tests, fuzzing and one-off sessions).
    pub fn never() -> ShutdownSignal {
        ShutdownSignal::new().1
    }

    /// Whether shutdown has started.
    pub fn is_shutdown(&self) -> bool {
        *self.rx.borrow()
    }

    /// Completes when shutdown starts (never, if the trigger was dropped unused).
    pub async fn wait(&mut self) {
        loop {
            if *self.rx.borrow_and_update() {
                return;
            }
            if self.rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Where a server accepts connections.
#[derive(Debug)]
pub enum Listener {
    Unix(tokio::net::UnixListener),
    Tcp(tokio::net::TcpListener),
}

/// What every connection of a server shares.
pub(crate) struct Shared {
    pub exports: Arc<dyn Exports>,
    pub config: ServerConfig,
    pub stats: Arc<ServerStats>,
    /// Refused opens and accept failures go to the log through this.
    pub log: crate::lograte::LogLimiter,
    /// Connections being answered "server full" now (see [`Server::refuse`]).
    pub refusing: std::sync::atomic::AtomicUsize,
}

/// Most connections answered "server full" at once; more are closed right after accept.
const MAX_REFUSING: usize = 32;

/// How long a connection answered "server full" may take over its handshake.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(5);

/// An NBD server (fixed newstyle handshake, no TLS). See the module docs.
pub struct Server {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("config", &self.shared.config).finish_non_exhaustive()
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
                config,
                stats: Arc::new(ServerStats::default()),
                log: crate::lograte::LogLimiter::default(),
                refusing: std::sync::atomic::AtomicUsize::new(0),
            }),
        }
    }

    /// The server's counters.
    pub fn stats(&self) -> Arc<ServerStats> {
        self.shared.stats.clone()
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
                Ok((conn, peer)) => {
                    accept_errors = 0;
                    let stats = &self.shared.stats;
                    stats.connections_accepted.fetch_add(1, Ordering::Relaxed);
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
                        match conn {
                            Conn::Unix(s) => run_connection(s, &shared, signal, &peer, None).await,
                            Conn::Tcp(s) => run_connection(s, &shared, signal, &peer, None).await,
                        }
                    });
                }
                Err(e) => {
                    // EMFILE and friends: the connection waits in the backlog until a
                    // descriptor frees; back off rather than spin, and never give up for
                    // it (connections end, and the cap keeps it rare). Anything else
                    // that persists ends the listener.
                    let resource = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM));
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
    fn refuse(&self, conn: Conn, peer: String, why: OpenError, sessions: &mut JoinSet<()>, shutdown: &ShutdownSignal) {
        let shared = self.shared.clone();
        if shared.refusing.fetch_add(1, Ordering::Relaxed) >= MAX_REFUSING {
            shared.refusing.fetch_sub(1, Ordering::Relaxed);
            shared.log.log(log::Level::Warn, module_path!(), "open refused", format_args!("NBD client {peer}: connection closed at once: {why}"));
            return;
        }
        let signal = shutdown.clone();
        sessions.spawn(async move {
            let _slot = RefusingGuard(shared.clone());
            match conn {
                Conn::Unix(s) => run_connection(s, &shared, signal, &peer, Some(why)).await,
                Conn::Tcp(s) => run_connection(s, &shared, signal, &peer, Some(why)).await,
            }
        });
    }

    /// Serves one already-connected stream (handshake, then transmission) until it closes.
    /// Used by tests and fuzzing over in-memory streams; `serve` calls the same code.
    pub async fn serve_stream<S>(&self, stream: S, shutdown: ShutdownSignal)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        run_connection(InMemory(stream), &self.shared, shutdown, "stream", None).await
    }
}

/// A stream the transmission phase may move onto a blocking socket of its own thread.
trait Transport: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// The blocking socket behind this stream, or the stream back if it has none.
    fn into_blocking(self) -> Converted<Self>
    where
        Self: Sized;
}

/// What became of a stream asked for its blocking socket.
enum Converted<S> {
    Blocking(BlockingSocket),
    Async(S),
    Failed(io::Error),
}

/// An in-memory stream (tests, fuzzing): always served by the async engines.
struct InMemory<S>(S);

impl<S: AsyncRead + Unpin> AsyncRead for InMemory<S> {
    fn poll_read(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>, buf: &mut tokio::io::ReadBuf<'_>) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for InMemory<S> {
    fn poll_write(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>, buf: &[u8]) -> std::task::Poll<io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }
    fn poll_flush(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }
    fn poll_shutdown(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> Transport for InMemory<S> {
    fn into_blocking(self) -> Converted<Self> {
        Converted::Async(self)
    }
}

impl Transport for tokio::net::UnixStream {
    fn into_blocking(self) -> Converted<Self> {
        match self.into_std() {
            Ok(s) => Converted::Blocking(BlockingSocket::Unix(Arc::new(s))),
            Err(e) => Converted::Failed(e),
        }
    }
}

impl Transport for tokio::net::TcpStream {
    fn into_blocking(self) -> Converted<Self> {
        match self.into_std() {
            Ok(s) => Converted::Blocking(BlockingSocket::Tcp(Arc::new(s))),
            Err(e) => Converted::Failed(e),
        }
    }
}

/// A connected socket in blocking mode. Its clones share one file descriptor (reads and
/// writes go through `&UnixStream` / `&TcpStream`): a connection costs one descriptor for
/// its socket, not one per thread that uses it.
enum BlockingSocket {
    Unix(Arc<std::os::unix::net::UnixStream>),
    Tcp(Arc<std::net::TcpStream>),
}

/// The whole handshake may take this many `handshake_timeout`s.
const HANDSHAKE_READS_ALLOWED: u32 = 4;

/// How long a blocked reply write may wait for a client that stopped reading.
const REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(120);

impl BlockingSocket {
    fn prepare(&self) -> io::Result<()> {
        match self {
            BlockingSocket::Unix(s) => {
                s.set_nonblocking(false)?;
                s.set_write_timeout(Some(REPLY_WRITE_TIMEOUT))
            }
            BlockingSocket::Tcp(s) => {
                s.set_nonblocking(false)?;
                s.set_write_timeout(Some(REPLY_WRITE_TIMEOUT))
            }
        }
    }

    /// Another handle on the same socket (no new descriptor).
    fn share(&self) -> BlockingSocket {
        match self {
            BlockingSocket::Unix(s) => BlockingSocket::Unix(s.clone()),
            BlockingSocket::Tcp(s) => BlockingSocket::Tcp(s.clone()),
        }
    }

    /// Ends the read side: a read blocked on it returns end-of-file.
    fn shutdown_read(&self) {
        let _ = match self {
            BlockingSocket::Unix(s) => s.shutdown(std::net::Shutdown::Read),
            BlockingSocket::Tcp(s) => s.shutdown(std::net::Shutdown::Read),
        };
    }
}

impl io::Read for BlockingSocket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            BlockingSocket::Unix(s) => (&**s).read(buf),
            BlockingSocket::Tcp(s) => (&**s).read(buf),
        }
    }
}

impl io::Write for BlockingSocket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            BlockingSocket::Unix(s) => (&**s).write(buf),
            BlockingSocket::Tcp(s) => (&**s).write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Runs a blocking engine on threads of its own: the inline engine for devices that never
/// sleep, the threaded one for devices that may. When a drain starts it shuts the socket's
/// read side, so the threads answer what they read and end.
async fn run_on_threads(sock: BlockingSocket, negotiated: Negotiated, shared: Arc<Shared>, mut shutdown: ShutdownSignal) -> Result<(), SessionError> {
    sock.prepare()?;
    let waker = sock.share();
    let batched = negotiated.device.prefers_batches();
    let writer = if negotiated.device.caps().may_block && !batched { Some(sock.share()) } else { None };
    let (done_tx, mut done_rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new().name("nbd-session".into()).spawn(move || {
        let result = match writer {
            None if batched => crate::session::run_batched_blocking(sock, negotiated, &shared),
            None => crate::session::run_inline_blocking(sock, negotiated, &shared),
            Some(writer) => {
                let threads = shared.config.threads_per_connection.max(1);
                crate::session::run_threaded_blocking(sock, writer, negotiated, &shared, threads)
            }
        };
        let _ = done_tx.send(result);
    })?;
    let finished = tokio::select! {
        r = &mut done_rx => Some(r),
        _ = shutdown.wait() => None,
    };
    let result = match finished {
        Some(r) => r,
        None => {
            waker.shutdown_read();
            done_rx.await
        }
    };
    result.unwrap_or_else(|_| Err(SessionError::Io(io::Error::other("the session thread panicked"))))
}

enum Conn {
    Unix(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream),
}

/// The default [`ServerConfig::dead_peer_timeout`].
pub const DEFAULT_DEAD_PEER_TIMEOUT: Duration = Duration::from_secs(60);

/// Sets keepalive and `TCP_USER_TIMEOUT` on an accepted TCP connection so that a peer that
/// stops answering is noticed within about `timeout`: the first probe after `timeout / 2`
/// of silence, then three probes `timeout / 6` apart (at least a second each).
pub fn set_dead_peer_timeout(sock: &impl std::os::fd::AsRawFd, timeout: Duration) -> io::Result<()> {
    let fd = sock.as_raw_fd();
    let secs = |d: Duration| d.as_secs().clamp(1, i32::MAX as u64) as libc::c_int;
    let set = |level: libc::c_int, name: libc::c_int, value: libc::c_int| -> io::Result<()> {
        // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from a live local; `fd` is
        // open for the call (borrowed from `sock`).
        let rc = unsafe {
            libc::setsockopt(fd, level, name, (&value as *const libc::c_int).cast(), std::mem::size_of::<libc::c_int>() as libc::socklen_t)
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, secs(timeout / 2))?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, secs(timeout / 6))?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3)?;
    set(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, timeout.as_millis().clamp(1000, i32::MAX as u128) as libc::c_int)
}

async fn accept(listener: &Listener, dead_peer_timeout: Option<Duration>) -> io::Result<(Conn, String)> {
    match listener {
        Listener::Unix(l) => {
            let (s, _) = l.accept().await?;
            Ok((Conn::Unix(s), "unix".to_string()))
        }
        Listener::Tcp(l) => {
            let (s, addr) = l.accept().await?;
            if let Err(e) = s.set_nodelay(true) {
                log::debug!("TCP_NODELAY on {addr}: {e}");
            }
            if let Some(t) = dead_peer_timeout {
                if let Err(e) = set_dead_peer_timeout(&s, t) {
                    log::warn!("cannot set TCP keepalive on the connection from {addr} ({e}); if its machine vanishes, the connection is held until the server stops");
                }
            }
            Ok((Conn::Tcp(s), addr.to_string()))
        }
    }
}

/// One connection, start to end. Never returns an error: failures are logged here.
/// `refusal`: the server has no room for it; every export it asks for is refused so.
async fn run_connection<S: Transport>(mut stream: S, shared: &Arc<Shared>, shutdown: ShutdownSignal, peer: &str, refusal: Option<OpenError>) {
    // Each handshake read is bounded by handshake_timeout; the whole handshake by a few of
    // them, so a client dribbling a byte at a time cannot hold a slot either.
    let whole = if refusal.is_some() { REFUSAL_TIMEOUT } else { shared.config.handshake_timeout * HANDSHAKE_READS_ALLOWED };
    let negotiated = match tokio::time::timeout(whole, crate::handshake::negotiate(&mut stream, shared, &shutdown, peer, refusal.as_ref()))
        .await
        .unwrap_or(Err(crate::handshake::HandshakeError::Timeout(whole)))
    {
        Ok(Some(n)) => n,
        Ok(None) => {
            log::debug!("NBD client {peer} ended the handshake");
            return;
        }
        Err(e) => {
            shared.stats.handshakes_failed.fetch_add(1, Ordering::Relaxed);
            log::info!("NBD handshake with {peer} failed: {e}");
            return;
        }
    };
    log::debug!("NBD client {peer} uses export {:?} ({})", negotiated.export_name, negotiated.device.describe());
    // Real sockets go blocking, on threads of their own (see session); in-memory streams
    // stay on the async engines.
    let result = match stream.into_blocking() {
        Converted::Blocking(sock) => run_on_threads(sock, negotiated, shared.clone(), shutdown).await,
        Converted::Async(stream) => crate::session::run(stream, negotiated, shared, shutdown).await,
        Converted::Failed(e) => Err(e.into()),
    };
    match result {
        Err(SessionError::Io(e)) if e.raw_os_error() == Some(libc::ETIMEDOUT) => log::warn!(
            "NBD connection from {peer} ended: the peer stopped answering (connection timed out; see --dead-peer-timeout), so what it held is let go"
        ),
        Err(e) => log::info!("NBD connection from {peer} ended: {e}"),
        Ok(()) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(sock: &std::net::TcpStream, level: libc::c_int, name: libc::c_int) -> libc::c_int {
        use std::os::fd::AsRawFd;
        let mut value: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into a live local.
        let rc = unsafe { libc::getsockopt(sock.as_raw_fd(), level, name, (&mut value as *mut libc::c_int).cast(), &mut len) };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        value
    }

    #[test]
    fn the_dead_peer_timeout_sets_keepalive_and_the_user_timeout() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (sock, _) = listener.accept().unwrap();
        assert_eq!(get(&sock, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 0, "keepalive is off by default");
        set_dead_peer_timeout(&sock, Duration::from_secs(60)).unwrap();
        assert_eq!(get(&sock, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        // First probe after half the timeout of silence, then three, a sixth apart.
        assert_eq!(get(&sock, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 30);
        assert_eq!(get(&sock, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 10);
        assert_eq!(get(&sock, libc::IPPROTO_TCP, libc::TCP_KEEPCNT), 3);
        assert_eq!(get(&sock, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT), 60_000);
        // Short timeouts keep whole seconds of at least one.
        set_dead_peer_timeout(&sock, Duration::from_secs(3)).unwrap();
        assert_eq!(get(&sock, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 1);
        assert_eq!(get(&sock, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 1);
        assert_eq!(get(&sock, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT), 3000);
    }
}
