//! The transmission phase over TLS on blocking threads: a reader and a writer that share
//! one `rustls` connection, so the request core ([`crate::session::run`]) keeps its
//! separate reader and writer (one thread reads requests while others write replies).
//!
//! Invariants: the reader never holds the lock while it waits on the socket (it reads
//! ciphertext first, then locks to decrypt), so a reply is never held up by a read that
//! waits for the client; the writer holds the lock until what it wrote is on the socket
//! (records go out whole and in order); end-of-file or `shutdown(Read)` on the socket ends
//! the reader exactly as on a plain socket; a decryption error is an I/O error
//! (`InvalidData`). A leaf module: it imports nothing else of this crate.

use std::io::{self, Read, Write};
use std::sync::{Arc, Mutex, MutexGuard};

/// How much ciphertext the reader takes from the socket at once (a few TLS records).
const CIPHERTEXT_BUFFER: usize = 64 << 10;

/// A socket two threads use at once (`&socket` implements `Read` and `Write`).
pub(crate) trait SharedSocket: Send + Sync {
    fn read_some(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// Writes from several buffers with one system call (rustls hands over one buffer per
    /// TLS record: a batch of replies is several records).
    fn write_some(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize>;
}

impl SharedSocket for socket2::Socket {
    fn read_some(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
    fn write_some(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        (&*self).write_vectored(bufs)
    }
}

#[cfg(test)]
impl SharedSocket for std::os::unix::net::UnixStream {
    fn read_some(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
    fn write_some(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        (&*self).write_vectored(bufs)
    }
}

/// `io::Write` over a shared socket, for `write_tls`, which writes through
/// `write_vectored`.
struct SockWriter<'a, S: SharedSocket>(&'a S);
impl<S: SharedSocket> Write for SockWriter<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write_some(&[io::IoSlice::new(buf)])
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.0.write_some(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

struct Inner<S> {
    sock: Arc<S>,
    tls: Mutex<rustls::ServerConnection>,
}

impl<S: SharedSocket> Inner<S> {
    fn lock(&self) -> MutexGuard<'_, rustls::ServerConnection> {
        self.tls.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Writes every record `tls` holds to the socket.
fn drain<S: SharedSocket>(tls: &mut rustls::ServerConnection, sock: &S) -> io::Result<()> {
    while tls.wants_write() {
        if tls.write_tls(&mut SockWriter(sock))? == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
    }
    Ok(())
}

/// The reading half: plaintext requests out of the shared TLS connection.
pub(crate) struct TlsReader<S> {
    inner: Arc<Inner<S>>,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

/// The writing half: plaintext replies into the shared TLS connection, and onto the socket.
pub(crate) struct TlsWriter<S> {
    inner: Arc<Inner<S>>,
}

/// Splits an established TLS connection over `sock` into a reader and a writer.
pub(crate) fn split<S: SharedSocket>(
    sock: Arc<S>,
    mut tls: rustls::ServerConnection,
) -> (TlsReader<S>, TlsWriter<S>) {
    // Ciphertext the handshake already read but did not decrypt: decrypt it now (an error
    // stays with the connection and ends the first read).
    let _ = tls.process_new_packets();
    let inner = Arc::new(Inner {
        sock,
        tls: Mutex::new(tls),
    });
    (
        TlsReader {
            inner: inner.clone(),
            buf: vec![0; CIPHERTEXT_BUFFER].into_boxed_slice(),
            start: 0,
            end: 0,
        },
        TlsWriter { inner },
    )
}

impl<S> Clone for TlsWriter<S> {
    fn clone(&self) -> Self {
        TlsWriter {
            inner: self.inner.clone(),
        }
    }
}

impl<S: SharedSocket> TlsWriter<S> {
    /// Sends `close_notify` (best effort: the peer may be gone).
    pub(crate) fn close(&self) {
        let mut tls = self.inner.lock();
        tls.send_close_notify();
        let _ = drain(&mut tls, &*self.inner.sock);
    }
}

impl<S: SharedSocket> Read for TlsReader<S> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        loop {
            {
                let mut tls = self.inner.lock();
                loop {
                    // Plaintext first: rustls refuses more ciphertext while it holds some.
                    match tls.reader().read(out) {
                        Ok(n) => return Ok(n),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        // The client went away without close_notify: end of file, as on a plain socket.
                        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                        Err(e) => return Err(e),
                    }
                    if self.start == self.end {
                        break;
                    }
                    // Ciphertext read before and not yet taken (rustls takes what fits).
                    self.start += tls.read_tls(&mut &self.buf[self.start..self.end])?;
                    tls.process_new_packets().map_err(|e| {
                        let _ = drain(&mut tls, &*self.inner.sock); // the alert, if any
                        io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}"))
                    })?;
                    if tls.wants_write() {
                        drain(&mut tls, &*self.inner.sock)?;
                    }
                }
            }
            // Nothing to hand out: wait for ciphertext, without the lock.
            let n = self.inner.sock.read_some(&mut self.buf)?;
            if n == 0 {
                return Ok(0);
            }
            (self.start, self.end) = (0, n);
        }
    }
}

impl<S: SharedSocket> Write for TlsWriter<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_all(buf)?;
        Ok(buf.len())
    }

    fn write_all(&mut self, mut buf: &[u8]) -> io::Result<()> {
        let mut tls = self.inner.lock();
        while !buf.is_empty() {
            // rustls takes what fits its send buffer; send that, then the rest.
            let n = tls.writer().write(buf)?;
            buf = &buf[n..];
            drain(&mut tls, &*self.inner.sock)?;
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! Many concurrent reads and writes through the blocking transport, against a rustls
    //! client on the other end, compared byte for byte.
    use super::*;
    use std::os::unix::net::UnixStream;

    fn configs() -> (Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>) {
        let provider = vdstream_tls::files::provider();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let der = cert.der().clone();
        let key_der = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap();
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![der.clone()], key_der)
            .unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        (Arc::new(server), Arc::new(client))
    }

    /// Echo server through the transport: every frame (u32 length + bytes) read is
    /// answered by several writer threads at once, each answer tagged with its sequence
    /// number; the client checks every answer against what it sent.
    #[test]
    fn concurrent_frames_round_trip() {
        let (server_cfg, client_cfg) = configs();
        let (a, b) = UnixStream::pair().unwrap();
        // The client writes every frame while it reads the answers (a tokio-rustls stream
        // split in two), as NBD clients do.
        let client = std::thread::spawn(move || {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                b.set_nonblocking(true).unwrap();
                let b = tokio::net::UnixStream::from_std(b).unwrap();
                let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
                let stream = tokio_rustls::TlsConnector::from(client_cfg)
                    .connect(name, b)
                    .await
                    .unwrap();
                let (mut r, mut w) = tokio::io::split(stream);
                let mut rng = fastrand::Rng::with_seed(7);
                let frames: Vec<Vec<u8>> = (0..400)
                    .map(|i| {
                        let len = if i % 50 == 0 {
                            300_000
                        } else {
                            rng.usize(1..9000)
                        };
                        (0..len).map(|_| rng.u8(..)).collect()
                    })
                    .collect();
                let sent = frames.clone();
                let writer = tokio::spawn(async move {
                    for f in &sent {
                        w.write_all(&(f.len() as u32).to_be_bytes()).await.unwrap();
                        w.write_all(f).await.unwrap();
                    }
                    w.flush().await.unwrap();
                    w
                });
                let mut got = vec![None; frames.len()];
                for _ in 0..frames.len() {
                    let mut h = [0u8; 8];
                    r.read_exact(&mut h).await.unwrap();
                    let seq = u32::from_be_bytes(h[..4].try_into().unwrap()) as usize;
                    let len = u32::from_be_bytes(h[4..].try_into().unwrap()) as usize;
                    let mut body = vec![0; len];
                    r.read_exact(&mut body).await.unwrap();
                    got[seq] = Some(body);
                }
                for (i, f) in frames.iter().enumerate() {
                    assert_eq!(got[i].as_deref(), Some(&f[..]), "frame {i}");
                }
                // close_notify from us ends the server's reads; the server's ends ours.
                let mut w = writer.await.unwrap();
                w.shutdown().await.unwrap();
                let mut rest = Vec::new();
                r.read_to_end(&mut rest).await.unwrap();
                assert!(rest.is_empty());
            });
        });

        let sock = Arc::new(a);
        let mut conn = rustls::ServerConnection::new(server_cfg).unwrap();
        {
            let mut s = &*sock;
            while conn.is_handshaking() {
                conn.complete_io(&mut s).unwrap();
            }
        }
        let (mut reader, writer) = split(sock, conn);
        let (tx, rx) = std::sync::mpsc::sync_channel::<(u32, Vec<u8>)>(16);
        let rx = Mutex::new(rx);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                let (rx, mut writer) = (&rx, writer.clone());
                scope.spawn(move || loop {
                    let Ok((seq, body)) = rx.lock().unwrap().recv() else {
                        return;
                    };
                    let mut out = Vec::with_capacity(8 + body.len());
                    out.extend_from_slice(&seq.to_be_bytes());
                    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
                    out.extend_from_slice(&body);
                    writer.write_all(&out).unwrap();
                });
            }
            let mut seq = 0;
            loop {
                let mut h = [0u8; 4];
                match reader.read_exact(&mut h) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
                    Err(e) => panic!("{e}"),
                }
                let mut body = vec![0; u32::from_be_bytes(h) as usize];
                reader.read_exact(&mut body).unwrap();
                tx.send((seq, body)).unwrap();
                seq += 1;
            }
            drop(tx);
            assert_eq!(seq, 400);
        });
        writer.close();
        client.join().unwrap();
    }

    /// `shutdown(Read)` on the socket ends a reader blocked waiting for ciphertext.
    #[test]
    fn shutdown_read_ends_the_reader() {
        let (server_cfg, client_cfg) = configs();
        let (a, b) = UnixStream::pair().unwrap();
        let client = std::thread::spawn(move || {
            let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
            let mut conn = rustls::ClientConnection::new(client_cfg, name).unwrap();
            let mut s = &b;
            while conn.is_handshaking() {
                conn.complete_io(&mut s).unwrap();
            }
            std::thread::sleep(std::time::Duration::from_secs(2));
            drop(b);
        });
        let sock = Arc::new(a);
        let mut conn = rustls::ServerConnection::new(server_cfg).unwrap();
        {
            let mut s = &*sock;
            while conn.is_handshaking() {
                conn.complete_io(&mut s).unwrap();
            }
        }
        let (mut reader, _writer) = split(sock.clone(), conn);
        let t0 = std::time::Instant::now();
        let waker = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(100));
            sock.shutdown(std::net::Shutdown::Read).unwrap();
        });
        let mut buf = [0u8; 16];
        assert_eq!(reader.read(&mut buf).unwrap(), 0);
        assert!(t0.elapsed() < std::time::Duration::from_secs(1));
        waker.join().unwrap();
        client.join().unwrap();
    }
}
