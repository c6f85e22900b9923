//! Human sizes on the command line: `64M`, `1G`, `512k`, `1.5T`, `4096` (bytes). Binary
//! units (K = 1024), because disk sizes are counted that way by qemu-img and nbdkit.

/// Parses a size such as `64M`, `1G`, `1GiB`, `512k` or `4096`.
pub fn parse_size(text: &str) -> Result<u64, String> {
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
        other => return Err(format!("unknown unit {other:?} in size {text:?}: use a number with K, M, G or T (e.g. 64M, 1G)")),
    };
    let value: f64 = num.parse().map_err(|_| format!("{text:?} is not a size: use a number with K, M, G or T (e.g. 64M, 1G)"))?;
    let bytes = value * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 / 2.0 {
        return Err(format!("size {text:?} is out of range"));
    }
    Ok(bytes.round() as u64)
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
    }

    #[test]
    fn sizes_format_round_trip() {
        for s in ["1 GiB", "64 MiB", "512 B", "1.5 KiB"] {
            let n = parse_size(&s.replace(' ', "")).unwrap();
            assert_eq!(format_size(n), s);
        }
    }
}
