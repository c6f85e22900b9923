//! The contracts between vdstream's components, in one place: what one component writes
//! and another reads. Nothing here does I/O; every type both writes (`Display`,
//! `Serialize`) and reads (`FromStr`, `Deserialize`) its own form, so writer and reader
//! cannot drift apart.
//!
//! - [`name`]: vDisk names, version selectors (`NAME@V`) and the export-name grammar
//!   (`vdisk/NAME[@V]`, `maintenance/NAME[@N]`, `target/ID[@ATTACH][+journal][#SECRET]`).
//! - [`description`]: the export description a store server sends with an export (what
//!   `nbdinfo` shows), which the agent reads to pin a version and to learn its secret.
//! - [`status`]: an agent's status document (its status file, its reports to the API,
//!   what `/metrics` exports of them).
//! - [`server`]: the documents of the store server's API that other components read
//!   (`GET /api/v1/server`).
//! - [`identity`]: who asks (a target, a server, an administrator, anonymous or local) and
//!   the role URI a certificate names it by.
//! - [`enrolment`]: a machine's enrolment (the TPM key it proved, approved or not).
//! - [`target`]: target records and the API bodies that add and change them, with the
//!   [`cache`] type names and the RFC 3339 [`time`]s they hold.
//! - [`refusal`]: the server's refusals a client acts on ([`refusal::AttachGone`]).
//! - [`size`]: byte counts as the commands print them (`1 GiB`).
//! - [`schema`]: the JSON schemas of the rule-checked values the documents hold, for the
//!   server's OpenAPI document.
//!
//! Invariant: this crate depends on serde, serde_json, thiserror, jiff, strsim and utoipa only, so every other
//! crate of the workspace may use it.

pub mod cache;
pub mod description;
pub mod enrolment;
pub mod identity;
pub mod name;
pub mod refusal;
pub mod schema;
pub mod server;
pub mod size;
pub mod status;
pub mod target;
pub mod time;

pub use cache::CacheType;
pub use description::ExportDescription;
pub use identity::Identity;
pub use name::{ExportName, Selector};

/// A text that breaks a contract; the message names the text and says what is allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContractError {
    /// A vDisk name or target id that is not allowed.
    #[error("{0}")]
    BadName(String),
    /// A version selector that is not one (`NAME@V`).
    #[error("{0}")]
    BadVersion(String),
    /// An export name that is not one.
    #[error("bad export name {text:?}: {why}; {}", name::EXPORT_NAMES_HELP)]
    BadExportName { text: String, why: String },
    /// An export description that does not follow [`description`]'s grammar.
    #[error("export description {text:?} is not a vdstream description: {why}")]
    BadDescription { text: String, why: String },
}
