//! The request core keeps its promises on every executor, over real unix sockets: the
//! in-flight byte budget holds on the worker pool and the batched executor, batched READs
//! keep their hole chunks, and a device that panics during a WRITE is answered as a failed
//! write.

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
    ServerConfig { max_in_flight_bytes: BUDGET, ..Default::default() }
}

/// Sends `n` READs of [`READ`] bytes in one write, so that the server finds them all in
/// its input at once; checks every reply (simple replies) and returns.
async fn pipelined_reads(c: &mut RawClient, n: u64) {
    let mut wire = Vec::new();
    for i in 0..n {
        let h = RequestHeader { magic: REQUEST_MAGIC, flags: 0, command: CMD_READ, handle: i, offset: (i % 4) * READ as u64, length: READ };
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
    assert_eq!(handles, (0..n).collect::<Vec<_>>(), "every read answered once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_pool_holds_max_in_flight_bytes() {
    let h = start_with(budget());
    let (mut c, _, _) = RawClient::open(&h.path, "slow", false).await;
    pipelined_reads(&mut c, 16).await;
    let peak = h.exports.slow.peak_bytes.load(Ordering::SeqCst);
    assert!(peak <= BUDGET, "{peak} bytes of reads ran at once, over the {BUDGET}-byte budget");
    assert!(h.exports.slow.peak.load(Ordering::SeqCst) > 1, "reads that fit in the budget still ran side by side");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_batched_executor_holds_max_in_flight_bytes() {
    let h = start_with(budget());
    let (mut c, _, _) = RawClient::open(&h.path, "batched", false).await;
    pipelined_reads(&mut c, 32).await;
    let batches = h.exports.batched.batch_bytes.lock().unwrap().clone();
    assert!(batches.iter().all(|&b| b <= BUDGET), "a batch went over the {BUDGET}-byte budget: {batches:?}");
    assert!(batches.iter().any(|&b| b > READ as usize), "reads that fit in the budget still went down together: {batches:?}");
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
        let Reply::Chunk { kind, payload, handle: 2, .. } = ch else { panic!("{ch:?}") };
        let off = u64::from_be_bytes(payload[0..8].try_into().unwrap()) as usize;
        match *kind {
            REPLY_TYPE_OFFSET_DATA => image[off..off + payload.len() - 8].copy_from_slice(&payload[8..]),
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
    assert!(matches!(&chunks[..], [Reply::Chunk { kind: REPLY_TYPE_OFFSET_DATA, payload, .. }] if payload[8..] == image[..]), "{chunks:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_during_a_write_is_answered_as_a_failed_write() {
    let h = start();
    let (mut c, _, _) = RawClient::open(&h.path, "panics", true).await;
    c.send(CMD_WRITE, 0, 1, 0, 4096, &[1u8; 4096]).await;
    let chunks = c.chunks().await;
    let [Reply::Chunk { kind: REPLY_TYPE_ERROR, payload, handle: 1, .. }] = &chunks[..] else { panic!("{chunks:?}") };
    assert_eq!(chunks[0].error(), EIO);
    let message = String::from_utf8_lossy(&payload[6..]).to_string();
    assert!(message.contains("write") && !message.contains("read"), "the error names the write: {message:?}");
    // The connection goes on: a read still works.
    c.send(CMD_READ, CMD_FLAG_DF, 2, 0, 4096, &[]).await;
    assert_eq!(c.chunks().await[0].error(), 0);
}
