//! A raw local disk or partition as the overflow of `ram-overflow` or the page file of
//! `device-disk` (`--overflow-device /dev/sda2`): a network-booted target with a scratch
//! disk keeps its cache there with no file system.
//!
//! Invariants: the device is opened exclusively (`O_EXCL` on a block device: a device
//! that is mounted or open exclusively elsewhere is refused, so the cache never writes
//! over a file system in use); its contents are never read before the cache wrote them,
//! so it is treated as empty at every start and needs no header (none is written); its
//! size is `BLKGETSIZE64` (a regular file standing in for a device in tests: its length).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// `#define BLKGETSIZE64 _IOR(0x12,114,size_t)` of include/uapi/linux/fs.h: direction read
/// (2 << 30), size 8 (<< 16), type 0x12 (<< 8), number 114, on 64-bit Linux.
const BLKGETSIZE64: u64 = (2 << 30) | (8 << 16) | (0x12 << 8) | 114;

/// Opens `path` for reading and writing, exclusively, with `O_DIRECT` if `direct`, and
/// returns it with its size in bytes. The error says what is wrong and what to do.
pub fn open_exclusive(path: &Path, direct: bool) -> io::Result<(File, u64)> {
    let meta = std::fs::metadata(path).map_err(|e| {
        annotate(
            path,
            e,
            "give an existing disk or partition, e.g. /dev/sda2",
        )
    })?;
    let block = meta.file_type().is_block_device();
    if !block && !meta.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is not a disk or partition (nor a file): give a block device such as /dev/sda2",
                path.display()
            ),
        ));
    }
    let mut flags = libc::O_CLOEXEC;
    if block {
        flags |= libc::O_EXCL;
    }
    if direct {
        flags |= libc::O_DIRECT;
    }
    let file = OpenOptions::new().read(true).write(true).custom_flags(flags).open(path).map_err(|e| match e.raw_os_error() {
        Some(libc::EBUSY) => annotate(path, e, "it is in use (mounted, or open by another program): unmount it or give another partition"),
        Some(libc::EACCES) | Some(libc::EPERM) => annotate(path, e, "writing to a disk needs root"),
        _ => annotate(path, e, "check that it exists and is writable"),
    })?;
    let size = if block {
        let mut bytes: u64 = 0;
        // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points at `bytes`
        // for the whole call; `file` is an open block device.
        if unsafe {
            libc::ioctl(
                file.as_raw_fd(),
                BLKGETSIZE64 as libc::Ioctl,
                &mut bytes as *mut u64,
            )
        } != 0
        {
            return Err(annotate(
                path,
                io::Error::last_os_error(),
                "cannot read its size (BLKGETSIZE64)",
            ));
        }
        bytes
    } else {
        meta.len()
    };
    Ok((file, size))
}

fn annotate(path: &Path, e: io::Error, what_to_do: &str) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}: {what_to_do}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_stands_in_and_other_things_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("disk");
        std::fs::write(&f, vec![0u8; 8192]).unwrap();
        let (_, size) = open_exclusive(&f, false).unwrap();
        assert_eq!(size, 8192);
        let e = open_exclusive(dir.path(), false).unwrap_err().to_string();
        assert!(e.contains("not a disk or partition"), "{e}");
        let e = open_exclusive(&dir.path().join("sdz9"), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sdz9") && e.contains("existing disk"), "{e}");
    }
}
