//! Importing a chain of images as a vDisk whose versions are the children: a PVS chain (a
//! base VHD or VHDX with differencing children, VHD of disk type 4 or AVHDX, which qemu
//! cannot read), or a qcow2 chain (a raw or qcow2 base with qcow2 children). `vhd.rs`,
//! `vhdx.rs` and the qcow2 crate read the files; each implements [`DifferencingLayer`], so
//! the import loop is one: each child, checked to name the file before it as its parent
//! (VHD: unique id; VHDX: `parent_linkage` against the parent's DataWriteGuid; qcow2: the
//! backing file its header names is the file given before it) before anything is made,
//! becomes one version over the previous layer holding exactly what the child defines
//! (its sectors, and zeros where it says zero), released to production.
//!
//! Only the files the command names are opened: a child's parent is compared with the
//! file before it, never opened by the name the child gives.
//!
//! Invariant: any failure after the base was imported deletes the whole new vDisk.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use vdstream_blockdev::{BlockDev, MemoryDev};
use vdstream_qcow2::{Holding, OpenOptions, Qcow2Image};

use crate::copy::Progress;
use crate::error::{io, Result, StoreError};
use crate::meta::VdiskMeta;
use crate::select::Selector;
use crate::store::Store;
use crate::vdisk::{ImportReport, NewVdisk};
use crate::vhd::Vhd;
use crate::vhdx::{Run, Vhdx};

/// One file of a VHD or VHDX chain, read natively.
pub trait DifferencingLayer {
    /// "VHD" or "VHDX", for messages.
    fn kind(&self) -> &'static str;
    /// Guest size in bytes.
    fn size(&self) -> u64;
    /// Whether the file is a differencing one (a child).
    fn is_differencing(&self) -> bool;
    /// The identity a child names as its parent (VHD unique id, VHDX DataWriteGuid).
    fn identity(&self) -> String;
    /// The identity of this file's parent, if it is a child.
    fn parent_identity(&self) -> Option<String>;
    /// Calls `f` for every run the file defines over its parent (never crossing a block).
    fn for_each_run(&self, f: &mut dyn FnMut(u64, Run<'_>) -> Result<()>) -> Result<()>;
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl DifferencingLayer for Vhd {
    fn kind(&self) -> &'static str {
        "VHD"
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn is_differencing(&self) -> bool {
        self.disk_type == 4
    }
    fn identity(&self) -> String {
        hex(&self.unique_id)
    }
    fn parent_identity(&self) -> Option<String> {
        self.is_differencing().then(|| hex(&self.parent_id))
    }
    fn for_each_run(&self, f: &mut dyn FnMut(u64, Run<'_>) -> Result<()>) -> Result<()> {
        Vhd::for_each_run(self, &mut |off, data| f(off, Run::Data(data)))
    }
}

impl DifferencingLayer for Vhdx {
    fn kind(&self) -> &'static str {
        "VHDX"
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn is_differencing(&self) -> bool {
        self.has_parent
    }
    fn identity(&self) -> String {
        self.data_write_guid.clone()
    }
    fn parent_identity(&self) -> Option<String> {
        // A child without a parent_linkage names no parent: "" matches no DataWriteGuid.
        self.has_parent
            .then(|| self.parent_linkage().unwrap_or_default())
    }
    fn for_each_run(&self, f: &mut dyn FnMut(u64, Run<'_>) -> Result<()>) -> Result<()> {
        Vhdx::for_each_run(self, f)
    }
}

/// A file's identity for parent checks: its device and inode (`None` when it cannot be
/// stat'ed, which then matches nothing).
fn file_identity(path: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path)
        .ok()
        .map(|m| format!("{}:{}", m.dev(), m.ino()))
}

/// A qcow2 file of a chain: a base with no backing file, or a child whose header names
/// its parent.
struct Qcow2Layer {
    img: Qcow2Image,
    identity: String,
    parent: Option<String>,
}

impl Qcow2Layer {
    fn open(path: &Path) -> Result<Self> {
        let header = crate::source::qcow2_header(path)?;
        // The parent is compared, never opened: a child reads zeros where it holds nothing.
        let parent = header.backing_file.as_deref().map(|name| {
            file_identity(&vdstream_qcow2::resolve_backing(path, name)).unwrap_or_default()
        });
        let below: Option<Arc<dyn BlockDev>> = parent
            .as_ref()
            .map(|_| Arc::new(MemoryDev::new(header.size)) as Arc<dyn BlockDev>);
        let img = Qcow2Image::open(
            path,
            OpenOptions {
                read_only: true,
                ..Default::default()
            },
            below,
        )?;
        Ok(Qcow2Layer {
            img,
            identity: file_identity(path).unwrap_or_default(),
            parent,
        })
    }
}

impl DifferencingLayer for Qcow2Layer {
    fn kind(&self) -> &'static str {
        "qcow2"
    }
    fn size(&self) -> u64 {
        self.img.size()
    }
    fn is_differencing(&self) -> bool {
        self.parent.is_some()
    }
    fn identity(&self) -> String {
        self.identity.clone()
    }
    fn parent_identity(&self) -> Option<String> {
        self.parent.clone()
    }
    fn for_each_run(&self, f: &mut dyn FnMut(u64, Run<'_>) -> Result<()>) -> Result<()> {
        const WINDOW: u64 = 4 << 20;
        let size = self.img.size();
        let mut buf = Vec::new();
        let mut at = 0;
        while at < size {
            let n = WINDOW.min(size - at);
            for (off, len, what) in self.img.own_extents(at, n)? {
                match what {
                    Holding::Data => {
                        buf.resize(len as usize, 0);
                        self.img.read_at(&mut buf, off)?;
                        f(off, Run::Data(&buf))?;
                    }
                    Holding::Zero => f(off, Run::Zero(len))?,
                    Holding::Backing => {}
                }
            }
            at += n;
        }
        Ok(())
    }
}

/// A raw base of a qcow2 chain: nothing to apply, only an identity to check the first
/// child against.
struct RawBase {
    size: u64,
    identity: String,
}

impl DifferencingLayer for RawBase {
    fn kind(&self) -> &'static str {
        "qcow2"
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn is_differencing(&self) -> bool {
        false
    }
    fn identity(&self) -> String {
        self.identity.clone()
    }
    fn parent_identity(&self) -> Option<String> {
        None
    }
    fn for_each_run(&self, _f: &mut dyn FnMut(u64, Run<'_>) -> Result<()>) -> Result<()> {
        Ok(())
    }
}

/// Opens a file of a chain by its format (read off its magic): VHD, VHDX, qcow2, or a
/// raw base. The kinds that chain together report one [`DifferencingLayer::kind`].
pub fn open_layer_file(path: &Path) -> Result<Box<dyn DifferencingLayer>> {
    let path = &std::fs::canonicalize(path).map_err(io("open", path))?;
    match crate::source::detect(path)? {
        "vhdx" => Ok(Box::new(Vhdx::open(path)?)),
        "vpc" => Ok(Box::new(Vhd::open(path)?)),
        "qcow2" => Ok(Box::new(Qcow2Layer::open(path)?)),
        "raw" => Ok(Box::new(RawBase { size: std::fs::metadata(path).map_err(io("stat", path))?.len(), identity: file_identity(path).unwrap_or_default() })),
        other => Err(StoreError::BadInput(format!(
            "{} is a {other} image: --version takes chains of VHD (.vhd), VHDX (.vhdx/.avhdx) or qcow2 files", path.display()))),
    }
}

/// A version's note for a child imported from `path`: its file name, escaped where it
/// holds control characters and cut to fit a note.
fn import_note(path: &Path) -> String {
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    format!("imported from {}", crate::names::printable(&name))
        .chars()
        .take(crate::names::MAX_TEXT_LEN)
        .collect()
}

impl Store {
    /// `vdisk import NAME BASE --version CHILD …`: a PVS chain of VHD or VHDX files. The
    /// base is imported as [`Store::import_vdisk`] does; each child, a differencing file
    /// of the same format whose parent is the file before it (checked before anything is
    /// made), becomes one version over the previous layer, released to production (note:
    /// "imported from FILE"). If any step fails, the whole vDisk is deleted again.
    pub fn import_chain(
        &self,
        name: &str,
        src: &Path,
        children: &[PathBuf],
        opts: NewVdisk,
        progress: Progress<'_>,
    ) -> Result<(VdiskMeta, ImportReport, Vec<crate::Version>)> {
        let base = open_layer_file(src)?;
        let kind = base.kind();
        if base.is_differencing() {
            return Err(StoreError::Refused(format!(
                "{} is itself a differencing {kind}: give the base of the chain first, then its children with --version", src.display())));
        }
        let mut parent_id = base.identity();
        let mut kids = Vec::new();
        for c in children {
            let k = open_layer_file(c)?;
            if k.kind() != kind || !k.is_differencing() {
                return Err(StoreError::Refused(format!(
                    "{} is not a differencing {kind} (it is a {}{}): --version takes the children of the base, in order",
                    c.display(), if k.is_differencing() { "differencing " } else { "" }, k.kind())));
            }
            if k.parent_identity().as_deref() != Some(parent_id.as_str()) {
                let what = match kind {
                    "VHD" => "its parent's unique id",
                    "VHDX" => "its parent_linkage (the parent's DataWriteGuid)",
                    _ => "the backing file its header names",
                };
                return Err(StoreError::Refused(format!(
                    "{} is not a child of {}: {what} does not match; give the children in chain order, each after its parent",
                    c.display(), if kids.is_empty() { src.display().to_string() } else { children[kids.len() - 1].display().to_string() })));
            }
            if k.size() != base.size() {
                return Err(StoreError::Refused(format!(
                    "{} is {} bytes, its base {}: a chain has one size",
                    c.display(),
                    k.size(),
                    base.size()
                )));
            }
            parent_id = k.identity();
            kids.push(k);
        }
        let (meta, report) = self.import_vdisk(name, src, opts, progress)?;
        let mut versions = Vec::new();
        let applied = (|| {
            for (k, path) in kids.iter().zip(children) {
                let v = self.new_version(name, Some(import_note(path)))?;
                let opened = self.open_layer(name, Selector::Maintenance, true)?;
                k.for_each_run(&mut |off, run| {
                    match run {
                        Run::Data(data) => opened.dev.write_at(data, off, false)?,
                        Run::Zero(n) => opened.dev.write_zeroes(
                            off,
                            n,
                            vdstream_blockdev::ZeroFlags::default(),
                        )?,
                    }
                    Ok(())
                })?;
                opened.dev.flush()?;
                drop(opened);
                versions.push(self.promote(name, v.number, crate::Access::Production, None)?);
            }
            Ok(())
        })();
        if let Err(e) = applied {
            if let Err(d) = self.delete_vdisk(name) {
                log::warn!("cannot delete the half-imported vDisk {name}: {d}; delete it with `vdstream vdisk delete {name}`");
            }
            return Err(e);
        }
        let meta = self.get(name).unwrap_or(meta);
        Ok((meta, report, versions))
    }
}
