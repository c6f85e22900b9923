//! `vdstream target attach|status`: the agent's command line. Flags become an
//! [`AttachConfig`]; everything else lives in the `vdstream-agent` crate. The store's
//! target records (`add`, `list`, `show`, `set`, `remove`) are in target_record.rs.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use vdstream_agent::api::{self, Overrides};
use vdstream_agent::daemon::DAEMON_ARGV0;
use vdstream_agent::service::{self, Outcome, ServiceConfig};
use vdstream_agent::{paths, status, Agent, AttachConfig, Endpoint};
use vdstream_wcache::CacheType;

use crate::exit::{fail, Failure, Kind};
use crate::size::{check_ram_fits_here, parse_duration, parse_ram, parse_size};
use crate::target_record;

/// Keep the store's target records, run a target's agent, or show how it is doing.
#[derive(Debug, Args)]
pub struct TargetArgs {
    #[command(subcommand)]
    command: TargetCommand,
}

#[derive(Debug, Subcommand)]
enum TargetCommand {
    Add(target_record::AddArgs),
    List(target_record::ListArgs),
    Show(target_record::ShowArgs),
    Set(target_record::SetArgs),
    Remove(target_record::RemoveArgs),
    Attach(AttachArgs),
    Detach(DetachArgs),
    Status(StatusArgs),
    Migrate(crate::target_migrate::MigrateArgs),
    Booted(BootedArgs),
    Identity(crate::target_identity::IdentityArgs),
}

/// Attach target ID: stream its vDisk from the servers, keep its writes in a local write
/// cache, and offer the disk on a unix socket until SIGINT or SIGTERM.
///
/// If the server connection drops, the agent reconnects (with backoff) to the same server
/// or the next one listed and sends every unanswered request again; the target sees a
/// pause, not an error. Non-persistent caches start empty on every attach.
///
/// Cache type `server`: its cache lives in one server process. When every server refuses
/// the reconnect because that cache is gone (its server restarted), the target gets EIO
/// for every request from then on, within about 3 s of the server answering again (one
/// reconnect round: the backoff tops out at 2 s + 25%); `target status` says `cache lost`,
/// and one SIGTERM ends the agent. Use server-persistent to keep the cache across restarts.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vdstream serve-image golden.img --read-only --socket /run/golden.sock
  vdstream target attach vm1 --server 'nbd+unix:///?socket=/run/golden.sock' --cache ram-overflow --ram 512M
  qemu-system-x86_64 -drive file=nbd+unix:///?socket=$XDG_RUNTIME_DIR/vdstream/vm1.sock,format=raw,if=virtio ...
A VM on this host through shared memory (vhost-user-blk; the fast path for a local VM):
  vdstream target attach vm1 --server http://10.0.0.1:8480 --vhost-user /run/vdstream/vm1.vhost --vhost-queues 4
  qemu-system-x86_64 -m 4G -smp 4 -object memory-backend-memfd,id=mem,size=4G,share=on -numa node,memdev=mem \\
      -chardev socket,id=c0,path=/run/vdstream/vm1.vhost,reconnect-ms=1000 -device vhost-user-blk-pci,chardev=c0,num-queues=4 ...
  vdstream target status vm1
Record the target's I/O for RAM sizing (vdstream size --help):
  vdstream target attach vm1 --server nbd://10.0.0.1:10809/ --record-trace vm1.trace
Two servers of the same image (failover):
  vdstream target attach vm1 --server nbd://10.0.0.1:10809/ --server nbd://10.0.0.2:10809/
Store servers (`vdstream server --http`): the target's record says what to attach, the least busy server serves it:
  vdstream target add vm1 --vdisk win11 --cache device-disk
  vdstream target attach vm1 --server http://10.0.0.1:8480 --server http://10.0.0.2:8480
  vdstream target attach lab7 --server http://10.0.0.1:8480 --vdisk win11@test --cache device-ram   (no record)
A network-booted target (what its initramfs runs): the disk becomes /dev/nbd0, its cache in RAM spilling to
a scratch partition; the command returns once /dev/nbd0 serves, and waits (saying so) while no server answers:
  modprobe nbd
  vdstream target attach lab7 --server http://10.0.0.1:8480 --server http://10.0.0.2:8480 --vdisk debian12@4 \\
      --cache ram-overflow --ram 2G --overflow-device /dev/sda2 --kernel-nbd /dev/nbd0 --daemon
  mount /dev/nbd0 /sysroot
  vdstream target detach lab7 --kernel-nbd /dev/nbd0     (to stop it; SIGTERM is ignored)")]
pub struct AttachArgs {
    /// Target id (letters, digits, '.', '_', '-'): names the socket, status and cache files.
    #[arg(value_name = "ID", add = crate::completion::targets())]
    id: String,

    /// An NBD server of the vDisk: nbd://HOST:PORT/EXPORT or nbd+unix:///EXPORT?socket=PATH;
    /// or a store server's API, http://HOST:PORT: the target's record (vDisk, version, cache)
    /// is read from it and the least busy server is used. Repeat for failover (all NBD
    /// URIs or all http:// URLs); NBD URIs are tried in the order listed.
    #[arg(long = "server", value_name = "URI", required = true)]
    servers: Vec<String>,

    /// With http:// servers: the vDisk to read, NAME or NAME@VERSION, instead of the
    /// record's (or without a record, with --cache).
    #[arg(long, value_name = "NAME[@V]", add = crate::completion::vdisks())]
    vdisk: Option<String>,

    /// Unix socket of the local export. Default: RUN/ID.sock, RUN being $VDSTREAM_RUN_DIR,
    /// $XDG_RUNTIME_DIR/vdstream, /run/vdstream (root) or /tmp/vdstream-UID.
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,

    /// Present the disk to the Linux kernel as this NBD block device (e.g. /dev/nbd0, after
    /// `modprobe nbd`) instead of the unix socket (give --socket as well to keep it): a
    /// network-booted target mounts it as its root. No nbd-client is needed; the agent
    /// configures the device itself (root only). The agent runs until the device is
    /// disconnected (`vdstream target detach ID`, or SIGINT/SIGTERM in the foreground).
    #[arg(long, value_name = "DEVICE")]
    kernel_nbd: Option<PathBuf>,

    /// With --kernel-nbd: run in the background as the root disk's backend. The command
    /// exits 0 once the device is connected and serving (non-zero, with the reason, if it
    /// cannot be); the agent goes on as `@vdstream` (spared by systemd's shutdown), with
    /// oom_score_adj -1000, ignoring SIGTERM, SIGINT and SIGHUP: stop it with `vdstream
    /// target detach ID`.
    #[arg(long, requires = "kernel_nbd")]
    daemon: bool,

    /// Offer the disk as a vhost-user-blk backend on this unix socket, for a VM on this
    /// host: the guest's virtqueues are served from shared memory, with no socket hop per
    /// request (no NBD socket is served then, unless --socket is given too). qemu attaches
    /// with shared guest memory and a vhost-user-blk-pci device:
    /// `-object memory-backend-memfd,id=mem,size=RAM,share=on -numa node,memdev=mem
    /// -chardev socket,id=c0,path=PATH,reconnect-ms=1000 -device vhost-user-blk-pci,chardev=c0,num-queues=N`.
    /// A VM that reboots or a qemu that restarts connects again; the cache stays.
    #[arg(long, value_name = "PATH")]
    vhost_user: Option<PathBuf>,

    /// With --vhost-user: queues offered, 1-64; qemu's num-queues (by default its vCPU
    /// count) must not exceed it. Each queue is served by one of min(queues, CPUs) threads.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64), requires = "vhost_user")]
    vhost_queues: u16,

    /// With --vhost-user: threads serving the queues, queue i on thread i mod N. Default:
    /// one a queue, up to the number of CPUs (measured against one thread for all queues in
    /// docs/BENCHMARKS.md, "vhost-user-blk").
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=64), requires = "vhost_user")]
    vhost_threads: Option<u16>,

    /// Also serve on TCP, e.g. 127.0.0.1:10810. Any address but loopback needs TLS, or
    /// --insecure.
    #[arg(long, value_name = "ADDR")]
    listen: Option<std::net::SocketAddr>,

    /// Live migration's destination: take this target's write cache from the agent that
    /// serves it now: on this host through that agent's migration socket (`RUN/ID.migrate`,
    /// e.g. /run/vdstream/vm1.migrate), from another host as tls://HOST:PORT (the source's
    /// --migrate-listen; both agents show the target's certificate, --migrate-certificates).
    /// This agent copies the cache while the guest runs there, then keeps up with what the
    /// guest writes; its own socket holds every request until the handover is done. Start
    /// the destination qemu (-incoming) on this socket, then run `vdstream target migrate
    /// ID` on the source host. The same cache type as the source's, on the same vDisk
    /// version: a cache on this host is copied; a server or server-persistent target (its
    /// cache on the store server) joins the source's attach there, and nothing is copied.
    /// Not private or --read-only. If the source cannot be reached or the migration is
    /// cancelled, this agent ends and the source serves on.
    #[arg(long, value_name = "SOCKET|tls://HOST:PORT")]
    incoming: Option<String>,

    /// Live migration's source on another host: also take destination agents on TCP at
    /// ADDR (e.g. 10.0.0.1:10811), over TLS only. Both agents show this target's own
    /// certificate (--migrate-certificates: a client-cert.pem naming target ID, as `vdstream
    /// pki issue target ID` makes) and each refuses any other at the handshake: another
    /// target, a server, a certificate of another CA or one ca-crl.pem revokes. The
    /// switch, cancel and commit stay on this host's migration socket.
    #[arg(long, value_name = "ADDR")]
    migrate_listen: Option<std::net::SocketAddr>,

    /// The certificate directory of the migration link between hosts (ca-cert.pem,
    /// client-cert.pem and client-key.pem of this target; optional ca-crl.pem). Default:
    /// --tls-certificates.
    #[arg(long, value_name = "DIR")]
    migrate_certificates: Option<PathBuf>,

    /// Serve --listen on a non-loopback address without TLS: any machine that reaches it
    /// may read and write this target's disk. Only for a trusted network; refused
    /// otherwise (exit status 7).
    #[arg(long, requires = "listen")]
    insecure: bool,

    /// Write cache type: ram-overflow (default, or the record's with http:// servers),
    /// device-ram, device-disk, device-disk-persistent; server and server-persistent send
    /// writes to the server's export (it must be writable: its own cache takes them).
    #[arg(long, value_name = "TYPE", value_parser = cache_type())]
    cache: Option<CacheType>,

    /// Offer the vDisk read-only: the guest reads it and cannot write (a data disk many
    /// targets share). No write cache is kept, so --cache does not apply; the local NBD
    /// export and the vhost-user-blk device say read-only, and a read-only server export is
    /// enough.
    #[arg(long, conflicts_with = "cache")]
    read_only: bool,

    /// RAM for device-ram and ram-overflow (e.g. 512M): 0 (ram-overflow only: straight to
    /// the file) or 1M to 256G, and no more than this machine has. Default: 256M, or the record's.
    #[arg(long, value_name = "SIZE", value_parser = parse_ram)]
    ram: Option<u64>,

    /// Folder of the overflow or cache file. Default: $VDSTREAM_CACHE_DIR/ID, else /var/tmp/vdstream/ID.
    /// A folder named here is created only if its parent exists (a typo is refused).
    #[arg(long, value_name = "DIR")]
    overflow_dir: Option<PathBuf>,

    /// A raw local disk or partition (e.g. /dev/sda2) for ram-overflow's overflow or
    /// device-disk's cache, instead of a file in --overflow-dir: no file system needed, its
    /// old contents are ignored (the cache starts empty at every attach), its size is the
    /// cap (ENOSPC past it). Opened exclusively: a mounted partition is refused. device-disk
    /// needs a device at least as large as the vDisk.
    #[arg(long, value_name = "DEVICE", conflicts_with = "overflow_dir")]
    overflow_device: Option<PathBuf>,

    /// Start even when the cache folder's file system has less than 64 MiB free (attach
    /// refuses then; with less free space than the cache may use it only warns).
    #[arg(long)]
    allow_low_space: bool,

    /// Cap on the overflow or cache file (e.g. 10G); past it, writes to new blocks fail with ENOSPC.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    overflow_max: Option<u64>,

    /// Disk cache types: `on` writes through the host page cache, `off` uses O_DIRECT.
    #[arg(long, value_name = "on|off", value_parser = crate::serve_image::parse_on_off, default_value = "off", action = clap::ArgAction::Set)]
    intermediate_buffering: bool,

    /// This attach is a machine's network boot (the initramfs passes it): first ask the
    /// store servers for a place in their boot window (`vdstream server --max-booting`),
    /// and while every one is full wait as told, one console line a round ("waiting: N
    /// booting"). `vdstream target booted ID` gives the place back. Store servers only.
    #[arg(long)]
    booting: bool,

    /// Prove this machine's identity with its TPM before attaching (docs/IDENTITY.md): a
    /// character device (/dev/tpmrm0) or swtpm's unix data socket. The store server (run
    /// with --identity-ca) certifies a TLS key made in RAM once the TPM's key is approved
    /// for this target; the agent then attaches and reports with that certificate. While
    /// the key is pending the agent waits (--identity-wait), one console line a round.
    /// Store servers only.
    #[arg(long, value_name = "PATH")]
    tpm: Option<PathBuf>,

    /// With --tpm: where the certificate directory goes (owner-only). Default: the run
    /// directory's identity/ID (RAM in a network-booted machine).
    #[arg(long, value_name = "DIR", requires = "tpm")]
    identity_dir: Option<PathBuf>,

    /// With --tpm: how long a pending enrolment is waited for before the agent gives up
    /// (e.g. 10m, 1h). Default: 24h.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, requires = "tpm")]
    identity_wait: Option<Duration>,

    /// Give up after no server answered for this long (e.g. 30s, 5m): the target then gets
    /// EIO. Default: retry forever, as PVS targets do.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    retry_for: Option<Duration>,

    /// A request with no reply for this long means the server is hung: reconnect and re-send.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "30s")]
    request_timeout: Duration,

    /// Record every request the local export receives (offset, length, op, time) into
    /// this I/O trace file, for `vdstream size --trace FILE` (format: docs/AGENT.md).
    #[arg(long, value_name = "FILE")]
    record_trace: Option<PathBuf>,

    /// Requests in flight to the server, at most.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    max_requests: u32,

    /// server and server-persistent on a store server: NBD connections this attach opens to
    /// the server that holds its cache, all joining that one cache (the requests are spread
    /// over them; one connection's requests are served by one session of the server). A
    /// server that offers fewer gets fewer; the device types read over one connection.
    /// More than 1 costs more CPU per request on agent and server alike (measured on two
    /// cores, docs/BENCHMARKS.md); try it where the server has cores to spare.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
    server_connections: u32,

    /// server-persistent: the agent keeps the writes the server answered until a flush
    /// covers them, and sends them again to a restarted (or another) server before anything
    /// else, so the server answers writes without syncing each one. Past this many bytes
    /// the agent flushes the server itself. 0: no journal; the server then makes every
    /// write durable before answering it (much slower).
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "64M")]
    journal_max: u64,

    /// NBD over TLS to the servers, with the target's credentials in DIR (the layout of
    /// qemu's tls-creds-x509: ca-cert.pem, client-cert.pem, client-key.pem): every
    /// connection starts TLS and checks the server's certificate against ca-cert.pem; a
    /// server without TLS is refused, never used in plaintext. nbds:// URIs ask for TLS
    /// too (their ?tls-certificates=DIR serves when this flag is not given).
    /// Example: --server nbd://10.0.0.1:10809/target/vm1 --tls-certificates /etc/vdstream/tls
    #[arg(long, value_name = "DIR")]
    tls_certificates: Option<PathBuf>,

    /// TLS of the local export's TCP listener (--listen): off (default), on or require,
    /// with server-cert.pem and server-key.pem of --tls-certificates; client certificates
    /// are verified against its ca-cert.pem. The unix socket stays plaintext.
    #[arg(long, value_name = "off|on|require", default_value = "off", value_parser = parse_tls_mode, requires = "listen")]
    listen_tls: vdstream_nbd::TlsMode,
}

fn parse_tls_mode(s: &str) -> Result<vdstream_nbd::TlsMode, String> {
    s.parse()
}

/// The local export's TLS: its mode and certificate directory.
type ListenTls = (
    vdstream_nbd::TlsMode,
    std::sync::Arc<vdstream_tls::files::ServerTls>,
);

/// The upstream TLS configuration and the local listener's: `--tls-certificates`, or the
/// `?tls-certificates=` of an nbds:// URI, which needs one or the other.
fn attach_tls(
    a: &AttachArgs,
) -> Result<(
    Option<std::sync::Arc<vdstream_tls::rustls::ClientConfig>>,
    Option<ListenTls>,
)> {
    let nbds = a
        .servers
        .iter()
        .filter_map(|u| vdstream_nbd::client::Address::parse_uri_tls(u).ok())
        .find(|p| p.tls);
    let dir = a
        .tls_certificates
        .clone()
        .or_else(|| nbds.as_ref().and_then(|p| p.tls_certificates.clone()));
    if nbds.is_some() && dir.is_none() {
        usage!("an nbds:// server needs the target's certificates: give --tls-certificates DIR (ca-cert.pem, client-cert.pem, client-key.pem)");
    }
    let upstream = match &dir {
        Some(d) => Some(
            vdstream_tls::files::client_config(d)
                .map_err(|e| anyhow::anyhow!("--tls-certificates: {e}"))?,
        ),
        None => None,
    };
    let local = match (a.listen_tls, &dir) {
        (vdstream_nbd::TlsMode::Off, _) => None,
        (mode, Some(d)) => Some((
            mode,
            std::sync::Arc::new(
                vdstream_tls::files::ServerTls::new(d, vdstream_tls::files::ClientAuth::Verify)
                    .map_err(|e| anyhow::anyhow!("--listen-tls {}: {e}", mode.as_str()))?,
            ),
        )),
        (mode, None) => usage!(
            "--listen-tls {} needs --tls-certificates DIR with server-cert.pem and server-key.pem",
            mode.as_str()
        ),
    };
    Ok((upstream, local))
}

/// The migration link's TLS listener and the source of an incoming attach, from
/// `--migrate-listen`, `--incoming` and the certificates of `--migrate-certificates` (else
/// `--tls-certificates`).
fn migration_link(
    a: &AttachArgs,
) -> Result<(
    Option<vdstream_agent::migrate::link::TlsListen>,
    Option<vdstream_agent::migrate::link::SourceAddr>,
)> {
    use vdstream_tls::Identity;
    let dir = a
        .migrate_certificates
        .as_ref()
        .or(a.tls_certificates.as_ref());
    let me = || Identity::Target(a.id.clone());
    let listen = match (a.migrate_listen, dir) {
        (None, _) => None,
        (Some(addr), None) => usage!("--migrate-listen {addr} takes destinations over TLS only: give --migrate-certificates DIR with this target's certificate (`vdstream pki issue target {} --out DIR`)", a.id),
        (Some(addr), Some(d)) => Some((
            addr,
            vdstream_tls::link::listen_config(d, me())
                .map_err(|e| crate::exit::fail(crate::exit::Kind::Usage, format!("--migrate-certificates: {e}")))?,
        )),
    };
    let incoming = match &a.incoming {
        None => None,
        Some(text) => {
            let config = match (text.starts_with("tls://"), dir) {
                (true, Some(d)) => {
                    Some(vdstream_tls::link::connect_config(d, me()).map_err(|e| {
                        crate::exit::fail(
                            crate::exit::Kind::Usage,
                            format!("--migrate-certificates: {e}"),
                        )
                    })?)
                }
                _ => None,
            };
            match vdstream_agent::migrate::link::parse_source(text, config) {
                Ok(s) => Some(s),
                Err(e) => usage!("{e}"),
            }
        }
    };
    Ok((listen, incoming))
}

/// Stop the agent of target ID: its kernel NBD device is disconnected (the kernel sends
/// its last requests, the agent answers them, flushes and exits), or, without one, the
/// agent gets SIGTERM. Waits until the agent has exited.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vdstream target detach vm1
  vdstream target detach lab7 --kernel-nbd /dev/nbd0     (after switch_root, where the agent's run folder is out of sight)")]
pub struct DetachArgs {
    /// The target's id, as given to `target attach`.
    #[arg(value_name = "ID", add = crate::completion::targets())]
    id: String,

    /// The kernel NBD device the agent serves (default: the one the agent's pid serves,
    /// found in /sys/block/nbd*/pid).
    #[arg(long, value_name = "DEVICE")]
    kernel_nbd: Option<PathBuf>,

    /// How long to wait for the agent to exit.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "60s")]
    timeout: Duration,
}

/// Say that target ID's machine has booted: the store servers close its boot window
/// (`vdstream server --max-booting`), so the next machine waiting may boot. The network-boot
/// initramfs runs it once the root file system is mounted, before switch_root.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vdstream target booted lab7 --server http://10.0.0.1:8480 --server http://10.0.0.2:8480")]
pub struct BootedArgs {
    /// The target's id, as given to `target attach --booting`.
    #[arg(value_name = "ID", add = crate::completion::targets())]
    id: String,

    /// A store server's API URL (http[s]://HOST:PORT), repeatable: each closes the
    /// window it holds.
    #[arg(long = "server", value_name = "URL", required = true)]
    servers: Vec<String>,
}

fn booted(b: BootedArgs) -> Result<()> {
    paths::check_target_id(&b.id)?;
    let closed = api::boot_done(&b.id, &b.servers)
        .with_context(|| format!("cannot end target {}'s boot window", b.id))?;
    outln!(
        "vdstream: target {}: booted; {}",
        b.id,
        if closed == 0 {
            "no server held a boot window for it".to_string()
        } else {
            format!(
                "its boot window closed on {closed} server{}",
                if closed == 1 { "" } else { "s" }
            )
        }
    );
    Ok(())
}

fn detach(d: DetachArgs) -> Result<()> {
    use vdstream_agent::kernel_nbd;
    paths::check_target_id(&d.id)?;
    // The pid in the target's lock file, if that agent still runs.
    let locked = std::fs::read_to_string(paths::lock_path(&d.id))
        .ok()
        .and_then(|t| t.trim().parse::<u32>().ok())
        .filter(|p| status::pid_alive(*p));
    let device = d
        .kernel_nbd
        .clone()
        .or_else(|| locked.and_then(kernel_nbd::device_served_by));
    let pid = match &device {
        Some(dev) => {
            let pid = kernel_nbd::server_pid(dev).or(locked);
            kernel_nbd::disconnect(dev)?;
            outln!("vdstream: target {}: {} disconnected; the agent answers what the kernel sent, flushes and exits", d.id, dev.display());
            pid
        }
        None => {
            let Some(pid) = locked else {
                return Err(fail(Kind::Unavailable, format!(
                    "target {} has no running agent here (no live pid in {}): nothing to detach; for an agent that backs a kernel NBD device, give --kernel-nbd /dev/nbdN",
                    d.id,
                    paths::lock_path(&d.id).display()
                )));
            };
            // SAFETY: kill with a pid read from the target's lock file and a valid signal.
            if unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) } != 0 {
                return Err(
                    anyhow::Error::new(std::io::Error::last_os_error()).context(format!(
                        "cannot signal the agent of target {} (pid {pid})",
                        d.id
                    )),
                );
            }
            outln!(
                "vdstream: target {}: SIGTERM sent to its agent (pid {pid})",
                d.id
            );
            Some(pid)
        }
    };
    let Some(pid) = pid else { return Ok(()) };
    let started = std::time::Instant::now();
    while status::pid_alive(pid) {
        if started.elapsed() >= d.timeout {
            return Err(fail(Kind::Unavailable, format!(
                "target {}: its agent (pid {pid}) still runs after {:?}: it may be waiting for a server to take its last flush (see `vdstream target status {}`)",
                d.id, d.timeout, d.id
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    outln!("vdstream: target {}: detached", d.id);
    Ok(())
}

/// Show the figures of a running (or the last) agent of target ID.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The target's id, as given to `target attach` (e.g. vm1). Exit status 6 when its
    /// agent is not running (the last figures are still shown).
    #[arg(value_name = "ID", add = crate::completion::targets())]
    id: String,

    /// Print the status document (the API's form) instead of text.
    #[arg(long)]
    json: bool,

    /// Show the latest report the agent sent to this store server's API
    /// (http://HOST:PORT) instead of the local status file.
    #[arg(long, value_name = "URL")]
    server: Option<String>,
}

impl TargetArgs {
    /// `target attach`: a service, not a printer (see output.rs).
    pub fn is_attach(&self) -> bool {
        matches!(self.command, TargetCommand::Attach(_))
    }
}

pub fn run(args: TargetArgs) -> Result<()> {
    match args.command {
        TargetCommand::Add(a) => target_record::add(a),
        TargetCommand::List(a) => target_record::list(a),
        TargetCommand::Show(a) => target_record::show(a),
        TargetCommand::Set(a) => target_record::set(a),
        TargetCommand::Remove(a) => target_record::remove(a),
        TargetCommand::Attach(a) => attach(a),
        TargetCommand::Detach(d) => detach(d),
        TargetCommand::Status(s) => show_status(s),
        TargetCommand::Migrate(m) => crate::target_migrate::run(m),
        TargetCommand::Booted(b) => booted(b),
        TargetCommand::Identity(i) => crate::target_identity::run(i),
    }
}

fn attach(mut a: AttachArgs) -> Result<()> {
    paths::check_target_id(&a.id)?;
    if let Some(tpm) = a.tpm.clone() {
        let dir = prove_identity(&a, tpm)?;
        // The certificate serves the NBD connections (--tls-certificates) and the API calls
        // (which read VDSTREAM_TLS_CERTIFICATES); no thread runs yet.
        std::env::set_var("VDSTREAM_TLS_CERTIFICATES", &dir);
        a.tls_certificates = Some(dir);
    }
    let service = ServiceConfig {
        id: a.id.clone(),
        daemon: a.daemon,
        kernel_nbd: a.kernel_nbd.is_some(),
    };
    match service::run(&service, || open_agent(&a))? {
        Outcome::DaemonReady { pid } => {
            outln!("vdstream: target {}: the agent runs in the background as pid {pid} ({DAEMON_ARGV0}); stop it with `vdstream target detach {}`", a.id, a.id);
            Ok(())
        }
        Outcome::DaemonEnded(status) => {
            // The daemon said why on the same stderr; its status is the command's.
            errln!(
                "vdstream: target {}: the agent ended before its device was up ({status})",
                a.id
            );
            std::process::exit(status.code().unwrap_or(1).max(1));
        }
        Outcome::Served(agent) => {
            outln!("vdstream: {}", agent.summary());
            crate::serve_image::report_trace(agent.trace())
        }
    }
}

/// `--tpm`: the machine's identity proved to the first store server that answers, its
/// certificate directory written; returns the directory.
fn prove_identity(a: &AttachArgs, tpm: PathBuf) -> Result<PathBuf> {
    let Some(api) = a.servers.iter().find(|s| api::is_api_url(s)) else {
        usage!("--tpm proves this machine's identity to a store server: give --server http://HOST:PORT (a store server's API)");
    };
    let req = vdstream_agent::identity::IdentityRequest {
        api: api.clone(),
        target: a.id.clone(),
        tpm,
        out: a
            .identity_dir
            .clone()
            .unwrap_or_else(|| paths::run_dir().join("identity").join(&a.id)),
        wait: a.identity_wait.unwrap_or(Duration::from_secs(24 * 3600)),
    };
    let say = |line: &str| errln!("vdstream: target {}: {line}", a.id);
    match vdstream_agent::identity::prove(&req, &say) {
        Ok(dir) => Ok(dir),
        Err(e @ vdstream_agent::identity::IdentityError::Refused(_)) => Err(crate::exit::fail(
            Kind::Denied,
            format!("target {}: {e}", a.id),
        )),
        Err(e) => {
            Err(anyhow::anyhow!(e).context(format!("cannot prove target {}'s identity", a.id)))
        }
    }
}

/// The agent of `target attach` from its flags (asking the store servers' APIs for the
/// target's record when --server names them), opened and announced.
fn open_agent(a: &AttachArgs) -> Result<Agent> {
    // Before anything is asked or opened; a local export over TLS (--listen-tls) may listen anywhere.
    if let Some(addr) = a.listen.filter(|l| {
        a.listen_tls == vdstream_nbd::TlsMode::Off
            && !a.insecure
            && !vdstream_server::config::is_loopback(l)
    }) {
        let e = vdstream_server::config::InsecureListen { what: "NBD", addr };
        return Err(crate::exit::fail(
            crate::exit::Kind::Insecure,
            e.to_string(),
        ));
    }
    let (upstream_tls, listen_tls) = attach_tls(a)?;
    if a.booting && !a.servers.iter().any(|s| api::is_api_url(s)) {
        usage!("--booting asks store servers for a boot place: give --server http://HOST:PORT (a store server's API), not an NBD URI");
    }
    let mut cfg = if a.servers.iter().any(|s| api::is_api_url(s)) {
        if let Some(nbd) = a.servers.iter().find(|s| !api::is_api_url(s)) {
            usage!(
                "--server {nbd} is an NBD URI, and the others are store servers' APIs: give every --server as http://HOST:PORT, or every one as an NBD URI"
            );
        }
        let flags = Overrides {
            vdisk: a.vdisk.clone(),
            cache: a.cache,
            ram: a.ram,
            overflow_max: a.overflow_max,
        };
        outln!("vdstream: target {}: asking {}", a.id, a.servers.join(", "));
        // No server answering at all (down at boot time) is waited for, one console line a round.
        let say = |line: &str| errln!("vdstream: target {}: {line}", a.id);
        let wait = api::Waiting {
            retry_for: a.retry_for,
            say: &say,
        };
        let mut r = api::resolve_waiting(&a.id, &a.servers, &flags, Some(&wait))
            .with_context(|| format!("cannot attach target {}", a.id))?;
        if a.booting {
            r.wait_for_boot_place(&wait)
                .with_context(|| format!("cannot attach target {}", a.id))?;
        }
        let p = &r.plan;
        outln!(
            "vdstream: target {}: vDisk {}{} with a {} cache (from the {}); servers, least busy first:",
            a.id,
            p.vdisk,
            p.version.map(|v| format!("@{v}")).unwrap_or_default(),
            p.cache,
            p.source
        );
        for s in &r.servers {
            outln!("vdstream:   {s}");
        }
        let mut cfg = AttachConfig::new(&a.id, r.endpoints);
        cfg.cache = p.cache;
        // The record's RAM size stays unused when --cache picks a type without RAM; a --ram
        // flag is checked like any other.
        let uses_ram = matches!(p.cache, CacheType::DeviceRam | CacheType::RamOverflow);
        if let Some(ram) = p.ram.filter(|_| uses_ram || a.ram.is_some()) {
            check_ram_fits_here(p.cache, ram)?;
            cfg.ram = ram;
        }
        cfg.overflow_max = p.overflow_max;
        cfg.api = Some(r.link);
        cfg
    } else {
        if a.vdisk.is_some() {
            usage!("--vdisk needs store servers (--server http://HOST:PORT); with an NBD URI, name the export in it (nbd://HOST:PORT/vdisk/NAME@V)");
        }
        let endpoints = a
            .servers
            .iter()
            .map(|s| Endpoint::parse(s))
            .collect::<Result<Vec<_>, _>>()?;
        let mut cfg = AttachConfig::new(&a.id, endpoints);
        cfg.cache = a.cache.unwrap_or(CacheType::RamOverflow);
        if let Some(ram) = a.ram {
            check_ram_fits_here(cfg.cache, ram)?;
            cfg.ram = ram;
        }
        cfg.overflow_max = a.overflow_max;
        cfg
    };
    if let Some(dir) = a.overflow_dir.clone() {
        cfg.cache_dir = dir;
    }
    cfg.overflow_device = a.overflow_device.clone();
    cfg.allow_low_space = a.allow_low_space;
    cfg.intermediate_buffering = a.intermediate_buffering;
    cfg.serve_socket = (a.kernel_nbd.is_none() && a.vhost_user.is_none()) || a.socket.is_some();
    cfg.vhost_user = a.vhost_user.clone();
    cfg.read_only = a.read_only;
    cfg.vhost.queues = a.vhost_queues;
    cfg.vhost.threads = a
        .vhost_threads
        .unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, |n| n.get().min(64) as u16)
        })
        .min(a.vhost_queues);
    if let Some(sock) = a.socket.clone() {
        cfg.socket = sock;
    }
    cfg.kernel_nbd = a.kernel_nbd.clone();
    cfg.listen = a.listen;
    cfg.remote.retry_for = a.retry_for;
    cfg.remote.request_timeout = Some(a.request_timeout);
    cfg.remote.max_requests = a.max_requests as usize;
    cfg.remote.connections = a.server_connections as usize;
    cfg.remote.journal = (a.journal_max > 0).then_some(a.journal_max);
    cfg.record_trace = a.record_trace.clone();
    let (migrate_listen, incoming) = migration_link(a)?;
    cfg.migrate_listen = migrate_listen;
    cfg.incoming = incoming;
    cfg.remote.tls = upstream_tls;
    cfg.listen_tls = listen_tls;
    let servers = cfg
        .endpoints
        .iter()
        .map(|e| e.uri.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    outln!("vdstream: target {}: connecting to {servers}", a.id);
    let agent = Agent::open(cfg).with_context(|| format!("cannot attach target {}", a.id))?;
    let id = agent.remote().identity();
    let c = agent.config();
    let mut served = Vec::new();
    if let Some(dev) = &c.kernel_nbd {
        served.push(format!("the kernel NBD device {}", dev.display()));
    }
    if c.serve_socket {
        served.push(format!("nbd+unix:///?socket={}", c.socket.display()));
    }
    if let Some(l) = c.listen {
        served.push(format!("nbd://{l}/"));
    }
    if let Some(p) = &c.vhost_user {
        served.push(format!(
            "vhost-user-blk on {} ({} queues)",
            p.display(),
            c.vhost.queues
        ));
    }
    outln!(
        "vdstream: target {}: vDisk export {:?} ({} bytes{}) from {}, {}; serving {}",
        c.target,
        id.export,
        id.size,
        id.description
            .as_ref()
            .map(|d| format!(", {d}"))
            .unwrap_or_default(),
        agent.remote().endpoint_in_use().0,
        if c.read_only {
            "read-only (no write cache)".to_string()
        } else {
            format!("{} write cache", c.cache)
        },
        served.join(" and ")
    );
    outln!(
        "vdstream: status: vdstream target status {} (file {})",
        c.target,
        c.status_path.display()
    );
    Ok(agent)
}

fn show_status(s: StatusArgs) -> Result<()> {
    paths::check_target_id(&s.id)?;
    if let Some(url) = &s.server {
        return show_api_status(&s, url);
    }
    let path = paths::status_path(&s.id);
    let st = status::read(&s.id, &path)?;
    let alive = status::pid_alive(st.pid);
    if s.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&st).context("cannot print the status")?
        );
    } else {
        out!("{}", status::render(&st, alive));
    }
    if st.state == "running" && alive {
        return Ok(());
    }
    // The figures are printed (they are the last ones), but the exit status says the
    // target has no usable disk: scripts check `target status ID` before they use its socket.
    if st.state == status::STATE_LOST && alive {
        return Err(anyhow::Error::new(Failure {
            kind: Kind::Unavailable,
            message: cache_lost(&s.id),
            reported: s.json,
        }));
    }
    Err(anyhow::Error::new(Failure {
        kind: Kind::Unavailable,
        message: format!(
            "target {} has no running agent (state {:?}, pid {}{}): start it with `vdstream target attach {} ...`",
            s.id,
            st.state,
            st.pid,
            if alive { "" } else { " is gone" },
            s.id
        ),
        reported: s.json,
    }))
}

/// Why `target status` of an agent whose server lost its cache exits non-zero.
fn cache_lost(id: &str) -> String {
    format!(
        "target {id}: its agent runs, but the server lost its cache, so every request of the guest fails with EIO: \
         detach the target and attach it again"
    )
}

/// `target status ID --server URL`: the agent's latest report, as the API keeps it.
fn show_api_status(s: &StatusArgs, url: &str) -> Result<()> {
    let client = vdstream_agent::client::Client::new(url)?.with_timeout(Duration::from_secs(10));
    let doc = client.get(&format!("/api/v1/targets/{}", s.id))?;
    let Some(report) = doc.get("agent") else {
        return Err(fail(Kind::Unavailable, format!(
            "target {} has no report from its agent on {}: the API keeps the latest for 60 s, and an agent reports to the server it reads from \
             (try the other servers, or `vdstream target status {}` on the target's machine)",
            s.id,
            client.url(),
            s.id
        )));
    };
    let st: status::Status = serde_json::from_value(report.clone()).with_context(|| {
        format!(
            "the report of target {} on {} is not an agent status",
            s.id,
            client.url()
        )
    })?;
    if s.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(report).context("cannot print the status")?
        );
    } else {
        let age = report
            .get("received_unix_ms")
            .and_then(serde_json::Value::as_u64)
            .map(|t| status::now_ms().saturating_sub(t));
        out!(
            "{}",
            status::render(&st, st.state == "running" || st.state == status::STATE_LOST)
        );
        if let Some(ms) = age {
            outln!(
                "reported:  to {} {:.1} s ago",
                client.url(),
                ms as f64 / 1000.0
            );
        }
    }
    if st.state == "running" {
        return Ok(());
    }
    if st.state == status::STATE_LOST {
        return Err(anyhow::Error::new(Failure {
            kind: Kind::Unavailable,
            message: cache_lost(&s.id),
            reported: s.json,
        }));
    }
    Err(anyhow::Error::new(Failure {
        kind: Kind::Unavailable,
        message: format!(
            "target {}'s agent reported state {:?} to {}: it is not running",
            s.id,
            st.state,
            client.url()
        ),
        reported: s.json,
    }))
}

/// --cache: one of the cache types' names, which shell completion offers.
fn cache_type() -> impl clap::builder::TypedValueParser<Value = CacheType> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(CacheType::NAMES)
        .try_map(|name| name.parse::<CacheType>())
}
