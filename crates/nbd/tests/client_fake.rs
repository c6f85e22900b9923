//! The NBD client against a scripted server: the test does the server's side of the
//! handshake, then writes exactly the replies it wants (chunks out of order, bad bounds,
//! silence, unknown cookies), to check the client's demultiplexing and its defences.
//! Every wait is bounded by a timeout.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

use vdstream_nbd::client::{Address, Client, ClientError, ConnectOptions, Op};
use vdstream_nbd::proto;

const SIZE: u64 = 1024 * 1024;
const FLAGS: u16 = proto::FLAG_HAS_FLAGS | proto::FLAG_SEND_FLUSH | proto::FLAG_SEND_TRIM;
const CONTEXT_ID: u32 = 7;
const BOUND: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, Default)]
struct FakeHandshake {
    go_unsupported: bool,
    no_zeroes_off: bool,
    huge_option_reply: bool,
}

struct Request {
    flags: u16,
    kind: u16,
    cookie: u64,
    offset: u64,
    len: u32,
}

/// Bind a socket, accept one client, play the server side of the handshake, return the stream.
async fn fake_server(
    hs: FakeHandshake,
) -> (
    tempfile::TempDir,
    Address,
    tokio::task::JoinHandle<UnixStream>,
) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fake.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let task = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut hflags = proto::FLAG_FIXED_NEWSTYLE;
        if !hs.no_zeroes_off {
            hflags |= proto::FLAG_NO_ZEROES;
        }
        s.write_u64(proto::NBDMAGIC).await.unwrap();
        s.write_u64(proto::IHAVEOPT).await.unwrap();
        s.write_u16(hflags).await.unwrap();
        let _client_flags = s.read_u32().await.unwrap();
        loop {
            assert_eq!(s.read_u64().await.unwrap(), proto::IHAVEOPT);
            let opt = s.read_u32().await.unwrap();
            let len = s.read_u32().await.unwrap();
            let mut data = vec![0u8; len as usize];
            s.read_exact(&mut data).await.unwrap();
            match opt {
                proto::OPT_STRUCTURED_REPLY => {
                    if hs.huge_option_reply {
                        s.write_u64(proto::REPLY_MAGIC_OPT).await.unwrap();
                        s.write_u32(opt).await.unwrap();
                        s.write_u32(proto::REP_ACK).await.unwrap();
                        s.write_u32(u32::MAX).await.unwrap();
                        return s;
                    }
                    option_reply(&mut s, opt, proto::REP_ACK, &[]).await;
                }
                proto::OPT_SET_META_CONTEXT => {
                    let mut p = CONTEXT_ID.to_be_bytes().to_vec();
                    p.extend_from_slice(proto::META_CONTEXT_BASE_ALLOCATION.as_bytes());
                    option_reply(&mut s, opt, proto::REP_META_CONTEXT, &p).await;
                    option_reply(&mut s, opt, proto::REP_ACK, &[]).await;
                }
                proto::OPT_GO if hs.go_unsupported => {
                    option_reply(&mut s, opt, proto::REP_ERR_UNSUP, b"no GO here").await;
                }
                proto::OPT_GO => {
                    let mut p = proto::INFO_EXPORT.to_be_bytes().to_vec();
                    p.extend_from_slice(&SIZE.to_be_bytes());
                    p.extend_from_slice(&FLAGS.to_be_bytes());
                    option_reply(&mut s, opt, proto::REP_INFO, &p).await;
                    option_reply(&mut s, opt, proto::REP_ACK, &[]).await;
                    return s;
                }
                proto::OPT_EXPORT_NAME => {
                    s.write_u64(SIZE).await.unwrap();
                    s.write_u16(FLAGS).await.unwrap();
                    if hs.no_zeroes_off {
                        s.write_all(&[0u8; 124]).await.unwrap();
                    }
                    return s;
                }
                other => option_reply(&mut s, other, proto::REP_ERR_UNSUP, &[]).await,
            }
        }
    });
    (dir, Address::unix(path), task)
}

async fn option_reply(s: &mut UnixStream, opt: u32, kind: u32, payload: &[u8]) {
    s.write_u64(proto::REPLY_MAGIC_OPT).await.unwrap();
    s.write_u32(opt).await.unwrap();
    s.write_u32(kind).await.unwrap();
    s.write_u32(payload.len() as u32).await.unwrap();
    s.write_all(payload).await.unwrap();
}

async fn connect(
    hs: FakeHandshake,
    opts: ConnectOptions,
) -> (tempfile::TempDir, Client, UnixStream) {
    let (dir, addr, server) = fake_server(hs).await;
    let (client, stream) = tokio::time::timeout(BOUND, async {
        tokio::join!(Client::connect(addr, opts), server)
    })
    .await
    .expect("handshake within bound");
    (dir, client.expect("connect"), stream.unwrap())
}

async fn read_request(s: &mut UnixStream) -> Request {
    let magic = s.read_u32().await.unwrap();
    assert_eq!(magic, proto::REQUEST_MAGIC);
    let req = Request {
        flags: s.read_u16().await.unwrap(),
        kind: s.read_u16().await.unwrap(),
        cookie: s.read_u64().await.unwrap(),
        offset: s.read_u64().await.unwrap(),
        len: s.read_u32().await.unwrap(),
    };
    if req.kind == proto::CMD_WRITE {
        let mut data = vec![0u8; req.len as usize];
        s.read_exact(&mut data).await.unwrap();
    }
    req
}

async fn chunk(s: &mut UnixStream, flags: u16, kind: u16, cookie: u64, payload: &[u8]) {
    let mut m = Vec::new();
    m.extend_from_slice(&proto::STRUCTURED_REPLY_MAGIC.to_be_bytes());
    m.extend_from_slice(&flags.to_be_bytes());
    m.extend_from_slice(&kind.to_be_bytes());
    m.extend_from_slice(&cookie.to_be_bytes());
    m.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    m.extend_from_slice(payload);
    s.write_all(&m).await.unwrap();
}

async fn data_chunk(s: &mut UnixStream, flags: u16, cookie: u64, offset: u64, data: &[u8]) {
    let mut p = offset.to_be_bytes().to_vec();
    p.extend_from_slice(data);
    chunk(s, flags, proto::REPLY_TYPE_OFFSET_DATA, cookie, &p).await;
}

async fn hole_chunk(s: &mut UnixStream, flags: u16, cookie: u64, offset: u64, len: u32) {
    let mut p = offset.to_be_bytes().to_vec();
    p.extend_from_slice(&len.to_be_bytes());
    chunk(s, flags, proto::REPLY_TYPE_OFFSET_HOLE, cookie, &p).await;
}

async fn simple_reply(s: &mut UnixStream, cookie: u64, errno: u32) {
    s.write_u32(proto::SIMPLE_REPLY_MAGIC).await.unwrap();
    s.write_u32(errno).await.unwrap();
    s.write_u64(cookie).await.unwrap();
}

const DONE: u16 = proto::REPLY_FLAG_DONE;

#[tokio::test]
async fn chunks_out_of_order_and_replies_out_of_order_assemble() {
    let (_dir, client, mut s) = connect(FakeHandshake::default(), ConnectOptions::default()).await;
    assert!(client.structured() && client.can_block_status());
    let client = std::sync::Arc::new(client);
    let first = {
        let c = client.clone();
        tokio::spawn(async move { c.read_buf(0, vec![0xee; 12288]).await })
    };
    let r1 = read_request(&mut s).await;
    let second = {
        let c = client.clone();
        tokio::spawn(async move { c.read(65536, 512).await })
    };
    let r2 = read_request(&mut s).await;
    assert_ne!(r1.cookie, r2.cookie);
    assert_eq!(
        (r1.kind, r1.offset, r1.len, r1.flags),
        (proto::CMD_READ, 0, 12288, 0)
    );
    // Second request answered first, with a simple reply; first request in three chunks.
    data_chunk(&mut s, 0, r1.cookie, 8192, &[0xcc; 4096]).await;
    simple_reply(&mut s, r2.cookie, 0).await;
    s.write_all(&[0x11; 512]).await.unwrap();
    hole_chunk(&mut s, 0, r1.cookie, 4096, 4096).await;
    data_chunk(&mut s, DONE, r1.cookie, 0, &[0xaa; 4096]).await;

    let got2 = tokio::time::timeout(BOUND, second)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(got2 == vec![0x11; 512]);
    let got1 = tokio::time::timeout(BOUND, first)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(got1[..4096].iter().all(|&b| b == 0xaa));
    assert!(
        got1[4096..8192].iter().all(|&b| b == 0),
        "hole not zero-filled"
    );
    assert!(got1[8192..].iter().all(|&b| b == 0xcc));
    let st = client.stats();
    assert_eq!(
        (st.data_chunks, st.hole_chunks, st.simple_replies),
        (2, 1, 1)
    );
}

#[tokio::test]
async fn chunk_outside_the_request_fails_the_connection() {
    let (_dir, client, mut s) = connect(FakeHandshake::default(), ConnectOptions::default()).await;
    let client = std::sync::Arc::new(client);
    let read = {
        let c = client.clone();
        tokio::spawn(async move { c.read(4096, 4096).await })
    };
    let r = read_request(&mut s).await;
    // Data that would land past the end of the 4 KiB buffer.
    data_chunk(&mut s, DONE, r.cookie, 4096 + 2048, &[0xcc; 4096]).await;
    let err = tokio::time::timeout(BOUND, read)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&err, ClientError::Disconnected { reason, .. } if reason.contains("outside")),
        "{err}"
    );
    let err = client.read(0, 512).await.unwrap_err();
    assert!(err.is_connection_lost(), "{err}");
}

#[tokio::test]
async fn incomplete_coverage_fails_only_that_request() {
    let (_dir, client, mut s) = connect(FakeHandshake::default(), ConnectOptions::default()).await;
    let client = std::sync::Arc::new(client);
    let c = client.clone();
    let read = tokio::spawn(async move { c.read(0, 8192).await });
    let r = read_request(&mut s).await;
    data_chunk(&mut s, DONE, r.cookie, 0, &[1; 4096]).await;
    let err = tokio::time::timeout(BOUND, read)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(err, ClientError::Protocol { op: Op::Read, .. }),
        "{err}"
    );
    // The stream is still in sync: the next request works.
    let c = client.clone();
    let flush = tokio::spawn(async move { c.flush().await });
    let r = read_request(&mut s).await;
    assert_eq!(r.kind, proto::CMD_FLUSH);
    simple_reply(&mut s, r.cookie, 0).await;
    tokio::time::timeout(BOUND, flush)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn error_chunks_carry_errno_and_message() {
    let (_dir, client, mut s) = connect(FakeHandshake::default(), ConnectOptions::default()).await;
    let client = std::sync::Arc::new(client);
    let c = client.clone();
    let read = tokio::spawn(async move { c.read(0, 8192).await });
    let r = read_request(&mut s).await;
    data_chunk(&mut s, 0, r.cookie, 0, &[1; 4096]).await;
    let msg = b"disk on fire";
    let mut p = proto::EIO.to_be_bytes().to_vec();
    p.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    p.extend_from_slice(msg);
    p.extend_from_slice(&4096u64.to_be_bytes());
    chunk(&mut s, DONE, proto::REPLY_TYPE_ERROR_OFFSET, r.cookie, &p).await;
    let err = tokio::time::timeout(BOUND, read)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    match &err {
        ClientError::Server {
            errno, message, op, ..
        } => {
            assert_eq!(
                (*errno, message.as_str(), *op),
                (proto::EIO, "disk on fire", Op::Read)
            );
        }
        other => panic!("expected a server error, got {other}"),
    }
    assert!(
        err.to_string().contains("EIO") && err.to_string().contains("disk on fire"),
        "{err}"
    );
}

#[tokio::test]
async fn block_status_keeps_only_our_context() {
    let (_dir, client, mut s) = connect(FakeHandshake::default(), ConnectOptions::default()).await;
    let client = std::sync::Arc::new(client);
    let c = client.clone();
    let bs = tokio::spawn(async move { c.block_status(0, 65536, false).await });
    let r = read_request(&mut s).await;
    assert_eq!(r.kind, proto::CMD_BLOCK_STATUS);
    let mut other = 99u32.to_be_bytes().to_vec();
    other.extend_from_slice(&[0, 0, 0x10, 0, 0, 0, 0, 1]);
    chunk(&mut s, 0, proto::REPLY_TYPE_BLOCK_STATUS, r.cookie, &other).await;
    let mut ours = CONTEXT_ID.to_be_bytes().to_vec();
    for (len, flags) in [
        (4096u32, 0u32),
        (61440, proto::STATE_HOLE | proto::STATE_ZERO),
    ] {
        ours.extend_from_slice(&len.to_be_bytes());
        ours.extend_from_slice(&flags.to_be_bytes());
    }
    chunk(
        &mut s,
        DONE,
        proto::REPLY_TYPE_BLOCK_STATUS,
        r.cookie,
        &ours,
    )
    .await;
    let extents = tokio::time::timeout(BOUND, bs)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(extents, vec![(4096, 0), (61440, 3)]);
}

#[tokio::test]
async fn silent_server_times_out_and_later_calls_fail_fast() {
    let opts = ConnectOptions {
        request_timeout: Some(Duration::from_millis(300)),
        ..Default::default()
    };
    let (_dir, client, mut s) = connect(FakeHandshake::default(), opts).await;
    let t = Instant::now();
    let err = client.read(0, 4096).await.unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Timeout {
                op: Op::Read,
                offset: 0,
                ..
            }
        ),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let t = Instant::now();
    let err = client.read(0, 4096).await.unwrap_err();
    assert!(matches!(err, ClientError::Disconnected { .. }), "{err}");
    assert!(t.elapsed() < Duration::from_millis(100));
    // The client closed its side: the server sees EOF after the one request.
    let _ = read_request(&mut s).await;
    let mut rest = Vec::new();
    let n = tokio::time::timeout(BOUND, s.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n, 0);
}

#[tokio::test]
async fn unknown_cookie_fails_in_flight_requests() {
    let (_dir, client, mut s) = connect(FakeHandshake::default(), ConnectOptions::default()).await;
    let client = std::sync::Arc::new(client);
    let c = client.clone();
    let read = tokio::spawn(async move { c.read(0, 512).await });
    let r = read_request(&mut s).await;
    simple_reply(&mut s, r.cookie ^ 0xdead_beef, 0).await;
    let err = tokio::time::timeout(BOUND, read)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&err, ClientError::Disconnected { reason, .. } if reason.contains("unknown cookie")),
        "{err}"
    );
}

#[tokio::test]
async fn go_unsupported_falls_back_to_export_name() {
    for no_zeroes_off in [false, true] {
        let hs = FakeHandshake {
            go_unsupported: true,
            no_zeroes_off,
            ..Default::default()
        };
        let (_dir, client, mut s) = connect(hs, ConnectOptions::export("golden")).await;
        assert_eq!((client.size(), client.flags()), (SIZE, FLAGS));
        assert!(client.can_trim() && !client.can_fua());
        let c = std::sync::Arc::new(client);
        let c2 = c.clone();
        let trim = tokio::spawn(async move { c2.trim(0, 4096, false).await });
        let r = read_request(&mut s).await;
        assert_eq!((r.kind, r.len), (proto::CMD_TRIM, 4096));
        simple_reply(&mut s, r.cookie, proto::EPERM).await;
        let err = tokio::time::timeout(BOUND, trim)
            .await
            .unwrap()
            .unwrap()
            .unwrap_err();
        assert_eq!(err.errno(), Some(proto::EPERM));
        // FUA is not advertised: refused client-side.
        assert!(matches!(
            c.write(0, &[0; 512], true).await,
            Err(ClientError::Invalid { .. })
        ));
    }
}

#[tokio::test]
async fn huge_option_reply_is_refused_without_allocating() {
    let (_dir, addr, server) = fake_server(FakeHandshake {
        huge_option_reply: true,
        ..Default::default()
    })
    .await;
    let res = tokio::time::timeout(BOUND, Client::connect(addr, ConnectOptions::default()))
        .await
        .unwrap();
    let err = res.unwrap_err();
    assert!(
        matches!(&err, ClientError::Handshake { reason, .. } if reason.contains("exceeds")),
        "{err}"
    );
    drop(server);
}
