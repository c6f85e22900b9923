//! `device-ram`: the target's writes kept in RAM, up to a fixed budget, and ENOSPC past it.
//!
//! Design notes.
//!
//! This is [`crate::tiers::Tiers`] without an overflow file: pages are taken one at a time
//! as the target writes (nothing is reserved up front), and given back when the target trims
//! or zeroes them (they become zero markers, which cost no page). Page states:
//!
//! | state  | reads from            | RAM held   | becomes, on write / trim           |
//! | ------ | --------------------- | ---------- | ---------------------------------- |
//! | absent | the vDisk (a *miss*)  | none       | ram (ENOSPC if full) / zero        |
//! | ram    | the page (a *hit*)    | 4 KiB      | ram, in place / zero (page freed)  |
//! | zero   | zeros (a *hit*)       | none       | ram (ENOSPC if full) / zero        |
//!
//! When the budget is used up, a write that needs a page the cache does not hold fails with
//! [`ErrorKind::NoSpace`](vdstream_blockdev::ErrorKind::NoSpace), with a message naming the
//! target and the budget and saying what to do; it is logged once per cache and counted in
//! `nospace_errors` every time. Nothing already written is lost, reads keep working, and
//! overwrites of cached pages, trims and zeroing still succeed. This is the fix for PVS's
//! "cache in device RAM", which stops the machine when it fills.
//!
//! `flush` and FUA are not advertised: nothing here is ever durable, and every completed
//! write is already visible to every connection, so a flush would have nothing to do.
//! `may_block` is the lower device's: the cache itself only copies memory.

use std::sync::Arc;

use vdstream_blockdev::{check_range, BlockDev, Caps, Extent, Op, Result, ZeroFlags};

use crate::page::PAGE;
use crate::tiers::Tiers;
use crate::{CacheConfig, CacheType, StatsSnapshot, WriteCache};

/// The `device-ram` cache. See the module notes.
#[derive(Debug)]
pub struct RamCache {
    tiers: Tiers,
}

impl RamCache {
    /// Opens an empty RAM cache of `cfg.ram` bytes over `lower`.
    pub fn open(lower: Arc<dyn BlockDev>, cfg: &CacheConfig) -> Result<Self> {
        let name = format!("device-ram cache of {} over {}", cfg.target, lower.describe());
        let full = format!(
            "the RAM cache of target {} is full ({} bytes): raise --ram, or use the ram-overflow cache type to spill to a local overflow file",
            cfg.target, cfg.ram
        );
        Ok(RamCache { tiers: Tiers::new(lower, name, cfg.ram, None, full) })
    }

    fn check(&self, op: Op, offset: u64, len: u64) -> Result<()> {
        check_range(self.tiers.size, op, offset, len, &|| self.tiers.name.clone())
    }
}

impl BlockDev for RamCache {
    fn size(&self) -> u64 {
        self.tiers.size
    }

    fn caps(&self) -> Caps {
        Caps {
            read_only: false,
            flush: false,
            fua: false,
            trim: true,
            zeroes: true,
            fast_zero: true,
            cache: false,
            block_status: true,
            multi_conn: true,
            may_block: self.tiers.lower.caps().may_block,
            preferred_block: PAGE as u32,
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.check(Op::Read, offset, buf.len() as u64)?;
        self.tiers.read(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        self.check(Op::Write, offset, buf.len() as u64)?;
        self.tiers.write(buf, offset)
    }

    fn trim(&self, offset: u64, len: u64, _fua: bool) -> Result<()> {
        self.check(Op::Trim, offset, len)?;
        self.tiers.zero_range(offset, len, Op::Trim)
    }

    fn write_zeroes(&self, offset: u64, len: u64, _flags: ZeroFlags) -> Result<()> {
        // Zeroing is always fast here (markers, or at most two partial pages), so
        // `fast_only` never has to be refused.
        self.check(Op::Zero, offset, len)?;
        self.tiers.zero_range(offset, len, Op::Zero)
    }

    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        self.check(Op::BlockStatus, offset, len)?;
        self.tiers.block_status(offset, len, out)
    }

    fn describe(&self) -> String {
        self.tiers.name.clone()
    }
}

impl WriteCache for RamCache {
    fn cache_type(&self) -> CacheType {
        CacheType::DeviceRam
    }

    fn stats(&self) -> StatsSnapshot {
        self.tiers.stats.snapshot()
    }
}
