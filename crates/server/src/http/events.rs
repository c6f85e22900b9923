//! `GET /api/v1/events`: the farm as server-sent events (`text/event-stream`), for the
//! console and for scripts that would otherwise poll. Each event is `event: farm` with one
//! JSON document:
//!
//! ```json
//! {"at_unix_ms": 1764000000000, "server": {…GET /server…}, "sessions": […GET /sessions…],
//!  "targets": [{…a target record…, "agent": {…its fresh report…},
//!               "boot": {"at_unix_ms": …, "what": "MAC from PEER: script for VDISK@VERSION"}}],
//!  "store_changes": 1234}
//! ```
//!
//! `store_changes` grows whenever the store changes (it is the audit trail's length in
//! bytes): a client re-reads vDisks and versions when it moves. `targets_error` is null,
//! or why the target records could not be read (`targets` is then empty).
//!
//! Cost: the document is built once a [`SAMPLE_EVERY`](super::live::SAMPLE_EVERY) tick,
//! on the blocking pool, and only while a stream is open; every stream sends the same
//! text. A new stream gets a document at once. At most [`MAX_EVENT_STREAMS`] streams are
//! open at a time (503 past it), and at most [`MAX_EVENT_STREAMS_PER_CALLER`] for one
//! caller (one token, one client certificate; 429 past it), so one credential cannot take
//! every place; a stream ends when its client goes or the API stops.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::Extension;
use futures_lite::Stream;
use tokio::sync::{watch, OwnedSemaphorePermit};
use vdstream_store::Store;

use super::auth::Caller;
use super::documents::{AgentReport, FarmEvent, FarmTarget};
use super::error::ApiError;
use super::limits::{MAX_EVENT_STREAMS, MAX_EVENT_STREAMS_PER_CALLER};
use super::live::Share;
use super::shared::{blocking, Shared};
use crate::state::unix_ms;

/// Builds the farm document (blocks: reads the store).
fn farm(s: &Shared) -> Result<FarmEvent, ApiError> {
    let store = Store::open(&s.state.store)?;
    let mut reports: std::collections::HashMap<String, AgentReport> =
        s.live.agent_reports().into_iter().collect();
    let (records, targets_error) = match store.targets() {
        Ok(r) => (r, None),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };
    let targets = records
        .into_iter()
        .map(|record| FarmTarget {
            agent: reports.remove(&record.id),
            boot: s.live.last_boot(&record.id),
            record,
        })
        .collect();
    let store_changes = std::fs::metadata(store.audit_path()).map_or(0, |m| m.len());
    Ok(FarmEvent {
        at_unix_ms: unix_ms(),
        server: super::live::server_doc(&s.state),
        sessions: s.live.sessions_doc(&s.state),
        targets,
        store_changes,
        targets_error,
    })
}

async fn farm_text(s: &Arc<Shared>) -> Result<Arc<str>, ApiError> {
    let s = s.clone();
    blocking(move || farm(&s))
        .await
        .map(|doc| Arc::from(serde_json::to_string(&doc).expect("a farm event serializes")))
}

/// One sampler tick: a new document for the open streams, if there are any.
pub(crate) async fn tick(s: &Arc<Shared>) {
    if !s.live.events.watched() {
        return;
    }
    match farm_text(s).await {
        Ok(text) => {
            s.live.events.latest.send_replace(Some(text));
        }
        Err(e) => log::warn!(
            "HTTP API: the event streams' farm document failed: {}",
            e.error
        ),
    }
}

/// What a stream holds: the document to send first, the latest's receiver, its place and
/// its caller's share.
type StreamState = (
    Option<Arc<str>>,
    watch::Receiver<Option<Arc<str>>>,
    (OwnedSemaphorePermit, Share),
);

/// One event of the stream, as schemathesis and OpenAPI 3.2's `itemSchema` read it: its
/// name and its data, one [`FarmEvent`] as JSON text.
#[derive(Debug, utoipa::ToSchema)]
#[allow(dead_code)]
pub(crate) struct FarmEventMessage {
    #[schema(pattern = "^farm$")]
    event: String,
    /// A FarmEvent (components/schemas/FarmEvent) as JSON.
    #[schema(content_media_type = "application/json")]
    data: String,
}

#[utoipa::path(
    get,
    path = "/api/v1/events",
    summary = "The farm, live (server-sent events)",
    description = "A `text/event-stream` that sends, at once and then every second, an event `farm` whose data is one JSON document (FarmEvent): the server document, the sessions, every target record with its agent's fresh report and its last boot script, and `store_changes`, which grows whenever the store changes (re-read vDisks then). A comment line keeps an idle connection open. The console (`/console`) follows it. At most 64 streams are open at a time (503 past it), and at most 8 for one caller (one token, one client certificate, the local users of an open API): 429 past it, naming the caller, so that one credential cannot take every stream.",
    responses(
        (status = 200, description = "The stream; each event's data is a FarmEvent.", body = FarmEventMessage, content_type = "text/event-stream"),
        (status = 500, response = super::documents::Error),
    )
)]
pub(crate) async fn stream(
    State(s): State<Arc<Shared>>,
    caller: Option<Extension<Caller>>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    // auth.rs marks every request it lets through; a stream without a caller would be a bug.
    let holder = caller.map_or_else(|| "this caller".to_string(), |Extension(c)| c.holder());
    let share = s.live.events.share(&holder).ok_or_else(|| {
        ApiError::new(
            429,
            format!("{holder} holds {MAX_EVENT_STREAMS_PER_CALLER} event streams, the most one caller may (the server keeps {MAX_EVENT_STREAMS} for all callers)"),
            "close one of its streams (a console tab) first, or poll GET /api/v1/targets and /api/v1/sessions instead",
        )
    })?;
    let place = s.live.events.places.clone().try_acquire_owned().map_err(|_| {
        ApiError::new(
            503,
            format!("{MAX_EVENT_STREAMS} event streams are open, the most this server keeps"),
            "close a console tab or another stream, or poll GET /api/v1/targets and /api/v1/sessions instead",
        )
    })?;
    let rx = s.live.events.latest.subscribe();
    let first = farm_text(&s).await?;
    let state: StreamState = (Some(first), rx, (place, share));
    let events = futures_lite::stream::unfold(state, |(first, mut rx, place)| async move {
        let text = match first {
            Some(t) => t,
            None => loop {
                rx.changed().await.ok()?;
                if let Some(t) = rx.borrow_and_update().clone() {
                    break t;
                }
            },
        };
        Some((
            Ok(Event::default().event("farm").data(&*text)),
            (None, rx, place),
        ))
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::default()))
}
