//! `merge_layers` against qemu: chains built with qemu-img/qemu-io (data, zero writes,
//! discards, compressed clusters, raw and qcow2 bases, mixed cluster sizes) are merged at
//! every level and flattened; `qemu-img compare` must find the result equal to the top,
//! `qemu-img check` clean, the backing as asked, and no cluster written that is not needed.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use proptest::prelude::*;
use vdstream_qcow2::{merge_layers, MergeOptions, MergeReport};

const MIB: u64 = 1 << 20;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `qemu-io -f FORMAT -c CMD...`.
fn io(image: &Path, format: &str, cmds: &[String]) {
    let mut args: Vec<&str> = vec!["-f", format];
    for c in cmds {
        args.push("-c");
        args.push(c);
    }
    args.push(s(image));
    run("qemu-io", &args);
}

/// Creates a qcow2 layer named `name` over `backing` (same directory, relative name).
fn overlay(dir: &Path, name: &str, backing: &Path, backing_fmt: &str, cluster: u64) -> PathBuf {
    let p = dir.join(name);
    let b = backing.file_name().unwrap().to_str().unwrap();
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        &format!("cluster_size={cluster}"),
        "-b",
        b,
        "-F",
        backing_fmt,
        s(&p),
    ]);
    p
}

/// Layer paths of a chain, top first (from `qemu-img info --backing-chain`).
fn chain_of(top: &Path) -> Vec<PathBuf> {
    let v: serde_json::Value = serde_json::from_str(&qemu_img(&[
        "info",
        "--backing-chain",
        "--output=json",
        s(top),
    ]))
    .unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| PathBuf::from(e["filename"].as_str().unwrap()))
        .collect()
}

/// The chain of `top` as vdstream opens a file it is given (bottom first).
fn chain_specs(top: &Path) -> Vec<vdstream_qcow2::LayerSpec> {
    vdstream_qcow2::chain_of(top).unwrap()
}

/// Guest ranges (start, len) that `image` itself holds as data (qemu-img map, depth 0).
fn own_data(image: &Path) -> Vec<(u64, u64)> {
    let v: serde_json::Value =
        serde_json::from_str(&qemu_img(&["map", "--output=json", s(image)])).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .filter(|e| e["depth"].as_u64() == Some(0) && e["data"].as_bool() == Some(true))
        .map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
        .collect()
}

/// Guest ranges the layers above depth `upper` hold, as data or zero clusters (qemu-img map
/// of the top).
fn upper_held(top: &Path, upper: u64) -> Vec<(u64, u64)> {
    let v: serde_json::Value =
        serde_json::from_str(&qemu_img(&["map", "--output=json", s(top)])).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .filter(|e| e["depth"].as_u64().unwrap() < upper && e["present"].as_bool() == Some(true))
        .map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
        .collect()
}

fn cluster_bits_of(image: &Path) -> u32 {
    let v: serde_json::Value =
        serde_json::from_str(&qemu_img(&["info", "--output=json", s(image)])).unwrap();
    v["cluster-size"].as_u64().unwrap().trailing_zeros()
}

/// Merges `top` down to `stop` (an index into its chain; `None` flattens) and checks the
/// result against qemu. Returns the report.
fn merge_and_check(top: &Path, stop: Option<usize>, opts: &MergeOptions, tag: &str) -> MergeReport {
    let chain = chain_of(top);
    let dst = top.with_file_name(format!("merged-{tag}.qcow2"));
    let _ = std::fs::remove_file(&dst);
    let stop_path = stop.map(|i| chain[i].clone());
    let mut calls = 0u64;
    let mut last = (0, 0);
    let report = merge_layers(
        &chain_specs(top),
        stop_path.as_deref(),
        &dst,
        opts,
        &mut |d, t| {
            assert!(
                d >= last.0 && d <= t,
                "progress went backwards or past the total: {d}/{t} after {last:?}"
            );
            last = (d, t);
            calls += 1;
        },
    )
    .unwrap_or_else(|e| panic!("merge {tag}: {e}"));
    let depth = chain.len();
    assert!(
        calls >= 2 && last.0 == last.1,
        "{tag}: progress ended at {last:?} after {calls} calls"
    );
    // Same guest content, clean metadata.
    qemu_img(&["compare", "-q", s(top), s(&dst)]);
    assert_clean(&dst);
    // Backing as asked: the stop layer's file name (same directory) and format.
    let v: serde_json::Value = serde_json::from_str(&qemu_img(&[
        "info",
        "--backing-chain",
        "--output=json",
        s(&dst),
    ]))
    .unwrap();
    let infos = v.as_array().unwrap();
    match &stop_path {
        None => {
            assert_eq!(
                infos.len(),
                1,
                "{tag}: flattened image has a backing chain: {v}"
            );
            assert!(infos[0].get("backing-filename").is_none());
        }
        Some(p) => {
            assert_eq!(
                infos[0]["backing-filename"].as_str(),
                Some(p.file_name().unwrap().to_str().unwrap()),
                "{tag}: {v}"
            );
            let fmt = if ImageKind::of(p) == ImageKind::Raw {
                "raw"
            } else {
                "qcow2"
            };
            assert_eq!(
                infos[0]["backing-filename-format"].as_str(),
                Some(fmt),
                "{tag}"
            );
            assert_eq!(
                infos.len(),
                depth - stop.unwrap() + 1,
                "{tag}: chain below dst"
            );
        }
    }
    assert_eq!(
        infos[0]["format-specific"]["data"]["compat"].as_str(),
        Some("1.1"),
        "{tag}: dst is qcow2 v3"
    );
    // Nothing written that is not needed: every data cluster of dst overlaps something an
    // upper layer holds (data, or zeros over data below when dst clusters are larger), and
    // it is not all zeros.
    let dst_bits = cluster_bits_of(&dst);
    let cs = 1u64 << dst_bits;
    let upper = upper_held(top, stop.unwrap_or(depth) as u64);
    let raw = qemu_raw(top);
    let mut dst_clusters = 0;
    for (start, len) in own_data(&dst) {
        let mut c = start / cs;
        while c * cs < start + len {
            dst_clusters += 1;
            let (a, b) = (c * cs, ((c + 1) * cs).min(raw.len() as u64));
            assert!(
                upper.iter().any(|&(us, ul)| us < b && a < us + ul),
                "{tag}: dst cluster at {a} is not held by any upper layer"
            );
            assert!(
                raw[a as usize..b as usize].iter().any(|&x| x != 0),
                "{tag}: dst cluster at {a} is all zeros yet written as data"
            );
            c += 1;
        }
    }
    assert_eq!(
        dst_clusters, report.clusters_written,
        "{tag}: report vs qemu-img map"
    );
    // The file holds the data plus a bounded amount of metadata.
    let file_len = std::fs::metadata(&dst).unwrap().len();
    let l2_tables = (raw.len() as u64).div_ceil(cs * (cs / 8));
    let meta = (4 + l2_tables + (raw.len() as u64 / cs * 8).div_ceil(cs) + 2) * cs;
    assert!(
        file_len <= report.bytes_written + meta,
        "{tag}: dst is {file_len} bytes for {} of data",
        report.bytes_written
    );
    std::fs::remove_file(&dst).unwrap();
    report
}

#[derive(Debug, PartialEq)]
enum ImageKind {
    Raw,
    Qcow2,
}

impl ImageKind {
    fn of(p: &Path) -> Self {
        let v: serde_json::Value =
            serde_json::from_str(&qemu_img(&["info", "--output=json", s(p)])).unwrap();
        if v["format"] == "raw" {
            ImageKind::Raw
        } else {
            ImageKind::Qcow2
        }
    }
}

/// Merges at every level of `top`'s chain and flattens.
fn merge_every_level(top: &Path, opts: &MergeOptions, tag: &str) {
    let n = chain_of(top).len();
    for stop in 1..n {
        merge_and_check(top, Some(stop), opts, &format!("{tag}-stop{stop}"));
    }
    merge_and_check(top, None, opts, &format!("{tag}-flat"));
}

#[test]
fn five_layers_over_a_qcow2_base_at_every_level() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "24M"]);
    io(
        &base,
        "qcow2",
        &[
            "write -P 0x11 0 8M".into(),
            "write -P 0x12 12M 4M".into(),
            "write -P 0 20M 1M".into(),
        ],
    );
    let mut top = base.clone();
    for i in 1..=5u64 {
        top = overlay(dir.path(), &format!("v{i}.qcow2"), &top, "qcow2", 65536);
        let at = |k: u64| (i * 977 + k * 3001) % 23 * MIB;
        io(
            &top,
            "qcow2",
            &[
                format!("write -P {} {} 192k", 0x20 + i, at(0)),
                format!("write -P {} {} 5000", 0x30 + i, at(1) + 12345),
                format!("write -z {} 128k", at(2)),
                format!("discard {} 64k", at(3)),
                format!("write -P 0 {} 64k", at(4)),
            ],
        );
    }
    merge_every_level(&top, &MergeOptions::default(), "q5");
    merge_and_check(
        &top,
        Some(2),
        &MergeOptions {
            cluster_bits: Some(12),
        },
        "q5-4k",
    );
}

#[test]
fn raw_base_and_mixed_cluster_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.raw");
    qemu_img(&["create", "-q", "-f", "raw", s(&base), "16M"]);
    io(
        &base,
        "raw",
        &[
            "write -P 0x41 0 3M".into(),
            "write -P 0x42 9M 2M".into(),
            "write -P 0x43 15M 1M".into(),
        ],
    );
    let l1 = overlay(dir.path(), "l1.qcow2", &base, "raw", 4096);
    io(
        &l1,
        "qcow2",
        &[
            "write -P 0x51 4k 8k".into(),
            "write -z 64k 1M".into(),
            "write -P 0x52 10M 100k".into(),
        ],
    );
    let l2 = overlay(dir.path(), "l2.qcow2", &l1, "qcow2", 2 << 20);
    io(
        &l2,
        "qcow2",
        &["write -P 0x61 2M 4k".into(), "write -z 14M 2M".into()],
    );
    let l3 = overlay(dir.path(), "l3.qcow2", &l2, "qcow2", 512);
    io(
        &l3,
        "qcow2",
        &[
            "write -P 0x71 100 1000".into(),
            "write -z 9M 8k".into(),
            "write -P 0x72 15M 512".into(),
        ],
    );
    merge_every_level(&l3, &MergeOptions::default(), "raw");
    for bits in [9, 12, 16, 21] {
        merge_every_level(
            &l3,
            &MergeOptions {
                cluster_bits: Some(bits),
            },
            &format!("raw-c{bits}"),
        );
    }
}

#[test]
fn compressed_base_and_compressed_layer() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&src), "8M"]);
    io(
        &src,
        "qcow2",
        &["write -P 0x81 0 2M".into(), "write -P 0x82 5M 1M".into()],
    );
    let base = dir.path().join("base.qcow2");
    qemu_img(&["convert", "-c", "-O", "qcow2", s(&src), s(&base)]);
    let l1 = overlay(dir.path(), "l1.qcow2", &base, "qcow2", 65536);
    io(
        &l1,
        "qcow2",
        &[
            "write -c -P 0x91 1M 256k".into(),
            "write -z 5M 64k".into(),
            "write -c -P 0 6M 64k".into(),
        ],
    );
    let l2 = overlay(dir.path(), "l2.qcow2", &l1, "qcow2", 65536);
    io(&l2, "qcow2", &["write -P 0x92 1088k 4k".into()]);
    merge_every_level(&l2, &MergeOptions::default(), "comp");
}

#[test]
fn a_zero_over_data_stays_zero_and_compaction_drops_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "4M"]);
    io(&base, "qcow2", &["write -P 0xaa 0 4M".into()]);
    let v1 = overlay(dir.path(), "v1.qcow2", &base, "qcow2", 65536);
    // Zeros over data as a zero cluster, as written zeros, and data.
    io(
        &v1,
        "qcow2",
        &[
            "write -z 0 128k".into(),
            "write -P 0 1M 192k".into(),
            "write -P 0xbb 2M 64k".into(),
        ],
    );
    let r = merge_and_check(&v1, Some(1), &MergeOptions::default(), "compact");
    assert_eq!(r.clusters_written, 1, "{r:?}");
    assert_eq!(
        r.zero_clusters,
        2 + 3,
        "zero clusters over base data: {r:?}"
    );
    assert_eq!(r.zero_data_dropped, 3, "{r:?}");
    // A second layer over zeros of the first: zeros over zeros need nothing.
    let v2 = overlay(dir.path(), "v2.qcow2", &v1, "qcow2", 65536);
    io(
        &v2,
        "qcow2",
        &["write -z 0 64k".into(), "write -P 0 1M 64k".into()],
    );
    let r = merge_and_check(&v2, Some(1), &MergeOptions::default(), "z-over-z");
    // The zero cluster needs nothing (v1 reports zeros there); the written zeros at 1M lie
    // over a v1 data cluster of zeros, which block status cannot tell from data.
    assert_eq!((r.clusters_written, r.zero_clusters), (0, 1), "{r:?}");
    // Flattened: zeros are simply not there.
    let r = merge_and_check(&v1, None, &MergeOptions::default(), "compact-flat");
    assert_eq!(r.zero_clusters, 0, "{r:?}");
    assert_eq!(r.clusters_written, 64 - 2 - 3, "{r:?}");
}

#[test]
fn version_2_layers() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "compat=0.10",
        s(&base),
        "8M",
    ]);
    io(&base, "qcow2", &["write -P 0x11 0 6M".into()]);
    let v1 = dir.path().join("v1.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "compat=0.10,cluster_size=4096",
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        s(&v1),
    ]);
    // Version 2 has no zero clusters: qemu writes the zeros as data.
    io(
        &v1,
        "qcow2",
        &[
            "write -z 1M 64k".into(),
            "write -P 0x22 3M 10k".into(),
            "write -c -P 0x23 7M 4k".into(),
        ],
    );
    let r = merge_and_check(&v1, Some(1), &MergeOptions::default(), "v2");
    assert_eq!(r.zero_clusters, 16, "zeros over base data: {r:?}");
    merge_and_check(&v1, None, &MergeOptions::default(), "v2-flat");
}

#[test]
fn odd_sizes_and_a_smaller_base() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "3000000"]);
    io(&base, "qcow2", &["write -P 0x11 0 2999808".into()]);
    let v1 = dir.path().join("v1.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        s(&v1),
        "5000000",
    ]);
    io(
        &v1,
        "qcow2",
        &[
            "write -P 0x22 4999680 320".into(),
            "write -z 65536 65536".into(),
        ],
    );
    merge_every_level(&v1, &MergeOptions::default(), "odd");
}

#[test]
fn refusals_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "1M"]);
    let v1 = overlay(dir.path(), "v1.qcow2", &base, "qcow2", 65536);
    let other = dir.path().join("other.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&other), "1M"]);
    let dst = dir.path().join("dst.qcow2");
    let e = merge_layers(
        &chain_specs(&v1),
        Some(&other),
        &dst,
        &MergeOptions::default(),
        &mut |_, _| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("not in its backing chain"), "{e}");
    let e = merge_layers(
        &chain_specs(&v1),
        Some(&v1),
        &dst,
        &MergeOptions::default(),
        &mut |_, _| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("nothing to merge"), "{e}");
    let e = merge_layers(
        &chain_specs(&v1),
        None,
        &dst,
        &MergeOptions {
            cluster_bits: Some(22),
        },
        &mut |_, _| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("cluster_bits"), "{e}");
    assert!(!dst.exists());
    std::fs::write(&dst, b"x").unwrap();
    let e = merge_layers(
        &chain_specs(&v1),
        None,
        &dst,
        &MergeOptions::default(),
        &mut |_, _| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("dst.qcow2"), "{e}");
    assert_eq!(
        std::fs::read(&dst).unwrap(),
        b"x",
        "an existing dst is left alone"
    );
}

#[test]
fn dst_in_another_folder_names_its_backing_by_absolute_path() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "4M"]);
    io(&base, "qcow2", &["write -P 0x11 0 4M".into()]);
    let v1 = overlay(dir.path(), "v1.qcow2", &base, "qcow2", 65536);
    io(&v1, "qcow2", &["write -P 0x22 1M 64k".into()]);
    std::fs::create_dir(dir.path().join("elsewhere")).unwrap();
    let dst = dir.path().join("elsewhere/merged.qcow2");
    merge_layers(
        &chain_specs(&v1),
        Some(&base),
        &dst,
        &MergeOptions::default(),
        &mut |_, _| {},
    )
    .unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&qemu_img(&["info", "--output=json", s(&dst)])).unwrap();
    assert_eq!(v["backing-filename"].as_str(), Some(s(&base)), "{v}");
    qemu_img(&["compare", "-q", s(&v1), s(&dst)]);
}

#[test]
fn a_read_error_mid_merge_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "64M"]);
    let v1 = overlay(dir.path(), "v1.qcow2", &base, "qcow2", 65536);
    io(
        &v1,
        "qcow2",
        &["write -P 0x11 0 40M".into(), "write -P 0x12 60M 64k".into()],
    );
    // Cut off the last data cluster (at guest 60M): the metadata still points at it.
    let len = std::fs::metadata(&v1).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&v1)
        .unwrap()
        .set_len(len - 65536)
        .unwrap();
    let dst = dir.path().join("dst.qcow2");
    let mut last = 0;
    let e = merge_layers(
        &chain_specs(&v1),
        Some(&base),
        &dst,
        &MergeOptions::default(),
        &mut |d, _| last = d,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("v1.qcow2") && e.to_string().contains("qemu-img check"),
        "{e}"
    );
    assert!(
        last >= 40 << 20,
        "chunks before the bad one were written ({last})"
    );
    assert!(!dst.exists(), "a failed merge leaves no dst behind");
}

/// One random operation on a layer.
#[derive(Debug, Clone)]
enum Write {
    Data { at: u64, len: u64, pat: u8 },
    Zero { at: u64, len: u64 },
    Discard { at: u64, len: u64 },
    Compressed { cluster: u64, pat: u8 },
}

const RSIZE: u64 = 4 * MIB;

fn write_strategy() -> impl Strategy<Value = Write> {
    let range =
        (0..RSIZE / 512, 1..1024u64).prop_map(|(a, l)| (a * 512, (l * 512).min(RSIZE - a * 512)));
    prop_oneof![
        4 => (range.clone(), any::<u8>()).prop_map(|((at, len), pat)| Write::Data { at, len, pat }),
        2 => range.clone().prop_map(|(at, len)| Write::Zero { at, len }),
        1 => range.prop_map(|(at, len)| Write::Discard { at, len }),
        1 => (0..RSIZE / 65536, any::<u8>()).prop_map(|(cluster, pat)| Write::Compressed { cluster, pat }),
    ]
}

/// Applies `ops` to a fresh layer; compressed writes go first, once per cluster (qemu
/// compresses only into unallocated clusters).
fn apply(image: &Path, format: &str, ops: &[Write]) {
    let mut ops = ops.to_vec();
    ops.sort_by_key(|w| !matches!(w, Write::Compressed { .. }));
    let mut seen = std::collections::BTreeSet::new();
    ops.retain(|w| match w {
        Write::Compressed { cluster, .. } => seen.insert(*cluster),
        _ => true,
    });
    let cmds: Vec<String> = ops
        .iter()
        .map(|w| match *w {
            Write::Data { at, len, pat } => format!("write -P {pat} {at} {len}"),
            Write::Zero { at, len } => format!("write -z {at} {len}"),
            Write::Discard { at, len } => format!("discard {at} {len}"),
            Write::Compressed { cluster, pat } => {
                format!("write -c -P {pat} {} 65536", cluster * 65536)
            }
        })
        .filter(|c| format == "qcow2" || !c.starts_with("write -c"))
        .collect();
    if !cmds.is_empty() {
        io(image, format, &cmds);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_chains_match_qemu(
        raw_base in any::<bool>(),
        layers in prop::collection::vec(prop::collection::vec(write_strategy(), 0..6), 1..5),
        cluster_bits in prop::sample::select(vec![12u32, 16, 21]),
        stop_pick in any::<prop::sample::Index>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let (base, fmt) = if raw_base { (dir.path().join("base.raw"), "raw") } else { (dir.path().join("base.qcow2"), "qcow2") };
        qemu_img(&["create", "-q", "-f", fmt, s(&base), &RSIZE.to_string()]);
        apply(&base, fmt, &[Write::Data { at: 0, len: RSIZE / 2, pat: 0x5a }, Write::Data { at: 3 * MIB, len: 4096, pat: 0 }]);
        let mut top = base.clone();
        let mut top_fmt = fmt;
        for (i, ops) in layers.iter().enumerate() {
            top = overlay(dir.path(), &format!("v{i}.qcow2"), &top, top_fmt, 65536);
            top_fmt = "qcow2";
            apply(&top, "qcow2", ops);
        }
        let want = qemu_raw(&top);
        let n = layers.len() + 1;
        let stop = stop_pick.index(n); // 0 means flatten
        let chain = chain_of(&top);
        let stop_path = (stop > 0).then(|| chain[stop].clone());
        let dst = dir.path().join("dst.qcow2");
        merge_layers(&chain_specs(&top), stop_path.as_deref(), &dst, &MergeOptions { cluster_bits: Some(cluster_bits) }, &mut |_, _| {}).unwrap();
        assert_same(&qemu_raw(&dst), &want, "dst against qemu's flattened top");
        assert_clean(&dst);
    }
}
