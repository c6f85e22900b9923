//! What the API's handlers share ([`Shared`]: the server's state and the live figures),
//! who sent a request ([`ClientAddr`]), and [`blocking`], which runs store work off the
//! runtime's workers.

use std::net::SocketAddr;
use std::sync::Arc;

use super::error::ApiError;
use super::live::Live;
use crate::state::ServerState;

/// What the API's tasks share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub state: Arc<ServerState>,
    pub live: Live,
}

/// The address of the client of a request (ip:port), for the audit trail; every request
/// carries it (the connection task puts it in the request's extensions).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClientAddr(pub SocketAddr);

/// Runs `f` on the blocking pool (the store's functions block on files and locks).
pub(crate) async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, ApiError> + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| Err(ApiError::new(500, format!("the handler failed: {e}"), "this is a bug in vdstream; see the server's log and report it")))
}
