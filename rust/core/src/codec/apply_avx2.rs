//! The sparse apply for x86 CPUs with AVX2 but without AVX-512 (where
//! `gather_x86` does not run): eight changes per step. Their old words are
//! loaded and their new words stored one by one (a gather is slow on these
//! CPUs, and a scatter would also write neighbouring words that may belong
//! to a chunk another thread is writing); in between, their value words
//! are built from the byte planes and their digest move is hashed in
//! registers. The apply is bound by the target's cache misses, and hashing
//! each step's words right after their loads lets that work run while the
//! next steps' loads are outstanding, where hashing a block of words after
//! all its loads (the portable loop's way) adds its time to theirs.
//!
//! The portable loop in `codec` is the reference the tests hold this to.

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use crate::digest::avx2::{moves_sum, zero_moves, AesNi, MoveHash, Vaes};
use crate::digest::DigestSum;

/// How many changes ahead the kernel prefetches the words it will load.
const PREFETCH_AHEAD: usize = 64;

/// Apply the leading changes of a chunk, eight at a time, to `target`
/// (the chunk's bytes; `first` is its first element in its tensor): the
/// change at `positions[k]` has the value word (an XOR mask, or the new
/// bits when `xor` is false) whose byte `j` is `planes[j][k]`. Returns the
/// digest move of the changes it applied and how many it applied (all
/// but the last `positions.len() % 8`, the caller's).
///
/// # Safety
/// The CPU has AVX2 and AES-NI (`codec::avx2_available`); `W` is 1, 2 or 4; every unit index
/// `first + positions[k]` is below 2^32. (Positions outside `target` panic,
/// as the portable loop's do.)
pub(super) unsafe fn apply_sparse<const W: usize>(
    target: &mut [u8],
    positions: &[u32],
    planes: &[&[u8]],
    xor: bool,
    first: u32,
) -> (DigestSum, usize) {
    if crate::digest::avx2::vaes_available() {
        apply_sparse_vaes::<W>(target, positions, planes, xor, first)
    } else {
        apply_sparse_aesni::<W>(target, positions, planes, xor, first)
    }
}

/// `apply_sparse` with the digest moves hashed by AES-NI.
///
/// # Safety
/// As `apply_sparse`.
#[target_feature(enable = "avx2,aes")]
pub(super) unsafe fn apply_sparse_aesni<const W: usize>(
    target: &mut [u8],
    positions: &[u32],
    planes: &[&[u8]],
    xor: bool,
    first: u32,
) -> (DigestSum, usize) {
    apply_sparse_with::<W, AesNi>(target, positions, planes, xor, first)
}

/// `apply_sparse` with the digest moves hashed by VAES.
///
/// # Safety
/// As `apply_sparse`, and the CPU has VAES (`digest::avx2::vaes_available`).
#[target_feature(enable = "avx2,aes,vaes")]
pub(super) unsafe fn apply_sparse_vaes<const W: usize>(
    target: &mut [u8],
    positions: &[u32],
    planes: &[&[u8]],
    xor: bool,
    first: u32,
) -> (DigestSum, usize) {
    apply_sparse_with::<W, Vaes>(target, positions, planes, xor, first)
}

#[inline(always)]
unsafe fn apply_sparse_with<const W: usize, H: MoveHash>(
    target: &mut [u8],
    positions: &[u32],
    planes: &[&[u8]],
    xor: bool,
    first: u32,
) -> (DigestSum, usize) {
    debug_assert!(matches!(W, 1 | 2 | 4));
    let n = positions.len() / 8 * 8;
    assert!(planes.len() >= W && planes[..W].iter().all(|p| p.len() >= n), "one byte per position in each of the {W} planes");
    let out = target.as_mut_ptr();
    let base = out.cast_const();
    let vfirst = _mm256_set1_epi32(first as i32);
    // The last unit index a change may have.
    let units = target.len() / W;
    assert!(n == 0 || units > 0, "{n} changes in a chunk of no whole word");
    let vlast = _mm256_set1_epi32(units.min(1 << 32).saturating_sub(1) as u32 as i32);
    let mut acc = zero_moves();
    let (mut old, mut new) = ([0u32; 8], [0u32; 8]);
    let mut i = 0;
    while i < n {
        // The positions are irregular, which the hardware prefetcher does
        // not follow: ask for the words a few steps ahead.
        super::prefetch_words(base, W, positions, i + PREFETCH_AHEAD, 8);
        let group = &positions[i..i + 8];
        // One check for the group's eight positions, where one per load
        // and store cost the sparse apply of the training pairs 4-8 % of
        // its time (paired `ab_timing`, a Zen 3 host).
        let vp = _mm256_loadu_si256(group.as_ptr().cast());
        assert!(
            _mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_min_epu32(vp, vlast), vp)) == -1,
            "a change at a position past its chunk's {units} words"
        );
        for (o, &p) in old.iter_mut().zip(group) {
            // Safety: `p < units`, checked above.
            let at = base.add(p as usize * W);
            *o = match W {
                1 => u32::from(*at),
                2 => u32::from(at.cast::<u16>().read_unaligned()),
                _ => at.cast::<u32>().read_unaligned(),
            };
        }
        let vo = _mm256_loadu_si256(old.as_ptr().cast());
        let mut vv = _mm256_setzero_si256();
        for (j, plane) in planes[..W].iter().enumerate() {
            // Eight bytes of the plane (`i + 8 <= n <= plane.len()`).
            let bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(plane.as_ptr().add(i).cast()));
            vv = _mm256_or_si256(vv, _mm256_sll_epi32(bytes, _mm_cvtsi32_si128(8 * j as i32)));
        }
        let vn = if xor { _mm256_xor_si256(vo, vv) } else { vv };
        _mm256_storeu_si256(new.as_mut_ptr().cast(), vn);
        for (&v, &p) in new.iter().zip(group) {
            // Safety: `p < units`, checked above.
            let at = out.add(p as usize * W);
            match W {
                1 => *at = v as u8,
                2 => at.cast::<u16>().write_unaligned(v as u16),
                _ => at.cast::<u32>().write_unaligned(v),
            }
        }
        H::add_moves(&mut acc, _mm256_add_epi32(vfirst, vp), vo, vn);
        i += 8;
    }
    (moves_sum(&acc), n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::tests::xorshift;
    use crate::digest::DigestMoves;

    /// A change past the chunk's last word panics before the kernel
    /// touches anything, in a group's first lane or its last, and in a
    /// chunk with no whole word.
    #[test]
    fn changes_past_the_chunk_panic() {
        if !crate::codec::avx2_available() {
            return; // nothing of this module runs on this CPU
        }
        let planes = [[0xFFu8; 8]; 2];
        let planes: Vec<&[u8]> = planes.iter().map(|p| &p[..]).collect();
        let past_end: Vec<u32> = (9..17).collect(); // 16 is one past 16 words
        let wild_first: Vec<u32> = [u32::MAX].into_iter().chain(1..8).collect();
        let any: Vec<u32> = (0..8).collect();
        for (len, positions) in [(32usize, past_end), (32, wild_first), (1, any)] {
            let mut target = vec![0u8; len];
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // Safety: `avx2_available()` was checked above.
                unsafe { apply_sparse::<2>(&mut target, &positions, &planes, true, 0) }
            }));
            assert!(result.is_err(), "len {len}, positions {positions:?}: no panic");
            assert!(target.iter().all(|&b| b == 0), "len {len}: the target was written before the check");
        }
    }

    /// The kernel, finished by word-by-word stores, writes what the
    /// word-by-word loop writes and moves the digest as it does, for every
    /// word width it takes, both change kinds, positions up to the chunk's
    /// last word, and chunks that start late in their tensor.
    #[test]
    fn kernel_matches_word_by_word() {
        if !crate::codec::avx2_available() {
            return; // nothing of this module runs on this CPU
        }
        let mut next = xorshift(0x0a99_1a75_0000_0007);
        let mut applied = 0;
        for w in [1usize, 2, 4] {
            for (n, every) in [(1u32, 1u64), (8, 1), (17, 1), (40, 3), (300, 2), (300, 5), (5000, 30)] {
                let len = n as usize * w;
                let old: Vec<u8> = (0..len).map(|_| next() as u8).collect();
                let mut pos: Vec<u32> = (0..n).filter(|_| next().is_multiple_of(every)).collect();
                if pos.last() != Some(&(n - 1)) {
                    pos.push(n - 1);
                }
                let first = [0u64, next() % (1 << 30), (1u64 << 32) - u64::from(n)][(next() % 3) as usize];
                for xor in [true, false] {
                    let vals: Vec<u32> = pos.iter().map(|_| next() as u32 & ((1u64 << (8 * w)) - 1) as u32).collect();
                    let word = |bytes: &[u8], p: u32| {
                        let mut b = [0u8; 4];
                        b[..w].copy_from_slice(&bytes[p as usize * w..][..w]);
                        u32::from_le_bytes(b)
                    };
                    let (mut want, mut want_moves) = (old.clone(), DigestMoves::new(w));
                    for (&p, &v) in pos.iter().zip(&vals) {
                        let o = word(&want, p);
                        let nw = if xor { o ^ v } else { v };
                        want[p as usize * w..][..w].copy_from_slice(&nw.to_le_bytes()[..w]);
                        want_moves.word(first + u64::from(p), u64::from(o), u64::from(nw));
                    }
                    let planes: Vec<Vec<u8>> = (0..w).map(|j| vals.iter().map(|v| (v >> (8 * j)) as u8).collect()).collect();
                    let planes: Vec<&[u8]> = planes.iter().map(|p| &p[..]).collect();
                    let want_move = want_moves.finish();
                    for vaes in [false, true] {
                        if vaes && !crate::digest::avx2::vaes_available() {
                            continue;
                        }
                        let mut got = old.clone();
                        // Safety: `available()` was checked above (and VAES
                        // for that build); every unit index is below 2^32.
                        let (moved, done) = unsafe {
                            match (w, vaes) {
                                (1, false) => apply_sparse_aesni::<1>(&mut got, &pos, &planes, xor, first as u32),
                                (2, false) => apply_sparse_aesni::<2>(&mut got, &pos, &planes, xor, first as u32),
                                (_, false) => apply_sparse_aesni::<4>(&mut got, &pos, &planes, xor, first as u32),
                                (1, true) => apply_sparse_vaes::<1>(&mut got, &pos, &planes, xor, first as u32),
                                (2, true) => apply_sparse_vaes::<2>(&mut got, &pos, &planes, xor, first as u32),
                                (_, true) => apply_sparse_vaes::<4>(&mut got, &pos, &planes, xor, first as u32),
                            }
                        };
                        assert_eq!(done, pos.len() / 8 * 8);
                        let mut moves = DigestMoves::new(w);
                        moves.add(moved);
                        for (k, &p) in pos.iter().enumerate().skip(done) {
                            let o = word(&got, p);
                            let nw = if xor { o ^ vals[k] } else { vals[k] };
                            got[p as usize * w..][..w].copy_from_slice(&nw.to_le_bytes()[..w]);
                            moves.word(first + u64::from(p), u64::from(o), u64::from(nw));
                        }
                        assert_eq!(got, want, "w {w} n {n} xor {xor} vaes {vaes}");
                        assert_eq!(moves.finish(), want_move, "digest move: w {w} n {n} xor {xor} vaes {vaes}");
                        applied += done;
                    }
                }
            }
        }
        assert!(applied > 1000, "{applied}");
    }
}
