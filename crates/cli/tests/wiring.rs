//! crates/cli is wiring: it parses arguments, builds a config and calls the crate that owns
//! the work. Its production code (everything before a file's `#[cfg(test)]` tests module)
//! does none of what belongs to another crate: it starts no process, forks or detaches
//! none, speaks no protocol on a connection of its own, and decides no sharing by counting
//! references. Each rule below names the crate where that work lives. And a file's tests
//! module, if it has one, is the end of the file, so production code is not split by tests.

use std::path::{Path, PathBuf};

/// (what production code of the CLI must not contain, where that work belongs).
const NOT_IN_THE_CLI: &[(&str, &str)] = &[
    (
        "Command::new(",
        "processes are started by the crate whose job needs them (vdstream-demo, vdstream-boot)",
    ),
    ("libc::fork", "daemonising is vdstream_agent::daemon"),
    ("libc::setsid", "daemonising is vdstream_agent::daemon"),
    (
        "signal_hook",
        "signal handling is vdstream_agent::service (wait_for_signal, run)",
    ),
    (
        "tokio::signal",
        "signal handling is vdstream_agent::service (wait_for_signal, run)",
    ),
    (
        "Arc::strong_count",
        "one writer at a time is vdstream_server::writer_slot",
    ),
    (
        "TcpStream",
        "connections are the nbd, agent and server crates'",
    ),
    (
        "UnixStream",
        "connections are the nbd, agent and server crates'",
    ),
    (
        "vdstream_nbd::proto",
        "the NBD protocol is vdstream-nbd's, behind its server and client",
    ),
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("crates/cli/src is readable") {
        let p = e.expect("a directory entry").path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every source file of the CLI.
fn cli_sources() -> Vec<PathBuf> {
    let mut files = Vec::new();
    sources(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut files,
    );
    files
}

/// The file's production code: what comes before its tests module, without `//` comments.
fn production(text: &str) -> String {
    let end = text.find("#[cfg(test)]\nmod tests").unwrap_or(text.len());
    text[..end]
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_cli_only_wires() {
    let files = cli_sources();
    assert!(files.len() > 10, "found {} source files", files.len());
    let mut found = Vec::new();
    for f in &files {
        let code = production(&std::fs::read_to_string(f).unwrap());
        for (what, owner) in NOT_IN_THE_CLI {
            if code.contains(what) {
                found.push(format!("{}: {what} ({owner})", f.display()));
            }
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn tests_modules_end_their_files() {
    let files = cli_sources();
    let mut split = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let Some(start) = text.find("#[cfg(test)]\nmod tests {") else {
            continue;
        };
        // The module closes with the file's last `}` at column 0; nothing follows it.
        let close = text[start..].find("\n}\n").map(|i| start + i + 3);
        if close != Some(text.len()) {
            split.push(f.display().to_string());
        }
    }
    assert!(
        split.is_empty(),
        "production code after the tests module in: {}",
        split.join(", ")
    );
}

#[test]
fn the_rules_catch_what_they_name() {
    let code = production(
        "fn f() { let n = Arc::strong_count(&x); }\n// Command::new(\"not code\")\n#[cfg(test)]\nmod tests { fn t() { Command::new(\"x\"); } }\n",
    );
    assert!(code.contains("Arc::strong_count"));
    assert!(
        !code.contains("Command::new("),
        "comments and the tests module are left out"
    );
}
