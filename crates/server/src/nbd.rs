//! The NBD side of the server: the listeners (unix socket and/or TCP), the store's exports
//! on them, and the drain.
//!
//! Drain ([`NbdService::drain`], on SIGTERM/SIGINT): `draining` is set (new opens are
//! refused with `NBD_REP_ERR_SHUTDOWN`, so an agent moves to its next server), the
//! listeners stop accepting, requests already read are answered, requests that arrive
//! after the drain began get `ESHUTDOWN`, and each connection closes. It returns when
//! every connection has closed.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vdstream_nbd::server::{Listener, Server, ServerConfig, ShutdownSignal, ShutdownTrigger};

use crate::exports::StoreExports;
use crate::state::ServerState;

/// `nbds` when the server speaks TLS, else `nbd` (for the URIs it prints).
fn scheme(state: &ServerState) -> &'static str {
    if state.nbd_tls.is_some() && state.nbd_tls_mode != vdstream_nbd::TlsMode::Off {
        "nbds"
    } else {
        "nbd"
    }
}

/// Why the NBD side could not start or failed.
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    #[error(transparent)]
    Store(#[from] vdstream_store::StoreError),
    #[error("{0}")]
    Listen(String),
    /// A listener could not bind: the `io::Error` is kept as the source, so that its kind
    /// (`AddrInUse`, `PermissionDenied`, ...) decides the CLI's exit status.
    #[error("cannot listen on {addr}: {source}; {hint}")]
    Bind {
        addr: String,
        hint: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("the NBD server failed: {0}")]
    Serve(std::io::Error),
}

/// The running NBD listeners of a server.
#[derive(Debug)]
pub struct NbdService {
    state: Arc<ServerState>,
    trigger: ShutdownTrigger,
    tasks: Vec<tokio::task::JoinHandle<std::io::Result<()>>>,
    /// The unix socket file: removed when the service is drained or dropped.
    socket: Option<SocketFile>,
    /// One line per listener: where clients connect.
    pub uris: Vec<String>,
}

impl NbdService {
    /// Binds the listeners named in `state` (`nbd_socket`, `nbd_listen`) and starts serving
    /// the store's exports on them. Call inside a tokio runtime.
    pub async fn start(state: Arc<ServerState>, threads: usize) -> Result<NbdService, NbdError> {
        let exports = Arc::new(StoreExports::new(state.clone())?);
        let limit = raise_open_files_limit();
        let max_connections = state
            .max_connections
            .unwrap_or_else(|| default_max_connections(limit.soft));
        log::info!(
            "{}; at most {max_connections} NBD connections (--max-connections)",
            limit.describe()
        );
        let config = ServerConfig {
            threads_per_connection: threads.max(1),
            dead_peer_timeout: state.dead_peer_timeout,
            max_connections: max_connections.max(1),
            max_request_memory: state.max_request_memory,
            tls: state.nbd_tls.clone(),
            tls_mode: state.nbd_tls_mode,
            penalty: state.handshake_penalty.clone(),
            ..ServerConfig::default()
        };
        if state.nbd_listen.is_some() {
            log::info!("NBD: {} (--handshake-penalty)", config.penalty.describe());
        }
        let server = Arc::new(Server::new(exports, config));
        let _ = state.nbd_memory.set(server.request_memory());
        log::info!(
            "NBD requests may hold {} MiB together (--max-request-memory)",
            server.request_memory().limit() >> 20
        );
        let (trigger, shutdown) = ShutdownSignal::new();
        let mut tasks = Vec::new();
        let mut uris = Vec::new();
        // Owned from the bind on: a later failure (the TCP port is busy) removes it.
        let mut socket = None;
        if let Some(path) = &state.nbd_socket {
            let listener = bind_unix(path)?;
            socket = Some(SocketFile(path.clone()));
            uris.push(format!(
                "{}+unix:///EXPORT?socket={}",
                scheme(&state),
                path.display()
            ));
            let (server, shutdown) = (server.clone(), shutdown.clone());
            tasks.push(tokio::spawn(async move {
                server.serve(Listener::Unix(listener), shutdown).await
            }));
        }
        if let Some(addr) = &state.nbd_listen {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| NbdError::Bind {
                    addr: addr.clone(),
                    hint: "is another server using that port?",
                    source,
                })?;
            uris.push(format!("{}://{addr}/EXPORT", scheme(&state)));
            let (server, shutdown) = (server.clone(), shutdown.clone());
            tasks.push(tokio::spawn(async move {
                server.serve(Listener::Tcp(listener), shutdown).await
            }));
        }
        if tasks.is_empty() {
            return Err(NbdError::Listen(
                "nothing to listen on: give a unix socket or a TCP address".into(),
            ));
        }
        Ok(NbdService {
            state,
            trigger,
            tasks,
            socket,
            uris,
        })
    }

    /// Drains (see the module docs) and returns once every connection has closed.
    pub async fn drain(self) -> Result<(), NbdError> {
        self.state.draining.store(true, Ordering::Relaxed);
        self.trigger.shutdown();
        let mut result = Ok(());
        for task in self.tasks {
            match task.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => result = Err(NbdError::Serve(e)),
                Err(e) => result = Err(NbdError::Serve(std::io::Error::other(e.to_string()))),
            }
        }
        drop(self.socket);
        result
    }
}

/// A unix socket file this process bound: removed on drop, so that no failure after the
/// bind (another listener, the HTTP API, a signal handler) leaves it behind.
#[derive(Debug)]
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Descriptors a connection may hold: its socket, and per layer of its chain the layer's
/// file and the file held for its shared lock (measured: 3 for a vDisk of one layer,
/// `tests/e2e/test-server-full.sh`), with room for chains a few versions deep.
pub const FDS_PER_CONNECTION: u64 = 8;

/// Descriptors kept for everything but connections (listeners, the runtime, the HTTP API,
/// the store's lock and metadata files, the read cache's files).
pub const FDS_RESERVED: u64 = 64;

/// The default `--max-connections` under a soft open-files limit of `soft`: what fits
/// beside [`FDS_RESERVED`] at [`FDS_PER_CONNECTION`] each, at least 1, at most 4096.
pub fn default_max_connections(soft: u64) -> usize {
    (soft.saturating_sub(FDS_RESERVED) / FDS_PER_CONNECTION).clamp(1, 4096) as usize
}

/// The open-files limit (`RLIMIT_NOFILE`) before and after [`raise_open_files_limit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFilesLimit {
    pub was: u64,
    pub soft: u64,
    pub hard: u64,
}

impl OpenFilesLimit {
    /// One line for the log.
    pub fn describe(&self) -> String {
        if self.soft > self.was {
            format!(
                "open-files limit raised from {} to {} (the hard limit)",
                self.was, self.soft
            )
        } else {
            format!("open-files limit {} (hard limit {})", self.soft, self.hard)
        }
    }
}

/// Raises the soft open-files limit to the hard limit: every connection costs descriptors,
/// and the usual soft limit of 1024 would fill at a few hundred. Failing to raise it is
/// logged, not fatal (the connection cap is derived from what holds).
pub fn raise_open_files_limit() -> OpenFilesLimit {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` into a live local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } != 0 {
        log::warn!(
            "cannot read the open-files limit: {}",
            std::io::Error::last_os_error()
        );
        return OpenFilesLimit {
            was: 1024,
            soft: 1024,
            hard: 1024,
        };
    }
    let was: u64 = rl.rlim_cur;
    // An unlimited hard limit still stops at the kernel's fs.nr_open.
    let hard = if rl.rlim_max == libc::RLIM_INFINITY {
        std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(1 << 20)
    } else {
        rl.rlim_max
    };
    if was < hard {
        let raised = libc::rlimit {
            rlim_cur: hard as libc::rlim_t,
            rlim_max: rl.rlim_max,
        };
        // SAFETY: setrlimit reads one `rlimit` from a live local.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return OpenFilesLimit {
                was,
                soft: hard,
                hard,
            };
        }
        log::warn!(
            "cannot raise the open-files limit from {was} to {hard}: {}",
            std::io::Error::last_os_error()
        );
    }
    OpenFilesLimit {
        was,
        soft: was,
        hard,
    }
}

/// Binds a unix socket, replacing a stale socket file left by a process that died, but
/// refusing one a live server still answers on.
fn bind_unix(path: &Path) -> Result<tokio::net::UnixListener, NbdError> {
    use vdstream_nbd::listen::BindError;
    let addr = format!("the unix socket {}", path.display());
    vdstream_nbd::listen::bind_unix(path).map_err(|e| match e {
        BindError::InUse(_) => NbdError::Bind {
            addr,
            hint: "stop that server or choose another --socket path",
            source: std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "another server is already listening on it (address in use)",
            ),
        },
        BindError::Bind { source, .. } => NbdError::Bind {
            addr,
            hint: "check the folder's permissions, or choose another --socket path",
            source,
        },
        e => NbdError::Listen(format!("{e}: choose another --socket path")),
    })
}

/// Writes the server's figures to `path` as JSON, atomically (temporary file + rename).
pub fn write_stats(state: &ServerState, path: &Path) -> std::io::Result<()> {
    let json = serde_json::to_vec_pretty(&state.stats()).map_err(std::io::Error::other)?;
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, json)?;
    std::fs::rename(&tmp, path)
}

/// One line on what the guests asked for against what reached the store.
pub fn summary(state: &ServerState) -> String {
    let t = state.totals.snapshot();
    let c = state.read_cache.snapshot();
    format!(
        "guest {} reads ({} bytes) and {} writes ({} bytes); store {} reads ({} bytes) and {} writes ({} bytes); \
         read cache {} of {} bytes used, {} hits, {} misses ({} loads shared), {} evictions",
        t.guest_read_ops,
        t.guest_read_bytes,
        t.guest_write_ops,
        t.guest_write_bytes,
        t.store_read_ops,
        t.store_read_bytes,
        t.store_write_ops,
        t.store_write_bytes,
        c.used,
        c.capacity,
        c.hits,
        c.misses,
        c.shared_loads,
        c.evictions
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_connection_cap_fits_the_open_files_limit() {
        assert_eq!(default_max_connections(1024), 120);
        assert_eq!(default_max_connections(20_000), 2492);
        assert_eq!(default_max_connections(40), 1, "at least one");
        assert_eq!(default_max_connections(1 << 20), 4096, "at most 4096");
        let l = OpenFilesLimit {
            was: 1024,
            soft: 524_288,
            hard: 524_288,
        };
        assert_eq!(
            l.describe(),
            "open-files limit raised from 1024 to 524288 (the hard limit)"
        );
    }
}
