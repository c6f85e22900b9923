//! `vdstream version …`: new, promote, revert, override and merge of a vDisk's versions.
//! Wiring only: the rules live in vdstream-store (version.rs, merge.rs).

use anyhow::Result;
use clap::{Args, Subcommand, ValueEnum};
use serde_json::json;
use vdstream_store::merge::{AutoMerge, MergeKind, MergeOutcome};
use vdstream_store::{Access, Store, Timestamp};

use crate::output::StoreOpts;

/// Manage the versions of a vDisk: maintenance → test → production.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vdstream version new win11                       a maintenance version on top
  vdstream serve-image --vdisk win11@maintenance   the maintenance target writes to it
  vdstream version promote win11 3 --to test
  vdstream version promote win11 3 --to production --at +2h
  vdstream version revert win11 3                  one step back (maintenance: discard)
  vdstream version override win11 2                pin production to version 2
  vdstream version merge win11 [--base]")]
pub struct VersionArgs {
    #[command(subcommand)]
    command: VersionCommand,

    #[command(flatten)]
    opts: StoreOpts,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Stage {
    Test,
    Production,
}

#[derive(Debug, Subcommand)]
enum VersionCommand {
    /// Make a maintenance version on top of the newest layer (one at a time).
    New {
        name: String,
        /// What this version is for (kept in the metadata).
        #[arg(long)]
        note: Option<String>,
    },
    /// Promote a version to test or production.
    Promote {
        name: String,
        version: u32,
        #[arg(long, value_enum)]
        to: Stage,
        /// Release to production from this time: RFC 3339 (2025-03-01T22:00:00Z) or +DURATION (+2h).
        #[arg(long, value_name = "TIME")]
        at: Option<String>,
    },
    /// One step back: production → test, test → maintenance (newest only), maintenance → discarded.
    Revert { name: String, version: u32 },
    /// Pin the version production targets boot (or --clear the pin).
    Override {
        name: String,
        #[arg(required_unless_present = "clear")]
        version: Option<u32>,
        #[arg(long, conflicts_with = "version")]
        clear: bool,
    },
    /// Merge all versions into one new version, or with --base into a new base.
    Merge {
        name: String,
        #[arg(long)]
        base: bool,
    },
}

pub fn run(args: VersionArgs) -> Result<()> {
    let o = &args.opts;
    let store = o.open()?;
    match args.command {
        VersionCommand::New { name, note } => {
            let v = store.new_version(&name, note)?;
            let (auto, said) = auto_merge(&store, o, &name)?;
            o.emit(json!({"vdisk": name, "version": v, "auto_merge": auto}), || {
                format!("created version {} of {name} in maintenance ({}); serve it to the maintenance target with `vdstream serve-image --vdisk {name}@maintenance`{said}", v.number, v.file)
            });
        }
        VersionCommand::Promote { name, version, to, at } => {
            let to = match to { Stage::Test => Access::Test, Stage::Production => Access::Production };
            let at = at.map(|t| Timestamp::parse_at(&t, Timestamp::now())).transpose()?;
            let v = store.promote(&name, version, to, at)?;
            let (auto, said) = auto_merge(&store, o, &name)?;
            o.emit(json!({"vdisk": name, "version": v, "auto_merge": auto}), || {
                format!("version {version} of {name} is now {}{}; targets get it when they next connect{said}",
                    to.name(), at.map(|t| format!(" from {t}")).unwrap_or_default())
            });
        }
        VersionCommand::Revert { name, version } => {
            let r = store.revert(&name, version)?;
            o.emit(json!({"vdisk": name, "version": version, "result": r}), || match r {
                vdstream_store::version::Reverted::To(a) => format!("version {version} of {name} is back in {}", a.name()),
                vdstream_store::version::Reverted::Discarded => format!("version {version} of {name} was discarded; its file is deleted once no target has it open"),
            });
        }
        VersionCommand::Override { name, version, clear } => {
            let pin = if clear { None } else { version };
            store.set_override(&name, pin)?;
            o.emit(json!({"vdisk": name, "override": pin}), || match pin {
                Some(v) => format!("production targets of {name} now boot version {v} (from their next connection)"),
                None => format!("override of {name} cleared: production targets boot the newest production version"),
            });
        }
        VersionCommand::Merge { name, base } => {
            let kind = if base { MergeKind::Base } else { MergeKind::Updates };
            let bar = o.bar(&format!("merging {name}"));
            let out = store.merge(&name, kind, false, &mut |d, t| bar.update(d, t))?;
            drop(bar);
            o.emit(json!({"vdisk": name, "merge": out}), || describe_merge(&name, &out));
        }
    }
    Ok(())
}

fn describe_merge(name: &str, out: &MergeOutcome) -> String {
    let merged = out.merged.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
    let mut s = format!("{}merged versions {merged} of {name} into {} ({}, {:.1} s)",
        if out.automatic { "automatically " } else { "" }, out.new_layer, out.file, out.seconds);
    if !out.still_in_use.is_empty() {
        s.push_str(&format!("; still read by running targets, deleted once they disconnect: {}", out.still_in_use.join(", ")));
    }
    s
}

/// After a change: runs the automatic merge when --max-versions is exceeded. Returns its
/// JSON (null when nothing happened) and a human sentence (empty, or starting with a newline).
pub fn auto_merge(store: &Store, o: &StoreOpts, name: &str) -> Result<(serde_json::Value, String)> {
    let bar = o.bar(&format!("merging {name} (over --max-versions)"));
    let r = store.auto_merge(name, &mut |d, t| bar.update(d, t));
    drop(bar);
    let r = match r {
        Ok(r) => r,
        Err(e) => {
            return Ok((json!({"error": e.to_string()}), format!(
                "\nthe automatic merge of {name} failed: {e}; the change above stands; run `vdstream version merge {name}` later")))
        }
    };
    Ok(match r {
        None => (serde_json::Value::Null, String::new()),
        Some(AutoMerge::Merged(out)) => (json!(out), format!("\n{} (over --max-versions)", describe_merge(name, &out))),
        Some(AutoMerge::Deferred(why)) => (
            json!({"deferred": why}),
            format!("\n{name} has more versions than --max-versions; the automatic merge waits: {why}"),
        ),
    })
}
