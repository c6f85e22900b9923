//! Times in metadata and on the command line: RFC 3339 in UTC (`2025-03-01T22:00:00Z`),
//! whole seconds. `--at` also takes an offset (`+01:00`) or a relative `+DURATION`
//! (`+2h`, `+1d12h`, `+90m`). Civil-date arithmetic is Howard Hinnant's `days_from_civil`
//! and its inverse, valid for every year from 0 to 9999.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Result, StoreError};

/// Seconds since the Unix epoch, UTC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub i64);

impl Timestamp {
    pub fn now() -> Self {
        let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        Timestamp(d.as_secs() as i64)
    }

    /// Parses RFC 3339 (`YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)`; `t` or a space for `T`).
    pub fn parse_rfc3339(text: &str) -> Option<Self> {
        let b = text.trim().as_bytes();
        if b.len() < 20 {
            return None;
        }
        let num = |r: std::ops::Range<usize>| -> Option<i64> {
            let s = std::str::from_utf8(b.get(r)?).ok()?;
            if s.bytes().all(|c| c.is_ascii_digit()) { s.parse().ok() } else { None }
        };
        let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
        let (h, mi, s) = (num(11..13)?, num(14..16)?, num(17..19)?);
        if b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') || b[13] != b':' || b[16] != b':' {
            return None;
        }
        if !(1..=12).contains(&mo) || d < 1 || d > days_in_month(y, mo) || h > 23 || mi > 59 || s > 60 {
            return None;
        }
        let mut i = 19;
        if b[i] == b'.' {
            i += 1;
            let start = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            if i == start {
                return None;
            }
        }
        let offset = match b.get(i..)? {
            [b'Z' | b'z'] => 0,
            [sign @ (b'+' | b'-'), rest @ ..] if rest.len() == 5 && rest[2] == b':' => {
                let oh = num(i + 1..i + 3)?;
                let om = num(i + 4..i + 6)?;
                if oh > 23 || om > 59 {
                    return None;
                }
                let o = oh * 3600 + om * 60;
                if *sign == b'+' { o } else { -o }
            }
            _ => return None,
        };
        Some(Timestamp(days_from_civil(y, mo, d) * 86400 + h * 3600 + mi * 60 + s.min(59) - offset))
    }

    /// `--at`: RFC 3339, or `+DURATION` from `now`.
    pub fn parse_at(text: &str, now: Timestamp) -> Result<Self> {
        if let Some(rel) = text.strip_prefix('+') {
            return parse_duration(rel).map(|secs| Timestamp(now.0 + secs)).ok_or_else(|| StoreError::BadInput(format!(
                "{text:?} is not a duration: use +N with s, m, h, d or w, e.g. +30m, +2h, +1d12h")));
        }
        Self::parse_rfc3339(text).ok_or_else(|| StoreError::BadInput(format!(
            "{text:?} is not a time: use RFC 3339 such as 2025-03-01T22:00:00Z (or with an offset, +01:00), or +DURATION such as +2h")))
    }
}

/// Seconds in `2h30m`, `90s`, `1d`, `2w` (units s, m, h, d, w; at least one part).
pub fn parse_duration(text: &str) -> Option<i64> {
    let mut total: i64 = 0;
    let mut digits = String::new();
    let mut parts = 0;
    for c in text.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86400,
            'w' => 7 * 86400,
            _ => return None,
        };
        let n: i64 = digits.parse().ok()?;
        total = total.checked_add(n.checked_mul(unit)?)?;
        digits.clear();
        parts += 1;
    }
    if !digits.is_empty() || parts == 0 {
        return None;
    }
    Some(total)
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if is_leap(y) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146097 + doe - 719468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (days, secs) = (self.0.div_euclid(86400), self.0.rem_euclid(86400));
        let (y, m, d) = civil_from_days(days);
        write!(f, "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", secs / 3600, secs % 3600 / 60, secs % 60)
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
        Timestamp::parse_rfc3339(&text).ok_or_else(|| serde::de::Error::custom(format!("{text:?} is not an RFC 3339 time")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_instants_format_and_parse() {
        for (secs, text) in [(0, "1970-01-01T00:00:00Z"), (951782400, "2000-02-29T00:00:00Z"), (1740866400, "2025-03-01T22:00:00Z")] {
            assert_eq!(Timestamp(secs).to_string(), text);
            assert_eq!(Timestamp::parse_rfc3339(text), Some(Timestamp(secs)));
        }
        assert_eq!(Timestamp::parse_rfc3339("2025-03-01T23:00:00.25+01:00"), Some(Timestamp(1740866400)));
        assert_eq!(Timestamp::parse_rfc3339("2025-03-01t21:30:00-00:30"), Some(Timestamp(1740866400)));
        for bad in ["2025-02-30T00:00:00Z", "2025-03-01T24:00:00Z", "2025-03-01", "2025-03-01T22:00:00", "2025-03-01T22:00:00+1"] {
            assert_eq!(Timestamp::parse_rfc3339(bad), None, "{bad}");
        }
    }

    #[test]
    fn relative_times_add_to_now() {
        let now = Timestamp(1000);
        assert_eq!(Timestamp::parse_at("+2h", now).unwrap(), Timestamp(1000 + 7200));
        assert_eq!(Timestamp::parse_at("+1d12h", now).unwrap(), Timestamp(1000 + 129600));
        for bad in ["+", "+2", "+2y", "tomorrow"] {
            let e = Timestamp::parse_at(bad, now).unwrap_err().to_string();
            assert!(e.contains("+2h"), "{bad}: {e}");
        }
    }

    proptest::proptest! {
        #[test]
        fn format_then_parse_is_identity(secs in 0i64..253402300799) {
            let t = Timestamp(secs);
            proptest::prop_assert_eq!(Timestamp::parse_rfc3339(&t.to_string()), Some(t));
        }
    }
}
