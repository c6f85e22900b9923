//! Runs the conformance suite (see `src/conformance.rs`) on every device this crate
//! provides: `MemoryDev`, `FileDev` buffered, `FileDev` with `O_DIRECT` (skipped, with the
//! reason printed, where the file system refuses it), `FileDev` read-only, and `TraceDev`
//! (the recording wrapper) over a `MemoryDev`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use vdstream_blockdev::conformance::{self, model};
use vdstream_blockdev::{BlockDev, ErrorKind, FileDev, FileOptions, MemoryDev};

fn memory(size: u64) -> Arc<dyn BlockDev> {
    Arc::new(MemoryDev::new(size))
}

/// A constructor of fresh image files in one temporary directory (removed on drop).
struct Images {
    dir: tempfile::TempDir,
    next: AtomicUsize,
}

impl Images {
    /// Images in a fresh directory under the system temporary directory (`TMPDIR`, else
    /// /tmp); O_DIRECT needs it to be a disk file system, not tmpfs, or those tests skip.
    fn new() -> Images {
        Images {
            dir: tempfile::tempdir().expect("a temporary directory"),
            next: AtomicUsize::new(0),
        }
    }

    fn path(&self) -> std::path::PathBuf {
        self.dir.path().join(format!(
            "img{}.raw",
            self.next.fetch_add(1, Ordering::Relaxed)
        ))
    }

    fn create(&self, size: u64, options: FileOptions) -> Result<FileDev, vdstream_blockdev::Error> {
        let path = self.path();
        FileDev::create(&path, size)?;
        FileDev::open(&path, options)
    }

    fn with_content(&self, content: &[u8], options: FileOptions) -> FileDev {
        let path = self.path();
        std::fs::write(&path, content).expect("writing an image");
        FileDev::open(&path, options).expect("opening an image")
    }
}

const DIRECT: FileOptions = FileOptions {
    read_only: false,
    direct: true,
};

/// Whether O_DIRECT works here; prints why not if it doesn't.
fn direct_works(images: &Images) -> bool {
    match images.create(1 << 20, DIRECT) {
        Ok(_) => true,
        Err(e) if e.kind == ErrorKind::NotSupported => {
            eprintln!("SKIPPED: FileDev O_DIRECT conformance: {e}");
            false
        }
        Err(e) => panic!("opening an O_DIRECT image failed in an unexpected way: {e}"),
    }
}

#[test]
fn memory_dev_conforms() {
    conformance::run_all("MemoryDev", &memory);
}

#[test]
fn memory_dev_matches_the_model() {
    model::model_check("MemoryDev", &memory, Default::default());
}

#[test]
fn memory_dev_matches_the_model_concurrently() {
    model::model_check_concurrent("MemoryDev", &memory, Default::default());
}

#[test]
fn file_dev_conforms() {
    let images = Images::new();
    conformance::run_all("FileDev", &|size| {
        Arc::new(images.create(size, FileOptions::default()).unwrap())
    });
}

#[test]
fn file_dev_matches_the_model() {
    let images = Images::new();
    let make = |size| -> Arc<dyn BlockDev> {
        Arc::new(images.create(size, FileOptions::default()).unwrap())
    };
    model::model_check("FileDev", &make, Default::default());
    model::model_check_concurrent("FileDev", &make, Default::default());
}

#[test]
fn file_dev_direct_conforms() {
    let images = Images::new();
    if !direct_works(&images) {
        return;
    }
    conformance::run_all("FileDev(O_DIRECT)", &|size| {
        Arc::new(images.create(size, DIRECT).unwrap())
    });
}

#[test]
fn file_dev_direct_matches_the_model() {
    let images = Images::new();
    if !direct_works(&images) {
        return;
    }
    let make = |size| -> Arc<dyn BlockDev> { Arc::new(images.create(size, DIRECT).unwrap()) };
    let cfg = model::ModelConfig {
        cases: 24,
        ..Default::default()
    };
    model::model_check("FileDev(O_DIRECT)", &make, cfg.clone());
    model::model_check_concurrent("FileDev(O_DIRECT)", &make, cfg);
}

#[test]
fn file_dev_read_only_conforms() {
    let images = Images::new();
    let ro = FileOptions {
        read_only: true,
        direct: false,
    };
    conformance::run_read_only("FileDev(read-only)", &|content| {
        Arc::new(images.with_content(content, ro.clone()))
    });
    if direct_works(&images) {
        let ro_direct = FileOptions {
            read_only: true,
            direct: true,
        };
        conformance::run_read_only("FileDev(read-only, O_DIRECT)", &|content| {
            Arc::new(images.with_content(content, ro_direct.clone()))
        });
    }
}

#[test]
fn file_dev_open_errors_say_what_to_do() {
    let images = Images::new();
    let missing = images.dir.path().join("no-such.raw");
    let e = FileDev::open(&missing, FileOptions::default()).unwrap_err();
    assert!(
        e.to_string().contains("no-such.raw") && e.to_string().contains("check the path"),
        "{e}"
    );
    let e = FileDev::open(
        images.dir.path(),
        FileOptions {
            read_only: true,
            direct: false,
        },
    )
    .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Invalid, "{e}");
}

#[test]
fn trace_dev_conforms() {
    // Recording must not change what the device below answers.
    let images = Images::new();
    conformance::run_all("TraceDev(MemoryDev)", &|size| {
        let dev = vdstream_blockdev::TraceDev::create(memory(size), &images.path())
            .expect("a trace file");
        Arc::new(dev) as Arc<dyn BlockDev>
    });
}
