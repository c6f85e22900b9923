//! Charts for the reports, drawn by `plotters` on its SVG backend: a bar chart and a line
//! chart, each one whole 720×420 `<svg>` document (no scripts, no external fonts or styles).
//! This module only chooses ranges, colours and labels; plotters lays out and writes.
//!
//! Invariants:
//! - The output is well-formed XML whatever the input: plotters escapes markup characters
//!   and [`clean`] drops the characters XML 1.0 forbids; no coordinate is `NaN` or infinite.
//! - The value axis of a bar chart always includes 0, so that bar heights compare honestly;
//!   a linear y axis of a line chart includes 0 too. A logarithmic axis runs from a power of
//!   ten to a power of ten and skips the points it cannot place (≤ 0).
//! - Non-finite values are never drawn: a bar shows `n/a`, a line breaks at the point. With
//!   nothing to draw at all the chart still renders, with axes and "no data".

use std::error::Error;
use std::ops::Range;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

const SIZE: (u32, u32) = (720, 420);
const FONT: &str = "sans-serif";
/// Widest legend (line, gap and name); longer names are cut with an ellipsis.
const LEGEND_MAX_W: u32 = 260;
/// Rough width of one character of the legend font, for the legend's room only.
const CHAR_W: u32 = 7;
/// Colours of series, in order (colour-blind friendly, after Okabe & Ito).
const PALETTE: [RGBColor; 8] = [
    RGBColor(0x00, 0x72, 0xb2),
    RGBColor(0xd5, 0x5e, 0x00),
    RGBColor(0x00, 0x9e, 0x73),
    RGBColor(0xcc, 0x79, 0xa7),
    RGBColor(0xe6, 0x9f, 0x00),
    RGBColor(0x56, 0xb4, 0xe9),
    RGBColor(0x00, 0x00, 0x00),
    RGBColor(0xf0, 0xe4, 0x42),
];

/// One line of a line chart: a name for the legend and its (x, y) points, drawn in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// How a line chart draws its axes; [`line_chart`] uses the default (both linear).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LineOptions {
    /// A logarithmic x axis, for sizes spanning decades such as RAM sizes from 64 MiB to
    /// 4 GiB. Points with x ≤ 0 cannot be placed on it and are skipped.
    pub x_log: bool,
    /// A logarithmic y axis, for values spanning decades such as latencies where one series
    /// starts at hundreds of milliseconds and another runs at hundreds of microseconds.
    /// Points with y ≤ 0 are skipped.
    pub y_log: bool,
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
type Drawn = Result<(), Box<dyn Error>>;

/// A bar chart of named values, one bar each, as a whole `<svg>` document.
///
/// ```
/// let svg = vdstream_report::bar_chart("IOPS per cache type", "IOPS",
///     &[("device-disk".to_string(), 9_000.0), ("ram-overflow".to_string(), 41_000.0)]);
/// assert!(svg.contains("<svg") && svg.contains("41k"));
/// ```
pub fn bar_chart(title: &str, y_label: &str, bars: &[(String, f64)]) -> String {
    let values: Vec<f64> = bars.iter().map(|b| b.1).filter(|v| v.is_finite()).collect();
    render(|root| {
        let n = bars.len().max(1);
        let mut chart = ChartBuilder::on(root)
            .caption(clean(title), (FONT, 20))
            .margin(12)
            .x_label_area_size(56)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..n as f64, including_zero(&values, 0.1))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_label_formatter(&|_| String::new()) // names are drawn below, wrapped
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15))
            .y_desc(clean(y_label))
            .y_label_formatter(&|v| format_value(*v))
            .draw()?;
        chart.draw_series(
            bars.iter()
                .enumerate()
                .filter(|(_, b)| b.1.is_finite())
                .map(|(i, b)| {
                    Rectangle::new(
                        [(i as f64 + 0.15, 0.0), (i as f64 + 0.85, b.1)],
                        PALETTE[0].filled(),
                    )
                }),
        )?;
        let label = |text: String, at: f64, above: bool| {
            let pos = Pos::new(HPos::Center, if above { VPos::Bottom } else { VPos::Top });
            (text, at, TextStyle::from((FONT, 15)).pos(pos))
        };
        chart.draw_series(bars.iter().enumerate().map(|(i, b)| {
            let (text, at, style) = if b.1.is_finite() {
                label(format_value(b.1), b.1, b.1 >= 0.0)
            } else {
                label("n/a".into(), 0.0, true)
            };
            Text::new(text, (i as f64 + 0.5, at), style)
        }))?;
        // Names under their bars, broken at spaces into lines that fit a bar's slot.
        let fits = (chart.plotting_area().dim_in_pixel().0 / n as u32 / CHAR_W).max(3) as usize;
        let y0 = chart.plotting_area().get_pixel_range().1.end + 8;
        for (i, (name, _)) in bars.iter().enumerate() {
            let x = chart.backend_coord(&(i as f64 + 0.5, 0.0)).0;
            for (k, line) in label_lines(&clean(name), fits, 3).into_iter().enumerate() {
                let style = TextStyle::from((FONT, 15)).pos(Pos::new(HPos::Center, VPos::Top));
                root.draw(&Text::new(line, (x, y0 + 15 * k as i32), style))?;
            }
        }
        if bars.is_empty() {
            no_data(root)?;
        }
        Ok(())
    })
}

/// A line chart of one or more series on linear axes, as a whole `<svg>` document; a
/// legend names the series when there are several (or one with a name).
pub fn line_chart(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    line_chart_with(title, x_label, y_label, series, LineOptions::default())
}

/// [`line_chart`] with a choice of axes (see [`LineOptions`]).
pub fn line_chart_with(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    options: LineOptions,
) -> String {
    let placeable = |&(x, y): &(f64, f64)| {
        x.is_finite() && y.is_finite() && (!options.x_log || x > 0.0) && (!options.y_log || y > 0.0)
    };
    let xs: Vec<f64> = series
        .iter()
        .flat_map(|s| &s.points)
        .filter(|p| placeable(p))
        .map(|p| p.0)
        .collect();
    let ys: Vec<f64> = series
        .iter()
        .flat_map(|s| &s.points)
        .filter(|p| placeable(p))
        .map(|p| p.1)
        .collect();
    let lines = Lines {
        title,
        x_label,
        y_label,
        series,
        placeable: &placeable,
        empty: xs.is_empty(),
    };
    let (x, y) = (spanning(&xs), including_zero(&ys, 0.05));
    render(|root| match (options.x_log, options.y_log) {
        (false, false) => lines.draw(root, x, y),
        (true, false) => lines.draw(root, decades(&xs).log_scale(), y),
        (false, true) => lines.draw(root, x, decades(&ys).log_scale()),
        (true, true) => lines.draw(root, decades(&xs).log_scale(), decades(&ys).log_scale()),
    })
}

/// What a line chart shows, whatever its axes.
struct Lines<'a> {
    title: &'a str,
    x_label: &'a str,
    y_label: &'a str,
    series: &'a [Series],
    placeable: &'a dyn Fn(&(f64, f64)) -> bool,
    empty: bool,
}

impl Lines<'_> {
    fn draw<X, Y>(&self, root: &Area, x: X, y: Y) -> Drawn
    where
        X: AsRangedCoord<Value = f64>,
        Y: AsRangedCoord<Value = f64>,
        X::CoordDescType: ValueFormatter<f64>,
        Y::CoordDescType: ValueFormatter<f64>,
    {
        let legend = self.series.len() > 1 || self.series.iter().any(|s| !s.name.is_empty());
        let names: Vec<String> = self
            .series
            .iter()
            .enumerate()
            .map(|(i, s)| legend_name(s, i))
            .collect();
        let longest = names
            .iter()
            .map(|n| n.chars().count() as u32)
            .max()
            .unwrap_or(0);
        let legend_w = if legend {
            (longest * CHAR_W + 40).min(LEGEND_MAX_W)
        } else {
            0
        };
        let mut chart = ChartBuilder::on(root)
            .caption(clean(self.title), (FONT, 20))
            .margin(12)
            .margin_right(12 + legend_w)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(x, y)?;
        chart
            .configure_mesh()
            .x_desc(clean(self.x_label))
            .y_desc(clean(self.y_label))
            .x_label_formatter(&|v| format_value(*v))
            .y_label_formatter(&|v| format_value(*v))
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15))
            .draw()?;
        let markers = self.series.iter().map(|s| s.points.len()).sum::<usize>() <= 200;
        for (i, s) in self.series.iter().enumerate() {
            let colour = PALETTE[i % PALETTE.len()];
            // A line breaks wherever a point cannot be placed.
            let runs: Vec<&[(f64, f64)]> = s
                .points
                .split(|p| !(self.placeable)(p))
                .filter(|r| !r.is_empty())
                .collect();
            for run in runs {
                chart.draw_series(LineSeries::new(run.iter().copied(), colour.stroke_width(2)))?;
            }
            if markers {
                chart.draw_series(
                    s.points
                        .iter()
                        .filter(|p| (self.placeable)(p))
                        .map(|&p| Circle::new(p, 3, colour.filled())),
                )?;
            }
        }
        // The legend, right of the plot (plotters' own is drawn, and clipped, inside it).
        let (x0, y0) = (
            chart.plotting_area().get_pixel_range().0.end + 14,
            chart.plotting_area().get_pixel_range().1.start + 8,
        );
        for (i, name) in names.iter().enumerate().filter(|_| legend) {
            let (colour, y) = (PALETTE[i % PALETTE.len()], y0 + 20 * i as i32);
            root.draw(&PathElement::new(
                [(x0, y), (x0 + 18, y)],
                colour.stroke_width(3),
            ))?;
            root.draw(&Text::new(
                name.clone(),
                (x0 + 24, y),
                TextStyle::from((FONT, 15)).pos(Pos::new(HPos::Left, VPos::Center)),
            ))?;
        }
        if self.empty {
            no_data(root)?;
        }
        Ok(())
    }
}

/// Draws into an SVG string. Drawing into a string does not fail; should plotters refuse a
/// shape, the chart keeps what was drawn (the backend closes every element it opened).
fn render(draw: impl FnOnce(&Area) -> Drawn) -> String {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        let _ = root
            .fill(&WHITE)
            .map_err(Into::into)
            .and_then(|()| draw(&root))
            .and_then(|()| Ok(root.present()?));
    }
    svg
}

fn no_data(root: &Area) -> Drawn {
    let style = (FONT, 16)
        .into_font()
        .color(&RGBColor(0x88, 0x88, 0x88))
        .pos(Pos::new(HPos::Center, VPos::Center));
    root.draw(&Text::new(
        "no data",
        (SIZE.0 as i32 / 2, SIZE.1 as i32 / 2),
        style,
    ))?;
    Ok(())
}

/// A linear range over `values` that includes 0, with `headroom` (a fraction) beyond the
/// data on the side(s) it extends to, for the value labels.
fn including_zero(values: &[f64], headroom: f64) -> Range<f64> {
    let lo = values.iter().copied().fold(0.0, f64::min);
    let hi = values.iter().copied().fold(0.0, f64::max);
    if lo == hi {
        return 0.0..1.0;
    }
    let pad = (hi - lo) * headroom;
    (if lo < 0.0 { lo - pad } else { lo })..(if hi > 0.0 { hi + pad } else { hi })
}

/// A linear range spanning `values` (x axes: time need not start at 0).
fn spanning(values: &[f64]) -> Range<f64> {
    let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    match (lo.is_finite(), lo < hi) {
        (false, _) => 0.0..1.0,
        (true, false) => lo - 1.0..hi + 1.0,
        (true, true) => lo..hi,
    }
}

/// A log range over positive `values`: from the power of ten at or below the smallest to the
/// one at or above the largest (at most 30 decades).
fn decades(values: &[f64]) -> Range<f64> {
    let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (lo, mut hi) = if lo.is_finite() {
        (lo.log10().floor(), hi.log10().ceil())
    } else {
        (0.0, 1.0)
    };
    if lo == hi {
        hi += 1.0;
    }
    10f64.powf(lo.max(hi - 30.0))..10f64.powf(hi)
}

fn legend_name(s: &Series, i: usize) -> String {
    let name = if s.name.is_empty() {
        format!("series {}", i + 1)
    } else {
        clean(&s.name)
    };
    shorten(&name, ((LEGEND_MAX_W - 40) / CHAR_W) as usize)
}

/// A value for a label: three significant digits, k/M/G for big ones ("41.2k").
fn format_value(v: f64) -> String {
    if !v.is_finite() {
        return "n/a".to_string();
    }
    let (div, suffix) = match v.abs() {
        a if a >= 1e9 => (1e9, "G"),
        a if a >= 1e6 => (1e6, "M"),
        a if a >= 1e4 => (1e3, "k"),
        _ => (1.0, ""),
    };
    let scaled = v / div;
    let decimals = if scaled.abs() >= 100.0 || scaled == scaled.trunc() && scaled.abs() >= 1.0 {
        0
    } else if scaled.abs() >= 10.0 {
        1
    } else if scaled.abs() >= 0.01 || scaled == 0.0 {
        2
    } else {
        return format!("{v:.1e}");
    };
    let s = format!("{scaled:.decimals$}");
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        &s
    };
    // Never print "-0".
    if s == "-0" {
        "0".to_string()
    } else {
        format!("{s}{suffix}")
    }
}

/// `s` broken at spaces into lines of at most `width` characters, at most `max_lines` of
/// them; what does not fit is cut with an ellipsis.
fn label_lines(s: &str, width: usize, max_lines: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for word in s.split_whitespace() {
        match lines.last_mut() {
            Some(line) if line.chars().count() + 1 + word.chars().count() <= width => {
                line.push(' ');
                line.push_str(word);
            }
            _ => lines.push(word.to_string()),
        }
    }
    if lines.len() > max_lines {
        let rest = lines.split_off(max_lines - 1).join(" ");
        lines.push(rest);
    }
    lines.iter().map(|l| shorten(l, width)).collect()
}

/// `s` cut to at most `max` characters, the last one an ellipsis when it was cut.
fn shorten(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut out: String = s.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// `s` without the characters XML 1.0 forbids (plotters escapes markup, not these); tabs
/// and line breaks become spaces.
fn clean(s: &str) -> String {
    s.chars()
        .filter_map(|c| match c {
            '\t' | '\n' | '\r' => Some(' '),
            c if (c as u32) < 0x20 || c == '\u{fffe}' || c == '\u{ffff}' => None,
            c => Some(c),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_labelled_with_three_digits() {
        assert_eq!(format_value(41_234.0), "41.2k");
        assert_eq!(format_value(9_000.0), "9000");
        assert_eq!(format_value(12_000.0), "12k");
        assert_eq!(format_value(1_250_000.0), "1.25M");
        assert_eq!(format_value(0.5), "0.5");
        assert_eq!(format_value(0.0), "0");
        assert_eq!(format_value(-0.001), "-1.0e-3");
        assert_eq!(format_value(123.0), "123");
        assert_eq!(format_value(f64::NAN), "n/a");
        assert_eq!(shorten("device-disk-persistent", 10), "device-di…");
        assert_eq!(
            label_lines("ram-overflow (overflows)", 14, 3),
            vec!["ram-overflow", "(overflows)"]
        );
        assert_eq!(label_lines("aa bb cc dd", 2, 3), vec!["aa", "bb", "c…"]);
        assert_eq!(clean("x\u{1}y\tz"), "xy z");
    }
}
