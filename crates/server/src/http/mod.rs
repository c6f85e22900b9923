//! The server's HTTP API and Prometheus `/metrics` (`vdstream server --http ADDR`): axum
//! routes with tower(-http) layers, on hyper's HTTP/1 server, as tasks of the server's
//! own tokio runtime (the one the NBD side's listeners run on; the NBD data path stays on
//! its blocking threads, and store work of the API on the blocking pool, so neither can
//! stall the other's tasks).
//!
//! ```text
//!   accept loop (one task) ── takes a permit of the connection cap, then accepts
//!     └▶ one task per connection: the TLS handshake (with --tls-certificates; bounded by
//!        REQUEST_DEADLINE), hyper HTTP/1 (header read timeout, head size limits, idle timeout)
//!          └▶ trailing-slash trim ▶ [with --identity-ca: identity.rs's /boot/identity/... routes,
//!             no auth] ▶ [with --boot: boot.rs's /boot/... routes, no auth]
//!             ▶ axum Router (router.rs: the route table, the layers;
//!             auth.rs: the caller and the role its route needs, 401/403)
//!               └▶ typed handlers: store.rs (vDisks, versions, targets, on the blocking
//!                  pool), live.rs (server, sessions, agent reports), metrics.rs
//!   sampler (one task): every second, a snapshot of every session's counters (rates over
//!                       5 s), expired agent reports swept away, and (while an event
//!                       stream is open) the farm document for events.rs's streams
//!   GET / and /console: the console's page and assets (console.rs), outside the API's
//!                       layers: static files, no data, so no credential
//! ```
//!
//! Module imports run one way: mod → router → {store, metrics, auth, boot, identity, events, console} → shared → {live,
//! failures} → error → limits (auth → error too; events → auth; boot → crate::boot; identity → crate::identity).
//!
//! Invariants:
//! - A connection costs a task and a socket, never a thread: a slow or idle client holds
//!   only its own connection. A request head must arrive whole within [`REQUEST_DEADLINE`]
//!   (hyper's header read timeout; also the longest a kept-alive connection may idle
//!   between requests), a body within [`REQUEST_DEADLINE`] too (408), and a connection that
//!   moves no byte for [`IDLE_TIMEOUT`] while no request of it is being handled is closed.
//! - At most [`connection_limit`] connections are open (derived from the file descriptor
//!   limit); past it, new connections wait in the listen backlog until one closes. They are
//!   never answered 503 for a mere count.
//! - Bodies are bounded before they are read: [`MAX_BODY`], and [`MAX_AGENT_REPORT`] for
//!   agent reports (413 over it). Heads: [`MAX_HEAD`] bytes and [`MAX_HEADERS`] fields (431).
//! - Everything the API itself answers is the JSON error document of error.rs; what hyper
//!   refuses before a request exists (a request line that does not parse, a head too large)
//!   gets hyper's bare status, and a head cut short or too slow a closed connection.
//! - [`HttpHandle::stop`] closes the listener and every open connection, and returns once
//!   the API's tasks are gone.

mod auth;
mod boot;
mod console;
pub mod documents;
mod error;
mod events;
mod failures;
pub mod forward;
mod identity;
mod limits;
mod live;
mod metrics;
mod openapi;
mod router;
mod shared;
mod store;

use std::net::{SocketAddr, TcpListener};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;
use tower_http::normalize_path::NormalizePath;

use crate::state::ServerState;
use crate::tokens::TokenFile;
use shared::{ClientAddr, PeerIdentity, Shared};
use vdstream_tls::files::ServerTls;

pub use error::ApiError;
pub use limits::*;
pub use router::{openapi, openapi_text, routes};

/// The running API; [`HttpHandle::stop`] stops it (dropping it stops it too, without
/// waiting).
#[derive(Debug)]
pub struct HttpHandle {
    addr: SocketAddr,
    stop_tx: watch::Sender<bool>,
    server: Option<tokio::task::JoinHandle<()>>,
}

/// Serves the API on `listener` until the handle is stopped, without TLS. Call inside the
/// server's tokio runtime: the API's tasks are spawned on it.
pub fn spawn(listener: TcpListener, state: Arc<ServerState>) -> std::io::Result<HttpHandle> {
    spawn_with(listener, state, None)
}

/// Serves the API on `listener` until the handle is stopped, over TLS when `tls` is given
/// (the certificate directory of `--tls-certificates`, client certificates verified
/// against its CA; a new connection takes the directory's configuration as it is then).
/// Bearer tokens are the store's (`api-tokens.json`). Call inside the server's tokio
/// runtime: the API's tasks are spawned on it.
pub fn spawn_with(
    listener: TcpListener,
    state: Arc<ServerState>,
    tls: Option<Arc<ServerTls>>,
) -> std::io::Result<HttpHandle> {
    let addr = listener.local_addr()?;
    let state_boot = state.boot.is_some();
    let tokens = TokenFile::open(&state.store).map_err(std::io::Error::other)?;
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let failures = failures::AuthFailures::new(state.handshake_penalty.clone());
    let shared = Arc::new(Shared {
        state,
        live: live::Live::default(),
        tokens,
        failures,
        loopback: addr.ip().is_loopback(),
        tls: tls.is_some(),
        local: addr,
        boot_transfers: Arc::new(Semaphore::new(boot::MAX_BOOT_TRANSFERS)),
    });
    let (stop_tx, stop_rx) = watch::channel(false);
    let limit = connection_limit();
    let scheme = if tls.is_some() { "https" } else { "http" };
    if shared.open() {
        log::info!("HTTP API open to local users (loopback, no TLS, no token made); `vdstream token add NAME --role ROLE` to require tokens");
    } else {
        log::info!(
            "HTTP API: every request needs a bearer token{}",
            if tls.is_some() {
                " or a client certificate"
            } else {
                ""
            }
        );
    }
    let server = tokio::spawn(serve(listener, shared, tls, stop_rx, limit));
    log::info!("HTTP API on {scheme}://{addr}/api/v1/server, metrics on {scheme}://{addr}/metrics (at most {limit} connections)");
    if state_boot {
        log::info!("boot service on {scheme}://{addr}/boot/ipxe (unauthenticated, read-only: boot scripts and boot files)");
    }
    Ok(HttpHandle {
        addr,
        stop_tx,
        server: Some(server),
    })
}

impl HttpHandle {
    /// Where the API listens (useful after binding port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, closes every open connection and waits for the API's tasks.
    pub async fn stop(mut self) {
        let _ = self.stop_tx.send(true);
        if let Some(t) = self.server.take() {
            let _ = t.await;
        }
    }
}

impl Drop for HttpHandle {
    fn drop(&mut self) {
        let _ = self.stop_tx.send(true);
    }
}

/// Returns once the API is told to stop.
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

async fn serve(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    tls: Option<Arc<ServerTls>>,
    mut stop: watch::Receiver<bool>,
    limit: usize,
) {
    let mut tasks = tokio::task::JoinSet::new();
    let s = shared.clone();
    let mut sampler_stop = stop.clone();
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(live::SAMPLE_EVERY);
        // The farm document for the event streams is built beside the sampler, so a slow
        // store delays neither the rate samples nor the sweep; a tick whose last build is
        // still running skips one.
        let mut farm: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    s.live.sample(&s.state.registry.sessions());
                    s.live.sweep_reports();
                    if farm.as_ref().is_none_or(|h| h.is_finished()) {
                        let s = s.clone();
                        farm = Some(tokio::spawn(async move { events::tick(&s).await }));
                    }
                }
                _ = stopped(&mut sampler_stop) => break,
            }
        }
        if let Some(f) = farm {
            let _ = f.await;
        }
    });
    let app = router::app(shared);
    let permits = Arc::new(Semaphore::new(limit));
    let mut warned: Option<Instant> = None;
    loop {
        if permits.available_permits() == 0
            && warned.is_none_or(|t| t.elapsed() > Duration::from_secs(10))
        {
            log::warn!("HTTP API: {limit} connections open, its limit; new connections wait until one closes");
            warned = Some(Instant::now());
        }
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            _ = stopped(&mut stop) => break,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // EMFILE and friends: wait a little rather than spin.
                    log::warn!("HTTP API: cannot accept a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stopped(&mut stop) => break,
        };
        while tasks.try_join_next().is_some() {}
        tasks.spawn(connection(
            stream,
            peer,
            tls.clone(),
            app.clone(),
            stop.clone(),
            permit,
        ));
    }
    drop(listener);
    while tasks.join_next().await.is_some() {}
}

/// When a connection last moved a byte, and how many of its requests are in a handler.
#[derive(Debug)]
struct Activity {
    origin: Instant,
    last_ms: AtomicU64,
    busy: AtomicUsize,
}

impl Activity {
    fn touch(&self) {
        self.last_ms
            .store(self.origin.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn idle_for(&self) -> Duration {
        self.origin
            .elapsed()
            .saturating_sub(Duration::from_millis(self.last_ms.load(Ordering::Relaxed)))
    }
}

/// Counts a request in a handler while alive.
struct Busy(Arc<Activity>);

impl Busy {
    fn new(a: Arc<Activity>) -> Self {
        a.busy.fetch_add(1, Ordering::AcqRel);
        Busy(a)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.touch();
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A socket that notes in [`Activity`] each time bytes move.
struct Tracked {
    inner: tokio::net::TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Serves one connection until it closes, idles too long, or the API stops. Dropping the
/// connection closes its socket; `_permit` returns its place under the cap. With TLS, the
/// handshake must be over within [`REQUEST_DEADLINE`] (a client that stops in it is
/// dropped then), and a verified client certificate's identity goes with each request.
async fn connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    tls: Option<Arc<ServerTls>>,
    app: Router,
    stop: watch::Receiver<bool>,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let activity = Arc::new(Activity {
        origin: Instant::now(),
        last_ms: AtomicU64::new(0),
        busy: AtomicUsize::new(0),
    });
    let tracked = Tracked {
        inner: stream,
        activity: activity.clone(),
    };
    let Some(tls) = tls else {
        return serve_connection(tracked, peer, None, activity, app, stop, permit).await;
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.current());
    let stream = match tokio::time::timeout(REQUEST_DEADLINE, acceptor.accept(tracked)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            log::info!("HTTP API: TLS handshake with {peer} failed: {e}");
            return;
        }
        Err(_) => {
            log::info!(
                "HTTP API: dropped {peer}: its TLS handshake was not over within {} s",
                REQUEST_DEADLINE.as_secs()
            );
            return;
        }
    };
    let identity = match stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
    {
        None => None,
        Some(cert) => match vdstream_tls::peer::identity_of(cert) {
            Ok(id) => Some(PeerIdentity(id)),
            Err(e) => {
                log::info!("HTTP API: the client certificate of {peer} names no vdstream identity ({e}); treated as no certificate");
                None
            }
        },
    };
    serve_connection(stream, peer, identity, activity, app, stop, permit).await
}

async fn serve_connection<I>(
    io: I,
    peer: SocketAddr,
    identity: Option<PeerIdentity>,
    activity: Arc<Activity>,
    app: Router,
    mut stop: watch::Receiver<bool>,
    _permit: tokio::sync::OwnedSemaphorePermit,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let io = TokioIo::new(io);
    let a = activity.clone();
    let app = NormalizePath::trim_trailing_slash(app);
    let service =
        hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(ClientAddr(peer));
            if let Some(id) = &identity {
                req.extensions_mut().insert(id.clone());
            }
            let busy = Busy::new(a.clone());
            let app = app.clone();
            async move {
                let r = app.oneshot(req).await;
                drop(busy);
                r
            }
        });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(REQUEST_DEADLINE)
        .max_header_size(MAX_HEAD)
        .max_headers(MAX_HEADERS)
        // A client may half-close after its request and still read the answer.
        .half_close(true)
        .title_case_headers(true)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            r = &mut conn => {
                if let Err(e) = r {
                    log::debug!("HTTP API: connection from {peer}: {e}");
                }
                break;
            }
            _ = stopped(&mut stop) => break,
            _ = tick.tick() => {
                if activity.busy.load(Ordering::Acquire) == 0 && activity.idle_for() > IDLE_TIMEOUT {
                    log::debug!("HTTP API: closing the connection from {peer}: no byte moved for {} s", IDLE_TIMEOUT.as_secs());
                    break;
                }
            }
        }
    }
}
