//! The live progress line of a run on stderr (`vdstream bench`, each row of `vdstream
//! demo`): shown only on a terminal, redrawn in place, erased at the end.

use std::io::{IsTerminal, Write};

use crate::{BenchError, BenchResult, Progress, RunOptions, Workload};

/// Runs `workload` on the NBD export `uri`, with a live progress line on stderr when it is a
/// terminal and `show_progress` is set; `label` starts the line.
pub fn run_with(
    uri: &str,
    workload: &Workload,
    opts: &RunOptions,
    label: &str,
    show_progress: bool,
) -> Result<BenchResult, BenchError> {
    with_progress(label, show_progress, |progress| {
        crate::run(uri, workload, opts, progress)
    })
}

/// Runs `run` with the live progress line of [`run_with`].
pub fn with_progress(
    label: &str,
    show_progress: bool,
    run: impl FnOnce(&mut dyn FnMut(&Progress)) -> Result<BenchResult, BenchError>,
) -> Result<BenchResult, BenchError> {
    let live = show_progress && std::io::stderr().is_terminal();
    // A closed stderr drops the line (there is nowhere left to report it).
    let mut progress = |p: &Progress| {
        if live {
            let i = &p.interval;
            let mut err = std::io::stderr().lock();
            let _ = write!(
                err,
                "\r{label}{:>5.1}/{:.0} s  {:>9.0} IOPS (read {:.0}, write {:.0})  mean latency {:>7.1} us   ",
                p.elapsed.as_secs_f64(),
                p.duration.as_secs_f64(),
                i.iops(),
                i.read_iops,
                i.write_iops,
                i.mean_latency_us
            );
            let _ = err.flush();
        }
    };
    let result = run(&mut progress);
    if live {
        let _ = write!(std::io::stderr().lock(), "\r\x1b[2K");
    }
    result
}

/// Keeps the NBD client's connection notices out of the output unless RUST_LOG asks.
pub fn quiet_client_logs() {
    if std::env::var_os("RUST_LOG").is_none() {
        log::set_max_level(log::LevelFilter::Warn);
    }
}
