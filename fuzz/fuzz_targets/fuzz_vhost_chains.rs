//! Fuzzes the vhost-user-blk request path: the input is guest memory as a hostile frontend
//! would leave it (the descriptor table, the available ring's heads, indirect tables,
//! request headers, discard segments: all of it the fuzzer's bytes), over two regions with a
//! hole between them. Every available chain is taken and carried out on a RAM disk.
//! Invariants: nothing panics, every head inside the queue is given back and none past it,
//! and a status byte is only ever one of the three virtio-blk statuses. (Requests may write
//! over the rings themselves, where the frontend gave them as buffers.)
#![no_main]

use libfuzzer_sys::fuzz_target;
use vdstream_blockdev::lograte::LogLimiter;
use vdstream_blockdev::{BlockDev, MemoryDev};
use vdstream_vhost::config::{Geometry, Options};
use vdstream_vhost::driver::SplitRing;
use vdstream_vhost::request::{Executor, Stats};
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const LOW: u64 = 0x1_0000;
const HIGH: u64 = 0x2_0000;
const SIZE: u16 = 16;

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), LOW as usize), (GuestAddress(HIGH), LOW as usize)]).unwrap();
    let mut ring = SplitRing::at(0, SIZE);
    ring.init(&mem);
    // The fuzzer's bytes: first the descriptor table (16 x 16 bytes), then everything after
    // the rings (headers, buffers, indirect tables), and the same bytes again in the high region.
    let (heads, rest) = data.split_at(8);
    let table = &rest[..rest.len().min(16 * SIZE as usize)];
    mem.write_slice(table, ring.desc).unwrap();
    let body = &rest[table.len()..];
    let body = &body[..body.len().min((LOW - 0x2000) as usize)];
    mem.write_slice(body, GuestAddress(0x2000)).unwrap();
    mem.write_slice(&rest[..rest.len().min(LOW as usize)], GuestAddress(HIGH)).unwrap();
    let disk = MemoryDev::new(64 << 10);
    let opts = Options { serial: "fuzz".into(), ..Options::default() };
    let geom = Geometry::of(&disk, &opts);
    let (stats, log) = (Stats::default(), LogLimiter::new(1, 1));
    let mut buf = Vec::new();
    let mut queue = ring.queue();
    for h in heads {
        ring.publish(&mem, u16::from(*h) % 32);
    }
    let mut exec = Executor { dev: &disk, geom: &geom, stats: &stats, log: &log, name: "fuzz", write_through: false, buf: &mut buf };
    let mut given_back = 0u16;
    let mut taken = 0;
    // Bounded as the backend's batches are: a request may write over the available ring
    // (the frontend gave it as a buffer) and so publish more chains.
    while taken < 4 * usize::from(SIZE) {
        let Some(chain) = queue.pop_descriptor_chain(&mem) else { break };
        taken += 1;
        let head = chain.head_index();
        let outcome = exec.execute(&mem, chain);
        if let Some(s) = outcome.status {
            assert!(s <= 2, "status {s}");
        }
        // A head inside the queue is given back; one past it cannot be. (Heads are read as
        // the device pops them: a request may legitimately write over the rings, if the
        // frontend gave that memory as a buffer.)
        assert_eq!(queue.add_used(&mem, head, outcome.used_len).is_ok(), head < SIZE, "head {head}");
        given_back += u16::from(head < SIZE);
    }
    assert!(usize::from(given_back) <= taken);
});
