//! Context-aware chunk coding: the decoder reads the base values of the
//! chunk, which every receiver holds bit for bit (the delta names their
//! digest), and both sides derive a context from each base value.
//!
//! - **Context**: the exponent field of the old value (floating-point
//!   dtypes), so elements are grouped by magnitude: in policy-gradient
//!   steps, whether an element changes depends strongly on it.
//! - **Positions**: per bucket (a run of neighbouring contexts, chosen per
//!   chunk by the encoder: `Buckets`), the changes are gap-coded within
//!   that bucket's own subsequence of elements, with a Rice code whose
//!   parameter is chosen per bucket, or, in dense buckets where that is
//!   estimated to be cheaper, as one range-coded flag per element up to
//!   the bucket's last change.
//! - **Values**: the distance between old and new in representable steps
//!   (ulps; exact integer arithmetic on an order-preserving map of the bit
//!   pattern), in element order: the signs as raw bits (a coin toss), the
//!   magnitudes per context, either through an adaptive binary range coder
//!   (is it above one ulp, then its bit length in unary and the bits below
//!   the leading one: an adaptive Elias-gamma code) or, in chunks with many
//!   changes, with static per-chunk tables of magnitude classes and four
//!   interleaved rANS states (`step_tables`), which decode several times
//!   faster for a few hundred bytes of tables. `docs/format.md` has the
//!   layout.
//!
//! No sorting. Exact for every bit pattern: the ordinal map is a bijection
//! on words.
//!
//! Speed: the decoder first turns each bucket's positions into a bitmap
//! over the bucket's own elements, then expands the bitmaps into element
//! order, and last decodes the ulp steps of the changes it found, in
//! element order. The element-at-a-time walks (a counter per bucket on
//! both sides) are kept as the portable path and the tests' oracle. On
//! x86-64 with AVX2 and a fast BMI2 (`codec::x86`) both sides work 64 or
//! 256 elements at a time: the encoder counts each bucket's elements with
//! one compare and popcount per bucket present in a block; the decoder
//! deposits the next flags of each bucket present onto its elements with
//! `pdep`. That work grows with the buckets a block touches, which is why
//! positions use a few buckets rather than every exponent.

use super::rice::{best_rice_parameter, stream_bound, RiceReader, RiceWriter};
use super::range::{RangeDecoder, RangeEncoder, Rate, PROB_INIT};
use super::step_tables;
use super::streams::{get_varint, put_stream, put_varint, StreamReader};
use super::{ChangeKind, SparseChanges, Word};
use crate::digest::DigestSum;
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

    /// What the AVX-512 kernels need of the model (words of at most 4
    /// bytes).
    #[cfg(target_arch = "x86_64")]
    fn step_model32(&self) -> super::gather_x86::StepModel32 {
        super::gather_x86::StepModel32 { shift: self.shift, mask: self.mask as u32, float: self.float }
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

    #[cfg(test)]
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

    /// The word `step` representable values from `old` (the decoder's
    /// `change`, element by element; the tests' reference).
    #[cfg(test)]
    fn apply_step(&self, old: u64, step: i64) -> u64 {
        self.word_of_ordinal(self.ordinal(old).wrapping_add(step as u64) & self.word_mask())
    }

}

/// The contexts that code positions: runs of adjacent exponent contexts
/// ("buckets"), chosen per chunk by the encoder and sent as their bounds.
/// Neighbouring exponents change at similar rates, so a few buckets lose
/// little against one context per exponent, while the per-element work of
/// both sides (`codec::x86`) grows with the buckets a block of elements
/// touches. Measured on the training pairs: at most five buckets with
/// changes made the context decode 7-8 % faster on the fp32-master pairs
/// (no change on bf16); with the smaller table the payloads moved by
/// -4 % (bf16, 1 % change) to +1.7 % (fp32 master, 2.6 % change); six
/// buckets halved that loss and most of the gain. The ulp steps keep one
/// context per exponent: they cost per change, not per element.
pub(super) struct Buckets {
    /// Ascending, in `1..contexts`: bucket `i` holds the contexts from
    /// `bounds[i - 1]` (0 for the first) up to `bounds[i]` (the context
    /// count for the last), exclusive.
    pub(super) bounds: Vec<usize>,
    /// Each context's bucket.
    of: Vec<u8>,
}

/// At most this many bounds (so at most 16 buckets).
const MAX_BOUNDS: usize = 15;
// The payload's first byte holds the bound count in its low 4 bits.
const _: () = assert!(MAX_BOUNDS <= 0x0f);
/// The encoder merges neighbouring contexts into at most this many buckets
/// with changes.
const MAX_BUCKETS_WITH_CHANGES: usize = 5;

impl Buckets {
    pub(super) fn new(bounds: Vec<usize>, contexts: usize) -> Self {
        debug_assert!(bounds.len() <= MAX_BOUNDS && bounds.windows(2).all(|b| b[0] < b[1]));
        let mut of = vec![0u8; contexts];
        for (bucket, &from) in bounds.iter().enumerate() {
            of[from..].fill(bucket as u8 + 1);
        }
        Buckets { bounds, of }
    }

    /// How many buckets there are.
    pub(super) fn len(&self) -> usize {
        self.bounds.len() + 1
    }

    /// The bucket of context `ctx`.
    #[inline(always)]
    pub(super) fn of(&self, ctx: usize) -> usize {
        usize::from(self.of[ctx])
    }
}

/// Choose the buckets of a chunk from its changes per context: adjacent
/// contexts are merged, the pair that costs least first, while a merge
/// costs less than a table entry or there are more than
/// `MAX_BUCKETS_WITH_CHANGES` buckets with changes. The cost of a bucket is
/// the entropy of its elements' changed flags, as if independent; the
/// elements per context are counted on a sample of the chunk's blocks.
fn choose_buckets<T: Word>(old: &[u8], model: &ContextModel, changes: &[u64]) -> Buckets {
    let nctx = model.contexts();
    let (Some(first), Some(last)) = (changes.iter().position(|&m| m > 0), changes.iter().rposition(|&m| m > 0)) else {
        return Buckets::new(Vec::new(), nctx);
    };
    // Elements per context, on one block of 64 in every `stride` (at least
    // `SAMPLE_BLOCKS` blocks; all of a small chunk).
    const SAMPLE_BLOCK: usize = 64;
    const SAMPLE_BLOCKS: usize = 128;
    let w = T::BYTES;
    let n = old.len() / w;
    let stride = (n / (SAMPLE_BLOCK * SAMPLE_BLOCKS)).max(1);
    // Counted in four interleaved sets (word `j` of each four in set `j`):
    // neighbouring words mostly share a context, and with one counter each
    // increment waited on the one before (the context diff 0.98-0.99 of
    // the time, paired, Zen 3; the sample is 5-12 % of a chunk of the
    // training pairs' tensors). `codec::counts` over the sample's words,
    // whose sets lie the item count apart, took 3-4 % more of the context
    // diff, and a set per word index modulo four 1-2 % more.
    let mut sets = vec![[0u32; 4]; nctx];
    let mut sampled = 0usize;
    for block in old.chunks(SAMPLE_BLOCK * w).step_by(stride) {
        let fours = block.chunks_exact(4 * w);
        let rest = fours.remainder();
        for four in fours {
            for (word, set) in four.chunks_exact(w).zip(0..4) {
                sets[model.context(T::load(word))][set] += 1;
            }
        }
        for word in rest.chunks_exact(w) {
            sets[model.context(T::load(word))][0] += 1;
        }
        sampled += block.len() / w;
    }
    let elements: Vec<u64> = sets.iter().map(|set| set.iter().map(|&k| u64::from(k)).sum()).collect();
    let scale = n as f64 / sampled.max(1) as f64;
    // A bucket with changes takes a table entry and a bound, one without a bound.
    const LISTED_BITS: f64 = 32.0;
    const BOUND_BITS: f64 = 8.0;
    #[derive(Clone, Copy)]
    struct Segment {
        from: usize,
        elements: f64,
        changes: u64,
        bits: f64,
    }
    let segment = |from: usize, elements: f64, changes: u64| {
        let bits = if changes == 0 {
            BOUND_BITS
        } else {
            let m = changes as f64;
            let n = elements.max(m);
            let p = m / n;
            let flags = if p >= 1.0 { 0.0 } else { -(m * p.log2() + (n - m) * (1.0 - p).log2()) };
            flags + LISTED_BITS
        };
        Segment { from, elements, changes, bits }
    };
    let merged = |a: &Segment, b: &Segment| segment(a.from, a.elements + b.elements, a.changes + b.changes);
    let extra = |a: &Segment, b: &Segment| merged(a, b).bits - a.bits - b.bits;
    // Contexts present from the first with changes to the last.
    let mut segments: Vec<Segment> = (first..=last)
        .filter(|&c| elements[c] > 0 || changes[c] > 0)
        .map(|c| segment(c, elements[c] as f64 * scale, changes[c]))
        .collect();
    // What merging each neighbouring pair would add.
    let mut extras: Vec<f64> = segments.windows(2).map(|p| extra(&p[0], &p[1])).collect();
    let mut with_changes = segments.iter().filter(|s| s.changes > 0).count();
    while let Some((i, &least)) = extras.iter().enumerate().min_by(|a, b| a.1.total_cmp(b.1)) {
        let too_many = with_changes > MAX_BUCKETS_WITH_CHANGES || segments.len() + 1 > MAX_BOUNDS;
        if least > 0.0 && !too_many {
            break;
        }
        with_changes -= usize::from(segments[i].changes > 0 && segments[i + 1].changes > 0);
        segments[i] = merged(&segments[i], &segments[i + 1]);
        segments.remove(i + 1);
        extras.remove(i);
        if i > 0 {
            extras[i - 1] = extra(&segments[i - 1], &segments[i]);
        }
        if i < extras.len() {
            extras[i] = extra(&segments[i], &segments[i + 1]);
        }
    }
    let mut bounds: Vec<usize> = segments.iter().map(|s| s.from).filter(|&from| from > 0).collect();
    if last + 1 < nctx {
        bounds.push(last + 1);
    }
    Buckets::new(bounds, nctx)
}

/// Probabilities of a magnitude: `[0]` more than one ulp; `[1..16]` the
/// unary decisions of the bit length class (decision `i` at `min(i, 15)`);
/// `[16..31]` the bit below the leading one, by class (lengths 2..=16, the
/// longer ones sharing the last); `[31]` how many magnitudes the context
/// has coded (saturating), which sets its adaptation rate.
const ROW: usize = 32;
const CLASS: usize = 1;
const CLASS_SHARED: usize = 15;
const MANTISSA: usize = 16;
const MANTISSA_SHARED: usize = 14;
const COUNT: usize = 31;

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
        let mut row = [PROB_INIT; ROW];
        row[COUNT] = 0;
        StepModel { rows: vec![Row(row); contexts] }
    }

    /// The magnitude `v = |step| - 1` of a change in context `ctx`. The
    /// first two decisions (more than one ulp? more than two?) are coded
    /// without branches (the second only counts when the first is yes); the
    /// rest only when both are.
    #[inline(always)]
    fn encode(&mut self, rc: &mut RangeEncoder, ctx: usize, v: u64) {
        let row = &mut self.rows[ctx].0;
        let rate = Rate::advance(&mut row[COUNT]);
        rc.bit_unpredictable(&mut row[0], v > 0, rate);
        rc.bit_masked(&mut row[CLASS], v > 1, v > 0, rate);
        if v > 1 {
            Self::encode_rest(rc, row, v, rate);
        }
    }

    #[inline(always)]
    fn encode_rest(rc: &mut RangeEncoder, row: &mut [u16; ROW], v: u64, rate: Rate) {
        let nb = 64 - v.leading_zeros() as usize;
        for i in 2..64 {
            let more = nb > i;
            rc.bit(&mut row[CLASS + (i - 1).min(CLASS_SHARED - 1)], more, rate);
            if !more {
                break;
            }
        }
        if nb >= 2 {
            rc.bit(&mut row[MANTISSA + (nb - 2).min(MANTISSA_SHARED)], (v >> (nb - 2)) & 1 == 1, rate);
            rc.direct(v, nb as u32 - 2);
        }
    }

    /// `|step| - 1` (every code is a magnitude).
    #[inline(always)]
    fn decode(&mut self, rc: &mut RangeDecoder<'_>, ctx: usize) -> u64 {
        let row = &mut self.rows[ctx].0;
        let rate = Rate::advance(&mut row[COUNT]);
        let nonzero = rc.bit_unpredictable(&mut row[0], rate);
        if rc.bit_masked(&mut row[CLASS], nonzero, rate) {
            Self::decode_rest(rc, row, rate)
        } else {
            u64::from(nonzero)
        }
    }

    #[inline(always)]
    fn decode_rest(rc: &mut RangeDecoder<'_>, row: &mut [u16; ROW], rate: Rate) -> u64 {
        let mut nb = 2usize;
        while nb < 64 && rc.bit(&mut row[CLASS + (nb - 1).min(CLASS_SHARED - 1)], rate) {
            nb += 1;
        }
        if nb < 2 {
            return 1;
        }
        let second = u64::from(rc.bit(&mut row[MANTISSA + (nb - 2).min(MANTISSA_SHARED)], rate));
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

/// Encode `changes` (positions ascending, relative to the chunk; values
/// the XOR words, as `find_changes` finds them with `ChangeKind::Xor`) of
/// a chunk whose base bytes are `old` and new bytes `new`.
pub fn encode(old: &[u8], new: &[u8], changes: &SparseChanges, model: &ContextModel, level: i32) -> Vec<u8> {
    let elements = old.len() / model.width;
    encode_with(old, new, changes, model, level, StepCoding::for_changes(changes.positions.len(), elements))
}

/// `encode` with the step coding given (tests reach both with any chunk).
pub(super) fn encode_with(old: &[u8], new: &[u8], changes: &SparseChanges, model: &ContextModel, level: i32, steps: StepCoding) -> Vec<u8> {
    encode_edited(old, new, changes, model, level, steps, &|_| {})
}

/// `encode_with`, with `edit` given each change's context and step before
/// they are coded: tests forge payloads that no encoder writes (a step
/// that leaves its element as it was) but whose streams end right.
fn encode_edited(old: &[u8], new: &[u8], changes: &SparseChanges, model: &ContextModel, level: i32, steps: StepCoding, edit: &dyn Fn(&mut Survey)) -> Vec<u8> {
    match model.width {
        1 => encode_words::<u8>(old, new, changes, model, level, steps, edit),
        2 => encode_words::<u16>(old, new, changes, model, level, steps, edit),
        4 => encode_words::<u32>(old, new, changes, model, level, steps, edit),
        _ => encode_words::<u64>(old, new, changes, model, level, steps, edit),
    }
}

/// How a payload codes its ulp step magnitudes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StepCoding {
    /// In the range coder after the coded flags, with adaptive
    /// probabilities per context: no table to send, so it suits chunks
    /// with few changes.
    Adaptive = 0,
    /// Static tables and sixteen interleaved rANS states (`step_tables`):
    /// decoding is several times cheaper per change, for a few hundred
    /// bytes of tables.
    Tables = 1,
}

impl StepCoding {
    /// The encoder's choice for a chunk of `elements` elements with
    /// `changes` changes.
    pub(super) fn for_changes(changes: usize, elements: usize) -> Self {
        if step_tables::worth_it(changes, elements) {
            StepCoding::Tables
        } else {
            StepCoding::Adaptive
        }
    }
}

/// Each change's context and ulp step: what `encode_words` codes after
/// the positions.
#[derive(Debug, PartialEq, Eq)]
struct Survey {
    contexts: Vec<u16>,
    /// The step's magnitude less one (steps are never 0).
    magnitudes: Vec<u64>,
    /// Bit `j % 16` of word `j / 16`: change `j`'s step is negative.
    signs: Vec<u16>,
}

/// The `Survey` of the changes at `positions` (ascending, relative to the
/// chunk) from `old` to `new`, whose XOR words are `xors` (the vector
/// kernels read them in order rather than gather the new words).
fn survey<T: Word>(old: &[u8], new: &[u8], positions: &[u32], xors: &[u64], model: &ContextModel) -> Survey {
    assert_eq!(xors.len(), positions.len(), "one XOR word per change");
    // The kernels trust `xors` for the new words: the first and last
    // change checked against `new`, which catches changes of the other
    // kind (new words as values) unless their old words are zero.
    let w = T::BYTES;
    for j in [0, positions.len().saturating_sub(1)].into_iter().filter(|&j| j < positions.len()) {
        let p = positions[j] as usize;
        assert_eq!(
            T::load(&old[p * w..(p + 1) * w]) ^ xors[j],
            T::load(&new[p * w..(p + 1) * w]),
            "context::encode takes XOR changes (ChangeKind::Xor): change {j}'s value is not old XOR new"
        );
    }
    let mut out = Survey::for_changes(positions.len());
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut done = 0;
    // The widest vector kernel this CPU runs takes the leading changes.
    #[cfg(target_arch = "x86_64")]
    {
        use super::{gather_x86, x86};
        type Kernel = unsafe fn(&[u8], &[u64], &[u32], gather_x86::StepModel32, &mut [u16], &mut [u64], &mut [u16]);
        let chosen: Option<(usize, [Kernel; 3])> = if gather_x86::available() {
            let kernels: [Kernel; 3] = [gather_x86::survey_steps::<1>, gather_x86::survey_steps::<2>, gather_x86::survey_steps::<4>];
            Some((gather_x86::kernel_prefix(positions, T::BYTES, old.len(), 0), kernels))
        } else if super::avx2_available() {
            Some((x86::survey_prefix(positions, T::BYTES, old.len()), [x86::survey_steps::<1>, x86::survey_steps::<2>, x86::survey_steps::<4>]))
        } else {
            None
        };
        if let Some((head, kernels)) = chosen.filter(|c| c.0 > 0) {
            let (contexts, magnitudes, signs) = (&mut out.contexts[..head], &mut out.magnitudes[..head], &mut out.signs[..head.div_ceil(16)]);
            let kernel = kernels[match T::BYTES {
                1 => 0,
                2 => 1,
                _ => 2,
            }];
            // Safety: each `*_prefix` takes only positions whose loads stay
            // in the chunk (so T::BYTES is 1, 2 or 4), and the CPU has what
            // the kernel needs (checked just above).
            #[allow(unsafe_code)]
            unsafe {
                kernel(old, &xors[..head], &positions[..head], model.step_model32(), contexts, magnitudes, signs)
            };
            done = head;
        }
    }
    survey_from::<T>(old, new, positions, model, done, &mut out);
    out
}

impl Survey {
    /// Room for `m` changes, all zero.
    #[cfg(test)]
    fn zeroed(m: usize) -> Self {
        Survey { contexts: vec![0; m], magnitudes: vec![0; m], signs: vec![0; m.div_ceil(16)] }
    }

    /// Room for `m` changes in the buffers of the chunk this thread encoded
    /// before (`reused`): their contexts and magnitudes hold whatever that
    /// chunk left, and `survey` overwrites every one; the signs are zero.
    fn for_changes(m: usize) -> Self {
        Survey { contexts: reused(&CONTEXTS, m), magnitudes: reused(&MAGNITUDES, m), signs: vec![0; m.div_ceil(16)] }
    }
}

type Reusable<T> = std::thread::LocalKey<std::cell::RefCell<Vec<T>>>;

thread_local! {
    /// Per thread, the buffers of the last chunk it encoded or decoded in
    /// context mode, for the next (`reused`, `keep`): a chunk's fresh
    /// buffers were zeroed and their pages faulted in anew (in the encode,
    /// 3-4 % of its samples at fp32m 10->15).
    static CONTEXTS: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
    static MAGNITUDES: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
    static GAPS: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `len` elements in the buffer `slot` holds: whatever the chunk before
/// left there, zeros where it grows. The caller overwrites every one.
fn reused<T: Copy + Default>(slot: &'static Reusable<T>, len: usize) -> Vec<T> {
    let mut buffer = slot.with(|cell| std::mem::take(&mut *cell.borrow_mut()));
    buffer.resize(len, T::default());
    buffer
}

/// Hand `buffer` back to `slot` for the next chunk (unless it holds more
/// than 32 MiB).
fn keep<T>(slot: &'static Reusable<T>, buffer: Vec<T>) {
    if buffer.capacity() * std::mem::size_of::<T>() <= 32 << 20 {
        slot.with(|cell| *cell.borrow_mut() = buffer);
    }
}

/// `survey`, one change at a time, from change `from` on.
fn survey_from<T: Word>(old: &[u8], new: &[u8], positions: &[u32], model: &ContextModel, from: usize, out: &mut Survey) {
    let w = T::BYTES;
    for (j, &p) in positions.iter().enumerate().skip(from) {
        let p = p as usize;
        let o = T::load(&old[p * w..(p + 1) * w]);
        let step = model.step(o, T::load(&new[p * w..(p + 1) * w]));
        out.contexts[j] = model.context(o) as u16;
        out.magnitudes[j] = step.unsigned_abs() - 1;
        out.signs[j / 16] |= u16::from(step < 0) << (j % 16);
    }
}

/// Each bucket's changes as the gaps between their ranks (a change's rank:
/// how many earlier elements of the chunk share its bucket), bucket by
/// bucket: what the position codes of `encode_words` take.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct BucketGaps {
    /// Bucket `b`'s gaps, in rank order, at `gaps[start[b]..start[b + 1]]`:
    /// its first change's rank, then each rank less the one before, less one.
    pub(super) gaps: Vec<u32>,
    pub(super) start: Vec<usize>,
    /// Per bucket: its last change's rank plus one (0 without changes),
    /// the flags a coded-flags bucket codes.
    pub(super) span: Vec<u32>,
}

impl BucketGaps {
    /// Room for `per_bucket[b]` gaps of each bucket `b`, none taken yet
    /// (in the buffer of the chunk this thread encoded before: `take`
    /// writes every slot, as `finish` checks).
    pub(super) fn with_counts(per_bucket: &[u32]) -> Self {
        let mut start = Vec::with_capacity(per_bucket.len() + 1);
        let mut total = 0usize;
        start.push(0);
        for &k in per_bucket {
            total += k as usize;
            start.push(total);
        }
        BucketGaps { gaps: reused(&GAPS, total), start, span: vec![0; per_bucket.len()] }
    }

    /// Take the next change of its bucket, whose rank is `rank`; `at` is
    /// the bucket's next free slot. The ranks become gaps in `finish`: a
    /// gap made here would wait on the bucket's change before, through
    /// memory, wherever a bucket's changes follow each other.
    #[inline(always)]
    pub(super) fn take(&mut self, at: &mut usize, rank: u32) {
        self.gaps[*at] = rank;
        *at += 1;
    }

    /// Check that every bucket took the changes it was sized for (`at`:
    /// each bucket's next free slot), then turn each bucket's ranks into
    /// gaps and note its span.
    pub(super) fn finish(&mut self, at: &[usize]) {
        assert!(
            at.iter().zip(&self.start[1..]).all(|(a, end)| a == end),
            "the changes per bucket match the positions"
        );
        for (b, span) in self.span.iter_mut().enumerate() {
            let mut next = 0u32; // the rank after the change before
            for slot in &mut self.gaps[self.start[b]..self.start[b + 1]] {
                let rank = *slot;
                *slot = rank - next;
                next = rank + 1;
            }
            *span = next;
        }
    }

    fn of(&self, b: usize) -> &[u32] {
        &self.gaps[self.start[b]..self.start[b + 1]]
    }
}

/// The `BucketGaps` of the changes at `positions` (ascending, relative to
/// the chunk `old`), of which `per_bucket[b]` lie in bucket `b`.
fn bucket_gaps<T: Word>(old: &[u8], model: &ContextModel, buckets: &Buckets, positions: &[u32], per_bucket: &[u32]) -> BucketGaps {
    #[cfg(target_arch = "x86_64")]
    if model.contexts() <= 256 && T::BYTES <= 4 && super::x86::available() {
        return super::x86::bucket_gaps::<T>(old, model, buckets, positions, per_bucket);
    }
    bucket_gaps_reference::<T>(old, model, buckets, positions, per_bucket)
}

/// `bucket_gaps`, one element at a time.
fn bucket_gaps_reference<T: Word>(old: &[u8], model: &ContextModel, buckets: &Buckets, positions: &[u32], per_bucket: &[u32]) -> BucketGaps {
    let w = T::BYTES;
    let mut out = BucketGaps::with_counts(per_bucket);
    let mut at = out.start[..per_bucket.len()].to_vec();
    let mut seen = vec![0u32; buckets.len()];
    let bucket = |word: &[u8]| buckets.of(model.context(T::load(word)));
    let mut run_start = 0usize;
    for &p in positions {
        let p = p as usize;
        for word in old[run_start * w..p * w].chunks_exact(w) {
            seen[bucket(word)] += 1;
        }
        let b = bucket(&old[p * w..(p + 1) * w]);
        out.take(&mut at[b], seen[b]);
        seen[b] += 1;
        run_start = p + 1;
    }
    out.finish(&at);
    out
}

/// Position modes of a listed bucket (bits 0-1 of its table byte).
const MODE_RICE: u8 = 0;
const MODE_CODED_FLAGS: u8 = 1;
const MODE_RUNS: u8 = 2;

/// A dense bucket's changes as runs: its ranks alternate between runs of
/// unchanged and of changed elements, and the lengths of both are coded as
/// two Rice lists (`unchanged[0]` is the first run, from rank 0, and may
/// be empty; each later unchanged run less one; each changed run less
/// one). Where changes come in runs this codes what the order-1 coded
/// flags do, per run rather than per element. The buffers are kept from
/// bucket to bucket; the runs are their first `count` values.
struct Runs {
    unchanged: Vec<u32>,
    changed: Vec<u32>,
    count: usize,
}

/// Runs are tried where at least one change in this many follows a change:
/// with fewer the two lists together are about as long as the gaps and
/// cannot code them in fewer bits.
const RUNS_MIN_SHARE: u64 = 4;

impl Runs {
    /// Fill with the runs of a bucket's gaps (its first rank, then each
    /// rank less the one before, less one).
    fn fill(&mut self, gaps: &[u32]) {
        let Some((&first, rest)) = gaps.split_first() else {
            self.count = 0;
            return;
        };
        // Every slot below is written before it is read.
        if self.unchanged.len() < gaps.len() {
            self.unchanged.resize(gaps.len(), 0);
            self.changed.resize(gaps.len(), 0);
        }
        // Branch-free (whether a change follows a change is a coin toss
        // in these buckets): every gap writes both slots, a nonzero one
        // keeps them.
        let (unchanged, changed) = (&mut self.unchanged[..gaps.len()], &mut self.changed[..gaps.len()]);
        unchanged[0] = first;
        let (mut runs, mut run) = (0usize, 0u32); // runs ended; the current one, less one
        for &g in rest {
            let ends = usize::from(g != 0);
            // `runs` is at most this gap's index in `rest`: both slots
            // lie inside.
            changed[runs] = run;
            unchanged[runs + 1] = g.wrapping_sub(1);
            runs += ends;
            run = if ends == 1 { 0 } else { run + 1 };
        }
        changed[runs] = run;
        self.count = runs + 1;
    }

    fn unchanged(&self) -> &[u32] {
        &self.unchanged[..self.count]
    }

    fn changed(&self) -> &[u32] {
        &self.changed[..self.count]
    }

    /// The best Rice parameters of the two lists and their bits.
    fn costs(&self) -> ((u32, u64), (u32, u64)) {
        let best = |values: &[u32]| {
            let count = values.len() as u64;
            best_rice_parameter(values, values.iter().map(|&v| u64::from(v)).sum::<u64>() + count, count)
        };
        (best(self.unchanged()), best(self.changed()))
    }
}

/// A bucket with at least one change per `CODED_FLAGS_SPAN_PER_CHANGE`
/// elements (dense) may code its changes as runs or as range-coded flags
/// (one adaptive decision per element up to its last change) instead of
/// its gaps as Rice codes. At such densities a Rice code of the gaps can
/// lose a fifth of a bit per change (most changes of pure-bf16 training
/// sit in such buckets, the smallest exponents), where changes come in
/// runs. Runs are taken where they are smaller than the gaps' Rice codes;
/// the flags, which decode one element at a time, only where their
/// estimated cost is below `CODED_FLAGS_GAIN` of the smaller of the two.
/// Measured against format v7's choice (flags where below 0.95 of the
/// gaps' codes, no runs) on the training pairs (`ab_timing` with
/// `DELTAS=2 MODE=context`, paired, Zen 3): the context apply of fp32m
/// 10->11 0.97-0.98, bf16 10->11 0.92-0.94, 12->15 0.90-0.91, 10->15
/// 0.92-0.94 of the time, the diff 0.98-1.01, for 0.2-0.6 % more bytes;
/// no flags at all (only runs) decoded no faster on the fp32m pairs, 3 %
/// faster on bf16, for 0.1-0.2 % more bytes again.
const CODED_FLAGS_SPAN_PER_CHANGE: u64 = 8;
const CODED_FLAGS_GAIN: f64 = 0.9;

/// The bits the flags of a bucket with these gaps take when each is coded
/// with a probability picked by the flag before it, as the empirical
/// conditional entropy plus a learning allowance of two probabilities;
/// `after_change` is how many of its changes follow a change (the zero
/// gaps after the first).
fn coded_flags_estimate(gaps: &[u32], span: u64, after_change: u64) -> f64 {
    fn entropy(a: u64, b: u64) -> f64 {
        let t = (a + b) as f64;
        [a, b].iter().filter(|&&x| x > 0).map(|&x| -(x as f64) * (x as f64 / t).log2()).sum()
    }
    // After a change: a change next when the gap is 0. After an unchanged
    // element: a change next once per nonzero gap (the first flag follows
    // an unchanged one).
    let m = gaps.len() as u64;
    let change_then_change = after_change;
    let change_then_same = m.saturating_sub(1) - after_change;
    let unchanged = span - m;
    let same_then_change = m - after_change - u64::from(gaps.first() == Some(&0));
    let same_then_same = unchanged - same_then_change;
    entropy(change_then_change, change_then_same) + entropy(same_then_change, same_then_same) + 2.0 * ((span + 1) as f64).log2()
}

/// Always inlined into `encode_with`: left to the compiler, it became a
/// function of its own once the rank kernels grew, and the context encode
/// measured 4-8 % slower on the fp32-master pairs.
#[inline(always)]
fn encode_words<T: Word>(old: &[u8], new: &[u8], changes: &SparseChanges, model: &ContextModel, level: i32, steps: StepCoding, edit: &dyn Fn(&mut Survey)) -> Vec<u8> {
    let w = T::BYTES;
    let nctx = model.contexts();
    let positions = &changes.positions;
    // Each change's context and ulp magnitude (coded after the flags), and
    // the changes per context, which choose the buckets.
    let mut surveyed = survey::<T>(old, new, positions, &changes.values, model);
    edit(&mut surveyed);
    let Survey { contexts, magnitudes, signs } = surveyed;
    let per_context = super::counts(contexts.iter().map(|&c| usize::from(c)), nctx);
    let buckets = choose_buckets::<T>(old, model, &per_context);
    let mut per_bucket = vec![0u32; buckets.len()];
    for (c, &k) in per_context.iter().enumerate() {
        per_bucket[buckets.of(c)] += k as u32; // a chunk has fewer than 2^32 elements
    }
    let bucket_gaps = bucket_gaps::<T>(old, model, &buckets, positions, &per_bucket);
    // Per bucket: its flags range-coded when dense, else its gaps as Rice
    // codes with the best parameter, one bit stream for all buckets.
    let mut table = Vec::new();
    // One byte: the bound count (at most MAX_BOUNDS = 15) and the step coding.
    table.push(buckets.bounds.len() as u8 | (steps as u8) << 4);
    let mut prev_bound = 0usize;
    for &bound in &buckets.bounds {
        put_varint(&mut table, (bound - prev_bound) as u64);
        prev_bound = bound;
    }
    let mut listed = 0u64;
    let mut entries = Vec::new();
    let mut prev_bucket = 0usize;
    let mut rice = RiceWriter::new();
    let mut rc = RangeEncoder::default();
    let mut runs = Runs { unchanged: Vec::new(), changed: Vec::new(), count: 0 };
    for b in 0..buckets.len() {
        let gaps = bucket_gaps.of(b);
        let m_b = gaps.len() as u64;
        if m_b == 0 {
            continue;
        }
        let span = u64::from(bucket_gaps.span[b]); // flags up to the last change
        let (k, rice_bits) = best_rice_parameter(gaps, span, m_b);
        let dense = m_b * CODED_FLAGS_SPAN_PER_CHANGE >= span;
        // How many changes follow a change (zero gaps after the first).
        let after_change = if dense { gaps[1..].iter().filter(|&&g| g == 0).count() as u64 } else { 0 };
        let run_costs = (dense && after_change * RUNS_MIN_SHARE >= m_b).then(|| {
            runs.fill(gaps);
            runs.costs()
        });
        // The runs' count and second parameter take about two bytes more.
        let runs_bits = run_costs.map_or(u64::MAX, |((_, a), (_, b))| a + b + 16);
        let fast_bits = rice_bits.min(runs_bits);
        put_varint(&mut entries, (b - prev_bucket) as u64);
        put_varint(&mut entries, m_b);
        if dense && coded_flags_estimate(gaps, span, after_change) < CODED_FLAGS_GAIN * fast_bits as f64 {
            // Ranks 0 up to its last change, each flag coded under the
            // flag before it (changes come in runs).
            rc.order1_flags(gaps);
            entries.push(MODE_CODED_FLAGS);
        } else if let Some(((k_unchanged, unchanged_bits), (k_changed, changed_bits))) = run_costs.filter(|_| runs_bits < rice_bits) {
            rice.put_gaps(runs.unchanged(), k_unchanged, unchanged_bits);
            rice.put_gaps(runs.changed(), k_changed, changed_bits);
            entries.push(MODE_RUNS | (k_unchanged as u8) << 2);
            entries.push(k_changed as u8);
            put_varint(&mut entries, runs.count as u64);
        } else {
            rice.put_gaps(gaps, k, rice_bits);
            entries.push(MODE_RICE | (k as u8) << 2);
        }
        prev_bucket = b;
        listed += 1;
    }
    put_varint(&mut table, listed);
    table.extend_from_slice(&entries);
    let mut out = table;
    put_stream(&mut out, &rice.finish(), level);
    match steps {
        StepCoding::Tables => step_tables::encode(&contexts, &magnitudes, &per_context, w, &mut out),
        StepCoding::Adaptive => {
            let mut model = StepModel::new(nctx);
            for (&c, &v) in contexts.iter().zip(&magnitudes) {
                model.encode(&mut rc, usize::from(c), v);
            }
        }
    }
    out.extend(signs.iter().flat_map(|word| word.to_le_bytes()).take(positions.len().div_ceil(8)));
    out.extend_from_slice(&rc.finish());
    keep(&CONTEXTS, contexts);
    keep(&MAGNITUDES, magnitudes);
    keep(&GAPS, bucket_gaps.gaps);
    out
}

/// Decode a context-coded payload against the chunk's base bytes `old`.
/// Returns the changes as XOR masks or new words (by `kind`).
///
/// Both paths first decode each listed bucket's changed ranks into a
/// bitmap. On x86-64 with AVX2 and a fast BMI2, words of up to 4 bytes with
/// up to 256 contexts then expand those bitmaps into element order block by
/// block (`codec::x86`), and decode table-coded steps sixteen at a time
/// with AVX-512 (`step_tables::avx512`), eight with AVX2
/// (`step_tables::avx2`); everything else (8-byte words, other
/// CPUs) walks the elements and the changes one at a time
/// (`decode_reference`). Both accept and refuse the same payloads and
/// return the same changes.
pub fn decode(
    payload: &[u8],
    old: &[u8],
    model: &ContextModel,
    n_changed: u32,
    kind: ChangeKind,
    context: &str,
) -> Result<SparseChanges> {
    let (positions, planes) = decode_split(payload, old, model, n_changed, kind, context)?;
    Ok(SparseChanges { positions, values: words_of(&planes) })
}

/// `decode`, with the value words as byte planes (byte `j` of each word in
/// plane `j`), as a chunk is applied.
pub(super) fn decode_split(
    payload: &[u8],
    old: &[u8],
    model: &ContextModel,
    n_changed: u32,
    kind: ChangeKind,
    context: &str,
) -> Result<(Vec<u32>, Vec<Vec<u8>>)> {
    let (positions, planes, _) = decode_words_of_width(payload, &mut Base::Read(old), model, n_changed, kind, context, fastest_expansion(model))?;
    Ok((positions, planes))
}

/// `decode_split` of XOR changes that also applies them to `target`, the
/// chunk they decode against (`first`: its first element in its tensor),
/// and returns the digest move of the words written. On an error nothing
/// of the chunk is left written. The groups of changes the vector kernel
/// decodes are written from its registers, the rest once all decoded.
pub(super) fn decode_split_in_place(
    payload: &[u8],
    target: &mut [u8],
    first: u64,
    model: &ContextModel,
    n_changed: u32,
    context: &str,
) -> Result<(Vec<u32>, Vec<Vec<u8>>, DigestSum)> {
    let mut base = Base::Written { target, first };
    let (positions, planes, moved) = decode_words_of_width(payload, &mut base, model, n_changed, ChangeKind::Xor, context, fastest_expansion(model))?;
    Ok((positions, planes, moved.expect("a written base's digest move")))
}

/// The widest expansion this CPU runs for `model`.
fn fastest_expansion(model: &ContextModel) -> Expansion {
    #[cfg(target_arch = "x86_64")]
    if model.contexts() <= 256 && model.width <= 4 && super::x86::available() {
        return Expansion::Blocks;
    }
    let _ = model;
    Expansion::Elements
}

/// The base words a chunk decodes against.
enum Base<'a> {
    /// Read only: the decoded changes are the result.
    Read(&'a [u8]),
    /// The target itself, XOR changes written into it as they are decoded
    /// (`first`: the chunk's first element in its tensor).
    Written { target: &'a mut [u8], first: u64 },
}

impl Base<'_> {
    fn words(&self) -> &[u8] {
        match self {
            Base::Read(old) => old,
            Base::Written { target, .. } => target,
        }
    }
}

/// The portable decoder: rank bitmaps expanded into element order one
/// element at a time, steps decoded one change at a time. The test oracle
/// of the fast decoder.
pub fn decode_reference(
    payload: &[u8],
    old: &[u8],
    model: &ContextModel,
    n_changed: u32,
    kind: ChangeKind,
    context: &str,
) -> Result<SparseChanges> {
    let (positions, planes, _) = decode_words_of_width(payload, &mut Base::Read(old), model, n_changed, kind, context, Expansion::Elements)?;
    Ok(SparseChanges { positions, values: words_of(&planes) })
}

/// Positions, value planes and (a written base) the digest move.
type DecodedWords = (Vec<u32>, Vec<Vec<u8>>, Option<DigestSum>);

/// `decode_words` for the model's word width.
fn decode_words_of_width(
    payload: &[u8],
    base: &mut Base<'_>,
    model: &ContextModel,
    n_changed: u32,
    kind: ChangeKind,
    context: &str,
    expansion: Expansion,
) -> Result<DecodedWords> {
    match model.width {
        1 => decode_words::<u8>(payload, base, model, n_changed, kind, context, expansion),
        2 => decode_words::<u16>(payload, base, model, n_changed, kind, context, expansion),
        4 => decode_words::<u32>(payload, base, model, n_changed, kind, context, expansion),
        _ => decode_words::<u64>(payload, base, model, n_changed, kind, context, expansion),
    }
}

/// How rank bitmaps become element positions, and steps new words.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Expansion {
    /// One element and one change at a time, a counter per bucket
    /// (portable).
    Elements,
    /// 64 or 256 elements at a time (`codec::x86`; AVX2 and fast BMI2),
    /// and table-coded steps sixteen at a time with AVX-512, eight with
    /// AVX2 (`step_tables`).
    #[cfg(target_arch = "x86_64")]
    Blocks,
}

/// One listed bucket of a payload.
struct Listed {
    bucket: usize,
    changes: u64,
    mode: u8,
    /// The Rice parameter (runs: of the unchanged runs).
    k: u32,
    /// Runs mode: the parameter of the changed runs and how many there are.
    k_changed: u32,
    runs: u64,
}

/// A payload's bucket table and streams, checked for consistency with the
/// chunk (n elements, m changes) but not yet decoded.
struct Parsed<'a> {
    buckets: Buckets,
    listed: Vec<Listed>,
    /// The Rice codes of the Rice-mode buckets, in table order.
    rice: std::borrow::Cow<'a, [u8]>,
    /// One bit per change: its step is negative.
    signs: &'a [u8],
    /// The step magnitudes' sections when they are table-coded.
    tables: Option<step_tables::Sections<'a>>,
    /// The range-coded flags of the dense buckets, then the step magnitudes
    /// when they are coded adaptively.
    coded: &'a [u8],
}

fn parse<'a>(payload: &'a [u8], n: usize, m: usize, nctx: usize, context: &'a str) -> Result<Parsed<'a>> {
    let bad = |detail: &str| Error::corrupt(context, detail.to_string());
    let truncated = || bad("bucket table truncated");
    let mut pos = 0usize;
    let head = *payload.first().ok_or_else(|| bad("bucket bound count missing"))?;
    pos += 1;
    let (n_bounds, coding) = (usize::from(head & 0x0f), head >> 4);
    let tables = match coding {
        c if c == StepCoding::Adaptive as u8 => false,
        c if c == StepCoding::Tables as u8 => true,
        other => return Err(bad(&format!("unknown step coding {other} (this build knows 0, adaptive, and 1, tables)"))),
    };
    if n_bounds > MAX_BOUNDS || n_bounds >= nctx {
        return Err(bad(&format!("{n_bounds} bucket bounds (at most {} for {nctx} contexts)", MAX_BOUNDS.min(nctx - 1))));
    }
    let mut bounds = Vec::with_capacity(n_bounds);
    let mut bound = 0usize;
    for _ in 0..n_bounds {
        let delta = get_varint(payload, &mut pos, 10).ok_or_else(truncated)? as usize;
        bound = bound.checked_add(delta).filter(|&b| delta > 0 && b < nctx).ok_or_else(|| bad("bucket bounds out of order"))?;
        bounds.push(bound);
    }
    let buckets = Buckets::new(bounds, nctx);
    let nb = buckets.len();
    let count = get_varint(payload, &mut pos, 10).ok_or_else(|| bad("bucket count missing"))? as usize;
    if count > nb || count > m {
        return Err(bad("more buckets listed than exist or changed"));
    }
    let mut listed = Vec::with_capacity(count);
    let (mut bucket, mut total) = (0usize, 0u64);
    for i in 0..count {
        let delta = get_varint(payload, &mut pos, 10).ok_or_else(truncated)? as usize;
        bucket = bucket.checked_add(delta).filter(|&b| b < nb && (i == 0 || delta > 0)).ok_or_else(|| bad("bucket ids out of order"))?;
        let changes = get_varint(payload, &mut pos, 10).ok_or_else(truncated)?;
        let code = *payload.get(pos).ok_or_else(truncated)?;
        pos += 1;
        let (mode, k) = (code & 3, u32::from(code >> 2));
        let (mut k_changed, mut runs) = (0, 0);
        if mode == MODE_RUNS {
            k_changed = u32::from(*payload.get(pos).ok_or_else(truncated)?);
            pos += 1;
            runs = get_varint(payload, &mut pos, 10).ok_or_else(truncated)?;
        }
        if changes == 0
            || changes > m as u64
            || k > 31
            || k_changed > 31
            || mode > MODE_RUNS
            || (mode == MODE_CODED_FLAGS && k != 0)
            || (mode == MODE_RUNS && !(1..=changes).contains(&runs))
        {
            return Err(bad(&format!("bad bucket entry (position mode {mode}, parameters {k} and {k_changed}, {runs} runs of {changes} changes)")));
        }
        total += changes;
        listed.push(Listed { bucket, changes, mode, k, k_changed, runs });
    }
    if total != m as u64 {
        return Err(bad("bucket table does not match the chunk's change count"));
    }
    let mut streams = StreamReader::new(&payload[pos..], context);
    let rice = streams.next("positions", 0, stream_bound(m, n))?;
    let rest = streams.rest();
    let mut pos = 0;
    let tables = if tables { Some(step_tables::sections(rest, &mut pos, context)?) } else { None };
    let rest = &rest[pos..];
    let signs_len = m.div_ceil(8);
    // The range coder's output is at least 5 bytes.
    if rest.len() < signs_len + 5 {
        return Err(Error::truncated(format!("{context}, step signs and range-coded stream"), (signs_len + 5) as u64, rest.len() as u64));
    }
    let (signs, coded) = rest.split_at(signs_len);
    Ok(Parsed { buckets, listed, rice, signs, tables, coded })
}

/// Per bucket, the ranks (indices within the bucket's own subsequence of
/// elements) that changed, as one bitmap per bucket laid end to end in
/// `words`: bit `r` of bucket `b` is bit `r % 64` of
/// `words[base[b] + r / 64]`. Each bucket's bitmap ends at its last
/// change (`limit[b]` bits) and is followed by `BITMAP_PADDING_WORDS`
/// zero words, so that a window of two words starting below the limit
/// plus `64 * (BITMAP_PADDING_WORDS - 1)` stays inside it: the expansion
/// kernels read a block of windows with no clamp. An unlisted bucket has
/// limit 0.
pub(super) const BITMAP_PADDING_WORDS: usize = 4;

pub(super) struct RankBitmaps {
    pub(super) words: Vec<u64>,
    pub(super) base: Vec<usize>,
    pub(super) limit: Vec<u64>,
}

/// Decode every listed bucket's changed ranks into its rank bitmap: the
/// Rice-mode ones from the positions stream, the coded-flag ones from the
/// range coder `rc`. Refuses streams that end early or run on, and ranks
/// that cannot fit the chunk (the bitmaps of all buckets together never
/// hold more than n bits, since the buckets partition the n elements).
fn rank_bitmaps(parsed: &Parsed<'_>, n: usize, rc: &mut RangeDecoder<'_>, context: &str) -> Result<RankBitmaps> {
    let bad = |detail: &str| Error::corrupt(context, detail.to_string());
    let nb = parsed.buckets.len();
    let mut maps = RankBitmaps { words: Vec::new(), base: vec![0; nb], limit: vec![0; nb] };
    let mut bits_left = n as u64;
    let (mut ranks, mut ends) = (Vec::new(), Vec::new());
    let low_bits = parsed
        .listed
        .iter()
        .map(|l| match l.mode {
            MODE_RICE => l.changes * u64::from(l.k),
            MODE_RUNS => l.runs * u64::from(l.k + l.k_changed),
            _ => 0,
        })
        .sum();
    let mut reader = RiceReader::new(&parsed.rice, low_bits).map_err(bad)?;
    for l in &parsed.listed {
        let base = maps.words.len();
        maps.base[l.bucket] = base;
        let limit = match l.mode {
            MODE_RICE => {
                ranks.clear();
                let next = reader.read_ascending(l.k, l.changes, bits_left, &mut ranks).map_err(bad)?;
                maps.words.resize(base + next.div_ceil(64) as usize, 0);
                set_ranks(&mut maps.words[base..], &ranks);
                next
            }
            MODE_RUNS => {
                // Read as ascending lists: the unchanged elements before
                // each changed run, and the changes up to each run's end
                // (less one).
                if l.changes > bits_left {
                    return Err(bad("positions beyond the chunk's elements"));
                }
                ranks.clear();
                ends.clear();
                reader.read_ascending(l.k, l.runs, bits_left - l.changes + 1, &mut ranks).map_err(bad)?;
                if reader.read_ascending(l.k_changed, l.runs, l.changes, &mut ends).map_err(bad)? != l.changes {
                    return Err(bad("changed runs do not add up to the bucket's changes"));
                }
                let span = u64::from(ranks[ranks.len() - 1]) + l.changes;
                maps.words.resize(base + span.div_ceil(64) as usize, 0);
                set_runs(&mut maps.words[base..], &ranks, &ends);
                span
            }
            _ => rc.order1_flags(l.changes, bits_left, &mut maps.words).ok_or_else(|| bad("positions beyond the chunk's elements"))?,
        };
        bits_left -= limit;
        maps.limit[l.bucket] = limit;
        maps.words.resize(base + limit.div_ceil(64) as usize + BITMAP_PADDING_WORDS, 0);
    }
    reader.finish().map_err(bad)?;
    Ok(maps)
}

/// Set bit `r % 64` of `map[r / 64]` for each rank `r` of `ranks`
/// (ascending, each below `64 * map.len()`) in a `map` of zeros. Each rank
/// stores its word as built so far in a register, branch-free: an OR into
/// memory per rank made a chain through memory wherever ranks share a
/// word, and a branch per new word was mispredicted.
fn set_ranks(map: &mut [u64], ranks: &[u32]) {
    let (mut at, mut word) = (usize::MAX, 0u64);
    for &rank in ranks {
        let index = (rank / 64) as usize;
        let same = u64::from(index == at).wrapping_neg();
        word = (word & same) | 1 << (rank % 64);
        map[index] = word;
        at = index;
    }
}

/// Set the runs of changed ranks in a `map` of zeros: run `j` follows
/// `unchanged[j]` unchanged ranks in all and ends after `ends[j] + 1`
/// changes in all (both ascending, as `RiceReader::read_ascending` reads
/// them; the runs fit the map).
fn set_runs(map: &mut [u64], unchanged: &[u32], ends: &[u32]) {
    let mut changes_before = 0u64;
    for (&u, &end) in unchanged.iter().zip(ends) {
        let end = u64::from(end) + 1;
        let (mut at, mut left) = (u64::from(u) + changes_before, end - changes_before);
        while left > 0 {
            let offset = at % 64;
            let take = left.min(64 - offset);
            map[(at / 64) as usize] |= (u64::MAX >> (64 - take)) << offset;
            at += take;
            left -= take;
        }
        changes_before = end;
    }
}

/// The positions of the changes, rank bitmaps walked in element order one
/// element at a time.
fn expand_reference<T: Word>(old: &[u8], model: &ContextModel, buckets: &Buckets, maps: &RankBitmaps) -> Vec<u32> {
    let mut seen = vec![0u64; buckets.len()];
    let mut positions = Vec::new();
    for (i, word) in old.chunks_exact(T::BYTES).enumerate() {
        let c = buckets.of(model.context(T::load(word)));
        let rank = seen[c];
        seen[c] = rank + 1;
        if rank < maps.limit[c] && (maps.words[maps.base[c] + (rank / 64) as usize] >> (rank % 64)) & 1 == 1 {
            positions.push(i as u32);
        }
    }
    positions
}

/// The value of a change of `old` by magnitude `v + 1` and sign into
/// `out`; true when it leaves the element unchanged (a corrupt payload).
/// `model.apply_step` with the word width known.
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

/// Parse, rank bitmaps, positions (by `expansion`), then the ulp steps of
/// the changes in one pass.
fn decode_words<T: Word>(
    payload: &[u8],
    base: &mut Base<'_>,
    model: &ContextModel,
    n_changed: u32,
    kind: ChangeKind,
    context: &str,
    expansion: Expansion,
) -> Result<DecodedWords> {
    debug_assert!(matches!(base, Base::Read(_)) || kind == ChangeKind::Xor, "a written base takes XOR changes");
    // Changes already written into a written base, and their digest move:
    // put back before any error returns.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut written = (0usize, DigestSum::ZERO);
    let w = T::BYTES;
    let n = base.words().len() / w;
    let m = n_changed as usize;
    let bad = |detail: &str| Error::corrupt(context, detail.to_string());
    let nctx = model.contexts();
    let parsed = parse(payload, n, m, nctx, context)?;
    let mut rc = RangeDecoder::new(parsed.coded).ok_or_else(|| bad("range-coded stream too short"))?;
    let maps = rank_bitmaps(&parsed, n, &mut rc, context)?;
    let buckets = &parsed.buckets;
    let signs = parsed.signs;
    // The value words' bytes, plane by plane (as a chunk is applied).
    let mut planes: Vec<Vec<u8>> = (0..w).map(|_| vec![0u8; m]).collect();
    // The table-coded steps' decoder, and the changes it decoded while the
    // positions were found (written in place, segment by segment).
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut steps = parsed.tables.as_ref().map(|sections| step_tables::Decoder::new(sections, nctx, w, context)).transpose()?;
    // Refused after the loop: a change that does not change its element.
    let mut unchanged = false;
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    let mut segmented = false;
    let positions = match expansion {
        Expansion::Elements => expand_reference::<T>(base.words(), model, buckets, &maps),
        #[cfg(target_arch = "x86_64")]
        Expansion::Blocks => {
            let listed: Vec<usize> = parsed.listed.iter().map(|l| l.bucket).collect();
            let mut positions = Vec::with_capacity(m + super::x86::SPARE);
            let in_place = match (&mut *base, steps.as_mut()) {
                (Base::Written { target, first }, Some(steps)) => {
                    let segments = super::x86::Segments::new::<T>(model, buckets, &listed, &maps, n, m);
                    segments.zip(step_tables::InPlaceGroups::new(steps, *first, n)).map(|(segments, groups)| {
                        decode_segments::<T>(segments, groups, steps, target, model, signs, &mut positions, &mut planes)
                    })
                }
                _ => None,
            };
            match in_place {
                Some(groups) => {
                    (done, unchanged, segmented) = (groups.taken, groups.unchanged, true);
                    written = (groups.taken, groups.moved);
                }
                None => super::x86::expand::<T>(base.words(), model, buckets, &listed, &maps, &mut positions),
            }
            positions
        }
    };
    if positions.len() != m {
        put_back::<T>(base, &positions, &planes, written.0);
        return Err(bad("positions or steps left over after the last element"));
    }
    // The ulp steps, in element order. The coder's state and the model's
    // fields are kept in locals, so that they stay in registers.
    let local = *model;
    if let Some(mut steps) = steps {
        // Sixteen changes at a time where the CPU can (one per rANS state),
        // all but the last few.
        #[cfg(target_arch = "x86_64")]
        if expansion == Expansion::Blocks && !segmented {
            let step_model = model.step_model32();
            (done, unchanged) = step_tables::decode_leading_groups(&mut steps, base.words(), w, &positions, signs, step_model, kind == ChangeKind::Xor, &mut planes);
        }
        let old = base.words();
        // Then four changes per round, one per rANS state, so that the
        // four chains overlap.
        let whole = done + (m - done) / 4 * 4;
        for (q, group) in positions[done..whole].chunks_exact(4).enumerate() {
            let first = done + 4 * q;
            let load = |p: u32| T::load(&old[p as usize * w..][..w]);
            let o = [load(group[0]), load(group[1]), load(group[2]), load(group[3])];
            let v = steps.decode4(first % step_tables::LANES, [local.context(o[0]), local.context(o[1]), local.context(o[2]), local.context(o[3])]);
            for lane in 0..4 {
                let mut out = 0;
                unchanged |= change::<T>(&local, kind, o[lane], v[lane], sign_bit(signs, first + lane), &mut out);
                set_word(&mut planes, first + lane, out);
            }
        }
        for j in whole..m {
            let o = T::load(&old[positions[j] as usize * w..][..w]);
            let v = steps.decode(j % step_tables::LANES, local.context(o));
            let mut out = 0;
            unchanged |= change::<T>(&local, kind, o, v, sign_bit(signs, j), &mut out);
            set_word(&mut planes, j, out);
        }
        if let Err(error) = steps.finish(context) {
            put_back::<T>(base, &positions, &planes, written.0);
            return Err(error);
        }
    } else {
        let old = base.words();
        let mut steps = StepModel::new(nctx);
        for (j, &p) in positions.iter().enumerate() {
            let o = T::load(&old[p as usize * w..][..w]);
            let v = steps.decode(&mut rc, local.context(o));
            let mut out = 0;
            unchanged |= change::<T>(&local, kind, o, v, sign_bit(signs, j), &mut out);
            set_word(&mut planes, j, out);
        }
    }
    if unchanged || rc.overrun() {
        put_back::<T>(base, &positions, &planes, written.0);
        return Err(bad(if unchanged { "a listed change does not change its element" } else { "range-coded stream ends early" }));
    }
    // All decoded: into a written base, the changes the kernel did not
    // write, written now.
    let moved = match base {
        Base::Read(_) => None,
        Base::Written { target, first } => {
            let (done, head_moved) = written;
            let tails: Vec<&[u8]> = planes.iter().map(|p| &p[done..]).collect();
            Some(head_moved.plus(super::apply_sparse::<T>(target, &positions[done..], &tails, ChangeKind::Xor, *first)))
        }
    };
    Ok((positions, planes, moved))
}

/// Elements a segmented expansion finds the changes of before the step
/// decoder takes them (256 KiB of 2-byte words): their words are then
/// still in L2 when the decoder gathers and writes them, where a chunk of
/// 4 MiB expanded whole has left L2 by then.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const SEGMENT_ELEMENTS: usize = 1 << 17;

/// Expand `target`'s positions a segment at a time, and after each decode
/// in place the whole groups of changes found so far (`positions`, which
/// has room for the chunk's changes plus `x86::SPARE`; `planes` the
/// chunk's value planes). Returns what the step decoder took.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn decode_segments<T: Word>(
    mut segments: super::x86::Segments<'_>,
    mut groups: step_tables::InPlaceGroups,
    steps: &mut step_tables::Decoder,
    target: &mut [u8],
    model: &ContextModel,
    signs: &[u8],
    positions: &mut Vec<u32>,
    planes: &mut [Vec<u8>],
) -> step_tables::InPlaceGroups {
    let w = T::BYTES;
    let n = target.len() / w;
    for start in (0..n).step_by(SEGMENT_ELEMENTS) {
        let end = (start + SEGMENT_ELEMENTS).min(n);
        segments.expand::<T>(&target[start * w..end * w], start, positions);
        let next_end = (end + SEGMENT_ELEMENTS).min(n);
        groups.take(steps, target, w, positions, signs, model.step_model32(), planes, end * w..next_end * w);
    }
    groups
}

/// Undo the leading `count` XOR changes written into a written base.
fn put_back<T: Word>(base: &mut Base<'_>, positions: &[u32], planes: &[Vec<u8>], count: usize) {
    if let Base::Written { target, first } = base {
        if count > 0 {
            let heads: Vec<&[u8]> = planes.iter().map(|p| &p[..count]).collect();
            super::apply_sparse::<T>(target, &positions[..count], &heads, ChangeKind::Xor, *first);
        }
    }
}

/// Word `j` of byte planes set to `v`.
#[inline(always)]
fn set_word(planes: &mut [Vec<u8>], j: usize, v: u64) {
    for (b, plane) in planes.iter_mut().enumerate() {
        plane[j] = (v >> (8 * b)) as u8;
    }
}

/// Value words from their byte planes.
fn words_of(planes: &[Vec<u8>]) -> Vec<u64> {
    let m = planes.first().map_or(0, Vec::len);
    (0..m).map(|j| planes.iter().enumerate().fold(0u64, |v, (b, plane)| v | u64::from(plane[j]) << (8 * b))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::read_word;

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
    fn survey_kernel_matches_the_scalar_loop() {
        // Every dtype of up to 4 bytes; any bit patterns (NaNs, both
        // zeros, subnormals, infinities, the largest steps), changes up
        // to the chunk's last word, whose 4-byte load the kernel must not
        // take.
        let mut next = super::super::tests::xorshift(0x2545_f491_4f6c_dd1d);
        let dtypes = [Dtype::BF16, Dtype::F16, Dtype::F32, Dtype::F8_E4M3, Dtype::F8_E5M2, Dtype::I8, Dtype::U8, Dtype::I16, Dtype::U32, Dtype::BOOL];
        for dtype in dtypes {
            let width = DType(dtype).word_bytes();
            let model = ContextModel::for_dtype(DType(dtype));
            let top = if width == 4 { u64::from(u32::MAX) } else { (1u64 << (8 * width)) - 1 };
            let sign = 1u64 << (8 * width - 1);
            let special = [0, sign, top, top ^ sign, 1, sign | 1, top - 1, sign - 1];
            for n in [0usize, 1, 2, 3, 15, 16, 17, 33, 100, 1000] {
                let pick = |r: u64| if r.is_multiple_of(4) { special[(r / 4 % 8) as usize] } else { (r >> 8) & top };
                let old: Vec<u64> = (0..n).map(|_| pick(next())).collect();
                let new: Vec<u64> = old.iter().enumerate().map(|(i, &o)| if i + 1 == n || next().is_multiple_of(3) { pick(next()) } else { o }).collect();
                let positions: Vec<u32> = (0..n as u32).filter(|&i| old[i as usize] != new[i as usize]).collect();
                let xors: Vec<u64> = positions.iter().map(|&p| old[p as usize] ^ new[p as usize]).collect();
                let bytes = |words: &[u64]| -> Vec<u8> { words.iter().flat_map(|w| w.to_le_bytes()[..width].to_vec()).collect() };
                let (old, new) = (bytes(&old), bytes(&new));
                let m = positions.len();
                let mut slow = Survey::zeroed(m);
                let fast = match width {
                    1 => {
                        survey_from::<u8>(&old, &new, &positions, &model, 0, &mut slow);
                        survey::<u8>(&old, &new, &positions, &xors, &model)
                    }
                    2 => {
                        survey_from::<u16>(&old, &new, &positions, &model, 0, &mut slow);
                        survey::<u16>(&old, &new, &positions, &xors, &model)
                    }
                    _ => {
                        survey_from::<u32>(&old, &new, &positions, &model, 0, &mut slow);
                        survey::<u32>(&old, &new, &positions, &xors, &model)
                    }
                };
                assert_eq!(fast, slow, "{dtype:?}, {n} words");
                // The steps rebuild the new words.
                for (j, &p) in positions.iter().enumerate() {
                    let o = read_word(&old[p as usize * width..][..width]);
                    let negative = (slow.signs[j / 16] >> (j % 16)) & 1 == 1;
                    let magnitude = slow.magnitudes[j] as i64 + 1;
                    let step = if negative { -magnitude } else { magnitude };
                    assert_eq!(model.apply_step(o, step), read_word(&new[p as usize * width..][..width]), "{dtype:?}");
                }
            }
        }
    }

    #[test]
    fn fast_gaps_match_the_reference() {
        // Float-like words (a few exponents, zeros, a partial last block)
        // and every sixth or so element changed; buckets as the encoder
        // chooses them, one bucket for all, and bounds that split the
        // exponents present.
        let mut next = super::super::tests::xorshift(0x9e37_79b9_7f4a_7c15);
        for (dtype, width) in [(Dtype::BF16, 2), (Dtype::F32, 4), (Dtype::F8_E4M3, 1), (Dtype::I16, 2), (Dtype::U8, 1)] {
            let model = ContextModel::for_dtype(DType(dtype));
            let nctx = model.contexts();
            for n in [0usize, 1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 383, 1000, 4099] {
                let old = float_like_words(&mut next, n, width);
                let positions: Vec<u32> = (0..n as u32).filter(|_| next().is_multiple_of(6)).collect();
                let context_of = |p: u32| model.context(read_word(&old[p as usize * width..][..width]));
                let mut per_context = vec![0u64; nctx];
                for &p in &positions {
                    per_context[context_of(p)] += 1;
                }
                let chosen = match width {
                    1 => choose_buckets::<u8>(&old, &model, &per_context),
                    2 => choose_buckets::<u16>(&old, &model, &per_context),
                    _ => choose_buckets::<u32>(&old, &model, &per_context),
                };
                let split: Vec<usize> = [1usize, 3, 7, 100, 120, 121, 127, 130, 200].into_iter().filter(|&b| b < nctx).collect();
                for buckets in [chosen, Buckets::new(Vec::new(), nctx), Buckets::new(split, nctx)] {
                    let mut per_bucket = vec![0u32; buckets.len()];
                    for &p in &positions {
                        per_bucket[buckets.of(context_of(p))] += 1;
                    }
                    let args = (&old[..], &model, &buckets, &positions[..], &per_bucket[..]);
                    let (fast, slow) = match width {
                        1 => (bucket_gaps::<u8>(args.0, args.1, args.2, args.3, args.4), bucket_gaps_reference::<u8>(args.0, args.1, args.2, args.3, args.4)),
                        2 => (bucket_gaps::<u16>(args.0, args.1, args.2, args.3, args.4), bucket_gaps_reference::<u16>(args.0, args.1, args.2, args.3, args.4)),
                        _ => (bucket_gaps::<u32>(args.0, args.1, args.2, args.3, args.4), bucket_gaps_reference::<u32>(args.0, args.1, args.2, args.3, args.4)),
                    };
                    // The reference, by its definition: each change's rank
                    // counted element by element.
                    for (b, span) in slow.span.iter().enumerate() {
                        let members: Vec<u32> = (0..n as u32).filter(|&p| buckets.of(context_of(p)) == b).collect();
                        let ranks: Vec<u32> = (0..members.len() as u32).filter(|&r| positions.contains(&members[r as usize])).collect();
                        let mut gaps = Vec::new();
                        let mut free = 0;
                        for &r in &ranks {
                            gaps.push(r - free);
                            free = r + 1;
                        }
                        assert_eq!((slow.of(b), *span), (&gaps[..], free), "bucket {b}");
                    }
                    assert_eq!(fast, slow, "{dtype:?}, {n} elements, bounds {:?}", buckets.bounds);
                    // Each kernel this CPU runs, not only the one `bucket_gaps` picks.
                    #[cfg(target_arch = "x86_64")]
                    for kernel in super::super::x86::kernels_here() {
                        let out = match width {
                            1 => super::super::x86::bucket_gaps_with::<u8>(kernel, args.0, args.1, args.2, args.3, args.4),
                            2 => super::super::x86::bucket_gaps_with::<u16>(kernel, args.0, args.1, args.2, args.3, args.4),
                            _ => super::super::x86::bucket_gaps_with::<u32>(kernel, args.0, args.1, args.2, args.3, args.4),
                        };
                        assert_eq!(out, slow, "{kernel:?}: {dtype:?}, {n} elements, bounds {:?}", buckets.bounds);
                    }
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn expansion_kernels_take_any_number_of_listed_buckets() {
        use super::super::x86;
        // Rank bitmaps built by hand for 1 to 16 listed buckets (the
        // encoder lists at most five; the kernels keep up to five cursors
        // in registers and take more in a loop), random flags over each
        // bucket's elements, every kernel this CPU runs held to the
        // reference loop.
        let kernels = x86::kernels_here();
        let mut next = super::super::tests::xorshift(0x0b5e_55ed_0000_0016);
        let model = ContextModel::for_dtype(DType(Dtype::BF16));
        let contexts = model.contexts();
        let bounds: Vec<usize> = (1..=MAX_BOUNDS).map(|i| i * contexts / (MAX_BOUNDS + 1)).collect();
        let buckets = Buckets::new(bounds, contexts);
        for n in [100usize, 4099] {
            // Random words: every exponent, so every bucket has members.
            let old: Vec<u8> = (0..2 * n).map(|_| next() as u8).collect();
            let mut members = vec![0u64; buckets.len()];
            for word in old.chunks_exact(2) {
                members[buckets.of(model.context(read_word(word)))] += 1;
            }
            for listed_count in [1usize, 2, 3, 4, 5, 6, 9, 16] {
                let listed: Vec<usize> = (0..buckets.len()).rev().take(listed_count).collect();
                let mut maps = RankBitmaps { words: Vec::new(), base: vec![0; buckets.len()], limit: vec![0; buckets.len()] };
                for &c in &listed {
                    let base = maps.words.len();
                    maps.base[c] = base;
                    maps.limit[c] = members[c];
                    maps.words.extend((0..members[c].div_ceil(64)).map(|_| next() & next() & next()));
                    if !members[c].is_multiple_of(64) {
                        *maps.words.last_mut().expect("a word") &= (1u64 << (members[c] % 64)) - 1;
                    }
                    maps.words.resize(maps.words.len() + BITMAP_PADDING_WORDS, 0);
                }
                let want = expand_reference::<u16>(&old, &model, &buckets, &maps);
                assert!(listed_count < 3 || !want.is_empty(), "{listed_count} listed buckets flag nothing");
                for &kernel in &kernels {
                    let mut got = Vec::with_capacity(want.len() + x86::SPARE);
                    x86::expand_with::<u16>(kernel, &old, &model, &buckets, &listed, &maps, &mut got);
                    assert_eq!(got, want, "{kernel:?}: {n} elements, {listed_count} listed buckets");
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
                let mut rc = RangeDecoder::new(parsed.coded).unwrap();
                let maps = rank_bitmaps(&parsed, n, &mut rc, "t").unwrap();
                let listed: Vec<usize> = parsed.listed.iter().map(|l| l.bucket).collect();
                let buckets = &parsed.buckets;
                let run = |kernel| {
                    let mut positions = Vec::with_capacity(m + x86::SPARE);
                    match width {
                        1 => x86::expand_with::<u8>(kernel, &old, &model, buckets, &listed, &maps, &mut positions),
                        2 => x86::expand_with::<u16>(kernel, &old, &model, buckets, &listed, &maps, &mut positions),
                        _ => x86::expand_with::<u32>(kernel, &old, &model, buckets, &listed, &maps, &mut positions),
                    }
                    positions
                };
                for &kernel in &kernels {
                    assert_eq!(run(kernel), found.positions, "{kernel:?}: {dtype:?}, {n} elements, 1 in {every} changed");
                }
                // A segment at a time, segments of one to three blocks.
                let segmented = |width: usize| -> Option<Vec<u32>> {
                    let mut positions = Vec::with_capacity(m + x86::SPARE);
                    macro_rules! walk {
                        ($t:ty) => {{
                            let mut segments = x86::Segments::new::<$t>(&model, buckets, &listed, &maps, n, m)?;
                            let mut start = 0;
                            while start < n {
                                let end = (start + 256 * (1 + start % 3)).min(n);
                                segments.expand::<$t>(&old[start * width..end * width], start, &mut positions);
                                start = end;
                            }
                        }};
                    }
                    match width {
                        1 => walk!(u8),
                        2 => walk!(u16),
                        _ => walk!(u32),
                    }
                    Some(positions)
                };
                if let Some(positions) = segmented(width) {
                    assert_eq!(positions, found.positions, "segments: {dtype:?}, {n} elements, 1 in {every} changed");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "context::encode takes XOR changes")]
    fn changes_of_the_other_kind_are_refused() {
        // New words as values (`ChangeKind::Overwrite`) would be read as
        // XOR words and code the wrong steps.
        let mut next = super::super::tests::xorshift(17);
        let old = float_like_words(&mut next, 1000, 2);
        let mut new = old.clone();
        for i in (3..1000).step_by(7) {
            new[2 * i] ^= 1;
        }
        let model = ContextModel::for_dtype(DType(Dtype::BF16));
        let found = super::super::find_changes(&old, &new, 2, ChangeKind::Overwrite).unwrap();
        encode(&old, &new, &found, &model, 1);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn step_group_kernels_agree() {
        // Each group kernel this CPU runs decodes the table-coded steps of
        // a chunk into the true values, both change kinds; the scalar
        // decoder (`Decoder::decode`) is the one the others are held to.
        let mut next = super::super::tests::xorshift(0x9e37_79b9_7f4a_7c15);
        let dtypes = [(Dtype::BF16, 2), (Dtype::F16, 2), (Dtype::F32, 4), (Dtype::F8_E4M3, 1), (Dtype::I16, 2), (Dtype::U8, 1)];
        for (dtype, width) in dtypes {
            let model = ContextModel::for_dtype(DType(dtype));
            for (n, every, far) in [(300usize, 2u64, false), (4099, 3, true), (20_000, 5, false), (20_000, 7, true)] {
                let old = float_like_words(&mut next, n, width);
                let mut new = old.clone();
                for i in 0..n {
                    if next().is_multiple_of(every) {
                        // A few ulps, or (`far`) anywhere: raw bits of
                        // every length.
                        let o = read_word(&old[i * width..][..width]);
                        let step = if far && next().is_multiple_of(3) { next() >> (64 - 8 * width) } else { next() % 9 };
                        let word = model.word_of_ordinal((model.ordinal(o).wrapping_add(step.max(1))) & model.word_mask());
                        new[i * width..][..width].copy_from_slice(&word.to_le_bytes()[..width]);
                    }
                }
                let found = super::super::find_changes(&old, &new, width, ChangeKind::Xor).unwrap();
                let m = found.positions.len();
                let payload = encode_with(&old, &new, &found, &model, 1, StepCoding::Tables);
                let parsed = parse(&payload, n, m, model.contexts(), "t").unwrap();
                let sections = parsed.tables.as_ref().expect("table-coded steps");
                let scalar = {
                    let mut d = step_tables::Decoder::new(sections, model.contexts(), width, "t").unwrap();
                    found.positions.iter().enumerate().map(|(j, &p)| d.decode(j % step_tables::LANES, model.context(read_word(&old[p as usize * width..][..width])))).collect::<Vec<u64>>()
                };
                let truth: Vec<u64> = found.positions.iter().map(|&p| read_word(&new[p as usize * width..][..width])).collect();
                for (j, &p) in found.positions.iter().enumerate() {
                    let o = read_word(&old[p as usize * width..][..width]);
                    let step = signed_step(scalar[j], sign_bit(parsed.signs, j));
                    assert_eq!(model.apply_step(o, step), truth[j], "the scalar decoder, {dtype:?}");
                }
                let d = step_tables::Decoder::new(sections, model.contexts(), width, "t").unwrap();
                // The kernel given all the changes, then an odd number of
                // groups; the scalar decoder takes the rest from the states
                // it left, and the streams must end exactly.
                let odd_groups = 16 * (2 * (m / 64) + 1);
                for kernel in step_tables::group_kernels_here(&d) {
                    for (xor, limit) in [(false, m), (true, m), (true, odd_groups.min(m))] {
                        let mut d = step_tables::Decoder::new(sections, model.contexts(), width, "t").unwrap();
                        let mut planes = vec![vec![0u8; limit]; width];
                        let (done, unchanged) = step_tables::decode_leading_groups_with(kernel, &mut d, &old, width, &found.positions[..limit], parsed.signs, model.step_model32(), xor, &mut planes);
                        let mut values = words_of(&planes);
                        values.resize(m, 0);
                        assert!(!unchanged && done % 16 == 0 && done + 32 >= limit, "{kernel:?}: {done} of {limit} changes");
                        for j in done..m {
                            let o = read_word(&old[found.positions[j] as usize * width..][..width]);
                            let v = d.decode(j % step_tables::LANES, model.context(o));
                            let new = model.apply_step(o, signed_step(v, sign_bit(parsed.signs, j)));
                            values[j] = if xor { o ^ new } else { new };
                        }
                        d.finish("t").unwrap_or_else(|e| panic!("{kernel:?}, {dtype:?}, {done} of {m} by the kernel: {e}"));
                        for j in 0..m {
                            let o = read_word(&old[found.positions[j] as usize * width..][..width]);
                            let want = if xor { o ^ truth[j] } else { truth[j] };
                            assert_eq!(values[j], want, "{kernel:?}, {dtype:?}, change {j} of {m} ({done} by the kernel), xor {xor}");
                        }
                    }
                }
            }
        }
    }

    /// A bf16 chunk in three kinds of elements: the smallest values change
    /// in runs (coded as runs), the middle ones nearly all, independently
    /// (range-coded flags: a run code spends about a bit on each short
    /// unchanged run), the larger ones rarely (Rice codes of the gaps).
    /// Returns the old and new bytes.
    fn three_position_modes_chunk(n: usize) -> (Vec<u8>, Vec<u8>) {
        let mut next = super::super::tests::xorshift(0x2545_f491_4f6c_dd1d);
        let mut old = Vec::with_capacity(2 * n);
        let mut new = Vec::with_capacity(2 * n);
        for i in 0..n {
            let r = next();
            let exponent: u16 = [100, 110, 120][i % 3];
            let word = (exponent << 7) | (r as u16 & 0x7f);
            let changes = match exponent {
                // Runs of 40 of every 50.
                100 => (i / 3) % 50 < 40,
                // 31 in 32.
                110 => r >> 40 & 31 != 0,
                // 1 in 64.
                _ => r >> 40 & 63 == 0,
            };
            let moved = if changes { word.wrapping_add(1 + (r >> 20 & 1) as u16) } else { word };
            old.extend_from_slice(&word.to_le_bytes());
            new.extend_from_slice(&moved.to_le_bytes());
        }
        (old, new)
    }

    /// A chunk of `three_position_modes_chunk` coded: the model, the element
    /// count, the old and new bytes, the change count and the payload.
    fn three_position_modes_payload() -> (ContextModel, usize, Vec<u8>, Vec<u8>, usize, Vec<u8>) {
        let model = ContextModel::for_dtype(DType(Dtype::BF16));
        let n = 30_000usize;
        let (old, new) = three_position_modes_chunk(n);
        let found = super::super::find_changes(&old, &new, 2, ChangeKind::Xor).unwrap();
        let payload = encode(&old, &new, &found, &model, 1);
        (model, n, old, new, found.positions.len(), payload)
    }

    /// `three_position_modes_chunk`: each kind of element gets a bucket of
    /// its own and its own position mode, and both decoders give back the
    /// changes exactly.
    #[test]
    fn buckets_code_runs_flags_or_rice_as_their_changes_fall() {
        let (model, n, old, new, m, payload) = three_position_modes_payload();
        let parsed = parse(&payload, n, m, model.contexts(), "t").unwrap();
        // The three exponents change at very different rates: each gets its own bucket.
        let (runs, flags, rice) = (parsed.buckets.of(100), parsed.buckets.of(110), parsed.buckets.of(120));
        assert!(runs != flags && flags != rice && runs != rice, "bounds {:?}", parsed.buckets.bounds);
        let modes: Vec<(usize, u8)> = parsed.listed.iter().map(|l| (l.bucket, l.mode)).collect();
        for expected in [(runs, MODE_RUNS), (flags, MODE_CODED_FLAGS), (rice, MODE_RICE)] {
            assert!(modes.contains(&expected), "{expected:?} in {modes:?}");
        }
        for kind in [ChangeKind::Xor, ChangeKind::Overwrite] {
            let expected = super::super::find_changes(&old, &new, 2, kind).unwrap();
            assert_eq!(decode(&payload, &old, &model, m as u32, kind, "t").unwrap(), expected);
            assert_eq!(decode_reference(&payload, &old, &model, m as u32, kind, "t").unwrap(), expected);
        }
    }

    /// Where in a payload each listed bucket's entry lies: its code byte
    /// and, for runs, the varint of its run count.
    fn entry_offsets(payload: &[u8]) -> Vec<(usize, Option<usize>)> {
        let mut pos = 1;
        for _ in 0..payload[0] & 0x0f {
            get_varint(payload, &mut pos, 10).unwrap();
        }
        let listed = get_varint(payload, &mut pos, 10).unwrap();
        (0..listed)
            .map(|_| {
                get_varint(payload, &mut pos, 10).unwrap();
                get_varint(payload, &mut pos, 10).unwrap();
                let code = pos;
                pos += 1;
                let mut runs = None;
                if payload[code] & 3 == MODE_RUNS {
                    pos += 1; // k_changed
                    runs = Some(pos);
                    get_varint(payload, &mut pos, 10).unwrap();
                }
                (code, runs)
            })
            .collect()
    }

    /// Each of the first 256 bytes of a payload with all three position
    /// modes (its bucket table and the start of its position stream)
    /// flipped (the low bit, all bits), and the payload cut short at each
    /// of those lengths: each decoder returns an error or changes, never
    /// panics, and a decode that succeeds lists the chunk's change count.
    #[test]
    fn damaged_three_mode_payloads_never_panic() {
        let (model, _, old, _, m, payload) = three_position_modes_payload();
        let check = |bytes: &[u8]| {
            let results = [decode(bytes, &old, &model, m as u32, ChangeKind::Xor, "t"), decode_reference(bytes, &old, &model, m as u32, ChangeKind::Xor, "t")];
            for changes in results.into_iter().flatten() {
                assert_eq!(changes.positions.len(), m);
            }
        };
        let head = payload.len().min(256);
        for at in 0..head {
            for flip in [0x01u8, 0xff] {
                let mut bytes = payload.clone();
                bytes[at] ^= flip;
                check(&bytes);
            }
            check(&payload[..at]);
        }
    }

    /// A runs entry whose run count is zero, exceeds its changes or does
    /// not match its lists, and an unknown position mode, are refused
    /// with a message, by both decoders.
    #[test]
    fn bad_run_entries_are_refused() {
        let (model, n, old, _, m, payload) = three_position_modes_payload();
        let entries = entry_offsets(&payload);
        let parsed = parse(&payload, n, m, model.contexts(), "t").unwrap();
        let (i, runs_at) = entries.iter().enumerate().find_map(|(i, e)| e.1.map(|at| (i, at))).expect("a runs entry");
        let (runs, changes) = (parsed.listed[i].runs, parsed.listed[i].changes);
        assert!(changes > runs + 1, "{runs} runs of {changes} changes");
        // The payload with another run count (a varint of its own length).
        let with_runs = |count: u64| {
            let mut end = runs_at;
            get_varint(&payload, &mut end, 10).unwrap();
            let mut bytes = payload[..runs_at].to_vec();
            put_varint(&mut bytes, count);
            bytes.extend_from_slice(&payload[end..]);
            bytes
        };
        let refused = |bytes: &[u8], what: &str| {
            for result in [decode(bytes, &old, &model, m as u32, ChangeKind::Xor, "t"), decode_reference(bytes, &old, &model, m as u32, ChangeKind::Xor, "t")] {
                let err = result.expect_err(what).to_string();
                assert!(err.contains("bucket entry") || err.contains("runs") || err.contains("position"), "{what}: {err}");
            }
        };
        // Out of range, refused by the parser; in range but not the
        // lists' count, refused as they are read or as the changes fail
        // to add up.
        for count in [0, 1, runs - 1, runs + 1, changes, changes + 1] {
            refused(&with_runs(count), &format!("{count} runs (written: {runs}) of {changes} changes"));
        }
        let mut bytes = payload.clone();
        bytes[entries[i].0] |= 3;
        refused(&bytes, "position mode 3");
    }

    /// Table-coded steps decoded by the vector kernels (sixteen or eight
    /// changes at a time) equal the scalar steps of the reference decoder,
    /// for every word width the kernels take, floats and integers, steps of
    /// one ulp to steps that carry many raw bits, across zero and the
    /// words' ends, and chunks whose last words the kernels leave to the
    /// scalar loop.
    #[test]
    fn vector_step_decoding_matches_the_scalar_steps() {
        let mut next = super::super::tests::xorshift(0x9e37_79b9_7f4a_7c15);
        for dtype in [Dtype::F8_E4M3, Dtype::U8, Dtype::BF16, Dtype::F16, Dtype::I16, Dtype::F32, Dtype::I32] {
            let dtype = DType(dtype);
            let (model, w) = (ContextModel::for_dtype(dtype), dtype.word_bytes());
            let word_mask = if w == 8 { u64::MAX } else { (1u64 << (8 * w)) - 1 };
            for n in [9_000usize, 30_011] {
                let (mut old, mut new) = (Vec::with_capacity(n * w), Vec::with_capacity(n * w));
                for i in 0..n {
                    let r = next();
                    // Exponents from a few busy contexts and a long tail.
                    let o = if r.is_multiple_of(4) { r >> 8 } else { (r >> 8) & !(model.mask << model.shift) | ((100 + r % 5) << model.shift) } & word_mask;
                    let x = next();
                    let v = if !x.is_multiple_of(3) && i + 1 != n {
                        o
                    } else {
                        // Steps of 1 to 2^24 ulps, up or down.
                        let size = 1 + (x >> 8) % (1 << ((x >> 40) % 25));
                        let ord = model.ordinal(o);
                        let moved = if x & (1 << 50) != 0 { ord.wrapping_add(size) } else { ord.wrapping_sub(size) } & word_mask;
                        model.ordinal(moved)
                    };
                    let v = if v == o { o ^ 1 } else { v };
                    old.extend_from_slice(&o.to_le_bytes()[..w]);
                    new.extend_from_slice(&v.to_le_bytes()[..w]);
                }
                let found = super::super::find_changes(&old, &new, w, ChangeKind::Xor).unwrap();
                let m = found.positions.len();
                #[cfg(target_arch = "x86_64")]
                if super::super::avx2_available() {
                    let head = step_tables::avx2::kernel_prefix(&found.positions, w, old.len());
                    assert!(head > 0 && head < m, "{dtype:?}: the kernel takes {head} of {m} changes");
                }
                let payload = encode_with(&old, &new, &found, &model, 1, StepCoding::Tables);
                for kind in [ChangeKind::Xor, ChangeKind::Overwrite] {
                    let expected = super::super::find_changes(&old, &new, w, kind).unwrap();
                    assert_eq!(decode(&payload, &old, &model, m as u32, kind, "t").unwrap(), expected, "{dtype:?}, {n}, {kind:?}");
                    assert_eq!(decode_reference(&payload, &old, &model, m as u32, kind, "t").unwrap(), expected, "{dtype:?}, {n}, {kind:?}");
                }
            }
        }
    }

    /// The encoder codes the steps of a chunk with many changes with
    /// tables, of one with few adaptively; the payload's first byte says
    /// which, and a coding this build does not know is refused by number,
    /// as are more bucket bounds than the words have contexts.
    #[test]
    fn step_coding_follows_the_change_count_and_unknown_codings_are_refused() {
        let model = ContextModel::for_dtype(DType(Dtype::BF16));
        let mut next = super::super::tests::xorshift(77);
        // Many changes; few; fewer than 4096 but one element in ten
        // (tables); as many, one in thirty (adaptive).
        for (n, every, coding) in [(40_000usize, 4u64, StepCoding::Tables), (40_000, 100, StepCoding::Adaptive), (16_384, 10, StepCoding::Tables), (40_000, 30, StepCoding::Adaptive)] {
            let old: Vec<u8> = (0..n).flat_map(|_| ((118u16 << 7) | (next() as u16 & 0x7f)).to_le_bytes()).collect();
            let mut new = old.clone();
            for i in 0..n {
                if next().is_multiple_of(every) {
                    let w = u16::from_le_bytes([old[2 * i], old[2 * i + 1]]).wrapping_add(1 + (next() % 5) as u16);
                    new[2 * i..2 * i + 2].copy_from_slice(&w.to_le_bytes());
                }
            }
            let found = super::super::find_changes(&old, &new, 2, ChangeKind::Xor).unwrap();
            let m = found.positions.len();
            assert_eq!(StepCoding::for_changes(m, n), coding, "{m} changes of {n}");
            let payload = encode(&old, &new, &found, &model, 1);
            assert_eq!(payload[0] >> 4, coding as u8);
            assert_eq!(decode(&payload, &old, &model, m as u32, ChangeKind::Xor, "t").unwrap(), found);
            let mut bad = payload.clone();
            bad[0] = bad[0] & 0x0f | 2 << 4;
            let err = decode(&bad, &old, &model, m as u32, ChangeKind::Xor, "t").unwrap_err().to_string();
            assert!(err.contains("unknown step coding 2"), "{err}");
        }
        // Integers have one context: a bucket bound is refused by count.
        let model = ContextModel::for_dtype(DType(Dtype::I16));
        let old: Vec<u8> = (0..4000u16).flat_map(|i| i.wrapping_mul(40_503).to_le_bytes()).collect();
        let new: Vec<u8> = old.chunks(2).enumerate().flat_map(|(i, w)| u16::from_le_bytes([w[0], w[1]]).wrapping_add(u16::from(i % 9 == 0)).to_le_bytes()).collect();
        let found = super::super::find_changes(&old, &new, 2, ChangeKind::Xor).unwrap();
        let m = found.positions.len() as u32;
        let mut payload = encode(&old, &new, &found, &model, 1);
        assert_eq!(decode(&payload, &old, &model, m, ChangeKind::Xor, "t").unwrap(), found);
        payload[0] = payload[0] & 0xf0 | 1;
        for decoder in [decode, decode_reference] {
            let err = decoder(&payload, &old, &model, m, ChangeKind::Xor, "t").unwrap_err().to_string();
            assert!(err.contains("1 bucket bounds (at most 0 for 1 contexts)"), "{err}");
        }
    }

    /// A step of magnitude 2^(8 W) wraps around to the element's own word:
    /// no encoder writes one, but a payload can code it with every stream
    /// ending where it must. Each step decoder refuses it wherever the
    /// change falls: in the vector kernels' leading groups, in the scalar
    /// tail after them, and in the adaptively coded steps; both decoders,
    /// every word width, both change kinds.
    #[test]
    fn a_step_that_wraps_to_the_same_word_is_refused() {
        let mut next = super::super::tests::xorshift(0x51_7cc1_b727_220a);
        for (dtype, width) in [(Dtype::F8_E4M3, 1usize), (Dtype::BF16, 2), (Dtype::F32, 4), (Dtype::I64, 8)] {
            let model = ContextModel::for_dtype(DType(dtype));
            let wrap = u64::MAX >> (64 - 8 * width);
            for (n, every, coding) in [(30_000usize, 3u64, StepCoding::Tables), (4000, 40, StepCoding::Adaptive)] {
                let old = float_like_words(&mut next, n, width);
                let mut new = old.clone();
                for i in 0..n {
                    if next().is_multiple_of(every) {
                        let o = read_word(&old[i * width..][..width]);
                        let word = model.word_of_ordinal(model.ordinal(o).wrapping_add(1 + next() % 5) & model.word_mask());
                        new[i * width..][..width].copy_from_slice(&word.to_le_bytes()[..width]);
                    }
                }
                let found = super::super::find_changes(&old, &new, width, ChangeKind::Xor).unwrap();
                let m = found.positions.len();
                assert_eq!(StepCoding::for_changes(m, n), coding, "{m} changes of {n}");
                for kind in [ChangeKind::Xor, ChangeKind::Overwrite] {
                    // The payload as encoded decodes, so the forged ones
                    // below differ from it only in the one step.
                    let payload = encode_with(&old, &new, &found, &model, 1, coding);
                    let want = super::super::find_changes(&old, &new, width, kind).unwrap();
                    assert_eq!(decode(&payload, &old, &model, m as u32, kind, "t").unwrap(), want);
                    // First (a vector kernel's group), in the middle, last
                    // (the scalar tail).
                    for j in [0, m / 2 + 5, m - 1] {
                        let forged = encode_edited(&old, &new, &found, &model, 1, coding, &|s: &mut Survey| s.magnitudes[j] = wrap);
                        assert_ne!(forged, payload);
                        for (name, decoder) in [("decode", decode as fn(&[u8], &[u8], &ContextModel, u32, ChangeKind, &str) -> Result<SparseChanges>), ("decode_reference", decode_reference)] {
                            let Err(err) = decoder(&forged, &old, &model, m as u32, kind, "t") else {
                                panic!("{name} took a step that wraps, {dtype:?}, {coding:?}, change {j} of {m}");
                            };
                            assert!(err.to_string().contains("does not change its element"), "{name}, {dtype:?}, {coding:?}, change {j}: {err}");
                        }
                        // Every group kernel this CPU runs, not only the
                        // one `decode` picks, flags the first change.
                        #[cfg(target_arch = "x86_64")]
                        if coding == StepCoding::Tables && width <= 4 && j == 0 {
                            let parsed = parse(&forged, n, m, model.contexts(), "t").unwrap();
                            let sections = parsed.tables.as_ref().expect("table-coded steps");
                            let d = step_tables::Decoder::new(sections, model.contexts(), width, "t").unwrap();
                            for kernel in step_tables::group_kernels_here(&d) {
                                let mut d = step_tables::Decoder::new(sections, model.contexts(), width, "t").unwrap();
                                let mut planes = vec![vec![0u8; m]; width];
                                let xor = kind == ChangeKind::Xor;
                                let (done, unchanged) = step_tables::decode_leading_groups_with(kernel, &mut d, &old, width, &found.positions, parsed.signs, model.step_model32(), xor, &mut planes);
                                assert!(done > 0 && unchanged, "{kernel:?}, {dtype:?}: {done} changes decoded, the wrapped step not flagged");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Random changes of one word in `every` of `n` words of `old`: steps
    /// of 1 to 2^12 ulps, up or down (the old words float-like).
    fn stepped(next: &mut impl FnMut() -> u64, model: &ContextModel, old: &[u8], width: usize, every: u64) -> Vec<u8> {
        let mut new = old.to_vec();
        for i in 0..old.len() / width {
            if next().is_multiple_of(every) {
                let o = read_word(&old[i * width..][..width]);
                let size = 1 + next() % (1 << (next() % 13));
                let ord = if next() & 1 == 0 { model.ordinal(o).wrapping_add(size) } else { model.ordinal(o).wrapping_sub(size) };
                let word = model.word_of_ordinal(ord & model.word_mask());
                let word = if word == o { o ^ 1 } else { word };
                new[i * width..][..width].copy_from_slice(&word.to_le_bytes()[..width]);
            }
        }
        new
    }

    /// Decoding a chunk into its own base (`decode_split_in_place`) leaves
    /// there what decoding it and then applying it leaves, with the same
    /// positions, planes and digest move: every word width, both step
    /// codings, chunks that start at and away from their tensor's first
    /// element. Where the CPU has the in-place kernel, it is checked to
    /// take most of the changes.
    #[test]
    fn decoding_in_place_writes_what_decoding_then_applying_writes() {
        let mut next = super::super::tests::xorshift(0x2545_f491_4f6c_dd1d);
        for (dtype, width) in [(Dtype::F8_E5M2, 1usize), (Dtype::BF16, 2), (Dtype::F16, 2), (Dtype::F32, 4), (Dtype::I32, 4), (Dtype::F64, 8)] {
            let model = ContextModel::for_dtype(DType(dtype));
            // One segment of the in-place decoder, several (the last
            // partial), and adaptive steps.
            let several = 2 * SEGMENT_ELEMENTS + 3 * 256 + 7;
            for (n, every, coding) in [(30_011usize, 5u64, StepCoding::Tables), (several, 9, StepCoding::Tables), (4000, 40, StepCoding::Adaptive)] {
                let old = float_like_words(&mut next, n, width);
                let new = stepped(&mut next, &model, &old, width, every);
                let found = super::super::find_changes(&old, &new, width, ChangeKind::Xor).unwrap();
                let m = found.positions.len();
                let payload = encode_with(&old, &new, &found, &model, 1, coding);
                let (positions, planes) = decode_split(&payload, &old, &model, m as u32, ChangeKind::Xor, "t").unwrap();
                for first in [0u64, 1 << 20] {
                    let mut applied = old.clone();
                    let want_moved = match width {
                        1 => super::super::apply_sparse::<u8>(&mut applied, &positions, &planes, ChangeKind::Xor, first),
                        2 => super::super::apply_sparse::<u16>(&mut applied, &positions, &planes, ChangeKind::Xor, first),
                        4 => super::super::apply_sparse::<u32>(&mut applied, &positions, &planes, ChangeKind::Xor, first),
                        _ => super::super::apply_sparse::<u64>(&mut applied, &positions, &planes, ChangeKind::Xor, first),
                    };
                    assert_eq!(applied, new, "{dtype:?}, {coding:?}");
                    let mut target = old.clone();
                    let (p, q, moved) = decode_split_in_place(&payload, &mut target, first, &model, m as u32, "t").unwrap();
                    assert!(target == new && p == positions && q == planes, "{dtype:?}, {coding:?}, first {first}: not what decode_split found");
                    assert_eq!(moved, want_moved, "{dtype:?}, {coding:?}, first {first}: digest move");
                }
                #[cfg(target_arch = "x86_64")]
                if coding == StepCoding::Tables && width <= 4 {
                    let parsed = parse(&payload, n, m, model.contexts(), "t").unwrap();
                    let mut d = step_tables::Decoder::new(parsed.tables.as_ref().unwrap(), model.contexts(), width, "t").unwrap();
                    let mut planes = vec![vec![0u8; m]; width];
                    let mut target = old.clone();
                    if let Some(mut groups) = step_tables::InPlaceGroups::new(&d, 0, n) {
                        // Found in two parts, as the segmented expansion hands them over.
                        for part in [&found.positions[..m / 3], &found.positions[..]] {
                            groups.take(&mut d, &mut target, width, part, parsed.signs, model.step_model32(), &mut planes, 0..0);
                        }
                        let done = groups.taken;
                        assert!(done > m / 2 && !groups.unchanged, "{dtype:?}: the in-place kernel took {done} of {m} changes");
                        assert_eq!(target[..found.positions[done - 1] as usize * width + width], new[..found.positions[done - 1] as usize * width + width], "{dtype:?}");
                    }
                }
            }
        }
    }

    /// A payload found bad only after the in-place decoder has written some
    /// of its changes (a forged step that wraps to its own word, in the
    /// vector kernel's first group or in the scalar tail; bytes of the
    /// steps' streams altered, which the states' end checks catch; a base
    /// whose exponents differ, so that the segments find other positions)
    /// leaves the target as it was, and whatever decodes in place decodes
    /// the same way with the target read only. Chunks of one segment and
    /// of several.
    #[test]
    fn a_payload_found_bad_after_changes_were_written_leaves_the_target_as_it_was() {
        let mut next = super::super::tests::xorshift(0x1d8e_4e27_c47d_124f);
        for (dtype, width, n) in [(Dtype::F8_E4M3, 1usize, 30_000), (Dtype::BF16, 2, 30_000), (Dtype::F32, 4, 30_000), (Dtype::BF16, 2, 3 * SEGMENT_ELEMENTS)] {
            let model = ContextModel::for_dtype(DType(dtype));
            let old = float_like_words(&mut next, n, width);
            let new = stepped(&mut next, &model, &old, width, 4);
            let found = super::super::find_changes(&old, &new, width, ChangeKind::Xor).unwrap();
            let m = found.positions.len();
            let payload = encode_with(&old, &new, &found, &model, 1, StepCoding::Tables);
            let wrap = u64::MAX >> (64 - 8 * width);
            let mut bad: Vec<Vec<u8>> = [0, m - 1]
                .iter()
                .map(|&j| encode_edited(&old, &new, &found, &model, 1, StepCoding::Tables, &|s: &mut Survey| s.magnitudes[j] = wrap))
                .collect();
            // A bit of the rANS section altered (the sixteen states, then
            // the words), anywhere in it.
            let rans = parse(&payload, n, m, model.contexts(), "t").unwrap().tables.expect("table-coded steps").rans();
            let start = rans.as_ptr() as usize - payload.as_ptr() as usize;
            for k in 0..40 {
                let mut altered = payload.clone();
                altered[start + k * (rans.len() - 1) / 39] ^= 1 << (k % 8);
                bad.push(altered);
            }
            // The payload as encoded against bases whose exponents differ
            // here and there (after the first segment, where the chunk has
            // several).
            let mut bases = Vec::new();
            for k in 1..6usize {
                let mut other = old.clone();
                for i in (k * n / 7..n).step_by(97 * k) {
                    other[i * width + width - 1] ^= 0x10;
                }
                bases.push(other);
            }
            let mut refused = 0;
            let cases = bad.iter().map(|forged| (forged, &old)).chain(bases.iter().map(|base| (&payload, base)));
            for (forged, base) in cases {
                let mut target = base.clone();
                match decode_split_in_place(forged, &mut target, 0, &model, m as u32, "t") {
                    Err(_) => {
                        refused += 1;
                        assert!(&target == base, "{dtype:?}: a refused payload left words written");
                        assert!(decode_split(forged, base, &model, m as u32, ChangeKind::Xor, "t").is_err());
                    }
                    Ok((positions, planes, _)) => {
                        assert_eq!(decode_split(forged, base, &model, m as u32, ChangeKind::Xor, "t").unwrap(), (positions, planes));
                    }
                }
            }
            assert!(refused >= 2 + 20 + 3, "{dtype:?}: only {refused} of {} damaged payloads and bases refused", bad.len() + bases.len());
        }
    }
}
