//! The names of a target's cache files, a leaf that the cache types and the space checks
//! share: `<stem>.vdcache` for the data (every disk type), plus `<stem>.vdmap` and
//! `<stem>.vdjournal` for the persistent types, where `<stem>` is [`file_stem`] of the target id.

use std::path::{Path, PathBuf};

/// A file-name-safe form of a target id: `[A-Za-z0-9._-]` kept, the rest `_`, plus a hash
/// of the original so that two ids that sanitize alike still get different files.
pub fn file_stem(target: &str) -> String {
    let clean: String = target
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let clean = clean.trim_start_matches('.');
    // FNV-1a, stable across builds and platforms.
    let hash = target.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x1000_0000_01b3)
    });
    format!("{clean}-{:08x}", hash as u32)
}

/// The three file paths of the cache of `target` in `dir`.
pub fn cache_paths(dir: &Path, target: &str) -> [PathBuf; 3] {
    let stem = file_stem(target);
    ["vdcache", "vdmap", "vdjournal"].map(|ext| dir.join(format!("{stem}.{ext}")))
}
