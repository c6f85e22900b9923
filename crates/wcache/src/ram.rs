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

use vdstream_blockdev::{BlockDev, Result};

use crate::tiers::{tiers_cache_impls, Tiers};
use crate::{CacheConfig, CacheType};

/// The `device-ram` cache. See the module notes.
#[derive(Debug)]
pub struct RamCache {
    tiers: Tiers,
}

impl RamCache {
    /// Opens an empty RAM cache of `cfg.ram` bytes over `lower`.
    pub fn open(lower: Arc<dyn BlockDev>, cfg: &CacheConfig) -> Result<Self> {
        let name = format!(
            "device-ram cache of {} over {}",
            cfg.target,
            lower.describe()
        );
        let full = format!(
            "the RAM cache of target {} is full ({} bytes): raise --ram, or use the ram-overflow cache type to spill to a local overflow file",
            cfg.target, cfg.ram
        );
        Ok(RamCache {
            tiers: Tiers::new(lower, name, cfg.ram, None, full),
        })
    }
}

tiers_cache_impls!(RamCache, CacheType::DeviceRam);
