//! What the server needs to know of a target to serve `target/ID`: its vDisk, the version
//! its record pins (if any), and its server-side cache. The records themselves belong to
//! the store (`vdstream target add`, `STORE/targets/`); this is the one place the server
//! reads them.

use vdstream_store::Store;
use vdstream_wcache::CacheType;

/// A target's record, as the server uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetSpec {
    pub vdisk: String,
    /// The version the record pins; `None`: production at connect time.
    pub version: Option<u32>,
    pub cache: CacheType,
    /// RAM of the cache, in bytes.
    pub ram: u64,
    /// Cap on the cache file, in bytes (`None`: the vDisk's size).
    pub overflow_max: Option<u64>,
}

/// Why a target could not be looked up; the message says what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetLookupError {
    /// No such target (`NBD_REP_ERR_UNKNOWN`).
    Unknown(String),
    /// The record exists but cannot be read.
    Failed(String),
}

/// Looks up target `id` in `store`.
pub fn lookup_target(store: &Store, id: &str) -> Result<TargetSpec, TargetLookupError> {
    Err(TargetLookupError::Unknown(format!(
        "no target named {id:?} in {}: add it with `vdstream target add {id} --vdisk NAME --cache server`, \
         or read a vDisk directly through vdisk/NAME",
        store.root().display()
    )))
}
