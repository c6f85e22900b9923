//! The rebalancing rounds of a running server: its heartbeat from its sessions, the
//! rounds that move its targets, and their audit (the plan itself: `crate::balance`).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vdstream_blockdev::lock;
use vdstream_contract::server::{BalanceDoc, ServerLoad};

use crate::balance::{
    file_name, load_of, pick_evenly, plan, servers_dir, Balancer, Heartbeat, Load, Plan, Round,
    HEARTBEAT, HINT_TTL, SETTLE,
};
use crate::state::{unix_ms, ServerState, Session};

impl Balancer {
    /// This server's heartbeat now.
    pub fn heartbeat(&self, state: &ServerState) -> Heartbeat {
        let t = state.totals.snapshot();
        self.sample_io(t.guest_read_ops + t.guest_write_ops);
        let sessions = state.registry.sessions();
        Heartbeat {
            load: ServerLoad {
                name: state.name.clone(),
                weight: self.config.weight,
                targets: targets_of(&sessions).len() as u64,
                sessions: sessions.len() as u64,
                guest_iops: (self.guest_iops() * 10.0).round() / 10.0,
                draining: state.is_draining() || self.drained.load(Relaxed),
                rebalance: self.config.enabled,
            },
            instance: self.instance.clone(),
            updated_unix_ms: unix_ms(),
        }
    }

    /// This server's figures, for `GET /api/v1/server`, /metrics and the console.
    pub fn doc(&self, state: &ServerState) -> BalanceDoc {
        let farm = self.farm_doc(unix_ms());
        let me = farm.servers.iter().find(|s| s.load.name == state.name);
        BalanceDoc {
            enabled: self.config.enabled,
            weight: self.config.weight,
            targets: targets_of(&state.registry.sessions()).len() as u64,
            share: me.map_or(0.0, |m| m.share),
            servers: farm.servers.len() as u64,
            rounds: self.rounds.load(Relaxed),
            moved_out: self.moved_out.load(Relaxed),
            drained: self.drained.load(Relaxed),
        }
    }

    /// A heartbeat: this server's load written into the store, the farm read back and kept
    /// for the API. Returns both.
    fn beat(&self, state: &ServerState) -> (Heartbeat, Vec<Heartbeat>) {
        let mine = self.heartbeat(state);
        if let Err(e) = self.write_heartbeat(&state.store, &mine) {
            // Every 2 s while it fails: through the limiter.
            state.log.log(
                log::Level::Warn,
                module_path!(),
                "heartbeat",
                format_args!(
                    "rebalance: cannot write this server's heartbeat in {}: {e}",
                    servers_dir(&state.store).display()
                ),
            );
        }
        let beats = self.read_farm(&state.store, &mine);
        *lock(&self.farm) = beats.clone();
        (mine, beats)
    }

    /// One round: read the farm, plan, and move what the plan says. Returns the targets
    /// moved and where.
    pub fn round(&self, state: &ServerState, kind: Round) -> Vec<(String, String)> {
        let (mine, beats) = self.beat(state);
        if kind == Round::Periodic && !self.config.enabled && !mine.load.draining {
            return Vec::new();
        }
        let loads: Vec<Load> = beats.iter().map(load_of).collect();
        let draining = mine.load.draining;
        if kind == Round::Periodic && !draining && self.settled_for() < SETTLE {
            log::debug!(
                "rebalance: nothing moves yet: the farm's servers changed {:.1?} ago",
                self.settled_for()
            );
            return Vec::new();
        }
        let plan = plan(0, &loads, self.config.threshold_percent, self.config.floor);
        let (moves, why) = match plan {
            Plan::Stay(why) => {
                if draining && mine.load.targets > 0 {
                    log::warn!("rebalance: draining, but {why}: the targets stay until another server takes them");
                } else {
                    log::debug!("rebalance: nothing moves: {why}");
                }
                return Vec::new();
            }
            Plan::Move(moves, why) => (moves, why),
        };
        if !draining {
            self.rounds.fetch_add(1, Relaxed);
        }
        let sessions = state.registry.sessions();
        let recent = if draining {
            Duration::ZERO
        } else {
            self.config.interval
        };
        let candidates = movable(state, &sessions, recent);
        let want: u64 = moves.iter().map(|(_, n)| n).sum();
        let chosen = pick_evenly(&candidates, want as usize);
        if chosen.len() < want as usize {
            log::info!(
                "rebalance: {} of the {want} targets to move can move now (the others are in their boot window, just arrived, or of cache type server)",
                chosen.len()
            );
        }
        let mut to = moves
            .iter()
            .flat_map(|(server, n)| std::iter::repeat_n(server.clone(), *n as usize));
        let mut moved = Vec::new();
        {
            let mut hints = lock(&self.hints);
            hints.retain(|_, (_, at, _)| at.elapsed() < HINT_TTL);
            for target in &chosen {
                let Some(server) = to.next() else { break };
                hints.insert(
                    target.clone(),
                    (
                        server.clone(),
                        Instant::now(),
                        if draining { "drain" } else { "rebalance" },
                    ),
                );
                moved.push((target.clone(), server));
            }
        }
        if kind != Round::HintsOnly {
            for (target, _) in &moved {
                for s in sessions
                    .iter()
                    .filter(|s| s.info.target.as_deref() == Some(target))
                {
                    s.close();
                }
            }
        }
        self.moved_out.fetch_add(moved.len() as u64, Relaxed);
        let mut per: BTreeMap<&str, u64> = BTreeMap::new();
        for (_, s) in &moved {
            *per.entry(s).or_default() += 1;
        }
        log::info!(
            "rebalance: moving {} target(s) ({}): {why}",
            moved.len(),
            per.iter()
                .map(|(s, n)| format!("{n} to {s}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        audit(state, &moved, &why, draining);
        moved
    }

    /// Heartbeats and rounds until the task is dropped: a heartbeat every [`HEARTBEAT`], a
    /// round every interval (the first after one interval, so a starting farm has seen
    /// itself), and one at once when [`Balancer::kick`]ed.
    pub async fn run(self: Arc<Self>, state: Arc<ServerState>) {
        let mut beat = tokio::time::interval(HEARTBEAT);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut next_round = Instant::now() + self.config.interval;
        loop {
            let kicked = tokio::select! {
                _ = beat.tick() => false,
                _ = self.kick.notified() => true,
            };
            let due = Instant::now() >= next_round;
            let b = self.clone();
            let s = state.clone();
            let round = match (kicked, due) {
                (true, _) => Some(Round::Drain),
                (false, true) => Some(Round::Periodic),
                (false, false) => None,
            };
            let _ = tokio::task::spawn_blocking(move || {
                if let Some(kind) = round {
                    b.round(&s, kind);
                } else {
                    b.beat(&s);
                }
            })
            .await;
            if due {
                next_round = Instant::now() + self.config.interval;
            }
        }
    }

    /// Removes this server's heartbeat (a clean stop: the others stop counting it at once).
    pub fn leave(&self, state: &ServerState) {
        let _ = std::fs::remove_file(servers_dir(&state.store).join(file_name(&state.name)));
    }

    /// The hints for every target of this server, for a SIGTERM drain: where each should
    /// go, spread by the others' shares. The connections are ended by the drain itself.
    pub fn plan_drain(&self, state: &ServerState) -> usize {
        self.round(state, Round::HintsOnly).len()
    }
}

/// The distinct targets with a connection here.
fn targets_of(sessions: &[Arc<Session>]) -> Vec<String> {
    let mut t: Vec<String> = sessions
        .iter()
        .filter_map(|s| s.info.target.clone())
        .collect();
    t.sort();
    t.dedup();
    t
}

/// The targets that may move now (see the module docs), busiest first.
fn movable(state: &ServerState, sessions: &[Arc<Session>], recent: Duration) -> Vec<String> {
    let now = unix_ms();
    let mut per: BTreeMap<String, (f64, bool)> = BTreeMap::new();
    for s in sessions {
        let Some(t) = &s.info.target else { continue };
        let age_ms = now.saturating_sub(s.connected_unix_ms);
        let c = s.counters.snapshot();
        let rate =
            (c.guest_read_ops + c.guest_write_ops) as f64 / (age_ms.max(1000) as f64 / 1000.0);
        let stays = s.info.cache_type.as_deref() == Some("server")
            || (age_ms as u128) < recent.as_millis()
            || state.pacer.as_ref().is_some_and(|p| p.is_booting(t));
        let e = per.entry(t.clone()).or_insert((0.0, false));
        e.0 += rate;
        e.1 |= stays;
    }
    let mut v: Vec<(String, f64)> = per
        .into_iter()
        .filter(|(_, (_, stays))| !stays)
        .map(|(t, (rate, _))| (t, rate))
        .collect();
    v.sort_by(|a, b| {
        b.1.partial_cmp(&a.1)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.0.cmp(&b.0))
    });
    v.into_iter().map(|(t, _)| t).collect()
}

/// One line in the audit trail for a round that moved targets.
fn audit(state: &ServerState, moved: &[(String, String)], why: &str, draining: bool) {
    if moved.is_empty() {
        return;
    }
    let details = serde_json::json!({
        "server": state.name,
        "kind": if draining { "drain" } else { "rebalance" },
        "moved": moved.iter().map(|(t, s)| serde_json::json!({"target": t, "to": s})).collect::<Vec<_>>(),
        "why": why,
    });
    let r = vdstream_store::Store::open(&state.store)
        .map(|s| s.with_client(format!("server {}", state.name)))
        .and_then(|s| s.audit_event("farm.rebalance", "", details));
    if let Err(e) = r {
        log::warn!("rebalance: cannot record the round in the audit trail: {e}");
    }
}
