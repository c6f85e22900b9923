//! Async NBD client: connects to a server over a unix socket or TCP, negotiates fixed
//! newstyle with structured replies and `base:allocation`, then lets many tasks issue
//! requests concurrently on one connection (pipelining).
//!
//! The agent streams a vDisk through this client, so a dead or hung server must surface
//! fast: when the connection breaks, every waiting request fails with
//! [`ClientError::Disconnected`] and later calls fail at once; when a reply does not arrive
//! within the request timeout, that request fails with [`ClientError::Timeout`] and the
//! connection is failed too (see [`ConnectOptions::request_timeout`]), so the caller
//! reconnects and re-sends. Requests are validated against the export (size, block sizes,
//! advertised capabilities) before they are sent, returning [`ClientError::Invalid`];
//! [`ConnectOptions::check_requests`] turns that off to test a server's own checks.
//!
//! Invariants: a `Client` is `Send + Sync`; all commands take `&self`; each request costs
//! one cookie, one oneshot channel and (for reads) the buffer it returns, no task spawn.

mod address;
mod connection;
mod error;
mod handshake;

use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

pub use address::{Address, ParsedUri, DEFAULT_PORT};
pub use connection::{corked, Corked, WriterMode};
pub use error::{errno_name, ClientError, Op};
pub use handshake::{BlockSizes, ExportInfo};

use address::Stream;
use connection::{Command, Connection, ReadHalf, ReplyKind, WriteHalf};

use crate::proto;

/// Separates an export name from the credential that follows it on the wire
/// ([`ConnectOptions::secret`]); the export-name grammar is the contract crate's.
pub use vdstream_contract::name::SECRET_SEPARATOR;

/// How to connect and what to negotiate.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Export name sent in NBD_OPT_GO ("" is the default export).
    pub export: String,
    /// A credential for the export: sent on the wire as `EXPORT#SECRET` (see
    /// [`SECRET_SEPARATOR`]), never shown: messages and [`ExportInfo::export`] name the
    /// export without it.
    pub secret: Option<String>,
    /// Ask for structured replies (needed for holes in reads and block status).
    pub structured_replies: bool,
    /// Ask for the `base:allocation` meta context (needs structured replies).
    pub base_allocation: bool,
    /// Bound on connecting plus the whole handshake.
    pub connect_timeout: Duration,
    /// Bound on each request, from submission to its last reply chunk. `None`: wait forever.
    /// A request that times out fails the whole connection: the server is presumed hung,
    /// and a late reply could otherwise arrive for a request we no longer track. The caller
    /// is expected to reconnect (possibly to another server) and re-send.
    pub request_timeout: Option<Duration>,
    /// Validate requests against the export before sending them. Only tests of a server's
    /// own validation turn this off.
    pub check_requests: bool,
    /// How request bytes reach the socket.
    pub writer: WriterMode,
    /// NBD over TLS: `NBD_OPT_STARTTLS` right after the greeting, then the TLS handshake
    /// with this configuration (the server's certificate checked against its CA and the
    /// host dialled, `localhost` for a unix socket). A server that refuses STARTTLS fails
    /// the connection; there is no plaintext fallback. `None`: no TLS.
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            export: String::new(),
            secret: None,
            structured_replies: true,
            base_allocation: true,
            connect_timeout: Duration::from_secs(10),
            request_timeout: Some(Duration::from_secs(30)),
            check_requests: true,
            writer: WriterMode::default(),
            tls: None,
        }
    }
}

impl ConnectOptions {
    /// Default options for the named export.
    pub fn export(name: impl Into<String>) -> Self {
        ConnectOptions {
            export: name.into(),
            ..Default::default()
        }
    }
}

/// The handshake over TLS: greeting, STARTTLS, the TLS handshake, then haggling over TLS;
/// the TLS stream is split for the connection's reader and writer.
async fn over_tls<S>(
    mut s: S,
    req: &handshake::Request<'_>,
    config: Arc<rustls::ClientConfig>,
    name: rustls::pki_types::ServerName<'static>,
) -> Result<
    (
        ExportInfo,
        ReadHalf,
        WriteHalf,
        Option<std::os::fd::OwnedFd>,
    ),
    ClientError,
>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let no_zeroes = handshake::greet(&mut s, req).await?;
    handshake::starttls(&mut s, req).await?;
    let mut t = tokio_rustls::TlsConnector::from(config)
        .connect(name, s)
        .await
        .map_err(|e| ClientError::Handshake {
            addr: req.addr.into(),
            export: req.export.to_string(),
            reason: format!("TLS handshake failed: {e}"),
        })?;
    let info = handshake::haggle(&mut t, req, no_zeroes).await?;
    let (r, w) = tokio::io::split(t);
    Ok((info, Box::new(r), Box::new(w), None))
}

/// Counters of replies received on a connection (for logs, metrics and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplyStats {
    pub simple_replies: u64,
    pub data_chunks: u64,
    pub hole_chunks: u64,
    pub error_chunks: u64,
}

/// A connected NBD client. Share it between tasks with `Arc<Client>`; dropping the last
/// reference closes the connection (without NBD_CMD_DISC; call [`Client::disconnect`] for a
/// clean goodbye).
#[derive(Debug)]
pub struct Client {
    conn: Arc<Connection>,
    info: ExportInfo,
    request_timeout: Option<Duration>,
    check_requests: bool,
}

impl Drop for Client {
    fn drop(&mut self) {
        self.conn.fail("the client was dropped".into());
    }
}

impl Client {
    /// Connect to `addr`, run the handshake and start the connection's tasks.
    pub async fn connect(addr: Address, opts: ConnectOptions) -> Result<Client, ClientError> {
        let addr_text: Arc<str> = addr.to_string().into();
        let setup = async {
            let stream = addr.open().await.map_err(|err| ClientError::Connect {
                addr: addr_text.clone(),
                err,
            })?;
            let wire = match &opts.secret {
                Some(secret) => format!("{}{SECRET_SEPARATOR}{secret}", opts.export),
                None => opts.export.clone(),
            };
            let req = handshake::Request {
                addr: &addr_text,
                export: &opts.export,
                wire: &wire,
                structured: opts.structured_replies,
                base_allocation: opts.base_allocation,
            };
            if let Some(config) = &opts.tls {
                let name = vdstream_tls::files::server_name(addr.host()).map_err(|e| {
                    ClientError::Address {
                        input: addr_text.to_string(),
                        reason: e.to_string(),
                    }
                })?;
                return match stream {
                    Stream::Unix(s) => over_tls(s, &req, config.clone(), name).await,
                    Stream::Tcp(s) => over_tls(s, &req, config.clone(), name).await,
                };
            }
            // A duplicate of a plain socket lets requesting threads send themselves.
            let (info, r, w, direct): (ExportInfo, ReadHalf, WriteHalf, _) = match stream {
                Stream::Unix(mut s) => {
                    let no_zeroes = handshake::greet(&mut s, &req).await?;
                    let info = handshake::haggle(&mut s, &req, no_zeroes).await?;
                    let direct = s.as_fd().try_clone_to_owned().ok();
                    let (r, w) = s.into_split();
                    (info, Box::new(r), Box::new(w), direct)
                }
                Stream::Tcp(mut s) => {
                    let no_zeroes = handshake::greet(&mut s, &req).await?;
                    let info = handshake::haggle(&mut s, &req, no_zeroes).await?;
                    let direct = s.as_fd().try_clone_to_owned().ok();
                    let (r, w) = s.into_split();
                    (info, Box::new(r), Box::new(w), direct)
                }
            };
            Ok::<_, ClientError>((info, r, w, direct))
        };
        let (info, r, w, direct) = tokio::time::timeout(opts.connect_timeout, setup)
            .await
            .map_err(|_| ClientError::ConnectTimeout {
                addr: addr_text.clone(),
                export: opts.export.clone(),
                timeout: opts.connect_timeout,
            })??;
        log::info!(
            "{addr_text}: export {:?}: {} bytes, flags {:#x}, structured replies {}, base:allocation {}, block sizes {}",
            info.export,
            info.size,
            info.flags,
            if info.structured { "yes" } else { "no" },
            info.base_allocation.map_or("no".to_string(), |id| format!("yes (context {id})")),
            info.block_sizes
        );
        let conn = Connection::start(addr_text, r, w, opts.writer, direct);
        Ok(Client {
            conn,
            info,
            request_timeout: opts.request_timeout,
            check_requests: opts.check_requests,
        })
    }

    /// Connect to an NBD URI (`nbd://host:port/export`, `nbd+unix:///export?socket=PATH`,
    /// and with TLS `nbds://…` / `nbds+unix://…`, whose `?tls-certificates=DIR` names the
    /// client's certificate directory unless `opts.tls` is set); the URI's export overrides
    /// `opts.export`.
    pub async fn connect_uri(uri: &str, opts: ConnectOptions) -> Result<Client, ClientError> {
        let parsed = Address::parse_uri_tls(uri)?;
        let mut tls = opts.tls.clone();
        if parsed.tls && tls.is_none() {
            let dir = parsed.tls_certificates.as_deref().ok_or_else(|| ClientError::Address {
                input: uri.to_string(),
                reason: "an nbds URI needs the client's certificates: add ?tls-certificates=DIR (ca-cert.pem, client-cert.pem, client-key.pem)".into(),
            })?;
            tls = Some(vdstream_tls::files::client_config(dir).map_err(|e| {
                ClientError::Address {
                    input: uri.to_string(),
                    reason: e.to_string(),
                }
            })?);
        }
        Client::connect(
            parsed.address,
            ConnectOptions {
                export: parsed.export,
                tls,
                ..opts
            },
        )
        .await
    }

    /// What the handshake learned.
    pub fn info(&self) -> &ExportInfo {
        &self.info
    }
    /// Export size in bytes.
    pub fn size(&self) -> u64 {
        self.info.size
    }
    /// Transmission flags (NBD_FLAG_*).
    pub fn flags(&self) -> u16 {
        self.info.flags
    }
    pub fn block_sizes(&self) -> BlockSizes {
        self.info.block_sizes
    }
    /// Structured replies are in use.
    pub fn structured(&self) -> bool {
        self.info.structured
    }
    /// The server's address as text, for logs.
    pub fn address(&self) -> &str {
        &self.conn.addr
    }
    fn has(&self, flag: u16) -> bool {
        self.info.flags & flag != 0
    }
    pub fn read_only(&self) -> bool {
        self.has(proto::FLAG_READ_ONLY)
    }
    pub fn can_flush(&self) -> bool {
        self.has(proto::FLAG_SEND_FLUSH)
    }
    pub fn can_fua(&self) -> bool {
        self.has(proto::FLAG_SEND_FUA)
    }
    pub fn can_trim(&self) -> bool {
        self.has(proto::FLAG_SEND_TRIM)
    }
    pub fn can_zeroes(&self) -> bool {
        self.has(proto::FLAG_SEND_WRITE_ZEROES)
    }
    pub fn can_fast_zero(&self) -> bool {
        self.has(proto::FLAG_SEND_FAST_ZERO)
    }
    pub fn can_cache(&self) -> bool {
        self.has(proto::FLAG_SEND_CACHE)
    }
    pub fn can_multi_conn(&self) -> bool {
        self.has(proto::FLAG_CAN_MULTI_CONN)
    }
    pub fn can_df(&self) -> bool {
        self.has(proto::FLAG_SEND_DF)
    }
    /// `base:allocation` block status is available.
    pub fn can_block_status(&self) -> bool {
        self.info.base_allocation.is_some()
    }
    /// Counters of the replies received so far.
    pub fn stats(&self) -> ReplyStats {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.conn.stats;
        ReplyStats {
            simple_replies: c.simple_replies.load(Relaxed),
            data_chunks: c.data_chunks.load(Relaxed),
            hole_chunks: c.hole_chunks.load(Relaxed),
            error_chunks: c.error_chunks.load(Relaxed),
        }
    }

    /// Why the connection is gone, or `None` while it is usable.
    pub fn closed_reason(&self) -> Option<String> {
        self.conn.closed_reason().map(|r| r.to_string())
    }

    /// Read `len` bytes at `offset`.
    pub async fn read(&self, offset: u64, len: u32) -> Result<Vec<u8>, ClientError> {
        self.read_buf(offset, vec![0; len as usize]).await
    }

    /// Read `buf.len()` bytes at `offset` into `buf`, returning it (lets callers reuse
    /// buffers). Holes are zero-filled.
    pub async fn read_buf(&self, offset: u64, buf: Vec<u8>) -> Result<Vec<u8>, ClientError> {
        let len = self.length(Op::Read, offset, buf.len() as u64)?;
        let cmd = Command {
            op: Op::Read,
            flags: 0,
            offset,
            len,
        };
        self.check(cmd, &[])?;
        match self.request(cmd, ReplyKind::Read(buf), &[]).await? {
            ReplyKind::Read(buf) => Ok(buf),
            _ => unreachable!("a read completes with its buffer"),
        }
    }

    /// Read into `buf` (one copy from an internal buffer).
    pub async fn read_into(&self, offset: u64, buf: &mut [u8]) -> Result<(), ClientError> {
        let data = self.read_buf(offset, vec![0; buf.len()]).await?;
        buf.copy_from_slice(&data);
        Ok(())
    }

    /// Write `data` at `offset`; with `fua`, the data is durable when this returns.
    pub async fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ClientError> {
        let len = self.length(Op::Write, offset, data.len() as u64)?;
        let cmd = Command {
            op: Op::Write,
            flags: fua_flag(fua),
            offset,
            len,
        };
        self.check(cmd, data)?;
        self.request(cmd, ReplyKind::Plain, data).await.map(drop)
    }

    /// Make every completed write durable.
    pub async fn flush(&self) -> Result<(), ClientError> {
        let cmd = Command {
            op: Op::Flush,
            flags: 0,
            offset: 0,
            len: 0,
        };
        self.check(cmd, &[])?;
        self.request(cmd, ReplyKind::Plain, &[]).await.map(drop)
    }

    /// Tell the server the range is no longer needed (it may read back as anything).
    pub async fn trim(&self, offset: u64, len: u32, fua: bool) -> Result<(), ClientError> {
        let cmd = Command {
            op: Op::Trim,
            flags: fua_flag(fua),
            offset,
            len,
        };
        self.check(cmd, &[])?;
        self.request(cmd, ReplyKind::Plain, &[]).await.map(drop)
    }

    /// Make the range read as zeroes. `no_hole`: keep it allocated; `fast_zero`: fail with
    /// ENOTSUP rather than fall back to a slow write.
    pub async fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        no_hole: bool,
        fast_zero: bool,
        fua: bool,
    ) -> Result<(), ClientError> {
        let mut flags = fua_flag(fua);
        if no_hole {
            flags |= proto::CMD_FLAG_NO_HOLE;
        }
        if fast_zero {
            flags |= proto::CMD_FLAG_FAST_ZERO;
        }
        let cmd = Command {
            op: Op::WriteZeroes,
            flags,
            offset,
            len,
        };
        self.check(cmd, &[])?;
        self.request(cmd, ReplyKind::Plain, &[]).await.map(drop)
    }

    /// Ask the server to prefetch the range.
    pub async fn cache(&self, offset: u64, len: u32) -> Result<(), ClientError> {
        let cmd = Command {
            op: Op::Cache,
            flags: 0,
            offset,
            len,
        };
        self.check(cmd, &[])?;
        self.request(cmd, ReplyKind::Plain, &[]).await.map(drop)
    }

    /// `base:allocation` extents from `offset`: `(length, NBD_STATE_* flags)`. The last
    /// extent may reach past `offset + len`; with `req_one` the server sends one extent.
    pub async fn block_status(
        &self,
        offset: u64,
        len: u32,
        req_one: bool,
    ) -> Result<Vec<(u32, u32)>, ClientError> {
        let flags = if req_one { proto::CMD_FLAG_REQ_ONE } else { 0 };
        let cmd = Command {
            op: Op::BlockStatus,
            flags,
            offset,
            len,
        };
        self.check(cmd, &[])?;
        let kind = ReplyKind::BlockStatus {
            context: self.info.base_allocation,
            extents: Vec::new(),
        };
        match self.request(cmd, kind, &[]).await? {
            ReplyKind::BlockStatus { extents, .. } => Ok(extents),
            _ => unreachable!("block status completes with extents"),
        }
    }

    /// Wait for in-flight requests, send NBD_CMD_DISC and close the connection. Requests
    /// issued after this call fail with `Disconnected`. Bounded by the request timeout.
    pub async fn disconnect(&self) -> Result<(), ClientError> {
        let disc = self.conn.disconnect();
        match self.request_timeout {
            Some(t) => {
                if tokio::time::timeout(t, disc).await.is_err() {
                    self.conn
                        .fail("disconnect timed out waiting for in-flight requests".into());
                }
            }
            None => disc.await,
        }
        Ok(())
    }

    fn length(&self, op: Op, offset: u64, len: u64) -> Result<u32, ClientError> {
        u32::try_from(len)
            .map_err(|_| self.invalid(op, offset, len, "length does not fit in 32 bits".into()))
    }

    fn invalid(&self, op: Op, offset: u64, len: u64, reason: String) -> ClientError {
        ClientError::Invalid {
            addr: self.conn.addr.clone(),
            op,
            offset,
            len,
            size: self.info.size,
            reason,
        }
    }

    /// Client-side validation, so a bad request never reaches the server.
    fn check(&self, cmd: Command, payload: &[u8]) -> Result<(), ClientError> {
        if !self.check_requests {
            return Ok(());
        }
        let Command {
            op,
            flags,
            offset,
            len,
        } = cmd;
        let bad = |reason: &str| Err(self.invalid(op, offset, u64::from(len), reason.to_string()));
        let needs = |ok: bool, what: &str| {
            if ok {
                Ok(())
            } else {
                bad(&format!("the server does not support {what}"))
            }
        };
        if op == Op::Flush {
            return needs(self.can_flush(), "flush");
        }
        if len == 0 {
            return bad("zero-length request");
        }
        match offset.checked_add(u64::from(len)) {
            Some(end) if end <= self.info.size => {}
            _ => return bad("range goes past the end of the export"),
        }
        // The minimum block size is a power of two (checked in the handshake).
        let min = u64::from(self.info.block_sizes.minimum);
        if (offset | u64::from(len)) & (min - 1) != 0 {
            return bad("not aligned to the server's minimum block size");
        }
        if matches!(op, Op::Read | Op::Write) && len > self.info.block_sizes.maximum {
            return bad("longer than the server's maximum block size");
        }
        if op == Op::Write && payload.len() != len as usize {
            return bad("payload length differs from request length");
        }
        if matches!(op, Op::Write | Op::Trim | Op::WriteZeroes) && self.read_only() {
            return bad("the export is read-only");
        }
        if flags & proto::CMD_FLAG_FUA != 0 {
            needs(self.can_fua(), "FUA")?;
        }
        if flags & proto::CMD_FLAG_FAST_ZERO != 0 {
            needs(self.can_fast_zero(), "fast zero")?;
        }
        match op {
            Op::Trim => needs(self.can_trim(), "trim"),
            Op::WriteZeroes => needs(self.can_zeroes(), "write zeroes"),
            Op::Cache => needs(self.can_cache(), "cache"),
            Op::BlockStatus => needs(self.can_block_status(), "base:allocation block status"),
            _ => Ok(()),
        }
    }

    /// Submit and wait, bounded by the request timeout.
    async fn request(
        &self,
        cmd: Command,
        kind: ReplyKind,
        payload: &[u8],
    ) -> Result<ReplyKind, ClientError> {
        let conn = &self.conn;
        let exchange = async {
            let reply = conn.submit(cmd, kind, payload).await?;
            match reply.await {
                Ok(result) => result,
                Err(_) => Err(ClientError::Disconnected {
                    addr: conn.addr.clone(),
                    reason: conn
                        .closed_reason()
                        .unwrap_or_else(|| "reply channel closed".into()),
                }),
            }
        };
        let Some(timeout) = self.request_timeout else {
            return exchange.await;
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(result) => result,
            Err(_) => {
                let reason = format!(
                    "{} at offset {} got no reply within {timeout:?}",
                    cmd.op, cmd.offset
                );
                log::warn!("{}: {reason}; failing the connection", conn.addr);
                conn.fail(reason.into());
                Err(ClientError::Timeout {
                    addr: conn.addr.clone(),
                    op: cmd.op,
                    offset: cmd.offset,
                    len: u64::from(cmd.len),
                    timeout,
                })
            }
        }
    }
}

fn fua_flag(fua: bool) -> u16 {
    if fua {
        proto::CMD_FLAG_FUA
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn client_is_send_and_sync() {
        assert_send_sync::<Client>();
        assert_send_sync::<ClientError>();
    }
}
