//! What the write-cache benchmarks share: a deterministic stream of page indices.

/// xorshift64*: a cheap, deterministic stream of page indices.
pub struct Pages(pub u64);

impl Pages {
    pub fn next(&mut self, pages: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % pages
    }
}
