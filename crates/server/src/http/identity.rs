//! The identity routes (`vdstream server --identity-ca DIR`; the service is crate::identity):
//! a booting machine has no credential yet, so these need none, like the boot routes; what
//! they give is worth nothing without the machine's TPM.
//!
//! | route | answer |
//! |---|---|
//! | `POST /boot/identity/{id}/challenge` | a credential for the machine's identity key under its endorsement key, and a nonce (JSON `Challenge`) |
//! | `POST /boot/identity/{id}/prove` | 200 `approved` with a certificate, 202 `pending`, 403 refused (JSON `ProofAnswer`, or an error) |
//!
//! Invariants:
//! - Bodies are JSON of at most [`MAX_IDENTITY_BODY`] bytes; at most
//!   [`MAX_IDENTITY_IN_FLIGHT`] requests are in handlers at once (more wait).
//! - Every refusal is logged (rate-limited) and counted; a refused proof for an enrolled
//!   target is audited by the store.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::ServiceBuilder;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use vdstream_contract::enrolment::{ChallengeRequest, ProofRequest};
use vdstream_store::Store;

use super::shared::{ClientAddr, Shared};
use crate::identity::{IdentityError, IdentityService};

/// Largest request body: two TPM public areas, a key and a signature, in base64.
pub const MAX_IDENTITY_BODY: usize = 16 << 10;
/// Identity requests in handlers at once, at most.
pub const MAX_IDENTITY_IN_FLIGHT: usize = 32;
/// The longest an identity handler may take (503 past it).
const IDENTITY_TIMEOUT: Duration = Duration::from_secs(60);

/// The identity routes on `shared`, in front of `next`.
pub(crate) fn router(shared: Arc<Shared>, next: Router) -> Router {
    let layers = ServiceBuilder::new()
        .layer(GlobalConcurrencyLimitLayer::new(MAX_IDENTITY_IN_FLIGHT))
        .layer(RequestBodyLimitLayer::new(MAX_IDENTITY_BODY))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            IDENTITY_TIMEOUT,
        ));
    Router::new()
        .route("/boot/identity/{id}/challenge", post(challenge))
        .route("/boot/identity/{id}/prove", post(prove))
        .layer(layers)
        .with_state(shared)
        .fallback_service(next)
}

fn service(s: &Shared) -> &IdentityService {
    s.state
        .identity
        .as_ref()
        .expect("identity routes exist only with an identity service")
}

fn error(s: &Shared, e: &IdentityError, peer: std::net::SocketAddr) -> Response {
    let (status, what_to_do) = match e {
        IdentityError::BadRequest(_) => (
            StatusCode::BAD_REQUEST,
            "the machine's agent sends these; see docs/IDENTITY.md",
        ),
        IdentityError::Refused(_) => (
            StatusCode::FORBIDDEN,
            "an administrator checks `vdstream target identity list` and the server's log",
        ),
        IdentityError::Server(_) => (StatusCode::INTERNAL_SERVER_ERROR, "see the server's log"),
    };
    if !matches!(e, IdentityError::Refused(_)) {
        // Refusals are logged by the service; the rest here, rate-limited per kind.
        s.state.log.log(
            log::Level::Warn,
            module_path!(),
            "identity-error",
            format_args!("identity: a request from {peer} failed: {e}"),
        );
    }
    (
        status,
        Json(serde_json::json!({"error": e.to_string(), "what_to_do": what_to_do})),
    )
        .into_response()
}

/// `POST /boot/identity/ID/challenge`.
async fn challenge(
    State(s): State<Arc<Shared>>,
    Extension(ClientAddr(peer)): Extension<ClientAddr>,
    Path(id): Path<String>,
    body: Result<Json<ChallengeRequest>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let req = match body {
        Ok(Json(r)) => r,
        Err(e) => return error(&s, &IdentityError::BadRequest(e.body_text()), peer),
    };
    let (s2, id2) = (s.clone(), id.clone());
    // The target must have a record: made-up ids get no challenge to fill the memory with.
    let found = tokio::task::spawn_blocking(move || {
        Store::open(&s2.state.store).and_then(|st| st.target(&id2).map(drop))
    })
    .await;
    match found {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return error(&s, &IdentityError::from(e), peer),
        Err(e) => {
            return error(
                &s,
                &IdentityError::Server(format!("the handler failed: {e}")),
                peer,
            )
        }
    }
    match service(&s).challenge(&id, &req) {
        Ok(c) => (StatusCode::OK, Json(c)).into_response(),
        Err(e) => error(&s, &e, peer),
    }
}

/// `POST /boot/identity/ID/prove`.
async fn prove(
    State(s): State<Arc<Shared>>,
    Extension(ClientAddr(peer)): Extension<ClientAddr>,
    Path(id): Path<String>,
    body: Result<Json<ProofRequest>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let req = match body {
        Ok(Json(r)) => r,
        Err(e) => return error(&s, &IdentityError::BadRequest(e.body_text()), peer),
    };
    let s2 = s.clone();
    let answer = tokio::task::spawn_blocking(move || {
        let store = Store::open(&s2.state.store).map_err(IdentityError::from)?;
        service(&s2).prove(&store, &id, &req, None, &peer.to_string())
    })
    .await;
    match answer {
        Ok(Ok(a)) => {
            let status = match a.state {
                vdstream_contract::enrolment::EnrolmentState::Approved => StatusCode::OK,
                _ => StatusCode::ACCEPTED,
            };
            (status, Json(a)).into_response()
        }
        Ok(Err(e)) => error(&s, &e, peer),
        Err(e) => error(
            &s,
            &IdentityError::Server(format!("the handler failed: {e}")),
            peer,
        ),
    }
}
