//! The API's OpenAPI document: [`base`] holds what no handler says (the title, the
//! description, the servers, the shared responses); the router adds each operation from
//! its handler's `#[utoipa::path]`; [`finish`] adds what the layers in front of every
//! handler answer (router.rs: 400, 401, 403, 429 and 503 on every route, 408 and 413 on
//! those with a body), the bearer scheme, and the exact bounds of unsigned integers.
//!
//! Invariant: nothing here describes a route, a body or an answer; those come from the
//! handlers and their typed documents only.

use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::request_body::RequestBody;
use utoipa::openapi::response::{Response, ResponseBuilder};
use utoipa::openapi::schema::{ArrayItems, KnownFormat, SchemaFormat, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{ContentBuilder, ObjectBuilder, OpenApi, Ref, RefOr, Schema};
use utoipa::OpenApi as _;

use super::documents::{Changed, Error, ErrorDoc, FarmEvent, Unprocessable};
use super::limits::{HANDLER_TIMEOUT, MAX_AGENT_REPORT, MAX_BODY, REQUEST_DEADLINE};

#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "vdstream server API",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
        description = include_str!("openapi-description.md"),
    ),
    servers((url = "http://127.0.0.1:8480"), (url = "https://pvs1.example:8480")),
    components(schemas(ErrorDoc, FarmEvent), responses(Error, Changed, Unprocessable)),
)]
struct Base;

/// The document before the routes are added.
pub fn base() -> OpenApi {
    let mut doc = Base::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_string();
    doc
}

fn error_content() -> utoipa::openapi::Content {
    ContentBuilder::new()
        .schema(Some(Ref::from_schema_name("ErrorDoc")))
        .build()
}

fn error_response(description: &str) -> Response {
    ResponseBuilder::new()
        .description(description)
        .content("application/json", error_content())
        .build()
}

fn header(description: &str, kind: Type) -> RefOr<utoipa::openapi::header::Header> {
    HeaderBuilder::new()
        .description(Some(description))
        .schema(Some(ObjectBuilder::new().schema_type(kind)))
        .build()
        .into()
}

/// The answers of the layers in front of every handler, by status: (component name,
/// response).
fn layer_responses() -> Vec<(u16, &'static str, Response)> {
    let mut unauthorized = error_response(
        "No credential, or a token that is not known or was revoked (nothing was done).",
    );
    unauthorized.headers.insert(
        "WWW-Authenticate".into(),
        header(
            "`Bearer realm=\"vdstream\"` (with `error=\"invalid_token\"` for a bad token).",
            Type::String,
        ),
    );
    let mut too_many = error_response(
        "This client asked for more than it may: its address failed too many authentications lately (`Retry-After` says for how many seconds it is refused, whatever it sends), or its caller holds its share of the event streams. Nothing was done.",
    );
    too_many.headers.insert(
        "Retry-After".into(),
        header(
            "Seconds until the address is served again (penalized addresses only).",
            Type::Integer,
        ),
    );
    vec![
        (400, "BadRequest", error_response("A malformed request, path, parameter or body (or a bad name, size or version); also a request without `Host` or with a header value that is not ASCII.")),
        (401, "Unauthorized", unauthorized),
        (403, "Forbidden", error_response("The token's role, or the client certificate, does not allow this call, and the error names the role needed; or a browser page of another site (a foreign `Origin`) asked for a change; or an open API was named by a DNS name other than localhost (DNS rebinding). Nothing was done.")),
        (429, "TooMany", too_many),
        (503, "Unavailable", error_response(&format!("The request was not done within {} s (or every event stream is taken).", HANDLER_TIMEOUT.as_secs()))),
    ]
}

/// The answers of the body layers, on routes that take a body.
fn body_responses() -> Vec<(u16, &'static str, Response)> {
    vec![
        (408, "SlowBody", error_response(&format!("The body did not arrive within {} s.", REQUEST_DEADLINE.as_secs()))),
        (413, "TooLarge", error_response(&format!("The body is over {MAX_BODY} bytes ({MAX_AGENT_REPORT} for an agent report), answered from `Content-Length` before the body is read."))),
    ]
}

/// Adds the layers' answers, the bearer scheme and the bounds of unsigned integers to the
/// document the router built.
pub fn finish(mut doc: OpenApi) -> OpenApi {
    let components = doc.components.get_or_insert_with(Default::default);
    let (layers, bodies) = (layer_responses(), body_responses());
    for (_, name, r) in layers.iter().chain(&bodies) {
        components
            .responses
            .insert((*name).to_string(), RefOr::T(r.clone()));
    }
    components.add_security_scheme(
        "bearer",
        SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .bearer_format("vdst_ + 43 base64url characters (32 random bytes)")
                .description(Some("A token from `vdstream token add NAME --role admin|operator|read-only`; stored hashed (SHA-256) by the server."))
                .build(),
        ),
    );
    doc.security = Some(vec![
        SecurityRequirement::new("bearer", Vec::<String>::new()),
        SecurityRequirement::default(),
    ]);
    for item in doc.paths.paths.values_mut() {
        // A PUT or POST may carry a body even where the handler reads none, and the body
        // layers answer it before the handler runs.
        for (op, may_send) in [
            (&mut item.get, false),
            (&mut item.put, true),
            (&mut item.post, true),
            (&mut item.delete, false),
        ] {
            let Some(op) = op else { continue };
            let with_body = may_send || op.request_body.is_some();
            let extra = layers.iter().chain(bodies.iter().filter(|_| with_body));
            for (status, name, _) in extra {
                op.responses
                    .responses
                    .entry(status.to_string())
                    .or_insert_with(|| {
                        RefOr::Ref(Ref::new(format!("#/components/responses/{name}")))
                    });
            }
            for p in op.parameters.iter_mut().flatten() {
                if let RefOr::T(p) = p {
                    if let Some(s) = p.schema.as_mut() {
                        bound_unsigned(s);
                    }
                }
            }
            if let Some(RefOr::T(RequestBody {
                content, required, ..
            })) = op.request_body.as_mut()
            {
                for c in content.values_mut() {
                    if let RefOr::T(c) = c {
                        if let Some(s) = c.schema.as_mut() {
                            if optional_body(s) {
                                *required = Some(utoipa::openapi::Required::False);
                            }
                            bound_unsigned(s);
                        }
                    }
                }
            }
            for r in op.responses.responses.values_mut() {
                if let RefOr::T(r) = r {
                    for c in r.content.values_mut() {
                        if let RefOr::T(c) = c {
                            if let Some(s) = c.schema.as_mut() {
                                bound_unsigned(s);
                            }
                        }
                    }
                }
            }
        }
    }
    let components = doc.components.get_or_insert_with(Default::default);
    for s in components.schemas.values_mut() {
        bound_unsigned(s);
    }
    doc
}

/// A handler's `Option<T>` body is one the request may leave out (the server reads an
/// empty body as `{}`), not a JSON `null`, which it refuses: utoipa writes it as
/// `oneOf: [T, null]`; this makes it `T`, not required. Whether it was one.
fn optional_body(s: &mut RefOr<Schema>) -> bool {
    let RefOr::T(Schema::OneOf(one)) = s else {
        return false;
    };
    let is_null = |x: &RefOr<Schema>| matches!(x, RefOr::T(Schema::Object(o)) if o.schema_type == utoipa::openapi::schema::SchemaType::Type(Type::Null));
    if one.items.len() != 2 || !one.items.iter().any(is_null) {
        return false;
    }
    let Some(body) = one.items.iter().find(|x| !is_null(x)).cloned() else {
        return false;
    };
    *s = body;
    true
}

/// An unsigned integer (utoipa's format `u-int8` … `u-int64`, from a Rust `u8` … `u64`)
/// gets its type's bounds in place of that format: JSON Schema's integers are unbounded,
/// and a larger number is one the server's parser refuses (400), so the document must not
/// allow it.
fn bound_unsigned(s: &mut RefOr<Schema>) {
    let RefOr::T(s) = s else { return };
    match s {
        Schema::Object(o) => {
            let max = match &o.format {
                Some(SchemaFormat::KnownFormat(KnownFormat::UInt8)) => Some(u64::from(u8::MAX)),
                Some(SchemaFormat::KnownFormat(KnownFormat::UInt16)) => Some(u64::from(u16::MAX)),
                Some(SchemaFormat::KnownFormat(KnownFormat::UInt32)) => Some(u64::from(u32::MAX)),
                Some(SchemaFormat::KnownFormat(KnownFormat::UInt64)) => Some(u64::MAX),
                _ => None,
            };
            if let Some(max) = max {
                o.minimum.get_or_insert(utoipa::Number::UInt(0));
                o.maximum.get_or_insert(utoipa::Number::UInt(max as usize));
                // The bounds say it all; `u-int64` is no format a validator knows.
                o.format = None;
            }
            for p in o.properties.values_mut() {
                bound_unsigned(p);
            }
            if let Some(utoipa::openapi::schema::AdditionalProperties::RefOr(r)) =
                o.additional_properties.as_deref_mut()
            {
                bound_unsigned(r);
            }
        }
        Schema::Array(a) => {
            if let ArrayItems::RefOrSchema(i) = &mut a.items {
                bound_unsigned(i);
            }
        }
        Schema::OneOf(x) => x.items.iter_mut().for_each(bound_unsigned),
        Schema::AllOf(x) => x.items.iter_mut().for_each(bound_unsigned),
        Schema::AnyOf(x) => x.items.iter_mut().for_each(bound_unsigned),
        _ => {}
    }
}
