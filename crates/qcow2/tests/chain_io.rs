//! How reads go through a chain: partial-cluster reads read only the bytes asked for (from
//! this layer's file or from the backing device), block status reports holes and zeros
//! through every layer, and reads run in parallel (no data I/O under the metadata lock).
//!
//! One test per concern; the byte counting uses this process's `/proc/self/io`, so the
//! tests of this binary take turns ([`SERIAL`]).

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use common::*;
use vdstream_blockdev::{BlockDev, Caps, Extent, MemoryDev, Result, ZeroFlags};
use vdstream_qcow2::{create, open_chain, ImageFormat, OpenOptions, Qcow2Image};

const MIB: u64 = 1 << 20;

/// Held by every test, so that no other test reads while one counts bytes.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn rchar() -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").unwrap();
    io.lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// A read-only device over another that counts the bytes asked of it and can hold reads
/// until released.
#[derive(Debug)]
struct Probe {
    inner: MemoryDev,
    bytes: AtomicU64,
    gate: Mutex<Option<mpsc::Receiver<()>>>,
    entered: Mutex<Option<mpsc::Sender<()>>>,
}

impl BlockDev for Probe {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn caps(&self) -> Caps {
        Caps {
            read_only: true,
            ..self.inner.caps()
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.bytes.fetch_add(buf.len() as u64, Ordering::SeqCst);
        if let Some(tx) = self.entered.lock().unwrap().take() {
            tx.send(()).unwrap();
            let rx = self.gate.lock().unwrap().take().unwrap();
            rx.recv_timeout(Duration::from_secs(20)).expect("released");
        }
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, _: &[u8], _: u64, _: bool) -> Result<()> {
        unreachable!("backing devices are read-only")
    }
    fn trim(&self, _: u64, _: u64, _: bool) -> Result<()> {
        unreachable!()
    }
    fn write_zeroes(&self, _: u64, _: u64, _: ZeroFlags) -> Result<()> {
        unreachable!()
    }
    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        self.inner.block_status(offset, len, out)
    }
    fn describe(&self) -> String {
        "probe".into()
    }
}

fn probe(size: u64) -> Arc<Probe> {
    let inner = MemoryDev::new(size);
    inner
        .write_at(&pattern(1, 0, size as usize), 0, false)
        .unwrap();
    Arc::new(Probe {
        inner,
        bytes: AtomicU64::new(0),
        gate: Mutex::new(None),
        entered: Mutex::new(None),
    })
}

#[test]
fn partial_reads_read_only_what_is_asked() {
    let _turn = serial();
    let dir = tempfile::tempdir().unwrap();
    // 2 MiB clusters make a whole-cluster copy obvious.
    let img = dir.path().join("big.qcow2");
    create(&img, 8 * MIB, Some(("unused", ImageFormat::Raw)), 21).unwrap();
    let below = probe(8 * MIB);
    {
        let rw = Qcow2Image::open(
            &img,
            OpenOptions {
                read_only: false,
                ..Default::default()
            },
            Some(below.clone()),
        )
        .unwrap();
        rw.write_at(&pattern(2, 2 * MIB, 2 * MIB as usize), 2 * MIB, false)
            .unwrap();
    }
    let top = Qcow2Image::open(&img, OpenOptions::default(), Some(below.clone())).unwrap();
    let mut buf = vec![0u8; 4096];
    // Warm the L2 cache so metadata reads do not count.
    top.read_at(&mut buf, 0).unwrap();
    below.bytes.store(0, Ordering::SeqCst);
    // An unallocated cluster: the backing device is asked for the 4 KiB only.
    top.read_at(&mut buf, 6 * MIB + 12345).unwrap();
    assert_eq!(buf, pattern(1, 6 * MIB + 12345, 4096));
    assert_eq!(
        below.bytes.load(Ordering::SeqCst),
        4096,
        "backing read size"
    );
    // An allocated cluster: the file is read for the 4 KiB only.
    let before = rchar();
    top.read_at(&mut buf, 3 * MIB + 777).unwrap();
    let read = rchar() - before;
    assert_eq!(buf, pattern(2, 3 * MIB + 777, 4096));
    assert!(
        read < 64 * 1024,
        "a 4 KiB read of a 2 MiB cluster read {read} bytes"
    );
    // Through a whole qemu-made chain, opened the usual way.
    let base = dir.path().join("base.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=2M",
        s(&base),
        "8M",
    ]);
    qemu_io(&base, &["write -P 0x31 0 8M"]);
    let mid = dir.path().join("mid.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=2M",
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        s(&mid),
    ]);
    let chain = open_chain(&mid).unwrap();
    chain.read_at(&mut buf, 0).unwrap();
    let before = rchar();
    chain.read_at(&mut buf, 5 * MIB + 1).unwrap();
    let read = rchar() - before;
    assert!(buf.iter().all(|&b| b == 0x31));
    assert!(
        read < 64 * 1024,
        "a 4 KiB read through two layers read {read} bytes"
    );
}

#[test]
fn block_status_reports_holes_and_zeros_through_the_chain() {
    let _turn = serial();
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.raw");
    // Raw base: data at 0-2M, a sparse hole at 2-4M, data 4-6M.
    qemu_img(&["create", "-q", "-f", "raw", s(&base), "6M"]);
    run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0x11 0 2M",
            "-c",
            "write -P 0x12 4M 2M",
            s(&base),
        ],
    );
    let mid = dir.path().join("mid.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base.raw",
        "-F",
        "raw",
        s(&mid),
    ]);
    qemu_io(&mid, &["write -z 0 1M", "write -P 0x21 5M 64k"]);
    let top = dir.path().join("top.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "mid.qcow2",
        "-F",
        "qcow2",
        s(&top),
        "8M",
    ]);
    qemu_io(&top, &["write -P 0x31 512k 64k"]);
    let dev = open_chain(&top).unwrap();
    let mut map: Vec<(u64, u64, bool, bool)> = Vec::new();
    let mut pos = 0;
    while pos < dev.size() {
        let mut ext = Vec::new();
        dev.block_status(pos, dev.size() - pos, &mut ext).unwrap();
        for e in ext {
            match map.last_mut() {
                Some(l) if (l.2, l.3) == (e.hole, e.zero) => l.1 += e.len,
                _ => map.push((pos, e.len, e.hole, e.zero)),
            }
            pos += e.len;
        }
    }
    let k = 1024;
    let want = vec![
        (0, 512 * k, true, true),         // zero clusters in mid over base data
        (512 * k, 64 * k, false, false),  // top's data
        (576 * k, 448 * k, true, true),   // mid's zeros again
        (MIB, MIB, false, false),         // base data
        (2 * MIB, 2 * MIB, true, true),   // base's sparse hole, unallocated above
        (4 * MIB, 2 * MIB, false, false), // base data and mid data
        (6 * MIB, 2 * MIB, true, true),   // past the base's end
    ];
    assert_eq!(map, want);
    let zeros = our_zero_map(&*dev);
    assert_eq!(
        zeros,
        qemu_zero_map(&top, dev.size()),
        "zero flags against qemu-img map"
    );
}

#[test]
fn reads_do_not_wait_for_each_other() {
    let _turn = serial();
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("top.qcow2");
    create(&img, 4 * MIB, Some(("unused", ImageFormat::Raw)), 16).unwrap();
    let below = probe(4 * MIB);
    {
        let rw = Qcow2Image::open(
            &img,
            OpenOptions {
                read_only: false,
                ..Default::default()
            },
            Some(below.clone()),
        )
        .unwrap();
        rw.write_at(&pattern(3, 0, MIB as usize), 0, false).unwrap();
    }
    let top =
        Arc::new(Qcow2Image::open(&img, OpenOptions::default(), Some(below.clone())).unwrap());
    // The next backing read stalls until released.
    let (entered_tx, entered_rx) = mpsc::channel();
    let (gate_tx, gate_rx) = mpsc::channel();
    *below.entered.lock().unwrap() = Some(entered_tx);
    *below.gate.lock().unwrap() = Some(gate_rx);
    let stalled = {
        let top = top.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 8192];
            top.read_at(&mut buf, 2 * MIB).unwrap();
            buf
        })
    };
    entered_rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the backing read started");
    // While it stalls, this layer's own data, its metadata and block status are served.
    let (done_tx, done_rx) = mpsc::channel();
    let other = {
        let top = top.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 100_000];
            top.read_at(&mut buf, 5000).unwrap();
            let mut ext = Vec::new();
            top.block_status(0, MIB, &mut ext).unwrap();
            done_tx.send(buf).unwrap();
        })
    };
    let got = done_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("a read of allocated data waited for a backing read");
    assert_eq!(got, pattern(3, 5000, 100_000));
    gate_tx.send(()).unwrap();
    assert_eq!(stalled.join().unwrap(), pattern(1, 2 * MIB, 8192));
    other.join().unwrap();
}
