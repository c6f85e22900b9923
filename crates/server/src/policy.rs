//! Who may open which export: a pure decision on the client's [`Identity`], the parsed
//! [`ExportName`] and what the store knows (the vDisk of a target's record), made before
//! anything is opened or looked up, so that a refused client learns nothing about the
//! export it asked for (not even whether it exists).
//!
//! | client            | may open                                                                 |
//! |-------------------|--------------------------------------------------------------------------|
//! | `local` (no TLS)  | everything (one host: unix socket, loopback, or `--insecure`)            |
//! | `admin:NAME`      | everything, `maintenance/NAME` included                                  |
//! | `target:ID`       | `target/ID` (any attach, `+journal`, `#SECRET`), and `vdisk/NAME[@V]` of its record's vDisk, any version |
//! | `server:NAME`     | `vdisk/NAME[@V]` of every vDisk, read-only (a store server copying versions) |
//! | `anonymous`       | what `--anonymous` grants: `none` (nothing), `vdisks` (every `vdisk/NAME[@V]`), `all` (everything but `maintenance/NAME`) |
//! | `certificate:CN`  | as `anonymous`: a certificate the CA signed that names no vdstream role is no identity in the farm |
//!
//! `maintenance/NAME` needs `admin` (or `local`) whatever else is granted. A target may
//! read any version of its record's vDisk, not only the one its record selects: an agent
//! that reconnects after a promote pins the version it booted (`vdisk/NAME@3`), and every
//! version of that vDisk is the golden image it already reads, with no other target's data.
//!
//! Invariants: [`decide`] never allows `maintenance/NAME` to anyone but `local` and
//! `admin`, never allows `target/ID` to a target other than `ID`, to a server, or to
//! anonymous clients unless granted `all`; a refusal names its rule ([`Refusal::rule`],
//! one of [`RULES`]) and what to do, and never carries an attach secret.

use std::fmt;
use std::str::FromStr;

use vdstream_contract::{ExportName, Identity};

/// What `--anonymous` grants clients that showed no verified certificate (TLS on).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum AnonymousGrant {
    /// Nothing: every open is refused (the default).
    #[default]
    None,
    /// Read-only `vdisk/NAME[@V]` of every vDisk (like a PVS standard-mode anonymous boot).
    Vdisks,
    /// Everything but `maintenance/NAME`.
    All,
}

impl AnonymousGrant {
    pub fn name(self) -> &'static str {
        match self {
            AnonymousGrant::None => "none",
            AnonymousGrant::Vdisks => "vdisks",
            AnonymousGrant::All => "all",
        }
    }
}

impl fmt::Display for AnonymousGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for AnonymousGrant {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(AnonymousGrant::None),
            "vdisks" => Ok(AnonymousGrant::Vdisks),
            "all" => Ok(AnonymousGrant::All),
            _ => Err(format!("{s:?}: say none, vdisks or all")),
        }
    }
}

/// The rules a refusal can name (the docs' table lists the same words).
pub const RULES: [&str; 6] = [
    MAINTENANCE_NEEDS_ADMIN,
    TARGET_OWN_EXPORTS,
    TARGET_WITHOUT_RECORD,
    SERVER_READS_VDISKS,
    ANONYMOUS_NONE,
    ANONYMOUS_VDISKS,
];

/// `maintenance/NAME` needs an administrator.
pub const MAINTENANCE_NEEDS_ADMIN: &str = "maintenance-needs-admin";
/// A target opens its own `target/ID` and its record's vDisk only.
pub const TARGET_OWN_EXPORTS: &str = "target-own-exports";
/// A target without a record in this store may open only its `target/ID` (which then
/// answers that it has no record).
pub const TARGET_WITHOUT_RECORD: &str = "target-needs-record";
/// A server reads `vdisk/NAME[@V]` only.
pub const SERVER_READS_VDISKS: &str = "server-reads-vdisks";
/// `--anonymous none`.
pub const ANONYMOUS_NONE: &str = "anonymous-none";
/// `--anonymous vdisks`: read-only vDisk exports only.
pub const ANONYMOUS_VDISKS: &str = "anonymous-vdisks";

/// Why an open is refused: the rule's name and a message naming who, what, and what to do.
/// Shown as `rule RULE: MESSAGE`; the client reads `refused by policy: rule RULE: MESSAGE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub rule: &'static str,
    pub message: String,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rule {}: {}", self.rule, self.message)
    }
}

/// Decides whether `client` may open `export`. `record_vdisk(id)` is the vDisk of target
/// `id`'s record (`None`: no record); it is asked only for a target's `vdisk/...` open.
pub fn decide(
    client: &Identity,
    export: &ExportName,
    anonymous: AnonymousGrant,
    record_vdisk: &dyn Fn(&str) -> Option<String>,
) -> Result<(), Refusal> {
    let shown = export.shown();
    let refuse = |rule: &'static str, message: String| Err(Refusal { rule, message });
    match (client, export) {
        (Identity::Local | Identity::Admin(_), _) => Ok(()),
        (_, ExportName::Maintenance { vdisk, .. }) => refuse(
            MAINTENANCE_NEEDS_ADMIN,
            format!(
                "{client} may not open {shown}: writing the maintenance version of vDisk {vdisk} needs an administrator's \
                 certificate (role URI urn:vdstream:admin:NAME)"
            ),
        ),
        (Identity::Target(me), ExportName::Target { id, .. }) if id == me => Ok(()),
        (Identity::Target(me), _) => {
            let own = match export {
                ExportName::Vdisk { .. } => record_vdisk(me),
                _ => None,
            };
            match (export, own) {
                (ExportName::Vdisk { vdisk, .. }, Some(own)) if *vdisk == own => Ok(()),
                (ExportName::Vdisk { .. }, None) => refuse(
                    TARGET_WITHOUT_RECORD,
                    format!(
                        "{client} may open only target/{me} and the vDisk of its record, and target {me} has no record on \
                         this server; refused {shown}: add it with `vdstream target add {me} --vdisk NAME --cache TYPE`"
                    ),
                ),
                (_, own) => {
                    let vdisk = match own.or_else(|| record_vdisk(me)) {
                        Some(v) => format!("vdisk/{v}[@V] (its record)"),
                        None => "the vDisk of its record (it has none here)".to_string(),
                    };
                    refuse(
                        TARGET_OWN_EXPORTS,
                        format!(
                            "{client} may open only target/{me} and {vdisk}; refused {shown}: connect with that \
                             target's own certificate"
                        ),
                    )
                }
            }
        }
        (Identity::Server(_), ExportName::Vdisk { .. }) => Ok(()),
        (Identity::Server(_), _) => refuse(
            SERVER_READS_VDISKS,
            format!("{client} may open only vdisk/NAME[@V] (read-only); refused {shown}: a target's export takes that target's certificate"),
        ),
        (Identity::Anonymous | Identity::Verified(_), _) => {
            // A certificate without a role is anonymous here; the refusal says why.
            let who = match client {
                Identity::Verified(_) => format!(
                    "{client} names no vdstream role (no urn:vdstream:ROLE:NAME URI), so it is anonymous here, and "
                ),
                _ => String::new(),
            };
            match anonymous {
                AnonymousGrant::All => Ok(()),
                AnonymousGrant::Vdisks if matches!(export, ExportName::Vdisk { .. }) => Ok(()),
                AnonymousGrant::Vdisks => refuse(
                    ANONYMOUS_VDISKS,
                    format!(
                        "{who}anonymous clients may open only vdisk/NAME[@V] on this server (--anonymous vdisks); refused {shown}: \
                         connect with a certificate of a vdstream role (`vdstream pki issue`, tls-certificates=DIR with client-cert.pem) that allows it"
                    ),
                ),
                AnonymousGrant::None => refuse(
                    ANONYMOUS_NONE,
                    format!(
                        "{who}anonymous clients may open nothing on this server (--anonymous none); refused {shown}: connect with a \
                         certificate of a vdstream role signed by the server's CA (`vdstream pki issue`, tls-certificates=DIR with client-cert.pem)"
                    ),
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One export of each kind and shape the grammar allows.
    fn exports() -> Vec<ExportName> {
        [
            "vdisk/win11",
            "vdisk/win11@3",
            "vdisk/win11@base",
            "vdisk/win11@latest",
            "vdisk/linux",
            "vdisk/linux@test",
            "maintenance/win11",
            "maintenance/win11@4",
            "target/a",
            "target/a@v3",
            "target/a@k3x+journal#0a9f",
            "target/a+journal",
            "target/b",
            "target/b@k3x#00ff",
        ]
        .iter()
        .map(|t| t.parse().unwrap())
        .collect()
    }

    fn identities() -> Vec<Identity> {
        vec![
            Identity::Local,
            Identity::Anonymous,
            Identity::Target("a".into()),
            Identity::Target("b".into()),
            Identity::Target("c".into()),
            Identity::Server("s1".into()),
            Identity::Admin("alice".into()),
            Identity::verified("t1"),
        ]
    }

    /// Target a boots win11, b boots linux, c has no record.
    fn records(id: &str) -> Option<String> {
        match id {
            "a" => Some("win11".into()),
            "b" => Some("linux".into()),
            _ => None,
        }
    }

    /// The table of the module docs, written out independently of `decide`: the rule that
    /// refuses, or `None` for allowed.
    fn expected(
        client: &Identity,
        export: &ExportName,
        grant: AnonymousGrant,
    ) -> Option<&'static str> {
        let maintenance = matches!(export, ExportName::Maintenance { .. });
        let (target_of, vdisk_of) = match export {
            ExportName::Target { id, .. } => (Some(id.as_str()), None),
            ExportName::Vdisk { vdisk, .. } => (None, Some(vdisk.as_str())),
            ExportName::Maintenance { .. } => (None, None),
        };
        match client {
            Identity::Local | Identity::Admin(_) => None,
            _ if maintenance => Some(MAINTENANCE_NEEDS_ADMIN),
            Identity::Target(me) => {
                if target_of == Some(me.as_str()) {
                    None
                } else if vdisk_of.is_some() && records(me).is_none() {
                    Some(TARGET_WITHOUT_RECORD)
                } else if vdisk_of.is_some() && vdisk_of == records(me).as_deref() {
                    None
                } else {
                    Some(TARGET_OWN_EXPORTS)
                }
            }
            Identity::Server(_) => {
                if vdisk_of.is_some() {
                    None
                } else {
                    Some(SERVER_READS_VDISKS)
                }
            }
            Identity::Anonymous | Identity::Verified(_) => match grant {
                AnonymousGrant::None => Some(ANONYMOUS_NONE),
                AnonymousGrant::Vdisks if vdisk_of.is_some() => None,
                AnonymousGrant::Vdisks => Some(ANONYMOUS_VDISKS),
                AnonymousGrant::All => None,
            },
        }
    }

    #[test]
    fn every_identity_and_every_export_kind_gets_the_table_s_answer() {
        let mut checked = 0;
        for grant in [
            AnonymousGrant::None,
            AnonymousGrant::Vdisks,
            AnonymousGrant::All,
        ] {
            for client in identities() {
                for export in exports() {
                    let got = decide(&client, &export, grant, &records);
                    let want = expected(&client, &export, grant);
                    assert_eq!(
                        got.as_ref().err().map(|r| r.rule),
                        want,
                        "{client} opening {export} (--anonymous {grant}): {got:?}"
                    );
                    if let Err(r) = got {
                        assert!(RULES.contains(&r.rule));
                        let text = r.to_string();
                        assert!(text.starts_with(&format!("rule {}: ", r.rule)), "{text}");
                        assert!(
                            text.contains(&export.shown()),
                            "the refusal names the export: {text}"
                        );
                        assert!(!text.contains('#'), "no secret in a refusal: {text}");
                        if r.rule != ANONYMOUS_NONE && r.rule != ANONYMOUS_VDISKS {
                            assert!(
                                text.contains(&client.to_string()),
                                "the refusal names the client: {text}"
                            );
                        }
                    }
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 3 * 8 * 14);
    }

    #[test]
    fn the_issue_s_cases_read_well() {
        let a = Identity::Target("pc-07".into());
        let rec = |id: &str| (id == "pc-07").then(|| "win11".to_string());
        let e = decide(
            &a,
            &"target/pc-08".parse().unwrap(),
            AnonymousGrant::All,
            &rec,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "rule target-own-exports: target:pc-07 may open only target/pc-07 and vdisk/win11[@V] (its record); \
             refused target/pc-08: connect with that target's own certificate"
        );
        let e = decide(
            &a,
            &"maintenance/win11".parse().unwrap(),
            AnonymousGrant::All,
            &rec,
        )
        .unwrap_err();
        assert!(
            e.to_string().starts_with(
                "rule maintenance-needs-admin: target:pc-07 may not open maintenance/win11"
            ),
            "{e}"
        );
        let e = decide(
            &Identity::Anonymous,
            &"maintenance/win11".parse().unwrap(),
            AnonymousGrant::All,
            &rec,
        )
        .unwrap_err();
        assert_eq!(
            e.rule, MAINTENANCE_NEEDS_ADMIN,
            "--anonymous all still excludes maintenance"
        );
        // The record is asked only when it decides something.
        let never = |_: &str| -> Option<String> { panic!("no record needed") };
        decide(
            &a,
            &"target/pc-07@k1#00".parse().unwrap(),
            AnonymousGrant::None,
            &never,
        )
        .unwrap();
        decide(
            &Identity::Server("s".into()),
            &"vdisk/x@2".parse().unwrap(),
            AnonymousGrant::None,
            &never,
        )
        .unwrap();
    }

    #[test]
    fn grants_parse_and_print() {
        for g in [
            AnonymousGrant::None,
            AnonymousGrant::Vdisks,
            AnonymousGrant::All,
        ] {
            assert_eq!(g.to_string().parse::<AnonymousGrant>(), Ok(g));
        }
        assert_eq!(AnonymousGrant::default(), AnonymousGrant::None);
        assert!("some"
            .parse::<AnonymousGrant>()
            .unwrap_err()
            .contains("none, vdisks or all"));
    }
}
