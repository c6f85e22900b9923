//! `private`: the conformance suite and model checks over a raw vDisk file, the one-writer
//! lock, and the refusal of a read-only vDisk.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use vdstream_blockdev::conformance::{self, model, pattern_buf};
use vdstream_blockdev::{BlockDev, ErrorKind, FileDev, FileOptions};
use vdstream_wcache::private::PrivateDev;
use vdstream_wcache::{CacheConfig, WriteCache};

struct Images {
    dir: tempfile::TempDir,
    next: AtomicUsize,
}

impl Images {
    fn new() -> Images {
        let base = std::env::var_os("CARGO_TARGET_TMPDIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        Images {
            dir: tempfile::tempdir_in(base).unwrap(),
            next: AtomicUsize::new(0),
        }
    }

    /// A fresh vDisk file of `size` bytes (zeros, or the pattern of `seed`).
    fn vdisk(&self, size: u64, seed: Option<u8>) -> PathBuf {
        let path = self.dir.path().join(format!(
            "vdisk{}.raw",
            self.next.fetch_add(1, Ordering::Relaxed)
        ));
        match seed {
            None => drop(FileDev::create(&path, size).unwrap()),
            Some(s) => std::fs::write(&path, pattern_buf(s, 0, size as usize)).unwrap(),
        }
        path
    }
}

fn private_over(path: &std::path::Path) -> vdstream_blockdev::Result<PrivateDev> {
    let lower = Arc::new(FileDev::open(path, FileOptions::default()).unwrap());
    PrivateDev::open(
        lower,
        &CacheConfig {
            lock_path: Some(path.to_path_buf()),
            ..CacheConfig::new("t1")
        },
    )
}

#[test]
fn private_conforms() {
    let images = Images::new();
    conformance::run_all("private", &|size| {
        Arc::new(private_over(&images.vdisk(size, None)).unwrap())
    });
}

#[test]
fn private_matches_the_model() {
    let images = Images::new();
    for seed in [None, Some(0x2d)] {
        let make = |size| -> Arc<dyn BlockDev> {
            Arc::new(private_over(&images.vdisk(size, seed)).unwrap())
        };
        let cfg = model::ModelConfig {
            cases: 32,
            initial_seed: seed,
            ..Default::default()
        };
        model::model_check("private", &make, cfg.clone());
        model::model_check_concurrent("private", &make, model::ModelConfig { cases: 16, ..cfg });
    }
}

#[test]
fn a_second_writer_is_refused_until_the_first_closes() {
    let images = Images::new();
    let path = images.vdisk(1 << 20, None);
    let first = private_over(&path).unwrap();
    let err = private_over(&path).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()) && msg.contains("in use by another writer"),
        "{msg}"
    );
    // Writes land in the vDisk itself and are counted as vDisk I/O.
    first.write_at(&[7u8; 4096], 4096, false).unwrap();
    first.flush().unwrap();
    let s = first.stats();
    assert_eq!(
        (
            s.vdisk_write_ops,
            s.vdisk_write_bytes,
            s.guest_write_ops,
            s.storage_flushes
        ),
        (1, 4096, 1, 1)
    );
    drop(first);
    assert_eq!(&std::fs::read(&path).unwrap()[4096..8192], &[7u8; 4096][..]);
    let again = private_over(&path).expect("the lock goes with the first writer");
    let mut buf = [0u8; 10];
    again.read_at(&mut buf, 4096).unwrap();
    assert_eq!(buf, [7u8; 10]);
    assert_eq!(again.stats().vdisk_read_bytes, 10);
}

#[test]
fn a_read_only_vdisk_or_a_missing_lock_path_is_refused() {
    let images = Images::new();
    let path = images.vdisk(1 << 20, None);
    let ro = Arc::new(
        FileDev::open(
            &path,
            FileOptions {
                read_only: true,
                direct: false,
            },
        )
        .unwrap(),
    );
    let cfg = CacheConfig {
        lock_path: Some(path.clone()),
        ..CacheConfig::new("t1")
    };
    let err = PrivateDev::open(ro.clone(), &cfg).unwrap_err();
    assert_eq!(err.kind, ErrorKind::ReadOnly);
    assert!(err.to_string().contains("read-only"), "{err}");
    let err = PrivateDev::open(ro, &CacheConfig::new("t1")).unwrap_err();
    assert!(err.to_string().contains("lock path"), "{err}");
}
