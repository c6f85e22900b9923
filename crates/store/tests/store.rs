//! The store against real files: life cycle, merges through merge_layers, reference
//! counting by flock, rules, bad input, and concurrent metadata updates from threads and
//! from two processes.

use std::path::Path;
use std::sync::Arc;

use vdstream_store::meta::MergeKind;
use vdstream_store::vdisk::NewVdisk;
use vdstream_store::{Access, DiskAccess, Layer, Selector, Store, StoreError};

const MIB: u64 = 1 << 20;

fn store(dir: &Path) -> Store {
    Store::open_or_create(dir.join("store")).unwrap().0
}

fn read_all(store: &Store, name: &str, sel: Selector) -> Vec<u8> {
    let l = store.open_layer(name, sel, false).unwrap();
    let mut buf = vec![0u8; l.dev.size() as usize];
    l.dev.read_at(&mut buf, 0).unwrap();
    buf
}

/// Makes a maintenance version, writes `data` at `offset` through it, promotes it.
fn patch(store: &Store, name: &str, offset: u64, data: &[u8], to: Access) -> u32 {
    let v = store.new_version(name, None).unwrap().number;
    {
        let l = store.open_layer(name, Selector::Maintenance, true).unwrap();
        assert!(l.writable);
        l.dev.write_at(data, offset, false).unwrap();
        l.dev.flush().unwrap();
    }
    store.promote(name, v, to, None).unwrap();
    v
}

fn refused(e: StoreError) -> String {
    match e {
        StoreError::Refused(m) => m,
        other => panic!("expected a refusal, got {other}"),
    }
}

#[test]
fn versions_stack_and_roles_see_their_own() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    s.create_vdisk("w", 8 * MIB, NewVdisk::default()).unwrap();
    let v1 = patch(&s, "w", 0, &[1; 4096], Access::Production);
    let v2 = patch(&s, "w", 4096, &[2; 4096], Access::Test);
    assert_eq!((v1, v2), (1, 2));
    let prod = read_all(&s, "w", Selector::Production);
    let test = read_all(&s, "w", Selector::Test);
    assert_eq!(&prod[..8192], &[[1u8; 4096], [0; 4096]].concat()[..]);
    assert_eq!(&test[..8192], &[[1u8; 4096], [2; 4096]].concat()[..]);
    assert_eq!(
        read_all(&s, "w", Selector::Base),
        vec![0u8; 8 * MIB as usize]
    );

    // One maintenance version at a time, one writer on it.
    let v3 = s.new_version("w", None).unwrap().number;
    assert!(refused(s.new_version("w", None).unwrap_err())
        .contains(&format!("version {v3} in maintenance")));
    let writer = s.open_layer("w", Selector::Maintenance, true).unwrap();
    let e = refused(s.open_layer("w", Selector::Maintenance, true).unwrap_err());
    assert!(
        e.contains("already has a writer") && e.contains(&format!("pid {}", std::process::id())),
        "{e}"
    );
    assert!(refused(s.promote("w", v3, Access::Test, None).unwrap_err()).contains("still open"));
    drop(writer);
    assert_eq!(
        s.revert("w", v3).unwrap(),
        vdstream_store::version::Reverted::Discarded
    );
    assert!(!s.get("w").unwrap().versions.iter().any(|v| v.number == v3));
    assert!(
        !s.file_path("w", &format!("w.{v3}.qcow2")).exists(),
        "a discarded file nobody reads is deleted at once"
    );

    // Override pins production; the pinned version cannot be reverted.
    s.set_override("w", Some(v2)).unwrap();
    assert_eq!(
        s.open_layer("w", Selector::Production, false)
            .unwrap()
            .layer,
        Layer::Version(v2)
    );
    assert!(refused(s.revert("w", v2).unwrap_err()).contains("override"));
    s.set_override("w", None).unwrap();
    assert_eq!(
        s.revert("w", v1).unwrap(),
        vdstream_store::version::Reverted::To(Access::Test)
    );
    assert!(refused(s.revert("w", v1).unwrap_err()).contains("newer versions"));
    assert_eq!(
        s.open_layer("w", Selector::Production, false)
            .unwrap()
            .layer,
        Layer::Base
    );
}

#[test]
fn merges_keep_every_byte_and_files_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    s.create_vdisk("m", 8 * MIB, NewVdisk::default()).unwrap();
    patch(&s, "m", 0, &[1; 65536], Access::Production);
    patch(&s, "m", 3 * MIB, &[2; 100_000], Access::Production);
    patch(&s, "m", 0, &[0; 65536], Access::Production); // zeros over data below
    let before = read_all(&s, "m", Selector::Production);

    // A target reading version 3 keeps its files through the merge.
    let reader = s.open_layer("m", Selector::Production, false).unwrap();
    assert_eq!(reader.layer, Layer::Version(3));
    let out = s
        .merge("m", MergeKind::Updates, false, &mut |_, _| {})
        .unwrap();
    assert_eq!(out.merged, vec![1, 2, 3]);
    assert_eq!(out.new_layer, Layer::Version(4));
    assert_eq!(out.still_in_use.len(), 3, "{out:?}");
    let meta = s.get("m").unwrap();
    assert_eq!(meta.versions.len(), 1);
    assert_eq!(meta.versions[0].access, Access::Production);
    assert_eq!(read_all(&s, "m", Selector::Production), before);
    let mut buf = vec![0u8; before.len()];
    reader.dev.read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, before, "the old chain still reads the same");
    for f in &out.retired {
        assert!(s.file_path("m", f).exists(), "{f} is in use and kept");
    }
    drop(reader);
    let deleted = s.gc().unwrap();
    assert_eq!(deleted.len(), 3, "{deleted:?}");
    assert!(s.get("m").unwrap().retired.is_empty());

    // Flatten into a new base; then compact.
    patch(&s, "m", 5 * MIB, &[9; 4096], Access::Production);
    let before = read_all(&s, "m", Selector::Production);
    let out = s
        .merge("m", MergeKind::Base, false, &mut |_, _| {})
        .unwrap();
    assert_eq!(out.new_layer, Layer::Base);
    let meta = s.get("m").unwrap();
    assert!(
        meta.versions.is_empty() && meta.base.file == "m.base-6.qcow2",
        "{meta:?}"
    );
    assert_eq!(read_all(&s, "m", Selector::Production), before);
    let layers = s.compact("m", &mut |_, _| {}).unwrap();
    assert_eq!(layers.len(), 1);
    assert_eq!(read_all(&s, "m", Selector::Production), before);
}

#[test]
fn merge_rules_protect_production_and_maintenance() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    s.create_vdisk(
        "r",
        4 * MIB,
        NewVdisk {
            max_versions: 2,
            ..Default::default()
        },
    )
    .unwrap();
    patch(&s, "r", 0, &[1; 512], Access::Production);
    patch(&s, "r", 512, &[2; 512], Access::Test);
    // Production boots version 1: nothing lies below it to merge, and version 2 stays.
    let e = refused(
        s.merge("r", MergeKind::Updates, false, &mut |_, _| {})
            .unwrap_err(),
    );
    assert!(
        e.contains("boot version 1, its first version") && e.contains("nothing below it"),
        "{e}"
    );
    let v3 = s.new_version("r", None).unwrap().number;
    assert!(refused(
        s.merge("r", MergeKind::Updates, false, &mut |_, _| {})
            .unwrap_err()
    )
    .contains("its first version"));
    // Promoting the test version makes 2 versions outside maintenance: at the limit.
    s.promote("r", 2, Access::Production, None).unwrap();
    assert!(s.auto_merge("r", &mut |_, _| {}).unwrap().is_none());
    // A third one outside maintenance is over the limit: merged automatically.
    s.promote("r", v3, Access::Production, None).unwrap();
    let m = s
        .auto_merge("r", &mut |_, _| {})
        .unwrap()
        .expect("over the limit");
    match m {
        vdstream_store::merge::AutoMerge::Merged(o) => assert_eq!(o.merged, vec![1, 2, 3]),
        other => panic!("{other:?}"),
    }
    let audit = vdstream_store::audit::read(&s.audit_path(), Some("r"), None).unwrap();
    assert!(audit
        .iter()
        .any(|e| e.action == "version.merge" && e.details["automatic"] == true));
}

#[test]
fn bad_input_and_damaged_stores_say_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let e = Store::open(dir.path().join("none"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no store at") && e.contains("check --store or VDSTREAM_STORE"),
        "{e}"
    );
    let s = store(dir.path());
    assert!(s
        .create_vdisk("a/b", MIB, NewVdisk::default())
        .unwrap_err()
        .to_string()
        .contains("path separator"));
    assert!(s
        .create_vdisk("x", 1000, NewVdisk::default())
        .unwrap_err()
        .to_string()
        .contains("multiple of 512"));
    s.create_vdisk("x", MIB, NewVdisk::default()).unwrap();
    assert!(
        refused(s.create_vdisk("x", MIB, NewVdisk::default()).unwrap_err())
            .contains("already exists")
    );
    let e = s.get("y").unwrap_err().to_string();
    assert!(
        e.contains("no vDisk named \"y\"") && e.contains("known vDisks: x"),
        "{e}"
    );

    s.new_version("x", None).unwrap();
    let f = s.file_path("x", "x.1.qcow2");
    std::fs::rename(&f, dir.path().join("moved")).unwrap();
    let e = s
        .open_layer("x", Selector::Latest, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("x.1.qcow2 is missing") && e.contains("qemu-img check"),
        "{e}"
    );
    std::fs::rename(dir.path().join("moved"), &f).unwrap();

    let meta = s.vdisk_dir("x").join("vdisk.json");
    let good = std::fs::read_to_string(&meta).unwrap();
    std::fs::write(&meta, good.replacen("\"size\": ", "\"size\": x", 1)).unwrap();
    let e = s.get("x").unwrap_err().to_string();
    assert!(
        e.contains("vdisk.json is corrupt (line")
            && e.contains("restore it from backup or re-import"),
        "{e}"
    );
    let listed = s.list().unwrap();
    assert!(
        listed[0].1.is_err(),
        "list shows the damaged vDisk with its error"
    );
    std::fs::write(&meta, good).unwrap();
    s.get("x").unwrap();
}

#[test]
fn private_vdisks_have_one_writer_and_no_versions() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    s.create_vdisk(
        "p",
        4 * MIB,
        NewVdisk {
            access: DiskAccess::Private,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(refused(s.new_version("p", None).unwrap_err()).contains("private access"));
    let w = s.open_layer("p", Selector::Production, true).unwrap();
    assert!(w.writable && w.layer == Layer::Base);
    w.dev.write_at(b"mine", 0, true).unwrap();
    assert!(
        refused(s.open_layer("p", Selector::Production, true).unwrap_err())
            .contains("already has a writer")
    );
    drop(w);
    assert_eq!(&read_all(&s, "p", Selector::Base)[..4], b"mine");
    s.set_vdisk("p", None, Some(DiskAccess::Standard)).unwrap();
    s.new_version("p", None).unwrap();
    assert!(refused(
        s.set_vdisk("p", None, Some(DiskAccess::Private))
            .unwrap_err()
    )
    .contains("versions"));
}

#[test]
fn concurrent_updates_from_threads_are_all_kept() {
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(store(dir.path()));
    s.create_vdisk("c", MIB, NewVdisk::default()).unwrap();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let s = s.clone();
            std::thread::spawn(move || {
                for i in 0..25 {
                    s.set_vdisk("c", Some(1 + (t * 100 + i) % 9), None).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let meta = s.get("c").unwrap();
    assert_eq!(
        meta.generation,
        1 + 100 - unchanged_sets(&s),
        "every change is one generation"
    );
    let sets = vdstream_store::audit::read(&s.audit_path(), Some("c"), None)
        .unwrap()
        .iter()
        .filter(|e| e.action == "vdisk.set")
        .count();
    assert_eq!(sets, 100);
}

/// `vdisk set` to the value already there changes nothing (and bumps no generation).
fn unchanged_sets(s: &Store) -> u64 {
    let audit = vdstream_store::audit::read(&s.audit_path(), Some("c"), None).unwrap();
    audit
        .iter()
        .filter(|e| {
            e.action == "vdisk.set"
                && e.details["max_versions"]["from"] == e.details["max_versions"]["to"]
        })
        .count() as u64
}

/// The child side of `concurrent_updates_from_two_processes` (does nothing when run alone).
#[test]
fn child_process_updates() {
    let Ok(root) = std::env::var("VDSTREAM_STORE_TEST_CHILD") else {
        return;
    };
    let s = Store::open(&root).unwrap();
    let me: u32 = std::env::var("VDSTREAM_STORE_TEST_ID")
        .unwrap()
        .parse()
        .unwrap();
    for i in 0..40u32 {
        s.set_vdisk("two", Some(1 + (me * 40 + i) % 7), None)
            .unwrap();
        if i % 10 == 0 {
            let v = s
                .new_version("two", Some(format!("p{me}-{i}")))
                .or_else(|_| s.new_version("two", None));
            if let Ok(v) = v {
                let _ = s.promote("two", v.number, Access::Test, None);
            }
        }
    }
}

#[test]
fn concurrent_updates_from_two_processes() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    s.create_vdisk(
        "two",
        MIB,
        NewVdisk {
            max_versions: 50,
            ..Default::default()
        },
    )
    .unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|id| {
            std::process::Command::new(&exe)
                .args(["--exact", "child_process_updates", "--test-threads", "1"])
                .env("VDSTREAM_STORE_TEST_CHILD", s.root())
                .env("VDSTREAM_STORE_TEST_ID", id.to_string())
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    let meta = s.get("two").unwrap(); // loads and checks every invariant
    let audit = vdstream_store::audit::read(&s.audit_path(), Some("two"), None).unwrap();
    let pids: std::collections::BTreeSet<u32> = audit
        .iter()
        .filter(|e| e.action == "vdisk.set")
        .map(|e| e.pid)
        .collect();
    assert_eq!(pids.len(), 2, "both processes wrote");
    assert_eq!(audit.iter().filter(|e| e.action == "vdisk.set").count(), 80);
    let news = audit.iter().filter(|e| e.action == "version.new").count();
    assert_eq!(
        news,
        meta.versions.len(),
        "every version made is listed once"
    );
    for v in &meta.versions {
        assert!(s.file_path("two", &v.file).exists());
    }
}

/// Two changes decided on the same reading of a vDisk (`--expect-generation`, `If-Match`):
/// from threads at once, exactly one is made and the other is refused with the generation
/// it expected and the one it found; nothing of the loser is in the metadata or the
/// audit trail; a change that expects nothing is made whatever the generation.
#[test]
fn changes_decided_on_the_same_generation_one_wins() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    s.create_vdisk("w", 4 * MIB, NewVdisk::default()).unwrap();
    let v = s.new_version("w", None).unwrap().number;
    let g = s.get("w").unwrap().generation;
    let audit_before = vdstream_store::audit::read(&s.audit_path(), Some("w"), None)
        .unwrap()
        .len();
    let (a, b) = (s.clone().expecting(Some(g)), s.clone().expecting(Some(g)));
    let promote = std::thread::spawn(move || a.promote("w", v, Access::Test, None).map(|_| ()));
    let revert = std::thread::spawn(move || b.revert("w", v).map(|_| ()));
    let results = [promote.join().unwrap(), revert.join().unwrap()];
    let won: Vec<bool> = results.iter().map(|r| r.is_ok()).collect();
    assert_eq!(
        won.iter().filter(|w| **w).count(),
        1,
        "exactly one wins: {results:?}"
    );
    let loser = results.into_iter().find_map(|r| r.err()).unwrap();
    match &loser {
        StoreError::Changed {
            vdisk,
            expected,
            now,
        } => assert_eq!((vdisk.as_str(), *expected, *now), ("w", g, g + 1)),
        other => panic!("the loser must get a conflict, got {other:?}"),
    }
    assert!(
        loser.to_string().contains("changed since generation"),
        "{loser}"
    );
    let m = s.get("w").unwrap();
    assert_eq!(m.generation, g + 1);
    if won[0] {
        assert_eq!(m.version(v).unwrap().access, Access::Test);
    } else {
        assert!(m.version(v).is_none(), "the revert discarded it");
    }
    assert_eq!(
        vdstream_store::audit::read(&s.audit_path(), Some("w"), None)
            .unwrap()
            .len(),
        audit_before + 1,
        "one change audited"
    );
    // Expecting the current generation works; expecting nothing works.
    s.clone()
        .expecting(Some(g + 1))
        .set_override("w", None)
        .unwrap();
    s.set_override("w", None).unwrap();
}
