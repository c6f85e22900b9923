//! The write side of [`Qcow2Image`]: writes, zeroes/trims, flush.
//!
//! A write to a cluster that is already a normal cluster with refcount 1 (`COPIED`) is a
//! plain `pwrite` outside the metadata lock. Anything else (unallocated, zero, compressed,
//! shared) takes the lock, looks again, and allocates: a new cluster at the end of the
//! file gets the cluster's old contents (copy-on-write from the backing device, the zero
//! state or the compressed data, for the parts the write does not cover) plus the new
//! bytes, then the L2 entry points at it (an L2 table is allocated when the L1 entry is
//! empty), then the old host cluster, if any, loses its reference.
//!
//! Zeroes and trims: whole clusters become zero clusters (v3 `ZERO` flag, no host cluster)
//! when there is a backing device, and unallocated when there is none; their old host
//! clusters are freed (and the file space punched). Partial clusters get written zeros,
//! unless they already read as zeros.
//!
//! Crash-safe ordering, all at flush (and when a dirty L2 table is evicted):
//! ```text
//!   data clusters (written at once) ┐
//!   refcount blocks, refcount table ├─ fdatasync ─ header (if the table moved)
//!                                   ┘              dirty L2 tables ─ fdatasync ─ L1 entries ─ fdatasync
//! ```
//! so an L2 entry is never durable before the data it points at or the refcount that
//! counts it, and an L1 entry never before its L2 table. A crash in between leaves at most
//! leaked clusters (counted, unreferenced), which `qemu-img check` reports as leaks, not
//! errors.

use std::os::unix::io::AsRawFd;

use vdstream_blockdev::span::units;
use vdstream_blockdev::{check_range, Error, ErrorKind, Op, Result};

use crate::image::{rc_error, Mapping, Meta, Qcow2Image, RunKind, COPIED, OFFSET_MASK, ZERO_FLAG};

impl Qcow2Image {
    fn check_writable(&self, op: Op, offset: u64, len: u64) -> Result<()> {
        check_range(self.size_bytes(), op, offset, len, &|| self.name())?;
        if self.read_only {
            return Err(Error::new(
                ErrorKind::ReadOnly,
                op,
                offset,
                len,
                self.name(),
                "the image is open read-only",
            ));
        }
        Ok(())
    }

    fn size_bytes(&self) -> u64 {
        self.header.size
    }

    pub(crate) fn write_impl(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.check_writable(Op::Write, offset, buf.len() as u64)?;
        let cs = self.cs();
        for p in units(offset, buf.len() as u64, cs) {
            let data = &buf[p.pos..p.pos + p.len];
            let fast = match self.lookup(&mut self.lock(), p.index, Op::Write)? {
                Mapping::Data { host, copied: true } => Some(host),
                _ => None,
            };
            match fast {
                Some(host) => self.pwrite(data, host + p.within as u64, offset + p.pos as u64)?,
                None => {
                    let mut meta = self.lock();
                    self.write_cluster_locked(&mut meta, p.index, p.within, data)?;
                }
            }
        }
        if fua {
            self.flush_impl()?;
        }
        Ok(())
    }

    fn pwrite(&self, data: &[u8], host: u64, guest: u64) -> Result<()> {
        self.file
            .write_all_at(data, host)
            .map_err(|e| self.io(e, Op::Write, guest, data.len() as u64))
    }

    /// Writes `data` at `within` of guest cluster `idx`, allocating it when needed.
    fn write_cluster_locked(
        &self,
        meta: &mut Meta,
        idx: u64,
        within: usize,
        data: &[u8],
    ) -> Result<()> {
        let cs = self.cs();
        let guest = idx * cs;
        let old = self.lookup(meta, idx, Op::Write)?;
        if let Mapping::Data { host, copied: true } = old {
            // Another writer allocated it while we waited for the lock.
            return self.pwrite(data, host + within as u64, guest + within as u64);
        }
        let valid = cs.min(self.size_bytes() - guest) as usize;
        let new = self.alloc(meta, 1)?;
        if within == 0 && data.len() == cs as usize {
            self.pwrite(data, new, guest)?;
        } else {
            let mut cluster = vec![0u8; cs as usize];
            if !(within == 0 && data.len() == valid) {
                self.read_mapping(old, &mut cluster[..valid], guest)?;
            }
            cluster[within..within + data.len()].copy_from_slice(data);
            self.pwrite(&cluster, new, guest)?;
        }
        self.set_l2(meta, idx, new | COPIED)?;
        self.release(meta, old)
    }

    /// Reads what a cluster holds under `mapping` (for copy-on-write).
    fn read_mapping(&self, mapping: Mapping, buf: &mut [u8], guest: u64) -> Result<()> {
        let kind = match mapping {
            Mapping::Unallocated => RunKind::Backing,
            Mapping::Zero { .. } => RunKind::Zero,
            Mapping::Data { host, .. } => RunKind::Data(host),
            Mapping::Compressed { host, len, .. } => RunKind::Compressed {
                host,
                len,
                within: 0,
            },
        };
        self.read_run(kind, buf, guest, None)
    }

    fn alloc(&self, meta: &mut Meta, n: u64) -> Result<u64> {
        let rc = meta.rc.as_mut().expect("read-write images have refcounts");
        rc.alloc(&self.file, n)
            .map_err(|e| rc_error(e, Op::Write, &self.path))
    }

    /// Sets the L2 entry of guest cluster `idx`, allocating its L2 table if needed.
    fn set_l2(&self, meta: &mut Meta, idx: u64, entry: u64) -> Result<()> {
        let per = self.header.l2_entries();
        let l1i = (idx / per) as usize;
        let mut l2_off = meta.l1[l1i] & OFFSET_MASK;
        if l2_off == 0 {
            l2_off = self.alloc(meta, 1)?;
            self.evict_if_full(meta)?;
            meta.l2.insert(l2_off, vec![0; per as usize], true);
            meta.l1[l1i] = l2_off | COPIED;
            meta.l1_dirty.insert(l1i);
        } else if meta.l1[l1i] & COPIED == 0 {
            return Err(Error::new(ErrorKind::NotSupported, Op::Write, idx * self.cs(), 0, self.name(),
                "the L2 table is shared (refcount above 1, as with internal snapshots); vdstream does not write shared tables"));
        }
        self.l2_table(meta, l2_off, Op::Write)?[(idx % per) as usize] = entry;
        meta.l2.get_mut(l2_off).expect("loaded").dirty = true;
        Ok(())
    }

    /// Drops this layer's reference to the host cluster(s) behind `old`.
    fn release(&self, meta: &mut Meta, old: Mapping) -> Result<()> {
        let (off, len) = match old {
            Mapping::Unallocated | Mapping::Zero { host: 0 } => return Ok(()),
            Mapping::Zero { host } | Mapping::Data { host, .. } => (host, self.cs()),
            Mapping::Compressed { host, sectors, .. } => (host & !511, sectors * 512),
        };
        let rc = meta.rc.as_mut().expect("read-write images have refcounts");
        let freed = rc
            .free(&self.file, off, len)
            .map_err(|e| rc_error(e, Op::Write, &self.path))?;
        for host in freed {
            self.punch(host);
        }
        Ok(())
    }

    /// Gives a freed cluster's space back to the file system (best effort).
    fn punch(&self, host: u64) {
        let Ok(file) = self.file.local() else { return };
        // SAFETY: fallocate takes the descriptor `file` keeps open and integers only.
        let rc = unsafe {
            libc::fallocate(
                file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                host as i64,
                self.cs() as i64,
            )
        };
        if rc != 0 {
            log::debug!(
                "{}: punching freed cluster at {host}: {}",
                self.name(),
                std::io::Error::last_os_error()
            );
        }
    }

    pub(crate) fn zero_impl(&self, op: Op, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.check_writable(op, offset, len)?;
        let cs = self.cs();
        for p in units(offset, len, cs) {
            let guest = p.index * cs;
            let valid = cs.min(self.size_bytes() - guest) as usize;
            let whole = p.within == 0 && p.len == valid;
            let mut meta = self.lock();
            let old = self.lookup(&mut meta, p.index, op)?;
            let reads_zero = matches!(old, Mapping::Zero { .. })
                || (old == Mapping::Unallocated && self.backing.is_none());
            if whole && (self.backing.is_none() || self.header.version >= 3) {
                let target = if self.backing.is_none() {
                    Mapping::Unallocated
                } else {
                    Mapping::Zero { host: 0 }
                };
                if old == target {
                    continue;
                }
                let entry = if target == Mapping::Unallocated {
                    0
                } else {
                    ZERO_FLAG
                };
                let l1e = meta.l1[(p.index / self.header.l2_entries()) as usize];
                if entry == 0 && l1e & OFFSET_MASK == 0 {
                    continue;
                }
                self.set_l2(&mut meta, p.index, entry)?;
                self.release(&mut meta, old)?;
            } else if !reads_zero {
                let zeros = vec![0u8; p.len];
                self.write_cluster_locked(&mut meta, p.index, p.within, &zeros)?;
            }
        }
        if fua {
            self.flush_impl()?;
        }
        Ok(())
    }

    /// Writes dirty refcount blocks and table, then syncs. Called before any L2 table is
    /// written.
    pub(crate) fn write_refcounts_and_sync(&self, meta: &mut Meta) -> Result<()> {
        let Some(rc) = meta.rc.as_mut() else {
            return Ok(());
        };
        rc.write_dirty(&self.file)
            .map_err(|e| self.io(e, Op::Flush, 0, 0))?;
        self.file
            .sync_data()
            .map_err(|e| self.io(e, Op::Flush, 0, 0))?;
        if rc.take_table_moved() {
            let (off, clusters) = rc.table_location();
            let mut raw = [0u8; 12];
            raw[..8].copy_from_slice(&off.to_be_bytes());
            raw[8..].copy_from_slice(&clusters.to_be_bytes());
            self.file
                .write_all_at(&raw, 48)
                .map_err(|e| self.io(e, Op::Flush, 48, 12))?;
            self.file
                .sync_data()
                .map_err(|e| self.io(e, Op::Flush, 0, 0))?;
            // The header no longer points at the old table: free it.
            for (off, clusters) in rc.take_pending_free() {
                rc.free(&self.file, off, clusters * self.cs())
                    .map_err(|e| rc_error(e, Op::Flush, &self.path))?;
            }
            rc.write_dirty(&self.file)
                .map_err(|e| self.io(e, Op::Flush, 0, 0))?;
            self.file
                .sync_data()
                .map_err(|e| self.io(e, Op::Flush, 0, 0))?;
        }
        Ok(())
    }

    pub(crate) fn flush_impl(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        let mut meta = self.lock();
        let meta = &mut *meta;
        self.write_refcounts_and_sync(meta)?;
        let dirty = meta.l2.dirty_offsets();
        for &off in &dirty {
            let t = meta.l2.get_mut(off).expect("listed");
            let raw: Vec<u8> = t.entries.iter().flat_map(|e| e.to_be_bytes()).collect();
            self.file
                .write_all_at(&raw, off)
                .map_err(|e| self.io(e, Op::Flush, off, raw.len() as u64))?;
            t.dirty = false;
        }
        if !meta.l1_dirty.is_empty() {
            // Every L2 table written so far (here or on eviction) is durable before an L1
            // entry points at it.
            self.file
                .sync_data()
                .map_err(|e| self.io(e, Op::Flush, 0, 0))?;
            for i in std::mem::take(&mut meta.l1_dirty) {
                let at = self.header.l1_table_offset + i as u64 * 8;
                self.file
                    .write_all_at(&meta.l1[i].to_be_bytes(), at)
                    .map_err(|e| self.io(e, Op::Flush, at, 8))?;
            }
        }
        self.file
            .sync_data()
            .map_err(|e| self.io(e, Op::Flush, 0, 0))
    }
}

impl Drop for Qcow2Image {
    fn drop(&mut self) {
        if let Err(e) = self.flush_impl() {
            log::error!("{}: flushing metadata on close failed: {e}", self.name());
        }
    }
}
