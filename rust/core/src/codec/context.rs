//! Context-aware chunk coding: the decoder reads the base values of the
//! chunk, which every receiver holds bit for bit (the delta names their
//! digest), and both sides derive a context from each base value.
//!
//! - **Context**: the exponent field of the old value (floating-point
//!   dtypes), so elements are grouped by magnitude: in policy-gradient
//!   steps, whether an element changes depends strongly on it.
//! - **Positions**: per context, the changes are gap-coded within that
//!   context's own subsequence of elements, with a Rice code whose parameter
//!   is chosen per context (or, in dense contexts, one flag bit per element
//!   up to the context's last change).
//! - **Values**: the distance between old and new in representable steps
//!   (ulps; exact integer arithmetic on an order-preserving map of the bit
//!   pattern), in element order: the signs as raw bits (a coin toss), the
//!   magnitudes through an adaptive binary range coder whose probabilities
//!   are kept per context (is it above one ulp, then its bit length in
//!   unary and the bits below the leading one: an adaptive Elias-gamma
//!   code). `docs/format.md` has the layout.
//!
//! No sorting. Exact for every bit pattern: the ordinal map is a bijection
//! on words.
//!
//! Speed: the element-at-a-time walks (a counter per context on the
//! encoder, a countdown per context on the decoder) are kept as the
//! portable path and the tests' oracle. On x86-64 with AVX2 and a fast
//! BMI2 (`codec::x86`) both sides work 64 elements at a time: the encoder
//! counts each context's elements with one compare and popcount per
//! context present in a block; the decoder first turns each context's
//! position stream into a bitmap over the context's own elements, then
//! deposits the next flags of each context present onto its elements with
//! `pdep`, and last decodes the ulp steps of the changes it found, in
//! element order.

use super::range::{RangeDecoder, RangeEncoder, PROB_INIT};
use super::streams::{get_varint, put_stored, put_stream, put_varint, StreamReader};
use super::{ChangeKind, SparseChanges, Word};
use crate::dtype::DType;
use crate::error::{Error, Result};
use safetensors::Dtype;

/// How a dtype's words map to contexts and ordinals.
#[derive(Clone, Copy, Debug)]
pub struct ContextModel {
    width: usize,
    /// Context = (word >> shift) & mask.
    pub(super) shift: u32,
    pub(super) mask: u64,
    /// Sign-magnitude floating point: ordinals flip the magnitude of
    /// negative values so that adjacent values differ by one.
    float: bool,
}

impl ContextModel {
    pub fn for_dtype(dtype: DType) -> Self {
        let (shift, bits, float) = match dtype.0 {
            Dtype::BF16 => (7, 8, true),
            Dtype::F16 => (10, 5, true),
            Dtype::F32 => (23, 8, true),
            Dtype::F64 => (52, 11, true),
            Dtype::F8_E4M3 => (3, 4, true),
            Dtype::F8_E5M2 => (2, 5, true),
            // Integers and packed types: one context, two's-complement steps.
            _ => (0, 0, false),
        };
        ContextModel { width: dtype.word_bytes(), shift, mask: (1u64 << bits) - 1, float }
    }

    pub fn contexts(&self) -> usize {
        self.mask as usize + 1
    }

    #[inline(always)]
    pub(super) fn context(&self, word: u64) -> usize {
        ((word >> self.shift) & self.mask) as usize
    }

    fn bits(&self) -> u32 {
        8 * self.width as u32
    }

    fn word_mask(&self) -> u64 {
        if self.width == 8 {
            u64::MAX
        } else {
            (1u64 << self.bits()) - 1
        }
    }

    /// Order-preserving bijection of words (for floats: -max .. -0, +0 .. +max).
    #[inline(always)]
    fn ordinal(&self, word: u64) -> u64 {
        let sign = 1u64 << (self.bits() - 1);
        if self.float && word & sign != 0 {
            word ^ (sign - 1)
        } else {
            word
        }
    }

    #[inline(always)]
    fn word_of_ordinal(&self, ord: u64) -> u64 {
        self.ordinal(ord) // the map is an involution
    }

    /// The signed step from old to new in representable values, in w-bit
    /// two's-complement arithmetic.
    #[inline(always)]
    fn step(&self, old: u64, new: u64) -> i64 {
        let bits = self.bits();
        let d = self.ordinal(new).wrapping_sub(self.ordinal(old)) & self.word_mask();
        ((d << (64 - bits)) as i64) >> (64 - bits)
    }

    #[inline(always)]
    fn apply_step(&self, old: u64, step: i64) -> u64 {
        self.word_of_ordinal(self.ordinal(old).wrapping_add(step as u64) & self.word_mask())
    }

}

/// Probabilities of a magnitude: `[0]` more than one ulp; `[1..16]` the
/// unary decisions of the bit length class (decision `i` at `min(i, 15)`);
/// `[16..32]` the bit below the leading one, by class (lengths 2..=17, the
/// longer ones sharing the last).
const ROW: usize = 32;
const CLASS: usize = 1;
const CLASS_SHARED: usize = 15;
const MANTISSA: usize = 16;

/// One row per context, one cache line.
#[derive(Clone)]
#[repr(align(64))]
struct Row([u16; ROW]);

/// Adaptive probabilities of the ulp step magnitudes, per context. The sign
/// of a step is a coin toss (as often up as down, whatever the old sign),
/// so it is stored as a raw bit outside the range coder.
///
/// A magnitude `v = |step| - 1` is coded as: `v > 0` (one decision); when
/// it is, the bit length `nb` of `v` (1..=64) in unary (`nb - 1` ones and,
/// below 64, a zero), then the `nb - 1` bits below its leading one, the
/// first with an adaptive probability and the others direct. No escape:
/// every 64-bit magnitude has a code.
struct StepModel {
    rows: Vec<Row>,
}

impl StepModel {
    fn new(contexts: usize) -> Self {
        StepModel { rows: vec![Row([PROB_INIT; ROW]); contexts] }
    }

    /// The magnitude `v = |step| - 1` of a change in context `ctx`. The
    /// first two decisions (more than one ulp? more than two?) are coded
    /// without branches (the second only counts when the first is yes); the
    /// rest only when both are.
    #[inline(always)]
    fn encode(&mut self, rc: &mut RangeEncoder, ctx: usize, v: u64) {
        let row = &mut self.rows[ctx].0;
        rc.bit_unpredictable(&mut row[0], v > 0);
        rc.bit_masked(&mut row[CLASS], v > 1, v > 0);
        if v > 1 {
            Self::encode_rest(rc, row, v);
        }
    }

    #[inline(always)]
    fn encode_rest(rc: &mut RangeEncoder, row: &mut [u16; ROW], v: u64) {
        let nb = 64 - v.leading_zeros() as usize;
        for i in 2..64 {
            let more = nb > i;
            rc.bit(&mut row[CLASS + (i - 1).min(CLASS_SHARED - 1)], more);
            if !more {
                break;
            }
        }
        if nb >= 2 {
            rc.bit(&mut row[MANTISSA + (nb - 2).min(15)], (v >> (nb - 2)) & 1 == 1);
            rc.direct(v, nb as u32 - 2);
        }
    }

    /// `|step| - 1` (every code is a magnitude).
    #[inline(always)]
    fn decode(&mut self, rc: &mut RangeDecoder<'_>, ctx: usize) -> u64 {
        let row = &mut self.rows[ctx].0;
        let nonzero = rc.bit_unpredictable(&mut row[0]);
        if rc.bit_masked(&mut row[CLASS], nonzero) {
            Self::decode_rest(rc, row)
        } else {
            u64::from(nonzero)
        }
    }

    #[inline(always)]
    fn decode_rest(rc: &mut RangeDecoder<'_>, row: &mut [u16; ROW]) -> u64 {
        let mut nb = 2usize;
        while nb < 64 && rc.bit(&mut row[CLASS + (nb - 1).min(CLASS_SHARED - 1)]) {
            nb += 1;
        }
        if nb < 2 {
            return 1;
        }
        let second = u64::from(rc.bit(&mut row[MANTISSA + (nb - 2).min(15)]));
        let low = rc.direct(nb as u32 - 2);
        (1u64 << (nb - 1)) | (second << (nb - 2)) | low
    }
}

/// The step of magnitude `v + 1`, negative when `negative`.
#[inline(always)]
fn signed_step(v: u64, negative: bool) -> i64 {
    let a = v.wrapping_add(1) as i64;
    if negative {
        a.wrapping_neg()
    } else {
        a
    }
}

/// Whether change `j` has a negative step: bit `j % 8` of byte `j / 8`.
#[inline(always)]
fn sign_bit(signs: &[u8], j: usize) -> bool {
    (signs[j / 8] >> (j % 8)) & 1 == 1
}

// ------------------------------------------------------------ bit streams

struct BitWriter {
    out: Vec<u8>,
    acc: u64,
    n: u32,
}

impl BitWriter {
    fn new() -> Self {
        BitWriter { out: Vec::new(), acc: 0, n: 0 }
    }
    /// Append the `bits <= 32` low bits of `value`, least significant first.
    #[inline(always)]
    fn put(&mut self, value: u64, bits: u32) {
        debug_assert!(bits <= 32 && self.n < 32);
        self.acc |= (value & ((1u64 << bits) - 1)) << self.n;
        self.n += bits;
        if self.n >= 32 {
            self.out.extend_from_slice(&(self.acc as u32).to_le_bytes());
            self.acc >>= 32;
            self.n -= 32;
        }
    }
    fn finish(mut self) -> Vec<u8> {
        while self.n > 0 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.n = self.n.saturating_sub(8);
        }
        self.out
    }
}

struct BitReader<'a> {
    buf: &'a [u8],
    pos: usize,
    acc: u64,
    n: u32,
}

impl<'a> BitReader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        BitReader { buf, pos: 0, acc: 0, n: 0 }
    }
    /// Top up `acc` to more than 55 bits while the buffer lasts. Bits of
    /// `acc` above `n` may hold the bytes that follow (never anything
    /// else), so OR-ing those bytes in again leaves them unchanged. Away
    /// from the end of the buffer this is branch-free: eight bytes are
    /// loaded and as many whole bytes as fit are counted (`n <= 63` there).
    #[inline(always)]
    fn refill(&mut self) {
        if let Some(next) = self.buf.get(self.pos..self.pos + 8) {
            let bytes = u64::from_le_bytes(next.try_into().expect("8 bytes"));
            self.acc |= bytes << self.n;
            let take = (63 - self.n) / 8;
            self.pos += take as usize;
            self.n += take * 8;
            return;
        }
        while self.n <= 56 && self.pos < self.buf.len() {
            self.acc |= u64::from(self.buf[self.pos]) << self.n;
            self.pos += 1;
            self.n += 8;
        }
    }
    #[inline(always)]
    fn get(&mut self, bits: u32) -> Option<u64> {
        if self.n < bits {
            self.refill();
            if self.n < bits {
                return None;
            }
        }
        let v = self.acc & ((1u64 << bits) - 1);
        self.acc >>= bits;
        self.n -= bits;
        Some(v)
    }
}

const RICE_ESCAPE: u64 = 32;

#[inline(always)]
fn put_rice(w: &mut BitWriter, g: u64, k: u32) {
    let q = g >> k;
    if q >= RICE_ESCAPE {
        w.put((1 << RICE_ESCAPE) - 1, RICE_ESCAPE as u32);
        w.put(g, 32);
    } else if q as u32 + 1 + k <= 32 {
        // q ones, a zero, then the k low bits: one write
        let low = g & ((1u64 << k) - 1);
        w.put(((1u64 << q) - 1) | (low << (q + 1)), q as u32 + 1 + k);
    } else {
        w.put((1u64 << q) - 1, q as u32 + 1);
        w.put(g, k);
    }
}

#[inline(always)]
fn get_rice(r: &mut BitReader<'_>, k: u32) -> Option<u64> {
    // Fast path: the unary part and its terminating zero are among the
    // buffered bits.
    r.refill();
    let ones = (!r.acc).trailing_zeros();
    let used = ones + 1 + k; // at most 31 + 1 + 31 bits
    if u64::from(ones) < RICE_ESCAPE && used <= r.n {
        let low = (r.acc >> (ones + 1)) & ((1u64 << k) - 1);
        r.acc >>= used;
        r.n -= used;
        return Some((u64::from(ones) << k) | low);
    }
    let mut q = 0u64;
    while r.get(1)? == 1 {
        q += 1;
        if q == RICE_ESCAPE {
            return r.get(32);
        }
    }
    let low = if k > 0 { r.get(k)? } else { 0 };
    Some((q << k) | low)
}

/// The bits of the gaps as Rice codes with parameters `k0`, `k0 + 1` and
/// `k0 + 2` (all below 32), in one pass.
fn rice_costs(gaps: &[u32], k0: u32) -> [u64; 3] {
    let mut costs = [0u64; 3];
    for &g in gaps {
        for (i, cost) in costs.iter_mut().enumerate() {
            let k = k0 + i as u32;
            let q = u64::from(g) >> k;
            *cost += if q >= RICE_ESCAPE { RICE_ESCAPE + 32 } else { q + 1 + u64::from(k) };
        }
    }
    costs
}

const MODE_RICE: u8 = 0;
const MODE_FLAGS: u8 = 1;

/// Encode `changes` (positions ascending, relative to the chunk) of a chunk
/// whose base bytes are `old` and new bytes `new`.
pub fn encode(old: &[u8], new: &[u8], changes: &SparseChanges, model: &ContextModel, level: i32) -> Vec<u8> {
    match model.width {
        1 => encode_words::<u8>(old, new, changes, model, level),
        2 => encode_words::<u16>(old, new, changes, model, level),
        4 => encode_words::<u32>(old, new, changes, model, level),
        _ => encode_words::<u64>(old, new, changes, model, level),
    }
}

/// For each change (positions ascending), how many earlier elements of the
/// chunk share its context.
fn ranks<T: Word>(old: &[u8], model: &ContextModel, positions: &[u32]) -> Vec<u32> {
    #[cfg(target_arch = "x86_64")]
    if model.contexts() <= 256 && T::BYTES <= 4 && super::x86::available() {
        let mut ranks = Vec::new();
        super::x86::ranks::<T>(old, model, positions, &mut ranks);
        return ranks;
    }
    ranks_reference::<T>(old, model, positions)
}

/// `ranks`, one element at a time.
fn ranks_reference<T: Word>(old: &[u8], model: &ContextModel, positions: &[u32]) -> Vec<u32> {
    let mut ranks = Vec::with_capacity(positions.len());
    let w = T::BYTES;
    let mut seen = vec![0u32; model.contexts()];
    let mut run_start = 0usize;
    for &p in positions {
        let p = p as usize;
        for word in old[run_start * w..p * w].chunks_exact(w) {
            seen[model.context(T::load(word))] += 1;
        }
        let c = model.context(T::load(&old[p * w..(p + 1) * w]));
        ranks.push(seen[c]);
        seen[c] += 1;
        run_start = p + 1;
    }
    ranks
}

fn encode_words<T: Word>(old: &[u8], new: &[u8], changes: &SparseChanges, model: &ContextModel, level: i32) -> Vec<u8> {
    let w = T::BYTES;
    let nctx = model.contexts();
    let mut next_free = vec![0u32; nctx]; // subsequence index after the last change
    let mut gaps: Vec<Vec<u32>> = vec![Vec::new(); nctx];
    let mut steps = StepModel::new(nctx);
    let mut rc = RangeEncoder::default();
    let positions = &changes.positions;
    let mut signs = BitWriter::new();
    let ranks = ranks::<T>(old, model, positions);
    // At each change: its gap within its context and its ulp step.
    for (&p, &rank) in positions.iter().zip(&ranks) {
        let p = p as usize;
        let o = T::load(&old[p * w..(p + 1) * w]);
        let c = model.context(o);
        gaps[c].push(rank - next_free[c]);
        next_free[c] = rank + 1;
        let step = model.step(o, T::load(&new[p * w..(p + 1) * w]));
        signs.put(u64::from(step < 0), 1);
        // Steps are never 0.
        steps.encode(&mut rc, c, step.unsigned_abs() - 1);
    }
    // Per context: Rice with the best parameter, or one flag per element
    // up to its last change when that is cheaper (dense contexts).
    let mut table = Vec::new();
    let mut listed = 0u64;
    let mut prev_ctx = 0usize;
    let mut body = Vec::new();
    for (c, gaps) in gaps.iter().enumerate() {
        let m_c = gaps.len() as u64;
        if m_c == 0 {
            continue;
        }
        let span = u64::from(next_free[c]); // flags needed, up to the last change
        let mean = (span - m_c) as f64 / m_c as f64;
        let guess = if mean > 1.0 { (mean * std::f64::consts::LN_2).log2().max(0.0) as u32 } else { 0 };
        let k0 = guess.saturating_sub(1).min(29);
        let costs = rice_costs(gaps, k0);
        let best = (0..3).min_by_key(|&i| costs[i]).expect("three candidates");
        let (k, cost) = (k0 + best as u32, costs[best]);
        let flags = span < cost;
        let stream = if flags {
            let mut bytes = vec![0u8; span.div_ceil(8) as usize];
            let mut rank = 0usize;
            for &g in gaps {
                rank += g as usize;
                bytes[rank / 8] |= 1 << (rank % 8);
                rank += 1;
            }
            bytes
        } else {
            let mut bits = BitWriter::new();
            for &g in gaps {
                put_rice(&mut bits, u64::from(g), k);
            }
            bits.finish()
        };
        put_varint(&mut table, (c - prev_ctx) as u64);
        put_varint(&mut table, m_c);
        table.push(if flags { MODE_FLAGS } else { MODE_RICE });
        table.push(k as u8);
        put_varint(&mut table, stream.len() as u64);
        body.extend_from_slice(&stream);
        prev_ctx = c;
        listed += 1;
    }
    let mut out = Vec::new();
    put_varint(&mut out, listed);
    put_stream(&mut out, &table, level);
    put_stream(&mut out, &body, level);
    put_stored(&mut out, &signs.finish());
    put_stored(&mut out, &rc.finish());
    out
}

/// Decode a context-coded payload against the chunk's base bytes `old`.
/// Returns the changes as XOR masks or new words (by `kind`).
///
/// On x86-64 with AVX2 and a fast BMI2, words of up to 4 bytes with up to
/// 256 contexts are decoded by `decode_expanded`; everything else (8-byte
/// words, other CPUs) by the element-at-a-time `decode_reference`. Both
/// accept and refuse the same payloads and return the same changes.
pub fn decode(
    payload: &[u8],
    old: &[u8],
    model: &ContextModel,
    n_changed: u32,
    kind: ChangeKind,
    context: &str,
) -> Result<SparseChanges> {
    #[cfg(target_arch = "x86_64")]
    if model.contexts() <= 256 && super::x86::available() {
        match model.width {
            1 => return decode_expanded::<u8>(payload, old, model, n_changed, kind, context),
            2 => return decode_expanded::<u16>(payload, old, model, n_changed, kind, context),
            4 => return decode_expanded::<u32>(payload, old, model, n_changed, kind, context),
            _ => {}
        }
    }
    decode_reference(payload, old, model, n_changed, kind, context)
}

/// The element-at-a-time decoder: per context, a countdown of the elements
/// to skip before its next change. Portable; the test oracle of the fast
/// decoder.
pub fn decode_reference(
    payload: &[u8],
    old: &[u8],
    model: &ContextModel,
    n_changed: u32,
    kind: ChangeKind,
    context: &str,
) -> Result<SparseChanges> {
    match model.width {
        1 => decode_words::<u8>(payload, old, model, n_changed, kind, context),
        2 => decode_words::<u16>(payload, old, model, n_changed, kind, context),
        4 => decode_words::<u32>(payload, old, model, n_changed, kind, context),
        _ => decode_words::<u64>(payload, old, model, n_changed, kind, context),
    }
}

/// One listed context of a payload: its position stream is
/// `body[start..end]`.
struct Listed {
    ctx: usize,
    changes: u64,
    mode: u8,
    k: u32,
    start: usize,
    end: usize,
}

/// A payload's streams and context table, checked for consistency with the
/// chunk (n elements, m changes) but not yet decoded.
struct Parsed {
    listed: Vec<Listed>,
    body: Vec<u8>,
    /// One bit per change: its step is negative.
    signs: Vec<u8>,
    /// The range-coded step magnitudes.
    values: Vec<u8>,
}

fn parse(payload: &[u8], n: usize, m: usize, nctx: usize, context: &str) -> Result<Parsed> {
    let bad = |detail: &str| Error::corrupt(context, detail.to_string());
    let mut pos = 0usize;
    let count = get_varint(payload, &mut pos, 10).ok_or_else(|| bad("context count missing"))? as usize;
    if count > nctx || count > m {
        return Err(bad("more contexts listed than exist or changed"));
    }
    let mut r = StreamReader::new(&payload[pos..], context);
    let table = r.next("context table", 0, count * 32)?;
    let body = r.next("positions", 0, n.div_ceil(8) + m * 9 + count)?;
    let signs = r.next("step signs", m.div_ceil(8), m.div_ceil(8))?;
    // At most 127 decisions of at most 6 bits each per change.
    let values = r.next("ulp steps", 5, m * 96 + 5)?;
    r.finish()?;

    let mut listed = Vec::with_capacity(count);
    let (mut tpos, mut bpos, mut ctx, mut total) = (0usize, 0usize, 0usize, 0u64);
    for i in 0..count {
        let delta = get_varint(&table, &mut tpos, 10).ok_or_else(|| bad("context table truncated"))? as usize;
        ctx = ctx.checked_add(delta).filter(|&c| c < nctx && (i == 0 || delta > 0)).ok_or_else(|| bad("context ids out of order"))?;
        let changes = get_varint(&table, &mut tpos, 10).ok_or_else(|| bad("context table truncated"))?;
        let mode = *table.get(tpos).ok_or_else(|| bad("context table truncated"))?;
        let k = u32::from(*table.get(tpos + 1).ok_or_else(|| bad("context table truncated"))?);
        tpos += 2;
        let len = get_varint(&table, &mut tpos, 10).ok_or_else(|| bad("context table truncated"))? as usize;
        let end = bpos.checked_add(len).filter(|&e| e <= body.len()).ok_or_else(|| bad("position stream overruns"))?;
        if changes == 0 || changes > m as u64 || k > 31 {
            return Err(bad("bad context entry"));
        }
        if mode != MODE_RICE && mode != MODE_FLAGS {
            return Err(Error::UnknownCode { what: "context position mode", code: mode, context: context.into() });
        }
        total += changes;
        listed.push(Listed { ctx, changes, mode, k, start: bpos, end });
        bpos = end;
    }
    if tpos != table.len() || bpos != body.len() || total != m as u64 {
        return Err(bad("context table does not match the chunk's change count"));
    }
    Ok(Parsed { listed, body, signs, values })
}

/// A context that has no (more) changes never counts down to zero.
const NEVER: u64 = u64::MAX;

fn decode_words<T: Word>(
    payload: &[u8],
    old: &[u8],
    model: &ContextModel,
    n_changed: u32,
    kind: ChangeKind,
    context: &str,
) -> Result<SparseChanges> {
    let w = T::BYTES;
    let m = n_changed as usize;
    let bad = |detail: &str| Error::corrupt(context, detail.to_string());
    let nctx = model.contexts();
    let parsed = parse(payload, old.len() / w, m, nctx, context)?;

    // Per context: elements to skip before its next change (NEVER when it
    // has none left), its bit reader, Rice parameter, flag mode, changes left.
    let mut countdown = vec![NEVER; nctx];
    let mut readers: Vec<Option<BitReader<'_>>> = (0..nctx).map(|_| None).collect();
    let mut rice_k = vec![0u32; nctx];
    let mut flags = vec![false; nctx];
    let mut remaining = vec![0u64; nctx];
    for l in &parsed.listed {
        let mut reader = BitReader::new(&parsed.body[l.start..l.end]);
        remaining[l.ctx] = l.changes;
        if l.mode == MODE_RICE {
            countdown[l.ctx] = get_rice(&mut reader, l.k).ok_or_else(|| bad("position stream ends early"))?;
            rice_k[l.ctx] = l.k;
        } else {
            countdown[l.ctx] = 0;
            flags[l.ctx] = true;
        }
        readers[l.ctx] = Some(reader);
    }
    let mut out = SparseChanges { positions: Vec::with_capacity(m), values: Vec::with_capacity(m) };
    let mut steps = StepModel::new(nctx);
    let mut rc = RangeDecoder::new(&parsed.values).ok_or_else(|| bad("ulp step stream too short"))?;
    for (i, word) in old.chunks_exact(w).enumerate() {
        let o = T::load(word);
        let c = model.context(o);
        let cd = countdown[c];
        if cd != 0 {
            countdown[c] = cd - 1; // NEVER stays out of reach: n < 2^32
            continue;
        }
        let reader = readers[c].as_mut().ok_or_else(|| bad("change in an unlisted context"))?;
        if flags[c] {
            if reader.get(1).ok_or_else(|| bad("flag stream ends early"))? == 0 {
                continue;
            }
            remaining[c] -= 1;
            if remaining[c] == 0 {
                countdown[c] = NEVER;
            }
        } else {
            remaining[c] -= 1;
            countdown[c] = if remaining[c] > 0 {
                get_rice(reader, rice_k[c]).ok_or_else(|| bad("position stream ends early"))?
            } else {
                NEVER
            };
        }
        let j = out.positions.len();
        let v = steps.decode(&mut rc, c);
        if rc.overrun() {
            return Err(bad("ulp step stream ends early"));
        }
        let step = signed_step(v, sign_bit(&parsed.signs, j));
        push_change(&mut out, i, o, model.apply_step(o, step), kind).ok_or_else(|| bad("a listed change does not change its element"))?;
    }
    if remaining.iter().any(|&r| r > 0) || out.positions.len() != m {
        return Err(bad("positions or steps left over after the last element"));
    }
    Ok(out)
}

/// The value of a change of `old` by magnitude `v + 1` and sign into `out`; true when it leaves the element unchanged (a
/// corrupt payload). `model.apply_step` with the word width known.
#[inline(always)]
fn change<T: Word>(model: &ContextModel, kind: ChangeKind, old: u64, v: u64, negative: bool, out: &mut u64) -> bool {
    let bits = 8 * T::BYTES as u32;
    let sign = 1u64 << (bits - 1);
    let word_mask = u64::MAX >> (64 - bits);
    let flip = if model.float { sign - 1 } else { 0 };
    let ordinal = |x: u64| if x & sign != 0 { x ^ flip } else { x };
    let step = signed_step(v, negative);
    let new = ordinal(ordinal(old).wrapping_add(step as u64) & word_mask);
    *out = match kind {
        ChangeKind::Xor => old ^ new,
        ChangeKind::Overwrite => new,
    };
    new == old
}

/// Record the change of element `i` from `old` to `new`; `None` when the
/// two are equal (a corrupt payload).
#[inline(always)]
fn push_change(out: &mut SparseChanges, i: usize, old: u64, new: u64, kind: ChangeKind) -> Option<()> {
    if new == old {
        return None;
    }
    out.positions.push(i as u32);
    out.values.push(match kind {
        ChangeKind::Xor => old ^ new,
        ChangeKind::Overwrite => new,
    });
    Some(())
}

/// Per context, the ranks (indices within the context's own subsequence of
/// elements) that changed, as one bitmap per context laid end to end in
/// `words`: bit `r` of context `c` is bit `r % 64` of
/// `words[base[c] + r / 64]`. Each context's bitmap ends at its last
/// change (`limit[c]` bits) and is followed by two zero words, so a window
/// of two words starting below the limit plus 64 stays inside it.
pub(super) struct RankBitmaps {
    pub(super) words: Vec<u64>,
    pub(super) base: Vec<usize>,
    pub(super) limit: Vec<u64>,
}

/// Decode every listed context's position stream into its rank bitmap.
/// Refuses streams that end early and ranks that cannot fit the chunk (the
/// bitmaps of all contexts together never hold more than n bits, since the
/// contexts partition the n elements).
fn rank_bitmaps(parsed: &Parsed, n: usize, nctx: usize, context: &str) -> Result<RankBitmaps> {
    let bad = |detail: &str| Error::corrupt(context, detail.to_string());
    let mut maps = RankBitmaps { words: Vec::new(), base: vec![0; nctx], limit: vec![0; nctx] };
    let mut bits_left = n as u64;
    let mut ranks = Vec::new();
    for l in &parsed.listed {
        let stream = &parsed.body[l.start..l.end];
        let base = maps.words.len();
        maps.base[l.ctx] = base;
        let limit = if l.mode == MODE_RICE {
            let mut reader = BitReader::new(stream);
            ranks.clear();
            let mut next = 0u64; // the rank after the previous change
            for _ in 0..l.changes {
                let gap = get_rice(&mut reader, l.k).ok_or_else(|| bad("position stream ends early"))?;
                let rank = next.checked_add(gap).filter(|&r| r < bits_left).ok_or_else(|| bad("positions beyond the chunk's elements"))?;
                ranks.push(rank);
                next = rank + 1;
            }
            maps.words.resize(base + next.div_ceil(64) as usize, 0);
            let map = &mut maps.words[base..];
            for &rank in &ranks {
                map[(rank / 64) as usize] |= 1 << (rank % 64);
            }
            next
        } else {
            // Flags: bit r of the stream (least significant first) is rank
            // r; only the flags up to the context's last change are read.
            let mut need = l.changes;
            let mut limit = None;
            for (i, bytes) in stream.chunks(8).enumerate() {
                let mut le = [0u8; 8];
                le[..bytes.len()].copy_from_slice(bytes);
                let word = u64::from_le_bytes(le);
                let ones = u64::from(word.count_ones());
                if ones < need {
                    need -= ones;
                    maps.words.push(word);
                    continue;
                }
                let mut rest = word;
                for _ in 1..need {
                    rest &= rest - 1;
                }
                let last = rest.trailing_zeros();
                maps.words.push(word & (u64::MAX >> (63 - last)));
                limit = Some(i as u64 * 64 + u64::from(last) + 1);
                break;
            }
            limit.filter(|&b| b <= bits_left).ok_or_else(|| bad("flag stream ends early"))?
        };
        bits_left -= limit;
        maps.limit[l.ctx] = limit;
        maps.words.resize(base + limit.div_ceil(64) as usize + 2, 0);
    }
    Ok(maps)
}

/// The fast decoder: rank bitmaps expanded into element order block by
/// block (see `x86`), then the ulp steps of the changes in one pass.
#[cfg(target_arch = "x86_64")]
fn decode_expanded<T: Word>(
    payload: &[u8],
    old: &[u8],
    model: &ContextModel,
    n_changed: u32,
    kind: ChangeKind,
    context: &str,
) -> Result<SparseChanges> {
    let n = old.len() / T::BYTES;
    let m = n_changed as usize;
    let bad = |detail: &str| Error::corrupt(context, detail.to_string());
    let nctx = model.contexts();
    let parsed = parse(payload, n, m, nctx, context)?;
    let maps = rank_bitmaps(&parsed, n, nctx, context)?;
    let listed: Vec<usize> = parsed.listed.iter().map(|l| l.ctx).collect();
    let mut positions = vec![0u32; m + super::x86::SPARE];
    super::x86::expand::<T>(old, model, &listed, &maps, &mut positions);
    if positions.len() != m {
        return Err(bad("positions or steps left over after the last element"));
    }
    // The ulp steps, in element order. The coder's state and the model's
    // fields are kept in locals, so that they stay in registers.
    let mut steps = StepModel::new(nctx);
    let mut rc = RangeDecoder::new(&parsed.values).ok_or_else(|| bad("ulp step stream too short"))?;
    let w = T::BYTES;
    let signs = &parsed.signs[..];
    let local = *model;
    let mut values = vec![0u64; m];
    // Refused after the loop: a change that does not change its element.
    let mut unchanged = false;
    for (j, (&p, out)) in positions.iter().zip(values.iter_mut()).enumerate() {
        let o = T::load(&old[p as usize * w..][..w]);
        let v = steps.decode(&mut rc, local.context(o));
        unchanged |= change::<T>(&local, kind, o, v, sign_bit(signs, j), out);
    }
    if unchanged {
        return Err(bad("a listed change does not change its element"));
    }
    if rc.overrun() {
        return Err(bad("ulp step stream ends early"));
    }
    Ok(SparseChanges { positions, values })
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinal_is_an_exact_involution_and_steps_round_trip() {
        let m = ContextModel::for_dtype(DType(Dtype::BF16));
        for a in (0u64..65536).step_by(7) {
            assert_eq!(m.word_of_ordinal(m.ordinal(a)), a);
            for b in [a ^ 1, a ^ 0x8000, (a + 3) & 0xffff, 0x7fc1, 0xffff, 0] {
                assert_eq!(m.apply_step(a, m.step(a, b)), b, "{a:#x} -> {b:#x}");
            }
        }
        let m = ContextModel::for_dtype(DType(Dtype::I64));
        for (a, b) in [(0u64, u64::MAX), (u64::MAX, 0), (5, 1 << 63)] {
            assert_eq!(m.apply_step(a, m.step(a, b)), b);
        }
    }

    /// `n` little-endian words of `width` bytes that look like floats: a
    /// few exponents, some zeros.
    fn float_like_words(next: &mut impl FnMut() -> u64, n: usize, width: usize) -> Vec<u8> {
        (0..n)
            .flat_map(|_| {
                let r = next();
                let word = if r.is_multiple_of(9) { 0 } else { (r & !(0x7u64 << (8 * width - 4))) | ((r >> 60) << (8 * width - 5)) };
                word.to_le_bytes()[..width].to_vec()
            })
            .collect()
    }

    #[test]
    fn fast_ranks_match_the_reference() {
        // Float-like words (a few exponents, zeros, a partial last block)
        // and every sixth or so element changed.
        let mut next = super::super::tests::xorshift(0x9e37_79b9_7f4a_7c15);
        for (dtype, width) in [(Dtype::BF16, 2), (Dtype::F32, 4), (Dtype::F8_E4M3, 1), (Dtype::I16, 2), (Dtype::U8, 1)] {
            let model = ContextModel::for_dtype(DType(dtype));
            for n in [0usize, 1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 383, 1000, 4099] {
                let old = float_like_words(&mut next, n, width);
                let positions: Vec<u32> = (0..n as u32).filter(|_| next().is_multiple_of(6)).collect();
                let (fast, slow) = match width {
                    1 => (ranks::<u8>(&old, &model, &positions), ranks_reference::<u8>(&old, &model, &positions)),
                    2 => (ranks::<u16>(&old, &model, &positions), ranks_reference::<u16>(&old, &model, &positions)),
                    _ => (ranks::<u32>(&old, &model, &positions), ranks_reference::<u32>(&old, &model, &positions)),
                };
                assert_eq!(fast, slow, "{dtype:?}, {n} elements");
                // Each kernel this CPU runs, not only the one `ranks` picks.
                #[cfg(target_arch = "x86_64")]
                for kernel in super::super::x86::kernels_here() {
                    let mut out = Vec::new();
                    match width {
                        1 => super::super::x86::ranks_with::<u8>(kernel, &old, &model, &positions, &mut out),
                        2 => super::super::x86::ranks_with::<u16>(kernel, &old, &model, &positions, &mut out),
                        _ => super::super::x86::ranks_with::<u32>(kernel, &old, &model, &positions, &mut out),
                    }
                    assert_eq!(out, slow, "{kernel:?}: {dtype:?}, {n} elements");
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn expansion_kernels_agree() {
        use super::super::x86;
        // Each kernel this CPU runs is held to the true positions (a CPU
        // without AVX2 never expands: it decodes by the reference loop).
        let kernels = x86::kernels_here();
        let mut next = super::super::tests::xorshift(0x5851_f42d_4c95_7f2d);
        for (dtype, width) in [(Dtype::BF16, 2), (Dtype::F32, 4), (Dtype::F8_E4M3, 1), (Dtype::F16, 2)] {
            let model = ContextModel::for_dtype(DType(dtype));
            // Lengths around the block sizes, and change rates from sparse to
            // every element (flag mode and Rice mode contexts).
            for (n, every) in [(1usize, 1u64), (63, 3), (64, 2), (127, 5), (128, 1), (129, 7), (255, 4), (256, 1), (257, 3), (383, 2), (1000, 40), (4099, 6), (20_000, 30), (20_000, 2)] {
                let old = float_like_words(&mut next, n, width);
                let mut new = old.clone();
                for i in 0..n {
                    if next().is_multiple_of(every) {
                        new[i * width] ^= 1; // one ulp away or so: the low mantissa bit
                    }
                }
                let found = super::super::find_changes(&old, &new, width, ChangeKind::Xor).unwrap();
                let m = found.positions.len();
                if m == 0 {
                    continue;
                }
                let payload = encode(&old, &new, &found, &model, 1);
                let parsed = parse(&payload, n, m, model.contexts(), "t").unwrap();
                let maps = rank_bitmaps(&parsed, n, model.contexts(), "t").unwrap();
                let listed: Vec<usize> = parsed.listed.iter().map(|l| l.ctx).collect();
                let run = |kernel| {
                    let mut positions = vec![0u32; m + x86::SPARE];
                    match width {
                        1 => x86::expand_with::<u8>(kernel, &old, &model, &listed, &maps, &mut positions),
                        2 => x86::expand_with::<u16>(kernel, &old, &model, &listed, &maps, &mut positions),
                        _ => x86::expand_with::<u32>(kernel, &old, &model, &listed, &maps, &mut positions),
                    }
                    positions
                };
                for &kernel in &kernels {
                    assert_eq!(run(kernel), found.positions, "{kernel:?}: {dtype:?}, {n} elements, 1 in {every} changed");
                }
            }
        }
    }

    #[test]
    fn rice_round_trip_with_escape() {
        let gaps = [0u64, 1, 5, 200, 1 << 31, 3];
        let mut w = BitWriter::new();
        for &g in &gaps {
            put_rice(&mut w, g, 2);
        }
        let buf = w.finish();
        let mut r = BitReader::new(&buf);
        for &g in &gaps {
            assert_eq!(get_rice(&mut r, 2), Some(g));
        }
    }
}
