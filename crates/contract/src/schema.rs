//! The JSON schemas of the values the API's documents hold as plain strings or numbers but
//! check by rule (names, MACs, host names, texts, RAM sizes, times, version selectors), for
//! the server's OpenAPI document. A field keeps its Rust type and names one of these with
//! `#[schema(value_type = …)]`; the types here exist for their schema only.
//!
//! Invariant: each schema admits exactly what the validator it names admits, no wider
//! (a request the schema allows is one the server takes) and, where a pattern can say it,
//! no narrower. `tests/e2e/test-api-schemathesis.sh` sends both sides of each.

use std::borrow::Cow;

use utoipa::openapi::schema::{KnownFormat, SchemaFormat, SchemaType, Type};
use utoipa::openapi::{ObjectBuilder, OneOfBuilder, RefOr, Schema};
use utoipa::{PartialSchema, ToSchema};

/// A vDisk name or target id ([`crate::name::validate_name`]).
#[derive(Debug, ToSchema)]
#[schema(
    min_length = 1,
    max_length = 64,
    pattern = r"^(?![.-])(?!.*\.\.)[A-Za-z0-9._-]+$"
)]
pub struct Name(pub String);

/// Six hex bytes separated by `:` or by `-` (one of them throughout), in either case
/// (kept as lowercase with `:`), not all zero nor all ff ([`crate::target::normalize_mac`]).
#[derive(Debug, ToSchema)]
#[schema(
    pattern = r"^(?!00([:-]00){5}$)(?![Ff]{2}([:-][Ff]{2}){5}$)([0-9A-Fa-f]{2}(:[0-9A-Fa-f]{2}){5}|[0-9A-Fa-f]{2}(-[0-9A-Fa-f]{2}){5})$"
)]
pub struct Mac(pub String);

/// Dot-separated labels of letters, digits and `-` (not first or last), at most 63 bytes
/// each, 253 in all (RFC 1123).
#[derive(Debug, ToSchema)]
#[schema(
    max_length = 253,
    pattern = r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)]
pub struct Hostname(pub String);

/// A path under /dev/ of letters, digits and `/_-.:+` (no `..`), at most 200 bytes, e.g.
/// `/dev/sda2`.
#[derive(Debug, ToSchema)]
#[schema(max_length = 200, pattern = r"^(?!.*\.\.)/dev/[A-Za-z0-9/_.:+-]+$")]
pub struct OverflowDevice(pub String);

/// At most 1024 characters of text on one line, without control characters
/// ([`crate::name::validate_text`]).
#[derive(Debug, ToSchema)]
#[schema(max_length = 1024, pattern = r"^[^\u0000-\u001f\u007f-\u009f]*$")]
pub struct Description(pub String);

/// A byte count of a cap (`overflow_max`): 1 or more.
#[derive(Debug, ToSchema)]
#[schema(minimum = 1, maximum = 18446744073709551615_u64)]
pub struct Cap(pub u64);

/// Bytes of RAM for a write cache: 0 (ram-overflow only: straight to its file), or 1 MiB
/// to 256 GiB.
#[derive(Debug)]
pub struct Ram;

/// The smallest RAM a cache may have, and the largest.
pub const MIN_RAM: u64 = 1 << 20;
pub const MAX_RAM: u64 = 256 << 30;

impl PartialSchema for Ram {
    fn schema() -> RefOr<Schema> {
        OneOfBuilder::new()
            .description(Some(
                "Bytes of RAM for the write cache: 0 (ram-overflow only: straight to its file), or 1 MiB to 256 GiB.",
            ))
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .enum_values(Some([0]))
                    .build(),
            )
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .minimum(Some(MIN_RAM))
                    .maximum(Some(MAX_RAM))
                    .build(),
            )
            .into()
    }
}

impl ToSchema for Ram {
    fn name() -> Cow<'static, str> {
        "Ram".into()
    }
}

/// The selectors a target record may name by text: every one but `maintenance`, which
/// its one writer opens directly (`vdstream_store::targets`).
fn selector_texts() -> [&'static str; 5] {
    ["production", "prod", "test", "latest", "base"]
}

/// What a target boots ([`crate::Selector`], as a target record holds it): a stage's name
/// or a version number, as a string or an integer.
impl PartialSchema for crate::Selector {
    fn schema() -> RefOr<Schema> {
        OneOfBuilder::new()
            .description(Some(
                "What the target boots: production (default; also prod), test, latest, base, or a version number (a string of digits without a leading zero, or an integer), 1 to 4294967295.",
            ))
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .enum_values(Some(selector_texts()))
                    .build(),
            )
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .pattern(Some(
                        "^([1-9][0-9]{0,8}|[1-3][0-9]{9}|4[01][0-9]{8}|42[0-8][0-9]{7}|429[0-3][0-9]{6}|4294[0-8][0-9]{5}|42949[0-5][0-9]{4}|429496[0-6][0-9]{3}|4294967[01][0-9]{2}|42949672[0-8][0-9]|429496729[0-5])$",
                    ))
                    .build(),
            )
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .minimum(Some(1))
                    .maximum(Some(u32::MAX))
                    .build(),
            )
            .into()
    }
}

impl ToSchema for crate::Selector {
    fn name() -> Cow<'static, str> {
        "TargetVersion".into()
    }
}

/// RFC 3339 in UTC, whole seconds ([`crate::time::Timestamp`]).
impl PartialSchema for crate::time::Timestamp {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(SchemaType::Type(Type::String))
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime)))
            .into()
    }
}

impl ToSchema for crate::time::Timestamp {}

/// A cache type's name, as target records and their bodies hold it: every type but
/// `private` (a private vDisk has one writer and no record).
impl PartialSchema for crate::CacheType {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some(
                crate::CacheType::ALL
                    .iter()
                    .filter(|c| **c != crate::CacheType::Private)
                    .map(|c| c.name()),
            ))
            .into()
    }
}

impl ToSchema for crate::CacheType {}
