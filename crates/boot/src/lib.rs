//! Network boot of vdstream targets.
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
//! Built files are cached per version (see [`boot_files`] and the `cache` module).
//!
//! Modules (each uses only those above it): `cmdline` (the contract), `image` (ext4 of a
//! version), `kernel` (the kernel and its modules directory), `modules` (the modules to
//! load, in order: dependencies, soft dependencies and aliases, as modprobe resolves them),
//! `cpio` (the archive), `cache` (the boot cache's files and lock), `build` (what goes into
//! the initramfs), and this file, which ties them to the store.

mod build;
mod cache;
pub mod cmdline;
pub mod cpio;
mod image;
pub mod kernel;
pub mod modules;

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use vdstream_store::{Layer, Selector, Store};

pub use build::{is_static_elf, strip_debug, BuildOptions, DEFAULT_MODULES};

/// What can go wrong while finding or building a version's boot files.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The version's file system has no `/boot/vmlinuz-*` (or no modules for it).
    #[error("vDisk {vdisk} version {version} has no kernel: {why}; install a kernel into the image (for Debian: linux-image-amd64) or set a boot-file override")]
    NoKernel {
        vdisk: String,
        version: String,
        why: String,
    },
    /// The version's file system could not be read as ext4.
    #[error("vDisk {vdisk} version {version}: {why}")]
    Image {
        vdisk: String,
        version: String,
        why: String,
    },
    /// The initramfs could not be built (no static busybox, a missing module, ...).
    #[error("cannot build the initramfs of vDisk {vdisk} version {version}: {why}")]
    Build {
        vdisk: String,
        version: String,
        why: String,
    },
    #[error(transparent)]
    Store(#[from] vdstream_store::StoreError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
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

/// What [`build_initrd`] made.
#[derive(Debug, Clone)]
pub struct InitrdReport {
    pub vdisk: String,
    /// The version number (0: the base).
    pub version: u64,
    /// `KVER`.
    pub kernel_version: String,
    /// The kernel's path in the version's file system.
    pub kernel_path: String,
    /// The modules `/init` loads, in order.
    pub modules: Vec<String>,
    /// Where busybox came from: `image:/bin/busybox` or a host path.
    pub busybox: String,
    /// Entries of the archive (files, directories, links).
    pub entries: usize,
    pub initrd_bytes: u64,
    pub kernel_bytes: u64,
}

fn layer_number(l: Layer) -> u64 {
    match l {
        Layer::Base => 0,
        Layer::Version(n) => n.into(),
    }
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BootError {
    let what = what.into();
    move |source| BootError::Io { what, source }
}

/// Writes `data` to `path` through a temporary file and a rename.
fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut std::fs::File) -> Result<(), BootError>,
) -> Result<(), BootError> {
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        std::process::id()
    ));
    let mut f =
        vdstream_blockdev::storefile::create_fresh(&tmp, vdstream_blockdev::storefile::SHARED_READ)
            .map_err(io_err(format!("creating {}", tmp.display())))?;
    let r = write(&mut f).and_then(|_| {
        f.sync_all()
            .map_err(io_err(format!("writing {}", tmp.display())))
    });
    if let Err(e) = r {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).map_err(io_err(format!(
        "renaming {} to {}",
        tmp.display(),
        path.display()
    )))
}

/// Opens the layer `sel` picks in `vdisk`, reads its kernel, writes the kernel to
/// `kernel_out` (when given) and the initramfs to `initrd_out`.
fn build_files(
    store: &Store,
    vdisk: &str,
    sel: Selector,
    opts: &BuildOptions,
    initrd_out: &Path,
    kernel_out: Option<&Path>,
) -> Result<InitrdReport, BootError> {
    let opened = store.open_layer(vdisk, sel, false)?;
    let tag = opened.layer.tag();
    let version = layer_number(opened.layer);
    let fs = image::open_fs(opened.dev.clone()).map_err(|why| BootError::Image {
        vdisk: vdisk.into(),
        version: tag.clone(),
        why,
    })?;
    let k = kernel::find_kernel(&fs).map_err(|why| BootError::NoKernel {
        vdisk: vdisk.into(),
        version: tag.clone(),
        why,
    })?;
    if k.modules_dir.is_none() {
        return Err(BootError::NoKernel {
            vdisk: vdisk.into(),
            version: tag,
            why: format!(
                "its kernel {} has no modules (no /lib/modules/{} nor /usr/lib/modules/{})",
                k.path, k.version, k.version
            ),
        });
    }
    let kernel_bytes = fs.read(k.path.as_str()).map_err(|e| BootError::Image {
        vdisk: vdisk.into(),
        version: tag.clone(),
        why: format!("reading {}: {e}", k.path),
    })?;
    let mut built = None;
    write_atomic(initrd_out, |f| {
        let w = std::io::BufWriter::new(f);
        built = Some(
            build::build_initramfs(&fs, &k, opts, w).map_err(|why| BootError::Build {
                vdisk: vdisk.into(),
                version: tag.clone(),
                why,
            })?,
        );
        Ok(())
    })?;
    let built = built.expect("built");
    if let Some(ko) = kernel_out {
        write_atomic(ko, |f| {
            std::io::Write::write_all(f, &kernel_bytes)
                .map_err(io_err(format!("writing {}", ko.display())))
        })?;
    }
    let initrd_bytes = std::fs::metadata(initrd_out)
        .map_err(io_err(format!("reading {}", initrd_out.display())))?
        .len();
    log::info!("boot: vDisk {vdisk} {}: kernel {} ({} bytes), initramfs {} ({initrd_bytes} bytes, modules: {}, busybox {})",
        opened.layer, k.version, kernel_bytes.len(), initrd_out.display(), built.modules.join(" "), built.busybox);
    Ok(InitrdReport {
        vdisk: vdisk.into(),
        version,
        kernel_version: k.version.clone(),
        kernel_path: k.path,
        modules: built.modules,
        busybox: built.busybox,
        entries: built.entries,
        initrd_bytes,
        kernel_bytes: kernel_bytes.len() as u64,
    })
}

/// Builds the initramfs of the layer `sel` picks in `vdisk` into `initrd_out`, and copies
/// its kernel to `kernel_out` when given (`vdstream initrd build`). No cache: every call
/// builds. Both files are replaced atomically.
pub fn build_initrd(
    store: &Store,
    vdisk: &str,
    sel: Selector,
    opts: &BuildOptions,
    initrd_out: &Path,
    kernel_out: Option<&Path>,
) -> Result<InitrdReport, BootError> {
    build_files(store, vdisk, sel, opts, initrd_out, kernel_out)
}

/// The directory of the boot cache under `store` (`STORE/boot-cache`).
pub fn cache_root(store: &Store) -> PathBuf {
    store.root().join("boot-cache")
}

/// The kernel and initramfs of version `version` (0: the base) of `vdisk`, from the boot
/// cache, built first when missing or out of date (see the `cache` module). Concurrent
/// callers (threads or processes) for the same version build it once: the first builds
/// under the version's lock, the others wait for it and take its files.
pub fn boot_files(
    store: &Store,
    vdisk: &str,
    version: u64,
    opts: &BuildOptions,
) -> Result<BootFiles, BootError> {
    let sel = if version == 0 {
        Selector::Base
    } else {
        Selector::Number(u32::try_from(version).map_err(|_| BootError::Image {
            vdisk: vdisk.into(),
            version: version.to_string(),
            why: "no such version".into(),
        })?)
    };
    let (key, tag) = {
        // The layer's top file identifies its content (a maintenance version's changes).
        let opened = store.open_layer(vdisk, sel, false)?;
        let mut h = Sha256::new();
        h.update(b"vdstream-boot cache 1\0");
        cache::hash_file_id(&mut h, &opened.path);
        let bin = build::vdstream_path(opts).map_err(|why| BootError::Build {
            vdisk: vdisk.into(),
            version: opened.layer.tag(),
            why,
        })?;
        cache::hash_file_id(&mut h, &bin);
        if let Some(b) = &opts.busybox {
            cache::hash_file_id(&mut h, b);
        }
        for m in &opts.modules {
            h.update(m.as_bytes());
            h.update([0]);
        }
        h.update(build::scripts_id());
        let tag = match opened.layer {
            Layer::Base => "base".to_string(),
            Layer::Version(n) => format!("v{n}"),
        };
        (cache::short_hex(h), tag)
    };
    let vdir = cache_root(store).join(vdisk).join(&tag);
    let dir = vdir.join(&key);
    let files = |kver: String| BootFiles {
        kernel: dir.join(cache::KERNEL),
        initrd: dir.join(cache::INITRD),
        kernel_version: kver,
        version,
    };
    let read_kver = || {
        std::fs::read_to_string(dir.join(cache::KVER))
            .map(|s| s.trim().to_string())
            .map_err(io_err(format!(
                "reading {}",
                dir.join(cache::KVER).display()
            )))
    };
    if cache::complete(&dir) {
        return Ok(files(read_kver()?));
    }
    vdstream_blockdev::storefile::create_dir_all(&vdir)
        .map_err(io_err(format!("creating {}", vdir.display())))?;
    let _lock = cache::Lock::exclusive(&vdir.join(".lock"))
        .map_err(io_err(format!("locking {}", vdir.join(".lock").display())))?;
    if cache::complete(&dir) {
        return Ok(files(read_kver()?)); // another caller built it while this one waited
    }
    let tmp = cache::temp_dir(&vdir, &key);
    let _ = std::fs::remove_dir_all(&tmp);
    vdstream_blockdev::storefile::create_dir_all(&tmp)
        .map_err(io_err(format!("creating {}", tmp.display())))?;
    let r = build_files(
        store,
        vdisk,
        sel,
        opts,
        &tmp.join(cache::INITRD),
        Some(&tmp.join(cache::KERNEL)),
    )
    .and_then(|rep| {
        let kver = tmp.join(cache::KVER);
        vdstream_blockdev::storefile::create_new(&kver, vdstream_blockdev::storefile::SHARED_READ)
            .and_then(|mut f| {
                std::io::Write::write_all(&mut f, format!("{}\n", rep.kernel_version).as_bytes())
            })
            .map_err(io_err(format!("writing {}", kver.display())))?;
        std::fs::rename(&tmp, &dir).map_err(io_err(format!(
            "renaming {} to {}",
            tmp.display(),
            dir.display()
        )))?;
        Ok(rep)
    });
    match r {
        Ok(rep) => {
            cache::prune(&vdir, &key);
            Ok(files(rep.kernel_version))
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(e)
        }
    }
}
