//! Finding a version's kernel and the modules the initramfs loads, in load order.
//!
//! - The kernel is `/boot/vmlinuz-KVER`, the newest KVER in version order (`sort -V`) when
//!   there are several; `/vmlinuz` and `/boot/vmlinuz` (Debian's symlinks) are followed when
//!   `/boot` names no versioned kernel.
//! - Its modules are `/lib/modules/KVER` or `/usr/lib/modules/KVER` (with usrmerge `/lib`
//!   is a symlink to `usr/lib`; `ext4-view` follows it).
//! - Dependencies come from `modules.dep` when the tree has one, else from each module's
//!   own `depends=` field (its `.modinfo`), as `depmod` would compute them. Modules listed
//!   in `modules.builtin` need no loading. The load order puts every dependency before the
//!   modules that need it, each module once.
//!
//! Module names compare with `-` and `_` as the same character, as the kernel does.

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashSet};

use ext4_view::{Ext4, Ext4Error};

/// A kernel found in an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    /// `KVER`.
    pub version: String,
    /// Its path in the image (after following symlinks).
    pub path: String,
    /// Its modules directory in the image, if there is one.
    pub modules_dir: Option<String>,
}

/// One module to load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    /// The module's name (`virtio_net`).
    pub name: String,
    /// Its path in the image.
    pub path: String,
}

/// `sort -V` order of two version strings: runs of digits compare as numbers, the rest
/// byte-wise.
pub fn version_cmp(a: &str, b: &str) -> Ordering {
    fn chunks(s: &str) -> Vec<(bool, &str)> {
        let mut out = Vec::new();
        let mut start = 0;
        let bytes = s.as_bytes();
        for i in 1..=bytes.len() {
            if i == bytes.len() || bytes[i].is_ascii_digit() != bytes[start].is_ascii_digit() {
                out.push((bytes[start].is_ascii_digit(), &s[start..i]));
                start = i;
            }
        }
        out
    }
    let (ca, cb) = (chunks(a), chunks(b));
    for (x, y) in ca.iter().zip(cb.iter()) {
        let o = match (x, y) {
            ((true, x), (true, y)) => {
                let (x, y) = (x.trim_start_matches('0'), y.trim_start_matches('0'));
                x.len().cmp(&y.len()).then_with(|| x.cmp(y))
            }
            ((_, x), (_, y)) => x.cmp(y),
        };
        if o != Ordering::Equal {
            return o;
        }
    }
    ca.len().cmp(&cb.len()).then_with(|| a.cmp(b))
}

fn is_dir(fs: &Ext4, p: &str) -> bool {
    fs.metadata(p).map(|m| m.is_dir()).unwrap_or(false)
}

fn file_names(fs: &Ext4, dir: &str) -> Result<Vec<String>, Ext4Error> {
    let mut out = Vec::new();
    for e in fs.read_dir(dir)? {
        let e = e?;
        if let Ok(n) = e.file_name().as_str() {
            if n != "." && n != ".." {
                out.push(n.to_string());
            }
        }
    }
    Ok(out)
}

/// The newest kernel of the image, or why there is none.
pub fn find_kernel(fs: &Ext4) -> Result<Kernel, String> {
    let mut kvers: Vec<String> = match file_names(fs, "/boot") {
        Ok(names) => names
            .into_iter()
            .filter_map(|n| n.strip_prefix("vmlinuz-").map(str::to_string))
            .filter(|v| fs.metadata(format!("/boot/vmlinuz-{v}").as_str()).map(|m| m.file_type().is_regular_file()).unwrap_or(false))
            .collect(),
        Err(Ext4Error::NotFound) => Vec::new(),
        Err(e) => return Err(format!("reading /boot: {e}")),
    };
    let mut path = None;
    if kvers.is_empty() {
        // Debian's /vmlinuz and /boot/vmlinuz symlinks name the kernel.
        for link in ["/vmlinuz", "/boot/vmlinuz"] {
            if let Ok(real) = fs.canonicalize(link) {
                let real = real.to_str().unwrap_or_default().to_string();
                if let Some(v) = real.rsplit('/').next().and_then(|n| n.strip_prefix("vmlinuz-")) {
                    if fs.metadata(real.as_str()).map(|m| m.file_type().is_regular_file()).unwrap_or(false) {
                        kvers.push(v.to_string());
                        path = Some(real.clone());
                        break;
                    }
                }
            }
        }
    }
    kvers.sort_by(|a, b| version_cmp(a, b));
    let Some(version) = kvers.pop() else {
        return Err("no /boot/vmlinuz-VERSION (nor a /vmlinuz symlink to one)".into());
    };
    let path = path.unwrap_or_else(|| format!("/boot/vmlinuz-{version}"));
    let modules_dir = ["/lib/modules", "/usr/lib/modules"]
        .iter()
        .map(|d| format!("{d}/{version}"))
        .find(|d| is_dir(fs, d));
    Ok(Kernel { version, path, modules_dir })
}

/// The kernel's module names treat `-` and `_` alike.
pub fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

/// The module name of a file name such as `virtio_net.ko` or `nbd.ko.xz`.
fn module_name(file: &str) -> Option<String> {
    let base = file.rsplit('/').next()?;
    let stem = ["", ".xz", ".zst", ".gz"].iter().find_map(|c| base.strip_suffix(&format!(".ko{c}")))?;
    Some(normalize(stem))
}

/// The modules of one kernel: where each is and what each needs.
#[derive(Debug, Default)]
pub struct ModuleIndex {
    dir: String,
    /// name → path relative to the modules directory.
    files: BTreeMap<String, String>,
    /// name → names it depends on, from modules.dep (when the tree has one).
    deps: Option<BTreeMap<String, Vec<String>>>,
    builtin: HashSet<String>,
}

impl ModuleIndex {
    /// Reads the index of the modules directory `dir`.
    pub fn load(fs: &Ext4, dir: &str) -> Result<Self, String> {
        let mut ix = ModuleIndex { dir: dir.to_string(), ..Default::default() };
        if let Ok(b) = fs.read_to_string(format!("{dir}/modules.builtin").as_str()) {
            ix.builtin = b.lines().filter_map(module_name).collect();
        }
        match fs.read_to_string(format!("{dir}/modules.dep").as_str()) {
            Ok(dep) => {
                let mut deps = BTreeMap::new();
                for line in dep.lines() {
                    let Some((file, needs)) = line.split_once(':') else { continue };
                    let Some(name) = module_name(file) else { continue };
                    ix.files.insert(name.clone(), file.trim().to_string());
                    deps.insert(name, needs.split_whitespace().filter_map(module_name).collect());
                }
                ix.deps = Some(deps);
            }
            Err(Ext4Error::NotFound) => ix.walk(fs, "")?,
            Err(e) => return Err(format!("reading {dir}/modules.dep: {e}")),
        }
        Ok(ix)
    }

    fn walk(&mut self, fs: &Ext4, rel: &str) -> Result<(), String> {
        let dir = if rel.is_empty() { self.dir.clone() } else { format!("{}/{rel}", self.dir) };
        let names = file_names(fs, &dir).map_err(|e| format!("reading {dir}: {e}"))?;
        for n in names {
            let r = if rel.is_empty() { n.clone() } else { format!("{rel}/{n}") };
            let full = format!("{}/{r}", self.dir);
            let meta = fs.symlink_metadata(full.as_str()).map_err(|e| format!("reading {full}: {e}"))?;
            if meta.is_dir() {
                self.walk(fs, &r)?;
            } else if let Some(m) = module_name(&n) {
                self.files.entry(m).or_insert(r);
            }
        }
        Ok(())
    }

    /// Whether the kernel has `name`, as a module or built in.
    pub fn has(&self, name: &str) -> bool {
        let n = normalize(name);
        self.files.contains_key(&n) || self.builtin.contains(&n)
    }

    /// Whether `name` is built into the kernel.
    pub fn is_builtin(&self, name: &str) -> bool {
        self.builtin.contains(&normalize(name))
    }

    fn depends(&self, fs: &Ext4, name: &str, rel: &str) -> Result<Vec<String>, String> {
        if let Some(d) = &self.deps {
            return Ok(d.get(name).cloned().unwrap_or_default());
        }
        let path = format!("{}/{rel}", self.dir);
        let bytes = fs.read(path.as_str()).map_err(|e| format!("reading {path}: {e}"))?;
        Ok(modinfo_depends(&bytes))
    }

    /// `wanted` and everything they need, dependencies first, each once; built-in modules
    /// are left out. A name the kernel has neither as a module nor built in is an error.
    pub fn load_order(&self, fs: &Ext4, wanted: &[String]) -> Result<Vec<Module>, String> {
        let mut out = Vec::new();
        let mut done = HashSet::new();
        for w in wanted {
            self.visit(fs, &normalize(w), &mut done, &mut Vec::new(), &mut out)?;
        }
        Ok(out)
    }

    fn visit(&self, fs: &Ext4, name: &str, done: &mut HashSet<String>, stack: &mut Vec<String>, out: &mut Vec<Module>) -> Result<(), String> {
        if done.contains(name) {
            return Ok(());
        }
        if stack.iter().any(|s| s == name) {
            return Err(format!("modules depend on each other in a loop: {} -> {name}", stack.join(" -> ")));
        }
        let Some(rel) = self.files.get(name) else {
            if self.builtin.contains(name) {
                done.insert(name.to_string());
                return Ok(());
            }
            let by = stack.last().map(|s| format!(" (needed by {s})")).unwrap_or_default();
            return Err(format!("kernel module {name}{by} is neither in {} nor built into the kernel", self.dir));
        };
        stack.push(name.to_string());
        for d in self.depends(fs, name, rel)? {
            self.visit(fs, &normalize(&d), done, stack, out)?;
        }
        stack.pop();
        done.insert(name.to_string());
        out.push(Module { name: name.to_string(), path: format!("{}/{rel}", self.dir) });
        Ok(())
    }
}

/// The `depends=` list of a module's `.modinfo` (NUL-separated `key=value` strings).
pub fn modinfo_depends(ko: &[u8]) -> Vec<String> {
    for field in ko.split(|&b| b == 0) {
        if let Some(v) = field.strip_prefix(b"depends=") {
            return String::from_utf8_lossy(v).split(',').filter(|s| !s.is_empty()).map(normalize).collect();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_sort_as_sort_v_does() {
        let mut v = vec!["6.10.0-1-amd64", "6.1.0-56-cloud-amd64", "6.1.0-9-cloud-amd64", "5.10.0-30-amd64", "6.1.0-56-amd64"];
        v.sort_by(|a, b| version_cmp(a, b));
        assert_eq!(v, ["5.10.0-30-amd64", "6.1.0-9-cloud-amd64", "6.1.0-56-amd64", "6.1.0-56-cloud-amd64", "6.10.0-1-amd64"]);
        assert_eq!(version_cmp("1.02", "1.2"), Ordering::Less); // equal numbers: the byte order decides, as a total order must
        assert_eq!(version_cmp("", "1"), Ordering::Less);
    }

    #[test]
    fn module_names() {
        assert_eq!(module_name("kernel/drivers/net/virtio_net.ko").as_deref(), Some("virtio_net"));
        assert_eq!(module_name("kernel/x/dm-mod.ko.xz").as_deref(), Some("dm_mod"));
        assert_eq!(module_name("kernel/x/readme.txt"), None);
        let ko = b"\x7fELF...\0license=GPL\0depends=virtio,virtio_ring,net-failover\0intree=Y\0";
        assert_eq!(modinfo_depends(ko), ["virtio", "virtio_ring", "net_failover"]);
        assert!(modinfo_depends(b"\0depends=\0").is_empty());
    }
}
