//! Export names of the store server, parsed once at the edge.
//!
//! | export              | serves                                                            |
//! |---------------------|-------------------------------------------------------------------|
//! | `vdisk/NAME`        | the version production targets get at connect time, read-only     |
//! | `vdisk/NAME@V`      | version V (a number, `base`, `production`, `test`, `latest`, …)  |
//! | `maintenance/NAME`  | the maintenance version, read-write, one connection at a time     |
//! | `target/ID`         | a target's vDisk through its server-side write cache              |
//!
//! `target/ID[@ATTACH]+journal` is what an agent that keeps a journal asks for: the same
//! export, whose answered writes need not be durable before they are answered, because
//! the agent sends them again after a server restart (`TargetHold::write_through`).
//!
//! `NAME@V` follows the CLI's syntax (`vdstream_store::names::parse_ref`). Every export's
//! description begins with its canonical name: the version resolved to a number (or
//! `base`), e.g. `vdisk/win11@3 (production)`, so a client can reconnect to exactly that.

use vdstream_store::names::{parse_ref, validate_name};
use vdstream_store::{Layer, Selector};

/// What a client asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExportName {
    /// `vdisk/NAME[@V]` (no `@V`: production).
    Vdisk { vdisk: String, selector: Selector },
    /// `maintenance/NAME[@N]`; with `@N`, only while N is still the maintenance version.
    Maintenance { vdisk: String, version: Option<u32> },
    /// `target/ID` (a new attach), or `target/ID@ATTACH`: a reconnect of the attach whose
    /// export description began with that name (see `target.rs`). `journaled`: the name
    /// ended in `+journal` (an agent that re-sends its answered, unflushed writes).
    /// `secret`: what followed `#` (`target/ID@ATTACH[+journal]#SECRET`), the proof that
    /// the client made the attach; never logged or published.
    Target { id: String, attach: Option<String>, secret: Option<String>, journaled: bool },
}

/// The one-line guide to export names, for error messages.
pub const EXPORT_NAMES_HELP: &str =
    "export names are vdisk/NAME, vdisk/NAME@V (V: a version number, base, production, test or latest), \
     maintenance/NAME and target/ID; list them with `nbdinfo --list URI`";

impl ExportName {
    /// Parses an export name; the error says what is wrong and what the names look like.
    pub fn parse(text: &str) -> Result<ExportName, String> {
        let bad = |why: String| Err(format!("bad export name {text:?}: {why}; {EXPORT_NAMES_HELP}"));
        let Some((kind, rest)) = text.split_once('/') else {
            return bad(if text.is_empty() {
                "this server has no default export".to_string()
            } else {
                "it has no kind (vdisk/, maintenance/ or target/)".to_string()
            });
        };
        match kind {
            "vdisk" => match parse_ref(rest, Selector::Production) {
                Ok((vdisk, Selector::Maintenance)) => bad(format!(
                    "the maintenance version is written through maintenance/{vdisk} (one writer)")),
                Ok((vdisk, selector)) => Ok(ExportName::Vdisk { vdisk, selector }),
                Err(e) => bad(e.to_string()),
            },
            "maintenance" => match parse_ref(rest, Selector::Maintenance) {
                Ok((vdisk, Selector::Maintenance)) => Ok(ExportName::Maintenance { vdisk, version: None }),
                Ok((vdisk, Selector::Number(n))) => Ok(ExportName::Maintenance { vdisk, version: Some(n) }),
                Ok((vdisk, _)) => bad(format!("maintenance/{vdisk} takes no version other than its number")),
                Err(e) => bad(e.to_string()),
            },
            "target" => {
                let (rest, secret) = match rest.split_once(vdstream_nbd::client::SECRET_SEPARATOR) {
                    Some((r, s)) => (r, Some(s)),
                    None => (rest, None),
                };
                if let Some(s) = secret {
                    if s.is_empty() || s.len() > 64 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
                        return bad("what follows '#' is not an attach secret".to_string());
                    }
                }
                let (rest, journaled) = match rest.strip_suffix(vdstream_wcache::JOURNAL_MARKER) {
                    Some(r) => (r, true),
                    None => (rest, false),
                };
                let (id, attach) = match rest.split_once('@') {
                    Some((id, a)) => (id, Some(a)),
                    None => (rest, None),
                };
                if let Some(a) = attach {
                    if a.is_empty() || a.len() > 32 || !a.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()) {
                        return bad(format!("{a:?} is not an attach of target {id} (target/ID@ATTACH is the name a target/ID export describes itself with)"));
                    }
                }
                if secret.is_some() && attach.is_none() {
                    return bad("a secret proves an attach: target/ID@ATTACH#SECRET".to_string());
                }
                match validate_target_id(id) {
                    Ok(()) => Ok(ExportName::Target { id: id.to_string(), attach: attach.map(str::to_string), secret: secret.map(str::to_string), journaled }),
                    Err(e) => bad(e),
                }
            }
            other => bad(format!("unknown kind {other:?}")),
        }
    }
}

/// A target id follows the rules of a vDisk name (it names a cache file).
pub fn validate_target_id(id: &str) -> Result<(), String> {
    validate_name(id).map_err(|e| e.to_string().replace("vDisk name", "target id"))
}

/// An export name as logs and the API show it: without its secret (`#…`).
pub fn shown_name(name: &str) -> &str {
    vdstream_nbd::shown_export_name(name)
}

/// The canonical export name of a layer read-only: `vdisk/NAME@3`, `vdisk/NAME@base`.
pub fn canonical_vdisk(vdisk: &str, layer: Layer) -> String {
    format!("vdisk/{vdisk}@{}", layer.tag())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_three_kinds_parse() {
        assert_eq!(ExportName::parse("vdisk/win11").unwrap(), ExportName::Vdisk { vdisk: "win11".into(), selector: Selector::Production });
        assert_eq!(ExportName::parse("vdisk/win11@3").unwrap(), ExportName::Vdisk { vdisk: "win11".into(), selector: Selector::Number(3) });
        assert_eq!(ExportName::parse("vdisk/win11@base").unwrap(), ExportName::Vdisk { vdisk: "win11".into(), selector: Selector::Base });
        assert_eq!(ExportName::parse("vdisk/w@test").unwrap(), ExportName::Vdisk { vdisk: "w".into(), selector: Selector::Test });
        assert_eq!(ExportName::parse("maintenance/win11").unwrap(), ExportName::Maintenance { vdisk: "win11".into(), version: None });
        assert_eq!(ExportName::parse("maintenance/win11@4").unwrap(), ExportName::Maintenance { vdisk: "win11".into(), version: Some(4) });
        assert_eq!(ExportName::parse("target/vm-1").unwrap(), ExportName::Target { id: "vm-1".into(), attach: None, secret: None, journaled: false });
        assert_eq!(ExportName::parse("target/vm-1@v3").unwrap(), ExportName::Target { id: "vm-1".into(), attach: Some("v3".into()), secret: None, journaled: false });
        assert_eq!(ExportName::parse("target/vm-1+journal").unwrap(), ExportName::Target { id: "vm-1".into(), attach: None, secret: None, journaled: true });
        assert_eq!(ExportName::parse("target/vm-1@k3x+journal").unwrap(), ExportName::Target { id: "vm-1".into(), attach: Some("k3x".into()), secret: None, journaled: true });
        assert_eq!(
            ExportName::parse("target/vm-1@k3x+journal#0a9f").unwrap(),
            ExportName::Target { id: "vm-1".into(), attach: Some("k3x".into()), secret: Some("0a9f".into()), journaled: true }
        );
        assert_eq!(shown_name("target/vm-1@k3x+journal#0a9f"), "target/vm-1@k3x+journal");
    }

    #[test]
    fn bad_names_say_why_and_how() {
        for (name, why) in [
            ("", "no default export"),
            ("win11", "no kind"),
            ("disk/win11", "unknown kind \"disk\""),
            ("vdisk/", "empty"),
            ("vdisk/../x", "'..'"),
            ("vdisk/a/b", "path separator"),
            ("vdisk/w@x", "not a version"),
            ("vdisk/w@0", "not a version"),
            ("vdisk/w@maintenance", "maintenance/w"),
            ("maintenance/w@test", "no version other"),
            ("target/", "empty"),
            ("target/a b", "target id"),
            ("target/a@", "not an attach"),
            ("target/a@X/y", "not an attach"),
            ("target/a#00", "a secret proves an attach"),
            ("target/a@k#", "not an attach secret"),
            ("target/a@k#xyz", "not an attach secret"),
        ] {
            let e = ExportName::parse(name).unwrap_err();
            assert!(e.contains(why), "{name:?}: {e}");
            assert!(e.contains("vdisk/NAME@V"), "{name:?}: {e}");
        }
    }

    #[test]
    fn canonical_names_pin_the_version() {
        assert_eq!(canonical_vdisk("w", Layer::Version(3)), "vdisk/w@3");
        assert_eq!(canonical_vdisk("w", Layer::Base), "vdisk/w@base");
        let back = ExportName::parse(&canonical_vdisk("w", Layer::Version(3))).unwrap();
        assert_eq!(back, ExportName::Vdisk { vdisk: "w".into(), selector: Selector::Number(3) });
    }

    proptest::proptest! {
        #[test]
        fn parsing_never_panics_and_accepted_names_are_safe(text in "\\PC{0,80}") {
            if let Ok(n) = ExportName::parse(&text) {
                let name = match n {
                    ExportName::Vdisk { vdisk, .. } | ExportName::Maintenance { vdisk, .. } => vdisk,
                    ExportName::Target { id, .. } => id,
                };
                proptest::prop_assert!(!name.contains('/') && !name.contains("..") && !name.is_empty());
            }
        }
    }
}
