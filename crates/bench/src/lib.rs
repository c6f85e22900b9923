//! vdstream's load generator: it talks NBD directly (the project's own client) so that a
//! benchmark needs no fio, and it measures what PVS write-cache comparisons report: total,
//! read and write IOPS, MiB/s, latency (mean, p50, p99, max) and a per-interval time series
//! that shows dips such as a RAM cache starting to overflow.
//!
//! Pieces: [`workload`] (the settings, the VDI preset and each worker's stream of offsets),
//! [`pattern`] (the `--verify` stamps and the ledger of acknowledged writes),
//! [`histogram`] (latency percentiles), [`measure`] (what every runner shares: counters,
//! ledger, sampler, result), the runners [`run`](mod@run) (NBD), [`vhost_user`] (a vhost-user-blk
//! backend, through libblkio's Rust core) and [`device`] (a [`vdstream_blockdev::BlockDev`]
//! in this process, no transport), [`result`] (what a run measured, as JSON and text),
//! [`compare`] (the write-cache comparison table of `vdstream demo`), [`report`]
//! (Markdown with SVG charts) and [`progress`] (the live progress line on stderr).

pub mod compare;
pub mod device;
pub mod histogram;
pub mod measure;
pub mod pattern;
pub mod progress;
pub mod report;
pub mod result;
pub mod run;
pub mod vhost_user;
pub mod workload;

pub use compare::{Comparison, Row};
pub use device::run_device;
pub use measure::{Progress, RunOptions};
pub use result::{BenchResult, Interval, OpFigures, VerifyFigures};
pub use run::{run, wait_ready};
pub use vhost_user::run_vhost_user;
pub use workload::{Profile, Workload, WorkloadError};

use vdstream_nbd::client::ClientError;

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// `cause` is in the message (not a `source`), so the error chain says it once.
    #[error("cannot benchmark {uri}: {cause} ({hint})")]
    Connect {
        uri: String,
        cause: Box<ClientError>,
        hint: &'static str,
    },
    #[error("cannot benchmark {uri}: {cause}")]
    Workload { uri: String, cause: WorkloadError },
    #[error("{uri} is read-only: run with --write-pct 0 to benchmark it with reads only")]
    ReadOnly { uri: String },
    #[error("cannot start the benchmark's runtime: {0}")]
    Runtime(std::io::Error),
    #[error("a request task failed: {0}")]
    Task(String),
    /// A vhost-user backend that could not be reached or used; `cause` is libblkio's.
    #[error("cannot benchmark {uri}: {cause} ({hint})")]
    VhostUser {
        uri: String,
        cause: String,
        hint: String,
    },
    #[error("cannot start the benchmark's threads: {0}")]
    Threads(std::io::Error),
}
