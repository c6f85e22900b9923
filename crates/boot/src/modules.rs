//! The kernel modules an initramfs loads, in load order: what `modprobe` would load for each
//! wanted module, worked out ahead of time from the version's own module tree.
//!
//! Why ahead of time: the initramfs has no module tree and no `modprobe`; its `/init`
//! insmods a list. But modules ask for more at run time. ext4 and jbd2 mounting a file
//! system with `metadata_csum` (what Debian's `mkfs.ext4` makes by default) ask the crypto
//! API for `crc32c`, which calls `request_module("crypto-crc32c")`. With no module to
//! answer, the mount fails: `EXT4-fs (nbd0): Cannot load crc32c driver`. So the list must
//! hold everything modprobe would have loaded, as `initramfs-tools` and dracut make sure.
//!
//! A wanted module brings in, as kmod's modprobe resolves them:
//!
//! | what | from | load order |
//! | --- | --- | --- |
//! | hard dependencies | `modules.dep`, else each module's `depends=` (its `.modinfo`) | before the module |
//! | soft dependencies | `modules.softdep` (`softdep ext4 pre: crypto-crc32c`), else each module's `softdep=` fields; for built-in modules `modules.builtin.modinfo` | `pre:` before the module and its hard dependencies, `post:` after it |
//!
//! A name that is not a module (soft dependencies name crypto algorithms: `crypto-crc32c`,
//! `blake2b-256`) is an alias: every module `modules.alias` (else the modules' `alias=`
//! fields) matches it is loaded, as modprobe loads them all (`crypto-crc32c`: crc32c_intel
//! and crc32c_generic; the crypto API then uses the best one that loaded). A built-in
//! module (`modules.builtin`, `modules.builtin.modinfo`), by name or alias, is not loaded,
//! but its soft dependencies are: a built-in ext4 still asks for crc32c at mount time.
//!
//! Rules (each module listed once, its dependencies before it):
//! - A hard dependency that the tree lacks is an error, and so is a loop of them.
//! - Soft dependencies are wishes: one that names nothing in the tree is left out, as
//!   modprobe leaves it; one that leads back into the chain being resolved is dropped.
//! - Every softdep line of a module counts: btrfs has four (`blake2b-256`, `sha256`,
//!   `xxhash64`, `crypto-crc32c`). kmod 30 (Debian 12's modprobe, and what dracut asks
//!   through libkmod) follows only a module's first line, so this list is a superset of
//!   what they load: the module itself asks for all four.
//! - A module reached only through an alias that several modules answer is *optional*:
//!   its insmod may fail on a machine it is not for (crc32c_intel on a CPU without SSE4.2:
//!   "No such device") while another one serves.
//!
//! Module names compare with `-` and `_` as the same character, as the kernel does;
//! aliases too (outside `[...]` sets), as kmod does.

use std::cell::OnceCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;

use ext4_view::{Ext4, Ext4Error};

/// Read access to the file tree a kernel's modules live in: a version's ext4 file system
/// or a host directory laid out as a root ([`HostDir`]). Paths are absolute in that tree.
pub trait ModuleFiles {
    /// The bytes of the file at `path`.
    fn read_file(&self, path: &str) -> Result<Vec<u8>, FileError>;
    /// The entries of the directory `dir` (no `.` and `..`); symbolic links are not
    /// followed (a module tree's `build` link points outside it).
    fn entries(&self, dir: &str) -> Result<Vec<Entry>, FileError>;
}

/// Why a file of the module tree could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileError {
    NotFound,
    Other(String),
}

impl std::fmt::Display for FileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FileError::NotFound => f.write_str("no such file or directory"),
            FileError::Other(s) => f.write_str(s),
        }
    }
}

/// One entry of a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    /// A directory (not a link to one).
    pub is_dir: bool,
}

impl ModuleFiles for Ext4 {
    fn read_file(&self, path: &str) -> Result<Vec<u8>, FileError> {
        self.read(path).map_err(|e| match e {
            Ext4Error::NotFound => FileError::NotFound,
            e => FileError::Other(e.to_string()),
        })
    }

    fn entries(&self, dir: &str) -> Result<Vec<Entry>, FileError> {
        let err = |e: Ext4Error| match e {
            Ext4Error::NotFound => FileError::NotFound,
            e => FileError::Other(e.to_string()),
        };
        let mut out = Vec::new();
        for e in self.read_dir(dir).map_err(err)? {
            let e = e.map_err(err)?;
            let Ok(name) = e.file_name().as_str() else {
                continue;
            };
            if name == "." || name == ".." {
                continue;
            }
            let is_dir = e.file_type().map_err(err)?.is_dir();
            out.push(Entry {
                name: name.to_string(),
                is_dir,
            });
        }
        Ok(out)
    }
}

/// A host directory laid out as a root file system (an unpacked kernel package, a chroot):
/// `/lib/modules/...` is read at `ROOT/lib/modules/...`, links inside it followed as the
/// host follows them.
#[derive(Debug, Clone)]
pub struct HostDir(pub PathBuf);

impl HostDir {
    fn at(&self, path: &str) -> PathBuf {
        self.0.join(path.trim_start_matches('/'))
    }
}

fn host_err(p: &std::path::Path, e: std::io::Error) -> FileError {
    if e.kind() == std::io::ErrorKind::NotFound {
        FileError::NotFound
    } else {
        FileError::Other(format!("{}: {e}", p.display()))
    }
}

impl ModuleFiles for HostDir {
    fn read_file(&self, path: &str) -> Result<Vec<u8>, FileError> {
        let p = self.at(path);
        std::fs::read(&p).map_err(|e| host_err(&p, e))
    }

    fn entries(&self, dir: &str) -> Result<Vec<Entry>, FileError> {
        let p = self.at(dir);
        let mut out = Vec::new();
        for e in std::fs::read_dir(&p).map_err(|e| host_err(&p, e))? {
            let e = e.map_err(|e| host_err(&p, e))?;
            let is_dir = e.file_type().map_err(|e| host_err(&p, e))?.is_dir();
            out.push(Entry {
                name: e.file_name().to_string_lossy().into_owned(),
                is_dir,
            });
        }
        Ok(out)
    }
}

/// The kernel's module names treat `-` and `_` alike.
pub fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

/// An alias as kmod compares it: `-` as `_`, except inside a `[...]` set of a pattern.
pub fn normalize_alias(alias: &str) -> String {
    let mut out = String::with_capacity(alias.len());
    let mut in_set = false;
    for c in alias.chars() {
        match c {
            '[' => in_set = true,
            ']' => in_set = false,
            '-' if !in_set => {
                out.push('_');
                continue;
            }
            _ => {}
        }
        out.push(c);
    }
    out
}

/// The module name of a file name such as `virtio_net.ko` or `nbd.ko.xz`.
pub fn module_name(file: &str) -> Option<String> {
    let base = file.rsplit('/').next()?;
    let stem = ["", ".xz", ".zst", ".gz"]
        .iter()
        .find_map(|c| base.strip_suffix(&format!(".ko{c}")))?;
    Some(normalize(stem))
}

/// The `.modinfo` strings of a module file (`key=value`, NUL-separated): the ELF section
/// when the file is an ELF object that has one, else the whole file.
fn modinfo_strings(ko: &[u8]) -> Vec<&[u8]> {
    let section = goblin::elf::Elf::parse(ko).ok().and_then(|elf| {
        elf.section_headers
            .iter()
            .find(|s| elf.shdr_strtab.get_at(s.sh_name) == Some(".modinfo"))
            .and_then(|s| {
                let start = usize::try_from(s.sh_offset).ok()?;
                let end = start.checked_add(usize::try_from(s.sh_size).ok()?)?;
                ko.get(start..end)
            })
    });
    section
        .unwrap_or(ko)
        .split(|&b| b == 0)
        .filter(|f| !f.is_empty())
        .collect()
}

/// Every value of `key` in a module's `.modinfo`, in order.
pub fn modinfo_values(ko: &[u8], key: &str) -> Vec<String> {
    let prefix = format!("{key}=");
    modinfo_strings(ko)
        .into_iter()
        .filter_map(|f| f.strip_prefix(prefix.as_bytes()))
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect()
}

/// The `depends=` list of a module's `.modinfo`.
pub fn modinfo_depends(ko: &[u8]) -> Vec<String> {
    modinfo_values(ko, "depends")
        .first()
        .map(|v| {
            v.split(',')
                .filter(|s| !s.is_empty())
                .map(normalize)
                .collect()
        })
        .unwrap_or_default()
}

/// The soft dependencies of one module.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SoftDeps {
    /// Loaded before the module (names or aliases).
    pub pre: Vec<String>,
    /// Loaded after it.
    pub post: Vec<String>,
}

impl SoftDeps {
    /// Adds the names of one softdep text (`pre: a b post: c`, the part of a
    /// `modules.softdep` line after the module name, or a `softdep=` value). Words before
    /// the first `pre:` or `post:` are ignored, as kmod ignores them.
    pub fn add(&mut self, text: &str) {
        #[derive(PartialEq)]
        enum Mode {
            None,
            Pre,
            Post,
        }
        let mut mode = Mode::None;
        for w in text.split_whitespace() {
            match w {
                "pre:" => mode = Mode::Pre,
                "post:" => mode = Mode::Post,
                w => match mode {
                    Mode::Pre if !self.pre.iter().any(|x| x == w) => self.pre.push(w.to_string()),
                    Mode::Post if !self.post.iter().any(|x| x == w) => {
                        self.post.push(w.to_string())
                    }
                    _ => {}
                },
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.pre.is_empty() && self.post.is_empty()
    }
}

/// `modules.softdep` as depmod writes it: `softdep MODULE pre: A B post: C`, one line per
/// `softdep=` field of the module (all of a module's lines are merged).
pub fn parse_softdep_file(text: &str) -> BTreeMap<String, SoftDeps> {
    let mut out: BTreeMap<String, SoftDeps> = BTreeMap::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or_default();
        let mut words = line
            .splitn(3, char::is_whitespace)
            .filter(|w| !w.is_empty());
        let (Some("softdep"), Some(name)) = (words.next(), words.next()) else {
            continue;
        };
        let rest = line
            .trim_start()
            .strip_prefix("softdep")
            .unwrap_or_default()
            .trim_start();
        let rest = rest.strip_prefix(name).unwrap_or_default();
        out.entry(normalize(name)).or_default().add(rest);
    }
    out.retain(|_, s| !s.is_empty());
    out
}

/// An alias table: alias (or alias pattern) → the modules that answer it, in file order.
#[derive(Debug, Default)]
struct Aliases {
    exact: HashMap<String, Vec<String>>,
    patterns: Vec<(glob::Pattern, String)>,
}

impl Aliases {
    fn add(&mut self, alias: &str, module: &str) {
        let alias = normalize_alias(alias);
        let module = normalize(module);
        if alias.contains(['*', '?', '[']) {
            match glob::Pattern::new(&alias) {
                Ok(p) => self.patterns.push((p, module)),
                Err(e) => log::debug!("boot: alias pattern {alias} of module {module} is not a pattern kmod could match either: {e}"),
            }
        } else {
            let v = self.exact.entry(alias).or_default();
            if !v.contains(&module) {
                v.push(module);
            }
        }
    }

    /// The modules that answer `name` (normalized), each once.
    fn lookup(&self, name: &str) -> Vec<String> {
        let mut out = self.exact.get(name).cloned().unwrap_or_default();
        for (p, m) in &self.patterns {
            if !out.contains(m) && p.matches(name) {
                out.push(m.clone());
            }
        }
        out
    }
}

/// `modules.alias`: `alias ALIAS MODULE` lines.
fn parse_alias_file(text: &str) -> Aliases {
    let mut a = Aliases::default();
    for line in text.lines() {
        let mut w = line.split_whitespace();
        if let (Some("alias"), Some(alias), Some(module)) = (w.next(), w.next(), w.next()) {
            a.add(alias, module);
        }
    }
    a
}

/// One module to load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    /// The module's name (`virtio_net`).
    pub name: String,
    /// Its path in the image.
    pub path: String,
    /// Reached only through an alias that several modules answer: a failed insmod is
    /// expected where the machine lacks what it drives (see the module doc).
    pub optional: bool,
}

/// How a module was reached.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Edge {
    /// Wanted, or a hard dependency: it must load.
    Hard,
    /// A soft dependency or alias with one answer: it should load.
    Soft,
    /// One of several modules that answer an alias.
    Alternative,
}

/// The modules of one kernel: where each is, and what each needs.
#[derive(Debug, Default)]
pub struct ModuleIndex {
    dir: String,
    /// name → path relative to the modules directory.
    files: BTreeMap<String, String>,
    /// name → names it depends on, from modules.dep (when the tree has one).
    deps: Option<BTreeMap<String, Vec<String>>>,
    /// name → soft dependencies, from modules.softdep (when the tree has one).
    softdeps: Option<BTreeMap<String, SoftDeps>>,
    /// From modules.alias when the tree has one, else (on first use) from every module's
    /// `alias=` fields.
    aliases: OnceCell<Aliases>,
    builtin: HashSet<String>,
    /// Aliases and soft dependencies of built-in modules (modules.builtin.modinfo).
    builtin_aliases: Aliases,
    builtin_softdeps: BTreeMap<String, SoftDeps>,
}

fn read_text(fs: &impl ModuleFiles, path: &str) -> Result<Option<String>, String> {
    match fs.read_file(path) {
        Ok(b) => Ok(Some(String::from_utf8_lossy(&b).into_owned())),
        Err(FileError::NotFound) => Ok(None),
        Err(e) => Err(format!("reading {path}: {e}")),
    }
}

impl ModuleIndex {
    /// Reads the index of the modules directory `dir` (`/lib/modules/KVER`).
    pub fn load(fs: &impl ModuleFiles, dir: &str) -> Result<Self, String> {
        let mut ix = ModuleIndex {
            dir: dir.to_string(),
            ..Default::default()
        };
        if let Some(b) = read_text(fs, &format!("{dir}/modules.builtin"))? {
            ix.builtin = b.lines().filter_map(module_name).collect();
        }
        if let Some(b) = read_text(fs, &format!("{dir}/modules.builtin.modinfo"))? {
            // NUL-separated `module.key=value`.
            for field in b.split('\0') {
                let Some((key, value)) = field.split_once('=') else {
                    continue;
                };
                let Some((module, key)) = key.split_once('.') else {
                    continue;
                };
                ix.builtin.insert(normalize(module)); // only built-in modules are listed there
                match key {
                    "alias" => ix.builtin_aliases.add(value, module),
                    "softdep" => ix
                        .builtin_softdeps
                        .entry(normalize(module))
                        .or_default()
                        .add(value),
                    _ => {}
                }
            }
        }
        match read_text(fs, &format!("{dir}/modules.dep"))? {
            Some(dep) => {
                let mut deps = BTreeMap::new();
                for line in dep.lines() {
                    let Some((file, needs)) = line.split_once(':') else {
                        continue;
                    };
                    let Some(name) = module_name(file) else {
                        continue;
                    };
                    ix.files.insert(name.clone(), file.trim().to_string());
                    deps.insert(
                        name,
                        needs.split_whitespace().filter_map(module_name).collect(),
                    );
                }
                ix.deps = Some(deps);
            }
            None => ix.walk(fs, "")?,
        }
        ix.softdeps =
            read_text(fs, &format!("{dir}/modules.softdep"))?.map(|t| parse_softdep_file(&t));
        if let Some(t) = read_text(fs, &format!("{dir}/modules.alias"))? {
            let _ = ix.aliases.set(parse_alias_file(&t));
        }
        Ok(ix)
    }

    fn walk(&mut self, fs: &impl ModuleFiles, rel: &str) -> Result<(), String> {
        let dir = if rel.is_empty() {
            self.dir.clone()
        } else {
            format!("{}/{rel}", self.dir)
        };
        let mut entries = fs
            .entries(&dir)
            .map_err(|e| format!("reading {dir}: {e}"))?;
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        for e in entries {
            let r = if rel.is_empty() {
                e.name.clone()
            } else {
                format!("{rel}/{}", e.name)
            };
            if e.is_dir {
                self.walk(fs, &r)?;
            } else if let Some(m) = module_name(&e.name) {
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

    fn module_bytes(&self, fs: &impl ModuleFiles, rel: &str) -> Result<Vec<u8>, String> {
        let path = format!("{}/{rel}", self.dir);
        fs.read_file(&path)
            .map_err(|e| format!("reading {path}: {e}"))
    }

    fn depends(&self, fs: &impl ModuleFiles, name: &str, rel: &str) -> Result<Vec<String>, String> {
        if let Some(d) = &self.deps {
            return Ok(d.get(name).cloned().unwrap_or_default());
        }
        Ok(modinfo_depends(&self.module_bytes(fs, rel)?))
    }

    /// The soft dependencies of `name` (a module file at `rel`, or built in).
    pub fn softdeps(
        &self,
        fs: &impl ModuleFiles,
        name: &str,
        rel: Option<&str>,
    ) -> Result<SoftDeps, String> {
        let Some(rel) = rel else {
            return Ok(self.builtin_softdeps.get(name).cloned().unwrap_or_default());
        };
        if let Some(s) = &self.softdeps {
            return Ok(s.get(name).cloned().unwrap_or_default());
        }
        let mut s = SoftDeps::default();
        for v in modinfo_values(&self.module_bytes(fs, rel)?, "softdep") {
            s.add(&v);
        }
        Ok(s)
    }

    fn aliases(&self, fs: &impl ModuleFiles) -> Result<&Aliases, String> {
        if let Some(a) = self.aliases.get() {
            return Ok(a);
        }
        // No modules.alias (depmod never ran on this tree): every module's alias= fields.
        let mut a = Aliases::default();
        for (name, rel) in &self.files {
            for v in modinfo_values(&self.module_bytes(fs, rel)?, "alias") {
                a.add(&v, name);
            }
        }
        Ok(self.aliases.get_or_init(|| a))
    }

    /// The modules that `name` stands for, as modprobe looks it up: the module of that
    /// name, else every module whose alias matches, else the built-in module of that name
    /// or the built-in modules whose alias matches (nothing to load, but what they ask
    /// for). `None`: the kernel has nothing by that name.
    pub fn resolve(
        &self,
        fs: &impl ModuleFiles,
        name: &str,
    ) -> Result<Option<Vec<String>>, String> {
        let n = normalize(name);
        if self.files.contains_key(&n) {
            return Ok(Some(vec![n]));
        }
        let alias = normalize_alias(name);
        let found = self.aliases(fs)?.lookup(&alias);
        if !found.is_empty() {
            return Ok(Some(found));
        }
        if self.builtin.contains(&n) {
            return Ok(Some(vec![n]));
        }
        let found = self.builtin_aliases.lookup(&alias);
        Ok((!found.is_empty()).then_some(found))
    }

    /// `wanted` and everything they bring in (see the module doc), dependencies first,
    /// each once; built-in modules are left out. A wanted name may be an alias. A name the
    /// kernel has neither as a module, an alias nor built in is an error.
    pub fn load_order(
        &self,
        fs: &impl ModuleFiles,
        wanted: &[String],
    ) -> Result<Vec<Module>, String> {
        let mut r = Resolution {
            ix: self,
            out: Vec::new(),
            at: HashMap::new(),
            stack: Vec::new(),
        };
        for w in wanted {
            match self.resolve(fs, w)? {
                Some(ms) => {
                    let edge = if ms.len() > 1 { Edge::Alternative } else { Edge::Hard };
                    for m in ms {
                        r.visit(fs, &m, edge)?;
                    }
                }
                None => {
                    return Err(format!("kernel module {} is neither in {} nor built into the kernel (nor a module alias)", normalize(w), self.dir))
                }
            }
        }
        Ok(r.out)
    }
}

/// One run of [`ModuleIndex::load_order`].
struct Resolution<'a> {
    ix: &'a ModuleIndex,
    out: Vec<Module>,
    /// name → index in `out`, or usize::MAX for a built-in module already handled.
    at: HashMap<String, usize>,
    stack: Vec<String>,
}

impl Resolution<'_> {
    fn soft(&mut self, fs: &impl ModuleFiles, of: &str, names: &[String]) -> Result<(), String> {
        for s in names {
            match self.ix.resolve(fs, s)? {
                Some(ms) => {
                    let edge = if ms.len() > 1 { Edge::Alternative } else { Edge::Soft };
                    for m in ms {
                        self.visit(fs, &m, edge)?;
                    }
                }
                None => log::debug!("boot: soft dependency {s} of module {of} names no module of {}: left out, as modprobe leaves it", self.ix.dir),
            }
        }
        Ok(())
    }

    fn visit(&mut self, fs: &impl ModuleFiles, name: &str, edge: Edge) -> Result<(), String> {
        if let Some(&i) = self.at.get(name) {
            // Once needed for sure, it stays needed.
            if edge != Edge::Alternative && i != usize::MAX {
                self.out[i].optional = false;
            }
            return Ok(());
        }
        if self.stack.iter().any(|s| s == name) {
            if edge == Edge::Hard {
                return Err(format!(
                    "modules depend on each other in a loop: {} -> {name}",
                    self.stack.join(" -> ")
                ));
            }
            return Ok(()); // a soft edge back into the chain: dropped, as modprobe drops it
        }
        let ix = self.ix;
        let Some(rel) = ix.files.get(name) else {
            if ix.builtin.contains(name) {
                // Built in: nothing to load, but what it asks for at run time is.
                self.at.insert(name.to_string(), usize::MAX);
                self.stack.push(name.to_string());
                let sd = ix.softdeps(fs, name, None)?;
                self.soft(fs, name, &sd.pre)?;
                self.soft(fs, name, &sd.post)?;
                self.stack.pop();
                return Ok(());
            }
            let by = self
                .stack
                .last()
                .map(|s| format!(" (needed by {s})"))
                .unwrap_or_default();
            return Err(format!(
                "kernel module {name}{by} is neither in {} nor built into the kernel",
                ix.dir
            ));
        };
        self.stack.push(name.to_string());
        let sd = ix.softdeps(fs, name, Some(rel))?;
        self.soft(fs, name, &sd.pre)?;
        for d in ix.depends(fs, name, rel)? {
            self.visit(fs, &normalize(&d), Edge::Hard)?;
        }
        self.stack.pop();
        self.at.insert(name.to_string(), self.out.len());
        self.out.push(Module {
            name: name.to_string(),
            path: format!("{}/{rel}", ix.dir),
            optional: edge == Edge::Alternative,
        });
        self.stack.push(name.to_string());
        self.soft(fs, name, &sd.post)?;
        self.stack.pop();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn module_names() {
        assert_eq!(
            module_name("kernel/drivers/net/virtio_net.ko").as_deref(),
            Some("virtio_net")
        );
        assert_eq!(
            module_name("kernel/x/dm-mod.ko.xz").as_deref(),
            Some("dm_mod")
        );
        assert_eq!(module_name("kernel/x/readme.txt"), None);
        let ko = b"\x7fELF...\0license=GPL\0depends=virtio,virtio_ring,net-failover\0intree=Y\0";
        assert_eq!(
            modinfo_depends(ko),
            ["virtio", "virtio_ring", "net_failover"]
        );
        assert!(modinfo_depends(b"\0depends=\0").is_empty());
        assert_eq!(normalize_alias("crypto-crc32c"), "crypto_crc32c");
        assert_eq!(normalize_alias("pci:v*d[0-9]-x"), "pci:v*d[0-9]_x");
    }

    #[test]
    fn softdep_text_as_kmod_reads_it() {
        let f = parse_softdep_file(
            "# Soft dependencies extracted from modules themselves.\n\
             softdep ext4 pre: crypto-crc32c\n\
             softdep btrfs pre: blake2b-256\n\
             softdep btrfs pre: sha256\n\
             softdep cifs gcm\n\
             softdep dual-mod pre: a b post: c  # a comment\n\
             softdep\n",
        );
        assert_eq!(
            f["ext4"],
            SoftDeps {
                pre: vec!["crypto-crc32c".into()],
                post: vec![]
            }
        );
        assert_eq!(
            f["btrfs"].pre,
            ["blake2b-256", "sha256"],
            "every line of a module counts"
        );
        assert!(
            !f.contains_key("cifs"),
            "words before pre:/post: are ignored: {f:?}"
        );
        assert_eq!(
            f["dual_mod"],
            SoftDeps {
                pre: vec!["a".into(), "b".into()],
                post: vec!["c".into()]
            }
        );
    }

    fn write(root: &Path, rel: &str, data: &[u8]) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, data).unwrap();
    }

    const DIR: &str = "/lib/modules/6.1.0-1-test";

    /// A module file whose .modinfo has these fields (not ELF: the whole file is read).
    fn ko(fields: &[(&str, &str)]) -> Vec<u8> {
        let mut b = b"\x7fELF fake module\0license=GPL".to_vec();
        for (k, v) in fields {
            b.extend(format!("\0{k}={v}").bytes());
        }
        b.push(0);
        b
    }

    /// A small tree laid out as ext4 + crc32c are in Debian's 6.1 kernel, with a btrfs
    /// whose four softdeps include one no module answers, and a post: softdep.
    fn fake_tree(root: &Path, depmod: bool) {
        let m = |name: &str| format!("lib/modules/6.1.0-1-test/{name}");
        let mods: &[(&str, &[(&str, &str)])] = &[
            (
                "kernel/fs/ext4/ext4.ko",
                &[
                    ("softdep", "pre: crypto-crc32c"),
                    ("depends", "jbd2,mbcache,crc16"),
                    ("alias", "fs-ext4"),
                ],
            ),
            (
                "kernel/fs/jbd2/jbd2.ko",
                &[("softdep", "pre: crypto-crc32c"), ("depends", "")],
            ),
            ("kernel/fs/mbcache.ko", &[("depends", "")]),
            ("kernel/lib/crc16.ko", &[("depends", "")]),
            (
                "kernel/arch/x86/crypto/crc32c-intel.ko",
                &[
                    ("alias", "crypto-crc32c"),
                    ("alias", "crc32c"),
                    ("alias", "cpu:type:x86,ven*fam*mod*:feature:*0094*"),
                    ("depends", ""),
                ],
            ),
            (
                "kernel/crypto/crc32c_generic.ko",
                &[
                    ("alias", "crypto-crc32c"),
                    ("alias", "crc32c"),
                    ("depends", ""),
                ],
            ),
            (
                "kernel/lib/libcrc32c.ko",
                &[("softdep", "pre: crc32c"), ("depends", "")],
            ),
            (
                "kernel/crypto/blake2b_generic.ko",
                &[("alias", "blake2b-256"), ("depends", "")],
            ),
            (
                "kernel/fs/btrfs/btrfs.ko",
                &[
                    ("softdep", "pre: blake2b-256"),
                    ("softdep", "pre: no-such-algo"),
                    ("softdep", "pre: crypto-crc32c"),
                    ("depends", "libcrc32c"),
                ],
            ),
            (
                "kernel/drivers/net/virtio_net.ko",
                &[("softdep", "post: net-helper"), ("depends", "")],
            ),
            (
                "kernel/drivers/net/net_helper.ko",
                &[("softdep", "pre: virtio_net"), ("depends", "")],
            ),
        ];
        let mut dep = String::new();
        let mut alias = String::new();
        let mut softdep = String::from("# Soft dependencies extracted from modules themselves.\n");
        for (rel, fields) in mods {
            write(root, &m(rel), &ko(fields));
            let name = module_name(rel).unwrap();
            let deps: Vec<String> = fields
                .iter()
                .filter(|f| f.0 == "depends")
                .flat_map(|f| f.1.split(','))
                .filter(|d| !d.is_empty())
                .map(|d| {
                    mods.iter()
                        .find(|x| module_name(x.0).unwrap() == d)
                        .unwrap()
                        .0
                        .to_string()
                })
                .collect();
            dep.push_str(&format!("{rel}: {}\n", deps.join(" ")));
            for (k, v) in fields.iter() {
                match *k {
                    "alias" => alias.push_str(&format!("alias {v} {name}\n")),
                    "softdep" => softdep.push_str(&format!("softdep {name} {v}\n")),
                    _ => {}
                }
            }
        }
        // A built-in module that asks for a module at run time.
        write(
            root,
            &m("modules.builtin"),
            b"kernel/fs/isofs/isofs.ko\nkernel/lib/builtin_crc.ko\n",
        );
        write(
            root,
            &m("modules.builtin.modinfo"),
            b"isofs.softdep=pre: crc16\0isofs.license=GPL\0builtin_crc.alias=crypto-xyz\0",
        );
        if depmod {
            write(root, &m("modules.dep"), dep.as_bytes());
            write(root, &m("modules.alias"), alias.as_bytes());
            write(root, &m("modules.softdep"), softdep.as_bytes());
        }
    }

    fn order(fs: &impl ModuleFiles, wanted: &[&str]) -> Vec<(String, bool)> {
        let ix = ModuleIndex::load(fs, DIR).unwrap();
        let w: Vec<String> = wanted.iter().map(|s| s.to_string()).collect();
        ix.load_order(fs, &w)
            .unwrap()
            .into_iter()
            .map(|m| (m.name, m.optional))
            .collect()
    }

    /// The names in order, where the two crc32c drivers (alternatives: their order is the
    /// alias file's, or the module names' without one) read as `crc32c*`.
    fn names(o: &[(String, bool)]) -> Vec<&str> {
        o.iter()
            .map(|m| {
                if m.0.starts_with("crc32c_") {
                    "crc32c*"
                } else {
                    m.0.as_str()
                }
            })
            .collect()
    }

    #[test]
    fn soft_dependencies_and_aliases_from_depmod_files_and_from_modinfo() {
        for depmod in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            fake_tree(dir.path(), depmod);
            let fs = HostDir(dir.path().to_path_buf());
            // ext4: crc32c (both drivers, each optional) before jbd2, then ext4's own.
            let o = order(&fs, &["ext4"]);
            assert_eq!(
                names(&o),
                ["crc32c*", "crc32c*", "jbd2", "mbcache", "crc16", "ext4"],
                "depmod files: {depmod}"
            );
            assert_ne!(o[0].0, o[1].0);
            assert!(
                o[0].1 && o[1].1,
                "the crc32c drivers are alternatives: {o:?}"
            );
            assert!(o[2..].iter().all(|m| !m.1), "{o:?}");
            // btrfs: every softdep line; a name nothing answers is left out.
            let o = order(&fs, &["btrfs"]);
            assert_eq!(
                names(&o),
                [
                    "blake2b_generic",
                    "crc32c*",
                    "crc32c*",
                    "libcrc32c",
                    "btrfs"
                ],
                "depmod files: {depmod}"
            );
            assert!(!o[0].1, "blake2b-256 has one answer: not optional");
            // post: after the module; a softdep back into the chain is dropped.
            assert_eq!(
                names(&order(&fs, &["virtio_net"])),
                ["virtio_net", "net_helper"]
            );
            // A wanted alias; a module wanted by name after being an alternative is needed.
            let mut o = order(&fs, &["crc32c", "crc32c-generic"]);
            o.sort();
            assert_eq!(
                o,
                [
                    ("crc32c_generic".to_string(), false),
                    ("crc32c_intel".to_string(), true)
                ]
            );
            // A built-in module's own softdep; an alias only a built-in module answers.
            assert_eq!(names(&order(&fs, &["isofs", "crypto-xyz"])), ["crc16"]);
            let ix = ModuleIndex::load(&fs, DIR).unwrap();
            let e = ix
                .load_order(&fs, &["no-such-driver".to_string()])
                .unwrap_err();
            assert!(
                e.contains("no_such_driver is neither in /lib/modules/6.1.0-1-test"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_hard_loop_is_an_error_a_missing_hard_dependency_names_both() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        write(
            root,
            "lib/modules/6.1.0-1-test/kernel/a.ko",
            &ko(&[("depends", "b")]),
        );
        write(
            root,
            "lib/modules/6.1.0-1-test/kernel/b.ko",
            &ko(&[("depends", "a")]),
        );
        write(
            root,
            "lib/modules/6.1.0-1-test/kernel/c.ko",
            &ko(&[("depends", "gone")]),
        );
        let fs = HostDir(root.to_path_buf());
        let ix = ModuleIndex::load(&fs, DIR).unwrap();
        let e = ix.load_order(&fs, &["a".into()]).unwrap_err();
        assert!(e.contains("loop: a -> b -> a"), "{e}");
        let e = ix.load_order(&fs, &["c".into()]).unwrap_err();
        assert!(
            e.contains("kernel module gone (needed by c) is neither"),
            "{e}"
        );
    }
}
