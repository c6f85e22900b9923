//! The API's routes and the tower layers around them. [`table`] is the one list: each
//! route comes from its handler's `#[utoipa::path]` (utoipa-axum's `routes!`), which gives
//! the router its method and path and the OpenAPI document ([`openapi`], openapi.rs) the
//! operation, its parameters, body and answers, so the two cannot drift apart. The
//! document is served at `/api/v1/openapi.json` and kept in docs/openapi.json, which a
//! test compares with it.
//!
//! Layers, outermost first (each request): the error document for every bare answer of
//! 400 and over (error.rs), the head checks, the caller and its role (auth.rs: 401/403
//! before anything else is done), at most [`MAX_IN_FLIGHT`] requests in
//! handlers (more wait), the body limit ([`MAX_BODY`], by `Content-Length` before
//! anything is read; [`MAX_AGENT_REPORT`] on the agent route), and [`HANDLER_TIMEOUT`]
//! (503). On a mirror of a store in object storage the changes go to its metadata writer
//! (forward.rs) inside the concurrency limit, with their own body cap and the relay's
//! timeout (as long as the handlers').
//! A path no route matches is 404, one matched with another method 405 with `Allow`;
//! a trailing `/` is ignored (the connection task strips it before routing).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, Method, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json, Router};
use serde_json::Value;
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::ServiceBuilder;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use vdstream_contract::server::{BalanceDoc, FarmDoc, ServerDoc};
use vdstream_contract::status::Status;

use super::documents::{Error, ReportAccepted, SessionDoc};
use super::error::{check_head, json_errors, ApiError, JsonBody, Param};
use super::limits::{HANDLER_TIMEOUT, MAX_AGENT_REPORT, MAX_BODY, MAX_IN_FLIGHT};
use super::openapi as spec;
use super::shared::{blocking, ClientAddr, Shared};
use super::{auth, boot, console, events, forward, identity, live, metrics, store};

/// Every route of the API, each from its handler's `#[utoipa::path]`: the method, path and
/// handler the router answers with are those the OpenAPI document describes.
fn table() -> OpenApiRouter<Arc<Shared>> {
    let (schemas, paths, report) = routes!(agent_report);
    OpenApiRouter::with_openapi(spec::base())
        .routes(routes!(server))
        .routes(routes!(server_drain))
        .routes(routes!(server_resume))
        .routes(routes!(farm))
        .routes(routes!(store::target_placement))
        .routes(routes!(store::vdisk_list))
        .routes(routes!(store::vdisk_show))
        .routes(routes!(store::version_list, store::version_new))
        .routes(routes!(store::version_promote))
        .routes(routes!(store::version_revert))
        .routes(routes!(store::version_merge))
        .routes(routes!(store::audit_list))
        .routes(routes!(store::target_list, store::target_add))
        .routes(routes!(
            store::target_show,
            store::target_set,
            store::target_remove
        ))
        .routes(routes!(store::identity_list))
        .routes(routes!(store::identity_show))
        .routes(routes!(store::identity_approve))
        .routes(routes!(store::identity_revoke))
        // An agent report's own body limit, below MAX_BODY.
        .routes((
            schemas,
            paths,
            report.layer(RequestBodyLimitLayer::new(MAX_AGENT_REPORT)),
        ))
        .routes(routes!(sessions))
        .routes(routes!(events::stream))
        .routes(routes!(metrics_text))
        .routes(routes!(openapi_json))
}

/// The API's OpenAPI document (`GET /api/v1/openapi.json`, docs/openapi.json).
pub fn openapi() -> utoipa::openapi::OpenApi {
    spec::finish(table().into_openapi())
}

/// [`openapi`] as the JSON text docs/openapi.json holds, made once.
pub fn openapi_text() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| {
        let mut t = openapi()
            .to_pretty_json()
            .expect("the OpenAPI document serializes");
        t.push('\n');
        t
    })
}

#[utoipa::path(
    get,
    path = "/api/v1/openapi.json",
    summary = "This API's OpenAPI document",
    description = "Generated from the server's typed handlers and answers; docs/openapi.json is the same document.",
    responses((status = 200, description = "The OpenAPI 3.1 document.", body = serde_json::Value))
)]
async fn openapi_json() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], openapi_text())
}

/// Every (path pattern, method) the router answers (besides HEAD for each GET).
pub fn routes() -> Vec<(String, Method)> {
    let mut out = Vec::new();
    for (path, item) in table().into_openapi().paths.paths {
        for (method, op) in [
            (Method::GET, &item.get),
            (Method::PUT, &item.put),
            (Method::POST, &item.post),
            (Method::DELETE, &item.delete),
        ] {
            if op.is_some() {
                out.push((path.clone(), method));
            }
        }
    }
    out
}

/// The API: the routes, the fallbacks and the layers, on `shared`; with a boot
/// configuration, the boot routes (boot.rs) in front of it, outside its layers; and the
/// console's page (console.rs) in front of both.
pub(crate) fn app(shared: Arc<Shared>) -> Router {
    let boot = shared.state.boot.is_some();
    let api = api(shared.clone());
    let api = if boot {
        boot::router(shared.clone(), api)
    } else {
        api
    };
    let api = if shared.state.identity.is_some() {
        identity::router(shared, api)
    } else {
        api
    };
    console::router(api)
}

fn api(shared: Arc<Shared>) -> Router {
    let layers = ServiceBuilder::new()
        .layer(middleware::map_response(json_errors))
        .layer(middleware::from_fn(head_checked))
        .layer(middleware::from_fn_with_state(
            shared.clone(),
            auth::authorize,
        ))
        .layer(GlobalConcurrencyLimitLayer::new(MAX_IN_FLIGHT))
        .layer(middleware::from_fn_with_state(
            shared.clone(),
            forward::changes_to_writer,
        ))
        .layer(RequestBodyLimitLayer::new(MAX_BODY))
        .layer(TimeoutLayer::with_status_code(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            HANDLER_TIMEOUT,
        ));
    let (router, _) = table().split_for_parts();
    router
        .fallback(not_found)
        .method_not_allowed_fallback(not_allowed)
        .layer(layers)
        .with_state(shared)
}

async fn head_checked(req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    match check_head(&parts) {
        Ok(()) => next.run(Request::from_parts(parts, body)).await,
        Err(e) => e.into_response(),
    }
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::new(
        404,
        format!("no API route {}", uri.path()),
        "the routes are listed in docs/openapi.json; they start with /api/v1/ (and /metrics)",
    )
}

/// (axum adds `Allow`.)
async fn not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        405,
        format!("{method} is not allowed on {}", uri.path()),
        "use a method the Allow field of this answer names",
    )
}

#[utoipa::path(
    get,
    path = "/api/v1/server",
    summary = "This server",
    responses((status = 200, description = "Who and where the server is.", body = ServerDoc))
)]
async fn server(
    State(s): State<Arc<Shared>>,
    caller: Option<Extension<auth::Caller>>,
) -> Json<ServerDoc> {
    let mut doc = live::server_doc(&s.state);
    if caller.is_some_and(|Extension(c)| c == auth::Caller::Booting) {
        // A machine without credentials learns where to connect, not where the store is.
        doc.store = String::new();
        doc.nbd.socket = None;
    }
    Json(doc)
}

#[utoipa::path(
    post,
    path = "/api/v1/server/drain",
    summary = "Drain this server without stopping it (`vdstream server drain`)",
    description = "The server takes no new connection and moves its targets to the other servers of its store at once, spread by their shares (each agent reconnects where it is told; no request is lost). Targets that cannot move (cache type `server`, or in their boot window) stay until they can; the next rounds move them. The server keeps running; `POST /api/v1/server/resume` takes it back into the farm. Audited as `server.drain`.",
    responses(
        (status = 200, description = "This server's part in rebalancing, now drained.", body = BalanceDoc),
        (status = 500, response = Error),
    )
)]
async fn server_drain(
    State(s): State<Arc<Shared>>,
    Extension(c): Extension<ClientAddr>,
) -> Result<Json<BalanceDoc>, ApiError> {
    drain_or_resume(s, c, true).await
}

#[utoipa::path(
    post,
    path = "/api/v1/server/resume",
    summary = "Take a drained server back into the farm (`vdstream server resume`)",
    description = "The server takes new connections again, and the next rebalancing round of a loaded server sends it its share. Audited as `server.resume`.",
    responses(
        (status = 200, description = "This server's part in rebalancing.", body = BalanceDoc),
        (status = 500, response = Error),
    )
)]
async fn server_resume(
    State(s): State<Arc<Shared>>,
    Extension(c): Extension<ClientAddr>,
) -> Result<Json<BalanceDoc>, ApiError> {
    drain_or_resume(s, c, false).await
}

async fn drain_or_resume(
    s: Arc<Shared>,
    c: ClientAddr,
    drain: bool,
) -> Result<Json<BalanceDoc>, ApiError> {
    blocking(move || {
        let state = &s.state;
        let was = state
            .balancer
            .drained
            .swap(drain, std::sync::atomic::Ordering::Relaxed);
        let action = if drain {
            "server.drain"
        } else {
            "server.resume"
        };
        if was != drain {
            log::info!(
                "{action}: {} by {}: {}",
                state.name,
                c.0,
                if drain {
                    "no new connections; moving every target to the other servers"
                } else {
                    "taking new connections again"
                }
            );
            vdstream_store::Store::open(&state.store)
                .map(|st| st.with_client(c.0.to_string()))
                .and_then(|st| {
                    st.audit_event(action, "", serde_json::json!({"server": state.name}))
                })?;
        }
        if drain {
            state.balancer.kick();
        }
        Ok(state.balancer.doc(state))
    })
    .await
    .map(Json)
}

#[utoipa::path(
    get,
    path = "/api/v1/farm",
    summary = "The servers of this store, their load and their shares",
    description = "As this server last read their heartbeats (`STORE/servers/`, every 2 s; a server silent for 10 s is left out): targets, sessions, guest I/O over the last minute, weight, and each one's fair share of the farm's targets.",
    responses((status = 200, description = "The farm.", body = FarmDoc))
)]
async fn farm(State(s): State<Arc<Shared>>) -> Json<FarmDoc> {
    Json(s.state.balancer.farm_doc(crate::state::unix_ms()))
}

#[utoipa::path(
    get,
    path = "/api/v1/sessions",
    summary = "Every live NBD session of this server",
    responses((status = 200, description = "Sessions, oldest first.", body = Vec<SessionDoc>))
)]
async fn sessions(State(s): State<Arc<Shared>>) -> Json<Vec<SessionDoc>> {
    Json(s.live.sessions_doc(&s.state))
}

#[utoipa::path(
    get,
    path = "/metrics",
    summary = "Prometheus metrics",
    description = "Text format 0.0.4: `vdstream_sessions`, `vdstream_server_draining`, `vdstream_server_start_time_seconds`; every session since the start `vdstream_{guest,store}_{read,write}_{ops,bytes}_total`; the shared read cache `vdstream_read_cache_{hits,misses,shared_loads,evictions}_total`, `vdstream_read_cache_used_bytes`, `vdstream_read_cache_capacity_bytes`; per session (labels session, target, export, vdisk, version) `vdstream_session_{guest,store}_{read,write}_{ops,bytes}_total`, `vdstream_session_cache_used_bytes`, and of a server-side write cache `vdstream_session_cache_{limit,fs_free,capacity}_bytes`, `vdstream_session_cache_used_percent` (of the capacity), `vdstream_session_cache_nospace_errors_total`; per target `vdstream_target_reconnects_total`; from agent reports (label target) `vdstream_agent_retries_total`, `vdstream_agent_reconnects_total`, `vdstream_agent_failovers_total`, `vdstream_agent_gave_up_total`, `vdstream_agent_cache_used_percent`, `vdstream_agent_guest_iops`, `vdstream_agent_connected`; with `--boot`, boot pacing `vdstream_boot_{max_booting,booting,booting_peak,waiting}` and `vdstream_boot_{admitted,waits,booted,expired}_total`; with `--identity-ca`, `vdstream_identity_{challenges,certified,pending,refused}_total`.",
    responses((status = 200, description = "The metrics.", body = String, content_type = "text/plain"))
)]
async fn metrics_text(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
        metrics::render(&s),
    )
}

#[utoipa::path(
    put,
    path = "/api/v1/targets/{id}/agent",
    summary = "An agent reports its status",
    description = "The body is the agent's status document (`vdstream target status ID --json`); its `target`, if present, must be ID (409 otherwise), a target with a record in the store (404 otherwise: `vdstream target add ID`). At most 64 KiB (413), 1,000 JSON values and 8 levels deep (400), and it must read as a Status (400). Only the latest report of a target is kept; a report older than 60 s is left out of every view and freed.",
    params(store::TargetPath),
    request_body = Status,
    responses(
        (status = 200, description = "Accepted.", body = ReportAccepted),
        (status = 404, response = Error),
        (status = 409, response = Error),
        (status = 500, response = Error),
    )
)]
async fn agent_report(
    State(s): State<Arc<Shared>>,
    Extension(c): Extension<ClientAddr>,
    Param(id): Param<String>,
    JsonBody(doc): JsonBody<Value>,
) -> Result<Json<ReportAccepted>, ApiError> {
    blocking(move || s.live.accept_report(&s.state, &id, c.0, doc))
        .await
        .map(Json)
}
