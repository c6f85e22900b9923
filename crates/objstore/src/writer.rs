//! The metadata writer of a store in object storage: the one server that changes it.
//!
//! Garage 2.5.0 does not honour conditional PUTs (`If-None-Match: *` over an object
//! answered 200 and overwrote it), and its K2V API has no compare-and-swap, so two servers
//! cannot safely take turns writing the bucket's metadata. Instead one server is started
//! with `--metadata-writer`: its folder is a whole, writable store (the layers it has not
//! made itself are read from the bucket, as in a mirror), every change is made there under
//! the store's lock, exactly as in a local store, and a publisher copies what changed to the
//! bucket about once a second. The other servers are mirrors: they read the metadata and
//! send changes to the writer's API (the URL in `PREFIX/writer.json`). The lock that orders
//! changes is therefore one `flock` on one machine, and a change decided on an old reading
//! (`If-Match` on the vDisk's generation) is refused there.
//!
//! Publishing keeps the store's order: a vDisk's new layers (object, then index) first,
//! then its `vdisk.json`, so that no server ever reads metadata naming a layer that is not
//! there yet. A maintenance version stays in the writer's folder until it is promoted (its
//! `vdisk.json` is published; its layer is not).
//!
//! `writer.json` names the writer and its heartbeat (every [`HEARTBEAT`]). A second
//! `--metadata-writer` is refused while the heartbeat is younger than [`STALE`]; a writer
//! that finds another's id there (a second writer started by hand after a stall) stops
//! publishing and refuses further changes. That check narrows the window but is not a lock
//! (Garage cannot give one): the role is configuration, one writer per store, like a
//! database primary.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use crate::client::Bucket;
use crate::copy::{download_layer, layer_files, upload_layer, Held};
use crate::error::{local, Error, Result};
use crate::layer::CacheConfig;
use crate::mirror::{is_metadata, write_atomic, Mirror, MIRROR_MARKER, TOKENS};

/// How often the writer looks for changes to publish.
pub const PUBLISH_EVERY: Duration = Duration::from_secs(1);

pub use crate::record::{hostname, WriterRecord, HEARTBEAT, STALE, WRITER_OBJECT};
use crate::record::{now_secs, LOCAL_ID};

/// A layer file as the publisher saw it: (length, mtime in ns).
type Stamp = (u64, i128);

/// What the publisher already sent: layer files by [`Stamp`], metadata by hash.
#[derive(Default)]
struct Published {
    layers: HashMap<String, Stamp>,
    meta: HashMap<String, u64>,
    /// Each published vDisk's incarnation (its `created`).
    created: HashMap<String, String>,
}

/// The file of the vDisk's version in maintenance, if one is.
fn maintenance_file(vdisk_json: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(vdisk_json).ok()?;
    v.get("versions")?
        .as_array()?
        .iter()
        .find(|x| x.get("access").and_then(|a| a.as_str()) == Some("maintenance"))?
        .get("file")?
        .as_str()
        .map(str::to_string)
}

/// A vDisk's incarnation: `created` of its `vdisk.json` (a vDisk deleted and made again
/// under its name has a new one, and reuses its layer file names).
fn incarnation(vdisk_json: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(vdisk_json)
        .ok()
        .and_then(|v| v.get("created").map(|c| c.to_string()))
        .unwrap_or_default()
}

/// Refuses to resume a folder when the bucket holds a newer generation of a vDisk than
/// the folder does: the store was changed without this writer (`store copy`, another
/// writer), and publishing the folder would undo that.
fn refuse_if_bucket_ahead(bucket: &Bucket, dir: &Path) -> Result<()> {
    for (rel, _, _) in bucket.list("vdisks/")? {
        let Some(name) = rel
            .strip_prefix("vdisks/")
            .and_then(|r| r.strip_suffix("/vdisk.json"))
        else {
            continue;
        };
        let gen = |raw: &[u8]| {
            serde_json::from_slice::<serde_json::Value>(raw)
                .ok()
                .and_then(|v| v.get("generation").and_then(|g| g.as_u64()))
                .unwrap_or(0)
        };
        let Some(theirs) = bucket.get_capped(&rel, 64 << 20)? else {
            continue;
        };
        let ours = std::fs::read(dir.join(&rel)).map(|r| gen(&r)).unwrap_or(0);
        if gen(&theirs) > ours {
            return Err(Error::Conflict(format!(
                "{}: vDisk {name} is at generation {} there but {} in this writer's folder {}: the store was changed without this writer \
                 (a store copy, or another writer); move the folder aside (its unpublished changes stay in it) and start again to begin from the bucket",
                bucket.location,
                gen(&theirs),
                ours,
                dir.display()
            )));
        }
    }
    Ok(())
}

/// Moves what an earlier writer left in `dir` (metadata, layers) into `dir/stale-TIME/`:
/// it may hold changes that never reached the bucket, so it is kept, not deleted.
fn set_aside(dir: &Path) -> Result<()> {
    let aside = dir.join(format!("stale-{}", now_secs()));
    let mut moved = Vec::new();
    for name in ["vdisks", "targets", "store.json", "audit.log", TOKENS] {
        let p = dir.join(name);
        if p.exists() {
            vdstream_blockdev::storefile::create_dir_all(&aside)
                .map_err(local("create", &aside))?;
            std::fs::rename(&p, aside.join(name)).map_err(local("move aside", &p))?;
            moved.push(name);
        }
    }
    if !moved.is_empty() {
        log::warn!(
            "{}: a writer's folder from before ({}) set aside into {}",
            dir.display(),
            moved.join(", "),
            aside.display()
        );
    }
    Ok(())
}

/// Fetches every layer the folder's metadata names that is not there whole (resumable,
/// as `store copy` down), so that the writer's folder is a whole store; a layer missing
/// from the bucket (a maintenance version an earlier writer never published) is logged.
fn fetch_layers(bucket: &Bucket, dir: &Path, published: &mut Published) -> Result<()> {
    let store = vdstream_store::Store::open(dir).map_err(|e| Error::Io(e.to_string()))?;
    let (mut layers, mut bytes) = (0, 0);
    for name in store.names().map_err(|e| Error::Io(e.to_string()))? {
        let json_path = dir.join("vdisks").join(&name).join("vdisk.json");
        let json = std::fs::read(&json_path).map_err(local("read", &json_path))?;
        for f in layer_files(&json, &json_path.display().to_string())? {
            let rel = format!("vdisks/{name}/{f}");
            let path = dir.join(&rel);
            if path.exists() {
                continue;
            }
            let Some(raw) = bucket.get_capped(&format!("{rel}.idx"), crate::layer::MAX_INDEX)?
            else {
                log::warn!(
                    "{}: layer {rel} is in neither the bucket nor {}: an earlier writer's unpublished maintenance version?",
                    bucket.location,
                    dir.display()
                );
                continue;
            };
            let index = crate::layer::LayerIndex::parse(&raw, &bucket.what(&format!("{rel}.idx")))?;
            if let Some(n) = download_layer(bucket, &rel, &index, &path, &mut |_| {})? {
                bytes += n;
            }
            layers += 1;
            let m = std::fs::metadata(&path).map_err(local("stat", &path))?;
            published.layers.insert(rel, (m.len(), mtime_of(&m)));
        }
    }
    if layers > 0 {
        log::info!(
            "{}: fetched {layers} layer(s) ({bytes} bytes) into the writer's folder {}",
            bucket.location,
            dir.display()
        );
    }
    Ok(())
}

pub struct Writer {
    pub mirror: Arc<Mirror>,
    record: Mutex<WriterRecord>,
    published: Mutex<Published>,
    fenced: AtomicBool,
    /// When a heartbeat last got through.
    last_beat: Mutex<std::time::Instant>,
    /// The folder's lock (one writer process per folder).
    _lock: std::fs::File,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "metadata writer of {:?}", self.mirror)
    }
}

fn hash(bytes: &[u8]) -> u64 {
    crc32c::crc32c(bytes) as u64 | ((bytes.len() as u64) << 32)
}

fn mtime_of(m: &std::fs::Metadata) -> i128 {
    use std::os::unix::fs::MetadataExt;
    m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128
}

/// One vDisk of an upload: its name, its vdisk.json, and each layer file held with its stamp.
type UpPlan = (String, Vec<u8>, Vec<(Held, Stamp)>);

impl Writer {
    /// Takes the writer role of the store at `bucket` (an empty store is made where there
    /// is none), with `dir` as its folder and `url` as its API; refuses while another
    /// writer is alive. The folder keeps what it holds when it was the last writer (its
    /// changes may not all be published yet), unless the bucket moved on without it;
    /// else it starts from the bucket and fetches every layer, so that it is a whole store
    /// on which every command works as on a local folder.
    pub fn start(
        bucket: Bucket,
        dir: &Path,
        cache: &CacheConfig,
        url: &str,
    ) -> Result<Arc<Writer>> {
        vdstream_blockdev::storefile::create_dir_all(dir)
            .map_err(local("create the writer's folder", dir))?;
        // One process per writer folder, for the life of the process.
        let lock_path = dir.join(".writer.lock");
        let lock = vdstream_blockdev::storefile::open_rw(
            &lock_path,
            vdstream_blockdev::storefile::SHARED_READ,
        )
        .map_err(local("open", &lock_path))?;
        if !vdstream_store::fsutil::try_lock(&lock, vdstream_blockdev::flock::LockMode::Exclusive)
            .map_err(local("lock", &lock_path))?
        {
            return Err(Error::Conflict(format!(
                "{} is the folder of a metadata writer that runs on this host: give this server another --object-cache",
                dir.display()
            )));
        }
        let mirror = Mirror::build(bucket, dir, cache, false)?;
        let bucket = &mirror.bucket;
        let mine = std::fs::read_to_string(dir.join(LOCAL_ID))
            .ok()
            .map(|s| s.trim().to_string());
        let theirs = WriterRecord::read(bucket)?;
        if let Some(r) = theirs.as_ref().filter(|r| Some(&r.id) != mine.as_ref()) {
            let refuse = |r: &WriterRecord, how: String| {
                Error::Conflict(format!(
                    "{} has a metadata writer already: the server at {} on {} (pid {}, {how}); one server writes a store's metadata: \
                     stop that one first (its role is free {} s after its last heartbeat), or start this server without --metadata-writer",
                    bucket.location,
                    r.url,
                    r.host,
                    r.pid,
                    STALE.as_secs()
                ))
            };
            if r.alive() {
                return Err(refuse(r, format!("heartbeat {} s ago", r.age())));
            }
            // Its clock may run behind ours: a record that still changes is a live writer.
            std::thread::sleep(HEARTBEAT * 2 + Duration::from_secs(1));
            if let Some(again) = WriterRecord::read(bucket)?.filter(|a| a != r) {
                return Err(refuse(&again, "its heartbeat still renews".into()));
            }
        }
        let resume = mine.is_some()
            && theirs.as_ref().map(|r| &r.id) == mine.as_ref()
            && dir.join("store.json").exists();
        if resume {
            refuse_if_bucket_ahead(bucket, dir)?;
            let _ = std::fs::remove_file(dir.join(MIRROR_MARKER));
            log::info!(
                "{}: {} was its metadata writer before; what it holds is published again",
                bucket.location,
                dir.display()
            );
        } else {
            if mine.is_some() {
                set_aside(dir)?;
            }
            let _ = std::fs::remove_file(dir.join(MIRROR_MARKER));
            mirror.start_fresh()?;
            mirror.sync()?;
            if !dir.join("store.json").exists() {
                // An empty bucket (or prefix): the writer makes the store there.
                vdstream_store::Store::open_or_create(dir).map_err(|e| Error::Io(e.to_string()))?;
                log::info!("{}: no store there yet; made an empty one", bucket.location);
            }
        }
        let mut published = Published::default();
        fetch_layers(bucket, dir, &mut published)?;
        let id = match (&mine, resume) {
            (Some(id), true) => id.clone(),
            _ => format!("{:016x}", fastrand::u64(..)),
        };
        write_atomic(&dir.join(LOCAL_ID), id.as_bytes())?;
        let now = now_secs();
        let record = WriterRecord {
            id,
            url: url.to_string(),
            host: hostname(),
            folder: std::fs::canonicalize(dir).map_err(local("resolve", dir))?,
            pid: std::process::id(),
            since: now,
            heartbeat: now,
        };
        bucket.put(
            WRITER_OBJECT,
            Bytes::from(serde_json::to_vec_pretty(&record).expect("record")),
        )?;
        // The metadata the bucket has counts as published (a fresh start read it from
        // there); what differs locally goes up in the first round. Each vDisk's
        // incarnation (its `created`) is noted, to tell a vDisk made again under its name.
        for (rel, _, _) in bucket.list("")? {
            if is_metadata(&rel) || rel == TOKENS {
                published.meta.insert(rel.clone(), u64::MAX);
            }
            if let Some(name) = rel
                .strip_prefix("vdisks/")
                .and_then(|r| r.strip_suffix("/vdisk.json"))
            {
                if let Some(raw) = bucket.get_capped(&rel, 64 << 20)? {
                    published
                        .created
                        .insert(name.to_string(), incarnation(&raw));
                }
            }
        }
        let w = Arc::new(Writer {
            mirror: mirror.clone(),
            record: Mutex::new(record),
            published: Mutex::new(published),
            fenced: AtomicBool::new(false),
            last_beat: Mutex::new(std::time::Instant::now()),
            _lock: lock,
        });
        mirror.register();
        let weak = Arc::downgrade(&w);
        std::thread::Builder::new()
            .name("vds-s3-heartbeat".into())
            .spawn(move || loop {
                std::thread::sleep(HEARTBEAT);
                let Some(w) = weak.upgrade() else { return };
                if w.fenced.load(Ordering::Relaxed) {
                    return;
                }
                match w.heartbeat() {
                    Ok(()) => {
                        *w.last_beat.lock().unwrap_or_else(|e| e.into_inner()) =
                            std::time::Instant::now()
                    }
                    Err(e) => log::warn!(
                        "{}: cannot renew {WRITER_OBJECT}: {e}",
                        w.mirror.bucket.location
                    ),
                }
            })
            .map_err(|e| Error::Io(format!("cannot start the heartbeat thread: {e}")))?;
        let weak = Arc::downgrade(&w);
        std::thread::Builder::new()
            .name("vds-s3-publish".into())
            .spawn(move || {
                let mut waiting = false;
                loop {
                    let Some(w) = weak.upgrade() else { return };
                    if w.fenced.load(Ordering::Relaxed) {
                        return;
                    }
                    // Another writer may take the role once this one's heartbeat is STALE
                    // old: publishing stops well before that, until a heartbeat gets through.
                    let silent = w.last_beat.lock().unwrap_or_else(|e| e.into_inner()).elapsed();
                    if silent > STALE - HEARTBEAT * 2 {
                        if !waiting {
                            log::error!(
                                "{}: no heartbeat got through for {} s: publishing waits until one does (changes are kept here)",
                                w.mirror.bucket.location,
                                silent.as_secs()
                            );
                        }
                        waiting = true;
                    } else {
                        waiting = false;
                        if let Err(e) = w.publish() {
                            log::warn!("{}: cannot publish the store's changes yet: {e}; trying again", w.mirror.bucket.location);
                        }
                        w.mirror.write_stats();
                    }
                    drop(w);
                    std::thread::sleep(PUBLISH_EVERY);
                }
            })
            .map_err(|e| Error::Io(format!("cannot start the publisher thread: {e}")))?;
        Ok(w)
    }

    pub fn record(&self) -> WriterRecord {
        self.record
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Renews `writer.json`; if another writer's id is there, stops publishing and makes
    /// the folder refuse changes (a mirror's marker), so that two writers never both publish.
    fn heartbeat(&self) -> Result<()> {
        let bucket = &self.mirror.bucket;
        let mut rec = self.record.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(other) = WriterRecord::read(bucket)?.filter(|r| r.id != rec.id) {
            self.fenced.store(true, Ordering::Relaxed);
            let marker = serde_json::json!({"source": bucket.location.to_string(),
                "note": format!("this server lost the metadata writer role to the server at {} on {}", other.url, other.host)});
            write_atomic(
                &self.mirror.dir.join(MIRROR_MARKER),
                marker.to_string().as_bytes(),
            )?;
            log::error!(
                "{}: another server took the metadata writer role ({} on {}, pid {}): this server publishes nothing more and refuses changes; \
                 its folder {} keeps what it had not published (a writer started on it again sets that aside)",
                bucket.location,
                other.url,
                other.host,
                other.pid,
                self.mirror.dir.display()
            );
            return Ok(());
        }
        rec.heartbeat = now_secs();
        bucket.put(
            WRITER_OBJECT,
            Bytes::from(serde_json::to_vec_pretty(&*rec).expect("record")),
        )
    }

    /// Sends what changed in the folder since the last round: each vDisk's new or changed
    /// layers, then its `vdisk.json`; then the targets, the audit trail, the API tokens
    /// (hashes) and `store.json`;
    /// then removes the metadata of what was deleted. Returns how many objects were sent or
    /// removed. A vDisk whose layer could not be sent keeps its old `vdisk.json` in the
    /// bucket until the next round.
    pub fn publish(&self) -> Result<usize> {
        let dir = &self.mirror.dir;
        let bucket = &self.mirror.bucket;
        let store = vdstream_store::Store::open(dir).map_err(|e| Error::Io(e.to_string()))?;
        let mut published = self.published.lock().unwrap_or_else(|e| e.into_inner());
        // The plan, under the store's shared lock: no change is half made while it is read,
        // and every layer to send is held (the store deletes no file a lock is on).
        let (plan, rest) = {
            let _lock = store
                .lock(vdstream_blockdev::flock::LockMode::Shared)
                .map_err(|e| Error::Io(e.to_string()))?;
            let mut plan: Vec<UpPlan> = Vec::new();
            for name in store.names().map_err(|e| Error::Io(e.to_string()))? {
                let json_path = dir.join("vdisks").join(&name).join("vdisk.json");
                let json = std::fs::read(&json_path).map_err(local("read", &json_path))?;
                let mut held = Vec::new();
                // The maintenance version stays here until it is promoted: uploading it
                // would hold its file (a shared lock) and so refuse its target's reconnect
                // (a rebooting maintenance VM) for as long as the upload runs.
                let maintenance = maintenance_file(&json);
                for f in layer_files(&json, &json_path.display().to_string())? {
                    if maintenance.as_deref() == Some(f.as_str()) {
                        continue;
                    }
                    let rel = format!("vdisks/{name}/{f}");
                    let path = dir.join(&rel);
                    let Ok(meta) = std::fs::metadata(&path) else {
                        continue;
                    }; // in the bucket already
                    let stamp = (meta.len(), mtime_of(&meta));
                    if published.layers.get(&rel) == Some(&stamp) {
                        continue;
                    }
                    // None: something writes it (never a sealed layer); the next round sees.
                    if let Some(file) = vdstream_store::fsutil::hold_shared(&path)
                        .map_err(|e| Error::Io(e.to_string()))?
                    {
                        held.push((
                            Held {
                                rel,
                                path,
                                file,
                                len: stamp.0,
                            },
                            stamp,
                        ));
                    }
                }
                plan.push((format!("vdisks/{name}/vdisk.json"), json, held));
            }
            let mut rest: Vec<(String, Vec<u8>)> = Vec::new();
            let mut paths: Vec<PathBuf> = std::fs::read_dir(dir.join("targets"))
                .map(|rd| rd.flatten().map(|e| e.path()).collect())
                .unwrap_or_default();
            paths.sort();
            paths.push(dir.join("audit.log"));
            paths.push(dir.join(TOKENS));
            paths.push(dir.join("store.json"));
            for p in paths {
                let rel = p
                    .strip_prefix(dir)
                    .expect("inside")
                    .to_string_lossy()
                    .into_owned();
                if (is_metadata(&rel) || rel == TOKENS) && p.is_file() {
                    rest.push((rel, std::fs::read(&p).map_err(local("read", &p))?));
                }
            }
            (plan, rest)
        };
        let mut sent = 0;
        let mut present: HashSet<String> = HashSet::new();
        let mut first_error = None;
        'vdisks: for (rel, json, held) in plan {
            present.insert(rel.clone());
            // A vDisk made again under its name reuses its layer file names: its old
            // metadata goes first, so that no server pairs it with the new layers.
            let name = rel
                .trim_start_matches("vdisks/")
                .trim_end_matches("/vdisk.json")
                .to_string();
            let now = incarnation(&json);
            if published.created.get(&name).is_some_and(|c| *c != now) {
                bucket.delete(&rel)?;
                published.meta.remove(&rel);
                published.created.remove(&name);
                log::info!("{}: vDisk {name} was made again; its old metadata is removed before its new layers go up", bucket.location);
            }
            for (h, stamp) in held {
                match upload_layer(bucket, &h, &mut |_| {}) {
                    Ok(moved) => {
                        if let Some(n) = moved {
                            log::info!(
                                "{}: published layer {} ({} bytes sent)",
                                bucket.location,
                                h.rel,
                                n
                            );
                            sent += 1;
                        }
                        published.layers.insert(h.rel.clone(), stamp);
                    }
                    Err(e) => {
                        first_error.get_or_insert(e);
                        continue 'vdisks;
                    }
                }
            }
            sent += self.put_if_changed(&mut published, &rel, json)?;
            published.created.insert(name, now);
        }
        for (rel, data) in rest {
            present.insert(rel.clone());
            sent += self.put_if_changed(&mut published, &rel, data)?;
        }
        let gone: Vec<String> = published
            .meta
            .keys()
            .filter(|k| !present.contains(*k))
            .cloned()
            .collect();
        for rel in gone {
            bucket.delete(&rel)?;
            published.meta.remove(&rel);
            if let Some(name) = rel
                .strip_prefix("vdisks/")
                .and_then(|r| r.strip_suffix("/vdisk.json"))
            {
                published.created.remove(name);
            }
            log::info!("{}: removed {rel} (deleted in the store)", bucket.location);
            sent += 1;
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(sent),
        }
    }

    fn put_if_changed(&self, published: &mut Published, rel: &str, data: Vec<u8>) -> Result<usize> {
        let h = hash(&data);
        if published.meta.get(rel) == Some(&h) {
            return Ok(0);
        }
        self.mirror.bucket.put(rel, Bytes::from(data))?;
        published.meta.insert(rel.to_string(), h);
        Ok(1)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_maintenance_file_and_the_incarnation_are_read_from_vdisk_json() {
        let j = br#"{"created":"2026-11-27T21:00:00Z","versions":[{"number":1,"file":"g.1.qcow2","access":"production"},{"number":2,"file":"g.2.qcow2","access":"maintenance"}]}"#;
        assert_eq!(super::maintenance_file(j).as_deref(), Some("g.2.qcow2"));
        assert_eq!(
            super::maintenance_file(br#"{"versions":[{"file":"g.1.qcow2","access":"test"}]}"#),
            None
        );
        assert_eq!(super::incarnation(j), "\"2026-11-27T21:00:00Z\"");
        assert_ne!(
            super::incarnation(j),
            super::incarnation(br#"{"created":"2026-11-27T22:00:00Z"}"#)
        );
    }
}
