//! The source side: the agent's migration socket, one session at a time with a destination
//! agent, and the control requests of `vdstream target migrate` (Switch, Cancel).

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vdstream_blockdev::lock;

use super::tracked::{Take, PAGE};
use super::wire::{self, Kind};
use super::{Migration, ACK_LIMIT, CONVERGED_BYTES, FENCE_LIMIT, ROUND_EVERY};

/// The bound migration socket, and the TLS listener between hosts if any, served by
/// [`Listener::start`].
#[derive(Debug)]
pub struct Listener {
    listener: UnixListener,
    path: PathBuf,
    tls: Option<(
        std::net::TcpListener,
        Arc<vdstream_tls::rustls::ServerConfig>,
    )>,
}

/// What the session and the control connections share.
#[derive(Debug, Default)]
struct Control {
    busy: AtomicBool,
    switch: AtomicBool,
    cancel: AtomicBool,
    commit: AtomicBool,
    revert: AtomicBool,
    /// Control requests waiting for their answer: a source that handed over ends only
    /// once they have it.
    waiters: std::sync::atomic::AtomicUsize,
    /// Bumped at the end of each session; its outcome kept beside it.
    ended: AtomicU64,
    outcome: Mutex<Option<Result<(), String>>>,
}

impl Listener {
    /// Binds `path` with owner-only access: a stale socket there is replaced, a live one
    /// or anything that is not a socket refused.
    pub fn bind(path: &Path) -> std::io::Result<Listener> {
        use std::os::unix::fs::PermissionsExt;
        vdstream_nbd::listen::clear_stale_socket(path).map_err(std::io::Error::other)?;
        let listener = UnixListener::bind(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        Ok(Listener {
            listener,
            path: path.to_path_buf(),
            tls: None,
        })
    }

    /// Also takes destinations on `addr`, over TLS with `config` ([`super::link`]).
    pub fn with_tls(
        mut self,
        addr: std::net::SocketAddr,
        config: Arc<vdstream_tls::rustls::ServerConfig>,
    ) -> std::io::Result<Listener> {
        self.tls = Some((std::net::TcpListener::bind(addr)?, config));
        Ok(self)
    }

    /// Where destinations reach this agent: the socket, and `tls://ADDR` if it listens there.
    pub fn describe(&self) -> String {
        match &self.tls {
            Some((l, _)) => format!(
                "{} and tls://{}",
                self.path.display(),
                l.local_addr().map_or("?".into(), |a| a.to_string())
            ),
            None => self.path.display().to_string(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Serves the socket on a thread of its own for the life of the process.
    pub fn start(mut self, m: Arc<Migration>) {
        let control = Arc::new(Control::default());
        let path = self.path.clone();
        if let Some((tcp, config)) = self.tls.take() {
            let (m, control) = (m.clone(), control.clone());
            let target = m.target.clone();
            let serve = Arc::new(move |conn: UnixStream, from: String| {
                if let Err(e) = serve_conn(conn, &m, &control, Some(&from)) {
                    log::warn!("target {}: migration link {from}: {e}", m.target);
                }
            });
            if let Err(e) = super::link::serve_tls(tcp, config, target, serve) {
                log::error!("target: cannot serve the migration link: {e}");
            }
        }
        let spawn = std::thread::Builder::new()
            .name("migrate-listen".into())
            .spawn(move || {
                for conn in self.listener.incoming() {
                    let Ok(conn) = conn else { continue };
                    let (m, control) = (m.clone(), control.clone());
                    let _ = std::thread::Builder::new()
                        .name("migrate-conn".into())
                        .spawn(move || {
                            if let Err(e) = serve_conn(conn, &m, &control, None) {
                                log::warn!("target {}: migration socket: {e}", m.target);
                            }
                        });
                }
            });
        if let Err(e) = spawn {
            log::error!(
                "target: cannot serve the migration socket {}: {e}",
                path.display()
            );
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Serves one connection: a destination's hello or join (the server types), a status
/// query, or (on the local socket only, `remote` being `None`) a control request of
/// `vdstream target migrate`.
fn serve_conn(
    mut conn: UnixStream,
    m: &Arc<Migration>,
    c: &Arc<Control>,
    remote: Option<&str>,
) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let Some(first) = wire::read(&mut conn)? else {
        return Ok(());
    };
    conn.set_read_timeout(None)?;
    if let (Some(from), Kind::Switch | Kind::Cancel | Kind::Commit | Kind::Revert) =
        (remote, first.kind)
    {
        log::warn!(
            "target {}: refused a {:?} request from {from}: the handover is driven on this host only",
            m.target,
            first.kind
        );
        let why = "the switch, cancel, commit and revert are taken on the source host's migration socket only (vdstream target migrate there)";
        wire::write(&mut conn, Kind::Error, &[why.as_bytes()])?;
        return Ok(());
    }
    let from = remote.unwrap_or("the migration socket").to_string();
    match first.kind {
        Kind::Hello => {
            let hello: wire::Hello = first.json()?;
            if let Err(why) = check_hello(&hello, m) {
                log::warn!("target {}: refused a migration: {why}", m.target);
                wire::write(&mut conn, Kind::Error, &[why.as_bytes()])?;
                return Ok(());
            }
            if c.busy.swap(true, SeqCst) {
                let why = "a migration of this target is already under way (cancel it first: vdstream target migrate ID --cancel)";
                wire::write(&mut conn, Kind::Error, &[why.as_bytes()])?;
                return Ok(());
            }
            for f in [&c.switch, &c.cancel, &c.commit, &c.revert] {
                f.store(false, SeqCst);
            }
            *lock(&c.outcome) = None;
            let result = session(conn, m, c, &from);
            if let Err(e) = &result {
                log::warn!("target {}: the migration ended: {e}", m.target);
                if !m.finished() {
                    let fenced = m.dev.is_fenced();
                    m.finish("failed", Some(if fenced {
                        format!("{e}; this agent stays fenced and keeps the cache: restart the destination's attach with --incoming to take it again")
                    } else {
                        format!("{e}; this agent serves on")
                    }));
                }
            }
            *lock(&c.outcome) = Some(result.map_err(|e| e.to_string()));
            c.ended.fetch_add(1, SeqCst);
            c.busy.store(false, SeqCst);
            m.notify();
            if m.phase().as_deref() == Some("done") {
                m.wait_until(Duration::from_secs(5), || c.waiters.load(SeqCst) == 0);
                m.end_agent();
            }
            Ok(())
        }
        Kind::Query => {
            wire::write_json(&mut conn, Kind::Ok, &m.status())?;
            Ok(())
        }
        Kind::Join => {
            let join: wire::Join = first.json()?;
            match joined(&join, m) {
                Ok(j) => {
                    log::info!(
                        "target {}: a destination agent on {from} joins attach {}",
                        m.target,
                        j.export
                    );
                    wire::write_json(&mut conn, Kind::Joined, &j)?;
                }
                Err(why) => {
                    log::warn!("target {}: refused a migration: {why}", m.target);
                    wire::write(&mut conn, Kind::Error, &[why.as_bytes()])?;
                }
            }
            Ok(())
        }
        Kind::Switch | Kind::Cancel | Kind::Commit | Kind::Revert => {
            if !c.busy.load(SeqCst) {
                let why = match m.phase() {
                    Some(p) if p == "done" => {
                        "this agent handed its target over already".to_string()
                    }
                    _ => format!("no destination agent is taking target {}'s cache: start `vdstream target attach {} --incoming {}` on the destination first", m.target, m.target, super::socket_path(&m.target).display()),
                };
                wire::write(&mut conn, Kind::Error, &[why.as_bytes()])?;
                return Ok(());
            }
            c.waiters.fetch_add(1, SeqCst);
            let _waiting = Waiting(c, m);
            let seen = c.ended.load(SeqCst);
            if first.kind == Kind::Commit {
                let info = wire::CommitInfo::of(&first.payload);
                m.update(|s| s.qemu_downtime_ms = info.qemu_downtime_ms);
            }
            let flag = match first.kind {
                Kind::Cancel => &c.cancel,
                Kind::Commit => &c.commit,
                Kind::Revert => &c.revert,
                _ => &c.switch,
            };
            flag.store(true, SeqCst);
            m.notify();
            // A switch is answered once the destination has everything (phase `switched`);
            // the others when the session ends.
            let ended = || c.ended.load(SeqCst) != seen;
            let switched =
                || first.kind == Kind::Switch && m.phase().as_deref() == Some("switched");
            m.wait_until(FENCE_LIMIT + ACK_LIMIT, || ended() || switched());
            let outcome = if ended() {
                lock(&c.outcome).clone()
            } else if switched() {
                Some(Ok(()))
            } else {
                None
            };
            match outcome {
                Some(Ok(())) => wire::write_json(&mut conn, Kind::Ok, &m.status())?,
                Some(Err(e)) => wire::write(&mut conn, Kind::Error, &[e.as_bytes()])?,
                None => wire::write(
                    &mut conn,
                    Kind::Error,
                    &[b"the migration did not get there in time"],
                )?,
            };
            Ok(())
        }
        k => Err(wire::bad(format!("a {k:?} frame to open a connection"))),
    }
}

/// The attach a `server`-type destination joins, if it matches this agent.
fn joined(j: &wire::Join, m: &Migration) -> Result<wire::Joined, String> {
    check_hello(
        &wire::Hello {
            version: j.version,
            target: j.target.clone(),
            export: m.export.clone(),
            size: m.dev.below().size(),
            cache: j.cache.clone(),
        },
        m,
    )?;
    let attach = m.server.as_ref().and_then(|r| r.attach()).ok_or_else(|| {
        format!(
            "this agent holds no attach of a store server to hand over (its {} link names no target/{}@ATTACH with a secret)",
            m.cache, m.target
        )
    })?;
    Ok(wire::Joined {
        export: attach.export,
        secret: attach.secret,
    })
}

fn check_hello(h: &wire::Hello, m: &Migration) -> Result<(), String> {
    if h.version != wire::VERSION {
        return Err(format!(
            "the destination speaks migration protocol {}, this agent {}: run the same vdstream on both hosts",
            h.version,
            wire::VERSION
        ));
    }
    if h.target != m.target {
        return Err(format!(
            "the destination attaches target {:?}, this agent serves {:?}",
            h.target, m.target
        ));
    }
    // A `server`-type destination joined this agent's attach: its export names the attach,
    // this agent's the target it first asked for.
    let same_export = m.server.is_some() || h.export == m.export;
    if !same_export || h.size != m.dev.below().size() {
        return Err(format!("the destination reads {} ({} bytes), this agent {} ({} bytes): attach it to the same vDisk version", h.export, h.size, m.export, m.dev.below().size()));
    }
    if h.cache != m.cache {
        return Err(format!(
            "the destination has a {} cache, this agent {}: use --cache {} there",
            h.cache, m.cache, m.cache
        ));
    }
    Ok(())
}

/// How long a source whose destination serves already waits for `target migrate`'s commit
/// (it follows qemu's completion within milliseconds) before it ends without it.
const LATE_COMMIT: Duration = Duration::from_secs(2);

/// What the destination said on its own, read beside the rounds.
#[derive(Debug, Default)]
struct Heard {
    acked: AtomicBool,
    /// The destination served its first guest write: its VM runs.
    serving: AtomicBool,
    reverted: AtomicBool,
    refused_revert: AtomicBool,
    gone: AtomicBool,
}

fn session(
    conn: UnixStream,
    m: &Arc<Migration>,
    c: &Arc<Control>,
    from: &str,
) -> std::io::Result<()> {
    m.begin("source", &format!("destination on {from}"));
    let fenced = m.dev.is_fenced();
    log::info!(
        "target {}: a destination agent on {from} takes this target's cache{}",
        m.target,
        if fenced {
            " (again: this agent is fenced since a final delta it was not told arrived)"
        } else {
            ""
        }
    );
    let heard = Arc::new(Heard::default());
    // However the session ends, the connection closes: the reader thread's clone of it
    // would keep it open otherwise.
    let _close = CloseOnDrop(conn.try_clone()?);
    {
        let (mut r, heard, m) = (conn.try_clone()?, heard.clone(), m.clone());
        std::thread::Builder::new()
            .name("migrate-read".into())
            .spawn(move || {
                loop {
                    match wire::read(&mut r) {
                        Ok(Some(f)) if f.kind == Kind::Ack => heard.acked.store(true, SeqCst),
                        Ok(Some(f)) if f.kind == Kind::Serving => heard.serving.store(true, SeqCst),
                        Ok(Some(f)) if f.kind == Kind::Reverted => {
                            heard.reverted.store(true, SeqCst)
                        }
                        Ok(Some(f)) if f.kind == Kind::Error => {
                            log::warn!("target {}: the destination says: {}", m.target, f.text());
                            heard.refused_revert.store(true, SeqCst);
                        }
                        _ => break,
                    }
                    m.notify();
                }
                heard.gone.store(true, SeqCst);
                m.notify();
            })?;
    }
    let mut w = std::io::BufWriter::with_capacity(wire::MAX_PAYLOAD + 64, conn);
    let mut wire_bytes = wire::write_json(&mut w, Kind::Welcome, &wire::Welcome { fenced })?;
    m.update(|s| s.phase = "pre-copy".into());
    let mut round = 0u64;
    let stop = |heard: &Heard| heard.gone.load(SeqCst) || c.cancel.load(SeqCst);
    // Rounds until asked to switch.
    if !fenced {
        loop {
            // The server types have nothing to copy: an empty round says so, and another
            // ends the wait for the switch (or the cancel).
            if m.server.is_some() && round > 0 && !stop(&heard) && !c.switch.load(SeqCst) {
                m.wait(ROUND_EVERY);
                continue;
            }
            let runs = m.dev.take(
                if round == 0 { Take::All } else { Take::Round },
                wire::MAX_DATA as u64,
            );
            let (data, bytes) = send_runs(&mut w, m, &runs, &|| stop(&heard))?;
            wire_bytes += bytes;
            let dirty = m.dev.dirty_bytes();
            wire_bytes += wire::write_json(
                &mut w,
                Kind::Round,
                &wire::RoundEnd {
                    round,
                    dirty_bytes: dirty,
                },
            )?;
            round += 1;
            m.update(|s| {
                s.rounds = round;
                s.data_bytes += data;
                s.wire_bytes = wire_bytes;
                if dirty <= CONVERGED_BYTES {
                    s.phase = "converged".into();
                }
            });
            if stop(&heard) {
                // Read once: the phase, the reason and the outcome must agree.
                let cancelled = c.cancel.load(SeqCst);
                let (phase, why) = if cancelled {
                    ("cancelled", "cancelled")
                } else {
                    (
                        "failed",
                        "the destination agent went away before the switch",
                    )
                };
                log::info!("target {}: migration {why}; this agent serves on", m.target);
                m.finish(phase, Some(why.into()));
                return if cancelled {
                    Ok(())
                } else {
                    Err(wire::bad(why.into()))
                };
            }
            if c.switch.load(SeqCst) {
                break;
            }
            if dirty <= CONVERGED_BYTES {
                m.wait(ROUND_EVERY);
            }
        }
    }
    // The switch: fence, then everything not sent yet.
    m.update(|s| s.phase = "switching".into());
    let fenced_at = Instant::now();
    if !m.dev.fence(FENCE_LIMIT) {
        m.dev.open();
        let why =
            "requests in flight did not finish within the fence's limit; this agent serves on";
        m.finish("failed", Some(why.into()));
        return Err(wire::bad(why.into()));
    }
    log::info!(
        "target {}: fenced for the switch after {round} rounds",
        m.target
    );
    if m.server.is_some() {
        // The cache is the store server's: what this agent answered and the server has not
        // made durable (the journal) is flushed now, so the destination starts with nothing
        // to replay.
        if let Err(e) = m.dev.below().flush() {
            m.dev.open();
            let why = format!(
                "flushing the store server before the switch failed ({e}); this agent serves on"
            );
            m.finish("failed", Some(why.clone()));
            return Err(wire::bad(why));
        }
    }
    let held = m.dev.held_bytes();
    m.update(|s| s.held_bytes = held);
    let runs = m.dev.take(
        if fenced { Take::All } else { Take::Round },
        wire::MAX_DATA as u64,
    );
    let (final_bytes, bytes) = send_runs(&mut w, m, &runs, &|| heard.gone.load(SeqCst))?;
    wire_bytes += bytes;
    round += 1;
    wire_bytes += wire::write_json(
        &mut w,
        Kind::Done,
        &wire::Done {
            rounds: round,
            final_bytes,
        },
    )?;
    m.update(|s| {
        s.rounds = round;
        s.data_bytes += final_bytes;
        s.final_bytes = final_bytes;
        s.wire_bytes = wire_bytes;
    });
    m.wait_until(ACK_LIMIT, || {
        heard.acked.load(SeqCst) || heard.gone.load(SeqCst)
    });
    if !heard.acked.load(SeqCst) {
        // The destination may or may not serve now: staying fenced is the safe answer, and a
        // new session from it gets the whole cache again.
        let why = "the destination did not acknowledge the final delta: this agent stays fenced and keeps the cache; restart the destination's attach with --incoming to take it again";
        log::error!("target {}: {why}", m.target);
        m.finish("failed", Some(why.into()));
        return Err(wire::bad(why.into()));
    }
    let fenced_ms = fenced_at.elapsed().as_millis() as u64;
    m.update(|s| {
        s.fenced_ms = fenced_ms;
        s.phase = "switched".into();
    });
    m.notify();
    log::info!(
        "target {}: the destination has the whole cache after {round} rounds ({} bytes moved, final delta {final_bytes} bytes, fenced {fenced_ms} ms); waiting for the commit",
        m.target,
        m.status().map_or(0, |s| s.data_bytes)
    );
    // Switched: the destination holds everything, this agent is fenced. The migration
    // commits when told (qemu completed), or when the destination serves a guest write; it
    // reverts when told (qemu failed after the switch-over: the source VM resumes here),
    // provided the destination served no write.
    loop {
        if c.commit.load(SeqCst) || heard.serving.load(SeqCst) {
            let info = || wire::CommitInfo {
                qemu_downtime_ms: m.status().and_then(|s| s.qemu_downtime_ms),
            };
            let _ = wire::write_json(&mut w, Kind::Commit, &info());
            if !c.commit.load(SeqCst) {
                // The destination serves before qemu's completion reached `target migrate`:
                // its commit, when it comes, brings qemu's downtime to pass on.
                m.wait_until(LATE_COMMIT, || {
                    c.commit.load(SeqCst) || c.revert.load(SeqCst) || heard.gone.load(SeqCst)
                });
                if c.commit.load(SeqCst) {
                    let _ = wire::write_json(&mut w, Kind::Commit, &info());
                }
            }
            break;
        }
        if c.revert.load(SeqCst) {
            if !heard.gone.load(SeqCst) && !heard.serving.load(SeqCst) {
                let _ = wire::write(&mut w, Kind::Revert, &[]);
                m.wait_until(ACK_LIMIT, || {
                    heard.reverted.load(SeqCst)
                        || heard.refused_revert.load(SeqCst)
                        || heard.gone.load(SeqCst)
                });
            }
            // The destination failed its gate, or went away without serving a write (it
            // announces a write before it runs it): this agent holds the only cache.
            if heard.reverted.load(SeqCst)
                || (heard.gone.load(SeqCst) && !heard.serving.load(SeqCst))
            {
                m.dev.open();
                log::info!(
                    "target {}: switch-over reverted: this agent serves on",
                    m.target
                );
                m.finish("reverted", Some(super::REVERTED.into()));
                return Ok(());
            }
            let why = "cannot revert: the destination serves the guest's writes already; it keeps the target";
            log::warn!("target {}: {why}", m.target);
            break;
        }
        m.wait(Duration::from_millis(50));
    }
    log::info!("target {}: handed over; this agent ends", m.target);
    for f in &m.cache_files {
        super::remove_quietly(f, &m.target);
    }
    m.finish("done", None);
    Ok(())
}

/// Counts one control request as waiting until its answer is written.
struct Waiting<'a>(&'a Control, &'a Migration);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, SeqCst);
        self.1.notify();
    }
}

struct CloseOnDrop(UnixStream);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        let _ = self.0.shutdown(std::net::Shutdown::Both);
    }
}

/// Sends `runs`, read from the cache below the gate: all-zero pages as Zero frames, the
/// rest as Data. Stops early when `stop` says so. Returns (cache bytes, wire bytes).
fn send_runs(
    w: &mut impl Write,
    m: &Migration,
    runs: &[(u64, u64)],
    stop: &dyn Fn() -> bool,
) -> std::io::Result<(u64, u64)> {
    let (mut data, mut wire_bytes) = (0u64, 0u64);
    let mut buf = vec![0u8; wire::MAX_DATA];
    for &(off, len) in runs {
        if stop() {
            break;
        }
        let buf = &mut buf[..len as usize];
        m.dev
            .below()
            .read_at(buf, off)
            .map_err(|e| std::io::Error::other(format!("reading the cache to send it: {e}")))?;
        let mut at = 0usize;
        while at < buf.len() {
            let page_end = |i: usize| (i + PAGE as usize).min(buf.len());
            let zero = buf[at..page_end(at)].iter().all(|&b| b == 0);
            let mut end = page_end(at);
            while end < buf.len() && buf[end..page_end(end)].iter().all(|&b| b == 0) == zero {
                end = page_end(end);
            }
            let o = off + at as u64;
            wire_bytes += if zero {
                wire::write(
                    w,
                    Kind::Zero,
                    &[&o.to_be_bytes(), &((end - at) as u64).to_be_bytes()],
                )?
            } else {
                wire::write(w, Kind::Data, &[&o.to_be_bytes(), &buf[at..end]])?
            };
            data += (end - at) as u64;
            at = end;
        }
    }
    Ok((data, wire_bytes))
}
