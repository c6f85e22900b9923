//! The blocking JSON client of vdstream's HTTP API, on `ureq`: the CLI's `--server URL`
//! and the agent's placement calls and reports use it. A leaf module (it knows nothing of
//! vDisks or targets), here because the CLI and the server's tests depend on the agent,
//! and the agent must not depend on the server.
//!
//! Credentials ([`Credentials`]): a bearer token, sent as `Authorization: Bearer` on every
//! call, and for `https://` URLs a certificate directory (`ca-cert.pem` verifies the server;
//! `client-cert.pem` and `client-key.pem`, when present, are shown to it). [`Client::new`]
//! takes them from the environment: `VDSTREAM_TOKEN`, else the file named by
//! `VDSTREAM_TOKEN_FILE`; `VDSTREAM_TLS_CERTIFICATES`. A token never appears in an error
//! or `Debug` text.
//!
//! Invariants: a connect timeout of 5 s and a whole-call timeout ([`Client::with_timeout`],
//! default 10 minutes: a merge can be long); no connection is kept between calls (the
//! server closes idle ones); an answer is read up to [`MAX_RESPONSE`] bytes. An error
//! answer of the API (`{"error", "what_to_do"}`) becomes [`ClientError::Api`], whose text
//! is the API's message, so a command prints the same words whether it ran on the store
//! or through a server.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server URL is not `http(s)://HOST:PORT`.
    #[error("{0}")]
    BadUrl(String),
    /// A token file or certificate directory cannot be used.
    #[error("{0}")]
    Credentials(String),
    /// No connection to the server. (The OS error is in the message, not `source()`,
    /// so that a chain printed with `{:#}` says it once.)
    #[error("cannot connect to the vdstream server at {url} ({err}): is `vdstream server --http` running there?")]
    Connect { url: String, err: std::io::Error },
    /// The connection broke or timed out during the call.
    #[error("the call to the vdstream server at {url} failed: {err}")]
    Io { url: String, err: std::io::Error },
    /// The server's answer is not HTTP or not JSON.
    #[error("{url} did not answer like a vdstream server: {detail}")]
    Protocol { url: String, detail: String },
    /// The API answered with an error.
    #[error("{}", api_message(.error, .what_to_do))]
    Api {
        status: u16,
        error: String,
        what_to_do: String,
    },
}

fn api_message(error: &str, what_to_do: &str) -> String {
    if what_to_do.is_empty() || error.contains(what_to_do) {
        error.to_string()
    } else {
        format!("{error}: {what_to_do}")
    }
}

/// Largest answer read (a vDisk or session list of a big site fits easily).
pub const MAX_RESPONSE: u64 = 64 << 20;

/// What a client shows the server: a bearer token and, for https, a certificate directory.
#[derive(Clone, Default)]
pub struct Credentials {
    token: Option<Arc<str>>,
    tls_dir: Option<PathBuf>,
    /// Show no client certificate even when the directory has one.
    no_client_cert: bool,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("token", &self.token.as_ref().map(|_| "<hidden>"))
            .field("tls_dir", &self.tls_dir)
            .finish()
    }
}

/// Reads a token from `path`: its first line, trimmed.
pub fn read_token_file(path: &Path) -> Result<String, ClientError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        ClientError::Credentials(format!(
            "cannot read the token file {}: {e}",
            path.display()
        ))
    })?;
    let token = text.lines().next().unwrap_or("").trim().to_string();
    if token.is_empty() {
        return Err(ClientError::Credentials(format!(
            "the token file {} is empty: put the token `vdstream token add` printed in it",
            path.display()
        )));
    }
    Ok(token)
}

impl Credentials {
    /// `VDSTREAM_TOKEN`, else the file `VDSTREAM_TOKEN_FILE` names; `VDSTREAM_TLS_CERTIFICATES`.
    pub fn from_env() -> Result<Credentials, ClientError> {
        let token = match (
            std::env::var("VDSTREAM_TOKEN")
                .ok()
                .filter(|t| !t.trim().is_empty()),
            std::env::var_os("VDSTREAM_TOKEN_FILE"),
        ) {
            (Some(t), _) => Some(t.trim().to_string()),
            (None, Some(f)) if !f.is_empty() => Some(read_token_file(Path::new(&f))?),
            _ => None,
        };
        let tls_dir = std::env::var_os("VDSTREAM_TLS_CERTIFICATES")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from);
        Ok(Credentials {
            token: token.map(Into::into),
            tls_dir,
            no_client_cert: false,
        })
    }

    /// Only the CA of `dir` (to verify the server); no client certificate is shown, so
    /// that a relayed call acts as its own caller, never as this process's identity.
    pub fn ca_only(dir: Option<PathBuf>) -> Self {
        Credentials {
            token: None,
            tls_dir: dir,
            no_client_cert: true,
        }
    }

    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token.map(Into::into);
        self
    }

    pub fn with_tls_dir(mut self, dir: Option<PathBuf>) -> Self {
        self.tls_dir = dir;
        self
    }

    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// ureq's TLS settings from the certificate directory.
    fn tls_config(&self) -> Result<ureq::tls::TlsConfig, ClientError> {
        use ureq::tls::{Certificate, ClientCert, PrivateKey, RootCerts, TlsConfig, TlsProvider};
        let dir = self.tls_dir.as_deref().ok_or_else(|| ClientError::Credentials("an https:// server needs a certificate directory with its CA: give --tls-certificates DIR (or VDSTREAM_TLS_CERTIFICATES)".into()))?;
        let bad = |e: vdstream_tls::TlsError| ClientError::Credentials(e.to_string());
        let roots: Vec<Certificate<'static>> =
            vdstream_tls::files::read_certs(&dir.join("ca-cert.pem"))
                .map_err(bad)?
                .iter()
                .map(|c| Certificate::from_der(c.as_ref()).to_owned())
                .collect();
        let (cert_path, key_path) = (dir.join("client-cert.pem"), dir.join("client-key.pem"));
        let client_cert = if !self.no_client_cert && (cert_path.exists() || key_path.exists()) {
            let chain: Vec<Certificate<'static>> = vdstream_tls::files::read_certs(&cert_path)
                .map_err(bad)?
                .iter()
                .map(|c| Certificate::from_der(c.as_ref()).to_owned())
                .collect();
            let pem = std::fs::read(&key_path).map_err(|e| {
                ClientError::Credentials(format!("cannot read {}: {e}", key_path.display()))
            })?;
            let key = PrivateKey::from_pem(&pem).map_err(|e| {
                ClientError::Credentials(format!(
                    "{}: not a private key in PEM: {e}",
                    key_path.display()
                ))
            })?;
            Some(ClientCert::new_with_certs(&chain, key))
        } else {
            None
        };
        Ok(TlsConfig::builder()
            .provider(TlsProvider::Rustls)
            .unversioned_rustls_crypto_provider(vdstream_tls::files::provider())
            .root_certs(RootCerts::new_with_certs(&roots))
            .client_cert(client_cert)
            .build())
    }
}

/// An answer passed through as it came ([`Client::relay`]).
#[derive(Debug)]
pub struct Relayed {
    pub status: u16,
    pub content_type: Option<String>,
    pub etag: Option<String>,
    pub body: Vec<u8>,
}

/// A server's API, by its base URL.
#[derive(Debug, Clone)]
pub struct Client {
    url: String,
    /// `If-Match` sent with every call ([`Client::if_match`]).
    if_match: Option<String>,
    timeout: Duration,
    credentials: Credentials,
    tls: Option<ureq::tls::TlsConfig>,
    agent: ureq::Agent,
}

fn agent(timeout: Duration, tls: Option<&ureq::tls::TlsConfig>) -> ureq::Agent {
    let b = ureq::Agent::config_builder()
        .timeout_connect(Some(Duration::from_secs(5)))
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .max_idle_connections(0)
        .max_redirects(0)
        .user_agent(concat!("vdstream/", env!("CARGO_PKG_VERSION")));
    match tls {
        Some(t) => b.tls_config(t.clone()).build().into(),
        None => b.build().into(),
    }
}

impl Client {
    /// `http://HOST:PORT` or `https://HOST:PORT` (a trailing `/` is allowed), with the
    /// credentials of the environment ([`Credentials::from_env`]).
    pub fn new(url: &str) -> Result<Client, ClientError> {
        Client::with_credentials(url, Credentials::from_env()?)
    }

    /// Like [`Client::new`], with these credentials.
    pub fn with_credentials(url: &str, credentials: Credentials) -> Result<Client, ClientError> {
        let bad = |why: &str| {
            ClientError::BadUrl(format!("{url:?} is not a vdstream server URL ({why}): give http://HOST:PORT or https://HOST:PORT, e.g. http://127.0.0.1:8480"))
        };
        let (scheme, rest) = match (url.strip_prefix("http://"), url.strip_prefix("https://")) {
            (Some(r), _) => ("http", r),
            (_, Some(r)) => ("https", r),
            _ => return Err(bad("it does not start with http:// or https://")),
        };
        let hostport = rest.strip_suffix('/').unwrap_or(rest);
        if hostport.contains('/') || hostport.contains('?') || hostport.contains('@') {
            return Err(bad("only HOST:PORT may follow the scheme"));
        }
        let (host, port) = hostport
            .rsplit_once(':')
            .ok_or_else(|| bad("it has no :PORT"))?;
        port.parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| bad("the port is not a number from 1 to 65535"))?;
        if host.is_empty() || host == "[]" {
            return Err(bad("the host is empty"));
        }
        let tls = if scheme == "https" {
            Some(credentials.tls_config()?)
        } else {
            None
        };
        let timeout = Duration::from_secs(600);
        let agent = agent(timeout, tls.as_ref());
        Ok(Client {
            url: format!("{scheme}://{hostport}"),
            if_match: None,
            timeout,
            credentials,
            tls,
            agent,
        })
    }

    /// How long a call may take in all (default 10 minutes: a merge can be long).
    pub fn with_timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self.agent = agent(t, self.tls.as_ref());
        self
    }

    /// Sends `If-Match: "G"` with each call: a change is made only if the vDisk's metadata
    /// is still at generation `G` (else 412).
    pub fn if_match(mut self, generation: Option<u64>) -> Self {
        self.if_match = generation.map(|g| format!("\"{g}\""));
        self
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    fn error(&self, e: ureq::Error) -> ClientError {
        let url = self.url.clone();
        match e {
            ureq::Error::Io(err)
                if matches!(
                    err.kind(),
                    ErrorKind::ConnectionRefused
                        | ErrorKind::AddrNotAvailable
                        | ErrorKind::NotFound
                ) =>
            {
                ClientError::Connect { url, err }
            }
            ureq::Error::Io(err) => ClientError::Io { url, err },
            ureq::Error::HostNotFound => ClientError::Connect {
                url,
                err: std::io::Error::new(ErrorKind::NotFound, "the host name has no address"),
            },
            ureq::Error::ConnectionFailed => ClientError::Connect {
                url,
                err: ErrorKind::ConnectionRefused.into(),
            },
            ureq::Error::Timeout(ureq::Timeout::Connect | ureq::Timeout::Resolve) => {
                ClientError::Connect {
                    url,
                    err: ErrorKind::TimedOut.into(),
                }
            }
            ureq::Error::Timeout(_) => ClientError::Io {
                url,
                err: std::io::Error::new(
                    ErrorKind::TimedOut,
                    format!("no answer within {:?}", self.timeout),
                ),
            },
            other => ClientError::Protocol {
                url,
                detail: other.to_string(),
            },
        }
    }

    /// One call: `method` on `path` (e.g. `/api/v1/targets`), with a JSON body or none.
    /// Returns the answer's JSON on a 2xx status.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, ClientError> {
        let mut req = ureq::http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.url))
            .header("Accept", "application/json");
        if let Some(t) = &self.credentials.token {
            req = req.header("Authorization", format!("Bearer {t}"));
        }
        if let Some(g) = &self.if_match {
            req = req.header("If-Match", g);
        }
        let sent = match body {
            Some(b) => {
                let bytes = serde_json::to_vec(b).expect("JSON values serialize");
                req.header("Content-Type", "application/json")
                    .body(bytes)
                    .map(|r| self.agent.run(r))
            }
            None => req.body(()).map(|r| self.agent.run(r)),
        };
        let mut resp = sent
            .map_err(|e| {
                ClientError::BadUrl(format!(
                    "{method} {}{path} is not a valid request: {e}",
                    self.url
                ))
            })?
            .map_err(|e| self.error(e))?;
        let status = resp.status().as_u16();
        let bytes = resp
            .body_mut()
            .with_config()
            .limit(MAX_RESPONSE)
            .read_to_vec()
            .map_err(|e| self.error(e))?;
        match (status, serde_json::from_slice::<Value>(&bytes)) {
            (200..=299, Ok(v)) => Ok(v),
            (200..=299, Err(e)) => Err(ClientError::Protocol {
                url: self.url.clone(),
                detail: format!("the answer to {method} {path} is not JSON ({e})"),
            }),
            (status, Ok(v)) if v.get("error").and_then(Value::as_str).is_some() => {
                Err(ClientError::Api {
                    status,
                    error: v["error"].as_str().unwrap_or_default().to_string(),
                    what_to_do: v
                        .get("what_to_do")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                })
            }
            (status, _) => Err(ClientError::Protocol {
                url: self.url.clone(),
                detail: format!(
                    "{method} {path} got status {status} without a vdstream error document: {}",
                    String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
                ),
            }),
        }
    }

    /// One call passed through as it is (a mirror sends a change to the store's metadata
    /// writer): `headers` as given (no token of this client's), the answer's status,
    /// `Content-Type`, `ETag` and body whatever they are.
    pub fn relay(
        &self,
        method: &str,
        path: &str,
        headers: &[(String, String)],
        body: Vec<u8>,
    ) -> Result<Relayed, ClientError> {
        let mut req = ureq::http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.url));
        for (k, v) in headers {
            req = req.header(k.as_str(), v.as_str());
        }
        let mut resp = req
            .body(body)
            .map(|r| self.agent.run(r))
            .map_err(|e| {
                ClientError::BadUrl(format!(
                    "{method} {}{path} is not a valid request: {e}",
                    self.url
                ))
            })?
            .map_err(|e| self.error(e))?;
        let header = |h: &str| {
            resp.headers()
                .get(h)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let (ct, etag) = (header("content-type"), header("etag"));
        let bytes = resp
            .body_mut()
            .with_config()
            .limit(MAX_RESPONSE)
            .read_to_vec()
            .map_err(|e| self.error(e))?;
        Ok(Relayed {
            status: resp.status().as_u16(),
            content_type: ct,
            etag,
            body: bytes,
        })
    }

    pub fn get(&self, path: &str) -> Result<Value, ClientError> {
        self.call("GET", path, None)
    }

    pub fn post(&self, path: &str, body: &Value) -> Result<Value, ClientError> {
        self.call("POST", path, Some(body))
    }

    pub fn put(&self, path: &str, body: &Value) -> Result<Value, ClientError> {
        self.call("PUT", path, Some(body))
    }

    pub fn delete(&self, path: &str) -> Result<Value, ClientError> {
        self.call("DELETE", path, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_http_host_port() {
        assert_eq!(
            Client::new("http://127.0.0.1:8480/").unwrap().url(),
            "http://127.0.0.1:8480"
        );
        assert_eq!(
            Client::new("http://[::1]:80").unwrap().url(),
            "http://[::1]:80"
        );
        for (bad, why) in [
            ("127.0.0.1:8480", "does not start with http://"),
            ("ftp://h:1", "does not start with http:// or https://"),
            ("http://h", "no :PORT"),
            ("http://h:0", "port"),
            ("http://h:1/api", "only HOST:PORT"),
            ("http://:1", "host is empty"),
        ] {
            let e = Client::new(bad).unwrap_err().to_string();
            assert!(
                e.contains(why) && e.contains("http://HOST:PORT"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn api_errors_read_as_their_message() {
        let e = ClientError::Api {
            status: 404,
            error: "no vDisk named \"x\"".into(),
            what_to_do: "known vDisks: a".into(),
        };
        assert_eq!(e.to_string(), "no vDisk named \"x\": known vDisks: a");
        let e = ClientError::Api {
            status: 409,
            error: "in use: stop it".into(),
            what_to_do: "stop it".into(),
        };
        assert_eq!(e.to_string(), "in use: stop it");
    }

    #[test]
    fn a_server_that_is_not_there_is_a_connect_error() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = Client::new(&format!("http://127.0.0.1:{port}"))
            .unwrap()
            .get("/api/v1/server")
            .unwrap_err();
        assert!(matches!(e, ClientError::Connect { .. }), "{e:?}");
        assert!(
            e.to_string()
                .starts_with("cannot connect to the vdstream server at http://127.0.0.1:"),
            "{e}"
        );
    }
}
