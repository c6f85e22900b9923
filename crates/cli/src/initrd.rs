//! `vdstream initrd build`: the kernel and network-boot initramfs of a vDisk version, as
//! files. Wiring only: vdstream-boot reads the version and builds the archive.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::json;
use vdstream_boot::BuildOptions;
use vdstream_store::Selector;

use crate::output::StoreOpts;

/// Build the network-boot initramfs (and copy the kernel) of a vDisk version.
#[derive(Debug, Args)]
#[command(after_help = "\
What goes in: /init (a busybox script), a static busybox (the version's own /bin/busybox,
else --busybox, else `busybox` in PATH), this vdstream binary with its shared libraries,
and the version's kernel modules the boot needs (nbd, virtio, common NICs and disk
controllers, whichever the kernel has, with their dependencies; --module adds more).
The kernel is the version's newest /boot/vmlinuz-KVER, its modules /lib/modules/KVER.
/init reads the vdstream.* parameters of the kernel command line (vdstream.target,
vdstream.server, vdstream.vdisk, vdstream.cache, vdstream.ram, vdstream.overflow,
vdstream.hostname, vdstream.machine_id, vdstream.on_fail: see docs/BOOT.md), brings up
the network by DHCP, attaches the target with its write cache in its own RAM, mounts the
vDisk through the kernel's NBD driver and switches root to it.
`vdstream server --boot` builds and caches the same files itself; this command is for
looking at them, or for booting with another boot server.

Examples:
  vdstream initrd build --vdisk golden --out initrd.img --kernel-out vmlinuz
  vdstream initrd build --vdisk golden@3 --out initrd.img --module e1000e --json
  qemu-system-x86_64 -accel tcg -m 512M -nographic -kernel vmlinuz -initrd initrd.img \\
    -append 'console=ttyS0 vdstream.target=lab1 vdstream.server=http://10.0.2.2:8080 vdstream.vdisk=golden@3' \\
    -netdev user,id=n0 -device virtio-net-pci,netdev=n0

Exit status: 3 when the vDisk, version or a kernel in it is not found; 5 when the
version's file system cannot be read; 1 when the initramfs cannot be built (no static
busybox, a module the kernel lacks); see `vdstream --help`.")]
pub struct InitrdArgs {
    #[command(subcommand)]
    command: InitrdCommand,

    #[command(flatten)]
    opts: StoreOpts,
}

#[derive(Debug, Subcommand)]
enum InitrdCommand {
    /// Build the initramfs of a vDisk version into a file (and copy its kernel).
    Build {
        /// The vDisk and version: NAME (the version production targets boot), NAME@3,
        /// NAME@latest, NAME@base.
        #[arg(long, value_name = "NAME[@V]")]
        vdisk: String,
        /// Where the initramfs goes (gzip-compressed newc cpio; replaced atomically).
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
        /// Where a copy of the version's kernel goes.
        #[arg(long, value_name = "FILE")]
        kernel_out: Option<PathBuf>,
        /// A static busybox to use when the version has none (e.g. Debian's
        /// busybox-static: /bin/busybox).
        #[arg(long, value_name = "PATH")]
        busybox: Option<PathBuf>,
        /// Another kernel module to load at boot, with its dependencies (repeatable).
        #[arg(long, value_name = "NAME")]
        module: Vec<String>,
        /// The vdstream binary to put in (default: this one).
        #[arg(long, value_name = "PATH")]
        vdstream: Option<PathBuf>,
    },
}

pub fn run(args: InitrdArgs) -> Result<()> {
    let o = &args.opts;
    match args.command {
        InitrdCommand::Build {
            vdisk,
            out,
            kernel_out,
            busybox,
            module,
            vdstream,
        } => {
            let store = o.open()?;
            let (name, sel) = vdstream_store::names::parse_ref(&vdisk, Selector::Production)?;
            if !o.json {
                errln!("building the initramfs of {vdisk}: reading its kernel and modules, then the archive (a few seconds)");
            }
            let opts = BuildOptions {
                vdstream,
                busybox,
                modules: module,
            };
            let r = vdstream_boot::build_initrd(
                &store,
                &name,
                sel,
                &opts,
                &out,
                kernel_out.as_deref(),
            )?;
            let tag = if r.version == 0 {
                "base".to_string()
            } else {
                r.version.to_string()
            };
            o.emit(
                json!({
                    "vdisk": r.vdisk, "version": r.version, "kernel_version": r.kernel_version,
                    "kernel_path": r.kernel_path, "initrd": out, "initrd_bytes": r.initrd_bytes,
                    "kernel": kernel_out, "kernel_bytes": r.kernel_bytes, "modules": r.modules,
                    "busybox": r.busybox, "entries": r.entries,
                }),
                || {
                    let mut s = format!(
                        "initramfs of {}@{tag} (kernel {}) in {}: {} KiB, {} entries, busybox from {}\nmodules, in load order: {}",
                        r.vdisk, r.kernel_version, out.display(), r.initrd_bytes >> 10, r.entries, r.busybox,
                        if r.modules.is_empty() { "none (all built in)".to_string() } else { r.modules.join(" ") });
                    if let Some(k) = &kernel_out {
                        s.push_str(&format!("\nkernel {} copied to {} ({} KiB)", r.kernel_path, k.display(), r.kernel_bytes >> 10));
                    }
                    s
                },
            );
        }
    }
    Ok(())
}
