//! A server's local face of a store in object storage.
//!
//! The server keeps the store's small metadata objects (`store.json`, `vdisks/*/vdisk.json`,
//! `targets/*.json`, `audit.log`) in a local folder, the mirror, and opens the store there
//! as it opens any store folder. The layers are not copied: the mirror registers itself
//! as the remote root of its `vdisks/` folder, so a layer file that is not there is read
//! from its object through the chunk cache. Nothing in the mirror is the truth; a server
//! started on an empty folder serves at once, and one that is removed loses nothing.
//!
//! The metadata is read again every few seconds (one LIST, then a GET for each object
//! whose ETag changed), so a version promoted in the bucket reaches every server.
//! Changes to the metadata through a mirror are refused (the store sees `mirror.json`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::client::{Bucket, S3Location};
use crate::error::{local, Error, Result};
use crate::layer::{CacheConfig, ChunkCache, ObjectLayer};

/// The marker a mirror folder carries (the store refuses changes where it is).
pub const MIRROR_MARKER: &str = vdstream_store::MIRROR_MARKER;

/// Whether `rel` (a path inside the store) is one of the metadata objects a mirror keeps.
pub fn is_metadata(rel: &str) -> bool {
    let parts: Vec<&str> = rel.split('/').collect();
    match parts.as_slice() {
        ["store.json"] | ["audit.log"] => true,
        ["targets", f] => f
            .strip_suffix(".json")
            .is_some_and(|id| vdstream_store::names::validate_name(id).is_ok()),
        ["vdisks", name, "vdisk.json"] => vdstream_store::names::validate_name(name).is_ok(),
        _ => false,
    }
}

/// The store's API tokens (SHA-256 hashes only; `vdstream_server::tokens::TOKEN_FILE`): the
/// metadata writer publishes them and mirrors read them, so that one token works on every
/// server of the store (a mirror's API forwards its caller's token to the writer). Not
/// moved by `store copy`: a copied store is another farm.
pub const TOKENS: &str = "api-tokens.json";

/// Writes `bytes` to `path` atomically and durably (the store's own `write_atomic`),
/// creating its folder first; the token file owner-only, as the store keeps it.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(d) = path.parent() {
        vdstream_blockdev::storefile::create_dir_all(d).map_err(local("create", d))?;
    }
    let mode = if path.file_name().is_some_and(|n| n == TOKENS) {
        vdstream_store::fsutil::PRIVATE
    } else {
        vdstream_store::fsutil::SHARED_READ
    };
    vdstream_store::fsutil::write_atomic_mode(path, bytes, mode)
        .map_err(|e| Error::Io(e.to_string()))
}

/// The chunk cache's counters, written into the mirror folder every refresh (GETs, bytes
/// fetched, RAM and SSD hits, checksum failures).
pub const STATS_FILE: &str = "object-stats.json";

pub struct Mirror {
    pub bucket: Arc<Bucket>,
    pub dir: PathBuf,
    vdisks: PathBuf,
    pub cache: Arc<ChunkCache>,
    layers: Mutex<HashMap<PathBuf, Arc<ObjectLayer>>>,
    etags: Mutex<HashMap<String, Option<String>>>,
    /// ETags of the layers' indexes ("NAME/FILE" → ETag), to notice a layer copied again.
    idx_etags: Mutex<HashMap<String, Option<String>>>,
}

impl std::fmt::Debug for Mirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "mirror of {:?} in {}", self.bucket, self.dir.display())
    }
}

impl Mirror {
    /// Opens the store at `bucket` into the folder `dir` (created), fills it with the
    /// metadata, registers it as the remote root of its layers, and reads the metadata
    /// again every `refresh`.
    pub fn open(
        bucket: Bucket,
        dir: &Path,
        cache: &CacheConfig,
        refresh: Duration,
    ) -> Result<Arc<Self>> {
        if dir.join(crate::record::LOCAL_ID).exists() {
            return Err(Error::Conflict(format!(
                "{} is a metadata writer's folder (it may hold changes not yet in the bucket): give this server another --object-cache, \
                 or start it with --metadata-writer again",
                dir.display())));
        }
        let mirror = Self::build(bucket, dir, cache, true)?;
        mirror.start_fresh()?;
        let marker = serde_json::json!({"source": mirror.bucket.location.to_string(), "note": "a local mirror of a store in object storage; its metadata is read from there"});
        write_atomic(&dir.join(MIRROR_MARKER), marker.to_string().as_bytes())?;
        mirror.sync()?;
        mirror.register();
        let weak = Arc::downgrade(&mirror);
        std::thread::Builder::new()
            .name("vds-s3-meta".into())
            .spawn(move || loop {
                std::thread::sleep(refresh);
                let Some(m) = weak.upgrade() else { return };
                if let Err(e) = m.sync() {
                    log::warn!("{}: cannot read the store's metadata again: {e}; serving what was read before", m.bucket.location);
                }
                m.write_stats();
            })
            .map_err(|e| Error::Io(format!("cannot start the metadata thread: {e}")))?;
        Ok(mirror)
    }

    /// The mirror of the store at `bucket` in `dir` (created), with nothing read yet;
    /// `existing`: refused where the bucket holds no store.
    pub(crate) fn build(
        bucket: Bucket,
        dir: &Path,
        cache: &CacheConfig,
        existing: bool,
    ) -> Result<Arc<Self>> {
        let bucket = Arc::new(bucket);
        if existing && bucket.get("store.json")?.is_none() {
            return Err(Error::NotFound(format!(
                "{} holds no vdstream store (no store.json): copy one there with `vdstream store copy --from DIR --to {}`",
                bucket.location, bucket.location
            )));
        }
        vdstream_blockdev::storefile::create_dir_all(dir)
            .map_err(local("create the mirror folder", dir))?;
        Ok(Arc::new(Mirror {
            cache: ChunkCache::new(cache)?,
            bucket,
            dir: dir.to_path_buf(),
            vdisks: dir.join("vdisks"),
            layers: Mutex::new(HashMap::new()),
            etags: Mutex::new(HashMap::new()),
            idx_etags: Mutex::new(HashMap::new()),
        }))
    }

    /// Empties the folder of the metadata (and layer files) an earlier run left: they may
    /// name what the bucket no longer has, so the mirror starts from the bucket alone.
    pub(crate) fn start_fresh(&self) -> Result<()> {
        for stale in ["vdisks", "targets"] {
            let p = self.dir.join(stale);
            if p.exists() {
                std::fs::remove_dir_all(&p).map_err(local("empty", &p))?;
            }
        }
        for stale in ["store.json", "audit.log", crate::record::WRITER_OBJECT] {
            let _ = std::fs::remove_file(self.dir.join(stale));
        }
        Ok(())
    }

    /// Makes this mirror the remote root of its `vdisks/` folder (layers with no local
    /// file are read from the bucket).
    pub(crate) fn register(self: &Arc<Self>) {
        vdstream_blockdev::layerfile::register(Arc::new(Root(self.clone())));
    }

    /// Writes the chunk cache's counters into the folder ([`STATS_FILE`]).
    pub(crate) fn write_stats(&self) {
        let stats = serde_json::json!({"source": self.bucket.location.to_string(), "ram_bytes": self.cache.ram_bytes(), "chunks": self.cache.stats.snapshot()});
        let _ = write_atomic(&self.dir.join(STATS_FILE), stats.to_string().as_bytes());
    }

    /// Reads the metadata objects whose ETag changed, and removes what the bucket no
    /// longer has. Returns how many files changed.
    pub fn sync(&self) -> Result<usize> {
        let all = self.bucket.list("")?;
        // A layer whose index changed (copied up again) is opened anew by the next export
        // that opens it; exports already open keep the object their index named.
        {
            let mut idx = self.idx_etags.lock().unwrap_or_else(|e| e.into_inner());
            let mut layers = self.layers.lock().unwrap_or_else(|e| e.into_inner());
            let now: HashMap<String, Option<String>> = all
                .iter()
                .filter_map(|(rel, _, etag)| {
                    Some((
                        rel.strip_prefix("vdisks/")?
                            .strip_suffix(".idx")?
                            .to_string(),
                        etag.clone(),
                    ))
                })
                .collect();
            for (layer, etag) in idx.iter() {
                if now.get(layer) != Some(etag) {
                    layers.remove(Path::new(layer));
                }
            }
            *idx = now;
        }
        // The metadata, and who writes it (`writer.json`: where this server sends changes).
        let listed: Vec<(String, u64, Option<String>)> = all
            .into_iter()
            .filter(|(rel, _, _)| {
                is_metadata(rel) || rel == crate::record::WRITER_OBJECT || rel == TOKENS
            })
            .collect();
        let mut etags = self.etags.lock().unwrap_or_else(|e| e.into_inner());
        let mut changed = 0;
        for (rel, _, etag) in &listed {
            if etag.is_some() && etags.get(rel) == Some(etag) {
                continue;
            }
            let Some(data) = self.bucket.get(rel)? else {
                continue;
            };
            write_atomic(&self.dir.join(rel), &data)?;
            if rel == TOKENS {
                use std::os::unix::fs::PermissionsExt;
                let p = self.dir.join(rel);
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600))
                    .map_err(local("restrict", &p))?;
            }
            etags.insert(rel.clone(), etag.clone());
            // (The writer's heartbeat renews writer.json every few seconds: not news.)
            changed += usize::from(rel != crate::record::WRITER_OBJECT);
        }
        let gone: Vec<String> = etags
            .keys()
            .filter(|k| !listed.iter().any(|(r, _, _)| r == *k))
            .cloned()
            .collect();
        for rel in gone {
            let path = self.dir.join(&rel);
            let _ = std::fs::remove_file(&path);
            if rel.ends_with("/vdisk.json") {
                // The vDisk's folder holds nothing else in a mirror (its layers are remote).
                let _ = path.parent().map(std::fs::remove_dir);
            }
            etags.remove(&rel);
            changed += 1;
        }
        if changed > 0 {
            log::info!(
                "{}: {changed} metadata file(s) read into {}",
                self.bucket.location,
                self.dir.display()
            );
        }
        Ok(changed)
    }
}

struct Root(Arc<Mirror>);

impl vdstream_blockdev::layerfile::RemoteRoot for Root {
    // The folder the root answers for is the mirror's vdisks/, not its top folder.
    #[allow(clippy::misnamed_getters)]
    fn dir(&self) -> &Path {
        &self.0.vdisks
    }

    fn open(
        &self,
        relative: &Path,
    ) -> Option<std::io::Result<Arc<dyn vdstream_blockdev::layerfile::RemoteFile>>> {
        let m = &self.0;
        if let Some(l) = m
            .layers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(relative)
        {
            return Some(Ok(l.clone()));
        }
        let rel = format!("vdisks/{}", relative.to_str()?);
        match ObjectLayer::open(m.bucket.clone(), &rel, m.cache.clone()) {
            Ok(Some(l)) => {
                m.layers
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(relative.to_path_buf(), l.clone());
                Some(Ok(l))
            }
            Ok(None) => None,
            Err(e) => Some(Err(e.into_io())),
        }
    }
}

/// Where a server keeps the mirror of `location` when no folder is given.
pub fn default_dir(base: &Path, location: &S3Location) -> PathBuf {
    let mut d = base.join(&location.bucket);
    if !location.prefix.is_empty() {
        d = d.join(&location.prefix);
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_metadata_objects_are_mirrored() {
        for yes in [
            "store.json",
            "audit.log",
            "targets/pc-01.json",
            "vdisks/golden/vdisk.json",
        ] {
            assert!(is_metadata(yes), "{yes}");
        }
        for no in [
            "vdisks/golden/golden.base.raw",
            "vdisks/golden/golden.1.qcow2.idx",
            "targets/.x.json",
            "cache/pc-01.cache",
            "vdisks/.tmp/vdisk.json",
            "other",
        ] {
            assert!(!is_metadata(no), "{no}");
        }
    }
}
