//! `OverflowFile`: the local-disk part of `ram-overflow`, allocated in 2 MiB units.
//!
//! Design notes.
//!
//! The file is a flat array of 2 MiB *units*. The cache cuts the guest disk into 2 MiB
//! *regions*; a region that has to spill gets one unit (the cache's block allocation table,
//! kept in [`crate::region_map`], maps region → unit), and page `i` of the region lives at
//! the fixed slot `unit * 2 MiB + i * 4 KiB`. So an evicted region is written with a few
//! large sequential writes, and no per-page metadata ever reaches the disk.
//!
//! The file is non-persistent: it is created fresh under a unique name in the configured
//! folder and unlinked at once, so it never outlives the process (not even a crash) and every
//! open starts empty. Freed pages are punched out (`FALLOC_FL_PUNCH_HOLE | KEEP_SIZE`);
//! a unit whose last page is freed is punched whole and goes back to the free list, lowest
//! unit first on reuse so that the file stays compact.
//!
//! Invariants:
//! - At most `max_units` units are handed out at once; past that [`OverflowFile::alloc_unit`]
//!   answers `None` and the cache answers ENOSPC for writes that need a new unit.
//! - A unit is in the free list or owned by exactly one region, never both.
//! - This type does no locking of page contents: the cache guarantees that no two writes of
//!   one slot are in flight, and that a unit is not released while I/O on it is in flight.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::page::{PageBuf, PAGE, PAGE_U64};

/// Bytes per unit of the overflow file (and per region of the guest disk).
pub const UNIT: u64 = 2 << 20;
/// Pages per unit.
pub const UNIT_PAGES: usize = (UNIT / PAGE_U64) as usize;

/// Which units are handed out.
#[derive(Debug, Default)]
struct UnitTable {
    /// Released units, reused lowest first.
    free: BTreeSet<u64>,
    /// Units `0..next` have been handed out at least once.
    next: u64,
    /// Units owned by a region now.
    in_use: u64,
}

/// The overflow file of one cache. See the module notes.
#[derive(Debug)]
pub struct OverflowFile {
    file: File,
    /// Where the file was created (it is unlinked): for messages.
    path: PathBuf,
    max_units: u64,
    units: Mutex<UnitTable>,
}

static SEQ: AtomicU64 = AtomicU64::new(0);

impl OverflowFile {
    /// Creates a fresh, empty overflow file in `dir` for `target`, capped at `max_units`.
    pub fn create(dir: &Path, target: &str, max_units: u64) -> io::Result<Self> {
        let safe: String = target
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .take(64)
            .collect();
        let name = format!(
            ".vdstream-overflow-{safe}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&path)?;
        // Unlinked at once: the file lives as long as the descriptor, and a crash leaves nothing.
        std::fs::remove_file(&path)?;
        Ok(OverflowFile {
            file,
            path,
            max_units,
            units: Mutex::new(UnitTable::default()),
        })
    }

    /// The overflow on a raw disk or partition (`--overflow-device`): opened exclusively,
    /// empty at every start (no slot is read before it is written), capped at `max_units`
    /// and at what the device holds. Returns it and the device's size in bytes.
    pub fn on_device(device: &Path, max_units: u64) -> io::Result<(Self, u64)> {
        let (file, size) = crate::device::open_exclusive(device, false)?;
        let max_units = max_units.min(size / UNIT);
        Ok((
            OverflowFile {
                file,
                path: device.to_path_buf(),
                max_units,
                units: Mutex::new(UnitTable::default()),
            },
            size,
        ))
    }

    /// Where the file was created, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Units owned by regions now.
    pub fn units_in_use(&self) -> u64 {
        self.table().in_use
    }

    fn table(&self) -> std::sync::MutexGuard<'_, UnitTable> {
        self.units.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Hands out a unit (a released one first), or `None` when the cap is reached.
    pub fn alloc_unit(&self) -> Option<u64> {
        let mut t = self.table();
        let unit = match t.free.pop_first() {
            Some(u) => u,
            None if t.next < self.max_units => {
                t.next += 1;
                t.next - 1
            }
            None => return None,
        };
        t.in_use += 1;
        Some(unit)
    }

    /// Gives a unit back: its space is punched out and it goes to the free list.
    pub fn release_unit(&self, unit: u64) {
        if let Err(e) = self.punch(unit * UNIT, UNIT) {
            log::debug!(
                "overflow file {}: punching unit {unit} failed: {e}",
                self.path.display()
            );
        }
        let mut t = self.table();
        debug_assert!(!t.free.contains(&unit));
        t.free.insert(unit);
        t.in_use -= 1;
    }

    /// File offset of page `slot` of `unit`.
    pub fn slot_offset(unit: u64, slot: usize) -> u64 {
        unit * UNIT + slot as u64 * PAGE_U64
    }

    /// Reads `buf.len()` bytes at `offset` (a run of slots, or part of one).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    /// Writes one page into its slot.
    pub fn write_slot(&self, unit: u64, slot: usize, page: &PageBuf) -> io::Result<()> {
        self.file.write_all_at(page, Self::slot_offset(unit, slot))
    }

    /// Writes consecutive pages to consecutive slots from `first_slot` with one `pwritev`
    /// (repeated only after a short write).
    pub fn write_run(&self, unit: u64, first_slot: usize, pages: &[&PageBuf]) -> io::Result<()> {
        debug_assert!(first_slot + pages.len() <= UNIT_PAGES);
        let mut offset = Self::slot_offset(unit, first_slot);
        let mut done = 0usize; // pages fully written
        let mut partial = 0usize; // bytes of pages[done] already written
        while done < pages.len() {
            let iov: Vec<libc::iovec> = pages[done..]
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let skip = if i == 0 { partial } else { 0 };
                    libc::iovec {
                        iov_base: p[skip..].as_ptr() as *mut libc::c_void,
                        iov_len: PAGE - skip,
                    }
                })
                .collect();
            // SAFETY: every iovec points into a live page borrowed for the whole call, with
            // its exact remaining length; pwritev only reads from them. The count is at most
            // UNIT_PAGES (512), below IOV_MAX (1024).
            let n = unsafe {
                libc::pwritev(
                    self.file.as_raw_fd(),
                    iov.as_ptr(),
                    iov.len() as libc::c_int,
                    offset as libc::off_t,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "pwritev wrote nothing",
                ));
            }
            let n = n as usize;
            offset += n as u64;
            let total = partial + n;
            done += total / PAGE;
            partial = total % PAGE;
        }
        Ok(())
    }

    /// Frees the space of `[offset, offset+len)`; it reads as zeros afterwards. A filesystem
    /// without hole punching just keeps the space (the cache never reads a freed slot).
    pub fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        // SAFETY: fallocate on a descriptor we own; no memory is passed.
        let r = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => Ok(()),
            _ => Err(e),
        }
    }

    /// Bytes the file occupies on disk now (allocated blocks), for tests and reports.
    pub fn disk_bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        self.file.metadata().map(|m| m.blocks() * 512).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_are_capped_reused_lowest_first_and_runs_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let f = OverflowFile::create(dir.path(), "t/1", 3).unwrap();
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "the file is unlinked at once"
        );
        let (a, b, c) = (
            f.alloc_unit().unwrap(),
            f.alloc_unit().unwrap(),
            f.alloc_unit().unwrap(),
        );
        assert_eq!((a, b, c), (0, 1, 2));
        assert_eq!(f.alloc_unit(), None);
        let p1: Box<PageBuf> = Box::new([1u8; PAGE]);
        let p2: Box<PageBuf> = Box::new([2u8; PAGE]);
        f.write_run(b, 10, &[&p1, &p2]).unwrap();
        let mut got = vec![0u8; 2 * PAGE];
        f.read_at(&mut got, OverflowFile::slot_offset(b, 10))
            .unwrap();
        assert!(got[..PAGE].iter().all(|&x| x == 1) && got[PAGE..].iter().all(|&x| x == 2));
        f.release_unit(c);
        f.release_unit(a);
        assert_eq!(f.units_in_use(), 1);
        assert_eq!(f.alloc_unit(), Some(0));
        f.release_unit(b);
        let mut page = vec![9u8; PAGE];
        f.read_at(&mut page, OverflowFile::slot_offset(b, 10))
            .unwrap();
        assert!(page.iter().all(|&x| x == 0), "a released unit is punched");
    }
}
