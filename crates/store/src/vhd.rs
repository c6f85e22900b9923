//! A reader for differencing VHD files (disk type 4: a child of another VHD, as PVS keeps
//! versions of VHD vDisks), which qemu cannot read: it opens them as if they had no
//! parent. `vdisk import NAME BASE.vhd --version CHILD.vhd …` writes the sectors a child
//! holds into a store version over the layer below, so that the version reads what the
//! child reads over its parent.
//!
//! Format (Microsoft "Virtual Hard Disk Image Format Specification", big-endian): a
//! 512-byte footer at the end of the file, copied at offset 0; its `data_offset` points
//! at a 1024-byte dynamic header (cookie "cxsparse") holding the block allocation table
//! (BAT) offset, the number of entries, the block size and the parent's unique id. A BAT
//! entry is the sector of a block, or 0xFFFFFFFF when the child holds nothing there. A
//! block starts with a sector bitmap (one bit per sector, most significant bit first,
//! padded to whole sectors): a set bit means the sector is in this file; a clear one,
//! that it reads from the parent.
//!
//! Invariants: every offset read is checked against the file's length before use (a
//! truncated child is refused, never read as zeros), and a child is applied only over
//! the layer whose unique id it names as its parent.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{io, Result, StoreError};

const SECTOR: u64 = 512;

/// A differencing (or dynamic) VHD, opened.
#[derive(Debug)]
pub struct Vhd {
    path: PathBuf,
    file: File,
    len: u64,
    /// Guest size in bytes (footer "current size").
    pub size: u64,
    /// 2 fixed, 3 dynamic, 4 differencing.
    pub disk_type: u32,
    /// The footer's unique id.
    pub unique_id: [u8; 16],
    /// The parent's unique id (differencing only).
    pub parent_id: [u8; 16],
    block_size: u64,
    bat: Vec<u32>,
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8"))
}

impl Vhd {
    /// Opens `path` and reads its footer, dynamic header and BAT; `Corrupt` names what is
    /// wrong (including a BAT entry past the end of the file).
    pub fn open(path: &Path) -> Result<Vhd> {
        let bad = |detail: String| {
            StoreError::Corrupt {
            path: path.to_path_buf(),
            detail,
            advice: "nothing was imported: check the file with the tool that made it (Hyper-V: Test-VHD)".into(),
        }
        };
        let file = File::open(path).map_err(io("open", path))?;
        let len = file.metadata().map_err(io("stat", path))?.len();
        if len < 3 * SECTOR {
            return Err(bad(format!("{len} bytes is too short for a VHD")));
        }
        let mut footer = [0u8; 512];
        file.read_exact_at(&mut footer, len - SECTOR)
            .map_err(io("read", path))?;
        if &footer[..8] != b"conectix" {
            // A truncated file has lost its footer; the copy at offset 0 still says VHD.
            file.read_exact_at(&mut footer, 0)
                .map_err(io("read", path))?;
            if &footer[..8] == b"conectix" {
                return Err(bad("the footer at the end of the file is missing (its copy at offset 0 is there): the file is truncated".into()));
            }
            return Err(bad(
                "no VHD footer (cookie \"conectix\"): not a VHD file".into()
            ));
        }
        let disk_type = be32(&footer, 60);
        let size = be64(&footer, 48);
        let unique_id: [u8; 16] = footer[68..84].try_into().expect("16");
        let mut vhd = Vhd {
            path: path.to_path_buf(),
            file,
            len,
            size,
            disk_type,
            unique_id,
            parent_id: [0; 16],
            block_size: 0,
            bat: vec![],
        };
        if disk_type != 3 && disk_type != 4 {
            return Ok(vhd); // fixed: no BAT
        }
        let dyn_at = be64(&footer, 16);
        if !matches!(dyn_at.checked_add(1024), Some(e) if e <= len) {
            return Err(bad(format!(
                "the dynamic header at offset {dyn_at} is past the end of the file ({len} bytes)"
            )));
        }
        let mut dh = [0u8; 1024];
        vhd.file
            .read_exact_at(&mut dh, dyn_at)
            .map_err(io("read", path))?;
        if &dh[..8] != b"cxsparse" {
            return Err(bad(format!(
                "no dynamic header (cookie \"cxsparse\") at offset {dyn_at}"
            )));
        }
        let bat_at = be64(&dh, 16);
        let entries = be32(&dh, 28) as u64;
        vhd.block_size = be32(&dh, 32) as u64;
        vhd.parent_id = dh[40..56].try_into().expect("16");
        if vhd.block_size == 0 || vhd.block_size % SECTOR != 0 || entries * vhd.block_size < size {
            return Err(bad(format!(
                "block size {} with {entries} blocks does not cover the disk's {size} bytes",
                vhd.block_size
            )));
        }
        if !matches!(bat_at.checked_add(entries * 4), Some(e) if e <= len) {
            return Err(bad(format!("the block table at offset {bat_at} is past the end of the file ({len} bytes): the file is truncated")));
        }
        let mut raw = vec![0u8; (entries * 4) as usize];
        vhd.file
            .read_exact_at(&mut raw, bat_at)
            .map_err(io("read", path))?;
        vhd.bat = raw
            .chunks_exact(4)
            .map(|c| u32::from_be_bytes(c.try_into().expect("4")))
            .collect();
        let block_bytes = vhd.bitmap_bytes() + vhd.block_size;
        for (i, &s) in vhd.bat.iter().enumerate() {
            if s != u32::MAX && s as u64 * SECTOR + block_bytes > len {
                return Err(bad(format!(
                    "block {i} at offset {} reaches past the end of the file ({len} bytes): the file is truncated", s as u64 * SECTOR)));
            }
        }
        Ok(vhd)
    }

    /// Bytes of a block's sector bitmap, padded to whole sectors.
    fn bitmap_bytes(&self) -> u64 {
        (self.block_size / SECTOR).div_ceil(8).div_ceil(SECTOR) * SECTOR
    }

    /// Calls `f(guest_offset, bytes)` for every run of sectors this file holds (a run
    /// never crosses a block).
    pub fn for_each_run(&self, f: &mut dyn FnMut(u64, &[u8]) -> Result<()>) -> Result<()> {
        let bm_len = self.bitmap_bytes();
        let per_block = self.block_size / SECTOR;
        let mut bitmap = vec![0u8; bm_len as usize];
        let mut data = Vec::new();
        for (i, &s) in self.bat.iter().enumerate() {
            if s == u32::MAX {
                continue;
            }
            let at = s as u64 * SECTOR;
            self.file
                .read_exact_at(&mut bitmap, at)
                .map_err(io("read", &self.path))?;
            let present = |k: u64| bitmap[(k / 8) as usize] & (0x80 >> (k % 8)) != 0;
            let block_start = i as u64 * self.block_size;
            let mut k = 0;
            while k < per_block {
                if !present(k) {
                    k += 1;
                    continue;
                }
                let first = k;
                while k < per_block && present(k) {
                    k += 1;
                }
                let guest = block_start + first * SECTOR;
                if guest >= self.size {
                    break;
                }
                let n = ((k - first) * SECTOR).min(self.size - guest);
                data.resize(n as usize, 0);
                self.file
                    .read_exact_at(&mut data, at + bm_len + first * SECTOR)
                    .map_err(io("read", &self.path))?;
                f(guest, &data)?;
            }
        }
        Ok(())
    }

    /// The file's length (for messages).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file is empty (never: `open` refuses short files).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
