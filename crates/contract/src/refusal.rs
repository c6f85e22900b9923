//! Refusals of the store server that a client acts on, not only shows: their form on the
//! wire (an NBD error reply's message) written and read here alone.
//!
//! [`AttachGone`]: a reconnect to `target/ID@ATTACH` whose attach the server no longer
//! has (its `server` cache died with the server process that held it, or its
//! `server-persistent` cache now belongs to another attach). It goes with
//! `NBD_REP_ERR_UNKNOWN`; an agent that every server answers so has lost its cache for good
//! and fails its guest's requests with EIO.

use std::fmt;

/// The server no longer has the attach a reconnect names; `why` says what happened to its
/// cache and what to do, for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachGone {
    pub why: String,
}

impl AttachGone {
    /// What starts the refusal's message on the wire.
    const MARK: &'static str = "attach gone: ";

    pub fn new(why: impl Into<String>) -> AttachGone {
        AttachGone { why: why.into() }
    }

    /// The refusal in an error reply's message, as a client reports it (possibly after a
    /// prefix of its own, such as "export could not be opened: "); `None` for any other
    /// message.
    pub fn from_message(message: &str) -> Option<AttachGone> {
        let at = message.find(Self::MARK)?;
        Some(AttachGone::new(&message[at + Self::MARK.len()..]))
    }
}

impl fmt::Display for AttachGone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", Self::MARK, self.why)
    }
}

#[cfg(test)]
mod tests {
    use super::AttachGone;

    #[test]
    fn reads_back_what_it_writes_and_nothing_else() {
        let g = AttachGone::new(
            "the server cache of target vm1 (attach a1) is gone; restart the target",
        );
        let wire = g.to_string();
        assert_eq!(AttachGone::from_message(&wire), Some(g.clone()));
        assert_eq!(
            AttachGone::from_message(&format!("export could not be opened: {wire}")),
            Some(g)
        );
        assert_eq!(
            AttachGone::from_message("export could not be opened: busy"),
            None
        );
        assert_eq!(AttachGone::from_message(""), None);
    }
}
