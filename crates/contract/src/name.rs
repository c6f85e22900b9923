//! Names: vDisk names, target ids, version selectors (`NAME@V`) and export names.
//!
//! A vDisk name (or target id) becomes a directory or file stem, so it is checked before
//! anything touches a disk: 1 to 64 characters of `A-Z a-z 0-9 . _ -`, not starting with
//! `.` (hidden files, `.` and `..`) or `-` (it would read as an option), and without `..`.
//! `@` is not allowed because it separates the name from the version in `NAME@V`. Nothing
//! else (no `/`, no spaces, no control characters) gets through, so a name never escapes
//! the store.
//!
//! Export names of the store server:
//!
//! | export              | serves                                                            |
//! |---------------------|-------------------------------------------------------------------|
//! | `vdisk/NAME`        | the version production targets get at connect time, read-only     |
//! | `vdisk/NAME@V`      | version V (a number, `base`, `production`, `test`, `latest`)      |
//! | `maintenance/NAME`  | the maintenance version, read-write, one connection at a time     |
//! | `target/ID`         | a target's vDisk through its write cache (a new attach)           |
//! | `target/ID@ATTACH`  | a reconnect of that attach (`vN` for the device cache types)      |
//!
//! `…+journal` after a target's name ([`JOURNAL_MARKER`]) is what an agent that keeps a
//! journal asks for; `…#SECRET` after it ([`SECRET_SEPARATOR`]) proves the attach and is
//! never logged. Invariant: `parse(x.to_string()) == x` for every [`ExportName`] the
//! parser accepts, and the parser refuses every name that could escape the store.

use std::fmt;
use std::str::FromStr;

use crate::ContractError;

/// Longest vDisk name.
pub const MAX_NAME_LEN: usize = 64;

/// Appended to a target's export name (`target/ID[@ATTACH]+journal`) by an agent that keeps
/// a journal of answered, unflushed writes: the server may then answer writes before they
/// are durable, because the agent sends them again after a server restart.
pub const JOURNAL_MARKER: &str = "+journal";

/// Separates an export name from the attach secret that proves a reconnect
/// (`target/vm1@A#SECRET`); what follows it is never shown.
pub const SECRET_SEPARATOR: char = '#';

/// The one-line guide to export names, for error messages.
pub const EXPORT_NAMES_HELP: &str =
    "export names are vdisk/NAME, vdisk/NAME@V (V: a version number, base, production, test or latest), \
     maintenance/NAME and target/ID; list them with `nbdinfo --list URI`";

const ALLOWED: &str = "1 to 64 characters of letters, digits, '.', '_' and '-', not starting with '.' or '-', without '..'";

/// Checks a vDisk name; the error says what is wrong and what is allowed.
pub fn validate_name(name: &str) -> Result<(), ContractError> {
    check_name("vDisk name", name)
}

/// Checks a target id: the same rules as a vDisk name, since it names a file
/// (`targets/ID.json`), the target's cache files and its `target/ID` export.
pub fn validate_target_id(id: &str) -> Result<(), ContractError> {
    check_name("target id", id)
}

/// Longest text for people that a record keeps (a target's description, a version's
/// note), in characters: what a JSON Schema `maxLength` counts, so the API's schema states
/// the rule exactly.
pub const MAX_TEXT_LEN: usize = 1024;

/// Checks text for people that a record keeps and commands print (a target's description,
/// a version's note): at most [`MAX_TEXT_LEN`] characters on one line, with no control
/// character, so that printing it cannot rewrite a terminal (ANSI or OSC escapes) or fake
/// a line of output. `what` names the field in the error.
pub fn validate_text(what: &str, text: &str) -> Result<(), ContractError> {
    let chars = text.chars().count();
    if chars > MAX_TEXT_LEN {
        return Err(ContractError::BadName(format!(
            "{what} is {chars} characters; it is at most {MAX_TEXT_LEN} characters of text on one line"
        )));
    }
    if let Some(c) = text.chars().find(|c| c.is_control()) {
        return Err(ContractError::BadName(format!(
            "{what} holds the control character {c:?}; it is at most {MAX_TEXT_LEN} characters of text on one line, without control characters (no newlines or terminal escapes)")));
    }
    Ok(())
}

/// Text from a record as it is safe to print on a terminal: control characters (a record
/// written before [`validate_text`] held, or by hand) shown escaped.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if text.chars().any(char::is_control) {
        text.chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_default().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect::<String>()
            .into()
    } else {
        text.into()
    }
}

fn check_name(kind: &str, name: &str) -> Result<(), ContractError> {
    let bad = |what: String| {
        Err(ContractError::BadName(format!(
            "invalid {kind} {name:?}: {what}; a name is {ALLOWED}"
        )))
    };
    if name.is_empty() {
        return bad("it is empty".into());
    }
    if name.chars().count() > MAX_NAME_LEN {
        return bad(format!("it is {} characters long", name.chars().count()));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return bad(match c {
            '/' | '\\' => "it contains a path separator".to_string(),
            '@' => "it contains '@', which separates a name from a version (NAME@V)".to_string(),
            c if c.is_control() || c.is_whitespace() => format!("it contains the character {c:?}"),
            c => format!("it contains {c:?}"),
        });
    }
    if name.starts_with('.') {
        return bad("it starts with '.'".into());
    }
    if name.starts_with('-') {
        return bad("it starts with '-'".into());
    }
    if name.contains("..") {
        return bad("it contains '..'".into());
    }
    Ok(())
}

/// Splits `NAME[@V]` into a checked name and a selector (`default` when there is no `@`).
pub fn parse_ref(text: &str, default: Selector) -> Result<(String, Selector), ContractError> {
    let (name, selector) = match text.split_once('@') {
        None => (text, default),
        Some((name, v)) => (name, v.parse()?),
    };
    validate_name(name)?;
    Ok((name.to_string(), selector))
}

/// What a `NAME@V` reference asks for (the store resolves it to a layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Selector {
    Number(u32),
    Base,
    Production,
    Test,
    Maintenance,
    Latest,
}

impl FromStr for Selector {
    type Err = ContractError;

    fn from_str(s: &str) -> Result<Self, ContractError> {
        Ok(match s {
            "base" => Selector::Base,
            "production" | "prod" => Selector::Production,
            "test" => Selector::Test,
            "maintenance" => Selector::Maintenance,
            "latest" => Selector::Latest,
            // Digits only, no leading zero (u32's parser would take "+7" and "007"): one
            // spelling per version, as the TargetVersion schema's pattern says (schema.rs).
            n => match n
                .bytes()
                .all(|b| b.is_ascii_digit())
                .then(|| n.parse::<u32>())
            {
                Some(Ok(n)) if n > 0 && !s.starts_with('0') => Selector::Number(n),
                _ => {
                    return Err(ContractError::BadVersion(format!(
                        "{s:?} is not a version: use a version number (1, 2, …), base, production, test, maintenance or latest"
                    )))
                }
            },
        })
    }
}

/// The canonical text of a selector, as `NAME@V` takes it (`prod` prints as `production`).
impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Selector::Number(n) => write!(f, "{n}"),
            Selector::Base => f.write_str("base"),
            Selector::Production => f.write_str("production"),
            Selector::Test => f.write_str("test"),
            Selector::Maintenance => f.write_str("maintenance"),
            Selector::Latest => f.write_str("latest"),
        }
    }
}

/// In JSON a selector is its text (`"production"`, `"3"`); a number is taken too.
impl serde::Serialize for Selector {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Selector {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Text;
        impl serde::de::Visitor<'_> for Text {
            type Value = Selector;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a version: a number, base, production, test, maintenance or latest")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Selector, E> {
                v.parse().map_err(E::custom)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Selector, E> {
                self.visit_str(&v.to_string())
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Selector, E> {
                self.visit_str(&v.to_string())
            }
        }
        d.deserialize_any(Text)
    }
}

/// What a client asks a store server for (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ExportName {
    /// `vdisk/NAME[@V]` (no `@V`: production). Never `Selector::Maintenance`.
    Vdisk { vdisk: String, selector: Selector },
    /// `maintenance/NAME[@N]`; with `@N`, only while N is still the maintenance version.
    Maintenance { vdisk: String, version: Option<u32> },
    /// `target/ID` (a new attach), or `target/ID@ATTACH`: a reconnect of the attach whose
    /// export description began with that name. `journaled`: the name ended in
    /// [`JOURNAL_MARKER`]. `secret`: what followed [`SECRET_SEPARATOR`], the proof that the
    /// client made the attach (only with an `attach`); never logged or published.
    Target {
        id: String,
        attach: Option<String>,
        secret: Option<String>,
        journaled: bool,
    },
}

/// An export name as logs and published lists may show it: without the credential a client
/// may append after [`SECRET_SEPARATOR`] (`target/vm1@A#SECRET` → `target/vm1@A`). Any
/// text, not only this grammar: an NBD server also logs the names clients ask of exports
/// that are not a store's (serve-image's, or a name that does not parse).
pub fn shown_export_name(text: &str) -> &str {
    text.split_once(SECRET_SEPARATOR)
        .map_or(text, |(shown, _)| shown)
}

impl ExportName {
    /// The name as logs, audit lines and refusals may show it: its text without the
    /// attach secret ([`shown_export_name`]).
    pub fn shown(&self) -> String {
        shown_export_name(&self.to_string()).to_owned()
    }

    /// Whether the name reaches one fixed vDisk version (or attach) whatever the store's
    /// metadata says later: `vdisk/NAME@3`, `vdisk/NAME@base`, `target/ID@ATTACH`.
    pub fn is_pinned(&self) -> bool {
        match self {
            ExportName::Vdisk { selector, .. } => {
                matches!(selector, Selector::Number(_) | Selector::Base)
            }
            ExportName::Target { attach, .. } => attach.is_some(),
            ExportName::Maintenance { .. } => false,
        }
    }

    /// The name without the version or attach it pins, journal or secret (`vdisk/w@3` →
    /// `vdisk/w`): two names with the same base reach the same vDisk or target.
    pub fn unpinned(&self) -> ExportName {
        match self {
            ExportName::Vdisk { vdisk, .. } => ExportName::Vdisk {
                vdisk: vdisk.clone(),
                selector: Selector::Production,
            },
            ExportName::Maintenance { vdisk, .. } => ExportName::Maintenance {
                vdisk: vdisk.clone(),
                version: None,
            },
            ExportName::Target { id, .. } => ExportName::Target {
                id: id.clone(),
                attach: None,
                secret: None,
                journaled: false,
            },
        }
    }
}

fn is_attach(a: &str) -> bool {
    !a.is_empty()
        && a.len() <= 32
        && a.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

fn is_secret(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

impl FromStr for ExportName {
    type Err = ContractError;

    /// Parses an export name; the error says what is wrong and what the names look like.
    fn from_str(text: &str) -> Result<ExportName, ContractError> {
        let bad = |why: String| {
            Err(ContractError::BadExportName {
                text: text.to_string(),
                why,
            })
        };
        let Some((kind, rest)) = text.split_once('/') else {
            return bad(if text.is_empty() {
                "this server has no default export"
            } else {
                "it has no kind (vdisk/, maintenance/ or target/)"
            }
            .into());
        };
        match kind {
            "vdisk" => match parse_ref(rest, Selector::Production) {
                Ok((vdisk, Selector::Maintenance)) => bad(format!(
                    "the maintenance version is written through maintenance/{vdisk} (one writer)"
                )),
                Ok((vdisk, selector)) => Ok(ExportName::Vdisk { vdisk, selector }),
                Err(e) => bad(e.to_string()),
            },
            "maintenance" => match parse_ref(rest, Selector::Maintenance) {
                Ok((vdisk, Selector::Maintenance)) => Ok(ExportName::Maintenance {
                    vdisk,
                    version: None,
                }),
                Ok((vdisk, Selector::Number(n))) => Ok(ExportName::Maintenance {
                    vdisk,
                    version: Some(n),
                }),
                Ok((vdisk, _)) => bad(format!(
                    "maintenance/{vdisk} takes no version other than its number"
                )),
                Err(e) => bad(e.to_string()),
            },
            "target" => {
                let (rest, secret) = match rest.split_once(SECRET_SEPARATOR) {
                    Some((_, s)) if !is_secret(s) => {
                        return bad("what follows '#' is not an attach secret".into())
                    }
                    Some((r, s)) => (r, Some(s.to_string())),
                    None => (rest, None),
                };
                let (rest, journaled) = rest
                    .strip_suffix(JOURNAL_MARKER)
                    .map_or((rest, false), |r| (r, true));
                let (id, attach) = match rest.split_once('@') {
                    Some((id, a)) if !is_attach(a) => {
                        return bad(format!("{a:?} is not an attach of target {id} (target/ID@ATTACH is the name a target/ID export describes itself with)"))
                    }
                    Some((id, a)) => (id, Some(a.to_string())),
                    None => (rest, None),
                };
                if secret.is_some() && attach.is_none() {
                    return bad("a secret proves an attach: target/ID@ATTACH#SECRET".into());
                }
                match validate_target_id(id) {
                    Ok(()) => Ok(ExportName::Target {
                        id: id.to_string(),
                        attach,
                        secret,
                        journaled,
                    }),
                    Err(e) => bad(e.to_string()),
                }
            }
            other => bad(format!("unknown kind {other:?}")),
        }
    }
}

/// The canonical form: `vdisk/NAME` for production, else `vdisk/NAME@V`; `maintenance/NAME[@N]`;
/// `target/ID[@ATTACH][+journal][#SECRET]`.
impl fmt::Display for ExportName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExportName::Vdisk {
                vdisk,
                selector: Selector::Production,
            } => write!(f, "vdisk/{vdisk}"),
            ExportName::Vdisk { vdisk, selector } => write!(f, "vdisk/{vdisk}@{selector}"),
            ExportName::Maintenance {
                vdisk,
                version: None,
            } => write!(f, "maintenance/{vdisk}"),
            ExportName::Maintenance {
                vdisk,
                version: Some(n),
            } => write!(f, "maintenance/{vdisk}@{n}"),
            ExportName::Target {
                id,
                attach,
                secret,
                journaled,
            } => {
                write!(f, "target/{id}")?;
                if let Some(a) = attach {
                    write!(f, "@{a}")?;
                }
                if *journaled {
                    f.write_str(JOURNAL_MARKER)?;
                }
                match secret {
                    Some(s) => write!(f, "{SECRET_SEPARATOR}{s}"),
                    None => Ok(()),
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(s: &str) -> Result<ExportName, ContractError> {
        s.parse()
    }

    #[test]
    fn text_for_people_is_one_bounded_line_without_escapes() {
        assert!(validate_text("a note", "patched KB5034441 — ok").is_ok());
        assert!(validate_text("a note", &"x".repeat(MAX_TEXT_LEN)).is_ok());
        // Characters, not bytes: 1024 of them in 3 bytes each is still one note.
        assert!(validate_text("a note", &"é".repeat(MAX_TEXT_LEN)).is_ok());
        assert!(validate_text("a note", &"é".repeat(MAX_TEXT_LEN + 1)).is_err());
        let e = validate_text("a note", &"x".repeat(100 * 1024))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("a note is 102400 characters") && e.contains("at most 1024"),
            "{e}"
        );
        for bad in [
            "two\nlines",
            "bell\u{7}",
            "\u{1b}]0;owned\u{7}",
            "\u{1b}[2J",
            "nul\0",
            "c1\u{9b}31m",
        ] {
            let e = validate_text("a note", bad).unwrap_err().to_string();
            assert!(e.contains("control character"), "{bad:?}: {e}");
        }
        assert_eq!(printable("plain"), "plain");
        assert_eq!(printable("a\u{1b}[2Jb\nc"), "a\\u{1b}[2Jb\\nc");
    }

    #[test]
    fn the_three_kinds_parse() {
        let target = |attach: Option<&str>, secret: Option<&str>, journaled| ExportName::Target {
            id: "vm-1".into(),
            attach: attach.map(Into::into),
            secret: secret.map(Into::into),
            journaled,
        };
        for (text, want) in [
            (
                "vdisk/win11",
                ExportName::Vdisk {
                    vdisk: "win11".into(),
                    selector: Selector::Production,
                },
            ),
            (
                "vdisk/win11@3",
                ExportName::Vdisk {
                    vdisk: "win11".into(),
                    selector: Selector::Number(3),
                },
            ),
            (
                "vdisk/win11@base",
                ExportName::Vdisk {
                    vdisk: "win11".into(),
                    selector: Selector::Base,
                },
            ),
            (
                "vdisk/w@test",
                ExportName::Vdisk {
                    vdisk: "w".into(),
                    selector: Selector::Test,
                },
            ),
            (
                "maintenance/win11",
                ExportName::Maintenance {
                    vdisk: "win11".into(),
                    version: None,
                },
            ),
            (
                "maintenance/win11@4",
                ExportName::Maintenance {
                    vdisk: "win11".into(),
                    version: Some(4),
                },
            ),
            ("target/vm-1", target(None, None, false)),
            ("target/vm-1@v3", target(Some("v3"), None, false)),
            ("target/vm-1+journal", target(None, None, true)),
            ("target/vm-1@k3x+journal", target(Some("k3x"), None, true)),
            (
                "target/vm-1@k3x+journal#0a9f",
                target(Some("k3x"), Some("0a9f"), true),
            ),
        ] {
            assert_eq!(parse(text).unwrap(), want, "{text}");
            assert_eq!(want.to_string(), text);
        }
        assert_eq!(
            shown_export_name("target/vm-1@k3x+journal#0a9f"),
            "target/vm-1@k3x+journal"
        );
        assert_eq!(
            target(Some("k3x"), Some("0a9f"), true).shown(),
            "target/vm-1@k3x+journal",
            "the secret is never shown"
        );
        // Names outside the grammar lose what follows '#' too; without one they are kept.
        for (text, shown) in [
            ("target/a#00", "target/a"),
            ("disk#x#y", "disk"),
            ("", ""),
            ("plain image", "plain image"),
            ("#", ""),
        ] {
            assert_eq!(shown_export_name(text), shown, "{text:?}");
        }
        assert_eq!(parse("vdisk/w@prod").unwrap().to_string(), "vdisk/w");
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
            let e = parse(name).unwrap_err().to_string();
            assert!(e.contains(why), "{name:?}: {e}");
            assert!(
                e.starts_with(&format!("bad export name {name:?}")) && e.contains("vdisk/NAME@V"),
                "{name:?}: {e}"
            );
        }
    }

    #[test]
    fn names_say_why_they_are_refused() {
        for n in ["win11", "a", "Ubuntu-24.04_lts", "x.y", &"a".repeat(64)] {
            validate_name(n).unwrap();
        }
        for (n, why) in [
            ("", "empty"),
            ("../etc", "separator"),
            ("..", "starts with '.'"),
            ("-rf", "starts with '-'"),
            ("a..b", "'..'"),
            ("a@2", "'@'"),
            ("tab\t", "'\\t'"),
            ("é", "'é'"),
            (&"a".repeat(65), "65 characters"),
        ] {
            let e = validate_name(n).unwrap_err().to_string();
            assert!(
                e.contains(why) && e.contains("a name is 1 to 64 characters"),
                "{n:?}: {e}"
            );
        }
        assert!(validate_target_id("../vm")
            .unwrap_err()
            .to_string()
            .starts_with("invalid target id \"../vm\""));
        assert_eq!(
            parse_ref("w@latest", Selector::Production).unwrap(),
            ("w".into(), Selector::Latest)
        );
        assert!("newest"
            .parse::<Selector>()
            .unwrap_err()
            .to_string()
            .contains("latest"));
        assert_eq!(
            serde_json::from_str::<Selector>("7").unwrap(),
            Selector::Number(7)
        );
        assert_eq!(serde_json::to_string(&Selector::Test).unwrap(), "\"test\"");
        // One spelling per number: digits, no sign, no leading zero, within u32.
        assert_eq!(
            "4294967295".parse::<Selector>().unwrap(),
            Selector::Number(u32::MAX)
        );
        for bad in ["0", "+7", "007", "-1", " 7", "4294967296", ""] {
            assert!(bad.parse::<Selector>().is_err(), "{bad:?} was taken");
        }
    }

    /// A valid vDisk name or target id.
    pub(crate) fn a_name() -> impl Strategy<Value = String> {
        "[A-Za-z0-9_][A-Za-z0-9._-]{0,20}".prop_filter("valid", |n| validate_name(n).is_ok())
    }

    pub(crate) fn a_selector() -> impl Strategy<Value = Selector> {
        prop_oneof![
            (1u32..).prop_map(Selector::Number),
            Just(Selector::Base),
            Just(Selector::Production),
            Just(Selector::Test),
            Just(Selector::Latest)
        ]
    }

    pub(crate) fn an_export_name() -> impl Strategy<Value = ExportName> {
        let attach_secret =
            proptest::option::of(("[a-z0-9]{1,32}", proptest::option::of("[0-9a-fA-F]{1,64}")));
        prop_oneof![
            (a_name(), a_selector())
                .prop_map(|(vdisk, selector)| ExportName::Vdisk { vdisk, selector }),
            (a_name(), proptest::option::of(1u32..))
                .prop_map(|(vdisk, version)| ExportName::Maintenance { vdisk, version }),
            (a_name(), attach_secret, any::<bool>()).prop_map(|(id, a, journaled)| {
                ExportName::Target {
                    id,
                    attach: a.as_ref().map(|(a, _)| a.clone()),
                    secret: a.and_then(|(_, s)| s),
                    journaled,
                }
            }),
        ]
    }

    proptest! {
        #[test]
        fn display_then_parse_gives_the_same_name(name in an_export_name()) {
            prop_assert_eq!(parse(&name.to_string()), Ok(name.clone()));
            let text = name.to_string();
            let shown = shown_export_name(&text);
            prop_assert!(!shown.contains(SECRET_SEPARATOR));
            if let ExportName::Target { id, attach, secret: Some(_), journaled } = &name {
                let without = ExportName::Target { id: id.clone(), attach: attach.clone(), secret: None, journaled: *journaled };
                prop_assert_eq!(parse(shown), Ok(without));
            } else {
                prop_assert_eq!(shown, text.as_str());
            }
        }

        #[test]
        fn accepted_names_are_canonical_and_safe(text in "\\PC{0,80}") {
            if let Ok(n) = parse(&text) {
                let name = match &n {
                    ExportName::Vdisk { vdisk, .. } | ExportName::Maintenance { vdisk, .. } => vdisk,
                    ExportName::Target { id, .. } => id,
                };
                let p = std::path::Path::new(name);
                prop_assert_eq!(p.components().count(), 1);
                prop_assert!(matches!(p.components().next(), Some(std::path::Component::Normal(_))));
                prop_assert_eq!(parse(&n.to_string()), Ok(n));
            }
        }
    }
}
