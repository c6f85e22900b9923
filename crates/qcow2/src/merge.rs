//! Merging the layers of a backing chain into one new qcow2 image: "merge the updates of a
//! vDisk into one version" (`stop_at = Some(base)`), "flatten into a new base"
//! (`stop_at = None`), and compaction of one version (its own backing as `stop_at`).
//!
//! How a cluster of the new image is decided (guest space is walked in chunks of
//! [`CHUNK_BYTES`]; each layer is asked what *it* holds through its own L1/L2 tables, or
//! `SEEK_DATA`/`SEEK_HOLE` for a raw base, never by reading data):
//!
//! ```text
//!   upper layers (top .. stop_at, exclusive), top first:
//!     the first layer that holds the range decides it:  data/compressed → Data
//!                                                        zero cluster    → Zero
//!     no upper layer holds it                                            → Below
//!   per destination cluster:
//!     Below                   → left unallocated (the new backing, stop_at, serves it)
//!     Zero                    → nothing if stop_at reads zeros there (or there is none),
//!                               else a qcow2 zero cluster
//!     Data, or Zero + Below   → read through the chain; all zeros → as Zero, else written
//! ```
//!
//! Two threads share the work: a reader ([`Planner`]) decides chunk n+1 and reads its data
//! runs while the caller's thread ([`Writer`]) checks chunk n for all-zero clusters and
//! writes it; at most two chunks wait between them, and their buffers are reused.
//!
//! Invariants:
//! - Only destination clusters an upper layer holds data in are read, each once (plus,
//!   when destination clusters are larger than a layer's, those that mix an upper layer's
//!   zeros with data below); nothing that reads as zeros is written as data.
//! - The guest content of `dst` equals that of `top`: a zero in an upper layer over data
//!   in `stop_at` stays a zero cluster; a cluster no upper layer holds falls through to the
//!   same `stop_at` it fell through to before.
//! - `dst` is created (it must not exist), and on success it is complete and durable
//!   (data, metadata and its directory entry fsynced) before `merge_layers` returns; the
//!   caller renames it into place. On failure it is removed.

use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use vdstream_blockdev::{BlockDev, Error, ErrorKind, Extent, Op, Result, ZeroFlags};

use crate::chain::{open_layers, Layer, LayerSpec};
use crate::header::{MAX_CLUSTER_BITS, MIN_CLUSTER_BITS};
use crate::image::{file_error, OpenOptions, Qcow2Image, RunKind};
use crate::ImageFormat;

/// Guest bytes looked at per step (rounded up to whole destination clusters); progress is
/// reported after each.
pub const CHUNK_BYTES: u64 = 4 << 20;

/// L2 cache budget of the image being written.
const DST_L2_CACHE_BYTES: u64 = 64 << 20;

/// How to merge. Build it with `MergeOptions { .., ..Default::default() }`: fields may be
/// added.
#[derive(Debug, Clone, Default)]
pub struct MergeOptions {
    /// Cluster size of the new image as a power of two (9..=21); `None`: top's (16, i.e.
    /// 64 KiB, when top is raw).
    pub cluster_bits: Option<u32>,
}

/// What a merge did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MergeReport {
    /// Data bytes read from the layers (only clusters some upper layer holds).
    pub bytes_read: u64,
    /// Data bytes written to the new image (whole clusters).
    pub bytes_written: u64,
    /// Data clusters written.
    pub clusters_written: u64,
    /// Zero clusters written (zeros over data that `stop_at` holds).
    pub zero_clusters: u64,
    /// Clusters an upper layer held as data that read as zeros and were not copied.
    pub zero_data_dropped: u64,
    pub duration: Duration,
}

/// Writes a new qcow2 v3 image at `dst` whose guest content equals `chain` (bottom first,
/// opened as [`crate::open_recorded`] opens it; its last layer is `top`).
///
/// With `stop_at = Some(p)` (`p` a layer of the chain below `top`) the new image's
/// backing file is `p` (its file name when `p` is in `dst`'s directory, else its absolute
/// path; with the backing format extension) and it holds only what the layers from `top`
/// down to (not including) `p` hold. With `None` it is standalone. `progress(done, total)`
/// is called with guest bytes after every [`CHUNK_BYTES`].
///
/// `dst` must not exist. On `Ok` it is complete and fsynced (file and directory entry),
/// ready to be renamed into place; on `Err` it has been removed.
pub fn merge_layers(
    chain: &[LayerSpec],
    stop_at: Option<&Path>,
    dst: &Path,
    opts: &MergeOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<MergeReport> {
    let started = Instant::now();
    let layers = open_layers(chain)?;
    let top = &layers[0].path;
    let upper_count = match stop_at {
        None => layers.len(),
        Some(p) => stop_index(&layers, top, p)?,
    };
    let below = stop_at.map(|_| layers[upper_count].clone());
    let cluster_bits = match opts.cluster_bits {
        Some(b) => b,
        None => layers[0]
            .qcow2
            .as_ref()
            .map_or(16, |q| q.header().cluster_bits),
    };
    if !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&cluster_bits) {
        return Err(file_error(ErrorKind::Invalid, Op::Open, 0, dst, format!(
            "cluster_bits {cluster_bits} is outside {MIN_CLUSTER_BITS}..={MAX_CLUSTER_BITS} (512 bytes to 2 MiB clusters)")));
    }
    let size = layers[0].dev.size();
    let backing = below
        .as_ref()
        .map(|b| (backing_name(dst, &b.path), b.format));
    crate::create(
        dst,
        size,
        backing.as_ref().map(|(n, f)| (n.as_str(), *f)),
        cluster_bits,
    )?;
    let result = (|| {
        let cs = 1u64 << cluster_bits;
        // Enough to keep every L2 table of dst in memory up to 64 MiB of them, so tables are
        // written once, at the end, rather than evicted (each eviction syncs).
        let l2_cache_bytes = (crate::header::Header::l1_entries_for(size, cluster_bits) * cs)
            .min(DST_L2_CACHE_BYTES);
        let out = Qcow2Image::open(
            dst,
            OpenOptions {
                read_only: false,
                l2_cache_bytes,
            },
            below.as_ref().map(|b| b.dev.clone()),
        )?;
        let planner = Planner {
            top: layers[0].dev.clone(),
            upper: &layers[..upper_count],
            below: below.is_some(),
            cs,
        };
        let mut writer = Writer {
            out: &out,
            below: below.as_ref().map(|b| b.dev.clone()),
            cs,
            report: MergeReport::default(),
        };
        let chunk = CHUNK_BYTES.div_ceil(cs) * cs;
        progress(0, size);
        std::thread::scope(|scope| -> Result<()> {
            // The reader plans and reads chunk n+1 while this thread writes chunk n.
            let (tx, rx) = mpsc::sync_channel::<Result<Batch>>(2);
            let (spare_tx, spare_rx) = mpsc::sync_channel::<Vec<u8>>(4);
            let planner = &planner;
            std::thread::Builder::new()
                .name("merge-read".into())
                .spawn_scoped(scope, move || {
                    let mut at = 0;
                    while at < size {
                        let end = (at + chunk).min(size);
                        let batch = planner.plan(at, end, &spare_rx);
                        let failed = batch.is_err();
                        if tx.send(batch).is_err() || failed {
                            return;
                        }
                        at = end;
                    }
                })
                .map_err(|e| Error::from_io(e, Op::Write, 0, 0, dst.display().to_string()))?;
            // On an error `rx` is dropped here, so the reader's next send fails and it stops.
            for batch in rx {
                let batch = batch?;
                let end = batch.end;
                writer.apply(batch, &spare_tx)?;
                progress(end, size);
            }
            Ok(())
        })?;
        let report = writer.report;
        out.flush()?;
        drop(out);
        sync_dir(dst)?;
        Ok(report)
    })();
    match result {
        Ok(mut report) => {
            report.duration = started.elapsed();
            Ok(report)
        }
        Err(e) => {
            let _ = std::fs::remove_file(dst);
            Err(e)
        }
    }
}

/// The index of `stop_at` in `layers` (compared by canonical path), which must be below top.
fn stop_index(layers: &[Layer], top: &Path, stop_at: &Path) -> Result<usize> {
    let canon = |p: &Path| {
        std::fs::canonicalize(p)
            .map_err(|e| Error::from_io(e, Op::Open, 0, 0, p.display().to_string()))
    };
    let want = canon(stop_at)?;
    for (i, l) in layers.iter().enumerate() {
        if canon(&l.path)? == want {
            if i == 0 {
                return Err(file_error(ErrorKind::Invalid, Op::Open, 0, top,
                    "stop_at is the top image itself, so there is nothing to merge: pass a layer below it, or None to flatten"));
            }
            return Ok(i);
        }
    }
    let chain: Vec<String> = layers
        .iter()
        .map(|l| l.path.display().to_string())
        .collect();
    Err(file_error(
        ErrorKind::Invalid,
        Op::Open,
        0,
        top,
        format!(
            "{} is not in its backing chain ({}): pass one of those layers, or None to flatten",
            stop_at.display(),
            chain.join(" -> ")
        ),
    ))
}

/// How `dst` names `below`: its file name when both sit in one directory (as the store
/// keeps a vDisk's versions; symlinks are not resolved, so the name stays the one the
/// chain uses), else its absolute path.
fn backing_name(dst: &Path, below: &Path) -> String {
    let dir = |p: &Path| -> Option<PathBuf> {
        let parent = p
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::canonicalize(parent).ok()
    };
    match (dir(dst), dir(below), below.file_name()) {
        (Some(a), Some(b), Some(name)) if a == b => name.to_string_lossy().into_owned(),
        _ => std::path::absolute(below)
            .unwrap_or_else(|_| below.to_path_buf())
            .display()
            .to_string(),
    }
}

fn sync_dir(dst: &Path) -> Result<()> {
    let parent = dst
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let io = |e| Error::from_io(e, Op::Flush, 0, 0, parent.display().to_string());
    std::fs::File::open(parent)
        .map_err(io)?
        .sync_all()
        .map_err(io)
}

/// What the upper layers say about a range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Alloc {
    /// No upper layer holds it.
    Below,
    Zero,
    Data,
}

/// What to do with one destination cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    Below,
    Zero,
    /// Read it; data or a mix of zeros and `Below`.
    Read,
}

/// One chunk as the reader planned it.
struct Batch {
    start: u64,
    end: u64,
    /// Per destination cluster: an upper layer makes it read as zeros.
    zero_at: Vec<bool>,
    /// Cluster-aligned runs read through the chain: (guest offset, bytes).
    reads: Vec<(u64, Vec<u8>)>,
}

/// The reading half: decides each chunk and reads what must be copied.
struct Planner<'a> {
    top: Arc<dyn BlockDev>,
    upper: &'a [Layer],
    /// Whether there is a backing (`stop_at`) below the upper layers.
    below: bool,
    cs: u64,
}

impl Planner<'_> {
    /// Plans `[start, end)` (`start` cluster aligned, `end` aligned or the end of the disk)
    /// and reads its data runs, into buffers from `spare` when there are some.
    fn plan(&self, start: u64, end: u64, spare: &mpsc::Receiver<Vec<u8>>) -> Result<Batch> {
        let cs = self.cs;
        let n = (end - start).div_ceil(cs) as usize;
        let mut plan: Vec<Option<Plan>> = vec![None; n];
        for (s, e, a) in self.upper_alloc(start, end)? {
            let p = match a {
                Alloc::Below if !self.below => Plan::Zero,
                Alloc::Below => Plan::Below,
                Alloc::Zero => Plan::Zero,
                Alloc::Data => Plan::Read,
            };
            for slot in &mut plan[((s - start) / cs) as usize..=((e - 1 - start) / cs) as usize] {
                *slot = Some(match (*slot, p) {
                    (None, p) => p,
                    (Some(a), b) if a == b => a,
                    _ => Plan::Read,
                });
            }
        }
        let mut batch = Batch {
            start,
            end,
            zero_at: vec![false; n],
            reads: Vec::new(),
        };
        let mut i = 0;
        while i < n {
            let Some(p) = plan[i] else {
                unreachable!("every cluster is covered")
            };
            let mut j = i + 1;
            while j < n && plan[j] == Some(p) {
                j += 1;
            }
            let (s, e) = (start + i as u64 * cs, (start + j as u64 * cs).min(end));
            match p {
                Plan::Below => {}
                Plan::Zero => batch.zero_at[i..j].fill(true),
                Plan::Read => {
                    let mut buf = spare.try_recv().unwrap_or_default();
                    buf.resize((e - s) as usize, 0);
                    self.top.read_at(&mut buf, s)?;
                    batch.reads.push((s, buf));
                }
            }
            i = j;
        }
        Ok(batch)
    }

    /// What the upper layers hold over `[start, end)`, as sorted, disjoint ranges covering it.
    fn upper_alloc(&self, start: u64, end: u64) -> Result<Vec<(u64, u64, Alloc)>> {
        let mut decided: Vec<(u64, u64, Alloc)> = Vec::new();
        let mut open: Vec<(u64, u64)> = vec![(start, end)];
        for layer in self.upper {
            if open.is_empty() {
                break;
            }
            let mut still = Vec::new();
            for &(s, e) in &open {
                for (a, b, alloc) in layer_alloc(layer, s, e)? {
                    match alloc {
                        Alloc::Below => still.push((a, b)),
                        _ => decided.push((a, b, alloc)),
                    }
                }
            }
            open = still;
        }
        decided.extend(open.into_iter().map(|(s, e)| (s, e, Alloc::Below)));
        decided.sort_unstable_by_key(|d| d.0);
        debug_assert!(decided.windows(2).all(|w| w[0].1 == w[1].0));
        Ok(decided)
    }
}

/// The writing half: drops all-zero clusters, writes the rest and the zero clusters.
struct Writer<'a> {
    out: &'a Qcow2Image,
    below: Option<Arc<dyn BlockDev>>,
    cs: u64,
    report: MergeReport,
}

impl Writer<'_> {
    /// Writes one planned chunk; hands its buffers back through `spare`.
    fn apply(&mut self, batch: Batch, spare: &mpsc::SyncSender<Vec<u8>>) -> Result<()> {
        let cs = self.cs as usize;
        let mut zero_at = batch.zero_at;
        for (s, buf) in batch.reads {
            self.report.bytes_read += buf.len() as u64;
            let first = ((s - batch.start) / self.cs) as usize;
            let clusters = buf.len().div_ceil(cs);
            let zero = &mut zero_at[first..first + clusters];
            for (k, cluster) in buf.chunks(cs).enumerate() {
                zero[k] = is_zero(cluster);
            }
            self.report.zero_data_dropped += zero.iter().filter(|&&z| z).count() as u64;
            let mut k = 0;
            while k < clusters {
                if zero[k] {
                    k += 1;
                    continue;
                }
                let mut j = k + 1;
                while j < clusters && !zero[j] {
                    j += 1;
                }
                let data = &buf[k * cs..(j * cs).min(buf.len())];
                self.out.write_at(data, s + (k * cs) as u64, false)?;
                self.report.bytes_written += data.len() as u64;
                self.report.clusters_written += (j - k) as u64;
                k = j;
            }
            let _ = spare.try_send(buf);
        }
        self.write_zeros(batch.start, batch.end, &zero_at)?;
        self.start_writeback();
        Ok(())
    }

    /// Asks the kernel to start writing dst's dirty pages now, so that the disk works
    /// while the copy goes on and the final fsync has little left to wait for.
    fn start_writeback(&self) {
        let Ok(file) = self.out.file.local() else {
            return;
        };
        // SAFETY: sync_file_range takes the descriptor `file` keeps open and integers;
        // it touches no memory of ours.
        let rc =
            unsafe { libc::sync_file_range(file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
        if rc != 0 {
            log::debug!(
                "{}: sync_file_range: {}",
                self.out.path.display(),
                std::io::Error::last_os_error()
            );
        }
    }

    /// Makes the clusters marked in `zero_at` read as zeros in `dst`: nothing to do where
    /// there is no backing or it reads zeros there, else zero clusters.
    fn write_zeros(&mut self, start: u64, end: u64, zero_at: &[bool]) -> Result<()> {
        let Some(below) = self.below.clone() else {
            return Ok(());
        };
        if !zero_at.contains(&true) {
            return Ok(());
        }
        let below_zero = self.below_zero(&*below, start, end)?;
        let cs = self.cs;
        let mut i = 0;
        while i < zero_at.len() {
            if !zero_at[i] || below_zero[i] {
                i += 1;
                continue;
            }
            let mut j = i + 1;
            while j < zero_at.len() && zero_at[j] && !below_zero[j] {
                j += 1;
            }
            let (s, e) = (start + i as u64 * cs, (start + j as u64 * cs).min(end));
            self.out.write_zeroes(s, e - s, ZeroFlags::default())?;
            self.report.zero_clusters += (j - i) as u64;
            i = j;
        }
        Ok(())
    }

    /// Per destination cluster of `[start, end)`: does the backing read zeros there (by its
    /// block status; past its end it does).
    fn below_zero(&self, below: &dyn BlockDev, start: u64, end: u64) -> Result<Vec<bool>> {
        let cs = self.cs;
        let n = (end - start).div_ceil(cs) as usize;
        let mut zero = vec![true; n];
        let stop = end.min(below.size());
        let mut pos = start;
        // Each round covers at least one byte; bounded by the range length.
        while pos < stop {
            let mut ext: Vec<Extent> = Vec::new();
            below.block_status(pos, stop - pos, &mut ext)?;
            if ext.is_empty() {
                let i = ((pos - start) / cs) as usize;
                zero[i..].fill(false);
                break;
            }
            for x in ext {
                let l = x.len.min(stop - pos);
                if l == 0 {
                    break;
                }
                if !x.zero {
                    let (a, b) = (
                        ((pos - start) / cs) as usize,
                        ((pos + l - 1 - start) / cs) as usize,
                    );
                    zero[a..=b].fill(false);
                }
                pos += l;
            }
        }
        Ok(zero)
    }
}

/// What `layer` itself holds over `[s, e)`: its L2 entries for qcow2 (past its end: zeros,
/// as a reader above it sees), its data/hole map for a raw base (which has nothing below).
fn layer_alloc(layer: &Layer, s: u64, e: u64) -> Result<Vec<(u64, u64, Alloc)>> {
    let mut out: Vec<(u64, u64, Alloc)> = Vec::new();
    let mut push = |a: u64, b: u64, alloc: Alloc| match out.last_mut() {
        Some(l) if l.2 == alloc && l.1 == a => l.1 = b,
        _ if a < b => out.push((a, b, alloc)),
        _ => {}
    };
    let stop = e.min(layer.dev.size()).max(s);
    match &layer.qcow2 {
        Some(img) => {
            for run in img.runs(s, stop - s, Op::Read)? {
                let a = s + run.pos as u64;
                let alloc = match run.kind {
                    RunKind::Backing => Alloc::Below,
                    RunKind::Zero => Alloc::Zero,
                    RunKind::Data(_) | RunKind::Compressed { .. } => Alloc::Data,
                };
                push(a, a + run.len as u64, alloc);
            }
        }
        None => {
            let mut pos = s;
            while pos < stop {
                let mut ext = Vec::new();
                layer.dev.block_status(pos, stop - pos, &mut ext)?;
                if ext.is_empty() {
                    push(pos, stop, Alloc::Data);
                    break;
                }
                for x in ext {
                    let l = x.len.min(stop - pos);
                    if l == 0 {
                        break;
                    }
                    push(pos, pos + l, if x.zero { Alloc::Zero } else { Alloc::Data });
                    pos += l;
                }
            }
        }
    }
    push(stop, e, Alloc::Zero);
    debug_assert!(layer.format == ImageFormat::Qcow2 || layer.qcow2.is_none());
    Ok(out)
}

/// Whether every byte is zero (word at a time).
fn is_zero(buf: &[u8]) -> bool {
    let (head, body, tail) = {
        // SAFETY: every bit pattern is a valid u64; align_to only reinterprets the aligned
        // middle of the slice and leaves the unaligned ends as bytes.
        unsafe { buf.align_to::<u64>() }
    };
    head.iter().all(|&b| b == 0) && body.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::is_zero;

    #[test]
    fn zero_detection_checks_every_byte() {
        let mut b = vec![0u8; 4099];
        assert!(is_zero(&b) && is_zero(&b[1..]) && is_zero(&[]));
        for i in [0, 1, 7, 8, 2048, 4098] {
            b[i] = 1;
            assert!(!is_zero(&b) && !is_zero(&b[..=i]), "byte {i}");
            b[i] = 0;
        }
    }
}
