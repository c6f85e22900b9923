//! What the device tells the guest: the virtio feature bits it offers and the bytes of its
//! configuration space (`struct virtio_blk_config`, virtio 1.2 §5.2.4), both derived from
//! the [`BlockDev`]'s size and [`Caps`] and from [`Options`], never from a hand-kept list.
//!
//! The configuration space is written by hand at the spec's offsets (little-endian):
//! virtio-bindings' structs do not implement vm-memory's `ByteValued`, and a window of it
//! (`offset`, `size`) must be answered byte for byte, padded with zeros past the end.

use vdstream_blockdev::{BlockDev, Caps};
use vhost::vhost_user::message::VhostUserVirtioFeatures;
use virtio_bindings::bindings::virtio_blk::*;
use virtio_bindings::bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};

/// Bytes of `struct virtio_blk_config` up to and including the zoned fields.
pub const CONFIG_LEN: usize = 96;

/// Descriptors a request may have for its data (`seg_max`): qemu's own value for a queue of
/// 256. Longer chains are still served (the backend copies in pieces), this only guides the
/// guest's request sizes.
pub const SEG_MAX: u32 = 254;

/// The largest discard or write-zeroes range of one segment, in 512-byte sectors (1 GiB).
pub const MAX_RANGE_SECTORS: u32 = 1 << 21;

/// Segments in one discard or write-zeroes request.
pub const MAX_RANGE_SEGS: u32 = 16;

/// How the device is offered, beyond what the block device says itself.
#[derive(Debug, Clone)]
pub struct Options {
    /// Queues offered (`num_queues`); qemu's `num-queues` must not exceed it.
    pub queues: u16,
    /// Threads serving the queues: queue `i` is served by thread `i % threads`.
    pub threads: u16,
    /// Descriptors per queue at most (qemu's `queue-size` must not exceed it).
    pub queue_size: u16,
    /// The logical block size (`blk_size`): a power of two from 512 to 64 KiB. The vDisk's
    /// smallest block; requests not aligned to it fail.
    pub logical_block: u32,
    /// Offer the disk read-only (`VIRTIO_BLK_F_RO`) whatever the device can do.
    pub read_only: bool,
    /// The serial number a guest reads (`GET_ID`, `/sys/block/vda/serial`), at most 20 bytes.
    pub serial: String,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            queues: 1,
            threads: 1,
            queue_size: 1024,
            logical_block: 512,
            read_only: false,
            serial: String::new(),
        }
    }
}

/// The device's geometry and what it offers, fixed for one attach.
#[derive(Debug, Clone)]
pub struct Geometry {
    /// Bytes; a whole number of logical blocks is served (a tail shorter than one is not).
    pub size: u64,
    pub logical_block: u32,
    pub read_only: bool,
    pub flush: bool,
    pub discard: bool,
    pub write_zeroes: bool,
    /// Trims are allowed for write-zeroes (`write_zeroes_may_unmap`).
    pub zeroes_may_unmap: bool,
    pub preferred_block: u32,
    pub serial: [u8; VIRTIO_BLK_ID_BYTES as usize],
}

impl Geometry {
    /// The geometry of `dev` offered with `opts`.
    pub fn of(dev: &dyn BlockDev, opts: &Options) -> Geometry {
        let caps: Caps = dev.caps();
        let logical_block = opts.logical_block.clamp(512, 65536).next_power_of_two();
        let read_only = opts.read_only || caps.read_only;
        let mut serial = [0u8; VIRTIO_BLK_ID_BYTES as usize];
        let id = opts.serial.as_bytes();
        let n = id.len().min(serial.len());
        serial[..n].copy_from_slice(&id[..n]);
        Geometry {
            size: dev.size() / u64::from(logical_block) * u64::from(logical_block),
            logical_block,
            read_only,
            flush: true,
            discard: !read_only && caps.trim,
            write_zeroes: !read_only,
            zeroes_may_unmap: caps.trim,
            preferred_block: caps.preferred_block.max(logical_block).next_power_of_two(),
            serial,
        }
    }

    /// The virtio feature bits offered.
    pub fn features(&self, queues: u16) -> u64 {
        let mut f = 1u64 << VIRTIO_F_VERSION_1
            | 1 << VIRTIO_RING_F_EVENT_IDX
            | 1 << VIRTIO_RING_F_INDIRECT_DESC
            | 1 << VIRTIO_BLK_F_SEG_MAX
            | 1 << VIRTIO_BLK_F_BLK_SIZE
            | 1 << VIRTIO_BLK_F_TOPOLOGY
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
            // Dirty logging of guest memory: qemu migrates a VM only with it.
            | VhostUserVirtioFeatures::LOG_ALL.bits();
        if queues > 1 {
            f |= 1 << VIRTIO_BLK_F_MQ;
        }
        if self.flush {
            f |= 1 << VIRTIO_BLK_F_FLUSH;
        }
        if self.read_only {
            f |= 1 << VIRTIO_BLK_F_RO;
        }
        if self.discard {
            f |= 1 << VIRTIO_BLK_F_DISCARD;
        }
        if self.write_zeroes {
            f |= 1 << VIRTIO_BLK_F_WRITE_ZEROES;
        }
        f
    }

    /// `struct virtio_blk_config`.
    pub fn config_space(&self, queues: u16) -> [u8; CONFIG_LEN] {
        let mut c = [0u8; CONFIG_LEN];
        let mut put = |at: usize, bytes: &[u8]| c[at..at + bytes.len()].copy_from_slice(bytes);
        put(0, &(self.size >> 9).to_le_bytes());
        put(12, &SEG_MAX.to_le_bytes());
        put(20, &self.logical_block.to_le_bytes());
        let exp = (self.preferred_block / self.logical_block).trailing_zeros() as u8;
        put(24, &[exp, 0]);
        put(26, &1u16.to_le_bytes());
        put(
            28,
            &(self.preferred_block / self.logical_block).to_le_bytes(),
        );
        put(34, &queues.to_le_bytes());
        let align = (self.preferred_block >> 9).max(1);
        if self.discard {
            put(36, &MAX_RANGE_SECTORS.to_le_bytes());
            put(40, &MAX_RANGE_SEGS.to_le_bytes());
            put(44, &align.to_le_bytes());
        }
        if self.write_zeroes {
            put(48, &MAX_RANGE_SECTORS.to_le_bytes());
            put(52, &MAX_RANGE_SEGS.to_le_bytes());
            put(56, &[u8::from(self.zeroes_may_unmap)]);
        }
        c
    }
}

/// The window `[offset, offset+size)` of `space`, zero past its end: a reply of exactly
/// `size` bytes, as vhost-user's GET_CONFIG needs.
pub fn config_window(space: &[u8], offset: u32, size: u32) -> Vec<u8> {
    let mut out = vec![0u8; size as usize];
    let start = (offset as usize).min(space.len());
    let end = (offset as usize)
        .saturating_add(size as usize)
        .min(space.len());
    out[..end - start].copy_from_slice(&space[start..end]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use vdstream_blockdev::MemoryDev;

    #[test]
    fn config_space_carries_size_block_size_and_queues() {
        let dev = MemoryDev::new(64 << 20);
        let g = Geometry::of(
            &dev,
            &Options {
                logical_block: 4096,
                ..Options::default()
            },
        );
        let c = g.config_space(4);
        assert_eq!(
            u64::from_le_bytes(c[0..8].try_into().unwrap()),
            (64 << 20) / 512,
            "capacity in 512-byte sectors"
        );
        assert_eq!(
            u32::from_le_bytes(c[20..24].try_into().unwrap()),
            4096,
            "blk_size"
        );
        assert_eq!(
            u16::from_le_bytes(c[34..36].try_into().unwrap()),
            4,
            "num_queues"
        );
        let f = g.features(4);
        assert_ne!(f & 1 << VIRTIO_BLK_F_MQ, 0);
        assert_ne!(f & 1 << VIRTIO_BLK_F_WRITE_ZEROES, 0);
        assert_eq!(f & 1 << VIRTIO_BLK_F_RO, 0);
    }

    #[test]
    fn read_only_offers_no_writes() {
        let dev = MemoryDev::new(1 << 20);
        let g = Geometry::of(
            &dev,
            &Options {
                read_only: true,
                ..Options::default()
            },
        );
        let f = g.features(1);
        assert_ne!(f & 1 << VIRTIO_BLK_F_RO, 0);
        assert_eq!(
            f & (1 << VIRTIO_BLK_F_DISCARD | 1 << VIRTIO_BLK_F_WRITE_ZEROES | 1 << VIRTIO_BLK_F_MQ),
            0
        );
    }

    #[test]
    fn a_window_is_exactly_the_size_asked() {
        let space = [7u8; CONFIG_LEN];
        assert_eq!(config_window(&space, 0, 60).len(), 60);
        let w = config_window(&space, 90, 20);
        assert_eq!(w.len(), 20);
        assert_eq!(&w[..6], &[7; 6]);
        assert_eq!(&w[6..], &[0; 14]);
        assert_eq!(config_window(&space, u32::MAX, 8), vec![0; 8]);
    }
}
