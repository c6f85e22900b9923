//! A mirror of a store in object storage sends the API's changes to the store's metadata
//! writer (see `vdstream_objstore::writer`): every request that is not GET or HEAD under
//! `/api/v1/`, except an agent's report (this server's own live state), after this server
//! has authorized it. The writer decides (its store lock orders every change; `If-Match`
//! is checked there) and its answer is relayed as it came, status and document; the
//! mirror's metadata catches up within a few seconds.
//!
//! The caller's `Authorization`, `Content-Type`, `If-Match` and `Accept` go along (the
//! servers of one store share their API tokens); the writer's audit trail names this
//! server's address as the client.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::auth::Caller;
use super::error::ApiError;
use super::limits::MAX_BODY;
use super::shared::{blocking, Shared};

pub use crate::forwarding::{Forward, ForwardAnswer, ForwardError, ForwardRequest, Forwarder};

const SENT_ALONG: [header::HeaderName; 4] = [
    header::AUTHORIZATION,
    header::CONTENT_TYPE,
    header::IF_MATCH,
    header::ACCEPT,
];

/// Whether `path` is an agent's report (`/api/v1/targets/{id}/agent`), which stays here.
fn agent_report(path: &str) -> bool {
    path.strip_prefix("/api/v1/targets/")
        .and_then(|r| r.strip_suffix("/agent"))
        .is_some_and(|id| !id.is_empty() && !id.contains('/'))
}

/// The middleware (inside authorization and the API's limits): forwards a change when
/// this server has a forwarder.
pub(crate) async fn changes_to_writer(
    State(s): State<Arc<Shared>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(Forwarder(f)) = s.state.forward.clone() else {
        return next.run(req).await;
    };
    let path = req.uri().path().to_string();
    if matches!(*req.method(), Method::GET | Method::HEAD)
        || !path.starts_with("/api/v1/")
        || agent_report(&path)
        || path.starts_with("/api/v1/server/")
    {
        return next.run(req).await;
    }
    // A token travels with the change; a certificate's identity cannot (the writer sees
    // this server's connection, not the caller's certificate).
    if matches!(req.extensions().get::<Caller>(), Some(Caller::Cert(_))) {
        return ApiError::new(
            403,
            "this server is a mirror of a store in object storage: a change made by certificate identity cannot be forwarded to its metadata writer",
            "send the change to the metadata writer's API directly, or use an API token (`vdstream token add`)",
        )
        .into_response();
    }
    let (parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(b) => b.to_vec(),
        Err(_) => {
            return ApiError::new(
                413,
                "the request body is too large",
                format!("send at most {MAX_BODY} bytes"),
            )
            .into_response()
        }
    };
    let headers = SENT_ALONG
        .iter()
        .filter_map(|h| {
            parts
                .headers
                .get(h)
                .and_then(|v| v.to_str().ok())
                .map(|v| (h.as_str().to_string(), v.to_string()))
        })
        .collect();
    let fr = ForwardRequest {
        method: parts.method.to_string(),
        path: parts
            .uri
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or(path.clone()),
        headers,
        body,
    };
    let (method, shown) = (fr.method.clone(), path.clone());
    let sent = blocking(move || {
        f.forward(fr).map_err(|e| match e {
            ForwardError::NotSent(m) => ApiError::new(
                503,
                m,
                "start the store's metadata writer (`vdstream server --store s3://… --metadata-writer`) or let it be reached; nothing was changed",
            ),
            ForwardError::Unknown(m) => ApiError::new(
                504,
                format!("the change was sent to the metadata writer, but its answer was lost ({m})"),
                "it may have been made: read the vDisk (or target) again before you send it once more",
            ),
        })
    })
    .await;
    match sent {
        Ok(a) => {
            log::info!(
                "HTTP API: {method} {shown} sent to the metadata writer {}: {}",
                a.writer,
                a.status
            );
            let mut r = Response::new(Body::from(a.body));
            *r.status_mut() = StatusCode::from_u16(a.status).unwrap_or(StatusCode::BAD_GATEWAY);
            if let Some(ct) = a.content_type.and_then(|c| c.parse().ok()) {
                r.headers_mut().insert(header::CONTENT_TYPE, ct);
            }
            if let Some(e) = a.etag.and_then(|c| c.parse().ok()) {
                r.headers_mut().insert(header::ETAG, e);
            }
            r
        }
        Err(e) => {
            log::warn!(
                "HTTP API: {method} {shown} could not be sent to the metadata writer: {}",
                e.error
            );
            e.into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_agents_reports_stay() {
        assert!(super::agent_report("/api/v1/targets/pc-01/agent"));
        for no in [
            "/api/v1/targets/agent",
            "/api/v1/targets//agent",
            "/api/v1/targets/a/b/agent",
            "/api/v1/vdisks/agent",
        ] {
            assert!(!super::agent_report(no), "{no}");
        }
    }
}
