//! The frames two agents (and `vdstream target migrate`) exchange on a migration socket:
//! a kind byte, a 4-byte big-endian payload length, the payload. A payload past
//! [`MAX_PAYLOAD`] or an unknown kind ends the connection: a peer cannot make an agent
//! hold more than one frame.

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

/// The protocol's version, in [`Hello`]; an agent refuses another.
pub const VERSION: u32 = 1;
/// The most data one frame carries.
pub const MAX_DATA: usize = 1 << 20;
/// The largest payload read: data and its offset.
pub const MAX_PAYLOAD: usize = MAX_DATA + 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Destination → source: who asks (JSON [`Hello`]).
    Hello = 1,
    /// Source → destination: the session is open (JSON [`Welcome`]).
    Welcome = 2,
    /// Either way: why the other side stops (UTF-8).
    Error = 3,
    /// Source → destination: 8-byte offset, then the bytes.
    Data = 4,
    /// Source → destination: 8-byte offset, 8-byte length of zeros.
    Zero = 5,
    /// Source → destination: a round ended (JSON [`RoundEnd`]).
    Round = 6,
    /// Source → destination: the final delta is sent (JSON [`Done`]).
    Done = 8,
    /// Destination → source: the final delta is in and flushed; the destination serves.
    Ack = 9,
    /// Control → source: switch now (qemu's migration completed); answered Done or Error.
    Switch = 10,
    /// Control → source: end the session, keep serving; answered Ok.
    Cancel = 11,
    /// Source → control: done (JSON, the source's migration status, or null).
    Ok = 12,
    /// Control → source: the migration's status; answered Ok.
    Query = 13,
    /// Destination → source: the first guest write after the switch is being served.
    Serving = 14,
    /// Control → source, and source → destination: qemu completed; the source ends.
    Commit = 15,
    /// Control → source, and source → destination: qemu failed after the switch-over; the
    /// destination fails its gate (if it served no write) and the source serves on.
    Revert = 16,
    /// Destination → source: reverted; it serves nothing.
    Reverted = 17,
    /// Destination → source, before it opens its vDisk, for the `server` types: which
    /// attach to join (JSON [`Join`]); answered Joined or Error.
    Join = 18,
    /// Source → destination: the attach and its secret (JSON [`Joined`]).
    Joined = 19,
}

impl Kind {
    fn of(b: u8) -> Option<Kind> {
        use Kind::*;
        Some(match b {
            1 => Hello,
            2 => Welcome,
            3 => Error,
            4 => Data,
            5 => Zero,
            6 => Round,
            8 => Done,
            9 => Ack,
            10 => Switch,
            11 => Cancel,
            12 => Ok,
            13 => Query,
            14 => Serving,
            15 => Commit,
            16 => Revert,
            17 => Reverted,
            18 => Join,
            19 => Joined,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Hello {
    pub version: u32,
    pub target: String,
    /// The export the destination reads: it must be the source's (same vDisk version).
    pub export: String,
    pub size: u64,
    /// The destination's cache type's name: it must be the source's.
    pub cache: String,
}

/// A `server`-type destination asks for the attach its source holds on the store server.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Join {
    pub version: u32,
    pub target: String,
    pub cache: String,
}

/// The attach a `server`-type destination joins: its export name and secret, as the store
/// server handed them to the source (sent on the authenticated link only, never logged).
#[derive(Clone, Serialize, Deserialize, PartialEq)]
pub struct Joined {
    pub export: String,
    pub secret: String,
}

impl std::fmt::Debug for Joined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Joined {{ export: {:?}, secret: (hidden) }}",
            self.export
        )
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Welcome {
    /// The source is fenced already (a session after an unacknowledged final delta): the
    /// first round is the final one.
    pub fenced: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RoundEnd {
    pub round: u64,
    /// What the guest dirtied meanwhile: the next round's size.
    pub dirty_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Done {
    pub rounds: u64,
    pub final_bytes: u64,
}

/// What a Commit carries (from `vdstream target migrate` to the source, and on to the
/// destination); an empty payload when no qemu was driven.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct CommitInfo {
    pub qemu_downtime_ms: Option<u64>,
}

impl CommitInfo {
    /// Read from a Commit frame's payload (empty: nothing known).
    pub fn of(payload: &[u8]) -> CommitInfo {
        serde_json::from_slice(payload).unwrap_or_default()
    }
}

/// One frame read.
#[derive(Debug)]
pub struct Frame {
    pub kind: Kind,
    pub payload: Vec<u8>,
}

impl Frame {
    pub fn json<T: for<'de> Deserialize<'de>>(&self) -> std::io::Result<T> {
        serde_json::from_slice(&self.payload)
            .map_err(|e| bad(format!("a bad {:?} frame: {e}", self.kind)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.payload).into_owned()
    }

    /// A Data frame's offset and bytes, or a Zero frame's offset and length.
    pub fn offset_and_rest(&self) -> std::io::Result<(u64, &[u8])> {
        if self.payload.len() < 8 {
            return Err(bad(format!("a {:?} frame without its offset", self.kind)));
        }
        let (head, rest) = self.payload.split_at(8);
        Ok((u64::from_be_bytes(head.try_into().expect("8 bytes")), rest))
    }
}

pub fn bad(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg)
}

/// Reads one frame; `Ok(None)` at a clean end of stream before a frame.
pub fn read(r: &mut impl Read) -> std::io::Result<Option<Frame>> {
    let mut head = [0u8; 5];
    match r.read(&mut head[..1])? {
        0 => return Ok(None),
        _ => r.read_exact(&mut head[1..])?,
    }
    let kind =
        Kind::of(head[0]).ok_or_else(|| bad(format!("an unknown frame kind {}", head[0])))?;
    let len = u32::from_be_bytes(head[1..].try_into().expect("4 bytes")) as usize;
    if len > MAX_PAYLOAD {
        return Err(bad(format!(
            "a {kind:?} frame of {len} bytes (at most {MAX_PAYLOAD})"
        )));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    Ok(Some(Frame { kind, payload }))
}

/// Writes one frame of `parts` (joined), flushed unless it carries data; returns the bytes
/// written.
pub fn write(w: &mut impl Write, kind: Kind, parts: &[&[u8]]) -> std::io::Result<u64> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut head = [0u8; 5];
    head[0] = kind as u8;
    head[1..].copy_from_slice(&(len as u32).to_be_bytes());
    w.write_all(&head)?;
    for p in parts {
        w.write_all(p)?;
    }
    // Data and zero frames come in runs: the frame that ends a run (a round's end) flushes.
    if !matches!(kind, Kind::Data | Kind::Zero) {
        w.flush()?;
    }
    Ok(5 + len as u64)
}

pub fn write_json<T: Serialize>(w: &mut impl Write, kind: Kind, v: &T) -> std::io::Result<u64> {
    let body = serde_json::to_vec(v).map_err(|e| bad(e.to_string()))?;
    write(w, kind, &[&body])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_hostile_ones_are_refused() {
        let mut buf = Vec::new();
        write(&mut buf, Kind::Data, &[&7u64.to_be_bytes(), b"abc"]).unwrap();
        write_json(
            &mut buf,
            Kind::Round,
            &RoundEnd {
                round: 2,
                dirty_bytes: 9,
            },
        )
        .unwrap();
        let mut r = &buf[..];
        let f = read(&mut r).unwrap().unwrap();
        assert_eq!(f.offset_and_rest().unwrap(), (7, &b"abc"[..]));
        let f = read(&mut r).unwrap().unwrap();
        assert_eq!(f.json::<RoundEnd>().unwrap().dirty_bytes, 9);
        assert!(read(&mut r).unwrap().is_none());
        let huge = [4u8, 0xff, 0xff, 0xff, 0xff];
        assert!(read(&mut &huge[..])
            .unwrap_err()
            .to_string()
            .contains("at most"));
        assert!(read(&mut &[99u8, 0, 0, 0, 0][..])
            .unwrap_err()
            .to_string()
            .contains("unknown"));
        // A frame cut short is an error, not a clean end.
        assert!(read(&mut &buf[..7]).is_err());
    }
}
