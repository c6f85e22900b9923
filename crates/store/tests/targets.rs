//! Target records against a real store: add, show, list, set (patch), remove; the rules
//! on ids, cache types, sizes and versions; the audit trail; and the vDisk they name
//! cannot be deleted or made private under them.

use std::path::Path;

use vdstream_store::vdisk::NewVdisk;
use vdstream_store::{NewTarget, Selector, Store, StoreError, TargetChange};
use vdstream_wcache::CacheType;

const MIB: u64 = 1 << 20;

fn store(dir: &Path) -> Store {
    let s = Store::open_or_create(dir.join("store")).unwrap().0;
    s.create_vdisk("win", 8 * MIB, NewVdisk::default()).unwrap();
    s.create_vdisk("lin", 8 * MIB, NewVdisk::default()).unwrap();
    s
}

fn new(id: &str, vdisk: &str, cache: &str) -> NewTarget {
    NewTarget {
        id: id.into(),
        vdisk: vdisk.into(),
        cache: cache.into(),
        version: None,
        ram: None,
        overflow_max: None,
        description: None,
        macs: vec![],
        hostname: None,
        overflow_device: None,
    }
}

#[test]
fn records_are_added_listed_changed_and_removed() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    assert!(s.targets().unwrap().is_empty());
    let r = s
        .add_target(NewTarget {
            ram: Some(512 * MIB),
            description: Some("lab PC 1".into()),
            ..new("vm1", "win", "ram-overflow")
        })
        .unwrap();
    assert_eq!(
        (r.cache, r.version, r.ram, r.generation),
        (
            CacheType::RamOverflow,
            Selector::Production,
            Some(512 * MIB),
            1
        )
    );
    s.add_target(new("vm2", "win", "server")).unwrap();
    assert_eq!(s.target("vm1").unwrap(), r);
    assert_eq!(
        s.targets()
            .unwrap()
            .iter()
            .map(|t| t.id.as_str())
            .collect::<Vec<_>>(),
        ["vm1", "vm2"]
    );

    // The file is the record, as JSON with names, not numbers.
    let text = std::fs::read_to_string(s.root().join("targets/vm1.json")).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (
            doc["cache"].as_str(),
            doc["version"].as_str(),
            doc["format"].as_str()
        ),
        (
            Some("ram-overflow"),
            Some("production"),
            Some("vdstream-target")
        )
    );

    // Patch: absent fields stay; a cache type without RAM drops the RAM size.
    let changed = s
        .set_target(
            "vm1",
            TargetChange {
                cache: Some("device-disk".into()),
                version: Some(Selector::Test),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(
        (
            changed.cache,
            changed.version,
            changed.ram,
            changed.generation
        ),
        (CacheType::DeviceDisk, Selector::Test, None, 2)
    );
    assert_eq!(changed.description.as_deref(), Some("lab PC 1"));
    let cleared = s
        .set_target(
            "vm1",
            TargetChange {
                description: Some(None),
                vdisk: Some("lin".into()),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!((cleared.description, cleared.vdisk.as_str()), (None, "lin"));

    assert_eq!(s.remove_target("vm1").unwrap().unwrap().vdisk, "lin");
    assert!(matches!(
        s.target("vm1").unwrap_err(),
        StoreError::UnknownTarget { .. }
    ));
    let e = s.target("vm9").unwrap_err().to_string();
    assert!(
        e.contains("no target named \"vm9\"") && e.contains("known targets: vm2"),
        "{e}"
    );

    let audit = vdstream_store::audit::read(&s.audit_path(), None, None).unwrap();
    let acts: Vec<_> = audit
        .iter()
        .filter(|a| a.action.starts_with("target."))
        .map(|a| (a.action.as_str(), a.details["target"].as_str().unwrap()))
        .collect();
    assert_eq!(
        acts,
        [
            ("target.add", "vm1"),
            ("target.add", "vm2"),
            ("target.set", "vm1"),
            ("target.set", "vm1"),
            ("target.remove", "vm1")
        ]
    );
    let set = audit.iter().find(|a| a.action == "target.set").unwrap();
    assert_eq!(
        set.details["cache"],
        serde_json::json!({"from": "ram-overflow", "to": "device-disk"})
    );
}

#[test]
fn bad_records_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let err = |t: NewTarget| s.add_target(t).unwrap_err().to_string();
    assert!(err(new("../x", "win", "server")).contains("invalid target id"));
    assert!(err(new("vm1", "nope", "server")).contains("no vDisk named \"nope\""));
    assert!(err(new("vm1", "win", "ram")).contains("unknown cache type"));
    assert!(err(new("vm1", "win", "private")).contains("cannot have the private cache type"));
    assert!(err(NewTarget {
        ram: Some(MIB),
        ..new("vm1", "win", "server")
    })
    .contains("--ram is for"));
    assert!(err(NewTarget {
        version: Some(Selector::Number(7)),
        ..new("vm1", "win", "server")
    })
    .contains("has no version 7"));
    assert!(err(NewTarget {
        version: Some(Selector::Maintenance),
        ..new("vm1", "win", "server")
    })
    .contains("maintenance"));
    s.add_target(new("vm1", "win", "server")).unwrap();
    assert!(err(new("vm1", "lin", "server")).contains("already exists"));
    let e = s
        .set_target("vm1", TargetChange::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("nothing to change"), "{e}");
    assert!(s
        .set_target(
            "vm1",
            TargetChange {
                vdisk: Some("nope".into()),
                ..Default::default()
            }
        )
        .is_err());
    assert_eq!(
        s.target("vm1").unwrap().vdisk,
        "win",
        "a refused change changes nothing"
    );

    // A private vDisk has no write caches, hence no targets.
    s.create_vdisk(
        "solo",
        8 * MIB,
        NewVdisk {
            access: vdstream_store::DiskAccess::Private,
            ..NewVdisk::default()
        },
    )
    .unwrap();
    assert!(err(new("vm2", "solo", "server")).contains("private access"));
}

#[test]
fn a_vdisk_that_targets_boot_is_not_deleted_or_made_private() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    s.add_target(new("vm1", "win", "device-ram")).unwrap();
    s.add_target(new("vm2", "win", "server")).unwrap();
    let e = s.delete_vdisk("win").unwrap_err().to_string();
    assert!(
        e.contains("booted by targets vm1, vm2") && e.contains("target remove"),
        "{e}"
    );
    let e = s
        .set_vdisk("win", None, Some(vdstream_store::DiskAccess::Private))
        .unwrap_err()
        .to_string();
    assert!(e.contains("booted by targets vm1, vm2"), "{e}");
    s.set_target(
        "vm1",
        TargetChange {
            vdisk: Some("lin".into()),
            ..Default::default()
        },
    )
    .unwrap();
    s.remove_target("vm2").unwrap();
    s.delete_vdisk("win").unwrap();
    assert!(s
        .delete_vdisk("lin")
        .unwrap_err()
        .to_string()
        .contains("vm1"));
}

#[test]
fn a_damaged_record_is_named_and_can_be_removed() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    s.add_target(new("vm1", "win", "server")).unwrap();
    std::fs::write(s.root().join("targets/vm1.json"), "{oops").unwrap();
    let e = s.target("vm1").unwrap_err().to_string();
    assert!(
        e.contains("targets/vm1.json is corrupt") && e.contains("target remove"),
        "{e}"
    );
    assert!(s.targets().is_err());
    assert!(
        s.delete_vdisk("win").is_err(),
        "a record that does not load might name the vDisk"
    );
    assert_eq!(s.remove_target("vm1").unwrap(), None);
    assert!(s.targets().unwrap().is_empty());
}

#[test]
fn a_merge_moves_the_records_pinned_to_the_versions_it_folds() {
    use vdstream_store::meta::MergeKind;
    use vdstream_store::Access;
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    for _ in 0..3 {
        let v = s.new_version("win", None).unwrap().number;
        s.promote("win", v, Access::Production, None).unwrap();
    }
    s.add_target(NewTarget {
        version: Some(Selector::Number(1)),
        ..new("vm1", "win", "server")
    })
    .unwrap();
    s.add_target(NewTarget {
        version: Some(Selector::Test),
        ..new("vm2", "win", "server")
    })
    .unwrap();
    s.add_target(NewTarget {
        version: Some(Selector::Number(3)),
        ..new("vm3", "win", "server")
    })
    .unwrap();
    s.set_override("win", Some(2)).unwrap();
    let out = s
        .merge("win", MergeKind::Updates, false, &mut |_, _| {})
        .unwrap();
    assert_eq!(out.merged, [1, 2]);
    assert_eq!(out.targets_moved, ["vm1"]);
    let vm1 = s.target("vm1").unwrap();
    assert_eq!((vm1.version, vm1.generation), (Selector::Number(4), 2));
    assert_eq!(
        s.target("vm2").unwrap().version,
        Selector::Test,
        "selectors by role stay"
    );
    assert_eq!(
        s.target("vm3").unwrap().version,
        Selector::Number(3),
        "a version above the merge keeps its number"
    );
    let audit = vdstream_store::audit::read(&s.audit_path(), Some("win"), None).unwrap();
    assert_eq!(
        audit.last().unwrap().details["targets_moved"],
        serde_json::json!(["vm1"])
    );
}

#[test]
fn macs_are_normalised_unique_and_found() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let r = s
        .add_target(NewTarget {
            macs: vec![
                "52-54-00-AB-CD-01".into(),
                "52:54:00:ab:cd:02".into(),
                "52:54:00:AB:CD:01".into(),
            ],
            ..new("pc1", "win", "ram-overflow")
        })
        .unwrap();
    assert_eq!(
        r.macs,
        vec!["52:54:00:ab:cd:01", "52:54:00:ab:cd:02"],
        "lowercase, ':', sorted, no repeats"
    );
    assert_eq!(s.target("pc1").unwrap().macs, r.macs, "kept in the file");

    // Another record may not take a MAC pc1 has, in any spelling; the error names pc1.
    let e = s
        .add_target(NewTarget {
            macs: vec!["52-54-00-ab-cd-02".into()],
            ..new("pc2", "win", "ram-overflow")
        })
        .unwrap_err();
    assert!(
        matches!(e, StoreError::Refused(_)) && e.to_string().contains("belongs to target pc1"),
        "{e}"
    );
    assert!(s.target("pc2").is_err(), "nothing written");
    let e = s
        .add_target(NewTarget {
            macs: vec!["52:54:00:zz:00:01".into()],
            ..new("pc2", "win", "ram-overflow")
        })
        .unwrap_err();
    assert!(
        matches!(e, StoreError::BadInput(_))
            && e.to_string()
                .contains("\"52:54:00:zz:00:01\" is not a MAC address"),
        "{e}"
    );

    s.add_target(new("pc2", "win", "ram-overflow")).unwrap();
    let e = s
        .set_target(
            "pc2",
            TargetChange {
                add_macs: vec!["52:54:00:AB:CD:01".into()],
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("belongs to target pc1"), "{e}");
    // pc1 gives it up, then pc2 may have it.
    let r1 = s
        .set_target(
            "pc1",
            TargetChange {
                remove_macs: vec!["52-54-00-ab-cd-01".into()],
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(r1.macs, vec!["52:54:00:ab:cd:02"]);
    let e = s
        .set_target(
            "pc1",
            TargetChange {
                remove_macs: vec!["52:54:00:00:00:09".into()],
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(
        e.to_string().contains("has no MAC 52:54:00:00:00:09"),
        "{e}"
    );
    let r2 = s
        .set_target(
            "pc2",
            TargetChange {
                add_macs: vec!["52:54:00:AB:CD:01".into()],
                hostname: Some(Some("lab-02".into())),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(
        (r2.macs.clone(), r2.hostname.as_deref()),
        (vec!["52:54:00:ab:cd:01".to_string()], Some("lab-02"))
    );
    // A record changing its own MACs does not collide with itself.
    s.set_target(
        "pc2",
        TargetChange {
            add_macs: vec!["52:54:00:ab:cd:01".into()],
            ..Default::default()
        },
    )
    .unwrap();

    assert_eq!(
        s.target_by_mac("52-54-00-AB-CD-01").unwrap().unwrap().id,
        "pc2"
    );
    assert_eq!(
        s.target_by_mac("52:54:00:ab:cd:02").unwrap().unwrap().id,
        "pc1"
    );
    assert!(s.target_by_mac("52:54:00:ab:cd:03").unwrap().is_none());
    assert!(s.target_by_mac("nonsense").is_err());

    let e = s
        .set_target(
            "pc2",
            TargetChange {
                hostname: Some(Some("bad_name".into())),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("host name \"bad_name\" is not valid"),
        "{e}"
    );
    let e = s
        .set_target(
            "pc2",
            TargetChange {
                overflow_device: Some(Some("sda2".into())),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("under /dev/"), "{e}");
    let r = s
        .set_target(
            "pc2",
            TargetChange {
                overflow_device: Some(Some("/dev/sda2".into())),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(r.overflow_device.as_deref(), Some("/dev/sda2"));
}

#[test]
fn an_old_record_without_macs_still_loads() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    std::fs::create_dir_all(s.targets_dir()).unwrap();
    std::fs::write(s.targets_dir().join("old.json"), r#"{"format":"vdstream-target","format_version":1,"id":"old","vdisk":"win","version":"production","cache":"device-disk",
        "created":"2026-01-01T00:00:00Z","created_by":"a","updated":"2026-01-01T00:00:00Z","updated_by":"a","generation":3}"#).unwrap();
    let r = s.target("old").unwrap();
    assert!(r.macs.is_empty() && r.generation == 3);
    assert!(s.target_by_mac("52:54:00:00:00:01").unwrap().is_none());
    let r = s
        .set_target(
            "old",
            TargetChange {
                add_macs: vec!["52:54:00:00:00:01".into()],
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(r.macs, vec!["52:54:00:00:00:01"]);
}

#[test]
fn auto_add_copies_the_template_under_the_next_free_id() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    s.add_target(NewTarget {
        ram: Some(256 * MIB),
        overflow_device: Some("/dev/sda2".into()),
        ..new("tmpl", "win", "ram-overflow")
    })
    .unwrap();
    let a = s
        .auto_add_target("52-54-00-00-00-0A", "tmpl", "lab", 2)
        .unwrap();
    assert_eq!(
        (
            a.id.as_str(),
            a.vdisk.as_str(),
            a.cache,
            a.ram,
            a.overflow_device.as_deref()
        ),
        (
            "lab-001",
            "win",
            CacheType::RamOverflow,
            Some(256 * MIB),
            Some("/dev/sda2")
        )
    );
    assert_eq!(a.macs, vec!["52:54:00:00:00:0a"]);
    assert_eq!(
        s.auto_add_target("52:54:00:00:00:0a", "tmpl", "lab", 2)
            .unwrap()
            .id,
        "lab-001",
        "the same MAC: the same record"
    );
    assert_eq!(
        s.auto_add_target("52:54:00:00:00:0b", "tmpl", "lab", 2)
            .unwrap()
            .id,
        "lab-002"
    );
    let e = s
        .auto_add_target("52:54:00:00:00:0c", "tmpl", "lab", 2)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("2 records named lab-NNN exist, the limit"),
        "{e}"
    );
    assert_eq!(
        s.auto_add_target("52:54:00:00:00:0b", "tmpl", "lab", 2)
            .unwrap()
            .id,
        "lab-002",
        "a known MAC still gets its record"
    );
    let e = s
        .auto_add_target("52:54:00:00:00:0c", "nope", "other", 2)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("template nope is not a target record"),
        "{e}"
    );
    let audit = std::fs::read_to_string(s.audit_path()).unwrap();
    assert_eq!(audit.matches("target.auto-add").count(), 2, "{audit}");
}
