//! Tensor digests that add up.
//!
//! A tensor's digest is a sum over its elements, so it can be computed in
//! pieces and combined in any order:
//!
//! - each trainer rank digests only the canonical positions its shard holds
//!   and the ranks' sums add up to the digest of the gathered tensor;
//! - a delta's target digest is the base digest plus, at the changed
//!   positions only, `h(position, new) - h(position, old)`: neither encoder
//!   nor receiver reads the unchanged bytes to know the new digest;
//! - one large tensor is digested on all cores.
//!
//! Definition (docs/format.md; unchanged since format version 2). A tensor's stored bytes are
//! read as *units*: its codec words (1, 2 or 4 bytes, little endian), or two
//! 4-byte units per 8-byte word (low half first). Unit `u` at unit index `i`
//! contributes, in each of four 32-bit lanes `l`,
//!
//! ```text
//! h_l(i, u) = fmix32(u ^ (lo32(i) * A_l + fmix32(hi32(i) ^ S_l)))
//! ```
//!
//! (`fmix32` is MurmurHash3's finaliser) and the digest is the four lane
//! sums modulo 2^32, little endian. For a fixed position `h_l` is a bijection
//! of the unit, so a change of any single unit changes every lane; two or
//! more changes collide with probability about 2^-128. Not a cryptographic
//! hash: it guards against accidents, the transport authenticates peers.


/// 16 bytes: four little-endian 32-bit lane sums.
pub type Digest = [u8; 16];

const LANES: usize = 4;
/// Per-lane multipliers of the low 32 bits of the unit index (odd).
const INDEX_MUL: [u32; LANES] = [0x9E37_79B1, 0x85EB_CA77, 0xC2B2_AE3D, 0x27D4_EB2F];
/// Per-lane seeds mixed with the high 32 bits of the unit index.
const SEED: [u32; LANES] = [0x6A09_E667, 0xBB67_AE85, 0x3C6E_F372, 0xA54F_F53A];

/// Units digested per parallel task.
const BLOCK_UNITS: usize = 1 << 20;

#[inline(always)]
const fn fmix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x85EB_CA6B);
    x ^= x >> 13;
    x = x.wrapping_mul(0xC2B2_AE35);
    x ^= x >> 16;
    x
}

/// The high keys of units below index 2^32 (nearly every tensor's).
const LOW_KEYS: [u32; LANES] = [fmix32(SEED[0]), fmix32(SEED[1]), fmix32(SEED[2]), fmix32(SEED[3])];

#[inline(always)]
fn high_keys(hi: u32) -> [u32; LANES] {
    if hi == 0 {
        return LOW_KEYS;
    }
    std::array::from_fn(|l| fmix32(hi ^ SEED[l]))
}

/// `h_l(i, u)` for one unit.
#[inline(always)]
fn unit_hash(index: u64, unit: u32) -> [u32; LANES] {
    let keys = high_keys((index >> 32) as u32);
    let lo = index as u32;
    std::array::from_fn(|l| fmix32(unit ^ lo.wrapping_mul(INDEX_MUL[l]).wrapping_add(keys[l])))
}

/// A digest being accumulated: lane sums that add and subtract.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DigestSum([u32; LANES]);

impl DigestSum {
    pub const ZERO: DigestSum = DigestSum([0; LANES]);

    pub fn from_digest(d: &Digest) -> Self {
        DigestSum(std::array::from_fn(|l| u32::from_le_bytes(d[4 * l..4 * l + 4].try_into().expect("4 bytes"))))
    }

    pub fn digest(&self) -> Digest {
        let mut d = [0u8; 16];
        for (l, v) in self.0.iter().enumerate() {
            d[4 * l..4 * l + 4].copy_from_slice(&v.to_le_bytes());
        }
        d
    }

    #[must_use]
    pub fn plus(self, other: DigestSum) -> DigestSum {
        DigestSum(std::array::from_fn(|l| self.0[l].wrapping_add(other.0[l])))
    }

    #[must_use]
    pub fn minus(self, other: DigestSum) -> DigestSum {
        DigestSum(std::array::from_fn(|l| self.0[l].wrapping_sub(other.0[l])))
    }

    fn add_unit(&mut self, index: u64, unit: u32) {
        let h = unit_hash(index, unit);
        for (s, x) in self.0.iter_mut().zip(h) {
            *s = s.wrapping_add(x);
        }
    }

    fn sub_unit(&mut self, index: u64, unit: u32) {
        let h = unit_hash(index, unit);
        for (s, x) in self.0.iter_mut().zip(h) {
            *s = s.wrapping_sub(x);
        }
    }

    /// Account for one element (word of `word_bytes`, little endian in the
    /// low bytes of `old`/`new`) at element index `element` changing from
    /// `old` to `new`.
    #[inline]
    pub fn change(&mut self, word_bytes: usize, element: u64, old: u64, new: u64) {
        if old == new {
            return;
        }
        if word_bytes == 8 {
            for half in 0..2u64 {
                let (o, n) = ((old >> (32 * half)) as u32, (new >> (32 * half)) as u32);
                if o != n {
                    self.sub_unit(2 * element + half, o);
                    self.add_unit(2 * element + half, n);
                }
            }
        } else {
            self.sub_unit(element, old as u32);
            self.add_unit(element, new as u32);
        }
    }

    /// Add one element (a word of `word_bytes`) at element index `element`.
    pub fn add_word(&mut self, word_bytes: usize, element: u64, word: u64) {
        if word_bytes == 8 {
            self.add_unit(2 * element, word as u32);
            self.add_unit(2 * element + 1, (word >> 32) as u32);
        } else {
            self.add_unit(element, word as u32);
        }
    }
}

/// Digest of one tensor's stored bytes (`word_bytes`: the dtype's codec word),
/// on all of rayon's threads when it is large.
pub fn tensor_digest(bytes: &[u8], word_bytes: usize) -> Digest {
    partial_digest(bytes, word_bytes, 0).digest()
}

/// The digest contribution of a contiguous run of a tensor's elements that
/// starts at element `first_element` (a shard, a chunk).
pub fn partial_digest(bytes: &[u8], word_bytes: usize, first_element: u64) -> DigestSum {
    let block = BLOCK_UNITS * word_bytes.min(4);
    if bytes.len() <= block {
        return sum_words(bytes, word_bytes, first_element);
    }
    crate::exec::map_range(bytes.len().div_ceil(block), |k| {
        let b = &bytes[k * block..bytes.len().min((k + 1) * block)];
        sum_words(b, word_bytes, first_element + (k * block / word_bytes) as u64)
    })
    .into_iter()
    .fold(DigestSum::ZERO, DigestSum::plus)
}

fn sum_words(bytes: &[u8], word_bytes: usize, first_element: u64) -> DigestSum {
    debug_assert!(matches!(word_bytes, 1 | 2 | 4 | 8) && bytes.len().is_multiple_of(word_bytes));
    let (unit_bytes, first_unit) = match word_bytes {
        8 => (4, first_element * 2),
        w => (w, first_element),
    };
    let n = bytes.len() / unit_bytes;
    let mut acc = DigestSum::ZERO;
    let mut done = 0usize;
    // Runs that do not cross a 2^32 boundary of the unit index share the
    // high keys.
    while done < n {
        let index = first_unit + done as u64;
        let to_boundary = (1u64 << 32) - (index & 0xFFFF_FFFF);
        let len = (n - done).min(usize::try_from(to_boundary).unwrap_or(usize::MAX));
        let run = &bytes[done * unit_bytes..(done + len) * unit_bytes];
        acc = acc.plus(sum_run(run, unit_bytes, index));
        done += len;
    }
    acc
}

fn sum_run(bytes: &[u8], unit_bytes: usize, first_unit: u64) -> DigestSum {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // Safety: the CPU supports AVX-512 F (checked just above).
        #[allow(unsafe_code)]
        return unsafe { avx512::sum_run(bytes, unit_bytes, first_unit) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // Safety: the CPU supports AVX2 (checked just above).
        #[allow(unsafe_code)]
        return unsafe { avx2::sum_run(bytes, unit_bytes, first_unit) };
    }
    sum_run_portable(bytes, unit_bytes, first_unit)
}

/// The lane sums of units `first_unit..` of one run (no 2^32 crossing), one
/// unit at a time: the definition, and the fallback without AVX2.
fn sum_run_portable(bytes: &[u8], unit_bytes: usize, first_unit: u64) -> DigestSum {
    let mut sums = DigestSum::ZERO;
    for (i, u) in bytes.chunks_exact(unit_bytes).enumerate() {
        let mut w = [0u8; 4];
        w[..unit_bytes].copy_from_slice(u);
        sums.add_unit(first_unit + i as u64, u32::from_le_bytes(w));
    }
    sums
}

/// Units buffered before they are hashed together.
const MOVE_BATCH: usize = 64;

/// Accumulates `h(i, new) - h(i, old)` over changed words as they are
/// written (by an apply loop, an encoder): the words are buffered and hashed
/// in batches, eight per AVX2 step, with no per-change allocation.
pub struct DigestMoves {
    word_bytes: usize,
    index: [u32; MOVE_BATCH],
    old: [u32; MOVE_BATCH],
    new: [u32; MOVE_BATCH],
    len: usize,
    sum: DigestSum,
    kernel: Kernel,
}

/// The widest vector unit this CPU has for the batched hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Kernel {
    fn detect() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Kernel::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Kernel::Avx2;
            }
        }
        Kernel::Portable
    }

    /// `sum h(first + offsets[k], new[k]) - h(first + offsets[k], old[k])`
    /// over the leading changes the vector unit takes (all unit indices
    /// below 2^32), and how many it took.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn moved_at(self, first: u32, offsets: &[u32], old: &[u32], new: &[u32]) -> (DigestSum, usize) {
        match self {
            Kernel::Portable => (DigestSum::ZERO, 0),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                let n = offsets.len() / 8 * 8;
                // Safety: the CPU supports AVX2 (detected).
                #[allow(unsafe_code)]
                let moved = unsafe { avx2::moved_at(first, &offsets[..n], &old[..n], &new[..n]) };
                (moved, n)
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => {
                let n = offsets.len() / 16 * 16;
                // Safety: the CPU supports AVX-512 F (detected).
                #[allow(unsafe_code)]
                let moved = unsafe { avx512::moved_at(first, &offsets[..n], &old[..n], &new[..n]) };
                (moved, n)
            }
        }
    }
}

impl DigestMoves {
    pub fn new(word_bytes: usize) -> Self {
        DigestMoves {
            word_bytes,
            index: [0; MOVE_BATCH],
            old: [0; MOVE_BATCH],
            new: [0; MOVE_BATCH],
            len: 0,
            sum: DigestSum::ZERO,
            kernel: Kernel::detect(),
        }
    }

    /// The element `element` (a word, little endian in the low bytes)
    /// changed from `old` to `new`.
    #[inline(always)]
    pub fn word(&mut self, element: u64, old: u64, new: u64) {
        if self.word_bytes == 8 {
            self.unit(2 * element, old as u32, new as u32);
            self.unit(2 * element + 1, (old >> 32) as u32, (new >> 32) as u32);
        } else {
            self.unit(element, old as u32, new as u32);
        }
    }

    #[inline(always)]
    fn unit(&mut self, index: u64, old: u32, new: u32) {
        if index >> 32 != 0 {
            // Past 2^32 units the high keys differ: one by one (rare).
            self.sum.sub_unit(index, old);
            self.sum.add_unit(index, new);
            return;
        }
        let k = self.len;
        self.index[k] = index as u32;
        self.old[k] = old;
        self.new[k] = new;
        self.len = k + 1;
        if self.len == MOVE_BATCH {
            self.flush();
        }
    }

    fn flush(&mut self) {
        let n = self.len;
        let (moved, done) = self.kernel.moved_at(0, &self.index[..n], &self.old[..n], &self.new[..n]);
        self.sum = self.sum.plus(moved);
        for k in done..n {
            self.sum.sub_unit(u64::from(self.index[k]), self.old[k]);
            self.sum.add_unit(u64::from(self.index[k]), self.new[k]);
        }
        self.len = 0;
    }

    /// A block of changed words of at most 4 bytes, at elements
    /// `first_element + offsets[k]` (offsets ascending, as every change list
    /// is), given as their old and new words.
    pub fn words_at(&mut self, first_element: u64, offsets: &[u32], old: &[u32], new: &[u32]) {
        debug_assert!(self.word_bytes <= 4 && offsets.len() == old.len() && old.len() == new.len());
        debug_assert!(offsets.is_sorted(), "change offsets ascend");
        // Ascending, so the last offset is the largest: whether every unit
        // index stays below 2^32 (the vector kernels' range) is one compare.
        let last = offsets.last().copied().map_or(0, u64::from);
        let mut done = 0;
        if first_element + last < 1 << 32 {
            let moved;
            (moved, done) = self.kernel.moved_at(first_element as u32, offsets, old, new);
            self.sum = self.sum.plus(moved);
        }
        for k in done..offsets.len() {
            self.unit(first_element + u64::from(offsets[k]), old[k], new[k]);
        }
    }

    /// Add a move already summed (by a kernel that hashes as it loads).
    pub fn add(&mut self, moved: DigestSum) {
        self.sum = self.sum.plus(moved);
    }

    /// The digest's total move.
    pub fn finish(mut self) -> DigestSum {
        self.flush();
        self.sum
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(crate) mod avx2 {
    //! AVX2 kernels: eight 32-bit lanes per instruction.
    use super::{high_keys, DigestSum, INDEX_MUL, LANES, LOW_KEYS};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn fmix(x: __m256i) -> __m256i {
        fmix_after_fold(fold(x))
    }

    /// `fmix32`'s first step, `x ^ (x >> 16)`: it distributes over XOR, so
    /// the moves fold a unit and its key apart and share the unit's fold
    /// among the four lanes (1-2 % of the multi-step free apply, paired).
    #[inline(always)]
    unsafe fn fold(x: __m256i) -> __m256i {
        _mm256_xor_si256(x, _mm256_srli_epi32(x, 16))
    }

    /// `fmix32` after its first step.
    #[inline(always)]
    unsafe fn fmix_after_fold(mut x: __m256i) -> __m256i {
        x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x85EB_CA6Bu32 as i32));
        x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
        x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0xC2B2_AE35u32 as i32));
        _mm256_xor_si256(x, _mm256_srli_epi32(x, 16))
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256i) -> u32 {
        let mut a = [0u32; 8];
        _mm256_storeu_si256(a.as_mut_ptr().cast(), v);
        a.iter().fold(0u32, |s, &x| s.wrapping_add(x))
    }

    /// Eight units starting at `p` (unit width 1, 2 or 4), widened to u32.
    #[inline(always)]
    unsafe fn load8(p: *const u8, unit_bytes: usize) -> __m256i {
        match unit_bytes {
            1 => _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())),
            2 => _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())),
            _ => _mm256_loadu_si256(p.cast()),
        }
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn sum_run(bytes: &[u8], unit_bytes: usize, first_unit: u64) -> DigestSum {
        let n = bytes.len() / unit_bytes;
        let full = n / 8 * 8;
        let keys = high_keys((first_unit >> 32) as u32);
        let lo0 = first_unit as u32;
        let steps = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        // Per lane: the key vector of units i..i+8 and its step per 8 units.
        let mut key = [_mm256_setzero_si256(); LANES];
        let mut stride = [_mm256_setzero_si256(); LANES];
        let mut acc = [_mm256_setzero_si256(); LANES];
        for l in 0..LANES {
            let a = _mm256_set1_epi32(INDEX_MUL[l] as i32);
            let idx = _mm256_add_epi32(_mm256_set1_epi32(lo0 as i32), steps);
            key[l] = _mm256_add_epi32(_mm256_mullo_epi32(idx, a), _mm256_set1_epi32(keys[l] as i32));
            stride[l] = _mm256_set1_epi32(INDEX_MUL[l].wrapping_mul(8) as i32);
        }
        let p = bytes.as_ptr();
        let mut i = 0;
        while i < full {
            let u = load8(p.add(i * unit_bytes), unit_bytes);
            for l in 0..LANES {
                acc[l] = _mm256_add_epi32(acc[l], fmix(_mm256_xor_si256(u, key[l])));
                key[l] = _mm256_add_epi32(key[l], stride[l]);
            }
            i += 8;
        }
        let mut sums = DigestSum(std::array::from_fn(|l| hsum(acc[l])));
        let tail = super::sum_run_portable(&bytes[full * unit_bytes..], unit_bytes, first_unit + full as u64);
        sums = sums.plus(tail);
        sums
    }

    /// `sum h(i, new) - h(i, old)` at unit indices `i = first + offsets[k]`
    /// (all below 2^32; equal lengths, a multiple of 8), eight per step in
    /// each lane.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn moved_at(first: u32, offsets: &[u32], old: &[u32], new: &[u32]) -> DigestSum {
        let mut acc = zero_moves();
        let n = offsets.len().min(old.len()).min(new.len()) / 8 * 8;
        let base = _mm256_set1_epi32(first as i32);
        let mut i = 0;
        while i < n {
            let vi = _mm256_add_epi32(base, _mm256_loadu_si256(offsets.as_ptr().add(i).cast()));
            let vo = _mm256_loadu_si256(old.as_ptr().add(i).cast());
            let vn = _mm256_loadu_si256(new.as_ptr().add(i).cast());
            add_moves(&mut acc, vi, vo, vn);
            i += 8;
        }
        moves_sum(&acc)
    }

    /// A digest move being summed in registers, one vector per lane.
    pub(crate) type MoveAcc = [__m256i; LANES];

    pub(crate) const fn zero_moves() -> MoveAcc {
        // Safety: an all-zero bit pattern is a valid __m256i.
        unsafe { std::mem::zeroed() }
    }

    /// Add `h(i, new) - h(i, old)` of eight units (unit indices `vi`, all
    /// below 2^32) to `acc`.
    #[inline(always)]
    pub(crate) unsafe fn add_moves(acc: &mut MoveAcc, vi: __m256i, vo: __m256i, vn: __m256i) {
        let (old, new) = (fold(vo), fold(vn));
        for l in 0..LANES {
            let k = _mm256_add_epi32(
                _mm256_mullo_epi32(vi, _mm256_set1_epi32(INDEX_MUL[l] as i32)),
                _mm256_set1_epi32(LOW_KEYS[l] as i32),
            );
            let k = fold(k);
            let d = _mm256_sub_epi32(fmix_after_fold(_mm256_xor_si256(new, k)), fmix_after_fold(_mm256_xor_si256(old, k)));
            acc[l] = _mm256_add_epi32(acc[l], d);
        }
    }

    /// The digest move held in `acc`.
    #[inline(always)]
    pub(crate) unsafe fn moves_sum(acc: &MoveAcc) -> DigestSum {
        DigestSum(std::array::from_fn(|l| hsum(acc[l])))
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(crate) mod avx512 {
    //! AVX-512 kernels: sixteen 32-bit lanes per instruction (same sums as
    //! the AVX2 and portable ones).
    use super::{high_keys, DigestSum, INDEX_MUL, LANES, LOW_KEYS};
    use std::arch::x86_64::*;

    /// `fmix32`'s first step, `x ^ (x >> 16)`.
    #[inline(always)]
    unsafe fn fold(x: __m512i) -> __m512i {
        _mm512_xor_si512(x, _mm512_srli_epi32(x, 16))
    }

    /// `fmix32` after its first step.
    #[inline(always)]
    unsafe fn fmix_after_fold(mut x: __m512i) -> __m512i {
        x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x85EB_CA6Bu32 as i32));
        x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
        x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0xC2B2_AE35u32 as i32));
        _mm512_xor_si512(x, _mm512_srli_epi32(x, 16))
    }

    /// Sixteen units starting at `p` (unit width 1, 2 or 4), widened to u32.
    #[inline(always)]
    unsafe fn load16(p: *const u8, unit_bytes: usize) -> __m512i {
        match unit_bytes {
            1 => _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast())),
            2 => _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast())),
            _ => _mm512_loadu_si512(p.cast()),
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sum_run(bytes: &[u8], unit_bytes: usize, first_unit: u64) -> DigestSum {
        let n = bytes.len() / unit_bytes;
        let full = n / 16 * 16;
        let keys = high_keys((first_unit >> 32) as u32);
        let steps = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let idx = _mm512_add_epi32(_mm512_set1_epi32(first_unit as u32 as i32), steps);
        let mut key = [_mm512_setzero_si512(); LANES];
        let mut stride = [_mm512_setzero_si512(); LANES];
        let mut acc = [_mm512_setzero_si512(); LANES];
        for l in 0..LANES {
            key[l] = _mm512_add_epi32(
                _mm512_mullo_epi32(idx, _mm512_set1_epi32(INDEX_MUL[l] as i32)),
                _mm512_set1_epi32(keys[l] as i32),
            );
            stride[l] = _mm512_set1_epi32(INDEX_MUL[l].wrapping_mul(16) as i32);
        }
        let p = bytes.as_ptr();
        let mut i = 0;
        while i < full {
            // `fmix32`'s first step distributes over XOR: the units are
            // folded once for the four lanes, and each lane's key and its
            // shifted half join them in one three-way XOR (the full pass
            // 0.961-0.976 of the time before, paired, bf16 checkpoints, an
            // Intel Xeon, where 512-bit operations have two ports).
            let u = load16(p.add(i * unit_bytes), unit_bytes);
            let folded = fold(u);
            for l in 0..LANES {
                let k = key[l];
                let x = _mm512_ternarylogic_epi32::<0x96>(folded, k, _mm512_srli_epi32(k, 16));
                acc[l] = _mm512_add_epi32(acc[l], fmix_after_fold(x));
                key[l] = _mm512_add_epi32(k, stride[l]);
            }
            i += 16;
        }
        let sums = DigestSum(std::array::from_fn(|l| _mm512_reduce_add_epi32(acc[l]) as u32));
        sums.plus(super::sum_run_portable(&bytes[full * unit_bytes..], unit_bytes, first_unit + full as u64))
    }

    /// Lane sums of digest moves being accumulated in vector registers.
    pub(crate) type MoveAcc = [__m512i; LANES];

    pub(crate) const fn zero_moves() -> MoveAcc {
        // Safety: an all-zero bit pattern is a valid __m512i.
        unsafe { std::mem::zeroed() }
    }

    /// Add `h(i, new) - h(i, old)` of sixteen units (unit indices `vi`, all
    /// below 2^32) to `acc`. A lane whose old and new units are equal adds
    /// nothing, so masked-off lanes are passed as zeros.
    ///
    /// The units are folded once for the four lanes and each lane's key
    /// joins them in a three-way XOR, as in `sum_run` (the free diff at
    /// fp32m 10->15 0.990, its apply 0.992 of the time before, paired).
    #[inline(always)]
    pub(crate) unsafe fn add_moves(acc: &mut MoveAcc, vi: __m512i, vo: __m512i, vn: __m512i) {
        let (old, new) = (fold(vo), fold(vn));
        for l in 0..LANES {
            let k = _mm512_add_epi32(
                _mm512_mullo_epi32(vi, _mm512_set1_epi32(INDEX_MUL[l] as i32)),
                _mm512_set1_epi32(LOW_KEYS[l] as i32),
            );
            let high = _mm512_srli_epi32(k, 16);
            let d = _mm512_sub_epi32(
                fmix_after_fold(_mm512_ternarylogic_epi32::<0x96>(new, k, high)),
                fmix_after_fold(_mm512_ternarylogic_epi32::<0x96>(old, k, high)),
            );
            acc[l] = _mm512_add_epi32(acc[l], d);
        }
    }

    /// The digest move held in `acc`.
    #[inline(always)]
    pub(crate) unsafe fn moves_sum(acc: &MoveAcc) -> DigestSum {
        DigestSum(std::array::from_fn(|l| _mm512_reduce_add_epi32(acc[l]) as u32))
    }

    /// `sum h(i, new) - h(i, old)` at unit indices `i = first + offsets[k]`
    /// (all below 2^32; equal lengths, a multiple of 16).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn moved_at(first: u32, offsets: &[u32], old: &[u32], new: &[u32]) -> DigestSum {
        let mut acc = zero_moves();
        let n = offsets.len().min(old.len()).min(new.len()) / 16 * 16;
        let base = _mm512_set1_epi32(first as i32);
        let mut i = 0;
        while i < n {
            let vi = _mm512_add_epi32(base, _mm512_loadu_si512(offsets.as_ptr().add(i).cast()));
            let vo = _mm512_loadu_si512(old.as_ptr().add(i).cast());
            let vn = _mm512_loadu_si512(new.as_ptr().add(i).cast());
            add_moves(&mut acc, vi, vo, vn);
            i += 16;
        }
        moves_sum(&acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(bytes: &[u8], word_bytes: usize, first_element: u64) -> Digest {
        let mut s = DigestSum::ZERO;
        for (k, w) in bytes.chunks_exact(word_bytes).enumerate() {
            let mut word = [0u8; 8];
            word[..word_bytes].copy_from_slice(w);
            let word = u64::from_le_bytes(word);
            let e = first_element + k as u64;
            if word_bytes == 8 {
                s.add_unit(2 * e, word as u32);
                s.add_unit(2 * e + 1, (word >> 32) as u32);
            } else {
                s.add_unit(e, word as u32);
            }
        }
        s.digest()
    }

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn vectorised_sum_matches_the_definition() {
        for w in [1, 2, 4, 8] {
            for n in [0, 1, 7, 8, 9, 63, 1000] {
                let b = bytes(n * w, n as u64 + w as u64);
                for first in [0u64, 5, (1 << 32) - 3] {
                    assert_eq!(sum_words(&b, w, first).digest(), reference(&b, w, first), "w={w} n={n} first={first}");
                }
            }
        }
    }

    /// Every vector kernel this CPU runs gives the portable sums (the
    /// dispatch picks only the widest, so each is called here directly).
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[allow(unsafe_code)]
    fn every_vector_kernel_agrees_with_the_portable_one() {
        let mut kernels = vec![];
        if std::arch::is_x86_feature_detected!("avx2") {
            kernels.push(Kernel::Avx2);
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            kernels.push(Kernel::Avx512);
        }
        for unit in [1usize, 2, 4] {
            for n in [0usize, 15, 16, 17, 100, 1027] {
                let b = bytes(n * unit, (n * unit) as u64 + 1);
                for first in [0u64, 9, (1 << 32) + 5] {
                    let want = sum_run_portable(&b, unit, first);
                    for &k in &kernels {
                        // Safety: each kernel is listed only when the CPU supports it.
                        let got = unsafe {
                            match k {
                                Kernel::Avx2 => avx2::sum_run(&b, unit, first),
                                Kernel::Avx512 => avx512::sum_run(&b, unit, first),
                                Kernel::Portable => unreachable!(),
                            }
                        };
                        assert_eq!(got, want, "{k:?} unit={unit} n={n} first={first}");
                    }
                }
            }
        }
        let offsets: Vec<u32> = (0..160u32).map(|k| k * 37 + k % 3).collect();
        let old: Vec<u32> = offsets.iter().map(|&o| o.wrapping_mul(0x9E37_79B9)).collect();
        let new: Vec<u32> = old.iter().map(|&o| o ^ 0x0001_0003).collect();
        for first in [0u32, 1 << 20] {
            let mut want = DigestSum::ZERO;
            for k in 0..offsets.len() {
                want.change(4, u64::from(first + offsets[k]), u64::from(old[k]), u64::from(new[k]));
            }
            for &k in &kernels {
                let (got, done) = k.moved_at(first, &offsets, &old, &new);
                assert_eq!(done, offsets.len(), "{k:?}");
                assert_eq!(got, want, "{k:?} first={first}");
            }
        }
    }

    #[test]
    fn pieces_add_up_to_the_whole() {
        let w = 2;
        let b = bytes(3 * BLOCK_UNITS * w + 10, 7);
        let whole = tensor_digest(&b, w);
        let cut = 12_345 * w;
        let sum = partial_digest(&b[..cut], w, 0).plus(partial_digest(&b[cut..], w, (cut / w) as u64));
        assert_eq!(sum.digest(), whole);
        assert_eq!(whole, reference(&b, w, 0));
    }

    #[test]
    fn a_change_moves_the_digest_by_its_own_delta() {
        for w in [1usize, 2, 4, 8] {
            let mut b = bytes(64 * w, 3);
            let before = DigestSum::from_digest(&tensor_digest(&b, w));
            let e = 17usize;
            let mut old = [0u8; 8];
            old[..w].copy_from_slice(&b[e * w..(e + 1) * w]);
            let old = u64::from_le_bytes(old);
            let new = old ^ 0x8000_0000_0000_0001 & (u64::MAX >> (64 - 8 * w));
            b[e * w..(e + 1) * w].copy_from_slice(&new.to_le_bytes()[..w]);
            let mut d = before;
            d.change(w, e as u64, old, new);
            assert_eq!(d.digest(), tensor_digest(&b, w));
            assert_ne!(d, before);
        }
    }

    #[test]
    fn every_single_unit_change_changes_every_lane() {
        let b = bytes(256, 11);
        let base = DigestSum::from_digest(&tensor_digest(&b, 2));
        for e in [0usize, 1, 100, 127] {
            for flip in [1u16, 0x8000, 0x7FFF, 0xFFFF] {
                let mut c = b.clone();
                let v = u16::from_le_bytes([c[2 * e], c[2 * e + 1]]) ^ flip;
                c[2 * e..2 * e + 2].copy_from_slice(&v.to_le_bytes());
                let d = DigestSum::from_digest(&tensor_digest(&c, 2));
                for l in 0..LANES {
                    assert_ne!(d.0[l], base.0[l], "lane {l} e={e} flip={flip:#x}");
                }
            }
        }
    }

    #[test]
    fn batched_changes_equal_one_by_one() {
        for w in [1usize, 2, 4, 8] {
            let b = bytes(4096 * w, 13);
            let changes: Vec<(u64, u64, u64)> = (0..300u64)
                .map(|k| {
                    let e = k * 13 % 4096;
                    let mut o = [0u8; 8];
                    o[..w].copy_from_slice(&b[e as usize * w..(e as usize + 1) * w]);
                    let old = u64::from_le_bytes(o);
                    let new = (old ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15)) & (u64::MAX >> (64 - 8 * w));
                    (e + (k % 3) * (1 << 32), old, new)
                })
                .collect();
            let mut moves = DigestMoves::new(w);
            for &(e, old, new) in &changes {
                moves.word(e, old, new);
            }
            let batched = moves.finish();
            let mut single = DigestSum::ZERO;
            for &(e, old, new) in &changes {
                single.change(w, e, old, new);
            }
            assert_eq!(batched, single, "w={w}");
        }
    }

    #[test]
    fn swapped_elements_change_the_digest() {
        let mut b = bytes(128, 5);
        let d0 = tensor_digest(&b, 4);
        b.swap(0, 4);
        b.swap(1, 5);
        b.swap(2, 6);
        b.swap(3, 7);
        assert_ne!(tensor_digest(&b, 4), d0);
    }
}
