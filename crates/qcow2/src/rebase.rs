//! Re-pointing an image at another backing file without touching its data, as
//! `qemu-img rebase -u` does: the store uses it when a version is moved onto a merged
//! chain, or a merged version is renamed into place.
//!
//! Invariants:
//! - Only the header area of the first cluster changes (see [`crate::header::with_backing`]),
//!   in one `pwrite` followed by `fsync`; every other header field and extension is kept.
//! - The image is locked exclusively (`flock`) for the rewrite, so it is refused while
//!   vdstream has it open anywhere; an image whose header cannot hold the new name is left
//!   untouched.
//! - Nothing checks that the new backing file exists or has the same content: that is the
//!   caller's promise, as with `rebase -u`.

use std::os::unix::fs::FileExt;
use std::path::Path;

use vdstream_blockdev::{Error, ErrorKind, Op, Result};

use crate::header::{with_backing, HEADER_READ_LEN};
use crate::image::{file_error, lock_file};
use crate::ImageFormat;

/// Rewrites the backing file name and format in the header of the qcow2 image at `path`
/// (`None` removes the backing file: unallocated clusters then read as zeros). A relative
/// name is resolved against `path`'s directory when the image is opened.
pub fn set_backing_file(path: &Path, backing: Option<(&str, ImageFormat)>) -> Result<()> {
    let io = |e: std::io::Error| Error::from_io(e, Op::Write, 0, 0, path.display().to_string());
    let file = vdstream_blockdev::storefile::open_existing_rw(path).map_err(io)?;
    lock_file(&file, true, path)?;
    let len = file.metadata().map_err(io)?.len();
    let mut first = vec![0u8; len.min(HEADER_READ_LEN as u64) as usize];
    file.read_exact_at(&mut first, 0).map_err(io)?;
    let header = with_backing(&first, len, backing.map(|(n, f)| (n, f.name()))).map_err(|e| {
        let advice = if e.field == "magic" || e.field == "version" {
            "only qcow2 images name a backing file"
        } else {
            "the header is left unchanged: use a shorter backing file name (or an image with larger clusters)"
        };
        file_error(ErrorKind::Invalid, Op::Write, 0, path, format!("{e}; {advice}"))
    })?;
    file.write_all_at(&header, 0).map_err(io)?;
    file.sync_all().map_err(io)
}
