//! `vdstream target add|list|show|set|remove`: the target records of the store (which
//! vDisk and version a target boots, its write cache). Wiring only: the rules live in
//! vdstream-store (targets.rs). With `--server URL` each goes to a server's API instead;
//! the human text is made from the JSON document, so the same words come out whether the
//! store or the API answered.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use serde::Deserialize;
use serde_json::{json, Value};
use vdstream_store::{documents, NewTarget, Selector, TargetChange, TargetRecord};

use crate::output::StoreOpts;
use crate::remote::{seg, ServerOpt};
use crate::size::{format_size, parse_ram, parse_size};

/// Add a target record: the machine ID boots vDisk NAME through a write cache of TYPE.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vdstream target add vm1 --vdisk win11 --cache ram-overflow --ram 512M
  vdstream target add lab-07 --vdisk win11 --cache device-disk --version test --description 'lab PC 7'
  vdstream target add render3 --vdisk ubuntu --cache server
  vdstream target add lab-pc-07 --vdisk debian --cache ram-overflow --ram 1G --mac 52:54:00:12:34:56
                                  network-booted (vdstream server --boot) by its MAC
  vdstream target add pc-07 --vdisk win11 --cache device-disk --issue-cert ./pc-07-tls
                                  and its TLS certificate (vdstream pki --help), for its agent")]
pub struct AddArgs {
    /// The target's id, usually its machine name: letters, digits, '.', '_', '-' (e.g. vm1).
    #[arg(value_name = "ID")]
    pub id: String,
    #[command(flatten)]
    pub fields: Fields,
    /// Also issue the target's certificate into this folder once the record is added
    /// (ca-cert.pem, client-cert.pem, client-key.pem: what `vdstream pki issue target ID
    /// --out DIR` writes); copy the folder to the target for its agent.
    #[arg(long, value_name = "DIR")]
    pub issue_cert: Option<PathBuf>,
    /// The CA folder for --issue-cert. Default: $VDSTREAM_CA, else /var/lib/vdstream/ca.
    #[arg(long, value_name = "DIR", requires = "issue_cert")]
    pub ca: Option<PathBuf>,
    #[command(flatten)]
    pub opts: StoreOpts,
    #[command(flatten)]
    pub api: ServerOpt,
}

/// What `add` and `set` take.
#[derive(Debug, Args)]
pub struct Fields {
    /// The vDisk it boots.
    #[arg(long, value_name = "NAME", add = crate::completion::vdisks())]
    pub vdisk: Option<String>,
    /// Write cache type: server, server-persistent, device-disk, device-disk-persistent,
    /// device-ram, ram-overflow (private is for a vDisk's one machine, not a target).
    #[arg(long, value_name = "TYPE", value_parser = clap::builder::PossibleValuesParser::new(vdstream_contract::CacheType::NAMES))]
    pub cache: Option<String>,
    /// RAM of device-ram and ram-overflow, e.g. 512M: 0 (ram-overflow only: straight to
    /// the file) or 1M to 256G.
    #[arg(long, value_name = "SIZE", value_parser = parse_ram)]
    pub ram: Option<u64>,
    /// Cap on the overflow or cache file, e.g. 10G.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub overflow_max: Option<u64>,
    /// Which version it boots: production (default), test, latest, base or a number.
    #[arg(long, value_name = "V")]
    pub version: Option<String>,
    /// Free text, e.g. where the machine is (empty with `set`: none).
    #[arg(long, value_name = "TEXT")]
    pub description: Option<String>,
    /// A MAC address of the target's network card, by which `vdstream server --boot`
    /// finds its record when it PXE-boots (repeatable; `-` separators taken; with `set`:
    /// added). One MAC belongs to one target.
    #[arg(long = "mac", value_name = "MAC")]
    pub macs: Vec<String>,
    /// Host name a network-booted target takes (default: its id; empty with `set`: none).
    #[arg(long, value_name = "NAME")]
    pub hostname: Option<String>,
    /// A local disk or partition of a network-booted target for its cache's overflow,
    /// e.g. /dev/sda2: formatted on first use, treated as empty at every boot (empty with
    /// `set`: none).
    #[arg(long, value_name = "DEV")]
    pub overflow_device: Option<String>,
}

/// Show one target record.
#[derive(Debug, Args)]
pub struct ShowArgs {
    /// The target's id, as `target list` shows it (e.g. vm1).
    #[arg(value_name = "ID", add = crate::completion::targets())]
    pub id: String,
    #[command(flatten)]
    pub opts: StoreOpts,
    #[command(flatten)]
    pub api: ServerOpt,
}

/// List the target records.
#[derive(Debug, Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub opts: StoreOpts,
    #[command(flatten)]
    pub api: ServerOpt,
}

/// Change a target record: only the fields given change.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vdstream target set vm1 --version test           boot what test targets boot, from its next attach
  vdstream target set vm1 --cache device-disk      RAM size dropped: device-disk has none
  vdstream target set lab-pc-07 --mac 52:54:00:12:34:57 --remove-mac 52:54:00:12:34:56   a new network card")]
pub struct SetArgs {
    /// The target's id, as `target list` shows it (e.g. vm1).
    #[arg(value_name = "ID", add = crate::completion::targets())]
    pub id: String,
    #[command(flatten)]
    pub fields: Fields,
    /// Take this MAC address off the record (repeatable).
    #[arg(long = "remove-mac", value_name = "MAC")]
    pub remove_macs: Vec<String>,
    #[command(flatten)]
    pub opts: StoreOpts,
    #[command(flatten)]
    pub api: ServerOpt,
}

/// Remove a target record (a running agent keeps what it attached to).
#[derive(Debug, Args)]
pub struct RemoveArgs {
    /// The target's id, as `target list` shows it (e.g. vm1).
    #[arg(value_name = "ID", add = crate::completion::targets())]
    pub id: String,
    /// Remove the record even while the target is in use. Without it, a target is kept
    /// while its agent runs: on this host (it holds the target's lock in the run
    /// directory), or, with --server, wherever the server has a session or a fresh report
    /// of it. Its agent's reports are refused once the record is gone.
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub opts: StoreOpts,
    #[command(flatten)]
    pub api: ServerOpt,
}

fn selector(v: Option<String>) -> Result<Option<Selector>> {
    Ok(v.map(|v| v.parse::<Selector>()).transpose()?)
}

impl Fields {
    /// The body of `target add` (the API's POST /api/v1/targets).
    pub fn new_target(self, id: String) -> Result<NewTarget> {
        let (Some(vdisk), Some(cache)) = (self.vdisk, self.cache) else {
            usage!("a new target needs --vdisk NAME and --cache TYPE");
        };
        Ok(NewTarget {
            id,
            vdisk,
            cache,
            version: selector(self.version)?,
            ram: self.ram,
            overflow_max: self.overflow_max,
            description: self.description,
            macs: self.macs,
            hostname: self.hostname.filter(|h| !h.is_empty()),
            overflow_device: self.overflow_device.filter(|d| !d.is_empty()),
        })
    }

    /// The body of `target set` (the API's PUT /api/v1/targets/ID). An empty
    /// `--description` (`--hostname`, `--overflow-device`) clears it.
    pub fn change(self, remove_macs: Vec<String>) -> Result<TargetChange> {
        Ok(TargetChange {
            vdisk: self.vdisk,
            cache: self.cache,
            version: selector(self.version)?,
            ram: self.ram.map(Some),
            overflow_max: self.overflow_max.map(Some),
            description: self.description.map(|d| Some(d).filter(|d| !d.is_empty())),
            add_macs: self.macs,
            remove_macs,
            hostname: self.hostname.map(|d| Some(d).filter(|d| !d.is_empty())),
            overflow_device: self
                .overflow_device
                .map(|d| Some(d).filter(|d| !d.is_empty())),
        })
    }
}

pub fn add(a: AddArgs) -> Result<()> {
    // The CA and the certificate folder are checked before the record is added, so a
    // missing CA or a folder in the way leaves nothing behind.
    let cert = match &a.issue_cert {
        Some(dir) => {
            let req = crate::pki::target_request(&a.id, dir)?;
            let ca = crate::pki::open_ca(a.ca.as_deref())?;
            ca.check(&req).with_context(|| {
                format!(
                    "not adding target {}: its certificate cannot be issued",
                    a.id
                )
            })?;
            Some((ca, req))
        }
        None => None,
    };
    let t = a.fields.new_target(a.id)?;
    let id = t.id.clone();
    let mut doc = match a.api.client_for(&a.opts)? {
        Some(c) => c.post(
            "/api/v1/targets",
            &json!({
                "id": t.id, "vdisk": t.vdisk, "cache": t.cache, "version": t.version, "ram": t.ram,
                "overflow_max": t.overflow_max, "description": t.description,
                "macs": t.macs, "hostname": t.hostname, "overflow_device": t.overflow_device,
            }),
        )?,
        None => json!(documents::target_add(&a.opts.open()?, t)?),
    };
    let mut lines = Vec::new();
    if let Some((ca, req)) = cert {
        let issued = ca.issue(&req).with_context(|| {
            format!(
                "target {id} was added, but its certificate was not issued: issue it with `vdstream pki issue target {id} --out {}`",
                req.out.display()
            )
        })?;
        lines = crate::pki::issued_lines(&issued);
        doc["certificate"] = serde_json::to_value(&issued)?;
    }
    print_added(&a.opts, doc, lines)
}

/// The added record (with `--issue-cert`, `certificate`: what was issued, and `more`: its lines).
pub fn print_added(o: &StoreOpts, doc: Value, more: Vec<String>) -> Result<()> {
    let r: TargetRecord = serde_json::from_value(doc.clone())?;
    o.emit(doc, || {
        std::iter::once(format!("added target {}: {}", r.id, summary(&r)))
            .chain(more)
            .collect::<Vec<_>>()
            .join("\n")
    });
    Ok(())
}

pub fn list(a: ListArgs) -> Result<()> {
    let o = &a.opts;
    let doc = match a.api.client_for(&a.opts)? {
        Some(c) => c.get("/api/v1/targets")?,
        None => json!(documents::target_list(&o.open()?)?),
    };
    print_list(o, doc)
}

pub fn print_list(o: &StoreOpts, doc: Value) -> Result<()> {
    let list: Vec<TargetRecord> = serde_json::from_value(doc.clone())?;
    o.emit(doc, || {
        if list.is_empty() {
            return "no targets; add one with `vdstream target add ID --vdisk NAME --cache TYPE`"
                .into();
        }
        let mut lines = vec![format!(
            "{:<20} {:<20} {:<11} {:<22} {:>9} {:>12}  {:<17}  {}",
            "ID", "VDISK", "VERSION", "CACHE", "RAM", "OVERFLOW-MAX", "MAC", "DESCRIPTION"
        )];
        for r in &list {
            let macs = match r.macs.len() {
                0 => "-".to_string(),
                1 => r.macs[0].clone(),
                n => format!("{} +{}", r.macs[0], n - 1),
            };
            lines.push(format!(
                "{:<20} {:<20} {:<11} {:<22} {:>9} {:>12}  {:<17}  {}",
                r.id,
                r.vdisk,
                r.version.to_string(),
                r.cache.name(),
                r.ram.map(format_size).unwrap_or_else(|| "-".into()),
                r.overflow_max
                    .map(format_size)
                    .unwrap_or_else(|| "-".into()),
                macs,
                vdstream_store::names::printable(r.description.as_deref().unwrap_or(""))
            ));
        }
        lines.join("\n")
    });
    Ok(())
}

pub fn show(a: ShowArgs) -> Result<()> {
    let doc = match a.api.client_for(&a.opts)? {
        Some(c) => c.get(&format!("/api/v1/targets/{}", seg(&a.id)))?,
        None => json!(documents::target_show(&a.opts.open()?, &a.id)?),
    };
    print_show(&a.opts, doc)
}

/// `target show`: the record; from a server also `agent`, the agent's latest report.
pub fn print_show(o: &StoreOpts, doc: Value) -> Result<()> {
    let r: TargetRecord = serde_json::from_value(doc.clone())?;
    // The agent's latest report, typed (`vdstream_contract::status::Status`).
    let agent = doc
        .get("agent")
        .and_then(|a| vdstream_agent::Status::deserialize(a).ok());
    o.emit(doc, || {
        let mut lines = vec![
            format!(
                "target {}{}",
                r.id,
                r.description
                    .as_ref()
                    .map(|d| format!(" ({})", vdstream_store::names::printable(d)))
                    .unwrap_or_default()
            ),
            format!(
                "  boots:    vDisk {} ({})",
                r.vdisk,
                describe_version(r.version)
            ),
            format!("  cache:    {}", cache_words(&r)),
            format!(
                "  macs:     {}",
                if r.macs.is_empty() {
                    "none (not network-booted by MAC)".to_string()
                } else {
                    r.macs.join(", ")
                }
            ),
            format!("  hostname: {}", r.hostname.as_deref().unwrap_or(&r.id)),
        ];
        if let Some(d) = &r.overflow_device {
            lines.push(format!("  overflow: {d} (the target's own disk)"));
        }
        lines.extend([
            format!("  created:  {} by {}", r.created, r.created_by),
            format!(
                "  changed:  {} by {} (generation {})",
                r.updated, r.updated_by, r.generation
            ),
        ]);
        if let Some(a) = agent {
            lines.push(format!(
                "  agent:    {} on {}, {} retries, {} reconnects, {} failovers; cache {:.1}% used",
                a.state,
                a.server.endpoint,
                a.server.retries,
                a.server.reconnects,
                a.server.failovers,
                a.cache.used_percent
            ));
        }
        lines.join("\n")
    });
    Ok(())
}

pub fn set(a: SetArgs) -> Result<()> {
    let change = a.fields.change(a.remove_macs)?;
    if change.is_empty() {
        usage!("nothing to set: give --vdisk, --cache, --version, --ram, --overflow-max, --description, --mac, --remove-mac, --hostname or --overflow-device");
    }
    let doc = match a.api.client_for(&a.opts)? {
        Some(c) => c.put(
            &format!("/api/v1/targets/{}", seg(&a.id)),
            &change_json(&change),
        )?,
        None => json!(documents::target_set(&a.opts.open()?, &a.id, change)?),
    };
    print_set(&a.opts, doc)
}

pub fn print_set(o: &StoreOpts, doc: Value) -> Result<()> {
    let r: TargetRecord = serde_json::from_value(doc.clone())?;
    o.emit(doc, || {
        format!(
            "target {}: {}; it takes effect at its next attach",
            r.id,
            summary(&r)
        )
    });
    Ok(())
}

pub fn remove(a: RemoveArgs) -> Result<()> {
    let force = if a.force { "?force=true" } else { "" };
    let doc = match a.api.client_for(&a.opts)? {
        Some(c) => c.delete(&format!("/api/v1/targets/{}{force}", seg(&a.id)))?,
        None => {
            if let Some(pid) = vdstream_agent::paths::running_agent(&a.id).filter(|_| !a.force) {
                conflict!(
                    "target {:?} is in use: its agent (pid {pid}) runs on this host; nothing was removed. Stop the agent first (its reports are refused once the record is gone), or remove it anyway with --force",
                    a.id
                );
            }
            json!(documents::target_remove(&a.opts.open()?, &a.id)?)
        }
    };
    print_removed(&a.opts, doc)
}

pub fn print_removed(o: &StoreOpts, doc: Value) -> Result<()> {
    let id = doc["removed"].as_str().unwrap_or_default().to_string();
    let damaged = doc["target"].is_null();
    o.emit(doc, || {
        if damaged {
            format!("removed the damaged record of target {id}")
        } else {
            format!("removed target {id}")
        }
    });
    Ok(())
}

/// A change as the API's PUT takes it: only the fields given (`null` clears).
fn change_json(c: &TargetChange) -> Value {
    let mut doc = json!({});
    if let Some(v) = &c.vdisk {
        doc["vdisk"] = json!(v);
    }
    if let Some(v) = &c.cache {
        doc["cache"] = json!(v);
    }
    if let Some(v) = c.version {
        doc["version"] = json!(v);
    }
    if let Some(v) = c.ram {
        doc["ram"] = json!(v);
    }
    if let Some(v) = c.overflow_max {
        doc["overflow_max"] = json!(v);
    }
    if let Some(v) = &c.description {
        doc["description"] = json!(v);
    }
    if !c.add_macs.is_empty() {
        doc["add_macs"] = json!(c.add_macs);
    }
    if !c.remove_macs.is_empty() {
        doc["remove_macs"] = json!(c.remove_macs);
    }
    if let Some(v) = &c.hostname {
        doc["hostname"] = json!(v);
    }
    if let Some(v) = &c.overflow_device {
        doc["overflow_device"] = json!(v);
    }
    doc
}

fn describe_version(v: Selector) -> String {
    match v {
        Selector::Production => "what production targets get".into(),
        Selector::Test => "what test targets get".into(),
        Selector::Latest => "its newest version".into(),
        Selector::Base => "its base".into(),
        other => format!("version {other}"),
    }
}

fn cache_words(r: &TargetRecord) -> String {
    let mut sizes = Vec::new();
    if let Some(ram) = r.ram {
        sizes.push(format!("RAM {}", format_size(ram)));
    }
    if let Some(m) = r.overflow_max {
        sizes.push(format!("file up to {}", format_size(m)));
    }
    if sizes.is_empty() {
        r.cache.name().to_string()
    } else {
        format!("{} ({})", r.cache.name(), sizes.join(", "))
    }
}

fn summary(r: &TargetRecord) -> String {
    let macs = if r.macs.is_empty() {
        String::new()
    } else {
        format!(", MAC {}", r.macs.join(", "))
    };
    format!(
        "vDisk {} ({}), {} write cache{macs}",
        r.vdisk,
        describe_version(r.version),
        cache_words(r)
    )
}
