//! The qcow2 header: a pure, fuzz-friendly parser over `&[u8]` (no I/O), following
//! qemu's `docs/interop/qcow2.txt`.
//!
//! [`Header::parse`] takes the first bytes of the file (the whole first cluster when the
//! file has one; [`HEADER_READ_LEN`] is enough for any cluster size) and the file's length,
//! and returns a validated [`Header`] or a [`HeaderError`] naming the field and what is
//! wrong with it. The image layer adds the file name and the advice.
//!
//! Invariants of a parsed header (everything later code may rely on without re-checking):
//! - `version` is 2 or 3, `cluster_bits` is in 9..=21, `refcount_order` in 0..=6.
//! - The L1 table (`l1_size` entries at `l1_table_offset`) and the refcount table lie inside
//!   the file, are cluster aligned, and are no larger than qemu's own limits (32 MiB and
//!   8 MiB), so a caller may allocate them as read.
//! - `l1_size` covers the virtual `size`.
//! - Nothing we do not implement is accepted silently: encryption, external data files,
//!   extended L2 entries, non-zlib compression and unknown incompatible features are
//!   refused by name. Dirty/corrupt flags are reported, and the image layer refuses to
//!   write such images.
//! - The backing file name and format (header extension `0xe2792aca`) are valid UTF-8 and
//!   lie inside the first cluster.

use std::fmt;

/// "QFI\xfb".
pub const MAGIC: u32 = 0x5146_49fb;
/// Bytes the parser may need: the largest cluster (2 MiB), which holds the header, its
/// extensions and the backing file name.
pub const HEADER_READ_LEN: usize = 1 << 21;
/// Smallest and largest cluster_bits qemu accepts.
pub const MIN_CLUSTER_BITS: u32 = 9;
pub const MAX_CLUSTER_BITS: u32 = 21;
/// qemu's limits on the L1 table (bytes) and the refcount table (bytes).
pub const MAX_L1_BYTES: u64 = 32 << 20;
pub const MAX_REFTABLE_BYTES: u64 = 8 << 20;
/// Longest backing file name qemu writes.
pub const MAX_BACKING_NAME: u32 = 1023;
/// Length of a version 2 header; a v3 header is at least [`V3_HEADER_LEN`].
pub const V2_HEADER_LEN: usize = 72;
pub const V3_HEADER_LEN: usize = 104;

/// Incompatible feature bits.
pub const INCOMPAT_DIRTY: u64 = 1 << 0;
pub const INCOMPAT_CORRUPT: u64 = 1 << 1;
pub const INCOMPAT_EXTERNAL_DATA: u64 = 1 << 2;
pub const INCOMPAT_COMPRESSION_TYPE: u64 = 1 << 3;
pub const INCOMPAT_EXTENDED_L2: u64 = 1 << 4;

/// Header extension types.
pub const EXT_END: u32 = 0;
pub const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
pub const EXT_FEATURE_TABLE: u32 = 0x6803_f857;
pub const EXT_CRYPTO: u32 = 0x0537_be77;
pub const EXT_EXTERNAL_DATA: u32 = 0x4441_5441;

/// A parsed, validated qcow2 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub cluster_bits: u32,
    /// Virtual disk size in bytes.
    pub size: u64,
    pub l1_size: u32,
    pub l1_table_offset: u64,
    pub refcount_table_offset: u64,
    pub refcount_table_clusters: u32,
    pub nb_snapshots: u32,
    pub snapshots_offset: u64,
    pub incompatible_features: u64,
    pub compatible_features: u64,
    pub autoclear_features: u64,
    pub refcount_order: u32,
    /// Length of the fixed header (72 for v2).
    pub header_length: u32,
    /// Backing file name as written in the image (relative to the image's directory when
    /// not absolute).
    pub backing_file: Option<String>,
    /// Backing file format from the header extension ("raw", "qcow2"), when present.
    pub backing_format: Option<String>,
}

/// What is wrong with a header: the field and the problem. Display reads as a sentence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderError {
    /// The header field or extension at fault.
    pub field: &'static str,
    pub problem: String,
    /// The image uses a feature we do not implement (as opposed to being corrupt).
    pub unsupported: bool,
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "qcow2 header field `{}`: {}", self.field, self.problem)
    }
}

impl std::error::Error for HeaderError {}

fn corrupt(field: &'static str, problem: impl Into<String>) -> HeaderError {
    HeaderError {
        field,
        problem: problem.into(),
        unsupported: false,
    }
}

fn unsupported(field: &'static str, problem: impl Into<String>) -> HeaderError {
    HeaderError {
        field,
        problem: problem.into(),
        unsupported: true,
    }
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Checks that `[offset, offset+len)` is cluster aligned and inside a file of `file_len`.
fn check_table(
    field: &'static str,
    offset: u64,
    len: u64,
    cluster: u64,
    file_len: u64,
) -> Result<(), HeaderError> {
    if offset % cluster != 0 {
        return Err(corrupt(
            field,
            format!("offset {offset} is not aligned to the cluster size {cluster}"),
        ));
    }
    if offset == 0 && len > 0 {
        return Err(corrupt(field, "offset 0 overlaps the header"));
    }
    match offset.checked_add(len) {
        Some(end) if end <= file_len => Ok(()),
        _ => Err(corrupt(
            field,
            format!("the table of {len} bytes at offset {offset} reaches past the end of the file ({file_len} bytes); the file is truncated or corrupt"),
        )),
    }
}

impl Header {
    /// Bytes per cluster.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Entries per L2 table (8 bytes each; extended L2 is refused).
    pub fn l2_entries(&self) -> u64 {
        self.cluster_size() / 8
    }

    /// Bits per refcount entry.
    pub fn refcount_bits(&self) -> u32 {
        1 << self.refcount_order
    }

    /// The L1 entries needed for a disk of `size` bytes with `cluster_bits`.
    pub fn l1_entries_for(size: u64, cluster_bits: u32) -> u64 {
        let per_l2 = 1u64 << (cluster_bits + cluster_bits - 3);
        size.div_ceil(per_l2)
    }

    /// Parses and validates the header at the start of `bytes` (the file's first bytes:
    /// at least the whole first cluster, or the whole file if shorter) of a file of
    /// `file_len` bytes.
    pub fn parse(bytes: &[u8], file_len: u64) -> Result<Header, HeaderError> {
        if bytes.len() < V2_HEADER_LEN {
            return Err(corrupt(
                "magic",
                format!("the file holds {} bytes, fewer than the 72 of a qcow2 header: it is truncated or not qcow2", bytes.len()),
            ));
        }
        let magic = be32(bytes, 0);
        if magic != MAGIC {
            return Err(corrupt(
                "magic",
                format!(
                    "{magic:#010x} is not the qcow2 magic \"QFI\\xfb\": this is not a qcow2 file"
                ),
            ));
        }
        let version = be32(bytes, 4);
        if version != 2 && version != 3 {
            return Err(unsupported(
                "version",
                format!("version {version}; only qcow2 versions 2 and 3 exist"),
            ));
        }
        let cluster_bits = be32(bytes, 20);
        if !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&cluster_bits) {
            return Err(corrupt(
                "cluster_bits",
                format!("{cluster_bits} is outside 9..=21 (512 bytes to 2 MiB clusters)"),
            ));
        }
        let cluster = 1u64 << cluster_bits;
        // Everything the parser reads besides the tables lies in the first cluster.
        let first = &bytes[..bytes.len().min(cluster as usize)];
        if version == 3 && first.len() < V3_HEADER_LEN {
            return Err(corrupt(
                "header_length",
                format!(
                    "a version 3 header needs 104 bytes, the file holds {}",
                    first.len()
                ),
            ));
        }
        let crypt_method = be32(bytes, 32);
        if crypt_method != 0 {
            return Err(unsupported("crypt_method", format!("the image is encrypted (method {crypt_method}); vdstream does not read encrypted qcow2: convert it with `qemu-img convert -O qcow2` without encryption")));
        }
        let mut h = Header {
            version,
            cluster_bits,
            size: be64(bytes, 24),
            l1_size: be32(bytes, 36),
            l1_table_offset: be64(bytes, 40),
            refcount_table_offset: be64(bytes, 48),
            refcount_table_clusters: be32(bytes, 56),
            nb_snapshots: be32(bytes, 60),
            snapshots_offset: be64(bytes, 64),
            incompatible_features: 0,
            compatible_features: 0,
            autoclear_features: 0,
            refcount_order: 4,
            header_length: V2_HEADER_LEN as u32,
            backing_file: None,
            backing_format: None,
        };
        let mut feature_names: Vec<(u8, u8, String)> = Vec::new();
        if version == 3 {
            h.incompatible_features = be64(bytes, 72);
            h.compatible_features = be64(bytes, 80);
            h.autoclear_features = be64(bytes, 88);
            h.refcount_order = be32(bytes, 96);
            h.header_length = be32(bytes, 100);
            if (h.header_length as usize) < V3_HEADER_LEN || h.header_length as usize > first.len()
            {
                return Err(corrupt(
                    "header_length",
                    format!(
                        "{} is not between 104 and the first cluster's {} bytes",
                        h.header_length,
                        first.len()
                    ),
                ));
            }
            if h.refcount_order > 6 {
                return Err(corrupt(
                    "refcount_order",
                    format!("{} is above 6 (64-bit refcounts)", h.refcount_order),
                ));
            }
        }
        // Header extensions: collect the backing format and feature names first, so that a
        // refused feature can be named as qemu names it.
        let mut at = h.header_length as usize;
        let mut ext_external = false;
        while at + 8 <= first.len() {
            let ty = be32(first, at);
            let len = be32(first, at + 4) as usize;
            if ty == EXT_END {
                break;
            }
            let data_at = at + 8;
            let Some(data) = data_at
                .checked_add(len)
                .and_then(|end| first.get(data_at..end))
            else {
                return Err(corrupt("header extension", format!("extension {ty:#010x} of {len} bytes at offset {at} runs past the first cluster")));
            };
            match ty {
                EXT_BACKING_FORMAT => {
                    let name = std::str::from_utf8(data).map_err(|_| {
                        corrupt("backing format extension", "the format name is not UTF-8")
                    })?;
                    h.backing_format = Some(name.trim_end_matches('\0').to_string());
                }
                EXT_FEATURE_TABLE => {
                    for entry in data.chunks_exact(48) {
                        let name_bytes = &entry[2..];
                        let end = name_bytes
                            .iter()
                            .position(|&b| b == 0)
                            .unwrap_or(name_bytes.len());
                        feature_names.push((
                            entry[0],
                            entry[1],
                            String::from_utf8_lossy(&name_bytes[..end]).into_owned(),
                        ));
                    }
                }
                EXT_CRYPTO => {
                    return Err(unsupported("full disk encryption extension", "the image is encrypted (LUKS); vdstream does not read encrypted qcow2: convert it without encryption"));
                }
                EXT_EXTERNAL_DATA => ext_external = true,
                _ => {}
            }
            at = data_at + len.div_ceil(8) * 8;
        }
        let feature_name = |ty: u8, bit: u8, fallback: &str| {
            feature_names
                .iter()
                .find(|(t, b, _)| *t == ty && *b == bit)
                .map(|(_, _, n)| n.clone())
                .unwrap_or_else(|| fallback.to_string())
        };
        if h.incompatible_features & INCOMPAT_EXTERNAL_DATA != 0 || ext_external {
            return Err(unsupported("incompatible_features", "the image keeps its data in an external data file (incompatible feature bit 2); vdstream does not support external data files: convert it with `qemu-img convert -O qcow2`"));
        }
        if h.incompatible_features & INCOMPAT_EXTENDED_L2 != 0 {
            return Err(unsupported("incompatible_features", "the image uses extended L2 entries (subclusters, incompatible feature bit 4); vdstream does not support them: convert it with `qemu-img convert -O qcow2 -o extended_l2=off`"));
        }
        if h.incompatible_features & INCOMPAT_COMPRESSION_TYPE != 0 {
            let ty = if h.header_length > 104 { first[104] } else { 0 };
            if ty != 0 {
                return Err(unsupported("compression_type", format!("compression type {ty} ({}); vdstream reads only zlib (deflate) compressed clusters: convert it with `qemu-img convert -O qcow2 -o compression_type=zlib`", if ty == 1 { "zstd" } else { "unknown" })));
            }
        }
        let known = INCOMPAT_DIRTY | INCOMPAT_CORRUPT | INCOMPAT_COMPRESSION_TYPE;
        let unknown = h.incompatible_features & !known;
        if unknown != 0 {
            let bit = unknown.trailing_zeros();
            let name = feature_name(0, bit as u8, "unnamed");
            return Err(unsupported("incompatible_features", format!("incompatible feature bit {bit} (\"{name}\") is set and vdstream does not implement it; open the image with qemu or convert it with `qemu-img convert -O qcow2`")));
        }
        // Backing file name.
        let bf_offset = be64(bytes, 8);
        let bf_size = be32(bytes, 16);
        if bf_offset != 0 && bf_size > 0 {
            if bf_size > MAX_BACKING_NAME {
                return Err(corrupt(
                    "backing_file_size",
                    format!("{bf_size} is longer than the 1023 bytes qemu allows"),
                ));
            }
            let end = bf_offset.checked_add(bf_size as u64).filter(|&e| e <= first.len() as u64).ok_or_else(|| {
                corrupt("backing_file_offset", format!("the name of {bf_size} bytes at offset {bf_offset} is not inside the first cluster"))
            })?;
            let name =
                std::str::from_utf8(&first[bf_offset as usize..end as usize]).map_err(|_| {
                    corrupt("backing_file_offset", "the backing file name is not UTF-8")
                })?;
            h.backing_file = Some(name.to_string());
        }
        // Tables and sizes, bounds-checked before anything is allocated from them.
        let per_l2 = 1u64 << (2 * cluster_bits - 3);
        let need_l1 = h.size.div_ceil(per_l2);
        if (h.l1_size as u64) < need_l1 {
            return Err(corrupt(
                "l1_size",
                format!(
                    "{} entries cover less than the virtual size of {} bytes (needs {need_l1})",
                    h.l1_size, h.size
                ),
            ));
        }
        let l1_bytes = h.l1_size as u64 * 8;
        if l1_bytes > MAX_L1_BYTES {
            return Err(corrupt(
                "l1_size",
                format!(
                    "{} entries ({l1_bytes} bytes) exceed qemu's 32 MiB limit for the L1 table",
                    h.l1_size
                ),
            ));
        }
        check_table(
            "l1_table_offset",
            h.l1_table_offset,
            l1_bytes,
            cluster,
            file_len,
        )?;
        let rt_bytes = (h.refcount_table_clusters as u64) << cluster_bits;
        if rt_bytes > MAX_REFTABLE_BYTES {
            return Err(corrupt("refcount_table_clusters", format!("{} clusters ({rt_bytes} bytes) exceed qemu's 8 MiB limit for the refcount table", h.refcount_table_clusters)));
        }
        if rt_bytes == 0 {
            return Err(corrupt(
                "refcount_table_clusters",
                "0: every image has a refcount table",
            ));
        }
        check_table(
            "refcount_table_offset",
            h.refcount_table_offset,
            rt_bytes,
            cluster,
            file_len,
        )?;
        if h.nb_snapshots > 0 && h.snapshots_offset % cluster != 0 {
            return Err(corrupt(
                "snapshots_offset",
                format!("{} is not cluster aligned", h.snapshots_offset),
            ));
        }
        Ok(h)
    }

    /// Serializes the fixed part of a version 3 header (`header_length` bytes, 104 or 112).
    pub fn to_bytes_v3(&self, backing_file_offset: u64) -> Vec<u8> {
        let mut b = vec![0u8; self.header_length as usize];
        let put32 =
            |b: &mut [u8], at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_be_bytes());
        let put64 =
            |b: &mut [u8], at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_be_bytes());
        put32(&mut b, 0, MAGIC);
        put32(&mut b, 4, 3);
        let name_len = self.backing_file.as_ref().map_or(0, |n| n.len() as u32);
        put64(
            &mut b,
            8,
            if name_len > 0 { backing_file_offset } else { 0 },
        );
        put32(&mut b, 16, name_len);
        put32(&mut b, 20, self.cluster_bits);
        put64(&mut b, 24, self.size);
        put32(&mut b, 32, 0);
        put32(&mut b, 36, self.l1_size);
        put64(&mut b, 40, self.l1_table_offset);
        put64(&mut b, 48, self.refcount_table_offset);
        put32(&mut b, 56, self.refcount_table_clusters);
        put32(&mut b, 60, self.nb_snapshots);
        put64(&mut b, 64, self.snapshots_offset);
        put64(&mut b, 72, self.incompatible_features);
        put64(&mut b, 80, self.compatible_features);
        put64(&mut b, 88, self.autoclear_features);
        put32(&mut b, 96, self.refcount_order);
        put32(&mut b, 100, self.header_length);
        b
    }
}

/// The first bytes of an image rewritten to name another backing file (or none), the way
/// `qemu-img rebase -u` does: the fixed header is kept except the name's offset and length,
/// every header extension is kept except the backing format, which is replaced (or
/// dropped with the name), and the name follows the extensions. `first` is what
/// [`Header::parse`] takes, `backing` is (name, format name).
///
/// The result is at most one cluster and at least as long as the old header area, so
/// writing it at offset 0 leaves no stale bytes of the old name behind; the name must
/// fit in the first cluster with everything else (a [`HeaderError`] says so otherwise).
pub fn with_backing(
    first: &[u8],
    file_len: u64,
    backing: Option<(&str, &str)>,
) -> Result<Vec<u8>, HeaderError> {
    let h = Header::parse(first, file_len)?;
    let cs = h.cluster_size() as usize;
    let first = &first[..first.len().min(cs)];
    let hl = h.header_length as usize;
    let mut kept: Vec<(u32, &[u8])> = Vec::new();
    let mut used_end = hl;
    let mut at = hl;
    // Each round moves `at` forward by at least 8 bytes inside `first`.
    while at + 8 <= first.len() {
        let ty = be32(first, at);
        let len = be32(first, at + 4) as usize;
        if ty == EXT_END {
            used_end = at + 8;
            break;
        }
        let data = first.get(at + 8..at + 8 + len).ok_or_else(|| {
            corrupt(
                "header extension",
                format!("extension {ty:#010x} runs past the first cluster"),
            )
        })?;
        if ty != EXT_BACKING_FORMAT {
            kept.push((ty, data));
        }
        at += 8 + len.div_ceil(8) * 8;
        used_end = at.min(first.len());
    }
    let old_name_end = if h.backing_file.is_some() {
        (be64(first, 8) + be32(first, 16) as u64) as usize
    } else {
        0
    };
    let mut out = first[..hl].to_vec();
    let mut ext = Vec::new();
    if let Some((name, format)) = backing {
        if name.is_empty() || name.len() > MAX_BACKING_NAME as usize || name.contains('\0') {
            return Err(corrupt("backing_file_size", format!("the backing file name must be 1 to {MAX_BACKING_NAME} bytes without NUL, got {} bytes", name.len())));
        }
        push_extension(&mut ext, EXT_BACKING_FORMAT, format.as_bytes());
    }
    for (ty, data) in kept {
        push_extension(&mut ext, ty, data);
    }
    push_extension(&mut ext, EXT_END, &[]);
    out.extend_from_slice(&ext);
    let name_at = out.len() as u64;
    let (offset, size) = match backing {
        Some((name, _)) => {
            out.extend_from_slice(name.as_bytes());
            (name_at, name.len() as u32)
        }
        None => (0, 0),
    };
    if out.len() > cs {
        return Err(corrupt("backing_file_offset", format!(
            "the header, its extensions and a {size}-byte backing file name need {} bytes, more than the {cs}-byte first cluster", out.len())));
    }
    out[8..16].copy_from_slice(&offset.to_be_bytes());
    out[16..20].copy_from_slice(&size.to_be_bytes());
    out.resize(out.len().max(used_end).max(old_name_end).min(cs), 0);
    Ok(out)
}

/// Appends one header extension (type, length, data padded to 8 bytes) to `out`.
pub fn push_extension(out: &mut Vec<u8>, ty: u32, data: &[u8]) {
    out.extend_from_slice(&ty.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(8) * 8, 0);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let h = Header {
            version: 3,
            cluster_bits: 16,
            size: 1 << 30,
            l1_size: 2,
            l1_table_offset: 3 << 16,
            refcount_table_offset: 1 << 16,
            refcount_table_clusters: 1,
            nb_snapshots: 0,
            snapshots_offset: 0,
            incompatible_features: 0,
            compatible_features: 0,
            autoclear_features: 0,
            refcount_order: 4,
            header_length: 112,
            backing_file: None,
            backing_format: None,
        };
        let mut b = h.to_bytes_v3(0);
        push_extension(&mut b, EXT_END, &[]);
        b.resize(1 << 16, 0);
        b
    }

    #[test]
    fn with_backing_sets_replaces_and_clears_the_name() {
        let mut b = sample();
        // An extension qemu writes (feature names), to be kept.
        let mut fixed = b[..112].to_vec();
        push_extension(&mut fixed, EXT_FEATURE_TABLE, &[0u8; 48]);
        push_extension(&mut fixed, EXT_END, &[]);
        b[..fixed.len()].copy_from_slice(&fixed);
        let len = 4 << 16;
        let set = with_backing(&b, len, Some(("base.qcow2", "qcow2"))).unwrap();
        let h = Header::parse(&set, len).unwrap();
        assert_eq!(
            (h.backing_file.as_deref(), h.backing_format.as_deref()),
            (Some("base.qcow2"), Some("qcow2"))
        );
        let longer = with_backing(&set, len, Some(("a-much-longer-name.raw", "raw"))).unwrap();
        let shorter = with_backing(&longer, len, Some(("b", "raw"))).unwrap();
        assert!(
            shorter.len() >= longer.len(),
            "stale name bytes are overwritten"
        );
        let h = Header::parse(&shorter, len).unwrap();
        assert_eq!(
            (h.backing_file.as_deref(), h.backing_format.as_deref()),
            (Some("b"), Some("raw"))
        );
        let cleared = with_backing(&shorter, len, None).unwrap();
        let h = Header::parse(&cleared, len).unwrap();
        assert_eq!((h.backing_file, h.backing_format), (None, None));
        assert_eq!(
            cleared[112..112 + 8],
            fixed[112..120],
            "the feature table is kept"
        );
        assert!(cleared[cleared.len() - 40..].iter().all(|&x| x == 0));
        assert!(with_backing(&b, len, Some(("", "raw"))).is_err());
        assert!(with_backing(&b, len, Some((&"x".repeat(1024), "raw"))).is_err());
        // 512-byte clusters: a long name does not fit after the header.
        let mut small = sample();
        small[20..24].copy_from_slice(&9u32.to_be_bytes());
        small[36..40].copy_from_slice(&(Header::l1_entries_for(1 << 30, 9) as u32).to_be_bytes());
        let small_len = 1 << 30;
        small[40..48].copy_from_slice(&(1u64 << 20).to_be_bytes());
        let e = with_backing(&small, small_len, Some((&"n".repeat(500), "qcow2"))).unwrap_err();
        assert!(e.problem.contains("first cluster"), "{e}");
    }

    #[test]
    fn round_trip_and_refusals() {
        let b = sample();
        let h = Header::parse(&b, 4 << 16).unwrap();
        assert_eq!(h.size, 1 << 30);
        assert_eq!(h.l2_entries(), 8192);
        // L1 past EOF.
        let e = Header::parse(&b, 3 << 16).unwrap_err();
        assert_eq!(e.field, "l1_table_offset");
        // Extended L2.
        let mut x = b.clone();
        x[79] |= INCOMPAT_EXTENDED_L2 as u8;
        let e = Header::parse(&x, 4 << 16).unwrap_err();
        assert!(e.unsupported && e.problem.contains("extended L2"), "{e}");
        // Unknown feature bit.
        let mut x = b.clone();
        x[78] |= 1;
        assert!(Header::parse(&x, 4 << 16)
            .unwrap_err()
            .problem
            .contains("bit 8"));
        // Truncated.
        assert_eq!(Header::parse(&b[..50], 50).unwrap_err().field, "magic");
        assert_eq!(
            Header::parse(&b[..80], 80).unwrap_err().field,
            "header_length"
        );
    }
}
