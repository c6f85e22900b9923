//! What a mirror of a store in object storage needs to send its API's changes to the
//! store's metadata writer: the request, the answer and the [`Forward`] that carries them
//! (made by the binary, which knows where the writer is). The middleware that uses them
//! is `http::forward`.

use std::sync::Arc;

/// A change to send to the writer.
#[derive(Debug, Clone)]
pub struct ForwardRequest {
    pub method: String,
    /// Path and query (`/api/v1/vdisks/golden/revert`).
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// The writer's answer.
#[derive(Debug, Clone)]
pub struct ForwardAnswer {
    pub status: u16,
    pub content_type: Option<String>,
    pub etag: Option<String>,
    pub body: Vec<u8>,
    /// The writer's URL, for the log.
    pub writer: String,
}

/// Why a change has no answer from the writer.
#[derive(Debug, Clone)]
pub enum ForwardError {
    /// It was not sent (no writer named, not reachable, not a safe URL): nothing changed.
    NotSent(String),
    /// It was sent and the answer was lost (timeout, broken connection): the writer may
    /// have made it.
    Unknown(String),
}

/// Sends a change to the store's metadata writer (blocking; run off the runtime).
pub trait Forward: Send + Sync {
    fn forward(&self, req: ForwardRequest) -> Result<ForwardAnswer, ForwardError>;
}

/// The server's forwarder (`None`: this server changes its own store).
#[derive(Clone)]
pub struct Forwarder(pub Arc<dyn Forward>);

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Forwarder")
    }
}
