//! `device-disk` and `server` caches: the conformance suite, model checks over a lower of
//! zeros and over a pre-filled one (the lower is frozen: any write to it fails the test),
//! exact statistics, the `max_file` cap, O_DIRECT, and that nothing outlives an attach.

use std::sync::Arc;

use vdstream_blockdev::conformance::{self, model, pattern_buf};
use vdstream_blockdev::uring::UringQueue;
use vdstream_blockdev::{
    BatchOp, BlockDev, Caps, Error, ErrorKind, Extent, Hole, IoEngine, IoEngineKind, MemoryDev, Op,
    Result, ZeroFlags,
};
use vdstream_wcache::disk::DiskCache;
use vdstream_wcache::{CacheConfig, CacheType, WriteCache};

/// A lower device that refuses every write: a cache that writes below fails loudly.
#[derive(Debug)]
struct Frozen(MemoryDev);

impl Frozen {
    fn over(size: u64, seed: Option<u8>) -> Arc<dyn BlockDev> {
        let mem = MemoryDev::new(size);
        if let Some(seed) = seed {
            mem.write_at(&pattern_buf(seed, 0, size as usize), 0, false)
                .unwrap();
        }
        Arc::new(Frozen(mem))
    }

    fn refuse(op: Op, offset: u64, len: u64) -> Error {
        Error::new(
            ErrorKind::ReadOnly,
            op,
            offset,
            len,
            "frozen lower",
            "a write cache wrote to its lower device",
        )
    }
}

impl BlockDev for Frozen {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn caps(&self) -> Caps {
        Caps {
            read_only: true,
            ..self.0.caps()
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.0.read_at(buf, offset)
    }
    fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> Result<()> {
        self.0.read_at_sparse(buf, offset, holes)
    }
    fn write_at(&self, buf: &[u8], offset: u64, _: bool) -> Result<()> {
        Err(Self::refuse(Op::Write, offset, buf.len() as u64))
    }
    fn trim(&self, offset: u64, len: u64, _: bool) -> Result<()> {
        Err(Self::refuse(Op::Trim, offset, len))
    }
    fn write_zeroes(&self, offset: u64, len: u64, _: ZeroFlags) -> Result<()> {
        Err(Self::refuse(Op::Zero, offset, len))
    }
    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        self.0.block_status(offset, len, out)
    }
    fn describe(&self) -> String {
        "frozen lower".into()
    }
}

fn cache_dir() -> tempfile::TempDir {
    let base = std::env::var_os("CARGO_TARGET_TMPDIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    tempfile::tempdir_in(base).expect("a temporary directory")
}

fn config(dir: &std::path::Path, buffered: bool) -> CacheConfig {
    CacheConfig {
        dir: dir.to_path_buf(),
        intermediate_buffering: buffered,
        ..CacheConfig::new("target-7/test")
    }
}

fn open(
    dir: &std::path::Path,
    buffered: bool,
    kind: CacheType,
    lower: Arc<dyn BlockDev>,
) -> Result<DiskCache> {
    DiskCache::open(lower, &config(dir, buffered), kind)
}

/// An O_DIRECT device-disk cache on the given engine; checks the engine is the one asked
/// for (io_uring only where this kernel allows it).
fn open_on(dir: &std::path::Path, engine: IoEngineKind, lower: Arc<dyn BlockDev>) -> DiskCache {
    let cfg = CacheConfig {
        io_engine: engine,
        ..config(dir, false)
    };
    let cache = DiskCache::open(lower, &cfg, CacheType::DeviceDisk).unwrap();
    if engine == IoEngineKind::Sync || uring_works() {
        assert_eq!(cache.io_engine(), engine);
    }
    cache
}

fn uring_works() -> bool {
    UringQueue::new("probe").is_ok()
}

/// Whether O_DIRECT works in `dir`; prints why not when it doesn't.
fn direct_works(dir: &std::path::Path) -> bool {
    match open(
        dir,
        false,
        CacheType::DeviceDisk,
        Frozen::over(1 << 20, None),
    ) {
        Ok(_) => true,
        Err(e) if e.kind == ErrorKind::NotSupported => {
            println!("skipping O_DIRECT: {e}");
            false
        }
        Err(e) => panic!("opening an O_DIRECT cache failed: {e}"),
    }
}

fn model_cfg(cases: u32, seed: Option<u8>) -> model::ModelConfig {
    model::ModelConfig {
        cases,
        initial_seed: seed,
        ..Default::default()
    }
}

#[test]
fn device_disk_buffered_conforms() {
    let dir = cache_dir();
    conformance::run_all("device-disk (buffered)", &|size| {
        Arc::new(
            open(
                dir.path(),
                true,
                CacheType::DeviceDisk,
                Frozen::over(size, None),
            )
            .unwrap(),
        )
    });
}

#[test]
fn device_disk_direct_conforms() {
    let dir = cache_dir();
    if !direct_works(dir.path()) {
        return;
    }
    conformance::run_all("device-disk (O_DIRECT)", &|size| {
        Arc::new(
            open(
                dir.path(),
                false,
                CacheType::DeviceDisk,
                Frozen::over(size, None),
            )
            .unwrap(),
        )
    });
}

#[test]
fn server_conforms() {
    let dir = cache_dir();
    conformance::run_all("server", &|size| {
        Arc::new(
            open(
                dir.path(),
                true,
                CacheType::Server,
                Frozen::over(size, None),
            )
            .unwrap(),
        )
    });
}

#[test]
fn device_disk_buffered_matches_the_model() {
    let dir = cache_dir();
    for seed in [None, Some(0x6b)] {
        let make = |size| -> Arc<dyn BlockDev> {
            Arc::new(
                open(
                    dir.path(),
                    true,
                    CacheType::DeviceDisk,
                    Frozen::over(size, seed),
                )
                .unwrap(),
            )
        };
        model::model_check("device-disk (buffered)", &make, model_cfg(64, seed));
        model::model_check_concurrent("device-disk (buffered)", &make, model_cfg(24, seed));
    }
}

#[test]
fn device_disk_direct_matches_the_model() {
    let dir = cache_dir();
    if !direct_works(dir.path()) {
        return;
    }
    let seed = Some(0x3c);
    let make = |size| -> Arc<dyn BlockDev> {
        Arc::new(
            open(
                dir.path(),
                false,
                CacheType::DeviceDisk,
                Frozen::over(size, seed),
            )
            .unwrap(),
        )
    };
    model::model_check("device-disk (O_DIRECT)", &make, model_cfg(48, seed));
    model::model_check_concurrent("device-disk (O_DIRECT)", &make, model_cfg(24, seed));
}

#[test]
fn device_disk_direct_conforms_on_each_engine() {
    let dir = cache_dir();
    if !direct_works(dir.path()) {
        return;
    }
    for engine in [IoEngineKind::IoUring, IoEngineKind::Sync] {
        conformance::run_all(&format!("device-disk (O_DIRECT, {engine})"), &|size| {
            Arc::new(open_on(dir.path(), engine, Frozen::over(size, None)))
        });
    }
}

#[test]
fn device_disk_direct_matches_the_model_on_each_engine() {
    let dir = cache_dir();
    if !direct_works(dir.path()) {
        return;
    }
    for (engine, seed) in [
        (IoEngineKind::IoUring, Some(0x5a)),
        (IoEngineKind::Sync, Some(0x2e)),
    ] {
        let make = |size| -> Arc<dyn BlockDev> {
            Arc::new(open_on(dir.path(), engine, Frozen::over(size, seed)))
        };
        let name = format!("device-disk (O_DIRECT, {engine})");
        model::model_check(&name, &make, model_cfg(32, seed));
        model::model_check_concurrent(&name, &make, model_cfg(24, seed));
    }
}

/// Many threads writing, partly writing and reading the same few pages at once, through
/// the page locks and the engine's queue: every write lands whole, none is lost.
#[test]
fn many_threads_hammering_the_same_pages_lose_nothing() {
    let dir = cache_dir();
    let direct = direct_works(dir.path());
    for (engine, buffered) in [
        (IoEngineKind::IoUring, !direct),
        (IoEngineKind::Sync, !direct),
        (IoEngineKind::IoUring, true),
    ] {
        let cfg = CacheConfig {
            io_engine: engine,
            ..config(dir.path(), buffered)
        };
        let cache =
            DiskCache::open(Frozen::over(64 << 12, Some(4)), &cfg, CacheType::DeviceDisk).unwrap();
        const THREADS: u64 = 40;
        const ROUNDS: u64 = 120;
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let cache = &cache;
                s.spawn(move || {
                    let mut back = vec![0u8; 4096];
                    for r in 0..ROUNDS {
                        // Own page: exact read-back. Shared pages 0..4: whole-page writes and
                        // 512-byte writes into this thread's own sector of page 4+t%4.
                        let own = 8 + t;
                        let mine = pattern_buf((t * 31 + r) as u8, own * 4096, 4096);
                        cache.write_at(&mine, own * 4096, false).unwrap();
                        cache.read_at(&mut back, own * 4096).unwrap();
                        assert!(
                            back == mine,
                            "{engine}: thread {t} round {r}: own page reads other bytes"
                        );
                        let shared = (t + r) % 4;
                        cache
                            .write_at(&[(t as u8) | 0x80; 4096], shared * 4096, false)
                            .unwrap();
                        let sector = (t / 4) % 8;
                        let at = (4 + t % 4) * 4096 + sector * 512;
                        // Threads t and t+32 share a sector; both end with the same value.
                        cache.write_at(&[r as u8; 512], at, false).unwrap();
                        cache.read_at(&mut back[..512], at).unwrap();
                    }
                });
            }
        });
        let mut back = vec![0u8; 4096];
        for p in 0..4u64 {
            cache.read_at(&mut back, p * 4096).unwrap();
            assert!(
                back.iter().all(|&b| b == back[0]) && back[0] & 0x80 != 0,
                "{engine}: shared page {p} is not one whole write"
            );
        }
        for p in 4..8u64 {
            cache.read_at(&mut back, p * 4096).unwrap();
            for sector in back.chunks(512) {
                assert!(
                    sector.iter().all(|&b| b == (ROUNDS - 1) as u8),
                    "{engine}: page {p}: a sector lost its last write"
                );
            }
        }
    }
}

/// Zero-filled preallocation never overwrites data: the suite, the model (concurrent too)
/// and many threads on the same pages, on each engine.
#[test]
fn zero_filled_chunks_keep_every_write() {
    let dir = cache_dir();
    if !direct_works(dir.path()) {
        return;
    }
    for engine in [IoEngineKind::Sync, IoEngineKind::IoUring] {
        let cfg = CacheConfig {
            io_engine: engine,
            zero_fill: true,
            ..config(dir.path(), false)
        };
        let name = format!("device-disk (O_DIRECT, {engine}, zero fill)");
        conformance::run_all(&name, &|size| {
            Arc::new(
                DiskCache::open(Frozen::over(size, None), &cfg, CacheType::DeviceDisk).unwrap(),
            )
        });
        let seed = Some(0x71);
        let make = |size| -> Arc<dyn BlockDev> {
            Arc::new(
                DiskCache::open(Frozen::over(size, seed), &cfg, CacheType::DeviceDisk).unwrap(),
            )
        };
        model::model_check(&name, &make, model_cfg(24, seed));
        model::model_check_concurrent(&name, &make, model_cfg(16, seed));
        // Writes racing into one 2 MiB chunk while it is preallocated and zero-filled.
        let cache =
            DiskCache::open(Frozen::over(8 << 20, Some(2)), &cfg, CacheType::DeviceDisk).unwrap();
        std::thread::scope(|s| {
            for t in 0..32u64 {
                let cache = &cache;
                s.spawn(move || {
                    for i in 0..16u64 {
                        let page = (t * 16 + i) % 512 + 512 * (i % 3);
                        cache
                            .write_at(
                                &pattern_buf((t + i) as u8, page * 4096, 4096),
                                page * 4096,
                                false,
                            )
                            .unwrap();
                    }
                });
            }
        });
        let mut back = vec![0u8; 4096];
        for t in 0..32u64 {
            for i in 0..16u64 {
                let page = (t * 16 + i) % 512 + 512 * (i % 3);
                cache.read_at(&mut back, page * 4096).unwrap();
                // Each page is written by one (t, i) only: (t*16+i) % 512 is unique for t < 32.
                assert!(
                    back == pattern_buf((t + i) as u8, page * 4096, 4096),
                    "{name}: page {page} lost its write"
                );
            }
        }
    }
}

#[test]
fn a_refused_io_uring_falls_back_and_the_cache_still_conforms() {
    let dir = cache_dir();
    let buffered = !direct_works(dir.path());
    let refused = |what: &str| {
        IoEngine::from_setup(IoEngineKind::IoUring, what, || {
            Err(std::io::Error::from_raw_os_error(libc::EPERM))
        })
    };
    let cfg = config(dir.path(), buffered);
    let cache = DiskCache::open_with_engine(
        Frozen::over(1 << 20, None),
        &cfg,
        CacheType::DeviceDisk,
        refused,
    )
    .unwrap();
    assert_eq!(cache.io_engine(), IoEngineKind::Sync);
    conformance::run_all("device-disk (io_uring refused → sync)", &|size| {
        Arc::new(
            DiskCache::open_with_engine(
                Frozen::over(size, None),
                &cfg,
                CacheType::DeviceDisk,
                refused,
            )
            .unwrap(),
        )
    });
}

#[test]
fn server_matches_the_model_over_a_filled_vdisk() {
    let dir = cache_dir();
    let seed = Some(0x91);
    let make = |size| -> Arc<dyn BlockDev> {
        Arc::new(
            open(
                dir.path(),
                true,
                CacheType::Server,
                Frozen::over(size, seed),
            )
            .unwrap(),
        )
    };
    model::model_check("server", &make, model_cfg(32, seed));
    model::model_check_concurrent("server", &make, model_cfg(16, seed));
}

#[test]
fn trimmed_pages_read_zero_not_the_vdisk() {
    let dir = cache_dir();
    let size = 1 << 20;
    let cache = open(
        dir.path(),
        true,
        CacheType::DeviceDisk,
        Frozen::over(size, Some(9)),
    )
    .unwrap();
    cache.trim(8192, 3 * 4096, false).unwrap();
    cache.write_zeroes(100, 50, ZeroFlags::default()).unwrap();
    let mut buf = vec![0xEE; 5 * 4096];
    cache.read_at(&mut buf, 0).unwrap();
    let mut want = pattern_buf(9, 0, buf.len());
    want[8192..8192 + 3 * 4096].fill(0);
    want[100..150].fill(0);
    assert!(
        buf == want,
        "trimmed and zeroed bytes must read as zeros, the rest as the vDisk"
    );
    let mut extents = Vec::new();
    cache.block_status(8192, 3 * 4096, &mut extents).unwrap();
    assert_eq!(
        extents,
        vec![Extent {
            len: 3 * 4096,
            hole: true,
            zero: true
        }]
    );
    extents.clear();
    cache.block_status(0, 4096, &mut extents).unwrap();
    assert_eq!(
        extents,
        vec![Extent {
            len: 4096,
            hole: false,
            zero: false
        }],
        "a page with a partial zero write is data"
    );
}

#[test]
fn statistics_are_exact() {
    let dir = cache_dir();
    let cache = open(
        dir.path(),
        true,
        CacheType::DeviceDisk,
        Frozen::over(1 << 20, Some(3)),
    )
    .unwrap();
    cache.write_at(&[1u8; 8192], 4096, false).unwrap();
    let s = cache.stats();
    assert_eq!(
        (
            s.disk_write_ops,
            s.disk_write_bytes,
            s.vdisk_read_ops,
            s.file_bytes
        ),
        (1, 8192, 0, 8192)
    );
    // A partial write to an uncached page reads that page from the vDisk once.
    cache.write_at(&[2u8; 10], 20 * 4096 + 5, false).unwrap();
    let s = cache.stats();
    assert_eq!(
        (
            s.disk_write_ops,
            s.disk_write_bytes,
            s.vdisk_read_ops,
            s.vdisk_read_bytes,
            s.file_bytes
        ),
        (2, 12288, 1, 4096, 12288)
    );
    // A read over cached, uncached and cached pages: two file reads, one vDisk read.
    let mut buf = vec![0u8; 4 * 4096];
    cache.read_at(&mut buf, 0).unwrap();
    let s = cache.stats();
    assert_eq!(
        (
            s.hits,
            s.misses,
            s.disk_read_ops,
            s.disk_read_bytes,
            s.vdisk_read_ops
        ),
        (2, 2, 1, 8192, 3)
    );
    assert_eq!(
        (
            s.guest_read_ops,
            s.guest_read_bytes,
            s.guest_write_ops,
            s.guest_write_bytes
        ),
        (1, 16384, 2, 8202)
    );
    cache.trim(0, 1 << 20, false).unwrap();
    assert_eq!(cache.stats().file_bytes, 0);
    assert_eq!(cache.cache_type(), CacheType::DeviceDisk);
}

#[test]
fn a_full_cache_refuses_new_pages_and_keeps_serving() {
    let dir = cache_dir();
    let cfg = CacheConfig {
        max_file: Some(16 * 4096 + 100),
        ..config(dir.path(), true)
    };
    let cache =
        DiskCache::open(Frozen::over(1 << 20, Some(5)), &cfg, CacheType::DeviceDisk).unwrap();
    cache.write_at(&vec![1u8; 15 * 4096], 0, false).unwrap();
    // Two new pages where one fits: refused whole, nothing written.
    let err = cache
        .write_at(&vec![2u8; 2 * 4096], 100 * 4096, false)
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::NoSpace);
    let msg = err.to_string();
    assert!(
        msg.contains("target-7/test")
            && msg.contains("max_file")
            && msg.contains(&(16 * 4096).to_string()),
        "{msg}"
    );
    let mut buf = vec![0u8; 2 * 4096];
    cache.read_at(&mut buf, 100 * 4096).unwrap();
    assert!(
        buf == pattern_buf(5, 100 * 4096, 2 * 4096),
        "a refused write must leave no trace"
    );
    cache.write_at(&[3u8; 1], 15 * 4096, false).unwrap();
    let err = cache.write_at(&[4u8; 1], 16 * 4096, false).unwrap_err();
    assert_eq!(err.kind, ErrorKind::NoSpace);
    // Overwrites and reads still work; a trim gives space back.
    cache.write_at(&vec![5u8; 16 * 4096], 0, false).unwrap();
    cache.read_at(&mut buf, 0).unwrap();
    assert!(buf.iter().all(|&b| b == 5));
    assert_eq!(cache.stats().nospace_errors, 2);
    assert_eq!(cache.stats().file_bytes, 16 * 4096);
    cache.trim(0, 4096, false).unwrap();
    cache.write_at(&[6u8; 1], 16 * 4096, false).unwrap();
}

#[test]
fn every_open_is_empty_and_leaves_no_file() {
    let dir = cache_dir();
    let lower = Frozen::over(1 << 20, Some(1));
    {
        let cache = open(dir.path(), true, CacheType::DeviceDisk, lower.clone()).unwrap();
        cache.write_at(&[9u8; 4096], 0, false).unwrap();
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "the cache file is unlinked at once"
        );
    }
    let cache = open(dir.path(), true, CacheType::DeviceDisk, lower).unwrap();
    let mut buf = vec![0u8; 4096];
    cache.read_at(&mut buf, 0).unwrap();
    assert!(
        buf == pattern_buf(1, 0, 4096),
        "a fresh attach must not see the last one's writes"
    );
}

#[test]
fn direct_io_on_tmpfs_is_refused_clearly() {
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        println!("skipping: no /dev/shm");
        return;
    }
    let dir = tempfile::tempdir_in(shm).unwrap();
    match open(
        dir.path(),
        false,
        CacheType::DeviceDisk,
        Frozen::over(1 << 20, None),
    ) {
        Ok(_) => println!("skipping: /dev/shm accepts O_DIRECT here"),
        Err(e) => {
            assert_eq!(e.kind, ErrorKind::NotSupported, "{e}");
            assert!(
                e.to_string().contains("O_DIRECT")
                    && e.to_string().contains("intermediate_buffering"),
                "{e}"
            );
        }
    }
}

#[test]
fn a_missing_folder_is_named() {
    let err = open(
        std::path::Path::new("/nonexistent/vdstream"),
        true,
        CacheType::Server,
        Frozen::over(4096, None),
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("/nonexistent/vdstream")
            && err.to_string().contains("target-7/test"),
        "{err}"
    );
}

/// A batch on a capped O_DIRECT cache: writes of new pages past the cap fail with
/// NoSpace, alone; overwrites of cached pages and reads in the same batch still work; the
/// statistics count each request once, whether it went down in the batch or after it.
#[test]
fn a_batch_past_the_cap_fails_only_the_writes_that_do_not_fit() {
    let dir = cache_dir();
    if !direct_works(dir.path()) {
        return;
    }
    let cfg = CacheConfig {
        max_file: Some(3 * 4096),
        ..config(dir.path(), false)
    };
    let cache = DiskCache::open(
        Frozen::over(1 << 20, Some(0x21)),
        &cfg,
        CacheType::DeviceDisk,
    )
    .unwrap();
    assert!(cache.prefers_batches());
    cache.write_at(&[7u8; 4096], 0, false).unwrap();
    let (a, b, c, d) = (
        vec![1u8; 4096],
        vec![2u8; 8192],
        vec![3u8; 4096],
        vec![4u8; 100],
    );
    let (mut r0, mut r9) = (vec![0u8; 4096], vec![0u8; 4096]);
    let mut ops = vec![
        BatchOp::write(&a, 0, false),            // overwrite: always fits
        BatchOp::read(&mut r9, 9 * 4096),        // from the vDisk (run after the batch)
        BatchOp::write(&b, 4096, false),         // two new pages: fills the cap
        BatchOp::write(&c, 3 * 4096, false),     // one more new page: no space
        BatchOp::write(&d, 5 * 4096 + 1, false), // partial page, new: no space either
    ];
    cache.io_batch(&mut ops);
    let kinds: Vec<Option<ErrorKind>> = ops
        .iter()
        .map(|o| o.result.as_ref().err().map(|e| e.kind))
        .collect();
    assert_eq!(
        kinds,
        vec![
            None,
            None,
            None,
            Some(ErrorKind::NoSpace),
            Some(ErrorKind::NoSpace)
        ]
    );
    drop(ops);
    assert_eq!(r9, pattern_buf(0x21, 9 * 4096, 4096));
    let mut ops = vec![BatchOp::read(&mut r0, 0)];
    cache.io_batch(&mut ops);
    assert!(ops[0].result.is_ok());
    drop(ops);
    assert_eq!(r0, a);
    let mut got = vec![0u8; 8192];
    cache.read_at(&mut got, 4096).unwrap();
    assert_eq!(got, b);
    let s = cache.stats();
    assert_eq!((s.guest_write_ops, s.guest_read_ops), (5, 3), "{s:?}");
    assert_eq!(s.file_bytes, 3 * 4096);
    assert_eq!(s.nospace_errors, 2);
}
