//! A small blocking JSON client of vdstream's HTTP API, for the CLI's `--server URL` and
//! the agent: one connection per call (`Connection: close`), connect and read timeouts,
//! a bounded response. An error answer of the API (`{"error", "what_to_do"}`) becomes
//! [`ClientError::Api`], whose text is the API's message, so a command prints the same
//! words whether it ran on the store or through a server.

use std::io::{BufReader, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use serde_json::Value;

use crate::wire::{self, Limits};

/// Why a call failed.
#[derive(Debug)]
pub enum ClientError {
    /// The server URL is not `http://HOST:PORT`.
    BadUrl(String),
    /// No connection to the server.
    Connect { url: String, source: std::io::Error },
    /// The connection broke or timed out during the call.
    Io { url: String, source: std::io::Error },
    /// The server's answer is not HTTP or not JSON.
    Protocol { url: String, detail: String },
    /// The API answered with an error.
    Api { status: u16, error: String, what_to_do: String },
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientError::BadUrl(m) => f.write_str(m),
            ClientError::Connect { url, source } => write!(f, "cannot connect to the vdstream server at {url} ({source}): is `vdstream server --http` running there?"),
            ClientError::Io { url, source } => write!(f, "the call to the vdstream server at {url} failed: {source}"),
            ClientError::Protocol { url, detail } => write!(f, "{url} did not answer like a vdstream server: {detail}"),
            ClientError::Api { error, what_to_do, .. } => {
                if what_to_do.is_empty() || error.contains(what_to_do.as_str()) {
                    f.write_str(error)
                } else {
                    write!(f, "{error}: {what_to_do}")
                }
            }
        }
    }
}

impl std::error::Error for ClientError {
    /// None: the OS error of `Connect` and `Io` is already in the message; as `source()`
    /// too, a chain printed with `{:#}` would say it twice.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        None
    }
}

/// A server's API, by its base URL.
#[derive(Debug, Clone)]
pub struct Client {
    url: String,
    host: String,
    port: u16,
    connect_timeout: Duration,
    timeout: Duration,
}

/// Largest answer read (a vDisk or session list of a big site fits easily).
const MAX_RESPONSE: usize = 64 << 20;

impl Client {
    /// `http://HOST:PORT` (a trailing `/` is allowed; `https` is not: there is no TLS yet).
    pub fn new(url: &str) -> Result<Client, ClientError> {
        let bad = |why: &str| ClientError::BadUrl(format!("{url:?} is not a vdstream server URL ({why}): give http://HOST:PORT, e.g. http://127.0.0.1:8480"));
        let rest = url.strip_prefix("http://").ok_or_else(|| bad(if url.starts_with("https://") { "https is not supported yet" } else { "it does not start with http://" }))?;
        let hostport = rest.strip_suffix('/').unwrap_or(rest);
        if hostport.contains('/') || hostport.contains('?') || hostport.contains('@') {
            return Err(bad("only HOST:PORT may follow http://"));
        }
        let (host, port) = hostport.rsplit_once(':').ok_or_else(|| bad("it has no :PORT"))?;
        let port: u16 = port.parse().ok().filter(|p| *p != 0).ok_or_else(|| bad("the port is not a number from 1 to 65535"))?;
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        if host.is_empty() {
            return Err(bad("the host is empty"));
        }
        Ok(Client {
            url: format!("http://{hostport}"),
            host: host.to_string(),
            port,
            connect_timeout: Duration::from_secs(5),
            timeout: Duration::from_secs(600),
        })
    }

    /// How long a call may wait for its answer (default 10 minutes: a merge can be long).
    pub fn with_timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    fn connect(&self) -> Result<TcpStream, ClientError> {
        let connect_err = |source| ClientError::Connect { url: self.url.clone(), source };
        let addrs = (self.host.as_str(), self.port).to_socket_addrs().map_err(connect_err)?;
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "the host name has no address");
        for a in addrs {
            match TcpStream::connect_timeout(&a, self.connect_timeout) {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        Err(connect_err(last))
    }

    /// One call: `method` on `path` (e.g. `/api/v1/targets`), with a JSON body or none.
    /// Returns the answer's JSON on a 2xx status.
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, ClientError> {
        let io_err = |source| ClientError::Io { url: self.url.clone(), source };
        let mut stream = self.connect()?;
        stream.set_read_timeout(Some(self.timeout)).map_err(io_err)?;
        stream.set_write_timeout(Some(self.timeout)).map_err(io_err)?;
        let body = body.map(|b| serde_json::to_vec(b).expect("JSON values serialize")).unwrap_or_default();
        let host = if self.host.contains(':') { format!("[{}]:{}", self.host, self.port) } else { format!("{}:{}", self.host, self.port) };
        let mut msg = format!(
            "{method} {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: vdstream/{}\r\nAccept: application/json\r\nConnection: close\r\n",
            env!("CARGO_PKG_VERSION")
        );
        if !body.is_empty() || matches!(method, "POST" | "PUT") {
            msg.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
        }
        msg.push_str("\r\n");
        let mut bytes = msg.into_bytes();
        bytes.extend_from_slice(&body);
        stream.write_all(&bytes).map_err(io_err)?;
        let limits = Limits { max_head: 64 << 10, max_body: MAX_RESPONSE };
        let resp = wire::read_response(&mut BufReader::new(stream), &limits).map_err(|e| match e {
            wire::WireError::Io(source) => ClientError::Io { url: self.url.clone(), source },
            wire::WireError::Timeout => ClientError::Io { url: self.url.clone(), source: std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no answer within {:?}", self.timeout)) },
            other => ClientError::Protocol { url: self.url.clone(), detail: other.to_string() },
        })?;
        let json: Result<Value, _> = serde_json::from_slice(&resp.body);
        match (resp.status, json) {
            (200..=299, Ok(v)) => Ok(v),
            (200..=299, Err(e)) => Err(ClientError::Protocol { url: self.url.clone(), detail: format!("the answer to {method} {path} is not JSON ({e})") }),
            (status, Ok(v)) if v.get("error").and_then(Value::as_str).is_some() => Err(ClientError::Api {
                status,
                error: v["error"].as_str().unwrap_or_default().to_string(),
                what_to_do: v.get("what_to_do").and_then(Value::as_str).unwrap_or_default().to_string(),
            }),
            (status, _) => Err(ClientError::Protocol {
                url: self.url.clone(),
                detail: format!("{method} {path} got status {status} without a vdstream error document: {}", String::from_utf8_lossy(&resp.body[..resp.body.len().min(200)])),
            }),
        }
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
        let c = Client::new("http://127.0.0.1:8480/").unwrap();
        assert_eq!((c.url(), c.host.as_str(), c.port), ("http://127.0.0.1:8480", "127.0.0.1", 8480));
        assert_eq!(Client::new("http://[::1]:80").unwrap().host, "::1");
        for (bad, why) in [
            ("127.0.0.1:8480", "does not start with http://"),
            ("https://h:1", "https is not supported"),
            ("http://h", "no :PORT"),
            ("http://h:0", "port"),
            ("http://h:1/api", "only HOST:PORT"),
            ("http://:1", "host is empty"),
        ] {
            let e = Client::new(bad).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("http://HOST:PORT"), "{bad}: {e}");
        }
    }

    #[test]
    fn api_errors_read_as_their_message() {
        let e = ClientError::Api { status: 404, error: "no vDisk named \"x\"".into(), what_to_do: "known vDisks: a".into() };
        assert_eq!(e.to_string(), "no vDisk named \"x\": known vDisks: a");
        let e = ClientError::Api { status: 409, error: "in use: stop it".into(), what_to_do: "stop it".into() };
        assert_eq!(e.to_string(), "in use: stop it");
    }
}
