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
//! Definition (docs/format.md; since delta format version 9). A tensor's
//! stored bytes are read as *units*: its codec words (1, 2 or 4 bytes,
//! little endian), or two 4-byte units per 8-byte word (low half first).
//! Unit `u` at unit index `i` is the 128-bit AES state
//!
//! ```text
//! S(i, u) = (u, lo32(i), hi32(i), 0)        four little-endian u32
//! h(i, u) = round(round(round(S, K1), K2), K3)
//! ```
//!
//! where `round` is one AES encryption round as x86's `aesenc` computes it
//! (ShiftRows, SubBytes, MixColumns, then XOR of the round key) and the
//! round keys are fixed constants. The digest is the sum modulo 2^32 of
//! each of the four 32-bit lanes of `h` over all units, little endian.
//! An AES round is a permutation of the state, so for a fixed position
//! `h(i, .)` is injective: a change of any single unit always changes the
//! digest. Three rounds: with two, single-bit changes at different
//! positions cancel far more often than chance (`examples/digest_designs`).
//! Not a cryptographic hash: it guards against accidents, the transport
//! authenticates peers.
//!
//! Format version 8 and earlier used four lanes of MurmurHash3's finaliser
//! (two 32-bit multiplies each, per unit and lane); AES rounds take the
//! digest moves from about 1.2 to about 0.5 ns per change on CPUs with
//! VAES (four states per instruction), where the multiplies were the
//! largest single cost of both the free diff and the free apply.

/// 16 bytes: four little-endian 32-bit lane sums.
pub type Digest = [u8; 16];

const LANES: usize = 4;

/// The round keys `K1, K2, K3`, as four little-endian u32 each: the first
/// twelve SHA-256 round constants (nothing up the sleeve).
const ROUND_KEYS: [[u32; 4]; 3] = [
    [0x428A_2F98, 0x7137_4491, 0xB5C0_FBCF, 0xE9B5_DBA5],
    [0x3956_C25B, 0x59F1_11F1, 0x923F_82A4, 0xAB1C_5ED5],
    [0xD807_AA98, 0x1283_5B01, 0x2431_85BE, 0x550C_7DC3],
];

/// Units digested per parallel task.
const BLOCK_UNITS: usize = 1 << 20;

/// The portable AES round (the definition; the vector kernels are held to
/// it by the tests, and it to FIPS-197's example by one of them).
mod aes {
    /// `x * 2` in GF(2^8) modulo AES's polynomial.
    const fn xtime(x: u8) -> u8 {
        (x << 1) ^ if x & 0x80 != 0 { 0x1B } else { 0 }
    }

    const fn multiply(mut a: u8, mut b: u8) -> u8 {
        let mut p = 0;
        while b != 0 {
            if b & 1 != 0 {
                p ^= a;
            }
            a = xtime(a);
            b >>= 1;
        }
        p
    }

    /// The S-box, computed: the multiplicative inverse (`x^254`; 0 for 0)
    /// then the affine map.
    const SBOX: [u8; 256] = {
        let mut table = [0u8; 256];
        let mut x = 0;
        while x < 256 {
            let mut inverse = 1u8;
            let mut k = 0;
            while k < 254 {
                inverse = multiply(inverse, x as u8);
                k += 1;
            }
            let b = if x == 0 { 0 } else { inverse };
            table[x] = b ^ b.rotate_left(1) ^ b.rotate_left(2) ^ b.rotate_left(3) ^ b.rotate_left(4) ^ 0x63;
            x += 1;
        }
        table
    };

    /// One encryption round (`aesenc`): byte `4c + r` is row `r` of column `c`.
    pub(super) fn round(state: [u8; 16], key: &[u8; 16]) -> [u8; 16] {
        // ShiftRows (row r rotates left by r) and SubBytes.
        let t: [u8; 16] = std::array::from_fn(|k| {
            let (c, r) = (k / 4, k % 4);
            SBOX[usize::from(state[4 * ((c + r) % 4) + r])]
        });
        let mut out = [0u8; 16];
        for c in 0..4 {
            let a = [t[4 * c], t[4 * c + 1], t[4 * c + 2], t[4 * c + 3]];
            let x = a.map(xtime);
            out[4 * c] = x[0] ^ x[1] ^ a[1] ^ a[2] ^ a[3] ^ key[4 * c];
            out[4 * c + 1] = a[0] ^ x[1] ^ x[2] ^ a[2] ^ a[3] ^ key[4 * c + 1];
            out[4 * c + 2] = a[0] ^ a[1] ^ x[2] ^ x[3] ^ a[3] ^ key[4 * c + 2];
            out[4 * c + 3] = x[0] ^ a[0] ^ a[1] ^ a[2] ^ x[3] ^ key[4 * c + 3];
        }
        out
    }

    #[cfg(test)]
    pub(super) fn last_round(state: [u8; 16], key: &[u8; 16]) -> [u8; 16] {
        std::array::from_fn(|k| {
            let (c, r) = (k / 4, k % 4);
            SBOX[usize::from(state[4 * ((c + r) % 4) + r])] ^ key[k]
        })
    }

    #[cfg(test)]
    pub(super) const fn sbox(x: u8) -> u8 {
        SBOX[x as usize]
    }
}

/// The round keys as bytes.
const ROUND_KEY_BYTES: [[u8; 16]; 3] = {
    let mut out = [[0u8; 16]; 3];
    let mut r = 0;
    while r < 3 {
        let mut l = 0;
        while l < 4 {
            let b = ROUND_KEYS[r][l].to_le_bytes();
            let mut j = 0;
            while j < 4 {
                out[r][4 * l + j] = b[j];
                j += 1;
            }
            l += 1;
        }
        r += 1;
    }
    out
};

/// `h(i, u)` for one unit, as its four lanes, by the CPU's AES
/// instructions where it has them.
fn unit_hash(index: u64, unit: u32) -> [u32; LANES] {
    // Safety (each arm): the CPU has the kernel's instructions (`detect`).
    #[allow(unsafe_code)]
    match Kernel::detect() {
        Kernel::Portable => portable_unit_hash(index, unit),
        #[cfg(target_arch = "x86_64")]
        Kernel::AesNi | Kernel::Vaes256 | Kernel::Avx512 => unsafe { aesni::unit_hash(index, unit) },
        #[cfg(target_arch = "aarch64")]
        Kernel::Neon => unsafe { neon::unit_hash(index, unit) },
    }
}

/// `h(i, u)` for one unit, as its four lanes: the definition.
fn portable_unit_hash(index: u64, unit: u32) -> [u32; LANES] {
    let mut s = [0u8; 16];
    s[..4].copy_from_slice(&unit.to_le_bytes());
    s[4..12].copy_from_slice(&index.to_le_bytes());
    for key in &ROUND_KEY_BYTES {
        s = aes::round(s, key);
    }
    std::array::from_fn(|l| u32::from_le_bytes(s[4 * l..4 * l + 4].try_into().expect("4 bytes")))
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
    // index's high half (the kernels count the low half in 32-bit lanes).
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
    Kernel::detect().sum_run(bytes, unit_bytes, first_unit)
}

/// The lane sums of units `first_unit..` of one run (no 2^32 crossing), one
/// unit at a time: the definition, and the fallback without AES
/// instructions.
fn sum_run_portable(bytes: &[u8], unit_bytes: usize, first_unit: u64) -> DigestSum {
    let mut sums = DigestSum::ZERO;
    for (i, u) in bytes.chunks_exact(unit_bytes).enumerate() {
        let mut w = [0u8; 4];
        w[..unit_bytes].copy_from_slice(u);
        let h = portable_unit_hash(first_unit + i as u64, u32::from_le_bytes(w));
        sums = sums.plus(DigestSum(h));
    }
    sums
}

/// Units buffered before they are hashed together.
const MOVE_BATCH: usize = 64;

/// Accumulates `h(i, new) - h(i, old)` over changed words as they are
/// written (by an apply loop, an encoder): the words are buffered and hashed
/// in batches by the widest AES kernel the CPU has, with no per-change
/// allocation.
pub struct DigestMoves {
    word_bytes: usize,
    index: [u32; MOVE_BATCH],
    old: [u32; MOVE_BATCH],
    new: [u32; MOVE_BATCH],
    len: usize,
    sum: DigestSum,
    kernel: Kernel,
}

/// The AES instructions this CPU has for the digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Portable,
    /// AES-NI: one state per instruction.
    #[cfg(target_arch = "x86_64")]
    AesNi,
    /// AVX2 with VAES: two states per instruction.
    #[cfg(target_arch = "x86_64")]
    Vaes256,
    /// AVX-512 with VAES: four states per instruction.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// The Armv8 cryptographic extension.
    #[cfg(target_arch = "aarch64")]
    Neon,
}

impl Kernel {
    /// The kernel for this CPU (probed once).
    fn detect() -> Kernel {
        static KERNEL: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(Kernel::probe)
    }

    fn probe() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if avx512::available() {
                return Kernel::Avx512;
            }
            if avx2::vaes_available() {
                return Kernel::Vaes256;
            }
            if std::arch::is_x86_feature_detected!("aes") {
                return Kernel::AesNi;
            }
        }
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("aes") {
            return Kernel::Neon;
        }
        Kernel::Portable
    }

    /// The lane sums of one run (no 2^32 crossing of the unit index).
    fn sum_run(self, bytes: &[u8], unit_bytes: usize, first_unit: u64) -> DigestSum {
        // Safety (each arm): the CPU has the kernel's instructions (`detect`).
        #[allow(unsafe_code)]
        match self {
            Kernel::Portable => sum_run_portable(bytes, unit_bytes, first_unit),
            #[cfg(target_arch = "x86_64")]
            Kernel::AesNi => unsafe { aesni::sum_run(bytes, unit_bytes, first_unit) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Vaes256 => unsafe { avx2::sum_run(bytes, unit_bytes, first_unit) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe { avx512::sum_run(bytes, unit_bytes, first_unit) },
            #[cfg(target_arch = "aarch64")]
            Kernel::Neon => unsafe { neon::sum_run(bytes, unit_bytes, first_unit) },
        }
    }

    /// `sum h(first + offsets[k], new[k]) - h(first + offsets[k], old[k])`
    /// (equal lengths; all unit indices below 2^32).
    fn moved_at(self, first: u32, offsets: &[u32], old: &[u32], new: &[u32]) -> DigestSum {
        debug_assert!(offsets.len() == old.len() && old.len() == new.len());
        // Safety (each arm): the CPU has the kernel's instructions (`detect`).
        #[allow(unsafe_code)]
        match self {
            Kernel::Portable => offsets.iter().zip(old).zip(new).fold(DigestSum::ZERO, |sum, ((&o, &a), &b)| {
                let i = u64::from(first) + u64::from(o);
                sum.plus(DigestSum(portable_unit_hash(i, b))).minus(DigestSum(portable_unit_hash(i, a)))
            }),
            #[cfg(target_arch = "x86_64")]
            Kernel::AesNi => unsafe { aesni::moved_at(first, offsets, old, new) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Vaes256 => unsafe { avx2::moved_at(first, offsets, old, new) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe { avx512::moved_at(first, offsets, old, new) },
            #[cfg(target_arch = "aarch64")]
            Kernel::Neon => unsafe { neon::moved_at(first, offsets, old, new) },
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
            // Past 2^32 units the index's high half is in the state too,
            // which the batched kernels' 32-bit lanes leave out: one by one
            // (rare).
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
        self.sum = self.sum.plus(self.kernel.moved_at(0, &self.index[..n], &self.old[..n], &self.new[..n]));
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
        if first_element + last < 1 << 32 {
            self.sum = self.sum.plus(self.kernel.moved_at(first_element as u32, offsets, old, new));
            return;
        }
        for k in 0..offsets.len() {
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
pub(crate) mod aesni {
    //! AES-NI: one state per instruction (every x86-64 CPU dcr runs on
    //! has it; the only kernel on those without VAES).
    use super::{DigestSum, LANES, ROUND_KEYS};
    use std::arch::x86_64::*;

    #[inline(always)]
    pub(super) unsafe fn keys() -> [__m128i; 3] {
        std::array::from_fn(|r| {
            let k = ROUND_KEYS[r].map(|x| x as i32);
            _mm_setr_epi32(k[0], k[1], k[2], k[3])
        })
    }

    /// `h` of one state.
    #[inline(always)]
    pub(super) unsafe fn hash(s: __m128i, k: &[__m128i; 3]) -> __m128i {
        _mm_aesenc_si128(_mm_aesenc_si128(_mm_aesenc_si128(s, k[0]), k[1]), k[2])
    }

    #[inline(always)]
    pub(super) unsafe fn lanes(v: __m128i) -> DigestSum {
        let mut a = [0u32; LANES];
        _mm_storeu_si128(a.as_mut_ptr().cast(), v);
        DigestSum(a)
    }

    #[inline(always)]
    unsafe fn unit_at(p: *const u8, unit_bytes: usize) -> u32 {
        match unit_bytes {
            1 => u32::from(*p),
            2 => u32::from(p.cast::<u16>().read_unaligned()),
            _ => p.cast::<u32>().read_unaligned(),
        }
    }

    #[target_feature(enable = "sse2,aes")]
    pub(super) unsafe fn unit_hash(index: u64, unit: u32) -> [u32; LANES] {
        let s = _mm_setr_epi32(unit as i32, index as u32 as i32, (index >> 32) as u32 as i32, 0);
        lanes(hash(s, &keys())).0
    }

    /// Units of one run (no 2^32 crossing), four chains at a time.
    #[target_feature(enable = "sse2,aes")]
    pub(super) unsafe fn sum_run(bytes: &[u8], unit_bytes: usize, first_unit: u64) -> DigestSum {
        let k = keys();
        let n = bytes.len() / unit_bytes;
        let (lo, hi) = (first_unit as u32, (first_unit >> 32) as u32 as i32);
        let p = bytes.as_ptr();
        let mut acc = [_mm_setzero_si128(); 4];
        let mut i = 0;
        while i < n {
            let j = i % 4;
            let s = _mm_setr_epi32(unit_at(p.add(i * unit_bytes), unit_bytes) as i32, lo.wrapping_add(i as u32) as i32, hi, 0);
            acc[j] = _mm_add_epi32(acc[j], hash(s, &k));
            i += 1;
        }
        lanes(_mm_add_epi32(_mm_add_epi32(acc[0], acc[1]), _mm_add_epi32(acc[2], acc[3])))
    }

    /// `sum h(i, new) - h(i, old)` at unit indices `i = first + offsets[k]`
    /// (all below 2^32).
    #[target_feature(enable = "sse2,aes")]
    pub(super) unsafe fn moved_at(first: u32, offsets: &[u32], old: &[u32], new: &[u32]) -> DigestSum {
        let k = keys();
        let mut acc = _mm_setzero_si128();
        for ((&o, &a), &b) in offsets.iter().zip(old).zip(new) {
            let i = first.wrapping_add(o) as i32;
            let (so, sn) = (_mm_setr_epi32(a as i32, i, 0, 0), _mm_setr_epi32(b as i32, i, 0, 0));
            acc = _mm_add_epi32(acc, _mm_sub_epi32(hash(sn, &k), hash(so, &k)));
        }
        lanes(acc)
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(crate) mod avx2 {
    //! The digest moves of the AVX2 kernels (apply, scan), eight changes
    //! per call: by VAES on whole registers (two states per instruction)
    //! where the CPU has it, else by AES-NI on the 128-bit halves. The
    //! kernels take the hash as a type parameter and come in two builds,
    //! one with `vaes` enabled (`vaes_available`); both enable `aes` and
    //! run only where `is_x86_feature_detected!("aes")`.
    use super::aesni;
    use super::{DigestSum, ROUND_KEYS};
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    /// A digest move being summed: the four lanes, in each 128-bit half.
    pub(crate) type MoveAcc = __m256i;

    pub(crate) const fn zero_moves() -> MoveAcc {
        // Safety: an all-zero bit pattern is a valid __m256i.
        unsafe { std::mem::zeroed() }
    }

    /// Whether this CPU has VAES (with AVX2 and AES-NI) for `Vaes`.
    pub(crate) fn vaes_available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("aes") && is_x86_feature_detected!("vaes"))
    }

    /// How an AVX2 kernel hashes its digest moves.
    pub(crate) trait MoveHash {
        /// Add `h(i, new) - h(i, old)` of eight units (unit indices `vi`,
        /// all below 2^32) to `acc`. A lane whose old and new units are
        /// equal adds nothing, so masked-off lanes are passed as zeros.
        ///
        /// # Safety
        /// The CPU has AVX2 and AES-NI, and VAES for `Vaes`; the caller
        /// enables them.
        unsafe fn add_moves(acc: &mut MoveAcc, vi: __m256i, vo: __m256i, vn: __m256i);
    }

    /// AES-NI on the 128-bit halves (one state per instruction).
    pub(crate) struct AesNi;
    /// VAES on whole registers (two states per instruction).
    pub(crate) struct Vaes;

    /// The units of `v` at indices `vi` as eight states (`(u, i, 0, 0)`),
    /// two per register: units 0 and 4, 1 and 5, 2 and 6, 3 and 7.
    #[inline(always)]
    unsafe fn states(v: __m256i, vi: __m256i) -> [__m256i; 4] {
        let z = _mm256_setzero_si256();
        let (lo, hi) = (_mm256_unpacklo_epi32(v, vi), _mm256_unpackhi_epi32(v, vi));
        [_mm256_unpacklo_epi64(lo, z), _mm256_unpackhi_epi64(lo, z), _mm256_unpacklo_epi64(hi, z), _mm256_unpackhi_epi64(hi, z)]
    }

    impl MoveHash for AesNi {
        #[inline(always)]
        unsafe fn add_moves(acc: &mut MoveAcc, vi: __m256i, vo: __m256i, vn: __m256i) {
            let k = aesni::keys();
            let hash = |s: __m256i| {
                _mm_add_epi32(aesni::hash(_mm256_castsi256_si128(s), &k), aesni::hash(_mm256_extracti128_si256::<1>(s), &k))
            };
            let (old, new) = (states(vo, vi), states(vn, vi));
            let mut sum = _mm_setzero_si128();
            for q in 0..4 {
                sum = _mm_add_epi32(sum, _mm_sub_epi32(hash(new[q]), hash(old[q])));
            }
            *acc = _mm256_add_epi32(*acc, _mm256_inserti128_si256::<0>(_mm256_setzero_si256(), sum));
        }
    }

    #[inline(always)]
    unsafe fn keys() -> [__m256i; 3] {
        std::array::from_fn(|r| {
            let k = ROUND_KEYS[r].map(|x| x as i32);
            _mm256_setr_epi32(k[0], k[1], k[2], k[3], k[0], k[1], k[2], k[3])
        })
    }

    #[inline(always)]
    unsafe fn hash(s: __m256i, k: &[__m256i; 3]) -> __m256i {
        _mm256_aesenc_epi128(_mm256_aesenc_epi128(_mm256_aesenc_epi128(s, k[0]), k[1]), k[2])
    }

    impl MoveHash for Vaes {
        #[inline(always)]
        unsafe fn add_moves(acc: &mut MoveAcc, vi: __m256i, vo: __m256i, vn: __m256i) {
            let k = keys();
            let (old, new) = (states(vo, vi), states(vn, vi));
            let mut sum = *acc;
            for q in 0..4 {
                sum = _mm256_add_epi32(sum, _mm256_sub_epi32(hash(new[q], &k), hash(old[q], &k)));
            }
            *acc = sum;
        }
    }

    /// The digest move held in `acc`.
    #[inline(always)]
    pub(crate) unsafe fn moves_sum(acc: &MoveAcc) -> DigestSum {
        aesni::lanes(_mm_add_epi32(_mm256_castsi256_si128(*acc), _mm256_extracti128_si256::<1>(*acc)))
    }

    /// `sum h(i, new) - h(i, old)` at unit indices `i = first + offsets[k]`
    /// (all below 2^32; equal lengths), by VAES eight at a time, the last
    /// few by AES-NI.
    #[target_feature(enable = "avx2,aes,vaes")]
    pub(super) unsafe fn moved_at(first: u32, offsets: &[u32], old: &[u32], new: &[u32]) -> DigestSum {
        let mut acc = zero_moves();
        let n = offsets.len() / 8 * 8;
        let base = _mm256_set1_epi32(first as i32);
        let mut i = 0;
        while i < n {
            let vi = _mm256_add_epi32(base, _mm256_loadu_si256(offsets.as_ptr().add(i).cast()));
            let vo = _mm256_loadu_si256(old.as_ptr().add(i).cast());
            let vn = _mm256_loadu_si256(new.as_ptr().add(i).cast());
            Vaes::add_moves(&mut acc, vi, vo, vn);
            i += 8;
        }
        moves_sum(&acc).plus(aesni::moved_at(first, &offsets[n..], &old[n..], &new[n..]))
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

    /// The lane sums of one run (no 2^32 crossing), eight units per step,
    /// by VAES.
    #[target_feature(enable = "avx2,aes,vaes")]
    pub(super) unsafe fn sum_run(bytes: &[u8], unit_bytes: usize, first_unit: u64) -> DigestSum {
        let n = bytes.len() / unit_bytes;
        let full = n / 8 * 8;
        let k = keys();
        // hi32 of the index in dword 2 of each state.
        let hi = (first_unit >> 32) as u32 as i32;
        let high = _mm256_setr_epi32(0, 0, hi, 0, 0, 0, hi, 0);
        let mut idx = _mm256_add_epi32(_mm256_set1_epi32(first_unit as u32 as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        let eight = _mm256_set1_epi32(8);
        let mut acc = [_mm256_setzero_si256(); 2];
        let p = bytes.as_ptr();
        let mut i = 0;
        while i < full {
            for (q, s) in states(load8(p.add(i * unit_bytes), unit_bytes), idx).into_iter().enumerate() {
                acc[q % 2] = _mm256_add_epi32(acc[q % 2], hash(_mm256_xor_si256(s, high), &k));
            }
            idx = _mm256_add_epi32(idx, eight);
            i += 8;
        }
        let tail = aesni::sum_run(&bytes[full * unit_bytes..], unit_bytes, first_unit + full as u64);
        moves_sum(&_mm256_add_epi32(acc[0], acc[1])).plus(tail)
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(crate) mod avx512 {
    //! AVX-512 with VAES: four states per instruction, sixteen units per
    //! step (same sums as the AES-NI and portable kernels).
    use super::{DigestSum, ROUND_KEYS};
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    /// Whether this CPU runs these kernels (AVX-512 F, VAES and AES-NI);
    /// the codec's AVX-512 kernels that add moves check it too.
    pub(crate) fn available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("vaes") && is_x86_feature_detected!("aes")
        })
    }

    /// Per group of four units (`4q..4q+3`): the permute that puts unit
    /// `4q + m` in dword 0 and its index (from the second operand) in dword
    /// 1 of 128-bit lane `m` (dwords 2 and 3 are masked to zero).
    const PICK: [[i32; 16]; 4] = {
        let mut out = [[0i32; 16]; 4];
        let mut q = 0;
        while q < 4 {
            let mut m = 0;
            while m < 4 {
                out[q][4 * m] = (4 * q + m) as i32;
                out[q][4 * m + 1] = (16 + 4 * q + m) as i32;
                m += 1;
            }
            q += 1;
        }
        out
    };
    /// Dwords 0 and 1 of every 128-bit lane.
    const LOW_DWORDS: __mmask16 = 0x3333;

    #[inline(always)]
    unsafe fn keys() -> [__m512i; 3] {
        std::array::from_fn(|r| {
            let k = ROUND_KEYS[r].map(|x| x as i32);
            _mm512_broadcast_i32x4(_mm_setr_epi32(k[0], k[1], k[2], k[3]))
        })
    }

    #[inline(always)]
    unsafe fn hash(s: __m512i, k: &[__m512i; 3]) -> __m512i {
        _mm512_aesenc_epi128(_mm512_aesenc_epi128(_mm512_aesenc_epi128(s, k[0]), k[1]), k[2])
    }

    /// The states of the units in `units` at indices `indices` (below
    /// 2^32), four per vector.
    #[inline(always)]
    unsafe fn states(units: __m512i, indices: __m512i) -> [__m512i; 4] {
        std::array::from_fn(|q| {
            let pick = _mm512_loadu_si512(PICK[q].as_ptr().cast());
            _mm512_maskz_permutex2var_epi32(LOW_DWORDS, units, pick, indices)
        })
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

    #[target_feature(enable = "avx512f,vaes,aes")]
    pub(super) unsafe fn sum_run(bytes: &[u8], unit_bytes: usize, first_unit: u64) -> DigestSum {
        let n = bytes.len() / unit_bytes;
        let full = n / 16 * 16;
        let k = keys();
        // hi32 of the index in dword 2 of each state (the run does not
        // cross 2^32).
        let high = _mm512_maskz_set1_epi32(0x4444, (first_unit >> 32) as u32 as i32);
        let steps = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let mut idx = _mm512_add_epi32(_mm512_set1_epi32(first_unit as u32 as i32), steps);
        let sixteen = _mm512_set1_epi32(16);
        let mut acc = [_mm512_setzero_si512(); 2];
        let p = bytes.as_ptr();
        let mut i = 0;
        while i < full {
            let s = states(load16(p.add(i * unit_bytes), unit_bytes), idx);
            for (q, &state) in s.iter().enumerate() {
                acc[q % 2] = _mm512_add_epi32(acc[q % 2], hash(_mm512_xor_si512(state, high), &k));
            }
            idx = _mm512_add_epi32(idx, sixteen);
            i += 16;
        }
        let tail = super::aesni::sum_run(&bytes[full * unit_bytes..], unit_bytes, first_unit + full as u64);
        moves_sum(&_mm512_add_epi32(acc[0], acc[1])).plus(tail)
    }

    /// Lane sums of digest moves being accumulated in a vector register
    /// (four 128-bit lanes of the digest's four lanes).
    pub(crate) type MoveAcc = __m512i;

    pub(crate) const fn zero_moves() -> MoveAcc {
        // Safety: an all-zero bit pattern is a valid __m512i.
        unsafe { std::mem::zeroed() }
    }

    /// Add `h(i, new) - h(i, old)` of sixteen units (unit indices `vi`, all
    /// below 2^32) to `acc`. A lane whose old and new units are equal adds
    /// nothing, so masked-off lanes are passed as zeros. The callers
    /// enable `avx512f` and `vaes` and check `available`.
    #[inline(always)]
    pub(crate) unsafe fn add_moves(acc: &mut MoveAcc, vi: __m512i, vo: __m512i, vn: __m512i) {
        let k = keys();
        let (old, new) = (states(vo, vi), states(vn, vi));
        let mut sum = *acc;
        for q in 0..4 {
            sum = _mm512_add_epi32(sum, _mm512_sub_epi32(hash(new[q], &k), hash(old[q], &k)));
        }
        *acc = sum;
    }

    /// How the AVX-512 gather and apply kernels hash their digest moves:
    /// VAES (`add_moves`) where the CPU has it, else AES-NI on the 128-bit
    /// quarters (the AVX-512 CPUs before Ice Lake: Skylake-X, Cascade
    /// Lake). The kernels come in one build per hash.
    pub(crate) trait MoveHash {
        /// `add_moves`, by this hash.
        ///
        /// # Safety
        /// The CPU has AVX-512 F and AES-NI, and VAES for `Vaes`; the
        /// caller enables them.
        unsafe fn add_moves(acc: &mut MoveAcc, vi: __m512i, vo: __m512i, vn: __m512i);
    }

    /// Four states per VAES instruction.
    pub(crate) struct Vaes;
    /// One state per AES-NI instruction.
    pub(crate) struct AesNi;

    impl MoveHash for Vaes {
        #[inline(always)]
        unsafe fn add_moves(acc: &mut MoveAcc, vi: __m512i, vo: __m512i, vn: __m512i) {
            add_moves(acc, vi, vo, vn);
        }
    }

    impl MoveHash for AesNi {
        #[inline(always)]
        unsafe fn add_moves(acc: &mut MoveAcc, vi: __m512i, vo: __m512i, vn: __m512i) {
            use super::avx2::MoveHash as _;
            let mut sum = super::avx2::zero_moves();
            let low = |v: __m512i| _mm512_castsi512_si256(v);
            let high = |v: __m512i| _mm512_extracti64x4_epi64::<1>(v);
            super::avx2::AesNi::add_moves(&mut sum, low(vi), low(vo), low(vn));
            super::avx2::AesNi::add_moves(&mut sum, high(vi), high(vo), high(vn));
            *acc = _mm512_add_epi32(*acc, _mm512_inserti64x4::<0>(_mm512_setzero_si512(), sum));
        }
    }

    /// The digest move held in `acc`.
    #[inline(always)]
    pub(crate) unsafe fn moves_sum(acc: &MoveAcc) -> DigestSum {
        let half = _mm256_add_epi32(_mm512_castsi512_si256(*acc), _mm512_extracti64x4_epi64::<1>(*acc));
        let quarter = _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256::<1>(half));
        let mut a = [0u32; 4];
        _mm_storeu_si128(a.as_mut_ptr().cast(), quarter);
        DigestSum(a)
    }

    /// `sum h(i, new) - h(i, old)` at unit indices `i = first + offsets[k]`
    /// (all below 2^32; equal lengths), sixteen at a time, the last few by
    /// AES-NI.
    #[target_feature(enable = "avx512f,vaes,aes")]
    pub(super) unsafe fn moved_at(first: u32, offsets: &[u32], old: &[u32], new: &[u32]) -> DigestSum {
        let mut acc = zero_moves();
        let n = offsets.len() / 16 * 16;
        let base = _mm512_set1_epi32(first as i32);
        let mut i = 0;
        while i < n {
            let vi = _mm512_add_epi32(base, _mm512_loadu_si512(offsets.as_ptr().add(i).cast()));
            let vo = _mm512_loadu_si512(old.as_ptr().add(i).cast());
            let vn = _mm512_loadu_si512(new.as_ptr().add(i).cast());
            add_moves(&mut acc, vi, vo, vn);
            i += 16;
        }
        moves_sum(&acc).plus(super::aesni::moved_at(first, &offsets[n..], &old[n..], &new[n..]))
    }
}

#[cfg(target_arch = "aarch64")]
#[allow(unsafe_code)]
mod neon {
    //! The Armv8 cryptographic extension: `aesenc(s, k)` is
    //! `AESMC(AESE(s, 0)) ^ k`.
    use super::{DigestSum, LANES, ROUND_KEY_BYTES};
    use std::arch::aarch64::*;

    #[inline(always)]
    unsafe fn keys() -> [uint8x16_t; 3] {
        std::array::from_fn(|r| vld1q_u8(ROUND_KEY_BYTES[r].as_ptr()))
    }

    #[target_feature(enable = "neon,aes")]
    #[inline]
    unsafe fn hash(mut s: uint8x16_t, k: &[uint8x16_t; 3]) -> uint32x4_t {
        let zero = vdupq_n_u8(0);
        for key in k {
            s = veorq_u8(vaesmcq_u8(vaeseq_u8(s, zero)), *key);
        }
        vreinterpretq_u32_u8(s)
    }

    #[inline(always)]
    unsafe fn state(unit: u32, index: u64) -> uint8x16_t {
        let words = [unit, index as u32, (index >> 32) as u32, 0];
        vreinterpretq_u8_u32(vld1q_u32(words.as_ptr()))
    }

    #[inline(always)]
    unsafe fn lanes(v: uint32x4_t) -> DigestSum {
        let mut a = [0u32; LANES];
        vst1q_u32(a.as_mut_ptr(), v);
        DigestSum(a)
    }

    #[target_feature(enable = "neon,aes")]
    pub(super) unsafe fn unit_hash(index: u64, unit: u32) -> [u32; LANES] {
        lanes(hash(state(unit, index), &keys())).0
    }

    #[target_feature(enable = "neon,aes")]
    pub(super) unsafe fn sum_run(bytes: &[u8], unit_bytes: usize, first_unit: u64) -> DigestSum {
        let k = keys();
        let mut acc = [vdupq_n_u32(0); 4];
        for (i, u) in bytes.chunks_exact(unit_bytes).enumerate() {
            let mut w = [0u8; 4];
            w[..unit_bytes].copy_from_slice(u);
            let h = hash(state(u32::from_le_bytes(w), first_unit + i as u64), &k);
            acc[i % 4] = vaddq_u32(acc[i % 4], h);
        }
        lanes(vaddq_u32(vaddq_u32(acc[0], acc[1]), vaddq_u32(acc[2], acc[3])))
    }

    #[target_feature(enable = "neon,aes")]
    pub(super) unsafe fn moved_at(first: u32, offsets: &[u32], old: &[u32], new: &[u32]) -> DigestSum {
        let k = keys();
        let mut acc = vdupq_n_u32(0);
        for ((&o, &a), &b) in offsets.iter().zip(old).zip(new) {
            let i = u64::from(first.wrapping_add(o));
            acc = vaddq_u32(acc, vsubq_u32(hash(state(b, i), &k), hash(state(a, i), &k)));
        }
        lanes(acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, one unit at a time through the portable AES round.
    fn reference(bytes: &[u8], word_bytes: usize, first_element: u64) -> Digest {
        let mut s = DigestSum::ZERO;
        let mut add = |index: u64, unit: u32| s = s.plus(DigestSum(portable_unit_hash(index, unit)));
        for (k, w) in bytes.chunks_exact(word_bytes).enumerate() {
            let mut word = [0u8; 8];
            word[..word_bytes].copy_from_slice(w);
            let word = u64::from_le_bytes(word);
            let e = first_element + k as u64;
            if word_bytes == 8 {
                add(2 * e, word as u32);
                add(2 * e + 1, (word >> 32) as u32);
            } else {
                add(e, word as u32);
            }
        }
        s.digest()
    }

    /// The portable round is AES's: AES-128 built from it (the key
    /// expansion written here) encrypts FIPS-197's example block (appendix
    /// C.1) to the published ciphertext.
    #[test]
    fn the_portable_round_is_aes() {
        let hex = |s: &str| -> [u8; 16] { std::array::from_fn(|k| u8::from_str_radix(&s[2 * k..2 * k + 2], 16).unwrap()) };
        let key = hex("000102030405060708090a0b0c0d0e0f");
        let mut words: Vec<[u8; 4]> = key.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]).collect();
        let mut rcon = 1u8;
        for i in 4..44 {
            let mut t = words[i - 1];
            if i % 4 == 0 {
                t = [aes::sbox(t[1]) ^ rcon, aes::sbox(t[2]), aes::sbox(t[3]), aes::sbox(t[0])];
                rcon = (rcon << 1) ^ if rcon & 0x80 != 0 { 0x1B } else { 0 };
            }
            let w = words[i - 4];
            words.push(std::array::from_fn(|j| w[j] ^ t[j]));
        }
        let round_key = |r: usize| -> [u8; 16] { std::array::from_fn(|k| words[4 * r + k / 4][k % 4]) };
        let plain = hex("00112233445566778899aabbccddeeff");
        let mut s: [u8; 16] = std::array::from_fn(|k| plain[k] ^ key[k]);
        for r in 1..10 {
            s = aes::round(s, &round_key(r));
        }
        s = aes::last_round(s, &round_key(10));
        assert_eq!(s, hex("69c4e0d86a7b0430d8cdb78070b4c55a"));
    }

    /// The hash this CPU computes (AES instructions where it has them) is
    /// the definition's, for indices past 2^32 too.
    #[test]
    fn unit_hash_is_the_definition() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let (index, unit) = (x >> (x % 40), (x >> 17) as u32);
            assert_eq!(unit_hash(index, unit), portable_unit_hash(index, unit), "index {index} unit {unit:#x}");
        }
    }

    /// The definition pinned: a digest that any change of the round, the
    /// keys, the state layout or the lane order would move (the values
    /// come from the portable definition, itself held to FIPS-197 above).
    #[test]
    fn known_digests() {
        let b: Vec<u8> = (0..64u32).map(|k| (k * 37 + 11) as u8).collect();
        let hex = |d: Digest| d.iter().map(|x| format!("{x:02x}")).collect::<String>();
        assert_eq!(hex(tensor_digest(&b, 2)), KNOWN_BF16);
        assert_eq!(hex(partial_digest(&b, 8, (1 << 31) + 3).digest()), KNOWN_F64_HIGH);
    }
    const KNOWN_BF16: &str = "811ebe6a6352392c2498bd7b4558f335";
    const KNOWN_F64_HIGH: &str = "92d438246d6114698b3f08ceabca0439";

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

    /// Every AES kernel this CPU runs gives the portable sums (the
    /// dispatch picks only the widest, so each is called here directly).
    #[test]
    fn every_kernel_agrees_with_the_portable_one() {
        let mut kernels = vec![];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("aes") {
                kernels.push(Kernel::AesNi);
            }
            if avx2::vaes_available() {
                kernels.push(Kernel::Vaes256);
            }
            if avx512::available() {
                kernels.push(Kernel::Avx512);
            }
        }
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("aes") {
            kernels.push(Kernel::Neon);
        }
        for unit in [1usize, 2, 4] {
            for n in [0usize, 15, 16, 17, 100, 1027] {
                let b = bytes(n * unit, (n * unit) as u64 + 1);
                for first in [0u64, 9, (1 << 32) + 5] {
                    let want = sum_run_portable(&b, unit, first);
                    for &k in &kernels {
                        assert_eq!(k.sum_run(&b, unit, first), want, "{k:?} unit={unit} n={n} first={first}");
                    }
                }
            }
        }
        let offsets: Vec<u32> = (0..171u32).map(|k| k * 37 + k % 3).collect();
        let old: Vec<u32> = offsets.iter().map(|&o| o.wrapping_mul(0x9E37_79B9)).collect();
        let new: Vec<u32> = old.iter().map(|&o| o ^ 0x0001_0003).collect();
        for first in [0u32, 1 << 20] {
            let mut want = DigestSum::ZERO;
            for k in 0..offsets.len() {
                let i = u64::from(first + offsets[k]);
                want = want.plus(DigestSum(portable_unit_hash(i, new[k]))).minus(DigestSum(portable_unit_hash(i, old[k])));
            }
            for &k in &kernels {
                assert_eq!(k.moved_at(first, &offsets, &old, &new), want, "{k:?} first={first}");
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
