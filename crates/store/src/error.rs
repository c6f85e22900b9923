//! The store's one error type. Every message says what went wrong, with which file, vDisk
//! or version, and what to do about it; the binary prints it as it is.

use std::path::PathBuf;

/// An error from a store operation.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store directory has no `store.json`.
    #[error("no store at {}: create a vDisk first with `vdstream vdisk create`", dir.display())]
    NoStore { dir: PathBuf },

    /// A vDisk name (or a version reference) that is not allowed.
    #[error("{0}")]
    BadName(String),

    /// A bad argument: size, time, version number, access.
    #[error("{0}")]
    BadInput(String),

    /// No vDisk of that name.
    #[error("no vDisk named {name:?} in {}: {known}", store.display())]
    UnknownVdisk { name: String, store: PathBuf, known: String },

    /// No target record of that id.
    #[error("no target named {id:?} in {}: {known}", store.display())]
    UnknownTarget { id: String, store: PathBuf, known: String },

    /// A metadata or data file that cannot be parsed.
    #[error("{} is corrupt ({detail}): {advice}", path.display())]
    Corrupt { path: PathBuf, detail: String, advice: String },

    /// A file the metadata names is not there.
    #[error("{} is missing: {advice}", path.display())]
    MissingFile { path: PathBuf, advice: String },

    /// A rule of the store forbids the operation; the message says which and what to do.
    #[error("{0}")]
    Refused(String),

    /// An operating-system error on a file of the store.
    #[error("cannot {what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
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

/// Wraps an OS error with the operation and the file.
pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> StoreError {
    let path = path.into();
    move |source| StoreError::Io { what, path, source }
}
