//! The file under a read-only image layer: a local file, or an object in a remote store.
//!
//! A store on object storage (`s3://…`) keeps its sealed layers as objects, read by range.
//! The server keeps the store's metadata in a local folder (its mirror) where those layers
//! have no file; it registers a [`RemoteRoot`] for that folder, and every layer opened
//! under it that has no local file is read through the root instead. The image readers
//! (raw and qcow2) open their files with [`LayerFile::open`], so they read a remote layer
//! exactly as they read a local one; writing one is refused, since a remote layer is
//! sealed.
//!
//! The registry is process-wide on purpose: the backing chain names its files by path
//! (a qcow2 header names its backing file relative to its own), so the path is the one
//! thing every opener has.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, RwLock};

/// One remote layer: a sized, immutable byte range readable at any offset.
pub trait RemoteFile: Send + Sync + fmt::Debug {
    /// The object's size in bytes.
    fn size(&self) -> u64;
    /// Fills `buf` from `offset`; an error names the object and what to do.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
}

/// A folder whose missing files are objects of a remote store.
pub trait RemoteRoot: Send + Sync {
    /// The folder this root answers for.
    fn dir(&self) -> &Path;
    /// The object behind `name` (a file name inside [`RemoteRoot::dir`], or a path below
    /// it); `None` when the store has no such object.
    fn open(&self, relative: &Path) -> Option<io::Result<Arc<dyn RemoteFile>>>;
}

static ROOTS: RwLock<Vec<Arc<dyn RemoteRoot>>> = RwLock::new(Vec::new());

/// Registers `root` for this process. A later root for the same folder replaces it.
pub fn register(root: Arc<dyn RemoteRoot>) {
    let mut roots = ROOTS.write().unwrap_or_else(|e| e.into_inner());
    roots.retain(|r| r.dir() != root.dir());
    roots.push(root);
}

/// The remote object behind `path` when no local file is there and a registered root
/// covers it.
pub fn remote(path: &Path) -> Option<io::Result<Arc<dyn RemoteFile>>> {
    let roots = ROOTS.read().unwrap_or_else(|e| e.into_inner());
    // No root (every process but a server of an s3:// store): no stat of the path.
    if roots.is_empty() || path.exists() {
        return None;
    }
    roots
        .iter()
        .find_map(|r| path.strip_prefix(r.dir()).ok().and_then(|rel| r.open(rel)))
}

/// Whether `path` names a layer: a local file, or an object under a registered root.
pub fn exists(path: &Path) -> bool {
    path.exists() || remote(path).is_some_and(|r| r.is_ok())
}

/// A layer's file, local or remote.
#[derive(Debug)]
pub enum LayerFile {
    Local(File),
    Remote(Arc<dyn RemoteFile>),
}

impl LayerFile {
    /// Opens `path` for reading (and writing, with `write`): the local file when there is
    /// one, else the remote object a registered root has for it. A remote layer cannot be
    /// opened for writing (EROFS).
    pub fn open(path: &Path, write: bool) -> io::Result<Self> {
        match remote(path) {
            Some(Ok(_)) if write => Err(io::Error::new(
                io::ErrorKind::ReadOnlyFilesystem,
                format!(
                    "{} is a sealed layer in object storage and cannot be written",
                    path.display()
                ),
            )),
            Some(r) => r.map(LayerFile::Remote),
            None => crate::storefile::options(crate::storefile::SHARED_READ)
                .read(true)
                .write(write)
                .open(path)
                .map_err(|e| crate::storefile::explain(e, path))
                .map(LayerFile::Local),
        }
    }

    /// The size of the file or object in bytes.
    pub fn size(&self) -> io::Result<u64> {
        match self {
            LayerFile::Local(f) => f.metadata().map(|m| m.len()),
            LayerFile::Remote(r) => Ok(r.size()),
        }
    }

    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        match self {
            LayerFile::Local(f) => f.read_exact_at(buf, offset),
            LayerFile::Remote(r) => r.read_exact_at(buf, offset),
        }
    }

    /// The local file, for writing and locking; a remote layer answers EROFS.
    pub fn local(&self) -> io::Result<&File> {
        match self {
            LayerFile::Local(f) => Ok(f),
            LayerFile::Remote(r) => Err(io::Error::new(
                io::ErrorKind::ReadOnlyFilesystem,
                format!("{r:?} is a sealed layer in object storage"),
            )),
        }
    }

    /// Writes to the local file; a remote layer answers EROFS.
    pub fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.local()?.write_all_at(buf, offset)
    }

    /// Syncs the local file's data; a remote layer answers EROFS.
    pub fn sync_data(&self) -> io::Result<()> {
        self.local()?.sync_data()
    }

    pub fn is_remote(&self) -> bool {
        matches!(self, LayerFile::Remote(_))
    }
}

/// A raw layer read from a remote object: read-only, every byte data.
#[derive(Debug)]
pub struct RemoteDev {
    object: Arc<dyn RemoteFile>,
    name: String,
}

impl RemoteDev {
    pub fn new(object: Arc<dyn RemoteFile>, path: &Path) -> Self {
        RemoteDev {
            object,
            name: path.display().to_string(),
        }
    }
}

impl crate::BlockDev for RemoteDev {
    fn size(&self) -> u64 {
        self.object.size()
    }

    fn caps(&self) -> crate::Caps {
        // Read-only, blocking on the network; flush is a no-op that clients expect.
        crate::Caps {
            flush: true,
            ..Default::default()
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> crate::Result<()> {
        crate::check_range(
            self.size(),
            crate::Op::Read,
            offset,
            buf.len() as u64,
            &|| self.describe(),
        )?;
        self.object.read_exact_at(buf, offset).map_err(|e| {
            crate::Error::from_io(
                e,
                crate::Op::Read,
                offset,
                buf.len() as u64,
                self.name.clone(),
            )
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64, _fua: bool) -> crate::Result<()> {
        Err(self.sealed(crate::Op::Write, offset, buf.len() as u64))
    }

    fn trim(&self, offset: u64, len: u64, _fua: bool) -> crate::Result<()> {
        Err(self.sealed(crate::Op::Trim, offset, len))
    }

    fn write_zeroes(&self, offset: u64, len: u64, _flags: crate::ZeroFlags) -> crate::Result<()> {
        Err(self.sealed(crate::Op::Zero, offset, len))
    }

    fn describe(&self) -> String {
        self.name.clone()
    }
}

impl RemoteDev {
    fn sealed(&self, op: crate::Op, offset: u64, len: u64) -> crate::Error {
        crate::Error::new(
            crate::ErrorKind::ReadOnly,
            op,
            offset,
            len,
            self.name.clone(),
            "a sealed layer in object storage is read-only",
        )
    }
}

/// Opens a raw layer: the local file read-only, or its remote object.
pub fn open_raw(path: &Path) -> crate::Result<Arc<dyn crate::BlockDev>> {
    match remote(path) {
        Some(Ok(object)) => Ok(Arc::new(RemoteDev::new(object, path))),
        Some(Err(e)) => Err(crate::Error::from_io(
            e,
            crate::Op::Open,
            0,
            0,
            path.display().to_string(),
        )),
        None => Ok(Arc::new(crate::FileDev::open(
            path,
            crate::FileOptions {
                read_only: true,
                ..Default::default()
            },
        )?)),
    }
}
