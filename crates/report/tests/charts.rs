//! The charts as a reader sees them: well-formed SVG whatever the input, bars and points
//! placed in the order of their values, names and labels present, nothing drawn at NaN.

use vdstream_report::svg::{line_chart_with, LineOptions};
use vdstream_report::{bar_chart, line_chart, Series};

/// The first series' colour (and the bars').
const BLUE: &str = "#0072B2";

fn parse(svg: &str) -> roxmltree::Document<'_> {
    roxmltree::Document::parse(svg).unwrap_or_else(|e| panic!("not well-formed XML: {e}\n{svg}"))
}

fn attr(n: &roxmltree::Node, name: &str) -> f64 {
    n.attribute(name)
        .unwrap_or_else(|| panic!("no {name}"))
        .parse()
        .unwrap()
}

/// Elements `tag` filled with `fill`.
fn filled<'a>(
    doc: &'a roxmltree::Document<'a>,
    tag: &str,
    fill: &str,
) -> Vec<roxmltree::Node<'a, 'a>> {
    doc.descendants()
        .filter(|n| n.has_tag_name(tag) && n.attribute("fill") == Some(fill))
        .collect()
}

/// The drawn lines (not the legend's) of the first series.
fn lines<'a>(doc: &'a roxmltree::Document<'a>) -> usize {
    doc.descendants()
        .filter(|n| {
            n.has_tag_name("polyline")
                && n.attribute("stroke") == Some(BLUE)
                && n.attribute("stroke-width") == Some("2")
        })
        .count()
}

fn texts<'a>(doc: &'a roxmltree::Document<'a>) -> Vec<&'a str> {
    doc.descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text())
        .map(str::trim)
        .collect()
}

fn bars(v: &[(&str, f64)]) -> Vec<(String, f64)> {
    v.iter().map(|(n, x)| (n.to_string(), *x)).collect()
}

#[test]
fn bar_heights_grow_with_values_and_bars_are_labelled() {
    let values = [
        ("small", 300.0),
        ("zero", 0.0),
        ("big", 41_234.0),
        ("mid", 9_000.0),
    ];
    let svg = bar_chart("IOPS per cache type", "IOPS", &bars(&values));
    let doc = parse(&svg);
    let rects = filled(&doc, "rect", BLUE);
    assert_eq!(rects.len(), 4);
    let heights: Vec<f64> = rects.iter().map(|r| attr(r, "height")).collect();
    let bottoms: Vec<f64> = rects
        .iter()
        .map(|r| attr(r, "y") + attr(r, "height"))
        .collect();
    for (i, a) in values.iter().enumerate() {
        for (j, b) in values.iter().enumerate() {
            if a.1 < b.1 {
                assert!(heights[i] < heights[j], "{a:?} drawn no shorter than {b:?}");
            }
        }
        assert!(
            (bottoms[i] - bottoms[0]).abs() <= 1.0,
            "bars share a baseline"
        );
    }
    assert_eq!(heights[1], 0.0);
    let xs: Vec<f64> = rects.iter().map(|r| attr(r, "x")).collect();
    assert!(
        xs.windows(2).all(|w| w[0] < w[1]),
        "bars go left to right in the given order"
    );
    let t = texts(&doc);
    for label in [
        "IOPS per cache type",
        "IOPS",
        "41.2k",
        "9000",
        "300",
        "small",
        "big",
        "mid",
    ] {
        assert!(t.contains(&label), "{label:?} in {t:?}");
    }
}

#[test]
fn long_bar_names_wrap_at_spaces_and_long_legends_are_cut() {
    let six = [
        ("raw disk", 5.0),
        ("ram-overflow (fits)", 4.0),
        ("ram-overflow (overflows)", 3.0),
        ("device-ram", 4.0),
        ("device-disk", 1.0),
        ("server", 1.0),
    ];
    let svg = bar_chart("t", "IOPS", &bars(&six));
    let doc = parse(&svg);
    let t = texts(&doc);
    assert!(
        t.contains(&"ram-overflow") && t.contains(&"(overflows)"),
        "{t:?}"
    );
    for n in doc.descendants().filter(|n| n.has_tag_name("text")) {
        assert!(
            attr(&n, "y") < 420.0,
            "label {:?} is inside the canvas",
            n.text()
        );
    }
    let long = "a series name much longer than any legend could hold on the right";
    let svg = line_chart(
        "t",
        "s",
        "IOPS",
        &[
            Series {
                name: long.into(),
                points: vec![(0.0, 1.0), (1.0, 2.0)],
            },
            Series {
                name: "b".into(),
                points: vec![(0.0, 2.0)],
            },
        ],
    );
    let doc = parse(&svg);
    let legend = texts(&doc)
        .into_iter()
        .find(|t| t.starts_with("a series"))
        .unwrap();
    assert!(
        legend.ends_with('…') && legend.chars().count() < 40,
        "{legend}"
    );
}

#[test]
fn text_is_escaped() {
    let svg = bar_chart(
        "<&> \"t\"",
        "y & <z>",
        &bars(&[("a</text>", 1.0), ("\u{0}b\u{1}", 2.0)]),
    );
    let doc = parse(&svg);
    let t = texts(&doc);
    assert!(
        t.contains(&"<&> \"t\"")
            && t.contains(&"y & <z>")
            && t.contains(&"a</text>")
            && t.contains(&"b"),
        "{t:?}"
    );
}

#[test]
fn nan_empty_and_zero_inputs_still_render() {
    for svg in [
        bar_chart("empty", "y", &[]),
        bar_chart("zeros", "y", &bars(&[("a", 0.0), ("b", 0.0)])),
        bar_chart(
            "nan",
            "y",
            &bars(&[("a", f64::NAN), ("b", f64::INFINITY), ("c", -2.0)]),
        ),
        line_chart("empty", "x", "y", &[]),
        line_chart(
            "no points",
            "x",
            "y",
            &[Series {
                name: "s".into(),
                points: vec![],
            }],
        ),
        line_chart(
            "nan",
            "x",
            "y",
            &[Series {
                name: "s".into(),
                points: vec![(0.0, f64::NAN), (1.0, 0.0), (f64::INFINITY, 2.0)],
            }],
        ),
        line_chart(
            "one point",
            "x",
            "y",
            &[Series {
                name: String::new(),
                points: vec![(5.0, 5.0)],
            }],
        ),
        line_chart_with(
            "log",
            "x",
            "y",
            &[Series {
                name: "s".into(),
                points: vec![(0.0, 1.0)],
            }],
            LineOptions {
                x_log: true,
                ..LineOptions::default()
            },
        ),
    ] {
        let doc = parse(&svg);
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        assert!(doc.root_element().has_tag_name("svg"));
        assert_eq!(
            (
                attr(&doc.root_element(), "width"),
                attr(&doc.root_element(), "height")
            ),
            (720.0, 420.0)
        );
    }
    assert!(bar_chart("empty", "y", &[]).contains("no data"));
    assert!(line_chart("empty", "x", "y", &[]).contains("no data"));
    assert!(bar_chart("nan", "y", &bars(&[("a", f64::NAN)])).contains("n/a"));
    let svg = bar_chart("neg", "y", &bars(&[("a", -2.0), ("b", 2.0)]));
    let doc = parse(&svg);
    let rects = filled(&doc, "rect", BLUE);
    assert!((attr(&rects[0], "height") - attr(&rects[1], "height")).abs() <= 1.0);
    assert!(
        attr(&rects[0], "y") > attr(&rects[1], "y"),
        "a negative bar hangs below the zero line"
    );
}

#[test]
fn points_map_monotonically_and_series_get_a_legend() {
    let series = vec![
        Series {
            name: "ram-overflow".into(),
            points: vec![(64.0, 900.0), (256.0, 400.0), (1024.0, 50.0), (4096.0, 0.0)],
        },
        Series {
            name: "device-ram".into(),
            points: vec![(64.0, 10.0), (256.0, 10.0), (1024.0, 10.0), (4096.0, 10.0)],
        },
    ];
    for options in [
        LineOptions::default(),
        LineOptions {
            x_log: true,
            ..LineOptions::default()
        },
    ] {
        let svg = line_chart_with("Storage IOPS", "RAM (MiB)", "IOPS", &series, options);
        let doc = parse(&svg);
        let first: Vec<(f64, f64)> = filled(&doc, "circle", BLUE)
            .iter()
            .map(|p| (attr(p, "cx"), attr(p, "cy")))
            .collect();
        assert_eq!(first.len(), 4);
        assert!(
            first.windows(2).all(|w| w[0].0 < w[1].0),
            "x grows to the right: {first:?}"
        );
        assert!(
            first.windows(2).all(|w| w[0].1 < w[1].1),
            "falling y goes down the page: {first:?}"
        );
        assert_eq!(lines(&doc), 1);
        let t = texts(&doc);
        for s in &series {
            assert!(t.contains(&s.name.as_str()), "legend names {}", s.name);
        }
        for label in ["Storage IOPS", "RAM (MiB)", "IOPS"] {
            assert!(t.contains(&label), "{label:?} in {t:?}");
        }
    }
    // On a log axis equal ratios are equal distances.
    let svg = line_chart_with(
        "log",
        "x",
        "y",
        &series[..1],
        LineOptions {
            x_log: true,
            ..LineOptions::default()
        },
    );
    let doc = parse(&svg);
    let cx: Vec<f64> = filled(&doc, "circle", BLUE)
        .iter()
        .map(|p| attr(p, "cx"))
        .collect();
    assert!(((cx[1] - cx[0]) - (cx[3] - cx[2])).abs() <= 1.0, "{cx:?}");
}

#[test]
fn a_log_y_axis_keeps_fast_and_slow_series_apart() {
    // Latency: one series at hundreds of milliseconds, one at hundreds of microseconds.
    let series = vec![
        Series {
            name: "steady".into(),
            points: vec![(0.5, 500.0), (1.0, 400.0), (1.5, 0.0)],
        },
        Series {
            name: "slow start".into(),
            points: vec![(0.5, 300_000.0), (1.0, 30_000.0), (1.5, 3_000.0)],
        },
    ];
    let options = LineOptions {
        y_log: true,
        ..LineOptions::default()
    };
    let svg = line_chart_with("Mean latency", "seconds", "latency (µs)", &series, options);
    let doc = parse(&svg);
    assert_eq!(
        filled(&doc, "circle", BLUE).len(),
        2,
        "the zero cannot be placed on a log axis and is skipped"
    );
    let slow: Vec<f64> = filled(&doc, "circle", "#D55E00")
        .iter()
        .map(|p| attr(p, "cy"))
        .collect();
    // Equal ratios are equal distances, and higher values sit higher on the page.
    assert!(
        ((slow[1] - slow[0]) - (slow[2] - slow[1])).abs() <= 1.0,
        "{slow:?}"
    );
    assert!(slow[0] < slow[1] && slow[1] < slow[2], "{slow:?}");
    let steady: Vec<f64> = filled(&doc, "circle", BLUE)
        .iter()
        .map(|p| attr(p, "cy"))
        .collect();
    assert!(
        steady[0] - slow[2] > 20.0,
        "log: 3000 µs and 500 µs are far apart: {steady:?} {slow:?}"
    );
    // On a linear axis the steady series sits within a few pixels of the bottom.
    let linear = line_chart("Mean latency", "seconds", "latency (µs)", &series);
    let doc = parse(&linear);
    let lin: Vec<f64> = filled(&doc, "circle", BLUE)
        .iter()
        .map(|p| attr(p, "cy"))
        .collect();
    assert!((lin[0] - lin[2]).abs() < 2.0, "linear: {lin:?}");
    let t = texts(&parse(&svg)).join(" ");
    assert!(
        t.contains("100k") && t.contains("1000") && t.contains("1M"),
        "power-of-ten ticks, each in its own unit: {t}"
    );
}

#[test]
fn a_line_breaks_at_a_point_it_cannot_place() {
    let s = Series {
        name: "s".into(),
        points: vec![
            (0.0, 1.0),
            (1.0, 2.0),
            (2.0, f64::NAN),
            (3.0, 1.0),
            (4.0, 0.0),
        ],
    };
    let svg = line_chart("gap", "x", "y", &[s]);
    let doc = parse(&svg);
    assert_eq!(lines(&doc), 2);
    assert_eq!(filled(&doc, "circle", BLUE).len(), 4);
}
