//! The API's routes and the tower layers around them. [`table`] is the one list: it
//! builds the axum router and records each (path, method) it adds, which [`routes`]
//! exports so that a test compares it with docs/openapi.yaml both ways.
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
use axum::handler::Handler;
use axum::http::{header, Method, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{on, MethodFilter};
use axum::{Extension, Json, Router};
use serde_json::Value;
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::ServiceBuilder;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;

use super::error::{check_head, json_errors, ApiError, JsonBody, Param};
use super::limits::{HANDLER_TIMEOUT, MAX_AGENT_REPORT, MAX_BODY, MAX_IN_FLIGHT};
use super::shared::{blocking, ClientAddr, Shared};
use super::{auth, boot, console, events, forward, live, metrics, store};

/// The router being built and the routes added so far.
struct Table {
    router: Router<Arc<Shared>>,
    routes: Vec<(&'static str, Method)>,
}

impl Table {
    fn at<H: Handler<T, Arc<Shared>>, T: 'static>(
        self,
        method: Method,
        path: &'static str,
        h: H,
    ) -> Self {
        self.at_limited(method, path, h, MAX_BODY)
    }

    /// A route whose body limit is `limit` (below [`MAX_BODY`]).
    fn at_limited<H: Handler<T, Arc<Shared>>, T: 'static>(
        mut self,
        method: Method,
        path: &'static str,
        h: H,
        limit: usize,
    ) -> Self {
        let filter =
            MethodFilter::try_from(method.clone()).expect("axum routes every standard method");
        let mut route = on(filter, h);
        if limit < MAX_BODY {
            route = route.layer(RequestBodyLimitLayer::new(limit));
        }
        self.router = self.router.route(path, route);
        self.routes.push((path, method));
        self
    }
}

/// Every route of the API.
fn table() -> Table {
    Table {
        router: Router::new(),
        routes: Vec::new(),
    }
    .at(Method::GET, "/api/v1/server", server)
    .at(Method::GET, "/api/v1/vdisks", store::vdisk_list)
    .at(Method::GET, "/api/v1/vdisks/{name}", store::vdisk_show)
    .at(
        Method::GET,
        "/api/v1/vdisks/{name}/versions",
        store::version_list,
    )
    .at(
        Method::POST,
        "/api/v1/vdisks/{name}/versions",
        store::version_new,
    )
    .at(
        Method::POST,
        "/api/v1/vdisks/{name}/versions/{version}/promote",
        store::version_promote,
    )
    .at(
        Method::POST,
        "/api/v1/vdisks/{name}/revert",
        store::version_revert,
    )
    .at(
        Method::POST,
        "/api/v1/vdisks/{name}/merge",
        store::version_merge,
    )
    .at(Method::GET, "/api/v1/audit", store::audit_list)
    .at(Method::GET, "/api/v1/targets", store::target_list)
    .at(Method::POST, "/api/v1/targets", store::target_add)
    .at(Method::GET, "/api/v1/targets/{id}", store::target_show)
    .at(Method::PUT, "/api/v1/targets/{id}", store::target_set)
    .at(Method::DELETE, "/api/v1/targets/{id}", store::target_remove)
    .at_limited(
        Method::PUT,
        "/api/v1/targets/{id}/agent",
        agent_report,
        MAX_AGENT_REPORT,
    )
    .at(Method::GET, "/api/v1/sessions", sessions)
    .at(Method::GET, "/api/v1/events", events::stream)
    .at(Method::GET, "/metrics", metrics_text)
}

/// Every (path pattern, method) the router answers (besides HEAD for each GET).
pub fn routes() -> Vec<(&'static str, Method)> {
    table().routes
}

/// The API: the routes, the fallbacks and the layers, on `shared`; with a boot
/// configuration, the boot routes (boot.rs) in front of it, outside its layers; and the
/// console's page (console.rs) in front of both.
pub(crate) fn app(shared: Arc<Shared>) -> Router {
    let boot = shared.state.boot.is_some();
    let api = api(shared.clone());
    console::router(if boot { boot::router(shared, api) } else { api })
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
    table()
        .router
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
        "the routes are listed in docs/openapi.yaml; they start with /api/v1/ (and /metrics)",
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

async fn server(
    State(s): State<Arc<Shared>>,
    caller: Option<Extension<auth::Caller>>,
) -> Json<Value> {
    let mut doc = live::server_doc(&s.state);
    if caller.is_some_and(|Extension(c)| c == auth::Caller::Booting) {
        // A machine without credentials learns where to connect, not where the store is.
        doc["store"] = Value::String(String::new());
        doc["nbd"]["socket"] = Value::Null;
    }
    Json(doc)
}

async fn sessions(State(s): State<Arc<Shared>>) -> Json<Value> {
    Json(s.live.sessions_doc(&s.state))
}

async fn metrics_text(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
        metrics::render(&s),
    )
}

async fn agent_report(
    State(s): State<Arc<Shared>>,
    Extension(c): Extension<ClientAddr>,
    Param(id): Param<String>,
    JsonBody(doc): JsonBody<Value>,
) -> Result<Json<Value>, ApiError> {
    blocking(move || s.live.accept_report(&s.state, &id, c.0, doc))
        .await
        .map(Json)
}
