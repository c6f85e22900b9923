//! Failed authentications at the API, seen and slowed: a wrong or revoked bearer token, or
//! an `Authorization` field that is not `Bearer TOKEN`, is logged with the client's
//! address (rate-limited), counted for `/metrics`, and counted against the address by the
//! NBD side's per-source penalties ([`vdstream_nbd::penalty`], with the server's
//! `--handshake-penalty` settings, in a table of the API's own). An address under penalty
//! is answered 429 with `Retry-After` before its credential is looked at, whatever it
//! sends. Tokens hold 256 random bits, so guessing is no threat to them; what this buys
//! is an administrator who sees the attempt, and a guesser who pays for it.
//!
//! Also counted here: agents' status reports refused for want of a credential (or of the
//! right one), which an agent started before the first token was made runs into.
//!
//! Invariants: nothing here formats a presented token; the table of addresses is bounded
//! (`PenaltyConfig::max_sources`); the host's own loopback addresses are exempt by
//! default, as they are from the NBD penalties.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vdstream_nbd::lograte::LogLimiter;
use vdstream_nbd::penalty::{Failure, Penalties, PenaltyConfig};

/// See the module docs.
#[derive(Debug)]
pub(crate) struct AuthFailures {
    penalties: Penalties,
    /// A few lines a second at most, whatever the flood: each line is one failure, with
    /// its address; the limiter says how many it held back.
    log: LogLimiter,
    failures: AtomicU64,
    penalized: AtomicU64,
    reports_refused: AtomicU64,
}

/// What `/metrics` shows of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AuthCounts {
    /// Requests whose credential was wrong (an unknown or revoked token, a malformed field).
    pub failures: u64,
    /// Requests answered 429 because their address was under penalty.
    pub penalized: u64,
    /// Agent status reports refused by authorization (401, 403).
    pub reports_refused: u64,
}

impl AuthFailures {
    pub fn new(config: PenaltyConfig) -> AuthFailures {
        AuthFailures {
            penalties: Penalties::new(config),
            log: LogLimiter::new(1, 3),
            failures: AtomicU64::new(0),
            penalized: AtomicU64::new(0),
            reports_refused: AtomicU64::new(0),
        }
    }

    /// How much longer requests from `client` are refused, if they are (counted, and
    /// logged rate-limited).
    pub fn penalized(&self, client: SocketAddr) -> Option<Duration> {
        let left = self.penalties.penalized(client.ip(), Instant::now())?;
        self.penalized.fetch_add(1, Ordering::Relaxed);
        self.log.log(log::Level::Warn, module_path!(), "api-penalized", format_args!(
            "HTTP API: refused a request from {client}: its address failed too many authentications, {} s of its penalty left (--handshake-penalty)",
            left.as_secs().max(1)
        ));
        Some(left)
    }

    /// Counts a failed authentication of `client` (`why`: what was wrong, never the token).
    pub fn failed(&self, client: SocketAddr, why: &str) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        let failure = self.penalties.failed(client.ip(), Instant::now());
        self.log.log(
            log::Level::Warn,
            module_path!(),
            "api-auth-failed",
            format_args!("HTTP API: failed authentication from {client}: {why}"),
        );
        if let Failure::Penalized { penalty, strike } = failure {
            let c = self.penalties.config();
            log::warn!(
                "HTTP API: {} failed {} authentications within {} s: its requests are refused (429) for {} s{} (--handshake-penalty)",
                client.ip(),
                c.max_failures,
                c.window.as_secs(),
                penalty.as_secs(),
                if strike > 1 { format!(", its penalty number {strike}") } else { String::new() }
            );
        }
    }

    /// Counts an agent's status report for target `id` from `client` that authorization
    /// refused with `status` (401: no credential or a bad one; 403: one that may not
    /// report for `id`), and logs it (rate-limited) with what the agent needs.
    pub fn report_refused(&self, id: &str, client: SocketAddr, status: u16) {
        self.reports_refused.fetch_add(1, Ordering::Relaxed);
        // The id comes off the request line: shown as it is only when it is a plain name.
        let plain = !id.is_empty()
            && id.len() <= 64
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        let id = if plain {
            id.to_string()
        } else {
            format!("{:?}", id.chars().take(64).collect::<String>())
        };
        let why = if status == 401 {
            "it has no credential the API knows"
        } else {
            "its credential may not report for this target"
        };
        self.log.log(log::Level::Warn, module_path!(), "api-report-refused", format_args!(
            "HTTP API: refused a status report of target {id} from {client} ({status}): {why}; the agent needs a token of role operator \
             (VDSTREAM_TOKEN_FILE in its environment) or, over https, its target certificate (VDSTREAM_TLS_CERTIFICATES)"
        ));
    }

    pub fn counts(&self) -> AuthCounts {
        AuthCounts {
            failures: self.failures.load(Ordering::Relaxed),
            penalized: self.penalized.load(Ordering::Relaxed),
            reports_refused: self.reports_refused.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn an_address_that_keeps_failing_is_penalized_and_others_are_not() {
        let f = AuthFailures::new(PenaltyConfig {
            max_failures: 3,
            ..PenaltyConfig::default()
        });
        let guesser = addr("192.0.2.9:5000");
        for _ in 0..2 {
            f.failed(guesser, "the bearer token is not known or was revoked");
            assert_eq!(f.penalized(guesser), None, "not before the third failure");
        }
        f.failed(
            addr("192.0.2.9:5001"),
            "the bearer token is not known or was revoked",
        );
        let left = f
            .penalized(addr("192.0.2.9:6000"))
            .expect("the address, whatever its port, is penalized");
        assert!(
            left > Duration::from_secs(25) && left <= Duration::from_secs(30),
            "{left:?}"
        );
        assert_eq!(
            f.penalized(addr("192.0.2.10:5000")),
            None,
            "another address is not touched"
        );
        assert_eq!(f.penalized(addr("127.0.0.1:5000")), None);
        for _ in 0..5 {
            f.failed(addr("127.0.0.1:5000"), "x");
        }
        assert_eq!(
            f.penalized(addr("127.0.0.1:5000")),
            None,
            "the host itself is exempt by default"
        );
        f.report_refused("pc-01", addr("192.0.2.20:5000"), 401);
        assert_eq!(
            f.counts(),
            AuthCounts {
                failures: 8,
                penalized: 1,
                reports_refused: 1
            }
        );
    }
}
