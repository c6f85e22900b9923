//! vDisk names and `NAME@V` references. The rules are the workspace's contract
//! ([`vdstream_contract::name`], with their tests); these wrappers give the store's error.

use crate::error::Result;
use crate::select::Selector;

pub use vdstream_contract::name::{printable, MAX_NAME_LEN, MAX_TEXT_LEN};

/// Checks text for people a record keeps (a description, a note): one line of at most
/// [`MAX_TEXT_LEN`] characters, no control characters; `what` names the field in the error.
pub fn validate_text(what: &str, text: &str) -> Result<()> {
    vdstream_contract::name::validate_text(what, text)
        .map_err(|e| crate::StoreError::BadInput(e.to_string()))
}

/// Checks a vDisk name; the error says what is wrong and what is allowed.
pub fn validate_name(name: &str) -> Result<()> {
    Ok(vdstream_contract::name::validate_name(name)?)
}

/// Checks a target id: the same rules as a vDisk name, since it names a file
/// (`targets/ID.json`), the target's cache files and its `target/ID` export.
pub fn validate_target_id(id: &str) -> Result<()> {
    Ok(vdstream_contract::name::validate_target_id(id)?)
}

/// Splits `NAME[@V]` into a checked name and a selector (`default` when there is no `@`).
pub fn parse_ref(text: &str, default: Selector) -> Result<(String, Selector)> {
    Ok(vdstream_contract::name::parse_ref(text, default)?)
}
