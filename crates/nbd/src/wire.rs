//! Byte layouts of NBD messages: parsing request and option headers, and encoding replies.
//!
//! Pure functions over byte slices, so tests and fuzz targets can call them without a
//! socket. Invariants: parsing never panics on any input and never allocates from a length
//! read off the wire; every reply encoder writes exactly the bytes the spec lays out (big
//! endian), with error messages cut to the spec's 4096-byte string limit on a UTF-8
//! character boundary.

use crate::proto::*;

/// Size of a (compact) request header.
pub const REQUEST_HEADER_LEN: usize = 28;
/// Size of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Size of a structured reply chunk header.
pub const CHUNK_HEADER_LEN: usize = 20;
/// Size of an option request header (magic, option, length).
pub const OPTION_HEADER_LEN: usize = 16;

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// A transmission-phase request header as read off the wire, not yet validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub magic: u32,
    pub flags: u16,
    pub command: u16,
    pub handle: u64,
    pub offset: u64,
    pub length: u32,
}

impl RequestHeader {
    /// Parses the first [`REQUEST_HEADER_LEN`] bytes of `b`; `None` if `b` is shorter.
    pub fn parse(b: &[u8]) -> Option<RequestHeader> {
        if b.len() < REQUEST_HEADER_LEN {
            return None;
        }
        Some(RequestHeader {
            magic: be32(&b[0..]),
            flags: be16(&b[4..]),
            command: be16(&b[6..]),
            handle: be64(&b[8..]),
            offset: be64(&b[16..]),
            length: be32(&b[24..]),
        })
    }

    /// The request's bytes on the wire (for clients and tests).
    pub fn encode(&self) -> [u8; REQUEST_HEADER_LEN] {
        let mut b = [0u8; REQUEST_HEADER_LEN];
        b[0..4].copy_from_slice(&self.magic.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.command.to_be_bytes());
        b[8..16].copy_from_slice(&self.handle.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    /// How many payload bytes follow this header on the wire (only WRITE carries one).
    pub fn payload_len(&self) -> u32 {
        if self.command == CMD_WRITE {
            self.length
        } else {
            0
        }
    }
}

/// An option request header of the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub magic: u64,
    pub option: u32,
    pub length: u32,
}

impl OptionHeader {
    pub fn parse(b: &[u8; OPTION_HEADER_LEN]) -> OptionHeader {
        OptionHeader {
            magic: be64(&b[0..]),
            option: be32(&b[8..]),
            length: be32(&b[12..]),
        }
    }
}

/// Appends one fixed-newstyle option reply to `out`.
pub fn put_option_reply(out: &mut Vec<u8>, option: u32, reply: u32, data: &[u8]) {
    out.extend_from_slice(&REPLY_MAGIC_OPT.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// Cuts `msg` to at most `max` bytes on a character boundary.
pub fn clip_message(msg: &str, max: usize) -> &str {
    if msg.len() <= max {
        return msg;
    }
    let mut end = max;
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    &msg[..end]
}

/// The output buffer of a connection: replies are appended here and written with one
/// syscall. The backing `Vec` only grows (pre-zeroed once), so appending a READ payload
/// and filling it in place costs no memset in the steady state.
#[derive(Debug, Default)]
pub struct ReplyBuf {
    buf: Vec<u8>,
    len: usize,
}

impl ReplyBuf {
    pub fn with_capacity(cap: usize) -> ReplyBuf {
        ReplyBuf {
            buf: vec![0; cap],
            len: 0,
        }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_slice(&self) -> &[u8] {
        &self.buf[..self.len]
    }
    pub fn clear(&mut self) {
        self.len = 0;
    }
    /// Drops everything after the first `len` bytes.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
    /// Gives memory back after a large reply, once the buffer is empty.
    pub fn shrink_to(&mut self, cap: usize) {
        if self.len == 0 && self.buf.len() > cap {
            self.buf = vec![0; cap];
        }
    }
    fn grow(&mut self, extra: usize) {
        let need = self.len + extra;
        if self.buf.len() < need {
            let new = need.max(self.buf.len() * 2).max(4096);
            self.buf.resize(new, 0);
        }
    }
    /// Appends `n` bytes of unspecified content and returns their position; the caller
    /// overwrites them through [`ReplyBuf::slice_mut`].
    pub fn reserve(&mut self, n: usize) -> std::ops::Range<usize> {
        self.grow(n);
        let start = self.len;
        self.len += n;
        start..self.len
    }
    pub fn slice_mut(&mut self, r: std::ops::Range<usize>) -> &mut [u8] {
        &mut self.buf[r]
    }
    pub fn put(&mut self, bytes: &[u8]) {
        let r = self.reserve(bytes.len());
        self.buf[r].copy_from_slice(bytes);
    }
    pub fn put_u16(&mut self, v: u16) {
        self.put(&v.to_be_bytes());
    }
    pub fn put_u32(&mut self, v: u32) {
        self.put(&v.to_be_bytes());
    }
    pub fn put_u64(&mut self, v: u64) {
        self.put(&v.to_be_bytes());
    }

    /// A simple reply header (a READ's data, if any, follows).
    pub fn simple_reply(&mut self, handle: u64, error: u32) {
        let r = self.reserve(SIMPLE_REPLY_LEN);
        write_simple_reply(&mut self.buf[r], handle, error);
    }

    /// A structured reply chunk header; `length` bytes of payload must follow.
    pub fn chunk_header(&mut self, flags: u16, kind: u16, handle: u64, length: u32) {
        let r = self.reserve(CHUNK_HEADER_LEN);
        write_chunk_header(&mut self.buf[r], flags, kind, handle, length);
    }

    /// A final `NBD_REPLY_TYPE_ERROR` (or `ERROR_OFFSET` when `offset` is given) chunk.
    pub fn error_chunk(&mut self, handle: u64, error: u32, message: &str, offset: Option<u64>) {
        let msg = clip_message(message, MAX_STRING_LEN as usize);
        let extra = if offset.is_some() { 8 } else { 0 };
        let kind = if offset.is_some() {
            REPLY_TYPE_ERROR_OFFSET
        } else {
            REPLY_TYPE_ERROR
        };
        self.chunk_header(
            REPLY_FLAG_DONE,
            kind,
            handle,
            (6 + msg.len() + extra) as u32,
        );
        self.put_u32(error);
        self.put_u16(msg.len() as u16);
        self.put(msg.as_bytes());
        if let Some(off) = offset {
            self.put_u64(off);
        }
    }
}

/// Writes a simple reply header into the first 16 bytes of `b`.
pub fn write_simple_reply(b: &mut [u8], handle: u64, error: u32) {
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
}

/// Writes a structured reply chunk header into the first 20 bytes of `b`.
pub fn write_chunk_header(b: &mut [u8], flags: u16, kind: u16, handle: u64, length: u32) {
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b[16..20].copy_from_slice(&length.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_header_round_trip() {
        let h = RequestHeader {
            magic: REQUEST_MAGIC,
            flags: 3,
            command: CMD_WRITE,
            handle: 7,
            offset: 1 << 40,
            length: 512,
        };
        assert_eq!(RequestHeader::parse(&h.encode()), Some(h));
        assert_eq!(h.payload_len(), 512);
        assert_eq!(
            RequestHeader {
                command: CMD_READ,
                ..h
            }
            .payload_len(),
            0
        );
        assert_eq!(RequestHeader::parse(&h.encode()[..27]), None);
    }

    #[test]
    fn error_chunk_layout() {
        let mut b = ReplyBuf::default();
        b.error_chunk(9, EINVAL, "bad", Some(4096));
        let s = b.as_slice();
        assert_eq!(s.len(), 20 + 6 + 3 + 8);
        assert_eq!(be32(&s[0..]), STRUCTURED_REPLY_MAGIC);
        assert_eq!(be16(&s[4..]), REPLY_FLAG_DONE);
        assert_eq!(be16(&s[6..]), REPLY_TYPE_ERROR_OFFSET);
        assert_eq!(be64(&s[8..]), 9);
        assert_eq!(be32(&s[16..]), 17);
        assert_eq!(be32(&s[20..]), EINVAL);
        assert_eq!(be16(&s[24..]), 3);
        assert_eq!(&s[26..29], b"bad");
        assert_eq!(be64(&s[29..]), 4096);
    }

    #[test]
    fn messages_are_clipped_on_char_boundaries() {
        let long = "é".repeat(3000); // 6000 bytes
        let c = clip_message(&long, 4096);
        assert!(c.len() <= 4096 && c.len() >= 4095);
        assert!(long.starts_with(c));
    }

    #[test]
    fn reply_buf_reuses_memory() {
        let mut b = ReplyBuf::with_capacity(64);
        b.simple_reply(1, 0);
        let r = b.reserve(100);
        b.slice_mut(r).fill(7);
        assert_eq!(b.len(), 116);
        b.clear();
        assert!(b.is_empty());
        b.put_u32(5);
        assert_eq!(b.as_slice(), &[0, 0, 0, 5]);
    }
}
