//! `device-ram`: the conformance suite, model checks (over a zero and a pre-filled vDisk,
//! sequential and concurrent), ENOSPC behaviour and statistics.

use std::sync::{Arc, Mutex};

use vdstream_blockdev::conformance::{self, model, pattern_buf};
use vdstream_blockdev::{BlockDev, ErrorKind, MemoryDev, ZeroFlags};
use vdstream_wcache::ram::RamCache;
use vdstream_wcache::{CacheConfig, CacheType, WriteCache};

const PAGE: u64 = 4096;
const MIB: u64 = 1 << 20;

mod common;
use common::{vdisk, Sealed};

fn cfg(ram: u64) -> CacheConfig {
    CacheConfig {
        ram,
        ..CacheConfig::new("target-7")
    }
}

fn ram_cache(lower: &Arc<MemoryDev>, ram: u64) -> RamCache {
    RamCache::open(Arc::new(Sealed(Arc::clone(lower))), &cfg(ram)).unwrap()
}

/// Runs a model check and checks that every vDisk under a cache is unchanged afterwards.
fn model_with_vdisk(name: &str, ram: u64, seed: Option<u8>, concurrent: bool) {
    let config = model::ModelConfig {
        initial_seed: seed,
        ..Default::default()
    };
    let size = config.size;
    let last: Mutex<Option<Arc<MemoryDev>>> = Mutex::new(None);
    let unchanged = |dev: &MemoryDev| {
        conformance::compare_all(dev, &pattern_or_zero(size, seed), "vDisk after the run")
    };
    let make = |size: u64| -> Arc<dyn BlockDev> {
        let lower = vdisk(size, seed);
        if let Some(prev) = last.lock().unwrap().replace(Arc::clone(&lower)) {
            unchanged(&prev).unwrap();
        }
        Arc::new(ram_cache(&lower, ram))
    };
    if concurrent {
        model::model_check_concurrent(name, &make, config);
    } else {
        model::model_check(name, &make, config);
    }
    unchanged(last.lock().unwrap().as_ref().unwrap()).unwrap();
}

fn pattern_or_zero(size: u64, seed: Option<u8>) -> Vec<u8> {
    seed.map_or_else(
        || vec![0; size as usize],
        |s| pattern_buf(s, 0, size as usize),
    )
}

#[test]
fn device_ram_conforms() {
    conformance::run_all("device-ram", &|size| {
        Arc::new(ram_cache(&vdisk(size, None), 64 * MIB))
    });
}

#[test]
fn device_ram_matches_the_model() {
    model_with_vdisk("device-ram", 64 * MIB, None, false);
}

#[test]
fn device_ram_over_a_filled_vdisk_matches_the_model() {
    model_with_vdisk("device-ram over data", 64 * MIB, Some(0x5a), false);
}

#[test]
fn device_ram_concurrent_matches_the_model() {
    model_with_vdisk("device-ram concurrent", 64 * MIB, Some(0x33), true);
}

#[test]
fn full_ram_answers_nospace_and_keeps_everything_else_working() {
    let lower = vdisk(8 * MIB, Some(9));
    let cache = ram_cache(&lower, 16 * PAGE);
    let mut model = pattern_buf(9, 0, 8 * MIB as usize);
    for i in 0..16u64 {
        let data = pattern_buf(100 + i as u8, 0, PAGE as usize);
        cache.write_at(&data, i * 2 * PAGE, false).unwrap();
        model[(i * 2 * PAGE) as usize..][..PAGE as usize].copy_from_slice(&data);
    }
    assert_eq!(cache.stats().ram_bytes, 16 * PAGE);
    // A new page: refused, with a message that says whose cache, how big and what to do.
    let err = cache.write_at(&[1u8; 4096], PAGE, false).unwrap_err();
    assert_eq!(err.kind, ErrorKind::NoSpace);
    assert!(err.to_string().contains("target-7"), "{err}");
    assert!(err.to_string().contains(&(16 * PAGE).to_string()), "{err}");
    assert!(
        err.to_string().contains("--ram") && err.to_string().contains("ram-overflow"),
        "{err}"
    );
    // A partial write to a page not held: refused too, and counted.
    assert_eq!(
        cache
            .write_at(&[1u8; 10], 5 * MIB + 3, false)
            .unwrap_err()
            .kind,
        ErrorKind::NoSpace
    );
    assert_eq!(cache.stats().nospace_errors, 2);
    // Overwrites of cached pages, whole and partial, still succeed.
    cache.write_at(&[7u8; 4096], 0, false).unwrap();
    model[..4096].fill(7);
    cache.write_at(&[8u8; 3], 2 * PAGE + 100, false).unwrap();
    model[(2 * PAGE + 100) as usize..][..3].fill(8);
    // Reads of everything, cached or not, are right.
    conformance::compare_all(&cache, &model, "full cache").unwrap();
    // A trim frees a page; a new page then fits.
    cache.trim(4 * PAGE, PAGE, false).unwrap();
    model[(4 * PAGE) as usize..][..PAGE as usize].fill(0);
    assert_eq!(cache.stats().ram_bytes, 15 * PAGE);
    cache.write_at(&[3u8; 4096], PAGE, false).unwrap();
    model[PAGE as usize..][..PAGE as usize].fill(3);
    conformance::compare_all(&cache, &model, "after trim and a new write").unwrap();
    assert_eq!(cache.stats().nospace_errors, 2);
    // Zeroing whole pages needs no RAM, even when full.
    cache
        .write_zeroes(6 * MIB, MIB, ZeroFlags::default())
        .unwrap();
    model[(6 * MIB) as usize..][..MIB as usize].fill(0);
    conformance::compare_all(&cache, &model, "after zeroing while full").unwrap();
    conformance::compare_all(&*lower, &pattern_buf(9, 0, 8 * MIB as usize), "vDisk").unwrap();
}

#[test]
fn trimmed_pages_read_zero_not_the_vdisk_and_give_ram_back() {
    let lower = vdisk(4 * MIB, Some(3));
    let cache = ram_cache(&lower, 64 * MIB);
    cache.write_at(&vec![5u8; 64 * 1024], 0, false).unwrap();
    assert_eq!(cache.stats().ram_bytes, 64 * 1024);
    cache.trim(0, 64 * 1024, false).unwrap();
    assert_eq!(cache.stats().ram_bytes, 0, "trimmed pages are freed");
    cache.trim(MIB, 2 * MIB, false).unwrap();
    let mut buf = vec![1u8; 3 * MIB as usize];
    cache.read_at(&mut buf, 0).unwrap();
    assert!(
        buf[..64 * 1024].iter().all(|&b| b == 0),
        "trimmed pages must read zero"
    );
    assert_eq!(
        buf[64 * 1024..MIB as usize],
        pattern_buf(3, 64 * 1024, (MIB - 64 * 1024) as usize)[..]
    );
    assert!(buf[MIB as usize..].iter().all(|&b| b == 0));
    assert_eq!(cache.stats().ram_bytes, 0, "zero markers take no page");
}

#[test]
fn stats_count_guest_and_vdisk_io_exactly() {
    let lower = vdisk(4 * MIB, None);
    let cache = ram_cache(&lower, 64 * MIB);
    assert_eq!(cache.cache_type(), CacheType::DeviceRam);
    cache.write_at(&[1u8; 100], 10, false).unwrap(); // partial: one vDisk page read
    cache.write_at(&[2u8; 8192], 2 * PAGE, false).unwrap(); // whole pages: no read
    let mut buf = vec![0u8; 4 * PAGE as usize];
    cache.read_at(&mut buf, 0).unwrap(); // pages 0, 2, 3 cached; page 1 from the vDisk
    let s = cache.stats();
    assert_eq!((s.guest_write_ops, s.guest_write_bytes), (2, 8292));
    assert_eq!((s.guest_read_ops, s.guest_read_bytes), (1, 4 * PAGE));
    assert_eq!((s.vdisk_read_ops, s.vdisk_read_bytes), (2, 2 * PAGE));
    assert_eq!((s.hits, s.misses), (3, 1));
    assert_eq!(s.ram_bytes, 3 * PAGE);
    assert_eq!(s.storage_write_ops(), 0);
    assert!(!cache.caps().flush && cache.caps().trim && cache.caps().block_status);
}

#[test]
fn block_status_reports_cache_data_zeros_and_vdisk_holes() {
    let lower = vdisk(8 * MIB, None);
    lower.write_at(&[1u8; 4096], 0, false).unwrap(); // vDisk data in its first page only
    let cache = ram_cache(&lower, 64 * MIB);
    cache.write_at(&[2u8; 8192], 4 * MIB, false).unwrap();
    cache
        .write_zeroes(6 * MIB, 8192, ZeroFlags::default())
        .unwrap();
    let all = conformance::block_status_covering(&cache, 0, 8 * MIB).unwrap();
    let at = |pos: u64| {
        let mut p = 0;
        *all.iter()
            .find(|e| {
                p += e.len;
                p > pos
            })
            .unwrap()
    };
    assert!(!at(0).zero, "vDisk data: {all:?}");
    assert!(
        at(MIB).hole && at(MIB).zero,
        "a hole of the vDisk stays a hole: {all:?}"
    );
    assert!(
        !at(4 * MIB).zero && !at(4 * MIB + PAGE).zero,
        "cached data: {all:?}"
    );
    assert!(at(6 * MIB).zero, "zeroed pages: {all:?}");
}
