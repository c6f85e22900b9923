//! Where an NBD server listens: a unix socket path or a TCP `host:port`, and the parsing of
//! NBD URIs (`nbd://host[:port]/export`, `nbd+unix:///export?socket=PATH`).
//!
//! Invariants: a parsed `Address::Tcp` always carries an explicit port (10809 when the URI
//! omits it); URI export names are percent-decoded; TLS schemes (`nbds`, `nbds+unix`) are
//! refused by [`Address::parse_uri`] (whose callers cannot do TLS) rather than silently
//! downgraded, and parsed by [`Address::parse_uri_tls`], which says that TLS was asked for.

use std::fmt;
use std::path::PathBuf;

use tokio::net::{TcpStream, UnixStream};

use super::error::ClientError;

/// The IANA port of NBD.
pub const DEFAULT_PORT: u16 = 10809;

/// An NBD URI taken apart by [`Address::parse_uri_tls`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedUri {
    pub address: Address,
    pub export: String,
    /// The scheme asks for TLS (`nbds`, `nbds+unix`).
    pub tls: bool,
    /// `?tls-certificates=DIR`, when given.
    pub tls_certificates: Option<PathBuf>,
}

/// Where to reach an NBD server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// A unix domain socket path.
    Unix(PathBuf),
    /// `host:port`, as accepted by [`tokio::net::TcpStream::connect`].
    Tcp(String),
}

impl Address {
    /// A unix socket address.
    pub fn unix(path: impl Into<PathBuf>) -> Self {
        Address::Unix(path.into())
    }

    /// A TCP address `host:port`.
    pub fn tcp(host_port: impl Into<String>) -> Self {
        Address::Tcp(host_port.into())
    }

    /// The host to check a TLS server's certificate against: the TCP host (without port
    /// or brackets), `None` for a unix socket.
    pub fn host(&self) -> Option<&str> {
        match self {
            Address::Unix(_) => None,
            Address::Tcp(hp) => Some(hp.rsplit_once(':').map_or(hp.as_str(), |(h, _)| h)),
        }
    }

    /// Parse an NBD URI, TLS schemes included: `nbds://HOST[:PORT]/EXPORT` and
    /// `nbds+unix:///EXPORT?socket=PATH` ask for TLS, and `tls-certificates=DIR` in the
    /// query names the client's certificate directory (as libnbd reads it).
    pub fn parse_uri_tls(uri: &str) -> Result<ParsedUri, ClientError> {
        let (tls, plain) = match uri.split_once("://") {
            Some(("nbds", rest)) => (true, format!("nbd://{rest}")),
            Some(("nbds+unix", rest)) => (true, format!("nbd+unix://{rest}")),
            _ => (false, uri.to_string()),
        };
        let (address, export) = Address::parse_uri(&plain).map_err(|e| match e {
            ClientError::Address { reason, .. } => ClientError::Address {
                input: uri.to_string(),
                reason,
            },
            e => e,
        })?;
        let tls_certificates = plain
            .split_once('?')
            .into_iter()
            .flat_map(|(_, q)| q.split('&'))
            .find_map(|kv| kv.strip_prefix("tls-certificates="))
            .and_then(percent_decode)
            .map(PathBuf::from);
        Ok(ParsedUri {
            address,
            export,
            tls,
            tls_certificates,
        })
    }

    /// Parse an NBD URI into the address and the export name it names.
    ///
    /// Accepted forms: `nbd://host[:port][/export]`, `nbd://[v6addr]:port/export`,
    /// `nbd+unix:///[export]?socket=PATH`.
    pub fn parse_uri(uri: &str) -> Result<(Address, String), ClientError> {
        let bad = |reason: &str| ClientError::Address {
            input: uri.to_string(),
            reason: reason.to_string(),
        };
        let (scheme, rest) = uri
            .split_once("://")
            .ok_or_else(|| bad("missing scheme (nbd:// or nbd+unix://)"))?;
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, ""),
        };
        let export =
            percent_decode(path).ok_or_else(|| bad("bad percent-encoding in export name"))?;
        match scheme {
            "nbd" | "nbd+tcp" => {
                if authority.is_empty() {
                    return Err(bad("missing host"));
                }
                let has_port = if let Some(v6) = authority.strip_prefix('[') {
                    let (_, after) = v6
                        .split_once(']')
                        .ok_or_else(|| bad("unclosed '[' in host"))?;
                    after.starts_with(':')
                } else {
                    authority.contains(':')
                };
                let host_port = if has_port {
                    let port = authority.rsplit(':').next().unwrap_or("");
                    port.parse::<u16>()
                        .map_err(|_| bad("port is not a number 0-65535"))?;
                    authority.to_string()
                } else {
                    format!("{authority}:{DEFAULT_PORT}")
                };
                Ok((Address::Tcp(host_port), export))
            }
            "nbd+unix" => {
                if !authority.is_empty() {
                    return Err(bad(
                        "nbd+unix URIs have no host (use nbd+unix:///export?socket=PATH)",
                    ));
                }
                let socket = query
                    .into_iter()
                    .flat_map(|q| q.split('&'))
                    .find_map(|kv| kv.strip_prefix("socket="))
                    .ok_or_else(|| bad("missing ?socket=PATH"))?;
                let socket = percent_decode(socket)
                    .ok_or_else(|| bad("bad percent-encoding in socket path"))?;
                if socket.is_empty() {
                    return Err(bad("empty socket path"));
                }
                Ok((Address::Unix(PathBuf::from(socket)), export))
            }
            "nbds" | "nbds+unix" => Err(bad("TLS is not supported by this client")),
            _ => Err(bad("unknown scheme (expected nbd:// or nbd+unix://)")),
        }
    }

    /// Open a stream to the server (no timeout here; the caller bounds it).
    pub(crate) async fn open(&self) -> std::io::Result<Stream> {
        match self {
            Address::Unix(path) => Ok(Stream::Unix(UnixStream::connect(path).await?)),
            Address::Tcp(host_port) => {
                let s = TcpStream::connect(host_port.as_str()).await?;
                s.set_nodelay(true)?;
                Ok(Stream::Tcp(s))
            }
        }
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Unix(p) => write!(f, "unix:{}", p.display()),
            Address::Tcp(hp) => write!(f, "tcp:{hp}"),
        }
    }
}

/// A connected stream of either kind.
#[derive(Debug)]
pub(crate) enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_uri_with_port_and_export() {
        let (a, e) = Address::parse_uri("nbd://127.0.0.1:10900/golden").unwrap();
        assert_eq!(a, Address::Tcp("127.0.0.1:10900".into()));
        assert_eq!(e, "golden");
    }

    #[test]
    fn tcp_uri_default_port_and_empty_export() {
        let (a, e) = Address::parse_uri("nbd://localhost").unwrap();
        assert_eq!(a, Address::Tcp("localhost:10809".into()));
        assert_eq!(e, "");
        let (a, _) = Address::parse_uri("nbd://[::1]/x").unwrap();
        assert_eq!(a, Address::Tcp("[::1]:10809".into()));
        let (a, _) = Address::parse_uri("nbd://[::1]:99/x").unwrap();
        assert_eq!(a, Address::Tcp("[::1]:99".into()));
    }

    #[test]
    fn unix_uri() {
        let (a, e) = Address::parse_uri("nbd+unix:///win%2010?socket=/tmp/s%20k.sock").unwrap();
        assert_eq!(a, Address::Unix("/tmp/s k.sock".into()));
        assert_eq!(e, "win 10");
        let (_, e) = Address::parse_uri("nbd+unix://?socket=/tmp/x").unwrap();
        assert_eq!(e, "");
    }

    #[test]
    fn tls_uris() {
        let p = Address::parse_uri_tls("nbds://127.0.0.1:10900/golden?tls-certificates=/etc/x%20y")
            .unwrap();
        assert_eq!(
            (p.address.clone(), p.export.as_str(), p.tls),
            (Address::Tcp("127.0.0.1:10900".into()), "golden", true)
        );
        assert_eq!(
            p.tls_certificates.as_deref(),
            Some(std::path::Path::new("/etc/x y"))
        );
        assert_eq!(p.address.host(), Some("127.0.0.1"));
        let p = Address::parse_uri_tls("nbds+unix:///t?socket=/s&tls-certificates=/d").unwrap();
        assert_eq!(
            (p.address.clone(), p.tls),
            (Address::Unix("/s".into()), true)
        );
        assert_eq!(p.address.host(), None);
        assert!(!Address::parse_uri_tls("nbd://h/x").unwrap().tls);
        assert_eq!(Address::tcp("[::1]:99").host(), Some("[::1]"));
    }

    #[test]
    fn bad_uris_are_refused() {
        for bad in [
            "/tmp/sock",
            "nbd+unix:///x",
            "nbd+unix://host/x?socket=/s",
            "nbds://h/x",
            "http://h/x",
            "nbd://h:port/x",
            "nbd:///x",
            "nbd://h/%zz",
        ] {
            assert!(Address::parse_uri(bad).is_err(), "{bad} should be refused");
        }
    }
}
