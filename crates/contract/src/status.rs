//! An agent's status document: the agent's status file (`vdstream target status ID
//! [--json]`), the report it sends to the API (`PUT /api/v1/targets/ID/agent`), and what
//! the server's `/metrics` exports of it.
//!
//! Invariants: every field has a default (`#[serde(default)]`), so a document from an
//! older or newer agent with fewer or more fields still reads; a field of the wrong type
//! does not. Rates (`iops`, `bytes_per_sec`) are over the last status interval; counters
//! only grow during an attach.

use serde::{Deserialize, Serialize};

/// One agent, as `vdstream target status` and the API show it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct Status {
    pub target: String,
    pub pid: u32,
    /// `running`; `cache lost` (running, but the server lost the target's `server` cache:
    /// every guest request fails with EIO; see `server.lost`); or `stopped` (written last,
    /// at a clean exit).
    pub state: String,
    pub started_unix_ms: u64,
    pub updated_unix_ms: u64,
    /// The local export, for qemu: `nbd+unix:///?socket=SOCKET`.
    pub socket: String,
    pub listen: Option<String>,
    /// The vhost-user-blk socket (`--vhost-user`), for a VM on this host.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vhost_user: Option<VhostUserStatus>,
    /// A live migration this agent takes part in, as its source or its destination
    /// (absent when there is none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub migration: Option<MigrationStatus>,
    pub vdisk: VdiskStatus,
    pub server: ServerStatus,
    pub cache: CacheStatus,
    /// What the target asked for.
    pub guest: IoStatus,
    /// What reached storage: reads of the vDisk over the network, and the overflow or
    /// cache file (for the `server` types: everything, since every request goes to the server).
    pub storage: IoStatus,
}

/// The vhost-user-blk backend of an agent: its socket and what its frontends asked.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct VhostUserStatus {
    pub socket: String,
    /// Queues offered (a frontend may use fewer).
    pub queues: u16,
    /// A frontend (qemu) is connected now.
    pub connected: bool,
    /// Frontends that connected since the attach (a VM's reboots and restarts).
    pub connections: u64,
    pub requests: u64,
    /// Requests that failed on the device (answered IOERR).
    pub errors: u64,
    /// Requests the frontend got wrong: malformed descriptor chains, ranges past the end
    /// or not aligned to the block size (answered IOERR, or given back unanswered).
    pub malformed: u64,
}

/// One live migration of a target's write cache between two agents, from one side.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct MigrationStatus {
    /// `source` (the agent that serves and sends its cache) or `destination` (the incoming
    /// agent that takes it and holds its export's requests until the final delta is in).
    pub role: String,
    /// `connecting`, `pre-copy` (the first full copy), `converged` (rounds of what the
    /// guest dirtied are small now: ready to switch), `switching` (the source is fenced and
    /// sends the final delta), `done` (the destination serves; the source is fenced and
    /// ends), `cancelled` or `failed` (see `error`).
    pub phase: String,
    /// The other agent: where the destination reaches its source (a migration socket or
    /// tls://HOST:PORT), or, on the source, where the destination came from.
    pub peer: String,
    /// Rounds sent or received, the first full copy included.
    pub rounds: u64,
    /// Cache bytes moved (data sent, and the length of zero ranges sent as such).
    pub data_bytes: u64,
    /// Bytes on the wire between the agents, headers included.
    pub wire_bytes: u64,
    /// Source: what the cache holds beyond the vDisk (the least a handover moves), at
    /// the switch; before it, now.
    pub held_bytes: u64,
    /// What the source still has to send: bytes the guest dirtied since the last round.
    pub dirty_bytes: u64,
    /// Bytes of the final delta, sent with the source fenced.
    pub final_bytes: u64,
    /// Milliseconds from the source's fence to the destination's acknowledgement of the
    /// final delta: while no agent serves the target.
    pub fenced_ms: u64,
    /// Destination: the longest a guest request waited for the handover, in milliseconds
    /// (0 when the handover was done before the guest asked): the pause the migration adds
    /// to qemu's own `downtime`.
    pub held_ms: u64,
    pub started_unix_ms: u64,
    /// qemu's `downtime` of this migration (from `query-migrate`), as `vdstream target
    /// migrate` read it at the commit; on both agents once committed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qemu_downtime_ms: Option<u64>,
    /// When the migration ended (done, cancelled or failed); 0 while it runs.
    pub finished_unix_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct VdiskStatus {
    /// The export read (with the store server: `vdisk/NAME@V`, V fixed at attach).
    pub export: String,
    pub description: Option<String>,
    pub size: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct ServerStatus {
    /// The server in use (or last used).
    pub endpoint: String,
    pub connected: bool,
    /// Every server listed, in the order tried.
    pub endpoints: Vec<String>,
    /// Requests re-sent after their connection broke.
    pub retries: u64,
    pub reconnects: u64,
    /// Reconnects that moved to another server.
    pub failovers: u64,
    /// Requests failed because no server answered within --retry-for.
    pub gave_up: u64,
    pub read_ops: u64,
    pub read_bytes: u64,
    pub write_ops: u64,
    pub write_bytes: u64,
    /// Why the target's attach is lost for good, once it is (state `cache lost`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lost: Option<String>,
    /// server-persistent: the journal of answered, unflushed writes (absent without one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub journal: Option<JournalStatus>,
}

/// The agent's journal of answered writes not yet covered by a flush.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct JournalStatus {
    /// Writes, trims and zeroes kept now, and the bytes they take.
    pub changes: u64,
    pub bytes: u64,
    /// Changes sent again to a new connection, in all.
    pub replayed: u64,
    /// Replayed changes the new server refused.
    pub replay_errors: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct CacheStatus {
    /// The cache type's name.
    #[serde(rename = "type")]
    pub kind: String,
    pub ram_bytes: u64,
    pub ram_limit: u64,
    pub file_bytes: u64,
    pub file_limit: u64,
    /// RAM limit + file limit (the file limit is the vDisk's size without a cap).
    pub limit_bytes: u64,
    /// Free bytes on the file system of the overflow or cache file (absent without a file).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fs_free_bytes: Option<u64>,
    /// What the cache can really hold: RAM limit + min(file limit, file in use + free).
    pub capacity_bytes: u64,
    /// (RAM + file in use) over `capacity_bytes`, in percent.
    pub used_percent: f64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub nospace_errors: u64,
    /// Where the overflow or cache file lives.
    pub dir: String,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct IoStatus {
    pub read_ops: u64,
    pub read_bytes: u64,
    pub write_ops: u64,
    pub write_bytes: u64,
    /// Operations per second over the last interval.
    pub iops: f64,
    pub bytes_per_sec: f64,
}

impl IoStatus {
    /// Sets the rates from the previous reading, `secs` ago.
    pub fn rate_from(&mut self, prev: &IoStatus, secs: f64) {
        if secs <= 0.0 {
            return;
        }
        let ops = (self.read_ops + self.write_ops).saturating_sub(prev.read_ops + prev.write_ops);
        let bytes =
            (self.read_bytes + self.write_bytes).saturating_sub(prev.read_bytes + prev.write_bytes);
        self.iops = ops as f64 / secs;
        self.bytes_per_sec = bytes as f64 / secs;
    }
}

/// The state of an agent whose server lost the target's cache.
pub const STATE_LOST: &str = "cache lost";

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_partial_report_reads_and_a_wrong_one_does_not() {
        let s: Status = serde_json::from_str(r#"{"target": "vm1", "server": {"retries": 4, "connected": true}, "cache": {"used_percent": 30.5}}"#).unwrap();
        assert_eq!(
            (
                s.target.as_str(),
                s.server.retries,
                s.server.connected,
                s.cache.used_percent
            ),
            ("vm1", 4, true, 30.5)
        );
        assert!(serde_json::from_str::<Status>(r#"{"server": 5}"#)
            .unwrap_err()
            .to_string()
            .contains("struct ServerStatus"));
        assert!(serde_json::from_str::<Status>(r#"{"server": {"retries": "x"}}"#).is_err());
    }

    fn io() -> impl Strategy<Value = IoStatus> {
        (any::<[u64; 4]>(), 0u32..1_000_000, 0u32..1_000_000).prop_map(|(n, iops, bps)| IoStatus {
            read_ops: n[0],
            read_bytes: n[1],
            write_ops: n[2],
            write_bytes: n[3],
            iops: f64::from(iops) / 8.0,
            bytes_per_sec: f64::from(bps),
        })
    }

    proptest! {
        #[test]
        fn a_status_survives_json(
            target in "[a-z0-9-]{1,12}", pid: u32, n in any::<[u64; 8]>(), guest in io(), storage in io(),
            lost in proptest::option::of("\\PC{0,20}"), journal in proptest::option::of(any::<[u64; 4]>()), free in proptest::option::of(any::<u64>()),
            vhost in proptest::option::of((any::<[u64; 4]>(), any::<u16>(), any::<bool>())),
            migration in proptest::option::of((any::<[u64; 8]>(), "[a-z-]{1,12}", proptest::option::of("\\PC{0,20}"))),
        ) {
            let s = Status {
                target, pid, state: STATE_LOST.into(), started_unix_ms: n[0], updated_unix_ms: n[1], socket: "/s".into(), listen: None,
                vhost_user: vhost.map(|(v, queues, connected)| VhostUserStatus {
                    socket: "/v".into(), queues, connected, connections: v[0], requests: v[1], errors: v[2], malformed: v[3],
                }),
                migration: migration.map(|(m, phase, error)| MigrationStatus {
                    role: "source".into(), phase, peer: "/run/vdstream/vm1.migrate".into(), rounds: m[0], data_bytes: m[1],
                    wire_bytes: m[2], held_bytes: m[2] / 2, dirty_bytes: m[3], final_bytes: m[4], fenced_ms: m[5], held_ms: m[6],
                    started_unix_ms: m[7], qemu_downtime_ms: (m[0] % 2 == 0).then_some(m[5] % 500), finished_unix_ms: 0, error,
                }),
                vdisk: VdiskStatus { export: "vdisk/w@3".into(), description: Some("vdisk/w@3 (production)".into()), size: n[2] },
                server: ServerStatus {
                    endpoint: "nbd://a/".into(), connected: true, endpoints: vec!["nbd://a/".into()], retries: n[3], reconnects: n[4],
                    failovers: n[5], gave_up: n[6], read_ops: n[7], lost,
                    journal: journal.map(|j| JournalStatus { changes: j[0], bytes: j[1], replayed: j[2], replay_errors: j[3] }),
                    ..ServerStatus::default()
                },
                cache: CacheStatus { kind: "ram-overflow".into(), fs_free_bytes: free, used_percent: 12.5, ..CacheStatus::default() },
                guest, storage,
            };
            let text = serde_json::to_string(&s).unwrap();
            prop_assert_eq!(serde_json::from_str::<Status>(&text).unwrap(), s);
        }
    }
}
