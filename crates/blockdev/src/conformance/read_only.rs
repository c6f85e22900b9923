//! The read-only half of the conformance suite: a read-only device must read what it
//! holds, refuse every write, trim and zero with `ErrorKind::ReadOnly` (naming itself in
//! the message) and change nothing, and still flush, report block status and read sparse.

use super::{
    block_status_covering, check_extents_against, check_holes, compare, compare_all, edge_ranges,
    expect_kind, guarded, pattern_buf, CheckResult, MakeReadOnlyDev, MIB,
};
use crate::{ErrorKind, ZeroFlags};

/// Size of the content handed to read-only constructors.
pub const READ_ONLY_SIZE: u64 = 3 * MIB + 333;

/// Runs the checks for read-only devices: `make` returns a read-only device holding the
/// given bytes. Panics listing every failure.
pub fn run_read_only(name: &str, make: MakeReadOnlyDev<'_>) {
    let mut content = pattern_buf(0x33, 0, READ_ONLY_SIZE as usize);
    content[MIB as usize..2 * MIB as usize].fill(0);
    let content = &content;
    let checks: [(&str, &dyn Fn() -> CheckResult); 4] = [
        ("reads_what_it_holds", &|| {
            let dev = make(content);
            if !dev.caps().read_only {
                return Err("caps().read_only is false".into());
            }
            for &(offset, len) in &edge_ranges(READ_ONLY_SIZE) {
                let mut buf = vec![0u8; len];
                dev.read_at(&mut buf, offset)
                    .map_err(|e| format!("read failed: {e}"))?;
                compare(
                    &buf,
                    &content[offset as usize..][..len],
                    offset,
                    "read-only device",
                )?;
            }
            compare_all(&*dev, content, "read-only device")
        }),
        ("refuses_every_write", &|| {
            let dev = make(content);
            let ro = [ErrorKind::ReadOnly];
            for (offset, len) in [
                (0u64, 1u64),
                (4095, 4097),
                (READ_ONLY_SIZE - 1, 1),
                (MIB, MIB),
            ] {
                let data = vec![0x77u8; len as usize];
                expect_kind(
                    dev.write_at(&data, offset, false),
                    &ro,
                    &format!("write_at({offset}, {len})"),
                )?;
                expect_kind(
                    dev.write_at(&data, offset, true),
                    &ro,
                    &format!("FUA write_at({offset}, {len})"),
                )?;
                expect_kind(
                    dev.trim(offset, len, false),
                    &ro,
                    &format!("trim({offset}, {len})"),
                )?;
                for may_trim in [false, true] {
                    for fast_only in [false, true] {
                        let flags = ZeroFlags {
                            may_trim,
                            fast_only,
                            fua: false,
                        };
                        expect_kind(
                            dev.write_zeroes(offset, len, flags),
                            &ro,
                            &format!("write_zeroes({offset}, {len}, {flags:?})"),
                        )?;
                    }
                }
            }
            let either = [ErrorKind::ReadOnly, ErrorKind::OutOfRange];
            expect_kind(
                dev.write_at(&[1], READ_ONLY_SIZE, false),
                &either,
                "write_at past the end",
            )?;
            let refusal = dev.write_at(&[1], 0, false).expect_err("checked above");
            if !refusal.to_string().contains(&dev.describe()) {
                return Err(format!(
                    "the refusal should name the device ({}): {refusal}",
                    dev.describe()
                ));
            }
            compare_all(&*dev, content, "after refused writes")
        }),
        ("flush_and_status_work", &|| {
            let dev = make(content);
            dev.flush()
                .map_err(|e| format!("flush on a read-only device failed: {e}"))?;
            let extents = block_status_covering(&*dev, 0, READ_ONLY_SIZE)?;
            check_extents_against(content, 0, &extents)?;
            let mut buf = vec![0xAAu8; 2 * MIB as usize];
            let mut holes = Vec::new();
            dev.read_at_sparse(&mut buf, MIB / 2, &mut holes)
                .map_err(|e| e.to_string())?;
            check_holes(&buf, &holes, "read-only read_at_sparse")?;
            compare(
                &buf,
                &content[MIB as usize / 2..][..buf.len()],
                MIB / 2,
                "read-only read_at_sparse",
            )
        }),
        ("out_of_range_reads", &|| {
            let dev = make(content);
            let mut buf = [0u8; 2];
            expect_kind(
                dev.read_at(&mut buf, READ_ONLY_SIZE - 1),
                &[ErrorKind::OutOfRange],
                "read across the end",
            )
        }),
    ];
    let failures: Vec<String> = checks
        .iter()
        .filter_map(|(check, f)| guarded(f).err().map(|m| format!("  {name}/{check}: {m}")))
        .collect();
    assert!(
        failures.is_empty(),
        "{} read-only conformance checks failed for {name}:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
