//! TLS between two peers of one identity: the migration link between the two agents of a
//! target. Neither end is a server of the farm, so neither has a host name to check; each
//! shows its `client-cert.pem` (the target's certificate) and each requires the other's to
//! chain to `ca-cert.pem`, not be revoked in `ca-crl.pem`, and name the expected identity.
//!
//! Invariants: no handshake completes without a certificate from the other end; a
//! certificate of another CA, revoked, expired, or naming another identity (another
//! target, a server, an administrator) fails the handshake on the end that checks it,
//! with a message naming what it named and what was expected.

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{
    ClientConfig, DigitallySignedStruct, DistinguishedName, ServerConfig, SignatureScheme,
};
use vdstream_contract::Identity;

use crate::files::{self, provider, read_certs, read_crls, read_key, CLIENT_CERT, CLIENT_KEY};
use crate::TlsError;

/// The name the connecting end puts in its handshake (no SNI is sent; the verifier checks
/// the identity, not a host name).
pub const LINK_SERVER_NAME: &str = "vdstream-peer.invalid";

/// Checks a peer certificate against the CA, then its identity against `expect`.
#[derive(Debug)]
struct PeerVerifier {
    chain: Arc<dyn ClientCertVerifier>,
    expect: Identity,
}

impl PeerVerifier {
    fn new(dir: &Path, expect: Identity) -> Result<PeerVerifier, TlsError> {
        let chain = WebPkiClientVerifier::builder_with_provider(files::roots(dir)?, provider())
            .with_crls(read_crls(dir)?)
            .only_check_end_entity_revocation()
            .allow_unknown_revocation_status()
            .build()
            .map_err(|e| {
                TlsError::Config(format!(
                    "{}: cannot verify peers with it: {e}",
                    dir.display()
                ))
            })?;
        Ok(PeerVerifier { chain, expect })
    }

    fn check(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<(), rustls::Error> {
        self.chain
            .verify_client_cert(end_entity, intermediates, now)?;
        match crate::peer::identity_of(end_entity) {
            Ok(id) if id == self.expect => Ok(()),
            Ok(id) => Err(rustls::Error::General(format!(
                "the peer's certificate names {id}, not {}",
                self.expect
            ))),
            Err(e) => Err(rustls::Error::General(format!(
                "the peer's certificate: {e}"
            ))),
        }
    }
}

/// The handshake signatures, checked as the chain verifier checks them (both traits ask).
macro_rules! signatures_by_chain {
    () => {
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.chain.verify_tls12_signature(message, cert, dss)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.chain.verify_tls13_signature(message, cert, dss)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.chain.supported_verify_schemes()
        }
    };
}

impl ClientCertVerifier for PeerVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.check(end_entity, intermediates, now)?;
        Ok(ClientCertVerified::assertion())
    }

    signatures_by_chain!();
}

impl ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.check(end_entity, intermediates, now)?;
        Ok(ServerCertVerified::assertion())
    }

    signatures_by_chain!();
}

/// This end's certificate, checked to name `expect`: an agent started with another
/// target's certificate is refused at start, not at the first migration.
fn own_cert(
    dir: &Path,
    expect: &Identity,
) -> Result<
    (
        Vec<CertificateDer<'static>>,
        rustls::pki_types::PrivateKeyDer<'static>,
    ),
    TlsError,
> {
    let path = dir.join(CLIENT_CERT);
    let certs = read_certs(&path)?;
    match crate::peer::identity_of(&certs[0]) {
        Ok(id) if &id == expect => {}
        Ok(id) => {
            return Err(TlsError::File {
                path,
                why: format!(
                    "names {id}; the migration link needs {expect}'s certificate (`vdstream pki issue {} {} --out DIR`)",
                    expect.role(),
                    expect.name().unwrap_or_default()
                ),
            })
        }
        Err(e) => return Err(TlsError::File { path, why: e.to_string() }),
    }
    Ok((certs, read_key(&dir.join(CLIENT_KEY))?))
}

/// The listening end: shows `dir`'s `client-cert.pem` (which must name `expect`) and
/// admits only a peer whose certificate names `expect`.
pub fn listen_config(dir: &Path, expect: Identity) -> Result<Arc<ServerConfig>, TlsError> {
    let (certs, key) = own_cert(dir, &expect)?;
    let verifier = Arc::new(PeerVerifier::new(dir, expect)?);
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .map_err(|e| TlsError::File {
            path: dir.join(CLIENT_CERT),
            why: format!("does not go with {CLIENT_KEY}: {e}"),
        })?;
    Ok(Arc::new(config))
}

/// The connecting end: shows `dir`'s `client-cert.pem` (which must name `expect`) and
/// accepts only a listener whose certificate names `expect`.
pub fn connect_config(dir: &Path, expect: Identity) -> Result<Arc<ClientConfig>, TlsError> {
    let (certs, key) = own_cert(dir, &expect)?;
    let verifier = Arc::new(PeerVerifier::new(dir, expect)?);
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(certs, key)
        .map_err(|e| TlsError::File {
            path: dir.join(CLIENT_CERT),
            why: format!("does not go with {CLIENT_KEY}: {e}"),
        })?;
    config.enable_sni = false;
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::tests::{new_ca, req};
    use crate::pki::{Ca, Revoke};
    use rustls::{ClientConnection, ServerConnection};

    fn issue(ca: &Ca, who: Identity, out: &Path) {
        ca.issue(&req(who, out)).unwrap();
    }

    fn vm1() -> Identity {
        Identity::Target("vm1".into())
    }

    /// Runs a handshake in memory: `Err` names the end that refused and why.
    fn handshake(client: Arc<ClientConfig>, server: Arc<ServerConfig>) -> Result<(), String> {
        let mut c =
            ClientConnection::new(client, ServerName::try_from(LINK_SERVER_NAME).unwrap()).unwrap();
        let mut s = ServerConnection::new(server).unwrap();
        for _ in 0..10 {
            let mut buf = Vec::new();
            while c.wants_write() {
                c.write_tls(&mut buf).unwrap();
            }
            if !buf.is_empty() {
                s.read_tls(&mut &buf[..]).unwrap();
                s.process_new_packets()
                    .map_err(|e| format!("listener: {e}"))?;
            }
            let mut buf = Vec::new();
            while s.wants_write() {
                s.write_tls(&mut buf).unwrap();
            }
            if !buf.is_empty() {
                c.read_tls(&mut &buf[..]).unwrap();
                c.process_new_packets()
                    .map_err(|e| format!("connector: {e}"))?;
            }
            if !c.is_handshaking() && !s.is_handshaking() && !c.wants_write() && !s.wants_write() {
                return Ok(());
            }
        }
        Err("the handshake did not end".into())
    }

    /// A connecting end that shows `dir`'s certificate whatever it names, and checks the
    /// listener for `expect`: what a third party would build.
    fn raw_connector(dir: &Path, expect: Identity, show: bool) -> Arc<ClientConfig> {
        let verifier = Arc::new(PeerVerifier::new(dir, expect).unwrap());
        let b = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        Arc::new(if show {
            b.with_client_auth_cert(
                read_certs(&dir.join(CLIENT_CERT)).unwrap(),
                read_key(&dir.join(CLIENT_KEY)).unwrap(),
            )
            .unwrap()
        } else {
            b.with_no_client_auth()
        })
    }

    #[test]
    fn two_ends_of_one_target_link_and_no_one_else_does() {
        let d = tempfile::tempdir().unwrap();
        let ca = new_ca(&d.path().join("ca"));
        let (a, b, other, srv) = (
            d.path().join("host-a"),
            d.path().join("host-b"),
            d.path().join("vm2"),
            d.path().join("store"),
        );
        issue(&ca, vm1(), &a);
        issue(&ca, vm1(), &b);
        issue(&ca, Identity::Target("vm2".into()), &other);
        issue(&ca, Identity::Admin("alice".into()), &srv);

        let listener = listen_config(&a, vm1()).unwrap();
        assert_eq!(
            handshake(connect_config(&b, vm1()).unwrap(), listener.clone()),
            Ok(())
        );

        // Another target's certificate (or an administrator's) is refused by the listener.
        for who in [&other, &srv] {
            let e = handshake(raw_connector(who, vm1(), true), listener.clone()).unwrap_err();
            assert!(
                e.starts_with("listener:") && e.contains("not target:vm1"),
                "{e}"
            );
        }
        // So is a connection that shows no certificate.
        let e = handshake(raw_connector(&b, vm1(), false), listener.clone()).unwrap_err();
        assert!(e.starts_with("listener:"), "{e}");
        // A listener with another target's certificate is refused by the connecting end.
        let rogue = {
            let verifier = Arc::new(PeerVerifier::new(&other, vm1()).unwrap());
            Arc::new(
                ServerConfig::builder_with_provider(provider())
                    .with_safe_default_protocol_versions()
                    .unwrap()
                    .with_client_cert_verifier(verifier)
                    .with_single_cert(
                        read_certs(&other.join(CLIENT_CERT)).unwrap(),
                        read_key(&other.join(CLIENT_KEY)).unwrap(),
                    )
                    .unwrap(),
            )
        };
        let e = handshake(connect_config(&b, vm1()).unwrap(), rogue).unwrap_err();
        assert!(
            e.starts_with("connector:") && e.contains("target:vm2"),
            "{e}"
        );

        // Each end refuses to start with a certificate that does not name the target.
        let e = listen_config(&other, vm1()).unwrap_err().to_string();
        assert!(
            e.contains("names target:vm2") && e.contains("pki issue target vm1 --out"),
            "{e}"
        );
        assert!(connect_config(&other, vm1()).is_err());
    }

    #[test]
    fn another_farm_or_a_revoked_certificate_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let ca = new_ca(&d.path().join("ca"));
        let stranger = new_ca(&d.path().join("ca2"));
        let (a, b, c) = (d.path().join("a"), d.path().join("b"), d.path().join("c"));
        issue(&ca, vm1(), &a);
        issue(&stranger, vm1(), &b);
        let e = handshake(
            raw_connector(&b, vm1(), true),
            listen_config(&a, vm1()).unwrap(),
        );
        assert!(
            e.is_err(),
            "a certificate of another CA naming the same target"
        );

        issue(&ca, vm1(), &c);
        let serial = ca.list().unwrap().last().unwrap().serial.clone();
        ca.revoke(&Revoke::Serial(serial), Some(&a.join(files::CA_CRL)))
            .unwrap();
        let e = handshake(
            connect_config(&c, vm1()).unwrap(),
            listen_config(&a, vm1()).unwrap(),
        )
        .unwrap_err();
        assert!(
            e.starts_with("listener:") && e.to_lowercase().contains("revoked"),
            "{e}"
        );
    }
}
