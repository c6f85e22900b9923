//! Errors of the object-store backend, each naming the object and what to do.

/// What went wrong, by what the caller should do about it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A bad location or setting.
    #[error("{0}")]
    BadInput(String),
    /// The store refused the credentials (401/403).
    #[error("{0}")]
    Auth(String),
    /// No such bucket or object.
    #[error("{0}")]
    NotFound(String),
    /// Another party holds what this needs (the metadata writer role).
    #[error("{0}")]
    Conflict(String),
    /// An object failed its checksum, or its index does not fit it.
    #[error("{0}")]
    Corrupt(String),
    /// The store did not answer in time, or a local file failed.
    #[error("{0}")]
    Io(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Classifies an `object_store` error about `what`.
    pub fn from_store(e: object_store::Error, what: &str) -> Self {
        let text = e.to_string();
        match e {
            object_store::Error::NotFound { .. } => Error::NotFound(format!("{what}: no such object or bucket ({text})")),
            object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. } => Error::Auth(format!(
                "{what}: the object store refused the credentials ({text}); check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, and that the key may use the bucket")),
            _ if text.contains("NoSuchBucket") => Error::NotFound(format!("{what}: the bucket does not exist ({text}); create it and give the key access")),
            _ if text.contains("InvalidAccessKeyId") || text.contains("SignatureDoesNotMatch") || text.contains("AccessDenied") || text.contains("Forbidden") => Error::Auth(format!(
                "{what}: the object store refused the credentials ({text}); check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")),
            _ => Error::Io(format!("{what}: the object store did not answer ({text}); check that it runs and AWS_ENDPOINT_URL names it")),
        }
    }

    /// For the block layer: the errno a guest sees.
    pub fn into_io(self) -> std::io::Error {
        let kind = match &self {
            Error::NotFound(_) => std::io::ErrorKind::NotFound,
            Error::Auth(_) => std::io::ErrorKind::PermissionDenied,
            _ => std::io::ErrorKind::Other,
        };
        std::io::Error::new(kind, self.to_string())
    }
}

/// `e` about the local `path`.
pub fn local<'a>(
    what: &'static str,
    path: &'a std::path::Path,
) -> impl Fn(std::io::Error) -> Error + 'a {
    move |e| Error::Io(format!("cannot {what} {}: {e}", path.display()))
}
