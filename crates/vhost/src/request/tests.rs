//! Requests carried out through a real split ring in guest memory (two regions with a
//! hole between them), well-formed against a reference model, and malformed ones.

use std::sync::Arc;

use proptest::prelude::*;
use vdstream_blockdev::lograte::LogLimiter;
use vdstream_blockdev::{BlockDev, MemoryDev};
use virtio_bindings::bindings::virtio_blk::*;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::{Executor, Outcome, Stats};
use crate::config::{Geometry, Options};
use crate::driver::{header, write_desc_at, Desc, Seg, SplitRing, INDIRECT, NEXT, WRITE};

/// Guest memory: [0, 64 KiB) and [128 KiB, 192 KiB); the hole between is not guest memory.
const LOW: u64 = 0x1_0000;
const HIGH: u64 = 0x2_0000;
const HIGH_END: u64 = 0x3_0000;
/// Where tests put headers, data and status bytes.
const DATA: u64 = 0x4000;

struct Rig {
    mem: GuestMemoryMmap,
    ring: SplitRing,
    queue: virtio_queue::Queue,
    dev: Arc<dyn BlockDev>,
    geom: Geometry,
    stats: Stats,
    log: LogLimiter,
    buf: Vec<u8>,
    write_through: bool,
}

impl Rig {
    fn new(dev: Arc<dyn BlockDev>, opts: Options) -> Rig {
        let mem = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), LOW as usize),
            (GuestAddress(HIGH), (HIGH_END - HIGH) as usize),
        ])
        .unwrap();
        let mut ring = SplitRing::at(0, 16);
        ring.init(&mem);
        let queue = ring.queue();
        let geom = Geometry::of(&*dev, &opts);
        Rig {
            mem,
            ring,
            queue,
            dev,
            geom,
            stats: Stats::default(),
            log: LogLimiter::default(),
            buf: Vec::new(),
            write_through: false,
        }
    }

    fn memory(size: u64) -> Rig {
        Rig::new(Arc::new(MemoryDev::new(size)), Options::default())
    }

    /// Serves what is available; returns each chain's head and outcome.
    fn serve(&mut self) -> Vec<(u16, Outcome)> {
        let mut out = Vec::new();
        let mut exec = Executor {
            dev: &*self.dev,
            geom: &self.geom,
            stats: &self.stats,
            log: &self.log,
            name: "test",
            write_through: self.write_through,
            buf: &mut self.buf,
        };
        while let Some(chain) = self.queue.pop_descriptor_chain(&self.mem) {
            let head = chain.head_index();
            let o = exec.execute(&self.mem, chain);
            let _ = self.queue.add_used(&self.mem, head, o.used_len);
            out.push((head, o));
        }
        out
    }

    /// One request of `segs`, served; its outcome.
    fn one(&mut self, segs: &[Seg]) -> Outcome {
        self.ring.add_chain(&self.mem, segs);
        let r = self.serve();
        assert_eq!(r.len(), 1, "one chain was made available");
        r[0].1
    }

    /// A well-formed request: header at DATA, data after it, status last.
    fn request(&mut self, kind: u32, sector: u64, data: &mut [u8]) -> u8 {
        let h = DATA;
        let d = DATA + 0x100;
        let s = d + data.len() as u64 + 16;
        self.mem
            .write_slice(&header(kind, sector), GuestAddress(h))
            .unwrap();
        self.mem.write_obj(0xffu8, GuestAddress(s)).unwrap();
        let device_writes = kind == VIRTIO_BLK_T_IN || kind == VIRTIO_BLK_T_GET_ID;
        if !device_writes {
            self.mem.write_slice(data, GuestAddress(d)).unwrap();
        }
        let mut segs = vec![Seg {
            addr: h,
            len: 16,
            write: false,
        }];
        if !data.is_empty() {
            segs.push(Seg {
                addr: d,
                len: data.len() as u32,
                write: device_writes,
            });
        }
        segs.push(Seg {
            addr: s,
            len: 1,
            write: true,
        });
        let o = self.one(&segs);
        let status: u8 = self.mem.read_obj(GuestAddress(s)).unwrap();
        assert_eq!(
            o.status,
            Some(status),
            "the outcome is the status byte in guest memory"
        );
        if device_writes {
            self.mem.read_slice(data, GuestAddress(d)).unwrap();
            if status == VIRTIO_BLK_S_OK as u8 {
                assert_eq!(
                    o.used_len as usize,
                    data.len().min(if kind == VIRTIO_BLK_T_IN {
                        usize::MAX
                    } else {
                        20
                    }) + 1
                );
            }
        } else {
            assert_eq!(o.used_len, 1);
        }
        status
    }

    fn ranges(&mut self, kind: u32, segs: &[(u64, u32, u32)]) -> u8 {
        let mut bytes = Vec::new();
        for (sector, n, flags) in segs {
            bytes.extend_from_slice(&sector.to_le_bytes());
            bytes.extend_from_slice(&n.to_le_bytes());
            bytes.extend_from_slice(&flags.to_le_bytes());
        }
        self.request(kind, 0, &mut bytes)
    }
}

const OK: u8 = VIRTIO_BLK_S_OK as u8;
const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
const UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;

#[test]
fn write_read_flush_id_discard_and_zeroes() {
    let mut rig = Rig::new(
        Arc::new(MemoryDev::new(1 << 20)),
        Options {
            serial: "lab7".into(),
            ..Options::default()
        },
    );
    let mut data: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 3) as u8).collect();
    assert_eq!(rig.request(VIRTIO_BLK_T_OUT, 8, &mut data.clone()), OK);
    let mut back = vec![0u8; 8192];
    assert_eq!(rig.request(VIRTIO_BLK_T_IN, 8, &mut back), OK);
    assert_eq!(back, data);
    assert_eq!(rig.request(VIRTIO_BLK_T_FLUSH, 0, &mut []), OK);
    let mut id = [0u8; 20];
    assert_eq!(rig.request(VIRTIO_BLK_T_GET_ID, 0, &mut id), OK);
    assert_eq!(&id[..5], b"lab7\0");
    // Discard the first 4 KiB of the data, zero the next 2 KiB.
    assert_eq!(rig.ranges(VIRTIO_BLK_T_DISCARD, &[(8, 8, 0)]), OK);
    assert_eq!(
        rig.ranges(
            VIRTIO_BLK_T_WRITE_ZEROES,
            &[(16, 4, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP)]
        ),
        OK
    );
    assert_eq!(rig.request(VIRTIO_BLK_T_IN, 8, &mut back), OK);
    data[..6144].fill(0);
    assert_eq!(back, data);
    // A discard with the unmap flag, and an unknown type: UNSUPP.
    assert_eq!(rig.ranges(VIRTIO_BLK_T_DISCARD, &[(0, 8, 1)]), UNSUPP);
    assert_eq!(rig.request(99, 0, &mut []), UNSUPP);
    assert_eq!(
        rig.stats
            .unsupported
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
    data.fill(0xab);
    // A request larger than a piece is carried out whole.
    let mut big = vec![0x5au8; 3 << 19];
    let mut rig = Rig::new(Arc::new(MemoryDev::new(4 << 20)), Options::default());
    rig.mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
    rig.ring.init(&rig.mem);
    rig.queue = rig.ring.queue();
    assert_eq!(rig.request(VIRTIO_BLK_T_OUT, 0, &mut big.clone()), OK);
    let mut back = vec![0u8; big.len()];
    assert_eq!(rig.request(VIRTIO_BLK_T_IN, 0, &mut back), OK);
    big.truncate(back.len());
    assert!(back == big, "1.5 MiB read back as written");
}

#[test]
fn out_of_range_misaligned_and_read_only_requests_fail_with_ioerr() {
    let mut rig = Rig::memory(1 << 20);
    let mut b = vec![1u8; 4096];
    assert_eq!(
        rig.request(VIRTIO_BLK_T_IN, (1 << 20) / 512 - 4, &mut b),
        IOERR,
        "ends 2 KiB past the end"
    );
    assert_eq!(
        rig.request(VIRTIO_BLK_T_OUT, u64::MAX / 256, &mut b),
        IOERR,
        "sector * 512 overflows"
    );
    assert_eq!(
        rig.request(VIRTIO_BLK_T_OUT, 0, &mut [1u8; 100]),
        IOERR,
        "not a whole number of sectors"
    );
    assert_eq!(
        rig.ranges(VIRTIO_BLK_T_WRITE_ZEROES, &[(2040, 16, 0)]),
        IOERR,
        "zeroes past the end"
    );
    assert_eq!(
        rig.ranges(VIRTIO_BLK_T_DISCARD, &[(0, 8, 0); 17]),
        IOERR,
        "more segments than offered"
    );
    let mut rig4k = Rig::new(
        Arc::new(MemoryDev::new(1 << 20)),
        Options {
            logical_block: 4096,
            ..Options::default()
        },
    );
    assert_eq!(
        rig4k.request(VIRTIO_BLK_T_IN, 1, &mut b),
        IOERR,
        "not aligned to the 4 KiB logical block"
    );
    assert_eq!(rig4k.request(VIRTIO_BLK_T_IN, 8, &mut b), OK);
    let mut ro = Rig::new(
        Arc::new(MemoryDev::new(1 << 20)),
        Options {
            read_only: true,
            ..Options::default()
        },
    );
    assert_eq!(ro.request(VIRTIO_BLK_T_OUT, 0, &mut b), IOERR);
    assert_eq!(ro.ranges(VIRTIO_BLK_T_DISCARD, &[(0, 8, 0)]), IOERR);
    assert_eq!(ro.ranges(VIRTIO_BLK_T_WRITE_ZEROES, &[(0, 8, 0)]), IOERR);
    assert_eq!(
        ro.request(VIRTIO_BLK_T_IN, 0, &mut b),
        OK,
        "reads still work"
    );
    let mut check = vec![0u8; 4096];
    assert_eq!(rig.request(VIRTIO_BLK_T_IN, 0, &mut check), OK);
    assert_eq!(
        check,
        vec![0u8; 4096],
        "none of the failed writes reached the disk"
    );
}

/// Malformed chains, each followed by a good request that must still be served.
#[test]
fn malformed_chains_fail_alone_and_the_queue_goes_on() {
    let h = DATA;
    let s = DATA + 0x80;
    let hole = LOW + 0x100;
    let cases: Vec<(&str, Vec<Seg>, Option<u8>)> = vec![
        (
            "data in the hole between regions",
            vec![
                Seg {
                    addr: h,
                    len: 16,
                    write: false,
                },
                Seg {
                    addr: hole,
                    len: 512,
                    write: true,
                },
                Seg {
                    addr: s,
                    len: 1,
                    write: true,
                },
            ],
            Some(IOERR),
        ),
        (
            "data past the end of memory",
            vec![
                Seg {
                    addr: h,
                    len: 16,
                    write: false,
                },
                Seg {
                    addr: HIGH_END - 256,
                    len: 512,
                    write: true,
                },
                Seg {
                    addr: s,
                    len: 1,
                    write: true,
                },
            ],
            Some(IOERR),
        ),
        (
            "data that crosses from a region into the hole",
            vec![
                Seg {
                    addr: h,
                    len: 16,
                    write: false,
                },
                Seg {
                    addr: LOW - 256,
                    len: 512,
                    write: true,
                },
                Seg {
                    addr: s,
                    len: 1,
                    write: true,
                },
            ],
            Some(IOERR),
        ),
        (
            "a readable descriptor after a writable one",
            vec![
                Seg {
                    addr: h,
                    len: 16,
                    write: false,
                },
                Seg {
                    addr: s,
                    len: 1,
                    write: true,
                },
                Seg {
                    addr: DATA + 0x200,
                    len: 512,
                    write: false,
                },
                Seg {
                    addr: s,
                    len: 1,
                    write: true,
                },
            ],
            Some(IOERR),
        ),
        (
            "a header of 8 bytes",
            vec![
                Seg {
                    addr: h,
                    len: 8,
                    write: false,
                },
                Seg {
                    addr: s,
                    len: 1,
                    write: true,
                },
            ],
            Some(IOERR),
        ),
        (
            "no status: the last descriptor is readable",
            vec![Seg {
                addr: h,
                len: 16,
                write: false,
            }],
            None,
        ),
        (
            "a zero-length status",
            vec![
                Seg {
                    addr: h,
                    len: 16,
                    write: false,
                },
                Seg {
                    addr: s,
                    len: 0,
                    write: true,
                },
            ],
            None,
        ),
        (
            "the status byte outside memory",
            vec![
                Seg {
                    addr: h,
                    len: 16,
                    write: false,
                },
                Seg {
                    addr: hole,
                    len: 1,
                    write: true,
                },
            ],
            None,
        ),
        (
            "a status descriptor that wraps the address space",
            vec![
                Seg {
                    addr: h,
                    len: 16,
                    write: false,
                },
                Seg {
                    addr: u64::MAX - 1,
                    len: 16,
                    write: true,
                },
            ],
            None,
        ),
        (
            "lengths that overflow",
            vec![
                Seg {
                    addr: h,
                    len: 16,
                    write: false,
                },
                Seg {
                    addr: DATA,
                    len: u32::MAX,
                    write: true,
                },
                Seg {
                    addr: DATA,
                    len: u32::MAX,
                    write: true,
                },
                Seg {
                    addr: s,
                    len: 1,
                    write: true,
                },
            ],
            None,
        ),
        (
            "the header outside memory",
            vec![
                Seg {
                    addr: hole,
                    len: 16,
                    write: false,
                },
                Seg {
                    addr: s,
                    len: 1,
                    write: true,
                },
            ],
            Some(IOERR),
        ),
    ];
    let mut rig = Rig::memory(1 << 20);
    for (what, segs, want) in cases {
        rig.mem
            .write_slice(&header(VIRTIO_BLK_T_IN, 0), GuestAddress(h))
            .unwrap();
        rig.mem.write_obj(0xffu8, GuestAddress(s)).unwrap();
        let o = rig.one(&segs);
        assert_eq!(o.status, want, "{what}");
        if want.is_none() {
            assert_eq!(o.used_len, 0, "{what}: given back with nothing written");
        } else {
            assert_eq!(
                rig.mem.read_obj::<u8>(GuestAddress(s)).unwrap(),
                IOERR,
                "{what}: the status byte says IOERR"
            );
        }
        let mut b = vec![0u8; 512];
        assert_eq!(
            rig.request(VIRTIO_BLK_T_IN, 0, &mut b),
            OK,
            "after {what}, the next request is served"
        );
    }
    assert_eq!(
        rig.stats
            .malformed
            .load(std::sync::atomic::Ordering::Relaxed),
        11
    );
}

#[test]
fn loops_bad_next_indexes_and_nested_indirect_tables_end_the_chain() {
    let mut rig = Rig::memory(1 << 20);
    let h = DATA;
    rig.mem
        .write_slice(&header(VIRTIO_BLK_T_IN, 0), GuestAddress(h))
        .unwrap();
    // A loop of writable descriptors: 5 -> 6 -> 5 ...
    rig.ring.write_desc(
        &rig.mem,
        4,
        Desc {
            addr: h,
            len: 16,
            flags: NEXT,
            next: 5,
        },
    );
    rig.ring.write_desc(
        &rig.mem,
        5,
        Desc {
            addr: DATA + 0x200,
            len: 512,
            flags: NEXT | WRITE,
            next: 6,
        },
    );
    rig.ring.write_desc(
        &rig.mem,
        6,
        Desc {
            addr: DATA + 0x400,
            len: 512,
            flags: NEXT | WRITE,
            next: 5,
        },
    );
    rig.ring.publish(&rig.mem, 4);
    // A next index past the queue's size.
    rig.ring.write_desc(
        &rig.mem,
        7,
        Desc {
            addr: h,
            len: 16,
            flags: NEXT,
            next: 999,
        },
    );
    rig.ring.publish(&rig.mem, 7);
    // An indirect table whose length is not a multiple of 16, and one that nests another.
    let table = DATA + 0x1000;
    write_desc_at(
        &rig.mem,
        table,
        Desc {
            addr: h,
            len: 16,
            flags: NEXT,
            next: 1,
        },
    );
    write_desc_at(
        &rig.mem,
        table + 16,
        Desc {
            addr: table,
            len: 32,
            flags: INDIRECT,
            next: 0,
        },
    );
    rig.ring.write_desc(
        &rig.mem,
        8,
        Desc {
            addr: table,
            len: 20,
            flags: INDIRECT,
            next: 0,
        },
    );
    rig.ring.publish(&rig.mem, 8);
    rig.ring.write_desc(
        &rig.mem,
        9,
        Desc {
            addr: table,
            len: 32,
            flags: INDIRECT,
            next: 0,
        },
    );
    rig.ring.publish(&rig.mem, 9);
    // An available head past the queue's size.
    rig.ring.publish(&rig.mem, 40);
    let served = rig.serve();
    assert_eq!(
        served.len(),
        5,
        "every chain made available was taken: {served:?}"
    );
    assert_eq!(
        rig.ring.used_idx(&rig.mem),
        4,
        "all but the head past the queue's size were given back"
    );
    let mut b = vec![0u8; 512];
    assert_eq!(
        rig.request(VIRTIO_BLK_T_IN, 0, &mut b),
        OK,
        "the queue goes on"
    );
}

#[test]
fn a_failing_device_gives_ioerr_not_a_stop() {
    #[derive(Debug)]
    struct Failing(MemoryDev);
    impl vdstream_blockdev::Filter for Failing {
        type Inner = MemoryDev;
        fn inner(&self) -> &MemoryDev {
            &self.0
        }
        fn read_at(&self, _buf: &mut [u8], offset: u64) -> vdstream_blockdev::Result<()> {
            Err(vdstream_blockdev::Error::new(
                vdstream_blockdev::ErrorKind::Io,
                vdstream_blockdev::Op::Read,
                offset,
                0,
                "failing",
                "injected",
            ))
        }
    }
    let mut rig = Rig::new(
        Arc::new(Failing(MemoryDev::new(1 << 20))),
        Options::default(),
    );
    let mut b = vec![0u8; 512];
    assert_eq!(rig.request(VIRTIO_BLK_T_IN, 0, &mut b), IOERR);
    assert_eq!(rig.request(VIRTIO_BLK_T_OUT, 0, &mut b), OK);
    assert_eq!(
        rig.stats.errors.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[derive(Debug, Clone)]
enum Op {
    Write { block: u64, blocks: u64, seed: u8 },
    Read { block: u64, blocks: u64 },
    Discard { block: u64, blocks: u64 },
    Zero { block: u64, blocks: u64 },
    Flush,
}

const BLOCKS: u64 = 64;

fn op() -> impl Strategy<Value = Op> {
    let range = (0..BLOCKS).prop_flat_map(|b| (Just(b), 1..=(BLOCKS - b).min(8)));
    prop_oneof![
        (range.clone(), any::<u8>()).prop_map(|((block, blocks), seed)| Op::Write {
            block,
            blocks,
            seed
        }),
        range
            .clone()
            .prop_map(|(block, blocks)| Op::Read { block, blocks }),
        range
            .clone()
            .prop_map(|(block, blocks)| Op::Discard { block, blocks }),
        range.prop_map(|(block, blocks)| Op::Zero { block, blocks }),
        Just(Op::Flush),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Reads through the ring always return what the model holds.
    #[test]
    fn requests_match_a_reference_model(ops in prop::collection::vec(op(), 1..40)) {
        let mut rig = Rig::memory(BLOCKS * 512);
        let mut model = vec![0u8; (BLOCKS * 512) as usize];
        for op in ops {
            match op {
                Op::Write { block, blocks, seed } => {
                    let mut d: Vec<u8> = (0..blocks * 512).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
                    model[(block * 512) as usize..((block + blocks) * 512) as usize].copy_from_slice(&d);
                    prop_assert_eq!(rig.request(VIRTIO_BLK_T_OUT, block, &mut d), OK);
                }
                Op::Read { block, blocks } => {
                    let mut d = vec![0xeeu8; (blocks * 512) as usize];
                    prop_assert_eq!(rig.request(VIRTIO_BLK_T_IN, block, &mut d), OK);
                    prop_assert!(d[..] == model[(block * 512) as usize..((block + blocks) * 512) as usize]);
                }
                Op::Discard { block, blocks } | Op::Zero { block, blocks } => {
                    let kind = if matches!(op, Op::Discard { .. }) { VIRTIO_BLK_T_DISCARD } else { VIRTIO_BLK_T_WRITE_ZEROES };
                    model[(block * 512) as usize..((block + blocks) * 512) as usize].fill(0);
                    prop_assert_eq!(rig.ranges(kind, &[(block, blocks as u32, 0)]), OK);
                }
                Op::Flush => prop_assert_eq!(rig.request(VIRTIO_BLK_T_FLUSH, 0, &mut []), OK),
            }
        }
    }

    /// Fuzzing the descriptor table and the request bytes: the backend never panics, takes
    /// every chain, and changes guest memory only inside buffers the driver marked
    /// device-writable (and the used ring).
    #[test]
    fn random_chains_never_write_outside_writable_buffers(
        descs in prop::collection::vec((
            prop_oneof![0u64..HIGH_END + 0x1000, Just(LOW - 8), Just(HIGH - 8), Just(HIGH_END - 1), Just(u64::MAX - 4)],
            prop_oneof![0u32..64, 0u32..0x3000, Just(u32::MAX), Just(16u32)],
            0u16..8,
            0u16..20,
        ), 16),
        heads in prop::collection::vec(0u16..18, 1..8),
        noise in prop::collection::vec(any::<u8>(), 64),
    ) {
        let mut rig = Rig::memory(1 << 20);
        // Request bytes the descriptors may point at: random headers at DATA.
        rig.mem.write_slice(&noise, GuestAddress(DATA)).unwrap();
        rig.mem.write_slice(&header(noise[0] as u32 % 16, u64::from(noise[1])), GuestAddress(DATA + 64)).unwrap();
        let mut writable: Vec<(u64, u64)> = Vec::new();
        for (i, (addr, len, flags, next)) in descs.iter().enumerate() {
            let flags = flags & (NEXT | WRITE | INDIRECT);
            rig.ring.write_desc(&rig.mem, i as u16, Desc { addr: *addr, len: *len, flags, next: *next });
            if flags & WRITE != 0 {
                writable.push((*addr, u64::from(*len)));
            }
        }
        let mut before = vec![0u8; LOW as usize];
        rig.mem.read_slice(&mut before, GuestAddress(0)).unwrap();
        let mut before_high = vec![0u8; (HIGH_END - HIGH) as usize];
        rig.mem.read_slice(&mut before_high, GuestAddress(HIGH)).unwrap();
        for h in &heads {
            rig.ring.publish(&rig.mem, *h);
        }
        let served = rig.serve();
        prop_assert_eq!(served.len(), heads.len());
        let used = (rig.ring.used.0, rig.ring.used.0 + 4 + 8 * 16 + 2);
        let avail = (rig.ring.avail.0, rig.ring.avail.0 + 4 + 2 * 16 + 2);
        let allowed = |a: u64| {
            (used.0..used.1).contains(&a) || (avail.0..avail.1).contains(&a)
                || writable.iter().any(|(s, l)| a >= *s && a - s < *l)
        };
        let mut after = vec![0u8; LOW as usize];
        rig.mem.read_slice(&mut after, GuestAddress(0)).unwrap();
        for (i, (b, a)) in before.iter().zip(&after).enumerate() {
            prop_assert!(b == a || allowed(i as u64), "byte {:#x} changed outside writable buffers", i);
        }
        let mut after_high = vec![0u8; (HIGH_END - HIGH) as usize];
        rig.mem.read_slice(&mut after_high, GuestAddress(HIGH)).unwrap();
        for (i, (b, a)) in before_high.iter().zip(&after_high).enumerate() {
            prop_assert!(b == a || allowed(HIGH + i as u64), "byte {:#x} changed outside writable buffers", HIGH + i as u64);
        }
        // And the queue still serves a good request.
        let mut b = vec![0u8; 512];
        prop_assert_eq!(rig.request(VIRTIO_BLK_T_IN, 0, &mut b), OK);
    }
}

/// Without FLUSH acknowledged, a completed write must be stable: it is sent as FUA.
#[test]
fn writes_are_fua_until_the_frontend_takes_flush() {
    #[derive(Debug)]
    struct CountFua(MemoryDev, std::sync::atomic::AtomicU64);
    impl vdstream_blockdev::Filter for CountFua {
        type Inner = MemoryDev;
        fn inner(&self) -> &MemoryDev {
            &self.0
        }
        fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> vdstream_blockdev::Result<()> {
            if fua {
                self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            self.0.write_at(buf, offset, fua)
        }
    }
    let dev = Arc::new(CountFua(MemoryDev::new(1 << 20), Default::default()));
    let mut rig = Rig::new(dev.clone(), Options::default());
    let mut b = vec![3u8; 4096];
    assert_eq!(rig.request(VIRTIO_BLK_T_OUT, 0, &mut b), OK);
    assert_eq!(
        dev.1.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "with FLUSH taken, writes are not FUA"
    );
    rig.write_through = true;
    assert_eq!(rig.request(VIRTIO_BLK_T_OUT, 0, &mut b), OK);
    assert_eq!(
        dev.1.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "without FLUSH, the write is FUA"
    );
}
