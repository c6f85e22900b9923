//! The VDI profile run in process against `device-disk` (no NBD, no socket): what the cache
//! layer itself costs against the raw disk with the same flags. It answers the question the
//! NBD figures cannot: how much of the gap between `device-disk` through NBD and fio on the
//! raw file is the cache (map, page locks, preallocation, reads of the vDisk) and how much is
//! the trip through the socket, which a server that stores nothing pays as well.
//!
//! The load is that of `shared/bench/vdi.fio` and `vdstream bench --profile vdi`: 4 workers
//! (threads), 16 requests in flight on each, 4 KiB, 80% writes, 90% at random blocks (the rest
//! continue after the worker's previous block), over the whole device, for `--runtime`
//! seconds. Each worker hands its 16 requests to the device as one batch
//! ([`BlockDev::io_batch`], as the NBD server hands it a connection's requests) and sends
//! the next 16 when all are done.
//!
//! Devices (`--device`):
//!
//! - `device-disk`: `DiskCache` over `--base` (read-only, through the page cache, as
//!   `vdstream serve-image BASE --cache device-disk` opens it), its cache file in `--dir` with
//!   O_DIRECT (`--buffered`: through the page cache), zero-filled chunks: the server's
//!   defaults. `--base-direct` reads the base with O_DIRECT as well, so that reads of pages
//!   not written yet get no help from the page cache either.
//! - `raw-disk`: `--base` itself, opened with O_DIRECT, each batch of 16 submitted through the
//!   worker's io_uring ([`vdstream_blockdev::ring::run_batch`]): what this harness gets from
//!   the raw file, beside fio's own io_uring run of the same profile.
//!
//! `--storage-out FILE` writes the bytes the process sent towards storage during the run
//! (`/proc/self/io`), as the script counts a server's.
//!
//! Output: fio's JSON shape, only the fields `bench/cache-vdi.sh` reads (`jobs[0].read` and
//! `.write` with `iops`, `total_ios`, `io_bytes`, `lat_ns.mean`; `jobs[0].error`), on stdout,
//! so the script tabulates these runs beside fio's. The latency of a request is that of its
//! batch.
//!
//! Without `--base` (as `cargo test` runs it: the target has `test = true`) it is a smoke
//! run: both devices for one second on a 64 MiB base of its own, failing on any error.
//!
//! Run: `cargo bench -p vdstream-wcache --bench disk_vdi -- --device device-disk --base FILE
//! --dir DIR --runtime 20` (`bench/cache-vdi.sh --peers raw-disk,device-disk-inproc,...` runs
//! it beside the other peers).

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vdstream_bench::workload::OpStream;
use vdstream_bench::Profile;
use vdstream_blockdev::ring::{run_batch, FileIo};
use vdstream_blockdev::{BatchOp, BlockDev, FileDev, FileOptions};
use vdstream_wcache::disk::DiskCache;
use vdstream_wcache::{CacheConfig, CacheType};

const PAGE: usize = 4096;

#[derive(Debug, Default, Clone, Copy)]
struct Figures {
    read_ops: u64,
    write_ops: u64,
    read_lat_ns: u128,
    write_lat_ns: u128,
    errors: u64,
}

impl Figures {
    fn add(&mut self, o: &Figures) {
        self.read_ops += o.read_ops;
        self.write_ops += o.write_ops;
        self.read_lat_ns += o.read_lat_ns;
        self.write_lat_ns += o.write_lat_ns;
        self.errors += o.errors;
    }
}

/// 4 KiB-aligned buffers, one per request of a batch (O_DIRECT wants aligned memory).
struct Buffers {
    raw: Vec<u8>,
    start: usize,
}

impl Buffers {
    fn new(n: usize) -> Buffers {
        let raw = vec![0xA5u8; (n + 1) * PAGE];
        let start = raw.as_ptr().align_offset(PAGE);
        Buffers { raw, start }
    }

    fn all(&mut self, n: usize) -> Vec<&mut [u8]> {
        self.raw[self.start..self.start + n * PAGE]
            .chunks_mut(PAGE)
            .collect()
    }
}

enum Device {
    Cache(Arc<dyn BlockDev>),
    Raw(std::fs::File),
}

/// Bytes this process sent towards storage so far (`/proc/self/io`: `write_bytes` less
/// `cancelled_write_bytes`), as `bench/cache-vdi.sh` counts a server's.
fn written_by_me() -> i64 {
    let text = std::fs::read_to_string("/proc/self/io").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name)
                    .and_then(|v| v.trim_start_matches(':').trim().parse::<i64>().ok())
            })
            .unwrap_or(0)
    };
    field("write_bytes") - field("cancelled_write_bytes")
}

fn usage(msg: &str) -> ! {
    eprintln!("disk_vdi: {msg}");
    eprintln!("usage: cargo bench -p vdstream-wcache --bench disk_vdi -- --device device-disk|raw-disk --base FILE [--dir DIR] [--runtime SECS] [--buffered] [--base-direct] [--storage-out FILE]");
    std::process::exit(2);
}

/// What one run asks for.
struct Run {
    device: String,
    base: PathBuf,
    dir: PathBuf,
    runtime: f64,
    buffered: bool,
    /// device-disk: read the base with O_DIRECT too (no help from the page cache for pages
    /// not written yet).
    base_direct: bool,
}

/// Runs the profile against the device `run` names; returns its figures and the seconds
/// they took, or why the device could not be opened.
fn measure(run: &Run) -> Result<(Figures, f64), String> {
    let base = &run.base;
    let dev = match run.device.as_str() {
        "device-disk" => {
            let lower = FileDev::open(
                base,
                FileOptions {
                    read_only: true,
                    direct: run.base_direct,
                },
            )
            .map_err(|e| format!("cannot open {}: {e}", base.display()))?;
            let cfg = CacheConfig {
                dir: run.dir.clone(),
                intermediate_buffering: run.buffered,
                ..CacheConfig::new("disk_vdi")
            };
            let cache = DiskCache::open(Arc::new(lower), &cfg, CacheType::DeviceDisk)
                .map_err(|e| format!("cannot open the cache in {}: {e}", run.dir.display()))?;
            Device::Cache(Arc::new(cache))
        }
        "raw-disk" => {
            let mut o = OpenOptions::new();
            o.read(true).write(true);
            if !run.buffered {
                o.custom_flags(libc::O_DIRECT);
            }
            Device::Raw(
                o.open(base)
                    .map_err(|e| format!("cannot open {}: {e}", base.display()))?,
            )
        }
        other => {
            return Err(format!(
                "unknown device {other}: give device-disk or raw-disk"
            ))
        }
    };
    let size = match &dev {
        Device::Cache(d) => d.size(),
        Device::Raw(f) => f.metadata().map(|m| m.len()).unwrap_or(0),
    };
    let mut workload = Profile::Vdi.workload();
    workload.duration = Duration::from_secs_f64(run.runtime);
    let blocks = workload
        .blocks(size)
        .map_err(|e| format!("{}: {e}", base.display()))?;
    let depth = workload.queue_depth as usize;

    let dev = Arc::new(dev);
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let workers: Vec<_> = (0..workload.workers)
        .map(|w| {
            let (dev, stop) = (dev.clone(), stop.clone());
            let mut stream = OpStream::new(&workload, blocks, w, 0x5644_5354_5245_414d);
            std::thread::spawn(move || worker(&dev, &stop, &mut stream, depth))
        })
        .collect();
    std::thread::sleep(workload.duration);
    stop.store(true, Relaxed);
    let mut total = Figures::default();
    for w in workers {
        total.add(&w.join().expect("a worker panicked"));
    }
    Ok((total, start.elapsed().as_secs_f64()))
}

/// One worker: batches of `depth` requests from `stream` until `stop`.
fn worker(dev: &Device, stop: &AtomicBool, stream: &mut OpStream, depth: usize) -> Figures {
    let mut fig = Figures::default();
    let mut bufs = Buffers::new(depth);
    while !stop.load(Relaxed) {
        let plan: Vec<_> = (0..depth).map(|_| stream.next_op()).collect();
        let slots = bufs.all(depth);
        let t0 = Instant::now();
        let results: Vec<bool> = match dev {
            Device::Cache(d) => {
                let mut ops: Vec<BatchOp<'_>> = plan
                    .iter()
                    .zip(slots)
                    .map(|(op, buf)| {
                        let at = op.block * PAGE as u64;
                        if op.write {
                            BatchOp::write(buf, at, false)
                        } else {
                            BatchOp::read(buf, at)
                        }
                    })
                    .collect();
                d.io_batch(&mut ops);
                ops.iter().map(|o| o.result.is_ok()).collect()
            }
            Device::Raw(f) => {
                let mut ios: Vec<FileIo<'_>> = plan
                    .iter()
                    .zip(slots)
                    .map(|(op, buf)| {
                        let at = op.block * PAGE as u64;
                        if op.write {
                            FileIo::write(f, buf, at)
                        } else {
                            FileIo::read(f, buf, at)
                        }
                    })
                    .collect();
                run_batch(&mut ios);
                ios.iter().map(|o| o.result.is_ok()).collect()
            }
        };
        let ns = t0.elapsed().as_nanos();
        for (op, ok) in plan.iter().zip(results) {
            match (ok, op.write) {
                (false, _) => fig.errors += 1,
                (true, true) => {
                    fig.write_ops += 1;
                    fig.write_lat_ns += ns;
                }
                (true, false) => {
                    fig.read_ops += 1;
                    fig.read_lat_ns += ns;
                }
            }
        }
    }
    fig
}

/// The figures in fio's JSON shape (see the module notes).
fn fio_json(device: &str, f: &Figures, secs: f64) -> String {
    let side = |ops: u64, lat: u128| {
        format!(
            r#"{{"iops": {:.1}, "total_ios": {ops}, "io_bytes": {}, "lat_ns": {{"mean": {:.1}}}}}"#,
            ops as f64 / secs,
            ops * PAGE as u64,
            if ops > 0 {
                lat as f64 / ops as f64
            } else {
                0.0
            }
        )
    };
    format!(
        r#"{{"harness": "disk_vdi", "device": "{device}", "jobs": [{{"jobname": "vdi", "error": {}, "read": {}, "write": {}}}]}}"#,
        f.errors,
        side(f.read_ops, f.read_lat_ns),
        side(f.write_ops, f.write_lat_ns)
    )
}

/// Without `--base` (as `cargo test` runs bench targets): both devices for a second on a
/// 64 MiB base of its own in the temp dir; fails unless each answered requests of both
/// kinds without an error.
fn smoke() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let base = dir.path().join("base.img");
    let mut data = vec![0u8; 64 << 20];
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3];
    }
    std::fs::write(&base, &data).expect("write the base");
    for device in ["raw-disk", "device-disk"] {
        let run = Run {
            device: device.into(),
            base: base.clone(),
            dir: dir.path().to_path_buf(),
            runtime: 1.0,
            buffered: false,
            base_direct: false,
        };
        let (f, secs) = match measure(&run) {
            Err(e) if e.contains("O_DIRECT") || e.contains("Invalid argument") => {
                eprintln!("disk_vdi smoke: {device} skipped: the temp dir's file system refuses O_DIRECT ({e})");
                continue;
            }
            r => r.unwrap_or_else(|e| panic!("{device}: {e}")),
        };
        println!("disk_vdi smoke: {}", fio_json(device, &f, secs));
        assert_eq!(f.errors, 0, "{device}: requests failed");
        assert!(
            f.read_ops > 0 && f.write_ops > 0,
            "{device}: no reads or no writes answered: {f:?}"
        );
    }
}

fn main() {
    let mut run = Run {
        device: "device-disk".into(),
        base: PathBuf::new(),
        dir: std::env::temp_dir(),
        runtime: 20.0,
        buffered: false,
        base_direct: false,
    };
    let mut base_given = false;
    let mut storage_out: Option<PathBuf> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || {
            args.next()
                .unwrap_or_else(|| usage(&format!("{a} needs a value")))
        };
        match a.as_str() {
            "--device" => run.device = value(),
            "--base" => {
                run.base = PathBuf::from(value());
                base_given = true;
            }
            "--dir" => run.dir = PathBuf::from(value()),
            "--runtime" => {
                run.runtime = value()
                    .parse()
                    .ok()
                    .filter(|s: &f64| *s > 0.0)
                    .unwrap_or_else(|| usage("--runtime takes seconds"))
            }
            "--buffered" => run.buffered = true,
            "--base-direct" => run.base_direct = true,
            "--storage-out" => storage_out = Some(PathBuf::from(value())),
            "--bench" => {} // cargo bench passes it to harness = false binaries
            other => usage(&format!("unknown argument {other}")),
        }
    }
    if !base_given {
        smoke();
        return;
    }
    let written_before = written_by_me();
    let (total, secs) = measure(&run).unwrap_or_else(|e| usage(&e));
    if let Some(path) = &storage_out {
        let bytes = written_by_me() - written_before;
        std::fs::write(path, format!("{bytes}\n"))
            .unwrap_or_else(|e| usage(&format!("cannot write {}: {e}", path.display())));
    }
    println!("{}", fio_json(&run.device, &total, secs));
    if total.errors > 0 {
        eprintln!("disk_vdi: {} requests failed", total.errors);
        std::process::exit(1);
    }
}
