//! Checking images: a source before it is imported, and the layers of a vDisk
//! (`vdisk check`, and the cheap part of it in `vdisk info`).
//!
//! Three levels, cheapest first:
//! - [`layer_health`]: what the metadata and the file's own header say, without reading
//!   data: the file is there; a raw base is as long as the vDisk; a qcow2 layer passes
//!   [`vdstream_qcow2::sanity`] (every table and used cluster inside the file), has the
//!   vDisk's size, and backs onto the layer the metadata puts below it. `vdisk info`
//!   runs it on every layer.
//! - [`qemu_check`]: `qemu-img check --output=json`, which reads every table.
//! - [`check_source`] (before an import): `qemu-img check` where the format has one,
//!   `qemu-img map` (every data extent inside the file) for the other formats qemu reads,
//!   and the sanity check for qcow2. `qemu-img convert` reads zeros for what a truncated
//!   file lacks, so without this a damaged image would import "successfully".
//!
//! The store keeps no checksums of layer contents: a version changes while it is in
//! maintenance, and qemu-img check covers the structure.

use std::path::Path;
use std::process::Command;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Result, StoreError};
use crate::fsutil;
use crate::meta::{LayerFormat, VdiskMeta};
use crate::open::chain_files;
use crate::select::{Layer, Selector};
use crate::source::Source;
use crate::store::Store;

fn qemu_img() -> Command {
    Command::new(std::env::var_os("VDSTREAM_QEMU_IMG").unwrap_or_else(|| "qemu-img".into()))
}

fn tool_missing(e: std::io::Error) -> StoreError {
    StoreError::Tool(format!(
        "cannot run qemu-img ({e}): install it (Debian: apt-get install qemu-utils)"
    ))
}

/// What `qemu-img check` said.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QemuVerdict {
    /// No errors, no leaks (exit 0).
    Clean,
    /// Only leaked clusters: wasted space, no data at risk (exit 3).
    Leaks,
    /// Corruptions found (exit 2).
    Corrupt,
    /// The check could not complete: the image cannot be opened or read (exit 1).
    Failed,
    /// The format has no check (exit 63), e.g. vpc and raw.
    Unsupported,
}

/// `qemu-img check --output=json` of one file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QemuCheck {
    pub verdict: QemuVerdict,
    /// qemu-img's JSON report, when it printed one.
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub report: Value,
    /// qemu-img's messages (stderr), trimmed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub messages: String,
}

impl QemuCheck {
    /// One sentence on what is wrong, or `None` when nothing is.
    pub fn problem(&self) -> Option<String> {
        let n = |k: &str| self.report[k].as_u64().unwrap_or(0);
        let said = if self.messages.is_empty() {
            String::new()
        } else {
            format!(": {}", first_lines(&self.messages))
        };
        match self.verdict {
            QemuVerdict::Clean | QemuVerdict::Leaks | QemuVerdict::Unsupported => None,
            QemuVerdict::Corrupt => Some(format!(
                "qemu-img check found {} corruption(s) and {} check error(s){said}",
                n("corruptions"),
                n("check-errors")
            )),
            QemuVerdict::Failed => Some(format!("qemu-img check could not check it{said}")),
        }
    }
}

/// The first three lines of `text`, joined (qemu repeats its messages).
pub(crate) fn first_lines(text: &str) -> String {
    let mut seen: Vec<&str> = Vec::new();
    for l in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if !seen.contains(&l) && seen.len() < 3 {
            seen.push(l);
        }
    }
    seen.join("; ")
}

/// Runs `qemu-img check --output=json SPEC` (with `-U` so that it never waits for or takes
/// qemu's image locks); `spec` is a `json:` spec naming every file qemu-img may open.
pub fn qemu_check(spec: &str) -> Result<QemuCheck> {
    let out = qemu_img()
        .args(["check", "-U", "--output=json"])
        .arg(spec)
        .output()
        .map_err(tool_missing)?;
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    let messages = String::from_utf8_lossy(&out.stderr).trim().to_string();
    let verdict = match out.status.code() {
        Some(0) => QemuVerdict::Clean,
        Some(3) => QemuVerdict::Leaks,
        Some(2) => QemuVerdict::Corrupt,
        Some(63) => QemuVerdict::Unsupported,
        _ => QemuVerdict::Failed,
    };
    Ok(QemuCheck {
        verdict,
        report,
        messages,
    })
}

/// Data extents of `src` (as `qemu-img map` reports them) that lie past its end.
fn map_problems(src: &Source) -> Result<Vec<String>> {
    let path = &src.path;
    let len = std::fs::metadata(path)
        .map_err(crate::error::io("stat", path))?
        .len();
    let out = qemu_img()
        .args(["map", "-U", "--output=json"])
        .arg(src.qemu_spec())
        .output()
        .map_err(tool_missing)?;
    if !out.status.success() {
        return Ok(vec![format!(
            "qemu-img map cannot read it: {}",
            first_lines(&String::from_utf8_lossy(&out.stderr))
        )]);
    }
    let extents: Vec<Value> = serde_json::from_slice(&out.stdout).map_err(|e| {
        StoreError::Tool(format!(
            "qemu-img map {} printed something that is not JSON: {e}",
            path.display()
        ))
    })?;
    let mut problems = Vec::new();
    for e in &extents {
        let (Some(off), Some(n)) = (e["offset"].as_u64(), e["length"].as_u64()) else {
            continue;
        };
        if e["depth"].as_u64() == Some(0) && e["data"].as_bool() == Some(true) && off + n > len {
            problems.push(format!(
                "guest bytes {}..{} are stored at file offset {off}..{}, past the end of the file ({len} bytes): it is truncated",
                e["start"].as_u64().unwrap_or(0), e["start"].as_u64().unwrap_or(0) + n, off + n));
            break;
        }
    }
    Ok(problems)
}

/// Checks an image before it is imported (see the module doc): `Ok` with warnings
/// (leaked clusters), or a `Corrupt` error naming the file and the problem.
pub fn check_source(source: &Source) -> Result<Vec<String>> {
    let (src, format) = (source.path.as_path(), source.format);
    if format == "raw" {
        return Ok(vec![]); // any length is a valid raw image
    }
    let mut problems = Vec::new();
    let mut warnings = Vec::new();
    if format == "qcow2" {
        problems.extend(vdstream_qcow2::sanity(src)?.problems);
    }
    let qc = qemu_check(&source.qemu_spec())?;
    if let Some(p) = qc.problem() {
        problems.push(p);
    }
    if qc.verdict == QemuVerdict::Leaks {
        warnings.push(format!(
            "qemu-img check found {} leaked cluster(s) in {} (wasted space, no data at risk)",
            qc.report["leaks"].as_u64().unwrap_or(0),
            src.display()
        ));
    }
    if problems.is_empty() && format != "qcow2" {
        problems.extend(map_problems(source)?);
    }
    if problems.is_empty() {
        return Ok(warnings);
    }
    Err(StoreError::Corrupt {
        path: src.to_path_buf(),
        detail: format!("a damaged {format} image: {}", problems.join("; ")),
        advice: format!("nothing was imported; import an intact copy (qemu-img check -f {format} FILE must find no errors), or repair a copy first with qemu-img check -r all"),
    })
}

/// The cheap health of one layer file (see the module doc): its problems, empty when none.
/// `below`: the layer file and format the metadata puts under it (`None` for the base).
pub fn layer_health(
    path: &Path,
    format: LayerFormat,
    size: u64,
    below: Option<(&str, LayerFormat)>,
) -> Vec<String> {
    let len = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return vec!["the file is missing".into()]
        }
        Err(e) => return vec![format!("cannot read the file: {e}")],
    };
    let mut problems = Vec::new();
    match format {
        LayerFormat::Raw => {
            if len < size {
                problems.push(format!(
                    "the file holds {len} bytes, less than the vDisk's {size}: it is truncated"
                ));
            }
        }
        LayerFormat::Qcow2 => {
            let s = match vdstream_qcow2::sanity(path) {
                Ok(s) => s,
                Err(e) => return vec![format!("cannot read the file: {e}")],
            };
            problems.extend(s.problems);
            if let Some(h) = s.header {
                if h.size != size {
                    problems.push(format!(
                        "its virtual size is {} bytes, the vDisk's is {size}",
                        h.size
                    ));
                }
                let names = h.backing_file.as_deref();
                match (below, names) {
                    (None, Some(b)) => problems.push(format!(
                        "it backs onto {b}, but it is the base and has no layer below"
                    )),
                    (Some((want, _)), None) => problems.push(format!(
                        "it has no backing file, but the layer below it is {want}"
                    )),
                    (Some((want, _)), Some(got)) if got != want => problems.push(format!(
                        "it backs onto {got}, but the layer below it is {want}"
                    )),
                    (Some((_, fmt)), Some(_))
                        if h.backing_format
                            .as_deref()
                            .is_some_and(|f| f != fmt.image_format().name()) =>
                    {
                        problems.push(format!(
                            "its backing format is {}, but the layer below is {}",
                            h.backing_format.as_deref().unwrap_or(""),
                            fmt.name()
                        ))
                    }
                    _ => {}
                }
            }
        }
    }
    problems
}

/// One layer in `vdisk check`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayerCheck {
    pub layer: Layer,
    pub file: String,
    pub format: LayerFormat,
    /// What is wrong; empty when the layer is sound.
    pub problems: Vec<String>,
    /// Worth knowing but harmless (leaked clusters, a check skipped and why).
    pub notes: Vec<String>,
    /// `qemu-img check` of the file (qcow2 layers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qemu_check: Option<QemuCheck>,
}

/// `vdisk check NAME[@V]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VdiskCheck {
    pub vdisk: String,
    /// No layer has a problem.
    pub ok: bool,
    /// Bottom first: the chain checked.
    pub layers: Vec<LayerCheck>,
}

impl Store {
    /// `vdisk check NAME[@V]`: every layer of the chain under `sel` (all layers when
    /// `None`) through [`layer_health`] and `qemu-img check`. The metadata is loaded (and
    /// its invariants checked) under the shared lock; the files are then held with shared
    /// `flock`s, so the store does not delete them during the check, and no store lock is
    /// held while qemu-img runs.
    pub fn check_layers(&self, name: &str, sel: Option<Selector>) -> Result<VdiskCheck> {
        let (meta, top) = {
            let _l = self.lock(fsutil::LockMode::Shared)?;
            let meta = self.load(name)?;
            let top = match sel {
                Some(s) => crate::select::select(&meta, s, crate::time::Timestamp::now())?,
                None => meta
                    .newest()
                    .map_or(Layer::Base, |v| Layer::Version(v.number)),
            };
            (meta, top)
        };
        let files = chain_files(&meta, top);
        let layers = layer_list(&meta, files.len());
        let mut holds = Vec::new();
        let mut out = Vec::new();
        for (i, (layer, (file, format))) in
            layers.into_iter().zip(files.iter().cloned()).enumerate()
        {
            let path = self.file_path(name, &file);
            let below = i.checked_sub(1).map(|j| (files[j].0.as_str(), files[j].1));
            let problems = layer_health(&path, format, meta.size, below);
            let mut lc = LayerCheck {
                layer,
                file,
                format,
                problems,
                notes: vec![],
                qemu_check: None,
            };
            let held = if path.exists() {
                fsutil::hold_shared(&path).ok()
            } else {
                None
            };
            match held {
                Some(Some(f)) => holds.push(f),
                Some(None) => lc.notes.push(format!("open read-write by its writer ({}): what is on disk may not be complete until it detaches", fsutil::describe_holders(&path))),
                None => {}
            }
            if format == LayerFormat::Qcow2 && path.exists() {
                // The layer alone (backing off): qemu-img opens no file its header names.
                let qc = qemu_check(&crate::source::chain_spec(&[
                    vdstream_qcow2::LayerSpec::new(&path, vdstream_qcow2::ImageFormat::Qcow2),
                ]))?;
                if let Some(p) = qc.problem() {
                    lc.problems.push(p);
                }
                if qc.verdict == QemuVerdict::Leaks {
                    lc.notes.push(format!("{} leaked cluster(s): wasted space, no data at risk (`vdstream vdisk compact {name}` drops them)", qc.report["leaks"].as_u64().unwrap_or(0)));
                }
                lc.qemu_check = Some(qc);
            }
            out.push(lc);
        }
        drop(holds);
        Ok(VdiskCheck {
            vdisk: name.to_string(),
            ok: out.iter().all(|l| l.problems.is_empty()),
            layers: out,
        })
    }
}

/// The first `n` layers of `meta`'s chain, bottom first.
pub(crate) fn layer_list(meta: &VdiskMeta, n: usize) -> Vec<Layer> {
    std::iter::once(Layer::Base)
        .chain(meta.versions.iter().map(|v| Layer::Version(v.number)))
        .take(n)
        .collect()
}
