//! `vdstream serve-image`: serve one image file (raw, or qcow2 with its backing chain), a
//! RAM disk, or a layer of a vDisk in the store, as an NBD export on a unix socket and/or a
//! loopback TCP port, until SIGINT or SIGTERM, which drain the requests in flight before
//! the process exits.
//!
//! With `--vdisk NAME[@V]` the layer is chosen once, at start (a target's version is fixed
//! when it connects), and its chain stays open, holding the files' locks, until exit.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use vdstream_blockdev::{BlockDev, FileDev, FileOptions, MemoryDev};
use vdstream_nbd::server::{
    ExportInfo, Exports, Listener, OpenError, OpenRequest, OpenedExport, Server, ServerConfig,
    ShutdownSignal,
};
use vdstream_qcow2::{open_chain, ImageFormat, OpenOptions, Qcow2Image};
use vdstream_server::writer_slot::{SlotDev, WriterSlots};

use vdstream_wcache::space::{self, Capacity, DirRule};
use vdstream_wcache::{CacheConfig, CacheType, WriteCache};

use crate::size::{check_ram_fits_here, format_size, parse_ram, parse_size};

/// --ram when not given.
const DEFAULT_RAM: u64 = 256 << 20;

pub(crate) fn parse_on_off(text: &str) -> Result<bool, String> {
    match text {
        "on" | "yes" | "true" => Ok(true),
        "off" | "no" | "false" => Ok(false),
        _ => Err(format!("{text:?}: say on or off")),
    }
}

/// `--format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FormatChoice {
    Auto,
    Raw,
    Qcow2,
}

fn parse_format(text: &str) -> Result<FormatChoice, String> {
    match text {
        "auto" => Ok(FormatChoice::Auto),
        "raw" => Ok(FormatChoice::Raw),
        "qcow2" => Ok(FormatChoice::Qcow2),
        _ => Err(format!("{text:?}: say auto, raw or qcow2")),
    }
}

const DEFAULT_SOCKET: &str = "/tmp/vdstream.sock";

/// Serve an image file (raw, or qcow2 with its backing chain) or a RAM disk over NBD.
///
/// The export answers to the empty (default) name and to --name. Clients connect with
/// `nbd+unix:///NAME?socket=PATH` or `nbd://127.0.0.1:PORT/NAME`. Ctrl-C or SIGTERM stops
/// accepting, finishes every request in flight, and exits.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vdstream serve-image --memory 1G
  vdstream serve-image disk.img --socket /run/disk.sock --name golden
  vdstream serve-image disk.img --read-only --listen 127.0.0.1:10809
  vdstream serve-image store/win11/v3.qcow2 --read-only   (v3 and every version below it)
  vdstream serve-image disk.img --cache ram-overflow --record-trace vm.trace   (then: vdstream size --trace vm.trace)
  vdstream serve-image disk.img --listen 127.0.0.1:10809 --tls require --tls-certificates /etc/vdstream/tls
Then:
  nbdinfo --map 'nbd+unix:///?socket=/tmp/vdstream.sock'
  qemu-system-x86_64 -drive file=nbd+unix:///?socket=/tmp/vdstream.sock,format=raw,if=virtio ...
  nbdinfo 'nbds://127.0.0.1:10809/vdstream?tls-certificates=/etc/vdstream/tls'      (with TLS)
  qemu-img info --object tls-creds-x509,id=tls0,dir=/etc/vdstream/tls,endpoint=client \\
    --image-opts driver=nbd,host=127.0.0.1,port=10809,export=vdstream,tls-creds=tls0")]
pub struct ServeImageArgs {
    /// Image file (or block device) to serve: raw, or qcow2 served with its whole backing
    /// chain (see --format). Omit it with --memory or --vdisk.
    #[arg(value_name = "FILE", required_unless_present_any = ["memory", "vdisk"], conflicts_with_all = ["memory", "vdisk"])]
    file: Option<PathBuf>,

    /// Format of FILE: `auto` (qcow2 when it starts with the qcow2 magic, else raw), `raw`
    /// or `qcow2`. A probed qcow2 that names a backing file is refused: say `--format
    /// qcow2` for a chain you made (a guest that wrote a qcow2 header into a raw image must
    /// not make the next start read the "backing files" it named). Give `raw` for a raw
    /// image that clients may write.
    #[arg(long, value_name = "auto|raw|qcow2", default_value = "auto", value_parser = parse_format)]
    format: FormatChoice,
    /// Serve a vDisk of the store: NAME (what production targets get) or NAME@V (V: a
    /// number, base, production, test, maintenance, latest). The maintenance version and a
    /// private vDisk are served read-write to one client process; the rest read-only.
    #[arg(long, value_name = "NAME[@V]", conflicts_with = "memory")]
    vdisk: Option<String>,

    /// Store directory for --vdisk. Default: $VDSTREAM_STORE, else /var/lib/vdstream/store.
    #[arg(long, value_name = "DIR", requires = "vdisk")]
    store: Option<PathBuf>,

    /// Serve a sparse RAM disk of this size instead of a file (e.g. 64M, 1G, 2T).
    /// Memory is taken only as data is written and is given back on trim.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    memory: Option<u64>,

    /// Refuse writes, trims and zeroes (clients see a read-only disk).
    #[arg(long)]
    read_only: bool,

    /// Open FILE with O_DIRECT, bypassing the host page cache.
    #[arg(long, conflicts_with = "memory")]
    direct: bool,

    /// Unix socket to listen on. Default: /tmp/vdstream.sock, unless --listen is given.
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,

    /// TCP address to listen on, e.g. 127.0.0.1:10809 (the NBD port). Any address but
    /// loopback needs TLS, or --insecure.
    #[arg(long, value_name = "ADDR")]
    listen: Option<std::net::SocketAddr>,

    /// Listen on a non-loopback --listen address without TLS: any machine that reaches it
    /// may read and write the export. Only for a trusted network; refused otherwise (exit
    /// status 7).
    #[arg(long)]
    insecure: bool,

    /// Serve FILE through a write cache of this type: the file is only read (except with
    /// `private`), every write lands in the cache. Types: ram-overflow, device-ram,
    /// device-disk, device-disk-persistent, server, server-persistent, private.
    #[arg(long, value_name = "TYPE")]
    cache: Option<vdstream_wcache::CacheType>,

    /// RAM for device-ram and ram-overflow (e.g. 256M): 0 (ram-overflow only: straight to its
    /// file) or 1M to 256G, and no more than this machine has. Default: 256M.
    #[arg(long, value_name = "SIZE", value_parser = parse_ram, requires = "cache")]
    ram: Option<u64>,

    /// Folder for the overflow file (ram-overflow) or cache file (disk and server types).
    /// Default: the store's cache/ folder for the server types of a --vdisk, else $TMPDIR.
    /// Created if missing, but only when its parent exists (a typo is refused).
    #[arg(long, value_name = "DIR", requires = "cache")]
    overflow_dir: Option<PathBuf>,

    /// Start even when the cache folder's file system has less than 64 MiB free (refused
    /// otherwise; with less free space than the cache may use, a warning only).
    #[arg(long, requires = "cache")]
    allow_low_space: bool,

    /// Cap on the overflow or cache file (e.g. 10G); past it, writes to new blocks fail with ENOSPC.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, requires = "cache")]
    overflow_max: Option<u64>,

    /// Disk cache types: `on` writes through the host page cache, `off` uses O_DIRECT.
    #[arg(long, value_name = "on|off", value_parser = parse_on_off, default_value = "off", requires = "cache", action = clap::ArgAction::Set)]
    intermediate_buffering: bool,

    /// Disk cache types: how the cache file is read and written outside batches: `sync`
    /// (pread/pwrite; measured faster here) or `io_uring` (one ring per cache file, shared
    /// by the threads; falls back to `sync` where the kernel refuses io_uring). With O_DIRECT
    /// the whole-page reads and writes of a connection go to the file as one batch through
    /// the connection's own io_uring either way.
    #[arg(
        long,
        value_name = "sync|io_uring",
        default_value = "sync",
        requires = "cache"
    )]
    io_engine: vdstream_blockdev::IoEngineKind,

    /// Disk cache types with O_DIRECT: write zeros over each 2 MiB chunk of the cache file
    /// as it is preallocated, so that guest writes land on written blocks (no extent
    /// conversion per write; one sequential 2 MiB write per chunk, no extra space).
    #[arg(long, value_name = "on|off", value_parser = parse_on_off, default_value = "on", requires = "cache", action = clap::ArgAction::Set)]
    zero_fill: bool,

    /// Record every request clients send (offset, length, op, time) into this I/O trace
    /// file, for `vdstream size --trace FILE` (format: docs/AGENT.md).
    #[arg(long, value_name = "FILE")]
    pub record_trace: Option<PathBuf>,

    /// Worker threads per connection for devices that may sleep (files, disk caches): how
    /// many of one connection's requests run at once. A device that takes batches (an
    /// O_DIRECT disk cache) gets up to four batch runners per connection; 1 runs one batch at a time.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    threads: u16,

    /// Export name, besides the default empty name.
    #[arg(long, value_name = "EXPORT", default_value = "vdstream")]
    name: String,

    /// Seconds a client may take over each step of the handshake, the TLS handshake
    /// included, before it is dropped (a stalled or slow-loris client cannot hold a slot).
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    handshake_timeout: u64,

    /// Memory the requests of all connections together may hold (READ data waiting to be
    /// sent, WRITE payloads), e.g. 128M; at least 64M. When it is reached, the connections
    /// holding the most are not read until memory comes back, while clients with a few
    /// small requests in flight are still served. Default: 128M.
    #[arg(long, value_name = "SIZE", value_parser = crate::size::parse_size)]
    max_request_memory: Option<u64>,

    #[command(flatten)]
    tls: crate::tls_flags::TlsFlags,

    #[command(flatten)]
    penalty: crate::penalty_flags::PenaltyFlags,

    /// With TLS on, what a client without a verified certificate may do: `none` (the
    /// default: refused with NBD_REP_ERR_POLICY, saying to connect with a client
    /// certificate of the server's CA) or `all` (served like any other: the plaintext
    /// clients of --tls on, or every client of --tls-verify-peer false). With --tls off
    /// every client is served, so keep to a unix socket or loopback.
    #[arg(long, value_name = "none|all", default_value = "none", value_parser = ["none", "all"])]
    anonymous: String,

    /// With TLS on, serve only clients whose verified certificate carries NAME: its
    /// subject's common name (CN=NAME) or a DNS, URI or e-mail subject alternative name.
    /// Repeatable (any one of them will do). Without it, any certificate the CA signed is
    /// served, as by nbdkit and qemu-nbd (this is qemu-nbd's --tls-authz). Others are
    /// refused with NBD_REP_ERR_POLICY naming the certificate. Clients without a
    /// certificate are --anonymous's. Example: --tls-allow-name t1 --tls-allow-name backup.lab
    #[arg(long, value_name = "NAME")]
    tls_allow_name: Vec<String>,
}

/// One device, offered under the default name and under its own name.
#[derive(Debug)]
struct SingleExport {
    name: String,
    description: String,
    dev: Arc<dyn BlockDev>,
    /// For a maintenance version or a private vDisk: the writer slot of the one connection
    /// allowed, held by its device.
    one_writer: Option<WriterSlots>,
    /// TLS is on and `--anonymous none`: a client without a verified certificate is refused.
    refuse_anonymous: bool,
}

impl SingleExport {
    fn new(name: String, description: String, dev: Arc<dyn BlockDev>, one_writer: bool) -> Self {
        SingleExport {
            name,
            description,
            dev,
            one_writer: one_writer.then(WriterSlots::default),
            refuse_anonymous: false,
        }
    }
}

impl Exports for SingleExport {
    fn list(&self) -> Vec<ExportInfo> {
        vec![ExportInfo {
            name: self.name.clone(),
            description: self.description.clone(),
        }]
    }

    fn description(&self, name: &str) -> Option<String> {
        (name.is_empty() || name == self.name).then(|| self.description.clone())
    }

    /// A one-writer export is held by its connection alone, so it offers no multi-conn.
    fn open_export(&self, req: &OpenRequest<'_>) -> Result<OpenedExport, OpenError> {
        if self.refuse_anonymous && *req.client == vdstream_contract::Identity::Anonymous {
            return Err(OpenError::Policy(format!(
                "{} is not served to clients without a verified certificate: connect over TLS with a client \
                 certificate of this server's CA (e.g. nbds://HOST:PORT/?tls-certificates=DIR holding client-cert.pem), \
                 or start serve-image with --anonymous all",
                self.description
            )));
        }
        let device = self.open(req.name)?;
        Ok(OpenedExport {
            device,
            description: self.description(req.name),
            exclusive: self.one_writer.is_some(),
            close: None,
        })
    }

    fn open(&self, name: &str) -> Result<Arc<dyn BlockDev>, OpenError> {
        if name.is_empty() || name == self.name {
            let Some(slots) = &self.one_writer else {
                return Ok(self.dev.clone());
            };
            let slot = slots.take(&self.name, || "a connection".into()).map_err(|_| {
                OpenError::Busy(format!(
                "{} takes one writer connection at a time and one is connected; disconnect it first", self.description))
            })?;
            Ok(Arc::new(SlotDev::new(self.dev.clone(), slot)))
        } else {
            Err(OpenError::Unknown(format!(
                "no export named {name:?}: this server offers {:?} (or the default empty name)",
                self.name
            )))
        }
    }
}

pub fn run(args: ServeImageArgs) -> Result<()> {
    // Checked first: nothing is opened for a server that will not start.
    let tls = args.tls.tls != vdstream_nbd::TlsMode::Off;
    if let Some(addr) = args
        .listen
        .filter(|a| !tls && !args.insecure && !vdstream_server::config::is_loopback(a))
    {
        let e = vdstream_server::config::InsecureListen { what: "NBD", addr };
        return Err(crate::exit::fail(
            crate::exit::Kind::Insecure,
            e.to_string(),
        ));
    }
    if args.read_only && args.memory.is_some() {
        usage!("--read-only with --memory would serve a disk of zeros; drop --read-only");
    }
    let mut opened_layer = None;
    let (dev, description): (Arc<dyn BlockDev>, String) = match (&args.file, args.memory) {
        _ if args.vdisk.is_some() => {
            let opened = open_vdisk(&args)?;
            let d = format!(
                "{} of vDisk {} ({})",
                opened.layer,
                opened.vdisk,
                opened.path.display()
            );
            let dev = opened.dev.clone();
            opened_layer = Some(opened);
            (dev, d)
        }
        (_, Some(size)) => {
            if size == 0 {
                usage!("--memory must be larger than 0 (e.g. --memory 1G)");
            }
            (
                Arc::new(MemoryDev::new(size)),
                format!("RAM disk of {}", format_size(size)),
            )
        }
        (Some(path), None) => {
            // Under a cache the image is the read-only vDisk; only `private` writes to it.
            let read_only = args.read_only || args.cache.is_some_and(|c| c != CacheType::Private);
            open_image(path, args.format, read_only, args.direct)?
        }
        (None, None) => usage!("give an image FILE or --memory SIZE"),
    };
    let mut cache_in_use = None;
    let (dev, description) = match args.cache {
        None => (dev, description),
        Some(kind) => {
            let cfg = CacheConfig {
                target: args.name.clone(),
                ram: match args.ram {
                    Some(ram) => {
                        check_ram_fits_here(kind, ram)?;
                        ram
                    }
                    None => DEFAULT_RAM,
                },
                dir: cache_dir(&args, kind)?,
                max_file: args.overflow_max,
                intermediate_buffering: args.intermediate_buffering,
                io_engine: args.io_engine,
                zero_fill: args.zero_fill,
                overflow_device: None,
                lock_path: args
                    .file
                    .clone()
                    .or_else(|| opened_layer.as_ref().map(|o| o.path.clone())),
            };
            let rule = if args.overflow_dir.is_some() {
                DirRule::ParentMustExist
            } else {
                DirRule::CreateAll
            };
            if let Some(warning) =
                space::check_cache_room(kind, &cfg, rule, dev.size(), args.allow_low_space)?
            {
                log::warn!("{warning}");
            }
            let cache = vdstream_wcache::open(kind, dev, &cfg)
                .with_context(|| format!("cannot open the {kind} write cache"))?;
            cache_in_use = Some((cache.clone(), cfg));
            let dev: Arc<dyn BlockDev> = cache;
            (dev, format!("{description} through a {kind} write cache"))
        }
    };
    let trace = match &args.record_trace {
        None => None,
        Some(path) => Some(Arc::new(
            vdstream_blockdev::TraceDev::create(dev.clone(), path)
                .with_context(|| "cannot record the I/O trace (--record-trace)")?,
        )),
    };
    let dev: Arc<dyn BlockDev> = match &trace {
        Some(t) => t.clone(),
        None => dev,
    };
    let size = dev.size();
    let one_writer = opened_layer.as_ref().is_some_and(|o| o.writable);
    let tls = args.tls.server()?;
    let tls_on = tls.is_some();
    let anonymous_all = args.anonymous == "all";
    if tls_on && !args.tls.tls_verify_peer && !anonymous_all {
        anyhow::bail!("--tls-verify-peer false makes every TLS client anonymous, and --anonymous none (the default) refuses anonymous clients: add --anonymous all to serve them");
    }
    let verifies_certificates = tls_on && args.tls.tls_verify_peer;
    if !verifies_certificates && !args.tls_allow_name.is_empty() {
        usage!("--tls-allow-name narrows the client certificates TLS verifies: it needs --tls on|require with --tls-certificates DIR (and --tls-verify-peer true)");
    }
    if let Some(bad) = args
        .tls_allow_name
        .iter()
        .find(|n| n.is_empty() || n.chars().any(|c| c.is_control()))
    {
        usage!("--tls-allow-name {bad:?}: give a certificate's common name or subject alternative name, e.g. --tls-allow-name t1");
    }
    let mut exports = SingleExport::new(args.name.clone(), description.clone(), dev, one_writer);
    exports.refuse_anonymous = tls_on && !anonymous_all;
    let exports = Arc::new(exports);

    let scheme = if tls_on { "nbds" } else { "nbd" };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the I/O runtime")?;
    runtime.block_on(async move {
        let config = ServerConfig {
            threads_per_connection: args.threads as usize,
            handshake_timeout: std::time::Duration::from_secs(args.handshake_timeout),
            max_request_memory: vdstream_nbd::memory::limit(args.max_request_memory)?,
            tls,
            tls_mode: args.tls.tls,
            penalty: args.penalty.config(None, None)?,
            tls_allow_names: args.tls_allow_name.clone(),
            ..ServerConfig::default()
        };
        if config.tls.is_some() {
            outln!("vdstream: {}", args.tls.describe());
            if !config.tls_allow_names.is_empty() {
                outln!("vdstream: client certificates served: those naming {} (--tls-allow-name)", config.tls_allow_names.join(", "));
            }
        }
        if args.listen.is_some() {
            log::info!("NBD: {} (--handshake-penalty)", config.penalty.describe());
        }
        let server = Arc::new(Server::new(exports, config));
        let (trigger, shutdown) = ShutdownSignal::new();
        let socket = match (&args.socket, &args.listen) {
            (None, None) => Some(PathBuf::from(DEFAULT_SOCKET)),
            (s, _) => s.clone(),
        };
        let mut tasks = Vec::new();
        if let Some(path) = &socket {
            let listener = bind_unix(path)?;
            outln!(
                "vdstream: serving {description} ({size} bytes) as export {:?} on {scheme}+unix:///{}?socket={}",
                args.name,
                args.name,
                path.display()
            );
            outln!("vdstream: try: nbdinfo '{scheme}+unix:///?socket={}{}'", path.display(), if tls_on { "&tls-certificates=DIR" } else { "" });
            let (server, shutdown) = (server.clone(), shutdown.clone());
            tasks.push(tokio::spawn(async move { server.serve(Listener::Unix(listener), shutdown).await }));
        }
        if let Some(addr) = args.listen {
            let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}: is another server using that port?"))?;
            outln!("vdstream: serving {description} ({size} bytes) as export {:?} on {scheme}://{addr}/{}", args.name, args.name);
            let (server, shutdown) = (server.clone(), shutdown.clone());
            tasks.push(tokio::spawn(async move { server.serve(Listener::Tcp(listener), shutdown).await }));
        }
        vdstream_agent::service::wait_for_signal().await?;
        log::info!("shutting down: finishing requests in flight");
        trigger.shutdown();
        for task in tasks {
            task.await.context("server task panicked")?.context("server failed")?;
        }
        if let Some(path) = &socket {
            let _ = std::fs::remove_file(path);
        }
        log::info!("all sessions drained; bye");
        if let Some((cache, cfg)) = cache_in_use {
            outln!("vdstream: {}", cache_summary(&*cache, &cfg));
        }
        report_trace(trace.map(|t| (t.trace_path().to_path_buf(), t.finish())))?;
        // The layer's files stay locked (in use) until here.
        drop(opened_layer);
        Ok(())
    })
}

/// Opens FILE as raw or as qcow2 with its backing chain (read-only layers below the top).
fn open_image(
    named: &Path,
    format: FormatChoice,
    read_only: bool,
    direct: bool,
) -> Result<(Arc<dyn BlockDev>, String)> {
    let resolved = vdstream_blockdev::storefile::resolve_named(named)
        .with_context(|| format!("cannot serve {}", named.display()))?;
    let path = resolved.as_path();
    let qcow2 = match format {
        FormatChoice::Raw => false,
        FormatChoice::Qcow2 => true,
        FormatChoice::Auto => {
            vdstream_qcow2::probe_named(path)
                .with_context(|| format!("cannot serve {}", named.display()))?
                == ImageFormat::Qcow2
        }
    };
    if !qcow2 {
        let dev = FileDev::open(path, FileOptions { read_only, direct })
            .with_context(|| format!("cannot serve {}", path.display()))?;
        return Ok((Arc::new(dev), format!("raw image {}", path.display())));
    }
    if direct {
        usage!("--direct is for raw images; {} is qcow2: drop --direct (or serve it with --format raw)", path.display());
    }
    let dev: Arc<dyn BlockDev> = if read_only {
        open_chain(path).with_context(|| format!("cannot serve {}", path.display()))?
    } else {
        let options = OpenOptions {
            read_only: false,
            ..Default::default()
        };
        Arc::new(
            Qcow2Image::open_with_backing_chain(path, options)
                .with_context(|| format!("cannot serve {}", path.display()))?,
        )
    };
    Ok((
        dev,
        format!("qcow2 image {} with its backing chain", path.display()),
    ))
}

/// Opens the layer `--vdisk NAME[@V]` picks and says which one it is.
/// Where the cache's file goes: `--overflow-dir`; else, for the server-side types of a
/// store vDisk, the store's `cache/` folder (kept with the store, one file per target);
/// else the temporary directory.
fn cache_dir(args: &ServeImageArgs, kind: CacheType) -> Result<PathBuf> {
    if let Some(dir) = &args.overflow_dir {
        return Ok(dir.clone());
    }
    if args.vdisk.is_some() && matches!(kind, CacheType::Server | CacheType::ServerPersistent) {
        return Ok(vdstream_store::server_cache_dir(
            &vdstream_store::store_dir(args.store.as_deref()),
        )?);
    }
    Ok(std::env::temp_dir())
}

fn open_vdisk(args: &ServeImageArgs) -> Result<vdstream_store::OpenedLayer> {
    use vdstream_store::{Access, DiskAccess, Selector, Store};
    let reference = args.vdisk.as_deref().expect("--vdisk");
    let (name, sel) = vdstream_store::names::parse_ref(reference, Selector::Production)?;
    let store = Store::open(vdstream_store::store_dir(args.store.as_deref()))?;
    let writable = !args.read_only && args.cache.is_none();
    let opened = store.open_layer(&name, sel, writable)?;
    let private = opened.meta.access == DiskAccess::Private;
    if args.cache.is_some() && (private || opened.access == Some(Access::Maintenance)) {
        usage!(
            "{} of vDisk {name} is written directly by one target ({}); drop --cache",
            opened.layer,
            if private {
                "private access"
            } else {
                "maintenance version"
            }
        );
    }
    if args.cache == Some(CacheType::Private) {
        usage!("vDisk {name} has standard access: its layers are read-only to targets; use another --cache type, \
               or serve {name}@maintenance to write a new version");
    }
    let access = match (private, opened.access) {
        (true, _) => "private access".to_string(),
        (false, Some(a)) => a.name().to_string(),
        (false, None) => "base".to_string(),
    };
    outln!(
        "vdstream: vDisk {name}: {} ({access}) chosen for {reference:?}, file {}, {}",
        opened.layer,
        opened.path.display(),
        if opened.writable {
            "read-write (one writer)"
        } else {
            "read-only"
        }
    );
    Ok(opened)
}

/// Says where the I/O trace went and how many requests it holds, once it is written out.
pub(crate) fn report_trace(
    trace: Option<(PathBuf, Result<u64, vdstream_blockdev::TraceError>)>,
) -> Result<()> {
    if let Some((path, written)) = trace {
        let n = written.context("the I/O trace is incomplete")?;
        outln!(
            "vdstream: recorded {n} requests in {} (replay: vdstream size --trace {})",
            path.display(),
            path.display()
        );
    }
    Ok(())
}

/// One line on what the guest asked for against what reached storage, and how full the
/// cache is against what it can really hold (its limit, or less when its file system has
/// less room).
fn cache_summary(cache: &dyn WriteCache, cfg: &CacheConfig) -> String {
    let s = cache.stats();
    let cap = Capacity::of(
        cache.cache_type(),
        cfg.ram,
        cfg.max_file,
        &cfg.dir,
        cache.size(),
        &s,
    );
    format!(
        "{} cache: guest {} reads and {} writes; storage {} reads and {} writes \
         ({} vDisk reads, {} overflow-file writes, {} cache-file writes); {} evictions; \
         {} writes refused for lack of space; RAM in use {}, file in use {}; {:.1}% used of {} (limit {}{})",
        cache.cache_type(),
        s.guest_read_ops,
        s.guest_write_ops,
        s.vdisk_read_ops + s.overflow_read_ops + s.disk_read_ops,
        s.storage_write_ops(),
        s.vdisk_read_ops,
        s.overflow_write_ops,
        s.disk_write_ops,
        s.evictions,
        s.nospace_errors,
        format_size(s.ram_bytes),
        format_size(s.file_bytes),
        cap.used_percent(),
        format_size(cap.capacity),
        format_size(cap.limit),
        cap.fs_free.map_or(String::new(), |f| format!(", {} free on the file system of {}", format_size(f), cfg.dir.display())),
    )
}

/// Binds a unix socket, removing a stale socket file left by a process that died, but
/// refusing to steal a socket some live server still answers on.
fn bind_unix(path: &Path) -> Result<tokio::net::UnixListener> {
    use vdstream_nbd::listen::BindError;
    match vdstream_nbd::listen::bind_unix(path) {
        Ok(l) => Ok(l),
        Err(e @ BindError::NotASocket(_)) => conflict!("{e}: choose another --socket path"),
        Err(e @ BindError::InUse(_)) => conflict!("{e}: stop it or choose another --socket path"),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the flag tests (main.rs) read of the parsed flags.
    impl ServeImageArgs {
        /// Whether disk cache types write through the host page cache.
        pub fn intermediate_buffering(&self) -> bool {
            self.intermediate_buffering
        }

        /// The engine asked for the disk cache types' cache file.
        pub fn io_engine(&self) -> vdstream_blockdev::IoEngineKind {
            self.io_engine
        }
    }

    #[test]
    fn cache_summary_counts_guest_and_storage_io() {
        let base: Arc<dyn BlockDev> = Arc::new(MemoryDev::new(1 << 20));
        let cfg = CacheConfig {
            ram: 64 << 10,
            ..CacheConfig::new("t1")
        };
        let cache = vdstream_wcache::open(CacheType::DeviceRam, base, &cfg).unwrap();
        cache.write_at(&[7u8; 4096], 0, false).unwrap();
        cache.write_at(&[8u8; 4096], 4096, false).unwrap();
        let mut buf = [0u8; 4096];
        cache.read_at(&mut buf, 8192).unwrap();
        let line = cache_summary(&*cache, &cfg);
        assert!(
            line.starts_with("device-ram cache: guest 1 reads and 2 writes"),
            "{line}"
        );
        assert!(line.contains("1 vDisk reads"), "{line}");
        assert!(line.contains("RAM in use 8 KiB"), "{line}");
        // Against its 64 KiB of RAM, not the 1 MiB vDisk.
        assert!(line.contains("12.5% used of 64 KiB"), "{line}");
    }
}
