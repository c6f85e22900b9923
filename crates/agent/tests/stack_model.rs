//! The agent's whole stack — a write cache over a RemoteBase over the real NBD server —
//! against a reference model (a byte vector), with the server stopped and started again
//! between operations. Every read of the stack must equal the model; the server's device
//! must never change.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use proptest::prelude::*;
use vdstream_blockdev::{BlockDev, ZeroFlags};
use vdstream_wcache::{CacheConfig, CacheType};

const SIZE: u64 = 1 << 20;

#[derive(Debug, Clone)]
enum Op {
    Write { off: u64, len: usize, seed: u8 },
    Read { off: u64, len: usize },
    Trim { off: u64, len: u64 },
    Zero { off: u64, len: u64 },
    RestartServer,
}

fn op() -> impl Strategy<Value = Op> {
    let range =
        (0..SIZE - 1, 1usize..40_000).prop_map(|(off, len)| (off, len.min((SIZE - off) as usize)));
    prop_oneof![
        4 => (range.clone(), any::<u8>()).prop_map(|((off, len), seed)| Op::Write { off, len, seed }),
        4 => range.clone().prop_map(|(off, len)| Op::Read { off, len }),
        1 => range.clone().prop_map(|(off, len)| Op::Trim { off: off / 4096 * 4096, len: (len as u64).div_ceil(4096) * 4096 }),
        1 => range.prop_map(|(off, len)| Op::Zero { off, len: len as u64 }),
        1 => Just(Op::RestartServer),
    ]
}

fn kind() -> impl Strategy<Value = CacheType> {
    prop_oneof![
        Just(CacheType::RamOverflow),
        Just(CacheType::DeviceRam),
        Just(CacheType::DeviceDisk),
        Just(CacheType::DeviceDiskPersistent)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn stack_matches_the_model(kind in kind(), ops in proptest::collection::vec(op(), 1..40)) {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s.sock");
        let vdisk = patterned(SIZE);
        let mut server = TestServer::start(&sock, vdisk.clone(), "golden");
        let remote: Arc<dyn BlockDev> = Arc::new(connect(&[server.uri()], quick(Some(Duration::from_secs(10)))));
        // 64 KiB of RAM: ram-overflow spills to its file within a few writes; device-ram
        // gets room for the whole disk (its ENOSPC behaviour is the wcache tests' subject).
        let ram = if kind == CacheType::DeviceRam { 4 * SIZE } else { 64 << 10 };
        let cfg = CacheConfig { ram, dir: dir.path().to_path_buf(), ..CacheConfig::new("model") };
        let cache = vdstream_wcache::open(kind, remote, &cfg).unwrap();
        let mut model = pattern(0, SIZE as usize);
        for op in ops {
            match op {
                Op::Write { off, len, seed } => {
                    let data: Vec<u8> = (0..len).map(|i| seed.wrapping_add(i as u8)).collect();
                    cache.write_at(&data, off, false).unwrap();
                    model[off as usize..off as usize + len].copy_from_slice(&data);
                }
                Op::Read { off, len } => {
                    let mut buf = vec![0u8; len];
                    cache.read_at(&mut buf, off).unwrap();
                    prop_assert!(buf == model[off as usize..off as usize + len], "{kind}: read at {off} length {len} differs");
                }
                Op::Trim { off, len } => {
                    let len = len.min(SIZE - off);
                    cache.trim(off, len, false).unwrap();
                    model[off as usize..(off + len) as usize].fill(0);
                }
                Op::Zero { off, len } => {
                    cache.write_zeroes(off, len, ZeroFlags::default()).unwrap();
                    model[off as usize..(off + len) as usize].fill(0);
                }
                Op::RestartServer => {
                    server.stop();
                    server = TestServer::start(&sock, vdisk.clone(), "golden");
                }
            }
        }
        let mut all = vec![0u8; SIZE as usize];
        cache.read_at(&mut all, 0).unwrap();
        prop_assert!(all == model, "{kind}: final contents differ");
        let mut base = vec![0u8; SIZE as usize];
        vdisk.read_at(&mut base, 0).unwrap();
        prop_assert!(base == pattern(0, SIZE as usize), "the vDisk was written");
    }
}
