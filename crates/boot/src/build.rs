//! Building the initramfs of a version: what goes in, from where.
//!
//! | in the initramfs | from |
//! | --- | --- |
//! | `/init`, `/etc/vdstream/udhcpc.script` | `crates/boot/initramfs/*.sh`, compiled in |
//! | `/bin/busybox` (static) | the version's `/bin/busybox` or `/usr/bin/busybox` when static, else [`BuildOptions::busybox`], else `busybox` in the host's `PATH`; a dynamic one is refused |
//! | `/bin/vdstream` and its libraries, the ELF interpreter | [`BuildOptions::vdstream`] (default: the running binary) without its debug sections; libraries as `lddtree` finds them on the host, at the same paths |
//! | `/lib/modules/NAME.ko`, `/etc/vdstream/modules` | the version's modules ([`DEFAULT_MODULES`] that exist, plus [`BuildOptions::modules`]) with their dependencies, soft dependencies and the modules their aliases name, in load order (the `modules` module); a line `NAME optional` is one of several modules that answer an alias |
//!
//! Invariant: the version's file system is only read; the host's files are only read.

use std::path::{Path, PathBuf};

use ext4_view::Ext4;

use crate::cpio::Archive;
use crate::kernel::Kernel;
use crate::modules::{Module, ModuleIndex};

/// The modules every initramfs loads when the version's kernel has them as modules: the
/// NBD driver, virtio and common physical NICs and disk controllers (for the overflow
/// disk), ext4 (for the root).
pub const DEFAULT_MODULES: &[&str] = &[
    "nbd",
    "virtio_pci",
    "virtio_net",
    "virtio_blk",
    "virtio_scsi",
    "e1000",
    "e1000e",
    "igb",
    "igc",
    "r8169",
    "tg3",
    "bnx2",
    "ixgbe",
    "ahci",
    "sd_mod",
    "nvme",
    "af_packet",
    "ext4",
];

const INIT: &str = include_str!("../initramfs/init.sh");
const UDHCPC: &str = include_str!("../initramfs/udhcpc.sh");

/// The identity of the compiled-in scripts (part of the boot cache's key).
pub fn scripts_id() -> [u8; 32] {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(INIT);
    h.update([0]);
    h.update(UDHCPC);
    h.update([0]);
    for m in DEFAULT_MODULES {
        h.update(m);
    }
    h.finalize().into()
}

/// What an initramfs is built from, beyond the version itself.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct BuildOptions {
    /// The `vdstream` binary to put in (default: the running one, `std::env::current_exe`).
    pub vdstream: Option<PathBuf>,
    /// A static busybox to use when the version has none.
    pub busybox: Option<PathBuf>,
    /// More modules to load (with their dependencies), after the default set.
    pub modules: Vec<String>,
}

/// What went into an initramfs.
#[derive(Debug, Clone)]
pub struct Built {
    /// Modules in load order.
    pub modules: Vec<String>,
    /// Where busybox came from (`image:/bin/busybox` or a host path).
    pub busybox: String,
    /// Files in the archive (directories and links included).
    pub entries: usize,
}

/// Whether an ELF file is statically linked: no interpreter and no needed libraries.
pub fn is_static_elf(bytes: &[u8]) -> Result<bool, String> {
    let elf = goblin::elf::Elf::parse(bytes).map_err(|e| format!("not an ELF executable: {e}"))?;
    Ok(elf.interpreter.is_none() && elf.libraries.is_empty())
}

fn read_host(p: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(p).map_err(|e| format!("reading {}: {e}", p.display()))
}

fn host_busybox() -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("busybox"))
            .find(|f| f.is_file())
    })
}

/// The busybox to put in, and where it came from.
fn busybox(fs: &Ext4, opts: &BuildOptions) -> Result<(Vec<u8>, String), String> {
    let mut skipped = Vec::new();
    for p in ["/bin/busybox", "/usr/bin/busybox"] {
        if let Ok(b) = fs.read(p) {
            if is_static_elf(&b).unwrap_or(false) {
                return Ok((b, format!("image:{p}")));
            }
            skipped.push(format!("the version's {p} is not a static executable"));
        }
    }
    if skipped.is_empty() {
        skipped.push("the version has no /bin/busybox".into());
    }
    let (path, whence) = match (&opts.busybox, host_busybox()) {
        (Some(p), _) => (p.clone(), "given"),
        (None, Some(p)) => (p, "found in PATH"),
        (None, None) => {
            return Err(format!(
                "no static busybox: {}, none was given (--busybox PATH) and there is none in PATH; install busybox-static into the image or on this host",
                skipped.join(", ")))
        }
    };
    let b = read_host(&path)?;
    match is_static_elf(&b) {
        Ok(true) => Ok((b, path.display().to_string())),
        Ok(false) => Err(format!(
            "busybox {} ({whence}) is dynamically linked and cannot run in the initramfs: give a static one (Debian: busybox-static, /bin/busybox)",
            path.display())),
        Err(e) => Err(format!("busybox {} ({whence}): {e}", path.display())),
    }
}

/// The running binary, or the one the options name.
pub fn vdstream_path(opts: &BuildOptions) -> Result<PathBuf, String> {
    match &opts.vdstream {
        Some(p) => Ok(p.clone()),
        None => {
            std::env::current_exe().map_err(|e| format!("finding the running vdstream binary: {e}"))
        }
    }
}

/// An ELF executable without its `.debug_*` sections (`strip --strip-debug`): the
/// target's RAM holds the initramfs, and a release build with debug info is about 7 times
/// the size of its code.
pub fn strip_debug(elf: &[u8]) -> Result<Vec<u8>, String> {
    let mut b =
        object::build::elf::Builder::read(elf).map_err(|e| format!("reading the ELF file: {e}"))?;
    for s in b.sections.iter_mut() {
        if s.name.starts_with(b".debug_") {
            s.delete = true;
        }
    }
    let mut out = Vec::new();
    b.write(&mut out)
        .map_err(|e| format!("writing it without debug sections: {e}"))?;
    Ok(out)
}

/// The `vdstream` binary, its interpreter and libraries, at their host paths.
fn vdstream_files(a: &mut Archive<impl std::io::Write>, bin: &Path) -> Result<(), String> {
    let tree = lddtree::DependencyAnalyzer::new(PathBuf::from("/"))
        .analyze(bin)
        .map_err(|e| format!("reading the shared libraries of {}: {e}", bin.display()))?;
    let io = |e: std::io::Error| e.to_string();
    let data = read_host(bin)?;
    let small = strip_debug(&data).unwrap_or_else(|e| {
        log::warn!(
            "boot: keeping the debug sections of {} in the initramfs: {e}",
            bin.display()
        );
        data
    });
    a.file("/bin/vdstream", 0o755, &small).map_err(io)?;
    let mut files: Vec<(String, PathBuf)> = Vec::new();
    if let Some(i) = &tree.interpreter {
        files.push((i.clone(), PathBuf::from(i)));
    }
    for (name, lib) in &tree.libraries {
        if !lib.found() {
            return Err(format!(
                "{} needs {name}, which is not on this host",
                bin.display()
            ));
        }
        files.push((
            lib.path.display().to_string(),
            lib.realpath.clone().unwrap_or_else(|| lib.path.clone()),
        ));
    }
    files.sort();
    for (at, from) in files {
        if !a.contains(&at) {
            let real =
                std::fs::canonicalize(&from).map_err(|e| format!("{}: {e}", from.display()))?;
            a.file(&at, 0o755, &read_host(&real)?).map_err(io)?;
        }
    }
    Ok(())
}

/// The module contents, uncompressed (`.ko` as is, `.ko.gz` inflated); `.ko.xz` and
/// `.ko.zst` are refused with a message.
fn module_bytes(fs: &Ext4, m: &Module) -> Result<Vec<u8>, String> {
    let b = fs
        .read(m.path.as_str())
        .map_err(|e| format!("reading {}: {e}", m.path))?;
    if m.path.ends_with(".ko") {
        return Ok(b);
    }
    if m.path.ends_with(".ko.gz") {
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&b[..]), &mut out)
            .map_err(|e| format!("inflating {}: {e}", m.path))?;
        return Ok(out);
    }
    Err(format!(
        "module {} is compressed ({}): the initramfs builder loads plain .ko and .ko.gz only; build the image's kernel with uncompressed modules or unpack them in the image (`unxz`/`unzstd` under /lib/modules, then depmod)",
        m.name, m.path.rsplit('/').next().unwrap_or_default()))
}

/// Writes the initramfs of the version whose file system is `fs` into `out`.
pub fn build_initramfs(
    fs: &Ext4,
    kernel: &Kernel,
    opts: &BuildOptions,
    out: impl std::io::Write,
) -> Result<Built, String> {
    let io = |e: std::io::Error| e.to_string();
    let dir = kernel.modules_dir.as_deref().ok_or_else(|| {
        format!(
            "no /lib/modules/{} for kernel {}",
            kernel.version, kernel.version
        )
    })?;
    let ix = ModuleIndex::load(fs, dir)?;
    let mut wanted: Vec<String> = DEFAULT_MODULES
        .iter()
        .filter(|m| ix.has(m))
        .map(|m| m.to_string())
        .collect();
    wanted.extend(opts.modules.iter().cloned());
    if !ix.has("nbd") {
        return Err(format!("kernel {} has no nbd driver (neither {dir}/.../nbd.ko nor built in): the target cannot mount its vDisk", kernel.version));
    }
    let order = ix.load_order(fs, &wanted)?;
    let (bb, bb_from) = busybox(fs, opts)?;
    let bin = vdstream_path(opts)?;

    let mut a = Archive::new(out);
    for d in [
        "/dev",
        "/proc",
        "/sys",
        "/run",
        "/tmp",
        "/newroot",
        "/etc",
        "/lib/modules",
        "/sbin",
        "/usr/bin",
        "/usr/sbin",
    ] {
        a.dir(d).map_err(io)?;
    }
    a.file("/init", 0o755, INIT.as_bytes()).map_err(io)?;
    a.file("/etc/vdstream/udhcpc.script", 0o755, UDHCPC.as_bytes())
        .map_err(io)?;
    a.file("/etc/nsswitch.conf", 0o644, b"hosts: files dns\n")
        .map_err(io)?;
    a.file("/etc/hosts", 0o644, b"127.0.0.1 localhost\n")
        .map_err(io)?;
    a.file("/bin/busybox", 0o755, &bb).map_err(io)?;
    a.symlink("/bin/sh", "busybox").map_err(io)?;
    vdstream_files(&mut a, &bin)?;
    let mut list = String::new();
    for m in &order {
        a.file(
            &format!("/lib/modules/{}.ko", m.name),
            0o644,
            &module_bytes(fs, m)?,
        )
        .map_err(io)?;
        list.push_str(&m.name);
        list.push_str(if m.optional { " optional\n" } else { "\n" });
    }
    a.file("/etc/vdstream/modules", 0o644, list.as_bytes())
        .map_err(io)?;
    let entries = a.entries();
    a.finish().map_err(io)?;
    Ok(Built {
        modules: order.into_iter().map(|m| m.name).collect(),
        busybox: bb_from,
        entries,
    })
}
