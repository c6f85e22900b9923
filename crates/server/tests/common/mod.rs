//! What several server test binaries share: a logger that keeps every line of the test
//! process (the server's included), for tests that look at what was, or was not, logged;
//! and an NBD server of some exports on a unix socket. Each test binary uses some of it.
#![allow(dead_code)]

use std::sync::{Arc, Mutex, OnceLock};

use vdstream_nbd::server::{Exports, Listener, Server, ServerConfig, ShutdownSignal};

/// Serves `exports` on a new unix socket at `socket`, on `rt`, until the runtime is dropped.
pub fn serve_exports(
    rt: &tokio::runtime::Runtime,
    exports: Arc<dyn Exports>,
    socket: &std::path::Path,
) {
    let server = Arc::new(Server::new(exports, ServerConfig::default()));
    let listener = rt
        .block_on(async { tokio::net::UnixListener::bind(socket) })
        .unwrap();
    let (trigger, shutdown) = ShutdownSignal::new();
    std::mem::forget(trigger); // serves until the runtime is dropped
    rt.spawn(async move { server.serve(Listener::Unix(listener), shutdown).await });
}

/// Every log line of this test process, at `level` and above, as `LEVEL target: text`.
pub struct Capture(pub Mutex<Vec<String>>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, r: &log::Record<'_>) {
        self.0
            .lock()
            .unwrap()
            .push(format!("{} {}: {}", r.level(), r.target(), r.args()));
    }
    fn flush(&self) {}
}

/// The process's capturing logger, installed by the first call (at `level`; later calls
/// keep the first level).
pub fn captured(level: log::LevelFilter) -> &'static Capture {
    static LOG: OnceLock<&'static Capture> = OnceLock::new();
    LOG.get_or_init(|| {
        let c: &'static Capture = Box::leak(Box::new(Capture(Mutex::new(Vec::new()))));
        log::set_logger(c).unwrap();
        log::set_max_level(level);
        c
    })
}
