//! The server's side, which has no TPM: the public keys a machine sends, its signatures,
//! and the credential challenge that binds its identity key to its endorsement key.
//!
//! The challenge is TPM2_MakeCredential done in software, as TPM 2.0 Part 1 describes it
//! (§24 "Credential Protection", Annex C for ECC): a secret that only the TPM holding the
//! endorsement key can decrypt, and that it releases only for a key of the given name
//! loaded beside it.

use aes::Aes128;
use cfb_mode::cipher::{AsyncStreamCipher, KeyIvInit};
use ring::rand::SystemRandom;
use ring::{agreement, digest, hmac, signature};
use tpm2_protocol::data::{
    Tpm2bDigest, Tpm2bEccParameter, Tpm2bEncryptedSecret, Tpm2bIdObject, Tpm2bPublic, TpmAlgId,
    TpmEccCurve, TpmsEccParms, TpmuPublicId, TpmuPublicParms,
};
use tpm2_protocol::{TpmError, TpmMarshal, TpmUnmarshal};

/// A public key or credential input that cannot be used; the message says why.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("not a TPM2B_PUBLIC: {0}")]
    Malformed(String),
    /// A well-formed key of a kind this crate does not handle (RSA, another curve).
    #[error("unsupported TPM key: {0}")]
    Unsupported(String),
    /// A key that is not what its role needs (an EK that is not one, a signing key that
    /// can also decrypt).
    #[error("not {role}: {why}")]
    Template { role: &'static str, why: String },
    #[error("cannot make a credential: {0}")]
    Credential(String),
}

const ENDORSEMENT_KEY: &str = "a TCG default ECC P-256 endorsement key";
const IDENTITY_KEY: &str = "a vdstream identity key";

/// The objectAttributes bits that an identity key must have: it never leaves its TPM, it
/// was generated there, and it signs.
const IDENTITY_REQUIRED: u32 = 0x0000_0002 | 0x0000_0010 | 0x0000_0020 | 0x0004_0000;
/// The objectAttributes bits that it must not have: restricted (it signs what it is given)
/// and decrypt (one key, one purpose).
const IDENTITY_FORBIDDEN: u32 = 0x0001_0000 | 0x0002_0000;

/// TPMA_OBJECT's bits, named as TPM 2.0 Part 2 names them.
const ATTRIBUTE_NAMES: [(u32, &str); 11] = [
    (0x0000_0002, "fixedTPM"),
    (0x0000_0004, "stClear"),
    (0x0000_0010, "fixedParent"),
    (0x0000_0020, "sensitiveDataOrigin"),
    (0x0000_0040, "userWithAuth"),
    (0x0000_0080, "adminWithPolicy"),
    (0x0000_0400, "noDA"),
    (0x0000_0800, "encryptedDuplication"),
    (0x0001_0000, "restricted"),
    (0x0002_0000, "decrypt"),
    (0x0004_0000, "sign"),
];

/// A TPM key's public area: an ECC NIST P-256 key with a SHA-256 name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicKey {
    /// The marshalled TPMT_PUBLIC, which the key's name hashes.
    tpmt_public: Vec<u8>,
    object_attributes: u32,
    auth_policy: Vec<u8>,
    parameters: TpmsEccParms,
    x: [u8; 32],
    y: [u8; 32],
}

impl PublicKey {
    /// Parses a marshalled TPM2B_PUBLIC (with its 2-byte size), as
    /// [`crate::device::Key::public`] holds it. Only ECC NIST P-256 keys named with SHA-256
    /// are accepted.
    pub fn parse(tpm2b_public: &[u8]) -> Result<Self, Error> {
        let public = match Tpm2bPublic::unmarshal(tpm2b_public) {
            Ok((public, [])) => public.inner,
            Ok((_, rest)) => {
                return Err(Error::Malformed(format!("{} bytes after it", rest.len())))
            }
            Err(e) => return Err(Error::Malformed(e.to_string())),
        };
        if public.object_type != TpmAlgId::Ecc {
            return Err(Error::Unsupported(format!(
                "a {} key, not ECC NIST P-256",
                public.object_type
            )));
        }
        if public.name_alg != TpmAlgId::Sha256 {
            return Err(Error::Unsupported(format!(
                "name algorithm {}, not TPM_ALG_SHA256",
                public.name_alg
            )));
        }
        let (TpmuPublicParms::Ecc(parameters), TpmuPublicId::Ecc(point)) =
            (public.parameters, &public.unique)
        else {
            return Err(Error::Malformed("ECC key without ECC parameters".into()));
        };
        if parameters.curve_id != TpmEccCurve::NistP256 {
            return Err(Error::Unsupported(format!(
                "curve {}, not TPM_ECC_NIST_P256",
                parameters.curve_id
            )));
        }
        // A TPM writes P-256 coordinates at their full 32 bytes, leading zeros included.
        let coordinate = |value: &[u8], which: &str| {
            <[u8; 32]>::try_from(value)
                .map_err(|_| Error::Malformed(format!("{which} is {} bytes, not 32", value.len())))
        };
        Ok(Self {
            // The unmarshal above consumed all of it: the size, then the TPMT_PUBLIC.
            tpmt_public: tpm2b_public[2..].to_vec(),
            object_attributes: public.object_attributes.bits(),
            auth_policy: public.auth_policy.to_vec(),
            parameters,
            x: coordinate(&point.x, "x")?,
            y: coordinate(&point.y, "y")?,
        })
    }

    /// The key's TPM name: nameAlg (TPM_ALG_SHA256) || SHA-256(TPMT_PUBLIC), what
    /// [`make_credential`] binds a credential to.
    pub fn name(&self) -> Vec<u8> {
        let mut name = TpmAlgId::Sha256.value().to_be_bytes().to_vec();
        name.extend_from_slice(digest::digest(&digest::SHA256, &self.tpmt_public).as_ref());
        name
    }

    /// "sha256:" and the lowercase hex SHA-256 of the TPMT_PUBLIC: what an administrator
    /// compares at enrolment.
    pub fn fingerprint(&self) -> String {
        let digest = digest::digest(&digest::SHA256, &self.tpmt_public);
        let hex: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        format!("sha256:{hex}")
    }

    /// Whether this is an endorsement key made from the TCG EK Credential Profile's
    /// default ECC P-256 template (L-2): a restricted decryption key that never leaves its
    /// TPM, usable only with the endorsement hierarchy's authorization, protecting with
    /// AES-128-CFB.
    pub fn check_endorsement_key(&self) -> Result<(), Error> {
        let wrong = |why: String| Error::Template {
            role: ENDORSEMENT_KEY,
            why,
        };
        check_attributes(
            self.object_attributes,
            crate::EK_ATTRIBUTES,
            !crate::EK_ATTRIBUTES,
        )
        .map_err(wrong)?;
        if self.auth_policy != crate::EK_AUTH_POLICY {
            return Err(wrong(
                "its authPolicy is not PolicySecret(TPM_RH_ENDORSEMENT)".into(),
            ));
        }
        if self.parameters.symmetric != crate::aes_128_cfb() {
            return Err(wrong("its symmetric algorithm is not AES-128-CFB".into()));
        }
        Ok(())
    }

    /// Whether this is a signing key fit to be a machine's identity: it never leaves its
    /// TPM, was generated there, signs with ECDSA-SHA256, and neither decrypts nor is
    /// restricted.
    pub fn check_identity_key(&self) -> Result<(), Error> {
        let wrong = |why: String| Error::Template {
            role: IDENTITY_KEY,
            why,
        };
        check_attributes(
            self.object_attributes,
            IDENTITY_REQUIRED,
            IDENTITY_FORBIDDEN,
        )
        .map_err(wrong)?;
        if self.parameters.scheme != crate::ecdsa_sha256() {
            return Err(wrong("its signing scheme is not ECDSA with SHA-256".into()));
        }
        Ok(())
    }

    /// Whether `signature` (r || s) is this key's ECDSA P-256 signature of the SHA-256 of
    /// `message`.
    pub fn verify(&self, message: &[u8], signature: &[u8; 64]) -> bool {
        signature::UnparsedPublicKey::new(&signature::ECDSA_P256_SHA256_FIXED, self.point())
            .verify(message, signature)
            .is_ok()
    }

    /// The uncompressed SEC 1 point: 04 || x || y.
    fn point(&self) -> Vec<u8> {
        [&[0x04][..], &self.x, &self.y].concat()
    }
}

/// Makes a credential for the TPM holding `ek`, to be released only for the key named
/// `object_name` (see [`PublicKey::name`]): TPM2_MakeCredential in software. Returns the
/// marshalled TPM2B_ID_OBJECT and TPM2B_ENCRYPTED_SECRET that
/// [`crate::device::Tpm::activate_credential`] takes. `secret` is at most 32 bytes.
pub fn make_credential(
    ek: &PublicKey,
    object_name: &[u8],
    secret: &[u8],
) -> Result<(Vec<u8>, Vec<u8>), Error> {
    if secret.len() > 32 {
        return Err(Error::Credential(format!(
            "the secret is {} bytes, more than 32",
            secret.len()
        )));
    }
    if ek.parameters.symmetric != crate::aes_128_cfb() {
        return Err(Error::Credential(
            "the endorsement key does not protect with AES-128-CFB".into(),
        ));
    }

    // One-pass Diffie-Hellman with an ephemeral key (Part 1 Annex C): Z is the
    // x-coordinate of e·EK, and the seed is KDFe(Z, "IDENTITY", ephemeral x, EK x). The
    // TPM gets the ephemeral point and redoes it with the EK's private key.
    let rng = SystemRandom::new();
    let ephemeral = agreement::EphemeralPrivateKey::generate(&agreement::ECDH_P256, &rng)
        .map_err(|_| Error::Credential("no random numbers".into()))?;
    let ephemeral_public = ephemeral
        .compute_public_key()
        .map_err(|_| Error::Credential("no ephemeral public key".into()))?;
    let (ephemeral_x, ephemeral_y) = ephemeral_public.as_ref()[1..].split_at(32);
    let ek_point = agreement::UnparsedPublicKey::new(&agreement::ECDH_P256, ek.point());
    let seed = agreement::agree_ephemeral(ephemeral, &ek_point, |z| {
        kdfe(z, b"IDENTITY", ephemeral_x, &ek.x, 32)
    })
    .map_err(|_| Error::Credential("the endorsement key is not a point on P-256".into()))?;
    // A TPMS_ECC_POINT is two TPM2B_ECC_PARAMETERs.
    let point = [
        tpm2b::<Tpm2bEccParameter>(ephemeral_x)?,
        tpm2b::<Tpm2bEccParameter>(ephemeral_y)?,
    ]
    .concat();
    let encrypted_secret = tpm2b::<Tpm2bEncryptedSecret>(&point)?;

    // The secret, encrypted with a key that only the seed and the object's name give.
    let sym_key = kdfa(&seed, b"STORAGE", object_name, &[], 16);
    let mut enc_identity = tpm2b::<Tpm2bDigest>(secret)?;
    cfb_mode::Encryptor::<Aes128>::new_from_slices(&sym_key, &[0; 16])
        .map_err(|_| Error::Credential("bad AES-128 key length".into()))?
        .encrypt(&mut enc_identity);

    // The outer HMAC over the encrypted secret and the name: a credential for another
    // name, or a changed one, fails its integrity check in the TPM.
    let hmac_key = kdfa(&seed, b"INTEGRITY", &[], &[], 32);
    let mut outer = hmac::Context::with_key(&hmac::Key::new(hmac::HMAC_SHA256, &hmac_key));
    outer.update(&enc_identity);
    outer.update(object_name);
    let outer_hmac = tpm2b::<Tpm2bDigest>(outer.sign().as_ref())?;

    let id_object = tpm2b::<Tpm2bIdObject>(&[outer_hmac, enc_identity].concat())?;
    Ok((id_object, encrypted_secret))
}

/// A TPM2B of type `T` holding `bytes`: their size (2 bytes), then them.
fn tpm2b<T>(bytes: &[u8]) -> Result<Vec<u8>, Error>
where
    T: for<'a> TryFrom<&'a [u8], Error = TpmError> + TpmMarshal,
{
    T::try_from(bytes)
        .and_then(|value| crate::marshal(&value))
        .map_err(|e| Error::Credential(format!("cannot encode: {e}")))
}

/// Describes what `attributes` lacks of `required` and has of `forbidden`.
fn check_attributes(attributes: u32, required: u32, forbidden: u32) -> Result<(), String> {
    let missing = required & !attributes;
    let unexpected = forbidden & attributes;
    if missing == 0 && unexpected == 0 {
        return Ok(());
    }
    let mut why = format!("its objectAttributes are {attributes:#010x}");
    if missing != 0 {
        why += &format!(", without {}", attribute_names(missing));
    }
    if unexpected != 0 {
        why += &format!(", with {}", attribute_names(unexpected));
    }
    Err(why)
}

/// "fixedTPM|sign", and any bit Part 2 does not name in hex.
fn attribute_names(bits: u32) -> String {
    let named = ATTRIBUTE_NAMES.iter().fold(0, |all, (bit, _)| all | bit);
    let mut names: Vec<String> = ATTRIBUTE_NAMES
        .iter()
        .filter(|(bit, _)| bits & bit != 0)
        .map(|(_, name)| (*name).to_owned())
        .collect();
    if bits & !named != 0 {
        names.push(format!("{:#010x}", bits & !named));
    }
    names.join("|")
}

/// KDFa with SHA-256 (TPM 2.0 Part 1 §11.4.10.2, SP 800-108 counter mode with HMAC):
/// `bytes` of HMAC(key, [i]32 || label || 00 || contextU || contextV || [bits]32).
/// `label` is given without its terminating zero, and the zero is added: the reference
/// implementation's labels ("STORAGE" and the like) carry theirs, and it adds one only to
/// a label without, so the same bytes are hashed.
fn kdfa(key: &[u8], label: &[u8], context_u: &[u8], context_v: &[u8], bytes: u32) -> Vec<u8> {
    let key = hmac::Key::new(hmac::HMAC_SHA256, key);
    derive(bytes, |counter| {
        let mut block = hmac::Context::with_key(&key);
        for part in [
            &counter[..],
            label,
            &[0],
            context_u,
            context_v,
            &(bytes * 8).to_be_bytes(),
        ] {
            block.update(part);
        }
        block.sign().as_ref().to_vec()
    })
}

/// KDFe with SHA-256 (TPM 2.0 Part 1 §11.4.10.3, SP 800-56A's concatenation KDF):
/// `bytes` of SHA-256([i]32 || Z || label || 00 || partyUInfo || partyVInfo), the label
/// zero-terminated as in [`kdfa`].
fn kdfe(z: &[u8], label: &[u8], party_u: &[u8], party_v: &[u8], bytes: u32) -> Vec<u8> {
    derive(bytes, |counter| {
        let mut block = digest::Context::new(&digest::SHA256);
        for part in [&counter[..], z, label, &[0], party_u, party_v] {
            block.update(part);
        }
        block.finish().as_ref().to_vec()
    })
}

/// Concatenates `block(1)`, `block(2)`, … (the big-endian counter) up to `bytes`.
fn derive(bytes: u32, block: impl Fn(&[u8; 4]) -> Vec<u8>) -> Vec<u8> {
    let len = bytes as usize;
    let mut out = Vec::with_capacity(len + 32);
    let mut counter = 1u32;
    while out.len() < len {
        out.extend(block(&counter.to_be_bytes()));
        counter += 1;
    }
    out.truncate(len);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tpm2_protocol::data::{Tpm2bPublicKeyRsa, TpmsRsaParms, TpmtPublic};

    fn tpm2b(public: TpmtPublic) -> Vec<u8> {
        crate::marshal(&Tpm2bPublic::from(public)).unwrap()
    }

    /// The key a TPM makes from the template has the template's public area, with the
    /// point the TPM derived in unique instead: that is what the checks read.
    #[test]
    fn the_templates_pass_their_own_checks_only() {
        let ek = PublicKey::parse(&tpm2b(crate::endorsement_template().unwrap())).unwrap();
        let identity = PublicKey::parse(&tpm2b(crate::identity_template().unwrap())).unwrap();
        ek.check_endorsement_key().unwrap();
        identity.check_identity_key().unwrap();
        assert!(ek.check_identity_key().is_err());
        assert!(identity.check_endorsement_key().is_err());
    }

    #[test]
    fn other_key_kinds_are_refused_by_name() {
        let mut p384 = crate::endorsement_template().unwrap();
        if let TpmuPublicParms::Ecc(parameters) = &mut p384.parameters {
            parameters.curve_id = TpmEccCurve::NistP384;
        }
        assert_eq!(
            PublicKey::parse(&tpm2b(p384)).unwrap_err().to_string(),
            "unsupported TPM key: curve TPM_ECC_NIST_P384, not TPM_ECC_NIST_P256"
        );
        let rsa = TpmtPublic {
            object_type: TpmAlgId::Rsa,
            name_alg: TpmAlgId::Sha256,
            parameters: TpmuPublicParms::Rsa(TpmsRsaParms::default()),
            unique: TpmuPublicId::Rsa(Tpm2bPublicKeyRsa::try_from(&[0xA5; 256][..]).unwrap()),
            ..Default::default()
        };
        assert_eq!(
            PublicKey::parse(&tpm2b(rsa)).unwrap_err().to_string(),
            "unsupported TPM key: a TPM_ALG_RSA key, not ECC NIST P-256"
        );
    }

    proptest! {
        #[test]
        fn parse_never_panics_on_arbitrary_bytes(
            bytes in proptest::collection::vec(any::<u8>(), 0..200),
        ) {
            let _ = PublicKey::parse(&bytes);
        }

        /// Changed bytes in a well-formed public area reach the deeper parsing.
        #[test]
        fn parse_never_panics_on_a_changed_public_area(
            changes in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        ) {
            let mut public = tpm2b(crate::identity_template().unwrap());
            for (at, byte) in changes {
                let at = at.index(public.len());
                public[at] = byte;
            }
            let _ = PublicKey::parse(&public);
        }
    }

    fn hex(text: &str) -> Vec<u8> {
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
            .collect()
    }

    /// The TPM reference implementation's KDFa self-test vector for SHA-256
    /// (KdfTestData.h, as libtpms ships it): key, label "KDFSELFTESTLABEL", contextU,
    /// contextV, 160 bits out.
    #[test]
    fn kdfa_matches_the_reference_self_test() {
        let key = hex("271fa08bbdc5060ec3dfa928ff9b73123a12da0c");
        let out = kdfa(
            &key,
            b"KDFSELFTESTLABEL",
            &hex("ce244f395dca7391"),
            &hex("da504031ddf12e83"),
            20,
        );
        assert_eq!(out, hex("bb0259e1c8ba607e6a2cd704b69a902e9ade84c4"));
    }

    /// A KDFe vector from go-tpm's implementation (chrisfenner/tpm-test-vectors,
    /// vectors/kdfe.json, "35_SHA256_336"): two SHA-256 blocks, the second cut short. Not
    /// made by a TPM; the swtpm credential round trip checks KDFe against a real one.
    #[test]
    fn kdfe_matches_go_tpm() {
        let out = kdfe(
            &hex("8995a6318a0217c7c7bf543f50da29016c4ff2a1ea5daf54ebcb00"),
            b"INTEGRITY",
            &hex("8852f14d8e9b68"),
            &hex("74ff"),
            42,
        );
        assert_eq!(
            out,
            hex("92343ef558feb95fd14838f9ca39c8618598a7eeb31af7fc276030b8c3ff326d4870f190e54abbec9da4")
        );
    }

    #[test]
    fn attributes_are_named() {
        assert_eq!(
            check_attributes(0x0006_0072, IDENTITY_REQUIRED, IDENTITY_FORBIDDEN),
            Err("its objectAttributes are 0x00060072, with decrypt".to_owned())
        );
        assert_eq!(
            check_attributes(0x0008_0040, 0x2, 0x0008_0040),
            Err("its objectAttributes are 0x00080040, without fixedTPM, with userWithAuth|0x00080000".to_owned())
        );
    }
}
