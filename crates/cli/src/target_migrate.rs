//! `vdstream target migrate`: flags to a [`vdstream_agent::migrate::drive::DriveConfig`].

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use vdstream_agent::migrate::{self, drive};
use vdstream_agent::paths;

use crate::exit::{fail, Kind};
use crate::size::parse_duration;

/// Live-migrate a VM target to another host, write cache and all: run on the source host.
///
/// First attach the target on the destination host with `--incoming` (the source agent's
/// migration socket) and start the destination qemu with `-incoming` on that agent's
/// socket. This command then waits for the destination agent to hold the cache but the
/// last rounds, runs qemu's migration through the source qemu's QMP socket, and, once qemu
/// reports it completed (the source VM is stopped and flushed), has the source agent send
/// its final delta: the destination serves, the source agent ends. The destination holds
/// the guest's requests until then, so the guest sees a pause, never an error.
///
/// If qemu's migration fails or is cancelled, the handover is cancelled too: the source
/// agent was never fenced and serves on; the destination agent ends. Without --qmp (libvirt
/// runs the migration: `virsh migrate --live`), the command waits for convergence and then
/// switches; the destination's first request also asks for the switch on its own.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples (two hosts; the paths are the defaults of a root agent):
  host2$ vdstream target attach vm1 --server http://store:8480 --incoming /run/vdstream/vm1.migrate
  host2$ qemu-system-x86_64 ... -drive file=nbd+unix:///?socket=/run/vdstream/vm1.sock,format=raw,if=virtio -incoming tcp:0:4444
  host1$ vdstream target migrate vm1 --qmp /run/vm1.qmp --to tcp:host2:4444
  host1$ vdstream target migrate vm1 --cancel --qmp /run/vm1.qmp
Exit status: 0 migrated; 2 bad arguments; 4 no destination converged, or the source agent
handed over already; 6 the source agent does not answer, or qemu's migration failed (the
source serves on).")]
pub struct MigrateArgs {
    /// The target's id, as given to `target attach` on this host.
    #[arg(value_name = "ID", add = crate::completion::targets())]
    id: String,

    /// The source qemu's QMP socket (`-qmp unix:PATH,server=on,wait=off`): this command
    /// runs qemu's migration through it. Without it, something else (libvirt) runs the
    /// migration, and this command only waits for convergence and switches.
    #[arg(long, value_name = "PATH")]
    qmp: Option<PathBuf>,

    /// Where qemu migrates to: the destination qemu's `-incoming` URI (tcp:HOST:PORT or
    /// unix:PATH).
    #[arg(long, value_name = "URI", requires = "qmp")]
    to: Option<String>,

    /// The source agent's migration socket (default: RUN/ID.migrate, as the agent prints).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,

    /// Cancel the migration under way: qemu's too, with --qmp. The source agent serves on.
    #[arg(long, conflicts_with = "to")]
    cancel: bool,

    /// How long to wait for the destination agent to converge (its rounds small enough
    /// for the switch): 500ms, 30s, 5m...
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    converge_for: Duration,

    /// How long qemu's migration may take before it is cancelled.
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = parse_duration)]
    timeout: Duration,

    /// Print the outcome as JSON (qemu's figures and the handover's).
    #[arg(long)]
    json: bool,
}

pub fn run(a: MigrateArgs) -> Result<()> {
    paths::check_target_id(&a.id)?;
    let socket = a
        .socket
        .clone()
        .unwrap_or_else(|| migrate::socket_path(&a.id));
    if a.cancel {
        drive::cancel_all(&socket, a.qmp.as_deref())
            .map_err(|e| fail(Kind::Unavailable, format!("target {}: {e}", a.id)))?;
        outln!(
            "vdstream: target {}: migration cancelled; the source agent serves on",
            a.id
        );
        return Ok(());
    }
    let cfg = drive::DriveConfig {
        target: a.id.clone(),
        socket,
        qmp: a.qmp.clone(),
        to: a.to.clone(),
        converge_for: a.converge_for,
        qemu_for: a.timeout,
    };
    let quiet = a.json;
    let outcome = drive::run(&cfg, &|step| {
        if !quiet {
            outln!("vdstream: target {}: {step}", a.id);
        }
    })
    .map_err(|e| {
        let kind = match &e {
            drive::DriveError::NotReady { .. } => Kind::Conflict,
            _ => Kind::Unavailable,
        };
        fail(kind, e.to_string())
    })?;
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&outcome)?);
    } else {
        let h = &outcome.handover;
        outln!(
            "vdstream: target {}: migrated: {} rounds, {} bytes of cache moved ({} on the wire), final delta {} bytes, source fenced {} ms{}",
            a.id,
            h.rounds,
            h.data_bytes,
            h.wire_bytes,
            h.final_bytes,
            h.fenced_ms,
            outcome
                .qemu
                .as_ref()
                .map(|q| format!("; qemu: {} ms in all, {} ms downtime", q.total_ms, q.downtime_ms))
                .unwrap_or_default()
        );
    }
    Ok(())
}
