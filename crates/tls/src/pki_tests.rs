//! Tests of the CA: what it writes is checked the way a peer checks it (rustls's webpki
//! verifiers, with the CRL) and read back with x509-parser.

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, ServerName, UnixTime};
use rustls::server::danger::ClientCertVerifier;
use rustls::{CertificateError, RootCertStore};
use x509_parser::extensions::GeneralName;

use super::*;

pub(crate) fn new_ca(dir: &Path) -> Ca {
    init(
        dir,
        &InitRequest {
            farm: "lab".into(),
            valid_for: CA_VALIDITY,
            force: false,
        },
    )
    .unwrap();
    Ca::open(dir).unwrap()
}

pub(crate) fn req(identity: Identity, out: &Path) -> IssueRequest {
    IssueRequest {
        identity,
        out: out.to_path_buf(),
        valid_for: None,
        dns: vec![],
        ips: vec![],
        default_hosts: true,
        force: false,
    }
}

fn cert_der(path: &Path) -> CertificateDer<'static> {
    CertificateDer::from_pem_file(path).unwrap()
}

fn roots(ca_dir: &Path) -> Arc<RootCertStore> {
    let mut roots = RootCertStore::empty();
    roots.add(cert_der(&ca_dir.join(CA_CERT))).unwrap();
    Arc::new(roots)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn client_verifier(ca_dir: &Path, with_crl: bool) -> Arc<dyn ClientCertVerifier> {
    let mut b =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots(ca_dir), provider());
    if with_crl {
        b = b.with_crls(vec![CertificateRevocationListDer::from_pem_file(
            ca_dir.join(CA_CRL),
        )
        .unwrap()]);
    }
    b.build().unwrap()
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

/// The SAN URIs, DNS names and addresses of a certificate, and its CN.
fn names(der: &CertificateDer<'_>) -> (Vec<String>, Vec<String>, String) {
    let (_, x) = x509_parser::parse_x509_certificate(der).unwrap();
    let mut uris = vec![];
    let mut hosts = vec![];
    if let Some(san) = x.subject_alternative_name().unwrap() {
        for n in &san.value.general_names {
            match n {
                GeneralName::URI(u) => uris.push(u.to_string()),
                GeneralName::DNSName(d) => hosts.push(d.to_string()),
                GeneralName::IPAddress(b) => hosts.push(match b.len() {
                    4 => IpAddr::from(<[u8; 4]>::try_from(*b).unwrap()).to_string(),
                    _ => IpAddr::from(<[u8; 16]>::try_from(*b).unwrap()).to_string(),
                }),
                other => panic!("unexpected SAN {other:?}"),
            }
        }
    }
    let cn = x
        .subject()
        .iter_common_name()
        .next()
        .unwrap()
        .as_str()
        .unwrap()
        .to_string();
    (uris, hosts, cn)
}

#[test]
fn init_writes_a_ca_and_refuses_to_replace_it() {
    let d = tempfile::tempdir().unwrap();
    let ca = d.path().join("ca");
    let info = init(
        &ca,
        &InitRequest {
            farm: "lab".into(),
            valid_for: CA_VALIDITY,
            force: false,
        },
    )
    .unwrap();
    assert_eq!(info.subject, "lab vdstream CA");
    assert_eq!(mode(&ca.join(CA_KEY)), 0o600);
    assert_eq!(mode(&ca.join(ISSUED)), 0o600);
    let der = cert_der(&ca.join(CA_CERT));
    let (_, x) = x509_parser::parse_x509_certificate(&der).unwrap();
    let bc = x.basic_constraints().unwrap().unwrap().value;
    assert!(bc.ca && bc.path_len_constraint == Some(0));
    let ku = x.key_usage().unwrap().unwrap().value;
    assert!(ku.key_cert_sign() && ku.crl_sign());
    let years =
        (x.validity().not_after.timestamp() - x.validity().not_before.timestamp()) / (365 * 86400);
    assert_eq!(years, 10);

    let again = init(
        &ca,
        &InitRequest {
            farm: "lab".into(),
            valid_for: CA_VALIDITY,
            force: false,
        },
    )
    .unwrap_err();
    assert!(matches!(again, PkiError::Exists { .. }), "{again}");
    assert!(again.to_string().contains("--force"), "{again}");
    assert_eq!(cert_der(&ca.join(CA_CERT)), der, "the CA is untouched");

    let replaced = init(
        &ca,
        &InitRequest {
            farm: "lab".into(),
            valid_for: CA_VALIDITY,
            force: true,
        },
    )
    .unwrap()
    .replaced
    .unwrap();
    assert_eq!(
        cert_der(&replaced.join(CA_CERT)),
        der,
        "the old CA is kept aside"
    );
    assert_ne!(cert_der(&ca.join(CA_CERT)), der);
}

#[test]
fn certificates_name_their_identity_and_verify_against_the_ca() {
    let d = tempfile::tempdir().unwrap();
    let ca_dir = d.path().join("ca");
    let ca = new_ca(&ca_dir);
    let (srv, tgt, adm) = (
        d.path().join("srv"),
        d.path().join("pc-07"),
        d.path().join("alice"),
    );
    let mut r = req(Identity::Server("store-a".into()), &srv);
    r.dns = vec!["Store-A.example.org".into()];
    r.ips = vec!["10.0.0.1".parse().unwrap()];
    let s = ca.issue(&r).unwrap();
    let t = ca
        .issue(&req(Identity::Target("pc-07".into()), &tgt))
        .unwrap();
    let a = ca
        .issue(&req(Identity::Admin("alice".into()), &adm))
        .unwrap();

    for (dir, role) in [(&srv, "server"), (&tgt, "client"), (&adm, "client")] {
        assert_eq!(
            std::fs::read(dir.join(CA_CERT)).unwrap(),
            std::fs::read(ca_dir.join(CA_CERT)).unwrap()
        );
        assert_eq!(mode(&dir.join(format!("{role}-key.pem"))), 0o600);
        assert!(
            !dir.join(CA_CRL).exists(),
            "no CRL before the first revocation"
        );
    }
    let server = cert_der(&srv.join("server-cert.pem"));
    let (uris, hosts, cn) = names(&server);
    assert_eq!(uris, ["urn:vdstream:server:store-a"]);
    assert_eq!(
        Identity::from_role_uri(&uris[0]).unwrap(),
        Identity::Server("store-a".into())
    );
    assert_eq!(cn, "store-a");
    for h in [
        "localhost",
        "127.0.0.1",
        "::1",
        "store-a.example.org",
        "10.0.0.1",
    ] {
        assert!(hosts.iter().any(|x| x == h), "{h} in {hosts:?}");
    }
    assert_eq!(s.cert.hosts, hosts);
    for (dir, id) in [
        (&tgt, Identity::Target("pc-07".into())),
        (&adm, Identity::Admin("alice".into())),
    ] {
        let (uris, hosts, cn) = names(&cert_der(&dir.join("client-cert.pem")));
        assert_eq!(uris, [id.role_uri().unwrap()], "exactly one SAN URI");
        assert_eq!(Identity::from_role_uri(&uris[0]).unwrap(), id);
        assert!(hosts.is_empty());
        assert_eq!(cn, id.name().unwrap());
    }
    for f in [
        srv.join("server-cert.pem"),
        tgt.join("client-cert.pem"),
        adm.join("client-cert.pem"),
    ] {
        let der = cert_der(&f);
        let (_, x) = x509_parser::parse_x509_certificate(&der).unwrap();
        let ku = x.key_usage().unwrap().unwrap().value;
        // qemu's tls-creds-x509 refuses a certificate without keyEncipherment.
        assert!(
            ku.digital_signature() && ku.key_encipherment() && !ku.key_cert_sign(),
            "{}",
            f.display()
        );
    }

    // What a vdstream server checks: the client certificates chain to the CA.
    let cv = client_verifier(&ca_dir, false);
    for dir in [&tgt, &adm] {
        cv.verify_client_cert(
            &cert_der(&dir.join("client-cert.pem")),
            &[],
            UnixTime::now(),
        )
        .unwrap();
    }
    // A server certificate is good for both ends; a target's is not a server's.
    cv.verify_client_cert(&server, &[], UnixTime::now())
        .unwrap();
    let sv =
        rustls::client::WebPkiServerVerifier::builder_with_provider(roots(&ca_dir), provider())
            .build()
            .unwrap();
    for host in ["localhost", "127.0.0.1", "store-a.example.org"] {
        sv.verify_server_cert(
            &server,
            &[],
            &ServerName::try_from(host).unwrap(),
            &[],
            UnixTime::now(),
        )
        .unwrap();
    }
    let wrong_host = sv.verify_server_cert(
        &server,
        &[],
        &ServerName::try_from("other.example.org").unwrap(),
        &[],
        UnixTime::now(),
    );
    assert!(wrong_host.is_err());
    let target_as_server = sv.verify_server_cert(
        &cert_der(&tgt.join("client-cert.pem")),
        &[],
        &ServerName::try_from("localhost").unwrap(),
        &[],
        UnixTime::now(),
    );
    assert!(
        target_as_server.is_err(),
        "a target certificate has no serverAuth"
    );

    // Another CA's certificates are refused.
    let other = tempfile::tempdir().unwrap();
    let ca2 = new_ca(&other.path().join("ca"));
    ca2.issue(&req(
        Identity::Target("pc-07".into()),
        &other.path().join("t"),
    ))
    .unwrap();
    assert!(cv
        .verify_client_cert(
            &cert_der(&other.path().join("t/client-cert.pem")),
            &[],
            UnixTime::now()
        )
        .is_err());

    // The record.
    let list = ca.list().unwrap();
    assert_eq!(
        list.iter().map(|c| c.identity.as_str()).collect::<Vec<_>>(),
        ["server:store-a", "target:pc-07", "admin:alice"]
    );
    assert_eq!(list[1], t.cert);
    assert_eq!(list[2], a.cert);
    assert!(list
        .iter()
        .all(|c| c.serial.len() == 32 && c.status(Timestamp::now()) == "valid"));
    let (_, x) = x509_parser::parse_x509_certificate(&server).unwrap();
    assert_eq!(hex(x.raw_serial()), s.cert.serial);
    assert_eq!(x.validity().not_after.timestamp(), s.cert.not_after.0);
    let days = |c: &IssuedCert| (c.not_after.0 - c.issued.0) / 86400;
    assert_eq!(
        (days(&s.cert), days(&t.cert), days(&a.cert)),
        (365, 365, 90)
    );
}

#[test]
fn a_revoked_certificate_is_in_the_crl_and_refused() {
    let d = tempfile::tempdir().unwrap();
    let ca_dir = d.path().join("ca");
    let ca = new_ca(&ca_dir);
    let a1 = ca
        .issue(&req(Identity::Target("a".into()), &d.path().join("a1")))
        .unwrap();
    let a2 = ca
        .issue(&req(Identity::Target("a".into()), &d.path().join("a2")))
        .unwrap();
    let b = ca
        .issue(&req(Identity::Target("b".into()), &d.path().join("b")))
        .unwrap();

    let out = d.path().join("server-dir");
    std::fs::create_dir(&out).unwrap();
    let (done, crl) = ca
        .revoke(&Revoke::Serial(a1.cert.serial.clone()), Some(&out))
        .unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!((crl.number, crl.revoked), (1, 1));
    assert_eq!(crl.copy.as_deref(), Some(out.join(CA_CRL).as_path()));
    assert_eq!(
        std::fs::read(out.join(CA_CRL)).unwrap(),
        std::fs::read(ca_dir.join(CA_CRL)).unwrap()
    );

    let cv = client_verifier(&ca_dir, true);
    let refused = cv
        .verify_client_cert(
            &cert_der(&d.path().join("a1/client-cert.pem")),
            &[],
            UnixTime::now(),
        )
        .unwrap_err();
    assert_eq!(
        refused,
        rustls::Error::InvalidCertificate(CertificateError::Revoked)
    );
    cv.verify_client_cert(
        &cert_der(&d.path().join("a2/client-cert.pem")),
        &[],
        UnixTime::now(),
    )
    .unwrap();
    cv.verify_client_cert(
        &cert_der(&d.path().join("b/client-cert.pem")),
        &[],
        UnixTime::now(),
    )
    .unwrap();

    let again = ca
        .revoke(&Revoke::Serial(a1.cert.serial.clone()), None)
        .unwrap_err();
    assert!(matches!(again, PkiError::AlreadyRevoked(_)), "{again}");

    // By identity: every unrevoked certificate of it.
    let (done, crl) = ca
        .revoke(&Revoke::Identity(Identity::Target("a".into())), None)
        .unwrap();
    assert_eq!(
        done.iter().map(|c| c.serial.as_str()).collect::<Vec<_>>(),
        [a2.cert.serial.as_str()]
    );
    assert_eq!((crl.number, crl.revoked), (2, 2));
    let pem = std::fs::read(ca_dir.join(CA_CRL)).unwrap();
    let der = CertificateRevocationListDer::from_pem_slice(&pem).unwrap();
    let (_, x) = x509_parser::parse_x509_crl(&der).unwrap();
    let listed: Vec<String> = x
        .iter_revoked_certificates()
        .map(|r| hex(r.raw_serial()))
        .collect();
    assert_eq!(listed, [a1.cert.serial.clone(), a2.cert.serial.clone()]);
    let ca_der = cert_der(&ca_dir.join(CA_CERT));
    let (_, ca_x) = x509_parser::parse_x509_certificate(&ca_der).unwrap();
    x.verify_signature(ca_x.public_key())
        .expect("the CRL is signed by the CA");
    assert_eq!(
        x.next_update().unwrap().timestamp() - x.last_update().timestamp(),
        CRL_VALIDITY.as_secs() as i64
    );
    let cv = client_verifier(&ca_dir, true);
    assert!(cv
        .verify_client_cert(
            &cert_der(&d.path().join("a2/client-cert.pem")),
            &[],
            UnixTime::now()
        )
        .is_err());
    cv.verify_client_cert(
        &cert_der(&d.path().join("b/client-cert.pem")),
        &[],
        UnixTime::now(),
    )
    .unwrap();

    let none = ca
        .revoke(&Revoke::Identity(Identity::Target("a".into())), None)
        .unwrap_err();
    assert!(
        matches!(none, PkiError::NotIssued(_))
            && none.to_string().contains("no unrevoked certificate"),
        "{none}"
    );
    let unknown = ca.revoke(&Revoke::Serial("4ABC".into()), None).unwrap_err();
    assert!(matches!(unknown, PkiError::NotIssued(_)), "{unknown}");
    let statuses: Vec<&str> = ca
        .list()
        .unwrap()
        .iter()
        .map(|c| c.status(Timestamp::now()))
        .collect();
    assert_eq!(statuses, ["revoked", "revoked", "valid"]);

    // A certificate issued after a revocation comes with the CRL; a fresh CRL has a new number.
    ca.issue(&req(Identity::Target("c".into()), &d.path().join("c")))
        .unwrap();
    assert_eq!(std::fs::read(d.path().join("c").join(CA_CRL)).unwrap(), pem);
    assert_eq!(ca.write_crl(None).unwrap().number, 3);
    let _ = b;
}

#[test]
fn refusals_name_the_problem() {
    let d = tempfile::tempdir().unwrap();
    let ca_dir = d.path().join("ca");
    let none = Ca::open(&ca_dir).unwrap_err();
    assert!(
        matches!(none, PkiError::NoCa { .. }) && none.to_string().contains("vdstream pki init"),
        "{none}"
    );
    let ca = new_ca(&ca_dir);
    let out = d.path().join("t");
    ca.issue(&req(Identity::Target("t1".into()), &out)).unwrap();
    let key = std::fs::read(out.join("client-key.pem")).unwrap();
    let e = ca
        .issue(&req(Identity::Target("t1".into()), &out))
        .unwrap_err();
    assert!(
        matches!(e, PkiError::Exists { .. }) && e.to_string().contains("--force"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(out.join("client-key.pem")).unwrap(),
        key,
        "the key is untouched"
    );
    let mut renew = req(Identity::Target("t1".into()), &out);
    renew.force = true;
    ca.issue(&renew).unwrap();
    assert_ne!(std::fs::read(out.join("client-key.pem")).unwrap(), key);

    let mut r = req(Identity::Target("t2".into()), &d.path().join("t2"));
    r.dns = vec!["x.example.org".into()];
    assert!(
        matches!(ca.issue(&r).unwrap_err(), PkiError::BadInput(m) if m.contains("not a server"))
    );
    let mut r = req(Identity::Server("s".into()), &d.path().join("s"));
    r.dns = vec!["bad name".into()];
    assert!(
        matches!(ca.issue(&r).unwrap_err(), PkiError::BadInput(m) if m.contains("not a DNS name"))
    );
    assert!(matches!(
        ca.issue(&req(Identity::Anonymous, &d.path().join("x")))
            .unwrap_err(),
        PkiError::BadInput(_)
    ));
    assert!(
        matches!(ca.issue(&req(Identity::Target("t3".into()), &ca_dir)).unwrap_err(), PkiError::BadInput(m) if m.contains("CA folder"))
    );
    assert_eq!(ca.list().unwrap().len(), 2, "refusals record nothing");
    // A CA that ends soon shortens what it issues.
    drop(ca);
    let short = d.path().join("short");
    init(
        &short,
        &InitRequest {
            farm: "lab".into(),
            valid_for: Duration::from_secs(86400),
            force: false,
        },
    )
    .unwrap();
    let ca = Ca::open(&short).unwrap();
    let i = ca
        .issue(&req(Identity::Target("t4".into()), &d.path().join("t4")))
        .unwrap();
    assert!(i.shortened && i.cert.not_after == ca.info().not_after);
}

#[test]
fn serials_and_identities_parse() {
    assert_eq!(parse_serial("4a:bc:0D").unwrap(), "4ABC0D");
    assert!(parse_serial("xyz").is_err() && parse_serial("").is_err());
    assert!(
        matches!(Revoke::parse("target:pc-07").unwrap(), Revoke::Identity(Identity::Target(t)) if t == "pc-07")
    );
    assert!(matches!(
        Revoke::parse("admin:alice").unwrap(),
        Revoke::Identity(Identity::Admin(_))
    ));
    assert!(matches!(Revoke::parse("4A:BC").unwrap(), Revoke::Serial(s) if s == "4ABC"));
    let e = Revoke::parse("target:../x").err().unwrap().to_string();
    assert!(e.contains("path separator"), "{e}");
    assert!(parse_identity("root:x").is_err() && parse_identity("pc-07").is_err());
    for _ in 0..100 {
        let s = new_serial().unwrap();
        assert!((0x40..=0x7f).contains(&s[0]) && s.len() == 16);
    }
}

#[test]
fn a_certificate_for_a_targets_own_key_names_the_target_and_verifies() {
    let d = tempfile::tempdir().unwrap();
    let ca_dir = d.path().join("ca");
    let ca = new_ca(&ca_dir);
    // The machine's key: made where it stays; the CA sees its public part only.
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let (pem, record) = ca
        .issue_for_key(
            "pc-07",
            &key.subject_public_key_info(),
            Duration::from_secs(3600),
        )
        .unwrap();
    let der = CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
    let (uris, hosts, cn) = names(&der);
    assert_eq!(uris, ["urn:vdstream:target:pc-07"]);
    assert!(hosts.is_empty());
    assert_eq!(cn, "pc-07");
    // The certificate carries the machine's public key, and a peer accepts it.
    let (_, parsed) = x509_parser::parse_x509_certificate(&der).unwrap();
    assert_eq!(
        parsed.public_key().raw,
        key.subject_public_key_info().as_slice()
    );
    client_verifier(&ca_dir, false)
        .verify_client_cert(&der, &[], UnixTime::now())
        .unwrap();
    // Short-lived, and in issued.json so that it can be revoked.
    assert!(record.not_after.0 - Timestamp::now().0 <= 3600);
    assert_eq!(ca.list().unwrap().last().unwrap().serial, record.serial);
    assert!(ca
        .issue_for_key("pc-07", b"not a key", Duration::from_secs(60))
        .is_err());
}
