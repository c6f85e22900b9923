//! The export description a store server sends with each export (`NBD_INFO_DESCRIPTION`,
//! what `nbdinfo` shows), written and read only through [`ExportDescription`].
//!
//! Grammar (format 1), one line:
//!
//! ```text
//! DESCRIPTION := EXPORT [" " READS] " (" NOTE ")"
//! EXPORT      := an ExportName, pinned to what was opened: vdisk/w@3, maintenance/w@4,
//!                target/vm1@k3x, target/vm1@v3 (with #SECRET only to the client that
//!                made the attach)
//! READS       := vdisk/NAME@V, the vDisk version a target export reads
//! NOTE        := text for people (access, cache type, server); never interpreted
//! ```
//!
//! e.g. `vdisk/win11@3 (production)` or `target/vm1@k3x vdisk/win11@3 (a server cache on
//! server s1, read-write, one writer)`. Why a description and not another channel: it is
//! the one per-export text NBD carries to every client, so nbdinfo shows people the same
//! line the agent reads, and NBD servers other than vdstream's (whose descriptions do not
//! parse) are simply not pinned. Machines read only EXPORT and READS, through
//! [`FromStr`]; a later format may add words before the note, never change these two.

use std::fmt;
use std::str::FromStr;

use crate::name::ExportName;
use crate::ContractError;

/// What a store server says an export is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportDescription {
    /// The export as opened, its version or attach resolved (see [`ExportName::is_pinned`]).
    pub export: ExportName,
    /// For a target export: the vDisk version it reads (`vdisk/NAME@V`).
    pub reads: Option<ExportName>,
    /// For people; no `\n`, and it is never parsed.
    pub note: String,
}

impl ExportDescription {
    /// The pinned export, without secret, if the description names one: reconnecting to
    /// it reaches the same bytes (`vdisk/w@3`, `target/vm1@k3x`).
    pub fn pin(&self) -> Option<ExportName> {
        self.export.is_pinned().then(|| {
            let mut shown = self.clone();
            shown.take_secret();
            shown.export
        })
    }

    /// The vDisk version the export reads: `reads`, or the export itself when it is a
    /// pinned `vdisk/NAME@V`. A device type may read it through `target/ID@vN` or `vdisk/`.
    pub fn vdisk_version(&self) -> Option<ExportName> {
        self.reads.clone().or_else(|| {
            (matches!(self.export, ExportName::Vdisk { .. }) && self.export.is_pinned())
                .then(|| self.export.clone())
        })
    }

    /// Puts the attach secret into the export's name, for the one client that made the
    /// attach (`target/ID@ATTACH#SECRET …`); nothing for other kinds of export.
    pub fn set_secret(&mut self, new: String) {
        if let ExportName::Target { secret, .. } = &mut self.export {
            *secret = Some(new);
        }
    }

    /// Takes the attach secret out of the export's name (the agent keeps it apart).
    pub fn take_secret(&mut self) -> Option<String> {
        match &mut self.export {
            ExportName::Target { secret, .. } => secret.take(),
            _ => None,
        }
    }
}

impl fmt::Display for ExportDescription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.export)?;
        if let Some(r) = &self.reads {
            write!(f, " {r}")?;
        }
        write!(f, " ({})", self.note)
    }
}

impl FromStr for ExportDescription {
    type Err = ContractError;

    fn from_str(text: &str) -> Result<Self, ContractError> {
        let bad = |why: String| ContractError::BadDescription {
            text: text.to_string(),
            why,
        };
        let (head, note) = text
            .split_once(" (")
            .ok_or_else(|| bad("it has no \" (NOTE)\"".into()))?;
        let note = note
            .strip_suffix(')')
            .filter(|n| !n.contains('\n'))
            .ok_or_else(|| bad("its note does not end the line with ')'".into()))?;
        let mut words = head.split(' ');
        let export: ExportName = words
            .next()
            .unwrap_or_default()
            .parse()
            .map_err(|e: ContractError| bad(e.to_string()))?;
        let reads = match words.next() {
            None => None,
            Some(w) => match w.parse().map_err(|e: ContractError| bad(e.to_string()))? {
                r @ ExportName::Vdisk { .. } if r.is_pinned() => Some(r),
                _ => return Err(bad(format!("{w:?} is not a vDisk version (vdisk/NAME@V)"))),
            },
        };
        if words.next().is_some() {
            return Err(bad("more than two names before the note".into()));
        }
        Ok(ExportDescription {
            export,
            reads,
            note: note.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::name::tests::{a_name, an_export_name};
    use crate::name::Selector;
    use proptest::prelude::*;

    #[test]
    fn what_the_server_writes_the_agent_reads() {
        let d: ExportDescription =
            "target/vm1@a1f#00ff99 vdisk/w@3 (a server cache on server s, read-write, one writer)"
                .parse()
                .unwrap();
        assert_eq!(
            d.reads,
            Some(ExportName::Vdisk {
                vdisk: "w".into(),
                selector: Selector::Number(3)
            })
        );
        let mut shown = d.clone();
        assert_eq!(shown.take_secret().as_deref(), Some("00ff99"));
        let mut again = shown.clone();
        again.set_secret("00ff99".into());
        assert_eq!(again, d);
        assert_eq!(
            shown.to_string(),
            "target/vm1@a1f vdisk/w@3 (a server cache on server s, read-write, one writer)"
        );
        assert_eq!(d.pin().unwrap().to_string(), "target/vm1@a1f");
        let p: ExportDescription = "vdisk/w@base (base)".parse().unwrap();
        assert_eq!(
            (p.pin().map(|p| p.to_string()), p.note.as_str()),
            (Some("vdisk/w@base".into()), "base")
        );
        assert_eq!(d.vdisk_version(), d.reads);
        assert_eq!(p.vdisk_version(), Some(p.export.clone()));
        let unpinned: ExportDescription = "target/vm1 vdisk/w@3 (a server cache on server s)"
            .parse()
            .unwrap();
        assert_eq!(unpinned.pin(), None);
        assert_eq!(
            "maintenance/w@4 (maintenance, read-write, one writer)"
                .parse::<ExportDescription>()
                .unwrap()
                .pin(),
            None
        );
    }

    #[test]
    fn other_servers_descriptions_are_refused_with_the_reason() {
        for (text, why) in [
            ("a disk image", "no \" (NOTE)\""),
            ("vdisk/w@3 (production", "end the line"),
            ("disk/w (x)", "unknown kind"),
            ("target/t vdisk/w (x)", "not a vDisk version"),
            ("target/t maintenance/w@2 (x)", "not a vDisk version"),
            ("vdisk/w@3 vdisk/w@3 vdisk/w@3 (x)", "more than two"),
        ] {
            let e = text.parse::<ExportDescription>().unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(text), "{text:?}: {e}");
        }
    }

    fn a_vdisk_version() -> impl Strategy<Value = ExportName> {
        (
            a_name(),
            prop_oneof![(1u32..).prop_map(Selector::Number), Just(Selector::Base)],
        )
            .prop_map(|(vdisk, selector)| ExportName::Vdisk { vdisk, selector })
    }

    proptest! {
        #[test]
        fn display_then_parse_gives_the_same_description(
            export in an_export_name(), reads in proptest::option::of(a_vdisk_version()), note in "[^\n]{0,60}",
        ) {
            let d = ExportDescription { export, reads, note };
            prop_assert_eq!(d.to_string().parse::<ExportDescription>(), Ok(d));
        }
    }
}
