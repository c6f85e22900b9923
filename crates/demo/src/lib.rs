//! `vdstream demo`: the main job in one command. In a scratch folder it makes a store with
//! a generated demo vDisk, starts a `vdstream server`, attaches one target per write-cache
//! type (`vdstream target attach` agents, the `server` type through a `target add` record),
//! runs the VDI profile on each with the bench engine, and prints the comparison table;
//! the RAM cache that fits runs a second time through the agent's vhost-user-blk backend
//! (the bench's vhost-user frontend), where the NBD socket no longer bounds it.
//! With `--boot`, real guests then boot at once through the same server (`boot`).
//!
//! Wiring only: every piece is this same binary run as a child process
//! (`std::env::current_exe`), exactly as a user would run it, or qemu. Invariants: every child is
//! stopped and the scratch folder removed when the demo ends, fails or is interrupted
//! (SIGINT/SIGTERM handled on a thread of its own; children also get SIGTERM if the demo
//! dies, through PR_SET_PDEATHSIG); every figure in the table is measured (see
//! `vdstream_bench::compare`).
//!
//! Nothing is printed with `println!` or `eprintln!` (they panic on a closed pipe): stdout
//! through [`DemoConfig::stdout`], stderr through `errln!`.

#![deny(clippy::print_stdout, clippy::print_stderr)]

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context, Result};
use vdstream_bench::{BenchResult, Comparison, Profile, Row, RunOptions, Workload};

use vdstream_contract::size::format_size;

mod boot;

/// What `vdstream demo` runs, from its flags.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// `--quick`: a 64 MiB vDisk and 2 s per row.
    pub quick: bool,
    /// `--duration`: seconds of VDI load per row (default 15, or 2 with `quick`).
    pub duration: Option<f64>,
    /// `--keep`: keep the scratch folder and print its path.
    pub keep: bool,
    /// `--json`: the table as one JSON document on stdout.
    pub json: bool,
    /// `--report DIR`: DIR/report.md with SVG charts and DIR/result.json.
    pub report: Option<PathBuf>,
    /// `--boot`: after the table, the boot storm.
    pub boot: bool,
    /// `--boot-targets`: guests in the boot storm (default 8, or 4 with `quick`).
    pub boot_targets: Option<u16>,
    /// `--golden DIR`: a golden image built before.
    pub golden: Option<PathBuf>,
    /// Writes to stdout: the binary's writer, which knows what a closed stdout means to it
    /// and whether anything was written.
    pub stdout: fn(std::fmt::Arguments<'_>),
}

/// A setting out of range (the binary's usage error); the message says what to give.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadInput(pub String);

/// Prints a line to stderr like `eprintln!`, never panicking (a closed stderr drops it).
macro_rules! errln {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

impl DemoConfig {
    /// Progress on stderr, unless the output is JSON for a script.
    fn say(&self, what: &str) {
        if !self.json {
            errln!("vdstream demo: {what}");
        }
    }
}

/// The children and the scratch folder; whoever finishes first (the demo, or the signal
/// thread) stops the children and removes the folder.
#[derive(Debug)]
struct Scratch {
    dir: PathBuf,
    keep: bool,
    children: Vec<(String, Child)>,
    done: bool,
}

impl Scratch {
    fn stop_child(name: &str, child: &mut Child) {
        // SAFETY: kill() only sends a signal to our own child's pid.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        for _ in 0..100 {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        log::warn!("{name} did not stop within 5 s of SIGTERM; killing it");
        let _ = child.kill();
        let _ = child.wait();
    }

    fn finish(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        // Agents first, then the servers they read from.
        while let Some((name, mut child)) = self.children.pop() {
            Scratch::stop_child(&name, &mut child);
        }
        if self.keep {
            errln!("vdstream demo: kept {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

type Shared = Arc<Mutex<Scratch>>;

/// Set by the signal thread before it stops the children: from then on a failure the
/// main thread sees (an agent gone, a connection reset) is the interruption's doing, and
/// the exit status is the signal thread's 130.
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Stops everything on SIGINT or SIGTERM, then exits 130.
fn clean_up_on_signal(scratch: Shared) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Register the handlers now, so a signal from here on is ours.
    let mut term = rt.block_on(async {
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    })?;
    let mut int = rt.block_on(async {
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
    })?;
    std::thread::spawn(move || {
        rt.block_on(async {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        });
        INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
        errln!("\nvdstream demo: interrupted; stopping the servers, agents and guests");
        scratch.lock().unwrap_or_else(|e| e.into_inner()).finish();
        std::process::exit(130);
    });
    Ok(())
}

/// Runs `vdstream ARGS...` to completion; its output, or an error with its stderr.
fn vdstream(args: &[&str]) -> Result<String> {
    let exe = std::env::current_exe().context("cannot find the vdstream binary")?;
    let out = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run vdstream {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "vdstream {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Starts `vdstream ARGS...` in the background, its output in DIR/NAME.log.
fn spawn(scratch: &Shared, name: &str, args: &[&str]) -> Result<()> {
    let exe = std::env::current_exe().context("cannot find the vdstream binary")?;
    let mut cmd = Command::new(exe);
    cmd.args(args);
    spawn_command(scratch, name, cmd)
}

/// Starts `cmd` in the background as the child NAME, its output in DIR/NAME.log; it is
/// stopped with the others when the demo ends.
fn spawn_command(scratch: &Shared, name: &str, mut cmd: Command) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let mut s = scratch.lock().unwrap_or_else(|e| e.into_inner());
    let log = File::create(s.dir.join(format!("{name}.log")))?;
    cmd.stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent; it asks the
    // kernel to SIGTERM the child if the demo dies without cleaning up.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    let program = cmd.get_program().to_string_lossy().into_owned();
    let child = cmd
        .spawn()
        .with_context(|| format!("cannot start {name} ({program})"))?;
    s.children.push((name.to_string(), child));
    Ok(())
}

/// The exit status of the child NAME once it has exited (it stays listed until [`stop`]).
fn exited(scratch: &Shared, name: &str) -> Result<Option<std::process::ExitStatus>> {
    let mut s = scratch.lock().unwrap_or_else(|e| e.into_inner());
    match s.children.iter_mut().find(|(n, _)| n == name) {
        Some((_, child)) => Ok(child.try_wait()?),
        None => bail!("no child named {name}"),
    }
}

/// Stops the child NAME (if still running) and forgets it.
fn stop(scratch: &Shared, name: &str) {
    let mut s = scratch.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = s.children.iter().position(|(n, _)| n == name) {
        let (name, mut child) = s.children.remove(i);
        Scratch::stop_child(&name, &mut child);
    }
}

/// Stops the most recently started child.
fn stop_last(scratch: &Shared) {
    let mut s = scratch.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((name, mut child)) = s.children.pop() {
        Scratch::stop_child(&name, &mut child);
    }
}

/// What child `name` logged so far (empty when it logged nothing).
fn child_log(scratch: &Shared, name: &str) -> String {
    let dir = scratch
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .dir
        .clone();
    std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default()
}

/// Waits for `uri` to answer NBD; on failure, says what the child logged.
fn ready(scratch: &Shared, name: &str, uri: &str) -> Result<()> {
    if let Err(e) = vdstream_bench::wait_ready(uri, Duration::from_secs(20)) {
        let log = child_log(scratch, name);
        bail!("{name} did not start serving {uri}: {e}\n{name}'s log:\n{log}");
    }
    Ok(())
}

/// Waits (at most 20 s) for the unix socket `path` that `name` is to listen on.
fn wait_socket(scratch: &Shared, name: &str, path: &Path) -> Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if std::fs::metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = child_log(scratch, name);
    bail!(
        "{name} did not create its socket {} in 20 s\n{name}'s log:\n{log}",
        path.display()
    );
}

/// Whether `path` opens with O_DIRECT (tmpfs, for one, refuses it).
fn opens_direct(path: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .is_ok()
}

/// A demo vDisk: `size` bytes, 64 KiB of generated data at the start of every MiB, holes
/// elsewhere (reads of the base meet both).
fn make_image(path: &Path, size: u64) -> Result<()> {
    let mut f = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    f.set_len(size)?;
    let mut rng = fastrand::Rng::with_seed(0x6465_6d6f);
    let mut chunk = vec![0u8; 64 << 10];
    for mib in 0..size >> 20 {
        rng.fill(&mut chunk);
        f.seek(SeekFrom::Start(mib << 20))?;
        f.write_all(&chunk)?;
    }
    Ok(f.sync_all()?)
}

/// Storage operations so far: (reads + writes) that reached a disk or the store, read from
/// a file that its writer rewrites every second.
struct StorageProbe<'a> {
    file: PathBuf,
    read: Box<dyn Fn() -> Result<u64> + 'a>,
}

impl StorageProbe<'_> {
    /// The figure as of a rewrite of the file that happened after this call.
    fn fresh(&self) -> Result<u64> {
        wait_rewrites(std::slice::from_ref(&self.file));
        (self.read)()
    }
}

/// Waits (at most [`STATUS_WAIT`]) until each of `files` has been rewritten after this call.
fn wait_rewrites(files: &[PathBuf]) {
    let since = SystemTime::now();
    let deadline = Instant::now() + STATUS_WAIT;
    while Instant::now() < deadline {
        if files.iter().all(|f| {
            std::fs::metadata(f)
                .and_then(|m| m.modified())
                .is_ok_and(|m| m > since)
        }) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn agent_storage_ops(id: &str) -> Result<u64> {
    let s = vdstream_agent::status::read(id, &vdstream_agent::paths::status_path(id))?;
    Ok(s.storage.read_ops + s.storage.write_ops)
}

fn server_storage_ops(stats: &Path, target: &str) -> Result<u64> {
    let text = std::fs::read(stats)
        .with_context(|| format!("cannot read the server's stats file {}", stats.display()))?;
    let j: serde_json::Value = serde_json::from_slice(&text)?;
    let sessions = j["sessions"].as_array().cloned().unwrap_or_default();
    let s = sessions
        .iter()
        .find(|s| s["target"].as_str() == Some(target))
        .with_context(|| format!("the server's stats file has no session of target {target}"))?;
    let c = &s["counters"];
    Ok(c["store_read_ops"].as_u64().unwrap_or(0) + c["store_write_ops"].as_u64().unwrap_or(0))
}

/// The status and stats files are rewritten every second: wait at most this long for a
/// rewrite.
const STATUS_WAIT: Duration = Duration::from_secs(3);

struct RowSpec<'a> {
    name: String,
    cache: &'a str,
    setup: String,
    uri: String,
    storage_source: &'a str,
    storage: Option<StorageProbe<'a>>,
}

fn measure(spec: RowSpec<'_>, workload: &Workload, json: bool) -> Result<Row> {
    let before = match &spec.storage {
        Some(probe) => probe.fresh()?,
        None => 0,
    };
    let label = format!("{:<36}", spec.name);
    let opts = RunOptions {
        interval: (workload.duration / 30)
            .clamp(Duration::from_millis(100), Duration::from_secs(1)),
        ..RunOptions::default()
    };
    let result = if spec.uri.starts_with("vhost-user:") {
        vdstream_bench::progress::with_progress(&label, !json, |p| {
            vdstream_bench::run_vhost_user(&spec.uri, workload, &opts, p)
        })?
    } else {
        vdstream_bench::progress::run_with(&spec.uri, workload, &opts, &label, !json)?
    };
    if !result.ok() {
        bail!(
            "{}: the run had {} errors: {}",
            spec.name,
            result.errors,
            result.error_messages.join("; ")
        );
    }
    let storage_ops = match &spec.storage {
        Some(probe) => probe.fresh()?.saturating_sub(before),
        // The raw disk has no cache: each request is one read or write of the file.
        None => result.total.ops,
    };
    if !json {
        errln!(
            "{label}{:>9.0} IOPS, {:>7.0} storage IOPS",
            result.total.iops,
            storage_ops as f64 / result.elapsed_secs
        );
    }
    Ok(row(spec, storage_ops, result))
}

fn row(spec: RowSpec<'_>, storage_ops: u64, result: BenchResult) -> Row {
    let storage_iops = if result.elapsed_secs > 0.0 {
        (storage_ops as f64 / result.elapsed_secs * 10.0).round() / 10.0
    } else {
        0.0
    };
    Row {
        name: spec.name,
        cache: spec.cache.into(),
        setup: spec.setup,
        storage_ops,
        storage_iops,
        storage_source: spec.storage_source.into(),
        result,
    }
}

/// What --boot will do: nothing, say why it cannot, or boot this golden image.
enum BootPlan {
    Off,
    Skipped(String),
    Run(boot::Golden, usize),
}

/// Before the table: is qemu there, and the golden image (built now, so that a missing
/// tool shows before two minutes of load rather than after).
fn boot_plan(args: &DemoConfig) -> Result<BootPlan> {
    if !args.boot {
        return Ok(BootPlan::Off);
    }
    if boot::find_program(boot::QEMU).is_none() {
        let note = format!(
            "{} is not on PATH; install it (Debian, Ubuntu: apt-get install {}) and run the demo with --boot again",
            boot::QEMU,
            boot::QEMU_PACKAGE
        );
        errln!("vdstream demo: boot storm skipped: {note}; the cache table runs without it");
        return Ok(BootPlan::Skipped(note));
    }
    let say = |what: &str| args.say(what);
    let golden = boot::golden(args.golden.as_deref(), &say)?;
    let targets = args
        .boot_targets
        .map_or(if args.quick { 4 } else { 8 }, usize::from);
    Ok(BootPlan::Run(golden, targets))
}

/// Runs the demo (see the crate's docs); with `--boot`, the boot storm after the table.
pub fn run(args: DemoConfig) -> Result<()> {
    let result = run_demo(args);
    if INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst) {
        // The signal thread is cleaning up and exits with 130: wait for it rather than
        // return an error the interruption caused.
        loop {
            std::thread::park();
        }
    }
    result
}

fn run_demo(args: DemoConfig) -> Result<()> {
    vdstream_bench::progress::quiet_client_logs();
    let size: u64 = if args.quick { 64 << 20 } else { 256 << 20 };
    let secs = args.duration.unwrap_or(if args.quick { 2.0 } else { 15.0 });
    if !(secs.is_finite() && secs > 0.0 && secs <= 3600.0) {
        return Err(BadInput(format!(
            "--duration {secs} is not a number of seconds between 0 and 3600"
        ))
        .into());
    }
    let workload = Workload {
        duration: Duration::from_secs_f64(secs),
        ..Profile::Vdi.workload()
    };
    let plan = boot_plan(&args)?;

    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = std::env::temp_dir().join(format!("vdstream-demo-{}-{nanos:x}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot create the scratch folder {}", dir.display()))?;
    // The agents' sockets, status files and caches live in the scratch folder; children
    // inherit this. Set before any other thread starts.
    std::env::set_var("VDSTREAM_RUN_DIR", dir.join("run"));
    std::env::set_var("VDSTREAM_CACHE_DIR", dir.join("cache"));
    let scratch: Shared = Arc::new(Mutex::new(Scratch {
        dir: dir.clone(),
        keep: args.keep,
        children: Vec::new(),
        done: false,
    }));
    clean_up_on_signal(scratch.clone())?;
    let result = run_rows(&args, &scratch, &dir, size, &workload, &plan);
    scratch.lock().unwrap_or_else(|e| e.into_inner()).finish();
    let (comparison, storm) = result?;
    let command = format!(
        "vdstream demo{}{}",
        if args.quick { " --quick" } else { "" },
        if args.boot { " --boot" } else { "" }
    );
    let intro = format!(
        "VDI profile (4 workers × queue depth 16, 4 KiB, 80% writes, 90% random) for {secs} s per row on a {} demo vDisk, \
         one target per row, every process on this machine (`{command}`).",
        format_size(size),
    );
    let mut doc = comparison.to_json();
    doc["vdisk_size"] = serde_json::json!(size);
    doc["workload"] = serde_json::to_value(&workload)?;
    match (&plan, &storm) {
        (BootPlan::Skipped(note), _) => doc["boot"] = serde_json::json!({ "skipped": note }),
        (_, Some(storm)) => doc["boot"] = serde_json::to_value(storm)?,
        _ => {}
    }
    if let Some(dir) = &args.report {
        let written = || -> std::io::Result<PathBuf> {
            let mut section = String::new();
            if let Some(storm) = &storm {
                std::fs::create_dir_all(dir)?;
                std::fs::write(dir.join("boot-times.svg"), storm.chart())?;
                section = format!(
                    "## Boot storm\n\n{}\n{}\n\n![Boot time per guest](boot-times.svg)\n\n",
                    storm.render_markdown(),
                    storm.setup()
                );
            }
            // result.json is the whole document, as --json prints it.
            vdstream_bench::report::write_comparison(
                dir,
                &comparison,
                "vdstream demo: write-cache types compared",
                &intro,
                &section,
                &doc,
            )
        };
        let path =
            written().with_context(|| format!("cannot write the report into {}", dir.display()))?;
        if !args.json {
            errln!("vdstream demo: report in {}", path.display());
        }
    }

    let stdout = args.stdout;
    macro_rules! out {
        ($($arg:tt)*) => { stdout(format_args!($($arg)*)) };
    }
    macro_rules! outln {
        () => { stdout(format_args!("\n")) };
        ($($arg:tt)*) => { stdout(format_args!("{}\n", format_args!($($arg)*))) };
    }
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        outln!(
            "\nVDI profile (4 workers x queue depth 16, 4 KiB, 80% writes, 90% random) for {secs} s per row on a {} vDisk:\n",
            format_size(size)
        );
        out!("{}", comparison.render_markdown());
        outln!();
        if let Some(headline) = comparison.headline() {
            outln!("{headline}.\n");
        }
        let close: Vec<String> = comparison
            .rows
            .iter()
            .zip(comparison.rows.iter().skip(1))
            .filter(|(a, b)| Comparison::within_noise(a, b))
            .map(|(a, b)| format!("{} and {}", a.name, b.name))
            .collect();
        if !close.is_empty() {
            outln!(
                "Within each other's noise (±: twice the standard error of the per-interval IOPS), so not ranked by this run: {}{}.\n",
                close.join("; "),
                if secs < 10.0 { "; longer rows (--duration 60) tell them apart" } else { "" }
            );
        }
        for r in &comparison.rows {
            outln!(
                "- {}: {}; storage from {}.",
                r.name,
                r.setup,
                r.storage_source
            );
        }
        match (&plan, &storm) {
            (BootPlan::Skipped(note), _) => outln!("\nBoot storm skipped: {note}."),
            (_, Some(storm)) => {
                outln!("\nBoot storm: {} at once from one vDisk, each through its own ram-overflow agent:\n", boot::n_guests(storm.targets));
                out!("{}", storm.render_markdown());
                outln!("\n- {}", storm.setup());
            }
            _ => {}
        }
    }
    if let Some(storm) = &storm {
        if storm.failed() > 0 {
            bail!(
                "{} did not boot and power off cleanly:\n{}",
                boot::n_guests(storm.failed()),
                storm.problems().join("\n")
            );
        }
    }
    Ok(())
}

fn run_rows(
    args: &DemoConfig,
    scratch: &Shared,
    dir: &Path,
    size: u64,
    workload: &Workload,
    plan: &BootPlan,
) -> Result<(Comparison, Option<boot::BootStorm>)> {
    let say = |what: &str| args.say(what);
    let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let store = path("store");
    let image = path("demo.img");
    say(&format!(
        "scratch folder {}; making a {} demo vDisk",
        dir.display(),
        format_size(size)
    ));
    make_image(Path::new(&image), size)?;
    vdstream(&["vdisk", "import", "demo", &image, "--store", &store])?;
    vdstream(&[
        "target",
        "add",
        "demo-server",
        "--vdisk",
        "demo",
        "--cache",
        "server",
        "--store",
        &store,
    ])?;
    if let BootPlan::Run(golden, _) = plan {
        vdstream(&[
            "vdisk",
            "import",
            "golden",
            &golden.image().to_string_lossy(),
            "--store",
            &store,
        ])?;
    }
    let server_sock = path("server.sock");
    let stats = path("server-stats.json");
    spawn(
        scratch,
        "server",
        &[
            "server",
            "--store",
            &store,
            "--socket",
            &server_sock,
            "--stats-file",
            &stats,
        ],
    )?;
    let vdisk_uri = format!("nbd+unix:///vdisk/demo?socket={server_sock}");
    ready(scratch, "server", &vdisk_uri)?;
    say(&format!(
        "server on {server_sock}; VDI profile for {:.0} s per row",
        workload.duration.as_secs_f64()
    ));

    let mut rows = Vec::new();

    // The raw disk: the same image file, served as it is (no cache, no server hop), and
    // unbuffered (O_DIRECT) as IOmeter and fio's direct=1 measure a disk, so that the row
    // measures the disk and not this machine's page cache; where the scratch folder's file
    // system refuses O_DIRECT (tmpfs), through the page cache, and the row says so.
    let raw_sock = path("raw.sock");
    let direct = opens_direct(Path::new(&image));
    let mut serve = vec!["serve-image", &image, "--socket", &raw_sock];
    if direct {
        serve.push("--direct");
    }
    spawn(scratch, "raw-disk", &serve)?;
    let raw_uri = format!("nbd+unix:///?socket={raw_sock}");
    ready(scratch, "raw-disk", &raw_uri)?;
    rows.push(measure(
        RowSpec {
            name: "raw disk".into(),
            cache: "none",
            setup: if direct {
                format!("`vdstream serve-image FILE --direct` on the image file itself in {}: unbuffered (O_DIRECT), no write cache, no server", dir.display())
            } else {
                format!("`vdstream serve-image FILE` on the image file itself in {}, through the page cache: its file system refuses O_DIRECT (set TMPDIR to a folder on a disk to measure the disk)", dir.display())
            },
            uri: raw_uri,
            storage_source: "the bench's own count (no cache: every request is one read or write of the file)",
            storage: None,
        },
        workload,
        args.json,
    )?);
    stop_last(scratch);

    let ram_big = format_size(size * 2).replace(' ', "");
    let ram_small = format_size(size / 4).replace(' ', "");
    // Each agent row: target id, row name, cache type, RAM, and whether the load goes
    // through the agent's vhost-user-blk backend (shared-memory virtqueues, the path of a
    // VM on the agent's host) rather than its NBD socket.
    let agents: [(&str, String, &str, Option<&str>, bool); 5] = [
        (
            "ram-overflow",
            "ram-overflow (fits)".to_string(),
            "ram-overflow",
            Some(&ram_big),
            false,
        ),
        (
            "ram-overflow-vhost",
            "ram-overflow (fits), vhost-user-blk".to_string(),
            "ram-overflow",
            Some(&ram_big),
            true,
        ),
        (
            "ram-overflow-small",
            "ram-overflow (overflows)".to_string(),
            "ram-overflow",
            Some(&ram_small),
            false,
        ),
        (
            "device-ram",
            "device-ram".to_string(),
            "device-ram",
            Some(&ram_big),
            false,
        ),
        (
            "device-disk",
            "device-disk".to_string(),
            "device-disk",
            None,
            false,
        ),
    ];
    let queues = workload.workers.clamp(1, 64).to_string();
    for (id, name, cache, ram, vhost) in agents {
        let mut attach = vec![
            "target", "attach", id, "--server", &vdisk_uri, "--cache", cache,
        ];
        if let Some(ram) = ram {
            attach.extend(["--ram", ram]);
        }
        let vhost_sock = path(&format!("{id}.vhost"));
        if vhost {
            // One virtqueue per worker, as `vdstream bench vhost-user:` opens them.
            attach.extend(["--vhost-user", &vhost_sock, "--vhost-queues", &queues]);
        }
        spawn(scratch, id, &attach)?;
        let nbd_uri = format!(
            "nbd+unix:///?socket={}",
            vdstream_agent::paths::socket_path(id).display()
        );
        // With --vhost-user the agent serves that socket alone.
        let uri = if vhost {
            wait_socket(scratch, id, Path::new(&vhost_sock))?;
            format!("vhost-user:{vhost_sock}")
        } else {
            ready(scratch, id, &nbd_uri)?;
            nbd_uri
        };
        let through = if vhost {
            format!(" --vhost-user SOCKET --vhost-queues {queues}`, driven through its virtqueues as a VM on this host would (libblkio's vhost-user frontend),")
        } else {
            "`".to_string()
        };
        let setup = match ram {
            Some(ram) => format!("`vdstream target attach --cache {cache} --ram {ram}{through} reading vdisk/demo from the server (the working set is {})", format_size(size)),
            None => format!("`vdstream target attach --cache {cache}{through} reading vdisk/demo from the server, cache file in {}", dir.display()),
        };
        let spec = RowSpec {
            name,
            cache,
            setup,
            uri,
            storage_source: "the agent's status (`vdstream target status`): vDisk reads from the server plus overflow or cache file I/O",
            storage: Some(StorageProbe { file: vdstream_agent::paths::status_path(id), read: Box::new(move || agent_storage_ops(id)) }),
        };
        rows.push(measure(spec, workload, args.json)?);
        stop_last(scratch);
    }

    // The server type: the writes go to the server's cache for target demo-server.
    let target_uri = format!("nbd+unix:///target/demo-server?socket={server_sock}");
    spawn(
        scratch,
        "demo-server",
        &[
            "target",
            "attach",
            "demo-server",
            "--server",
            &target_uri,
            "--cache",
            "server",
        ],
    )?;
    let uri = format!(
        "nbd+unix:///?socket={}",
        vdstream_agent::paths::socket_path("demo-server").display()
    );
    ready(scratch, "demo-server", &uri)?;
    let stats_path = PathBuf::from(&stats);
    let spec = RowSpec {
        name: "server".into(),
        cache: "server",
        setup: "`vdstream target add --cache server` and an agent passing I/O through to target/demo-server on the server".into(),
        uri,
        storage_source: "the server's stats (`--stats-file`): the target's session's store reads and cache file I/O",
        storage: Some(StorageProbe { file: stats_path.clone(), read: Box::new(move || server_storage_ops(&stats_path, "demo-server")) }),
    };
    rows.push(measure(spec, workload, args.json)?);
    stop_last(scratch);
    let storm = match plan {
        BootPlan::Run(golden, targets) => {
            let uri = format!("nbd+unix:///vdisk/golden?socket={server_sock}");
            Some(boot::storm(
                scratch,
                dir,
                golden,
                &uri,
                Path::new(&stats),
                *targets,
                &say,
            )?)
        }
        _ => None,
    };
    Ok((Comparison { rows }, storm))
}
