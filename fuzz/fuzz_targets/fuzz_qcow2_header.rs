//! Fuzzes the qcow2 header parser (pure, over the input bytes as the file's start), checks
//! the invariants it promises, and then opens inputs that parse as a real image file and
//! reads through their (equally fuzzed) L1/L2 tables and compressed clusters: errors are
//! fine, panics and allocations sized by bad fields are not. Headers that parse are also
//! re-pointed at another backing file (`with_backing`), which must parse back with it.
#![no_main]

use std::os::unix::fs::FileExt;

use libfuzzer_sys::fuzz_target;
use vdstream_blockdev::BlockDev;
use vdstream_qcow2::{with_backing, Header, OpenOptions, Qcow2Image};

fuzz_target!(|data: &[u8]| {
    let len = data.len() as u64;
    let Ok(h) = Header::parse(data, len) else { return };
    assert!((9..=21).contains(&h.cluster_bits));
    assert!(h.l1_table_offset + h.l1_size as u64 * 8 <= len);
    assert!(((h.refcount_table_clusters as u64) << h.cluster_bits) <= 8 << 20);
    assert!(h.l1_size as u64 >= Header::l1_entries_for(h.size, h.cluster_bits));
    for backing in [Some(("base.qcow2", "qcow2")), None] {
        if let Ok(out) = with_backing(data, len, backing) {
            assert!(out.len() as u64 <= h.cluster_size());
            let again = Header::parse(&out, len).expect("a re-pointed header parses");
            assert_eq!(again.backing_file.as_deref(), backing.map(|b| b.0));
            assert_eq!(again.l1_table_offset, h.l1_table_offset);
        }
    }
    if h.backing_file.is_some() || h.size > 64 << 20 {
        return;
    }
    let path = std::env::temp_dir().join(format!("vdstream-fuzz-qcow2-{}.img", std::process::id()));
    let Ok(f) = std::fs::File::create(&path) else { return };
    if f.write_all_at(data, 0).is_err() {
        return;
    }
    drop(f);
    if let Ok(img) = Qcow2Image::open(&path, OpenOptions { read_only: true, l2_cache_bytes: 0 }, None) {
        let n = img.size().min(1 << 20) as usize;
        let mut buf = vec![0u8; n];
        let _ = img.read_at(&mut buf, 0);
        let _ = img.read_at_sparse(&mut buf, 0, &mut Vec::new());
        let _ = img.block_status(0, img.size(), &mut Vec::new());
    }
});
