//! Renders charts with a real SVG renderer, `rsvg-convert` (Debian: librsvg2-bin), and
//! checks that it accepts them and draws a PNG of the canvas size. Skipped, with a note,
//! when `rsvg-convert` is not installed.

use std::process::Command;

use vdstream_report::{bar_chart, line_chart, Series};

fn rasterize(name: &str, svg: &str) -> Option<Vec<u8>> {
    if Command::new("rsvg-convert")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("SKIP: rsvg-convert is not installed (Debian: librsvg2-bin)");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let svg_path = dir.path().join(format!("{name}.svg"));
    let png_path = dir.path().join(format!("{name}.png"));
    std::fs::write(&svg_path, svg).unwrap();
    let out = Command::new("rsvg-convert")
        .arg("-o")
        .arg(&png_path)
        .arg(&svg_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "rsvg-convert refused {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let png = std::fs::read(&png_path).unwrap();
    // Keep a copy beside the build output, to look at by eye.
    let _ = std::fs::write(
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}.png")),
        &png,
    );
    Some(png)
}

/// Width and height from a PNG's IHDR chunk.
fn png_size(png: &[u8]) -> (u32, u32) {
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    assert_eq!(&png[12..16], b"IHDR");
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    (be(&png[16..20]), be(&png[20..24]))
}

#[test]
fn rsvg_convert_renders_a_bar_chart_and_a_line_chart() {
    let bars: Vec<(String, f64)> = [
        ("raw disk", 9_800.0),
        ("ram-overflow (fits)", 41_500.0),
        ("ram-overflow (overflows)", 30_100.0),
        ("device-ram", 40_900.0),
        ("device-disk", 8_900.0),
        ("server", 7_200.0),
    ]
    .iter()
    .map(|(n, v)| (n.to_string(), *v))
    .collect();
    if let Some(png) = rasterize(
        "bars",
        &bar_chart("IOPS per cache type <VDI profile>", "IOPS", &bars),
    ) {
        assert_eq!(png_size(&png), (720, 420));
    }
    let series = vec![
        Series {
            name: "ram-overflow".into(),
            points: vec![
                (64.0, 1900.0),
                (256.0, 800.0),
                (1024.0, 120.0),
                (4096.0, 0.0),
            ],
        },
        Series {
            name: "device-ram".into(),
            points: vec![(64.0, 0.0), (256.0, 0.0), (1024.0, 0.0), (4096.0, 0.0)],
        },
        Series {
            name: "device-disk".into(),
            points: vec![
                (64.0, 2400.0),
                (256.0, 2400.0),
                (1024.0, 2400.0),
                (4096.0, 2400.0),
            ],
        },
    ];
    if let Some(png) = rasterize(
        "lines",
        &line_chart(
            "Storage IOPS by RAM size",
            "RAM (MiB)",
            "storage IOPS",
            &series,
        ),
    ) {
        assert_eq!(png_size(&png), (720, 420));
    }
}
