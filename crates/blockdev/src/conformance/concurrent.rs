//! The concurrency checks of the conformance suite: threads writing disjoint ranges,
//! threads writing their own bytes of the same 4 KiB pages (and of a page pair across a
//! 2 MiB edge), and overlapping writers. Each knows its expected end state exactly, so a
//! lost update fails the check; a device passes only if its locking is per byte-range
//! correct, not merely free of crashes.

use super::{compare_all, guarded, pattern_buf, CheckResult, MakeDev, CHECK_SIZE, MIB};
/// Runs `threads` closures at once on the device, each given its index; joins all and
/// returns the first error.
fn in_threads(threads: usize, f: impl Fn(usize) -> CheckResult + Sync) -> CheckResult {
    let f = &f;
    let results: Vec<CheckResult> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| s.spawn(move || guarded(|| f(t))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into())))
            .collect()
    });
    results.into_iter().collect()
}

pub(super) fn concurrent_disjoint_ranges(make: MakeDev<'_>) -> CheckResult {
    const THREADS: usize = 4;
    let dev = make(CHECK_SIZE);
    // Thread t owns every 4th slice of 12_345 bytes (so slices share pages with neighbours).
    let slice = 12_345u64;
    let slices = CHECK_SIZE / slice;
    let owned = |t: usize| (0..slices).filter(move |i| i % THREADS as u64 == t as u64);
    in_threads(THREADS, |t| {
        for round in 1..=3u8 {
            for i in owned(t) {
                let seed = round * 16 + t as u8;
                let data = pattern_buf(seed, i * slice, slice as usize);
                dev.write_at(&data, i * slice, false)
                    .map_err(|e| e.to_string())?;
                if round == 2 && i % 3 == 0 {
                    dev.trim(i * slice + 100, 5000, false)
                        .map_err(|e| e.to_string())?;
                }
            }
        }
        Ok(())
    })?;
    let mut model = vec![0u8; CHECK_SIZE as usize];
    for t in 0..THREADS {
        for i in owned(t) {
            let at = (i * slice) as usize;
            model[at..at + slice as usize].copy_from_slice(&pattern_buf(
                3 * 16 + t as u8,
                i * slice,
                slice as usize,
            ));
        }
    }
    compare_all(&*dev, &model, "after 4 threads wrote disjoint slices")
}

pub(super) fn concurrent_bytes_of_one_page(make: MakeDev<'_>) -> CheckResult {
    const THREADS: usize = 8;
    const ROUNDS: usize = 300;
    let dev = make(CHECK_SIZE);
    // Two 4 KiB windows: one page, and one straddling the 2 MiB edge. Thread t owns bytes
    // [t*512, t*512+512) of each and rewrites sub-ranges of them; the last round writes
    // all of its bytes, so the expected end state is known.
    let windows = [3 * 4096u64, 2 * MIB - 2048];
    in_threads(THREADS, |t| {
        for round in 0..ROUNDS {
            for &w in &windows {
                let mine = w + t as u64 * 512;
                let (start, len) = if round + 1 == ROUNDS {
                    (mine, 512)
                } else {
                    (mine + (round % 7) as u64 * 37, 1 + (round * 13) % 250)
                };
                let seed = (round % 250) as u8 + 1;
                dev.write_at(&pattern_buf(seed, start, len), start, false)
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    })?;
    let mut model = vec![0u8; CHECK_SIZE as usize];
    let last_seed = ((ROUNDS - 1) % 250) as u8 + 1;
    for &w in &windows {
        model[w as usize..w as usize + 4096].copy_from_slice(&pattern_buf(last_seed, w, 4096));
    }
    compare_all(
        &*dev,
        &model,
        "after 8 threads wrote their own bytes of the same pages",
    )
}

pub(super) fn concurrent_overlapping_writes(make: MakeDev<'_>) -> CheckResult {
    const THREADS: usize = 4;
    let dev = make(CHECK_SIZE);
    let (offset, len) = (MIB + 1000, 9000usize);
    in_threads(THREADS, |t| {
        for _ in 0..200 {
            dev.write_at(&vec![t as u8 + 1; len], offset, false)
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    })?;
    let mut got = vec![0u8; len + 2];
    dev.read_at(&mut got, offset - 1)
        .map_err(|e| e.to_string())?;
    if got[0] != 0 || got[len + 1] != 0 {
        return Err("overlapping writes spilled outside their range".into());
    }
    match got[1..=len]
        .iter()
        .position(|&b| b == 0 || b > THREADS as u8)
    {
        None => Ok(()),
        Some(i) => Err(format!(
            "byte {} after overlapping writes is {:#04x}, from none of the writers",
            offset + i as u64,
            got[1 + i]
        )),
    }
}
