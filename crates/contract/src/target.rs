//! Target records (`STORE/targets/ID.json`, `GET /api/v1/targets/ID`): which vDisk a target
//! boots, which version of it, and its write cache; and the API bodies that add and change
//! one. The store writes and checks them (`vdstream_store::targets`); the server serves
//! them, and the agent and the CLI read them with these types.
//!
//! A record may name the MAC addresses of the target's network cards (`macs`): the boot
//! service (`vdstream server --boot`) finds the record of a PXE-booting machine by them.
//! A MAC is kept in one form, [`normalize_mac`]'s (`52:54:00:12:34:56`), and belongs to
//! one record at most. Records written before MACs existed load with none.

use serde::{Deserialize, Serialize};

use crate::cache::CacheType;
use crate::name::Selector;
use crate::time::Timestamp;

/// One target, as `STORE/targets/ID.json` holds it and the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
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
    /// MAC addresses of its network cards, normalised ([`normalize_mac`]), sorted; each
    /// unique across the store's records. Absent in older records: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<crate::schema::Mac>)]
    pub macs: Vec<String>,
    /// Host name a network-booted target takes (`vdstream.hostname=`); absent: its id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// A local disk or partition of a network-booted target for its cache's overflow
    /// (`vdstream.overflow=`, e.g. `/dev/sda2`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overflow_device: Option<String>,
    pub created: Timestamp,
    pub created_by: String,
    pub updated: Timestamp,
    pub updated_by: String,
    /// Bumped on every change.
    pub generation: u64,
}

/// `target add`: a new record. In JSON (the API's POST), `cache` is a cache type's name
/// and `version` a selector's text or number.
#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(
    description = "Rules across fields (422 when broken): `ram` only with device-ram (not 0) and ram-overflow; `overflow_max` not with device-ram; the vDisk must exist (422) and the id be new (409); a MAC another record has is refused, naming it (409)."
)]
pub struct NewTarget {
    #[schema(value_type = crate::schema::Name)]
    pub id: String,
    #[schema(value_type = crate::schema::Name)]
    pub vdisk: String,
    #[schema(value_type = crate::CacheType)]
    pub cache: String,
    #[serde(default)]
    #[schema(value_type = Option<Selector>)]
    pub version: Option<Selector>,
    #[serde(default)]
    #[schema(value_type = Option<crate::schema::Ram>)]
    pub ram: Option<u64>,
    #[serde(default)]
    #[schema(value_type = Option<crate::schema::Cap>)]
    pub overflow_max: Option<u64>,
    #[serde(default)]
    #[schema(value_type = Option<crate::schema::Description>)]
    pub description: Option<String>,
    /// MAC addresses (any of the forms [`normalize_mac`] takes).
    #[serde(default)]
    #[schema(value_type = Vec<crate::schema::Mac>)]
    pub macs: Vec<String>,
    #[serde(default)]
    #[schema(value_type = Option<crate::schema::Hostname>)]
    pub hostname: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<crate::schema::OverflowDevice>)]
    pub overflow_device: Option<String>,
}

/// `target set`: what to change; an absent field stays. For `ram`, `overflow_max` and
/// `description`, `Some(None)` (JSON `null`) clears the value.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(
    min_properties = 1,
    description = "Absent fields stay; `null` clears `ram`, `overflow_max`, `description`, `hostname` or `overflow_device`. The rules of NewTarget hold for the record after the change (422 otherwise)."
)]
pub struct TargetChange {
    #[serde(default)]
    #[schema(value_type = Option<crate::schema::Name>, nullable = false)]
    pub vdisk: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<crate::CacheType>, nullable = false)]
    pub cache: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Selector>, nullable = false)]
    pub version: Option<Selector>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<crate::schema::Ram>)]
    pub ram: Option<Option<u64>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<crate::schema::Cap>)]
    pub overflow_max: Option<Option<u64>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<crate::schema::Description>)]
    pub description: Option<Option<String>>,
    /// MACs to add to the record (`--mac`); in JSON, absent or at least one (409 when
    /// another record has one, naming it).
    #[serde(default, deserialize_with = "non_empty")]
    #[schema(value_type = Vec<crate::schema::Mac>, min_items = 1)]
    pub add_macs: Vec<String>,
    /// MACs to take off the record (`--remove-mac`); in JSON, absent or at least one (409
    /// when the record has not one of them).
    #[serde(default, deserialize_with = "non_empty")]
    #[schema(value_type = Vec<crate::schema::Mac>, min_items = 1)]
    pub remove_macs: Vec<String>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<crate::schema::Hostname>)]
    pub hostname: Option<Option<String>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<crate::schema::OverflowDevice>)]
    pub overflow_device: Option<Option<String>>,
}

impl TargetChange {
    pub fn is_empty(&self) -> bool {
        *self == TargetChange::default()
    }
}

/// A list that is present holds something: an empty one would ask for no change, and a
/// change that asks for none is refused as a whole (`is_empty`), so it is refused here too.
fn non_empty<'de, T: Deserialize<'de>, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<T>, D::Error> {
    let v = Vec::<T>::deserialize(d)?;
    if v.is_empty() {
        return Err(serde::de::Error::custom(
            "an empty list of MACs changes nothing: leave the field out, or name at least one MAC",
        ));
    }
    Ok(v)
}

/// A field that is present (even as `null`) becomes `Some(value)`.
fn present<'de, T: Deserialize<'de>, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// A MAC address that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not a MAC address: give six two-digit hex bytes separated by ':' or '-', e.g. 52:54:00:12:34:56")]
pub struct BadMac {
    pub text: String,
}

/// A MAC address in the one form records keep: six lowercase two-digit hex bytes joined
/// by `:`. Takes `:` or `-` separators (iPXE's `${net0/mac:hexhyp}` gives `-`) and either
/// case; refuses anything else, and the broadcast and all-zero addresses.
pub fn normalize_mac(text: &str) -> Result<String, BadMac> {
    let bad = || BadMac {
        text: text.chars().take(64).collect(),
    };
    let t = text.trim();
    let sep = if t.contains('-') { '-' } else { ':' };
    let parts: Vec<&str> = t.split(sep).collect();
    if parts.len() != 6
        || parts
            .iter()
            .any(|p| p.len() != 2 || !p.bytes().all(|b| b.is_ascii_hexdigit()))
    {
        return Err(bad());
    }
    let mac = parts.join(":").to_ascii_lowercase();
    if mac == "00:00:00:00:00:00" || mac == "ff:ff:ff:ff:ff:ff" {
        return Err(bad());
    }
    Ok(mac)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_take_one_form() {
        for t in [
            "52:54:00:12:34:56",
            "52-54-00-12-34-56",
            "52:54:00:12:34:5A".to_lowercase().as_str(),
            " 52:54:00:12:34:56 ",
        ] {
            assert!(
                normalize_mac(t).unwrap().starts_with("52:54:00:12:34:5"),
                "{t}"
            );
        }
        assert_eq!(
            normalize_mac("52-54-00-AB-CD-EF").unwrap(),
            "52:54:00:ab:cd:ef"
        );
        for t in [
            "",
            "52:54:00:12:34",
            "52:54:00:12:34:56:78",
            "52:54:00:12:34:5g",
            "5254.0012.3456",
            "52:54-00:12:34:56",
            "525:4:00:12:34:56",
            "00:00:00:00:00:00",
            "FF:FF:FF:FF:FF:FF",
        ] {
            let e = normalize_mac(t).unwrap_err().to_string();
            assert!(
                e.contains("is not a MAC address") && e.contains("52:54:00:12:34:56"),
                "{t}: {e}"
            );
        }
    }

    #[test]
    fn a_record_without_macs_loads_and_writes_none() {
        let old = r#"{"format":"vdstream-target","format_version":1,"id":"vm1","vdisk":"win","version":"production","cache":"ram-overflow",
            "created":"2026-01-01T00:00:00Z","created_by":"a","updated":"2026-01-01T00:00:00Z","updated_by":"a","generation":1}"#;
        let r: TargetRecord = serde_json::from_str(old).unwrap();
        assert!(r.macs.is_empty() && r.hostname.is_none() && r.overflow_device.is_none());
        let back = serde_json::to_value(&r).unwrap();
        assert!(
            back.get("macs").is_none() && back.get("hostname").is_none(),
            "{back}"
        );
        let mut r = r;
        r.macs = vec!["52:54:00:12:34:56".into()];
        assert_eq!(
            serde_json::to_value(&r).unwrap()["macs"],
            serde_json::json!(["52:54:00:12:34:56"])
        );
    }

    #[test]
    fn a_mac_list_in_a_change_is_absent_or_holds_one() {
        let change = |j: &str| serde_json::from_str::<TargetChange>(j);
        assert!(change("{}").unwrap().is_empty());
        let c = change(r#"{"add_macs": ["52:54:00:12:34:56"]}"#).unwrap();
        assert_eq!(c.add_macs, ["52:54:00:12:34:56"]);
        for empty in [
            r#"{"add_macs": []}"#,
            r#"{"remove_macs": [], "vdisk": "w"}"#,
        ] {
            let e = change(empty).unwrap_err().to_string();
            assert!(e.contains("an empty list of MACs changes nothing"), "{e}");
        }
    }
}
