//! Enrolments against a real store: a first proof waits as pending, the administrator
//! approves it (or pre-enrols a fingerprint), another key for an approved target is refused
//! and counted, a revoked target gets nothing, and every change is in the audit trail.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use vdstream_store::identities::{EnrolmentState, ProofOutcome, TpmKey};
use vdstream_store::vdisk::NewVdisk;
use vdstream_store::{NewTarget, Store};

fn store(dir: &Path) -> Store {
    let s = Store::open_or_create(dir.join("store")).unwrap().0;
    s.create_vdisk("win", 1 << 20, NewVdisk::default()).unwrap();
    for id in ["pc1", "pc2"] {
        s.add_target(NewTarget {
            id: id.into(),
            vdisk: "win".into(),
            cache: "device-ram".into(),
            version: None,
            ram: None,
            overflow_max: None,
            description: None,
            macs: vec![],
            hostname: None,
            overflow_device: None,
        })
        .unwrap();
    }
    s
}

fn key(n: u8) -> TpmKey {
    TpmKey {
        fingerprint: format!("sha256:{}", format!("{n:02x}").repeat(32)),
        public: format!("public-{n}"),
    }
}

fn prove(s: &Store, id: &str, n: u8) -> ProofOutcome {
    s.prove_identity(
        id,
        key(n),
        key(100 + n),
        Some("52:54:00:00:00:01".into()),
        Some("10.0.2.15:40000".into()),
    )
    .unwrap()
}

fn actions(s: &Store) -> Vec<String> {
    vdstream_store::audit::read(&s.audit_path(), None, None)
        .unwrap()
        .into_iter()
        .map(|e| e.action)
        .filter(|a| a.starts_with("identity."))
        .collect()
}

#[test]
fn a_first_proof_waits_until_approved_and_then_is_the_targets_key() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    assert!(s.identity("pc1").unwrap().is_none());
    let ProofOutcome::Pending(e) = prove(&s, "pc1", 1) else {
        panic!("a first proof is pending")
    };
    assert_eq!(e.key, Some(key(1)));
    assert_eq!(e.state, EnrolmentState::Pending);
    // Proving again while pending changes nothing but the time.
    assert!(matches!(prove(&s, "pc1", 1), ProofOutcome::Pending(_)));
    // Approving with a fingerprint other than the pending key's is refused.
    let err = s
        .approve_identity("pc1", Some(&key(2).fingerprint))
        .unwrap_err()
        .to_string();
    assert!(err.contains("compare with the machine's console"), "{err}");
    let e = s
        .approve_identity(
            "pc1",
            Some(
                &key(1)
                    .fingerprint
                    .to_uppercase()
                    .replace("SHA256", "sha256"),
            ),
        )
        .unwrap();
    assert_eq!(e.state, EnrolmentState::Approved);
    assert!(matches!(prove(&s, "pc1", 1), ProofOutcome::Approved(_)));
    // The file is the owner's alone.
    let mode = std::fs::metadata(s.identities_dir().join("pc1.json"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    assert_eq!(actions(&s), ["identity.pending", "identity.approve"]);
}

#[test]
fn another_key_for_an_approved_target_is_refused_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    prove(&s, "pc1", 1);
    s.approve_identity("pc1", None).unwrap();
    let ProofOutcome::Refused(e, why) = prove(&s, "pc1", 2) else {
        panic!("a spoofer is refused")
    };
    assert!(why.contains("another approved key"), "{why}");
    assert_eq!(e.refused, 1);
    // The approved key is untouched.
    assert_eq!(s.identity("pc1").unwrap().unwrap().key, Some(key(1)));
    assert!(matches!(prove(&s, "pc1", 1), ProofOutcome::Approved(_)));
    // Another target's enrolment is its own.
    assert!(matches!(prove(&s, "pc2", 2), ProofOutcome::Pending(_)));
    assert_eq!(
        actions(&s),
        [
            "identity.pending",
            "identity.approve",
            "identity.refused",
            "identity.pending"
        ]
    );
}

#[test]
fn a_pre_enrolled_fingerprint_is_approved_at_its_first_proof_and_only_it() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let err = s.approve_identity("pc1", None).unwrap_err().to_string();
    assert!(err.contains("has proved no key yet"), "{err}");
    s.approve_identity("pc1", Some(&key(3).fingerprint))
        .unwrap();
    assert!(matches!(prove(&s, "pc1", 4), ProofOutcome::Refused(..)));
    let ProofOutcome::Approved(e) = prove(&s, "pc1", 3) else {
        panic!("the pre-enrolled key is approved")
    };
    assert_eq!(e.key, Some(key(3)));
    assert_eq!(e.expected_fingerprint, None);
}

#[test]
fn a_revoked_target_gets_nothing_until_a_key_is_approved_again() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    prove(&s, "pc1", 1);
    s.approve_identity("pc1", None).unwrap();
    s.revoke_identity("pc1").unwrap();
    let ProofOutcome::Refused(_, why) = prove(&s, "pc1", 1) else {
        panic!("revoked")
    };
    assert!(why.contains("revoked"), "{why}");
    // A replacement machine: the administrator names its key.
    s.approve_identity("pc1", Some(&key(5).fingerprint))
        .unwrap();
    assert!(matches!(prove(&s, "pc1", 1), ProofOutcome::Refused(..)));
    assert!(matches!(prove(&s, "pc1", 5), ProofOutcome::Approved(_)));
}

#[test]
fn enrolments_go_with_their_target_and_unknown_targets_have_none() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    prove(&s, "pc1", 1);
    assert!(s
        .prove_identity("nope", key(1), key(2), None, None)
        .is_err());
    assert!(s
        .prove_identity("../pc1", key(1), key(2), None, None)
        .is_err());
    assert_eq!(s.identities().unwrap().len(), 1);
    s.remove_target("pc1").unwrap();
    assert!(s.identities().unwrap().is_empty());
    assert!(!s.identities_dir().join("pc1.json").exists());
    assert!(matches!(prove(&s, "pc2", 1), ProofOutcome::Pending(_)));
    assert!(s.reset_identity("pc2").unwrap());
    assert!(s.identity("pc2").unwrap().is_none());
}

#[test]
fn a_key_approved_for_one_target_is_refused_for_another() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    prove(&s, "pc1", 1);
    s.approve_identity("pc1", None).unwrap();
    let ProofOutcome::Refused(_, why) = prove(&s, "pc2", 1) else {
        panic!("one machine, one target")
    };
    assert!(why.contains("approved for target pc1"), "{why}");
    assert!(s.identity("pc2").unwrap().unwrap().key.is_none());
    // A pre-enrolled fingerprint counts as approved too.
    s.approve_identity("pc2", Some(&key(7).fingerprint))
        .unwrap();
    assert!(matches!(prove(&s, "pc1", 7), ProofOutcome::Refused(..)));
}
