//! The change scan: which words of a chunk differ between old and new,
//! their value words (XOR masks or new bits) and, for the diff, how the
//! tensor digest moves there. Run by stripes that stay in L2, with an
//! AVX-512 and an AVX2 kernel for the positions (runtime dispatch) and a
//! portable one that the tests hold them to; the changed words are then
//! gathered (`gather`). Where the CPU has AVX-512 VBMI2 (or else AVX2), one
//! kernel does both in one pass (`scan_gather_avx512`, `scan_gather_avx2`)
//! and the others scan only a stripe's last partial block.

use super::{check_width, ChangeKind, SparseChanges, Word};
use crate::digest::{DigestMoves, DigestSum};
use crate::error::{Error, Result};

/// Bit `i` set when lane `i` (of width `T::BYTES`) of the XOR word `d` is
/// nonzero: the high bit of each lane is set where any bit of the lane is,
/// then the lane bits are gathered by one multiply.
#[inline(always)]
fn changed_lanes<T: Word>(d: u64) -> u64 {
    match T::BYTES {
        1 => {
            let low = 0x7f7f_7f7f_7f7f_7f7fu64;
            let hi = (d | ((d & low).wrapping_add(low))) & !low;
            ((hi >> 7).wrapping_mul(0x0102_0408_1020_4080)) >> 56
        }
        2 => {
            let low = 0x7fff_7fff_7fff_7fffu64;
            let hi = (d | ((d & low).wrapping_add(low))) & !low;
            ((hi >> 15).wrapping_mul((1 << 45) | (1 << 30) | (1 << 15) | 1) >> 45) & 0xf
        }
        4 => {
            let low = 0x7fff_ffff_7fff_ffffu64;
            let hi = (d | ((d & low).wrapping_add(low))) & !low;
            ((hi >> 31) & 1) | ((hi >> 62) & 2)
        }
        _ => u64::from(d != 0),
    }
}

/// Scan 64 words at a time: a branch-free compare builds a bitmask of the
/// changed words, whose set bits are then visited; unchanged blocks cost one
/// compare of their bytes. Appends the changed positions.
pub(super) fn scan<T: Word>(old: &[u8], new: &[u8], base: u32, positions: &mut Vec<u32>) {
    const BLOCK: usize = 64;
    let w = T::BYTES;
    let n = old.len() / w;
    let blocks = n / BLOCK;
    let visit = |first: usize, mut mask: u64, positions: &mut Vec<u32>| {
        while mask != 0 {
            positions.push(base + (first + mask.trailing_zeros() as usize) as u32);
            mask &= mask - 1;
        }
    };
    for blk in 0..blocks {
        let range = blk * BLOCK * w..(blk + 1) * BLOCK * w;
        let (a, b) = (&old[range.clone()], &new[range]);
        if a == b {
            continue;
        }
        // 8 bytes at a time (SWAR): 8/w lane bits per u64 of XOR.
        let lanes = 8 / w;
        let mut mask = 0u64;
        for (k, (x, y)) in a.chunks_exact(8).zip(b.chunks_exact(8)).enumerate() {
            let d = u64::from_le_bytes(x.try_into().expect("8")) ^ u64::from_le_bytes(y.try_into().expect("8"));
            mask |= changed_lanes::<T>(d) << (k * lanes);
        }
        visit(blk * BLOCK, mask, positions);
    }
    let tail = blocks * BLOCK;
    let (a, b) = (&old[tail * w..], &new[tail * w..]);
    let mut mask = 0u64;
    for (i, (x, y)) in a.chunks_exact(w).zip(b.chunks_exact(w)).enumerate() {
        mask |= u64::from(T::load(x) != T::load(y)) << i;
    }
    visit(tail, mask, positions);
}

/// Changes gathered (and their digest move hashed) per block.
const GATHER_BLOCK: usize = 256;

/// Append the value words at `positions` (XOR masks or new bits) and, when
/// `tracked_from` gives the chunk's first element, account for how the
/// tensor digest moves from `old` to `new` there.
fn gather<T: Word>(
    old: &[u8],
    new: &[u8],
    positions: &[u32],
    kind: ChangeKind,
    tracked_from: Option<u64>,
    values: &mut Vec<u64>,
    moves: &mut DigestMoves,
) {
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    let w = T::BYTES;
    let overwrite = kind == ChangeKind::Overwrite;
    values.reserve(positions.len());
    // Each block's words are gathered on the stack and appended: no
    // zero-filling of `values` first.
    let mut words = [0u64; GATHER_BLOCK];
    for block in positions.chunks(GATHER_BLOCK) {
        let out = &mut words[..block.len()];
        #[cfg(target_arch = "x86_64")]
        if super::gather_x86::fits(block, w, old.len(), tracked_from.unwrap_or(0)) {
            use super::gather_x86::gather_block;
            let first = tracked_from.unwrap_or(0) as u32;
            // Safety: `fits` (just above) checked that the CPU has AVX-512 F,
            // that `w` is 1, 2 or 4 and that the block's loads and lanes fit.
            #[allow(unsafe_code)]
            let moved = unsafe {
                match (w, tracked_from.is_some()) {
                    (1, true) => gather_block::<1, true>(old, new, block, overwrite, first, out),
                    (2, true) => gather_block::<2, true>(old, new, block, overwrite, first, out),
                    (_, true) => gather_block::<4, true>(old, new, block, overwrite, first, out),
                    (1, false) => gather_block::<1, false>(old, new, block, overwrite, first, out),
                    (2, false) => gather_block::<2, false>(old, new, block, overwrite, first, out),
                    (_, false) => gather_block::<4, false>(old, new, block, overwrite, first, out),
                }
            };
            moves.add(moved);
            values.extend_from_slice(out);
            continue;
        }
        gather_scalar::<T>(old, new, block, overwrite, tracked_from, out, moves);
        values.extend_from_slice(out);
    }
}

/// `gather` for one block, word by word (the reference of the AVX-512
/// kernel, and what runs where it does not).
fn gather_scalar<T: Word>(
    old: &[u8],
    new: &[u8],
    block: &[u32],
    overwrite: bool,
    tracked_from: Option<u64>,
    out: &mut [u64],
    moves: &mut DigestMoves,
) {
    let w = T::BYTES;
    let Some(first) = tracked_from else {
        for (v, &p) in out.iter_mut().zip(block) {
            let at = p as usize * w;
            let (x, y) = (T::load(&old[at..at + w]), T::load(&new[at..at + w]));
            *v = if overwrite { y } else { x ^ y };
        }
        return;
    };
    if w == 8 {
        for (v, &p) in out.iter_mut().zip(block) {
            let at = p as usize * w;
            let (x, y) = (T::load(&old[at..at + w]), T::load(&new[at..at + w]));
            *v = if overwrite { y } else { x ^ y };
            moves.word(first + u64::from(p), x, y);
        }
        return;
    }
    debug_assert!(block.len() <= GATHER_BLOCK);
    let mut old_units = [0u32; GATHER_BLOCK];
    let mut new_units = [0u32; GATHER_BLOCK];
    for (k, (v, &p)) in out.iter_mut().zip(block).enumerate() {
        let at = p as usize * w;
        let (x, y) = (T::load(&old[at..at + w]), T::load(&new[at..at + w]));
        *v = if overwrite { y } else { x ^ y };
        (old_units[k], new_units[k]) = (x as u32, y as u32);
    }
    moves.words_at(first, block, &old_units[..block.len()], &new_units[..block.len()]);
}

/// How far ahead of the compare the SIMD scans ask for the old and new
/// bytes. A refit's inputs are not in the caches (on this VM a 20 MB pair
/// read back to back takes 0.8-0.9 ms, after a 10 ms pause 1.9-2.0 ms),
/// and the hardware prefetcher alone, which stops at page boundaries, left
/// the cold scan well under the memory's bandwidth. Measured on fp32m
/// 10->11 with the caches evicted before each repeat (`profile_diff` with
/// `COLD=1`, median of eight rounds' fastest): the whole diff 4.15 ms
/// without, 3.47 ms at 1 KiB, 3.47 at 2 KiB, 3.64 at 4 KiB, 3.52 at 8 KiB
/// ahead; at 2 KiB the scan alone 2.86 -> 2.40 ms cold, 1.56 -> 1.42 ms
/// with the inputs in the caches.
#[cfg(target_arch = "x86_64")]
const SCAN_PREFETCH_BYTES: usize = 2048;

/// Ask for the cache lines `SCAN_PREFETCH_BYTES` past the `len` bytes at
/// offset `at` of both sides (a hint: lines past the end are never read).
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[inline(always)]
fn prefetch_ahead(pa: *const u8, pb: *const u8, at: usize, len: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let mut line = at + SCAN_PREFETCH_BYTES;
    while line < at + SCAN_PREFETCH_BYTES + len {
        // Safety: a prefetch is a hint that neither faults nor reads the
        // address into the program; the pointers are only computed, with
        // wrapping arithmetic.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(pa.wrapping_add(line).cast());
            _mm_prefetch::<_MM_HINT_T0>(pb.wrapping_add(line).cast());
        }
        line += 64;
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(super) mod scan_avx2 {
    //! The change scan with AVX2: 32 bytes of each side per compare; the
    //! byte mask of differing words is visited bit by bit.
    use super::super::Word;
    use std::arch::x86_64::*;

    /// Append the positions of the words that differ.
    #[target_feature(enable = "avx2,popcnt")]
    pub(in crate::codec) unsafe fn scan(old: &[u8], new: &[u8], width: usize, base: u32, positions: &mut Vec<u32>) {
        match width {
            1 => scan_words::<u8>(old, new, base, positions),
            2 => scan_words::<u16>(old, new, base, positions),
            4 => scan_words::<u32>(old, new, base, positions),
            _ => scan_words::<u64>(old, new, base, positions),
        }
    }

    /// Bit `k` set when word `k` of the 64 words at `pa`/`pb` differs.
    /// (No closures: they would not inherit the AVX2 target feature.)
    #[inline(always)]
    pub(super) unsafe fn block_mask(pa: *const u8, pb: *const u8, width: usize) -> u64 {
        macro_rules! eq {
            ($k:expr, $cmp:ident) => {
                $cmp(_mm256_loadu_si256(pa.add(32 * $k).cast()), _mm256_loadu_si256(pb.add(32 * $k).cast()))
            };
        }
        let mut same = 0u64;
        match width {
            1 => {
                same = (_mm256_movemask_epi8(eq!(0, _mm256_cmpeq_epi8)) as u32 as u64)
                    | ((_mm256_movemask_epi8(eq!(1, _mm256_cmpeq_epi8)) as u32 as u64) << 32);
            }
            2 => {
                // Saturating packs keep -1 / 0 per word; the permute fixes the lane order.
                let lo = _mm256_permute4x64_epi64(
                    _mm256_packs_epi16(eq!(0, _mm256_cmpeq_epi16), eq!(1, _mm256_cmpeq_epi16)),
                    0b11_01_10_00,
                );
                let hi = _mm256_permute4x64_epi64(
                    _mm256_packs_epi16(eq!(2, _mm256_cmpeq_epi16), eq!(3, _mm256_cmpeq_epi16)),
                    0b11_01_10_00,
                );
                same = (_mm256_movemask_epi8(lo) as u32 as u64) | ((_mm256_movemask_epi8(hi) as u32 as u64) << 32);
            }
            4 => {
                let mut k = 0;
                while k < 8 {
                    same |= (_mm256_movemask_ps(_mm256_castsi256_ps(eq!(k, _mm256_cmpeq_epi32))) as u64) << (8 * k);
                    k += 1;
                }
            }
            _ => {
                let mut k = 0;
                while k < 16 {
                    same |= (_mm256_movemask_pd(_mm256_castsi256_pd(eq!(k, _mm256_cmpeq_epi64))) as u64) << (4 * k);
                    k += 1;
                }
            }
        }
        !same
    }

    #[inline(always)]
    unsafe fn scan_words<T: Word>(old: &[u8], new: &[u8], first: u32, positions: &mut Vec<u32>) {
        let width = T::BYTES;
        let n = old.len() / width;
        let blocks = n / 64;
        let (pa, pb) = (old.as_ptr(), new.as_ptr());
        let mut len = positions.len();
        for blk in 0..blocks {
            super::prefetch_ahead(pa, pb, blk * 64 * width, 64 * width);
            let mut m = block_mask(pa.add(blk * 64 * width), pb.add(blk * 64 * width), width);
            if m == 0 {
                continue;
            }
            let cnt = m.count_ones() as usize;
            if positions.capacity() < len + 64 {
                positions.reserve(len + 64 + (n - blk * 64) / 16 - positions.len());
            }
            // Branch-free: write eight candidates, keep `cnt` of them.
            let dst = positions.as_mut_ptr().add(len);
            let base = first + (blk * 64) as u32;
            for j in 0..8 {
                *dst.add(j) = base + m.trailing_zeros();
                m &= m.wrapping_sub(1);
            }
            for j in 8..cnt {
                *dst.add(j) = base + m.trailing_zeros();
                m &= m.wrapping_sub(1);
            }
            len += cnt;
            positions.set_len(len);
        }
        for i in blocks * 64..n {
            if old[i * width..(i + 1) * width] != new[i * width..(i + 1) * width] {
                positions.push(first + i as u32);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(super) mod scan_avx512 {
    //! The change scan with AVX-512: compare masks of 64 words, whose
    //! positions are compacted by `vpcompressd`, 16 at a time, branch-free.
    use std::arch::x86_64::*;

    /// Bit `k` set when word `k` of the 64 words at `pa`/`pb` differs.
    #[inline(always)]
    unsafe fn block_mask(pa: *const u8, pb: *const u8, width: usize) -> u64 {
        macro_rules! ne {
            ($k:expr, $cmp:ident) => {
                $cmp(_mm512_loadu_si512(pa.add(64 * $k).cast()), _mm512_loadu_si512(pb.add(64 * $k).cast()))
            };
        }
        match width {
            1 => ne!(0, _mm512_cmpneq_epi8_mask),
            2 => u64::from(ne!(0, _mm512_cmpneq_epi16_mask)) | (u64::from(ne!(1, _mm512_cmpneq_epi16_mask)) << 32),
            4 => {
                u64::from(ne!(0, _mm512_cmpneq_epi32_mask))
                    | (u64::from(ne!(1, _mm512_cmpneq_epi32_mask)) << 16)
                    | (u64::from(ne!(2, _mm512_cmpneq_epi32_mask)) << 32)
                    | (u64::from(ne!(3, _mm512_cmpneq_epi32_mask)) << 48)
            }
            _ => {
                let mut m = 0u64;
                let mut k = 0;
                while k < 8 {
                    m |= u64::from(ne!(k, _mm512_cmpneq_epi64_mask)) << (8 * k);
                    k += 1;
                }
                m
            }
        }
    }

    /// Append the positions (plus `first`) of the words that differ.
    #[target_feature(enable = "avx512f,avx512bw,popcnt")]
    pub(in crate::codec) unsafe fn scan(old: &[u8], new: &[u8], width: usize, first: u32, positions: &mut Vec<u32>) {
        let n = old.len() / width;
        let blocks = n / 64;
        let (pa, pb) = (old.as_ptr(), new.as_ptr());
        let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let mut len = positions.len();
        for blk in 0..blocks {
            super::prefetch_ahead(pa, pb, blk * 64 * width, 64 * width);
            let m = block_mask(pa.add(blk * 64 * width), pb.add(blk * 64 * width), width);
            if m == 0 {
                continue;
            }
            if positions.capacity() < len + 64 {
                positions.reserve(64 + (n - blk * 64) / 16);
            }
            // Four groups of 16: compress the changed lanes' indices to the
            // front and store all 16 lanes; the next store starts where the
            // kept ones end (capacity for 64 more was ensured above).
            let base = _mm512_add_epi32(iota, _mm512_set1_epi32((first + (blk * 64) as u32) as i32));
            let dst = positions.as_mut_ptr();
            for g in 0..4 {
                let part = (m >> (16 * g)) as u16;
                let idx = _mm512_add_epi32(base, _mm512_set1_epi32(16 * g));
                _mm512_storeu_si512(dst.add(len).cast(), _mm512_maskz_compress_epi32(part, idx));
                len += part.count_ones() as usize;
            }
            positions.set_len(len);
        }
        for i in blocks * 64..n {
            if old[i * width..(i + 1) * width] != new[i * width..(i + 1) * width] {
                positions.push(first + i as u32);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(super) mod scan_gather_avx512 {
    //! The change scan and the gather in one pass, for words of 1, 2 or 4
    //! bytes (AVX-512 with VBMI2): each 64-word block's changed lanes are
    //! compressed out of the very registers that were compared, so no
    //! change is loaded a second time by a gather (`gather_x86::gather_block`,
    //! which AVX-512 CPUs without VBMI2 run): their offsets by one byte compress, their
    //! old and new words (untracked: their value words only) to a stage
    //! that becomes value words and digest moves from contiguous loads, a
    //! few groups of sixteen at a time. Measured on the scan
    //! micro-benchmark (`scan_micro`, 4 MiB of bf16) against the scan then
    //! gather: 0.50 -> 0.25 ms at 10 % changed, 0.31 -> 0.21 ms at 1 %.
    use super::super::gather_x86::{lanes, store_widened};
    use crate::digest::avx512::{add_moves, moves_sum, zero_moves};
    use crate::digest::DigestSum;
    use super::Planes;
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;
    use std::sync::OnceLock;

    /// Changes staged before their whole groups of sixteen become value
    /// words and digest moves (the rest, fewer than sixteen, stay staged).
    /// Untracked, `staged_old` holds the value words and `staged_new` is
    /// not used. Small, so that the hashing runs among the blocks' loads
    /// and overlaps their cache misses, where 1024 changes at a time held
    /// several thousand instructions with no load in flight. Measured on
    /// an Intel Xeon host (`ab_timing` with `STAGE=diff`, paired, 64 /
    /// 1024): the diff with cold caches (`COLD=1`) 0.88 at fp32m 10->15
    /// and synthetic 5 %, 0.92 at 11->12; warm 0.94-0.99 (32: about the
    /// same, 128 and 256: between).
    const STAGE: usize = 64;
    const _: () = assert!(STAGE >= 64 && STAGE.is_multiple_of(16));
    /// Room for the stage plus one block's changes and a full store past them.
    const STAGE_BYTES: usize = (STAGE + 64) * 4 + 64;

    /// Whether this CPU runs the kernel (AVX-512 F, BW, VL, VBMI, VBMI2 and
    /// VAES).
    pub(in crate::codec) fn available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            super::super::gather_x86::available()
                && crate::digest::avx512::available()
                && is_x86_feature_detected!("avx512vbmi")
                && is_x86_feature_detected!("avx512vbmi2")
                && is_x86_feature_detected!("popcnt")
        })
    }

    /// Scan the whole 64-word blocks of `old` / `new` (one stripe of a
    /// chunk, whose first word is the chunk's word `base`): append the
    /// positions (plus `base`) of the words that differ and their value
    /// words (XOR masks, or the new words when `overwrite`), and, when
    /// `TRACK`, return the digest move from old to new there (`first` being
    /// the chunk's first element in its tensor). Returns how many words it
    /// scanned (the caller scans the rest).
    ///
    /// # Safety
    /// The CPU has what `available` checks; `W` is 1, 2 or 4; every unit
    /// index `first + base + k` for `k` below the stripe's word count is
    /// below 2^32.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vbmi2,popcnt,vaes,aes")]
    pub(in crate::codec) unsafe fn scan_and_gather<const W: usize, const TRACK: bool>(
        old: &[u8],
        new: &[u8],
        base: u32,
        overwrite: bool,
        first: u32,
        positions: &mut Vec<u32>,
        values: &mut impl StageSink,
    ) -> (usize, DigestSum) {
        debug_assert_eq!(old.len(), new.len());
        let n = old.len() / W;
        let blocks = n / 64;
        if blocks == 0 {
            return (0, DigestSum::ZERO);
        }
        let (pa, pb) = (old.as_ptr(), new.as_ptr());
        let iota_bytes = _mm512_set_epi8(
            63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42, 41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 31,
            30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0,
        );
        // Not zeroed (8.6 KiB per call, which a checkpoint of many small
        // tensors would pay per chunk): only stored lanes are ever loaded.
        let mut stage_old = MaybeUninit::<[u8; STAGE_BYTES]>::uninit();
        let mut stage_new = MaybeUninit::<[u8; STAGE_BYTES]>::uninit();
        let (staged_old, staged_new) = (stage_old.as_mut_ptr().cast::<u8>(), stage_new.as_mut_ptr().cast::<u8>());
        let mut staged = 0usize;
        let mut len = positions.len();
        let mut acc = zero_moves();
        let vfirst = _mm512_set1_epi32(first as i32);
        for blk in 0..blocks {
            super::prefetch_ahead(pa, pb, blk * 64 * W, 64 * W);
            let (a, b) = (pa.add(blk * 64 * W), pb.add(blk * 64 * W));
            // The changed lanes of each of the W registers of the block.
            let mut parts = [0u64; 4];
            let mut m = 0u64;
            for (k, part) in parts.iter_mut().enumerate().take(W) {
                let (x, y) = (_mm512_loadu_si512(a.add(64 * k).cast()), _mm512_loadu_si512(b.add(64 * k).cast()));
                *part = match W {
                    1 => _mm512_cmpneq_epi8_mask(x, y),
                    2 => u64::from(_mm512_cmpneq_epi16_mask(x, y)),
                    _ => u64::from(_mm512_cmpneq_epi32_mask(x, y)),
                };
                m |= *part << (k * 64 / W);
            }
            if m == 0 {
                continue;
            }
            if positions.capacity() < len + 64 {
                positions.reserve(64 + (n - blk * 64) / 16);
            }
            // The changed words' offsets in the block, compressed to the
            // front of one byte vector, widened sixteen at a time.
            let offsets = _mm512_maskz_compress_epi8(m, iota_bytes);
            let cnt = m.count_ones() as usize;
            let vbase = _mm512_set1_epi32((base + (blk * 64) as u32) as i32);
            let dst = positions.as_mut_ptr().add(len);
            _mm512_storeu_si512(dst.cast(), _mm512_add_epi32(vbase, _mm512_cvtepu8_epi32(_mm512_castsi512_si128(offsets))));
            if cnt > 16 {
                let rest = [
                    _mm512_extracti32x4_epi32::<1>(offsets),
                    _mm512_extracti32x4_epi32::<2>(offsets),
                    _mm512_extracti32x4_epi32::<3>(offsets),
                ];
                for (j, part) in rest.into_iter().enumerate().take(cnt.div_ceil(16) - 1) {
                    _mm512_storeu_si512(dst.add(16 * (j + 1)).cast(), _mm512_add_epi32(vbase, _mm512_cvtepu8_epi32(part)));
                }
            }
            len += cnt;
            positions.set_len(len);
            // The same lanes' old and new words (or, untracked, their value
            // words only), compressed to the stage: each store writes 64
            // bytes, the next starts where the kept words end.
            for (k, &part) in parts.iter().enumerate().take(W) {
                let (x, y) = (_mm512_loadu_si512(a.add(64 * k).cast()), _mm512_loadu_si512(b.add(64 * k).cast()));
                let (so, sn) = (staged_old.add(staged * W), staged_new.add(staged * W));
                let first_side = if TRACK { x } else if overwrite { y } else { _mm512_xor_si512(x, y) };
                _mm512_storeu_si512(so.cast(), compress::<W>(part, first_side));
                if TRACK {
                    _mm512_storeu_si512(sn.cast(), compress::<W>(part, y));
                }
                staged += part.count_ones() as usize;
            }
            if staged >= STAGE {
                // Whole groups only: no lane of the hash is wasted.
                let whole = staged / 16 * 16;
                let from = len - staged;
                flush::<W, TRACK>(staged_old, staged_new, whole, &positions[from..from + whole], overwrite, vfirst, values, &mut acc);
                // The rest (under 16 words, under 64 bytes, only those
                // loaded) to the front; `whole >= STAGE >= 64` words, so
                // the two do not overlap.
                staged -= whole;
                let rest = (1u64 << (staged * W)) - 1;
                _mm512_mask_storeu_epi8(staged_old.cast(), rest, _mm512_maskz_loadu_epi8(rest, staged_old.add(whole * W).cast()));
                if TRACK {
                    _mm512_mask_storeu_epi8(staged_new.cast(), rest, _mm512_maskz_loadu_epi8(rest, staged_new.add(whole * W).cast()));
                }
            }
        }
        flush::<W, TRACK>(staged_old, staged_new, staged, &positions[len - staged..len], overwrite, vfirst, values, &mut acc);
        (blocks * 64, moves_sum(&acc))
    }

    /// The lanes `mask` of `v` (words of `W` bytes) packed to the front.
    #[inline(always)]
    unsafe fn compress<const W: usize>(mask: u64, v: __m512i) -> __m512i {
        match W {
            1 => _mm512_maskz_compress_epi8(mask, v),
            2 => _mm512_maskz_compress_epi16(mask as u32, v),
            _ => _mm512_maskz_compress_epi32(mask as u16, v),
        }
    }

    /// Sixteen staged words from `p` (`m` the lanes kept), widened to u32.
    #[inline(always)]
    unsafe fn load_units<const W: usize>(p: *const u8, m: __mmask16) -> __m512i {
        match W {
            1 => _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p.cast())),
            2 => _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p.cast())),
            _ => _mm512_maskz_loadu_epi32(m, p.cast()),
        }
    }

    /// The value words of `n` staged changes appended to `values`, their
    /// digest moves added to `acc`.
    ///
    /// # Safety
    /// The first `n` words of `W` bytes at `staged_old` (and, when `TRACK`,
    /// at `staged_new`) were stored; the CPU has what `available` checks.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn flush<const W: usize, const TRACK: bool>(
        staged_old: *const u8,
        staged_new: *const u8,
        n: usize,
        positions: &[u32],
        overwrite: bool,
        vfirst: __m512i,
        values: &mut impl StageSink,
        acc: &mut crate::digest::avx512::MoveAcc,
    ) {
        debug_assert_eq!(positions.len(), n);
        values.reserve(n);
        let mut i = 0;
        while i < n {
            let m = lanes(n - i);
            let vo = load_units::<W>(staged_old.add(i * W), m);
            if !TRACK {
                // Untracked, the stage holds the value words themselves.
                values.store16::<W>(i, m, vo);
                i += 16;
                continue;
            }
            let vn = load_units::<W>(staged_new.add(i * W), m);
            let v = if overwrite { vn } else { _mm512_xor_si512(vo, vn) };
            values.store16::<W>(i, m, v);
            let vp = _mm512_maskz_loadu_epi32(m, positions.as_ptr().add(i).cast());
            add_moves(acc, _mm512_add_epi32(vfirst, vp), vo, vn);
            i += 16;
        }
        values.commit(n);
    }

    /// Where the kernel's value words go: whole words (`Vec<u64>`) or byte
    /// planes (`Planes`, what the free mode's encoder codes).
    pub(in crate::codec) trait StageSink {
        /// Room for `n` more values.
        fn reserve(&mut self, n: usize);
        /// Values `i..i + 16` past the end, lanes `m` of `v` (words of `W`
        /// bytes in u32 lanes).
        ///
        /// # Safety
        /// `reserve` made room for them; the CPU has AVX-512 F, BW, VL and
        /// VBMI.
        unsafe fn store16<const W: usize>(&mut self, i: usize, m: __mmask16, v: __m512i);
        /// The `n` values stored since `reserve` become part of the output.
        ///
        /// # Safety
        /// All `n` were stored.
        unsafe fn commit(&mut self, n: usize);
    }

    impl StageSink for Vec<u64> {
        fn reserve(&mut self, n: usize) {
            Vec::reserve(self, n);
        }
        #[inline(always)]
        unsafe fn store16<const W: usize>(&mut self, i: usize, m: __mmask16, v: __m512i) {
            store_widened(self.as_mut_ptr().add(self.len() + i), m, v);
        }
        unsafe fn commit(&mut self, n: usize) {
            self.set_len(self.len() + n);
        }
    }

    impl StageSink for Planes<'_> {
        fn reserve(&mut self, n: usize) {
            for plane in self.0.iter_mut() {
                plane.reserve(n);
            }
        }
        #[inline(always)]
        unsafe fn store16<const W: usize>(&mut self, i: usize, m: __mmask16, v: __m512i) {
            // Byte j of each lane to the j-th 16 bytes, one permute (where a
            // shift and a narrowing per plane took three operations on the
            // port the compresses use: the free diff 0.992-1.000 of the
            // time, paired, fp32m 10->15, 12->15, 10->11).
            let index = _mm512_set_epi8(
                63, 59, 55, 51, 47, 43, 39, 35, 31, 27, 23, 19, 15, 11, 7, 3, 62, 58, 54, 50, 46, 42, 38, 34, 30, 26, 22, 18, 14, 10, 6, 2,
                61, 57, 53, 49, 45, 41, 37, 33, 29, 25, 21, 17, 13, 9, 5, 1, 60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0,
            );
            let bytes = _mm512_permutexvar_epi8(index, v);
            let at = |plane: &mut Vec<u8>| plane.as_mut_ptr().add(plane.len() + i).cast();
            _mm_mask_storeu_epi8(at(&mut self.0[0]), m, _mm512_castsi512_si128(bytes));
            if W >= 2 {
                _mm_mask_storeu_epi8(at(&mut self.0[1]), m, _mm512_extracti32x4_epi32::<1>(bytes));
            }
            if W == 4 {
                _mm_mask_storeu_epi8(at(&mut self.0[2]), m, _mm512_extracti32x4_epi32::<2>(bytes));
                _mm_mask_storeu_epi8(at(&mut self.0[3]), m, _mm512_extracti32x4_epi32::<3>(bytes));
            }
        }
        unsafe fn commit(&mut self, n: usize) {
            for plane in self.0.iter_mut() {
                plane.set_len(plane.len() + n);
            }
        }
    }
}

/// Byte planes: plane `j` holds byte `j` of each value word (what the
/// free mode's encoder codes), filled by the one-pass kernels.
#[cfg(target_arch = "x86_64")]
pub(super) struct Planes<'a>(pub &'a mut [Vec<u8>]);

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(super) mod scan_gather_avx2 {
    //! The change scan and the gather in one pass for CPUs with AVX2 but
    //! not `scan_gather_avx512`'s AVX-512 VBMI2, for words of 1, 2 or 4
    //! bytes: `scan_avx2`'s compare masks; the changed words' positions and
    //! their old and new words (untracked: their value words only) are
    //! staged as each block's set bits are visited, one scalar load per side
    //! from the lines the compare just read (AVX2 has no compress), and the
    //! stage becomes value words and digest moves eight at a time every
    //! `STAGE` changes. Without it a stripe's changes were loaded a second
    //! time by the gather, into whole words that were then split into
    //! planes in a pass of their own. Measured on a Zen 3 host (`ab_timing`
    //! with `STAGE=diff`, paired ratios one pass / two passes, before
    //! `EAGER` went from eight to four): the diff of fp32m 10->15
    //! 0.81-0.84, 12->15 0.87-0.88, 10->11 0.87-0.90.
    use super::Planes;
    use crate::digest::avx2::{moves_sum, zero_moves, AesNi, MoveAcc, MoveHash, Vaes};
    use crate::digest::DigestSum;
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;
    use std::sync::OnceLock;

    /// Changes staged before they become value words (2 x 4 KiB of units).
    const STAGE: usize = 1024;
    /// Room for the stage plus one block's changes and a vector past them.
    const STAGE_UNITS: usize = STAGE + 64 + 8;
    /// Changes of a block staged without a branch: each costs two loads and
    /// two stores even where the block holds fewer, and a block of 64 words
    /// holds about two at 3 % change. Measured on a Zen 3 host (`ab_timing`
    /// with `STAGE=diff`, paired): four against eight, the diff of fp32m
    /// 10->11 0.86, bf16 10->11 0.87, fp32m 12->15 0.95, 10->15 0.97; two
    /// against four 1.05 at 10->11, the same at 6-10 %.
    const EAGER: usize = 4;

    /// Whether this CPU runs the kernel (AVX2, POPCNT, and AES-NI for the
    /// digest moves).
    pub(in crate::codec) fn available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("popcnt") && is_x86_feature_detected!("aes"))
    }

    /// `scan_gather_avx512::scan_and_gather` with AVX2: scan the whole
    /// 64-word blocks of `old` / `new` (one stripe of a chunk, whose first
    /// word is the chunk's word `base`), append the positions (plus `base`)
    /// of the words that differ and their value words (XOR masks, or the
    /// new words when `overwrite`) and, when `TRACK`, return the digest move
    /// from old to new there (`first` being the chunk's first element in
    /// its tensor). Returns how many words it scanned (the caller scans the
    /// rest).
    ///
    /// # Safety
    /// The CPU has what `available` checks; `W` is 1, 2 or 4; every unit
    /// index `first + base + k` for `k` below the stripe's word count is
    /// below 2^32.
    pub(in crate::codec) unsafe fn scan_and_gather<const W: usize, const TRACK: bool>(
        old: &[u8],
        new: &[u8],
        base: u32,
        overwrite: bool,
        first: u32,
        positions: &mut Vec<u32>,
        values: &mut impl Sink8,
    ) -> (usize, DigestSum) {
        if crate::digest::avx2::vaes_available() {
            scan_and_gather_vaes::<W, TRACK>(old, new, base, overwrite, first, positions, values)
        } else {
            scan_and_gather_aesni::<W, TRACK>(old, new, base, overwrite, first, positions, values)
        }
    }

    /// `scan_and_gather` with the digest moves hashed by AES-NI.
    ///
    /// # Safety
    /// As `scan_and_gather`.
    #[target_feature(enable = "avx2,popcnt,aes")]
    pub(in crate::codec) unsafe fn scan_and_gather_aesni<const W: usize, const TRACK: bool>(
        old: &[u8],
        new: &[u8],
        base: u32,
        overwrite: bool,
        first: u32,
        positions: &mut Vec<u32>,
        values: &mut impl Sink8,
    ) -> (usize, DigestSum) {
        scan_and_gather_with::<W, TRACK, AesNi>(old, new, base, overwrite, first, positions, values)
    }

    /// `scan_and_gather` with the digest moves hashed by VAES.
    ///
    /// # Safety
    /// As `scan_and_gather`, and the CPU has VAES
    /// (`digest::avx2::vaes_available`).
    #[target_feature(enable = "avx2,popcnt,aes,vaes")]
    pub(in crate::codec) unsafe fn scan_and_gather_vaes<const W: usize, const TRACK: bool>(
        old: &[u8],
        new: &[u8],
        base: u32,
        overwrite: bool,
        first: u32,
        positions: &mut Vec<u32>,
        values: &mut impl Sink8,
    ) -> (usize, DigestSum) {
        scan_and_gather_with::<W, TRACK, Vaes>(old, new, base, overwrite, first, positions, values)
    }

    #[inline(always)]
    unsafe fn scan_and_gather_with<const W: usize, const TRACK: bool, H: MoveHash>(
        old: &[u8],
        new: &[u8],
        base: u32,
        overwrite: bool,
        first: u32,
        positions: &mut Vec<u32>,
        values: &mut impl Sink8,
    ) -> (usize, DigestSum) {
        debug_assert_eq!(old.len(), new.len());
        let n = old.len() / W;
        let blocks = n / 64;
        if blocks == 0 {
            return (0, DigestSum::ZERO);
        }
        let (pa, pb) = (old.as_ptr(), new.as_ptr());
        // Not zeroed (8.6 KiB per call): `flush` loads only stored units.
        let mut stage_old = MaybeUninit::<[u32; STAGE_UNITS]>::uninit();
        let mut stage_new = MaybeUninit::<[u32; STAGE_UNITS]>::uninit();
        let (staged_old, staged_new) = (stage_old.as_mut_ptr().cast::<u32>(), stage_new.as_mut_ptr().cast::<u32>());
        let mut staged = 0usize;
        let mut len = positions.len();
        let mut acc = zero_moves();
        let vfirst = _mm256_set1_epi32(first as i32);
        for blk in 0..blocks {
            super::prefetch_ahead(pa, pb, blk * 64 * W, 64 * W);
            let (a, b) = (pa.add(blk * 64 * W), pb.add(blk * 64 * W));
            let mut m = super::scan_avx2::block_mask(a, b, W);
            if m == 0 {
                continue;
            }
            if positions.capacity() < len + 64 {
                positions.reserve(64 + (n - blk * 64) / 16);
            }
            let cnt = m.count_ones() as usize;
            let dst = positions.as_mut_ptr().add(len);
            let (so, sn) = (staged_old.add(staged), staged_new.add(staged));
            let at = base + (blk * 64) as u32;
            // Branch-free for the first `EAGER` (past the last change the
            // offset wraps to the block's first word, whose slots are
            // written but not kept), then one by one.
            for j in 0..EAGER {
                let t = (m.trailing_zeros() & 63) as usize;
                *dst.add(j) = at + t as u32;
                stage::<W, TRACK>(a, b, t, overwrite, so.add(j), sn.add(j));
                m &= m.wrapping_sub(1);
            }
            for j in EAGER..cnt {
                let t = m.trailing_zeros() as usize;
                *dst.add(j) = at + t as u32;
                stage::<W, TRACK>(a, b, t, overwrite, so.add(j), sn.add(j));
                m &= m.wrapping_sub(1);
            }
            len += cnt;
            positions.set_len(len);
            staged += cnt;
            if staged >= STAGE {
                flush::<W, TRACK, H>(staged_old, staged_new, staged, &positions[len - staged..len], overwrite, vfirst, values, &mut acc);
                staged = 0;
            }
        }
        flush::<W, TRACK, H>(staged_old, staged_new, staged, &positions[len - staged..len], overwrite, vfirst, values, &mut acc);
        (blocks * 64, moves_sum(&acc))
    }

    /// Stage word `t` of the block at `a` / `b`: its old and new units
    /// (untracked: its value word only).
    #[inline(always)]
    unsafe fn stage<const W: usize, const TRACK: bool>(a: *const u8, b: *const u8, t: usize, overwrite: bool, so: *mut u32, sn: *mut u32) {
        let load = |p: *const u8| -> u32 {
            match W {
                1 => u32::from(*p.add(t)),
                2 => u32::from(p.add(2 * t).cast::<u16>().read_unaligned()),
                _ => p.add(4 * t).cast::<u32>().read_unaligned(),
            }
        };
        let (x, y) = (load(a), load(b));
        if TRACK {
            *so = x;
            *sn = y;
        } else {
            *so = if overwrite { y } else { x ^ y };
        }
    }

    /// The value words of `n` staged changes appended to `values`, their
    /// digest moves added to `acc`.
    ///
    /// # Safety
    /// The first `n` units at `staged_old` (and, when `TRACK`, at
    /// `staged_new`) were stored, with room for eight more; the CPU has
    /// AVX2.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn flush<const W: usize, const TRACK: bool, H: MoveHash>(
        staged_old: *mut u32,
        staged_new: *mut u32,
        n: usize,
        positions: &[u32],
        overwrite: bool,
        vfirst: __m256i,
        values: &mut impl Sink8,
        acc: &mut MoveAcc,
    ) {
        debug_assert_eq!(positions.len(), n);
        // The last group's missing lanes: equal old and new units, so their
        // digest moves are zero whatever their index.
        let whole = n / 8 * 8;
        for k in n..whole + 8 {
            *staged_old.add(k) = 0;
            *staged_new.add(k) = 0;
        }
        let mut tail = [0u32; 8];
        tail[..n - whole].copy_from_slice(&positions[whole..]);
        values.reserve(whole + 8);
        let mut i = 0;
        while i < n {
            let vo = _mm256_loadu_si256(staged_old.add(i).cast());
            if !TRACK {
                // Untracked, the stage holds the value words themselves.
                values.store8::<W>(i, vo);
                i += 8;
                continue;
            }
            let vn = _mm256_loadu_si256(staged_new.add(i).cast());
            let v = if overwrite { vn } else { _mm256_xor_si256(vo, vn) };
            values.store8::<W>(i, v);
            let at = if i < whole { positions.as_ptr().add(i) } else { tail.as_ptr() };
            let vp = _mm256_loadu_si256(at.cast());
            H::add_moves(acc, _mm256_add_epi32(vfirst, vp), vo, vn);
            i += 8;
        }
        values.commit(n);
    }

    /// Where the kernel's value words go: whole words (`Vec<u64>`) or byte
    /// planes (`Planes`).
    pub(in crate::codec) trait Sink8 {
        /// Room for `n` more values.
        fn reserve(&mut self, n: usize);
        /// Values `i..i + 8` past the end, from the words of `W` bytes in
        /// the u32 lanes of `v`.
        ///
        /// # Safety
        /// `reserve` made room for them; the CPU has AVX2.
        unsafe fn store8<const W: usize>(&mut self, i: usize, v: __m256i);
        /// The `n` values stored since `reserve` become part of the output.
        ///
        /// # Safety
        /// All `n` were stored.
        unsafe fn commit(&mut self, n: usize);
    }

    impl Sink8 for Vec<u64> {
        fn reserve(&mut self, n: usize) {
            Vec::reserve(self, n);
        }
        #[inline(always)]
        unsafe fn store8<const W: usize>(&mut self, i: usize, v: __m256i) {
            let p = self.as_mut_ptr().add(self.len() + i);
            _mm256_storeu_si256(p.cast(), _mm256_cvtepu32_epi64(_mm256_castsi256_si128(v)));
            _mm256_storeu_si256(p.add(4).cast(), _mm256_cvtepu32_epi64(_mm256_extracti128_si256::<1>(v)));
        }
        unsafe fn commit(&mut self, n: usize) {
            self.set_len(self.len() + n);
        }
    }

    impl Sink8 for Planes<'_> {
        fn reserve(&mut self, n: usize) {
            for plane in self.0.iter_mut() {
                plane.reserve(n);
            }
        }
        #[inline(always)]
        unsafe fn store8<const W: usize>(&mut self, i: usize, v: __m256i) {
            // Byte `j` of each lane to the front of its 128-bit half, the
            // two halves' four bytes side by side, eight bytes stored.
            let join = _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
            for (j, plane) in self.0[..W].iter_mut().enumerate() {
                let j = j as i8;
                let pick = _mm256_setr_epi8(
                    j, 4 + j, 8 + j, 12 + j, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                    j, 4 + j, 8 + j, 12 + j, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                );
                let bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v, pick), join);
                _mm_storel_epi64(plane.as_mut_ptr().add(plane.len() + i).cast(), _mm256_castsi256_si128(bytes));
            }
        }
        unsafe fn commit(&mut self, n: usize) {
            for plane in self.0.iter_mut() {
                plane.set_len(plane.len() + n);
            }
        }
    }
}

/// Find the words that differ between `old` and `new` (same length, a
/// multiple of `width`).
pub fn find_changes(old: &[u8], new: &[u8], width: usize, kind: ChangeKind) -> Result<SparseChanges> {
    Ok(find(old, new, width, kind, None)?.0)
}

/// Find the words that differ and, in the same pass over them, how the
/// tensor digest moves from `old` to `new` (the chunk's first element in its
/// tensor is `first_element`).
pub fn find_changes_tracked(
    old: &[u8],
    new: &[u8],
    width: usize,
    kind: ChangeKind,
    first_element: u64,
) -> Result<(SparseChanges, DigestSum)> {
    find(old, new, width, kind, Some(first_element))
}

/// Append the positions (plus `base`) of the words that differ.
fn scan_positions(old: &[u8], new: &[u8], width: usize, base: u32, positions: &mut Vec<u32>) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("popcnt")
    {
        // Safety: the CPU supports AVX-512 F and BW and POPCNT (checked just above).
        #[allow(unsafe_code)]
        unsafe {
            scan_avx512::scan(old, new, width, base, positions)
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("popcnt") {
        // Safety: the CPU supports AVX2 and POPCNT (checked just above).
        #[allow(unsafe_code)]
        unsafe {
            scan_avx2::scan(old, new, width, base, positions)
        };
        return;
    }
    match width {
        1 => scan::<u8>(old, new, base, positions),
        2 => scan::<u16>(old, new, base, positions),
        4 => scan::<u32>(old, new, base, positions),
        _ => scan::<u64>(old, new, base, positions),
    }
}

/// Whether a one-pass kernel (`scan_gather_avx512`, else
/// `scan_gather_avx2`) runs on a chunk of `n` words of `width` bytes (unit
/// indices from `tracked_from`, or 0): words of 1, 2 or 4 bytes, unit
/// indices below 2^32, a CPU with what one of them needs.
fn one_pass_runs(width: usize, tracked_from: Option<u64>, n: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        width <= 4
            && tracked_from.unwrap_or(0) + n as u64 <= 1 << 32
            && (scan_gather_avx512::available() || scan_gather_avx2::available())
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (width, tracked_from, n);
        false
    }
}

/// Run a one-pass kernel on one stripe where the CPU and the words allow
/// (words of 1, 2 or 4 bytes; unit indices below 2^32 in a chunk of `n`
/// words): returns how many of the stripe's words it scanned (0 where
/// none ran).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn scan_and_gather(
    old: &[u8],
    new: &[u8],
    width: usize,
    base: u32,
    kind: ChangeKind,
    tracked_from: Option<u64>,
    n: usize,
    positions: &mut Vec<u32>,
    values: &mut (impl scan_gather_avx512::StageSink + scan_gather_avx2::Sink8),
    moves: &mut DigestMoves,
) -> usize {
    if !one_pass_runs(width, tracked_from, n) {
        return 0;
    }
    let first = tracked_from.unwrap_or(0);
    let overwrite = kind == ChangeKind::Overwrite;
    let f = first as u32;
    macro_rules! dispatch {
        ($kernel:ident) => {
            match (width, tracked_from.is_some()) {
                (1, true) => $kernel::scan_and_gather::<1, true>(old, new, base, overwrite, f, positions, values),
                (2, true) => $kernel::scan_and_gather::<2, true>(old, new, base, overwrite, f, positions, values),
                (_, true) => $kernel::scan_and_gather::<4, true>(old, new, base, overwrite, f, positions, values),
                (1, false) => $kernel::scan_and_gather::<1, false>(old, new, base, overwrite, f, positions, values),
                (2, false) => $kernel::scan_and_gather::<2, false>(old, new, base, overwrite, f, positions, values),
                (_, false) => $kernel::scan_and_gather::<4, false>(old, new, base, overwrite, f, positions, values),
            }
        };
    }
    // Safety: the CPU has what the kernel needs (`available`: one of the
    // two, checked by `one_pass_runs`), the width is 1, 2 or 4 and every
    // unit index `first + position` is below 2^32 (checked just above).
    #[allow(unsafe_code)]
    let (scanned, moved) = unsafe {
        if scan_gather_avx512::available() {
            dispatch!(scan_gather_avx512)
        } else {
            dispatch!(scan_gather_avx2)
        }
    };
    moves.add(moved);
    scanned
}

fn find(old: &[u8], new: &[u8], width: usize, kind: ChangeKind, tracked_from: Option<u64>) -> Result<(SparseChanges, DigestSum)> {
    let mut values = Vec::new();
    let (positions, moved) = find_into(old, new, width, kind, tracked_from, &mut values)?;
    Ok((SparseChanges { positions, values }, moved))
}

/// `find_changes` / `find_changes_tracked` (`tracked_from` gives the
/// chunk's first element) with the value words split into byte planes
/// (plane `j` holds byte `j` of each): what the free mode's encoder codes,
/// made without whole words in between where the one-pass kernel runs.
pub(super) fn find_split(old: &[u8], new: &[u8], width: usize, kind: ChangeKind, tracked_from: Option<u64>) -> Result<(Vec<u32>, Vec<Vec<u8>>, DigestSum)> {
    if !one_pass_runs(width, tracked_from, old.len() / width.max(1)) {
        // Whole words, then one split (with its own vector kernels).
        let (changes, moved) = find(old, new, width, kind, tracked_from)?;
        return Ok((changes.positions, super::planes_of(&changes.values, width), moved));
    }
    let mut planes = SplitValues(vec![Vec::new(); width]);
    let (positions, moved) = find_into(old, new, width, kind, tracked_from, &mut planes)?;
    Ok((positions, planes.0, moved))
}

/// Where `find_into` puts the value words it finds.
trait FoundValues {
    fn reserve(&mut self, n: usize);
    /// Append the value words at `positions` (and their digest moves).
    #[allow(clippy::too_many_arguments)]
    fn gather(&mut self, old: &[u8], new: &[u8], positions: &[u32], width: usize, kind: ChangeKind, tracked_from: Option<u64>, moves: &mut DigestMoves);
    /// `scan_and_gather` into this output (0 where it does not run).
    #[allow(clippy::too_many_arguments)]
    fn scan_and_gather(&mut self, old: &[u8], new: &[u8], width: usize, base: u32, kind: ChangeKind, tracked_from: Option<u64>, n: usize, positions: &mut Vec<u32>, moves: &mut DigestMoves) -> usize;
    fn shrink_to_fit(&mut self);
}

impl FoundValues for Vec<u64> {
    fn reserve(&mut self, n: usize) {
        Vec::reserve(self, n);
    }
    fn gather(&mut self, old: &[u8], new: &[u8], at: &[u32], width: usize, kind: ChangeKind, tracked_from: Option<u64>, moves: &mut DigestMoves) {
        match width {
            1 => gather::<u8>(old, new, at, kind, tracked_from, self, moves),
            2 => gather::<u16>(old, new, at, kind, tracked_from, self, moves),
            4 => gather::<u32>(old, new, at, kind, tracked_from, self, moves),
            _ => gather::<u64>(old, new, at, kind, tracked_from, self, moves),
        }
    }
    #[allow(unused_variables)]
    fn scan_and_gather(&mut self, old: &[u8], new: &[u8], width: usize, base: u32, kind: ChangeKind, tracked_from: Option<u64>, n: usize, positions: &mut Vec<u32>, moves: &mut DigestMoves) -> usize {
        #[cfg(target_arch = "x86_64")]
        return scan_and_gather(old, new, width, base, kind, tracked_from, n, positions, self, moves);
        #[cfg(not(target_arch = "x86_64"))]
        0
    }
    fn shrink_to_fit(&mut self) {
        Vec::shrink_to_fit(self);
    }
}

/// Value words as byte planes (`find_split`).
struct SplitValues(Vec<Vec<u8>>);

impl FoundValues for SplitValues {
    fn reserve(&mut self, n: usize) {
        for plane in &mut self.0 {
            plane.reserve(n);
        }
    }
    fn gather(&mut self, old: &[u8], new: &[u8], at: &[u32], width: usize, kind: ChangeKind, tracked_from: Option<u64>, moves: &mut DigestMoves) {
        // Whole words first (the few of a chunk's last partial block: this
        // output is only used where the one-pass kernel runs), then split.
        let mut words = Vec::new();
        FoundValues::gather(&mut words, old, new, at, width, kind, tracked_from, moves);
        for (j, plane) in self.0.iter_mut().enumerate() {
            plane.extend(words.iter().map(|&v| (v >> (8 * j)) as u8));
        }
    }
    #[allow(unused_variables)]
    fn scan_and_gather(&mut self, old: &[u8], new: &[u8], width: usize, base: u32, kind: ChangeKind, tracked_from: Option<u64>, n: usize, positions: &mut Vec<u32>, moves: &mut DigestMoves) -> usize {
        #[cfg(target_arch = "x86_64")]
        return scan_and_gather(old, new, width, base, kind, tracked_from, n, positions, &mut Planes(&mut self.0), moves);
        #[cfg(not(target_arch = "x86_64"))]
        0
    }
    fn shrink_to_fit(&mut self) {
        for plane in &mut self.0 {
            plane.shrink_to_fit();
        }
    }
}

fn find_into(old: &[u8], new: &[u8], width: usize, kind: ChangeKind, tracked_from: Option<u64>, values: &mut impl FoundValues) -> Result<(Vec<u32>, DigestSum)> {
    check_width(width)?;
    if old.len() != new.len() || !old.len().is_multiple_of(width) {
        return Err(Error::Invalid(format!(
            "old and new must have equal lengths that are multiples of {width}: got {} and {}",
            old.len(),
            new.len()
        )));
    }
    if old.len() / width > u32::MAX as usize {
        return Err(Error::Invalid(format!("a chunk holds at most {} words", u32::MAX)));
    }
    // Stripes whose old and new bytes stay in L2: the gather of the changed
    // words reads what the scan just read, and the scan streams long enough
    // for the hardware prefetcher (measured on the training pairs: 128 KiB
    // beat 16 KiB by 12 %, 64 and 256 KiB by 3-5 %).
    const STRIPE_BYTES: usize = 128 << 10;
    let stripe = STRIPE_BYTES / width;
    let n = old.len() / width;
    // A diff keeps the found changes of many chunks between its passes, so
    // they should hold about what was found: room for the first stripe's
    // worth at up to an eighth changed (the fp32-master pairs change up to
    // a tenth: at a sixteenth, growing the first stripe's lists was about
    // 1 % of the free diff at fp32m 10->15), then for the whole chunk at
    // the first stripe's rate (changes are spread fairly evenly over a
    // tensor) plus a quarter, then doubling.
    let mut positions = Vec::with_capacity((stripe.min(n) / 8) + 64);
    values.reserve(positions.capacity());
    let mut moves = DigestMoves::new(width);
    for start in (0..n).step_by(stripe) {
        let bytes = start * width..(start + stripe).min(n) * width;
        let (a, b) = (&old[bytes.clone()], &new[bytes]);
        // The one-pass kernel takes the stripe's whole blocks where it
        // runs; the scan then the gather take the rest.
        let mut found = positions.len();
        let scanned = values.scan_and_gather(a, b, width, start as u32, kind, tracked_from, n, &mut positions, &mut moves);
        if scanned > 0 {
            found = positions.len();
        }
        scan_positions(&a[scanned * width..], &b[scanned * width..], width, (start + scanned) as u32, &mut positions);
        if start == 0 && n > stripe {
            let expected = positions.len() * n.div_ceil(stripe) * 5 / 4 + 64;
            positions.reserve(expected.saturating_sub(positions.len()));
            values.reserve(expected);
        }
        values.gather(old, new, &positions[found..], width, kind, tracked_from, &mut moves);
    }
    let moved = moves.finish();
    if positions.capacity() > 2 * positions.len() + 64 {
        // Far fewer changes than reserved: keep only them (a small copy).
        positions.shrink_to_fit();
        values.shrink_to_fit();
    }
    Ok((positions, moved))
}
