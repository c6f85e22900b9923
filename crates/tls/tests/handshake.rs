//! A certificate directory read by `files` gives working rustls configurations: a real
//! handshake (in memory) between them, the client's identity read from its certificate
//! (its role URI, else its common name), anonymous clients, a foreign CA refused, a
//! certificate request that names no CA (so that a client shows a foreign certificate
//! rather than hold it back), and a revocation list taking effect on the next connection
//! without a restart.

use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, DnType, IsCa, Issuer,
    KeyIdMethod, KeyPair, KeyUsagePurpose, RevokedCertParams, SanType, SerialNumber,
};
use rustls::{ClientConnection, ServerConnection};
use vdstream_tls::files::{self, ClientAuth, ServerTls};
use vdstream_tls::{peer, Identity};

struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

fn ca(name: &str) -> Ca {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let pem = params.self_signed(&key).unwrap().pem();
    Ca {
        issuer: Issuer::new(params, key),
        pem,
    }
}

/// Writes `NAME-cert.pem` and `NAME-key.pem` into `dir`, signed by `ca`.
fn issue(ca: &Ca, dir: &Path, file: &str, sans: Vec<SanType>, serial: u8) {
    issue_cn(ca, dir, file, None, sans, serial);
}

/// [`issue`] with a subject common name.
fn issue_cn(ca: &Ca, dir: &Path, file: &str, cn: Option<&str>, sans: Vec<SanType>, serial: u8) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    if let Some(cn) = cn {
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, cn);
    }
    params.subject_alt_names = sans;
    params.serial_number = Some(SerialNumber::from(vec![serial]));
    params.key_identifier_method = KeyIdMethod::Sha256;
    let cert = params.signed_by(&key, &ca.issuer).unwrap();
    std::fs::write(dir.join(format!("{file}-cert.pem")), cert.pem()).unwrap();
    std::fs::write(dir.join(format!("{file}-key.pem")), key.serialize_pem()).unwrap();
}

fn server_sans() -> Vec<SanType> {
    vec![
        SanType::DnsName("localhost".try_into().unwrap()),
        SanType::IpAddress([127, 0, 0, 1].into()),
    ]
}

fn target_sans(id: &str) -> Vec<SanType> {
    vec![SanType::URI(
        Identity::Target(id.into())
            .role_uri()
            .unwrap()
            .try_into()
            .unwrap(),
    )]
}

/// A server directory and a client directory, both trusting `ca`.
fn dirs(ca: &Ca, client: Option<(Vec<SanType>, u8)>) -> (tempfile::TempDir, tempfile::TempDir) {
    let (sd, cd) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    for d in [sd.path(), cd.path()] {
        std::fs::write(d.join(files::CA_CERT), &ca.pem).unwrap();
    }
    issue(ca, sd.path(), "server", server_sans(), 1);
    if let Some((sans, serial)) = client {
        issue(ca, cd.path(), "client", sans, serial);
    }
    (sd, cd)
}

/// Runs a handshake in memory; returns the server side or the first error.
fn handshake(server: &ServerTls, client_dir: &Path) -> Result<ServerConnection, rustls::Error> {
    handshake_with(server, files::client_config(client_dir).unwrap())
}

fn handshake_with(
    server: &ServerTls,
    client: std::sync::Arc<rustls::ClientConfig>,
) -> Result<ServerConnection, rustls::Error> {
    let mut s = ServerConnection::new(server.current()).unwrap();
    let mut c = ClientConnection::new(client, files::server_name(None).unwrap()).unwrap();
    for _ in 0..20 {
        let mut buf = Vec::new();
        while c.wants_write() {
            c.write_tls(&mut buf).unwrap();
        }
        s.read_tls(&mut &buf[..]).unwrap();
        s.process_new_packets()?;
        buf.clear();
        while s.wants_write() {
            s.write_tls(&mut buf).unwrap();
        }
        c.read_tls(&mut &buf[..]).unwrap();
        c.process_new_packets()?;
        if !s.is_handshaking() && !c.is_handshaking() && !c.wants_write() {
            return Ok(s);
        }
    }
    panic!("the handshake did not finish in 20 rounds");
}

fn client_identity(s: &ServerConnection) -> Option<Identity> {
    s.peer_certificates()
        .map(|certs| peer::identity_of(&certs[0]).unwrap())
}

#[test]
fn a_target_certificate_names_its_target() {
    let ca = ca("farm");
    let (sd, cd) = dirs(&ca, Some((target_sans("pc-07"), 7)));
    let server = ServerTls::new(sd.path(), ClientAuth::Verify).unwrap();
    let s = handshake(&server, cd.path()).unwrap();
    assert_eq!(client_identity(&s), Some(Identity::Target("pc-07".into())));
    assert_eq!(
        peer::serial_of(&s.peer_certificates().unwrap()[0]).unwrap(),
        vec![7]
    );
}

#[test]
fn a_client_without_a_certificate_is_anonymous_not_refused() {
    let ca = ca("farm");
    let (sd, cd) = dirs(&ca, None);
    let server = ServerTls::new(sd.path(), ClientAuth::Verify).unwrap();
    let s = handshake(&server, cd.path()).unwrap();
    assert_eq!(client_identity(&s), None);
}

#[test]
fn a_client_certificate_from_another_ca_is_refused() {
    let (ours, theirs) = (ca("farm"), ca("elsewhere"));
    let (sd, _) = dirs(&ours, None);
    let (_, cd) = dirs(&theirs, Some((target_sans("pc-07"), 7)));
    // The client trusts our CA for the server, but shows a certificate of another CA.
    std::fs::write(cd.path().join(files::CA_CERT), &ours.pem).unwrap();
    let server = ServerTls::new(sd.path(), ClientAuth::Verify).unwrap();
    let err = handshake(&server, cd.path()).unwrap_err();
    assert!(
        matches!(err, rustls::Error::InvalidCertificate(_)),
        "{err:?}"
    );
}

#[test]
fn a_server_of_another_ca_is_refused_by_the_client() {
    let (ours, theirs) = (ca("farm"), ca("elsewhere"));
    let (sd, _) = dirs(&theirs, None);
    let (_, cd) = dirs(&ours, None);
    let server = ServerTls::new(sd.path(), ClientAuth::Verify).unwrap();
    let err = handshake(&server, cd.path()).unwrap_err();
    assert!(
        matches!(err, rustls::Error::InvalidCertificate(_)),
        "{err:?}"
    );
}

#[test]
fn a_revocation_list_takes_effect_on_the_next_connection() {
    let ca = ca("farm");
    let (sd, cd) = dirs(&ca, Some((target_sans("pc-07"), 9)));
    let server = ServerTls::new(sd.path(), ClientAuth::Verify).unwrap();
    handshake(&server, cd.path()).unwrap();
    assert!(server.revoked_serials().unwrap().is_empty());

    let crl = CertificateRevocationListParams {
        this_update: rcgen::date_time_ymd(2020, 1, 1),
        next_update: rcgen::date_time_ymd(2099, 1, 1),
        crl_number: SerialNumber::from(vec![1]),
        issuing_distribution_point: None,
        revoked_certs: vec![RevokedCertParams {
            serial_number: SerialNumber::from(vec![9]),
            revocation_time: rcgen::date_time_ymd(2020, 1, 1),
            reason_code: None,
            invalidity_date: None,
        }],
        key_identifier_method: KeyIdMethod::Sha256,
    }
    .signed_by(&ca.issuer)
    .unwrap();
    std::fs::write(sd.path().join(files::CA_CRL), crl.pem().unwrap()).unwrap();
    assert_eq!(server.revoked_serials().unwrap(), vec![vec![9]]);
    let err = handshake(&server, cd.path()).unwrap_err();
    assert!(
        matches!(
            err,
            rustls::Error::InvalidCertificate(rustls::CertificateError::Revoked)
        ),
        "{err:?}"
    );
}

#[test]
fn a_certificate_without_a_role_names_no_identity() {
    let ca = ca("farm");
    let (sd, cd) = dirs(
        &ca,
        Some((
            vec![SanType::DnsName("pc-07.example".try_into().unwrap())],
            3,
        )),
    );
    let server = ServerTls::new(sd.path(), ClientAuth::Verify).unwrap();
    let s = handshake(&server, cd.path()).unwrap();
    let err = peer::identity_of(&s.peer_certificates().unwrap()[0])
        .unwrap_err()
        .to_string();
    assert!(err.contains("names no vdstream role"), "{err}");
}

#[test]
fn a_certificate_without_a_role_is_held_by_its_common_name() {
    // As qemu's and nbdkit's documentation make one: CN=t1, no vdstream role URI.
    let ca = ca("farm");
    let (sd, cd) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    for d in [sd.path(), cd.path()] {
        std::fs::write(d.join(files::CA_CERT), &ca.pem).unwrap();
    }
    issue(&ca, sd.path(), "server", server_sans(), 1);
    issue_cn(
        &ca,
        cd.path(),
        "client",
        Some("t1"),
        vec![SanType::DnsName("t1.lab.example".try_into().unwrap())],
        4,
    );
    let server = ServerTls::new(sd.path(), ClientAuth::Verify).unwrap();
    let s = handshake(&server, cd.path()).unwrap();
    let cert = &s.peer_certificates().unwrap()[0];
    let (holder, why) = peer::holder_of(cert);
    assert_eq!(holder, Identity::Verified("t1".into()));
    assert!(why.is_some_and(|e| e.to_string().contains("names no vdstream role")));
    assert_eq!(peer::names_of(cert).unwrap(), ["t1", "t1.lab.example"]);
    // A role URI still names the role.
    let (sd, cd) = dirs(&ca, Some((target_sans("pc-07"), 7)));
    let s = handshake(
        &ServerTls::new(sd.path(), ClientAuth::Verify).unwrap(),
        cd.path(),
    )
    .unwrap();
    assert_eq!(
        peer::holder_of(&s.peer_certificates().unwrap()[0]).0,
        Identity::Target("pc-07".into())
    );
}

/// A client that records the CA names the server's certificate request gives, and shows
/// no certificate.
#[derive(Debug, Default)]
struct HintsSeen(std::sync::Mutex<Option<usize>>);

impl rustls::client::ResolvesClientCert for HintsSeen {
    fn resolve(
        &self,
        root_hint_subjects: &[&[u8]],
        _: &[rustls::SignatureScheme],
    ) -> Option<std::sync::Arc<rustls::sign::CertifiedKey>> {
        *self.0.lock().unwrap() = Some(root_hint_subjects.len());
        None
    }

    fn has_certs(&self) -> bool {
        true
    }
}

#[test]
fn the_certificate_request_names_no_ca() {
    // With the CA's name in it, gnutls (libnbd, qemu) holds back a certificate another CA
    // signed and connects as anonymous; without, it shows it, and the handshake refuses it.
    let ca = ca("farm");
    let (sd, _cd) = dirs(&ca, None);
    let server = ServerTls::new(sd.path(), ClientAuth::Verify).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for c in files::read_certs(&sd.path().join(files::CA_CERT)).unwrap() {
        roots.add(c).unwrap();
    }
    let seen = std::sync::Arc::new(HintsSeen::default());
    let client = rustls::ClientConfig::builder_with_provider(files::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_cert_resolver(seen.clone());
    handshake_with(&server, std::sync::Arc::new(client)).unwrap();
    assert_eq!(
        *seen.0.lock().unwrap(),
        Some(0),
        "the server asked for a certificate, naming no CA"
    );
}

#[test]
fn a_missing_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let err = ServerTls::new(dir.path(), ClientAuth::Verify)
        .unwrap_err()
        .to_string();
    assert!(err.contains("ca-cert.pem"), "{err}");
}
