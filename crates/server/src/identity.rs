//! Machine identity at boot (`vdstream server --identity-ca DIR`, docs/IDENTITY.md): a
//! machine proves that its TPM holds the target's key, and gets a short-lived client
//! certificate for a TLS key it made in its RAM.
//!
//! 1. `challenge`: the machine shows its endorsement key (EK) and its identity key, both
//!    TPM2B_PUBLIC. The server checks their templates (the identity key is fixedTPM: it can
//!    never leave the TPM), and makes a credential for the identity key's name under the EK
//!    (TPM2_MakeCredential, in software): only a TPM that holds both keys can activate it.
//!    The secret and a fresh nonce are kept in memory for [`CHALLENGE_TTL`], once.
//! 2. `prove`: the machine returns the activated secret and the identity key's signature
//!    over the target, the nonce, the secret and its TLS key. The server checks both, then
//!    asks the store's enrolment (pending, approved or refused), and for an approved key
//!    issues the certificate from the CA folder.
//!
//! Invariants:
//! - A challenge is used once and expires; at most [`MAX_CHALLENGES`] are kept (the oldest
//!   go first), so unauthenticated machines cannot fill the server's memory.
//! - Nothing is certified without a valid activation and signature for the very key the
//!   store approved for that target; a failed proof changes nothing in the store.
//! - The CA folder is opened (and locked) for each certificate only, so `vdstream pki`
//!   commands on it are not shut out while the server runs.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use subtle::ConstantTimeEq;
use vdstream_contract::enrolment::{
    proof_message, Challenge, ChallengeRequest, EnrolmentState, ProofAnswer, ProofRequest,
};
use vdstream_store::identities::{ProofOutcome, TpmKey};
use vdstream_store::{Store, StoreError};
use vdstream_tpm::credential::{self, PublicKey};

/// How long a challenge may be answered.
pub const CHALLENGE_TTL: Duration = Duration::from_secs(60);
/// Challenges kept at once, at most.
pub const MAX_CHALLENGES: usize = 4096;
/// Default `--identity-cert-lifetime`: a machine proves itself again at every boot.
pub const DEFAULT_CERT_LIFETIME: Duration = Duration::from_secs(24 * 3600);

/// `--identity-ca` and its lifetime.
#[derive(Debug, Clone)]
pub struct IdentityConfig {
    /// A `vdstream pki` CA folder (its key signs the machines' certificates).
    pub ca_dir: PathBuf,
    pub cert_lifetime: Duration,
}

/// What went wrong, by who must act.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The request is malformed (400).
    #[error("{0}")]
    BadRequest(String),
    /// The proof failed or the enrolment refuses it (403); logged and counted.
    #[error("{0}")]
    Refused(String),
    /// The store or the CA failed (500).
    #[error("{0}")]
    Server(String),
}

impl From<StoreError> for IdentityError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::UnknownTarget { .. } | StoreError::BadName(_) => {
                IdentityError::BadRequest(format!("no target record: {e}"))
            }
            e => IdentityError::Server(e.to_string()),
        }
    }
}

struct Pending {
    target: String,
    key: PublicKey,
    key_text: String,
    endorsement_key: TpmKey,
    secret: [u8; 32],
    nonce: [u8; 32],
    made: Instant,
}

/// The identity service's counters, for `/metrics`.
#[derive(Debug, Default)]
pub struct IdentityCounters {
    pub challenges: AtomicU64,
    pub approved: AtomicU64,
    pub pending: AtomicU64,
    pub refused: AtomicU64,
}

/// The challenges in flight and the configuration.
pub struct IdentityService {
    pub config: IdentityConfig,
    challenges: Mutex<HashMap<String, Pending>>,
    pub counters: IdentityCounters,
}

impl std::fmt::Debug for IdentityService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdentityService")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn random<const N: usize>() -> Result<[u8; N], IdentityError> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| {
        IdentityError::Server(format!("the system's random number generator failed: {e}"))
    })?;
    Ok(b)
}

fn decode(what: &str, text: &str) -> Result<Vec<u8>, IdentityError> {
    B64.decode(text.trim())
        .map_err(|e| IdentityError::BadRequest(format!("{what} is not base64: {e}")))
}

fn tpm_key(key: &PublicKey, text: &str) -> TpmKey {
    TpmKey {
        fingerprint: key.fingerprint(),
        public: text.to_string(),
    }
}

impl IdentityService {
    pub fn new(config: IdentityConfig) -> IdentityService {
        IdentityService {
            config,
            challenges: Mutex::new(HashMap::new()),
            counters: IdentityCounters::default(),
        }
    }

    /// Step 1: a credential for the machine's identity key under its EK, and a nonce.
    pub fn challenge(
        &self,
        target: &str,
        req: &ChallengeRequest,
    ) -> Result<Challenge, IdentityError> {
        let bad =
            |what: &str, e: credential::Error| IdentityError::BadRequest(format!("{what}: {e}"));
        let ek_bytes = decode("endorsement_key", &req.endorsement_key)?;
        let key_bytes = decode("key", &req.key)?;
        let ek = PublicKey::parse(&ek_bytes).map_err(|e| bad("the endorsement key", e))?;
        ek.check_endorsement_key()
            .map_err(|e| bad("the endorsement key", e))?;
        let key = PublicKey::parse(&key_bytes).map_err(|e| bad("the identity key", e))?;
        key.check_identity_key()
            .map_err(|e| bad("the identity key", e))?;
        let secret = random::<32>()?;
        let nonce = random::<32>()?;
        let (credential, encrypted) = credential::make_credential(&ek, &key.name(), &secret)
            .map_err(|e| bad("the endorsement key", e))?;
        let id = hex(&random::<16>()?);
        let fingerprint = key.fingerprint();
        let pending = Pending {
            target: target.to_string(),
            endorsement_key: tpm_key(&ek, req.endorsement_key.trim()),
            key_text: req.key.trim().to_string(),
            key,
            secret,
            nonce,
            made: Instant::now(),
        };
        {
            let mut map = self.challenges.lock().unwrap_or_else(|p| p.into_inner());
            map.retain(|_, p| p.made.elapsed() < CHALLENGE_TTL);
            if map.len() >= MAX_CHALLENGES {
                if let Some(oldest) = map
                    .iter()
                    .min_by_key(|(_, p)| p.made)
                    .map(|(k, _)| k.clone())
                {
                    map.remove(&oldest);
                }
            }
            map.insert(id.clone(), pending);
        }
        self.counters.challenges.fetch_add(1, Ordering::Relaxed);
        Ok(Challenge {
            challenge: id,
            credential: B64.encode(credential),
            secret: B64.encode(encrypted),
            nonce: B64.encode(nonce),
            fingerprint,
        })
    }

    /// Step 2 (blocks: the store and the CA): checks the activation and the signature,
    /// then the enrolment; an approved key gets its certificate.
    pub fn prove(
        &self,
        store: &Store,
        target: &str,
        req: &ProofRequest,
        mac: Option<String>,
        peer: &str,
    ) -> Result<ProofAnswer, IdentityError> {
        let pending = self
            .challenges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(req.challenge.trim())
            .filter(|p| p.made.elapsed() < CHALLENGE_TTL)
            .ok_or_else(|| {
                IdentityError::BadRequest(format!(
                    "challenge {:?} is unknown, used or expired (they last {} s): ask a new one",
                    req.challenge,
                    CHALLENGE_TTL.as_secs()
                ))
            })?;
        if pending.target != target {
            return Err(self.refused(format!(
                "the challenge was made for target {}, not {target}",
                pending.target
            )));
        }
        let secret = decode("secret", &req.secret)?;
        let tls_key = decode("tls_key", &req.tls_key)?;
        let signature: [u8; 64] = decode("signature", &req.signature)?
            .try_into()
            .map_err(|_| IdentityError::BadRequest("signature is not 64 bytes (r‖s)".into()))?;
        let fingerprint = pending.key.fingerprint();
        if !bool::from(secret.as_slice().ct_eq(pending.secret.as_slice())) {
            return Err(self.refused(format!(
                "target {target}: the credential for key {fingerprint} was not activated (the machine's TPM does not hold that key under that endorsement key)"
            )));
        }
        let message = proof_message(target, &pending.nonce, &secret, &tls_key);
        if !pending.key.verify(&message, &signature) {
            return Err(self.refused(format!(
                "target {target}: the signature is not key {fingerprint}'s"
            )));
        }
        let outcome = store.prove_identity(
            target,
            tpm_key(&pending.key, &pending.key_text),
            pending.endorsement_key.clone(),
            mac,
            Some(peer.to_string()),
        )?;
        match outcome {
            ProofOutcome::Approved(_) => {
                let ca = vdstream_tls::pki::Ca::open(&self.config.ca_dir)
                    .map_err(|e| IdentityError::Server(format!("the identity CA: {e}")))?;
                let (certificate, record) = ca
                    .issue_for_key(target, &tls_key, self.config.cert_lifetime)
                    .map_err(|e| match e {
                        vdstream_tls::pki::PkiError::BadInput(m) => IdentityError::BadRequest(m),
                        e => IdentityError::Server(format!("the identity CA: {e}")),
                    })?;
                self.counters.approved.fetch_add(1, Ordering::Relaxed);
                log::info!(
                    "identity: target {target} ({peer}) proved key {fingerprint}; certificate {} until {}",
                    record.serial,
                    record.not_after
                );
                Ok(ProofAnswer {
                    state: EnrolmentState::Approved,
                    fingerprint,
                    certificate: Some(certificate),
                    ca: Some(ca.cert_pem().to_string()),
                    not_after: Some(record.not_after),
                    message: format!(
                        "identity of {target} proved; certificate until {}",
                        record.not_after
                    ),
                })
            }
            ProofOutcome::Pending(_) => {
                self.counters.pending.fetch_add(1, Ordering::Relaxed);
                log::info!(
                    "identity: target {target} ({peer}) proved key {fingerprint}; pending: `vdstream target identity approve {target} --fingerprint {fingerprint}`"
                );
                Ok(ProofAnswer {
                    state: EnrolmentState::Pending,
                    message: format!("{target} waits for an administrator to approve key {fingerprint} (vdstream target identity approve {target})"),
                    fingerprint,
                    certificate: None,
                    ca: None,
                    not_after: None,
                })
            }
            ProofOutcome::Refused(_, why) => Err(self.refused(why)),
        }
    }

    fn refused(&self, why: String) -> IdentityError {
        self.counters.refused.fetch_add(1, Ordering::Relaxed);
        log::warn!("identity: refused: {why}");
        IdentityError::Refused(why)
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl IdentityConfig {
    /// Whether the CA folder opens (at the server's start, so that a wrong path fails
    /// there rather than at the first machine's boot).
    pub fn check(&self) -> Result<(), String> {
        vdstream_tls::pki::Ca::open(&self.ca_dir)
            .map(drop)
            .map_err(|e| format!("--identity-ca {}: {e}", self.ca_dir.display()))
    }
}
