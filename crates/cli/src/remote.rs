//! `--server URL`: a store command sent to a running server's API instead of the store.
//! The API answers the document the local command would print (both are built by
//! `vdstream_store::documents`), so the command prints it the same way.

//!
//! Credentials: a bearer token from `--token-file FILE`, else VDSTREAM_TOKEN, else the file
//! VDSTREAM_TOKEN_FILE names (never a flag with the token itself: other users see argv);
//! for `https://`, the CA (and client certificate) of `--tls-certificates DIR`, else
//! VDSTREAM_TLS_CERTIFICATES.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use vdstream_agent::client::{read_token_file, Client, Credentials};

/// The `--server` option of the store commands the API serves.
#[derive(Debug, Clone, Args)]
pub struct ServerOpt {
    /// Send the command to a running `vdstream server --http` (http://HOST:PORT or
    /// https://HOST:PORT) instead of the store.
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,

    /// With --server (or an s3:// --store whose metadata writer is on another host): the
    /// API token is the first line of FILE (else $VDSTREAM_TOKEN, else the file
    /// $VDSTREAM_TOKEN_FILE names).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,

    /// With an https:// server: the certificate directory (ca-cert.pem, and
    /// client-cert.pem and client-key.pem if the client shows one). Default:
    /// $VDSTREAM_TLS_CERTIFICATES.
    #[arg(long, value_name = "DIR")]
    pub tls_certificates: Option<PathBuf>,
}

impl ServerOpt {
    /// The API client, when `--server` is given.
    pub fn client(&self) -> Result<Option<Client>> {
        let Some(url) = self.server.as_deref() else {
            return Ok(None);
        };
        let mut c = Credentials::from_env()?;
        if let Some(f) = &self.token_file {
            c = c.with_token(Some(read_token_file(f)?));
        }
        if let Some(d) = &self.tls_certificates {
            c = c.with_tls_dir(Some(d.clone()));
        }
        Ok(Some(Client::with_credentials(url, c)?))
    }
}

impl ServerOpt {
    /// The API client: `--server`, else for a store in object storage whose metadata
    /// writer is on another host, the writer's API (see `output::S3Store`).
    pub fn client_for(&self, o: &crate::output::StoreOpts) -> Result<Option<Client>> {
        if self.server.is_some() {
            return self.client();
        }
        match o.s3()? {
            Some(crate::output::S3Store::Remote { url, location, .. }) => {
                // The URL comes from the bucket: the token goes only where it is safe.
                if !url.starts_with("https://") && !vdstream_server::forwarding::loopback_http(&url)
                {
                    return Err(crate::exit::fail(crate::exit::Kind::Usage, format!(
                        "the metadata writer of {location} is at {url}, plain http on the network: this command's token is not sent there; \
                         serve the writer's API over TLS, or give --server URL yourself to send it anyway")));
                }
                ServerOpt {
                    server: Some(url),
                    ..self.clone()
                }
                .client()
            }
            _ => Ok(None),
        }
    }
}

/// Percent-encodes one path segment (names are checked by the server, as by the store).
pub fn seg(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn segments_are_percent_encoded() {
        assert_eq!(super::seg("win11.a_b-c"), "win11.a_b-c");
        assert_eq!(super::seg("a/b c@é"), "a%2Fb%20c%40%C3%A9");
    }
}
