//! The HTTP API alone, on a store, with no NBD side (an empty session registry): for the
//! end-to-end tests of the API and of `vdstream … --server URL` (tests/e2e/test-api-*.sh)
//! until `vdstream server --http` serves both. Stop it with SIGTERM or SIGINT.
//!
//! ```text
//! http-api --store DIR [--http 127.0.0.1:0]     prints "listening on http://ADDR"
//! ```

use std::io::Write;
use std::net::TcpListener;

use vdstream_server::state::ServerState;
use vdstream_server::ServerOptions;

fn main() {
    let mut store = None;
    let mut http = "127.0.0.1:8480".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next()) {
            ("--store", Some(v)) => store = Some(v),
            ("--http", Some(v)) => http = v,
            _ => {
                eprintln!("usage: http-api --store DIR [--http ADDR]");
                std::process::exit(2);
            }
        }
    }
    let Some(store) = store else {
        eprintln!("usage: http-api --store DIR [--http ADDR]");
        std::process::exit(2);
    };
    let listener = TcpListener::bind(&http).unwrap_or_else(|e| {
        eprintln!("http-api: cannot listen on {http}: {e}");
        std::process::exit(1);
    });
    let state = ServerState::new(&ServerOptions {
        store: store.into(),
        listen: None,
        socket: None,
        read_cache: 0,
        name: Some(format!("http-api:{}", std::process::id())),
        stats_file: None,
        threads: 1,
    });
    let handle = vdstream_server::http::spawn(listener, state).unwrap_or_else(|e| {
        eprintln!("http-api: cannot start: {e}");
        std::process::exit(1);
    });
    println!("listening on http://{}", handle.local_addr());
    let _ = std::io::stdout().flush();
    loop {
        std::thread::park();
    }
}
