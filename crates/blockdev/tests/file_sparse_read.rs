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
        let Ok(dev) = FileDev::open(&path, FileOptions { read_only: true, direct }) else {
            println!("SKIP direct={direct}: refused here");
            continue;
        };
        let mut buf = vec![0xffu8; 4 << 20];
        let mut holes = Vec::new();
        dev.read_at_sparse(&mut buf, 0, &mut holes).unwrap();
        let data = (1 << 20)..(1 << 20) + 8192;
        for (i, &b) in buf.iter().enumerate() {
            assert_eq!(b, if data.contains(&i) { 0xab } else { 0 }, "byte {i} (direct={direct})");
        }
        // The file system may round its extents, but the data is never inside a hole and
        // most of the file is reported as holes.
        let in_hole = |i: usize| holes.iter().any(|h: &Hole| (h.start..h.start + h.len).contains(&i));
        assert!(!data.clone().any(in_hole), "data reported as a hole: {holes:?}");
        let hole_bytes: usize = holes.iter().map(|h| h.len).sum();
        assert!(hole_bytes >= 3 << 20, "only {hole_bytes} bytes of holes reported: {holes:?}");
        // Small reads take the plain path and report nothing.
        let mut small = vec![0u8; 4096];
        let mut none = Vec::new();
        dev.read_at_sparse(&mut small, 0, &mut none).unwrap();
        assert!(none.is_empty());
    }
}
