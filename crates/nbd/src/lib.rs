//! The NBD protocol for vdstream: constants, wire codec, the server session and an async
//! client. This crate knows the [`vdstream_blockdev::BlockDev`] trait and nothing of how any
//! device stores bytes.
//!
//! Server side, by protocol phase: [`wire`] (byte layouts), [`options`] (option payload
//! parsers), [`handshake`] (option haggling), [`flags`] (what is advertised, from `Caps`),
//! [`validate`] (every request checked once at the edge), `exec` (running a request and
//! encoding its reply), `session` (the transmission loop), [`errno`] (the one error → wire
//! code mapping) and [`server`] (the public API, accept loop and drain). Failures a client
//! can provoke are logged through [`lograte`] (the workspace's one rate limiter, from
//! vdstream-blockdev).

pub mod client;
pub mod errno;
mod exec;
pub mod flags;
pub mod handshake;
pub use vdstream_blockdev::lograte;
pub mod options;
pub mod proto;
pub mod server;
mod session;
pub mod validate;
pub mod wire;

/// An export name as logs and published lists may show it: without the credential that a
/// client may append after [`client::SECRET_SEPARATOR`] (`target/vm1@A#SECRET`).
pub fn shown_export_name(name: &str) -> &str {
    name.split_once(client::SECRET_SEPARATOR).map_or(name, |(n, _)| n)
}

pub use server::{ExportInfo, Exports, Listener, OpenError, OpenPurpose, OpenRequest, OpenedExport, Server, ServerConfig, ServerStats, ShutdownSignal, ShutdownTrigger};
