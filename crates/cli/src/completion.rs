//! Shell completion that knows the store: `vdstream completions SHELL` prints a script that
//! asks this binary (`VDSTREAM_COMPLETE=SHELL vdstream -- WORDS…`, clap_complete's dynamic
//! engine) what fits the word being typed. So besides the commands, flags and values the
//! command definition has (cache types after --cache, stages after --to), it offers the
//! vDisk names and target ids of the store ($VDSTREAM_STORE, else the default store) when
//! that store is readable, and nothing from it otherwise.

use clap_complete::engine::{ArgValueCandidates, CompletionCandidate};
use vdstream_store::{store_dir, Store};

/// The variable that turns a run of the binary into a completion request.
pub const VAR: &str = "VDSTREAM_COMPLETE";

/// Answers a completion request and exits, when the environment holds one; returns
/// otherwise (a normal run). First thing in `main`: nothing may be printed before.
pub fn answer_if_asked(cmd: fn() -> clap::Command) {
    clap_complete::CompleteEnv::with_factory(cmd)
        .var(VAR)
        .complete();
}

/// The script that registers the completion for `shell`: it calls `vdstream` (the one on
/// PATH) for each completion.
pub fn registration(shell: clap_complete::Shell) -> std::io::Result<Vec<u8>> {
    let name = shell.to_string();
    let shells = clap_complete::env::Shells::builtins();
    let completer = shells
        .completer(&name)
        .ok_or_else(|| std::io::Error::other(format!("no completion for the shell {name}")))?;
    let mut script = Vec::new();
    completer.write_registration(VAR, "vdstream", "vdstream", "vdstream", &mut script)?;
    Ok(script)
}

/// The store completion reads: the command line being completed is not parsed yet, so
/// `--store` on it is not seen; $VDSTREAM_STORE is.
fn store() -> Option<Store> {
    Store::open(store_dir(None)).ok()
}

fn candidates(names: Vec<String>) -> Vec<CompletionCandidate> {
    names.into_iter().map(CompletionCandidate::new).collect()
}

/// Completes a vDisk name (`NAME`, and the name part of `NAME@V`).
pub fn vdisks() -> ArgValueCandidates {
    ArgValueCandidates::new(|| candidates(store().and_then(|s| s.names().ok()).unwrap_or_default()))
}

/// Completes a target id.
pub fn targets() -> ArgValueCandidates {
    ArgValueCandidates::new(|| {
        candidates(
            store()
                .and_then(|s| s.target_ids().ok())
                .unwrap_or_default(),
        )
    })
}
