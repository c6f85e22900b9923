//! Fuzzes the transmission phase: request header parsing and validation as pure
//! functions, then a real session (the request core with its inline, worker-pool or
//! batched executor, simple or structured replies, chosen by the first byte) over a unix
//! socket pair with a memory device.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vdstream_blockdev::Caps;
use vdstream_nbd::flags::transmission_flags;
use vdstream_nbd::validate::{validate, ExportParams};
use vdstream_nbd::wire::{RequestHeader, REQUEST_HEADER_LEN};

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let caps = Caps { read_only: mode & 4 != 0, flush: true, fua: true, trim: true, zeroes: true, fast_zero: true,
        cache: true, block_status: true, multi_conn: true, may_block: false, preferred_block: 4096 };
    let x = ExportParams { size: 1 << 20, flags: transmission_flags(&caps, mode & 2 != 0), structured: mode & 2 != 0, base_allocation: mode & 8 != 0 };
    for chunk in rest.chunks(REQUEST_HEADER_LEN) {
        if let Some(h) = RequestHeader::parse(chunk) {
            if let Ok(req) = validate(&h, &x) {
                // What validation lets through is inside the export.
                assert!(req.offset.checked_add(req.length as u64).is_some_and(|end| end <= x.size));
            }
        }
    }
    let export = match mode & 0x11 {
        0 => "a",
        0x10 => "c",
        _ => "b",
    };
    let mut stream = common::handshake_prefix(export, mode & 2 != 0);
    stream.extend_from_slice(rest);
    common::run_connection(&stream);
});
