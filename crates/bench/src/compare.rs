//! The write-cache comparison table that PVS sizing guides show: one row per cache type
//! (and the raw disk), with IOPS, read and write IOPS, MiB/s read and write, average
//! latency, and storage IOPS per target with its reduction against `device-disk`.
//!
//! Invariants: every figure comes from a measurement: the guest side from the row's
//! [`BenchResult`], the storage side from the counters of the process that did the storage
//! I/O (agent or server), read before and after the run; nothing is derived from settings.
//! The reduction is only shown when a `device-disk` row with storage IOPS exists.

use serde::Serialize;

use crate::result::{round1, BenchResult};

/// The name of the row the reduction is measured against.
pub const REFERENCE: &str = "device-disk";

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// Short name: `raw disk`, `ram-overflow (fits in RAM)`, `device-disk`, ...
    pub name: String,
    /// The cache type (`none` for the raw disk).
    pub cache: String,
    /// What was run, for a person (RAM size, what the storage is).
    pub setup: String,
    /// Storage operations (reads and writes that reached a disk file or the server's
    /// store) during the run, and per second of it.
    pub storage_ops: u64,
    pub storage_iops: f64,
    /// Where the storage figure was read from.
    pub storage_source: String,
    pub result: BenchResult,
}

/// The rows of a comparison, in the order they ran.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Comparison {
    pub rows: Vec<Row>,
}

impl Comparison {
    /// Storage IOPS of the reference row, if it ran and did storage I/O.
    fn reference_storage_iops(&self) -> Option<f64> {
        self.rows
            .iter()
            .find(|r| r.cache == REFERENCE)
            .map(|r| r.storage_iops)
            .filter(|x| *x > 0.0)
    }

    /// `1 - row / device-disk` in percent (positive: less storage I/O than device-disk).
    pub fn reduction_pct(&self, row: &Row) -> Option<f64> {
        self.reference_storage_iops()
            .map(|d| round1((1.0 - row.storage_iops / d) * 100.0))
    }

    /// The table as JSON: the rows, each with its reduction.
    pub fn to_json(&self) -> serde_json::Value {
        let rows: Vec<serde_json::Value> = self
            .rows
            .iter()
            .map(|r| {
                let mut v = serde_json::to_value(r).expect("a row serializes");
                v["storage_reduction_pct"] = serde_json::json!(self.reduction_pct(r));
                v
            })
            .collect();
        serde_json::json!({ "reference": REFERENCE, "rows": rows })
    }

    /// The table as Markdown (it reads as plain text on a terminal too).
    pub fn render_markdown(&self) -> String {
        let mut out = String::from(
            "| write cache | IOPS | read IOPS | write IOPS | read MiB/s | write MiB/s | avg latency (ms) | storage IOPS per target | vs device-disk |\n\
             | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        );
        for r in &self.rows {
            let b = &r.result;
            let reduction = match (r.cache.as_str(), self.reduction_pct(r)) {
                (REFERENCE, _) => "reference".to_string(),
                (_, Some(p)) if p >= 0.0 => format!("{p:.0}% less"),
                (_, Some(p)) => format!("{:.0}% more", -p),
                (_, None) => "n/a".to_string(),
            };
            out += &format!(
                "| {} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {:.2} | {:.0} | {} |\n",
                r.name,
                b.total.iops,
                b.read.iops,
                b.write.iops,
                b.read.mib_per_sec,
                b.write.mib_per_sec,
                b.total.latency.mean_us / 1000.0,
                r.storage_iops,
                reduction
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::result::OpFigures;
    use crate::workload::Workload;

    fn row(name: &str, cache: &str, iops: f64, storage_iops: f64) -> Row {
        let figures = OpFigures {
            ops: 100,
            bytes: 409_600,
            iops,
            mib_per_sec: 1.0,
            ..OpFigures::default()
        };
        Row {
            name: name.into(),
            cache: cache.into(),
            setup: String::new(),
            storage_ops: 10,
            storage_iops,
            storage_source: "test".into(),
            result: BenchResult {
                uri: "nbd+unix:///?socket=/x".into(),
                export_size: 1 << 20,
                working_set: 1 << 20,
                workload: Workload::default(),
                elapsed_secs: 1.0,
                total: figures,
                read: figures,
                write: figures,
                errors: 0,
                error_messages: vec![],
                verify: None,
                series: vec![],
            },
        }
    }

    #[test]
    fn reduction_is_against_device_disk() {
        let c = Comparison {
            rows: vec![
                row("ram-overflow", "ram-overflow", 900.0, 100.0),
                row("device-disk", "device-disk", 500.0, 400.0),
            ],
        };
        assert_eq!(c.reduction_pct(&c.rows[0]), Some(75.0));
        let table = c.render_markdown();
        assert!(
            table.contains("| ram-overflow | 900 |")
                && table.contains("75% less")
                && table.contains("reference"),
            "{table}"
        );
        assert_eq!(c.to_json()["rows"][0]["storage_reduction_pct"], 75.0);
        let none = Comparison {
            rows: vec![row("ram-overflow", "ram-overflow", 900.0, 100.0)],
        };
        assert_eq!(none.reduction_pct(&none.rows[0]), None);
        assert!(none.render_markdown().contains("n/a"));
    }
}
