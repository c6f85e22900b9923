//! The small certificate authority behind `vdstream pki init|issue|revoke|crl|list`.
//!
//! A CA directory holds:
//!
//! | file          | what                                                              | mode |
//! |---------------|-------------------------------------------------------------------|------|
//! | `ca-cert.pem` | the CA's self-signed certificate: what every peer trusts          | 0644 |
//! | `ca-key.pem`  | its ECDSA P-256 key (PKCS#8): whoever holds it can mint identities | 0600 |
//! | `issued.json` | every certificate issued: serial, identity, validity, revocation  | 0600 |
//! | `ca-crl.pem`  | the revocation list, signed by the CA (from the first revocation) | 0644 |
//! | `.lock`       | `flock`ed by every command, so two admins never lose a record     | 0600 |
//!
//! A certificate directory written by [`Ca::issue`] has the layout qemu's `tls-creds-x509`,
//! nbdkit and libnbd read: `ca-cert.pem`, then `server-cert.pem` + `server-key.pem` for a
//! server, or `client-cert.pem` + `client-key.pem` for a target or an administrator, and a
//! copy of `ca-crl.pem` when the CA has one.
//!
//! Invariants:
//! - every certificate carries exactly one SAN URI, its identity's
//!   [`Identity::role_uri`], and CN = the identity's name; a server's also carries the DNS
//!   names and addresses clients check against the host they dialled;
//! - serials are 16 random bytes, positive, first byte 0x40..=0x7f (so the hex form never
//!   starts with 0 and is the same in `openssl x509 -serial` and `openssl crl -text`);
//! - `issued.json` gets the record before the files are written, so a certificate that
//!   exists anywhere can be revoked; writes are atomic (temporary file, rename);
//! - the CRL lists every revoked serial; `next_update` is [`CRL_VALIDITY`] after its
//!   issue, and [`Ca::write_crl`] (`vdstream pki crl`) signs a fresh one.

use std::fs::File;
use std::io::Write;
use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyIdMethod, KeyPair, KeyUsagePurpose, PublicKeyData,
    RevokedCertParams, SanType, SerialNumber,
};
use serde::{Deserialize, Serialize};
use vdstream_contract::time::Timestamp;
use vdstream_contract::Identity;

/// The CA's certificate, in the CA directory and in every certificate directory.
pub const CA_CERT: &str = "ca-cert.pem";
/// The CA's private key.
pub const CA_KEY: &str = "ca-key.pem";
/// The revocation list, in the CA directory and copied into certificate directories.
pub const CA_CRL: &str = "ca-crl.pem";
/// The record of every certificate issued.
pub const ISSUED: &str = "issued.json";
const LOCK: &str = ".lock";

const DAY: u64 = 24 * 3600;
/// The CA's lifetime by default: 10 years (every certificate must be re-issued with it).
pub const CA_VALIDITY: Duration = Duration::from_secs(3650 * DAY);
/// How long a CRL says it is current (its `nextUpdate`): 1 year. rustls applies a CRL past
/// it by default (webpki's `ExpirationPolicy::Ignore`); gnutls peers (qemu, nbdkit) may set
/// a stale one aside, so sign a fresh one (`vdstream pki crl`) before.
pub const CRL_VALIDITY: Duration = Duration::from_secs(365 * DAY);
/// Certificates start this long before they are issued, for clocks a little behind.
const BACKDATE: Duration = Duration::from_secs(300);

/// The default lifetime of a certificate for `identity`.
///
/// - server and target: 1 year. vdstream has no automatic renewal yet, so a short lifetime
///   would stop the whole farm every few months; a lost or retired target is revoked
///   (`vdstream pki revoke`), which takes effect on its next connection.
/// - admin: 90 days. It may write the golden image every target boots, there are few of
///   them, and a person renews theirs in one command.
pub fn default_validity(identity: &Identity) -> Duration {
    match identity {
        Identity::Admin(_) => Duration::from_secs(90 * DAY),
        _ => Duration::from_secs(365 * DAY),
    }
}

/// What went wrong; each says what to do. The CLI maps each variant to an exit status.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// A bad name, serial, host or lifetime (a usage error).
    #[error("{0}")]
    BadInput(String),
    /// No CA in the directory.
    #[error("no certificate authority in {}: create one with `vdstream pki init --ca {}`", dir.display(), dir.display())]
    NoCa { dir: PathBuf },
    /// A file that would be replaced exists.
    #[error("{} already exists: {what_to_do}", path.display())]
    Exists { path: PathBuf, what_to_do: String },
    /// No issued certificate matches.
    #[error("{0}")]
    NotIssued(String),
    /// Already revoked.
    #[error("{0}")]
    AlreadyRevoked(String),
    #[error("cannot {what} {}: {err}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        err: std::io::Error,
    },
    /// A file of the CA that cannot be read as what it should be.
    #[error("{}: {why}", path.display())]
    Damaged { path: PathBuf, why: String },
    /// rcgen refused to build or sign.
    #[error("cannot sign {what}: {err}")]
    Sign { what: String, err: rcgen::Error },
}

type Result<T> = std::result::Result<T, PkiError>;

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> PkiError {
    let path = path.to_path_buf();
    move |err| PkiError::Io { what, path, err }
}

/// One certificate the CA issued, as `issued.json` and `vdstream pki list --json` show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IssuedCert {
    /// Upper-case hex, no colons (as `openssl x509 -serial` prints it).
    pub serial: String,
    /// `target:pc-07`, `server:store-a`, `admin:alice`.
    pub identity: String,
    pub issued: Timestamp,
    pub not_before: Timestamp,
    pub not_after: Timestamp,
    /// A server's DNS names and addresses; empty for others.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    pub revoked: Option<Timestamp>,
}

impl IssuedCert {
    /// `valid`, `expired` or `revoked`, at `now`.
    pub fn status(&self, now: Timestamp) -> &'static str {
        if self.revoked.is_some() {
            "revoked"
        } else if self.not_after < now {
            "expired"
        } else {
            "valid"
        }
    }
}

/// `issued.json`.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Record {
    /// The number of the last CRL signed (CRL numbers only grow).
    crl_number: u64,
    certificates: Vec<IssuedCert>,
}

/// Reads `target:pc-07` (an identity as [`Identity`]'s Display writes it).
pub fn parse_identity(text: &str) -> Result<Identity> {
    let (role, name) = text.split_once(':').ok_or_else(|| {
        PkiError::BadInput(format!("{text:?} is not an identity: give ROLE:NAME, e.g. target:pc-07, server:store-a, admin:alice"))
    })?;
    Identity::new(role, name).map_err(|e| PkiError::BadInput(e.to_string()))
}

/// What `init` makes.
#[derive(Debug, Clone)]
pub struct InitRequest {
    /// The farm's name, in the CA's CN (`FARM vdstream CA`).
    pub farm: String,
    pub valid_for: Duration,
    /// Replace an existing CA (its files move to `replaced-TIME/`).
    pub force: bool,
}

/// A CA as `init` made it or `open` found it.
#[derive(Debug, Clone, Serialize)]
pub struct CaInfo {
    pub dir: PathBuf,
    pub subject: String,
    pub not_after: Timestamp,
    /// Where the previous CA's files went (`init --force`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replaced: Option<PathBuf>,
}

/// The CA of a directory, locked for this process while it lives.
#[derive(Debug)]
pub struct Ca {
    dir: PathBuf,
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
    subject: String,
    not_after: Timestamp,
    _lock: File,
}

/// Takes `DIR/.lock`, waiting for another `vdstream pki` command on the same CA.
fn lock(dir: &Path) -> Result<File> {
    let path = dir.join(LOCK);
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io("open the lock", &path))?;
    let _ = f.set_permissions(std::fs::Permissions::from_mode(0o600));
    vdstream_blockdev::flock::lock_wait(&f, vdstream_blockdev::flock::LockMode::Exclusive)
        .map_err(io("lock", &path))?;
    Ok(f)
}

/// Writes `bytes` to `path` atomically with `mode` (the temporary file is 0600 from the start,
/// so a key is never readable by others, not even for a moment).
fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io("create a file in", dir))?;
    tmp.write_all(bytes)
        .and_then(|()| tmp.as_file().sync_all())
        .map_err(io("write", path))?;
    tmp.as_file()
        .set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(io("set the mode of", path))?;
    tmp.persist(path).map_err(|e| PkiError::Io {
        what: "write",
        path: path.to_path_buf(),
        err: e.error,
    })?;
    Ok(())
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(io("read", path))
}

fn to_time(t: Timestamp) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp(t.0).unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}

fn plus(t: Timestamp, d: Duration) -> Timestamp {
    Timestamp(t.0.saturating_add(i64::try_from(d.as_secs()).unwrap_or(i64::MAX)))
}

fn minus(t: Timestamp, d: Duration) -> Timestamp {
    Timestamp(t.0.saturating_sub(i64::try_from(d.as_secs()).unwrap_or(i64::MAX)))
}

/// Certificates end no later than the year 9999 (X.509's GeneralizedTime).
const LAST_TIME: Timestamp = Timestamp(253_402_300_799);

fn sign_err(what: impl Into<String>) -> impl FnOnce(rcgen::Error) -> PkiError {
    let what = what.into();
    move |err| PkiError::Sign { what, err }
}

/// 16 random bytes, positive, without a leading zero (see the module invariants).
fn new_serial() -> Result<Vec<u8>> {
    let mut bytes = vec![0u8; 16];
    rustls::crypto::ring::default_provider()
        .secure_random
        .fill(&mut bytes)
        .map_err(|_| PkiError::BadInput("the system's random number generator failed".into()))?;
    bytes[0] = (bytes[0] & 0x3f) | 0x40;
    Ok(bytes)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02X}")).collect()
}

/// Reads a serial as `list` shows it or openssl prints it (`3F:2A:…` or `3f2a…`).
pub fn parse_serial(text: &str) -> Result<String> {
    let s: String = text
        .trim()
        .trim_start_matches("0x")
        .chars()
        .filter(|c| *c != ':')
        .collect::<String>()
        .to_ascii_uppercase();
    if s.is_empty() || s.len() > 40 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(PkiError::BadInput(format!(
            "{text:?} is not a certificate serial: give the hex serial `vdstream pki list` shows, or ROLE:NAME"
        )));
    }
    Ok(s)
}

fn unhex(s: &str) -> Vec<u8> {
    let s = if s.len() % 2 == 1 {
        format!("0{s}")
    } else {
        s.to_string()
    };
    (0..s.len())
        .step_by(2)
        .filter_map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

/// A DNS name for a server certificate: letters, digits, '-', dots between labels, an
/// optional leading `*.`.
fn check_dns(name: &str) -> Result<()> {
    let body = name.strip_prefix("*.").unwrap_or(name);
    let ok = !body.is_empty()
        && name.len() <= 253
        && body.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if ok && body.parse::<IpAddr>().is_err() {
        Ok(())
    } else {
        Err(PkiError::BadInput(format!(
            "{name:?} is not a DNS name (letters, digits, '-' and dots; an address goes in --ip)"
        )))
    }
}

/// This machine's host name (`/proc/sys/kernel/hostname`), if it is a usable DNS name.
pub fn hostname() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let name = name.trim().to_string();
    check_dns(&name).ok().map(|()| name)
}

/// The hosts a server certificate names by default: `localhost`, `127.0.0.1`, `::1` and
/// this machine's host name.
pub fn default_server_hosts() -> Vec<String> {
    let mut v: Vec<String> = ["localhost", "127.0.0.1", "::1"].map(String::from).to_vec();
    v.extend(hostname().filter(|h| h != "localhost"));
    v
}

/// Makes a new CA in `dir` (created if missing): key, self-signed certificate, an empty
/// `issued.json`. Refuses when `dir` has a CA, unless `force`.
pub fn init(dir: &Path, req: &InitRequest) -> Result<CaInfo> {
    if req.farm.trim().is_empty() || req.farm.chars().any(char::is_control) {
        return Err(PkiError::BadInput(format!(
            "{:?} is not a farm name: give a short text such as \"lab\" or \"campus-a\"",
            req.farm
        )));
    }
    std::fs::create_dir_all(dir).map_err(io("create the CA folder", dir))?;
    let _lock = lock(dir)?;
    let mut replaced = None;
    if let Some(existing) = [CA_CERT, CA_KEY]
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.exists())
    {
        if !req.force {
            return Err(PkiError::Exists {
                path: existing,
                what_to_do: "this folder has a CA already; every certificate it issued would stop working with a new one. \
                             Use another --ca folder, or give --force to replace it (its files are kept in replaced-TIME/)"
                    .into(),
            });
        }
        let aside = dir.join(format!(
            "replaced-{}",
            Timestamp::now().to_string().replace(':', "")
        ));
        std::fs::create_dir_all(&aside).map_err(io("create", &aside))?;
        for f in [CA_CERT, CA_KEY, ISSUED, CA_CRL] {
            let p = dir.join(f);
            if p.exists() {
                std::fs::rename(&p, aside.join(f)).map_err(io("move aside", &p))?;
            }
        }
        replaced = Some(aside);
    }
    let key =
        KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(sign_err("a CA key"))?;
    let now = Timestamp::now();
    let subject = format!("{} vdstream CA", req.farm.trim());
    let mut p = CertificateParams::default();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name
        .push(DnType::CommonName, subject.as_str());
    p.distinguished_name
        .push(DnType::OrganizationName, req.farm.trim());
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    p.serial_number = Some(SerialNumber::from_slice(&new_serial()?));
    p.not_before = to_time(minus(now, BACKDATE));
    let not_after = plus(now, req.valid_for).min(LAST_TIME);
    p.not_after = to_time(not_after);
    let cert = p
        .self_signed(&key)
        .map_err(sign_err("the CA certificate"))?;
    // The key first: a certificate without its key would look like a CA and sign nothing.
    write_file(&dir.join(CA_KEY), key.serialize_pem().as_bytes(), 0o600)?;
    write_file(&dir.join(CA_CERT), cert.pem().as_bytes(), 0o644)?;
    save(dir, &Record::default())?;
    Ok(CaInfo {
        dir: dir.to_path_buf(),
        subject,
        not_after,
        replaced,
    })
}

fn load(dir: &Path) -> Result<Record> {
    let path = dir.join(ISSUED);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| PkiError::Damaged {
            path,
            why: format!("not the CA's record of issued certificates: {e}"),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Record::default()),
        Err(e) => Err(PkiError::Io {
            what: "read",
            path,
            err: e,
        }),
    }
}

fn save(dir: &Path, r: &Record) -> Result<()> {
    let mut bytes = serde_json::to_vec_pretty(r).expect("the record serializes");
    bytes.push(b'\n');
    write_file(&dir.join(ISSUED), &bytes, 0o600)
}

/// What `issue` makes.
#[derive(Debug, Clone)]
pub struct IssueRequest {
    pub identity: Identity,
    /// The certificate directory (created if missing).
    pub out: PathBuf,
    /// Default: [`default_validity`].
    pub valid_for: Option<Duration>,
    /// A server's DNS names and addresses besides (or, without `default_hosts`, instead of)
    /// [`default_server_hosts`].
    pub dns: Vec<String>,
    pub ips: Vec<IpAddr>,
    pub default_hosts: bool,
    /// Replace the certificate and key files in `out`.
    pub force: bool,
}

/// What `issue` made.
#[derive(Debug, Clone, Serialize)]
pub struct Issued {
    #[serde(flatten)]
    pub cert: IssuedCert,
    /// The files written, in `out`.
    pub files: Vec<PathBuf>,
    /// Set when the CA expires before the lifetime asked for: the certificate ends with it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub shortened: bool,
}

/// What `revoke` revokes.
#[derive(Debug, Clone)]
pub enum Revoke {
    Serial(String),
    /// Every certificate of the identity not yet revoked.
    Identity(Identity),
}

impl Revoke {
    /// `ROLE:NAME` or a hex serial.
    pub fn parse(text: &str) -> Result<Revoke> {
        if text.contains(':')
            && text.split(':').next().is_some_and(|r| {
                r.bytes()
                    .any(|b| b.is_ascii_lowercase() && !b.is_ascii_hexdigit())
            })
        {
            parse_identity(text).map(Revoke::Identity)
        } else {
            parse_serial(text).map(Revoke::Serial)
        }
    }
}

/// A CRL just signed.
#[derive(Debug, Clone, Serialize)]
pub struct CrlInfo {
    pub path: PathBuf,
    pub number: u64,
    pub next_update: Timestamp,
    pub revoked: usize,
    /// Where else it was written (`--crl-out`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub copy: Option<PathBuf>,
}

/// What [`Ca::prepare`] found: the files to write and the hosts to name.
#[derive(Debug)]
struct Prepared {
    is_server: bool,
    cert_path: PathBuf,
    key_path: PathBuf,
    hosts: Vec<String>,
}

impl Ca {
    /// Opens the CA of `dir`, waiting for another command that holds it.
    pub fn open(dir: &Path) -> Result<Ca> {
        if !dir.join(CA_CERT).exists() && !dir.join(CA_KEY).exists() {
            return Err(PkiError::NoCa {
                dir: dir.to_path_buf(),
            });
        }
        let lock = lock(dir)?;
        let cert_path = dir.join(CA_CERT);
        let key_path = dir.join(CA_KEY);
        let cert_pem = read_text(&cert_path)?;
        let key = KeyPair::from_pem(&read_text(&key_path)?).map_err(|e| PkiError::Damaged {
            path: key_path.clone(),
            why: format!("not a private key in PEM: {e}"),
        })?;
        let damaged = |why: String| PkiError::Damaged {
            path: cert_path.clone(),
            why,
        };
        let der = rustls::pki_types::pem::PemObject::from_pem_slice(cert_pem.as_bytes())
            .map_err(|e| damaged(format!("not a certificate in PEM: {e:?}")))?;
        let der: rustls::pki_types::CertificateDer<'static> = der;
        let (_, x509) = x509_parser::parse_x509_certificate(&der)
            .map_err(|e| damaged(format!("not an X.509 certificate: {e}")))?;
        if x509.public_key().subject_public_key.data.as_ref() != key.der_bytes() {
            return Err(damaged(format!(
                "it does not belong to the key in {}: the CA folder is mixed up",
                key_path.display()
            )));
        }
        let subject = x509
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .unwrap_or("")
            .to_string();
        let not_after = Timestamp(x509.validity().not_after.timestamp());
        drop(x509);
        let issuer = Issuer::from_ca_cert_der(&der, key)
            .map_err(|e| damaged(format!("cannot sign with it: {e}")))?;
        Ok(Ca {
            dir: dir.to_path_buf(),
            cert_pem,
            issuer,
            subject,
            not_after,
            _lock: lock,
        })
    }

    pub fn info(&self) -> CaInfo {
        CaInfo {
            dir: self.dir.clone(),
            subject: self.subject.clone(),
            not_after: self.not_after,
            replaced: None,
        }
    }

    /// Every certificate issued, oldest first.
    pub fn list(&self) -> Result<Vec<IssuedCert>> {
        Ok(load(&self.dir)?.certificates)
    }

    /// Checks `req` as [`Ca::issue`] would (names, hosts, files in the way) without signing
    /// or writing anything: `target add --issue-cert` asks before it adds the record.
    pub fn check(&self, req: &IssueRequest) -> Result<()> {
        self.prepare(req).map(drop)
    }

    fn prepare(&self, req: &IssueRequest) -> Result<Prepared> {
        let (role_file, is_server) = match &req.identity {
            Identity::Server(_) => ("server", true),
            Identity::Target(_) | Identity::Admin(_) => ("client", false),
            other => {
                return Err(PkiError::BadInput(format!(
                "{other} has no certificate: issue one for target:ID, server:NAME or admin:NAME"
            )))
            }
        };
        if !is_server && (!req.dns.is_empty() || !req.ips.is_empty()) {
            return Err(PkiError::BadInput(format!(
                "--dns and --ip name a server's hosts; {} is not a server",
                req.identity
            )));
        }
        let out = &req.out;
        if out
            .canonicalize()
            .ok()
            .is_some_and(|o| self.dir.canonicalize().is_ok_and(|d| d == o))
        {
            return Err(PkiError::BadInput(format!(
                "{} is the CA folder: give --out another folder (a certificate folder holds a key the CA must not mix with its own)",
                out.display()
            )));
        }
        let cert_path = out.join(format!("{role_file}-cert.pem"));
        let key_path = out.join(format!("{role_file}-key.pem"));
        if !req.force {
            if let Some(p) = [&cert_path, &key_path].into_iter().find(|p| p.exists()) {
                return Err(PkiError::Exists {
                    path: p.clone(),
                    what_to_do: "give --force to replace it (renewal), or another --out folder"
                        .into(),
                });
            }
        }
        let mut hosts: Vec<String> = Vec::new();
        if is_server {
            if req.default_hosts {
                hosts.extend(default_server_hosts());
            }
            for d in &req.dns {
                check_dns(d)?;
                hosts.push(d.to_ascii_lowercase());
            }
            hosts.extend(req.ips.iter().map(IpAddr::to_string));
            let mut seen = std::collections::HashSet::new();
            hosts.retain(|h| seen.insert(h.clone()));
            if hosts.is_empty() {
                return Err(PkiError::BadInput("a server certificate needs a host name: give --dns or --ip (or keep the default hosts)".into()));
            }
        }
        Ok(Prepared {
            is_server,
            cert_path,
            key_path,
            hosts,
        })
    }

    /// Issues a certificate for `req.identity` into `req.out` (see the module docs for the
    /// files). Refuses to replace a certificate or key there unless `req.force`.
    pub fn issue(&self, req: &IssueRequest) -> Result<Issued> {
        let Prepared {
            is_server,
            cert_path,
            key_path,
            hosts,
        } = self.prepare(req)?;
        let out = &req.out;
        let now = Timestamp::now();
        let valid_for = req
            .valid_for
            .unwrap_or_else(|| default_validity(&req.identity));
        let (p, serial, not_after, wanted) =
            self.params(&req.identity, &hosts, is_server, now, valid_for)?;
        let key =
            KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(sign_err("a key"))?;
        let cert = p
            .signed_by(&key, &self.issuer)
            .map_err(sign_err(format!("the certificate of {}", req.identity)))?;
        // The record first: a certificate that exists anywhere can be revoked.
        let record = self.record_issued(&req.identity, &serial, now, not_after, hosts)?;
        std::fs::create_dir_all(out).map_err(io("create the certificate folder", out))?;
        let mut files = vec![out.join(CA_CERT), cert_path.clone(), key_path.clone()];
        write_file(&key_path, key.serialize_pem().as_bytes(), 0o600)?;
        write_file(&cert_path, cert.pem().as_bytes(), 0o644)?;
        write_file(&out.join(CA_CERT), self.cert_pem.as_bytes(), 0o644)?;
        let crl = self.dir.join(CA_CRL);
        if crl.exists() {
            write_file(
                &out.join(CA_CRL),
                &std::fs::read(&crl).map_err(io("read", &crl))?,
                0o644,
            )?;
            files.push(out.join(CA_CRL));
        }
        Ok(Issued {
            cert: record,
            files,
            shortened: not_after < wanted,
        })
    }

    /// The certificate's fields for `identity` (see the module invariants): its serial,
    /// when it ends, and when it would have ended had the CA lasted.
    fn params(
        &self,
        identity: &Identity,
        hosts: &[String],
        is_server: bool,
        now: Timestamp,
        valid_for: Duration,
    ) -> Result<(CertificateParams, Vec<u8>, Timestamp, Timestamp)> {
        let (Some(uri), Some(name)) = (identity.role_uri(), identity.name()) else {
            return Err(PkiError::BadInput(format!(
                "{identity} has no certificate: issue one for target:ID, server:NAME or admin:NAME"
            )));
        };
        let wanted = plus(now, valid_for);
        let not_after = wanted.min(self.not_after);
        if not_after <= now {
            return Err(PkiError::BadInput(format!(
                "the CA expired on {}: make a new one (vdstream pki init --force)",
                self.not_after
            )));
        }
        let serial = new_serial()?;
        let mut p = CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name.push(DnType::CommonName, name);
        let ia5 = |s: &str| {
            rcgen::string::Ia5String::try_from(s)
                .map_err(|e| PkiError::BadInput(format!("{s:?}: {e}")))
        };
        p.subject_alt_names = vec![SanType::URI(ia5(&uri)?)];
        for h in hosts {
            p.subject_alt_names.push(match h.parse::<IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(ia5(h)?),
            });
        }
        p.serial_number = Some(SerialNumber::from_slice(&serial));
        p.not_before = to_time(minus(now, BACKDATE));
        p.not_after = to_time(not_after);
        p.is_ca = IsCa::ExplicitNoCa;
        // keyEncipherment means nothing for an ECDSA key, but qemu's tls-creds-x509 refuses a
        // certificate whose (critical) key usage lacks it: "usage does not permit key
        // encipherment". gnutls's certtool sets both for TLS certificates too.
        p.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        p.extended_key_usages = if is_server {
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ]
        } else {
            vec![ExtendedKeyUsagePurpose::ClientAuth]
        };
        p.use_authority_key_identifier_extension = true;
        p.key_identifier_method = KeyIdMethod::Sha256;
        Ok((p, serial, not_after, wanted))
    }

    /// Issues a target's client certificate for a public key the target made and keeps
    /// (`spki_der`: its SubjectPublicKeyInfo, DER): a machine that proved its TPM identity
    /// at boot gets one for the key in its RAM, which never leaves it. Recorded in
    /// `issued.json` like every other; returns the certificate (PEM) and its record.
    pub fn issue_for_key(
        &self,
        target: &str,
        spki_der: &[u8],
        valid_for: Duration,
    ) -> Result<(String, IssuedCert)> {
        let identity = Identity::Target(target.to_string());
        let key = rcgen::SubjectPublicKeyInfo::from_der(spki_der).map_err(|e| {
            PkiError::BadInput(format!(
                "the public key for {identity} is not a SubjectPublicKeyInfo: {e}"
            ))
        })?;
        let now = Timestamp::now();
        let (p, serial, not_after, _) = self.params(&identity, &[], false, now, valid_for)?;
        let cert = p
            .signed_by(&key, &self.issuer)
            .map_err(sign_err(format!("the certificate of {identity}")))?;
        let record = self.record_issued(&identity, &serial, now, not_after, Vec::new())?;
        Ok((cert.pem(), record))
    }

    /// Adds a certificate's record to `issued.json`.
    fn record_issued(
        &self,
        identity: &Identity,
        serial: &[u8],
        now: Timestamp,
        not_after: Timestamp,
        hosts: Vec<String>,
    ) -> Result<IssuedCert> {
        let record = IssuedCert {
            serial: hex(serial),
            identity: identity.to_string(),
            issued: now,
            not_before: minus(now, BACKDATE),
            not_after,
            hosts,
            revoked: None,
        };
        let mut rec = load(&self.dir)?;
        rec.certificates.push(record.clone());
        save(&self.dir, &rec)?;
        Ok(record)
    }

    /// The CA's certificate (PEM), which every peer trusts.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Revokes a serial, or every unrevoked certificate of an identity, and signs a new CRL
    /// (written to the CA folder, and to `crl_out` too when given).
    pub fn revoke(
        &self,
        what: &Revoke,
        crl_out: Option<&Path>,
    ) -> Result<(Vec<IssuedCert>, CrlInfo)> {
        let mut rec = load(&self.dir)?;
        let now = Timestamp::now();
        let mut done = Vec::new();
        match what {
            Revoke::Serial(s) => {
                let c = rec.certificates.iter_mut().find(|c| c.serial == *s).ok_or_else(|| {
                    PkiError::NotIssued(format!("this CA issued no certificate with serial {s}: `vdstream pki list` shows the serials"))
                })?;
                if let Some(when) = c.revoked {
                    return Err(PkiError::AlreadyRevoked(format!(
                        "certificate {s} of {} was revoked on {when} already",
                        c.identity
                    )));
                }
                c.revoked = Some(now);
                done.push(c.clone());
            }
            Revoke::Identity(id) => {
                let shown = id.to_string();
                for c in rec
                    .certificates
                    .iter_mut()
                    .filter(|c| c.identity == shown && c.revoked.is_none())
                {
                    c.revoked = Some(now);
                    done.push(c.clone());
                }
                if done.is_empty() {
                    return Err(PkiError::NotIssued(format!("{shown} has no unrevoked certificate from this CA: `vdstream pki list` shows what was issued")));
                }
            }
        }
        let crl = self.sign_crl(&mut rec, crl_out)?;
        Ok((done, crl))
    }

    /// Signs a fresh CRL of every revoked certificate (a new number, `next_update` renewed).
    pub fn write_crl(&self, crl_out: Option<&Path>) -> Result<CrlInfo> {
        let mut rec = load(&self.dir)?;
        self.sign_crl(&mut rec, crl_out)
    }

    fn sign_crl(&self, rec: &mut Record, crl_out: Option<&Path>) -> Result<CrlInfo> {
        let now = Timestamp::now();
        rec.crl_number += 1;
        let revoked: Vec<RevokedCertParams> = rec
            .certificates
            .iter()
            .filter_map(|c| {
                c.revoked.map(|t| RevokedCertParams {
                    serial_number: SerialNumber::from_slice(&unhex(&c.serial)),
                    revocation_time: to_time(t),
                    reason_code: None,
                    invalidity_date: None,
                })
            })
            .collect();
        let next_update = plus(now, CRL_VALIDITY);
        let params = CertificateRevocationListParams {
            this_update: to_time(now),
            next_update: to_time(next_update),
            crl_number: SerialNumber::from_slice(&rec.crl_number.to_be_bytes()),
            issuing_distribution_point: None,
            revoked_certs: revoked,
            key_identifier_method: KeyIdMethod::Sha256,
        };
        let crl = params
            .signed_by(&self.issuer)
            .map_err(sign_err("the revocation list"))?;
        let pem = crl.pem().map_err(sign_err("the revocation list"))?;
        // The record before the CRL: a revocation on record is in every later CRL.
        save(&self.dir, rec)?;
        let path = self.dir.join(CA_CRL);
        write_file(&path, pem.as_bytes(), 0o644)?;
        let copy = match crl_out {
            Some(p) => {
                let p = if p.is_dir() {
                    p.join(CA_CRL)
                } else {
                    p.to_path_buf()
                };
                write_file(&p, pem.as_bytes(), 0o644)?;
                Some(p)
            }
            None => None,
        };
        Ok(CrlInfo {
            path,
            number: rec.crl_number,
            next_update,
            revoked: params.revoked_certs.len(),
            copy,
        })
    }
}

#[cfg(test)]
#[path = "pki_tests.rs"]
pub(crate) mod tests;

/// A fresh ECDSA P-256 key for a client certificate that a CA issues without seeing the
/// key ([`Ca::issue_for_key`]): the key's PKCS#8 PEM, and its SubjectPublicKeyInfo (DER).
pub fn new_client_key() -> Result<(String, Vec<u8>)> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(sign_err("a key"))?;
    Ok((key.serialize_pem(), key.subject_public_key_info()))
}
