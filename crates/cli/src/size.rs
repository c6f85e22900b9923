//! Human sizes on the command line: `64M`, `1G`, `512k`, `1.5T`, `4096` (bytes). Binary
//! units (K = 1024), because disk sizes are counted that way by qemu-img and nbdkit.
//!
//! One exact parser (integers, never floating point: `1.1K` is refused rather than rounded)
//! for every size flag, and one range check, [`parse_ram`], for every `--ram`
//! (`serve-image`, `target add|set|attach`, `size`); [`check_ram_fits_here`] adds this
//! machine's RAM for the commands whose cache lives here (`serve-image`, `target attach`).

use vdstream_store::targets::{check_ram, check_ram_range};
use vdstream_wcache::CacheType;

/// Largest size at all: what an `off_t` holds.
const MAX_SIZE: u128 = i64::MAX as u128;

/// Parses a size such as `64M`, `1G`, `1GiB`, `512k`, `1.5T` or `4096`, exactly.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let hint = "use a number with K, M, G or T (e.g. 64M, 1G)";
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        other => return Err(format!("unknown unit {other:?} in size {text:?}: {hint}")),
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    let digits = |d: &str| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit());
    if !(digits(int) || int.is_empty() && digits(frac)) || !(frac.is_empty() || digits(frac)) {
        return Err(format!("{text:?} is not a size: {hint}"));
    }
    if frac.len() > 18 {
        return Err(format!("size {text:?} has more decimals than a byte count needs"));
    }
    let int: u128 = if int.is_empty() { 0 } else { int.parse().map_err(|_| format!("size {text:?} is out of range"))? };
    let frac_value: u128 = if frac.is_empty() { 0 } else { frac.parse().map_err(|_| format!("size {text:?} is out of range"))? };
    let scale = 10u128.pow(frac.len() as u32);
    let unit_bytes = 1u128 << shift;
    let whole = int.checked_mul(unit_bytes).filter(|v| *v <= MAX_SIZE).ok_or_else(|| format!("size {text:?} is out of range"))?;
    let part = frac_value * unit_bytes;
    if part % scale != 0 {
        return Err(format!("size {text:?} is not a whole number of bytes: use a smaller unit (e.g. 1536K rather than 1.5001M)"));
    }
    let bytes = whole + part / scale;
    if bytes > MAX_SIZE {
        return Err(format!("size {text:?} is out of range"));
    }
    Ok(bytes as u64)
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
    let (pages, page_size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
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

/// Formats bytes the way `parse_size` reads them, e.g. `1 GiB`, `64 MiB`, `4096 B`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = "B";
    for u in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = u;
    }
    if unit == "B" {
        format!("{bytes} B")
    } else if value.fract() == 0.0 {
        format!("{value:.0} {unit}")
    } else {
        format!("{value:.1} {unit}")
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
        assert!(parse_size("12 parsecs").unwrap_err().contains("unknown unit"));
        assert!(parse_size("G").is_err());
        assert!(parse_size("-1G").is_err());
        assert_eq!(parse_size(".5K").unwrap(), 512);
        assert_eq!(parse_size("1.5T").unwrap(), 3 << 39);
        for bad in ["", ".", "1..2K", "1.2.3", "1e3", " K"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sizes_are_exact_never_rounded() {
        // 2^53 + 1 bytes: an f64 cannot hold it.
        assert_eq!(parse_size("9007199254740993").unwrap(), 9_007_199_254_740_993);
        assert_eq!(parse_size("0.25k").unwrap(), 256);
        assert!(parse_size("1.1k").unwrap_err().contains("whole number of bytes"));
        assert!(parse_size("0.1").unwrap_err().contains("whole number of bytes"));
        assert!(parse_size("8E").is_err(), "exa is not a unit");
        assert_eq!(parse_size("8191P").unwrap(), 8191 << 50);
        assert!(parse_size("8192P").unwrap_err().contains("out of range"));
        assert!(parse_size("99999999999999999999999").unwrap_err().contains("out of range"));
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
        assert!(check_ram_fits_here(CacheType::DeviceRam, total + (1 << 20)).is_err(), "more than the machine has");
        assert!(check_ram_fits_here(CacheType::RamOverflow, 1 << 20).is_ok());
        assert!(check_ram_fits_here(CacheType::DeviceDisk, 1 << 20).is_err(), "device-disk takes no --ram");
    }

    #[test]
    fn sizes_format_round_trip() {
        for s in ["1 GiB", "64 MiB", "512 B", "1.5 KiB"] {
            let n = parse_size(&s.replace(' ', "")).unwrap();
            assert_eq!(format_size(n), s);
        }
    }
}
