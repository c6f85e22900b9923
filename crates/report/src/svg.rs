//! Hand-written SVG charts: a bar chart and a line chart, each one whole `<svg>` document.
//!
//! Layout: a fixed 720×420 canvas; the title on top, the plot area framed by a y axis on the
//! left and an x axis at the bottom, gridlines at "nice" tick values (1, 2, 2.5 or 5 times a
//! power of ten, or powers of ten on a logarithmic axis), tick labels shortened with k/M/G,
//! and for line charts a legend on the right that names every series in its colour.
//!
//! Invariants:
//! - The output is well-formed XML whatever the input: every text (titles, labels, series
//!   names) is XML-escaped and stripped of characters XML 1.0 forbids, and no coordinate
//!   is ever `NaN` or infinite.
//! - Values map to coordinates monotonically: a bigger value is a taller bar, a point
//!   further right or higher up. The value axis of a bar chart always includes 0 so that
//!   bar heights compare honestly; a line chart's y axis includes 0 too.
//! - Non-finite values (`NaN`, ±∞) are never drawn: a bar shows `n/a`, a line breaks at
//!   the point. With nothing to draw at all the chart still renders, with axes and "no data".
//! - Marks carry a `class` (`bar`, `point`, `line`, `tick`) so that tests and style sheets
//!   can find them.

use std::fmt::Write as _;

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 420.0;
const TOP: f64 = 48.0;
const LEFT: f64 = 78.0;
const BOTTOM_PAD: f64 = 62.0;
const RIGHT_PAD: f64 = 24.0;
/// Rough width of one character at font-size 12, for layout only.
const CHAR_W: f64 = 6.8;
/// Widest legend (line, gap and name); longer names are cut with an ellipsis.
const LEGEND_MAX_W: f64 = 260.0;
/// Colours of series, in order (colour-blind friendly, after Okabe & Ito).
const PALETTE: [&str; 8] = ["#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#000000", "#f0e442"];

/// One line of a line chart: a name for the legend and its (x, y) points, drawn in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// How a line chart draws its axes; [`line_chart`] uses the default (both linear).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LineOptions {
    /// A logarithmic x axis (powers of ten), for sizes spanning decades such as RAM sizes
    /// from 64 MiB to 4 GiB. Points with x ≤ 0 cannot be placed on it and are skipped.
    pub x_log: bool,
    /// A logarithmic y axis, for values spanning decades such as latencies where one
    /// series starts at hundreds of milliseconds and another runs at hundreds of
    /// microseconds. Points with y ≤ 0 are skipped.
    pub y_log: bool,
}

/// A bar chart of named values, one bar each, as a whole `<svg>` document.
///
/// ```
/// let svg = vdstream_report::bar_chart("IOPS per cache type", "IOPS",
///     &[("device-disk".to_string(), 9_000.0), ("ram-overflow".to_string(), 41_000.0)]);
/// assert!(svg.starts_with("<?xml"));
/// ```
pub fn bar_chart(title: &str, y_label: &str, bars: &[(String, f64)]) -> String {
    let values: Vec<f64> = bars.iter().map(|b| b.1).filter(|v| v.is_finite()).collect();
    let axis = LinearAxis::including_zero(&values);
    let plot = Plot::new(RIGHT_PAD);
    let mut out = header(title);
    let y = Scale { axis: &axis, px_lo: plot.bottom, px_hi: plot.top };
    y_grid(&mut out, &plot, &axis, &y);
    axis_titles(&mut out, &plot, "", y_label);
    if bars.is_empty() {
        no_data(&mut out, &plot);
    }
    let n = bars.len().max(1) as f64;
    let slot = plot.width() / n;
    let bar_w = (slot * 0.7).min(90.0);
    // Names go under their bars on up to three lines, broken at spaces; a name that still
    // does not fit is cut with an ellipsis (the bar's tooltip keeps it whole).
    let fits = ((slot * 0.95) / CHAR_W).floor().max(3.0) as usize;
    let zero = y.map(0.0);
    for (i, (name, value)) in bars.iter().enumerate() {
        let cx = plot.left + slot * (i as f64 + 0.5);
        if value.is_finite() {
            let top = y.map(*value);
            let (y0, h) = if top <= zero { (top, zero - top) } else { (zero, top - zero) };
            let _ = writeln!(
                out,
                r#"<rect class="bar" x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{}: {}</title></rect>"#,
                cx - bar_w / 2.0,
                y0,
                bar_w,
                h,
                PALETTE[0],
                escape(name),
                format_value(*value)
            );
            let label_y = if *value >= 0.0 { top - 5.0 } else { top + 14.0 };
            text(&mut out, cx, label_y, "middle", "", &format_value(*value));
        } else {
            text(&mut out, cx, zero - 5.0, "middle", "", "n/a");
        }
        for (k, line) in label_lines(name, fits, 3).iter().enumerate() {
            text(&mut out, cx, plot.bottom + 18.0 + 14.0 * k as f64, "middle", "", line);
        }
    }
    frame(&mut out, &plot);
    out.push_str("</svg>\n");
    out
}

/// A line chart of one or more series on linear axes, as a whole `<svg>` document; a
/// legend names the series when there are several (or one with a name).
pub fn line_chart(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    line_chart_with(title, x_label, y_label, series, LineOptions::default())
}

/// [`line_chart`] with a choice of axes (see [`LineOptions`]).
pub fn line_chart_with(title: &str, x_label: &str, y_label: &str, series: &[Series], options: LineOptions) -> String {
    let placeable = |&(x, y): &(f64, f64)| x.is_finite() && y.is_finite() && (!options.x_log || x > 0.0) && (!options.y_log || y > 0.0);
    let all: Vec<(f64, f64)> = series.iter().flat_map(|s| s.points.iter().copied()).filter(placeable).collect();
    let xs: Vec<f64> = all.iter().map(|p| p.0).collect();
    let ys: Vec<f64> = all.iter().map(|p| p.1).collect();
    let x_axis = if options.x_log { LinearAxis::log10(&xs) } else { LinearAxis::spanning(&xs) };
    let y_axis = if options.y_log { LinearAxis::log10(&ys) } else { LinearAxis::including_zero(&ys) };

    let legend = series.len() > 1 || series.iter().any(|s| !s.name.is_empty());
    let longest = series.iter().map(|s| s.name.chars().count()).max().unwrap_or(0) as f64;
    let legend_w = if legend { (longest * CHAR_W + 40.0).min(LEGEND_MAX_W) } else { 0.0 };
    let plot = Plot::new(RIGHT_PAD + legend_w);
    let x = Scale { axis: &x_axis, px_lo: plot.left, px_hi: plot.right };
    let y = Scale { axis: &y_axis, px_lo: plot.bottom, px_hi: plot.top };

    let mut out = header(title);
    y_grid(&mut out, &plot, &y_axis, &y);
    for &t in &x_axis.ticks {
        let px = x.map(t);
        let _ = writeln!(
            out,
            r##"<line class="tick" x1="{px:.1}" y1="{:.1}" x2="{px:.1}" y2="{:.1}" stroke="#e4e4e4"/>"##,
            plot.top, plot.bottom
        );
        text(&mut out, px, plot.bottom + 18.0, "middle", "", &x_axis.label(t));
    }
    axis_titles(&mut out, &plot, x_label, y_label);
    if all.is_empty() {
        no_data(&mut out, &plot);
    }
    let markers = all.len() <= 200;
    for (i, s) in series.iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        // A line breaks wherever a point cannot be placed.
        for run in s.points.split(|p| !placeable(p)).filter(|r| !r.is_empty()) {
            let pts: Vec<String> = run.iter().map(|&(a, b)| format!("{:.1},{:.1}", x.map(a), y.map(b))).collect();
            let _ = writeln!(
                out,
                r#"<polyline class="line" points="{}" fill="none" stroke="{colour}" stroke-width="2" stroke-linejoin="round"/>"#,
                pts.join(" ")
            );
        }
        if markers {
            for &(a, b) in s.points.iter().filter(|p| placeable(p)) {
                let _ = writeln!(
                    out,
                    r#"<circle class="point" cx="{:.1}" cy="{:.1}" r="3" fill="{colour}"><title>{}: ({}, {})</title></circle>"#,
                    x.map(a),
                    y.map(b),
                    escape(&s.name),
                    format_value(a),
                    format_value(b)
                );
            }
        }
    }
    if legend {
        let lx = plot.right + 14.0;
        for (i, s) in series.iter().enumerate() {
            let ly = plot.top + 8.0 + 20.0 * i as f64;
            let colour = PALETTE[i % PALETTE.len()];
            let _ =
                writeln!(out, r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{colour}" stroke-width="3"/>"#, lx + 18.0);
            let name = if s.name.is_empty() { format!("series {}", i + 1) } else { s.name.clone() };
            let name = shorten(&name, ((LEGEND_MAX_W - 40.0) / CHAR_W) as usize);
            text(&mut out, lx + 24.0, ly + 4.0, "start", "", &name);
        }
    }
    frame(&mut out, &plot);
    out.push_str("</svg>\n");
    out
}

/// The plot area inside the canvas, in pixels.
struct Plot {
    left: f64,
    top: f64,
    right: f64,
    bottom: f64,
}

impl Plot {
    fn new(right_pad: f64) -> Self {
        Plot { left: LEFT, top: TOP, right: WIDTH - right_pad, bottom: HEIGHT - BOTTOM_PAD }
    }
    fn width(&self) -> f64 {
        self.right - self.left
    }
}

/// An axis's range and tick values, chosen from the data.
struct LinearAxis {
    lo: f64,
    hi: f64,
    log: bool,
    ticks: Vec<f64>,
    /// Divisor and suffix of tick labels (1000 → "k"), and decimals after dividing (linear
    /// axes only: a log axis labels each tick in its own unit).
    unit: (f64, &'static str),
    decimals: usize,
}

impl LinearAxis {
    /// A linear axis over `values` that always includes 0 (value axes).
    fn including_zero(values: &[f64]) -> Self {
        let lo = values.iter().copied().fold(0.0, f64::min);
        let hi = values.iter().copied().fold(0.0, f64::max);
        Self::nice(lo, hi)
    }

    /// A linear axis spanning `values` (x axes: time need not start at 0).
    fn spanning(values: &[f64]) -> Self {
        let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if !lo.is_finite() {
            return Self::nice(0.0, 1.0);
        }
        Self::nice(lo, hi)
    }

    /// Round `lo..hi` out to nice ticks, about five of them.
    fn nice(mut lo: f64, mut hi: f64) -> Self {
        if !(lo.is_finite() && hi.is_finite()) {
            (lo, hi) = (0.0, 1.0);
        }
        if lo == hi {
            // One value: widen to include 0, or to [v-1, v+1] around 0 itself.
            if lo == 0.0 {
                hi = 1.0;
            } else {
                (lo, hi) = (lo.min(0.0), hi.max(0.0));
            }
        }
        let step = nice_step((hi - lo) / 5.0);
        let first = (lo / step).floor();
        let last = (hi / step).ceil();
        let ticks: Vec<f64> = (0..=((last - first) as i64).clamp(1, 20)).map(|i| (first + i as f64) * step).collect();
        let max_abs = ticks.iter().fold(0.0f64, |m, t| m.max(t.abs()));
        let unit = unit_for(max_abs);
        let decimals = (-(step / unit.0).log10().floor()).clamp(0.0, 6.0) as usize;
        LinearAxis { lo: ticks[0], hi: *ticks.last().unwrap_or(&1.0), log: false, ticks, unit, decimals }
    }

    /// A log10 axis over positive `values`, from the power of ten at or below the smallest
    /// to the one at or above the largest; ticks at powers of ten, and at 2× and 5× when
    /// the axis spans two decades or fewer.
    fn log10(values: &[f64]) -> Self {
        let lo = values.iter().copied().filter(|v| *v > 0.0).fold(f64::INFINITY, f64::min);
        let hi = values.iter().copied().filter(|v| *v > 0.0).fold(f64::NEG_INFINITY, f64::max);
        let (mut e_lo, mut e_hi) = if lo.is_finite() { (lo.log10().floor(), hi.log10().ceil()) } else { (0.0, 1.0) };
        if e_lo == e_hi {
            e_hi += 1.0;
        }
        e_lo = e_lo.max(e_hi - 30.0);
        let mut ticks = Vec::new();
        for e in (e_lo as i64)..=(e_hi as i64) {
            let p = 10f64.powi(e as i32);
            ticks.push(p);
            if e_hi - e_lo <= 2.0 && (e as f64) < e_hi {
                ticks.extend([2.0 * p, 5.0 * p]);
            }
        }
        // No axis-wide unit or decimals: each tick's label picks its own (see `label`).
        LinearAxis { lo: 10f64.powf(e_lo), hi: 10f64.powf(e_hi), log: true, ticks, unit: (1.0, ""), decimals: 0 }
    }

    fn label(&self, v: f64) -> String {
        if v == 0.0 {
            return "0".to_string();
        }
        // A log axis spans decades: each tick gets its own unit (100, 1k, 10k, 1M).
        let unit = if self.log { unit_for(v.abs()) } else { self.unit };
        let scaled = v / unit.0;
        let decimals = if self.log { trimmed_decimals(scaled, 6) } else { self.decimals };
        let s = format!("{:.*}{}", decimals, scaled, unit.1);
        // Never print "-0".
        if s.starts_with('-') && s[1..].chars().all(|c| c == '0' || c == '.' || c.is_alphabetic()) {
            s[1..].to_string()
        } else {
            s
        }
    }
}

/// Fewest decimals (up to `max`) that show `v` exactly enough: 0.2 rather than 0.200.
fn trimmed_decimals(v: f64, max: usize) -> usize {
    (0..=max).find(|&d| (v * 10f64.powi(d as i32)).round() - v * 10f64.powi(d as i32) == 0.0).unwrap_or(max)
}

/// 1, 2, 2.5 or 5 times a power of ten, the smallest not below `raw`.
fn nice_step(raw: f64) -> f64 {
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let nice = [1.0, 2.0, 2.5, 5.0, 10.0].into_iter().find(|n| norm <= n * (1.0 + 1e-9)).unwrap_or(10.0);
    nice * mag
}

fn unit_for(max_abs: f64) -> (f64, &'static str) {
    if max_abs >= 1e9 {
        (1e9, "G")
    } else if max_abs >= 1e6 {
        (1e6, "M")
    } else if max_abs >= 1e4 {
        (1e3, "k")
    } else {
        (1.0, "")
    }
}

/// A value for a label: three significant digits, k/M/G for big ones ("41.2k").
fn format_value(v: f64) -> String {
    if !v.is_finite() {
        return "n/a".to_string();
    }
    let (div, suffix) = unit_for(v.abs());
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
    let s = if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s };
    format!("{s}{suffix}")
}

/// Maps an axis's values onto pixels `px_lo..px_hi` (`px_hi` may be smaller: y grows down).
struct Scale<'a> {
    axis: &'a LinearAxis,
    px_lo: f64,
    px_hi: f64,
}

impl Scale<'_> {
    fn map(&self, v: f64) -> f64 {
        let (lo, hi, v) = if self.axis.log {
            (self.axis.lo.log10(), self.axis.hi.log10(), v.max(f64::MIN_POSITIVE).log10())
        } else {
            (self.axis.lo, self.axis.hi, v)
        };
        let frac = if hi > lo { (v - lo) / (hi - lo) } else { 0.0 };
        let px = self.px_lo + frac * (self.px_hi - self.px_lo);
        if px.is_finite() {
            px
        } else {
            self.px_lo
        }
    }
}

fn header(title: &str) -> String {
    let mut out = String::with_capacity(8192);
    let _ = writeln!(out, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
    let _ = writeln!(
        out,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12" fill="#222">"##
    );
    let _ = writeln!(out, "<title>{}</title>", escape(title));
    let _ = writeln!(out, r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="28" text-anchor="middle" font-size="16" font-weight="bold">{}</text>"#,
        WIDTH / 2.0,
        escape(title)
    );
    out
}

fn y_grid(out: &mut String, plot: &Plot, axis: &LinearAxis, y: &Scale) {
    for &t in &axis.ticks {
        let py = y.map(t);
        let _ = writeln!(
            out,
            r##"<line class="tick" x1="{:.1}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#e4e4e4"/>"##,
            plot.left, plot.right
        );
        text(out, plot.left - 6.0, py + 4.0, "end", "", &axis.label(t));
    }
}

fn axis_titles(out: &mut String, plot: &Plot, x_label: &str, y_label: &str) {
    if !x_label.is_empty() {
        text(out, (plot.left + plot.right) / 2.0, HEIGHT - 16.0, "middle", "", x_label);
    }
    if !y_label.is_empty() {
        let (x, y) = (18.0, (plot.top + plot.bottom) / 2.0);
        let _ = writeln!(
            out,
            r#"<text x="{x:.1}" y="{y:.1}" text-anchor="middle" transform="rotate(-90 {x:.1} {y:.1})">{}</text>"#,
            escape(y_label)
        );
    }
}

fn frame(out: &mut String, plot: &Plot) {
    let _ = writeln!(
        out,
        r##"<path d="M{:.1},{:.1} V{:.1} H{:.1}" fill="none" stroke="#444" stroke-width="1"/>"##,
        plot.left, plot.top, plot.bottom, plot.right
    );
}

fn no_data(out: &mut String, plot: &Plot) {
    text(out, (plot.left + plot.right) / 2.0, (plot.top + plot.bottom) / 2.0, "middle", "#888", "no data");
}

fn text(out: &mut String, x: f64, y: f64, anchor: &str, fill: &str, s: &str) {
    let fill = if fill.is_empty() { String::new() } else { format!(r#" fill="{fill}""#) };
    let _ = writeln!(out, r#"<text x="{x:.1}" y="{y:.1}" text-anchor="{anchor}"{fill}>{}</text>"#, escape(s));
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

/// XML-escape `s` for text and attribute values, dropping characters XML 1.0 forbids.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(' '),
            c if (c as u32) < 0x20 || c == '\u{fffe}' || c == '\u{ffff}' => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(svg: &str) -> roxmltree::Document<'_> {
        roxmltree::Document::parse(svg).unwrap_or_else(|e| panic!("not well-formed XML: {e}\n{svg}"))
    }

    fn attr(n: &roxmltree::Node, name: &str) -> f64 {
        n.attribute(name).unwrap_or_else(|| panic!("no {name}")).parse().unwrap()
    }

    fn marks<'a>(doc: &'a roxmltree::Document<'a>, class: &str) -> Vec<roxmltree::Node<'a, 'a>> {
        doc.descendants().filter(|n| n.attribute("class") == Some(class)).collect()
    }

    fn bars(v: &[(&str, f64)]) -> Vec<(String, f64)> {
        v.iter().map(|(n, x)| (n.to_string(), *x)).collect()
    }

    #[test]
    fn nice_steps_are_1_2_2_5_5_times_a_power_of_ten() {
        assert_eq!(nice_step(0.9), 1.0);
        assert_eq!(nice_step(1.7), 2.0);
        assert_eq!(nice_step(2.2), 2.5);
        assert_eq!(nice_step(3.0), 5.0);
        assert_eq!(nice_step(7.0), 10.0);
        assert_eq!(nice_step(8200.0), 10000.0);
        assert_eq!(nice_step(f64::NAN), 1.0);
        let a = LinearAxis::including_zero(&[41_234.0, 9_000.0]);
        assert_eq!(a.ticks, vec![0.0, 10_000.0, 20_000.0, 30_000.0, 40_000.0, 50_000.0]);
        assert_eq!(a.label(20_000.0), "20k");
        assert_eq!(a.label(0.0), "0");
        let a = LinearAxis::including_zero(&[0.35]);
        assert_eq!(a.label(0.1), "0.1");
        let a = LinearAxis::log10(&[64.0, 4096.0]);
        assert_eq!((a.lo, a.hi), (10.0, 10_000.0));
        assert_eq!(a.ticks, vec![10.0, 100.0, 1000.0, 10_000.0]);
    }

    #[test]
    fn values_are_labelled_with_three_digits() {
        assert_eq!(format_value(41_234.0), "41.2k");
        assert_eq!(format_value(9_000.0), "9000");
        assert_eq!(format_value(12_000.0), "12k");
        assert_eq!(format_value(1_250_000.0), "1.25M");
        assert_eq!(format_value(0.5), "0.5");
        assert_eq!(format_value(0.0), "0");
        assert_eq!(format_value(123.0), "123");
        assert_eq!(format_value(f64::NAN), "n/a");
    }

    #[test]
    fn long_bar_names_wrap_at_spaces_and_long_legends_are_cut() {
        assert_eq!(label_lines("ram-overflow (overflows)", 14, 3), vec!["ram-overflow", "(overflows)"]);
        assert_eq!(label_lines("aa bb cc dd", 2, 3), vec!["aa", "bb", "c…"]);
        assert_eq!(label_lines("device-disk-persistent", 10, 3), vec!["device-di…"]);
        let six = [("raw disk", 5.0), ("ram-overflow (fits)", 4.0), ("ram-overflow (overflows)", 3.0), ("device-ram", 4.0), ("device-disk", 1.0), ("server", 1.0)];
        let svg = bar_chart("t", "IOPS", &bars(&six));
        let doc = parse(&svg);
        let texts: Vec<&str> = doc.descendants().filter(|n| n.has_tag_name("text")).filter_map(|n| n.text()).collect();
        assert!(texts.contains(&"ram-overflow") && texts.contains(&"(overflows)"), "{texts:?}");
        for t in doc.descendants().filter(|n| n.has_tag_name("text")) {
            assert!(attr(&t, "y") < HEIGHT, "label {:?} is inside the canvas", t.text());
        }
        let long = "a series name much longer than any legend could hold on the right";
        let svg = line_chart("t", "s", "IOPS", &[Series { name: long.into(), points: vec![(0.0, 1.0), (1.0, 2.0)] }, Series { name: "b".into(), points: vec![(0.0, 2.0)] }]);
        let doc = parse(&svg);
        let legend = doc.descendants().filter(|n| n.has_tag_name("text")).filter_map(|n| n.text()).find(|t| t.starts_with("a series")).unwrap();
        assert!(legend.ends_with('…') && (legend.chars().count() as f64) * CHAR_W + 24.0 + 14.0 <= LEGEND_MAX_W, "{legend}");
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(escape(r#"a<b>&"c'"#), "a&lt;b&gt;&amp;&quot;c&apos;");
        assert_eq!(escape("x\u{1}y\tz"), "xy z");
        let svg = bar_chart("<&> \"t\"", "y & <z>", &bars(&[("a</text>", 1.0), ("\u{0}b", 2.0)]));
        let doc = parse(&svg);
        assert_eq!(doc.descendants().find(|n| n.has_tag_name("title")).unwrap().text(), Some("<&> \"t\""));
        assert!(doc.descendants().any(|n| n.text() == Some("a</text>")));
    }

    #[test]
    fn bar_heights_grow_with_values() {
        let values = [("small", 300.0), ("zero", 0.0), ("big", 41_000.0), ("mid", 9_000.0)];
        let svg = bar_chart("IOPS", "IOPS", &bars(&values));
        let doc = parse(&svg);
        let rects = marks(&doc, "bar");
        assert_eq!(rects.len(), 4);
        let heights: Vec<f64> = rects.iter().map(|r| attr(r, "height")).collect();
        let bottoms: Vec<f64> = rects.iter().map(|r| attr(r, "y") + attr(r, "height")).collect();
        for (i, a) in values.iter().enumerate() {
            for (j, b) in values.iter().enumerate() {
                if a.1 < b.1 {
                    assert!(heights[i] < heights[j], "{a:?} drawn no shorter than {b:?}");
                }
                if a.1 <= b.1 {
                    assert!(heights[i] <= heights[j], "{a:?} drawn taller than {b:?}");
                }
            }
            assert!((bottoms[i] - bottoms[0]).abs() < 0.2, "bars share a baseline");
        }
        assert_eq!(heights[1], 0.0);
        // bars go left to right in the given order
        let xs: Vec<f64> = rects.iter().map(|r| attr(r, "x")).collect();
        assert!(xs.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn nan_empty_and_zero_inputs_still_render() {
        for svg in [
            bar_chart("empty", "y", &[]),
            bar_chart("zeros", "y", &bars(&[("a", 0.0), ("b", 0.0)])),
            bar_chart("nan", "y", &bars(&[("a", f64::NAN), ("b", f64::INFINITY), ("c", -2.0)])),
            line_chart("empty", "x", "y", &[]),
            line_chart("no points", "x", "y", &[Series { name: "s".into(), points: vec![] }]),
            line_chart("nan", "x", "y", &[Series { name: "s".into(), points: vec![(0.0, f64::NAN), (1.0, 0.0), (f64::INFINITY, 2.0)] }]),
            line_chart("one point", "x", "y", &[Series { name: String::new(), points: vec![(5.0, 5.0)] }]),
            line_chart_with("log", "x", "y", &[Series { name: "s".into(), points: vec![(0.0, 1.0)] }], LineOptions { x_log: true, ..LineOptions::default() }),
        ] {
            parse(&svg);
            assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        }
        assert!(bar_chart("empty", "y", &[]).contains("no data"));
        assert!(bar_chart("nan", "y", &bars(&[("a", f64::NAN)])).contains("n/a"));
        let doc_svg = bar_chart("neg", "y", &bars(&[("a", -2.0), ("b", 2.0)]));
        let doc = parse(&doc_svg);
        let rects = marks(&doc, "bar");
        assert_eq!(attr(&rects[0], "height"), attr(&rects[1], "height"));
        assert!(attr(&rects[0], "y") > attr(&rects[1], "y"), "negative bar hangs below the zero line");
    }

    #[test]
    fn points_map_monotonically_and_series_get_a_legend() {
        let series = vec![
            Series { name: "ram-overflow".into(), points: vec![(64.0, 900.0), (256.0, 400.0), (1024.0, 50.0), (4096.0, 0.0)] },
            Series { name: "device-ram".into(), points: vec![(64.0, 10.0), (256.0, 10.0), (1024.0, 10.0), (4096.0, 10.0)] },
        ];
        for options in [LineOptions::default(), LineOptions { x_log: true, ..LineOptions::default() }] {
            let svg = line_chart_with("Storage IOPS", "RAM (MiB)", "IOPS", &series, options);
            let doc = parse(&svg);
            let pts = marks(&doc, "point");
            assert_eq!(pts.len(), 8);
            let first: Vec<(f64, f64)> = pts[..4].iter().map(|p| (attr(p, "cx"), attr(p, "cy"))).collect();
            assert!(first.windows(2).all(|w| w[0].0 < w[1].0), "x grows to the right: {first:?}");
            assert!(first.windows(2).all(|w| w[0].1 < w[1].1), "falling y goes down the page: {first:?}");
            assert_eq!(marks(&doc, "line").len(), 2);
            for s in &series {
                assert!(doc.descendants().any(|n| n.text() == Some(s.name.as_str())), "legend names {}", s.name);
            }
        }
        // On a log axis equal ratios are equal distances.
        let svg = line_chart_with("log", "x", "y", &series[..1], LineOptions { x_log: true, ..LineOptions::default() });
        let doc = parse(&svg);
        let cx: Vec<f64> = marks(&doc, "point").iter().map(|p| attr(p, "cx")).collect();
        assert!(((cx[1] - cx[0]) - (cx[3] - cx[2])).abs() < 0.2, "{cx:?}");
    }

    #[test]
    fn a_log_y_axis_keeps_fast_and_slow_series_apart() {
        // Latency: one series at hundreds of milliseconds, one at hundreds of microseconds.
        let series = vec![
            Series { name: "slow start".into(), points: vec![(0.5, 300_000.0), (1.0, 30_000.0), (1.5, 3_000.0)] },
            Series { name: "steady".into(), points: vec![(0.5, 500.0), (1.0, 400.0), (1.5, 0.0)] },
        ];
        let options = LineOptions { y_log: true, ..LineOptions::default() };
        let doc_svg = line_chart_with("Mean latency", "seconds", "latency (µs)", &series, options);
        let doc = parse(&doc_svg);
        let cy: Vec<f64> = marks(&doc, "point").iter().map(|p| attr(p, "cy")).collect();
        assert_eq!(cy.len(), 5, "the zero cannot be placed on a log axis and is skipped");
        // Equal ratios are equal distances, and higher values sit higher on the page.
        assert!(((cy[1] - cy[0]) - (cy[2] - cy[1])).abs() < 0.2, "{cy:?}");
        assert!(cy[0] < cy[1] && cy[1] < cy[2] && cy[2] < cy[3], "{cy:?}");
        // On a linear axis the steady series would sit within a pixel of the bottom; here it
        // is a visible distance above it.
        let linear_svg = line_chart("Mean latency", "seconds", "latency (µs)", &series);
        let linear = parse(&linear_svg);
        let lin_cy: Vec<f64> = marks(&linear, "point").iter().map(|p| attr(p, "cy")).collect();
        assert!((lin_cy[3] - lin_cy[5]).abs() < 2.0, "linear: {lin_cy:?}");
        assert!(cy[3] - cy[2] > 20.0, "log: 3000 µs and 500 µs are far apart: {cy:?}");
        assert!(doc_svg.contains(">100k<") && doc_svg.contains(">1000<") && doc_svg.contains(">1M<"), "power-of-ten ticks, each in its own unit: {doc_svg}");
    }

    #[test]
    fn a_line_breaks_at_a_point_it_cannot_place() {
        let s = Series { name: "s".into(), points: vec![(0.0, 1.0), (1.0, 2.0), (2.0, f64::NAN), (3.0, 1.0), (4.0, 0.0)] };
        let svg = line_chart("gap", "x", "y", &[s]);
        let doc = parse(&svg);
        assert_eq!(marks(&doc, "line").len(), 2);
        assert_eq!(marks(&doc, "point").len(), 4);
    }
}
