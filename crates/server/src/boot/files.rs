//! A version's kernel and initrd for the boot service, behind one function, [`boot_files`]:
//!
//! 1. A boot-file override, when the administrator put one for the version:
//!    `STORE/boot-override/NAME/V/vmlinuz` and `initrd.img` (V: `base` or the version's
//!    number), both. It is served as it is: for a version whose image has no kernel, or to
//!    try a kernel or initramfs by hand.
//! 2. Otherwise what `vdstream_boot::boot_files(store, vdisk, version, &BuildOptions)`
//!    finds and builds: the version's own `/boot/vmlinuz-*`, and an initramfs from its
//!    modules, cached per version under `STORE/boot-cache/`.
//!
//! A version the vDisk does not have is refused first, before anything is read.

use std::path::Path;

use vdstream_boot::{BootError, BootFiles};
use vdstream_store::{Layer, Store};

use super::version_text;

/// Where the override of `vdisk` at `layer` would be.
pub fn override_dir(store: &Store, vdisk: &str, layer: Layer) -> std::path::PathBuf {
    store
        .root()
        .join("boot-override")
        .join(vdisk)
        .join(version_text(layer))
}

/// The kernel and initrd of `vdisk` at `layer`. Blocks (reads the store, may build the
/// initramfs): call on the blocking pool.
pub fn boot_files(store: &Store, vdisk: &str, layer: Layer) -> Result<BootFiles, BootError> {
    let meta = store.load(vdisk)?;
    let (number, shown) = match layer {
        Layer::Base => (0, "base".to_string()),
        Layer::Version(n) => (u64::from(n), n.to_string()),
    };
    if let Layer::Version(n) = layer {
        if !meta.versions.iter().any(|v| v.number == n) {
            return Err(BootError::Image {
                vdisk: vdisk.into(),
                version: shown,
                why: format!("it has no version {n}"),
            });
        }
    }
    let dir = override_dir(store, vdisk, layer);
    let (kernel, initrd) = (dir.join("vmlinuz"), dir.join("initrd.img"));
    match (is_file(&kernel), is_file(&initrd)) {
        (true, true) => {
            return Ok(BootFiles {
                kernel,
                initrd,
                kernel_version: String::new(),
                version: number,
            })
        }
        (false, false) => {}
        _ => {
            // Named inside the store: this text reaches machines without credentials.
            let why = format!("its boot-file override (STORE/boot-override/{vdisk}/{shown}) needs both vmlinuz and initrd.img: add the missing one, or remove the folder");
            return Err(BootError::Image {
                vdisk: vdisk.into(),
                version: shown,
                why,
            });
        }
    }
    built(store, vdisk, number, shown)
}

/// The version's own kernel and its built initramfs.
fn built(store: &Store, vdisk: &str, number: u64, _shown: String) -> Result<BootFiles, BootError> {
    vdstream_boot::boot_files(
        store,
        vdisk,
        number,
        &vdstream_boot::BuildOptions::default(),
    )
}

fn is_file(p: &Path) -> bool {
    p.metadata().is_ok_and(|m| m.is_file())
}
