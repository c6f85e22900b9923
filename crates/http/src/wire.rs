//! HTTP/1.1 messages on the wire (RFC 9112), as much as vdstream's API needs: a request
//! or response head, then a body of `Content-Length` bytes. Every read is bounded before
//! anything is allocated from what the peer said: the head by [`Limits::max_head`] bytes
//! (and [`MAX_HEADERS`] fields), the body by [`Limits::max_body`], checked against
//! `Content-Length` before a byte of it is read. Chunked bodies are refused.
//!
//! Errors say which rule the peer broke; the server answers [`WireError::status`] and
//! closes the connection, so a malformed message costs only its own connection.

use std::io::{self, BufRead, Read, Write};

/// Most header fields in one message.
pub const MAX_HEADERS: usize = 64;

/// Size limits of one message.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Request or status line plus header fields, in bytes.
    pub max_head: usize,
    pub max_body: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_head: 16 << 10, max_body: 1 << 20 }
    }
}

/// Why a message could not be read.
#[derive(Debug)]
pub enum WireError {
    /// The peer closed the connection before the first byte of a message (not an error
    /// between keep-alive requests).
    Closed,
    /// Not a well-formed HTTP/1.x message; the text says what is wrong.
    Malformed(String),
    /// The head is over [`Limits::max_head`] or has more than [`MAX_HEADERS`] fields.
    HeadTooLarge(usize),
    /// `Content-Length` is over [`Limits::max_body`].
    BodyTooLarge { length: u64, limit: usize },
    /// The peer was too slow: the read timeout or the deadline passed.
    Timeout,
    Io(io::Error),
}

impl WireError {
    /// The status a server answers with (the connection is closed after it).
    pub fn status(&self) -> u16 {
        match self {
            WireError::BodyTooLarge { .. } => 413,
            WireError::HeadTooLarge(_) => 431,
            WireError::Timeout => 408,
            _ => 400,
        }
    }
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::Closed => f.write_str("the connection closed"),
            WireError::Malformed(m) => write!(f, "malformed HTTP message: {m}"),
            WireError::HeadTooLarge(n) => write!(f, "the message head is over {n} bytes or {MAX_HEADERS} header fields"),
            WireError::BodyTooLarge { length, limit } => write!(f, "the body is {length} bytes, over the limit of {limit}"),
            WireError::Timeout => f.write_str("the peer sent nothing for too long"),
            WireError::Io(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for WireError {}

fn from_io(e: io::Error) -> WireError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => WireError::Timeout,
        _ => WireError::Io(e),
    }
}

fn malformed<T>(m: impl Into<String>) -> Result<T, WireError> {
    Err(WireError::Malformed(m.into()))
}

/// A request as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// The path, still percent-encoded, without the query.
    pub path: String,
    /// What follows `?`, if anything.
    pub query: String,
    /// `1` for HTTP/1.1, `0` for HTTP/1.0.
    pub minor: u8,
    /// Field names in lower case, values trimmed.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// A response as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
}

impl Request {
    /// The value of a header field (`name` in lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }

    /// Whether the connection stays open after the response.
    pub fn keep_alive(&self) -> bool {
        let conn = self.header("connection").unwrap_or("").to_ascii_lowercase();
        if self.minor == 0 {
            conn.split(',').any(|t| t.trim() == "keep-alive")
        } else {
            !conn.split(',').any(|t| t.trim() == "close")
        }
    }
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }
}

/// Reads the lines of a head: the start line and the header fields, up to the empty line.
fn read_head<R: BufRead>(r: &mut R, limits: &Limits) -> Result<(String, Vec<(String, String)>), WireError> {
    let mut used = 0usize;
    let mut start: Option<String> = None;
    let mut headers = Vec::new();
    loop {
        let mut line = Vec::new();
        let room = (limits.max_head - used.min(limits.max_head)) as u64;
        let n = r.by_ref().take(room + 1).read_until(b'\n', &mut line).map_err(from_io)?;
        used += n;
        if n == 0 {
            return if start.is_none() && used == 0 { Err(WireError::Closed) } else { malformed("the connection closed in the middle of the head") };
        }
        if used > limits.max_head {
            return Err(WireError::HeadTooLarge(limits.max_head));
        }
        if line.last() != Some(&b'\n') {
            return malformed("the connection closed in the middle of the head");
        }
        line.pop();
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        let Ok(line) = String::from_utf8(line) else { return malformed("the head is not UTF-8") };
        match &start {
            // Empty lines before the start line are allowed (RFC 9112, 2.2).
            None if line.is_empty() => continue,
            None => start = Some(line),
            Some(_) if line.is_empty() => break,
            Some(_) => {
                if line.starts_with([' ', '\t']) {
                    return malformed("folded header lines are not allowed");
                }
                let Some((name, value)) = line.split_once(':') else { return malformed(format!("header line {line:?} has no ':'")) };
                if name.is_empty() || !name.bytes().all(is_token) {
                    return malformed(format!("{name:?} is not a header field name"));
                }
                if value.chars().any(|c| c.is_control() && c != '\t') {
                    return malformed(format!("header {name} has a control character"));
                }
                if headers.len() == MAX_HEADERS {
                    return Err(WireError::HeadTooLarge(limits.max_head));
                }
                headers.push((name.to_ascii_lowercase(), value.trim().to_string()));
            }
        }
    }
    Ok((start.expect("a start line was read"), headers))
}

fn is_token(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn parse_version(v: &str) -> Result<u8, WireError> {
    match v {
        "HTTP/1.1" => Ok(1),
        "HTTP/1.0" => Ok(0),
        other => malformed(format!("{other:?} is not HTTP/1.0 or HTTP/1.1")),
    }
}

/// The body length the head announces (`None`: no `Content-Length`).
fn content_length(headers: &[(String, String)], limits: &Limits) -> Result<Option<usize>, WireError> {
    if headers.iter().any(|(n, _)| n == "transfer-encoding") {
        return malformed("Transfer-Encoding (chunked bodies) is not supported: send Content-Length");
    }
    let mut length: Option<u64> = None;
    for (_, v) in headers.iter().filter(|(n, _)| n == "content-length") {
        if v.is_empty() || v.len() > 19 || !v.bytes().all(|b| b.is_ascii_digit()) {
            return malformed(format!("Content-Length {v:?} is not a number of bytes"));
        }
        let n: u64 = v.parse().map_err(|_| WireError::Malformed(format!("Content-Length {v:?} is out of range")))?;
        if length.is_some_and(|l| l != n) {
            return malformed("two different Content-Length fields");
        }
        length = Some(n);
    }
    match length {
        Some(n) if n > limits.max_body as u64 => Err(WireError::BodyTooLarge { length: n, limit: limits.max_body }),
        Some(n) => Ok(Some(n as usize)),
        None => Ok(None),
    }
}

fn read_body<R: Read>(r: &mut R, len: usize) -> Result<Vec<u8>, WireError> {
    let mut body = vec![0u8; len];
    let mut got = 0;
    while got < len {
        match r.read(&mut body[got..]) {
            Ok(0) => return malformed(format!("the body ended after {got} of {len} bytes (Content-Length)")),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(from_io(e)),
        }
    }
    Ok(body)
}

/// Reads one request. `Err(WireError::Closed)` when the peer closed before sending one.
pub fn read_request<R: BufRead>(r: &mut R, limits: &Limits) -> Result<Request, WireError> {
    let (start, headers) = read_head(r, limits)?;
    let mut parts = start.split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return malformed(format!("{start:?} is not a request line (METHOD /path HTTP/1.1)"));
    };
    if method.is_empty() || !method.bytes().all(is_token) {
        return malformed(format!("{method:?} is not a method"));
    }
    if !target.starts_with('/') || !target.bytes().all(|b| b.is_ascii_graphic()) {
        return malformed(format!("{target:?} is not a path"));
    }
    let minor = parse_version(version)?;
    if minor == 1 && header(&headers, "host").is_none() {
        return malformed("an HTTP/1.1 request needs a Host field");
    }
    let len = content_length(&headers, limits)?.unwrap_or(0);
    let body = read_body(r, len)?;
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_string(), q.to_string()),
        None => (target.to_string(), String::new()),
    };
    Ok(Request { method: method.to_string(), path, query, minor, headers, body })
}

/// Reads one response. Without `Content-Length`, the body runs to the end of the
/// connection (bounded by `max_body`).
pub fn read_response<R: BufRead>(r: &mut R, limits: &Limits) -> Result<Response, WireError> {
    let (start, headers) = read_head(r, limits)?;
    let mut parts = start.splitn(3, ' ');
    let (Some(version), Some(code)) = (parts.next(), parts.next()) else {
        return malformed(format!("{start:?} is not a status line"));
    };
    parse_version(version)?;
    let status = match code.parse::<u16>() {
        Ok(s) if code.len() == 3 && (100..600).contains(&s) => s,
        _ => return malformed(format!("{code:?} is not a status code")),
    };
    let body = match content_length(&headers, limits)? {
        Some(len) => read_body(r, len)?,
        None => {
            let mut body = Vec::new();
            r.take(limits.max_body as u64 + 1).read_to_end(&mut body).map_err(from_io)?;
            if body.len() > limits.max_body {
                return Err(WireError::BodyTooLarge { length: body.len() as u64, limit: limits.max_body });
            }
            body
        }
    };
    Ok(Response { status, headers, body })
}

/// The reason phrase of the statuses vdstream sends.
pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        204 => "No Content",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Content Too Large",
        415 => "Unsupported Media Type",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// Writes a response with `Content-Length` (and `Connection: close` unless `keep_alive`).
pub fn write_response<W: Write>(w: &mut W, status: u16, headers: &[(&str, &str)], body: &[u8], keep_alive: bool) -> io::Result<()> {
    let mut head = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    if !keep_alive {
        head.push_str("Connection: close\r\n");
    }
    head.push_str("\r\n");
    let mut msg = head.into_bytes();
    msg.extend_from_slice(body);
    w.write_all(&msg)?;
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(text: &[u8]) -> Result<Request, WireError> {
        read_request(&mut io::BufReader::new(text), &Limits { max_head: 256, max_body: 16 })
    }

    #[test]
    fn a_request_with_a_body_parses() {
        let r = req(b"\r\nPOST /api/v1/targets?x=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\nX-A:  b \r\n\r\n{}extra").unwrap();
        assert_eq!((r.method.as_str(), r.path.as_str(), r.query.as_str(), r.body.as_slice()), ("POST", "/api/v1/targets", "x=1", &b"{}"[..]));
        assert_eq!(r.header("x-a"), Some("b"));
        assert!(r.keep_alive());
        assert!(!req(b"GET / HTTP/1.0\r\n\r\n").unwrap().keep_alive());
        assert!(!req(b"GET / HTTP/1.1\nHost: h\nConnection: close\n\n").unwrap().keep_alive());
    }

    #[test]
    fn malformed_requests_say_why() {
        for (text, want) in [
            (&b"GARBAGE\r\n\r\n"[..], "not a request line"),
            (b"GET / HTTP/2.0\r\n\r\n", "not HTTP/1.0"),
            (b"GET nopath HTTP/1.1\r\nHost: h\r\n\r\n", "not a path"),
            (b"GET / HTTP/1.1\r\n\r\n", "needs a Host"),
            (b"GET / HTTP/1.1\r\nHost: h\r\nContent-Length: -1\r\n\r\n", "not a number"),
            (b"GET / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "two different"),
            (b"GET / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n", "chunked"),
            (b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nab", "ended after 2 of 5"),
            (b"GET / HTTP/1.1\r\nHost: \xff\r\n\r\n", "not UTF-8"),
            (b"GET / HTTP/1.1\r\nHost: h\r\n folded\r\n\r\n", "folded"),
            (b"GET / HTTP/1.1\r\nHo st: h\r\n\r\n", "not a header field name"),
            (b"GET / HTTP/1.1\r\nHost: h\r\n", "middle of the head"),
        ] {
            match req(text) {
                Err(e @ WireError::Malformed(_)) => {
                    assert_eq!(e.status(), 400);
                    assert!(e.to_string().contains(want), "{:?}: {e}", String::from_utf8_lossy(text));
                }
                other => panic!("{:?}: {other:?}", String::from_utf8_lossy(text)),
            }
        }
        assert!(matches!(req(b""), Err(WireError::Closed)));
    }

    #[test]
    fn limits_are_checked_before_reading() {
        let long = format!("GET /{} HTTP/1.1\r\nHost: h\r\n\r\n", "a".repeat(300));
        assert_eq!(req(long.as_bytes()).unwrap_err().status(), 431);
        let many: String = (0..70).map(|i| format!("a{i}:b\r\n")).collect();
        let r = read_request(&mut io::BufReader::new(format!("GET / HTTP/1.1\r\nHost: h\r\n{many}\r\n").as_bytes()), &Limits::default());
        assert_eq!(r.unwrap_err().status(), 431);
        let e = req(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 99999999999999\r\n\r\n").unwrap_err();
        assert_eq!(e.status(), 413);
    }

    #[test]
    fn responses_round_trip() {
        let mut out = Vec::new();
        write_response(&mut out, 404, &[("Content-Type", "application/json")], b"{\"error\":\"x\"}", false).unwrap();
        let r = read_response(&mut io::BufReader::new(&out[..]), &Limits::default()).unwrap();
        assert_eq!((r.status, r.header("content-type"), r.body.as_slice()), (404, Some("application/json"), &b"{\"error\":\"x\"}"[..]));
    }
}
