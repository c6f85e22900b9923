//! Shared helpers for the qcow2 tests: running qemu-img/qemu-io, reading files, comparing.
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

use vdstream_blockdev::{BlockDev, Extent};

/// Runs a command, panics with its output when it fails, returns stdout.
pub fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn qemu_img(args: &[&str]) -> String {
    run("qemu-img", args)
}

/// qemu-img's (major, minor) version, from `qemu-img --version` ("qemu-img version 10.0.2 (...)").
pub fn qemu_img_version() -> (u32, u32) {
    let text = qemu_img(&["--version"]);
    let number = text
        .split_whitespace()
        .find(|w| w.starts_with(|c: char| c.is_ascii_digit()))
        .unwrap_or_else(|| panic!("no version in: {text}"));
    let mut parts = number.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// `qemu-io -c CMD...` on an image (format probed).
pub fn qemu_io(image: &Path, cmds: &[&str]) {
    let mut args: Vec<&str> = Vec::new();
    for c in cmds {
        args.push("-c");
        args.push(c);
    }
    let p = image.to_str().unwrap();
    args.push(p);
    run("qemu-io", &args);
}

/// What qemu reads from `image`: `qemu-img convert -O raw`.
pub fn qemu_raw(image: &Path) -> Vec<u8> {
    let out = image.with_extension("qemu-raw");
    let _ = std::fs::remove_file(&out);
    qemu_img(&[
        "convert",
        "-O",
        "raw",
        image.to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    let bytes = std::fs::read(&out).unwrap();
    std::fs::remove_file(&out).unwrap();
    bytes
}

/// Reads the whole device in chunks of `chunk` bytes.
pub fn read_all(dev: &dyn BlockDev, chunk: usize) -> Vec<u8> {
    let mut buf = vec![0u8; dev.size() as usize];
    for (i, part) in buf.chunks_mut(chunk).enumerate() {
        dev.read_at(part, (i * chunk) as u64).unwrap();
    }
    buf
}

/// Panics at the first differing byte.
pub fn assert_same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length differs");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i}: got {:#04x}, want {:#04x}",
            got[i], want[i]
        );
    }
}

/// `qemu-img check --output=json`: (check-errors, corruptions, leaks).
pub fn qemu_check(image: &Path) -> (u64, u64, u64) {
    let out = Command::new("qemu-img")
        .args(["check", "--output=json", image.to_str().unwrap()])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "qemu-img check output is not JSON ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let n = |k: &str| v.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
    (n("check-errors"), n("corruptions"), n("leaks"))
}

/// Asserts `qemu-img check` reports no errors, corruptions or leaks.
pub fn assert_clean(image: &Path) {
    let (errors, corruptions, leaks) = qemu_check(image);
    assert_eq!(
        (errors, corruptions, leaks),
        (0, 0, 0),
        "qemu-img check on {}: {}",
        image.display(),
        String::from_utf8_lossy(
            &Command::new("qemu-img")
                .args(["check", image.to_str().unwrap()])
                .output()
                .unwrap()
                .stdout
        )
    );
}

/// Per-byte "reads as zero per block status" from `qemu-img map --output=json`.
pub fn qemu_zero_map(image: &Path, size: u64) -> Vec<bool> {
    let v: serde_json::Value = serde_json::from_str(&qemu_img(&[
        "map",
        "--output=json",
        image.to_str().unwrap(),
    ]))
    .unwrap();
    let mut map = vec![false; size as usize];
    for e in v.as_array().unwrap() {
        let start = e["start"].as_u64().unwrap() as usize;
        let len = e["length"].as_u64().unwrap() as usize;
        let zero = e["zero"].as_bool().unwrap();
        map[start..start + len].fill(zero);
    }
    map
}

/// Per-byte zero flags from our block status over the whole device.
pub fn our_zero_map(dev: &dyn BlockDev) -> Vec<bool> {
    let size = dev.size();
    let mut map = Vec::with_capacity(size as usize);
    let mut pos = 0;
    while pos < size {
        let mut ext: Vec<Extent> = Vec::new();
        dev.block_status(pos, size - pos, &mut ext).unwrap();
        assert!(!ext.is_empty());
        for e in ext {
            map.resize(map.len() + e.len as usize, e.zero);
            pos += e.len;
        }
    }
    map
}

/// The byte pattern tests write: cheap, position-dependent.
pub fn pattern(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            ((offset + i)
                .wrapping_mul(2654435761)
                .wrapping_add(seed.wrapping_mul(97))
                >> 7) as u8
                | 1
        })
        .collect()
}
