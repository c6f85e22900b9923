//! The boot service's HTTP routes (`vdstream server --http ADDR --boot`), on the API's
//! port but outside the API: no token, no certificate (a PXE ROM has none), text answers
//! that iPXE runs or shows, not the API's JSON.
//!
//! | route | answer |
//! |---|---|
//! | `GET /boot/ipxe` | the first script: `chain …/boot/target/${net0/mac:hexhyp}` |
//! | `GET /boot/target/{mac}` | the target's script (`kernel` URL and command line, `initrd`, `boot`); for an unknown MAC a script that says how to add it and retries (or, with `--boot-unknown auto-add`, the script of the record made for it) |
//! | `GET /boot/vdisk/{name}/{version}/vmlinuz`, `/initrd.img` | the version's kernel and initrd (Content-Length, Range) |
//! | `GET /boot/vdisk/{name}/{version}/problem` | a script that prints why the kernel or initrd could not be had |
//! | `GET /boot/admit/{id}` | the initramfs agent asks a place in the boot window (`--max-booting`): 200, or 503 with `Retry-After` while it must wait (JSON) |
//! | `GET /boot/booted/{id}` | the initramfs says the machine's root is mounted: its boot window closes (JSON) |
//!
//! Invariants:
//! - Only GET (and HEAD); a request body is refused (413) before any handler runs.
//! - These routes reveal boot scripts and boot files only: a script names the target's id,
//!   vDisk, version, cache type and sizes, host name and overflow device, which the
//!   target's kernel command line carries anyway; nothing of other records, tokens or the
//!   store's paths. Auto-add changes the store only when the administrator turned it on.
//! - At most [`MAX_BOOT_IN_FLIGHT`] requests are in handlers at once (more wait); a
//!   handler has [`BOOT_TIMEOUT`] (building an initramfs the first time takes a while).
//!   At most [`MAX_BOOT_TRANSFERS`] file bodies are being sent at once: each holds its
//!   place until its last byte is written (or its connection drops).
//! - Boot pacing (`boot::pacing`): the target script and `/boot/admit` open a machine's
//!   window or tell it to wait; a GET that changes the pacer's memory only, never the
//!   store, since iPXE and busybox speak nothing else.
//! - Failures a machine can provoke (unknown MAC, a version without a kernel) are logged
//!   rate-limited.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::{ServiceBuilder, ServiceExt};
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::services::ServeFile;
use tower_http::timeout::TimeoutLayer;
use vdstream_boot::BootError;
use vdstream_store::targets::normalize_mac;
use vdstream_store::{select, Store, StoreError, Timestamp};

use super::shared::{ClientAddr, Shared};
use crate::boot::pacing::Admission;
use crate::boot::{self, files, BootConfig, ScriptContext, UnknownMac};

/// Boot requests in handlers at once, at most (the rest wait).
pub const MAX_BOOT_IN_FLIGHT: usize = 64;

/// Kernels and initrds being sent at once, at most (the next wait for a place): a storm of
/// machines shares the link in turns rather than all crawling.
pub const MAX_BOOT_TRANSFERS: usize = 32;

/// The longest a boot handler may take (503 past it): the first request for a version's
/// files builds its initramfs.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(600);

/// The boot routes on `shared`, with their own layers (no authorization; see the module
/// docs); `api` answers every other path.
pub(crate) fn router(shared: Arc<Shared>, api: Router) -> Router {
    let layers = ServiceBuilder::new()
        .layer(GlobalConcurrencyLimitLayer::new(MAX_BOOT_IN_FLIGHT))
        .layer(RequestBodyLimitLayer::new(0))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            BOOT_TIMEOUT,
        ));
    Router::new()
        .route("/boot/ipxe", get(first))
        .route("/boot/target/{mac}", get(target))
        .route("/boot/vdisk/{name}/{version}/{file}", get(file))
        .route("/boot/admit/{id}", get(admit))
        .route("/boot/booted/{id}", get(booted))
        .layer(layers)
        .with_state(shared)
        .fallback_service(api)
}

fn text(status: StatusCode, body: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body,
    )
        .into_response()
}

fn script(body: String) -> Response {
    text(StatusCode::OK, body)
}

fn pacer(s: &Shared) -> &crate::boot::pacing::Pacer {
    s.state
        .pacer
        .as_ref()
        .expect("boot routes exist only with a pacer")
}

fn config(s: &Shared) -> &BootConfig {
    s.state
        .boot
        .as_ref()
        .expect("boot routes exist only with a boot configuration")
}

/// A `Host` field that cannot name the server in a script.
struct BadHost;

impl IntoResponse for BadHost {
    fn into_response(self) -> Response {
        text(
            StatusCode::BAD_REQUEST,
            "the Host field is not a host name or address with an optional port\n".into(),
        )
    }
}

/// This server's base URL as the machine reaches it: `--boot-advertise`, else the request's
/// `Host`, else the address the API listens on.
fn base(s: &Shared, headers: &HeaderMap) -> Result<String, BadHost> {
    let scheme = if s.tls { "https" } else { "http" };
    let host = match (&config(s).advertise, headers.get(header::HOST)) {
        (Some(a), _) => with_port(a, s.local.port()),
        (None, Some(h)) => {
            let h = h.to_str().unwrap_or_default();
            if !boot::host_ok(h) {
                return Err(BadHost);
            }
            h.to_string()
        }
        (None, None) => s.local.to_string(),
    };
    Ok(format!("{scheme}://{host}"))
}

/// `HOST` or `HOST:PORT` (`[V6]` or `[V6]:PORT`), with `port` added when it has none.
pub fn with_port(host: &str, port: u16) -> String {
    let has_port = match host.rsplit_once(':') {
        Some((h, p)) => {
            !p.is_empty()
                && p.bytes().all(|b| b.is_ascii_digit())
                && (!h.contains(':') || h.ends_with(']'))
        }
        None => false,
    };
    if has_port {
        host.to_string()
    } else {
        format!("{host}:{port}")
    }
}

async fn first(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    match base(&s, &headers) {
        Ok(base) => script(boot::first_script(&base, &s.state.name)),
        Err(r) => r.into_response(),
    }
}

async fn target(
    State(s): State<Arc<Shared>>,
    Extension(ClientAddr(peer)): Extension<ClientAddr>,
    headers: HeaderMap,
    Path(mac): Path<String>,
) -> Response {
    let base = match base(&s, &headers) {
        Ok(b) => b,
        Err(r) => return r.into_response(),
    };
    let mac = match normalize_mac(&mac) {
        Ok(m) => m,
        Err(e) => return text(StatusCode::BAD_REQUEST, format!("{e}\n")),
    };
    let s2 = s.clone();
    let r = tokio::task::spawn_blocking(move || {
        let s = s2;
        let cfg = config(&s);
        let store = Store::open(&s.state.store)?.with_client(format!("{peer} boot"));
        let record = match store.target_by_mac(&mac)? {
            Some(r) => r,
            None => match &cfg.unknown {
                UnknownMac::Refuse => {
                    s.state.log.log(log::Level::Warn, module_path!(), "boot-unknown-mac", format_args!(
                        "boot: refused MAC {mac} from {peer}: no target record has it; add one with `vdstream target add ID --vdisk NAME --cache TYPE --mac {mac}` (or start the server with --boot-unknown auto-add --boot-template ID)"));
                    return Ok(boot::message_script(&base, &boot::refusal_lines(&mac, &s.state.name), cfg.retry_secs));
                }
                UnknownMac::AutoAdd { template, prefix } => {
                    let r = store.auto_add_target(&mac, template, prefix, boot::MAX_AUTO_ADDED)?;
                    log::info!("boot: auto-added target {} for MAC {mac} from {peer}, a copy of template {template}", r.id);
                    r
                }
            },
        };
        let layer = select(&store.load(&record.vdisk)?, record.version, Timestamp::now())?;
        if let Admission::Wait { booting, max, ahead, retry_secs } = pacer(&s).admit(&record.id) {
            s.state.log.log(log::Level::Info, module_path!(), "boot-wait", format_args!(
                "boot: target {} (MAC {mac} from {peer}) waits: {booting} booting (at most {max}), {ahead} waiting ahead of it", record.id));
            return Ok(boot::wait_script(&base, &mac, booting, max, ahead, retry_secs));
        }
        log::info!("boot: MAC {mac} from {peer} is target {}, booting vDisk {}@{}", record.id, record.vdisk, boot::version_text(layer));
        s.live.note_boot(&record.id, &format!("{mac} from {peer}: script for {}@{}", record.vdisk, boot::version_text(layer)));
        Ok::<_, StoreError>(boot::target_script(&record, layer, &ScriptContext { base: &base, config: cfg, mac: &mac }))
    })
    .await;
    match r {
        Ok(Ok(body)) => script(body),
        Ok(Err(e)) => {
            s.state.log.log(
                log::Level::Warn,
                module_path!(),
                "boot-failed",
                format_args!("boot: cannot make the script of a machine at {peer}: {e}"),
            );
            script(boot::message_script(
                &base_or_local(&s, &headers),
                &[format!(
                    "the server cannot boot this machine: {}",
                    public_store_text(&e)
                )],
                config(&s).retry_secs,
            ))
        }
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the boot handler failed: {e}\n"),
        ),
    }
}

fn base_or_local(s: &Shared, headers: &HeaderMap) -> String {
    base(s, headers).unwrap_or_else(|_| format!("http://{}", s.local))
}

/// What a boot-file error answers: 404 when the vDisk, version or kernel is not there, 400
/// for a bad name, 500 otherwise.
fn status_of(e: &BootError) -> StatusCode {
    match e {
        BootError::NoKernel { .. }
        | BootError::Image { .. }
        | BootError::Store(StoreError::UnknownVdisk { .. } | StoreError::UnknownVersion { .. }) => {
            StatusCode::NOT_FOUND
        }
        BootError::Store(StoreError::BadName(_) | StoreError::BadInput(_)) => {
            StatusCode::BAD_REQUEST
        }
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// What a machine without credentials is told of a store error: the reason, but never the
/// store's folder or the names of other vDisks and targets (an unknown name's error lists
/// them); the server's log has the whole error.
fn public_store_text(e: &StoreError) -> String {
    match e {
        StoreError::UnknownVdisk { name, .. } => format!("no vDisk named {name:?} on this server: check the target's record (vdstream target show ID)"),
        StoreError::UnknownVersion { .. } | StoreError::BadName(_) | StoreError::BadInput(_) => e.to_string(),
        _ => "the server could not read its store; its log says why".to_string(),
    }
}

/// [`public_store_text`] for a boot-file error.
fn public_text(e: &BootError) -> String {
    match e {
        BootError::Store(e) => public_store_text(e),
        BootError::NoKernel { .. } | BootError::Image { .. } => e.to_string(),
        _ => "the server could not prepare the boot files; its log says why".to_string(),
    }
}

async fn file(
    State(s): State<Arc<Shared>>,
    Extension(ClientAddr(peer)): Extension<ClientAddr>,
    Path((name, version, file)): Path<(String, String, String)>,
    req: Request,
) -> Response {
    let Some(layer) = boot::parse_version(&version) else {
        return text(
            StatusCode::BAD_REQUEST,
            format!(
                "{:?} is not a version: give base or a version number\n",
                boot::ipxe_text(&version)
            ),
        );
    };
    if !matches!(file.as_str(), "vmlinuz" | "initrd.img" | "problem") {
        return text(
            StatusCode::NOT_FOUND,
            "a version's boot files are vmlinuz and initrd.img\n".into(),
        );
    }
    let store_dir = s.state.store.clone();
    let vdisk = name.clone();
    let found = tokio::task::spawn_blocking(move || {
        let store = Store::open(&store_dir)?;
        files::boot_files(&store, &vdisk, layer)
    })
    .await;
    let found = match found {
        Ok(f) => f,
        Err(e) => {
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the boot handler failed: {e}\n"),
            )
        }
    };
    let headers = req.headers().clone();
    match (file.as_str(), found) {
        ("problem", Ok(_)) => script(boot::message_script(&base_or_local(&s, &headers), &[format!("the kernel and initrd of {name}@{version} are there now; the last try may have been cut off")], 5)),
        ("problem", Err(e)) => script(boot::message_script(&base_or_local(&s, &headers), &[public_text(&e)], config(&s).retry_secs)),
        (_, Err(e)) => {
            s.state.log.log(log::Level::Warn, module_path!(), "boot-files", format_args!("boot: {peer} asked for {file} of {name}@{version}: {e}"));
            text(status_of(&e), format!("{}\n", public_text(&e)))
        }
        (f, Ok(files)) => {
            let path = if f == "vmlinuz" { files.kernel } else { files.initrd };
            // No waiting for a place while holding a handler: slow readers holding every
            // place must not stall the scripts of other machines. iPXE's script goes on to
            // the problem script, which retries.
            let Ok(permit) = s.boot_transfers.clone().try_acquire_owned() else {
                s.state.log.log(log::Level::Warn, module_path!(), "boot-busy", format_args!("boot: {peer} asked for {file} of {name}@{version} while every transfer place was taken; answered 503"));
                let mut r = text(StatusCode::SERVICE_UNAVAILABLE, "every transfer place of the boot service is taken; try again in a few seconds\n".into());
                r.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static("5"));
                return r;
            };
            match ServeFile::new(&path).oneshot(req).await {
                Ok(r) => r.map(|b| Body::new(Held { inner: Body::new(b), _permit: permit })),
                Err(e) => match e {},
            }
        }
    }
}

fn json(status: StatusCode, v: serde_json::Value) -> Response {
    (status, axum::Json(v)).into_response()
}

/// Whether target `id` has a record (the pacer keeps windows for records only, so made-up
/// ids cannot fill its memory).
async fn known_target(s: &Shared, id: &str) -> Result<(), Response> {
    let (store_dir, id2) = (s.state.store.clone(), id.to_string());
    let found = tokio::task::spawn_blocking(move || {
        let store = Store::open(&store_dir)?;
        store.target(&id2).map(|_| ())
    })
    .await;
    match found {
        Ok(Ok(())) => Ok(()),
        Ok(Err(StoreError::UnknownTarget { .. } | StoreError::BadName(_))) => Err(json(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": format!("no target record named {:?}", boot::ipxe_text(id)), "what_to_do": "boot the machine with the kernel command line its target script gives (vdstream.target=ID)"}),
        )),
        Ok(Err(e)) => Err(json(
            StatusCode::INTERNAL_SERVER_ERROR,
            serde_json::json!({"error": public_store_text(&e), "what_to_do": "see the server's log"}),
        )),
        Err(e) => Err(json(
            StatusCode::INTERNAL_SERVER_ERROR,
            serde_json::json!({"error": format!("the boot handler failed: {e}"), "what_to_do": "see the server's log"}),
        )),
    }
}

/// `GET /boot/admit/ID`: a place in the boot window for the agent in a machine's
/// initramfs (`target attach --booting`), or how long to wait.
async fn admit(
    State(s): State<Arc<Shared>>,
    Extension(ClientAddr(peer)): Extension<ClientAddr>,
    Path(id): Path<String>,
) -> Response {
    if let Err(r) = known_target(&s, &id).await {
        return r;
    }
    match pacer(&s).admit(&id) {
        Admission::Admitted => {
            let f = pacer(&s).figures();
            json(
                StatusCode::OK,
                serde_json::json!({"admitted": true, "booting": f.booting, "max_booting": f.max_booting}),
            )
        }
        Admission::Wait {
            booting,
            max,
            ahead,
            retry_secs,
        } => {
            s.state.log.log(log::Level::Info, module_path!(), "boot-wait", format_args!(
                "boot: target {id}'s agent at {peer} waits: {booting} booting (at most {max}), {ahead} waiting ahead of it"));
            let mut r = json(
                StatusCode::SERVICE_UNAVAILABLE,
                serde_json::json!({
                    "admitted": false, "booting": booting, "max_booting": max, "ahead": ahead, "retry_after_secs": retry_secs,
                    "error": format!("waiting: {booting} booting (at most {max} at once), {ahead} waiting ahead"),
                    "what_to_do": format!("ask again in {retry_secs} s"),
                }),
            );
            if let Ok(v) = axum::http::HeaderValue::from_str(&retry_secs.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
            r
        }
    }
}

/// `GET /boot/booted/ID`: the machine's root is mounted; its boot window closes.
async fn booted(
    State(s): State<Arc<Shared>>,
    Extension(ClientAddr(peer)): Extension<ClientAddr>,
    Path(id): Path<String>,
) -> Response {
    if let Err(r) = known_target(&s, &id).await {
        return r;
    }
    let closed = pacer(&s).booted(&id);
    if closed {
        log::info!("boot: target {id} ({peer}) booted; its boot window closed");
        s.live.note_boot(&id, &format!("booted ({peer})"));
    }
    json(StatusCode::OK, serde_json::json!({"closed": closed}))
}

/// A body that holds a transfer place until it is sent or dropped.
struct Held {
    inner: Body,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl http_body::Body for Held {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertise_gets_the_api_port_when_it_has_none() {
        assert_eq!(with_port("10.0.2.2", 8480), "10.0.2.2:8480");
        assert_eq!(with_port("10.0.2.2:80", 8480), "10.0.2.2:80");
        assert_eq!(with_port("pvs1.lab", 8480), "pvs1.lab:8480");
        assert_eq!(with_port("[fd00::1]", 8480), "[fd00::1]:8480");
        assert_eq!(with_port("[fd00::1]:81", 8480), "[fd00::1]:81");
    }
}
