//! The conformance suite every [`BlockDev`] in the workspace must pass (TiKV's
//! `engine_traits` habit): a new device or write-cache type is done when its tests call
//! [`run_all`] (and [`run_read_only`] for its read-only form, and the model checks in
//! [`model`]) and they pass.
//!
//! Usage, from any crate's tests:
//!
//! ```no_run
//! # use std::sync::Arc;
//! use vdstream_blockdev::conformance::{self, model};
//! use vdstream_blockdev::MemoryDev;
//!
//! let make = |size| -> Arc<dyn vdstream_blockdev::BlockDev> { Arc::new(MemoryDev::new(size)) };
//! conformance::run_all("memory", &make);
//! model::model_check("memory", &make, model::ModelConfig::default());
//! model::model_check_concurrent("memory", &make, model::ModelConfig::default());
//! ```
//!
//! with, in the calling crate's `Cargo.toml`:
//! `vdstream-blockdev = { workspace = true, features = ["conformance"] }` under
//! `[dev-dependencies]`.
//!
//! Each check gets fresh devices from the constructor, compares what it reads with a plain
//! byte vector it keeps alongside, and returns a message naming what differed. The runners
//! run every check (a panic inside a check is caught and reported as its failure) and then
//! panic once, listing every failed check with the device's name, so one run shows them
//! all. Callers that need to skip a check (say, a device that cannot have an unaligned size)
//! filter [`checks`] and call [`run_checks`].
//!
//! What the suite holds every device to is the contract in the crate root: reads fill the
//! buffer, never-written/trimmed/zeroed bytes read as zero, out-of-range requests fail with
//! [`ErrorKind::OutOfRange`] without panicking, block status extents start at the offset,
//! are non-empty, contiguous and within the request, and claim zero only for zeros (and
//! report trimmed, 2 MiB-aligned ranges as zero when `caps.block_status`), and concurrent
//! writes to disjoint bytes — in the same 4 KiB page too — all survive.

mod concurrent;
pub mod model;
mod read_only;

use concurrent::{
    concurrent_bytes_of_one_page, concurrent_disjoint_ranges, concurrent_overlapping_writes,
};
pub use read_only::{run_read_only, READ_ONLY_SIZE};

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use crate::{BlockDev, ErrorKind, Extent, Hole, ZeroFlags};

/// A constructor of fresh, writable devices of a given size.
pub type MakeDev<'a> = &'a dyn Fn(u64) -> Arc<dyn BlockDev>;
/// A constructor of fresh read-only devices holding the given bytes.
pub type MakeReadOnlyDev<'a> = &'a dyn Fn(&[u8]) -> Arc<dyn BlockDev>;

/// What a check returns: `Err` says what differed.
pub type CheckResult = std::result::Result<(), String>;

/// One named check of writable devices.
#[derive(Clone, Copy)]
pub struct Check {
    pub name: &'static str,
    pub run: fn(MakeDev<'_>) -> CheckResult,
}

impl std::fmt::Debug for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
/// Size of the devices most checks use: four 2 MiB units, so that ranges cross them.
pub const CHECK_SIZE: u64 = 8 * MIB;
/// An awkward size: not a multiple of 512, let alone 4096.
pub const ODD_SIZE: u64 = 4 * MIB + 3 * 4096 + 777;

/// Every check of writable devices.
pub fn checks() -> Vec<Check> {
    macro_rules! checks {
        ($($f:ident),* $(,)?) => { vec![$(Check { name: stringify!($f), run: $f }),*] };
    }
    checks![
        caps_are_consistent,
        fresh_device_reads_zero,
        round_trip_at_edges,
        odd_size_device,
        trim_reads_zero,
        write_zeroes_reads_zero,
        fast_zero_is_fast_or_refused,
        block_status_is_well_formed,
        read_at_sparse_holes_are_zero,
        out_of_range_is_refused,
        flush_and_fua,
        concurrent_disjoint_ranges,
        concurrent_bytes_of_one_page,
        concurrent_overlapping_writes,
    ]
}

/// Runs every check on devices from `make`; panics listing every failure.
pub fn run_all(name: &str, make: MakeDev<'_>) {
    run_checks(name, make, &checks());
}

/// Runs the given checks; panics listing every failure, each named `device/check`.
pub fn run_checks(name: &str, make: MakeDev<'_>, checks: &[Check]) {
    let failures: Vec<String> = checks
        .iter()
        .filter_map(|c| {
            guarded(|| (c.run)(make))
                .err()
                .map(|m| format!("  {name}/{}: {m}", c.name))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} conformance checks failed for {name}:\n{}",
        failures.len(),
        checks.len(),
        failures.join("\n")
    );
}

/// Runs a check, turning a panic into an `Err` with the panic's message.
fn guarded(f: impl FnOnce() -> CheckResult) -> CheckResult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            Err(format!(
                "panicked: {}",
                msg.unwrap_or_else(|| "(no message)".into())
            ))
        }
    }
}

/// Period of [`pattern`]: a prime, so that the pattern never repeats at a page or 2 MiB
/// stride and a write that lands at the wrong offset shows.
const PATTERN_PERIOD: usize = 65_521;

/// One period of the pattern of each seed, made on first use (the pattern is copied, not
/// computed per byte, so that unoptimised test builds stay quick).
fn pattern_period(seed: u8) -> &'static [u8] {
    static TABLES: [std::sync::OnceLock<Box<[u8]>>; 256] =
        [const { std::sync::OnceLock::new() }; 256];
    TABLES[seed as usize].get_or_init(|| {
        (0..PATTERN_PERIOD as u64)
            .map(|p| {
                if seed == 0 {
                    return 0;
                }
                let x = p.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    ^ (seed as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
                ((x >> 29) as u8 ^ seed) | 1
            })
            .collect()
    })
}

/// The bytes the checks write: a function of the absolute position and a seed, never zero
/// for seed != 0 (so a lost or misplaced write shows), all zero for seed 0.
pub fn pattern(seed: u8, pos: u64) -> u8 {
    pattern_period(seed)[(pos % PATTERN_PERIOD as u64) as usize]
}

/// `len` bytes of [`pattern`] starting at absolute position `offset`.
pub fn pattern_buf(seed: u8, offset: u64, len: usize) -> Vec<u8> {
    let period = pattern_period(seed);
    let mut out = Vec::with_capacity(len);
    let mut at = (offset % PATTERN_PERIOD as u64) as usize;
    while out.len() < len {
        let take = (PATTERN_PERIOD - at).min(len - out.len());
        out.extend_from_slice(&period[at..at + take]);
        at = 0;
    }
    out
}

/// Reads the whole device in 1 MiB pieces and compares it with `model`, naming the first
/// differing byte and `context`.
pub fn compare_all(dev: &dyn BlockDev, model: &[u8], context: &str) -> CheckResult {
    if dev.size() != model.len() as u64 {
        return Err(format!(
            "{context}: size() is {}, expected {}",
            dev.size(),
            model.len()
        ));
    }
    for (i, want) in model.chunks(MIB as usize).enumerate() {
        let offset = i as u64 * MIB;
        let mut got = vec![0xEEu8; want.len()];
        dev.read_at(&mut got, offset)
            .map_err(|e| format!("{context}: full read failed: {e}"))?;
        compare(&got, want, offset, context)?;
    }
    Ok(())
}

/// Compares what was read at `offset` with what was expected.
pub fn compare(got: &[u8], want: &[u8], offset: u64, context: &str) -> CheckResult {
    if got == want {
        return Ok(());
    }
    if got.len() != want.len() {
        return Err(format!(
            "{context}: read {} bytes at {offset}, expected {}",
            got.len(),
            want.len()
        ));
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{context}: byte at offset {} reads {:#04x}, expected {:#04x} (read of {} bytes at {offset})",
            offset + i as u64,
            got[i],
            want[i],
            got.len()
        )),
    }
}

/// Writes [`pattern`] bytes with `seed` to the device and the model.
fn write_both(
    dev: &dyn BlockDev,
    model: &mut [u8],
    seed: u8,
    offset: u64,
    len: usize,
) -> CheckResult {
    let data = pattern_buf(seed, offset, len);
    dev.write_at(&data, offset, false)
        .map_err(|e| format!("write of {len} bytes at {offset} failed: {e}"))?;
    model[offset as usize..offset as usize + len].copy_from_slice(&data);
    Ok(())
}

/// Asks for block status over `[offset, offset+len)` until it is covered, checking each
/// answer against the rules, and returns the extents (which together cover the range).
pub fn block_status_covering(
    dev: &dyn BlockDev,
    offset: u64,
    len: u64,
) -> Result<Vec<Extent>, String> {
    let mut all = Vec::new();
    let mut pos = offset;
    let end = offset + len;
    while pos < end {
        let sentinel = Extent {
            len: 12345,
            hole: false,
            zero: true,
        };
        let mut out = vec![sentinel];
        dev.block_status(pos, end - pos, &mut out)
            .map_err(|e| format!("block_status({pos}, {}) failed: {e}", end - pos))?;
        if out.first() != Some(&sentinel) {
            return Err("block_status must append to `out`, not clear or rewrite it".into());
        }
        check_extents(pos, end - pos, &out[1..])?;
        pos += out[1..].iter().map(|e| e.len).sum::<u64>();
        all.extend_from_slice(&out[1..]);
    }
    Ok(all)
}

/// The rules for one block-status answer to `[offset, offset+len)` (len > 0): at least one
/// extent, none empty, a hole always reads zero, and together no longer than asked.
pub fn check_extents(offset: u64, len: u64, extents: &[Extent]) -> CheckResult {
    if extents.is_empty() {
        return Err(format!("block_status({offset}, {len}) returned no extent"));
    }
    let mut total = 0u64;
    for e in extents {
        if e.len == 0 {
            return Err(format!(
                "block_status({offset}, {len}) returned an empty extent: {extents:?}"
            ));
        }
        if e.hole && !e.zero {
            return Err(format!(
                "block_status({offset}, {len}): a hole must also be zero: {e:?}"
            ));
        }
        total = total.saturating_add(e.len);
    }
    if total > len {
        return Err(format!(
            "block_status({offset}, {len}) describes {total} bytes, more than asked: {extents:?}"
        ));
    }
    Ok(())
}

/// Checks that every extent claiming zero reads as zero in `model`, starting at `offset`.
pub fn check_extents_against(model: &[u8], offset: u64, extents: &[Extent]) -> CheckResult {
    let mut pos = offset as usize;
    for e in extents {
        let range = &model[pos..pos + e.len as usize];
        if e.zero {
            if let Some(i) = range.iter().position(|&b| b != 0) {
                return Err(format!(
                    "block status says [{pos}, +{}) is zero, but byte {} is {:#04x}",
                    e.len,
                    pos + i,
                    range[i]
                ));
            }
        }
        pos += e.len as usize;
    }
    Ok(())
}

/// Checks a `read_at_sparse` answer: holes inside the buffer, ordered, not overlapping,
/// and zero in the buffer.
pub fn check_holes(buf: &[u8], holes: &[Hole], context: &str) -> CheckResult {
    let mut prev_end = 0usize;
    for h in holes {
        if h.len == 0 || h.start < prev_end || h.start + h.len > buf.len() {
            return Err(format!("{context}: bad hole {h:?} (buffer {} bytes, previous hole ends at {prev_end}): {holes:?}", buf.len()));
        }
        if buf[h.start..h.start + h.len].iter().any(|&b| b != 0) {
            return Err(format!("{context}: hole {h:?} is not zero in the buffer"));
        }
        prev_end = h.start + h.len;
    }
    Ok(())
}

fn expect_kind<T: std::fmt::Debug>(
    r: crate::Result<T>,
    kinds: &[ErrorKind],
    what: &str,
) -> CheckResult {
    match r {
        Err(e) if kinds.contains(&e.kind) => Ok(()),
        Err(e) => Err(format!("{what}: expected {kinds:?}, got {:?}: {e}", e.kind)),
        Ok(v) => Err(format!("{what}: expected {kinds:?}, got Ok({v:?})")),
    }
}

// ---- checks of writable devices ---------------------------------------------------------

fn caps_are_consistent(make: MakeDev<'_>) -> CheckResult {
    let dev = make(CHECK_SIZE);
    let caps = dev.caps();
    if dev.size() != CHECK_SIZE {
        return Err(format!(
            "asked for {CHECK_SIZE} bytes, size() is {}",
            dev.size()
        ));
    }
    if caps.read_only {
        return Err("run_all needs a writable device; use run_read_only for read-only ones".into());
    }
    if caps.fast_zero && !caps.zeroes {
        return Err(
            "caps.fast_zero without caps.zeroes (NBD needs SEND_WRITE_ZEROES for SEND_FAST_ZERO)"
                .into(),
        );
    }
    if !caps.preferred_block.is_power_of_two() {
        return Err(format!(
            "preferred_block {} is not a power of two",
            caps.preferred_block
        ));
    }
    if dev.describe().is_empty() {
        return Err("describe() is empty: errors would not say which device".into());
    }
    Ok(())
}

fn fresh_device_reads_zero(make: MakeDev<'_>) -> CheckResult {
    let dev = make(CHECK_SIZE);
    compare_all(&*dev, &vec![0; CHECK_SIZE as usize], "fresh device")
}

/// (offset, len) pairs at the awkward places of a device of `size` bytes.
fn edge_ranges(size: u64) -> Vec<(u64, usize)> {
    let two = 2 * MIB;
    let ranges = vec![
        (0, 1),
        (1, 511),
        (4095, 2),
        (4096 - 1, 4097),
        (8192, 4096),
        (3 * 4096 + 5, 4097),
        (two - 3, 4097),
        (two - 4096, 8192),
        (two * 2 - 1, 1),
        (12345, 70000),
        (MIB, MIB as usize),
        (size - 1, 1),
        (size - 4097, 4097),
        (size - 511, 511),
    ];
    ranges
        .into_iter()
        .filter(|&(offset, len)| offset + len as u64 <= size)
        .collect()
}

fn round_trip_at_edges(make: MakeDev<'_>) -> CheckResult {
    round_trip(&*make(CHECK_SIZE), CHECK_SIZE)
}

fn round_trip(dev: &dyn BlockDev, size: u64) -> CheckResult {
    let mut model = vec![0u8; size as usize];
    for (i, &(offset, len)) in edge_ranges(size).iter().enumerate() {
        let seed = i as u8 + 1;
        write_both(dev, &mut model, seed, offset, len)?;
        let mut got = vec![0u8; len];
        dev.read_at(&mut got, offset)
            .map_err(|e| format!("read after write failed: {e}"))?;
        compare(
            &got,
            &model[offset as usize..][..len],
            offset,
            &format!("read back a write of {len} bytes at {offset}"),
        )?;
    }
    compare_all(dev, &model, "after writes at page and 2 MiB edges")
}

fn odd_size_device(make: MakeDev<'_>) -> CheckResult {
    let dev = make(ODD_SIZE);
    if dev.size() != ODD_SIZE {
        return Err(format!(
            "asked for {ODD_SIZE} bytes, size() is {}",
            dev.size()
        ));
    }
    compare_all(
        &*dev,
        &vec![0; ODD_SIZE as usize],
        "fresh device of odd size",
    )?;
    round_trip(&*dev, ODD_SIZE)?;
    let mut model = vec![0u8; ODD_SIZE as usize];
    let mut buf = vec![0u8; ODD_SIZE as usize];
    dev.read_at(&mut buf, 0).map_err(|e| e.to_string())?;
    model.copy_from_slice(&buf);
    dev.trim(ODD_SIZE - 5000, 5000, false)
        .map_err(|e| format!("trim of the end failed: {e}"))?;
    model[(ODD_SIZE - 5000) as usize..].fill(0);
    compare_all(&*dev, &model, "after trimming the last 5000 bytes")?;
    write_both(&*dev, &mut model, 9, ODD_SIZE - 3000, 3000)?;
    dev.write_zeroes(ODD_SIZE - 100, 100, ZeroFlags::default())
        .map_err(|e| format!("zeroing the end failed: {e}"))?;
    model[(ODD_SIZE - 100) as usize..].fill(0);
    compare_all(&*dev, &model, "after zeroing the last 100 bytes")?;
    let extents = block_status_covering(&*dev, 0, ODD_SIZE)?;
    check_extents_against(&model, 0, &extents)
}

/// Fills the first 6 MiB (plus a bit) with data; returns the model.
fn filled(dev: &dyn BlockDev) -> Result<Vec<u8>, String> {
    let mut model = vec![0u8; dev.size() as usize];
    let len = (6 * MIB + 3000) as usize;
    write_both(dev, &mut model, 0x5a, 0, len)?;
    Ok(model)
}

fn trim_reads_zero(make: MakeDev<'_>) -> CheckResult {
    let dev = make(CHECK_SIZE);
    let mut model = filled(&*dev)?;
    for (offset, len) in [
        (2 * MIB, 2 * MIB),
        (100, 5000),
        (4096, 4096),
        (6 * MIB - 10, 20),
        (5 * MIB + 1, 300 * KIB),
    ] {
        dev.trim(offset, len, false)
            .map_err(|e| format!("trim({offset}, {len}) failed: {e}"))?;
        model[offset as usize..(offset + len) as usize].fill(0);
        compare_all(&*dev, &model, &format!("after trim({offset}, {len})"))?;
    }
    if dev.caps().block_status {
        let extents = block_status_covering(&*dev, 2 * MIB, 2 * MIB)?;
        if let Some(e) = extents.iter().find(|e| !e.zero) {
            return Err(format!(
                "a trimmed, 2 MiB-aligned range must report zero; got {e:?} in {extents:?}"
            ));
        }
    }
    Ok(())
}

fn write_zeroes_reads_zero(make: MakeDev<'_>) -> CheckResult {
    let dev = make(CHECK_SIZE);
    let mut model = filled(&*dev)?;
    let ranges = [
        (2 * MIB, 2 * MIB),
        (100, 5000),
        (8192, 4096),
        (6 * MIB - 10, 20),
        (5 * MIB + 1, 300 * KIB),
    ];
    for (i, &(offset, len)) in ranges.iter().enumerate() {
        let flags = ZeroFlags {
            may_trim: i % 2 == 0,
            fast_only: false,
            fua: i == 3,
        };
        dev.write_zeroes(offset, len, flags)
            .map_err(|e| format!("write_zeroes({offset}, {len}, {flags:?}) failed: {e}"))?;
        model[offset as usize..(offset + len) as usize].fill(0);
        compare_all(
            &*dev,
            &model,
            &format!("after write_zeroes({offset}, {len}, {flags:?})"),
        )?;
    }
    // Zeroing what was never written, and then writing into it again.
    dev.write_zeroes(7 * MIB, 4096 * 3, ZeroFlags::default())
        .map_err(|e| e.to_string())?;
    write_both(&*dev, &mut model, 3, 7 * MIB + 4000, 200)?;
    compare_all(&*dev, &model, "after writing into a zeroed hole")
}

fn fast_zero_is_fast_or_refused(make: MakeDev<'_>) -> CheckResult {
    let dev = make(CHECK_SIZE);
    if !dev.caps().fast_zero {
        return Ok(());
    }
    let mut model = filled(&*dev)?;
    let flags = ZeroFlags {
        may_trim: false,
        fast_only: true,
        fua: false,
    };
    match dev.write_zeroes(MIB + 7, 3 * MIB, flags) {
        Ok(()) => model[(MIB + 7) as usize..(4 * MIB + 7) as usize].fill(0),
        Err(e) if e.kind == ErrorKind::NotFast => {}
        Err(e) => {
            return Err(format!(
                "a fast-only write_zeroes must succeed or answer NotFast, got {:?}: {e}",
                e.kind
            ))
        }
    }
    compare_all(&*dev, &model, "after a fast-only write_zeroes")
}

fn block_status_is_well_formed(make: MakeDev<'_>) -> CheckResult {
    let dev = make(CHECK_SIZE);
    let mut model = vec![0u8; CHECK_SIZE as usize];
    for (i, &(offset, len)) in edge_ranges(CHECK_SIZE).iter().enumerate().step_by(2) {
        write_both(&*dev, &mut model, i as u8 + 1, offset, len)?;
    }
    dev.trim(4 * MIB, 2 * MIB, false)
        .map_err(|e| e.to_string())?;
    model[4 * MIB as usize..6 * MIB as usize].fill(0);
    for (offset, len) in [
        (0, CHECK_SIZE),
        (1, 1),
        (4095, 3),
        (2 * MIB - 1, 2 * MIB + 2),
        (CHECK_SIZE - 1, 1),
        (3 * MIB, 3 * MIB),
    ] {
        let extents = block_status_covering(&*dev, offset, len)?;
        check_extents_against(&model, offset, &extents)?;
    }
    if dev.caps().block_status {
        let extents = block_status_covering(&*dev, 4 * MIB, 2 * MIB)?;
        if extents.iter().any(|e| !e.zero) {
            return Err(format!(
                "trimmed range [4 MiB, 6 MiB) must report zero: {extents:?}"
            ));
        }
    }
    Ok(())
}

fn read_at_sparse_holes_are_zero(make: MakeDev<'_>) -> CheckResult {
    let dev = make(CHECK_SIZE);
    let mut model = vec![0u8; CHECK_SIZE as usize];
    write_both(&*dev, &mut model, 7, 4096 + 100, 50)?;
    write_both(&*dev, &mut model, 8, 3 * MIB, 8192)?;
    write_both(&*dev, &mut model, 9, CHECK_SIZE - 10, 10)?;
    for (offset, len) in [
        (0, 5 * MIB as usize),
        (4000, 9000),
        (3 * MIB - 1, 3),
        (CHECK_SIZE - 70000, 70000),
    ] {
        let mut buf = vec![0xAAu8; len];
        let prior = Hole { start: 1, len: 1 };
        let mut holes = vec![prior];
        dev.read_at_sparse(&mut buf, offset, &mut holes)
            .map_err(|e| format!("read_at_sparse({offset}, {len}) failed: {e}"))?;
        if holes.first() != Some(&prior) {
            return Err("read_at_sparse must append to `holes`, not clear or rewrite it".into());
        }
        let context = format!("read_at_sparse({offset}, {len})");
        check_holes(&buf, &holes[1..], &context)?;
        compare(&buf, &model[offset as usize..][..len], offset, &context)?;
    }
    Ok(())
}

fn out_of_range_is_refused(make: MakeDev<'_>) -> CheckResult {
    let dev = make(CHECK_SIZE);
    let s = CHECK_SIZE;
    let oor = [ErrorKind::OutOfRange];
    for (offset, len) in [
        (s - 1, 2u64),
        (s, 1),
        (s + 4096, 4096),
        (u64::MAX, 1),
        (u64::MAX - 10, 4096),
    ] {
        let mut buf = vec![0u8; len as usize];
        expect_kind(
            dev.read_at(&mut buf, offset),
            &oor,
            &format!("read_at({offset}, {len})"),
        )?;
        expect_kind(
            dev.read_at_sparse(&mut buf, offset, &mut Vec::new()),
            &oor,
            &format!("read_at_sparse({offset}, {len})"),
        )?;
        expect_kind(
            dev.write_at(&buf, offset, false),
            &oor,
            &format!("write_at({offset}, {len})"),
        )?;
        expect_kind(
            dev.trim(offset, len, false),
            &oor,
            &format!("trim({offset}, {len})"),
        )?;
        expect_kind(
            dev.write_zeroes(offset, len, ZeroFlags::default()),
            &oor,
            &format!("write_zeroes({offset}, {len})"),
        )?;
        if dev.caps().block_status {
            expect_kind(
                dev.block_status(offset, len, &mut Vec::new()),
                &oor,
                &format!("block_status({offset}, {len})"),
            )?;
        }
    }
    expect_kind(dev.trim(0, u64::MAX, false), &oor, "trim(0, u64::MAX)")?;
    // Empty requests at the very end are in range.
    dev.read_at(&mut [], s)
        .map_err(|e| format!("an empty read at the end must succeed: {e}"))?;
    dev.write_at(&[], s, false)
        .map_err(|e| format!("an empty write at the end must succeed: {e}"))?;
    compare_all(&*dev, &vec![0; s as usize], "after refused requests")
}

fn flush_and_fua(make: MakeDev<'_>) -> CheckResult {
    let dev = make(CHECK_SIZE);
    let mut model = vec![0u8; CHECK_SIZE as usize];
    write_both(&*dev, &mut model, 1, 1000, 10000)?;
    dev.flush().map_err(|e| format!("flush failed: {e}"))?;
    let data = pattern_buf(2, 3 * MIB - 7, 9000);
    dev.write_at(&data, 3 * MIB - 7, true)
        .map_err(|e| format!("FUA write failed: {e}"))?;
    model[(3 * MIB - 7) as usize..][..9000].copy_from_slice(&data);
    dev.trim(2000, 3000, true)
        .map_err(|e| format!("FUA trim failed: {e}"))?;
    model[2000..5000].fill(0);
    dev.write_zeroes(
        3 * MIB,
        100,
        ZeroFlags {
            fua: true,
            ..Default::default()
        },
    )
    .map_err(|e| format!("FUA zero failed: {e}"))?;
    model[3 * MIB as usize..][..100].fill(0);
    dev.flush()
        .map_err(|e| format!("second flush failed: {e}"))?;
    compare_all(&*dev, &model, "after FUA writes and flushes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Caps, MemoryDev, Result};

    /// A device that drops writes starting in the second half of a page: the suite must
    /// notice (a suite that passes everything proves nothing).
    #[derive(Debug)]
    struct ForgetfulDev(MemoryDev);

    impl BlockDev for ForgetfulDev {
        fn size(&self) -> u64 {
            self.0.size()
        }
        fn caps(&self) -> Caps {
            self.0.caps()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
            self.0.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
            if offset % 4096 >= 2048 {
                return Ok(());
            }
            self.0.write_at(buf, offset, fua)
        }
        fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
            self.0.trim(offset, len, fua)
        }
        fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
            self.0.write_zeroes(offset, len, flags)
        }
        fn describe(&self) -> String {
            "forgetful".into()
        }
    }

    #[test]
    fn the_suite_catches_a_broken_device() {
        let make: MakeDev<'_> = &|size| Arc::new(ForgetfulDev(MemoryDev::new(size)));
        let failed: Vec<_> = checks()
            .iter()
            .filter(|c| guarded(|| (c.run)(make)).is_err())
            .map(|c| c.name)
            .collect();
        for must_fail in [
            "round_trip_at_edges",
            "concurrent_disjoint_ranges",
            "concurrent_bytes_of_one_page",
        ] {
            assert!(
                failed.contains(&must_fail),
                "{must_fail} did not notice lost writes; failed: {failed:?}"
            );
        }
        assert!(guarded(|| Err::<(), _>("x".into())).is_err());
    }

    #[test]
    fn pattern_is_never_zero_with_a_seed() {
        assert!((0..100_000u64).all(|p| pattern(1, p) != 0 && pattern(255, p) != 0));
        assert!((0..100u64).all(|p| pattern(0, p) == 0));
        assert_ne!(pattern_buf(1, 0, 64), pattern_buf(2, 0, 64));
        assert_ne!(
            pattern_buf(1, 0, 64),
            pattern_buf(1, 4096, 64),
            "the pattern must not repeat per page"
        );
        let long = pattern_buf(5, 1000, 3 * PATTERN_PERIOD);
        assert!(long
            .iter()
            .enumerate()
            .all(|(i, &b)| b == pattern(5, 1000 + i as u64)));
    }
}
