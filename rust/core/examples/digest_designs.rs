//! The measurements behind the tensor digest's design (see
//! `benches/RESULTS.md`, "Twenty-eighth session" and "Thirty-fifth
//! session"): what a digest move costs per change through the crate's own
//! `DigestMoves` (whose widest kernel for this CPU runs; three AES rounds
//! since delta format version 9) against the same hash with one to four
//! rounds in kernels written here, and whether two or three rounds mix
//! enough. `cargo run --release -p dcr-core --example digest_designs` on
//! an x86-64 CPU with AVX2 and AES-NI (the VAES rows need VAES).
//!
//! The hash is the crate's definition with `R` rounds: the unit `u` at
//! index `i` as the 128-bit state `(u, i, 0, 0)`, then `R` `aesenc` rounds
//! with the first `4R` SHA-256 round constants as keys; the result's four
//! 32-bit lanes are summed.

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code, unsafe_op_in_unsafe_fn)]
mod x86 {
    use std::arch::x86_64::*;
    use std::collections::HashMap;
    use std::time::Instant;

    use dcr_core::digest::{DigestMoves, DigestSum};

    /// The crate's moves, through its widest kernel (offsets ascending).
    fn crate_moves(pos: &[u32], old: &[u32], new: &[u32]) -> DigestSum {
        let mut moves = DigestMoves::new(4);
        moves.words_at(0, pos, old, new);
        moves.finish()
    }

    /// Round key `r` (0-based): SHA-256 round constants `4r..4r+3`, as the
    /// crate's first three are.
    fn round_key(r: usize) -> [i32; 4] {
        const K: [u32; 16] = [
            0x428A_2F98, 0x7137_4491, 0xB5C0_FBCF, 0xE9B5_DBA5, 0x3956_C25B, 0x59F1_11F1, 0x923F_82A4, 0xAB1C_5ED5, 0xD807_AA98, 0x1283_5B01,
            0x2431_85BE, 0x550C_7DC3, 0x72BE_5D74, 0x80DE_B1FE, 0x9BDC_06A7, 0xC19B_F174,
        ];
        std::array::from_fn(|l| K[4 * r + l] as i32)
    }

    /// The eight units of `v` at indices `vi`, one per 128-bit state, in
    /// four vectors of two states.
    #[inline(always)]
    unsafe fn states(v: __m256i, vi: __m256i) -> [__m256i; 4] {
        let z = _mm256_setzero_si256();
        let (lo, hi) = (_mm256_unpacklo_epi32(v, vi), _mm256_unpackhi_epi32(v, vi));
        [_mm256_unpacklo_epi64(lo, z), _mm256_unpackhi_epi64(lo, z), _mm256_unpacklo_epi64(hi, z), _mm256_unpackhi_epi64(hi, z)]
    }

    /// The AES candidate's moves, two states per VAES instruction.
    #[target_feature(enable = "avx2,aes,vaes")]
    unsafe fn vaes_moves<const R: usize>(pos: &[u32], old: &[u32], new: &[u32]) -> __m256i {
        let keys: [__m256i; 4] = std::array::from_fn(|r| {
            let k = round_key(r);
            _mm256_setr_epi32(k[0], k[1], k[2], k[3], k[0], k[1], k[2], k[3])
        });
        let hash = |mut s: __m256i| {
            for key in &keys[..R] {
                s = _mm256_aesenc_epi128(s, *key);
            }
            s
        };
        let mut acc = _mm256_setzero_si256();
        for i in (0..pos.len()).step_by(8) {
            let vi = _mm256_loadu_si256(pos.as_ptr().add(i).cast());
            let vo = _mm256_loadu_si256(old.as_ptr().add(i).cast());
            let vn = _mm256_loadu_si256(new.as_ptr().add(i).cast());
            for (s, sign) in states(vn, vi).into_iter().map(|s| (s, 1)).chain(states(vo, vi).into_iter().map(|s| (s, -1))) {
                acc = if sign > 0 { _mm256_add_epi32(acc, hash(s)) } else { _mm256_sub_epi32(acc, hash(s)) };
            }
        }
        acc
    }

    /// The AES candidate's moves, one state per AES-NI instruction (CPUs
    /// without VAES).
    #[target_feature(enable = "avx2,aes")]
    unsafe fn aesni_moves<const R: usize>(pos: &[u32], old: &[u32], new: &[u32]) -> __m128i {
        let keys: [__m128i; 4] = std::array::from_fn(|r| {
            let k = round_key(r);
            _mm_setr_epi32(k[0], k[1], k[2], k[3])
        });
        let hash = |mut s: __m128i| {
            for key in &keys[..R] {
                s = _mm_aesenc_si128(s, *key);
            }
            s
        };
        let mut acc = _mm_setzero_si128();
        for i in (0..pos.len()).step_by(8) {
            let vi = _mm256_loadu_si256(pos.as_ptr().add(i).cast());
            let vo = _mm256_loadu_si256(old.as_ptr().add(i).cast());
            let vn = _mm256_loadu_si256(new.as_ptr().add(i).cast());
            for (v, sign) in [(vn, 1), (vo, -1)] {
                for s in states(v, vi) {
                    let h = _mm_add_epi32(hash(_mm256_castsi256_si128(s)), hash(_mm256_extracti128_si256::<1>(s)));
                    acc = if sign > 0 { _mm_add_epi32(acc, h) } else { _mm_sub_epi32(acc, h) };
                }
            }
        }
        acc
    }

    /// One unit's AES candidate hash, `R` rounds.
    #[target_feature(enable = "aes")]
    unsafe fn aes_unit(rounds: usize, i: u32, u: u32) -> [u32; 4] {
        let mut s = _mm_setr_epi32(u as i32, i as i32, 0, 0);
        for r in 0..rounds {
            let k = round_key(r);
            s = _mm_aesenc_si128(s, _mm_setr_epi32(k[0], k[1], k[2], k[3]));
        }
        let mut out = [0u32; 4];
        _mm_storeu_si128(out.as_mut_ptr().cast(), s);
        out
    }

    fn xorshift(seed: u64) -> impl FnMut() -> u64 {
        let mut x = seed | 1;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

    /// Pairs of positions among `2^22` where flipping the bits `flip` of
    /// the unit gives moves that cancel in lanes 0 and 1 (units random, or
    /// all zero).
    fn cancelling_pairs(rounds: usize, flip: u32, zero_units: bool) -> usize {
        let mut next = xorshift(99);
        let mut seen: HashMap<u64, ()> = HashMap::new();
        let mut hits = 0;
        for i in 0..1u32 << 22 {
            let u = if zero_units { 0 } else { next() as u32 & 0xffff };
            // Safety: the caller checked that the CPU has AES-NI.
            let (a, b) = unsafe { (aes_unit(rounds, i, u), aes_unit(rounds, i, u ^ flip)) };
            let d: [u32; 2] = std::array::from_fn(|l| b[l].wrapping_sub(a[l]));
            let key = u64::from(d[0]) << 32 | u64::from(d[1]);
            let negated = u64::from(d[0].wrapping_neg()) << 32 | u64::from(d[1].wrapping_neg());
            hits += usize::from(seen.contains_key(&negated));
            seen.insert(key, ());
        }
        hits
    }

    pub fn run() {
        if !is_x86_feature_detected!("avx2") || !is_x86_feature_detected!("aes") {
            println!("needs AVX2 and AES-NI");
            return;
        }
        let vaes = is_x86_feature_detected!("vaes");
        let n = 8192usize;
        let mut next = xorshift(12345);
        let mut pos: Vec<u32> = (0..n).map(|_| next() as u32 & 0xfffff).collect();
        pos.sort_unstable();
        let old: Vec<u32> = (0..n).map(|_| next() as u32).collect();
        let new: Vec<u32> = (0..n).map(|_| next() as u32).collect();
        let reps = 20_000;
        let time = |f: &dyn Fn()| {
            let t = Instant::now();
            for _ in 0..reps {
                f();
            }
            t.elapsed().as_secs_f64() / (reps * n) as f64 * 1e9
        };
        println!("ns per change (both hashes and the sums), {n} changes in L1, three rounds of timings:");
        for _ in 0..3 {
            // Safety: AVX2 and AES-NI were detected above, VAES where used.
            let current = time(&|| {
                std::hint::black_box(crate_moves(std::hint::black_box(&pos), &old, &new));
            });
            let aesni3 = time(&|| unsafe { std::hint::black_box(aesni_moves::<3>(std::hint::black_box(&pos), &old, &new)); });
            let aesni4 = time(&|| unsafe { std::hint::black_box(aesni_moves::<4>(std::hint::black_box(&pos), &old, &new)); });
            let mut line = format!("  dcr_core (R=3, widest kernel) {current:.3}   AES-NI 128-bit R=3 {aesni3:.3} R=4 {aesni4:.3}");
            if vaes {
                let v: Vec<f64> = vec![
                    time(&|| unsafe { std::hint::black_box(vaes_moves::<1>(std::hint::black_box(&pos), &old, &new)); }),
                    time(&|| unsafe { std::hint::black_box(vaes_moves::<2>(std::hint::black_box(&pos), &old, &new)); }),
                    time(&|| unsafe { std::hint::black_box(vaes_moves::<3>(std::hint::black_box(&pos), &old, &new)); }),
                    time(&|| unsafe { std::hint::black_box(vaes_moves::<4>(std::hint::black_box(&pos), &old, &new)); }),
                ];
                line += &format!("   VAES 256-bit R=1..4 {:.3} {:.3} {:.3} {:.3}", v[0], v[1], v[2], v[3]);
            }
            println!("{line}");
        }
        println!("pairs of 2^22 positions whose moves cancel in lanes 0-1, by rounds and bits flipped:");
        for rounds in [2, 3] {
            for (flip, zero) in [(0x8000, false), (0x0001, false), (0x0080, false), (0x8000, true), (0x0001, true)] {
                println!("  R={rounds} flip {flip:#06x} units {}: {}", if zero { "zero" } else { "random" }, cancelling_pairs(rounds, flip, zero));
            }
        }
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    x86::run();
    #[cfg(not(target_arch = "x86_64"))]
    println!("an x86-64 measurement");
}
