//! A certificate directory turned into rustls configurations.
//!
//! The layout is the one qemu's `tls-creds-x509` and nbdkit read, so one directory serves
//! every tool: `ca-cert.pem` (the CA that signs both ends), `server-cert.pem` and
//! `server-key.pem` (a server's own), `client-cert.pem` and `client-key.pem` (a client's
//! own), and optionally `ca-crl.pem` (certificates the CA revoked).
//!
//! Invariants: a server verifies client certificates against `ca-cert.pem` (and
//! `ca-crl.pem` when present) unless verification is turned off; a certificate that fails
//! (another CA's, expired, revoked) fails the TLS handshake, and the server's certificate
//! request names no CA, so that clients show whatever certificate they have rather than
//! hold back one of another CA; a client without a certificate, or with verification off,
//! is anonymous, never refused by TLS itself (what an anonymous client may do is the
//! server's policy). [`ServerTls::current`] re-reads the
//! directory when a file in it changed, so a new CRL takes effect on the next connection.
//! Every error names the file and what to do.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::TlsError;

pub const CA_CERT: &str = "ca-cert.pem";
pub const CA_CRL: &str = "ca-crl.pem";
pub const SERVER_CERT: &str = "server-cert.pem";
pub const SERVER_KEY: &str = "server-key.pem";
pub const CLIENT_CERT: &str = "client-cert.pem";
pub const CLIENT_KEY: &str = "client-key.pem";

/// The crypto provider every vdstream TLS configuration uses.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn file_error(path: &Path, why: impl std::fmt::Display) -> TlsError {
    TlsError::File {
        path: path.to_path_buf(),
        why: why.to_string(),
    }
}

/// The certificates in a PEM file (at least one).
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(path, format!("cannot read certificates: {e}")))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(path, format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(file_error(
            path,
            "holds no certificate (expected -----BEGIN CERTIFICATE-----)",
        ));
    }
    Ok(certs)
}

/// The private key in a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| file_error(path, format!("cannot read a private key: {e}")))
}

/// The revocation lists in `ca-crl.pem`, or none when the file does not exist.
pub fn read_crls(dir: &Path) -> Result<Vec<CertificateRevocationListDer<'static>>, TlsError> {
    let path = dir.join(CA_CRL);
    if !path.exists() {
        return Ok(Vec::new());
    }
    CertificateRevocationListDer::pem_file_iter(&path)
        .map_err(|e| file_error(&path, format!("cannot read the revocation list: {e}")))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(&path, format!("not a PEM revocation list: {e}")))
}

pub(crate) fn roots(dir: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let path = dir.join(CA_CERT);
    let mut roots = RootCertStore::empty();
    for cert in read_certs(&path)? {
        roots
            .add(cert)
            .map_err(|e| file_error(&path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(Arc::new(roots))
}

/// Whether a server asks for and checks client certificates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// Verify client certificates against `ca-cert.pem` (and `ca-crl.pem`); a client that
    /// shows none is anonymous. The default.
    Verify,
    /// Ask for none: every client is anonymous.
    Off,
}

/// Builds a server configuration from `dir` (`ca-cert.pem`, `server-cert.pem`,
/// `server-key.pem`, optional `ca-crl.pem`).
pub fn server_config(dir: &Path, auth: ClientAuth) -> Result<Arc<ServerConfig>, TlsError> {
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match auth {
        ClientAuth::Off => {
            builder.with_client_cert_verifier(WebPkiClientVerifier::no_client_auth())
        }
        ClientAuth::Verify => {
            // No CA names in the certificate request: with them, a gnutls client (libnbd,
            // qemu) keeps a certificate another CA signed to itself and goes on without
            // one, as anonymous; without them it shows it, and is refused here.
            let verifier = WebPkiClientVerifier::builder_with_provider(roots(dir)?, provider())
                .clear_root_hint_subjects()
                .with_crls(read_crls(dir)?)
                .only_check_end_entity_revocation()
                .allow_unknown_revocation_status()
                .allow_unauthenticated()
                .build()
                .map_err(|e| match e {
                    rustls::server::VerifierBuilderError::InvalidCrl(e) => file_error(
                        &dir.join(CA_CRL),
                        format!("not a usable revocation list ({e:?}): it must be an X.509 v2 CRL signed by ca-cert.pem (`vdstream pki revoke` writes one; with `openssl ca -gencrl`, set crlnumber)"),
                    ),
                    e => file_error(&dir.join(CA_CERT), format!("cannot verify clients with it: {e}")),
                })?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let cert_path = dir.join(SERVER_CERT);
    let key_path = dir.join(SERVER_KEY);
    let config = builder
        .with_single_cert(read_certs(&cert_path)?, read_key(&key_path)?)
        .map_err(|e| {
            file_error(
                &cert_path,
                format!("does not go with {}: {e}", key_path.display()),
            )
        })?;
    Ok(Arc::new(config))
}

/// Builds a client configuration from `dir`: servers are verified against `ca-cert.pem`;
/// `client-cert.pem` and `client-key.pem`, when both exist, are shown to the server.
pub fn client_config(dir: &Path) -> Result<Arc<ClientConfig>, TlsError> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots(dir)?);
    let (cert_path, key_path) = (dir.join(CLIENT_CERT), dir.join(CLIENT_KEY));
    let config = if cert_path.exists() || key_path.exists() {
        builder
            .with_client_auth_cert(read_certs(&cert_path)?, read_key(&key_path)?)
            .map_err(|e| {
                file_error(
                    &cert_path,
                    format!("does not go with {}: {e}", key_path.display()),
                )
            })?
    } else {
        builder.with_no_client_auth()
    };
    Ok(Arc::new(config))
}

/// The name a client checks the server's certificate against: the host of the address it
/// dials, or `localhost` for a unix socket (what `vdstream pki issue` puts in every server
/// certificate, as qemu and libnbd do for unix sockets).
pub fn server_name(host: Option<&str>) -> Result<ServerName<'static>, TlsError> {
    let host = host
        .unwrap_or("localhost")
        .trim_start_matches('[')
        .trim_end_matches(']');
    ServerName::try_from(host.to_string())
        .map_err(|e| TlsError::Config(format!("{host:?} cannot name a TLS server: {e}")))
}

/// A server's TLS configuration that follows its directory: [`ServerTls::current`] rebuilds
/// it when a file changed (a new CRL, a renewed certificate), so changes take effect on the
/// next connection without a restart.
pub struct ServerTls {
    dir: PathBuf,
    auth: ClientAuth,
    cached: Mutex<(Vec<Option<SystemTime>>, Arc<ServerConfig>)>,
    /// `ca-crl.pem`'s modification time and the serials it revoked then.
    revoked: Mutex<(Option<SystemTime>, Vec<Vec<u8>>)>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("dir", &self.dir)
            .field("auth", &self.auth)
            .finish_non_exhaustive()
    }
}

fn stamps(dir: &Path) -> Vec<Option<SystemTime>> {
    [CA_CERT, CA_CRL, SERVER_CERT, SERVER_KEY]
        .iter()
        .map(|f| {
            std::fs::metadata(dir.join(f))
                .and_then(|m| m.modified())
                .ok()
        })
        .collect()
}

impl ServerTls {
    /// Reads `dir` now, so a bad directory fails at start, not at the first client.
    pub fn new(dir: &Path, auth: ClientAuth) -> Result<ServerTls, TlsError> {
        let config = server_config(dir, auth)?;
        let tls = ServerTls {
            dir: dir.to_path_buf(),
            auth,
            cached: Mutex::new((stamps(dir), config)),
            revoked: Mutex::new((None, Vec::new())),
        };
        tls.revoked_serials()?;
        Ok(tls)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn client_auth(&self) -> ClientAuth {
        self.auth
    }

    /// The configuration for a new connection. When the directory changed and no longer
    /// reads, the last good configuration stays (and the error is logged).
    pub fn current(&self) -> Arc<ServerConfig> {
        let now = stamps(&self.dir);
        let mut cached = self.cached.lock().unwrap_or_else(|p| p.into_inner());
        if cached.0 != now {
            match server_config(&self.dir, self.auth) {
                Ok(config) => {
                    log::info!("TLS: re-read {} (a file in it changed)", self.dir.display());
                    *cached = (now, config);
                }
                Err(e) => {
                    log::error!("TLS: {e}; keeping the configuration read before");
                    cached.0 = now;
                }
            }
        }
        cached.1.clone()
    }

    /// The serial numbers `ca-crl.pem` revokes now (big-endian bytes as in the certificate),
    /// for closing sessions that were opened before the revocation.
    pub fn revoked_serials(&self) -> Result<Vec<Vec<u8>>, TlsError> {
        let mut serials = Vec::new();
        for crl in read_crls(&self.dir)? {
            serials.extend(
                crate::peer::revoked_serials(&crl)
                    .map_err(|e| file_error(&self.dir.join(CA_CRL), e))?,
            );
        }
        Ok(serials)
    }

    /// Whether `ca-crl.pem` revokes the certificate with this serial (big-endian, no
    /// leading zeros). The file is parsed again only when its modification time changed;
    /// when it no longer reads, the serials read before stay (and the error is logged).
    pub fn is_revoked(&self, serial: &[u8]) -> bool {
        let path = self.dir.join(CA_CRL);
        let stamp = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
        let mut revoked = self.revoked.lock().unwrap_or_else(|p| p.into_inner());
        if revoked.0 != stamp {
            match self.revoked_serials() {
                Ok(serials) => *revoked = (stamp, serials),
                Err(e) => {
                    log::error!("TLS: {e}; keeping the revocations read before");
                    revoked.0 = stamp;
                }
            }
        }
        let trimmed = &serial[serial.iter().position(|&b| b != 0).unwrap_or(serial.len())..];
        revoked.1.iter().any(|s| s == trimmed)
    }
}
