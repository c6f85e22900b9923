//! `--tls off|on|require`, `--tls-certificates DIR` and `--tls-verify-peer`: the NBD TLS
//! flags shared by `vdstream server`, `serve-image` and the agent's local export, turned
//! into the server's TLS setting. Invariant: a certificate directory with `--tls off`, or
//! `--tls on|require` without one, is refused at start with what to say instead.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{anyhow, Result};
use clap::Args;
use vdstream_nbd::TlsMode;
use vdstream_tls::files::{ClientAuth, ServerTls};

/// The server's NBD TLS flags.
#[derive(Debug, Clone, Args)]
pub struct TlsFlags {
    /// NBD over TLS (NBD_OPT_STARTTLS, nbdkit's words): off (no TLS; every client has full
    /// access, so keep to a unix socket or loopback), on (TLS for clients that ask for it;
    /// plaintext clients are anonymous), require (nothing but TLS: other options get
    /// NBD_REP_ERR_TLS_REQD until the client starts TLS). A session whose client
    /// certificate ca-crl.pem comes to revoke is closed within 5 seconds.
    /// Example: --tls require --tls-certificates /etc/vdstream/tls
    #[arg(long, value_name = "off|on|require", default_value = "off", value_parser = parse_mode)]
    pub tls: TlsMode,

    /// The certificate directory (the layout of qemu's tls-creds-x509 and nbdkit):
    /// ca-cert.pem, server-cert.pem, server-key.pem, optional ca-crl.pem (revocations,
    /// re-read when it changes). Client certificates are verified against ca-cert.pem; a
    /// client without one is anonymous. `vdstream server` also serves its HTTP API (--http)
    /// over HTTPS with it, even with --tls off (then only that).
    #[arg(long, value_name = "DIR")]
    pub tls_certificates: Option<PathBuf>,

    /// Verify client certificates against ca-cert.pem (default true); false asks for
    /// none, so every TLS client is anonymous (encryption without client identities).
    #[arg(long, value_name = "true|false", default_value_t = true, action = clap::ArgAction::Set)]
    pub tls_verify_peer: bool,
}

fn parse_mode(s: &str) -> Result<TlsMode, String> {
    s.parse()
}

impl TlsFlags {
    /// The directory read and checked now (a bad one fails the start), with the mode;
    /// `None` for `--tls off`.
    pub fn server(&self) -> Result<Option<Arc<ServerTls>>> {
        match (self.tls, &self.tls_certificates) {
            (TlsMode::Off, None) => Ok(None),
            (TlsMode::Off, Some(dir)) => Err(anyhow!(
                "--tls-certificates {} was given with --tls off: say --tls on or --tls require to use it, or leave it out",
                dir.display()
            )),
            (mode, None) => Err(anyhow!(
                "--tls {} needs --tls-certificates DIR (ca-cert.pem, server-cert.pem, server-key.pem; `vdstream pki` makes them)",
                mode.as_str()
            )),
            (_, Some(dir)) => {
                let auth = if self.tls_verify_peer { ClientAuth::Verify } else { ClientAuth::Off };
                Ok(Some(Arc::new(ServerTls::new(dir, auth).map_err(|e| anyhow!("--tls-certificates: {e}"))?)))
            }
        }
    }

    /// A line for the start banner.
    pub fn describe(&self) -> String {
        match (&self.tls_certificates, self.tls) {
            (Some(dir), mode) if mode != TlsMode::Off => format!(
                "TLS {} ({}, client certificates {})",
                mode.as_str(),
                dir.display(),
                if self.tls_verify_peer {
                    "verified"
                } else {
                    "not asked for"
                }
            ),
            _ => "TLS off".to_string(),
        }
    }
}
