//! `vdstream demo --boot`: the boot storm of `bench/boot-storm.sh` inside the demo. N real
//! guests (the golden image of `scripts/make-golden-image` under qemu) boot at once from
//! one vDisk through the demo's server, each through its own `ram-overflow` agent; before
//! them one guest boots alone from a local raw copy of the image, as the peer.
//!
//! The golden image is built from the two scripts embedded in this binary (the same files
//! the e2e tests run, so they stay the single source) into a cache folder, once per change
//! of the scripts, or taken from `--golden DIR`. qemu runs as in `tests/e2e/vm-lib.sh`:
//! `-m 192M -smp 1 -nic none`, `-kernel`, the image's kernel command line, the disk with
//! `discard=unmap`, KVM only where a probe boot under KVM finishes.
//!
//! Invariants: every figure is measured: boot times on the host's clock from qemu's start
//! to the guest's `VDSTEST BOOTED` line on its serial console (polled every 50 ms), I/O
//! from the agents' status files and the server's stats file, read before and after the
//! storm; every guest is bounded in time and stopped with the demo's other children.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use super::{exited, ready, spawn, spawn_command, stop, wait_rewrites, Shared};
use vdstream_contract::size::format_size;

/// The golden image's build script and the guest's /sbin/init, as in the checkout.
const MAKE_GOLDEN_IMAGE: &str = include_str!("../../../scripts/make-golden-image");
const GOLDEN_INIT: &str = include_str!("../../../scripts/golden-init.sh");

pub const QEMU: &str = "qemu-system-x86_64";
/// What a person installs to get [`QEMU`] (Debian and Ubuntu).
pub const QEMU_PACKAGE: &str = "qemu-system-x86";
/// What every guest runs (see scripts/golden-init.sh): the markers, 1 MiB written with
/// sync into its write cache, power-off.
const APPEND: &str = "vdstest=write vdstest.mb=1";
/// The agents of the storm, as in bench/boot-storm.sh.
const AGENT_RAM: &str = "32M";
/// The line a guest's init prints first.
const BOOTED: &[u8] = b"VDSTEST BOOTED";
const DONE_OK: &[u8] = b"VDSTEST DONE status=ok";

/// Where `program` is on PATH.
pub fn find_program(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(program))
        .find(|p| {
            use std::os::unix::fs::PermissionsExt;
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// A built golden image: the folder holding vmlinuz, initrd.img, golden.img and cmdline.
#[derive(Debug, Clone)]
pub struct Golden {
    pub dir: PathBuf,
}

impl Golden {
    const FILES: [&'static str; 4] = ["vmlinuz", "initrd.img", "golden.img", "cmdline"];

    fn missing(dir: &Path) -> Option<&'static str> {
        Golden::FILES.into_iter().find(|f| !dir.join(f).is_file())
    }

    pub fn image(&self) -> PathBuf {
        self.dir.join("golden.img")
    }
}

/// FNV-1a of both scripts: the built image is reused while it matches.
fn scripts_stamp() -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in MAKE_GOLDEN_IMAGE.bytes().chain(GOLDEN_INIT.bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// $XDG_CACHE_HOME/vdstream/golden, or ~/.cache/vdstream/golden.
fn golden_home() -> Result<PathBuf> {
    let xdg = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute());
    let home = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache"));
    let base = xdg.or(home).context(
        "neither XDG_CACHE_HOME nor HOME is set: say where a golden image is with --golden DIR",
    )?;
    Ok(base.join("vdstream").join("golden"))
}

/// "1 guest", "8 guests".
pub fn n_guests(n: usize) -> String {
    format!("{n} guest{}", if n == 1 { "" } else { "s" })
}

/// `text` without terminal escape sequences and other control characters (a console log
/// holds the firmware's screen clearing).
fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            '\u{1b}' => {
                // ESC [ parameters final-byte, or ESC and one character.
                if chars.next() == Some('[') {
                    for c in chars.by_ref() {
                        if ('@'..='~').contains(&c) {
                            break;
                        }
                    }
                }
            }
            '\n' | '\t' => out.push(c),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

/// `x` rounded to two decimals, as the figures are kept in the JSON.
fn hundredths(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The golden image to boot: `--golden DIR` as it is, else the one built from the
/// embedded scripts into the cache folder (built now if missing or made by other scripts).
pub fn golden(explicit: Option<&Path>, say: &dyn Fn(&str)) -> Result<Golden> {
    if let Some(dir) = explicit {
        if let Some(file) = Golden::missing(dir) {
            bail!(
                "--golden {}: there is no {file} in it; build a golden image there with `scripts/make-golden-image {}` \
                 (in a vdstream checkout), or leave out --golden and the demo builds one in {}",
                dir.display(),
                dir.display(),
                golden_home().map_or_else(|_| "~/.cache/vdstream/golden".into(), |p| p.display().to_string())
            );
        }
        return Ok(Golden {
            dir: dir.to_path_buf(),
        });
    }
    let home = golden_home()?;
    let image = home.join("image");
    let stamp_file = image.join(".stamp");
    let stamp = scripts_stamp();
    if Golden::missing(&image).is_none()
        && std::fs::read_to_string(&stamp_file).is_ok_and(|s| s.trim() == stamp)
    {
        return Ok(Golden { dir: image });
    }
    say(&format!(
        "building the golden image into {} (Debian's cloud kernel and busybox, fetched once with apt-get download; about 5 s)",
        image.display()
    ));
    // The script finds golden-init.sh beside itself, in ROOT/scripts.
    let scripts = home.join("scripts");
    std::fs::create_dir_all(&scripts)
        .with_context(|| format!("cannot create {}", scripts.display()))?;
    let script = scripts.join("make-golden-image");
    std::fs::write(&script, MAKE_GOLDEN_IMAGE)
        .with_context(|| format!("cannot write {}", script.display()))?;
    std::fs::write(scripts.join("golden-init.sh"), GOLDEN_INIT)
        .with_context(|| format!("cannot write into {}", scripts.display()))?;
    let debs =
        std::env::var_os("VDSTREAM_GOLDEN_CACHE").map_or_else(|| home.join("debs"), PathBuf::from);
    let out = Command::new("bash")
        .arg(&script)
        .arg(&image)
        .arg("--cache")
        .arg(&debs)
        .stdin(Stdio::null())
        .output()
        .context("cannot run bash, which builds the golden image")?;
    if !out.status.success() {
        bail!(
            "cannot build the golden image into {}:\n{}\nThe build needs apt-get with package lists (run `apt-get update`), dpkg-deb, \
             cpio, gzip and mkfs.ext4 (`apt-get install dpkg cpio gzip e2fsprogs`); or point --golden at a built one \
             (`scripts/make-golden-image DIR` in a vdstream checkout).",
            image.display(),
            tail(&String::from_utf8_lossy(&out.stderr), 5)
        );
    }
    std::fs::write(&stamp_file, &stamp)
        .with_context(|| format!("cannot write {}", stamp_file.display()))?;
    let _ = std::fs::remove_file(image.join("accel"));
    Ok(Golden { dir: image })
}

/// The qemu command line of tests/e2e/vm-lib.sh (`qemu_argv`).
fn qemu(golden: &Golden, accel: &str, serial: &Path, drive: &str) -> Result<Command> {
    let cmdline = std::fs::read_to_string(golden.dir.join("cmdline"))
        .with_context(|| format!("cannot read {}/cmdline", golden.dir.display()))?;
    let mut cmd = Command::new(QEMU);
    cmd.args([
        "-accel",
        accel,
        "-m",
        "192M",
        "-smp",
        "1",
        "-nographic",
        "-no-reboot",
        "-nic",
        "none",
        "-monitor",
        "none",
    ])
    .arg("-serial")
    .arg(format!("file:{}", serial.display()))
    .arg("-kernel")
    .arg(golden.dir.join("vmlinuz"))
    .arg("-initrd")
    .arg(golden.dir.join("initrd.img"))
    .arg("-append")
    .arg(format!("{} {APPEND}", cmdline.trim()))
    .arg("-drive")
    .arg(format!("{drive},discard=unmap"));
    Ok(cmd)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

fn read_serial(path: &Path) -> Vec<u8> {
    let mut buf = Vec::new();
    if let Ok(mut f) = std::fs::File::open(path) {
        let _ = f.read_to_end(&mut buf);
    }
    buf
}

/// One guest's run.
#[derive(Debug, Clone, Serialize)]
pub struct GuestRun {
    /// The target (boot1, boot2, ...), or local-file for the peer.
    pub name: String,
    /// Host seconds from qemu's start to the `VDSTEST BOOTED` line (None: never booted).
    pub boot_secs: Option<f64>,
    /// Host seconds from qemu's start to its exit (or to the bound).
    pub run_secs: f64,
    /// Booted, printed `VDSTEST DONE status=ok` and qemu exited 0.
    pub ok: bool,
    /// What the guest read through its agent, and what its agent read from the server.
    pub guest_read_bytes: Option<u64>,
    pub from_server_bytes: Option<u64>,
    /// Why it failed: qemu's exit and the last lines of its console.
    pub problem: Option<String>,
}

/// Starts one qemu per (name, drive) at once and waits (at most `bound`) for all of them;
/// a guest that runs past the bound is stopped and counted as failed.
fn run_guests(
    scratch: &Shared,
    dir: &Path,
    golden: &Golden,
    accel: &str,
    guests: &[(String, String)],
    bound: Duration,
) -> Result<Vec<GuestRun>> {
    let mut runs = Vec::new();
    for (name, drive) in guests {
        let serial = dir.join(format!("{name}.serial"));
        let cmd = qemu(golden, accel, &serial, drive)?;
        let started = Instant::now();
        spawn_command(scratch, name, cmd)?;
        runs.push((
            name.clone(),
            serial,
            started,
            None::<Duration>,
            None::<(Duration, std::process::ExitStatus)>,
        ));
    }
    let deadline = Instant::now() + bound;
    while Instant::now() < deadline && runs.iter().any(|r| r.4.is_none()) {
        for (name, serial, started, booted, ended) in runs.iter_mut() {
            if booted.is_none() && contains(&read_serial(serial), BOOTED) {
                *booted = Some(started.elapsed());
            }
            if ended.is_none() {
                if let Some(status) = exited(scratch, name)? {
                    *ended = Some((started.elapsed(), status));
                    if booted.is_none() && contains(&read_serial(serial), BOOTED) {
                        // Booted and powered off within one poll: the marker's time is
                        // known to be before the exit only.
                        *booted = Some(started.elapsed());
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut out = Vec::new();
    for (name, serial, started, booted, ended) in runs {
        let console = read_serial(&serial);
        let (run_secs, problem) = match ended {
            Some((t, status)) if status.success() && contains(&console, DONE_OK) => {
                (t.as_secs_f64(), None)
            }
            Some((t, status)) => (t.as_secs_f64(), Some(format!("qemu {status}"))),
            None => (
                started.elapsed().as_secs_f64(),
                Some(format!(
                    "still running after {} s; stopped",
                    bound.as_secs()
                )),
            ),
        };
        stop(scratch, &name);
        let problem = problem.map(|p| {
            let qemu_log =
                std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default();
            let said = tail(qemu_log.trim(), 3);
            let said = if said.is_empty() {
                String::new()
            } else {
                format!("; qemu said: {said}")
            };
            format!(
                "{p}, no `VDSTEST DONE status=ok`{said}; last console lines:\n{}",
                tail(&printable(&String::from_utf8_lossy(&console)), 8)
            )
        });
        out.push(GuestRun {
            name,
            boot_secs: booted.map(|d| hundredths(d.as_secs_f64())),
            run_secs: hundredths(run_secs),
            ok: problem.is_none() && booted.is_some(),
            guest_read_bytes: None,
            from_server_bytes: None,
            problem,
        });
    }
    Ok(out)
}

/// tcg or kvm: $VDSTREAM_VM_ACCEL, else the answer kept in the golden folder, else kvm
/// only where /dev/kvm is usable and a probe boot under KVM finishes within 15 s (nested
/// virtualisation often hangs), as tests/e2e/vm-lib.sh decides.
fn accel(scratch: &Shared, dir: &Path, golden: &Golden, say: &dyn Fn(&str)) -> Result<String> {
    if let Ok(a) = std::env::var("VDSTREAM_VM_ACCEL") {
        if a == "tcg" || a == "kvm" {
            return Ok(a);
        }
        bail!("VDSTREAM_VM_ACCEL={a}: say tcg or kvm, or unset it to probe");
    }
    let kept = golden.dir.join("accel");
    if let Ok(a) = std::fs::read_to_string(&kept) {
        if matches!(a.trim(), "tcg" | "kvm") {
            return Ok(a.trim().to_string());
        }
    }
    let mut accel = "tcg";
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok()
    {
        say("probing KVM with one guest boot of at most 15 s");
        let probe = dir.join("kvm-probe.img");
        std::fs::copy(golden.image(), &probe)
            .with_context(|| format!("cannot copy the golden image to {}", probe.display()))?;
        let runs = run_guests(
            scratch,
            dir,
            golden,
            "kvm",
            &[(
                "kvm-probe".into(),
                format!("file={},format=raw,if=virtio", probe.display()),
            )],
            Duration::from_secs(15),
        )?;
        if runs.iter().all(|r| r.ok) {
            accel = "kvm";
        }
        let _ = std::fs::remove_file(&probe);
    }
    // Kept for the next demo; a read-only --golden folder just probes again.
    let _ = std::fs::write(&kept, accel);
    Ok(accel.to_string())
}

/// Min, median and max.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Spread {
    fn of(values: &[f64]) -> Option<Spread> {
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = match n {
            0 => return None,
            _ if n % 2 == 1 => v[n / 2],
            _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        };
        Some(Spread {
            min: v[0],
            median: hundredths(median),
            max: v[n - 1],
        })
    }
}

/// What `--boot` measured.
#[derive(Debug, Clone, Serialize)]
pub struct BootStorm {
    pub targets: usize,
    pub accel: String,
    /// CPUs of this machine: under TCG the guests of a storm share them.
    pub cores: usize,
    pub golden: String,
    /// The vDisk the guests boot from, and its size.
    pub vdisk: String,
    pub vdisk_size: u64,
    /// Each agent: `vdstream target attach --cache ram-overflow --ram 32M`.
    pub agent: String,
    /// Appended to the image's kernel command line: what each guest does.
    pub guest_append: String,
    /// The peer: one guest alone on a local raw copy of the image, qemu reading the file.
    pub local_file: GuestRun,
    pub guests: Vec<GuestRun>,
    /// Over the guests that booted.
    pub boot_secs: Option<Spread>,
    pub failures: usize,
    /// Host seconds from the first qemu's start to the last one's exit.
    pub wall_secs: f64,
    /// Sums over the targets: what the guests read, what their agents read from the server.
    pub guest_read_bytes: u64,
    pub from_server_bytes: u64,
    /// The most one target's agent read from the server.
    pub one_target_read_bytes: u64,
    /// What the server read from the store during the storm (its stats file, before and after).
    pub store_read_bytes: u64,
    /// store_read_bytes / one_target_read_bytes: about 1 when the shared read cache serves
    /// every target after the first; about `targets` without it.
    pub store_reads_per_target: f64,
}

fn server_store_read_bytes(stats: &Path) -> Result<u64> {
    let text = std::fs::read(stats)
        .with_context(|| format!("cannot read the server's stats file {}", stats.display()))?;
    let j: serde_json::Value = serde_json::from_slice(&text)?;
    j["totals"]["store_read_bytes"].as_u64().with_context(|| {
        format!(
            "the server's stats file {} has no totals.store_read_bytes",
            stats.display()
        )
    })
}

/// The storm: the local peer boot, then `targets` agents on `vdisk_uri` and one guest on
/// each, all at once. The server writes its stats to `stats`.
pub fn storm(
    scratch: &Shared,
    dir: &Path,
    golden: &Golden,
    vdisk_uri: &str,
    stats: &Path,
    targets: usize,
    say: &dyn Fn(&str),
) -> Result<BootStorm> {
    let accel = accel(scratch, dir, golden, say)?;
    let bound = Duration::from_secs(120 + 30 * targets as u64);

    say(&format!(
        "boot storm: one guest from a local raw copy of the golden image first (-accel {accel})"
    ));
    let local = dir.join("local.img");
    std::fs::copy(golden.image(), &local)
        .with_context(|| format!("cannot copy the golden image to {}", local.display()))?;
    let local_run = run_guests(
        scratch,
        dir,
        golden,
        &accel,
        &[(
            "local-file".into(),
            format!("file={},format=raw,if=virtio", local.display()),
        )],
        bound,
    )?
    .pop()
    .context("no local run")?;
    let _ = std::fs::remove_file(&local);

    wait_rewrites(&[stats.to_path_buf()]);
    let store_before = server_store_read_bytes(stats)?;
    let ids: Vec<String> = (1..=targets).map(|i| format!("boot{i}")).collect();
    for id in &ids {
        spawn(
            scratch,
            id,
            &[
                "target",
                "attach",
                id,
                "--server",
                vdisk_uri,
                "--cache",
                "ram-overflow",
                "--ram",
                AGENT_RAM,
            ],
        )?;
    }
    let mut guests = Vec::new();
    for id in &ids {
        let sock = vdstream_agent::paths::socket_path(id);
        ready(
            scratch,
            id,
            &format!("nbd+unix:///?socket={}", sock.display()),
        )?;
        guests.push((
            format!("{id}-guest"),
            format!(
                "file=nbd+unix:///?socket={},format=raw,if=virtio",
                sock.display()
            ),
        ));
    }
    say(&format!(
        "boot storm: {} at once, each through its own ram-overflow agent",
        n_guests(targets)
    ));
    let start = Instant::now();
    let mut runs = run_guests(scratch, dir, golden, &accel, &guests, bound)?;
    let wall_secs = (start.elapsed().as_secs_f64() * 10.0).round() / 10.0;

    let mut files: Vec<PathBuf> = ids
        .iter()
        .map(|id| vdstream_agent::paths::status_path(id))
        .collect();
    files.push(stats.to_path_buf());
    wait_rewrites(&files);
    for (id, run) in ids.iter().zip(runs.iter_mut()) {
        let s = vdstream_agent::status::read(id, &vdstream_agent::paths::status_path(id))?;
        run.name.clone_from(id);
        run.guest_read_bytes = Some(s.guest.read_bytes);
        run.from_server_bytes = Some(s.server.read_bytes);
    }
    let store_read_bytes = server_store_read_bytes(stats)?.saturating_sub(store_before);
    for id in &ids {
        stop(scratch, id);
    }

    let booted: Vec<f64> = runs.iter().filter_map(|r| r.boot_secs).collect();
    let one = runs
        .iter()
        .filter_map(|r| r.from_server_bytes)
        .max()
        .unwrap_or(0);
    Ok(BootStorm {
        targets,
        accel,
        cores: std::thread::available_parallelism().map_or(1, usize::from),
        golden: golden.dir.display().to_string(),
        vdisk: "vdisk/golden".into(),
        vdisk_size: std::fs::metadata(golden.image())?.len(),
        agent: format!("vdstream target attach --cache ram-overflow --ram {AGENT_RAM}"),
        guest_append: APPEND.into(),
        local_file: local_run,
        boot_secs: Spread::of(&booted),
        failures: runs.iter().filter(|r| !r.ok).count(),
        wall_secs,
        guest_read_bytes: runs.iter().filter_map(|r| r.guest_read_bytes).sum(),
        from_server_bytes: runs.iter().filter_map(|r| r.from_server_bytes).sum(),
        one_target_read_bytes: one,
        store_read_bytes,
        store_reads_per_target: if one > 0 {
            hundredths(store_read_bytes as f64 / one as f64)
        } else {
            0.0
        },
        guests: runs,
    })
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

impl BootStorm {
    /// Guests that did not boot and power off cleanly, the peer included.
    pub fn failed(&self) -> usize {
        self.failures + usize::from(!self.local_file.ok)
    }

    /// The table and what it means, as Markdown (it reads as plain text on a terminal too).
    pub fn render_markdown(&self) -> String {
        let secs = |s: Option<f64>| s.map_or("n/a".to_string(), |s| format!("{s:.1}"));
        let mut out = String::from(
            "| boot | guests | failed | boot s min | boot s median | boot s max | guest reads | agents' reads from the server | store reads |\n\
             | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        );
        let l = &self.local_file;
        out += &format!(
            "| local raw file (the peer) | 1 | {} | {} | {} | {} | n/a | n/a | n/a |\n",
            usize::from(!l.ok),
            secs(l.boot_secs),
            secs(l.boot_secs),
            secs(l.boot_secs)
        );
        out += &format!(
            "| storm through vdstream | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            self.targets,
            self.failures,
            secs(self.boot_secs.map(|s| s.min)),
            secs(self.boot_secs.map(|s| s.median)),
            secs(self.boot_secs.map(|s| s.max)),
            mib(self.guest_read_bytes),
            mib(self.from_server_bytes),
            mib(self.store_read_bytes)
        );
        if self.failures == 0 && self.targets > 1 {
            out += &format!(
                "\nStore reads: {:.2}x one target's reads from the server ({}); the {} targets read {} from the server in all, \
                 the server's shared read cache served the rest.\n",
                self.store_reads_per_target,
                mib(self.one_target_read_bytes),
                self.targets,
                mib(self.from_server_bytes)
            );
        } else {
            out += &format!(
                "\nStore reads: {:.2}x one target's reads from the server ({}).\n",
                self.store_reads_per_target,
                mib(self.one_target_read_bytes)
            );
        }
        out
    }

    /// How the storm was run, for a person.
    pub fn setup(&self) -> String {
        format!(
            "{} (qemu -accel {}, -m 192M, one vCPU, `{}`) boot at once from {} ({} golden image in {}), each through its own \
             `{}` agent on the demo's server; boot s: host seconds from qemu's start to the guest init's first line on the serial \
             console; the peer boots alone with qemu reading a local raw copy of the image; reads from the agents' status and the \
             server's stats file; {:.0} s from the first qemu's start to the last one's exit. The {} share this machine's \
             {} CPUs{}.",
            n_guests(self.targets),
            self.accel,
            self.guest_append,
            self.vdisk,
            format_size(self.vdisk_size),
            self.golden,
            self.agent,
            self.wall_secs,
            n_guests(self.targets),
            self.cores,
            if self.accel == "tcg" { ": under TCG a storm guest's boot time is its share of the CPUs as much as the streaming, the peer has them alone" } else { "" }
        )
    }

    /// Boot time per guest (the peer first) as bars.
    pub fn chart(&self) -> String {
        let bars: Vec<(String, f64)> = std::iter::once(&self.local_file)
            .chain(&self.guests)
            .map(|r| (r.name.replace('-', " "), r.boot_secs.unwrap_or(f64::NAN)))
            .collect();
        vdstream_report::bar_chart(
            "Boot time per guest, qemu start to init (the local file boots alone)",
            "seconds",
            &bars,
        )
    }

    /// What went wrong with each failed guest.
    pub fn problems(&self) -> Vec<String> {
        std::iter::once(&self.local_file)
            .chain(&self.guests)
            .filter_map(|r| r.problem.as_ref().map(|p| format!("{}: {p}", r.name)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_takes_the_middle_or_the_mean_of_the_two_middles() {
        let s = Spread::of(&[9.0, 1.0, 4.0]).unwrap();
        assert_eq!((s.min, s.median, s.max), (1.0, 4.0, 9.0));
        let s = Spread::of(&[3.0, 1.0, 4.0, 2.0]).unwrap();
        assert_eq!((s.min, s.median, s.max), (1.0, 2.5, 4.0));
        assert!(Spread::of(&[]).is_none());
    }

    #[test]
    fn a_golden_folder_without_its_files_is_named_with_what_to_run() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("vmlinuz"), b"k").unwrap();
        let e = golden(Some(dir.path()), &|_| {}).unwrap_err().to_string();
        assert!(
            e.contains("no initrd.img") && e.contains("scripts/make-golden-image"),
            "{e}"
        );
        for f in Golden::FILES {
            std::fs::write(dir.path().join(f), b"x").unwrap();
        }
        assert_eq!(
            golden(Some(dir.path()), &|_| {}).unwrap().image(),
            dir.path().join("golden.img")
        );
    }

    #[test]
    fn the_embedded_build_finds_the_guest_init_beside_itself() {
        // golden() writes both scripts into ROOT/scripts and runs make-golden-image there.
        assert!(MAKE_GOLDEN_IMAGE.contains(r#"cp "$ROOT/scripts/golden-init.sh" "$rfs/sbin/init""#));
        // The markers the storm waits for: `say X` prints `VDSTEST X`.
        assert!(
            GOLDEN_INIT.contains(r#"say() { echo "VDSTEST $*"; }"#),
            "say"
        );
        assert!(
            GOLDEN_INIT.contains(r#"say "BOOTED uptime="#)
                && GOLDEN_INIT.contains(r#"say "DONE status=$status"#)
        );
    }
}
