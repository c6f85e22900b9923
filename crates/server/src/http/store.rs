//! The store's routes: vDisks, versions and target records. Each calls the same function
//! of `vdstream_store::documents` as the CLI command it mirrors, so the answer is the
//! document `vdstream … --json` prints; only `GET /targets/{id}` adds `agent`, the
//! target's latest report, when there is a fresh one.

use serde::Deserialize;
use serde_json::Value;
use vdstream_store::{documents, Access, NewTarget, Store, TargetChange};

use super::error::ApiError;
use super::router::{Call, Reply, Route};
use super::Shared;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewVersion {
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
struct Promotion {
    to: Stage,
    /// RFC 3339 or `+DURATION`, as `version promote --at` takes.
    #[serde(default)]
    at: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Revert {
    version: u32,
}

fn version_number(text: &str) -> Result<u32, ApiError> {
    text.parse::<u32>().ok().filter(|n| *n > 0).ok_or_else(|| ApiError::bad_request(
        format!("{text:?} is not a version number"), "give the version's number, 1 or more, as `vdstream version list NAME` shows it"))
}

fn no_progress(_: u64, _: u64) {}

pub(crate) fn handle(shared: &Shared, route: Route, call: &Call<'_>) -> Result<Reply, ApiError> {
    let mut store = Store::open(&shared.state.store)?;
    if let Some(c) = call.client {
        store = store.with_client(c.0.to_string());
    }
    let p = |i: usize| call.params[i].as_str();
    let ok = |v: Value| Ok(Reply::json(200, &v));
    let created = |v: Value| Ok(Reply::json(201, &v));
    match (route, call.method) {
        (Route::Vdisks, "GET") => ok(documents::vdisk_list(&store)?),
        (Route::Vdisk, "GET") => ok(documents::vdisk_show(&store, p(0))?),
        (Route::Versions, "GET") => ok(documents::version_list(&store, p(0))?),
        (Route::Versions, "POST") => {
            let b: NewVersion = call.json(true)?;
            created(documents::version_new(&store, p(0), b.note, &mut no_progress)?)
        }
        (Route::Promote, "POST") => {
            let n = version_number(p(1))?;
            let b: Promotion = call.json(false)?;
            let to = match b.to {
                Stage::Test => Access::Test,
                Stage::Production => Access::Production,
            };
            ok(documents::version_promote(&store, p(0), n, to, b.at.as_deref(), &mut no_progress)?)
        }
        (Route::Revert, "POST") => {
            let b: Revert = call.json(false)?;
            ok(documents::version_revert(&store, p(0), b.version)?)
        }
        (Route::Targets, "GET") => ok(documents::target_list(&store)?),
        (Route::Targets, "POST") => {
            let t: NewTarget = call.json(false)?;
            created(documents::target_add(&store, t)?)
        }
        (Route::Target, "GET") => {
            let mut doc = documents::target_show(&store, p(0))?;
            if let Some(report) = shared.live.agent_report(p(0)) {
                doc["agent"] = report;
            }
            ok(doc)
        }
        (Route::Target, "PUT") => {
            let c: TargetChange = call.json(false)?;
            ok(documents::target_set(&store, p(0), c)?)
        }
        (Route::Target, "DELETE") => ok(documents::target_remove(&store, p(0))?),
        (route, method) => Err(ApiError::new(500, format!("route {route:?} has no handler for {method}"), "this is a bug in vdstream; please report it")),
    }
}
