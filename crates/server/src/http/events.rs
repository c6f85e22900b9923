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
use serde_json::{json, Value};
use tokio::sync::{watch, OwnedSemaphorePermit};
use vdstream_store::Store;

use super::auth::Caller;
use super::error::ApiError;
use super::limits::{MAX_EVENT_STREAMS, MAX_EVENT_STREAMS_PER_CALLER};
use super::live::Share;
use super::shared::{blocking, Shared};
use crate::state::unix_ms;

/// Builds the farm document (blocks: reads the store).
fn farm(s: &Shared) -> Result<Value, ApiError> {
    let store = Store::open(&s.state.store)?;
    let reports: std::collections::HashMap<String, Value> =
        s.live.agent_reports().into_iter().collect();
    let mut targets = Vec::new();
    // A store whose records cannot be read still streams everything else, and says why.
    let (records, targets_error) = match store.targets() {
        Ok(r) => (r, None),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };
    for t in records {
        let mut doc = json!(t);
        if let Some(r) = reports.get(&t.id) {
            doc["agent"] = r.clone();
        }
        if let Some(b) = s.live.last_boot(&t.id) {
            doc["boot"] = b;
        }
        targets.push(doc);
    }
    let store_changes = std::fs::metadata(store.audit_path()).map_or(0, |m| m.len());
    Ok(json!({
        "at_unix_ms": unix_ms(),
        "server": super::live::server_doc(&s.state),
        "sessions": s.live.sessions_doc(&s.state),
        "targets": targets,
        "store_changes": store_changes,
        "targets_error": targets_error,
    }))
}

async fn farm_text(s: &Arc<Shared>) -> Result<Arc<str>, ApiError> {
    let s = s.clone();
    blocking(move || farm(&s))
        .await
        .map(|doc| Arc::from(doc.to_string()))
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
