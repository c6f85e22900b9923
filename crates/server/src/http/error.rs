//! The API's one error document, `{"error": "...", "what_to_do": "..."}`, and the one
//! place that maps store and wire errors to HTTP statuses:
//!
//! | status | when |
//! |---|---|
//! | 400 | malformed request, path, parameter or JSON body; a bad name, size, version |
//! | 404 | unknown route, vDisk or target |
//! | 405 | a known route with another method (with `Allow`) |
//! | 408, 413 | the body was too slow, or too large |
//! | 409 | a rule of the store refuses the change (in use, exists, wrong state) |
//! | 500 | anything else: a damaged or missing file, an I/O error |
//!
//! (What hyper refuses before there is a request, a request line or head that does not
//! parse or is too large, gets hyper's bare 400 or 431 without this document.)

use serde_json::json;
use vdstream_store::StoreError;

/// An error answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub error: String,
    pub what_to_do: String,
}

impl ApiError {
    pub fn new(status: u16, error: impl Into<String>, what_to_do: impl Into<String>) -> Self {
        ApiError { status, error: error.into(), what_to_do: what_to_do.into() }
    }

    pub fn bad_request(error: impl Into<String>, what_to_do: impl Into<String>) -> Self {
        Self::new(400, error, what_to_do)
    }

    pub fn body(&self) -> Vec<u8> {
        let mut b = serde_json::to_vec(&json!({"error": self.error, "what_to_do": self.what_to_do})).expect("serializes");
        b.push(b'\n');
        b
    }
}

/// The advice at the end of a store message (`what went wrong: what to do`), if any.
fn advice_of(message: &str) -> String {
    message.rsplit_once(": ").map(|(_, a)| a.to_string()).unwrap_or_default()
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        let error = e.to_string();
        let (status, what) = match &e {
            StoreError::BadName(m) => (400, m.split_once("; ").map_or(String::new(), |(_, a)| a.to_string())),
            StoreError::BadInput(m) => (400, advice_of(m)),
            StoreError::UnknownVdisk { known, .. } => (404, known.clone()),
            StoreError::UnknownTarget { known, .. } => (404, known.clone()),
            StoreError::UnknownVersion { have, .. } => (404, format!("its versions are: {have}")),
            StoreError::Refused(m) => (409, advice_of(m)),
            StoreError::Corrupt { advice, .. } | StoreError::MissingFile { advice, .. } => (500, advice.clone()),
            StoreError::NoStore { .. } => (500, "create a vDisk first with `vdstream vdisk create`".to_string()),
            _ => (500, "see the server's log; check the store's files and free space".to_string()),
        };
        ApiError { status, error, what_to_do: what }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_errors_map_to_statuses_with_advice() {
        let e: ApiError = StoreError::Refused("vDisk w is in use: stop its targets first".into()).into();
        assert_eq!((e.status, e.what_to_do.as_str()), (409, "stop its targets first"));
        let e: ApiError = StoreError::UnknownTarget { id: "x".into(), store: "/s".into(), known: "known targets: a".into() }.into();
        assert_eq!((e.status, e.what_to_do.as_str()), (404, "known targets: a"));
        let e: ApiError = vdstream_store::names::validate_name("a/b").unwrap_err().into();
        assert_eq!(e.status, 400);
        assert!(e.what_to_do.starts_with("a name is"), "{}", e.what_to_do);
    }
}
