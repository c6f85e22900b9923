//! The module resolution against Debian's own kernel package, with kmod's modprobe as the
//! reference: its full module tree as installed (depmod's modules.dep, modules.alias,
//! modules.softdep) and as shipped (no depmod files: each module's .modinfo).
//!
//! The tree comes from `scripts/make-stock-image --kernel-only` (linux-image-amd64's
//! current package, unpacked into its cache). `scripts/test` makes it and sets
//! `VDSTREAM_STOCK_DEBIAN`; without that variable the default cache is used when it is
//! there, else these tests say so on stderr and pass.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use vdstream_boot::modules::{HostDir, ModuleIndex};
use vdstream_boot::DEFAULT_MODULES;

struct Tree {
    kver: String,
    /// The package as shipped.
    shipped: PathBuf,
    /// As installed, with depmod's files.
    installed: PathBuf,
}

fn tree() -> Option<Tree> {
    let (dir, required) = match std::env::var_os("VDSTREAM_STOCK_DEBIAN") {
        Some(d) => (PathBuf::from(d), true),
        None => {
            let cache = std::env::var_os("VDSTREAM_CACHE")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/vdstream"))
                })?;
            (cache.join("stock-debian"), false)
        }
    };
    let kver = match std::fs::read_to_string(dir.join("kver")) {
        Ok(k) => k.trim().to_string(),
        Err(e) if required => panic!(
            "VDSTREAM_STOCK_DEBIAN={}: no kver ({e}): run scripts/make-stock-image --kernel-only",
            dir.display()
        ),
        Err(_) => {
            eprintln!("skipped: no Debian kernel tree in {} (scripts/make-stock-image --kernel-only makes it)", dir.display());
            return None;
        }
    };
    Some(Tree {
        kver,
        shipped: dir.join("kernel"),
        installed: dir.join("installed"),
    })
}

fn wanted(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// What `modprobe --show-depends` would insmod for `names`, by module name.
fn modprobe(t: &Tree, names: &[&str]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for n in names {
        let bin = ["/usr/sbin/modprobe", "/sbin/modprobe"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .unwrap_or("modprobe");
        let o = Command::new(bin)
            .args(["-d"])
            .arg(&t.installed)
            .args(["-S", &t.kver, "--show-depends", n])
            .output()
            .expect("running modprobe (Debian: apt-get install kmod)");
        assert!(
            o.status.success(),
            "modprobe --show-depends {n}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        for line in String::from_utf8_lossy(&o.stdout).lines() {
            if let Some(p) = line.strip_prefix("insmod ") {
                out.insert(vdstream_boot::modules::module_name(p.trim()).unwrap());
            }
        }
    }
    out
}

fn resolve(root: &Path, t: &Tree, names: &[&str]) -> Vec<vdstream_boot::modules::Module> {
    let fs = HostDir(root.to_path_buf());
    let ix = ModuleIndex::load(&fs, &format!("/lib/modules/{}", t.kver)).unwrap();
    ix.load_order(&fs, &wanted(names)).unwrap()
}

fn set(order: &[vdstream_boot::modules::Module]) -> BTreeSet<String> {
    order.iter().map(|m| m.name.clone()).collect()
}

#[test]
fn ext4_brings_its_crc32c_drivers_first_as_modprobe_does() {
    let Some(t) = tree() else { return };
    let order = resolve(&t.installed, &t, &["ext4"]);
    let names: Vec<&str> = order.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(set(&order), modprobe(&t, &["ext4"]), "ext4: {names:?}");
    let pos = |m: &str| {
        names
            .iter()
            .position(|x| *x == m)
            .unwrap_or_else(|| panic!("{m} not loaded: {names:?}"))
    };
    for crc in ["crc32c_generic", "crc32c_intel"] {
        assert!(
            pos(crc) < pos("jbd2") && pos(crc) < pos("ext4"),
            "{crc} must load before jbd2 and ext4: {names:?}"
        );
        assert!(
            order[pos(crc)].optional,
            "{crc} is one of two answers to crypto-crc32c: optional"
        );
    }
    assert!(
        pos("jbd2") < pos("ext4") && pos("mbcache") < pos("ext4") && pos("crc16") < pos("ext4"),
        "{names:?}"
    );
    assert!(
        order
            .iter()
            .filter(|m| !m.name.starts_with("crc32c_"))
            .all(|m| !m.optional),
        "{order:?}"
    );
}

#[test]
fn the_default_set_is_what_modprobe_loads() {
    let Some(t) = tree() else { return };
    let fs = HostDir(t.installed.clone());
    let ix = ModuleIndex::load(&fs, &format!("/lib/modules/{}", t.kver)).unwrap();
    let present: Vec<&str> = DEFAULT_MODULES
        .iter()
        .copied()
        .filter(|m| ix.has(m) && !ix.is_builtin(m))
        .collect();
    assert!(
        present.contains(&"ext4") && present.contains(&"nbd"),
        "{present:?}"
    );
    let order = ix.load_order(&fs, &wanted(&present)).unwrap();
    assert_eq!(set(&order), modprobe(&t, &present));
    // Every module after all it depends on (modules.dep).
    let dep = std::fs::read_to_string(
        t.installed
            .join(format!("lib/modules/{}/modules.dep", t.kver)),
    )
    .unwrap();
    for (i, m) in order.iter().enumerate() {
        let line = dep
            .lines()
            .find(|l| {
                l.split(':')
                    .next()
                    .and_then(vdstream_boot::modules::module_name)
                    .as_deref()
                    == Some(&m.name)
            })
            .unwrap();
        for d in line.split_once(':').unwrap().1.split_whitespace() {
            let d = vdstream_boot::modules::module_name(d).unwrap();
            assert!(
                order[..i].iter().any(|x| x.name == d),
                "{d} must load before {}",
                m.name
            );
        }
    }
}

#[test]
fn every_softdep_line_counts_where_modprobe_takes_the_first() {
    let Some(t) = tree() else { return };
    // btrfs has four softdep lines; kmod follows the first (blake2b-256) only.
    let ours = set(&resolve(&t.installed, &t, &["btrfs"]));
    let kmod = modprobe(&t, &["btrfs"]);
    assert!(
        ours.is_superset(&kmod),
        "missing {:?}",
        kmod.difference(&ours).collect::<Vec<_>>()
    );
    let extra = modprobe(&t, &["sha256", "xxhash64"]);
    assert_eq!(
        ours,
        kmod.union(&extra).cloned().collect(),
        "btrfs: all four of its softdeps"
    );
}

#[test]
fn the_package_as_shipped_resolves_from_modinfo_alike() {
    let Some(t) = tree() else { return };
    assert!(
        !t.shipped
            .join(format!("lib/modules/{}/modules.dep", t.kver))
            .exists(),
        "the package ships no modules.dep"
    );
    let names = ["ext4", "btrfs", "nbd", "virtio_net"];
    let shipped = resolve(&t.shipped, &t, &names);
    let installed = resolve(&t.installed, &t, &names);
    assert_eq!(set(&shipped), set(&installed));
    for m in &shipped {
        let i = installed.iter().find(|x| x.name == m.name).unwrap();
        assert_eq!(
            (m.optional, m.path.rsplit('/').next()),
            (i.optional, i.path.rsplit('/').next()),
            "{}",
            m.name
        );
    }
}
