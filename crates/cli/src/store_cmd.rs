//! `vdstream store copy`: a whole store between a folder and S3-compatible object storage.

use anyhow::Result;
use clap::{Args, Subcommand};

use crate::exit::fail;
use crate::output::StoreOpts;

/// Move a whole store between a folder and S3-compatible object storage.
#[derive(Debug, Args)]
pub struct StoreArgs {
    #[command(subcommand)]
    cmd: StoreCmd,
}

#[derive(Debug, Subcommand)]
enum StoreCmd {
    Copy(CopyArgs),
}

/// Copy a store from a folder to s3://BUCKET/PREFIX, or back. Layers go first and
/// store.json last, so the destination is never a half-made store; run it again after
/// an interruption and it skips what is already whole (a half-fetched layer keeps the
/// chunks that match). Zero chunks are never sent.
///
/// The object store is named by the AWS CLI's variables: AWS_ENDPOINT_URL (e.g.
/// http://127.0.0.1:3900 for Garage), AWS_REGION (Garage: "garage"), AWS_ACCESS_KEY_ID,
/// AWS_SECRET_ACCESS_KEY; VDSTREAM_S3_TIMEOUT bounds each request with its retries
/// (seconds, default 30).
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  vdstream store copy --from /var/lib/vdstream/store --to s3://farm/site-a\n  vdstream store copy --from s3://farm/site-a --to /srv/restore --json"
)]
struct CopyArgs {
    /// Where the store is: a folder, or s3://BUCKET/PREFIX.
    #[arg(long, value_name = "DIR|s3://BUCKET/PREFIX")]
    from: String,

    /// Where it goes: s3://BUCKET/PREFIX when --from is a folder, a folder when --from is s3://.
    #[arg(long, value_name = "DIR|s3://BUCKET/PREFIX")]
    to: String,

    /// Print one JSON document on stdout (what was copied and skipped, bytes moved)
    /// instead of a line; errors too (see `vdstream --help`, "Exit status").
    #[arg(long)]
    json: bool,
}

pub fn objstore_error(e: vdstream_objstore::Error) -> anyhow::Error {
    fail(crate::exit::of_objstore(&e), e.to_string())
}

pub fn run(args: StoreArgs) -> Result<()> {
    match args.cmd {
        StoreCmd::Copy(a) => copy(a),
    }
}

fn copy(a: CopyArgs) -> Result<()> {
    use vdstream_objstore::copy::{self, Side};
    let from = Side::parse(&a.from).map_err(objstore_error)?;
    let to = Side::parse(&a.to).map_err(objstore_error)?;
    let opts = StoreOpts {
        store: None,
        json: a.json,
    };
    let bar = opts.bar("copying layers");
    let report = copy::copy(&from, &to, copy::open_bucket, &mut |d, t| bar.update(d, t))
        .map_err(objstore_error)?;
    drop(bar);
    let doc = serde_json::to_value(&report)?;
    opts.emit(doc, || {
        format!(
            "copied {} vDisk(s), {} layer(s) ({} skipped as already whole), {} metadata file(s) from {} to {}: {} of layers, {} moved",
            report.vdisks,
            report.layers,
            report.layers_skipped,
            report.metadata_files,
            report.from,
            report.to,
            crate::size::format_size(report.layer_bytes),
            crate::size::format_size(report.bytes_moved)
        )
    });
    Ok(())
}
