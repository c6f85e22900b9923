//! vhost-user-blk: a VM on the agent's host reaches its target's disk (the write cache)
//! through shared memory, with no socket hop per request. qemu (`vhost-user-blk-pci`),
//! cloud-hypervisor and libblkio are the frontends; this crate is the backend, on
//! rust-vmm's `vhost-user-backend`, `virtio-queue` and `vm-memory`.
//!
//! ```text
//!   guest virtio-blk driver ──virtqueues in shared memory──▶ queue threads ──▶ BlockDev
//!        qemu ──── vhost-user socket (memory table, kicks, calls) ────▶ VhostServer
//! ```
//!
//! Pieces: [`config`] (features and configuration space from the device's caps),
//! [`request`] (one descriptor chain, parsed and carried out; the part a hostile frontend
//! reaches), [`backend`] (the device a frontend connection gets, its queue threads) and
//! [`server`] (the socket, one frontend after another). [`driver`] is the other side of
//! a split virtqueue, for tests and fuzzing.

pub mod backend;
pub mod config;
pub mod dirty;
pub mod driver;
pub mod request;
pub mod server;

pub use config::Options;
pub use server::{ServerFigures, VhostServer};
