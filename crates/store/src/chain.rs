//! Importing a PVS chain: a base VHD or VHDX with differencing children (VHD of disk type
//! 4, or AVHDX), which qemu cannot read, as a vDisk whose versions are the children.
//! `vhd.rs` and `vhdx.rs` read the files; both implement [`DifferencingLayer`], so the
//! import loop is one: each child, checked to name the file before it as its parent
//! (VHD: unique id; VHDX: `parent_linkage` against the parent's DataWriteGuid) before
//! anything is made, becomes one version over the previous layer holding exactly what the
//! child defines (its sectors, and zeros where it says zero), released to production.
//!
//! Invariant: any failure after the base was imported deletes the whole new vDisk.

use std::path::{Path, PathBuf};

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
        self.has_parent.then(|| self.parent_linkage().unwrap_or_default())
    }
    fn for_each_run(&self, f: &mut dyn FnMut(u64, Run<'_>) -> Result<()>) -> Result<()> {
        Vhdx::for_each_run(self, f)
    }
}

/// Opens a VHD or VHDX file (told apart by the VHDX file type identifier).
pub fn open_layer_file(path: &Path) -> Result<Box<dyn DifferencingLayer>> {
    use std::io::Read;
    let mut sig = [0u8; 8];
    let n = std::fs::File::open(path).and_then(|mut f| f.read(&mut sig)).map_err(io("read", path))?;
    if n == 8 && &sig == b"vhdxfile" {
        Ok(Box::new(Vhdx::open(path)?))
    } else {
        Ok(Box::new(Vhd::open(path)?))
    }
}

impl Store {
    /// `vdisk import NAME BASE --version CHILD …`: a PVS chain of VHD or VHDX files. The
    /// base is imported as [`Store::import_vdisk`] does; each child, a differencing file
    /// of the same format whose parent is the file before it (checked before anything is
    /// made), becomes one version over the previous layer, released to production (note:
    /// "imported from FILE"). If any step fails, the whole vDisk is deleted again.
    pub fn import_chain(&self, name: &str, src: &Path, children: &[PathBuf], opts: NewVdisk, progress: Progress<'_>) -> Result<(VdiskMeta, ImportReport, Vec<crate::Version>)> {
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
                let what = if kind == "VHD" { "its parent's unique id" } else { "its parent_linkage (the parent's DataWriteGuid)" };
                return Err(StoreError::Refused(format!(
                    "{} is not a child of {}: {what} does not match; give the children in chain order, each after its parent",
                    c.display(), if kids.is_empty() { src.display().to_string() } else { children[kids.len() - 1].display().to_string() })));
            }
            if k.size() != base.size() {
                return Err(StoreError::Refused(format!("{} is {} bytes, its base {}: a chain has one size", c.display(), k.size(), base.size())));
            }
            parent_id = k.identity();
            kids.push(k);
        }
        let (meta, report) = self.import_vdisk(name, src, opts, progress)?;
        let mut versions = Vec::new();
        let applied = (|| {
            for (k, path) in kids.iter().zip(children) {
                let v = self.new_version(name, Some(format!("imported from {}", path.display())))?;
                let opened = self.open_layer(name, Selector::Maintenance, true)?;
                k.for_each_run(&mut |off, run| {
                    match run {
                        Run::Data(data) => opened.dev.write_at(data, off, false)?,
                        Run::Zero(n) => opened.dev.write_zeroes(off, n, vdstream_blockdev::ZeroFlags::default())?,
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
