//! `--verify`: what a write puts on the disk and what a read expects back.
//!
//! A written block is a run of 16-byte stamps. Stamp `i` holds the absolute byte offset of
//! its own first byte (u64, little endian), then the magic `VDSB` and the block's
//! generation (u32 each, little endian). A stamp names where it belongs and which write
//! put it there, so a misplaced, stale, torn or foreign block is recognised and reported
//! with its offset.
//!
//! The [`Ledger`] remembers, per block, the generation of the last acknowledged write and
//! whether a request of this run holds the block. Invariants: at most one request holds a
//! block at a time (so a read is never racing our own write to it); generation 0 means
//! "never written by this run, or a write failed": its contents are unknown and not checked.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// Bytes per stamp.
pub const STAMP_LEN: usize = 16;
/// The magic in every stamp ("VDSB" read as little-endian u32).
pub const MAGIC: u32 = u32::from_le_bytes(*b"VDSB");

/// Fills `buf` (a multiple of [`STAMP_LEN`]) with the stamps of a write at `offset`.
pub fn fill(buf: &mut [u8], offset: u64, generation: u32) {
    for (i, stamp) in buf.chunks_exact_mut(STAMP_LEN).enumerate() {
        stamp[0..8].copy_from_slice(&(offset + (i * STAMP_LEN) as u64).to_le_bytes());
        stamp[8..12].copy_from_slice(&MAGIC.to_le_bytes());
        stamp[12..16].copy_from_slice(&generation.to_le_bytes());
    }
}

/// A read that did not return what the last acknowledged write put there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mismatch {
    /// Byte offset of the first stamp that differs.
    pub offset: u64,
    pub expected_generation: u32,
    /// What is there instead, for a person.
    pub found: String,
}

/// Checks a block read at `offset` against generation `generation`; the first stamp that
/// differs, if any.
pub fn check(buf: &[u8], offset: u64, generation: u32) -> Option<Mismatch> {
    for (i, stamp) in buf.chunks_exact(STAMP_LEN).enumerate() {
        let at = offset + (i * STAMP_LEN) as u64;
        let got_off = u64::from_le_bytes(stamp[0..8].try_into().expect("8 bytes"));
        let got_magic = u32::from_le_bytes(stamp[8..12].try_into().expect("4 bytes"));
        let got_gen = u32::from_le_bytes(stamp[12..16].try_into().expect("4 bytes"));
        if got_off == at && got_magic == MAGIC && got_gen == generation {
            continue;
        }
        let found = if got_magic != MAGIC {
            let hex: String = stamp.iter().map(|b| format!("{b:02x}")).collect();
            format!("not a stamp (bytes {hex})")
        } else if got_off != at {
            format!("the stamp of offset {got_off} (generation {got_gen})")
        } else {
            format!("generation {got_gen}")
        };
        return Some(Mismatch {
            offset: at,
            expected_generation: generation,
            found,
        });
    }
    None
}

/// Per block: the last acknowledged generation and whether a request holds it.
#[derive(Debug)]
pub struct Ledger {
    /// `generation << 1 | held`.
    blocks: Vec<AtomicU64>,
}

const HELD: u64 = 1;

impl Ledger {
    pub fn new(blocks: u64) -> Ledger {
        Ledger {
            blocks: (0..blocks).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Takes `block` if no request holds it; returns its last acknowledged generation.
    pub fn try_hold(&self, block: u64) -> Option<u32> {
        let cell = &self.blocks[block as usize];
        let cur = cell.load(Ordering::Acquire);
        if cur & HELD != 0 {
            return None;
        }
        cell.compare_exchange(cur, cur | HELD, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|v| (v >> 1) as u32)
    }

    /// Gives `block` back with its generation now `generation` (0: unknown).
    pub fn release(&self, block: u64, generation: u32) {
        self.blocks[block as usize].store(u64::from(generation) << 1, Ordering::Release);
    }
}

/// The generation after `generation`, skipping 0 (which means "unknown").
pub fn next_generation(generation: u32) -> u32 {
    generation.wrapping_add(1).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn zeroes_and_other_blocks_are_recognised() {
        let mut buf = vec![0u8; 4096];
        let m = check(&buf, 8192, 3).unwrap();
        assert_eq!(m.offset, 8192);
        assert!(m.found.starts_with("not a stamp"), "{}", m.found);
        fill(&mut buf, 4096, 3);
        let m = check(&buf, 8192, 3).unwrap();
        assert!(m.found.contains("the stamp of offset 4096"), "{}", m.found);
        fill(&mut buf, 8192, 2);
        assert!(check(&buf, 8192, 3).unwrap().found.contains("generation 2"));
        assert_eq!(check(&buf, 8192, 2), None);
    }

    #[test]
    fn ledger_holds_one_request_per_block() {
        let l = Ledger::new(4);
        assert_eq!(l.try_hold(2), Some(0));
        assert_eq!(l.try_hold(2), None);
        l.release(2, 7);
        assert_eq!(l.try_hold(2), Some(7));
        l.release(2, 0);
        assert_eq!(l.try_hold(2), Some(0));
        assert_eq!(next_generation(u32::MAX), 1);
    }

    proptest! {
        #[test]
        fn a_written_block_checks_and_any_torn_byte_is_found(
            block in 0u64..1 << 30, generation in 1u32.., sectors in 1usize..16, flip in any::<prop::sample::Index>(), bit in 0u8..8,
        ) {
            let offset = block * 512;
            let mut buf = vec![0u8; sectors * 512];
            fill(&mut buf, offset, generation);
            prop_assert_eq!(check(&buf, offset, generation), None);
            let i = flip.index(buf.len());
            buf[i] ^= 1 << bit;
            let m = check(&buf, offset, generation).expect("a flipped bit is a mismatch");
            prop_assert_eq!(m.offset, offset + (i - i % STAMP_LEN) as u64);
        }
    }
}
