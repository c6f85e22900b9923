//! The metadata files of a persistent disk cache: the [`Checkpoint`] (the whole page map at
//! one flush) and the [`Journal`] (page-state changes appended at each flush since then).
//! Parsing and encoding live here, apart from the I/O engine in [`crate::persistent`].
//!
//! Formats (little-endian):
//!
//! ```text
//! checkpoint  "VDSCKPT1" | version u32 | page size u32 | seq u64 | lower size u64
//!             | identity len u32 | identity bytes | word count u64 | words u64…   | crc32 u32
//! journal     "VDSJRNL1" | version u32 | reserved u32                (16-byte header)
//!   record    magic u32 "VDJR" | seq u64 | count u32 | entries u64… | crc32 u32
//!             entry = page << 2 | state (1 data, 2 zero)
//! ```
//!
//! Invariants: a checkpoint is written to a temporary name, synced, renamed over the old
//! one and the folder synced, so it is always whole; the CRC covers everything before it.
//! Journal records carry consecutive sequence numbers; replay applies the records after the
//! checkpoint's `seq` and stops at the first short, bad-checksum, out-of-order or invalid
//! one (a torn tail from a crash), which the caller then truncates away.
//!
//! Space: the journal keeps [`JOURNAL_RESERVE`] bytes allocated past its end
//! (`fallocate` with `KEEP_SIZE`, so the file's length and its records do not change), and
//! tops the reservation up after each append. So a flush appends into blocks it already
//! holds, and a file system that the cache's data writes filled cannot make it fail: the
//! ENOSPC goes to the writes that did not fit, not to every flush after them. A reset (after
//! a checkpoint) frees the old blocks and reserves again at once.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use vdstream_blockdev::storefile;

use crate::pagemap::PageState;

const CHECKPOINT_MAGIC: &[u8; 8] = b"VDSCKPT1";
const JOURNAL_MAGIC: &[u8; 8] = b"VDSJRNL1";
const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"VDJR");
const VERSION: u32 = 1;
/// Bytes of the journal header.
pub const JOURNAL_HEADER: u64 = 16;
/// Most entries one journal record holds (a flush with more writes several records).
const MAX_ENTRIES: usize = 1 << 16;
const MAX_IDENTITY: usize = 4096;
/// Bytes the journal keeps allocated past its end: the records of one flush that changes
/// up to 32 Ki pages (128 MiB of new data) fit in it without new space.
pub const JOURNAL_RESERVE: u64 = 256 << 10;

/// CRC-32 (IEEE), table-driven.
pub fn crc32(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, slot) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0xEDB8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
            *slot = c;
        }
        t
    });
    !data.iter().fold(!0u32, |c, &b| {
        table[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8)
    })
}

/// The whole page map at one flush, plus what the cache was made for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// The last journal sequence number whose changes it includes.
    pub seq: u64,
    pub lower_size: u64,
    /// What the caller said the vDisk is ("" = not given).
    pub identity: String,
    /// The [`crate::pagemap::PageMap`] words.
    pub words: Vec<u64>,
}

impl Checkpoint {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(48 + self.identity.len() + self.words.len() * 8);
        out.extend_from_slice(CHECKPOINT_MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(crate::page::PAGE as u32).to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.lower_size.to_le_bytes());
        out.extend_from_slice(&(self.identity.len() as u32).to_le_bytes());
        out.extend_from_slice(self.identity.as_bytes());
        out.extend_from_slice(&(self.words.len() as u64).to_le_bytes());
        for w in &self.words {
            out.extend_from_slice(&w.to_le_bytes());
        }
        let crc = crc32(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Parses a checkpoint; `Err` says what is wrong with it.
    pub fn decode(bytes: &[u8]) -> Result<Checkpoint, String> {
        let body_len = bytes.len().checked_sub(4).ok_or("the file is too short")?;
        let (body, crc) = bytes.split_at(body_len);
        if crc32(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            if !body.starts_with(CHECKPOINT_MAGIC) {
                return Err("it is not a vdstream cache checkpoint (bad magic)".into());
            }
            return Err("its checksum does not match (the file is damaged)".into());
        }
        let mut r = Reader(body);
        if r.take(8)? != CHECKPOINT_MAGIC {
            return Err("it is not a vdstream cache checkpoint (bad magic)".into());
        }
        let version = r.u32()?;
        if version != VERSION {
            return Err(format!(
                "it has format version {version}; this build reads version {VERSION}"
            ));
        }
        let page = r.u32()?;
        if page as usize != crate::page::PAGE {
            return Err(format!(
                "it uses {page}-byte pages, not {}",
                crate::page::PAGE
            ));
        }
        let seq = r.u64()?;
        let lower_size = r.u64()?;
        let id_len = r.u32()? as usize;
        if id_len > MAX_IDENTITY {
            return Err(format!("its identity is {id_len} bytes long"));
        }
        let identity =
            String::from_utf8(r.take(id_len)?.to_vec()).map_err(|_| "its identity is not UTF-8")?;
        let n = r.u64()?;
        if n.checked_mul(8) != Some(r.0.len() as u64) {
            return Err(format!(
                "it claims {n} map words but holds {} bytes of them",
                r.0.len()
            ));
        }
        let words =
            r.0.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect();
        Ok(Checkpoint {
            seq,
            lower_size,
            identity,
            words,
        })
    }

    /// Reads the checkpoint at `path`: `Ok(None)` when there is none.
    pub fn load(path: &Path) -> io::Result<Option<Vec<u8>>> {
        match std::fs::read(path) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Writes the checkpoint durably and atomically over `path`: temporary file, fsync,
    /// rename, fsync of the folder.
    /// On failure before the rename the temporary file is removed, so a full file system
    /// is not left fuller, and the old checkpoint stays.
    pub fn store(&self, path: &Path) -> io::Result<()> {
        let tmp = tmp_path(path);
        let written = (|| {
            // Made afresh and owner-only: a leftover, or a link in its place, goes first.
            let mut f = storefile::create_fresh(&tmp, storefile::PRIVATE)?;
            f.write_all(&self.encode())?;
            f.sync_all()
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        std::fs::rename(&tmp, path)?;
        sync_dir(path)
    }
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

/// fsyncs the folder holding `path` (so a rename or a new file in it is durable).
pub fn sync_dir(path: &Path) -> io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    File::open(dir)?.sync_all()
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("the file is too short".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
}

/// What a replay found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Replay {
    /// The changes to apply, in order.
    pub changes: Vec<(u64, PageState)>,
    /// The last sequence number applied (the checkpoint's when none was).
    pub last_seq: u64,
    /// Where the valid records end: the next record goes here.
    pub end: u64,
    /// Why replay stopped before the end of the file, if it did.
    pub stopped: Option<String>,
}

/// The append-only journal of page-state changes.
#[derive(Debug)]
pub struct Journal {
    file: File,
    path: PathBuf,
    /// Where the next record goes.
    end: u64,
    /// Blocks are allocated (reserved) up to here; `end` when nothing is reserved.
    reserved: u64,
    /// Off once the file system said it cannot preallocate.
    can_reserve: bool,
}

impl Journal {
    /// Creates (or empties) the journal at `path`, durably.
    pub fn create(path: &Path) -> io::Result<Journal> {
        let file = storefile::options(storefile::PRIVATE)
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| storefile::explain(e, path))?;
        storefile::tighten_logged(&file, storefile::PRIVATE, path);
        let mut header = Vec::with_capacity(JOURNAL_HEADER as usize);
        header.extend_from_slice(JOURNAL_MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        file.write_all_at(&header, 0)?;
        file.sync_all()?;
        sync_dir(path)?;
        Ok(Journal {
            file,
            path: path.to_path_buf(),
            end: JOURNAL_HEADER,
            reserved: JOURNAL_HEADER,
            can_reserve: true,
        })
    }

    /// Opens an existing journal and reads the records after `after_seq` that are valid for
    /// a map of `pages` pages. `Ok(None)` when there is no journal; `Err` with a message
    /// when the file is not a journal at all.
    pub fn open(path: &Path, after_seq: u64, pages: u64) -> io::Result<Option<(Journal, Replay)>> {
        let mut file = match storefile::open_existing_rw(path) {
            Ok(f) => {
                storefile::tighten_logged(&f, storefile::PRIVATE, path);
                f
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        if bytes.len() < JOURNAL_HEADER as usize || &bytes[..8] != JOURNAL_MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "it is not a vdstream cache journal (bad header)",
            ));
        }
        let replay = parse_records(&bytes, after_seq, pages);
        // Blocks a former open reserved past the end are still there (a journal is written
        // and reserved front to back, so its allocated bytes end where the reservation does).
        use std::os::unix::fs::MetadataExt;
        let allocated = file.metadata()?.blocks().saturating_mul(512);
        let reserved = if replay.stopped.is_none() {
            allocated.max(replay.end)
        } else {
            replay.end
        };
        let journal = Journal {
            file,
            path: path.to_path_buf(),
            end: replay.end,
            reserved,
            can_reserve: true,
        };
        Ok(Some((journal, replay)))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes of records in the journal.
    pub fn len(&self) -> u64 {
        self.end - JOURNAL_HEADER
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Cuts the file at the end of the valid records (drops a torn tail, and any record a
    /// failed append left past the end), durably. Frees the reservation too (call
    /// [`reserve`](Self::reserve) after), so only call it when there is something to cut.
    /// Needs no space.
    pub fn truncate_tail(&mut self) -> io::Result<()> {
        self.file.set_len(self.end)?;
        self.reserved = self.end;
        self.file.sync_all()
    }

    /// Tops up the blocks allocated past the end to [`JOURNAL_RESERVE`] when less than half
    /// of it is left. An error (ENOSPC) leaves the journal as it was: it still works, with
    /// what is reserved. A file system that cannot preallocate is not an error.
    pub fn reserve(&mut self) -> io::Result<()> {
        if !self.can_reserve || self.reserved >= self.end + JOURNAL_RESERVE / 2 {
            return Ok(());
        }
        // Only past what is reserved already: a failed fallocate may give back the blocks of
        // its range that hold no data (tmpfs does), and those must stay reserved.
        let from = self.reserved.max(self.end);
        match crate::cachefile::fallocate(
            &self.file,
            libc::FALLOC_FL_KEEP_SIZE,
            from,
            self.end + JOURNAL_RESERVE - from,
        ) {
            Ok(()) => {
                self.reserved = self.end + JOURNAL_RESERVE;
                Ok(())
            }
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)
                ) =>
            {
                self.can_reserve = false;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Bytes allocated past the end of the records.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved.saturating_sub(self.end)
    }

    /// Appends `changes` as records numbered from `seq + 1`, then fdatasyncs; returns the
    /// last sequence number used. On error nothing counts as written (the end stays).
    pub fn append(&mut self, seq: u64, changes: &[(u64, PageState)]) -> io::Result<u64> {
        let mut buf = Vec::with_capacity(changes.len() * 8 + 32);
        let mut seq = seq;
        for chunk in changes.chunks(MAX_ENTRIES) {
            seq += 1;
            let start = buf.len();
            buf.extend_from_slice(&RECORD_MAGIC.to_le_bytes());
            buf.extend_from_slice(&seq.to_le_bytes());
            buf.extend_from_slice(&(chunk.len() as u32).to_le_bytes());
            for &(page, state) in chunk {
                buf.extend_from_slice(&((page << 2) | state as u64).to_le_bytes());
            }
            let crc = crc32(&buf[start..]);
            buf.extend_from_slice(&crc.to_le_bytes());
        }
        self.file.write_all_at(&buf, self.end)?;
        self.file.sync_data()?;
        self.end += buf.len() as u64;
        self.reserved = self.reserved.max(self.end);
        Ok(seq)
    }

    /// Empties the journal after a checkpoint made its records redundant, durably. This
    /// frees its blocks, reservation included: call [`reserve`](Self::reserve) right after.
    pub fn reset(&mut self) -> io::Result<()> {
        self.file.set_len(JOURNAL_HEADER)?;
        self.file.sync_all()?;
        self.end = JOURNAL_HEADER;
        self.reserved = JOURNAL_HEADER;
        Ok(())
    }
}

/// Reads the records of a journal image (header included). See the module notes.
pub fn parse_records(bytes: &[u8], after_seq: u64, pages: u64) -> Replay {
    let mut replay = Replay {
        last_seq: after_seq,
        end: JOURNAL_HEADER,
        ..Default::default()
    };
    let mut pos = JOURNAL_HEADER as usize;
    let mut prev: Option<u64> = None;
    while pos < bytes.len() {
        let stop = |why: String| Some(format!("record at byte {pos}: {why}"));
        let rest = &bytes[pos..];
        if rest.len() < 16 {
            replay.stopped = stop("torn header".into());
            break;
        }
        let magic = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
        let seq = u64::from_le_bytes(rest[4..12].try_into().expect("8 bytes"));
        let count = u32::from_le_bytes(rest[12..16].try_into().expect("4 bytes")) as usize;
        let len = 16 + count * 8 + 4;
        if magic != RECORD_MAGIC || count > MAX_ENTRIES {
            replay.stopped = stop("bad record header".into());
            break;
        }
        if rest.len() < len {
            replay.stopped = stop("torn record".into());
            break;
        }
        let crc = u32::from_le_bytes(rest[len - 4..len].try_into().expect("4 bytes"));
        if crc32(&rest[..len - 4]) != crc {
            replay.stopped = stop("bad checksum".into());
            break;
        }
        if prev.is_some_and(|p| seq != p + 1) || (seq > after_seq && seq != replay.last_seq + 1) {
            replay.stopped = stop(format!("sequence number {seq} out of order"));
            break;
        }
        let mut entries = Vec::with_capacity(count);
        for e in rest[16..len - 4].chunks_exact(8) {
            let v = u64::from_le_bytes(e.try_into().expect("8 bytes"));
            match PageState::from_bits(v & 3) {
                Some(s @ (PageState::Data | PageState::Zero)) if v >> 2 < pages => {
                    entries.push((v >> 2, s))
                }
                _ => break,
            }
        }
        if entries.len() != count {
            replay.stopped = stop("an entry names a page or state that cannot be".into());
            break;
        }
        if seq > after_seq {
            replay.changes.extend(entries);
            replay.last_seq = seq;
        }
        prev = Some(seq);
        pos += len;
        replay.end = pos as u64;
    }
    replay
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn checkpoint_round_trips_and_detects_damage() {
        let cp = Checkpoint {
            seq: 7,
            lower_size: 12345,
            identity: "vdisk-a v3".into(),
            words: vec![1, 2, 0x5555],
        };
        let mut bytes = cp.encode();
        assert_eq!(Checkpoint::decode(&bytes).unwrap(), cp);
        bytes[30] ^= 1;
        assert!(Checkpoint::decode(&bytes).unwrap_err().contains("checksum"));
        assert!(Checkpoint::decode(b"xy").is_err());
        assert!(Checkpoint::decode(b"garbage garbage garbage")
            .unwrap_err()
            .contains("magic"));
    }

    #[test]
    fn replay_stops_at_a_torn_tail_and_skips_old_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let mut j = Journal::create(&path).unwrap();
        let s = j
            .append(4, &[(1, PageState::Data), (2, PageState::Zero)])
            .unwrap();
        assert_eq!(s, 5);
        let s = j.append(s, &[(3, PageState::Data)]).unwrap();
        let full = std::fs::read(&path).unwrap();
        let r = parse_records(&full, 4, 10);
        assert_eq!(
            r.changes,
            vec![
                (1, PageState::Data),
                (2, PageState::Zero),
                (3, PageState::Data)
            ]
        );
        assert_eq!(
            (r.last_seq, r.end, r.stopped.clone()),
            (s, full.len() as u64, None)
        );
        // After a checkpoint at 5, only record 6 applies.
        assert_eq!(
            parse_records(&full, 5, 10).changes,
            vec![(3, PageState::Data)]
        );
        // A torn tail: the first record only.
        for cut in [full.len() - 1, full.len() - 10] {
            let r = parse_records(&full[..cut], 4, 10);
            assert_eq!(r.changes.len(), 2);
            assert!(r.stopped.is_some());
        }
        // A page past the map is invalid.
        assert!(parse_records(&full, 4, 2).changes.is_empty());
    }
}
