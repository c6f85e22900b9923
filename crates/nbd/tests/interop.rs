//! Interop checks against libnbd's real tools (`nbdinfo`, `nbdsh`), when installed.
//! Each test prints a note and passes trivially only if the tool is absent; when present,
//! any protocol mismatch fails it.

mod common;
use std::path::Path;
use std::process::Command;

use common::*;

fn tool(name: &str) -> Option<String> {
    let p = format!("/usr/bin/{name}");
    if Path::new(&p).exists() {
        Some(p)
    } else {
        eprintln!("{name} not installed; skipping this interop check");
        None
    }
}

async fn run(cmd: Vec<String>) -> (bool, String) {
    tokio::task::spawn_blocking(move || {
        let out = Command::new(&cmd[0])
            .args(&cmd[1..])
            .env("PATH", "/usr/bin:/bin")
            .output()
            .unwrap();
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_sees_export_and_contexts() {
    let Some(nbdinfo) = tool("nbdinfo") else {
        return;
    };
    let h = start();
    let uri = format!("nbd+unix:///disk?socket={}", h.path.display());
    let (ok, out) = run(vec![nbdinfo.clone(), "--json".into(), uri]).await;
    assert!(ok, "nbdinfo failed: {out}");
    assert!(out.contains(&format!("\"export-size\": {DISK}")), "{out}");
    assert!(out.contains("base:allocation"), "{out}");
    assert!(out.contains("\"block_size_preferred\": 4096"), "{out}");
    let (ok, out) = run(vec![
        nbdinfo,
        "--list".into(),
        format!("nbd+unix://?socket={}", h.path.display()),
    ])
    .await;
    assert!(ok, "nbdinfo --list failed: {out}");
    assert!(
        out.contains("export=\"disk\"") || out.contains("disk"),
        "{out}"
    );
    assert!(out.contains("ro"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdsh_reads_writes_zeroes_and_block_status() {
    let Some(nbdsh) = tool("nbdsh") else { return };
    let h = start();
    let uri = format!("nbd+unix:///disk?socket={}", h.path.display());
    let script = format!(
        "h = nbd.NBD()\nh.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)\nh.connect_uri({uri:?})\n"
    ) + r#"
h.pwrite(b"hello world" * 100, 4096)
assert h.pread(11, 4096) == b"hello world"
h.zero(8192, 4096)
assert h.pread(1100, 4096) == bytes(1100)
h.pwrite(b"x" * 4096, 65536, nbd.CMD_FLAG_FUA) if h.can_fua() else h.pwrite(b"x" * 4096, 65536)
entries = []
def cb(metacontext, offset, e, err):
    entries.extend(e)
h.block_status(131072, 0, cb)
assert sum(entries[0::2]) <= 131072 and len(entries) >= 2, entries
try:
    h.pread(10, 1 << 20)
    raise Exception("read past the end succeeded")
except nbd.Error as ex:
    assert ex.errno in (22, "EINVAL") or "Invalid" in str(ex) or "range" in str(ex), ex
print("ok")
"#;
    let script = script.replace("\n\nh.pwrite", "\nh.pwrite");
    let (ok, out) = run(vec![nbdsh, "-c".into(), script]).await;
    assert!(ok && out.contains("ok"), "nbdsh failed: {out}");
}
