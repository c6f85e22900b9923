//! What a benchmark asks of a disk: workers, queue depth, block size, the mix of reads and
//! writes and of random and sequential offsets, the working set and the duration; and the
//! per-worker stream of operations ([`OpStream`]) that follows it.
//!
//! Invariants: every offset an [`OpStream`] yields is a multiple of the block size and the
//! whole block lies inside the working set; the stream is deterministic for a given seed
//! (tests and the verify ledger rely on that, not on the OS's randomness). A random
//! operation picks a uniformly random block; a sequential one continues after the previous
//! operation of the same worker, wrapping at the end of the working set (fio's
//! `percentage_random`).

use std::time::Duration;

use serde::Serialize;

/// The shape of a benchmark run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Workload {
    /// Connections to the export, each with its own stream of operations.
    pub workers: u32,
    /// Requests in flight per worker.
    pub queue_depth: u32,
    /// Bytes per request.
    pub block_size: u32,
    /// Percentage of operations that are writes (the rest read).
    pub write_pct: u32,
    /// Percentage of operations at a random offset (the rest continue sequentially).
    pub random_pct: u32,
    /// Bytes from offset 0 that the run touches; `None`: the whole export.
    pub working_set: Option<u64>,
    /// How long the run lasts.
    #[serde(serialize_with = "secs")]
    pub duration: Duration,
    /// Writes carry an offset and generation stamp; reads check it.
    pub verify: bool,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// The presets `--profile` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// The IOmeter VDI profile of PVS sizing guides: 4 workers, queue depth 16, 4 KiB,
    /// 80% writes, 90% random (`shared/bench/vdi.fio`).
    Vdi,
}

impl Profile {
    pub fn parse(name: &str) -> Option<Profile> {
        match name {
            "vdi" => Some(Profile::Vdi),
            _ => None,
        }
    }

    pub fn workload(self) -> Workload {
        match self {
            Profile::Vdi => Workload {
                workers: 4,
                queue_depth: 16,
                block_size: 4096,
                write_pct: 80,
                random_pct: 90,
                working_set: None,
                duration: Duration::from_secs(30),
                verify: false,
            },
        }
    }
}

impl Default for Workload {
    fn default() -> Self {
        Profile::Vdi.workload()
    }
}

/// Why a workload cannot run against an export.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkloadError {
    #[error("{what} must be at least 1")]
    Zero { what: &'static str },
    #[error("{what} is {value}%: give a percentage from 0 to 100")]
    Percent { what: &'static str, value: u32 },
    #[error("block size {0} is not a multiple of 512 bytes: use e.g. 4096 or 64K")]
    BlockSize(u32),
    #[error("the working set ({working_set} bytes) is smaller than one block ({block_size} bytes): give a larger --working-set")]
    TooSmall { working_set: u64, block_size: u32 },
}

impl Workload {
    /// Checks the settings, and the working set against an export of `export_size` bytes;
    /// returns the working set in whole blocks.
    pub fn blocks(&self, export_size: u64) -> Result<u64, WorkloadError> {
        for (what, v) in [
            ("--workers", self.workers),
            ("--queue-depth", self.queue_depth),
            ("--block-size", self.block_size),
        ] {
            if v == 0 {
                return Err(WorkloadError::Zero { what });
            }
        }
        for (what, value) in [
            ("--write-pct", self.write_pct),
            ("--random-pct", self.random_pct),
        ] {
            if value > 100 {
                return Err(WorkloadError::Percent { what, value });
            }
        }
        if self.block_size % 512 != 0 {
            return Err(WorkloadError::BlockSize(self.block_size));
        }
        let working_set = self.working_set.map_or(export_size, |w| w.min(export_size));
        let blocks = working_set / u64::from(self.block_size);
        if blocks == 0 {
            return Err(WorkloadError::TooSmall {
                working_set,
                block_size: self.block_size,
            });
        }
        Ok(blocks)
    }
}

/// One operation of the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    pub write: bool,
    /// Index of the block (offset = block × block size).
    pub block: u64,
}

/// The operations of one worker: reads or writes at random or sequential blocks.
#[derive(Debug, Clone)]
pub struct OpStream {
    /// Seeded: the same seed gives the same stream.
    rng: fastrand::Rng,
    blocks: u64,
    write_pct: u32,
    random_pct: u32,
    /// The block after the previous operation.
    next: u64,
}

impl OpStream {
    /// Worker `worker` of `workers` starts its sequential run at its share of the working
    /// set, so that workers do not all walk the same blocks.
    pub fn new(w: &Workload, blocks: u64, worker: u32, seed: u64) -> OpStream {
        let start = blocks * u64::from(worker) / u64::from(w.workers.max(1));
        OpStream {
            rng: fastrand::Rng::with_seed(
                seed ^ (u64::from(worker) + 1).wrapping_mul(0x2545_f491_4f6c_dd1d),
            ),
            blocks,
            write_pct: w.write_pct,
            random_pct: w.random_pct,
            next: start,
        }
    }

    pub fn next_op(&mut self) -> Op {
        let write = self.rng.u32(..100) < self.write_pct;
        let block = if self.rng.u32(..100) < self.random_pct {
            self.rng.u64(..self.blocks)
        } else {
            self.next
        };
        self.next = if block + 1 >= self.blocks {
            0
        } else {
            block + 1
        };
        Op { write, block }
    }

    /// The block after `block`, wrapping (to step past a block another request holds).
    pub fn skip(&mut self, block: u64) -> u64 {
        let b = if block + 1 >= self.blocks {
            0
        } else {
            block + 1
        };
        self.next = if b + 1 >= self.blocks { 0 } else { b + 1 };
        b
    }

    /// A fresh random block (to step past a block another request holds).
    pub fn random_block(&mut self) -> u64 {
        self.rng.u64(..self.blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn workload(write_pct: u32, random_pct: u32) -> Workload {
        Workload {
            write_pct,
            random_pct,
            ..Workload::default()
        }
    }

    #[test]
    fn vdi_profile_is_the_iometer_one() {
        let w = Profile::parse("vdi").unwrap().workload();
        assert_eq!(
            (
                w.workers,
                w.queue_depth,
                w.block_size,
                w.write_pct,
                w.random_pct
            ),
            (4, 16, 4096, 80, 90)
        );
        assert!(Profile::parse("oltp").is_none());
    }

    #[test]
    fn bad_settings_are_named() {
        let e = Workload {
            block_size: 1000,
            ..Workload::default()
        }
        .blocks(1 << 20)
        .unwrap_err();
        assert!(e.to_string().contains("block size 1000"), "{e}");
        let e = Workload {
            write_pct: 101,
            ..Workload::default()
        }
        .blocks(1 << 20)
        .unwrap_err();
        assert!(e.to_string().contains("--write-pct"), "{e}");
        let e = Workload {
            workers: 0,
            ..Workload::default()
        }
        .blocks(1 << 20)
        .unwrap_err();
        assert!(e.to_string().contains("--workers"), "{e}");
        assert!(matches!(
            Workload::default().blocks(100),
            Err(WorkloadError::TooSmall { .. })
        ));
        assert_eq!(
            Workload {
                working_set: Some(1 << 20),
                ..Workload::default()
            }
            .blocks(1 << 30)
            .unwrap(),
            256
        );
        assert_eq!(
            Workload {
                working_set: Some(1 << 40),
                ..Workload::default()
            }
            .blocks(1 << 20)
            .unwrap(),
            256
        );
    }

    #[test]
    fn all_sequential_walks_the_working_set_in_order_and_wraps() {
        let w = workload(0, 0);
        let mut s = OpStream::new(&w, 10, 1, 7);
        let got: Vec<u64> = (0..12).map(|_| s.next_op().block).collect();
        // Worker 1 of 4 starts at 10 * 1 / 4 = 2.
        assert_eq!(got, vec![2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3]);
    }

    #[test]
    fn mix_is_close_to_the_percentages() {
        let w = workload(80, 90);
        let mut s = OpStream::new(&w, 1 << 20, 0, 42);
        let n = 100_000;
        let mut writes = 0;
        let mut sequential = 0;
        let mut prev = None;
        for _ in 0..n {
            let op = s.next_op();
            writes += u32::from(op.write);
            if prev.map(|p: u64| p + 1) == Some(op.block) {
                sequential += 1;
            }
            prev = Some(op.block);
        }
        assert!((79_000..81_000).contains(&writes), "writes {writes} of {n}");
        assert!(
            (9_000..11_000).contains(&sequential),
            "sequential {sequential} of {n}"
        );
    }

    proptest! {
        #[test]
        fn blocks_stay_inside_the_working_set(
            blocks in 1u64..5000, worker in 0u32..8, seed: u64,
            write_pct in 0u32..=100, random_pct in 0u32..=100,
        ) {
            let w = Workload { workers: 8, ..workload(write_pct, random_pct) };
            let mut s = OpStream::new(&w, blocks, worker, seed);
            for _ in 0..200 {
                let op = s.next_op();
                prop_assert!(op.block < blocks);
                prop_assert!(s.skip(op.block) < blocks);
                prop_assert!(s.random_block() < blocks);
            }
        }

        #[test]
        fn same_seed_same_stream(seed: u64) {
            let w = workload(50, 50);
            let mut a = OpStream::new(&w, 1000, 2, seed);
            let mut b = OpStream::new(&w, 1000, 2, seed);
            for _ in 0..100 {
                prop_assert_eq!(a.next_op(), b.next_op());
            }
        }
    }
}
