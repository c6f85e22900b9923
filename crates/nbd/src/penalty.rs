//! Per-source penalties for failed handshakes, as OpenSSH's `PerSourcePenalties`: a source
//! address that keeps failing handshakes (certificates of a foreign CA, garbage, stalls)
//! has its new connections closed at accept for a while, before any TLS work is done for
//! it. A storm of hostile handshakes then costs the server, and the attacker, a closed
//! socket each instead of a key exchange each, and the targets that are already connected
//! keep their CPU.
//!
//! The rules, per source (an IPv4 address, or the /64 an IPv6 address is in; an
//! IPv4-mapped IPv6 address counts as its IPv4 address):
//!
//! | state | on a failed handshake | at accept |
//! | --- | --- | --- |
//! | counting (fewer than `max_failures` within `window`) | count it; the count restarts when `window` has passed since its first | let in |
//! | the `max_failures`-th failure within `window` | penalty starts: `penalty` × 2^(earlier penalties), at most `max_penalty` | |
//! | penalized (until the penalty ends) | (cannot happen: no handshake runs) | closed at once |
//!
//! A source whose last penalty ended more than `max_penalty` ago starts again at `penalty`.
//! Exempt networks (by default the host's own `127.0.0.1` and `::1`) and unix-socket
//! clients are never penalized. Invariants: at most `max_sources` sources are remembered;
//! when that many are and none has expired, a new source is not tracked (it is let in, as
//! before penalties existed) rather than evicting one that is penalized now.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::str::FromStr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ipnet::IpNet;

/// See the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PenaltyConfig {
    /// Failed handshakes from one source within `window` that start a penalty; 0 turns
    /// penalties off.
    pub max_failures: u32,
    /// The span the failures are counted over.
    pub window: Duration,
    /// The first penalty of a source; each further one doubles, up to `max_penalty`.
    pub penalty: Duration,
    /// The longest penalty.
    pub max_penalty: Duration,
    /// Networks whose clients are never penalized.
    pub exempt: Vec<IpNet>,
    /// Most sources remembered at once.
    pub max_sources: usize,
}

impl Default for PenaltyConfig {
    /// 10 failed handshakes within a minute: closed at accept for 30 s, then 60 s, ... up
    /// to 10 minutes; the host's own 127.0.0.1 and ::1 exempt; 65,536 sources remembered.
    fn default() -> Self {
        PenaltyConfig {
            max_failures: 10,
            window: Duration::from_secs(60),
            penalty: Duration::from_secs(30),
            max_penalty: Duration::from_secs(600),
            exempt: default_exempt(),
            max_sources: 65_536,
        }
    }
}

impl PenaltyConfig {
    /// One line for a server's start: what it penalizes, or that it does not.
    pub fn describe(&self) -> String {
        if self.max_failures == 0 {
            return "handshake penalties off".to_string();
        }
        let exempt: Vec<String> = self.exempt.iter().map(ToString::to_string).collect();
        format!(
            "a client address with {} failed handshakes within {}s is closed at accept for {}s, doubling up to {}s (exempt: {})",
            self.max_failures,
            self.window.as_secs(),
            self.penalty.as_secs(),
            self.max_penalty.as_secs(),
            if exempt.is_empty() { "none".to_string() } else { exempt.join(",") }
        )
    }
}

/// The networks exempt by default: the host's own loopback addresses.
pub fn default_exempt() -> Vec<IpNet> {
    vec![
        IpNet::from(IpAddr::from([127, 0, 0, 1])),
        IpNet::from(IpAddr::from(Ipv6Addr::LOCALHOST)),
    ]
}

/// Parses an exempt list as the command line gives it: networks or addresses separated by
/// commas (`10.0.0.0/8,192.168.1.7,::1`), or `none`.
pub fn parse_exempt(text: &str) -> Result<Vec<IpNet>, String> {
    let text = text.trim();
    if text.eq_ignore_ascii_case("none") || text.is_empty() {
        return Ok(Vec::new());
    }
    text.split(',')
        .map(|item| {
            let item = item.trim();
            IpNet::from_str(item)
                .or_else(|_| IpAddr::from_str(item).map(IpNet::from))
                .map_err(|_| format!("{item:?} is not an address or a network (examples: 10.0.0.0/8, 192.168.1.7, ::1, or none)"))
        })
        .collect()
}

/// What a failed handshake did to its source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Not counted: penalties are off, the source is exempt, or no room to track it.
    Ignored,
    /// Counted: `count` failures within the window so far.
    Counted { count: u32 },
    /// This failure started a penalty of `penalty` (the source's `strike`-th).
    Penalized { penalty: Duration, strike: u32 },
}

#[derive(Debug, Clone, Copy)]
struct Source {
    window_start: Instant,
    count: u32,
    until: Option<Instant>,
    strikes: u32,
}

/// The penalty table of one server. Cheap to share (`&self` methods, one short lock).
#[derive(Debug)]
pub struct Penalties {
    config: PenaltyConfig,
    sources: Mutex<HashMap<IpAddr, Source>>,
}

/// The key a source address is counted under: an IPv4 address (also when mapped into
/// IPv6), or the /64 of an IPv6 address (one host commonly has a whole /64).
pub fn source_key(addr: IpAddr) -> IpAddr {
    match addr.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))),
        v4 => v4,
    }
}

impl Penalties {
    pub fn new(config: PenaltyConfig) -> Penalties {
        Penalties {
            config,
            sources: Mutex::new(HashMap::new()),
        }
    }

    pub fn config(&self) -> &PenaltyConfig {
        &self.config
    }

    fn exempt(&self, addr: IpAddr) -> bool {
        let plain = addr.to_canonical();
        self.config.max_failures == 0
            || self
                .config
                .exempt
                .iter()
                .any(|net| net.contains(&plain) || net.contains(&addr))
    }

    /// How much longer `addr`'s connections are closed at accept, if they are.
    pub fn penalized(&self, addr: IpAddr, now: Instant) -> Option<Duration> {
        if self.exempt(addr) {
            return None;
        }
        let sources = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        let until = sources.get(&source_key(addr))?.until?;
        (until > now).then(|| until - now)
    }

    /// Counts a failed handshake of `addr` at `now`; see [`Failure`].
    pub fn failed(&self, addr: IpAddr, now: Instant) -> Failure {
        if self.exempt(addr) {
            return Failure::Ignored;
        }
        let c = &self.config;
        let key = source_key(addr);
        let mut sources = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        if !sources.contains_key(&key) && sources.len() >= c.max_sources {
            // Forget the sources with nothing left to remember: no penalty now or within
            // max_penalty (their strikes have lapsed) and a window that is over.
            sources.retain(|_, s| {
                let penalty_matters = s.until.is_some_and(|u| now < u + c.max_penalty);
                penalty_matters || now.duration_since(s.window_start) < c.window
            });
            if sources.len() >= c.max_sources {
                return Failure::Ignored;
            }
        }
        let s = sources.entry(key).or_insert(Source {
            window_start: now,
            count: 0,
            until: None,
            strikes: 0,
        });
        if s.until.is_some_and(|u| now >= u + c.max_penalty) {
            s.strikes = 0; // behaved for a whole max_penalty since its last penalty ended
        }
        if now.duration_since(s.window_start) >= c.window {
            s.window_start = now;
            s.count = 0;
        }
        s.count += 1;
        if s.count < c.max_failures {
            return Failure::Counted { count: s.count };
        }
        s.strikes = s.strikes.saturating_add(1);
        let factor = 1u32.checked_shl(s.strikes - 1).unwrap_or(u32::MAX);
        let penalty = c.penalty.saturating_mul(factor).min(c.max_penalty);
        s.until = Some(now + penalty);
        s.window_start = now;
        s.count = 0;
        Failure::Penalized {
            penalty,
            strike: s.strikes,
        }
    }

    /// How many sources are remembered now.
    pub fn tracked(&self) -> usize {
        self.sources.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(max_failures: u32) -> PenaltyConfig {
        PenaltyConfig {
            max_failures,
            exempt: Vec::new(),
            ..PenaltyConfig::default()
        }
    }
    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }
    const S: Duration = Duration::from_secs(1);

    #[test]
    fn the_tenth_failure_within_a_minute_closes_the_source_for_30_s() {
        let p = Penalties::new(cfg(10));
        let t0 = Instant::now();
        let a = ip("192.0.2.7");
        for i in 1..10 {
            assert_eq!(p.failed(a, t0 + S * i), Failure::Counted { count: i });
            assert_eq!(p.penalized(a, t0 + S * i), None, "not before the 10th");
        }
        assert_eq!(
            p.failed(a, t0 + S * 10),
            Failure::Penalized {
                penalty: S * 30,
                strike: 1
            }
        );
        assert_eq!(p.penalized(a, t0 + S * 11), Some(S * 29));
        assert_eq!(
            p.penalized(ip("192.0.2.8"), t0 + S * 11),
            None,
            "another address is not touched"
        );
        assert_eq!(p.penalized(a, t0 + S * 40), None, "over after 30 s");
    }

    #[test]
    fn failures_spread_wider_than_the_window_never_add_up() {
        let p = Penalties::new(cfg(3));
        let t0 = Instant::now();
        let a = ip("192.0.2.7");
        for i in 0..20u32 {
            // two failures a minute, the window restarting at every third
            assert!(
                matches!(p.failed(a, t0 + S * (i * 31)), Failure::Counted { .. }),
                "failure {i}"
            );
        }
    }

    #[test]
    fn penalties_double_up_to_the_longest_and_lapse_after_good_behaviour() {
        let p = Penalties::new(cfg(1));
        let t0 = Instant::now();
        let a = ip("198.51.100.1");
        let mut t = t0;
        let mut got = Vec::new();
        for _ in 0..7 {
            match p.failed(a, t) {
                Failure::Penalized { penalty, .. } => {
                    got.push(penalty.as_secs());
                    t += penalty; // fails again the moment it is let in
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(got, [30, 60, 120, 240, 480, 600, 600]);
        // Quiet for longer than the longest penalty after the last one ended: back to 30 s.
        t += Duration::from_secs(600);
        assert_eq!(
            p.failed(a, t),
            Failure::Penalized {
                penalty: S * 30,
                strike: 1
            }
        );
    }

    #[test]
    fn exempt_networks_and_zero_are_never_penalized() {
        let mut c = cfg(1);
        c.exempt = parse_exempt("10.0.0.0/8, ::1").unwrap();
        let p = Penalties::new(c);
        let now = Instant::now();
        assert_eq!(p.failed(ip("10.1.2.3"), now), Failure::Ignored);
        assert_eq!(
            p.failed(ip("::ffff:10.1.2.3"), now),
            Failure::Ignored,
            "IPv4-mapped counts as IPv4"
        );
        assert_eq!(p.failed(ip("::1"), now), Failure::Ignored);
        assert!(matches!(
            p.failed(ip("11.0.0.1"), now),
            Failure::Penalized { .. }
        ));
        let off = Penalties::new(cfg(0));
        assert_eq!(off.failed(ip("11.0.0.1"), now), Failure::Ignored);
        assert_eq!(off.penalized(ip("11.0.0.1"), now), None);
        // The default exempts the host's own loopback addresses only.
        let d = Penalties::new(PenaltyConfig {
            max_failures: 1,
            ..PenaltyConfig::default()
        });
        assert_eq!(d.failed(ip("127.0.0.1"), now), Failure::Ignored);
        assert_eq!(d.failed(ip("::1"), now), Failure::Ignored);
        assert!(matches!(
            d.failed(ip("127.0.0.2"), now),
            Failure::Penalized { .. }
        ));
    }

    #[test]
    fn an_ipv6_source_is_its_slash_64_and_mapped_ipv4_is_ipv4() {
        let p = Penalties::new(cfg(2));
        let now = Instant::now();
        assert_eq!(
            p.failed(ip("2001:db8:1:2::1"), now),
            Failure::Counted { count: 1 }
        );
        assert!(
            matches!(
                p.failed(ip("2001:db8:1:2:ffff::9"), now),
                Failure::Penalized { .. }
            ),
            "same /64"
        );
        assert!(p.penalized(ip("2001:db8:1:2::77"), now).is_some());
        assert_eq!(
            p.penalized(ip("2001:db8:1:3::1"), now),
            None,
            "the next /64 is another source"
        );
        assert_eq!(
            p.failed(ip("192.0.2.1"), now),
            Failure::Counted { count: 1 }
        );
        assert!(matches!(
            p.failed(ip("::ffff:192.0.2.1"), now),
            Failure::Penalized { .. }
        ));
        assert!(p.penalized(ip("192.0.2.1"), now).is_some());
    }

    #[test]
    fn the_table_is_bounded_and_keeps_the_penalized() {
        let mut c = cfg(1);
        c.max_sources = 4;
        let p = Penalties::new(c);
        let t0 = Instant::now();
        for i in 0..4u8 {
            assert!(matches!(
                p.failed(IpAddr::from([203, 0, 113, i]), t0),
                Failure::Penalized { .. }
            ));
        }
        // Full of sources penalized now: a fifth is not tracked, none is evicted.
        assert_eq!(p.failed(ip("203.0.113.200"), t0), Failure::Ignored);
        assert_eq!(p.tracked(), 4);
        assert!(p.penalized(ip("203.0.113.0"), t0 + S).is_some());
        // Once their penalties and a max_penalty after them are over, they make room.
        let later = t0 + Duration::from_secs(30 + 600 + 1);
        assert!(matches!(
            p.failed(ip("203.0.113.200"), later),
            Failure::Penalized { .. }
        ));
        assert_eq!(p.tracked(), 1);
    }

    #[test]
    fn exempt_lists_parse_as_administrators_write_them() {
        assert_eq!(parse_exempt("none").unwrap(), Vec::<IpNet>::new());
        assert_eq!(parse_exempt("127.0.0.1,::1").unwrap(), default_exempt());
        assert_eq!(
            parse_exempt("10.0.0.0/8").unwrap(),
            vec!["10.0.0.0/8".parse::<IpNet>().unwrap()]
        );
        let e = parse_exempt("10.0.0.0/8,lab").unwrap_err();
        assert!(e.contains("\"lab\""), "{e}");
    }
}
