//! The vDisk store of vdstream: vDisks kept as a base plus a chain of qcow2 versions in a
//! directory, with the version life cycle of Citrix PVS (maintenance → test → production),
//! locked and atomically written metadata, an audit trail, and reference counting of
//! files by `flock`, so nothing a running target reads is deleted under it.
//!
//! ```text
//!   names.rs    vDisk names and NAME@V references (validated before any path is built)
//!   time.rs     RFC 3339 times and +DURATION
//!   meta.rs     vdisk.json / store.json schema, loading, invariants
//!   select.rs   which layer production, test and maintenance targets get (pure)
//!   fsutil.rs   atomic writes, flock, lock holders, who is acting; store files opened
//!               without following links, with owner-only modes
//!   audit.rs    audit.log, JSON lines
//!   store.rs    Store: the directory, its lock, metadata transactions, retired files
//!   open.rs     opening a layer and its chain for a target (holding its files), each
//!               layer in the format its record names, never probed
//!   vdisk.rs    create, import, set, info, export, delete
//!   version.rs  new, promote, revert, override
//!   merge.rs    merge, merge --base, automatic merges, compact
//!   targets.rs  target records: which vDisk and version a target boots, its write cache
//!   identities.rs  enrolments: the TPM key each target proved, approved or revoked
//!   documents.rs  the JSON documents the CLI prints and the server's API answers
//!   chain.rs    PVS chains (VHD or VHDX base + differencing children) imported as versions
//!   vhd.rs      differencing VHD children (qemu cannot read them)
//!   vhdx.rs     VHDX and differencing AVHDX children (qemu refuses them)
//!   source.rs   an image from outside: its format from its magic, refused if it names
//!               another file; the json: specs qemu-img opens images through
//!   copy.rs     sparse raw copies, qemu-img for other formats, progress
//!   check.rs    checks of an import's source and of a vDisk's layers (vdisk check, info)
//! ```
//!
//! The layout and formats are documented for administrators in docs/STORE.md.

pub mod audit;
pub mod chain;
pub mod check;
pub mod copy;
pub mod documents;
pub mod error;
pub mod fsutil;
pub mod identities;
pub mod merge;
pub mod meta;
pub mod names;
pub mod open;
pub mod select;
pub mod source;
pub mod store;
pub mod targets;
pub mod time;
pub mod vdisk;
pub mod version;
pub mod vhd;
pub mod vhdx;

pub use error::{Result, StoreError};
pub use meta::{Access, DiskAccess, LayerFormat, VdiskMeta, Version};
pub use open::OpenedLayer;
pub use select::{select, Layer, Selector};
pub use store::{
    check_location, first_missing_dir, server_cache_dir, store_dir, Store, DEFAULT_STORE,
    MIRROR_MARKER, STORE_SCHEMES,
};
pub use targets::{NewTarget, TargetChange, TargetRecord};
pub use time::Timestamp;
