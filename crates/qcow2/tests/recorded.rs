//! A recorded chain is opened as its record says, never as its files say: a raw layer
//! whose first bytes a guest made into a qcow2 header naming a host file is still raw, and
//! a qcow2 layer whose header names anything but the layer recorded below it is refused.
//! The host file in these tests carries a unique marker; it must never be read.

use std::path::{Path, PathBuf};

use vdstream_blockdev::BlockDev;
use vdstream_qcow2::{create, open_chain, open_recorded, ImageFormat, LayerSpec};

const MIB: u64 = 1 << 20;

/// A host file with a unique marker at every 4 KiB, 1 MiB long.
fn host_file(dir: &Path) -> (PathBuf, Vec<u8>) {
    let marker = format!("HOST-SECRET-{}-{}", std::process::id(), nanos()).into_bytes();
    let mut bytes = vec![0u8; MIB as usize];
    for chunk in bytes.chunks_mut(4096) {
        chunk[..marker.len()].copy_from_slice(&marker);
    }
    let p = dir.join("shadow");
    std::fs::write(&p, &bytes).unwrap();
    (p, marker)
}

fn nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

fn read_all(dev: &dyn BlockDev) -> Vec<u8> {
    let mut buf = vec![0u8; dev.size() as usize];
    dev.read_at(&mut buf, 0).unwrap();
    buf
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The first cluster of a qcow2 image of `size` bytes backed by `backing` (raw), as a guest
/// would write it into the first sectors of a raw disk.
fn qcow2_header_naming(dir: &Path, backing: &Path, size: u64) -> Vec<u8> {
    let p = dir.join("scratch.qcow2");
    let _ = std::fs::remove_file(&p);
    create(
        &p,
        size,
        Some((backing.to_str().unwrap(), ImageFormat::Raw)),
        16,
    )
    .unwrap();
    std::fs::read(&p).unwrap()
}

#[test]
fn a_raw_layer_whose_guest_wrote_a_qcow2_header_stays_raw() {
    let dir = tempfile::tempdir().unwrap();
    let (host, marker) = host_file(dir.path());
    let base = dir.path().join("v.base.raw");
    let header = qcow2_header_naming(dir.path(), &host, MIB);
    let mut disk = vec![0u8; 4 * MIB as usize];
    disk[..header.len()].copy_from_slice(&header);
    std::fs::write(&base, &disk).unwrap();

    // What a probe would have done: the file now looks like a qcow2 over the host file.
    assert_eq!(ImageFormat::probe(&base).unwrap(), ImageFormat::Qcow2);
    let probed = read_all(&*open_chain(&base).unwrap());
    assert!(
        contains(&probed, &marker),
        "the probed open reads the host file (the hazard this guards against)"
    );

    let dev = open_recorded(&[LayerSpec::new(&base, ImageFormat::Raw)]).unwrap();
    let got = read_all(&*dev);
    assert_eq!(
        got.len(),
        disk.len(),
        "served at the raw file's size, not the header's"
    );
    assert_eq!(got, disk, "the guest's own bytes, header included");
    assert!(!contains(&got, &marker));
}

#[test]
fn a_qcow2_layer_naming_another_file_than_its_recorded_parent_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (host, marker) = host_file(dir.path());
    let base = dir.path().join("v.base.raw");
    std::fs::write(&base, vec![0u8; MIB as usize]).unwrap();

    // Named by absolute path, by a relative path out of the folder, by a json: or nbd: name.
    for (i, name) in [
        host.to_str().unwrap().to_string(),
        "../shadow".to_string(),
        format!("json:{{\"file\":{{\"filename\":\"{}\"}}}}", host.display()),
        "nbd://127.0.0.1:10809/x".to_string(),
    ]
    .iter()
    .enumerate()
    {
        let top = dir.path().join(format!("v.{}.qcow2", i + 1));
        create(&top, MIB, Some((name, ImageFormat::Raw)), 16).unwrap();
        let e = open_recorded(&[
            LayerSpec::new(&base, ImageFormat::Raw),
            LayerSpec::new(&top, ImageFormat::Qcow2),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(&format!("names backing file {name:?}")) && e.contains("v.base.raw"),
            "{e}"
        );
    }

    // The right name, the wrong recorded format.
    let top = dir.path().join("v.9.qcow2");
    create(&top, MIB, Some(("v.base.raw", ImageFormat::Qcow2)), 16).unwrap();
    let e = open_recorded(&[
        LayerSpec::new(&base, ImageFormat::Raw),
        LayerSpec::new(&top, ImageFormat::Qcow2),
    ])
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("backing format \"qcow2\"") && e.contains("recorded as raw"),
        "{e}"
    );

    // A bottom layer that names a backing file at all.
    let lone = dir.path().join("lone.qcow2");
    create(
        &lone,
        MIB,
        Some((host.to_str().unwrap(), ImageFormat::Raw)),
        16,
    )
    .unwrap();
    let e = open_recorded(&[LayerSpec::new(&lone, ImageFormat::Qcow2)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("it is the bottom layer"), "{e}");

    // Nothing opened read the host file: the right chain reads zeros.
    let good = dir.path().join("v.10.qcow2");
    create(&good, MIB, Some(("v.base.raw", ImageFormat::Raw)), 16).unwrap();
    let dev = open_recorded(&[
        LayerSpec::new(&base, ImageFormat::Raw),
        LayerSpec::new(&good, ImageFormat::Qcow2),
    ])
    .unwrap();
    assert!(!contains(&read_all(&*dev), &marker));
    assert!(read_all(&*dev).iter().all(|&b| b == 0));
}

#[test]
fn layers_that_are_symbolic_links_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let (host, _) = host_file(dir.path());
    let link = dir.path().join("v.base.raw");
    std::os::unix::fs::symlink(&host, &link).unwrap();
    let e = open_recorded(&[LayerSpec::new(&link, ImageFormat::Raw)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("v.base.raw is a symbolic link"), "{e}");

    // A file an administrator names through a link is resolved once and served.
    let dev = open_chain(&link).unwrap();
    assert_eq!(dev.size(), MIB);
}

#[test]
fn a_probed_qcow2_that_names_a_backing_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (host, _) = host_file(dir.path());
    let raw = dir.path().join("disk.img");
    let mut disk = vec![0u8; MIB as usize];
    let header = qcow2_header_naming(dir.path(), &host, MIB);
    disk[..header.len()].copy_from_slice(&header);
    std::fs::write(&raw, &disk).unwrap();
    let e = vdstream_qcow2::probe_named(&raw).unwrap_err().to_string();
    assert!(
        e.contains(&format!("names backing file {:?}", host.to_str().unwrap()))
            && e.contains("--format qcow2")
            && e.contains("--format raw"),
        "{e}"
    );

    let lone = dir.path().join("lone.qcow2");
    create(&lone, MIB, None, 16).unwrap();
    assert_eq!(
        vdstream_qcow2::probe_named(&lone).unwrap(),
        ImageFormat::Qcow2
    );
    std::fs::write(dir.path().join("r.img"), vec![7u8; 4096]).unwrap();
    assert_eq!(
        vdstream_qcow2::probe_named(&dir.path().join("r.img")).unwrap(),
        ImageFormat::Raw
    );
}
