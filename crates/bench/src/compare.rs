//! The write-cache comparison table that PVS sizing guides show: one row per cache type
//! (and the raw disk), with IOPS, read and write IOPS, MiB/s read and write, average
//! latency, and storage IOPS per target with its reduction against `device-disk`.
//!
//! Invariants: every figure comes from a measurement: the guest side from the row's
//! [`BenchResult`], the storage side from the counters of the process that did the storage
//! I/O (agent or server), read before and after the run; nothing is derived from settings.
//! The reduction is only shown when a `device-disk` row with storage IOPS exists. Each
//! row's IOPS carry their noise, measured from the spread of the run's own intervals, so a
//! short run does not rank two rows that it cannot tell apart.

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

impl Row {
    /// How the load reached the disk: `vhost-user-blk` (shared-memory virtqueues, as a VM
    /// on the agent's host) or `NBD` (a unix socket), read off the run's URI.
    pub fn transport(&self) -> &'static str {
        if self.result.uri.starts_with("vhost-user:") {
            "vhost-user-blk"
        } else {
            "NBD"
        }
    }

    /// Half the width of the ~95% interval of the row's mean IOPS, in percent of it: twice
    /// the standard error of the per-interval IOPS. `None` with fewer than 3 intervals.
    pub fn iops_noise_pct(&self) -> Option<f64> {
        let xs: Vec<f64> = self.result.series.iter().map(|i| i.iops()).collect();
        let n = xs.len() as f64;
        if xs.len() < 3 {
            return None;
        }
        let mean = xs.iter().sum::<f64>() / n;
        if mean <= 0.0 {
            return None;
        }
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
        Some(round1(200.0 * (var / n).sqrt() / mean))
    }
}

/// The name of the raw disk's row (`cache`), and of the RAM cache with overflow that the
/// headline compares with it.
pub const RAW: &str = "none";
pub const RAM_OVERFLOW: &str = "ram-overflow";

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

    /// The field reports' own comparison: the RAM cache with overflow (its first row over
    /// NBD, the one that fits in RAM) against the raw disk, in guest IOPS and in storage
    /// IOPS per target; and, when the table has one, the same cache through vhost-user-blk,
    /// where the NBD socket no longer bounds what the cache can answer. `None` without the
    /// raw disk and an NBD RAM row.
    pub fn headline(&self) -> Option<String> {
        let raw = self.rows.iter().find(|r| r.cache == RAW)?;
        let ram = |transport: &str| {
            self.rows
                .iter()
                .find(|r| r.cache == RAM_OVERFLOW && r.transport() == transport)
        };
        let nbd = ram("NBD")?;
        let (r, m) = (raw.result.total.iops, nbd.result.total.iops);
        if r <= 0.0 {
            return None;
        }
        let mut line = format!(
            "{}: {:.1}x the IOPS of the raw disk ({m:.0} against {r:.0}), with {:.0} storage IOPS per target against the raw disk's {:.0}",
            nbd.name, m / r, nbd.storage_iops, raw.storage_iops
        );
        if let Some(v) = ram("vhost-user-blk") {
            let i = v.result.total.iops;
            line += &format!(
                "; through vhost-user-blk, {:.1}x ({i:.0} IOPS, {:.1}x NBD's)",
                i / r,
                i / m.max(1.0)
            );
        }
        Some(line)
    }

    /// Whether two rows' IOPS are within each other's noise (their intervals overlap).
    pub fn within_noise(a: &Row, b: &Row) -> bool {
        let (Some(na), Some(nb)) = (a.iops_noise_pct(), b.iops_noise_pct()) else {
            return false;
        };
        let (ia, ib) = (a.result.total.iops, b.result.total.iops);
        (ia - ib).abs() <= ia * na / 100.0 + ib * nb / 100.0
    }

    /// The table as JSON: the rows, each with its reduction.
    pub fn to_json(&self) -> serde_json::Value {
        let rows: Vec<serde_json::Value> = self
            .rows
            .iter()
            .map(|r| {
                let mut v = serde_json::to_value(r).expect("a row serializes");
                v["storage_reduction_pct"] = serde_json::json!(self.reduction_pct(r));
                v["iops_noise_pct"] = serde_json::json!(r.iops_noise_pct());
                v
            })
            .collect();
        serde_json::json!({ "reference": REFERENCE, "rows": rows, "headline": self.headline() })
    }

    /// The table as Markdown (it reads as plain text on a terminal too).
    pub fn render_markdown(&self) -> String {
        let mut out = String::from(
            "| write cache | IOPS (±noise) | read IOPS | write IOPS | read MiB/s | write MiB/s | avg latency (ms) | storage IOPS per target | storage IOPS vs device-disk |\n\
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
            let iops = match r.iops_noise_pct() {
                Some(n) => format!("{:.0} ±{n:.0}%", b.total.iops),
                None => format!("{:.0}", b.total.iops),
            };
            out += &format!(
                "| {} | {} | {:.0} | {:.0} | {:.1} | {:.1} | {:.2} | {:.0} | {} |\n",
                r.name,
                iops,
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

    fn with_series(mut r: Row, iops: &[f64]) -> Row {
        r.result.series = iops
            .iter()
            .enumerate()
            .map(|(k, &x)| crate::result::Interval {
                t_secs: k as f64 + 1.0,
                read_iops: x / 5.0,
                write_iops: x * 4.0 / 5.0,
                read_mib_per_sec: 0.0,
                write_mib_per_sec: 0.0,
                mean_latency_us: 100.0,
            })
            .collect();
        r
    }

    #[test]
    fn noise_comes_from_the_rows_own_intervals() {
        let steady = with_series(row("a", "ram-overflow", 1000.0, 1.0), &[1000.0; 10]);
        assert_eq!(steady.iops_noise_pct(), Some(0.0));
        // Mean 1000, sample sd 100 (alternating 900, 1100 over 10 intervals, n-1 = 9):
        // 2 * sd / sqrt(n) / mean = 2 * 105.4 / 3.162 / 1000 = 6.7%.
        let noisy = with_series(
            row("b", "device-disk", 1000.0, 1.0),
            &[900.0, 1100.0].repeat(5),
        );
        assert_eq!(noisy.iops_noise_pct(), Some(6.7));
        assert_eq!(
            row("c", "server", 1.0, 1.0).iops_noise_pct(),
            None,
            "no intervals"
        );
        let near = with_series(
            row("d", "device-ram", 1050.0, 1.0),
            &[950.0, 1150.0].repeat(5),
        );
        let far = with_series(
            row("e", "device-ram", 2000.0, 1.0),
            &[1900.0, 2100.0].repeat(5),
        );
        assert!(Comparison::within_noise(&noisy, &near));
        assert!(!Comparison::within_noise(&noisy, &far));
        let c = Comparison { rows: vec![noisy] };
        assert!(
            c.render_markdown().contains("| b | 1000 ±7% |"),
            "{}",
            c.render_markdown()
        );
    }

    #[test]
    fn the_headline_is_ram_overflow_against_the_raw_disk() {
        let c = Comparison {
            rows: vec![
                row("raw disk", RAW, 400.0, 400.0),
                row("ram-overflow (fits)", RAM_OVERFLOW, 1560.0, 12.0),
                row("device-disk", "device-disk", 900.0, 700.0),
            ],
        };
        let h = c.headline().unwrap();
        assert!(
            h.starts_with("ram-overflow (fits): 3.9x the IOPS of the raw disk (1560 against 400)")
                && h.ends_with("with 12 storage IOPS per target against the raw disk's 400"),
            "{h}"
        );
        assert_eq!(c.to_json()["headline"], h.as_str());
        let no_raw = Comparison {
            rows: c.rows[1..].to_vec(),
        };
        assert_eq!(no_raw.headline(), None);

        // The same cache through vhost-user-blk adds its own ratio; it never stands in for
        // the NBD row.
        let mut vhost = row(
            "ram-overflow (fits), vhost-user-blk",
            RAM_OVERFLOW,
            3120.0,
            12.0,
        );
        vhost.result.uri = "vhost-user:/run/x.vhost".into();
        assert_eq!(vhost.transport(), "vhost-user-blk");
        let mut both = c.clone();
        both.rows.insert(1, vhost.clone());
        let h2 = both.headline().unwrap();
        assert!(
            h2.starts_with(&h)
                && h2.ends_with("; through vhost-user-blk, 7.8x (3120 IOPS, 2.0x NBD's)"),
            "{h2}"
        );
        let only_vhost = Comparison {
            rows: vec![c.rows[0].clone(), vhost],
        };
        assert_eq!(only_vhost.headline(), None);
    }
}
