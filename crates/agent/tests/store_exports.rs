//! RemoteBase against servers that name their exports as the store server does: an
//! endpoint reading `target/ID` falls back to `vdisk/NAME` on a server that does not know
//! the target, keeps its version through the fallback and across restarts (never moving to
//! the newer production), and a reconnect goes in the order a [`Reorder`] gives. Real
//! vdstream NBD server, unix sockets, bounded waits.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use vdstream_agent::remote::{Placement, Reorder};
use vdstream_agent::{Endpoint, RemoteBase};
use vdstream_blockdev::{BlockDev, MemoryDev};
use vdstream_nbd::client::Address;
use vdstream_nbd::{
    ExportInfo, Exports, Listener, OpenError, Server, ServerConfig, ShutdownSignal, ShutdownTrigger,
};

const SIZE: u64 = 1 << 20;

/// Named exports with descriptions, like the store server's.
struct Named(HashMap<String, (Arc<dyn BlockDev>, String)>);

impl Exports for Named {
    fn list(&self) -> Vec<ExportInfo> {
        self.0
            .iter()
            .map(|(n, (_, d))| ExportInfo {
                name: n.clone(),
                description: d.clone(),
            })
            .collect()
    }
    fn open(&self, name: &str) -> Result<Arc<dyn BlockDev>, OpenError> {
        self.0
            .get(name)
            .map(|(d, _)| d.clone())
            .ok_or_else(|| OpenError::Unknown(format!("no export named {name:?}")))
    }
    fn description(&self, name: &str) -> Option<String> {
        self.0.get(name).map(|(_, d)| d.clone())
    }
}

struct NamedServer {
    trigger: Option<ShutdownTrigger>,
    thread: Option<std::thread::JoinHandle<()>>,
    sock: std::path::PathBuf,
}

impl NamedServer {
    fn start(sock: &Path, exports: &[(&str, &Arc<MemoryDev>, &str)]) -> NamedServer {
        let _ = std::fs::remove_file(sock);
        let listener = std::os::unix::net::UnixListener::bind(sock).unwrap();
        listener.set_nonblocking(true).unwrap();
        let map = exports
            .iter()
            .map(|(n, d, desc)| {
                (
                    n.to_string(),
                    ((*d).clone() as Arc<dyn BlockDev>, desc.to_string()),
                )
            })
            .collect();
        let exports = Arc::new(Named(map));
        let (trigger, signal) = ShutdownSignal::new();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let l = tokio::net::UnixListener::from_std(listener).unwrap();
                Server::new(exports, ServerConfig::default())
                    .serve(Listener::Unix(l), signal)
                    .await
                    .unwrap();
            });
        });
        NamedServer {
            trigger: Some(trigger),
            thread: Some(thread),
            sock: sock.to_path_buf(),
        }
    }

    fn stop(&mut self) {
        if let Some(t) = self.trigger.take() {
            t.shutdown();
        }
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
        let _ = std::fs::remove_file(&self.sock);
    }
}

impl Drop for NamedServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn filled(byte: u8) -> Arc<MemoryDev> {
    let dev = MemoryDev::new(SIZE);
    dev.write_at(&vec![byte; SIZE as usize], 0, false).unwrap();
    Arc::new(dev)
}

fn target_endpoint(sock: &Path) -> Endpoint {
    let mut ep = Endpoint::at(Address::unix(sock), "target/vm1");
    ep.fallback = Some("vdisk/w".into());
    ep
}

fn first_byte(base: &RemoteBase) -> u8 {
    let mut b = [0u8; 512];
    base.read_at(&mut b, 0).unwrap();
    b[0]
}

#[test]
fn an_older_server_is_read_through_the_pinned_vdisk_export() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("old.sock");
    let (v3, v4) = (filled(3), filled(4));
    // A server without target/ID exports: the endpoint falls back to vdisk/w, pinned to @3.
    let mut s = NamedServer::start(
        &sock,
        &[
            ("vdisk/w", &v3, "vdisk/w@3 (production)"),
            ("vdisk/w@3", &v3, "vdisk/w@3 (production)"),
        ],
    );
    let base = RemoteBase::connect(
        vec![target_endpoint(&sock)],
        quick(Some(Duration::from_secs(5))),
    )
    .unwrap();
    assert_eq!(base.identity().export, "vdisk/w");
    assert_eq!(first_byte(&base), 3);
    // Production moves to 4 and the server restarts: the target keeps reading version 3.
    s.stop();
    let _s = NamedServer::start(
        &sock,
        &[
            ("vdisk/w", &v4, "vdisk/w@4 (production)"),
            ("vdisk/w@3", &v3, "vdisk/w@3 (test)"),
        ],
    );
    assert_eq!(first_byte(&base), 3);
    assert_eq!(base.counters().reconnects.load(Ordering::Relaxed), 1);
}

#[test]
fn target_exports_that_change_version_fall_back_to_the_pinned_one() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("new.sock");
    let (v3, v4) = (filled(3), filled(4));
    // Described as the store server describes a device type's target/ID (the contract's grammar).
    let mut s = NamedServer::start(
        &sock,
        &[(
            "target/vm1",
            &v3,
            "target/vm1@v3 vdisk/w@3 (ram-overflow cache on the target; read-only)",
        )],
    );
    let base = RemoteBase::connect(
        vec![target_endpoint(&sock)],
        quick(Some(Duration::from_secs(5))),
    )
    .unwrap();
    assert_eq!(base.identity().export, "target/vm1");
    assert_eq!(first_byte(&base), 3);
    // After a restart target/vm1 serves version 4: not this attach's; vdisk/w@3 is read.
    s.stop();
    let _s = NamedServer::start(
        &sock,
        &[
            (
                "target/vm1",
                &v4,
                "target/vm1@v4 vdisk/w@4 (ram-overflow cache on the target; read-only)",
            ),
            ("vdisk/w", &v4, "vdisk/w@4 (production)"),
            ("vdisk/w@3", &v3, "vdisk/w@3 (test)"),
        ],
    );
    assert_eq!(first_byte(&base), 3);
}

#[derive(Debug)]
struct Fixed(Vec<usize>);

impl Reorder for Fixed {
    fn reorder(&self, _failed: usize, _known: usize) -> Placement {
        Placement {
            added: Vec::new(),
            order: self.0.clone(),
        }
    }
}

#[test]
fn a_reconnect_follows_the_new_placement() {
    let dir = tempfile::tempdir().unwrap();
    let v = filled(7);
    let socks: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|n| dir.path().join(format!("{n}.sock")))
        .collect();
    let mut servers: Vec<_> = socks
        .iter()
        .map(|s| NamedServer::start(s, &[("vdisk/w@1", &v, "vdisk/w@1 (production)")]))
        .collect();
    let eps = socks
        .iter()
        .map(|s| Endpoint::at(Address::unix(s), "vdisk/w@1"))
        .collect();
    // Round-robin would go from a to b; the placement says c (the least busy), then a, then b.
    let base = RemoteBase::connect_with(
        eps,
        quick(Some(Duration::from_secs(5))),
        Some(Arc::new(Fixed(vec![2, 0, 1]))),
    )
    .unwrap();
    assert_eq!(base.endpoint_index(), 0);
    servers[0].stop();
    assert_eq!(first_byte(&base), 7);
    assert_eq!(base.endpoint_index(), 2);
    assert_eq!(base.counters().failovers.load(Ordering::Relaxed), 1);
}
