//! The server's settings: flags, and a TOML file (`--config FILE`) whose keys are the
//! flags' names. A flag given on the command line wins over the file.
//!
//! ```toml
//! store = "/srv/vdstream"
//! listen = "127.0.0.1:10809"
//! socket = "/run/vdstream/server.sock"
//! http = "127.0.0.1:8480"    # the HTTP API and /metrics
//! read-cache = "1G"          # or a number of bytes
//! name = "pvs1"
//! stats-file = "/run/vdstream/server-stats.json"
//! max-connections = 1000     # default: from the open-files limit
//! anonymous = "none"         # none, vdisks or all (with TLS: what clients without a certificate get)
//! insecure = false           # true: listen on a non-loopback address without TLS
//! handshake-penalty = 10     # failed NBD handshakes a minute before an address is closed at accept (0: off)
//! handshake-penalty-exempt = "127.0.0.1,::1"   # addresses or networks never penalized, or "none"
//! boot = true                # the boot service (docs/BOOT.md), and its settings:
//! boot-advertise = "192.168.1.10"
//! boot-server = ["http://192.168.1.11:8480"]
//! boot-unknown = "refuse"    # or "auto-add" with boot-template = "ID", boot-id-prefix = "lab"
//! boot-ipxe = "/usr/lib/ipxe"
//! tftp = "0.0.0.0:69"
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::policy::AnonymousGrant;

/// Default size of the shared read cache.
pub const DEFAULT_READ_CACHE: u64 = 256 << 20;

/// Everything a server runs with, after flags and file are merged.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub store: PathBuf,
    pub listen: Option<SocketAddr>,
    pub socket: Option<PathBuf>,
    /// Where the HTTP API and `/metrics` listen (`None`: no API).
    pub http: Option<SocketAddr>,
    /// Bytes of the shared read cache (0: none).
    pub read_cache: u64,
    pub name: Option<String>,
    /// Where to write the server's figures (JSON) every second and at exit.
    pub stats_file: Option<PathBuf>,
    /// Worker threads per connection.
    pub threads: usize,
    /// TCP connections whose peer stops answering are dropped after about this long
    /// (`None`: never; see `vdstream_nbd::ServerConfig::dead_peer_timeout`).
    pub dead_peer_timeout: Option<std::time::Duration>,
    /// NBD connections served at once, at most; more are answered "server full"
    /// (`None`: derived from the open-files limit, see `nbd::default_max_connections`).
    pub max_connections: Option<usize>,
    /// Bytes the requests of every NBD connection together may hold
    /// (`vdstream_nbd::ServerConfig::max_request_memory`).
    pub max_request_memory: usize,
    /// `--anonymous`: what clients without a verified certificate may open when TLS is on
    /// (without TLS every client is `Local` and may open everything).
    pub anonymous: AnonymousGrant,
    /// `--insecure`: listen on a non-loopback address without TLS (a trusted network).
    pub insecure: bool,
    /// Serve the HTTP API over TLS with this certificate directory (`server-cert.pem`,
    /// `server-key.pem`, `ca-cert.pem` to verify client certificates): the directory of
    /// `--tls-certificates`, with or without NBD TLS. `None`: plain HTTP.
    pub http_tls: Option<PathBuf>,
    /// NBD over TLS: the certificate directory (`--tls-certificates`), `None` for `--tls off`.
    pub nbd_tls: Option<std::sync::Arc<vdstream_tls::files::ServerTls>>,
    /// `--tls on|require` (with `nbd_tls`).
    pub nbd_tls_mode: vdstream_nbd::TlsMode,
    /// `--boot` and its settings: the boot service on the API's port (`None`: off).
    /// `--identity-ca`: the CA folder whose key certifies machines that prove their TPM
    /// identity (`None`: no identity routes).
    pub identity: Option<crate::identity::IdentityConfig>,
    pub boot: Option<crate::boot::BootConfig>,
    /// `--handshake-penalty`, `--handshake-penalty-exempt`: TCP client addresses that keep
    /// failing NBD handshakes are closed at accept for a while.
    pub handshake_penalty: vdstream_nbd::penalty::PenaltyConfig,
    /// A mirror of a store in object storage: where the API's changes go (its metadata
    /// writer); `None`: this server changes its own store.
    pub forward: Option<crate::forwarding::Forwarder>,
    /// Counters of the store's backend for /metrics (a store in object storage: its chunk
    /// cache's GETs, hits, checksum failures).
    pub extra_counters: Option<ExtraCounters>,
    /// Rebalancing across the store's servers (the loop runs where the server is started:
    /// `crate::balance::Balancer::run`).
    pub balance: crate::balance::BalanceConfig,
}

/// Counters /metrics reads at each scrape: (name ending in `_total`, help, value).
#[derive(Clone)]
pub struct ExtraCounters(
    pub std::sync::Arc<dyn Fn() -> Vec<(&'static str, &'static str, u64)> + Send + Sync>,
);

impl std::fmt::Debug for ExtraCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExtraCounters")
    }
}

/// A server asked to listen in plaintext where other machines can reach it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "refusing to listen for {what} on {addr} without TLS: any machine that reaches it could open every export \
     (other targets' target/ID, maintenance/NAME); use --tls require --tls-certificates DIR, or --insecure to \
     accept plaintext on a trusted network (a unix socket, 127.0.0.1 and ::1 need neither)"
)]
pub struct InsecureListen {
    /// `NBD` or `the HTTP API`.
    pub what: &'static str,
    pub addr: SocketAddr,
}

/// Whether only this machine can reach `addr` (127.0.0.0/8, ::1, ::ffff:127.x.y.z).
pub fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().to_canonical().is_loopback()
}

impl ServerOptions {
    /// A server of the store at `store` that listens nowhere yet, with the defaults of
    /// `vdstream server` where it has them (no read cache, one thread per connection,
    /// no TLS, anonymous clients get nothing): callers set what they need with
    /// `ServerOptions { field: value, ..ServerOptions::new(store) }`.
    pub fn new(store: impl Into<PathBuf>) -> ServerOptions {
        ServerOptions {
            store: store.into(),
            listen: None,
            socket: None,
            http: None,
            read_cache: 0,
            name: None,
            stats_file: None,
            threads: 1,
            dead_peer_timeout: None,
            max_connections: None,
            max_request_memory: vdstream_nbd::server::DEFAULT_MAX_REQUEST_MEMORY,
            anonymous: AnonymousGrant::None,
            insecure: false,
            http_tls: None,
            nbd_tls: None,
            nbd_tls_mode: Default::default(),
            boot: None,
            identity: None,
            handshake_penalty: Default::default(),
            forward: None,
            extra_counters: None,
            balance: Default::default(),
        }
    }

    /// Refuses a plaintext listener on a non-loopback address unless `insecure` (see
    /// [`InsecureListen`]): NBD without `--tls on|require`, and the HTTP API without HTTPS
    /// (`http_tls`).
    pub fn check_listen(&self) -> Result<(), InsecureListen> {
        self.check_listen_with(self.nbd_tls.is_some())
    }

    fn check_listen_with(&self, nbd_tls: bool) -> Result<(), InsecureListen> {
        if self.insecure {
            return Ok(());
        }
        let nbd = self
            .listen
            .filter(|a| !nbd_tls && !is_loopback(a))
            .map(|addr| InsecureListen { what: "NBD", addr });
        let http = self
            .http
            .filter(|a| self.http_tls.is_none() && !is_loopback(a))
            .map(|addr| InsecureListen {
                what: "the HTTP API",
                addr,
            });
        nbd.or(http).map_or(Ok(()), Err)
    }
}

/// A size in the file: `"256M"` or a number of bytes.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum SizeValue {
    Bytes(u64),
    Text(String),
}

/// The `--config` file, as written.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ConfigFile {
    pub store: Option<PathBuf>,
    pub listen: Option<String>,
    pub socket: Option<PathBuf>,
    pub http: Option<String>,
    pub read_cache: Option<SizeValue>,
    pub name: Option<String>,
    pub stats_file: Option<PathBuf>,
    /// Seconds; 0 turns it off.
    pub dead_peer_timeout: Option<u64>,
    pub max_connections: Option<usize>,
    pub max_request_memory: Option<SizeValue>,
    /// none, vdisks or all.
    pub anonymous: Option<String>,
    pub insecure: Option<bool>,
    /// Failed NBD handshakes a minute before an address is closed at accept (0: off).
    pub handshake_penalty: Option<u32>,
    /// Addresses or networks never penalized, comma-separated, or "none".
    pub handshake_penalty_exempt: Option<String>,
    /// The boot service (keys as the flags: boot, boot-advertise, boot-server (a list),
    /// boot-unknown, boot-template, boot-id-prefix, boot-kernel-args, boot-ipxe, tftp,
    /// max-booting, boot-window (seconds)).
    pub boot: Option<bool>,
    pub boot_advertise: Option<String>,
    pub boot_server: Option<Vec<String>>,
    pub boot_unknown: Option<String>,
    pub boot_template: Option<String>,
    pub boot_id_prefix: Option<String>,
    pub boot_kernel_args: Option<String>,
    pub boot_ipxe: Option<PathBuf>,
    pub tftp: Option<String>,
    pub max_booting: Option<usize>,
    pub boot_window: Option<u64>,
    /// Machine identity (keys as the flags): the CA folder, and the certificates' lifetime
    /// in seconds.
    pub identity_ca: Option<PathBuf>,
    pub identity_cert_lifetime: Option<u64>,
    /// Rebalancing (keys as the flags).
    pub rebalance: Option<bool>,
    pub rebalance_interval: Option<u64>,
    pub rebalance_threshold: Option<u64>,
    pub rebalance_floor: Option<u64>,
    pub weight: Option<f64>,
    /// A store on object storage (store = "s3://…"): the chunk cache's folder and sizes,
    /// and how to reach the store when the AWS variables do not say (they win, as with the
    /// AWS CLI).
    pub object_cache: Option<PathBuf>,
    pub object_cache_ram: Option<SizeValue>,
    pub object_cache_disk: Option<SizeValue>,
    pub s3_endpoint: Option<String>,
    pub s3_region: Option<String>,
    pub s3_access_key_id: Option<String>,
    pub s3_secret_access_key: Option<String>,
}

impl ConfigFile {
    /// Reads and parses `path`; the error names the file and what is wrong in it.
    pub fn load(path: &Path) -> Result<ConfigFile, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the config file {}: {e}", path.display()))?;
        Self::parse(&text)
            .map_err(|e| format!("the config file {} is not valid: {e}", path.display()))
    }

    /// Parses the text of a config file.
    pub fn parse(text: &str) -> Result<ConfigFile, String> {
        toml::from_str(text).map_err(|e| {
            format!("{}; its keys are the flags of `vdstream server`: store, listen, socket, http, read-cache, name, stats-file, dead-peer-timeout, max-connections, max-request-memory, anonymous, insecure, handshake-penalty, handshake-penalty-exempt, boot, boot-advertise, boot-server, boot-unknown, boot-template, boot-id-prefix, boot-kernel-args, boot-ipxe, tftp, max-booting, boot-window, object-cache, object-cache-ram, object-cache-disk, s3-endpoint, s3-region, s3-access-key-id, s3-secret-access-key", e.message())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_the_flag_names() {
        let c = ConfigFile::parse(
            "store = \"/s\"\nlisten = \"127.0.0.1:10809\"\nread-cache = \"1G\"\nname = \"pvs1\"\n",
        )
        .unwrap();
        assert_eq!(c.store, Some(PathBuf::from("/s")));
        assert_eq!(c.read_cache, Some(SizeValue::Text("1G".into())));
        assert_eq!(
            ConfigFile::parse("read-cache = 0").unwrap().read_cache,
            Some(SizeValue::Bytes(0))
        );
        assert_eq!(ConfigFile::parse("").unwrap(), ConfigFile::default());
        assert_eq!(
            ConfigFile::parse("http = \"127.0.0.1:8480\"")
                .unwrap()
                .http
                .as_deref(),
            Some("127.0.0.1:8480")
        );
        assert_eq!(
            ConfigFile::parse("dead-peer-timeout = 20")
                .unwrap()
                .dead_peer_timeout,
            Some(20)
        );
        assert_eq!(
            ConfigFile::parse("max-connections = 200")
                .unwrap()
                .max_connections,
            Some(200)
        );
        let c =
            ConfigFile::parse("handshake-penalty = 0\nhandshake-penalty-exempt = \"10.0.0.0/8\"")
                .unwrap();
        assert_eq!(
            (c.handshake_penalty, c.handshake_penalty_exempt.as_deref()),
            (Some(0), Some("10.0.0.0/8"))
        );
        let c = ConfigFile::parse("boot = true\nboot-server = [\"http://a:1\"]\ntftp = \"0.0.0.0:69\"\nboot-unknown = \"auto-add\"").unwrap();
        assert_eq!(
            (
                c.boot,
                c.boot_server.as_deref(),
                c.tftp.as_deref(),
                c.boot_unknown.as_deref()
            ),
            (
                Some(true),
                Some(&["http://a:1".to_string()][..]),
                Some("0.0.0.0:69"),
                Some("auto-add")
            )
        );
        let c = ConfigFile::parse("anonymous = \"vdisks\"\ninsecure = true").unwrap();
        assert_eq!(
            (c.anonymous.as_deref(), c.insecure),
            (Some("vdisks"), Some(true))
        );
    }

    fn listening(listen: Option<&str>, http: Option<&str>) -> ServerOptions {
        ServerOptions {
            listen: listen.map(|a| a.parse().unwrap()),
            http: http.map(|a| a.parse().unwrap()),
            ..ServerOptions::new("s")
        }
    }

    #[test]
    fn a_plaintext_listener_off_loopback_needs_insecure() {
        for (listen, http) in [
            (None, None),
            (Some("127.0.0.1:10809"), Some("127.0.0.1:0")),
            (Some("[::1]:10809"), None),
            (Some("127.3.2.1:1"), None),
            (Some("[::ffff:127.0.0.1]:1"), None),
        ] {
            assert_eq!(
                listening(listen, http).check_listen(),
                Ok(()),
                "{listen:?} {http:?}"
            );
        }
        for (listen, http, what, addr) in [
            (Some("0.0.0.0:10809"), None, "NBD", "0.0.0.0:10809"),
            (
                Some("10.1.2.3:10809"),
                Some("127.0.0.1:8480"),
                "NBD",
                "10.1.2.3:10809",
            ),
            (Some("[::]:10809"), None, "NBD", "[::]:10809"),
            (
                None,
                Some("192.168.1.5:8480"),
                "the HTTP API",
                "192.168.1.5:8480",
            ),
        ] {
            let mut o = listening(listen, http);
            let e = o.check_listen().unwrap_err();
            assert_eq!((e.what, e.addr.to_string().as_str()), (what, addr));
            let text = e.to_string();
            assert!(text.contains("use --tls require --tls-certificates DIR, or --insecure to accept plaintext on a trusted network"), "{text}");
            o.insecure = true;
            assert_eq!(o.check_listen(), Ok(()));
        }
        let o = listening(Some("0.0.0.0:10809"), None);
        assert_eq!(
            o.check_listen_with(true),
            Ok(()),
            "NBD over TLS may listen anywhere"
        );
        let mut o = listening(Some("0.0.0.0:10809"), Some("10.0.0.1:8480"));
        assert_eq!(
            o.check_listen_with(true).unwrap_err().what,
            "the HTTP API",
            "an API without HTTPS off loopback is refused"
        );
        o.http_tls = Some(PathBuf::from("tls"));
        assert_eq!(
            o.check_listen_with(true),
            Ok(()),
            "the API over HTTPS may listen anywhere"
        );
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let e = ConfigFile::parse("read_cache = \"1G\"").unwrap_err();
        assert!(e.contains("read_cache") && e.contains("read-cache"), "{e}");
        let e = ConfigFile::parse("listen = 5").unwrap_err();
        assert!(e.contains("listen") || e.contains("string"), "{e}");
    }
}
