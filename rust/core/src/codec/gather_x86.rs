//! AVX-512 kernels for the words at change positions, used by the sparse
//! apply (a chunk at a time) and by the encoder's gather (a block at a
//! time) for words of 1, 2 or 4 bytes. Sixteen positions per step: one `vpgatherdd` loads their words
//! (each lane reads 4 bytes at the word's offset and keeps the word's own
//! bytes), and the digest move `h(i, new) - h(i, old)` is added in the same
//! registers, so no per-change arrays of old and new words are written and
//! read back for the hash. The last partial step runs masked.
//!
//! Positions go through a kernel only where every 4-byte load stays inside
//! the slice it reads and every index fits the kernels' 32-bit lanes
//! (`fits`); the scalar loops in `codec` handle the rest (8-byte words, the
//! few positions at a chunk's very end) and are the reference the tests
//! hold these to.

#![allow(unsafe_code)]

use std::arch::x86_64::*;
use std::sync::OnceLock;

use crate::digest::avx512::{moves_sum, zero_moves, AesNi, MoveHash, Vaes};
use crate::digest::DigestSum;

/// Whether this CPU runs the gather kernels (AVX-512 F, BW and VL, and
/// AES-NI for the digest moves; they hash by VAES where the CPU has it).
pub(super) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("aes")
    })
}

/// Whether a block of `positions` in a slice of `len` bytes of `width`-byte
/// words, the first at element `first_element` of its tensor, can go
/// through the kernels: each lane's 4-byte load ends inside the slice,
/// positions are valid signed 32-bit gather indices, and the unit indices
/// `first_element + position` stay below 2^32. Checked on the block's
/// largest position, whatever their order (a few vector instructions per
/// block), since the kernels' loads rely on it.
pub(super) fn fits(positions: &[u32], width: usize, len: usize, first_element: u64) -> bool {
    if positions.is_empty() || width > 4 || !available() {
        return false;
    }
    // Safety: the CPU has AVX-512 F (`available`, just above).
    let last = unsafe { largest(positions) };
    (last as usize) * width + 4 <= len && last < 1 << 31 && first_element + u64::from(last) < 1 << 32
}

/// How many of the leading `positions` (ascending) the kernels can take
/// in a slice of `len` bytes of `width`-byte words: those whose 4-byte
/// loads stay inside it (all but the last few words'), when they `fits`;
/// else none.
pub(super) fn kernel_prefix(positions: &[u32], width: usize, len: usize, first_element: u64) -> usize {
    let cut = positions.partition_point(|&p| p as usize * width + 4 <= len);
    if fits(&positions[..cut], width, len, first_element) {
        cut
    } else {
        0
    }
}

/// The largest position the kernels may take in a slice of `len` bytes of
/// `width`-byte words whose first is element `first_element` of its tensor:
/// its 4-byte load ends inside the slice, it is a valid signed 32-bit gather
/// index, and its unit index stays below 2^32. `None` where no position
/// can (8-byte words, a slice under 4 bytes, a CPU without the kernels).
pub(super) fn position_limit(width: usize, len: usize, first_element: u64) -> Option<u32> {
    if width > 4 || len < 4 || !available() {
        return None;
    }
    let by_load = ((len - 4) / width) as u64;
    let by_unit = ((1u64 << 32) - 1).checked_sub(first_element)?;
    Some(by_load.min(by_unit).min((1 << 31) - 1) as u32)
}

/// The largest of `positions` (0 when empty).
#[target_feature(enable = "avx512f")]
unsafe fn largest(positions: &[u32]) -> u32 {
    let mut acc = _mm512_setzero_si512();
    let mut i = 0;
    while i < positions.len() {
        let m = lanes(positions.len() - i);
        acc = _mm512_max_epu32(acc, _mm512_maskz_loadu_epi32(m, positions.as_ptr().add(i).cast()));
        i += 16;
    }
    _mm512_reduce_max_epu32(acc)
}

/// How many changes ahead the apply kernel prefetches the words it will
/// load (64 before the twenty-second session: 160 measured 1.5-3 % faster
/// with the target in the caches, the same cold; the scalar loops in
/// `codec` keep their own distance).
const PREFETCH_AHEAD: usize = 160;

/// The inclusive prefix sum of the sixteen 32-bit lanes of `v` (four
/// shift-and-add steps).
///
/// # Safety
/// The CPU has AVX-512 F.
#[inline(always)]
pub(super) unsafe fn prefix_sum(v: __m512i) -> __m512i {
    let zero = _mm512_setzero_si512();
    let v = _mm512_add_epi32(v, _mm512_alignr_epi32::<15>(v, zero));
    let v = _mm512_add_epi32(v, _mm512_alignr_epi32::<14>(v, zero));
    let v = _mm512_add_epi32(v, _mm512_alignr_epi32::<12>(v, zero));
    _mm512_add_epi32(v, _mm512_alignr_epi32::<8>(v, zero))
}

/// Lanes `0..n` of a step of sixteen.
#[inline(always)]
pub(super) fn lanes(n: usize) -> __mmask16 {
    if n >= 16 {
        0xFFFF
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

/// The `W`-byte words at the sixteen positions `vp` (masked lanes read
/// nothing and give zero).
#[inline(always)]
pub(super) unsafe fn gather_words<const W: i32>(base: *const u8, m: __mmask16, vp: __m512i) -> __m512i {
    let raw = _mm512_mask_i32gather_epi32::<W>(_mm512_setzero_si512(), m, vp, base.cast());
    match W {
        1 => _mm512_and_si512(raw, _mm512_set1_epi32(0xFF)),
        2 => _mm512_and_si512(raw, _mm512_set1_epi32(0xFFFF)),
        _ => raw,
    }
}

/// Store the lanes `m` of `v` as u64s at `dst` (lane `k` at `dst + k`).
///
/// # Safety
/// `dst + k` is valid for writes for each lane `k` in `m`; the CPU has
/// AVX-512 F.
#[inline(always)]
pub(super) unsafe fn store_widened(dst: *mut u64, m: __mmask16, v: __m512i) {
    _mm512_mask_storeu_epi64(dst.cast(), m as __mmask8, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(v)));
    _mm512_mask_storeu_epi64(dst.add(8).cast(), (m >> 8) as __mmask8, _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64::<1>(v)));
}

/// Apply a chunk's sparse changes to `target` (the chunk's bytes), `first`
/// being the chunk's first element in its tensor: the change at
/// `positions[k]` has the value word (an XOR mask, or the new bits when
/// `xor` is false) whose byte `j` is `planes[j][k]`. The words are gathered
/// and hashed sixteen at a time and stored one by one (a 32-bit scatter
/// would also write the neighbouring words, which may belong to a chunk
/// another thread is writing). Each group of sixteen is checked against
/// `limit` before it is gathered (a compare per group, where a pass for the
/// largest position read them all once more): the kernel stops before the
/// first group with a position beyond it (the last few of a chunk, whose
/// 4-byte loads would leave it). Returns the digest move and how many
/// leading changes it applied.
///
/// # Safety
/// `limit` is `position_limit(W, target.len(), first)`, and `W` is 1, 2 or 4.
pub(super) unsafe fn apply_sparse<const W: i32>(
    target: &mut [u8],
    positions: &[u32],
    planes: &[&[u8]],
    xor: bool,
    first: u32,
    limit: u32,
) -> (DigestSum, usize) {
    if crate::digest::avx512::available() {
        apply_sparse_vaes::<W>(target, positions, planes, xor, first, limit)
    } else {
        apply_sparse_aesni::<W>(target, positions, planes, xor, first, limit)
    }
}

/// `apply_sparse` with the digest moves by VAES.
///
/// # Safety
/// As `apply_sparse`, and the CPU has VAES (`digest::avx512::available`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,aes,vaes")]
pub(super) unsafe fn apply_sparse_vaes<const W: i32>(
    target: &mut [u8],
    positions: &[u32],
    planes: &[&[u8]],
    xor: bool,
    first: u32,
    limit: u32,
) -> (DigestSum, usize) {
    apply_sparse_with::<W, Vaes>(target, positions, planes, xor, first, limit)
}

/// `apply_sparse` with the digest moves by AES-NI.
///
/// # Safety
/// As `apply_sparse`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,aes")]
pub(super) unsafe fn apply_sparse_aesni<const W: i32>(
    target: &mut [u8],
    positions: &[u32],
    planes: &[&[u8]],
    xor: bool,
    first: u32,
    limit: u32,
) -> (DigestSum, usize) {
    apply_sparse_with::<W, AesNi>(target, positions, planes, xor, first, limit)
}

#[inline(always)]
unsafe fn apply_sparse_with<const W: i32, H: MoveHash>(
    target: &mut [u8],
    positions: &[u32],
    planes: &[&[u8]],
    xor: bool,
    first: u32,
    limit: u32,
) -> (DigestSum, usize) {
    let w = W as usize;
    debug_assert_eq!(Some(limit), position_limit(w, target.len(), u64::from(first)));
    let n = positions.len();
    let vlimit = _mm512_set1_epi32(limit as i32);
    assert!(planes.len() >= w && planes[..w].iter().all(|p| p.len() == n), "one byte per position in each of the {w} planes");
    let base = target.as_ptr();
    let vfirst = _mm512_set1_epi32(first as i32);
    let mut acc = zero_moves();
    let mut written = [0u32; 16];
    let mut i = 0;
    while i < n {
        // The positions are irregular, which the hardware prefetcher does
        // not follow: ask for the words a few steps ahead.
        super::prefetch_words(base, w, positions, i + PREFETCH_AHEAD, 16);
        let m = lanes(n - i);
        let vp = _mm512_maskz_loadu_epi32(m, positions.as_ptr().add(i).cast());
        if _mm512_mask_cmpgt_epu32_mask(m, vp, vlimit) != 0 {
            break;
        }
        let vo = gather_words::<W>(base, m, vp);
        let mut vv = _mm512_setzero_si512();
        for (j, plane) in planes[..w].iter().enumerate() {
            let bytes = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, plane.as_ptr().add(i).cast()));
            vv = _mm512_or_si512(vv, _mm512_sllv_epi32(bytes, _mm512_set1_epi32(8 * j as i32)));
        }
        let vn = if xor { _mm512_xor_si512(vo, vv) } else { vv };
        H::add_moves(&mut acc, _mm512_add_epi32(vfirst, vp), vo, vn);
        _mm512_storeu_si512(written.as_mut_ptr().cast(), vn);
        // Every position of the group is at most `limit`, checked above.
        let out = target.as_mut_ptr();
        let store = |p: u32, v: u32| match W {
            1 => out.add(p as usize).write(v as u8),
            2 => out.add(2 * p as usize).cast::<u16>().write_unaligned(v as u16),
            _ => out.add(4 * p as usize).cast::<u32>().write_unaligned(v),
        };
        if let Ok(group) = <&[u32; 16]>::try_from(&positions[i..(i + 16).min(n)]) {
            // A whole group: sixteen stores, no count checked between them
            // (1-4 % of the multi-step free apply, paired, an Intel Xeon).
            for k in 0..16 {
                store(group[k], written[k]);
            }
        } else {
            for (&p, v) in positions[i..].iter().zip(written) {
                store(p, v);
            }
        }
        i += 16;
    }
    (moves_sum(&acc), i.min(n))
}

/// The value words of the changes at `positions` between `old` and `new`
/// (XOR masks, or the new words when `overwrite`), written to `out`, and,
/// when `TRACK`, the digest move from old to new (`first` being the chunk's
/// first element in its tensor).
///
/// # Safety
/// `fits(positions, W, old.len(), first)`, and `W` is 1, 2 or 4.
pub(super) unsafe fn gather_block<const W: i32, const TRACK: bool>(
    old: &[u8],
    new: &[u8],
    positions: &[u32],
    overwrite: bool,
    first: u32,
    out: &mut [u64],
) -> DigestSum {
    if crate::digest::avx512::available() {
        gather_block_vaes::<W, TRACK>(old, new, positions, overwrite, first, out)
    } else {
        gather_block_aesni::<W, TRACK>(old, new, positions, overwrite, first, out)
    }
}

/// `gather_block` with the digest moves by VAES.
///
/// # Safety
/// As `gather_block`, and the CPU has VAES (`digest::avx512::available`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,aes,vaes")]
pub(super) unsafe fn gather_block_vaes<const W: i32, const TRACK: bool>(
    old: &[u8],
    new: &[u8],
    positions: &[u32],
    overwrite: bool,
    first: u32,
    out: &mut [u64],
) -> DigestSum {
    gather_block_with::<W, TRACK, Vaes>(old, new, positions, overwrite, first, out)
}

/// `gather_block` with the digest moves by AES-NI.
///
/// # Safety
/// As `gather_block`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,aes")]
pub(super) unsafe fn gather_block_aesni<const W: i32, const TRACK: bool>(
    old: &[u8],
    new: &[u8],
    positions: &[u32],
    overwrite: bool,
    first: u32,
    out: &mut [u64],
) -> DigestSum {
    gather_block_with::<W, TRACK, AesNi>(old, new, positions, overwrite, first, out)
}

#[inline(always)]
unsafe fn gather_block_with<const W: i32, const TRACK: bool, H: MoveHash>(
    old: &[u8],
    new: &[u8],
    positions: &[u32],
    overwrite: bool,
    first: u32,
    out: &mut [u64],
) -> DigestSum {
    debug_assert!(fits(positions, W as usize, old.len(), u64::from(first)));
    assert!(old.len() == new.len() && out.len() == positions.len(), "old and new of one length, one output per position");
    let n = positions.len();
    let vfirst = _mm512_set1_epi32(first as i32);
    let mut acc = zero_moves();
    let mut i = 0;
    while i < n {
        let (m, vp, vo, vn) = gather_pair::<W>(old, new, positions, i);
        let v = if overwrite { vn } else { _mm512_xor_si512(vo, vn) };
        store_widened(out.as_mut_ptr().add(i), m, v);
        if TRACK {
            H::add_moves(&mut acc, _mm512_add_epi32(vfirst, vp), vo, vn);
        }
        i += 16;
    }
    moves_sum(&acc)
}

/// How the context mode reads a change (`context::ContextModel`, for
/// words of at most 4 bytes): its context is `(old >> shift) & mask`, and
/// with `float` the words are sign-magnitude (the ordinal map flips the
/// magnitude bits of negative words).
#[derive(Clone, Copy, Debug)]
pub(super) struct StepModel32 {
    pub shift: u32,
    pub mask: u32,
    pub float: bool,
}

/// `W`-byte words in the high bits of 32-bit lanes (the sign bit at bit
/// 31), where lane arithmetic wraps as `W`-byte arithmetic does, and the
/// ordinal map there (order-preserving, an involution).
#[derive(Clone, Copy)]
pub(super) struct HighWords {
    /// The shift that takes a word up: `32 - 8 W`.
    up: __m128i,
    /// The bits an ordinal flips in a negative word (its bits below the
    /// sign bit, for floats; none for integers).
    flip: __m512i,
}

impl HighWords {
    #[inline(always)]
    pub(super) unsafe fn new<const W: i32>(float: bool) -> Self {
        let below_sign = (i32::MAX >> (32 - 8 * W)) << (32 - 8 * W);
        HighWords { up: _mm_cvtsi32_si128(32 - 8 * W), flip: _mm512_set1_epi32(if float { below_sign } else { 0 }) }
    }

    /// Words (in the low bits) shifted up.
    #[inline(always)]
    pub(super) unsafe fn up(&self, words: __m512i) -> __m512i {
        _mm512_sll_epi32(words, self.up)
    }

    /// High words shifted back down, signed (`arithmetic`) or not.
    #[inline(always)]
    pub(super) unsafe fn down(&self, high: __m512i, arithmetic: bool) -> __m512i {
        if arithmetic {
            _mm512_sra_epi32(high, self.up)
        } else {
            _mm512_srl_epi32(high, self.up)
        }
    }

    /// The ordinal of each high word (or the high word of each ordinal).
    #[inline(always)]
    pub(super) unsafe fn ordinal(&self, high: __m512i) -> __m512i {
        _mm512_xor_si512(high, _mm512_and_si512(_mm512_srai_epi32::<31>(high), self.flip))
    }
}

/// The lanes, positions and old and new words of the next (up to) sixteen
/// changes from `positions[i]`.
#[inline(always)]
unsafe fn gather_pair<const W: i32>(old: &[u8], new: &[u8], positions: &[u32], i: usize) -> (__mmask16, __m512i, __m512i, __m512i) {
    let m = lanes(positions.len() - i);
    let vp = _mm512_maskz_loadu_epi32(m, positions.as_ptr().add(i).cast());
    (m, vp, gather_words::<W>(old.as_ptr(), m, vp), gather_words::<W>(new.as_ptr(), m, vp))
}

/// The context encoder's survey of its changes: for the change at
/// `positions[j]`, whose new word is its old word XOR `xors[j]`, its
/// context (`contexts[j]`), its ulp step from `old` to new (`magnitudes[j]`:
/// the step's magnitude less one; the sign: bit `j % 16` of
/// `signs[j / 16]`, set when negative, which must start clear). Sixteen
/// changes per step, their old words gathered (the XOR words, which the
/// change scan found, are read in order: a second gather, of the new
/// words, took a third of the kernel's time).
///
/// # Safety
/// `fits(positions, W, old.len(), 0)`, and `W` is 1, 2 or 4.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn survey_steps<const W: i32>(
    old: &[u8],
    xors: &[u64],
    positions: &[u32],
    model: StepModel32,
    contexts: &mut [u16],
    magnitudes: &mut [u64],
    signs: &mut [u16],
) {
    debug_assert!(fits(positions, W as usize, old.len(), 0));
    let n = positions.len();
    assert!(
        xors.len() == n && contexts.len() == n && magnitudes.len() == n && signs.len() == n.div_ceil(16),
        "one XOR word and one output per position"
    );
    let high = HighWords::new::<W>(model.float);
    let shift = _mm_cvtsi32_si128(model.shift as i32);
    let context_mask = _mm512_set1_epi32(model.mask as i32);
    let ones = _mm512_set1_epi32(1);
    let mut i = 0;
    while i < n {
        let m = lanes(n - i);
        let vp = _mm512_maskz_loadu_epi32(m, positions.as_ptr().add(i).cast());
        let vo = gather_words::<W>(old.as_ptr(), m, vp);
        let low = _mm512_cvtepi64_epi32(_mm512_maskz_loadu_epi64(m as __mmask8, xors.as_ptr().add(i).cast()));
        let high_xors = _mm512_cvtepi64_epi32(_mm512_maskz_loadu_epi64((m >> 8) as __mmask8, xors.as_ptr().add(i + 8).cast()));
        let vn = _mm512_xor_si512(vo, _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high_xors));
        // The step between the ordinals, made in the high bits.
        let step = high.down(_mm512_sub_epi32(high.ordinal(high.up(vn)), high.ordinal(high.up(vo))), true);
        let negative = _mm512_mask_cmplt_epi32_mask(m, step, _mm512_setzero_si512());
        let magnitude = _mm512_sub_epi32(_mm512_abs_epi32(step), ones);
        let context = _mm512_and_si512(_mm512_srl_epi32(vo, shift), context_mask);
        _mm512_mask_cvtepi32_storeu_epi16(contexts.as_mut_ptr().add(i).cast(), m, context);
        store_widened(magnitudes.as_mut_ptr().add(i), m, magnitude);
        signs[i / 16] = negative;
        i += 16;
    }
}

/// The byte planes of `W`-byte words held one per u64 (plane `j` holds
/// byte `j` of each), in one pass over the words, eight at a time: the
/// planes are written as they are narrowed, with no zero-filling first.
///
/// # Safety
/// `available()`, and `W` is 1, 2 or 4.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn split_planes<const W: usize>(values: &[u64]) -> Vec<Vec<u8>> {
    let n = values.len();
    let mut planes: Vec<Vec<u8>> = (0..W).map(|_| Vec::with_capacity(n)).collect();
    let full = n / 8 * 8;
    let mut i = 0;
    while i < full {
        _mm_prefetch::<_MM_HINT_T0>(values.as_ptr().wrapping_add(i + 128).cast());
        let v = _mm512_loadu_si512(values.as_ptr().add(i).cast());
        for (j, plane) in planes.iter_mut().enumerate() {
            let bytes = _mm512_cvtepi64_epi8(_mm512_srl_epi64(v, _mm_cvtsi32_si128(8 * j as i32)));
            // Safety: `i + 8 <= full <= n`, the capacity.
            _mm_storel_epi64(plane.as_mut_ptr().add(i).cast(), bytes);
        }
        i += 8;
    }
    for (j, plane) in planes.iter_mut().enumerate() {
        for (k, &v) in values[full..].iter().enumerate() {
            *plane.as_mut_ptr().add(full + k) = (v >> (8 * j)) as u8;
        }
        // Safety: all `n` bytes were just written.
        plane.set_len(n);
    }
    planes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::tests::xorshift;
    use crate::digest::DigestMoves;

    fn word(bytes: &[u8], p: u32, w: usize) -> u32 {
        let mut b = [0u8; 4];
        b[..w].copy_from_slice(&bytes[p as usize * w..][..w]);
        u32::from_le_bytes(b)
    }

    /// Ascending positions among `n` words, about one in `every`, the last
    /// one forced to `n - 1` when `to_end` (a block the kernels must refuse
    /// for words under 4 bytes).
    fn positions(next: &mut impl FnMut() -> u64, n: u32, every: u64, to_end: bool) -> Vec<u32> {
        let mut p: Vec<u32> = (0..n).filter(|_| next().is_multiple_of(every)).collect();
        if to_end && p.last() != Some(&(n - 1)) {
            p.push(n - 1);
        }
        p
    }

    /// `old` with the changes at `positions` (values `vals`, XOR masks or new
    /// words) written word by word, and their digest move.
    fn applied_word_by_word(old: &[u8], positions: &[u32], vals: &[u32], w: usize, xor: bool, first: u64) -> (Vec<u8>, DigestSum) {
        let (mut out, mut moves) = (old.to_vec(), DigestMoves::new(w));
        for (&p, &v) in positions.iter().zip(vals) {
            let o = word(&out, p, w);
            let nw = if xor { o ^ v } else { v };
            out[p as usize * w..][..w].copy_from_slice(&nw.to_le_bytes()[..w]);
            moves.word(first + u64::from(p), u64::from(o), u64::from(nw));
        }
        (out, moves.finish())
    }

    /// `apply_sparse` for words of `w` bytes, its digest moves by VAES or
    /// by AES-NI.
    ///
    /// # Safety
    /// As for `apply_sparse`, and VAES where `vaes`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn apply_kernel(w: usize, vaes: bool, target: &mut [u8], positions: &[u32], planes: &[&[u8]], xor: bool, first: u32, limit: u32) -> (DigestSum, usize) {
        unsafe {
            match (w, vaes) {
                (1, true) => apply_sparse_vaes::<1>(target, positions, planes, xor, first, limit),
                (2, true) => apply_sparse_vaes::<2>(target, positions, planes, xor, first, limit),
                (_, true) => apply_sparse_vaes::<4>(target, positions, planes, xor, first, limit),
                (1, false) => apply_sparse_aesni::<1>(target, positions, planes, xor, first, limit),
                (2, false) => apply_sparse_aesni::<2>(target, positions, planes, xor, first, limit),
                (_, false) => apply_sparse_aesni::<4>(target, positions, planes, xor, first, limit),
            }
        }
    }

    /// `gather_block` for words of `w` bytes (tracked, then untracked), its
    /// digest moves by VAES or by AES-NI.
    ///
    /// # Safety
    /// As for `gather_block`, and VAES where `vaes`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gather_kernel(w: usize, vaes: bool, o: &[u8], nw: &[u8], pos: &[u32], overwrite: bool, first: u32, got: &mut [u64]) -> (DigestSum, DigestSum) {
        macro_rules! both {
            ($f:ident, $w:literal) => {
                unsafe { ($f::<$w, true>(o, nw, pos, overwrite, first, got), $f::<$w, false>(o, nw, pos, overwrite, 0, got)) }
            };
        }
        match (w, vaes) {
            (1, true) => both!(gather_block_vaes, 1),
            (2, true) => both!(gather_block_vaes, 2),
            (_, true) => both!(gather_block_vaes, 4),
            (1, false) => both!(gather_block_aesni, 1),
            (2, false) => both!(gather_block_aesni, 2),
            (_, false) => both!(gather_block_aesni, 4),
        }
    }

    /// The digest hashes of the kernels this CPU runs: AES-NI always, VAES
    /// where it has it.
    fn hashes() -> Vec<bool> {
        if crate::digest::avx512::available() {
            vec![false, true]
        } else {
            vec![false]
        }
    }

    #[test]
    fn position_limit_keeps_every_load_and_index_in_range() {
        // 100 words of 2 bytes: a load at word 98 ends at byte 200, at 99 past it.
        if !available() {
            assert_eq!(position_limit(2, 200, 0), None);
            return;
        }
        assert_eq!(position_limit(2, 200, 0), Some(98));
        assert_eq!(position_limit(4, 200, 0), Some(49));
        assert_eq!(position_limit(1, 200, 0), Some(196));
        assert_eq!(position_limit(8, 200, 0), None, "8-byte words take the scalar loop");
        assert_eq!(position_limit(2, 3, 0), None, "no 4-byte load fits");
        assert_eq!(position_limit(2, 200, (1 << 32) - 6), Some(5), "unit indices stay below 2^32");
        assert_eq!(position_limit(2, 200, 1 << 32), None);
        assert_eq!(position_limit(1, 1 << 33, 0), Some((1 << 31) - 1), "gather indices are signed 32-bit");
    }

    /// A position out of order past the limit (which no decoder makes):
    /// the kernel stops before its group and writes nothing there.
    #[test]
    fn apply_stops_before_a_group_past_the_limit() {
        if !available() {
            return;
        }
        let mut next = xorshift(11);
        let (w, n) = (2usize, 1000u32);
        let old: Vec<u8> = (0..n as usize * w).map(|_| next() as u8).collect();
        let mut pos: Vec<u32> = (0..64).map(|k| 3 * k).collect();
        pos[37] = n + 5;
        let vals: Vec<u32> = pos.iter().map(|_| 1 + (next() as u32 & 0xFFFE)).collect();
        let planes: Vec<Vec<u8>> = (0..w).map(|j| vals.iter().map(|v| (v >> (8 * j)) as u8).collect()).collect();
        let planes: Vec<&[u8]> = planes.iter().map(|p| &p[..]).collect();
        let limit = position_limit(w, old.len(), 0).unwrap();
        for vaes in hashes() {
            let mut got = old.clone();
            let (moved, done) = unsafe { apply_kernel(w, vaes, &mut got, &pos, &planes, true, 0, limit) };
            assert_eq!(done, 32, "the groups before the one holding the bad position (vaes {vaes})");
            let (want, want_moves) = applied_word_by_word(&old, &pos[..32], &vals, w, true, 0);
            assert_eq!(got, want);
            assert_eq!(moved, want_moves);
        }
    }

    #[test]
    fn planes_split_as_the_portable_loop_does() {
        if !available() {
            return;
        }
        let mut next = crate::codec::tests::xorshift(3);
        for n in [0usize, 1, 7, 8, 9, 63, 1000] {
            let values: Vec<u64> = (0..n).map(|_| next() & 0xFFFF_FFFF).collect();
            for w in [1usize, 2, 4] {
                // Safety: `available()` was checked above.
                let fast = unsafe {
                    match w {
                        1 => split_planes::<1>(&values),
                        2 => split_planes::<2>(&values),
                        _ => split_planes::<4>(&values),
                    }
                };
                let expected: Vec<Vec<u8>> = (0..w).map(|j| values.iter().map(|&v| (v >> (8 * j)) as u8).collect()).collect();
                assert_eq!(fast, expected, "{n} words of {w} bytes");
            }
        }
    }

    #[test]
    fn fits_looks_at_the_largest_position() {
        if !available() {
            return;
        }
        // 100 words of 2 bytes: a load at word 98 ends at byte 200, at 99 past it.
        assert!(fits(&[3, 50, 98], 2, 200, 0));
        assert!(!fits(&[3, 50, 99], 2, 200, 0));
        assert!(!fits(&[99, 3, 50], 2, 200, 0), "the largest position decides, wherever it is");
        assert!(!fits(&(0..40).map(|i| if i == 17 { 99 } else { i }).collect::<Vec<u32>>(), 2, 200, 0));
        assert!(!fits(&[], 2, 200, 0));
        assert!(!fits(&[1], 8, 200, 0), "8-byte words take the scalar loop");
        assert!(!fits(&[5], 2, 200, (1 << 32) - 5), "unit indices must stay below 2^32");
        assert!(fits(&[5], 2, 200, (1 << 32) - 6));
    }

    #[test]
    fn kernels_match_word_by_word() {
        if !available() {
            return; // nothing of this module runs on this CPU
        }
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        for w in [1usize, 2, 4] {
            for (n, every, to_end) in [(1u32, 1u64, false), (17, 1, false), (40, 3, false), (300, 2, false), (300, 5, true), (5000, 30, false)] {
                let bytes: Vec<u8> = (0..n as usize * w + 3).map(|_| next() as u8).collect();
                let (old, new_side) = (bytes.clone(), bytes.iter().map(|b| b ^ (next() as u8 & 0x11)).collect::<Vec<u8>>());
                let len = n as usize * w;
                let pos = positions(&mut next, n, every, to_end);
                let first = next() % (1 << 30);
                let fit = fits(&pos, w, len, first);
                assert_eq!(fit, !pos.is_empty() && (*pos.last().unwrap() as usize) * w + 4 <= len, "w {w} n {n}");
                let Some(limit) = position_limit(w, len, first) else {
                    assert!(!fit && len < 4, "w {w} n {n}: no kernel for a slice under 4 bytes");
                    continue;
                };
                for (vaes, xor) in hashes().into_iter().flat_map(|v| [(v, true), (v, false)]) {
                    // Apply: the kernel against word-by-word stores and
                    // moves of the changes it says it applied, which are all
                    // but the groups from the first with a position past
                    // `limit` (the last few, whose 4-byte loads would leave
                    // the slice).
                    let vals: Vec<u32> = pos.iter().map(|_| next() as u32 & ((1u64 << (8 * w)) - 1) as u32).collect();
                    let stop = pos.iter().position(|&p| p > limit).map_or(pos.len(), |k| k / 16 * 16);
                    let (want, want_moves) = applied_word_by_word(&old[..len], &pos[..stop], &vals, w, xor, first);
                    let planes: Vec<Vec<u8>> = (0..w).map(|j| vals.iter().map(|v| (v >> (8 * j)) as u8).collect()).collect();
                    let planes: Vec<&[u8]> = planes.iter().map(|p| &p[..]).collect();
                    let mut got = old[..len].to_vec();
                    let (moved, done) = unsafe { apply_kernel(w, vaes, &mut got, &pos, &planes, xor, first as u32, limit) };
                    assert_eq!(done, stop, "apply: w {w} n {n} xor {xor} vaes {vaes}: changes applied");
                    assert_eq!(done == pos.len(), fit, "the kernel takes every change exactly where they all fit");
                    assert_eq!(got, want, "apply: w {w} n {n} xor {xor} vaes {vaes}");
                    assert_eq!(moved, want_moves, "apply digest move: w {w} n {n} xor {xor} vaes {vaes}");
                    if !fit {
                        continue;
                    }
                    // Gather: value words and the digest move from old to new.
                    let overwrite = !xor;
                    let (o, nw) = (&old[..len], &new_side[..len]);
                    let mut want_moves = DigestMoves::new(w);
                    let want: Vec<u64> = pos
                        .iter()
                        .map(|&p| {
                            let (x, y) = (word(o, p, w), word(nw, p, w));
                            want_moves.word(first + u64::from(p), u64::from(x), u64::from(y));
                            u64::from(if overwrite { y } else { x ^ y })
                        })
                        .collect();
                    let mut got = vec![u64::MAX; pos.len()];
                    let (tracked, untracked) = unsafe { gather_kernel(w, vaes, o, nw, &pos, overwrite, first as u32, &mut got) };
                    assert_eq!(got, want, "gather: w {w} n {n} overwrite {overwrite} vaes {vaes}");
                    assert_eq!(tracked, want_moves.finish(), "gather digest move: w {w} n {n} vaes {vaes}");
                    assert_eq!(untracked, DigestSum::ZERO);
                }
            }
        }
    }
}
