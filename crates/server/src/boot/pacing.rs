//! Boot pacing (`--max-booting N`, PVS's "maximum devices booting"): at most N machines
//! are in their boot window on this server at once; the others are told to wait and ask
//! again, and places that free up go to the machines that have waited longest.
//!
//! A machine's **boot window** opens when the server admits it: when it hands the machine
//! its target script (`GET /boot/target/MAC`), or when the agent in its initramfs asks
//! (`GET /boot/admit/ID`; a machine already in its window is admitted again at once). It
//! closes when the initramfs says the root is mounted (`GET /boot/booted/ID`, just before
//! `switch_root`), or after `--boot-window` seconds, so a machine that died mid-boot
//! does not keep its place.
//!
//! **Order.** A machine told to wait joins a queue by the time it was first told. A
//! machine is admitted only while there are more free places than machines queued ahead
//! of it, so the longest waiting get the places as they free up, and a newcomer cannot
//! overtake a queue of machines that are retrying. A queued machine that has not asked
//! again within [`QUEUE_STALE`] has given up (powered off, or booted elsewhere) and
//! leaves the queue.
//!
//! The pacer is per server and in memory: a restarted server starts with empty windows,
//! and the initramfs's own admission call paces the machines already past iPXE.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Default `--boot-window`: how long a machine keeps its place without saying it booted.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(180);

/// A queued machine that has not asked again within this long leaves the queue.
pub const QUEUE_STALE: Duration = Duration::from_secs(30);

/// How long a waiting machine is told to wait, at least and at most (whole seconds: an
/// iPXE `sleep`); each answer draws one at random between them, so a room of machines
/// told to wait together does not come back together.
pub const RETRY_MIN_SECS: u64 = 1;
pub const RETRY_MAX_SECS: u64 = 4;

/// What a machine asking for a place is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// In its boot window (opened now, or still open).
    Admitted,
    /// Every place is taken, or promised to machines queued ahead of it: ask again after
    /// `retry_secs`.
    Wait {
        booting: usize,
        max: usize,
        /// Machines queued ahead of this one.
        ahead: usize,
        retry_secs: u64,
    },
}

/// The pacer's figures, for `/metrics`, `GET /api/v1/server` and the console.
pub use vdstream_contract::server::BootPacingDoc as PacingFigures;

#[derive(Debug)]
struct Queued {
    first: Instant,
    last: Instant,
}

#[derive(Debug, Default)]
struct Inner {
    /// Target id → when its window opened.
    windows: HashMap<String, Instant>,
    queue: HashMap<String, Queued>,
    figures: PacingFigures,
}

/// The boot windows of one server.
#[derive(Debug)]
pub struct Pacer {
    max: usize,
    window: Duration,
    inner: Mutex<Inner>,
}

impl Pacer {
    /// `max` machines at once (0: no limit; windows are still counted), each window at most
    /// `window` long.
    pub fn new(max: usize, window: Duration) -> Pacer {
        let inner = Inner {
            figures: PacingFigures {
                max_booting: max as u64,
                ..PacingFigures::default()
            },
            ..Inner::default()
        };
        Pacer {
            max,
            window,
            inner: Mutex::new(inner),
        }
    }

    /// Asks a place for target `id` now.
    pub fn admit(&self, id: &str) -> Admission {
        self.admit_at(
            id,
            Instant::now(),
            fastrand::u64(RETRY_MIN_SECS..=RETRY_MAX_SECS),
        )
    }

    /// [`Pacer::admit`] at `now`, telling a waiting machine `retry_secs`.
    pub fn admit_at(&self, id: &str, now: Instant, retry_secs: u64) -> Admission {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        Self::expire(&mut g, self.window, now);
        if g.windows.contains_key(id) {
            // Asked again within its window (the initramfs after iPXE, or a retried
            // script): the window goes on from its opening.
            return Admission::Admitted;
        }
        let booting = g.windows.len();
        let first = g.queue.get(id).map(|q| q.first);
        let ahead = g
            .queue
            .iter()
            .filter(|(other, q)| other.as_str() != id && first.is_none_or(|f| q.first < f))
            .count();
        if self.max == 0 || booting + ahead < self.max {
            g.queue.remove(id);
            g.windows.insert(id.to_string(), now);
            let f = &mut g.figures;
            f.admitted_total += 1;
            f.booting_peak = f.booting_peak.max(booting as u64 + 1);
            return Admission::Admitted;
        }
        g.queue
            .entry(id.to_string())
            .and_modify(|q| q.last = now)
            .or_insert(Queued {
                first: now,
                last: now,
            });
        g.figures.waits_total += 1;
        Admission::Wait {
            booting,
            max: self.max,
            ahead,
            retry_secs,
        }
    }

    /// Target `id` says it booted: its window closes. Whether it had one.
    pub fn booted(&self, id: &str) -> bool {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let had = g.windows.remove(id).is_some();
        if had {
            g.figures.booted_total += 1;
        }
        had
    }

    /// Whether target `id` is in its boot window now (rebalancing leaves it where it is).
    pub fn is_booting(&self, id: &str) -> bool {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.windows
            .get(id)
            .is_some_and(|opened| opened.elapsed() < self.window)
    }

    /// The figures now.
    pub fn figures(&self) -> PacingFigures {
        self.figures_at(Instant::now())
    }

    fn figures_at(&self, now: Instant) -> PacingFigures {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        Self::expire(&mut g, self.window, now);
        let mut f = g.figures;
        f.booting = g.windows.len() as u64;
        f.waiting = g.queue.len() as u64;
        f
    }

    /// Closes the windows older than `window` and drops the queued machines that stopped
    /// asking.
    fn expire(g: &mut Inner, window: Duration, now: Instant) {
        let before = g.windows.len();
        g.windows
            .retain(|_, opened| now.saturating_duration_since(*opened) < window);
        g.figures.expired_total += (before - g.windows.len()) as u64;
        g.queue
            .retain(|_, q| now.saturating_duration_since(q.last) < QUEUE_STALE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waits(a: Admission) -> bool {
        matches!(a, Admission::Wait { .. })
    }

    #[test]
    fn at_most_max_are_booting_and_a_booted_one_frees_its_place() {
        let p = Pacer::new(2, DEFAULT_WINDOW);
        let t = Instant::now();
        assert_eq!(p.admit_at("a", t, 5), Admission::Admitted);
        assert_eq!(p.admit_at("b", t, 5), Admission::Admitted);
        assert_eq!(
            p.admit_at("c", t, 5),
            Admission::Wait {
                booting: 2,
                max: 2,
                ahead: 0,
                retry_secs: 5
            }
        );
        // In its window already: admitted again, and counted once.
        assert_eq!(p.admit_at("a", t, 5), Admission::Admitted);
        assert_eq!(p.figures_at(t).booting, 2);
        assert!(p.booted("a"));
        assert!(!p.booted("a"), "a second booted closes nothing");
        assert_eq!(p.admit_at("c", t, 5), Admission::Admitted);
        let f = p.figures_at(t);
        assert_eq!((f.booting, f.booting_peak, f.waiting), (2, 2, 0));
        assert_eq!((f.admitted_total, f.waits_total, f.booted_total), (3, 1, 1));
    }

    #[test]
    fn freed_places_go_to_the_longest_waiting_first() {
        let p = Pacer::new(1, DEFAULT_WINDOW);
        let t = Instant::now();
        assert_eq!(p.admit_at("a", t, 5), Admission::Admitted);
        assert!(waits(p.admit_at("old", t, 5)));
        let t1 = t + Duration::from_secs(1);
        assert!(waits(p.admit_at("young", t1, 5)));
        p.booted("a");
        // The younger one asks first, but "old" is queued ahead of it.
        match p.admit_at("young", t1, 5) {
            Admission::Wait { ahead, booting, .. } => assert_eq!((ahead, booting), (1, 0)),
            a => panic!("the younger waiter overtook the queue: {a:?}"),
        }
        // A newcomer that never waited cannot overtake either.
        assert!(waits(p.admit_at("new", t1, 5)));
        assert_eq!(p.admit_at("old", t1, 5), Admission::Admitted);
    }

    #[test]
    fn a_waiter_that_stops_asking_leaves_the_queue() {
        let p = Pacer::new(1, DEFAULT_WINDOW);
        let t = Instant::now();
        p.admit_at("a", t, 5);
        assert!(waits(p.admit_at("gone", t, 5)));
        let t2 = t + Duration::from_secs(5);
        assert!(waits(p.admit_at("b", t2, 5)));
        p.booted("a");
        let t3 = t + QUEUE_STALE + Duration::from_secs(1);
        // "gone" stopped asking: "b" is first now.
        assert_eq!(p.admit_at("b", t3, 5), Admission::Admitted);
        assert_eq!(p.figures_at(t3).waiting, 0);
    }

    #[test]
    fn a_window_closes_by_itself_after_the_boot_window() {
        let p = Pacer::new(1, Duration::from_secs(60));
        let t = Instant::now();
        p.admit_at("dead", t, 5);
        assert!(waits(p.admit_at("b", t + Duration::from_secs(59), 5)));
        assert_eq!(
            p.admit_at("b", t + Duration::from_secs(61), 5),
            Admission::Admitted
        );
        let f = p.figures_at(t + Duration::from_secs(61));
        assert_eq!((f.booting, f.expired_total), (1, 1));
    }

    #[test]
    fn no_limit_admits_everyone_and_still_counts() {
        let p = Pacer::new(0, DEFAULT_WINDOW);
        let t = Instant::now();
        for i in 0..100 {
            assert_eq!(p.admit_at(&format!("m{i}"), t, 5), Admission::Admitted);
        }
        let f = p.figures_at(t);
        assert_eq!((f.booting, f.booting_peak, f.max_booting), (100, 100, 0));
    }
}
