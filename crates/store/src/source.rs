//! An image from outside the store, before `vdisk import` copies it in: what it is, decided
//! once from its own bytes, and the proof that it names nothing else.
//!
//! An image is data. A downloaded qcow2 can name a backing file (`/etc/shadow`, a
//! `json:{...}` spec, `nbd://host:port`), a VMDK descriptor can name flat extents anywhere
//! on the host, a VMDK sparse file can name a parent; `qemu-img` follows all of them when
//! it is left to probe. So, before any qemu-img runs:
//!
//! 1. The format is read off the file's own magic ([`detect`]) and recorded; qemu-img is
//!    never asked to probe.
//! 2. The image's metadata is read here for every name it holds ([`refuse_references`]):
//!    a qcow2 backing file or external data file, a VMDK descriptor (its extents are other
//!    files), a VMDK sparse file's parent or descriptor-only header, a differencing VHD or
//!    VHDX. Any of them refuses the import, naming what was named and how to import a
//!    chain instead (`--version`).
//! 3. qemu-img opens the file only through [`Source::qemu_spec`]: a `json:` spec that
//!    pins the format driver, pins the protocol to a local `file` at the resolved path, and
//!    turns backing files off (`"backing": null`) where the format has them.
//! 4. What `qemu-img info` then reports is checked again ([`Source::check_info`]): no
//!    backing file, and for VMDK no extent but the file itself.
//!
//! Formats qemu reads that vdstream does not import (qed, luks, parallels) are refused
//! by name rather than copied as raw bytes.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::error::{io, Result, StoreError};

/// What `--version` imports, for the messages that point there.
const CHAIN_ADVICE: &str = "to import a chain, import its base and give each child in order with --version \
    (`vdstream vdisk import NAME BASE --version CHILD ...`: qcow2 children of a raw or qcow2 base, \
    differencing VHDs of a .vhd, AVHDXs of a .vhdx), each child's parent checked to be the file before it; \
    or flatten a chain you trust first (`qemu-img convert -O qcow2 IMAGE flat.qcow2`)";

/// An image to import, resolved and identified.
#[derive(Debug, Clone)]
pub struct Source {
    /// The file, links resolved once (the path the administrator gave may be a link).
    pub path: PathBuf,
    /// qemu's name for the format: raw, qcow2, vhdx, vpc, vmdk, vdi.
    pub format: &'static str,
}

/// Resolves `path` (a regular file the administrator names), reads its format off its
/// magic and refuses it if its metadata names any other file.
pub fn inspect(path: &Path) -> Result<Source> {
    let resolved = std::fs::canonicalize(path).map_err(io("open", path))?;
    if !std::fs::metadata(&resolved).is_ok_and(|m| m.is_file()) {
        return Err(StoreError::BadInput(format!(
            "{} is not a file: give the path of a disk image to import",
            path.display()
        )));
    }
    let format = detect(&resolved)?;
    refuse_references(&resolved, format)?;
    Ok(Source {
        path: resolved,
        format,
    })
}

/// The format of the image at `path`, from its own bytes (qemu's magic numbers): qcow2,
/// vhdx, vpc (a VHD: its header cookie, or the footer alone of a fixed VHD), vmdk (sparse,
/// or a text descriptor), vdi; raw otherwise. Formats vdstream does not import are refused.
pub fn detect(path: &Path) -> Result<&'static str> {
    let f = std::fs::File::open(path).map_err(io("open", path))?;
    let len = f.metadata().map_err(io("stat", path))?.len();
    let mut head = vec![0u8; len.min(4096) as usize];
    f.read_exact_at(&mut head, 0).map_err(io("read", path))?;
    let at = |o: usize, m: &[u8]| head.get(o..o + m.len()) == Some(m);
    let unsupported = |what: &str| {
        Err(StoreError::BadInput(format!(
            "{} is a {what} image: vdstream imports raw, qcow2, vhdx, vpc (VHD), vmdk and vdi; convert it first (qemu-img convert -O qcow2)",
            path.display()
        )))
    };
    if at(0, b"QFI\xfb") {
        return Ok("qcow2");
    }
    if at(0, b"vhdxfile") {
        return Ok("vhdx");
    }
    if at(0, b"conectix") || has_vhd_footer(&f, len) {
        return Ok("vpc");
    }
    if at(0, b"KDMV") || at(0, b"COWD") || is_vmdk_descriptor(&head) {
        return Ok("vmdk");
    }
    if head.len() >= 0x44
        && u32::from_le_bytes(head[0x40..0x44].try_into().expect("4")) == 0xbeda_107f
    {
        return Ok("vdi");
    }
    if at(0, b"QED\0") {
        return unsupported("qed");
    }
    if at(0, b"LUKS\xba\xbe") {
        return unsupported("LUKS-encrypted");
    }
    if at(0, b"WithoutFreeSpace") || at(0, b"WithouFreSpacExt") {
        return unsupported("parallels");
    }
    Ok("raw")
}

/// Whether the last 512 bytes of the file are a VHD footer (cookie "conectix"): a fixed
/// VHD has its footer only at the end.
fn has_vhd_footer(f: &std::fs::File, len: u64) -> bool {
    let mut cookie = [0u8; 8];
    len >= 1024 && f.read_exact_at(&mut cookie, len - 512).is_ok() && &cookie == b"conectix"
}

/// Whether `head` is the start of a VMDK text descriptor (as qemu's probe decides: the
/// first line that is not blank or a comment is `version=N`).
fn is_vmdk_descriptor(head: &[u8]) -> bool {
    let text = String::from_utf8_lossy(head);
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .is_some_and(|l| {
            l.strip_prefix("version=")
                .is_some_and(|v| v.trim().parse::<u32>().is_ok())
        })
}

/// Refuses an image whose metadata names any other file (see the module doc).
pub fn refuse_references(path: &Path, format: &str) -> Result<()> {
    match format {
        "qcow2" => qcow2_references(path),
        "vmdk" => vmdk_references(path),
        "vpc" | "vhdx" => refuse_differencing(path),
        _ => Ok(()),
    }
}

fn names_another_file(path: &Path, what: String) -> StoreError {
    StoreError::BadInput(format!(
        "{} {what}: an imported image must stand alone, and vdstream opens no file an image names, so nothing was imported; {CHAIN_ADVICE}",
        path.display()
    ))
}

/// The header of the qcow2 image from outside at `path`, parsed (which refuses an external
/// data file: incompatible bit 2 or its extension).
pub(crate) fn qcow2_header(path: &Path) -> Result<vdstream_qcow2::Header> {
    let f = std::fs::File::open(path).map_err(io("open", path))?;
    let len = f.metadata().map_err(io("stat", path))?.len();
    let mut first = vec![0u8; len.min(vdstream_qcow2::header::HEADER_READ_LEN as u64) as usize];
    f.read_exact_at(&mut first, 0).map_err(io("read", path))?;
    vdstream_qcow2::Header::parse(&first, len).map_err(|e| StoreError::Corrupt {
        path: path.to_path_buf(),
        detail: format!("a damaged or unsupported qcow2 image: {e}"),
        advice: "nothing was imported; check it with `qemu-img check -f qcow2 FILE`".into(),
    })
}

fn qcow2_references(path: &Path) -> Result<()> {
    match qcow2_header(path)?.backing_file {
        Some(name) => Err(names_another_file(
            path,
            format!("is a qcow2 image whose header names backing file {name:?}"),
        )),
        None => Ok(()),
    }
}

/// A VMDK's header and descriptor: a text descriptor names its extents (other files); a
/// sparse file whose capacity is 0 is a descriptor that names them too; a sparse file's
/// embedded descriptor can name a parent (`parentFileNameHint`).
fn vmdk_references(path: &Path) -> Result<()> {
    let f = std::fs::File::open(path).map_err(io("open", path))?;
    let len = f.metadata().map_err(io("stat", path))?.len();
    let mut head = vec![0u8; len.min(512) as usize];
    f.read_exact_at(&mut head, 0).map_err(io("read", path))?;
    if head.starts_with(b"COWD") {
        return Err(StoreError::BadInput(format!(
            "{} is a VMDK3 (ESX 2 \"COWD\") sparse image, which vdstream does not import: convert it with VMware's tools or qemu-img convert -O qcow2 first",
            path.display()
        )));
    }
    if !head.starts_with(b"KDMV") {
        let mut text = vec![0u8; len.min(64 << 10) as usize];
        f.read_exact_at(&mut text, 0).map_err(io("read", path))?;
        let extents = descriptor_extents(&String::from_utf8_lossy(&text));
        return Err(StoreError::BadInput(format!(
            "{} is a VMDK descriptor: its disk is in other files it names ({}), which vdstream does not open; \
             import the disk itself: a monolithicFlat extent is a raw image (`vdstream vdisk import NAME DISK-flat.vmdk`), \
             or convert a VMDK you trust to one file first (`qemu-img convert -O qcow2 {} disk.qcow2`)",
            path.display(),
            if extents.is_empty() { "no extent line found".to_string() } else { extents.join(", ") },
            path.display()
        )));
    }
    if head.len() < 44 {
        return Err(StoreError::Corrupt {
            path: path.to_path_buf(),
            detail: "a VMDK sparse header shorter than 44 bytes".into(),
            advice: "nothing was imported".into(),
        });
    }
    let u64_at = |o: usize| u64::from_le_bytes(head[o..o + 8].try_into().expect("8"));
    let (capacity, desc_offset, desc_size) = (u64_at(12), u64_at(28), u64_at(36));
    if capacity == 0 {
        return Err(names_another_file(path, "is a VMDK sparse header with no data of its own (capacity 0): its descriptor names the files that hold the disk".into()));
    }
    if desc_offset > 0 && desc_size > 0 {
        let n = (desc_size.min(2048) * 512).min(len.saturating_sub(desc_offset * 512));
        let mut desc = vec![0u8; n as usize];
        f.read_exact_at(&mut desc, desc_offset * 512)
            .map_err(io("read", path))?;
        let text = String::from_utf8_lossy(&desc);
        for line in text.lines().map(str::trim) {
            if let Some(v) = line.strip_prefix("parentFileNameHint") {
                let name = v
                    .trim_start()
                    .trim_start_matches('=')
                    .trim()
                    .trim_matches('"');
                return Err(names_another_file(
                    path,
                    format!("is a VMDK delta disk whose descriptor names parent {name:?}"),
                ));
            }
        }
    }
    Ok(())
}

/// The file names a VMDK descriptor's extent lines give (`RW 8 FLAT "x-flat.vmdk" 0`).
fn descriptor_extents(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| {
            ["RW ", "RDONLY ", "NOACCESS "]
                .iter()
                .any(|p| l.starts_with(p))
        })
        .filter_map(|l| {
            let start = l.find('"')? + 1;
            let end = start + l[start..].find('"')?;
            Some(format!("{:?}", &l[start..end]))
        })
        .collect()
}

/// Refuses a differencing VHD or VHDX (an AVHDX): qemu cannot create them, and it reads a
/// differencing VHD as if it had no parent (only the child's own blocks, zeros
/// elsewhere), so converting one would import the wrong bytes. VHD disk type 4 in the
/// footer (a copy sits at offset 0 of dynamic and differencing files); for VHDX, qemu
/// refuses files with a parent itself, and this names the reason first.
pub fn refuse_differencing(src: &Path) -> Result<()> {
    use std::io::Read;
    let mut head = [0u8; 512];
    let n = std::fs::File::open(src)
        .and_then(|mut f| f.read(&mut head))
        .map_err(io("read", src))?;
    let advice = "qemu (which vdstream converts with) cannot read differencing images: import the chain with its base, \
        `vdstream vdisk import NAME BASE.vhd --version CHILD.vhd ...` (VHD) or \
        `vdstream vdisk import NAME BASE.vhdx --version CHILD.avhdx ...` (VHDX), children in chain order, \
        or merge the chain into its base first (Hyper-V: Merge-VHD; PVS: merge the versions into a new base)";
    if n >= 64
        && &head[..8] == b"conectix"
        && u32::from_be_bytes(head[60..64].try_into().expect("4")) == 4
    {
        return Err(StoreError::Refused(format!(
            "{} is a differencing VHD (a child of another VHD): {advice}",
            src.display()
        )));
    }
    let avhdx = src
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("avhdx"));
    if n >= 8 && &head[..8] == b"vhdxfile" && (avhdx || vhdx_has_parent(src)) {
        return Err(StoreError::Refused(format!(
            "{} is a differencing VHDX (AVHDX, a child of another VHDX): {advice}",
            src.display()
        )));
    }
    Ok(())
}

/// Whether a VHDX file's metadata says it has a parent (the HasParent bit of its File
/// Parameters item). Layout (MS-VHDX 2.2, 2.3): region table at 192 KiB, entries of 32
/// bytes (GUID, file offset, length) after a 16-byte header; the metadata region starts
/// with a 32-byte header ("metadata", entry count at 10) and 32-byte entries (item GUID,
/// offset within the region at 16); File Parameters' flags word has HasParent as bit 1.
fn vhdx_has_parent(src: &Path) -> bool {
    const METADATA_REGION: [u8; 16] = [
        0x06, 0xa2, 0x7c, 0x8b, 0x90, 0x47, 0x9a, 0x4b, 0xb8, 0xfe, 0x57, 0x5f, 0x05, 0x0f, 0x88,
        0x6e,
    ];
    const FILE_PARAMETERS: [u8; 16] = [
        0x37, 0x67, 0xa1, 0xca, 0x36, 0xfa, 0x43, 0x4d, 0xb3, 0xb6, 0x33, 0xf0, 0xaa, 0x44, 0xe7,
        0x6b,
    ];
    let Ok(f) = std::fs::File::open(src) else {
        return false;
    };
    let mut rt = vec![0u8; 64 << 10];
    if f.read_exact_at(&mut rt, 192 << 10).is_err() || &rt[..4] != b"regi" {
        return false;
    }
    let count = (u32::from_le_bytes(rt[8..12].try_into().expect("4")) as usize).min(2047);
    let Some(meta_off) = (0..count)
        .map(|i| &rt[16 + 32 * i..48 + 32 * i])
        .find(|e| e[..16] == METADATA_REGION)
        .map(|e| u64::from_le_bytes(e[16..24].try_into().expect("8")))
    else {
        return false;
    };
    let mut mt = vec![0u8; 64 << 10];
    if f.read_exact_at(&mut mt, meta_off).is_err() || &mt[..8] != b"metadata" {
        return false;
    }
    let entries = (u16::from_le_bytes(mt[10..12].try_into().expect("2")) as usize).min(2047);
    let Some(item_off) = (0..entries)
        .map(|i| &mt[32 + 32 * i..64 + 32 * i])
        .find(|e| e[..16] == FILE_PARAMETERS)
        .map(|e| u32::from_le_bytes(e[16..20].try_into().expect("4")) as u64)
    else {
        return false;
    };
    let mut fp = [0u8; 8];
    f.read_exact_at(&mut fp, meta_off + item_off).is_ok()
        && u32::from_le_bytes(fp[4..8].try_into().expect("4")) & 2 != 0
}

impl Source {
    /// How qemu-img must open this image: a `json:` spec with the format driver, a local
    /// `file` protocol at the resolved path, and no backing file where the format has one.
    pub fn qemu_spec(&self) -> String {
        let mut spec =
            json!({"driver": self.format, "file": {"driver": "file", "filename": self.path}});
        if matches!(self.format, "qcow2" | "vmdk") {
            spec["backing"] = Value::Null;
        }
        format!("json:{spec}")
    }

    /// Checks what `qemu-img info --output=json` said of the image opened through
    /// [`Source::qemu_spec`]: its format, no backing file, and (VMDK) no extent but itself.
    pub fn check_info(&self, info: &Value) -> Result<()> {
        if info["format"].as_str() != Some(self.format) {
            return Err(StoreError::Tool(format!(
                "qemu-img opened {} as {:?}, not as the {} it was told: nothing was imported",
                self.path.display(),
                info["format"],
                self.format
            )));
        }
        if let Some(b) = info.get("backing-filename").and_then(Value::as_str) {
            return Err(names_another_file(
                &self.path,
                format!("names backing file {b:?}"),
            ));
        }
        let me = self.path.display().to_string();
        if let Some(extents) = info["format-specific"]["data"]["extents"].as_array() {
            for e in extents {
                let name = e["filename"].as_str().unwrap_or_default();
                if name != me {
                    return Err(names_another_file(
                        &self.path,
                        format!("has an extent in {name:?}"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A qemu-img `json:` spec of a chain the store records (base first): each layer with its
/// recorded driver, over a local file, the qcow2 layers over the layer below and the
/// bottom one over nothing. What `vdisk export` and `vdisk check` hand to qemu-img, so that
/// it reads exactly the files the record names.
pub fn chain_spec(chain: &[vdstream_qcow2::LayerSpec]) -> String {
    let mut below: Option<Value> = None;
    for l in chain {
        let mut node =
            json!({"driver": l.format.name(), "file": {"driver": "file", "filename": l.path}});
        if l.format == vdstream_qcow2::ImageFormat::Qcow2 {
            node["backing"] = below.take().unwrap_or(Value::Null);
        }
        below = Some(node);
    }
    format!("json:{}", below.unwrap_or(Value::Null))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn formats_come_from_magic_and_foreign_ones_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut vdi = vec![0u8; 1024];
        vdi[0x40..0x44].copy_from_slice(&0xbeda_107fu32.to_le_bytes());
        let mut fixed_vhd = vec![0u8; 4096];
        fixed_vhd[4096 - 512..4096 - 504].copy_from_slice(b"conectix");
        for (bytes, want) in [
            (&b"QFI\xfb\0\0\0\x03"[..], "qcow2"),
            (b"vhdxfile", "vhdx"),
            (b"conectix", "vpc"),
            (&fixed_vhd[..], "vpc"),
            (b"KDMV\x01\0\0\0", "vmdk"),
            (b"# Disk DescriptorFile\nversion=1\nCID=fffffffe\n", "vmdk"),
            (&vdi[..], "vdi"),
            (&[0u8; 512][..], "raw"),
            (b"version is not a descriptor", "raw"),
        ] {
            assert_eq!(
                detect(&file(dir.path(), "x", bytes)).unwrap(),
                want,
                "{:?}",
                &bytes[..8.min(bytes.len())]
            );
        }
        let e = detect(&file(dir.path(), "q", b"QED\0...."))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is a qed image") && e.contains("qemu-img convert"),
            "{e}"
        );
    }

    #[test]
    fn vmdk_descriptors_and_parents_are_refused_naming_what_they_name() {
        let dir = tempfile::tempdir().unwrap();
        let d = file(dir.path(), "d.vmdk", b"# Disk DescriptorFile\nversion=1\ncreateType=\"monolithicFlat\"\nRW 8 FLAT \"/etc/shadow\" 0\n");
        let e = refuse_references(&d, "vmdk").unwrap_err().to_string();
        assert!(
            e.contains("is a VMDK descriptor")
                && e.contains("\"/etc/shadow\"")
                && e.contains("DISK-flat.vmdk"),
            "{e}"
        );

        let mut sparse = vec![0u8; 4096];
        sparse[..4].copy_from_slice(b"KDMV");
        sparse[12..20].copy_from_slice(&8u64.to_le_bytes());
        sparse[28..36].copy_from_slice(&1u64.to_le_bytes());
        sparse[36..44].copy_from_slice(&1u64.to_le_bytes());
        let desc = b"# Disk DescriptorFile\nversion=1\nparentCID=12345678\nparentFileNameHint=\"/srv/secret.vmdk\"\n";
        sparse[512..512 + desc.len()].copy_from_slice(desc);
        let s = file(dir.path(), "s.vmdk", &sparse);
        let e = refuse_references(&s, "vmdk").unwrap_err().to_string();
        assert!(
            e.contains("names parent \"/srv/secret.vmdk\"") && e.contains("--version"),
            "{e}"
        );

        sparse[12..20].copy_from_slice(&0u64.to_le_bytes());
        let s = file(dir.path(), "s0.vmdk", &sparse);
        let e = refuse_references(&s, "vmdk").unwrap_err().to_string();
        assert!(e.contains("capacity 0"), "{e}");
    }

    #[test]
    fn qemu_specs_pin_driver_protocol_and_backing() {
        let src = Source {
            path: PathBuf::from("/x/a,b.qcow2"),
            format: "qcow2",
        };
        let spec: Value =
            serde_json::from_str(src.qemu_spec().strip_prefix("json:").unwrap()).unwrap();
        assert_eq!(
            spec,
            json!({"driver": "qcow2", "file": {"driver": "file", "filename": "/x/a,b.qcow2"}, "backing": null})
        );
        let vpc = Source {
            path: PathBuf::from("/x/a.vhd"),
            format: "vpc",
        };
        assert!(
            !vpc.qemu_spec().contains("backing"),
            "vpc has no backing option"
        );

        use vdstream_qcow2::{ImageFormat, LayerSpec};
        let chain = [
            LayerSpec::new("/s/v.base.raw", ImageFormat::Raw),
            LayerSpec::new("/s/v.1.qcow2", ImageFormat::Qcow2),
        ];
        let spec: Value =
            serde_json::from_str(chain_spec(&chain).strip_prefix("json:").unwrap()).unwrap();
        assert_eq!(
            spec,
            json!({"driver": "qcow2", "file": {"driver": "file", "filename": "/s/v.1.qcow2"},
            "backing": {"driver": "raw", "file": {"driver": "file", "filename": "/s/v.base.raw"}}})
        );
        let lone = [LayerSpec::new("/s/v.base.qcow2", ImageFormat::Qcow2)];
        assert!(chain_spec(&lone).contains("\"backing\":null"));

        let info = json!({"format": "qcow2", "backing-filename": "/etc/passwd"});
        let e = src.check_info(&info).unwrap_err().to_string();
        assert!(e.contains("names backing file \"/etc/passwd\""), "{e}");
        let vmdk = Source {
            path: PathBuf::from("/x/a.vmdk"),
            format: "vmdk",
        };
        let info = json!({"format": "vmdk", "format-specific": {"data": {"extents": [{"filename": "/x/a.vmdk"}, {"filename": "/etc/shadow"}]}}});
        assert!(vmdk
            .check_info(&info)
            .unwrap_err()
            .to_string()
            .contains("\"/etc/shadow\""));
    }
}
