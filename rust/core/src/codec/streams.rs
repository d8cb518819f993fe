//! Byte streams inside a chunk payload: each is stored verbatim or through
//! zstd, behind a small header, and decoded with a length bounded by the
//! caller before any allocation.

use std::cell::RefCell;

use crate::error::{Error, Result};

const STORED: u8 = 0;
const ZSTD: u8 = 1;
/// codec byte + raw length + stored length
pub const STREAM_HEADER: usize = 1 + 4 + 4;

thread_local! {
    static COMPRESSOR: RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> = const { RefCell::new(None) };
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

fn zstd_compress(data: &[u8], level: i32) -> Vec<u8> {
    COMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.as_ref().map(|(l, _)| *l) != Some(level) {
            *slot = Some((level, zstd::bulk::Compressor::new(level).expect("zstd compressor")));
        }
        let (_, c) = slot.as_mut().expect("just set");
        c.compress(data).expect("zstd compression into a growable buffer cannot fail")
    })
}

fn zstd_decompress(data: &[u8], raw_len: usize, context: &str) -> Result<Vec<u8>> {
    DECOMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(zstd::bulk::Decompressor::new().expect("zstd decompressor"));
        }
        let d = slot.as_mut().expect("just set");
        let out = d
            .decompress(data, raw_len)
            .map_err(|e| Error::corrupt(context, format!("zstd stream does not decode within {raw_len} bytes: {e}")))?;
        if out.len() != raw_len {
            return Err(Error::corrupt(context, format!("zstd stream decodes to {} bytes, header says {raw_len}", out.len())));
        }
        Ok(out)
    })
}

/// Append `data` as one stream: zstd when that is smaller, else stored.
pub fn put_stream(out: &mut Vec<u8>, data: &[u8], zstd_level: i32) {
    let raw_len = u32::try_from(data.len()).expect("streams are bounded by the chunk size");
    let compressed = if data.len() >= 16 { Some(zstd_compress(data, zstd_level)) } else { None };
    match compressed {
        Some(c) if c.len() < data.len() => {
            out.push(ZSTD);
            out.extend_from_slice(&raw_len.to_le_bytes());
            out.extend_from_slice(&(c.len() as u32).to_le_bytes());
            out.extend_from_slice(&c);
        }
        _ => {
            out.push(STORED);
            out.extend_from_slice(&raw_len.to_le_bytes());
            out.extend_from_slice(&raw_len.to_le_bytes());
            out.extend_from_slice(data);
        }
    }
}

/// Reads streams from a payload, front to back.
pub struct StreamReader<'a> {
    rest: &'a [u8],
    context: &'a str,
}

impl<'a> StreamReader<'a> {
    pub fn new(payload: &'a [u8], context: &'a str) -> Self {
        StreamReader { rest: payload, context }
    }

    /// Next stream, whose decoded length must lie in `min_len..=max_len`.
    pub fn next(&mut self, name: &str, min_len: usize, max_len: usize) -> Result<Vec<u8>> {
        let ctx = format!("{}, stream {name}", self.context);
        if self.rest.len() < STREAM_HEADER {
            return Err(Error::truncated(ctx, STREAM_HEADER as u64, self.rest.len() as u64));
        }
        let codec = self.rest[0];
        let raw_len = u32::from_le_bytes(self.rest[1..5].try_into().expect("4 bytes")) as usize;
        let stored_len = u32::from_le_bytes(self.rest[5..9].try_into().expect("4 bytes")) as usize;
        if raw_len < min_len || raw_len > max_len {
            return Err(Error::corrupt(ctx, format!("decoded length {raw_len} outside the expected {min_len}..={max_len}")));
        }
        let body_end = STREAM_HEADER
            .checked_add(stored_len)
            .filter(|&e| e <= self.rest.len())
            .ok_or_else(|| Error::truncated(ctx.clone(), stored_len as u64, (self.rest.len() - STREAM_HEADER) as u64))?;
        let body = &self.rest[STREAM_HEADER..body_end];
        self.rest = &self.rest[body_end..];
        match codec {
            STORED if stored_len == raw_len => Ok(body.to_vec()),
            STORED => Err(Error::corrupt(ctx, format!("stored stream has {stored_len} bytes but claims {raw_len}"))),
            ZSTD => zstd_decompress(body, raw_len, &ctx),
            code => Err(Error::UnknownCode { what: "stream codec", code, context: ctx }),
        }
    }

    pub fn finish(self) -> Result<()> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(Error::corrupt(self.context, format!("{} trailing bytes after the last stream", self.rest.len())))
        }
    }
}

/// LEB128 unsigned varint.
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Read a LEB128 varint of at most `max_bytes` bytes.
pub fn get_varint(buf: &[u8], pos: &mut usize, max_bytes: usize) -> Option<u64> {
    let mut v = 0u64;
    for i in 0..max_bytes {
        let b = *buf.get(*pos)?;
        *pos += 1;
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}
