//! `vdstream pki init|issue|revoke|crl|list`: the farm's certificate authority. Wiring
//! only: the CA lives in `vdstream_tls::pki`. Also `target add --issue-cert` (target_record.rs)
//! issues through [`open_ca`] and [`target_request`].

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use serde_json::json;
use vdstream_contract::time::Timestamp;
use vdstream_tls::pki::{self, Ca, InitRequest, IssueRequest, Issued, Revoke};
use vdstream_tls::Identity;

/// Where the CA lives when neither --ca nor $VDSTREAM_CA says: next to the default store,
/// but not in it (a store may be shared by every server; the CA key belongs to the admin).
pub const DEFAULT_CA: &str = "/var/lib/vdstream/ca";

/// The farm's certificate authority: certificates for targets, servers and administrators.
///
/// Every certificate names one identity in a SAN URI (urn:vdstream:target:ID,
/// urn:vdstream:server:NAME, urn:vdstream:admin:NAME); servers decide what a client may open
/// from it. Certificates are written in the folder layout qemu's tls-creds-x509, nbdkit,
/// libnbd and `vdstream --tls-certificates DIR` read.
#[derive(Debug, Args)]
#[command(after_help = "\
The CA folder (--ca, default $VDSTREAM_CA, else /var/lib/vdstream/ca):
  ca-cert.pem   the CA certificate: every server and client trusts it
  ca-key.pem    its private key (mode 0600): keep it on the admin's machine, back it up
  issued.json   every certificate issued (serial, identity, validity, revocation)
  ca-crl.pem    the revocation list, after the first `pki revoke`

Examples:
  vdstream pki init --farm lab
  vdstream pki issue server store-a --out /etc/vdstream/tls --dns store-a.lab.example
  vdstream pki issue target pc-07 --out ./pc-07-tls
  vdstream pki issue admin alice --out ~/.config/vdstream/tls
  vdstream pki list
  vdstream pki revoke target:pc-07 --crl-out /etc/vdstream/tls
  nbdinfo 'nbds://store-a.lab.example/vdisk/win11?tls-certificates=./pc-07-tls'")]
pub struct PkiArgs {
    #[command(subcommand)]
    command: PkiCommand,
    #[command(flatten)]
    opts: PkiOpts,
}

/// What every `pki` command takes.
#[derive(Debug, Clone, Args)]
pub struct PkiOpts {
    /// The CA folder. Default: $VDSTREAM_CA, else /var/lib/vdstream/ca.
    #[arg(long, value_name = "DIR", global = true)]
    pub ca: Option<PathBuf>,
    /// Print one JSON document on stdout instead of human lines (errors too: see
    /// `vdstream --help`, "Exit status").
    #[arg(long, global = true)]
    pub json: bool,
}

impl PkiOpts {
    pub fn dir(&self) -> PathBuf {
        ca_dir(self.ca.as_deref())
    }

    fn emit(&self, doc: serde_json::Value, human: impl FnOnce() -> String) {
        if self.json {
            outln!(
                "{}",
                serde_json::to_string_pretty(&doc).expect("serializes")
            );
        } else {
            outln!("{}", human());
        }
    }
}

/// `--ca DIR`, else $VDSTREAM_CA, else [`DEFAULT_CA`].
pub fn ca_dir(flag: Option<&Path>) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| {
            std::env::var_os("VDSTREAM_CA")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CA))
}

#[derive(Debug, Subcommand)]
enum PkiCommand {
    Init(InitArgs),
    Issue(IssueArgs),
    Revoke(RevokeArgs),
    Crl(CrlArgs),
    List(ListArgs),
}

/// Make the CA: a key and a self-signed certificate in the CA folder (created if missing).
///
/// Refused when the folder has a CA already, unless --force: a new CA makes every
/// certificate of the old one useless.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vdstream pki init --farm campus-a                  in $VDSTREAM_CA or /var/lib/vdstream/ca
  vdstream pki init --ca ./pki --farm lab --valid-for 5y")]
struct InitArgs {
    /// The farm's name, in the CA's name ("FARM vdstream CA"). Default: this machine's host name.
    #[arg(long, value_name = "NAME")]
    farm: Option<String>,
    /// The CA's lifetime, e.g. 10y, 3650d (units: s, m, h, d, y = 365 d). Certificates
    /// it issues end no later than it does.
    #[arg(long, value_name = "DURATION", value_parser = parse_lifetime, default_value = "10y")]
    valid_for: Duration,
    /// Replace the CA the folder holds (its files move to replaced-TIME/ in the folder).
    #[arg(long)]
    force: bool,
}

/// Whose certificate.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum Role {
    /// A target (a machine that boots from a vDisk); NAME is its target id.
    Target,
    /// A store server (`vdstream server`, `serve-image`).
    Server,
    /// An administrator: the maintenance role (may write maintenance/NAME and change the farm).
    Admin,
}

/// Issue a certificate, signed by the CA, into a certificate folder.
///
/// A server gets ca-cert.pem, server-cert.pem, server-key.pem; a target or an admin gets
/// ca-cert.pem, client-cert.pem, client-key.pem (keys mode 0600), and a copy of the CA's
/// ca-crl.pem if it has one. Keys are ECDSA P-256. Default lifetimes: server and target 1
/// year (there is no automatic renewal yet; revoke a lost target instead), admin 90 days.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vdstream pki issue server store-a --out /etc/vdstream/tls --dns store-a.lab.example --ip 10.0.0.1
  vdstream pki issue target pc-07 --out ./pc-07-tls       then copy the folder to pc-07
  vdstream pki issue admin alice --out ~/.config/vdstream/tls --valid-for 30d
  vdstream pki issue target pc-07 --out ./pc-07-tls --force   renew (replaces the files)
Use them:
  qemu-img info --object tls-creds-x509,id=tls0,endpoint=client,dir=./pc-07-tls \\
    --image-opts driver=nbd,host=store-a.lab.example,port=10809,export=target/pc-07,tls-creds=tls0
  nbdkit --tls=require --tls-certificates=/etc/vdstream/tls memory 1G")]
struct IssueArgs {
    /// target, server or admin.
    #[arg(value_name = "ROLE")]
    role: Role,
    /// The target's id, or the server's or admin's name: letters, digits, '.', '_', '-'.
    #[arg(value_name = "NAME")]
    name: String,
    /// The certificate folder to write (created if missing).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Lifetime, e.g. 365d, 1y, 12h (units: s, m, h, d, y = 365 d). Default: 1y for servers
    /// and targets, 90d for admins. Ends no later than the CA.
    #[arg(long, value_name = "DURATION", value_parser = parse_lifetime)]
    valid_for: Option<Duration>,
    /// Server only: a DNS name clients dial it by (repeat). Clients (qemu, libnbd, vdstream)
    /// check the host name of their URI against the certificate's names.
    #[arg(long, value_name = "NAME")]
    dns: Vec<String>,
    /// Server only: an address clients dial it by (repeat), e.g. 10.0.0.1.
    #[arg(long, value_name = "ADDR")]
    ip: Vec<IpAddr>,
    /// Server only: leave out the default names localhost, 127.0.0.1, ::1 and this
    /// machine's host name (then give --dns or --ip).
    #[arg(long)]
    no_default_hosts: bool,
    /// Replace the certificate and key in --out (renewal). The old certificate stays valid
    /// until it expires or is revoked.
    #[arg(long)]
    force: bool,
}

/// Revoke a certificate by serial, or every unrevoked certificate of an identity, and sign
/// a new revocation list (ca-crl.pem in the CA folder).
///
/// Servers read ca-crl.pem from their own certificate folder (--tls-certificates DIR):
/// copy it there (--crl-out writes it there directly; sync it to every server), and
/// revocation takes effect on each server's next connection.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vdstream pki revoke target:pc-07                 every certificate of target pc-07
  vdstream pki revoke 5A1F0C...                    one certificate, by the serial `pki list` shows
  vdstream pki revoke admin:bob --crl-out /etc/vdstream/tls
  for s in store-a store-b; do scp /var/lib/vdstream/ca/ca-crl.pem $s:/etc/vdstream/tls/; done")]
struct RevokeArgs {
    /// ROLE:NAME (target:pc-07, server:store-a, admin:alice) or a certificate's hex serial.
    #[arg(value_name = "WHAT")]
    what: String,
    /// Also write the new CRL here: a file, or a folder (then FOLDER/ca-crl.pem), e.g. this
    /// machine's server certificate folder.
    #[arg(long, value_name = "PATH")]
    crl_out: Option<PathBuf>,
}

/// Sign a fresh revocation list (a new number and next-update date) without revoking
/// anything: CRLs say they are current for 1 year.
#[derive(Debug, Args)]
#[command(after_help = "\
Example:
  vdstream pki crl --crl-out /etc/vdstream/tls")]
struct CrlArgs {
    /// Also write the CRL here: a file, or a folder (then FOLDER/ca-crl.pem).
    #[arg(long, value_name = "PATH")]
    crl_out: Option<PathBuf>,
}

/// List the certificates the CA issued: serial, identity, end of validity, status.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vdstream pki list
  vdstream pki list --json | jq -r '.[] | select(.status == \"valid\") | .identity'")]
struct ListArgs {}

pub fn run(args: PkiArgs) -> Result<()> {
    let o = &args.opts;
    match args.command {
        PkiCommand::Init(a) => init(o, a),
        PkiCommand::Issue(a) => issue(o, a),
        PkiCommand::Revoke(a) => revoke(o, a),
        PkiCommand::Crl(a) => crl(o, a),
        PkiCommand::List(_) => list(o),
    }
}

/// `10y`, `90d`, `12h`, `30m`, `5s` or a number of seconds; y = 365 days.
pub fn parse_lifetime(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(split);
    let bad = || format!("{text:?}: give a lifetime such as 10y, 365d, 12h (units: s, m, h, d, y)");
    let n: u64 = n.parse().map_err(|_| bad())?;
    let secs = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "y" => 365 * 86_400,
        _ => return Err(bad()),
    };
    match n.checked_mul(secs) {
        Some(s) if s > 0 && s <= 1000 * 365 * 86_400 => Ok(Duration::from_secs(s)),
        _ => Err(format!(
            "{text:?}: give a lifetime above 0 and at most 1000y"
        )),
    }
}

fn init(o: &PkiOpts, a: InitArgs) -> Result<()> {
    let dir = o.dir();
    let farm = a
        .farm
        .or_else(pki::hostname)
        .unwrap_or_else(|| "vdstream".into());
    let info = pki::init(
        &dir,
        &InitRequest {
            farm,
            valid_for: a.valid_for,
            force: a.force,
        },
    )?;
    let doc = json!({"ca": info, "files": [dir.join(pki::CA_CERT), dir.join(pki::CA_KEY), dir.join(pki::ISSUED)]});
    o.emit(doc, || {
        let mut lines = vec![format!("created the CA {:?} in {}, valid until {}", info.subject, dir.display(), info.not_after)];
        if let Some(r) = &info.replaced {
            lines.push(format!("  the previous CA's files are in {}", r.display()));
        }
        lines.push(format!("  {}: the certificate every server and client trusts", dir.join(pki::CA_CERT).display()));
        lines.push(format!("  {}: its key (mode 0600): keep it here, back it up, never copy it to a server", dir.join(pki::CA_KEY).display()));
        lines.push("next: vdstream pki issue server NAME --out DIR; vdstream pki issue target ID --out DIR".into());
        lines.join("\n")
    });
    Ok(())
}

/// Opens the CA of `--ca`/$VDSTREAM_CA/the default, saying which folder it looked in.
pub fn open_ca(flag: Option<&Path>) -> Result<Ca> {
    Ok(Ca::open(&ca_dir(flag))?)
}

fn identity(role: Role, name: &str) -> Result<Identity> {
    let role = match role {
        Role::Target => "target",
        Role::Server => "server",
        Role::Admin => "admin",
    };
    Identity::new(role, name)
        .map_err(|e| crate::exit::fail(crate::exit::Kind::Usage, format!("{e}")))
}

/// The request `target add --issue-cert DIR` makes for target `id`.
pub fn target_request(id: &str, out: &Path) -> Result<IssueRequest> {
    Ok(IssueRequest {
        identity: identity(Role::Target, id)?,
        out: out.to_path_buf(),
        valid_for: None,
        dns: vec![],
        ips: vec![],
        default_hosts: false,
        force: false,
    })
}

fn issue(o: &PkiOpts, a: IssueArgs) -> Result<()> {
    let req = IssueRequest {
        identity: identity(a.role, &a.name)?,
        out: a.out,
        valid_for: a.valid_for,
        dns: a.dns,
        ips: a.ip,
        default_hosts: !a.no_default_hosts,
        force: a.force,
    };
    let ca = Ca::open(&o.dir())?;
    let issued = ca
        .issue(&req)
        .with_context(|| format!("cannot issue a certificate for {}", req.identity))?;
    o.emit(serde_json::to_value(&issued)?, || {
        issued_lines(&issued).join("\n")
    });
    Ok(())
}

/// What `issue` and `target add --issue-cert` say about a certificate they wrote.
pub fn issued_lines(i: &Issued) -> Vec<String> {
    let c = &i.cert;
    let mut lines = vec![format!(
        "issued a certificate for {}: serial {}, valid until {}",
        c.identity, c.serial, c.not_after
    )];
    if i.shortened {
        lines.push("  (shortened: the CA ends then; make a new CA before it expires)".into());
    }
    if !c.hosts.is_empty() {
        lines.push(format!(
            "  host names clients may dial: {}",
            c.hosts.join(", ")
        ));
    }
    for f in &i.files {
        lines.push(format!("  wrote {}", f.display()));
    }
    lines
}

fn revoke(o: &PkiOpts, a: RevokeArgs) -> Result<()> {
    let what = Revoke::parse(&a.what)?;
    let ca = Ca::open(&o.dir())?;
    let (done, crl) = ca.revoke(&what, a.crl_out.as_deref())?;
    let doc = json!({"revoked": done, "crl": crl});
    o.emit(doc, || {
        let mut lines: Vec<String> = done
            .iter()
            .map(|c| format!("revoked {} (serial {})", c.identity, c.serial))
            .collect();
        lines.extend(crl_lines(&crl));
        lines.join("\n")
    });
    Ok(())
}

fn crl_lines(crl: &pki::CrlInfo) -> Vec<String> {
    let mut lines = vec![format!(
        "wrote the revocation list {} (number {}, {} revoked, current until {})",
        crl.path.display(),
        crl.number,
        crl.revoked,
        crl.next_update
    )];
    match &crl.copy {
        Some(p) => lines.push(format!("  and {}; copy it to every other server's certificate folder as ca-crl.pem", p.display())),
        None => lines.push("  copy it to every server's certificate folder (--tls-certificates DIR) as ca-crl.pem: it counts from their next connection".into()),
    }
    lines
}

fn crl(o: &PkiOpts, a: CrlArgs) -> Result<()> {
    let ca = Ca::open(&o.dir())?;
    let crl = ca.write_crl(a.crl_out.as_deref())?;
    o.emit(serde_json::to_value(&crl)?, || crl_lines(&crl).join("\n"));
    Ok(())
}

fn list(o: &PkiOpts) -> Result<()> {
    let ca = Ca::open(&o.dir())?;
    let certs = ca.list()?;
    let now = Timestamp::now();
    let doc: Vec<serde_json::Value> = certs
        .iter()
        .map(|c| {
            let mut v = serde_json::to_value(c).expect("serializes");
            v["status"] = json!(c.status(now));
            v
        })
        .collect();
    o.emit(json!(doc), || {
        let info = ca.info();
        let mut lines = vec![format!(
            "CA {:?} in {}, valid until {}",
            info.subject,
            info.dir.display(),
            info.not_after
        )];
        if certs.is_empty() {
            lines.push(
                "no certificates yet; issue one with `vdstream pki issue ROLE NAME --out DIR`"
                    .into(),
            );
            return lines.join("\n");
        }
        lines.push(format!(
            "{:<32}  {:<28}  {:<20}  {}",
            "SERIAL", "IDENTITY", "NOT-AFTER", "STATUS"
        ));
        for c in &certs {
            let status = match c.revoked {
                Some(t) => format!("revoked {t}"),
                None => c.status(now).to_string(),
            };
            lines.push(format!(
                "{:<32}  {:<28}  {:<20}  {status}",
                c.serial,
                c.identity,
                c.not_after.to_string()
            ));
        }
        lines.join("\n")
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifetimes() {
        assert_eq!(
            parse_lifetime("10y").unwrap(),
            Duration::from_secs(3650 * 86400)
        );
        assert_eq!(
            parse_lifetime("90d").unwrap(),
            Duration::from_secs(90 * 86400)
        );
        assert_eq!(parse_lifetime("2").unwrap(), Duration::from_secs(2));
        assert_eq!(
            parse_lifetime("12h").unwrap(),
            Duration::from_secs(12 * 3600)
        );
        for bad in ["", "0", "1w", "-1d", "y", "1.5y", "2000y"] {
            assert!(parse_lifetime(bad).is_err(), "{bad:?}");
        }
    }
}
