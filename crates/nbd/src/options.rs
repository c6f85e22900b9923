//! Pure parsers for handshake option payloads (`NBD_OPT_*` data), and the meta-context
//! query rules of the `base:` namespace.
//!
//! Everything here works on a `&[u8]` that the handshake already bounded by
//! [`crate::proto::MAX_OPTION_LEN`], returns borrowed strings, and never panics or
//! allocates from a length read off the wire (the one `Vec`, of queries, grows by what is
//! actually present). A parse error means the handshake answers `NBD_REP_ERR_INVALID`.

use crate::proto::*;

/// Why an option payload was rejected (sent to the client as the `REP_ERR_INVALID` message).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionParseError {
    #[error("option data ends early: a length field points past the end of the option")]
    Truncated,
    #[error("option data has {0} unexpected trailing bytes")]
    Trailing(usize),
    #[error("this option takes no data, but {0} bytes were sent")]
    DataNotAllowed(usize),
    #[error("a string of {0} bytes exceeds the 4096-byte limit of the NBD spec")]
    StringTooLong(usize),
    #[error("a string is not valid UTF-8")]
    NotUtf8,
    #[error("a string contains a NUL byte")]
    ContainsNul,
    #[error("meta context query {0:?} has no namespace (expected e.g. \"base:allocation\")")]
    QueryWithoutNamespace(String),
}

/// A cursor over option data.
struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], OptionParseError> {
        if self.b.len() < n {
            return Err(OptionParseError::Truncated);
        }
        let (head, tail) = self.b.split_at(n);
        self.b = tail;
        Ok(head)
    }
    fn u16(&mut self) -> Result<u16, OptionParseError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, OptionParseError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    /// A 32-bit length followed by that many bytes of string.
    fn string32(&mut self) -> Result<&'a str, OptionParseError> {
        let len = self.u32()? as usize;
        if len > self.b.len() {
            return Err(OptionParseError::Truncated);
        }
        parse_string(self.take(len)?)
    }
    fn finish(&self) -> Result<(), OptionParseError> {
        match self.b.len() {
            0 => Ok(()),
            n => Err(OptionParseError::Trailing(n)),
        }
    }
}

/// Checks an NBD string: at most 4096 bytes, UTF-8, no NUL.
pub fn parse_string(b: &[u8]) -> Result<&str, OptionParseError> {
    if b.len() > MAX_STRING_LEN as usize {
        return Err(OptionParseError::StringTooLong(b.len()));
    }
    let s = std::str::from_utf8(b).map_err(|_| OptionParseError::NotUtf8)?;
    if s.contains('\0') {
        return Err(OptionParseError::ContainsNul);
    }
    Ok(s)
}

/// `NBD_OPT_EXPORT_NAME` data: the whole payload is the name.
pub fn parse_export_name(data: &[u8]) -> Result<&str, OptionParseError> {
    parse_string(data)
}

/// Options that carry no data (`LIST`, `STRUCTURED_REPLY`, `STARTTLS`).
pub fn parse_empty(data: &[u8]) -> Result<(), OptionParseError> {
    match data.len() {
        0 => Ok(()),
        n => Err(OptionParseError::DataNotAllowed(n)),
    }
}

/// `NBD_OPT_INFO` / `NBD_OPT_GO` data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest<'a> {
    pub name: &'a str,
    pub want_name: bool,
    pub want_description: bool,
    pub want_block_size: bool,
}

/// Parses `NBD_OPT_INFO` / `NBD_OPT_GO` data: name length, name, count, count × info type.
/// Unknown info types are ignored, as the spec requires.
pub fn parse_info_request(data: &[u8]) -> Result<InfoRequest<'_>, OptionParseError> {
    let mut r = Reader { b: data };
    let name = r.string32()?;
    let count = r.u16()?;
    let mut req = InfoRequest {
        name,
        want_name: false,
        want_description: false,
        want_block_size: false,
    };
    for _ in 0..count {
        match r.u16()? {
            INFO_NAME => req.want_name = true,
            INFO_DESCRIPTION => req.want_description = true,
            INFO_BLOCK_SIZE => req.want_block_size = true,
            _ => {}
        }
    }
    r.finish()?;
    Ok(req)
}

/// `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT` data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest<'a> {
    pub export: &'a str,
    pub queries: Vec<&'a str>,
}

/// Parses meta-context option data: export name, query count, count × (length, query).
pub fn parse_meta_context_request(data: &[u8]) -> Result<MetaContextRequest<'_>, OptionParseError> {
    let mut r = Reader { b: data };
    let export = r.string32()?;
    let count = r.u32()?;
    let mut queries = Vec::new();
    for _ in 0..count {
        // Each query needs at least its 4-byte length, so a huge count fails fast here.
        queries.push(r.string32()?);
    }
    r.finish()?;
    Ok(MetaContextRequest { export, queries })
}

/// Whether a meta-context request selects (`listing == false`, SET) or lists
/// (`listing == true`, LIST) `base:allocation`, the one context this server knows.
///
/// Rules from the spec's `base:` namespace section: no queries lists everything but selects
/// nothing; `base:` is a wildcard when listing and ignored when setting; unknown leaf names
/// and unknown namespaces are ignored; a query without a colon is invalid.
pub fn selects_base_allocation(
    req: &MetaContextRequest<'_>,
    listing: bool,
) -> Result<bool, OptionParseError> {
    if req.queries.is_empty() {
        return Ok(listing);
    }
    let mut found = false;
    for q in &req.queries {
        let Some((namespace, leaf)) = q.split_once(':') else {
            return Err(OptionParseError::QueryWithoutNamespace((*q).to_string()));
        };
        if namespace != "base" {
            continue;
        }
        if leaf == "allocation" || (listing && leaf.is_empty()) {
            found = true;
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, types: &[u16]) -> Vec<u8> {
        let mut v = (name.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(name.as_bytes());
        v.extend_from_slice(&(types.len() as u16).to_be_bytes());
        for t in types {
            v.extend_from_slice(&t.to_be_bytes());
        }
        v
    }

    fn meta(export: &str, queries: &[&str]) -> Vec<u8> {
        let mut v = (export.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(export.as_bytes());
        v.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in queries {
            v.extend_from_slice(&(q.len() as u32).to_be_bytes());
            v.extend_from_slice(q.as_bytes());
        }
        v
    }

    #[test]
    fn info_request_parses() {
        let r_data = info("disk", &[INFO_BLOCK_SIZE, 77, INFO_NAME]);

        let r = parse_info_request(&r_data).unwrap();
        assert_eq!(r.name, "disk");
        assert!(r.want_block_size && r.want_name && !r.want_description);
        assert_eq!(parse_info_request(&info("", &[])).unwrap().name, "");
    }

    #[test]
    fn info_request_rejects_bad_lengths() {
        let mut d = info("disk", &[INFO_NAME]);
        d.push(0);
        assert_eq!(parse_info_request(&d), Err(OptionParseError::Trailing(1)));
        let d = info("disk", &[INFO_NAME]);
        assert_eq!(
            parse_info_request(&d[..d.len() - 1]),
            Err(OptionParseError::Truncated)
        );
        // Name length larger than the data.
        let mut d = info("disk", &[]);
        d[3] = 200;
        assert_eq!(parse_info_request(&d), Err(OptionParseError::Truncated));
        assert_eq!(
            parse_info_request(&[0xff, 0xff, 0xff, 0xff]),
            Err(OptionParseError::Truncated)
        );
        assert_eq!(parse_info_request(&[]), Err(OptionParseError::Truncated));
    }

    #[test]
    fn strings_are_checked() {
        assert_eq!(parse_string(b"a\0b"), Err(OptionParseError::ContainsNul));
        assert_eq!(parse_string(&[0xff, 0xfe]), Err(OptionParseError::NotUtf8));
        assert_eq!(
            parse_string(&vec![b'a'; 4097]),
            Err(OptionParseError::StringTooLong(4097))
        );
        assert_eq!(parse_string(&vec![b'a'; 4096]).map(str::len), Ok(4096));
        assert_eq!(parse_empty(&[1]), Err(OptionParseError::DataNotAllowed(1)));
    }

    #[test]
    fn meta_context_queries() {
        let r_data = meta("disk", &["base:allocation", "qemu:dirty-bitmap:x"]);

        let r = parse_meta_context_request(&r_data).unwrap();
        assert_eq!(r.export, "disk");
        assert_eq!(r.queries.len(), 2);
        assert_eq!(selects_base_allocation(&r, false), Ok(true));

        let wildcard_data = meta("", &["base:"]);

        let wildcard = parse_meta_context_request(&wildcard_data).unwrap();
        assert_eq!(selects_base_allocation(&wildcard, true), Ok(true));
        assert_eq!(selects_base_allocation(&wildcard, false), Ok(false));

        let none_data = meta("", &[]);

        let none = parse_meta_context_request(&none_data).unwrap();
        assert_eq!(selects_base_allocation(&none, true), Ok(true));
        assert_eq!(selects_base_allocation(&none, false), Ok(false));

        let other_data = meta("", &["base:nope", "x-foo:bar"]);

        let other = parse_meta_context_request(&other_data).unwrap();
        assert_eq!(selects_base_allocation(&other, false), Ok(false));

        let bad_data = meta("", &["nocolon"]);

        let bad = parse_meta_context_request(&bad_data).unwrap();
        assert!(matches!(
            selects_base_allocation(&bad, false),
            Err(OptionParseError::QueryWithoutNamespace(_))
        ));
    }

    #[test]
    fn meta_context_huge_count_fails_without_allocating() {
        let mut d = meta("", &[]);
        let n = d.len();
        d[n - 4..].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(
            parse_meta_context_request(&d),
            Err(OptionParseError::Truncated)
        );
    }
}
