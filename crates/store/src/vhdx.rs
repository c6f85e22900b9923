//! A read-only reader for VHDX files (MS-VHDX, "Virtual Hard Disk v2"), above all for
//! differencing ones (AVHDX: a child of another VHDX, as PVS and Hyper-V keep versions of
//! VHDX vDisks), which qemu refuses to open. `vdisk import NAME BASE.vhdx --version
//! CHILD.avhdx …` writes what a child holds into a store version over the layer below.
//!
//! Format (little-endian; GUIDs in their mixed-endian binary form): a 64 KiB file type
//! identifier ("vhdxfile"); two 4 KiB headers at 64 and 128 KiB ("head", CRC-32C, sequence
//! number, DataWriteGuid, LogGuid, log offset and length), the current one being the
//! valid one with the higher sequence number; two copies of a 64 KiB region table at 192
//! and 256 KiB ("regi", CRC-32C) locating the BAT and metadata regions. Metadata items:
//! File Parameters (block size, LeaveBlockAllocated, HasParent), Virtual Disk Size,
//! Logical Sector Size and, in a differencing file, the Parent Locator (UTF-16 key/value
//! pairs: `parent_linkage` is the parent's DataWriteGuid, `relative_path`,
//! `absolute_win32_path`…). The BAT holds one 64-bit entry per payload block (state in
//! bits 0-2, file offset in MiB in bits 20-63) with a sector-bitmap entry after every
//! `chunk ratio` payload entries (chunk ratio = 2^23 × logical sector size / block size).
//! A sector bitmap block (1 MiB) has one bit per sector, least significant bit first: set
//! means the sector is in this file, clear that it reads from the parent.
//!
//! Block states read as follows: FULLY_PRESENT from the file; PARTIALLY_PRESENT (only in
//! differencing files) per sector bitmap; ZERO and UNMAPPED as zeros (for UNMAPPED, one of
//! the readings the specification allows); NOT_PRESENT and UNDEFINED from the parent (zeros
//! for a file without one).
//!
//! Invariants: headers and region tables are used only with a valid CRC-32C; every offset
//! read is checked against the file's length when the file is opened (a truncated file is
//! refused, never read as zeros); a file whose log holds entries (it was not closed
//! cleanly, and needs a replay) is refused.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{io, Result, StoreError};

/// What a layer defines over its parent at one guest offset.
#[derive(Debug)]
pub enum Run<'a> {
    /// These bytes.
    Data(&'a [u8]),
    /// This many bytes of zeros (they hide the parent).
    Zero(u64),
}

const KIB: u64 = 1024;
const MIB: u64 = 1024 * 1024;

const BAT_REGION: &str = "2DC27766-F623-4200-9D64-115E9BFD4A08";
const METADATA_REGION: &str = "8B7CA206-4790-4B9A-B8FE-575F050F886E";
const FILE_PARAMETERS: &str = "CAA16737-FA36-4D43-B3B6-33F0AA44E76B";
const VIRTUAL_DISK_SIZE: &str = "2FA54224-CD1B-4876-B211-5DBED83BF4B8";
const LOGICAL_SECTOR_SIZE: &str = "8141BF1D-A96F-4709-BA47-F233A8FAAB5F";
const PARENT_LOCATOR: &str = "A8D35F2D-B30B-454D-ABF7-D3D84834AB0C";
/// Metadata items this reader knows and may ignore (virtual disk id, physical sector size).
const KNOWN_OTHER_ITEMS: [&str; 2] = [
    "BECA12AB-B2E6-4523-93EF-C309E000C746",
    "CDA348C7-445D-4471-9CC9-E9885251C556",
];
const VHDX_PARENT_LOCATOR_TYPE: &str = "B04AEFB7-D19E-4A81-B789-25B8E9445913";

const PAYLOAD_NOT_PRESENT: u64 = 0;
const PAYLOAD_UNDEFINED: u64 = 1;
const PAYLOAD_ZERO: u64 = 2;
const PAYLOAD_UNMAPPED: u64 = 3;
const PAYLOAD_FULLY_PRESENT: u64 = 6;
const PAYLOAD_PARTIALLY_PRESENT: u64 = 7;
const SB_PRESENT: u64 = 6;

/// A VHDX file, opened and checked.
#[derive(Debug)]
pub struct Vhdx {
    path: PathBuf,
    file: File,
    /// Guest size in bytes (Virtual Disk Size).
    pub size: u64,
    /// Payload block size in bytes.
    pub block_size: u64,
    /// Logical sector size in bytes (512 or 4096).
    pub sector: u64,
    /// File Parameters' HasParent: a differencing file (AVHDX).
    pub has_parent: bool,
    /// The current header's DataWriteGuid, as text ("XXXXXXXX-XXXX-…", upper case): what a
    /// child's `parent_linkage` names.
    pub data_write_guid: String,
    /// The parent locator's entries (key, value), for a differencing file.
    pub parent_locator: Vec<(String, String)>,
    chunk_ratio: u64,
    bat: Vec<u64>,
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2"))
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4"))
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8"))
}

/// The text form of a GUID stored in its binary (mixed-endian) layout.
pub fn guid_text(b: &[u8]) -> String {
    let mut s = format!("{:08X}-{:04X}-{:04X}-", le32(b, 0), le16(b, 4), le16(b, 6));
    for (i, x) in b[8..16].iter().enumerate() {
        if i == 2 {
            s.push('-');
        }
        s.push_str(&format!("{x:02X}"));
    }
    s
}

/// A GUID's text without braces, upper case (parent locators write "{…}").
fn normalize_guid(s: &str) -> String {
    s.trim()
        .trim_start_matches('{')
        .trim_end_matches('}')
        .to_ascii_uppercase()
}

/// Whether `buf` (a header or region table) has signature `sig` and a valid CRC-32C in
/// bytes 4..8 (computed with those bytes zero).
fn valid(buf: &[u8], sig: &[u8]) -> bool {
    if &buf[..4] != sig {
        return false;
    }
    let mut copy = buf.to_vec();
    copy[4..8].fill(0);
    crc32c::crc32c(&copy) == le32(buf, 4)
}

impl Vhdx {
    /// Opens `path` and reads its headers, region table, metadata and BAT; `Corrupt` names
    /// what is wrong (including a block past the end of the file), `Refused` a log that
    /// needs a replay.
    pub fn open(path: &Path) -> Result<Vhdx> {
        let bad = |detail: String| {
            StoreError::Corrupt {
            path: path.to_path_buf(),
            detail,
            advice: "nothing was imported: check the file with the tool that made it (Hyper-V: Test-VHD)".into(),
        }
        };
        let file = File::open(path).map_err(io("open", path))?;
        let len = file.metadata().map_err(io("stat", path))?.len();
        let read = |at: u64, n: u64, what: &str| -> Result<Vec<u8>> {
            if !matches!(at.checked_add(n), Some(e) if e <= len) {
                return Err(bad(format!("the {what} at offset {at} ({n} bytes) is past the end of the file ({len} bytes): the file is truncated")));
            }
            let mut b = vec![0u8; n as usize];
            file.read_exact_at(&mut b, at).map_err(io("read", path))?;
            Ok(b)
        };
        let mut sig = [0u8; 8];
        if len < 8 || file.read_exact_at(&mut sig, 0).is_err() || &sig != b"vhdxfile" {
            return Err(bad(
                "no file type identifier \"vhdxfile\" at offset 0: not a VHDX file".into(),
            ));
        }

        // The current header: the valid one with the higher sequence number.
        let mut header: Option<Vec<u8>> = None;
        for at in [64 * KIB, 128 * KIB] {
            let h = read(at, 4 * KIB, "header")?;
            if valid(&h, b"head") && header.as_ref().is_none_or(|c| le64(&h, 8) > le64(c, 8)) {
                header = Some(h);
            }
        }
        let header = header.ok_or_else(|| {
            bad("neither header (at 64 and 128 KiB) has a valid signature and CRC-32C".into())
        })?;
        if le16(&header, 66) != 1 {
            return Err(bad(format!(
                "header version {} (this reader knows version 1)",
                le16(&header, 66)
            )));
        }
        let data_write_guid = guid_text(&header[32..48]);
        let log_guid = &header[48..64];
        if log_guid.iter().any(|&b| b != 0) {
            let (log_len, log_at) = (le32(&header, 68) as u64, le64(&header, 72));
            let log = read(log_at, log_len, "log")?;
            let has_entry = log
                .chunks_exact(4 * KIB as usize)
                .any(|e| &e[..4] == b"loge" && &e[32..48] == log_guid);
            if has_entry {
                return Err(StoreError::Refused(format!(
                    "{} has a non-empty log (it was not closed cleanly): its log must be replayed before it can be read; \
                     open it once in Hyper-V (Mount-VHD, then Dismount-VHD; for a VHDX without a parent \
                     `qemu-img check -r all FILE` also replays it), then import again",
                    path.display())));
            }
        }

        // The region table (the second copy if the first is damaged).
        let mut regions = None;
        for at in [192 * KIB, 256 * KIB] {
            let r = read(at, 64 * KIB, "region table")?;
            if valid(&r, b"regi") {
                regions = Some(r);
                break;
            }
        }
        let regions = regions.ok_or_else(|| {
            bad(
                "neither region table (at 192 and 256 KiB) has a valid signature and CRC-32C"
                    .into(),
            )
        })?;
        let count = le32(&regions, 8) as usize;
        if count > 2047 {
            return Err(bad(format!("{count} region table entries (at most 2047)")));
        }
        let (mut bat_region, mut meta_region) = (None, None);
        for i in 0..count {
            let e = &regions[16 + 32 * i..48 + 32 * i];
            let (guid, at, n, required) = (
                guid_text(&e[..16]),
                le64(e, 16),
                le32(e, 24) as u64,
                le32(e, 28) & 1 != 0,
            );
            match guid.as_str() {
                BAT_REGION => bat_region = Some((at, n)),
                METADATA_REGION => meta_region = Some((at, n)),
                _ if required => return Err(bad(format!("an unknown required region {guid}"))),
                _ => {}
            }
        }
        let (Some(bat_region), Some(meta_region)) = (bat_region, meta_region) else {
            return Err(bad(
                "the region table has no BAT or no metadata region".into()
            ));
        };

        // Metadata items.
        let meta = read(meta_region.0, meta_region.1, "metadata region")?;
        if meta.len() < 64 * KIB as usize || &meta[..8] != b"metadata" {
            return Err(bad(format!(
                "no metadata table (signature \"metadata\") at offset {}",
                meta_region.0
            )));
        }
        let entries = le16(&meta, 10) as usize;
        if entries > 2047 {
            return Err(bad(format!("{entries} metadata entries (at most 2047)")));
        }
        let (mut params, mut size, mut sector, mut locator) = (None, None, None, None);
        for i in 0..entries {
            let e = &meta[32 + 32 * i..64 + 32 * i];
            let (guid, off, n, required) = (
                guid_text(&e[..16]),
                le32(e, 16) as usize,
                le32(e, 20) as usize,
                le32(e, 24) & 4 != 0,
            );
            let Some(item) = meta.get(off..off + n) else {
                return Err(bad(format!(
                    "metadata item {guid} at {off} ({n} bytes) is outside the metadata region"
                )));
            };
            let short = |min: usize| {
                if n < min {
                    Err(bad(format!("metadata item {guid} is {n} bytes, too short")))
                } else {
                    Ok(())
                }
            };
            match guid.as_str() {
                FILE_PARAMETERS => {
                    short(8)?;
                    params = Some((le32(item, 0) as u64, le32(item, 4)));
                }
                VIRTUAL_DISK_SIZE => {
                    short(8)?;
                    size = Some(le64(item, 0));
                }
                LOGICAL_SECTOR_SIZE => {
                    short(4)?;
                    sector = Some(le32(item, 0) as u64);
                }
                PARENT_LOCATOR => locator = Some(item.to_vec()),
                g if required && !KNOWN_OTHER_ITEMS.contains(&g) => {
                    return Err(bad(format!("an unknown required metadata item {guid}")))
                }
                _ => {}
            }
        }
        let (Some((block_size, flags)), Some(size), Some(sector)) = (params, size, sector) else {
            return Err(bad(
                "the metadata lacks File Parameters, Virtual Disk Size or Logical Sector Size"
                    .into(),
            ));
        };
        if !block_size.is_power_of_two() || !(MIB..=256 * MIB).contains(&block_size) {
            return Err(bad(format!(
                "block size {block_size} (a power of 2 from 1 to 256 MiB)"
            )));
        }
        if sector != 512 && sector != 4096 {
            return Err(bad(format!("logical sector size {sector} (512 or 4096)")));
        }
        if size == 0 || size % sector != 0 || size > 64 << 40 {
            return Err(bad(format!(
                "virtual disk size {size} (a multiple of the {sector}-byte sector, at most 64 TiB)"
            )));
        }
        let has_parent = flags & 2 != 0;
        let parent_locator = match (has_parent, locator) {
            (false, _) => vec![],
            (true, None) => {
                return Err(bad(
                    "it has a parent (HasParent) but no parent locator".into()
                ))
            }
            (true, Some(l)) => parse_locator(&l).map_err(bad)?,
        };

        // The BAT, with a sector-bitmap entry after every `chunk_ratio` payload entries.
        let chunk_ratio = (1u64 << 23) * sector / block_size;
        let blocks = size.div_ceil(block_size);
        let bat_len = if has_parent {
            blocks.div_ceil(chunk_ratio) * (chunk_ratio + 1)
        } else {
            blocks + (blocks - 1) / chunk_ratio
        };
        if bat_region.1 < bat_len * 8 {
            return Err(bad(format!(
                "the BAT region holds {} bytes, {} entries need {}",
                bat_region.1,
                bat_len,
                bat_len * 8
            )));
        }
        let raw = read(bat_region.0, bat_len * 8, "BAT")?;
        let bat: Vec<u64> = raw
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8")))
            .collect();
        let vhdx = Vhdx {
            path: path.to_path_buf(),
            file,
            size,
            block_size,
            sector,
            has_parent,
            data_write_guid,
            parent_locator,
            chunk_ratio,
            bat,
        };
        for i in 0..blocks {
            let e = vhdx.bat[vhdx.payload_index(i)];
            let at = (e >> 20) * MIB;
            match e & 7 {
                PAYLOAD_NOT_PRESENT | PAYLOAD_UNDEFINED | PAYLOAD_ZERO | PAYLOAD_UNMAPPED => {}
                PAYLOAD_FULLY_PRESENT => {}
                PAYLOAD_PARTIALLY_PRESENT if has_parent => {
                    let sb = vhdx.bat[vhdx.bitmap_index(i)];
                    if sb & 7 != SB_PRESENT {
                        return Err(bad(format!(
                            "block {i} is partially present but its chunk has no sector bitmap"
                        )));
                    }
                    if (sb >> 20) * MIB + MIB > len {
                        return Err(bad(format!(
                            "the sector bitmap of block {i} at offset {} reaches past the end of the file ({len} bytes): the file is truncated",
                            (sb >> 20) * MIB)));
                    }
                }
                s => return Err(bad(format!("block {i} has the invalid state {s}"))),
            }
            if e & 7 >= PAYLOAD_FULLY_PRESENT && at + block_size > len {
                return Err(bad(format!("block {i} at offset {at} reaches past the end of the file ({len} bytes): the file is truncated")));
            }
        }
        Ok(vhdx)
    }

    fn payload_index(&self, block: u64) -> usize {
        (block + block / self.chunk_ratio) as usize
    }

    fn bitmap_index(&self, block: u64) -> usize {
        ((block / self.chunk_ratio) * (self.chunk_ratio + 1) + self.chunk_ratio) as usize
    }

    /// The parent locator's `parent_linkage` (the parent's DataWriteGuid), normalized.
    pub fn parent_linkage(&self) -> Option<String> {
        self.parent_locator
            .iter()
            .find(|(k, _)| k == "parent_linkage")
            .map(|(_, v)| normalize_guid(v))
    }

    /// Calls `f` for every run this file defines (a run never crosses a block): data it
    /// holds, or zeros (ZERO and UNMAPPED blocks). Blocks and sectors it leaves to the
    /// parent are not visited.
    pub fn for_each_run(&self, f: &mut dyn FnMut(u64, Run<'_>) -> Result<()>) -> Result<()> {
        let per_block = self.block_size / self.sector;
        let mut bitmap = vec![0u8; (per_block / 8) as usize];
        let mut data = Vec::new();
        let mut emit = |guest: u64,
                        at: u64,
                        n: u64,
                        f: &mut dyn FnMut(u64, Run<'_>) -> Result<()>|
         -> Result<()> {
            // In pieces of at most 1 MiB, for memory.
            let mut done = 0;
            while done < n {
                let k = (n - done).min(MIB);
                data.resize(k as usize, 0);
                self.file
                    .read_exact_at(&mut data, at + done)
                    .map_err(io("read", &self.path))?;
                f(guest + done, Run::Data(&data))?;
                done += k;
            }
            Ok(())
        };
        for i in 0..self.size.div_ceil(self.block_size) {
            let e = self.bat[self.payload_index(i)];
            let at = (e >> 20) * MIB;
            let guest = i * self.block_size;
            let n = self.block_size.min(self.size - guest);
            match e & 7 {
                PAYLOAD_ZERO | PAYLOAD_UNMAPPED => f(guest, Run::Zero(n))?,
                PAYLOAD_FULLY_PRESENT => emit(guest, at, n, f)?,
                PAYLOAD_PARTIALLY_PRESENT => {
                    let sb_at = (self.bat[self.bitmap_index(i)] >> 20) * MIB
                        + (i % self.chunk_ratio) * (per_block / 8);
                    self.file
                        .read_exact_at(&mut bitmap, sb_at)
                        .map_err(io("read", &self.path))?;
                    let present = |k: u64| bitmap[(k / 8) as usize] & (1 << (k % 8)) != 0;
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
                        let off = first * self.sector;
                        if off >= n {
                            break;
                        }
                        emit(
                            guest + off,
                            at + off,
                            ((k - first) * self.sector).min(n - off),
                            f,
                        )?;
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// The key/value pairs of a parent locator item (MS-VHDX 2.6.2.6): a 20-byte header (locator
/// type GUID, reserved, key-value count), 12-byte entries (key offset, value offset, key
/// length, value length; offsets from the item's start), UTF-16LE strings.
fn parse_locator(item: &[u8]) -> std::result::Result<Vec<(String, String)>, String> {
    if item.len() < 20 {
        return Err("the parent locator is too short".into());
    }
    if guid_text(&item[..16]) != VHDX_PARENT_LOCATOR_TYPE {
        return Err(format!(
            "the parent locator has the unknown type {}",
            guid_text(&item[..16])
        ));
    }
    let n = le16(item, 18) as usize;
    let text = |off: usize, len: usize| -> std::result::Result<String, String> {
        let b = item
            .get(off..off + len)
            .ok_or("a parent locator entry points outside the item")?;
        let units: Vec<u16> = b
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        String::from_utf16(&units).map_err(|_| "a parent locator entry is not UTF-16".to_string())
    };
    let mut out = Vec::new();
    for i in 0..n {
        let e = item
            .get(20 + 12 * i..32 + 12 * i)
            .ok_or("the parent locator's entries run past the item")?;
        out.push((
            text(le32(e, 0) as usize, le16(e, 8) as usize)?,
            text(le32(e, 4) as usize, le16(e, 10) as usize)?,
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guid_text_is_mixed_endian() {
        let b = [
            0x06, 0xa2, 0x7c, 0x8b, 0x90, 0x47, 0x9a, 0x4b, 0xb8, 0xfe, 0x57, 0x5f, 0x05, 0x0f,
            0x88, 0x6e,
        ];
        assert_eq!(guid_text(&b), METADATA_REGION);
    }
}
