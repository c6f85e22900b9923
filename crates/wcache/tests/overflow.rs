//! `ram-overflow`: the conformance suite and model checks with RAM ample, tiny (everything
//! overflows, evictions during the run) and zero; ENOSPC at the file cap; the cost of
//! overwrites; coalesced region eviction; space given back on trim.

use std::sync::{Arc, Mutex};

use vdstream_blockdev::conformance::{self, model, pattern_buf};
use vdstream_blockdev::{BlockDev, ErrorKind, MemoryDev, Result};
use vdstream_wcache::overflow::RamOverflowCache;
use vdstream_wcache::{CacheConfig, CacheType, WriteCache};

const PAGE: u64 = 4096;
const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;

mod common;
use common::{vdisk, Sealed};

fn content(size: u64, seed: Option<u8>) -> Vec<u8> {
    seed.map_or_else(
        || vec![0; size as usize],
        |s| pattern_buf(s, 0, size as usize),
    )
}

/// The overflow folder of every cache in this test binary.
fn dir() -> &'static std::path::Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().unwrap()).path()
}

fn cfg(ram: u64, max_file: Option<u64>) -> CacheConfig {
    CacheConfig {
        ram,
        max_file,
        dir: dir().to_path_buf(),
        ..CacheConfig::new("target-9")
    }
}

fn cache(lower: &Arc<MemoryDev>, ram: u64, max_file: Option<u64>) -> RamOverflowCache {
    RamOverflowCache::open(Arc::new(Sealed(Arc::clone(lower))), &cfg(ram, max_file)).unwrap()
}

/// RAM sizes of the runs: ample, tiny (64 KiB: nearly everything overflows), none.
const RAMS: [(&str, u64); 3] = [("ram-ample", 64 * MIB), ("ram-64k", 64 * KIB), ("ram-0", 0)];

#[test]
fn ram_overflow_conforms() {
    for (name, ram) in RAMS {
        conformance::run_all(&format!("ram-overflow/{name}"), &|size| {
            Arc::new(cache(&vdisk(size, None), ram, None))
        });
    }
}

/// A model check (sequential or concurrent) over a vDisk of zeros or pattern bytes; every
/// vDisk is compared with its starting content once its cache is done.
fn model_run(name: &str, ram: u64, seed: Option<u8>, concurrent: bool, cases: u32) {
    let config = model::ModelConfig {
        initial_seed: seed,
        cases,
        ..Default::default()
    };
    let last: Mutex<Option<Arc<MemoryDev>>> = Mutex::new(None);
    let unchanged = |dev: &MemoryDev| {
        conformance::compare_all(dev, &content(dev.size(), seed), "vDisk after the run")
    };
    let make = |size: u64| -> Arc<dyn BlockDev> {
        let lower = vdisk(size, seed);
        if let Some(prev) = last.lock().unwrap().replace(Arc::clone(&lower)) {
            unchanged(&prev).unwrap();
        }
        Arc::new(cache(&lower, ram, None))
    };
    if concurrent {
        model::model_check_concurrent(name, &make, config);
    } else {
        model::model_check(name, &make, config);
    }
    unchanged(last.lock().unwrap().as_ref().unwrap()).unwrap();
}

#[test]
fn model_ram_ample() {
    model_run("ram-overflow/ram-ample", 64 * MIB, None, false, 32);
    model_run(
        "ram-overflow/ram-ample over data",
        64 * MIB,
        Some(0x42),
        false,
        32,
    );
}

#[test]
fn model_ram_tiny_evicts_during_the_run() {
    model_run("ram-overflow/ram-64k", 64 * KIB, None, false, 48);
    model_run(
        "ram-overflow/ram-64k over data",
        64 * KIB,
        Some(0x17),
        false,
        48,
    );
}

#[test]
fn model_ram_zero() {
    model_run("ram-overflow/ram-0 over data", 0, Some(0x29), false, 32);
}

#[test]
fn model_concurrent() {
    model_run(
        "ram-overflow/ram-64k concurrent",
        64 * KIB,
        Some(0x61),
        true,
        32,
    );
    model_run("ram-overflow/ram-0 concurrent", 0, Some(0x62), true, 16);
    model_run(
        "ram-overflow/ram-ample concurrent",
        64 * MIB,
        None,
        true,
        16,
    );
}

#[test]
fn the_overflow_file_is_fresh_and_never_left_behind() {
    let d = tempfile::tempdir().unwrap();
    let lower = vdisk(8 * MIB, None);
    let c = RamOverflowCache::open(
        Arc::new(Sealed(Arc::clone(&lower))),
        &CacheConfig {
            ram: 0,
            dir: d.path().into(),
            ..CacheConfig::new("t")
        },
    )
    .unwrap();
    c.write_at(&[1u8; 4096], 0, false).unwrap();
    assert_eq!(
        std::fs::read_dir(d.path()).unwrap().count(),
        0,
        "the file is unlinked at once"
    );
    assert_eq!(c.cache_type(), CacheType::RamOverflow);
    drop(c);
    let missing = CacheConfig {
        dir: d.path().join("missing"),
        ..CacheConfig::new("t")
    };
    let err = RamOverflowCache::open(lower, &missing).unwrap_err();
    assert!(
        err.to_string().contains("missing"),
        "the message names the folder: {err}"
    );
}

#[test]
fn overwrites_of_ram_pages_cost_no_storage_io() {
    let lower = vdisk(8 * MIB, Some(1));
    let c = cache(&lower, 64 * MIB, None);
    c.write_at(&[1u8; 4096], 3 * PAGE, false).unwrap();
    c.write_at(&[1u8; 100], 5 * PAGE + 7, false).unwrap(); // partial: one vDisk read
    let before = c.stats();
    for i in 0..1000u64 {
        c.write_at(&[i as u8; 4096], 3 * PAGE, false).unwrap();
        c.write_at(&[i as u8; 10], 5 * PAGE + (i % 4000), false)
            .unwrap();
    }
    let after = c.stats();
    assert_eq!(after.guest_write_ops - before.guest_write_ops, 2000);
    assert_eq!(
        after.storage_ops(),
        before.storage_ops(),
        "{before:?} → {after:?}"
    );
    assert_eq!(after.vdisk_read_ops, 1);
    assert_eq!(
        (
            after.overflow_write_ops,
            after.overflow_read_ops,
            after.evictions
        ),
        (0, 0, 0)
    );
}

#[test]
fn an_evicted_region_is_written_with_few_large_writes() {
    let lower = vdisk(16 * MIB, None);
    let c = cache(&lower, 64 * MIB, None); // RAM far above what is written: no flusher run
    let mut model = vec![0u8; 16 * MIB as usize];
    // Regions 0..4 written whole, page by page in a scrambled order.
    let pages = 4 * 512u64;
    for k in 0..pages {
        let p = (k * 1237) % pages;
        let data = pattern_buf(p as u8 | 1, p * PAGE, PAGE as usize);
        c.write_at(&data, p * PAGE, false).unwrap();
        model[(p * PAGE) as usize..][..PAGE as usize].copy_from_slice(&data);
    }
    // Region 5 with two gaps: three runs.
    for p in (5 * 512..6 * 512u64).filter(|p| p % 512 != 100 && p % 512 != 300) {
        c.write_at(&[0xAB; 4096], p * PAGE, false).unwrap();
        model[(p * PAGE) as usize..][..PAGE as usize].fill(0xAB);
    }
    let moved = c.evict_until(0).unwrap();
    let s = c.stats();
    assert_eq!(moved, pages + 510);
    assert_eq!(s.evictions, pages + 510);
    assert_eq!(s.ram_bytes, 0);
    assert_eq!(
        s.overflow_write_ops,
        4 + 3,
        "one pwritev per run of adjacent pages: {s:?}"
    );
    assert_eq!(s.overflow_write_bytes, (pages + 510) * PAGE);
    assert_eq!(s.file_bytes, (pages + 510) * PAGE);
    assert_eq!(c.overflow_units(), 5);
    conformance::compare_all(&c, &model, "after eviction").unwrap();
    let s = c.stats();
    assert!(
        s.overflow_read_ops > 0 && s.overflow_read_ops <= 16 + 6,
        "reads are coalesced: {s:?}"
    );
    // A write to an evicted page goes back to RAM; the file copy waits for the next eviction.
    c.write_at(&[9u8; 4096], 0, false).unwrap();
    assert_eq!(c.stats().ram_bytes, PAGE);
    model[..4096].fill(9);
    conformance::compare_all(&c, &model, "after rewriting an evicted page").unwrap();
}

#[test]
fn trim_gives_ram_and_file_space_back() {
    let lower = vdisk(16 * MIB, Some(5));
    let c = cache(&lower, 64 * MIB, None);
    c.write_at(&vec![3u8; 6 * MIB as usize], 0, false).unwrap();
    c.evict_until(2 * MIB).unwrap();
    assert!(c.stats().file_bytes >= 4 * MIB);
    let disk_before = c.overflow_disk_bytes();
    // A few pages of an evicted region: their slots are punched.
    c.trim(0, 64 * KIB, false).unwrap();
    c.trim(2 * MIB, 2 * MIB, false).unwrap();
    c.trim(4 * MIB, 2 * MIB, false).unwrap();
    let s = c.stats();
    assert!(
        c.overflow_disk_bytes() < disk_before,
        "space goes back to the filesystem"
    );
    assert_eq!(s.file_bytes + s.ram_bytes, 2 * MIB - 64 * KIB, "{s:?}");
    c.trim(0, 16 * MIB, false).unwrap();
    let s = c.stats();
    assert_eq!((s.ram_bytes, s.file_bytes, c.overflow_units()), (0, 0, 0));
    let mut buf = vec![1u8; 16 * MIB as usize];
    c.read_at(&mut buf, 0).unwrap();
    assert!(
        buf.iter().all(|&b| b == 0),
        "trimmed pages read zero, not the vDisk"
    );
}

#[test]
fn a_capped_file_answers_nospace_and_recovers_after_trim() {
    let lower = vdisk(16 * MIB, Some(2));
    let mut model = content(16 * MIB, Some(2));
    let c = cache(&lower, 0, Some(2 * 2 * MIB)); // no RAM, two units
    fn put(
        c: &RamOverflowCache,
        model: &mut [u8],
        offset: u64,
        len: usize,
        seed: u8,
    ) -> Result<()> {
        let data = pattern_buf(seed, offset, len);
        c.write_at(&data, offset, false)?;
        model[offset as usize..][..len].copy_from_slice(&data);
        Ok(())
    }
    put(&c, &mut model, 10, 100, 7).unwrap(); // region 0
    put(&c, &mut model, 2 * MIB + 5 * PAGE, 4096, 8).unwrap(); // region 1
    let err = put(&c, &mut model, 4 * MIB, 4096, 9).unwrap_err(); // region 2: no unit left
    assert_eq!(err.kind, ErrorKind::NoSpace);
    let msg = err.to_string();
    assert!(
        msg.contains("target-9") && msg.contains("--overflow-max"),
        "{msg}"
    );
    // New pages in regions that own a unit, overwrites, and reads still work.
    put(&c, &mut model, 3 * PAGE, 8192, 10).unwrap();
    put(&c, &mut model, 2 * MIB + 5 * PAGE + 1, 10, 11).unwrap();
    assert_eq!(
        put(&c, &mut model, 9 * MIB, 1, 12).unwrap_err().kind,
        ErrorKind::NoSpace
    );
    assert_eq!(c.stats().nospace_errors, 2);
    conformance::compare_all(&c, &model, "full overflow file").unwrap();
    // Trimming region 1 gives its unit back: region 2 can be written now.
    c.trim(2 * MIB, 2 * MIB, false).unwrap();
    model[(2 * MIB) as usize..(4 * MIB) as usize].fill(0);
    assert_eq!(c.overflow_units(), 1);
    put(&c, &mut model, 4 * MIB, 4096, 9).unwrap();
    conformance::compare_all(&c, &model, "after trim").unwrap();
    assert_eq!(c.stats().nospace_errors, 2);
}

#[test]
fn full_ram_and_full_file_refuse_new_regions_until_trim() {
    let lower = vdisk(32 * MIB, None);
    let c = cache(&lower, 16 * PAGE, Some(2 * MIB)); // 16 RAM pages, one unit
    let mut model = vec![0u8; 32 * MIB as usize];
    let mut refused = 0;
    for p in 0..64u64 {
        let off = 8 * MIB + p * PAGE;
        match c.write_at(&[p as u8 + 1; 4096], off, false) {
            Ok(()) => model[off as usize..][..4096].fill(p as u8 + 1),
            Err(e) if e.kind == ErrorKind::NoSpace => refused += 1,
            Err(e) => panic!("{e}"),
        }
    }
    // The first region evicted took the only unit; once RAM filled up with pages of regions
    // that cannot get one, new pages were refused.
    let mut other = 0;
    for p in 0..64u64 {
        let off = 20 * MIB + p * PAGE;
        match c.write_at(&[0xEE; 4096], off, false) {
            Ok(()) => model[off as usize..][..4096].fill(0xEE),
            Err(e) if e.kind == ErrorKind::NoSpace => other += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        refused + other > 0,
        "64 + 64 pages cannot fit in 16 RAM pages and one unit"
    );
    assert_eq!(c.stats().nospace_errors, refused + other);
    conformance::compare_all(&c, &model, "while full").unwrap();
    c.trim(0, 32 * MIB, false).unwrap();
    model.fill(0);
    for p in 0..64u64 {
        c.write_at(&[5u8; 4096], 20 * MIB + p * PAGE, false)
            .unwrap();
        model[(20 * MIB + p * PAGE) as usize..][..4096].fill(5);
    }
    conformance::compare_all(&c, &model, "after trim").unwrap();
}

#[test]
fn writes_racing_evictions_lose_nothing() {
    let lower = vdisk(8 * MIB, Some(4));
    let c = cache(&lower, 64 * MIB, None);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let models: Vec<Vec<u8>> = std::thread::scope(|s| {
        let evictor = s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                c.evict_until(0).unwrap();
            }
        });
        let writers: Vec<_> = (0..2u64)
            .map(|t| {
                let c = &c;
                s.spawn(move || {
                    // Thread t owns the bytes of each page whose index within the page is
                    // even (t = 0) or odd (t = 1), in the first 64 pages.
                    let mut model = pattern_buf(4, 0, 64 * PAGE as usize);
                    for round in 0..40u64 {
                        for p in 0..64u64 {
                            let at = p * PAGE + t * 2048 + (round * 8) % 2000;
                            let data = [(round + t * 100 + p) as u8 | 1; 40];
                            c.write_at(&data, at, false).unwrap();
                            model[at as usize..][..40].copy_from_slice(&data);
                        }
                    }
                    model
                })
            })
            .collect();
        let models = writers.into_iter().map(|w| w.join().unwrap()).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        evictor.join().unwrap();
        models
    });
    let mut want = models[0].clone();
    for (i, b) in want.iter_mut().enumerate() {
        if i % 4096 >= 2048 {
            *b = models[1][i];
        }
    }
    let mut got = vec![0u8; want.len()];
    c.read_at(&mut got, 0).unwrap();
    conformance::compare(&got, &want, 0, "after writes racing evictions").unwrap();
}
