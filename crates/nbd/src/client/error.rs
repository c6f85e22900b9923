//! Errors of the NBD client and the operation names they carry.
//!
//! Every error says which server (`addr`) it concerns and, when a request failed, which
//! operation, offset and length, so that an agent log line is enough to understand a
//! failure. `Disconnected` and `Timeout` mean "this connection is gone, reconnect and
//! re-send"; `Server` means the server answered the request with an errno; `Invalid` means
//! the request was refused before it reached the wire.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::proto;

/// The NBD commands the client sends, named as in the domain (used in errors and logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Read,
    Write,
    Flush,
    Trim,
    Cache,
    WriteZeroes,
    BlockStatus,
    Disconnect,
}

impl Op {
    /// The NBD_CMD_* value of this operation.
    pub(crate) fn command(self) -> u16 {
        match self {
            Op::Read => proto::CMD_READ,
            Op::Write => proto::CMD_WRITE,
            Op::Flush => proto::CMD_FLUSH,
            Op::Trim => proto::CMD_TRIM,
            Op::Cache => proto::CMD_CACHE,
            Op::WriteZeroes => proto::CMD_WRITE_ZEROES,
            Op::BlockStatus => proto::CMD_BLOCK_STATUS,
            Op::Disconnect => proto::CMD_DISC,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Trim => "trim",
            Op::Cache => "cache",
            Op::WriteZeroes => "write-zeroes",
            Op::BlockStatus => "block-status",
            Op::Disconnect => "disconnect",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Symbolic name of an NBD wire errno, for messages.
pub fn errno_name(errno: u32) -> &'static str {
    match errno {
        proto::EPERM => "EPERM",
        proto::EIO => "EIO",
        proto::ENOMEM => "ENOMEM",
        proto::EINVAL => "EINVAL",
        proto::ENOSPC => "ENOSPC",
        proto::EOVERFLOW => "EOVERFLOW",
        proto::ENOTSUP => "ENOTSUP",
        proto::ESHUTDOWN => "ESHUTDOWN",
        _ => "unknown errno",
    }
}

/// Meaning of an NBD_REP_ERR_* option reply, for messages.
pub(crate) fn option_error_name(reply: u32) -> &'static str {
    match reply {
        proto::REP_ERR_UNSUP => "option not supported",
        proto::REP_ERR_POLICY => "forbidden by server policy",
        proto::REP_ERR_INVALID => "invalid request",
        proto::REP_ERR_PLATFORM => "not supported on the server platform",
        proto::REP_ERR_TLS_REQD => "TLS required",
        proto::REP_ERR_UNKNOWN => "unknown export (check the export name)",
        proto::REP_ERR_SHUTDOWN => "server is shutting down",
        proto::REP_ERR_BLOCK_SIZE_REQD => "block size negotiation required",
        proto::REP_ERR_TOO_BIG => "request too big",
        proto::REP_ERR_EXT_HEADER_REQD => "extended headers required",
        _ => "unknown option error",
    }
}

/// Everything that can go wrong in the NBD client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("bad NBD address {input:?}: {reason}")]
    Address { input: String, reason: String },

    #[error("cannot connect to NBD server {addr}: {err}")]
    Connect {
        addr: Arc<str>,
        /// In the message, so not also `source()` (`{:#}` would print it twice).
        err: std::io::Error,
    },

    #[error("connecting to NBD server {addr} (export {export:?}) took longer than {timeout:?}")]
    ConnectTimeout {
        addr: Arc<str>,
        export: String,
        timeout: Duration,
    },

    #[error("NBD handshake with {addr} (export {export:?}) failed: {reason}")]
    Handshake {
        addr: Arc<str>,
        export: String,
        reason: String,
    },

    #[error(
        "NBD server {addr} refused export {export:?} in {option}: {meaning} (reply {reply:#x}); server said: {message:?}"
    )]
    Refused {
        addr: Arc<str>,
        export: String,
        option: &'static str,
        reply: u32,
        meaning: &'static str,
        message: String,
    },

    #[error(
        "NBD server {addr} failed {op} at offset {offset} length {len}: {} ({errno}){}",
        errno_name(*errno),
        if message.is_empty() { String::new() } else { format!(": {message}") }
    )]
    Server {
        addr: Arc<str>,
        op: Op,
        offset: u64,
        len: u64,
        errno: u32,
        message: String,
    },

    #[error("NBD connection to {addr} is gone ({reason}); reconnect and re-send")]
    Disconnected { addr: Arc<str>, reason: Arc<str> },

    #[error(
        "NBD server {addr} did not answer {op} at offset {offset} length {len} within {timeout:?}; the connection was closed"
    )]
    Timeout {
        addr: Arc<str>,
        op: Op,
        offset: u64,
        len: u64,
        timeout: Duration,
    },

    #[error("invalid {op} at offset {offset} length {len} for export of {size} bytes on {addr}: {reason}")]
    Invalid {
        addr: Arc<str>,
        op: Op,
        offset: u64,
        len: u64,
        size: u64,
        reason: String,
    },

    #[error(
        "NBD server {addr} broke the protocol in the reply to {op} at offset {offset}: {reason}"
    )]
    Protocol {
        addr: Arc<str>,
        op: Op,
        offset: u64,
        reason: String,
    },
}

impl ClientError {
    /// True when the connection is unusable and the caller should reconnect and re-send.
    pub fn is_connection_lost(&self) -> bool {
        matches!(
            self,
            ClientError::Disconnected { .. } | ClientError::Timeout { .. }
        )
    }

    /// The server's errno, when the server answered the request with an error.
    pub fn errno(&self) -> Option<u32> {
        match self {
            ClientError::Server { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}
