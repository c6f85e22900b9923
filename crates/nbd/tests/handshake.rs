//! Handshake tests over a real unix socket: GO, INFO, LIST, structured replies, meta
//! contexts, unknown options, STARTTLS, bad magic, oversized options, client flags.

mod common;
use common::*;
use tokio::io::AsyncWriteExt;
use vdstream_nbd::proto::*;

#[tokio::test]
async fn go_reports_size_flags_and_block_size() {
    let h = start();
    let mut c = RawClient::connect(&h.path).await;
    c.greet(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).await;
    let replies = c
        .option(
            OPT_GO,
            &info_data("disk", &[INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION]),
        )
        .await;
    assert_eq!(replies.last().unwrap().kind, REP_ACK);
    let (size, flags) = export_info(&replies);
    assert_eq!(size, DISK);
    assert_ne!(flags & FLAG_HAS_FLAGS, 0);
    assert_ne!(flags & FLAG_SEND_TRIM, 0, "MemoryDev trims");
    assert_eq!(flags & FLAG_SEND_DF, 0, "no DF without structured replies");
    let bs = replies
        .iter()
        .find(|r| r.kind == REP_INFO && r.data[0..2] == INFO_BLOCK_SIZE.to_be_bytes())
        .unwrap();
    assert_eq!(&bs.data[2..], &[0, 0, 0, 1, 0, 0, 0x10, 0, 0x02, 0, 0, 0]);
    let name = replies
        .iter()
        .find(|r| r.kind == REP_INFO && r.data[0..2] == INFO_NAME.to_be_bytes())
        .unwrap();
    assert_eq!(&name.data[2..], b"disk");
    let desc = replies
        .iter()
        .find(|r| r.kind == REP_INFO && r.data[0..2] == INFO_DESCRIPTION.to_be_bytes())
        .unwrap();
    assert_eq!(&desc.data[2..], b"a test disk");
    // Transmission works right after GO.
    assert_eq!(c.call(CMD_WRITE, 0, 0, 4, b"abcd").await, 0);
    assert_eq!(c.read(0, 4).await, b"abcd");
}

#[tokio::test]
async fn info_then_unknown_option_then_go() {
    let h = start();
    let mut c = RawClient::connect(&h.path).await;
    c.greet(FLAG_C_FIXED_NEWSTYLE).await;
    let info = c.option(OPT_INFO, &info_data("ro", &[])).await;
    let (_, flags) = export_info(&info);
    assert_ne!(flags & FLAG_READ_ONLY, 0);
    assert_eq!(
        flags & (FLAG_SEND_TRIM | FLAG_SEND_WRITE_ZEROES | FLAG_SEND_FUA),
        0
    );
    let r = c.option(0x1234, b"whatever").await;
    assert_eq!(r[0].kind, REP_ERR_UNSUP);
    let r = c.option(OPT_EXTENDED_HEADERS, &[]).await;
    assert_eq!(r[0].kind, REP_ERR_UNSUP);
    let r = c.option(OPT_GO, &info_data("nope", &[])).await;
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].kind, REP_ERR_UNKNOWN);
    assert!(String::from_utf8_lossy(&r[0].data).contains("nope"));
    let r = c.option(OPT_GO, &info_data("busy", &[])).await;
    assert_eq!(r[0].kind, REP_ERR_POLICY);
    let r = c.option(OPT_GO, &[0, 0, 0, 9, b'x']).await;
    assert_eq!(r[0].kind, REP_ERR_INVALID, "name length past the data");
    let (size, _) = c.go("").await;
    assert_eq!(size, DISK);
}

#[tokio::test]
async fn list_exports() {
    let h = start();
    let mut c = RawClient::connect(&h.path).await;
    c.greet(FLAG_C_FIXED_NEWSTYLE).await;
    let r = c.option(OPT_LIST, &[]).await;
    assert_eq!(r.len(), 3);
    assert_eq!(r[0].kind, REP_SERVER);
    assert_eq!(&r[0].data[0..4], &4u32.to_be_bytes());
    assert_eq!(&r[0].data[4..], b"diska test disk");
    assert_eq!(&r[1].data[4..], b"ro");
    assert_eq!(r[2].kind, REP_ACK);
    let r = c.option(OPT_LIST, b"x").await;
    assert_eq!(r[0].kind, REP_ERR_INVALID);
}

#[tokio::test]
async fn meta_contexts() {
    let h = start();
    let mut c = RawClient::connect(&h.path).await;
    c.greet(FLAG_C_FIXED_NEWSTYLE).await;
    // Before structured replies: invalid.
    let r = c.set_meta("disk", &["base:allocation"]).await;
    assert_eq!(r[0].kind, REP_ERR_INVALID);
    c.structured().await;
    let r = c
        .option(OPT_LIST_META_CONTEXT, &meta_data("disk", &["base:"]))
        .await;
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].kind, REP_META_CONTEXT);
    assert_eq!(&r[0].data[4..], b"base:allocation");
    let r = c
        .option(OPT_LIST_META_CONTEXT, &meta_data("disk", &[]))
        .await;
    assert_eq!(r[0].kind, REP_META_CONTEXT);
    let r = c
        .option(
            OPT_LIST_META_CONTEXT,
            &meta_data("disk", &["qemu:dirty-bitmap:a"]),
        )
        .await;
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].kind, REP_ACK);
    let r = c.set_meta("disk", &["base:"]).await;
    assert_eq!(r.len(), 1, "base: selects nothing on SET");
    let r = c.set_meta("disk", &["nocolon"]).await;
    assert_eq!(r[0].kind, REP_ERR_INVALID);
    let r = c.set_meta("disk", &["base:allocation"]).await;
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].kind, REP_META_CONTEXT);
    let id = u32::from_be_bytes(r[0].data[0..4].try_into().unwrap());
    assert_ne!(id, 0);
    let (_, flags) = c.go("disk").await;
    assert_ne!(flags & FLAG_SEND_DF, 0);
    // Block status works and names the context id.
    c.send(CMD_BLOCK_STATUS, 0, 3, 0, 8192, &[]).await;
    let chunks = c.chunks().await;
    match &chunks[0] {
        Reply::Chunk {
            kind,
            payload,
            flags,
            ..
        } => {
            assert_eq!(*kind, REPLY_TYPE_BLOCK_STATUS);
            assert_ne!(flags & REPLY_FLAG_DONE, 0);
            assert_eq!(u32::from_be_bytes(payload[0..4].try_into().unwrap()), id);
            assert_eq!((payload.len() - 4) % 8, 0);
        }
        r => panic!("{r:?}"),
    }
}

#[tokio::test]
async fn meta_context_for_another_export_does_not_count() {
    let h = start();
    let mut c = RawClient::connect(&h.path).await;
    c.greet(FLAG_C_FIXED_NEWSTYLE).await;
    c.structured().await;
    c.set_meta("ro", &["base:allocation"]).await;
    c.go("disk").await;
    c.send(CMD_BLOCK_STATUS, 0, 3, 0, 4096, &[]).await;
    assert_eq!(c.chunks().await[0].error(), EINVAL);
}

#[tokio::test]
async fn starttls_is_refused_with_policy() {
    let h = start();
    let mut c = RawClient::connect(&h.path).await;
    c.greet(FLAG_C_FIXED_NEWSTYLE).await;
    let r = c.option(OPT_STARTTLS, &[]).await;
    assert_eq!(r[0].kind, REP_ERR_POLICY);
    let r = c.option(OPT_STARTTLS, b"junk").await;
    assert_eq!(r[0].kind, REP_ERR_INVALID);
    c.go("disk").await;
}

#[tokio::test]
async fn abort_is_acked_then_closed() {
    let h = start();
    let mut c = RawClient::connect(&h.path).await;
    c.greet(FLAG_C_FIXED_NEWSTYLE).await;
    let r = c.option(OPT_ABORT, &[]).await;
    assert_eq!(r[0].kind, REP_ACK);
    assert!(c.closed().await);
}

#[tokio::test]
async fn export_name_with_and_without_zeroes() {
    let h = start();
    for no_zeroes in [true, false] {
        let mut c = RawClient::connect(&h.path).await;
        c.greet(FLAG_C_FIXED_NEWSTYLE | if no_zeroes { FLAG_C_NO_ZEROES } else { 0 })
            .await;
        c.send_option(OPT_EXPORT_NAME, b"disk").await;
        let mut b = [0u8; 10];
        c.read_exact(&mut b).await;
        assert_eq!(u64::from_be_bytes(b[0..8].try_into().unwrap()), DISK);
        if !no_zeroes {
            let mut z = [1u8; 124];
            c.read_exact(&mut z).await;
            assert!(z.iter().all(|&x| x == 0));
        }
        // The next bytes are replies to our requests, not padding.
        assert_eq!(
            c.call(CMD_FLUSH, 0, 0, 0, &[]).await,
            0,
            "the memory disk answers flush"
        );
    }
    // An unknown export via EXPORT_NAME cannot be refused politely: disconnect.
    let mut c = RawClient::connect(&h.path).await;
    c.greet(FLAG_C_FIXED_NEWSTYLE).await;
    c.send_option(OPT_EXPORT_NAME, b"nope").await;
    assert!(c.closed().await);
}

#[tokio::test]
async fn bad_magic_and_client_flags_disconnect() {
    let h = start();
    let mut c = RawClient::connect(&h.path).await;
    c.greet(FLAG_C_FIXED_NEWSTYLE).await;
    c.s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    assert!(c.closed().await);

    let mut c = RawClient::connect(&h.path).await;
    c.greet(1 << 7).await;
    assert!(c.closed().await);

    // The server is still fine.
    let (mut c, _, _) = RawClient::open(&h.path, "disk", false).await;
    assert_eq!(c.call(CMD_READ, 0, 0, 512, &[]).await, 0);
}

#[tokio::test]
async fn oversized_option_disconnects_without_reading_it() {
    let h = start();
    let mut c = RawClient::connect(&h.path).await;
    c.greet(FLAG_C_FIXED_NEWSTYLE).await;
    let mut m = IHAVEOPT.to_be_bytes().to_vec();
    m.extend_from_slice(&OPT_GO.to_be_bytes());
    m.extend_from_slice(&u32::MAX.to_be_bytes());
    c.s.write_all(&m).await.unwrap();
    assert!(c.closed().await);
    assert_eq!(
        h.stats
            .handshakes_failed
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    let (mut c, _, _) = RawClient::open(&h.path, "disk", false).await;
    assert_eq!(c.call(CMD_READ, 0, 0, 512, &[]).await, 0);
}

#[tokio::test]
async fn stalled_handshake_times_out() {
    let h = start_with(vdstream_nbd::ServerConfig {
        handshake_timeout: std::time::Duration::from_millis(200),
        ..Default::default()
    });
    let mut c = RawClient::connect(&h.path).await;
    c.greet(FLAG_C_FIXED_NEWSTYLE).await;
    // Send half an option header and stall.
    c.s.write_all(&IHAVEOPT.to_be_bytes()).await.unwrap();
    let t = std::time::Instant::now();
    assert!(c.closed().await);
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
}

#[tokio::test]
async fn slow_endless_handshake_is_bounded_as_a_whole() {
    // Every option arrives whole and in time, but the handshake never ends: the server
    // must still close it, after a few handshake timeouts (4 x 300 ms here).
    let h = start_with(vdstream_nbd::ServerConfig {
        handshake_timeout: std::time::Duration::from_millis(300),
        ..Default::default()
    });
    let mut c = RawClient::connect(&h.path).await;
    c.greet(FLAG_C_FIXED_NEWSTYLE).await;
    let t = std::time::Instant::now();
    let mut answered = 0;
    while t.elapsed() < std::time::Duration::from_secs(5) {
        let mut opt = IHAVEOPT.to_be_bytes().to_vec();
        opt.extend_from_slice(&OPT_STRUCTURED_REPLY.to_be_bytes());
        opt.extend_from_slice(&0u32.to_be_bytes());
        if c.s.write_all(&opt).await.is_err() || c.closed_or_acked().await {
            break;
        }
        answered += 1;
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let took = t.elapsed();
    assert!(
        answered >= 5,
        "options sent in time were answered before the cut ({answered})"
    );
    assert!(
        took >= std::time::Duration::from_millis(900) && took < std::time::Duration::from_secs(3),
        "closed after {took:?}"
    );
}
