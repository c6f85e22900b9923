//! Enrolments: the TPM key each target proved, and whether an administrator approved it
//! (docs/IDENTITY.md; the record type is `vdstream_contract::enrolment::Enrolment`).
//!
//! ```text
//! STORE/identities/ID.json   one Enrolment, mode 0600, written atomically under the exclusive store lock
//! ```
//!
//! Invariants:
//! - An enrolment exists only for a target that has a record; `target remove` removes it.
//! - Every change is made under the exclusive store lock, written atomically and audited
//!   (`identity.pending`, `identity.approve`, `identity.revoke`, `identity.refused`), except
//!   the time of an approved key's proof, which every boot updates.
//! - An approved enrolment changes its key only through an administrator: a proof with
//!   another key is refused and counted, never recorded as the target's.
//! - A key approved for one target is refused for every other: one machine, one target.
//! - The store never sees a private key: a key here is the public area the TPM showed.

use std::path::PathBuf;

use serde_json::json;

use crate::error::{io, Result, StoreError};
use crate::fsutil::{self, LockMode};
use crate::meta::{load_json, FORMAT_VERSION};
use crate::names::validate_target_id;
use crate::store::Store;
use crate::time::Timestamp;

pub use vdstream_contract::enrolment::{
    Enrolment, EnrolmentState, ProofOutcome, TpmKey, ENROLMENT_FORMAT,
};
pub use vdstream_contract::time::Stamp;

const RECORD_ADVICE: &str =
    "remove it (`vdstream target identity reset ID`) and approve the machine's key again";

/// Whether `text` is a key fingerprint as [`TpmKey::fingerprint`] writes it.
pub fn check_fingerprint(text: &str) -> Result<String> {
    let t = text.trim().to_ascii_lowercase();
    let ok = t
        .strip_prefix("sha256:")
        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()));
    if ok {
        Ok(t)
    } else {
        Err(StoreError::BadInput(format!(
            "{text:?} is not a key fingerprint: it is `sha256:` and 64 hex digits, as the machine's console and `vdstream target identity list` show it"
        )))
    }
}

impl Store {
    pub fn identities_dir(&self) -> PathBuf {
        self.root().join("identities")
    }

    fn identity_path(&self, id: &str) -> PathBuf {
        self.identities_dir().join(format!("{id}.json"))
    }

    /// Loads an enrolment; the caller holds the lock. `None`: the target has none.
    fn load_identity(&self, id: &str) -> Result<Option<Enrolment>> {
        validate_target_id(id)?;
        let path = self.identity_path(id);
        if !path.exists() {
            return Ok(None);
        }
        let e: Enrolment = load_json(&path, RECORD_ADVICE)?;
        if e.format != ENROLMENT_FORMAT || e.format_version != FORMAT_VERSION || e.target != id {
            return Err(StoreError::Corrupt {
                path,
                detail: format!(
                    "format {:?} version {} for target {:?}, expected {ENROLMENT_FORMAT:?} version {FORMAT_VERSION} for {id:?}",
                    e.format, e.format_version, e.target
                ),
                advice: RECORD_ADVICE.into(),
            });
        }
        Ok(Some(e))
    }

    fn write_identity(&self, e: &Enrolment) -> Result<()> {
        fsutil::create_dir_all(&self.identities_dir())?;
        let bytes = serde_json::to_vec_pretty(e).expect("an enrolment serializes");
        fsutil::write_atomic_mode(&self.identity_path(&e.target), &bytes, 0o600)
    }

    /// The enrolment of target `id`, if it has one.
    pub fn identity(&self, id: &str) -> Result<Option<Enrolment>> {
        let _l = self.lock(LockMode::Shared)?;
        self.load_identity(id)
    }

    /// Every enrolment, sorted by target id.
    pub fn identities(&self) -> Result<Vec<Enrolment>> {
        let _l = self.lock(LockMode::Shared)?;
        let mut out = Vec::new();
        for id in self.target_ids()? {
            if let Some(e) = self.load_identity(&id)? {
                out.push(e);
            }
        }
        Ok(out)
    }

    fn blank_identity(id: &str) -> Enrolment {
        Enrolment {
            format: ENROLMENT_FORMAT.into(),
            format_version: FORMAT_VERSION,
            target: id.into(),
            state: EnrolmentState::Pending,
            key: None,
            endorsement_key: None,
            expected_fingerprint: None,
            mac: None,
            peer: None,
            first_proof: None,
            last_proof: None,
            approved: None,
            revoked: None,
            refused: 0,
        }
    }

    /// A machine proved that its TPM holds `key` (the server checked the credential
    /// activation against `endorsement_key` and a fresh signature): records it as the
    /// target's pending key, or says whether it is the approved one.
    pub fn prove_identity(
        &self,
        id: &str,
        key: TpmKey,
        endorsement_key: TpmKey,
        mac: Option<String>,
        peer: Option<String>,
    ) -> Result<ProofOutcome> {
        validate_target_id(id)?;
        let _l = self.lock(LockMode::Exclusive)?;
        let record = self.load_target(id)?;
        let now = Timestamp::now();
        let mut e = self
            .load_identity(id)?
            .unwrap_or_else(|| Self::blank_identity(id));
        let same_key = e.key.as_ref().map(|k| &k.fingerprint) == Some(&key.fingerprint);
        let refuse = |mut e: Enrolment, why: String| -> Result<ProofOutcome> {
            e.refused += 1;
            self.write_identity(&e)?;
            self.audit(
                "identity.refused",
                &record.vdisk,
                json!({"target": id, "fingerprint": key.fingerprint, "mac": mac, "peer": peer, "why": why}),
            )?;
            Ok(ProofOutcome::Refused(e, why))
        };
        match e.state {
            EnrolmentState::Revoked => {
                let why = format!(
                    "target {id}'s identity is revoked: an administrator approves a key again with `vdstream target identity approve {id}`"
                );
                return refuse(e, why);
            }
            EnrolmentState::Approved if e.key.is_none() => {
                // Pre-enrolled by fingerprint: the first proof of that key completes it.
                if e.expected_fingerprint.as_deref() != Some(key.fingerprint.as_str()) {
                    let why = format!(
                        "target {id} was approved for key {} and this machine's key is {}",
                        e.expected_fingerprint.as_deref().unwrap_or("?"),
                        key.fingerprint
                    );
                    return refuse(e, why);
                }
                e.key = Some(key.clone());
                e.endorsement_key = Some(endorsement_key);
                e.expected_fingerprint = None;
            }
            EnrolmentState::Approved if !same_key => {
                let why = format!(
                    "target {id} has another approved key ({}); this machine's key is {}: a second machine with this target's MAC, or a machine whose TPM was cleared (`vdstream target identity approve {id} --fingerprint {}` if it is the same machine)",
                    e.key.as_ref().map_or("?", |k| k.fingerprint.as_str()),
                    key.fingerprint,
                    key.fingerprint
                );
                return refuse(e, why);
            }
            EnrolmentState::Approved => {}
            EnrolmentState::Pending => {
                if !same_key {
                    // One machine is one target: a key approved for another target cannot
                    // wait as this one's too (an administrator would not see it twice).
                    if let Some(other) = self.approved_elsewhere(id, &key.fingerprint)? {
                        let why = format!(
                            "this machine's key {} is approved for target {other}: a machine proves one target (boot it as {other}, or reset that enrolment first)",
                            key.fingerprint
                        );
                        return refuse(e, why);
                    }
                    // A new pending key (or another machine's, replacing the one that waited):
                    // the administrator compares the fingerprint before approving.
                    e.key = Some(key.clone());
                    e.endorsement_key = Some(endorsement_key);
                    e.first_proof = Some(now);
                    e.mac = mac.clone();
                    e.peer = peer.clone();
                    e.last_proof = Some(now);
                    self.write_identity(&e)?;
                    self.audit(
                        "identity.pending",
                        &record.vdisk,
                        json!({"target": id, "fingerprint": key.fingerprint, "mac": mac, "peer": peer}),
                    )?;
                    return Ok(ProofOutcome::Pending(e));
                }
            }
        }
        e.first_proof.get_or_insert(now);
        e.last_proof = Some(now);
        e.mac = mac;
        e.peer = peer;
        self.write_identity(&e)?;
        Ok(match e.state {
            EnrolmentState::Approved => ProofOutcome::Approved(e),
            _ => ProofOutcome::Pending(e),
        })
    }

    /// The target other than `id` whose approved key is `fingerprint`; the caller holds the
    /// lock.
    fn approved_elsewhere(&self, id: &str, fingerprint: &str) -> Result<Option<String>> {
        for other in self.target_ids()? {
            if other == id {
                continue;
            }
            if let Some(e) = self.load_identity(&other)? {
                let matches = e.key.as_ref().map(|k| k.fingerprint.as_str()) == Some(fingerprint)
                    || e.expected_fingerprint.as_deref() == Some(fingerprint);
                if e.state == EnrolmentState::Approved && matches {
                    return Ok(Some(other));
                }
            }
        }
        Ok(None)
    }

    /// `target identity approve`: the pending key becomes the target's (it must have
    /// `fingerprint` when one is given), or, with no key proved yet, the target is
    /// pre-enrolled for the key of `fingerprint`.
    pub fn approve_identity(&self, id: &str, fingerprint: Option<&str>) -> Result<Enrolment> {
        validate_target_id(id)?;
        let fingerprint = fingerprint.map(check_fingerprint).transpose()?;
        let _l = self.lock(LockMode::Exclusive)?;
        let record = self.load_target(id)?;
        let mut e = self
            .load_identity(id)?
            .unwrap_or_else(|| Self::blank_identity(id));
        let proved = e.key.as_ref().map(|k| k.fingerprint.clone());
        match (&fingerprint, &proved) {
            (None, None) => {
                return Err(StoreError::Refused(format!(
                    "target {id} has proved no key yet: boot it once (it then waits as pending), or pre-enrol it with --fingerprint sha256:… as its console shows"
                )))
            }
            (Some(f), Some(p)) if f != p => {
                if e.state == EnrolmentState::Pending {
                    return Err(StoreError::Refused(format!(
                        "target {id}'s pending key is {p}, not {f}: compare with the machine's console before approving"
                    )));
                }
                // Approved or revoked with another key: the administrator names the new one.
                e.key = None;
                e.endorsement_key = None;
                e.expected_fingerprint = Some(f.clone());
            }
            (Some(f), None) => e.expected_fingerprint = Some(f.clone()),
            _ => e.expected_fingerprint = None,
        }
        e.state = EnrolmentState::Approved;
        e.approved = Some(Stamp {
            time: Timestamp::now(),
            by: self.actor().who(),
        });
        e.revoked = None;
        self.write_identity(&e)?;
        self.audit(
            "identity.approve",
            &record.vdisk,
            json!({"target": id, "fingerprint": e.key.as_ref().map(|k| &k.fingerprint).or(e.expected_fingerprint.as_ref())}),
        )?;
        Ok(e)
    }

    /// `target identity revoke`: nothing gets a certificate or a secret for the target
    /// until a key is approved again.
    pub fn revoke_identity(&self, id: &str) -> Result<Enrolment> {
        validate_target_id(id)?;
        let _l = self.lock(LockMode::Exclusive)?;
        let record = self.load_target(id)?;
        let mut e = self
            .load_identity(id)?
            .unwrap_or_else(|| Self::blank_identity(id));
        e.state = EnrolmentState::Revoked;
        e.revoked = Some(Stamp {
            time: Timestamp::now(),
            by: self.actor().who(),
        });
        self.write_identity(&e)?;
        self.audit(
            "identity.revoke",
            &record.vdisk,
            json!({"target": id, "fingerprint": e.key.as_ref().map(|k| &k.fingerprint)}),
        )?;
        Ok(e)
    }

    /// Removes target `id`'s enrolment (with its record, or `target identity reset`); the
    /// caller holds the exclusive lock. Whether there was one.
    pub(crate) fn drop_identity(&self, id: &str) -> Result<bool> {
        let path = self.identity_path(id);
        match std::fs::remove_file(&path) {
            Ok(()) => {
                fsutil::sync_dir(&self.identities_dir())?;
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io("delete", &path)(e)),
        }
    }

    /// `target identity reset`: forgets the target's enrolment; its next proof is pending.
    pub fn reset_identity(&self, id: &str) -> Result<bool> {
        validate_target_id(id)?;
        let _l = self.lock(LockMode::Exclusive)?;
        let record = self.load_target(id)?;
        let had = self.drop_identity(id)?;
        if had {
            self.audit("identity.reset", &record.vdisk, json!({"target": id}))?;
        }
        Ok(had)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_are_checked_and_normalised() {
        let f = format!("SHA256:{}", "AB".repeat(32));
        assert_eq!(check_fingerprint(&f).unwrap(), f.to_ascii_lowercase());
        for bad in [
            "",
            "sha256:",
            "sha1:abcd",
            &format!("sha256:{}", "g".repeat(64)),
        ] {
            assert!(check_fingerprint(bad).is_err(), "{bad:?}");
        }
    }
}
