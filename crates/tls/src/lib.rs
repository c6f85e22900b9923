//! vdstream's TLS, shared by the NBD server and client, the agent and the HTTP API.
//!
//! - [`files`]: a certificate directory in the layout qemu's `tls-creds-x509` and nbdkit
//!   read (`ca-cert.pem`, `server-cert.pem`, `server-key.pem`, `client-cert.pem`,
//!   `client-key.pem`, optional `ca-crl.pem`) turned into rustls server and client
//!   configurations, with client certificates verified against `ca-cert.pem`.
//! - [`peer`]: the [`Identity`] a verified peer certificate names (its role URI).
//! - [`pki`]: the small certificate authority behind `vdstream pki init|issue|revoke`.

pub mod files;
pub mod link;
pub mod peer;
pub mod pki;

/// The rustls this crate builds its configurations with (so callers name the same types).
pub use rustls;
pub use vdstream_contract::Identity;

/// A TLS setup that cannot be used; the message names the file and what to do.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {why}")]
    File {
        path: std::path::PathBuf,
        why: String,
    },
    #[error("{0}")]
    Config(String),
}
