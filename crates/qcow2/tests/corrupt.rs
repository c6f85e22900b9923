//! Corrupt and unsupported images give clear errors (file, field, what to do), never a
//! panic or an allocation sized by a bad field.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use vdstream_blockdev::{BlockDev, ErrorKind};
use vdstream_qcow2::{create, open_chain, OpenOptions, Qcow2Image};

fn fresh(dir: &Path, name: &str) -> (PathBuf, Vec<u8>) {
    let p = dir.join(name);
    create(&p, 4 << 20, None, 16).unwrap();
    {
        let dev = Qcow2Image::open(
            &p,
            OpenOptions {
                read_only: false,
                ..Default::default()
            },
            None,
        )
        .unwrap();
        dev.write_at(&[7u8; 100_000], 1000, false).unwrap();
    }
    let bytes = std::fs::read(&p).unwrap();
    (p, bytes)
}

/// Writes `bytes` to a new file and returns the error opening it (read-only).
fn open_err(dir: &Path, name: &str, bytes: &[u8]) -> vdstream_blockdev::Error {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    let e = Qcow2Image::open(&p, OpenOptions::default(), None).unwrap_err();
    let text = e.to_string();
    assert!(text.contains(name), "the error must name the file: {text}");
    e
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

#[test]
fn corrupt_headers_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let (_, good) = fresh(dir.path(), "good.qcow2");
    type Corruption = Box<dyn Fn(&mut Vec<u8>)>;
    let cases: Vec<(&str, Corruption, &str)> = vec![
        (
            "empty.qcow2",
            Box::new(|b: &mut Vec<u8>| b.clear()),
            "truncated",
        ),
        (
            "trunc50.qcow2",
            Box::new(|b: &mut Vec<u8>| b.truncate(50)),
            "truncated",
        ),
        (
            "trunc90.qcow2",
            Box::new(|b: &mut Vec<u8>| b.truncate(90)),
            "header_length",
        ),
        (
            "trunc2c.qcow2",
            Box::new(|b: &mut Vec<u8>| b.truncate(2 << 16)),
            "l1_table_offset",
        ),
        (
            "magic.qcow2",
            Box::new(|b: &mut Vec<u8>| b[0] = b'X'),
            "not a qcow2 file",
        ),
        (
            "version.qcow2",
            Box::new(|b: &mut Vec<u8>| put32(b, 4, 4)),
            "version",
        ),
        (
            "l1huge.qcow2",
            Box::new(|b: &mut Vec<u8>| put32(b, 36, u32::MAX)),
            "32 MiB",
        ),
        (
            "l1small.qcow2",
            Box::new(|b: &mut Vec<u8>| put32(b, 36, 0)),
            "l1_size",
        ),
        (
            "cbits30.qcow2",
            Box::new(|b: &mut Vec<u8>| put32(b, 20, 30)),
            "cluster_bits",
        ),
        (
            "cbits8.qcow2",
            Box::new(|b: &mut Vec<u8>| put32(b, 20, 8)),
            "cluster_bits",
        ),
        (
            "l1eof.qcow2",
            Box::new(|b: &mut Vec<u8>| put64(b, 40, 1 << 40)),
            "past the end of the file",
        ),
        (
            "l1unaligned.qcow2",
            Box::new(|b: &mut Vec<u8>| put64(b, 40, 3 * 65536 + 8)),
            "aligned",
        ),
        (
            "rthuge.qcow2",
            Box::new(|b: &mut Vec<u8>| put32(b, 56, u32::MAX)),
            "refcount_table_clusters",
        ),
        (
            "crypt.qcow2",
            Box::new(|b: &mut Vec<u8>| put32(b, 32, 1)),
            "encrypted",
        ),
        (
            "extl2.qcow2",
            Box::new(|b: &mut Vec<u8>| b[79] |= 1 << 4),
            "extended L2",
        ),
        (
            "extdata.qcow2",
            Box::new(|b: &mut Vec<u8>| b[79] |= 1 << 2),
            "external data file",
        ),
        (
            "unknown.qcow2",
            Box::new(|b: &mut Vec<u8>| b[79] |= 1 << 6),
            "bit 6",
        ),
        (
            "zstd.qcow2",
            Box::new(|b: &mut Vec<u8>| {
                b[79] |= 1 << 3;
                b[104] = 1;
            }),
            "zstd",
        ),
        (
            "backname.qcow2",
            Box::new(|b: &mut Vec<u8>| {
                put64(b, 8, 65530);
                put32(b, 16, 100);
            }),
            "backing_file_offset",
        ),
        (
            "hdrlen.qcow2",
            Box::new(|b: &mut Vec<u8>| put32(b, 100, 1 << 20)),
            "header_length",
        ),
        (
            "ext.qcow2",
            Box::new(|b: &mut Vec<u8>| {
                put32(b, 112, 0x1234);
                put32(b, 116, 1 << 20);
            }),
            "extension",
        ),
    ];
    for (name, corrupt, expect) in cases {
        let mut b = good.clone();
        corrupt(&mut b);
        let e = open_err(dir.path(), name, &b);
        assert!(
            e.to_string().contains(expect),
            "{name}: expected {expect:?} in: {e}"
        );
        assert_eq!(
            e.kind == ErrorKind::NotSupported,
            ["crypt", "extl2", "extdata", "unknown", "zstd", "version"]
                .iter()
                .any(|p| name.starts_with(p)),
            "{name}: {e}"
        );
    }
}

#[test]
fn unsupported_images_made_by_qemu() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("sub.qcow2");
    qemu_img(&[
        "create",
        "-f",
        "qcow2",
        "-o",
        "extended_l2=on",
        p.to_str().unwrap(),
        "1M",
    ]);
    let e = open_chain(&p).unwrap_err();
    assert!(
        e.to_string().contains("extended L2") && e.to_string().contains("sub.qcow2"),
        "{e}"
    );
    let p = dir.path().join("snap.qcow2");
    qemu_img(&["create", "-f", "qcow2", p.to_str().unwrap(), "1M"]);
    qemu_img(&["snapshot", "-c", "s1", p.to_str().unwrap()]);
    let e = Qcow2Image::open(
        &p,
        OpenOptions {
            read_only: false,
            ..Default::default()
        },
        None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("snapshot"), "{e}");
    assert!(
        open_chain(&p).is_ok(),
        "read-only open of an image with snapshots works"
    );
}

#[test]
fn bad_tables_fail_reads_not_panic() {
    let dir = tempfile::tempdir().unwrap();
    let (p, mut b) = fresh(dir.path(), "l2.qcow2");
    // L1[0] points past the end of the file, then at an unaligned offset.
    for bad in [1u64 << 40, 3 * 65536 + 512] {
        put64(&mut b, 3 * 65536, bad | (1 << 63));
        std::fs::write(&p, &b).unwrap();
        let dev = open_chain(&p).unwrap();
        let mut buf = vec![0u8; 4096];
        let e = dev.read_at(&mut buf, 0).unwrap_err();
        assert!(
            e.to_string().contains("qemu-img check") && e.to_string().contains("l2.qcow2"),
            "{e}"
        );
        assert!(dev.block_status(0, 4096, &mut Vec::new()).is_err());
    }
    // A backing file that does not exist.
    let q = dir.path().join("orphan.qcow2");
    create(
        &q,
        1 << 20,
        Some(("missing.raw", vdstream_qcow2::ImageFormat::Raw)),
        16,
    )
    .unwrap();
    let e = open_chain(&q).unwrap_err();
    assert!(
        e.to_string().contains("missing.raw") && e.to_string().contains("does not exist"),
        "{e}"
    );
}
