//! The blockdev conformance suite and model checks on fresh qcow2 images created by us,
//! with and without a backing file; every image must then pass `qemu-img check`.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use vdstream_blockdev::conformance::{self, model, pattern_buf};
use vdstream_blockdev::BlockDev;
use vdstream_qcow2::{create, open_chain, ImageFormat, OpenOptions, Qcow2Image};

static N: AtomicUsize = AtomicUsize::new(0);

fn rw() -> OpenOptions {
    OpenOptions {
        read_only: false,
        l2_cache_bytes: 4 * 4096,
    }
}

/// A fresh image in `dir`; `base_seed` puts a raw backing file of that pattern under it.
fn fresh(
    dir: &std::path::Path,
    size: u64,
    base_seed: Option<u8>,
    cluster_bits: u32,
) -> Arc<dyn BlockDev> {
    let n = N.fetch_add(1, Ordering::Relaxed);
    let path = dir.join(format!("img{n}.qcow2"));
    match base_seed {
        Some(seed) => {
            let base = format!("base{n}.raw");
            std::fs::write(dir.join(&base), pattern_buf(seed, 0, size as usize)).unwrap();
            create(&path, size, Some((&base, ImageFormat::Raw)), cluster_bits).unwrap();
            Arc::new(Qcow2Image::open_with_backing_chain(&path, rw()).unwrap())
        }
        None => {
            create(&path, size, None, cluster_bits).unwrap();
            Arc::new(Qcow2Image::open(&path, rw(), None).unwrap())
        }
    }
}

/// Every image left in `dir` passes qemu-img check.
fn check_all(dir: &std::path::Path) {
    let mut checked = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "qcow2") {
            common::assert_clean(&p);
            checked += 1;
        }
    }
    assert!(checked > 0);
}

#[test]
fn conformance_suite() {
    let dir = tempfile::tempdir().unwrap();
    let make = |size| fresh(dir.path(), size, None, 16);
    conformance::run_all("qcow2", &make);
    let make_small = |size| fresh(dir.path(), size, None, 12);
    conformance::run_all("qcow2 4k clusters", &make_small);
    check_all(dir.path());
}

#[test]
fn conformance_suite_over_backing_file_of_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let make = |size| fresh(dir.path(), size, Some(0), 16);
    conformance::run_all("qcow2 over raw", &make);
    check_all(dir.path());
}

#[test]
fn model_check() {
    let dir = tempfile::tempdir().unwrap();
    let make = |size| fresh(dir.path(), size, None, 16);
    model::model_check(
        "qcow2",
        &make,
        model::ModelConfig {
            cases: 12,
            ..Default::default()
        },
    );
    model::model_check_concurrent(
        "qcow2",
        &make,
        model::ModelConfig {
            cases: 6,
            ..Default::default()
        },
    );
    check_all(dir.path());
}

#[test]
fn model_check_over_backing_file() {
    let dir = tempfile::tempdir().unwrap();
    let make = |size| fresh(dir.path(), size, Some(0x3c), 15);
    let cfg = model::ModelConfig {
        cases: 12,
        initial_seed: Some(0x3c),
        ..Default::default()
    };
    model::model_check("qcow2 over random base", &make, cfg.clone());
    model::model_check_concurrent(
        "qcow2 over random base",
        &make,
        model::ModelConfig { cases: 6, ..cfg },
    );
    check_all(dir.path());
}

#[test]
fn read_only_open_refuses_writes_and_single_writer_lock() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.qcow2");
    create(&p, 1 << 20, None, 16).unwrap();
    let ro = open_chain(&p).unwrap();
    let e = ro.write_at(&[1], 0, false).unwrap_err();
    assert_eq!(e.kind, vdstream_blockdev::ErrorKind::ReadOnly);
    // A writer is refused while a reader holds it, and a second writer while one writes.
    assert!(Qcow2Image::open(&p, rw(), None).is_err());
    drop(ro);
    let w = Qcow2Image::open(&p, rw(), None).unwrap();
    let e = Qcow2Image::open(&p, rw(), None).unwrap_err();
    assert!(e.to_string().contains("already open"), "{e}");
    drop(w);
}
