//! `vdstream bench TARGET`: the built-in load generator's command line. Flags become a
//! [`Workload`]; the target picks the runner: an NBD export (`nbd+unix://`, `nbd://`), a
//! vhost-user-blk backend (`vhost-user:PATH`) or a write cache in this process
//! (`in-process:CACHE`, built here over a RAM base); the runs, their figures and their
//! report live in the `vdstream-bench` crate. Live progress goes to stderr only when stderr
//! is a terminal; `--json` prints the whole result (totals, read and write figures, latency
//! percentiles, time series) on stdout.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use vdstream_bench::progress::{quiet_client_logs, run_with, with_progress};
use vdstream_bench::{Profile, RunOptions, Workload};
use vdstream_blockdev::{BlockDev, MemoryDev};
use vdstream_wcache::{CacheConfig, CacheType};

use crate::size::{check_ram_fits_here, format_size, parse_ram, parse_size};

/// Working set (and RAM base) of an in-process run without --working-set: there is no
/// export whose size it could default to.
const IN_PROCESS_WORKING_SET: u64 = 1 << 30;
/// RAM of an in-process cache without --ram.
const IN_PROCESS_RAM: u64 = 2 << 30;

/// Run a workload against an NBD export, a vhost-user-blk backend or a write cache in this
/// process, and measure IOPS, MiB/s and latency.
///
/// Each worker opens its own connection (NBD) or virtqueue (vhost-user) and keeps
/// --queue-depth requests in flight; in-process, each worker is a thread with one request in
/// flight. Writes overwrite the target's data in the working set: point it at a scratch disk
/// or a write cache.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vdstream serve-image --memory 1G &
  vdstream bench 'nbd+unix:///?socket=/tmp/vdstream.sock' --profile vdi --duration 30
                                   the IOmeter VDI profile: 4 workers x QD 16, 4 KiB, 80% writes, 90% random
  vdstream bench nbd://127.0.0.1:10809/ --write-pct 0 --random-pct 0 --block-size 1M --working-set 256M
                                   sequential 1 MiB reads
  vdstream bench URI --verify --duration 10       writes carry offset and generation stamps; reads check them
  vdstream bench URI --json | jq .total.iops
  vdstream bench URI --report out/                out/report.md with SVG charts
  vdstream bench vhost-user:/run/vdstream/lab7.vhost --profile vdi
                                   through a vhost-user-blk backend's socket, one virtqueue per worker
  vdstream bench in-process:ram-overflow --working-set 1G
                                   the write-cache engine alone: no transport, a RAM base")]
pub struct BenchArgs {
    /// What to measure: an NBD export (nbd+unix:///NAME?socket=PATH, nbd://HOST:PORT/NAME);
    /// a vhost-user-blk backend's unix socket (vhost-user:PATH or vhost-user:///ABS/PATH),
    /// which needs one queue per worker; or in-process:CACHE, a write cache of that type
    /// (ram-overflow, device-ram, device-disk, ...) in this process over a zero-filled RAM
    /// base of --working-set bytes (default 1G), its files in a temporary folder.
    #[arg(value_name = "URI")]
    uri: String,

    /// A preset the other flags adjust: `vdi` (4 workers, queue depth 16, 4 KiB, 80% writes,
    /// 90% random). It is also the default.
    #[arg(long, value_name = "NAME", default_value = "vdi", value_parser = parse_profile)]
    profile: Profile,

    /// Workers, each with its own stream of offsets: an NBD connection, a vhost-user virtqueue or an in-process thread.
    #[arg(long, value_name = "N")]
    workers: Option<u32>,

    /// Requests in flight per worker (in-process: always 1, the cache's API being synchronous).
    #[arg(long, value_name = "N")]
    queue_depth: Option<u32>,

    /// Bytes per request, a multiple of 512 (e.g. 4K, 64K, 1M).
    #[arg(long, value_name = "SIZE", value_parser = parse_block_size)]
    block_size: Option<u32>,

    /// Percentage of requests that are writes, 0-100.
    #[arg(long, value_name = "PCT")]
    write_pct: Option<u32>,

    /// Percentage of requests at a random offset, 0-100; the rest continue sequentially.
    #[arg(long, value_name = "PCT")]
    random_pct: Option<u32>,

    /// Bytes from offset 0 to use (e.g. 1G). Default: the whole export (in-process: 1G).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    working_set: Option<u64>,

    /// in-process: targets only: the RAM of a device-ram or ram-overflow cache (default 2G).
    #[arg(long, value_name = "SIZE", value_parser = parse_ram)]
    ram: Option<u64>,

    /// Seconds to run.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    duration: f64,

    /// Writes carry a stamp (offset and generation); reads check the last acknowledged
    /// write's stamp. Mismatches are listed with their offsets and fail the command.
    #[arg(long)]
    verify: bool,

    /// Print the result as one JSON document on stdout.
    #[arg(long)]
    json: bool,

    /// Write DIR/report.md with SVG charts (IOPS and latency over time) and DIR/result.json.
    #[arg(long, value_name = "DIR")]
    report: Option<PathBuf>,
}

fn parse_profile(s: &str) -> Result<Profile, String> {
    Profile::parse(s).ok_or_else(|| format!("unknown profile {s:?}: the profile is `vdi`"))
}

fn parse_block_size(s: &str) -> Result<u32, String> {
    let n = parse_size(s)?;
    u32::try_from(n).map_err(|_| format!("block size {s} is too large: at most 32M"))
}

impl BenchArgs {
    /// The workload: the profile, adjusted by the flags given.
    pub fn workload(&self) -> Result<Workload> {
        let mut w = self.profile.workload();
        w.workers = self.workers.unwrap_or(w.workers);
        w.queue_depth = self.queue_depth.unwrap_or(w.queue_depth);
        w.block_size = self.block_size.unwrap_or(w.block_size);
        w.write_pct = self.write_pct.unwrap_or(w.write_pct);
        w.random_pct = self.random_pct.unwrap_or(w.random_pct);
        w.working_set = self.working_set;
        if !(self.duration.is_finite() && self.duration > 0.0 && self.duration <= 86_400.0) {
            usage!(
                "--duration {} is not a number of seconds between 0 and 86400",
                self.duration
            );
        }
        w.duration = Duration::from_secs_f64(self.duration);
        w.verify = self.verify;
        Ok(w)
    }
}

/// The kinds of target `vdstream bench` takes, by the URI's scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target<'a> {
    Nbd,
    VhostUser,
    /// `in-process:CACHE`, with the cache's name.
    InProcess(&'a str),
}

fn target(uri: &str) -> Target<'_> {
    if uri.starts_with("vhost-user:") {
        Target::VhostUser
    } else if let Some(cache) = uri.strip_prefix("in-process:") {
        Target::InProcess(cache)
    } else {
        Target::Nbd
    }
}

/// The write cache of `in-process:CACHE` over a zero-filled RAM base of `size` bytes, its
/// files in `dir`.
fn in_process_cache(
    uri: &str,
    cache: &str,
    size: u64,
    ram: Option<u64>,
    dir: &std::path::Path,
) -> Result<Arc<dyn BlockDev>> {
    let names = || {
        CacheType::ALL
            .iter()
            .filter(|&&k| k != CacheType::Private)
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let kind = match cache.parse::<CacheType>() {
        Ok(CacheType::Private) => usage!(
            "{uri}: private has no write cache (writes go to the vDisk itself): choose one of {}",
            names()
        ),
        Ok(k) => k,
        Err(_) => usage!(
            "{uri}: unknown cache type {cache:?}: choose one of {}",
            names()
        ),
    };
    let ram = match ram {
        Some(ram) => {
            check_ram_fits_here(kind, ram)?;
            ram
        }
        None => IN_PROCESS_RAM,
    };
    let cfg = CacheConfig {
        ram,
        dir: dir.to_path_buf(),
        ..CacheConfig::new("bench")
    };
    let base: Arc<dyn BlockDev> = Arc::new(MemoryDev::new(size));
    let cache = vdstream_wcache::open(kind, base, &cfg)
        .with_context(|| format!("cannot open the {kind} write cache in {}", dir.display()))?;
    Ok(cache)
}

pub fn run(args: BenchArgs) -> Result<()> {
    let mut workload = args.workload()?;
    quiet_client_logs();
    let opts = RunOptions::default();
    let show = !args.json;
    let target = target(&args.uri);
    if args.ram.is_some() && !matches!(target, Target::InProcess(_)) {
        usage!("--ram is for in-process: targets (a write cache in this process): leave it out");
    }
    let result = match target {
        Target::Nbd => run_with(&args.uri, &workload, &opts, "", show)?,
        Target::VhostUser => with_progress("", show, |p| {
            vdstream_bench::run_vhost_user(&args.uri, &workload, &opts, p)
        })?,
        Target::InProcess(cache) => {
            let size = workload.working_set.unwrap_or(IN_PROCESS_WORKING_SET);
            if size == 0 {
                usage!("--working-set 0 leaves nothing to measure: give e.g. --working-set 1G");
            }
            workload.working_set = Some(size);
            let dir = tempfile::Builder::new()
                .prefix("vdstream-bench.")
                .tempdir()
                .context("cannot make a temporary folder for the cache's files")?;
            let dev = in_process_cache(&args.uri, cache, size, args.ram, dir.path())?;
            log::info!(
                "{}: {} over a RAM base of {}",
                args.uri,
                dev.describe(),
                format_size(size)
            );
            let mut result = with_progress("", show, |p| {
                vdstream_bench::run_device(dev.clone(), &workload, &opts, p)
            })?;
            result.uri = args.uri.clone();
            drop(dev);
            result
        }
    };
    if args.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&result).expect("a result serializes")
        );
    } else {
        out!("{}", result.render());
    }
    if let Some(dir) = &args.report {
        let path = vdstream_bench::report::write_bench(dir, &result)
            .with_context(|| format!("cannot write the report into {}", dir.display()))?;
        if !args.json {
            outln!("report: {}", path.display());
        }
    }
    if !result.ok() {
        let why = match &result.verify {
            Some(v) if v.mismatches > 0 => {
                format!(
                    "{} verify mismatches, the first at offset {}",
                    v.mismatches, v.first[0].offset
                )
            }
            _ => format!(
                "{} requests failed, the first: {}",
                result.errors,
                result.error_messages.first().map_or("", |s| s.as_str())
            ),
        };
        bail!("{}: {why}", args.uri);
    }
    Ok(())
}
