//! Rate-limited logging of failures that a hostile or broken client can provoke at will
//! (refused opens, I/O errors, a full server or a full cache): every kind of line gets a
//! small token bucket, so the log shows each failure while they are rare and a count once
//! they flood. The one limiter of the workspace: the NBD server, the store server and the
//! write caches all log through it.
//!
//! Invariants: a kind logs at most `burst` lines at once and `per_second` lines a second
//! on average; every line held back is counted, and the next line of that kind that is let
//! through is preceded by one "suppressed N similar" line, so nothing is lost silently.
//! Kinds are independent: a flood of one never hides another.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// See the module docs. Cheap to share (`&self` methods; one short lock per call).
#[derive(Debug)]
pub struct LogLimiter {
    per_second: f64,
    burst: f64,
    kinds: Mutex<HashMap<&'static str, Bucket>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    last: Instant,
    suppressed: u64,
}

/// Whether a line may be logged now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Log it; `suppressed` lines of its kind were held back since the last one logged.
    Log { suppressed: u64 },
    /// Hold it back (it is counted).
    Suppress,
}

impl Default for LogLimiter {
    /// 10 lines a second per kind, in bursts of up to 20.
    fn default() -> Self {
        LogLimiter::new(10, 20)
    }
}

impl LogLimiter {
    pub fn new(per_second: u32, burst: u32) -> LogLimiter {
        LogLimiter {
            per_second: f64::from(per_second.max(1)),
            burst: f64::from(burst.max(1)),
            kinds: Mutex::new(HashMap::new()),
        }
    }

    /// One line per `period` and kind, no burst (a condition that lasts, like a full file
    /// system, says so once a period).
    pub fn every(period: Duration) -> LogLimiter {
        let secs = period.as_secs_f64().max(1e-3);
        LogLimiter {
            per_second: 1.0 / secs,
            burst: 1.0,
            kinds: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a line of `kind` may be logged at `now`.
    pub fn check_at(&self, kind: &'static str, now: Instant) -> Verdict {
        let mut kinds = self
            .kinds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let b = kinds.entry(kind).or_insert(Bucket {
            tokens: self.burst,
            last: now,
            suppressed: 0,
        });
        let elapsed = now.saturating_duration_since(b.last).as_secs_f64();
        b.tokens = (b.tokens + elapsed * self.per_second).min(self.burst);
        b.last = b.last.max(now);
        // (The epsilon absorbs the rounding of many small refills.)
        if b.tokens >= 1.0 - 1e-9 {
            b.tokens -= 1.0;
            Verdict::Log {
                suppressed: std::mem::take(&mut b.suppressed),
            }
        } else {
            b.suppressed += 1;
            Verdict::Suppress
        }
    }

    /// Logs `line` at `level` under `target` (the caller's `module_path!()`) unless `kind`
    /// is over its rate; first says how many lines of the kind were held back, if any.
    pub fn log(
        &self,
        level: log::Level,
        target: &str,
        kind: &'static str,
        line: std::fmt::Arguments<'_>,
    ) {
        if !log::log_enabled!(target: target, level) {
            return;
        }
        if let Verdict::Log { suppressed } = self.check_at(kind, Instant::now()) {
            if suppressed > 0 {
                log::log!(target: target, level, "({kind}: suppressed {suppressed} similar lines)");
            }
            log::log!(target: target, level, "{line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_passes_then_lines_are_counted_and_reported_once_the_rate_allows() {
        let l = LogLimiter::new(2, 3);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(l.check_at("refused", t0), Verdict::Log { suppressed: 0 });
        }
        for _ in 0..5 {
            assert_eq!(l.check_at("refused", t0), Verdict::Suppress);
        }
        // Another kind is not held back by the flood.
        assert_eq!(l.check_at("eio", t0), Verdict::Log { suppressed: 0 });
        // Half a second at 2 a second: one token, and the five held back are reported.
        let t1 = t0 + Duration::from_millis(500);
        assert_eq!(l.check_at("refused", t1), Verdict::Log { suppressed: 5 });
        assert_eq!(l.check_at("refused", t1), Verdict::Suppress);
        // A long quiet refills only up to the burst.
        let t2 = t1 + Duration::from_secs(60);
        for _ in 0..3 {
            assert!(matches!(l.check_at("refused", t2), Verdict::Log { .. }));
        }
        assert_eq!(l.check_at("refused", t2), Verdict::Suppress);
    }

    #[test]
    fn a_steady_rate_is_held_to_the_limit() {
        let l = LogLimiter::new(10, 1);
        let t0 = Instant::now();
        // 100 lines a second for 10 seconds: about 10 a second get through.
        let logged = (0..1000)
            .filter(|i| {
                matches!(
                    l.check_at("k", t0 + Duration::from_millis(i * 10)),
                    Verdict::Log { .. }
                )
            })
            .count();
        assert!((99..=101).contains(&logged), "{logged} lines logged");
    }

    #[test]
    fn every_lets_one_line_through_per_period() {
        let l = LogLimiter::every(Duration::from_secs(60));
        let t0 = Instant::now();
        assert_eq!(l.check_at("full", t0), Verdict::Log { suppressed: 0 });
        assert_eq!(
            l.check_at("full", t0 + Duration::from_secs(1)),
            Verdict::Suppress
        );
        assert_eq!(
            l.check_at("full", t0 + Duration::from_secs(59)),
            Verdict::Suppress
        );
        assert_eq!(
            l.check_at("full", t0 + Duration::from_secs(60)),
            Verdict::Log { suppressed: 2 }
        );
    }
}
