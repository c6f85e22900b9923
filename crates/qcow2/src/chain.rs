//! Backing chains: opening an image and everything below it, and creating new images.
//!
//! Two ways in, for two kinds of caller:
//!
//! - **A recorded chain** ([`open_recorded`], [`open_recorded_with`]): the store knows every
//!   layer's file and format, bottom first, and says so. Nothing is probed and nothing a
//!   header names is opened: each qcow2 layer's header must name the layer below it by its
//!   file name in the same folder (or nothing, at the bottom), with that layer's format when
//!   it names one, and it is opened over that layer explicitly. A raw layer stays raw
//!   whatever its first bytes say, so a guest that writes a qcow2 header into a raw base
//!   cannot make it name a host file (qemu's CVE-2008-2004 class).
//! - **A file an administrator names** ([`open_chain`], [`chain_of`]): `serve-image FILE`
//!   serves what the administrator points at, as qemu-nbd does. The format is probed (qcow2
//!   magic, else raw) and a qcow2 header's backing file is followed, relative to the
//!   image's folder when not absolute, with the backing format from the header extension
//!   when there is one. Each path is resolved once (links included), since layers are then
//!   opened without following links.
//!
//! Every layer below the top is read-only. Chains deeper than [`MAX_CHAIN_DEPTH`] are
//! refused (that also stops loops).
//!
//! [`create`] writes an empty version 3 image the way `qemu-img create -f qcow2` does:
//! header (with the backing format extension) in cluster 0, refcount table in cluster 1,
//! one refcount block in cluster 2, the L1 table after it; those clusters count 1.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vdstream_blockdev::layerfile::{self, LayerFile};
use vdstream_blockdev::storefile;
use vdstream_blockdev::{BlockDev, Error, ErrorKind, Op, Result};

use crate::header::{
    push_extension, Header, EXT_BACKING_FORMAT, EXT_END, MAGIC, MAX_BACKING_NAME, MAX_CLUSTER_BITS,
    MIN_CLUSTER_BITS,
};
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

    /// Probes `path`: qcow2 if it starts with the qcow2 magic, raw otherwise. Only for a
    /// file an administrator names; a recorded layer's format comes from its record.
    pub fn probe(path: &Path) -> Result<Self> {
        let mut magic = [0u8; 4];
        let io_err = |e| Error::from_io(e, Op::Open, 0, 0, path.display().to_string());
        let f = LayerFile::open(path, false).map_err(io_err)?;
        if f.size().map_err(io_err)? < 4 {
            return Ok(ImageFormat::Raw);
        }
        f.read_exact_at(&mut magic, 0).map_err(io_err)?;
        Ok(if u32::from_be_bytes(magic) == MAGIC {
            ImageFormat::Qcow2
        } else {
            ImageFormat::Raw
        })
    }
}

/// The format of a file an administrator names without saying its format (`serve-image
/// FILE` with `--format auto`): probed, and refused when the probe finds a qcow2 that
/// names a backing file. A probed format may not lead to other files: a raw image served
/// writable could have been given a qcow2 header by its own guest, naming any host file.
/// Whoever made the chain says `--format qcow2`.
pub fn probe_named(path: &Path) -> Result<ImageFormat> {
    let format = ImageFormat::probe(path)?;
    if format == ImageFormat::Qcow2 {
        if let Some(name) = read_header(path)?.backing_file {
            return Err(file_error(ErrorKind::Invalid, Op::Open, 0, path, format!(
                "its format was probed (qcow2) and its header names backing file {name:?}; a probed image may not name other files \
                 (a guest that wrote its own first sector could make it name any host file): if you made this chain, say so with --format qcow2, \
                 else serve it as --format raw")));
        }
    }
    Ok(format)
}

/// One layer of a chain: its file and its format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSpec {
    pub path: PathBuf,
    pub format: ImageFormat,
}

impl LayerSpec {
    pub fn new(path: impl Into<PathBuf>, format: ImageFormat) -> Self {
        LayerSpec {
            path: path.into(),
            format,
        }
    }
}

/// Called on every layer of a chain as it is opened, bottom first, with the layer's file
/// and its device (that layer and everything below it); what it returns is what the layer
/// above reads as its backing device (and, for the top, what the caller gets). The store
/// server puts its shared read cache there.
pub type LayerHook<'a> = &'a dyn Fn(&Path, Arc<dyn BlockDev>) -> Arc<dyn BlockDev>;

/// Opens a recorded chain (bottom first) read-only; see the module doc for what is checked.
pub fn open_recorded(chain: &[LayerSpec]) -> Result<Arc<dyn BlockDev>> {
    open_recorded_with(chain, &|_, dev| dev)
}

/// [`open_recorded`], passing each layer's device through `hook`.
pub fn open_recorded_with(chain: &[LayerSpec], hook: LayerHook<'_>) -> Result<Arc<dyn BlockDev>> {
    Ok(top_of(open_specs(chain, true, hook)?))
}

/// Opens `path` (raw or qcow2, probed) and the backing chain its header names, read-only:
/// for a file an administrator names (see the module doc).
pub fn open_chain(path: impl AsRef<Path>) -> Result<Arc<dyn BlockDev>> {
    Ok(top_of(open_specs(
        &chain_of(path.as_ref())?,
        false,
        &|_, dev| dev,
    )?))
}

/// The device of the top of opened layers (top first).
fn top_of(layers: Vec<Layer>) -> Arc<dyn BlockDev> {
    layers.into_iter().next().expect("a chain has a layer").dev
}

impl Qcow2Image {
    /// Opens `path` and, below it, the backing chain its header names (read-only): for a
    /// file an administrator names. Here and not in image.rs, so that the chain is built on
    /// images and never the reverse.
    pub fn open_with_backing_chain(path: impl AsRef<Path>, options: OpenOptions) -> Result<Self> {
        let path = resolve_named(path.as_ref())?;
        let backing = match backing_ref(&path)? {
            None => None,
            Some(b) => Some(open_chain_from(b)?),
        };
        Self::open(&path, options, backing)
    }
}

fn open_chain_from(b: BackingRef) -> Result<Arc<dyn BlockDev>> {
    let mut chain = walk_chain(b.path, b.format)?;
    chain.reverse();
    Ok(top_of(open_specs(&chain, false, &|_, dev| dev)?))
}

/// The chain of a file an administrator names, bottom first, as its headers name it:
/// formats probed where no header says, every path resolved (links followed once).
pub fn chain_of(top: &Path) -> Result<Vec<LayerSpec>> {
    let mut found = walk_chain(resolve_named(top)?, None)?;
    found.reverse();
    Ok(found)
}

/// Top first: `path` and the layers its headers name below it.
fn walk_chain(path: PathBuf, format: Option<ImageFormat>) -> Result<Vec<LayerSpec>> {
    let top = path.clone();
    let mut found: Vec<LayerSpec> = Vec::new();
    let mut next = Some((path, format));
    while let Some((path, format)) = next.take() {
        if found.len() > MAX_CHAIN_DEPTH {
            return Err(file_error(ErrorKind::Invalid, Op::Open, 0, &top, format!(
                "the backing chain is deeper than {MAX_CHAIN_DEPTH} layers (or loops): check it with `qemu-img info --backing-chain`")));
        }
        let format = match format {
            Some(f) => f,
            None => ImageFormat::probe(&path)?,
        };
        if format == ImageFormat::Qcow2 {
            next = backing_ref(&path)?.map(|b| (b.path, b.format));
        }
        found.push(LayerSpec { path, format });
    }
    Ok(found)
}

/// A path an administrator named, resolved to its file (links included) when it is local;
/// a layer in object storage has no local file and keeps its path.
fn resolve_named(path: &Path) -> Result<PathBuf> {
    if layerfile::remote(path).is_some() && !path.exists() {
        return Ok(path.to_path_buf());
    }
    std::fs::canonicalize(path)
        .map_err(|e| Error::from_io(e, Op::Open, 0, 0, path.display().to_string()))
}

/// Checks that the qcow2 header of `path` names `below` as its backing file (by file
/// name, in the same folder, with its format when the header gives one), or names none
/// when `below` is `None`. The store calls it on every qcow2 layer it opens, the writable
/// top included, so that a layer never reaches a file the store did not put below it.
pub fn check_backing(path: &Path, below: Option<&LayerSpec>) -> Result<()> {
    let header = read_header(path)?;
    let refused = |what: String| {
        file_error(ErrorKind::Invalid, Op::Open, 0, path, format!(
        "{what}; a layer is opened only over the layer its record puts below it, so it is refused: check the vDisk with `vdstream vdisk check`, and restore the layer from backup"))
    };
    match (header.backing_file.as_deref(), below) {
        (None, None) => Ok(()),
        (Some(name), None) => Err(refused(format!(
            "its header names backing file {name:?}, but it is the bottom layer of its chain"
        ))),
        (None, Some(b)) => Err(refused(format!(
            "its header names no backing file, but {} is recorded below it",
            b.path.display()
        ))),
        (Some(name), Some(b)) => {
            let same_folder = path.parent() == b.path.parent();
            if !same_folder || b.path.file_name().and_then(|n| n.to_str()) != Some(name) {
                return Err(refused(format!(
                    "its header names backing file {name:?}, but the layer recorded below it is {}",
                    b.path.display()
                )));
            }
            match header.backing_format.as_deref() {
                Some(f) if f != b.format.name() => Err(refused(format!(
                    "its header gives backing format {f:?}, but {name} is recorded as {}",
                    b.format.name()
                ))),
                _ => Ok(()),
            }
        }
    }
}

/// Opens `chain` (bottom first) layer by layer, each qcow2 layer over what `hook` made of
/// the one below; `checked`: each header must name the layer below ([`check_backing`]).
/// Top first.
fn open_specs(chain: &[LayerSpec], checked: bool, hook: LayerHook<'_>) -> Result<Vec<Layer>> {
    let Some(top) = chain.last() else {
        return Err(Error::new(
            ErrorKind::Invalid,
            Op::Open,
            0,
            0,
            "chain",
            "a chain needs at least one layer",
        ));
    };
    if chain.len() > MAX_CHAIN_DEPTH + 1 {
        return Err(file_error(ErrorKind::Invalid, Op::Open, 0, &top.path, format!(
            "the backing chain is deeper than {MAX_CHAIN_DEPTH} layers (or loops): check it with `qemu-img info --backing-chain`")));
    }
    let mut layers: Vec<Layer> = Vec::with_capacity(chain.len());
    for (i, spec) in chain.iter().enumerate() {
        let below = layers.last().map(|l| l.dev.clone());
        let layer = match spec.format {
            ImageFormat::Raw if i > 0 => {
                return Err(file_error(
                    ErrorKind::Invalid,
                    Op::Open,
                    0,
                    &spec.path,
                    format!(
                        "a raw layer can only be the bottom of a chain, and {} is above {}",
                        spec.path.display(),
                        chain[i - 1].path.display()
                    ),
                ));
            }
            ImageFormat::Raw => Layer {
                path: spec.path.clone(),
                format: spec.format,
                dev: hook(&spec.path, layerfile::open_raw(&spec.path)?),
                qcow2: None,
            },
            ImageFormat::Qcow2 => {
                if checked {
                    check_backing(&spec.path, i.checked_sub(1).map(|j| &chain[j]))?;
                }
                let img = Arc::new(Qcow2Image::open(
                    &spec.path,
                    OpenOptions {
                        read_only: true,
                        ..Default::default()
                    },
                    below,
                )?);
                Layer {
                    path: spec.path.clone(),
                    format: spec.format,
                    dev: hook(&spec.path, img.clone()),
                    qcow2: Some(img),
                }
            }
        };
        layers.push(layer);
    }
    layers.reverse();
    Ok(layers)
}

/// What a qcow2 header says about its backing file.
#[derive(Debug, Clone)]
pub(crate) struct BackingRef {
    /// The name resolved against the image's directory (checked to exist), links resolved.
    pub path: PathBuf,
    /// The format from the backing format extension, when there is one.
    pub format: Option<ImageFormat>,
}

/// Reads and validates the header of the qcow2 image at `path`.
pub(crate) fn read_header(path: &Path) -> Result<Header> {
    let f = LayerFile::open(path, false)
        .map_err(|e| Error::from_io(e, Op::Open, 0, 0, path.display().to_string()))?;
    let len = f
        .size()
        .map_err(|e| Error::from_io(e, Op::Open, 0, 0, path.display().to_string()))?;
    let mut first = vec![0u8; len.min(crate::header::HEADER_READ_LEN as u64) as usize];
    f.read_exact_at(&mut first, 0)
        .map_err(|e| Error::from_io(e, Op::Open, 0, 0, path.display().to_string()))?;
    Header::parse(&first, len).map_err(|e| {
        file_error(
            ErrorKind::Invalid,
            Op::Open,
            0,
            path,
            format!("{e}; check the image with `qemu-img check`"),
        )
    })
}

/// The backing file named by the qcow2 header of `path`, if any (a file an administrator
/// names: see the module doc).
pub(crate) fn backing_ref(path: &Path) -> Result<Option<BackingRef>> {
    let header = read_header(path)?;
    let Some(name) = header.backing_file else {
        return Ok(None);
    };
    let resolved = resolve_backing(path, &name);
    let format = header
        .backing_format
        .as_deref()
        .map(|n| ImageFormat::from_name(n, path))
        .transpose()?;
    if !layerfile::exists(&resolved) {
        return Err(file_error(ErrorKind::Invalid, Op::Open, 0, path, format!(
            "backing file {name:?} (resolved to {}) does not exist: restore it or rebase the image with `qemu-img rebase`", resolved.display())));
    }
    Ok(Some(BackingRef {
        path: resolve_named(&resolved)?,
        format,
    }))
}

/// One layer of an opened chain, with its own type kept (merging asks each layer what it
/// holds itself, which a `dyn BlockDev` of the whole chain cannot say).
#[derive(Debug, Clone)]
pub(crate) struct Layer {
    pub path: PathBuf,
    pub format: ImageFormat,
    /// This layer and everything below it (as the hook made it).
    pub dev: Arc<dyn BlockDev>,
    /// The same device when it is qcow2, for per-layer allocation lookups.
    pub qcow2: Option<Arc<Qcow2Image>>,
}

/// Opens a recorded chain (bottom first) layer by layer, checked as [`open_recorded`]
/// checks it: index 0 of the result is the top, the last is the base.
pub(crate) fn open_layers(chain: &[LayerSpec]) -> Result<Vec<Layer>> {
    open_specs(chain, true, &|_, dev| dev)
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
pub fn create(
    path: impl AsRef<Path>,
    size: u64,
    backing: Option<(&str, ImageFormat)>,
    cluster_bits: u32,
) -> Result<()> {
    let path = path.as_ref();
    let invalid = |m: String| file_error(ErrorKind::Invalid, Op::Open, 0, path, m);
    if !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&cluster_bits) {
        return Err(invalid(format!(
            "cluster_bits {cluster_bits} is outside 9..=21"
        )));
    }
    let cs = 1u64 << cluster_bits;
    let l1_entries = Header::l1_entries_for(size, cluster_bits);
    if l1_entries * 8 > crate::header::MAX_L1_BYTES {
        return Err(invalid(format!(
            "{size} bytes need an L1 table above 32 MiB: use larger clusters"
        )));
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
            return Err(invalid(format!(
                "the backing file name must be 1 to 1023 bytes, got {}",
                name.len()
            )));
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
        return Err(invalid(
            "the header and backing file name do not fit in one cluster: use larger clusters"
                .into(),
        ));
    }
    let mut image = vec![0u8; (used * cs) as usize];
    image[..first.len()].copy_from_slice(&first);
    image[cs as usize..cs as usize + 8].copy_from_slice(&(2 * cs).to_be_bytes());
    for c in 0..used as usize {
        let at = 2 * cs as usize + 2 * c;
        image[at..at + 2].copy_from_slice(&1u16.to_be_bytes());
    }
    let io = |e: std::io::Error| Error::from_io(e, Op::Open, 0, 0, path.display().to_string());
    // A new layer: made, never opened through an existing name; the owner's group may read it.
    let file = storefile::create_new(path, storefile::SHARED_READ).map_err(io)?;
    // A failed write (a full file system) must not leave a half-made image behind.
    file.write_all_at(&image, 0)
        .and_then(|()| file.sync_all())
        .map_err(|e| {
            let _ = std::fs::remove_file(path);
            io(e)
        })
}
