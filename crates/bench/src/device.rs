//! Running a [`Workload`] straight on a [`BlockDev`] in this process (`vdstream bench
//! in-process:CACHE`: a write cache over a RAM base), with no transport: what the cache
//! engine itself can do, against which the NBD and vhost-user figures show what their
//! transport costs.
//!
//! The device API is synchronous (`read_at`/`write_at` return when the request is done), so
//! a request in flight is an OS thread: one per worker (see `THREADS_PER_WORKER`), each
//! with its worker's [`OpStream`], so the offsets are those of the other runners. The
//! result's `queue_depth` is what ran, 1, whatever the workload asked.
//!
//! Invariants: as in [`crate::measure`]; a device error is counted as an error answer and
//! the run goes on (no error of a device in this process is a broken transport).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use vdstream_blockdev::BlockDev;

use crate::measure::{self, Finished, Progress, RunOptions, Shared, TaskFigures};
use crate::pattern;
use crate::result::BenchResult;
use crate::workload::{OpStream, Workload};
use crate::BenchError;

/// Threads per worker: 1, so `workers` threads with one request each, rather than
/// `workers × queue_depth` threads. Measured on the 2-core machine, ram-overflow over a
/// 1 GiB RAM base with 2 GiB RAM, the VDI profile (4 workers, QD 16), 10 s runs alternated
/// five times: 4 threads gave 1.3-2.4 M IOPS (median 2.02 M) at a mean latency of 1.5-3 µs;
/// 64 threads 1.2-2.3 M (median 1.98 M) at 28-52 µs, the time a preempted thread waits for
/// a core counted as latency. The same IOPS within the noise, a little more with 4, and
/// latencies that are the cache's own.
const THREADS_PER_WORKER: u32 = 1;

/// Runs `workload` on `dev`, calling `progress` once per interval; blocks until the run is
/// over. The result's `uri` is `in-process:` and the device's description (a caller with a
/// better name sets it), its `queue_depth` 1 (one request per worker: see
/// `THREADS_PER_WORKER`). Writes overwrite `dev`'s data in the working set.
pub fn run_device(
    dev: Arc<dyn BlockDev>,
    workload: &Workload,
    opts: &RunOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<BenchResult, BenchError> {
    let uri = format!("in-process:{}", dev.describe());
    let export_size = dev.size();
    let blocks = workload
        .blocks(export_size)
        .map_err(|cause| BenchError::Workload {
            uri: uri.clone(),
            cause,
        })?;
    if workload.write_pct > 0 && dev.caps().read_only {
        return Err(BenchError::ReadOnly { uri });
    }
    let shared = Shared::new(workload, blocks);
    let streams: Vec<Mutex<OpStream>> = (0..workload.workers)
        .map(|w| Mutex::new(OpStream::new(workload, blocks, w, opts.seed)))
        .collect();
    let threads = THREADS_PER_WORKER;
    let (figures, series, elapsed) = std::thread::scope(|s| {
        let start = Instant::now();
        let mut handles = Vec::new();
        for (w, stream) in streams.iter().enumerate() {
            for t in 0..threads {
                let (dev, shared) = (&*dev, &shared);
                let spawned = std::thread::Builder::new()
                    .name(format!("bench-w{w}-{t}"))
                    .spawn_scoped(s, move || request_loop(dev, stream, shared));
                match spawned {
                    Ok(h) => handles.push(h),
                    Err(e) => {
                        shared.stop();
                        return Err(BenchError::Threads(e));
                    }
                }
            }
        }
        let series = measure::sample(&shared, workload, opts, start, progress);
        let figures = measure::join_workers(handles)?;
        Ok((figures, series, start.elapsed().as_secs_f64()))
    })?;
    let ran = Workload {
        queue_depth: threads,
        ..workload.clone()
    };
    Ok(measure::finish(
        &shared,
        Finished {
            uri,
            export_size,
            blocks,
            workload: &ran,
            figures,
            series,
            elapsed,
        },
    ))
}

fn request_loop(dev: &dyn BlockDev, stream: &Mutex<OpStream>, shared: &Shared) -> TaskFigures {
    let bs = shared.block_size as usize;
    let mut figures = TaskFigures::default();
    let mut wbuf = vec![0u8; bs];
    let mut rbuf = vec![0u8; bs];
    // Without --verify every write carries the same stamped block (generation 0).
    pattern::fill(&mut wbuf, 0, 0);
    while !shared.stopped() {
        let Some(pick) = shared.try_pick(&mut stream.lock().expect("op stream lock")) else {
            std::thread::yield_now();
            continue;
        };
        let offset = shared.offset(&pick);
        if pick.write {
            shared.stamp(&pick, &mut wbuf);
            let t0 = Instant::now();
            let result = dev.write_at(&wbuf, offset, false);
            let ns = t0.elapsed().as_nanos() as u64;
            match result {
                Ok(()) => shared.wrote(&mut figures, &pick, ns),
                Err(e) => shared.failed(&pick, e.to_string(), false),
            }
        } else {
            let t0 = Instant::now();
            let result = dev.read_at(&mut rbuf, offset);
            let ns = t0.elapsed().as_nanos() as u64;
            match result {
                Ok(()) => shared.read(&mut figures, &pick, &rbuf, ns),
                Err(e) => shared.failed(&pick, e.to_string(), false),
            }
        }
    }
    figures
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use vdstream_blockdev::{Filter, MemoryDev, ReadOnly};

    use super::*;

    fn short(workload: Workload) -> (Workload, RunOptions) {
        let w = Workload {
            duration: Duration::from_millis(400),
            working_set: Some(4 << 20),
            verify: true,
            ..workload
        };
        (
            w,
            RunOptions {
                interval: Duration::from_millis(100),
                ..RunOptions::default()
            },
        )
    }

    /// A device that flips one bit of every read, in the magic of the block's seventh stamp
    /// (bytes 104..108), as a torn or corrupted read would.
    #[derive(Debug)]
    struct FlipsReads(MemoryDev);

    impl Filter for FlipsReads {
        type Inner = MemoryDev;
        fn inner(&self) -> &MemoryDev {
            &self.0
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> vdstream_blockdev::Result<()> {
            self.0.read_at(buf, offset)?;
            buf[104] ^= 0x40;
            Ok(())
        }
    }

    #[test]
    fn a_verify_run_on_a_memory_device_is_clean() {
        let (w, opts) = short(Workload {
            workers: 2,
            queue_depth: 4,
            write_pct: 50,
            ..Workload::default()
        });
        let mut intervals = 0;
        let r = run_device(Arc::new(MemoryDev::new(64 << 20)), &w, &opts, &mut |_| {
            intervals += 1
        })
        .unwrap();
        assert!(r.read.ops > 100 && r.write.ops > 100, "{}", r.render());
        assert_eq!(r.total.ops, r.read.ops + r.write.ops);
        assert_eq!(
            (r.errors, r.working_set, r.export_size),
            (0, 4 << 20, 64 << 20),
            "{}",
            r.render()
        );
        let v = r.verify.as_ref().expect("verify figures");
        assert!(v.checked_reads > 10, "{}", r.render());
        assert_eq!(v.mismatches, 0, "{}", r.render());
        assert!(
            r.ok() && intervals >= 2 && !r.series.is_empty(),
            "{intervals} intervals: {}",
            r.render()
        );
        assert_eq!(
            (r.uri.as_str(), r.workload.queue_depth, r.workload.workers),
            ("in-process:memory", 1, 2)
        );
    }

    #[test]
    fn a_device_that_corrupts_reads_is_caught() {
        let (w, opts) = short(Workload {
            workers: 2,
            queue_depth: 4,
            write_pct: 50,
            ..Workload::default()
        });
        let r = run_device(
            Arc::new(FlipsReads(MemoryDev::new(8 << 20))),
            &w,
            &opts,
            &mut |_| {},
        )
        .unwrap();
        let v = r.verify.as_ref().expect("verify figures");
        assert!(v.checked_reads > 10, "{}", r.render());
        // Every checked read had its bit flipped, so every one is a mismatch, at the stamp
        // that holds byte 104 of its block.
        assert_eq!(v.mismatches, v.checked_reads, "{}", r.render());
        assert!(!r.ok());
        let m = &v.first[0];
        assert_eq!(m.offset % u64::from(w.block_size), 96, "{m:?}");
        assert!(m.found.contains("not a stamp"), "{m:?}");
    }

    #[test]
    fn device_errors_are_counted_and_the_run_goes_on() {
        // A read-only device refuses writes up front; with reads only it runs.
        #[derive(Debug)]
        struct FailsBlock0(MemoryDev);
        impl Filter for FailsBlock0 {
            type Inner = MemoryDev;
            fn inner(&self) -> &MemoryDev {
                &self.0
            }
            fn read_at(&self, buf: &mut [u8], offset: u64) -> vdstream_blockdev::Result<()> {
                if offset == 0 {
                    let (kind, op) = (
                        vdstream_blockdev::ErrorKind::Io,
                        vdstream_blockdev::Op::Read,
                    );
                    return Err(vdstream_blockdev::Error::new(
                        kind,
                        op,
                        offset,
                        buf.len() as u64,
                        "ro",
                        "test error",
                    ));
                }
                self.0.read_at(buf, offset)
            }
        }
        let ro = || Arc::new(ReadOnly(Arc::new(FailsBlock0(MemoryDev::new(1 << 20)))));
        let (w, opts) = short(Workload {
            workers: 1,
            write_pct: 20,
            verify: false,
            ..Workload::default()
        });
        let e = run_device(ro(), &w, &opts, &mut |_| {}).unwrap_err();
        assert!(matches!(e, BenchError::ReadOnly { .. }), "{e}");
        // Sequential reads of 256 blocks from block 0: every pass reads block 0 once.
        let w = Workload {
            write_pct: 0,
            random_pct: 0,
            working_set: Some(1 << 20),
            ..w
        };
        let r = run_device(ro(), &w, &opts, &mut |_| {}).unwrap();
        assert!(
            r.errors > 0 && r.read.ops > r.errors * 100,
            "{}",
            r.render()
        );
        assert!(
            r.error_messages[0].contains("at offset 0 on ro: test error"),
            "{:?}",
            r.error_messages
        );
    }
}
