//! Merges and compaction: the long operations, done in steps so that the store is locked
//! only for moments.
//!
//! A merge folds the versions **up to and including the one production boots now** into
//! one new layer (`--base`: the base too); versions above it stay, with their numbers and
//! access, and the first of them is re-pointed onto the new layer. The new layer's content
//! equals that of the version it replaces, byte for byte, so no target (production, test,
//! maintenance, `NAME@N` of a version that stays) sees a change.
//!
//! 1. plan, under the exclusive lock: check the rules, pick the versions, note the
//!    metadata `generation`; refuse if a writer holds the version that must be re-pointed;
//! 2. write, with no store lock: `vdstream_qcow2::merge_layers` writes the new layer into
//!    a hidden temporary file beside the others (the chain it reads is held by `flock`),
//!    fsynced;
//! 3. commit, under the exclusive lock, if the generation did not move (else the merge is
//!    dropped: run it again), in this order:
//!
//! | step | does | a crash right after it leaves | the next command (`recover`) |
//! |---|---|---|---|
//! | pending  | metadata names the new file in `pending_merge`, takes its number | a temporary file; the chain untouched | undoes: drops the record (gc removes the temporary file) |
//! | renamed  | the new file gets its name (fsync folder) | a complete new file nobody points at | undoes: retires the new file |
//! | re-pointed | the version above names the new file as backing (fsync) | the version above reads the new file (same bytes); metadata still lists the old chain | finishes the merge |
//! | done     | metadata: merged versions replaced by the new one, old files retired, record dropped | the merged store | — |
//!
//! "Re-pointed" is read from the header of the version above, so recovery knows which
//! side of step 3 the crash fell on. With no version above, a new file in place means done.
//!
//! Re-pointing rewrites the header in place when nobody has the file open; when targets
//! read it (shared `flock`), a copy is re-pointed and renamed over it, so they keep the
//! old inode and its old chain; when a writer holds it (a maintenance target), the merge
//! is refused (deferred, when automatic) and the audit trail says why.
//!
//! Compaction rewrites each qcow2 layer except the maintenance one (its own backing file as
//! `stop_at`, so its content is unchanged) into a temporary file and renames it over the
//! old one; an open reader keeps the old inode. A raw base is compacted in place by
//! punching holes where 64 KiB blocks read as zeros.

use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::json;
use vdstream_qcow2::{merge_layers, set_backing_file, ImageFormat, MergeOptions};

use crate::copy::{Progress, ZERO_BLOCK};
use crate::error::{io, Result, StoreError};
use crate::fsutil::{self, Holders, LockMode};
use crate::meta::{
    Access, Base, DiskAccess, LayerFormat, MergeKind, PendingMerge, VdiskMeta, Version,
};
use crate::select::{select, Layer, Selector};
use crate::store::Store;
use crate::time::Timestamp;

/// The commit steps of a merge (see the table at the top of this module). Tests stop a
/// merge after one of them to leave the store as a crash there would.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MergeStep {
    Pending,
    Renamed,
    Repointed,
}

/// An override the merge moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OverrideMove {
    pub from: u32,
    /// `None`: cleared, because the pinned version became the base.
    pub to: Option<u32>,
}

/// What a merge did.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MergeOutcome {
    pub kind: MergeKind,
    pub automatic: bool,
    pub merged: Vec<u32>,
    pub new_layer: Layer,
    pub file: String,
    /// The version left above the merged ones and re-pointed onto the new layer.
    pub repointed: Option<u32>,
    #[serde(rename = "override")]
    pub override_moved: Option<OverrideMove>,
    /// Target records that were pinned to a merged version and now name the new layer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub targets_moved: Vec<String>,
    /// Files retired (deleted now, or once their last reader is gone).
    pub retired: Vec<String>,
    pub still_in_use: Vec<String>,
    pub bytes_written: u64,
    pub seconds: f64,
}

/// What an automatic merge check decided.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AutoMerge {
    Merged(MergeOutcome),
    /// Over the limit, but a rule stops the merge for now; the reason says which.
    Deferred(String),
}

/// One compacted layer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CompactedLayer {
    pub layer: Layer,
    pub file: String,
    pub bytes_before: u64,
    pub bytes_after: u64,
}

fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path)
        .map(|m| m.blocks() * 512)
        .unwrap_or(0)
}

/// Versions that count against `max_versions` (all but the maintenance one).
pub fn counted_versions(meta: &VdiskMeta) -> usize {
    meta.versions
        .iter()
        .filter(|v| v.access != Access::Maintenance)
        .count()
}

/// What a merge will fold, and the version it leaves above.
#[derive(Debug, Clone)]
struct Plan {
    merged: Vec<u32>,
    above: Option<u32>,
}

/// Checks the merge rules at `now`.
fn plan(meta: &VdiskMeta, kind: MergeKind, now: Timestamp) -> Result<Plan> {
    let name = &meta.name;
    if meta.access == DiskAccess::Private {
        return Err(StoreError::Refused(format!(
            "vDisk {name} has private access and no versions to merge"
        )));
    }
    if meta.versions.is_empty() {
        return Err(StoreError::Refused(format!(
            "vDisk {name} has no versions to merge"
        )));
    }
    let p = match select(meta, Selector::Production, now)? {
        Layer::Version(p) => p,
        Layer::Base => {
            return Err(StoreError::Refused(format!(
                "production targets of {name} boot the base: a merge folds the versions up to the one production boots, and there is none yet; promote one first (`vdstream version promote {name} N --to production`)")))
        }
    };
    let idx = meta
        .versions
        .iter()
        .position(|v| v.number == p)
        .expect("select picks listed versions");
    let merged: Vec<u32> = meta.versions[..=idx].iter().map(|v| v.number).collect();
    let above = meta.versions.get(idx + 1).map(|v| v.number);
    if kind == MergeKind::Updates && merged.len() < 2 {
        return Err(StoreError::Refused(format!(
            "production targets of {name} boot version {p}, its first version: there is nothing below it to merge (a merge folds the versions up to the one production boots; those above are merged once production boots them)")));
    }
    if kind == MergeKind::Base && meta.override_version.is_some() && above.is_some() {
        return Err(StoreError::Refused(format!(
            "production targets of {name} are pinned to version {p} by an override, and versions above it stay: a base cannot carry the pin; run `vdstream version merge {name}` (without --base), which moves the pin to the merged version, or clear the override first (`vdstream version override {name} --clear`)")));
    }
    Ok(Plan { merged, above })
}

/// Applies the pending merge of `m` to it: the merged versions (and, for `--base`, the
/// base) give way to the new layer, the override moves, the old files are retired.
/// Returns the new layer, the files retired and the override moved.
fn finish(m: &mut VdiskMeta, who: &str) -> (Layer, Vec<String>, Option<OverrideMove>) {
    let p = m.pending_merge.take().expect("a pending merge");
    let last = *p.merged.last().expect("merges fold at least one version");
    let idx = m
        .versions
        .iter()
        .position(|v| v.number == last)
        .expect("checked by VdiskMeta::check");
    let rest = m.versions.split_off(idx + 1);
    let folded = std::mem::replace(&mut m.versions, rest);
    let mut retired: Vec<String> = folded.iter().map(|v| v.file.clone()).collect();
    let k = folded.last().expect("folded");
    let pinned = m.override_version.filter(|o| p.merged.contains(o));
    let now = Timestamp::now();
    let layer = match p.kind {
        MergeKind::Updates => {
            m.versions.insert(
                0,
                Version {
                    number: p.number,
                    file: p.file.clone(),
                    access: k.access,
                    created: now,
                    created_by: who.to_string(),
                    promoted: k.promoted.clone(),
                    scheduled_at: k.scheduled_at,
                    note: Some(format!(
                        "merge of versions {}",
                        p.merged
                            .iter()
                            .map(u32::to_string)
                            .collect::<Vec<_>>()
                            .join(", ")
                    )),
                    merged_from: p.merged.clone(),
                },
            );
            Layer::Version(p.number)
        }
        MergeKind::Base => {
            retired.insert(0, m.base.file.clone());
            m.base = Base {
                file: p.file.clone(),
                format: LayerFormat::Qcow2,
                created: now,
                created_by: who.to_string(),
            };
            Layer::Base
        }
    };
    let moved = pinned.map(|from| {
        let to = (p.kind == MergeKind::Updates).then_some(p.number);
        m.override_version = to;
        OverrideMove { from, to }
    });
    m.retired.extend(retired.iter().cloned());
    (layer, retired, moved)
}

fn stopped(step: MergeStep) -> StoreError {
    StoreError::Refused(format!("merge stopped after step {step:?} (test hook)"))
}

impl Store {
    /// `version merge NAME [--base]`.
    pub fn merge(
        &self,
        name: &str,
        kind: MergeKind,
        automatic: bool,
        progress: Progress<'_>,
    ) -> Result<MergeOutcome> {
        self.merge_until(name, kind, automatic, None, progress)
    }

    /// A merge that stops right after `step`, leaving the store as a crash there would
    /// (for tests of `recover`).
    #[doc(hidden)]
    pub fn merge_stopping_after(
        &self,
        name: &str,
        kind: MergeKind,
        step: MergeStep,
    ) -> Result<MergeOutcome> {
        self.merge_until(name, kind, false, Some(step), &mut |_, _| {})
    }

    /// Refuses when a writer holds version `above`, which the merge must re-point.
    fn check_repointable(&self, meta: &VdiskMeta, above: u32) -> Result<()> {
        let v = meta.version(above).expect("planned");
        let path = self.file_path(&meta.name, &v.file);
        if fsutil::holders_of(&path)? == Holders::Writer {
            let name = &meta.name;
            return Err(StoreError::Refused(format!(
                "version {above} of {name} ({}) is open read-write ({}): the merge would re-point it onto the merged layer, which vdstream does only while no writer has it; stop that target, then run `vdstream version merge {name}` (nothing was changed)",
                v.access.name(), fsutil::describe_holders(&path))));
        }
        Ok(())
    }

    /// Makes the qcow2 file `file` of vDisk `name` back onto `backing`: in place when
    /// nobody has it open, else through a re-pointed copy renamed over it (its readers keep
    /// the old inode). The caller holds the exclusive store lock.
    fn repoint(&self, name: &str, file: &str, backing: &str) -> Result<()> {
        let path = self.file_path(name, file);
        let to = Some((backing, ImageFormat::Qcow2));
        match fsutil::holders_of(&path)? {
            Holders::Nobody => Ok(set_backing_file(&path, to)?),
            Holders::Readers => {
                let tmp = fsutil::temp_beside(&path);
                let _ = std::fs::remove_file(&tmp);
                let done = fsutil::copy_file(&path, &tmp)
                    .and_then(|_| Ok(set_backing_file(&tmp, to)?)) // fsyncs the copy
                    .and_then(|()| {
                        std::fs::rename(&tmp, &path).map_err(io("move into place", &path))
                    });
                if done.is_err() {
                    let _ = std::fs::remove_file(&tmp);
                }
                done?;
                fsutil::sync_dir(&self.vdisk_dir(name))
            }
            Holders::Writer => Err(StoreError::Refused(format!(
                "{} is open read-write ({}): it cannot be re-pointed now",
                path.display(),
                fsutil::describe_holders(&path)
            ))),
        }
    }

    fn merge_until(
        &self,
        name: &str,
        kind: MergeKind,
        automatic: bool,
        stop: Option<MergeStep>,
        progress: Progress<'_>,
    ) -> Result<MergeOutcome> {
        let started = std::time::Instant::now();
        let (meta, plan) = {
            let _l = self.lock(LockMode::Exclusive)?;
            let meta = self.load_for_change(name)?;
            let plan = plan(&meta, kind, Timestamp::now())?;
            if let Some(a) = plan.above {
                if let Err(e) = self.check_repointable(&meta, a) {
                    if !automatic {
                        self.audit(
                            "version.merge.deferred",
                            name,
                            json!({"automatic": false, "kind": kind, "reason": e.to_string()}),
                        )?;
                    }
                    return Err(e);
                }
            }
            (meta, plan)
        };
        let number = meta.next_version;
        let file = match kind {
            MergeKind::Updates => format!("{name}.{number}.qcow2"),
            MergeKind::Base => format!("{name}.base-{number}.qcow2"),
        };
        let k = meta
            .version(*plan.merged.last().expect("planned"))
            .expect("listed")
            .clone();
        let top = self.file_path(name, &k.file);
        let base = self.file_path(name, &meta.base.file);
        let dst = self.file_path(name, &file);
        let tmp = fsutil::temp_beside(&dst);
        let _ = std::fs::remove_file(&tmp);
        let stop_at = (kind == MergeKind::Updates).then_some(base.as_path());
        let drop_tmp = || {
            let _ = std::fs::remove_file(&tmp);
        };
        // A failure before the commit (a full file system, a lock or metadata error) leaves
        // no temporary file behind.
        let chain = self.chain_specs(&meta, Layer::Version(k.number))?;
        debug_assert_eq!(chain.last().map(|l| l.path.as_path()), Some(top.as_path()));
        let report = merge_layers(&chain, stop_at, &tmp, &MergeOptions::default(), progress)
            .inspect_err(|_| drop_tmp())?;
        let _l = self.lock(LockMode::Exclusive).inspect_err(|_| drop_tmp())?;
        // The expected generation was checked when the merge began; from there the
        // generation must not have moved at all.
        let mut m = self
            .clone()
            .expecting(None)
            .load_for_change(name)
            .inspect_err(|_| drop_tmp())?;
        if m.generation != meta.generation {
            drop_tmp();
            return Err(StoreError::Refused(format!(
                "vDisk {name} changed while the merge ran (see `vdstream audit {name}`); nothing was changed: run the merge again")));
        }
        if dst.exists() {
            drop_tmp();
            return Err(StoreError::Refused(format!(
                "{} exists but the metadata does not list it: move it away and run the merge again",
                dst.display()
            )));
        }
        if let Some(a) = plan.above {
            if let Err(e) = self.check_repointable(&m, a) {
                drop_tmp();
                if !automatic {
                    self.audit(
                        "version.merge.deferred",
                        name,
                        json!({"automatic": false, "kind": kind, "reason": e.to_string()}),
                    )?;
                }
                return Err(e);
            }
        }
        // Step "pending": the new file is named before anything points at it.
        m.pending_merge = Some(PendingMerge {
            kind,
            automatic,
            merged: plan.merged.clone(),
            number,
            file: file.clone(),
            above: plan.above,
            started: Timestamp::now(),
        });
        m.next_version = number + 1;
        if let Err(e) = self.save(&mut m) {
            drop_tmp();
            return Err(e);
        }
        if stop == Some(MergeStep::Pending) {
            return Err(stopped(MergeStep::Pending));
        }
        let steps = (|| {
            std::fs::rename(&tmp, &dst).map_err(io("move into place", &dst))?;
            fsutil::sync_dir(&self.vdisk_dir(name))?;
            if stop == Some(MergeStep::Renamed) {
                return Err(stopped(MergeStep::Renamed));
            }
            if let Some(a) = plan.above {
                let above_file = m.version(a).expect("planned").file.clone();
                self.repoint(name, &above_file, &file)?;
            }
            if stop == Some(MergeStep::Repointed) {
                return Err(stopped(MergeStep::Repointed));
            }
            Ok(())
        })();
        if let Err(e) = steps {
            if stop.is_none() {
                // A real failure: finish or undo now rather than at the next command.
                drop_tmp();
                if let Err(r) = self.recover(&mut m) {
                    log::warn!("cannot recover the interrupted merge of {name} now: {r}; the next command of {name} will");
                }
            }
            return Err(e);
        }
        // Step "done".
        let (new_layer, retired, override_moved) = finish(&mut m, &self.actor().who());
        self.collect_retired(&mut m)?;
        let still_in_use = m
            .retired
            .iter()
            .filter(|f| retired.contains(f))
            .cloned()
            .collect();
        self.save(&mut m)?;
        let targets_moved = self.move_target_pins(name, &plan.merged, new_layer);
        let outcome = MergeOutcome {
            kind,
            automatic,
            merged: plan.merged,
            new_layer,
            file,
            repointed: plan.above,
            override_moved,
            targets_moved,
            retired,
            still_in_use,
            bytes_written: report.bytes_written,
            seconds: started.elapsed().as_secs_f64(),
        };
        self.audit(
            "version.merge",
            name,
            serde_json::to_value(&outcome).expect("serializes"),
        )?;
        Ok(outcome)
    }

    /// Finishes or undoes a merge cut short between its commit steps (`pending_merge` set):
    /// finished when the new file is in place and the version above already backs onto it
    /// (or there is none), undone otherwise. Saves and audits `version.merge.recovered`.
    /// The caller holds the exclusive lock.
    pub(crate) fn recover(&self, m: &mut VdiskMeta) -> Result<()> {
        let Some(p) = m.pending_merge.clone() else {
            return Ok(());
        };
        let name = m.name.clone();
        let dst = self.file_path(&name, &p.file);
        let repointed = match p.above {
            None => dst.exists(),
            Some(a) => {
                let f = self.file_path(
                    &name,
                    &m.version(a).expect("checked by VdiskMeta::check").file,
                );
                crate::open::backing_of(&f)?.as_deref() == Some(p.file.as_str())
            }
        };
        let mut finished_as = None;
        let mut details = if dst.exists() && repointed {
            let (layer, retired, moved) = finish(m, &self.actor().who());
            self.collect_retired(m)?;
            finished_as = Some(layer);
            json!({"result": "finished", "merge": p, "new_layer": layer, "retired": retired, "override": moved})
        } else if repointed {
            return Err(StoreError::MissingFile {
                path: dst,
                advice: format!("version {} of vDisk {name} backs onto it (a merge was cut short): restore it from backup", p.above.unwrap_or_default()),
            });
        } else {
            m.pending_merge = None;
            if dst.exists() {
                m.retired.push(p.file.clone());
            }
            self.collect_retired(m)?;
            json!({"result": "undone", "merge": p})
        };
        self.save(m)?;
        if let Some(layer) = finished_as {
            details["targets_moved"] = json!(self.move_target_pins(&name, &p.merged, layer));
        }
        self.audit("version.merge.recovered", &name, details)
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
                self.audit("version.merge.deferred", name, json!({"automatic": true, "versions": counted_versions(&meta), "max_versions": meta.max_versions, "reason": why}))?;
                Ok(Some(AutoMerge::Deferred(why)))
            }
            Err(e) => Err(e),
        }
    }

    /// `vdisk compact NAME`: drops zero and unused clusters from every layer but the
    /// maintenance version.
    pub fn compact(&self, name: &str, progress: Progress<'_>) -> Result<Vec<CompactedLayer>> {
        let meta = {
            let _l = self.lock(LockMode::Exclusive)?;
            self.load_for_change(name)?
        };
        let mut out = Vec::new();
        let mut parent: Option<String> = None;
        let mut layers = vec![(Layer::Base, meta.base.file.clone(), meta.base.format)];
        layers.extend(
            meta.versions
                .iter()
                .filter(|v| v.access != Access::Maintenance)
                .map(|v| (Layer::Version(v.number), v.file.clone(), LayerFormat::Qcow2)),
        );
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
                    let drop_tmp = || {
                        let _ = std::fs::remove_file(&tmp);
                    };
                    merge_layers(
                        &self.chain_specs(&meta, layer)?,
                        stop.as_deref(),
                        &tmp,
                        &MergeOptions::default(),
                        &mut sub,
                    )
                    .inspect_err(|_| drop_tmp())?;
                    let _l = self.lock(LockMode::Exclusive).inspect_err(|_| drop_tmp())?;
                    let now = self.load_for_change(name).inspect_err(|_| drop_tmp())?;
                    let exists = match layer {
                        Layer::Base => now.base.file == file,
                        Layer::Version(n) => now.version(n).is_some_and(|v| v.file == file),
                    };
                    let files: Vec<String> = crate::open::chain_files(&now, layer)
                        .into_iter()
                        .map(|f| f.0)
                        .collect();
                    let want: Vec<String> = parent
                        .iter()
                        .cloned()
                        .chain(std::iter::once(file.clone()))
                        .collect();
                    let unchanged =
                        exists && files.ends_with(&want) && (parent.is_some() || files.len() == 1);
                    if !unchanged {
                        let _ = std::fs::remove_file(&tmp);
                        return Err(StoreError::Refused(format!(
                            "vDisk {name} changed while compacting {layer} (see `vdstream audit {name}`); the layers done so far are compacted: run it again")));
                    }
                    std::fs::rename(&tmp, &path)
                        .map_err(io("move into place", &path))
                        .inspect_err(|_| drop_tmp())?;
                    fsutil::sync_dir(&self.vdisk_dir(name))?;
                }
            }
            out.push(CompactedLayer {
                layer,
                file: file.clone(),
                bytes_before: before,
                bytes_after: allocated(&path),
            });
            parent = Some(file);
        }
        progress(total, total);
        let _l = self.lock(LockMode::Exclusive)?;
        self.audit(
            "vdisk.compact",
            name,
            serde_json::to_value(&out).expect("serializes"),
        )?;
        Ok(out)
    }
}

/// Punches holes where 64 KiB blocks of a raw file read as zeros (content unchanged).
fn punch_zeros(path: &Path, progress: Progress<'_>) -> Result<()> {
    let f = vdstream_blockdev::storefile::open_existing_rw(path).map_err(io("open", path))?;
    let len = f.metadata().map_err(io("stat", path))?.len();
    let mut buf = vec![0u8; ZERO_BLOCK];
    let mut off = 0;
    while off < len {
        let n = ((len - off) as usize).min(ZERO_BLOCK);
        f.read_exact_at(&mut buf[..n], off)
            .map_err(io("read", path))?;
        if buf[..n].iter().all(|&b| b == 0) {
            // SAFETY: fallocate takes the descriptor `f` keeps open and integers only.
            let rc = unsafe {
                libc::fallocate(
                    f.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    off as i64,
                    n as i64,
                )
            };
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
