//! `run_batch`: a batch of file reads and writes submitted together through the calling
//! thread's own io_uring, returning when all are done.
//!
//! Design notes.
//!
//! - **Whose ring**: each thread that calls [`run_batch`] gets a ring of its own on first use
//!   (`SINGLE_ISSUER` and `DEFER_TASKRUN` where the kernel has them, so completions are
//!   processed only when this thread waits for them). No hand-off to another thread: the
//!   caller (an NBD connection's thread) pushes every I/O of its batch, enters the kernel
//!   once to submit them all and wait for all, and goes on. That is one sleep per batch
//!   where blocking `pwrite`s from worker threads cost a sleep and a wake-up per request,
//!   and the extent lookups of the submissions run on every connection's thread at once.
//! - **Short transfers, EINTR, EAGAIN**: the rest of the I/O is resubmitted until it is whole;
//!   a transfer of 0 bytes ends a read with `UnexpectedEof` and a write with `WriteZero`, as
//!   `read_exact_at`/`write_all_at` do; other errors are the `io::Error` of the errno, so
//!   ENOSPC and EIO map to the same kinds as with `pwrite`.
//! - **Fallback**: where the ring cannot be set up (old kernel, seccomp, io_uring disabled),
//!   or breaks, or the call is nested inside another `run_batch` on the same thread, the
//!   batch runs with `pread`/`pwrite`, one I/O after the other. A ring that broke is not
//!   tried again on that thread (logged once per thread).
//!
//! Invariants: every buffer is lent to the kernel only between its submission and the
//! reaping of its last completion, and `run_batch` returns only when no I/O of the batch is
//! in the kernel, so the borrow of each buffer covers the kernel's use of it.

use std::cell::RefCell;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use io_uring::{opcode, types, IoUring};

/// Submission queue entries of a thread's ring (the completion queue gets twice as many).
const ENTRIES: u32 = 128;
/// `IORING_ENTER_GETEVENTS` of the kernel ABI (the crate keeps its `sys` module private).
const IORING_ENTER_GETEVENTS: u32 = 1;

/// One read or write of a file, for [`run_batch`].
#[derive(Debug)]
pub struct FileIo<'a> {
    pub file: &'a File,
    pub offset: u64,
    pub buf: FileBuf<'a>,
    /// Set by `run_batch`.
    pub result: io::Result<()>,
}

/// The bytes of a [`FileIo`].
#[derive(Debug)]
pub enum FileBuf<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

impl<'a> FileIo<'a> {
    pub fn read(file: &'a File, buf: &'a mut [u8], offset: u64) -> Self {
        FileIo {
            file,
            offset,
            buf: FileBuf::Read(buf),
            result: Ok(()),
        }
    }

    pub fn write(file: &'a File, buf: &'a [u8], offset: u64) -> Self {
        FileIo {
            file,
            offset,
            buf: FileBuf::Write(buf),
            result: Ok(()),
        }
    }

    pub fn len(&self) -> usize {
        match &self.buf {
            FileBuf::Read(b) => b.len(),
            FileBuf::Write(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Does the rest of this I/O (from byte `done`) with `pread`/`pwrite`.
    fn run_sync(&mut self, done: usize) -> io::Result<()> {
        let at = self.offset + done as u64;
        match &mut self.buf {
            FileBuf::Read(b) => self.file.read_exact_at(&mut b[done..], at),
            FileBuf::Write(b) => self.file.write_all_at(&b[done..], at),
        }
    }
}

enum RingState {
    Untried,
    Ready(Box<IoUring>),
    Unavailable,
}

thread_local! {
    static RING: RefCell<RingState> = const { RefCell::new(RingState::Untried) };
}

/// Runs every I/O of `ios` (at once where the kernel can) and sets each one's `result`.
/// Buffers for files opened with `O_DIRECT` must meet its alignment, as with `pread`.
pub fn run_batch(ios: &mut [FileIo<'_>]) {
    if ios.is_empty() {
        return;
    }
    // Bytes done per I/O; `None` once it is finished (its `result` set).
    let mut done: Vec<Option<usize>> = vec![Some(0); ios.len()];
    RING.with(|cell| {
        let Ok(mut state) = cell.try_borrow_mut() else {
            return;
        };
        if let RingState::Untried = *state {
            *state = match crate::uring::setup_ring_of(ENTRIES) {
                Ok(r) => RingState::Ready(Box::new(r)),
                Err(e) => {
                    log::info!(
                        "io_uring is not available on this thread ({e}); batches use pread/pwrite"
                    );
                    RingState::Unavailable
                }
            };
        }
        let RingState::Ready(ring) = &mut *state else {
            return;
        };
        if let Err(e) = run_on_ring(ring, ios, &mut done) {
            log::warn!("io_uring failed ({e}); this thread's batches use pread/pwrite from now on");
            *state = RingState::Unavailable;
        }
    });
    // Whatever the ring did not finish (no ring, or it broke) runs here.
    for (io, d) in ios.iter_mut().zip(done) {
        if let Some(d) = d {
            io.result = io.run_sync(d);
        }
    }
}

/// Submits and reaps until every I/O is finished. On an error of the ring itself it
/// returns once nothing is left in the kernel, with `done` saying what is left to do.
fn run_on_ring(
    ring: &mut IoUring,
    ios: &mut [FileIo<'_>],
    done: &mut [Option<usize>],
) -> io::Result<()> {
    let mut next = 0usize; // first I/O never submitted
    let mut retry: Vec<usize> = Vec::new(); // I/O to submit again (the rest of it)
    let mut in_kernel = 0usize;
    loop {
        // Push what fits: resubmissions first, then new I/O.
        while !ring.submission().is_full() {
            let i = match retry.pop() {
                Some(i) => i,
                None if next < ios.len() => {
                    next += 1;
                    next - 1
                }
                None => break,
            };
            let d = done[i].unwrap_or(0);
            let io = &mut ios[i];
            let fd = types::Fd(io.file.as_raw_fd());
            let at = io.offset + d as u64;
            let rest = (io.len() - d) as u32;
            let entry = match &mut io.buf {
                FileBuf::Read(b) => opcode::Read::new(fd, b[d..].as_mut_ptr(), rest)
                    .offset(at)
                    .build(),
                FileBuf::Write(b) => opcode::Write::new(fd, b[d..].as_ptr(), rest)
                    .offset(at)
                    .build(),
            }
            .user_data(i as u64);
            // SAFETY: the buffer stays borrowed (by `ios`) until `run_batch` returns, and
            // this function returns only once no submitted entry is left in the kernel.
            unsafe { ring.submission().push(&entry) }
                .expect("the submission queue has room (checked above)");
            in_kernel += 1;
        }
        if in_kernel == 0 {
            return Ok(());
        }
        if let Err(e) = ring.submit_and_wait(1) {
            if matches!(
                e.raw_os_error(),
                Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
            ) {
                continue;
            }
            return wait_out(ring, ios, done, in_kernel, e);
        }
        for cqe in ring.completion() {
            in_kernel -= 1;
            let i = cqe.user_data() as usize;
            let res = cqe.result();
            let Some(d) = done[i] else { continue };
            if res == -libc::EINTR || res == -libc::EAGAIN {
                retry.push(i);
            } else if res < 0 {
                ios[i].result = Err(io::Error::from_raw_os_error(-res));
                done[i] = None;
            } else if res == 0 {
                let kind = if matches!(ios[i].buf, FileBuf::Read(_)) {
                    io::ErrorKind::UnexpectedEof
                } else {
                    io::ErrorKind::WriteZero
                };
                ios[i].result = Err(io::Error::new(
                    kind,
                    "the file ended before the whole transfer",
                ));
                done[i] = None;
            } else if d + res as usize >= ios[i].len() {
                ios[i].result = Ok(());
                done[i] = None;
            } else {
                done[i] = Some(d + res as usize);
                retry.push(i);
            }
        }
    }
}

/// After `io_uring_enter` failed for good: waits for the completion of everything the
/// kernel consumed (it may write into those buffers until then) without submitting the
/// entries it did not consume (they are never submitted: the ring is not used again).
/// Returns `first` for the caller to report; `done` says what is left to do.
fn wait_out(
    ring: &mut IoUring,
    ios: &mut [FileIo<'_>],
    done: &mut [Option<usize>],
    in_kernel: usize,
    first: io::Error,
) -> io::Result<()> {
    let mut waiting = in_kernel.saturating_sub(ring.submission().len());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while waiting > 0 {
        // SAFETY: a plain io_uring_enter that submits nothing and waits for one completion.
        let _ = unsafe {
            ring.submitter()
                .enter::<libc::sigset_t>(0, 1, IORING_ENTER_GETEVENTS, None)
        };
        for cqe in ring.completion() {
            waiting = waiting.saturating_sub(1);
            let i = cqe.user_data() as usize;
            if let (Some(d), res) = (done[i], cqe.result()) {
                if res > 0 && d + res as usize >= ios[i].len() {
                    ios[i].result = Ok(());
                    done[i] = None;
                } else if res > 0 {
                    done[i] = Some(d + res as usize);
                }
            }
        }
        if waiting > 0 && std::time::Instant::now() > deadline {
            log::error!("io_uring failed ({first}) and {waiting} I/O never completed; stopping, since their buffers cannot be released safely");
            std::process::abort();
        }
    }
    Err(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_of(bytes: &[u8]) -> (tempfile::TempDir, File) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, bytes).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        (dir, f)
    }

    #[test]
    fn a_batch_of_reads_and_writes_lands_like_pread_and_pwrite() {
        let start: Vec<u8> = (0..64 * 1024).map(|i| (i * 7 % 251) as u8).collect();
        let (_d, f) = file_of(&start);
        let new = vec![0xabu8; 4096];
        let mut r1 = vec![0u8; 4096];
        let mut r2 = vec![0u8; 10_000];
        let mut ios = vec![
            FileIo::write(&f, &new, 8192),
            FileIo::read(&f, &mut r1, 0),
            FileIo::read(&f, &mut r2, 20_000),
            FileIo::write(&f, &new[..100], 60_000),
        ];
        run_batch(&mut ios);
        for io in &ios {
            assert!(io.result.is_ok(), "{:?}", io.result);
        }
        drop(ios);
        assert_eq!(r1[..], start[..4096]);
        assert_eq!(r2[..], start[20_000..30_000]);
        let mut want = start.clone();
        want[8192..12288].copy_from_slice(&new);
        want[60_000..60_100].copy_from_slice(&new[..100]);
        let mut got = vec![0u8; want.len()];
        f.read_exact_at(&mut got, 0).unwrap();
        assert_eq!(got, want);
    }

    #[test]
    fn a_read_past_the_end_fails_alone() {
        let (_d, f) = file_of(&[1u8; 4096]);
        let mut a = vec![0u8; 4096];
        let mut b = vec![0u8; 4096];
        let mut ios = vec![FileIo::read(&f, &mut a, 0), FileIo::read(&f, &mut b, 2048)];
        run_batch(&mut ios);
        assert!(ios[0].result.is_ok());
        assert_eq!(
            ios[1].result.as_ref().unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }

    #[test]
    fn batches_larger_than_the_ring_finish() {
        let (_d, f) = file_of(&vec![0u8; 1 << 20]);
        let bufs: Vec<Vec<u8>> = (0..600).map(|i| vec![(i % 255) as u8 + 1; 512]).collect();
        let mut ios: Vec<FileIo<'_>> = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| FileIo::write(&f, b, i as u64 * 1024))
            .collect();
        run_batch(&mut ios);
        assert!(ios.iter().all(|io| io.result.is_ok()));
        for (i, b) in bufs.iter().enumerate() {
            let mut got = vec![0u8; 512];
            f.read_exact_at(&mut got, i as u64 * 1024).unwrap();
            assert_eq!(&got, b, "write {i}");
        }
    }

    #[test]
    fn an_error_reaches_its_io_only() {
        let dir = tempfile::tempdir().unwrap();
        let ro = File::open(dir.path()).unwrap(); // a directory: reads fail with EISDIR
        let (_d, f) = file_of(&[5u8; 4096]);
        let mut a = vec![0u8; 16];
        let mut b = vec![0u8; 16];
        let mut ios = vec![FileIo::read(&ro, &mut a, 0), FileIo::read(&f, &mut b, 0)];
        run_batch(&mut ios);
        assert_eq!(
            ios[0].result.as_ref().unwrap_err().raw_os_error(),
            Some(libc::EISDIR)
        );
        assert!(ios[1].result.is_ok());
        drop(ios);
        assert_eq!(b, vec![5u8; 16]);
    }
}
