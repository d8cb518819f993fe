//! Rice codes of ascending values: the positions of a chunk's changes (the
//! context-free `rice` encoding) and the changed ranks of a bucket (the
//! context-aware payload).
//!
//! A value is coded as its gap from the previous one (`value - previous -
//! 1`, the first previous being -1), and a gap `g` with parameter `k` as
//! `q = g >> k` in unary and its `k` low bits. The two parts go to two
//! sections, every list's low parts first, then every list's unary parts
//! (`q` zeros and a one per gap), instead of one code after the other. The
//! bits are as many, but a decoder needs no chain through a bit reader:
//! the `i`-th value of a list is `((t_i - i) << k) + (l_0 + ... + l_i) + i`,
//! `t_i` being the offset of the list's `i`-th one in its unary part and
//! `l_j` the `j`-th low part, so it finds the ones of the unary bits a word
//! at a time and adds up the low parts sixteen lanes at a time.
//!
//! There is no escape for long gaps: the unary parts of a list whose values
//! stay below `limit` take at most `count + (limit >> k)` bits, which also
//! bounds what a decoder scans.

use std::mem::MaybeUninit;

use super::bits::BitWriter;

/// The bits of the gaps as Rice codes with parameters `k0`, `k0 + 1` and
/// `k0 + 2` (all below 32), in one pass the compiler vectorises: with `h =
/// g >> k0`, the unary parts add up to the sums of `h`, `h >> 1 = (h - (h
/// & 1)) / 2` and `h >> 2 = (h - (h & 3)) / 4`.
fn rice_costs(gaps: &[u32], k0: u32) -> [u64; 3] {
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        // Safety: the CPU has AVX-512 F (just checked).
        #[allow(unsafe_code)]
        return unsafe { avx512::rice_costs(gaps, k0) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::codec::avx2_available() {
        // Safety: the CPU has AVX2 (just checked).
        #[allow(unsafe_code)]
        return unsafe { rice_costs_avx2(gaps, k0) };
    }
    rice_costs_any(gaps, k0)
}

/// `rice_costs_any` compiled for AVX2, which the compiler vectorises eight
/// gaps wide (the free diff 0.95-0.99 of the time at several optimizer
/// steps, paired, on a Zen 3 without AVX-512).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn rice_costs_avx2(gaps: &[u32], k0: u32) -> [u64; 3] {
    rice_costs_any(gaps, k0)
}

/// Sums of `h = g >> k0` over gaps, of `h & 1` and of `h & 3`.
#[derive(Default)]
struct UnarySums {
    high: u64,
    odd: u64,
    low2: u64,
}

impl UnarySums {
    /// Gaps handled per block: short enough for 32-bit sums of `h & 3`.
    const BLOCK: usize = 1 << 20;

    /// Add the sums of one block (at most `BLOCK` gaps, given one by one).
    #[inline(always)]
    fn add_block(&mut self, gaps: impl Iterator<Item = u32>, k0: u32) {
        let (mut h_sum, mut odd_sum, mut low2_sum) = (0u64, 0u32, 0u32);
        for g in gaps {
            let h = g >> k0;
            h_sum += u64::from(h);
            odd_sum += h & 1;
            low2_sum += h & 3;
        }
        self.high += h_sum;
        self.odd += u64::from(odd_sum);
        self.low2 += u64::from(low2_sum);
    }

    /// The bits of `m` gaps' Rice codes with parameters `k0`, `k0 + 1` and
    /// `k0 + 2`.
    fn costs(&self, m: usize, k0: u32) -> [u64; 3] {
        let unary = [self.high, (self.high - self.odd) / 2, (self.high - self.low2) / 4];
        [0u32, 1, 2].map(|i| unary[i as usize] + m as u64 * u64::from(1 + k0 + i))
    }
}

#[inline(always)]
fn rice_costs_any(gaps: &[u32], k0: u32) -> [u64; 3] {
    let mut sums = UnarySums::default();
    for block in gaps.chunks(UnarySums::BLOCK) {
        sums.add_block(block.iter().copied(), k0);
    }
    sums.costs(gaps.len(), k0)
}

/// The bits of the gaps' Rice codes with parameter `k < 32`.
pub(super) fn code_bits(gaps: &[u32], k: u32) -> u64 {
    rice_costs_any(gaps, k)[0]
}

/// The Rice parameter that codes `gaps` (of `m` values over `span`) in the
/// fewest bits, and those bits: three candidates around the one the mean
/// gap suggests.
pub(super) fn best_rice_parameter(gaps: &[u32], span: u64, m: u64) -> (u32, u64) {
    let k0 = first_candidate(span, m);
    best_candidate(rice_costs(gaps, k0), k0)
}

/// The smallest of the three parameters `best_rice_parameter` weighs: one
/// below the one that suits a geometric distribution of that mean gap.
fn first_candidate(span: u64, m: u64) -> u32 {
    let mean = (span - m) as f64 / m as f64;
    let guess = if mean > 1.0 { (mean * std::f64::consts::LN_2).log2().max(0.0) as u32 } else { 0 };
    guess.saturating_sub(1).min(29)
}

fn best_candidate(costs: [u64; 3], k0: u32) -> (u32, u64) {
    let best = (0..3).min_by_key(|&i| costs[i]).expect("three candidates");
    (k0 + best as u32, costs[best])
}

/// The gaps of ascending `positions` (`position - previous - 1`, the first
/// previous being -1) appended to `gaps`, and `best_rice_parameter` of
/// them, from the same pass over the positions (where the gaps were
/// written by one pass and read back by the next).
pub(super) fn gaps_and_best_parameter(positions: &[u32], gaps: &mut Vec<u32>) -> (u32, u64) {
    let (m, span) = (positions.len() as u64, positions.last().map_or(0, |&p| u64::from(p) + 1));
    let k0 = first_candidate(span, m);
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        // Safety: the CPU has AVX-512 F (just checked).
        #[allow(unsafe_code)]
        return best_candidate(unsafe { gaps_and_costs_avx512(positions, gaps, k0) }, k0);
    }
    #[cfg(target_arch = "x86_64")]
    if crate::codec::avx2_available() {
        // Safety: the CPU has AVX2 (just checked).
        #[allow(unsafe_code)]
        return best_candidate(unsafe { gaps_and_costs_avx2(positions, gaps, k0) }, k0);
    }
    best_candidate(gaps_and_costs_any(positions, gaps, k0), k0)
}

/// `gaps_and_costs_any` compiled for AVX-512 F, vectorised sixteen wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn gaps_and_costs_avx512(positions: &[u32], gaps: &mut Vec<u32>, k0: u32) -> [u64; 3] {
    gaps_and_costs_any(positions, gaps, k0)
}

/// `gaps_and_costs_any` compiled for AVX2, vectorised eight wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn gaps_and_costs_avx2(positions: &[u32], gaps: &mut Vec<u32>, k0: u32) -> [u64; 3] {
    gaps_and_costs_any(positions, gaps, k0)
}

/// The gaps appended and their `rice_costs` with `k0`.
#[inline(always)]
fn gaps_and_costs_any(positions: &[u32], gaps: &mut Vec<u32>, k0: u32) -> [u64; 3] {
    let Some((&first, _)) = positions.split_first() else {
        return UnarySums::default().costs(0, k0);
    };
    let n = positions.len();
    gaps.reserve(n);
    let start = gaps.len();
    let out = &mut gaps.spare_capacity_mut()[..n];
    out[0].write(first);
    // Sums in 32 bits, sixteen lanes to a register where the 64-bit sum
    // of `h` took two: none can overflow, since the gaps of ascending u32
    // positions add up to less than the last position, and `h = g >> k0`,
    // `h & 1` and `h & 3` are each at most `g`.
    let (mut high, mut odd, mut low2) = (0u32, 0u32, 0u32);
    for (o, (&p, &q)) in out[1..].iter_mut().zip(positions[1..].iter().zip(positions)) {
        // Independent differences of neighbours: `next[i] - previous[i] - 1`.
        let g = p - q - 1;
        o.write(g);
        let h = g >> k0;
        high += h;
        odd += h & 1;
        low2 += h & 3;
    }
    let h = first >> k0;
    let sums = UnarySums {
        high: u64::from(high) + u64::from(h),
        odd: u64::from(odd) + u64::from(h & 1),
        low2: u64::from(low2) + u64::from(h & 3),
    };
    // Safety: the `n` slots past `start` were all written just above.
    #[allow(unsafe_code)]
    unsafe {
        gaps.set_len(start + n)
    };
    sums.costs(n, k0)
}

/// The most bytes a Rice stream of `count` values below `limit` can take:
/// low parts of at most 31 bits and unary parts of at most `count + limit`
/// bits (for any parameter), each section padded to whole bytes.
pub(super) fn stream_bound(count: usize, limit: usize) -> usize {
    count.saturating_mul(4).saturating_add(count.saturating_add(limit) / 8).saturating_add(2)
}

/// Writes lists of gaps as Rice codes, every list's low parts in one
/// section and every list's unary parts in the next.
pub(super) struct RiceWriter {
    lows: BitWriter,
    /// The unary parts' bits, least significant first.
    unary: Vec<u64>,
    unary_bits: u64,
}

impl RiceWriter {
    pub(super) fn new() -> Self {
        RiceWriter { lows: BitWriter::new(), unary: Vec::new(), unary_bits: 0 }
    }

    /// A writer with room for codes of `low_bits` low-part bits and
    /// `unary_bits` unary bits before it grows.
    pub(super) fn with_capacity(low_bits: u64, unary_bits: u64) -> Self {
        // (The vector kernels ask for 16 bytes of slack past the codes.)
        let lows = BitWriter::with_capacity(usize::try_from(low_bits.div_ceil(8) + 16).unwrap_or(0));
        RiceWriter { lows, unary: Vec::with_capacity(usize::try_from(unary_bits.div_ceil(64) + 1).unwrap_or(0)), unary_bits: 0 }
    }

    /// Append one list's gaps with parameter `k < 32`, `bits` their codes'
    /// bits (as `best_rice_parameter` counts them).
    pub(super) fn put_gaps(&mut self, gaps: &[u32], k: u32, bits: u64) {
        debug_assert!(k < 32 && bits == code_bits(gaps, k));
        let end = self.unary_bits + bits - gaps.len() as u64 * u64::from(k);
        // A word of slack: the kernel ORs two words per sixteen gaps.
        self.unary.resize(end.div_ceil(64) as usize + 1, 0);
        #[cfg(target_arch = "x86_64")]
        if avx512::has_kernels() {
            // Safety: the CPU has the kernels' features (just checked);
            // `unary` holds the list's bits, and a word more.
            #[allow(unsafe_code)]
            unsafe {
                let packed = avx512::put_low_parts(&mut self.lows, gaps, k);
                self.lows.put_each(&gaps[packed..], k);
                avx512::put_unary(&mut self.unary, self.unary_bits, gaps, k);
            }
            self.unary_bits = end;
            return;
        }
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut packed = 0;
        #[cfg(target_arch = "x86_64")]
        if avx2::packs_low_parts() {
            // Safety: the CPU has AVX2 and BMI2 (just checked).
            #[allow(unsafe_code)]
            unsafe {
                packed = avx2::put_low_parts(&mut self.lows, gaps, k)
            };
        }
        self.lows.put_each(&gaps[packed..], k);
        #[cfg(target_arch = "x86_64")]
        if super::avx2_available() {
            // Safety: the CPU has AVX2 (just checked); `unary` holds the
            // list's bits, and a word more.
            #[allow(unsafe_code)]
            unsafe {
                avx2::put_unary(&mut self.unary, self.unary_bits, gaps, k)
            };
            self.unary_bits = end;
            return;
        }
        put_unary(&mut self.unary, self.unary_bits, gaps, k);
        self.unary_bits = end;
    }

    /// The low parts' section (padded with zero bits to a whole byte), then
    /// the unary parts' (likewise).
    pub(super) fn finish(self) -> Vec<u8> {
        let mut out = self.lows.finish();
        append_unary(&mut out, &self.unary, self.unary_bits);
        out
    }

    /// `put_stored(out, &self.finish())`, the sections copied once.
    pub(super) fn finish_stored_into(self, out: &mut Vec<u8>) {
        let lows = self.lows.finish();
        super::streams::put_stored_header(out, lows.len() + self.unary_bits.div_ceil(8) as usize);
        out.extend_from_slice(&lows);
        append_unary(out, &self.unary, self.unary_bits);
    }
}

/// The first `bits` of the unary parts `unary`, in bytes, appended to `out`.
fn append_unary(out: &mut Vec<u8>, unary: &[u64], bits: u64) {
    let end = out.len() + bits.div_ceil(8) as usize;
    out.reserve(8 * unary.len());
    for word in unary {
        out.extend_from_slice(&word.to_le_bytes());
    }
    out.truncate(end);
}

/// The unary parts of `gaps` (parameter `k`) into `unary` from bit `at`
/// on: a one `g >> k` bits after the previous code's end. The word being
/// filled stays in a register until the ones move on.
#[inline(always)]
fn put_unary(unary: &mut [u64], mut at: u64, gaps: &[u32], k: u32) {
    let mut word_at = (at / 64) as usize;
    let mut word = 0u64;
    for &g in gaps {
        at += u64::from(g >> k);
        if (at / 64) as usize != word_at {
            unary[word_at] |= word;
            word_at = (at / 64) as usize;
            word = 0;
        }
        word |= 1 << (at % 64);
        at += 1;
    }
    if let Some(last) = unary.get_mut(word_at) {
        *last |= word;
    }
}

/// `put_unary` of a few gaps, returning the bit after their codes.
#[cfg(target_arch = "x86_64")]
fn put_unary_block(unary: &mut [u64], at: u64, gaps: &[u32], k: u32) -> u64 {
    put_unary(unary, at, gaps, k);
    at + gaps.iter().map(|&g| u64::from(g >> k) + 1).sum::<u64>()
}

/// Reads the lists of a stream that `RiceWriter` wrote, in the same order.
pub(super) struct RiceReader {
    /// The low parts' section, then 8 zero bytes: a 4- or 8-byte load at
    /// any of its bits stays inside.
    lows: Vec<u8>,
    /// The next list's first low bit, and the section's bits.
    low_at: u64,
    low_bits: u64,
    /// The unary parts' section as words, then a zero word.
    unary: Vec<u64>,
    /// The next list's first unary bit, and the section's bits (whole
    /// bytes).
    unary_at: u64,
    unary_bits: u64,
}

impl RiceReader {
    /// A reader of `stream`, whose lists' low parts take `low_bits` bits
    /// in all (the sum of their counts times their parameters).
    pub(super) fn new(stream: &[u8], low_bits: u64) -> Result<Self, &'static str> {
        let low_bytes = low_bits.div_ceil(8);
        if low_bytes > stream.len() as u64 {
            return Err("position stream ends early");
        }
        let (low_part, unary_part) = stream.split_at(low_bytes as usize);
        // Zero bytes after the low parts: the scalar loop reads 8 bytes
        // from a part's first byte, the AVX2 kernel two 16-byte halves
        // from a block's.
        const PADDING: usize = 24;
        let mut lows = Vec::with_capacity(low_part.len() + PADDING);
        lows.extend_from_slice(low_part);
        lows.resize(low_part.len() + PADDING, 0);
        // Whole words by a loop the compiler turns into copies, the last
        // part-word once, then a zero word (2-3 % of the free apply at
        // 5-10 % changed, where a zeroed vector was filled through an
        // 8-byte buffer per word).
        let words = unary_part.chunks_exact(8);
        let rest = words.remainder();
        let mut unary = Vec::with_capacity(unary_part.len().div_ceil(8) + 1);
        unary.extend(words.map(|bytes| u64::from_le_bytes(bytes.try_into().expect("8 bytes"))));
        if !rest.is_empty() {
            let mut le = [0u8; 8];
            le[..rest.len()].copy_from_slice(rest);
            unary.push(u64::from_le_bytes(le));
        }
        unary.push(0);
        Ok(RiceReader { lows, low_at: 0, low_bits, unary, unary_at: 0, unary_bits: 8 * unary_part.len() as u64 })
    }

    /// Read the next list: `count` values, each below `limit` (and below
    /// 2^32 - 1), coded with parameter `k < 32`, appended to `out` in
    /// ascending order. Returns the value after the last (0 for an empty
    /// list); `Err` says what is wrong when the stream ends early or a
    /// value would reach `limit`.
    pub(super) fn read_ascending(&mut self, k: u32, count: u64, limit: u64, out: &mut Vec<u32>) -> Result<u64, &'static str> {
        debug_assert!(k < 32);
        // Values are 32-bit: none reaches 2^32 - 1 whatever the caller's
        // limit, and the slots below count zeros in 32 bits.
        let limit = limit.min(u64::from(u32::MAX));
        if count == 0 {
            return Ok(0);
        }
        // Distinct values below `limit`: this also bounds the allocation.
        if count > limit {
            return Err("positions beyond the chunk's elements");
        }
        if self.low_at + count * u64::from(k) > self.low_bits {
            return Err("position stream ends early");
        }
        // The slots are written by `select` before anything reads them: not
        // zeroed first (a pass over 4 bytes per change).
        let start = out.len();
        out.reserve(count as usize);
        let zeros = self.select(&mut out.spare_capacity_mut()[..count as usize], limit >> k)?;
        // Safety: `select` wrote each of the `count` slots after `start`.
        #[allow(unsafe_code)]
        unsafe {
            out.set_len(start + count as usize)
        };
        let slots = &mut out[start..];
        let low_at = self.low_at;
        self.low_at += count * u64::from(k);
        // Every value is at most the last, which is at most this: when it
        // fits, 32-bit lanes cannot wrap.
        let largest = (u128::from(zeros) << k) + u128::from(count) * ((1u128 << k) - 1) + u128::from(count);
        if largest <= 1 << 32 {
            add_low_parts(&self.lows, low_at, k, slots);
        } else {
            add_low_parts_wide(&self.lows, low_at, k, limit, slots)?;
        }
        let last = u64::from(slots[slots.len() - 1]);
        if last >= limit {
            return Err("positions beyond the chunk's elements");
        }
        Ok(last + 1)
    }

    /// Find the next `slots.len()` ones of the unary parts and write, for
    /// each, the zeros before it since the list's start; the list's unary
    /// bits end after the last. Returns the list's zeros. At most
    /// `max_zeros` zeros are read: more cannot belong to values below the
    /// caller's limit.
    fn select(&mut self, slots: &mut [MaybeUninit<u32>], max_zeros: u64) -> Result<u64, &'static str> {
        let count = slots.len() as u64;
        let from = self.unary_at;
        let end = self.unary_bits.min(from + count + max_zeros);
        if !select_ones(&self.unary, from, end, slots) {
            return Err(if end == self.unary_bits { "position stream ends early" } else { "positions beyond the chunk's elements" });
        }
        // The last one is at `zeros + count - 1` from the list's start.
        // Safety: `select_ones` wrote every slot (it found them all).
        #[allow(unsafe_code)]
        let zeros = u64::from(unsafe { slots[slots.len() - 1].assume_init() });
        self.unary_at = from + zeros + count;
        Ok(zeros)
    }

    /// Refuses a stream with ones left after the last list, or more than 7
    /// padding bits after it.
    pub(super) fn finish(&self) -> Result<(), &'static str> {
        let rest = self.unary_at.div_ceil(64) as usize;
        let tail = self.unary[(self.unary_at / 64) as usize] >> (self.unary_at % 64);
        let ones_left = (!self.unary_at.is_multiple_of(64) && tail != 0) || self.unary[rest..].iter().any(|&w| w != 0);
        if ones_left || self.unary_bits - self.unary_at >= 8 {
            return Err("position stream runs on past its last change");
        }
        Ok(())
    }
}

/// Write to each slot the zeros between bit `from` of `unary` and the next
/// one (bits `from..end` only), less the ones between them: the zeros
/// before each one since `from`. False when fewer ones than slots lie
/// there. `end - from` must be below 2^32.
fn select_ones(unary: &[u64], from: u64, end: u64, slots: &mut [MaybeUninit<u32>]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if avx512::has_kernels() {
        // Safety: the CPU has the kernel's features (just checked).
        #[allow(unsafe_code)]
        return unsafe { avx512::select_ones(unary, from, end, slots) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // Safety: the CPU has AVX2 and POPCNT (`avx2::available`).
        #[allow(unsafe_code)]
        return unsafe { avx2::select_ones(unary, from, end, slots) };
    }
    select_ones_with(unary, from, end, slots, emit_ones)
}

/// `select_ones`, a word at a time: `emit(slots, word, zeros_at)` writes
/// one slot per one of `word` (as many as `slots`), the slot of the `j`-th
/// being `zeros_at + its bit - j`.
#[inline(always)]
fn select_ones_with(unary: &[u64], from: u64, end: u64, slots: &mut [MaybeUninit<u32>], emit: impl Fn(&mut [MaybeUninit<u32>], u64, u32)) -> bool {
    let mut word_at = from / 64;
    let mut word = unary[word_at as usize] & (u64::MAX << (from % 64));
    let mut found = 0usize;
    loop {
        let word_start = 64 * word_at;
        if word_start + 64 > end {
            word &= (1u64 << (end - word_start)) - 1;
        }
        let ones = word.count_ones() as usize;
        let need = slots.len() - found;
        // Modulo 2^32, where every slot's value lies: the word's first
        // bit's offset from `from` (less than 2^32 for any but the first
        // word, whose ones lie at or past `from`), less the ones found.
        let zeros_at = (word_start.wrapping_sub(from) as u32).wrapping_sub(found as u32);
        if ones >= need {
            emit(&mut slots[found..], lowest_ones(word, need), zeros_at);
            return true;
        }
        emit(&mut slots[found..found + ones], word, zeros_at);
        found += ones;
        word_at += 1;
        if 64 * word_at >= end {
            return false;
        }
        word = unary[word_at as usize];
    }
}

/// `word` with only its `keep` lowest ones (it has at least that many).
#[inline(always)]
fn lowest_ones(mut word: u64, keep: usize) -> u64 {
    for _ in keep..word.count_ones() as usize {
        word &= !(1u64 << (63 - word.leading_zeros()));
    }
    word
}

#[inline(always)]
fn emit_ones(slots: &mut [MaybeUninit<u32>], mut word: u64, zeros_at: u32) {
    for (j, slot) in slots.iter_mut().enumerate() {
        slot.write(zeros_at.wrapping_add(word.trailing_zeros()).wrapping_sub(j as u32));
        word &= word - 1;
    }
}

/// The `i`-th low part of a list whose low parts start at bit `at`.
#[inline(always)]
fn low_part(lows: &[u8], at: u64, k: u32, i: usize) -> u64 {
    let bit = at + i as u64 * u64::from(k);
    let byte = (bit / 8) as usize;
    let word = u64::from_le_bytes(lows[byte..byte + 8].try_into().expect("8 bytes"));
    (word >> (bit % 8)) & ((1u64 << k) - 1)
}

/// Turn each slot's zeros `z_i` into its value `(z_i << k) + (l_0 + ... +
/// l_i) + i`, where no lane can wrap (the caller checked the largest
/// value).
fn add_low_parts(lows: &[u8], at: u64, k: u32, slots: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    if k <= avx512::MAX_K && at + slots.len() as u64 * u64::from(k) < 1 << 31 && avx512::available() {
        // Safety: the CPU has the kernel's features; `k` and the low bits'
        // extent are within its bounds (checked just above), and `lows`
        // ends with 8 zero bytes past the bits read.
        #[allow(unsafe_code)]
        unsafe {
            if super::x86::vbmi_available() {
                // The CPU also has AVX-512 BW and VBMI.
                avx512::add_low_parts_vbmi(lows, at as u32, k, slots);
            } else {
                avx512::add_low_parts(lows, at as u32, k, slots);
            }
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if k <= avx2::MAX_K && super::avx2_available() {
        // Safety: the CPU has AVX2 and `k` is within the kernel's bound.
        #[allow(unsafe_code)]
        let (done, sum) = unsafe { avx2::add_low_parts(lows, at, k, slots) };
        add_low_parts_from(lows, at, k, slots, done, sum);
        return;
    }
    add_low_parts_scalar(lows, at, k, slots);
}

fn add_low_parts_scalar(lows: &[u8], at: u64, k: u32, slots: &mut [u32]) {
    add_low_parts_from(lows, at, k, slots, 0, 0);
}

/// `add_low_parts_scalar` from slot `first` on, where `sum` is the sum of
/// the low parts before it.
fn add_low_parts_from(lows: &[u8], at: u64, k: u32, slots: &mut [u32], first: usize, mut sum: u32) {
    for (i, slot) in slots.iter_mut().enumerate().skip(first) {
        sum += low_part(lows, at, k, i) as u32;
        *slot = (*slot << k) + sum + i as u32;
    }
}

/// `add_low_parts` in 64 bits, for lists whose values could exceed 32
/// bits (only a corrupt stream's do): refuses the first value that
/// reaches `limit`.
fn add_low_parts_wide(lows: &[u8], at: u64, k: u32, limit: u64, slots: &mut [u32]) -> Result<(), &'static str> {
    let mut sum = 0u64;
    for (i, slot) in slots.iter_mut().enumerate() {
        sum += low_part(lows, at, k, i);
        let value = (u64::from(*slot) << k) + sum + i as u64;
        if value >= limit {
            return Err("positions beyond the chunk's elements");
        }
        *slot = value as u32;
    }
    Ok(())
}

/// The reader's kernels for x86 CPUs without AVX-512 (AVX2 only, no
/// gather): the unary parts' ones selected a byte at a time, and eight low
/// parts taken out of their bytes by one shuffle.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx2 {
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    use super::super::bits::BitWriter;

    /// For each byte value, each of its ones' bit number less the ones
    /// below it (the zeros before it in the byte), in ascending order.
    static ZEROS_BEFORE_ONES: [[u8; 8]; 256] = {
        let mut table = [[0u8; 8]; 256];
        let mut byte = 0;
        while byte < 256 {
            let (mut bit, mut ones) = (0, 0);
            while bit < 8 {
                if byte >> bit & 1 == 1 {
                    table[byte][ones] = (bit - ones) as u8;
                    ones += 1;
                }
                bit += 1;
            }
            byte += 1;
        }
        table
    };

    /// Whether this CPU runs `select_ones` (AVX2 and POPCNT).
    pub(super) fn available() -> bool {
        super::super::avx2_available() && is_x86_feature_detected!("popcnt")
    }

    /// `super::select_ones_with` where the ones of a word become slots a
    /// byte at a time, without a branch per one: the byte's entry of
    /// `ZEROS_BEFORE_ONES`, widened to eight lanes, plus the zeros before
    /// the byte, stored where the byte's first one goes (the next byte's
    /// store overwrites the lanes past its ones), to a buffer whose leading
    /// slots are then copied out. Measured on a Zen 3 host (`ab_timing`,
    /// paired, against the loop over the ones): the free apply of fp32m
    /// 10->15, 12->15 and 10->11 0.90-0.91, bf16 10->11 0.92; the context
    /// apply of 10->15 (whose buckets are Rice lists too) 0.98.
    ///
    /// # Safety
    /// The CPU has AVX2 and POPCNT.
    #[target_feature(enable = "avx2,popcnt")]
    pub(super) unsafe fn select_ones(unary: &[u64], from: u64, end: u64, slots: &mut [MaybeUninit<u32>]) -> bool {
        super::select_ones_with(unary, from, end, slots, |slots, word, zeros_at| {
            let n = slots.len();
            let mut buffer = MaybeUninit::<[u32; 64 + 8]>::uninit();
            let out = buffer.as_mut_ptr().cast::<u32>();
            let mut ones = 0u32;
            for q in 0..8u32 {
                let byte = (word >> (8 * q)) as u8;
                let within = _mm_loadl_epi64(ZEROS_BEFORE_ONES[usize::from(byte)].as_ptr().cast());
                let before = _mm256_set1_epi32(zeros_at.wrapping_add(8 * q).wrapping_sub(ones) as i32);
                _mm256_storeu_si256(out.add(ones as usize).cast(), _mm256_add_epi32(_mm256_cvtepu8_epi32(within), before));
                ones += byte.count_ones();
            }
            debug_assert_eq!(ones as usize, n);
            // Safety: the first `n` (all the word's ones) were stored.
            std::ptr::copy_nonoverlapping(out.cast_const(), slots.as_mut_ptr().cast::<u32>(), n);
        })
    }

    /// The largest parameter the kernel reads: a part and its bit offset
    /// within a byte fit the three bytes each lane takes.
    pub(super) const MAX_K: u32 = 16;

    /// Whether this CPU runs `put_low_parts`: AVX2 and a fast BMI2 (`pext`
    /// is microcoded on AMD before Zen 3).
    pub(super) fn packs_low_parts() -> bool {
        super::super::x86::available()
    }

    /// `BitWriter::put_each` of the low parts of the leading gaps, sixteen
    /// at a time where `k <= 14` (the AVX2 twin of `avx512::put_low_parts`):
    /// narrowed to bytes (`k <= 7`) or 16-bit words by two packs, then
    /// packed by a `pext` per eight bytes. Returns how many it wrote.
    /// Measured on a Zen 3 host (`ab_timing` with `STAGE=diff`, paired,
    /// two runs, against `put_each`'s shifts and ORs): the free diff of
    /// fp32m 10->15 0.93-0.94, synthetic 5 % 0.96, 10->11 0.97-0.99, bf16
    /// 10->11 0.97.
    ///
    /// # Safety
    /// The CPU has AVX2 and BMI2.
    #[target_feature(enable = "avx2,bmi2")]
    pub(super) unsafe fn put_low_parts(lows: &mut BitWriter, gaps: &[u32], k: u32) -> usize {
        if !(1..=14).contains(&k) {
            return 0;
        }
        let blocks = gaps.chunks_exact(16);
        let done = gaps.len() - blocks.remainder().len();
        let mut sink = lows.sink(done * k as usize);
        // The low byte (or half) of each gap, so that the packs, which
        // saturate, keep the bits below it.
        let low = _mm256_set1_epi32(if k <= 7 { 0xFF } else { 0xFFFF });
        let load = |block: &[u32], i: usize| _mm256_and_si256(_mm256_loadu_si256(block.as_ptr().add(i).cast()), low);
        // The packs work within 128-bit lanes: the 16-bit results are
        // gaps 0-3, 8-11, 4-7, 12-15 in turn, put back in order by a
        // permute of 64-bit quarters.
        let halves = |block: &[u32]| _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(load(block, 0), load(block, 8)));
        if k <= 7 {
            let mask = u64::from_le_bytes([((1u32 << k) - 1) as u8; 8]);
            for block in blocks {
                // Bytes 0-7 and 16-23 of the byte pack: gaps 0-7, 8-15.
                let bytes = _mm256_packus_epi16(halves(block), _mm256_setzero_si256());
                sink.put(_pext_u64(_mm256_extract_epi64::<0>(bytes) as u64, mask), 8 * k);
                sink.put(_pext_u64(_mm256_extract_epi64::<2>(bytes) as u64, mask), 8 * k);
            }
        } else {
            let mask = 0x0001_0001_0001_0001 * ((1u64 << k) - 1);
            for block in blocks {
                let words = halves(block);
                sink.put(_pext_u64(_mm256_extract_epi64::<0>(words) as u64, mask), 4 * k);
                sink.put(_pext_u64(_mm256_extract_epi64::<1>(words) as u64, mask), 4 * k);
                sink.put(_pext_u64(_mm256_extract_epi64::<2>(words) as u64, mask), 4 * k);
                sink.put(_pext_u64(_mm256_extract_epi64::<3>(words) as u64, mask), 4 * k);
            }
        }
        sink.finish();
        done
    }

    /// `super::put_unary`, eight gaps at a time (the AVX2 twin of
    /// `avx512::put_unary`): the ones' offsets from a prefix sum of the
    /// codes' lengths and, where the eight ones lie within two words
    /// (unless a gap is long), those two words' bits OR-ed together from
    /// one shifted bit per lane. Measured on a Zen 3 host (`ab_timing` with
    /// `STAGE=diff`, paired, two runs, against the loop per gap): the free
    /// diff of fp32m 10->15 0.95-0.98, 12->15 0.92-0.94, 10->11 0.98-0.99,
    /// bf16 10->11 0.97.
    ///
    /// # Safety
    /// The CPU has AVX2; `unary` holds the bits up to the list's end and a
    /// word more.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn put_unary(unary: &mut [u64], mut at: u64, gaps: &[u32], k: u32) {
        let shift = _mm_cvtsi32_si128(k as i32);
        let one32 = _mm256_set1_epi32(1);
        let one64 = _mm256_set1_epi64x(1);
        let sixty_four = _mm256_set1_epi64x(64);
        let short = _mm256_set1_epi32(1 << 16);
        let zero = _mm256_setzero_si256();
        let (lane3, lane7) = (_mm256_set1_epi32(3), _mm256_set1_epi32(7));
        let blocks = gaps.chunks_exact(8);
        let rest = blocks.remainder();
        for block in blocks {
            let q = _mm256_srl_epi32(_mm256_loadu_si256(block.as_ptr().cast()), shift);
            // Short unary parts only (`q <= 2^16`, unsigned): the eight
            // codes' bits then add up in a lane without wrapping.
            if _mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_max_epu32(q, short), short)) != -1 {
                at = super::put_unary_block(unary, at, block, k);
                continue;
            }
            // Prefix sum of the codes' lengths: within each half, then the
            // low half's total into the high half.
            let mut e = _mm256_add_epi32(q, one32);
            e = _mm256_add_epi32(e, _mm256_slli_si256::<4>(e));
            e = _mm256_add_epi32(e, _mm256_slli_si256::<8>(e));
            e = _mm256_add_epi32(e, _mm256_blend_epi32::<0xF0>(zero, _mm256_permutevar8x32_epi32(e, lane3)));
            let total = _mm256_cvtsi256_si32(_mm256_permutevar8x32_epi32(e, lane7)) as u32;
            if u64::from(total) + at % 64 > 128 {
                at = super::put_unary_block(unary, at, block, k);
                continue;
            }
            let word_at = (at / 64) as usize;
            // The ones' offsets from that word's first bit.
            let r = _mm256_add_epi32(e, _mm256_set1_epi32((at % 64) as i32 - 1));
            let (r0, r1) = (_mm256_cvtepu32_epi64(_mm256_castsi256_si128(r)), _mm256_cvtepu32_epi64(_mm256_extracti128_si256::<1>(r)));
            // A shift by 64 or more (or a wrapped negative) gives 0.
            let low = _mm256_or_si256(_mm256_sllv_epi64(one64, r0), _mm256_sllv_epi64(one64, r1));
            let high = _mm256_or_si256(
                _mm256_sllv_epi64(one64, _mm256_sub_epi64(r0, sixty_four)),
                _mm256_sllv_epi64(one64, _mm256_sub_epi64(r1, sixty_four)),
            );
            unary[word_at] |= or_lanes(low);
            unary[word_at + 1] |= or_lanes(high);
            at += u64::from(total);
        }
        super::put_unary_block(unary, at, rest, k);
    }

    /// The OR of the four 64-bit lanes of `v`.
    #[inline(always)]
    unsafe fn or_lanes(v: __m256i) -> u64 {
        let x = _mm_or_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        (_mm_cvtsi128_si64(x) | _mm_extract_epi64::<1>(x)) as u64
    }

    /// `add_low_parts_scalar` on the leading slots, eight at a time, as far
    /// as each block's 16-byte loads stay inside `lows`. Returns how many
    /// slots it did and the sum of their low parts (the rest is the
    /// caller's, from there).
    ///
    /// Eight parts of `k` bits take exactly `k` bytes, so every block's
    /// parts lie at the same bit offsets from the block's first byte: one
    /// byte shuffle and one shift per lane, the same for the whole list,
    /// take them out (the high four lanes read from a second load, `high`
    /// bytes on).
    ///
    /// # Safety
    /// The CPU has AVX2; `k <= MAX_K`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn add_low_parts(lows: &[u8], at: u64, k: u32, slots: &mut [u32]) -> (usize, u32) {
        debug_assert!(k <= MAX_K);
        let phase = (at % 8) as u32;
        let first_byte = (at / 8) as usize;
        let high = ((phase + 4 * k) / 8) as usize;
        // Blocks whose two loads end inside `lows`.
        let fit = match lows.len().checked_sub(first_byte + high + 16) {
            None => 0,
            Some(_) if k == 0 => usize::MAX,
            Some(room) => room / k as usize + 1,
        };
        let blocks = (slots.len() / 8).min(fit);
        // Lane `j` takes bytes `bit / 8 ..= bit / 8 + 2` of its half (the
        // fourth byte zero) and shifts right by `bit % 8`.
        let mut index = [0u8; 32];
        let mut shifts = [0u32; 8];
        for j in 0..8u32 {
            let bit = phase + j * k - if j >= 4 { 8 * high as u32 } else { 0 };
            for b in 0..3 {
                index[(4 * j + b) as usize] = (bit / 8 + b) as u8;
            }
            index[(4 * j + 3) as usize] = 0x80;
            shifts[j as usize] = bit % 8;
        }
        let index = _mm256_loadu_si256(index.as_ptr().cast());
        let shifts = _mm256_loadu_si256(shifts.as_ptr().cast());
        let mask = _mm256_set1_epi32(((1u64 << k) - 1) as i32);
        let count = _mm_cvtsi32_si128(k as i32);
        let zero = _mm256_setzero_si256();
        let (lane3, lane7) = (_mm256_set1_epi32(3), _mm256_set1_epi32(7));
        let eight = _mm256_set1_epi32(8);
        let mut numbers = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mut carry = zero;
        for b in 0..blocks {
            let p = lows.as_ptr().add(first_byte + b * k as usize);
            let bytes = _mm256_loadu2_m128i(p.add(high).cast(), p.cast());
            let mut x = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(bytes, index), shifts), mask);
            // Prefix sum: within each half, then the low half's total into
            // the high half, then the blocks before.
            x = _mm256_add_epi32(x, _mm256_slli_si256::<4>(x));
            x = _mm256_add_epi32(x, _mm256_slli_si256::<8>(x));
            x = _mm256_add_epi32(x, _mm256_blend_epi32::<0xF0>(zero, _mm256_permutevar8x32_epi32(x, lane3)));
            let sums = _mm256_add_epi32(x, carry);
            carry = _mm256_permutevar8x32_epi32(sums, lane7);
            let at_slots = slots.as_mut_ptr().add(8 * b);
            let zeros = _mm256_loadu_si256(at_slots.cast());
            let values = _mm256_add_epi32(_mm256_add_epi32(_mm256_sll_epi32(zeros, count), sums), numbers);
            _mm256_storeu_si256(at_slots.cast(), values);
            numbers = _mm256_add_epi32(numbers, eight);
        }
        (8 * blocks, _mm256_cvtsi256_si32(carry) as u32)
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx512 {
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;
    use std::sync::OnceLock;

    use super::super::bits::BitWriter;
    use super::super::gather_x86::{lanes, prefix_sum};

    /// The largest parameter the kernel reads: a low part and its bit
    /// offset within a byte fit one 32-bit load.
    pub(super) const MAX_K: u32 = 24;

    pub(super) fn available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| is_x86_feature_detected!("avx512f"))
    }

    /// Whether this CPU runs the kernels that need more than AVX-512 F:
    /// `select_ones` (a byte compress: AVX-512 BW and VBMI2) and
    /// `put_low_parts` (`pext`: BMI2).
    pub(super) fn has_kernels() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vbmi2")
                && is_x86_feature_detected!("bmi2")
        })
    }

    /// `put_each` of the low parts of the leading gaps, sixteen at a time
    /// where `k <= 14`: narrowed to bytes (`k <= 7`) or 16-bit words, then
    /// packed by a `pext` per eight bytes. Returns how many it wrote.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BMI2.
    #[target_feature(enable = "avx512f,bmi2")]
    pub(super) unsafe fn put_low_parts(lows: &mut BitWriter, gaps: &[u32], k: u32) -> usize {
        let blocks = gaps.chunks_exact(16);
        let done = gaps.len() - blocks.remainder().len();
        let mut sink = lows.sink(done * k as usize);
        match k {
            1..=7 => {
                let mask = u64::from_le_bytes([((1u32 << k) - 1) as u8; 8]);
                for block in blocks {
                    let bytes = _mm512_cvtepi32_epi8(_mm512_loadu_si512(block.as_ptr().cast()));
                    sink.put(pack_bits(_mm_cvtsi128_si64(bytes) as u64, mask), 8 * k);
                    sink.put(pack_bits(_mm_extract_epi64::<1>(bytes) as u64, mask), 8 * k);
                }
            }
            8..=14 => {
                let mask = 0x0001_0001_0001_0001 * ((1u64 << k) - 1);
                for block in blocks {
                    let mut words = [0u64; 4];
                    _mm256_storeu_si256(words.as_mut_ptr().cast(), _mm512_cvtepi32_epi16(_mm512_loadu_si512(block.as_ptr().cast())));
                    for word in words {
                        sink.put(pack_bits(word, mask), 4 * k);
                    }
                }
            }
            _ => {
                sink.finish();
                return 0;
            }
        }
        sink.finish();
        done
    }

    /// The bits of `value` where `mask` has ones, packed (`pext`).
    #[inline(always)]
    unsafe fn pack_bits(value: u64, mask: u64) -> u64 {
        _pext_u64(value, mask)
    }

    /// `super::rice_costs_any` on sixteen lanes.
    ///
    /// # Safety
    /// The CPU has AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn rice_costs(gaps: &[u32], k0: u32) -> [u64; 3] {
        super::rice_costs_any(gaps, k0)
    }

    /// `super::put_unary`, sixteen gaps at a time: the ones' offsets from a
    /// prefix sum of the codes' lengths, and, where the sixteen ones lie
    /// within two words (unless a gap is long), those two words' bits
    /// OR-ed together from one shifted bit per lane.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BW; `unary` holds the bits up to the
    /// list's end and a word more.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn put_unary(unary: &mut [u64], mut at: u64, gaps: &[u32], k: u32) {
        let shift = _mm_cvtsi32_si128(k as i32);
        let one32 = _mm512_set1_epi32(1);
        let one64 = _mm512_set1_epi64(1);
        let sixty_four = _mm512_set1_epi64(64);
        let blocks = gaps.chunks_exact(16);
        let rest = blocks.remainder();
        for block in blocks {
            let q = _mm512_srl_epi32(_mm512_loadu_si512(block.as_ptr().cast()), shift);
            // Short unary parts only: the sixteen codes' bits then add up
            // in a lane without wrapping.
            if _mm512_cmpgt_epu32_mask(q, _mm512_set1_epi32(1 << 16)) != 0 {
                at = super::put_unary_block(unary, at, block, k);
                continue;
            }
            let e = prefix_sum(_mm512_add_epi32(q, one32));
            let total = _mm512_cvtsi512_si32(_mm512_alignr_epi32::<15>(e, e)) as u32;
            let word_at = (at / 64) as usize;
            // The ones' offsets from that word's first bit.
            let r = _mm512_add_epi32(e, _mm512_set1_epi32((at % 64) as i32 - 1));
            if u64::from(total) + at % 64 > 128 {
                at = super::put_unary_block(unary, at, block, k);
                continue;
            }
            let (r0, r1) = (_mm512_cvtepu32_epi64(_mm512_castsi512_si256(r)), _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64::<1>(r)));
            // A shift by 64 or more (or a wrapped negative) gives 0.
            let low = _mm512_or_si512(_mm512_sllv_epi64(one64, r0), _mm512_sllv_epi64(one64, r1));
            let high = _mm512_or_si512(_mm512_sllv_epi64(one64, _mm512_sub_epi64(r0, sixty_four)), _mm512_sllv_epi64(one64, _mm512_sub_epi64(r1, sixty_four)));
            // Both words reduced together, [low | low', high | high'] per
            // 128-bit lane and then the four lanes into one, and OR-ed into
            // memory at once (two reductions of their own: the free diff
            // 0.992-0.998 of the time, paired, fp32m 10->15, 12->15, 10->11).
            let pairs = _mm512_or_si512(_mm512_unpacklo_epi64(low, high), _mm512_unpackhi_epi64(low, high));
            let halves = _mm256_or_si256(_mm512_castsi512_si256(pairs), _mm512_extracti64x4_epi64::<1>(pairs));
            let words = _mm_or_si128(_mm256_castsi256_si128(halves), _mm256_extracti128_si256::<1>(halves));
            let dst = unary.as_mut_ptr().add(word_at).cast::<__m128i>();
            _mm_storeu_si128(dst, _mm_or_si128(_mm_loadu_si128(dst), words));
            at += u64::from(total);
        }
        super::put_unary_block(unary, at, rest, k);
    }

    /// `super::select_ones_with` where the ones of a word become slots
    /// sixteen at a time: their bit numbers compressed into bytes, then
    /// widened and offset.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VBMI2 (`has_kernels`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi2,popcnt")]
    pub(super) unsafe fn select_ones(unary: &[u64], from: u64, end: u64, slots: &mut [MaybeUninit<u32>]) -> bool {
        let bit_numbers = _mm512_set_epi8(
            63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42, 41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 31,
            30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0,
        );
        let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        super::select_ones_with(unary, from, end, slots, |slots, word, zeros_at| {
            let n = slots.len();
            let mut bits = [0u8; 64];
            _mm512_storeu_si512(bits.as_mut_ptr().cast(), _mm512_maskz_compress_epi8(word, bit_numbers));
            let mut g = 0;
            while g < n {
                let m = lanes(n - g);
                let numbers = _mm512_cvtepu8_epi32(_mm_loadu_si128(bits.as_ptr().add(g).cast()));
                let offset = _mm512_sub_epi32(_mm512_set1_epi32(zeros_at.wrapping_sub(g as u32) as i32), iota);
                _mm512_mask_storeu_epi32(slots.as_mut_ptr().add(g).cast(), m, _mm512_add_epi32(numbers, offset));
                g += 16;
            }
        })
    }

    /// `add_low_parts_scalar`, sixteen slots at a time: the low parts are
    /// gathered from their bytes, shifted into place and added up in the
    /// register.
    ///
    /// # Safety
    /// The CPU has AVX-512 F; `k <= MAX_K`; `at + slots.len() * k < 2^31`;
    /// `lows` holds the bits read and 4 more bytes.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn add_low_parts(lows: &[u8], at: u32, k: u32, slots: &mut [u32]) {
        debug_assert!(k <= MAX_K && u64::from(at) + slots.len() as u64 * u64::from(k) < 1 << 31);
        debug_assert!((u64::from(at) + slots.len() as u64 * u64::from(k)).div_ceil(8) + 4 <= lows.len() as u64);
        let n = slots.len();
        let zero = _mm512_setzero_si512();
        let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let vk = _mm512_set1_epi32(k as i32);
        let shift = _mm_cvtsi32_si128(k as i32);
        let mask = _mm512_set1_epi32(((1u64 << k) - 1) as i32);
        let seven = _mm512_set1_epi32(7);
        let last = _mm512_set1_epi32(15);
        let mut carry = zero;
        let mut i = 0;
        while i < n {
            let m = lanes(n - i);
            let index = _mm512_add_epi32(_mm512_set1_epi32(i as i32), iota);
            let bit = _mm512_add_epi32(_mm512_set1_epi32(at as i32), _mm512_mullo_epi32(index, vk));
            let bytes = _mm512_mask_i32gather_epi32::<1>(zero, m, _mm512_srli_epi32::<3>(bit), lows.as_ptr().cast());
            let x = prefix_sum(_mm512_and_si512(_mm512_srlv_epi32(bytes, _mm512_and_si512(bit, seven)), mask));
            let sums = _mm512_add_epi32(x, carry);
            carry = _mm512_permutexvar_epi32(last, sums);
            let at_slots = slots.as_mut_ptr().add(i);
            let zeros = _mm512_maskz_loadu_epi32(m, at_slots.cast());
            let values = _mm512_add_epi32(_mm512_add_epi32(_mm512_sll_epi32(zeros, shift), sums), index);
            _mm512_mask_storeu_epi32(at_slots.cast(), m, values);
            i += 16;
        }
    }

    /// `add_low_parts` without a gather (AVX-512 VBMI): sixteen parts of
    /// `k` bits take exactly `2k` bytes, so every block's parts lie at the
    /// same bit offsets from the block's first byte, and one byte permute
    /// of the block's bytes, one shift per lane and a mask take them all
    /// out (each lane's part and its bit offset within a byte fit the four
    /// bytes it takes).
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VBMI; `k <= MAX_K`; `at + slots.len()
    /// * k < 2^31`; `lows` holds the bits read and 4 more bytes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    pub(super) unsafe fn add_low_parts_vbmi(lows: &[u8], at: u32, k: u32, slots: &mut [u32]) {
        debug_assert!(k <= MAX_K && u64::from(at) + slots.len() as u64 * u64::from(k) < 1 << 31);
        debug_assert!((u64::from(at) + slots.len() as u64 * u64::from(k)).div_ceil(8) + 4 <= lows.len() as u64);
        let n = slots.len();
        let phase = at % 8;
        // Lane `j` takes bytes `bit / 8 ..= bit / 8 + 3` of its block and
        // shifts right by `bit % 8`, `bit` being `phase + j k`.
        let mut index = [0u8; 64];
        let mut shifts = [0u32; 16];
        for j in 0..16u32 {
            let bit = phase + j * k;
            for b in 0..4 {
                index[(4 * j + b) as usize] = (bit / 8 + b) as u8;
            }
            shifts[j as usize] = bit % 8;
        }
        // The bytes the first `lanes` lanes of a block take (at most 52).
        let taken = |lanes: u32| -> u64 {
            let bytes = (phase + (lanes - 1) * k) / 8 + 4;
            (1u64 << bytes) - 1
        };
        let whole = taken(16);
        let index = _mm512_loadu_si512(index.as_ptr().cast());
        let shifts = _mm512_loadu_si512(shifts.as_ptr().cast());
        let zero = _mm512_setzero_si512();
        let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let shift = _mm_cvtsi32_si128(k as i32);
        let mask = _mm512_set1_epi32(((1u64 << k) - 1) as i32);
        let last = _mm512_set1_epi32(15);
        let sixteen = _mm512_set1_epi32(16);
        let mut numbers = iota;
        let mut carry = zero;
        let mut block = lows.as_ptr().add((at / 8) as usize);
        let mut i = 0;
        while i < n {
            let m = lanes(n - i);
            // Masked loads read (and may fault on) only the bytes taken.
            let bytes = _mm512_maskz_loadu_epi8(if n - i >= 16 { whole } else { taken((n - i) as u32) }, block.cast());
            let x = prefix_sum(_mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi8(index, bytes), shifts), mask));
            let sums = _mm512_add_epi32(x, carry);
            // The block's total is broadcast from `x`, not from `sums`, so
            // that only an add is on the chain from block to block.
            carry = _mm512_add_epi32(carry, _mm512_permutexvar_epi32(last, x));
            let at_slots = slots.as_mut_ptr().add(i);
            let zeros = _mm512_maskz_loadu_epi32(m, at_slots.cast());
            let values = _mm512_add_epi32(_mm512_add_epi32(_mm512_sll_epi32(zeros, shift), sums), numbers);
            _mm512_mask_storeu_epi32(at_slots.cast(), m, values);
            numbers = _mm512_add_epi32(numbers, sixteen);
            block = block.wrapping_add(2 * k as usize);
            i += 16;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ascending values from their gaps.
    fn values_of(gaps: &[u32]) -> Vec<u32> {
        let mut next = 0u32;
        gaps.iter()
            .map(|&g| {
                let v = next + g;
                next = v + 1;
                v
            })
            .collect()
    }

    /// Several lists of every parameter, short and long gaps, through one
    /// writer and one reader; both low-part paths give the same values.
    #[test]
    fn lists_round_trip() {
        let mut next = super::super::tests::xorshift(0x9e37_79b9_7f4a_7c15);
        let mut lists = Vec::new();
        for k in [0u32, 1, 3, 7, 12, 20, 24, 25, 31] {
            for len in [0usize, 1, 2, 15, 16, 17, 100, 1000] {
                // Gaps below 2^21: a list of 1000 stays below 2^32.
                let gaps: Vec<u32> = (0..len)
                    .map(|_| match next() % 16 {
                        0 => (next() % (1 << 21)) as u32,
                        1 => ((next() % 300) << k.min(12)) as u32,
                        _ => (next() % (4u64 << k).min(1 << 21)) as u32,
                    })
                    .collect();
                lists.push((k, gaps));
            }
        }
        // Values up to the largest a chunk has.
        lists.push((31, vec![(1 << 31) + 5, (1 << 31) - 100]));
        lists.push((0, vec![0, 0, 1, 0]));
        let mut w = RiceWriter::new();
        let mut low_bits = 0;
        for (k, gaps) in &lists {
            w.put_gaps(gaps, *k, code_bits(gaps, *k));
            low_bits += gaps.len() as u64 * u64::from(*k);
        }
        let stream = w.finish();
        let mut r = RiceReader::new(&stream, low_bits).unwrap();
        for (k, gaps) in &lists {
            let values = values_of(gaps);
            let mut out = vec![7u32];
            let after = r.read_ascending(*k, gaps.len() as u64, u64::from(u32::MAX), &mut out).unwrap();
            assert_eq!(&out[1..], &values[..], "k {k}, {} gaps", gaps.len());
            assert_eq!(after, values.last().map_or(0, |&v| u64::from(v) + 1));
            // The scalar reference and the wide path read the same.
            if let Some(&last) = values.last() {
                let low_at = r.low_at - gaps.len() as u64 * u64::from(*k);
                let zeros: Vec<u32> = values.iter().zip(gaps).scan(0u32, |z, (_, &g)| {
                    *z += g >> k;
                    Some(*z)
                }).collect();
                let mut scalar = zeros.clone();
                add_low_parts_scalar(&r.lows, low_at, *k, &mut scalar);
                assert_eq!(scalar, values);
                let mut wide = zeros.clone();
                add_low_parts_wide(&r.lows, low_at, *k, u64::from(last) + 1, &mut wide).unwrap();
                assert_eq!(wide, values);
            }
        }
        r.finish().unwrap();
    }

    /// The AVX2 low-part kernel (where the CPU has it), finished by the
    /// scalar loop, adds what the scalar loop adds: every parameter it
    /// takes, every bit phase, lists that end at the buffer's end.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn low_part_kernel_matches_scalar() {
        if !super::super::avx2_available() {
            return;
        }
        let mut next = super::super::tests::xorshift(0x10b1_7500_0000_0003);
        let lows: Vec<u8> = (0..300).map(|_| next() as u8).chain([0; 8]).collect();
        let mut full_blocks = 0;
        for k in 0..=avx2::MAX_K {
            for at in 0..17u64 {
                for len in [0usize, 1, 7, 8, 9, 16, 31, 64, 100, 200, usize::MAX] {
                    // The longest list that ends inside the 300 bytes.
                    let len = len.min(((300 * 8 - at) / u64::from(k.max(1))) as usize);
                    let zeros: Vec<u32> = (0..len)
                        .scan(0u32, |z, _| {
                            *z += (next() % 4) as u32;
                            Some(*z)
                        })
                        .collect();
                    let mut scalar = zeros.clone();
                    add_low_parts_scalar(&lows, at, k, &mut scalar);
                    let mut fast = zeros.clone();
                    #[allow(unsafe_code)]
                    let (done, sum) = unsafe { avx2::add_low_parts(&lows, at, k, &mut fast) };
                    assert_eq!(&fast[..done], &scalar[..done], "k {k} at {at} len {len}");
                    add_low_parts_from(&lows, at, k, &mut fast, done, sum);
                    assert_eq!(fast, scalar, "k {k} at {at} len {len}");
                    full_blocks += usize::from(done + 8 > len && len >= 8);
                }
            }
        }
        // The kernel reached the last block in most lists.
        assert!(full_blocks > 500, "{full_blocks}");
    }

    /// Both AVX-512 low-part kernels (the gather, and the byte permute
    /// where the CPU has VBMI) add what the scalar loop adds: every
    /// parameter they take, every bit phase, partial last blocks, lists
    /// that end 4 bytes before the buffer does (all the kernels may read).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn wide_low_part_kernels_match_scalar() {
        if !avx512::available() {
            return;
        }
        let vbmi = super::super::x86::vbmi_available();
        let mut next = super::super::tests::xorshift(0x10b1_7500_0000_0005);
        let random: Vec<u8> = (0..700).map(|_| next() as u8).collect();
        let mut checked = 0;
        for k in 0..=avx512::MAX_K {
            for at in 0..19u32 {
                for len in [0usize, 1, 15, 16, 17, 31, 32, 33, 100, 200] {
                    let bits = u64::from(at) + len as u64 * u64::from(k);
                    // Exactly the bits read and 4 more bytes.
                    let lows = &random[..bits.div_ceil(8) as usize + 4];
                    // Zeros small enough that every value fits 32 bits, as
                    // the reader checks before it calls the kernels.
                    let most = ((1u64 << 32) - ((len as u64 + 1) << k)) >> k;
                    let zeros: Vec<u32> = (0..len)
                        .scan(0u32, |z, _| {
                            *z = (u64::from(*z) + next() % 4).min(most) as u32;
                            Some(*z)
                        })
                        .collect();
                    let mut scalar = zeros.clone();
                    // (The scalar loop reads 8 bytes at a time.)
                    add_low_parts_scalar(&random[..lows.len() + 4], u64::from(at), k, &mut scalar);
                    let mut gathered = zeros.clone();
                    #[allow(unsafe_code)]
                    unsafe { avx512::add_low_parts(lows, at, k, &mut gathered) };
                    assert_eq!(gathered, scalar, "gather: k {k} at {at} len {len}");
                    if vbmi {
                        let mut permuted = zeros.clone();
                        #[allow(unsafe_code)]
                        unsafe { avx512::add_low_parts_vbmi(lows, at, k, &mut permuted) };
                        assert_eq!(permuted, scalar, "byte permute: k {k} at {at} len {len}");
                        checked += 1;
                    }
                }
            }
        }
        assert!(!vbmi || checked == 25 * 19 * 10, "{checked}");
    }

    /// The writer's kernels (where the CPU has them) write what the
    /// portable loops write, for every parameter, long gaps included.
    #[test]
    fn writer_paths_agree() {
        let agree = |gaps: &[u32], k: u32, what: &str| {
            let bits = code_bits(gaps, k);
            let mut w = RiceWriter::new();
            w.put_gaps(gaps, k, bits);
            let fast = w.finish();
            let mut lows = BitWriter::new();
            lows.put_each(gaps, k);
            let unary_bits = bits - gaps.len() as u64 * u64::from(k);
            let mut unary = vec![0u64; unary_bits.div_ceil(64) as usize];
            put_unary(&mut unary, 0, gaps, k);
            #[cfg(target_arch = "x86_64")]
            if super::super::avx2_available() {
                // The AVX2 kernel, which AVX-512 CPUs do not dispatch to.
                let mut by_eight = vec![0u64; unary.len() + 1];
                // Safety: the CPU has AVX2 (just checked); a word more.
                #[allow(unsafe_code)]
                unsafe {
                    avx2::put_unary(&mut by_eight, 0, gaps, k)
                };
                assert_eq!(by_eight[..unary.len()], unary[..], "AVX2: k {k}, {what}");
                assert_eq!(by_eight[unary.len()], 0, "AVX2: k {k}, {what}: past the end");
            }
            #[cfg(target_arch = "x86_64")]
            if avx2::packs_low_parts() {
                // The AVX2 low parts, then the rest as the portable loop.
                let mut packed = BitWriter::new();
                // Safety: the CPU has AVX2 and BMI2 (just checked).
                #[allow(unsafe_code)]
                let done = unsafe { avx2::put_low_parts(&mut packed, gaps, k) };
                assert_eq!(done, if (1..=14).contains(&k) { gaps.len() / 16 * 16 } else { 0 }, "AVX2 low parts: k {k}, {what}");
                packed.put_each(&gaps[done..], k);
                let mut each = BitWriter::new();
                each.put_each(gaps, k);
                assert_eq!(packed.finish(), each.finish(), "AVX2 low parts: k {k}, {what}");
            }
            let mut portable = lows.finish();
            portable.extend(unary.iter().flat_map(|w| w.to_le_bytes()).take(unary_bits.div_ceil(8) as usize));
            assert_eq!(fast, portable, "k {k}, {what}");
        };
        let mut next = super::super::tests::xorshift(0x7e57_0b17);
        for k in 0..32u32 {
            for len in [1usize, 15, 16, 17, 33, 500] {
                let gaps: Vec<u32> = (0..len)
                    .map(|_| match next() % 20 {
                        0 => (next() % (1 << 24)) as u32,
                        _ => (next() % (3u64 << k).min(1 << 24)) as u32,
                    })
                    .collect();
                agree(&gaps, k, &format!("{len} gaps"));
            }
        }
        // Unary parts of up to 8 bits, so that sixteen codes reach 128
        // bits: a block that fills two words exactly, then one starting
        // on a word's first bit and running past it, then random lengths.
        for k in [0u32, 3] {
            let mut gaps: Vec<u32> = [7u32; 16].iter().chain(&[4; 16]).map(|&q| q << k).collect();
            gaps.extend((0..600).map(|_| (((next() % 8) << k) | (next() % (1 << k))) as u32));
            agree(&gaps, k, "long unary parts");
            // The same for blocks of eight: unary parts of up to 16 bits.
            let mut gaps: Vec<u32> = [15u32; 8].iter().chain(&[9; 8]).map(|&q| q << k).collect();
            gaps.extend((0..600).map(|_| (((next() % 16) << k) | (next() % (1 << k))) as u32));
            agree(&gaps, k, "long unary parts, blocks of eight");
        }
    }

    /// The kernel's selection (where the CPU has it) matches the word by
    /// word loop on random bits, from any start and to any end.
    #[test]
    fn select_paths_agree() {
        let mut next = super::super::tests::xorshift(0x51ec_7ab1_e000_0001);
        for density in [1u64, 4, 16, 48, 63] {
            let unary: Vec<u64> = (0..40).map(|_| (0..density).fold(0, |w, _| w | 1 << (next() % 64))).chain([0]).collect();
            for _ in 0..200 {
                let from = next() % (64 * 39);
                let end = from + next() % (64 * 40 - from);
                let count = 1 + (next() % 300) as usize;
                let mut scalar = vec![MaybeUninit::new(0u32); count];
                let found = select_ones_with(&unary, from, end, &mut scalar, emit_ones);
                let mut fast = vec![MaybeUninit::new(0u32); count];
                assert_eq!(select_ones(&unary, from, end, &mut fast), found);
                // The AVX2 kernel, which AVX-512 CPUs do not dispatch to.
                #[cfg(target_arch = "x86_64")]
                let by_bytes = avx2::available().then(|| {
                    let mut slots = vec![MaybeUninit::new(0u32); count];
                    // Safety: the CPU has AVX2 and POPCNT (just checked).
                    #[allow(unsafe_code)]
                    let ok = unsafe { avx2::select_ones(&unary, from, end, &mut slots) };
                    assert_eq!(ok, found, "AVX2: from {from} end {end} count {count}");
                    slots
                });
                #[cfg(not(target_arch = "x86_64"))]
                let by_bytes: Option<Vec<MaybeUninit<u32>>> = None;
                // Safety: initialized above (the kernels write only u32s).
                #[allow(unsafe_code)]
                let init = |slots: &[MaybeUninit<u32>]| -> Vec<u32> { slots.iter().map(|s| unsafe { s.assume_init() }).collect() };
                let (scalar, fast) = (init(&scalar), init(&fast));
                if let (true, Some(by_bytes)) = (found, &by_bytes) {
                    assert_eq!(init(by_bytes), scalar, "AVX2: from {from} end {end} count {count}");
                }
                if found {
                    assert_eq!(fast, scalar, "from {from} end {end} count {count}");
                    // Each slot is the zeros before its one since `from`.
                    let mut ones = 0;
                    for bit in from..end {
                        if unary[(bit / 64) as usize] >> (bit % 64) & 1 == 1 && ones < count {
                            assert_eq!(u64::from(scalar[ones]), bit - from - ones as u64);
                            ones += 1;
                        }
                    }
                    assert_eq!(ones, count);
                }
            }
        }
    }

    #[test]
    fn bad_streams_are_refused() {
        let gaps = [3u32, 0, 9, 40, 2];
        let mut w = RiceWriter::new();
        w.put_gaps(&gaps, 2, code_bits(&gaps, 2));
        let stream = w.finish();
        let read = |stream: &[u8], count: u64, limit: u64| -> Result<Vec<u32>, &'static str> {
            let mut r = RiceReader::new(stream, count * 2)?;
            let mut out = Vec::new();
            r.read_ascending(2, count, limit, &mut out)?;
            r.finish()?;
            Ok(out)
        };
        assert_eq!(read(&stream, 5, 100).unwrap(), values_of(&gaps));
        // The last value is 58: a limit of 58 refuses it.
        assert_eq!(read(&stream, 5, 58), Err("positions beyond the chunk's elements"));
        assert_eq!(read(&stream, 6, 100), Err("position stream ends early"));
        assert_eq!(read(&stream[..stream.len() - 1], 5, 100), Err("position stream ends early"));
        assert_eq!(read(&stream[..1], 5, 100), Err("position stream ends early"));
        assert_eq!(read(&stream, 4, 100), Err("position stream runs on past its last change"));
        let mut longer = stream.clone();
        longer.push(0);
        assert_eq!(read(&longer, 5, 100), Err("position stream runs on past its last change"));
        // A unary part longer than any value below the limit allows is not
        // scanned to its end.
        let mut w = RiceWriter::new();
        w.put_gaps(&[1 << 20], 0, code_bits(&[1 << 20], 0));
        assert_eq!(read_k0(&w.finish(), 1000), Err("positions beyond the chunk's elements"));
        // More values than fit below the limit.
        assert_eq!(read(&stream, 5, 4), Err("positions beyond the chunk's elements"));
    }

    fn read_k0(stream: &[u8], limit: u64) -> Result<Vec<u32>, &'static str> {
        let mut r = RiceReader::new(stream, 0)?;
        let mut out = Vec::new();
        r.read_ascending(0, 1, limit, &mut out)?;
        Ok(out)
    }

    /// Low parts whose sum alone passes 2^32 (only a corrupt stream has
    /// them) go through the 64-bit path and are refused, not wrapped.
    #[test]
    fn sums_past_32_bits_are_refused() {
        let gaps = vec![(1u32 << 31) - 1; 4];
        let mut w = RiceWriter::new();
        w.put_gaps(&gaps, 31, code_bits(&gaps, 31));
        let stream = w.finish();
        let mut r = RiceReader::new(&stream, 4 * 31).unwrap();
        let mut out = Vec::new();
        assert_eq!(r.read_ascending(31, 4, u64::from(u32::MAX), &mut out), Err("positions beyond the chunk's elements"));
    }

    #[test]
    fn best_parameter_is_the_cheapest_of_all() {
        let mut next = super::super::tests::xorshift(0x1234_5678);
        for mean in [0u64, 1, 5, 40, 1000, 100_000] {
            let gaps: Vec<u32> = (0..500).map(|_| (next() % (2 * mean + 1)) as u32).collect();
            let span: u64 = gaps.iter().map(|&g| u64::from(g) + 1).sum();
            let (k, bits) = best_rice_parameter(&gaps, span, gaps.len() as u64);
            let cost = |k: u32| gaps.iter().map(|&g| u64::from(g >> k) + 1 + u64::from(k)).sum::<u64>();
            assert_eq!(bits, cost(k));
            let best = (0..32).map(cost).min().unwrap();
            assert!(bits <= best + best / 50, "mean {mean}: k {k} costs {bits}, the best {best}");
            let mut w = RiceWriter::new();
            w.put_gaps(&gaps, k, bits);
            assert_eq!(w.finish().len() as u64, (gaps.len() as u64 * u64::from(k)).div_ceil(8) + (bits - gaps.len() as u64 * u64::from(k)).div_ceil(8));
        }
    }

    /// The fused pass writes the gaps and counts their costs as the two
    /// passes it replaces do, on every kernel this CPU has, for long lists,
    /// for gaps that add up to nearly 2^32 (its sums are 32-bit), and
    /// appended behind earlier gaps.
    #[test]
    fn gaps_and_best_parameter_match_the_two_passes() {
        let mut next = super::super::tests::xorshift(0x9E37_79B9);
        let mut lists: Vec<Vec<u32>> = [(0usize, 1u64), (1, 0), (1, 70), (17, 3), (5000, 9), (UnarySums::BLOCK + 37, 2)]
            .into_iter()
            .map(|(m, mean)| {
                let mut at = 0u32;
                (0..m)
                    .map(|_| {
                        let p = at + (next() % (2 * mean + 1)) as u32;
                        at = p + 1;
                        p
                    })
                    .collect()
            })
            .collect();
        lists.push(vec![3, 1 << 31, u32::MAX - 1]);
        lists.push((0..40).map(|i| if i < 39 { i * 7 } else { u32::MAX - 1 }).collect());
        for positions in lists {
            let m = positions.len();
            let gaps = super::super::position_gaps(&positions);
            let span = positions.last().map_or(0, |&p| u64::from(p) + 1);
            let want = if m == 0 { None } else { Some(best_rice_parameter(&gaps, span, m as u64)) };
            let k0 = if m == 0 { 0 } else { first_candidate(span, m as u64) };
            type Kernel = fn(&[u32], &mut Vec<u32>, u32) -> [u64; 3];
            #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
            let mut kernels: Vec<(&str, Kernel)> = vec![("portable", gaps_and_costs_any)];
            #[cfg(target_arch = "x86_64")]
            {
                #[allow(unsafe_code)]
                fn on_avx2(p: &[u32], g: &mut Vec<u32>, k0: u32) -> [u64; 3] {
                    // Safety: listed only where the CPU has AVX2.
                    unsafe { gaps_and_costs_avx2(p, g, k0) }
                }
                #[allow(unsafe_code)]
                fn on_avx512(p: &[u32], g: &mut Vec<u32>, k0: u32) -> [u64; 3] {
                    // Safety: listed only where the CPU has AVX-512 F.
                    unsafe { gaps_and_costs_avx512(p, g, k0) }
                }
                if crate::codec::avx2_available() {
                    kernels.push(("avx2", on_avx2));
                }
                if avx512::available() {
                    kernels.push(("avx512", on_avx512));
                }
            }
            for (name, kernel) in kernels {
                let mut out = vec![7u32, 8];
                let costs = kernel(&positions, &mut out, k0);
                assert_eq!(&out[..2], &[7, 8], "{name}: earlier gaps kept");
                assert_eq!(out[2..], gaps[..], "{name}: {m} gaps");
                assert_eq!(costs, rice_costs_any(&gaps, k0), "{name}: {m} gaps");
            }
            if let Some(want) = want {
                let mut out = Vec::new();
                assert_eq!(gaps_and_best_parameter(&positions, &mut out), want);
            }
        }
    }
}
