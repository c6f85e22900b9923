//! vdstream's load generator: it talks NBD directly (the project's own client) so that a
//! benchmark needs no fio, and it measures what PVS write-cache comparisons report: total,
//! read and write IOPS, MiB/s, latency (mean, p50, p99, max) and a per-interval time series
//! that shows dips such as a RAM cache starting to overflow.
//!
//! Pieces: [`workload`] (the settings, the VDI preset and each worker's stream of offsets),
//! [`pattern`] (the `--verify` stamps and the ledger of acknowledged writes),
//! [`histogram`] (latency percentiles), [`run`] (the workers and the sampler) and
//! [`result`] (what a run measured, as JSON and text) and [`compare`] (the write-cache
//! comparison table of `vdstream demo`) and [`report`] (Markdown with SVG charts).

pub mod compare;
pub mod histogram;
pub mod pattern;
pub mod report;
pub mod result;
pub mod run;
pub mod workload;

pub use result::{BenchResult, Interval, OpFigures, VerifyFigures};
pub use compare::{Comparison, Row};
pub use run::{run, wait_ready, Progress, RunOptions};
pub use workload::{Profile, Workload, WorkloadError};

use vdstream_nbd::client::ClientError;

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// `cause` is in the message (not a `source`), so the error chain says it once.
    #[error("cannot benchmark {uri}: {cause} ({hint})")]
    Connect { uri: String, cause: Box<ClientError>, hint: &'static str },
    #[error("cannot benchmark {uri}: {cause}")]
    Workload { uri: String, cause: WorkloadError },
    #[error("{uri} is read-only: run with --write-pct 0 to benchmark it with reads only")]
    ReadOnly { uri: String },
    #[error("cannot start the benchmark's runtime: {0}")]
    Runtime(std::io::Error),
    #[error("a request task failed: {0}")]
    Task(String),
}
