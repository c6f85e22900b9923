//! `GET /api/v1/server`: the store server's document about itself, which the agent reads
//! to place a target (the least busy server first) and to find its NBD address.
//!
//! Invariant: `nbd` and `sessions` are required (an agent cannot place a target without
//! them); everything else has a default, so a newer or older server still reads.

use serde::{Deserialize, Serialize};

/// `GET /api/v1/server`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ServerDoc {
    /// `--name`, how logs and the API call this server.
    #[serde(default)]
    pub name: String,
    /// The store directory.
    #[serde(default)]
    pub store: String,
    pub nbd: NbdAddresses,
    /// Live NBD sessions.
    pub sessions: u64,
    /// Whether the server drains (SIGTERM): no new target should go there.
    #[serde(default)]
    pub draining: bool,
    #[serde(default)]
    pub started_unix_ms: u64,
    /// The server's release.
    #[serde(default)]
    pub version: String,
    #[serde(default)]
    pub read_cache: ReadCacheDoc,
    /// Guest I/O (what clients asked for) against store I/O (what reached the store's
    /// files) of every session since the server started.
    #[serde(default)]
    pub io: IoDoc,
    /// The boot service's pacing (`--max-booting`); `null` without `--boot`.
    #[serde(default)]
    pub boot: Option<BootPacingDoc>,
    /// Rebalancing across the store's servers (`--rebalance`, `--weight`).
    #[serde(default)]
    pub balance: BalanceDoc,
}

/// This server's part in rebalancing.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct BalanceDoc {
    /// `--rebalance on`: rounds run every `--rebalance-interval`.
    pub enabled: bool,
    /// `--weight`, the power rating.
    pub weight: f64,
    /// Targets with a connection here.
    pub targets: u64,
    /// This server's fair share of the farm's targets, by weight (as last read).
    pub share: f64,
    /// Servers of the store seen alive (this one included).
    pub servers: u64,
    /// Rounds that moved targets away since the server started.
    pub rounds: u64,
    /// Targets moved away since the server started (rebalancing and drains).
    pub moved_out: u64,
    /// Drained through the API (`POST /api/v1/server/drain`): it takes no new target.
    pub drained: bool,
}

/// The store's servers as this one last read their heartbeats (`GET /api/v1/farm`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct FarmDoc {
    /// `--rebalance-threshold`: percent above its share before a server moves targets.
    pub threshold_percent: f64,
    /// `--rebalance-floor`: nothing moves while the farm has fewer targets.
    pub floor: u64,
    /// `--rebalance-interval`, in seconds.
    pub interval_secs: u64,
    pub servers: Vec<FarmServer>,
}

/// What a server says of its load to the others of its store (its heartbeat).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct ServerLoad {
    pub name: String,
    /// `--weight`, its power rating.
    pub weight: f64,
    /// Targets with a connection there.
    pub targets: u64,
    pub sessions: u64,
    /// Guest requests a second over the last minute.
    pub guest_iops: f64,
    pub draining: bool,
    /// Whether it runs rebalancing rounds.
    pub rebalance: bool,
}

/// One server of the farm.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct FarmServer {
    #[serde(flatten)]
    pub load: ServerLoad,
    /// Its fair share of the farm's targets, by weight (0 while draining).
    pub share: f64,
    /// How old its heartbeat is, in milliseconds.
    pub age_ms: u64,
}

/// Where a target should reconnect (`GET /api/v1/targets/{id}/placement`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct PlacementDoc {
    pub target: String,
    /// The server's name (`GET /api/v1/server`'s `name`) this server moved the target to;
    /// `null`: no advice, place it as usual.
    pub server: Option<String>,
    /// `rebalance` or `drain`, when `server` is given.
    pub reason: Option<String>,
}

/// Boot pacing: machines in their boot window, and those told to wait.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct BootPacingDoc {
    /// `--max-booting` (0: no limit).
    pub max_booting: u64,
    /// Machines in their boot window now.
    pub booting: u64,
    /// The most that were at once since the server started.
    pub booting_peak: u64,
    /// Machines told to wait that are still asking.
    pub waiting: u64,
    /// Boot windows opened since the server started.
    pub admitted_total: u64,
    /// Answers that told a machine to wait.
    pub waits_total: u64,
    /// Windows closed by the machine saying it booted.
    pub booted_total: u64,
    /// Windows closed by `--boot-window` running out.
    pub expired_total: u64,
}

/// Where the server takes NBD connections (`null` or absent: not there).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct NbdAddresses {
    /// `HOST:PORT` of the TCP listener.
    pub listen: Option<String>,
    /// The unix socket's path.
    pub socket: Option<String>,
}

/// The shared read cache: what it holds, and how often it spared the store a read.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct ReadCacheDoc {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub shared_loads: u64,
    pub evictions: u64,
    /// hits / (hits + misses), to three places; `null` before the first read.
    pub hit_ratio: Option<f64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct IoDoc {
    pub guest: IoTotals,
    pub store: IoTotals,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct IoTotals {
    pub read_ops: u64,
    pub read_bytes: u64,
    pub write_ops: u64,
    pub write_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_agent_needs_nbd_and_sessions() {
        let d: ServerDoc = serde_json::from_str(r#"{"name": "b", "nbd": {"listen": null, "socket": "/b.sock"}, "sessions": 2, "draining": true}"#).unwrap();
        assert_eq!(
            (d.nbd.socket.as_deref(), d.sessions, d.draining),
            (Some("/b.sock"), 2, true)
        );
        for (doc, field) in [
            (r#"{"name": "x", "sessions": 1}"#, "nbd"),
            (r#"{"nbd": {}}"#, "sessions"),
        ] {
            let e = serde_json::from_str::<ServerDoc>(doc)
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("missing field `{field}`")), "{e}");
        }
    }

    proptest! {
        #[test]
        fn a_server_document_survives_json(
            name in "\\PC{0,16}", n in any::<[u64; 12]>(), draining: bool, listen in proptest::option::of("[0-9.:]{1,20}"),
            socket in proptest::option::of("/[a-z/.]{1,20}"), ratio in proptest::option::of(0u32..=1000),
        ) {
            let t = |i: usize| IoTotals { read_ops: n[i], read_bytes: n[i + 1], write_ops: n[i + 2], write_bytes: n[i + 3] };
            let d = ServerDoc {
                name, store: "/srv/store".into(), nbd: NbdAddresses { listen, socket }, sessions: n[0], draining,
                started_unix_ms: n[1], version: "0.1.0".into(),
                read_cache: ReadCacheDoc { capacity_bytes: n[2], used_bytes: n[3], hits: n[4], misses: n[5], shared_loads: n[6], evictions: n[7],
                                           hit_ratio: ratio.map(|r| f64::from(r) / 1000.0) },
                io: IoDoc { guest: t(4), store: t(8) },
                boot: draining.then(|| BootPacingDoc { max_booting: n[9], booting: n[10], booting_peak: n[11], ..BootPacingDoc::default() }),
                balance: BalanceDoc { enabled: !draining, weight: f64::from(ratio.unwrap_or(1)), targets: n[2], share: (n[3] % 1_000_000) as f64 / 10.0,
                                      servers: n[4], rounds: n[5], moved_out: n[6], drained: draining },
            };
            let text = serde_json::to_string(&d).unwrap();
            prop_assert_eq!(serde_json::from_str::<ServerDoc>(&text).unwrap(), d);
        }
    }
}
