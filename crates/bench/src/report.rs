//! `--report DIR`: a Markdown report with SVG charts beside it, for people who look at
//! charts rather than read tables. `vdstream bench --report` charts one run (IOPS and
//! latency over time); `vdstream demo --report` charts the comparison (IOPS per cache
//! type, storage IOPS per target, and IOPS and latency over time per row, where the
//! overflowing RAM cache shows its dip). Charts are drawn by `vdstream-report`.
//!
//! Invariants: the report only shows figures from the results it is given, and writes
//! `result.json` (the whole result) beside it so every chart can be traced to numbers;
//! files are written into DIR (created if needed), named the same on every run.

use std::io;
use std::path::{Path, PathBuf};

use vdstream_report::svg::{line_chart_with, LineOptions};
use vdstream_report::{bar_chart, line_chart, Series};

use crate::compare::Comparison;
use crate::result::BenchResult;

fn write(dir: &Path, name: &str, text: &str) -> io::Result<()> {
    std::fs::write(dir.join(name), text).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("cannot write {}: {e}", dir.join(name).display()),
        )
    })
}

fn series(name: &str, r: &BenchResult, y: impl Fn(&crate::result::Interval) -> f64) -> Series {
    Series {
        name: name.to_string(),
        points: r.series.iter().map(|i| (i.t_secs, y(i))).collect(),
    }
}

fn figures_table(rows: &[(&str, &BenchResult)]) -> String {
    let mut t = String::from(
        "| run | IOPS | read IOPS | write IOPS | MiB/s | mean latency (µs) | p99 latency (µs) |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for (name, r) in rows {
        t += &format!(
            "| {name} | {:.0} | {:.0} | {:.0} | {:.1} | {:.0} | {:.0} |\n",
            r.total.iops,
            r.read.iops,
            r.write.iops,
            r.total.mib_per_sec,
            r.total.latency.mean_us,
            r.total.latency.p99_us
        );
    }
    t
}

/// Mean latency over time on a log axis: a cache's slow first seconds (hundreds of
/// milliseconds) and a steady RAM cache (hundreds of microseconds) on one chart, each
/// readable, so that a dip like ram-overflow's when it starts to overflow shows.
fn latency_chart(series: &[Series]) -> String {
    line_chart_with(
        "Mean latency over time",
        "seconds",
        "latency (µs, log scale)",
        series,
        LineOptions {
            y_log: true,
            ..LineOptions::default()
        },
    )
}

/// Writes DIR/report.md, DIR/iops-over-time.svg, DIR/latency-over-time.svg and
/// DIR/result.json for one run; returns the report's path.
pub fn write_bench(dir: &Path, r: &BenchResult) -> io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let iops = line_chart(
        "IOPS over time",
        "seconds",
        "IOPS",
        &[
            series("total", r, |i| i.iops()),
            series("read", r, |i| i.read_iops),
            series("write", r, |i| i.write_iops),
        ],
    );
    write(dir, "iops-over-time.svg", &iops)?;
    let latency = latency_chart(&[series("mean latency", r, |i| i.mean_latency_us)]);
    write(dir, "latency-over-time.svg", &latency)?;
    write(
        dir,
        "result.json",
        &serde_json::to_string_pretty(r).expect("a result serializes"),
    )?;
    let w = &r.workload;
    let md = format!(
        "# vdstream bench: {}\n\n\
         {} workers × queue depth {}, {} B blocks, {}% writes, {}% random, working set {} MiB, {:.1} s.\n\n\
         {}\n\
         Latency of all requests: mean {:.0} µs, p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs. Errors: {}.{}\n\n\
         ![IOPS over time](iops-over-time.svg)\n\n\
         ![Mean latency over time](latency-over-time.svg)\n\n\
         Every figure is in `result.json` beside this file.\n",
        r.uri,
        w.workers,
        w.queue_depth,
        w.block_size,
        w.write_pct,
        w.random_pct,
        r.working_set >> 20,
        r.elapsed_secs,
        figures_table(&[("this run", r)]),
        r.total.latency.mean_us,
        r.total.latency.p50_us,
        r.total.latency.p99_us,
        r.total.latency.max_us,
        r.errors,
        r.verify.as_ref().map(|v| format!(" Verify: {} reads checked, {} mismatches.", v.checked_reads, v.mismatches)).unwrap_or_default(),
    );
    write(dir, "report.md", &md)?;
    Ok(dir.join("report.md"))
}

/// Writes DIR/report.md with the comparison table and its charts (IOPS per cache type,
/// storage IOPS per target, IOPS and latency over time per row), then `more` (Markdown the
/// caller adds, with its own charts), and DIR/result.json holding `doc`.
pub fn write_comparison(
    dir: &Path,
    c: &Comparison,
    title: &str,
    intro: &str,
    more: &str,
    doc: &serde_json::Value,
) -> io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let bars = |f: &dyn Fn(&crate::compare::Row) -> f64| -> Vec<(String, f64)> {
        c.rows.iter().map(|r| (r.name.clone(), f(r))).collect()
    };
    write(
        dir,
        "iops-per-cache-type.svg",
        &bar_chart(
            "IOPS per cache type (VDI profile)",
            "IOPS",
            &bars(&|r| r.result.total.iops),
        ),
    )?;
    write(
        dir,
        "storage-iops-per-target.svg",
        &bar_chart(
            "Storage IOPS per target",
            "storage IOPS",
            &bars(&|r| r.storage_iops),
        ),
    )?;
    let per_row = |y: &dyn Fn(&crate::result::Interval) -> f64| -> Vec<Series> {
        c.rows
            .iter()
            .map(|r| series(&r.name, &r.result, y))
            .collect()
    };
    write(
        dir,
        "iops-over-time.svg",
        &line_chart("IOPS over time", "seconds", "IOPS", &per_row(&|i| i.iops())),
    )?;
    write(
        dir,
        "latency-over-time.svg",
        &latency_chart(&per_row(&|i| i.mean_latency_us)),
    )?;
    write(
        dir,
        "result.json",
        &serde_json::to_string_pretty(doc).expect("JSON values serialize"),
    )?;
    let setups: String = c
        .rows
        .iter()
        .map(|r| {
            format!(
                "- **{}**: {}; storage from {}.\n",
                r.name, r.setup, r.storage_source
            )
        })
        .collect();
    let headline = c
        .headline()
        .map(|h| format!("**{h}.**\n\n"))
        .unwrap_or_default();
    let md = format!(
        "# {title}\n\n{intro}\n\n{headline}{}\n{setups}\n\
         ![IOPS per cache type](iops-per-cache-type.svg)\n\n\
         ![Storage IOPS per target](storage-iops-per-target.svg)\n\n\
         IOPS and latency over each run (a RAM cache that overflows shows its dip here):\n\n\
         ![IOPS over time](iops-over-time.svg)\n\n\
         ![Mean latency over time](latency-over-time.svg)\n\n\
         {more}\
         Every figure is in `result.json` beside this file.\n",
        c.render_markdown()
    );
    write(dir, "report.md", &md)?;
    Ok(dir.join("report.md"))
}
