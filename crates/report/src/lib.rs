//! Reports of vdstream: the shared chart writer for benchmark and sizing reports.
//!
//! [`bar_chart`] and [`line_chart`] each return one whole, self-contained `<svg>` document
//! (no scripts, no external fonts or styles) that browsers, Markdown viewers and
//! `rsvg-convert` render alike, drawn by `plotters` on its SVG backend.

pub mod svg;

pub use svg::{bar_chart, line_chart, Series};
