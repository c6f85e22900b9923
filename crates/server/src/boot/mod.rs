//! The boot service of `vdstream server --boot`: what a PXE-booting machine is told. This
//! module makes the iPXE scripts and the kernel command line (pure text from a record and
//! the address the machine used); http/boot.rs serves them with the kernel and initrd
//! ([`files`]), and [`tftp`] hands legacy PXE ROMs an iPXE binary.
//!
//! ```text
//!   PXE ROM ──DHCP──▶ TFTP undionly.kpxe / ipxe.efi (tftp.rs, --tftp)
//!   iPXE ──DHCP (user-class iPXE)──▶ GET /boot/ipxe ──▶ chain /boot/target/${net0/mac:hexhyp}
//!        ──▶ kernel /boot/vdisk/NAME/V/vmlinuz + cmdline, initrd /boot/vdisk/NAME/V/initrd.img, boot
//! ```
//!
//! Invariants:
//! - Every text put into a script is either checked by the store's rules (ids, vDisk names,
//!   host names, overflow devices, MACs) or passed through [`ipxe_text`], so no record or
//!   error message can add an iPXE command or expand a `${setting}`.
//! - The server is named by the address the machine used (its request's `Host`), or by
//!   `--boot-advertise`; never by a guess from the listening socket.
//! - The kernel command line carries exactly the `vdstream.*` parameters of
//!   `vdstream_boot::cmdline`, for the version the record resolves to when the script is
//!   made, so kernel, initrd and root come from one version.

pub mod files;
pub mod tftp;

use std::net::SocketAddr;
use std::path::PathBuf;

use sha2::{Digest, Sha256};
use vdstream_store::{Layer, TargetRecord};

/// What happens when a machine whose MAC no record has asks for its script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnknownMac {
    /// A script that prints on the console how to add the machine, then retries; the
    /// server logs the MAC (rate-limited).
    Refuse,
    /// PVS's auto-add: a new record, a copy of record `template`, id `PREFIX-NNN` (at most
    /// [`MAX_AUTO_ADDED`] of them).
    AutoAdd { template: String, prefix: String },
}

/// `--boot` and its settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootConfig {
    /// `--boot-advertise HOST[:PORT]`: how targets reach this server (default: the `Host`
    /// of their request). Without a port, the API's.
    pub advertise: Option<String>,
    /// `--boot-server URL`: other servers of the store, after this one, for failover.
    pub servers: Vec<String>,
    pub unknown: UnknownMac,
    /// `--boot-kernel-args`: kernel arguments before the `vdstream.*` ones.
    pub kernel_args: String,
    /// `--boot-ipxe DIR`: the iPXE binaries TFTP serves.
    pub ipxe_dir: PathBuf,
    /// `--tftp ADDR`: serve them over TFTP here.
    pub tftp: Option<SocketAddr>,
    /// Seconds a refused or failed machine waits before it asks again.
    pub retry_secs: u64,
}

/// Records auto-add makes under one prefix, at most: past it unknown machines are refused
/// (a flood of forged MACs cannot fill the store).
pub const MAX_AUTO_ADDED: usize = 1000;

/// Where Debian's `ipxe` package puts its binaries.
pub const DEFAULT_IPXE_DIR: &str = "/usr/lib/ipxe";

/// Default `--boot-kernel-args`: the kernel's console on the first serial port too.
pub const DEFAULT_KERNEL_ARGS: &str = "console=tty0 console=ttyS0";

impl Default for BootConfig {
    fn default() -> Self {
        BootConfig {
            advertise: None,
            servers: Vec::new(),
            unknown: UnknownMac::Refuse,
            kernel_args: DEFAULT_KERNEL_ARGS.into(),
            ipxe_dir: PathBuf::from(DEFAULT_IPXE_DIR),
            tftp: None,
            retry_secs: 30,
        }
    }
}

/// A target's machine-id: the first 32 hex digits of SHA-256("vdstream machine-id " + id),
/// stable for an id and different between ids (systemd's format: 128 bits, lowercase hex).
pub fn machine_id(id: &str) -> String {
    let digest = Sha256::digest(format!("vdstream machine-id {id}").as_bytes());
    digest.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// The version part of `NAME@V` and of the boot URLs: `base` or the number.
pub fn version_text(layer: Layer) -> String {
    match layer {
        Layer::Base => "base".into(),
        Layer::Version(n) => n.to_string(),
    }
}

/// Reads the version part of a boot URL (`base` or a number of at least 1).
pub fn parse_version(text: &str) -> Option<Layer> {
    match text {
        "base" => Some(Layer::Base),
        t => t.parse::<u32>().ok().filter(|n| *n > 0 && !t.starts_with('0')).map(Layer::Version),
    }
}

/// A size for `vdstream.ram=`: `NM` when whole MiB, else bytes.
fn size_text(bytes: u64) -> String {
    if bytes % (1 << 20) == 0 { format!("{}M", bytes >> 20) } else { bytes.to_string() }
}

/// Whether a `Host` field (or `--boot-advertise`) can name this server in a URL: a host
/// name, IPv4 or bracketed IPv6, with an optional port; nothing that could end the URL.
pub fn host_ok(host: &str) -> bool {
    !host.is_empty() && host.len() <= 255 && host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b))
}

/// Text that an iPXE script may print: printable ASCII without `$` (setting expansion),
/// `|`, `&` (command chaining) and quotes; anything else becomes a space. At most 400
/// characters.
pub fn ipxe_text(text: &str) -> String {
    text.chars().take(400).map(|c| if c.is_ascii_graphic() && !"$|&\"'\\{}".contains(c) || c == ' ' { c } else { ' ' }).collect()
}

/// What a target's script needs besides its record.
#[derive(Debug, Clone)]
pub struct ScriptContext<'a> {
    /// This server's base URL as the target reaches it (`http://HOST:PORT`).
    pub base: &'a str,
    pub config: &'a BootConfig,
    /// The MAC the target asked with (normalised).
    pub mac: &'a str,
}

/// The kernel command line of target `r` booting `layer` of its vDisk.
pub fn cmdline(r: &TargetRecord, layer: Layer, cx: &ScriptContext<'_>) -> String {
    let mut args: Vec<String> = Vec::new();
    if !cx.config.kernel_args.is_empty() {
        args.push(cx.config.kernel_args.clone());
    }
    // The EFI stub finds the initrd by this name (iPXE names it after the URL's last part).
    args.push("initrd=initrd.img".into());
    args.push(format!("vdstream.target={}", r.id));
    args.push(format!("vdstream.server={}", cx.base));
    for s in &cx.config.servers {
        if s != cx.base {
            args.push(format!("vdstream.server={s}"));
        }
    }
    args.push(format!("vdstream.vdisk={}@{}", r.vdisk, version_text(layer)));
    args.push(format!("vdstream.cache={}", r.cache.name()));
    if let Some(ram) = r.ram {
        args.push(format!("vdstream.ram={}", size_text(ram)));
    }
    if let Some(d) = &r.overflow_device {
        args.push(format!("vdstream.overflow={d}"));
    }
    args.push(format!("vdstream.hostname={}", r.hostname.as_deref().unwrap_or(&r.id)));
    args.push(format!("vdstream.machine_id={}", machine_id(&r.id)));
    ipxe_text(&args.join(" ")).replace("  ", " ")
}

/// `GET /boot/ipxe`: the first script, which asks for the machine's own by its MAC.
pub fn first_script(base: &str, server: &str) -> String {
    format!(
        "#!ipxe\n# vdstream boot service of server {}\necho vdstream: asking {base} for the script of ${{net0/mac}}\nchain --replace --autofree {base}/boot/target/${{net0/mac:hexhyp}}\n",
        ipxe_text(server)
    )
}

/// The files of a version, as the target fetches them.
pub fn file_url(base: &str, vdisk: &str, layer: Layer, file: &str) -> String {
    format!("{base}/boot/vdisk/{vdisk}/{}/{file}", version_text(layer))
}

/// `GET /boot/target/MAC`: a known target's script: its kernel with the command line, its
/// initrd, boot; when a fetch fails, the server says why ([`problem_script`]).
pub fn target_script(r: &TargetRecord, layer: Layer, cx: &ScriptContext<'_>) -> String {
    let (base, v) = (cx.base, version_text(layer));
    format!(
        "#!ipxe\n# vdstream: target {id}, MAC {mac}, vDisk {vdisk}@{v}\n\
         echo vdstream: target {id} boots vDisk {vdisk}@{v} ({cache})\n\
         kernel {kernel} {cmdline} || goto failed\n\
         initrd {initrd} || goto failed\n\
         boot || goto failed\n\
         :failed\n\
         chain --replace --autofree {base}/boot/vdisk/{vdisk}/{v}/problem\n",
        id = r.id,
        mac = cx.mac,
        vdisk = r.vdisk,
        cache = r.cache.name(),
        kernel = file_url(base, &r.vdisk, layer, "vmlinuz"),
        initrd = file_url(base, &r.vdisk, layer, "initrd.img"),
        cmdline = cmdline(r, layer, cx),
    )
}

/// Console columns a message line may take after `vdstream: ` (a PXE console is 80 wide).
const MESSAGE_WIDTH: usize = 68;

/// `text` cut at spaces into lines of at most [`MESSAGE_WIDTH`] characters (a longer word
/// stands alone); the leading spaces of `text` start every line.
fn wrap(text: &str) -> Vec<String> {
    let indent = &text[..text.len() - text.trim_start().len()];
    let mut out: Vec<String> = Vec::new();
    let mut line = String::from(indent);
    for word in text.split_whitespace() {
        if line.trim().is_empty() || line.len() + 1 + word.len() <= MESSAGE_WIDTH {
            if !line.trim().is_empty() {
                line.push(' ');
            }
            line.push_str(word);
        } else {
            out.push(std::mem::replace(&mut line, format!("{indent}{word}")));
        }
    }
    out.push(line);
    out
}

/// A script that prints `lines` on the machine's console (wrapped to fit 80 columns),
/// waits `retry_secs` and starts over at `/boot/ipxe`.
pub fn message_script(base: &str, lines: &[String], retry_secs: u64) -> String {
    let mut s = String::from("#!ipxe\n");
    for l in lines.iter().flat_map(|l| wrap(&ipxe_text(l))) {
        s.push_str(&format!("echo vdstream: {l}\n"));
    }
    s.push_str(&format!("echo vdstream: trying again in {retry_secs} seconds\nsleep {retry_secs}\nchain --replace --autofree {base}/boot/ipxe\n"));
    s
}

/// What an unknown machine is told (`--boot-unknown refuse`).
pub fn refusal_lines(mac: &str, server: &str) -> Vec<String> {
    vec![
        format!("no target record has MAC {mac} (server {server})."),
        "to boot this machine from a vDisk, run on the server:".into(),
        format!("  vdstream target add ID --mac {mac}"),
        "      --vdisk NAME --cache ram-overflow --ram 1G".into(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn machine_ids_are_stable_hex_and_differ() {
        let a = machine_id("pc-07");
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(a, machine_id("pc-07"));
        assert_ne!(a, machine_id("pc-08"));
        // sha256("vdstream machine-id pc-07"), by `printf %s 'vdstream machine-id pc-07' | sha256sum`.
        assert_eq!(a, EXPECTED_PC07);
    }

    const EXPECTED_PC07: &str = "b85868ba5e75f7230b74731f21c428d3";

    #[test]
    fn messages_fit_a_pxe_console() {
        let long = "vDisk win version 0 has no kernel: no kernel was found for it; install a kernel into the image (for Debian: linux-image-amd64) or set a boot-file override";
        let s = message_script("http://h:1", &[long.to_string(), "  indented words stay indented".into()], 30);
        for shown in s.lines().filter_map(|l| l.strip_prefix("echo ")) {
            assert!(shown.len() < 80, "{shown}");
        }
        let echoed: Vec<&str> = s.lines().filter_map(|l| l.strip_prefix("echo vdstream: ")).collect();
        assert_eq!(echoed[..echoed.len() - 2].join(" "), long, "every word, in order");
        assert_eq!(echoed[echoed.len() - 2], "  indented words stay indented");
        assert!(s.ends_with("sleep 30\nchain --replace --autofree http://h:1/boot/ipxe\n"), "{s}");
    }

    #[test]
    fn texts_cannot_add_commands() {
        assert_eq!(ipxe_text("a ${x} || reboot && b\n#c"), "a   x     reboot    b #c");
        assert!(host_ok("10.0.2.2:8480") && host_ok("[::1]:80") && host_ok("pvs1.lab"));
        assert!(!host_ok("a/b") && !host_ok("a b") && !host_ok("") && !host_ok("x${y}") && !host_ok("a?b"));
        assert_eq!(parse_version("base"), Some(Layer::Base));
        assert_eq!(parse_version("3"), Some(Layer::Version(3)));
        for bad in ["0", "03", "-1", "x", ""] {
            assert_eq!(parse_version(bad), None, "{bad}");
        }
    }
}
