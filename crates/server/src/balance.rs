//! Rebalancing: the servers of one store keep their targets spread by weight, and a
//! server that drains hands its targets to the others, spread the same way.
//!
//! ```text
//!   every HEARTBEAT: STORE/servers/NAME.json ◀─ targets, sessions, guest IOPS, weight, draining
//!   every --rebalance-interval (or at once on a drain):
//!     read the fresh heartbeats ─▶ [`plan`] ─▶ for each excess target: a hint (target → server)
//!        ─▶ its NBD connections end at a safe point (read side shut, what was read answered)
//!        ─▶ the agent reconnects at once, asks GET /api/v1/targets/ID/placement ─▶ the hinted server
//! ```
//!
//! Invariants:
//! - **Load exchange through the store.** Each server writes its heartbeat every
//!   [`HEARTBEAT`] (owner-only, never through a link); one older than [`STALE`] is a server
//!   that is gone. Servers on one store directory see each other with no other setting.
//! - **Only the loaded server acts.** A server moves only its own targets, and only when its
//!   share exceeds its weighted fair share by more than the threshold (or it drains). It
//!   sends them to servers below their share, most missing first, never past their share:
//!   two servers never send each other targets in one round.
//! - **Hysteresis.** A target moves at most once a round. Nothing moves while the farm has
//!   fewer targets than the floor. A target whose connection arrived within the last
//!   interval (it just moved, or just attached) stays, and so does one in its boot window.
//! - **What moves.** A target of a device cache type (its cache is in the agent; any
//!   server reads it the vDisk) and `server-persistent` (its cache is in the store: the next
//!   server opens it once this one let it go, and the agent's journal covers the rest). Not
//!   `server`: its cache lives in this process's memory and would be lost.
//! - **Which ones.** The server's targets sorted by their guest I/O, taken at even steps, so
//!   the busy ones spread as the idle ones do.
//! - **Safe point.** A connection ends as a drain ends it: nothing it read is dropped; a
//!   request it had not read is sent again by the agent to the next server.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vdstream_blockdev::lock;
use vdstream_contract::server::{FarmDoc, FarmServer, ServerLoad};

/// How often a server writes its heartbeat.
pub const HEARTBEAT: Duration = Duration::from_secs(2);

/// A heartbeat older than this is a server that is gone.
pub const STALE: Duration = Duration::from_secs(10);

/// How long a placement hint is kept for the agent to ask.
pub const HINT_TTL: Duration = Duration::from_secs(60);

/// How long a server that stops (SIGTERM) keeps its API up after its connections ended,
/// for the agents it told where to go to ask (`crate::balance` module docs).
pub const HINT_GRACE: Duration = Duration::from_secs(2);

/// A round moves nothing until the set of servers has stayed the same this long (two
/// heartbeats): servers started together are all counted before targets go to any.
pub const SETTLE: Duration = Duration::from_secs(4);

/// The window of the guest I/O rate.
const IO_WINDOW: Duration = Duration::from_secs(60);

/// Defaults of the flags.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(30);
pub const DEFAULT_THRESHOLD_PERCENT: f64 = 25.0;
pub const DEFAULT_FLOOR: u64 = 5;

/// `--rebalance`, `--rebalance-interval`, `--rebalance-threshold`, `--rebalance-floor`,
/// `--weight`.
#[derive(Debug, Clone, PartialEq)]
pub struct BalanceConfig {
    /// Rounds run (a drain moves targets away either way).
    pub enabled: bool,
    pub interval: Duration,
    /// Percent above the fair share before targets move.
    pub threshold_percent: f64,
    /// Nothing moves while the farm has fewer targets.
    pub floor: u64,
    /// This server's power rating.
    pub weight: f64,
}

impl Default for BalanceConfig {
    fn default() -> Self {
        BalanceConfig {
            enabled: true,
            interval: DEFAULT_INTERVAL,
            threshold_percent: DEFAULT_THRESHOLD_PERCENT,
            floor: DEFAULT_FLOOR,
            weight: 1.0,
        }
    }
}

/// What a server tells the others, in `STORE/servers/NAME.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    #[serde(flatten)]
    pub load: ServerLoad,
    /// Which process: two servers given one name are told apart (and warned about).
    pub instance: String,
    pub updated_unix_ms: u64,
}

/// Why a round runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Round {
    /// Every `--rebalance-interval` (with `--rebalance off`, only while drained).
    Periodic,
    /// A drain through the API: every target that may move goes now.
    Drain,
    /// SIGTERM: hints for every target, whose connections the server's own drain ends.
    HintsOnly,
}

/// One server as a round sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Load {
    pub name: String,
    pub weight: f64,
    pub targets: u64,
    pub draining: bool,
}

/// Why a round moves nothing, or what it moves.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    Stay(String),
    /// How many targets go to which server, and why.
    Move(Vec<(String, u64)>, String),
}

/// Fair shares of `loads` (in targets): the farm's targets split by weight among the
/// servers that take targets (not draining, weight above 0); 0 for the others.
pub fn shares(loads: &[Load]) -> Vec<f64> {
    let total: u64 = loads.iter().map(|l| l.targets).sum();
    let takes = |l: &Load| !l.draining && l.weight > 0.0;
    let weights: f64 = loads.iter().filter(|l| takes(l)).map(|l| l.weight).sum();
    loads
        .iter()
        .map(|l| {
            if takes(l) && weights > 0.0 {
                total as f64 * l.weight / weights
            } else {
                0.0
            }
        })
        .collect()
}

/// What server `me` (an index of `loads`) should move this round (see the module docs).
pub fn plan(me: usize, loads: &[Load], threshold_percent: f64, floor: u64) -> Plan {
    let total: u64 = loads.iter().map(|l| l.targets).sum();
    let share = shares(loads);
    let mine = &loads[me];
    let others = |f: &dyn Fn(usize) -> bool| {
        (0..loads.len())
            .filter(|&j| j != me && f(j))
            .collect::<Vec<_>>()
    };
    let takers = others(&|j| !loads[j].draining && loads[j].weight > 0.0);
    if mine.targets == 0 {
        return Plan::Stay("no targets here".into());
    }
    if takers.is_empty() {
        return Plan::Stay(format!(
            "no other server takes targets ({} known)",
            loads.len().saturating_sub(1)
        ));
    }
    let draining = mine.draining || mine.weight <= 0.0;
    let excess = if draining {
        mine.targets
    } else {
        if total < floor {
            return Plan::Stay(format!(
                "the farm has {total} targets, under the floor of {floor}"
            ));
        }
        let limit = share[me] * (1.0 + threshold_percent / 100.0);
        if (mine.targets as f64) <= limit {
            return Plan::Stay(format!(
                "{} targets, within {threshold_percent}% of the share {:.1}",
                mine.targets, share[me]
            ));
        }
        mine.targets.saturating_sub(share[me].round() as u64).max(1)
    };
    // One at a time to the server missing most (ties: the order given); past their share
    // only when this server drains (its targets must go somewhere).
    let mut given = vec![0u64; loads.len()];
    let missing = |j: usize, given: &[u64]| share[j] - (loads[j].targets + given[j]) as f64;
    for _ in 0..excess {
        let Some(&best) = takers.iter().max_by(|&&a, &&b| {
            missing(a, &given)
                .partial_cmp(&missing(b, &given))
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(b.cmp(&a))
        }) else {
            break;
        };
        if !draining && missing(best, &given) < 0.5 {
            break;
        }
        given[best] += 1;
    }
    let moves: Vec<(String, u64)> = (0..loads.len())
        .filter(|&j| given[j] > 0)
        .map(|j| (loads[j].name.clone(), given[j]))
        .collect();
    if moves.is_empty() {
        return Plan::Stay("no server has room below its share".into());
    }
    let why = if draining {
        format!("draining: all {} targets go", mine.targets)
    } else {
        format!(
            "{} targets against a share of {:.1} (weight {} of {}; farm {total} targets on {} servers, threshold {threshold_percent}%)",
            mine.targets,
            share[me],
            mine.weight,
            takers.iter().map(|&j| loads[j].weight).sum::<f64>() + mine.weight,
            takers.len() + 1
        )
    };
    Plan::Move(moves, why)
}

/// Picks `n` of `ids` (sorted busiest first) at even steps, so busy and idle ones go alike.
pub fn pick_evenly<T: Clone>(sorted: &[T], n: usize) -> Vec<T> {
    let n = n.min(sorted.len());
    (0..n)
        .map(|k| sorted[k * sorted.len() / n.max(1)].clone())
        .collect()
}

/// A file name for a server's name (names may hold `:` and other characters).
pub(crate) fn file_name(server: &str) -> String {
    let mut out = String::new();
    for (i, c) in server.chars().enumerate() {
        if c.is_ascii_alphanumeric() || matches!(c, '-' | '_') || (c == '.' && i > 0) {
            out.push(c);
        } else {
            out.push_str(&format!("%{:02X}", c as u32 & 0xff));
        }
    }
    format!("{out}.json")
}

/// Where a store's heartbeats are.
pub fn servers_dir(store: &Path) -> PathBuf {
    store.join("servers")
}

/// The balancer of one server: its settings, its hints, its figures.
#[derive(Debug)]
pub struct Balancer {
    pub config: BalanceConfig,
    pub(crate) instance: String,
    /// Target → (server it should go to, when told, why).
    pub(crate) hints: Mutex<HashMap<String, (String, Instant, &'static str)>>,
    /// Guest requests of the whole server, sampled at each heartbeat.
    pub(crate) io: Mutex<VecDeque<(Instant, u64)>>,
    pub(crate) rounds: AtomicU64,
    pub(crate) moved_out: AtomicU64,
    /// Set by a drain through the API (the server goes on running and serving nothing new).
    pub drained: AtomicBool,
    /// Wakes the loop for a round now (a drain).
    pub(crate) kick: tokio::sync::Notify,
    /// The last heartbeats read (for the API's farm view).
    pub(crate) farm: Mutex<Vec<Heartbeat>>,
    /// Name clashes already warned about.
    pub(crate) warned: Mutex<Vec<String>>,
    /// The servers seen at the last read, and when that set last changed.
    pub(crate) members: Mutex<(Vec<String>, Instant)>,
}

impl Balancer {
    pub fn new(config: BalanceConfig) -> Balancer {
        Balancer {
            config,
            instance: format!("{}-{:016x}", std::process::id(), fastrand::u64(..)),
            hints: Mutex::new(HashMap::new()),
            io: Mutex::new(VecDeque::new()),
            rounds: AtomicU64::new(0),
            moved_out: AtomicU64::new(0),
            drained: AtomicBool::new(false),
            kick: tokio::sync::Notify::new(),
            farm: Mutex::new(Vec::new()),
            warned: Mutex::new(Vec::new()),
            members: Mutex::new((Vec::new(), Instant::now())),
        }
    }

    /// The server this target was told to go to, if it was within [`HINT_TTL`].
    pub fn hint(&self, target: &str) -> Option<(String, &'static str)> {
        let hints = lock(&self.hints);
        hints
            .get(target)
            .filter(|(_, at, _)| at.elapsed() < HINT_TTL)
            .map(|(to, _, why)| (to.clone(), *why))
    }

    /// Asks the loop for a round now.
    pub fn kick(&self) {
        self.kick.notify_one();
    }

    /// Guest requests a second over the last minute (from the samples so far).
    pub(crate) fn guest_iops(&self) -> f64 {
        let io = lock(&self.io);
        match (io.front(), io.back()) {
            (Some((t0, n0)), Some((t1, n1))) if t1 > t0 => {
                n1.saturating_sub(*n0) as f64 / t1.duration_since(*t0).as_secs_f64()
            }
            _ => 0.0,
        }
    }

    pub(crate) fn sample_io(&self, ops: u64) {
        let now = Instant::now();
        let mut io = lock(&self.io);
        io.push_back((now, ops));
        while io
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > IO_WINDOW)
        {
            io.pop_front();
        }
    }

    /// Writes this server's heartbeat into the store (owner-only, replaced whole, never
    /// through a link).
    pub(crate) fn write_heartbeat(&self, store: &Path, beat: &Heartbeat) -> std::io::Result<()> {
        use vdstream_blockdev::storefile;
        let dir = servers_dir(store);
        storefile::create_dir_all(&dir)?;
        let path = dir.join(file_name(&beat.load.name));
        let tmp = dir.join(format!(
            ".{}.tmp-{}",
            file_name(&beat.load.name),
            std::process::id()
        ));
        let mut f = storefile::create_fresh(&tmp, storefile::PRIVATE)?;
        std::io::Write::write_all(
            &mut f,
            &serde_json::to_vec_pretty(beat).expect("serializes"),
        )?;
        drop(f);
        std::fs::rename(&tmp, &path)
    }

    /// The fresh heartbeats of the store's servers (this one's included, as `mine`).
    pub(crate) fn read_farm(&self, store: &Path, mine: &Heartbeat) -> Vec<Heartbeat> {
        let mut out = vec![mine.clone()];
        let now = mine.updated_unix_ms;
        let Ok(entries) = std::fs::read_dir(servers_dir(store)) else {
            return out;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || !name.ends_with(".json") {
                continue;
            }
            let Ok(f) = vdstream_blockdev::storefile::open_read(&e.path()) else {
                continue;
            };
            let mut text = String::new();
            if std::io::Read::read_to_string(&mut std::io::Read::take(f, 64 << 10), &mut text)
                .is_err()
            {
                continue;
            }
            let Ok(beat) = serde_json::from_str::<Heartbeat>(&text) else {
                log::debug!(
                    "rebalance: {} is not a heartbeat; ignored",
                    e.path().display()
                );
                continue;
            };
            if now.saturating_sub(beat.updated_unix_ms) > STALE.as_millis() as u64 {
                continue;
            }
            if beat.load.name == mine.load.name {
                if beat.instance != mine.instance {
                    let mut warned = lock(&self.warned);
                    if !warned.contains(&beat.instance) {
                        warned.push(beat.instance.clone());
                        log::warn!("rebalance: another server on this store calls itself {:?} too (instance {}): give each server its own --name, or they count each other's targets as one", beat.load.name, beat.instance);
                    }
                }
                continue;
            }
            out.push(beat);
        }
        let mut names: Vec<String> = out.iter().map(|b| b.load.name.clone()).collect();
        names.sort();
        let mut members = lock(&self.members);
        if members.0 != names {
            *members = (names, Instant::now());
        }
        out
    }

    /// How long the set of servers has stayed the same.
    pub(crate) fn settled_for(&self) -> Duration {
        lock(&self.members).1.elapsed()
    }

    /// The farm as last read, for `GET /api/v1/farm`.
    pub fn farm_doc(&self, now_unix_ms: u64) -> FarmDoc {
        let beats = lock(&self.farm).clone();
        let loads: Vec<Load> = beats.iter().map(load_of).collect();
        let share = shares(&loads);
        let now = now_unix_ms;
        FarmDoc {
            threshold_percent: self.config.threshold_percent,
            floor: self.config.floor,
            interval_secs: self.config.interval.as_secs(),
            servers: beats
                .iter()
                .zip(share)
                .map(|(b, share)| FarmServer {
                    load: b.load.clone(),
                    share: (share * 10.0).round() / 10.0,
                    age_ms: now.saturating_sub(b.updated_unix_ms),
                })
                .collect(),
        }
    }
}

pub(crate) fn load_of(b: &Heartbeat) -> Load {
    Load {
        name: b.load.name.clone(),
        weight: b.load.weight,
        targets: b.load.targets,
        draining: b.load.draining,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(name: &str, weight: f64, targets: u64, draining: bool) -> Load {
        Load {
            name: name.into(),
            weight,
            targets,
            draining,
        }
    }

    fn moves(p: Plan) -> Vec<(String, u64)> {
        match p {
            Plan::Move(m, _) => m,
            Plan::Stay(why) => panic!("stays: {why}"),
        }
    }

    #[test]
    fn a_loaded_server_sends_its_excess_to_the_servers_below_their_share() {
        let farm = [
            l("a", 1.0, 100, false),
            l("b", 1.0, 0, false),
            l("c", 1.0, 0, false),
        ];
        let m = moves(plan(0, &farm, 25.0, 5));
        assert_eq!(m, vec![("b".into(), 33), ("c".into(), 33)]);
        // The others are under their share: they send nothing.
        assert!(matches!(plan(1, &farm, 25.0, 5), Plan::Stay(_)));
    }

    #[test]
    fn within_the_threshold_or_under_the_floor_nothing_moves() {
        let farm = [
            l("a", 1.0, 40, false),
            l("b", 1.0, 30, false),
            l("c", 1.0, 30, false),
        ];
        assert!(
            matches!(plan(0, &farm, 25.0, 5), Plan::Stay(_)),
            "40 is within 25% of 33.3"
        );
        let farm = [l("a", 1.0, 4, false), l("b", 1.0, 0, false)];
        assert!(
            matches!(plan(0, &farm, 25.0, 5), Plan::Stay(_)),
            "4 targets, floor 5"
        );
        assert_eq!(moves(plan(0, &farm, 25.0, 4)), vec![("b".into(), 2)]);
    }

    #[test]
    fn weights_set_the_shares() {
        let farm = [l("a", 1.0, 90, false), l("b", 2.0, 0, false)];
        assert_eq!(shares(&farm), vec![30.0, 60.0]);
        assert_eq!(moves(plan(0, &farm, 25.0, 5)), vec![("b".into(), 60)]);
    }

    #[test]
    fn a_draining_server_spreads_all_of_its_targets_even_past_the_others_shares() {
        let farm = [
            l("a", 1.0, 30, false),
            l("b", 1.0, 34, false),
            l("c", 1.0, 36, true),
        ];
        let m = moves(plan(2, &farm, 25.0, 5));
        assert_eq!(m.iter().map(|(_, n)| n).sum::<u64>(), 36);
        let a = m.iter().find(|(s, _)| s == "a").unwrap().1;
        let b = m.iter().find(|(s, _)| s == "b").unwrap().1;
        assert_eq!((30 + a, 34 + b), (50, 50));
        // A draining server counts for nothing in the others' shares.
        assert!(matches!(plan(0, &farm, 25.0, 5), Plan::Stay(_)));
    }

    #[test]
    fn a_server_alone_keeps_its_targets() {
        let farm = [l("a", 1.0, 100, true)];
        assert!(matches!(plan(0, &farm, 25.0, 5), Plan::Stay(_)));
    }

    #[test]
    fn no_two_servers_send_each_other_targets_in_one_round() {
        // Every farm of 2..5 servers with loads 0..12: if a sends to b, b sends nothing to a.
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..2000 {
            let n = rng.usize(2..6);
            let farm: Vec<Load> = (0..n)
                .map(|i| {
                    l(
                        &format!("s{i}"),
                        rng.usize(1..4) as f64,
                        rng.u64(0..13),
                        rng.u8(0..8) == 0,
                    )
                })
                .collect();
            let plans: Vec<Vec<(String, u64)>> = (0..n)
                .map(|i| match plan(i, &farm, 25.0, 5) {
                    Plan::Move(m, _) => m,
                    Plan::Stay(_) => Vec::new(),
                })
                .collect();
            for (i, p) in plans.iter().enumerate() {
                for (to, _) in p {
                    let j = farm.iter().position(|f| &f.name == to).unwrap();
                    assert!(
                        !plans[j].iter().any(|(back, _)| back == &farm[i].name),
                        "{farm:?}: {i} and {j} send each other targets"
                    );
                    assert!(!farm[j].draining, "sent to a draining server: {farm:?}");
                }
            }
        }
    }

    #[test]
    fn even_picks_take_busy_and_idle_alike() {
        let sorted: Vec<u32> = (0..100).collect();
        let p = pick_evenly(&sorted, 10);
        assert_eq!(p, vec![0, 10, 20, 30, 40, 50, 60, 70, 80, 90]);
        assert_eq!(pick_evenly(&sorted[..3], 10), vec![0, 1, 2]);
        assert!(pick_evenly(&sorted, 0).is_empty());
    }

    #[test]
    fn file_names_hold_no_path() {
        assert_eq!(file_name("pvs1:4242"), "pvs1%3A4242.json");
        assert_eq!(file_name("../x"), "%2E.%2Fx.json");
    }
}
