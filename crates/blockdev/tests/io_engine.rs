//! The I/O engines of `vdstream_blockdev::engine`: both give `read_exact_at`/`write_all_at`
//! results (whole buffer, `UnexpectedEof` past the end, errno kinds), io_uring requests from
//! many threads at once all land where they should, a refused io_uring setup falls back to
//! `pread`/`pwrite`, and dropping a queue never hangs.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;

use vdstream_blockdev::uring::UringQueue;
use vdstream_blockdev::{IoEngine, IoEngineKind};

fn temp_dir() -> tempfile::TempDir {
    let base = std::env::var_os("CARGO_TARGET_TMPDIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    tempfile::tempdir_in(base).expect("a temporary directory")
}

/// A 4096-aligned buffer of `pages` pages.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Page([u8; 4096]);

fn page_of(tag: u64) -> Page {
    let mut p = Page([0; 4096]);
    for (i, w) in p.0.chunks_mut(8).enumerate() {
        w.copy_from_slice(&(tag ^ ((i as u64) << 48)).to_le_bytes());
    }
    p
}

fn open(path: &std::path::Path, direct: bool) -> File {
    let mut o = OpenOptions::new();
    o.read(true).write(true).create(true).truncate(false);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path).unwrap()
}

/// The engines to test: io_uring only where this kernel allows it.
fn engines() -> Vec<IoEngine> {
    let mut v = vec![IoEngine::open(IoEngineKind::Sync, "test")];
    match UringQueue::new("test") {
        Ok(q) => v.push(IoEngine::IoUring(q)),
        Err(e) => println!("io_uring unavailable here ({e}): testing the sync engine only"),
    }
    v
}

#[test]
fn both_engines_read_back_what_they_wrote_and_report_eof() {
    let dir = temp_dir();
    for engine in engines() {
        let kind = engine.kind();
        let f = open(&dir.path().join(format!("f-{kind}")), false);
        f.set_len(3 * 4096 + 100).unwrap();
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + 3) as u8).collect();
        engine.write_all_at(&f, &data, 1234).unwrap();
        let mut back = vec![0; data.len()];
        engine.read_exact_at(&f, &mut back, 1234).unwrap();
        assert_eq!(back, data, "{kind}");
        engine.read_exact_at(&f, &mut [], 1 << 40).unwrap();
        let mut past = vec![0; 4096];
        let e = engine.read_exact_at(&f, &mut past, 3 * 4096).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{kind}: {e}");
        let ro = OpenOptions::new()
            .read(true)
            .open(dir.path().join(format!("f-{kind}")))
            .unwrap();
        let e = engine.write_all_at(&ro, &data, 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADF), "{kind}: {e}");
    }
}

#[test]
fn many_threads_on_the_same_pages_lose_nothing() {
    let dir = temp_dir();
    for engine in engines() {
        let kind = engine.kind();
        let path = dir.path().join(format!("g-{kind}"));
        let direct = {
            let f = open(&path, true);
            f.set_len(64 * 4096).unwrap();
            let mut p = page_of(0);
            let probe = engine.read_exact_at(&f, &mut p.0, 0);
            probe.is_ok()
        };
        let file = Arc::new(open(&path, direct));
        let engine = Arc::new(engine);
        const THREADS: u64 = 48;
        const ROUNDS: u64 = 150;
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let (file, engine) = (file.clone(), engine.clone());
                s.spawn(move || {
                    let mut back = Page([0; 4096]);
                    for r in 0..ROUNDS {
                        // Its own page: read back exactly. A shared page (8 of them, all
                        // threads): whatever is read is one whole write of some thread.
                        let own = 8 + t;
                        let mine = page_of((t << 32) | r);
                        engine.write_all_at(&file, &mine.0, own * 4096).unwrap();
                        engine
                            .read_exact_at(&file, &mut back.0, own * 4096)
                            .unwrap();
                        assert!(
                            back.0 == mine.0,
                            "{kind}: thread {t} round {r} read another page's bytes"
                        );
                        let shared = (t + r) % 8;
                        engine
                            .write_all_at(
                                &file,
                                &page_of((1 << 63) | (t << 32) | r).0,
                                shared * 4096,
                            )
                            .unwrap();
                    }
                });
            }
        });
        let mut back = Page([0; 4096]);
        for p in 0..8u64 {
            engine.read_exact_at(&file, &mut back.0, p * 4096).unwrap();
            let tag = u64::from_le_bytes(back.0[..8].try_into().unwrap());
            assert!(
                back.0 == page_of(tag).0 && tag >> 63 == 1,
                "{kind}: shared page {p} is not one whole write"
            );
        }
        if let IoEngine::IoUring(q) = &*engine {
            assert!(!q.is_broken(), "the ring broke during the test");
        }
    }
}

#[test]
fn a_refused_io_uring_falls_back_to_pread_pwrite() {
    let dir = temp_dir();
    for errno in [libc::EPERM, libc::ENOSYS, libc::EINVAL] {
        let engine = IoEngine::from_setup(IoEngineKind::IoUring, "refused", || {
            Err(io::Error::from_raw_os_error(errno))
        });
        assert_eq!(engine.kind(), IoEngineKind::Sync);
        let f = open(&dir.path().join("h"), false);
        engine.write_all_at(&f, b"still works", 10).unwrap();
        let mut back = [0; 11];
        engine.read_exact_at(&f, &mut back, 10).unwrap();
        assert_eq!(&back, b"still works");
    }
    assert_eq!(
        IoEngine::open(IoEngineKind::Sync, "s").kind(),
        IoEngineKind::Sync
    );
}

#[test]
fn queues_come_and_go_without_hanging() {
    let dir = temp_dir();
    let f = open(&dir.path().join("q"), false);
    for i in 0..50u8 {
        let Ok(q) = UringQueue::new("churn") else {
            return;
        };
        if i % 2 == 0 {
            q.write(std::os::fd::AsRawFd::as_raw_fd(&f), &[i; 100], 0)
                .unwrap()
                .unwrap();
        }
        drop(q);
    }
}

#[test]
fn engine_names_parse() {
    for k in [IoEngineKind::Sync, IoEngineKind::IoUring] {
        assert_eq!(k.name().parse::<IoEngineKind>().unwrap(), k);
    }
    assert!("aio".parse::<IoEngineKind>().is_err());
}
