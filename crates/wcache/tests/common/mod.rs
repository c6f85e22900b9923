//! Pieces the write-cache tests share: a vDisk that refuses every change, and vDisks of
//! known content.
#![allow(dead_code)] // each test file uses its own subset

use std::sync::Arc;

use vdstream_blockdev::conformance::pattern_buf;
use vdstream_blockdev::{BlockDev, Caps, Extent, MemoryDev, Result, ZeroFlags};

/// A lower device that refuses every change, so a cache that writes below fails loudly.
#[derive(Debug)]
pub struct Sealed(pub Arc<MemoryDev>);

impl BlockDev for Sealed {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn caps(&self) -> Caps {
        Caps {
            read_only: true,
            ..self.0.caps()
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.0.read_at(buf, offset)
    }
    fn write_at(&self, _: &[u8], _: u64, _: bool) -> Result<()> {
        panic!("the cache wrote to the vDisk")
    }
    fn trim(&self, _: u64, _: u64, _: bool) -> Result<()> {
        panic!("the cache trimmed the vDisk")
    }
    fn write_zeroes(&self, _: u64, _: u64, _: ZeroFlags) -> Result<()> {
        panic!("the cache zeroed the vDisk")
    }
    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        self.0.block_status(offset, len, out)
    }
    fn describe(&self) -> String {
        "sealed vDisk".into()
    }
}

/// A vDisk of `size` bytes holding `pattern_buf(seed, 0, size)` (zeros for `None`).
pub fn vdisk(size: u64, seed: Option<u8>) -> Arc<MemoryDev> {
    let dev = Arc::new(MemoryDev::new(size));
    if let Some(seed) = seed {
        dev.write_at(&pattern_buf(seed, 0, size as usize), 0, false)
            .unwrap();
    }
    dev
}
