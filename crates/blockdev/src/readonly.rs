//! [`ReadOnly`]: a device seen read-only, whatever it can do: a target attached with
//! `--read-only` (a shared data disk many machines read), offered read-only to its guest
//! over NBD and vhost-user-blk alike.
//!
//! Invariants: `caps().read_only` is true, so every edge advertises it; every write, trim
//! and zero is refused with [`ErrorKind::ReadOnly`] before it reaches the device below;
//! reads, flushes, block status and prefetch pass through.

use crate::{BatchIo, BatchOp, BlockDev, Caps, Error, ErrorKind, Filter, Op, Result, ZeroFlags};

/// See the module docs.
#[derive(Debug)]
pub struct ReadOnly<D: BlockDev + ?Sized>(pub std::sync::Arc<D>);

impl<D: BlockDev + ?Sized> ReadOnly<D> {
    fn refuse(&self, op: Op, offset: u64, len: u64) -> Error {
        Error::new(
            ErrorKind::ReadOnly,
            op,
            offset,
            len,
            self.0.as_ref().describe(),
            "the disk is attached read-only (--read-only)",
        )
    }
}

impl<D: BlockDev + ?Sized> Filter for ReadOnly<D> {
    type Inner = D;
    fn inner(&self) -> &D {
        &self.0
    }
    fn caps(&self) -> Caps {
        Caps {
            read_only: true,
            fua: false,
            trim: false,
            zeroes: false,
            fast_zero: false,
            ..self.inner().caps()
        }
    }
    fn write_at(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        Err(self.refuse(Op::Write, offset, buf.len() as u64))
    }
    fn trim(&self, offset: u64, len: u64, _fua: bool) -> Result<()> {
        Err(self.refuse(Op::Trim, offset, len))
    }
    fn write_zeroes(&self, offset: u64, len: u64, _flags: ZeroFlags) -> Result<()> {
        Err(self.refuse(Op::Zero, offset, len))
    }
    fn io_batch(&self, ops: &mut [BatchOp<'_>]) {
        if !ops.iter().any(BatchOp::is_write) {
            return self.inner().io_batch(ops);
        }
        for op in ops {
            match op.io {
                BatchIo::Write(..) => {
                    op.result = Err(self.refuse(Op::Write, op.offset, op.len() as u64))
                }
                BatchIo::Read(_) => op.run_alone(self.inner()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::ReadOnly;
    use crate::{conformance, BlockDev, MemoryDev};

    #[test]
    fn conformance_read_only() {
        conformance::run_read_only("ReadOnly(MemoryDev)", &|content| {
            let m = MemoryDev::new(content.len() as u64);
            m.write_at(content, 0, false).unwrap();
            Arc::new(ReadOnly(Arc::new(m))) as Arc<dyn BlockDev>
        });
    }
}

#[cfg(test)]
mod batch_tests {
    use std::sync::Arc;

    use super::ReadOnly;
    use crate::{BatchOp, BlockDev, ErrorKind, MemoryDev};

    #[test]
    fn a_batch_with_writes_refuses_them_and_reads_the_rest() {
        let m = Arc::new(MemoryDev::new(1 << 20));
        m.write_at(&[7u8; 4096], 0, false).unwrap();
        let ro = ReadOnly(m.clone());
        let (mut a, b) = (vec![0u8; 4096], vec![9u8; 4096]);
        let mut ops = [BatchOp::read(&mut a, 0), BatchOp::write(&b, 0, false)];
        ro.io_batch(&mut ops);
        assert!(ops[0].result.is_ok());
        assert_eq!(
            ops[1].result.as_ref().unwrap_err().kind,
            ErrorKind::ReadOnly
        );
        drop(ops);
        assert_eq!(a, vec![7u8; 4096]);
        let mut back = vec![0u8; 4096];
        m.read_at(&mut back, 0).unwrap();
        assert_eq!(back, vec![7u8; 4096], "the refused write changed nothing");
    }
}
