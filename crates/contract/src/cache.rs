//! The cache types' names, as PVS names them (see DESIGN.md): what the command line, the
//! config files, target records and the API say. Serialized as the name (`"ram-overflow"`).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The cache types, named as PVS names them (see DESIGN.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheType {
    /// Cache file on the server, per target; gone on the next attach.
    Server,
    /// Cache file on the server that survives restarts.
    ServerPersistent,
    /// Cache file on the target's local disk, 4 KiB granularity; gone on the next attach.
    DeviceDisk,
    /// Cache file on the target's local disk that survives restarts.
    DeviceDiskPersistent,
    /// RAM only, up to a limit; ENOSPC past it.
    DeviceRam,
    /// RAM first, least-recently-used data to an overflow file in 2 MiB units (the default).
    RamOverflow,
    /// No cache: writes go to the vDisk itself, one writer at a time.
    Private,
}

impl CacheType {
    pub const ALL: [CacheType; 7] = [
        CacheType::Server,
        CacheType::ServerPersistent,
        CacheType::DeviceDisk,
        CacheType::DeviceDiskPersistent,
        CacheType::DeviceRam,
        CacheType::RamOverflow,
        CacheType::Private,
    ];

    /// Every type's name, in the order of [`CacheType::ALL`] (what shell completion offers).
    pub const NAMES: [&'static str; 7] = {
        let mut names = [""; 7];
        let mut i = 0;
        while i < names.len() {
            names[i] = Self::ALL[i].name();
            i += 1;
        }
        names
    };

    /// The name used on the command line, in config files and in the API.
    pub const fn name(self) -> &'static str {
        match self {
            CacheType::Server => "server",
            CacheType::ServerPersistent => "server-persistent",
            CacheType::DeviceDisk => "device-disk",
            CacheType::DeviceDiskPersistent => "device-disk-persistent",
            CacheType::DeviceRam => "device-ram",
            CacheType::RamOverflow => "ram-overflow",
            CacheType::Private => "private",
        }
    }

    pub fn is_persistent(self) -> bool {
        matches!(
            self,
            CacheType::ServerPersistent | CacheType::DeviceDiskPersistent
        )
    }
}

impl std::fmt::Display for CacheType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CacheType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        CacheType::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = CacheType::ALL.iter().map(|t| t.name()).collect();
                let hint = did_you_mean(s, &names)
                    .map(|n| format!("did you mean {n:?}? "))
                    .unwrap_or_default();
                format!(
                    "unknown cache type {s:?}: {hint}choose one of {}",
                    names.join(", ")
                )
            })
    }
}

/// The name of `names` closest to `typed`, when it is close enough to be what was meant
/// (Jaro-Winkler similarity of at least 0.8, as clap's own suggestions use).
pub fn did_you_mean<'a>(typed: &str, names: &[&'a str]) -> Option<&'a str> {
    names
        .iter()
        .map(|n| (strsim::jaro_winkler(&typed.to_ascii_lowercase(), n), *n))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, n)| n)
}

impl Serialize for CacheType {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for CacheType {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_reads_back_and_others_are_refused() {
        assert_eq!(CacheType::NAMES, CacheType::ALL.map(CacheType::name));
        for t in CacheType::ALL {
            assert_eq!(t.name().parse::<CacheType>(), Ok(t));
            assert_eq!(
                serde_json::from_value::<CacheType>(serde_json::to_value(t).unwrap()).unwrap(),
                t
            );
        }
        let e = "floppy".parse::<CacheType>().unwrap_err();
        assert!(e.contains("floppy") && e.contains("ram-overflow"), "{e}");
        assert!(!e.contains("did you mean"), "{e}");
        for (typed, meant) in [
            ("ram-overflw", "ram-overflow"),
            ("ramoverflow", "ram-overflow"),
            ("device-disk-persistant", "device-disk-persistent"),
            ("sever", "server"),
            ("Device-RAM", "device-ram"),
        ] {
            let e = typed.parse::<CacheType>().unwrap_err();
            assert!(
                e.contains(&format!("did you mean {meant:?}?")),
                "{typed}: {e}"
            );
        }
    }
}
