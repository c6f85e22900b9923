//! The audit trail: `STORE/audit.log`, one JSON object per line, appended (and fsynced)
//! under the store's exclusive lock by every command that changes the store, so lines
//! never interleave and none is lost once the command has said it succeeded.
//!
//! ```json
//! {"time":"2025-03-01T22:00:00Z","user":"root","host":"pvs1","pid":4242,"action":"version.promote","vdisk":"win11","details":{"version":3,"to":"production"}}
//! ```
//!
//! A change made through the server's HTTP API also has `client`, the API client's
//! `ip:port` (`user`, `host` and `pid` are then the server process's).

use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{io, Result, StoreError};
use crate::fsutil::Actor;
use crate::time::Timestamp;

/// One line of `audit.log`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    pub time: Timestamp,
    pub user: String,
    pub host: String,
    pub pid: u32,
    /// The API client (`ip:port`) a server made the change for; absent for the CLI.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
    /// `vdisk.create`, `version.promote`, `version.merge`, …
    pub action: String,
    pub vdisk: String,
    #[serde(default)]
    pub details: serde_json::Value,
}

impl AuditEntry {
    pub fn new(actor: &Actor, action: &str, vdisk: &str, details: serde_json::Value) -> Self {
        AuditEntry {
            time: Timestamp::now(),
            user: actor.user.clone(),
            host: actor.host.clone(),
            pid: actor.pid,
            client: actor.client.clone(),
            action: action.to_string(),
            vdisk: vdisk.to_string(),
            details,
        }
    }
}

/// Appends one entry and fsyncs. The caller holds the store's exclusive lock.
pub fn append(path: &Path, entry: &AuditEntry) -> Result<()> {
    let mut line = serde_json::to_vec(entry).expect("audit entries serialize");
    line.push(b'\n');
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).map_err(io("open", path))?;
    f.write_all(&line).map_err(io("append to", path))?;
    f.sync_data().map_err(io("fsync", path))
}

/// Reads the entries about `vdisk` (all when `None`), oldest first, at most the last
/// `limit`. A line that does not parse is an error naming its number.
pub fn read(path: &Path, vdisk: Option<&str>, limit: Option<usize>) -> Result<Vec<AuditEntry>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(io("read", path)(e)),
    };
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let e: AuditEntry = serde_json::from_str(line).map_err(|e| StoreError::Corrupt {
            path: path.to_path_buf(),
            detail: format!("line {}: {}", i + 1, e.to_string().split(" at line ").next().unwrap_or_default()),
            advice: "the audit trail is append-only: move the damaged line out of the file by hand (keep a copy)".into(),
        })?;
        if vdisk.is_none_or(|v| v == e.vdisk) {
            out.push(e);
        }
    }
    if let Some(n) = limit {
        let skip = out.len().saturating_sub(n);
        out.drain(..skip);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_append_and_filter() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("audit.log");
        let a = Actor::current();
        for (i, v) in ["a", "b", "a", "a"].iter().enumerate() {
            append(&p, &AuditEntry::new(&a, "vdisk.set", v, serde_json::json!({"i": i}))).unwrap();
        }
        assert_eq!(read(&p, None, None).unwrap().len(), 4);
        let last = read(&p, Some("a"), Some(2)).unwrap();
        assert_eq!(last.iter().map(|e| e.details["i"].as_u64().unwrap()).collect::<Vec<_>>(), vec![2, 3]);
        std::fs::OpenOptions::new().append(true).open(&p).unwrap().write_all(b"{oops\n").unwrap();
        let e = read(&p, None, None).unwrap_err().to_string();
        assert!(e.contains("audit.log is corrupt (line 5"), "{e}");
    }
}
