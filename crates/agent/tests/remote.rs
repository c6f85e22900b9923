//! RemoteBase against the real vdstream NBD server on unix sockets: reads in flight while
//! the server stops and starts again, failover to a second server, a server that comes
//! back with another size or description, no server at all, the cap on requests in flight
//! and writes forwarded for the `server` cache types. Every wait is bounded.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use vdstream_agent::{AgentError, Endpoint, RemoteBase, RemoteOptions};
use vdstream_blockdev::{BlockDev, ErrorKind, MemoryDev};

const SIZE: u64 = 8 << 20;

/// Reader threads doing random reads and checking every byte until `stop`; returns the
/// number of reads done.
fn readers(
    base: &Arc<RemoteBase>,
    threads: usize,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<u64>> {
    (0..threads)
        .map(|t| {
            let (base, stop) = (base.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t as u64);
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let len = 512 * rng.usize(1..=128);
                    let off = rng.u64(..SIZE - len as u64);
                    let mut buf = vec![0u8; len];
                    base.read_at(&mut buf, off)
                        .unwrap_or_else(|e| panic!("read at {off}: {e}"));
                    assert!(
                        buf == pattern(off, len),
                        "wrong bytes at {off} length {len}"
                    );
                    n += 1;
                }
                n
            })
        })
        .collect()
}

#[test]
fn reads_in_flight_survive_server_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    let data = patterned(SIZE);
    let slow = Arc::new(SlowReads {
        inner: data,
        active: Default::default(),
        peak: Default::default(),
        delay: Duration::from_millis(2),
    });
    let mut server = TestServer::start(&sock, slow.clone(), "golden v1");
    let base = Arc::new(connect(&[server.uri()], quick(None)));
    let stop = Arc::new(AtomicBool::new(false));
    let threads = readers(&base, 16, &stop);
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(250));
        server.stop();
        std::thread::sleep(Duration::from_millis(150));
        server = TestServer::start(&sock, slow.clone(), "golden v1");
    }
    std::thread::sleep(Duration::from_millis(250));
    stop.store(true, Ordering::Relaxed);
    let reads: u64 = threads
        .into_iter()
        .map(|t| t.join().expect("a reader failed"))
        .sum();
    let c = base.counters();
    let (reconnects, retries) = (
        c.reconnects.load(Ordering::Relaxed),
        c.retries.load(Ordering::Relaxed),
    );
    eprintln!("{reads} reads, {reconnects} reconnects, {retries} re-sent requests");
    assert!(reads > 100, "only {reads} reads");
    assert!(reconnects >= 3, "{reconnects} reconnects for 3 restarts");
    assert!(retries >= 1, "no request was in flight at a restart");
    assert_eq!(c.failovers.load(Ordering::Relaxed), 0);
}

#[test]
fn failover_to_the_second_server() {
    let dir = tempfile::tempdir().unwrap();
    let data = patterned(SIZE);
    let mut a = TestServer::start(&dir.path().join("a.sock"), data.clone(), "golden v1");
    let b = TestServer::start(&dir.path().join("b.sock"), data.clone(), "golden v1");
    let base = Arc::new(connect(&[a.uri(), b.uri()], quick(None)));
    assert_eq!(base.endpoint_in_use(), (a.uri(), true));
    let stop = Arc::new(AtomicBool::new(false));
    let threads = readers(&base, 8, &stop);
    std::thread::sleep(Duration::from_millis(200));
    a.stop();
    std::thread::sleep(Duration::from_millis(400));
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("a reader failed");
    }
    assert_eq!(base.endpoint_in_use(), (b.uri(), true));
    assert_eq!(base.counters().failovers.load(Ordering::Relaxed), 1);
}

#[test]
fn a_server_back_with_another_size_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    let mut server = TestServer::start(&sock, patterned(SIZE), "golden v1");
    let base = connect(&[server.uri()], quick(Some(Duration::from_millis(600))));
    let mut buf = vec![0u8; 4096];
    base.read_at(&mut buf, 0).unwrap();
    server.stop();
    let _other = TestServer::start(&sock, patterned(SIZE / 2), "golden v1");
    let t = Instant::now();
    let err = base.read_at(&mut buf, 4096).unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(err.kind, ErrorKind::Io);
    let msg = err.to_string();
    assert!(
        msg.contains("4194304 bytes but was 8388608 bytes at attach"),
        "{msg}"
    );
    assert!(msg.contains("a.sock"), "{msg}");
}

#[test]
fn a_server_back_with_another_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    let mut server = TestServer::start(&sock, patterned(SIZE), "v3 of vDisk win11");
    let base = connect(&[server.uri()], quick(Some(Duration::from_millis(400))));
    server.stop();
    let _newer = TestServer::start(&sock, patterned(SIZE), "v4 of vDisk win11");
    let msg = base.read_at(&mut [0u8; 512], 0).unwrap_err().to_string();
    assert!(
        msg.contains("\"v4 of vDisk win11\"") && msg.contains("\"v3 of vDisk win11\""),
        "{msg}"
    );
}

#[test]
fn no_server_gives_up_after_retry_for_naming_the_servers() {
    let dir = tempfile::tempdir().unwrap();
    let eps = vec![
        Endpoint::parse(&format!(
            "nbd+unix:///?socket={}",
            dir.path().join("none.sock").display()
        ))
        .unwrap(),
        Endpoint::parse("nbd://127.0.0.1:1/").unwrap(),
    ];
    let t = Instant::now();
    let err = RemoteBase::connect(eps, quick(Some(Duration::from_millis(300)))).unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    let msg = err.to_string();
    assert!(matches!(err, AgentError::NoServer { .. }), "{msg}");
    assert!(
        msg.contains("none.sock") && msg.contains("127.0.0.1:1"),
        "{msg}"
    );
}

#[test]
fn an_unknown_export_fails_the_attach_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(&dir.path().join("a.sock"), patterned(SIZE), "golden");
    let ep = Endpoint::parse(&server.uri())
        .unwrap()
        .with_export("vdisk/nosuch@1");
    let t = Instant::now();
    let msg = RemoteBase::connect(vec![ep], quick(None))
        .unwrap_err()
        .to_string();
    assert!(t.elapsed() < Duration::from_secs(3));
    assert!(
        msg.contains("refused the export") && msg.contains("nosuch"),
        "{msg}"
    );
}

#[test]
fn requests_in_flight_are_capped() {
    let dir = tempfile::tempdir().unwrap();
    let slow = Arc::new(SlowReads {
        inner: patterned(SIZE),
        active: Default::default(),
        peak: Default::default(),
        delay: Duration::from_millis(5),
    });
    let server = TestServer::start(&dir.path().join("a.sock"), slow.clone(), "");
    let opts = RemoteOptions {
        max_requests: 3,
        ..quick(None)
    };
    let base = Arc::new(connect(&[server.uri()], opts));
    let stop = Arc::new(AtomicBool::new(false));
    let threads = readers(&base, 12, &stop);
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    let peak = slow.peak.load(Ordering::SeqCst);
    assert!(
        (1..=3).contains(&peak),
        "the server saw {peak} reads at once"
    );
}

#[test]
fn server_types_forward_writes_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    let disk = Arc::new(MemoryDev::new(SIZE));
    let mut server = TestServer::start(&sock, disk.clone(), "target/t1");
    let base = connect(
        &[server.uri()],
        RemoteOptions {
            writable: true,
            ..quick(None)
        },
    );
    assert!(!base.caps().read_only);
    base.write_at(&[7u8; 8192], 4096, false).unwrap();
    server.stop();
    let restarted = {
        let (sock, disk) = (sock.clone(), disk.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            TestServer::start(&sock, disk, "target/t1")
        })
    };
    base.write_at(&[9u8; 4096], 8192, false).unwrap(); // waits for the server to come back
    let _server = restarted.join().unwrap();
    base.write_zeroes(0, 4096, Default::default()).unwrap();
    let mut got = vec![0u8; 16384];
    base.read_at(&mut got, 0).unwrap();
    assert_eq!(&got[..4096], &[0u8; 4096][..]);
    assert_eq!(&got[4096..8192], &[7u8; 4096][..]);
    assert_eq!(&got[8192..12288], &[9u8; 4096][..]);
    let mut direct = vec![0u8; 4096];
    disk.read_at(&mut direct, 8192).unwrap();
    assert_eq!(
        direct,
        vec![9u8; 4096],
        "the write reached the server's device"
    );
}

/// What a `server-persistent` cache keeps when its server is killed: the bytes as of the
/// last flush. The agent's journal must bring back everything answered since.
#[test]
fn the_journal_sends_answered_unflushed_writes_to_a_server_that_lost_them() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    let disk = Arc::new(MemoryDev::new(SIZE));
    let mut server = TestServer::start(&sock, disk.clone(), "target/t1@a1 vdisk/w@1");
    let base = connect(
        &[server.uri()],
        RemoteOptions {
            writable: true,
            journal: Some(1 << 20),
            ..quick(None)
        },
    );
    for i in 0..16u64 {
        base.write_at(&[1u8; 4096], i * 4096, false).unwrap();
    }
    base.flush().unwrap();
    let durable = Arc::new(MemoryDev::new(SIZE));
    let mut at_flush = vec![0u8; SIZE as usize];
    disk.read_at(&mut at_flush, 0).unwrap();
    durable.write_at(&at_flush, 0, false).unwrap();
    assert_eq!(
        base.journal_status().unwrap().changes,
        0,
        "the flush covered every write before it"
    );

    for i in 16..32u64 {
        base.write_at(&[2u8; 4096], i * 4096, false).unwrap();
    }
    base.write_zeroes(4096, 4096, Default::default()).unwrap();
    base.write_at(&[3u8; 4096], 16 * 4096, false).unwrap(); // a later write to a written block
    assert_eq!(base.journal_status().unwrap().changes, 18);
    // The server dies; the one that comes back has only what was flushed.
    server.stop();
    let _server = TestServer::start(&sock, durable.clone(), "target/t1@a1 vdisk/w@1");
    let mut got = vec![0u8; 33 * 4096];
    base.read_at(&mut got, 0).unwrap(); // reconnects: the journal goes first
    let block = |i: usize| &got[i * 4096..(i + 1) * 4096];
    assert_eq!(block(0), &[1u8; 4096][..]);
    assert_eq!(block(1), &[0u8; 4096][..], "the zeroing was sent again");
    assert_eq!(block(15), &[1u8; 4096][..]);
    assert_eq!(
        block(16),
        &[3u8; 4096][..],
        "the later write to block 16 won again"
    );
    assert_eq!(block(17), &[2u8; 4096][..]);
    assert_eq!(block(31), &[2u8; 4096][..]);
    assert_eq!(block(32), &[0u8; 4096][..]);
    let mut direct = vec![0u8; 4096];
    durable.read_at(&mut direct, 20 * 4096).unwrap();
    assert_eq!(
        direct,
        vec![2u8; 4096],
        "the replay reached the new server's device"
    );
    let j = base.journal_status().unwrap();
    assert_eq!((j.replayed, j.replay_errors), (18, 0), "{j:?}");
    assert!(base.counters().reconnects.load(Ordering::Relaxed) >= 1);
}

#[test]
fn the_journal_flushes_the_server_past_its_cap() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    let _server = TestServer::start(
        &sock,
        Arc::new(MemoryDev::new(SIZE)),
        "target/t1@a1 vdisk/w@1",
    );
    let cap = 64 << 10;
    let base = connect(
        &[_server.uri()],
        RemoteOptions {
            writable: true,
            journal: Some(cap),
            ..quick(None)
        },
    );
    for i in 0..256u64 {
        base.write_at(&[5u8; 4096], i * 4096, false).unwrap();
        let j = base.journal_status().unwrap();
        assert!(
            j.bytes <= cap,
            "after write {i} the journal holds {} bytes, past its cap of {cap}",
            j.bytes
        );
    }
    // FUA writes are durable when answered: nothing to keep.
    base.flush().unwrap();
    base.write_at(&[6u8; 4096], 0, true).unwrap();
    assert_eq!(base.journal_status().unwrap().changes, 0);
}

#[test]
fn read_only_base_refuses_writes_and_reports_extents() {
    let dir = tempfile::tempdir().unwrap();
    let disk = Arc::new(MemoryDev::new(SIZE));
    disk.write_at(&[1u8; 65536], 1 << 20, false).unwrap();
    let server = TestServer::start(&dir.path().join("a.sock"), disk, "");
    let base = connect(&[server.uri()], quick(None));
    assert!(base.caps().read_only);
    assert_eq!(
        base.write_at(&[0u8; 512], 0, false).unwrap_err().kind,
        ErrorKind::ReadOnly
    );
    let mut ext = Vec::new();
    base.block_status(0, 2 << 20, &mut ext).unwrap();
    assert!(!ext.is_empty() && ext[0].hole, "{ext:?}");
    assert!(ext.iter().map(|e| e.len).sum::<u64>() <= 2 << 20);
    // Unaligned reads are fine too.
    let mut buf = vec![0u8; 1000];
    base.read_at(&mut buf, (1 << 20) - 500).unwrap();
    assert_eq!(&buf[..500], &[0u8; 500][..]);
    assert_eq!(&buf[500..], &[1u8; 500][..]);
}

/// A batch of reads is sent side by side and every read gets its own bytes (aligned or
/// not); a write in the same batch is refused alone (the vDisk is read-only to targets).
#[test]
fn a_batch_of_reads_gets_each_its_bytes() {
    use vdstream_blockdev::{BatchOp, ErrorKind};
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let vdisk = patterned(1 << 20);
    let server = TestServer::start(&sock, vdisk.clone(), "golden");
    let base = connect(&[server.uri()], quick(None));
    let ranges: Vec<(u64, usize)> = (0..40u64)
        .map(|i| {
            (
                (i * 24_577) % ((1 << 20) - 9000),
                512 + (i as usize * 211) % 8000,
            )
        })
        .collect();
    let mut bufs: Vec<Vec<u8>> = ranges.iter().map(|&(_, l)| vec![0u8; l]).collect();
    let junk = vec![1u8; 4096];
    let mut ops: Vec<BatchOp<'_>> = bufs
        .iter_mut()
        .zip(&ranges)
        .map(|(b, &(o, _))| BatchOp::read(b, o))
        .collect();
    ops.push(BatchOp::write(&junk, 0, false));
    base.io_batch(&mut ops);
    let refused = ops.pop().unwrap();
    assert_eq!(refused.result.unwrap_err().kind, ErrorKind::ReadOnly);
    assert!(ops.iter().all(|o| o.result.is_ok()));
    drop(ops);
    for (b, &(o, l)) in bufs.iter().zip(&ranges) {
        assert_eq!(b, &pattern(o, l), "read of {l} bytes at {o}");
    }
}
