//! `vdstream token add|list|revoke`: the HTTP API's bearer tokens, kept (hashed) in the
//! store directory; a running server takes a change on its next request.

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::json;
use vdstream_server::tokens::{Role, TokenRecord, Tokens, AGENTS_NEED_A_CREDENTIAL};

use crate::output::StoreOpts;

/// Bearer tokens for the HTTP API (`vdstream server --http`), with a role each:
/// read-only (every GET), operator (also target records and agent reports), admin
/// (everything). A token is printed once, when made; the store keeps only its SHA-256.
#[derive(Debug, Args)]
#[command(after_help = "Examples:
  vdstream token add grafana --role read-only
  vdstream token add helpdesk --role operator --json
  vdstream token list
  vdstream token revoke helpdesk

Clients send it as `Authorization: Bearer TOKEN`; vdstream's own commands (`--server URL`)
and agents read it from VDSTREAM_TOKEN or a file (--token-file, VDSTREAM_TOKEN_FILE), not
from the command line, where other users could see it. Once a token exists, the API
requires one on every call, even on loopback: agents too (give them an operator token
in VDSTREAM_TOKEN_FILE, or their target certificate over https).")]
pub struct TokenArgs {
    #[command(subcommand)]
    command: TokenCommand,
}

#[derive(Debug, Subcommand)]
enum TokenCommand {
    /// Make a token and print it (once: it cannot be shown again).
    Add {
        /// A name for the token (who or what uses it), unique in the store.
        #[arg(value_name = "NAME")]
        name: String,
        /// admin, operator or read-only.
        #[arg(long, value_name = "ROLE")]
        role: Role,
        #[command(flatten)]
        opts: StoreOpts,
    },
    /// List the tokens (names, roles, when made and revoked; never the tokens).
    List {
        #[command(flatten)]
        opts: StoreOpts,
    },
    /// Revoke a token: the server refuses it from its next request on.
    Revoke {
        /// The token's name, as `vdstream token list` shows it.
        #[arg(value_name = "NAME")]
        name: String,
        #[command(flatten)]
        opts: StoreOpts,
    },
}

fn record_json(t: &TokenRecord) -> serde_json::Value {
    json!({"name": t.name, "role": t.role, "created": t.created, "revoked": t.revoked})
}

pub fn run(args: TokenArgs) -> Result<()> {
    match args.command {
        TokenCommand::Add { name, role, opts } => {
            let store = opts.open()?;
            let made = Tokens::of_store(store.root()).add(&name, role)?;
            let mut doc = record_json(&made.record);
            doc["token"] = json!(made.token);
            doc["note"] = json!(AGENTS_NEED_A_CREDENTIAL);
            // The token alone on stdout (`> file` keeps just it); the notes on stderr.
            opts.emit(doc, || made.token.clone());
            if !opts.json {
                errln!("token {:?} ({}) made; it is shown only now: keep it in a file only its user can read", made.record.name, made.record.role);
                errln!("note: {AGENTS_NEED_A_CREDENTIAL}");
            }
        }
        TokenCommand::List { opts } => {
            let store = opts.open()?;
            let list = Tokens::of_store(store.root()).list()?;
            let doc = json!(list.iter().map(record_json).collect::<Vec<_>>());
            opts.emit(doc, || {
                if list.is_empty() {
                    return "no tokens: the API is open on loopback without TLS (`vdstream token add NAME --role ROLE`)".to_string();
                }
                list.iter()
                    .map(|t| format!("{:<24} {:<10} made {}{}", t.name, t.role.as_str(), t.created, t.revoked.map(|r| format!(", revoked {r}")).unwrap_or_default()))
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
        TokenCommand::Revoke { name, opts } => {
            let store = opts.open()?;
            let t = Tokens::of_store(store.root()).revoke(&name)?;
            opts.emit(record_json(&t), || {
                format!(
                    "token {:?} revoked; the server refuses it from its next request on",
                    t.name
                )
            });
        }
    }
    Ok(())
}
