//! Where a store is in object storage (`s3://BUCKET/PREFIX`), how to reach it, and a
//! blocking face over `object_store`'s async S3 client for the store's threads.
//!
//! The endpoint, region and credentials come from the variables the AWS CLI reads
//! (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`).
//! Addressing is path-style (`ENDPOINT/BUCKET/KEY`), which every S3-compatible store
//! serves (Garage, MinIO, Ceph RGW); plain http is allowed, with a warning in the log when
//! the endpoint is not on loopback.

use std::net::IpAddr;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjPath;
use object_store::{
    BackoffConfig, ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig,
};

use crate::error::{Error, Result};

/// The largest metadata object read whole (`vdisk.json`, a target record, the audit trail).
pub const MAX_METADATA: u64 = 256 << 20;

/// `s3://BUCKET/PREFIX`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Location {
    pub bucket: String,
    /// Without leading or trailing '/'; may be empty.
    pub prefix: String,
}

impl S3Location {
    /// Parses `s3://BUCKET[/PREFIX]`; `None` when `text` is not an `s3://` location.
    pub fn parse(text: &str) -> Option<Result<Self>> {
        let rest = text.strip_prefix("s3://")?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_matches('/').to_string();
        let ok_bucket = (3..=63).contains(&bucket.len())
            && bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
            && bucket
                .bytes()
                .next()
                .is_some_and(|b| b.is_ascii_alphanumeric());
        if !ok_bucket {
            return Some(Err(Error::BadInput(format!(
                "{text:?}: {bucket:?} is not a bucket name (3 to 63 lowercase letters, digits, '-' and '.'); write the store as s3://BUCKET/PREFIX"
            ))));
        }
        if prefix
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == "..")
            && !prefix.is_empty()
        {
            return Some(Err(Error::BadInput(format!(
                "{text:?}: the prefix has an empty, '.' or '..' part; write it as s3://BUCKET/a/b"
            ))));
        }
        Some(Ok(S3Location {
            bucket: bucket.to_string(),
            prefix,
        }))
    }

    /// The object key of `rel` (a path inside the store, '/'-separated).
    pub fn key(&self, rel: &str) -> String {
        if self.prefix.is_empty() {
            rel.to_string()
        } else {
            format!("{}/{rel}", self.prefix)
        }
    }
}

impl std::fmt::Display for S3Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.prefix.is_empty() {
            write!(f, "s3://{}", self.bucket)
        } else {
            write!(f, "s3://{}/{}", self.bucket, self.prefix)
        }
    }
}

/// How to reach the object store.
#[derive(Debug, Clone)]
pub struct S3Config {
    pub endpoint: Option<String>,
    pub region: String,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    /// How long one request may take, retries included, before the caller gets an error
    /// (a guest read then gets EIO; the next read tries again).
    pub timeout: Duration,
}

impl S3Config {
    /// From the AWS CLI's variables; `VDSTREAM_S3_TIMEOUT` (seconds, default 30) bounds a
    /// request with its retries.
    pub fn from_env() -> Result<Self> {
        let var = |n: &str| std::env::var(n).ok().filter(|v| !v.is_empty());
        let timeout = match var("VDSTREAM_S3_TIMEOUT") {
            None => Duration::from_secs(30),
            Some(t) => Duration::from_secs_f64(
                t.parse::<f64>()
                    .ok()
                    .filter(|s| *s > 0.0 && *s <= 3600.0)
                    .ok_or_else(|| {
                        Error::BadInput(format!(
                            "VDSTREAM_S3_TIMEOUT={t:?}: give seconds, more than 0 and at most 3600"
                        ))
                    })?,
            ),
        };
        Ok(S3Config {
            endpoint: var("AWS_ENDPOINT_URL_S3").or_else(|| var("AWS_ENDPOINT_URL")),
            region: var("AWS_REGION")
                .or_else(|| var("AWS_DEFAULT_REGION"))
                .unwrap_or_else(|| "us-east-1".into()),
            access_key_id: var("AWS_ACCESS_KEY_ID"),
            secret_access_key: var("AWS_SECRET_ACCESS_KEY"),
            timeout,
        })
    }
}

/// Whether `endpoint` (a URL) names a loopback host.
fn is_loopback(endpoint: &str) -> bool {
    let host = endpoint
        .split("://")
        .nth(1)
        .unwrap_or(endpoint)
        .split('/')
        .next()
        .unwrap_or("");
    let host = host.rsplit_once('@').map(|(_, h)| h).unwrap_or(host);
    let host = if let Some(v6) = host.strip_prefix('[') {
        v6.split(']').next().unwrap_or("")
    } else {
        host.split(':').next().unwrap_or("")
    };
    host == "localhost" || host.parse::<IpAddr>().is_ok_and(|a| a.is_loopback())
}

/// A bucket, with a runtime of its own so that any thread can wait on it.
pub struct Bucket {
    pub location: S3Location,
    store: Arc<AmazonS3>,
    rt: tokio::runtime::Runtime,
    endpoint: String,
}

impl std::fmt::Debug for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} at {}", self.location, self.endpoint)
    }
}

impl Bucket {
    /// Connects to `location` with `config` and checks that the bucket answers with these
    /// credentials (one LIST), so that a wrong key or a missing bucket is named at once.
    pub fn open(location: S3Location, config: &S3Config) -> Result<Self> {
        crate::install_crypto();
        let (Some(key), Some(secret)) = (&config.access_key_id, &config.secret_access_key) else {
            return Err(Error::Auth(format!(
                "{location}: no credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a store other than AWS)"
            )));
        };
        let endpoint = config
            .endpoint
            .clone()
            .unwrap_or_else(|| format!("https://s3.{}.amazonaws.com", config.region));
        let http = endpoint.starts_with("http://");
        if http && !is_loopback(&endpoint) {
            log::warn!(
                "{location}: the object store endpoint {endpoint} is plain http: keys are signed but data and names cross the network unencrypted; use https"
            );
        }
        let per_try = config.timeout.min(Duration::from_secs(30));
        let retry = RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(2),
                base: 2.0,
            },
            max_retries: 10,
            retry_timeout: config.timeout,
        };
        let store = AmazonS3Builder::new()
            .with_endpoint(&endpoint)
            .with_allow_http(http)
            .with_region(&config.region)
            .with_bucket_name(&location.bucket)
            .with_access_key_id(key)
            .with_secret_access_key(secret)
            .with_retry(retry)
            .with_client_options(
                ClientOptions::new()
                    .with_timeout(per_try)
                    .with_connect_timeout(Duration::from_secs(3))
                    .with_allow_http(http),
            )
            .build()
            .map_err(|e| Error::BadInput(format!("{location} at {endpoint}: {e}")))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("vds-s3")
            .enable_all()
            .build()
            .map_err(|e| Error::Io(format!("cannot start the object store's runtime: {e}")))?;
        let bucket = Bucket {
            location,
            store: Arc::new(store),
            rt,
            endpoint,
        };
        bucket.list("store.json").map_err(|e| match e {
            Error::NotFound(_) => Error::NotFound(format!(
                "bucket {:?} does not exist at {}: create it (e.g. `garage bucket create {}`) and give the key access",
                bucket.location.bucket, bucket.endpoint, bucket.location.bucket
            )),
            other => other,
        })?;
        Ok(bucket)
    }

    fn path(&self, rel: &str) -> ObjPath {
        ObjPath::from(self.location.key(rel))
    }

    /// Runs `fut` on the bucket's runtime and waits for it on a channel. Callers are
    /// threads outside that runtime (session threads, the CLI's, `spawn_blocking` tasks):
    /// from one of its own workers the task could sit in that worker's queue while it waits.
    pub fn block<T: Send + 'static>(
        &self,
        fut: impl std::future::Future<Output = T> + Send + 'static,
    ) -> T {
        debug_assert!(
            tokio::runtime::Handle::try_current().map_or(true, |h| h.id() != self.rt.handle().id()),
            "Bucket::block called from a worker of the bucket's own runtime"
        );
        let (tx, rx) = mpsc::sync_channel(1);
        self.rt.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv()
            .expect("the object store's runtime dropped a request")
    }

    pub fn store(&self) -> Arc<AmazonS3> {
        self.store.clone()
    }

    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.rt
    }

    /// The whole object at `rel` (metadata: at most [`MAX_METADATA`] bytes); `None` when
    /// there is none.
    pub fn get(&self, rel: &str) -> Result<Option<Bytes>> {
        self.get_capped(rel, MAX_METADATA)
    }

    /// The whole object at `rel` when it is at most `max` bytes; `None` when there is none.
    /// A larger one is refused before it is read (a hostile or broken store cannot make us
    /// hold it in memory).
    pub fn get_capped(&self, rel: &str, max: u64) -> Result<Option<Bytes>> {
        let (store, path, what) = (self.store.clone(), self.path(rel), self.what(rel));
        self.block(async move {
            match store.get(&path).await {
                Ok(r) if r.meta.size > max => Err(Error::Corrupt(format!(
                    "{what}: {} bytes, more than the {max} this object may have; copy the store again", r.meta.size))),
                Ok(r) => r.bytes().await.map(Some).map_err(|e| Error::from_store(e, &what)),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(Error::from_store(e, &what)),
            }
        })
    }

    /// The size of the object at `rel`; `None` when there is none.
    pub fn size(&self, rel: &str) -> Result<Option<u64>> {
        let (store, path, what) = (self.store.clone(), self.path(rel), self.what(rel));
        self.block(async move {
            match store.head(&path).await {
                Ok(m) => Ok(Some(m.size)),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(Error::from_store(e, &what)),
            }
        })
    }

    /// Bytes `start..end` of the object at `rel`.
    pub fn get_range(&self, rel: &str, start: u64, end: u64) -> Result<Bytes> {
        let (store, path, what) = (self.store.clone(), self.path(rel), self.what(rel));
        self.block(async move {
            store
                .get_range(&path, start..end)
                .await
                .map_err(|e| Error::from_store(e, &what))
        })
    }

    /// Writes `data` as the object at `rel` (one PUT: readers see all of it or the old one).
    pub fn put(&self, rel: &str, data: Bytes) -> Result<()> {
        let (store, path, what) = (self.store.clone(), self.path(rel), self.what(rel));
        self.block(async move {
            store
                .put(&path, PutPayload::from_bytes(data))
                .await
                .map(|_| ())
                .map_err(|e| Error::from_store(e, &what))
        })
    }

    pub fn delete(&self, rel: &str) -> Result<()> {
        let (store, path, what) = (self.store.clone(), self.path(rel), self.what(rel));
        self.block(async move {
            match store.delete(&path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(Error::from_store(e, &what)),
            }
        })
    }

    /// Every object under `rel` (a folder inside the store): its path relative to the
    /// store, size and ETag.
    pub fn list(&self, rel: &str) -> Result<Vec<(String, u64, Option<String>)>> {
        let store = self.store.clone();
        let prefix = self.path(rel);
        let strip = if self.location.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.location.prefix)
        };
        let what = self.what(rel);
        self.block(async move {
            let mut out = Vec::new();
            let mut s = store.list(Some(&prefix));
            while let Some(m) = s.next().await {
                let m = m.map_err(|e| Error::from_store(e, &what))?;
                let key = m.location.to_string();
                let rel = key.strip_prefix(&strip).unwrap_or(&key).to_string();
                out.push((rel, m.size, m.e_tag));
            }
            Ok(out)
        })
    }

    /// "s3://BUCKET/PREFIX/REL" for messages.
    pub fn what(&self, rel: &str) -> String {
        format!("s3://{}/{}", self.location.bucket, self.location.key(rel))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_parse_and_refuse_what_is_not_a_bucket() {
        let l = S3Location::parse("s3://farm-a/sites/paris/")
            .unwrap()
            .unwrap();
        assert_eq!(
            (l.bucket.as_str(), l.prefix.as_str()),
            ("farm-a", "sites/paris")
        );
        assert_eq!(l.key("store.json"), "sites/paris/store.json");
        assert_eq!(l.to_string(), "s3://farm-a/sites/paris");
        let bare = S3Location::parse("s3://farm").unwrap().unwrap();
        assert_eq!(bare.key("store.json"), "store.json");
        assert!(S3Location::parse("/srv/store").is_none());
        for bad in [
            "s3://",
            "s3://ab",
            "s3://Farm",
            "s3://-farm/x",
            "s3://farm/a//b",
            "s3://farm/a/../b",
        ] {
            assert!(
                matches!(S3Location::parse(bad), Some(Err(Error::BadInput(_)))),
                "{bad} was taken"
            );
        }
    }

    #[test]
    fn loopback_endpoints_are_told_from_remote_ones() {
        for e in [
            "http://127.0.0.1:3900",
            "http://localhost:3900/",
            "http://[::1]:3900",
            "http://key@127.0.0.2",
        ] {
            assert!(is_loopback(e), "{e}");
        }
        for e in [
            "http://10.0.2.2:3900",
            "http://garage.lan:3900",
            "https://s3.eu-west-1.amazonaws.com",
        ] {
            assert!(!is_loopback(e), "{e}");
        }
    }
}
