//! A store in object storage (`--store s3://BUCKET/PREFIX`) as a server serves it: its
//! metadata mirrored into a local folder, its layers read chunk by chunk through the
//! chunk cache. A mirror sends its API's changes to the store's metadata writer
//! ([`ToWriter`]); the metadata writer's folder is a whole store whose changes are
//! published to the bucket.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use vdstream_objstore::layer::{CacheConfig, ChunkCache};
use vdstream_objstore::writer::Writer;
use vdstream_objstore::{mirror, Bucket, S3Config, S3Location};

use vdstream_contract::size::format_size;

use crate::config::ExtraCounters;
use crate::forwarding::{Forwarder, ToWriter};

/// How a server serves a store in object storage, after flags and file are merged.
#[derive(Debug, Clone)]
pub struct ObjectStoreConfig {
    pub location: S3Location,
    /// `--object-cache`: the folder this store's mirror (and the SSD tier of its chunk
    /// cache) goes under.
    pub cache_base: PathBuf,
    /// `--object-cache-ram`: RAM for chunks.
    pub ram_bytes: u64,
    /// `--object-cache-disk`: SSD bytes for chunks (0: RAM only).
    pub disk_bytes: u64,
    /// `--metadata-writer`: this server is the one that changes the store.
    pub metadata_writer: bool,
    /// `--advertise-url`: where others reach the metadata writer's API (default: from `http`).
    pub advertise_url: Option<String>,
    /// Where this server's API listens.
    pub http: Option<SocketAddr>,
    /// `--tls-certificates`: the API is https, and a mirror checks an https writer with its CA.
    pub tls_certificates: Option<PathBuf>,
    /// `--insecure`: a mirror may send changes (with their tokens) to a plain-http writer
    /// off loopback.
    pub insecure: bool,
    /// The config file's s3-endpoint, s3-region, s3-access-key-id and
    /// s3-secret-access-key; the AWS variables win over them.
    pub s3_endpoint: Option<String>,
    pub s3_region: Option<String>,
    pub s3_access_key_id: Option<String>,
    pub s3_secret_access_key: Option<String>,
}

/// A store in object storage, opened.
#[derive(Debug)]
pub struct ObjectStore {
    /// The folder the server opens as its store.
    pub dir: PathBuf,
    /// A mirror's way to the metadata writer; `None` on the metadata writer.
    pub forward: Option<Forwarder>,
    /// The chunk cache's counters for /metrics.
    pub counters: ExtraCounters,
}

/// Why a store in object storage cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum ObjectStoreError {
    #[error(transparent)]
    Objstore(#[from] vdstream_objstore::Error),
    /// The settings do not fit together; the message says what to give.
    #[error("{0}")]
    Settings(String),
}

/// The metadata writer of this process: its publisher thread holds it weakly, so the
/// process keeps it.
static WRITER: OnceLock<Arc<Writer>> = OnceLock::new();

/// Opens the store of `config`: as its metadata writer (the folder becomes a writable
/// store whose changes are published, refused while another writer is alive), or as a
/// mirror whose API's changes go to the metadata writer.
pub fn open(config: &ObjectStoreConfig) -> Result<ObjectStore, ObjectStoreError> {
    let dir = mirror::default_dir(&config.cache_base, &config.location);
    let s3 = s3_config(config)?;
    let bucket = Bucket::open(config.location.clone(), &s3)?;
    let cache = CacheConfig {
        ram_bytes: config.ram_bytes,
        disk_dir: dir.join("chunks"),
        disk_bytes: config.disk_bytes,
        readahead: 4,
        wait: s3.timeout + Duration::from_secs(1),
    };
    let sizes = format!(
        "chunk cache: {} RAM, {} SSD",
        format_size(cache.ram_bytes),
        format_size(cache.disk_bytes)
    );
    if config.metadata_writer {
        let url = advertised_url(config)?;
        let w = Writer::start(bucket, &dir, &cache, &url)?;
        log::info!(
            "serving {} as its metadata writer from {} ({sizes}); changes go to {url}",
            w.mirror.bucket.location,
            dir.display()
        );
        let counters = chunk_counters(w.mirror.cache.clone());
        let _ = WRITER.set(w);
        return Ok(ObjectStore {
            dir,
            forward: None,
            counters,
        });
    }
    let m = mirror::Mirror::open(bucket, &dir, &cache, Duration::from_secs(2))?;
    log::info!(
        "serving {} from its mirror {} ({sizes}); changes go to its metadata writer",
        m.bucket.location,
        dir.display()
    );
    let forward = ToWriter {
        dir: dir.clone(),
        location: m.bucket.location.to_string(),
        tls: config.tls_certificates.clone(),
        insecure: config.insecure,
    };
    Ok(ObjectStore {
        dir,
        forward: Some(Forwarder(Arc::new(forward))),
        counters: chunk_counters(m.cache.clone()),
    })
}

/// How to reach the bucket: the AWS variables, else the config file's keys (the
/// variables win, as they do for the AWS CLI).
fn s3_config(config: &ObjectStoreConfig) -> Result<S3Config, ObjectStoreError> {
    let mut s3 = S3Config::from_env()?;
    let env_set = |n: &str| std::env::var_os(n).is_some_and(|v| !v.is_empty());
    if !env_set("AWS_ENDPOINT_URL") && !env_set("AWS_ENDPOINT_URL_S3") {
        s3.endpoint = s3.endpoint.or(config.s3_endpoint.clone());
    }
    if !env_set("AWS_REGION") && !env_set("AWS_DEFAULT_REGION") {
        if let Some(r) = &config.s3_region {
            s3.region = r.clone();
        }
    }
    s3.access_key_id = s3.access_key_id.or(config.s3_access_key_id.clone());
    s3.secret_access_key = s3.secret_access_key.or(config.s3_secret_access_key.clone());
    Ok(s3)
}

/// The URL other servers and commands reach the metadata writer's API at:
/// `--advertise-url`, else `--http` when it names a fixed port on a specific address.
fn advertised_url(config: &ObjectStoreConfig) -> Result<String, ObjectStoreError> {
    match (&config.advertise_url, config.http) {
        (Some(u), _) => Ok(u.trim_end_matches('/').to_string()),
        (None, Some(a)) if a.port() != 0 && !a.ip().is_unspecified() => Ok(format!(
            "{}://{a}",
            if config.tls_certificates.is_some() { "https" } else { "http" }
        )),
        (None, Some(_)) => Err(ObjectStoreError::Settings("--metadata-writer with --http on port 0 or an unspecified address: give --advertise-url URL, the address others reach this server's API at".into())),
        (None, None) => Err(ObjectStoreError::Settings("--metadata-writer takes the store's changes through the HTTP API: give --http ADDR".into())),
    }
}

/// The chunk cache's counters for /metrics.
fn chunk_counters(cache: Arc<ChunkCache>) -> ExtraCounters {
    ExtraCounters(Arc::new(move || cache.stats.counters()))
}
