//! HTTP/1.1 for vdstream's API, on std only: [`wire`] reads and writes messages with
//! every size bounded before anything is allocated, and [`client`] is the blocking JSON
//! client the CLI (`--server URL`) and the agent use. The server's routes and handlers
//! live in `vdstream-server` (`http/`); this crate knows nothing of vDisks or targets.
//!
//! Why a crate of its own: the server, the CLI and the agent all speak this protocol, and
//! the agent must not depend on the server (nor the server on the agent). Why not an HTTP
//! library: the API needs a few fixed routes, JSON bodies and Content-Length framing; a
//! hand-written reader with explicit limits is small, builds with the workspace's Rust,
//! and its malformed-input behaviour is tested here and in the server.

pub mod client;
pub mod wire;

pub use client::{Client, ClientError};
