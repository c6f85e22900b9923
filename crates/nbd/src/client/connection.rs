//! The transmission phase of one NBD connection: many requests in flight, one writer side,
//! one reader task that routes replies to waiting requests by cookie.
//!
//! Invariants:
//! - Every in-flight request has exactly one entry in [`InFlightTable`], keyed by a cookie
//!   that is never reused on this connection. An entry is completed exactly once: by its
//!   reply, or by [`Connection::fail`], which drains the table.
//! - Once `fail` ran, the table is closed: no request can be added, so no request can wait
//!   forever on a dead connection.
//! - A request is either wholly in the outgoing byte stream or not at all: request bytes are
//!   appended to the [`Outbox`] under a plain mutex (no await), so a cancelled caller can never
//!   leave half a request on the wire. In [`WriterMode::Locked`], a caller cancelled in the
//!   middle of its write fails the connection instead.
//! - The reader never allocates from a wire length: data lands in the buffer the request
//!   brought, after checking the chunk against the request's offset and length.
//! - On a plain socket in [`WriterMode::Coalescing`], the thread that queued requests
//!   writes them itself when nobody else is writing and the socket takes them at once
//!   (a non-blocking send), so a request costs no hand-off to the writer task; what the
//!   socket does not take at once stays queued, first, for the writer task. One writer at
//!   a time ([`OutboxState::writing`]), so request bytes never interleave. Inside
//!   [`corked`], requests are only queued, and go out together when its poll returns.

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{oneshot, Notify};
use tokio::task::JoinHandle;

use super::error::{ClientError, Op};
use crate::proto;
use vdstream_blockdev::lock;

pub(crate) type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;
pub(crate) type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

/// How request bytes reach the socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WriterMode {
    /// Requests are appended to a shared buffer; one writer task sends everything queued
    /// since its last write in one syscall. Cancellation-safe. The default (faster, see
    /// the client_bench example).
    #[default]
    Coalescing,
    /// Each request takes an async mutex over the socket and writes itself.
    Locked,
}

/// Most block-status descriptors we keep for one request, whatever the server sends.
const MAX_EXTENTS: usize = 1 << 20;
/// Longest error chunk we read (4 KiB message plus headers, with room to spare).
const MAX_ERROR_CHUNK: u32 = 16 * 1024;
/// Buffer of the reply reader.
const READ_BUFFER: usize = 256 * 1024;

/// What a request expects back, and where its data goes.
#[derive(Debug)]
pub(crate) enum ReplyKind {
    Read(Vec<u8>),
    BlockStatus {
        context: Option<u32>,
        extents: Vec<(u32, u32)>,
    },
    Plain,
}

/// A request waiting for its reply.
#[derive(Debug)]
struct InFlight {
    op: Op,
    offset: u64,
    len: u32,
    kind: ReplyKind,
    /// Bytes of a read covered by data and hole chunks so far.
    covered: u64,
    error: Option<ClientError>,
    done: oneshot::Sender<Result<ReplyKind, ClientError>>,
}

#[derive(Debug, Default)]
struct InFlightTable {
    map: HashMap<u64, InFlight>,
    /// Why the connection is gone; set once, never cleared.
    closed: Option<Arc<str>>,
    /// `disconnect` was called: no new requests.
    draining: bool,
}

#[derive(Debug, Default)]
struct OutboxState {
    buf: Vec<u8>,
    /// The writer task or a requesting thread is writing to the socket: only it may.
    writing: bool,
    /// A second buffer, swapped with `buf` by the thread that writes.
    spare: Vec<u8>,
    /// Send what is queued, shut the write side down, stop.
    finish: bool,
    /// Stop now.
    abort: bool,
}

/// Request bytes waiting for the writer task (or a requesting thread) to send them.
#[derive(Debug, Default)]
struct Outbox {
    state: Mutex<OutboxState>,
    wake: Notify,
    /// The socket itself, for requesting threads' non-blocking sends; `None` under TLS,
    /// whose records only the writer task's stream can make.
    direct: Option<OwnedFd>,
}

enum Writer {
    Coalescing(Outbox),
    Locked(tokio::sync::Mutex<Option<WriteHalf>>),
}

/// One transmission-phase connection. Shared by the [`super::Client`] and its two tasks.
pub(crate) struct Connection {
    pub(crate) addr: Arc<str>,
    table: Mutex<InFlightTable>,
    writer: Writer,
    next_cookie: AtomicU64,
    idle: Notify,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    pub(crate) stats: Counters,
}

/// Reply counters, updated by the reader task only (relaxed atomics).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub simple_replies: AtomicU64,
    pub data_chunks: AtomicU64,
    pub hole_chunks: AtomicU64,
    pub error_chunks: AtomicU64,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// A request as the caller describes it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Command {
    pub op: Op,
    pub flags: u16,
    pub offset: u64,
    pub len: u32,
}

impl Connection {
    /// Start the reader (and, in coalescing mode, writer) task on an established stream.
    /// `direct` is a plain socket's descriptor (a duplicate), for requesting threads' own sends.
    pub(crate) fn start(
        addr: Arc<str>,
        r: ReadHalf,
        w: WriteHalf,
        mode: WriterMode,
        direct: Option<OwnedFd>,
    ) -> Arc<Self> {
        let (writer, w) = match mode {
            WriterMode::Coalescing => (
                Writer::Coalescing(Outbox {
                    direct,
                    ..Outbox::default()
                }),
                Some(w),
            ),
            WriterMode::Locked => (Writer::Locked(tokio::sync::Mutex::new(Some(w))), None),
        };
        let conn = Arc::new(Connection {
            addr,
            table: Mutex::new(InFlightTable::default()),
            writer,
            next_cookie: AtomicU64::new(1),
            idle: Notify::new(),
            tasks: Mutex::new(Vec::new()),
            stats: Counters::default(),
        });
        let mut tasks = vec![tokio::spawn(run_reader(
            conn.clone(),
            BufReader::with_capacity(READ_BUFFER, r),
        ))];
        if let Some(w) = w {
            tasks.push(tokio::spawn(run_writer(conn.clone(), w)));
        }
        *lock(&conn.tasks) = tasks;
        conn
    }

    /// The reason the connection is gone, if it is.
    pub(crate) fn closed_reason(&self) -> Option<Arc<str>> {
        lock(&self.table).closed.clone()
    }

    fn disconnected(&self, reason: Arc<str>) -> ClientError {
        ClientError::Disconnected {
            addr: self.addr.clone(),
            reason,
        }
    }

    /// Register a request and put it on the wire. Returns the receiver of its reply.
    pub(crate) async fn submit(
        self: &Arc<Self>,
        cmd: Command,
        kind: ReplyKind,
        payload: &[u8],
    ) -> Result<oneshot::Receiver<Result<ReplyKind, ClientError>>, ClientError> {
        let cookie = self.next_cookie.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut t = lock(&self.table);
            if let Some(reason) = &t.closed {
                return Err(self.disconnected(reason.clone()));
            }
            if t.draining {
                return Err(self.disconnected("the client is disconnecting".into()));
            }
            let entry = InFlight {
                op: cmd.op,
                offset: cmd.offset,
                len: cmd.len,
                kind,
                covered: 0,
                error: None,
                done: tx,
            };
            t.map.insert(cookie, entry);
        }
        self.send(cookie, cmd, payload).await?;
        Ok(rx)
    }

    async fn send(
        self: &Arc<Self>,
        cookie: u64,
        cmd: Command,
        payload: &[u8],
    ) -> Result<(), ClientError> {
        let header = encode_request(cookie, cmd);
        match &self.writer {
            Writer::Coalescing(outbox) => {
                {
                    let mut st = lock(&outbox.state);
                    st.buf.extend_from_slice(&header);
                    st.buf.extend_from_slice(payload);
                }
                if outbox.direct.is_none() {
                    outbox.wake.notify_one();
                } else if !CORK.with(|c| {
                    c.borrow_mut()
                        .as_mut()
                        .map(|held| hold(held, self))
                        .is_some()
                }) {
                    self.send_queued(outbox);
                }
                Ok(())
            }
            Writer::Locked(m) => {
                let mut guard = m.lock().await;
                let Some(w) = guard.as_mut() else {
                    return Err(self.disconnected(
                        self.closed_reason()
                            .unwrap_or_else(|| "write side closed".into()),
                    ));
                };
                let mut cancelled = FailOnDrop {
                    conn: self,
                    armed: true,
                };
                let res = if payload.len() <= 64 * 1024 {
                    let mut m = Vec::with_capacity(header.len() + payload.len());
                    m.extend_from_slice(&header);
                    m.extend_from_slice(payload);
                    w.write_all(&m).await
                } else {
                    match w.write_all(&header).await {
                        Ok(()) => w.write_all(payload).await,
                        Err(e) => Err(e),
                    }
                };
                // A TLS stream holds records until flushed (a no-op on a plain socket).
                let res = match res {
                    Ok(()) => w.flush().await,
                    e => e,
                };
                cancelled.armed = false;
                if let Err(e) = res {
                    let reason: Arc<str> = format!("writing to the server failed: {e}").into();
                    *guard = None;
                    drop(guard);
                    self.fail(reason.clone());
                    return Err(self.disconnected(reason));
                }
                Ok(())
            }
        }
    }

    /// Sends what is queued from this thread, if nobody else is writing and the socket
    /// takes it without blocking; what it does not take is left, first in the queue, to
    /// the writer task.
    fn send_queued(&self, outbox: &Outbox) {
        let Some(fd) = &outbox.direct else { return };
        let mut out = {
            let mut st = lock(&outbox.state);
            if st.writing || st.buf.is_empty() || st.abort || st.finish {
                return;
            }
            st.writing = true;
            let spare = std::mem::take(&mut st.spare);
            std::mem::replace(&mut st.buf, spare)
        };
        let sock = socket2::SockRef::from(fd);
        let mut sent = 0;
        let failed = loop {
            if sent == out.len() {
                break None;
            }
            match sock.send_with_flags(&out[sent..], libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break None,
                Err(e) => break Some(e),
            }
        };
        let more = {
            let mut st = lock(&outbox.state);
            st.writing = false;
            if sent < out.len() {
                // The rest goes first, before what was queued meanwhile.
                out.drain(..sent);
                out.extend_from_slice(&st.buf);
                st.buf.clear();
                st.spare = std::mem::replace(&mut st.buf, out);
            } else {
                out.clear();
                if out.capacity() <= 8 * 1024 * 1024 {
                    st.spare = out;
                }
            }
            !st.buf.is_empty() || st.finish
        };
        if let Some(e) = failed {
            self.fail(format!("writing to the server failed: {e}").into());
        } else if more {
            outbox.wake.notify_one();
        }
    }

    /// Send NBD_CMD_DISC once every in-flight request has its reply, then close.
    pub(crate) async fn disconnect(&self) {
        {
            let mut t = lock(&self.table);
            if t.closed.is_some() {
                return;
            }
            t.draining = true;
        }
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            {
                let t = lock(&self.table);
                if t.map.is_empty() || t.closed.is_some() {
                    break;
                }
            }
            idle.await;
        }
        // Close the table first, so the reason callers see is ours, not the EOF that follows.
        self.close_table("the client disconnected".into());
        let disc = encode_request(
            0,
            Command {
                op: Op::Disconnect,
                flags: 0,
                offset: 0,
                len: 0,
            },
        );
        match &self.writer {
            Writer::Coalescing(outbox) => {
                {
                    let mut st = lock(&outbox.state);
                    st.buf.extend_from_slice(&disc);
                    st.finish = true;
                }
                outbox.wake.notify_one();
                let writer = lock(&self.tasks).pop();
                if let Some(w) = writer {
                    let _ = w.await;
                }
            }
            Writer::Locked(m) => {
                if let Some(mut w) = m.lock().await.take() {
                    let _ = w.write_all(&disc).await;
                    let _ = w.flush().await;
                    let _ = w.shutdown().await;
                }
            }
        }
        self.stop_tasks();
    }

    /// Mark the connection dead: fail every waiting request with `Disconnected`, refuse new
    /// ones, stop both tasks. Idempotent; the first reason wins.
    pub(crate) fn fail(&self, reason: Arc<str>) {
        self.close_table(reason);
        self.stop_tasks();
    }

    /// Close the in-flight table with `reason` and fail what it held (no-op if closed).
    fn close_table(&self, reason: Arc<str>) {
        let drained = {
            let mut t = lock(&self.table);
            if t.closed.is_some() {
                return;
            }
            log::debug!("{}: connection closed: {reason}", self.addr);
            t.closed = Some(reason.clone());
            std::mem::take(&mut t.map)
        };
        for (_, entry) in drained {
            let _ = entry.done.send(Err(self.disconnected(reason.clone())));
        }
        self.idle.notify_waiters();
    }

    /// Stop the reader and writer tasks (idempotent).
    fn stop_tasks(&self) {
        if let Writer::Coalescing(outbox) = &self.writer {
            lock(&outbox.state).abort = true;
            outbox.wake.notify_one();
            // The duplicate would keep the socket open after the tasks' halves are gone.
            if let Some(fd) = &outbox.direct {
                let _ = socket2::SockRef::from(fd).shutdown(std::net::Shutdown::Both);
            }
        }
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
    }

    fn take(&self, cookie: u64) -> Result<InFlight, String> {
        let mut t = lock(&self.table);
        match t.map.remove(&cookie) {
            Some(e) => Ok(e),
            None if t.closed.is_some() => Err("connection closed".into()),
            None => Err(format!("reply for unknown cookie {cookie:#x}")),
        }
    }

    fn put_back(&self, cookie: u64, entry: InFlight) {
        let mut t = lock(&self.table);
        if let Some(reason) = t.closed.clone() {
            drop(t);
            let _ = entry.done.send(Err(self.disconnected(reason)));
        } else {
            t.map.insert(cookie, entry);
        }
    }

    fn complete(&self, mut entry: InFlight) {
        if entry.error.is_none() {
            if let ReplyKind::Read(_) = entry.kind {
                if entry.covered != u64::from(entry.len) {
                    entry.error = Some(self.protocol(
                        &entry,
                        format!(
                            "data and hole chunks cover {} of {} bytes",
                            entry.covered, entry.len
                        ),
                    ));
                }
            }
        }
        let result = match entry.error {
            Some(e) => Err(e),
            None => Ok(entry.kind),
        };
        let _ = entry.done.send(result);
        let t = lock(&self.table);
        if t.draining && t.map.is_empty() {
            self.idle.notify_waiters();
        }
    }

    fn protocol(&self, e: &InFlight, reason: String) -> ClientError {
        ClientError::Protocol {
            addr: self.addr.clone(),
            op: e.op,
            offset: e.offset,
            reason,
        }
    }

    fn server_error(&self, e: &InFlight, errno: u32, message: String) -> ClientError {
        ClientError::Server {
            addr: self.addr.clone(),
            op: e.op,
            offset: e.offset,
            len: u64::from(e.len),
            errno,
            message,
        }
    }
}

/// Cancellation guard for a write in `WriterMode::Locked`.
struct FailOnDrop<'a> {
    conn: &'a Connection,
    armed: bool,
}

impl Drop for FailOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.conn
                .fail("a request was cancelled in the middle of its write".into());
        }
    }
}

fn encode_request(cookie: u64, cmd: Command) -> [u8; 28] {
    let mut h = [0u8; 28];
    h[0..4].copy_from_slice(&proto::REQUEST_MAGIC.to_be_bytes());
    h[4..6].copy_from_slice(&cmd.flags.to_be_bytes());
    h[6..8].copy_from_slice(&cmd.op.command().to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    h[16..24].copy_from_slice(&cmd.offset.to_be_bytes());
    h[24..28].copy_from_slice(&cmd.len.to_be_bytes());
    h
}

async fn run_writer(conn: Arc<Connection>, mut w: WriteHalf) {
    let Writer::Coalescing(outbox) = &conn.writer else {
        return;
    };
    let mut batch: Vec<u8> = Vec::with_capacity(64 * 1024);
    loop {
        let (finish, busy) = {
            let mut st = lock(&outbox.state);
            if st.abort {
                return;
            }
            // A requesting thread is sending: it wakes this task for what it leaves.
            if !st.writing {
                std::mem::swap(&mut st.buf, &mut batch);
                st.writing = !batch.is_empty();
            }
            (st.finish, st.writing && batch.is_empty())
        };
        if busy {
            outbox.wake.notified().await;
            continue;
        }
        if batch.is_empty() {
            if finish {
                let _ = w.shutdown().await;
                return;
            }
            outbox.wake.notified().await;
            continue;
        }
        // flush: a TLS stream holds records until flushed (a no-op on a plain socket).
        if let Err(e) = async {
            w.write_all(&batch).await?;
            w.flush().await
        }
        .await
        {
            conn.fail(format!("writing to the server failed: {e}").into());
            return;
        }
        lock(&outbox.state).writing = false;
        batch.clear();
        if batch.capacity() > 8 * 1024 * 1024 {
            batch.shrink_to(1024 * 1024);
        }
    }
}

thread_local! {
    /// Inside [`corked`] on this thread: the connections with requests queued and not sent.
    static CORK: RefCell<Option<Vec<Arc<Connection>>>> = const { RefCell::new(None) };
}

fn hold(held: &mut Vec<Arc<Connection>>, conn: &Arc<Connection>) {
    if !held.iter().any(|c| Arc::ptr_eq(c, conn)) {
        held.push(conn.clone());
    }
}

/// `fut`, with the requests that each of its polls makes queued and sent together when the
/// poll returns: a batch of requests from one thread goes out in one write.
pub fn corked<F: Future>(fut: F) -> Corked<F> {
    Corked { fut: Box::pin(fut) }
}

/// See [`corked`].
pub struct Corked<F> {
    fut: Pin<Box<F>>,
}

impl<F> std::fmt::Debug for Corked<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Corked").finish_non_exhaustive()
    }
}

impl<F: Future> Future for Corked<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // Uncorks when the poll returns, and when it panics (a caller that catches the
        // panic keeps this thread: its later requests must not stay held).
        struct Uncork(Option<Vec<Arc<Connection>>>);
        impl Drop for Uncork {
            fn drop(&mut self) {
                let held = CORK
                    .with(|c| std::mem::replace(&mut *c.borrow_mut(), self.0.take()))
                    .unwrap_or_default();
                for conn in held {
                    if let Writer::Coalescing(outbox) = &conn.writer {
                        conn.send_queued(outbox);
                    }
                }
            }
        }
        let _uncork = Uncork(CORK.with(|c| c.borrow_mut().replace(Vec::new())));
        self.fut.as_mut().poll(cx)
    }
}

/// Why the reader stopped.
enum ReaderStop {
    Io(std::io::Error),
    Protocol(String),
}

impl From<std::io::Error> for ReaderStop {
    fn from(e: std::io::Error) -> Self {
        ReaderStop::Io(e)
    }
}

async fn run_reader(conn: Arc<Connection>, mut r: BufReader<ReadHalf>) {
    let reason = match read_replies(&conn, &mut r).await {
        ReaderStop::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            "the server closed the connection".to_string()
        }
        ReaderStop::Io(e) => format!("reading from the server failed: {e}"),
        ReaderStop::Protocol(p) => format!("protocol error: {p}"),
    };
    conn.fail(reason.into());
}

async fn read_replies(conn: &Connection, r: &mut BufReader<ReadHalf>) -> ReaderStop {
    loop {
        let res = match r.read_u32().await {
            Ok(proto::SIMPLE_REPLY_MAGIC) => simple_reply(conn, r).await,
            Ok(proto::STRUCTURED_REPLY_MAGIC) => structured_chunk(conn, r).await,
            Ok(m) => Err(ReaderStop::Protocol(format!("bad reply magic {m:#x}"))),
            Err(e) => Err(e.into()),
        };
        if let Err(stop) = res {
            return stop;
        }
    }
}

async fn simple_reply(conn: &Connection, r: &mut BufReader<ReadHalf>) -> Result<(), ReaderStop> {
    let errno = r.read_u32().await?;
    let cookie = r.read_u64().await?;
    let mut e = conn.take(cookie).map_err(ReaderStop::Protocol)?;
    conn.stats.simple_replies.fetch_add(1, Ordering::Relaxed);
    if errno != 0 {
        e.error = Some(conn.server_error(&e, errno, String::new()));
        if let ReplyKind::Read(_) = e.kind {
            e.covered = u64::from(e.len);
        }
    } else {
        match &mut e.kind {
            ReplyKind::Read(buf) => {
                if let Err(err) = r.read_exact(buf).await {
                    conn.put_back(cookie, e);
                    return Err(err.into());
                }
                e.covered = u64::from(e.len);
            }
            ReplyKind::BlockStatus { .. } => {
                e.error = Some(conn.protocol(&e, "simple reply to block status".into()));
            }
            ReplyKind::Plain => {}
        }
    }
    conn.complete(e);
    Ok(())
}

async fn structured_chunk(
    conn: &Connection,
    r: &mut BufReader<ReadHalf>,
) -> Result<(), ReaderStop> {
    let flags = r.read_u16().await?;
    let kind = r.read_u16().await?;
    let cookie = r.read_u64().await?;
    let length = r.read_u32().await?;
    let mut e = conn.take(cookie).map_err(ReaderStop::Protocol)?;
    // A chunk error that leaves the stream in sync only fails this request; one that does
    // not (we would have to trust a wire length) stops the connection.
    let res = chunk_payload(conn, r, &mut e, kind, length).await;
    match res {
        Ok(()) => {}
        Err(stop) => {
            conn.put_back(cookie, e);
            return Err(stop);
        }
    }
    if flags & proto::REPLY_FLAG_DONE != 0 {
        conn.complete(e);
    } else if kind == proto::REPLY_TYPE_NONE {
        conn.put_back(cookie, e);
        return Err(ReaderStop::Protocol(
            "NBD_REPLY_TYPE_NONE without the DONE flag".into(),
        ));
    } else {
        conn.put_back(cookie, e);
    }
    Ok(())
}

async fn chunk_payload(
    conn: &Connection,
    r: &mut BufReader<ReadHalf>,
    e: &mut InFlight,
    kind: u16,
    length: u32,
) -> Result<(), ReaderStop> {
    let (op, at) = (e.op, e.offset);
    let proto_err = |m: String| {
        ReaderStop::Protocol(format!(
            "chunk type {kind} in the reply to {op} at {at}: {m}"
        ))
    };
    match kind {
        proto::REPLY_TYPE_NONE => {
            if length != 0 {
                return Err(proto_err(format!("NONE chunk with {length} payload bytes")));
            }
        }
        proto::REPLY_TYPE_OFFSET_DATA | proto::REPLY_TYPE_OFFSET_HOLE => {
            let (req_offset, req_len) = (e.offset, u64::from(e.len));
            let ReplyKind::Read(buf) = &mut e.kind else {
                return Err(proto_err(
                    "data or hole chunk in reply to a non-read".into(),
                ));
            };
            let is_data = kind == proto::REPLY_TYPE_OFFSET_DATA;
            if (is_data && length <= 8) || (!is_data && length != 12) {
                return Err(proto_err(format!("bad chunk length {length}")));
            }
            let offset = r.read_u64().await?;
            let count = if is_data {
                u64::from(length - 8)
            } else {
                u64::from(r.read_u32().await?)
            };
            let start = offset
                .checked_sub(req_offset)
                .filter(|s| count > 0 && s.checked_add(count).is_some_and(|end| end <= req_len));
            let Some(start) = start else {
                return Err(proto_err(format!(
                    "chunk [{offset}, +{count}) outside the requested [{req_offset}, +{req_len})"
                )));
            };
            let range = start as usize..(start + count) as usize;
            if is_data {
                r.read_exact(&mut buf[range]).await?;
                conn.stats.data_chunks.fetch_add(1, Ordering::Relaxed);
            } else {
                buf[range].fill(0);
                conn.stats.hole_chunks.fetch_add(1, Ordering::Relaxed);
            }
            e.covered += count;
        }
        proto::REPLY_TYPE_BLOCK_STATUS => {
            let ReplyKind::BlockStatus { context, extents } = &mut e.kind else {
                return Err(proto_err(
                    "block status chunk in reply to another command".into(),
                ));
            };
            if length < 12 || (length - 4) & 7 != 0 {
                return Err(proto_err(format!("bad block status chunk length {length}")));
            }
            let id = r.read_u32().await?;
            let wanted = Some(id) == *context;
            for _ in 0..(length - 4) / 8 {
                let len = r.read_u32().await?;
                let flags = r.read_u32().await?;
                if wanted {
                    if len == 0 || extents.len() >= MAX_EXTENTS {
                        return Err(proto_err("zero-length extent or too many extents".into()));
                    }
                    extents.push((len, flags));
                }
            }
        }
        k if k & (1 << 15) != 0 => {
            if !(6..=MAX_ERROR_CHUNK).contains(&length) {
                return Err(proto_err(format!("error chunk of {length} bytes")));
            }
            conn.stats.error_chunks.fetch_add(1, Ordering::Relaxed);
            let errno = r.read_u32().await?;
            let msg_len = u32::from(r.read_u16().await?);
            let tail = if k == proto::REPLY_TYPE_ERROR_OFFSET {
                8
            } else {
                0
            };
            if msg_len + tail > length - 6 {
                return Err(proto_err(format!(
                    "error message of {msg_len} bytes in a {length}-byte chunk"
                )));
            }
            let mut rest = vec![0u8; (length - 6) as usize];
            r.read_exact(&mut rest).await?;
            let message = String::from_utf8_lossy(&rest[..msg_len as usize]).into_owned();
            if e.error.is_none() {
                e.error = Some(if errno == 0 {
                    conn.protocol(e, format!("error chunk with errno 0: {message}"))
                } else {
                    conn.server_error(e, errno, message)
                });
            }
            // An error chunk of a read stands for the part it did not cover.
            if let ReplyKind::Read(_) = e.kind {
                e.covered = u64::from(e.len);
            }
        }
        _ => {
            log::debug!(
                "{}: skipping unknown chunk type {kind} ({length} bytes)",
                conn.addr
            );
            tokio::io::copy(
                &mut (&mut *r).take(u64::from(length)),
                &mut tokio::io::sink(),
            )
            .await?;
        }
    }
    Ok(())
}
