//! The agent's one error type. Every message says what went wrong, with which target,
//! server, file or socket, and what to do.

use std::path::PathBuf;

/// Everything attach and status can fail with.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("bad server {uri:?}: {reason} (use nbd://HOST:PORT/EXPORT or nbd+unix:///EXPORT?socket=PATH)")]
    BadEndpoint { uri: String, reason: String },

    #[error(
        "{uri}: fetching target records from a vdstream store server is not built into this version; \
         give the vDisk's NBD address instead (--server nbd+unix:///?socket=PATH or nbd://HOST:PORT/EXPORT) and --cache TYPE"
    )]
    ServerModeNotBuilt { uri: String },

    #[error("no server given: list at least one with --server")]
    NoEndpoint,

    #[error("{message}")]
    NoServer { message: String },

    #[error("bad target id {id:?}: {reason}")]
    BadTarget { id: String, reason: String },

    #[error("target {id} is already attached by a running agent (pid {pid}, lock {lock}); detach it first (SIGTERM) or use another id", lock = lock.display())]
    AlreadyAttached { id: String, pid: String, lock: PathBuf },

    #[error("{path}: {reason}", path = path.display())]
    SocketInUse { path: PathBuf, reason: String },

    #[error("cannot open the {kind} write cache of target {id}: {source}")]
    Cache {
        id: String,
        kind: vdstream_wcache::CacheType,
        #[source]
        source: vdstream_blockdev::Error,
    },

    #[error("no status for target {id} in {path}: is it attached? (start it with `vdstream target attach {id} ...`; set VDSTREAM_RUN_DIR if it runs with another)", path = path.display())]
    NoStatus { id: String, path: PathBuf },

    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}
