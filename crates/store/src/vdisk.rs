//! vDisk commands: create, import, set, info, export, delete.
//!
//! A new vDisk is built in a hidden folder `vdisks/.NAME.import-PID/` (no lock held while
//! bytes are copied), then, under the exclusive lock, its `vdisk.json` is written there
//! and the folder is renamed to `vdisks/NAME/` in one step: a vDisk is either wholly there
//! or not at all, and two imports of one name cannot both win.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::check;
use crate::copy::{self, Progress};
use crate::error::{io, Result, StoreError};
use crate::fsutil::{self, LockMode};
use crate::meta::{
    Base, DiskAccess, LayerFormat, VdiskMeta, DEFAULT_MAX_VERSIONS, FORMAT_VERSION, VDISK_FORMAT,
};
use crate::names::validate_name;
use crate::open::chain_files;
use crate::select::{select, Layer, Selector};
use crate::source;
use crate::store::Store;
use crate::time::Timestamp;

/// Formats `vdisk import` takes, besides raw (`vpc` is qemu's name for VHD).
pub const CONVERTED_FORMATS: [&str; 5] = ["qcow2", "vhdx", "vpc", "vmdk", "vdi"];

/// Options of a new vDisk.
#[derive(Debug, Clone, Copy)]
pub struct NewVdisk {
    pub access: DiskAccess,
    pub max_versions: u32,
}

impl Default for NewVdisk {
    fn default() -> Self {
        NewVdisk {
            access: DiskAccess::Standard,
            max_versions: DEFAULT_MAX_VERSIONS,
        }
    }
}

/// What an import did.
#[derive(Debug, Clone, Serialize)]
pub struct ImportReport {
    pub source_format: String,
    pub size: u64,
    pub base_file: String,
    /// `native` (raw sparse copy) or `qemu-img convert`.
    pub method: &'static str,
    /// What the source check noticed that did not stop the import (leaked clusters).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// Checks a guest size.
pub fn check_size(size: u64) -> Result<()> {
    if size == 0 || size % 512 != 0 {
        return Err(StoreError::BadInput(format!(
            "size {size} bytes is not allowed: a vDisk size is a positive multiple of 512 bytes; give it with a unit K, M, G or T (e.g. 64M, 40G)")));
    }
    Ok(())
}

/// Checks `--max-versions`.
pub fn check_max_versions(n: u32) -> Result<()> {
    if n == 0 {
        return Err(StoreError::BadInput(
            "--max-versions must be at least 1".into(),
        ));
    }
    Ok(())
}

/// Per-layer facts for `vdisk info`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LayerInfo {
    pub layer: Layer,
    pub file: String,
    /// Bytes the file takes on disk.
    pub allocated: u64,
    /// Processes that have the file open (from `/proc/locks`).
    pub in_use_by: Vec<String>,
    /// What is wrong with the file, from its size and header (see check.rs,
    /// `layer_health`); empty when it looks sound. `vdisk check` checks it in full.
    #[serde(default)]
    pub problems: Vec<String>,
}

/// `vdisk info`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VdiskInfo {
    pub meta: VdiskMeta,
    pub production: Layer,
    pub test: Layer,
    pub maintenance: Option<u32>,
    pub layers: Vec<LayerInfo>,
}

impl Store {
    fn staging_dir(&self, name: &str) -> PathBuf {
        self.root()
            .join("vdisks")
            .join(format!(".{name}.import-{}", std::process::id()))
    }

    fn refuse_existing(&self, name: &str) -> Result<()> {
        if self.vdisk_dir(name).exists() {
            return Err(StoreError::Refused(format!(
                "vDisk {name} already exists in {}: choose another name, or delete it first with `vdstream vdisk delete {name}`", self.root().display())));
        }
        Ok(())
    }

    fn new_meta(
        &self,
        name: &str,
        size: u64,
        base: (String, LayerFormat),
        opts: NewVdisk,
    ) -> VdiskMeta {
        let now = Timestamp::now();
        VdiskMeta {
            format: VDISK_FORMAT.into(),
            format_version: FORMAT_VERSION,
            name: name.into(),
            size,
            access: opts.access,
            max_versions: opts.max_versions,
            base: Base {
                file: base.0,
                format: base.1,
                created: now,
                created_by: self.actor().who(),
            },
            versions: vec![],
            next_version: 1,
            override_version: None,
            retired: vec![],
            generation: 0,
            created: now,
            created_by: self.actor().who(),
            pending_merge: None,
        }
    }

    /// Moves a staged vDisk into place under the exclusive lock and audits `action`.
    fn commit_staged(
        &self,
        staging: &Path,
        mut meta: VdiskMeta,
        action: &str,
        details: serde_json::Value,
    ) -> Result<()> {
        let _l = self.lock(LockMode::Exclusive)?;
        self.refuse_existing(&meta.name)?;
        meta.generation = 1;
        meta.check().map_err(StoreError::BadInput)?;
        fsutil::write_atomic(
            &staging.join("vdisk.json"),
            &serde_json::to_vec_pretty(&meta).expect("serializes"),
        )?;
        let dst = self.vdisk_dir(&meta.name);
        std::fs::rename(staging, &dst).map_err(io("move into place", &dst))?;
        fsutil::sync_dir(&self.root().join("vdisks"))?;
        self.audit(action, &meta.name, details)
    }

    fn stage(&self, name: &str) -> Result<PathBuf> {
        validate_name(name)?;
        self.refuse_existing(name)?;
        let staging = self.staging_dir(name);
        let _ = std::fs::remove_dir_all(&staging);
        fsutil::create_dir_all(&staging)?;
        Ok(staging)
    }

    /// `vdisk create NAME --size SIZE`: an empty qcow2 base.
    pub fn create_vdisk(&self, name: &str, size: u64, opts: NewVdisk) -> Result<VdiskMeta> {
        check_size(size)?;
        check_max_versions(opts.max_versions)?;
        let staging = self.stage(name)?;
        let result = (|| {
            let file = format!("{name}.base.qcow2");
            vdstream_qcow2::create(staging.join(&file), size, None, 16)?;
            let meta = self.new_meta(name, size, (file, LayerFormat::Qcow2), opts);
            self.commit_staged(
                &staging,
                meta.clone(),
                "vdisk.create",
                json!({"size": size, "access": opts.access, "max_versions": opts.max_versions}),
            )?;
            Ok(meta)
        })();
        if result.is_err() {
            let _ = std::fs::remove_dir_all(&staging);
        }
        result
    }

    /// `vdisk import NAME FILE`: raw is copied natively (sparse); qcow2, vhdx, vpc, vmdk and
    /// vdi are checked (check.rs; a damaged source is refused before anything is made) and
    /// go through `qemu-img convert` into a qcow2 base. The format is read off the file's
    /// magic, and a file whose metadata names any other file is refused, before qemu-img
    /// opens it (source.rs).
    pub fn import_vdisk(
        &self,
        name: &str,
        src: &Path,
        opts: NewVdisk,
        progress: Progress<'_>,
    ) -> Result<(VdiskMeta, ImportReport)> {
        check_max_versions(opts.max_versions)?;
        validate_name(name)?;
        let source = source::inspect(src)?;
        let info = if source.format == "raw" {
            copy::ImageInfo {
                format: "raw".into(),
                virtual_size: std::fs::metadata(&source.path)
                    .map_err(io("stat", src))?
                    .len(),
            }
        } else {
            copy::qemu_info(&source)?.ok_or_else(|| StoreError::Tool(format!(
                "{} is a {} image, which vdstream imports through qemu-img: install it (Debian: apt-get install qemu-utils)", src.display(), source.format)))?
        };
        let method = if info.format == "raw" {
            "native"
        } else {
            "qemu-img convert"
        };
        check_size(info.virtual_size).map_err(|_| {
            StoreError::BadInput(format!(
                "{} is {} bytes, not a multiple of 512: pad it first (truncate -s %512 FILE)",
                src.display(),
                info.virtual_size
            ))
        })?;
        self.refuse_existing(name)?;
        // Before anything is made: a damaged source is refused (check.rs).
        let warnings = check::check_source(&source)?;
        let staging = self.stage(name)?;
        let result = (|| {
            let (file, format) = if method == "native" {
                let file = format!("{name}.base.raw");
                copy::copy_raw_sparse(&source.path, &staging.join(&file), progress)?;
                (file, LayerFormat::Raw)
            } else {
                let file = format!("{name}.base.qcow2");
                copy::qemu_convert(
                    &source.qemu_spec(),
                    src,
                    &staging.join(&file),
                    "qcow2",
                    info.virtual_size,
                    progress,
                )?;
                fsutil::restrict(&staging.join(&file), fsutil::SHARED_READ)?;
                (file, LayerFormat::Qcow2)
            };
            let report = ImportReport {
                source_format: info.format.clone(),
                size: info.virtual_size,
                base_file: file.clone(),
                method,
                warnings: warnings.clone(),
            };
            let meta = self.new_meta(name, info.virtual_size, (file, format), opts);
            self.commit_staged(&staging, meta.clone(), "vdisk.import", json!({
                "source": src.display().to_string(), "source_format": info.format, "size": info.virtual_size, "method": method,
            }))?;
            Ok((meta, report))
        })();
        if result.is_err() {
            let _ = std::fs::remove_dir_all(&staging);
        }
        result
    }

    /// `vdisk set NAME [--max-versions N] [--access A]`.
    pub fn set_vdisk(
        &self,
        name: &str,
        max_versions: Option<u32>,
        access: Option<DiskAccess>,
    ) -> Result<VdiskMeta> {
        if let Some(n) = max_versions {
            check_max_versions(n)?;
        }
        let targets = if access == Some(DiskAccess::Private) {
            let _l = self.lock(LockMode::Shared)?;
            self.targets_using(name)?
        } else {
            vec![]
        };
        self.update(name, "vdisk.set", |m| {
            let mut details = json!({});
            if let Some(n) = max_versions {
                details["max_versions"] = json!({"from": m.max_versions, "to": n});
                m.max_versions = n;
            }
            if let Some(a) = access {
                if a == DiskAccess::Private && !m.versions.is_empty() {
                    return Err(StoreError::Refused(format!(
                        "vDisk {name} has {} versions; private access has none: merge them into a new base first (`vdstream version merge {name} --base`)",
                        m.versions.len())));
                }
                if a == DiskAccess::Private && m.access != DiskAccess::Private && !targets.is_empty() {
                    return Err(StoreError::Refused(format!(
                        "vDisk {name} is booted by targets {} through their write caches; private access has none: move or remove those targets first",
                        targets.join(", "))));
                }
                details["access"] = json!({"from": m.access, "to": a});
                m.access = a;
            }
            Ok((m.clone(), details))
        })
    }

    /// `vdisk info NAME`.
    pub fn info(&self, name: &str) -> Result<VdiskInfo> {
        use std::os::unix::fs::MetadataExt;
        let meta = self.get(name)?;
        let now = Timestamp::now();
        let mut layers = Vec::new();
        let all = std::iter::once(Layer::Base)
            .chain(meta.versions.iter().map(|v| Layer::Version(v.number)));
        let mut below: Option<(String, LayerFormat)> = None;
        for (layer, (file, format)) in all.zip(chain_files(
            &meta,
            meta.newest()
                .map_or(Layer::Base, |v| Layer::Version(v.number)),
        )) {
            let p = self.file_path(name, &file);
            let allocated = std::fs::metadata(&p).map(|m| m.blocks() * 512).unwrap_or(0);
            let problems = check::layer_health(
                &p,
                format,
                meta.size,
                below
                    .as_ref()
                    .map(|(f, fmt): &(String, LayerFormat)| (f.as_str(), *fmt)),
            );
            below = Some((file.clone(), format));
            layers.push(LayerInfo {
                layer,
                file,
                allocated,
                in_use_by: fsutil::holders(&p),
                problems,
            });
        }
        Ok(VdiskInfo {
            production: select(&meta, Selector::Production, now)?,
            test: select(&meta, Selector::Test, now)?,
            maintenance: meta.maintenance().map(|v| v.number),
            layers,
            meta,
        })
    }

    /// `vdisk export NAME[@V] FILE [--format raw|qcow2]`. Returns the layer exported.
    pub fn export(
        &self,
        name: &str,
        sel: Selector,
        dst: &Path,
        format: LayerFormat,
        overwrite: bool,
        progress: Progress<'_>,
    ) -> Result<Layer> {
        let opened = self.open_layer(name, sel, false)?;
        match format {
            LayerFormat::Raw => {
                copy::export_raw(&*opened.dev, dst, overwrite, progress)?;
            }
            LayerFormat::Qcow2 => {
                if dst.exists() && !overwrite {
                    return Err(StoreError::Refused(format!(
                        "{} already exists: choose another file or pass --force to overwrite it",
                        dst.display()
                    )));
                }
                // The chain stays locked (opened) while qemu-img reads it, through a spec
                // that names each recorded layer and its format.
                let chain = self.chain_specs(&opened.meta, opened.layer)?;
                copy::qemu_convert(
                    &crate::source::chain_spec(&chain),
                    &opened.path,
                    dst,
                    "qcow2",
                    opened.meta.size,
                    progress,
                )?;
            }
        }
        Ok(opened.layer)
    }

    /// `vdisk delete NAME`: refused while any of its files is open.
    pub fn delete_vdisk(&self, name: &str) -> Result<Vec<String>> {
        validate_name(name)?;
        let _l = self.lock(LockMode::Exclusive)?;
        let dir = self.vdisk_dir(name);
        if !dir.is_dir() {
            self.load(name)?; // the "unknown vDisk" error, with the known names
        }
        let targets = self.targets_using(name)?;
        if !targets.is_empty() {
            return Err(StoreError::Refused(format!(
                "vDisk {name} is booted by targets {}: move them to another vDisk (`vdstream target set ID --vdisk OTHER`) or remove them (`vdstream target remove ID`) first",
                targets.join(", "))));
        }
        let mut files = Vec::new();
        for e in std::fs::read_dir(&dir).map_err(io("list", &dir))? {
            let e = e.map_err(io("list", &dir))?;
            let p = e.path();
            if p.is_file() && fsutil::in_use(&p)? {
                return Err(StoreError::Refused(format!(
                    "vDisk {name} is in use: {} is open ({}); stop its targets first",
                    p.display(),
                    fsutil::describe_holders(&p)
                )));
            }
            files.push(e.file_name().to_string_lossy().into_owned());
        }
        std::fs::remove_dir_all(&dir).map_err(io("delete", &dir))?;
        fsutil::sync_dir(&self.root().join("vdisks"))?;
        files.sort();
        self.audit("vdisk.delete", name, json!({"files": files}))?;
        Ok(files)
    }
}
