//! Concurrency tests: many requests in flight on a may_block device with out-of-order
//! completion, graceful drain under load, and isolation of an abusive connection.

mod common;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use vdstream_nbd::proto::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_in_flight_replies_out_of_order() {
    let h = start();
    let (mut c, _, _) = RawClient::open(&h.path, "slow", false).await;
    let n = 32u64;
    for i in 0..n {
        c.send(CMD_WRITE, 0, i, i * 4096, 4096, &vec![i as u8; 4096])
            .await;
    }
    let mut order = Vec::new();
    for _ in 0..n {
        let r = c.reply(0).await;
        assert_eq!(r.error(), 0);
        order.push(r.handle());
    }
    let mut sorted = order.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        (0..n).collect::<Vec<_>>(),
        "every request answered once"
    );
    assert_ne!(order, sorted, "a slow device should complete out of order");
    assert!(
        h.exports.slow.peak.load(Ordering::SeqCst) > 1,
        "requests ran concurrently"
    );
    // Reads see the writes.
    for i in [0u64, 7, 31] {
        c.send(CMD_READ, 0, 100 + i, i * 4096, 4096, &[]).await;
        match c.reply(4096).await {
            Reply::Simple {
                error: 0,
                data,
                handle,
            } => {
                assert_eq!(handle, 100 + i);
                assert!(data.iter().all(|&b| b == i as u8));
            }
            r => panic!("{r:?}"),
        }
    }
}

/// The threaded engine starts workers as requests need them: an idle connection holds one
/// thread, a connection with slow requests in flight grows to run them side by side, and
/// no more than the configured number per connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_start_as_requests_need_them() {
    let h = start_with(vdstream_nbd::ServerConfig {
        threads_per_connection: 6,
        ..Default::default()
    });
    let mut idle = Vec::new();
    for _ in 0..5 {
        let (mut c, _, _) = RawClient::open(&h.path, "slow", false).await;
        assert_eq!(c.call(CMD_TRIM, 0, 0, 4096, &[]).await, 0); // a fast request: no new worker
        idle.push(c);
    }
    let workers = || h.stats.workers.load(Ordering::SeqCst);
    assert_eq!(workers(), 5, "five idle connections, one worker each");
    let c = &mut idle[0];
    for i in 0..16u64 {
        c.send(CMD_WRITE, 0, i, i * 4096, 4096, &[9u8; 4096]).await;
    }
    for _ in 0..16 {
        assert_eq!(c.reply(0).await.error(), 0);
    }
    let grown = workers();
    assert!(
        grown > 5 && grown <= 5 + 5,
        "the busy connection grew to at most 6 workers: {grown} in all"
    );
    assert!(
        h.exports.slow.peak.load(Ordering::SeqCst) > 1,
        "its slow writes ran side by side"
    );
    drop(idle);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while workers() > 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(workers(), 0, "every worker ends with its connection");
}

/// The threaded engine runs fast requests inline in batches; when the device turns slow it
/// must go back to running requests side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_concurrent_again_when_a_fast_device_slows_down() {
    let h = start();
    let (mut c, _, _) = RawClient::open(&h.path, "slow", false).await;
    // TRIM does not sleep on this device: a long run of fast requests first.
    for i in 0..256u64 {
        c.send(CMD_TRIM, 0, i, (i % 64) * 4096, 4096, &[]).await;
    }
    for _ in 0..256 {
        assert_eq!(c.reply(0).await.error(), 0);
    }
    let n = 16u64;
    for i in 0..n {
        c.send(CMD_WRITE, 0, 1000 + i, i * 4096, 4096, &vec![i as u8; 4096])
            .await;
    }
    let mut order = Vec::new();
    for _ in 0..n {
        let r = c.reply(0).await;
        assert_eq!(r.error(), 0);
        order.push(r.handle() - 1000);
    }
    let mut sorted = order.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        (0..n).collect::<Vec<_>>(),
        "every request answered once"
    );
    assert!(
        h.exports.slow.peak.load(Ordering::SeqCst) > 1,
        "slow writes ran side by side"
    );
    assert_ne!(order, sorted, "slow writes complete out of order");
}

/// A device that prefers batches gets a connection's reads and writes in batches; other
/// commands and refused requests in between are answered too, and every reply carries the
/// right bytes (simple and structured replies).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_reach_a_device_that_prefers_them() {
    for structured in [false, true] {
        let h = start();
        let (mut c, _, _) = RawClient::open(&h.path, "batched", structured).await;
        let n = 48u64;
        for i in 0..n {
            c.send(CMD_WRITE, 0, i, i * 4096, 4096, &vec![i as u8 + 1; 4096])
                .await;
            if i == 20 {
                c.send(CMD_FLUSH, 0, 500, 0, 0, &[]).await;
                c.send(CMD_READ, 0, 501, DISK, 4096, &[]).await; // out of range: refused
            }
        }
        let mut handles = Vec::new();
        for _ in 0..n + 2 {
            let r = c.reply(0).await;
            if r.handle() == 501 {
                assert_eq!(r.error(), EINVAL, "{r:?}");
            } else {
                assert_eq!(r.error(), 0, "{r:?}");
            }
            handles.push(r.handle());
        }
        handles.sort();
        let mut want: Vec<u64> = (0..n).collect();
        want.extend([500, 501]);
        assert_eq!(handles, want, "every request answered once");
        for i in 0..n {
            c.send(CMD_READ, 0, 1000 + i, i * 4096, 4096, &[]).await;
        }
        for _ in 0..n {
            let (handle, data) = match c.reply(4096).await {
                Reply::Simple {
                    error: 0,
                    data,
                    handle,
                } => (handle, data),
                Reply::Chunk {
                    flags,
                    kind: REPLY_TYPE_OFFSET_DATA,
                    handle,
                    payload: data,
                } => {
                    assert_ne!(flags & REPLY_FLAG_DONE, 0, "one chunk per read");
                    let off = u64::from_be_bytes(data[..8].try_into().unwrap());
                    assert_eq!(off, (handle - 1000) * 4096);
                    (handle, data[8..].to_vec())
                }
                r => panic!("{r:?}"),
            };
            let i = handle - 1000;
            assert!(
                data.iter().all(|&b| b == i as u8 + 1),
                "read {i} (structured: {structured})"
            );
        }
        let batches = h.exports.batched.batches.lock().unwrap().clone();
        assert!(
            batches.iter().any(|&b| b > 1),
            "requests in flight together went down together: {batches:?}"
        );
        assert_eq!(
            batches.iter().sum::<usize>() as u64,
            2 * n,
            "every read and write went through io_batch once"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_answers_in_flight_requests_then_closes() {
    let h = start();
    let (mut slow, _, _) = RawClient::open(&h.path, "slow", true).await;
    let (mut fast, _, _) = RawClient::open(&h.path, "disk", false).await;
    let n = 16u64;
    for i in 0..n {
        slow.send(CMD_WRITE, 0, i, i * 4096, 4096, &[1u8; 4096])
            .await;
    }
    // Let the server read them, then shut down while they sleep in the device.
    tokio::time::sleep(Duration::from_millis(20)).await;
    h.trigger.shutdown();
    let mut handles: Vec<u64> = Vec::new();
    for _ in 0..n {
        let r = slow.reply(0).await;
        assert!(r.error() == 0 || r.error() == ESHUTDOWN, "got {r:?}");
        handles.push(r.handle());
    }
    handles.sort();
    assert_eq!(handles, (0..n).collect::<Vec<_>>());
    assert!(slow.closed().await);
    assert!(fast.closed().await);
    let served = tokio::time::timeout(Duration::from_secs(10), h.task)
        .await
        .expect("serve returned after drain");
    served.unwrap().unwrap();
    // No new connections after shutdown.
    assert!(tokio::net::UnixStream::connect(&h.path).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abusive_connection_does_not_disturb_another() {
    let h = start();
    let (mut good, _, _) = RawClient::open(&h.path, "disk", false).await;
    let path = h.path.clone();
    let abuser = tokio::spawn(async move {
        for round in 0..20u32 {
            let (mut c, _, _) = RawClient::open(&path, "disk", round % 2 == 0).await;
            // Floods of invalid requests, then garbage.
            for i in 0..200 {
                c.send(CMD_READ, 0xffff, i, u64::MAX, u32::MAX, &[]).await;
            }
            use tokio::io::AsyncWriteExt;
            let _ = c.s.write_all(&[0xde; 1000]).await;
            // Drop without reading replies.
        }
    });
    for i in 0..200u64 {
        let data = [(i % 256) as u8; 512];
        assert_eq!(good.call(CMD_WRITE, 0, i * 512, 512, &data).await, 0);
        assert_eq!(good.read(i * 512, 512).await, data);
    }
    abuser.await.unwrap();
    assert_eq!(good.call(CMD_READ, 0, 0, 512, &[]).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backpressure_bounds_in_flight_bytes() {
    // A tiny budget: the server must still answer everything (one at a time if need be).
    let h = start_with(vdstream_nbd::ServerConfig {
        max_in_flight_bytes: 1,
        ..Default::default()
    });
    let (mut c, _, _) = RawClient::open(&h.path, "slow", false).await;
    for i in 0..8u64 {
        c.send(CMD_WRITE, 0, i, i * 4096, 4096, &[3u8; 4096]).await;
    }
    for _ in 0..8 {
        assert_eq!(c.reply(0).await.error(), 0);
    }
}
