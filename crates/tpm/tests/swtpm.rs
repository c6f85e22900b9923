//! Against a real TPM 2.0: swtpm (libtpms, the TCG reference code), one per simulated
//! machine, each with its own state directory.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vdstream_tpm::credential::{make_credential, PublicKey};
use vdstream_tpm::device::{Error, Key, Tpm};

/// A running swtpm, killed on drop.
struct Swtpm {
    child: Child,
    data: PathBuf,
}

impl Swtpm {
    /// Starts swtpm on the state directory `state` (a fresh one is a new machine; the same
    /// one again is the same machine booting again) and waits for its socket.
    fn start(state: &Path) -> Self {
        let data = state.join("data");
        let ctrl = state.join("ctrl");
        // A previous swtpm on this state directory leaves its sockets behind.
        for socket in [&data, &ctrl] {
            let _ = std::fs::remove_file(socket);
        }
        let child = Command::new("swtpm")
            .arg("socket")
            .arg("--tpm2")
            .arg("--tpmstate")
            .arg(format!("dir={}", state.display()))
            .arg("--server")
            .arg(format!("type=unixio,path={}", data.display()))
            .arg("--ctrl")
            .arg(format!("type=unixio,path={}", ctrl.display()))
            .args(["--flags", "not-need-init,startup-clear"])
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run swtpm ({e}): these tests need a real TPM 2.0 simulator; scripts/test installs Debian's swtpm (apt-get install swtpm)")
            });
        let mut swtpm = Self { child, data };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !swtpm.data.exists() {
            if let Ok(Some(status)) = swtpm.child.try_wait() {
                panic!("swtpm exited at start: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "swtpm's socket did not appear in 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        swtpm
    }

    fn tpm(&self) -> Tpm {
        Tpm::connect(&self.data).expect("connect to swtpm")
    }
}

impl Drop for Swtpm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One simulated machine: its swtpm, a connection, and its two keys.
struct Machine {
    // Dropped first: the connection, then swtpm, then its state directory.
    tpm: Tpm,
    _swtpm: Swtpm,
    _state: tempfile::TempDir,
    ek: Key,
    identity: Key,
}

impl Machine {
    fn new() -> Self {
        let state = tempfile::tempdir().unwrap();
        let swtpm = Swtpm::start(state.path());
        let mut tpm = swtpm.tpm();
        let ek = tpm.endorsement_key().unwrap();
        let identity = tpm.identity_key().unwrap();
        Self {
            tpm,
            _swtpm: swtpm,
            _state: state,
            ek,
            identity,
        }
    }

    fn ek_public(&self) -> PublicKey {
        PublicKey::parse(&self.ek.public).unwrap()
    }

    fn identity_public(&self) -> PublicKey {
        PublicKey::parse(&self.identity.public).unwrap()
    }

    fn activate(&mut self, (id_object, secret): &(Vec<u8>, Vec<u8>)) -> Result<Vec<u8>, Error> {
        self.tpm
            .activate_credential(&self.identity, &self.ek, id_object, secret)
    }
}

/// The EK and identity key of a machine whose state is in `state`, created then flushed
/// (swtpm holds only three transient objects).
fn keys_of(state: &Path) -> (Vec<u8>, Vec<u8>) {
    let swtpm = Swtpm::start(state);
    let mut tpm = swtpm.tpm();
    let ek = tpm.endorsement_key().unwrap();
    tpm.flush(ek.handle).unwrap();
    let identity = tpm.identity_key().unwrap();
    tpm.flush(identity.handle).unwrap();
    (ek.public, identity.public)
}

/// An activation the TPM refused because the credential's HMAC did not check out.
fn assert_integrity_failure(result: Result<Vec<u8>, Error>) {
    let error = result.expect_err("a credential was activated").to_string();
    assert!(error.contains("TPM_RC_INTEGRITY"), "{error}");
}

/// 32 bytes from the OS's randomness.
fn random_secret() -> Vec<u8> {
    let mut secret = vec![0; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut secret).unwrap();
    secret
}

#[test]
fn keys_are_the_same_on_every_boot_and_differ_between_machines() {
    let machine = tempfile::tempdir().unwrap();
    let (ek, identity) = keys_of(machine.path());
    let (ek_again, identity_again) = keys_of(machine.path());
    assert_eq!(ek, ek_again, "the EK changed across a reboot");
    assert_eq!(
        identity, identity_again,
        "the identity key changed across a reboot"
    );

    let other = tempfile::tempdir().unwrap();
    let (other_ek, other_identity) = keys_of(other.path());
    assert_ne!(ek, other_ek, "two machines have the same EK");
    assert_ne!(
        identity, other_identity,
        "two machines have the same identity key"
    );

    let ek = PublicKey::parse(&ek).unwrap();
    let identity = PublicKey::parse(&identity).unwrap();
    ek.check_endorsement_key().unwrap();
    identity.check_identity_key().unwrap();
    assert_eq!(
        identity.check_endorsement_key().unwrap_err().to_string(),
        "not a TCG default ECC P-256 endorsement key: its objectAttributes are 0x00040472, \
         without adminWithPolicy|restricted|decrypt, with userWithAuth|noDA|sign"
    );
    assert_eq!(
        ek.check_identity_key().unwrap_err().to_string(),
        "not a vdstream identity key: its objectAttributes are 0x000300b2, \
         without sign, with restricted|decrypt"
    );

    assert_ne!(ek.fingerprint(), identity.fingerprint());
    assert!(ek.fingerprint().starts_with("sha256:"));
    assert_eq!(ek.fingerprint().len(), "sha256:".len() + 64);
    assert_eq!(&ek.name()[..2], &[0x00, 0x0B]);
}

#[test]
fn only_this_tpm_activates_a_credential_for_its_identity_key() {
    let mut machine = Machine::new();
    let mut other = Machine::new();
    let ek = machine.ek_public();
    let name = machine.identity_public().name();

    let secret = random_secret();
    let credential = make_credential(&ek, &name, &secret).unwrap();
    assert_eq!(machine.activate(&credential).unwrap(), secret);

    // Made for another TPM's EK: this TPM cannot open it.
    let for_other = make_credential(&other.ek_public(), &name, &secret).unwrap();
    assert_eq!(
        machine.activate(&for_other).unwrap_err().to_string(),
        "TPM2_ActivateCredential failed: TPM_RC 0x000001df (TPM_RC_INTEGRITY, parameter[1])"
    );
    // And the other TPM does not release it for a key that is not the named one.
    assert_integrity_failure(other.activate(&for_other));

    // Made for another key's name: the TPM releases it only for that key.
    let other_name = other.identity_public().name();
    let for_other_key = make_credential(&ek, &other_name, &secret).unwrap();
    assert_integrity_failure(machine.activate(&for_other_key));

    // Tampered with: in the outer HMAC, in the encrypted secret, in the ephemeral point.
    let (id_object, encrypted_secret) = &credential;
    for at in [4, 40, id_object.len() - 1] {
        let mut tampered = id_object.clone();
        tampered[at] ^= 0x01;
        assert_integrity_failure(machine.activate(&(tampered, encrypted_secret.clone())));
    }
    let mut tampered = encrypted_secret.clone();
    tampered[10] ^= 0x01;
    let error = machine.activate(&(id_object.clone(), tampered));
    assert!(error.unwrap_err().to_string().contains("TPM_RC_ECC_POINT"));

    // The failures above flushed their policy sessions (swtpm holds three at a time).
    let secret = random_secret();
    let credential = make_credential(&ek, &name, &secret).unwrap();
    assert_eq!(machine.activate(&credential).unwrap(), secret);

    // A secret is at most a SHA-256 digest long.
    assert!(make_credential(&ek, &name, &[0; 33]).is_err());
}

#[test]
fn signatures_verify_against_the_signing_machine_only() {
    let mut machine = Machine::new();
    let mut other = Machine::new();
    let key = machine.identity_public();

    let message = b"vdstream: machine 52:54:00:12:34:56 boots vdisk base@3";
    let signature = machine.tpm.sign(&machine.identity, message).unwrap();
    assert!(key.verify(message, &signature));
    assert!(!key.verify(
        b"vdstream: machine 52:54:00:12:34:57 boots vdisk base@3",
        &signature
    ));

    let by_other = other.tpm.sign(&other.identity, message).unwrap();
    assert!(!key.verify(message, &by_other));
    assert!(other.identity_public().verify(message, &by_other));

    // ECDSA signs with a fresh nonce: two signatures differ, both verify.
    let again = machine.tpm.sign(&machine.identity, message).unwrap();
    assert_ne!(signature, again);
    assert!(key.verify(message, &again));
}

#[test]
fn truncated_public_areas_are_rejected() {
    let machine = Machine::new();
    for public in [&machine.ek.public, &machine.identity.public] {
        for len in 0..public.len() {
            assert!(
                PublicKey::parse(&public[..len]).is_err(),
                "a {len}-byte truncation parsed"
            );
        }
        let mut longer = public.clone();
        longer.push(0);
        assert!(PublicKey::parse(&longer).is_err());
    }
}

#[test]
fn a_dead_tpm_is_an_error() {
    let state = tempfile::tempdir().unwrap();
    let swtpm = Swtpm::start(state.path());
    let mut tpm = swtpm.tpm();
    drop(swtpm);
    let error = tpm.identity_key().unwrap_err().to_string();
    assert!(
        error.starts_with("TPM2_CreatePrimary: no answer from the TPM: "),
        "{error}"
    );
}
