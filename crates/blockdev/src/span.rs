//! Block arithmetic, kept apart from the code that holds bytes: splitting a byte range into
//! an unaligned head, an aligned body and an unaligned tail, and iterating the fixed-size
//! units (4 KiB pages, 2 MiB overflow units) a range touches.

/// One piece of a byte range that lies inside a single unit of `unit` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnitPiece {
    /// Index of the unit (offset / unit size).
    pub index: u64,
    /// Offset of the piece inside the unit.
    pub within: usize,
    /// Length of the piece.
    pub len: usize,
    /// Offset of the piece relative to the start of the whole range.
    pub pos: usize,
}

impl UnitPiece {
    /// Whether the piece covers its whole unit.
    pub fn is_whole(&self, unit: u64) -> bool {
        self.within == 0 && self.len as u64 == unit
    }
}

/// Iterates the pieces of `[offset, offset+len)` cut at multiples of `unit` (a power of two).
pub fn units(offset: u64, len: u64, unit: u64) -> impl Iterator<Item = UnitPiece> {
    debug_assert!(unit.is_power_of_two());
    let end = offset + len;
    let mut cur = offset;
    std::iter::from_fn(move || {
        if cur >= end {
            return None;
        }
        let index = cur / unit;
        let within = cur % unit;
        let piece = (unit - within).min(end - cur);
        let p = UnitPiece {
            index,
            within: within as usize,
            len: piece as usize,
            pos: (cur - offset) as usize,
        };
        cur += piece;
        Some(p)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_range_exactly() {
        let p: Vec<_> = units(4000, 10_000, 4096).collect();
        assert_eq!(
            p[0],
            UnitPiece {
                index: 0,
                within: 4000,
                len: 96,
                pos: 0
            }
        );
        assert_eq!(
            p[1],
            UnitPiece {
                index: 1,
                within: 0,
                len: 4096,
                pos: 96
            }
        );
        assert!(p[1].is_whole(4096));
        assert_eq!(p.last().unwrap().index, 3);
        assert_eq!(p.iter().map(|x| x.len).sum::<usize>(), 10_000);
        assert_eq!(units(0, 0, 4096).count(), 0);
    }
}
