//! The JSON documents of the store commands that the server's API also answers: what
//! `vdstream … --json` prints and what `GET/POST /api/v1/…` returns are built here, once,
//! so the two cannot drift apart and `vdstream … --server URL` can print the API's answer
//! exactly as the local command would.
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

use serde_json::{json, Value};

use crate::copy::Progress;
use crate::error::Result;
use crate::merge::AutoMerge;
use crate::meta::{Access, MergeKind};
use crate::select::{select, Selector};
use crate::store::Store;
use crate::targets::{NewTarget, TargetChange};
use crate::time::Timestamp;

pub fn vdisk_list(store: &Store) -> Result<Value> {
    let list = store.list()?;
    Ok(json!(list
        .iter()
        .map(|(n, m)| match m {
            Ok(m) => json!(m),
            Err(e) => json!({"name": n, "error": e.to_string()}),
        })
        .collect::<Vec<_>>()))
}

pub fn vdisk_show(store: &Store, name: &str) -> Result<Value> {
    Ok(json!(store.info(name)?))
}

pub fn version_list(store: &Store, name: &str) -> Result<Value> {
    let m = store.get(name)?;
    let now = Timestamp::now();
    Ok(json!({
        "vdisk": name,
        "base": m.base,
        "versions": m.versions,
        "production": select(&m, Selector::Production, now)?,
        "test": select(&m, Selector::Test, now)?,
        "maintenance": m.maintenance().map(|v| v.number),
        "override": m.override_version,
        "next_version": m.next_version,
        "generation": m.generation,
    }))
}

pub fn version_new(
    store: &Store,
    name: &str,
    note: Option<String>,
    progress: Progress<'_>,
) -> Result<Value> {
    let v = store.new_version(name, note)?;
    Ok(json!({"vdisk": name, "version": v, "auto_merge": auto_merge(store, name, progress)}))
}

/// `at`: RFC 3339 or `+DURATION`, relative to now.
pub fn version_promote(
    store: &Store,
    name: &str,
    number: u32,
    to: Access,
    at: Option<&str>,
    progress: Progress<'_>,
) -> Result<Value> {
    let at = at
        .map(|t| crate::time::parse_at(t, Timestamp::now()))
        .transpose()?;
    let v = store.promote(name, number, to, at)?;
    Ok(json!({"vdisk": name, "version": v, "auto_merge": auto_merge(store, name, progress)}))
}

pub fn version_revert(store: &Store, name: &str, number: u32) -> Result<Value> {
    let r = store.revert(name, number)?;
    Ok(json!({"vdisk": name, "version": number, "result": r}))
}

/// `version merge NAME [--base]`.
pub fn version_merge(
    store: &Store,
    name: &str,
    kind: MergeKind,
    progress: Progress<'_>,
) -> Result<Value> {
    let out = store.merge(name, kind, false, progress)?;
    Ok(json!({"vdisk": name, "merge": out}))
}

/// `audit [NAME] [--limit N]`: the entries about `vdisk` (all when `None`), the last `limit`.
pub fn audit(store: &Store, vdisk: Option<&str>, limit: Option<usize>) -> Result<Value> {
    if let Some(n) = vdisk {
        crate::names::validate_name(n)?;
    }
    Ok(json!(crate::audit::read(
        &store.audit_path(),
        vdisk,
        limit
    )?))
}

/// After a change: the automatic merge when `max_versions` is exceeded (see the module doc).
/// The change itself was checked against the expected generation (if any); the merge
/// that follows it is its consequence, not a second decision, so it expects nothing.
pub fn auto_merge(store: &Store, name: &str, progress: Progress<'_>) -> Value {
    match store.clone().expecting(None).auto_merge(name, progress) {
        Err(e) => json!({"error": e.to_string()}),
        Ok(None) => Value::Null,
        Ok(Some(AutoMerge::Merged(out))) => json!(out),
        Ok(Some(AutoMerge::Deferred(why))) => json!({"deferred": why}),
    }
}

pub fn target_add(store: &Store, t: NewTarget) -> Result<Value> {
    Ok(json!(store.add_target(t)?))
}

pub fn target_list(store: &Store) -> Result<Value> {
    Ok(json!(store.targets()?))
}

pub fn target_show(store: &Store, id: &str) -> Result<Value> {
    Ok(json!(store.target(id)?))
}

pub fn target_set(store: &Store, id: &str, change: TargetChange) -> Result<Value> {
    Ok(json!(store.set_target(id, change)?))
}

pub fn target_remove(store: &Store, id: &str) -> Result<Value> {
    Ok(json!({"removed": id, "target": store.remove_target(id)?}))
}
