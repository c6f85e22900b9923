//! The NBD client against real servers: nbdkit (memory plugin, delay and error filters) and
//! qemu-nbd (raw and qcow2 images), each started on a unix socket in a temporary directory
//! and killed when the test ends. Every wait is bounded.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vdstream_nbd::client::{Address, Client, ClientError, ConnectOptions, Op, WriterMode};
use vdstream_nbd::proto;

const MIB: u64 = 1024 * 1024;

/// A server process on a unix socket, killed on drop.
struct ServerProcess {
    child: Child,
    sock: PathBuf,
    _dir: tempfile::TempDir,
}

fn find_program(name: &str) -> Option<PathBuf> {
    ["/usr/sbin", "/usr/bin", "/usr/local/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.exists())
}

impl ServerProcess {
    /// `nbdkit -f -U sock ARGS...`, or `None` (with a printed message) when nbdkit is missing.
    fn nbdkit(args: &[&str]) -> Option<ServerProcess> {
        let Some(nbdkit) = find_program("nbdkit") else {
            eprintln!("SKIP: nbdkit is not installed");
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("nbd.sock");
        let mut cmd = Command::new(nbdkit);
        cmd.args(["-f", "--exit-with-parent", "-U"])
            .arg(&sock)
            .args(args);
        Some(ServerProcess::spawn(cmd, sock, dir))
    }

    /// `qemu-nbd --persistent -k sock -f FORMAT [-x EXPORT] IMAGE` on an image made by `make`.
    fn qemu_nbd(format: &str, size: u64, export: Option<&str>) -> ServerProcess {
        let qemu_nbd = find_program("qemu-nbd").expect("qemu-nbd is installed");
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("nbd.sock");
        let image = dir.path().join(format!("disk.{format}"));
        let made = Command::new("qemu-img")
            .args(["create", "-q", "-f", format])
            .arg(&image)
            .arg(size.to_string())
            .status()
            .expect("run qemu-img");
        assert!(made.success(), "qemu-img create failed");
        let mut cmd = Command::new(qemu_nbd);
        cmd.args([
            "--persistent",
            "--shared=16",
            "--discard=unmap",
            "-f",
            format,
            "-k",
        ])
        .arg(&sock);
        if let Some(e) = export {
            cmd.args(["-x", e]);
        }
        cmd.arg(&image);
        ServerProcess::spawn(cmd, sock, dir)
    }

    fn spawn(mut cmd: Command, sock: PathBuf, dir: tempfile::TempDir) -> ServerProcess {
        let log_path = dir.path().join("server.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn server");
        let mut server = ServerProcess {
            child,
            sock,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = server.child.try_wait().unwrap() {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                panic!("server exited early: {status} ({cmd:?}): {log}");
            }
            if server.sock.exists() && std::os::unix::net::UnixStream::connect(&server.sock).is_ok()
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "server socket {:?} did not appear within 10 s",
                server.sock
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    fn address(&self) -> Address {
        Address::unix(&self.sock)
    }

    fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.sock.display())
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn connect(server: &ServerProcess, opts: ConnectOptions) -> Arc<Client> {
    Arc::new(
        Client::connect(server.address(), opts)
            .await
            .expect("connect"),
    )
}

/// Many tasks write random ranges of their own stripe and read random ranges back,
/// checking against a per-stripe model; at the end the whole disk is compared.
async fn concurrent_model_roundtrip(client: Arc<Client>, tasks: u64, ops_per_task: usize) {
    let size = client.size();
    let stripe = size / tasks;
    let mut handles = Vec::new();
    for t in 0..tasks {
        let client = client.clone();
        handles.push(tokio::spawn(async move {
            let base = t * stripe;
            let mut model = vec![0u8; stripe as usize];
            let mut rng = fastrand::Rng::with_seed(t + 1); // reproducible
            for i in 0..ops_per_task {
                let len = 1 + rng.u64(..64 * 1024);
                let off = rng.u64(..=stripe - len);
                let range = off as usize..(off + len) as usize;
                if i % 3 != 2 {
                    let data: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
                    client.write(base + off, &data, false).await.expect("write");
                    model[range].copy_from_slice(&data);
                } else {
                    let got = client.read(base + off, len as u32).await.expect("read");
                    assert!(
                        got == model[range],
                        "task {t}: read at {} differs from the model",
                        base + off
                    );
                }
            }
            model
        }));
    }
    let mut whole = Vec::with_capacity(size as usize);
    for h in handles {
        whole.extend_from_slice(&h.await.unwrap());
    }
    // Read the whole disk back in 1 MiB pieces, all in flight at once.
    let reads: Vec<_> = (0..tasks * stripe / MIB)
        .map(|i| {
            let c = client.clone();
            tokio::spawn(async move { c.read(i * MIB, MIB as u32).await.expect("read back") })
        })
        .collect();
    for (i, r) in reads.into_iter().enumerate() {
        let got = r.await.unwrap();
        let start = i * MIB as usize;
        assert!(
            got == whole[start..start + MIB as usize],
            "MiB {i} differs from the model"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_reports_size_flags_and_contexts() {
    let Some(server) = ServerProcess::nbdkit(&["memory", "64M"]) else {
        return;
    };
    let client = Client::connect_uri(&server.uri(""), ConnectOptions::default())
        .await
        .unwrap();
    assert_eq!(client.size(), 64 * MIB);
    assert!(client.structured());
    assert!(client.can_block_status());
    assert!(client.flags() & proto::FLAG_HAS_FLAGS != 0);
    assert!(client.can_flush() && client.can_fua() && client.can_trim() && client.can_zeroes());
    assert!(client.can_multi_conn() && client.can_cache());
    assert!(!client.read_only());
    let b = client.block_sizes();
    assert!(b.minimum >= 1 && b.minimum <= b.preferred && b.preferred <= b.maximum);

    // Without structured replies nothing that needs them is offered.
    let plain = Client::connect(
        server.address(),
        ConnectOptions {
            structured_replies: false,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(!plain.structured());
    assert!(!plain.can_block_status());
    plain.write(4096, &[7u8; 512], false).await.unwrap();
    assert_eq!(plain.read(4096, 512).await.unwrap(), vec![7u8; 512]);
    assert!(plain.stats().simple_replies >= 2);
    plain.disconnect().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_read_back_like_the_model_nbdkit() {
    for writer in [WriterMode::Coalescing, WriterMode::Locked] {
        // A fresh, all-zero disk for each run: the model starts from zeroes.
        let Some(server) = ServerProcess::nbdkit(&["memory", "64M"]) else {
            return;
        };
        let client = connect(
            &server,
            ConnectOptions {
                writer,
                ..Default::default()
            },
        )
        .await;
        concurrent_model_roundtrip(client.clone(), 16, 150).await;
        client.disconnect().await.unwrap();
    }
}

/// The agent's way: threads outside the runtime each `block_on` a corked batch of writes,
/// whose requests they send themselves. Writes of up to 4 MiB fill the socket, so part of
/// a batch is left to the writer task while other threads send theirs: every byte must
/// still arrive whole and in its request.
#[test]
fn corked_batches_from_several_threads_read_back_like_the_model() {
    let Some(server) = ServerProcess::nbdkit(&["memory", "64M"]) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let client = rt.block_on(connect(&server, ConnectOptions::default()));
    let stripe = client.size() / 4;
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (client, handle) = (client.clone(), rt.handle().clone());
            std::thread::spawn(move || {
                let mut model = vec![0u8; stripe as usize];
                let mut rng = fastrand::Rng::with_seed(t + 7);
                for _ in 0..6 {
                    // One batch: a few ranges of this thread's stripe that do not overlap.
                    let mut writes = Vec::new();
                    let slot = stripe / 4;
                    for k in 0..4 {
                        let len = 1 + rng.u64(..(4 * MIB).min(slot));
                        let off = k * slot + rng.u64(..=slot - len);
                        let data: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
                        model[off as usize..(off + len) as usize].copy_from_slice(&data);
                        writes.push((t * stripe + off, data));
                    }
                    let batch = futures_util::future::join_all(
                        writes
                            .iter()
                            .map(|(off, data)| client.write(*off, data, false)),
                    );
                    for r in handle.block_on(vdstream_nbd::client::corked(batch)) {
                        r.expect("write");
                    }
                }
                model
            })
        })
        .collect();
    let models: Vec<Vec<u8>> = threads.into_iter().map(|h| h.join().unwrap()).collect();
    for (t, model) in models.iter().enumerate() {
        for (i, want) in model.chunks(MIB as usize).enumerate() {
            let off = t as u64 * stripe + i as u64 * MIB;
            let got = rt
                .block_on(client.read(off, want.len() as u32))
                .expect("read back");
            assert!(got == want, "thread {t}: MiB {i} differs from the model");
        }
    }
    rt.block_on(client.disconnect()).unwrap();
}

/// A caller that catches a panic from inside `corked` keeps its thread: the requests the
/// thread makes afterwards go out, and so does the one queued before the panic.
#[test]
fn a_panic_inside_corked_leaves_the_thread_uncorked() {
    let Some(server) = ServerProcess::nbdkit(&["memory", "64M"]) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let client = rt.block_on(connect(&server, ConnectOptions::default()));
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(vdstream_nbd::client::corked(async {
            let mut write = std::pin::pin!(client.write(0, &[7u8; 512], false));
            // Queue the write (one poll), then a bug.
            std::future::poll_fn(|cx| {
                let _ = write.as_mut().poll(cx);
                std::task::Poll::Ready(())
            })
            .await;
            panic!("a bug after queuing a request");
        }))
    }));
    assert!(panicked.is_err());
    let read = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), client.read(0, 512)).await
    });
    assert_eq!(
        read.expect("a read after the panic got no reply: the thread stayed corked")
            .expect("read"),
        vec![7u8; 512]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_read_back_like_the_model_qemu_nbd() {
    for format in ["raw", "qcow2"] {
        let server = ServerProcess::qemu_nbd(format, 32 * MIB, None);
        let client = connect(&server, ConnectOptions::default()).await;
        assert_eq!(client.size(), 32 * MIB);
        concurrent_model_roundtrip(client.clone(), 8, 120).await;
        client.flush().await.unwrap();
        client.disconnect().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_reads_assemble_holes_and_data() {
    // qemu-nbd answers reads of sparse ranges with NBD_REPLY_TYPE_OFFSET_HOLE chunks.
    let server = ServerProcess::qemu_nbd("raw", 16 * MIB, None);
    let client = connect(&server, ConnectOptions::default()).await;
    let data = vec![0xabu8; 128 * 1024];
    client.write(4 * MIB, &data, false).await.unwrap();
    client.flush().await.unwrap();
    let got = client.read(3 * MIB, 3 * MIB as u32).await.unwrap();
    assert!(got[..MIB as usize].iter().all(|&b| b == 0));
    assert_eq!(&got[MIB as usize..MIB as usize + data.len()], &data[..]);
    assert!(got[MIB as usize + data.len()..].iter().all(|&b| b == 0));
    let stats = client.stats();
    assert!(
        stats.hole_chunks >= 1 && stats.data_chunks >= 1,
        "{stats:?}"
    );

    // A reused buffer full of junk must come back with the holes zeroed.
    let junk = vec![0xeeu8; 2 * MIB as usize];
    let got = client.read_buf(5 * MIB, junk).await.unwrap();
    assert!(got.iter().all(|&b| b == 0));

    // nbdkit memory: write, trim, read back zeroes where trimmed.
    let Some(kit) = ServerProcess::nbdkit(&["memory", "64M"]) else {
        return;
    };
    let client = connect(&kit, ConnectOptions::default()).await;
    client
        .write(0, &vec![0x5a; MIB as usize], false)
        .await
        .unwrap();
    client.trim(256 * 1024, 256 * 1024, false).await.unwrap();
    let got = client.read(0, MIB as u32).await.unwrap();
    assert!(got[..256 * 1024].iter().all(|&b| b == 0x5a));
    assert!(got[256 * 1024..512 * 1024].iter().all(|&b| b == 0));
    assert!(got[512 * 1024..].iter().all(|&b| b == 0x5a));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_status_reports_holes_and_data() {
    let Some(server) = ServerProcess::nbdkit(&["memory", "64M"]) else {
        return;
    };
    let client = connect(&server, ConnectOptions::default()).await;
    client
        .write(MIB, &vec![1u8; 64 * 1024], false)
        .await
        .unwrap();
    let extents = client.block_status(0, 4 * MIB as u32, false).await.unwrap();
    assert!(!extents.is_empty());
    let total: u64 = extents.iter().map(|&(l, _)| u64::from(l)).sum();
    assert!(total >= 64 * 1024, "extents cover too little: {extents:?}");
    // Walk the extents: offset 0 is a hole, offset 1 MiB is data.
    let state_at = |target: u64| {
        let mut off = 0u64;
        for &(len, flags) in &extents {
            if target < off + u64::from(len) {
                return Some(flags);
            }
            off += u64::from(len);
        }
        None
    };
    assert_eq!(
        state_at(0).unwrap() & proto::STATE_HOLE,
        proto::STATE_HOLE,
        "{extents:?}"
    );
    assert_eq!(
        state_at(MIB).unwrap() & (proto::STATE_HOLE | proto::STATE_ZERO),
        0,
        "{extents:?}"
    );

    let one = client
        .block_status(MIB, 4 * MIB as u32, true)
        .await
        .unwrap();
    assert_eq!(one.len(), 1, "REQ_ONE gives one extent: {one:?}");
    assert_eq!(one[0].1 & proto::STATE_HOLE, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_zeroes_flush_and_fua() {
    let Some(server) = ServerProcess::nbdkit(&["memory", "64M"]) else {
        return;
    };
    let client = connect(&server, ConnectOptions::default()).await;
    client.write(0, &vec![9u8; 256 * 1024], true).await.unwrap();
    client
        .write_zeroes(64 * 1024, 64 * 1024, false, false, false)
        .await
        .unwrap();
    client
        .write_zeroes(192 * 1024, 4096, true, false, true)
        .await
        .unwrap();
    if client.can_fast_zero() {
        client
            .write_zeroes(128 * 1024, 4096, false, true, false)
            .await
            .unwrap();
    }
    client.flush().await.unwrap();
    client.cache(0, 4096).await.unwrap();
    let got = client.read(0, 256 * 1024).await.unwrap();
    let zero_at = |i: usize| {
        (64 * 1024..128 * 1024).contains(&i)
            || (192 * 1024..196 * 1024).contains(&i)
            || (client.can_fast_zero() && (128 * 1024..132 * 1024).contains(&i))
    };
    for (i, &b) in got.iter().enumerate() {
        assert_eq!(b, if zero_at(i) { 0 } else { 9 }, "byte {i}");
    }

    let server = ServerProcess::qemu_nbd("qcow2", 16 * MIB, None);
    let client = connect(&server, ConnectOptions::default()).await;
    client.write(MIB, &[3u8; 8192], true).await.unwrap();
    client
        .write_zeroes(MIB, 4096, false, false, true)
        .await
        .unwrap();
    client.flush().await.unwrap();
    let got = client.read(MIB, 8192).await.unwrap();
    assert!(got[..4096].iter().all(|&b| b == 0) && got[4096..].iter().all(|&b| b == 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_carry_errno_and_context() {
    let Some(server) = ServerProcess::nbdkit(&["memory", "1M"]) else {
        return;
    };
    // Client-side validation refuses without sending.
    let checked = connect(&server, ConnectOptions::default()).await;
    let err = checked.read(MIB - 512, 1024).await.unwrap_err();
    assert!(
        matches!(err, ClientError::Invalid { op: Op::Read, .. }),
        "{err}"
    );
    assert!(matches!(
        checked.read(0, 0).await,
        Err(ClientError::Invalid { .. })
    ));

    // The server's own check answers EINVAL, and the connection stays usable.
    for structured_replies in [true, false] {
        let opts = ConnectOptions {
            check_requests: false,
            structured_replies,
            ..Default::default()
        };
        let raw = connect(&server, opts).await;
        let err = raw.read(MIB - 512, 1024).await.unwrap_err();
        match &err {
            ClientError::Server {
                errno,
                op,
                offset,
                len,
                ..
            } => {
                assert_eq!(
                    (*errno, *op, *offset, *len),
                    (proto::EINVAL, Op::Read, MIB - 512, 1024),
                    "{err}"
                );
            }
            other => panic!("expected a server error, got {other}"),
        }
        assert!(err.to_string().contains("EINVAL"), "{err}");
        let err = raw.write(MIB, &[1u8; 512], false).await.unwrap_err();
        assert!(
            matches!(err.errno(), Some(proto::ENOSPC) | Some(proto::EINVAL)),
            "{err}"
        );
        assert_eq!(raw.read(0, 512).await.unwrap(), vec![0u8; 512]);
    }

    // Injected EIO on reads arrives as a structured error chunk.
    let Some(failing) = ServerProcess::nbdkit(&[
        "--filter=error",
        "memory",
        "1M",
        "error-pread=EIO",
        "error-pread-rate=1",
    ]) else {
        return;
    };
    let client = connect(&failing, ConnectOptions::default()).await;
    let err = client.read(4096, 4096).await.unwrap_err();
    assert_eq!(err.errno(), Some(proto::EIO), "{err}");
    client.write(4096, &[1u8; 4096], false).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_export_is_named_in_the_error() {
    let server = ServerProcess::qemu_nbd("raw", MIB, Some("golden"));
    let ok = Client::connect_uri(&server.uri("golden"), ConnectOptions::default())
        .await
        .unwrap();
    assert_eq!(ok.info().export, "golden");
    let err = Client::connect(server.address(), ConnectOptions::export("no-such-vdisk"))
        .await
        .unwrap_err();
    match &err {
        ClientError::Refused { export, reply, .. } => {
            assert_eq!(export, "no-such-vdisk");
            assert_eq!(*reply, proto::REP_ERR_UNKNOWN);
        }
        other => panic!("expected Refused, got {other}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("no-such-vdisk") && text.contains("nbd.sock"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_server_fails_in_flight_requests_promptly() {
    let Some(mut server) = ServerProcess::nbdkit(&["--filter=delay", "memory", "64M", "rdelay=5"])
    else {
        return;
    };
    let client = connect(&server, ConnectOptions::default()).await;
    let reads: Vec<_> = (0..32u64)
        .map(|i| {
            let c = client.clone();
            tokio::spawn(async move {
                let t = Instant::now();
                (c.read(i * 4096, 4096).await, t.elapsed())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.kill();
    for r in reads {
        let (res, elapsed) = tokio::time::timeout(Duration::from_secs(3), r)
            .await
            .expect("no hang")
            .unwrap();
        let err = res.unwrap_err();
        assert!(matches!(err, ClientError::Disconnected { .. }), "{err}");
        assert!(err.is_connection_lost());
        assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}");
    }
    let t = Instant::now();
    let err = client.read(0, 4096).await.unwrap_err();
    assert!(matches!(err, ClientError::Disconnected { .. }), "{err}");
    assert!(t.elapsed() < Duration::from_millis(100));
    assert!(client.closed_reason().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_server_times_out_and_fails_the_connection() {
    let Some(server) = ServerProcess::nbdkit(&["--filter=delay", "memory", "64M", "rdelay=5"])
    else {
        return;
    };
    let opts = ConnectOptions {
        request_timeout: Some(Duration::from_millis(400)),
        ..Default::default()
    };
    let client = connect(&server, opts).await;
    // A write is not delayed; it succeeds.
    client.write(0, &[1u8; 4096], false).await.unwrap();
    let t = Instant::now();
    let slow = {
        let c = client.clone();
        tokio::spawn(async move { c.read(0, 4096).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let other = {
        let c = client.clone();
        tokio::spawn(async move { c.read(8192, 4096).await })
    };
    let err = slow.await.unwrap().unwrap_err();
    assert!(
        matches!(err, ClientError::Timeout { op: Op::Read, .. }),
        "{err}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t.elapsed()
    );
    let err = other.await.unwrap().unwrap_err();
    assert!(err.is_connection_lost(), "{err}");
    assert!(matches!(
        client.write(0, &[1u8; 512], false).await,
        Err(ClientError::Disconnected { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_waits_for_in_flight_requests() {
    let Some(server) = ServerProcess::nbdkit(&["--filter=delay", "memory", "64M", "rdelay=300ms"])
    else {
        return;
    };
    let client = connect(&server, ConnectOptions::default()).await;
    let reads: Vec<_> = (0..8u64)
        .map(|i| {
            let c = client.clone();
            tokio::spawn(async move { c.read(i * 4096, 4096).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    client.disconnect().await.unwrap();
    for r in reads {
        assert!(r.await.unwrap().unwrap() == vec![0u8; 4096]);
    }
    let err = client.read(0, 4096).await.unwrap_err();
    assert!(matches!(err, ClientError::Disconnected { .. }), "{err}");
    assert_eq!(
        client.closed_reason().as_deref(),
        Some("the client disconnected")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_missing_socket_fails_with_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("absent.sock");
    let err = Client::connect(Address::unix(&path), ConnectOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Connect { .. }), "{err}");
    assert!(err.to_string().contains("absent.sock"), "{err}");
}
