//! The server's HTTP API and Prometheus `/metrics` (`vdstream server --http ADDR`): axum's
//! routing on hyper's HTTP/1 server, on a tokio runtime of its own (apart from the NBD
//! side's, so that nothing the API's clients do can slow NBD sessions down).
//!
//! ```text
//!   accept loop (one task) ── takes a permit of the connection cap, then accepts
//!     └▶ one task per connection: hyper HTTP/1 (header read timeout, head size limits)
//!          └▶ axum Router (the patterns of router::ROUTES, and a fallback)
//!               └▶ dispatch: protocol checks, the body read with a limit and a deadline,
//!                  then router::handle on the blocking pool ──▶ store.rs (vDisks, versions,
//!                  targets), live.rs (sessions, agent reports), metrics.rs
//!   sampler thread: every second, a snapshot of every session's counters (rates over 5 s),
//!                   and expired agent reports swept away
//! ```
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
//!   agent reports (413 over it). Heads: [`MAX_HEAD`] bytes and 64 fields (431).
//! - Everything the API itself answers is the JSON error document of error.rs; what hyper
//!   refuses before a request exists (a request line that does not parse, a head too large)
//!   gets hyper's bare status, and a head cut short or too slow a closed connection.
//! - [`HttpHandle::stop`] closes the listener and every open connection, and returns once
//!   the API's threads are gone.

mod error;
mod live;
mod metrics;
mod router;
mod store;

use std::net::{SocketAddr, TcpListener};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode, Version};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use axum::{Extension, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{watch, Semaphore};

use crate::state::ServerState;

pub use error::ApiError;
pub use router::{Route, ROUTES};

/// Time a request head (and then its body) may take to arrive, and a kept-alive
/// connection may idle between requests.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(10);
/// A connection that moves no byte for this long, with no request of it in a handler, is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest request body.
pub const MAX_BODY: usize = 1 << 20;
/// Largest agent report (`PUT /api/v1/targets/{id}/agent`).
pub const MAX_AGENT_REPORT: usize = 64 << 10;
/// Largest request head (request line and header fields).
pub const MAX_HEAD: usize = 16 << 10;
/// Most header fields in a request.
const MAX_HEADERS: usize = 64;

/// How many connections the API keeps open at most: a quarter of the soft limit on open
/// files (the rest is for the NBD side and the store's files), between 64 and 16,384.
pub fn connection_limit() -> usize {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes only into `rl`, a live local of the right type.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0 { rl.rlim_cur } else { 1024 };
    let soft = usize::try_from(soft).unwrap_or(usize::MAX);
    (soft / 4).clamp(64, 16_384)
}

/// What the API's tasks share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub state: Arc<ServerState>,
    pub live: live::Live,
    stop: AtomicBool,
}

/// The address of the client of a request (ip:port), for the audit trail.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClientAddr(pub SocketAddr);

/// The running API; [`HttpHandle::stop`] (or dropping it) stops it.
#[derive(Debug)]
pub struct HttpHandle {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop_tx: watch::Sender<bool>,
    server: Option<JoinHandle<()>>,
    sampler: Option<JoinHandle<()>>,
}

/// Serves the API on `listener` until the handle is stopped.
pub fn spawn(listener: TcpListener, state: Arc<ServerState>) -> std::io::Result<HttpHandle> {
    let addr = listener.local_addr()?;
    listener.set_nonblocking(true)?;
    let shared = Arc::new(Shared { state, live: live::Live::default(), stop: AtomicBool::new(false) });
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("http-api").enable_all().build()?;
    let listener = {
        let _in = runtime.enter();
        tokio::net::TcpListener::from_std(listener)?
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let limit = connection_limit();
    let s = shared.clone();
    let server = std::thread::Builder::new().name("http-api".into()).spawn(move || {
        runtime.block_on(serve(listener, s, stop_rx, limit));
        // Handlers still on the blocking pool (a store change) get a moment to finish.
        runtime.shutdown_timeout(Duration::from_secs(5));
    })?;
    let s = shared.clone();
    let sampler = std::thread::Builder::new().name("http-sampler".into()).spawn(move || {
        while !s.stop.load(Ordering::Acquire) {
            s.live.sample(&s.state.registry.sessions());
            s.live.sweep_reports();
            std::thread::park_timeout(live::SAMPLE_EVERY);
        }
    });
    let sampler = match sampler {
        Ok(t) => t,
        Err(e) => {
            let _ = stop_tx.send(true);
            let _ = server.join();
            return Err(e);
        }
    };
    log::info!("HTTP API on http://{addr}/api/v1/server, metrics on http://{addr}/metrics (at most {limit} connections)");
    Ok(HttpHandle { addr, shared, stop_tx, server: Some(server), sampler: Some(sampler) })
}

impl HttpHandle {
    /// Where the API listens (useful after binding port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, closes every open connection and waits for the threads.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if self.shared.stop.swap(true, Ordering::AcqRel) {
            return;
        }
        let _ = self.stop_tx.send(true);
        if let Some(t) = self.server.take() {
            let _ = t.join();
        }
        if let Some(t) = self.sampler.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Drop for HttpHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The axum router: every pattern of [`ROUTES`] (any method) and the fallback lead to
/// [`dispatch`], which leaves routing to `router::handle` (one table, its 404 and 405).
fn app(shared: Arc<Shared>) -> Router {
    let mut r = Router::new();
    for (pattern, _, _) in ROUTES {
        r = r.route(pattern, any(dispatch));
    }
    r.fallback(dispatch).with_state(shared)
}

async fn serve(listener: tokio::net::TcpListener, shared: Arc<Shared>, mut stop: watch::Receiver<bool>, limit: usize) {
    let app = app(shared);
    let permits = Arc::new(Semaphore::new(limit));
    let mut tasks = tokio::task::JoinSet::new();
    let mut warned: Option<Instant> = None;
    loop {
        if permits.available_permits() == 0 && warned.map_or(true, |t| t.elapsed() > Duration::from_secs(10)) {
            log::warn!("HTTP API: {limit} connections open, its limit; new connections wait until one closes");
            warned = Some(Instant::now());
        }
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            _ = stop.wait_for(|s| *s) => break,
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
            _ = stop.wait_for(|s| *s) => break,
        };
        while tasks.try_join_next().is_some() {}
        tasks.spawn(connection(stream, peer, app.clone(), stop.clone(), permit));
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
        self.last_ms.store(self.origin.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn idle_for(&self) -> Duration {
        self.origin.elapsed().saturating_sub(Duration::from_millis(self.last_ms.load(Ordering::Relaxed)))
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
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[std::io::IoSlice<'_>]) -> Poll<std::io::Result<usize>> {
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
/// connection closes its socket; `_permit` returns its place under the cap.
async fn connection(stream: tokio::net::TcpStream, peer: SocketAddr, app: Router, mut stop: watch::Receiver<bool>, _permit: tokio::sync::OwnedSemaphorePermit) {
    let _ = stream.set_nodelay(true);
    let activity = Arc::new(Activity { origin: Instant::now(), last_ms: AtomicU64::new(0), busy: AtomicUsize::new(0) });
    let io = TokioIo::new(Tracked { inner: stream, activity: activity.clone() });
    let a = activity.clone();
    let service = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
        req.extensions_mut().insert(ClientAddr(peer));
        let busy = Busy::new(a.clone());
        let mut app = app.clone();
        async move {
            let r = tower_service::Service::call(&mut app, req).await;
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
            _ = stop.wait_for(|s| *s) => break,
            _ = tick.tick() => {
                if activity.busy.load(Ordering::Acquire) == 0 && activity.idle_for() > IDLE_TIMEOUT {
                    log::debug!("HTTP API: closing the connection from {peer}: no byte moved for {} s", IDLE_TIMEOUT.as_secs());
                    break;
                }
            }
        }
    }
}

fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], e.body()).into_response()
}

/// The body limit of a path.
fn body_limit(path: &str) -> usize {
    if path.starts_with("/api/v1/targets/") && path.trim_end_matches('/').ends_with("/agent") {
        MAX_AGENT_REPORT
    } else {
        MAX_BODY
    }
}

/// Reads the body (bounded by `limit` and [`REQUEST_DEADLINE`]).
async fn read_body(body: Body, limit: usize, announced: Option<u64>) -> Result<Vec<u8>, ApiError> {
    let too_large = |len: String| ApiError::new(413, format!("the body is {len} bytes, over the limit of {limit} for this route"), format!("send a body of at most {limit} bytes"));
    if let Some(n) = announced.filter(|n| *n > limit as u64) {
        return Err(too_large(n.to_string()));
    }
    match tokio::time::timeout(REQUEST_DEADLINE, axum::body::to_bytes(body, limit)).await {
        Err(_) => Err(ApiError::new(408, "the request body did not arrive in time", format!("send the whole request within {} seconds", REQUEST_DEADLINE.as_secs()))),
        Ok(Ok(b)) => Ok(b.to_vec()),
        Ok(Err(e)) => {
            let inner = e.into_inner();
            if inner.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                Err(too_large("more than that".to_string()))
            } else {
                Err(ApiError::bad_request(format!("the request body could not be read: {inner}"), "send a body of Content-Length bytes (or chunked), whole"))
            }
        }
    }
}

/// Every request: checks what hyper lets through but the API refuses (HTTP/1.1 without
/// Host, header values that are not text), reads the body, and answers with
/// `router::handle` run on the blocking pool (the store's functions block).
async fn dispatch(State(shared): State<Arc<Shared>>, client: Option<Extension<ClientAddr>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    if parts.version == Version::HTTP_11 && !parts.headers.contains_key(header::HOST) {
        return error_response(&ApiError::bad_request("an HTTP/1.1 request needs a Host field", "send Host: with the server's address"));
    }
    if let Some((name, _)) = parts.headers.iter().find(|(_, v)| v.to_str().is_err()) {
        return error_response(&ApiError::bad_request(format!("header {name} is not printable ASCII"), "send header values in printable ASCII"));
    }
    let announced = parts.headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    let body = match read_body(body, body_limit(parts.uri.path()), announced).await {
        Ok(b) => b,
        Err(e) => return error_response(&e),
    };
    let req = vdstream_http::wire::Request {
        method: parts.method.as_str().to_string(),
        path: parts.uri.path().to_string(),
        query: parts.uri.query().unwrap_or("").to_string(),
        minor: if parts.version == Version::HTTP_10 { 0 } else { 1 },
        headers: Vec::new(),
        body,
    };
    let client = client.map(|Extension(c)| c);
    let reply = match tokio::task::spawn_blocking(move || router::handle(&shared, &req, client)).await {
        Ok(r) => r,
        Err(e) => return error_response(&ApiError::new(500, format!("the handler failed: {e}"), "this is a bug in vdstream; see the server's log and report it")),
    };
    let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = (status, reply.body).into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(reply.content_type));
    if let Some(allow) = reply.allow.as_deref().and_then(|a| HeaderValue::from_str(a).ok()) {
        resp.headers_mut().insert(header::ALLOW, allow);
    }
    resp
}
