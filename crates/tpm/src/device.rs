//! The machine's side: a small TPM 2.0 client.
//!
//! One command goes out and one response comes back, over the kernel's resource-managed
//! character device (`/dev/tpmrm0`) or swtpm's unix data socket. `tpm2-protocol` marshals
//! the commands and unmarshals the responses; this module holds the transport, the
//! authorization sessions and the few command sequences the agent needs.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ring::digest;
use ring::rand::{SecureRandom, SystemRandom};
use tpm2_protocol::basic::TpmHandle;
use tpm2_protocol::constant::TPM_MAX_COMMAND_SIZE;
use tpm2_protocol::data::{
    Tpm2bDigest, Tpm2bEncryptedSecret, Tpm2bIdObject, Tpm2bNonce, TpmAlgId, TpmCc, TpmRc, TpmRh,
    TpmSe, TpmSt, TpmaSession, TpmsAuthCommand, TpmsSchemeHash, TpmtPublic, TpmtSigScheme,
    TpmtSymDef, TpmtTkHashcheck, TpmuSigScheme, TpmuSignature,
};
use tpm2_protocol::frame::{
    tpm_marshal_command, TpmActivateCredentialCommand, TpmActivateCredentialResponse,
    TpmCreatePrimaryCommand, TpmCreatePrimaryResponse, TpmFlushContextCommand,
    TpmFlushContextResponse, TpmFrame, TpmPolicySecretCommand, TpmPolicySecretResponse,
    TpmResponse, TpmSignCommand, TpmSignResponse, TpmStartAuthSessionCommand,
    TpmStartAuthSessionResponse, TpmUnmarshalBody,
};
use tpm2_protocol::{TpmError, TpmUnmarshal, TpmWriter};

/// How long a socket TPM may take to answer one command before it counts as dead. Creating
/// a primary key takes a real TPM up to a few seconds; swtpm much less.
const TIMEOUT: Duration = Duration::from_secs(30);

/// A response header: tag (2 bytes), size (4), response code (4).
const HEADER: usize = 10;

/// The warnings that ask for the same command again (TPM 2.0 Part 2, TPM_RC), which a TSS
/// resends: RETRY (for one, on the first use of a dictionary-attack-protected key after
/// startup, while the TPM records that use), YIELDED, and TESTING (a self-test still runs).
const TPM_RC_RETRY: u32 = 0x922;
const TPM_RC_YIELDED: u32 = 0x908;
const TPM_RC_TESTING: u32 = 0x90A;
/// How many times a command is sent at most, and the pause before sending it again: about
/// a second in all, enough for a self-test.
const SUBMISSIONS: u32 = 10;
const RESUBMIT_AFTER: Duration = Duration::from_millis(100);

/// A TPM command that failed, or a TPM that could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot open the TPM at {path}: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error("{command}: no answer from the TPM: {source}")]
    Io { command: String, source: io::Error },
    /// The TPM answered with an error code.
    #[error("{command} failed: TPM_RC {rc:#010x} ({})", rc_name(*rc))]
    Tpm { command: String, rc: u32 },
    #[error("{command}: malformed TPM response: {why}")]
    Response { command: String, why: String },
    /// An argument that cannot be sent (an id_object that is not a TPM2B_ID_OBJECT, say).
    #[error("{0}")]
    Argument(String),
    #[error("the kernel gave no random numbers")]
    Random,
}

/// A key loaded in the TPM: its transient handle and its public area.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    pub handle: u32,
    /// The marshalled TPM2B_PUBLIC (with its 2-byte size), what the server parses with
    /// [`crate::credential::PublicKey::parse`].
    pub public: Vec<u8>,
}

/// How commands reach the TPM.
#[derive(Debug)]
enum Transport {
    /// A character device (`/dev/tpmrm0`): one write() of a whole command, one read() of
    /// the whole response.
    Device(File),
    /// swtpm's unix data socket: a byte stream, each response framed by its header's size.
    Socket(UnixStream),
}

/// A TPM 2.0, one command at a time.
#[derive(Debug)]
pub struct Tpm {
    transport: Transport,
}

impl Tpm {
    /// Opens a TPM character device, normally `/dev/tpmrm0` (the kernel's resource manager,
    /// which also flushes what this process leaves loaded when it closes).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| Error::Open {
                path: path.to_owned(),
                source,
            })?;
        Ok(Self {
            transport: Transport::Device(file),
        })
    }

    /// Connects to swtpm's data socket (`swtpm socket --server type=unixio,path=PATH`).
    pub fn connect(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let open_error = |source| Error::Open {
            path: path.to_owned(),
            source,
        };
        let stream = UnixStream::connect(path).map_err(open_error)?;
        stream.set_read_timeout(Some(TIMEOUT)).map_err(open_error)?;
        stream
            .set_write_timeout(Some(TIMEOUT))
            .map_err(open_error)?;
        Ok(Self {
            transport: Transport::Socket(stream),
        })
    }

    /// The endorsement key: TPM2_CreatePrimary with the TCG default ECC NIST P-256 EK
    /// template (L-2). The same key on every call; flush it when done.
    pub fn endorsement_key(&mut self) -> Result<Key, Error> {
        let template = crate::endorsement_template().map_err(encode_error)?;
        self.create_primary(template)
    }

    /// The machine's identity key: TPM2_CreatePrimary with vdstream's ECDSA P-256 signing
    /// key template. The same key on every boot of the same TPM; flush it when done.
    pub fn identity_key(&mut self) -> Result<Key, Error> {
        let template = crate::identity_template().map_err(encode_error)?;
        self.create_primary(template)
    }

    /// Signs the SHA-256 of `message` with `key` (ECDSA), and returns r || s, each
    /// left-padded to 32 bytes.
    pub fn sign(&mut self, key: &Key, message: &[u8]) -> Result<[u8; 64], Error> {
        let digest = digest::digest(&digest::SHA256, message);
        let command = TpmSignCommand {
            handles: [TpmHandle::new(key.handle)],
            digest: Tpm2bDigest::try_from(digest.as_ref()).map_err(encode_error)?,
            in_scheme: TpmtSigScheme {
                scheme: TpmAlgId::Ecdsa,
                details: TpmuSigScheme::Hash(TpmsSchemeHash {
                    hash_alg: TpmAlgId::Sha256,
                }),
            },
            // The digest was not made by the TPM: an unrestricted key takes a null ticket.
            validation: TpmtTkHashcheck {
                tag: TpmSt::HashCheck,
                hierarchy: TpmRh::Null,
                digest: Tpm2bDigest::default(),
            },
        };
        let response: TpmSignResponse = self.execute(&command, &[password()])?;
        let malformed = |why: &str| Error::Response {
            command: command_name(TpmCc::Sign),
            why: why.to_owned(),
        };
        let TpmuSignature::Ecdsa(ecdsa) = response.signature.signature else {
            return Err(malformed("not an ECDSA signature"));
        };
        let mut signature = [0; 64];
        let (r, s) = signature.split_at_mut(32);
        if !left_pad(r, &ecdsa.signature_r) || !left_pad(s, &ecdsa.signature_s) {
            return Err(malformed("an ECDSA signature half longer than 32 bytes"));
        }
        Ok(signature)
    }

    /// Answers a credential challenge made by [`crate::credential::make_credential`] for
    /// `ek` and `key`'s name: the secret inside, which only this TPM can recover. The inputs
    /// are the marshalled TPM2B_ID_OBJECT and TPM2B_ENCRYPTED_SECRET.
    pub fn activate_credential(
        &mut self,
        key: &Key,
        ek: &Key,
        id_object: &[u8],
        encrypted_secret: &[u8],
    ) -> Result<Vec<u8>, Error> {
        let command = TpmActivateCredentialCommand {
            handles: [TpmHandle::new(key.handle), TpmHandle::new(ek.handle)],
            credential_blob: parse_whole::<Tpm2bIdObject>(id_object, "TPM2B_ID_OBJECT")?,
            secret: parse_whole::<Tpm2bEncryptedSecret>(
                encrypted_secret,
                "TPM2B_ENCRYPTED_SECRET",
            )?,
        };
        // The EK's authPolicy is PolicySecret(TPM_RH_ENDORSEMENT): satisfy it in a policy
        // session, which is flushed whatever happens.
        let session = self.start_policy_session()?;
        let result = self.activate_in_session(&command, session);
        let flushed = self.flush(session);
        let secret = result?;
        flushed?;
        Ok(secret)
    }

    /// Unloads a key or session (TPM2_FlushContext).
    pub fn flush(&mut self, handle: u32) -> Result<(), Error> {
        let command = TpmFlushContextCommand {
            handles: [],
            flush_handle: TpmHandle::new(handle),
        };
        let _: TpmFlushContextResponse = self.execute(&command, &[])?;
        Ok(())
    }

    /// TPM2_CreatePrimary under the endorsement hierarchy (empty authorization).
    fn create_primary(&mut self, template: TpmtPublic) -> Result<Key, Error> {
        let command = TpmCreatePrimaryCommand {
            handles: [TpmHandle::new(TpmRh::Endorsement.value())],
            in_public: template.into(),
            ..Default::default()
        };
        let response: TpmCreatePrimaryResponse = self.execute(&command, &[password()])?;
        // Marshalling the unmarshalled TPM2B_PUBLIC gives back the TPM's bytes: every field
        // of it has exactly one encoding.
        let public = crate::marshal(&response.out_public).map_err(|e| Error::Response {
            command: command_name(TpmCc::CreatePrimary),
            why: e.to_string(),
        })?;
        Ok(Key {
            handle: response.handles[0].value(),
            public,
        })
    }

    /// An unbound, unsalted policy session (TPM2_StartAuthSession), for the EK's policy.
    fn start_policy_session(&mut self) -> Result<u32, Error> {
        let command = TpmStartAuthSessionCommand {
            handles: [
                TpmHandle::new(TpmRh::Null.value()),
                TpmHandle::new(TpmRh::Null.value()),
            ],
            nonce_caller: random_nonce()?,
            encrypted_salt: Tpm2bEncryptedSecret::default(),
            session_type: TpmSe::Policy,
            symmetric: TpmtSymDef::default(),
            auth_hash: TpmAlgId::Sha256,
        };
        let response: TpmStartAuthSessionResponse = self.execute(&command, &[])?;
        Ok(response.handles[0].value())
    }

    /// TPM2_PolicySecret(TPM_RH_ENDORSEMENT) in `session`, then TPM2_ActivateCredential
    /// with `key` authorized by password and the EK by `session`.
    fn activate_in_session(
        &mut self,
        command: &TpmActivateCredentialCommand,
        session: u32,
    ) -> Result<Vec<u8>, Error> {
        let policy_secret = TpmPolicySecretCommand {
            handles: [
                TpmHandle::new(TpmRh::Endorsement.value()),
                TpmHandle::new(session),
            ],
            ..Default::default()
        };
        let _: TpmPolicySecretResponse = self.execute(&policy_secret, &[password()])?;
        let policy = TpmsAuthCommand {
            session_handle: TpmHandle::new(session),
            nonce: random_nonce()?,
            // Kept open so that the flush after it has a session to flush on every path.
            session_attributes: TpmaSession::CONTINUE_SESSION,
            ..Default::default()
        };
        let response: TpmActivateCredentialResponse =
            self.execute(command, &[password(), policy])?;
        Ok(response.cert_info.to_vec())
    }

    /// Sends `command` with `sessions` and unmarshals the response as `R`.
    fn execute<C: TpmFrame, R: TpmUnmarshalBody>(
        &mut self,
        command: &C,
        sessions: &[TpmsAuthCommand],
    ) -> Result<R, Error> {
        let name = command_name(command.cc());
        let mut buffer = [0; TPM_MAX_COMMAND_SIZE];
        let mut writer = TpmWriter::new(&mut buffer);
        let tag = if sessions.is_empty() {
            TpmSt::NoSessions
        } else {
            TpmSt::Sessions
        };
        tpm_marshal_command(command, tag, sessions, &mut writer)
            .map_err(|e| Error::Argument(format!("cannot encode {name}: {e}")))?;
        let len = writer.len();
        let mut attempt = 1;
        let response = loop {
            let response = self.transact(&buffer[..len]).map_err(|source| Error::Io {
                command: name.clone(),
                source,
            })?;
            // The response code is read here, not by tpm2-protocol, so that a code it does
            // not know is still reported by number.
            let rc = match response.get(6..HEADER) {
                Some(&[a, b, c, d]) => u32::from_be_bytes([a, b, c, d]),
                _ => {
                    return Err(Error::Response {
                        command: name,
                        why: format!("{} bytes, shorter than a header", response.len()),
                    })
                }
            };
            match rc {
                0 => break response,
                TPM_RC_RETRY | TPM_RC_YIELDED | TPM_RC_TESTING if attempt < SUBMISSIONS => {
                    attempt += 1;
                    std::thread::sleep(RESUBMIT_AFTER);
                }
                _ => return Err(Error::Tpm { command: name, rc }),
            }
        };
        TpmResponse::cast(&response)
            .and_then(|response| response.unmarshal::<R>())
            .map_err(|e| Error::Response {
                command: name,
                why: e.to_string(),
            })
    }

    /// Sends one marshalled command and returns the whole response.
    fn transact(&mut self, command: &[u8]) -> io::Result<Vec<u8>> {
        let mut response = vec![0; TPM_MAX_COMMAND_SIZE];
        match &mut self.transport {
            Transport::Device(file) => {
                file.write_all(command)?;
                let len = file.read(&mut response)?;
                response.truncate(len);
            }
            Transport::Socket(stream) => {
                stream.write_all(command)?;
                stream.read_exact(&mut response[..HEADER])?;
                let size = u32::from_be_bytes([response[2], response[3], response[4], response[5]]);
                let size = usize::try_from(size).unwrap_or(usize::MAX);
                if !(HEADER..=TPM_MAX_COMMAND_SIZE).contains(&size) {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("response size {size} is out of range"),
                    ));
                }
                stream.read_exact(&mut response[HEADER..size])?;
                response.truncate(size);
            }
        }
        Ok(response)
    }
}

/// An empty password authorization (TPM_RS_PW): the hierarchies and keys here have none.
fn password() -> TpmsAuthCommand {
    TpmsAuthCommand {
        session_handle: TpmHandle::new(TpmRh::Pw.value()),
        ..Default::default()
    }
}

/// A fresh 32-byte nonce.
fn random_nonce() -> Result<Tpm2bNonce, Error> {
    let mut nonce = [0; 32];
    SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| Error::Random)?;
    Tpm2bNonce::try_from(&nonce[..]).map_err(encode_error)
}

/// Parses `bytes` as exactly one `T`.
fn parse_whole<T: TpmUnmarshal>(bytes: &[u8], what: &str) -> Result<T, Error> {
    match T::unmarshal(bytes) {
        Ok((value, [])) => Ok(value),
        Ok((_, rest)) => Err(Error::Argument(format!(
            "not a {what}: {} bytes after it",
            rest.len()
        ))),
        Err(e) => Err(Error::Argument(format!("not a {what}: {e}"))),
    }
}

/// Copies `src` to the end of `dst`, zeroes before it; false if it does not fit.
fn left_pad(dst: &mut [u8], src: &[u8]) -> bool {
    let Some(start) = dst.len().checked_sub(src.len()) else {
        return false;
    };
    dst[start..].copy_from_slice(src);
    true
}

/// A value this module built that tpm2-protocol cannot encode (a bug, not a TPM failure).
fn encode_error(e: TpmError) -> Error {
    Error::Argument(format!("cannot encode a TPM structure: {e}"))
}

/// The command's name as TPM 2.0 Part 3 spells it ("TPM2_CreatePrimary").
fn command_name(cc: TpmCc) -> String {
    cc.to_string().replace("TPM_CC_", "TPM2_")
}

/// The response code's name, and which handle, session or parameter it is about:
/// "TPM_RC_INTEGRITY, parameter[1]" (tpm2-protocol writes that in brackets).
fn rc_name(rc: u32) -> String {
    let Ok(rc) = TpmRc::try_from(rc) else {
        return "unknown code".to_owned();
    };
    let name = rc.to_string();
    match name
        .strip_prefix('[')
        .and_then(|inner| inner.strip_suffix(']'))
    {
        Some(inner) => inner.to_owned(),
        None => name,
    }
}
