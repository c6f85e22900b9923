//! `vdstream demo`: its flags; the demo itself is `vdstream_demo`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use vdstream_demo::DemoConfig;

/// Compare the write-cache types on a demo vDisk: one command, about two minutes.
///
/// Makes a temporary store with a generated vDisk, starts a server, attaches one target
/// per cache type and runs the VDI profile (4 workers x QD 16, 4 KiB, 80% writes, 90%
/// random) on each, the RAM cache also through vhost-user-blk, against the raw disk read
/// unbuffered; prints IOPS, latency and storage IOPS per target. With --boot, then
/// boots real Linux guests at once from one vDisk (needs qemu-system-x86_64). Cleans up
/// after itself, also on Ctrl-C.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vdstream demo                   about 2 minutes on 2 cores: a 256 MiB vDisk, 15 s per row, 7 rows
  vdstream demo --quick           about 20 seconds: a 64 MiB vDisk, 2 s per row
  vdstream demo --duration 60     longer runs, steadier figures
  vdstream demo --json | jq '.rows[] | {name, storage_iops}'
  vdstream demo --report out/     out/report.md with SVG charts
  vdstream demo --keep            keep the scratch folder (store, logs) and print where it is
  vdstream demo --boot            then a boot storm: 8 real guests at once (about 1.5 more minutes under TCG)
  vdstream demo --quick --boot    4 guests; about 1 minute in all
  vdstream demo --boot --golden target/golden-image   boot a golden image built before

The boot storm (--boot) needs qemu-system-x86_64 (Debian: apt-get install qemu-system-x86);
without it the demo prints the cache table and says what to install. Its golden image (a
Debian kernel, a busybox initramfs and a 128 MiB ext4 root) is built on first use into
$XDG_CACHE_HOME/vdstream/golden (or ~/.cache/vdstream/golden) from Debian packages fetched
with apt-get download, and reused after. Guests run under TCG unless a probe boot under KVM
finishes (VDSTREAM_VM_ACCEL=tcg|kvm decides instead).")]
pub struct DemoArgs {
    /// About 20 seconds: a 64 MiB vDisk and 2 s per row.
    #[arg(long)]
    quick: bool,

    /// Seconds of VDI load per row (default 15, or 2 with --quick).
    #[arg(long, value_name = "SECS")]
    duration: Option<f64>,

    /// Keep the scratch folder (store, cache files, logs) and print its path.
    #[arg(long)]
    keep: bool,

    /// Print the table as one JSON document (every row's full bench result; with --boot,
    /// the storm as `boot`) on stdout.
    #[arg(long)]
    json: bool,

    /// Also write DIR/report.md with SVG charts (IOPS per cache type, storage IOPS per
    /// target, IOPS and latency over time; with --boot, boot time per guest) and
    /// DIR/result.json.
    #[arg(long, value_name = "DIR")]
    report: Option<PathBuf>,

    /// After the table, boot real Linux guests at once from one vDisk through the demo's
    /// server, each through its own ram-overflow agent, and one from a local copy of the
    /// image as the peer: boot times, failures, guest reads against store reads.
    #[arg(long)]
    boot: bool,

    /// Guests in the boot storm (default 8, or 4 with --quick).
    #[arg(long, value_name = "N", requires = "boot", value_parser = clap::value_parser!(u16).range(1..=32))]
    boot_targets: Option<u16>,

    /// A golden image built before (vmlinuz, initrd.img, golden.img, cmdline, as
    /// scripts/make-golden-image writes them) instead of the one in the cache folder.
    #[arg(long, value_name = "DIR", requires = "boot")]
    golden: Option<PathBuf>,
}

pub fn run(args: DemoArgs) -> Result<()> {
    vdstream_demo::run(DemoConfig {
        quick: args.quick,
        duration: args.duration,
        keep: args.keep,
        json: args.json,
        report: args.report,
        boot: args.boot,
        boot_targets: args.boot_targets,
        golden: args.golden,
        stdout: crate::output::write_stdout,
    })
}
