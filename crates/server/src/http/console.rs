//! The console: a page for the farm at `/console` (`/` leads there), in the browser of an
//! operator. Its three files (console/) are compiled into the binary: no CDN, no network
//! at run time, no build step. They hold no data: the page's script reads the API with the
//! operator's credential (a bearer token it asks for when the API answers 401, kept in the
//! tab's sessionStorage, or none on an open API), and follows `GET /api/v1/events` for
//! live figures. So these routes sit outside the API's authorization, like the boot
//! service's, and every answer of them is the same for everyone.
//!
//! Headers: a Content-Security-Policy that lets the page load only its own script and
//! style and talk only to this server (no inline script, no frames), `nosniff`, no
//! referrer, and `no-cache` (a new binary's page is fetched anew).

use axum::http::{header, HeaderName, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

const INDEX: &str = include_str!("console/index.html");
const SCRIPT: &str = include_str!("console/app.js");
const STYLE: &str = include_str!("console/app.css");

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let headers: [(HeaderName, &'static str); 5] = [
        (header::CONTENT_TYPE, content_type),
        (header::CACHE_CONTROL, "no-cache"),
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
    ];
    (StatusCode::OK, headers, body).into_response()
}

/// The console's routes in front of `app`, which answers every other path.
pub(crate) fn router(app: Router) -> Router {
    Router::new()
        .route("/", get(|| async { Redirect::to("/console") }))
        .route(
            "/console",
            get(|| async { asset("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/console/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/console/app.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
        .fallback_service(app)
}
