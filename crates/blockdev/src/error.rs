//! One error type for every block device: a stable [`ErrorKind`] (which the NBD edge maps to
//! an errno in exactly one place) plus the context a person needs to act on it: the
//! operation, the offset and length, and which device or file.

use std::fmt;

/// The stable kind of a block-device error. Adding a kind is an API change: the NBD edge
/// maps each one to an errno, and the mapping must stay total.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The device's backing store failed (EIO).
    Io,
    /// No space left in the device or its cache (ENOSPC). Nothing already acknowledged is lost.
    NoSpace,
    /// The device is read-only (EPERM).
    ReadOnly,
    /// The request reaches past the end of the device (EINVAL; the NBD edge filters these first).
    OutOfRange,
    /// The operation is not supported by this device (ENOTSUP).
    NotSupported,
    /// A request with bad arguments (EINVAL).
    Invalid,
    /// A fast-zero request that cannot be done fast (ENOTSUP, as the NBD spec asks for FAST_ZERO).
    NotFast,
    /// The device is shutting down or its remote went away for good (ESHUTDOWN).
    Shutdown,
}

/// What the device was asked to do when the error happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Flush,
    Trim,
    Zero,
    BlockStatus,
    Cache,
    Open,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Trim => "trim",
            Op::Zero => "write-zeroes",
            Op::BlockStatus => "block-status",
            Op::Cache => "cache",
            Op::Open => "open",
        })
    }
}

/// A block-device error with its kind and context. An I/O error names the operation, the
/// range and the device; an open error names the device (it has no range).
#[derive(Debug, thiserror::Error)]
#[error("{}", self.describe())]
pub struct Error {
    pub kind: ErrorKind,
    pub op: Op,
    pub offset: u64,
    pub len: u64,
    /// Which device: a file path, "memory", a target id.
    pub device: String,
    /// What went wrong and, where there is one, what to do about it.
    pub message: String,
    /// The OS error behind it, if any. Its text is already in `message`, so it is not the
    /// error's `source()` (a chain printed with `{:#}` would say it twice).
    pub os_error: Option<std::io::Error>,
}

impl Error {
    fn describe(&self) -> String {
        match self.op {
            Op::Open => format!("cannot open {}: {}", self.device, self.message),
            op => format!(
                "{op} of {} bytes at offset {} on {}: {}",
                self.len, self.offset, self.device, self.message
            ),
        }
    }

    pub fn new(
        kind: ErrorKind,
        op: Op,
        offset: u64,
        len: u64,
        device: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Error {
            kind,
            op,
            offset,
            len,
            device: device.into(),
            message: message.into(),
            os_error: None,
        }
    }

    /// Wraps an OS error, choosing the kind from its errno (ENOSPC stays NoSpace, and so on).
    pub fn from_io(
        err: std::io::Error,
        op: Op,
        offset: u64,
        len: u64,
        device: impl Into<String>,
    ) -> Self {
        let kind = match err.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorKind::NoSpace,
            Some(libc::EROFS) | Some(libc::EPERM) | Some(libc::EACCES) => ErrorKind::ReadOnly,
            Some(libc::EOPNOTSUPP) => ErrorKind::NotSupported,
            Some(libc::EINVAL) => ErrorKind::Invalid,
            _ => ErrorKind::Io,
        };
        Error {
            kind,
            op,
            offset,
            len,
            device: device.into(),
            message: err.to_string(),
            os_error: Some(err),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_what_matters_for_the_operation() {
        let e = Error::new(ErrorKind::Io, Op::Read, 4096, 512, "disk.img", "short read");
        assert_eq!(
            e.to_string(),
            "read of 512 bytes at offset 4096 on disk.img: short read"
        );
        let e = Error::new(
            ErrorKind::Io,
            Op::Open,
            0,
            0,
            "disk.img",
            "it is in use by another writer",
        );
        assert_eq!(
            e.to_string(),
            "cannot open disk.img: it is in use by another writer"
        );
    }
}
