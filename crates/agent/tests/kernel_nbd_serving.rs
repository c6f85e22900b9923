//! `--kernel-nbd`'s serving half, with this test in the kernel's seat: the agent's whole
//! stack (a write cache over a RemoteBase over the real NBD server) served on one end of a
//! socket pair by `kernel_nbd::serve_pair`, and on the other end requests written as
//! Linux's `drivers/block/nbd.c` writes them (no handshake, fixed 28-byte request headers,
//! simple replies, several requests in flight and answered in any order, the FUA flag in
//! the command's upper half). Every READ reply must equal a reference model; DISC ends
//! the serving thread cleanly. The ioctl half needs the nbd module (the VM tests).

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use proptest::prelude::*;
use vdstream_agent::kernel_nbd::{kernel_params, serve_pair, KERNEL_FLAGS};
use vdstream_blockdev::BlockDev;
use vdstream_nbd::proto::*;
use vdstream_nbd::{Server, ServerConfig};
use vdstream_wcache::{CacheConfig, CacheType};

const SIZE: u64 = 1 << 20;
/// `NBD_REQUEST_MAGIC` and `NBD_REPLY_MAGIC` of include/uapi/linux/nbd.h.
const KERNEL_REQUEST_MAGIC: u32 = 0x2560_9513;
const KERNEL_REPLY_MAGIC: u32 = 0x6744_6698;

#[derive(Debug, Clone)]
enum Op {
    Write {
        off: u64,
        len: usize,
        seed: u8,
        fua: bool,
    },
    Read {
        off: u64,
        len: usize,
    },
    Trim {
        off: u64,
        len: u64,
    },
    Zero {
        off: u64,
        len: u64,
    },
    Flush,
}

impl Op {
    /// The bytes it touches, and whether it changes them.
    fn range(&self) -> Option<(u64, u64, bool)> {
        match *self {
            Op::Write { off, len, .. } => Some((off, off + len as u64, true)),
            Op::Read { off, len } => Some((off, off + len as u64, false)),
            Op::Trim { off, len } | Op::Zero { off, len } => Some((off, off + len, true)),
            Op::Flush => None,
        }
    }
}

/// Sector-aligned ranges, as the block layer sends them.
fn op() -> impl Strategy<Value = Op> {
    let range =
        (0..SIZE / 512 - 1, 1u64..129).prop_map(|(s, n)| (s * 512, (n * 512).min(SIZE - s * 512)));
    prop_oneof![
        4 => (range.clone(), any::<u8>(), any::<bool>()).prop_map(|((off, len), seed, fua)| Op::Write { off, len: len as usize, seed, fua }),
        4 => range.clone().prop_map(|(off, len)| Op::Read { off, len: len as usize }),
        1 => range.clone().prop_map(|(off, len)| Op::Trim { off: off / 4096 * 4096, len: len.div_ceil(4096) * 4096 }),
        1 => range.prop_map(|(off, len)| Op::Zero { off, len }),
        1 => Just(Op::Flush),
    ]
}

/// One request as the kernel sends it: `struct nbd_request` (magic, type with the command
/// flags in its upper 16 bits, 8-byte cookie, offset, length), then a WRITE's data.
fn request(out: &mut Vec<u8>, cmd: u16, flags: u16, handle: u64, off: u64, len: u32) {
    out.extend_from_slice(&KERNEL_REQUEST_MAGIC.to_be_bytes());
    out.extend_from_slice(&((u32::from(flags) << 16) | u32::from(cmd)).to_be_bytes());
    out.extend_from_slice(&handle.to_be_bytes());
    out.extend_from_slice(&off.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
}

/// Reads one simple reply: (error, handle).
fn reply(k: &mut UnixStream) -> (u32, u64) {
    let mut h = [0u8; 16];
    k.read_exact(&mut h).expect("a reply");
    assert_eq!(
        u32::from_be_bytes(h[0..4].try_into().unwrap()),
        KERNEL_REPLY_MAGIC,
        "simple replies only: the kernel knows no other"
    );
    (
        u32::from_be_bytes(h[4..8].try_into().unwrap()),
        u64::from_be_bytes(h[8..16].try_into().unwrap()),
    )
}

struct Served {
    _dir: tempfile::TempDir,
    _server: TestServer,
    kernel: UnixStream,
    serving: std::thread::JoinHandle<std::io::Result<()>>,
    flags: u16,
}

/// The agent's stack over a patterned vDisk, served to "the kernel".
fn serve(kind: CacheType) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let server = TestServer::start(&sock, patterned(SIZE), "golden");
    let remote: Arc<dyn BlockDev> = Arc::new(connect(
        &[server.uri()],
        quick(Some(Duration::from_secs(10))),
    ));
    let ram = if kind == CacheType::DeviceRam {
        4 * SIZE
    } else {
        64 << 10
    };
    let cfg = CacheConfig {
        ram,
        dir: dir.path().to_path_buf(),
        ..CacheConfig::new("kernel")
    };
    let cache: Arc<dyn BlockDev> = vdstream_wcache::open(kind, remote, &cfg).unwrap();
    let params = kernel_params(cache.as_ref());
    let local = Arc::new(Server::new(
        Arc::new(OneDev {
            dev: cache.clone(),
            description: String::new(),
        }),
        ServerConfig {
            threads_per_connection: 4,
            ..ServerConfig::default()
        },
    ));
    let (kernel, serving) = serve_pair(local, cache, params).unwrap();
    kernel
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    Served {
        _dir: dir,
        _server: server,
        kernel,
        serving,
        flags: params.flags,
    }
}

#[test]
fn the_kernel_gets_the_flags_it_understands_and_no_others() {
    let s = serve(CacheType::RamOverflow);
    assert_eq!(s.flags & !KERNEL_FLAGS, 0, "{:#x}", s.flags);
    for f in [
        FLAG_HAS_FLAGS,
        FLAG_SEND_TRIM,
        FLAG_SEND_WRITE_ZEROES,
        FLAG_CAN_MULTI_CONN,
    ] {
        assert_ne!(s.flags & f, 0, "flag {f:#x} missing from {:#x}", s.flags);
    }
    // A volatile cache has nothing to make durable: no flush, no FUA; never structured.
    assert_eq!(
        s.flags
            & (FLAG_READ_ONLY
                | FLAG_SEND_FLUSH
                | FLAG_SEND_FUA
                | FLAG_SEND_DF
                | FLAG_SEND_CACHE
                | FLAG_SEND_FAST_ZERO),
        0
    );
    let persistent = serve(CacheType::DeviceDiskPersistent);
    for f in [FLAG_SEND_FLUSH, FLAG_SEND_FUA] {
        assert_ne!(
            persistent.flags & f,
            0,
            "device-disk-persistent: flag {f:#x} missing from {:#x}",
            persistent.flags
        );
    }
    let Served {
        mut kernel,
        serving,
        ..
    } = s;
    // A request past the end is refused with a simple reply, and the stream stays usable.
    let mut out = Vec::new();
    request(&mut out, CMD_READ, 0, 7, SIZE, 512);
    request(&mut out, CMD_DISC, 0, 8, 0, 0);
    kernel.write_all(&out).unwrap();
    assert_eq!(reply(&mut kernel), (EINVAL, 7));
    let mut rest = Vec::new();
    kernel.read_to_end(&mut rest).unwrap();
    assert!(
        rest.is_empty(),
        "DISC gets no reply; the agent closes its end"
    );
    serving.join().unwrap().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn kernel_requests_match_the_model(
        kind in prop_oneof![Just(CacheType::RamOverflow), Just(CacheType::DeviceRam), Just(CacheType::DeviceDisk), Just(CacheType::DeviceDiskPersistent)],
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let Served { _dir, _server, mut kernel, serving, flags } = serve(kind);
        // The kernel sends FLUSH and FUA only when the flags offer them.
        let durable = flags & FLAG_SEND_FLUSH != 0;
        let ops: Vec<Op> = ops
            .into_iter()
            .filter(|o| durable || !matches!(o, Op::Flush))
            .map(|o| match o {
                Op::Write { off, len, seed, fua } => Op::Write { off, len, seed, fua: fua && flags & FLAG_SEND_FUA != 0 },
                o => o,
            })
            .collect();
        let mut model = pattern(0, SIZE as usize);
        let mut handle = 0u64;
        let mut i = 0;
        while i < ops.len() {
            // A wave of requests in flight at once, as the kernel's queue sends them: none
            // overlaps a change of another (file systems never race those), a FLUSH alone.
            let mut wave: Vec<&Op> = vec![&ops[i]];
            i += 1;
            if !matches!(ops[i - 1], Op::Flush) {
                while i < ops.len() && wave.len() < 16 {
                    let Some((a, b, w)) = ops[i].range() else { break };
                    if wave.iter().any(|o| o.range().is_some_and(|(c, d, w2)| (w || w2) && a < d && c < b)) {
                        break;
                    }
                    wave.push(&ops[i]);
                    i += 1;
                }
            }
            let mut out = Vec::new();
            let mut expected: HashMap<u64, Option<Vec<u8>>> = HashMap::new();
            for op in &wave {
                handle += 1;
                // The kernel's cookie: a tag in the low half, a counter in the high half.
                let h = (handle << 32) | (handle % 64);
                match **op {
                    Op::Write { off, len, seed, fua } => {
                        let data: Vec<u8> = (0..len).map(|i| seed.wrapping_add(i as u8)).collect();
                        request(&mut out, CMD_WRITE, if fua { CMD_FLAG_FUA } else { 0 }, h, off, len as u32);
                        out.extend_from_slice(&data);
                        model[off as usize..off as usize + len].copy_from_slice(&data);
                        expected.insert(h, None);
                    }
                    Op::Read { off, len } => {
                        request(&mut out, CMD_READ, 0, h, off, len as u32);
                        expected.insert(h, Some(model[off as usize..off as usize + len].to_vec()));
                    }
                    Op::Trim { off, len } => {
                        let len = len.min(SIZE - off);
                        request(&mut out, CMD_TRIM, 0, h, off, len as u32);
                        model[off as usize..(off + len) as usize].fill(0);
                        expected.insert(h, None);
                    }
                    Op::Zero { off, len } => {
                        request(&mut out, CMD_WRITE_ZEROES, 0, h, off, len as u32);
                        model[off as usize..(off + len) as usize].fill(0);
                        expected.insert(h, None);
                    }
                    Op::Flush => {
                        request(&mut out, CMD_FLUSH, 0, h, 0, 0);
                        expected.insert(h, None);
                    }
                }
            }
            kernel.write_all(&out).unwrap();
            while !expected.is_empty() {
                let (error, h) = reply(&mut kernel);
                let want = expected.remove(&h);
                prop_assert!(want.is_some(), "{kind}: a reply for cookie {h:#x}, which is not in flight");
                prop_assert_eq!(error, 0, "{}: request {:#x} failed", kind, h);
                if let Some(Some(data)) = want {
                    let mut got = vec![0u8; data.len()];
                    kernel.read_exact(&mut got).unwrap();
                    prop_assert!(got == data, "{kind}: a read differs from the model");
                }
            }
        }
        // Everything, read back in 128 KiB requests (the block layer's usual maximum).
        let mut out = Vec::new();
        for (n, off) in (0..SIZE).step_by(128 << 10).enumerate() {
            request(&mut out, CMD_READ, 0, 1 << 40 | n as u64, off, 128 << 10);
        }
        request(&mut out, CMD_DISC, 0, 0, 0, 0);
        kernel.write_all(&out).unwrap();
        let mut all = vec![0u8; SIZE as usize];
        for _ in 0..SIZE / (128 << 10) {
            let (error, h) = reply(&mut kernel);
            prop_assert_eq!(error, 0);
            let off = ((h & 0xffff) as usize) * (128 << 10);
            kernel.read_exact(&mut all[off..off + (128 << 10)]).unwrap();
        }
        prop_assert!(all == model, "{kind}: the final contents differ from the model");
        let mut rest = Vec::new();
        kernel.read_to_end(&mut rest).unwrap();
        prop_assert!(rest.is_empty());
        serving.join().unwrap().unwrap();
    }
}
