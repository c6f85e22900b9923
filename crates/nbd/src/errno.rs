//! The one place where errors become NBD wire codes.
//!
//! Block-device errors ([`ErrorKind`]) become transmission-phase errno values, and export
//! open failures ([`OpenError`]) become option reply types. Both matches are exhaustive on
//! purpose: adding an `ErrorKind` or an `OpenError` variant fails to compile until its wire
//! code is chosen here. No other module picks an errno for a device error.

use vdstream_blockdev::ErrorKind;

use crate::proto;
use crate::state::OpenError;

/// The NBD errno for a device error.
///
/// `fast_zero_request` says whether the failed request was a `WRITE_ZEROES` with
/// `NBD_CMD_FLAG_FAST_ZERO`: the spec allows `NBD_ENOTSUP` only there, so "not supported"
/// anywhere else is reported as `NBD_EINVAL`, and a device that answers "not fast" to a
/// request that did not ask for speed is reported as an I/O error (it broke its contract).
pub fn errno_for(kind: ErrorKind, fast_zero_request: bool) -> u32 {
    match kind {
        ErrorKind::Io => proto::EIO,
        ErrorKind::NoSpace => proto::ENOSPC,
        ErrorKind::ReadOnly => proto::EPERM,
        ErrorKind::OutOfRange => proto::EINVAL,
        ErrorKind::Invalid => proto::EINVAL,
        ErrorKind::Shutdown => proto::ESHUTDOWN,
        ErrorKind::NotSupported if fast_zero_request => proto::ENOTSUP,
        ErrorKind::NotSupported => proto::EINVAL,
        ErrorKind::NotFast if fast_zero_request => proto::ENOTSUP,
        ErrorKind::NotFast => proto::EIO,
    }
}

/// The option reply type (`NBD_REP_ERR_*`) for an export that could not be opened.
pub fn rep_err_for(err: &OpenError) -> u32 {
    match err {
        OpenError::Unknown(_) => proto::REP_ERR_UNKNOWN,
        OpenError::Policy(_) => proto::REP_ERR_POLICY,
        OpenError::Busy(_) => proto::REP_ERR_POLICY,
        OpenError::Shutdown(_) => proto::REP_ERR_SHUTDOWN,
        // The spec has no generic "failed" reply; UNKNOWN ("the requested export is not
        // available") is the closest, and the message says why.
        OpenError::Failed(_) => proto::REP_ERR_UNKNOWN,
        // No room now: the spec's "unwilling to continue negotiation" code, which clients
        // take as "try another server or later", never as "no such export".
        OpenError::Full(_) => proto::REP_ERR_SHUTDOWN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enotsup_only_for_fast_zero() {
        assert_eq!(errno_for(ErrorKind::NotFast, true), proto::ENOTSUP);
        assert_eq!(errno_for(ErrorKind::NotSupported, true), proto::ENOTSUP);
        assert_eq!(errno_for(ErrorKind::NotSupported, false), proto::EINVAL);
        assert_eq!(errno_for(ErrorKind::NotFast, false), proto::EIO);
        assert_eq!(errno_for(ErrorKind::NoSpace, false), proto::ENOSPC);
        assert_eq!(errno_for(ErrorKind::ReadOnly, false), proto::EPERM);
        assert_eq!(errno_for(ErrorKind::Shutdown, false), proto::ESHUTDOWN);
    }

    #[test]
    fn open_errors() {
        assert_eq!(
            rep_err_for(&OpenError::Unknown("x".into())),
            proto::REP_ERR_UNKNOWN
        );
        assert_eq!(
            rep_err_for(&OpenError::Policy("x".into())),
            proto::REP_ERR_POLICY
        );
        assert_eq!(
            rep_err_for(&OpenError::Shutdown("x".into())),
            proto::REP_ERR_SHUTDOWN
        );
    }

    #[test]
    fn a_full_server_is_not_an_unknown_export() {
        let full = OpenError::Full("64 connections (--max-connections 64)".into());
        assert_eq!(rep_err_for(&full), proto::REP_ERR_SHUTDOWN);
        assert!(
            full.to_string().starts_with("server full: 64 connections"),
            "{full}"
        );
        // Out of descriptors, however deep the error that says so is wrapped.
        #[derive(Debug, thiserror::Error)]
        #[error("cannot open layer: {0}")]
        struct Wrapped(#[source] std::io::Error);
        assert!(crate::state::is_out_of_fds(&Wrapped(
            std::io::Error::from_raw_os_error(libc::EMFILE)
        )));
        assert!(crate::state::is_out_of_fds(
            &std::io::Error::from_raw_os_error(libc::ENFILE)
        ));
        assert!(!crate::state::is_out_of_fds(&Wrapped(
            std::io::Error::from_raw_os_error(libc::ENOENT)
        )));
    }
}
