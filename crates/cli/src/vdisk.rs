//! `vdstream vdisk …`: create, import, list, info, export, delete, set, compact and gc of
//! vDisks in the store. Wiring only: every rule lives in vdstream-store. `list` and `info`
//! (also `show`) go to a server's API instead with `--server URL`; their human text is
//! made from the JSON document, so both print the same.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Subcommand, ValueEnum};
use serde_json::{json, Value};
use vdstream_store::meta::DEFAULT_MAX_VERSIONS;
use vdstream_store::vdisk::{NewVdisk, VdiskInfo};
use vdstream_store::{documents, DiskAccess, LayerFormat, Selector, VdiskMeta};

use crate::output::StoreOpts;
use crate::remote::{seg, ServerOpt};
use crate::size::{format_size, parse_size};

/// Manage vDisks: golden images kept as a base plus a chain of versions.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vdstream vdisk create win11 --size 64G
  vdstream vdisk import ubuntu ubuntu.qcow2
  vdstream vdisk list
  vdstream vdisk info win11
  vdstream vdisk check win11                    qemu-img check of every layer, and the metadata
  vdstream vdisk export win11@production win11.raw
The store is $VDSTREAM_STORE, else /var/lib/vdstream/store, unless --store DIR says.")]
pub struct VdiskArgs {
    #[command(subcommand)]
    command: VdiskCommand,

    #[command(flatten)]
    opts: StoreOpts,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum AccessArg {
    /// Shared and read-only; each target writes to its own write cache.
    Standard,
    /// One writer, no cache, no versions.
    Private,
}

impl From<AccessArg> for DiskAccess {
    fn from(a: AccessArg) -> Self {
        match a {
            AccessArg::Standard => DiskAccess::Standard,
            AccessArg::Private => DiskAccess::Private,
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum FormatArg {
    Raw,
    Qcow2,
}

#[derive(Debug, Subcommand)]
enum VdiskCommand {
    /// Create an empty vDisk (creates the store if there is none).
    Create {
        /// Name of the new vDisk: letters, digits, '.', '_', '-' (e.g. win11).
        name: String,
        /// Guest size, e.g. 64M, 40G (binary units).
        #[arg(long, value_parser = parse_size)]
        size: u64,
        /// Versions kept (besides one in maintenance) before they are merged automatically.
        #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_VERSIONS)]
        max_versions: u32,
        /// standard: shared read-only, each target writes to its own cache; private: one
        /// machine writes to it directly.
        #[arg(long, value_enum, default_value = "standard")]
        access: AccessArg,
    },
    /// Import a disk image: raw natively; qcow2, vhdx, vhd (vpc), vmdk, vdi through qemu-img
    /// convert. The image is checked first (qemu-img check, its size against its header) and
    /// a damaged one is refused.
    Import {
        /// Name of the new vDisk: letters, digits, '.', '_', '-' (e.g. ubuntu).
        name: String,
        /// The disk image to import (raw, qcow2, vhdx, vhd, vmdk or vdi; its format is detected),
        /// e.g. ubuntu.qcow2. It is only read.
        file: PathBuf,
        /// A differencing child of FILE (then of the previous --version): a differencing VHD
        /// of a .vhd, an AVHDX of a .vhdx; imported as a version released to production;
        /// repeat in chain order (PVS vDisk chains). Read natively, since qemu cannot.
        #[arg(long = "version", value_name = "CHILD")]
        versions: Vec<PathBuf>,
        /// Versions kept (besides one in maintenance) before they are merged automatically.
        #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_VERSIONS)]
        max_versions: u32,
        /// standard: shared read-only, each target writes to its own cache; private: one
        /// machine writes to it directly.
        #[arg(long, value_enum, default_value = "standard")]
        access: AccessArg,
    },
    /// List the vDisks.
    List {
        #[command(flatten)]
        api: ServerOpt,
    },
    /// Show a vDisk: versions, what each kind of target gets, files and who uses them.
    #[command(visible_alias = "show")]
    Info {
        /// The vDisk's name: letters, digits, '.', '_', '-' (e.g. win11).
        #[arg(add = crate::completion::vdisks())]
        name: String,
        #[command(flatten)]
        api: ServerOpt,
    },
    /// Check every layer of a vDisk: qemu-img check of each file, and that the files agree
    /// with the metadata (present, not truncated, the right size and backing file). Exits
    /// non-zero when anything is wrong.
    Check {
        /// NAME (every layer) or NAME@V (the chain under V: a number, base, production, test, maintenance, latest).
        #[arg(add = crate::completion::vdisks())]
        reference: String,
    },
    /// Write a layer's whole content to a file (raw, sparse; or standalone qcow2).
    Export {
        /// NAME or NAME@V (V: a number, base, production, test, maintenance, latest).
        #[arg(add = crate::completion::vdisks())]
        reference: String,
        /// The file to write, e.g. win11.raw (refused if it exists, unless --force).
        file: PathBuf,
        /// raw: a sparse raw image; qcow2: a standalone qcow2 image (no backing file).
        #[arg(long, value_enum, default_value = "raw")]
        format: FormatArg,
        /// Overwrite FILE if it exists.
        #[arg(long)]
        force: bool,
    },
    /// Delete a vDisk and all its files (refused while a target uses it).
    Delete {
        /// The vDisk's name: letters, digits, '.', '_', '-' (e.g. win11).
        #[arg(add = crate::completion::vdisks())]
        name: String,
    },
    /// Change settings of a vDisk.
    Set {
        /// The vDisk's name: letters, digits, '.', '_', '-' (e.g. win11).
        #[arg(add = crate::completion::vdisks())]
        name: String,
        /// Versions kept (besides one in maintenance) before they are merged automatically;
        /// lowering it merges at once.
        #[arg(long, value_name = "N")]
        max_versions: Option<u32>,
        /// standard (shared, read-only, one cache per target) or private (one writer).
        #[arg(long, value_enum)]
        access: Option<AccessArg>,
    },
    /// Rewrite every layer but the maintenance one without zero or unused clusters.
    Compact {
        /// The vDisk's name: letters, digits, '.', '_', '-' (e.g. win11).
        #[arg(add = crate::completion::vdisks())]
        name: String,
    },
    /// Delete retired files no target uses any more, and leftovers of crashed commands.
    Gc,
}

pub fn run(args: VdiskArgs) -> Result<()> {
    let o = &args.opts;
    match args.command {
        VdiskCommand::Create {
            name,
            size,
            max_versions,
            access,
        } => {
            let (store, created, m) = o.in_new_or_existing_store(|store| {
                Ok(store.create_vdisk(
                    &name,
                    size,
                    NewVdisk {
                        access: access.into(),
                        max_versions,
                    },
                )?)
            })?;
            o.emit(
                json!({"store": store.root(), "store_created": created, "vdisk": m}),
                || {
                    format!(
                        "created vDisk {name} ({}, {} access) with base {}",
                        format_size(m.size),
                        access_name(m.access),
                        m.base.file
                    )
                },
            );
        }
        VdiskCommand::Import {
            name,
            file,
            versions,
            max_versions,
            access,
        } => {
            let bar = o.bar(&format!("importing {}", file.display()));
            let opts = NewVdisk {
                access: access.into(),
                max_versions,
            };
            let (store, created, (m, report, made)) = o.in_new_or_existing_store(|store| {
                Ok(if versions.is_empty() {
                    let (m, r) =
                        store.import_vdisk(&name, &file, opts, &mut |d, t| bar.update(d, t))?;
                    (m, r, vec![])
                } else {
                    store
                        .import_chain(&name, &file, &versions, opts, &mut |d, t| bar.update(d, t))?
                })
            })?;
            drop(bar);
            o.emit(json!({"store": store.root(), "store_created": created, "vdisk": m, "import": report, "versions": made}), || {
                let mut text = format!("imported {} ({} image, {}) as vDisk {name} with base {} ({})",
                    file.display(), report.source_format, format_size(report.size), report.base_file, report.method);
                for w in &report.warnings {
                    text.push_str(&format!("\nnote: {w}"));
                }
                for v in &made {
                    text.push_str(&format!("\nversion {} ({}, production) from {}", v.number, v.file, v.note.as_deref().unwrap_or("").trim_start_matches("imported from ")));
                }
                text
            });
        }
        VdiskCommand::List { api } => {
            let (doc, place) = match api.client_for(o)? {
                Some(c) => (c.get("/api/v1/vdisks")?, c.url().to_string()),
                None => {
                    let store = o.open()?;
                    (
                        json!(documents::vdisk_list(&store)?),
                        store.root().display().to_string(),
                    )
                }
            };
            print_list(o, doc, &place)?;
        }
        VdiskCommand::Info { name, api } => {
            let doc = match api.client_for(o)? {
                Some(c) => c.get(&format!("/api/v1/vdisks/{}", seg(&name)))?,
                None => json!(documents::vdisk_show(&o.open()?, &name)?),
            };
            print_info(o, doc)?;
        }
        VdiskCommand::Check { reference } => {
            let store = o.open()?;
            let (name, sel) = match reference.split_once('@') {
                Some(_) => {
                    let (n, s) =
                        vdstream_store::names::parse_ref(&reference, Selector::Production)?;
                    (n, Some(s))
                }
                None => (reference.clone(), None),
            };
            let report = store.check_layers(&name, sel)?;
            let bad = report
                .layers
                .iter()
                .filter(|l| !l.problems.is_empty())
                .count();
            o.emit(serde_json::to_value(&report)?, || {
                let mut lines = Vec::new();
                for l in &report.layers {
                    let verdict = if l.problems.is_empty() { "ok".to_string() } else { format!("DAMAGED: {}", l.problems.join("; ")) };
                    lines.push(format!("  {:<12} {:<28} {verdict}", l.layer.to_string(), l.file));
                    lines.extend(l.notes.iter().map(|n| format!("  {:<12} {:<28} note: {n}", "", "")));
                }
                lines.insert(0, if report.ok {
                    format!("vDisk {name}: {} layer(s) checked, no problems (qemu-img check and metadata)", report.layers.len())
                } else {
                    format!("vDisk {name}: {bad} of {} layer(s) damaged", report.layers.len())
                });
                lines.join("\n")
            });
            if !report.ok {
                return Err(crate::exit::fail(
                    crate::exit::Kind::Io,
                    format!("vDisk {name}: {bad} of {} layer(s) damaged (listed above); restore the files from a backup, or revert or delete the versions", report.layers.len()),
                ));
            }
        }
        VdiskCommand::Export {
            reference,
            file,
            format,
            force,
        } => {
            let store = o.open()?;
            let (name, sel) = vdstream_store::names::parse_ref(&reference, Selector::Production)?;
            let fmt = match format {
                FormatArg::Raw => LayerFormat::Raw,
                FormatArg::Qcow2 => LayerFormat::Qcow2,
            };
            let bar = o.bar(&format!("exporting {reference}"));
            let layer =
                store.export(&name, sel, &file, fmt, force, &mut |d, t| bar.update(d, t))?;
            drop(bar);
            o.emit(
                json!({"vdisk": name, "layer": layer, "file": file, "format": fmt}),
                || {
                    format!(
                        "exported {layer} of vDisk {name} to {} ({})",
                        file.display(),
                        fmt.name()
                    )
                },
            );
        }
        VdiskCommand::Delete { name } => {
            let store = o.open()?;
            let files = store.delete_vdisk(&name)?;
            o.emit(json!({"vdisk": name, "deleted": files}), || {
                format!("deleted vDisk {name} ({} files)", files.len())
            });
        }
        VdiskCommand::Set {
            name,
            max_versions,
            access,
        } => {
            if max_versions.is_none() && access.is_none() {
                usage!("nothing to set: give --max-versions N and/or --access standard|private");
            }
            let store = o.open()?;
            let m = store.set_vdisk(&name, max_versions, access.map(Into::into))?;
            let (auto, said) = crate::version::auto_merge(&store, o, &name)?;
            o.emit(json!({"vdisk": m, "auto_merge": auto}), || {
                format!(
                    "vDisk {name}: {} access, max {} versions{said}",
                    access_name(m.access),
                    m.max_versions
                )
            });
        }
        VdiskCommand::Compact { name } => {
            let store = o.open()?;
            let bar = o.bar(&format!("compacting {name}"));
            let layers = store.compact(&name, &mut |d, t| bar.update(d, t))?;
            drop(bar);
            let (before, after) = layers
                .iter()
                .fold((0, 0), |(b, a), l| (b + l.bytes_before, a + l.bytes_after));
            o.emit(json!({"vdisk": name, "layers": layers, "bytes_before": before, "bytes_after": after}), || {
                let mut lines: Vec<String> = layers.iter().map(|l| format!("  {:<12} {:<28} {:>10} -> {}", l.layer.to_string(), l.file, format_size(l.bytes_before), format_size(l.bytes_after))).collect();
                lines.insert(0, format!("compacted vDisk {name}: {} -> {}", format_size(before), format_size(after)));
                lines.join("\n")
            });
        }
        VdiskCommand::Gc => {
            let store = o.open()?;
            let deleted = store.gc()?;
            o.emit(
                json!(deleted
                    .iter()
                    .map(|(v, f)| json!({"vdisk": v, "file": f}))
                    .collect::<Vec<_>>()),
                || {
                    if deleted.is_empty() {
                        "nothing to delete".to_string()
                    } else {
                        deleted
                            .iter()
                            .map(|(v, f)| format!("deleted {v}/{f}"))
                            .collect::<Vec<_>>()
                            .join("\n")
                    }
                },
            );
        }
    }
    Ok(())
}

/// `vdisk list`, from its JSON document (`place`: the store or the server it came from).
fn print_list(o: &StoreOpts, doc: Value, place: &str) -> Result<()> {
    let list: Vec<Result<VdiskMeta, (String, String)>> = doc
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|d| {
            serde_json::from_value::<VdiskMeta>(d.clone()).map_err(|e| {
                (
                    d["name"].as_str().unwrap_or("?").to_string(),
                    d["error"]
                        .as_str()
                        .map_or_else(|| format!("unreadable entry: {e}"), str::to_string),
                )
            })
        })
        .collect();
    o.emit(doc, || {
        if list.is_empty() {
            return format!("no vDisks in {place}");
        }
        let mut lines = vec![format!(
            "{:<24} {:>10} {:<9} {:>8} {:<12}",
            "NAME", "SIZE", "ACCESS", "VERSIONS", "PRODUCTION"
        )];
        for m in &list {
            lines.push(match m {
                Ok(m) => {
                    let prod = vdstream_store::select(
                        m,
                        Selector::Production,
                        vdstream_store::Timestamp::now(),
                    )
                    .map(|l| l.tag())
                    .unwrap_or_default();
                    format!(
                        "{:<24} {:>10} {:<9} {:>8} {:<12}",
                        m.name,
                        format_size(m.size),
                        access_name(m.access),
                        m.versions.len(),
                        prod
                    )
                }
                Err((n, e)) => format!("{n:<24} error: {e}"),
            });
        }
        lines.join("\n")
    });
    Ok(())
}

/// `vdisk info` / `vdisk show`, from its JSON document.
fn print_info(o: &StoreOpts, doc: Value) -> Result<()> {
    let info: VdiskInfo = serde_json::from_value(doc.clone())?;
    o.emit(doc, || {
        let m = &info.meta;
        let mut lines = vec![
            format!("vDisk {} — {}, {} access, max {} versions, created {} by {}", m.name, format_size(m.size), access_name(m.access), m.max_versions, m.created, m.created_by),
            format!("production targets get {}; test targets get {}{}", info.production, info.test,
                info.maintenance.map(|n| format!("; version {n} is in maintenance")).unwrap_or_default()),
        ];
        if let Some(o) = m.override_version {
            lines.push(format!("override: production is pinned to version {o}"));
        }
        for l in &info.layers {
            let v = match l.layer { vdstream_store::Layer::Version(n) => m.version(n), _ => None };
            let what = match v {
                None => format!("base     {}", m.base.format.name()),
                Some(v) => format!("{:<8} {}{}{}", v.number, v.access.name(),
                    v.scheduled_at.map(|t| format!(" from {t}")).unwrap_or_default(),
                    v.note.as_ref().map(|n| format!(" ({n})")).unwrap_or_default()),
            };
            let users = if l.in_use_by.is_empty() { String::new() } else { format!("  in use by {}", l.in_use_by.join(", ")) };
            lines.push(format!("  {what:<40} {:<28} {:>10}{users}", l.file, format_size(l.allocated)));
            if !l.problems.is_empty() {
                lines.push(format!("    DAMAGED: {}", l.problems.join("; ")));
            }
        }
        let damaged = info.layers.iter().filter(|l| !l.problems.is_empty()).count();
        if damaged > 0 {
            lines.push(format!("{damaged} layer(s) damaged: run `vdstream vdisk check {}` for a full check (qemu-img check of every layer)", m.name));
        } else {
            lines.push(format!("layer files look sound (size and headers); `vdstream vdisk check {}` checks them in full", m.name));
        }
        if !m.retired.is_empty() {
            lines.push(format!("retired, deleted once no target reads them: {}", m.retired.join(", ")));
        }
        lines.join("\n")
    });
    Ok(())
}

pub fn access_name(a: DiskAccess) -> &'static str {
    match a {
        DiskAccess::Standard => "standard",
        DiskAccess::Private => "private",
    }
}
