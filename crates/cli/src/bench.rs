//! `vdstream bench URI`: the built-in load generator's command line. Flags become a
//! [`Workload`]; the run, its figures and its report live in the `vdstream-bench` crate.
//! Live progress goes to stderr only when stderr is a terminal; `--json` prints the whole
//! result (totals, read and write figures, latency percentiles, time series) on stdout.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use vdstream_bench::{BenchResult, Profile, Progress, RunOptions, Workload};

use crate::size::parse_size;

/// Run a workload against an NBD export and measure IOPS, MiB/s and latency.
///
/// Each worker opens its own connection and keeps --queue-depth requests in flight. Writes
/// overwrite the export's data in the working set: point it at a scratch disk or a write cache.
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
  vdstream bench URI --report out/                out/report.md with SVG charts")]
pub struct BenchArgs {
    /// The export: nbd+unix:///NAME?socket=PATH or nbd://HOST:PORT/NAME.
    #[arg(value_name = "URI")]
    uri: String,

    /// A preset the other flags adjust: `vdi` (4 workers, queue depth 16, 4 KiB, 80% writes,
    /// 90% random). It is also the default.
    #[arg(long, value_name = "NAME", default_value = "vdi", value_parser = parse_profile)]
    profile: Profile,

    /// Connections, each with its own stream of offsets.
    #[arg(long, value_name = "N")]
    workers: Option<u32>,

    /// Requests in flight per worker.
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

    /// Bytes from offset 0 to use (e.g. 1G). Default: the whole export.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    working_set: Option<u64>,

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
            usage!("--duration {} is not a number of seconds between 0 and 86400", self.duration);
        }
        w.duration = Duration::from_secs_f64(self.duration);
        w.verify = self.verify;
        Ok(w)
    }
}

/// Runs `workload` on `uri`, with a live progress line on stderr when it is a terminal and
/// `show_progress` is set; `label` starts the line.
pub fn run_with(uri: &str, workload: &Workload, opts: &RunOptions, label: &str, show_progress: bool) -> Result<BenchResult> {
    let live = show_progress && std::io::stderr().is_terminal();
    let mut progress = |p: &Progress| {
        if live {
            let i = &p.interval;
            err!(
                "\r{label}{:>5.1}/{:.0} s  {:>9.0} IOPS (read {:.0}, write {:.0})  mean latency {:>7.1} us   ",
                p.elapsed.as_secs_f64(),
                p.duration.as_secs_f64(),
                i.iops(),
                i.read_iops,
                i.write_iops,
                i.mean_latency_us
            );
            let _ = std::io::stderr().flush();
        }
    };
    let result = vdstream_bench::run(uri, workload, opts, &mut progress);
    if live {
        err!("\r\x1b[2K");
    }
    Ok(result?)
}

/// Keeps the NBD client's connection notices out of the output unless RUST_LOG asks.
pub fn quiet_client_logs() {
    if std::env::var_os("RUST_LOG").is_none() {
        log::set_max_level(log::LevelFilter::Warn);
    }
}

pub fn run(args: BenchArgs) -> Result<()> {
    let workload = args.workload()?;
    quiet_client_logs();
    let result = run_with(&args.uri, &workload, &RunOptions::default(), "", !args.json)?;
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&result).expect("a result serializes"));
    } else {
        out!("{}", result.render());
    }
    if let Some(dir) = &args.report {
        let path = vdstream_bench::report::write_bench(dir, &result).with_context(|| format!("cannot write the report into {}", dir.display()))?;
        if !args.json {
            outln!("report: {}", path.display());
        }
    }
    if !result.ok() {
        let why = match &result.verify {
            Some(v) if v.mismatches > 0 => {
                format!("{} verify mismatches, the first at offset {}", v.mismatches, v.first[0].offset)
            }
            _ => format!("{} requests failed, the first: {}", result.errors, result.error_messages.first().map_or("", |s| s.as_str())),
        };
        bail!("{}: {why}", args.uri);
    }
    Ok(())
}
