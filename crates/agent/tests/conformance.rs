//! The blockdev conformance suite and model checks on RemoteBase, each device a fresh
//! connection to the real vdstream NBD server (in-process, on a unix socket) over a
//! memory device: writable as the `server` cache types open it, and read-only as the
//! other types do.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use vdstream_agent::RemoteOptions;
use vdstream_blockdev::conformance::{self, model};
use vdstream_blockdev::{BlockDev, MemoryDev};

/// Starts a server per device and keeps them all running until the test ends.
struct Servers {
    dir: tempfile::TempDir,
    running: Mutex<Vec<TestServer>>,
    next: AtomicUsize,
}

impl Servers {
    fn new() -> Servers {
        Servers {
            dir: tempfile::tempdir().unwrap(),
            running: Mutex::new(Vec::new()),
            next: AtomicUsize::new(0),
        }
    }

    /// A RemoteBase on a new server exporting `dev`.
    fn remote(&self, dev: Arc<dyn BlockDev>, writable: bool) -> Arc<dyn BlockDev> {
        let sock = self.dir.path().join(format!(
            "{}.sock",
            self.next.fetch_add(1, Ordering::Relaxed)
        ));
        let server = TestServer::start(&sock, dev, "target/t1");
        let base = connect(
            &[server.uri()],
            RemoteOptions {
                writable,
                ..quick(None)
            },
        );
        self.running.lock().unwrap().push(server);
        Arc::new(base)
    }
}

#[test]
fn a_writable_remote_base_conforms_and_matches_the_model() {
    let servers = Servers::new();
    let make = |size| servers.remote(Arc::new(MemoryDev::new(size)), true);
    conformance::run_all("RemoteBase(writable)", &make);
    model::model_check(
        "RemoteBase(writable)",
        &make,
        model::ModelConfig {
            cases: 16,
            ..Default::default()
        },
    );
    model::model_check_concurrent(
        "RemoteBase(writable)",
        &make,
        model::ModelConfig {
            cases: 8,
            ..Default::default()
        },
    );
}

#[test]
fn a_read_only_remote_base_conforms() {
    let servers = Servers::new();
    conformance::run_read_only("RemoteBase(read-only)", &|content| {
        let dev = MemoryDev::new(content.len() as u64);
        dev.write_at(content, 0, false).unwrap();
        servers.remote(Arc::new(dev), false)
    });
}
