//! boot_files and build_initrd against real ext4 images (mkfs.ext4 -d) imported into a
//! real store: the kernel found, the initramfs's contents and module order, the cache, the
//! errors. Skips (with a line on stderr) where mkfs.ext4 or a static executable to stand in
//! for busybox is missing.

use std::os::unix::fs::{symlink, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use vdstream_boot::cpio::{list, Listed};
use vdstream_boot::{boot_files, build_initrd, is_static_elf, BootError, BuildOptions};
use vdstream_store::vdisk::NewVdisk;
use vdstream_store::{Selector, Store};

const KVER: &str = "6.1.0-10-test";

fn mkfs() -> Option<PathBuf> {
    ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
}

/// A static executable of the host to play busybox (it is only copied, never run).
fn static_exe() -> Option<PathBuf> {
    ["/sbin/ldconfig", "/usr/sbin/ldconfig", "/bin/busybox"]
        .iter()
        .map(PathBuf::from)
        .find(|p| {
            std::fs::read(p)
                .ok()
                .is_some_and(|b| is_static_elf(&b).unwrap_or(false))
        })
}

fn write(p: &Path, data: &[u8]) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, data).unwrap();
}

/// A module file: only its .modinfo's depends= matters to the builder.
fn ko(deps: &str) -> Vec<u8> {
    format!("\x7fELF fake module\0license=GPL\0depends={deps}\0intree=Y\0").into_bytes()
}

/// (name, relative path, depends) of the fake kernel's modules.
const MODULES: &[(&str, &str, &str)] = &[
    ("nbd", "kernel/drivers/block/nbd.ko", ""),
    ("virtio", "kernel/drivers/virtio/virtio.ko", ""),
    ("virtio_ring", "kernel/drivers/virtio/virtio_ring.ko", ""),
    (
        "virtio_pci_modern_dev",
        "kernel/drivers/virtio/virtio_pci_modern_dev.ko",
        "",
    ),
    (
        "virtio_pci",
        "kernel/drivers/virtio/virtio_pci.ko",
        "virtio_pci_modern_dev,virtio_ring,virtio",
    ),
    ("failover", "kernel/net/core/failover.ko", ""),
    (
        "net_failover",
        "kernel/drivers/net/net_failover.ko",
        "failover",
    ),
    (
        "virtio_net",
        "kernel/drivers/net/virtio_net.ko",
        "net_failover,virtio_ring,virtio",
    ),
    (
        "dummy_extra",
        "kernel/drivers/net/dummy-extra.ko",
        "failover",
    ),
];

/// A root tree: busybox, Debian's usrmerge /lib symlink, two kernels, modules.
fn tree(dir: &Path, with_kernel: bool, with_dep: bool, busybox: &Path) -> PathBuf {
    tree_with(dir, with_kernel, with_dep, busybox, "")
}

/// [`tree`], with `nbd`'s file name ending in `.ko{nbd_suffix}` (a compressed module).
fn tree_with(
    dir: &Path,
    with_kernel: bool,
    with_dep: bool,
    busybox: &Path,
    nbd_suffix: &str,
) -> PathBuf {
    let root = dir.join("root");
    write(&root.join("bin/busybox"), &std::fs::read(busybox).unwrap());
    std::fs::create_dir_all(root.join("usr/lib")).unwrap();
    symlink("usr/lib", root.join("lib")).unwrap();
    write(&root.join("sbin/init"), b"#!/bin/sh\n");
    if with_kernel {
        write(&root.join("boot/vmlinuz-6.1.0-9-test"), b"KERNEL 9");
        write(&root.join(format!("boot/vmlinuz-{KVER}")), b"KERNEL 10");
        write(&root.join("boot/config-6.1.0-10-test"), b"");
        let m = root.join("usr/lib/modules").join(KVER);
        let mut dep = String::new();
        for (name, rel, deps) in MODULES {
            let rel = &if *name == "nbd" {
                format!("{rel}{nbd_suffix}")
            } else {
                rel.to_string()
            };
            write(&m.join(rel), &ko(deps));
            let files: Vec<&str> = deps
                .split(',')
                .filter(|d| !d.is_empty())
                .map(|d| MODULES.iter().find(|x| x.0 == d).unwrap().1)
                .collect();
            dep.push_str(&format!("{rel}: {}\n", files.join(" ")));
        }
        if with_dep {
            write(&m.join("modules.dep"), dep.as_bytes());
        }
        write(
            &m.join("modules.builtin"),
            b"kernel/fs/ext4/ext4.ko\nkernel/net/packet/af_packet.ko\n",
        );
    }
    root
}

/// mkfs.ext4 -d ROOT into a 32 MiB image, optionally behind an MBR (the file system at 1 MiB).
fn image(dir: &Path, root: &Path, mbr: bool) -> PathBuf {
    let fs = dir.join("fs.img");
    std::fs::File::create(&fs)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    let out = Command::new(mkfs().unwrap())
        .args(["-q", "-F", "-E", "root_owner=0:0", "-d"])
        .arg(root)
        .arg(&fs)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "mkfs.ext4: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    if !mbr {
        return fs;
    }
    let disk = dir.join("disk.img");
    let mut d = vec![0u8; 1 << 20];
    d[446 + 4] = 0x83;
    d[446 + 8..446 + 12].copy_from_slice(&2048u32.to_le_bytes());
    d[446 + 12..446 + 16].copy_from_slice(&(65536u32).to_le_bytes());
    d[510] = 0x55;
    d[511] = 0xAA;
    d.extend(std::fs::read(&fs).unwrap());
    std::fs::write(&disk, d).unwrap();
    disk
}

struct Fixture {
    _dir: tempfile::TempDir,
    store: Store,
    busybox: PathBuf,
}

fn fixture(with_kernel: bool, with_dep: bool, mbr: bool) -> Option<Fixture> {
    if mkfs().is_none() {
        eprintln!("skipped: no mkfs.ext4");
        return None;
    }
    let Some(busybox) = static_exe() else {
        eprintln!("skipped: no static executable on this host to stand in for busybox");
        return None;
    };
    let dir = tempfile::tempdir().unwrap();
    let root = tree(dir.path(), with_kernel, with_dep, &busybox);
    let img = image(dir.path(), &root, mbr);
    let store = Store::open_or_create(dir.path().join("store")).unwrap().0;
    store
        .import_vdisk("gold", &img, NewVdisk::default(), &mut |_, _| {})
        .unwrap();
    Some(Fixture {
        _dir: dir,
        store,
        busybox,
    })
}

fn names(l: &[Listed]) -> Vec<&str> {
    l.iter().map(|e| e.name.as_str()).collect()
}

fn file<'a>(l: &'a [Listed], name: &str) -> &'a Listed {
    l.iter()
        .find(|e| e.name == name)
        .unwrap_or_else(|| panic!("{name} is not in the initramfs: {:?}", names(l)))
}

fn check_initramfs(initrd: &Path, busybox: &Path, extra: &[&str]) {
    let l = list(&std::fs::read(initrd).unwrap()).unwrap();
    let n = names(&l);
    // Parents come before their contents.
    for (i, name) in n.iter().enumerate() {
        if let Some((parent, _)) = name.rsplit_once('/') {
            assert!(
                n[..i].contains(&parent),
                "{name} comes before its directory {parent}"
            );
        }
    }
    let init = file(&l, "init");
    assert_eq!(init.mode & 0o170777, 0o100755);
    assert!(String::from_utf8_lossy(&init.data).contains("--kernel-nbd /dev/nbd0 --daemon"));
    assert!(n.contains(&"etc/vdstream/udhcpc.script"));
    assert_eq!(
        file(&l, "bin/busybox").data,
        std::fs::read(busybox).unwrap()
    );
    let me = std::env::current_exe().unwrap();
    assert_eq!(
        file(&l, "bin/vdstream").data,
        vdstream_boot::strip_debug(&std::fs::read(&me).unwrap()).unwrap()
    );
    // The binary's libraries and interpreter, as ldd names them.
    let ldd = Command::new("ldd").arg(&me).output().unwrap();
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        let path = line.split_whitespace().find(|w| w.starts_with('/'));
        if let Some(p) = path {
            assert!(
                n.contains(&p.trim_start_matches('/')),
                "{p} (from ldd) is not in the initramfs: {n:?}"
            );
        }
    }
    // Modules in dependency order, built-in ones left out.
    let order = String::from_utf8(file(&l, "etc/vdstream/modules").data.clone()).unwrap();
    let order: Vec<&str> = order.lines().collect();
    let pos = |m: &str| {
        order
            .iter()
            .position(|x| *x == m)
            .unwrap_or_else(|| panic!("{m} not loaded: {order:?}"))
    };
    for (name, _, deps) in MODULES
        .iter()
        .filter(|m| m.0 != "dummy_extra" || extra.contains(&"dummy-extra"))
    {
        assert!(n.contains(&format!("lib/modules/{name}.ko").as_str()));
        for d in deps.split(',').filter(|d| !d.is_empty()) {
            assert!(pos(d) < pos(name), "{d} must load before {name}: {order:?}");
        }
    }
    assert_eq!(
        order.len(),
        if extra.is_empty() {
            MODULES.len() - 1
        } else {
            MODULES.len()
        },
        "{order:?}"
    );
    assert!(!order.contains(&"ext4") && !order.contains(&"af_packet"));
}

#[test]
fn boot_files_builds_once_and_caches() {
    let Some(f) = fixture(true, true, false) else {
        return;
    };
    let opts = BuildOptions::default();
    let b = boot_files(&f.store, "gold", 0, &opts).unwrap();
    assert_eq!(b.kernel_version, KVER, "the newest kernel by version order");
    assert_eq!(std::fs::read(&b.kernel).unwrap(), b"KERNEL 10");
    assert_eq!(b.version, 0);
    assert!(b
        .initrd
        .starts_with(f.store.root().join("boot-cache/gold/base")));
    check_initramfs(&b.initrd, &f.busybox, &[]);
    // A second call takes the cached files.
    let ino = std::fs::metadata(&b.initrd).unwrap().ino();
    let again = boot_files(&f.store, "gold", 0, &opts).unwrap();
    assert_eq!(again.initrd, b.initrd);
    assert_eq!(
        std::fs::metadata(&again.initrd).unwrap().ino(),
        ino,
        "rebuilt instead of cached"
    );
    // Other options: another key, the old entry removed, the extra module loaded.
    let opts2 = BuildOptions {
        modules: vec!["dummy-extra".into()],
        ..Default::default()
    };
    let c = boot_files(&f.store, "gold", 0, &opts2).unwrap();
    assert_ne!(c.initrd, b.initrd);
    assert!(
        !b.initrd.exists(),
        "the entry of the old key is left behind"
    );
    check_initramfs(&c.initrd, &f.busybox, &["dummy-extra"]);
}

#[test]
fn concurrent_callers_share_one_build() {
    let Some(f) = fixture(true, true, false) else {
        return;
    };
    // A version on top of the base: the same file system, version 1.
    f.store.new_version("gold", None).unwrap();
    let opts = BuildOptions::default();
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| s.spawn(|| boot_files(&f.store, "gold", 1, &opts)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    let ino = std::fs::metadata(&results[0].initrd).unwrap().ino();
    for r in &results {
        assert_eq!(r.version, 1);
        assert_eq!(r.initrd, results[0].initrd);
        assert_eq!(std::fs::metadata(&r.initrd).unwrap().ino(), ino);
    }
    let dirs: Vec<_> = std::fs::read_dir(f.store.root().join("boot-cache/gold/v1"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".lock")
        .collect();
    assert_eq!(dirs.len(), 1, "one cache entry, no leftovers: {dirs:?}");
}

#[test]
fn modinfo_order_and_a_partitioned_disk() {
    // No modules.dep (depends= of each module instead), and the file system in an MBR partition.
    let Some(f) = fixture(true, false, true) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (ird, k) = (dir.path().join("initrd.img"), dir.path().join("vmlinuz"));
    let opts = BuildOptions {
        modules: vec!["dummy-extra".into()],
        ..Default::default()
    };
    let r = build_initrd(&f.store, "gold", Selector::Latest, &opts, &ird, Some(&k)).unwrap();
    assert_eq!(r.kernel_version, KVER);
    assert_eq!(r.kernel_path, format!("/boot/vmlinuz-{KVER}"));
    assert_eq!(r.busybox, "image:/bin/busybox");
    assert_eq!(std::fs::read(&k).unwrap(), b"KERNEL 10");
    check_initramfs(&ird, &f.busybox, &["dummy-extra"]);
}

#[test]
fn a_version_without_a_kernel_is_refused_clearly() {
    let Some(f) = fixture(false, false, false) else {
        return;
    };
    let e = boot_files(&f.store, "gold", 0, &BuildOptions::default()).unwrap_err();
    assert!(matches!(e, BootError::NoKernel { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("vDisk gold version base has no kernel") && msg.contains("/boot/vmlinuz"),
        "{msg}"
    );
    assert!(!f
        .store
        .root()
        .join("boot-cache/gold/base")
        .read_dir()
        .unwrap()
        .flatten()
        .any(|e| e.file_name() != ".lock"));
}

#[test]
fn an_unknown_module_is_refused() {
    let Some(f) = fixture(true, true, false) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ird = dir.path().join("initrd.img");
    let opts = BuildOptions {
        modules: vec!["no_such_driver".into()],
        ..Default::default()
    };
    let e = build_initrd(&f.store, "gold", Selector::Base, &opts, &ird, None).unwrap_err();
    assert!(
        matches!(e, BootError::Build { .. }) && e.to_string().contains("no_such_driver is neither"),
        "{e}"
    );
    assert!(!ird.exists(), "a failed build leaves no initramfs");
}

#[test]
fn a_dynamic_busybox_is_refused() {
    let dynamic = PathBuf::from("/bin/sh");
    if mkfs().is_none()
        || std::fs::read(&dynamic)
            .ok()
            .is_none_or(|b| is_static_elf(&b).unwrap_or(true))
    {
        eprintln!("skipped: no mkfs.ext4 or no dynamic /bin/sh");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = tree(
        dir.path(),
        true,
        true,
        &std::fs::canonicalize(&dynamic).unwrap(),
    );
    let img = image(dir.path(), &root, false);
    let store = Store::open_or_create(dir.path().join("store")).unwrap().0;
    store
        .import_vdisk("gold", &img, NewVdisk::default(), &mut |_, _| {})
        .unwrap();
    let opts = BuildOptions {
        busybox: Some(dynamic),
        ..Default::default()
    };
    let e = boot_files(&store, "gold", 0, &opts).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("the version's /bin/busybox is not a static executable")
            || msg.contains("dynamically linked"),
        "{msg}"
    );
    assert!(
        msg.contains("dynamically linked") && msg.contains("busybox-static"),
        "{msg}"
    );
}

#[test]
fn a_compressed_module_is_refused_by_name() {
    let (Some(_), Some(bb)) = (mkfs(), static_exe()) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let root = tree_with(dir.path(), true, true, &bb, ".xz");
    let img = image(dir.path(), &root, false);
    let store = Store::open_or_create(dir.path().join("store")).unwrap().0;
    store
        .import_vdisk("gold", &img, NewVdisk::default(), &mut |_, _| {})
        .unwrap();
    let e = build_initrd(
        &store,
        "gold",
        Selector::Base,
        &BuildOptions::default(),
        &dir.path().join("i.img"),
        None,
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("module nbd is compressed (nbd.ko.xz)") && msg.contains("plain .ko"),
        "{msg}"
    );
}

/// The stripped binary still runs and is no larger (the test binary has debug sections in
/// the dev profile; in release-test only those of the standard library it links).
#[test]
fn strip_debug_keeps_a_runnable_binary() {
    let me = std::env::current_exe().unwrap();
    let data = std::fs::read(&me).unwrap();
    let small = vdstream_boot::strip_debug(&data).unwrap();
    assert!(small.len() <= data.len());
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("stripped");
    std::fs::write(&p, &small).unwrap();
    std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = Command::new(&p).arg("--list").output().unwrap();
    assert!(
        out.status.success()
            && String::from_utf8_lossy(&out.stdout).contains("strip_debug_keeps_a_runnable_binary"),
        "the stripped test binary does not run: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// ext4 as a module that asks for `crypto-crc32c` (its softdep), which two modules answer
/// by alias, read from the image's ext4 without depmod's files: both drivers go into the
/// initramfs before ext4, each as an optional line of /etc/vdstream/modules.
#[test]
fn soft_dependencies_and_the_modules_of_their_alias_go_in() {
    let (Some(_), Some(bb)) = (mkfs(), static_exe()) else {
        eprintln!("skipped: no mkfs.ext4 or no static executable");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let root = tree(dir.path(), true, false, &bb);
    let m = root.join("usr/lib/modules").join(KVER);
    let fake = |fields: &str| format!("\x7fELF fake module\0license=GPL\0{fields}\0").into_bytes();
    write(
        &m.join("kernel/fs/ext4/ext4.ko"),
        &fake("softdep=pre: crypto-crc32c\0depends=jbd2"),
    );
    write(
        &m.join("kernel/fs/jbd2/jbd2.ko"),
        &fake("softdep=pre: crypto-crc32c\0depends="),
    );
    write(
        &m.join("kernel/crypto/crc32c_generic.ko"),
        &fake("alias=crypto-crc32c\0alias=crc32c\0depends="),
    );
    write(
        &m.join("kernel/arch/x86/crypto/crc32c-intel.ko"),
        &fake("alias=crypto-crc32c\0alias=crc32c\0depends="),
    );
    write(
        &m.join("modules.builtin"),
        b"kernel/net/packet/af_packet.ko\n",
    );
    let img = image(dir.path(), &root, false);
    let store = Store::open_or_create(dir.path().join("store")).unwrap().0;
    store
        .import_vdisk("gold", &img, NewVdisk::default(), &mut |_, _| {})
        .unwrap();
    let ird = dir.path().join("initrd.img");
    let r = build_initrd(
        &store,
        "gold",
        Selector::Base,
        &BuildOptions::default(),
        &ird,
        None,
    )
    .unwrap();
    let l = list(&std::fs::read(&ird).unwrap()).unwrap();
    let lines = String::from_utf8(file(&l, "etc/vdstream/modules").data.clone()).unwrap();
    let lines: Vec<&str> = lines.lines().collect();
    let pos = |want: &str| {
        lines
            .iter()
            .position(|x| *x == want)
            .unwrap_or_else(|| panic!("no line {want:?} in {lines:?}"))
    };
    for crc in ["crc32c_generic optional", "crc32c_intel optional"] {
        assert!(
            pos(crc) < pos("jbd2") && pos("jbd2") < pos("ext4"),
            "{lines:?}"
        );
        let name = crc.split(' ').next().unwrap();
        assert!(
            names(&l).contains(&format!("lib/modules/{name}.ko").as_str()),
            "{name}.ko is not in the initramfs"
        );
        assert!(r.modules.iter().any(|x| x == name), "{:?}", r.modules);
    }
    assert_eq!(lines.len(), MODULES.len() - 1 + 4, "{lines:?}");
}
