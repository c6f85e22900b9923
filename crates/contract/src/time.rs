//! Times in the documents components exchange: RFC 3339 in UTC (`2025-03-01T22:00:00Z`),
//! whole seconds. Parsing, formatting and calendar arithmetic are `jiff`'s; this module
//! only fixes the format (whole seconds, `Z`).

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Seconds since the Unix epoch, UTC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub i64);

impl Timestamp {
    pub fn now() -> Self {
        Timestamp(jiff::Timestamp::now().as_second())
    }

    /// Parses RFC 3339 (`YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)`); fractions are dropped.
    pub fn parse_rfc3339(text: &str) -> Option<Self> {
        text.trim()
            .parse::<jiff::Timestamp>()
            .ok()
            .map(|t| Timestamp(t.as_second()))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match jiff::Timestamp::from_second(self.0) {
            Ok(t) => write!(f, "{t}"),
            Err(_) => write!(f, "@{}", self.0),
        }
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Timestamp::parse_rfc3339(&text)
            .ok_or_else(|| serde::de::Error::custom(format!("{text:?} is not an RFC 3339 time")))
    }
}

/// Who did something, and when (a promotion, an approval).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Stamp {
    pub time: Timestamp,
    pub by: String,
}
