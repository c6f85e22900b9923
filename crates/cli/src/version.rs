//! `vdstream version …`: list, new, promote, revert, override and merge of a vDisk's
//! versions. Wiring only: the rules live in vdstream-store (version.rs, merge.rs); list,
//! new, promote and revert also go to a server's API with `--server URL`.

use anyhow::Result;
use clap::{Args, Subcommand, ValueEnum};
use serde_json::json;
use vdstream_store::version::Reverted;
use vdstream_store::{documents, Access, Layer, Store, Version};
use vdstream_store::{merge::MergeOutcome, meta::MergeKind};

use crate::output::StoreOpts;
use crate::remote::{seg, ServerOpt};

/// Manage the versions of a vDisk: maintenance → test → production.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vdstream version list win11                      the chain and what each kind of target gets
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
    /// List the versions of a vDisk, in chain order, and what each kind of target gets.
    List {
        /// The vDisk's name (e.g. win11).
        #[arg(add = crate::completion::vdisks())]
        name: String,
        #[command(flatten)]
        api: ServerOpt,
    },
    /// Make a maintenance version on top of the newest layer (one at a time).
    New {
        /// The vDisk's name (e.g. win11).
        #[arg(add = crate::completion::vdisks())]
        name: String,
        /// What this version is for (kept in the metadata).
        #[arg(long)]
        note: Option<String>,
        /// Make the change only if the vDisk's metadata is still at generation G (the
        /// `generation` that `version list --json` showed, the API's ETag); else exit 4
        /// and change nothing. Two admins (or scripts) acting on what they read cannot
        /// both win.
        #[arg(long, value_name = "G")]
        expect_generation: Option<u64>,
        #[command(flatten)]
        api: ServerOpt,
    },
    /// Promote a version to test or production.
    Promote {
        /// The vDisk's name (e.g. win11).
        #[arg(add = crate::completion::vdisks())]
        name: String,
        /// The version's number, as `version list` shows it (e.g. 3).
        version: u32,
        /// The stage it moves to: test (test targets boot it) or production (every
        /// production target boots it from its next connection, or from --at).
        #[arg(long, value_enum)]
        to: Stage,
        /// Release to production from this time: RFC 3339 (2025-03-01T22:00:00Z) or +DURATION (+2h).
        #[arg(long, value_name = "TIME")]
        at: Option<String>,
        /// Make the change only if the vDisk's metadata is still at generation G (the
        /// `generation` that `version list --json` showed, the API's ETag); else exit 4
        /// and change nothing. Two admins (or scripts) acting on what they read cannot
        /// both win.
        #[arg(long, value_name = "G")]
        expect_generation: Option<u64>,
        #[command(flatten)]
        api: ServerOpt,
    },
    /// One step back: production → test, test → maintenance (newest only), maintenance → discarded.
    Revert {
        /// The vDisk's name (e.g. win11).
        #[arg(add = crate::completion::vdisks())]
        name: String,
        /// The version's number, as `version list` shows it (e.g. 3).
        version: u32,
        /// Make the change only if the vDisk's metadata is still at generation G (the
        /// `generation` that `version list --json` showed, the API's ETag); else exit 4
        /// and change nothing. Two admins (or scripts) acting on what they read cannot
        /// both win.
        #[arg(long, value_name = "G")]
        expect_generation: Option<u64>,
        #[command(flatten)]
        api: ServerOpt,
    },
    /// Pin the version production targets boot (or --clear the pin).
    Override {
        /// The vDisk's name (e.g. win11).
        #[arg(add = crate::completion::vdisks())]
        name: String,
        /// The version production targets boot from their next connection, whatever was
        /// promoted later (e.g. 2 to go back to it while 3 is looked at).
        #[arg(required_unless_present = "clear")]
        version: Option<u32>,
        /// Remove the pin: production targets boot the newest production version again.
        #[arg(long, conflicts_with = "version")]
        clear: bool,
    },
    /// Merge the versions up to the one production boots into one new version (--base: into a new base).
    Merge {
        /// The vDisk's name (e.g. win11).
        #[arg(add = crate::completion::vdisks())]
        name: String,
        /// Merge the base too: the chain up to production becomes one new base file (no
        /// versions below it); without it, the versions merge into one version on the base.
        #[arg(long)]
        base: bool,
        /// Make the change only if the vDisk's metadata is still at generation G (the
        /// `generation` that `version list --json` showed, the API's ETag); else exit 4
        /// and change nothing. Two admins (or scripts) acting on what they read cannot
        /// both win.
        #[arg(long, value_name = "G")]
        expect_generation: Option<u64>,
        #[command(flatten)]
        api: ServerOpt,
    },
}

pub fn run(args: VersionArgs) -> Result<()> {
    let o = &args.opts;
    match args.command {
        VersionCommand::List { name, api } => {
            let doc = match api.client_for(o)? {
                Some(c) => c.get(&format!("/api/v1/vdisks/{}/versions", seg(&name)))?,
                None => json!(documents::version_list(&o.open()?, &name)?),
            };
            print_list(o, doc)?;
        }
        VersionCommand::New {
            name,
            note,
            expect_generation: g,
            api,
        } => {
            let client = api.client_for(o)?;
            // Where the maintenance target finds the new version: a server exports it as
            // maintenance/NAME; serve-image is for a store that no server serves.
            let serve = if client.is_some() {
                format!("the server exports it to the maintenance target as maintenance/{name}")
            } else {
                format!("a `vdstream server` on this store exports it to the maintenance target as maintenance/{name}; with no server, serve it alone with `vdstream serve-image --vdisk {name}@maintenance`")
            };
            let doc = match client {
                Some(c) => c.if_match(g).post(
                    &format!("/api/v1/vdisks/{}/versions", seg(&name)),
                    &json!({"note": note}),
                )?,
                None => {
                    let bar = o.bar(&format!("merging {name} (over --max-versions)"));
                    json!(documents::version_new(
                        &o.open()?.expecting(g),
                        &name,
                        note,
                        &mut |d, t| { bar.update(d, t) }
                    )?)
                }
            };
            let v: Version = serde_json::from_value(doc["version"].clone())?;
            let said = describe_auto_merge(&name, &doc["auto_merge"]);
            o.emit(doc, || {
                format!(
                    "created version {} of {name} in maintenance ({}); {serve}{said}",
                    v.number, v.file
                )
            });
        }
        VersionCommand::Promote {
            name,
            version,
            to,
            at,
            expect_generation: g,
            api,
        } => {
            let to = match to {
                Stage::Test => Access::Test,
                Stage::Production => Access::Production,
            };
            let doc = match api.client_for(o)? {
                Some(c) => c.if_match(g).post(
                    &format!("/api/v1/vdisks/{}/versions/{version}/promote", seg(&name)),
                    &json!({"to": to, "at": at}),
                )?,
                None => {
                    let bar = o.bar(&format!("merging {name} (over --max-versions)"));
                    json!(documents::version_promote(
                        &o.open()?.expecting(g),
                        &name,
                        version,
                        to,
                        at.as_deref(),
                        &mut |d, t| bar.update(d, t),
                    )?)
                }
            };
            let v: Version = serde_json::from_value(doc["version"].clone())?;
            let said = describe_auto_merge(&name, &doc["auto_merge"]);
            o.emit(doc, || {
                format!("version {version} of {name} is now {}{}; targets get it when they next connect{said}",
                    v.access.name(), v.scheduled_at.map(|t| format!(" from {t}")).unwrap_or_default())
            });
        }
        VersionCommand::Revert {
            name,
            version,
            expect_generation: g,
            api,
        } => {
            let doc = match api.client_for(o)? {
                Some(c) => c.if_match(g).post(
                    &format!("/api/v1/vdisks/{}/revert", seg(&name)),
                    &json!({"version": version}),
                )?,
                None => json!(documents::version_revert(
                    &o.open()?.expecting(g),
                    &name,
                    version
                )?),
            };
            let r: Reverted = serde_json::from_value(doc["result"].clone())?;
            o.emit(doc, || match r {
                Reverted::To(a) => format!("version {version} of {name} is back in {}", a.name()),
                Reverted::Discarded => format!("version {version} of {name} was discarded; its file is deleted once no target has it open"),
            });
        }
        VersionCommand::Override {
            name,
            version,
            clear,
        } => {
            let store = o.open()?;
            let pin = if clear { None } else { version };
            store.set_override(&name, pin)?;
            o.emit(json!({"vdisk": name, "override": pin}), || match pin {
                Some(v) => format!("production targets of {name} now boot version {v} (from their next connection)"),
                None => format!("override of {name} cleared: production targets boot the newest production version"),
            });
        }
        VersionCommand::Merge {
            name,
            base,
            expect_generation: g,
            api,
        } => {
            let kind = if base {
                MergeKind::Base
            } else {
                MergeKind::Updates
            };
            let doc = match api.client_for(o)? {
                Some(c) => c.if_match(g).post(
                    &format!("/api/v1/vdisks/{}/merge", seg(&name)),
                    &json!({"base": base}),
                )?,
                None => {
                    let store = o.open()?.expecting(g);
                    let bar = o.bar(&format!("merging {name}"));
                    json!(documents::version_merge(
                        &store,
                        &name,
                        kind,
                        &mut |d, t| bar.update(d, t)
                    )?)
                }
            };
            let out: MergeOutcome = serde_json::from_value(doc["merge"].clone())?;
            o.emit(doc, || describe_merge(&name, &out));
        }
    }
    Ok(())
}

/// `version list`, from its JSON document.
fn print_list(o: &StoreOpts, doc: serde_json::Value) -> Result<()> {
    let name = doc["vdisk"].as_str().unwrap_or_default().to_string();
    let versions: Vec<Version> = serde_json::from_value(doc["versions"].clone())?;
    let production: Layer = serde_json::from_value(doc["production"].clone())?;
    let test: Layer = serde_json::from_value(doc["test"].clone())?;
    let pin = doc["override"].as_u64();
    o.emit(doc, || {
        let mut lines = vec![
            format!(
                "vDisk {name}: production targets get {production}; test targets get {test}{}",
                pin.map(|p| format!(" (production pinned to version {p})"))
                    .unwrap_or_default()
            ),
            format!(
                "  {:<8} {:<12} {:<22} {:<20} {}",
                "VERSION", "ACCESS", "CREATED", "BY", "NOTE"
            ),
            "  base".to_string(),
        ];
        for v in &versions {
            let access = match v.scheduled_at {
                Some(t) => format!("{} from {t}", v.access.name()),
                None => v.access.name().to_string(),
            };
            lines.push(format!(
                "  {:<8} {:<12} {:<22} {:<20} {}",
                v.number,
                access,
                v.created.to_string(),
                v.created_by,
                vdstream_store::names::printable(v.note.as_deref().unwrap_or(""))
            ));
        }
        lines.join("\n")
    });
    Ok(())
}

/// The sentence about an automatic merge, from its JSON (see `documents::auto_merge`):
/// empty, or starting with a newline.
pub fn describe_auto_merge(name: &str, doc: &serde_json::Value) -> String {
    if doc.is_null() {
        return String::new();
    }
    if let Some(e) = doc.get("error").and_then(|e| e.as_str()) {
        return format!("\nthe automatic merge of {name} failed: {e}; the change above stands; run `vdstream version merge {name}` later");
    }
    if let Some(why) = doc.get("deferred").and_then(|e| e.as_str()) {
        return format!(
            "\n{name} has more versions than --max-versions; the automatic merge waits: {why}"
        );
    }
    match serde_json::from_value::<MergeOutcome>(doc.clone()) {
        Ok(out) => format!("\n{} (over --max-versions)", describe_merge(name, &out)),
        Err(_) => format!("\n{name} was merged automatically (over --max-versions)"),
    }
}

fn describe_merge(name: &str, out: &MergeOutcome) -> String {
    let merged = out
        .merged
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let mut s = format!(
        "{}merged versions {merged} of {name} into {} ({}, {:.1} s)",
        if out.automatic { "automatically " } else { "" },
        out.new_layer,
        out.file,
        out.seconds
    );
    if let Some(v) = out.repointed {
        s.push_str(&format!(
            "; version {v} above it now backs onto {} (same content)",
            out.file
        ));
    }
    if let Some(m) = out.override_moved {
        match m.to {
            Some(to) => s.push_str(&format!("; the override moved from version {} to version {to}", m.from)),
            None => s.push_str(&format!("; the override of version {} was cleared: production boots the new base, the same content", m.from)),
        }
    }
    if !out.targets_moved.is_empty() {
        s.push_str(&format!(
            "; targets pinned to a merged version now boot {} (same content): {}",
            out.new_layer,
            out.targets_moved.join(", ")
        ));
    }
    if !out.still_in_use.is_empty() {
        s.push_str(&format!(
            "; still read by running targets, deleted once they disconnect: {}",
            out.still_in_use.join(", ")
        ));
    }
    s
}

/// After a change: runs the automatic merge when --max-versions is exceeded. Returns its
/// JSON (null when nothing happened) and a human sentence (empty, or starting with a newline).
pub fn auto_merge(store: &Store, o: &StoreOpts, name: &str) -> Result<(serde_json::Value, String)> {
    let bar = o.bar(&format!("merging {name} (over --max-versions)"));
    let doc = json!(documents::auto_merge(store, name, &mut |d, t| bar.update(d, t)));
    drop(bar);
    let said = describe_auto_merge(name, &doc);
    Ok((doc, said))
}
