//! Human sizes and durations on the command line: `64M`, `1G`, `512k`, `1.5T`, `4096` (bytes). Binary
//! units (K = 1024), because disk sizes are counted that way by qemu-img and nbdkit.
//!
//! One exact parser (the `parse-size` crate: integers, never floating point) for every size
//! flag; a fraction that is not a whole number of bytes (`1.1K`) is refused rather than
//! rounded. One range check, [`parse_ram`], for every `--ram` (`serve-image`,
//! `target add|set|attach`, `size`); [`check_ram_fits_here`] adds this machine's RAM for the
//! commands whose cache lives here (`serve-image`, `target attach`).

use std::time::Duration;

use parse_size::{Config, Error};
pub use vdstream_contract::size::format_size;
use vdstream_store::targets::{check_ram, check_ram_range};
use vdstream_wcache::CacheType;

/// K, M, G, T, P, E (with or without `B`, `iB`) are powers of 1024.
const BINARY: Config = Config::new().with_binary();

/// Parses a size such as `64M`, `1G`, `1GiB`, `512k`, `1.5T` or `4096`, exactly; at most
/// what an `off_t` holds.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let dot_first = t.starts_with('.') && t[1..].starts_with(|c: char| c.is_ascii_digit());
    let t = &if dot_first {
        format!("0{t}")
    } else {
        t.to_owned()
    }; // `.5K`, as before
    let out_of_range = || format!("size {text:?} is out of range");
    let bytes = BINARY.parse_size(t).map_err(|e| match e {
        Error::PosOverflow => out_of_range(),
        _ => format!("unknown unit or malformed number in size {text:?}: use a number with K, M, G or T (e.g. 64M, 1G)"),
    })?;
    // parse-size rounds a fraction of a byte to the nearest byte. Refuse it instead: N.D<unit>
    // is whole bytes exactly when ND<unit> (the dot dropped, exact) is 10^decimals times it.
    let unit_at = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    if let Some(dot) = t[..unit_at].find('.') {
        let decimals = t[dot + 1..unit_at]
            .bytes()
            .filter(u8::is_ascii_digit)
            .count() as u32;
        let scaled = BINARY.parse_size(format!("{}{}", &t[..dot], &t[dot + 1..]));
        if scaled.ok()
            != 10u64
                .checked_pow(decimals)
                .and_then(|p| bytes.checked_mul(p))
        {
            return Err(format!("size {text:?} is not a whole number of bytes: use a smaller unit (e.g. 1536K rather than 1.5001M)"));
        }
    }
    if bytes > i64::MAX as u64 {
        return Err(out_of_range());
    }
    Ok(bytes)
}

/// Parses a `--ram` size and checks its range (0, or 1M to 256G:
/// vdstream_store::targets::check_ram_range, the one range of every --ram).
pub fn parse_ram(text: &str) -> Result<u64, String> {
    let bytes = parse_size(text)?;
    check_ram_range(bytes).map_err(|e| e.to_string())?;
    Ok(bytes)
}

/// This machine's RAM in bytes, if the system says.
pub fn machine_ram() -> Option<u64> {
    // SAFETY: sysconf only reads system configuration values.
    let (pages, page_size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages > 0 && page_size > 0).then(|| (pages as u64).saturating_mul(page_size as u64))
}

/// For a cache in this process: the cache type's rule (vdstream_store::targets::check_ram),
/// and no more than this machine's RAM.
pub fn check_ram_fits_here(cache: CacheType, bytes: u64) -> anyhow::Result<()> {
    check_ram(cache, bytes)?;
    match machine_ram() {
        Some(total) if bytes > total => Err(crate::exit::fail(crate::exit::Kind::Usage, format!(
            "RAM {} is more than this machine has ({}): give a smaller --ram (the cache's RAM is taken as writes arrive)",
            format_size(bytes),
            format_size(total)
        ))),
        _ => Ok(()),
    }
}

/// `500ms`, `30s`, `5m`, `1h`, `1m30s`, or a plain number of seconds (jiff's friendly format).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let plain = !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    let parsed: jiff::SignedDuration = if plain {
        format!("{t}s").parse()
    } else {
        t.parse()
    }
    .map_err(|_| format!("{text:?}: give a duration such as 500ms, 30s, 5m or 1h"))?;
    match Duration::try_from(parsed) {
        Ok(d) if !d.is_zero() && d.as_secs() < 1_000_000_000 => Ok(d),
        _ => Err(format!("{text:?}: give a positive duration")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("1.5k").unwrap(), 1536);
        assert!(parse_size("12 parsecs")
            .unwrap_err()
            .contains("unknown unit"));
        assert!(parse_size("G").is_err());
        assert!(parse_size("-1G").is_err());
        assert_eq!(parse_size(".5K").unwrap(), 512);
        assert_eq!(parse_size("1.5T").unwrap(), 3 << 39);
        assert_eq!(parse_size("1.5e3").unwrap(), 1500, "scientific notation");
        assert_eq!(parse_size("1_024 KiB").unwrap(), 1 << 20, "digit grouping");
        for bad in ["", ".", "1..2K", "1.2.3", " K", "1.5e-1"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sizes_are_exact_never_rounded() {
        // 2^53 + 1 bytes: an f64 cannot hold it.
        assert_eq!(
            parse_size("9007199254740993").unwrap(),
            9_007_199_254_740_993
        );
        assert_eq!(parse_size("0.25k").unwrap(), 256);
        assert!(parse_size("1.1k")
            .unwrap_err()
            .contains("whole number of bytes"));
        assert!(parse_size("0.1")
            .unwrap_err()
            .contains("whole number of bytes"));
        // 2^52 + 1 KiB = 2^62 + 1024 bytes, also beyond an f64.
        assert_eq!(parse_size("4503599627370497K").unwrap(), (1 << 62) + 1024);
        assert_eq!(parse_size("7E").unwrap(), 7 << 60);
        assert!(
            parse_size("8E").unwrap_err().contains("out of range"),
            "2^63 is past off_t"
        );
        assert_eq!(parse_size("8191P").unwrap(), 8191 << 50);
        assert!(parse_size("8192P").unwrap_err().contains("out of range"));
        assert!(parse_size("99999999999999999999999")
            .unwrap_err()
            .contains("out of range"));
    }

    #[test]
    fn ram_has_one_range() {
        assert_eq!(parse_ram("0").unwrap(), 0);
        assert_eq!(parse_ram("1M").unwrap(), 1 << 20);
        assert_eq!(parse_ram("256G").unwrap(), 256 << 30);
        assert!(parse_ram("1").unwrap_err().contains("too small"));
        assert!(parse_ram("1023K").unwrap_err().contains("too small"));
        assert!(parse_ram("1T").unwrap_err().contains("at most 256G"));
        assert!(parse_ram("257G").is_err());
        assert!(parse_ram("12parsecs").unwrap_err().contains("unknown unit"));
        let total = machine_ram().expect("the machine's RAM");
        assert!(
            check_ram_fits_here(CacheType::DeviceRam, total + (1 << 20)).is_err(),
            "more than the machine has"
        );
        assert!(check_ram_fits_here(CacheType::RamOverflow, 1 << 20).is_ok());
        assert!(
            check_ram_fits_here(CacheType::DeviceDisk, 1 << 20).is_err(),
            "device-disk takes no --ram"
        );
    }

    #[test]
    fn sizes_format_round_trip() {
        for s in ["1 GiB", "64 MiB", "512 B", "1.5 KiB"] {
            let n = parse_size(&s.replace(' ', "")).unwrap();
            assert_eq!(format_size(n), s);
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("2").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("1m30s").unwrap(), Duration::from_secs(90));
        for bad in ["", "s", "-1s", "3 days", "0"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }
}
