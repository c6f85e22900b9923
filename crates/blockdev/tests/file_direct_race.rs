//! O_DIRECT read-modify-write against a concurrent aligned write of the same blocks: the
//! bytes only the aligned write touched must always end up as it wrote them. (Before every
//! direct write took the locks of all the blocks it covers, the partial write's
//! read-modify-write could put back the old bytes around its own range.)

use std::sync::{Arc, Barrier};

use vdstream_blockdev::{BlockDev, FileDev, FileOptions};

#[repr(C, align(4096))]
struct Aligned([u8; 16384]);

#[test]
fn partial_write_never_undoes_a_concurrent_aligned_write() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    std::fs::write(&path, vec![0u8; 64 << 10]).unwrap();
    let dev = match FileDev::open(
        &path,
        FileOptions {
            read_only: false,
            direct: true,
        },
    ) {
        Ok(d) => Arc::new(d),
        Err(e) => {
            println!("SKIP: O_DIRECT refused here: {e}");
            return;
        }
    };
    const ROUNDS: usize = 400;
    // The partial write: 100 bytes inside the third block of the aligned range.
    const PART: std::ops::Range<usize> = 8192 + 10..8192 + 110;
    let barrier = Arc::new(Barrier::new(2));
    let partial = {
        let (dev, barrier) = (dev.clone(), barrier.clone());
        std::thread::spawn(move || {
            for _ in 0..ROUNDS {
                barrier.wait();
                dev.write_at(&[0xee; PART.end - PART.start], PART.start as u64, false)
                    .unwrap();
                barrier.wait();
            }
        })
    };
    let mut buf = Box::new(Aligned([0; 16384]));
    let mut back = vec![0u8; 16384];
    for round in 0..ROUNDS {
        let fill = (round % 250) as u8 + 1;
        buf.0.fill(fill);
        barrier.wait();
        dev.write_at(&buf.0, 0, false).unwrap();
        barrier.wait();
        dev.read_at(&mut back, 0).unwrap();
        for (i, &b) in back.iter().enumerate() {
            if !PART.contains(&i) {
                assert_eq!(
                    b, fill,
                    "round {round}: byte {i}, outside the partial write, lost the aligned write"
                );
            }
        }
    }
    partial.join().unwrap();
}
