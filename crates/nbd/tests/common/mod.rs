//! A tiny raw-protocol NBD client for the server tests, plus test devices and a server
//! harness on a unix socket in a temp dir. It speaks bytes, not the real client's API,
//! so tests can send anything, including what a good client never would.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use vdstream_blockdev::{BlockDev, Caps, Extent, Hole, MemoryDev, Result as DevResult, ZeroFlags};
use vdstream_nbd::proto::*;
use vdstream_nbd::wire::RequestHeader;
use vdstream_nbd::{
    ExportInfo, Exports, Listener, OpenError, Server, ServerConfig, ShutdownSignal, ShutdownTrigger,
};

pub const DISK: u64 = 1 << 20;

/// Exports: "disk" (writable memory), "ro" (read-only view that offers no flush, FUA or
/// cache), "slow" (may_block, variable sleeps), "" (= "disk").
pub struct TestExports {
    pub disk: Arc<MemoryDev>,
    pub slow: Arc<SlowDev>,
    pub batched: Arc<BatchDev>,
}

impl Exports for TestExports {
    fn list(&self) -> Vec<ExportInfo> {
        vec![
            ExportInfo {
                name: "disk".into(),
                description: "a test disk".into(),
            },
            ExportInfo {
                name: "ro".into(),
                description: String::new(),
            },
        ]
    }
    fn open(&self, name: &str) -> Result<Arc<dyn BlockDev>, OpenError> {
        match name {
            "" | "disk" => Ok(self.disk.clone()),
            "ro" => Ok(Arc::new(ReadOnly(self.disk.clone()))),
            "slow" => Ok(self.slow.clone()),
            "batched" => Ok(self.batched.clone()),
            "panics" => Ok(Arc::new(PanicOnWrite(MemoryDev::new(DISK)))),
            "busy" => Err(OpenError::Busy(
                "version v3 is in maintenance by another target".into(),
            )),
            _ => Err(OpenError::Unknown(format!("no export named {name:?}"))),
        }
    }
}

/// A read-only view of a device.
#[derive(Debug)]
pub struct ReadOnly(pub Arc<MemoryDev>);
impl BlockDev for ReadOnly {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn caps(&self) -> Caps {
        Caps {
            read_only: true,
            flush: false,
            fua: false,
            cache: false,
            ..self.0.caps()
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> DevResult<()> {
        self.0.read_at(buf, offset)
    }
    fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> DevResult<()> {
        self.0.read_at_sparse(buf, offset, holes)
    }
    fn write_at(&self, _: &[u8], _: u64, _: bool) -> DevResult<()> {
        panic!("write reached a read-only device")
    }
    fn trim(&self, _: u64, _: u64, _: bool) -> DevResult<()> {
        panic!("trim reached a read-only device")
    }
    fn write_zeroes(&self, _: u64, _: u64, _: ZeroFlags) -> DevResult<()> {
        panic!("zero reached a read-only device")
    }
    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> DevResult<()> {
        self.0.block_status(offset, len, out)
    }
    fn describe(&self) -> String {
        "read-only memory".into()
    }
}

/// A may_block device that sleeps a per-offset time before each operation, so replies
/// come back out of order. Records the peak number of concurrent operations.
#[derive(Debug)]
pub struct SlowDev {
    pub inner: MemoryDev,
    pub active: AtomicUsize,
    pub peak: AtomicUsize,
    /// Data bytes of the reads and writes running now, and the most there ever were.
    pub bytes: AtomicUsize,
    pub peak_bytes: AtomicUsize,
    pub log: Mutex<Vec<u64>>,
}

impl SlowDev {
    pub fn new() -> SlowDev {
        SlowDev {
            inner: MemoryDev::new(DISK),
            active: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            peak_bytes: AtomicUsize::new(0),
            log: Mutex::new(Vec::new()),
        }
    }
    fn slow<T>(&self, offset: u64, len: usize, f: impl FnOnce() -> T) -> T {
        let now = self.active.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
        let bytes = self.bytes.fetch_add(len, Ordering::SeqCst) + len;
        self.peak_bytes.fetch_max(bytes, Ordering::SeqCst);
        // Later offsets finish sooner: 0..=70 ms, decreasing with offset.
        let ms = 70u64.saturating_sub((offset / 4096) % 8 * 10);
        std::thread::sleep(Duration::from_millis(ms));
        let r = f();
        self.log.lock().unwrap().push(offset);
        self.bytes.fetch_sub(len, Ordering::SeqCst);
        self.active.fetch_sub(1, Ordering::SeqCst);
        r
    }
}

impl BlockDev for SlowDev {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn caps(&self) -> Caps {
        Caps {
            may_block: true,
            ..self.inner.caps()
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> DevResult<()> {
        self.slow(offset, buf.len(), || self.inner.read_at(buf, offset))
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> DevResult<()> {
        self.slow(offset, buf.len(), || self.inner.write_at(buf, offset, fua))
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> DevResult<()> {
        self.inner.trim(offset, len, fua)
    }
    fn write_zeroes(&self, offset: u64, len: u64, f: ZeroFlags) -> DevResult<()> {
        self.inner.write_zeroes(offset, len, f)
    }
    fn describe(&self) -> String {
        "slow memory".into()
    }
}

/// A memory device that prefers batches: each `io_batch` call sleeps 5 ms (so requests pile
/// up behind it) and records its size (requests), its data bytes, and the most calls and
/// data bytes in it at once. It knows its holes.
#[derive(Debug)]
pub struct BatchDev {
    pub inner: MemoryDev,
    pub batches: Mutex<Vec<usize>>,
    pub batch_bytes: Mutex<Vec<usize>>,
    pub in_batch: AtomicUsize,
    pub peak: AtomicUsize,
    pub bytes: AtomicUsize,
    pub peak_bytes: AtomicUsize,
}

impl BatchDev {
    pub fn new() -> BatchDev {
        BatchDev {
            inner: MemoryDev::new(DISK),
            batches: Mutex::new(Vec::new()),
            batch_bytes: Mutex::new(Vec::new()),
            in_batch: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            peak_bytes: AtomicUsize::new(0),
        }
    }
}

impl BlockDev for BatchDev {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn caps(&self) -> Caps {
        Caps {
            may_block: true,
            ..self.inner.caps()
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> DevResult<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> DevResult<()> {
        self.inner.write_at(buf, offset, fua)
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> DevResult<()> {
        self.inner.trim(offset, len, fua)
    }
    fn write_zeroes(&self, offset: u64, len: u64, f: ZeroFlags) -> DevResult<()> {
        self.inner.write_zeroes(offset, len, f)
    }
    fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> DevResult<()> {
        self.inner.read_at_sparse(buf, offset, holes)
    }
    fn describe(&self) -> String {
        "batched memory".into()
    }
    fn io_batch(&self, ops: &mut [vdstream_blockdev::BatchOp<'_>]) {
        self.batches.lock().unwrap().push(ops.len());
        self.batch_bytes
            .lock()
            .unwrap()
            .push(ops.iter().map(|op| op.len()).sum());
        let now = self.in_batch.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
        let bytes: usize = ops.iter().map(|op| op.len()).sum();
        let now = self.bytes.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.peak_bytes.fetch_max(now, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(5));
        for op in ops {
            op.run_alone(&self.inner);
        }
        self.bytes.fetch_sub(bytes, Ordering::SeqCst);
        self.in_batch.fetch_sub(1, Ordering::SeqCst);
    }
    fn prefers_batches(&self) -> bool {
        true
    }
}

/// A device that prefers batches and panics on every write (a bug in a device), reads fine.
#[derive(Debug)]
pub struct PanicOnWrite(pub MemoryDev);

impl BlockDev for PanicOnWrite {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn caps(&self) -> Caps {
        Caps {
            may_block: true,
            ..self.0.caps()
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> DevResult<()> {
        self.0.read_at(buf, offset)
    }
    fn write_at(&self, _: &[u8], _: u64, _: bool) -> DevResult<()> {
        panic!("a bug in the device's write path")
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> DevResult<()> {
        self.0.trim(offset, len, fua)
    }
    fn write_zeroes(&self, offset: u64, len: u64, f: ZeroFlags) -> DevResult<()> {
        self.0.write_zeroes(offset, len, f)
    }
    fn describe(&self) -> String {
        "panicking memory".into()
    }
    fn prefers_batches(&self) -> bool {
        true
    }
}

/// A running server on a unix socket in a temp dir.
pub struct Harness {
    pub dir: tempfile::TempDir,
    pub path: std::path::PathBuf,
    pub exports: Arc<TestExports>,
    pub trigger: ShutdownTrigger,
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
    pub stats: Arc<vdstream_nbd::ServerStats>,
}

pub fn start() -> Harness {
    start_with(ServerConfig::default())
}

/// The test exports, each device new.
pub fn test_exports() -> Arc<TestExports> {
    Arc::new(TestExports {
        disk: Arc::new(MemoryDev::new(DISK)),
        slow: Arc::new(SlowDev::new()),
        batched: Arc::new(BatchDev::new()),
    })
}

pub fn start_with(config: ServerConfig) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let exports = test_exports();
    let server = Server::new(exports.clone(), config);
    let stats = server.stats();
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let (trigger, signal) = ShutdownSignal::new();
    let task = tokio::spawn(async move { server.serve(Listener::Unix(listener), signal).await });
    Harness {
        dir,
        path,
        exports,
        trigger,
        task,
        stats,
    }
}

/// One option reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptReply {
    pub option: u32,
    pub kind: u32,
    pub data: Vec<u8>,
}

/// One transmission reply (simple or one structured chunk).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Simple {
        handle: u64,
        error: u32,
        data: Vec<u8>,
    },
    Chunk {
        handle: u64,
        flags: u16,
        kind: u16,
        payload: Vec<u8>,
    },
}

impl Reply {
    pub fn handle(&self) -> u64 {
        match self {
            Reply::Simple { handle, .. } | Reply::Chunk { handle, .. } => *handle,
        }
    }
    /// The errno of a simple reply or an error chunk (0 otherwise).
    pub fn error(&self) -> u32 {
        match self {
            Reply::Simple { error, .. } => *error,
            Reply::Chunk { kind, payload, .. } if kind & 0x8000 != 0 => {
                u32::from_be_bytes(payload[0..4].try_into().unwrap())
            }
            _ => 0,
        }
    }
}

pub struct RawClient {
    pub s: UnixStream,
}

const T: Duration = Duration::from_secs(10);

impl RawClient {
    pub async fn connect(path: &std::path::Path) -> RawClient {
        RawClient {
            s: UnixStream::connect(path).await.unwrap(),
        }
    }

    /// Reads the greeting and sends client flags.
    pub async fn greet(&mut self, client_flags: u32) {
        let mut g = [0u8; 18];
        self.read_exact(&mut g).await;
        assert_eq!(&g[0..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(
            u16::from_be_bytes([g[16], g[17]]),
            FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES
        );
        self.s.write_all(&client_flags.to_be_bytes()).await.unwrap();
    }

    pub async fn read_exact(&mut self, buf: &mut [u8]) {
        tokio::time::timeout(T, self.s.read_exact(buf))
            .await
            .expect("server reply timed out")
            .expect("server closed");
    }

    /// Whether the server closed the connection (EOF or reset) within the timeout.
    pub async fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        loop {
            match tokio::time::timeout(T, self.s.read(&mut b)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue,
                Err(_) => return false,
            }
        }
    }

    /// After an option was sent: true if the server closed the connection instead of
    /// answering it, false once one reply arrived.
    pub async fn closed_or_acked(&mut self) -> bool {
        let mut head = [0u8; 20];
        if self.s.read_exact(&mut head).await.is_err() {
            return true;
        }
        let len = u32::from_be_bytes(head[16..20].try_into().unwrap()) as usize;
        let mut rest = vec![0u8; len];
        self.s.read_exact(&mut rest).await.is_err()
    }

    pub async fn send_option(&mut self, option: u32, data: &[u8]) {
        let mut m = IHAVEOPT.to_be_bytes().to_vec();
        m.extend_from_slice(&option.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        self.s.write_all(&m).await.unwrap();
    }

    pub async fn opt_reply(&mut self) -> OptReply {
        let mut h = [0u8; 20];
        self.read_exact(&mut h).await;
        assert_eq!(
            u64::from_be_bytes(h[0..8].try_into().unwrap()),
            REPLY_MAGIC_OPT
        );
        let option = u32::from_be_bytes(h[8..12].try_into().unwrap());
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut data = vec![0; len as usize];
        self.read_exact(&mut data).await;
        OptReply { option, kind, data }
    }

    /// Sends an option and collects replies up to the final one (ACK or an error).
    pub async fn option(&mut self, option: u32, data: &[u8]) -> Vec<OptReply> {
        self.send_option(option, data).await;
        let mut v = Vec::new();
        loop {
            let r = self.opt_reply().await;
            assert_eq!(r.option, option);
            let last = r.kind == REP_ACK || r.kind & REP_FLAG_ERROR != 0;
            v.push(r);
            if last {
                return v;
            }
        }
    }

    pub async fn structured(&mut self) {
        let r = self.option(OPT_STRUCTURED_REPLY, &[]).await;
        assert_eq!(r[0].kind, REP_ACK);
    }

    pub async fn set_meta(&mut self, export: &str, queries: &[&str]) -> Vec<OptReply> {
        self.option(OPT_SET_META_CONTEXT, &meta_data(export, queries))
            .await
    }

    /// NBD_OPT_GO; returns (size, transmission flags).
    pub async fn go(&mut self, name: &str) -> (u64, u16) {
        let replies = self
            .option(OPT_GO, &info_data(name, &[INFO_BLOCK_SIZE]))
            .await;
        assert_eq!(
            replies.last().unwrap().kind,
            REP_ACK,
            "GO failed: {replies:?}"
        );
        export_info(&replies)
    }

    /// Greet, optionally structured (+ base:allocation), GO on `name`.
    pub async fn open(
        path: &std::path::Path,
        name: &str,
        structured: bool,
    ) -> (RawClient, u64, u16) {
        let mut c = RawClient::connect(path).await;
        c.greet(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).await;
        if structured {
            c.structured().await;
            c.set_meta(name, &["base:allocation"]).await;
        }
        let (size, flags) = c.go(name).await;
        (c, size, flags)
    }

    pub async fn send(
        &mut self,
        command: u16,
        flags: u16,
        handle: u64,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) {
        let h = RequestHeader {
            magic: REQUEST_MAGIC,
            flags,
            command,
            handle,
            offset,
            length,
        };
        let mut m = h.encode().to_vec();
        m.extend_from_slice(payload);
        self.s.write_all(&m).await.unwrap();
    }

    /// Reads one reply; a simple reply to a READ carries `read_len` data bytes when OK.
    pub async fn reply(&mut self, read_len: usize) -> Reply {
        let mut magic = [0u8; 4];
        self.read_exact(&mut magic).await;
        match u32::from_be_bytes(magic) {
            SIMPLE_REPLY_MAGIC => {
                let mut h = [0u8; 12];
                self.read_exact(&mut h).await;
                let error = u32::from_be_bytes(h[0..4].try_into().unwrap());
                let handle = u64::from_be_bytes(h[4..12].try_into().unwrap());
                let mut data = vec![0; if error == 0 { read_len } else { 0 }];
                self.read_exact(&mut data).await;
                Reply::Simple {
                    handle,
                    error,
                    data,
                }
            }
            STRUCTURED_REPLY_MAGIC => {
                let mut h = [0u8; 16];
                self.read_exact(&mut h).await;
                let flags = u16::from_be_bytes(h[0..2].try_into().unwrap());
                let kind = u16::from_be_bytes(h[2..4].try_into().unwrap());
                let handle = u64::from_be_bytes(h[4..12].try_into().unwrap());
                let len = u32::from_be_bytes(h[12..16].try_into().unwrap());
                let mut payload = vec![0; len as usize];
                self.read_exact(&mut payload).await;
                Reply::Chunk {
                    handle,
                    flags,
                    kind,
                    payload,
                }
            }
            m => panic!("bad reply magic {m:#x}"),
        }
    }

    /// Reads structured chunks up to the one with DONE.
    pub async fn chunks(&mut self) -> Vec<Reply> {
        let mut v = Vec::new();
        loop {
            let r = self.reply(0).await;
            let done = match &r {
                Reply::Chunk { flags, .. } => flags & REPLY_FLAG_DONE != 0,
                Reply::Simple { .. } => true,
            };
            v.push(r);
            if done {
                return v;
            }
        }
    }

    /// Simple-reply request round trip: the errno.
    pub async fn call(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> u32 {
        self.send(command, flags, 77, offset, length, payload).await;
        let r = self
            .reply(if command == CMD_READ {
                length as usize
            } else {
                0
            })
            .await;
        assert_eq!(r.handle(), 77);
        r.error()
    }

    /// Simple-reply read: the data.
    pub async fn read(&mut self, offset: u64, length: u32) -> Vec<u8> {
        self.send(CMD_READ, 0, 5, offset, length, &[]).await;
        match self.reply(length as usize).await {
            Reply::Simple { error: 0, data, .. } => data,
            r => panic!("read failed: {r:?}"),
        }
    }
}

pub fn info_data(name: &str, types: &[u16]) -> Vec<u8> {
    let mut v = (name.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(name.as_bytes());
    v.extend_from_slice(&(types.len() as u16).to_be_bytes());
    for t in types {
        v.extend_from_slice(&t.to_be_bytes());
    }
    v
}

pub fn meta_data(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut v = (export.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(export.as_bytes());
    v.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        v.extend_from_slice(&(q.len() as u32).to_be_bytes());
        v.extend_from_slice(q.as_bytes());
    }
    v
}

/// (size, flags) from the NBD_INFO_EXPORT reply among `replies`.
pub fn export_info(replies: &[OptReply]) -> (u64, u16) {
    let info = replies
        .iter()
        .find(|r| r.kind == REP_INFO && r.data[0..2] == INFO_EXPORT.to_be_bytes())
        .expect("no NBD_INFO_EXPORT");
    assert_eq!(info.data.len(), 12);
    (
        u64::from_be_bytes(info.data[2..10].try_into().unwrap()),
        u16::from_be_bytes(info.data[10..12].try_into().unwrap()),
    )
}
