//! The server's HTTP API and Prometheus `/metrics` (`vdstream server --http ADDR`): a
//! small HTTP/1.1 server on std threads over [`vdstream_http::wire`].
//!
//! ```text
//!   accept thread ──▶ one thread per connection (at most MAX_CONNECTIONS; more get 503)
//!                        read_request (bounded head and body, deadline per request)
//!                        └▶ router::handle ──▶ store.rs (vDisks, versions, targets: the store's
//!                                               functions, the CLI's JSON documents)
//!                                           ──▶ live.rs  (sessions, agent reports, rates)
//!                                           ──▶ metrics.rs
//!   sampler thread: every second, a snapshot of every session's counters (rates over 5 s)
//! ```
//!
//! Invariants: a request is read whole, within [`REQUEST_DEADLINE`], before anything acts
//! on it; a malformed one is answered 400 (413, 431, 408 for the limits) and its
//! connection closed, costing nothing else; a connection idle for [`REQUEST_DEADLINE`]
//! is closed (silently; one that stalls inside a request gets 408); [`HttpHandle::stop`] closes the listener and every open connection.

mod error;
mod live;
mod metrics;
mod router;
mod store;

use std::collections::HashMap;
use std::io::{BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vdstream_http::wire::{self, Limits, WireError};

use crate::state::ServerState;

pub use error::ApiError;
pub use router::{Route, ROUTES};

/// Open connections at most; one more is answered 503 and closed.
pub const MAX_CONNECTIONS: usize = 32;
/// Time a request (head and body) may take to arrive, and a kept-alive connection may idle.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(10);
/// Largest request body.
pub const MAX_BODY: usize = 1 << 20;

/// What the connection threads share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub state: Arc<ServerState>,
    pub live: live::Live,
    stop: AtomicBool,
    next_conn: AtomicU64,
    /// Open connections (a clone of each socket), so that `stop` can close them.
    conns: Mutex<HashMap<u64, TcpStream>>,
}

/// The running API; [`HttpHandle::stop`] (or dropping it) stops it.
#[derive(Debug)]
pub struct HttpHandle {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
    sampler: Option<JoinHandle<()>>,
}

/// Serves the API on `listener` until the handle is stopped.
pub fn spawn(listener: TcpListener, state: Arc<ServerState>) -> std::io::Result<HttpHandle> {
    let addr = listener.local_addr()?;
    let shared = Arc::new(Shared {
        state,
        live: live::Live::default(),
        stop: AtomicBool::new(false),
        next_conn: AtomicU64::new(0),
        conns: Mutex::new(HashMap::new()),
    });
    let s = shared.clone();
    let sampler = std::thread::Builder::new().name("http-sampler".into()).spawn(move || {
        while !s.stop.load(Ordering::Acquire) {
            s.live.sample(&s.state.registry.sessions());
            std::thread::park_timeout(live::SAMPLE_EVERY);
        }
    })?;
    let s = shared.clone();
    let accept = std::thread::Builder::new().name("http-accept".into()).spawn(move || accept_loop(listener, s))?;
    log::info!("HTTP API on http://{addr}/api/v1/server, metrics on http://{addr}/metrics");
    Ok(HttpHandle { addr, shared, accept: Some(accept), sampler: Some(sampler) })
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
        // Wake the accept thread with a connection of our own.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(if wake.is_ipv4() { [127, 0, 0, 1].into() } else { std::net::Ipv6Addr::LOCALHOST.into() });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        for c in lock(&self.shared.conns).values() {
            let _ = c.shutdown(Shutdown::Both);
        }
        if let Some(t) = self.sampler.take() {
            t.thread().unpark();
            let _ = t.join();
        }
        let until = Instant::now() + Duration::from_secs(5);
        while !lock(&self.shared.conns).is_empty() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
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

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                // EMFILE and friends: wait a little rather than spin.
                log::warn!("HTTP API: cannot accept a connection: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        {
            let mut conns = lock(&shared.conns);
            if conns.len() >= MAX_CONNECTIONS {
                drop(conns);
                let mut stream = stream;
                let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
                let e = ApiError::new(503, format!("the API has {MAX_CONNECTIONS} connections open, its limit"), "try again in a moment, and close connections you do not use");
                let _ = wire::write_response(&mut stream, 503, &[("Content-Type", "application/json")], &e.body(), false);
                continue;
            }
            match stream.try_clone() {
                Ok(c) => {
                    conns.insert(id, c);
                }
                Err(e) => {
                    log::warn!("HTTP API: cannot use a connection: {e}");
                    continue;
                }
            }
        }
        let s = shared.clone();
        let spawned = std::thread::Builder::new().name("http-conn".into()).spawn(move || {
            serve_connection(&s, stream);
            lock(&s.conns).remove(&id);
        });
        if let Err(e) = spawned {
            log::warn!("HTTP API: cannot start a connection thread: {e}");
            lock(&shared.conns).remove(&id);
        }
    }
}

/// A socket whose reads must all finish by `deadline`; counts the bytes read since the
/// deadline was last set.
struct DeadlineStream {
    stream: TcpStream,
    deadline: Instant,
    got: usize,
}

impl DeadlineStream {
    fn reset(&mut self, deadline: Instant) {
        self.deadline = deadline;
        self.got = 0;
    }
}

impl Read for DeadlineStream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        let n = self.stream.read(buf)?;
        self.got += n;
        Ok(n)
    }
}

fn serve_connection(shared: &Shared, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(REQUEST_DEADLINE));
    let Ok(mut out) = stream.try_clone() else { return };
    let mut reader = BufReader::new(DeadlineStream { stream, deadline: Instant::now() + REQUEST_DEADLINE, got: 0 });
    let limits = Limits { max_head: 16 << 10, max_body: MAX_BODY };
    loop {
        let idle = reader.buffer().is_empty();
        reader.get_mut().reset(Instant::now() + REQUEST_DEADLINE);
        let req = match wire::read_request(&mut reader, &limits) {
            Ok(r) => r,
            Err(WireError::Closed) => return,
            Err(WireError::Io(_)) if shared.stop.load(Ordering::Acquire) => return,
            // A kept-alive connection that sent nothing more: close it without a word.
            Err(WireError::Timeout) if idle && reader.get_ref().got == 0 => return,
            Err(e) => {
                let err = ApiError::from_wire(&e);
                let _ = wire::write_response(&mut out, err.status, &[("Content-Type", "application/json")], &err.body(), false);
                linger_close(&mut out, reader.get_mut());
                return;
            }
        };
        let keep_alive = req.keep_alive() && !shared.stop.load(Ordering::Acquire);
        let reply = router::handle(shared, &req);
        let mut headers = vec![("Content-Type", reply.content_type)];
        if let Some(allow) = &reply.allow {
            headers.push(("Allow", allow.as_str()));
        }
        if wire::write_response(&mut out, reply.status, &headers, &reply.body, keep_alive).is_err() || !keep_alive {
            let _ = out.shutdown(Shutdown::Both);
            return;
        }
    }
}

/// After an error answer: stop writing, and read (and drop) what the peer still sends for
/// a moment, so that closing does not reset the connection before it reads the answer.
fn linger_close(out: &mut TcpStream, input: &mut DeadlineStream) {
    let _ = out.flush();
    let _ = out.shutdown(Shutdown::Write);
    input.deadline = Instant::now() + Duration::from_millis(500);
    let mut sink = [0u8; 8192];
    let mut left = 1usize << 20;
    while left > 0 {
        match input.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
}
