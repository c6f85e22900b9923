//! A version's kernel and initrd for the boot service: the one call into
//! `vdstream_boot::boot_files` (which reads the version's `/boot/vmlinuz-*` and modules and
//! builds and caches the initramfs under `STORE/boot-cache`, once per version and
//! `vdstream` binary), behind [`boot_files`] so the HTTP side does not care how they are
//! made. A version the vDisk does not have is refused here, before anything is read.

use vdstream_boot::{BootError, BootFiles, BuildOptions};
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
    vdstream_boot::boot_files(store, vdisk, number, &BuildOptions::default())
}
