//! Handshake penalties through a real TCP listener: an address that fails handshakes
//! (bytes that are not NBD) is closed at accept once it reaches the limit, before any
//! greeting; other addresses, exempt ones and clients that merely close early are not; the
//! penalty ends on time. Source addresses come from the 127.0.0.0/8 loopback range.

mod common;
use common::*;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vdstream_nbd::penalty::PenaltyConfig;
use vdstream_nbd::proto::*;
use vdstream_nbd::{Listener, Server, ServerConfig, ShutdownSignal};

const T: Duration = Duration::from_secs(10);

async fn connect_from(source: &str, server: SocketAddr) -> tokio::net::TcpStream {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(format!("{source}:0").parse().unwrap()).unwrap();
    tokio::time::timeout(T, sock.connect(server))
        .await
        .unwrap()
        .unwrap()
}

/// Whether the server greeted a connection from `source` (false: it closed it at once).
async fn greeted(source: &str, server: SocketAddr) -> bool {
    let mut s = connect_from(source, server).await;
    let mut greeting = [0u8; 18];
    match tokio::time::timeout(T, s.read_exact(&mut greeting))
        .await
        .expect("the server neither greeted nor closed")
    {
        Ok(_) => {
            assert_eq!(&greeting[0..8], &NBDMAGIC.to_be_bytes());
            true
        }
        Err(_) => false,
    }
}

/// A handshake that fails: greeting read, then an option with a bad magic.
async fn fail_handshake(source: &str, server: SocketAddr) {
    let mut s = connect_from(source, server).await;
    let mut greeting = [0u8; 18];
    tokio::time::timeout(T, s.read_exact(&mut greeting))
        .await
        .unwrap()
        .expect("greeted");
    s.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes())
        .await
        .unwrap();
    s.write_all(&[0xde; 16]).await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(T, s.read_to_end(&mut rest))
        .await
        .expect("the server closes a client that is not NBD");
}

#[tokio::test]
async fn an_address_that_fails_handshakes_is_closed_at_accept_until_its_penalty_ends() {
    let config = ServerConfig {
        penalty: PenaltyConfig {
            max_failures: 3,
            penalty: Duration::from_secs(2),
            ..PenaltyConfig::default()
        },
        ..ServerConfig::default()
    };
    let server = Server::new(test_exports(), config);
    let stats = server.stats();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_trigger, signal) = ShutdownSignal::new();
    tokio::spawn(async move { server.serve(Listener::Tcp(listener), signal).await });

    // Two failures: still let in.
    fail_handshake("127.0.0.2", addr).await;
    fail_handshake("127.0.0.2", addr).await;
    assert!(
        greeted("127.0.0.2", addr).await,
        "two failures of three are not yet a penalty"
    );
    // The third starts the penalty: the next connection gets no greeting.
    fail_handshake("127.0.0.2", addr).await;
    assert!(
        !greeted("127.0.0.2", addr).await,
        "penalized: closed at accept"
    );
    assert_eq!(stats.connections_penalized.load(Ordering::Relaxed), 1);
    // Other addresses are not touched; the host's own 127.0.0.1 is exempt by default.
    assert!(greeted("127.0.0.3", addr).await);
    for _ in 0..5 {
        fail_handshake("127.0.0.1", addr).await;
    }
    assert!(greeted("127.0.0.1", addr).await, "127.0.0.1 is exempt");
    // Closing early (a port probe, a health check) does not count.
    for _ in 0..5 {
        drop(connect_from("127.0.0.4", addr).await);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        greeted("127.0.0.4", addr).await,
        "early closes are not failures"
    );
    // The penalty ends after its 2 s.
    let deadline = std::time::Instant::now() + Duration::from_secs(8);
    loop {
        if greeted("127.0.0.2", addr).await {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the penalty of 2 s never ended"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(stats.handshakes_failed.load(Ordering::Relaxed) >= 8);
}
