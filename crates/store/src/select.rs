//! Which layer a target gets: the core rule of the store, a pure function of the metadata
//! and the time.
//!
//! | selector      | gets                                                                    |
//! |---------------|-------------------------------------------------------------------------|
//! | `production`  | the override if set; else the newest production version whose           |
//! |               | `scheduled_at` (if any) has passed; else the base                       |
//! | `test`        | the newest test or production version (scheduled or not); else the base |
//! | `maintenance` | the version in maintenance (an error if there is none)                  |
//! | `latest`      | the newest version of any access; else the base                         |
//! | `N`, `base`   | that version, the base                                                  |
//!
//! A target's layer is chosen once, when it connects; later changes to the metadata do
//! not move it (see `open.rs`).

use std::fmt;

use crate::error::{Result, StoreError};
use crate::meta::{Access, VdiskMeta};
use crate::time::Timestamp;
pub use vdstream_contract::Selector;

/// One layer of a vDisk.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Layer {
    Base,
    Version(u32),
}

impl fmt::Display for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Layer::Base => f.write_str("base"),
            Layer::Version(n) => write!(f, "version {n}"),
        }
    }
}

impl Layer {
    /// `base` or the number, as in `NAME@V`.
    pub fn tag(self) -> String {
        match self {
            Layer::Base => "base".into(),
            Layer::Version(n) => n.to_string(),
        }
    }
}

/// Whether production targets see a version of this access and schedule at `now`.
pub fn released(access: Access, scheduled_at: Option<Timestamp>, now: Timestamp) -> bool {
    access == Access::Production && scheduled_at.is_none_or(|t| t <= now)
}

/// The layer `sel` picks in `meta` at `now`.
pub fn select(meta: &VdiskMeta, sel: Selector, now: Timestamp) -> Result<Layer> {
    let newest = |keep: &dyn Fn(&crate::meta::Version) -> bool| {
        meta.versions
            .iter()
            .rev()
            .find(|v| keep(v))
            .map_or(Layer::Base, |v| Layer::Version(v.number))
    };
    Ok(match sel {
        Selector::Base => Layer::Base,
        Selector::Production => match meta.override_version {
            Some(n) => Layer::Version(n),
            None => newest(&|v| released(v.access, v.scheduled_at, now)),
        },
        Selector::Test => newest(&|v| v.access >= Access::Test),
        Selector::Latest => newest(&|_| true),
        Selector::Maintenance => match meta.maintenance() {
            Some(v) => Layer::Version(v.number),
            None => {
                return Err(StoreError::Refused(format!(
                "vDisk {} has no version in maintenance: make one with `vdstream version new {}`",
                meta.name, meta.name
            )))
            }
        },
        Selector::Number(n) => match meta.version(n) {
            Some(_) => Layer::Version(n),
            None => {
                let have: Vec<String> =
                    meta.versions.iter().map(|v| v.number.to_string()).collect();
                return Err(StoreError::UnknownVersion {
                    vdisk: meta.name.clone(),
                    version: n,
                    have: if have.is_empty() {
                        "none (only the base)".to_string()
                    } else {
                        have.join(", ")
                    },
                });
            }
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::tests::sample;

    const NOW: Timestamp = Timestamp(1_750_000_000);

    #[test]
    fn each_role_gets_its_layer() {
        let m = sample(); // 1 production, 2 test, 3 maintenance
        assert_eq!(
            select(&m, Selector::Production, NOW).unwrap(),
            Layer::Version(1)
        );
        assert_eq!(select(&m, Selector::Test, NOW).unwrap(), Layer::Version(2));
        assert_eq!(
            select(&m, Selector::Maintenance, NOW).unwrap(),
            Layer::Version(3)
        );
        assert_eq!(
            select(&m, Selector::Latest, NOW).unwrap(),
            Layer::Version(3)
        );
        assert_eq!(select(&m, Selector::Base, NOW).unwrap(), Layer::Base);
        assert_eq!(
            select(&m, Selector::Number(2), NOW).unwrap(),
            Layer::Version(2)
        );
        let e = select(&m, Selector::Number(9), NOW)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no version 9") && e.contains("1, 2, 3"), "{e}");
    }

    #[test]
    fn schedule_and_override_steer_production() {
        let mut m = sample();
        m.versions[1].access = Access::Production;
        m.versions[1].scheduled_at = Some(Timestamp(NOW.0 + 60));
        assert_eq!(
            select(&m, Selector::Production, NOW).unwrap(),
            Layer::Version(1),
            "not yet"
        );
        assert_eq!(
            select(&m, Selector::Production, Timestamp(NOW.0 + 60)).unwrap(),
            Layer::Version(2),
            "due"
        );
        assert_eq!(
            select(&m, Selector::Test, NOW).unwrap(),
            Layer::Version(2),
            "test sees scheduled versions"
        );
        m.override_version = Some(1);
        assert_eq!(
            select(&m, Selector::Production, Timestamp(NOW.0 + 60)).unwrap(),
            Layer::Version(1),
            "override wins"
        );
    }

    #[test]
    fn nothing_released_means_the_base() {
        let mut m = sample();
        m.versions.truncate(2);
        m.versions[0].access = Access::Test;
        assert_eq!(select(&m, Selector::Production, NOW).unwrap(), Layer::Base);
        m.versions.clear();
        assert_eq!(select(&m, Selector::Test, NOW).unwrap(), Layer::Base);
        assert_eq!(select(&m, Selector::Latest, NOW).unwrap(), Layer::Base);
        let e = select(&m, Selector::Maintenance, NOW)
            .unwrap_err()
            .to_string();
        assert!(e.contains("version new w"), "{e}");
    }
}
