//! How a failed command ends: one exit status per class of failure, and under `--json` one
//! JSON object on stdout that says the same as the message on stderr.
//!
//! | status | kind          | for example                                                   |
//! |--------|---------------|---------------------------------------------------------------|
//! | 0      | —             | success (also: stdout closed early, as by `| head -1`)        |
//! | 1      | `other`       | anything not below                                            |
//! | 2      | `usage`       | a bad argument, option, name or size (clap's own status too)  |
//! | 3      | `not_found`   | no such vDisk, version, target, store, status file, CA; 404   |
//! | 4      | `conflict`    | refused by the state of things: in use, exists, attached, changed meanwhile; 409, 412 |
//! | 5      | `io`          | an I/O error, a damaged or missing file of the store          |
//! | 6      | `unavailable` | no server answers (connection refused, timeout), agent stopped|
//! | 7      | `insecure`    | a server asked to listen off loopback without TLS or --insecure |
//! | 8      | `denied`      | the API refused who asked: no, a wrong or a revoked token (401), a role too small (403) |
//!
//! The kind comes from the first error in the chain whose type says it (outermost first):
//! the library error types ([`StoreError`], [`ClientError`], [`AgentError`], [`PkiError`], the
//! block-device error, `std::io::Error`), or a [`Failure`] the command made itself.
//! `--json` anywhere on the command line selects the JSON form:
//! `{"error": {"kind": "not_found", "status": 3, "message": "..."}}`, unless the command
//! already printed its own document (`bench --verify --json` with mismatches, `target
//! status --json` of a stopped agent): stdout then stays that one document, and the
//! status and stderr say the failure.

use std::fmt;

use vdstream_agent::client::ClientError;
use vdstream_agent::AgentError;
use vdstream_boot::BootError;
use vdstream_store::StoreError;
use vdstream_tls::pki::PkiError;

/// A class of failure, and its exit status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Other,
    Usage,
    NotFound,
    Conflict,
    Io,
    Unavailable,
    Insecure,
    Denied,
}

impl Kind {
    pub fn code(self) -> i32 {
        match self {
            Kind::Other => 1,
            Kind::Usage => 2,
            Kind::NotFound => 3,
            Kind::Conflict => 4,
            Kind::Io => crate::output::IO_STATUS,
            Kind::Unavailable => 6,
            Kind::Insecure => 7,
            Kind::Denied => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Other => "other",
            Kind::Usage => "usage",
            Kind::NotFound => "not_found",
            Kind::Conflict => "conflict",
            Kind::Io => "io",
            Kind::Unavailable => "unavailable",
            Kind::Insecure => "insecure",
            Kind::Denied => "denied",
        }
    }
}

/// The "Exit status" section of `vdstream --help` (main.rs's after_help ends with it; a
/// macro, since clap's attribute takes a literal or `concat!`).
macro_rules! exit_status_help {
    () => {
        "\
Exit status:
  0 success (also when stdout closes early, as with `| head -1`)
  1 other failure
  2 usage: a bad argument, option, name or size
  3 not found: no such vDisk, version, target, store, status or CA
  4 conflict: refused by the current state (in use, already exists, already attached)
  5 I/O: a read or write failed, a store file is damaged or missing
  6 unavailable: no server answers, or the target's agent is not running
  7 insecure: a server asked to listen off loopback without TLS (see --insecure)
  8 denied: the API refused the caller: no, a wrong or a revoked token, or a role too small
With --json, a failure also prints one JSON object on stdout (unless the command's
own document is already there):
  {\"error\": {\"kind\": \"not_found\", \"status\": 3, \"message\": \"...\"}}"
    };
}

#[cfg(test)]
pub const HELP: &str = exit_status_help!();

/// A failure the CLI classifies itself. `reported`: the command already printed its JSON
/// document on stdout (e.g. `target status --json` of a stopped agent), so no error object
/// follows it.
#[derive(Debug)]
pub struct Failure {
    pub kind: Kind,
    pub message: String,
    pub reported: bool,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Failure {}

/// An error of `kind` with `message`.
pub fn fail(kind: Kind, message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Failure {
        kind,
        message: message.into(),
        reported: false,
    })
}

fn of_store(e: &StoreError) -> Kind {
    match e {
        StoreError::BadName(_) | StoreError::BadInput(_) | StoreError::Inconsistent(_) => {
            Kind::Usage
        }
        StoreError::NoStore { .. }
        | StoreError::UnknownVdisk { .. }
        | StoreError::UnknownVersion { .. }
        | StoreError::UnknownTarget { .. } => Kind::NotFound,
        StoreError::Refused(_) | StoreError::Changed { .. } => Kind::Conflict,
        StoreError::Corrupt { .. }
        | StoreError::MissingFile { .. }
        | StoreError::Io { .. }
        | StoreError::Image(_) => Kind::Io,
        _ => Kind::Other,
    }
}

fn of_client(e: &ClientError) -> Kind {
    match e {
        ClientError::BadUrl(_) | ClientError::Credentials(_) => Kind::Usage,
        ClientError::Connect { .. } | ClientError::Io { .. } => Kind::Unavailable,
        ClientError::Protocol { .. } => Kind::Other,
        ClientError::Api { status, .. } => match status {
            400 | 405 | 413 | 422 => Kind::Usage,
            401 | 403 => Kind::Denied,
            404 => Kind::NotFound,
            409 | 412 => Kind::Conflict,
            502..=504 => Kind::Unavailable,
            _ => Kind::Other,
        },
    }
}

fn of_agent(e: &AgentError) -> Option<Kind> {
    use vdstream_wcache::space::CacheDirError;
    Some(match e {
        AgentError::BadEndpoint { .. }
        | AgentError::MixedServers { .. }
        | AgentError::NoEndpoint
        | AgentError::BadTarget { .. }
        | AgentError::Migration { .. } => Kind::Usage,
        AgentError::NoTargetRecord { .. } | AgentError::NoStatus { .. } => Kind::NotFound,
        AgentError::AlreadyAttached { .. } | AgentError::SocketInUse { .. } => Kind::Conflict,
        AgentError::NoServer { .. } => Kind::Unavailable,
        AgentError::KernelNbd { message, .. } if message.starts_with("is busy") => Kind::Conflict,
        AgentError::KernelNbd { message, .. }
            if message.starts_with("is not an NBD device")
                || message.starts_with("does not exist") =>
        {
            Kind::Usage
        }
        AgentError::KernelNbd { .. } => Kind::Other,
        AgentError::OverflowDevice { .. } => Kind::Usage,
        AgentError::Cache { .. } | AgentError::Trace { .. } => Kind::Io,
        AgentError::CacheDir { reason, .. } => match reason {
            CacheDirError::NoParent { .. } => Kind::NotFound,
            CacheDirError::NotADir { .. } => Kind::Usage,
            CacheDirError::Create { .. }
            | CacheDirError::Statvfs { .. }
            | CacheDirError::TooLittleSpace { .. } => Kind::Io,
        },
        // The io::Error is held, not chained (its text is in the message once).
        AgentError::Io { err, .. } => of_io(err),
        // Its cause further down the chain, if any, says more.
        AgentError::Api { .. } => return None,
    })
}

/// An error of a store in object storage.
pub fn of_objstore(e: &vdstream_objstore::Error) -> Kind {
    use vdstream_objstore::Error as E;
    match e {
        E::BadInput(_) | E::Auth(_) => Kind::Usage,
        E::NotFound(_) => Kind::NotFound,
        E::Corrupt(_) => Kind::Io,
        E::Conflict(_) => Kind::Conflict,
        E::Io(_) => Kind::Unavailable,
    }
}

fn of_pki(e: &PkiError) -> Kind {
    match e {
        PkiError::BadInput(_) => Kind::Usage,
        PkiError::NoCa { .. } | PkiError::NotIssued(_) => Kind::NotFound,
        PkiError::Exists { .. } | PkiError::AlreadyRevoked(_) => Kind::Conflict,
        PkiError::Io { err, .. } => of_io(err),
        PkiError::Damaged { .. } => Kind::Io,
        PkiError::Sign { .. } => Kind::Other,
    }
}

fn of_io(e: &std::io::Error) -> Kind {
    use std::io::ErrorKind as K;
    match e.kind() {
        K::NotFound => Kind::NotFound,
        K::AlreadyExists | K::AddrInUse => Kind::Conflict,
        K::ConnectionRefused
        | K::ConnectionReset
        | K::ConnectionAborted
        | K::TimedOut
        | K::NotConnected => Kind::Unavailable,
        K::InvalidInput => Kind::Usage,
        _ => Kind::Io,
    }
}

/// The class of `err`: the first error of its chain whose type says one.
pub fn classify(err: &anyhow::Error) -> Kind {
    for cause in err.chain() {
        if let Some(f) = cause.downcast_ref::<Failure>() {
            return f.kind;
        }
        if let Some(e) = cause.downcast_ref::<StoreError>() {
            return of_store(e);
        }
        if let Some(e) = cause.downcast_ref::<BootError>() {
            return match e {
                BootError::NoKernel { .. } => Kind::NotFound,
                BootError::Image { .. } => Kind::Io,
                BootError::Build { .. } => Kind::Other,
                BootError::Store(e) => of_store(e),
                BootError::Io { source, .. } => of_io(source),
            };
        }
        if let Some(e) = cause.downcast_ref::<ClientError>() {
            return of_client(e);
        }
        if let Some(e) = cause.downcast_ref::<vdstream_objstore::Error>() {
            return of_objstore(e);
        }
        if cause.downcast_ref::<vdstream_demo::BadInput>().is_some() {
            return Kind::Usage;
        }
        if let Some(e) = cause.downcast_ref::<PkiError>() {
            return of_pki(e);
        }
        if let Some(e) = cause.downcast_ref::<AgentError>() {
            if let Some(kind) = of_agent(e) {
                return kind;
            }
            continue;
        }
        if cause.downcast_ref::<vdstream_blockdev::Error>().is_some() {
            return Kind::Io;
        }
        if let Some(e) = cause.downcast_ref::<std::io::Error>() {
            return of_io(e);
        }
        if cause.downcast_ref::<clap::Error>().is_some()
            || cause
                .downcast_ref::<vdstream_nbd::memory::LimitTooSmall>()
                .is_some()
        {
            return Kind::Usage;
        }
    }
    Kind::Other
}

/// Whether `--json` is on the command line (every command's --json means the same).
pub fn json_requested() -> bool {
    std::env::args_os()
        .skip(1)
        .take_while(|a| a != "--")
        .any(|a| a == "--json")
}

/// The error and its causes, `: `-separated, each said once: a cause whose text an outer
/// message already includes (an error that prints its source and also returns it from
/// `source()`) is not repeated ("No such file or directory (os error 2): No such file or
/// directory (os error 2)").
pub fn message(err: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if text.is_empty() || out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// Prints `err` (stderr; with `json`, also the JSON object on stdout) and exits with its status.
pub fn exit_with(err: &anyhow::Error, json: bool) -> ! {
    let kind = classify(err);
    let message = message(err);
    errln!("vdstream: error: {message}");
    let reported = crate::output::wrote_stdout()
        || err
            .chain()
            .any(|c| c.downcast_ref::<Failure>().is_some_and(|f| f.reported));
    if json && !reported {
        let doc = serde_json::json!({"error": {"kind": kind.name(), "status": kind.code(), "message": message}});
        outln!("{doc}");
    }
    std::process::exit(kind.code())
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn library_errors_get_their_class_through_context() {
        let nf: anyhow::Error = StoreError::UnknownVdisk {
            name: "w".into(),
            store: "/s".into(),
            known: String::new(),
        }
        .into();
        assert_eq!(classify(&nf.context("cannot show w")), Kind::NotFound);
        let refused: anyhow::Error = StoreError::Refused("in use".into()).into();
        assert_eq!(classify(&refused), Kind::Conflict);
        let conn = ClientError::Connect {
            url: "http://x".into(),
            err: std::io::ErrorKind::ConnectionRefused.into(),
        };
        assert_eq!(classify(&anyhow::Error::new(conn)), Kind::Unavailable);
        let api = ClientError::Api {
            status: 409,
            error: "busy".into(),
            what_to_do: String::new(),
        };
        assert_eq!(classify(&anyhow::Error::new(api)), Kind::Conflict);
        let api = ClientError::Api {
            status: 404,
            error: "none".into(),
            what_to_do: String::new(),
        };
        assert_eq!(classify(&anyhow::Error::new(api)), Kind::NotFound);
        let io: Result<(), std::io::Error> = Err(std::io::ErrorKind::AddrInUse.into());
        assert_eq!(
            classify(&io.context("cannot listen").unwrap_err()),
            Kind::Conflict
        );
        assert_eq!(
            classify(&fail(Kind::Unavailable, "stopped")),
            Kind::Unavailable
        );
        assert_eq!(classify(&anyhow::anyhow!("plain")), Kind::Other);
        let agent = AgentError::Io {
            what: "cannot bind".into(),
            err: std::io::ErrorKind::PermissionDenied.into(),
        };
        assert_eq!(classify(&anyhow::Error::new(agent)), Kind::Io);
    }

    #[test]
    fn a_cause_is_said_once() {
        let e = ClientError::Connect {
            url: "http://h:1".into(),
            err: std::io::Error::from_raw_os_error(libc::ECONNREFUSED),
        };
        let m = message(&anyhow::Error::new(e).context("cannot list"));
        assert_eq!(m.matches("os error 111").count(), 1, "{m}");
        assert!(
            m.starts_with("cannot list: cannot connect to the vdstream server at http://h:1"),
            "{m}"
        );
        let io: Result<(), std::io::Error> = Err(std::io::Error::from_raw_os_error(libc::ENOENT));
        let m = message(&io.context("cannot open /x").unwrap_err());
        assert_eq!(m, "cannot open /x: No such file or directory (os error 2)");
    }

    #[test]
    fn codes_are_distinct_and_documented() {
        let all = [
            Kind::Other,
            Kind::Usage,
            Kind::NotFound,
            Kind::Conflict,
            Kind::Io,
            Kind::Unavailable,
            Kind::Insecure,
        ];
        let codes: std::collections::BTreeSet<i32> = all.iter().map(|k| k.code()).collect();
        assert_eq!(codes.len(), all.len());
        for k in all {
            assert!(
                HELP.contains(&format!("  {} ", k.code())),
                "{k:?} is in the help"
            );
        }
    }
}
