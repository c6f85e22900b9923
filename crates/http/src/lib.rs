//! HTTP/1.1 for vdstream's API clients, on std only: [`client`] is the blocking JSON
//! client the CLI (`--server URL`) and the agent use, and [`wire`] reads and writes
//! messages with every size bounded before anything is allocated (the client reads its
//! answers with it). The server itself runs on axum/hyper (`vdstream-server`, `http/`);
//! its handlers take the [`wire::Request`] shape. This crate knows nothing of vDisks or
//! targets.
//!
//! Why a crate of its own: the CLI and the agent both call the API, and the agent must
//! not depend on the server (nor the server on the agent). Why a blocking client rather
//! than an async library: its callers are synchronous, it needs a few JSON calls with
//! timeouts, and it keeps an HTTP stack out of the agent.

pub mod client;
pub mod wire;

pub use client::{Client, ClientError};
