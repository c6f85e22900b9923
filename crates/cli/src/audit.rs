//! `vdstream audit [NAME]`: the store's audit trail, who changed what and when.

use anyhow::Result;
use clap::Args;
use vdstream_store::audit;

use crate::output::StoreOpts;

/// Show who changed what and when in the store (oldest first).
#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  vdstream audit\n  vdstream audit win11 --limit 20 --json")]
pub struct AuditArgs {
    /// Only entries about this vDisk.
    #[arg(value_name = "NAME")]
    name: Option<String>,

    /// Only the last N entries.
    #[arg(long, value_name = "N")]
    limit: Option<usize>,

    #[command(flatten)]
    opts: StoreOpts,
}

pub fn run(args: AuditArgs) -> Result<()> {
    let store = args.opts.open()?;
    let doc = vdstream_store::documents::audit(&store, args.name.as_deref(), args.limit)?;
    let entries: Vec<audit::AuditEntry> = serde_json::from_value(doc.clone())?;
    args.opts.emit(doc, || {
        entries
            .iter()
            .map(|e| {
                let via = e.client.as_deref().map(|c| format!(" via API from {c}")).unwrap_or_default();
                format!("{}  {}@{} (pid {}{via})  {:<22} {:<16} {}", e.time, e.user, e.host, e.pid, e.action, e.vdisk, e.details)
            })
            .collect::<Vec<_>>()
            .join("\n")
    });
    Ok(())
}
