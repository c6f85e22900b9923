//! What the API's handlers share ([`Shared`]: the server's state, the live figures and the
//! tokens), who sent a request ([`ClientAddr`], [`PeerIdentity`]), and [`blocking`], which
//! runs store work off the runtime's workers.

use std::net::SocketAddr;
use std::sync::Arc;

use super::error::ApiError;
use super::failures::AuthFailures;
use super::live::Live;
use crate::state::ServerState;
use crate::tokens::TokenFile;

/// What the API's tasks share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub state: Arc<ServerState>,
    pub live: Live,
    /// The store's API tokens (re-read when the file changes).
    pub tokens: TokenFile,
    /// Failed authentications: logged, counted, and penalized per address.
    pub failures: AuthFailures,
    /// The API listens on a loopback address.
    pub loopback: bool,
    /// The API serves TLS.
    pub tls: bool,
    /// Where the API listens (the boot service names the server by it when a request
    /// has no `Host`).
    pub local: SocketAddr,
    /// Places for the boot service's file transfers (boot.rs: `MAX_BOOT_TRANSFERS`), each
    /// held until its body is sent.
    pub boot_transfers: Arc<tokio::sync::Semaphore>,
}

impl Shared {
    /// Whether a request without a credential is a local user's (may do everything): the
    /// API is on loopback, without TLS, and no token was ever made in the store.
    pub fn open(&self) -> bool {
        self.loopback && !self.tls && !self.tokens.exists()
    }
}

/// The identity of a TLS connection's verified client certificate (absent without TLS or
/// without a certificate); the connection task puts it in each request's extensions.
#[derive(Debug, Clone)]
pub(crate) struct PeerIdentity(pub vdstream_contract::Identity);

/// The address of the client of a request (ip:port), for the audit trail; every request
/// carries it (the connection task puts it in the request's extensions).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClientAddr(pub SocketAddr);

/// Who made a request, as the audit trail records it: `IP:PORT`, and the caller when it is
/// not a local user of an open API (`IP:PORT token:NAME (ROLE)`, `IP:PORT target:ID`).
/// auth.rs puts it in the extensions of every request it lets through.
#[derive(Debug, Clone)]
pub(crate) struct AuditClient(pub String);

/// Runs `f` on the blocking pool (the store's functions block on files and locks).
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(ApiError::new(
            500,
            format!("the handler failed: {e}"),
            "this is a bug in vdstream; see the server's log and report it",
        ))
    })
}
