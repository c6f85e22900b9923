//! What a mirror of a store in object storage needs to send its API's changes to the
//! store's metadata writer: the request, the answer, the [`Forward`] that carries them,
//! and [`ToWriter`], the one a mirror uses (`object_store` makes it), with the rule of
//! where a change may go. The middleware that uses them is `http::forward`.

use std::path::PathBuf;
use std::sync::Arc;

/// A change to send to the writer.
#[derive(Debug, Clone)]
pub struct ForwardRequest {
    pub method: String,
    /// Path and query (`/api/v1/vdisks/golden/revert`).
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// The writer's answer.
#[derive(Debug, Clone)]
pub struct ForwardAnswer {
    pub status: u16,
    pub content_type: Option<String>,
    pub etag: Option<String>,
    pub body: Vec<u8>,
    /// The writer's URL, for the log.
    pub writer: String,
}

/// Why a change has no answer from the writer.
#[derive(Debug, Clone)]
pub enum ForwardError {
    /// It was not sent (no writer named, not reachable, not a safe URL): nothing changed.
    NotSent(String),
    /// It was sent and the answer was lost (timeout, broken connection): the writer may
    /// have made it.
    Unknown(String),
}

/// Sends a change to the store's metadata writer (blocking; run off the runtime).
pub trait Forward: Send + Sync {
    fn forward(&self, req: ForwardRequest) -> Result<ForwardAnswer, ForwardError>;
}

/// The server's forwarder (`None`: this server changes its own store).
#[derive(Clone)]
pub struct Forwarder(pub Arc<dyn Forward>);

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Forwarder")
    }
}

/// A mirror's way to its store's metadata writer: the URL in the mirror's copy of
/// `writer.json` (read again every 2 s, so a new writer is found), with this server's
/// certificate directory for an https:// writer.
///
/// A change carries its caller's token, and `writer.json` is only as trusted as the
/// bucket's keys, so a change goes only where the token is safe: an https:// writer (its
/// certificate checked against the farm's CA), or plain http on loopback, or anywhere
/// with --insecure (a trusted network, as for this server's own listeners).
pub(crate) struct ToWriter {
    /// The mirror's folder (its copy of `writer.json`).
    pub dir: PathBuf,
    /// The store's `s3://` location, for the errors.
    pub location: String,
    /// `--tls-certificates`: the CA an https:// writer's certificate is checked against.
    pub tls: Option<PathBuf>,
    /// `--insecure`: plain http to a writer off loopback is allowed.
    pub insecure: bool,
}

impl Forward for ToWriter {
    fn forward(&self, req: ForwardRequest) -> Result<ForwardAnswer, ForwardError> {
        use vdstream_objstore::writer::WriterRecord;
        let rec = WriterRecord::read_local(&self.dir).ok_or_else(|| {
            ForwardError::NotSent(format!(
                "no server is the metadata writer of {}, so it takes no changes now",
                self.location
            ))
        })?;
        if !rec.url.starts_with("https://") && !loopback_http(&rec.url) && !self.insecure {
            return Err(ForwardError::NotSent(format!(
                "the metadata writer of {} is at {}, plain http on the network: a change carries its caller's token, so it is not sent there; \
                 serve the writer's API over TLS (--tls-certificates), or start this server with --insecure on a trusted network",
                self.location, rec.url)));
        }
        let creds = vdstream_agent::client::Credentials::ca_only(self.tls.clone());
        let client = vdstream_agent::client::Client::with_credentials(&rec.url, creds)
            .map_err(|e| ForwardError::NotSent(e.to_string()))?;
        let r = client
            .relay(&req.method, &req.path, &req.headers, req.body)
            .map_err(|e| match e {
                vdstream_agent::client::ClientError::Connect { .. } => {
                    ForwardError::NotSent(e.to_string())
                }
                other => ForwardError::Unknown(other.to_string()),
            })?;
        Ok(ForwardAnswer {
            status: r.status,
            content_type: r.content_type,
            etag: r.etag,
            body: r.body,
            writer: rec.url,
        })
    }
}

/// Whether `url` is `http://` to a loopback address (127.0.0.0/8, [::1], localhost): a
/// plaintext API where a token cannot be overheard.
pub fn loopback_http(url: &str) -> bool {
    let Some(rest) = url.strip_prefix("http://") else {
        return false;
    };
    let host = rest.rsplit_once(':').map_or(rest, |(h, _)| h);
    host == "localhost"
        || host
            .trim_matches(|c| c == '[' || c == ']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::loopback_http;

    #[test]
    fn only_loopback_http_is_plain() {
        for yes in [
            "http://127.0.0.1:8480",
            "http://127.3.4.5:1",
            "http://[::1]:8480",
            "http://localhost:8480",
        ] {
            assert!(loopback_http(yes), "{yes}");
        }
        for no in [
            "http://10.0.0.1:8480",
            "https://127.0.0.1:8480",
            "http://127.0.0.1.evil.example:80",
            "http://[::2]:1",
            "ftp://127.0.0.1:1",
        ] {
            assert!(!loopback_http(no), "{no}");
        }
    }
}
