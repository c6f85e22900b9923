//! Merges with versions left above the merged ones: a maintenance version on top, a
//! version in test, a release scheduled for later, an override. For every selector the
//! bytes before and after each merge are compared, and `qemu-img check` and
//! `qemu-img info --backing-chain` judge every file left. Crashes between the commit steps
//! are simulated with the test hook `Store::merge_stopping_after` and repaired by the next
//! command.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use vdstream_store::merge::{AutoMerge, MergeStep};
use vdstream_store::meta::MergeKind;
use vdstream_store::open::chain_files;
use vdstream_store::time::Timestamp;
use vdstream_store::vdisk::NewVdisk;
use vdstream_store::{Access, Layer, Selector, Store, StoreError};

const MIB: u64 = 1 << 20;

/// One test at a time: a `qemu-img` child forked by one test holds (until its exec) the
/// descriptors, and so the `flock`s, another test is about to drop.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn store(dir: &Path) -> Store {
    Store::open_or_create(dir.join("store")).unwrap().0
}

/// Writes `data` at `offset` through the maintenance version (one writer, then closed).
fn write_maintenance(s: &Store, name: &str, offset: u64, data: &[u8]) {
    let l = s.open_layer(name, Selector::Maintenance, true).unwrap();
    l.dev.write_at(data, offset, false).unwrap();
    l.dev.flush().unwrap();
}

/// A new version with `data` at `offset`, left in maintenance or promoted to `to`.
fn patch(s: &Store, name: &str, offset: u64, data: &[u8], to: Access) -> u32 {
    let v = s.new_version(name, None).unwrap().number;
    write_maintenance(s, name, offset, data);
    if to != Access::Maintenance {
        s.promote(name, v, to, None).unwrap();
    }
    v
}

fn refused(e: StoreError) -> String {
    match e {
        StoreError::Refused(m) => m,
        other => panic!("expected a refusal, got {other}"),
    }
}

/// What every kind of target reads now: production, test, maintenance (if any), latest,
/// and each numbered version.
fn snapshot(s: &Store, name: &str) -> BTreeMap<String, Vec<u8>> {
    let meta = s.get(name).unwrap();
    let mut sels = vec![
        ("production".to_string(), Selector::Production),
        ("test".into(), Selector::Test),
        ("latest".into(), Selector::Latest),
    ];
    if meta.maintenance().is_some() {
        sels.push(("maintenance".into(), Selector::Maintenance));
    }
    sels.extend(
        meta.versions
            .iter()
            .map(|v| (v.number.to_string(), Selector::Number(v.number))),
    );
    sels.into_iter()
        .map(|(k, sel)| {
            let l = s.open_layer(name, sel, false).unwrap();
            let mut buf = vec![0u8; l.dev.size() as usize];
            l.dev.read_at(&mut buf, 0).unwrap();
            (k, buf)
        })
        .collect()
}

/// Every selector that still exists reads the same bytes as before; `moved` maps a
/// merged version's number to the one that replaced it.
fn assert_unchanged(
    before: &BTreeMap<String, Vec<u8>>,
    after: &BTreeMap<String, Vec<u8>>,
    moved: &[(u32, u32)],
) {
    for key in ["production", "test", "latest", "maintenance"] {
        assert_eq!(
            before.contains_key(key),
            after.contains_key(key),
            "{key} appeared or vanished"
        );
    }
    for (k, bytes) in after {
        let was = match before.get(k) {
            Some(b) => b,
            None => {
                let n: u32 = k.parse().unwrap();
                let (old, _) = moved
                    .iter()
                    .find(|(_, new)| *new == n)
                    .unwrap_or_else(|| panic!("version {k} is new but not a merge"));
                &before[&old.to_string()]
            }
        };
        assert!(was == bytes, "{k} reads other bytes after the merge");
    }
}

/// `qemu-img check` on every qcow2 file of the vDisk, and `qemu-img info --backing-chain`
/// on every layer names exactly the chain the metadata lists.
fn qemu_judges(s: &Store, name: &str) {
    let meta = s.get(name).unwrap();
    assert!(meta.pending_merge.is_none());
    let tops =
        std::iter::once(Layer::Base).chain(meta.versions.iter().map(|v| Layer::Version(v.number)));
    for layer in tops {
        let chain = chain_files(&meta, layer);
        let (top, format) = chain.last().unwrap();
        let path = s.file_path(name, top);
        if format.name() == "qcow2" {
            let out = Command::new("qemu-img")
                .arg("check")
                .arg(&path)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "qemu-img check {top}: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        let out = Command::new("qemu-img")
            .args(["info", "--backing-chain", "--output=json"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "qemu-img info {top}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let infos: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let files: Vec<String> = infos
            .as_array()
            .unwrap()
            .iter()
            .rev()
            .map(|i| {
                Path::new(i["filename"].as_str().unwrap())
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        let want: Vec<String> = chain.iter().map(|(f, _)| f.clone()).collect();
        assert_eq!(
            files, want,
            "the backing chain of {top} is not the one the metadata lists"
        );
    }
}

fn audit_actions(s: &Store, name: &str) -> Vec<serde_json::Value> {
    vdstream_store::audit::read(&s.audit_path(), Some(name), None)
        .unwrap()
        .into_iter()
        .map(|e| serde_json::json!({"action": e.action, "details": e.details}))
        .collect()
}

#[test]
fn a_maintenance_version_on_top_is_repointed_onto_the_merge() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    s.create_vdisk("w", 8 * MIB, NewVdisk::default()).unwrap();
    patch(&s, "w", 0, &[1; 65536], Access::Production);
    patch(&s, "w", MIB, &[2; 70000], Access::Production);
    let m = patch(&s, "w", 0, &[3; 4096], Access::Maintenance);
    let before = snapshot(&s, "w");

    let out = s
        .merge("w", MergeKind::Updates, false, &mut |_, _| {})
        .unwrap();
    assert_eq!(
        (out.merged.clone(), out.new_layer, out.repointed),
        (vec![1, 2], Layer::Version(4), Some(m))
    );
    let meta = s.get("w").unwrap();
    assert_eq!(
        meta.versions
            .iter()
            .map(|v| (v.number, v.access))
            .collect::<Vec<_>>(),
        vec![(4, Access::Production), (m, Access::Maintenance)]
    );
    assert_unchanged(&before, &snapshot(&s, "w"), &[(2, 4)]);
    qemu_judges(&s, "w");

    // The maintenance version is still the one writer's, over the merged layer.
    write_maintenance(&s, "w", 2 * MIB, &[4; 512]);
    s.promote("w", m, Access::Production, None).unwrap();
    let before = snapshot(&s, "w");
    let out = s
        .merge("w", MergeKind::Base, false, &mut |_, _| {})
        .unwrap();
    assert_eq!((out.merged, out.repointed), (vec![4, m], None));
    assert_unchanged(&before, &snapshot(&s, "w"), &[]);
    qemu_judges(&s, "w");
}

#[test]
fn a_writer_on_the_maintenance_version_defers_the_merge() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    s.create_vdisk(
        "d",
        4 * MIB,
        NewVdisk {
            max_versions: 2,
            ..Default::default()
        },
    )
    .unwrap();
    patch(&s, "d", 0, &[1; 512], Access::Production);
    patch(&s, "d", 512, &[2; 512], Access::Production);
    let m = patch(&s, "d", 1024, &[3; 512], Access::Maintenance);
    let writer = s.open_layer("d", Selector::Maintenance, true).unwrap();
    let generation = s.get("d").unwrap().generation;
    let e = refused(
        s.merge("d", MergeKind::Updates, false, &mut |_, _| {})
            .unwrap_err(),
    );
    assert!(
        e.contains(&format!(
            "version {m} of d (maintenance) is open read-write"
        )) && e.contains(&format!("pid {}", std::process::id())),
        "{e}"
    );
    assert_eq!(
        s.get("d").unwrap().generation,
        generation,
        "nothing changed"
    );
    let last = audit_actions(&s, "d").pop().unwrap();
    assert_eq!(last["action"], "version.merge.deferred");
    assert!(
        last["details"]["reason"]
            .as_str()
            .unwrap()
            .contains("open read-write"),
        "{last}"
    );

    // Over --max-versions: the automatic merge waits for the writer, and says so.
    s.set_vdisk("d", Some(1), None).unwrap();
    match s.auto_merge("d", &mut |_, _| {}).unwrap() {
        Some(AutoMerge::Deferred(why)) => assert!(
            why.contains("open read-write") && why.contains("pid"),
            "{why}"
        ),
        other => panic!("{other:?}"),
    }
    let last = audit_actions(&s, "d").pop().unwrap();
    assert_eq!(
        (
            last["action"].as_str(),
            last["details"]["automatic"].as_bool()
        ),
        (Some("version.merge.deferred"), Some(true))
    );
    drop(writer);
    let before = snapshot(&s, "d");
    match s.auto_merge("d", &mut |_, _| {}).unwrap() {
        Some(AutoMerge::Merged(o)) => assert_eq!((o.merged, o.repointed), (vec![1, 2], Some(m))),
        other => panic!("{other:?}"),
    }
    assert_unchanged(&before, &snapshot(&s, "d"), &[(2, 4)]);
    qemu_judges(&s, "d");
}

#[test]
fn merges_stop_at_what_production_boots() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    s.create_vdisk(
        "p",
        8 * MIB,
        NewVdisk {
            max_versions: 9,
            ..Default::default()
        },
    )
    .unwrap();
    patch(&s, "p", 0, &[1; 8192], Access::Production);
    patch(&s, "p", 4096, &[2; 8192], Access::Production);
    patch(&s, "p", 0, &[3; 4096], Access::Test);
    let v4 = s.new_version("p", None).unwrap().number;
    write_maintenance(&s, "p", 3 * MIB, &[4; 4096]);
    s.promote(
        "p",
        v4,
        Access::Production,
        Some(Timestamp(Timestamp::now().0 + 3600)),
    )
    .unwrap();
    patch(&s, "p", 5 * MIB, &[5; 4096], Access::Maintenance);
    assert_eq!(
        s.open_layer("p", Selector::Production, false)
            .unwrap()
            .layer,
        Layer::Version(2)
    );

    // Production boots 2: versions 1 and 2 become 6; 3 (test), 4 (scheduled), 5 stay.
    let before = snapshot(&s, "p");
    let out = s
        .merge("p", MergeKind::Updates, false, &mut |_, _| {})
        .unwrap();
    assert_eq!(
        (out.merged.clone(), out.new_layer, out.repointed),
        (vec![1, 2], Layer::Version(6), Some(3))
    );
    let meta = s.get("p").unwrap();
    assert_eq!(
        meta.versions.iter().map(|v| v.number).collect::<Vec<_>>(),
        vec![6, 3, 4, 5],
        "numbers above keep their place"
    );
    assert!(meta.version(4).unwrap().scheduled_at.is_some());
    assert_unchanged(&before, &snapshot(&s, "p"), &[(2, 6)]);
    qemu_judges(&s, "p");

    // An override pins 3 (test): 6 and 3 become 7, and the override moves with them.
    s.set_override("p", Some(3)).unwrap();
    let before = snapshot(&s, "p");
    let e = refused(
        s.merge("p", MergeKind::Base, false, &mut |_, _| {})
            .unwrap_err(),
    );
    assert!(
        e.contains("override") && e.contains("without --base"),
        "{e}"
    );
    let out = s
        .merge("p", MergeKind::Updates, false, &mut |_, _| {})
        .unwrap();
    assert_eq!((out.merged.clone(), out.repointed), (vec![6, 3], Some(4)));
    let moved = out.override_moved.expect("the override moved");
    assert_eq!((moved.from, moved.to), (3, Some(7)));
    let meta = s.get("p").unwrap();
    assert_eq!(meta.override_version, Some(7));
    assert_eq!(meta.version(7).unwrap().access, Access::Test);
    assert_unchanged(&before, &snapshot(&s, "p"), &[(3, 7)]);
    qemu_judges(&s, "p");
    let merge = audit_actions(&s, "p")
        .into_iter()
        .rev()
        .find(|e| e["action"] == "version.merge")
        .unwrap();
    assert_eq!(
        merge["details"]["override"],
        serde_json::json!({"from": 3, "to": 7})
    );

    // Into a new base, below a test version and the maintenance version.
    s.set_override("p", None).unwrap();
    s.revert("p", 4).unwrap(); // production → test: production now boots the base
    assert!(refused(
        s.merge("p", MergeKind::Base, false, &mut |_, _| {})
            .unwrap_err()
    )
    .contains("boot the base"));
    s.promote("p", 7, Access::Production, None).unwrap();
    let before = snapshot(&s, "p");
    let out = s
        .merge("p", MergeKind::Base, false, &mut |_, _| {})
        .unwrap();
    assert_eq!(
        (
            out.merged.clone(),
            out.new_layer,
            out.repointed,
            out.file.as_str()
        ),
        (vec![7], Layer::Base, Some(4), "p.base-8.qcow2")
    );
    assert_eq!(
        s.get("p")
            .unwrap()
            .versions
            .iter()
            .map(|v| v.number)
            .collect::<Vec<_>>(),
        vec![4, 5]
    );
    assert_unchanged(&before, &snapshot(&s, "p"), &[]);
    qemu_judges(&s, "p");
}

#[test]
fn automatic_merges_run_below_versions_in_test() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    s.create_vdisk(
        "a",
        4 * MIB,
        NewVdisk {
            max_versions: 2,
            ..Default::default()
        },
    )
    .unwrap();
    patch(&s, "a", 0, &[1; 512], Access::Production);
    patch(&s, "a", 512, &[2; 512], Access::Production);
    let v3 = patch(&s, "a", 1024, &[3; 512], Access::Maintenance);
    let before = snapshot(&s, "a");
    s.promote("a", v3, Access::Test, None).unwrap();
    let before_test = snapshot(&s, "a");
    assert_eq!(before["latest"], before_test["test"]);
    match s.auto_merge("a", &mut |_, _| {}).unwrap() {
        Some(AutoMerge::Merged(o)) => assert_eq!(
            (o.merged, o.repointed, o.automatic),
            (vec![1, 2], Some(v3), true)
        ),
        other => panic!("{other:?}"),
    }
    assert_unchanged(&before_test, &snapshot(&s, "a"), &[(2, 4)]);
    qemu_judges(&s, "a");
}

#[test]
fn targets_reading_the_version_above_keep_reading_through_the_repoint() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    s.create_vdisk("t", 4 * MIB, NewVdisk::default()).unwrap();
    patch(&s, "t", 0, &[1; 4096], Access::Production);
    patch(&s, "t", 4096, &[2; 4096], Access::Production);
    patch(&s, "t", 8192, &[3; 4096], Access::Test);
    let before = snapshot(&s, "t");
    let reader = s.open_layer("t", Selector::Test, false).unwrap();
    let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
    let above = s.file_path("t", "t.3.qcow2");
    let old_inode = inode(&above);
    let out = s
        .merge("t", MergeKind::Updates, false, &mut |_, _| {})
        .unwrap();
    assert_eq!(out.repointed, Some(3));
    assert_ne!(
        inode(&above),
        old_inode,
        "a file targets read is re-pointed through a copy"
    );
    let mut buf = vec![0u8; 4 * MIB as usize];
    reader.dev.read_at(&mut buf, 0).unwrap();
    assert!(
        buf == before["test"],
        "the running test target reads what it read"
    );
    assert_eq!(out.still_in_use.len(), 2, "{out:?}");
    assert_unchanged(&before, &snapshot(&s, "t"), &[(2, 4)]);
    qemu_judges(&s, "t");
    drop(reader);
    assert_eq!(s.gc().unwrap().len(), 2);
}

/// A merge stopped after `step`, then any command: the store reads the same throughout
/// and ends merged (`finished`) or as before (`undone`).
fn crash_and_recover(step: MergeStep, with_above: bool) {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    s.create_vdisk("c", 4 * MIB, NewVdisk::default()).unwrap();
    patch(&s, "c", 0, &[1; 65536], Access::Production);
    patch(&s, "c", 65536, &[2; 65536], Access::Production);
    if with_above {
        patch(&s, "c", 0, &[3; 512], Access::Maintenance);
    }
    let before = snapshot(&s, "c");
    let e = refused(
        s.merge_stopping_after("c", MergeKind::Updates, step)
            .unwrap_err(),
    );
    assert!(e.contains("test hook"), "{e}");
    let meta = s.get("c").unwrap();
    let pending = meta
        .pending_merge
        .clone()
        .expect("a merge cut short leaves its record");
    assert_eq!(
        (pending.number, pending.file.clone()),
        (
            meta.next_version - 1,
            format!("c.{}.qcow2", meta.next_version - 1)
        )
    );
    assert_eq!(
        snapshot(&s, "c"),
        before,
        "between the steps every target reads as before"
    );

    // The next command (here `vdisk set`) repairs first.
    s.set_vdisk("c", Some(7), None).unwrap();
    let meta = s.get("c").unwrap();
    assert!(meta.pending_merge.is_none());
    let finished = step == MergeStep::Repointed || (step == MergeStep::Renamed && !with_above);
    let recovered = audit_actions(&s, "c")
        .into_iter()
        .find(|e| e["action"] == "version.merge.recovered")
        .expect("audited");
    assert_eq!(
        recovered["details"]["result"],
        if finished { "finished" } else { "undone" }
    );
    if finished {
        assert_eq!(meta.versions[0].number, pending.number);
        assert_unchanged(&before, &snapshot(&s, "c"), &[(2, pending.number)]);
    } else {
        assert_eq!(
            meta.versions.iter().map(|v| v.number).collect::<Vec<_>>(),
            if with_above {
                vec![1, 2, 3]
            } else {
                vec![1, 2]
            }
        );
        assert!(
            !s.file_path("c", &pending.file).exists(),
            "the unused new file is deleted"
        );
        assert_unchanged(&before, &snapshot(&s, "c"), &[]);
        // The merge runs again, under a new number.
        let out = s
            .merge("c", MergeKind::Updates, false, &mut |_, _| {})
            .unwrap();
        assert_eq!(out.new_layer, Layer::Version(meta.next_version));
        assert_unchanged(&before, &snapshot(&s, "c"), &[(2, meta.next_version)]);
    }
    qemu_judges(&s, "c");
    for f in std::fs::read_dir(s.vdisk_dir("c")).unwrap() {
        let f = f.unwrap().file_name().to_string_lossy().into_owned();
        assert!(
            f == "vdisk.json"
                || s.get("c").unwrap().live_files().contains(&f.as_str())
                || f.contains(".tmp-"),
            "stray file {f}"
        );
    }
}

#[test]
fn a_crash_after_naming_the_merge_is_undone() {
    let _serial = serial();
    crash_and_recover(MergeStep::Pending, true);
    crash_and_recover(MergeStep::Pending, false);
}

#[test]
fn a_crash_before_the_repoint_is_undone() {
    let _serial = serial();
    crash_and_recover(MergeStep::Renamed, true);
}

#[test]
fn a_crash_with_nothing_to_repoint_is_finished() {
    let _serial = serial();
    crash_and_recover(MergeStep::Renamed, false);
}

#[test]
fn a_crash_after_the_repoint_is_finished() {
    let _serial = serial();
    crash_and_recover(MergeStep::Repointed, true);
}
