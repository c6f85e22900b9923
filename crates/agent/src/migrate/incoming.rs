//! The destination side: an agent attached with `--incoming SOCKET` takes its target's
//! cache from the source agent there, holding its own export's requests until the final
//! delta is in.

use std::io::BufReader;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vdstream_blockdev::lock;

use super::wire::{self, Kind};
use super::{Migration, CONVERGED_BYTES};

/// How long the destination tries to reach its source: at start, and again when the link
/// breaks after the guest asked here (then only the source has the last writes).
const CONNECT_FOR: Duration = Duration::from_secs(30);

/// How one session ended.
enum Ended {
    /// The final delta is in: this agent serves.
    Done,
    /// The source refused (a wrong vDisk, cache type, target): no use trying again.
    Refused(String),
    /// The link broke or the source went away.
    Broken(String),
}

/// Runs the handover from the source at `source` on a thread of its own; the gate opens
/// when it is done, or every held request fails and the agent ends when it cannot be.
pub fn run_incoming(m: Arc<Migration>, source: PathBuf, size: u64) {
    let final_wanted = Arc::new(AtomicBool::new(false));
    let writer: Arc<Mutex<Option<UnixStream>>> = Arc::new(Mutex::new(None));
    {
        let (final_wanted, writer, m2) = (final_wanted.clone(), writer.clone(), m.clone());
        m.dev.on_first_request(Box::new(move || {
            // The guest runs here: its source VM stopped and flushed. Ask for the final delta.
            log::info!(
                "target {}: the guest's first request here: asking the source for the final delta",
                m2.target
            );
            final_wanted.store(true, SeqCst);
            if let Some(w) = lock(&writer).as_mut() {
                let _ = wire::write(w, Kind::Final, &[]);
            }
        }));
    }
    m.begin("destination", &source.display().to_string());
    let spawn = std::thread::Builder::new()
        .name("migrate-in".into())
        .spawn(move || {
            let started = Instant::now();
            loop {
                match session(&m, &source, size, &final_wanted, &writer) {
                    Ended::Done => return,
                    Ended::Refused(why) => return fail(&m, &why),
                    Ended::Broken(why) => {
                        // Before the guest asked here, the source serves on: give up. After,
                        // only the source has the last writes: try to reach it again.
                        if !final_wanted.load(SeqCst) || started.elapsed() > CONNECT_FOR * 4 {
                            return fail(&m, &why);
                        }
                        log::warn!("target {}: {why}; trying the source again", m.target);
                        std::thread::sleep(Duration::from_millis(200));
                    }
                }
            }
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

fn connect(source: &Path) -> std::io::Result<UnixStream> {
    let start = Instant::now();
    loop {
        match UnixStream::connect(source) {
            Ok(s) => return Ok(s),
            Err(e) if start.elapsed() > CONNECT_FOR => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

fn session(
    m: &Migration,
    source: &Path,
    size: u64,
    final_wanted: &AtomicBool,
    writer: &Mutex<Option<UnixStream>>,
) -> Ended {
    let conn = match connect(source) {
        Ok(c) => c,
        Err(e) => {
            return Ended::Broken(format!(
                "cannot reach the source agent's migration socket {}: {e}",
                source.display()
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
    let mut w = match conn.try_clone() {
        Ok(w) => w,
        Err(e) => return Ended::Broken(e.to_string()),
    };
    if let Err(e) = wire::write_json(&mut w, Kind::Hello, &hello) {
        return Ended::Broken(format!("the source agent closed the connection: {e}"));
    }
    let mut r = BufReader::with_capacity(wire::MAX_PAYLOAD + 64, conn);
    let broken =
        |e: std::io::Error| Ended::Broken(format!("the link to the source agent broke: {e}"));
    let welcome = match wire::read(&mut r) {
        Ok(Some(f)) if f.kind == Kind::Welcome => f,
        Ok(Some(f)) if f.kind == Kind::Error => return Ended::Refused(f.text()),
        Ok(_) => return Ended::Broken("the source agent closed the connection at once".into()),
        Err(e) => return broken(e),
    };
    let fenced = welcome
        .json::<wire::Welcome>()
        .map(|w| w.fenced)
        .unwrap_or(false);
    log::info!(
        "target {}: taking the cache from the source agent at {}{}",
        m.target,
        source.display(),
        if fenced {
            " (it is fenced: one final round)"
        } else {
            ""
        }
    );
    *lock(writer) = Some(w);
    if final_wanted.load(SeqCst) {
        if let Some(w) = lock(writer).as_mut() {
            let _ = wire::write(w, Kind::Final, &[]);
        }
    }
    m.update(|s| s.phase = "pre-copy".into());
    let (mut data, mut wire_bytes) = (0u64, 0u64);
    let ended = loop {
        let f = match wire::read(&mut r) {
            Ok(Some(f)) => f,
            Ok(None) => {
                break Ended::Broken(
                    "the source agent closed the connection before the final delta".into(),
                )
            }
            Err(e) => break broken(e),
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
                    break Ended::Refused(format!(
                        "flushing this agent's cache after the final delta failed: {e}"
                    ));
                }
                if let Some(w) = lock(writer).as_mut() {
                    if let Err(e) = wire::write(w, Kind::Ack, &[]) {
                        break broken(e);
                    }
                }
                m.dev.open();
                m.update(|s| {
                    s.rounds = done.rounds;
                    s.final_bytes = done.final_bytes;
                    s.data_bytes = data;
                    s.wire_bytes = wire_bytes;
                    s.dirty_bytes = 0;
                });
                m.finish("done", None);
                log::info!(
                    "target {}: took over from the source agent after {} rounds ({data} bytes, final delta {} bytes); serving",
                    m.target, done.rounds, done.final_bytes
                );
                break Ended::Done;
            }
            Kind::Error => break Ended::Refused(f.text()),
            k => Err(wire::bad(format!("an unexpected {k:?} frame"))),
        };
        if let Err(e) = applied {
            break Ended::Refused(format!("applying the source's cache: {e}"));
        }
    };
    *lock(writer) = None;
    ended
}

fn check_range(off: u64, len: u64, size: u64) -> std::io::Result<()> {
    if off.checked_add(len).is_none_or(|end| end > size) {
        return Err(wire::bad(format!(
            "a range {off}+{len} past the disk's {size} bytes"
        )));
    }
    Ok(())
}
