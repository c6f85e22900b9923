#![allow(dead_code)]
//! Shared fuzz harness: memory exports (one per executor of the request core) and a
//! runtime, and a function that feeds a byte stream to a whole server connection over a
//! real unix socket pair, served exactly as an accepted connection is (handshake on tokio,
//! then the blocking request core), while draining the server's replies. Invariants
//! checked: the server never panics, always finishes, and leaves no thread of the
//! connection running once it has (LeakSanitizer reports the memory of one that has not
//! yet exited, as fuzz/regressions/fuzz_requests/leak-* once showed).

use std::sync::{Arc, OnceLock};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vdstream_blockdev::{BlockDev, Caps, Hole, MemoryDev, Result as DevResult, ZeroFlags};
use vdstream_nbd::{ExportInfo, Exports, OpenError, Server, ServerConfig, ShutdownSignal};

/// A MemoryDev that claims may_block, to drive the worker pool (or, with `.1`, prefers
/// batches, to drive the batched executor).
#[derive(Debug)]
pub struct Blocking(pub MemoryDev, pub bool);
impl BlockDev for Blocking {
    fn size(&self) -> u64 { self.0.size() }
    fn caps(&self) -> Caps { Caps { may_block: true, flush: true, fua: true, cache: true, ..self.0.caps() } }
    fn read_at(&self, b: &mut [u8], o: u64) -> DevResult<()> { self.0.read_at(b, o) }
    fn read_at_sparse(&self, b: &mut [u8], o: u64, h: &mut Vec<Hole>) -> DevResult<()> { self.0.read_at_sparse(b, o, h) }
    fn write_at(&self, b: &[u8], o: u64, f: bool) -> DevResult<()> { self.0.write_at(b, o, f) }
    fn trim(&self, o: u64, l: u64, f: bool) -> DevResult<()> { self.0.trim(o, l, f) }
    fn write_zeroes(&self, o: u64, l: u64, f: ZeroFlags) -> DevResult<()> { self.0.write_zeroes(o, l, f) }
    fn describe(&self) -> String { "fuzz blocking memory".into() }
    fn prefers_batches(&self) -> bool { self.1 }
}

pub struct FuzzExports {
    inline: Arc<MemoryDev>,
    blocking: Arc<Blocking>,
    batched: Arc<Blocking>,
}

impl Exports for FuzzExports {
    fn list(&self) -> Vec<ExportInfo> {
        vec![ExportInfo { name: "a".into(), description: "inline".into() }, ExportInfo { name: "b".into(), description: String::new() }]
    }
    fn open(&self, name: &str) -> Result<Arc<dyn BlockDev>, OpenError> {
        match name {
            "" | "a" => Ok(self.inline.clone()),
            "b" => Ok(self.blocking.clone()),
            "c" => Ok(self.batched.clone()),
            _ => Err(OpenError::Unknown(name.to_string())),
        }
    }
}

pub struct Harness {
    pub rt: tokio::runtime::Runtime,
    pub server: Server,
}

pub fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let exports = Arc::new(FuzzExports {
            inline: Arc::new(MemoryDev::new(1 << 20)),
            blocking: Arc::new(Blocking(MemoryDev::new(1 << 20), false)),
            batched: Arc::new(Blocking(MemoryDev::new(1 << 20), true)),
        });
        let config = ServerConfig { handshake_timeout: std::time::Duration::from_secs(5), ..Default::default() };
        Harness { rt, server: Server::new(exports, config) }
    })
}

/// Feeds `input` to one server connection, reading (and discarding) every reply.
pub fn run_connection(input: &[u8]) {
    let h = harness();
    h.rt.block_on(async {
        let (client, server_side) = std::os::unix::net::UnixStream::pair().expect("socket pair");
        let pair = [&client, &server_side].map(|s| s.set_nonblocking(true));
        pair.into_iter().collect::<std::io::Result<()>>().expect("non-blocking socket pair");
        let mut client = tokio::net::UnixStream::from_std(client).expect("client socket");
        let server_side = tokio::net::UnixStream::from_std(server_side).expect("server socket");
        let serve = h.server.serve_unix_stream(server_side, ShutdownSignal::never());
        let drive = async {
            let (mut rd, mut wr) = tokio::io::split(&mut client);
            let write = async {
                let _ = wr.write_all(input).await;
                let _ = wr.shutdown().await;
            };
            let read = async {
                let mut buf = vec![0u8; 1 << 16];
                while let Ok(n) = rd.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                }
            };
            tokio::join!(write, read);
        };
        let done = async {
            tokio::join!(serve, drive);
        };
        tokio::time::timeout(std::time::Duration::from_secs(20), done).await.expect("server connection hung");
    });
}

/// A well-formed handshake: flags, STRUCTURED_REPLY (if asked), SET_META_CONTEXT
/// base:allocation, GO on `export`.
pub fn handshake_prefix(export: &str, structured: bool) -> Vec<u8> {
    let mut v = 3u32.to_be_bytes().to_vec();
    let mut opt = |option: u32, data: &[u8]| {
        v.extend_from_slice(&0x4948_4156_454f_5054u64.to_be_bytes());
        v.extend_from_slice(&option.to_be_bytes());
        v.extend_from_slice(&(data.len() as u32).to_be_bytes());
        v.extend_from_slice(data);
    };
    if structured {
        opt(8, &[]);
        let mut meta = (export.len() as u32).to_be_bytes().to_vec();
        meta.extend_from_slice(export.as_bytes());
        meta.extend_from_slice(&1u32.to_be_bytes());
        meta.extend_from_slice(&15u32.to_be_bytes());
        meta.extend_from_slice(b"base:allocation");
        opt(10, &meta);
    }
    let mut go = (export.len() as u32).to_be_bytes().to_vec();
    go.extend_from_slice(export.as_bytes());
    go.extend_from_slice(&0u16.to_be_bytes());
    opt(7, &go);
    v
}
