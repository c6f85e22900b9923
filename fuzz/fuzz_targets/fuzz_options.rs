//! Fuzzes the handshake: the pure option payload parsers, then the whole handshake state
//! machine fed an arbitrary client byte stream over a unix socket pair.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vdstream_nbd::options;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let _ = options::parse_export_name(data);
    let _ = options::parse_empty(data);
    let _ = options::parse_info_request(data);
    if let Ok(req) = options::parse_meta_context_request(data) {
        let _ = options::selects_base_allocation(&req, true);
        let _ = options::selects_base_allocation(&req, false);
    }
    // The whole handshake, fed as the client's bytes (client flags first).
    common::run_connection(data);
});
