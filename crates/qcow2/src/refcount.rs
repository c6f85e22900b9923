//! Refcounts and cluster allocation for read-write images.
//!
//! qcow2 counts the references to every host cluster in refcount blocks (one cluster each,
//! `refcount_bits`-wide big-endian entries) listed by the refcount table. `qemu-img check`
//! compares those counts with the references it finds (header, L1, L2 tables, data and
//! compressed clusters, refcount structures): a count too low is an error, too high a leak.
//!
//! Policy (simple and crash-safe):
//! - New clusters are taken at the end of the file (`next_free`), skipping any cluster
//!   whose count is not zero. Freed clusters are never reused while the image is open, so
//!   a racing write that still holds an old mapping can only land in a dead cluster.
//! - A refcount block needed by an allocation is itself allocated at the end (and counts
//!   itself if it covers itself). When the table is too small it is grown into new
//!   clusters at the end; the old table's clusters are freed only after the header that
//!   points at the new one has been written and synced ([`Refcounts::take_pending_free`]).
//! - Only 16-bit refcounts (`refcount_order` 4, qemu's default) are written; the image
//!   refuses to open others read-write.
//!
//! Invariants: every block ever loaded or created stays in memory (2 bytes per cluster of
//! image, written back when dirty), and `table` always has `table_clusters * cluster/8`
//! entries, mirroring the on-disk table.

use std::collections::HashMap;

use vdstream_blockdev::layerfile::LayerFile;

use crate::header::MAX_REFTABLE_BYTES;

/// Offset bits of a refcount table entry.
const RT_OFFSET_MASK: u64 = !0x1ff;

/// A refcount problem: corrupt metadata or a full table.
#[derive(Debug)]
pub enum RefcountError {
    Io(std::io::Error),
    Corrupt(String),
}

impl From<std::io::Error> for RefcountError {
    fn from(e: std::io::Error) -> Self {
        RefcountError::Io(e)
    }
}

type Result<T> = std::result::Result<T, RefcountError>;

#[derive(Debug)]
struct Block {
    counts: Vec<u16>,
    dirty: bool,
}

/// Refcount table, blocks and the allocator.
#[derive(Debug)]
pub struct Refcounts {
    cluster_bits: u32,
    table: Vec<u64>,
    table_offset: u64,
    table_clusters: u32,
    table_dirty: bool,
    /// The table moved: the header must be rewritten.
    table_moved: bool,
    blocks: HashMap<u64, Block>,
    next_free: u64,
    pending_free: Vec<(u64, u64)>,
}

impl Refcounts {
    /// Loads the refcount table (bounds were checked by the header parser).
    pub fn load(
        file: &LayerFile,
        cluster_bits: u32,
        table_offset: u64,
        table_clusters: u32,
        file_len: u64,
    ) -> Result<Self> {
        let bytes = (table_clusters as usize) << cluster_bits;
        let mut raw = vec![0u8; bytes];
        file.read_exact_at(&mut raw, table_offset)?;
        let table = raw
            .chunks_exact(8)
            .map(|c| u64::from_be_bytes(c.try_into().expect("8")))
            .collect();
        let cs = 1u64 << cluster_bits;
        Ok(Refcounts {
            cluster_bits,
            table,
            table_offset,
            table_clusters,
            table_dirty: false,
            table_moved: false,
            blocks: HashMap::new(),
            next_free: file_len.div_ceil(cs) * cs,
            pending_free: Vec::new(),
        })
    }

    fn cs(&self) -> u64 {
        1 << self.cluster_bits
    }

    fn per_block(&self) -> u64 {
        self.cs() / 2
    }

    /// The refcount table's location, for the header.
    pub fn table_location(&self) -> (u64, u32) {
        (self.table_offset, self.table_clusters)
    }

    fn load_block(&mut self, file: &LayerFile, off: u64) -> Result<()> {
        if self.blocks.contains_key(&off) {
            return Ok(());
        }
        if off % self.cs() != 0 {
            return Err(RefcountError::Corrupt(format!(
                "refcount block offset {off} is not cluster aligned"
            )));
        }
        let mut raw = vec![0u8; self.cs() as usize];
        file.read_exact_at(&mut raw, off).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                RefcountError::Corrupt(format!(
                    "refcount block at offset {off} lies past the end of the file"
                ))
            } else {
                e.into()
            }
        })?;
        let counts = raw
            .chunks_exact(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
            .collect();
        self.blocks.insert(
            off,
            Block {
                counts,
                dirty: false,
            },
        );
        Ok(())
    }

    /// The count of host cluster `idx` (0 when no block covers it).
    pub fn get(&mut self, file: &LayerFile, idx: u64) -> Result<u16> {
        let rti = (idx / self.per_block()) as usize;
        let Some(&entry) = self.table.get(rti) else {
            return Ok(0);
        };
        let off = entry & RT_OFFSET_MASK;
        if off == 0 {
            return Ok(0);
        }
        self.load_block(file, off)?;
        Ok(self.blocks[&off].counts[(idx % self.per_block()) as usize])
    }

    /// Adds `delta` (+1 or -1) to the count of host cluster `idx`; returns the new count.
    fn add(&mut self, file: &LayerFile, idx: u64, delta: i32) -> Result<u16> {
        let off = self.ensure_block(file, idx, delta > 0)?;
        let i = (idx % self.per_block()) as usize;
        let block = self.blocks.get_mut(&off).expect("ensured");
        let old = block.counts[i];
        let new = match delta {
            1 => old.checked_add(1).ok_or_else(|| {
                RefcountError::Corrupt(format!("refcount of cluster {idx} overflows"))
            })?,
            _ => old.checked_sub(1).ok_or_else(|| {
                RefcountError::Corrupt(format!(
                    "cluster at offset {} is in use but its refcount is already 0",
                    idx << self.cluster_bits
                ))
            })?,
        };
        block.counts[i] = new;
        block.dirty = true;
        Ok(new)
    }

    /// The offset of the block covering cluster `idx`, creating it (and growing the table)
    /// when `create`.
    fn ensure_block(&mut self, file: &LayerFile, idx: u64, create: bool) -> Result<u64> {
        let rti = (idx / self.per_block()) as usize;
        if rti >= self.table.len() {
            if !create {
                return Err(RefcountError::Corrupt(format!(
                    "cluster {idx} lies beyond the refcount table"
                )));
            }
            self.grow(file, rti + 1)?;
        }
        let off = self.table[rti] & RT_OFFSET_MASK;
        if off != 0 {
            self.load_block(file, off)?;
            return Ok(off);
        }
        if !create {
            return Err(RefcountError::Corrupt(format!(
                "cluster {idx} has no refcount block"
            )));
        }
        let off = self.next_free;
        self.next_free += self.cs();
        self.table[rti] = off;
        self.table_dirty = true;
        self.blocks.insert(
            off,
            Block {
                counts: vec![0; self.per_block() as usize],
                dirty: true,
            },
        );
        self.add(file, off >> self.cluster_bits, 1)?;
        Ok(off)
    }

    /// Grows the table to at least `min_entries` entries, into new clusters at the end.
    fn grow(&mut self, file: &LayerFile, min_entries: usize) -> Result<()> {
        let per_cluster = (self.cs() / 8) as usize;
        let entries = min_entries.max(self.table.len() * 2).div_ceil(per_cluster) * per_cluster;
        let clusters = (entries / per_cluster) as u64;
        if clusters * self.cs() > MAX_REFTABLE_BYTES {
            return Err(RefcountError::Corrupt(
                "the refcount table would exceed qemu's 8 MiB limit".into(),
            ));
        }
        let old = (self.table_offset, self.table_clusters as u64);
        self.table.resize(entries, 0);
        let new_off = self.next_free;
        self.next_free += clusters * self.cs();
        self.table_offset = new_off;
        self.table_clusters = clusters as u32;
        self.table_dirty = true;
        self.table_moved = true;
        for c in 0..clusters {
            self.add(file, (new_off >> self.cluster_bits) + c, 1)?;
        }
        self.pending_free.push(old);
        Ok(())
    }

    /// Allocates `n` contiguous free clusters at the end of the file, counts them, and
    /// returns the offset of the first.
    pub fn alloc(&mut self, file: &LayerFile, n: u64) -> Result<u64> {
        'search: loop {
            let off = self.next_free;
            for c in 0..n {
                if self.get(file, (off >> self.cluster_bits) + c)? != 0 {
                    self.next_free = off + (c + 1) * self.cs();
                    continue 'search;
                }
            }
            self.next_free = off + n * self.cs();
            for c in 0..n {
                self.add(file, (off >> self.cluster_bits) + c, 1)?;
            }
            return Ok(off);
        }
    }

    /// Drops one reference to every cluster touching `[offset, offset+len)`; returns the
    /// clusters whose count fell to zero.
    pub fn free(&mut self, file: &LayerFile, offset: u64, len: u64) -> Result<Vec<u64>> {
        let mut freed = Vec::new();
        if len == 0 {
            return Ok(freed);
        }
        let first = offset >> self.cluster_bits;
        let last = (offset + len - 1) >> self.cluster_bits;
        for idx in first..=last {
            if self.add(file, idx, -1)? == 0 {
                freed.push(idx << self.cluster_bits);
            }
        }
        Ok(freed)
    }

    /// Writes every dirty block, then the table if it changed. Returns whether anything
    /// was written. The caller syncs.
    pub fn write_dirty(&mut self, file: &LayerFile) -> std::io::Result<bool> {
        let mut wrote = false;
        let mut offs: Vec<u64> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.dirty)
            .map(|(&o, _)| o)
            .collect();
        offs.sort_unstable();
        for off in offs {
            let b = self.blocks.get_mut(&off).expect("listed");
            let raw: Vec<u8> = b.counts.iter().flat_map(|c| c.to_be_bytes()).collect();
            file.write_all_at(&raw, off)?;
            b.dirty = false;
            wrote = true;
        }
        if self.table_dirty {
            let raw: Vec<u8> = self.table.iter().flat_map(|e| e.to_be_bytes()).collect();
            file.write_all_at(&raw, self.table_offset)?;
            self.table_dirty = false;
            wrote = true;
        }
        Ok(wrote)
    }

    /// Whether the header must be rewritten for a moved table; clears the flag.
    pub fn take_table_moved(&mut self) -> bool {
        std::mem::take(&mut self.table_moved)
    }

    /// Old table locations to free once the header no longer points at them.
    pub fn take_pending_free(&mut self) -> Vec<(u64, u64)> {
        std::mem::take(&mut self.pending_free)
    }
}
