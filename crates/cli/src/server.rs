//! `vdstream server`: flags and config file → `vdstream_server::ServerOptions`, then the
//! server runs until SIGINT or SIGTERM, which drain it. Everything else is in
//! `crates/server`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use clap::{Args, Subcommand};
use vdstream_server::boot::{host_ok, BootConfig, UnknownMac};
use vdstream_server::config::{ExtraCounters, SizeValue};
use vdstream_server::forwarding::Forwarder;
use vdstream_server::object_store::{ObjectStoreConfig, ObjectStoreError};
use vdstream_server::policy::AnonymousGrant;
use vdstream_server::{ConfigFile, NbdService, ServerOptions, ServerState, DEFAULT_READ_CACHE};

use crate::exit::{fail, Kind};
use crate::size::{format_size, parse_size};

const DEFAULT_LISTEN: &str = "127.0.0.1:10809";

/// Serve every vDisk of the store over NBD, to agents and to any NBD client.
///
/// One server process serves the whole store: each connection names its export, and its
/// version is chosen when it connects (a promote moves the next connections, never the
/// running ones). Exports:
///
///   vdisk/NAME          what production targets get now, read-only
///   vdisk/NAME@V        version V: a number, base, production, test or latest
///   maintenance/NAME    the maintenance version, read-write, one connection at a time
///   target/ID           a target's vDisk through its server-side write cache (with target records)
///
/// Every export's description starts with its resolved name (e.g. `vdisk/win11@3
/// (production)`): reconnect to that name to keep the version. One RAM read cache
/// (--read-cache) in front of the store's files is shared by every connection. SIGTERM or
/// Ctrl-C drains: no new connections, requests in flight are answered, later ones get
/// ESHUTDOWN (agents then move to their next server). With --http, the JSON API and
/// Prometheus /metrics run on the same server (they answer through the drain, showing
/// "draining": true, and stop when it ends).
///
/// Without TLS every client may open every export, so the server listens only where no
/// other machine reaches it (a unix socket, 127.0.0.1, ::1) unless --insecure says the
/// network is trusted. With TLS, a client's certificate decides what it may open (a
/// target: its own target/ID and its record's vDisk; maintenance/NAME: an administrator),
/// and --anonymous what clients without one get. Refusals answer NBD_REP_ERR_POLICY naming
/// the rule and are recorded in the audit trail (`vdstream audit`).
///
/// With --boot (off by default) the API's port also serves the network boot of diskless
/// targets (docs/BOOT.md): GET /boot/ipxe, /boot/target/MAC, /boot/vdisk/NAME/V/vmlinuz and
/// initrd.img. These routes need no token (a PXE ROM has none), take only GET, and hand out
/// only boot scripts and boot files; --tftp adds TFTP for legacy PXE ROMs (iPXE binaries).
#[derive(Debug, Args)]
#[command(
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    verbatim_doc_comment,
    after_help = "\
Examples:
  vdstream server --store /srv/vdstream                       (listens on 127.0.0.1:10809)
  vdstream server --socket /run/vdstream/server.sock --read-cache 1G
  vdstream server --config /etc/vdstream/server.toml --name pvs1
  vdstream server --store /srv/vdstream --http 127.0.0.1:8480     (with the HTTP API)
  vdstream server --store /srv/vdstream --listen 0.0.0.0:10809 --tls require --tls-certificates /etc/vdstream/tls
  vdstream server --listen 0.0.0.0:10809 --http 0.0.0.0:8480 --insecure --boot --tftp 0.0.0.0:69
                                                               (network boot, docs/BOOT.md)
Then:
  nbdinfo --list nbd://127.0.0.1:10809
  qemu-img info nbd://127.0.0.1:10809/vdisk/win11
  vdstream target attach vm1 --server nbd://127.0.0.1:10809/vdisk/win11 --cache ram-overflow
  qemu-io -f raw -c 'write -P 1 0 1M' 'nbd+unix:///maintenance/win11?socket=/run/vdstream/server.sock'
  curl http://127.0.0.1:8480/api/v1/sessions
  nbdinfo --list 'nbds://pvs1:10809?tls-certificates=/etc/vdstream/tls'      (with TLS)

Config file (TOML, keys = flag names; a flag given on the command line wins):
  store = \"/srv/vdstream\"
  listen = \"127.0.0.1:10809\"
  socket = \"/run/vdstream/server.sock\"
  http = \"127.0.0.1:8480\"
  read-cache = \"1G\"
  name = \"pvs1\"
  stats-file = \"/run/vdstream/server-stats.json\"
  dead-peer-timeout = 60
  max-connections = 1000
  anonymous = \"none\"
  insecure = false
  boot = true                          (and boot-advertise, boot-server = [...], boot-unknown,
  tftp = \"0.0.0.0:69\"                  boot-template, boot-id-prefix, boot-kernel-args, boot-ipxe,
                                       max-booting, boot-window)
  rebalance = true                     (and rebalance-interval, rebalance-threshold,
  weight = 1.0                          rebalance-floor)
  identity-ca = \"/etc/vdstream/ca\"    (and identity-cert-lifetime)"
)]
pub struct ServerArgs {
    /// Act on a running server through its API instead of starting one.
    #[command(subcommand)]
    action: Option<ServerAction>,

    /// Store directory, or s3://BUCKET/PREFIX: a store in S3-compatible object storage,
    /// reached through AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID and
    /// AWS_SECRET_ACCESS_KEY. Served as a mirror: its metadata read every 2 s, its layers
    /// chunk by chunk through --object-cache, changes sent to its metadata writer (see
    /// --metadata-writer).
    /// Default: $VDSTREAM_STORE, else /var/lib/vdstream/store.
    #[arg(long, value_name = "DIR|s3://BUCKET/PREFIX")]
    store: Option<PathBuf>,

    /// With an s3:// store: the folder for its metadata and the SSD tier of the chunk
    /// cache (emptied at start: a server holds nothing another needs). Default:
    /// /var/cache/vdstream/objects.
    #[arg(long, value_name = "DIR")]
    object_cache: Option<PathBuf>,

    /// With an s3:// store: this server is the store's metadata writer, the one server
    /// that changes it. Its --object-cache folder becomes a whole store (layers it did not
    /// make are read from the bucket), every change is made there (the API, or any
    /// `vdstream` command on this host with --store s3://…), and what changed is copied to
    /// the bucket within about a second, layers before the metadata naming them. The other
    /// servers send their API's changes here. Needs --http on a fixed port (or
    /// --advertise-url); refused while another writer of the store is alive.
    #[arg(long)]
    metadata_writer: bool,

    /// With --metadata-writer: the URL other servers and commands reach this server's API
    /// at (e.g. https://pvs1.example:8480). Default: from --http.
    #[arg(long, value_name = "URL", requires = "metadata_writer")]
    advertise_url: Option<String>,

    /// With an s3:// store: RAM for 1 MiB chunks of layers. Default: 1G.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    object_cache_ram: Option<u64>,

    /// With an s3:// store: SSD bytes for chunks (in --object-cache); 0 keeps only RAM.
    /// Default: 16G.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    object_cache_disk: Option<u64>,

    /// TCP address to listen on. Default: 127.0.0.1:10809, unless only --socket is given.
    /// Any address but loopback needs TLS, or --insecure.
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,

    /// Unix socket to listen on (as well as, or instead of, --listen).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,

    /// Serve the HTTP API (/api/v1/...) and Prometheus /metrics on this TCP address (port 0:
    /// any free port; the address is printed). Any address but loopback needs --insecure
    /// (or TLS). Calls need a bearer token (`vdstream token add`) unless the address is
    /// loopback, without TLS, and no token was ever made.
    #[arg(long, value_name = "ADDR")]
    http: Option<SocketAddr>,

    /// TOML file with any of these settings (keys: store, listen, socket, http, read-cache, name, stats-file,
    /// dead-peer-timeout, max-connections, max-request-memory, anonymous, insecure, boot and the boot-* keys, tftp,
    /// object-cache, object-cache-ram, object-cache-disk, and for an s3:// store s3-endpoint,
    /// s3-region, s3-access-key-id, s3-secret-access-key, which the AWS variables override).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,

    /// RAM for the read cache shared by every connection (e.g. 256M, 4G); 0 disables it.
    /// Default: 256M.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    read_cache: Option<u64>,

    /// This server's name in logs, errors and the API. Default: HOSTNAME:PID.
    #[arg(long, value_name = "NAME")]
    name: Option<String>,

    /// Write the server's figures (guest and store I/O, read cache, sessions) as JSON to
    /// this file every second and at exit.
    #[arg(long, value_name = "FILE")]
    stats_file: Option<PathBuf>,

    /// Worker threads per connection: how many of one connection's requests run at once.
    /// A device that takes batches (an O_DIRECT disk cache) gets up to four batch runners per
    /// connection; 1 runs one batch at a time.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    threads: u16,

    /// Seconds after which a TCP connection whose peer stopped answering (its machine lost
    /// or cut off without closing the connection) is dropped and its target let go: TCP
    /// keepalive probes while it is idle, TCP_USER_TIMEOUT while data waits. 0: never.
    /// Default: 60.
    #[arg(long, value_name = "SECS")]
    dead_peer_timeout: Option<u64>,

    /// NBD connections served at once, at most; a client beyond them is told "server full"
    /// (NBD_REP_ERR_SHUTDOWN), and an agent moves to its next server. Default: what the
    /// open-files limit allows (the soft limit is raised to the hard one at start; each
    /// connection is counted at 8 descriptors, 64 kept aside), at most 4096.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_connections: Option<u64>,

    /// Memory the requests of all NBD connections together may hold (READ data waiting to
    /// be sent, WRITE payloads), e.g. 128M, 1G; at least 64M. When it is reached, the
    /// connections holding the most are not read until memory comes back (a client that
    /// sends large READs and never reads the replies holds only its share), while clients
    /// with a few small requests in flight are still served. Default: 128M.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    max_request_memory: Option<u64>,

    /// What clients without a verified certificate may open when TLS is on: `none` (the
    /// default), `vdisks` (read-only vdisk/NAME[@V], like an anonymous PVS boot) or `all`
    /// (everything but maintenance/NAME). Without TLS every client may open everything.
    #[arg(long, value_name = "none|vdisks|all")]
    anonymous: Option<AnonymousGrant>,

    /// Listen on a non-loopback address (--listen, --http) without TLS: any machine that
    /// reaches it may open every export. Only for a trusted network; refused otherwise
    /// (exit status 7).
    #[arg(long)]
    insecure: bool,

    #[command(flatten)]
    tls: crate::tls_flags::TlsFlags,

    #[command(flatten)]
    penalty: crate::penalty_flags::PenaltyFlags,

    /// Serve the network boot of targets on the HTTP API's port (needs --http): iPXE scripts
    /// chosen by MAC (target records' --mac), each version's kernel and initrd. Off by
    /// default. These routes are unauthenticated and read-only (see docs/BOOT.md).
    #[arg(long)]
    boot: bool,

    /// How targets reach this server, named in their scripts and kernel command line (e.g.
    /// 10.0.2.2 behind qemu's user network, or a DNS name); the API's port when none is
    /// given. Default: the Host the target's request named.
    #[arg(long, value_name = "HOST[:PORT]", requires = "boot")]
    boot_advertise: Option<String>,

    /// Another server of the store (its API URL, http://HOST:PORT) that booted targets
    /// fail over to, after this one (repeatable).
    #[arg(long = "boot-server", value_name = "URL", requires = "boot")]
    boot_servers: Vec<String>,

    /// What a machine whose MAC no record has gets: `refuse` (the default: its console says
    /// how to add it, it retries; the log names the MAC) or `auto-add` (a new record, a copy
    /// of --boot-template, id PREFIX-NNN; audited).
    #[arg(long, value_name = "refuse|auto-add", value_parser = ["refuse", "auto-add"], requires = "boot")]
    boot_unknown: Option<String>,

    /// The target record that auto-added records copy (vDisk, version, cache, RAM, overflow).
    #[arg(long, value_name = "ID", requires = "boot")]
    boot_template: Option<String>,

    /// The id prefix of auto-added records (PREFIX-001, PREFIX-002, …). Default: pxe.
    #[arg(long, value_name = "PREFIX", requires = "boot")]
    boot_id_prefix: Option<String>,

    /// Kernel arguments before the vdstream.* ones. Default: "console=tty0 console=ttyS0".
    #[arg(long, value_name = "TEXT", requires = "boot")]
    boot_kernel_args: Option<String>,

    /// The folder of iPXE binaries that --tftp serves. Default: /usr/lib/ipxe (Debian's
    /// ipxe package: undionly.kpxe, ipxe.efi, …).
    #[arg(long, value_name = "DIR", requires = "boot")]
    boot_ipxe: Option<PathBuf>,

    /// Serve the iPXE binaries over TFTP (read-only) on this UDP address, for PXE ROMs
    /// (e.g. 0.0.0.0:69).
    #[arg(long, value_name = "ADDR", requires = "boot")]
    tftp: Option<SocketAddr>,

    /// Boot pacing (PVS's "maximum devices booting"): at most N machines in their boot
    /// window on this server at once; the others are told to wait (their console says
    /// "waiting: N booting") and ask again, longest waiting first. A window opens when a
    /// machine gets its script, and closes when its initramfs has mounted the root, or
    /// after --boot-window. 0: no limit. Default: 50 (docs/BENCHMARKS.md, "Boot pacing").
    #[arg(long, value_name = "N", requires = "boot")]
    max_booting: Option<usize>,

    /// How long a machine keeps its boot place without saying it booted (one that died
    /// mid-boot gives it back then). Default: 180.
    #[arg(long, value_name = "SECONDS", requires = "boot", value_parser = clap::value_parser!(u64).range(1..=3600))]
    boot_window: Option<u64>,

    /// Rebalancing across the servers of this store (on by default): servers find each
    /// other through heartbeats in STORE/servers/, and a server whose targets exceed its
    /// fair share (by --weight) by more than --rebalance-threshold moves the excess to
    /// the servers below their share, at a safe point (no request lost, none failed).
    /// `off`: this server moves nothing by itself (a drain still moves its targets, and
    /// the others still count it).
    #[arg(long, value_name = "on|off", value_parser = on_off)]
    rebalance: Option<bool>,

    /// Seconds between two rebalancing rounds (also how long a target that arrived stays
    /// before it may move again). Default: 30: a server that joins or returns has its share
    /// within one interval plus a few seconds (docs/SERVER.md, "Rebalancing").
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=86400))]
    rebalance_interval: Option<u64>,

    /// How far above its share, in percent, a server's targets may go before it moves
    /// some (PVS's threshold). Default: 25.
    #[arg(long, value_name = "PERCENT", value_parser = clap::value_parser!(u64).range(1..=1000))]
    rebalance_threshold: Option<u64>,

    /// Nothing moves while the farm has fewer targets than this. Default: 5.
    #[arg(long, value_name = "N")]
    rebalance_floor: Option<u64>,

    /// This server's power rating: its share of the farm's targets is its weight over the
    /// sum of the weights (a server of weight 2 carries twice what one of weight 1 does).
    /// Default: 1.
    #[arg(long, value_name = "W", value_parser = weight)]
    weight: Option<f64>,

    /// Machine identity (docs/IDENTITY.md): a `vdstream pki` CA folder whose key signs a
    /// short-lived client certificate for each machine that proves, with its TPM, that it
    /// holds the key approved for its target (`vdstream target identity approve`). Adds the
    /// routes POST /boot/identity/ID/challenge and /prove, which need no credential. The
    /// server then holds that CA's key: keep the folder owner-only.
    #[arg(long, value_name = "DIR")]
    identity_ca: Option<PathBuf>,

    /// How long a machine's certificate lasts; it proves itself again at its next boot.
    /// Default: 86400 (a day).
    #[arg(long, value_name = "SECONDS", requires = "identity_ca", value_parser = clap::value_parser!(u64).range(300..=31_536_000))]
    identity_cert_lifetime: Option<u64>,
}

fn on_off(s: &str) -> std::result::Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?}: say on or off")),
    }
}

fn weight(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(w) if w.is_finite() && w > 0.0 && w <= 1000.0 => Ok(w),
        _ => Err(format!(
            "{s:?}: give a weight above 0, at most 1000 (e.g. 1, 2.5)"
        )),
    }
}

/// `vdstream server drain|resume`: through a running server's API.
#[derive(Debug, Subcommand)]
enum ServerAction {
    /// Drain a running server without stopping it: it takes no new connection and moves
    /// every target to the other servers of its store now, spread by their shares (each
    /// agent reconnects where it is told; no request is lost). `vdstream server resume`
    /// takes it back.
    ///
    /// Example: vdstream server drain --server http://pvs1:8480
    Drain(FarmArgs),
    /// Take a drained server back into the farm: it takes connections again, and the next
    /// rebalancing round of a loaded server sends it its share.
    ///
    /// Example: vdstream server resume --server http://pvs1:8480
    Resume(FarmArgs),
}

#[derive(Debug, Args)]
struct FarmArgs {
    #[command(flatten)]
    remote: crate::remote::ServerOpt,

    /// Print the server's rebalancing figures as one JSON document.
    #[arg(long)]
    json: bool,
}

fn run_action(action: ServerAction) -> Result<()> {
    let (args, drain) = match action {
        ServerAction::Drain(a) => (a, true),
        ServerAction::Resume(a) => (a, false),
    };
    let Some(client) = args.remote.client()? else {
        return Err(fail(Kind::Usage, format!(
            "vdstream server {} acts on a running server: give its API with --server http://HOST:PORT",
            if drain { "drain" } else { "resume" }
        )));
    };
    let path = if drain {
        "/api/v1/server/drain"
    } else {
        "/api/v1/server/resume"
    };
    let doc = client.post(path, &serde_json::Value::Null)?;
    if args.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&doc).expect("serializes")
        );
    } else if drain {
        outln!(
            "{}: drained: no new connections; its {} target(s) move to the other servers now (`curl {0}/api/v1/farm` shows where they are)",
            client.url(),
            doc["targets"]
        );
    } else {
        outln!(
            "{}: back in the farm: it takes connections again, and gets its share at the next rebalancing round",
            client.url()
        );
    }
    Ok(())
}

/// The boot service's settings from the flags over the config file (`None` without
/// --boot or `boot = true`).
fn boot_config(
    args: &ServerArgs,
    file: &ConfigFile,
    http: Option<SocketAddr>,
) -> Result<Option<BootConfig>> {
    // (The boot-* flags need --boot on the command line; the file's keys need boot = true.)
    if !(args.boot || file.boot == Some(true)) {
        return Ok(None);
    }
    if http.is_none() {
        usage!(
            "--boot serves on the HTTP API's port: give --http ADDR too (e.g. --http 0.0.0.0:8480)"
        );
    }
    let advertise = args
        .boot_advertise
        .clone()
        .or_else(|| file.boot_advertise.clone());
    if let Some(a) = &advertise {
        let bare_v6 = !a.starts_with('[') && a.matches(':').count() > 1;
        if !host_ok(a) || bare_v6 {
            usage!("--boot-advertise {a:?} is not HOST or HOST:PORT (an IPv6 address goes in brackets: [fd00::1]:8480)");
        }
    }
    let servers = if args.boot_servers.is_empty() {
        file.boot_server.clone().unwrap_or_default()
    } else {
        args.boot_servers.clone()
    };
    for s in &servers {
        let rest = s
            .strip_prefix("http://")
            .or_else(|| s.strip_prefix("https://"));
        if !rest.is_some_and(|r| host_ok(r.trim_end_matches('/'))) {
            usage!("--boot-server {s:?} is not a server's API URL such as http://10.0.0.2:8480");
        }
    }
    let template = args
        .boot_template
        .clone()
        .or_else(|| file.boot_template.clone());
    let unknown = match args
        .boot_unknown
        .as_deref()
        .or(file.boot_unknown.as_deref())
    {
        Some("auto-add") => {
            let Some(template) = template else {
                usage!("--boot-unknown auto-add copies a template record: name it with --boot-template ID (e.g. a record made with `vdstream target add lab-template --vdisk NAME --cache ram-overflow`)");
            };
            let prefix = args
                .boot_id_prefix
                .clone()
                .or_else(|| file.boot_id_prefix.clone())
                .unwrap_or_else(|| "pxe".into());
            vdstream_store::names::validate_target_id(&format!("{prefix}-001"))
                .map_err(|e| anyhow!("--boot-id-prefix {prefix:?}: {e}"))?;
            UnknownMac::AutoAdd { template, prefix }
        }
        None | Some("refuse") => {
            if template.is_some() {
                usage!("--boot-template is for --boot-unknown auto-add");
            }
            UnknownMac::Refuse
        }
        Some(other) => {
            usage!("boot-unknown = {other:?} in the config file: say \"refuse\" or \"auto-add\"")
        }
    };
    let tftp = match (args.tftp, &file.tftp) {
        (Some(a), _) => Some(a),
        (None, Some(text)) => Some(text.parse::<SocketAddr>().map_err(|e| {
            anyhow!("tftp = {text:?} in the config file: {e} (say e.g. \"0.0.0.0:69\")")
        })?),
        (None, None) => None,
    };
    let defaults = BootConfig::default();
    Ok(Some(BootConfig {
        advertise,
        servers: servers
            .iter()
            .map(|s| s.trim_end_matches('/').to_string())
            .collect(),
        unknown,
        kernel_args: args
            .boot_kernel_args
            .clone()
            .or_else(|| file.boot_kernel_args.clone())
            .unwrap_or(defaults.kernel_args),
        ipxe_dir: args
            .boot_ipxe
            .clone()
            .or_else(|| file.boot_ipxe.clone())
            .unwrap_or(defaults.ipxe_dir),
        tftp,
        retry_secs: defaults.retry_secs,
        max_booting: args
            .max_booting
            .or(file.max_booting)
            .unwrap_or(defaults.max_booting),
        boot_window: match args.boot_window.or(file.boot_window) {
            Some(s @ 1..=3600) => std::time::Duration::from_secs(s),
            Some(s) => usage!("boot-window = {s} in the config file: give 1 to 3600 seconds"),
            None => defaults.boot_window,
        },
    }))
}

/// Merges the flags over the config file.
fn options(args: &ServerArgs) -> Result<ServerOptions> {
    let file = match &args.config {
        Some(path) => ConfigFile::load(path).map_err(|e| anyhow!(e))?,
        None => ConfigFile::default(),
    };
    let listen_from_file = match &file.listen {
        Some(text) => Some(text.parse::<SocketAddr>().map_err(|e| {
            anyhow!("listen = {text:?} in the config file: {e} (say e.g. \"127.0.0.1:10809\")")
        })?),
        None => None,
    };
    let http_from_file = match &file.http {
        Some(text) => Some(text.parse::<SocketAddr>().map_err(|e| {
            anyhow!("http = {text:?} in the config file: {e} (say e.g. \"127.0.0.1:8480\")")
        })?),
        None => None,
    };
    let read_cache_from_file = file_size("read-cache", &file.read_cache)?;
    let boot = boot_config(args, &file, args.http.or(http_from_file))?;
    let socket = args.socket.clone().or(file.socket.clone());
    let mut listen = args.listen.or(listen_from_file);
    if listen.is_none() && socket.is_none() {
        listen = Some(DEFAULT_LISTEN.parse().expect("a socket address"));
    }
    let store = vdstream_store::store_dir(args.store.as_deref().or(file.store.as_deref()));
    let http = args.http.or(http_from_file);
    let (store, forward, extra_counters) = match store.to_str().and_then(vdstream_objstore::S3Location::parse) {
        Some(location) => object_store(args, &file, location.map_err(crate::store_cmd::objstore_error)?, http)?,
        None if args.metadata_writer => return Err(anyhow!("--metadata-writer is for a store in object storage (--store s3://BUCKET/PREFIX); a store folder has its own lock")),
        None => (store, None, None),
    };
    vdstream_store::check_location(&store)?;
    // NBD TLS with --tls on|require. --tls-certificates with --tls off serves only the
    // API's HTTPS, so it needs --http; without one it is refused as serve-image refuses it.
    let nbd_tls = match (args.tls.tls, &args.tls.tls_certificates) {
        (vdstream_nbd::TlsMode::Off, Some(_)) if http.is_some() => None,
        _ => args.tls.server()?,
    };
    Ok(ServerOptions {
        boot,
        store,
        listen,
        socket,
        http,
        // --tls-certificates serves the API over HTTPS even with --tls off (NBD plaintext).
        http_tls: args.tls.tls_certificates.clone(),
        read_cache: args.read_cache.or(read_cache_from_file).unwrap_or(DEFAULT_READ_CACHE),
        name: args.name.clone().or(file.name),
        stats_file: args.stats_file.clone().or(file.stats_file),
        threads: args.threads as usize,
        max_request_memory: vdstream_nbd::memory::limit(
            args.max_request_memory.or(file_size("max-request-memory", &file.max_request_memory)?),
        )?,
        max_connections: match args.max_connections.map(|n| n as usize).or(file.max_connections) {
            Some(0) => return Err(anyhow!("max-connections = 0 in the config file: say at least 1, or leave it out for the default")),
            n => n,
        },
        anonymous: match (args.anonymous, &file.anonymous) {
            (Some(g), _) => g,
            (None, Some(text)) => text.parse().map_err(|e| anyhow!("anonymous in the config file: {e}"))?,
            (None, None) => AnonymousGrant::None,
        },
        insecure: args.insecure || file.insecure.unwrap_or(false),
        dead_peer_timeout: match args.dead_peer_timeout.or(file.dead_peer_timeout) {
            Some(0) => None,
            Some(secs) => Some(Duration::from_secs(secs)),
            None => Some(vdstream_nbd::server::DEFAULT_DEAD_PEER_TIMEOUT),
        },
        nbd_tls,
        nbd_tls_mode: args.tls.tls,
        handshake_penalty: args.penalty.config(file.handshake_penalty, file.handshake_penalty_exempt.as_deref())?,
        forward,
        extra_counters,
        identity: args.identity_ca.clone().or_else(|| file.identity_ca.clone()).map(|ca_dir| {
            vdstream_server::identity::IdentityConfig {
                ca_dir,
                cert_lifetime: args
                    .identity_cert_lifetime
                    .or(file.identity_cert_lifetime)
                    .map_or(vdstream_server::identity::DEFAULT_CERT_LIFETIME, Duration::from_secs),
            }
        }),
        balance: vdstream_server::balance::BalanceConfig {
            enabled: args.rebalance.or(file.rebalance).unwrap_or(true),
            interval: Duration::from_secs(match args.rebalance_interval.or(file.rebalance_interval) {
                Some(s @ 1..=86400) => s,
                Some(s) => usage!("rebalance-interval = {s} in the config file: give 1 to 86400 seconds"),
                None => vdstream_server::balance::DEFAULT_INTERVAL.as_secs(),
            }),
            threshold_percent: match args.rebalance_threshold.or(file.rebalance_threshold) {
                Some(p @ 1..=1000) => p as f64,
                Some(p) => usage!("rebalance-threshold = {p} in the config file: give 1 to 1000 (percent)"),
                None => vdstream_server::balance::DEFAULT_THRESHOLD_PERCENT,
            },
            floor: args.rebalance_floor.or(file.rebalance_floor).unwrap_or(vdstream_server::balance::DEFAULT_FLOOR),
            weight: match args.weight.or(file.weight) {
                Some(w) if w.is_finite() && w > 0.0 && w <= 1000.0 => w,
                Some(w) => usage!("weight = {w} in the config file: give a weight above 0, at most 1000"),
                None => 1.0,
            },
        },
    })
}

pub fn run(mut args: ServerArgs) -> Result<()> {
    if let Some(action) = args.action.take() {
        return run_action(action);
    }
    let opts = options(&args)?;
    opts.check_listen()
        .map_err(|e| fail(Kind::Insecure, e.to_string()))?;
    if opts.insecure
        && [opts.listen, opts.http]
            .iter()
            .flatten()
            .any(|a| !vdstream_server::config::is_loopback(a))
    {
        log::warn!("listening without TLS on a non-loopback address (--insecure): every client that reaches it may open every export");
    }
    if opts.anonymous != AnonymousGrant::None && opts.nbd_tls.is_none() {
        log::warn!(
            "--anonymous {} matters only with TLS: without it every client may open every export",
            opts.anonymous
        );
    }
    if let Some(identity) = &opts.identity {
        identity.check().map_err(|e| fail(Kind::Usage, e))?;
    }
    let state = ServerState::new(&opts);
    // Bound before the NBD side starts, so that a busy port fails the start cleanly.
    let http_listener = match opts.http {
        Some(addr) => Some(std::net::TcpListener::bind(addr).with_context(|| {
            format!("cannot listen for the HTTP API on {addr}; is another server using that port?")
        })?),
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the I/O runtime")?;
    runtime.block_on(async move {
        let nbd = NbdService::start(state.clone(), opts.threads).await?;
        outln!(
            "vdstream: server {} on store {}, read cache {}",
            state.name,
            state.store.display(),
            if opts.read_cache == 0 { "off".to_string() } else { format_size(opts.read_cache) }
        );
        for uri in &nbd.uris {
            outln!("vdstream: serving {uri} (EXPORT: vdisk/NAME[@V], maintenance/NAME, target/ID)");
        }
        if let Some(uri) = nbd.uris.first() {
            outln!("vdstream: try: nbdinfo --list '{}'", uri.replace("EXPORT", ""));
        }
        // The API's tasks run on this runtime; it shares `state` with the NBD side.
        let http = match http_listener {
            Some(listener) => {
                let tls = match &opts.http_tls {
                    Some(dir) => Some(Arc::new(
                        vdstream_tls::files::ServerTls::new(dir, vdstream_tls::files::ClientAuth::Verify).with_context(|| format!("cannot serve the HTTP API over TLS with {}", dir.display()))?,
                    )),
                    None => None,
                };
                let scheme = if tls.is_some() { "https" } else { "http" };
                let handle = vdstream_server::http::spawn_with(listener, state.clone(), tls).context("cannot start the HTTP API")?;
                outln!("vdstream: HTTP API on {scheme}://{}/api/v1/server, metrics on {scheme}://{0}/metrics", handle.local_addr());
                outln!("vdstream: console on {scheme}://{}/console", handle.local_addr());
                Some(handle)
            }
            None => None,
        };
        if let Some(b) = &opts.boot {
            if let Some(h) = &http {
                let scheme = if opts.http_tls.is_some() { "https" } else { "http" };
                let host = b.advertise.clone().unwrap_or_else(|| h.local_addr().to_string());
                outln!("vdstream: boot service on {scheme}://{host}/boot/ipxe (unknown MACs: {})", match &b.unknown {
                    UnknownMac::Refuse => "refused".to_string(),
                    UnknownMac::AutoAdd { template, prefix } => format!("auto-added as {prefix}-NNN from {template}"),
                });
            }
        }
        let tftp = match opts.boot.as_ref().and_then(|b| b.tftp.map(|a| (a, b.ipxe_dir.clone()))) {
            Some((addr, dir)) => {
                let t = vdstream_server::boot::tftp::bind(addr, &dir).await.map_err(|e| anyhow!(e))?;
                outln!("vdstream: TFTP on {} serving the iPXE binaries of {}", t.addr, dir.display());
                Some(tokio::spawn(t.serve()))
            }
            None => None,
        };
        let stats = opts.stats_file.clone().map(|path| {
            let state = state.clone();
            tokio::spawn(async move {
                loop {
                    if let Err(e) = vdstream_server::nbd::write_stats(&state, &path) {
                        log::warn!("cannot write the stats file {}: {e}", path.display());
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            })
        });
        let balance = tokio::spawn(state.balancer.clone().run(state.clone()));
        vdstream_agent::service::wait_for_signal().await?;
        balance.abort();
        // Before the connections end: where each target should go, spread over the others.
        state.draining.store(true, std::sync::atomic::Ordering::Relaxed);
        let hinted = {
            let state = state.clone();
            tokio::task::spawn_blocking(move || state.balancer.plan_drain(&state)).await.unwrap_or(0)
        };
        if hinted > 0 {
            log::info!("draining: {hinted} target(s) told which server to reconnect to");
        }
        state.balancer.leave(&state);
        log::info!("draining: no new connections; finishing the requests in flight of {} session(s)", state.registry.len());
        let drained = nbd.drain().await;
        // The API answered through the drain ("draining": true); it stops once it is over,
        // and once the agents told where to go had time to ask (they ask when their
        // connection closes, within a second).
        if hinted > 0 && http.is_some() {
            tokio::time::sleep(vdstream_server::balance::HINT_GRACE).await;
        }
        if let Some(handle) = http {
            handle.stop().await;
        }
        drained?;
        if let Some(task) = stats {
            task.abort();
        }
        if let Some(task) = tftp {
            task.abort();
        }
        if let Some(path) = &opts.stats_file {
            vdstream_server::nbd::write_stats(&state, path).with_context(|| format!("cannot write the stats file {}", path.display()))?;
        }
        outln!("vdstream: {}", vdstream_server::nbd::summary(&state));
        log::info!("all sessions drained; bye");
        Ok(())
    })
}

/// A size from the config file (a number of bytes, or a text like "256M"); the error
/// names the key.
fn file_size(key: &str, value: &Option<SizeValue>) -> Result<Option<u64>> {
    match value {
        Some(SizeValue::Bytes(n)) => Ok(Some(*n)),
        Some(SizeValue::Text(t)) => Ok(Some(
            parse_size(t).map_err(|e| anyhow!("{key} in the config file: {e}"))?,
        )),
        None => Ok(None),
    }
}

/// A store in object storage: the flags over the file make its config, and the server
/// opens it (`vdstream_server::object_store`). Returns the folder the server opens as its
/// store, where a mirror's API changes go, and the chunk cache's counters.
fn object_store(
    args: &ServerArgs,
    file: &ConfigFile,
    location: vdstream_objstore::S3Location,
    http: Option<SocketAddr>,
) -> Result<(PathBuf, Option<Forwarder>, Option<ExtraCounters>)> {
    let config = ObjectStoreConfig {
        location,
        cache_base: args
            .object_cache
            .clone()
            .or(file.object_cache.clone())
            .unwrap_or_else(|| PathBuf::from("/var/cache/vdstream/objects")),
        ram_bytes: args
            .object_cache_ram
            .or(file_size("object-cache-ram", &file.object_cache_ram)?)
            .unwrap_or(1 << 30),
        disk_bytes: args
            .object_cache_disk
            .or(file_size("object-cache-disk", &file.object_cache_disk)?)
            .unwrap_or(16 << 30),
        metadata_writer: args.metadata_writer,
        advertise_url: args.advertise_url.clone(),
        http,
        tls_certificates: args.tls.tls_certificates.clone(),
        insecure: args.insecure || file.insecure.unwrap_or(false),
        s3_endpoint: file.s3_endpoint.clone(),
        s3_region: file.s3_region.clone(),
        s3_access_key_id: file.s3_access_key_id.clone(),
        s3_secret_access_key: file.s3_secret_access_key.clone(),
    };
    let opened = vdstream_server::object_store::open(&config).map_err(|e| match e {
        ObjectStoreError::Objstore(e) => crate::store_cmd::objstore_error(e),
        ObjectStoreError::Settings(m) => anyhow!(m),
    })?;
    Ok((opened.dir, opened.forward, Some(opened.counters)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: ServerArgs,
    }

    fn parse(args: &[&str]) -> ServerArgs {
        Cli::try_parse_from(std::iter::once("server").chain(args.iter().copied()))
            .unwrap()
            .args
    }

    #[test]
    fn flags_win_over_the_file_and_defaults_fill_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("s.toml");
        std::fs::write(&file, "store = \"/from-file\"\nread-cache = \"1G\"\nname = \"file\"\nsocket = \"/tmp/f.sock\"\nhttp = \"127.0.0.1:8480\"\n").unwrap();
        let cfg = file.to_str().unwrap();
        let o = options(&parse(&["--config", cfg, "--name", "flag"])).unwrap();
        assert_eq!(o.store, PathBuf::from("/from-file"));
        assert_eq!(o.read_cache, 1 << 30);
        assert_eq!(o.name.as_deref(), Some("flag"));
        assert_eq!(o.socket, Some(PathBuf::from("/tmp/f.sock")));
        assert_eq!(o.listen, None, "a socket alone: no TCP");
        assert_eq!(o.http, Some("127.0.0.1:8480".parse().unwrap()));
        let o = options(&parse(&["--config", cfg, "--http", "127.0.0.1:0"])).unwrap();
        assert_eq!(o.http, Some("127.0.0.1:0".parse().unwrap()));
        let o = options(&parse(&["--store", "/s", "--read-cache", "0"])).unwrap();
        assert_eq!(o.listen, Some(DEFAULT_LISTEN.parse().unwrap()));
        assert_eq!(o.read_cache, 0);
        assert_eq!(o.http, None, "no API unless asked for");
        assert_eq!(
            options(&parse(&["--store", "/s"])).unwrap().read_cache,
            DEFAULT_READ_CACHE
        );
        assert_eq!(
            options(&parse(&["--store", "/s"])).unwrap().max_connections,
            None,
            "derived at start"
        );
        std::fs::write(&file, "max-connections = 300\n").unwrap();
        assert_eq!(
            options(&parse(&["--config", cfg])).unwrap().max_connections,
            Some(300)
        );
        assert_eq!(
            options(&parse(&["--config", cfg, "--max-connections", "7"]))
                .unwrap()
                .max_connections,
            Some(7)
        );
        std::fs::write(&file, "anonymous = \"vdisks\"\ninsecure = true\n").unwrap();
        let o = options(&parse(&["--config", cfg])).unwrap();
        assert_eq!((o.anonymous, o.insecure), (AnonymousGrant::Vdisks, true));
        let o = options(&parse(&["--config", cfg, "--anonymous", "all"])).unwrap();
        assert_eq!(o.anonymous, AnonymousGrant::All);
        let o = options(&parse(&["--store", "/s"])).unwrap();
        assert_eq!(
            (o.anonymous, o.insecure),
            (AnonymousGrant::None, false),
            "nothing for anonymous clients, no plaintext off loopback"
        );
        assert!(Cli::try_parse_from(["server", "--anonymous", "some"]).is_err());
    }

    #[test]
    fn boot_flags_and_keys_make_the_boot_config() {
        let o = options(&parse(&["--store", "/s", "--http", "127.0.0.1:0"])).unwrap();
        assert_eq!(o.boot, None, "off by default");
        let o = options(&parse(&[
            "--store",
            "/s",
            "--http",
            "127.0.0.1:0",
            "--boot",
            "--boot-advertise",
            "10.0.2.2",
            "--boot-server",
            "http://10.0.0.9:8480/",
            "--tftp",
            "127.0.0.1:6969",
        ]))
        .unwrap();
        let b = o.boot.unwrap();
        assert_eq!(
            (b.advertise.as_deref(), b.servers, b.unknown, b.tftp),
            (
                Some("10.0.2.2"),
                vec!["http://10.0.0.9:8480".to_string()],
                UnknownMac::Refuse,
                Some("127.0.0.1:6969".parse().unwrap())
            )
        );
        let e = options(&parse(&["--store", "/s", "--boot"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("give --http ADDR"), "{e}");
        let e = options(&parse(&[
            "--store",
            "/s",
            "--http",
            "127.0.0.1:0",
            "--boot",
            "--boot-unknown",
            "auto-add",
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("--boot-template ID"), "{e}");
        let o = options(&parse(&[
            "--store",
            "/s",
            "--http",
            "127.0.0.1:0",
            "--boot",
            "--boot-unknown",
            "auto-add",
            "--boot-template",
            "tmpl",
            "--boot-id-prefix",
            "lab",
        ]))
        .unwrap();
        assert_eq!(
            o.boot.unwrap().unknown,
            UnknownMac::AutoAdd {
                template: "tmpl".into(),
                prefix: "lab".into()
            }
        );
        for bad in ["a b", "fd00::1", "x/y"] {
            assert!(
                options(&parse(&[
                    "--store",
                    "/s",
                    "--http",
                    "127.0.0.1:0",
                    "--boot",
                    "--boot-advertise",
                    bad
                ]))
                .is_err(),
                "{bad}"
            );
        }
        assert!(
            options(&parse(&[
                "--store",
                "/s",
                "--http",
                "127.0.0.1:0",
                "--boot",
                "--boot-server",
                "10.0.0.9:8480"
            ]))
            .is_err(),
            "no scheme"
        );
        assert!(
            Cli::try_parse_from(["server", "--tftp", "0.0.0.0:69"]).is_err(),
            "--tftp needs --boot"
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("s.toml");
        std::fs::write(&file, "http = \"127.0.0.1:0\"\nboot = true\nboot-unknown = \"auto-add\"\nboot-template = \"t\"\ntftp = \"127.0.0.1:69\"\n").unwrap();
        let b = options(&parse(&[
            "--store",
            "/s",
            "--config",
            file.to_str().unwrap(),
        ]))
        .unwrap()
        .boot
        .unwrap();
        assert_eq!(
            (b.unknown, b.tftp),
            (
                UnknownMac::AutoAdd {
                    template: "t".into(),
                    prefix: "pxe".into()
                },
                Some("127.0.0.1:69".parse().unwrap())
            )
        );
    }

    #[test]
    fn a_bad_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("s.toml");
        std::fs::write(&file, "read_cache = 5\n").unwrap();
        let e = options(&parse(&["--config", file.to_str().unwrap()]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("s.toml") && e.contains("read-cache"), "{e}");
    }
}
