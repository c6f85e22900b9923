//! PLACEHOLDER (being replaced by the sharded sparse implementation): a sparse RAM disk.
use std::collections::HashMap;
use std::sync::Mutex;

use crate::{check_range, BlockDev, Caps, Op, Result, ZeroFlags};

const PAGE: u64 = 4096;

#[derive(Debug)]
pub struct MemoryDev {
    size: u64,
    pages: Mutex<HashMap<u64, Box<[u8]>>>,
}

impl MemoryDev {
    pub fn new(size: u64) -> Self {
        MemoryDev { size, pages: Mutex::new(HashMap::new()) }
    }
}

impl BlockDev for MemoryDev {
    fn size(&self) -> u64 {
        self.size
    }
    fn caps(&self) -> Caps {
        Caps { read_only: false, flush: false, fua: false, trim: true, zeroes: true, fast_zero: true, cache: false, block_status: true, multi_conn: true, may_block: false, preferred_block: 4096 }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size, Op::Read, offset, buf.len() as u64, &|| self.describe())?;
        let pages = self.pages.lock().unwrap();
        for p in crate::span::units(offset, buf.len() as u64, PAGE) {
            let dst = &mut buf[p.pos..p.pos + p.len];
            match pages.get(&p.index) {
                Some(page) => dst.copy_from_slice(&page[p.within..p.within + p.len]),
                None => dst.fill(0),
            }
        }
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        check_range(self.size, Op::Write, offset, buf.len() as u64, &|| self.describe())?;
        let mut pages = self.pages.lock().unwrap();
        for p in crate::span::units(offset, buf.len() as u64, PAGE) {
            let page = pages.entry(p.index).or_insert_with(|| vec![0u8; PAGE as usize].into_boxed_slice());
            page[p.within..p.within + p.len].copy_from_slice(&buf[p.pos..p.pos + p.len]);
        }
        Ok(())
    }
    fn trim(&self, offset: u64, len: u64, _fua: bool) -> Result<()> {
        self.write_zeroes(offset, len, ZeroFlags { may_trim: true, ..Default::default() })
    }
    fn write_zeroes(&self, offset: u64, len: u64, _flags: ZeroFlags) -> Result<()> {
        check_range(self.size, Op::Zero, offset, len, &|| self.describe())?;
        let mut pages = self.pages.lock().unwrap();
        for p in crate::span::units(offset, len, PAGE) {
            if p.is_whole(PAGE) {
                pages.remove(&p.index);
            } else if let Some(page) = pages.get_mut(&p.index) {
                page[p.within..p.within + p.len].fill(0);
            }
        }
        Ok(())
    }
    fn describe(&self) -> String {
        "memory".into()
    }
}
