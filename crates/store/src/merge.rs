//! Merges and compaction: the long operations, done in three steps so that the store is
//! locked only for moments:
//!
//! 1. plan, under the exclusive lock: check the rules, pick the files, note the
//!    metadata `generation`;
//! 2. write, with no store lock: `vdstream_qcow2::merge_layers` writes the new layer into
//!    a hidden temporary file beside the others (the chain it reads is held by `flock`);
//! 3. commit, under the exclusive lock: if the generation moved, the vDisk changed
//!    meanwhile and the merge is dropped (run it again); otherwise the file is renamed
//!    into place, the metadata rewritten, the old files retired, and the audit appended.
//!
//! Merge rules (docs/STORE.md explains them):
//! - nothing is merged while a version is in maintenance: vdstream does not rebase the
//!   maintenance version onto the merged layer, so it stays where it is;
//! - a merge never changes what production targets boot: if they boot a version other than
//!   the newest (which the merge would fold away), the merge is refused until the newest
//!   is promoted or reverted; `--base` also needs production to boot the newest version.
//!
//! Compaction rewrites each qcow2 layer except the maintenance one (its own backing file as
//! `stop_at`, so its content is unchanged) into a temporary file and renames it over the
//! old one; an open reader keeps the old inode. A raw base is compacted in place by
//! punching holes where 64 KiB blocks read as zeros.

use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

use serde::Serialize;
use serde_json::json;
use vdstream_qcow2::{merge_layers, MergeOptions};

use crate::copy::{Progress, ZERO_BLOCK};
use crate::error::{io, Result, StoreError};
use crate::fsutil::{self, LockMode};
use crate::meta::{Access, Base, DiskAccess, LayerFormat, VdiskMeta, Version};
use crate::select::{select, Layer, Selector};
use crate::store::Store;
use crate::time::Timestamp;

/// Which merge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MergeKind {
    /// All versions into one new version over the same base.
    Updates,
    /// The base and all versions into a new (qcow2) base.
    Base,
}

/// What a merge did.
#[derive(Debug, Clone, Serialize)]
pub struct MergeOutcome {
    pub kind: MergeKind,
    pub automatic: bool,
    pub merged: Vec<u32>,
    pub new_layer: Layer,
    pub file: String,
    /// Files retired (deleted now, or once their last reader is gone).
    pub retired: Vec<String>,
    pub still_in_use: Vec<String>,
    pub bytes_written: u64,
    pub seconds: f64,
}

/// What an automatic merge check decided.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AutoMerge {
    Merged(MergeOutcome),
    /// Over the limit, but a rule stops the merge for now; the reason says which.
    Deferred(String),
}

/// One compacted layer.
#[derive(Debug, Clone, Serialize)]
pub struct CompactedLayer {
    pub layer: Layer,
    pub file: String,
    pub bytes_before: u64,
    pub bytes_after: u64,
}

fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.blocks() * 512).unwrap_or(0)
}

/// Versions that count against `max_versions` (all but the maintenance one).
pub fn counted_versions(meta: &VdiskMeta) -> usize {
    meta.versions.iter().filter(|v| v.access != Access::Maintenance).count()
}

/// Checks the merge rules; returns the numbers to merge.
fn plan(meta: &VdiskMeta, kind: MergeKind) -> Result<Vec<u32>> {
    let name = &meta.name;
    if meta.access == DiskAccess::Private {
        return Err(StoreError::Refused(format!("vDisk {name} has private access and no versions to merge")));
    }
    if let Some(v) = meta.maintenance() {
        return Err(StoreError::Refused(format!(
            "version {} of {name} is in maintenance; vdstream does not merge while a maintenance version sits on the chain: promote it (`vdstream version promote {name} {} --to test`) or discard it (`vdstream version revert {name} {}`) first",
            v.number, v.number, v.number)));
    }
    let merged: Vec<u32> = meta.versions.iter().map(|v| v.number).collect();
    let Some(&k) = merged.last() else {
        return Err(StoreError::Refused(format!("vDisk {name} has no versions to merge")));
    };
    if kind == MergeKind::Updates && merged.len() < 2 {
        return Err(StoreError::Refused(format!("vDisk {name} has one version ({k}); there is nothing to merge")));
    }
    let newest = meta.version(k).expect("listed");
    let production = select(meta, Selector::Production, Timestamp::now())?;
    let why = match (kind, production) {
        (_, Layer::Version(p)) if p != k => Some(format!("production targets boot version {p}, which the merge would fold into version {k} ({})", newest.access.name())),
        (MergeKind::Base, Layer::Base) => Some(format!("production targets boot the base, and merge --base would give them version {k} ({})", newest.access.name())),
        _ => None,
    };
    if let Some(why) = why {
        let pin = if meta.override_version.is_some_and(|o| o != k) { " or clear the override (`version override --clear`)" } else { "" };
        return Err(StoreError::Refused(format!(
            "{why}: promote version {k} to production (`vdstream version promote {name} {k} --to production`){pin} first, or revert it")));
    }
    Ok(merged)
}

impl Store {
    /// `version merge NAME [--base]`.
    pub fn merge(&self, name: &str, kind: MergeKind, automatic: bool, progress: Progress<'_>) -> Result<MergeOutcome> {
        let started = std::time::Instant::now();
        let (meta, merged) = {
            let _l = self.lock(LockMode::Exclusive)?;
            let meta = self.load(name)?;
            let merged = plan(&meta, kind)?;
            (meta, merged)
        };
        let number = meta.next_version;
        let file = match kind {
            MergeKind::Updates => format!("{name}.{number}.qcow2"),
            MergeKind::Base => format!("{name}.base-{number}.qcow2"),
        };
        let k = meta.version(*merged.last().expect("planned")).expect("listed").clone();
        let top = self.file_path(name, &k.file);
        let base = self.file_path(name, &meta.base.file);
        let dst = self.file_path(name, &file);
        let tmp = fsutil::temp_beside(&dst);
        let _ = std::fs::remove_file(&tmp);
        let stop_at = (kind == MergeKind::Updates).then_some(base.as_path());
        let report = merge_layers(&top, stop_at, &tmp, &MergeOptions::default(), progress)?;

        let _l = self.lock(LockMode::Exclusive)?;
        let mut m = self.load(name)?;
        if m.generation != meta.generation {
            let _ = std::fs::remove_file(&tmp);
            return Err(StoreError::Refused(format!(
                "vDisk {name} changed while the merge ran (see `vdstream audit {name}`); nothing was changed: run the merge again")));
        }
        if dst.exists() {
            let _ = std::fs::remove_file(&tmp);
            return Err(StoreError::Refused(format!("{} exists but the metadata does not list it: move it away and run the merge again", dst.display())));
        }
        std::fs::rename(&tmp, &dst).map_err(io("move into place", &dst))?;
        fsutil::sync_dir(&self.vdisk_dir(name))?;
        let mut retired: Vec<String> = m.versions.iter().map(|v| v.file.clone()).collect();
        let new_layer = match kind {
            MergeKind::Updates => {
                m.versions = vec![Version {
                    number,
                    file: file.clone(),
                    access: k.access,
                    created: Timestamp::now(),
                    created_by: self.actor().who(),
                    promoted: k.promoted.clone(),
                    scheduled_at: k.scheduled_at,
                    note: Some(format!("merge of versions {}", merged.iter().map(u32::to_string).collect::<Vec<_>>().join(", "))),
                    merged_from: merged.clone(),
                }];
                if m.override_version.is_some() {
                    m.override_version = Some(number);
                }
                Layer::Version(number)
            }
            MergeKind::Base => {
                retired.insert(0, m.base.file.clone());
                m.base = Base { file: file.clone(), format: LayerFormat::Qcow2, created: Timestamp::now(), created_by: self.actor().who() };
                m.versions.clear();
                m.override_version = None;
                Layer::Base
            }
        };
        m.next_version = number + 1;
        m.retired.extend(retired.iter().cloned());
        self.collect_retired(&mut m)?;
        let still_in_use = m.retired.iter().filter(|f| retired.contains(f)).cloned().collect();
        self.save(&mut m)?;
        let outcome = MergeOutcome {
            kind,
            automatic,
            merged,
            new_layer,
            file,
            retired,
            still_in_use,
            bytes_written: report.bytes_written,
            seconds: started.elapsed().as_secs_f64(),
        };
        self.audit("version.merge", name, serde_json::to_value(&outcome).expect("serializes"))?;
        Ok(outcome)
    }

    /// After a change: merges the updates if the versions outside maintenance exceed
    /// `max_versions`. `None` when under the limit.
    pub fn auto_merge(&self, name: &str, progress: Progress<'_>) -> Result<Option<AutoMerge>> {
        let meta = self.get(name)?;
        if counted_versions(&meta) <= meta.max_versions as usize {
            return Ok(None);
        }
        match self.merge(name, MergeKind::Updates, true, progress) {
            Ok(o) => Ok(Some(AutoMerge::Merged(o))),
            Err(StoreError::Refused(why)) => {
                let _l = self.lock(LockMode::Exclusive)?;
                self.audit("version.merge.deferred", name, json!({"versions": counted_versions(&meta), "max_versions": meta.max_versions, "reason": why}))?;
                Ok(Some(AutoMerge::Deferred(why)))
            }
            Err(e) => Err(e),
        }
    }

    /// `vdisk compact NAME`: drops zero and unused clusters from every layer but the
    /// maintenance version.
    pub fn compact(&self, name: &str, progress: Progress<'_>) -> Result<Vec<CompactedLayer>> {
        let meta = self.get(name)?;
        let mut out = Vec::new();
        let mut parent: Option<String> = None;
        let mut layers = vec![(Layer::Base, meta.base.file.clone(), meta.base.format)];
        layers.extend(meta.versions.iter().filter(|v| v.access != Access::Maintenance).map(|v| (Layer::Version(v.number), v.file.clone(), LayerFormat::Qcow2)));
        let total = layers.len() as u64 * meta.size;
        for (done_layers, (layer, file, format)) in (0u64..).zip(layers) {
            let path = self.file_path(name, &file);
            let before = allocated(&path);
            let mut sub = |d: u64, _t: u64| progress(done_layers * meta.size + d, total);
            match format {
                LayerFormat::Raw => punch_zeros(&path, &mut sub)?,
                LayerFormat::Qcow2 => {
                    let tmp = fsutil::temp_beside(&path);
                    let _ = std::fs::remove_file(&tmp);
                    let stop = parent.as_ref().map(|p| self.file_path(name, p));
                    merge_layers(&path, stop.as_deref(), &tmp, &MergeOptions::default(), &mut sub)?;
                    let _l = self.lock(LockMode::Exclusive)?;
                    let now = self.load(name)?;
                    let exists = match layer {
                        Layer::Base => now.base.file == file,
                        Layer::Version(n) => now.version(n).is_some_and(|v| v.file == file),
                    };
                    let files: Vec<String> = crate::open::chain_files(&now, layer).into_iter().map(|f| f.0).collect();
                    let want: Vec<String> = parent.iter().cloned().chain(std::iter::once(file.clone())).collect();
                    let unchanged = exists && files.ends_with(&want) && (parent.is_some() || files.len() == 1);
                    if !unchanged {
                        let _ = std::fs::remove_file(&tmp);
                        return Err(StoreError::Refused(format!(
                            "vDisk {name} changed while compacting {layer} (see `vdstream audit {name}`); the layers done so far are compacted: run it again")));
                    }
                    std::fs::rename(&tmp, &path).map_err(io("move into place", &path))?;
                    fsutil::sync_dir(&self.vdisk_dir(name))?;
                }
            }
            out.push(CompactedLayer { layer, file: file.clone(), bytes_before: before, bytes_after: allocated(&path) });
            parent = Some(file);
        }
        progress(total, total);
        let _l = self.lock(LockMode::Exclusive)?;
        self.audit("vdisk.compact", name, serde_json::to_value(&out).expect("serializes"))?;
        Ok(out)
    }
}

/// Punches holes where 64 KiB blocks of a raw file read as zeros (content unchanged).
fn punch_zeros(path: &Path, progress: Progress<'_>) -> Result<()> {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).map_err(io("open", path))?;
    let len = f.metadata().map_err(io("stat", path))?.len();
    let mut buf = vec![0u8; ZERO_BLOCK];
    let mut off = 0;
    while off < len {
        let n = ((len - off) as usize).min(ZERO_BLOCK);
        f.read_exact_at(&mut buf[..n], off).map_err(io("read", path))?;
        if buf[..n].iter().all(|&b| b == 0) {
            // SAFETY: fallocate takes the descriptor `f` keeps open and integers only.
            let rc = unsafe { libc::fallocate(f.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, off as i64, n as i64) };
            if rc != 0 {
                return Err(io("punch holes in", path)(std::io::Error::last_os_error()));
            }
        }
        off += n as u64;
        if off % (4 << 20) == 0 || off == len {
            progress(off, len);
        }
    }
    f.sync_all().map_err(io("fsync", path))
}
