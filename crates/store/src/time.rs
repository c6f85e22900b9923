//! Times in metadata and on the command line: RFC 3339 in UTC (`2025-03-01T22:00:00Z`),
//! whole seconds. `--at` also takes an offset (`+01:00`) or a relative `+DURATION`
//! (`+2h`, `+1d12h`, `+90m`). Parsing, formatting and calendar arithmetic are `jiff`'s;
//! this module only fixes the messages. [`Timestamp`] itself is the contract crate's.

use crate::error::{Result, StoreError};

pub use vdstream_contract::time::Timestamp;

/// `--at`: RFC 3339, or `+DURATION` from `now`.
pub fn parse_at(text: &str, now: Timestamp) -> Result<Timestamp> {
    if let Some(rel) = text.strip_prefix('+') {
        return parse_duration(rel).and_then(|secs| now.0.checked_add(secs)).map(Timestamp).ok_or_else(|| {
            StoreError::BadInput(format!("{text:?} is not a duration: use +N with s, m, h, d or w, e.g. +30m, +2h, +1d12h"))
        });
    }
    Timestamp::parse_rfc3339(text).ok_or_else(|| StoreError::BadInput(format!(
        "{text:?} is not a time: use RFC 3339 such as 2025-03-01T22:00:00Z (or with an offset, +01:00), or +DURATION such as +2h")))
}

/// Whole seconds in `2h30m`, `90s`, `1d`, `2w` (jiff's friendly format; a day is 24 hours;
/// months, years and negative spans are refused).
pub fn parse_duration(text: &str) -> Option<i64> {
    let span: jiff::Span = text.parse().ok()?;
    let d = span
        .to_duration(jiff::SpanRelativeTo::days_are_24_hours())
        .ok()?;
    (!d.is_negative()).then(|| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_instants_format_and_parse() {
        for (secs, text) in [
            (0, "1970-01-01T00:00:00Z"),
            (951782400, "2000-02-29T00:00:00Z"),
            (1740866400, "2025-03-01T22:00:00Z"),
        ] {
            assert_eq!(Timestamp(secs).to_string(), text);
            assert_eq!(Timestamp::parse_rfc3339(text), Some(Timestamp(secs)));
        }
        assert_eq!(
            Timestamp::parse_rfc3339("2025-03-01T23:00:00.25+01:00"),
            Some(Timestamp(1740866400))
        );
        assert_eq!(
            Timestamp::parse_rfc3339("2025-03-01t21:30:00-00:30"),
            Some(Timestamp(1740866400))
        );
        for bad in [
            "2025-02-30T00:00:00Z",
            "2025-03-01T24:00:00Z",
            "2025-03-01",
            "2025-03-01T22:00:00",
            "2025-03-01T22:00:00+1",
        ] {
            assert_eq!(Timestamp::parse_rfc3339(bad), None, "{bad}");
        }
    }

    #[test]
    fn relative_times_add_to_now() {
        let now = Timestamp(1000);
        assert_eq!(parse_at("+2h", now).unwrap(), Timestamp(1000 + 7200));
        assert_eq!(parse_at("+1d12h", now).unwrap(), Timestamp(1000 + 129600));
        assert_eq!(parse_at("+2h30m", now).unwrap(), Timestamp(1000 + 9000));
        assert_eq!(parse_at("+1w", now).unwrap(), Timestamp(1000 + 7 * 86400));
        assert_eq!(parse_at("+90s", now).unwrap(), Timestamp(1000 + 90));
        for bad in ["+", "+2", "+2y", "+1mo", "+-2h", "tomorrow"] {
            let e = parse_at(bad, now).unwrap_err().to_string();
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
