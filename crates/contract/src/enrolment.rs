//! A machine's enrolment: the TPM-resident key a target proved it holds, and whether an
//! administrator approved it (docs/IDENTITY.md). `STORE/identities/ID.json` holds one
//! [`Enrolment`]; the API and `vdstream target identity` show it.
//!
//! States:
//!
//! - `pending`: a machine proved a key for this target (credential activation against its
//!   TPM's endorsement key, and a fresh signature) and waits for an administrator, who
//!   compares the fingerprint with the one the machine's console shows.
//! - `approved`: the key is the target's. A proof with it gets a certificate; a proof with
//!   any other key is refused, logged and audited. Approved before any proof (pre-enrolled
//!   by fingerprint), `key` stays empty until the machine first proves that key.
//! - `revoked`: no key gets anything for this target until an administrator approves a key
//!   again. The server refuses the target's connections made with a certificate.

use serde::{Deserialize, Serialize};

use crate::time::{Stamp, Timestamp};

/// `format` of an enrolment record.
pub const ENROLMENT_FORMAT: &str = "vdstream-enrolment";

/// Where an enrolment stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum EnrolmentState {
    Pending,
    Approved,
    Revoked,
}

impl EnrolmentState {
    pub fn name(self) -> &'static str {
        match self {
            EnrolmentState::Pending => "pending",
            EnrolmentState::Approved => "approved",
            EnrolmentState::Revoked => "revoked",
        }
    }
}

/// A TPM key as the machine showed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TpmKey {
    /// `sha256:` and the hex SHA-256 of the key's TPMT_PUBLIC: what an administrator
    /// compares with the machine's console.
    pub fingerprint: String,
    /// The key's TPM2B_PUBLIC, base64 (standard alphabet, padded).
    pub public: String,
}

/// One target's enrolment, as `STORE/identities/ID.json` holds it and the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Enrolment {
    pub format: String,
    pub format_version: u32,
    /// The target id.
    pub target: String,
    pub state: EnrolmentState,
    /// The identity key (a primary key of the TPM's endorsement hierarchy, from a fixed
    /// template: the same on every boot, never outside the TPM). Absent while pre-enrolled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<TpmKey>,
    /// The endorsement key the identity key was proved against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endorsement_key: Option<TpmKey>,
    /// The fingerprint an administrator approved before the machine proved any key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_fingerprint: Option<String>,
    /// The MAC and the address the last proof came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    /// The first and the last accepted proof (pending or approved).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_proof: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_proof: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved: Option<Stamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked: Option<Stamp>,
    /// Proofs refused for this target (another key, or a revoked one).
    #[serde(default)]
    pub refused: u64,
}

/// What a proof of a key for a target came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProofOutcome {
    /// The key is the target's approved one.
    Approved(Enrolment),
    /// Waiting for an administrator (a new enrolment, or one still pending).
    Pending(Enrolment),
    /// Refused: another key than the approved one, or a revoked target. The reason names
    /// what to do.
    Refused(Enrolment, String),
}

/// `POST /boot/identity/{id}/challenge`: the machine's two TPM keys (TPM2B_PUBLIC, base64).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ChallengeRequest {
    pub endorsement_key: String,
    pub key: String,
}

/// The server's answer: a credential only the TPM holding both keys can activate, and a
/// nonce the proof signs. Both base64; the challenge expires after a minute and is used once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Challenge {
    pub challenge: String,
    /// TPM2B_ID_OBJECT, for TPM2_ActivateCredential.
    pub credential: String,
    /// TPM2B_ENCRYPTED_SECRET, for TPM2_ActivateCredential.
    pub secret: String,
    pub nonce: String,
    /// The identity key's fingerprint, as the machine's console shows it.
    pub fingerprint: String,
}

/// `POST /boot/identity/{id}/prove`: the activated secret, the TLS key the machine made
/// (SubjectPublicKeyInfo, DER), and the identity key's signature over [`proof_message`]
/// (ECDSA P-256, r‖s); all base64.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ProofRequest {
    pub challenge: String,
    pub secret: String,
    pub tls_key: String,
    pub signature: String,
}

/// The answer to a proof: `approved` with a certificate, or `pending`, or (HTTP 403) refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ProofAnswer {
    pub state: EnrolmentState,
    pub fingerprint: String,
    /// The target's client certificate for `tls_key` (PEM), when approved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate: Option<String>,
    /// The farm's CA certificate (PEM), when approved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_after: Option<Timestamp>,
    /// What the machine's console says.
    pub message: String,
}

/// What the identity key signs: the protocol's name, the target, the challenge's nonce, the
/// activated secret and the TLS key to certify, each length-prefixed (u32, big-endian), so
/// that no two different proofs sign the same bytes.
pub fn proof_message(target: &str, nonce: &[u8], secret: &[u8], tls_key: &[u8]) -> Vec<u8> {
    let mut m = Vec::new();
    for part in [
        b"vdstream identity proof v1".as_slice(),
        target.as_bytes(),
        nonce,
        secret,
        tls_key,
    ] {
        m.extend_from_slice(&u32::try_from(part.len()).unwrap_or(u32::MAX).to_be_bytes());
        m.extend_from_slice(part);
    }
    m
}
