//! The driver's side of a split virtqueue (virtio 1.2 §2.7), written straight into guest
//! memory: what a guest's virtio-blk driver does, reduced to what tests and fuzzing need.
//! It writes any descriptor asked for, well-formed or not, so tests can hand the backend
//! chains no real driver would build.

use virtio_bindings::bindings::virtio_ring::{
    VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory};

/// Flag bits of a descriptor.
pub const NEXT: u16 = VRING_DESC_F_NEXT as u16;
pub const WRITE: u16 = VRING_DESC_F_WRITE as u16;
pub const INDIRECT: u16 = VRING_DESC_F_INDIRECT as u16;

/// One descriptor as the driver writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

/// One buffer of a chain: device-readable or device-writable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seg {
    pub addr: u64,
    pub len: u32,
    pub write: bool,
}

/// A split virtqueue laid out in guest memory.
#[derive(Debug, Clone)]
pub struct SplitRing {
    pub size: u16,
    pub desc: GuestAddress,
    pub avail: GuestAddress,
    pub used: GuestAddress,
    /// The next descriptor [`add_chain`](Self::add_chain) takes (wraps at `size`).
    next_desc: u16,
    avail_idx: u16,
}

impl SplitRing {
    /// A ring of `size` entries from `base`: the descriptor table, the available ring, and
    /// the used ring on the next 4 KiB boundary. Occupies [`Self::bytes`] bytes.
    pub fn at(base: u64, size: u16) -> SplitRing {
        let desc = base;
        let avail = desc + 16 * u64::from(size);
        let used = (avail + 6 + 2 * u64::from(size) + 4095) & !4095;
        SplitRing {
            size,
            desc: GuestAddress(desc),
            avail: GuestAddress(avail),
            used: GuestAddress(used),
            next_desc: 0,
            avail_idx: 0,
        }
    }

    /// Bytes from `base` the ring occupies.
    pub fn bytes(&self) -> u64 {
        self.used.0 + 6 + 8 * u64::from(self.size) - self.desc.0
    }

    /// Zeroes the rings' indexes in `mem`.
    pub fn init<M: GuestMemory>(&mut self, mem: &M) {
        let zeros = vec![0u8; self.bytes() as usize];
        mem.write_slice(&zeros, self.desc)
            .expect("the ring is in guest memory");
        self.next_desc = 0;
        self.avail_idx = 0;
    }

    /// A device-side queue over this ring (what the backend's vring holds after the
    /// frontend's SET_VRING_ADDR).
    pub fn queue(&self) -> Queue {
        let mut q = Queue::new(self.size).expect("a power-of-two size");
        q.set_size(self.size);
        let split = |a: GuestAddress| (Some(a.0 as u32), Some((a.0 >> 32) as u32));
        let (lo, hi) = split(self.desc);
        q.set_desc_table_address(lo, hi);
        let (lo, hi) = split(self.avail);
        q.set_avail_ring_address(lo, hi);
        let (lo, hi) = split(self.used);
        q.set_used_ring_address(lo, hi);
        q.set_ready(true);
        q
    }

    /// Writes descriptor `index` (taken modulo the size) as given.
    pub fn write_desc<M: GuestMemory>(&self, mem: &M, index: u16, d: Desc) {
        write_desc_at(mem, self.desc.0 + 16 * u64::from(index % self.size), d);
    }

    /// Makes `head` available to the device.
    pub fn publish<M: GuestMemory>(&mut self, mem: &M, head: u16) {
        let slot = self.avail.0 + 4 + 2 * u64::from(self.avail_idx % self.size);
        mem.write_obj(head.to_le(), GuestAddress(slot))
            .expect("the ring is in guest memory");
        self.avail_idx = self.avail_idx.wrapping_add(1);
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        mem.write_obj(self.avail_idx.to_le(), GuestAddress(self.avail.0 + 2))
            .expect("the ring is in guest memory");
    }

    /// Writes `segs` as one chain of consecutive descriptors and publishes it; returns its
    /// head.
    pub fn add_chain<M: GuestMemory>(&mut self, mem: &M, segs: &[Seg]) -> u16 {
        let head = self.next_desc % self.size;
        for (i, s) in segs.iter().enumerate() {
            let index = (head + i as u16) % self.size;
            let last = i + 1 == segs.len();
            let flags = if s.write { WRITE } else { 0 } | if last { 0 } else { NEXT };
            self.write_desc(
                mem,
                index,
                Desc {
                    addr: s.addr,
                    len: s.len,
                    flags,
                    next: (index + 1) % self.size,
                },
            );
        }
        self.next_desc = (head + segs.len().max(1) as u16) % self.size;
        self.publish(mem, head);
        head
    }

    /// How many chains the device has given back.
    pub fn used_idx<M: GuestMemory>(&self, mem: &M) -> u16 {
        u16::from_le(
            mem.read_obj(GuestAddress(self.used.0 + 2))
                .expect("the ring is in guest memory"),
        )
    }

    /// The `n`th used element: the head and the length the device wrote.
    pub fn used_elem<M: GuestMemory>(&self, mem: &M, n: u16) -> (u32, u32) {
        let at = self.used.0 + 4 + 8 * u64::from(n % self.size);
        let id: u32 = mem
            .read_obj(GuestAddress(at))
            .expect("the ring is in guest memory");
        let len: u32 = mem
            .read_obj(GuestAddress(at + 4))
            .expect("the ring is in guest memory");
        (u32::from_le(id), u32::from_le(len))
    }
}

/// Writes one 16-byte descriptor at `addr` (a ring's table or an indirect table).
pub fn write_desc_at<M: GuestMemory>(mem: &M, addr: u64, d: Desc) {
    let mut b = [0u8; 16];
    b[0..8].copy_from_slice(&d.addr.to_le_bytes());
    b[8..12].copy_from_slice(&d.len.to_le_bytes());
    b[12..14].copy_from_slice(&d.flags.to_le_bytes());
    b[14..16].copy_from_slice(&d.next.to_le_bytes());
    mem.write_slice(&b, GuestAddress(addr))
        .expect("the descriptor is in guest memory");
}

/// A virtio-blk request header.
pub fn header(kind: u32, sector: u64) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    h
}
