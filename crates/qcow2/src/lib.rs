//! Native qcow2 for vdstream: versions of a vDisk are qcow2 files whose backing chain
//! points at the previous layer, so `qemu-img info --backing-chain`, `check` and `compare`
//! work on any version in the store.
//!
//! Split the way cloud-hypervisor splits its disk formats:
//!
//! ```text
//!   header.rs    pure parser/validator of the header over &[u8] (fuzzed)
//!   image.rs     Qcow2Image: open, L1/L2 mapping, reads, block status   ┐ the I/O engine,
//!   write.rs     writes, zeroes/trims, flush ordering                   ┘ one BlockDev
//!   l2cache.rs   bounded LRU of L2 tables
//!   refcount.rs  refcount table/blocks and the end-of-file allocator
//!   chain.rs     open_recorded (a chain the store records), open_chain (a file named), create
//!   merge.rs     merge_layers: merge a chain's upper layers (or all) into a new image
//!   rebase.rs    set_backing_file: re-point an image's header (qemu-img rebase -u)
//!   sanity.rs    sanity: a cheap check of the file against its own size (truncation)
//! ```
//!
//! What is implemented, from qemu's `docs/interop/qcow2.txt`: versions 2 and 3, cluster
//! sizes 512 B to 2 MiB; normal, zero (v3) and compressed (zlib/deflate) clusters; backing
//! files (raw or qcow2) with the backing format extension; writes with copy-on-write,
//! L2 allocation and 16-bit refcounts kept exact (so `qemu-img check` finds no errors and
//! no leaks). Refused by name: encryption, external data files, extended L2, zstd,
//! unknown incompatible features; writing images with internal snapshots or other
//! refcount widths. Invariants are stated at the top of each module.

pub mod chain;
pub mod header;
mod image;
mod l2cache;
mod merge;
mod rebase;
mod refcount;
mod sanity;
mod write;

pub use chain::{
    chain_of, check_backing, create, open_chain, open_recorded, open_recorded_with, probe_named,
    resolve_backing, ImageFormat, LayerHook, LayerSpec,
};
pub use header::{with_backing, Header, HeaderError};
pub use image::{Holding, OpenOptions, Qcow2Image, DEFAULT_L2_CACHE_BYTES};
pub use merge::{merge_layers, MergeOptions, MergeReport, CHUNK_BYTES};
pub use rebase::set_backing_file;
pub use sanity::{check_sane, sanity, Sanity};
