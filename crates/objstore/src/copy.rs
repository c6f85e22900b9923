//! `vdstream store copy`: a whole store from a folder to object storage, or back.
//!
//! Order makes every step safe to interrupt: the layers of a vDisk go first (object, then
//! its index), then its `vdisk.json`, then the targets and the audit trail, and
//! `store.json` last. A reader of the destination never finds metadata that names a layer
//! not yet there. Run again, the copy skips what is already whole:
//! - up: a layer whose index in the bucket equals the one computed from the file;
//! - down: a layer file whose chunks already match the index; a half-downloaded layer
//!   (`FILE.part`) keeps the chunks that match, and only the rest is fetched.
//!
//! Zero chunks are never sent (see layer.rs), so a sparse raw base costs what it holds.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use object_store::path::Path as ObjPath;
use object_store::{MultipartUpload, ObjectStoreExt, PutPayload};
use serde::Serialize;

use crate::client::{Bucket, S3Location};
use crate::error::{local, Error, Result};
use crate::layer::{IndexBuilder, LayerIndex, CHUNK};
use crate::mirror::{is_metadata, write_atomic};

/// One side of a copy.
#[derive(Debug, Clone)]
pub enum Side {
    Dir(PathBuf),
    S3(S3Location),
}

impl Side {
    pub fn parse(text: &str) -> Result<Self> {
        match S3Location::parse(text) {
            Some(l) => Ok(Side::S3(l?)),
            None => Ok(Side::Dir(vdstream_store::store_dir(Some(Path::new(text))))),
        }
    }
}

/// What a copy did.
#[derive(Debug, Default, Clone, Serialize)]
pub struct CopyReport {
    pub from: String,
    pub to: String,
    pub vdisks: usize,
    pub layers: usize,
    /// Layers already whole at the destination.
    pub layers_skipped: usize,
    /// Bytes of the layers (their files' lengths).
    pub layer_bytes: u64,
    /// Bytes sent or fetched for layers (zero chunks and skipped layers cost nothing).
    pub bytes_moved: u64,
    pub metadata_files: usize,
}

const PARTS_IN_FLIGHT: usize = 4;

/// The layer files `vdisk.json` names (base and versions), parsed loosely so that a copy
/// moves any store format this build reads.
pub(crate) fn layer_files(vdisk_json: &[u8], what: &str) -> Result<Vec<String>> {
    let v: serde_json::Value = serde_json::from_slice(vdisk_json)
        .map_err(|e| Error::Corrupt(format!("{what}: not JSON ({e})")))?;
    let mut out = Vec::new();
    if let Some(f) = v.pointer("/base/file").and_then(|f| f.as_str()) {
        out.push(f.to_string());
    }
    for ver in v
        .get("versions")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
    {
        if let Some(f) = ver.get("file").and_then(|f| f.as_str()) {
            out.push(f.to_string());
        }
    }
    for f in &out {
        if f.contains('/') || f.starts_with('.') || f.is_empty() {
            return Err(Error::Corrupt(format!(
                "{what}: layer file name {f:?} is not a plain file name"
            )));
        }
    }
    Ok(out)
}

/// Copies `from` to `to` (one side a folder, the other `s3://`), calling `progress` with
/// (layer bytes done, layer bytes in all).
pub fn copy(
    from: &Side,
    to: &Side,
    bucket: impl FnOnce(&S3Location) -> Result<Bucket>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<CopyReport> {
    match (from, to) {
        (Side::Dir(d), Side::S3(l)) => {
            let b = bucket(l)?;
            upload(d, &b, progress)
        }
        (Side::S3(l), Side::Dir(d)) => {
            let b = bucket(l)?;
            download(&b, d, progress)
        }
        _ => Err(Error::BadInput(
            "one side of a store copy is a folder and the other s3://BUCKET/PREFIX".into(),
        )),
    }
}

/// One layer file to send, opened and held (a shared `flock`, as the store's readers
/// take: the store deletes no file a lock is on) while the store's lock was held.
pub(crate) struct Held {
    pub(crate) rel: String,
    pub(crate) path: PathBuf,
    pub(crate) file: File,
    pub(crate) len: u64,
}

fn upload(dir: &Path, bucket: &Bucket, progress: &mut dyn FnMut(u64, u64)) -> Result<CopyReport> {
    if let Some(w) = crate::record::WriterRecord::read(bucket)?.filter(|w| w.alive()) {
        return Err(Error::Conflict(format!(
            "{} has a live metadata writer (the server at {} on {}): a copy into it would be overwritten by, or undo, the writer's changes; \
             make changes through the writer, or stop it first",
            bucket.location, w.url, w.host)));
    }
    let store = vdstream_store::Store::open(dir).map_err(|e| Error::NotFound(e.to_string()))?;
    let mut report = CopyReport {
        from: dir.display().to_string(),
        to: bucket.location.to_string(),
        ..Default::default()
    };
    // Under the store's shared lock: the metadata as it is now, and every layer it names
    // opened and held. Then the lock goes, so that the store's own changes (and a server
    // of it) do not wait for an upload that may take hours.
    let (plan, rest) = {
        let _lock = store
            .lock(vdstream_blockdev::flock::LockMode::Shared)
            .map_err(|e| Error::Io(e.to_string()))?;
        let names = store.names().map_err(|e| Error::Io(e.to_string()))?;
        let mut plan: Vec<(String, Vec<u8>, Vec<Held>)> = Vec::new();
        for name in &names {
            let json_path = dir.join("vdisks").join(name).join("vdisk.json");
            let json = std::fs::read(&json_path).map_err(local("read", &json_path))?;
            let mut held = Vec::new();
            for f in layer_files(&json, &json_path.display().to_string())? {
                let path = dir.join("vdisks").join(name).join(&f);
                let file = vdstream_store::fsutil::hold_shared(&path).map_err(|e| Error::Io(e.to_string()))?.ok_or_else(|| {
                    Error::BadInput(format!(
                        "{} is open for writing (a maintenance target of vDisk {name}): stop it, or promote the version, then copy again",
                        path.display()))
                })?;
                let len = file.metadata().map_err(local("stat", &path))?.len();
                held.push(Held {
                    rel: format!("vdisks/{name}/{f}"),
                    path,
                    file,
                    len,
                });
            }
            plan.push((name.clone(), json, held));
        }
        let mut rest: Vec<(String, Vec<u8>)> = Vec::new();
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir.join("targets"))
            .map(|rd| rd.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        paths.sort();
        paths.push(dir.join("audit.log"));
        paths.push(dir.join("store.json"));
        for p in paths {
            let rel = p
                .strip_prefix(dir)
                .expect("inside")
                .to_string_lossy()
                .replace('\\', "/");
            if is_metadata(&rel) && p.is_file() {
                rest.push((rel, std::fs::read(&p).map_err(local("read", &p))?));
            }
        }
        (plan, rest)
    };
    let total: u64 = plan.iter().flat_map(|(_, _, h)| h).map(|h| h.len).sum();
    let mut done = 0;
    progress(0, total);
    for (name, json, held) in &plan {
        for h in held {
            let moved = upload_layer(bucket, h, &mut |n| {
                done += n;
                progress(done, total);
            })?;
            report.layers += 1;
            report.layer_bytes += h.len;
            match moved {
                Some(n) => report.bytes_moved += n,
                None => report.layers_skipped += 1,
            }
        }
        bucket.put(
            &format!("vdisks/{name}/vdisk.json"),
            Bytes::from(json.clone()),
        )?;
        report.vdisks += 1;
        report.metadata_files += 1;
    }
    for (rel, data) in rest {
        bucket.put(&rel, Bytes::from(data))?;
        report.metadata_files += 1;
    }
    // Metadata of vDisks and targets the source no longer has.
    for (rel, _, _) in bucket.list("")? {
        if is_metadata(&rel) && !dir.join(&rel).exists() {
            bucket.delete(&rel)?;
        }
    }
    Ok(report)
}

/// Reads `len` bytes of `file` chunk by chunk, calling `each(index, bytes)`.
fn for_chunks(
    file: &File,
    len: u64,
    path: &Path,
    mut each: impl FnMut(u64, &[u8]) -> Result<()>,
) -> Result<()> {
    let mut buf = vec![0u8; CHUNK as usize];
    for i in 0..len.div_ceil(CHUNK) {
        let n = (len - i * CHUNK).min(CHUNK) as usize;
        file.read_exact_at(&mut buf[..n], i * CHUNK)
            .map_err(local("read", path))?;
        each(i, &buf[..n])?;
    }
    Ok(())
}

/// Multipart part size: 16 chunks, more for layers whose data would need over 9,000
/// parts (S3 allows 10,000).
fn part_size(stored: u64) -> usize {
    let per_part = stored.div_ceil(9_000).div_ceil(CHUNK) * CHUNK;
    per_part.max(16 * CHUNK) as usize
}

type PartTask = tokio::task::JoinHandle<object_store::Result<()>>;

/// Uploads one layer unless the bucket already has it whole (its index equals the file's
/// and the object it names has the stored size); returns the bytes sent (`None`:
/// skipped). The data goes to a new object (`FILE.TOKEN`), and the index naming it is
/// written last: no reader ever sees an index without its object, or an object change
/// under an index.
pub(crate) fn upload_layer(
    bucket: &Bucket,
    h: &Held,
    advance: &mut dyn FnMut(u64),
) -> Result<Option<u64>> {
    let file_name = h.rel.rsplit('/').next().expect("a file name");
    let idx_rel = format!("{}.idx", h.rel);
    let mut b = IndexBuilder::new(String::new(), h.len);
    for_chunks(&h.file, h.len, &h.path, |_, c| {
        b.push(c);
        Ok(())
    })?;
    let mut index = b.finish();
    if let Some(raw) = bucket.get_capped(&idx_rel, crate::layer::MAX_INDEX)? {
        if let Ok(old) = LayerIndex::parse(&raw, &bucket.what(&idx_rel)) {
            if old.len == index.len
                && old.chunks == index.chunks
                && bucket.size(&old.object_rel(&h.rel))? == Some(old.stored_bytes())
            {
                advance(h.len);
                return Ok(None);
            }
        }
    }
    index.object = format!("{file_name}.{:016x}", fastrand::u64(..));
    let object_rel = index.object_rel(&h.rel);
    let what = bucket.what(&object_rel);
    let key = ObjPath::from(bucket.location.key(&object_rel));
    let stored = index.stored_bytes();
    let sent = if stored == 0 {
        // Every chunk is zeros: an empty object (a multipart upload needs a part).
        bucket.put(&object_rel, Bytes::new())?;
        advance(h.len);
        0
    } else {
        let store = bucket.store();
        let mut upload: Box<dyn MultipartUpload> = {
            let (store, key, what) = (store.clone(), key.clone(), what.clone());
            bucket.block(async move {
                store
                    .put_multipart(&key)
                    .await
                    .map_err(|e| Error::from_store(e, &what))
            })?
        };
        let part_len = part_size(stored);
        let mut part: Vec<u8> = Vec::with_capacity(part_len);
        let mut inflight: Vec<PartTask> = Vec::new();
        let mut sent = 0u64;
        let wait_one = |t: PartTask| -> Result<()> {
            bucket
                .block(t)
                .map_err(|e| Error::Io(format!("{what}: {e}")))?
                .map_err(|e| Error::from_store(e, &what))
        };
        let send = |part: &mut Vec<u8>,
                    inflight: &mut Vec<PartTask>,
                    upload: &mut Box<dyn MultipartUpload>|
         -> Result<()> {
            if !part.is_empty() {
                inflight.push(
                    bucket
                        .runtime()
                        .spawn(upload.put_part(PutPayload::from(std::mem::take(part)))),
                );
            }
            while inflight.len() >= PARTS_IN_FLIGHT {
                wait_one(inflight.remove(0))?;
            }
            Ok(())
        };
        let result = for_chunks(&h.file, h.len, &h.path, |i, c| {
            if let Some(crc) = index.chunks[i as usize] {
                // Read again as it is sent: a file written meanwhile is refused, never sent
                // against an index that no longer describes it.
                if crc32c::crc32c(c) != crc {
                    return Err(Error::BadInput(format!(
                        "{} changed while it was copied (chunk {i}): something writes it; stop that writer and copy again",
                        h.path.display())));
                }
                part.extend_from_slice(c);
                sent += c.len() as u64;
                if part.len() >= part_len {
                    send(&mut part, &mut inflight, &mut upload)?;
                }
            } else if c.iter().any(|&b| b != 0) {
                return Err(Error::BadInput(format!("{} changed while it was copied (chunk {i}); copy again", h.path.display())));
            }
            advance(c.len() as u64);
            Ok(())
        })
        .and_then(|()| {
            send(&mut part, &mut inflight, &mut upload)?;
            for t in inflight.drain(..) {
                wait_one(t)?;
            }
            Ok(())
        });
        if let Err(e) = result {
            // Parts still in flight finish (or fail) before the upload is abandoned.
            for t in inflight.drain(..) {
                let _ = bucket.block(t);
            }
            let _ = bucket.block(async move { upload.abort().await });
            return Err(e);
        }
        let (what2, mut upload) = (what.clone(), upload);
        let completed = bucket.block(async move {
            match upload.complete().await {
                Ok(_) => Ok(()),
                Err(e) => {
                    let _ = upload.abort().await;
                    Err(e)
                }
            }
        });
        completed.map_err(|e| Error::from_store(e, &what2))?;
        sent
    };
    bucket.put(
        &idx_rel,
        Bytes::from(serde_json::to_vec(&index).expect("index")),
    )?;
    Ok(Some(sent))
}

/// One vDisk of a copy down: its name, its vdisk.json, and each layer file with its index.
type DownPlan = (String, Bytes, Vec<(String, LayerIndex)>);

fn download(bucket: &Bucket, dir: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<CopyReport> {
    let Some(store_json) = bucket.get("store.json")? else {
        return Err(Error::NotFound(format!(
            "{} holds no vdstream store (no store.json)",
            bucket.location
        )));
    };
    if dir.join(crate::mirror::MIRROR_MARKER).exists() {
        return Err(Error::BadInput(format!(
            "{} is a server's mirror; copy into a folder of its own",
            dir.display()
        )));
    }
    let mut report = CopyReport {
        from: bucket.location.to_string(),
        to: dir.display().to_string(),
        ..Default::default()
    };
    let listed = bucket.list("")?;
    let mut plan: Vec<DownPlan> = Vec::new();
    for (rel, _, _) in &listed {
        let Some(name) = rel
            .strip_prefix("vdisks/")
            .and_then(|r| r.strip_suffix("/vdisk.json"))
        else {
            continue;
        };
        if !is_metadata(rel) {
            continue;
        }
        let json = bucket.get(rel)?.ok_or_else(|| {
            Error::NotFound(format!("{} went away during the copy", bucket.what(rel)))
        })?;
        let mut layers = Vec::new();
        for f in layer_files(&json, &bucket.what(rel))? {
            let lrel = format!("vdisks/{name}/{f}");
            let idx_rel = format!("{lrel}.idx");
            let raw = bucket
                .get(&idx_rel)?
                .ok_or_else(|| Error::NotFound(format!("{}: the layer {f} of vDisk {name} has no index: if it is a maintenance version, it stays on the store's metadata writer while a target writes it (stop that target, or promote the version, and copy again); else copy the store up again", bucket.what(&idx_rel))))?;
            layers.push((lrel, LayerIndex::parse(&raw, &bucket.what(&idx_rel))?));
        }
        plan.push((name.to_string(), json, layers));
    }
    let total: u64 = plan
        .iter()
        .flat_map(|(_, _, l)| l)
        .map(|(_, i)| i.len)
        .sum();
    let mut done = 0;
    progress(0, total);
    for (name, json, layers) in &plan {
        for (lrel, index) in layers {
            let moved = download_layer(bucket, lrel, index, &dir.join(lrel), &mut |n| {
                done += n;
                progress(done, total);
            })?;
            report.layers += 1;
            report.layer_bytes += index.len;
            match moved {
                Some(n) => report.bytes_moved += n,
                None => report.layers_skipped += 1,
            }
        }
        write_atomic(&dir.join("vdisks").join(name).join("vdisk.json"), json)?;
        report.vdisks += 1;
        report.metadata_files += 1;
    }
    for (rel, _, _) in &listed {
        if is_metadata(rel) && !rel.starts_with("vdisks/") && rel != "store.json" {
            if let Some(data) = bucket.get(rel)? {
                write_atomic(&dir.join(rel), &data)?;
                report.metadata_files += 1;
            }
        }
    }
    write_atomic(&dir.join("store.json"), &store_json)?;
    report.metadata_files += 1;
    Ok(report)
}

/// Checks which chunks of the local `path` already match `index`.
fn matching_chunks(path: &Path, index: &LayerIndex) -> Vec<bool> {
    let mut ok = vec![false; index.chunks.len()];
    let Ok(f) = File::open(path) else { return ok };
    let mut buf = vec![0u8; CHUNK as usize];
    let flen = f.metadata().map(|m| m.len()).unwrap_or(0);
    for (i, want) in index.chunks.iter().enumerate() {
        let n = index.chunk_len(i as u64) as usize;
        let at = i as u64 * CHUNK;
        if at + n as u64 > flen || f.read_exact_at(&mut buf[..n], at).is_err() {
            continue;
        }
        let zero = buf[..n].iter().all(|&b| b == 0);
        ok[i] = match want {
            None => zero,
            Some(c) => !zero && crc32c::crc32c(&buf[..n]) == *c,
        };
    }
    ok
}

pub(crate) fn download_layer(
    bucket: &Bucket,
    rel: &str,
    index: &LayerIndex,
    path: &Path,
    advance: &mut dyn FnMut(u64),
) -> Result<Option<u64>> {
    let object_rel = index.object_rel(rel);
    if path.metadata().is_ok_and(|m| m.len() == index.len)
        && matching_chunks(path, index).iter().all(|&b| b)
    {
        advance(index.len);
        return Ok(None);
    }
    if let Some(d) = path.parent() {
        vdstream_blockdev::storefile::create_dir_all(d).map_err(local("create", d))?;
    }
    let part = path.with_file_name(format!(
        "{}.part",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("layer")
    ));
    let f = vdstream_blockdev::storefile::open_rw(&part, vdstream_blockdev::storefile::SHARED_READ)
        .map_err(local("open", &part))?;
    f.set_len(index.len).map_err(local("size", &part))?;
    // What a half-done copy left (a new file's holes match the zero chunks already).
    let have = matching_chunks(&part, index);
    let places = index.places();
    let mut fetched = 0;
    let zeros = vec![0u8; CHUNK as usize];
    for i in 0..index.chunks.len() {
        let n = index.chunk_len(i as u64);
        let at = i as u64 * CHUNK;
        if !have[i] {
            match places[i] {
                Some(place) => {
                    // A chunk that fails its checksum twice stops the copy; the layer
                    // stays in FILE.part, never renamed into place.
                    let b = index.fetch_checked(bucket, &object_rel, i as u64, place, |_| {})?;
                    f.write_all_at(&b, at).map_err(local("write", &part))?;
                    fetched += n;
                }
                None => {
                    // Zeros where an interrupted copy of other bytes left data.
                    f.write_all_at(&zeros[..n as usize], at)
                        .map_err(local("write", &part))?;
                }
            }
        }
        advance(n);
    }
    f.sync_all().map_err(local("sync", &part))?;
    std::fs::rename(&part, path).map_err(local("rename into place", path))?;
    vdstream_store::fsutil::sync_dir(path.parent().unwrap_or(Path::new(".")))
        .map_err(|e| Error::Io(e.to_string()))?;
    Ok(Some(fetched))
}

/// Opens the bucket for a copy with the process's settings.
pub fn open_bucket(location: &S3Location) -> Result<Bucket> {
    Bucket::open(location.clone(), &crate::client::S3Config::from_env()?)
}
