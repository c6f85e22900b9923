//! The boot service (`vdstream server --http ADDR --boot`) through the real HTTP server and
//! a real store: what a PXE-booting machine is told for a known MAC, an unknown one (refused
//! and logged, or auto-added from the template), the address it is told to use (its Host,
//! or the advertised one), the boot files, bad input, and that none of it exists without
//! --boot.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use vdstream_server::boot::{machine_id, BootConfig, UnknownMac};
use vdstream_server::http::{self, HttpHandle};
use vdstream_server::state::ServerState;
use vdstream_server::tokens::{Role, Tokens};
use vdstream_server::ServerOptions;
use vdstream_store::vdisk::NewVdisk;
use vdstream_store::{NewTarget, Store};

mod common;

/// Every log line of this test process (the server's included).
fn captured() -> &'static common::Capture {
    common::captured(log::LevelFilter::Info)
}

struct Boot {
    _dir: tempfile::TempDir,
    store: Store,
    _state: Arc<ServerState>,
    handle: Option<HttpHandle>,
    addr: SocketAddr,
    rt: tokio::runtime::Runtime,
}

impl Drop for Boot {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            self.rt.block_on(h.stop());
        }
    }
}

fn new_target(id: &str, macs: &[&str]) -> NewTarget {
    NewTarget {
        id: id.into(),
        vdisk: "win".into(),
        cache: "ram-overflow".into(),
        version: None,
        ram: Some(256 << 20),
        overflow_max: None,
        description: None,
        macs: macs.iter().map(|m| m.to_string()).collect(),
        hostname: None,
        overflow_device: None,
    }
}

fn server(boot: Option<BootConfig>) -> Boot {
    captured();
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open_or_create(dir.path().join("store")).unwrap();
    store
        .create_vdisk("win", 8 << 20, NewVdisk::default())
        .unwrap();
    let state = ServerState::new(&ServerOptions {
        listen: Some("127.0.0.1:10809".parse().unwrap()),
        name: Some("pvs1".into()),
        boot,
        ..ServerOptions::new(store.root())
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let handle = rt
        .block_on(async { http::spawn(TcpListener::bind("127.0.0.1:0").unwrap(), state.clone()) })
        .unwrap();
    let addr = handle.local_addr();
    Boot {
        _dir: dir,
        store,
        _state: state,
        handle: Some(handle),
        addr,
        rt,
    }
}

/// One request (`head`: the request line and fields, without the blank line) and its
/// answer: status, head, body.
fn raw(addr: SocketAddr, head: &str) -> (u16, String, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(format!("{head}\r\nConnection: close\r\n\r\n").as_bytes())
        .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let split = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a whole answer");
    let head = String::from_utf8_lossy(&out[..split]).to_string();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head, out[split + 4..].to_vec())
}

fn get(addr: SocketAddr, path: &str, host: &str) -> (u16, String) {
    let (status, _, body) = raw(addr, &format!("GET {path} HTTP/1.1\r\nHost: {host}"));
    (status, String::from_utf8(body).unwrap())
}

#[test]
fn a_known_mac_gets_its_kernel_initrd_and_command_line_from_the_host_it_asked() {
    let b = server(Some(BootConfig::default()));
    b.store
        .add_target(new_target("pc1", &["52:54:00:12:34:56"]))
        .unwrap();
    b.store
        .add_target(NewTarget {
            hostname: Some("lab-two".into()),
            overflow_device: Some("/dev/sda2".into()),
            ..new_target("pc2", &["52:54:00:12:34:57"])
        })
        .unwrap();

    let (status, first) = get(b.addr, "/boot/ipxe", "10.0.2.2:8480");
    assert_eq!(status, 200, "{first}");
    assert!(first.starts_with("#!ipxe\n"), "{first}");
    assert!(
        first.contains(
            "chain --replace --autofree http://10.0.2.2:8480/boot/target/${net0/mac:hexhyp}\n"
        ),
        "{first}"
    );

    // iPXE's hexhyp form and the colon form are the same machine.
    for mac in [
        "52-54-00-12-34-56",
        "52:54:00:12:34:56",
        "52-54-00-12-34-56/",
    ] {
        let (status, s) = get(b.addr, &format!("/boot/target/{mac}"), "10.0.2.2:8480");
        assert_eq!(status, 200, "{mac}: {s}");
        assert!(s.starts_with("#!ipxe\n"), "{s}");
        let kernel = s
            .lines()
            .find(|l| l.starts_with("kernel "))
            .expect("a kernel line");
        let args: Vec<&str> = kernel
            .trim_end_matches(" || goto failed")
            .split(' ')
            .collect();
        assert_eq!(args[1], "http://10.0.2.2:8480/boot/vdisk/win/base/vmlinuz");
        for want in [
            "console=ttyS0",
            "initrd=initrd.img",
            "vdstream.target=pc1",
            "vdstream.server=http://10.0.2.2:8480",
            "vdstream.vdisk=win@base",
            "vdstream.cache=ram-overflow",
            "vdstream.ram=256M",
            "vdstream.hostname=pc1",
            &format!("vdstream.machine_id={}", machine_id("pc1")),
        ] {
            assert!(args.contains(&want), "{want} missing from {kernel}");
        }
        assert!(!kernel.contains("vdstream.overflow="), "{kernel}");
        assert!(s.contains("\ninitrd http://10.0.2.2:8480/boot/vdisk/win/base/initrd.img || goto failed\nboot || goto failed\n"), "{s}");
        assert!(
            s.contains(
                "chain --replace --autofree http://10.0.2.2:8480/boot/vdisk/win/base/problem"
            ),
            "{s}"
        );
    }
    // A promoted version is what the next boot gets; personality fields from the record.
    vdstream_store::documents::version_new(&b.store, "win", None, &mut |_, _| {}).unwrap();
    for to in [
        vdstream_store::Access::Test,
        vdstream_store::Access::Production,
    ] {
        vdstream_store::documents::version_promote(&b.store, "win", 1, to, None, &mut |_, _| {})
            .unwrap();
    }
    let (_, s) = get(b.addr, "/boot/target/52-54-00-12-34-57", "127.0.0.1:1234");
    for want in [
        "vdstream.target=pc2",
        "vdstream.vdisk=win@1",
        "vdstream.hostname=lab-two",
        "vdstream.overflow=/dev/sda2",
        "http://127.0.0.1:1234/boot/vdisk/win/1/vmlinuz",
    ] {
        assert!(s.contains(want), "{want} missing from {s}");
    }
    assert_ne!(machine_id("pc1"), machine_id("pc2"));
    assert!(s.contains(&machine_id("pc2")));
}

#[test]
fn the_advertised_address_and_other_servers_win_over_the_host() {
    let cfg = BootConfig {
        advertise: Some("10.0.2.2".into()),
        servers: vec!["http://10.0.0.9:8480".into()],
        ..BootConfig::default()
    };
    let b = server(Some(cfg));
    b.store
        .add_target(new_target("pc1", &["52:54:00:12:34:56"]))
        .unwrap();
    let port = b.addr.port();
    let (_, first) = get(b.addr, "/boot/ipxe", "127.0.0.1");
    assert!(
        first.contains(&format!("http://10.0.2.2:{port}/boot/target/")),
        "the API's port added: {first}"
    );
    let (_, s) = get(b.addr, "/boot/target/52:54:00:12:34:56", "127.0.0.1");
    assert!(
        s.contains(&format!(
            "vdstream.server=http://10.0.2.2:{port} vdstream.server=http://10.0.0.9:8480 "
        )),
        "this server first, then the others: {s}"
    );
    assert!(!s.contains("127.0.0.1"), "{s}");
}

#[test]
fn an_unknown_mac_is_refused_on_its_console_and_in_the_log() {
    let b = server(Some(BootConfig::default()));
    let (status, s) = get(b.addr, "/boot/target/52-54-00-AA-BB-01", "10.0.2.2:8480");
    assert_eq!(status, 200, "a script iPXE runs: {s}");
    assert!(s.starts_with("#!ipxe\n"), "{s}");
    assert!(
        s.contains("echo vdstream: no target record has MAC 52:54:00:aa:bb:01"),
        "{s}"
    );
    assert!(s.contains("echo vdstream:   vdstream target add ID --mac 52:54:00:aa:bb:01\necho vdstream:       --vdisk NAME --cache ram-overflow --ram 1G\n"), "{s}");
    assert!(
        s.contains("\nsleep 30\nchain --replace --autofree http://10.0.2.2:8480/boot/ipxe\n"),
        "retries: {s}"
    );
    assert!(b.store.targets().unwrap().is_empty(), "nothing added");
    let logged =
        captured().0.lock().unwrap().iter().any(|l| {
            l.contains("refused MAC 52:54:00:aa:bb:01") && l.contains("vdstream target add")
        });
    assert!(logged, "the log names the MAC");
}

#[test]
fn auto_add_makes_a_record_from_the_template() {
    let b = server(Some(BootConfig {
        unknown: UnknownMac::AutoAdd {
            template: "tmpl".into(),
            prefix: "lab".into(),
        },
        ..BootConfig::default()
    }));
    b.store
        .add_target(NewTarget {
            overflow_device: Some("/dev/vdb".into()),
            ..new_target("tmpl", &[])
        })
        .unwrap();
    let (status, s) = get(b.addr, "/boot/target/52-54-00-AA-BB-02", "10.0.2.2:8480");
    assert_eq!(status, 200, "{s}");
    for want in [
        "vdstream.target=lab-001",
        "vdstream.hostname=lab-001",
        "vdstream.overflow=/dev/vdb",
        "vdstream.ram=256M",
    ] {
        assert!(s.contains(want), "{want} missing from {s}");
    }
    let r = b.store.target("lab-001").unwrap();
    assert_eq!(
        (r.macs.clone(), r.vdisk.as_str(), r.ram),
        (
            vec!["52:54:00:aa:bb:02".to_string()],
            "win",
            Some(256 << 20)
        )
    );
    // The same machine again: the same record; another: the next id.
    assert!(get(b.addr, "/boot/target/52:54:00:aa:bb:02", "h")
        .1
        .contains("vdstream.target=lab-001"));
    assert!(get(b.addr, "/boot/target/52:54:00:aa:bb:03", "h")
        .1
        .contains("vdstream.target=lab-002"));
    let audit = vdstream_store::audit::read(&b.store.audit_path(), None, None).unwrap();
    let added: Vec<_> = audit
        .iter()
        .filter(|a| a.action == "target.auto-add")
        .map(|a| a.details["target"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(added, ["lab-001", "lab-002"]);
}

#[test]
fn bad_input_is_refused_and_only_get_is_served() {
    let b = server(Some(BootConfig::default()));
    for mac in [
        "nonsense",
        "52-54-00-12-34",
        "52:54:00:12:34:zz",
        "ff:ff:ff:ff:ff:ff",
    ] {
        let (status, body) = get(b.addr, &format!("/boot/target/{mac}"), "h");
        assert_eq!(status, 400, "{mac}: {body}");
        assert!(body.contains("is not a MAC address"), "{body}");
    }
    let (status, body) = get(b.addr, "/boot/ipxe", "evil${x}");
    assert_eq!(status, 400, "a Host that could add to the script: {body}");
    for head in [
        "POST /boot/ipxe HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0",
        "DELETE /boot/target/52:54:00:12:34:56 HTTP/1.1\r\nHost: h",
    ] {
        assert_eq!(raw(b.addr, head).0, 405, "{head}");
    }
    let (status, _, _) = raw(
        b.addr,
        "GET /boot/ipxe HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n\r\nhello",
    );
    assert_eq!(status, 413, "no bodies");
    assert_eq!(get(b.addr, "/boot/vdisk/win/x/vmlinuz", "h").0, 400);
    assert_eq!(get(b.addr, "/boot/vdisk/win/base/passwd", "h").0, 404);
    assert_eq!(
        get(b.addr, "/boot/vdisk/a%2F..%2Fb/base/vmlinuz", "h").0,
        400
    );
}

#[test]
fn a_version_without_a_kernel_is_named_and_its_files_are_served_when_there() {
    let b = server(Some(BootConfig::default()));
    // The vDisk holds no file system: no kernel (the reason names the vDisk and version).
    let (status, body) = get(b.addr, "/boot/vdisk/win/base/vmlinuz", "h");
    assert_eq!(status, 404, "{body}");
    assert!(body.starts_with("vDisk win version base"), "{body}");
    let (status, s) = get(b.addr, "/boot/vdisk/win/base/problem", "10.0.2.2:8480");
    assert_eq!(status, 200);
    assert!(
        s.starts_with("#!ipxe\n") && s.contains("echo vdstream: vDisk win version base"),
        "{s}"
    );
    // What a machine without credentials is told never shows the store's folder or the
    // names of other vDisks (the log has the whole reason).
    let root = b.store.root().display().to_string();
    for path in [
        "/boot/vdisk/nope/base/vmlinuz",
        "/boot/vdisk/nope/base/problem",
    ] {
        let (status, body) = get(b.addr, path, "h");
        assert!(
            body.contains("no vDisk named") && body.contains("nope"),
            "{status} {body}"
        );
        assert!(
            !body.contains(&root) && !body.contains("win"),
            "{path} shows the store to anyone: {body}"
        );
    }
    assert_eq!(get(b.addr, "/boot/vdisk/win/7/initrd.img", "h").0, 404);

    // A boot-file override (boot/files.rs): half of one is named, a whole one served.
    let dir = b.store.root().join("boot-override/win/base");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("initrd.img"), b"initrd bytes").unwrap();
    let (status, body) = get(b.addr, "/boot/vdisk/win/base/initrd.img", "h");
    assert!(
        status == 404 && body.contains("needs both vmlinuz and initrd.img"),
        "{status} {body}"
    );
    assert!(
        !body.contains(&root),
        "the override's folder is the administrator's to know: {body}"
    );
    let kernel: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(dir.join("vmlinuz"), &kernel).unwrap();
    let (status, head, body) = raw(
        b.addr,
        "GET /boot/vdisk/win/base/vmlinuz HTTP/1.1\r\nHost: h",
    );
    assert_eq!(status, 200, "{head}");
    assert!(
        head.to_ascii_lowercase().contains("content-length: 100000"),
        "{head}"
    );
    assert_eq!(body, kernel);
    let (status, head, body) = raw(
        b.addr,
        "GET /boot/vdisk/win/base/vmlinuz HTTP/1.1\r\nHost: 127.0.0.1\r\nRange: bytes=1000-1999",
    );
    assert_eq!(status, 206, "{head}");
    assert_eq!(body, &kernel[1000..2000]);
    assert_eq!(
        raw(
            b.addr,
            "GET /boot/vdisk/win/base/initrd.img HTTP/1.1\r\nHost: h"
        )
        .2,
        b"initrd bytes"
    );
}

#[test]
fn the_boot_routes_need_no_token_but_the_api_still_does() {
    let b = server(Some(BootConfig::default()));
    Tokens::of_store(b.store.root())
        .add("ops", Role::Admin)
        .unwrap();
    b.store
        .add_target(new_target("pc1", &["52:54:00:12:34:56"]))
        .unwrap();
    let (status, s) = get(b.addr, "/boot/target/52:54:00:12:34:56", "h");
    assert_eq!(status, 200, "a PXE ROM has no token: {s}");
    assert_eq!(
        get(b.addr, "/api/v1/targets", "h").0,
        401,
        "the API keeps its tokens"
    );
}

#[test]
fn a_machine_without_credentials_reads_only_network_booted_records_and_never_the_store() {
    let b = server(Some(BootConfig::default()));
    Tokens::of_store(b.store.root())
        .add("ops", Role::Admin)
        .unwrap();
    b.store
        .add_target(new_target("pc1", &["52:54:00:12:34:56"]))
        .unwrap();
    b.store.add_target(new_target("vm-on-a-host", &[])).unwrap();
    let root = b.store.root().display().to_string();
    // Its own record, as its agent reads it: no authorship, no report.
    let (status, body) = get(b.addr, "/api/v1/targets/pc1", "h");
    assert_eq!(status, 200, "{body}");
    let doc: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(doc["vdisk"], "win");
    assert_eq!(doc["created_by"], "", "{body}");
    // Records without a MAC, and ids that do not exist: the same bare 404, naming neither
    // the store's folder nor the ids there are.
    for id in ["vm-on-a-host", "nosuch"] {
        let (status, body) = get(b.addr, &format!("/api/v1/targets/{id}"), "h");
        assert_eq!(status, 404, "{id}: {body}");
        assert!(
            !body.contains(&root) && !body.contains("pc1") && !body.contains("known"),
            "{id}: {body}"
        );
    }
    let (status, body) = get(b.addr, "/api/v1/server", "h");
    assert_eq!(status, 200, "{body}");
    assert!(
        !body.contains(&root),
        "the server document shows the store to anyone: {body}"
    );
}

#[test]
fn without_boot_there_are_no_boot_routes() {
    let b = server(None);
    b.store
        .add_target(new_target("pc1", &["52:54:00:12:34:56"]))
        .unwrap();
    for path in [
        "/boot/ipxe",
        "/boot/target/52:54:00:12:34:56",
        "/boot/vdisk/win/base/vmlinuz",
    ] {
        let (status, body) = get(b.addr, path, "127.0.0.1");
        assert_eq!(status, 404, "{path}: {body}");
        assert!(body.contains("no API route"), "{body}");
    }
}
