//! Fuzzes the options phase of a TLS server (`--tls require` or `--tls on`) with STARTTLS
//! in it: the input's first part is fed as the client's plaintext bytes (client flags,
//! options before TLS: TLS_REQD answers, a STARTTLS among them...), then the harness sends
//! NBD_OPT_STARTTLS itself; when the server acknowledges it, a real TLS handshake follows
//! (a client certificate naming a target) and the input's second part is fed over TLS
//! (options after TLS, a second STARTTLS, GO, requests). Invariants checked: the server
//! never panics and every connection ends.
//!
//! Input: byte 0 picks the mode (even: require, odd: on), bytes 1-2 the length of the
//! plaintext part (big-endian, clipped), the rest the two parts.
#![no_main]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vdstream_blockdev::{BlockDev, MemoryDev};
use vdstream_nbd::{ExportInfo, Exports, OpenError, Server, ServerConfig, ShutdownSignal, TlsMode};

struct One(Arc<MemoryDev>);
impl Exports for One {
    fn list(&self) -> Vec<ExportInfo> {
        vec![ExportInfo { name: "a".into(), description: String::new() }]
    }
    fn open(&self, name: &str) -> Result<Arc<dyn BlockDev>, OpenError> {
        match name {
            "" | "a" => Ok(self.0.clone()),
            _ => Err(OpenError::Unknown(name.to_string())),
        }
    }
}

struct Harness {
    rt: tokio::runtime::Runtime,
    servers: [Server; 2],
    client: Arc<rustls::ClientConfig>,
}

/// A CA, a server certificate for localhost and a target certificate, in one directory.
fn make_pki() -> PathBuf {
    use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, SanType};
    let dir = std::env::temp_dir().join(format!("vdstream-fuzz-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "fuzz CA");
    std::fs::write(dir.join("ca-cert.pem"), ca.self_signed(&ca_key).unwrap().pem()).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    for (role, san, eku) in [
        ("server", SanType::DnsName("localhost".try_into().unwrap()), ExtendedKeyUsagePurpose::ServerAuth),
        ("client", SanType::URI("urn:vdstream:target:fuzz".try_into().unwrap()), ExtendedKeyUsagePurpose::ClientAuth),
    ] {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.subject_alt_names = vec![san];
        p.extended_key_usages = vec![eku];
        std::fs::write(dir.join(format!("{role}-cert.pem")), p.signed_by(&key, &issuer).unwrap().pem()).unwrap();
        std::fs::write(dir.join(format!("{role}-key.pem")), key.serialize_pem()).unwrap();
    }
    dir
}

fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        let dir = make_pki();
        let tls = Arc::new(vdstream_tls::files::ServerTls::new(&dir, vdstream_tls::files::ClientAuth::Verify).unwrap());
        let exports = Arc::new(One(Arc::new(MemoryDev::new(1 << 20))));
        let server = |mode| {
            let config = ServerConfig { handshake_timeout: Duration::from_secs(2), tls: Some(tls.clone()), tls_mode: mode, ..Default::default() };
            Server::new(exports.clone(), config)
        };
        let client = vdstream_tls::files::client_config(&dir).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        Harness { rt, servers: [server(TlsMode::Require), server(TlsMode::On)], client }
    })
}

const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

/// Reads the greeting and option replies until the reply to STARTTLS: whether it was ACK.
async fn starttls_acked<R: tokio::io::AsyncRead + Unpin>(s: &mut R) -> bool {
    let mut greeting = [0u8; 18];
    if s.read_exact(&mut greeting).await.is_err() {
        return false;
    }
    let mut h = [0u8; 20];
    let mut payload = vec![0u8; 0];
    for _ in 0..1000 {
        if s.read_exact(&mut h).await.is_err() || u64::from_be_bytes(h[..8].try_into().unwrap()) != REPLY_MAGIC {
            return false;
        }
        let [opt, kind, len] = [8, 12, 16].map(|i| u32::from_be_bytes(h[i..i + 4].try_into().unwrap()));
        payload.resize(len.min(1 << 20) as usize, 0);
        if len > 1 << 20 || s.read_exact(&mut payload).await.is_err() {
            return false;
        }
        if opt == 5 {
            return kind == 1;
        }
    }
    false
}

async fn drain<R: tokio::io::AsyncRead + Unpin>(r: &mut R) {
    let mut buf = vec![0u8; 1 << 16];
    while let Ok(n) = r.read(&mut buf).await {
        if n == 0 {
            break;
        }
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let h = harness();
    let server = &h.servers[(data[0] & 1) as usize];
    let split = (u16::from_be_bytes([data[1], data[2]]) as usize).min(data.len() - 3);
    let (plain, secret) = data[3..].split_at(split);
    h.rt.block_on(async {
        let (client, server_side) = tokio::net::UnixStream::pair().expect("socket pair");
        let serve = server.serve_unix_stream(server_side, ShutdownSignal::never());
        let drive = async move {
            let mut client = client;
            let mut out = plain.to_vec();
            out.extend_from_slice(&IHAVEOPT.to_be_bytes());
            out.extend_from_slice(&5u32.to_be_bytes());
            out.extend_from_slice(&0u32.to_be_bytes());
            let (mut rd, mut wr) = client.split();
            let (_, acked) = tokio::join!(wr.write_all(&out), async {
                // The server may say nothing (it waits for more), so this is bounded.
                tokio::time::timeout(Duration::from_secs(3), starttls_acked(&mut rd)).await.unwrap_or(false)
            });
            if !acked {
                let _ = client.shutdown().await;
                drain(&mut client).await;
                return;
            }
            let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
            let Ok(tls) = tokio_rustls::TlsConnector::from(h.client.clone()).connect(name, client).await else { return };
            let (mut r, mut w) = tokio::io::split(tls);
            tokio::join!(
                async {
                    let _ = w.write_all(secret).await;
                    let _ = w.shutdown().await;
                },
                drain(&mut r)
            );
        };
        tokio::time::timeout(Duration::from_secs(20), async { tokio::join!(serve, drive) }).await.expect("server connection hung");
    });
});
