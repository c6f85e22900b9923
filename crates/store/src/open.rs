//! Opening a layer of a vDisk for a target, an export or a merge.
//!
//! The layer is chosen once, under the store's shared lock, and its whole chain is opened
//! before the lock is released: from then on the [`OpenedLayer`] reads the same files
//! whatever later commands do to the metadata. Every file of the chain is held with a
//! shared `flock` (qcow2 layers take one themselves; the store takes one on every file,
//! raw bases included), and those locks are the reference counts that keep a retired file
//! on disk until the last reader drops it (store.rs deletes only files nobody locks).
//!
//! A maintenance version opened writable takes the exclusive lock on its file instead, so
//! it has one writer at a time and no reader beside it; a second writer is refused with
//! the holder's pid and command line. A `private` vDisk is its base, opened read-write
//! under an exclusive lock.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vdstream_blockdev::{BlockDev, FileDev, FileOptions};
use vdstream_qcow2::{LayerHook, LayerSpec, OpenOptions, Qcow2Image};

use crate::error::{io, Result, StoreError};
use crate::fsutil::{self, LockMode};
use crate::meta::{Access, DiskAccess, LayerFormat, MergeKind, VdiskMeta};
use crate::select::{select, Layer, Selector};
use crate::store::Store;
use crate::time::Timestamp;

/// A layer and the chain below it, open, with the locks that keep its files.
#[derive(Debug)]
pub struct OpenedLayer {
    pub dev: Arc<dyn BlockDev>,
    pub vdisk: String,
    pub layer: Layer,
    /// The version's access (`None` for the base).
    pub access: Option<Access>,
    pub writable: bool,
    /// The top file of the chain.
    pub path: PathBuf,
    pub format: LayerFormat,
    /// The metadata the layer was chosen from.
    pub meta: VdiskMeta,
    _held: Vec<File>,
}

/// The files of `layer`'s chain, base first, with their formats.
pub fn chain_files(meta: &VdiskMeta, layer: Layer) -> Vec<(String, LayerFormat)> {
    let mut out = vec![(meta.base.file.clone(), meta.base.format)];
    if let Layer::Version(n) = layer {
        for v in &meta.versions {
            out.push((v.file.clone(), LayerFormat::Qcow2));
            if v.number == n {
                break;
            }
        }
    }
    out
}

impl Store {
    /// The files of `layer`'s chain as the qcow2 crate opens them: each path with the
    /// format its record names, base first ([`Store::reader_chain`]).
    pub(crate) fn chain_specs(&self, meta: &VdiskMeta, layer: Layer) -> Result<Vec<LayerSpec>> {
        Ok(self
            .reader_chain(meta, layer)?
            .into_iter()
            .map(|(f, fmt)| LayerSpec::new(self.file_path(&meta.name, &f), fmt.image_format()))
            .collect())
    }

    /// The files of `layer`'s chain (base first, with formats) as a reader opens them now:
    /// what the metadata lists, except while a merge cut short by a crash is pending and
    /// the version above the merged ones already backs onto the merge's new file (merge.rs,
    /// step "re-pointed"). Then that version and those above it read through the new file,
    /// which the metadata names in `pending_merge`, and the merged layers below it are
    /// left out. Either way every file is one the metadata names.
    pub(crate) fn reader_chain(
        &self,
        meta: &VdiskMeta,
        layer: Layer,
    ) -> Result<Vec<(String, LayerFormat)>> {
        let files = chain_files(meta, layer);
        let Some(p) = &meta.pending_merge else {
            return Ok(files);
        };
        let Some(above) = p.above.and_then(|a| meta.version(a)) else {
            return Ok(files);
        };
        let Some(at) = files.iter().position(|(f, _)| *f == above.file) else {
            return Ok(files);
        };
        if backing_of(&self.file_path(&meta.name, &above.file))?.as_deref() != Some(p.file.as_str())
        {
            return Ok(files);
        }
        let merged = |f: &String| {
            meta.versions
                .iter()
                .any(|v| v.file == *f && p.merged.contains(&v.number))
        };
        let first_merged = match p.kind {
            MergeKind::Base => 0,
            MergeKind::Updates => files.iter().position(|(f, _)| merged(f)).unwrap_or(at),
        };
        let mut out = files[..first_merged].to_vec();
        out.push((p.file.clone(), LayerFormat::Qcow2));
        out.extend_from_slice(&files[at..]);
        Ok(out)
    }

    /// Opens the layer `sel` picks in vDisk `name`. With `write_maintenance`, a maintenance
    /// version (and a private vDisk) is opened read-write; everything else is read-only.
    pub fn open_layer(
        &self,
        name: &str,
        sel: Selector,
        write_maintenance: bool,
    ) -> Result<OpenedLayer> {
        self.open_layer_with(name, sel, write_maintenance, &|_, dev| dev)
    }

    /// [`Store::open_layer`], passing the device of every read-only layer of the chain
    /// through `hook` as it is opened (bottom first; see [`vdstream_qcow2::LayerHook`]).
    /// The writable top of a maintenance version is not passed. A private vDisk is not
    /// passed either: its one file is written in place by its writer.
    pub fn open_layer_with(
        &self,
        name: &str,
        sel: Selector,
        write_maintenance: bool,
        hook: LayerHook<'_>,
    ) -> Result<OpenedLayer> {
        let _l = self.lock(LockMode::Shared)?;
        let meta = self.load(name)?;
        if meta.access == DiskAccess::Private {
            if !matches!(
                sel,
                Selector::Base | Selector::Latest | Selector::Production | Selector::Maintenance
            ) {
                return Err(StoreError::BadInput(format!("vDisk {name} has private access and no versions: refer to it as {name} or {name}@base")));
            }
            return self.open_private(meta, write_maintenance);
        }
        let layer = select(&meta, sel, Timestamp::now())?;
        let files = self.reader_chain(&meta, layer)?;
        let top_path = self.file_path(name, &files.last().expect("base").0);
        for (f, _) in &files {
            let p = self.file_path(name, f);
            if !vdstream_blockdev::layerfile::exists(&p) {
                return Err(StoreError::MissingFile {
                    path: p,
                    advice: format!(
                        "{layer} of vDisk {name} needs it: restore it from backup, then check the chain with `qemu-img info --backing-chain {}` and `qemu-img check`",
                        top_path.display()),
                });
            }
        }
        let access = match layer {
            Layer::Base => None,
            Layer::Version(n) => meta.version(n).map(|v| v.access),
        };
        let writable = write_maintenance && access == Some(Access::Maintenance);
        let below = if writable {
            &files[..files.len() - 1]
        } else {
            &files[..]
        };
        let mut held = Vec::new();
        for (f, _) in below {
            let p = self.file_path(name, f);
            if !p.exists() {
                continue; // a sealed layer in object storage: nobody deletes it under us
            }
            match fsutil::hold_shared(&p)? {
                Some(h) => held.push(h),
                None => {
                    return Err(StoreError::Refused(format!(
                        "{} is open read-write ({}): {layer} of vDisk {name} is in maintenance; stop its maintenance target first",
                        p.display(), fsutil::describe_holders(&p))))
                }
            }
        }
        let format = files.last().expect("base").1;
        // Every layer in the format its record names, each over the layer recorded below
        // it; nothing a header names is opened (vdstream_qcow2::open_recorded).
        let specs: Vec<LayerSpec> = files
            .iter()
            .map(|(f, fmt)| LayerSpec::new(self.file_path(name, f), fmt.image_format()))
            .collect();
        let dev: Arc<dyn BlockDev> = if writable {
            let (top, below) = specs
                .split_last()
                .expect("a maintenance version has a layer below");
            let backing = vdstream_qcow2::open_recorded_with(below, hook)?;
            vdstream_qcow2::check_backing(&top.path, below.last())?;
            match Qcow2Image::open(
                &top_path,
                OpenOptions {
                    read_only: false,
                    ..Default::default()
                },
                Some(backing),
            ) {
                Ok(img) => Arc::new(img),
                Err(e) => {
                    return Err(writer_refused(
                        e,
                        &top_path,
                        &format!("{layer} of vDisk {name} is in maintenance and"),
                    ))
                }
            }
        } else {
            vdstream_qcow2::open_recorded_with(&specs, hook)?
        };
        Ok(OpenedLayer {
            dev,
            vdisk: name.into(),
            layer,
            access,
            writable,
            path: top_path,
            format,
            meta,
            _held: held,
        })
    }

    fn open_private(&self, meta: VdiskMeta, writable: bool) -> Result<OpenedLayer> {
        let name = meta.name.clone();
        let path = self.file_path(&name, &meta.base.file);
        if !path.exists() {
            return Err(StoreError::MissingFile {
                path,
                advice: format!("it is the base of vDisk {name}: restore it from backup"),
            });
        }
        let mut held = Vec::new();
        let what = format!("vDisk {name} has private access (one writer, no cache) and");
        let dev: Arc<dyn BlockDev> = match (meta.base.format, writable) {
            (LayerFormat::Raw, true) => {
                let f = fsutil::open_read(&path)?;
                if !fsutil::take_lock(&f, LockMode::Exclusive).map_err(io("lock", &path))? {
                    return Err(StoreError::Refused(format!(
                        "{what} is already open ({}): stop that target first",
                        fsutil::describe_holders(&path)
                    )));
                }
                held.push(f);
                Arc::new(FileDev::open(
                    &path,
                    FileOptions {
                        read_only: false,
                        direct: false,
                    },
                )?)
            }
            (LayerFormat::Qcow2, true) => match Qcow2Image::open(
                &path,
                OpenOptions {
                    read_only: false,
                    ..Default::default()
                },
                None,
            ) {
                Ok(img) => Arc::new(img),
                Err(e) => return Err(writer_refused(e, &path, &what)),
            },
            (_, false) => {
                match fsutil::hold_shared(&path)? {
                    Some(h) => held.push(h),
                    None => {
                        return Err(StoreError::Refused(format!(
                            "{what} is open read-write ({}): stop that target first",
                            fsutil::describe_holders(&path)
                        )))
                    }
                }
                vdstream_qcow2::open_recorded(&[LayerSpec::new(
                    &path,
                    meta.base.format.image_format(),
                )])?
            }
        };
        Ok(OpenedLayer {
            dev,
            vdisk: name,
            layer: Layer::Base,
            access: None,
            writable,
            path,
            format: meta.base.format,
            meta,
            _held: held,
        })
    }
}

/// Turns "the image is already open elsewhere" into a message naming the holder.
fn writer_refused(e: vdstream_blockdev::Error, path: &std::path::Path, what: &str) -> StoreError {
    let holders = fsutil::holders(path);
    if holders.is_empty() {
        return e.into();
    }
    StoreError::Refused(format!(
        "{what} already has a writer ({}) on {}: it takes one writer at a time; stop that target first",
        holders.join(", "), path.display()))
}

/// The backing file name in the header of the qcow2 image at `path` (file name only).
pub(crate) fn backing_of(path: &Path) -> Result<Option<String>> {
    let f = fsutil::open_read(path)?;
    let len = f.metadata().map_err(io("stat", path))?.len();
    let mut buf = vec![0u8; len.min(vdstream_qcow2::header::HEADER_READ_LEN as u64) as usize];
    f.read_exact_at(&mut buf, 0).map_err(io("read", path))?;
    let h = vdstream_qcow2::Header::parse(&buf, len).map_err(|e| StoreError::Corrupt {
        path: path.to_path_buf(),
        detail: e.to_string(),
        advice: "check it with `qemu-img check`, restore it from backup if it is damaged".into(),
    })?;
    Ok(h.backing_file.map(|b| {
        Path::new(&b)
            .file_name()
            .map_or(b.clone(), |n| n.to_string_lossy().into_owned())
    }))
}
