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
use utoipa::{IntoParams, ToSchema};
use vdstream_contract::schema::{Description, Name};
use vdstream_contract::server::PlacementDoc;
use vdstream_store::audit::AuditEntry;
use vdstream_store::documents::{
    self, MergeDoc, RevertDoc, TargetRemoved, VdiskListEntry, VersionChange, VersionList,
};
use vdstream_store::identities::Enrolment;
use vdstream_store::meta::MergeKind;
use vdstream_store::vdisk::VdiskInfo;
use vdstream_store::{Access, NewTarget, Store, TargetChange, TargetRecord};

use super::auth::Caller;
use super::documents::{Changed, Error, TargetShown, Unprocessable};
use super::error::{ApiError, IfMatch, JsonBody, Param, QueryArgs};
use super::shared::{blocking, AuditClient, Shared};

type S = State<Arc<Shared>>;
type Client = Extension<AuditClient>;
type Answer<T> = Result<Json<T>, ApiError>;
type Created<T> = Result<(StatusCode, Json<T>), ApiError>;

/// The body of `POST /vdisks/{name}/versions` (optional).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewVersion {
    /// What the version is for (`version new --note`).
    #[serde(default)]
    #[schema(value_type = Option<Description>, nullable = false)]
    note: Option<String>,
}

/// Which stage a promotion makes a version.
#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Stage {
    Test,
    Production,
}

/// A release time: RFC 3339, or `+DURATION` from now in weeks, days, hours, minutes and
/// seconds, largest first (`+2h`, `+1d12h`), as `vdstream_store::time::parse_at` reads it.
#[derive(Debug)]
pub(crate) struct ReleaseAt;

impl utoipa::PartialSchema for ReleaseAt {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::Schema> {
        use utoipa::openapi::schema::{KnownFormat, SchemaFormat, Type};
        use utoipa::openapi::{ObjectBuilder, OneOfBuilder};
        OneOfBuilder::new()
            .description(Some("Release time, only with `to = production` (422 with `test`): RFC 3339, or `+DURATION` from now in weeks, days, hours, minutes and seconds, largest first (`+2h`, `+1d12h`)."))
            .item(ObjectBuilder::new().schema_type(Type::String).format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime))))
            .item(ObjectBuilder::new().schema_type(Type::String).pattern(Some(r"^\+(?=[0-9])([0-9]{1,4}w)?([0-9]{1,4}d)?([0-9]{1,4}h)?([0-9]{1,4}m)?([0-9]{1,4}s)?$")))
            .into()
    }
}

impl ToSchema for ReleaseAt {}

/// The body of `POST /vdisks/{name}/versions/{version}/promote`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Promotion {
    to: Stage,
    /// RFC 3339 or `+DURATION`, as `version promote --at` takes.
    #[serde(default)]
    #[schema(value_type = Option<ReleaseAt>, nullable = false)]
    at: Option<String>,
}

/// The body of `POST /vdisks/{name}/revert`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Revert {
    #[schema(minimum = 1)]
    version: u32,
}

/// The body of `POST /vdisks/{name}/merge` (optional).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Merge {
    /// Merge the base too (into a new base file; `version merge --base`).
    #[serde(default)]
    base: bool,
}

/// The most audit entries one answer holds.
pub const MAX_AUDIT_ENTRIES: usize = 1000;

/// The query of `GET /audit`; any other parameter is refused (400).
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct AuditQuery {
    /// Only the entries about this vDisk (a vDisk name; 400 otherwise).
    #[serde(default)]
    #[param(value_type = Option<Name>, nullable = false)]
    vdisk: Option<String>,
    /// The last N entries (default 100).
    #[serde(default)]
    #[param(minimum = 1, maximum = 1000, nullable = false)]
    limit: Option<usize>,
}

/// The `{name}` of a vDisk's routes.
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
pub(crate) struct VdiskPath {
    /// A vDisk name (1–64 of `A–Z a–z 0–9 . _ -`, not starting with `.` or `-`, no `..`; 400 otherwise), percent-encoded.
    #[param(value_type = Name)]
    name: String,
}

/// The `{id}` of a target's routes.
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
pub(crate) struct TargetPath {
    /// A target id (the rules of a vDisk name; 400 otherwise), percent-encoded.
    #[param(value_type = Name)]
    id: String,
}

/// `If-Match` on a change of a vDisk (error.rs, [`IfMatch`]).
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Header)]
#[allow(dead_code)]
pub(crate) struct IfMatchHeader {
    /// The generation of the vDisk's metadata this change was decided on, as its GET's
    /// ETag gave it (`"7"`); the change is made only if it is still that (else 412,
    /// nothing changed). `*` or no field: no condition; anything else is refused (400).
    /// `vdstream version … --expect-generation G` sends it.
    #[param(
        rename = "If-Match",
        pattern = r#"^[ \t]*(\*|"[0-9]{1,19}"|[0-9]{1,19})[ \t]*$"#,
        nullable = false
    )]
    if_match: Option<String>,
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
async fn on_store<T: Send + 'static>(
    s: Arc<Shared>,
    client: AuditClient,
    f: impl FnOnce(&Store, &Shared) -> Result<T, vdstream_store::StoreError> + Send + 'static,
) -> Result<T, ApiError> {
    on_store_expecting(s, client, None, f).await
}

/// [`on_store`] for a change of a vDisk decided on generation `expect` of its metadata
/// (`If-Match`): refused with 412 when another change came first.
async fn on_store_expecting<T: Send + 'static>(
    s: Arc<Shared>,
    client: AuditClient,
    expect: Option<u64>,
    f: impl FnOnce(&Store, &Shared) -> Result<T, vdstream_store::StoreError> + Send + 'static,
) -> Result<T, ApiError> {
    blocking(move || {
        let store = Store::open(&s.state.store)?
            .with_client(client.0)
            .expecting(expect);
        Ok(f(&store, &s)?)
    })
    .await
}

/// [`on_store`] for a change to a target record, whose body names the vDisk it boots and
/// may name a version of it: a vDisk the store has not, or a version the vDisk has not, is
/// 422 (what the body refers to is missing, not the route's resource, which stays 404: an
/// unknown target).
async fn on_store_for_record<T: Send + 'static>(
    s: Arc<Shared>,
    client: AuditClient,
    f: impl FnOnce(&Store) -> Result<T, vdstream_store::StoreError> + Send + 'static,
) -> Result<T, ApiError> {
    blocking(move || {
        let store = Store::open(&s.state.store)?.with_client(client.0);
        f(&store).map_err(|e| match e {
            vdstream_store::StoreError::UnknownVdisk { ref known, .. } => {
                ApiError::new(422, e.to_string(), known.clone())
            }
            vdstream_store::StoreError::UnknownVersion { ref have, .. } => ApiError::new(
                422,
                e.to_string(),
                format!(
                    "name a version it has ({have}), or a stage: production, test, latest, base"
                ),
            ),
            e => e.into(),
        })
    })
    .await
}

/// A vDisk's document with its generation as the ETag (what `If-Match` sends back).
fn tagged<T: serde::Serialize>(doc: T, generation: u64) -> Response {
    let mut r = Json(doc).into_response();
    if let Ok(g) = HeaderValue::from_str(&format!("\"{generation}\"")) {
        r.headers_mut().insert(header::ETAG, g);
    }
    r
}

#[utoipa::path(
    get,
    path = "/api/v1/vdisks",
    summary = "Every vDisk (`vdstream vdisk list --json`)",
    responses(
        (status = 200, description = "The metadata of each vDisk, or its name and the error that stopped it loading.", body = Vec<VdiskListEntry>),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn vdisk_list(State(s): S, Extension(c): Client) -> Answer<Vec<VdiskListEntry>> {
    on_store(s, c, |st, _| documents::vdisk_list(st))
        .await
        .map(Json)
}

#[utoipa::path(
    get,
    path = "/api/v1/vdisks/{name}",
    summary = "One vDisk (`vdstream vdisk show NAME --json`)",
    params(VdiskPath),
    responses(
        (status = 200, description = "Metadata, what production and test targets get, files and who holds them.", body = VdiskInfo,
            headers(("ETag" = String, description = "The generation of the vDisk's metadata, quoted (`\"7\"`): send it back as `If-Match` with a change."))),
        (status = 404, response = Error),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn vdisk_show(
    State(s): S,
    Extension(c): Client,
    Param(name): Param<String>,
) -> Result<Response, ApiError> {
    let doc = on_store(s, c, move |st, _| documents::vdisk_show(st, &name)).await?;
    let g = doc.meta.generation;
    Ok(tagged(doc, g))
}

#[utoipa::path(
    get,
    path = "/api/v1/vdisks/{name}/versions",
    summary = "The versions of a vDisk (`vdstream version list NAME --json`)",
    params(VdiskPath),
    responses(
        (status = 200, description = "The chain, bottom first, and which layer each kind of target gets.", body = VersionList,
            headers(("ETag" = String, description = "The generation of the vDisk's metadata, quoted (`\"7\"`): send it back as `If-Match` with a change."))),
        (status = 404, response = Error),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn version_list(
    State(s): S,
    Extension(c): Client,
    Param(name): Param<String>,
) -> Result<Response, ApiError> {
    let doc = on_store(s, c, move |st, _| documents::version_list(st, &name)).await?;
    let g = doc.generation;
    Ok(tagged(doc, g))
}

#[utoipa::path(
    post,
    path = "/api/v1/vdisks/{name}/versions",
    summary = "A new maintenance version (`vdstream version new NAME`)",
    params(VdiskPath, IfMatchHeader),
    request_body(content = Option<NewVersion>, description = "Optional."),
    responses(
        (status = 201, description = "The new version (and the automatic merge, if one ran).", body = VersionChange),
        (status = 404, response = Error),
        (status = 409, response = Error),
        (status = 412, response = Changed),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn version_new(
    State(s): S,
    Extension(c): Client,
    IfMatch(g): IfMatch,
    Param(name): Param<String>,
    JsonBody(b): JsonBody<NewVersion, true>,
) -> Created<VersionChange> {
    let doc = on_store_expecting(s, c, g, move |st, _| {
        documents::version_new(st, &name, b.note, &mut no_progress)
    })
    .await?;
    Ok((StatusCode::CREATED, Json(doc)))
}

#[utoipa::path(
    post,
    path = "/api/v1/vdisks/{name}/versions/{version}/promote",
    summary = "Promote a version (`vdstream version promote NAME V --to … [--at …]`)",
    params(VdiskPath, ("version" = u32, Path, minimum = 1, description = "The version's number."), IfMatchHeader),
    request_body = Promotion,
    responses(
        (status = 200, description = "The promoted version (and the automatic merge, if one ran).", body = VersionChange),
        (status = 404, response = Error),
        (status = 409, response = Error),
        (status = 412, response = Changed),
        (status = 422, response = Unprocessable),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn version_promote(
    State(s): S,
    Extension(c): Client,
    IfMatch(g): IfMatch,
    Param((name, version)): Param<(String, String)>,
    JsonBody(b): JsonBody<Promotion>,
) -> Answer<VersionChange> {
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

#[utoipa::path(
    post,
    path = "/api/v1/vdisks/{name}/revert",
    summary = "One step back (`vdstream version revert NAME V`)",
    description = "production → test, test → maintenance (newest only), maintenance → discarded.",
    params(VdiskPath, IfMatchHeader),
    request_body = Revert,
    responses(
        (status = 200, description = "What the version became.", body = RevertDoc),
        (status = 404, response = Error),
        (status = 409, response = Error),
        (status = 412, response = Changed),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn version_revert(
    State(s): S,
    Extension(c): Client,
    IfMatch(g): IfMatch,
    Param(name): Param<String>,
    JsonBody(b): JsonBody<Revert>,
) -> Answer<RevertDoc> {
    on_store_expecting(s, c, g, move |st, _| {
        documents::version_revert(st, &name, b.version)
    })
    .await
    .map(Json)
}

#[utoipa::path(
    post,
    path = "/api/v1/vdisks/{name}/merge",
    summary = "Merge the versions up to production (`vdstream version merge NAME [--base]`)",
    description = "The versions up to the one production boots become one version on the base, or with `base: true` one new base. What targets read does not change; a version open read-write that the merge would re-point refuses it (409).",
    params(VdiskPath, IfMatchHeader),
    request_body(content = Option<Merge>, description = "Optional."),
    responses(
        (status = 200, description = "What was merged (the document `vdstream version merge NAME --json` prints).", body = MergeDoc),
        (status = 404, response = Error),
        (status = 409, response = Error),
        (status = 412, response = Changed),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn version_merge(
    State(s): S,
    Extension(c): Client,
    IfMatch(g): IfMatch,
    Param(name): Param<String>,
    JsonBody(b): JsonBody<Merge, true>,
) -> Answer<MergeDoc> {
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
#[utoipa::path(
    get,
    path = "/api/v1/audit",
    summary = "The store's audit trail (`vdstream audit [NAME] --limit N --json`)",
    description = "Who changed what and when, oldest first. A query parameter other than these two is refused (400).",
    params(AuditQuery),
    responses(
        (status = 200, description = "The entries.", body = Vec<AuditEntry>),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn audit_list(
    State(s): S,
    Extension(c): Client,
    QueryArgs(q): QueryArgs<AuditQuery>,
) -> Answer<Vec<AuditEntry>> {
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

#[utoipa::path(
    get,
    path = "/api/v1/targets",
    summary = "Every target record (`vdstream target list --json`)",
    responses(
        (status = 200, description = "The records, by id.", body = Vec<TargetRecord>),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn target_list(State(s): S, Extension(c): Client) -> Answer<Vec<TargetRecord>> {
    on_store(s, c, |st, _| documents::target_list(st))
        .await
        .map(Json)
}

#[utoipa::path(
    post,
    path = "/api/v1/targets",
    summary = "Add a target record (`vdstream target add`)",
    request_body = NewTarget,
    responses(
        (status = 201, description = "The record written.", body = TargetRecord),
        (status = 409, response = Error),
        (status = 422, response = Unprocessable),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn target_add(
    State(s): S,
    Extension(c): Client,
    JsonBody(t): JsonBody<NewTarget>,
) -> Created<TargetRecord> {
    let doc = on_store_for_record(s, c, move |st| documents::target_add(st, t)).await?;
    Ok((StatusCode::CREATED, Json(doc)))
}

#[utoipa::path(
    get,
    path = "/api/v1/targets/{id}/placement",
    summary = "Where a target this server moved away should reconnect",
    description = "An agent whose connection this server ended (rebalancing, a drain) asks here which server to reconnect to. `server` is that server's name, for 60 s after the move; `null` otherwise (place it as usual: the least busy first).",
    params(TargetPath),
    responses(
        (status = 200, description = "The advice.", body = PlacementDoc),
        (status = 404, response = Error),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn target_placement(
    State(s): S,
    Extension(c): Client,
    Param(id): Param<String>,
) -> Answer<PlacementDoc> {
    on_store(s, c, move |st, shared| {
        documents::target_show(st, &id)?;
        let hint = shared.state.balancer.hint(&id);
        Ok(PlacementDoc {
            target: id,
            server: hint.as_ref().map(|(to, _)| to.clone()),
            reason: hint.map(|(_, why)| why.to_string()),
        })
    })
    .await
    .map(Json)
}

#[utoipa::path(
    get,
    path = "/api/v1/targets/{id}",
    summary = "One target record (`vdstream target show ID --json`), with its agent's latest report",
    params(TargetPath),
    responses(
        (status = 200, description = "The record; `agent` is present when the target's agent reported within the last 60 s.", body = TargetShown),
        (status = 404, response = Error),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn target_show(
    State(s): S,
    Extension(c): Client,
    caller: Option<Extension<Caller>>,
    Param(id): Param<String>,
) -> Answer<TargetShown> {
    if caller.is_some_and(|Extension(c)| c == Caller::Booting) {
        return booting_target_show(s, c, id).await;
    }
    on_store(s, c, move |st, shared| {
        Ok(TargetShown {
            record: documents::target_show(st, &id)?,
            agent: shared.live.agent_report(&id),
        })
    })
    .await
    .map(Json)
}

/// `GET /targets/{id}` for a machine without credentials (a network-booted target's agent,
/// see `auth::booting_may`): only a record that names MACs (a network-booted target's),
/// without its agent's report or who made and changed it; any other id is a bare 404,
/// which names neither the store nor the ids there are.
async fn booting_target_show(s: Arc<Shared>, c: AuditClient, id: String) -> Answer<TargetShown> {
    let shown = id.clone();
    let found = on_store(s, c, move |st, _| {
        Ok(st
            .target(&id)
            .ok()
            .filter(|r| !r.macs.is_empty())
            .map(|mut r| {
                r.description = None;
                r.created_by = String::new();
                r.updated_by = String::new();
                TargetShown {
                    record: r,
                    agent: None,
                }
            }))
    })
    .await?;
    found.map(Json).ok_or_else(|| ApiError::new(404, format!("no network-booted target {shown:?}"), "a machine that boots from the network needs a target record with its MAC (vdstream target add ID --mac MAC)"))
}

#[utoipa::path(
    put,
    path = "/api/v1/targets/{id}",
    summary = "Change a target record (`vdstream target set`), patch semantics",
    description = "Absent fields stay; `null` clears `ram`, `overflow_max`, `description`, `hostname` or `overflow_device`.",
    params(TargetPath),
    request_body = TargetChange,
    responses(
        (status = 200, description = "The record after the change.", body = TargetRecord),
        (status = 404, response = Error),
        (status = 409, response = Error),
        (status = 422, response = Unprocessable),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn target_set(
    State(s): S,
    Extension(c): Client,
    Param(id): Param<String>,
    JsonBody(ch): JsonBody<TargetChange>,
) -> Answer<TargetRecord> {
    on_store_for_record(s, c, move |st| documents::target_set(st, &id, ch))
        .await
        .map(Json)
}

/// The query of DELETE /api/v1/targets/{id}.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct RemoveQuery {
    /// Remove the record even while the target is in use (`target remove --force`); its
    /// agent's reports are then refused.
    #[serde(default)]
    #[param(nullable = false)]
    force: bool,
}

#[utoipa::path(
    delete,
    path = "/api/v1/targets/{id}",
    summary = "Remove a target record (`vdstream target remove ID`)",
    description = "Refused (409, nothing removed) while the target is in use: a session of this server serves it, or its agent's fresh report says it is attached (any state but `stopped`), unless `force` is true (`target remove --force`).",
    params(TargetPath, RemoveQuery),
    responses(
        (status = 200, description = "The record removed (`target` is null if the record was damaged).", body = TargetRemoved),
        (status = 404, response = Error),
        (status = 409, response = Error),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn target_remove(
    State(s): S,
    Extension(c): Client,
    Param(id): Param<String>,
    QueryArgs(q): QueryArgs<RemoveQuery>,
) -> Answer<TargetRemoved> {
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
    let report = s.live.agent_report(id)?.status;
    let state = match report.state.as_str() {
        "" => "in no state it names",
        s => s,
    };
    (state != "stopped").then(|| format!("its agent (pid {}) reports it {state}", report.pid))
}

// ---- machine identities (docs/IDENTITY.md) ----

/// The body of POST /api/v1/targets/{id}/identity/approve.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Approval {
    /// The key to approve (`sha256:` and 64 hex digits, as the machine's console shows it):
    /// required to pre-enrol a target that has proved no key yet, or to name a new key for
    /// an approved or revoked one; with a pending key it must be that key's.
    #[serde(default)]
    #[schema(nullable = false, pattern = "^sha256:[0-9a-fA-F]{64}$")]
    fingerprint: Option<String>,
}

#[utoipa::path(
    get,
    path = "/api/v1/identities",
    summary = "Every target's enrolment (`vdstream target identity list --json`)",
    description = "The TPM key each target proved, and whether it is pending, approved or revoked.",
    responses(
        (status = 200, description = "The enrolments, by target id.", body = [Enrolment]),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn identity_list(State(s): S, Extension(c): Client) -> Answer<Vec<Enrolment>> {
    on_store(s, c, |st, _| st.identities()).await.map(Json)
}

fn no_enrolment(id: &str) -> ApiError {
    ApiError::new(
        404,
        format!("target {id:?} has no enrolment: its machine has not proved a TPM key"),
        "boot the machine once with --identity-ca on its server (it then waits as pending), or pre-enrol it: POST …/identity/approve with its fingerprint",
    )
}

#[utoipa::path(
    get,
    path = "/api/v1/targets/{id}/identity",
    summary = "One target's enrolment (`vdstream target identity show ID`)",
    params(TargetPath),
    responses(
        (status = 200, description = "The enrolment.", body = Enrolment),
        (status = 404, response = Error),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn identity_show(
    State(s): S,
    Extension(c): Client,
    Param(id): Param<String>,
) -> Answer<Enrolment> {
    let id2 = id.clone();
    on_store(s, c, move |st, _| {
        st.target(&id2)?;
        st.identity(&id2)
    })
    .await?
    .ok_or_else(|| no_enrolment(&id))
    .map(Json)
}

#[utoipa::path(
    post,
    path = "/api/v1/targets/{id}/identity/approve",
    summary = "Approve a target's key (`vdstream target identity approve ID`)",
    description = "The pending key becomes the target's: its machine gets a certificate at its next proof. With `fingerprint` and no key proved yet, the target is pre-enrolled for that key. Audited as `identity.approve`.",
    params(TargetPath),
    request_body = Approval,
    responses(
        (status = 200, description = "The enrolment.", body = Enrolment),
        (status = 404, response = Error),
        (status = 409, response = Error),
        (status = 422, response = Unprocessable),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn identity_approve(
    State(s): S,
    Extension(c): Client,
    Param(id): Param<String>,
    JsonBody(b): JsonBody<Approval, true>,
) -> Answer<Enrolment> {
    on_store(s, c, move |st, _| {
        st.approve_identity(&id, b.fingerprint.as_deref())
    })
    .await
    .map(Json)
}

#[utoipa::path(
    post,
    path = "/api/v1/targets/{id}/identity/revoke",
    summary = "Revoke a target's identity (`vdstream target identity revoke ID`)",
    description = "No key gets a certificate for the target until one is approved again; its next boot is refused. Audited as `identity.revoke`.",
    params(TargetPath),
    responses(
        (status = 200, description = "The enrolment.", body = Enrolment),
        (status = 404, response = Error),
        (status = 409, response = Error),
        (status = 500, response = Error),
    )
)]
pub(crate) async fn identity_revoke(
    State(s): S,
    Extension(c): Client,
    Param(id): Param<String>,
) -> Answer<Enrolment> {
    on_store(s, c, move |st, _| st.revoke_identity(&id))
        .await
        .map(Json)
}
