//! `vdstream audit [NAME]`: the store's audit trail, who changed what and when (from the
//! store, or from a server's API with `--server URL`, at most the last 1000 entries).

use anyhow::Result;
use clap::Args;
use serde_json::json;
use vdstream_store::audit;

use crate::output::StoreOpts;
use crate::remote::{seg, ServerOpt};

/// Show who changed what and when in the store (oldest first).
#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  vdstream audit\n  vdstream audit win11 --limit 20 --json")]
pub struct AuditArgs {
    /// Only entries about this vDisk.
    #[arg(value_name = "NAME", add = crate::completion::vdisks())]
    name: Option<String>,

    /// Only the last N entries.
    #[arg(long, value_name = "N")]
    limit: Option<usize>,

    #[command(flatten)]
    opts: StoreOpts,

    #[command(flatten)]
    api: ServerOpt,
}

pub fn run(args: AuditArgs) -> Result<()> {
    let doc = match args.api.client_for(&args.opts)? {
        Some(c) => {
            // The API answers at most 1000 entries (100 unless asked).
            let mut q = vec![format!(
                "limit={}",
                args.limit.unwrap_or(1000).clamp(1, 1000)
            )];
            if let Some(n) = &args.name {
                q.push(format!("vdisk={}", seg(n)));
            }
            c.get(&format!("/api/v1/audit?{}", q.join("&")))?
        }
        None => {
            json!(vdstream_store::documents::audit(
                &args.opts.open()?,
                args.name.as_deref(),
                args.limit
            )?)
        }
    };
    let entries: Vec<audit::AuditEntry> = serde_json::from_value(doc.clone())?;
    args.opts.emit(doc, || {
        entries
            .iter()
            .map(|e| {
                let via = e
                    .client
                    .as_deref()
                    .map(|c| format!(" via API from {c}"))
                    .unwrap_or_default();
                format!(
                    "{}  {}@{} (pid {}{via})  {:<22} {:<16} {}",
                    e.time, e.user, e.host, e.pid, e.action, e.vdisk, e.details
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    });
    Ok(())
}
