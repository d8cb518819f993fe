//! The chunk codec: turns the old and new stored bytes of one element range
//! into a compact payload of changes, and applies such a payload in place.
//!
//! A chunk's changes are either XOR masks (old ^ new, exact for any bit
//! pattern and self-inverse) or overwrites (the new bits, idempotent). The
//! encoder picks the smallest representation per chunk:
//! - `Rice`: the positions' gaps as Rice codes (`rice`), plus the value
//!   words split into byte planes;
//! - `Sparse`: gap-coded positions (one byte per gap, 255 escapes to a varint
//!   stream, through zstd) plus byte planes;
//! - `Bitmap`: one bit per element plus byte planes of the changed values;
//! - `Dense`: byte planes of every element's value (XOR or new);
//! - `Raw`: every element's value verbatim, no compression.
//!
//! Every stream goes through zstd when that is smaller. Decoding needs only
//! the payload (context-free mode).

pub mod context;
pub mod range;
mod scan;
pub mod streams;
mod bits;
mod huffman;
mod rice;
mod step_tables;
#[cfg(target_arch = "x86_64")]
mod apply_avx2;
#[cfg(target_arch = "x86_64")]
mod gather_x86;
#[cfg(target_arch = "x86_64")]
mod x86;

/// Whether this CPU has AVX2, for the kernels that need nothing more (the
/// sparse apply's, the Rice reader's low parts, the context mode's survey
/// and step decoding, the compiler-vectorised loops); detected once.
#[cfg(target_arch = "x86_64")]
fn avx2_available() -> bool {
    // AES-NI too, for the digest moves of the AVX2 apply (every AVX2 CPU
    // has it).
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("aes"))
}

use crate::digest::{DigestMoves, DigestSum};
pub use scan::{find_changes, find_changes_tracked};
use crate::error::{Error, Result};
use streams::{get_varint, put_mostly_zero, put_stream, put_symbols, put_varint, varint_len, StreamReader};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ChangeKind {
    /// Payload values are old ^ new; applying twice undoes the change.
    Xor = 0,
    /// Payload values are the new bits; applying twice is harmless.
    Overwrite = 1,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Encoding {
    /// Positions as gap bytes (SIMD prefix sums when decoding), values as
    /// byte planes.
    Sparse = 0,
    /// Positions as one bit per element, values as byte planes.
    Bitmap = 1,
    /// Every element's value, as byte planes.
    Dense = 2,
    /// Every element's value, as is.
    Raw = 3,
    /// Positions as Rice codes (no table to send, near the entropy of
    /// uniformly scattered changes), values as byte planes.
    Rice = 4,
}

/// The encodings, by code.
pub const ENCODINGS: [Encoding; 5] = [Encoding::Sparse, Encoding::Bitmap, Encoding::Dense, Encoding::Raw, Encoding::Rice];

/// How the decoder reads the payload: `Free` needs nothing but the payload;
/// `Context` (reserved) also reads the base values of the chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Mode {
    Free = 0,
    Context = 1,
}

impl ChangeKind {
    pub fn from_code(code: u8, context: &str) -> Result<Self> {
        match code {
            0 => Ok(ChangeKind::Xor),
            1 => Ok(ChangeKind::Overwrite),
            _ => Err(Error::UnknownCode { what: "change kind", code, context: context.into() }),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            ChangeKind::Xor => "xor",
            ChangeKind::Overwrite => "overwrite",
        }
    }
}

impl Encoding {
    pub fn from_code(code: u8, context: &str) -> Result<Self> {
        match code {
            0 => Ok(Encoding::Sparse),
            1 => Ok(Encoding::Bitmap),
            2 => Ok(Encoding::Dense),
            3 => Ok(Encoding::Raw),
            4 => Ok(Encoding::Rice),
            _ => Err(Error::UnknownCode { what: "encoding", code, context: context.into() }),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Encoding::Sparse => "sparse",
            Encoding::Bitmap => "bitmap",
            Encoding::Dense => "dense",
            Encoding::Raw => "raw",
            Encoding::Rice => "rice",
        }
    }
}

impl Mode {
    pub fn from_code(code: u8, context: &str) -> Result<Self> {
        match code {
            0 => Ok(Mode::Free),
            1 => Ok(Mode::Context),
            _ => Err(Error::UnknownCode { what: "mode", code, context: context.into() }),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Mode::Free => "free",
            Mode::Context => "context",
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct EncodeOptions {
    pub kind: ChangeKind,
    pub zstd_level: i32,
}

impl Default for EncodeOptions {
    fn default() -> Self {
        EncodeOptions { kind: ChangeKind::Xor, zstd_level: 1 }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodedChunk {
    pub encoding: Encoding,
    pub mode: Mode,
    pub n_changed: u32,
    pub payload: Vec<u8>,
}

/// Changed positions of a chunk (ascending, relative to the chunk start) and
/// their value words (XOR masks or new bits), as the diff scan or a GPU
/// compaction kernel produces them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SparseChanges {
    pub positions: Vec<u32>,
    pub values: Vec<u64>,
}

fn lane_mask(width: usize) -> u64 {
    if width == 8 {
        u64::MAX
    } else {
        (1u64 << (8 * width)) - 1
    }
}

#[inline(always)]
fn write_word(dst: &mut [u8], v: u64) {
    match dst.len() {
        1 => dst[0] = v as u8,
        2 => dst.copy_from_slice(&(v as u16).to_le_bytes()),
        4 => dst.copy_from_slice(&(v as u32).to_le_bytes()),
        8 => dst.copy_from_slice(&v.to_le_bytes()),
        n => dst.copy_from_slice(&v.to_le_bytes()[..n]),
    }
}

/// How many of `items` are each of `0..n`, counted in four interleaved
/// sets (item `j` in set `j % 4`): a few values take most items, and with
/// one counter each increment would wait on the one before.
fn counts(items: impl Iterator<Item = usize>, n: usize) -> Vec<u64> {
    let mut sets = vec![0u64; 4 * n];
    for (j, item) in items.enumerate() {
        sets[(j % 4) * n + item] += 1;
    }
    (0..n).map(|i| (0..4).map(|set| sets[set * n + i]).sum()).collect()
}

#[inline(always)]
fn read_word(bytes: &[u8]) -> u64 {
    // Fixed-size loads: a variable-length copy would be a memcpy call.
    match bytes.len() {
        1 => u64::from(bytes[0]),
        2 => u64::from(u16::from_le_bytes([bytes[0], bytes[1]])),
        4 => u64::from(u32::from_le_bytes(bytes.try_into().expect("4 bytes"))),
        8 => u64::from_le_bytes(bytes.try_into().expect("8 bytes")),
        n => {
            let mut w = [0u8; 8];
            w[..n].copy_from_slice(bytes);
            u64::from_le_bytes(w)
        }
    }
}

fn check_width(width: usize) -> Result<()> {
    match width {
        1 | 2 | 4 | 8 => Ok(()),
        _ => Err(Error::Invalid(format!("word width must be 1, 2, 4 or 8 bytes, got {width}"))),
    }
}

/// A little-endian word of the codec (the element width).
pub(crate) trait Word {
    const BYTES: usize;
    fn load(b: &[u8]) -> u64;
    fn store(b: &mut [u8], v: u64);
}

macro_rules! word {
    ($t:ty) => {
        impl Word for $t {
            const BYTES: usize = std::mem::size_of::<$t>();
            #[inline(always)]
            fn load(b: &[u8]) -> u64 {
                <$t>::from_le_bytes(b.try_into().expect("one word")) as u64
            }
            #[inline(always)]
            fn store(b: &mut [u8], v: u64) {
                b.copy_from_slice(&(v as $t).to_le_bytes());
            }
        }
    };
}
word!(u8);
word!(u16);
word!(u32);
word!(u64);

fn planes_of(values: &[u64], width: usize) -> Vec<Vec<u8>> {
    #[cfg(target_arch = "x86_64")]
    if width <= 4 && gather_x86::available() {
        // Safety: the CPU has the kernels' AVX-512 (`available`), and the
        // width is 1, 2 or 4.
        #[allow(unsafe_code)]
        return unsafe {
            match width {
                1 => gather_x86::split_planes::<1>(values),
                2 => gather_x86::split_planes::<2>(values),
                _ => gather_x86::split_planes::<4>(values),
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2_available() {
        // Safety: the CPU supports AVX2 (checked just above).
        #[allow(unsafe_code)]
        return unsafe { planes_of_avx2(values, width) };
    }
    planes_of_any(values, width)
}

/// `planes_of_any` compiled for AVX2, where the compiler vectorises it.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2")]
unsafe fn planes_of_avx2(values: &[u64], width: usize) -> Vec<Vec<u8>> {
    planes_of_any(values, width)
}

#[inline(always)]
fn planes_of_any(values: &[u64], width: usize) -> Vec<Vec<u8>> {
    match width {
        1 => planes_n::<1>(values),
        2 => planes_n::<2>(values),
        4 => planes_n::<4>(values),
        _ => planes_n::<8>(values),
    }
}

/// Byte planes of `W`-byte words (plain loops, so that they are inlined and
/// vectorised where the caller is compiled for AVX2).
#[inline(always)]
fn planes_n<const W: usize>(values: &[u64]) -> Vec<Vec<u8>> {
    let mut planes = Vec::with_capacity(W);
    for j in 0..W {
        let mut plane = vec![0u8; values.len()];
        for (b, &v) in plane.iter_mut().zip(values) {
            *b = (v >> (8 * j)) as u8;
        }
        planes.push(plane);
    }
    planes
}

fn put_planes(out: &mut Vec<u8>, planes: &[Vec<u8>], level: i32) {
    // Most significant plane first: its stream is the most compressible
    // (mostly zeros, with runs); the lower planes are near-random symbols.
    for (k, plane) in planes.iter().rev().enumerate() {
        if k == 0 {
            put_mostly_zero(out, plane, level);
        } else {
            put_symbols(out, plane, level);
        }
    }
}

/// A sparse payload's position streams (its planes follow), from the
/// changes' gaps (`position - previous - 1`, the first previous -1).
fn sparse_positions(gaps: &[u32], level: i32) -> Vec<u8> {
    let (gaps, overflow) = gap_streams(gaps);
    let mut out = Vec::new();
    put_symbols(&mut out, &gaps, level);
    put_stream(&mut out, &overflow, level);
    out
}

/// A payload of one of the encodings that list the changes (sparse, rice,
/// bitmap): its position part, then the value planes all three share.
fn with_planes(mut positions: Vec<u8>, planes: &[u8]) -> Vec<u8> {
    positions.extend_from_slice(planes);
    positions
}

/// The gaps of ascending positions: `position - previous - 1`, the first
/// previous being -1 (what `rice::gaps_and_best_parameter` writes).
#[cfg(test)]
fn position_gaps(positions: &[u32]) -> Vec<u32> {
    let mut previous = -1i64;
    positions
        .iter()
        .map(|&p| {
            let gap = (i64::from(p) - previous - 1) as u32;
            previous = i64::from(p);
            gap
        })
        .collect()
}

thread_local! {
    /// `with_position_gaps`'s buffer, kept between chunks: a fresh one of a
    /// large chunk's size would be mapped (and its pages faulted in) anew
    /// for each.
    static GAPS: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `f(position_gaps(positions), best_rice_parameter of them)`, the gaps in
/// a buffer reused by the thread.
fn with_position_gaps<R>(positions: &[u32], f: impl FnOnce(&[u32], (u32, u64)) -> R) -> R {
    GAPS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut gaps) => {
            gaps.clear();
            let rice = rice::gaps_and_best_parameter(positions, &mut gaps);
            let out = f(&gaps, rice);
            // At most 4 MiB kept per thread (a default chunk's gaps at 50 %).
            if gaps.capacity() > 1 << 20 {
                *gaps = Vec::new();
            }
            out
        }
        // Only if `f` itself encodes a chunk on this thread.
        Err(_) => {
            let mut gaps = Vec::new();
            let rice = rice::gaps_and_best_parameter(positions, &mut gaps);
            f(&gaps, rice)
        }
    })
}

/// A rice payload's position part (its planes follow): the parameter `k`,
/// then the Rice codes of the `gaps` (`bits` of them), stored (zstd finds
/// nothing in them).
fn rice_positions(gaps: &[u32], k: u32, bits: u64) -> Vec<u8> {
    let low_bits = gaps.len() as u64 * u64::from(k);
    let mut codes = rice::RiceWriter::with_capacity(low_bits, bits - low_bits);
    codes.put_gaps(gaps, k, bits);
    // Sized for the positions alone. Tried and dropped: room made here for
    // the planes too, and the planes' Huffman frames written in place
    // into it (no copy of each frame): the payloads then grew into fresh
    // pages on every chunk, and the free diff at fp32m 10->15 took about
    // 5 % longer (page faults 2.4 % of its profile).
    let len = rice_positions_len(gaps.len(), k, bits);
    // The unary parts are copied a word at a time: room for a word past
    // the end, so that the copy does not grow the buffer.
    let mut out = Vec::with_capacity(len + 16);
    out.push(k as u8);
    codes.finish_stored_into(&mut out);
    debug_assert_eq!(out.len(), len);
    out
}

/// The bytes `rice_positions` writes for `m` gaps whose Rice codes take
/// `bits` with parameter `k`: `k`, a stored stream's header (a byte and a
/// varint), the low parts and the unary parts, each padded to whole bytes.
fn rice_positions_len(m: usize, k: u32, bits: u64) -> usize {
    let low_bits = m as u64 * u64::from(k);
    let codes = (low_bits.div_ceil(8) + (bits - low_bits).div_ceil(8)) as usize;
    2 + varint_len(codes as u64) + codes
}

/// Whether the sparse encoding's gap bytes could take fewer than `bytes`,
/// estimated from a sample of the gaps (every eighth of a long list): the
/// size of their Huffman code, corrected for the rare gaps a sample misses
/// (Miller and Madow's `(symbols - 1) / (2 N ln 2)` bits per gap), plus
/// zstd's headers and table (measured on those chunks: 20 bytes and
/// 0.6-1.2 bytes per symbol of the whole list, about one per symbol of the
/// sample). zstd's matches can do better still on gaps that
/// repeat in runs, whose Huffman code is short too. On the training pairs'
/// chunks of 4096 gaps or more the estimate is off from the gap bytes'
/// size by 0.84 % on average (0.72 % sampling every fourth, 1.53 % every
/// sixteenth), by at most 7 % where changes cluster (an underestimate,
/// where they win by 11 % or more), well inside `gap_bytes_margin_percent`.
fn gap_bytes_could_beat(gaps: &[u32], bytes: usize) -> bool {
    // Below this their headers and table alone outweigh what they could
    // save (a microsecond per chunk not spent on the estimate).
    if gaps.len() < 256 {
        return false;
    }
    let stride = (gaps.len() / 1024).clamp(1, 8);
    // Four sets of counts, so that a run of one gap waits less on itself
    // (the common small gaps repeat: with two sets the estimate took 2.6 %
    // of the free diff at fp32m 10->15).
    let mut sets = [[0u32; 256]; 4];
    let mut quads = gaps.chunks_exact(4 * stride);
    for quad in &mut quads {
        for (k, set) in sets.iter_mut().enumerate() {
            set[quad[k * stride].min(255) as usize] += 1;
        }
    }
    // The samples of a last part too short for four (two of them at most).
    for pair in quads.remainder().chunks_exact(2 * stride) {
        sets[0][pair[0].min(255) as usize] += 1;
        sets[1][pair[stride].min(255) as usize] += 1;
    }
    let mut weights: Vec<u64> = Vec::with_capacity(256);
    weights.extend((0..256).map(|v| u64::from(sets[0][v] + sets[1][v] + sets[2][v] + sets[3][v])).filter(|&c| c > 0));
    weights.sort_unstable();
    let sampled: u64 = weights.iter().sum();
    let symbols = weights.len() as f64;
    let unseen_bits = gaps.len() as f64 * (symbols - 1.0) / (2.0 * sampled as f64 * std::f64::consts::LN_2);
    let code_bits = huffman_bits(&weights) as f64 * gaps.len() as f64 / sampled as f64 + unseen_bits;
    code_bits / 8.0 + 20.0 + symbols < bytes as f64
}

/// How much smaller than the Rice codes (percent) the gap bytes must be
/// estimated to come out before the encoder builds them, at a zstd level.
/// At the default level 1 the encoder spends its time where it pays: on
/// the training pairs the gap bytes win by 11-16 % where changes cluster
/// (embeddings, pure-bf16 steps) and by 0.1-1 % on uniformly scattered
/// changes, where building them (a Huffman code over a byte per change)
/// cost about a tenth of the encode for at most 0.3 % of the payload.
/// Higher levels build them whenever they could be smaller.
const fn gap_bytes_margin_percent(level: i32) -> usize {
    if level <= 1 {
        3
    } else {
        0
    }
}

/// The bits of the Huffman code of symbols with these counts (ascending):
/// the sum of the merged weights, merging the two lightest of the leaves
/// and the merged nodes (which come out in ascending order) each time.
fn huffman_bits(leaves: &[u64]) -> u64 {
    // The merged nodes, a queue: taken from `next`, added at the end.
    let mut merged = Vec::with_capacity(leaves.len());
    let (mut leaf, mut next, mut bits) = (0, 0, 0);
    let mut lightest = |merged: &Vec<u64>| match (leaves.get(leaf), merged.get(next)) {
        (Some(&l), Some(&m)) if m < l => {
            next += 1;
            Some(m)
        }
        (Some(&l), _) => {
            leaf += 1;
            Some(l)
        }
        (None, m) => {
            next += 1;
            m.copied()
        }
    };
    while let (Some(a), Some(b)) = (lightest(&merged), lightest(&merged)) {
        bits += a + b;
        merged.push(a + b);
    }
    bits
}

/// The positions of `m` changes in a chunk of `n` elements from their Rice
/// codes with parameter `k`.
fn positions_from_rice(codes: &[u8], k: u32, m: usize, n: usize, context: &str) -> Result<Vec<u32>> {
    let bad = |detail: &str| Error::corrupt(context, detail.to_string());
    let mut reader = rice::RiceReader::new(codes, m as u64 * u64::from(k)).map_err(bad)?;
    let mut positions = Vec::new();
    reader.read_ascending(k, m as u64, n as u64, &mut positions).map_err(bad)?;
    reader.finish().map_err(bad)?;
    Ok(positions)
}

/// The gap bytes of the changes' gaps (255 escapes to a varint of
/// `gap - 255` in the overflow stream), made from the gaps the Rice
/// parameter was chosen on.
fn gap_streams(gaps: &[u32]) -> (Vec<u8>, Vec<u8>) {
    #[cfg(target_arch = "x86_64")]
    if avx2_available() {
        // Safety: the CPU supports AVX2 (checked just above).
        #[allow(unsafe_code)]
        return unsafe { gap_streams_avx2(gaps) };
    }
    gap_streams_any(gaps)
}

/// `gap_streams_any` compiled for AVX2, where the compiler vectorises it.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2")]
unsafe fn gap_streams_avx2(gaps: &[u32]) -> (Vec<u8>, Vec<u8>) {
    gap_streams_any(gaps)
}

#[inline(always)]
fn gap_streams_any(gaps: &[u32]) -> (Vec<u8>, Vec<u8>) {
    // Clamped to 255 (vectorises); the rare escapes are coded in a second
    // pass.
    let bytes: Vec<u8> = gaps.iter().map(|&g| g.min(255) as u8).collect();
    let mut overflow = Vec::new();
    if bytes.contains(&255) {
        // The escapes found 64 at a time as a bit mask (compares), where a
        // test of every gap in turn took most of this function's time on
        // the embeddings' chunks (an escape every few dozen gaps).
        for (block, gaps) in bytes.chunks(64).zip(gaps.chunks(64)) {
            let mut escapes = block.iter().enumerate().fold(0u64, |m, (i, &b)| m | u64::from(b == 255) << i);
            while escapes != 0 {
                put_varint(&mut overflow, u64::from(gaps[escapes.trailing_zeros() as usize] - 255));
                escapes &= escapes - 1;
            }
        }
    }
    (bytes, overflow)
}

/// A bitmap payload's position part (its planes follow).
fn bitmap_positions(positions: &[u32], n: usize, level: i32) -> Vec<u8> {
    let mut bitmap = vec![0u8; n.div_ceil(8)];
    for &p in positions {
        bitmap[p as usize / 8] |= 1 << (p % 8);
    }
    let mut out = Vec::new();
    put_symbols(&mut out, &bitmap, level);
    out
}

fn dense_values(old: &[u8], new: &[u8], kind: ChangeKind) -> Vec<u8> {
    match kind {
        ChangeKind::Xor => old.iter().zip(new).map(|(a, b)| a ^ b).collect(),
        ChangeKind::Overwrite => new.to_vec(),
    }
}

fn encode_dense(values: &[u8], width: usize, level: i32) -> Vec<u8> {
    let planes: Vec<Vec<u8>> =
        (0..width).map(|j| values.iter().skip(j).step_by(width).copied().collect()).collect();
    let mut out = Vec::new();
    put_planes(&mut out, &planes, level);
    out
}

/// Encode the changes between `old` and `new` (one chunk). `None` when the
/// chunk did not change.
pub fn encode_chunk(old: &[u8], new: &[u8], width: usize, opts: EncodeOptions) -> Result<Option<EncodedChunk>> {
    encode_chunk_with_context(old, new, width, opts, None)
}

/// Encode a chunk, trying the context-aware mode too when `model` is given
/// (the decoder then reads the chunk's base values): the smaller wins.
pub fn encode_chunk_with_context(
    old: &[u8],
    new: &[u8],
    width: usize,
    opts: EncodeOptions,
    model: Option<&context::ContextModel>,
) -> Result<Option<EncodedChunk>> {
    let (found, _) = FoundChanges::find(old, new, width, opts.kind, model, None)?;
    Ok((!found.is_empty()).then(|| found.encode(old, new, width, opts, model)))
}

/// A chunk's changes as its mode's encoder takes them: byte planes for the
/// free mode (`find_split_changes`), XOR words where a context model is
/// asked for (`encode_found` also tries the free mode with them).
pub enum FoundChanges {
    Split(SplitChanges),
    Xor(SparseChanges),
}

impl FoundChanges {
    /// The changes between `old` and `new` for a chunk encoded with
    /// `model` (or none) and `kind`, and, with `tracked_from` (the chunk's
    /// first element in its tensor), how the tensor digest moves.
    pub fn find(
        old: &[u8],
        new: &[u8],
        width: usize,
        kind: ChangeKind,
        model: Option<&context::ContextModel>,
        tracked_from: Option<u64>,
    ) -> Result<(FoundChanges, DigestSum)> {
        if model.is_none() {
            let (split, moved) = find_split_changes(old, new, width, kind, tracked_from)?;
            return Ok((FoundChanges::Split(split), moved));
        }
        let (xor, moved) = match tracked_from {
            Some(first) => find_changes_tracked(old, new, width, ChangeKind::Xor, first)?,
            None => (find_changes(old, new, width, ChangeKind::Xor)?, DigestSum::ZERO),
        };
        Ok((FoundChanges::Xor(xor), moved))
    }

    /// How many elements changed.
    pub fn len(&self) -> usize {
        match self {
            FoundChanges::Split(split) => split.positions.len(),
            FoundChanges::Xor(xor) => xor.positions.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Encode them (non-empty), with the `model` they were found for.
    pub fn encode(self, old: &[u8], new: &[u8], width: usize, opts: EncodeOptions, model: Option<&context::ContextModel>) -> EncodedChunk {
        match self {
            FoundChanges::Split(split) => encode_split(old, new, width, opts, split),
            FoundChanges::Xor(xor) => encode_found(old, new, width, opts, model, xor),
        }
    }
}

/// Encode a chunk whose XOR changes were already found (non-empty).
pub fn encode_found(
    old: &[u8],
    new: &[u8],
    width: usize,
    opts: EncodeOptions,
    model: Option<&context::ContextModel>,
    xor: SparseChanges,
) -> EncodedChunk {
    let n = old.len() / width;
    let m = xor.positions.len();
    let ctx_payload = model.map(|model| context::encode(old, new, &xor, model, opts.zstd_level));
    // The free mode wins on small chunks, where the context mode's fixed
    // overhead dominates; on larger ones the context payload is far smaller
    // (0.6-0.85 against 1.1-1.5 bytes per change on the fp32-master and bf16
    // training pairs; the free mode never won a chunk of 256 changes or more
    // whose context payload stayed within a byte per change). So the free
    // mode, which costs as much time as the context mode, is skipped there.
    if let Some(ctx) = ctx_payload.as_ref().filter(|ctx| m >= 256 && ctx.len() <= m) {
        return EncodedChunk { encoding: Encoding::Sparse, mode: Mode::Context, n_changed: m as u32, payload: ctx.clone() };
    }
    let changes = match opts.kind {
        ChangeKind::Xor => xor,
        ChangeKind::Overwrite => SparseChanges {
            values: xor.positions.iter().map(|&p| read_word(&new[p as usize * width..][..width])).collect(),
            positions: xor.positions,
        },
    };
    let free = encode_changes(&changes, n, width, opts, || dense_values(old, new, opts.kind));
    match ctx_payload {
        Some(ctx) if ctx.len() < free.payload.len() => {
            EncodedChunk { encoding: Encoding::Sparse, mode: Mode::Context, n_changed: m as u32, payload: ctx }
        }
        _ => free,
    }
}

/// Encode changes already found (e.g. by a GPU compaction kernel). `dense`
/// gives every element's value when a dense representation is considered.
pub fn encode_changes(
    changes: &SparseChanges,
    n: usize,
    width: usize,
    opts: EncodeOptions,
    dense: impl FnOnce() -> Vec<u8>,
) -> EncodedChunk {
    encode_positions(&changes.positions, || planes_of(&changes.values, width), n, width, opts, dense)
}

/// Changes as the free mode codes them: ascending positions and the value
/// words split into byte planes (plane `j` holds byte `j` of each).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SplitChanges {
    pub positions: Vec<u32>,
    pub planes: Vec<Vec<u8>>,
}

/// Find the changes between `old` and `new` (same length, a multiple of
/// `width`) of `kind`, their values split into byte planes, and, with
/// `tracked_from` (the chunk's first element in its tensor), how the tensor
/// digest moves: `find_changes_tracked` for `encode_split`, without whole
/// value words in between where the CPU runs the one-pass kernel.
pub fn find_split_changes(old: &[u8], new: &[u8], width: usize, kind: ChangeKind, tracked_from: Option<u64>) -> Result<(SplitChanges, DigestSum)> {
    let (positions, planes, moved) = scan::find_split(old, new, width, kind, tracked_from)?;
    Ok((SplitChanges { positions, planes }, moved))
}

/// Encode changes that `find_split_changes` found (of `opts.kind`) in the
/// free mode.
pub fn encode_split(old: &[u8], new: &[u8], width: usize, opts: EncodeOptions, changes: SplitChanges) -> EncodedChunk {
    let n = old.len() / width;
    let SplitChanges { positions, planes } = changes;
    encode_positions(&positions, || planes, n, width, opts, || dense_values(old, new, opts.kind))
}

/// `encode_changes` with the value planes made on demand.
fn encode_positions(
    positions: &[u32],
    planes: impl FnOnce() -> Vec<Vec<u8>>,
    n: usize,
    width: usize,
    opts: EncodeOptions,
    dense: impl FnOnce() -> Vec<u8>,
) -> EncodedChunk {
    let m = positions.len();
    let density = m as f64 / n.max(1) as f64;
    let level = opts.zstd_level;
    let mut best: Option<(Encoding, Vec<u8>)> = None;
    let consider = |enc: Encoding, payload: Vec<u8>, best: &mut Option<(Encoding, Vec<u8>)>| {
        if best.as_ref().is_none_or(|(_, b)| payload.len() < b.len()) {
            *best = Some((enc, payload));
        }
    };
    if density <= 0.90 {
        // The value planes are compressed once, after the first listing's
        // positions, and copied behind a bitmap's where that is tried too
        // (from 25 % changed).
        let (first, mut payload) = if density <= 0.30 {
            // Rice codes, unless the gap bytes come out smaller (where the
            // gaps are far from geometric); those are built only where
            // their Huffman code's size says they could be.
            with_position_gaps(positions, |gaps, (k, bits)| {
                let rice_len = rice_positions_len(m, k, bits);
                match gap_bytes_could_beat(gaps, rice_len - rice_len / 100 * gap_bytes_margin_percent(level)).then(|| sparse_positions(gaps, level)) {
                    Some(sparse) if sparse.len() < rice_len => (Encoding::Sparse, sparse),
                    _ => (Encoding::Rice, rice_positions(gaps, k, bits)),
                }
            })
        } else {
            (Encoding::Bitmap, bitmap_positions(positions, n, level))
        };
        let planes_at = payload.len();
        put_planes(&mut payload, &planes(), level);
        let planes = &payload[planes_at..];
        let bitmap = (first != Encoding::Bitmap && density >= 0.25)
            .then(|| with_planes(bitmap_positions(positions, n, level), planes));
        consider(first, payload, &mut best);
        if let Some(payload) = bitmap {
            consider(Encoding::Bitmap, payload, &mut best);
        }
    }
    if density >= 0.25 {
        let values = dense();
        consider(Encoding::Dense, encode_dense(&values, width, level), &mut best);
        consider(Encoding::Raw, values, &mut best);
    } else if best.as_ref().is_some_and(|(_, b)| b.len() >= n * width) {
        consider(Encoding::Raw, dense(), &mut best);
    }
    let (encoding, payload) = best.expect("at least one encoding is always considered");
    EncodedChunk { encoding, mode: Mode::Free, n_changed: m as u32, payload }
}

/// Decoded changes of a chunk, ready to be applied.
enum Decoded {
    /// Positions and byte planes (plane j holds byte j of each value).
    Sparse { positions: Vec<u32>, planes: Vec<Vec<u8>> },
    /// Every element's value bytes, interleaved (Raw) or as planes (Dense).
    Full(Vec<u8>),
}

fn read_planes(r: &mut StreamReader<'_>, width: usize, count: usize) -> Result<Vec<Vec<u8>>> {
    let mut planes: Vec<Vec<u8>> = Vec::with_capacity(width);
    for j in (0..width).rev() {
        planes.push(r.next(&format!("plane {j}"), count, count)?.into_owned());
    }
    planes.reverse();
    Ok(planes)
}

fn decode(payload: &[u8], n: usize, width: usize, encoding: Encoding, n_changed: u32, context: &str) -> Result<Decoded> {
    let m = n_changed as usize;
    if m > n || (m == 0 && n > 0) {
        return Err(Error::corrupt(context, format!("{m} changed elements in a chunk of {n}")));
    }
    match encoding {
        Encoding::Raw => {
            if payload.len() != n * width {
                return Err(Error::corrupt(context, format!("raw payload has {} bytes, expected {}", payload.len(), n * width)));
            }
            Ok(Decoded::Full(payload.to_vec()))
        }
        Encoding::Dense => {
            let mut r = StreamReader::new(payload, context);
            let planes = read_planes(&mut r, width, n)?;
            r.finish()?;
            let mut full = vec![0u8; n * width];
            for (j, plane) in planes.iter().enumerate() {
                for (i, &b) in plane.iter().enumerate() {
                    full[i * width + j] = b;
                }
            }
            Ok(Decoded::Full(full))
        }
        Encoding::Sparse => {
            let mut r = StreamReader::new(payload, context);
            let gaps = r.next("gaps", m, m)?;
            let overflow = r.next("gap overflow", 0, 5 * m)?;
            let planes = read_planes(&mut r, width, m)?;
            r.finish()?;
            let positions = positions_from_gaps(&gaps, &overflow, n, context)?;
            Ok(Decoded::Sparse { positions, planes })
        }
        Encoding::Rice => {
            let k = *payload.first().ok_or_else(|| Error::truncated(context, 1, 0))?;
            if k > 31 {
                return Err(Error::corrupt(context, format!("Rice parameter {k} (at most 31)")));
            }
            let mut r = StreamReader::new(&payload[1..], context);
            let codes = r.next("positions", 0, rice::stream_bound(m, n))?;
            let planes = read_planes(&mut r, width, m)?;
            r.finish()?;
            let positions = positions_from_rice(&codes, u32::from(k), m, n, context)?;
            Ok(Decoded::Sparse { positions, planes })
        }
        Encoding::Bitmap => {
            let mut r = StreamReader::new(payload, context);
            let bitmap = r.next("bitmap", n.div_ceil(8), n.div_ceil(8))?;
            let planes = read_planes(&mut r, width, m)?;
            r.finish()?;
            let mut positions = Vec::with_capacity(m);
            for (byte_i, &byte) in bitmap.iter().enumerate() {
                let mut bits = byte;
                while bits != 0 {
                    let p = byte_i * 8 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    if p >= n {
                        return Err(Error::corrupt(context, "bitmap marks elements past the chunk end"));
                    }
                    positions.push(p as u32);
                }
            }
            if positions.len() != m {
                return Err(Error::corrupt(context, format!("bitmap marks {} elements, header says {m}", positions.len())));
            }
            Ok(Decoded::Sparse { positions, planes })
        }
    }
}

/// A switch for comparing two variants of the code in one process
/// (`examples/ab_timing.rs` flips it between repeats; the variant under
/// study reads it): on this project's noisy hosts only paired repeats show
/// differences of a few percent.
#[cfg(feature = "ab-switch")]
pub static AB_SWITCH: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// How many changes ahead the scalar apply loops prefetch their target
/// words (the vector kernel's is `gather_x86`'s own).
const PREFETCH_AHEAD: usize = 64;

#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // Safety: a prefetch is a hint; it never faults, whatever the address.
    #[allow(unsafe_code)]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Memory a loop will read after it, fetched into L2 a few lines per step
/// of the loop (`prefetcht1`), so that the fetch overlaps the loop's work
/// where it would otherwise follow it. One burst of prefetches before the
/// loop does not: the core holds only a few dozen misses in flight, and
/// the burst waits on memory as the reads it replaces would.
#[cfg(target_arch = "x86_64")]
pub(super) struct Ahead {
    next: *const u8,
    end: *const u8,
    lines_per_step: usize,
}

#[cfg(target_arch = "x86_64")]
impl Ahead {
    /// At most this many lines per step: a loop of few steps (few changes
    /// in a segment) leaves the rest to the hardware prefetcher.
    const MAX_LINES_PER_STEP: usize = 32;

    /// `bytes` fetched over `steps` steps.
    pub(super) fn new(bytes: &[u8], steps: usize) -> Self {
        let lines = bytes.len().div_ceil(64);
        let lines_per_step = if steps == 0 { 0 } else { lines.div_ceil(steps).min(Self::MAX_LINES_PER_STEP) };
        let range = bytes.as_ptr_range();
        Ahead { next: range.start, end: range.end, lines_per_step }
    }

    /// One step of the loop: its share of the lines.
    #[inline(always)]
    pub(super) fn step(&mut self) {
        if self.next < self.end {
            for k in 0..self.lines_per_step {
                // Safety: a prefetch is a hint; it never faults, whatever
                // the address.
                #[allow(unsafe_code)]
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(self.next.wrapping_add(64 * k).cast());
                }
            }
            self.next = self.next.wrapping_add(64 * self.lines_per_step);
        }
    }
}

/// Prefetch the words of the chunk at `base` (`width` bytes each) at
/// `positions[from..]`, the first `count` of those there are: changes are
/// irregular, which the hardware prefetcher does not follow, so the
/// kernels that load or gather them ask a few steps ahead. Where all
/// `count` are there (all but near a chunk's end), one check covers the
/// group: a check per prefetch took seven instructions each, and without
/// them the sparse apply of the training pairs took 0.97-0.99 of the
/// time, the context apply and encode 0.98-0.99 (paired `ab_timing`, a
/// Zen 3 host).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_words(base: *const u8, width: usize, positions: &[u32], from: usize, count: usize) {
    if let Some(group) = from.checked_add(count).and_then(|end| positions.get(from..end)) {
        for &p in group {
            prefetch(base.wrapping_add(p as usize * width));
        }
        return;
    }
    for &p in positions.get(from..).unwrap_or_default().iter().take(count) {
        prefetch(base.wrapping_add(p as usize * width));
    }
}

/// Apply sparse changes given as byte planes, word by word, and accumulate
/// the digest move as the words are written (one pass, no per-change
/// records). Positions were bounds-checked while decoding.
fn apply_sparse<T: Word>(
    target: &mut [u8],
    positions: &[u32],
    planes: &[impl AsRef<[u8]>],
    kind: ChangeKind,
    first_element: u64,
) -> DigestSum {
    let w = T::BYTES;
    let m = positions.len();
    let mut lanes: [&[u8]; 8] = [&[]; 8];
    for (lane, plane) in lanes.iter_mut().zip(planes) {
        *lane = &plane.as_ref()[..m];
    }
    let mut moves = DigestMoves::new(w);
    let xor = kind == ChangeKind::Xor;
    let value_at = |i: usize| {
        let mut value = 0u64;
        for (j, lane) in lanes.iter().enumerate().take(w) {
            value |= u64::from(lane[i]) << (8 * j);
        }
        value
    };
    // The positions are ascending but irregular, which the hardware
    // prefetcher does not follow: ask for the word some changes ahead.
    let base = target.as_ptr();
    let prefetch_ahead = |i: usize| {
        if let Some(&ahead) = positions.get(i + PREFETCH_AHEAD) {
            prefetch(base.wrapping_add(ahead as usize * w));
        }
    };
    // Change `i` (at position `p`), word by word.
    let apply_one = |target: &mut [u8], moves: &mut DigestMoves, i: usize, p: u32| {
        let word = &mut target[p as usize * w..][..w];
        let old = T::load(word);
        let new = if xor { old ^ value_at(i) } else { value_at(i) };
        T::store(word, new);
        moves.word(first_element + u64::from(p), old, new);
    };
    if w == 8 {
        for (i, &p) in positions.iter().enumerate() {
            prefetch_ahead(i);
            apply_one(target, &mut moves, i, p);
        }
        return moves.finish();
    }
    // Words of at most 4 bytes: a vector kernel where the CPU has one
    // (`apply_sparse_kernels`), then the rest word by word.
    #[cfg(target_arch = "x86_64")]
    if let Some((moved, done)) = apply_sparse_kernels(target, positions, &lanes, w, xor, first_element) {
        moves.add(moved);
        for (i, &p) in positions.iter().enumerate().skip(done) {
            apply_one(target, &mut moves, i, p);
        }
        return moves.finish();
    }
    // Else a block at a time: the block's value words are assembled from
    // the planes first (a loop the compiler vectorizes), then written one by
    // one, and the old and new words are hashed together.
    const BLOCK: usize = 256;
    let mut old_words = [0u32; BLOCK];
    let mut new_words = [0u32; BLOCK];
    for (b, block) in positions.chunks(BLOCK).enumerate() {
        let start = b * BLOCK;
        let len = block.len();
        let values = &mut new_words[..len];
        values.fill(0);
        for (j, lane) in lanes.iter().enumerate().take(w) {
            for (v, &byte) in values.iter_mut().zip(&lane[start..start + len]) {
                *v |= u32::from(byte) << (8 * j);
            }
        }
        for (k, &p) in block.iter().enumerate() {
            prefetch_ahead(start + k);
            let at = p as usize * w;
            let word = &mut target[at..at + w];
            let old = T::load(word) as u32;
            let new = if xor { old ^ new_words[k] } else { new_words[k] };
            T::store(word, u64::from(new));
            old_words[k] = old;
            new_words[k] = new;
        }
        moves.words_at(first_element, block, &old_words[..len], &new_words[..len]);
    }
    moves.finish()
}

/// Apply the leading changes of a chunk of words of 1, 2 or 4 bytes (`w`)
/// with the CPU's vector kernel: gathered, hashed and written sixteen at a
/// time with AVX-512 where every load stays in the chunk (all but the last
/// few positions, where a 4-byte load would leave it), else eight at a
/// time with AVX2, hashed as they go. Returns the digest move and how many
/// leading changes it applied; `None` where no kernel runs.
#[cfg(target_arch = "x86_64")]
fn apply_sparse_kernels(
    target: &mut [u8],
    positions: &[u32],
    lanes: &[&[u8]; 8],
    w: usize,
    xor: bool,
    first_element: u64,
) -> Option<(DigestSum, usize)> {
    if let Some(limit) = gather_x86::position_limit(w, target.len(), first_element) {
        let planes = lanes.map(|l| &l[..positions.len().min(l.len())]);
        // Safety: `limit` is the kernel's (`position_limit` also found that
        // the CPU has its features and that `w` is 1, 2 or 4).
        #[allow(unsafe_code)]
        let (moved, done) = unsafe {
            match w {
                1 => gather_x86::apply_sparse::<1>(target, positions, &planes, xor, first_element as u32, limit),
                2 => gather_x86::apply_sparse::<2>(target, positions, &planes, xor, first_element as u32, limit),
                _ => gather_x86::apply_sparse::<4>(target, positions, &planes, xor, first_element as u32, limit),
            }
        };
        if done > 0 {
            return Some((moved, done));
        }
    }
    if !avx2_available() || first_element + positions.last().map_or(0, |&p| u64::from(p)) >= 1 << 32 {
        return None;
    }
    // Safety: the CPU has AVX2, `w` is 1, 2 or 4, and every unit index is
    // below 2^32 (the positions ascend, so the last is the largest).
    #[allow(unsafe_code)]
    let applied = unsafe {
        match w {
            1 => apply_avx2::apply_sparse::<1>(target, positions, lanes, xor, first_element as u32),
            2 => apply_avx2::apply_sparse::<2>(target, positions, lanes, xor, first_element as u32),
            _ => apply_avx2::apply_sparse::<4>(target, positions, lanes, xor, first_element as u32),
        }
    };
    Some(applied)
}

/// Positions from the gap streams (a gap of 255 escapes to the overflow
/// varint stream), checked to lie inside the chunk of `n` elements.
fn positions_from_gaps(gaps: &[u8], overflow: &[u8], n: usize, context: &str) -> Result<Vec<u32>> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // Safety: the CPU supports AVX-512 F (detected).
        #[allow(unsafe_code)]
        return unsafe { positions_from_gaps_avx512(gaps, overflow, n, context) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2_available() {
        // Safety: the CPU supports AVX2 (detected).
        #[allow(unsafe_code)]
        return unsafe { positions_from_gaps_avx2(gaps, overflow, n, context) };
    }
    positions_with(gaps, overflow, n, context, prefix_block_portable, prefix_block_portable)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(unsafe_code)]
unsafe fn positions_from_gaps_avx2(gaps: &[u8], overflow: &[u8], n: usize, context: &str) -> Result<Vec<u32>> {
    // Safety (both closures): they run only inside this AVX2 function.
    #[allow(unsafe_code)]
    let bytes = |g: &[u8; GAP_BLOCK], next, n, out: &mut [u32]| unsafe { prefix_bytes_avx2(g, next, n, out) };
    #[allow(unsafe_code)]
    let words = |g: &[u32; GAP_BLOCK], next, n, out: &mut [u32]| unsafe { prefix_words_avx2(g, next, n, out) };
    positions_with(gaps, overflow, n, context, bytes, words)
}

/// The inclusive prefix sum of `gap + 1` over eight 32-bit gaps.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_code)]
unsafe fn gap_prefix8(x: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let x = _mm256_add_epi32(x, _mm256_set1_epi32(1));
    // Within each 128-bit half, then the low half's total into the high.
    let x = _mm256_add_epi32(x, _mm256_slli_si256::<4>(x));
    let x = _mm256_add_epi32(x, _mm256_slli_si256::<8>(x));
    let low_total = _mm256_permutevar8x32_epi32(x, _mm256_set1_epi32(3));
    _mm256_add_epi32(x, _mm256_blend_epi32::<0xF0>(_mm256_setzero_si256(), low_total))
}

/// Store a block's positions after `next` from the prefix sums of its
/// four quarters (`gap_prefix8`), each carried over the ones before it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_code)]
unsafe fn store_block_positions8(quarters: [std::arch::x86_64::__m256i; 4], next: u64, out: &mut [u32]) {
    use std::arch::x86_64::*;
    let out = &mut out[..GAP_BLOCK];
    // Positions are below 2^32 (u32); only their low bits enter a lane.
    let mut before = _mm256_set1_epi32((next as u32).wrapping_sub(1) as i32);
    for (k, quarter) in quarters.into_iter().enumerate() {
        _mm256_storeu_si256(out.as_mut_ptr().add(8 * k).cast(), _mm256_add_epi32(quarter, before));
        before = _mm256_add_epi32(before, _mm256_permutevar8x32_epi32(quarter, _mm256_set1_epi32(7)));
    }
}

/// `prefix_bytes_avx512` with AVX2: four quarters of eight lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(unsafe_code)]
unsafe fn prefix_bytes_avx2(g: &[u8; GAP_BLOCK], next: u64, n: u64, out: &mut [u32]) -> Option<u64> {
    use std::arch::x86_64::*;
    let quarters: [__m256i; 4] = std::array::from_fn(|k| gap_prefix8(_mm256_cvtepu8_epi32(_mm_loadl_epi64(g.as_ptr().add(8 * k).cast()))));
    // At most 32 * 256: the block's total fits a lane.
    let total: u32 = quarters.iter().map(|&q| _mm256_extract_epi32::<7>(q) as u32).sum();
    let after = next + u64::from(total);
    if after > n {
        return None;
    }
    store_block_positions8(quarters, next, out);
    Some(after)
}

/// `prefix_words_avx512` with AVX2: the block's total in 64 bits first,
/// then only a block that stays below `n` summed in 32-bit lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(unsafe_code)]
unsafe fn prefix_words_avx2(g: &[u32; GAP_BLOCK], next: u64, n: u64, out: &mut [u32]) -> Option<u64> {
    use std::arch::x86_64::*;
    let after = whole_gaps_end(g, next, n)?;
    let quarters: [__m256i; 4] = std::array::from_fn(|k| gap_prefix8(_mm256_loadu_si256(g.as_ptr().add(8 * k).cast())));
    store_block_positions8(quarters, next, out);
    Some(after)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(unsafe_code)]
unsafe fn positions_from_gaps_avx512(gaps: &[u8], overflow: &[u8], n: usize, context: &str) -> Result<Vec<u32>> {
    // Safety (both closures): they run only inside this AVX-512 F function.
    #[allow(unsafe_code)]
    let bytes = |g: &[u8; GAP_BLOCK], next, n, out: &mut [u32]| unsafe { prefix_bytes_avx512(g, next, n, out) };
    #[allow(unsafe_code)]
    let words = |g: &[u32; GAP_BLOCK], next, n, out: &mut [u32]| unsafe { prefix_words_avx512(g, next, n, out) };
    positions_with(gaps, overflow, n, context, bytes, words)
}

/// Gaps decoded per block; a block is one prefix sum.
const GAP_BLOCK: usize = 32;

/// The positions of a block of `GAP_BLOCK` gaps (bytes without escapes,
/// or whole gaps with the escapes replaced), the first one `next +
/// gaps[0]`, into `out`, when every one is below `n` (the position after
/// the last returned); `None` when one is not. Positions are 32-bit, so
/// `n` is at most 2^32.
fn prefix_block_portable<T: Copy + Into<u64>>(g: &[T; GAP_BLOCK], next: u64, n: u64, out: &mut [u32]) -> Option<u64> {
    let mut at = next;
    for (&gap, o) in g.iter().zip(out.iter_mut()) {
        at += gap.into() + 1;
        *o = (at - 1) as u32;
    }
    (at <= n).then_some(at)
}

/// The inclusive prefix sum of `gap + 1` over sixteen 32-bit gaps.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_code)]
unsafe fn gap_prefix(x: std::arch::x86_64::__m512i) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    gather_x86::prefix_sum(_mm512_add_epi32(x, _mm512_set1_epi32(1)))
}

/// Lane 15 of `x`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_code)]
unsafe fn last_lane(x: std::arch::x86_64::__m512i) -> u32 {
    use std::arch::x86_64::*;
    _mm_extract_epi32::<3>(_mm512_extracti32x4_epi32::<3>(x)) as u32
}

/// Store a block's positions after `next`, from the prefix sums of its
/// halves (`gap_prefix`; `low_total` is the low half's last).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_code)]
unsafe fn store_block_positions(low: std::arch::x86_64::__m512i, high: std::arch::x86_64::__m512i, low_total: u32, next: u64, out: &mut [u32]) {
    use std::arch::x86_64::*;
    let out = &mut out[..GAP_BLOCK];
    // Positions are below 2^32 (u32); only their low bits enter a lane.
    let before = (next as u32).wrapping_sub(1);
    _mm512_storeu_si512(out.as_mut_ptr().cast(), _mm512_add_epi32(low, _mm512_set1_epi32(before as i32)));
    _mm512_storeu_si512(out.as_mut_ptr().add(16).cast(), _mm512_add_epi32(high, _mm512_set1_epi32(before.wrapping_add(low_total) as i32)));
}

/// `prefix_block_portable` of gap bytes without escapes, sixteen lanes at
/// a time: the halves are summed independently and the low half's total
/// added to the high one.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,sse4.1")]
#[allow(unsafe_code)]
unsafe fn prefix_bytes_avx512(g: &[u8; GAP_BLOCK], next: u64, n: u64, out: &mut [u32]) -> Option<u64> {
    use std::arch::x86_64::*;
    let low = gap_prefix(_mm512_cvtepu8_epi32(_mm_loadu_si128(g.as_ptr().cast())));
    let high = gap_prefix(_mm512_cvtepu8_epi32(_mm_loadu_si128(g.as_ptr().add(16).cast())));
    let low_total = last_lane(low);
    // At most 32 * 256: the block's total fits a lane.
    let after = next + u64::from(low_total + last_lane(high));
    if after > n {
        return None;
    }
    store_block_positions(low, high, low_total, next, out);
    Some(after)
}

/// `prefix_block_portable` of whole gaps (escapes replaced): the block's
/// total is added up in 64 bits first (a gap may be up to 2^32), and only
/// a block that stays below `n` is summed in 32-bit lanes, where then no
/// partial sum wraps.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,sse4.1")]
#[allow(unsafe_code)]
unsafe fn prefix_words_avx512(g: &[u32; GAP_BLOCK], next: u64, n: u64, out: &mut [u32]) -> Option<u64> {
    use std::arch::x86_64::*;
    let after = whole_gaps_end(g, next, n)?;
    let low = gap_prefix(_mm512_loadu_si512(g.as_ptr().cast()));
    let high = gap_prefix(_mm512_loadu_si512(g.as_ptr().add(16).cast()));
    store_block_positions(low, high, last_lane(low), next, out);
    Some(after)
}

/// The position after a block of whole gaps from `next`, added up in 64
/// bits (a gap may be up to 2^32), when it is at most `n`: the vector
/// kernels then sum the block in 32-bit lanes, where no partial sum wraps.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn whole_gaps_end(g: &[u32; GAP_BLOCK], next: u64, n: u64) -> Option<u64> {
    let after = next + g.iter().map(|&gap| u64::from(gap) + 1).sum::<u64>();
    (after <= n).then_some(after)
}

/// The gap stream decoded a block of `GAP_BLOCK` gaps at a time, each
/// block by one prefix sum written straight into the positions: the gap
/// bytes themselves (`bytes`) where the block has no escape, else its
/// whole gaps, the escapes replaced by `255 + overflow varint` (`words`);
/// either returns `None` when a position would leave the chunk. A block
/// where anything is wrong (a position outside the chunk, the overflow
/// stream ending early) is decoded again a gap at a time
/// (`gaps_one_at_a_time`), which names the first thing wrong; so is the
/// last, partial block.
#[inline(always)]
fn positions_with(
    gaps: &[u8],
    overflow: &[u8],
    n: usize,
    context: &str,
    bytes: impl Fn(&[u8; GAP_BLOCK], u64, u64, &mut [u32]) -> Option<u64>,
    words: impl Fn(&[u32; GAP_BLOCK], u64, u64, &mut [u32]) -> Option<u64>,
) -> Result<Vec<u32>> {
    let mut positions = Vec::with_capacity(gaps.len());
    // Positions are u32: a chunk of more elements holds none past 2^32.
    let limit = (n as u64).min(1 << 32);
    // `next` is the position after the last change.
    let mut next = 0u64;
    let mut opos = 0usize;
    let mut blocks = gaps.chunks_exact(GAP_BLOCK);
    for g in &mut blocks {
        let g: &[u8; GAP_BLOCK] = g.try_into().expect("a whole block");
        let at = positions.len();
        // Zeros in the cache, overwritten at once (no zeroing pass over
        // the whole list first).
        positions.resize(at + GAP_BLOCK, 0);
        let out = &mut positions[at..];
        // (A fold, not `contains`, so that the compiler vectorises it.)
        let escaped = g.iter().fold(false, |any, &gap| any | (gap == 255));
        let block_opos = opos;
        let after = if escaped {
            let mut whole = g.map(u32::from);
            let mut read = opos;
            let fit = g.iter().zip(whole.iter_mut()).filter(|(&gap, _)| gap == 255).all(|(_, w)| match get_varint(overflow, &mut read, 5) {
                // A whole gap reaching the limit cannot be in the chunk.
                Some(more) if 255 + more < limit => {
                    *w = (255 + more) as u32;
                    true
                }
                _ => false,
            });
            let after = if fit { words(&whole, next, limit, out) } else { None };
            opos = read;
            after
        } else {
            bytes(g, next, limit, out)
        };
        match after {
            Some(after) => next = after,
            None => {
                // Only a chunk of more than 2^32 elements gets past this.
                positions.resize(gaps.len(), 0);
                opos = block_opos;
                gaps_one_at_a_time(&gaps[at..], overflow, &mut opos, next, n, context, &mut positions[at..])?;
                return Err(Error::corrupt(context, "positions past 2^32 in a chunk"));
            }
        }
    }
    let at = positions.len();
    positions.resize(gaps.len(), 0);
    gaps_one_at_a_time(blocks.remainder(), overflow, &mut opos, next, n, context, &mut positions[at..])?;
    if opos != overflow.len() {
        return Err(Error::corrupt(context, "unused bytes in the gap overflow stream"));
    }
    Ok(positions)
}

/// `gaps` decoded a gap at a time from `next` (the position after the
/// last change before them), their positions into `out`, escapes' varints
/// read from `opos` on: the last, partial block, and a block the vector
/// sum refused, whose first wrong gap this names. Returns the position
/// after the last.
fn gaps_one_at_a_time(gaps: &[u8], overflow: &[u8], opos: &mut usize, mut next: u64, n: usize, context: &str, out: &mut [u32]) -> Result<u64> {
    for (&gap, o) in gaps.iter().zip(out) {
        let gap = if gap < 255 {
            u64::from(gap)
        } else {
            255 + get_varint(overflow, opos, 5).ok_or_else(|| Error::corrupt(context, "gap overflow stream ends early"))?
        };
        let p = next + gap;
        if p >= n as u64 {
            return Err(Error::corrupt(context, format!("position {p} outside the chunk of {n} elements")));
        }
        *o = p as u32;
        next = p + 1;
    }
    Ok(next)
}

/// A decoded chunk: validated, ready to be applied to a target range.
pub struct DecodedChunk {
    width: usize,
    inner: Decoded,
}

/// Decode and validate a chunk payload of `n` words. Nothing is written.
pub fn decode_chunk(
    payload: &[u8],
    n: usize,
    width: usize,
    encoding: Encoding,
    n_changed: u32,
    context: &str,
) -> Result<DecodedChunk> {
    check_width(width)?;
    Ok(DecodedChunk { width, inner: decode(payload, n, width, encoding, n_changed, context)? })
}

/// Decode a context-mode chunk against its base bytes (the target's current
/// bytes for this chunk, which must be the delta's base).
pub fn decode_chunk_context(
    payload: &[u8],
    base: &[u8],
    width: usize,
    model: &context::ContextModel,
    n_changed: u32,
    kind: ChangeKind,
    context_name: &str,
) -> Result<DecodedChunk> {
    check_width(width)?;
    let (positions, planes) = context::decode_split(payload, base, model, n_changed, kind, context_name)?;
    Ok(DecodedChunk { width, inner: Decoded::Sparse { positions, planes } })
}

/// Decode a context-mode chunk of XOR changes against `target` (the
/// chunk's current bytes, which must be the delta's base) and apply it
/// there in the same pass: returns the decoded chunk (what undoes it) and
/// the digest move of the words written (`first_element`: the chunk's
/// first element in its tensor). On an error nothing of the chunk is left
/// written.
pub fn apply_chunk_context(
    payload: &[u8],
    target: &mut [u8],
    width: usize,
    model: &context::ContextModel,
    n_changed: u32,
    first_element: u64,
    context_name: &str,
) -> Result<(DecodedChunk, DigestSum)> {
    check_width(width)?;
    let (positions, planes, moved) = context::decode_split_in_place(payload, target, first_element, model, n_changed, context_name)?;
    Ok((DecodedChunk { width, inner: Decoded::Sparse { positions, planes } }, moved))
}

impl DecodedChunk {
    /// Apply in place. `target` must be the chunk's range (n words); the
    /// positions were bounds-checked while decoding.
    pub fn apply(&self, target: &mut [u8], kind: ChangeKind) {
        let _ = self.apply_tracked(target, kind, 0);
    }

    /// Apply in place and return how the tensor's digest moved: the sum of
    /// `h(new) - h(old)` over the words written, `first_element` being the
    /// chunk's first element within its tensor.
    pub fn apply_tracked(&self, target: &mut [u8], kind: ChangeKind, first_element: u64) -> DigestSum {
        match (&self.inner, self.width) {
            (Decoded::Sparse { positions, planes }, 1) => apply_sparse::<u8>(target, positions, planes, kind, first_element),
            (Decoded::Sparse { positions, planes }, 2) => apply_sparse::<u16>(target, positions, planes, kind, first_element),
            (Decoded::Sparse { positions, planes }, 4) => apply_sparse::<u32>(target, positions, planes, kind, first_element),
            (Decoded::Sparse { positions, planes }, _) => apply_sparse::<u64>(target, positions, planes, kind, first_element),
            (Decoded::Full(values), width) => {
                let mut moves = DigestMoves::new(width);
                for (i, (word, v)) in target.chunks_exact_mut(width).zip(values.chunks_exact(width)).enumerate() {
                    let old = read_word(word);
                    let new = match kind {
                        ChangeKind::Xor => old ^ read_word(v),
                        ChangeKind::Overwrite => read_word(v),
                    };
                    write_word(word, new);
                    moves.word(first_element + i as u64, old, new);
                }
                moves.finish()
            }
        }
    }

    /// The target's current bytes at this chunk's positions, as a chunk that
    /// restores them when applied as an overwrite.
    pub fn capture(&self, target: &[u8]) -> DecodedChunk {
        let width = self.width;
        let inner = match &self.inner {
            Decoded::Sparse { positions, .. } => Decoded::Sparse {
                positions: positions.clone(),
                planes: (0..width).map(|j| positions.iter().map(|&p| target[p as usize * width + j]).collect()).collect(),
            },
            Decoded::Full(_) => Decoded::Full(target.to_vec()),
        };
        DecodedChunk { width, inner }
    }

    /// The changed positions (words of the chunk, ascending) of a chunk
    /// that lists them; `None` where it covers every word (dense, raw).
    pub fn positions(&self) -> Option<&[u32]> {
        match &self.inner {
            Decoded::Sparse { positions, .. } => Some(positions),
            Decoded::Full(_) => None,
        }
    }

    /// The bytes its decoded changes take (positions and values).
    pub fn decoded_bytes(&self) -> usize {
        match &self.inner {
            Decoded::Sparse { positions, planes } => 4 * positions.len() + planes.iter().map(Vec::len).sum::<usize>(),
            Decoded::Full(bytes) => bytes.len(),
        }
    }

    /// [`DecodedChunk::positions`], taken out of the chunk.
    pub fn into_positions(self) -> Option<Vec<u32>> {
        match self.inner {
            Decoded::Sparse { positions, .. } => Some(positions),
            Decoded::Full(_) => None,
        }
    }

    /// Positions and value words.
    pub fn to_changes(&self) -> SparseChanges {
        let width = self.width;
        match &self.inner {
            Decoded::Sparse { positions, planes } => SparseChanges {
                values: (0..positions.len())
                    .map(|i| planes.iter().enumerate().fold(0u64, |v, (j, p)| v | (u64::from(p[i]) << (8 * j))))
                    .collect(),
                positions: positions.clone(),
            },
            Decoded::Full(bytes) => {
                let mut out = SparseChanges::default();
                for (i, w) in bytes.chunks_exact(width).enumerate() {
                    out.positions.push(i as u32);
                    out.values.push(read_word(w));
                }
                out
            }
        }
    }
}

/// Decode a chunk payload and apply it in place to `target` (the chunk's
/// stored bytes). Nothing is written unless the whole payload decodes.
pub fn apply_chunk(
    target: &mut [u8],
    width: usize,
    kind: ChangeKind,
    encoding: Encoding,
    n_changed: u32,
    payload: &[u8],
    context: &str,
) -> Result<()> {
    check_width(width)?;
    if !target.len().is_multiple_of(width) {
        return Err(Error::Invalid(format!("target length {} is not a multiple of {width}", target.len())));
    }
    decode_chunk(payload, target.len() / width, width, encoding, n_changed, context)?.apply(target, kind);
    Ok(())
}

/// Apply already-decoded sparse changes in place (the CPU reference of the
/// GPU apply kernels).
pub fn apply_changes(target: &mut [u8], width: usize, kind: ChangeKind, changes: &SparseChanges) -> Result<()> {
    check_width(width)?;
    let n = target.len() / width;
    if changes.positions.len() != changes.values.len() {
        return Err(Error::Invalid("positions and values differ in length".into()));
    }
    if let Some(&p) = changes.positions.iter().find(|&&p| p as usize >= n) {
        return Err(Error::Invalid(format!("position {p} outside a target of {n} words")));
    }
    let mask = lane_mask(width);
    for (&p, &v) in changes.positions.iter().zip(&changes.values) {
        let word = &mut target[p as usize * width..][..width];
        let v = v & mask;
        let new = match kind {
            ChangeKind::Xor => read_word(word) ^ v,
            ChangeKind::Overwrite => v,
        };
        write_word(word, new);
    }
    Ok(())
}

#[cfg(test)]
mod tests;
