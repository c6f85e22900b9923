//! Finding a version's kernel and its modules directory.
//!
//! - The kernel is `/boot/vmlinuz-KVER`, the newest KVER in version order (`sort -V`) when
//!   there are several; `/vmlinuz` and `/boot/vmlinuz` (Debian's symlinks) are followed when
//!   `/boot` names no versioned kernel.
//! - Its modules are `/lib/modules/KVER` or `/usr/lib/modules/KVER` (with usrmerge `/lib`
//!   is a symlink to `usr/lib`; `ext4-view` follows it).
//!
//! Which of its modules the initramfs loads, and in what order, is the `modules` module's.

use std::cmp::Ordering;

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
            .filter(|v| {
                fs.metadata(format!("/boot/vmlinuz-{v}").as_str())
                    .map(|m| m.file_type().is_regular_file())
                    .unwrap_or(false)
            })
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
                if let Some(v) = real
                    .rsplit('/')
                    .next()
                    .and_then(|n| n.strip_prefix("vmlinuz-"))
                {
                    if fs
                        .metadata(real.as_str())
                        .map(|m| m.file_type().is_regular_file())
                        .unwrap_or(false)
                    {
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
    Ok(Kernel {
        version,
        path,
        modules_dir,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_sort_as_sort_v_does() {
        let mut v = vec![
            "6.10.0-1-amd64",
            "6.1.0-56-cloud-amd64",
            "6.1.0-9-cloud-amd64",
            "5.10.0-30-amd64",
            "6.1.0-56-amd64",
        ];
        v.sort_by(|a, b| version_cmp(a, b));
        assert_eq!(
            v,
            [
                "5.10.0-30-amd64",
                "6.1.0-9-cloud-amd64",
                "6.1.0-56-amd64",
                "6.1.0-56-cloud-amd64",
                "6.10.0-1-amd64"
            ]
        );
        assert_eq!(version_cmp("1.02", "1.2"), Ordering::Less); // equal numbers: the byte order decides, as a total order must
        assert_eq!(version_cmp("", "1"), Ordering::Less);
    }
}
