//! Where the agent reads its vDisk from: a list of [`Endpoint`]s, each one NBD server and
//! the export on it.
//!
//! Invariants: an endpoint is parsed once, at attach, and never changes; its `export` is
//! the one field that pins what is read. Today it is whatever the URI names (serve-image,
//! nbdkit and qemu-nbd serve one image, usually as ""); with the store server it will be
//! `vdisk/NAME@V` with V fixed at the first attach, so a reconnect can only reach the same
//! version, never a newer one. `http://` URLs name a store server's API, not an NBD
//! server: the `api` module turns them into endpoints (`target/ID`, with a `vdisk/NAME[@V]`
//! fallback for the device cache types).

use std::fmt;

use vdstream_nbd::client::Address;

use crate::AgentError;

/// One NBD server and the export on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The URI as given, for messages and the status.
    pub uri: String,
    /// How to reach the server.
    pub address: Address,
    /// The export name sent in `NBD_OPT_GO`.
    pub export: String,
    /// Asked instead when the server does not know `export` or serves another version
    /// under it (a device type reading `target/ID` from an older server): `vdisk/NAME[@V]`,
    /// pinned like any `vdisk/` export.
    pub fallback: Option<String>,
}

/// Whether `uri` names a store server's API (`http://…`) rather than an NBD server.
pub fn is_api_url(uri: &str) -> bool {
    uri.starts_with("http://") || uri.starts_with("https://")
}

impl Endpoint {
    /// Parses `nbd://HOST[:PORT]/EXPORT` or `nbd+unix:///EXPORT?socket=PATH` (or their TLS
    /// forms `nbds://`, `nbds+unix://`: whether the link uses TLS is the link's setting,
    /// `RemoteOptions::tls`, which the caller sets for them).
    pub fn parse(uri: &str) -> Result<Endpoint, AgentError> {
        if is_api_url(uri) {
            return Err(AgentError::MixedServers {
                uri: uri.to_string(),
            });
        }
        let vdstream_nbd::client::ParsedUri {
            address, export, ..
        } = Address::parse_uri_tls(uri).map_err(|e| AgentError::BadEndpoint {
            uri: uri.to_string(),
            reason: e.to_string(),
        })?;
        Ok(Endpoint {
            uri: uri.to_string(),
            address,
            export,
            fallback: None,
        })
    }

    /// `export` on the server at `address`, with the URI that names it.
    pub fn at(address: Address, export: &str) -> Endpoint {
        let uri = match &address {
            Address::Unix(p) => format!("nbd+unix:///{export}?socket={}", p.display()),
            Address::Tcp(hp) => format!("nbd://{hp}/{export}"),
        };
        Endpoint {
            uri,
            address,
            export: export.to_string(),
            fallback: None,
        }
    }

    /// The same server, another export: how a target's version is pinned (`vdisk/NAME@V`)
    /// and how the `server` cache types reach `target/ID`.
    pub fn with_export(&self, export: &str) -> Endpoint {
        Endpoint::at(self.address.clone(), export)
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.uri)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_and_tcp_uris() {
        let e = Endpoint::parse("nbd+unix:///?socket=/tmp/a.sock").unwrap();
        assert_eq!(e.address, Address::unix("/tmp/a.sock"));
        assert_eq!(e.export, "");
        let e = Endpoint::parse("nbd://127.0.0.1:10900/golden").unwrap();
        assert_eq!(e.export, "golden");
    }

    #[test]
    fn pinning_changes_the_export_only() {
        let e = Endpoint::parse("nbd://127.0.0.1:10900/")
            .unwrap()
            .with_export("vdisk/win11@3");
        assert_eq!(e.uri, "nbd://127.0.0.1:10900/vdisk/win11@3");
        assert_eq!(e.export, "vdisk/win11@3");
        let e = Endpoint::parse("nbd+unix:///?socket=/s")
            .unwrap()
            .with_export("target/t1");
        assert_eq!(e.uri, "nbd+unix:///target/t1?socket=/s");
    }

    #[test]
    fn http_is_not_an_nbd_uri() {
        let err = Endpoint::parse("http://pvs1:8080").unwrap_err().to_string();
        assert!(
            err.contains("store server") && err.contains("every --server"),
            "{err}"
        );
        let err = Endpoint::parse("/tmp/a.sock").unwrap_err().to_string();
        assert!(err.contains("/tmp/a.sock"), "{err}");
    }
}
