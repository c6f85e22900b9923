//! Sockets before the protocol: binding a unix socket over a stale one, and the TCP
//! options that notice a dead peer. The one copy of each for the server, `serve-image` and
//! the agent.
//!
//! Invariant: [`bind_unix`] never takes a path from a live server: a path that is not a
//! socket, or a socket something still answers on, is refused; only a socket no process
//! answers on (left by one that died) is removed.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Why a unix socket path cannot be listened on.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("{} exists and is not a socket", .0.display())]
    NotASocket(PathBuf),
    #[error("another server is already listening on {}", .0.display())]
    InUse(PathBuf),
    #[error("cannot remove the stale socket {}: {source}", path.display())]
    Stale { path: PathBuf, source: io::Error },
    #[error("cannot listen on the unix socket {}: {source}", path.display())]
    Bind { path: PathBuf, source: io::Error },
}

/// Makes `path` free for a new socket: nothing there, or a stale socket (removed).
pub fn clear_stale_socket(path: &Path) -> Result<(), BindError> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        return Err(BindError::NotASocket(path.to_path_buf()));
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(BindError::InUse(path.to_path_buf()));
    }
    std::fs::remove_file(path).map_err(|source| BindError::Stale {
        path: path.to_path_buf(),
        source,
    })
}

/// Listens on the unix socket `path` (creating its folder), replacing a stale socket but
/// never one a live server answers on.
pub fn bind_unix(path: &Path) -> Result<tokio::net::UnixListener, BindError> {
    clear_stale_socket(path)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        let _ = std::fs::create_dir_all(dir);
    }
    tokio::net::UnixListener::bind(path).map_err(|source| BindError::Bind {
        path: path.to_path_buf(),
        source,
    })
}

/// Sets keepalive and `TCP_USER_TIMEOUT` on a TCP connection so that a peer that stops
/// answering is noticed within about `timeout`: the first probe after `timeout / 2` of
/// silence, then three probes `timeout / 6` apart (at least a second each).
pub fn set_dead_peer_timeout(sock: impl std::os::fd::AsFd, timeout: Duration) -> io::Result<()> {
    let sock = socket2::SockRef::from(&sock);
    let secs = |d: Duration| Duration::from_secs(d.as_secs().max(1));
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(secs(timeout / 2))
        .with_interval(secs(timeout / 6))
        .with_retries(3);
    sock.set_tcp_keepalive(&keepalive)?;
    sock.set_keepalive(true)?;
    sock.set_tcp_user_timeout(Some(timeout.max(Duration::from_secs(1))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dead_peer_timeout_sets_keepalive_and_the_user_timeout() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (sock, _) = listener.accept().unwrap();
        let s = socket2::SockRef::from(&sock);
        assert!(!s.keepalive().unwrap(), "keepalive is off by default");
        set_dead_peer_timeout(&sock, Duration::from_secs(60)).unwrap();
        assert!(s.keepalive().unwrap());
        // First probe after half the timeout of silence, then three, a sixth apart.
        assert_eq!(s.tcp_keepalive_time().unwrap(), Duration::from_secs(30));
        assert_eq!(s.tcp_keepalive_interval().unwrap(), Duration::from_secs(10));
        assert_eq!(s.tcp_keepalive_retries().unwrap(), 3);
        assert_eq!(s.tcp_user_timeout().unwrap(), Some(Duration::from_secs(60)));
        // Short timeouts keep whole seconds of at least one.
        set_dead_peer_timeout(&sock, Duration::from_secs(3)).unwrap();
        assert_eq!(s.tcp_keepalive_time().unwrap(), Duration::from_secs(1));
        assert_eq!(s.tcp_keepalive_interval().unwrap(), Duration::from_secs(1));
        assert_eq!(s.tcp_user_timeout().unwrap(), Some(Duration::from_secs(3)));
    }

    #[tokio::test]
    async fn a_stale_socket_is_replaced_a_live_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/nbd.sock");
        let live = bind_unix(&path).unwrap();
        assert!(
            matches!(bind_unix(&path), Err(BindError::InUse(_))),
            "a live server keeps its socket"
        );
        drop(live); // the socket file stays behind, as after a crash
        assert!(path.exists());
        let _again = bind_unix(&path).unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(bind_unix(&file), Err(BindError::NotASocket(_))));
    }
}
