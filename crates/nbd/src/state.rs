//! What every part of the server shares, and the types of its public API: the exports a
//! server offers ([`Exports`], [`OpenError`]...), its tunables ([`ServerConfig`]), its
//! counters ([`ServerStats`]), the drain signal ([`ShutdownSignal`]) and the per-server
//! state every connection reads ([`Shared`]).
//!
//! Nearly a leaf: of this crate it imports only `memory` (itself a leaf), so the
//! handshake, the session engines, the errno mapping and the accept loop all depend on it
//! and never on each other in a circle.

use std::io;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use vdstream_blockdev::BlockDev;

/// The default [`ServerConfig::max_request_memory`].
pub use crate::memory::DEFAULT_LIMIT as DEFAULT_MAX_REQUEST_MEMORY;

/// The default [`ServerConfig::dead_peer_timeout`].
pub const DEFAULT_DEAD_PEER_TIMEOUT: Duration = Duration::from_secs(60);

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
    /// Who the client is: its verified certificate's identity, `Anonymous` when TLS is
    /// configured and it showed none, `Local` when the server runs without TLS.
    pub client: &'a vdstream_contract::Identity,
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
    /// Fires to end this one connection as a drain ends every one: its socket's read side
    /// is shut, what it already read is answered, then it closes (a store server moves a
    /// target to another server so). `None`: only the server's own drain ends it.
    pub close: Option<ShutdownSignal>,
}

/// The set of exports a server offers.
pub trait Exports: Send + Sync + 'static {
    /// The exports shown to `NBD_OPT_LIST`.
    fn list(&self) -> Vec<ExportInfo>;

    /// The exports shown to `NBD_OPT_LIST` from `client`: only those it may open (a client
    /// must not learn names it is not allowed to reach). The default shows [`Exports::list`].
    fn list_for(&self, client: &vdstream_contract::Identity) -> Vec<ExportInfo> {
        let _ = client;
        self.list()
    }

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
        self.list()
            .into_iter()
            .find(|e| e.name == name)
            .map(|e| e.description)
    }

    /// Opens an export for one connection, knowing its peer and why. The device lives as
    /// long as the connection uses it (for [`OpenPurpose::Session`], until the connection
    /// closes), so an implementation can tie per-connection state to it. The default
    /// calls [`Exports::open`] and [`Exports::description`].
    fn open_export(&self, req: &OpenRequest<'_>) -> Result<OpenedExport, OpenError> {
        let device = self.open(req.name)?;
        Ok(OpenedExport {
            device,
            description: self.description(req.name),
            exclusive: false,
            close: None,
        })
    }
}

/// When a server speaks TLS (`NBD_OPT_STARTTLS`); nbdkit's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// No TLS: `NBD_OPT_STARTTLS` is refused (`NBD_REP_ERR_POLICY`); every client is
    /// [`vdstream_contract::Identity::Local`].
    #[default]
    Off,
    /// TLS for clients that ask (the spec's SELECTIVETLS); plaintext clients are served too,
    /// as anonymous.
    On,
    /// TLS before anything else (the spec's FORCEDTLS): every option but `NBD_OPT_ABORT` and
    /// `NBD_OPT_STARTTLS` is answered `NBD_REP_ERR_TLS_REQD` until TLS is up.
    Require,
}

impl TlsMode {
    /// `off`, `on` or `require`.
    pub fn as_str(self) -> &'static str {
        match self {
            TlsMode::Off => "off",
            TlsMode::On => "on",
            TlsMode::Require => "require",
        }
    }
}

impl std::str::FromStr for TlsMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" | "no" | "false" => Ok(TlsMode::Off),
            "on" | "yes" | "true" => Ok(TlsMode::On),
            "require" | "required" => Ok(TlsMode::Require),
            _ => Err(format!("{s:?} is not a TLS mode: use off, on or require")),
        }
    }
}

/// How often an open TLS session's client certificate is checked against `ca-crl.pem`
/// (the file is re-read only when it changed): a revoked certificate's session is closed
/// within this time.
pub const REVOCATION_CHECK_INTERVAL: Duration = Duration::from_secs(5);

/// Tunables of a server. `Default` gives production values.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Each handshake read or write must finish within this time, or the connection is
    /// dropped (a stalled client cannot hold a slot forever).
    pub handshake_timeout: Duration,
    /// Payload bytes (read data, write data, plus 512 bytes a request) one connection may
    /// have taken and not yet answered before the server stops reading its requests
    /// (backpressure), whatever executor serves it; a single larger request runs alone.
    pub max_in_flight_bytes: usize,
    /// Size of each connection's request read buffer.
    pub read_buffer_size: usize,
    /// Bytes the requests of all connections together may hold (READ data waiting to be
    /// sent, WRITE payloads, read buffers grown for large WRITEs); past it the connections
    /// that hold the most stop being read ([`crate::memory`]). At least 64 MiB.
    pub max_request_memory: usize,
    /// Connections beyond this (over all listeners of the server) are answered
    /// [`OpenError::Full`] to whatever export they ask for, then closed.
    pub max_connections: usize,
    /// Worker threads per connection for devices that may sleep (files, caches): how many
    /// of one connection's requests run at once. 1 also keeps one batch runner.
    pub threads_per_connection: usize,
    /// Most batch runners of one connection to a device that prefers batches (batches in
    /// the device while the next is read; at most `threads_per_connection`). Several pay
    /// where one connection carries many clients' requests (an agent's link to the
    /// server); where a connection is one client's queue (a guest at the agent's local
    /// export) one runner takes all it has queued in one pass, with less CPU and no
    /// hand-offs between runners (docs/BENCHMARKS.md, "The server hop: one batch runner
    /// per local connection").
    pub batch_runners: usize,
    /// TCP connections whose peer stops answering (its machine lost or cut off without
    /// closing the connection) are dropped after about this long: TCP keepalive probes
    /// while idle, `TCP_USER_TIMEOUT` while data waits for an acknowledgement. `None`:
    /// the system's defaults (keepalive off; a dead idle peer is never noticed).
    pub dead_peer_timeout: Option<Duration>,
    /// The certificate directory the server's TLS comes from; `None`: no TLS (whatever
    /// [`ServerConfig::tls_mode`] says, `NBD_OPT_STARTTLS` is refused).
    pub tls: Option<Arc<vdstream_tls::files::ServerTls>>,
    /// Whether TLS is offered or required (with [`ServerConfig::tls`]).
    pub tls_mode: TlsMode,
    /// When a TCP source that keeps failing handshakes has its new connections closed at
    /// accept ([`crate::penalty`]).
    pub penalty: crate::penalty::PenaltyConfig,
    /// Client certificates this server serves, by name (`serve-image --tls-allow-name`, as
    /// qemu-nbd's `--tls-authz`): when not empty, a client whose verified certificate
    /// carries none of these names (subject common name, DNS, URI or e-mail subject
    /// alternative name) is refused every export with `NBD_REP_ERR_POLICY`. Clients
    /// without a certificate are left to the export's policy (`--anonymous`).
    pub tls_allow_names: Vec<String>,
}

impl ServerConfig {
    /// The TLS directory, when TLS is configured and not off.
    pub fn tls_enabled(&self) -> Option<&Arc<vdstream_tls::files::ServerTls>> {
        self.tls.as_ref().filter(|_| self.tls_mode != TlsMode::Off)
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            handshake_timeout: Duration::from_secs(30),
            max_in_flight_bytes: 64 << 20,
            read_buffer_size: 256 << 10,
            max_request_memory: DEFAULT_MAX_REQUEST_MEMORY,
            max_connections: 4096,
            threads_per_connection: 16,
            batch_runners: 4,
            dead_peer_timeout: Some(DEFAULT_DEAD_PEER_TIMEOUT),
            tls: None,
            tls_mode: TlsMode::Off,
            penalty: crate::penalty::PenaltyConfig::default(),
            tls_allow_names: Vec::new(),
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
    /// TCP connections closed at accept because their source is penalized for failed
    /// handshakes ([`crate::penalty`]).
    pub connections_penalized: AtomicU64,
    pub requests: AtomicU64,
    pub request_errors: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    /// Threads serving connections now: one per connection, more for a device that may
    /// sleep (its worker pool starts them as requests need them).
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

/// What every connection of a server shares.
pub(crate) struct Shared {
    pub exports: Arc<dyn Exports>,
    pub config: ServerConfig,
    pub stats: Arc<ServerStats>,
    /// Refused opens and accept failures go to the log through this.
    pub log: vdstream_blockdev::lograte::LogLimiter,
    /// Connections being answered "server full" now (the server's refusal path).
    pub refusing: std::sync::atomic::AtomicUsize,
    /// Failed handshakes per TCP source, and the sources closed at accept for them.
    pub penalties: crate::penalty::Penalties,
    /// The memory every connection's requests hold, bounded together
    /// ([`ServerConfig::max_request_memory`]).
    pub memory: Arc<crate::memory::MemoryPool>,
}
