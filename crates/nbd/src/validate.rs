//! Validation of every transmission request, once, at the edge (nbdkit's
//! `validate_request`), before anything is allocated or any device is called.
//!
//! Invariant: a [`Request`] only exists if it passed [`validate`]; the execution layer
//! below only asserts. Every check derives from the negotiated [`ExportParams`] (whose
//! flags come from [`crate::flags::transmission_flags`]), never from a second list. The
//! errno for each refusal is the one the NBD spec names:
//!
//! | problem                                              | answer      |
//! |------------------------------------------------------|-------------|
//! | bad magic                                            | disconnect  |
//! | WRITE payload over [`MAX_PAYLOAD`]                   | disconnect  |
//! | unknown command, unknown/inapplicable flag           | EINVAL      |
//! | command the export did not advertise                 | EINVAL      |
//! | WRITE / TRIM / WRITE_ZEROES on a read-only export    | EPERM       |
//! | BLOCK_STATUS without a negotiated meta context       | EINVAL      |
//! | FLUSH with nonzero offset or length                  | EINVAL      |
//! | zero length (READ, WRITE, TRIM, ZERO, CACHE, STATUS) | EINVAL      |
//! | READ / WRITE longer than [`MAX_PAYLOAD`]             | EINVAL      |
//! | WRITE / WRITE_ZEROES past the end                    | ENOSPC      |
//! | other commands past the end (or offset overflow)     | EINVAL      |

use vdstream_blockdev::ZeroFlags;

use crate::proto::*;
use crate::wire::RequestHeader;

/// What was negotiated for a connection, as far as validation cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportParams {
    /// Export size in bytes.
    pub size: u64,
    /// The transmission flags that were sent to the client.
    pub flags: u16,
    /// Structured replies were negotiated.
    pub structured: bool,
    /// `base:allocation` was selected for this export (BLOCK_STATUS allowed).
    pub base_allocation: bool,
}

impl ExportParams {
    fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }
    pub fn read_only(&self) -> bool {
        self.has(FLAG_READ_ONLY)
    }
}

/// A validated request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub handle: u64,
    pub command: Command,
    pub offset: u64,
    pub length: u32,
}

/// A validated command with its meaningful flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read { df: bool },
    Write { fua: bool },
    Disconnect,
    Flush,
    Trim { fua: bool },
    Cache,
    WriteZeroes(ZeroFlags),
    BlockStatus { req_one: bool },
}

/// Why a request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// Reply with this errno (and, for a WRITE, skip its payload) and carry on.
    Error { errno: u32, reason: &'static str },
    /// The stream cannot be trusted or would cost too much: close the connection.
    Disconnect(&'static str),
}

fn err(errno: u32, reason: &'static str) -> Rejection {
    Rejection::Error { errno, reason }
}

/// Validates a request header against what was negotiated.
pub fn validate(h: &RequestHeader, x: &ExportParams) -> Result<Request, Rejection> {
    if h.magic != REQUEST_MAGIC {
        return Err(Rejection::Disconnect(
            "bad request magic: the stream is out of sync",
        ));
    }
    if h.command == CMD_WRITE && h.length > MAX_PAYLOAD {
        return Err(Rejection::Disconnect(
            "WRITE payload larger than the 32 MiB maximum block size",
        ));
    }

    // Which flags each command may carry (FUA on any command once SEND_FUA was advertised).
    let fua_ok = if x.has(FLAG_SEND_FUA) {
        CMD_FLAG_FUA
    } else {
        0
    };
    let allowed = fua_ok
        | match h.command {
            CMD_READ if x.has(FLAG_SEND_DF) => CMD_FLAG_DF,
            CMD_WRITE_ZEROES => {
                CMD_FLAG_NO_HOLE
                    | if x.has(FLAG_SEND_FAST_ZERO) {
                        CMD_FLAG_FAST_ZERO
                    } else {
                        0
                    }
            }
            CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
            CMD_READ | CMD_WRITE | CMD_DISC | CMD_FLUSH | CMD_TRIM | CMD_CACHE => 0,
            _ => return Err(err(EINVAL, "unknown command")),
        };
    if h.flags & !allowed != 0 {
        return Err(err(
            EINVAL,
            "command flag not valid for this command or not negotiated",
        ));
    }
    let has = |f: u16| h.flags & f != 0;

    let command = match h.command {
        CMD_READ => Command::Read {
            df: has(CMD_FLAG_DF),
        },
        CMD_WRITE => Command::Write {
            fua: has(CMD_FLAG_FUA),
        },
        CMD_DISC => {
            return Ok(Request {
                handle: h.handle,
                command: Command::Disconnect,
                offset: 0,
                length: 0,
            })
        }
        CMD_FLUSH => Command::Flush,
        CMD_TRIM => Command::Trim {
            fua: has(CMD_FLAG_FUA),
        },
        CMD_CACHE => Command::Cache,
        CMD_WRITE_ZEROES => Command::WriteZeroes(ZeroFlags {
            may_trim: !has(CMD_FLAG_NO_HOLE),
            fast_only: has(CMD_FLAG_FAST_ZERO),
            fua: has(CMD_FLAG_FUA),
        }),
        _ => Command::BlockStatus {
            req_one: has(CMD_FLAG_REQ_ONE),
        },
    };

    let writes = matches!(
        command,
        Command::Write { .. } | Command::Trim { .. } | Command::WriteZeroes(_)
    );
    if writes && x.read_only() {
        return Err(err(EPERM, "the export is read-only"));
    }
    let advertised = match command {
        Command::Flush => x.has(FLAG_SEND_FLUSH),
        Command::Trim { .. } => x.has(FLAG_SEND_TRIM),
        Command::WriteZeroes(_) => x.has(FLAG_SEND_WRITE_ZEROES),
        Command::Cache => x.has(FLAG_SEND_CACHE),
        _ => true,
    };
    if !advertised {
        return Err(err(EINVAL, "the export did not advertise this command"));
    }
    if matches!(command, Command::BlockStatus { .. }) && !(x.structured && x.base_allocation) {
        return Err(err(EINVAL, "BLOCK_STATUS needs base:allocation selected with NBD_OPT_SET_META_CONTEXT for this export"));
    }

    if command == Command::Flush {
        if h.offset != 0 || h.length != 0 {
            return Err(err(EINVAL, "FLUSH must have zero offset and length"));
        }
        return Ok(Request {
            handle: h.handle,
            command,
            offset: 0,
            length: 0,
        });
    }
    if h.length == 0 {
        return Err(err(EINVAL, "zero-length request"));
    }
    if matches!(command, Command::Read { .. }) && h.length > MAX_PAYLOAD {
        return Err(err(
            EINVAL,
            "READ longer than the 32 MiB maximum block size",
        ));
    }
    let in_range = matches!(h.offset.checked_add(h.length as u64), Some(end) if end <= x.size);
    if !in_range {
        let errno = if matches!(command, Command::Write { .. } | Command::WriteZeroes(_)) {
            ENOSPC
        } else {
            EINVAL
        };
        return Err(err(errno, "request reaches past the end of the export"));
    }
    Ok(Request {
        handle: h.handle,
        command,
        offset: h.offset,
        length: h.length,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flags::transmission_flags;
    use vdstream_blockdev::Caps;

    fn caps() -> Caps {
        Caps {
            read_only: false,
            flush: true,
            fua: true,
            trim: true,
            zeroes: true,
            fast_zero: true,
            cache: true,
            block_status: true,
            multi_conn: true,
            may_block: false,
            preferred_block: 4096,
        }
    }
    fn params(caps: Caps) -> ExportParams {
        ExportParams {
            size: 1 << 20,
            flags: transmission_flags(&caps, true),
            structured: true,
            base_allocation: true,
        }
    }
    fn hdr(command: u16, flags: u16, offset: u64, length: u32) -> RequestHeader {
        RequestHeader {
            magic: REQUEST_MAGIC,
            flags,
            command,
            handle: 1,
            offset,
            length,
        }
    }
    fn errno(r: Result<Request, Rejection>) -> u32 {
        match r {
            Err(Rejection::Error { errno, .. }) => errno,
            other => panic!("expected an errno, got {other:?}"),
        }
    }

    #[test]
    fn good_requests_pass() {
        let x = params(caps());
        let r = validate(
            &hdr(
                CMD_WRITE_ZEROES,
                CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
                0,
                4096,
            ),
            &x,
        )
        .unwrap();
        assert_eq!(
            r.command,
            Command::WriteZeroes(ZeroFlags {
                may_trim: false,
                fast_only: true,
                fua: false
            })
        );
        assert_eq!(
            validate(&hdr(CMD_READ, CMD_FLAG_DF, (1 << 20) - 1, 1), &x)
                .unwrap()
                .command,
            Command::Read { df: true }
        );
        assert!(
            validate(&hdr(CMD_READ, CMD_FLAG_FUA, 0, 1), &x).is_ok(),
            "FUA is valid on any command"
        );
        assert!(validate(&hdr(CMD_FLUSH, 0, 0, 0), &x).is_ok());
        assert!(validate(&hdr(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 0, 1 << 20), &x).is_ok());
    }

    #[test]
    fn errnos_follow_the_spec() {
        let x = params(caps());
        assert_eq!(errno(validate(&hdr(99, 0, 0, 1), &x)), EINVAL);
        assert_eq!(
            errno(validate(&hdr(CMD_READ, CMD_FLAG_REQ_ONE, 0, 1), &x)),
            EINVAL
        );
        assert_eq!(errno(validate(&hdr(CMD_READ, 0, 1 << 20, 1), &x)), EINVAL);
        assert_eq!(errno(validate(&hdr(CMD_READ, 0, u64::MAX, 2), &x)), EINVAL);
        assert_eq!(errno(validate(&hdr(CMD_WRITE, 0, 1 << 20, 1), &x)), ENOSPC);
        assert_eq!(
            errno(validate(&hdr(CMD_WRITE_ZEROES, 0, u64::MAX, 1), &x)),
            ENOSPC
        );
        assert_eq!(errno(validate(&hdr(CMD_TRIM, 0, 1 << 20, 1), &x)), EINVAL);
        assert_eq!(
            errno(validate(&hdr(CMD_READ, 0, 0, MAX_PAYLOAD + 1), &x)),
            EINVAL
        );
        assert_eq!(errno(validate(&hdr(CMD_READ, 0, 0, 0), &x)), EINVAL);
        assert_eq!(errno(validate(&hdr(CMD_FLUSH, 0, 1, 0), &x)), EINVAL);
        assert_eq!(
            errno(validate(&hdr(CMD_READ, CMD_FLAG_PAYLOAD_LEN, 0, 1), &x)),
            EINVAL
        );
    }

    #[test]
    fn unadvertised_and_read_only() {
        let ro = params(Caps {
            read_only: true,
            flush: false,
            cache: false,
            ..caps()
        });
        assert_eq!(errno(validate(&hdr(CMD_WRITE, 0, 0, 1), &ro)), EPERM);
        assert_eq!(errno(validate(&hdr(CMD_TRIM, 0, 0, 1), &ro)), EPERM);
        assert_eq!(errno(validate(&hdr(CMD_WRITE_ZEROES, 0, 0, 1), &ro)), EPERM);
        assert_eq!(errno(validate(&hdr(CMD_FLUSH, 0, 0, 0), &ro)), EINVAL);
        assert_eq!(errno(validate(&hdr(CMD_CACHE, 0, 0, 1), &ro)), EINVAL);
        assert_eq!(
            errno(validate(&hdr(CMD_WRITE, CMD_FLAG_FUA, 0, 1), &ro)),
            EINVAL,
            "FUA not advertised"
        );
        let no_ctx = ExportParams {
            base_allocation: false,
            ..params(caps())
        };
        assert_eq!(
            errno(validate(&hdr(CMD_BLOCK_STATUS, 0, 0, 1), &no_ctx)),
            EINVAL
        );
        let no_fast = params(Caps {
            fast_zero: false,
            ..caps()
        });
        assert_eq!(
            errno(validate(
                &hdr(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 1),
                &no_fast
            )),
            EINVAL
        );
        let simple = ExportParams {
            flags: transmission_flags(&caps(), false),
            ..params(caps())
        };
        assert_eq!(
            errno(validate(&hdr(CMD_READ, CMD_FLAG_DF, 0, 1), &simple)),
            EINVAL
        );
    }

    #[test]
    fn disconnects() {
        let x = params(caps());
        let bad_magic = RequestHeader {
            magic: 0x1234,
            ..hdr(CMD_READ, 0, 0, 1)
        };
        assert!(matches!(
            validate(&bad_magic, &x),
            Err(Rejection::Disconnect(_))
        ));
        assert!(matches!(
            validate(&hdr(CMD_WRITE, 0, 0, MAX_PAYLOAD + 1), &x),
            Err(Rejection::Disconnect(_))
        ));
        assert_eq!(
            validate(&hdr(CMD_DISC, 0, 0, 0), &x).unwrap().command,
            Command::Disconnect
        );
    }
}
