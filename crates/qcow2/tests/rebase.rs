//! `set_backing_file` against qemu-img: the new backing shows in `qemu-img info`, the
//! chain reads through it, and refusals leave the header as it was.

mod common;

use std::path::Path;

use common::*;
use vdstream_qcow2::{open_chain, set_backing_file, ImageFormat, OpenOptions, Qcow2Image};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn info(p: &Path) -> serde_json::Value {
    serde_json::from_str(&qemu_img(&["info", "--output=json", s(p)])).unwrap()
}

#[test]
fn repoint_a_version_and_remove_its_backing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (compat, cluster) in [("1.1", "65536"), ("0.10", "65536"), ("1.1", "4096")] {
        let (a, b, v) = (d.join("a.raw"), d.join("b.qcow2"), d.join("v.qcow2"));
        for p in [&a, &b, &v] {
            let _ = std::fs::remove_file(p);
        }
        qemu_img(&["create", "-q", "-f", "raw", s(&a), "2M"]);
        qemu_io(&a, &["write -P 0x61 0 1M"]);
        qemu_img(&["convert", "-O", "qcow2", s(&a), s(&b)]);
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            &format!("compat={compat},cluster_size={cluster}"),
            "-b",
            "a.raw",
            "-F",
            "raw",
            s(&v),
        ]);
        qemu_io(&v, &["write -P 0x62 1M 4k"]);
        let want = qemu_raw(&v);
        set_backing_file(&v, Some(("b.qcow2", ImageFormat::Qcow2))).unwrap();
        let i = info(&v);
        assert_eq!(i["backing-filename"], "b.qcow2", "{i}");
        assert_eq!(i["backing-filename-format"], "qcow2", "{i}");
        assert_clean(&v);
        assert_same(
            &qemu_raw(&v),
            &want,
            "qemu reads the same through the new backing",
        );
        assert_same(
            &read_all(&*open_chain(&v).unwrap(), 1 << 20),
            &want,
            "so do we",
        );
        // Absolute name, then none.
        let abs = d.join("a.raw");
        set_backing_file(&v, Some((s(&abs), ImageFormat::Raw))).unwrap();
        assert_eq!(info(&v)["backing-filename"], s(&abs));
        set_backing_file(&v, None).unwrap();
        let i = info(&v);
        assert!(
            i.get("backing-filename").is_none() && i.get("backing-filename-format").is_none(),
            "{i}"
        );
        assert_clean(&v);
        let own = qemu_raw(&v);
        assert!(own[..1 << 20].iter().all(|&x| x == 0) && own[1 << 20] == 0x62);
    }
}

#[test]
fn refusals_leave_the_header_alone() {
    let dir = tempfile::tempdir().unwrap();
    let v = dir.path().join("v.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=512",
        s(&v),
        "1M",
    ]);
    let before = std::fs::read(&v).unwrap();
    let long = "n".repeat(600);
    let e = set_backing_file(&v, Some((&long, ImageFormat::Raw))).unwrap_err();
    assert!(
        e.to_string().contains("v.qcow2") && e.to_string().contains("first cluster"),
        "{e}"
    );
    assert_eq!(std::fs::read(&v).unwrap(), before);
    // Open in vdstream: refused, unchanged.
    let open = Qcow2Image::open(&v, OpenOptions::default(), None).unwrap();
    let e = set_backing_file(&v, Some(("x.raw", ImageFormat::Raw))).unwrap_err();
    assert!(e.to_string().contains("already open"), "{e}");
    drop(open);
    assert_eq!(std::fs::read(&v).unwrap(), before);
    // Not qcow2.
    let raw = dir.path().join("r.raw");
    std::fs::write(&raw, vec![0u8; 4096]).unwrap();
    let e = set_backing_file(&raw, None).unwrap_err();
    assert!(e.to_string().contains("only qcow2"), "{e}");
}
