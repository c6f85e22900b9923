//! NBD over TLS end to end in one process: the server's STARTTLS and its blocking TLS
//! transport against the crate's own async client. Many concurrent reads and writes
//! compared with a reference copy; the client's identity as the export sees it; require
//! mode refusing a plaintext client; a TLS client refusing a server without TLS.

use std::path::Path;
use std::sync::{Arc, Mutex};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    SanType,
};
use vdstream_blockdev::{BlockDev, MemoryDev};
use vdstream_contract::Identity;
use vdstream_nbd::client::{Address, Client, ConnectOptions};
use vdstream_nbd::{
    ExportInfo, Exports, Listener, OpenError, OpenRequest, OpenedExport, Server, ServerConfig,
    ShutdownSignal, TlsMode,
};
use vdstream_tls::files::{ClientAuth, ServerTls};

const DISK: u64 = 8 << 20;

/// Writes a CA, a server certificate for localhost and a target certificate for `pc-07`
/// into `dir` (qemu's layout; one directory for both ends).
fn make_pki(dir: &Path) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "test CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    std::fs::write(dir.join("ca-cert.pem"), ca_cert.pem()).unwrap();
    for (role, san, eku) in [
        (
            "server",
            SanType::DnsName("localhost".try_into().unwrap()),
            ExtendedKeyUsagePurpose::ServerAuth,
        ),
        (
            "client",
            SanType::URI("urn:vdstream:target:pc-07".try_into().unwrap()),
            ExtendedKeyUsagePurpose::ClientAuth,
        ),
    ] {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.subject_alt_names = vec![san];
        p.extended_key_usages = vec![eku];
        p.distinguished_name.push(DnType::CommonName, role);
        let cert = p.signed_by(&key, &issuer).unwrap();
        std::fs::write(dir.join(format!("{role}-cert.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{role}-key.pem")), key.serialize_pem()).unwrap();
    }
}

/// One writable export, recording who opened it.
struct Recording {
    dev: Arc<MemoryDev>,
    clients: Mutex<Vec<Identity>>,
}

impl Exports for Recording {
    fn list(&self) -> Vec<ExportInfo> {
        vec![ExportInfo {
            name: "disk".into(),
            description: String::new(),
        }]
    }
    fn open(&self, _: &str) -> Result<Arc<dyn BlockDev>, OpenError> {
        Ok(self.dev.clone())
    }
    fn open_export(&self, req: &OpenRequest<'_>) -> Result<OpenedExport, OpenError> {
        self.clients.lock().unwrap().push(req.client.clone());
        Ok(OpenedExport {
            device: self.dev.clone(),
            description: None,
            exclusive: false,
            close: None,
        })
    }
}

struct Setup {
    dir: tempfile::TempDir,
    sock: std::path::PathBuf,
    exports: Arc<Recording>,
}

fn serve(mode: TlsMode, tls: bool) -> Setup {
    serve_allowing(mode, tls, Vec::new())
}

/// [`serve`] with `tls_allow_names`.
fn serve_allowing(mode: TlsMode, tls: bool, tls_allow_names: Vec<String>) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    make_pki(dir.path());
    let exports = Arc::new(Recording {
        dev: Arc::new(MemoryDev::new(DISK)),
        clients: Mutex::new(Vec::new()),
    });
    let config = ServerConfig {
        tls: tls.then(|| Arc::new(ServerTls::new(dir.path(), ClientAuth::Verify).unwrap())),
        tls_mode: mode,
        threads_per_connection: 4,
        tls_allow_names,
        ..ServerConfig::default()
    };
    let server = Server::new(exports.clone(), config);
    let sock = dir.path().join("nbd.sock");
    let listener = tokio::net::UnixListener::bind(&sock).unwrap();
    tokio::spawn(async move {
        server
            .serve(Listener::Unix(listener), ShutdownSignal::never())
            .await
    });
    Setup { dir, sock, exports }
}

fn tls_opts(dir: &Path) -> ConnectOptions {
    ConnectOptions {
        tls: Some(vdstream_tls::files::client_config(dir).unwrap()),
        ..ConnectOptions::export("disk")
    }
}

/// 16 tasks on one TLS connection, each writing and reading its own region in random
/// sizes (1 byte to 256 KiB) while the others run; every read equals the task's
/// reference copy, and at the end the whole disk equals the joined references.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_io_over_tls_matches_a_reference() {
    let s = serve(TlsMode::Require, true);
    let client = Arc::new(
        Client::connect(Address::unix(&s.sock), tls_opts(s.dir.path()))
            .await
            .unwrap(),
    );
    assert_eq!(
        s.exports.clients.lock().unwrap().as_slice(),
        &[Identity::Target("pc-07".into())]
    );
    const TASKS: u64 = 16;
    let region = DISK / TASKS;
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(t);
            let mut model = vec![0u8; region as usize];
            for _ in 0..60 {
                let len = if rng.u8(..) < 20 {
                    rng.usize(1..=256 << 10)
                } else {
                    rng.usize(1..=8192)
                }
                .min(region as usize);
                let off = rng.usize(..=(region as usize - len));
                if rng.bool() {
                    let data: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
                    client
                        .write(t * region + off as u64, &data, false)
                        .await
                        .unwrap();
                    model[off..off + len].copy_from_slice(&data);
                } else {
                    let got = client
                        .read(t * region + off as u64, len as u32)
                        .await
                        .unwrap();
                    assert!(
                        got == model[off..off + len],
                        "task {t}: read at {off}+{len} differs from the reference"
                    );
                }
            }
            model
        }));
    }
    let mut whole = Vec::new();
    for t in tasks {
        whole.extend(t.await.unwrap());
    }
    for (i, chunk) in whole.chunks(1 << 20).enumerate() {
        assert!(
            client
                .read(i as u64 * (1 << 20), chunk.len() as u32)
                .await
                .unwrap()
                == chunk,
            "MiB {i} differs"
        );
    }
    client.disconnect().await.unwrap();
}

/// `tls_allow_names` lets in a certificate that carries one of the names (its common name
/// here), and refuses one that carries none with a policy refusal that names it and the
/// flag, before any export is opened.
#[tokio::test]
async fn allowed_names_narrow_the_certificates_served() {
    let s = serve_allowing(TlsMode::Require, true, vec!["client".into()]);
    let c = Client::connect(Address::unix(&s.sock), tls_opts(s.dir.path()))
        .await
        .unwrap();
    c.disconnect().await.unwrap();
    assert_eq!(
        s.exports.clients.lock().unwrap().as_slice(),
        &[Identity::Target("pc-07".into())]
    );
    let s = serve_allowing(
        TlsMode::Require,
        true,
        vec!["t1".into(), "backup.lab".into()],
    );
    let e = Client::connect(Address::unix(&s.sock), tls_opts(s.dir.path()))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("forbidden by server policy")
            && e.contains("client certificate of target:pc-07"),
        "{e}"
    );
    assert!(
        e.contains("--tls-allow-name") && e.contains("t1") && e.contains("backup.lab"),
        "{e}"
    );
    assert!(
        s.exports.clients.lock().unwrap().is_empty(),
        "an export was opened for a certificate not allowed"
    );
}

/// A plaintext client to a `require` server is told TLS is required, by name.
#[tokio::test]
async fn require_refuses_a_plaintext_client() {
    let s = serve(TlsMode::Require, true);
    let e = Client::connect(Address::unix(&s.sock), ConnectOptions::export("disk"))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("TLS"), "{e}");
    assert!(
        s.exports.clients.lock().unwrap().is_empty(),
        "an export was opened for a plaintext client"
    );
}

/// `on`: a plaintext client is served, as anonymous; a TLS one as its certificate says.
#[tokio::test]
async fn on_serves_plaintext_as_anonymous() {
    let s = serve(TlsMode::On, true);
    let c = Client::connect(Address::unix(&s.sock), ConnectOptions::export("disk"))
        .await
        .unwrap();
    c.write(0, b"abc", false).await.unwrap();
    let t = Client::connect(Address::unix(&s.sock), tls_opts(s.dir.path()))
        .await
        .unwrap();
    assert_eq!(t.read(0, 3).await.unwrap(), b"abc");
    assert_eq!(
        s.exports.clients.lock().unwrap().as_slice(),
        &[Identity::Anonymous, Identity::Target("pc-07".into())]
    );
}

/// A client that wants TLS fails clearly against a server without it (no plaintext
/// fallback); a server without TLS knows its clients as Local.
#[tokio::test]
async fn tls_client_refuses_a_server_without_tls() {
    let s = serve(TlsMode::Off, false);
    let e = Client::connect(Address::unix(&s.sock), tls_opts(s.dir.path()))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("refused NBD_OPT_STARTTLS") && e.contains("--tls"),
        "{e}"
    );
    Client::connect(Address::unix(&s.sock), ConnectOptions::export("disk"))
        .await
        .unwrap();
    assert_eq!(
        s.exports.clients.lock().unwrap().as_slice(),
        &[Identity::Local]
    );
}

/// `nbds+unix://…?tls-certificates=DIR` connects over TLS without further options.
#[tokio::test]
async fn nbds_uri_with_certificates() {
    let s = serve(TlsMode::Require, true);
    let uri = format!(
        "nbds+unix:///disk?socket={}&tls-certificates={}",
        s.sock.display(),
        s.dir.path().display()
    );
    let c = Client::connect_uri(&uri, ConnectOptions::default())
        .await
        .unwrap();
    assert_eq!(c.size(), DISK);
    let e = Client::connect_uri(
        &format!("nbds+unix:///disk?socket={}", s.sock.display()),
        ConnectOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("tls-certificates"), "{e}");
}

/// Raw bytes before STARTTLS in `require` mode: LIST and INFO get TLS_REQD and the
/// connection stays usable (ABORT is still acknowledged); EXPORT_NAME, which cannot carry
/// an error, closes the connection without opening anything.
#[tokio::test]
async fn require_before_starttls_raw() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use vdstream_nbd::proto::*;
    async fn option(s: &mut tokio::net::UnixStream, opt: u32, data: &[u8]) {
        let mut m = IHAVEOPT.to_be_bytes().to_vec();
        m.extend_from_slice(&opt.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        s.write_all(&m).await.unwrap();
    }
    async fn reply(s: &mut tokio::net::UnixStream) -> (u32, u32) {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).await.unwrap();
        let mut payload = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
        s.read_exact(&mut payload).await.unwrap();
        (
            u32::from_be_bytes(h[8..12].try_into().unwrap()),
            u32::from_be_bytes(h[12..16].try_into().unwrap()),
        )
    }
    async fn greeted(path: &Path) -> tokio::net::UnixStream {
        let mut s = tokio::net::UnixStream::connect(path).await.unwrap();
        let mut g = [0u8; 18];
        s.read_exact(&mut g).await.unwrap();
        s.write_all(&3u32.to_be_bytes()).await.unwrap();
        s
    }
    let s = serve(TlsMode::Require, true);
    let mut c = greeted(&s.sock).await;
    option(&mut c, OPT_LIST, &[]).await;
    assert_eq!(reply(&mut c).await, (OPT_LIST, REP_ERR_TLS_REQD));
    let mut info = 4u32.to_be_bytes().to_vec();
    info.extend_from_slice(b"disk\0\0");
    option(&mut c, OPT_INFO, &info).await;
    assert_eq!(reply(&mut c).await, (OPT_INFO, REP_ERR_TLS_REQD));
    option(&mut c, OPT_ABORT, &[]).await;
    assert_eq!(reply(&mut c).await, (OPT_ABORT, REP_ACK));

    let mut c = greeted(&s.sock).await;
    option(&mut c, OPT_EXPORT_NAME, b"disk").await;
    let mut rest = Vec::new();
    let n = tokio::time::timeout(std::time::Duration::from_secs(5), c.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(n, 0, "EXPORT_NAME before TLS was answered");
    assert!(
        s.exports.clients.lock().unwrap().is_empty(),
        "an export was opened before TLS"
    );
}
