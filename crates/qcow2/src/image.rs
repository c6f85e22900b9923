//! [`Qcow2Image`]: the I/O engine. Opening, guest-to-host mapping, and the read side
//! (reads, sparse reads, block status) of the [`BlockDev`] impl; the write side lives in
//! `write.rs`.
//!
//! Mapping: guest cluster `i` → L1 entry `i / l2_entries` → L2 table (cached) → L2 entry,
//! decoded into a [`Mapping`]. The L1 table is held whole in memory (the header parser
//! bounded it to 32 MiB); L2 tables sit in an LRU [`L2Cache`] bounded in bytes
//! ([`OpenOptions::l2_cache_bytes`], 4 MiB by default, per layer of a chain).
//!
//! Reads take the metadata lock only to turn the request into runs ([`Run`]), then do the
//! I/O without it: data runs `pread` straight into the caller's buffer (contiguous host
//! clusters merged into one call), zero runs are filled, unallocated runs are read from the
//! backing device (zeros past its end, or with no backing), and compressed clusters are
//! inflated (raw deflate, as qemu writes them) into a scratch cluster and copied.
//!
//! Invariants:
//! - Every offset read from the file is checked before use: L2 tables and data clusters
//!   must be cluster aligned and inside the file; a bad one is an `Io` error naming the
//!   file, the offset and "run qemu-img check", never a panic.
//! - Reads of a range the caller does not also write concurrently see either the old or
//!   the new state of each cluster (writes change a mapping under the lock, after the data
//!   is in place).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use vdstream_blockdev::flock::{try_lock, LockMode, LOCK_PATIENCE};
use vdstream_blockdev::layerfile::LayerFile;
use vdstream_blockdev::span::units;
use vdstream_blockdev::{
    check_range, BlockDev, Caps, Error, ErrorKind, Extent, Hole, Op, Result, ZeroFlags,
};

use crate::header::{Header, HEADER_READ_LEN, INCOMPAT_CORRUPT, INCOMPAT_DIRTY};
use crate::l2cache::L2Cache;
use crate::refcount::{RefcountError, Refcounts};

pub(crate) const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
pub(crate) const COPIED: u64 = 1 << 63;
pub(crate) const COMPRESSED: u64 = 1 << 62;
pub(crate) const ZERO_FLAG: u64 = 1;

/// How to open an image.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// Refuse writes. Read-only opens take a shared lock, read-write an exclusive one.
    pub read_only: bool,
    /// Memory for cached L2 tables, in bytes ([`DEFAULT_L2_CACHE_BYTES`] by default).
    /// Each table is one cluster and maps `cluster_size / 8` clusters; at least two tables
    /// are kept whatever the budget. Every layer of a chain has its own cache.
    pub l2_cache_bytes: u64,
}

/// The default L2 cache budget per image: 4 MiB, which maps 32 GiB of guest space with
/// 64 KiB clusters (64 tables), 512 MiB with 4 KiB clusters and 4 TiB with 2 MiB clusters.
pub const DEFAULT_L2_CACHE_BYTES: u64 = 4 << 20;

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            read_only: true,
            l2_cache_bytes: DEFAULT_L2_CACHE_BYTES,
        }
    }
}

/// Where the bytes of one guest cluster are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mapping {
    /// Not in this layer: read the backing device.
    Unallocated,
    /// Reads as zeros; `host` is a preallocated cluster or 0.
    Zero { host: u64 },
    /// A normal cluster; `copied` = refcount is exactly one (may be written in place).
    Data { host: u64, copied: bool },
    /// Compressed: `host` is the byte offset of the data, `len` how many bytes it may take,
    /// `sectors` the 512-byte sectors qemu counts for refcounts (from `host & !511`).
    Compressed { host: u64, len: u64, sectors: u64 },
}

/// What an image holds itself over a guest range ([`Qcow2Image::own_extents`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holding {
    /// Its own data.
    Data,
    /// Zeros it records (they hide the backing file).
    Zero,
    /// Nothing: the backing file's bytes show through.
    Backing,
}

/// One piece of a request with a single source.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Run {
    /// Offset relative to the start of the request.
    pub pos: usize,
    pub len: usize,
    pub kind: RunKind,
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum RunKind {
    /// Host byte offset of the run's first byte (the run is contiguous on the host).
    Data(u64),
    Zero,
    Backing,
    /// The cluster's descriptor and the run's offset within the cluster.
    Compressed {
        host: u64,
        len: u64,
        within: usize,
    },
}

/// Metadata guarded by one lock: the lock covers lookups and changes, never data I/O of
/// clusters already allocated.
#[derive(Debug)]
pub(crate) struct Meta {
    pub l1: Vec<u64>,
    pub l1_dirty: std::collections::BTreeSet<usize>,
    pub l2: L2Cache,
    pub rc: Option<Refcounts>,
}

/// A qcow2 image as a [`BlockDev`].
#[derive(Debug)]
pub struct Qcow2Image {
    pub(crate) path: PathBuf,
    pub(crate) file: LayerFile,
    pub(crate) header: Header,
    pub(crate) read_only: bool,
    pub(crate) backing: Option<Arc<dyn BlockDev>>,
    pub(crate) meta: Mutex<Meta>,
}

/// An error about the file itself (not one request): corrupt metadata and the like.
pub(crate) fn file_error(
    kind: ErrorKind,
    op: Op,
    offset: u64,
    path: &Path,
    message: impl Into<String>,
) -> Error {
    Error::new(kind, op, offset, 0, path.display().to_string(), message)
}

impl Qcow2Image {
    /// Opens `path`. `backing` serves clusters this layer does not hold; it is required when
    /// the header names a backing file (see [`crate::open_chain`] and
    /// [`Qcow2Image::open_with_backing_chain`] to resolve it from the header).
    pub fn open(
        path: impl AsRef<Path>,
        options: OpenOptions,
        backing: Option<Arc<dyn BlockDev>>,
    ) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let io_err =
            |e: std::io::Error| Error::from_io(e, Op::Open, 0, 0, path.display().to_string());
        let file = LayerFile::open(&path, !options.read_only).map_err(io_err)?;
        if let LayerFile::Local(f) = &file {
            lock_file(f, !options.read_only, &path)?;
        }
        let file_len = file.size().map_err(io_err)?;
        let mut first = vec![0u8; (file_len.min(HEADER_READ_LEN as u64)) as usize];
        file.read_exact_at(&mut first, 0).map_err(io_err)?;
        let header = Header::parse(&first, file_len).map_err(|e| {
            let advice = if e.unsupported {
                "vdstream cannot use this image as it is"
            } else {
                "the image is corrupt or not qcow2: check it with `qemu-img check` or restore it from the store"
            };
            file_error(if e.unsupported { ErrorKind::NotSupported } else { ErrorKind::Invalid }, Op::Open, 0, &path, format!("{e}; {advice}"))
        })?;
        drop(first);
        if header.backing_file.is_some() && backing.is_none() {
            return Err(file_error(ErrorKind::Invalid, Op::Open, 0, &path, format!(
                "the image has backing file {:?} but none was given: open it with `open_chain` or `Qcow2Image::open_with_backing_chain`",
                header.backing_file.as_deref().unwrap_or_default())));
        }
        let flags = header.incompatible_features & (INCOMPAT_DIRTY | INCOMPAT_CORRUPT);
        if flags != 0 {
            let what = if flags & INCOMPAT_CORRUPT != 0 {
                "marked corrupt"
            } else {
                "marked dirty (refcounts may be stale)"
            };
            if !options.read_only {
                return Err(file_error(ErrorKind::Invalid, Op::Open, 72, &path, format!(
                    "the image is {what}; vdstream will not write it: repair it with `qemu-img check -r all` first")));
            }
            log::warn!(
                "{}: the image is {what}; reading it anyway (read-only)",
                path.display()
            );
        }
        let mut raw_l1 = vec![0u8; header.l1_size as usize * 8];
        file.read_exact_at(&mut raw_l1, header.l1_table_offset)
            .map_err(io_err)?;
        let l1 = raw_l1
            .chunks_exact(8)
            .map(|c| u64::from_be_bytes(c.try_into().expect("8")))
            .collect();
        let rc = if options.read_only {
            None
        } else {
            if header.nb_snapshots > 0 {
                return Err(file_error(ErrorKind::NotSupported, Op::Open, 60, &path, format!(
                    "the image has {} internal snapshots; vdstream writes only images without them: remove them with `qemu-img snapshot -d` or write a new overlay",
                    header.nb_snapshots)));
            }
            if header.refcount_order != 4 {
                return Err(file_error(ErrorKind::NotSupported, Op::Open, 96, &path, format!(
                    "refcount_order {} ({}-bit refcounts); vdstream writes only 16-bit refcounts: open it read-only or convert it with `qemu-img convert -O qcow2`",
                    header.refcount_order, header.refcount_bits())));
            }
            let rc = Refcounts::load(
                &file,
                header.cluster_bits,
                header.refcount_table_offset,
                header.refcount_table_clusters,
                file_len,
            )
            .map_err(|e| rc_error(e, Op::Open, &path))?;
            Some(rc)
        };
        let name = path.display().to_string();
        let l2_tables =
            (options.l2_cache_bytes / header.cluster_size()).clamp(2, usize::MAX as u64) as usize;
        let image = Qcow2Image {
            path,
            file,
            header,
            read_only: options.read_only,
            backing,
            meta: Mutex::new(Meta {
                l1,
                l1_dirty: Default::default(),
                l2: L2Cache::new(l2_tables),
                rc,
            }),
        };
        if !image.read_only && image.header.autoclear_features != 0 {
            // We keep no bitmaps: clearing the autoclear bits tells qemu they are stale.
            let io = |e| Error::from_io(e, Op::Open, 88, 8, name.clone());
            image.file.write_all_at(&[0u8; 8], 88).map_err(io)?;
            image.file.sync_data().map_err(io)?;
        }
        Ok(image)
    }

    /// The parsed header (as it was at open).
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// What this image holds itself over `[offset, offset+len)`, without asking its
    /// backing file: `(guest offset, length, what)` in guest order, neighbours of one kind
    /// merged. Compressed clusters count as data.
    pub fn own_extents(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, Holding)>> {
        let mut out: Vec<(u64, u64, Holding)> = Vec::new();
        for r in self.runs(offset, len, Op::BlockStatus)? {
            let what = match r.kind {
                RunKind::Data(_) | RunKind::Compressed { .. } => Holding::Data,
                RunKind::Zero => Holding::Zero,
                RunKind::Backing => Holding::Backing,
            };
            match out.last_mut() {
                Some(last) if last.2 == what => last.1 += r.len as u64,
                _ => out.push((offset + r.pos as u64, r.len as u64, what)),
            }
        }
        Ok(out)
    }

    pub(crate) fn cs(&self) -> u64 {
        self.header.cluster_size()
    }

    pub(crate) fn name(&self) -> String {
        self.path.display().to_string()
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Meta> {
        self.meta.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn corrupt(&self, op: Op, offset: u64, what: String) -> Error {
        file_error(
            ErrorKind::Io,
            op,
            offset,
            &self.path,
            format!("{what}: the image is corrupt; run `qemu-img check` on it"),
        )
    }

    pub(crate) fn io(&self, e: std::io::Error, op: Op, offset: u64, len: u64) -> Error {
        Error::from_io(e, op, offset, len, self.name())
    }

    /// Decodes an L2 entry.
    pub(crate) fn decode(&self, entry: u64, op: Op, guest: u64) -> Result<Mapping> {
        if entry & COMPRESSED != 0 {
            let x = 62 - (self.header.cluster_bits - 8);
            let host = entry & ((1u64 << x) - 1);
            let sectors = ((entry >> x) & ((1u64 << (62 - x)) - 1)) + 1;
            let len = sectors * 512 - (host & 511);
            return Ok(Mapping::Compressed { host, len, sectors });
        }
        let host = entry & OFFSET_MASK;
        if self.header.version >= 3 && entry & ZERO_FLAG != 0 {
            return Ok(Mapping::Zero { host });
        }
        if host == 0 {
            return Ok(Mapping::Unallocated);
        }
        if host % self.cs() != 0 {
            return Err(self.corrupt(
                op,
                guest,
                format!(
                    "the L2 entry for guest offset {guest} points at unaligned host offset {host}"
                ),
            ));
        }
        Ok(Mapping::Data {
            host,
            copied: entry & COPIED != 0,
        })
    }

    /// The L2 table at `l2_off`, loaded (evicting if needed) into the cache.
    pub(crate) fn l2_table<'m>(
        &self,
        meta: &'m mut Meta,
        l2_off: u64,
        op: Op,
    ) -> Result<&'m mut Vec<u64>> {
        if meta.l2.get_mut(l2_off).is_none() {
            if l2_off % self.cs() != 0 {
                return Err(self.corrupt(
                    op,
                    l2_off,
                    format!("an L1 entry points at unaligned L2 table offset {l2_off}"),
                ));
            }
            let mut raw = vec![0u8; self.cs() as usize];
            self.file.read_exact_at(&mut raw, l2_off).map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    self.corrupt(
                        op,
                        l2_off,
                        format!("the L2 table at offset {l2_off} lies past the end of the file"),
                    )
                } else {
                    self.io(e, op, l2_off, self.cs())
                }
            })?;
            let entries = raw
                .chunks_exact(8)
                .map(|c| u64::from_be_bytes(c.try_into().expect("8")))
                .collect();
            self.evict_if_full(meta)?;
            meta.l2.insert(l2_off, entries, false);
        }
        Ok(&mut meta.l2.get_mut(l2_off).expect("present").entries)
    }

    /// Makes room in the L2 cache; a dirty victim is written after the refcounts.
    pub(crate) fn evict_if_full(&self, meta: &mut Meta) -> Result<()> {
        if let Some(victim) = meta.l2.victim() {
            let dirty = meta.l2.get_mut(victim).map(|t| t.dirty).unwrap_or(false);
            if dirty {
                self.write_refcounts_and_sync(meta)?;
                let t = meta.l2.get_mut(victim).expect("victim");
                let raw: Vec<u8> = t.entries.iter().flat_map(|e| e.to_be_bytes()).collect();
                self.file
                    .write_all_at(&raw, victim)
                    .map_err(|e| self.io(e, Op::Flush, victim, raw.len() as u64))?;
            }
            meta.l2.remove(victim);
        }
        Ok(())
    }

    /// The mapping of guest cluster `idx`.
    pub(crate) fn lookup(&self, meta: &mut Meta, idx: u64, op: Op) -> Result<Mapping> {
        let per = self.header.l2_entries();
        let Some(&l1e) = meta.l1.get((idx / per) as usize) else {
            return Ok(Mapping::Unallocated);
        };
        let l2_off = l1e & OFFSET_MASK;
        if l2_off == 0 {
            return Ok(Mapping::Unallocated);
        }
        let entry = self.l2_table(meta, l2_off, op)?[(idx % per) as usize];
        self.decode(entry, op, idx * self.cs())
    }

    /// Splits `[offset, offset+len)` into runs with one source each.
    pub(crate) fn runs(&self, offset: u64, len: u64, op: Op) -> Result<Vec<Run>> {
        let cs = self.cs();
        let mut meta = self.lock();
        let mut out: Vec<Run> = Vec::new();
        for p in units(offset, len, cs) {
            let kind = match self.lookup(&mut meta, p.index, op)? {
                Mapping::Unallocated => RunKind::Backing,
                Mapping::Zero { .. } => RunKind::Zero,
                Mapping::Data { host, .. } => RunKind::Data(host + p.within as u64),
                Mapping::Compressed { host, len, .. } => RunKind::Compressed {
                    host,
                    len,
                    within: p.within,
                },
            };
            if let Some(last) = out.last_mut() {
                let merged = match (last.kind, kind) {
                    (RunKind::Data(a), RunKind::Data(b)) => a + last.len as u64 == b,
                    (RunKind::Zero, RunKind::Zero) | (RunKind::Backing, RunKind::Backing) => true,
                    _ => false,
                };
                if merged {
                    last.len += p.len;
                    continue;
                }
            }
            out.push(Run {
                pos: p.pos,
                len: p.len,
                kind,
            });
        }
        Ok(out)
    }

    /// Fills `buf` (the run's bytes, at guest `guest`) from the run's source; appends holes
    /// (relative to `hole_base`) when asked.
    pub(crate) fn read_run(
        &self,
        kind: RunKind,
        buf: &mut [u8],
        guest: u64,
        holes: Option<(&mut Vec<Hole>, usize)>,
    ) -> Result<()> {
        match kind {
            RunKind::Data(host) => self.file.read_exact_at(buf, host).map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    self.corrupt(Op::Read, guest, format!("guest offset {guest} maps to host offset {host}, past the end of the file"))
                } else {
                    self.io(e, Op::Read, guest, buf.len() as u64)
                }
            }),
            RunKind::Zero => {
                buf.fill(0);
                if let Some((h, base)) = holes {
                    h.push(Hole { start: base, len: buf.len() });
                }
                Ok(())
            }
            RunKind::Backing => self.read_backing(buf, guest, holes),
            RunKind::Compressed { host, len, within } => {
                let cluster = self.inflate(host, len, guest)?;
                buf.copy_from_slice(&cluster[within..within + buf.len()]);
                Ok(())
            }
        }
    }

    fn read_backing(
        &self,
        buf: &mut [u8],
        guest: u64,
        holes: Option<(&mut Vec<Hole>, usize)>,
    ) -> Result<()> {
        let avail = match &self.backing {
            Some(b) => b.size().saturating_sub(guest).min(buf.len() as u64) as usize,
            None => 0,
        };
        let (head, tail) = buf.split_at_mut(avail);
        let mut holes = holes;
        if let Some(b) = &self.backing {
            if !head.is_empty() {
                match holes.as_mut() {
                    Some((h, base)) => {
                        let mut found = Vec::new();
                        b.read_at_sparse(head, guest, &mut found)?;
                        h.extend(found.into_iter().map(|x| Hole {
                            start: x.start + *base,
                            len: x.len,
                        }));
                    }
                    None => b.read_at(head, guest)?,
                }
            }
        }
        tail.fill(0);
        if let Some((h, base)) = holes {
            if !tail.is_empty() {
                h.push(Hole {
                    start: base + avail,
                    len: tail.len(),
                });
            }
        }
        Ok(())
    }

    /// Inflates one compressed cluster.
    pub(crate) fn inflate(&self, host: u64, len: u64, guest: u64) -> Result<Vec<u8>> {
        let file_len = self
            .file
            .size()
            .map_err(|e| self.io(e, Op::Read, guest, 0))?;
        let len = len
            .min(file_len.saturating_sub(host))
            .min(2 * self.cs() + 512);
        let mut input = vec![0u8; len as usize];
        self.file
            .read_exact_at(&mut input, host)
            .map_err(|e| self.io(e, Op::Read, guest, len))?;
        let mut out = vec![0u8; self.cs() as usize];
        let mut d = flate2::Decompress::new(false);
        let status = d.decompress(&input, &mut out, flate2::FlushDecompress::Finish);
        if status.is_err() || d.total_out() != self.cs() {
            return Err(self.corrupt(Op::Read, guest, format!(
                "the compressed cluster at host offset {host} does not inflate to {} bytes ({status:?}, {} bytes out)", self.cs(), d.total_out())));
        }
        Ok(out)
    }

    /// Reads `buf` at `offset`, optionally collecting holes.
    pub(crate) fn read_into(
        &self,
        buf: &mut [u8],
        offset: u64,
        mut holes: Option<&mut Vec<Hole>>,
    ) -> Result<()> {
        for run in self.runs(offset, buf.len() as u64, Op::Read)? {
            let part = &mut buf[run.pos..run.pos + run.len];
            let h = holes.as_deref_mut().map(|h| (h, run.pos));
            self.read_run(run.kind, part, offset + run.pos as u64, h)?;
        }
        Ok(())
    }

    fn status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        let push = |out: &mut Vec<Extent>, e: Extent| match out.last_mut() {
            Some(l) if l.hole == e.hole && l.zero == e.zero => l.len += e.len,
            _ => out.push(e),
        };
        let start = out.len();
        for run in self.runs(offset, len, Op::BlockStatus)? {
            let (guest, rlen) = (offset + run.pos as u64, run.len as u64);
            match run.kind {
                RunKind::Data(_) | RunKind::Compressed { .. } => push(
                    out,
                    Extent {
                        len: rlen,
                        hole: false,
                        zero: false,
                    },
                ),
                RunKind::Zero => push(
                    out,
                    Extent {
                        len: rlen,
                        hole: true,
                        zero: true,
                    },
                ),
                RunKind::Backing => {
                    let avail = match &self.backing {
                        Some(b) => b.size().saturating_sub(guest).min(rlen),
                        None => 0,
                    };
                    if let (Some(b), true) = (&self.backing, avail > 0) {
                        let mut done = 0;
                        while done < avail {
                            let mut sub = Vec::new();
                            b.block_status(guest + done, avail - done, &mut sub)?;
                            if sub.is_empty() {
                                break;
                            }
                            for e in sub {
                                let l = e.len.min(avail - done);
                                if l == 0 {
                                    continue;
                                }
                                push(out, Extent { len: l, ..e });
                                done += l;
                            }
                        }
                        if done < avail {
                            // The backing device stopped short: report the rest as data.
                            push(
                                out,
                                Extent {
                                    len: avail - done,
                                    hole: false,
                                    zero: false,
                                },
                            );
                        }
                    }
                    if rlen > avail {
                        push(
                            out,
                            Extent {
                                len: rlen - avail,
                                hole: true,
                                zero: true,
                            },
                        );
                    }
                }
            }
        }
        debug_assert!(out.len() > start || len == 0);
        Ok(())
    }
}

/// Locks an image for reading (shared) or writing (exclusive), waiting out a conflict that
/// clears within [`LOCK_PATIENCE`] (see [`vdstream_blockdev::flock`]); a lock held for good
/// is refused, naming the image and what to do.
pub(crate) fn lock_file(file: &File, exclusive: bool, path: &Path) -> Result<()> {
    let mode = if exclusive {
        LockMode::Exclusive
    } else {
        LockMode::Shared
    };
    let e = match try_lock(file, mode, LOCK_PATIENCE) {
        Ok(true) => return Ok(()),
        Ok(false) => std::io::Error::from_raw_os_error(libc::EWOULDBLOCK),
        Err(e) => e,
    };
    let mut err = file_error(
        ErrorKind::Io,
        Op::Open,
        0,
        path,
        if exclusive {
            "the image is already open elsewhere (vdstream allows one writer and no readers beside it): close the other user first".to_string()
        } else {
            "the image is open read-write elsewhere: close the writer first".to_string()
        },
    );
    err.os_error = Some(e);
    Err(err)
}

pub(crate) fn rc_error(e: RefcountError, op: Op, path: &Path) -> Error {
    match e {
        RefcountError::Io(e) => Error::from_io(e, op, 0, 0, path.display().to_string()),
        RefcountError::Corrupt(m) => file_error(
            ErrorKind::Io,
            op,
            0,
            path,
            format!("{m}: the refcounts are corrupt; run `qemu-img check -r all`"),
        ),
    }
}

impl BlockDev for Qcow2Image {
    fn size(&self) -> u64 {
        self.header.size
    }

    fn caps(&self) -> Caps {
        let rw = !self.read_only;
        Caps {
            read_only: self.read_only,
            flush: rw,
            fua: rw,
            trim: rw,
            zeroes: rw,
            fast_zero: false,
            cache: false,
            block_status: true,
            multi_conn: true,
            may_block: true,
            preferred_block: self.cs().min(64 * 1024) as u32,
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size(), Op::Read, offset, buf.len() as u64, &|| {
            self.name()
        })?;
        self.read_into(buf, offset, None)
    }

    fn read_at_sparse(&self, buf: &mut [u8], offset: u64, holes: &mut Vec<Hole>) -> Result<()> {
        check_range(self.size(), Op::Read, offset, buf.len() as u64, &|| {
            self.name()
        })?;
        self.read_into(buf, offset, Some(holes))
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.write_impl(buf, offset, fua)
    }

    fn flush(&self) -> Result<()> {
        self.flush_impl()
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.zero_impl(Op::Trim, offset, len, fua)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        if flags.fast_only {
            check_range(self.size(), Op::Zero, offset, len, &|| self.name())?;
            return Err(Error::new(
                ErrorKind::NotFast,
                Op::Zero,
                offset,
                len,
                self.name(),
                "fast zeroing is not offered",
            ));
        }
        self.zero_impl(Op::Zero, offset, len, flags.fua)
    }

    fn block_status(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        check_range(self.size(), Op::BlockStatus, offset, len, &|| self.name())?;
        self.status(offset, len, out)
    }

    fn describe(&self) -> String {
        self.name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vdstream_blockdev::flock::lock_wait;

    #[test]
    fn a_lock_released_a_moment_later_is_taken_and_a_held_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, b"x").unwrap();
        let open = || File::open(&path).unwrap();
        // Held for 50 ms (as by a forked child on its way to exec): the open waits it out.
        let holder = open();
        lock_wait(&holder, LockMode::Exclusive).unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            drop(holder);
        });
        lock_file(&open(), false, &path).unwrap();
        release.join().unwrap();
        // Held for good: refused, naming the image, once the patience is spent.
        let writer = open();
        lock_wait(&writer, LockMode::Exclusive).unwrap();
        let start = std::time::Instant::now();
        let e = lock_file(&open(), false, &path).unwrap_err();
        assert!(start.elapsed() >= LOCK_PATIENCE);
        assert!(
            e.to_string().contains("img") && e.to_string().contains("open read-write elsewhere"),
            "{e}"
        );
        drop(writer);
    }
}
