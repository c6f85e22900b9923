//! Test servers for the agent: the real vdstream NBD server over a device, on a unix socket,
//! that a test can stop (drain: requests not yet read get no answer) and start again on
//! the same path.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use vdstream_agent::{Endpoint, RemoteBase, RemoteOptions};
use vdstream_blockdev::{BlockDev, Caps, Extent, MemoryDev, Result as DevResult, ZeroFlags};
use vdstream_nbd::{
    ExportInfo, Exports, Listener, OpenError, Server, ServerConfig, ShutdownSignal, ShutdownTrigger,
};

/// A device and its description, under "" only.
pub struct OneDev {
    pub dev: Arc<dyn BlockDev>,
    pub description: String,
}

impl Exports for OneDev {
    fn list(&self) -> Vec<ExportInfo> {
        vec![ExportInfo {
            name: String::new(),
            description: self.description.clone(),
        }]
    }
    fn open(&self, name: &str) -> Result<Arc<dyn BlockDev>, OpenError> {
        if name.is_empty() {
            Ok(self.dev.clone())
        } else {
            Err(OpenError::Unknown(format!("no export named {name:?}")))
        }
    }
}

/// A running server; `stop` drains it and removes its socket.
pub struct TestServer {
    pub sock: PathBuf,
    trigger: Option<ShutdownTrigger>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestServer {
    pub fn start(sock: &Path, dev: Arc<dyn BlockDev>, description: &str) -> TestServer {
        let _ = std::fs::remove_file(sock);
        let listener = std::os::unix::net::UnixListener::bind(sock).expect("bind the test socket");
        listener.set_nonblocking(true).unwrap();
        let (trigger, signal) = ShutdownSignal::new();
        let exports = Arc::new(OneDev {
            dev,
            description: description.to_string(),
        });
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let l = tokio::net::UnixListener::from_std(listener).unwrap();
                let server = Server::new(
                    exports,
                    ServerConfig {
                        threads_per_connection: 4,
                        ..ServerConfig::default()
                    },
                );
                server.serve(Listener::Unix(l), signal).await.unwrap();
            });
        });
        TestServer {
            sock: sock.to_path_buf(),
            trigger: Some(trigger),
            thread: Some(thread),
        }
    }

    /// Drains the server and removes its socket (once: a stopped server's drop must not
    /// remove the socket of a new server on the same path).
    pub fn stop(&mut self) {
        let Some(trigger) = self.trigger.take() else {
            return;
        };
        trigger.shutdown();
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
        let _ = std::fs::remove_file(&self.sock);
    }

    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.sock.display())
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop();
    }
}

pub fn pattern(offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((offset + i) / 7 % 251) as u8 ^ ((offset + i) >> 12) as u8)
        .collect()
}

/// A memory device filled with `pattern`.
pub fn patterned(size: u64) -> Arc<MemoryDev> {
    let dev = MemoryDev::new(size);
    dev.write_at(&pattern(0, size as usize), 0, false).unwrap();
    Arc::new(dev)
}

/// Quick options: short backoff, a bound on outages.
pub fn quick(retry_for: Option<Duration>) -> RemoteOptions {
    RemoteOptions {
        backoff_start: Duration::from_millis(10),
        backoff_max: Duration::from_millis(200),
        retry_for,
        connect_timeout: Duration::from_secs(2),
        target: "test".into(),
        ..RemoteOptions::default()
    }
}

pub fn connect(uris: &[String], opts: RemoteOptions) -> RemoteBase {
    let eps = uris.iter().map(|u| Endpoint::parse(u).unwrap()).collect();
    RemoteBase::connect(eps, opts).expect("connect")
}

/// A read-only view of a device that sleeps a little in every read (so requests pile up
/// in the server) and records the most reads it saw at once.
#[derive(Debug)]
pub struct SlowReads {
    pub inner: Arc<MemoryDev>,
    pub active: AtomicUsize,
    pub peak: AtomicUsize,
    pub delay: Duration,
}

impl BlockDev for SlowReads {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn caps(&self) -> Caps {
        Caps {
            read_only: true,
            may_block: true,
            ..self.inner.caps()
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> DevResult<()> {
        let now = self.active.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
        std::thread::sleep(self.delay);
        let r = self.inner.read_at(buf, offset);
        self.active.fetch_sub(1, Ordering::SeqCst);
        r
    }
    fn write_at(&self, _: &[u8], _: u64, _: bool) -> DevResult<()> {
        unreachable!("read-only")
    }
    fn trim(&self, _: u64, _: u64, _: bool) -> DevResult<()> {
        unreachable!("read-only")
    }
    fn write_zeroes(&self, _: u64, _: u64, _: ZeroFlags) -> DevResult<()> {
        unreachable!("read-only")
    }
    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> DevResult<()> {
        self.inner.block_status(offset, len, out)
    }
    fn describe(&self) -> String {
        "slow reads".into()
    }
}
