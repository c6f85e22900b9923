//! The agent's journal of answered, unflushed changes, for `server-persistent` targets.
//!
//! A `server-persistent` cache is durable at FLUSH: what its server answered since the last
//! flush may be gone if the server process dies (its map is the last flushed one). The
//! guest, though, never sees the server die: the agent reconnects and re-sends what was in
//! flight. So every write, trim and zero the server answered is kept here until a FLUSH
//! sent after it succeeds, and on every new connection the link sends the kept changes
//! again, in the order they were answered, before any other request uses it. The server
//! then need not make each write durable before answering it (the store server's
//! write-through, which cost a sync per write); the agent asks for its export with
//! [`vdstream_contract::name::JOURNAL_MARKER`] so that the server knows.
//!
//! Invariants:
//! - An entry is kept from its answer until a flush *sent after* that answer succeeds
//!   ([`Journal::mark`] before sending, [`Journal::flushed`] on success): NBD's flush covers
//!   the writes completed before it was sent, no others.
//! - A replay for connection `g` ([`Journal::snapshot`]) holds every entry answered on an
//!   older connection and recorded before it. An answer from an older connection recorded
//!   after that snapshot ([`Recorded::Missed`]) is not kept: its sender sends the change
//!   again on the current connection and records that answer instead, so nothing answered
//!   is left out of the new connection and nothing is applied twice out of order.
//! - Entries replay in answer order: of two answered changes to one range the later one
//!   wins, as it did on the server that died. (Changes to overlapping ranges in flight at
//!   once have no order in NBD; guests do not send them.)
//! - Bytes kept are bounded by the caller: past `cap` ([`Journal::over_cap`]) the sender
//!   flushes, which empties the journal of everything answered before.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use vdstream_blockdev::ZeroFlags;
use vdstream_nbd::client::{Client, ClientError};

use super::Request;

/// One answered change.
#[derive(Debug, Clone)]
pub(crate) enum Change {
    Write(Arc<[u8]>),
    Trim(u32),
    Zero(u32, ZeroFlags),
}

impl Change {
    fn bytes(&self) -> u64 {
        match self {
            Change::Write(d) => d.len() as u64,
            // What an entry costs to keep, not what it covers.
            Change::Trim(_) | Change::Zero(..) => 64,
        }
    }

    /// The request that sends the change again: the original one (only changes sent without
    /// FUA are kept; the flush that ends the journal makes them durable).
    fn request(&self) -> Request<'_> {
        match self {
            Change::Write(d) => Request::Write(d, false),
            Change::Trim(len) => Request::Trim(*len, false),
            Change::Zero(len, f) => Request::Zero(*len, *f),
        }
    }
}

#[derive(Debug)]
struct Entry {
    seq: u64,
    offset: u64,
    change: Change,
}

#[derive(Debug, Default)]
struct Inner {
    entries: VecDeque<Entry>,
    next_seq: u64,
    bytes: u64,
    /// The connection generation the last snapshot was taken for.
    replayed_for: u64,
}

/// What [`Journal::record`] did with an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// Kept until a flush covers it.
    Kept,
    /// Answered on a connection that a replay has replaced: send it again.
    Missed,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Journal {
    cap: u64,
    inner: Mutex<Inner>,
    /// Set while a flush to empty the journal is on its way (one at a time).
    pub flushing: AtomicBool,
    /// Changes sent again on new connections, in all.
    pub replayed: AtomicU64,
    /// Replayed changes the new server answered with an error.
    pub replay_errors: AtomicU64,
}

impl Journal {
    pub fn new(cap: u64) -> Journal {
        Journal {
            cap: cap.max(1),
            inner: Mutex::new(Inner::default()),
            flushing: AtomicBool::new(false),
            replayed: AtomicU64::new(0),
            replay_errors: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a change the server answered on connection `generation`.
    pub fn record(&self, generation: u64, offset: u64, change: Change) -> Recorded {
        let mut j = self.lock();
        if generation < j.replayed_for {
            return Recorded::Missed;
        }
        let seq = j.next_seq;
        j.next_seq += 1;
        j.bytes += change.bytes();
        j.entries.push_back(Entry {
            seq,
            offset,
            change,
        });
        Recorded::Kept
    }

    /// Taken before a flush is sent: what it will cover.
    pub fn mark(&self) -> u64 {
        self.lock().next_seq
    }

    /// A flush sent at `mark` succeeded: forgets what was answered before it.
    pub fn flushed(&self, mark: u64) {
        let mut j = self.lock();
        while j.entries.front().is_some_and(|e| e.seq < mark) {
            let e = j.entries.pop_front().expect("checked");
            j.bytes -= e.change.bytes();
        }
    }

    /// Every kept change, in answer order, for a replay on connection `generation`; from
    /// now on answers from older connections are [`Recorded::Missed`].
    pub fn snapshot(&self, generation: u64) -> Vec<(u64, Change)> {
        let mut j = self.lock();
        j.replayed_for = j.replayed_for.max(generation);
        j.entries
            .iter()
            .map(|e| (e.offset, e.change.clone()))
            .collect()
    }

    /// Whether the journal holds more than its cap (time to flush).
    pub fn over_cap(&self) -> bool {
        self.lock().bytes > self.cap
    }

    /// Changes and bytes kept now.
    pub fn size(&self) -> (usize, u64) {
        let j = self.lock();
        (j.entries.len(), j.bytes)
    }

    /// Sends every kept change on `client`, the connection `generation` about to be used.
    /// A broken connection is returned (the link tries the next one, and replays again
    /// there); an error answer is logged and counted, and the replay goes on.
    pub async fn replay(
        &self,
        client: &Client,
        generation: u64,
        target: &str,
    ) -> Result<(), ClientError> {
        let changes = self.snapshot(generation);
        if changes.is_empty() {
            return Ok(());
        }
        let bytes: u64 = changes.iter().map(|(_, c)| c.bytes()).sum();
        for (offset, change) in &changes {
            match change.request().send(client, *offset).await {
                Ok(()) => {}
                Err(e) if e.errno().is_some() => {
                    self.replay_errors.fetch_add(1, Relaxed);
                    log::error!("target {target}: replaying an answered change at offset {offset} failed on the new connection: {e}");
                }
                Err(e) => return Err(e),
            }
        }
        self.replayed.fetch_add(changes.len() as u64, Relaxed);
        log::warn!("target {target}: sent again the {} answered changes ({bytes} bytes) since the last flush", changes.len());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(byte: u8) -> Change {
        Change::Write(Arc::from(vec![byte; 4096]))
    }

    fn offsets(j: &Journal, g: u64) -> Vec<u64> {
        j.snapshot(g).into_iter().map(|(o, _)| o).collect()
    }

    #[test]
    fn a_flush_forgets_only_what_was_answered_before_it_was_sent() {
        let j = Journal::new(1 << 20);
        assert_eq!(j.record(1, 0, w(1)), Recorded::Kept);
        let mark = j.mark();
        // Answered while the flush is on its way: not covered by it.
        j.record(1, 4096, w(2));
        j.flushed(mark);
        assert_eq!(j.size(), (1, 4096));
        assert_eq!(offsets(&j, 1), vec![4096]);
        j.flushed(j.mark());
        assert_eq!(j.size(), (0, 0));
    }

    #[test]
    fn a_replay_holds_everything_answered_before_it_in_order() {
        let j = Journal::new(1 << 20);
        j.record(1, 8192, w(1));
        j.record(1, 0, Change::Trim(4096));
        j.record(1, 8192, w(2));
        let snap = j.snapshot(2);
        assert_eq!(
            snap.iter().map(|(o, _)| *o).collect::<Vec<_>>(),
            vec![8192, 0, 8192]
        );
        match &snap[2].1 {
            Change::Write(d) => assert_eq!(d[0], 2, "the later write to a range replays last"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_answer_from_a_replaced_connection_is_sent_again_not_kept() {
        let j = Journal::new(1 << 20);
        j.record(1, 0, w(1));
        j.snapshot(2);
        assert_eq!(j.record(1, 4096, w(2)), Recorded::Missed);
        assert_eq!(j.size(), (1, 4096));
        assert_eq!(j.record(2, 4096, w(2)), Recorded::Kept);
        assert_eq!(offsets(&j, 2), vec![0, 4096]);
    }

    #[test]
    fn past_the_cap_it_says_flush() {
        let j = Journal::new(8192);
        assert_eq!(j.record(1, 0, w(1)), Recorded::Kept);
        assert_eq!(j.record(1, 4096, w(1)), Recorded::Kept);
        assert!(!j.over_cap());
        assert_eq!(j.record(1, 8192, w(1)), Recorded::Kept);
        assert!(j.over_cap());
        j.flushed(j.mark());
        assert_eq!(j.record(1, 0, w(1)), Recorded::Kept);
        assert!(!j.over_cap());
    }
}
