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
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

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
    /// NBD over TLS: the certificate directory (`--tls-certificates`), `None` for `--tls off`.
    pub nbd_tls: Option<std::sync::Arc<vdstream_tls::files::ServerTls>>,
    /// `--tls on|require` (with `nbd_tls`).
    pub nbd_tls_mode: vdstream_nbd::TlsMode,
}

/// A size in the file: `"256M"` or a number of bytes.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum SizeValue {
    Bytes(u64),
    Text(String),
}

/// The `--config` file, as written.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
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
}

impl ConfigFile {
    /// Reads and parses `path`; the error names the file and what is wrong in it.
    pub fn load(path: &Path) -> Result<ConfigFile, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read the config file {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("the config file {} is not valid: {e}", path.display()))
    }

    /// Parses the text of a config file.
    pub fn parse(text: &str) -> Result<ConfigFile, String> {
        toml::from_str(text).map_err(|e| {
            format!("{}; its keys are the flags of `vdstream server`: store, listen, socket, http, read-cache, name, stats-file, dead-peer-timeout, max-connections", e.message())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_the_flag_names() {
        let c = ConfigFile::parse("store = \"/s\"\nlisten = \"127.0.0.1:10809\"\nread-cache = \"1G\"\nname = \"pvs1\"\n").unwrap();
        assert_eq!(c.store, Some(PathBuf::from("/s")));
        assert_eq!(c.read_cache, Some(SizeValue::Text("1G".into())));
        assert_eq!(ConfigFile::parse("read-cache = 0").unwrap().read_cache, Some(SizeValue::Bytes(0)));
        assert_eq!(ConfigFile::parse("").unwrap(), ConfigFile::default());
        assert_eq!(ConfigFile::parse("http = \"127.0.0.1:8480\"").unwrap().http.as_deref(), Some("127.0.0.1:8480"));
        assert_eq!(ConfigFile::parse("dead-peer-timeout = 20").unwrap().dead_peer_timeout, Some(20));
        assert_eq!(ConfigFile::parse("max-connections = 200").unwrap().max_connections, Some(200));
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let e = ConfigFile::parse("read_cache = \"1G\"").unwrap_err();
        assert!(e.contains("read_cache") && e.contains("read-cache"), "{e}");
        let e = ConfigFile::parse("listen = 5").unwrap_err();
        assert!(e.contains("listen") || e.contains("string"), "{e}");
    }
}
