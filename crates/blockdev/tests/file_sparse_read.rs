//! A large read of a sparse file reports its holes (so the NBD edge can send them as
//! holes), and the bytes it returns are the file's, holes as zeros.

use std::os::unix::fs::FileExt;

use vdstream_blockdev::{BlockDev, FileDev, FileOptions, Hole};

#[test]
fn large_reads_report_the_holes_of_a_sparse_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sparse.img");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(4 << 20).unwrap();
    f.write_all_at(&[0xab; 8192], 1 << 20).unwrap();
    f.sync_all().unwrap();
    drop(f);
    for direct in [false, true] {
        let Ok(dev) = FileDev::open(
            &path,
            FileOptions {
                read_only: true,
                direct,
            },
        ) else {
            println!("SKIP direct={direct}: refused here");
            continue;
        };
        let mut buf = vec![0xffu8; 4 << 20];
        let mut holes = Vec::new();
        dev.read_at_sparse(&mut buf, 0, &mut holes).unwrap();
        let data = (1 << 20)..(1 << 20) + 8192;
        for (i, &b) in buf.iter().enumerate() {
            assert_eq!(
                b,
                if data.contains(&i) { 0xab } else { 0 },
                "byte {i} (direct={direct})"
            );
        }
        // The file system may round its extents, but the data is never inside a hole and
        // most of the file is reported as holes.
        let in_hole = |i: usize| {
            holes
                .iter()
                .any(|h: &Hole| (h.start..h.start + h.len).contains(&i))
        };
        assert!(
            !data.clone().any(in_hole),
            "data reported as a hole: {holes:?}"
        );
        let hole_bytes: usize = holes.iter().map(|h| h.len).sum();
        assert!(
            hole_bytes >= 3 << 20,
            "only {hole_bytes} bytes of holes reported: {holes:?}"
        );
        // Small reads take the plain path and report nothing.
        let mut small = vec![0u8; 4096];
        let mut none = Vec::new();
        dev.read_at_sparse(&mut small, 0, &mut none).unwrap();
        assert!(none.is_empty());
    }
}

/// A file cut short under an open device: a sparse read past the cut fails with EIO, as a
/// plain read does, instead of calling the lost bytes a hole.
#[test]
fn a_sparse_read_past_the_end_of_a_cut_file_fails() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.img");
    let f = std::fs::File::create(&path).unwrap();
    f.write_all_at(&vec![0xcd; 4 << 20], 0).unwrap();
    let dev = FileDev::open(
        &path,
        FileOptions {
            read_only: true,
            direct: false,
        },
    )
    .unwrap();
    f.set_len(2 << 20).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let e = dev
        .read_at_sparse(&mut buf, 3 << 20, &mut Vec::new())
        .unwrap_err();
    assert_eq!(e.kind, vdstream_blockdev::ErrorKind::Io, "{e}");
    assert!(dev.read_at(&mut buf, 3 << 20).is_err());
}
