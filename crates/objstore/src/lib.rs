//! vdstream stores on S3-compatible object storage (AWS S3, Garage, MinIO, Ceph RGW).
//!
//! - [`client`]: `s3://BUCKET/PREFIX`, the AWS variables, a blocking face over
//!   `object_store`'s S3 client.
//! - [`layer`]: a layer as one object of its non-zero 1 MiB chunks plus an index of
//!   CRC-32Cs; the chunk cache (RAM, then SSD, single flight, read-ahead) in front of it.
//! - [`mirror`]: a server's local folder of the store's metadata, and the remote root
//!   that reads its layers from the bucket.
//! - [`copy`]: `vdstream store copy` between a folder and a bucket, resumable.
//! - [`record`]: `writer.json`, who the metadata writer is.
//! - [`writer`]: the one server that changes a store in object storage, and publishes.

pub mod client;
pub mod copy;
pub mod error;
pub mod layer;
pub mod mirror;
pub mod record;
pub mod writer;

pub use client::{Bucket, S3Config, S3Location};
pub use error::{Error, Result};

/// Installs ring as the process's rustls provider (reqwest is built without one), once.
pub fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
