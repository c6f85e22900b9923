//! No thread of a connection outlives it: when the future serving a connection returns,
//! its session thread and workers have ended (thread-local destructors included, which
//! LeakSanitizer checks in the fuzz harness), and when the task serving a connection is
//! cancelled, the session ends instead of serving on with nobody owning it. One test in
//! this binary, so the threads it counts are its own.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use vdstream_blockdev::MemoryDev;
use vdstream_nbd::proto::*;
use vdstream_nbd::wire::RequestHeader;
use vdstream_nbd::{Server, ServerConfig, ShutdownSignal};

/// Threads of this process that serve an NBD connection.
fn connection_threads() -> Vec<String> {
    let tasks = std::fs::read_dir("/proc/self/task").expect("/proc/self/task");
    let names = tasks.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok());
    names
        .map(|n| n.trim_end().to_string())
        .filter(|n| n == "nbd-session" || n == "nbd-worker")
        .collect()
}

/// A connection served on a task of its own, as the accept loop serves it; the client end
/// has opened `export`.
async fn connect(server: &Arc<Server>, export: &str) -> (RawClient, tokio::task::JoinHandle<()>) {
    let (client, served) = UnixStream::pair().unwrap();
    let server = server.clone();
    let task = tokio::spawn(async move {
        server
            .serve_unix_stream(served, ShutdownSignal::never())
            .await
    });
    let mut c = RawClient { s: client };
    c.greet(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).await;
    c.go(export).await;
    (c, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_thread_outlives_its_connection() {
    let exports = Arc::new(TestExports {
        disk: Arc::new(MemoryDev::new(DISK)),
        slow: Arc::new(SlowDev::new()),
        batched: Arc::new(BatchDev::new()),
    });
    let server = Arc::new(Server::new(
        exports,
        ServerConfig {
            threads_per_connection: 4,
            ..Default::default()
        },
    ));

    // To its end: the reads pipelined on "slow" start workers beside the session thread,
    // and on "batched" more batch runners.
    for round in 0..30 {
        let export = ["slow", "disk", "batched"][round % 3];
        let (mut c, task) = connect(&server, export).await;
        let mut wire = Vec::new();
        for handle in 0..8u64 {
            let h = RequestHeader {
                magic: REQUEST_MAGIC,
                flags: 0,
                command: CMD_READ,
                handle,
                offset: handle * 4096,
                length: 4096,
            };
            wire.extend_from_slice(&h.encode());
        }
        c.s.write_all(&wire).await.unwrap();
        for _ in 0..8 {
            assert_eq!(c.reply(4096).await.error(), 0);
        }
        c.send(CMD_DISC, 0, 99, 0, 0, &[]).await;
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the connection ended")
            .unwrap();
        // A joined thread has run to its end, thread-local destructors included; the
        // kernel may list its task a moment longer, until it has released it.
        let deadline = Instant::now() + Duration::from_millis(500);
        while !connection_threads().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            connection_threads(),
            Vec::<String>::new(),
            "round {round} ({export}): threads left after the connection's future returned"
        );
    }

    // Cancelled: the task that serves an idle connection is aborted (a server future
    // dropped, a runtime shutting down). The client sees the connection end, and the
    // session thread ends instead of waiting on the socket for good.
    let (mut c, task) = connect(&server, "disk").await;
    assert_eq!(c.call(CMD_READ, 0, 0, 512, &[]).await, 0);
    assert_eq!(connection_threads(), vec!["nbd-session".to_string()]);
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    assert!(
        c.closed().await,
        "the connection of a cancelled task was still open"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !connection_threads().is_empty() {
        assert!(
            Instant::now() < deadline,
            "a cancelled connection's threads still run: {:?}",
            connection_threads()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
