//! A version's kernel and initrd for the boot service: the one call into
//! `vdstream_boot::boot_files` (which reads the version's `/boot/vmlinuz-*` and modules and
//! builds and caches the initramfs), behind [`boot_files`] so the HTTP side does not care
//! how they are made.
//!
//! STAND-IN: until `vdstream_boot::boot_files(store, vdisk, version, &BuildOptions)` lands,
//! this takes the files an administrator (or a test) put in
//! `STORE/boot-cache/NAME/V/{vmlinuz,initrd.img}` (V: the version number, 0 for the
//! base), and answers [`BootError::NoKernel`] otherwise. Switching is this one function.

use std::path::Path;

use vdstream_boot::{BootError, BootFiles};
use vdstream_store::{Layer, Store};

/// The kernel and initrd of `vdisk` at `layer`. Blocks (reads the store, may build the
/// initramfs): call on the blocking pool.
pub fn boot_files(store: &Store, vdisk: &str, layer: Layer) -> Result<BootFiles, BootError> {
    let number = match layer {
        Layer::Base => 0,
        Layer::Version(n) => u64::from(n),
    };
    let meta = store.load(vdisk)?;
    if let Layer::Version(n) = layer {
        if !meta.versions.iter().any(|v| v.number == n) {
            return Err(BootError::Image { vdisk: vdisk.into(), version: number.to_string(), why: format!("it has no version {n}") });
        }
    }
    let dir = store.root().join("boot-cache").join(vdisk).join(number.to_string());
    let (kernel, initrd) = (dir.join("vmlinuz"), dir.join("initrd.img"));
    if !is_file(&kernel) || !is_file(&initrd) {
        return Err(BootError::NoKernel { vdisk: vdisk.into(), version: number.to_string(), why: "no kernel was found for it".into() });
    }
    Ok(BootFiles { kernel, initrd, kernel_version: String::new(), version: number })
}

fn is_file(p: &Path) -> bool {
    p.metadata().is_ok_and(|m| m.is_file())
}
