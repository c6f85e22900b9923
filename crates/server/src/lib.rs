//! The vdstream server: one process on the store that serves every vDisk version and every
//! target over NBD, keeps one shared read cache for all of them, and answers the HTTP API.
//!
//! ```text
//!   config.rs     ServerOptions; the --config TOML file (keys = flag names)
//!   state.rs      ServerState: sessions, counters, draining; shared by the NBD and HTTP halves
//!   policy.rs     who may open which export (Identity x ExportName -> allow, or the rule that refuses)
//!   refusal.rs    refused opens in the audit trail, rate-limited
//!   exports.rs    StoreExports: what each export name (vdstream_contract::ExportName, parsed at
//!                 the edge) opens, one chain per connection, and its description; SessionDev
//!   readcache.rs  the shared read cache in front of the layer files (per file, quick_cache, single flight)
//!   target.rs     lookup_target: a target's vDisk, version and cache, from the store
//!   nbd.rs        NbdService: listeners, serving, drain; the stats file
//!   object_store.rs  a store in object storage (s3://): its mirror or its metadata writer
//!   forwarding.rs a mirror's API changes sent to the metadata writer, and where they may go
//!   http/         the JSON HTTP API and /metrics (http::spawn), on the same ServerState
//!   tokens.rs     the API's bearer tokens: made, listed, revoked; kept hashed in the store
//!   writer_slot.rs  one writer at a time: an export's writer slot, freed with its device
//!   boot/         the boot service (--boot): iPXE scripts and kernel command lines, a version's
//!                 boot files (files.rs), TFTP for PXE ROMs (tftp.rs); served by http/boot.rs
//!   identity.rs   machine identity (--identity-ca): TPM challenges and proofs, enrolment,
//!                 certificates at boot; served by http/identity.rs
//! ```
//!
//! [`state`] is the live picture both halves share: the NBD side registers a
//! [`state::Session`] per connection and counts its I/O; the HTTP side reads them.
//! Starting a server: `let state = ServerState::new(&opts);` then
//! `NbdService::start(state.clone(), threads)` (and the HTTP API on the same `state`).

pub mod balance;
pub mod boot;
pub mod config;
pub mod exports;
pub mod forwarding;
pub mod http;
pub mod identity;
pub mod nbd;
pub mod object_store;
pub mod policy;
pub mod readcache;
pub mod rebalance;
pub mod refusal;
pub mod state;
pub mod target;
pub mod tokens;
pub mod writer_slot;

pub use config::{ConfigFile, ServerOptions, DEFAULT_READ_CACHE};
pub use nbd::NbdService;
pub use state::ServerState;
