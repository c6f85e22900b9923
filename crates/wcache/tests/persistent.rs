//! `device-disk-persistent` and `server-persistent`: the conformance suite, model checks,
//! reopening, refusal of a cache made for another vDisk or in use, tolerance of a torn
//! journal, a clear error for a damaged checkpoint, and a kill -9 crash test.
//!
//! The crash test re-runs this test binary as a child (`crash_child`, ignored in normal
//! runs) that writes and flushes until the parent SIGKILLs it, then reopens the cache and
//! checks every page against what the child had flushed.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vdstream_blockdev::conformance::{self, model, pattern_buf};
use vdstream_blockdev::{
    BatchOp, BlockDev, ErrorKind, FileDev, FileOptions, IoEngineKind, MemoryDev,
};
use vdstream_wcache::persistent::{cache_paths, PersistentDiskCache};
use vdstream_wcache::{CacheConfig, CacheType, WriteCache};

const PAGE: usize = 4096;

fn temp_dir() -> tempfile::TempDir {
    let base = std::env::var_os("CARGO_TARGET_TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    tempfile::tempdir_in(base).expect("a temporary directory")
}

fn lower(size: u64, seed: Option<u8>) -> Arc<dyn BlockDev> {
    let mem = MemoryDev::new(size);
    if let Some(seed) = seed {
        mem.write_at(&pattern_buf(seed, 0, size as usize), 0, false)
            .unwrap();
    }
    Arc::new(mem)
}

fn config(dir: &Path, target: &str, buffered: bool) -> CacheConfig {
    CacheConfig {
        dir: dir.to_path_buf(),
        intermediate_buffering: buffered,
        ..CacheConfig::new(target)
    }
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// A fresh persistent cache (new target name) over a lower of `size` bytes.
fn fresh(
    dir: &Path,
    kind: CacheType,
    buffered: bool,
    size: u64,
    seed: Option<u8>,
) -> vdstream_blockdev::Result<PersistentDiskCache> {
    let target = format!("vm {}/x", NEXT.fetch_add(1, Ordering::Relaxed));
    PersistentDiskCache::open(lower(size, seed), &config(dir, &target, buffered), kind)
}

fn direct_works(dir: &Path) -> bool {
    match fresh(dir, CacheType::DeviceDiskPersistent, false, 1 << 20, None) {
        Ok(_) => true,
        Err(e) if e.kind == ErrorKind::NotSupported => {
            println!("skipping O_DIRECT: {e}");
            false
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn both_persistent_types_conform() {
    let dir = temp_dir();
    for kind in [CacheType::DeviceDiskPersistent, CacheType::ServerPersistent] {
        conformance::run_all(kind.name(), &|size| {
            Arc::new(fresh(dir.path(), kind, true, size, None).unwrap())
        });
    }
    if direct_works(dir.path()) {
        conformance::run_all("device-disk-persistent (O_DIRECT)", &|size| {
            Arc::new(
                fresh(
                    dir.path(),
                    CacheType::DeviceDiskPersistent,
                    false,
                    size,
                    None,
                )
                .unwrap(),
            )
        });
        conformance::run_all("device-disk-persistent (O_DIRECT, io_uring)", &|size| {
            let target = format!("uring vm {}", NEXT.fetch_add(1, Ordering::Relaxed));
            let cfg = CacheConfig {
                io_engine: IoEngineKind::IoUring,
                ..config(dir.path(), &target, false)
            };
            Arc::new(
                PersistentDiskCache::open(lower(size, None), &cfg, CacheType::DeviceDiskPersistent)
                    .unwrap(),
            )
        });
    }
}

#[test]
fn persistent_types_match_the_model() {
    let dir = temp_dir();
    for (kind, buffered, seed) in [
        (CacheType::DeviceDiskPersistent, true, None),
        (CacheType::DeviceDiskPersistent, true, Some(0x47)),
        (CacheType::ServerPersistent, false, Some(0x19)),
    ] {
        if !buffered && !direct_works(dir.path()) {
            continue;
        }
        let make = |size| -> Arc<dyn BlockDev> {
            Arc::new(fresh(dir.path(), kind, buffered, size, seed).unwrap())
        };
        let cfg = model::ModelConfig {
            cases: 32,
            initial_seed: seed,
            ..Default::default()
        };
        model::model_check(kind.name(), &make, cfg.clone());
        model::model_check_concurrent(kind.name(), &make, model::ModelConfig { cases: 16, ..cfg });
    }
}

/// The persistent cache is a filter over the disk cache: with O_DIRECT it takes batches
/// (the batched engine), and a FUA write in a batch is durable when the batch returns.
#[test]
fn a_persistent_cache_takes_batches_and_makes_their_fua_writes_durable() {
    let dir = temp_dir();
    if !direct_works(dir.path()) {
        return;
    }
    let low = lower(1 << 20, Some(0x31));
    for kind in [CacheType::DeviceDiskPersistent, CacheType::ServerPersistent] {
        let target = format!("batch {}", kind.name());
        let cache =
            PersistentDiskCache::open(low.clone(), &config(dir.path(), &target, false), kind)
                .unwrap();
        assert!(
            cache.prefers_batches(),
            "{}: the O_DIRECT engine must see batches",
            kind.name()
        );
        let (a, b) = (vec![0xA1u8; 2 * PAGE], vec![0xB2u8; PAGE]);
        let mut got = vec![0u8; 3 * PAGE];
        let mut ops = [
            BatchOp::write(&a, 0, false),
            BatchOp::write(&b, 8 * PAGE as u64, true),
            BatchOp::read(&mut got, 16 * PAGE as u64),
        ];
        cache.io_batch(&mut ops);
        assert!(ops.iter().all(|op| op.result.is_ok()));
        assert!(
            got == pattern_buf(0x31, 16 * PAGE as u64, 3 * PAGE),
            "{}: a read of the batch",
            kind.name()
        );
        // A crash now: the files as they are, the cache never closed.
        let image = temp_dir();
        copy_cache(dir.path(), image.path(), &target);
        let reopened =
            PersistentDiskCache::open(low.clone(), &config(image.path(), &target, true), kind)
                .unwrap();
        let mut page = vec![0u8; PAGE];
        reopened.read_at(&mut page, 8 * PAGE as u64).unwrap();
        assert!(
            page == b,
            "{}: the FUA write of the batch survives",
            kind.name()
        );
        reopened.read_at(&mut page, 0).unwrap();
        assert!(
            page == a[..PAGE],
            "{}: and the write before it, flushed with it",
            kind.name()
        );
    }
}

/// Reads the whole device.
fn contents(dev: &dyn BlockDev) -> Vec<u8> {
    let mut buf = vec![0u8; dev.size() as usize];
    dev.read_at(&mut buf, 0).unwrap();
    buf
}

#[test]
fn a_reopened_cache_has_its_writes_and_trims() {
    let dir = temp_dir();
    let size = 3 << 20;
    let low = lower(size, Some(0x55));
    let cfg = config(dir.path(), "vm-1", true);
    let (want, file_bytes) = {
        let cache =
            PersistentDiskCache::open(low.clone(), &cfg, CacheType::DeviceDiskPersistent).unwrap();
        cache
            .write_at(&pattern_buf(1, 1000, 70_000), 1000, false)
            .unwrap();
        cache.flush().unwrap();
        cache.trim(8192, 3 * PAGE as u64, false).unwrap();
        cache.write_at(&[9u8; 100], size - 100, true).unwrap();
        cache.checkpoint().unwrap();
        cache.write_at(&[8u8; 5000], 1 << 20, false).unwrap();
        cache
            .write_zeroes(2 << 20, 5000, Default::default())
            .unwrap();
        cache.flush().unwrap();
        (contents(&cache), cache.stats().file_bytes)
    };
    let cache =
        PersistentDiskCache::open(low.clone(), &cfg, CacheType::DeviceDiskPersistent).unwrap();
    assert!(
        contents(&cache) == want,
        "the reopened cache must read exactly as before"
    );
    assert_eq!(file_bytes, (15 + 1 + 2 + 1) * PAGE as u64);
    assert_eq!(
        cache.stats().file_bytes,
        file_bytes,
        "file_bytes counts the data pages loaded"
    );
    // Another target in the same folder is a different, empty cache.
    let other = PersistentDiskCache::open(
        low.clone(),
        &config(dir.path(), "vm-2", true),
        CacheType::DeviceDiskPersistent,
    )
    .unwrap();
    assert!(contents(&other) == contents(&*low));
}

#[test]
fn a_cache_for_another_vdisk_or_in_use_is_refused() {
    let dir = temp_dir();
    let cfg = config(dir.path(), "vm-1", true);
    let kind = CacheType::ServerPersistent;
    let first =
        PersistentDiskCache::open_with_identity(lower(1 << 20, None), &cfg, kind, "golden v1")
            .unwrap();
    let err =
        PersistentDiskCache::open_with_identity(lower(1 << 20, None), &cfg, kind, "golden v1")
            .unwrap_err();
    assert!(err.to_string().contains("in use"), "{err}");
    drop(first);
    let err =
        PersistentDiskCache::open_with_identity(lower(2 << 20, None), &cfg, kind, "golden v1")
            .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("was made for a vDisk of 1048576 bytes")
            && msg.contains("delete it or choose another target"),
        "{msg}"
    );
    assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
    let err =
        PersistentDiskCache::open_with_identity(lower(1 << 20, None), &cfg, kind, "golden v2")
            .unwrap_err();
    assert!(
        err.to_string().contains("golden v1") && err.to_string().contains("golden v2"),
        "{err}"
    );
    PersistentDiskCache::open_with_identity(lower(1 << 20, None), &cfg, kind, "golden v1")
        .expect("the right vDisk opens");
}

/// Copies the three files of the cache of `target` from `from` to `to` (a crash image when
/// taken right after a completed flush).
fn copy_cache(from: &Path, to: &Path, target: &str) {
    for (a, b) in cache_paths(from, target)
        .iter()
        .zip(cache_paths(to, target))
    {
        std::fs::copy(a, b).unwrap();
    }
}

#[test]
fn a_torn_or_damaged_journal_tail_is_dropped() {
    let dir = temp_dir();
    let size = 1 << 20;
    let low = lower(size, Some(0x21));
    let cfg = config(dir.path(), "vm-j", true);
    let cache =
        PersistentDiskCache::open(low.clone(), &cfg, CacheType::DeviceDiskPersistent).unwrap();
    cache.write_at(&[1u8; PAGE], 0, false).unwrap();
    cache.flush().unwrap();
    cache
        .write_at(&[2u8; PAGE], 5 * PAGE as u64, false)
        .unwrap();
    cache.flush().unwrap();
    let image = temp_dir();
    copy_cache(dir.path(), image.path(), "vm-j");
    drop(cache);
    let journal = &cache_paths(image.path(), "vm-j")[2];
    let full = std::fs::read(journal).unwrap();
    let record = 16 + 8 + 4; // header, one entry, crc
    assert_eq!(full.len() - 16, 2 * record, "two flushes, one record each");
    for damage in ["cut", "flip", "garbage"] {
        let work = temp_dir();
        copy_cache(image.path(), work.path(), "vm-j");
        let mut bytes = full.clone();
        match damage {
            "cut" => bytes.truncate(bytes.len() - 3),
            "flip" => *bytes.last_mut().unwrap() ^= 0x40,
            _ => bytes.extend_from_slice(&[0xAB; 40]),
        }
        std::fs::write(&cache_paths(work.path(), "vm-j")[2], &bytes).unwrap();
        let cfg = config(work.path(), "vm-j", true);
        let cache =
            PersistentDiskCache::open(low.clone(), &cfg, CacheType::DeviceDiskPersistent).unwrap();
        let mut page = vec![0u8; PAGE];
        cache.read_at(&mut page, 0).unwrap();
        assert!(
            page.iter().all(|&b| b == 1),
            "{damage}: the first flush must survive"
        );
        cache.read_at(&mut page, 5 * PAGE as u64).unwrap();
        let want = if damage == "garbage" {
            vec![2u8; PAGE]
        } else {
            pattern_buf(0x21, 5 * PAGE as u64, PAGE)
        };
        assert!(
            page == want,
            "{damage}: page 5 must read {}",
            if damage == "garbage" {
                "its flushed data"
            } else {
                "as the vDisk"
            }
        );
        // The cache goes on working after the repair.
        cache.write_at(&[3u8; 10], 7, true).unwrap();
    }
}

#[test]
fn a_damaged_checkpoint_is_refused_clearly() {
    let dir = temp_dir();
    let cfg = config(dir.path(), "vm-c", true);
    drop(
        PersistentDiskCache::open(lower(1 << 20, None), &cfg, CacheType::DeviceDiskPersistent)
            .unwrap(),
    );
    let cp = &cache_paths(dir.path(), "vm-c")[1];
    let mut bytes = std::fs::read(cp).unwrap();
    bytes[40] ^= 1;
    std::fs::write(cp, &bytes).unwrap();
    let err =
        PersistentDiskCache::open(lower(1 << 20, None), &cfg, CacheType::DeviceDiskPersistent)
            .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&cp.display().to_string())
            && msg.contains("damaged")
            && msg.contains("delete"),
        "{msg}"
    );
    std::fs::write(cp, b"not a checkpoint at all").unwrap();
    let err =
        PersistentDiskCache::open(lower(1 << 20, None), &cfg, CacheType::DeviceDiskPersistent)
            .unwrap_err();
    assert!(err.to_string().contains("magic"), "{err}");
}

// ---- crash test ---------------------------------------------------------------------------

const CRASH_ENV: &str = "VDSTREAM_CRASH_CHILD";
const CRASH_SIZE: u64 = 4 << 20;
const CRASH_PAGES: u64 = CRASH_SIZE / PAGE as u64;
const CRASH_WRITES: u64 = 1_000_000;
const FLUSH_EVERY: u64 = 8;

/// Write `i` of round `seed`: the page and its new bytes (`None` = a trim of the page). The
/// child and the parent replay the same sequence: `rng` is `fastrand::Rng::with_seed(seed)`.
fn crash_op(rng: &mut fastrand::Rng, seed: u64, i: u64) -> (u64, Option<Vec<u8>>) {
    let page = rng.u64(..CRASH_PAGES);
    if rng.u8(..10) == 0 {
        return (page, None);
    }
    let tag = (seed << 40) | (i << 12) | page;
    (
        page,
        Some(
            (0..PAGE / 8)
                .flat_map(|w| (tag ^ ((w as u64) << 52)).to_le_bytes())
                .collect(),
        ),
    )
}

fn crash_paths(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join("vdisk.raw"), dir.join("progress"))
}

fn crash_lower(dir: &Path) -> Arc<dyn BlockDev> {
    Arc::new(
        FileDev::open(
            crash_paths(dir).0,
            FileOptions {
                read_only: true,
                direct: false,
            },
        )
        .unwrap(),
    )
}

/// The child: writes pages of round `seed`, flushing every FLUSH_EVERY writes and noting
/// each completed flush (writes acknowledged so far) in the progress file, until killed.
#[test]
#[ignore = "run by crash_test_flushed_writes_survive_kill_9 in a child process"]
fn crash_child() {
    let Some(dir) = std::env::var_os(CRASH_ENV).map(PathBuf::from) else {
        return;
    };
    let seed: u64 = std::env::var("VDSTREAM_CRASH_SEED")
        .unwrap()
        .parse()
        .unwrap();
    // Rounds 1-2 on io_uring (O_DIRECT, buffered), 3-4 on pread/pwrite.
    let engine = if seed <= 2 {
        IoEngineKind::IoUring
    } else {
        IoEngineKind::Sync
    };
    let cfg = CacheConfig {
        io_engine: engine,
        ..config(&dir, "crash target", seed % 2 == 0)
    };
    let cache = PersistentDiskCache::open(crash_lower(&dir), &cfg, CacheType::DeviceDiskPersistent)
        .unwrap();
    let mut progress = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(crash_paths(&dir).1)
        .unwrap();
    let mut rng = fastrand::Rng::with_seed(seed);
    for i in 0..CRASH_WRITES {
        match crash_op(&mut rng, seed, i) {
            (page, Some(data)) => cache.write_at(&data, page * PAGE as u64, false).unwrap(),
            (page, None) => cache.trim(page * PAGE as u64, PAGE as u64, false).unwrap(),
        }
        if (i + 1) % FLUSH_EVERY == 0 {
            if (i + 1) % (FLUSH_EVERY * 50) == 0 {
                cache.checkpoint().unwrap();
            } else {
                cache.flush().unwrap();
            }
            writeln!(progress, "{}", i + 1).unwrap();
            progress.sync_data().unwrap();
        }
    }
}

#[test]
fn crash_test_flushed_writes_survive_kill_9() {
    let dir = temp_dir();
    let (vdisk, progress) = crash_paths(dir.path());
    std::fs::write(&vdisk, pattern_buf(0x77, 0, CRASH_SIZE as usize)).unwrap();
    let mut baseline = pattern_buf(0x77, 0, CRASH_SIZE as usize);
    let mut delays = fastrand::Rng::with_seed(0xC0FFEE);
    for round in 1..=4u64 {
        let _ = std::fs::remove_file(&progress);
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "crash_child",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CRASH_ENV, dir.path())
            .env("VDSTREAM_CRASH_SEED", round.to_string())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Wait for the first completed flush (at most 20 s), then a random moment more.
        let start = Instant::now();
        while std::fs::read_to_string(&progress).map_or(true, |s| s.is_empty())
            && start.elapsed() < Duration::from_secs(20)
        {
            assert!(
                child.try_wait().unwrap().is_none(),
                "the crash child exited early"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(delays.u64(..400)));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let acked: u64 = std::fs::read_to_string(&progress)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.parse().ok())
            .next_back()
            .unwrap_or(0);

        // Every page: its value after the acknowledged writes, or a later write's value.
        let mut expect = baseline.clone();
        let mut later: Vec<Vec<Option<Vec<u8>>>> = vec![Vec::new(); CRASH_PAGES as usize];
        let mut rng = fastrand::Rng::with_seed(round);
        for i in 0..acked + 2 * FLUSH_EVERY {
            let (page, data) = crash_op(&mut rng, round, i);
            let at = page as usize * PAGE;
            if i < acked {
                match &data {
                    Some(d) => expect[at..at + PAGE].copy_from_slice(d),
                    None => expect[at..at + PAGE].fill(0),
                }
            } else {
                later[page as usize].push(data);
            }
        }
        let cache = PersistentDiskCache::open(
            crash_lower(dir.path()),
            &config(dir.path(), "crash target", true),
            CacheType::DeviceDiskPersistent,
        )
        .unwrap();
        let got = contents(&cache);
        for p in 0..CRASH_PAGES as usize {
            let page = &got[p * PAGE..(p + 1) * PAGE];
            let ok = page == &expect[p * PAGE..(p + 1) * PAGE]
                || later[p].iter().any(|d| match d {
                    Some(d) => page == &d[..],
                    None => page.iter().all(|&b| b == 0),
                });
            assert!(ok, "round {round}: page {p} reads neither its value after {acked} flushed writes nor a later write's");
        }
        println!("round {round}: {acked} writes flushed before kill -9; all {CRASH_PAGES} pages check out");
        assert!(
            acked > 0,
            "round {round}: the child never completed a flush"
        );
        baseline = got;
    }
}
