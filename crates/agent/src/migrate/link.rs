//! Where a destination agent reaches its source: the source's migration socket on the same
//! host, or, between hosts, TCP with TLS in which both agents show the target's own
//! certificate ([`vdstream_tls::link`]): a third party cannot pull the cache, and nothing
//! travels in plaintext off the host.
//!
//! The session code speaks to a unix stream either way: a TLS connection is carried as one
//! end of a socket pair, pumped to and from the TLS stream on the agent's runtime. Closing
//! that end closes the TLS connection, and the peer's close reads as the end's EOF.
//!
//! Bounds: at most [`MAX_LINKS`] TLS connections at once (one session runs at a time; a
//! second is refused after its hello), [`HANDSHAKE_LIMIT`] for a handshake, and the
//! session's own limit on its first frame.

use std::fmt;
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use vdstream_tls::rustls::{ClientConfig, ServerConfig};

/// TLS connections to the migration listener at once, at most.
pub const MAX_LINKS: usize = 4;
/// Time for a TCP connect and a TLS handshake.
pub const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);
/// Buffer of each direction of a pump: a whole data frame's worth moves per wakeup.
const PUMP_BUFFER: usize = 256 << 10;

/// A source's TLS listener between hosts: its address and configuration.
pub type TlsListen = (SocketAddr, Arc<ServerConfig>);

/// Where the source agent listens.
#[derive(Clone)]
pub enum SourceAddr {
    /// Its migration socket on this host.
    Socket(PathBuf),
    /// `tls://HOST:PORT` on another host.
    Tls {
        host_port: String,
        config: Arc<ClientConfig>,
    },
}

impl fmt::Debug for SourceAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for SourceAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SourceAddr::Socket(p) => write!(f, "{}", p.display()),
            SourceAddr::Tls { host_port, .. } => write!(f, "tls://{host_port}"),
        }
    }
}

/// Why a connection to the source failed: `retry` when the source may not be listening
/// yet (refused, unreachable), not when it answered and the TLS handshake failed.
#[derive(Debug)]
pub struct ConnectError {
    pub retry: bool,
    pub error: std::io::Error,
}

impl SourceAddr {
    /// Connects once.
    pub fn connect(&self) -> Result<UnixStream, ConnectError> {
        let retry = |error| ConnectError { retry: true, error };
        match self {
            SourceAddr::Socket(p) => UnixStream::connect(p).map_err(retry),
            SourceAddr::Tls { host_port, config } => {
                let handle = crate::remote::runtime().map_err(|e| ConnectError {
                    retry: false,
                    error: std::io::Error::other(e.to_string()),
                })?;
                let connector = tokio_rustls::TlsConnector::from(config.clone());
                let name = vdstream_tls::rustls::pki_types::ServerName::try_from(
                    vdstream_tls::link::LINK_SERVER_NAME,
                )
                .expect("a valid name");
                let tls = handle.block_on(async {
                    let tcp = tokio::time::timeout(
                        HANDSHAKE_LIMIT,
                        tokio::net::TcpStream::connect(host_port.as_str()),
                    )
                    .await
                    .map_err(|_| retry(std::io::ErrorKind::TimedOut.into()))?
                    .map_err(retry)?;
                    let _ = tcp.set_nodelay(true);
                    tokio::time::timeout(HANDSHAKE_LIMIT, connector.connect(name, tcp))
                        .await
                        .map_err(|_| retry(std::io::ErrorKind::TimedOut.into()))?
                        .map_err(|e| ConnectError {
                            retry: false,
                            error: std::io::Error::other(format!("the TLS handshake failed: {e}")),
                        })
                })?;
                let (ours, pumped) = UnixStream::pair().map_err(retry)?;
                let _guard = handle.enter();
                let pumped = to_tokio(pumped).map_err(retry)?;
                handle.spawn(pump(tls, pumped));
                Ok(ours)
            }
        }
    }
}

/// Parses `--incoming`: `tls://HOST:PORT` (with `config`, else an error saying what is
/// missing), or a socket path.
pub fn parse_source(text: &str, config: Option<Arc<ClientConfig>>) -> Result<SourceAddr, String> {
    match text.strip_prefix("tls://") {
        None if text.contains("://") => Err(format!(
            "--incoming {text}: a migration source is a socket path or tls://HOST:PORT (plaintext TCP is never used between hosts)"
        )),
        None => Ok(SourceAddr::Socket(PathBuf::from(text))),
        Some(hp) => {
            let host_port = hp.trim_end_matches('/');
            if host_port.rsplit_once(':').is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err()) {
                return Err(format!("--incoming {text}: say tls://HOST:PORT, the source agent's --migrate-listen address"));
            }
            let config = config.ok_or_else(|| format!("--incoming {text} needs the target's certificate: give --migrate-certificates DIR (or --tls-certificates DIR) with ca-cert.pem, client-cert.pem and client-key.pem"))?;
            Ok(SourceAddr::Tls { host_port: host_port.to_string(), config })
        }
    }
}

fn to_tokio(s: UnixStream) -> std::io::Result<tokio::net::UnixStream> {
    s.set_nonblocking(true)?;
    tokio::net::UnixStream::from_std(s)
}

/// Moves bytes both ways until both directions end or one fails; then both close.
async fn pump<T>(mut tls: T, mut end: tokio::net::UnixStream)
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let _ = tokio::io::copy_bidirectional_with_sizes(&mut tls, &mut end, PUMP_BUFFER, PUMP_BUFFER)
        .await;
}

/// Serves `listener` with TLS on the agent's runtime, for the life of the process: each
/// connection that passes the handshake is handed to `serve` as a unix stream, on a thread
/// of its own, with the peer's address.
pub fn serve_tls(
    listener: std::net::TcpListener,
    config: Arc<ServerConfig>,
    target: String,
    serve: Arc<dyn Fn(UnixStream, String) + Send + Sync>,
) -> std::io::Result<()> {
    let handle = crate::remote::runtime().map_err(|e| std::io::Error::other(e.to_string()))?;
    listener.set_nonblocking(true)?;
    let _guard = handle.enter();
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_LINKS));
    handle.spawn(async move {
        loop {
            let Ok((tcp, peer)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                log::warn!("target {target}: refused a migration link from {}: {MAX_LINKS} are open already", peer_name(&peer));
                continue;
            };
            let (acceptor, target, serve) = (acceptor.clone(), target.clone(), serve.clone());
            let peer = peer_name(&peer);
            tokio::spawn(async move {
                let _slot = slot;
                let _ = tcp.set_nodelay(true);
                let tls = match tokio::time::timeout(HANDSHAKE_LIMIT, acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(e)) => {
                        log::warn!("target {target}: refused a migration link from {peer}: {e}");
                        return;
                    }
                    Err(_) => {
                        log::warn!("target {target}: refused a migration link from {peer}: no TLS handshake within {HANDSHAKE_LIMIT:?}");
                        return;
                    }
                };
                let Ok((theirs, pumped)) = UnixStream::pair() else { return };
                let Ok(pumped) = to_tokio(pumped) else { return };
                let spawned = std::thread::Builder::new()
                    .name("migrate-tls".into())
                    .spawn(move || serve(theirs, peer));
                if spawned.is_ok() {
                    pump(tls, pumped).await;
                }
            });
        }
    });
    Ok(())
}

fn peer_name(peer: &SocketAddr) -> String {
    format!("tls://{peer}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incoming_names_a_socket_or_a_tls_address() {
        assert!(
            matches!(parse_source("/run/vdstream/vm1.migrate", None), Ok(SourceAddr::Socket(p)) if p == std::path::Path::new("/run/vdstream/vm1.migrate"))
        );
        let e = parse_source("tcp://10.0.0.2:10811", None).unwrap_err();
        assert!(e.contains("plaintext TCP is never used"), "{e}");
        let e = parse_source("tls://10.0.0.2:10811", None).unwrap_err();
        assert!(e.contains("--migrate-certificates"), "{e}");
        for bad in ["tls://10.0.0.2", "tls://:10811", "tls://host:port"] {
            let e = parse_source(bad, None).unwrap_err();
            assert!(e.contains("tls://HOST:PORT"), "{bad}: {e}");
        }
    }
}
