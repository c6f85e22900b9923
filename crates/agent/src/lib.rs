//! The target side of vdstream: `vdstream target attach`.
//!
//! An agent streams one vDisk from its servers, keeps the target's writes in a local write
//! cache, and offers the result to the target's OS or hypervisor as an NBD export on a
//! unix socket (qemu `-drive file=nbd+unix:///?socket=PATH`, `nbd-client -unix`, nbdfuse).
//!
//! ```text
//!   qemu / nbd-client / nbdfuse / fio
//!        │ NBD, unix socket (and optionally 127.0.0.1)
//!   vdstream_nbd::Server ─▶ WriteCache(type) ─▶ RemoteBase ══ NBD ══▶ server 1 | server 2 ...
//!                           (absent for the `server` types: RemoteBase forwards writes)
//! ```
//!
//! Modules: [`api`] (`--server http://`: the target's record, placement on the least
//! busy store server, status reports) over [`client`] (the API's JSON client, on ureq), [`endpoint`] (the servers to read from), [`remote`] (the remote base: cap on
//! requests in flight, reconnect with backoff, failover, re-send of unanswered requests),
//! [`attach`] (the stack, the local export, the drain), [`status`] (the figures the agent
//! publishes and `vdstream target status` shows), [`paths`] (where sockets, status files
//! and caches live by default), [`service`] (the agent run until a signal, or as the
//! daemon behind a kernel NBD device: [`daemon`]), [`identity`] (`--tpm`: the machine
//! proves its TPM identity and gets its certificate before it attaches).
//!
//! Invariants: the vDisk is never written unless the cache type is `server` or
//! `server-persistent` (then the server's own cache takes the writes); a non-persistent
//! cache starts empty on every attach; the guest never sees a connection loss, only a
//! pause, unless `--retry-for` runs out (then EIO, naming the servers).

pub mod api;
pub mod attach;
pub mod client;
pub mod daemon;
pub mod endpoint;
mod error;
pub mod identity;
pub mod kernel_nbd;
pub mod migrate;
pub mod paths;
pub mod remote;
pub mod service;
pub mod status;

pub use attach::{Agent, AttachConfig};
pub use endpoint::Endpoint;
pub use error::AgentError;
pub use remote::{Identity, RemoteBase, RemoteOptions};
pub use status::Status;
