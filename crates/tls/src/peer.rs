//! What a verified peer certificate says: the [`Identity`] its role URI names, and its
//! serial number (to match it against a revocation list).
//!
//! Invariant: only certificates rustls already verified against the CA reach these
//! functions; a certificate without exactly one vdstream role URI names no identity
//! (the caller treats its holder as anonymous and logs why).

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
