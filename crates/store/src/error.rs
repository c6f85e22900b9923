//! The store's one error type. Every message says what went wrong, with which file, vDisk
//! or version, and what to do about it; the binary prints it as it is.

use std::path::PathBuf;

/// An error from a store operation.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store directory has no `store.json`.
    #[error("no store at {}: check --store or VDSTREAM_STORE, which name the folder that holds store.json (a new store is made by the first `vdstream vdisk create` or `vdstream vdisk import`)", dir.display())]
    NoStore { dir: PathBuf },

    /// A vDisk name (or a version reference) that is not allowed.
    #[error("{0}")]
    BadName(String),

    /// A bad argument: size, time, version number, access.
    #[error("{0}")]
    BadInput(String),

    /// No vDisk of that name.
    #[error("no vDisk named {name:?} in {}: {known}", store.display())]
    UnknownVdisk {
        name: String,
        store: PathBuf,
        known: String,
    },

    /// No version of that number (`have`: the versions there are, in words).
    #[error("vDisk {vdisk} has no version {version}; its versions are: {have}")]
    UnknownVersion {
        vdisk: String,
        version: u32,
        have: String,
    },

    /// No target record of that id.
    #[error("no target named {id:?} in {}: {known}", store.display())]
    UnknownTarget {
        id: String,
        store: PathBuf,
        known: String,
    },

    /// A metadata or data file that cannot be parsed.
    #[error("{} is corrupt ({detail}): {advice}", path.display())]
    Corrupt {
        path: PathBuf,
        detail: String,
        advice: String,
    },

    /// A file the metadata names is not there.
    #[error("{} is missing: {advice}", path.display())]
    MissingFile { path: PathBuf, advice: String },

    /// Arguments each valid alone that do not go together (`--ram` with a cache type that
    /// holds no RAM, `--at` with `--to test`); the message says which and what to do.
    #[error("{0}")]
    Inconsistent(String),

    /// A rule of the store forbids the operation; the message says which and what to do.
    #[error("{0}")]
    Refused(String),

    /// The change was made against generation `expected` of the vDisk's metadata
    /// (`--expect-generation`, the API's `If-Match`), and another change came first.
    #[error("vDisk {vdisk} changed since generation {expected} was read (it is at generation {now}); nothing was changed: read it again (`vdstream version list {vdisk}`) and decide again")]
    Changed {
        vdisk: String,
        expected: u64,
        now: u64,
    },

    /// An operating-system error on a file of the store. The OS error is part of the
    /// message and deliberately not also the error's `source()`: `{:#}` (anyhow) prints
    /// the chain, and the reason must appear once.
    #[error("cannot {what} {}: {err}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        err: std::io::Error,
    },

    /// An error from an image (qcow2 or raw) of the store.
    #[error(transparent)]
    Image(#[from] vdstream_blockdev::Error),

    /// An external tool (qemu-img) failed or is missing.
    #[error("{0}")]
    Tool(String),
}

/// Result of store operations.
pub type Result<T> = std::result::Result<T, StoreError>;

/// A name or version the workspace's grammar refuses (`vdstream_contract`).
impl From<vdstream_contract::ContractError> for StoreError {
    fn from(e: vdstream_contract::ContractError) -> Self {
        match e {
            vdstream_contract::ContractError::BadName(m) => StoreError::BadName(m),
            other => StoreError::BadInput(other.to_string()),
        }
    }
}

impl StoreError {
    /// The OS error behind this one, if any. It is held, not chained as `source()` (its
    /// text is in the message once), so callers that must tell its kind (the server telling
    /// "out of file descriptors" from "no such export") ask here.
    pub fn os_error(&self) -> Option<&std::io::Error> {
        match self {
            StoreError::Io { err, .. } => Some(err),
            StoreError::Image(e) => e.os_error.as_ref(),
            _ => None,
        }
    }
}

/// Wraps an OS error with the operation and the file.
pub(crate) fn io(
    what: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> StoreError {
    let path = path.into();
    move |err| StoreError::Io { what, path, err }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error and its `source()` chain joined as anyhow's `{:#}` prints them.
    fn chain(e: &dyn std::error::Error) -> String {
        let mut s = e.to_string();
        let mut cur = e.source();
        while let Some(c) = cur {
            s.push_str(&format!(": {c}"));
            cur = c.source();
        }
        s
    }

    #[test]
    fn an_os_error_is_printed_once_in_the_chain() {
        let os = std::io::Error::from_raw_os_error(libc::ENOENT).to_string();
        let e = io("create", "/no/such/x.raw")(std::io::Error::from_raw_os_error(libc::ENOENT));
        let text = chain(&e);
        assert_eq!(text.matches(&os).count(), 1, "{text}");
        assert!(
            text.starts_with("cannot create /no/such/x.raw: No such file"),
            "{text}"
        );
        let e = StoreError::Image(vdstream_blockdev::Error::from_io(
            std::io::Error::from_raw_os_error(libc::ENOENT),
            vdstream_blockdev::Op::Open,
            0,
            0,
            "/no/such/x.qcow2",
        ));
        let text = chain(&e);
        assert_eq!(text.matches(&os).count(), 1, "{text}");
    }
}
