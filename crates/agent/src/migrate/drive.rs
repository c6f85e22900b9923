//! `vdstream target migrate`: drives one live migration from the source host. It waits for
//! the destination agent to converge, and runs qemu's migration through QMP with
//! `pause-before-switchover`: at `pre-switchover` the source VM is stopped and its disk
//! flushed, and the source agent sends its final delta (Switch) before qemu goes on; at
//! `completed` the handover commits (the source agent ends). A qemu migration that fails
//! before the switch cancels the handover (the source agent was never fenced); one that
//! fails after it reverts it (the destination fails its gate, the source serves on).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};
use vdstream_contract::status::MigrationStatus;

use super::wire::{self, Kind};

/// What a migration run is told.
#[derive(Debug, Clone)]
pub struct DriveConfig {
    pub target: String,
    /// The source agent's migration socket.
    pub socket: PathBuf,
    /// The source qemu's QMP socket; without it, the caller runs qemu's migration itself
    /// (libvirt) and this only waits for convergence and switches.
    pub qmp: Option<PathBuf>,
    /// qemu's migration URI (`tcp:HOST:PORT`, `unix:PATH`): the destination qemu's `-incoming`.
    pub to: Option<String>,
    /// How long to wait for the destination agent to converge, and for qemu to finish.
    pub converge_for: Duration,
    pub qemu_for: Duration,
}

/// qemu's own figures of its migration (`query-migrate`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct QemuFigures {
    pub status: String,
    pub total_ms: u64,
    pub downtime_ms: u64,
    pub setup_ms: u64,
    pub ram_bytes: u64,
}

/// A finished migration: qemu's figures and the handover's.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    pub target: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qemu: Option<QemuFigures>,
    pub handover: MigrationStatus,
}

#[derive(Debug, thiserror::Error)]
pub enum DriveError {
    #[error("target {target}: {message}")]
    Agent { target: String, message: String },
    /// The source agent is not where a migration can start: no destination converged, or
    /// it handed the target over already.
    #[error("target {target}: {message}")]
    NotReady { target: String, message: String },
    #[error("target {target}: qemu's QMP socket {qmp}: {message}")]
    Qmp {
        target: String,
        qmp: String,
        message: String,
    },
    #[error("target {target}: the migration {status}: {message}; the source agent serves on")]
    Failed {
        target: String,
        status: String,
        message: String,
    },
}

/// One request on the source agent's migration socket; its answer's payload.
pub fn ask(socket: &Path, kind: Kind, wait: Duration) -> Result<wire::Frame, String> {
    ask_with(socket, kind, &[], wait)
}

/// [`ask`] with a payload.
pub fn ask_with(
    socket: &Path,
    kind: Kind,
    payload: &[u8],
    wait: Duration,
) -> Result<wire::Frame, String> {
    let mut s = UnixStream::connect(socket).map_err(|e| {
        format!(
            "cannot reach the source agent's migration socket {}: {e} (is the target attached on this host?)",
            socket.display()
        )
    })?;
    s.set_read_timeout(Some(wait)).map_err(|e| e.to_string())?;
    wire::write(&mut s, kind, &[payload]).map_err(|e| e.to_string())?;
    match wire::read(&mut s) {
        Ok(Some(f)) if f.kind == Kind::Error => Err(f.text()),
        Ok(Some(f)) => Ok(f),
        Ok(None) => Err("the source agent closed the connection".into()),
        Err(e) => Err(format!("no answer from the source agent: {e}")),
    }
}

/// The source agent's migration now.
pub fn query(socket: &Path) -> Result<Option<MigrationStatus>, String> {
    let f = ask(socket, Kind::Query, Duration::from_secs(10))?;
    f.json::<Option<MigrationStatus>>()
        .map_err(|e| e.to_string())
}

/// Cancels the source agent's migration (it serves on).
pub fn cancel(socket: &Path) -> Result<(), String> {
    ask(socket, Kind::Cancel, Duration::from_secs(30)).map(|_| ())
}

/// `target migrate --cancel`: qemu's migration first (through `qmp`, when given), then the
/// source agent's.
pub fn cancel_all(socket: &Path, qmp: Option<&Path>) -> Result<(), String> {
    if let Some(qmp) = qmp {
        Qmp::connect(qmp)
            .and_then(|mut q| q.execute("migrate_cancel", json!({})))
            .map_err(|e| format!("qemu's QMP socket {}: {e}", qmp.display()))?;
    }
    cancel(socket)
}

/// One of Switch (fence and send the final delta), Commit or Revert; the source agent's
/// migration status after.
pub fn tell(socket: &Path, kind: Kind) -> Result<MigrationStatus, String> {
    tell_with(socket, kind, &[])
}

/// Commits the handover, telling both agents qemu's downtime (when a qemu was driven).
pub fn commit(socket: &Path, qemu_downtime_ms: Option<u64>) -> Result<MigrationStatus, String> {
    let info = serde_json::to_vec(&wire::CommitInfo { qemu_downtime_ms }).expect("plain JSON");
    tell_with(socket, Kind::Commit, &info)
}

fn tell_with(socket: &Path, kind: Kind, payload: &[u8]) -> Result<MigrationStatus, String> {
    let f = ask_with(socket, kind, payload, super::FENCE_LIMIT + super::ACK_LIMIT)?;
    f.json::<Option<MigrationStatus>>()
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "the source agent reports no migration".into())
}

/// Runs one migration (see the module docs); `progress` hears each step.
pub fn run(cfg: &DriveConfig, progress: &dyn Fn(&str)) -> Result<Outcome, DriveError> {
    let agent_err = |message: String| DriveError::Agent {
        target: cfg.target.clone(),
        message,
    };
    // 1. The destination agent has the cache but the last rounds.
    let start = Instant::now();
    loop {
        let s = query(&cfg.socket).map_err(agent_err)?;
        match s.as_ref().map(|s| s.phase.as_str()) {
            Some("converged") => {
                let s = s.expect("some");
                progress(&format!(
                    "the destination agent converged: {} rounds, {} bytes moved, {} bytes dirty",
                    s.rounds, s.data_bytes, s.dirty_bytes
                ));
                break;
            }
            Some("done") if s.as_ref().is_some_and(|s| s.role == "source") => {
                return Err(DriveError::NotReady {
                    target: cfg.target.clone(),
                    message: "this agent handed the target over already".into(),
                })
            }
            _ if start.elapsed() > cfg.converge_for => {
                return Err(DriveError::NotReady {
                    target: cfg.target.clone(),
                    message: format!(
                    "no destination agent converged within {} s (migration: {}); start `vdstream target attach {} --incoming {}` on the destination",
                    cfg.converge_for.as_secs(),
                    s.map_or("none".into(), |s| format!("{} {}", s.role, s.phase)),
                    cfg.target,
                    cfg.socket.display()
                ),
                })
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    let (Some(qmp_path), Some(to)) = (&cfg.qmp, &cfg.to) else {
        // No VM to move (the caller stopped it, or moves a disk alone): switch and commit.
        tell(&cfg.socket, Kind::Switch).map_err(agent_err)?;
        let handover = commit(&cfg.socket, None).map_err(agent_err)?;
        return Ok(Outcome {
            target: cfg.target.clone(),
            qemu: None,
            handover,
        });
    };
    let qmp_err = |message: String| DriveError::Qmp {
        target: cfg.target.clone(),
        qmp: qmp_path.display().to_string(),
        message,
    };
    // 2. qemu's migration, paused before its switch-over.
    let mut qmp = Qmp::connect(qmp_path).map_err(qmp_err)?;
    qmp.execute(
        "migrate-set-capabilities",
        json!({ "capabilities": [{ "capability": "pause-before-switchover", "state": true }] }),
    )
    .map_err(qmp_err)?;
    qmp.execute("migrate", json!({ "uri": to }))
        .map_err(qmp_err)?;
    progress(&format!("qemu migrates to {to}"));
    let failed = |status: String, message: String| DriveError::Failed {
        target: cfg.target.clone(),
        status,
        message,
    };
    let start = Instant::now();
    let mut switched = false;
    let figures = loop {
        let q = qmp.execute("query-migrate", json!({})).map_err(qmp_err)?;
        let status = q["status"].as_str().unwrap_or("").to_string();
        match status.as_str() {
            "pre-switchover" if !switched => {
                // 3. The source VM is stopped and flushed: the final delta, then qemu goes on.
                let s = tell(&cfg.socket, Kind::Switch);
                if let Err(e) = s {
                    let _ = qmp.execute("migrate_cancel", json!({}));
                    let _ = cancel(&cfg.socket);
                    return Err(failed(
                        "was cancelled".into(),
                        format!("the source agent could not switch: {e}"),
                    ));
                }
                switched = true;
                progress("the destination agent has the whole cache; qemu switches over");
                qmp.execute("migrate-continue", json!({ "state": "pre-switchover" }))
                    .map_err(qmp_err)?;
            }
            "completed" => break figures_of(&q),
            "failed" | "cancelled" => {
                let message = q["error-desc"]
                    .as_str()
                    .unwrap_or("qemu gave no reason")
                    .to_string();
                if switched {
                    // The source VM resumes at its agent: take the target back.
                    tell(&cfg.socket, Kind::Revert).map_err(agent_err)?;
                } else {
                    let _ = cancel(&cfg.socket);
                }
                return Err(failed(status, message));
            }
            _ if start.elapsed() > cfg.qemu_for && !switched => {
                let _ = qmp.execute("migrate_cancel", json!({}));
                let _ = cancel(&cfg.socket);
                return Err(failed(
                    "was cancelled".into(),
                    format!("qemu did not finish within {} s", cfg.qemu_for.as_secs()),
                ));
            }
            _ => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    progress(&format!(
        "qemu's migration completed: {} ms in all, {} ms downtime",
        figures.total_ms, figures.downtime_ms
    ));
    // 4. The destination VM runs: the source agent ends.
    let handover = commit(&cfg.socket, Some(figures.downtime_ms)).map_err(agent_err)?;
    Ok(Outcome {
        target: cfg.target.clone(),
        qemu: Some(figures),
        handover,
    })
}

fn figures_of(q: &Value) -> QemuFigures {
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    QemuFigures {
        status: q["status"].as_str().unwrap_or("").into(),
        total_ms: n(&q["total-time"]),
        downtime_ms: n(&q["downtime"]),
        setup_ms: n(&q["setup-time"]),
        ram_bytes: n(&q["ram"]["transferred"]),
    }
}

/// A QMP connection: one command at a time, events skipped.
#[derive(Debug)]
pub struct Qmp {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Qmp {
    pub fn connect(path: &Path) -> Result<Qmp, String> {
        let s = UnixStream::connect(path).map_err(|e| format!("cannot connect: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(|e| e.to_string())?;
        let w = s.try_clone().map_err(|e| e.to_string())?;
        let mut q = Qmp {
            r: BufReader::new(s),
            w,
        };
        let greeting = q.line()?;
        if greeting.get("QMP").is_none() {
            return Err(format!("not a QMP greeting: {greeting}"));
        }
        q.execute("qmp_capabilities", json!({}))?;
        Ok(q)
    }

    fn line(&mut self) -> Result<Value, String> {
        let mut l = String::new();
        match self.r.read_line(&mut l) {
            Ok(0) => Err("qemu closed the connection".into()),
            Ok(_) => serde_json::from_str(&l).map_err(|e| format!("a bad QMP line: {e}")),
            Err(e) => Err(format!("reading: {e}")),
        }
    }

    /// Runs `command`; its `return`, or its error's description.
    pub fn execute(&mut self, command: &str, args: Value) -> Result<Value, String> {
        let mut msg = json!({ "execute": command });
        if args.as_object().is_some_and(|o| !o.is_empty()) {
            msg["arguments"] = args;
        }
        writeln!(self.w, "{msg}").map_err(|e| format!("writing: {e}"))?;
        loop {
            let v = self.line()?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(format!(
                    "{command}: {}",
                    e["desc"]
                        .as_str()
                        .unwrap_or("an error without a description")
                ));
            }
        }
    }
}
