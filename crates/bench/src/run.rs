//! Running a [`Workload`] against an NBD export: one connection per worker (the project's
//! async client, pipelined), `queue_depth` requests in flight on each, until the duration
//! is over; the sampler of [`crate::measure`] turns the shared counters into the
//! per-interval time series and calls the caller's progress function.
//!
//! Invariants: a request's latency runs from just before it is handed to the client to its
//! answer; every answered request is reported once to `measure::Shared` (counters, histogram,
//! ledger); with `verify`, a block is held by one request at a time through the ledger. A
//! connection that breaks ends the run (and is reported); an errno answer is counted and the
//! run goes on.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vdstream_nbd::client::{Client, ClientError, ConnectOptions};

use crate::measure::{self, Finished, Pick, Shared, TaskFigures};
pub use crate::measure::{Progress, RunOptions};
use crate::pattern;
use crate::result::BenchResult;
use crate::workload::{OpStream, Workload, WorkloadError};
use crate::BenchError;

/// Runs `workload` against the export at `uri` (`nbd+unix:///NAME?socket=PATH`,
/// `nbd://HOST:PORT/NAME`), calling `progress` once per interval. Blocks until the run is
/// over; builds its own runtime.
pub fn run(
    uri: &str,
    workload: &Workload,
    opts: &RunOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<BenchResult, BenchError> {
    // At least two runtime threads, even on one CPU: with one, the connections' reader
    // tasks fell behind the request tasks (measured pinned to one CPU against nbdkit
    // memory: 6-18k IOPS and a p99 of 20-250 ms, against 39-58k with two threads).
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 8);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("vdstream-bench")
        .enable_all()
        .build()
        .map_err(BenchError::Runtime)?;
    let clients = rt.block_on(async {
        let mut clients = Vec::new();
        for _ in 0..workload.workers.max(1) {
            clients.push(Arc::new(connect(uri).await?));
        }
        Ok::<_, BenchError>(clients)
    })?;
    let export_size = clients[0].size();
    let blocks = workload
        .blocks(export_size)
        .map_err(|cause: WorkloadError| BenchError::Workload {
            uri: uri.to_string(),
            cause,
        })?;
    if workload.write_pct > 0 && clients[0].read_only() {
        return Err(BenchError::ReadOnly {
            uri: uri.to_string(),
        });
    }
    let shared = Arc::new(Shared::new(workload, blocks));

    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    {
        let _in_runtime = rt.enter();
        for (w, client) in clients.iter().enumerate() {
            let stream = Arc::new(Mutex::new(OpStream::new(
                workload, blocks, w as u32, opts.seed,
            )));
            for _ in 0..workload.queue_depth {
                tasks.spawn(request_loop(client.clone(), stream.clone(), shared.clone()));
            }
        }
    }
    // The runtime's threads run the requests; this one samples until the duration is over.
    let series = measure::sample(&shared, workload, opts, start, progress);
    let figures = rt.block_on(async {
        let mut figures = TaskFigures::default();
        while let Some(joined) = tasks.join_next().await {
            figures.merge(&joined.map_err(|e| BenchError::Task(e.to_string()))?);
        }
        Ok::<_, BenchError>(figures)
    })?;
    let elapsed = start.elapsed().as_secs_f64();
    rt.block_on(async {
        for c in &clients {
            let _ = c.disconnect().await;
        }
    });
    Ok(measure::finish(
        &shared,
        Finished {
            uri: uri.to_string(),
            export_size,
            blocks,
            workload,
            figures,
            series,
            elapsed,
        },
    ))
}

/// Waits until `uri` answers an NBD handshake (a server that is starting), at most
/// `timeout`; returns the export's size. The last connection error on timeout.
pub fn wait_ready(uri: &str, timeout: Duration) -> Result<u64, BenchError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(BenchError::Runtime)?;
    rt.block_on(async {
        let deadline = Instant::now() + timeout;
        loop {
            match connect(uri).await {
                Ok(client) => {
                    let size = client.size();
                    let _ = client.disconnect().await;
                    return Ok(size);
                }
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    })
}

async fn connect(uri: &str) -> Result<Client, BenchError> {
    // No allocation map or structured replies needed: plain reads, like fio's engine.
    let opts = ConnectOptions {
        structured_replies: true,
        base_allocation: false,
        ..ConnectOptions::default()
    };
    Client::connect_uri(uri, opts).await.map_err(|cause| {
        let hint = match cause {
            ClientError::Address { .. } => {
                "give nbd+unix:///NAME?socket=PATH or nbd://HOST:PORT/NAME"
            }
            ClientError::Connect { .. } | ClientError::ConnectTimeout { .. } => {
                "is an NBD server listening there?"
            }
            _ => "is it an NBD server, and does it have that export?",
        };
        BenchError::Connect {
            uri: uri.to_string(),
            cause: Box::new(cause),
            hint,
        }
    })
}

/// Picks the next operation (see [`Shared::try_pick`]), yielding while every block it
/// steps to is held by another request.
async fn next_op(stream: &Mutex<OpStream>, shared: &Shared) -> Pick {
    loop {
        if let Some(pick) = shared.try_pick(&mut stream.lock().expect("op stream lock")) {
            return pick;
        }
        tokio::task::yield_now().await;
    }
}

async fn request_loop(
    client: Arc<Client>,
    stream: Arc<Mutex<OpStream>>,
    shared: Arc<Shared>,
) -> TaskFigures {
    let bs = shared.block_size as usize;
    let mut figures = TaskFigures::default();
    let mut buf = vec![0u8; bs];
    // Without --verify every write carries the same stamped block (generation 0).
    pattern::fill(&mut buf, 0, 0);
    while !shared.stopped() {
        let pick = next_op(&stream, &shared).await;
        let offset = shared.offset(&pick);
        if pick.write {
            shared.stamp(&pick, &mut buf);
            let t0 = Instant::now();
            let result = client.write(offset, &buf, false).await;
            let ns = t0.elapsed().as_nanos() as u64;
            match result {
                Ok(()) => shared.wrote(&mut figures, &pick, ns),
                Err(e) => failed(&shared, &pick, e),
            }
        } else {
            let t0 = Instant::now();
            let result = client.read_buf(offset, std::mem::take(&mut buf)).await;
            let ns = t0.elapsed().as_nanos() as u64;
            match result {
                Ok(data) => {
                    buf = data;
                    shared.read(&mut figures, &pick, &buf, ns);
                }
                Err(e) => {
                    buf = vec![0u8; bs];
                    failed(&shared, &pick, e);
                }
            }
        }
    }
    figures
}

/// Counts a failed request; a broken connection ends the run.
fn failed(shared: &Shared, pick: &Pick, e: ClientError) {
    let fatal = matches!(
        e,
        ClientError::Disconnected { .. } | ClientError::Timeout { .. }
    );
    shared.failed(pick, e.to_string(), fatal);
}
