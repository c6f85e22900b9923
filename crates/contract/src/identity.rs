//! Who is asking: the identity an NBD connection or an API call carries, and the role URI
//! by which a vdstream certificate names it.
//!
//! A certificate issued by `vdstream pki issue` carries exactly one subject-alternative-name
//! URI of the form [`ROLE_URI_PREFIX`]`ROLE:NAME`:
//!
//! - `urn:vdstream:target:ID`: a target; `ID` is its target id. It may open its own
//!   `target/ID` and the vDisk its record allows.
//! - `urn:vdstream:server:NAME`: a store server (an agent's upstream peer).
//! - `urn:vdstream:admin:NAME`: an administrator: the maintenance role, may change the farm.
//!
//! Invariants: [`Identity::role_uri`] and [`Identity::from_role_uri`] are inverse on every
//! identity that has a certificate; names follow the vDisk-name / target-id grammar
//! ([`crate::name`]), so an identity can never smuggle a path or an export-name separator.

use std::fmt;

use crate::name::{validate_name, validate_target_id};
use crate::ContractError;

/// What every vdstream role URI starts with.
pub const ROLE_URI_PREFIX: &str = "urn:vdstream:";

/// Who is asking.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Identity {
    /// No TLS is configured: a client of a one-host setup (unix socket or loopback, or a
    /// server started with `--insecure`). It may do everything, as before TLS existed.
    Local,
    /// TLS is configured, but the client showed no verified certificate. It gets only what
    /// the configuration grants anonymous clients.
    Anonymous,
    /// A target, by its target id.
    Target(String),
    /// A store server, by name.
    Server(String),
    /// An administrator, by name: the maintenance role.
    Admin(String),
    /// A client whose certificate the CA signed but that names no vdstream role (no role
    /// URI, as the certificates qemu's and nbdkit's documentation make): its subject's
    /// common name, as [`Identity::verified`] cleans it. `serve-image` serves it, as
    /// nbdkit and qemu-nbd do; the farm's `server` gives it what `--anonymous` grants.
    Verified(String),
}

impl Identity {
    /// The role word in a role URI and in [`Display`](fmt::Display) (`target`, `server`,
    /// `admin`), or `local` / `anonymous` / `certificate`.
    pub fn role(&self) -> &'static str {
        match self {
            Identity::Local => "local",
            Identity::Anonymous => "anonymous",
            Identity::Target(_) => "target",
            Identity::Server(_) => "server",
            Identity::Admin(_) => "admin",
            Identity::Verified(_) => "certificate",
        }
    }

    /// The name within the role (target id, server or administrator name), or the common
    /// name of a [`Identity::Verified`] certificate.
    pub fn name(&self) -> Option<&str> {
        match self {
            Identity::Local | Identity::Anonymous => None,
            Identity::Target(n)
            | Identity::Server(n)
            | Identity::Admin(n)
            | Identity::Verified(n) => Some(n),
        }
    }

    /// The SAN URI a certificate for this identity carries; `None` for `Local`,
    /// `Anonymous` and `Verified` (a certificate without one).
    pub fn role_uri(&self) -> Option<String> {
        match self {
            Identity::Local | Identity::Anonymous | Identity::Verified(_) => None,
            _ => self
                .name()
                .map(|n| format!("{ROLE_URI_PREFIX}{}:{n}", self.role())),
        }
    }

    /// The identity of a verified certificate without a role URI, by its subject's common
    /// name: printable ASCII kept (others become `?`), at most 64 characters, so that it
    /// can go into a log line or a refusal as it is.
    pub fn verified(common_name: &str) -> Identity {
        let shown: String = common_name
            .chars()
            .take(64)
            .map(|c| {
                if c == ' ' || c.is_ascii_graphic() {
                    c
                } else {
                    '?'
                }
            })
            .collect();
        Identity::Verified(shown)
    }

    /// Builds an identity from a role word and a name, checking the name's grammar.
    pub fn new(role: &str, name: &str) -> Result<Identity, ContractError> {
        match role {
            "target" => validate_target_id(name).map(|()| Identity::Target(name.to_string())),
            "server" => validate_name(name).map(|()| Identity::Server(name.to_string())),
            "admin" => validate_name(name).map(|()| Identity::Admin(name.to_string())),
            other => Err(ContractError::BadName(format!(
                "unknown role {other:?}: a vdstream certificate's role is target, server or admin"
            ))),
        }
    }

    /// Reads a SAN URI written by [`Identity::role_uri`].
    pub fn from_role_uri(uri: &str) -> Result<Identity, ContractError> {
        let rest = uri.strip_prefix(ROLE_URI_PREFIX).ok_or_else(|| {
            ContractError::BadName(format!(
                "{uri:?} is not a vdstream role URI (they start with {ROLE_URI_PREFIX})"
            ))
        })?;
        let (role, name) = rest.split_once(':').ok_or_else(|| {
            ContractError::BadName(format!(
                "role URI {uri:?} has no name: it is {ROLE_URI_PREFIX}ROLE:NAME"
            ))
        })?;
        Identity::new(role, name)
    }
}

/// `local`, `anonymous`, or `ROLE:NAME` (as audit lines and refusals show it).
impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            None => f.write_str(self.role()),
            Some(n) => write!(f, "{}:{n}", self.role()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_uris_round_trip() {
        for id in [
            Identity::Target("pc-07".into()),
            Identity::Server("store-a".into()),
            Identity::Admin("alice".into()),
        ] {
            let uri = id.role_uri().unwrap();
            assert!(uri.starts_with(ROLE_URI_PREFIX));
            assert_eq!(Identity::from_role_uri(&uri).unwrap(), id);
        }
        assert_eq!(Identity::Local.role_uri(), None);
        assert_eq!(Identity::Anonymous.role_uri(), None);
    }

    #[test]
    fn bad_role_uris_are_refused_with_the_reason() {
        for (uri, says) in [
            ("urn:other:target:a", "not a vdstream role URI"),
            ("urn:vdstream:target", "has no name"),
            ("urn:vdstream:root:a", "unknown role"),
            ("urn:vdstream:target:../x", "path separator"),
            ("urn:vdstream:admin:", "empty"),
        ] {
            let e = Identity::from_role_uri(uri).unwrap_err().to_string();
            assert!(e.contains(says), "{uri}: {e}");
        }
    }

    #[test]
    fn shown_as_role_and_name() {
        assert_eq!(Identity::Target("pc-07".into()).to_string(), "target:pc-07");
        assert_eq!(Identity::Anonymous.to_string(), "anonymous");
        assert_eq!(Identity::verified("t1").to_string(), "certificate:t1");
    }

    #[test]
    fn a_certificate_without_a_role_is_named_by_its_common_name_cleaned() {
        assert_eq!(
            Identity::verified("Jane Doe"),
            Identity::Verified("Jane Doe".into())
        );
        assert_eq!(
            Identity::verified("a\nb\u{1b}]c\u{e9}"),
            Identity::Verified("a?b?]c?".into())
        );
        assert_eq!(
            Identity::verified(&"x".repeat(100)).name().map(str::len),
            Some(64)
        );
        assert_eq!(
            Identity::verified("t1").role_uri(),
            None,
            "it names no role"
        );
    }
}
