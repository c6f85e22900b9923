//! The native VHDX reader (vhdx.rs) against qemu: a VHDX made and written by qemu-img and
//! qemu-io, larger than one chunk (so the BAT interleaves a sector-bitmap entry), reads
//! exactly what qemu reads; a truncated one is refused.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

use vdstream_store::vhdx::Run;
use vdstream_store::vhdx::Vhdx;

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("run qemu tool");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes what `vhdx` reads into a sparse raw file of its size (zero runs are left as
/// holes: qemu-img marks every block of a new VHDX ZERO).
fn read_all(vhdx: &Vhdx, out: &Path) {
    let f = std::fs::File::create(out).unwrap();
    f.set_len(vhdx.size).unwrap();
    vhdx.for_each_run(&mut |off, r| {
        match r {
            Run::Data(d) => f.write_all_at(d, off).unwrap(),
            Run::Zero(_) => {}
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_qemu_vhdx_reads_as_qemu_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("base.vhdx");
    // 6 GiB with 1 MiB blocks: chunks of 4096 blocks (4 GiB), so blocks past 4 GiB sit after
    // the first sector-bitmap entry of the BAT.
    run(Command::new("qemu-img")
        .args(["create", "-q", "-f", "vhdx", "-o", "block_size=1M"])
        .arg(&img)
        .arg("6G"));
    run(Command::new("qemu-io")
        .arg("-c")
        .arg("write -P 0x11 0 3M")
        .arg("-c")
        .arg("write -P 0x22 1536k 4k")
        .arg("-c")
        .arg("write -P 0x33 4095M 2M")
        .arg("-c")
        .arg("write -P 0x44 6143M 1M")
        .arg("-c")
        .arg("write -z 1M 256k")
        .arg(&img));
    let v = Vhdx::open(&img).unwrap();
    assert_eq!(v.size, 6 << 30);
    assert_eq!(v.block_size, 1 << 20);
    assert_eq!(v.sector, 512);
    assert!(!v.has_parent);
    assert_eq!(v.data_write_guid.len(), 36);
    let mine = dir.path().join("mine.raw");
    read_all(&v, &mine);
    let qemu = dir.path().join("qemu.raw");
    run(Command::new("qemu-img")
        .args(["convert", "-O", "raw", "-f", "vhdx"])
        .arg(&img)
        .arg(&qemu));
    run(Command::new("qemu-img")
        .args(["compare", "-q", "-f", "raw", "-F", "raw"])
        .arg(&mine)
        .arg(&qemu));
    // And the bytes themselves, where qemu wrote them.
    let f = std::fs::File::open(&mine).unwrap();
    for (at, byte) in [
        (0u64, 0x11u8),
        (1536 << 10, 0x22),
        (4095 << 20, 0x33),
        ((4096 << 20) + 5, 0x33),
        (6143 << 20, 0x44),
    ] {
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at).unwrap();
        assert_eq!(b[0], byte, "byte at {at}");
    }
}

#[test]
fn a_truncated_vhdx_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("t.vhdx");
    run(Command::new("qemu-img")
        .args(["create", "-q", "-f", "vhdx"])
        .arg(&img)
        .arg("64M"));
    run(Command::new("qemu-io")
        .arg("-c")
        .arg("write -P 0x55 40M 8M")
        .arg(&img));
    let len = std::fs::metadata(&img).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(len - (1 << 20))
        .unwrap();
    let e = Vhdx::open(&img).unwrap_err().to_string();
    assert!(
        e.contains("t.vhdx is corrupt") && e.contains("truncated"),
        "{e}"
    );
}

#[test]
fn a_file_that_is_not_vhdx_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("x.raw");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let e = Vhdx::open(&img).unwrap_err().to_string();
    assert!(
        e.contains("x.raw is corrupt") && e.contains("not a VHDX"),
        "{e}"
    );
}
