//! vDisk names and `NAME@V` references.
//!
//! A name becomes a directory (`vdisks/NAME/`) and the stem of every file of the vDisk, so
//! it is checked before anything touches the disk: 1 to 64 characters of `A-Z a-z 0-9 . _ -`,
//! not starting with `.` (hidden files, `.` and `..`) or `-` (it would read as an option),
//! and without `..`. `@` is not allowed because it separates the name from the version in
//! `NAME@V`. Nothing else (no `/`, no spaces, no control characters) can get through, so a
//! name can never escape the store.

use crate::error::{Result, StoreError};
use crate::select::Selector;

/// Longest vDisk name.
pub const MAX_NAME_LEN: usize = 64;

const ALLOWED: &str = "1 to 64 characters of letters, digits, '.', '_' and '-', not starting with '.' or '-', without '..'";

/// Checks a vDisk name; the error says what is wrong and what is allowed.
pub fn validate_name(name: &str) -> Result<()> {
    check_name("vDisk name", name)
}

/// Checks a target id: the same rules as a vDisk name, since it names a file
/// (`targets/ID.json`), the target's cache files and its `target/ID` export.
pub fn validate_target_id(id: &str) -> Result<()> {
    check_name("target id", id)
}

fn check_name(kind: &str, name: &str) -> Result<()> {
    let bad = |what: String| Err(StoreError::BadName(format!("invalid {kind} {name:?}: {what}; a name is {ALLOWED}")));
    if name.is_empty() {
        return bad("it is empty".into());
    }
    if name.chars().count() > MAX_NAME_LEN {
        return bad(format!("it is {} characters long", name.chars().count()));
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        let what = match c {
            '/' | '\\' => "it contains a path separator".to_string(),
            '@' => "it contains '@', which separates a name from a version (NAME@V)".to_string(),
            c if c.is_control() || c.is_whitespace() => format!("it contains the character {c:?}"),
            c => format!("it contains {c:?}"),
        };
        return bad(what);
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
pub fn parse_ref(text: &str, default: Selector) -> Result<(String, Selector)> {
    match text.split_once('@') {
        None => {
            validate_name(text)?;
            Ok((text.to_string(), default))
        }
        Some((name, v)) => {
            validate_name(name)?;
            Ok((name.to_string(), v.parse()?))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_names_pass() {
        for n in ["win11", "a", "Ubuntu-24.04_lts", "x.y", &"a".repeat(64)] {
            validate_name(n).unwrap();
        }
    }

    #[test]
    fn bad_names_say_why() {
        for (n, why) in [
            ("", "empty"),
            ("../etc", "separator"),
            ("a/b", "separator"),
            ("..", "starts with '.'"),
            (".hidden", "starts with '.'"),
            ("-rf", "starts with '-'"),
            ("a..b", "'..'"),
            ("a@2", "'@'"),
            ("a b", "' '"),
            ("tab\t", "'\\t'"),
            ("é", "'é'"),
            (&"a".repeat(65), "65 characters"),
        ] {
            let e = validate_name(n).unwrap_err().to_string();
            assert!(e.contains(why), "{n:?}: {e}");
            assert!(e.contains("a name is 1 to 64 characters"), "{e}");
        }
    }

    #[test]
    fn target_ids_follow_the_same_rules() {
        validate_target_id("vm-01.lab").unwrap();
        let e = validate_target_id("../vm").unwrap_err().to_string();
        assert!(e.starts_with("invalid target id \"../vm\""), "{e}");
    }

    #[test]
    fn refs_split_at_the_at_sign() {
        assert_eq!(parse_ref("w", Selector::Production).unwrap(), ("w".into(), Selector::Production));
        assert_eq!(parse_ref("w@3", Selector::Production).unwrap(), ("w".into(), Selector::Number(3)));
        assert_eq!(parse_ref("w@base", Selector::Production).unwrap().1, Selector::Base);
        assert_eq!(parse_ref("w@latest", Selector::Production).unwrap().1, Selector::Latest);
        assert!(parse_ref("w@x", Selector::Production).is_err());
        assert!(parse_ref("../w@1", Selector::Production).is_err());
    }

    proptest::proptest! {
        #[test]
        fn accepted_names_are_single_safe_path_components(name in "\\PC{0,70}") {
            if validate_name(&name).is_ok() {
                let p = std::path::Path::new(&name);
                proptest::prop_assert_eq!(p.components().count(), 1);
                proptest::prop_assert!(matches!(p.components().next(), Some(std::path::Component::Normal(_))));
                proptest::prop_assert!(!name.contains('@') && !name.contains('/'));
            }
        }
    }
}
