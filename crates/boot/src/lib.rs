//! Network boot of vdstream targets (issue P10).
//!
//! A diskless target boots from the network: iPXE fetches a script, then the kernel and an
//! initramfs, from `vdstream server`'s boot service. Both files come from the vDisk version
//! the target boots, so a promoted version boots its own kernel:
//!
//! - the kernel is the version's own `/boot/vmlinuz-*` (ext4 root, laid out as Debian lays it
//!   out), its modules are the version's `/lib/modules/KVER`;
//! - the initramfs is built from those modules, the `vdstream` binary and the libraries it
//!   needs, and a static busybox; its `/init` reads the `vdstream.*` parameters of the kernel
//!   command line (see [`cmdline`]), brings up the network, attaches the target with its
//!   write cache in the target's own RAM (and overflow disk), hands the disk to the kernel's
//!   NBD driver and switches root to it.
//!
//! Built files are cached per version (see [`BootFiles`]).

pub mod cmdline;

use std::path::PathBuf;

/// What can go wrong while finding or building a version's boot files.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The version's file system has no `/boot/vmlinuz-*` (or no modules for it).
    #[error("vDisk {vdisk} version {version} has no kernel: {why}; install a kernel into the image (for Debian: linux-image-amd64) or set a boot-file override")]
    NoKernel { vdisk: String, version: String, why: String },
    /// The version's file system could not be read as ext4.
    #[error("vDisk {vdisk} version {version}: {why}")]
    Image { vdisk: String, version: String, why: String },
    #[error(transparent)]
    Store(#[from] vdstream_store::StoreError),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
}

/// A version's kernel and initramfs, built once and kept in the store's boot cache.
#[derive(Debug, Clone)]
pub struct BootFiles {
    /// The kernel image (a copy of the version's `/boot/vmlinuz-KVER`).
    pub kernel: PathBuf,
    /// The initramfs (newc cpio, gzip).
    pub initrd: PathBuf,
    /// The kernel's version string (`KVER`).
    pub kernel_version: String,
    /// The version number these files belong to.
    pub version: u64,
}
