//! Byte streams inside a chunk payload: each is stored verbatim or through
//! zstd, behind a small header, and decoded with a length bounded by the
//! caller before any allocation.

use std::borrow::Cow;
use std::cell::RefCell;

use crate::error::{Error, Result};

const STORED: u8 = 0;
const ZSTD: u8 = 1;
const NONZERO: u8 = 2;

/// How a stream is compressed. The decoder does not care: every stream is a
/// plain zstd frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tuning {
    /// A zstd level, for streams with runs and repeats (the most significant
    /// byte plane of XOR words is mostly zeros).
    Level(i32),
    /// Entropy-coded symbols with few repeats worth a match (gaps, low byte
    /// planes): the Huffman-coded literals-only frame `huffman` writes
    /// (zstd's fastest match search with Huffman-coded literals where it
    /// cannot). Measured on the training pairs: that zstd setting took
    /// 35-40 % less time than level 1 and was 1-2 % smaller (level 1's
    /// short matches cost more than the literals they replace); the frame
    /// written directly takes about three quarters of its time.
    Symbols,
}

thread_local! {
    static COMPRESSORS: RefCell<Vec<(Tuning, zstd::bulk::Compressor<'static>)>> = const { RefCell::new(Vec::new()) };
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

fn new_compressor(tuning: Tuning) -> zstd::bulk::Compressor<'static> {
    use zstd::zstd_safe::{CParameter, ParamSwitch};
    let level = match tuning {
        Tuning::Level(level) => level,
        Tuning::Symbols => zstd::zstd_safe::min_c_level(),
    };
    let mut c = zstd::bulk::Compressor::new(level).expect("zstd compressor");
    // The stream header already holds the length; skip zstd's own checksum
    // and dictionary id (the frame checksum covers the payload).
    let mut params = vec![
        CParameter::ChecksumFlag(false),
        CParameter::DictIdFlag(false),
        CParameter::ContentSizeFlag(false),
        // The stream's codec byte already says zstd: 4 bytes fewer per stream.
        CParameter::Format(zstd::zstd_safe::FrameFormat::Magicless),
    ];
    match tuning {
        // Short matches cost more than the literals they replace in these
        // streams (measured: 7 saves 4-6 % against zstd's choice for small
        // inputs, at the same speed).
        Tuning::Level(_) => params.push(CParameter::MinMatch(7)),
        // Negative levels store literals raw unless told otherwise.
        Tuning::Symbols => params.push(CParameter::LiteralCompressionMode(ParamSwitch::Enable)),
    }
    for p in params {
        c.set_parameter(p).expect("valid zstd parameter");
    }
    c
}

fn zstd_compress(data: &[u8], tuning: Tuning) -> Vec<u8> {
    COMPRESSORS.with(|cell| {
        let mut cache = cell.borrow_mut();
        let slot = match cache.iter().position(|(t, _)| *t == tuning) {
            Some(i) => i,
            None => {
                cache.push((tuning, new_compressor(tuning)));
                cache.len() - 1
            }
        };
        cache[slot].1.compress(data).expect("zstd compression into a growable buffer cannot fail")
    })
}

fn zstd_decompress(data: &[u8], raw_len: usize, context: &str) -> Result<Vec<u8>> {
    DECOMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            let mut d = zstd::bulk::Decompressor::new().expect("zstd decompressor");
            d.set_parameter(zstd::zstd_safe::DParameter::Format(zstd::zstd_safe::FrameFormat::Magicless))
                .expect("valid zstd parameter");
            *slot = Some(d);
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

/// Append `data` as one stream: zstd at `zstd_level` when that is smaller,
/// else stored.
pub fn put_stream(out: &mut Vec<u8>, data: &[u8], zstd_level: i32) {
    put_tuned(out, data, Tuning::Level(zstd_level));
}

/// Append a stream of entropy-coded symbols with few repeats (gaps, low byte
/// planes): at the default level 1 and below as a Huffman-coded zstd frame
/// without matches (`huffman`); higher levels are used as given.
pub fn put_symbols(out: &mut Vec<u8>, data: &[u8], zstd_level: i32) {
    put_tuned(out, data, if zstd_level <= 1 { Tuning::Symbols } else { Tuning::Level(zstd_level) });
}

fn put_tuned(out: &mut Vec<u8>, data: &[u8], tuning: Tuning) {
    let compressed = match tuning {
        _ if data.len() < 16 => None,
        // The frame zstd would write for symbols, written directly
        // (`huffman`); zstd itself where that one cannot be written.
        Tuning::Symbols => super::huffman::frame(data).or_else(|| Some(zstd_compress(data, tuning))),
        Tuning::Level(_) => Some(zstd_compress(data, tuning)),
    };
    match compressed {
        Some(c) if c.len() < data.len() => {
            out.push(ZSTD);
            put_varint(out, data.len() as u64);
            put_varint(out, c.len() as u64);
            out.extend_from_slice(&c);
        }
        _ => put_stored(out, data),
    }
}

/// Append a stream that is mostly zero bytes (the most significant byte
/// plane of XOR words: sign and exponent rarely change): as its nonzero
/// bytes and the gaps between them when that is smaller, else as
/// `put_stream` does. zstd spends about 4 bytes on each isolated nonzero
/// byte of such a stream (a literal and a sequence); this spends about 2.
///
/// zstd is tried as well only where the nonzero bytes come in runs (fewer
/// than three runs per four nonzero bytes), which it codes as one sequence
/// each. Measured on the training pairs (one-step and multi-step, fp32
/// master and bf16): the top planes' nonzero bytes were nearly all
/// isolated (at least 0.9 runs per nonzero byte), and zstd won 2 of 254
/// planes, by 1-2 %; trying it on all cost 5-8 % of the free encode's time.
pub fn put_mostly_zero(out: &mut Vec<u8>, data: &[u8], zstd_level: i32) {
    let start = out.len();
    let Some((nonzero, runs)) = (data.len() >= 16).then(|| put_nonzero(out, data, data.len() / 8)).flatten() else {
        return put_stream(out, data, zstd_level);
    };
    if 4 * runs >= 3 * nonzero {
        return;
    }
    let mut packed = Vec::new();
    put_stream(&mut packed, data, zstd_level);
    if packed.len() < out.len() - start {
        out.truncate(start);
        out.extend_from_slice(&packed);
    }
}

/// Append `data` as a `NONZERO` stream if it holds at most `most` nonzero
/// bytes; returns how many it holds and in how many runs they come, or
/// `None` (nothing appended) if it holds more. One pass: the gaps and the
/// bytes are gathered first, since their count goes before them (where a
/// counting pass came first: the free diff at fp32m 10->15 and 12->15
/// 0.981, 10->11 0.991 of the time, paired).
fn put_nonzero(out: &mut Vec<u8>, data: &[u8], most: usize) -> Option<(usize, usize)> {
    let mut w = NonzeroWriter {
        // A byte per nonzero byte and at most one escape's varint (up to 10
        // bytes) per 255 bytes: never more than reserved here.
        gaps: Vec::with_capacity(most + 10 * (data.len() / 255 + 1)),
        values: Vec::with_capacity(most),
        next: 0,
        runs: 0,
    };
    let mut over = false;
    // 64 bytes at a time: most are zero.
    let whole = for_each_nonzero_block(data, |at, mut mask| {
        if over || w.values.len() + mask.count_ones() as usize > most {
            over = true;
            return;
        }
        while mask != 0 {
            let i = at + mask.trailing_zeros() as usize;
            mask &= mask - 1;
            w.note(i, data[i]);
        }
    });
    for (i, &b) in data.iter().enumerate().skip(whole).filter(|(_, &b)| b != 0) {
        if over || w.values.len() == most {
            return None;
        }
        w.note(i, b);
    }
    if over {
        return None;
    }
    let start = out.len();
    out.push(NONZERO);
    put_varint(out, data.len() as u64);
    put_varint(out, w.values.len() as u64);
    out.extend_from_slice(&w.gaps);
    out.extend_from_slice(&w.values);
    // At most `most` gaps (with their escapes) and as many bytes.
    debug_assert!(out.len() - start <= 1 + 20 + 2 * most + 10 * (data.len() / 255 + 1));
    Some((w.values.len(), w.runs))
}

/// `put_nonzero`'s gaps and bytes as they are gathered.
struct NonzeroWriter {
    gaps: Vec<u8>,
    values: Vec<u8>,
    /// The index after the previous nonzero byte.
    next: usize,
    runs: usize,
}

impl NonzeroWriter {
    /// The nonzero byte `b` at index `i` (past the previous one).
    #[inline(always)]
    fn note(&mut self, i: usize, b: u8) {
        let gap = i - self.next;
        self.gaps.push(gap.min(255) as u8);
        if gap >= 255 {
            let mut more = (gap - 255) as u64;
            while more >= 0x80 {
                self.gaps.push((more as u8) | 0x80);
                more >>= 7;
            }
            self.gaps.push(more as u8);
        }
        self.runs += usize::from(gap > 0 || i == 0);
        self.values.push(b);
        self.next = i + 1;
    }
}

/// The top bit of each byte of `w` set where that byte is not zero.
#[inline(always)]
fn nonzero_flags(w: u64) -> u64 {
    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    (((w & LOW7) + LOW7) | w) & !LOW7
}

/// Bit `k` set where byte `k` of `block` is not zero (portable).
#[inline(always)]
fn nonzero_mask_portable(block: &[u8]) -> u64 {
    let mut mask = 0u64;
    for (k, word) in block.chunks_exact(8).enumerate() {
        // The flags' top bits moved to the low bit of each byte, then
        // gathered into one byte by a multiply.
        let low = nonzero_flags(u64::from_le_bytes(word.try_into().expect("8 bytes"))) >> 7;
        mask |= (low.wrapping_mul(0x0102_0408_1020_4080) >> 56) << (8 * k);
    }
    mask
}

/// Call `visit(at, mask)` for each 64-byte block of `data` from byte `at`
/// that holds a nonzero byte (bit `k` of `mask` set where byte `at + k` is
/// not zero), in order; returns where the whole blocks end (the caller
/// looks at the rest). With AVX-512 BW one compare per block.
fn for_each_nonzero_block(data: &[u8], mut visit: impl FnMut(usize, u64)) -> usize {
    let whole = data.len() / 64 * 64;
    #[cfg(target_arch = "x86_64")]
    if super::gather_x86::available() {
        // Safety: the CPU has AVX-512 F and BW (checked just above).
        #[allow(unsafe_code)]
        unsafe {
            nonzero_blocks_avx512(&data[..whole], &mut visit)
        };
        return whole;
    }
    #[cfg(target_arch = "x86_64")]
    if super::avx2_available() {
        // Safety: the CPU has AVX2 (checked just above).
        #[allow(unsafe_code)]
        unsafe {
            nonzero_blocks_avx2(&data[..whole], &mut visit)
        };
        return whole;
    }
    for (b, block) in data[..whole].chunks_exact(64).enumerate() {
        let mask = nonzero_mask_portable(block);
        if mask != 0 {
            visit(64 * b, mask);
        }
    }
    whole
}

/// `for_each_nonzero_block` over whole blocks, one masked compare each.
///
/// # Safety
/// The CPU has AVX-512 F and BW; `data.len()` is a multiple of 64.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn nonzero_blocks_avx512(data: &[u8], visit: &mut impl FnMut(usize, u64)) {
    use std::arch::x86_64::{_mm512_loadu_si512, _mm512_test_epi8_mask};
    for at in (0..data.len()).step_by(64) {
        let v = _mm512_loadu_si512(data.as_ptr().add(at).cast());
        let mask = _mm512_test_epi8_mask(v, v);
        if mask != 0 {
            visit(at, mask);
        }
    }
}

/// `nonzero_blocks_avx512` with AVX2: two compares with zero per block.
///
/// # Safety
/// The CPU has AVX2; `data.len()` is a multiple of 64.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2")]
unsafe fn nonzero_blocks_avx2(data: &[u8], visit: &mut impl FnMut(usize, u64)) {
    use std::arch::x86_64::{_mm256_cmpeq_epi8, _mm256_loadu_si256, _mm256_movemask_epi8, _mm256_setzero_si256};
    let zero = _mm256_setzero_si256();
    for at in (0..data.len()).step_by(64) {
        let zeros = |half: usize| _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_loadu_si256(data.as_ptr().add(at + 32 * half).cast()), zero)) as u32;
        let mask = !(u64::from(zeros(0)) | (u64::from(zeros(1)) << 32));
        if mask != 0 {
            visit(at, mask);
        }
    }
}

/// How many bytes of `data` are not zero, 64 at a time.
#[cfg(test)]
fn count_nonzero(data: &[u8]) -> usize {
    let mut count = 0usize;
    let whole = for_each_nonzero_block(data, |_, mask| count += mask.count_ones() as usize);
    count + data[whole..].iter().filter(|&&b| b != 0).count()
}

/// A `NONZERO` stream's body after its length: `count` then the gaps and
/// the bytes; returns the decoded bytes and the body's length.
fn nonzero_bytes(body: &[u8], raw_len: usize, context: &str) -> Result<(Vec<u8>, usize)> {
    let bad = |detail: &str| Error::corrupt(context, detail.to_string());
    let mut pos = 0usize;
    let count = get_varint(body, &mut pos, 10).ok_or_else(|| bad("nonzero count cut off"))? as usize;
    if count > raw_len {
        return Err(bad(&format!("{count} nonzero bytes in a stream of {raw_len}")));
    }
    let mut positions = Vec::with_capacity(count);
    let mut next = 0usize;
    for _ in 0..count {
        let mut gap = u64::from(*body.get(pos).ok_or_else(|| bad("gaps cut off"))?);
        pos += 1;
        if gap == 255 {
            gap = get_varint(body, &mut pos, 10).ok_or_else(|| bad("gaps cut off"))?.saturating_add(255);
        }
        let at = (next as u64)
            .checked_add(gap)
            .filter(|&a| a < raw_len as u64)
            .ok_or_else(|| bad("a nonzero byte beyond the stream's length"))? as usize;
        positions.push(at);
        next = at + 1;
    }
    let values = body.get(pos..pos + count).ok_or_else(|| bad("nonzero bytes cut off"))?;
    if values.contains(&0) {
        return Err(bad("a zero among the nonzero bytes"));
    }
    let mut out = vec![0u8; raw_len];
    for (&at, &v) in positions.iter().zip(values) {
        out[at] = v;
    }
    Ok((out, pos + count))
}

/// A stream stored as is, for data that zstd cannot shrink (range-coder
/// output, raw sign bits): trying would only cost time.
pub fn put_stored(out: &mut Vec<u8>, data: &[u8]) {
    put_stored_header(out, data.len());
    out.extend_from_slice(data);
}

/// The head of a stored stream of `len` bytes, which the caller appends.
pub(super) fn put_stored_header(out: &mut Vec<u8>, len: usize) {
    out.push(STORED);
    put_varint(out, len as u64);
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

    /// Next stream, whose decoded length must lie in `min_len..=max_len`:
    /// borrowed from the payload where it is stored as is.
    pub fn next(&mut self, name: &str, min_len: usize, max_len: usize) -> Result<Cow<'a, [u8]>> {
        let ctx = || format!("{}, stream {name}", self.context);
        let truncated = || Error::truncated(ctx(), 1, 0);
        let codec = *self.rest.first().ok_or_else(truncated)?;
        let mut pos = 1;
        let raw_len = get_varint(self.rest, &mut pos, 5).ok_or_else(truncated)? as usize;
        if raw_len < min_len || raw_len > max_len {
            return Err(Error::corrupt(ctx(), format!("decoded length {raw_len} outside the expected {min_len}..={max_len}")));
        }
        if codec == NONZERO {
            let (out, used) = nonzero_bytes(&self.rest[pos..], raw_len, &ctx())?;
            self.rest = &self.rest[pos + used..];
            return Ok(Cow::Owned(out));
        }
        let stored_len = match codec {
            ZSTD => get_varint(self.rest, &mut pos, 5).ok_or_else(truncated)? as usize,
            _ => raw_len,
        };
        let body_end = pos
            .checked_add(stored_len)
            .filter(|&e| e <= self.rest.len())
            .ok_or_else(|| Error::truncated(ctx(), stored_len as u64, (self.rest.len() - pos) as u64))?;
        let body = &self.rest[pos..body_end];
        self.rest = &self.rest[body_end..];
        match codec {
            STORED => Ok(Cow::Borrowed(body)),
            ZSTD => Ok(Cow::Owned(zstd_decompress(body, raw_len, &ctx())?)),
            code => Err(Error::UnknownCode { what: "stream codec", code, context: ctx() }),
        }
    }

    /// The bytes after the streams read so far (fields of known length that
    /// follow them without a stream header).
    pub fn rest(self) -> &'a [u8] {
        self.rest
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

/// The bytes of `v` as a varint.
pub fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn read_back(stream: &[u8], max_len: usize) -> Result<Vec<u8>> {
        let mut r = StreamReader::new(stream, "test");
        let out = r.next("plane", 0, max_len)?.into_owned();
        r.finish()?;
        Ok(out)
    }

    #[test]
    fn nonzero_bytes_are_counted_and_found_a_block_at_a_time() {
        let mut x = 1u64;
        for len in [0usize, 1, 7, 8, 9, 63, 64, 65, 127, 128, 1000] {
            let data: Vec<u8> = (0..len)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    [0u8, 0, 0, 1, 0x80, 0x7f, 0xff][(x >> 60) as usize % 7]
                })
                .collect();
            assert_eq!(count_nonzero(&data), data.iter().filter(|&&b| b != 0).count(), "{len} bytes");
            // Both block kernels against a byte-by-byte look.
            let mut found = Vec::new();
            let whole = for_each_nonzero_block(&data, |at, mut mask| {
                while mask != 0 {
                    found.push(at + mask.trailing_zeros() as usize);
                    mask &= mask - 1;
                }
            });
            let want: Vec<usize> = (0..whole).filter(|&i| data[i] != 0).collect();
            assert_eq!(found, want, "{len} bytes");
            for (b, block) in data[..whole].chunks_exact(64).enumerate() {
                let bits: u64 = block.iter().enumerate().map(|(k, &v)| u64::from(v != 0) << k).sum();
                assert_eq!(nonzero_mask_portable(block), bits, "{len} bytes, block {b}");
            }
        }
    }

    #[test]
    fn mostly_zero_streams_keep_their_nonzero_bytes_and_refuse_damage() {
        // Isolated nonzero bytes, gaps of every size (255 and over escape).
        let mut data = vec![0u8; 5000];
        for (i, at) in [0usize, 1, 3, 258, 513, 514, 1800, 4999].iter().enumerate() {
            data[*at] = (i as u8).wrapping_mul(37) | 1;
        }
        let mut stream = Vec::new();
        put_mostly_zero(&mut stream, &data, 1);
        assert_eq!(stream[0], NONZERO, "the sparse form is the smaller here");
        assert!(stream.len() < 40, "{} bytes", stream.len());
        assert_eq!(read_back(&stream, data.len()).unwrap(), data);
        // Every cut is refused, never read past.
        for cut in 0..stream.len() {
            assert!(read_back(&stream[..cut], data.len()).is_err(), "cut at {cut}");
        }
        // A length over the caller's bound, a nonzero byte past the end, a
        // zero among the values.
        assert!(read_back(&stream, data.len() - 1).is_err());
        let mut bad = stream.clone();
        let last_value = bad.len() - 1;
        bad[last_value] = 0;
        assert!(read_back(&bad, data.len()).unwrap_err().to_string().contains("zero among"));
        let mut tight = stream.clone();
        // Rewrite the length to 4999: the byte at index 4999 no longer fits.
        let mut len = Vec::new();
        put_varint(&mut len, 4999);
        tight.splice(1..1 + len.len(), len);
        assert!(read_back(&tight, data.len()).unwrap_err().to_string().contains("beyond"));
        // An escaped gap as large as a varint holds: refused, not wrapped.
        let mut huge = vec![NONZERO];
        put_varint(&mut huge, 5000);
        put_varint(&mut huge, 1);
        huge.push(255);
        put_varint(&mut huge, u64::MAX);
        huge.push(7);
        assert!(read_back(&huge, 5000).unwrap_err().to_string().contains("beyond"));
        // More nonzero bytes claimed than the stream has bytes: refused
        // before anything is sized by the count.
        let mut claims = vec![NONZERO];
        put_varint(&mut claims, 4);
        put_varint(&mut claims, 1 << 40);
        let err = read_back(&claims, 5000).unwrap_err().to_string();
        assert!(err.contains("1099511627776 nonzero bytes in a stream of 4"), "{err}");
        // Nonzero bytes in one long run: zstd is tried, and wins.
        let mut runs = vec![0u8; 5000];
        runs[1000..1400].fill(0x3c);
        let mut stream = Vec::new();
        put_mostly_zero(&mut stream, &runs, 1);
        assert_eq!(stream[0], ZSTD, "{} bytes", stream.len());
        assert!(stream.len() < 100, "{} bytes", stream.len());
        assert_eq!(read_back(&stream, runs.len()).unwrap(), runs);
        // At most one nonzero byte in eight: the limit is checked in one
        // pass, in the whole blocks and in the tail past them (1000 bytes:
        // 15 blocks and 40 more), and a stream over it is left whole to
        // `put_stream`.
        for (spacing, tail_only) in [(8usize, false), (7, false), (8, true), (7, true)] {
            let mut data = vec![0u8; 1000];
            let from = if tail_only { 960 } else { 0 };
            for at in (from..1000).step_by(spacing) {
                data[at] = 0x41;
            }
            if tail_only {
                // Up to the limit (125) in the blocks, then the tail's.
                for at in (0..960).step_by(8).take(125 - if spacing == 8 { 5 } else { 4 }) {
                    data[at] = 0x42;
                }
            }
            let nonzero = data.iter().filter(|&&b| b != 0).count();
            let mut stream = vec![9u8];
            put_mostly_zero(&mut stream, &data, 1);
            assert_eq!(stream[1] == NONZERO, nonzero <= 125, "{nonzero} nonzero bytes, spacing {spacing}");
            assert_eq!(read_back(&stream[1..], data.len()).unwrap(), data);
        }
        // Dense data keeps the usual codecs.
        let dense: Vec<u8> = (0..5000u32).map(|i| (i % 7) as u8).collect();
        let mut stream = Vec::new();
        put_mostly_zero(&mut stream, &dense, 1);
        assert_ne!(stream[0], NONZERO);
        assert_eq!(read_back(&stream, dense.len()).unwrap(), dense);
    }
}
