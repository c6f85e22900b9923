//! Sizes as people read them: `1 GiB`, `64 MiB`, `4096 B`, in binary units (K = 1024), as
//! the command line's size flags take them (`vdstream`'s `parse_size`).

/// Formats bytes the way the command line's sizes are read (binary units), e.g. `1 GiB`,
/// `64 MiB`, `4096 B`.
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
