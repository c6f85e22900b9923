//! The initramfs archive: newc cpio (the `cpio` crate) compressed with gzip, as the kernel
//! unpacks it.
//!
//! Invariants: every parent directory is written before what it holds (each once); owners
//! are root, times are 0 and inode numbers count up, so the same inputs give the same bytes.

use std::collections::BTreeSet;
use std::io::Write;

use cpio::newc::{Builder, ModeFileType};
use flate2::write::GzEncoder;
use flate2::Compression;

/// A newc archive being written to `W` through gzip.
pub struct Archive<W: Write> {
    out: GzEncoder<W>,
    dirs: BTreeSet<String>,
    names: BTreeSet<String>,
    ino: u32,
}

impl<W: Write> std::fmt::Debug for Archive<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Archive")
            .field("entries", &self.names.len())
            .finish()
    }
}

fn rel(path: &str) -> String {
    path.trim_start_matches('/').to_string()
}

impl<W: Write> Archive<W> {
    pub fn new(w: W) -> Self {
        Archive {
            out: GzEncoder::new(w, Compression::default()),
            dirs: BTreeSet::new(),
            names: BTreeSet::new(),
            ino: 1,
        }
    }

    fn entry(
        &mut self,
        name: &str,
        kind: ModeFileType,
        perm: u32,
        data: &[u8],
    ) -> std::io::Result<()> {
        if !self.names.insert(name.to_string()) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{name} is in the initramfs twice"),
            ));
        }
        let size = u32::try_from(data.len())
            .map_err(|_| std::io::Error::other(format!("{name} is over 4 GiB")))?;
        self.ino += 1;
        let b = Builder::new(name)
            .ino(self.ino)
            .uid(0)
            .gid(0)
            .mtime(0)
            .nlink(if matches!(kind, ModeFileType::Directory) {
                2
            } else {
                1
            })
            .mode(perm)
            .set_mode_file_type(kind);
        let mut w = b.write(&mut self.out, size);
        w.write_all(data)?;
        w.finish()?;
        Ok(())
    }

    fn parents(&mut self, name: &str) -> std::io::Result<()> {
        let mut acc = String::new();
        let parts: Vec<&str> = name.split('/').collect();
        for p in &parts[..parts.len() - 1] {
            if !acc.is_empty() {
                acc.push('/');
            }
            acc.push_str(p);
            if self.dirs.insert(acc.clone()) {
                let a = acc.clone();
                self.entry(&a, ModeFileType::Directory, 0o755, &[])?;
            }
        }
        Ok(())
    }

    /// A directory (and its parents).
    pub fn dir(&mut self, path: &str) -> std::io::Result<()> {
        let name = rel(path);
        self.parents(&format!("{name}/x"))
    }

    /// A regular file with permission bits `perm`.
    pub fn file(&mut self, path: &str, perm: u32, data: &[u8]) -> std::io::Result<()> {
        let name = rel(path);
        self.parents(&name)?;
        self.entry(&name, ModeFileType::Regular, perm, data)
    }

    /// A symbolic link to `target`.
    pub fn symlink(&mut self, path: &str, target: &str) -> std::io::Result<()> {
        let name = rel(path);
        self.parents(&name)?;
        self.entry(&name, ModeFileType::Symlink, 0o777, target.as_bytes())
    }

    /// How many entries (files, directories, links) are written so far.
    pub fn entries(&self) -> usize {
        self.names.len()
    }

    /// Whether `path` is already in the archive.
    pub fn contains(&self, path: &str) -> bool {
        let n = rel(path);
        self.names.contains(&n) || self.dirs.contains(&n)
    }

    /// The trailer; returns the writer after gzip's end.
    pub fn finish(mut self) -> std::io::Result<W> {
        cpio::newc::trailer(&mut self.out)?;
        self.out.finish()
    }
}

/// One entry read back from an archive: for tests and `initrd build`'s listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub name: String,
    pub mode: u32,
    pub data: Vec<u8>,
}

/// Reads a gzip-compressed newc archive back, in order.
pub fn list(gz: &[u8]) -> std::io::Result<Vec<Listed>> {
    use std::io::Read;
    let mut r: Box<dyn Read> = Box::new(flate2::read::GzDecoder::new(gz));
    let mut out = Vec::new();
    loop {
        let mut e = cpio::NewcReader::new(r)?;
        if e.entry().is_trailer() {
            return Ok(out);
        }
        let (name, mode) = (e.entry().name().to_string(), e.entry().mode());
        let mut data = Vec::new();
        e.read_to_end(&mut data)?;
        out.push(Listed { name, mode, data });
        r = Box::new(e.finish()?);
    }
}
