//! What the server advertises, derived from [`Caps`] in one place.
//!
//! Invariant: the transmission flags sent at `NBD_OPT_GO` / `NBD_OPT_EXPORT_NAME` and the
//! checks in [`crate::validate`] both come from [`transmission_flags`], so what the server
//! says it does and what it accepts cannot drift apart. Nothing here is a hand-kept list.

use vdstream_blockdev::Caps;

use crate::proto::*;

/// The transmission flags for an export with `caps`.
///
/// `structured` says whether the client negotiated structured replies (it gates
/// `NBD_FLAG_SEND_DF`, which the spec says MUST be clear without them). A read-only export
/// advertises none of the write-side features (FUA, TRIM, WRITE_ZEROES, FAST_ZERO): the
/// client must not send them, and if it does anyway the request is refused with EPERM.
pub fn transmission_flags(caps: &Caps, structured: bool) -> u16 {
    let writable = !caps.read_only;
    let mut flags = FLAG_HAS_FLAGS;
    let mut set = |cond: bool, flag: u16| {
        if cond {
            flags |= flag;
        }
    };
    set(caps.read_only, FLAG_READ_ONLY);
    set(caps.flush, FLAG_SEND_FLUSH);
    set(writable && caps.fua, FLAG_SEND_FUA);
    set(writable && caps.trim, FLAG_SEND_TRIM);
    set(writable && caps.zeroes, FLAG_SEND_WRITE_ZEROES);
    // FAST_ZERO MUST be clear when WRITE_ZEROES is.
    set(
        writable && caps.zeroes && caps.fast_zero,
        FLAG_SEND_FAST_ZERO,
    );
    set(caps.cache, FLAG_SEND_CACHE);
    set(caps.multi_conn, FLAG_CAN_MULTI_CONN);
    // Reads are always answered with a single content chunk when DF is set, so DF is
    // supported whenever structured replies are.
    set(structured, FLAG_SEND_DF);
    flags
}

/// Block size constraints advertised in `NBD_INFO_BLOCK_SIZE`: (minimum, preferred, maximum).
///
/// Minimum is 1 (no alignment needed: every device handles byte ranges). Preferred comes
/// from `caps.preferred_block`, forced into what the spec allows (a power of two, at least
/// 512, at most the maximum). Maximum is [`MAX_PAYLOAD`].
pub fn block_size(caps: &Caps) -> (u32, u32, u32) {
    let mut preferred = caps.preferred_block;
    if !preferred.is_power_of_two() || preferred < 512 {
        preferred = 4096;
    }
    (1, preferred.min(MAX_PAYLOAD), MAX_PAYLOAD)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rw() -> Caps {
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

    #[test]
    fn writable_export_advertises_everything_it_can() {
        let f = transmission_flags(&rw(), true);
        for flag in [
            FLAG_HAS_FLAGS,
            FLAG_SEND_FLUSH,
            FLAG_SEND_FUA,
            FLAG_SEND_TRIM,
            FLAG_SEND_WRITE_ZEROES,
            FLAG_SEND_FAST_ZERO,
            FLAG_SEND_CACHE,
            FLAG_CAN_MULTI_CONN,
            FLAG_SEND_DF,
        ] {
            assert_ne!(f & flag, 0, "flag {flag:#x} missing from {f:#x}");
        }
        assert_eq!(f & FLAG_READ_ONLY, 0);
        assert_eq!(transmission_flags(&rw(), false) & FLAG_SEND_DF, 0);
    }

    #[test]
    fn read_only_export_hides_write_features() {
        let caps = Caps {
            read_only: true,
            multi_conn: false,
            ..rw()
        };
        let f = transmission_flags(&caps, false);
        assert_ne!(f & FLAG_READ_ONLY, 0);
        for flag in [
            FLAG_SEND_FUA,
            FLAG_SEND_TRIM,
            FLAG_SEND_WRITE_ZEROES,
            FLAG_SEND_FAST_ZERO,
            FLAG_CAN_MULTI_CONN,
        ] {
            assert_eq!(f & flag, 0, "flag {flag:#x} set on read-only export");
        }
    }

    #[test]
    fn fast_zero_needs_write_zeroes() {
        let caps = Caps {
            zeroes: false,
            ..rw()
        };
        assert_eq!(transmission_flags(&caps, true) & FLAG_SEND_FAST_ZERO, 0);
    }

    #[test]
    fn block_size_is_sane() {
        assert_eq!(block_size(&rw()), (1, 4096, MAX_PAYLOAD));
        assert_eq!(
            block_size(&Caps {
                preferred_block: 3000,
                ..rw()
            })
            .1,
            4096
        );
        assert_eq!(
            block_size(&Caps {
                preferred_block: 1 << 30,
                ..rw()
            })
            .1,
            MAX_PAYLOAD
        );
    }
}
