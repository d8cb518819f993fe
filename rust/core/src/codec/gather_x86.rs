//! AVX-512 kernels for the words at a block of change positions, used by
//! the sparse apply and by the encoder's gather for words of 1, 2 or 4
//! bytes. Sixteen positions per step: one `vpgatherdd` loads their words
//! (each lane reads 4 bytes at the word's offset and keeps the word's own
//! bytes), and the digest move `h(i, new) - h(i, old)` is added in the same
//! registers, so no per-change arrays of old and new words are written and
//! read back for the hash. The last partial step runs masked.
//!
//! A block is taken only where every 4-byte load stays inside the slice it
//! reads and every index fits the kernels' 32-bit lanes (`fits`); the scalar
//! loops in `codec` handle the rest (8-byte words, the few positions at a
//! chunk's very end) and are the reference the tests hold these to.

#![allow(unsafe_code)]

use std::arch::x86_64::*;
use std::sync::OnceLock;

use crate::digest::avx512::{add_moves, moves_sum, zero_moves};
use crate::digest::DigestSum;

/// Whether this CPU runs the gather kernels (AVX-512 F).
pub(super) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| is_x86_feature_detected!("avx512f"))
}

/// Whether a block of ascending `positions` in a slice of `len` bytes of
/// `width`-byte words, the first at element `first_element` of its tensor,
/// can go through the kernels: each lane's 4-byte load ends inside the
/// slice, positions are valid signed 32-bit gather indices, and the unit
/// indices `first_element + position` stay below 2^32.
pub(super) fn fits(positions: &[u32], width: usize, len: usize, first_element: u64) -> bool {
    let Some(&last) = positions.last() else { return false };
    width <= 4 && (last as usize) * width + 4 <= len && last < 1 << 31 && first_element + u64::from(last) < 1 << 32
}

/// How many changes ahead the apply prefetches the words it will load.
const PREFETCH_AHEAD: usize = 64;

/// Lanes `0..n` of a step of sixteen.
#[inline(always)]
fn lanes(n: usize) -> __mmask16 {
    if n >= 16 {
        0xFFFF
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

/// The `W`-byte words at the sixteen positions `vp` (masked lanes read
/// nothing and give zero).
#[inline(always)]
unsafe fn gather_words<const W: i32>(base: *const u8, m: __mmask16, vp: __m512i) -> __m512i {
    let raw = _mm512_mask_i32gather_epi32::<W>(_mm512_setzero_si512(), m, vp, base.cast());
    match W {
        1 => _mm512_and_si512(raw, _mm512_set1_epi32(0xFF)),
        2 => _mm512_and_si512(raw, _mm512_set1_epi32(0xFFFF)),
        _ => raw,
    }
}

/// Apply one block of changes to `target` (the chunk's bytes), `first` being
/// the chunk's first element in its tensor. On entry `values[k]` is the
/// value word of the change at `positions[k]` (an XOR mask, or the new bits
/// when `xor` is false); it is replaced by the word written. Returns the
/// digest move.
///
/// # Safety
/// The CPU has AVX-512 F (`available`), `W` is 1, 2 or 4, `values` is as
/// long as `positions`, and `fits(positions, W, target.len(), first)`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn apply_block<const W: i32>(
    target: &mut [u8],
    positions: &[u32],
    values: &mut [u32],
    xor: bool,
    first: u32,
) -> DigestSum {
    debug_assert!(fits(positions, W as usize, target.len(), u64::from(first)) && values.len() == positions.len());
    let n = positions.len();
    let base = target.as_ptr();
    let vfirst = _mm512_set1_epi32(first as i32);
    let mut acc = zero_moves();
    let mut i = 0;
    while i < n {
        // The positions are irregular, which the hardware prefetcher does
        // not follow: ask for the words a few steps ahead.
        for &p in positions.get(i + PREFETCH_AHEAD..).unwrap_or_default().iter().take(16) {
            _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(p as usize * W as usize).cast());
        }
        let m = lanes(n - i);
        let vp = _mm512_maskz_loadu_epi32(m, positions.as_ptr().add(i).cast());
        let vo = gather_words::<W>(base, m, vp);
        let vv = _mm512_maskz_loadu_epi32(m, values.as_ptr().add(i).cast());
        let vn = if xor { _mm512_xor_si512(vo, vv) } else { vv };
        _mm512_mask_storeu_epi32(values.as_mut_ptr().add(i).cast(), m, vn);
        add_moves(&mut acc, _mm512_add_epi32(vfirst, vp), vo, vn);
        i += 16;
    }
    let w = W as usize;
    for (&p, &v) in positions.iter().zip(values.iter()) {
        let at = p as usize * w;
        target[at..at + w].copy_from_slice(&v.to_le_bytes()[..w]);
    }
    moves_sum(&acc)
}

/// The value words of the changes at `positions` between `old` and `new`
/// (XOR masks, or the new words when `overwrite`), written to `out`, and,
/// when `TRACK`, the digest move from old to new (`first` being the chunk's
/// first element in its tensor).
///
/// # Safety
/// The CPU has AVX-512 F (`available`), `W` is 1, 2 or 4, `old` and `new`
/// have equal lengths, `out` is as long as `positions`, and
/// `fits(positions, W, old.len(), first)`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn gather_block<const W: i32, const TRACK: bool>(
    old: &[u8],
    new: &[u8],
    positions: &[u32],
    overwrite: bool,
    first: u32,
    out: &mut [u64],
) -> DigestSum {
    debug_assert!(fits(positions, W as usize, old.len(), u64::from(first)) && old.len() == new.len());
    debug_assert!(out.len() == positions.len());
    let n = positions.len();
    let vfirst = _mm512_set1_epi32(first as i32);
    let mut acc = zero_moves();
    let mut i = 0;
    while i < n {
        let m = lanes(n - i);
        let vp = _mm512_maskz_loadu_epi32(m, positions.as_ptr().add(i).cast());
        let vo = gather_words::<W>(old.as_ptr(), m, vp);
        let vn = gather_words::<W>(new.as_ptr(), m, vp);
        let v = if overwrite { vn } else { _mm512_xor_si512(vo, vn) };
        let dst = out.as_mut_ptr().add(i);
        _mm512_mask_storeu_epi64(dst.cast(), m as __mmask8, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(v)));
        _mm512_mask_storeu_epi64(
            dst.add(8).cast(),
            (m >> 8) as __mmask8,
            _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64::<1>(v)),
        );
        if TRACK {
            add_moves(&mut acc, _mm512_add_epi32(vfirst, vp), vo, vn);
        }
        i += 16;
    }
    moves_sum(&acc)
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
                if !fit {
                    continue;
                }
                for xor in [true, false] {
                    // Apply: the kernel against word-by-word stores and moves.
                    let vals: Vec<u32> = pos.iter().map(|_| next() as u32 & ((1u64 << (8 * w)) - 1) as u32).collect();
                    let (mut want, mut want_moves) = (old[..len].to_vec(), DigestMoves::new(w));
                    for (&p, &v) in pos.iter().zip(&vals) {
                        let o = word(&want, p, w);
                        let nw = if xor { o ^ v } else { v };
                        want[p as usize * w..][..w].copy_from_slice(&nw.to_le_bytes()[..w]);
                        want_moves.word(first + u64::from(p), u64::from(o), u64::from(nw));
                    }
                    let (mut got, mut got_vals) = (old[..len].to_vec(), vals.clone());
                    let moved = unsafe {
                        match w {
                            1 => apply_block::<1>(&mut got, &pos, &mut got_vals, xor, first as u32),
                            2 => apply_block::<2>(&mut got, &pos, &mut got_vals, xor, first as u32),
                            _ => apply_block::<4>(&mut got, &pos, &mut got_vals, xor, first as u32),
                        }
                    };
                    assert_eq!(got, want, "apply: w {w} n {n} xor {xor}");
                    assert_eq!(moved, want_moves.finish(), "apply digest move: w {w} n {n} xor {xor}");
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
                    let (tracked, untracked) = unsafe {
                        match w {
                            1 => (gather_block::<1, true>(o, nw, &pos, overwrite, first as u32, &mut got), gather_block::<1, false>(o, nw, &pos, overwrite, 0, &mut got)),
                            2 => (gather_block::<2, true>(o, nw, &pos, overwrite, first as u32, &mut got), gather_block::<2, false>(o, nw, &pos, overwrite, 0, &mut got)),
                            _ => (gather_block::<4, true>(o, nw, &pos, overwrite, first as u32, &mut got), gather_block::<4, false>(o, nw, &pos, overwrite, 0, &mut got)),
                        }
                    };
                    assert_eq!(got, want, "gather: w {w} n {n} overwrite {overwrite}");
                    assert_eq!(tracked, want_moves.finish(), "gather digest move: w {w} n {n}");
                    assert_eq!(untracked, DigestSum::ZERO);
                }
            }
        }
    }
}
