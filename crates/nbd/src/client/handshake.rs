//! Client side of the fixed-newstyle NBD handshake.
//!
//! Order of options: NBD_OPT_STRUCTURED_REPLY, then NBD_OPT_SET_META_CONTEXT
//! `base:allocation` (only once structured replies are on), then NBD_OPT_GO asking for
//! NBD_INFO_BLOCK_SIZE and NBD_INFO_DESCRIPTION, falling back to NBD_OPT_EXPORT_NAME when the server answers GO with
//! NBD_REP_ERR_UNSUP. Invariants: no option reply payload longer than [`MAX_REPLY_LEN`] is
//! read (so a wire length never drives an allocation beyond it); every reply must echo the
//! option we sent; the handshake does not read past the server's last handshake byte, so the
//! stream can be split for transmission right after.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::error::{option_error_name, ClientError};
use crate::proto;

/// Largest option reply payload we accept (the longest legitimate one is an error or
/// description string of at most 4 KiB plus a few header bytes).
const MAX_REPLY_LEN: u32 = 64 * 1024;
/// Minimum and maximum block sizes the spec allows a server to advertise.
const MAX_MIN_BLOCK: u32 = 64 * 1024;
/// Largest request a client may send when the server does not say (spec: 32 MiB).
pub(crate) const DEFAULT_MAX_BLOCK: u32 = 32 * 1024 * 1024;

/// Block size constraints of an export (NBD_INFO_BLOCK_SIZE, or the spec defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    pub minimum: u32,
    pub preferred: u32,
    pub maximum: u32,
}

/// As the log says it: "minimum 1, preferred 4096, maximum 33554432".
impl std::fmt::Display for BlockSizes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "minimum {}, preferred {}, maximum {}",
            self.minimum, self.preferred, self.maximum
        )
    }
}

impl Default for BlockSizes {
    fn default() -> Self {
        BlockSizes {
            minimum: 1,
            preferred: 4096,
            maximum: DEFAULT_MAX_BLOCK,
        }
    }
}

/// What the handshake learned about the export.
#[derive(Debug, Clone)]
pub struct ExportInfo {
    pub export: String,
    pub size: u64,
    /// Transmission flags (NBD_FLAG_*).
    pub flags: u16,
    pub block_sizes: BlockSizes,
    /// Structured replies were negotiated.
    pub structured: bool,
    /// The meta context id of `base:allocation`, when negotiated.
    pub base_allocation: Option<u32>,
    /// The export's description (NBD_INFO_DESCRIPTION), when the server sent one. The
    /// agent uses it, with the size, to tell that a server still serves the same vDisk
    /// version after a reconnect.
    pub description: Option<String>,
}

pub(crate) struct Request<'a> {
    pub addr: &'a str,
    /// The export name, as messages show it.
    pub export: &'a str,
    /// The name sent on the wire: `export`, or `export#SECRET` (`ConnectOptions::secret`).
    pub wire: &'a str,
    pub structured: bool,
    pub base_allocation: bool,
}

struct OptionReply {
    kind: u32,
    payload: Vec<u8>,
}

fn failer<'a>(req: &'a Request<'_>) -> impl Fn(String) -> ClientError + 'a {
    move |reason: String| ClientError::Handshake {
        addr: req.addr.into(),
        export: req.export.to_string(),
        reason,
    }
}

/// The greeting and the client flags; returns whether the zeroes of
/// `NBD_OPT_EXPORT_NAME`'s reply are left out.
pub(crate) async fn greet<S>(s: &mut S, req: &Request<'_>) -> Result<bool, ClientError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let fail = failer(req);
    let io = |what: &str, e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            fail(format!("server closed the connection during {what}"))
        } else {
            fail(format!("{what}: {e}"))
        }
    };
    if req.wire.len() > proto::MAX_STRING_LEN as usize {
        return Err(fail(format!(
            "export name longer than {} bytes",
            proto::MAX_STRING_LEN
        )));
    }

    let magic = s
        .read_u64()
        .await
        .map_err(|e| io("reading the greeting", e))?;
    if magic != proto::NBDMAGIC {
        return Err(fail(format!(
            "not an NBD server (greeting magic {magic:#x})"
        )));
    }
    let style = s
        .read_u64()
        .await
        .map_err(|e| io("reading the greeting", e))?;
    if style != proto::IHAVEOPT {
        return Err(fail(
            "server speaks oldstyle NBD; only fixed newstyle is supported".into(),
        ));
    }
    let hflags = s
        .read_u16()
        .await
        .map_err(|e| io("reading the greeting", e))?;
    if hflags & proto::FLAG_FIXED_NEWSTYLE == 0 {
        return Err(fail(
            "server does not offer fixed newstyle negotiation".into(),
        ));
    }
    let no_zeroes = hflags & proto::FLAG_NO_ZEROES != 0;
    let mut cflags = proto::FLAG_C_FIXED_NEWSTYLE;
    if no_zeroes {
        cflags |= proto::FLAG_C_NO_ZEROES;
    }
    s.write_all(&cflags.to_be_bytes())
        .await
        .map_err(|e| io("sending client flags", e))?;
    Ok(no_zeroes)
}

/// `NBD_OPT_STARTTLS`: Ok when the server acknowledged it (the TLS handshake comes next).
/// A server that refuses it fails the connection: this client was told to use TLS and
/// never falls back to plaintext.
pub(crate) async fn starttls<S>(s: &mut S, req: &Request<'_>) -> Result<(), ClientError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let fail = failer(req);
    let mut opts = Options {
        s,
        req,
        fail: &fail,
    };
    opts.send(proto::OPT_STARTTLS, &[]).await?;
    let r = opts.reply(proto::OPT_STARTTLS).await?;
    match r.kind {
        proto::REP_ACK => Ok(()),
        k => Err(fail(format!(
            "TLS is required by this client (nbds:// or --tls-certificates) but the server refused NBD_OPT_STARTTLS ({}: {}); start the server with --tls on or --tls require, or connect without TLS",
            option_error_name(k),
            String::from_utf8_lossy(&r.payload)
        ))),
    }
}

/// Option haggling after the greeting (and after TLS, when used): structured replies,
/// `base:allocation`, then GO.
pub(crate) async fn haggle<S>(
    s: &mut S,
    req: &Request<'_>,
    no_zeroes: bool,
) -> Result<ExportInfo, ClientError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let fail = failer(req);
    let mut opts = Options {
        s,
        req,
        fail: &fail,
    };

    let mut structured = false;
    if req.structured {
        opts.send(proto::OPT_STRUCTURED_REPLY, &[]).await?;
        let r = opts.reply(proto::OPT_STRUCTURED_REPLY).await?;
        match r.kind {
            proto::REP_ACK => structured = true,
            k if k & proto::REP_FLAG_ERROR != 0 => {
                log::info!(
                    "{}: server declined structured replies ({})",
                    req.addr,
                    option_error_name(k)
                )
            }
            k => {
                return Err(fail(format!(
                    "unexpected reply {k:#x} to NBD_OPT_STRUCTURED_REPLY"
                )))
            }
        }
    }

    let mut base_allocation = None;
    if structured && req.base_allocation {
        let query = proto::META_CONTEXT_BASE_ALLOCATION.as_bytes();
        let mut p = Vec::with_capacity(12 + req.wire.len() + query.len());
        p.extend_from_slice(&(req.wire.len() as u32).to_be_bytes());
        p.extend_from_slice(req.wire.as_bytes());
        p.extend_from_slice(&1u32.to_be_bytes());
        p.extend_from_slice(&(query.len() as u32).to_be_bytes());
        p.extend_from_slice(query);
        opts.send(proto::OPT_SET_META_CONTEXT, &p).await?;
        loop {
            let r = opts.reply(proto::OPT_SET_META_CONTEXT).await?;
            match r.kind {
                proto::REP_META_CONTEXT => {
                    if r.payload.len() < 4 {
                        return Err(fail("NBD_REP_META_CONTEXT shorter than 4 bytes".into()));
                    }
                    let id = u32::from_be_bytes(r.payload[..4].try_into().expect("4 bytes"));
                    if &r.payload[4..] == query {
                        base_allocation = Some(id);
                    } else {
                        log::warn!(
                            "{}: server sent unrequested meta context, ignored",
                            req.addr
                        );
                    }
                }
                proto::REP_ACK => break,
                k if k & proto::REP_FLAG_ERROR != 0 => {
                    // UNKNOWN here means the export is unknown: let GO report it with its message.
                    log::info!(
                        "{}: server declined base:allocation ({})",
                        req.addr,
                        option_error_name(k)
                    );
                    break;
                }
                k => {
                    return Err(fail(format!(
                        "unexpected reply {k:#x} to NBD_OPT_SET_META_CONTEXT"
                    )))
                }
            }
        }
    }

    let mut p = Vec::with_capacity(8 + req.wire.len());
    p.extend_from_slice(&(req.wire.len() as u32).to_be_bytes());
    p.extend_from_slice(req.wire.as_bytes());
    p.extend_from_slice(&2u16.to_be_bytes());
    p.extend_from_slice(&proto::INFO_BLOCK_SIZE.to_be_bytes());
    p.extend_from_slice(&proto::INFO_DESCRIPTION.to_be_bytes());
    opts.send(proto::OPT_GO, &p).await?;
    let mut export_info: Option<(u64, u16)> = None;
    let mut block_sizes = BlockSizes::default();
    let mut description = None;
    loop {
        let r = opts.reply(proto::OPT_GO).await?;
        match r.kind {
            proto::REP_INFO => {
                if r.payload.len() < 2 {
                    return Err(fail("NBD_REP_INFO shorter than 2 bytes".into()));
                }
                let info = u16::from_be_bytes([r.payload[0], r.payload[1]]);
                let d = &r.payload[2..];
                match info {
                    proto::INFO_EXPORT => {
                        if d.len() != 10 {
                            return Err(fail(format!(
                                "NBD_INFO_EXPORT of {} bytes, expected 10",
                                d.len()
                            )));
                        }
                        let size = u64::from_be_bytes(d[..8].try_into().expect("8 bytes"));
                        let flags = u16::from_be_bytes([d[8], d[9]]);
                        export_info = Some((size, flags));
                    }
                    proto::INFO_BLOCK_SIZE => {
                        if d.len() != 12 {
                            return Err(fail(format!(
                                "NBD_INFO_BLOCK_SIZE of {} bytes, expected 12",
                                d.len()
                            )));
                        }
                        let be =
                            |i: usize| u32::from_be_bytes(d[i..i + 4].try_into().expect("4 bytes"));
                        let b = BlockSizes {
                            minimum: be(0),
                            preferred: be(4),
                            maximum: be(8),
                        };
                        block_sizes = check_block_sizes(b).map_err(&fail)?;
                    }
                    proto::INFO_DESCRIPTION => {
                        description = Some(String::from_utf8_lossy(d).into_owned())
                    }
                    _ => {} // NAME and unknown infos are informative only.
                }
            }
            proto::REP_ACK => break,
            proto::REP_ERR_UNSUP => {
                log::info!(
                    "{}: server lacks NBD_OPT_GO, falling back to NBD_OPT_EXPORT_NAME",
                    req.addr
                );
                let (size, flags) = opts.export_name(no_zeroes).await?;
                return Ok(ExportInfo {
                    export: req.export.to_string(),
                    size,
                    flags,
                    block_sizes: BlockSizes::default(),
                    structured,
                    base_allocation,
                    description: None,
                });
            }
            k if k & proto::REP_FLAG_ERROR != 0 => {
                return Err(ClientError::Refused {
                    addr: req.addr.into(),
                    export: req.export.to_string(),
                    option: "NBD_OPT_GO",
                    reply: k,
                    meaning: option_error_name(k),
                    message: String::from_utf8_lossy(&r.payload).into_owned(),
                })
            }
            k => log::debug!("{}: ignoring reply type {k:#x} to NBD_OPT_GO", req.addr),
        }
    }
    let (size, flags) = export_info
        .ok_or_else(|| fail("server acknowledged NBD_OPT_GO without NBD_INFO_EXPORT".into()))?;
    Ok(ExportInfo {
        export: req.export.to_string(),
        size,
        flags,
        block_sizes,
        structured,
        base_allocation,
        description,
    })
}

fn check_block_sizes(b: BlockSizes) -> Result<BlockSizes, String> {
    let ok = b.minimum.is_power_of_two()
        && b.minimum <= MAX_MIN_BLOCK
        && b.preferred.is_power_of_two()
        && b.preferred >= b.minimum
        && b.maximum >= b.minimum
        && (b.maximum == u32::MAX || b.maximum & (b.minimum - 1) == 0);
    if ok {
        // We never send more than the spec default in one request whatever the server says.
        Ok(BlockSizes {
            maximum: b.maximum.min(DEFAULT_MAX_BLOCK),
            ..b
        })
    } else {
        Err(format!("server advertised impossible block sizes ({b})"))
    }
}

struct Options<'a, S, F> {
    s: &'a mut S,
    req: &'a Request<'a>,
    fail: &'a F,
}

impl<S, F> Options<'_, S, F>
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: Fn(String) -> ClientError,
{
    async fn send(&mut self, option: u32, payload: &[u8]) -> Result<(), ClientError> {
        let mut m = Vec::with_capacity(16 + payload.len());
        m.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
        m.extend_from_slice(&option.to_be_bytes());
        m.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        m.extend_from_slice(payload);
        self.s
            .write_all(&m)
            .await
            .map_err(|e| (self.fail)(format!("sending option {option}: {e}")))?;
        self.s
            .flush()
            .await
            .map_err(|e| (self.fail)(format!("sending option {option}: {e}")))
    }

    async fn reply(&mut self, option: u32) -> Result<OptionReply, ClientError> {
        let mut h = [0u8; 20];
        self.s
            .read_exact(&mut h)
            .await
            .map_err(|e| self.read_error(option, e))?;
        let magic = u64::from_be_bytes(h[..8].try_into().expect("8 bytes"));
        let echoed = u32::from_be_bytes(h[8..12].try_into().expect("4 bytes"));
        let kind = u32::from_be_bytes(h[12..16].try_into().expect("4 bytes"));
        let len = u32::from_be_bytes(h[16..20].try_into().expect("4 bytes"));
        if magic != proto::REPLY_MAGIC_OPT {
            return Err((self.fail)(format!("bad option reply magic {magic:#x}")));
        }
        if echoed != option {
            return Err((self.fail)(format!(
                "reply to option {echoed} while waiting for option {option}"
            )));
        }
        if len > MAX_REPLY_LEN {
            return Err((self.fail)(format!(
                "option reply of {len} bytes exceeds {MAX_REPLY_LEN}"
            )));
        }
        let mut payload = vec![0u8; len as usize];
        self.s
            .read_exact(&mut payload)
            .await
            .map_err(|e| self.read_error(option, e))?;
        Ok(OptionReply { kind, payload })
    }

    fn read_error(&self, option: u32, e: std::io::Error) -> ClientError {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            (self.fail)(format!(
                "server closed the connection while answering option {option}"
            ))
        } else {
            (self.fail)(format!("reading the reply to option {option}: {e}"))
        }
    }

    /// NBD_OPT_EXPORT_NAME: no reply header; the server closes the connection when it does
    /// not know the export.
    async fn export_name(&mut self, no_zeroes: bool) -> Result<(u64, u16), ClientError> {
        self.send(proto::OPT_EXPORT_NAME, self.req.wire.as_bytes())
            .await?;
        let mut d = [0u8; 10 + 124];
        let want = if no_zeroes { 10 } else { d.len() };
        self.s.read_exact(&mut d[..want]).await.map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                ClientError::Refused {
                    addr: self.req.addr.into(),
                    export: self.req.export.to_string(),
                    option: "NBD_OPT_EXPORT_NAME",
                    reply: proto::REP_ERR_UNKNOWN,
                    meaning: "server closed the connection (unknown export?)",
                    message: String::new(),
                }
            } else {
                (self.fail)(format!("reading the NBD_OPT_EXPORT_NAME reply: {e}"))
            }
        })?;
        let size = u64::from_be_bytes(d[..8].try_into().expect("8 bytes"));
        let flags = u16::from_be_bytes([d[8], d[9]]);
        Ok((size, flags))
    }
}
