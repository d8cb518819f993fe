//! Block-wise kernels of the context mode for x86-64 with AVX2 and BMI2:
//! each bucket's rank gaps (encoder) and the changed positions (decoder).
//!
//! The chunk is walked in blocks of 64 elements. For each block the bucket
//! of every element is computed into 64 bytes (two vectors: the context
//! field, then one compare per bucket bound); for each bucket with changes
//! (every such bucket in every block, present or not: a loop whose exit is
//! always predicted, 5-20 % faster than walking the range of buckets
//! present in the encoder's kernels and the AVX-512 expansion, and 4-15 %
//! in the AVX2 expansion on a Zen 3), one compare
//! gives the mask `m` of its elements, `k = popcount(m)` of them. The
//! encoder adds `k` to the bucket's count; then, in element order, a
//! change's rank is its bucket's count before the block plus the elements
//! of `m` below it, and its gap goes to its bucket's list (one loop over
//! the block's changes rather than one per bucket present, whose trip
//! counts mispredict: 2.3 times faster on the training pairs). The decoder
//! takes the next `k` bits of the bucket's rank bitmap, its changed flags,
//! and `pdep` deposits them onto `m`; the union over buckets marks the
//! block's changed elements. No per-element branches and no per-element
//! state in memory: the decoder's cost is set by the buckets per block,
//! hardly by the number of changes.
//!
//! Where the CPU also has AVX-512 (F and BW) both sides walk blocks of 256
//! elements instead: one compare per 64 elements lands straight in a mask
//! register, and the per-block work (loop exits, which mispredict) is paid
//! a quarter as often. That made the whole context decode 10-15 % faster
//! on the real pairs (Zen 4).
//!
//! Where the CPU also has AVX-512 VBMI, the bucket ids of 64 elements come
//! from a 256-byte table (`Walk::of_byte`) through two byte permutes and a
//! blend, whatever the number of bucket bounds, and the context bytes of 64
//! two- or four-byte words are gathered by one or two permutes (Intel Xeon,
//! the training pairs: the expansion 5-13 % and the encoder's kernel about
//! 10 % faster than with a compare per bound).
//!
//! Each kernel has a portable twin (`context::bucket_gaps_reference`,
//! `context::decode_reference`) that the tests hold it to.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::sync::OnceLock;

use super::context::{BucketGaps, Buckets, ContextModel, RankBitmaps, BITMAP_PADDING_WORDS};
use super::gather_x86::StepModel32;
use super::Word;

/// Whether this CPU runs the block-wise decoder well: AVX2, BMI2 and
/// POPCNT present, and `pdep` not microcoded (AMD before Zen 3 takes
/// hundreds of cycles for one).
pub(super) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("bmi2")
            && is_x86_feature_detected!("popcnt")
            && !slow_pdep()
    })
}

fn slow_pdep() -> bool {
    use std::arch::x86_64::__cpuid;
    // Safety: the cpuid instruction exists on every x86-64 CPU; leaves 0
    // and 1 always do.
    #[allow(unsafe_code, unused_unsafe)]
    let (vendor, signature) = unsafe { (__cpuid(0), __cpuid(1)) };
    let vendor = (vendor.ebx, vendor.edx, vendor.ecx);
    let amd = vendor == (0x6874_7541, 0x6974_6e65, 0x444d_4163); // "AuthenticAMD"
    let hygon = vendor == (0x6f67_7948, 0x6e65_476e, 0x656e_6975); // "HygonGenuine" (Zen 1)
    let base = (signature.eax >> 8) & 0xf;
    let family = if base == 0xf { base + ((signature.eax >> 20) & 0xff) } else { base };
    hygon || (amd && family < 0x19)
}

/// Spare slots at the end of the positions buffer (see `expand_avx2`).
pub(super) const SPARE: usize = 64;

/// Whether this CPU also has AVX-512 F and BW, for the expansion by blocks
/// of 256 elements (`expand_avx512`).
pub(super) fn wide_available() -> bool {
    static WIDE: OnceLock<bool> = OnceLock::new();
    *WIDE.get_or_init(|| available() && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw"))
}

/// Whether this CPU also has AVX-512 VBMI, whose byte permutes find the
/// context bytes and bucket ids of 64 elements in a few instructions
/// whatever the number of bucket bounds (`Kernel::Avx512Vbmi`).
pub(super) fn vbmi_available() -> bool {
    static VBMI: OnceLock<bool> = OnceLock::new();
    *VBMI.get_or_init(|| wide_available() && is_x86_feature_detected!("avx512vbmi"))
}

/// The widest kernel this CPU runs.
fn widest() -> Kernel {
    if vbmi_available() {
        Kernel::Avx512Vbmi
    } else if wide_available() {
        Kernel::Avx512
    } else {
        Kernel::Avx2
    }
}

/// The AVX-512 expansion walks blocks of `64 * LANES` elements. On the
/// bf16 and fp32-master pairs (Zen 4), 4 beat 2 by 2-3 % and 8 by 2-5 %.
const LANES: usize = 4;

/// The expansion kernels (`expand` picks the widest the CPU runs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kernel {
    /// Blocks of 64 elements, AVX2 compares.
    Avx2,
    /// Blocks of 256 elements, AVX-512 compares into mask registers: a
    /// quarter of the per-block work (bucket range, loop exit) per
    /// element.
    Avx512,
    /// `Avx512` with the bucket ids by a 256-byte table lookup (two
    /// two-register byte permutes and a blend, AVX-512 VBMI) instead of
    /// two instructions per bucket bound, and the context bytes gathered
    /// by one permute per 64 elements instead of narrowing moves.
    Avx512Vbmi,
}

/// The kernels this CPU runs, narrowest first (none without AVX2 and a
/// fast BMI2: such a CPU takes the portable paths).
#[cfg(test)]
pub(super) fn kernels_here() -> Vec<Kernel> {
    [(Kernel::Avx2, available()), (Kernel::Avx512, wide_available()), (Kernel::Avx512Vbmi, vbmi_available())].into_iter().filter(|k| k.1).map(|k| k.0).collect()
}

/// Expand the rank bitmaps of the `listed` buckets over the chunk `old`:
/// the changed positions, ascending, into `positions`, which must be empty
/// with room for the listed total of changes plus `SPARE` (slots past the
/// changes are written but not kept: left unzeroed, the context apply of
/// the training pairs took 0.98-0.996 of the time, paired).
pub(super) fn expand<T: Word>(
    old: &[u8],
    model: &ContextModel,
    buckets: &Buckets,
    listed: &[usize],
    maps: &RankBitmaps,
    positions: &mut Vec<u32>,
) {
    expand_with::<T>(widest(), old, model, buckets, listed, maps, positions);
}

/// `expand` with a given kernel (the tests hold the two to each other).
pub(super) fn expand_with<T: Word>(
    kernel: Kernel,
    old: &[u8],
    model: &ContextModel,
    buckets: &Buckets,
    listed: &[usize],
    maps: &RankBitmaps,
    positions: &mut Vec<u32>,
) {
    assert!(available() && model.contexts() <= 256 && T::BYTES <= 4, "the caller checks the CPU and the model");
    let walk = Walk::new(model, buckets);
    // The chunk's changes per 64 elements.
    assert!(positions.is_empty(), "positions are written from the start");
    let per_block = 64 * positions.capacity().saturating_sub(SPARE) / (old.len() / T::BYTES).max(1);
    match kernel {
        // Safety: the CPU has the features `expand_avx2` is compiled for
        // (checked just above).
        #[allow(unsafe_code)]
        Kernel::Avx2 => {
            // The positions written unconditionally per block: about the
            // mean changes per block plus one deviation, so that the loop
            // for the others seldom runs (its trip count mispredicts). On
            // fp32m 10->15 (6 changes per block) 12 took 5 % fewer samples
            // of the expansion than 8 and 10 % fewer than 16; on 12->15
            // (4 per block) 8 took 17 % fewer than 16.
            match per_block {
                0..2 => unsafe { expand_avx2::<T, 4>(old, &walk, listed, maps, positions) },
                2..5 => unsafe { expand_avx2::<T, 8>(old, &walk, listed, maps, positions) },
                _ => unsafe { expand_avx2::<T, 12>(old, &walk, listed, maps, positions) },
            }
        }
        // The whole chunk as one segment.
        Kernel::Avx512 | Kernel::Avx512Vbmi => {
            assert!(if kernel == Kernel::Avx512 { wide_available() } else { vbmi_available() }, "the caller checks the CPU");
            Segments::with(kernel, walk, listed, maps, per_block).expand::<T>(old, 0, positions);
        }
    }
}

/// What the kernels need to find each element's bucket: the context field
/// (`(word >> shift) & mask`) and the buckets' bounds, each below 256 here.
/// A block's context bytes become bucket ids by one compare per bound.
pub(super) struct Walk {
    shift: u32,
    mask: u8,
    bounds: Vec<u8>,
    /// The AVX2 kernels' split of the bounds: the lowest `compared` by one
    /// compare each, the rest (the highest at most 14 above the lowest of
    /// them) by one byte
    /// shuffle of `window`, which counts the bounds up to each of the 16
    /// contexts from `window_base` on (`bucket_ids`).
    compared: usize,
    window_base: u8,
    window: [u8; 16],
    /// The bucket of each value of the low byte of `word >> shift`, the
    /// bits above the field included (`Kernel::Avx512Vbmi`'s table).
    of_byte: [u8; 256],
}

impl Walk {
    fn new(model: &ContextModel, buckets: &Buckets) -> Self {
        let bounds: Vec<u8> = buckets.bounds.iter().map(|&b| u8::try_from(b).expect("at most 256 contexts")).collect();
        let of: [u8; 256] = std::array::from_fn(|c| if c < model.contexts() { buckets.of(c) as u8 } else { 0 });
        let mask = model.mask as u8;
        let of_byte = std::array::from_fn(|b| of[usize::from(b as u8 & mask)]);
        // The fewest compares that leave the rest within a window of 16
        // contexts (the training pairs' bounds: one far below, four or five
        // within a few exponents of each other).
        let compared = bounds.iter().position(|&b| bounds.last().is_some_and(|&last| last - b <= 14)).unwrap_or(0);
        let window_base = bounds.get(compared).map_or(0, |&b| b - 1);
        let window = std::array::from_fn(|i| bounds[compared..].iter().filter(|&&b| usize::from(b) <= usize::from(window_base) + i).count() as u8);
        Walk { shift: model.shift, mask, bounds, compared, window_base, window, of_byte }
    }
}

/// Where each listed bucket's walk over its rank bitmap starts, for the
/// expansion kernels: the bucket, the bit of `words` that holds the flag
/// of its first element, and the end of its bitmap.
fn cursors<'a>(listed: &'a [usize], maps: &'a RankBitmaps) -> impl Iterator<Item = (u8, usize, usize)> + 'a {
    listed.iter().map(|&c| {
        let next = maps.base[c] * 64;
        (u8::try_from(c).expect("at most 256 buckets"), next, next + maps.limit[c] as usize)
    })
}

/// 64 flags of a bucket's rank bitmap from bit `bit`: two words, which
/// lie inside the bitmap or the `BITMAP_PADDING_WORDS` zero words after it
/// when `bit` is below the bitmap's end plus `64 * (BITMAP_PADDING_WORDS -
/// 1)` (`rank_bitmaps`).
#[inline(always)]
fn window(words: &[u64], bit: usize) -> u64 {
    let i = bit / 64;
    debug_assert!(i + 1 < words.len());
    // Safety: `i + 1 < words.len()`: the callers read from below a
    // bitmap's end plus 64, and every bitmap is followed by two zero words.
    #[allow(unsafe_code)]
    let pair = unsafe { u128::from(*words.get_unchecked(i)) | (u128::from(*words.get_unchecked(i + 1)) << 64) };
    (pair >> (bit % 64)) as u64
}

/// Write the positions of the set bits of `changed` (elements from
/// `start`) at `at`: `U` unconditionally (most blocks have no more; the
/// surplus is overwritten or cut off), then any others. Returns how many.
#[inline(always)]
fn write_positions<const U: usize>(at: &mut [MaybeUninit<u32>], start: usize, mut changed: u64) -> usize {
    const { assert!(U <= SPARE) };
    let found = changed.count_ones() as usize;
    for slot in &mut at[..U] {
        slot.write((start + changed.trailing_zeros() as usize) as u32);
        changed &= changed.wrapping_sub(1);
    }
    let mut slot = U;
    while changed != 0 {
        at[slot].write((start + changed.trailing_zeros() as usize) as u32);
        changed &= changed - 1;
        slot += 1;
    }
    found
}

/// `write_positions` by sixteen-lane compresses: each sixteen flags of
/// `changed` select their positions, written as a whole vector (the
/// surplus is overwritten or cut off). Returns how many.
///
/// # Safety
/// The CPU must have AVX-512 F.
#[allow(unsafe_code)]
#[inline(always)]
unsafe fn compress_positions(at: &mut [MaybeUninit<u32>], start: usize, changed: u64) -> usize {
    const { assert!(SPARE >= 64) };
    assert!(at.len() >= 64);
    let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let mut count = 0usize;
    for part in 0..4 {
        let flags = (changed >> (16 * part)) as u16;
        let lanes = _mm512_add_epi32(iota, _mm512_set1_epi32((start + 16 * part) as i32));
        // Safety: `count` stays at most 16 * part, so the 16 lanes fit in
        // the 64 slots asserted above.
        unsafe { _mm512_storeu_si512(at.as_mut_ptr().add(count).cast(), _mm512_maskz_compress_epi32(flags, lanes)) };
        count += flags.count_ones() as usize;
    }
    count
}

/// Compiled with AVX-512 F/BW and BMI2: may only run where
/// `wide_available()`. The same walk as `expand_avx2`, by blocks of
/// `64 * L` elements: per bucket present, one compare per 64 elements
/// straight into a mask, and one deposit.
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx512bw,avx2,bmi1,bmi2,popcnt")]
unsafe fn expand_avx512<T: Word, const L: usize, const COMPRESS: bool>(old: &[u8], walk: &Walk, words: &[u64], cursors: &mut Vec<Cursor>, offset: usize, positions: &mut Vec<u32>) {
    // Safety: the caller's CPU has these features.
    unsafe { expand_blocks::<T, L, false, COMPRESS>(old, walk, words, cursors, offset, positions) }
}

/// `expand_avx512` with the bucket ids by table lookup: may only run where
/// `vbmi_available()`.
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2,bmi1,bmi2,popcnt")]
unsafe fn expand_avx512_vbmi<T: Word, const L: usize, const COMPRESS: bool>(old: &[u8], walk: &Walk, words: &[u64], cursors: &mut Vec<Cursor>, offset: usize, positions: &mut Vec<u32>) {
    // Safety: the caller's CPU has these features.
    unsafe { expand_blocks::<T, L, true, COMPRESS>(old, walk, words, cursors, offset, positions) }
}

/// A listed bucket's walk over its rank bitmap: the bucket, the bit of
/// the bitmaps' words that holds the flag of its next element, and the
/// end of its bitmap.
type Cursor = (u8, usize, usize);

/// The expansion over a chunk's elements a segment at a time, in order
/// (the AVX-512 kernels): so that a decoder can decode the changes of one
/// segment while its words are still in the caches, before the next is
/// read.
pub(super) struct Segments<'m> {
    /// `Avx512` or `Avx512Vbmi`.
    kernel: Kernel,
    /// Positions by compresses, from two changes per 64 elements up: on
    /// fp32m 10->15 (6 per 64) that took 15 % fewer of the expansion's
    /// samples than a write per change (Zen 4), on 10->11 (2 per 64)
    /// about as many, and on sparser chunks more.
    compress: bool,
    walk: Walk,
    words: &'m [u64],
    cursors: Vec<Cursor>,
}

impl<'m> Segments<'m> {
    /// For a chunk of `n` elements with `m` changes; `None` where the CPU
    /// has no AVX-512 kernel (or the model does not suit them).
    pub(super) fn new<T: Word>(model: &ContextModel, buckets: &Buckets, listed: &[usize], maps: &'m RankBitmaps, n: usize, m: usize) -> Option<Self> {
        let kernel = widest();
        if kernel == Kernel::Avx2 || !available() || model.contexts() > 256 || T::BYTES > 4 {
            return None;
        }
        Some(Segments::with(kernel, Walk::new(model, buckets), listed, maps, 64 * m / n.max(1)))
    }

    /// The walks of the `listed` buckets from their bitmaps' starts, for a
    /// chunk of `per_block` changes per 64 elements.
    fn with(kernel: Kernel, walk: Walk, listed: &[usize], maps: &'m RankBitmaps, per_block: usize) -> Self {
        Segments { kernel, compress: per_block >= 2, walk, words: &maps.words, cursors: cursors(listed, maps).collect() }
    }

    /// Expand the segment `old` (whole blocks of `64 * LANES` elements but
    /// at the chunk's end), whose first element is the chunk's `offset`:
    /// its changed positions appended to `positions`, which has room for
    /// the listed total plus `SPARE`.
    pub(super) fn expand<T: Word>(&mut self, old: &[u8], offset: usize, positions: &mut Vec<u32>) {
        debug_assert!(offset.is_multiple_of(64 * LANES));
        // Safety: the kernel's features were found on this CPU (`new`,
        // `expand_with`).
        #[allow(unsafe_code)]
        unsafe {
            let (walk, words, cursors) = (&self.walk, self.words, &mut self.cursors);
            match (self.kernel, self.compress) {
                (Kernel::Avx512Vbmi, true) => expand_avx512_vbmi::<T, LANES, true>(old, walk, words, cursors, offset, positions),
                (Kernel::Avx512Vbmi, false) => expand_avx512_vbmi::<T, LANES, false>(old, walk, words, cursors, offset, positions),
                (_, true) => expand_avx512::<T, LANES, true>(old, walk, words, cursors, offset, positions),
                (_, false) => expand_avx512::<T, LANES, false>(old, walk, words, cursors, offset, positions),
            }
        }
    }
}

/// The body of the AVX-512 expansions, inlined into each (`VBMI`: the
/// bucket ids by table lookup): the blocks of `old` (a segment whose first
/// element is the chunk's `offset`), the walks continued from `cursors`
/// (and left where they stop), the positions appended to `positions`.
///
/// # Safety
/// The CPU must have AVX-512 F and BW, BMI1, BMI2 and POPCNT, and AVX-512
/// VBMI when `VBMI`; `positions` has room for the listed total plus
/// `SPARE`.
#[allow(unsafe_code)]
#[inline(always)]
unsafe fn expand_blocks<T: Word, const L: usize, const VBMI: bool, const COMPRESS: bool>(
    old: &[u8],
    walk: &Walk,
    words: &[u64],
    cursors: &mut Vec<Cursor>,
    offset: usize,
    positions: &mut Vec<u32>,
) {
    let w = T::BYTES;
    let n = old.len() / w;
    const { assert!(L <= BITMAP_PADDING_WORDS) };
    let before = positions.len();
    let mut count = 0usize;
    // Every listed bucket is walked in every block, present or not: a loop
    // of fixed trip count, whose exit is always predicted (walking only the
    // buckets present took 5-15 % more time, Intel Xeon). Per bucket: its
    // probe, next flag and end.
    let mut walks: Vec<(__m512i, Cursor)> = cursors.iter().map(|&(c, next, end)| (_mm512_set1_epi8(c as i8), (c, next, end))).collect();
    for start in (0..n).step_by(64 * L) {
        // A bucket whose walk has reached its bitmap's end flags nothing
        // more: it leaves the walk (and once none is left, the chunk's
        // other elements are unchanged). The others start the block below
        // their end, so the `L` windows each reads stay inside its bitmap
        // and the `BITMAP_PADDING_WORDS` zero words after it, with no
        // clamp per window (the context apply 0.99 of the time, fp32m
        // 10->15, paired, Intel Xeon: the walk waits mostly on the loads
        // of `old`).
        if walks.iter().any(|&(_, (_, next, end))| next >= end) {
            walks.retain(|&(_, (_, next, end))| next < end);
        }
        if walks.is_empty() {
            break;
        }
        // Safety: these kernels run only where the CPU has AVX-512 F and BW.
        let (v, valid) = unsafe { wide_lanes::<T, L, VBMI>(old, start, walk) };
        let mut changed = [0u64; L];
        for (probe, (_, next_bit, _)) in walks.iter_mut() {
            let mut bit = *next_bit;
            for lane in 0..L {
                let m = _mm512_cmpeq_epi8_mask(v[lane], *probe) & valid[lane];
                let k = m.count_ones();
                changed[lane] |= _pdep_u64(_bzhi_u64(window(words, bit), k), m);
                bit += k as usize;
            }
            *next_bit = bit;
        }
        // At most the listed total is ever found (each bitmap bit is taken
        // once), so `SPARE` slots past it suffice for each part.
        for (lane, &bits) in changed.iter().enumerate() {
            let at = &mut positions.spare_capacity_mut()[count..count + SPARE];
            count += if COMPRESS {
                // Safety: the CPU has AVX-512 F (the caller's).
                unsafe { compress_positions(at, offset + start + 64 * lane, bits) }
            } else {
                write_positions::<4>(at, offset + start + 64 * lane, bits)
            };
        }
    }
    // The walks left (where each stopped), for the next segment.
    *cursors = walks.into_iter().map(|(_, cursor)| cursor).collect();
    // Safety: each slot below `count` was written (the kernels write every
    // slot from a block's first up to its last change, and more).
    unsafe { positions.set_len(before + count) };
}

/// The bucket ids of the `64 * L` words of `old` from word `start`, as
/// `L` vectors of 64, and the masks of their valid elements (words past the
/// end of `old` are invalid; `L` is even). Always inlined into the
/// kernels, so that the vectors stay in registers.
///
/// # Safety
/// The CPU must have AVX-512 F and BW.
#[allow(unsafe_code)]
#[inline(always)]
unsafe fn wide_lanes<T: Word, const L: usize, const VBMI: bool>(old: &[u8], start: usize, walk: &Walk) -> ([__m512i; L], [u64; L]) {
    let n = old.len() / T::BYTES;
    let mut v = [_mm512_setzero_si512(); L];
    let mut valid = [0u64; L];
    for half in 0..L / 2 {
        if start + 128 * half < n {
            // Safety: the caller's CPU has AVX-512 F and BW.
            (v[2 * half], v[2 * half + 1], valid[2 * half], valid[2 * half + 1]) = if VBMI {
                unsafe { wide_block_buckets_vbmi::<T>(old, start + 128 * half, walk) }
            } else {
                unsafe { wide_block_buckets::<T>(old, start + 128 * half, walk) }
            };
        }
    }
    (v, valid)
}

/// The (up to) 128 words of `old` from word `start` handed to `f` as a
/// whole block of 128 words (a partial last block padded with zero words),
/// and the masks of the valid elements of its two halves.
#[inline(always)]
fn with_block_of_128<T: Word, R>(old: &[u8], start: usize, f: impl FnOnce(&[u8]) -> R) -> (R, u64, u64) {
    const B: usize = 128;
    let w = T::BYTES;
    let len = B.min(old.len() / w - start);
    let block = &old[start * w..(start + len) * w];
    if len == B {
        return (f(block), u64::MAX, u64::MAX);
    }
    let valid = |from: usize| match len.saturating_sub(from) {
        0 => 0,
        k if k >= 64 => u64::MAX,
        k => (1u64 << k) - 1,
    };
    let mut tail = [0u8; B * 4];
    tail[..block.len()].copy_from_slice(block);
    (f(&tail[..B * w]), valid(0), valid(64))
}

/// The bucket ids of the block of (up to) 128 words of `old` from word
/// `start`, as two vectors of 64 bytes, and the masks of their valid
/// elements (a partial last block is padded with zero words).
#[allow(unsafe_code)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn wide_block_buckets<T: Word>(old: &[u8], start: usize, walk: &Walk) -> (__m512i, __m512i, u64, u64) {
    // Safety: the block holds 128 words.
    let ((v0, v1), valid0, valid1) = with_block_of_128::<T, _>(old, start, |block| unsafe { wide_context_vectors::<T>(block, walk.shift, walk.mask) });
    (wide_bucket_ids(v0, &walk.bounds), wide_bucket_ids(v1, &walk.bounds), valid0, valid1)
}

/// `wide_block_buckets` by byte permutes (AVX-512 VBMI): the low byte of
/// each word shifted right to its context field, then that byte's bucket
/// from `walk.of_byte`, with no masking and no compare per bound.
#[allow(unsafe_code)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
fn wide_block_buckets_vbmi<T: Word>(old: &[u8], start: usize, walk: &Walk) -> (__m512i, __m512i, u64, u64) {
    // Safety: `of_byte` holds 256 bytes, four vectors.
    let table: [__m512i; 4] = std::array::from_fn(|i| unsafe { _mm512_loadu_si512(walk.of_byte.as_ptr().add(64 * i) as *const __m512i) });
    // Safety: the block holds 128 words.
    let ((v0, v1), valid0, valid1) = with_block_of_128::<T, _>(old, start, |block| unsafe { wide_low_bytes::<T>(block, walk.shift) });
    (lookup_bytes(&table, v0), lookup_bytes(&table, v1), valid0, valid1)
}

/// Each byte of `index` replaced by its entry of the 256-byte `table`
/// (four vectors of 64): two two-register byte permutes (the low seven
/// bits) and a blend by the top bit (AVX-512 VBMI).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
pub(super) fn lookup_bytes(table: &[__m512i; 4], index: __m512i) -> __m512i {
    let low = _mm512_permutex2var_epi8(table[0], index, table[1]);
    let high = _mm512_permutex2var_epi8(table[2], index, table[3]);
    _mm512_mask_blend_epi8(_mm512_movepi8_mask(index), low, high)
}

/// The low byte of each of the 128 words at `words` shifted right by
/// `shift`, in element order, as two vectors of 64 (the bits above the
/// context field left in: `Walk::of_byte` ignores them). For one-byte
/// words the shift is of 16-bit lanes, which brings in bits of the next
/// byte above the field only (shift plus field width is at most 8).
///
/// # Safety
/// `words` must hold at least `128 * T::BYTES` bytes; the CPU must have
/// AVX-512 F, BW and VBMI.
#[allow(unsafe_code)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn wide_low_bytes<T: Word>(words: &[u8], shift: u32) -> (__m512i, __m512i) {
    debug_assert!(words.len() >= 128 * T::BYTES);
    let p = words.as_ptr() as *const __m512i;
    let count = _mm_cvtsi32_si128(shift as i32);
    // Byte i of the result is byte `step * i` of the pair (a, b).
    let every = |step: usize| -> __m512i {
        let idx: [u8; 64] = std::array::from_fn(|i| ((step * i) % 128) as u8);
        _mm512_loadu_si512(idx.as_ptr() as *const __m512i)
    };
    match T::BYTES {
        1 => {
            let f = |i: usize| _mm512_srl_epi16(_mm512_loadu_si512(p.add(i)), count);
            (f(0), f(1))
        }
        2 => {
            let f = |i: usize| _mm512_srl_epi16(_mm512_loadu_si512(p.add(i)), count);
            let even = every(2);
            (_mm512_permutex2var_epi8(f(0), even, f(1)), _mm512_permutex2var_epi8(f(2), even, f(3)))
        }
        _ => {
            let f = |i: usize| _mm512_srl_epi32(_mm512_loadu_si512(p.add(i)), count);
            // Bytes 0, 4, .. of two vectors fill the low half of a result.
            let fourth = every(4);
            let half = |i: usize| _mm512_castsi512_si256(_mm512_permutex2var_epi8(f(i), fourth, f(i + 1)));
            let join = |i: usize| _mm512_inserti64x4::<1>(_mm512_castsi256_si512(half(i)), half(i + 2));
            (join(0), join(4))
        }
    }
}

/// The bucket id of each context byte of `v`: how many bounds it reaches.
#[allow(unsafe_code)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn wide_bucket_ids(v: __m512i, bounds: &[u8]) -> __m512i {
    let one = _mm512_set1_epi8(1);
    let mut ids = _mm512_setzero_si512();
    for &b in bounds {
        ids = _mm512_mask_add_epi8(ids, _mm512_cmpge_epu8_mask(v, _mm512_set1_epi8(b as i8)), ids, one);
    }
    ids
}

/// The context bytes of the 128 words at `words` (`128 * T::BYTES`
/// bytes), in element order, as two vectors of 64.
///
/// # Safety
/// `words` must hold at least `128 * T::BYTES` bytes; the CPU must have
/// AVX-512 F and BW.
#[allow(unsafe_code)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn wide_context_vectors<T: Word>(words: &[u8], shift: u32, mask: u8) -> (__m512i, __m512i) {
    debug_assert!(words.len() >= 128 * T::BYTES);
    let p = words.as_ptr() as *const __m512i;
    let count = _mm_cvtsi32_si128(shift as i32);
    match T::BYTES {
        1 => {
            // As in `context_vectors`: bits brought in from the byte above
            // the field are masked off.
            let m = _mm512_set1_epi8(mask as i8);
            let f = |i: usize| _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(p.add(i)), count), m);
            (f(0), f(1))
        }
        2 => {
            let m = _mm512_set1_epi16(i16::from(mask));
            let f = |i: usize| _mm512_cvtepi16_epi8(_mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(p.add(i)), count), m));
            let join = |a: __m256i, b: __m256i| _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
            (join(f(0), f(1)), join(f(2), f(3)))
        }
        _ => {
            let m = _mm512_set1_epi32(i32::from(mask));
            let f = |i: usize| _mm512_cvtepi32_epi8(_mm512_and_si512(_mm512_srl_epi32(_mm512_loadu_si512(p.add(i)), count), m));
            let join = |i: usize| {
                let v = _mm512_castsi128_si512(f(i));
                let v = _mm512_inserti32x4::<1>(v, f(i + 1));
                let v = _mm512_inserti32x4::<2>(v, f(i + 2));
                _mm512_inserti32x4::<3>(v, f(i + 3))
            };
            (join(0), join(4))
        }
    }
}

/// Compiled with AVX2 and BMI2: may only run where `available()`.
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,bmi1,bmi2,popcnt")]
unsafe fn expand_avx2<T: Word, const U: usize>(old: &[u8], walk: &Walk, listed: &[usize], maps: &RankBitmaps, positions: &mut Vec<u32>) {
    if listed.is_empty() {
        positions.clear();
        return;
    }
    let mut all: Vec<(__m256i, usize, usize)> = cursors(listed, maps).map(|(c, next, end)| (_mm256_set1_epi8(c as i8), next, end)).collect();
    // Up to five buckets (the encoder lists at most that many) by a loop
    // of known trip count, whose cursors the compiler keeps in registers:
    // the context apply of the training pairs 0.96-0.97 of the time of
    // the cursors' loads and stores through memory each block (paired
    // `ab_timing`, a Zen 3 host). More (another encoder's payload) by
    // the general loop.
    let words = &maps.words[..];
    let count = match all.len() {
        1 => expand_cursors::<T, U, 1>(old, walk, words, all.try_into().expect("one cursor"), positions),
        2 => expand_cursors::<T, U, 2>(old, walk, words, all.try_into().expect("two cursors"), positions),
        3 => expand_cursors::<T, U, 3>(old, walk, words, all.try_into().expect("three cursors"), positions),
        4 => expand_cursors::<T, U, 4>(old, walk, words, all.try_into().expect("four cursors"), positions),
        5 => expand_cursors::<T, U, 5>(old, walk, words, all.try_into().expect("five cursors"), positions),
        _ => expand_blocks_avx2::<T, U>(old, walk, words, &mut all, positions),
    };
    // Safety: each slot below `count` was written (the kernels write every
    // slot from a block's first up to its last change, and more).
    unsafe { positions.set_len(count) };
}

/// `expand_blocks_avx2` with `N` cursors in an array (registers).
///
/// # Safety
/// As for `expand_blocks_avx2`.
#[allow(unsafe_code)]
#[inline(always)]
unsafe fn expand_cursors<T: Word, const U: usize, const N: usize>(old: &[u8], walk: &Walk, words: &[u64], mut cursors: [(__m256i, usize, usize); N], positions: &mut Vec<u32>) -> usize {
    expand_blocks_avx2::<T, U>(old, walk, words, &mut cursors, positions)
}

/// The body of `expand_avx2`, inlined into it: per block of 64 elements,
/// each cursor's (listed bucket's: probe, next flag, end) members and
/// flags, then the block's changed positions written after the first
/// `count` of `positions`' spare room. Returns how many were written.
///
/// # Safety
/// The CPU has AVX2, BMI1, BMI2 and POPCNT (inlined only into
/// `expand_avx2`); `positions` is empty with room for the listed total
/// plus `SPARE`.
#[allow(unsafe_code)]
#[inline(always)]
unsafe fn expand_blocks_avx2<T: Word, const U: usize>(old: &[u8], walk: &Walk, words: &[u64], cursors: &mut [(__m256i, usize, usize)], positions: &mut Vec<u32>) -> usize {
    const B: usize = 64;
    let n = old.len() / T::BYTES;
    let mut count = 0usize;
    for start in (0..n).step_by(B) {
        let (v0, v1, _, valid) = block_buckets::<T>(old, start, walk);
        let mut changed = 0u64;
        for (probe, next_bit, stop) in cursors.iter_mut() {
            let m = (u64::from(_mm256_movemask_epi8(_mm256_cmpeq_epi8(v0, *probe)) as u32)
                | (u64::from(_mm256_movemask_epi8(_mm256_cmpeq_epi8(v1, *probe)) as u32) << 32))
                & valid;
            let k = m.count_ones();
            // Past the end every flag is zero: reading from the end keeps
            // the window inside the bitmap's zero words.
            changed |= _pdep_u64(_bzhi_u64(window(words, (*next_bit).min(*stop)), k), m);
            *next_bit += k as usize;
        }
        // At most the listed total is ever found (each bitmap bit is taken
        // once), so `SPARE` slots past it suffice.
        count += write_positions::<U>(&mut positions.spare_capacity_mut()[count..count + SPARE], start, changed);
    }
    count
}


/// The bucket ids of the block of (up to) 64 words of `old` from word
/// `start`, the block's length and the mask of its valid elements: a
/// partial last block is padded with zero words, masked out by `valid`.
/// Inlined into its callers, which are compiled for AVX2 (a function
/// compiled for a target feature may not be `inline(always)`, and out of
/// line it returned its two vectors through memory per block: inlined, the
/// context apply 0.96-0.98 of the time, paired, on a Zen 3 host).
///
/// # Safety
/// The CPU has AVX2.
#[allow(unsafe_code)]
#[inline(always)]
unsafe fn block_buckets<T: Word>(old: &[u8], start: usize, walk: &Walk) -> (__m256i, __m256i, usize, u64) {
    const B: usize = 64;
    let w = T::BYTES;
    let len = B.min(old.len() / w - start);
    let block = &old[start * w..(start + len) * w];
    let ids = |v| bucket_ids(v, walk);
    // Safety (both calls): the slice holds 64 words.
    if len == B {
        let (v0, v1) = unsafe { context_vectors::<T>(block, walk.shift, walk.mask) };
        return (ids(v0), ids(v1), len, u64::MAX);
    }
    // Kept out of line, so that the common case is small enough to inline.
    #[cold]
    #[inline(never)]
    #[target_feature(enable = "avx2")]
    fn partial<T: Word>(block: &[u8], walk: &Walk) -> (__m256i, __m256i, usize, u64) {
        let mut tail = [0u8; B * 4];
        tail[..block.len()].copy_from_slice(block);
        let (v0, v1) = unsafe { context_vectors::<T>(&tail[..B * T::BYTES], walk.shift, walk.mask) };
        let len = block.len() / T::BYTES;
        (bucket_ids(v0, walk), bucket_ids(v1, walk), len, (1u64 << len) - 1)
    }
    partial::<T>(block, walk)
}

/// The bucket id of each context byte of `v`: how many bounds it reaches.
/// The bounds of `walk.window` by one shuffle (the context's distance
/// above `window_base`, saturated to 0..15, indexes the count of those
/// bounds up to it); each lower one by a compare (`max(v, b) == v` is
/// `v >= b` unsigned; the compare's -1 counts one). On the training pairs
/// that is 6 instructions per 32 contexts where a compare per bound took
/// 15-18.
#[allow(unsafe_code)]
#[inline]
#[target_feature(enable = "avx2")]
fn bucket_ids(v: __m256i, walk: &Walk) -> __m256i {
    let mut ids = _mm256_setzero_si256();
    if walk.compared < walk.bounds.len() {
        // Safety: `window` holds 16 bytes.
        let window = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(walk.window.as_ptr().cast()) });
        let at = _mm256_min_epu8(_mm256_subs_epu8(v, _mm256_set1_epi8(walk.window_base as i8)), _mm256_set1_epi8(15));
        ids = _mm256_shuffle_epi8(window, at);
    }
    for &b in &walk.bounds[..walk.compared] {
        let reached = _mm256_cmpeq_epi8(_mm256_max_epu8(v, _mm256_set1_epi8(b as i8)), v);
        ids = _mm256_sub_epi8(ids, reached);
    }
    ids
}

/// The context bytes of the 64 words at `words` (`64 * T::BYTES` bytes),
/// in element order, as two vectors of 32.
///
/// # Safety
/// `words` must hold at least `64 * T::BYTES` bytes; the CPU must have AVX2.
#[allow(unsafe_code)]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn context_vectors<T: Word>(words: &[u8], shift: u32, mask: u8) -> (__m256i, __m256i) {
    debug_assert!(words.len() >= 64 * T::BYTES);
    let p = words.as_ptr() as *const __m256i;
    let count = _mm_cvtsi32_si128(shift as i32);
    match T::BYTES {
        1 => {
            // Shifting 16-bit lanes brings in bits of the neighbouring byte
            // above the field only (shift + field width <= 8): masked off.
            let m = _mm256_set1_epi8(mask as i8);
            let f = |v| _mm256_and_si256(_mm256_srl_epi16(v, count), m);
            (f(_mm256_loadu_si256(p)), f(_mm256_loadu_si256(p.add(1))))
        }
        2 => {
            let m = _mm256_set1_epi16(i16::from(mask));
            let f = |i: usize| _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256(p.add(i)), count), m);
            // packus interleaves 128-bit lanes; the permute restores order.
            let pack = |a, b| _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi16(a, b));
            (pack(f(0), f(1)), pack(f(2), f(3)))
        }
        _ => {
            let m = _mm256_set1_epi32(i32::from(mask));
            let f = |i: usize| _mm256_and_si256(_mm256_srl_epi32(_mm256_loadu_si256(p.add(i)), count), m);
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            let pack = |i: usize| {
                let ab = _mm256_packus_epi32(f(i), f(i + 1));
                let cd = _mm256_packus_epi32(f(i + 2), f(i + 3));
                _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), order)
            };
            (pack(0), pack(4))
        }
    }
}

/// Each bucket's gaps (`BucketGaps`) for the changed `positions`
/// (ascending) of the chunk `old`, of which `per_bucket[b]` lie in bucket
/// `b`. The encoder's side of `expand`: per block and bucket with changes,
/// one compare gives the bucket's elements `m`; each change among them has
/// the rank of the bucket's count plus the elements of `m` below it.
pub(super) fn bucket_gaps<T: Word>(old: &[u8], model: &ContextModel, buckets: &Buckets, positions: &[u32], per_bucket: &[u32]) -> BucketGaps {
    bucket_gaps_with::<T>(widest(), old, model, buckets, positions, per_bucket)
}

/// `bucket_gaps` with a given kernel (the tests hold each to the reference).
pub(super) fn bucket_gaps_with<T: Word>(
    kernel: Kernel,
    old: &[u8],
    model: &ContextModel,
    buckets: &Buckets,
    positions: &[u32],
    per_bucket: &[u32],
) -> BucketGaps {
    assert!(available() && model.contexts() <= 256 && T::BYTES <= 4, "the caller checks the CPU and the model");
    let walk = Walk::new(model, buckets);
    match kernel {
        Kernel::Avx2 => {
            let mut walker = GapWalker::<1>::new(per_bucket);
            // Safety: the CPU has the features `gaps_avx2` is compiled for
            // (checked just above).
            #[allow(unsafe_code)]
            unsafe {
                gaps_avx2::<T>(old, &walk, positions, &mut walker)
            };
            walker.finish()
        }
        Kernel::Avx512 => {
            assert!(wide_available(), "the caller checks the CPU");
            let mut walker = GapWalker::<LANES>::new(per_bucket);
            // Safety: checked just above.
            #[allow(unsafe_code)]
            unsafe {
                gaps_avx512::<T, LANES>(old, &walk, positions, &mut walker)
            };
            walker.finish()
        }
        Kernel::Avx512Vbmi => {
            assert!(vbmi_available(), "the caller checks the CPU");
            let mut walker = GapWalker::<LANES>::new(per_bucket);
            // Safety: checked just above.
            #[allow(unsafe_code)]
            unsafe {
                gaps_avx512_vbmi::<T, LANES>(old, &walk, positions, &mut walker)
            };
            walker.finish()
        }
    }
}

/// The state of a walk of the gap kernels over blocks of `64 * L`
/// elements, per bucket (indexed by its id).
struct GapWalker<const L: usize> {
    out: BucketGaps,
    /// The next free slot of its gaps.
    at: [usize; 256],
    /// How many of the elements before the current block it holds.
    seen: [u32; 256],
    /// The buckets with changes (only those need counting), each counted
    /// in every block, present or not: a loop of fixed trip count, whose
    /// exit is always predicted.
    with_changes: Vec<usize>,
    /// In the current block, per bucket with changes and lane of 64: its
    /// elements, and how many it holds before the lane.
    members: [[u64; L]; 256],
    before: [[u32; L]; 256],
}

impl<const L: usize> GapWalker<L> {
    fn new(per_bucket: &[u32]) -> Self {
        assert!(per_bucket.len() <= 256, "at most 256 buckets");
        let out = BucketGaps::with_counts(per_bucket);
        let mut at = [0usize; 256];
        at[..per_bucket.len()].copy_from_slice(&out.start[..per_bucket.len()]);
        let with_changes = (0..per_bucket.len()).filter(|&b| per_bucket[b] > 0).collect();
        GapWalker { out, at, seen: [0; 256], with_changes, members: [[0; L]; 256], before: [[0; L]; 256] }
    }

    /// Count bucket `c`'s elements in the current block: `members[lane]`
    /// marks them among each 64.
    #[inline(always)]
    fn count(&mut self, c: usize, members: [u64; L]) {
        let mut seen = self.seen[c];
        for (before, m) in self.before[c].iter_mut().zip(members) {
            *before = seen;
            seen += m.count_ones();
        }
        self.members[c] = members;
        self.seen[c] = seen;
    }

    /// Take the change at element `j` of the current block, of bucket `c`
    /// (counted).
    #[inline(always)]
    fn take(&mut self, c: usize, j: usize) {
        let (lane, bit) = (j / 64, j % 64);
        let below = self.members[c][lane] & ((1u64 << bit) - 1);
        let rank = self.before[c][lane] + below.count_ones();
        self.out.take(&mut self.at[c], rank);
    }

    fn finish(mut self) -> BucketGaps {
        self.out.finish(&self.at[..self.out.span.len()]);
        self.out
    }
}

/// Compiled with AVX-512 F/BW and BMI2: may only run where
/// `wide_available()`. The walk of `gaps_avx2` by blocks of `64 * L`
/// elements, as `expand_avx512` walks them: one compare per 64 elements
/// straight into a mask, and the per-block work paid a quarter as often.
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx512bw,avx2,bmi1,bmi2,popcnt")]
unsafe fn gaps_avx512<T: Word, const L: usize>(old: &[u8], walk: &Walk, positions: &[u32], walker: &mut GapWalker<L>) {
    // Safety: the caller's CPU has these features.
    unsafe { gap_blocks::<T, L, false>(old, walk, positions, walker) }
}

/// `gaps_avx512` with the bucket ids by table lookup: may only run where
/// `vbmi_available()`.
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2,bmi1,bmi2,popcnt")]
unsafe fn gaps_avx512_vbmi<T: Word, const L: usize>(old: &[u8], walk: &Walk, positions: &[u32], walker: &mut GapWalker<L>) {
    // Safety: the caller's CPU has these features.
    unsafe { gap_blocks::<T, L, true>(old, walk, positions, walker) }
}

/// The body of the AVX-512 gap kernels, inlined into each. Per block: the
/// buckets with changes counted, then the block's changes taken in
/// element order (one loop over the changes, not one per bucket: its trip
/// count is predicted far better).
///
/// # Safety
/// As for `expand_blocks`.
#[allow(unsafe_code)]
#[inline(always)]
unsafe fn gap_blocks<T: Word, const L: usize, const VBMI: bool>(old: &[u8], walk: &Walk, positions: &[u32], walker: &mut GapWalker<L>) {
    let n = old.len() / T::BYTES;
    let mut next = 0usize; // the next change
    let mut ids = [[0u8; 64]; L];
    for start in (0..n).step_by(64 * L) {
        if next == positions.len() {
            break; // nothing after the last change needs counting
        }
        // Safety: these kernels run only where the CPU has AVX-512 F and BW.
        let (v, valid) = unsafe { wide_lanes::<T, L, VBMI>(old, start, walk) };
        for i in 0..walker.with_changes.len() {
            let c = walker.with_changes[i];
            let probe = _mm512_set1_epi8(c as u8 as i8);
            walker.count(c, std::array::from_fn(|lane| _mm512_cmpeq_epi8_mask(v[lane], probe) & valid[lane]));
        }
        for (lane, ids) in ids.iter_mut().enumerate() {
            // Safety: `ids` holds 64 bytes per lane.
            unsafe { _mm512_storeu_si512(ids.as_mut_ptr() as *mut __m512i, v[lane]) };
        }
        take_block_changes(walker, ids.as_flattened(), positions, &mut next, start);
    }
    assert_eq!(next, positions.len(), "changed positions ascend and lie inside the chunk");
}

/// Take the changes of the block of `64 * L` elements from `start`, whose
/// bucket ids are `ids`, from `positions[*next..]`.
#[inline(always)]
fn take_block_changes<const L: usize>(walker: &mut GapWalker<L>, ids: &[u8], positions: &[u32], next: &mut usize, start: usize) {
    while let Some(&p) = positions.get(*next) {
        // Positions below `start` (not ascending) wrap to past the block
        // and end the walk early, which the kernels refuse.
        let j = (p as usize).wrapping_sub(start);
        if j >= 64 * L {
            break;
        }
        walker.take(usize::from(ids[j]), j);
        *next += 1;
    }
}

/// Compiled with AVX2 and BMI2: may only run where `available()`.
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,bmi1,bmi2,popcnt")]
unsafe fn gaps_avx2<T: Word>(old: &[u8], walk: &Walk, positions: &[u32], walker: &mut GapWalker<1>) {
    let n = old.len() / T::BYTES;
    let mut next = 0usize; // the next change
    let mut ids = [0u8; 64];
    for start in (0..n).step_by(64) {
        if next == positions.len() {
            break; // nothing after the last change needs counting
        }
        let (v0, v1, _, valid) = block_buckets::<T>(old, start, walk);
        for i in 0..walker.with_changes.len() {
            let c = walker.with_changes[i];
            let probe = _mm256_set1_epi8(c as u8 as i8);
            let members = (u64::from(_mm256_movemask_epi8(_mm256_cmpeq_epi8(v0, probe)) as u32)
                | (u64::from(_mm256_movemask_epi8(_mm256_cmpeq_epi8(v1, probe)) as u32) << 32))
                & valid;
            walker.count(c, [members]);
        }
        // Safety: `ids` holds 64 bytes.
        unsafe {
            _mm256_storeu_si256(ids.as_mut_ptr() as *mut __m256i, v0);
            _mm256_storeu_si256(ids.as_mut_ptr().add(32) as *mut __m256i, v1);
        }
        take_block_changes(walker, &ids, positions, &mut next, start);
    }
    assert_eq!(next, positions.len(), "changed positions ascend and lie inside the chunk");
}

/// How many of the leading `positions` (ascending) of a chunk of `len`
/// bytes of `width`-byte words `survey_steps` takes: whole groups of
/// sixteen whose 4-byte loads stay inside the chunk, at positions that
/// are valid signed 32-bit gather indices.
pub(super) fn survey_prefix(positions: &[u32], width: usize, len: usize) -> usize {
    if width > 4 {
        return 0;
    }
    positions.partition_point(|&p| p < 1 << 31 && p as usize * width + 4 <= len) / 16 * 16
}

/// The context encoder's survey of its changes where the CPU has AVX2 but
/// not AVX-512 (`gather_x86::survey_steps` is the AVX-512 twin, and
/// `context::survey_from` the portable loop the tests hold both to): for
/// the change at `positions[j]`, whose new word is its old word XOR
/// `xors[j]`, its context (`contexts[j]`), its ulp step from `old` to new
/// (`magnitudes[j]`: the step's magnitude less one; the sign: bit `j % 16`
/// of `signs[j / 16]`, set when negative). Eight changes per step, their
/// old words gathered and the XOR words read in order, the step made
/// between the ordinals in the high bits of 32-bit lanes.
///
/// # Safety
/// The CPU has AVX2 (`codec::avx2_available`); `W` is 1, 2 or 4; `positions`
/// is a `survey_prefix` of a chunk's positions for `old` and `W`.
#[allow(unsafe_code)]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn survey_steps<const W: i32>(
    old: &[u8],
    xors: &[u64],
    positions: &[u32],
    model: StepModel32,
    contexts: &mut [u16],
    magnitudes: &mut [u64],
    signs: &mut [u16],
) {
    let n = positions.len();
    assert!(
        n.is_multiple_of(16) && xors.len() == n && contexts.len() == n && magnitudes.len() == n && signs.len() == n / 16,
        "whole groups, one XOR word and one output per position"
    );
    assert!(
        positions.last().is_none_or(|&p| p < 1 << 31 && p as usize * W as usize + 4 <= old.len()),
        "every 4-byte load inside the chunk"
    );
    let up = _mm_cvtsi32_si128(32 - 8 * W);
    let below_sign = (i32::MAX >> (32 - 8 * W)) << (32 - 8 * W);
    let flip = _mm256_set1_epi32(if model.float { below_sign } else { 0 });
    let ordinal = |high: __m256i| _mm256_xor_si256(high, _mm256_and_si256(_mm256_srai_epi32::<31>(high), flip));
    let word_mask = _mm256_set1_epi32(if W == 4 { -1 } else { (1 << (8 * W)) - 1 });
    let shift = _mm_cvtsi32_si128(model.shift as i32);
    let context_mask = _mm256_set1_epi32(model.mask as i32);
    let ones = _mm256_set1_epi32(1);
    for (g, group) in positions.chunks_exact(16).enumerate() {
        // The words eight groups ahead: the scan read the chunk before,
        // and its words at the changes are no longer near (0.96-0.99 of
        // the context diff's time, paired, on a Zen 3).
        super::prefetch_words(old.as_ptr(), W as usize, positions, 16 * g + 128, 16);
        let mut negative = 0u16;
        for half in 0..2 {
            let i = 16 * g + 8 * half;
            let vp = _mm256_loadu_si256(group.as_ptr().add(8 * half).cast());
            let vo = _mm256_and_si256(_mm256_i32gather_epi32::<W>(old.as_ptr().cast(), vp), word_mask);
            // The XOR words' low halves, in order.
            let low_halves = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
            let first = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(xors.as_ptr().add(i).cast()), low_halves);
            let second = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(xors.as_ptr().add(i + 4).cast()), low_halves);
            let xor = _mm256_inserti128_si256::<1>(first, _mm256_castsi256_si128(second));
            let vn = _mm256_xor_si256(vo, xor);
            // The step between the ordinals, made in the high bits and
            // shifted back down with its sign.
            let step = _mm256_sra_epi32(_mm256_sub_epi32(ordinal(_mm256_sll_epi32(vn, up)), ordinal(_mm256_sll_epi32(vo, up))), up);
            negative |= (_mm256_movemask_ps(_mm256_castsi256_ps(step)) as u16) << (8 * half);
            let magnitude = _mm256_sub_epi32(_mm256_abs_epi32(step), ones);
            let context = _mm256_and_si256(_mm256_srl_epi32(vo, shift), context_mask);
            // Contexts fit 16 bits: pack them (lanes 0-3 and 4-7 land in
            // the two halves' low quarters).
            let packed = _mm256_packus_epi32(context, context);
            let packed = _mm256_permute4x64_epi64::<0b00_00_10_00>(packed);
            _mm_storeu_si128(contexts.as_mut_ptr().add(i).cast(), _mm256_castsi256_si128(packed));
            _mm256_storeu_si256(magnitudes.as_mut_ptr().add(i).cast(), _mm256_cvtepu32_epi64(_mm256_castsi256_si128(magnitude)));
            _mm256_storeu_si256(magnitudes.as_mut_ptr().add(i + 4).cast(), _mm256_cvtepu32_epi64(_mm256_extracti128_si256::<1>(magnitude)));
        }
        signs[g] = negative;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use safetensors::Dtype;

    /// `bucket_ids` counts the bounds each context reaches, for bound sets
    /// that fit one window, need a compare or several below it, or none,
    /// at every context byte.
    #[test]
    fn bucket_ids_count_the_bounds_reached() {
        if !is_x86_feature_detected!("avx2") {
            return; // nothing of this module runs on this CPU
        }
        let model = ContextModel::for_dtype(DType(Dtype::BF16));
        let mut next = crate::codec::tests::xorshift(0x0b0c_4e75_0000_0011);
        let mut sets: Vec<Vec<usize>> = vec![vec![], vec![1], vec![255], vec![1, 255], vec![100, 114], vec![100, 115], vec![99, 116, 118, 119, 121, 124]];
        for _ in 0..200 {
            let count = 1 + (next() % 14) as usize;
            let spread = 1 + next() % 60;
            let low = 1 + next() % 180;
            let mut b: Vec<usize> = (0..count).map(|_| (low + next() % spread) as usize).collect();
            if next().is_multiple_of(3) {
                b.push(1 + (next() % 255) as usize);
            }
            b.sort_unstable();
            b.dedup();
            sets.push(b);
        }
        for bounds in sets {
            let walk = Walk::new(&model, &Buckets::new(bounds.clone(), model.contexts()));
            for first in (0..256).step_by(32) {
                let contexts: [u8; 32] = std::array::from_fn(|i| (first + i) as u8);
                // Safety: the CPU has AVX2 (checked above).
                #[allow(unsafe_code)]
                let ids: [u8; 32] = unsafe {
                    let v = _mm256_loadu_si256(contexts.as_ptr().cast());
                    std::mem::transmute(bucket_ids(v, &walk))
                };
                for (c, id) in contexts.iter().zip(ids) {
                    let want = bounds.iter().filter(|&&b| b <= usize::from(*c)).count();
                    assert_eq!(usize::from(id), want, "context {c}, bounds {bounds:?}");
                }
            }
        }
    }
}
