//! The machine's side of identity at boot (`target attach --tpm PATH`, docs/IDENTITY.md):
//! the agent asks its TPM for the endorsement key and the identity key (primary keys from
//! fixed templates: the same on every boot, never outside the TPM), answers the server's
//! credential challenge inside the TPM, signs the proof there, and receives a client
//! certificate for a TLS key it made in RAM. The certificate directory it writes (mode 0700,
//! the layout of `--tls-certificates`) is what the agent then attaches and reports with.
//!
//! A pending enrolment is waited for, one console line a round, so that a machine booted
//! before its approval goes on by itself once an administrator approves it.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::json;
use vdstream_contract::enrolment::{proof_message, Challenge, EnrolmentState, ProofAnswer};
use vdstream_tpm::device::Tpm;

use crate::client::{Client, ClientError, Credentials};

/// How often a pending machine asks again.
pub const PENDING_RETRY: Duration = Duration::from_secs(5);

/// What went wrong, by what the machine's console says.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("the TPM at {path}: {err}")]
    Tpm {
        path: PathBuf,
        err: vdstream_tpm::device::Error,
    },
    /// The server refused the proof (another key is approved, or the target is revoked).
    #[error("the server refused this machine's identity: {0}")]
    Refused(String),
    #[error("asking the server for a certificate: {0}")]
    Api(#[from] ClientError),
    #[error("still pending after {0:?}: an administrator approves it with `vdstream target identity approve`")]
    StillPending(Duration),
    #[error("{0}")]
    Other(String),
}

/// What to prove, to whom, and where the certificate goes.
#[derive(Debug, Clone)]
pub struct IdentityRequest {
    /// The store server's API (http://HOST:PORT or https://).
    pub api: String,
    pub target: String,
    /// The TPM: a character device (/dev/tpmrm0), or swtpm's unix data socket.
    pub tpm: PathBuf,
    /// The certificate directory to write (ca-cert.pem, client-cert.pem, client-key.pem).
    pub out: PathBuf,
    /// How long a pending enrolment is waited for.
    pub wait: Duration,
}

/// The fingerprint of this machine's identity key, as the server shows it.
pub fn fingerprint(tpm_path: &Path) -> Result<String, IdentityError> {
    let mut tpm = open(tpm_path)?;
    let key = tpm.identity_key().map_err(tpm_err(tpm_path))?;
    let _ = tpm.flush(key.handle);
    vdstream_tpm::credential::PublicKey::parse(&key.public)
        .map(|k| k.fingerprint())
        .map_err(|e| IdentityError::Other(format!("the TPM's identity key: {e}")))
}

fn open(path: &Path) -> Result<Tpm, IdentityError> {
    let is_socket = std::fs::metadata(path)
        .map(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
        .unwrap_or(false);
    if is_socket {
        Tpm::connect(path)
    } else {
        Tpm::open(path)
    }
    .map_err(tpm_err(path))
}

fn tpm_err(path: &Path) -> impl Fn(vdstream_tpm::device::Error) -> IdentityError + '_ {
    move |err| IdentityError::Tpm {
        path: path.to_path_buf(),
        err,
    }
}

/// One proof: a challenge, its answer from the TPM, and the server's verdict.
fn prove_once(
    req: &IdentityRequest,
    client: &Client,
    tpm: &mut Tpm,
    tls_spki: &[u8],
) -> Result<ProofAnswer, IdentityError> {
    let ek = tpm.endorsement_key().map_err(tpm_err(&req.tpm))?;
    let key = match tpm.identity_key() {
        Ok(k) => k,
        Err(e) => {
            let _ = tpm.flush(ek.handle);
            return Err(tpm_err(&req.tpm)(e));
        }
    };
    let result = (|| {
        // Target ids follow the vDisk name rules: one path segment as they are.
        let id = &req.target;
        let challenge: Challenge = serde_json::from_value(client.post(
            &format!("/boot/identity/{id}/challenge"),
            &json!({"endorsement_key": B64.encode(&ek.public), "key": B64.encode(&key.public)}),
        )?)
        .map_err(|e| IdentityError::Other(format!("the server's challenge: {e}")))?;
        let b64 = |what: &str, t: &str| {
            B64.decode(t)
                .map_err(|e| IdentityError::Other(format!("the server's {what}: {e}")))
        };
        let secret = tpm
            .activate_credential(
                &key,
                &ek,
                &b64("credential", &challenge.credential)?,
                &b64("secret", &challenge.secret)?,
            )
            .map_err(tpm_err(&req.tpm))?;
        let nonce = b64("nonce", &challenge.nonce)?;
        let signature = tpm
            .sign(&key, &proof_message(&req.target, &nonce, &secret, tls_spki))
            .map_err(tpm_err(&req.tpm))?;
        let answer = client.post(
            &format!("/boot/identity/{id}/prove"),
            &json!({
                "challenge": challenge.challenge,
                "secret": B64.encode(&secret),
                "tls_key": B64.encode(tls_spki),
                "signature": B64.encode(signature),
            }),
        );
        match answer {
            Ok(v) => serde_json::from_value(v)
                .map_err(|e| IdentityError::Other(format!("the server's answer: {e}"))),
            Err(ClientError::Api {
                status: 403, error, ..
            }) => Err(IdentityError::Refused(error)),
            Err(e) => Err(e.into()),
        }
    })();
    let _ = tpm.flush(key.handle);
    let _ = tpm.flush(ek.handle);
    result
}

/// Proves the machine's identity, waiting while its enrolment is pending (`say` gets one
/// console line a round), and writes the certificate directory. Returns it.
pub fn prove(req: &IdentityRequest, say: &dyn Fn(&str)) -> Result<PathBuf, IdentityError> {
    // The CA to check the server against is the environment's, as for every API call; the
    // machine shows no client certificate yet.
    let creds = Credentials::from_env()?;
    let client = Client::with_credentials(&req.api, creds)?;
    let mut tpm = open(&req.tpm)?;
    let (key_pem, spki) = vdstream_tls::pki::new_client_key()
        .map_err(|e| IdentityError::Other(format!("a TLS key: {e}")))?;
    let started = Instant::now();
    loop {
        let answer = prove_once(req, &client, &mut tpm, &spki)?;
        match answer.state {
            EnrolmentState::Approved => {
                let (Some(cert), Some(ca)) = (&answer.certificate, &answer.ca) else {
                    return Err(IdentityError::Other(
                        "the server approved the key but sent no certificate".into(),
                    ));
                };
                write_dir(&req.out, &key_pem, cert, ca)?;
                say(&answer.message);
                return Ok(req.out.clone());
            }
            _ => {
                say(&answer.message);
                if started.elapsed() >= req.wait {
                    return Err(IdentityError::StillPending(req.wait));
                }
                std::thread::sleep(PENDING_RETRY);
            }
        }
    }
}

/// Writes the certificate directory: owner-only, the key never readable by others.
fn write_dir(dir: &Path, key_pem: &str, cert: &str, ca: &str) -> Result<(), IdentityError> {
    let io = |what: &str, p: &Path, e: std::io::Error| {
        IdentityError::Other(format!("cannot {what} {}: {e}", p.display()))
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| io("create", dir, e))?;
    for (name, text, mode) in [
        ("client-key.pem", key_pem, 0o600),
        ("client-cert.pem", cert, 0o644),
        ("ca-cert.pem", ca, 0o644),
    ] {
        let path = dir.join(name);
        let tmp = dir.join(format!(".{name}.tmp"));
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(|e| io("write", &tmp, e))?;
        f.write_all(text.as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(|e| io("write", &tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| io("write", &path, e))?;
    }
    Ok(())
}
