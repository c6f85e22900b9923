//! Several connections of one `server`-type attach (what an agent opens with
//! `--server-connections`), through the real NBD server on a unix socket: the connection
//! that makes the attach is offered no multi-conn (a second client without the secret is
//! refused), the ones that join it with the attach's secret are; a write on one is read on
//! another; and the cache's store I/O is charged once to the server's totals, however many
//! connections hold the cache (each used to charge from its own snapshot).

mod common;

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vdstream_contract::{ExportDescription, ExportName};
use vdstream_nbd::client::{Client, ConnectOptions};
use vdstream_server::exports::StoreExports;
use vdstream_server::{ServerOptions, ServerState};
use vdstream_store::vdisk::NewVdisk;
use vdstream_store::{NewTarget, Store};

struct Farm {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    state: Arc<ServerState>,
    rt: tokio::runtime::Runtime,
}

/// A store with vDisk `win` and target `s` of cache type `server`, served on a unix socket.
fn farm() -> Farm {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open_or_create(dir.path().join("store")).unwrap();
    store
        .create_vdisk("win", 8 << 20, NewVdisk::default())
        .unwrap();
    let t = NewTarget {
        id: "s".into(),
        vdisk: "win".into(),
        cache: "server".into(),
        version: None,
        ram: None,
        overflow_max: None,
        description: None,
        macs: vec![],
        hostname: None,
        overflow_device: None,
    };
    store.add_target(t).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let socket = dir.path().join("server.sock");
    let state = ServerState::new(&ServerOptions {
        socket: Some(socket.clone()),
        name: Some("pvs1".into()),
        ..ServerOptions::new(store.root())
    });
    common::serve_exports(
        &rt,
        Arc::new(StoreExports::new(state.clone()).unwrap()),
        &socket,
    );
    Farm {
        _dir: dir,
        socket,
        state,
        rt,
    }
}

impl Farm {
    fn connect(&self, export: &str, secret: Option<String>) -> Client {
        let uri = format!("nbd+unix:///{export}?socket={}", self.socket.display());
        self.rt
            .block_on(Client::connect_uri(
                &uri,
                ConnectOptions {
                    secret,
                    ..ConnectOptions::default()
                },
            ))
            .unwrap()
    }

    /// A new attach of target `s`: the client, the pinned name and the secret it was handed.
    fn attach(&self) -> (Client, String, String) {
        let c = self.connect("target/s", None);
        let mut d: ExportDescription = c.info().description.clone().unwrap().parse().unwrap();
        let secret = d.take_secret().expect("a new attach is handed its secret");
        let pin = d.pin().expect("the description names the attach");
        assert!(
            matches!(
                pin,
                ExportName::Target {
                    attach: Some(_),
                    ..
                }
            ),
            "{pin}"
        );
        (c, pin.to_string(), secret)
    }

    fn write(&self, c: &Client, offset: u64, byte: u8) {
        self.rt
            .block_on(c.write(offset, &[byte; 64 << 10], false))
            .unwrap();
    }

    fn store_write_bytes(&self) -> u64 {
        self.state.totals.store_write_bytes.load(Ordering::Relaxed)
    }
}

#[test]
fn the_attach_offers_multi_conn_only_to_connections_that_prove_it() {
    let f = farm();
    let (first, pin, secret) = f.attach();
    assert!(
        !first.can_multi_conn(),
        "the connection that made the attach holds it alone as far as any other client knows"
    );
    let second = f.connect(&pin, Some(secret.clone()));
    let third = f.connect(&pin, Some(secret));
    assert!(
        second.can_multi_conn() && third.can_multi_conn(),
        "joined with the secret: multi-conn"
    );
    // One cache: a write on one connection is read on the others.
    f.write(&second, 1 << 20, 0x5a);
    for c in [&first, &third] {
        assert_eq!(
            f.rt.block_on(c.read(1 << 20, 4096)).unwrap(),
            vec![0x5a; 4096]
        );
    }
    // Without the secret the attach is fenced, as before.
    let uri = format!("nbd+unix:///{pin}?socket={}", f.socket.display());
    assert!(
        f.rt.block_on(Client::connect_uri(&uri, ConnectOptions::default()))
            .is_err(),
        "no secret: refused"
    );
}

#[test]
fn store_io_of_a_shared_cache_is_charged_once() {
    // The same writes, through one connection and through two of one attach.
    let one = farm();
    let (c, _, _) = one.attach();
    for (i, off) in [0u64, 2 << 20, 4 << 20, 6 << 20].into_iter().enumerate() {
        one.write(&c, off, i as u8 + 1);
    }
    let two = farm();
    let (a, pin, secret) = two.attach();
    let b = two.connect(&pin, Some(secret));
    for (i, off) in [0u64, 2 << 20, 4 << 20, 6 << 20].into_iter().enumerate() {
        two.write(if i % 2 == 0 { &a } else { &b }, off, i as u8 + 1);
    }
    assert!(
        one.store_write_bytes() >= 4 * (64 << 10),
        "the writes reached the cache file: {}",
        one.store_write_bytes()
    );
    assert_eq!(
        two.store_write_bytes(),
        one.store_write_bytes(),
        "two connections on one cache charged its file's writes more than once"
    );
}

/// An agent's link (RemoteBase, writable: the `server` types) with `connections`.
fn agent(f: &Farm, connections: usize) -> vdstream_agent::RemoteBase {
    let ep = vdstream_agent::Endpoint::parse(&format!(
        "nbd+unix:///target/s?socket={}",
        f.socket.display()
    ))
    .unwrap();
    let opts = vdstream_agent::RemoteOptions {
        writable: true,
        connections,
        target: "s".into(),
        ..Default::default()
    };
    vdstream_agent::RemoteBase::connect(vec![ep], opts).unwrap()
}

#[test]
fn an_agent_opens_its_connections_on_the_one_attach() {
    use vdstream_blockdev::BlockDev;
    let f = farm();
    let base = agent(&f, 4);
    assert_eq!(
        f.state.registry.len(),
        4,
        "four sessions of target s on the server"
    );
    // Requests spread over the connections land in one cache.
    for i in 0..16u64 {
        base.write_at(&[i as u8 + 1; 4096], i * 4096, false)
            .unwrap();
    }
    for i in 0..16u64 {
        let mut b = [0u8; 4096];
        base.read_at(&mut b, i * 4096).unwrap();
        assert_eq!(b, [i as u8 + 1; 4096], "block {i}");
    }
    assert!(base.caps().multi_conn);
    drop(base);
    let one = farm();
    let _base = agent(&one, 1);
    assert_eq!(
        one.state.registry.len(),
        1,
        "--server-connections 1: one session"
    );
}
