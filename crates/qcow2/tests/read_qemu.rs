//! Images made by qemu-img/qemu-io read back byte-identical to `qemu-img convert -O raw`,
//! and our block status agrees with `qemu-img map` on what reads as zero.

mod common;

use std::path::Path;

use common::*;
use vdstream_blockdev::BlockDev;
use vdstream_qcow2::{open_chain, Qcow2Image};

const MIB: u64 = 1 << 20;

fn check_image(path: &Path) {
    let dev = open_chain(path).unwrap();
    let want = qemu_raw(path);
    // Odd chunk sizes so reads straddle clusters, and one big read.
    assert_same(
        &read_all(&*dev, 1_000_003),
        &want,
        &format!("{} (1 MB chunks)", path.display()),
    );
    assert_same(
        &read_all(&*dev, 12_345),
        &want,
        &format!("{} (12345-byte chunks)", path.display()),
    );
    let mut sparse = vec![0xaau8; dev.size() as usize];
    let mut holes = Vec::new();
    dev.read_at_sparse(&mut sparse, 0, &mut holes).unwrap();
    assert_same(&sparse, &want, "sparse read");
    for h in holes {
        assert!(sparse[h.start..h.start + h.len].iter().all(|&b| b == 0));
    }
    let ours = our_zero_map(&*dev);
    let theirs = qemu_zero_map(path, dev.size());
    if let Some(i) = ours.iter().zip(&theirs).position(|(a, b)| a != b) {
        panic!(
            "{}: block status differs from qemu-img map at byte {i}: ours zero={}, qemu zero={}",
            path.display(),
            ours[i],
            theirs[i]
        );
    }
}

#[test]
fn plain_image_with_data_and_zero_clusters() {
    let dir = tempfile::tempdir().unwrap();
    for (name, opts) in [
        ("v3.qcow2", "cluster_size=65536"),
        ("small.qcow2", "cluster_size=4096"),
        ("v2.qcow2", "compat=0.10"),
        ("big.qcow2", "cluster_size=2M"),
    ] {
        let p = dir.path().join(name);
        qemu_img(&[
            "create",
            "-f",
            "qcow2",
            "-o",
            opts,
            p.to_str().unwrap(),
            "9M",
        ]);
        let mut cmds = vec![
            "write -P 0x11 0 4k",
            "write -P 0x22 100k 300k",
            "write -P 0x33 2M 2M",
            "write -P 0x44 9437183 1",
        ];
        if !opts.contains("0.10") {
            cmds.extend(["write -z 2M 64k", "write -P 0x55 6M 1M", "write -z 6M 1M"]);
        }
        qemu_io(&p, &cmds);
        check_image(&p);
    }
}

#[test]
fn compressed_clusters() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.qcow2");
    qemu_img(&["create", "-f", "qcow2", src.to_str().unwrap(), "5M"]);
    qemu_io(
        &src,
        &[
            "write -P 0x61 0 1M",
            "write -P 0x62 1M 4k",
            "write -P 0x63 3M 1536k",
        ],
    );
    for (name, cs) in [
        ("c64k.qcow2", "65536"),
        ("c4k.qcow2", "4096"),
        ("c512.qcow2", "512"),
    ] {
        let p = dir.path().join(name);
        qemu_img(&[
            "convert",
            "-c",
            "-O",
            "qcow2",
            "-o",
            &format!("cluster_size={cs}"),
            src.to_str().unwrap(),
            p.to_str().unwrap(),
        ]);
        check_image(&p);
    }
    // Random (incompressible-ish) data next to compressed clusters, through qemu-io -c.
    let p = dir.path().join("mixed.qcow2");
    qemu_img(&["create", "-f", "qcow2", p.to_str().unwrap(), "2M"]);
    qemu_io(
        &p,
        &[
            "write -c -P 0x71 0 64k",
            "write -c -P 0x72 128k 64k",
            "write -P 0x73 64k 64k",
        ],
    );
    let map = qemu_img(&["map", "--output=json", p.to_str().unwrap()]);
    let version = qemu_img_version();
    assert!(
        version >= (8, 2),
        "qemu-img {}.{} is too old for this test: `qemu-img map --output=json` reports \"compressed\" from qemu 8.2 on \
         (Debian 12 ships 7.2: install qemu-utils from bookworm-backports, as ./scripts/test does)",
        version.0,
        version.1
    );
    assert!(
        map.contains("\"compressed\": true"),
        "qemu wrote no compressed cluster: {map}"
    );
    check_image(&p);
}

#[test]
fn three_layer_chain_raw_base() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.raw");
    // A raw base with data, and a sparse hole at 4-5 MiB.
    let size = 8 * MIB;
    let mut bytes = pattern(1, 0, size as usize);
    bytes[(4 * MIB) as usize..(5 * MIB) as usize].fill(0);
    std::fs::write(&base, &bytes).unwrap();
    run(
        "fallocate",
        &[
            "-p",
            "-o",
            &(4 * MIB).to_string(),
            "-l",
            &MIB.to_string(),
            base.to_str().unwrap(),
        ],
    );
    let mid = dir.path().join("mid.qcow2");
    let top = dir.path().join("top.qcow2");
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
            "write -P 0x21 0 100k",
            "write -z 1M 128k",
            "write -P 0x22 3M 1M",
        ],
    );
    qemu_img(&[
        "create",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=4096",
        "-b",
        "mid.qcow2",
        "-F",
        "qcow2",
        top.to_str().unwrap(),
        "10M",
    ]);
    qemu_io(
        &top,
        &[
            "write -P 0x31 50k 20k",
            "write -z 3M 8k",
            "write -P 0x32 9M 4k",
            "write -z 7M 4k",
        ],
    );
    check_image(&top);
    check_image(&mid);
    let info = qemu_img(&["info", "--backing-chain", top.to_str().unwrap()]);
    assert!(info.contains("base.raw"), "{info}");
    // An explicit backing device works too, and open() without one is refused.
    let err = Qcow2Image::open(&top, Default::default(), None).unwrap_err();
    assert!(err.to_string().contains("backing file"), "{err}");
    let explicit =
        Qcow2Image::open(&top, Default::default(), Some(open_chain(&mid).unwrap())).unwrap();
    assert_same(
        &read_all(&explicit, 1 << 20),
        &qemu_raw(&top),
        "explicit backing",
    );
    assert!(explicit.caps().read_only);
}
