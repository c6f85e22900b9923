//! Reports of vdstream: the shared chart writer for benchmark and sizing reports.
//!
//! [`bar_chart`] and [`line_chart`] each return one whole, self-contained `<svg>` document
//! (no scripts, no external fonts or styles) that browsers, Markdown viewers and
//! `rsvg-convert` render alike. The crate has no dependencies: charts are written by hand.

pub mod svg;

pub use svg::{bar_chart, line_chart, Series};
