//! Target records (`STORE/targets/ID.json`, `GET /api/v1/targets/ID`): which vDisk a target
//! boots, which version of it, and its write cache; and the API bodies that add and change
//! one. The store writes and checks them (`vdstream_store::targets`); the server serves
//! them, and the agent and the CLI read them with these types.

use serde::{Deserialize, Serialize};

use crate::cache::CacheType;
use crate::name::Selector;
use crate::time::Timestamp;

/// One target, as `STORE/targets/ID.json` holds it and the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetRecord {
    pub format: String,
    pub format_version: u32,
    pub id: String,
    pub vdisk: String,
    /// Which version it boots (`production` unless said otherwise).
    pub version: Selector,
    pub cache: CacheType,
    /// RAM of `device-ram` and `ram-overflow`, bytes; absent: the agent's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram: Option<u64>,
    /// Cap on the overflow or cache file, bytes; absent: the vDisk's size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overflow_max: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    pub created: Timestamp,
    pub created_by: String,
    pub updated: Timestamp,
    pub updated_by: String,
    /// Bumped on every change.
    pub generation: u64,
}

/// `target add`: a new record. In JSON (the API's POST), `cache` is a cache type's name
/// and `version` a selector's text or number.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewTarget {
    pub id: String,
    pub vdisk: String,
    pub cache: String,
    #[serde(default)]
    pub version: Option<Selector>,
    #[serde(default)]
    pub ram: Option<u64>,
    #[serde(default)]
    pub overflow_max: Option<u64>,
    #[serde(default)]
    pub description: Option<String>,
}

/// `target set`: what to change; an absent field stays. For `ram`, `overflow_max` and
/// `description`, `Some(None)` (JSON `null`) clears the value.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetChange {
    #[serde(default)]
    pub vdisk: Option<String>,
    #[serde(default)]
    pub cache: Option<String>,
    #[serde(default)]
    pub version: Option<Selector>,
    #[serde(default, deserialize_with = "present")]
    pub ram: Option<Option<u64>>,
    #[serde(default, deserialize_with = "present")]
    pub overflow_max: Option<Option<u64>>,
    #[serde(default, deserialize_with = "present")]
    pub description: Option<Option<String>>,
}

impl TargetChange {
    pub fn is_empty(&self) -> bool {
        *self == TargetChange::default()
    }
}

/// A field that is present (even as `null`) becomes `Some(value)`.
fn present<'de, T: Deserialize<'de>, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}
