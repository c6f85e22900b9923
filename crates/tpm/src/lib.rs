//! TPM 2.0 identity for vdstream's diskless machines.
//!
//! A diskless machine proves which machine it is with its TPM, in two halves:
//!
//! - [`device`], the agent's side (in the initramfs): a small TPM 2.0 client that talks to
//!   `/dev/tpmrm0` (or swtpm's socket) itself, with `tpm2-protocol` marshalling the
//!   commands, so the initramfs carries no TSS C libraries. It derives the endorsement key
//!   and an identity signing key as primary keys from fixed templates: the same keys on
//!   every boot of the same TPM, whose private halves never leave it.
//! - [`credential`], the server's side, which needs no TPM: it parses and checks the public
//!   keys a machine sends, names and fingerprints them, verifies the identity key's
//!   signatures, and makes the TPM2_MakeCredential challenge that only the TPM holding
//!   both the endorsement key and the identity key can answer (TPM2_ActivateCredential).

#![forbid(unsafe_code)]

pub mod credential;
pub mod device;

use tpm2_protocol::basic::TpmUint16;
use tpm2_protocol::data::{
    Tpm2bDigest, TpmAlgId, TpmEccCurve, TpmaObject, TpmsEccParms, TpmsEccPoint, TpmsSchemeHash,
    TpmtEccScheme, TpmtKdfScheme, TpmtPublic, TpmtSymDef, TpmuAsymScheme, TpmuPublicId,
    TpmuPublicParms, TpmuSymKeyBits, TpmuSymMode,
};
use tpm2_protocol::{TpmMarshal, TpmResult, TpmWriter};

/// The EK template's objectAttributes: fixedTPM | fixedParent | sensitiveDataOrigin |
/// adminWithPolicy | restricted | decrypt (TCG EK Credential Profile, template L-2).
const EK_ATTRIBUTES: u32 = 0x0003_00B2;

/// The EK template's authPolicy: PolicySecret(TPM_RH_ENDORSEMENT), so using the EK needs
/// the endorsement hierarchy's authorization.
const EK_AUTH_POLICY: [u8; 32] = [
    0x83, 0x71, 0x97, 0x67, 0x44, 0x84, 0xB3, 0xF8, 0x1A, 0x90, 0xCC, 0x8D, 0x46, 0xA5, 0xD7, 0x24,
    0xFD, 0x52, 0xD7, 0x6E, 0x06, 0x52, 0x0B, 0x64, 0xF2, 0xA1, 0xDA, 0x1B, 0x33, 0x14, 0x69, 0xAA,
];

/// The identity key's objectAttributes: fixedTPM | fixedParent | sensitiveDataOrigin |
/// userWithAuth | noDA | sign (an unrestricted signing key that never leaves its TPM).
/// noDA: the key has no password to guess, and a TPM that other software's failed
/// passwords put into dictionary-attack lockout must still let the machine prove itself.
const IDENTITY_ATTRIBUTES: u32 = 0x0004_0472;

/// What the identity key template's unique.x is the SHA-256 of: a different value would
/// derive a different key from the same TPM.
const IDENTITY_UNIQUE: &[u8] = b"vdstream identity key v1";

/// The TCG EK Credential Profile's default ECC NIST P-256 endorsement key template (L-2).
fn endorsement_template() -> TpmResult<TpmtPublic> {
    Ok(TpmtPublic {
        object_type: TpmAlgId::Ecc,
        name_alg: TpmAlgId::Sha256,
        object_attributes: TpmaObject::from_bits_truncate(EK_ATTRIBUTES),
        auth_policy: Tpm2bDigest::try_from(&EK_AUTH_POLICY[..])?,
        parameters: TpmuPublicParms::Ecc(TpmsEccParms {
            symmetric: aes_128_cfb(),
            scheme: TpmtEccScheme::default(),
            curve_id: TpmEccCurve::NistP256,
            kdf: TpmtKdfScheme::default(),
        }),
        unique: ecc_unique(&[0; 32])?,
    })
}

/// vdstream's identity key template: ECC NIST P-256, ECDSA-SHA256. It is created under the
/// endorsement hierarchy, whose seed TPM2_Clear leaves alone: the identity lasts as long as
/// the EK does.
fn identity_template() -> TpmResult<TpmtPublic> {
    let unique_x = ring::digest::digest(&ring::digest::SHA256, IDENTITY_UNIQUE);
    Ok(TpmtPublic {
        object_type: TpmAlgId::Ecc,
        name_alg: TpmAlgId::Sha256,
        object_attributes: TpmaObject::from_bits_truncate(IDENTITY_ATTRIBUTES),
        auth_policy: Tpm2bDigest::default(),
        parameters: TpmuPublicParms::Ecc(TpmsEccParms {
            symmetric: TpmtSymDef::default(),
            scheme: ecdsa_sha256(),
            curve_id: TpmEccCurve::NistP256,
            kdf: TpmtKdfScheme::default(),
        }),
        unique: ecc_unique(unique_x.as_ref())?,
    })
}

/// AES-128 in CFB mode: the EK's symmetric algorithm, which protects credentials.
fn aes_128_cfb() -> TpmtSymDef {
    TpmtSymDef {
        algorithm: TpmAlgId::Aes,
        key_bits: TpmuSymKeyBits::Aes(TpmUint16::new(128)),
        mode: TpmuSymMode::Aes(TpmAlgId::Cfb),
    }
}

/// ECDSA over SHA-256: the identity key's signing scheme.
fn ecdsa_sha256() -> TpmtEccScheme {
    TpmtEccScheme {
        scheme: TpmAlgId::Ecdsa,
        details: TpmuAsymScheme::Hash(TpmsSchemeHash {
            hash_alg: TpmAlgId::Sha256,
        }),
    }
}

/// A template's unique field: `x` as given, `y` 32 zero bytes.
fn ecc_unique(x: &[u8]) -> TpmResult<TpmuPublicId> {
    Ok(TpmuPublicId::Ecc(TpmsEccPoint {
        x: x.try_into()?,
        y: (&[0u8; 32][..]).try_into()?,
    }))
}

/// The wire bytes of a TPM structure.
fn marshal<T: TpmMarshal>(value: &T) -> TpmResult<Vec<u8>> {
    let mut buffer = vec![0; tpm2_protocol::constant::TPM_MAX_COMMAND_SIZE];
    let mut writer = TpmWriter::new(&mut buffer);
    value.marshal(&mut writer)?;
    let len = writer.len();
    buffer.truncate(len);
    Ok(buffer)
}
