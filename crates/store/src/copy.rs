//! Moving bytes in and out of the store: a sparse copy of a raw file (import), a sparse
//! raw export of any layer, and `qemu-img` for the formats vdstream does not read itself.
//!
//! Sparse means: ranges the source reports as holes (`SEEK_DATA`/`SEEK_HOLE` on a file,
//! block status on a chain) are never read, and 64 KiB blocks that read as zeros are not
//! written, so the destination is as sparse as the file system allows. Progress is
//! reported as `(done, total)` bytes through a callback; drawing it is the caller's job.
//!
//! `qemu-img convert -p` prints `(NN.NN/100%)` to stdout, separated by carriage returns;
//! [`parse_qemu_progress`] turns each into a fraction.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::process::{Command, Stdio};

use vdstream_blockdev::BlockDev;

use crate::error::{io, Result, StoreError};
use crate::source::Source;

/// Progress callback: bytes done, bytes in all.
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64);

/// The unit of zero detection.
pub const ZERO_BLOCK: usize = 64 * 1024;
const CHUNK: usize = 4 << 20;

fn is_zero(b: &[u8]) -> bool {
    b.iter().all(|&x| x == 0)
}

/// Writes the non-zero 64 KiB blocks of `buf` at `offset` of `dst`.
fn write_nonzero(dst: &File, buf: &[u8], offset: u64, path: &Path) -> Result<u64> {
    let mut written = 0;
    for (i, block) in buf.chunks(ZERO_BLOCK).enumerate() {
        if !is_zero(block) {
            dst.write_all_at(block, offset + (i * ZERO_BLOCK) as u64)
                .map_err(io("write", path))?;
            written += block.len() as u64;
        }
    }
    Ok(written)
}

/// The data ranges of a file from `SEEK_DATA`/`SEEK_HOLE` (the whole file if unsupported).
fn data_ranges(f: &File, len: u64) -> Vec<(u64, u64)> {
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut pos = 0u64;
    while pos < len {
        // SAFETY: lseek takes the descriptor `f` keeps open and integers only.
        let data = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
                break; // only a hole from pos to the end
            }
            return vec![(0, len)];
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let end = if hole < 0 {
            len
        } else {
            (hole as u64).min(len)
        };
        if end <= data as u64 {
            break;
        }
        out.push((data as u64, end));
        pos = end;
    }
    out
}

/// Copies raw `src` into a new sparse file `dst`; returns the bytes written.
pub fn copy_raw_sparse(src: &Path, dst: &Path, progress: Progress<'_>) -> Result<u64> {
    let input = File::open(src).map_err(io("open", src))?;
    let len = input.metadata().map_err(io("stat", src))?.len();
    let out = vdstream_blockdev::storefile::create_new(dst, crate::fsutil::SHARED_READ)
        .map_err(io("create", dst))?;
    out.set_len(len).map_err(io("size", dst))?;
    let mut buf = vec![0u8; CHUNK];
    let mut written = 0;
    let mut done = 0;
    for (start, end) in data_ranges(&input, len) {
        let mut off = start;
        while off < end {
            let n = ((end - off) as usize).min(CHUNK);
            input
                .read_exact_at(&mut buf[..n], off)
                .map_err(io("read", src))?;
            written += write_nonzero(&out, &buf[..n], off, dst)?;
            off += n as u64;
            done += n as u64;
            progress(done.min(len), len);
        }
    }
    progress(len, len);
    out.sync_all().map_err(io("fsync", dst))?;
    Ok(written)
}

/// Writes the whole guest content of `dev` to a new sparse raw file; returns bytes written.
pub fn export_raw(
    dev: &dyn BlockDev,
    dst: &Path,
    overwrite: bool,
    progress: Progress<'_>,
) -> Result<u64> {
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true);
    if overwrite {
        opts.create(true).truncate(true)
    } else {
        opts.create_new(true)
    };
    let out = opts.open(dst).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            StoreError::Refused(format!(
                "{} already exists: choose another file or pass --force to overwrite it",
                dst.display()
            ))
        } else {
            io("create", dst)(e)
        }
    })?;
    let size = dev.size();
    out.set_len(size).map_err(io("size", dst))?;
    let mut buf = vec![0u8; CHUNK];
    let mut written = 0;
    let mut off = 0;
    while off < size {
        let window = (size - off).min(CHUNK as u64);
        let mut extents = Vec::new();
        dev.block_status(off, window, &mut extents)?;
        let mut at = off;
        for e in extents {
            let len = e.len.min(off + window - at);
            if len == 0 {
                break;
            }
            if !e.zero {
                dev.read_at(&mut buf[..len as usize], at)?;
                written += write_nonzero(&out, &buf[..len as usize], at, dst)?;
            }
            at += len;
            if at >= off + window {
                break;
            }
        }
        off = at.max(off + 1).min(size);
        progress(off, size);
    }
    out.sync_all().map_err(io("fsync", dst))?;
    Ok(written)
}

/// What `qemu-img info` says about an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageInfo {
    pub format: String,
    pub virtual_size: u64,
}

fn qemu_img() -> Command {
    Command::new(std::env::var_os("VDSTREAM_QEMU_IMG").unwrap_or_else(|| "qemu-img".into()))
}

fn tool_missing(e: std::io::Error) -> StoreError {
    StoreError::Tool(format!(
        "cannot run qemu-img ({e}): install it (Debian: apt-get install qemu-utils)"
    ))
}

/// `qemu-img info --output=json SPEC` of an image from outside, opened only as `src` says
/// ([`Source::qemu_spec`]), its report checked ([`Source::check_info`]). `Ok(None)` when
/// qemu-img cannot be run at all.
pub fn qemu_info(src: &Source) -> Result<Option<ImageInfo>> {
    let out = match qemu_img()
        .args(["info", "--output=json"])
        .arg(src.qemu_spec())
        .output()
    {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(tool_missing(e)),
    };
    if !out.status.success() {
        return Err(StoreError::Tool(format!(
            "qemu-img info {} (as {}) failed: {}",
            src.path.display(),
            src.format,
            crate::check::first_lines(&String::from_utf8_lossy(&out.stderr))
        )));
    }
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        StoreError::Tool(format!(
            "qemu-img info {} printed something that is not JSON: {e}",
            src.path.display()
        ))
    })?;
    src.check_info(&j)?;
    Ok(Some(ImageInfo {
        format: src.format.to_string(),
        virtual_size: j["virtual-size"].as_u64().unwrap_or(0),
    }))
}

/// Parses one `(NN.NN/100%)` progress report of `qemu-img -p` into a fraction.
pub fn parse_qemu_progress(text: &str) -> Option<f64> {
    let t = text.trim();
    let inner = t.strip_prefix('(')?.strip_suffix("/100%)")?;
    let v: f64 = inner.trim().parse().ok()?;
    (0.0..=100.0).contains(&v).then_some(v / 100.0)
}

/// Runs `qemu-img convert -p -O OUT_FMT SPEC DST`, reporting progress against `total`.
/// `spec` is a `json:` spec that names every file qemu-img may open ([`Source::qemu_spec`],
/// [`crate::source::chain_spec`]); `what` names the source in messages.
pub fn qemu_convert(
    spec: &str,
    what: &Path,
    dst: &Path,
    dst_format: &str,
    total: u64,
    progress: Progress<'_>,
) -> Result<()> {
    let mut cmd = qemu_img();
    cmd.args(["convert", "-p", "-O", dst_format]);
    if dst_format == "qcow2" {
        cmd.args(["-o", "cluster_size=65536"]);
    }
    let mut child = cmd
        .arg(spec)
        .arg(dst)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(tool_missing)?;
    let mut stdout = child.stdout.take().expect("piped");
    let stderr = child.stderr.take().expect("piped");
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = { stderr }.read_to_string(&mut s);
        s
    });
    let mut pending = Vec::new();
    let mut byte = [0u8; 256];
    loop {
        let n = match stdout.read(&mut byte) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        for &b in &byte[..n] {
            if b == b'\r' || b == b'\n' {
                if let Some(f) = parse_qemu_progress(&String::from_utf8_lossy(&pending)) {
                    progress((f * total as f64) as u64, total);
                }
                pending.clear();
            } else {
                pending.push(b);
            }
        }
    }
    let status = child.wait().map_err(tool_missing)?;
    let errors = err_reader.join().unwrap_or_default();
    if !status.success() {
        let _ = std::fs::remove_file(dst);
        return Err(StoreError::Tool(format!(
            "qemu-img convert {} to {} failed ({status}): {}",
            what.display(),
            dst.display(),
            errors.trim()
        )));
    }
    progress(total, total);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_progress_lines_parse() {
        assert_eq!(parse_qemu_progress("    (12.50/100%)"), Some(0.125));
        assert_eq!(parse_qemu_progress("(100.00/100%)"), Some(1.0));
        assert_eq!(parse_qemu_progress("junk"), None);
        assert_eq!(parse_qemu_progress("(120.00/100%)"), None);
    }

    #[test]
    fn raw_copies_are_sparse_and_equal() {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("a.raw"), dir.path().join("b.raw"));
        let f = File::create(&src).unwrap();
        f.set_len(8 << 20).unwrap();
        f.write_all_at(&[7u8; 5000], 3 << 20).unwrap();
        f.write_all_at(&[0u8; 70000], 5 << 20).unwrap(); // allocated zeros
        let mut last = (0, 0);
        let written = copy_raw_sparse(&src, &dst, &mut |d, t| last = (d, t)).unwrap();
        assert!(
            written > 0 && written <= ZERO_BLOCK as u64,
            "only the non-zero block is written: {written}"
        );
        assert_eq!(last, (8 << 20, 8 << 20));
        assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
        let e = copy_raw_sparse(&src, &dst, &mut |_, _| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot create") && e.contains("b.raw"), "{e}");
    }
}
