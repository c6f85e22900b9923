//! The request core keeps its promises on every executor, over real unix sockets: the
//! in-flight byte budget holds on the worker pool and the batched executor, one
//! connection's batches run side by side (one at a time with one thread per connection),
//! batched READs keep their hole chunks, and a device that panics during a WRITE is
//! answered as a failed write.

mod common;

use std::sync::atomic::Ordering;

use common::*;
use tokio::io::AsyncWriteExt;
use vdstream_nbd::proto::*;
use vdstream_nbd::wire::RequestHeader;
use vdstream_nbd::ServerConfig;

const BUDGET: usize = 1 << 20;
const READ: u32 = 256 << 10;

fn budget() -> ServerConfig {
    ServerConfig {
        max_in_flight_bytes: BUDGET,
        ..Default::default()
    }
}

/// Sends `n` READs of [`READ`] bytes in one write, so that the server finds them all in
/// its input at once; checks every reply (simple replies) and returns.
async fn pipelined_reads(c: &mut RawClient, n: u64) {
    let mut wire = Vec::new();
    for i in 0..n {
        let h = RequestHeader {
            magic: REQUEST_MAGIC,
            flags: 0,
            command: CMD_READ,
            handle: i,
            offset: (i % 4) * READ as u64,
            length: READ,
        };
        wire.extend_from_slice(&h.encode());
    }
    c.s.write_all(&wire).await.unwrap();
    let mut handles = Vec::new();
    for _ in 0..n {
        let r = c.reply(READ as usize).await;
        assert_eq!(r.error(), 0, "{r:?}");
        handles.push(r.handle());
    }
    handles.sort();
    assert_eq!(
        handles,
        (0..n).collect::<Vec<_>>(),
        "every read answered once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_pool_holds_max_in_flight_bytes() {
    let h = start_with(budget());
    let (mut c, _, _) = RawClient::open(&h.path, "slow", false).await;
    pipelined_reads(&mut c, 16).await;
    let peak = h.exports.slow.peak_bytes.load(Ordering::SeqCst);
    assert!(
        peak <= BUDGET,
        "{peak} bytes of reads ran at once, over the {BUDGET}-byte budget"
    );
    assert!(
        h.exports.slow.peak.load(Ordering::SeqCst) > 1,
        "reads that fit in the budget still ran side by side"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_batched_executor_holds_max_in_flight_bytes() {
    let h = start_with(budget());
    let (mut c, _, _) = RawClient::open(&h.path, "batched", false).await;
    pipelined_reads(&mut c, 32).await;
    let batches = h.exports.batched.batch_bytes.lock().unwrap().clone();
    assert!(
        batches.iter().all(|&b| b <= BUDGET),
        "a batch went over the {BUDGET}-byte budget: {batches:?}"
    );
    let peak = h.exports.batched.peak_bytes.load(Ordering::SeqCst);
    assert!(
        peak <= BUDGET,
        "{peak} bytes of batches ran at once, over the {BUDGET}-byte budget"
    );
    assert!(
        batches.iter().any(|&b| b > READ as usize),
        "reads that fit in the budget still went down together: {batches:?}"
    );
}

/// Sends `n` 4 KiB WRITEs (block `i` filled with `i + 1`) and a DISC in one write; checks
/// that every write is answered once and successfully before the server closes.
async fn writes_then_disc(c: &mut RawClient, n: u64) {
    let mut wire = Vec::new();
    for i in 0..n {
        let h = RequestHeader {
            magic: REQUEST_MAGIC,
            flags: 0,
            command: CMD_WRITE,
            handle: i,
            offset: i * 4096,
            length: 4096,
        };
        wire.extend_from_slice(&h.encode());
        wire.extend_from_slice(&[i as u8 + 1; 4096]);
    }
    let disc = RequestHeader {
        magic: REQUEST_MAGIC,
        flags: 0,
        command: CMD_DISC,
        handle: n,
        offset: 0,
        length: 0,
    };
    wire.extend_from_slice(&disc.encode());
    c.s.write_all(&wire).await.unwrap();
    let mut handles = Vec::new();
    for _ in 0..n {
        let r = c.reply(0).await;
        assert_eq!(r.error(), 0, "{r:?}");
        handles.push(r.handle());
    }
    handles.sort();
    assert_eq!(
        handles,
        (0..n).collect::<Vec<_>>(),
        "every write answered once before the close"
    );
    assert!(
        c.closed().await,
        "DISC closes the connection once its replies are out"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connections_batches_run_side_by_side() {
    let h = start();
    let (mut c, _, _) = RawClient::open(&h.path, "batched", false).await;
    let n = 200; // more than one batch, and more than the input buffer holds
    writes_then_disc(&mut c, n).await;
    let dev = &h.exports.batched;
    assert!(
        dev.peak.load(Ordering::SeqCst) >= 2,
        "a second batch went to the device while the first was in it"
    );
    assert_eq!(
        dev.batches.lock().unwrap().iter().sum::<usize>() as u64,
        n,
        "every write went down once"
    );
    let (mut c, _, _) = RawClient::open(&h.path, "batched", false).await;
    for i in [0, 63, 64, 150, n - 1] {
        assert!(
            c.read(i * 4096, 4096)
                .await
                .iter()
                .all(|&b| b == i as u8 + 1),
            "block {i} holds its write"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_thread_per_connection_runs_one_batch_at_a_time() {
    let h = start_with(ServerConfig {
        threads_per_connection: 1,
        ..Default::default()
    });
    let (mut c, _, _) = RawClient::open(&h.path, "batched", false).await;
    writes_then_disc(&mut c, 200).await;
    assert_eq!(
        h.exports.batched.peak.load(Ordering::SeqCst),
        1,
        "one batch at a time"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_structured_reads_keep_their_holes() {
    let h = start();
    let (mut c, _, _) = RawClient::open(&h.path, "batched", true).await;
    c.send(CMD_WRITE, 0, 1, 8192, 4096, &[7u8; 4096]).await;
    assert_eq!(c.reply(0).await.error(), 0);
    // 16 KiB over [hole 8K][data 4K][hole 4K].
    c.send(CMD_READ, 0, 2, 0, 16384, &[]).await;
    let chunks = c.chunks().await;
    let mut image = vec![0xAAu8; 16384];
    let mut holes = 0;
    for ch in &chunks {
        let Reply::Chunk {
            kind,
            payload,
            handle: 2,
            ..
        } = ch
        else {
            panic!("{ch:?}")
        };
        let off = u64::from_be_bytes(payload[0..8].try_into().unwrap()) as usize;
        match *kind {
            REPLY_TYPE_OFFSET_DATA => {
                image[off..off + payload.len() - 8].copy_from_slice(&payload[8..])
            }
            REPLY_TYPE_OFFSET_HOLE => {
                let len = u32::from_be_bytes(payload[8..12].try_into().unwrap()) as usize;
                image[off..off + len].fill(0);
                holes += len;
            }
            k => panic!("unexpected chunk type {k}"),
        }
    }
    assert_eq!(holes, 12288, "both holes came as hole chunks: {chunks:?}");
    assert!(image[..8192].iter().all(|&b| b == 0) && image[12288..].iter().all(|&b| b == 0));
    assert!(image[8192..12288].iter().all(|&b| b == 7));
    // With DF: one data chunk with all the bytes.
    c.send(CMD_READ, CMD_FLAG_DF, 3, 0, 16384, &[]).await;
    let chunks = c.chunks().await;
    assert!(
        matches!(&chunks[..], [Reply::Chunk { kind: REPLY_TYPE_OFFSET_DATA, payload, .. }] if payload[8..] == image[..]),
        "{chunks:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_during_a_write_is_answered_as_a_failed_write() {
    let h = start();
    let (mut c, _, _) = RawClient::open(&h.path, "panics", true).await;
    c.send(CMD_WRITE, 0, 1, 0, 4096, &[1u8; 4096]).await;
    let chunks = c.chunks().await;
    let [Reply::Chunk {
        kind: REPLY_TYPE_ERROR,
        payload,
        handle: 1,
        ..
    }] = &chunks[..]
    else {
        panic!("{chunks:?}")
    };
    assert_eq!(chunks[0].error(), EIO);
    let message = String::from_utf8_lossy(&payload[6..]).to_string();
    assert!(
        message.contains("write") && !message.contains("read"),
        "the error names the write: {message:?}"
    );
    // The connection goes on: a read still works.
    c.send(CMD_READ, CMD_FLAG_DF, 2, 0, 4096, &[]).await;
    assert_eq!(c.chunks().await[0].error(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_batch_runner_keeps_the_worker_pool() {
    // The agent's local export: one batch runner a connection, whatever the workers.
    let h = start_with(ServerConfig {
        batch_runners: 1,
        threads_per_connection: 4,
        ..Default::default()
    });
    let (mut c, _, _) = RawClient::open(&h.path, "batched", false).await;
    writes_then_disc(&mut c, 200).await;
    assert_eq!(
        h.exports.batched.peak.load(Ordering::SeqCst),
        1,
        "one batch at a time"
    );
    assert_eq!(
        h.exports
            .batched
            .batches
            .lock()
            .unwrap()
            .iter()
            .sum::<usize>(),
        200,
        "every write went down once"
    );
    // A device that sleeps without batches still gets its workers.
    let (mut c, _, _) = RawClient::open(&h.path, "slow", false).await;
    let mut wire = Vec::new();
    for i in 0..8u64 {
        wire.extend_from_slice(
            &RequestHeader {
                magic: REQUEST_MAGIC,
                flags: 0,
                command: CMD_READ,
                handle: i,
                offset: i * 4096,
                length: 4096,
            }
            .encode(),
        );
    }
    c.s.write_all(&wire).await.unwrap();
    for _ in 0..8 {
        assert_eq!(c.reply(4096).await.error(), 0);
    }
    assert!(
        h.exports.slow.peak.load(Ordering::SeqCst) > 1,
        "the slow device's reads ran side by side"
    );
}
