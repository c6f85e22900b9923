//! [`RemoteBase`]: the vDisk as a target sees it, a [`BlockDev`] over the NBD client that
//! survives its servers. It is the lower device of the target's write cache (read-only),
//! or, for the `server` cache types, the whole device (writes forwarded).
//!
//! ```text
//!   read_at (sync, any thread) ─▶ cap on requests and bytes in flight ─▶ Link::client()
//!        ▲                                                             │ live connection
//!        └── reply ◀── NBD client (pipelined) ◀── server ◀─────────────┘
//!            connection lost: same request again on the link's next connection
//! ```
//!
//! Invariants:
//! - A request whose connection breaks before its reply is sent again, unchanged, on the
//!   next connection (same server restarted, or the next one listed); the caller only
//!   waits. Reads and block status are idempotent, so this is always safe; for forwarded
//!   writes see docs/AGENT.md ("exactly once").
//! - Requests are split to the server's maximum block size and widened to its minimum
//!   (a bounce buffer), so callers may ask for any range inside `size()`.
//! - [`Caps`] come from the first server and stay fixed; a later server that cannot do
//!   something (say, block status) is answered around (all data), never lied about.
//! - The sync API polls its request on the caller's thread; the connections' reader and
//!   writer tasks run on the agent's one runtime ([`runtime`]), shared by every base. It
//!   must not be called from a current-thread tokio runtime (the NBD server calls it from
//!   its session threads).

mod journal;
mod link;

use std::future::Future;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};

use vdstream_blockdev::{
    BatchIo, BatchOp, BlockDev, Caps, Error, ErrorKind, Extent, Op, Result, ZeroFlags,
};
use vdstream_nbd::client::{Client, ClientError};
use vdstream_nbd::proto;

use journal::{Change, Recorded};
use link::{is_retryable, Link};
pub use link::{Identity, JoinAttach, LinkCounters, Placement, RemoteOptions, Reorder};

use crate::endpoint::Endpoint;
use crate::AgentError;

/// Longest trim, zero or block-status request sent at once (aligned for any minimum block).
const MAX_RANGE_OP: u64 = 1 << 30;

/// How often the link is looked at for a connection the server closed (a drain, a move to
/// another server, a server that died): it is replaced then, not at the guest's next
/// request, so an idle target moves too and the guest's next request finds a connection.
const WATCH: std::time::Duration = std::time::Duration::from_millis(250);

/// See the module docs.
#[derive(Debug)]
pub struct RemoteBase {
    link: Arc<Link>,
    handle: tokio::runtime::Handle,
    /// The task that reconnects a link whose connection closed ([`WATCH`]); ended on drop.
    watcher: tokio::task::AbortHandle,
    caps: Caps,
    size: u64,
    min_block: u64,
    max_block: u64,
}

/// One request, owned or borrowed by the caller who waits for it.
enum Request<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8], bool),
    Flush,
    Trim(u32, bool),
    Zero(u32, ZeroFlags),
    Status(u32, &'a mut Vec<(u32, u32)>),
}

impl Request<'_> {
    fn op(&self) -> Op {
        match self {
            Request::Read(_) => Op::Read,
            Request::Write(..) => Op::Write,
            Request::Flush => Op::Flush,
            Request::Trim(..) => Op::Trim,
            Request::Zero(..) => Op::Zero,
            Request::Status(..) => Op::BlockStatus,
        }
    }

    fn len(&self) -> u64 {
        match self {
            Request::Read(b) => b.len() as u64,
            Request::Write(b, _) => b.len() as u64,
            Request::Flush => 0,
            Request::Trim(l, _) | Request::Zero(l, _) | Request::Status(l, _) => u64::from(*l),
        }
    }

    /// What the journal keeps of this request once answered: writes, trims and zeroes
    /// (not those with FUA: answered, they are durable already).
    fn change(&self) -> Option<Change> {
        match self {
            Request::Write(data, false) => Some(Change::Write(Arc::from(&**data))),
            Request::Trim(len, false) => Some(Change::Trim(*len)),
            Request::Zero(len, f) if !f.fua => Some(Change::Zero(*len, *f)),
            _ => None,
        }
    }

    /// Payload bytes this request keeps in flight.
    fn payload(&self) -> u64 {
        match self {
            Request::Read(b) => b.len() as u64,
            Request::Write(b, _) => b.len() as u64,
            _ => 0,
        }
    }

    async fn send(&mut self, client: &Client, offset: u64) -> std::result::Result<(), ClientError> {
        match self {
            Request::Read(buf) => client.read_into(offset, buf).await,
            Request::Write(data, fua) => client.write(offset, data, *fua).await,
            Request::Flush => client.flush().await,
            Request::Trim(len, fua) => client.trim(offset, *len, *fua).await,
            Request::Zero(len, f) => {
                let fua = f.fua && client.can_fua();
                client
                    .write_zeroes(offset, *len, !f.may_trim, f.fast_only, fua)
                    .await
            }
            Request::Status(len, out) => {
                out.clear();
                if client.can_block_status() {
                    **out = client.block_status(offset, *len, false).await?;
                }
                Ok(())
            }
        }
    }
}

impl Drop for RemoteBase {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

impl RemoteBase {
    /// Connects to the first endpoint that answers (trying them in order, then again with
    /// backoff, up to `opts.retry_for`) and takes its export as this target's vDisk.
    pub fn connect(
        endpoints: Vec<Endpoint>,
        opts: RemoteOptions,
    ) -> std::result::Result<RemoteBase, AgentError> {
        RemoteBase::connect_with(endpoints, opts, None)
    }

    /// [`RemoteBase::connect`], with reconnects asking `reorder` for the order of the
    /// endpoints (a new placement after a failover).
    pub fn connect_with(
        endpoints: Vec<Endpoint>,
        opts: RemoteOptions,
        reorder: Option<Arc<dyn Reorder>>,
    ) -> std::result::Result<RemoteBase, AgentError> {
        if endpoints.is_empty() {
            return Err(AgentError::NoEndpoint);
        }
        let handle = runtime()?;
        let link = Arc::new(Link::new(endpoints, opts).with_reorder(reorder));
        let (client, _) = run(&handle, link.client(None))
            .map_err(|e| AgentError::NoServer { message: e.message })?;
        let writable = link.opts.writable;
        let read_only = !writable || client.read_only();
        let caps = Caps {
            read_only,
            flush: !read_only && client.can_flush(),
            fua: !read_only && client.can_fua(),
            trim: !read_only && client.can_trim(),
            zeroes: !read_only && client.can_zeroes(),
            fast_zero: !read_only && client.can_fast_zero(),
            cache: false,
            block_status: client.can_block_status(),
            // Every connection to this device shares the link's one set of server
            // connections (at a time, all to one server), so a flush covers every write any
            // of them completed: with one connection whatever the server offers, with
            // several because each extra one was checked to offer multi-conn.
            multi_conn: true,
            may_block: true,
            preferred_block: client.block_sizes().preferred.max(512),
        };
        let bs = client.block_sizes();
        let min_block = u64::from(bs.minimum.max(1));
        let max_block = (u64::from(bs.maximum) / min_block * min_block).max(min_block);
        let size = client.size();
        let watched = Arc::downgrade(&link);
        let watcher = handle
            .spawn(async move {
                let mut tick = tokio::time::interval(WATCH);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    let Some(link) = watched.upgrade() else {
                        return;
                    };
                    if let Some(g) = link.closed_generation() {
                        // A failure is the requests' to see (and to wait out).
                        let _ = link.client(Some(g)).await;
                    }
                }
            })
            .abort_handle();
        Ok(RemoteBase {
            link,
            handle,
            watcher,
            caps,
            size,
            min_block,
            max_block,
        })
    }

    /// The server's minimum block: requests not aligned to it cost a read-modify-write.
    pub fn min_block(&self) -> u64 {
        self.min_block
    }

    /// What the target attached to (export, size, description).
    pub fn identity(&self) -> Identity {
        self.link.identity().expect("set at connect")
    }

    /// The endpoint in use (or last used) and whether it is connected now.
    pub fn endpoint_in_use(&self) -> (String, bool) {
        let (ep, live) = self.link.endpoint_in_use();
        (ep.uri.clone(), live)
    }

    /// The attach this target holds on its store server, with its secret (`server` types).
    pub fn attach(&self) -> Option<JoinAttach> {
        self.link.attach()
    }

    /// The index in [`RemoteBase::endpoints`] of the endpoint in use (or last used).
    pub fn endpoint_index(&self) -> usize {
        self.link.index_in_use()
    }

    /// Every endpoint, in the order tried.
    pub fn endpoints(&self) -> Vec<String> {
        self.link
            .endpoints()
            .iter()
            .map(|e| e.uri.clone())
            .collect()
    }

    /// The journal's figures (server-persistent), if the link keeps one.
    pub fn journal_status(&self) -> Option<crate::status::JournalStatus> {
        let j = self.link.journal.as_deref()?;
        let (changes, bytes) = j.size();
        Some(crate::status::JournalStatus {
            changes: changes as u64,
            bytes,
            replayed: j.replayed.load(Relaxed),
            replay_errors: j.replay_errors.load(Relaxed),
        })
    }

    /// Why the target's attach is lost for good (its server lost the cache), once it is:
    /// every request then fails with EIO.
    pub fn lost(&self) -> Option<String> {
        self.link.lost()
    }

    /// The counters (requests, retries, reconnects, failovers).
    pub fn counters(&self) -> &LinkCounters {
        &self.link.counters
    }

    /// Runs one request (inside `size()`, aligned to the server's minimum block, at most
    /// its maximum) until it gets an answer, reconnecting as often as needed.
    async fn call(&self, offset: u64, mut req: Request<'_>) -> Result<()> {
        let link = &self.link;
        let (op, len) = (req.op(), req.len());
        let _slot = link
            .requests
            .acquire()
            .await
            .map_err(|_| self.shut(op, offset, len))?;
        let bytes = req.payload().clamp(
            1,
            link.opts.max_bytes.clamp(1 << 20, u32::MAX as usize) as u64,
        ) as u32;
        let _bytes = link
            .bytes
            .acquire_many(bytes)
            .await
            .map_err(|_| self.shut(op, offset, len))?;
        let journal = link.journal.as_deref();
        // A flush covers what was answered before it is sent (the first time).
        let mark = journal
            .filter(|_| matches!(req, Request::Flush))
            .map(|j| j.mark());
        let mut failed = None;
        loop {
            let (client, generation) = link.client(failed).await.map_err(|g| {
                Error::new(ErrorKind::Io, op, offset, len, self.describe(), g.message)
            })?;
            match req.send(&client, offset).await {
                Ok(()) => {
                    if let Some(j) = journal {
                        if let Some(change) = req.change() {
                            if j.record(generation, offset, change) == Recorded::Missed {
                                // Answered by a connection already replaced and replayed
                                // without it: the new server must get it too.
                                log::debug!("{op} at {offset} length {len}: answered on a replaced connection; sending it again");
                                failed = None;
                                continue;
                            }
                        }
                        if let Some(m) = mark {
                            j.flushed(m);
                        }
                    }
                    return Ok(());
                }
                Err(e) if is_retryable(&e) => {
                    link.counters.retries.fetch_add(1, Relaxed);
                    log::debug!("{op} at {offset} length {len}: {e}; sending it again");
                    if e.errno().is_some() {
                        link.broken(generation, e.to_string());
                    }
                    failed = Some(generation);
                }
                Err(e) => return Err(self.error(op, offset, len, &e)),
            }
        }
    }

    fn shut(&self, op: Op, offset: u64, len: u64) -> Error {
        Error::new(
            ErrorKind::Shutdown,
            op,
            offset,
            len,
            self.describe(),
            "the remote base is closing",
        )
    }

    fn error(&self, op: Op, offset: u64, len: u64, e: &ClientError) -> Error {
        let kind = match e.errno() {
            Some(proto::EPERM) => ErrorKind::ReadOnly,
            Some(proto::ENOSPC) => ErrorKind::NoSpace,
            Some(proto::EINVAL) | Some(proto::EOVERFLOW) => ErrorKind::Invalid,
            Some(proto::ENOTSUP) => ErrorKind::NotSupported,
            Some(_) => ErrorKind::Io,
            None => match e {
                ClientError::Invalid { .. } => ErrorKind::Invalid,
                _ => ErrorKind::Io,
            },
        };
        Error::new(kind, op, offset, len, self.describe(), e.to_string())
    }

    fn check(&self, op: Op, offset: u64, len: u64) -> Result<()> {
        vdstream_blockdev::check_range(self.size, op, offset, len, &|| self.describe())?;
        if op != Op::Read && op != Op::BlockStatus && self.caps.read_only {
            return Err(Error::new(
                ErrorKind::ReadOnly,
                op,
                offset,
                len,
                self.describe(),
                "the vDisk is read-only to targets",
            ));
        }
        Ok(())
    }

    fn aligned(&self, offset: u64, len: u64) -> bool {
        (offset | len) % self.min_block == 0
    }

    /// Reads an aligned range in chunks of at most the server's maximum.
    async fn read_aligned(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let mut done = 0usize;
        while done < buf.len() {
            let n = (buf.len() - done).min(self.max_block as usize);
            self.call(
                offset + done as u64,
                Request::Read(&mut buf[done..done + n]),
            )
            .await?;
            done += n;
        }
        self.link.counters.read_ops.fetch_add(1, Relaxed);
        self.link
            .counters
            .read_bytes
            .fetch_add(buf.len() as u64, Relaxed);
        Ok(())
    }

    /// `read_at`, on the base's runtime.
    async fn read_async(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        self.check(Op::Read, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        if self.aligned(offset, len) {
            return self.read_aligned(buf, offset).await;
        }
        let (start, wide) = self.widen(offset, len);
        let mut bounce = vec![0u8; wide as usize];
        self.read_aligned(&mut bounce, start).await?;
        let skip = (offset - start) as usize;
        buf.copy_from_slice(&bounce[skip..skip + buf.len()]);
        Ok(())
    }

    /// `write_at`, on the base's runtime.
    async fn write_async(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let len = buf.len() as u64;
        self.check(Op::Write, offset, len)?;
        if !self.aligned(offset, len) {
            return Err(Error::new(
                ErrorKind::Invalid,
                Op::Write,
                offset,
                len,
                self.describe(),
                format!(
                    "not aligned to the server's minimum block of {} bytes",
                    self.min_block
                ),
            ));
        }
        let fua = fua && self.caps.fua;
        let mut done = 0usize;
        while done < buf.len() {
            let n = (buf.len() - done).min(self.max_block as usize);
            self.call(
                offset + done as u64,
                Request::Write(&buf[done..done + n], fua),
            )
            .await?;
            done += n;
        }
        self.link.counters.write_ops.fetch_add(1, Relaxed);
        self.link.counters.write_bytes.fetch_add(len, Relaxed);
        self.keep_journal_small().await;
        Ok(())
    }

    /// Past the journal's cap, one caller flushes the server (which empties the journal of
    /// everything answered before); the others go on.
    async fn keep_journal_small(&self) {
        let Some(j) = self.link.journal.as_deref() else {
            return;
        };
        if !j.over_cap() {
            return;
        }
        if !self.caps.flush {
            // A server without flush offers no more durability than its answers: there is
            // nothing to wait for, so the journal only keeps its last `cap` bytes' worth.
            j.flushed(j.mark());
            return;
        }
        if j.flushing.swap(true, Relaxed) {
            return;
        }
        let r = self.call(0, Request::Flush).await;
        j.flushing.store(false, Relaxed);
        if let Err(e) = r {
            log::warn!(
                "target {}: a flush to empty the journal failed: {e}",
                self.link.opts.target
            );
        }
    }

    /// The aligned range covering `[offset, offset+len)`, clipped to the device.
    fn widen(&self, offset: u64, len: u64) -> (u64, u64) {
        let start = offset / self.min_block * self.min_block;
        let end = (offset + len).div_ceil(self.min_block) * self.min_block;
        (start, end.min(self.size) - start)
    }

    /// Runs a ranged operation (trim, zero) in pieces the wire can carry.
    fn ranged(
        &self,
        op: Op,
        offset: u64,
        len: u64,
        make: impl Fn(u32) -> Request<'static>,
    ) -> Result<()> {
        self.check(op, offset, len)?;
        if !self.aligned(offset, len) {
            return Err(Error::new(
                ErrorKind::Invalid,
                op,
                offset,
                len,
                self.describe(),
                format!(
                    "not aligned to the server's minimum block of {} bytes",
                    self.min_block
                ),
            ));
        }
        run(&self.handle, async {
            let mut done = 0;
            while done < len {
                let n = (len - done).min(MAX_RANGE_OP);
                self.call(offset + done, make(n as u32)).await?;
                done += n;
            }
            self.link.counters.other_ops.fetch_add(1, Relaxed);
            self.keep_journal_small().await;
            Ok(())
        })
    }
}

/// The agent process's one tokio runtime, started on first use and never stopped: every
/// remote base's connections and the agent's local NBD server run on it.
pub fn runtime() -> std::result::Result<tokio::runtime::Handle, AgentError> {
    static SHARED: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    if let Some(rt) = SHARED.get() {
        return Ok(rt.handle().clone());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .thread_name("vdstream-io")
        .enable_all()
        .build()
        .map_err(|err| AgentError::Io {
            what: "cannot start the I/O runtime".into(),
            err,
        })?;
    // A racing first caller's runtime is the one kept; dropping ours may not block here.
    if let Err(rt) = SHARED.set(rt) {
        rt.shutdown_background();
    }
    Ok(SHARED.get().expect("set above").handle().clone())
}

/// Runs `fut` to completion from sync code on `handle`'s runtime.
fn run<F: Future>(handle: &tokio::runtime::Handle, fut: F) -> F::Output {
    match tokio::runtime::Handle::try_current() {
        // Inside some multi-thread runtime (a caller's async code): give the worker up first.
        Ok(_) => tokio::task::block_in_place(|| handle.block_on(fut)),
        Err(_) => handle.block_on(fut),
    }
}

impl BlockDev for RemoteBase {
    fn size(&self) -> u64 {
        self.size
    }

    fn caps(&self) -> Caps {
        self.caps
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        run(&self.handle, self.read_async(buf, offset))
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        run(&self.handle, self.write_async(buf, offset, fua))
    }

    fn flush(&self) -> Result<()> {
        if !self.caps.flush {
            return Ok(());
        }
        run(&self.handle, self.call(0, Request::Flush))
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        if !self.caps.trim {
            self.check(Op::Trim, offset, len)?;
            return Ok(()); // trim is advisory; a server without it keeps the bytes
        }
        let fua = fua && self.caps.fua;
        self.ranged(Op::Trim, offset, len, |n| Request::Trim(n, fua))
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        if !self.caps.zeroes {
            self.check(Op::Zero, offset, len)?;
            return Err(Error::new(
                ErrorKind::NotSupported,
                Op::Zero,
                offset,
                len,
                self.describe(),
                "the server does not offer write-zeroes",
            ));
        }
        self.ranged(Op::Zero, offset, len, |n| Request::Zero(n, flags))
    }

    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        self.check(Op::BlockStatus, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let all_data = Extent {
            len,
            hole: false,
            zero: false,
        };
        if !self.caps.block_status || !self.aligned(offset, len) {
            out.push(all_data);
            return Ok(());
        }
        let ask = len.min(MAX_RANGE_OP);
        let mut raw = Vec::new();
        run(
            &self.handle,
            self.call(offset, Request::Status(ask as u32, &mut raw)),
        )?;
        let before = out.len();
        let mut covered = 0u64;
        for (l, flags) in raw {
            if covered >= ask || l == 0 {
                break;
            }
            let l = u64::from(l).min(ask - covered);
            let hole = flags & proto::STATE_HOLE != 0;
            let zero = hole || flags & proto::STATE_ZERO != 0;
            out.push(Extent { len: l, hole, zero });
            covered += l;
        }
        if out.len() == before {
            out.push(all_data); // a server that answered nothing usable: say "data"
        }
        Ok(())
    }

    /// Every read and write of the batch is in flight at once on the connection (each one
    /// reconnecting and re-sent on its own as `read_at` and `write_at` would be).
    fn io_batch(&self, ops: &mut [BatchOp<'_>]) {
        let futs: Vec<_> = ops
            .iter_mut()
            .map(|op| {
                let offset = op.offset;
                async move {
                    match &mut op.io {
                        BatchIo::Read(buf) => self.read_async(buf, offset).await,
                        BatchIo::Write(buf, fua) => self.write_async(buf, offset, *fua).await,
                    }
                }
            })
            .collect();
        // Corked: the batch's requests go out in one write from this thread.
        let results = run(
            &self.handle,
            vdstream_nbd::client::corked(futures_util::future::join_all(futs)),
        );
        for (op, r) in ops.iter_mut().zip(results) {
            op.result = r;
        }
    }

    /// A batch goes out on the connection at once and costs one wait for all its replies,
    /// where one request per thread costs a hand-off to this base's runtime and back each
    /// (the `server` types: the agent's local export forwards every request here).
    fn prefers_batches(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        let id = self.link.identity();
        let export = id.map(|i| i.export).unwrap_or_default();
        let (ep, _) = self.link.endpoint_in_use();
        format!(
            "vDisk export {export:?} of target {} via {ep}",
            self.link.opts.target
        )
    }
}
