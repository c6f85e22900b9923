//! `vdstream size`: RAM sizing advice from a target's recorded I/O trace. Wiring only: the
//! replay through the real cache engines and the recommendation are
//! `vdstream_wcache::sizing`, the chart is `vdstream_report`.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use vdstream_blockdev::{TraceReader, TraceRecord};
use vdstream_report::svg::{line_chart_with, LineOptions, Series};
use vdstream_wcache::sizing::{self, ReplayResult, SizingGoal, TraceSummary};
use vdstream_wcache::CacheType;

use crate::size::{format_size, parse_ram};

/// Replay a recorded I/O trace through each cache type and RAM size, and recommend the
/// smallest RAM that keeps storage IOPS within a target.
///
/// The trace comes from `target attach --record-trace FILE` or `serve-image --record-trace
/// FILE`. Each run opens the real cache engine, empty, over a zero-filled vDisk of the
/// traced size (overflow and cache files in a temporary folder) and replays every request.
/// Storage operations are the cache's own counts of vDisk reads, overflow-file and
/// cache-file reads and writes; storage IOPS divide them by the trace's duration.
/// `device-disk` uses no RAM: it runs once and is the baseline of --target-reduction.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vdstream target attach vm1 --server nbd://10.0.0.1:10809/ --record-trace vm1.trace   (a working day, then Ctrl-C)
  vdstream size --trace vm1.trace --ram 64M,256M,1G,4G
  vdstream size --trace vm1.trace --ram 128M,512M,2G --target-storage-iops 50 --chart ram.svg
  vdstream size --trace vm1.trace --ram 256M,1G --cache ram-overflow --target-reduction 90 --json
Without a target, the recommendation is the smallest RAM within 10% (or 1 IOPS) of the
lowest storage IOPS any size reached: where more RAM stops helping. A RAM size at which
device-ram refuses writes (ENOSPC) never meets a target.")]
pub struct SizeArgs {
    /// The I/O trace to replay.
    #[arg(long, value_name = "FILE")]
    trace: PathBuf,

    /// RAM sizes to try, comma-separated (e.g. 64M,256M,1G,4G).
    #[arg(long, value_name = "SIZES", value_delimiter = ',', value_parser = parse_ram, default_value = "64M,256M,1G,4G")]
    ram: Vec<u64>,

    /// Cache types to replay, comma-separated: ram-overflow, device-ram, device-disk.
    #[arg(
        long,
        value_name = "TYPES",
        value_delimiter = ',',
        default_value = "ram-overflow,device-ram,device-disk"
    )]
    cache: Vec<CacheType>,

    /// Recommend the smallest RAM whose storage IOPS are at most N.
    #[arg(long, value_name = "N", conflicts_with = "target_reduction")]
    target_storage_iops: Option<f64>,

    /// Recommend the smallest RAM whose storage IOPS are at least PCT percent below
    /// device-disk's on the same trace (e.g. 90).
    #[arg(long, value_name = "PCT", value_parser = parse_percent)]
    target_reduction: Option<f64>,

    /// Replays of each ram-overflow run; the one with the median storage operations is
    /// shown (its background flusher makes replays differ at sizes that overflow).
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=99))]
    replays: u32,

    /// Print one JSON document instead of the table.
    #[arg(long)]
    json: bool,

    /// Write a chart of storage IOPS against RAM size (SVG).
    #[arg(long, value_name = "FILE.svg")]
    chart: Option<PathBuf>,
}

fn parse_percent(text: &str) -> Result<f64, String> {
    let p: f64 = text
        .trim_end_matches('%')
        .parse()
        .map_err(|_| format!("{text:?} is not a percentage (e.g. 90)"))?;
    if !(0.0..100.0).contains(&p) {
        return Err(format!(
            "{text:?}: give a reduction from 0 to below 100 percent"
        ));
    }
    Ok(p)
}

pub fn run(args: SizeArgs) -> Result<()> {
    let mut kinds = Vec::new();
    for k in &args.cache {
        if !matches!(
            k,
            CacheType::RamOverflow | CacheType::DeviceRam | CacheType::DeviceDisk
        ) {
            usage!("--cache {k}: size replays ram-overflow, device-ram and device-disk (the target-side types; server types behave as device-disk on the server)");
        }
        if !kinds.contains(k) {
            kinds.push(*k);
        }
    }
    let mut rams = args.ram.clone();
    rams.sort_unstable();
    rams.dedup();
    if rams.is_empty() {
        usage!("--ram: give at least one RAM size (e.g. --ram 64M,256M,1G)");
    }
    let goal = match (args.target_storage_iops, args.target_reduction) {
        (Some(n), _) if !(n.is_finite() && n >= 0.0) => {
            usage!("--target-storage-iops {n}: give a number of IOPS, 0 or more")
        }
        (Some(n), _) => SizingGoal::StorageIops(n),
        (None, Some(p)) => SizingGoal::ReductionPercent(p),
        (None, None) => SizingGoal::NearBest,
    };

    let reader = TraceReader::open(&args.trace)?;
    let device_size = reader.header().device_size;
    let records: Vec<TraceRecord> = reader.collect::<Result<_, _>>()?;
    let trace = TraceSummary::of(&records);
    if records.is_empty() {
        bail!(
            "{} holds no requests: record a workload first (--record-trace while the target runs)",
            args.trace.display()
        );
    }

    // The runs: each RAM size for the types that use RAM, one run for device-disk (also as
    // the baseline of --target-reduction when it was not asked for).
    let mut runs: Vec<(CacheType, u64)> = Vec::new();
    for &k in &kinds {
        if sizing::uses_ram(k) {
            runs.extend(rams.iter().map(|&r| (k, r)));
        } else {
            runs.push((k, 0));
        }
    }
    let baseline_asked = kinds.contains(&CacheType::DeviceDisk);
    if !baseline_asked && matches!(goal, SizingGoal::ReductionPercent(_)) {
        runs.push((CacheType::DeviceDisk, 0));
    }

    // The caches log a full cache as an error; here that is a finding, shown in the table.
    if std::env::var_os("RUST_LOG").is_none() {
        log::set_max_level(log::LevelFilter::Off);
    }
    let tmp = tempfile::Builder::new()
        .prefix("vdstream-size-")
        .tempdir()
        .context("cannot make a temporary folder for the overflow and cache files")?;
    // ram-overflow's flusher is a thread of its own, so its replays vary: take the median.
    let replays_of = |kind: CacheType| {
        if kind == CacheType::RamOverflow {
            args.replays
        } else {
            1
        }
    };
    let total: u64 =
        runs.iter().map(|&(k, _)| replays_of(k) as u64).sum::<u64>() * records.len() as u64;
    let bar = progress_bar(!args.json, total);
    let mut results = Vec::new();
    let mut base = 0u64;
    for &(kind, ram) in &runs {
        let label = if sizing::uses_ram(kind) {
            format!("{kind} {}", format_size(ram))
        } else {
            kind.to_string()
        };
        bar.set_message(label.clone());
        let mut tries = Vec::new();
        for _ in 0..replays_of(kind) {
            let r = sizing::replay(
                &records,
                device_size,
                kind,
                ram,
                tmp.path().to_path_buf(),
                &mut |done| bar.set_position(base + done),
            )
            .with_context(|| format!("cannot replay {} through {label}", args.trace.display()))?;
            base += records.len() as u64;
            tries.push(r);
        }
        tries.sort_by_key(|r| r.storage_ops());
        results.push(tries.swap_remove(tries.len() / 2));
    }
    bar.finish_and_clear();

    let baseline = results
        .iter()
        .find(|r| r.kind == CacheType::DeviceDisk)
        .and_then(|r| r.storage_iops(&trace));
    let advice: Vec<(CacheType, Option<u64>)> = kinds
        .iter()
        .filter(|k| sizing::uses_ram(**k))
        .map(|&k| (k, sizing::recommend(&results, k, &trace, goal, baseline)))
        .collect();
    let shown: Vec<&ReplayResult> = results.iter().filter(|r| kinds.contains(&r.kind)).collect();

    if let Some(path) = &args.chart {
        std::fs::write(path, chart(&shown, &trace, &rams, goal, baseline))
            .with_context(|| format!("cannot write the chart to {}", path.display()))?;
    }
    let report = Report {
        args: &args,
        device_size,
        trace: &trace,
        results: &shown,
        advice: &advice,
        goal,
        baseline,
    };
    if args.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&report_json(&report))
                .context("cannot print the report")?
        );
    } else {
        out!("{}", report_text(&report));
        if let Some(path) = &args.chart {
            outln!("chart: {}", path.display());
        }
    }
    Ok(())
}

fn progress_bar(show: bool, total: u64) -> ProgressBar {
    if !(show && std::io::stderr().is_terminal()) {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template("replaying {msg:24} [{bar:40}] {percent:>3}% eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb
}

fn goal_text(goal: SizingGoal) -> String {
    match goal {
        SizingGoal::StorageIops(n) => format!("storage IOPS at most {n}"),
        SizingGoal::ReductionPercent(p) => {
            format!("storage IOPS at least {p}% below device-disk's")
        }
        SizingGoal::NearBest => {
            "within 10% of the lowest storage IOPS reached (no target given)".into()
        }
    }
}

fn ram_cell(r: &ReplayResult) -> String {
    if r.uses_ram() {
        format_size(r.ram)
    } else {
        "-".into()
    }
}

fn iops_text(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| {
        if v >= 100.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.1}")
        }
    })
}

fn reduction(r: &ReplayResult, trace: &TraceSummary, baseline: Option<f64>) -> Option<f64> {
    match (r.storage_iops(trace), baseline) {
        (Some(v), Some(b)) if b > 0.0 => Some(100.0 * (1.0 - v / b)),
        _ => None,
    }
}

/// Everything the report shows, for the table and the JSON alike.
struct Report<'a> {
    args: &'a SizeArgs,
    device_size: u64,
    trace: &'a TraceSummary,
    results: &'a [&'a ReplayResult],
    advice: &'a [(CacheType, Option<u64>)],
    goal: SizingGoal,
    baseline: Option<f64>,
}

fn report_text(rep: &Report) -> String {
    let Report {
        args,
        device_size,
        trace: t,
        results,
        advice,
        goal,
        baseline,
    } = *rep;
    let mut out = String::new();
    let secs = t.seconds();
    out += &format!(
        "trace {}: {} requests over {} on a {} disk: {} reads, {} writes, {} trims, {} zeroes, {} flushes; guest {} IOPS\n\n",
        args.trace.display(),
        t.requests(),
        secs.map_or("under 1 ms".into(), |s| format!("{s:.1} s")),
        format_size(device_size),
        t.reads,
        t.writes,
        t.trims,
        t.zeroes,
        t.flushes,
        iops_text(secs.map(|s| t.requests() as f64 / s)),
    );
    out += &format!(
        "{:<13} {:>9} {:>11} {:>9} {:>9} {:>10} {:>10} {:>9} {:>10} {:>10}  {}\n",
        "cache",
        "RAM",
        "storage ops",
        "reads",
        "writes",
        "storage",
        "reduction",
        "RAM",
        "peak file",
        "overflow",
        "ENOSPC"
    );
    out += &format!(
        "{:<13} {:>9} {:>11} {:>9} {:>9} {:>10} {:>10} {:>9} {:>10} {:>10}\n",
        "", "", "", "", "", "IOPS", "vs disk", "used", "", "writes"
    );
    for r in results {
        let s = &r.stats;
        let enospc = match r.first_nospace_ns {
            Some(ns) => format!(
                "{} writes refused, first at {:.1} s",
                r.nospace_writes,
                ns as f64 / 1e9
            ),
            None if r.kind == CacheType::DeviceRam => "none".into(),
            None => String::new(),
        };
        out += &format!(
            "{:<13} {:>9} {:>11} {:>9} {:>9} {:>10} {:>10} {:>9} {:>10} {:>10}  {}\n",
            r.kind.name(),
            ram_cell(r),
            r.storage_ops(),
            s.vdisk_read_ops + s.overflow_read_ops + s.disk_read_ops,
            s.storage_write_ops(),
            iops_text(r.storage_iops(t)),
            reduction(r, t, baseline).map_or("-".into(), |p| format!("{p:.0}%")),
            format_size(r.peak_ram_bytes),
            format_size(r.peak_file_bytes),
            s.overflow_write_ops,
            enospc
        );
    }
    out += &format!("\ngoal: {}\n", goal_text(goal));
    for (kind, ram) in advice {
        out += &match ram {
            Some(ram) => format!("recommended: {kind} with --ram {}\n", format_size(*ram).replace(' ', "").replace("iB", "")),
            None => format!(
                "recommended: {kind}: none of the RAM sizes tried meets the goal; try larger sizes{}\n",
                if matches!(goal, SizingGoal::ReductionPercent(_)) && baseline.is_none() { " (device-disk's rate is unknown)" } else { "" }
            ),
        };
    }
    out
}

fn report_json(rep: &Report) -> Value {
    let Report {
        args,
        device_size,
        trace: t,
        results,
        advice,
        goal,
        baseline,
    } = *rep;
    let rows: Vec<Value> = results
        .iter()
        .map(|r| {
            let s = &r.stats;
            json!({
                "cache": r.kind.name(),
                "ram_bytes": r.uses_ram().then_some(r.ram),
                "storage_ops": r.storage_ops(),
                "storage_read_ops": s.vdisk_read_ops + s.overflow_read_ops + s.disk_read_ops,
                "storage_write_ops": s.storage_write_ops(),
                "vdisk_read_ops": s.vdisk_read_ops,
                "overflow_read_ops": s.overflow_read_ops,
                "overflow_write_ops": s.overflow_write_ops,
                "cache_file_read_ops": s.disk_read_ops,
                "cache_file_write_ops": s.disk_write_ops,
                "storage_iops": r.storage_iops(t),
                "reduction_pct": reduction(r, t, baseline),
                "peak_ram_bytes": r.peak_ram_bytes,
                "peak_file_bytes": r.peak_file_bytes,
                "evictions": s.evictions,
                "enospc": r.first_nospace_ns.map(|ns| json!({"refused_writes": r.nospace_writes, "first_at_s": ns as f64 / 1e9})),
                "errors": r.other_errors,
            })
        })
        .collect();
    let goal_json = match goal {
        SizingGoal::StorageIops(n) => json!({"storage_iops_max": n}),
        SizingGoal::ReductionPercent(p) => json!({"reduction_pct_min": p}),
        SizingGoal::NearBest => json!({"near_best": true}),
    };
    json!({
        "trace": {
            "file": args.trace,
            "device_size": device_size,
            "duration_s": t.seconds(),
            "requests": {"read": t.reads, "write": t.writes, "trim": t.trims, "zero": t.zeroes, "flush": t.flushes, "total": t.requests()},
            "read_bytes": t.read_bytes,
            "write_bytes": t.write_bytes,
        },
        "goal": goal_json,
        "ram_overflow_replays": args.replays,
        "device_disk_storage_iops": baseline,
        "results": rows,
        "recommendations": advice.iter().map(|(k, ram)| json!({"cache": k.name(), "ram_bytes": ram})).collect::<Vec<_>>(),
        "chart": args.chart,
    })
}

/// Storage IOPS against RAM size (MiB, log axis), a line per type; device-disk and an
/// explicit IOPS target as flat lines.
fn chart(
    results: &[&ReplayResult],
    t: &TraceSummary,
    rams: &[u64],
    goal: SizingGoal,
    baseline: Option<f64>,
) -> String {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    // A size at which writes were refused has no honest rate: leave a gap.
    let y = |r: &ReplayResult| {
        if r.nospace_writes > 0 {
            f64::NAN
        } else {
            r.storage_iops(t).unwrap_or(f64::NAN)
        }
    };
    let mut series = Vec::new();
    let mut seen = Vec::new();
    for r in results {
        if seen.contains(&r.kind) {
            continue;
        }
        seen.push(r.kind);
        let points = if r.uses_ram() {
            results
                .iter()
                .filter(|o| o.kind == r.kind)
                .map(|o| (mib(o.ram), y(o)))
                .collect()
        } else {
            rams.iter().map(|&ram| (mib(ram), y(r))).collect()
        };
        let refused = results
            .iter()
            .any(|o| o.kind == r.kind && o.nospace_writes > 0);
        let name = match (r.uses_ram(), refused) {
            (false, _) => format!("{} (uses no RAM)", r.kind),
            (true, true) => format!("{} (gaps: ENOSPC)", r.kind),
            (true, false) => r.kind.name().to_string(),
        };
        series.push(Series { name, points });
    }
    let flat = |v: f64| rams.iter().map(|&ram| (mib(ram), v)).collect::<Vec<_>>();
    match (goal, baseline) {
        (SizingGoal::StorageIops(n), _) => series.push(Series {
            name: format!("target {n} IOPS"),
            points: flat(n),
        }),
        (SizingGoal::ReductionPercent(p), Some(b)) => series.push(Series {
            name: format!("target: {p}% below device-disk"),
            points: flat(b * (1.0 - p / 100.0)),
        }),
        _ => {}
    }
    let x_log = rams
        .first()
        .zip(rams.last())
        .is_some_and(|(lo, hi)| *lo > 0 && hi / lo >= 8);
    line_chart_with(
        "Storage IOPS by RAM size",
        "RAM (MiB)",
        "storage IOPS",
        &series,
        LineOptions {
            x_log,
            ..LineOptions::default()
        },
    )
}
