//! A bounded LRU cache of L2 tables, keyed by the table's offset in the file.
//!
//! The cache only holds tables; loading and writing them is the image's job, because
//! writing a dirty table has an ordering duty the cache cannot see: the refcounts of the
//! clusters a dirty table points at must be on disk first. So the cache never evicts on
//! its own: the image asks for a [`L2Cache::victim`] when it is full, writes it out if
//! dirty (after the refcounts), and then [`L2Cache::remove`]s it.
//!
//! Invariants:
//! - At most `capacity` tables are held once the image has evicted (it evicts before every
//!   insert), so memory is bounded by `capacity * cluster_size`.
//! - A table in the cache is the newest version of that table: reads never go to the file
//!   for a cached table, and a dirty table is written before it leaves the cache.

use std::collections::HashMap;

/// One cached L2 table.
#[derive(Debug)]
pub struct L2Table {
    /// Host-endian entries (converted from big-endian on load).
    pub entries: Vec<u64>,
    /// Changed since it was last written to the file.
    pub dirty: bool,
    used: u64,
}

/// The cache.
#[derive(Debug)]
pub struct L2Cache {
    capacity: usize,
    tick: u64,
    tables: HashMap<u64, L2Table>,
}

impl L2Cache {
    pub fn new(capacity: usize) -> Self {
        L2Cache {
            capacity: capacity.max(1),
            tick: 0,
            tables: HashMap::new(),
        }
    }

    /// The table at `offset`, marked as just used.
    pub fn get_mut(&mut self, offset: u64) -> Option<&mut L2Table> {
        self.tick += 1;
        let tick = self.tick;
        let t = self.tables.get_mut(&offset)?;
        t.used = tick;
        Some(t)
    }

    /// The least recently used table's offset, when the cache is full.
    pub fn victim(&self) -> Option<u64> {
        if self.tables.len() < self.capacity {
            return None;
        }
        self.tables
            .iter()
            .min_by_key(|(_, t)| t.used)
            .map(|(&off, _)| off)
    }

    pub fn remove(&mut self, offset: u64) -> Option<L2Table> {
        self.tables.remove(&offset)
    }

    /// Inserts a table (the caller evicted first).
    pub fn insert(&mut self, offset: u64, entries: Vec<u64>, dirty: bool) -> &mut L2Table {
        self.tick += 1;
        let t = L2Table {
            entries,
            dirty,
            used: self.tick,
        };
        self.tables.insert(offset, t);
        self.tables.get_mut(&offset).expect("just inserted")
    }

    /// Offsets of every dirty table, in file order.
    pub fn dirty_offsets(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .tables
            .iter()
            .filter(|(_, t)| t.dirty)
            .map(|(&o, _)| o)
            .collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used() {
        let mut c = L2Cache::new(2);
        c.insert(1, vec![0], false);
        c.insert(2, vec![0], true);
        assert_eq!(c.victim(), Some(1));
        c.get_mut(1);
        assert_eq!(c.victim(), Some(2));
        assert_eq!(c.dirty_offsets(), vec![2]);
        c.remove(2);
        assert_eq!(c.victim(), None);
    }
}
