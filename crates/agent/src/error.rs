//! The agent's one error type. Every message says what went wrong, with which target,
//! server, file or socket, and what to do.

use std::path::PathBuf;

/// Everything attach and status can fail with.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("bad server {uri:?}: {reason} (use nbd://HOST:PORT/EXPORT or nbd+unix:///EXPORT?socket=PATH)")]
    BadEndpoint { uri: String, reason: String },

    #[error(
        "{uri} is a store server's API, and the other servers listed are NBD URIs: give every --server as http://HOST:PORT \
         (the agent then asks the API for the target's record and the servers' NBD addresses), or every one as an NBD URI"
    )]
    MixedServers { uri: String },

    #[error(
        "target {id} has no record on {server}: add one with `vdstream target add {id} --vdisk NAME --cache TYPE --server {server}`, \
         or attach it without a record: --vdisk NAME[@VERSION] --cache TYPE"
    )]
    NoTargetRecord { id: String, server: String },

    #[error("{message}")]
    Api { message: String },

    #[error("no server given: list at least one with --server")]
    NoEndpoint,

    #[error("{message}")]
    NoServer { message: String },

    #[error("bad target id {id:?}: {reason}")]
    BadTarget { id: String, reason: String },

    #[error("target {id}: live migration: {reason}")]
    Migration { id: String, reason: String },

    #[error("target {id} is already attached by a running agent (pid {pid}, lock {lock}); detach it first (SIGTERM) or use another id", lock = lock.display())]
    AlreadyAttached {
        id: String,
        pid: String,
        lock: PathBuf,
    },

    #[error("{path}: {reason}", path = path.display())]
    SocketInUse { path: PathBuf, reason: String },

    // The causes below are in the messages, so they are not also `source()`: a chain
    // printed with `{:#}` would say them twice.
    #[error("cannot open the {kind} write cache of target {id}: {err}")]
    Cache {
        id: String,
        kind: vdstream_wcache::CacheType,
        err: vdstream_blockdev::Error,
    },

    /// The cache folder of target `id` is unusable (the message names it and what to do).
    #[error("{reason}")]
    CacheDir {
        id: String,
        reason: vdstream_wcache::space::CacheDirError,
    },

    #[error("target {id}: cannot record the I/O trace: {message}")]
    Trace { id: String, message: String },

    #[error("no status for target {id} in {path}: is it attached? (start it with `vdstream target attach {id} ...`; set VDSTREAM_RUN_DIR if it runs with another)", path = path.display())]
    NoStatus { id: String, path: PathBuf },

    #[error("target {id}: --overflow-device {device}: {reason}", device = device.display())]
    OverflowDevice {
        id: String,
        device: PathBuf,
        reason: String,
    },

    /// `--kernel-nbd DEVICE`: the message says what is wrong with it and what to do.
    #[error("{device} {message}", device = device.display())]
    KernelNbd { device: PathBuf, message: String },

    #[error("{what}: {err}")]
    Io { what: String, err: std::io::Error },
}
