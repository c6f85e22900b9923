//! The destination side: an agent attached with `--incoming SOCKET|tls://HOST:PORT` takes
//! its target's cache from the source agent there, holding its own export's writes until
//! the final delta is in.

use std::io::BufReader;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vdstream_blockdev::lock;

use super::link::SourceAddr;
use super::wire::{self, Kind};
use super::{Migration, CONVERGED_BYTES};

/// How long the destination tries to reach its source at start.
const CONNECT_FOR: Duration = Duration::from_secs(30);

/// How one session ended.
enum Ended {
    /// The final delta is in: this agent serves.
    Serving,
    /// qemu failed after the switch-over: the source serves on, this agent nothing.
    Reverted,
    /// The source refused (a wrong vDisk, cache type, target), the link broke, or the
    /// source went away before the final delta: the source keeps the target.
    Failed(String),
}

/// Runs the handover from the source at `source` on a thread of its own; the gate opens
/// when the final delta is in, or every held request fails and the agent ends.
pub fn run_incoming(m: Arc<Migration>, source: SourceAddr, size: u64) {
    m.begin("destination", &source.to_string());
    let spawn = std::thread::Builder::new()
        .name("migrate-in".into())
        .spawn(move || match session(&m, &source, size) {
            Ended::Serving => {}
            Ended::Reverted => {
                log::warn!(
                    "target {}: qemu's migration failed after the switch-over: the source agent serves on; this agent ends",
                    m.target
                );
                m.finish("reverted", Some(super::REVERTED.into()));
                m.end_agent();
            }
            Ended::Failed(why) => fail(&m, &why),
        });
    if let Err(e) = spawn {
        log::error!("target: cannot start the incoming migration: {e}");
    }
}

fn fail(m: &Migration, why: &str) {
    log::error!(
        "target {}: the incoming migration failed: {why}; this agent serves nothing and ends (the source agent keeps the target)",
        m.target
    );
    m.dev.fail();
    m.finish("failed", Some(why.to_string()));
    m.end_agent();
}

/// Connects to the source, trying again while it may not listen yet (not after a failed
/// TLS handshake: that is an answer).
fn connect(source: &SourceAddr) -> std::io::Result<UnixStream> {
    let start = Instant::now();
    loop {
        match source.connect() {
            Ok(s) => return Ok(s),
            Err(e) if !e.retry || start.elapsed() > CONNECT_FOR => return Err(e.error),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// A `server`-type destination, before it opens its vDisk: asks the source for the attach
/// it holds on the store server, to join it (the store server's cache is the target's).
pub fn join(
    source: &SourceAddr,
    target: &str,
    cache: &str,
) -> Result<crate::remote::JoinAttach, String> {
    let mut conn = connect(source)
        .map_err(|e| format!("cannot reach the source agent's migration link {source}: {e}"))?;
    let ask = wire::Join {
        version: wire::VERSION,
        target: target.to_string(),
        cache: cache.to_string(),
    };
    wire::write_json(&mut conn, Kind::Join, &ask)
        .map_err(|e| format!("the source agent closed the connection: {e}"))?;
    match wire::read(&mut conn) {
        Ok(Some(f)) if f.kind == Kind::Joined => {
            let j: wire::Joined = f.json().map_err(|e| e.to_string())?;
            Ok(crate::remote::JoinAttach {
                export: j.export,
                secret: j.secret,
            })
        }
        Ok(Some(f)) if f.kind == Kind::Error => Err(f.text()),
        Ok(_) => Err("the source agent closed the connection at once".into()),
        Err(e) => Err(format!("the link to the source agent broke: {e}")),
    }
}

fn session(m: &Migration, source: &SourceAddr, size: u64) -> Ended {
    let conn = match connect(source) {
        Ok(c) => c,
        Err(e) => {
            return Ended::Failed(format!(
                "cannot reach the source agent's migration link {source}: {e}"
            ))
        }
    };
    let hello = wire::Hello {
        version: wire::VERSION,
        target: m.target.clone(),
        export: m.export.clone(),
        size,
        cache: m.cache.clone(),
    };
    let writer = match conn.try_clone() {
        Ok(w) => Arc::new(Mutex::new(w)),
        Err(e) => return Ended::Failed(e.to_string()),
    };
    if let Err(e) = wire::write_json(&mut *lock(&writer), Kind::Hello, &hello) {
        return Ended::Failed(format!("the source agent closed the connection: {e}"));
    }
    let send = |kind: Kind, text: &str| wire::write(&mut *lock(&writer), kind, &[text.as_bytes()]);
    let mut r = BufReader::with_capacity(wire::MAX_PAYLOAD + 64, conn);
    let broken =
        |e: std::io::Error| Ended::Failed(format!("the link to the source agent broke: {e}"));
    match wire::read(&mut r) {
        Ok(Some(f)) if f.kind == Kind::Welcome => {}
        Ok(Some(f)) if f.kind == Kind::Error => return Ended::Failed(f.text()),
        Ok(_) => return Ended::Failed("the source agent closed the connection at once".into()),
        Err(e) => return broken(e),
    }
    log::info!(
        "target {}: taking the cache from the source agent at {source}",
        m.target
    );
    m.update(|s| s.phase = "pre-copy".into());
    let (mut data, mut wire_bytes) = (0u64, 0u64);
    loop {
        let f = match wire::read(&mut r) {
            Ok(Some(f)) => f,
            Ok(None) if m.finished() => return Ended::Serving,
            Ok(None) if m.dev.is_open() => {
                // After the switch this agent has everything: the source's end changes nothing.
                log::info!("target {}: the source agent went away after the switch-over; this agent has the whole cache and serves on", m.target);
                m.finish("done", None);
                return Ended::Serving;
            }
            Ok(None) => {
                return Ended::Failed(
                    "the source agent closed the connection before the final delta".into(),
                )
            }
            Err(_) if m.finished() => return Ended::Serving,
            Err(e) if m.dev.is_open() => {
                log::warn!("target {}: the link to the source agent broke after the switch-over ({e}); this agent has the whole cache and serves on", m.target);
                m.finish("done", None);
                return Ended::Serving;
            }
            Err(e) => return broken(e),
        };
        wire_bytes += 5 + f.payload.len() as u64;
        let applied = match f.kind {
            Kind::Data => f.offset_and_rest().and_then(|(off, bytes)| {
                data += bytes.len() as u64;
                check_range(off, bytes.len() as u64, size)?;
                m.dev
                    .apply_write(bytes, off)
                    .map_err(|e| std::io::Error::other(e.to_string()))
            }),
            Kind::Zero => f.offset_and_rest().and_then(|(off, rest)| {
                let len = u64::from_be_bytes(
                    rest.try_into()
                        .map_err(|_| wire::bad("a zero frame without its length".into()))?,
                );
                data += len;
                check_range(off, len, size)?;
                m.dev
                    .apply_zeroes(off, len)
                    .map_err(|e| std::io::Error::other(e.to_string()))
            }),
            Kind::Round => f.json::<wire::RoundEnd>().map(|round| {
                m.update(|s| {
                    s.rounds = round.round + 1;
                    s.data_bytes = data;
                    s.wire_bytes = wire_bytes;
                    s.dirty_bytes = round.dirty_bytes;
                    if round.dirty_bytes <= CONVERGED_BYTES {
                        s.phase = "converged".into();
                    }
                });
            }),
            Kind::Done => {
                let done = f.json::<wire::Done>().unwrap_or(wire::Done {
                    rounds: 0,
                    final_bytes: 0,
                });
                // Everything is in: make it as durable as the cache makes anything, then serve.
                if let Err(e) = m.dev.below().flush() {
                    return Ended::Failed(format!(
                        "flushing this agent's cache after the final delta failed: {e}"
                    ));
                }
                // The first guest write here is announced before it runs: the source then
                // knows it may not take the target back.
                let w = writer.clone();
                m.dev.on_first_write(Box::new(move || {
                    let _ = wire::write(&mut *lock(&w), Kind::Serving, &[]);
                }));
                // Open before the acknowledgement, so that a source that heard it (and the
                // qemu told to go on) finds this export serving.
                m.dev.open();
                m.update(|s| {
                    s.rounds = done.rounds;
                    s.final_bytes = done.final_bytes;
                    s.data_bytes = data;
                    s.wire_bytes = wire_bytes;
                    s.dirty_bytes = 0;
                    s.phase = "switched".into();
                });
                if let Err(e) = send(Kind::Ack, "") {
                    return broken(e);
                }
                log::info!(
                    "target {}: took over from the source agent after {} rounds ({data} bytes, final delta {} bytes); serving",
                    m.target, done.rounds, done.final_bytes
                );
                Ok(())
            }
            Kind::Commit => {
                // A second commit may follow the first (sent when this agent served a write)
                // with qemu's downtime: read on until the source closes.
                let info = wire::CommitInfo::of(&f.payload);
                m.update(|s| s.qemu_downtime_ms = s.qemu_downtime_ms.or(info.qemu_downtime_ms));
                if !m.finished() {
                    m.finish("done", None);
                }
                Ok(())
            }
            Kind::Revert => {
                // Hold new requests, then give the target back only if no write was served.
                m.dev.fence(super::FENCE_LIMIT);
                if m.dev.wrote() {
                    m.dev.open();
                    let _ = send(
                        Kind::Error,
                        "the destination served guest writes already: it keeps the target",
                    );
                    Ok(())
                } else {
                    m.dev.fail();
                    let _ = send(Kind::Reverted, "");
                    return Ended::Reverted;
                }
            }
            Kind::Error => return Ended::Failed(f.text()),
            k => Err(wire::bad(format!("an unexpected {k:?} frame"))),
        };
        if let Err(e) = applied {
            return Ended::Failed(format!("applying the source's cache: {e}"));
        }
    }
}

fn check_range(off: u64, len: u64, size: u64) -> std::io::Result<()> {
    if off.checked_add(len).is_none_or(|end| end > size) {
        return Err(wire::bad(format!(
            "a range {off}+{len} past the disk's {size} bytes"
        )));
    }
    Ok(())
}
