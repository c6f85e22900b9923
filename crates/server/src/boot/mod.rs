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
pub mod pacing;
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
    /// `--max-booting`: machines in their boot window at once, at most (0: no limit).
    pub max_booting: usize,
    /// `--boot-window`: how long a machine keeps its place without saying it booted.
    pub boot_window: std::time::Duration,
}

/// Records auto-add makes under one prefix, at most: past it unknown machines are refused
/// (a flood of forged MACs cannot fill the store).
pub const MAX_AUTO_ADDED: usize = 1000;

/// Default `--max-booting` (docs/BENCHMARKS.md, "Boot pacing").
pub const DEFAULT_MAX_BOOTING: usize = 50;

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
            max_booting: DEFAULT_MAX_BOOTING,
            boot_window: pacing::DEFAULT_WINDOW,
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
        t => t
            .parse::<u32>()
            .ok()
            .filter(|n| *n > 0 && !t.starts_with('0'))
            .map(Layer::Version),
    }
}

/// A size for `vdstream.ram=`: `NM` when whole MiB, else bytes.
fn size_text(bytes: u64) -> String {
    if bytes % (1 << 20) == 0 {
        format!("{}M", bytes >> 20)
    } else {
        bytes.to_string()
    }
}

/// Whether a `Host` field (or `--boot-advertise`) can name this server in a URL: a host
/// name, IPv4 or bracketed IPv6, with an optional port; nothing that could end the URL.
pub fn host_ok(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 255
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b))
}

/// Characters an iPXE script line must not carry: `$` and braces (setting expansion), `|`
/// and `&` (command chaining), quotes and backslashes.
const IPXE_SPECIAL: &str = "$|&\"'\\{}";

/// `text` as an iPXE script line may carry it: printable ASCII without [`IPXE_SPECIAL`];
/// anything else becomes a space. Never cut.
fn ipxe_chars(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_ascii_graphic() && !IPXE_SPECIAL.contains(c) || c == ' ' {
                c
            } else {
                ' '
            }
        })
        .collect()
}

/// Text that an iPXE script may print ([`ipxe_chars`]), at most 400 characters.
pub fn ipxe_text(text: &str) -> String {
    ipxe_chars(&text.chars().take(400).collect::<String>())
}

/// The longest kernel command line (x86's `COMMAND_LINE_SIZE`, bytes with the final NUL).
pub const KERNEL_CMDLINE_MAX: usize = 2048;

/// A value of the record that goes into the kernel command line as one parameter's value:
/// one word of characters an iPXE line carries as they are (a space would start another
/// parameter, as `init=/bin/sh`; a record file edited by hand is not checked otherwise).
fn one_word(r: &TargetRecord, what: &str, v: &str) -> Result<(), String> {
    if v.is_empty()
        || v.chars()
            .any(|c| !c.is_ascii_graphic() || IPXE_SPECIAL.contains(c))
    {
        return Err(format!("target {}'s record has a {what} the kernel command line cannot carry ({:?}): correct it with vdstream target set {} --{what} VALUE", ipxe_chars(&r.id), ipxe_chars(v), ipxe_chars(&r.id)));
    }
    Ok(())
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

/// The kernel command line of target `r` booting `layer` of its vDisk, whole or not at all:
/// `Err` says why (a record value that is not one word, or a line longer than the
/// kernel takes), for the machine's console. Never cut: a cut parameter could name
/// another disk as the overflow device.
pub fn cmdline(r: &TargetRecord, layer: Layer, cx: &ScriptContext<'_>) -> Result<String, String> {
    one_word(r, "id", &r.id)?;
    one_word(r, "vdisk", &r.vdisk)?;
    if let Some(h) = &r.hostname {
        one_word(r, "hostname", h)?;
    }
    if let Some(d) = &r.overflow_device {
        one_word(r, "overflow-device", d)?;
    }
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
    args.push(format!(
        "vdstream.vdisk={}@{}",
        r.vdisk,
        version_text(layer)
    ));
    args.push(format!("vdstream.cache={}", r.cache.name()));
    if let Some(ram) = r.ram {
        args.push(format!("vdstream.ram={}", size_text(ram)));
    }
    if let Some(d) = &r.overflow_device {
        args.push(format!("vdstream.overflow={d}"));
    }
    args.push(format!(
        "vdstream.hostname={}",
        r.hostname.as_deref().unwrap_or(&r.id)
    ));
    args.push(format!("vdstream.machine_id={}", machine_id(&r.id)));
    let line = ipxe_chars(&args.join(" ")).replace("  ", " ");
    if line.len() >= KERNEL_CMDLINE_MAX {
        return Err(format!(
            "the kernel command line of target {} would be {} characters, more than the kernel takes ({}): shorten --boot-kernel-args or the --boot-server list",
            ipxe_chars(&r.id), line.len(), KERNEL_CMDLINE_MAX - 1
        ));
    }
    Ok(line)
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
    let cmdline = match cmdline(r, layer, cx) {
        Ok(line) => line,
        Err(why) => {
            log::warn!("boot: cannot boot target {} (MAC {}): {why}", r.id, cx.mac);
            return message_script(base, &[why], cx.config.retry_secs);
        }
    };
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
        cmdline = cmdline,
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

/// What a machine is told while every boot place is taken (`--max-booting`): how many
/// boot, how many wait ahead of it; then it waits `retry_secs` and asks for its own
/// script again (its place in the queue is kept while it keeps asking).
pub fn wait_script(
    base: &str,
    mac: &str,
    booting: usize,
    max: usize,
    ahead: usize,
    retry_secs: u64,
) -> String {
    format!(
        "#!ipxe\necho vdstream: waiting: {booting} booting (at most {max} at once), {ahead} waiting ahead of this machine\n\
         echo vdstream: asking again in {retry_secs} seconds\nsleep {retry_secs}\n\
         chain --replace --autofree {base}/boot/target/{mac}\n",
        mac = mac.replace(':', "-"),
    )
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
        assert!(a
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(a, machine_id("pc-07"));
        assert_ne!(a, machine_id("pc-08"));
        // sha256("vdstream machine-id pc-07"), by `printf %s 'vdstream machine-id pc-07' | sha256sum`.
        assert_eq!(a, EXPECTED_PC07);
    }

    const EXPECTED_PC07: &str = "b85868ba5e75f7230b74731f21c428d3";

    #[test]
    fn messages_fit_a_pxe_console() {
        let long = "vDisk win version 0 has no kernel: no kernel was found for it; install a kernel into the image (for Debian: linux-image-amd64) or set a boot-file override";
        let s = message_script(
            "http://h:1",
            &[long.to_string(), "  indented words stay indented".into()],
            30,
        );
        for shown in s.lines().filter_map(|l| l.strip_prefix("echo ")) {
            assert!(shown.len() < 80, "{shown}");
        }
        let echoed: Vec<&str> = s
            .lines()
            .filter_map(|l| l.strip_prefix("echo vdstream: "))
            .collect();
        assert_eq!(
            echoed[..echoed.len() - 2].join(" "),
            long,
            "every word, in order"
        );
        assert_eq!(echoed[echoed.len() - 2], "  indented words stay indented");
        assert!(
            s.ends_with("sleep 30\nchain --replace --autofree http://h:1/boot/ipxe\n"),
            "{s}"
        );
    }

    fn record(hostname: Option<&str>, overflow: Option<&str>) -> TargetRecord {
        let mut doc = serde_json::json!({
            "format": "vdstream-target", "format_version": 1, "id": "pc1", "vdisk": "lab", "version": "production",
            "cache": "ram-overflow", "macs": ["52:54:00:12:34:56"], "created": "2026-11-25T00:00:00Z", "created_by": "a",
            "updated": "2026-11-25T00:00:00Z", "updated_by": "a", "generation": 1
        });
        if let Some(h) = hostname {
            doc["hostname"] = h.into();
        }
        if let Some(d) = overflow {
            doc["overflow_device"] = d.into();
        }
        serde_json::from_value(doc).unwrap()
    }

    #[test]
    fn the_kernel_command_line_is_whole_or_refused() {
        let cfg = BootConfig::default();
        let cx = ScriptContext {
            base: "http://10.0.2.2:8480",
            config: &cfg,
            mac: "52:54:00:12:34:56",
        };
        // A long overflow device path is carried whole (a cut one could name another disk).
        let dev = "/dev/disk/by-id/ata-SAMSUNG_MZ7LN256HAJQ-000H1_S3TWNX0K123456-part12";
        let line = cmdline(
            &record(Some("lab-pc-01"), Some(dev)),
            Layer::Version(3),
            &cx,
        )
        .unwrap();
        assert!(
            line.contains(&format!("vdstream.overflow={dev} ")),
            "{line}"
        );
        assert!(
            line.contains("vdstream.hostname=lab-pc-01 vdstream.machine_id="),
            "{line}"
        );
        // More than the kernel takes: refused, not cut.
        let servers: Vec<String> = (0..40)
            .map(|i| format!("http://boot-server-number-{i}.lab.example:8480"))
            .collect();
        let many = BootConfig {
            servers,
            ..BootConfig::default()
        };
        let e = cmdline(
            &record(None, Some(dev)),
            Layer::Base,
            &ScriptContext {
                config: &many,
                ..cx.clone()
            },
        )
        .unwrap_err();
        assert!(e.contains("more than the kernel takes"), "{e}");
        let script = target_script(
            &record(None, None),
            Layer::Base,
            &ScriptContext {
                config: &many,
                ..cx.clone()
            },
        );
        assert!(
            !script.lines().any(|l| l.starts_with("kernel ")) && script.contains("echo vdstream:"),
            "{script}"
        );
        // A record edited by hand cannot add kernel parameters.
        for (h, d) in [
            (Some("x init=/bin/sh"), None),
            (None, Some("/dev/sda2 init=/bin/sh")),
            (Some(""), None),
        ] {
            let e = cmdline(&record(h, d), Layer::Base, &cx).unwrap_err();
            assert!(e.contains("cannot carry"), "{e}");
        }
    }

    #[test]
    fn texts_cannot_add_commands() {
        assert_eq!(
            ipxe_text("a ${x} || reboot && b\n#c"),
            "a   x     reboot    b #c"
        );
        assert!(host_ok("10.0.2.2:8480") && host_ok("[::1]:80") && host_ok("pvs1.lab"));
        assert!(
            !host_ok("a/b")
                && !host_ok("a b")
                && !host_ok("")
                && !host_ok("x${y}")
                && !host_ok("a?b")
        );
        assert_eq!(parse_version("base"), Some(Layer::Base));
        assert_eq!(parse_version("3"), Some(Layer::Version(3)));
        for bad in ["0", "03", "-1", "x", ""] {
            assert_eq!(parse_version(bad), None, "{bad}");
        }
    }
}
