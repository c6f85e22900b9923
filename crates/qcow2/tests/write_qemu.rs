//! Images written by us pass `qemu-img check` (no errors, no leaks), `qemu-img compare`
//! says they hold what a raw file given the same writes holds, and `qemu-img info
//! --backing-chain` reads them.

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;

use common::*;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use vdstream_blockdev::{BlockDev, ZeroFlags};
use vdstream_qcow2::{create, ImageFormat, OpenOptions, Qcow2Image};

const MIB: u64 = 1 << 20;

/// A small L2 cache, to exercise eviction: `units` of 512 bytes (never under two tables).
fn rw(units: u64) -> OpenOptions {
    OpenOptions {
        read_only: false,
        l2_cache_bytes: units * 512,
    }
}

#[derive(Debug, Clone)]
enum Op {
    Write { offset: u64, len: u64, seed: u64 },
    Zero { offset: u64, len: u64 },
    Trim { offset: u64, len: u64 },
    Flush,
}

fn ops(size: u64) -> impl Strategy<Value = Vec<Op>> {
    let range = (0..size).prop_flat_map(move |o| (Just(o), 1..=(size - o).min(700_000)));
    let op = prop_oneof![
        5 => (range.clone(), any::<u64>()).prop_map(|((offset, len), seed)| Op::Write { offset, len, seed }),
        2 => range.clone().prop_map(|(offset, len)| Op::Zero { offset, len }),
        2 => range.prop_map(|(offset, len)| Op::Trim { offset, len }),
        1 => Just(Op::Flush),
    ];
    prop::collection::vec(op, 1..30)
}

/// Applies `ops` to `dev` and to a raw file (via plain file writes).
fn apply(dev: &dyn BlockDev, raw: &std::fs::File, ops: &[Op]) {
    for op in ops {
        match *op {
            Op::Write { offset, len, seed } => {
                let data = pattern(seed, offset, len as usize);
                dev.write_at(&data, offset, seed % 7 == 0).unwrap();
                raw.write_all_at(&data, offset).unwrap();
            }
            Op::Zero { offset, len } => {
                dev.write_zeroes(
                    offset,
                    len,
                    ZeroFlags {
                        may_trim: len % 2 == 0,
                        ..Default::default()
                    },
                )
                .unwrap();
                raw.write_all_at(&vec![0; len as usize], offset).unwrap();
            }
            Op::Trim { offset, len } => {
                dev.trim(offset, len, false).unwrap();
                raw.write_all_at(&vec![0; len as usize], offset).unwrap();
            }
            Op::Flush => dev.flush().unwrap(),
        }
    }
}

fn compare(image: &Path, raw: &Path) {
    run(
        "qemu-img",
        &[
            "compare",
            "-f",
            "qcow2",
            "-F",
            "raw",
            image.to_str().unwrap(),
            raw.to_str().unwrap(),
        ],
    );
}

/// Random writes, zeroes and trims on a fresh image (cluster sizes 512 B, 4 KiB, 64 KiB;
/// tiny L2 caches so dirty tables get evicted), with and without a raw backing file.
#[test]
fn random_writes_pass_check_and_compare() {
    let dir = tempfile::tempdir().unwrap();
    let size = 5 * MIB + 4096 * 3 + 512;
    let counter = std::sync::atomic::AtomicU64::new(0);
    let mut runner = TestRunner::new(Config {
        cases: 16,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(
            &(
                ops(size),
                prop::sample::select(vec![9u32, 12, 16]),
                any::<bool>(),
            ),
            |(ops, bits, with_base)| {
                let n = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                let img = dir.path().join(format!("w{n}.qcow2"));
                let raw = dir.path().join(format!("w{n}.raw"));
                let base_bytes = if with_base {
                    pattern(n, 0, size as usize)
                } else {
                    vec![0; size as usize]
                };
                std::fs::write(&raw, &base_bytes).unwrap();
                if with_base {
                    let base = format!("b{n}.raw");
                    std::fs::write(dir.path().join(&base), &base_bytes).unwrap();
                    create(&img, size, Some((&base, ImageFormat::Raw)), bits).unwrap();
                } else {
                    create(&img, size, None, bits).unwrap();
                }
                {
                    let dev = Qcow2Image::open_with_backing_chain(&img, rw(2)).unwrap();
                    let rawf = std::fs::OpenOptions::new().write(true).open(&raw).unwrap();
                    apply(&dev, &rawf, &ops);
                    assert_same(
                        &read_all(&dev, 777_777),
                        &std::fs::read(&raw).unwrap(),
                        "our read-back",
                    );
                }
                assert_clean(&img);
                compare(&img, &raw);
                Ok(())
            },
        )
        .unwrap();
}

/// 512-byte clusters: 8 MiB of data overflows the first refcount table (64 blocks of 256
/// clusters), so the table grows and moves.
#[test]
fn refcount_table_grows() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("grow.qcow2");
    let raw = dir.path().join("grow.raw");
    let size = 12 * MIB;
    create(&img, size, None, 9).unwrap();
    let data = pattern(3, 0, size as usize);
    {
        let dev = Qcow2Image::open(&img, rw(8), None).unwrap();
        for (i, chunk) in data.chunks(300_001).enumerate() {
            dev.write_at(chunk, i as u64 * 300_001, false).unwrap();
        }
        dev.flush().unwrap();
        dev.trim(MIB, 3 * MIB, false).unwrap();
    }
    let mut want = data.clone();
    want[MIB as usize..(4 * MIB) as usize].fill(0);
    std::fs::write(&raw, &want).unwrap();
    assert_clean(&img);
    compare(&img, &raw);
    let info = qemu_img(&["info", "--output=json", img.to_str().unwrap()]);
    assert!(info.contains("\"cluster-size\": 512"), "{info}");
    let bytes = std::fs::read(&img).unwrap();
    let h = vdstream_qcow2::Header::parse(&bytes, bytes.len() as u64).unwrap();
    assert!(
        h.refcount_table_clusters > 1 && h.refcount_table_offset != 512,
        "the refcount table did not grow: {h:?}"
    );
}

/// Partial-cluster writes over a qcow2 backing chain made by qemu (compressed and zero
/// clusters below), then qemu-img check/compare/info on our top layer.
#[test]
fn overlay_on_qemu_chain() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.raw");
    std::fs::write(&base, pattern(9, 0, (6 * MIB) as usize)).unwrap();
    let mid = dir.path().join("mid.qcow2");
    qemu_img(&[
        "create",
        "-f",
        "qcow2",
        "-b",
        "base.raw",
        "-F",
        "raw",
        mid.to_str().unwrap(),
    ]);
    qemu_io(
        &mid,
        &[
            "write -P 0x41 0 1M",
            "write -z 2M 1M",
            "write -c -P 0x42 4M 64k",
        ],
    );
    let top = dir.path().join("top.qcow2");
    create(&top, 6 * MIB, Some(("mid.qcow2", ImageFormat::Qcow2)), 16).unwrap();
    let writes: &[(u64, usize, u64)] = &[
        (100, 10, 1),
        (65_530, 20, 2),
        (2 * MIB + 7, 70_000, 3),
        (4 * MIB + 1, 5, 4),
        (6 * MIB - 3, 3, 5),
    ];
    {
        let dev = Qcow2Image::open_with_backing_chain(&top, rw(16)).unwrap();
        for &(off, len, seed) in writes {
            dev.write_at(&pattern(seed, off, len), off, false).unwrap();
        }
        dev.write_zeroes(MIB, 128 * 1024, ZeroFlags::default())
            .unwrap();
        dev.trim(5 * MIB, 100_000, false).unwrap();
    }
    let mut want = qemu_raw(&mid);
    for &(off, len, seed) in writes {
        want[off as usize..off as usize + len].copy_from_slice(&pattern(seed, off, len));
    }
    want[MIB as usize..(MIB + 128 * 1024) as usize].fill(0);
    want[(5 * MIB) as usize..(5 * MIB + 100_000) as usize].fill(0);
    let raw = dir.path().join("want.raw");
    std::fs::write(&raw, &want).unwrap();
    assert_clean(&top);
    compare(&top, &raw);
    let info = qemu_img(&["info", "--backing-chain", top.to_str().unwrap()]);
    assert!(
        info.contains("mid.qcow2")
            && info.contains("base.raw")
            && info.contains("backing file format: qcow2"),
        "{info}"
    );
}

/// Writing over clusters qemu compressed and zero-preallocated frees them exactly.
#[test]
fn rewrite_qemu_compressed_and_zero_clusters() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.qcow2");
    qemu_img(&["create", "-f", "qcow2", src.to_str().unwrap(), "3M"]);
    qemu_io(&src, &["write -P 0x51 0 2M", "write -P 0x52 2M 1M"]);
    let img = dir.path().join("c.qcow2");
    qemu_img(&[
        "convert",
        "-c",
        "-O",
        "qcow2",
        src.to_str().unwrap(),
        img.to_str().unwrap(),
    ]);
    // A preallocated zero cluster: zeroing an allocated cluster without unmap keeps it.
    qemu_io(&img, &["write -P 0x53 2M 64k", "write -z 2M 64k"]);
    let mut want = qemu_raw(&img);
    {
        let dev = Qcow2Image::open(&img, rw(4), None).unwrap();
        for (off, len) in [
            (10u64, 100usize),
            (70_000, 200_000),
            (2 * MIB + 5, 10),
            (3 * MIB - 1, 1),
        ] {
            let d = pattern(off, off, len);
            dev.write_at(&d, off, false).unwrap();
            want[off as usize..off as usize + len].copy_from_slice(&d);
        }
        dev.trim(MIB, MIB, false).unwrap();
        want[MIB as usize..(2 * MIB) as usize].fill(0);
    }
    let raw = dir.path().join("c.raw");
    std::fs::write(&raw, &want).unwrap();
    assert_clean(&img);
    compare(&img, &raw);
}

/// A version 2 image (no zero flag): zeroing over a backing file writes zeros, and qemu
/// agrees with what we wrote.
#[test]
fn writes_to_v2_image_over_backing() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.raw");
    let base_bytes = pattern(4, 0, (3 * MIB) as usize);
    std::fs::write(&base, &base_bytes).unwrap();
    let img = dir.path().join("v2.qcow2");
    qemu_img(&[
        "create",
        "-f",
        "qcow2",
        "-o",
        "compat=0.10,cluster_size=4096",
        "-b",
        "base.raw",
        "-F",
        "raw",
        img.to_str().unwrap(),
    ]);
    let mut want = base_bytes.clone();
    {
        let dev = Qcow2Image::open_with_backing_chain(&img, rw(2)).unwrap();
        dev.write_at(&pattern(5, 5000, 10_000), 5000, false)
            .unwrap();
        want[5000..15_000].copy_from_slice(&pattern(5, 5000, 10_000));
        dev.write_zeroes(MIB, 200_000, ZeroFlags::default())
            .unwrap();
        dev.trim(2 * MIB - 1, 3, false).unwrap();
        want[MIB as usize..(MIB + 200_000) as usize].fill(0);
        want[(2 * MIB - 1) as usize..(2 * MIB + 2) as usize].fill(0);
        assert_same(&read_all(&dev, 1 << 20), &want, "v2 read-back");
    }
    let raw = dir.path().join("v2.raw");
    std::fs::write(&raw, &want).unwrap();
    assert_clean(&img);
    compare(&img, &raw);
}

/// Block status of an image we wrote (zero flags over a backing file, trims without one)
/// matches `qemu-img map` on the same file.
#[test]
fn our_block_status_matches_qemu_map_on_our_images() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.raw");
    std::fs::write(&base, pattern(6, 0, (4 * MIB) as usize)).unwrap();
    for (name, backing) in [
        ("over.qcow2", Some(("base.raw", ImageFormat::Raw))),
        ("alone.qcow2", None),
    ] {
        let img = dir.path().join(name);
        create(&img, 4 * MIB, backing, 16).unwrap();
        {
            let dev = Qcow2Image::open_with_backing_chain(&img, rw(4)).unwrap();
            dev.write_at(&pattern(7, 0, 300_000), 100, false).unwrap();
            dev.write_zeroes(MIB, MIB, ZeroFlags::default()).unwrap();
            dev.trim(64 * 1024, 128 * 1024, false).unwrap();
            dev.write_at(&[0u8; 70_000], 3 * MIB, false).unwrap();
        }
        assert_clean(&img);
        let dev = vdstream_qcow2::open_chain(&img).unwrap();
        let (ours, theirs) = (our_zero_map(&*dev), qemu_zero_map(&img, dev.size()));
        if let Some(i) = ours.iter().zip(&theirs).position(|(a, b)| a != b) {
            panic!("{name}: block status differs from qemu-img map at byte {i}: ours zero={}, qemu zero={}", ours[i], theirs[i]);
        }
    }
}
