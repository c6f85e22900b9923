//! Target records: which vDisk a target boots, which version of it, and its write cache,
//! kept in the store like PVS keeps its device collection. The server looks a record up
//! when a target connects to `target/ID`; the agent's `--server http://` mode reads it
//! through the API.
//!
//! ```text
//! STORE/targets/ID.json   one TargetRecord, written atomically under the exclusive store lock
//! ```
//!
//! Invariants:
//! - Every change is made under the exclusive store lock, written atomically
//!   (`fsutil::write_atomic`) and audited (`target.add`, `target.set`, `target.remove`),
//!   so the vDisk a record names existed when the record was written, and `vdisk delete`
//!   (which checks the records under the same lock) cannot remove a vDisk a record names.
//! - A record is always valid as written: a known cache type other than `private`, RAM
//!   only for the RAM types, an overflow cap only for types with a cache file, a version
//!   selector other than `maintenance`, and the vDisk of standard access.
//! - The id follows the vDisk name rules (names.rs), so it is one safe file name.
//! - A MAC address is kept normalised (`vdstream_contract::target::normalize_mac`) and
//!   belongs to one record at most: adding one that another record has is refused,
//!   naming that record (checked under the same exclusive lock as the write).
//!
//! Why not `private` or `maintenance`: a target record describes a machine that reads a
//! shared vDisk through its own write cache. `private` writes to the vDisk itself and
//! the maintenance version is written directly by its one writer (`maintenance/NAME`);
//! neither is a target of a shared image, and serving either through a record would let
//! two machines write one image.

use std::path::PathBuf;

use serde_json::json;
use vdstream_wcache::CacheType;

use crate::error::{io, Result, StoreError};
use crate::fsutil::{self, LockMode};
use crate::meta::{load_json, DiskAccess, FORMAT_VERSION};
use crate::names::validate_target_id;
use crate::select::{select, Layer, Selector};
use crate::store::Store;
use crate::time::Timestamp;

pub use vdstream_contract::target::{normalize_mac, BadMac, NewTarget, TargetChange, TargetRecord};

/// `format` of a target record.
pub const TARGET_FORMAT: &str = "vdstream-target";

const RECORD_ADVICE: &str =
    "restore it from backup, or remove the target (`vdstream target remove ID`) and add it again";

/// Whether the cache type keeps data in RAM (takes `ram`).
fn uses_ram(t: CacheType) -> bool {
    matches!(t, CacheType::DeviceRam | CacheType::RamOverflow)
}

/// Whether the cache type has a cache or overflow file (takes `overflow_max`).
fn uses_file(t: CacheType) -> bool {
    !matches!(t, CacheType::DeviceRam | CacheType::Private)
}

/// Parses and checks a cache type for a target.
pub fn target_cache_type(text: &str) -> Result<CacheType> {
    let allowed: Vec<&str> = CacheType::ALL
        .iter()
        .filter(|t| **t != CacheType::Private)
        .map(|t| t.name())
        .collect();
    let t: CacheType = text.parse().map_err(|_| {
        StoreError::BadInput(format!(
            "unknown cache type {text:?}: choose one of {}",
            allowed.join(", ")
        ))
    })?;
    if t == CacheType::Private {
        return Err(StoreError::BadInput(format!(
            "a target cannot have the private cache type: private writes go to the vDisk itself, for one machine, while a target reads a shared vDisk through its own write cache; choose one of {} (or serve a private vDisk to its one machine directly)",
            allowed.join(", "))));
    }
    Ok(t)
}

/// Smallest RAM cache: 1 MiB (256 pages). 0 is allowed too: ram-overflow then writes
/// straight to its file (device-ram refuses 0).
pub const MIN_RAM: u64 = 1 << 20;

/// Largest RAM cache of one target: 256 GiB. Past it a value is a typo (`--ram 1T`, or a
/// byte count meant as MiB), not a write cache.
pub const MAX_RAM: u64 = 256 << 30;

/// The range of any `--ram`, wherever it comes from (a flag, a record, the API): 0, or
/// [`MIN_RAM`] to [`MAX_RAM`].
pub fn check_ram_range(ram: u64) -> Result<()> {
    let mib = |b: u64| {
        if b % (1 << 20) == 0 {
            format!("{}M", b >> 20)
        } else {
            format!("{b} bytes")
        }
    };
    if ram != 0 && ram < MIN_RAM {
        return Err(StoreError::BadInput(format!(
            "RAM {} is too small for a write cache: give at least 1M (e.g. 256M), or 0 for a ram-overflow cache that writes straight to its file",
            mib(ram))));
    }
    if ram > MAX_RAM {
        return Err(StoreError::BadInput(format!(
            "RAM {} is more than one target's write cache may take (at most 256G): did you mean a smaller unit (e.g. 1G)?", mib(ram))));
    }
    Ok(())
}

/// Whether `--ram` suits the cache type: its range, only device-ram and ram-overflow take
/// it, and device-ram needs some. The one rule for every command that takes --ram (records
/// here and through the API, `target attach` and `serve-image` in the binary).
pub fn check_ram(cache: CacheType, ram: u64) -> Result<()> {
    if !uses_ram(cache) {
        return Err(StoreError::Inconsistent(format!(
            "--ram is for the device-ram and ram-overflow cache types, not {cache}: leave it out, or choose one of those types")));
    }
    check_ram_range(ram)?;
    if ram == 0 && cache == CacheType::DeviceRam {
        return Err(StoreError::Inconsistent(
            "device-ram with --ram 0 could hold no write: give a size such as 512M".into(),
        ));
    }
    Ok(())
}

/// Checks the fields of a record that do not depend on the store.
fn check_fields(
    cache: CacheType,
    version: Selector,
    ram: Option<u64>,
    overflow_max: Option<u64>,
    description: Option<&str>,
) -> Result<()> {
    if version == Selector::Maintenance {
        return Err(StoreError::BadInput(
            "a target cannot boot the maintenance version: it is written directly by its one writer (the maintenance/NAME export or `serve-image --vdisk NAME@maintenance`), not through a write cache; give production, test, latest, base or a version number".into()));
    }
    if let Some(ram) = ram {
        check_ram(cache, ram)?;
    }
    if overflow_max.is_some() && !uses_file(cache) {
        return Err(StoreError::Inconsistent(format!(
            "--overflow-max caps a cache or overflow file; {cache} has none: leave it out, or choose a type with a file (ram-overflow, device-disk, server, …)")));
    }
    if overflow_max == Some(0) {
        return Err(StoreError::BadInput("--overflow-max 0 would refuse every write that reaches the file: give a size such as 10G, or leave it out".into()));
    }
    if let Some(d) = description {
        crate::names::validate_text("a target description", d)?;
    }
    Ok(())
}

/// Normalises a list of MACs (sorted, without repeats); the error names the bad one.
fn normalized_macs<'a>(macs: impl IntoIterator<Item = &'a String>) -> Result<Vec<String>> {
    let mut out = macs
        .into_iter()
        .map(|m| normalize_mac(m).map_err(|e| StoreError::BadInput(e.to_string())))
        .collect::<Result<Vec<_>>>()?;
    out.sort();
    out.dedup();
    Ok(out)
}

/// Checks the fields a network-booted target uses: its host name (RFC 1123: labels of
/// letters, digits and '-', at most 63 bytes each, 253 in all) and its overflow device (an
/// absolute path under /dev/ of letters, digits and `/_-.:+`: it goes on a kernel command
/// line and into an iPXE script, where `$` or a space would mean something).
fn check_boot_fields(hostname: Option<&str>, overflow_device: Option<&str>) -> Result<()> {
    if let Some(h) = hostname {
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        };
        if h.len() > 253 || !h.split('.').all(label_ok) {
            return Err(StoreError::BadInput(format!(
                "host name {h:?} is not valid: use letters, digits and '-' (not first or last), dot-separated labels of at most 63 characters, e.g. lab-pc-07")));
        }
    }
    if let Some(d) = overflow_device {
        if !d.starts_with("/dev/")
            || d.len() > 200
            || d.contains("..")
            || !d
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"/_-.:+".contains(&b))
        {
            return Err(StoreError::BadInput(format!(
                "overflow device {d:?} is not valid: give the target's local disk or partition as a path under /dev/ of letters, digits and /_-.:+, e.g. /dev/sda2 or /dev/disk/by-id/ata-X-part2")));
        }
    }
    Ok(())
}

impl Store {
    pub fn targets_dir(&self) -> PathBuf {
        self.root().join("targets")
    }

    fn target_path(&self, id: &str) -> PathBuf {
        self.targets_dir().join(format!("{id}.json"))
    }

    /// Ids of the records, sorted. Under the lock it is the store's list; without it (shell
    /// completion, which must not wait for a merge) a listing of the moment.
    pub fn target_ids(&self) -> Result<Vec<String>> {
        let dir = self.targets_dir();
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(io("list", &dir)(e)),
        };
        let mut out = Vec::new();
        for e in entries {
            let e = e.map_err(io("list", &dir))?;
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(id) = name.strip_suffix(".json") {
                if validate_target_id(id).is_ok() {
                    out.push(id.to_string());
                }
            }
        }
        out.sort();
        Ok(out)
    }

    /// Loads a record; the caller holds the lock.
    pub(crate) fn load_target(&self, id: &str) -> Result<TargetRecord> {
        validate_target_id(id)?;
        let path = self.target_path(id);
        if !path.exists() {
            let ids = self.target_ids()?;
            let known = if ids.is_empty() {
                "the store has no targets yet; add one with `vdstream target add ID --vdisk NAME --cache TYPE`".to_string()
            } else {
                format!("known targets: {}", ids.join(", "))
            };
            return Err(StoreError::UnknownTarget {
                id: id.into(),
                store: self.root().to_path_buf(),
                known,
            });
        }
        let r: TargetRecord = load_json(&path, RECORD_ADVICE)?;
        let corrupt = |detail: String| StoreError::Corrupt {
            path: path.clone(),
            detail,
            advice: RECORD_ADVICE.into(),
        };
        if r.format != TARGET_FORMAT || r.format_version != FORMAT_VERSION {
            return Err(corrupt(format!(
                "format {:?} version {}, expected {TARGET_FORMAT:?} version {FORMAT_VERSION}",
                r.format, r.format_version
            )));
        }
        if r.id != id {
            return Err(corrupt(format!(
                "it names target {:?} but its file is that of {id:?}",
                r.id
            )));
        }
        Ok(r)
    }

    /// The record of target `id`.
    pub fn target(&self, id: &str) -> Result<TargetRecord> {
        let _l = self.lock(LockMode::Shared)?;
        self.load_target(id)
    }

    /// Every target record, sorted by id. A record that does not load is an error naming
    /// its file.
    pub fn targets(&self) -> Result<Vec<TargetRecord>> {
        let _l = self.lock(LockMode::Shared)?;
        self.target_ids()?
            .iter()
            .map(|id| self.load_target(id))
            .collect()
    }

    /// Ids of the targets that boot vDisk `name`; the caller holds the lock.
    pub(crate) fn targets_using(&self, name: &str) -> Result<Vec<String>> {
        let mut out = Vec::new();
        for id in self.target_ids()? {
            // A record that does not load cannot be said not to use the vDisk.
            match self.load_target(&id) {
                Ok(r) if r.vdisk != name => {}
                _ => out.push(id),
            }
        }
        Ok(out)
    }

    /// Checks the vDisk and version of a record against the store; the caller holds the lock.
    fn check_vdisk(&self, vdisk: &str, version: Selector) -> Result<()> {
        let meta = self.load(vdisk)?;
        if meta.access == DiskAccess::Private {
            return Err(StoreError::Refused(format!(
                "vDisk {vdisk} has private access (one writer, no write cache), so it cannot have targets: switch it to standard (`vdstream vdisk set {vdisk} --access standard`) or serve it to its one machine directly")));
        }
        select(&meta, version, Timestamp::now()).map(|_| ())
    }

    fn write_target(&self, r: &TargetRecord) -> Result<()> {
        let dir = self.targets_dir();
        fsutil::create_dir_all(&dir)?;
        fsutil::write_atomic(
            &self.target_path(&r.id),
            &serde_json::to_vec_pretty(r).expect("serializes"),
        )
    }

    /// After a merge of vDisk `vdisk` folded the versions `merged` into `to`: the records
    /// pinned to one of them now name `to`, which reads the same bytes. Returns their ids.
    /// The caller holds the exclusive lock and has saved the merged metadata. A record that
    /// cannot be read or rewritten is left as it is, with a warning: the server then
    /// refuses that target, naming the missing version, until the record is changed.
    pub(crate) fn move_target_pins(&self, vdisk: &str, merged: &[u32], to: Layer) -> Vec<String> {
        let ids = match self.target_ids() {
            Ok(ids) => ids,
            Err(e) => {
                log::warn!("cannot list the target records after merging {vdisk}: {e}; records pinned to versions {merged:?} must be changed by hand");
                return vec![];
            }
        };
        let to = match to {
            Layer::Base => Selector::Base,
            Layer::Version(n) => Selector::Number(n),
        };
        let mut moved = Vec::new();
        for id in ids {
            let mut r = match self.load_target(&id) {
                Ok(r) => r,
                Err(e) => {
                    log::warn!("target {id}: {e}");
                    continue;
                }
            };
            if r.vdisk != vdisk || !matches!(r.version, Selector::Number(n) if merged.contains(&n))
            {
                continue;
            }
            r.version = to;
            r.updated = Timestamp::now();
            r.updated_by = self.actor().who();
            r.generation += 1;
            match self.write_target(&r) {
                Ok(()) => moved.push(id),
                Err(e) => {
                    log::warn!("cannot move target {id} to {to} after the merge of {vdisk}: {e}")
                }
            }
        }
        moved
    }

    /// Refuses MACs that another record than `id` has; the caller holds the lock.
    fn check_macs_free(&self, id: &str, macs: &[String]) -> Result<()> {
        if macs.is_empty() {
            return Ok(());
        }
        for other in self.target_ids()? {
            if other == id {
                continue;
            }
            // A record that does not load is skipped here; the server refuses it anyway.
            let Ok(r) = self.load_target(&other) else {
                continue;
            };
            if let Some(m) = macs.iter().find(|m| r.macs.contains(m)) {
                return Err(StoreError::Refused(format!(
                    "MAC {m} belongs to target {other} already: take it off there first (`vdstream target set {other} --remove-mac {m}`)")));
            }
        }
        Ok(())
    }

    /// The record that has MAC `mac` (any form [`normalize_mac`] takes), if one has.
    pub fn target_by_mac(&self, mac: &str) -> Result<Option<TargetRecord>> {
        let mac = normalize_mac(mac).map_err(|e| StoreError::BadInput(e.to_string()))?;
        let _l = self.lock(LockMode::Shared)?;
        Ok(self
            .target_ids()?
            .iter()
            .filter_map(|id| self.load_target(id).ok())
            .find(|r| r.macs.contains(&mac)))
    }

    /// PVS's auto-add: a new record for an unknown MAC (at most `limit` records of the
    /// prefix: past it a flood of unknown or forged MACs cannot fill the store), a copy of record `template`
    /// (vDisk, version, cache, RAM, overflow cap and device) with this MAC, host name its
    /// id, and id `PREFIX-NNN` (the next free number, three digits or more). A MAC that a
    /// record has meanwhile gets that record. Audited as `target.auto-add`.
    pub fn auto_add_target(
        &self,
        mac: &str,
        template: &str,
        prefix: &str,
        limit: usize,
    ) -> Result<TargetRecord> {
        let mac = normalize_mac(mac).map_err(|e| StoreError::BadInput(e.to_string()))?;
        validate_target_id(&format!("{prefix}-001"))?;
        let _l = self.lock(LockMode::Exclusive)?;
        let ids = self.target_ids()?;
        let mut next = 1u64;
        let mut made = 0usize;
        for id in &ids {
            if let Ok(r) = self.load_target(id) {
                if r.macs.contains(&mac) {
                    return Ok(r);
                }
            }
            if let Some(n) = id
                .strip_prefix(prefix)
                .and_then(|t| t.strip_prefix('-'))
                .and_then(|n| n.parse::<u64>().ok())
            {
                next = next.max(n + 1);
                made += 1;
            }
        }
        if made >= limit {
            return Err(StoreError::Refused(format!(
                "auto-add of MAC {mac} refused: {made} records named {prefix}-NNN exist, the limit; remove the ones not wanted (`vdstream target remove ID`) or add this machine by hand")));
        }
        let t = self.load_target(template).map_err(|e| match e {
            StoreError::UnknownTarget { .. } => StoreError::Refused(format!(
                "the auto-add template {template} is not a target record: add it (`vdstream target add {template} --vdisk NAME --cache TYPE`) or name another with --boot-template")),
            e => e,
        })?;
        let now = Timestamp::now();
        let r = TargetRecord {
            format: TARGET_FORMAT.into(),
            format_version: FORMAT_VERSION,
            id: format!("{prefix}-{next:03}"),
            vdisk: t.vdisk,
            version: t.version,
            cache: t.cache,
            ram: t.ram,
            overflow_max: t.overflow_max,
            description: Some(format!("auto-added for MAC {mac} from template {template}")),
            macs: vec![mac.clone()],
            hostname: None,
            overflow_device: t.overflow_device,
            created: now,
            created_by: self.actor().who(),
            updated: now,
            updated_by: self.actor().who(),
            generation: 1,
        };
        self.check_vdisk(&r.vdisk, r.version)?;
        self.write_target(&r)?;
        self.audit("target.auto-add", &r.vdisk, json!({"target": r.id, "mac": mac, "template": template, "version": r.version, "cache": r.cache.name()}))?;
        Ok(r)
    }

    /// `target add`.
    pub fn add_target(&self, t: NewTarget) -> Result<TargetRecord> {
        validate_target_id(&t.id)?;
        let cache = target_cache_type(&t.cache)?;
        let version = t.version.unwrap_or(Selector::Production);
        let description = t.description.filter(|d| !d.is_empty());
        check_fields(
            cache,
            version,
            t.ram,
            t.overflow_max,
            description.as_deref(),
        )?;
        let macs = normalized_macs(&t.macs)?;
        check_boot_fields(t.hostname.as_deref(), t.overflow_device.as_deref())?;
        let _l = self.lock(LockMode::Exclusive)?;
        if self.target_path(&t.id).exists() {
            return Err(StoreError::Refused(format!(
                "target {} already exists in {}: change it with `vdstream target set {} …`, or remove it first", t.id, self.root().display(), t.id)));
        }
        self.check_vdisk(&t.vdisk, version)?;
        self.check_macs_free(&t.id, &macs)?;
        let now = Timestamp::now();
        let r = TargetRecord {
            format: TARGET_FORMAT.into(),
            format_version: FORMAT_VERSION,
            id: t.id,
            vdisk: t.vdisk,
            version,
            cache,
            ram: t.ram,
            overflow_max: t.overflow_max,
            description,
            macs,
            hostname: t.hostname,
            overflow_device: t.overflow_device,
            created: now,
            created_by: self.actor().who(),
            updated: now,
            updated_by: self.actor().who(),
            generation: 1,
        };
        self.write_target(&r)?;
        self.audit("target.add", &r.vdisk, json!({
            "target": r.id, "version": r.version, "cache": r.cache.name(), "ram": r.ram, "overflow_max": r.overflow_max, "description": r.description,
            "macs": r.macs, "hostname": r.hostname, "overflow_device": r.overflow_device,
        }))?;
        Ok(r)
    }

    /// `target set`: changes the fields `change` gives. When the cache type changes,
    /// `ram` and `overflow_max` that the new type does not use are dropped (unless given).
    pub fn set_target(&self, id: &str, change: TargetChange) -> Result<TargetRecord> {
        validate_target_id(id)?;
        if change.is_empty() {
            return Err(StoreError::BadInput(format!(
                "nothing to change for target {id}: give --vdisk, --cache, --version, --ram, --overflow-max, --description, --mac, --remove-mac, --hostname or --overflow-device")));
        }
        let add_macs = normalized_macs(&change.add_macs)?;
        let remove_macs = normalized_macs(&change.remove_macs)?;
        let new_cache = change.cache.as_deref().map(target_cache_type).transpose()?;
        let _l = self.lock(LockMode::Exclusive)?;
        let before = self.load_target(id)?;
        let mut r = before.clone();
        if let Some(v) = &change.vdisk {
            r.vdisk = v.clone();
        }
        if let Some(c) = new_cache {
            r.cache = c;
            if change.ram.is_none() && !uses_ram(c) {
                r.ram = None;
            }
            if change.overflow_max.is_none() && !uses_file(c) {
                r.overflow_max = None;
            }
        }
        if let Some(v) = change.version {
            r.version = v;
        }
        if let Some(ram) = change.ram {
            r.ram = ram;
        }
        if let Some(m) = change.overflow_max {
            r.overflow_max = m;
        }
        if let Some(d) = change.description {
            r.description = d.filter(|d| !d.is_empty());
        }
        if let Some(m) = remove_macs.iter().find(|m| !r.macs.contains(m)) {
            return Err(StoreError::Refused(format!(
                "target {id} has no MAC {m} to remove: its MACs are {}",
                if r.macs.is_empty() {
                    "none".to_string()
                } else {
                    r.macs.join(", ")
                }
            )));
        }
        r.macs.retain(|m| !remove_macs.contains(m));
        r.macs.extend(add_macs.iter().cloned());
        r.macs.sort();
        r.macs.dedup();
        if let Some(h) = change.hostname {
            r.hostname = h.filter(|h| !h.is_empty());
        }
        if let Some(d) = change.overflow_device {
            r.overflow_device = d.filter(|d| !d.is_empty());
        }
        check_fields(
            r.cache,
            r.version,
            r.ram,
            r.overflow_max,
            r.description.as_deref(),
        )?;
        check_boot_fields(r.hostname.as_deref(), r.overflow_device.as_deref())?;
        self.check_macs_free(id, &add_macs)?;
        if r.vdisk != before.vdisk || r.version != before.version {
            self.check_vdisk(&r.vdisk, r.version)?;
        }
        let mut details = json!({"target": id});
        let mut note = |field: &str, from: serde_json::Value, to: serde_json::Value| {
            if from != to {
                details[field] = json!({"from": from, "to": to});
            }
        };
        note("vdisk", json!(before.vdisk), json!(r.vdisk));
        note("version", json!(before.version), json!(r.version));
        note("cache", json!(before.cache.name()), json!(r.cache.name()));
        note("ram", json!(before.ram), json!(r.ram));
        note(
            "overflow_max",
            json!(before.overflow_max),
            json!(r.overflow_max),
        );
        note(
            "description",
            json!(before.description),
            json!(r.description),
        );
        note("macs", json!(before.macs), json!(r.macs));
        note("hostname", json!(before.hostname), json!(r.hostname));
        note(
            "overflow_device",
            json!(before.overflow_device),
            json!(r.overflow_device),
        );
        if r != before {
            r.updated = Timestamp::now();
            r.updated_by = self.actor().who();
            r.generation += 1;
            self.write_target(&r)?;
        }
        self.audit("target.set", &r.vdisk, details)?;
        Ok(r)
    }

    /// `target remove`: deletes the record; returns what it was (`None`: it was damaged).
    pub fn remove_target(&self, id: &str) -> Result<Option<TargetRecord>> {
        validate_target_id(id)?;
        let _l = self.lock(LockMode::Exclusive)?;
        // A damaged record can still be removed; the audit then names no vDisk.
        let (r, vdisk) = match self.load_target(id) {
            Ok(r) => {
                let v = r.vdisk.clone();
                (Some(r), v)
            }
            Err(StoreError::Corrupt { .. }) => (None, String::new()),
            Err(e) => return Err(e),
        };
        let path = self.target_path(id);
        std::fs::remove_file(&path).map_err(io("delete", &path))?;
        fsutil::sync_dir(&self.targets_dir())?;
        // Its enrolment goes with it: a new record of the same id starts unenrolled.
        let enrolled = self.drop_identity(id)?;
        self.audit(
            "target.remove",
            &vdisk,
            json!({"target": id, "damaged": r.is_none(), "enrolment_removed": enrolled}),
        )?;
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_checked_by_cache_type() {
        use CacheType::*;
        let ok = |c, ram, max| check_fields(c, Selector::Production, ram, max, None);
        ok(RamOverflow, Some(1 << 30), Some(10 << 30)).unwrap();
        ok(RamOverflow, Some(0), None).unwrap();
        ok(DeviceRam, Some(1 << 20), None).unwrap();
        ok(DeviceDisk, None, Some(1 << 30)).unwrap();
        ok(Server, None, None).unwrap();
        assert!(ok(DeviceDisk, Some(1), None)
            .unwrap_err()
            .to_string()
            .contains("--ram is for"));
        assert!(ok(DeviceRam, None, Some(1))
            .unwrap_err()
            .to_string()
            .contains("has none"));
        assert!(ok(DeviceRam, Some(0), None).is_err());
        assert!(
            ok(RamOverflow, Some(0), None).is_ok(),
            "0: straight to the file"
        );
        assert!(ok(RamOverflow, Some(1), None)
            .unwrap_err()
            .to_string()
            .contains("too small"));
        assert!(ok(DeviceRam, Some(1 << 40), None)
            .unwrap_err()
            .to_string()
            .contains("at most 256G"));
        assert!(
            ok(DeviceRam, Some(MIN_RAM), None).is_ok()
                && ok(DeviceRam, Some(MAX_RAM), None).is_ok()
        );
        assert!(ok(Server, None, Some(0)).is_err());
        let e = check_fields(Server, Selector::Maintenance, None, None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("maintenance version"), "{e}");
        assert!(check_fields(Server, Selector::Test, None, None, Some("a\nb")).is_err());
        let e = target_cache_type("private").unwrap_err().to_string();
        assert!(
            e.contains("private writes go to the vDisk itself") && e.contains("ram-overflow"),
            "{e}"
        );
        assert!(target_cache_type("ram")
            .unwrap_err()
            .to_string()
            .contains("choose one of"));
    }

    #[test]
    fn changes_read_null_as_clear_and_absent_as_keep() {
        let c: TargetChange =
            serde_json::from_str(r#"{"ram": null, "version": 3, "cache": "device-disk"}"#).unwrap();
        assert_eq!(c.ram, Some(None));
        assert_eq!(c.overflow_max, None);
        assert_eq!(c.version, Some(Selector::Number(3)));
        assert!(serde_json::from_str::<TargetChange>(r#"{"rams": 1}"#).is_err());
        assert!(serde_json::from_str::<TargetChange>("{}")
            .unwrap()
            .is_empty());
    }
}
