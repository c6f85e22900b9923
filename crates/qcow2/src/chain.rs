//! Backing chains: opening an image and everything below it, and creating new images.
//!
//! [`open_chain`] probes the format (qcow2 magic, else raw), and for qcow2 follows the
//! backing file named in the header, relative to the image's directory when not absolute,
//! using the backing format from the header extension when there is one. Every layer below
//! the top is read-only. Chains deeper than [`MAX_CHAIN_DEPTH`] are refused (that also
//! stops loops).
//!
//! [`create`] writes an empty version 3 image the way `qemu-img create -f qcow2` does:
//! header (with the backing format extension) in cluster 0, refcount table in cluster 1,
//! one refcount block in cluster 2, the L1 table after it; those clusters count 1.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vdstream_blockdev::layerfile::{self, LayerFile};
use vdstream_blockdev::{BlockDev, Error, ErrorKind, Op, Result};

use crate::header::{push_extension, Header, EXT_BACKING_FORMAT, EXT_END, MAGIC, MAX_BACKING_NAME, MAX_CLUSTER_BITS, MIN_CLUSTER_BITS};
use crate::image::{file_error, OpenOptions, Qcow2Image};

/// Deepest backing chain we follow.
pub const MAX_CHAIN_DEPTH: usize = 64;

/// The format of an image in a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    Raw,
    Qcow2,
}

impl ImageFormat {
    /// The name qemu uses ("raw", "qcow2").
    pub fn name(self) -> &'static str {
        match self {
            ImageFormat::Raw => "raw",
            ImageFormat::Qcow2 => "qcow2",
        }
    }

    fn from_name(name: &str, image: &Path) -> Result<Self> {
        match name {
            "raw" => Ok(ImageFormat::Raw),
            "qcow2" => Ok(ImageFormat::Qcow2),
            other => Err(file_error(ErrorKind::NotSupported, Op::Open, 0, image, format!(
                "backing format {other:?} is not supported (only raw and qcow2): convert the backing file with `qemu-img convert`"))),
        }
    }

    /// Probes `path`: qcow2 if it starts with the qcow2 magic, raw otherwise.
    pub fn probe(path: &Path) -> Result<Self> {
        let mut magic = [0u8; 4];
        let io_err = |e| Error::from_io(e, Op::Open, 0, 0, path.display().to_string());
        let f = LayerFile::open(path, false).map_err(io_err)?;
        if f.len().map_err(io_err)? < 4 {
            return Ok(ImageFormat::Raw);
        }
        f.read_exact_at(&mut magic, 0).map_err(io_err)?;
        Ok(if u32::from_be_bytes(magic) == MAGIC { ImageFormat::Qcow2 } else { ImageFormat::Raw })
    }
}

/// Opens `path` (raw or qcow2, probed) and its whole backing chain, read-only.
pub fn open_chain(path: impl AsRef<Path>) -> Result<Arc<dyn BlockDev>> {
    open_layer(path.as_ref(), None, 0, &|_, dev| dev)
}

/// Called on every layer of a chain as it is opened, bottom first, with the layer's file
/// and its device (that layer and everything below it); what it returns is what the layer
/// above reads as its backing device (and, for the top, what the caller gets). The store
/// server puts its shared read cache there.
pub type LayerHook<'a> = &'a dyn Fn(&Path, Arc<dyn BlockDev>) -> Arc<dyn BlockDev>;

/// [`open_chain`], passing each layer's device through `hook`.
pub fn open_chain_with(path: impl AsRef<Path>, hook: LayerHook<'_>) -> Result<Arc<dyn BlockDev>> {
    open_layer(path.as_ref(), None, 0, hook)
}

fn open_layer(path: &Path, format: Option<ImageFormat>, depth: usize, hook: LayerHook<'_>) -> Result<Arc<dyn BlockDev>> {
    if depth > MAX_CHAIN_DEPTH {
        return Err(file_error(ErrorKind::Invalid, Op::Open, 0, path, format!(
            "the backing chain is deeper than {MAX_CHAIN_DEPTH} layers (or loops): check it with `qemu-img info --backing-chain`")));
    }
    let format = match format {
        Some(f) => f,
        None => ImageFormat::probe(path)?,
    };
    let dev: Arc<dyn BlockDev> = match format {
        ImageFormat::Raw => layerfile::open_raw(path)?,
        ImageFormat::Qcow2 => {
            let backing = backing_of(path, depth, hook)?;
            Arc::new(Qcow2Image::open(path, OpenOptions { read_only: true, ..Default::default() }, backing)?)
        }
    };
    Ok(hook(path, dev))
}

impl Qcow2Image {
    /// Opens `path` and, below it, the backing chain its header names (read-only). Here and
    /// not in image.rs, so that the chain is built on images and never the reverse.
    pub fn open_with_backing_chain(path: impl AsRef<Path>, options: OpenOptions) -> Result<Self> {
        let backing = backing_of(path.as_ref(), 0, &|_, dev| dev)?;
        Self::open(path, options, backing)
    }
}

/// The backing device named by the qcow2 header of `path`, each layer opened read-only and
/// passed through `hook`.
fn backing_of(path: &Path, depth: usize, hook: LayerHook<'_>) -> Result<Option<Arc<dyn BlockDev>>> {
    match backing_ref(path)? {
        None => Ok(None),
        Some(b) => open_layer(&b.path, b.format, depth + 1, hook).map(Some),
    }
}

/// What a qcow2 header says about its backing file.
#[derive(Debug, Clone)]
pub(crate) struct BackingRef {
    /// The name resolved against the image's directory (checked to exist).
    pub path: PathBuf,
    /// The format from the backing format extension, when there is one.
    pub format: Option<ImageFormat>,
}

/// Reads and validates the header of the qcow2 image at `path`.
pub(crate) fn read_header(path: &Path) -> Result<Header> {
    let f = LayerFile::open(path, false).map_err(|e| Error::from_io(e, Op::Open, 0, 0, path.display().to_string()))?;
    let len = f.len().map_err(|e| Error::from_io(e, Op::Open, 0, 0, path.display().to_string()))?;
    let mut first = vec![0u8; len.min(crate::header::HEADER_READ_LEN as u64) as usize];
    f.read_exact_at(&mut first, 0).map_err(|e| Error::from_io(e, Op::Open, 0, 0, path.display().to_string()))?;
    Header::parse(&first, len).map_err(|e| file_error(ErrorKind::Invalid, Op::Open, 0, path, format!("{e}; check the image with `qemu-img check`")))
}

/// The backing file named by the qcow2 header of `path`, if any.
pub(crate) fn backing_ref(path: &Path) -> Result<Option<BackingRef>> {
    let header = read_header(path)?;
    let Some(name) = header.backing_file else { return Ok(None) };
    // A layer in object storage names its backing file beside it, by file name: a name
    // with a folder in it would let whoever writes the bucket make a server open (and
    // serve) any file of its machine.
    if (name.contains('/') || name.starts_with('.')) && layerfile::remote(path).is_some() {
        return Err(file_error(ErrorKind::Invalid, Op::Open, 0, path, format!(
            "backing file {name:?} of a layer in object storage is not a file name beside it; the store's layers name their backing file by name only: copy the store again")));
    }
    let resolved = resolve_backing(path, &name);
    let format = header.backing_format.as_deref().map(|n| ImageFormat::from_name(n, path)).transpose()?;
    if !layerfile::exists(&resolved) {
        return Err(file_error(ErrorKind::Invalid, Op::Open, 0, path, format!(
            "backing file {name:?} (resolved to {}) does not exist: restore it or rebase the image with `qemu-img rebase`", resolved.display())));
    }
    Ok(Some(BackingRef { path: resolved, format }))
}

/// One layer of an opened chain, with its own type kept (merging asks each layer what it
/// holds itself, which a `dyn BlockDev` of the whole chain cannot say).
#[derive(Debug, Clone)]
pub(crate) struct Layer {
    /// The path as reached from the top (relative names resolved).
    pub path: PathBuf,
    pub format: ImageFormat,
    /// This layer and everything below it.
    pub dev: Arc<dyn BlockDev>,
    /// The same device when it is qcow2, for per-layer allocation lookups.
    pub qcow2: Option<Arc<Qcow2Image>>,
}

/// Opens `top` and its whole backing chain read-only, layer by layer: index 0 is `top`,
/// the last is the base.
pub(crate) fn open_layers(top: &Path) -> Result<Vec<Layer>> {
    let mut found: Vec<(PathBuf, ImageFormat)> = Vec::new();
    let mut next = Some((top.to_path_buf(), None::<ImageFormat>));
    while let Some((path, format)) = next.take() {
        if found.len() > MAX_CHAIN_DEPTH {
            return Err(file_error(ErrorKind::Invalid, Op::Open, 0, top, format!(
                "the backing chain is deeper than {MAX_CHAIN_DEPTH} layers (or loops): check it with `qemu-img info --backing-chain`")));
        }
        let format = match format {
            Some(f) => f,
            None => ImageFormat::probe(&path)?,
        };
        if format == ImageFormat::Qcow2 {
            next = backing_ref(&path)?.map(|b| (b.path, b.format));
        }
        found.push((path, format));
    }
    let mut layers: Vec<Layer> = Vec::with_capacity(found.len());
    for (path, format) in found.into_iter().rev() {
        let below = layers.last().map(|l| l.dev.clone());
        let layer = match format {
            ImageFormat::Raw => {
                let dev = layerfile::open_raw(&path)?;
                Layer { path, format, dev, qcow2: None }
            }
            ImageFormat::Qcow2 => {
                let img = Arc::new(Qcow2Image::open(&path, OpenOptions { read_only: true, ..Default::default() }, below)?);
                Layer { path, format, dev: img.clone(), qcow2: Some(img) }
            }
        };
        layers.push(layer);
    }
    layers.reverse();
    Ok(layers)
}

/// A backing file name, relative to the directory of the image that names it.
pub fn resolve_backing(image: &Path, name: &str) -> PathBuf {
    let p = Path::new(name);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        image.parent().unwrap_or(Path::new(".")).join(p)
    }
}

/// Creates an empty version 3 qcow2 image of `size` bytes at `path` (which must not
/// exist), optionally over `backing` (its name is stored as given: relative names are
/// resolved against `path`'s directory), with clusters of `1 << cluster_bits` bytes.
pub fn create(path: impl AsRef<Path>, size: u64, backing: Option<(&str, ImageFormat)>, cluster_bits: u32) -> Result<()> {
    let path = path.as_ref();
    let invalid = |m: String| file_error(ErrorKind::Invalid, Op::Open, 0, path, m);
    if !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&cluster_bits) {
        return Err(invalid(format!("cluster_bits {cluster_bits} is outside 9..=21")));
    }
    let cs = 1u64 << cluster_bits;
    let l1_entries = Header::l1_entries_for(size, cluster_bits);
    if l1_entries * 8 > crate::header::MAX_L1_BYTES {
        return Err(invalid(format!("{size} bytes need an L1 table above 32 MiB: use larger clusters")));
    }
    let l1_clusters = (l1_entries * 8).div_ceil(cs).max(1);
    let used = 3 + l1_clusters;
    if used > cs / 2 {
        return Err(invalid(format!("{size} bytes with {cs}-byte clusters need more metadata than one refcount block covers: use larger clusters")));
    }
    let mut h = Header {
        version: 3,
        cluster_bits,
        size,
        l1_size: l1_entries as u32,
        l1_table_offset: 3 * cs,
        refcount_table_offset: cs,
        refcount_table_clusters: 1,
        nb_snapshots: 0,
        snapshots_offset: 0,
        incompatible_features: 0,
        compatible_features: 0,
        autoclear_features: 0,
        refcount_order: 4,
        header_length: 112,
        backing_file: None,
        backing_format: None,
    };
    let mut ext = Vec::new();
    if let Some((name, format)) = backing {
        if name.is_empty() || name.len() > MAX_BACKING_NAME as usize {
            return Err(invalid(format!("the backing file name must be 1 to 1023 bytes, got {}", name.len())));
        }
        push_extension(&mut ext, EXT_BACKING_FORMAT, format.name().as_bytes());
        h.backing_file = Some(name.to_string());
        h.backing_format = Some(format.name().to_string());
    }
    push_extension(&mut ext, EXT_END, &[]);
    let name_at = h.header_length as u64 + ext.len() as u64;
    let mut first = h.to_bytes_v3(name_at);
    first.extend_from_slice(&ext);
    if let Some(name) = &h.backing_file {
        first.extend_from_slice(name.as_bytes());
    }
    if first.len() as u64 > cs {
        return Err(invalid("the header and backing file name do not fit in one cluster: use larger clusters".into()));
    }
    let mut image = vec![0u8; (used * cs) as usize];
    image[..first.len()].copy_from_slice(&first);
    image[cs as usize..cs as usize + 8].copy_from_slice(&(2 * cs).to_be_bytes());
    for c in 0..used as usize {
        let at = 2 * cs as usize + 2 * c;
        image[at..at + 2].copy_from_slice(&1u16.to_be_bytes());
    }
    let io = |e: std::io::Error| Error::from_io(e, Op::Open, 0, 0, path.display().to_string());
    let file = std::fs::OpenOptions::new().write(true).create_new(true).open(path).map_err(io)?;
    // A failed write (a full file system) must not leave a half-made image behind.
    file.write_all_at(&image, 0).and_then(|()| file.sync_all()).map_err(|e| {
        let _ = std::fs::remove_file(path);
        io(e)
    })
}
