//! The HTTP API's bearer tokens: `vdstream token add|list|revoke` writes them, the API
//! checks them. They live in the store directory, in `api-tokens.json` (mode 0600), next
//! to the store's other files, so whoever may change the store may manage them.
//!
//! A token is `vdst_` + 32 random bytes (from the OS) in unpadded base64url: 256 bits, so
//! a plain SHA-256 of it is a safe thing to keep (no salt or slow hash is needed against
//! guessing). Only that hash is written; the token itself is shown once, when made.
//!
//! Invariants:
//! - A token is found by its hash, compared with every stored hash in constant time
//!   (`subtle`), the whole list walked whatever matches: no early exit that a timing
//!   could reveal, and no comparison of the token's text.
//! - A revoked token stays in the file (name, role, when) and never matches again.
//!   [`TokenFile::current`] re-reads the file when it changed (its inode, size or time), so
//!   a revocation takes effect on the next request.
//! - Names are unique among the tokens, revoked ones included, so a name always means
//!   one token in the audit trail.
//! - A token's text is never formatted by this module except in [`NewToken`], whose
//!   `Debug` hides it.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use base64::Engine;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use vdstream_contract::time::Timestamp;

/// The file in the store directory that holds the tokens' hashes.
pub const TOKEN_FILE: &str = "api-tokens.json";
/// What every token starts with (so a leaked one is recognisable by secret scanners).
pub const TOKEN_PREFIX: &str = "vdst_";

/// What `vdstream token add` tells the administrator besides the token: from now on the
/// API needs a credential from every client, agents included, whose reports are refused
/// (and their targets shown offline) until they have one.
pub const AGENTS_NEED_A_CREDENTIAL: &str = "agents that report to this store's servers (`vdstream target attach ID --server http://...`) \
need a credential from now on, or their status reports are refused (401) and the console shows their targets offline: \
give each a token of role operator in a file only its user reads (`vdstream token add agents --role operator > FILE`, \
then VDSTREAM_TOKEN_FILE=FILE in the agent's environment) or, over https, its target's certificate \
(VDSTREAM_TLS_CERTIFICATES=DIR, from `vdstream pki issue target ID` or `target add ID --issue-cert DIR`)";

/// What a token may do. Ordered: each role may do all that the ones before it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// Every GET: the server, vDisks, versions, targets, sessions, /metrics.
    ReadOnly,
    /// Also target records (add, change, remove) and agents' status reports.
    Operator,
    /// Everything: also versions (new, promote, revert).
    Admin,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::ReadOnly, Role::Operator, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::ReadOnly => "read-only",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = TokenError;

    fn from_str(s: &str) -> Result<Role, TokenError> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| {
                TokenError::Bad(format!(
                    "{s:?} is not a role: say admin, operator or read-only"
                ))
            })
    }
}

/// One token as stored (its hash, never its text).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenRecord {
    pub name: String,
    pub role: Role,
    /// SHA-256 of the token's text, lowercase hex.
    pub sha256: String,
    pub created: Timestamp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked: Option<Timestamp>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Stored {
    tokens: Vec<TokenRecord>,
}

/// A token just made: its text (shown once) and its record.
pub struct NewToken {
    pub token: String,
    pub record: TokenRecord,
}

impl std::fmt::Debug for NewToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NewToken")
            .field("token", &"<hidden>")
            .field("record", &self.record)
            .finish()
    }
}

/// Why a token command or check failed.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("{0}")]
    Bad(String),
    #[error("{path}: {why}")]
    File { path: PathBuf, why: String },
}

fn file_error(path: &Path, why: impl std::fmt::Display) -> TokenError {
    TokenError::File {
        path: path.to_path_buf(),
        why: why.to_string(),
    }
}

/// SHA-256 of `token`, lowercase hex.
fn hash_of(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The tokens of a store directory.
#[derive(Debug, Clone)]
pub struct Tokens {
    path: PathBuf,
}

impl Tokens {
    pub fn of_store(store: &Path) -> Tokens {
        Tokens {
            path: store.join(TOKEN_FILE),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn read(&self) -> Result<Stored, TokenError> {
        let read = vdstream_blockdev::storefile::open_read(&self.path).and_then(|mut f| {
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut f, &mut bytes).map(|_| bytes)
        });
        match read {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| file_error(&self.path, format!("is not a token file ({e}); restore it from a backup, or move it away and make new tokens"))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Stored::default()),
            Err(e) => Err(file_error(&self.path, format!("cannot read it: {e}"))),
        }
    }

    /// Runs `f` on the stored list under an exclusive lock and writes the result atomically.
    fn change<T>(
        &self,
        f: impl FnOnce(&mut Stored) -> Result<T, TokenError>,
    ) -> Result<T, TokenError> {
        let lock_path = self.path.with_extension("lock");
        let lock = vdstream_blockdev::storefile::open_rw(
            &lock_path,
            vdstream_blockdev::storefile::PRIVATE,
        )
        .map_err(|e| {
            file_error(
                &lock_path,
                format!("cannot open it: {e}; is the store directory writable?"),
            )
        })?;
        vdstream_store::fsutil::lock_wait(&lock, vdstream_store::fsutil::LockMode::Exclusive)
            .map_err(|e| file_error(&lock_path, format!("cannot lock it: {e}")))?;
        let mut stored = self.read()?;
        let out = f(&mut stored)?;
        let mut bytes = serde_json::to_vec_pretty(&stored).expect("the token list serializes");
        bytes.push(b'\n');
        // Owner-only from its creation (the hashes are not the tokens, but a list of them
        // is nobody else's business).
        vdstream_store::fsutil::write_atomic_mode(
            &self.path,
            &bytes,
            vdstream_store::fsutil::PRIVATE,
        )
        .map_err(|e| file_error(&self.path, e))?;
        Ok(out)
    }

    /// Makes a token named `name` with `role`. The name must be new (revoked ones count).
    pub fn add(&self, name: &str, role: Role) -> Result<NewToken, TokenError> {
        if name.is_empty()
            || name.len() > 64
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.@".contains(&b))
        {
            return Err(TokenError::Bad(format!(
                "{name:?} is not a token name: use 1 to 64 letters, digits, '-', '_', '.' or '@'"
            )));
        }
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes)
            .map_err(|e| TokenError::Bad(format!("the OS gave no random bytes: {e}")))?;
        let token = format!(
            "{TOKEN_PREFIX}{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
        );
        let record = TokenRecord {
            name: name.to_string(),
            role,
            sha256: hash_of(&token),
            created: Timestamp::now(),
            revoked: None,
        };
        let r = record.clone();
        self.change(move |s| {
            if s.tokens.iter().any(|t| t.name == r.name) {
                return Err(TokenError::Bad(format!("a token named {:?} exists already (`vdstream token list`): choose another name", r.name)));
            }
            s.tokens.push(r);
            Ok(())
        })?;
        Ok(NewToken { token, record })
    }

    /// Every token, revoked ones included, oldest first.
    pub fn list(&self) -> Result<Vec<TokenRecord>, TokenError> {
        Ok(self.read()?.tokens)
    }

    /// Revokes the token named `name`; revoking a revoked one is refused.
    pub fn revoke(&self, name: &str) -> Result<TokenRecord, TokenError> {
        self.change(|s| {
            let known = s
                .tokens
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(", ");
            let t = s
                .tokens
                .iter_mut()
                .find(|t| t.name == name)
                .ok_or_else(|| {
                    TokenError::Bad(format!(
                        "no token named {name:?}; tokens: {}",
                        if known.is_empty() { "none" } else { &known }
                    ))
                })?;
            if t.revoked.is_some() {
                return Err(TokenError::Bad(format!(
                    "the token {name:?} is revoked already"
                )));
            }
            t.revoked = Some(Timestamp::now());
            Ok(t.clone())
        })
    }
}

/// The token list a server checks requests against, re-read when the file changes.
#[derive(Debug)]
pub struct TokenFile {
    tokens: Tokens,
    cached: Mutex<(Option<Stamp>, Arc<Vec<TokenRecord>>)>,
}

/// A file's identity and version: inode, size, mtime (s, ns).
type Stamp = (u64, u64, i64, i64);

fn stamp(path: &Path) -> Option<Stamp> {
    std::fs::metadata(path)
        .ok()
        .map(|m| (m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
}

impl TokenFile {
    /// Reads the tokens of `store` now (a damaged file fails the start).
    pub fn open(store: &Path) -> Result<TokenFile, TokenError> {
        let tokens = Tokens::of_store(store);
        let s = stamp(tokens.path());
        let list = tokens.read()?.tokens;
        Ok(TokenFile {
            tokens,
            cached: Mutex::new((s, Arc::new(list))),
        })
    }

    /// The tokens now. When the file changed and no longer reads, no token is accepted
    /// until it reads again (failing closed), and the error is logged.
    pub fn current(&self) -> Arc<Vec<TokenRecord>> {
        let now = stamp(self.tokens.path());
        let mut cached = self.cached.lock().unwrap_or_else(|p| p.into_inner());
        if cached.0 != now {
            let list = match self.tokens.read() {
                Ok(s) => s.tokens,
                Err(e) => {
                    log::error!("HTTP API: {e}; no token is accepted until it reads again");
                    Vec::new()
                }
            };
            *cached = (now, Arc::new(list));
        }
        cached.1.clone()
    }

    /// Whether the token file exists (any token was ever made in this store).
    pub fn exists(&self) -> bool {
        self.tokens.path().exists()
    }

    /// The live (not revoked) token whose text is `presented`, by hash, in constant time.
    pub fn check(&self, presented: &str) -> Option<TokenRecord> {
        find(&self.current(), presented)
    }
}

/// The record among `list` whose hash is the hash of `presented`, not revoked. Every
/// record is compared (constant time each, no early exit).
pub fn find(list: &[TokenRecord], presented: &str) -> Option<TokenRecord> {
    let wanted = hash_of(presented);
    let mut found: Option<&TokenRecord> = None;
    for t in list {
        let same: bool = t.sha256.as_bytes().ct_eq(wanted.as_bytes()).into();
        if same && t.revoked.is_none() {
            found = Some(t);
        }
    }
    found.cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_stored_hashed_found_by_hash_and_revoked_for_good() {
        let dir = tempfile::tempdir().unwrap();
        let tokens = Tokens::of_store(dir.path());
        let a = tokens.add("ci", Role::Operator).unwrap();
        assert!(
            a.token.starts_with(TOKEN_PREFIX) && a.token.len() == TOKEN_PREFIX.len() + 43,
            "{}",
            a.token.len()
        );
        assert!(!format!("{a:?}").contains(&a.token));
        let text = std::fs::read_to_string(tokens.path()).unwrap();
        assert!(
            !text.contains(&a.token) && text.contains(&a.record.sha256),
            "{text}"
        );
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(tokens.path())
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o600
        );
        let b = tokens.add("ro", Role::ReadOnly).unwrap();
        assert_ne!(a.token, b.token);
        assert!(tokens
            .add("ci", Role::Admin)
            .unwrap_err()
            .to_string()
            .contains("exists already"));
        assert!(tokens.add("a b", Role::Admin).is_err());
        let file = TokenFile::open(dir.path()).unwrap();
        assert_eq!(file.check(&a.token).map(|t| t.role), Some(Role::Operator));
        assert_eq!(file.check(&b.token).map(|t| t.name), Some("ro".to_string()));
        assert_eq!(file.check("vdst_nope"), None);
        assert_eq!(file.check(&a.token[..a.token.len() - 1]), None);
        tokens.revoke("ci").unwrap();
        assert_eq!(
            file.check(&a.token),
            None,
            "revocation takes effect at once"
        );
        assert!(tokens
            .revoke("ci")
            .unwrap_err()
            .to_string()
            .contains("revoked already"));
        assert!(tokens
            .revoke("zz")
            .unwrap_err()
            .to_string()
            .contains("tokens: ci, ro"));
        assert_eq!(tokens.list().unwrap().len(), 2);
    }

    #[test]
    fn roles_read_and_order() {
        assert_eq!("read-only".parse::<Role>().unwrap(), Role::ReadOnly);
        assert!("root".parse::<Role>().is_err());
        assert!(Role::ReadOnly < Role::Operator && Role::Operator < Role::Admin);
    }
}
