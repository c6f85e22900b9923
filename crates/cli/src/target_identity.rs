//! `vdstream target identity list|show|approve|revoke|reset`: the machines' TPM
//! enrolments (docs/IDENTITY.md), in the store or through a server's API (`--server`).

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::{json, Value};
use vdstream_store::identities::{Enrolment, EnrolmentState};

use crate::output::StoreOpts;
use crate::remote::{seg, ServerOpt};

/// The TPM keys machines proved for their targets: who waits for approval, approve or
/// pre-enrol a key, revoke a lost machine.
#[derive(Debug, Args)]
#[command(after_help = "\
A machine booted from a server with --identity-ca proves at every boot that its TPM holds
its key; its console shows the key's fingerprint. The first time, it waits as pending:
  vdstream target identity list                     pending, approved and revoked targets
  vdstream target identity approve pc-07 --fingerprint sha256:…   compare with its console first
Pre-enrol a machine whose fingerprint you have (it gets its certificate at its first boot):
  vdstream target identity approve pc-07 --fingerprint sha256:…
A lost or stolen machine: its next boot is refused, and nothing is certified for pc-07
until a key is approved again:
  vdstream target identity revoke pc-07")]
pub struct IdentityArgs {
    #[command(subcommand)]
    command: IdentityCommand,
}

#[derive(Debug, Subcommand)]
enum IdentityCommand {
    /// Every target's enrolment: its state and key fingerprint.
    List(ListArgs),
    /// One target's enrolment, with where and when its machine last proved its key.
    Show(OneArgs),
    /// Approve the key a machine proved (it must be FINGERPRINT when given), or pre-enrol
    /// a target for the key of FINGERPRINT.
    Approve(ApproveArgs),
    /// Revoke a target's identity: its next boot gets no certificate and no secret.
    Revoke(OneArgs),
    /// Forget a target's enrolment: its machine's next proof waits as pending again.
    Reset(OneArgs),
}

#[derive(Debug, Args)]
struct ListArgs {
    #[command(flatten)]
    opts: StoreOpts,
    #[command(flatten)]
    api: ServerOpt,
}

#[derive(Debug, Args)]
struct OneArgs {
    /// The target's id, as `target list` shows it (e.g. pc-07).
    #[arg(value_name = "ID", add = crate::completion::targets())]
    id: String,
    #[command(flatten)]
    opts: StoreOpts,
    #[command(flatten)]
    api: ServerOpt,
}

#[derive(Debug, Args)]
struct ApproveArgs {
    /// The target's id, as `target list` shows it (e.g. pc-07).
    #[arg(value_name = "ID", add = crate::completion::targets())]
    id: String,
    /// The key's fingerprint as the machine's console shows it (`sha256:` and 64 hex
    /// digits). Required when the target has proved no key yet (pre-enrolment) or to name
    /// a new key for an approved or revoked target; with a pending key it must match it.
    #[arg(long, value_name = "sha256:HEX")]
    fingerprint: Option<String>,
    #[command(flatten)]
    opts: StoreOpts,
    #[command(flatten)]
    api: ServerOpt,
}

pub fn run(a: IdentityArgs) -> Result<()> {
    match a.command {
        IdentityCommand::List(a) => {
            let doc = match a.api.client_for(&a.opts)? {
                Some(c) => c.get("/api/v1/identities")?,
                None => json!(a.opts.open()?.identities()?),
            };
            let list: Vec<Enrolment> = serde_json::from_value(doc.clone())?;
            a.opts.emit(doc, || {
                if list.is_empty() {
                    return "no machine has proved a TPM key yet (servers need --identity-ca)"
                        .into();
                }
                list.iter().map(line).collect::<Vec<_>>().join("\n")
            });
            Ok(())
        }
        IdentityCommand::Show(a) => {
            let doc = match a.api.client_for(&a.opts)? {
                Some(c) => c.get(&format!("/api/v1/targets/{}/identity", seg(&a.id)))?,
                None => {
                    let store = a.opts.open()?;
                    store.target(&a.id)?;
                    match store.identity(&a.id)? {
                        Some(e) => json!(e),
                        None => {
                            return Err(crate::exit::fail(crate::exit::Kind::NotFound, format!(
                                "target {:?} has no enrolment: its machine has not proved a TPM key (boot it once, or pre-enrol it with `vdstream target identity approve {} --fingerprint …`)",
                                a.id, a.id
                            )))
                        }
                    }
                }
            };
            print_one(&a.opts, doc)
        }
        IdentityCommand::Approve(a) => {
            let doc = match a.api.client_for(&a.opts)? {
                Some(c) => c.post(
                    &format!("/api/v1/targets/{}/identity/approve", seg(&a.id)),
                    &json!({"fingerprint": a.fingerprint}),
                )?,
                None => json!(a
                    .opts
                    .open()?
                    .approve_identity(&a.id, a.fingerprint.as_deref())?),
            };
            print_one(&a.opts, doc)
        }
        IdentityCommand::Revoke(a) => {
            let doc = match a.api.client_for(&a.opts)? {
                Some(c) => c.post(
                    &format!("/api/v1/targets/{}/identity/revoke", seg(&a.id)),
                    &json!({}),
                )?,
                None => json!(a.opts.open()?.revoke_identity(&a.id)?),
            };
            print_one(&a.opts, doc)
        }
        IdentityCommand::Reset(a) => {
            if a.api.server.is_some() {
                usage!("`target identity reset` changes the store directly: run it on the store's host, without --server");
            }
            let had = a.opts.open()?.reset_identity(&a.id)?;
            a.opts.emit(json!({"target": a.id, "reset": had}), || {
                if had {
                    format!(
                        "forgot {}'s enrolment: its machine's next proof waits as pending",
                        a.id
                    )
                } else {
                    format!("{} had no enrolment", a.id)
                }
            });
            Ok(())
        }
    }
}

fn line(e: &Enrolment) -> String {
    let key = e
        .key
        .as_ref()
        .map(|k| k.fingerprint.clone())
        .or_else(|| {
            e.expected_fingerprint
                .as_ref()
                .map(|f| format!("{f} (pre-enrolled, not proved yet)"))
        })
        .unwrap_or_else(|| "no key".into());
    let refused = if e.refused > 0 {
        format!(", {} refused", e.refused)
    } else {
        String::new()
    };
    format!("{:<16} {:<9} {key}{refused}", e.target, e.state.name())
}

fn print_one(o: &StoreOpts, doc: Value) -> Result<()> {
    let e: Enrolment = serde_json::from_value(doc.clone())?;
    o.emit(doc, || {
        let mut lines = vec![line(&e)];
        if let (Some(at), Some(peer)) = (&e.last_proof, &e.peer) {
            lines.push(format!("  last proof: {at} from {peer}"));
        }
        if let Some(ek) = &e.endorsement_key {
            lines.push(format!("  endorsement key: {}", ek.fingerprint));
        }
        match e.state {
            EnrolmentState::Pending => lines.push(format!(
                "  waits for approval: compare the fingerprint with the machine's console, then `vdstream target identity approve {} --fingerprint {}`",
                e.target,
                e.key.as_ref().map_or("sha256:…", |k| k.fingerprint.as_str())
            )),
            EnrolmentState::Approved => {
                if let Some(a) = &e.approved {
                    lines.push(format!("  approved {} by {}", a.time, a.by));
                }
            }
            EnrolmentState::Revoked => {
                if let Some(r) = &e.revoked {
                    lines.push(format!("  revoked {} by {}", r.time, r.by));
                }
            }
        }
        lines.join("\n")
    });
    Ok(())
}
