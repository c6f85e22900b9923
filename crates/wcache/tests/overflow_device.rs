//! `--overflow-device`: `ram-overflow`'s overflow and `device-disk`'s page file on a raw
//! disk or partition. A file full of old bytes stands in for the device (and, where this
//! machine lets root set one up, a real loop device): the caches match the model (so the
//! old bytes are never read: the device counts as empty at every start), a device smaller
//! than needed answers ENOSPC past its end (ram-overflow) or is refused at open
//! (device-disk), and a device in use elsewhere is refused.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use vdstream_blockdev::conformance::{model, pattern_buf};
use vdstream_blockdev::{BlockDev, ErrorKind};
use vdstream_wcache::disk::DiskCache;
use vdstream_wcache::overflow::RamOverflowCache;
use vdstream_wcache::{CacheConfig, CacheType, WriteCache};

mod common;
use common::{vdisk, Sealed};

const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;

/// A "device": a file of `size` bytes of 0xEE, old contents the cache must never show.
fn stale_device(dir: &Path, name: &str, size: u64) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, vec![0xEE; size as usize]).unwrap();
    path
}

fn cfg(dir: &Path, device: &Path, ram: u64) -> CacheConfig {
    CacheConfig {
        ram,
        dir: dir.join("no-such-folder"),
        overflow_device: Some(device.to_path_buf()),
        ..CacheConfig::new("lab-3")
    }
}

#[test]
fn ram_overflow_on_a_device_matches_the_model() {
    let dir = tempfile::tempdir().unwrap();
    for (ram, seed) in [(64 * KIB, Some(0x31)), (0, None)] {
        let n = std::sync::atomic::AtomicUsize::new(0);
        let make = |size: u64| -> Arc<dyn BlockDev> {
            let dev = stale_device(
                dir.path(),
                &format!(
                    "sdb{}",
                    n.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                ),
                size.div_ceil(2 * MIB) * 2 * MIB,
            );
            Arc::new(
                RamOverflowCache::open(
                    Arc::new(Sealed(vdisk(size, seed))),
                    &cfg(dir.path(), &dev, ram),
                )
                .unwrap(),
            )
        };
        model::model_check(
            &format!("ram-overflow on a device, RAM {ram}"),
            &make,
            model::ModelConfig {
                initial_seed: seed,
                cases: 24,
                ..Default::default()
            },
        );
    }
}

#[test]
fn a_small_device_answers_nospace_past_its_end() {
    let dir = tempfile::tempdir().unwrap();
    // Two 2 MiB units and a bit: the bit is never used.
    let dev = stale_device(dir.path(), "sdb1", 4 * MIB + 4096);
    let c = RamOverflowCache::open(
        Arc::new(Sealed(vdisk(16 * MIB, Some(2)))),
        &cfg(dir.path(), &dev, 0),
    )
    .unwrap();
    c.write_at(&pattern_buf(7, 0, 4096), 10 * 4096, false)
        .unwrap();
    c.write_at(&pattern_buf(8, 0, 4096), 2 * MIB, false)
        .unwrap();
    let e = c
        .write_at(&pattern_buf(9, 0, 4096), 4 * MIB, false)
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::NoSpace);
    assert!(
        e.to_string().contains("sdb1") && e.to_string().contains("overflow device"),
        "{e}"
    );
    let mut got = vec![0u8; 4096];
    c.read_at(&mut got, 2 * MIB).unwrap();
    assert_eq!(got, pattern_buf(8, 0, 4096));
    assert_eq!(c.stats().nospace_errors, 1);
}

#[test]
fn device_disk_on_a_device_matches_the_model_and_a_small_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let n = std::sync::atomic::AtomicUsize::new(0);
    let make = |size: u64| -> Arc<dyn BlockDev> {
        let dev = stale_device(
            dir.path(),
            &format!(
                "sdc{}",
                n.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ),
            size.div_ceil(4096) * 4096,
        );
        Arc::new(
            DiskCache::open(
                Arc::new(Sealed(vdisk(size, Some(5)))),
                &cfg(dir.path(), &dev, 0),
                CacheType::DeviceDisk,
            )
            .unwrap(),
        )
    };
    model::model_check(
        "device-disk on a device",
        &make,
        model::ModelConfig {
            initial_seed: Some(5),
            cases: 24,
            ..Default::default()
        },
    );
    let small = stale_device(dir.path(), "sdc-small", MIB);
    let e = DiskCache::open(
        Arc::new(Sealed(vdisk(4 * MIB, None))),
        &cfg(dir.path(), &small, 0),
        CacheType::DeviceDisk,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("sdc-small") && e.to_string().contains("use ram-overflow"),
        "{e}"
    );
}

/// A real block device: a loop device over a file of old bytes (root only; elsewhere the
/// file tests above stand in). Opened exclusively: a second cache on it is refused.
#[test]
fn a_loop_device_holds_the_overflow_and_is_held_exclusively() {
    let dir = tempfile::tempdir().unwrap();
    let backing = stale_device(dir.path(), "loop-backing", 8 * MIB);
    let out = std::process::Command::new("losetup")
        .args(["--find", "--show"])
        .arg(&backing)
        .output();
    let Some(loopdev) = out
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    else {
        eprintln!("no loop device here (not root, or no losetup): the file tests stand in");
        return;
    };
    struct Detach(String);
    impl Drop for Detach {
        fn drop(&mut self) {
            let _ = std::process::Command::new("losetup")
                .args(["-d", &self.0])
                .status();
        }
    }
    let _detach = Detach(loopdev.clone());
    let dev = PathBuf::from(&loopdev);
    let lower = vdisk(32 * MIB, Some(3));
    let c = RamOverflowCache::open(Arc::new(Sealed(lower)), &cfg(dir.path(), &dev, 0)).unwrap();
    for i in 0..4u64 {
        c.write_at(
            &pattern_buf(i as u8 + 1, 0, 8192),
            i * 2 * MIB + 4096,
            false,
        )
        .unwrap();
    }
    let e = c
        .write_at(&pattern_buf(9, 0, 4096), 8 * MIB, false)
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::NoSpace, "8 MiB of device: four units");
    assert_eq!(c.overflow_units(), 4);
    for i in 0..4u64 {
        let mut got = vec![0u8; 8192];
        c.read_at(&mut got, i * 2 * MIB + 4096).unwrap();
        assert_eq!(got, pattern_buf(i as u8 + 1, 0, 8192));
    }
    let e = RamOverflowCache::open(
        Arc::new(Sealed(vdisk(MIB, None))),
        &cfg(dir.path(), &dev, 0),
    )
    .unwrap_err();
    assert!(
        e.to_string().contains(&loopdev) && e.to_string().contains("in use"),
        "{e}"
    );
    drop(c);
    // device-disk with O_DIRECT on the real device.
    let d = DiskCache::open(
        Arc::new(Sealed(vdisk(8 * MIB, Some(4)))),
        &cfg(dir.path(), &dev, 0),
        CacheType::DeviceDisk,
    )
    .unwrap();
    d.write_at(&pattern_buf(6, 0, 10_000), 12_345, false)
        .unwrap();
    let mut got = vec![0u8; 10_000];
    d.read_at(&mut got, 12_345).unwrap();
    assert_eq!(got, pattern_buf(6, 0, 10_000));
    let mut base = vec![0u8; 4096];
    d.read_at(&mut base, 6 * MIB).unwrap();
    assert_eq!(
        base,
        pattern_buf(4, 6 * MIB, 4096),
        "unwritten pages come from the vDisk, not the device's old bytes"
    );
}
