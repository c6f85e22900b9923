//! `PREFIX/writer.json`: who the metadata writer of a store in object storage is, and its
//! heartbeat (see `writer`). Read by the writer, its mirrors, `store copy` and the CLI.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::client::Bucket;
use crate::error::Result;

/// The object (beside `store.json`) that names the store's metadata writer.
pub const WRITER_OBJECT: &str = "writer.json";
/// The file in the writer's folder that holds its id (so that a restarted writer knows
/// its folder is still the truth).
pub(crate) const LOCAL_ID: &str = "writer-id";
/// How often the writer renews `writer.json`.
pub const HEARTBEAT: Duration = Duration::from_secs(5);
/// A heartbeat older than this is a writer that stopped; another may take the role.
pub const STALE: Duration = Duration::from_secs(30);

/// `PREFIX/writer.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WriterRecord {
    pub id: String,
    /// The writer's API, where changes go (`http://HOST:PORT` or `https://…`).
    pub url: String,
    /// The writer's host name and folder: a CLI on that host opens the folder itself.
    pub host: String,
    pub folder: PathBuf,
    pub pid: u32,
    /// Seconds since the epoch.
    pub since: u64,
    pub heartbeat: u64,
}

pub(crate) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// This machine's host name.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

impl WriterRecord {
    /// The record in the bucket, if there is one (a damaged one is no record, with a warning).
    pub fn read(bucket: &Bucket) -> Result<Option<WriterRecord>> {
        let Some(raw) = bucket.get_capped(WRITER_OBJECT, 64 << 10)? else {
            return Ok(None);
        };
        match serde_json::from_slice(&raw) {
            Ok(r) => Ok(Some(r)),
            Err(e) => {
                log::warn!(
                    "{}: not a writer record ({e}); treated as none",
                    bucket.what(WRITER_OBJECT)
                );
                Ok(None)
            }
        }
    }

    /// The record in a mirror's folder (read there by its metadata thread).
    pub fn read_local(dir: &Path) -> Option<WriterRecord> {
        serde_json::from_slice(&std::fs::read(dir.join(WRITER_OBJECT)).ok()?).ok()
    }

    /// Seconds since the last heartbeat.
    pub fn age(&self) -> u64 {
        now_secs().saturating_sub(self.heartbeat)
    }

    pub fn alive(&self) -> bool {
        self.age() < STALE.as_secs()
    }
}
