//! Running a [`Workload`] through a vhost-user-blk backend (`vdstream bench vhost-user:PATH`):
//! qemu-storage-daemon's `--export type=vhost-user-blk`, vdstream's own backend, or any
//! other, driven by libblkio's pure-Rust core (the `blkio` crate, its
//! `virtio-blk-vhost-user` driver: a real vhost-user frontend that shares its virtqueues and
//! buffers with the backend through memfd-backed memory, as a VM would).
//!
//! One virtqueue per worker, each driven by its own OS thread that keeps `queue_depth`
//! requests in flight: it submits into the free buffer slots, then waits for at least one
//! completion (`do_io`, on the queue's completion eventfd, no busy polling) and reports it.
//! The offsets, `--verify` stamps and ledger, histograms, counters and sampler are those of
//! the NBD runner ([`crate::measure`]), so the figures compare.
//!
//! Invariants: a request's latency runs from just before it is queued to the `do_io` call
//! that reaps it (queued requests are kicked to the backend by that call at once); a
//! completion with an error is counted as an error answer and the run goes on; a queue that
//! fails, or a request with no answer within [`REQUEST_TIMEOUT`] (a backend that stopped),
//! ends the run. Every buffer lies in one memory region mapped into the backend before the
//! first request, and outlives every queue.

use std::ffi::CStr;
use std::mem::MaybeUninit;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, Errno, ReqFlags};

use crate::measure::{self, Finished, Pick, Progress, RunOptions, Shared, TaskFigures};
use crate::pattern;
use crate::result::BenchResult;
use crate::workload::{OpStream, Workload};
use crate::BenchError;

/// How long the vhost-user handshake may take (the NBD client's connect timeout).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a request may wait for its answer before the run ends (the NBD client's).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long one `do_io` waits before the thread looks at the clock again.
const WAIT_SLICE: Duration = Duration::from_millis(100);

const FORMS: &str =
    "give vhost-user:PATH or vhost-user:///ABSOLUTE/PATH, the backend's unix socket";

/// The socket of `vhost-user:PATH` or `vhost-user:///ABSOLUTE/PATH`.
fn socket_path(uri: &str) -> Result<PathBuf, String> {
    let Some(rest) = uri.strip_prefix("vhost-user:") else {
        return Err(format!("not a vhost-user target: {FORMS}"));
    };
    let path = match rest.strip_prefix("//") {
        Some(p) if p.starts_with('/') => p,
        Some(_) => {
            return Err(format!(
                "a vhost-user socket is on this machine, there is no host part: {FORMS}"
            ))
        }
        None => rest,
    };
    if path.is_empty() {
        return Err(format!("no socket path: {FORMS}"));
    }
    Ok(PathBuf::from(path))
}

fn vhost_error(uri: &str, cause: impl Into<String>, hint: impl Into<String>) -> BenchError {
    BenchError::VhostUser {
        uri: uri.to_string(),
        cause: cause.into(),
        hint: hint.into(),
    }
}

/// Opens a libblkio instance on `path` and does the vhost-user handshake, at most
/// [`CONNECT_TIMEOUT`] (a socket whose peer never answers would block it for ever: that
/// helper thread is then left behind, blocked, until the process ends).
fn connect(uri: &str, path: &str, read_only: bool) -> Result<Blkio, BenchError> {
    let (tx, rx) = mpsc::channel();
    let p = path.to_string();
    std::thread::Builder::new()
        .name("vhost-user-connect".into())
        .spawn(move || {
            let connected = (|| {
                let mut b = Blkio::new("virtio-blk-vhost-user")?;
                b.set_str("path", &p)?;
                // A read-only device starts only for a read-only frontend; reads need no more.
                b.set_bool("read-only", read_only)?;
                b.connect()?;
                Ok::<_, blkio::Error>(b)
            })();
            let _ = tx.send(connected);
        })
        .map_err(BenchError::Threads)?;
    match rx.recv_timeout(CONNECT_TIMEOUT) {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => Err(connect_error(uri, path, &e)),
        Err(_) => Err(vhost_error(
            uri,
            format!("{path} gave no vhost-user answer within {} s", CONNECT_TIMEOUT.as_secs()),
            "is it a vhost-user-blk backend's socket, with no other frontend connected? qemu-storage-daemon serves one at a time",
        )),
    }
}

fn connect_error(uri: &str, path: &str, e: &blkio::Error) -> BenchError {
    let errno = e.errno();
    let msg = e.message();
    if errno == Errno::NOENT {
        vhost_error(uri, format!("no socket at {path}: {msg}"), "is the vhost-user-blk backend running, with this path as its socket? e.g. qemu-storage-daemon --export type=vhost-user-blk,addr.type=unix,addr.path=PATH,...")
    } else if errno == Errno::CONNREFUSED {
        vhost_error(
            uri,
            format!("nothing listens on {path}: {msg}"),
            "is the vhost-user-blk backend running, and is this its socket? a backend that stopped leaves its socket file behind",
        )
    } else if errno == Errno::ACCESS || errno == Errno::PERM {
        vhost_error(
            uri,
            format!("cannot open {path}: {msg}"),
            "run as a user who may connect to the socket",
        )
    } else {
        vhost_error(
            uri,
            format!("{path} did not answer as a vhost-user-blk backend: {msg}"),
            "is it a vhost-user-blk backend's socket (not an NBD server's or another device's)?",
        )
    }
}

/// Runs `workload` through the vhost-user-blk backend of `uri` (`vhost-user:PATH` or
/// `vhost-user:///ABSOLUTE/PATH`), calling `progress` once per interval. Blocks until the
/// run is over. Needs one backend queue per worker.
pub fn run_vhost_user(
    uri: &str,
    workload: &Workload,
    opts: &RunOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<BenchResult, BenchError> {
    let path = socket_path(uri)
        .map_err(|cause| vhost_error(uri, cause, "e.g. vhost-user:/run/vdstream/lab7.vhost"))?;
    let path = path
        .to_str()
        .ok_or_else(|| vhost_error(uri, "the socket path is not UTF-8", "use a UTF-8 path"))?
        .to_string();
    let mut blkio = connect(uri, &path, workload.write_pct == 0)?;
    let prop = |what: &str, e: blkio::Error| {
        vhost_error(
            uri,
            format!("cannot read the backend's {what}: {}", e.message()),
            "is it a vhost-user-blk backend?",
        )
    };

    let capacity = blkio.get_u64("capacity").map_err(|e| prop("capacity", e))?;
    let blocks = workload
        .blocks(capacity)
        .map_err(|cause| BenchError::Workload {
            uri: uri.to_string(),
            cause,
        })?;
    let max_queues = blkio
        .get_i32("max-queues")
        .map_err(|e| prop("queue count", e))?;
    let workers = workload.workers;
    if i64::from(workers) > i64::from(max_queues) {
        return Err(vhost_error(
            uri,
            format!("the backend offers {max_queues} queue(s) and each of the {workers} workers needs its own"),
            format!("run with --workers {max_queues} or fewer, or give the backend {workers} queues, e.g. qemu-storage-daemon's num-queues={workers}"),
        ));
    }
    blkio.set_i32("num-queues", workers as i32).map_err(|e| {
        vhost_error(
            uri,
            format!("cannot ask for {workers} queues: {}", e.message()),
            "run with fewer --workers",
        )
    })?;
    let started = match blkio.start() {
        Ok(s) => s,
        Err(e) if e.errno() == Errno::ROFS => {
            return Err(BenchError::ReadOnly {
                uri: uri.to_string(),
            })
        }
        Err(e) => {
            return Err(vhost_error(
                uri,
                format!("the backend refused to start its queues: {}", e.message()),
                "see the backend's log",
            ))
        }
    };
    // Read-only only when asked for (reads only): libblkio would fail every write then.
    let read_only = blkio
        .get_bool("read-only")
        .map_err(|e| prop("read-only flag", e))?;
    debug_assert!(!read_only || workload.write_pct == 0);

    // All buffers in one memfd-backed region that the backend maps: `queue_depth` slots of
    // one block per worker.
    let bs = workload.block_size as usize;
    let qd = workload.queue_depth as usize;
    let too_big = || {
        vhost_error(
            uri,
            "the buffers would not fit in the address space",
            "use a smaller --queue-depth or --block-size",
        )
    };
    let per_worker = qd.checked_mul(bs).ok_or_else(too_big)?;
    let align = (blkio
        .get_u64("mem-region-alignment")
        .map_err(|e| prop("memory alignment", e))? as usize)
        .max(4096);
    let len = per_worker
        .checked_mul(workers as usize)
        .map(|n| n.div_ceil(align) * align)
        .ok_or_else(too_big)?;
    let region = blkio.alloc_mem_region(len).map_err(|e| {
        vhost_error(
            uri,
            format!("cannot allocate {len} bytes of buffers: {}", e.message()),
            "use a smaller --queue-depth or --block-size",
        )
    })?;
    blkio.map_mem_region(&region).map_err(|e| {
        vhost_error(
            uri,
            format!("the backend could not map the buffers: {}", e.message()),
            "see the backend's log",
        )
    })?;
    for slot in 0..len / bs {
        // SAFETY: the region is `len` bytes, mapped read-write, and no request uses it yet.
        let buf =
            unsafe { std::slice::from_raw_parts_mut((region.addr + slot * bs) as *mut u8, bs) };
        // Without --verify every write carries the same stamped block (generation 0).
        pattern::fill(buf, 0, 0);
    }

    let shared = Shared::new(workload, blocks);
    let mut queues = started.queues;
    let (figures, series, elapsed) = std::thread::scope(|s| {
        let start = Instant::now();
        let mut handles = Vec::new();
        for (w, q) in queues.iter_mut().enumerate() {
            let slots = Slots {
                base: region.addr + w * per_worker,
                block_size: bs,
                count: qd,
            };
            let stream = OpStream::new(workload, blocks, w as u32, opts.seed);
            let shared = &shared;
            match std::thread::Builder::new()
                .name(format!("bench-vq{w}"))
                .spawn_scoped(s, move || queue_loop(q, slots, stream, shared))
            {
                Ok(h) => handles.push(h),
                Err(e) => {
                    shared.stop();
                    return Err(BenchError::Threads(e));
                }
            }
        }
        let series = measure::sample(&shared, workload, opts, start, progress);
        let figures = measure::join_workers(handles)?;
        Ok((figures, series, start.elapsed().as_secs_f64()))
    })?;
    // The queues go before the instance that owns the buffers (it frees them last).
    drop(queues);
    drop(blkio);
    Ok(measure::finish(
        &shared,
        Finished {
            uri: uri.to_string(),
            export_size: capacity,
            blocks,
            workload,
            figures,
            series,
            elapsed,
        },
    ))
}

/// One worker's buffers: `count` blocks of `block_size` bytes from address `base`, inside
/// the mapped region; slot `i` belongs to the request whose user_data is `i`.
#[derive(Debug, Clone, Copy)]
struct Slots {
    base: usize,
    block_size: usize,
    count: usize,
}

impl Slots {
    fn ptr(&self, i: usize) -> *mut u8 {
        assert!(i < self.count, "slot {i} of {}", self.count);
        (self.base + i * self.block_size) as *mut u8
    }
}

/// A request in flight.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    pick: Pick,
    t0: Instant,
}

/// One worker: keeps its queue `slots.count` requests deep until the run stops, then
/// reaps what is still in flight.
fn queue_loop(q: &mut Blkioq, slots: Slots, mut stream: OpStream, shared: &Shared) -> TaskFigures {
    let bs = slots.block_size;
    let mut figures = TaskFigures::default();
    let mut in_flight: Vec<Option<InFlight>> = vec![None; slots.count];
    let mut free: Vec<usize> = (0..slots.count).rev().collect();
    let mut completions: Vec<MaybeUninit<Completion>> =
        (0..slots.count).map(|_| MaybeUninit::uninit()).collect();
    loop {
        while !shared.stopped() {
            let Some(&i) = free.last() else { break };
            let Some(pick) = shared.try_pick(&mut stream) else {
                break;
            };
            free.pop();
            let ptr = slots.ptr(i);
            let offset = shared.offset(&pick);
            if pick.write {
                // SAFETY: slot i is free: no request of the backend uses it.
                shared.stamp(&pick, unsafe { std::slice::from_raw_parts_mut(ptr, bs) });
            }
            let t0 = Instant::now();
            if pick.write {
                q.write(offset, ptr, bs, i, ReqFlags::empty());
            } else {
                q.read(offset, ptr, bs, i, ReqFlags::empty());
            }
            in_flight[i] = Some(InFlight { pick, t0 });
        }
        if free.len() == slots.count {
            if shared.stopped() {
                return figures;
            }
            // Every block this worker stepped to is held by another worker's request.
            std::thread::yield_now();
            continue;
        }
        let mut timeout = WAIT_SLICE;
        match q.do_io(&mut completions, 1, Some(&mut timeout), None) {
            Ok(n) => {
                for c in &completions[..n] {
                    // SAFETY: do_io initialised the first n completions.
                    let c = unsafe { c.assume_init_ref() };
                    let i = c.user_data;
                    let req = in_flight[i]
                        .take()
                        .expect("a completion of a request in flight");
                    let ns = req.t0.elapsed().as_nanos() as u64;
                    if c.ret != 0 {
                        shared.failed(&req.pick, request_error(shared, &req.pick, c), false);
                    } else if req.pick.write {
                        shared.wrote(&mut figures, &req.pick, ns);
                    } else {
                        // SAFETY: the backend is done with slot i.
                        shared.read(
                            &mut figures,
                            &req.pick,
                            unsafe { std::slice::from_raw_parts(slots.ptr(i), bs) },
                            ns,
                        );
                    }
                    free.push(i);
                }
            }
            Err(e) if e.errno() == Errno::TIME => {
                let oldest = in_flight.iter().flatten().map(|r| r.t0).min();
                if oldest.is_some_and(|t| t.elapsed() >= REQUEST_TIMEOUT) {
                    let why = format!(
                        "no answer from the vhost-user backend within {} s; the run was stopped",
                        REQUEST_TIMEOUT.as_secs()
                    );
                    abandon(shared, &mut in_flight, &why);
                    return figures;
                }
            }
            Err(e) => {
                abandon(
                    shared,
                    &mut in_flight,
                    &format!("the vhost-user queue failed: {}", e.message()),
                );
                return figures;
            }
        }
    }
}

/// Fails every request in flight with `why` and ends the run (their buffers stay mapped
/// until the instance is dropped, after every queue).
fn abandon(shared: &Shared, in_flight: &mut [Option<InFlight>], why: &str) {
    for req in in_flight.iter_mut().filter_map(Option::take) {
        let op = if req.pick.write { "write" } else { "read" };
        shared.failed(
            &req.pick,
            format!("{op} at offset {}: {why}", shared.offset(&req.pick)),
            true,
        );
    }
    shared.stop();
}

/// The message of a completion with an error: the operation, its range and the errno (and
/// libblkio's text, when it has one).
fn request_error(shared: &Shared, pick: &Pick, c: &Completion) -> String {
    let op = if pick.write { "write" } else { "read" };
    let errno = std::io::Error::from_raw_os_error(-c.ret);
    let mut m = format!(
        "{op} of {} bytes at offset {} failed: {errno}",
        shared.block_size,
        shared.offset(pick)
    );
    if !c.error_msg.is_null() {
        // SAFETY: a non-null error_msg is a NUL-terminated static string of libblkio's.
        let msg = unsafe { CStr::from_ptr(c.error_msg) };
        m += &format!(" ({})", msg.to_string_lossy());
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_paths() {
        assert_eq!(
            socket_path("vhost-user:/run/vdstream/lab7.vhost"),
            Ok(PathBuf::from("/run/vdstream/lab7.vhost"))
        );
        assert_eq!(
            socket_path("vhost-user:///run/x.sock"),
            Ok(PathBuf::from("/run/x.sock"))
        );
        assert_eq!(
            socket_path("vhost-user:rel.sock"),
            Ok(PathBuf::from("rel.sock"))
        );
        assert!(socket_path("vhost-user://host/x.sock")
            .unwrap_err()
            .contains("no host part"));
        assert!(socket_path("vhost-user:")
            .unwrap_err()
            .contains("no socket path"));
        assert!(socket_path("vhost-user://")
            .unwrap_err()
            .contains("no host part"));
        assert!(socket_path("nbd://x").is_err());
    }

    #[test]
    fn no_listener_is_named_with_what_to_check() {
        let dir = tempfile_dir();
        let sock = dir.join("nobody.sock");
        let uri = format!("vhost-user:{}", sock.display());
        let e = run_vhost_user(
            &uri,
            &Workload::default(),
            &RunOptions::default(),
            &mut |_| {},
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(&format!("no socket at {}", sock.display()))
                && e.contains("backend running"),
            "{e}"
        );
        // A socket file nobody listens on any more.
        drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
        let e = run_vhost_user(
            &uri,
            &Workload::default(),
            &RunOptions::default(),
            &mut |_| {},
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(&format!("nothing listens on {}", sock.display())),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_socket_that_is_not_vhost_user_is_named() {
        // A peer that answers with an NBD server's greeting.
        let dir = tempfile_dir();
        let sock = dir.join("nbd.sock");
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let server = std::thread::spawn(move || {
            use std::io::Write;
            let (mut c, _) = listener.accept().unwrap();
            let _ = c.write_all(b"NBDMAGICIHAVEOPT\x00\x03");
            std::thread::sleep(Duration::from_millis(200));
        });
        let e = run_vhost_user(
            &format!("vhost-user:{}", sock.display()),
            &Workload::default(),
            &RunOptions::default(),
            &mut |_| {},
        )
        .unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("did not answer as a vhost-user-blk backend")
                && e.contains("not an NBD server"),
            "{e}"
        );
        server.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "vdstream-bench-vu-{}-{:x}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir(&d).unwrap();
        d
    }
}
