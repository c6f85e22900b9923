//! What a verified peer certificate says: the [`Identity`] its role URI names, the names it
//! carries (for `serve-image --tls-allow-name`), and its serial number (to match it
//! against a revocation list).
//!
//! Invariant: only certificates rustls already verified against the CA reach these
//! functions; a certificate without exactly one vdstream role URI names no role identity
//! ([`identity_of`] says why); [`holder_of`] then names its holder by its common name
//! ([`Identity::Verified`]), never as anonymous.

use rustls::pki_types::{CertificateDer, CertificateRevocationListDer};
use vdstream_contract::identity::ROLE_URI_PREFIX;
use vdstream_contract::Identity;
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};
use x509_parser::revocation_list::CertificateRevocationList;

use crate::TlsError;

fn parse<'a>(cert: &'a CertificateDer<'_>) -> Result<X509Certificate<'a>, TlsError> {
    X509Certificate::from_der(cert.as_ref())
        .map(|(_, c)| c)
        .map_err(|e| TlsError::Config(format!("the peer's certificate does not parse: {e}")))
}

/// The identity a certificate's `urn:vdstream:ROLE:NAME` SAN URI names.
pub fn identity_of(cert: &CertificateDer<'_>) -> Result<Identity, TlsError> {
    let cert = parse(cert)?;
    let subject = cert.subject().to_string();
    let mut uris = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let GeneralName::URI(uri) = name {
                if uri.starts_with(ROLE_URI_PREFIX) {
                    uris.push(*uri);
                }
            }
        }
    }
    match uris.as_slice() {
        [uri] => Identity::from_role_uri(uri).map_err(|e| TlsError::Config(format!("certificate {subject:?}: {e}"))),
        [] => Err(TlsError::Config(format!(
            "certificate {subject:?} names no vdstream role (no {ROLE_URI_PREFIX}ROLE:NAME URI); issue one with `vdstream pki issue`"
        ))),
        _ => Err(TlsError::Config(format!("certificate {subject:?} names {} vdstream roles; a certificate names one", uris.len()))),
    }
}

/// Who holds a verified certificate: the identity its role URI names, or, when it names
/// none (or not one usable), [`Identity::Verified`] with its subject's common name (the
/// whole subject when it has no common name). The `Err` of [`identity_of`], if any, comes
/// along for the log.
pub fn holder_of(cert: &CertificateDer<'_>) -> (Identity, Option<TlsError>) {
    match identity_of(cert) {
        Ok(id) => (id, None),
        Err(e) => {
            let name = parse(cert)
                .map(|c| {
                    common_names(&c)
                        .into_iter()
                        .next()
                        .unwrap_or_else(|| c.subject().to_string())
                })
                .unwrap_or_default();
            (Identity::verified(&name), Some(e))
        }
    }
}

fn common_names(cert: &X509Certificate<'_>) -> Vec<String> {
    cert.subject()
        .iter_common_name()
        .filter_map(|cn| cn.as_str().ok().map(str::to_string))
        .collect()
}

/// The names a certificate carries, as `--tls-allow-name` matches them: its subject's
/// common names, and its DNS, URI and e-mail subject alternative names.
pub fn names_of(cert: &CertificateDer<'_>) -> Result<Vec<String>, TlsError> {
    let cert = parse(cert)?;
    let mut names = common_names(&cert);
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            match name {
                GeneralName::DNSName(n) | GeneralName::URI(n) | GeneralName::RFC822Name(n) => {
                    names.push((*n).to_string())
                }
                _ => {}
            }
        }
    }
    Ok(names)
}

/// A certificate's serial number, big-endian, without leading zeros.
pub fn serial_of(cert: &CertificateDer<'_>) -> Result<Vec<u8>, TlsError> {
    Ok(trim(parse(cert)?.raw_serial()))
}

/// The serials a revocation list revokes (big-endian, without leading zeros).
pub fn revoked_serials(crl: &CertificateRevocationListDer<'_>) -> Result<Vec<Vec<u8>>, String> {
    let (_, crl) = CertificateRevocationList::from_der(crl.as_ref())
        .map_err(|e| format!("not a revocation list: {e}"))?;
    Ok(crl
        .iter_revoked_certificates()
        .map(|r| trim(r.raw_serial()))
        .collect())
}

fn trim(serial: &[u8]) -> Vec<u8> {
    let first = serial.iter().position(|&b| b != 0).unwrap_or(serial.len());
    serial[first..].to_vec()
}
