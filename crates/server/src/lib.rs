//! The vdstream server: one process on the store that serves every vDisk version and every
//! target over NBD, keeps one shared read cache for all of them, and answers the HTTP API.
//!
//! [`state`] is the live picture both halves share: the NBD side registers a
//! [`state::Session`] per connection and counts its I/O; the HTTP side reads them.

pub mod http;
pub mod state;
