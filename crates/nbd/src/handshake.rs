//! The fixed-newstyle handshake: greeting, client flags, and option haggling until the
//! client picks an export (`NBD_OPT_GO` / `NBD_OPT_EXPORT_NAME`) or leaves.
//!
//! Invariants: every read and write is bounded by `handshake_timeout`; an option payload
//! longer than [`MAX_OPTION_LEN`] ends the connection before anything is allocated for it;
//! option payloads are parsed only by the pure functions of [`crate::options`]; an unknown
//! or unsupported option gets `NBD_REP_ERR_UNSUP` and haggling goes on; the stream is read
//! exactly (no read-ahead), so nothing of the transmission phase is swallowed here.
//!
//! TLS (`NBD_OPT_STARTTLS`, [`crate::state::TlsMode`]): without a TLS directory, or with
//! mode `off`, STARTTLS is refused with `NBD_REP_ERR_POLICY` (the spec's NOTLS mode). With
//! `on` (SELECTIVETLS) or `require` (FORCEDTLS) STARTTLS is acknowledged, the TLS handshake
//! runs on the same stream within `handshake_timeout`, and haggling continues over TLS with
//! no new greeting and nothing remembered from before (structured replies and meta
//! contexts are negotiated again). In `require` mode every option before STARTTLS except
//! `NBD_OPT_ABORT` gets `NBD_REP_ERR_TLS_REQD` and the connection stays usable;
//! `NBD_OPT_EXPORT_NAME` (which cannot carry an error) closes it. A second STARTTLS gets
//! `NBD_REP_ERR_INVALID`. The client is its verified certificate's identity (its role
//! URI's, else [`Identity::Verified`] by its common name), else `Anonymous` (TLS
//! configured, no certificate) or `Local` (no TLS). A certificate that fails verification
//! fails the TLS handshake (counted against the source by the penalties); it is never
//! taken for no certificate. With `tls_allow_names`, a certificate that carries none of
//! them is refused every export with `NBD_REP_ERR_POLICY`, naming it.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use vdstream_blockdev::BlockDev;
use vdstream_contract::Identity;

use crate::errno::rep_err_for;
use crate::flags::{block_size, transmission_flags};
use crate::options::{self, OptionParseError};
use crate::proto::*;
use crate::state::{
    OpenError, OpenPurpose, OpenRequest, OpenedExport, Shared, ShutdownSignal, TlsMode,
};
use crate::validate::ExportParams;
use crate::wire::{put_option_reply, OptionHeader, OPTION_HEADER_LEN};

/// The metadata context id this server gives `base:allocation` in `NBD_OPT_SET_META_CONTEXT`.
pub const BASE_ALLOCATION_CONTEXT_ID: u32 = 1;

/// What the handshake settled: the export and how to talk about it.
#[derive(Debug)]
pub struct Negotiated {
    pub export_name: String,
    pub device: Arc<dyn BlockDev>,
    pub params: ExportParams,
    /// Ends this connection alone (see `OpenedExport::close`).
    pub close: Option<ShutdownSignal>,
}

/// A client's TLS session, handed from the handshake to the transmission phase.
pub struct TlsPeer {
    pub conn: rustls::ServerConnection,
    /// Who the client is (its verified certificate's role, or `Anonymous`).
    pub identity: Identity,
    /// Its certificate's serial (to close the session when `ca-crl.pem` revokes it).
    pub serial: Option<Vec<u8>>,
}

impl std::fmt::Debug for TlsPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsPeer")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

/// What a successful handshake hands the transmission phase.
#[derive(Debug)]
pub struct Handshaken {
    pub negotiated: Negotiated,
    /// `Some` when the client started TLS.
    pub tls: Option<TlsPeer>,
}

/// Why a handshake ended without reaching the transmission phase.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("I/O error during the handshake: {0}")]
    Io(#[from] io::Error),
    #[error("the client sent nothing for {0:?} during the handshake; dropped it")]
    Timeout(Duration),
    #[error(
        "the client set unknown client flags {0:#x}; the spec requires dropping the connection"
    )]
    ClientFlags(u32),
    #[error("bad option magic {0:#018x}: not an NBD client, or it lost sync")]
    BadMagic(u64),
    #[error("option {option} carries {length} bytes, more than the {MAX_OPTION_LEN} this server accepts")]
    OptionTooLong { option: u32, length: u32 },
    #[error("NBD_OPT_EXPORT_NAME {name:?} cannot be served ({reason}); that option cannot return an error, so the connection was closed (clients should use NBD_OPT_GO)")]
    ExportRejected { name: String, reason: String },
    #[error("the server is shutting down")]
    Shutdown,
    #[error("NBD_OPT_EXPORT_NAME before NBD_OPT_STARTTLS on a server that requires TLS (--tls require); that option cannot return an error, so the connection was closed")]
    TlsRequired,
    #[error("TLS handshake failed: {0}")]
    Tls(io::Error),
}

impl HandshakeError {
    /// Whether this failure counts against the client's address ([`crate::penalty`]): a
    /// refused TLS handshake (foreign CA, expired or revoked certificate), a stall, bytes
    /// that are not NBD. A client that merely closes early (a port probe, a health check),
    /// a drain, or an export name that cannot be served does not.
    pub fn counts_against_source(&self) -> bool {
        matches!(
            self,
            HandshakeError::Tls(_)
                | HandshakeError::Timeout(_)
                | HandshakeError::ClientFlags(_)
                | HandshakeError::BadMagic(_)
                | HandshakeError::OptionTooLong { .. }
        )
    }
}

struct Wire<'a, S> {
    stream: &'a mut S,
    timeout: Duration,
    shutdown: ShutdownSignal,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Wire<'_, S> {
    /// Reads exactly `buf.len()` bytes, giving up after the timeout, or as soon as a drain
    /// has begun and the bytes are not already there (a stalled client must not hold up a
    /// shutdown).
    async fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), HandshakeError> {
        tokio::select! {
            biased;
            r = tokio::time::timeout(self.timeout, self.stream.read_exact(buf)) => match r {
                Ok(r) => r.map(|_| ()).map_err(HandshakeError::from),
                Err(_) => Err(HandshakeError::Timeout(self.timeout)),
            },
            _ = self.shutdown.wait() => Err(HandshakeError::Shutdown),
        }
    }
    async fn write_all(&mut self, buf: &[u8]) -> Result<(), HandshakeError> {
        let write = async {
            self.stream.write_all(buf).await?;
            self.stream.flush().await
        };
        match tokio::time::timeout(self.timeout, write).await {
            Ok(r) => r.map_err(HandshakeError::from),
            Err(_) => Err(HandshakeError::Timeout(self.timeout)),
        }
    }
}

/// Meta-context selection made by the last `NBD_OPT_SET_META_CONTEXT`.
struct MetaSelection {
    export: String,
    base_allocation: bool,
}

/// Where a connection stands with TLS, for one round of haggling.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TlsPhase {
    /// No TLS on this server: STARTTLS is refused.
    Unavailable,
    /// TLS offered, not started yet; `required`: nothing else is allowed first.
    Offered { required: bool },
    /// TLS is up: a second STARTTLS is invalid.
    Active,
}

/// How a round of haggling ended.
enum Step {
    /// An export was chosen (`Some`) or the client left (`None`).
    Done(Option<Negotiated>),
    /// STARTTLS was acknowledged: the TLS handshake comes next.
    StartTls,
}

/// What one round of haggling needs to know about the connection.
#[derive(Clone, Copy)]
struct Ctx<'a> {
    shared: &'a Shared,
    shutdown: &'a ShutdownSignal,
    peer: &'a str,
    refusal: Option<&'a OpenError>,
    no_zeroes: bool,
    client: &'a Identity,
    /// The names of the client's verified certificate (`None`: it showed none).
    cert_names: Option<&'a [String]>,
    tls: TlsPhase,
}

/// Runs the handshake. `Ok(None)`: the client aborted or left politely. `refusal`: the
/// server has no room for this connection; every export it asks for is refused so.
/// Every refused open is logged (rate-limited) with the peer, the export and the reason.
pub(crate) async fn negotiate<S>(
    stream: &mut S,
    shared: &Shared,
    shutdown: &ShutdownSignal,
    peer: &str,
    refusal: Option<&OpenError>,
) -> Result<Option<Handshaken>, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let timeout = shared.config.handshake_timeout;
    let mut wire = Wire {
        stream: &mut *stream,
        timeout,
        shutdown: shutdown.clone(),
    };
    let server_tls = shared.config.tls_enabled();

    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&NBDMAGIC.to_be_bytes());
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    wire.write_all(&greeting).await?;

    let mut flags = [0u8; 4];
    wire.read_exact(&mut flags).await?;
    let client_flags = u32::from_be_bytes(flags);
    if client_flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(HandshakeError::ClientFlags(client_flags));
    }
    let no_zeroes = client_flags & FLAG_C_NO_ZEROES != 0;

    // Without TLS every client is a one-host client; with TLS configured, a client that
    // shows no verified certificate is anonymous.
    let plain_client = if server_tls.is_some() {
        Identity::Anonymous
    } else {
        Identity::Local
    };
    let tls = match server_tls {
        None => TlsPhase::Unavailable,
        Some(_) => TlsPhase::Offered {
            required: shared.config.tls_mode == TlsMode::Require,
        },
    };
    let ctx = Ctx {
        shared,
        shutdown,
        peer,
        refusal,
        no_zeroes,
        client: &plain_client,
        cert_names: None,
        tls,
    };
    let config = match haggle(&mut wire, &ctx).await? {
        Step::Done(n) => {
            return Ok(n.map(|negotiated| Handshaken {
                negotiated,
                tls: None,
            }))
        }
        Step::StartTls => match server_tls {
            Some(t) => t.current(),
            None => unreachable!("STARTTLS is acknowledged only with TLS configured"),
        },
    };

    let accept = tokio_rustls::TlsAcceptor::from(config).accept(&mut *stream);
    let mut drain = shutdown.clone();
    let mut tls_stream = tokio::select! {
        biased;
        r = tokio::time::timeout(timeout, accept) => match r {
            Ok(r) => r.map_err(HandshakeError::Tls)?,
            Err(_) => return Err(HandshakeError::Timeout(timeout)),
        },
        _ = drain.wait() => return Err(HandshakeError::Shutdown),
    };
    let PeerCert {
        identity,
        serial,
        names,
    } = peer_identity(tls_stream.get_ref().1, peer);
    let mut wire = Wire {
        stream: &mut tls_stream,
        timeout,
        shutdown: shutdown.clone(),
    };
    let ctx = Ctx {
        client: &identity,
        cert_names: names.as_deref(),
        tls: TlsPhase::Active,
        ..ctx
    };
    match haggle(&mut wire, &ctx).await? {
        Step::Done(Some(negotiated)) => {
            let (_, conn) = tls_stream.into_inner();
            Ok(Some(Handshaken {
                negotiated,
                tls: Some(TlsPeer {
                    conn,
                    identity,
                    serial,
                }),
            }))
        }
        Step::Done(None) => {
            let _ = tokio::time::timeout(timeout, tls_stream.shutdown()).await;
            Ok(None)
        }
        Step::StartTls => unreachable!("a second STARTTLS is answered NBD_REP_ERR_INVALID"),
    }
}

/// What a TLS client's verified certificate says.
struct PeerCert {
    identity: Identity,
    serial: Option<Vec<u8>>,
    /// `None`: no certificate.
    names: Option<Vec<String>>,
}

/// The identity a TLS client's verified certificate names (its role URI's, else its
/// common name's), its serial and its names. A client with no certificate is anonymous.
fn peer_identity(conn: &rustls::ServerConnection, peer: &str) -> PeerCert {
    let version = conn
        .protocol_version()
        .map(|v| format!("{v:?}"))
        .unwrap_or_default();
    let Some(cert) = conn.peer_certificates().and_then(|c| c.first()) else {
        log::info!("NBD client {peer}: {version} without a client certificate: anonymous");
        return PeerCert {
            identity: Identity::Anonymous,
            serial: None,
            names: None,
        };
    };
    let serial = vdstream_tls::peer::serial_of(cert).ok();
    let (identity, why) = vdstream_tls::peer::holder_of(cert);
    if let Some(e) = why {
        log::info!("NBD client {peer}: its verified certificate names no vdstream role, so it is {identity}: {e}");
    }
    let names = vdstream_tls::peer::names_of(cert).unwrap_or_default();
    log::info!("NBD client {peer}: {version} as {identity}");
    PeerCert {
        identity,
        serial,
        names: Some(names),
    }
}

/// Whether `names` (a verified certificate's) include one of `allowed` (`--tls-allow-name`);
/// an empty `allowed` allows every certificate.
fn allowed_by_name(allowed: &[String], names: &[String]) -> bool {
    allowed.is_empty() || names.iter().any(|n| allowed.contains(n))
}

/// The refusal of a certificate that `--tls-allow-name` does not name.
fn not_allowed(client: &Identity, allowed: &[String], names: &[String]) -> OpenError {
    // A certificate's names are the client's text: printable ASCII only, cut, quoted.
    let shown = |n: &String| {
        format!(
            "{:?}",
            n.chars()
                .take(64)
                .map(|c| if c == ' ' || c.is_ascii_graphic() {
                    c
                } else {
                    '?'
                })
                .collect::<String>()
        )
    };
    let list = |v: &[String]| v.iter().map(shown).collect::<Vec<_>>().join(", ");
    OpenError::Policy(format!(
        "the client certificate of {client} (its names: {}) is not one this server serves (--tls-allow-name {}): \
         connect with a certificate issued to one of those names, or add one of its names to --tls-allow-name",
        if names.is_empty() { "none".to_string() } else { list(names) },
        list(allowed)
    ))
}

/// Option haggling until an export is chosen, the client leaves, or STARTTLS is accepted.
async fn haggle<S>(wire: &mut Wire<'_, S>, ctx: &Ctx<'_>) -> Result<Step, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let Ctx {
        shared,
        shutdown,
        peer,
        refusal,
        no_zeroes,
        client,
        cert_names,
        tls,
    } = *ctx;
    // A certificate `--tls-allow-name` does not name is refused whatever it asks for.
    let name_refusal = cert_names
        .filter(|n| !allowed_by_name(&shared.config.tls_allow_names, n))
        .map(|n| not_allowed(client, &shared.config.tls_allow_names, n));
    let refusal = refusal.or(name_refusal.as_ref());
    let mut structured = false;
    let mut meta: Option<MetaSelection> = None;
    let mut data = Vec::new();
    let mut out = Vec::new();
    loop {
        let mut raw = [0u8; OPTION_HEADER_LEN];
        wire.read_exact(&mut raw).await?;
        let header = OptionHeader::parse(&raw);
        if header.magic != IHAVEOPT {
            return Err(HandshakeError::BadMagic(header.magic));
        }
        if header.length > MAX_OPTION_LEN {
            return Err(HandshakeError::OptionTooLong {
                option: header.option,
                length: header.length,
            });
        }
        data.clear();
        data.resize(header.length as usize, 0);
        wire.read_exact(&mut data).await?;
        let option = header.option;
        out.clear();

        if shutdown.is_shutdown() && option != OPT_ABORT {
            if option != OPT_EXPORT_NAME {
                put_option_reply(
                    &mut out,
                    option,
                    REP_ERR_SHUTDOWN,
                    b"the server is shutting down; reconnect later",
                );
                wire.write_all(&out).await?;
            }
            return Err(HandshakeError::Shutdown);
        }

        if tls == (TlsPhase::Offered { required: true })
            && option != OPT_ABORT
            && option != OPT_STARTTLS
        {
            if option == OPT_EXPORT_NAME {
                return Err(HandshakeError::TlsRequired);
            }
            put_option_reply(&mut out, option, REP_ERR_TLS_REQD,
                b"this server requires TLS: send NBD_OPT_STARTTLS first (e.g. nbds:// URIs, or qemu's tls-creds)");
            wire.write_all(&out).await?;
            continue;
        }

        match option {
            OPT_EXPORT_NAME => {
                let rejected = |reason: String| HandshakeError::ExportRejected {
                    name: crate::shown_export_name(&String::from_utf8_lossy(&data)).to_string(),
                    reason,
                };
                let name = options::parse_export_name(&data).map_err(|e| rejected(e.to_string()))?;
                let opened = open(shared, refusal, &OpenRequest { name, peer, client, purpose: OpenPurpose::Session }, "NBD_OPT_EXPORT_NAME");
                let OpenedExport { device, exclusive, close, .. } = opened.map_err(|e| rejected(e.to_string()))?;
                let params = export_params(&*device, structured, &meta, name, exclusive);
                out.extend_from_slice(&params.size.to_be_bytes());
                out.extend_from_slice(&params.flags.to_be_bytes());
                if !no_zeroes {
                    out.extend_from_slice(&[0u8; 124]);
                }
                let export_name = crate::shown_export_name(name).to_string();
                wire.write_all(&out).await?;
                return Ok(Step::Done(Some(Negotiated { export_name, device, params, close })));
            }
            OPT_ABORT => {
                // The spec asks the server to ignore any data sent with ABORT.
                put_option_reply(&mut out, option, REP_ACK, &[]);
                // The client may already have closed; that is fine.
                let _ = wire.write_all(&out).await;
                return Ok(Step::Done(None));
            }
            OPT_LIST => match options::parse_empty(&data) {
                Ok(()) => {
                    for export in shared.exports.list_for(client) {
                        let mut rep = (export.name.len() as u32).to_be_bytes().to_vec();
                        rep.extend_from_slice(export.name.as_bytes());
                        rep.extend_from_slice(export.description.as_bytes());
                        put_option_reply(&mut out, option, REP_SERVER, &rep);
                    }
                    put_option_reply(&mut out, option, REP_ACK, &[]);
                }
                Err(e) => invalid(&mut out, option, &e),
            },
            OPT_STARTTLS => match (options::parse_empty(&data), tls) {
                (Err(e), _) => invalid(&mut out, option, &e),
                (Ok(()), TlsPhase::Unavailable) => put_option_reply(&mut out, option, REP_ERR_POLICY,
                    b"this server does not offer TLS (started without --tls on|require); connect without TLS"),
                (Ok(()), TlsPhase::Active) => put_option_reply(&mut out, option, REP_ERR_INVALID, b"TLS is already up"),
                (Ok(()), TlsPhase::Offered { .. }) => {
                    put_option_reply(&mut out, option, REP_ACK, &[]);
                    wire.write_all(&out).await?;
                    return Ok(Step::StartTls);
                }
            },
            OPT_INFO | OPT_GO => match options::parse_info_request(&data) {
                Err(e) => invalid(&mut out, option, &e),
                Ok(req) => match open(
                    shared,
                    refusal,
                    &OpenRequest { name: req.name, peer, client, purpose: if option == OPT_GO { OpenPurpose::Session } else { OpenPurpose::Info } },
                    if option == OPT_GO { "NBD_OPT_GO" } else { "NBD_OPT_INFO" },
                ) {
                    Err(e) => {
                        let msg = e.to_string();
                        put_option_reply(&mut out, option, rep_err_for(&e), crate::wire::clip_message(&msg, 4096).as_bytes());
                    }
                    Ok(OpenedExport { device, description, exclusive, close }) => {
                        let params = export_params(&*device, structured, &meta, req.name, exclusive);
                        let mut info = INFO_EXPORT.to_be_bytes().to_vec();
                        info.extend_from_slice(&params.size.to_be_bytes());
                        info.extend_from_slice(&params.flags.to_be_bytes());
                        put_option_reply(&mut out, option, REP_INFO, &info);
                        if req.want_name {
                            let mut info = INFO_NAME.to_be_bytes().to_vec();
                            info.extend_from_slice(req.name.as_bytes());
                            put_option_reply(&mut out, option, REP_INFO, &info);
                        }
                        if req.want_description {
                            if let Some(d) = description.filter(|d| !d.is_empty()) {
                                let mut info = INFO_DESCRIPTION.to_be_bytes().to_vec();
                                info.extend_from_slice(crate::wire::clip_message(&d, 4096).as_bytes());
                                put_option_reply(&mut out, option, REP_INFO, &info);
                            }
                        }
                        let (min, preferred, max) = block_size(&device.caps());
                        let mut info = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
                        for v in [min, preferred, max] {
                            info.extend_from_slice(&v.to_be_bytes());
                        }
                        put_option_reply(&mut out, option, REP_INFO, &info);
                        put_option_reply(&mut out, option, REP_ACK, &[]);
                        if option == OPT_GO {
                            let export_name = crate::shown_export_name(req.name).to_string();
                            wire.write_all(&out).await?;
                            return Ok(Step::Done(Some(Negotiated { export_name, device, params, close })));
                        }
                    }
                },
            },
            OPT_STRUCTURED_REPLY => match options::parse_empty(&data) {
                Ok(()) => {
                    structured = true;
                    put_option_reply(&mut out, option, REP_ACK, &[]);
                }
                Err(e) => invalid(&mut out, option, &e),
            },
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                let listing = option == OPT_LIST_META_CONTEXT;
                if !listing {
                    // SET replaces the selection even when it fails.
                    meta = None;
                }
                if !structured {
                    put_option_reply(&mut out, option, REP_ERR_INVALID,
                        b"meta contexts need structured replies: send NBD_OPT_STRUCTURED_REPLY first");
                } else {
                    let parsed = options::parse_meta_context_request(&data)
                        .and_then(|req| options::selects_base_allocation(&req, listing).map(|sel| (req.export, sel)));
                    match parsed {
                        Err(e) => invalid(&mut out, option, &e),
                        Ok((export, selected)) => {
                            if selected {
                                let id = if listing { 0 } else { BASE_ALLOCATION_CONTEXT_ID };
                                let mut rep = id.to_be_bytes().to_vec();
                                rep.extend_from_slice(META_CONTEXT_BASE_ALLOCATION.as_bytes());
                                put_option_reply(&mut out, option, REP_META_CONTEXT, &rep);
                            }
                            put_option_reply(&mut out, option, REP_ACK, &[]);
                            if !listing {
                                meta = Some(MetaSelection { export: export.to_string(), base_allocation: selected });
                            }
                        }
                    }
                }
            }
            _ => {
                // Includes NBD_OPT_EXTENDED_HEADERS and NBD_OPT_PEEK_EXPORT.
                let msg = format!("option {option} is not supported by this server");
                put_option_reply(&mut out, option, REP_ERR_UNSUP, msg.as_bytes());
            }
        }
        wire.write_all(&out).await?;
    }
}

/// Opens the export a client asked for (or refuses it with `refusal`), logging a refusal.
fn open(
    shared: &Shared,
    refusal: Option<&OpenError>,
    req: &OpenRequest<'_>,
    option: &str,
) -> Result<OpenedExport, OpenError> {
    let result = match refusal {
        Some(r) => Err(r.clone()),
        None => shared.exports.open_export(req),
    };
    if let Err(e) = &result {
        shared.log.log(
            log::Level::Warn,
            module_path!(),
            "open refused",
            format_args!(
                "open refused ({}): client {}, export {:?} ({option}): {e}",
                e.kind(),
                req.peer,
                crate::shown_export_name(req.name)
            ),
        );
    }
    result
}

fn invalid(out: &mut Vec<u8>, option: u32, e: &OptionParseError) {
    put_option_reply(out, option, REP_ERR_INVALID, e.to_string().as_bytes());
}

/// The parameters a device gets for this connection; BLOCK_STATUS is allowed only if the
/// last SET_META_CONTEXT selected `base:allocation` for this same export name. An export
/// this connection holds alone (`exclusive`) never advertises `CAN_MULTI_CONN`: a client's
/// second connection would be refused.
fn export_params(
    device: &dyn BlockDev,
    structured: bool,
    meta: &Option<MetaSelection>,
    name: &str,
    exclusive: bool,
) -> ExportParams {
    let mut caps = device.caps();
    caps.multi_conn &= !exclusive;
    let base_allocation = structured
        && meta
            .as_ref()
            .is_some_and(|m| m.base_allocation && m.export == name);
    ExportParams {
        size: device.size(),
        flags: transmission_flags(&caps, structured),
        structured,
        base_allocation,
    }
}
