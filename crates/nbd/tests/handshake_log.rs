//! A client that fails handshakes at will (garbage, a storm of foreign TLS certificates)
//! must not fill the server's log: failed handshakes go through the server's log limiter,
//! so the log shows the first ones and then a count, while the statistics count them all.
//! (Its own test binary: it installs a process-wide logger.)

mod common;
use common::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::io::AsyncWriteExt;
use vdstream_nbd::proto::*;

#[derive(Default)]
struct Lines {
    failed: AtomicUsize,
    suppressed: AtomicUsize,
}

struct Capture(Arc<Lines>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        let line = record.args().to_string();
        if line.starts_with("NBD handshake with") && line.contains("failed") {
            self.0.failed.fetch_add(1, Ordering::Relaxed);
        }
        if line.contains("handshake failed: suppressed") {
            self.0.suppressed.fetch_add(1, Ordering::Relaxed);
        }
    }
    fn flush(&self) {}
}

#[tokio::test]
async fn a_flood_of_failed_handshakes_is_logged_at_a_bounded_rate_and_counted_in_full() {
    let lines = Arc::new(Lines::default());
    log::set_logger(Box::leak(Box::new(Capture(lines.clone())))).unwrap();
    log::set_max_level(log::LevelFilter::Trace);

    let h = start();
    const ATTEMPTS: usize = 200;
    for _ in 0..ATTEMPTS {
        let mut c = RawClient::connect(&h.path).await;
        c.greet(FLAG_C_FIXED_NEWSTYLE).await;
        // Not an option header: the handshake fails.
        c.s.write_all(&[0xde; 16]).await.unwrap();
        assert!(c.closed().await);
    }
    // The server counts every failure ...
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while h.stats.handshakes_failed.load(Ordering::Relaxed) < ATTEMPTS as u64
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(
        h.stats.handshakes_failed.load(Ordering::Relaxed),
        ATTEMPTS as u64
    );
    // ... and logs a bounded number of them: the limiter's burst (20) plus what its rate
    // (10 a second) refills while the flood lasts.
    let logged = lines.failed.load(Ordering::Relaxed);
    assert!(logged >= 1, "the first failures are logged");
    assert!(
        logged < ATTEMPTS / 2,
        "{logged} of {ATTEMPTS} failed handshakes were logged one line each"
    );

    // After a pause the next failure is logged again, preceded by the count held back. (A
    // flood slowed by a busy machine may already have had such lines while it lasted, as
    // the limiter refilled: only the one after the pause is counted here.)
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let before = lines.suppressed.load(Ordering::Relaxed);
    let mut c = RawClient::connect(&h.path).await;
    c.greet(FLAG_C_FIXED_NEWSTYLE).await;
    c.s.write_all(&[0xde; 16]).await.unwrap();
    assert!(c.closed().await);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while lines.suppressed.load(Ordering::Relaxed) == before && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(
        lines.suppressed.load(Ordering::Relaxed),
        before + 1,
        "one line says how many were held back"
    );
}
