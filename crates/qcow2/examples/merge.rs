//! Runs `merge_layers` from the command line, for benchmarks and by hand:
//!
//! ```text
//! cargo run --release -p vdstream-qcow2 --example merge -- TOP STOP|- DST [CLUSTER_BITS]
//! ```
//!
//! `STOP` is the layer the new image is backed by (`-` flattens). Prints one line of
//! `key=value` pairs (the merge report) on success.

use std::path::Path;
use std::process::ExitCode;

use vdstream_qcow2::{merge_layers, MergeOptions};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !(3..=4).contains(&args.len()) {
        eprintln!("usage: merge TOP STOP|- DST [CLUSTER_BITS]");
        return ExitCode::from(2);
    }
    let stop = (args[1] != "-").then(|| Path::new(&args[1]));
    let cluster_bits = match args.get(3).map(|b| b.parse::<u32>()) {
        None => None,
        Some(Ok(b)) => Some(b),
        Some(Err(e)) => {
            eprintln!("CLUSTER_BITS {:?}: {e}", args[3]);
            return ExitCode::from(2);
        }
    };
    let opts = MergeOptions { cluster_bits };
    let chain = match vdstream_qcow2::chain_of(Path::new(&args[0])) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cannot open {}: {e}", args[0]);
            return ExitCode::FAILURE;
        }
    };
    match merge_layers(&chain, stop, Path::new(&args[2]), &opts, &mut |_, _| {}) {
        Ok(r) => {
            println!(
                "bytes_read={} bytes_written={} clusters_written={} zero_clusters={} zero_data_dropped={} seconds={:.3}",
                r.bytes_read, r.bytes_written, r.clusters_written, r.zero_clusters, r.zero_data_dropped, r.duration.as_secs_f64()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("merge failed: {e}");
            ExitCode::FAILURE
        }
    }
}
