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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
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
    let mut f = vdstream_blockdev::storefile::options(crate::fsutil::SHARED_READ)
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| vdstream_blockdev::storefile::explain(e, path))
        .map_err(io("open", path))?;
    f.write_all(&line).map_err(io("append to", path))?;
    f.sync_data().map_err(io("fsync", path))
}

/// Reads the entries about `vdisk` (all when `None`), oldest first, at most the last
/// `limit`. A line that does not parse is an error naming its number (counted from the
/// end when only the last `limit` were read).
pub fn read(path: &Path, vdisk: Option<&str>, limit: Option<usize>) -> Result<Vec<AuditEntry>> {
    match limit {
        Some(n) => read_last(path, vdisk, n),
        None => read_all(path, vdisk),
    }
}

fn corrupt(path: &Path, which: String, e: &serde_json::Error) -> StoreError {
    StoreError::Corrupt {
        path: path.to_path_buf(),
        detail: format!("{which}: {}", e.to_string().split(" at line ").next().unwrap_or_default()),
        advice: "the audit trail is append-only: move the damaged line out of the file by hand (keep a copy)".into(),
    }
}

/// The first block read from the end by [`read_last`]; each further one is four times larger.
const TAIL_BLOCK: u64 = 64 << 10;

/// The last `n` entries about `vdisk`, reading the file from its end in growing blocks: the
/// cost follows `n` (and how rare the vDisk's entries are), not the trail's length.
fn read_last(path: &Path, vdisk: Option<&str>, n: usize) -> Result<Vec<AuditEntry>> {
    use std::io::{Read, Seek, SeekFrom};
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut f = match vdstream_blockdev::storefile::open_read(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io("open", path)(e)),
    };
    let len = f.metadata().map_err(io("stat", path))?.len();
    let mut block = TAIL_BLOCK;
    loop {
        let start = len.saturating_sub(block);
        f.seek(SeekFrom::Start(start))
            .map_err(io("seek in", path))?;
        let mut bytes = Vec::with_capacity((len - start) as usize);
        Read::by_ref(&mut f)
            .take(len - start)
            .read_to_end(&mut bytes)
            .map_err(io("read", path))?;
        // Past a cut, the first line is partial: whole lines start after its newline.
        let whole = if start == 0 {
            &bytes[..]
        } else {
            bytes
                .iter()
                .position(|b| *b == b'\n')
                .map_or(&bytes[..0], |i| &bytes[i + 1..])
        };
        let text = std::str::from_utf8(whole).map_err(|e| StoreError::Corrupt {
            path: path.to_path_buf(),
            detail: format!("not UTF-8 near byte {}", len - whole.len() as u64 + e.valid_up_to() as u64),
            advice: "the audit trail is append-only: move the damaged line out of the file by hand (keep a copy)".into(),
        })?;
        let mut out = Vec::new();
        for (k, line) in text.lines().rev().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let e: AuditEntry = serde_json::from_str(line)
                .map_err(|e| corrupt(path, format!("line {} from the end", k + 1), &e))?;
            if vdisk.is_none_or(|v| v == e.vdisk) {
                out.push(e);
                if out.len() == n {
                    break;
                }
            }
        }
        if out.len() == n || start == 0 {
            out.reverse();
            return Ok(out);
        }
        block = block.saturating_mul(4);
    }
}

fn read_all(path: &Path, vdisk: Option<&str>) -> Result<Vec<AuditEntry>> {
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
        let e: AuditEntry =
            serde_json::from_str(line).map_err(|e| corrupt(path, format!("line {}", i + 1), &e))?;
        if vdisk.is_none_or(|v| v == e.vdisk) {
            out.push(e);
        }
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
            append(
                &p,
                &AuditEntry::new(&a, "vdisk.set", v, serde_json::json!({"i": i})),
            )
            .unwrap();
        }
        assert_eq!(read(&p, None, None).unwrap().len(), 4);
        let last = read(&p, Some("a"), Some(2)).unwrap();
        assert_eq!(
            last.iter()
                .map(|e| e.details["i"].as_u64().unwrap())
                .collect::<Vec<_>>(),
            vec![2, 3]
        );
        std::fs::OpenOptions::new()
            .append(true)
            .open(&p)
            .unwrap()
            .write_all(b"{oops\n")
            .unwrap();
        let e = read(&p, None, None).unwrap_err().to_string();
        assert!(e.contains("audit.log is corrupt (line 5"), "{e}");
        let e = read(&p, None, Some(2)).unwrap_err().to_string();
        assert!(
            e.contains("audit.log is corrupt (line 1 from the end"),
            "{e}"
        );
    }

    /// The last N read from the end match the model (the whole trail, filtered, its last
    /// N), for trails many blocks long, rare and common vDisks, notes with multi-byte
    /// characters across block cuts, and N from 0 to past the trail.
    #[test]
    fn the_last_entries_read_from_the_end_match_reading_all() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("audit.log");
        let a = Actor::current();
        let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut f = std::fs::File::create(&p).unwrap();
        for i in 0..6000 {
            let v = match next() % 100 {
                0 => "rare",
                1..=40 => "a",
                _ => "b",
            };
            let note = "é→".repeat((next() % 200) as usize);
            let mut line = serde_json::to_vec(&AuditEntry::new(
                &a,
                "vdisk.set",
                v,
                serde_json::json!({"i": i, "note": note}),
            ))
            .unwrap();
            line.push(b'\n');
            f.write_all(&line).unwrap();
        }
        drop(f);
        assert!(
            std::fs::metadata(&p).unwrap().len() > 16 * TAIL_BLOCK,
            "the trail spans many blocks"
        );
        for vdisk in [None, Some("a"), Some("b"), Some("rare"), Some("none")] {
            let all = read_all(&p, vdisk).unwrap();
            for n in [0, 1, 2, 7, 100, 1000, all.len(), all.len() + 5] {
                let want = &all[all.len().saturating_sub(n)..];
                assert_eq!(
                    read(&p, vdisk, Some(n)).unwrap(),
                    want,
                    "{vdisk:?} last {n}"
                );
            }
        }
    }
}
