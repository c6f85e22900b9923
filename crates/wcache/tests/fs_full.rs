//! Caches whose file system fills before their cap (issue 17, items 6 and 8a), on a real
//! small tmpfs mounted for the test (the tests need root; as another user they say so and
//! pass without running).
//!
//! - A persistent cache answers ENOSPC to the writes that do not fit, and only to them: a
//!   flush after them succeeds, so does a flush with no new writes, and every acknowledged
//!   write survives a reopen.
//! - Every cache type with a file counts a write the file system refused as "refused for
//!   space" (`nospace_errors`), as it counts one past its cap.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use vdstream_blockdev::conformance::pattern_buf;
use vdstream_blockdev::{BlockDev, ErrorKind, MemoryDev};
use vdstream_wcache::persistent::PersistentDiskCache;
use vdstream_wcache::{CacheConfig, CacheType, WriteCache};

const PAGE: usize = 4096;

/// A tmpfs of a given size, unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// `None` when not root (mounting needs it).
    fn mount(size: &str) -> Option<Tmpfs> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            println!("skipping: mounting a small tmpfs needs root");
            return None;
        }
        let dir = tempfile::tempdir().expect("a temporary directory");
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(dir.path())
            .output()
            .expect("mount runs");
        assert!(
            out.status.success(),
            "mount -t tmpfs: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(Tmpfs { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

fn lower(size: u64, seed: u8) -> Arc<dyn BlockDev> {
    let mem = MemoryDev::new(size);
    mem.write_at(&pattern_buf(seed, 0, size as usize), 0, false)
        .unwrap();
    Arc::new(mem)
}

fn page_of(p: u64) -> Vec<u8> {
    vec![(p % 251) as u8 + 1; PAGE]
}

fn config(dir: &Path, target: &str) -> CacheConfig {
    // tmpfs refuses O_DIRECT: write through the page cache.
    CacheConfig {
        dir: dir.to_path_buf(),
        intermediate_buffering: true,
        ram: 64 << 10,
        ..CacheConfig::new(target)
    }
}

/// Writes page after page from `first` until `want` writes were refused; returns the pages
/// written and how many were refused. Every refusal must be ENOSPC.
fn fill(dev: &dyn BlockDev, first: u64, want_refused: u64) -> (Vec<u64>, u64) {
    let pages = dev.size() / PAGE as u64;
    let (mut written, mut refused) = (Vec::new(), 0);
    let mut p = first;
    while p < pages && refused < want_refused {
        match dev.write_at(&page_of(p), p * PAGE as u64, false) {
            Ok(()) => written.push(p),
            Err(e) => {
                assert_eq!(
                    e.kind,
                    ErrorKind::NoSpace,
                    "a write that does not fit must fail with ENOSPC: {e}"
                );
                refused += 1;
            }
        }
        p += 1;
    }
    (written, refused)
}

#[test]
fn a_persistent_cache_on_a_full_file_system_keeps_flushing() {
    persistent_cache_on_a_full_file_system(None);
}

/// As above, with a checkpoint due at every flush (the journal is "long" at once): a
/// checkpoint that cannot be written must not fail the flush whose records are durable.
#[test]
fn a_due_checkpoint_that_does_not_fit_does_not_fail_the_flush() {
    persistent_cache_on_a_full_file_system(Some(0));
}

fn persistent_cache_on_a_full_file_system(checkpoint_after: Option<u64>) {
    let Some(fs) = Tmpfs::mount("4m") else { return };
    let size = 16 << 20;
    let low = lower(size, 0x5A);
    let cfg = config(fs.path(), "vm-full");
    let kind = CacheType::DeviceDiskPersistent;
    let mut cache = PersistentDiskCache::open(low.clone(), &cfg, kind).unwrap();
    if let Some(bytes) = checkpoint_after {
        cache.set_checkpoint_after(bytes);
    }
    let mut acked: Vec<u64> = (0..64).collect();
    for &p in &acked {
        cache.write_at(&page_of(p), p * PAGE as u64, false).unwrap();
    }
    cache.flush().unwrap();
    // Fill the file system with writes no flush has covered yet.
    let (written, refused) = fill(&cache, 64, 8);
    assert!(
        refused == 8,
        "a 4 MiB file system must fill before a 16 MiB disk is written"
    );
    assert!(written.len() > 100, "only {} pages fit", written.len());
    acked.extend(&written);
    // The acknowledged writes fit: a flush covering them succeeds, and so does one with no
    // new writes.
    cache
        .flush()
        .expect("a flush after writes that did not fit must succeed");
    cache
        .flush()
        .expect("a flush with no new writes must succeed");
    assert_eq!(
        cache.stats().nospace_errors,
        refused,
        "refused for space: the file system's ENOSPC counts"
    );
    // Still full: a new page is refused, an overwrite of a cached page works, flushes work.
    let (_, refused) = fill(&cache, written.last().unwrap() + 1, 1);
    assert_eq!(refused, 1);
    cache
        .write_at(&page_of(1000), 0, true)
        .expect("an overwrite needs no new space");
    cache.flush().expect("a flush after an overwrite");
    drop(cache);

    // Every acknowledged write survives the restart; refused pages read as the vDisk.
    let cache = PersistentDiskCache::open(low.clone(), &cfg, kind)
        .expect("the cache reopens on a full file system");
    let mut buf = vec![0u8; PAGE];
    cache.read_at(&mut buf, 0).unwrap();
    assert!(buf == page_of(1000), "page 0 holds its last write");
    for &p in &acked[1..] {
        cache.read_at(&mut buf, p * PAGE as u64).unwrap();
        assert!(buf == page_of(p), "acknowledged page {p} was lost");
    }
    let after = acked.last().unwrap() + 1;
    cache.read_at(&mut buf, after * PAGE as u64).unwrap();
    assert!(
        buf == pattern_buf(0x5A, after * PAGE as u64, PAGE),
        "a refused page reads as the vDisk"
    );
    // Reopened on the still full file system, it refuses new pages and keeps flushing.
    let (_, refused) = fill(&cache, after, 1);
    assert_eq!(refused, 1);
    cache
        .flush()
        .expect("a flush after a restart on a full file system");
    // Trimming gives the space back: new writes fit again.
    cache.trim(0, 64 * PAGE as u64, false).unwrap();
    cache.flush().unwrap();
    cache
        .write_at(&page_of(after), after * PAGE as u64, false)
        .expect("space given back by a trim is usable");
    cache.flush().unwrap();
}

#[test]
fn writes_the_file_system_refuses_count_as_refused_for_space() {
    let Some(fs) = Tmpfs::mount("2m") else { return };
    for kind in [
        CacheType::DeviceDisk,
        CacheType::RamOverflow,
        CacheType::DeviceDiskPersistent,
    ] {
        let dir: PathBuf = fs.path().join(kind.name());
        std::fs::create_dir(&dir).unwrap();
        let cache =
            vdstream_wcache::open(kind, lower(8 << 20, 1), &config(&dir, "vm-count")).unwrap();
        let (written, refused) = fill(&*cache, 0, 3);
        assert_eq!(
            refused,
            3,
            "{kind}: a 2 MiB file system must fill ({} pages written)",
            written.len()
        );
        assert_eq!(
            cache.stats().nospace_errors,
            3,
            "{kind}: every write the file system refused counts"
        );
        // Reads and overwrites keep working.
        let mut buf = vec![0u8; PAGE];
        cache.read_at(&mut buf, written[0] * PAGE as u64).unwrap();
        assert!(buf == page_of(written[0]), "{kind}");
        cache
            .write_at(&page_of(7), written[0] * PAGE as u64, false)
            .unwrap();
        drop(cache);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A flush whose changes outgrow the journal's reserve on a full file system (a guest that
/// zeroes most of a large disk) folds them into a checkpoint instead, and they survive.
#[test]
fn a_flush_too_big_for_the_journal_becomes_a_checkpoint() {
    let Some(fs) = Tmpfs::mount("4m") else { return };
    let size: u64 = 1 << 30;
    let mem = MemoryDev::new(size);
    mem.write_at(&pattern_buf(0x33, 0, 64 << 20), 0, false)
        .unwrap();
    let low: Arc<dyn BlockDev> = Arc::new(mem);
    let cfg = config(fs.path(), "vm-big");
    let kind = CacheType::DeviceDiskPersistent;
    let cache = PersistentDiskCache::open(low.clone(), &cfg, kind).unwrap();
    let (written, refused) = fill(&cache, 0, 1);
    assert_eq!(refused, 1);
    cache.flush().unwrap();
    // Give back 256 KiB: room for the 64 KiB map, not for the 2 MiB of journal records
    // that zeroing 1 GiB makes.
    cache.trim(0, 64 * PAGE as u64, false).unwrap();
    cache.flush().unwrap();
    cache
        .write_zeroes(16 << 20, size - (16 << 20), Default::default())
        .unwrap();
    cache
        .flush()
        .expect("a flush whose records do not fit the journal must fall back to a checkpoint");
    cache.flush().unwrap();
    drop(cache);
    let cache = PersistentDiskCache::open(low, &cfg, kind).unwrap();
    let mut buf = vec![0u8; PAGE];
    for &p in written
        .iter()
        .filter(|&&p| p >= 64 && p * (PAGE as u64) < (16 << 20))
    {
        cache.read_at(&mut buf, p * PAGE as u64).unwrap();
        assert!(buf == page_of(p), "page {p} was lost");
    }
    cache.read_at(&mut buf, 0).unwrap();
    assert!(buf.iter().all(|&b| b == 0), "a trimmed page reads as zeros");
    cache.read_at(&mut buf, 32 << 20).unwrap();
    assert!(
        buf.iter().all(|&b| b == 0),
        "a zeroed page reads as zeros, not the vDisk"
    );
}
