//! The store's routes: vDisks, versions and target records, as typed handlers. Each calls
//! the same function of `vdstream_store::documents` as the CLI command it mirrors, so the
//! answer is the document `vdstream … --json` prints; only `GET /targets/{id}` adds
//! `agent`, the target's latest report, when there is a fresh one, and `DELETE
//! /targets/{id}` refuses a target in use (a session here, or an agent that reports it
//! attached).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::Value;
use vdstream_store::meta::MergeKind;
use vdstream_store::{documents, Access, NewTarget, Store, TargetChange};

use super::auth::Caller;
use super::error::{ApiError, IfMatch, JsonBody, Param, QueryArgs};
use super::shared::{blocking, AuditClient, Shared};

type S = State<Arc<Shared>>;
type Client = Extension<AuditClient>;
type Answer = Result<Json<Value>, ApiError>;
type Created = Result<(StatusCode, Json<Value>), ApiError>;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewVersion {
    #[serde(default)]
    note: Option<String>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Stage {
    Test,
    Production,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Promotion {
    to: Stage,
    /// RFC 3339 or `+DURATION`, as `version promote --at` takes.
    #[serde(default)]
    at: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Revert {
    version: u32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Merge {
    /// Merge the base too (`version merge --base`).
    #[serde(default)]
    base: bool,
}

/// The most audit entries one answer holds.
pub const MAX_AUDIT_ENTRIES: usize = 1000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AuditQuery {
    #[serde(default)]
    vdisk: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
}

fn version_number(text: &str) -> Result<u32, ApiError> {
    text.parse::<u32>().ok().filter(|n| *n > 0).ok_or_else(|| {
        ApiError::bad_request(
            format!("{text:?} is not a version number"),
            "give the version's number, 1 or more, as `vdstream version list NAME` shows it",
        )
    })
}

fn no_progress(_: u64, _: u64) {}

/// Runs `f` on the store (opened for this request, its changes audited as `client`'s:
/// address and token or certificate).
async fn on_store(
    s: Arc<Shared>,
    client: AuditClient,
    f: impl FnOnce(&Store, &Shared) -> Result<Value, vdstream_store::StoreError> + Send + 'static,
) -> Result<Value, ApiError> {
    on_store_expecting(s, client, None, f).await
}

/// [`on_store`] for a change of a vDisk decided on generation `expect` of its metadata
/// (`If-Match`): refused with 412 when another change came first.
async fn on_store_expecting(
    s: Arc<Shared>,
    client: AuditClient,
    expect: Option<u64>,
    f: impl FnOnce(&Store, &Shared) -> Result<Value, vdstream_store::StoreError> + Send + 'static,
) -> Result<Value, ApiError> {
    blocking(move || {
        let store = Store::open(&s.state.store)?
            .with_client(client.0)
            .expecting(expect);
        Ok(f(&store, &s)?)
    })
    .await
}

/// [`on_store`] for a change to a target record, whose body names the vDisk it boots: a
/// vDisk the store has not is 422 (what the body refers to is missing, not the route's
/// resource, which stays 404: an unknown target).
async fn on_store_for_record(
    s: Arc<Shared>,
    client: AuditClient,
    f: impl FnOnce(&Store) -> Result<Value, vdstream_store::StoreError> + Send + 'static,
) -> Result<Value, ApiError> {
    blocking(move || {
        let store = Store::open(&s.state.store)?.with_client(client.0);
        f(&store).map_err(|e| match e {
            vdstream_store::StoreError::UnknownVdisk { ref known, .. } => {
                ApiError::new(422, e.to_string(), known.clone())
            }
            e => e.into(),
        })
    })
    .await
}

/// A vDisk's document with its generation as the ETag (what `If-Match` sends back).
fn tagged(doc: Value, generation: Option<u64>) -> Response {
    let mut r = Json(doc).into_response();
    if let Some(g) = generation.and_then(|g| HeaderValue::from_str(&format!("\"{g}\"")).ok()) {
        r.headers_mut().insert(header::ETAG, g);
    }
    r
}

pub(crate) async fn vdisk_list(State(s): S, Extension(c): Client) -> Answer {
    on_store(s, c, |st, _| documents::vdisk_list(st))
        .await
        .map(Json)
}

pub(crate) async fn vdisk_show(
    State(s): S,
    Extension(c): Client,
    Param(name): Param<String>,
) -> Result<Response, ApiError> {
    let doc = on_store(s, c, move |st, _| documents::vdisk_show(st, &name)).await?;
    let g = doc.pointer("/meta/generation").and_then(Value::as_u64);
    Ok(tagged(doc, g))
}

pub(crate) async fn version_list(
    State(s): S,
    Extension(c): Client,
    Param(name): Param<String>,
) -> Result<Response, ApiError> {
    let doc = on_store(s, c, move |st, _| documents::version_list(st, &name)).await?;
    let g = doc.get("generation").and_then(Value::as_u64);
    Ok(tagged(doc, g))
}

pub(crate) async fn version_new(
    State(s): S,
    Extension(c): Client,
    IfMatch(g): IfMatch,
    Param(name): Param<String>,
    JsonBody(b): JsonBody<NewVersion, true>,
) -> Created {
    let doc = on_store_expecting(s, c, g, move |st, _| {
        documents::version_new(st, &name, b.note, &mut no_progress)
    })
    .await?;
    Ok((StatusCode::CREATED, Json(doc)))
}

pub(crate) async fn version_promote(
    State(s): S,
    Extension(c): Client,
    IfMatch(g): IfMatch,
    Param((name, version)): Param<(String, String)>,
    JsonBody(b): JsonBody<Promotion>,
) -> Answer {
    let n = version_number(&version)?;
    let to = match b.to {
        Stage::Test => Access::Test,
        Stage::Production => Access::Production,
    };
    on_store_expecting(s, c, g, move |st, _| {
        documents::version_promote(st, &name, n, to, b.at.as_deref(), &mut no_progress)
    })
    .await
    .map(Json)
}

pub(crate) async fn version_revert(
    State(s): S,
    Extension(c): Client,
    IfMatch(g): IfMatch,
    Param(name): Param<String>,
    JsonBody(b): JsonBody<Revert>,
) -> Answer {
    on_store_expecting(s, c, g, move |st, _| {
        documents::version_revert(st, &name, b.version)
    })
    .await
    .map(Json)
}

pub(crate) async fn version_merge(
    State(s): S,
    Extension(c): Client,
    IfMatch(g): IfMatch,
    Param(name): Param<String>,
    JsonBody(b): JsonBody<Merge, true>,
) -> Answer {
    let kind = if b.base {
        MergeKind::Base
    } else {
        MergeKind::Updates
    };
    on_store_expecting(s, c, g, move |st, _| {
        documents::version_merge(st, &name, kind, &mut no_progress)
    })
    .await
    .map(Json)
}

/// `GET /audit?vdisk=NAME&limit=N`: the last N entries (100 by default, at most
/// [`MAX_AUDIT_ENTRIES`]), oldest first.
pub(crate) async fn audit_list(
    State(s): S,
    Extension(c): Client,
    QueryArgs(q): QueryArgs<AuditQuery>,
) -> Answer {
    let limit = q.limit.unwrap_or(100);
    if limit == 0 || limit > MAX_AUDIT_ENTRIES {
        return Err(ApiError::bad_request(
            format!("limit={limit} is out of range"),
            format!("ask for 1 to {MAX_AUDIT_ENTRIES} entries"),
        ));
    }
    on_store(s, c, move |st, _| {
        documents::audit(st, q.vdisk.as_deref(), Some(limit))
    })
    .await
    .map(Json)
}

pub(crate) async fn target_list(State(s): S, Extension(c): Client) -> Answer {
    on_store(s, c, |st, _| documents::target_list(st))
        .await
        .map(Json)
}

pub(crate) async fn target_add(
    State(s): S,
    Extension(c): Client,
    JsonBody(t): JsonBody<NewTarget>,
) -> Created {
    let doc = on_store_for_record(s, c, move |st| documents::target_add(st, t)).await?;
    Ok((StatusCode::CREATED, Json(doc)))
}

pub(crate) async fn target_show(
    State(s): S,
    Extension(c): Client,
    caller: Option<Extension<Caller>>,
    Param(id): Param<String>,
) -> Answer {
    if caller.is_some_and(|Extension(c)| c == Caller::Booting) {
        return booting_target_show(s, c, id).await;
    }
    on_store(s, c, move |st, shared| {
        let mut doc = documents::target_show(st, &id)?;
        if let Some(report) = shared.live.agent_report(&id) {
            doc["agent"] = report;
        }
        Ok(doc)
    })
    .await
    .map(Json)
}

/// `GET /targets/{id}` for a machine without credentials (a network-booted target's agent,
/// see `auth::booting_may`): only a record that names MACs (a network-booted target's),
/// without its agent's report or who made and changed it; any other id is a bare 404,
/// which names neither the store nor the ids there are.
async fn booting_target_show(s: Arc<Shared>, c: AuditClient, id: String) -> Answer {
    let shown = id.clone();
    let found = on_store(s, c, move |st, _| {
        Ok(st
            .target(&id)
            .ok()
            .filter(|r| !r.macs.is_empty())
            .map_or(Value::Null, |mut r| {
                r.description = None;
                r.created_by = String::new();
                r.updated_by = String::new();
                serde_json::json!(r)
            }))
    })
    .await?;
    Some(found).filter(|v| !v.is_null()).map(Json).ok_or_else(|| ApiError::new(404, format!("no network-booted target {shown:?}"), "a machine that boots from the network needs a target record with its MAC (vdstream target add ID --mac MAC)"))
}

pub(crate) async fn target_set(
    State(s): S,
    Extension(c): Client,
    Param(id): Param<String>,
    JsonBody(ch): JsonBody<TargetChange>,
) -> Answer {
    on_store_for_record(s, c, move |st| documents::target_set(st, &id, ch))
        .await
        .map(Json)
}

/// The query of DELETE /api/v1/targets/{id}.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RemoveQuery {
    /// Remove the record even while the target is in use (`target remove --force`).
    #[serde(default)]
    force: bool,
}

pub(crate) async fn target_remove(
    State(s): S,
    Extension(c): Client,
    Param(id): Param<String>,
    QueryArgs(q): QueryArgs<RemoveQuery>,
) -> Answer {
    if let Some(why) = in_use(&s, &id) {
        if !q.force {
            log::info!(
                "HTTP API: refused to remove target {id:?} for {}: {why}",
                c.0
            );
            return Err(ApiError::new(
                409,
                format!("target {id:?} is in use: {why}; nothing was removed"),
                format!("stop its agent (or the machine) first; once it has reported `stopped` or its report is older than {} s, remove it again (or remove it anyway with force=true: `target remove --force`)", super::live::REPORT_TTL.as_secs()),
            ));
        }
        log::warn!(
            "HTTP API: target {id:?} removed for {} although it is in use (force): {why}",
            c.0
        );
    }
    on_store(s, c, move |st, _| documents::target_remove(st, &id))
        .await
        .map(Json)
}

/// Why target `id` is in use, if it is: an NBD session of this server serves it, or its
/// agent's fresh report says it is attached (any state but `stopped`).
fn in_use(s: &Shared, id: &str) -> Option<String> {
    if let Some(session) = s
        .state
        .registry
        .sessions()
        .iter()
        .find(|x| x.info.target.as_deref() == Some(id))
    {
        return Some(format!(
            "session {} from {} serves it",
            session.id, session.info.peer
        ));
    }
    let report = s.live.agent_report(id)?;
    let state = report
        .get("state")
        .and_then(Value::as_str)
        .unwrap_or("unknown");
    (state != "stopped").then(|| {
        format!(
            "its agent (pid {}) reports it {state}",
            report.get("pid").and_then(Value::as_u64).unwrap_or(0)
        )
    })
}
