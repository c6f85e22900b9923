//! The NBD protocol for vdstream: constants, wire codec, the server session and an async
//! client. This crate knows the [`vdstream_blockdev::BlockDev`] trait and nothing of how any
//! device stores bytes.
//!
//! Server side, by protocol phase: [`listen`] (binding over a stale socket, TCP dead-peer
//! options), [`wire`] (byte layouts), [`options`] (option payload parsers), [`handshake`]
//! (option haggling), [`flags`] (what is advertised, from `Caps`), [`validate`] (every
//! request checked once at the edge), `exec` (running a request and encoding its reply),
//! `session` (the one request core: parse → validate → execute → reply, with an inline,
//! batched or worker-pool executor), [`errno`] (the one error → wire code mapping),
//! [`state`] (the shared server state and public types: a leaf every other server module
//! may use) and [`server`] (the accept loop and drain), [`penalty`] (closing at accept the sources that keep failing handshakes), [`memory`] (the bound on request memory across all connections), `tlsio` (the transmission phase over TLS on blocking
//! threads: a reader and a writer sharing one rustls connection). The module-level `use crate::…`
//! graph is acyclic. Failures a client can provoke are logged through [`lograte`] (the
//! workspace's one rate limiter, from vdstream-blockdev).

pub mod client;
pub mod errno;
mod exec;
pub mod flags;
pub mod handshake;
pub mod listen;
pub mod memory;
pub use vdstream_blockdev::lograte;
pub mod options;
pub mod penalty;
pub mod proto;
pub mod server;
mod session;
pub mod state;
mod tlsio;
pub mod validate;
pub mod wire;

pub use vdstream_contract::name::shown_export_name;

pub use server::{
    ExportInfo, Exports, Listener, OpenError, OpenPurpose, OpenRequest, OpenedExport, Server,
    ServerConfig, ServerStats, ShutdownSignal, ShutdownTrigger, TlsMode,
};
