//! `device-disk-persistent` and `server-persistent`: the disk cache of [`crate::disk`] made
//! to survive a restart. Opening with the same `cfg.dir` and `cfg.target` reopens the same
//! cache; every write acknowledged before a completed FLUSH (or written with FUA) survives
//! kill -9 and power loss; a crash at any point leaves a consistent cache.
//!
//! Files, in `cfg.dir`, named from the sanitized target id (`<stem>` = [`crate::disk::file_stem`]):
//!
//! | file              | holds                                                          |
//! | ----------------- | -------------------------------------------------------------- |
//! | `<stem>.vdcache`  | the pages, page p at p·4096 (sparse); `flock`ed while open      |
//! | `<stem>.vdmap`    | the [`Checkpoint`]: the whole page map at one flush, the vDisk's size and identity |
//! | `<stem>.vdjournal`| the [`Journal`]: page-state changes of each flush since then    |
//!
//! Flush ordering (crucible's `pre_flush` / `flush_inner` / `post_flush`), one flush at a
//! time:
//!
//! | step          | does                                                          | a crash after it leaves                       |
//! | ------------- | ------------------------------------------------------------- | --------------------------------------------- |
//! | `pre_flush`   | takes the set of pages whose state changed, with their states | nothing on disk changed                       |
//! | `flush_inner` | 1. `fdatasync(data)`                                          | new bytes durable, map on disk still old: old pages read as before (absent → vDisk, zero → zeros, data → old or new bytes) |
//! |               | 2. append the changes as checksummed, numbered records; `fdatasync(journal)` | a torn record is dropped at replay; a whole one says *data* only for pages already synced in 1 |
//! | `post_flush`  | apply the changes to the durable map; when the journal is long, write a checkpoint of it (tmp, fsync, rename, fsync folder), then empty the journal | a checkpoint is whole or absent; journal records it already holds are skipped by sequence number |
//!
//! Why it is safe: a page becomes *data* in the live map only after its bytes are written
//! (see [`crate::disk`]), and the change set is taken *before* step 1, so every page a
//! journal record calls *data* had its bytes synced first. A page written after the last
//! flush may read back old or new after a crash, never another page's bytes. Trim/zero
//! changes need no data sync (zero pages are never read from the file). At open, replay
//! stops at the first torn or bad record, the journal is cut there, and every page the map
//! does not call *data* is punched, so blocks of unflushed writes are given back.
//!
//! Space: a flush must not need space the data writes may have taken, or a cache whose file
//! system fills would fail every flush after (the ENOSPC belongs to the writes that did not
//! fit, each refused itself). So the journal appends into blocks it reserved ahead (see
//! [`crate::journal`]); should an append still meet ENOSPC, the flush folds its changes into
//! a checkpoint instead (it needs the map's size, not the journal's); and a checkpoint that
//! is merely *due* and fails does not fail the flush, whose records are already durable: it
//! is logged (at most once a minute, with the folder and what to do) and tried again later.
//! A flush fails with ENOSPC only when neither the journal nor a checkpoint could be written;
//! the next flush retries every change, and nothing acknowledged before is lost.
//!
//! The checkpoint records the lower device's size and an identity string the caller may
//! pass ([`PersistentDiskCache::open_with_identity`]); a cache made for another vDisk is
//! refused. Corrupt metadata is refused with the file's name and what to do.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use vdstream_blockdev::{
    BatchIo, BatchOp, BlockDev, Caps, Error, ErrorKind, Op, Result, ZeroFlags,
};

use crate::cachefile::{try_lock_exclusive, CacheFile};
use crate::disk::DiskCache;
use crate::journal::{Checkpoint, Journal};
pub use crate::names::cache_paths;
use crate::page::{PAGE_SHIFT, PAGE_U64};
use crate::pagemap::{PageMap, PageState};
use crate::{CacheConfig, CacheType, StatsSnapshot, WriteCache};

/// Journal bytes past which a flush writes a checkpoint (at least; see `checkpoint_due`).
const CHECKPOINT_AFTER: u64 = 4 << 20;

/// The metadata side of the cache, owned by the flush path.
#[derive(Debug)]
struct Metadata {
    journal: Journal,
    /// The map as the files on disk describe it (checkpoint + journal).
    durable: PageMap,
    /// The last journal sequence number written.
    seq: u64,
}

/// A persistent disk write cache; see the module notes.
#[derive(Debug)]
pub struct PersistentDiskCache {
    cache: DiskCache,
    meta: Mutex<Metadata>,
    checkpoint_path: PathBuf,
    lower_size: u64,
    identity: String,
    /// Rate limit of the metadata space warnings.
    space_log: vdstream_blockdev::lograte::LogLimiter,
    /// Journal bytes past which a flush writes a checkpoint (at least the map's size).
    checkpoint_after: u64,
    /// Keeps the `flock` on the data file for the life of the cache.
    _lock: std::fs::File,
}

impl PersistentDiskCache {
    /// Opens the cache of `cfg.target` in `cfg.dir`, creating it empty if there is none.
    pub fn open(lower: Arc<dyn BlockDev>, cfg: &CacheConfig, kind: CacheType) -> Result<Self> {
        Self::open_with_identity(lower, cfg, kind, "")
    }

    /// Like [`open`](Self::open), and records `identity` (say, vDisk name and version) in a
    /// new cache, or refuses an existing cache made with another one. An empty identity on
    /// either side checks the size only.
    pub fn open_with_identity(
        lower: Arc<dyn BlockDev>,
        cfg: &CacheConfig,
        kind: CacheType,
        identity: &str,
    ) -> Result<Self> {
        let [data_path, cp_path, journal_path] = cache_paths(&cfg.dir, &cfg.target);
        let dir = cfg.dir.display().to_string();
        let open_err = |path: &Path, what: String| {
            Error::new(
                ErrorKind::Io,
                Op::Open,
                0,
                0,
                path.display().to_string(),
                what,
            )
        };
        let io_err = |path: &Path, e: std::io::Error| {
            let mut err = Error::from_io(e, Op::Open, 0, 0, path.display().to_string());
            err.message = format!("cache of target {} in {dir}: {}", cfg.target, err.message);
            err
        };
        let lock = vdstream_blockdev::storefile::open_rw(
            &data_path,
            vdstream_blockdev::storefile::PRIVATE,
        )
        .map_err(|e| io_err(&data_path, e))?;
        if !try_lock_exclusive(&lock).map_err(|e| io_err(&data_path, e))? {
            return Err(Error::new(
                ErrorKind::Invalid,
                Op::Open,
                0,
                0,
                data_path.display().to_string(),
                format!("the persistent cache of target {} in {dir} is in use by another open (this process or another): close that one first", cfg.target),
            ));
        }
        let size = lower.size();
        let pages = size.div_ceil(PAGE_U64);
        let corrupt = |path: &Path, why: &str| {
            open_err(
                path,
                format!(
                    "the persistent cache of target {} in {dir} is damaged: {why}; delete its files ({}.*) to start it empty \
                     (its unflushed and flushed writes are lost), or restore them from a backup",
                    cfg.target,
                    data_path.with_extension("").display()
                ),
            )
        };
        let (durable, journal, seq) = match Checkpoint::load(&cp_path)
            .map_err(|e| io_err(&cp_path, e))?
        {
            None => {
                // A new cache (or one whose creation never finished): start empty. The
                // checkpoint is written last, so its presence marks a complete cache.
                lock.set_len(0).map_err(|e| io_err(&data_path, e))?;
                let journal =
                    Journal::create(&journal_path).map_err(|e| io_err(&journal_path, e))?;
                let cp = Checkpoint {
                    seq: 0,
                    lower_size: size,
                    identity: identity.to_string(),
                    words: PageMap::new(pages).export_words(),
                };
                cp.store(&cp_path).map_err(|e| io_err(&cp_path, e))?;
                (PageMap::new(pages), journal, 0)
            }
            Some(bytes) => {
                let cp = Checkpoint::decode(&bytes).map_err(|why| corrupt(&cp_path, &why))?;
                if cp.lower_size != size
                    || (!cp.identity.is_empty() && !identity.is_empty() && cp.identity != identity)
                {
                    return Err(Error::new(
                        ErrorKind::Invalid,
                        Op::Open,
                        0,
                        0,
                        cp_path.display().to_string(),
                        format!(
                            "the cache in {dir} was made for a vDisk of {} bytes{}, not this one ({} of {size} bytes{}): \
                             delete it or choose another target",
                            cp.lower_size,
                            if cp.identity.is_empty() { String::new() } else { format!(" ({})", cp.identity) },
                            lower.describe(),
                            if identity.is_empty() { String::new() } else { format!(", {identity}") },
                        ),
                    ));
                }
                let durable = PageMap::new(pages);
                durable
                    .import_words(&cp.words)
                    .map_err(|why| corrupt(&cp_path, &why))?;
                let (journal, replay) = match Journal::open(&journal_path, cp.seq, pages) {
                    Ok(Some(found)) => found,
                    Ok(None) => {
                        log::warn!(
                            "{}: the journal is missing; the cache is as of its last checkpoint",
                            journal_path.display()
                        );
                        let j =
                            Journal::create(&journal_path).map_err(|e| io_err(&journal_path, e))?;
                        (j, Default::default())
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                        return Err(corrupt(&journal_path, &e.to_string()))
                    }
                    Err(e) => return Err(io_err(&journal_path, e)),
                };
                let mut journal = journal;
                if let Some(why) = &replay.stopped {
                    log::info!(
                        "{}: replay stopped at a torn tail ({why}); dropping it",
                        journal_path.display()
                    );
                    journal
                        .truncate_tail()
                        .map_err(|e| io_err(&journal_path, e))?;
                }
                for &(page, state) in &replay.changes {
                    durable.set(page, state);
                }
                (durable, journal, replay.last_seq.max(cp.seq))
            }
        };
        let mut journal = journal;
        if let Err(e) = journal.reserve() {
            log::warn!(
                "{}: cannot reserve {} bytes for the journal ({e}): a flush may fail with ENOSPC while the file system of {dir} is full; free space there",
                journal_path.display(),
                crate::journal::JOURNAL_RESERVE
            );
        }
        let file = CacheFile::open(
            &data_path,
            pages,
            !cfg.intermediate_buffering,
            true,
            false,
            cfg.io_engine,
        )?;
        give_back_unmapped(&file, &durable)?;
        let cache = DiskCache::with_file(lower, file, cfg, kind, true);
        cache
            .map()
            .import_words(&durable.export_words())
            .map_err(|why| corrupt(&cp_path, &why))?;
        cache.refresh_file_bytes();
        Ok(PersistentDiskCache {
            cache,
            meta: Mutex::new(Metadata {
                journal,
                durable,
                seq,
            }),
            checkpoint_path: cp_path,
            lower_size: size,
            identity: identity.to_string(),
            space_log: crate::space::full_log(),
            checkpoint_after: CHECKPOINT_AFTER,
            _lock: lock,
        })
    }

    /// The last journal sequence number made durable (grows with every flush that changed
    /// the map).
    /// The engine the cache file's pages go through (sync after a fallback).
    pub fn io_engine(&self) -> vdstream_blockdev::IoEngineKind {
        self.cache.io_engine()
    }

    /// Writes a checkpoint once the journal holds more than `bytes` (and more than the
    /// map's size) instead of the default 4 MiB: for tests of the checkpoint path.
    #[doc(hidden)]
    pub fn set_checkpoint_after(&mut self, bytes: u64) {
        self.checkpoint_after = bytes;
    }

    pub fn durable_seq(&self) -> u64 {
        self.meta.lock().unwrap_or_else(PoisonError::into_inner).seq
    }

    /// Flushes, then writes a checkpoint and empties the journal.
    pub fn checkpoint(&self) -> Result<()> {
        let mut meta = self.meta.lock().unwrap_or_else(PoisonError::into_inner);
        self.flush_locked(&mut meta)?;
        self.write_checkpoint(&mut meta)
    }

    /// `pre_flush`: the changed pages and their states now.
    fn pre_flush(&self) -> (Vec<(u64, PageState)>, bool) {
        let pages = self.cache.drain_changed();
        let unsynced = self.cache.take_unsynced();
        let map = self.cache.map();
        (
            pages.into_iter().map(|p| (p, map.get(p))).collect(),
            unsynced,
        )
    }

    /// `flush_inner`: data durable first, then the journal records naming it (or, when the
    /// journal cannot grow, a checkpoint holding them).
    fn flush_inner(
        &self,
        meta: &mut Metadata,
        changes: &[(u64, PageState)],
        unsynced: bool,
    ) -> Result<()> {
        if unsynced || !changes.is_empty() {
            self.cache.cache_file().sync_data()?;
            self.count_flush();
        }
        if changes.is_empty() {
            return Ok(());
        }
        let journal_err = |meta: &Metadata, e| {
            Error::from_io(
                e,
                Op::Flush,
                0,
                0,
                meta.journal.path().display().to_string(),
            )
        };
        match meta.journal.append(meta.seq, changes) {
            Ok(seq) => {
                meta.seq = seq;
                self.count_flush();
                self.keep_reserve(meta);
                Ok(())
            }
            Err(e)
                if e.raw_os_error() == Some(libc::ENOSPC)
                    || e.raw_os_error() == Some(libc::EDQUOT) =>
            {
                // Drop whatever the failed append left past the end, then put the changes in
                // a checkpoint instead (same sequence number: nothing in the journal names it).
                let err = journal_err(meta, e);
                meta.journal
                    .truncate_tail()
                    .map_err(|e| journal_err(meta, e))?;
                self.keep_reserve(meta);
                let before: Vec<(u64, PageState)> = changes
                    .iter()
                    .map(|&(p, _)| (p, meta.durable.get(p)))
                    .collect();
                for &(page, state) in changes {
                    meta.durable.set(page, state);
                }
                if let Err(cp) = self.write_checkpoint(meta) {
                    for &(page, state) in &before {
                        meta.durable.set(page, state);
                    }
                    self.warn_space(&format!(
                        "neither the journal ({err}) nor a checkpoint ({cp}) could be written"
                    ));
                    return Err(err);
                }
                Ok(())
            }
            Err(e) => Err(journal_err(meta, e)),
        }
    }

    /// `post_flush`: the durable map follows the journal; a checkpoint when it is due. The
    /// flush is complete before the checkpoint: one that fails is logged and tried again at
    /// a later flush.
    fn post_flush(&self, meta: &mut Metadata, changes: &[(u64, PageState)]) -> Result<()> {
        for &(page, state) in changes {
            meta.durable.set(page, state);
        }
        let map_bytes = meta.durable.pages().div_ceil(4);
        if meta.journal.len() > self.checkpoint_after.max(map_bytes) {
            if let Err(e) = self.write_checkpoint(meta) {
                self.warn_space(&format!("the checkpoint is due and could not be written ({e}); the journal keeps growing until it can"));
            }
        }
        Ok(())
    }

    /// Tops up the journal's reserved space; a failure is only logged (rate-limited).
    fn keep_reserve(&self, meta: &mut Metadata) {
        if let Err(e) = meta.journal.reserve() {
            self.warn_space(&format!(
                "cannot reserve space for the journal {} ({e})",
                meta.journal.path().display()
            ));
        }
    }

    /// One warning about the metadata's space, at most once a minute.
    fn warn_space(&self, what: &str) {
        self.space_log.log(
            log::Level::Warn,
            module_path!(),
            "metadata space",
            format_args!(
                "{}: {what}: the file system of {} is full or failing; writes that do not fit get ENOSPC and flushes may too: \
                 free space there, or trim unused space in the guest (fstrim)",
                self.describe(),
                self.cache.dir().display(),
            ),
        );
    }

    fn flush_locked(&self, meta: &mut Metadata) -> Result<()> {
        let (changes, unsynced) = self.pre_flush();
        if let Err(e) = self.flush_inner(meta, &changes, unsynced) {
            // Nothing of this flush counts: the next one retries every change.
            for &(page, _) in &changes {
                self.cache.mark_changed(page);
            }
            self.cache.mark_unsynced();
            return Err(e);
        }
        self.post_flush(meta, &changes)
    }

    fn write_checkpoint(&self, meta: &mut Metadata) -> Result<()> {
        let cp = Checkpoint {
            seq: meta.seq,
            lower_size: self.lower_size,
            identity: self.identity.clone(),
            words: meta.durable.export_words(),
        };
        let err = |e| {
            Error::from_io(
                e,
                Op::Flush,
                0,
                0,
                self.checkpoint_path.display().to_string(),
            )
        };
        cp.store(&self.checkpoint_path).map_err(err)?;
        self.count_flush();
        meta.journal.reset().map_err(|e| {
            Error::from_io(
                e,
                Op::Flush,
                0,
                0,
                meta.journal.path().display().to_string(),
            )
        })?;
        self.keep_reserve(meta);
        Ok(())
    }

    fn count_flush(&self) {
        self.cache
            .counters()
            .storage_flushes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn durable_if(&self, fua: bool) -> Result<()> {
        if fua {
            self.flush()?;
        }
        Ok(())
    }
}

/// Punches every run of pages `map` does not call data: blocks left by writes that were
/// never flushed, or by trims whose punch did not reach the disk.
fn give_back_unmapped(file: &CacheFile, map: &PageMap) -> Result<()> {
    let mut p = 0;
    while p < map.pages() {
        let (state, end) = map.run(p, map.pages());
        if state != PageState::Data {
            file.punch(p << PAGE_SHIFT, (end - p) << PAGE_SHIFT)?;
        }
        p = end;
    }
    Ok(())
}

impl Drop for PersistentDiskCache {
    fn drop(&mut self) {
        // A clean close leaves everything flushed and the journal folded into a checkpoint.
        let mut meta = self.meta.lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(e) = self.flush_locked(&mut meta) {
            log::warn!(
                "closing {}: {e}; writes since the last completed flush may be lost",
                self.describe()
            );
        } else if let Err(e) = self.write_checkpoint(&mut meta) {
            log::info!("closing {}: no checkpoint ({e}); the journal holds every flushed write and is replayed at the next open", self.describe());
        }
    }
}

/// The disk cache below does the I/O; this layer adds flush and FUA through the journal.
impl vdstream_blockdev::Filter for PersistentDiskCache {
    type Inner = DiskCache;

    fn inner(&self) -> &DiskCache {
        &self.cache
    }

    fn caps(&self) -> Caps {
        Caps {
            flush: true,
            fua: true,
            ..self.cache.caps()
        }
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.cache.write_at(buf, offset, false)?;
        self.durable_if(fua)
    }

    fn flush(&self) -> Result<()> {
        let mut meta = self.meta.lock().unwrap_or_else(PoisonError::into_inner);
        self.flush_locked(&mut meta)
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.cache.trim(offset, len, false)?;
        self.durable_if(fua)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.cache.write_zeroes(
            offset,
            len,
            ZeroFlags {
                fua: false,
                ..flags
            },
        )?;
        self.durable_if(flags.fua)
    }

    /// Without FUA to the disk cache, then one flush for the FUA writes (failed: every write fails).
    fn io_batch(&self, ops: &mut [BatchOp<'_>]) {
        let mut fua = false;
        for op in ops.iter_mut() {
            if let BatchIo::Write(_, f) = &mut op.io {
                fua |= std::mem::take(f);
            }
        }
        self.cache.io_batch(ops);
        if let Err(e) = self.durable_if(fua) {
            for op in ops
                .iter_mut()
                .filter(|op| op.is_write() && op.result.is_ok())
            {
                op.result = Err(Error::new(
                    e.kind,
                    Op::Write,
                    op.offset,
                    op.len() as u64,
                    e.device.clone(),
                    e.message.clone(),
                ));
            }
        }
    }
}

impl WriteCache for PersistentDiskCache {
    fn cache_type(&self) -> CacheType {
        self.cache.cache_type()
    }

    fn stats(&self) -> StatsSnapshot {
        self.cache.stats()
    }

    /// What the cache held at its open is not seen written again: it says what it holds.
    fn held(&self) -> Option<Vec<(u64, u64)>> {
        Some(self.cache.held_ranges())
    }
}
