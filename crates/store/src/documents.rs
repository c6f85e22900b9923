//! The JSON documents of the store commands that the server's API also answers: what
//! `vdstream … --json` prints and what `GET/POST /api/v1/…` returns are built here, once,
//! so the two cannot drift apart and `vdstream … --server URL` can print the API's answer
//! exactly as the local command would. Each document is a type, whose schema the server's
//! OpenAPI document is generated from.
//!
//! | command                         | document                                                      |
//! |---------------------------------|---------------------------------------------------------------|
//! | `vdisk list`                    | `[VdiskMeta \| {name, error}]`                                |
//! | `vdisk info` / `vdisk show`     | `VdiskInfo`                                                   |
//! | `version list`                  | `{vdisk, base, versions, production, test, maintenance, override, next_version}` |
//! | `version new`                   | `{vdisk, version, auto_merge}`                                |
//! | `version promote`               | `{vdisk, version, auto_merge}`                                |
//! | `version revert`                | `{vdisk, version, result}`                                    |
//! | `version merge`                 | `{vdisk, merge}` (a `MergeOutcome`)                           |
//! | `audit`                         | `[AuditEntry]`, oldest first                                  |
//! | `target add\|show\|set`         | `TargetRecord`                                                |
//! | `target list`                   | `[TargetRecord]`                                              |
//! | `target remove`                 | `{removed, target}`                                           |
//!
//! `auto_merge` is `null` (nothing to do), a `MergeOutcome`, `{"deferred": why}` or
//! `{"error": message}` (the change itself stands).

use serde::Serialize;
use utoipa::ToSchema;

use crate::copy::Progress;
use crate::error::Result;
use crate::merge::{AutoMerge, MergeOutcome};
use crate::meta::{Access, Base, MergeKind, VdiskMeta, Version};
use crate::select::{select, Layer, Selector};
use crate::store::Store;
use crate::targets::{NewTarget, TargetChange, TargetRecord};
use crate::time::Timestamp;
use crate::vdisk::VdiskInfo;
use crate::version::Reverted;

/// One entry of `vdisk list`: the vDisk's metadata, or its name and why it did not load.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(untagged)]
pub enum VdiskListEntry {
    Meta(Box<VdiskMeta>),
    LoadError(VdiskLoadError),
}

/// A vDisk whose `vdisk.json` did not load, in the vDisk list.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct VdiskLoadError {
    pub name: String,
    /// What stopped it loading, and what to do.
    pub error: String,
}

/// `version list`: the chain, bottom first, and which layer each kind of target gets.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct VersionList {
    pub vdisk: String,
    pub base: Base,
    pub versions: Vec<Version>,
    pub production: Layer,
    pub test: Layer,
    pub maintenance: Option<u32>,
    #[serde(rename = "override")]
    pub override_version: Option<u32>,
    pub next_version: u32,
    /// The generation of the metadata (also the ETag): send it as If-Match with a change.
    pub generation: u64,
}

/// `version new` and `version promote`: the version, and the automatic merge if one ran.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct VersionChange {
    pub vdisk: String,
    pub version: Version,
    /// null (nothing to do), the merge's outcome, `{"deferred": why}` or
    /// `{"error": message}` (the change stands).
    pub auto_merge: Option<AutoMergeDoc>,
}

/// What the automatic merge after a change did (see the module doc).
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(untagged)]
pub enum AutoMergeDoc {
    Merged(MergeOutcome),
    Deferred {
        /// The rule that stops the merge for now.
        deferred: String,
    },
    Error {
        error: String,
    },
}

/// `version revert`: what the version became.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RevertDoc {
    pub vdisk: String,
    pub version: u32,
    /// `{"to": "test"}`, `{"to": "maintenance"}` or `"discarded"`.
    pub result: Reverted,
}

/// `version merge`: what was merged.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct MergeDoc {
    pub vdisk: String,
    pub merge: MergeOutcome,
}

/// `target remove`: the record removed (`target` is null if the record was damaged).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TargetRemoved {
    pub removed: String,
    pub target: Option<TargetRecord>,
}

pub fn vdisk_list(store: &Store) -> Result<Vec<VdiskListEntry>> {
    Ok(store
        .list()?
        .into_iter()
        .map(|(name, m)| match m {
            Ok(m) => VdiskListEntry::Meta(Box::new(m)),
            Err(e) => VdiskListEntry::LoadError(VdiskLoadError {
                name,
                error: e.to_string(),
            }),
        })
        .collect())
}

pub fn vdisk_show(store: &Store, name: &str) -> Result<VdiskInfo> {
    store.info(name)
}

pub fn version_list(store: &Store, name: &str) -> Result<VersionList> {
    let m = store.get(name)?;
    let now = Timestamp::now();
    Ok(VersionList {
        vdisk: name.to_string(),
        production: select(&m, Selector::Production, now)?,
        test: select(&m, Selector::Test, now)?,
        maintenance: m.maintenance().map(|v| v.number),
        base: m.base,
        versions: m.versions,
        override_version: m.override_version,
        next_version: m.next_version,
        generation: m.generation,
    })
}

pub fn version_new(
    store: &Store,
    name: &str,
    note: Option<String>,
    progress: Progress<'_>,
) -> Result<VersionChange> {
    let version = store.new_version(name, note)?;
    Ok(VersionChange {
        vdisk: name.to_string(),
        version,
        auto_merge: auto_merge(store, name, progress),
    })
}

/// `at`: RFC 3339 or `+DURATION`, relative to now.
pub fn version_promote(
    store: &Store,
    name: &str,
    number: u32,
    to: Access,
    at: Option<&str>,
    progress: Progress<'_>,
) -> Result<VersionChange> {
    let at = at
        .map(|t| crate::time::parse_at(t, Timestamp::now()))
        .transpose()?;
    let version = store.promote(name, number, to, at)?;
    Ok(VersionChange {
        vdisk: name.to_string(),
        version,
        auto_merge: auto_merge(store, name, progress),
    })
}

pub fn version_revert(store: &Store, name: &str, number: u32) -> Result<RevertDoc> {
    let result = store.revert(name, number)?;
    Ok(RevertDoc {
        vdisk: name.to_string(),
        version: number,
        result,
    })
}

/// `version merge NAME [--base]`.
pub fn version_merge(
    store: &Store,
    name: &str,
    kind: MergeKind,
    progress: Progress<'_>,
) -> Result<MergeDoc> {
    let merge = store.merge(name, kind, false, progress)?;
    Ok(MergeDoc {
        vdisk: name.to_string(),
        merge,
    })
}

/// `audit [NAME] [--limit N]`: the entries about `vdisk` (all when `None`), the last `limit`.
pub fn audit(
    store: &Store,
    vdisk: Option<&str>,
    limit: Option<usize>,
) -> Result<Vec<crate::audit::AuditEntry>> {
    if let Some(n) = vdisk {
        crate::names::validate_name(n)?;
    }
    crate::audit::read(&store.audit_path(), vdisk, limit)
}

/// After a change: the automatic merge when `max_versions` is exceeded (see the module doc).
/// The change itself was checked against the expected generation (if any); the merge
/// that follows it is its consequence, not a second decision, so it expects nothing.
pub fn auto_merge(store: &Store, name: &str, progress: Progress<'_>) -> Option<AutoMergeDoc> {
    match store.clone().expecting(None).auto_merge(name, progress) {
        Err(e) => Some(AutoMergeDoc::Error {
            error: e.to_string(),
        }),
        Ok(None) => None,
        Ok(Some(AutoMerge::Merged(out))) => Some(AutoMergeDoc::Merged(out)),
        Ok(Some(AutoMerge::Deferred(why))) => Some(AutoMergeDoc::Deferred { deferred: why }),
    }
}

pub fn target_add(store: &Store, t: NewTarget) -> Result<TargetRecord> {
    store.add_target(t)
}

pub fn target_list(store: &Store) -> Result<Vec<TargetRecord>> {
    store.targets()
}

pub fn target_show(store: &Store, id: &str) -> Result<TargetRecord> {
    store.target(id)
}

pub fn target_set(store: &Store, id: &str, change: TargetChange) -> Result<TargetRecord> {
    store.set_target(id, change)
}

pub fn target_remove(store: &Store, id: &str) -> Result<TargetRemoved> {
    Ok(TargetRemoved {
        removed: id.to_string(),
        target: store.remove_target(id)?,
    })
}
