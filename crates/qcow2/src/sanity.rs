//! [`sanity`]: a cheap check of a qcow2 file against its own size, for `vdisk info` and
//! before an import: the header parses; the L1 table, every L2 table it names, the
//! refcount table and every refcount block lie inside the file; and every cluster the
//! refcounts count as used begins inside the file. A truncated image fails it: `qemu-img
//! convert` would silently read zeros for what is missing.
//!
//! It reads the header, the L1 table and the refcount structures only (about 2 bytes per
//! cluster of file: 2 MiB for 64 GiB of 64 KiB clusters), never an L2 table or data. What
//! it does not see (an L2 entry pointing outside the file while its refcounts were not
//! updated, wrong refcounts) is `qemu-img check`'s job.
//!
//! A cluster counts as inside when it begins before the end of the file: qemu ends a
//! file in the middle of its last cluster when only part of it was ever written (a fresh
//! image ends right after its L1 table), and `qemu-img check` accepts that too.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use vdstream_blockdev::{ErrorKind, Op, Result};

use crate::header::{Header, HEADER_READ_LEN};
use crate::image::{file_error, OFFSET_MASK};

/// Offset bits of a refcount table entry.
const RT_OFFSET_MASK: u64 = !0x1ff;

/// What [`sanity`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sanity {
    /// The parsed header, when it parses.
    pub header: Option<Header>,
    /// Bytes in the file.
    pub file_len: u64,
    /// Bytes the structures and used clusters need: the end of the highest of them.
    pub needed_len: u64,
    /// What is wrong, one sentence each; empty when the file is sane.
    pub problems: Vec<String>,
}

/// Checks `path` as described in the module doc. `Err` only when the file cannot be read
/// at all (missing, unreadable); a damaged file is an `Ok` with `problems`.
pub fn sanity(path: impl AsRef<Path>) -> Result<Sanity> {
    let path = path.as_ref();
    let io = |e: std::io::Error| {
        vdstream_blockdev::Error::from_io(e, Op::Open, 0, 0, path.display().to_string())
    };
    let file = File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut out = Sanity {
        header: None,
        file_len,
        needed_len: 0,
        problems: vec![],
    };
    let mut first = vec![0u8; (file_len as usize).min(HEADER_READ_LEN)];
    file.read_exact_at(&mut first, 0).map_err(io)?;
    let h = match Header::parse(&first, file_len) {
        Ok(h) => h,
        Err(e) => {
            out.problems.push(format!("unreadable header: {e}"));
            return Ok(out);
        }
    };
    let cs = h.cluster_size();
    let need = |what: &str, offset: u64, out: &mut Sanity| {
        out.needed_len = out.needed_len.max(offset + 1);
        if offset >= file_len && out.problems.len() < 8 {
            out.problems.push(format!(
                "{what} at offset {offset} lies past the end of the file ({file_len} bytes): the file is truncated"));
        }
    };
    // Header::parse checked that both tables themselves are inside the file.
    out.needed_len = (h.l1_table_offset + h.l1_size as u64 * 8)
        .max(h.refcount_table_offset + ((h.refcount_table_clusters as u64) << h.cluster_bits));
    let read = |offset: u64, len: u64| -> Result<Vec<u8>> {
        let mut b = vec![0u8; len as usize];
        file.read_exact_at(&mut b, offset).map_err(|e| {
            vdstream_blockdev::Error::from_io(e, Op::Read, offset, len, path.display().to_string())
        })?;
        Ok(b)
    };
    let l1 = read(h.l1_table_offset, h.l1_size as u64 * 8)?;
    for (i, e) in l1.chunks_exact(8).enumerate() {
        let l2 = u64::from_be_bytes(e.try_into().expect("8")) & OFFSET_MASK;
        if l2 != 0 {
            need(&format!("the L2 table of L1 entry {i}"), l2, &mut out);
        }
    }
    let width = 1u64 << h.refcount_order; // bits per refcount
    let per_block = cs * 8 / width;
    let table = read(
        h.refcount_table_offset,
        (h.refcount_table_clusters as u64) << h.cluster_bits,
    )?;
    for (i, e) in table.chunks_exact(8).enumerate() {
        let block = u64::from_be_bytes(e.try_into().expect("8")) & RT_OFFSET_MASK;
        if block == 0 {
            continue;
        }
        if block >= file_len {
            need(&format!("refcount block {i}"), block, &mut out);
            continue;
        }
        let bytes = read(block, cs.min(file_len - block))?;
        // The highest cluster this block counts as used.
        let used = (0..per_block).rev().find(|&j| {
            let bit = j * width;
            let (at, shift) = ((bit / 8) as usize, bit % 8);
            if at >= bytes.len() {
                return false;
            }
            match width {
                1 | 2 | 4 => (bytes[at] >> (8 - shift - width)) & ((1 << width) - 1) != 0,
                _ => bytes[at..(at + (width / 8) as usize).min(bytes.len())]
                    .iter()
                    .any(|&b| b != 0),
            }
        });
        if let Some(j) = used {
            let cluster = (i as u64 * per_block + j) * cs;
            need("a cluster in use (by the refcounts)", cluster, &mut out);
        }
    }
    if out.needed_len > file_len && out.problems.is_empty() {
        out.problems.push(format!(
            "the file needs {} bytes but holds {file_len}: it is truncated",
            out.needed_len
        ));
    }
    out.header = Some(h);
    Ok(out)
}

/// [`sanity`], as an error naming the file and the first problems when there are any.
pub fn check_sane(path: impl AsRef<Path>) -> Result<Sanity> {
    let path = path.as_ref();
    let s = sanity(path)?;
    if s.problems.is_empty() {
        return Ok(s);
    }
    Err(file_error(
        ErrorKind::Invalid,
        Op::Open,
        0,
        path,
        format!("the qcow2 image is damaged: {}", s.problems.join("; ")),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vdstream_blockdev::BlockDev;

    #[test]
    fn a_whole_image_is_sane_and_a_truncated_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.qcow2");
        crate::create(&p, 64 << 20, None, 16).unwrap();
        let fresh = sanity(&p).unwrap();
        assert!(fresh.problems.is_empty(), "{fresh:?}");
        {
            let img = crate::Qcow2Image::open(
                &p,
                crate::OpenOptions {
                    read_only: false,
                    ..Default::default()
                },
                None,
            )
            .unwrap();
            img.write_at(&[0x5a; 1 << 20], 8 << 20, false).unwrap();
            img.flush().unwrap();
        }
        let full = sanity(&p).unwrap();
        assert!(full.problems.is_empty(), "{full:?}");
        assert!(
            full.needed_len <= full.file_len && full.needed_len > full.file_len - (64 << 10),
            "{full:?}"
        );
        // Cut off the last half of the data: the refcounts name clusters past the end.
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(full.file_len - (512 << 10)).unwrap();
        let cut = sanity(&p).unwrap();
        assert!(
            !cut.problems.is_empty() && cut.problems[0].contains("past the end of the file"),
            "{cut:?}"
        );
        let e = check_sane(&p).unwrap_err().to_string();
        assert!(e.contains("a.qcow2") && e.contains("truncated"), "{e}");
        // Cut into the tables: the header names tables outside the file.
        f.set_len(100 << 10).unwrap();
        let cut = sanity(&p).unwrap();
        assert!(
            cut.problems[0].starts_with("unreadable header")
                && cut.problems[0].contains("past the end"),
            "{cut:?}"
        );
        std::fs::write(
            &p,
            b"not qcow2 at all, just some bytes that are long enough to be a header......",
        )
        .unwrap();
        assert!(sanity(&p).unwrap().problems[0].contains("not the qcow2 magic"));
        assert!(sanity(dir.path().join("gone")).is_err());
    }
}
