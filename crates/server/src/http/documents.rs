//! The server's own answers, as types: the error document, an agent's report as the API
//! shows it, the sessions, a target with its agent, the live farm event, and what an
//! accepted report answers. The store's documents are `vdstream_store::documents`, the
//! server document `vdstream_contract::server::ServerDoc`, an agent's status
//! `vdstream_contract::status::Status`. Each derives its schema, from which the OpenAPI
//! document (openapi.rs) is generated, so an answer and its schema cannot drift apart.

use serde::{Deserialize, Serialize};
use utoipa::{ToResponse, ToSchema};
use vdstream_contract::server::ServerDoc;
use vdstream_contract::status::{IoStatus, Status};
use vdstream_store::TargetRecord;

/// What went wrong and what to do.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorDoc {
    pub error: String,
    pub what_to_do: String,
}

/// An error answer: what went wrong and what to do.
#[derive(Debug, ToResponse)]
#[response(description = "What went wrong and what to do.")]
pub struct Error(#[allow(dead_code)] ErrorDoc);

/// 412: the vDisk changed since the generation `If-Match` named.
#[derive(Debug, ToResponse)]
#[response(
    description = "The vDisk changed since the generation in `If-Match` (another change came first); nothing was changed. Read it again and decide again."
)]
pub struct Changed(#[allow(dead_code)] ErrorDoc);

/// 422: fields each valid alone that do not go together.
#[derive(Debug, ToResponse)]
#[response(
    description = "Fields each valid alone that do not go together, or a body that names a vDisk the store has not (the error names them and what to do); nothing was changed."
)]
pub struct Unprocessable(#[allow(dead_code)] ErrorDoc);

/// An agent's latest report, as the server keeps and shows it: the agent's status
/// document and when the server got it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AgentReport {
    #[serde(flatten)]
    pub status: Status,
    /// When the server got it (Unix time, milliseconds).
    pub received_unix_ms: u64,
}

/// `PUT /api/v1/targets/{id}/agent`: the report was kept.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ReportAccepted {
    pub target: String,
    pub accepted: bool,
    /// How long the report counts (then it is left out of every view and freed).
    pub keep_for_secs: u64,
}

/// `GET /api/v1/targets/{id}`: the record, with its agent's report when it is fresh.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TargetShown {
    #[serde(flatten)]
    pub record: TargetRecord,
    /// The target's agent's latest report, when it reported within the last 60 s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentReport>,
}

/// The boot script the boot service last sent a target.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LastBoot {
    pub at_unix_ms: u64,
    /// MAC, peer, and the vDisk and version of the boot script sent.
    pub what: String,
}

/// A target in the farm event: its record, its agent's fresh report, its last boot.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct FarmTarget {
    #[serde(flatten)]
    pub record: TargetRecord,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boot: Option<LastBoot>,
}

/// The data of each `farm` event of `GET /api/v1/events`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct FarmEvent {
    pub at_unix_ms: u64,
    pub server: ServerDoc,
    pub sessions: Vec<SessionDoc>,
    pub targets: Vec<FarmTarget>,
    /// Grows whenever the store changes.
    pub store_changes: u64,
    /// Why the target records could not be read (then `targets` is empty); null when
    /// they were.
    pub targets_error: Option<String>,
}

/// One live NBD session of this server.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SessionDoc {
    pub id: u64,
    /// The server's name.
    pub server: String,
    /// As the client asked: `vdisk/NAME[@V]`, `target/ID`, `maintenance/NAME`.
    pub export: String,
    pub kind: crate::state::ExportKind,
    pub target: Option<String>,
    /// `unix` or IP:PORT.
    pub peer: String,
    pub vdisk: String,
    /// The version served; 0 is the base.
    pub version: u32,
    pub cache: SessionCache,
    /// Connections of this target after its first since the server started.
    pub reconnects: u64,
    pub guest: IoStatus,
    pub store: IoStatus,
    pub connected_unix_ms: u64,
    /// The target's agent's latest report (within 60 s), or null.
    pub agent: Option<AgentReport>,
}

/// A session's write cache on the server (figures as an agent's status has them).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SessionCache {
    /// The cache type's name; null without a server-side cache.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub used_bytes: u64,
    /// The cache file's cap (the target's --overflow-max, else the vDisk's size); null
    /// without a server-side cache.
    pub limit_bytes: Option<u64>,
    /// Free bytes on the file system of the cache's file (STORE/cache).
    pub fs_free_bytes: Option<u64>,
    /// What the cache can hold: min(limit_bytes, used_bytes + fs_free_bytes).
    pub capacity_bytes: Option<u64>,
    /// used_bytes, percent of capacity_bytes.
    pub used_percent: Option<f64>,
    /// Writes refused for space: the limit reached, or the file system full (ENOSPC).
    pub nospace_errors: Option<u64>,
}
