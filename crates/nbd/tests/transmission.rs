//! Transmission-phase tests over a real unix socket: every validation errno, stream
//! sync after refused WRITEs, structured reads (holes, DF), block status, zeroing flags.

mod common;
use common::*;
use vdstream_nbd::proto::*;

#[tokio::test]
async fn validation_errnos_simple_replies() {
    let h = start();
    let (mut c, size, _) = RawClient::open(&h.path, "disk", false).await;
    assert_eq!(
        c.call(CMD_READ, 0, size, 1, &[]).await,
        EINVAL,
        "read past the end"
    );
    assert_eq!(
        c.call(CMD_READ, 0, u64::MAX - 1, 4, &[]).await,
        EINVAL,
        "offset overflow"
    );
    assert_eq!(
        c.call(CMD_READ, 0, 0, MAX_PAYLOAD + 1, &[]).await,
        EINVAL,
        "read too long"
    );
    assert_eq!(c.call(CMD_READ, 0, 0, 0, &[]).await, EINVAL, "zero length");
    assert_eq!(
        c.call(CMD_WRITE, 0, size - 2, 4, b"abcd").await,
        ENOSPC,
        "write past the end"
    );
    assert_eq!(
        c.call(CMD_WRITE_ZEROES, 0, size, 4096, &[]).await,
        ENOSPC,
        "zero past the end"
    );
    assert_eq!(
        c.call(CMD_TRIM, 0, size, 4096, &[]).await,
        EINVAL,
        "trim past the end"
    );
    assert_eq!(c.call(42, 0, 0, 1, &[]).await, EINVAL, "unknown command");
    assert_eq!(
        c.call(CMD_READ, CMD_FLAG_NO_HOLE, 0, 1, &[]).await,
        EINVAL,
        "flag not for READ"
    );
    assert_eq!(
        c.call(CMD_READ, CMD_FLAG_DF, 0, 1, &[]).await,
        EINVAL,
        "DF without structured replies"
    );
    assert_eq!(
        c.call(CMD_READ, 1 << 12, 0, 1, &[]).await,
        EINVAL,
        "unknown flag"
    );
    assert_eq!(
        c.call(CMD_BLOCK_STATUS, 0, 0, 512, &[]).await,
        EINVAL,
        "block status without context"
    );
    assert_eq!(
        c.call(CMD_FLUSH, 0, 0, 0, &[]).await,
        0,
        "flush is advertised by the memory disk"
    );
    assert_eq!(
        c.call(CMD_CACHE, 0, 0, 512, &[]).await,
        0,
        "cache is advertised by the memory disk"
    );
    // Commands the export does not advertise are refused.
    let (mut ro, _, ro_flags) = RawClient::open(&h.path, "ro", false).await;
    assert_eq!(ro_flags & (FLAG_SEND_FLUSH | FLAG_SEND_CACHE), 0);
    assert_eq!(
        ro.call(CMD_FLUSH, 0, 0, 0, &[]).await,
        EINVAL,
        "flush not advertised"
    );
    assert_eq!(
        ro.call(CMD_CACHE, 0, 0, 512, &[]).await,
        EINVAL,
        "cache not advertised"
    );
    // After all that, the stream is in sync.
    assert_eq!(c.call(CMD_WRITE, 0, 100, 3, b"xyz").await, 0);
    assert_eq!(c.read(100, 3).await, b"xyz");
}

#[tokio::test]
async fn read_only_export_refuses_writes_with_eperm() {
    let h = start();
    let (mut c, _, flags) = RawClient::open(&h.path, "ro", false).await;
    assert_ne!(flags & FLAG_READ_ONLY, 0);
    assert_eq!(c.call(CMD_WRITE, 0, 0, 4, b"abcd").await, EPERM);
    assert_eq!(c.call(CMD_TRIM, 0, 0, 4096, &[]).await, EPERM);
    assert_eq!(c.call(CMD_WRITE_ZEROES, 0, 0, 4096, &[]).await, EPERM);
    assert_eq!(c.call(CMD_READ, 0, 0, 4, &[]).await, 0);
}

#[tokio::test]
async fn refused_write_payload_is_skipped() {
    let h = start();
    let (mut c, size, _) = RawClient::open(&h.path, "disk", true).await;
    // A 64 KiB write at a bad offset, whose payload looks like requests, then a good one.
    let fake = vec![0x25u8; 65536];
    c.send(CMD_WRITE, 0, 1, size, 65536, &fake).await;
    c.send(CMD_WRITE, 0, 2, 0, 4, b"good").await;
    let r1 = c.reply(0).await;
    assert_eq!((r1.handle(), r1.error()), (1, ENOSPC));
    if let Reply::Chunk { kind, payload, .. } = &r1 {
        assert_eq!(*kind, REPLY_TYPE_ERROR);
        let len = u16::from_be_bytes([payload[4], payload[5]]) as usize;
        assert!(
            !String::from_utf8_lossy(&payload[6..6 + len]).is_empty(),
            "error chunks carry a message"
        );
    } else {
        panic!("structured replies negotiated: errors come as chunks, got {r1:?}");
    }
    let r2 = c.reply(0).await;
    assert_eq!((r2.handle(), r2.error()), (2, 0));
    // A bad-flag write also keeps the stream in sync.
    c.send(CMD_WRITE, 1 << 9, 3, 0, 4, b"bad!").await;
    assert_eq!(c.reply(0).await.error(), EINVAL);
    c.send(CMD_READ, 0, 4, 0, 4, &[]).await;
    let chunks = c.chunks().await;
    match &chunks[0] {
        Reply::Chunk { kind, payload, .. } => {
            assert_eq!(*kind, REPLY_TYPE_OFFSET_DATA);
            assert_eq!(&payload[8..], b"good");
        }
        r => panic!("{r:?}"),
    }
}

#[tokio::test]
async fn oversized_write_disconnects_only_that_connection() {
    let h = start();
    let (mut other, _, _) = RawClient::open(&h.path, "disk", false).await;
    let (mut c, _, _) = RawClient::open(&h.path, "disk", false).await;
    c.send(CMD_WRITE, 0, 1, 0, MAX_PAYLOAD + 1, &[]).await;
    assert!(c.closed().await);
    let (mut c, _, _) = RawClient::open(&h.path, "disk", false).await;
    c.send(CMD_READ, 0, 1, 0, 4, &[]).await;
    // Bad magic mid-stream: disconnect.
    tokio::io::AsyncWriteExt::write_all(&mut c.s, &[0u8; 28])
        .await
        .unwrap();
    let _ = c.reply(4).await;
    assert!(c.closed().await);
    assert_eq!(other.call(CMD_WRITE, 0, 0, 2, b"ok").await, 0);
    assert_eq!(other.read(0, 2).await, b"ok");
}

#[tokio::test]
async fn structured_read_holes_and_df() {
    let h = start();
    let (mut c, _, _) = RawClient::open(&h.path, "disk", true).await;
    c.send(CMD_WRITE, 0, 1, 8192, 4096, &[7u8; 4096]).await;
    assert_eq!(c.reply(0).await.error(), 0);
    // 16 KiB read over [hole 8K][data 4K][hole 4K]: reassemble whatever chunks come back.
    c.send(CMD_READ, 0, 2, 0, 16384, &[]).await;
    let chunks = c.chunks().await;
    let mut image = vec![0xAAu8; 16384];
    let mut covered = 0;
    for ch in &chunks {
        let Reply::Chunk {
            kind,
            payload,
            handle,
            ..
        } = ch
        else {
            panic!("simple reply to a structured read")
        };
        assert_eq!(*handle, 2);
        let off = u64::from_be_bytes(payload[0..8].try_into().unwrap()) as usize;
        match *kind {
            REPLY_TYPE_OFFSET_DATA => {
                image[off..off + payload.len() - 8].copy_from_slice(&payload[8..]);
                covered += payload.len() - 8;
            }
            REPLY_TYPE_OFFSET_HOLE => {
                let len = u32::from_be_bytes(payload[8..12].try_into().unwrap()) as usize;
                image[off..off + len].fill(0);
                covered += len;
            }
            k => panic!("unexpected chunk type {k}"),
        }
    }
    assert_eq!(covered, 16384);
    assert!(image[..8192].iter().all(|&b| b == 0));
    assert!(image[8192..12288].iter().all(|&b| b == 7));
    assert!(image[12288..].iter().all(|&b| b == 0));
    // With DF: exactly one data chunk.
    c.send(CMD_READ, CMD_FLAG_DF, 3, 0, 16384, &[]).await;
    let chunks = c.chunks().await;
    assert_eq!(chunks.len(), 1);
    match &chunks[0] {
        Reply::Chunk { kind, payload, .. } => {
            assert_eq!(*kind, REPLY_TYPE_OFFSET_DATA);
            assert_eq!(&payload[8..], &image[..]);
        }
        r => panic!("{r:?}"),
    }
    // An invalid structured read is an error chunk, never a simple reply.
    c.send(CMD_READ, 0, 4, 1 << 40, 512, &[]).await;
    let chunks = c.chunks().await;
    assert!(matches!(
        chunks[0],
        Reply::Chunk {
            kind: REPLY_TYPE_ERROR,
            ..
        }
    ));
    assert_eq!(chunks[0].error(), EINVAL);
}

fn descriptors(r: &Reply) -> Vec<(u32, u32)> {
    let Reply::Chunk {
        kind: REPLY_TYPE_BLOCK_STATUS,
        payload,
        ..
    } = r
    else {
        panic!("not block status: {r:?}")
    };
    payload[4..]
        .chunks(8)
        .map(|d| {
            (
                u32::from_be_bytes(d[0..4].try_into().unwrap()),
                u32::from_be_bytes(d[4..8].try_into().unwrap()),
            )
        })
        .collect()
}

#[tokio::test]
async fn block_status_and_req_one() {
    let h = start();
    let (mut c, size, _) = RawClient::open(&h.path, "disk", true).await;
    c.send(CMD_WRITE, 0, 1, 4096, 4096, &[1u8; 4096]).await;
    c.reply(0).await;
    c.send(CMD_BLOCK_STATUS, 0, 2, 0, 65536, &[]).await;
    let d = descriptors(&c.chunks().await[0]);
    let total: u64 = d.iter().map(|x| x.0 as u64).sum();
    assert!(total <= 65536 && total > 0);
    assert!(d.iter().all(|x| x.0 > 0));
    c.send(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 3, 0, 65536, &[])
        .await;
    let d = descriptors(&c.chunks().await[0]);
    assert_eq!(d.len(), 1);
    assert!(d[0].0 <= 65536);
    c.send(CMD_BLOCK_STATUS, 0, 4, size - 512, 1024, &[]).await;
    assert_eq!(c.chunks().await[0].error(), EINVAL);
}

#[tokio::test]
async fn write_zeroes_trim_and_fast_zero() {
    let h = start();
    let (mut c, _, flags) = RawClient::open(&h.path, "disk", true).await;
    assert_ne!(flags & FLAG_SEND_WRITE_ZEROES, 0);
    c.send(CMD_WRITE, 0, 1, 0, 8192, &[9u8; 8192]).await;
    assert_eq!(c.reply(0).await.error(), 0);
    c.send(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 2, 0, 4096, &[])
        .await;
    assert_eq!(c.reply(0).await.error(), 0);
    if flags & FLAG_SEND_FAST_ZERO != 0 {
        c.send(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 3, 4096, 4096, &[])
            .await;
        let e = c.reply(0).await.error();
        assert!(
            e == 0 || e == ENOTSUP,
            "fast zero may only fail with ENOTSUP, got {e}"
        );
    }
    c.send(CMD_TRIM, 0, 4, 4096, 4096, &[]).await;
    assert_eq!(c.reply(0).await.error(), 0);
    c.send(CMD_READ, CMD_FLAG_DF, 5, 0, 8192, &[]).await;
    match &c.chunks().await[0] {
        Reply::Chunk { payload, .. } => assert!(payload[8..].iter().all(|&b| b == 0)),
        r => panic!("{r:?}"),
    }
}

#[tokio::test]
async fn disc_answers_everything_then_closes() {
    let h = start();
    let (mut c, _, _) = RawClient::open(&h.path, "disk", false).await;
    for i in 0..10 {
        c.send(CMD_WRITE, 0, i, i * 512, 512, &[i as u8; 512]).await;
    }
    c.send(CMD_DISC, 0, 99, 0, 0, &[]).await;
    for i in 0..10 {
        let r = c.reply(0).await;
        assert_eq!((r.handle(), r.error()), (i, 0));
    }
    assert!(c.closed().await);
}

#[tokio::test]
async fn large_read_and_write() {
    let h = start();
    let (mut c, _, _) = RawClient::open(&h.path, "disk", false).await;
    let data: Vec<u8> = (0..DISK as usize).map(|i| (i * 7 % 251) as u8).collect();
    assert_eq!(c.call(CMD_WRITE, 0, 0, DISK as u32, &data).await, 0);
    assert_eq!(c.read(0, DISK as u32).await, data);
}
