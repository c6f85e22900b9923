//! A vDisk version's root file system, read as ext4 without mounting it.
//!
//! The version's block device (the store's opened chain) is read through `ext4-view`. The
//! golden image is raw ext4 (the device is the file system); a whole disk is accepted too:
//! with an MBR or GPT partition table, the first Linux partition (MBR type 0x83, GPT
//! "Linux filesystem" or "Linux x86-64 root") that holds ext4 is taken.
//!
//! Invariant: everything here only reads the device; paths are absolute and symbolic links
//! are followed inside the image (never on the host).

use std::sync::Arc;

use ext4_view::{Ext4, Ext4Read};
use vdstream_blockdev::BlockDev;

/// Reads a block device from `base` on (a partition's start, or 0).
struct DevReader {
    dev: Arc<dyn BlockDev>,
    base: u64,
}

impl Ext4Read for DevReader {
    fn read(
        &mut self,
        start_byte: u64,
        dst: &mut [u8],
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync + 'static>> {
        self.dev
            .read_at(dst, self.base + start_byte)
            .map_err(|e| Box::new(e) as _)
    }
}

const EXT4_MAGIC_AT: u64 = 1024 + 56;
const SECTOR: u64 = 512;
/// GPT type GUIDs in their on-disk (mixed-endian) byte order.
const GPT_LINUX_FS: [u8; 16] = [
    0xAF, 0x3D, 0xC6, 0x0F, 0x83, 0x84, 0x72, 0x47, 0x8E, 0x79, 0x3D, 0x69, 0xD8, 0x47, 0x7D, 0xE4,
];
const GPT_ROOT_X86_64: [u8; 16] = [
    0xE3, 0xBC, 0x68, 0x4F, 0xCD, 0xE8, 0xB1, 0x4D, 0x96, 0xE7, 0xFB, 0xCA, 0xF9, 0x84, 0xB7, 0x09,
];

fn read(dev: &dyn BlockDev, len: usize, at: u64) -> Result<Vec<u8>, String> {
    let mut b = vec![0u8; len];
    if at + len as u64 > dev.size() {
        return Err(format!(
            "the disk is too small ({} bytes) to hold a file system",
            dev.size()
        ));
    }
    dev.read_at(&mut b, at)
        .map_err(|e| format!("reading {len} bytes at {at}: {e}"))?;
    Ok(b)
}

fn has_ext4(dev: &dyn BlockDev, base: u64) -> Result<bool, String> {
    if base + EXT4_MAGIC_AT + 2 > dev.size() {
        return Ok(false);
    }
    Ok(read(dev, 2, base + EXT4_MAGIC_AT)? == [0x53, 0xEF])
}

fn le32(b: &[u8], at: usize) -> u64 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes")) as u64
}
fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Where the ext4 file system starts on `dev`: 0 for a bare file system, else the start of
/// the first Linux partition holding ext4. The error says what was found instead.
pub fn find_root(dev: &dyn BlockDev) -> Result<u64, String> {
    if has_ext4(dev, 0)? {
        return Ok(0);
    }
    let mbr = read(dev, SECTOR as usize, 0)?;
    if mbr[510..512] != [0x55, 0xAA] {
        return Err(
            "it is neither an ext4 file system nor a disk with an MBR or GPT partition table"
                .into(),
        );
    }
    let entries: Vec<&[u8]> = (0..4).map(|i| &mbr[446 + 16 * i..462 + 16 * i]).collect();
    if entries.iter().any(|e| e[4] == 0xEE) {
        let hdr = read(dev, SECTOR as usize, SECTOR)?;
        if &hdr[..8] != b"EFI PART" {
            return Err("its protective MBR names a GPT, but sector 1 has no GPT header".into());
        }
        let (lba, count, size) = (le64(&hdr, 72), le32(&hdr, 80).min(256), le32(&hdr, 84));
        if !(128..=4096).contains(&size) {
            return Err(format!(
                "its GPT header gives a partition entry size of {size} bytes"
            ));
        }
        let table = read(dev, (count * size) as usize, lba * SECTOR)?;
        for e in table.chunks(size as usize) {
            if e[..16] == GPT_LINUX_FS || e[..16] == GPT_ROOT_X86_64 {
                let start = le64(e, 32) * SECTOR;
                if has_ext4(dev, start)? {
                    return Ok(start);
                }
            }
        }
        return Err("its GPT has no Linux partition holding ext4".into());
    }
    for e in entries {
        if e[4] == 0x83 {
            let start = le32(e, 8) * SECTOR;
            if has_ext4(dev, start)? {
                return Ok(start);
            }
        }
    }
    Err("its MBR has no Linux (type 0x83) partition holding ext4".into())
}

/// Opens the ext4 file system of `dev` (see [`find_root`]).
pub fn open_fs(dev: Arc<dyn BlockDev>) -> Result<Ext4, String> {
    let base = find_root(dev.as_ref())?;
    Ext4::load(Box::new(DevReader { dev, base })).map_err(|e| {
        let at = if base == 0 {
            String::new()
        } else {
            format!(" (partition at byte {base})")
        };
        format!("reading its ext4 file system{at}: {e}")
    })
}
