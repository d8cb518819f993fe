//! An adaptive binary range coder (the classic 11-bit-probability,
//! carry-propagating design of LZMA): each binary decision is coded with a
//! probability that adapts to what it has seen in its context.
//!
//! Unlike LZMA's, a context learns fast while it is young: each decision
//! moves its probability `1 / 2^shift` of the way to the outcome, with
//! `shift = min(5, floor(log2(n + 2)))` after the context has coded `n`
//! symbols ([`Rate::after`]): halfway at first, LZMA's 1/32 from the 30th
//! symbol on. A context with a few dozen symbols then costs close to what
//! its counts say instead of paying for a slow start from one half
//! (measured on the ulp steps of small chunks: 1.55 -> 1.45 bits per
//! change). The count is kept per context, not per probability, so it
//! costs a few instructions per symbol rather than per decision.

pub const PROB_BITS: u32 = 11;
/// Probability one half.
pub const PROB_INIT: u16 = 1 << (PROB_BITS - 1);
const TOP: u32 = 1 << 24;
/// The count at which a context's rate settles.
pub const SETTLED_AFTER: u16 = 30;

/// How far a decision moves its probability towards the outcome:
/// `1 / 2^shift` of the way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate(u32);

impl Rate {
    /// The rate once a context has coded `SETTLED_AFTER` symbols.
    pub const SETTLED: Rate = Rate(5);

    /// The rate for a context that has coded `n` symbols before this one:
    /// `min(5, floor(log2(n + 2)))`. (Any rate keeps a probability within
    /// 1..=2047 of 2048; see `RangeDecoder::normalize`.)
    #[inline(always)]
    pub fn after(n: u16) -> Rate {
        const SHIFT: [u8; SETTLED_AFTER as usize + 1] = {
            let mut t = [5u8; SETTLED_AFTER as usize + 1];
            let mut n = 0;
            while n < t.len() {
                t[n] = (usize::BITS - 1 - (n + 2).leading_zeros()) as u8;
                n += 1;
            }
            t
        };
        Rate(u32::from(SHIFT[usize::from(n.min(SETTLED_AFTER))]))
    }

    /// The rate for the next symbol of a context whose count is `count`,
    /// which it then advances (saturating at `SETTLED_AFTER`).
    #[inline(always)]
    pub fn advance(count: &mut u16) -> Rate {
        let n = *count;
        *count = n + u16::from(n < SETTLED_AFTER);
        Rate::after(n)
    }
}

/// The probability after a decision: `up` towards 0 when `zero`, `down`
/// when `one` (masks, at most one set; neither for a decision not taken).
#[inline(always)]
fn adapted(p: u32, rate: Rate, zero: u32, one: u32) -> u16 {
    let up = ((1 << PROB_BITS) - p) >> rate.0;
    let down = p >> rate.0;
    p.wrapping_add(up & zero).wrapping_sub(down & one) as u16
}

pub struct RangeEncoder {
    low: u64,
    range: u32,
    cache: u8,
    cache_size: u64,
    out: Vec<u8>,
}

impl Default for RangeEncoder {
    fn default() -> Self {
        RangeEncoder { low: 0, range: u32::MAX, cache: 0, cache_size: 1, out: Vec::new() }
    }
}

impl RangeEncoder {
    #[inline(always)]
    fn shift_low(&mut self) {
        if (self.low as u32) < 0xff00_0000 || (self.low >> 32) != 0 {
            // The cached byte, then the pending 0xff bytes, each plus the carry.
            let carry = (self.low >> 32) as u8;
            self.out.push(self.cache.wrapping_add(carry));
            if self.cache_size > 1 {
                self.flush_pending(carry);
            }
            self.cache_size = 0;
            self.cache = ((self.low >> 24) & 0xff) as u8;
        }
        self.cache_size += 1;
        self.low = (self.low & 0x00ff_ffff) << 8;
    }

    #[cold]
    fn flush_pending(&mut self, carry: u8) {
        for _ in 1..self.cache_size {
            self.out.push(0xffu8.wrapping_add(carry));
        }
    }

    #[inline(always)]
    pub fn bit(&mut self, prob: &mut u16, bit: bool, rate: Rate) {
        let p = u32::from(*prob);
        let bound = (self.range >> PROB_BITS) * p;
        if !bit {
            self.range = bound;
            *prob = adapted(p, rate, u32::MAX, 0);
        } else {
            self.low += u64::from(bound);
            self.range -= bound;
            *prob = adapted(p, rate, 0, u32::MAX);
        }
        self.normalize();
    }

    /// A dense context's change flags given as the gaps between its
    /// changes (`gaps[i]` unchanged elements, then a change): each flag by
    /// `bit_unpredictable` under one of two probabilities chosen by the
    /// flag before it (the first as after a `false`), both at the rate of
    /// one count. What `RangeDecoder::order1_flags` reads; the coder's
    /// range and low and both probabilities kept in locals, as there.
    pub fn order1_flags(&mut self, gaps: &[u32]) {
        let mut flags = Order1Writer { range: self.range, low: self.low, probs: Order1Probs::new(), count: 0 };
        for &gap in gaps {
            for _ in 0..gap {
                flags.code(self, false);
            }
            flags.code(self, true);
        }
        (self.range, self.low) = (flags.range, flags.low);
    }

    /// At most two renormalisation steps (see `RangeDecoder::normalize`).
    #[inline(always)]
    fn normalize(&mut self) {
        if self.range < TOP {
            self.range <<= 8;
            self.shift_low();
            if self.range < TOP {
                self.range <<= 8;
                self.shift_low();
            }
        }
        debug_assert!(self.range >= TOP);
    }

    /// The same decision, branch-free: for coin tosses such as signs.
    #[inline(always)]
    pub fn bit_unpredictable(&mut self, prob: &mut u16, bit: bool, rate: Rate) {
        self.bit_masked(prob, bit, true, rate);
    }

    /// A branch-free decision coded only when `active` (otherwise nothing
    /// changes): the decoder reads it with `bit_masked` (or `bit` when it
    /// knows `active`).
    #[inline(always)]
    pub fn bit_masked(&mut self, prob: &mut u16, bit: bool, active: bool, rate: Rate) {
        let p = u32::from(*prob);
        let bound = (self.range >> PROB_BITS) * p;
        let act = u32::from(active).wrapping_neg();
        let one = u32::from(bit).wrapping_neg() & act;
        let zero = !u32::from(bit).wrapping_neg() & act;
        self.low += u64::from(bound & one);
        self.range = (bound & zero) | (self.range.wrapping_sub(bound) & one) | (self.range & !act);
        *prob = adapted(p, rate, zero, one);
        self.normalize();
    }

    /// `bits` low bits of `value`, each with probability one half.
    pub fn direct(&mut self, value: u64, bits: u32) {
        for i in (0..bits).rev() {
            self.range >>= 1;
            if (value >> i) & 1 == 1 {
                self.low += u64::from(self.range);
            }
            self.normalize();
        }
    }

    pub fn finish(mut self) -> Vec<u8> {
        for _ in 0..5 {
            self.shift_low();
        }
        self.out
    }
}

pub struct RangeDecoder<'a> {
    buf: &'a [u8],
    pos: usize,
    range: u32,
    code: u32,
}

impl<'a> RangeDecoder<'a> {
    /// `None` when the stream is too short to start.
    pub fn new(buf: &'a [u8]) -> Option<Self> {
        if buf.len() < 5 || buf[0] != 0 {
            return None;
        }
        let code = u32::from_be_bytes(buf[1..5].try_into().expect("4"));
        Some(RangeDecoder { buf, pos: 5, range: u32::MAX, code })
    }

    /// Whether more bytes were consumed than the stream holds (corruption).
    pub fn overrun(&self) -> bool {
        self.pos > self.buf.len()
    }

    /// At most two bytes are ever needed: before a decision `range >= 2^24`,
    /// and a probability stays within 1..=2047 (of 2048) under the update
    /// rule, whatever the rates, so both outcomes leave
    /// `range >= (2^24 >> 11) * 1 = 2^13`; a direct bit halves the range,
    /// leaving `>= 2^23`. The second step is rare (a probability that far
    /// out costs 11 bits when it is wrong), so it costs one predicted branch.
    #[inline(always)]
    fn normalize(&mut self) {
        if self.range < TOP {
            self.shift_in();
            if self.range < TOP {
                self.shift_in();
            }
        }
        debug_assert!(self.range >= TOP);
    }

    #[inline(always)]
    fn shift_in(&mut self) {
        self.range <<= 8;
        // Past the end the stream reads as zeros; `overrun` tells.
        let byte = self.buf.get(self.pos).map_or(0, |&b| u32::from(b));
        self.code = (self.code << 8) | byte;
        self.pos += 1;
    }

    /// A decision whose outcome is usually the likely one: branches, which
    /// cost little when predicted (a short dependency chain).
    #[inline(always)]
    pub fn bit(&mut self, prob: &mut u16, rate: Rate) -> bool {
        let p = u32::from(*prob);
        let bound = (self.range >> PROB_BITS) * p;
        let bit = if self.code < bound {
            self.range = bound;
            *prob = adapted(p, rate, u32::MAX, 0);
            false
        } else {
            self.code -= bound;
            self.range -= bound;
            *prob = adapted(p, rate, 0, u32::MAX);
            true
        };
        self.normalize();
        bit
    }

    /// The same decision, branch-free (both outcomes computed, one selected
    /// by a mask): for decisions close to a coin toss, such as signs.
    #[inline(always)]
    pub fn bit_unpredictable(&mut self, prob: &mut u16, rate: Rate) -> bool {
        self.bit_masked(prob, true, rate)
    }

    /// A decision read only when `active` (else `false`, nothing read), the
    /// decoder's side of `RangeEncoder::bit_masked`: branch-free, for a
    /// decision that follows an unpredictable one.
    #[inline(always)]
    pub fn bit_masked(&mut self, prob: &mut u16, active: bool, rate: Rate) -> bool {
        let p = u32::from(*prob);
        let bound = (self.range >> PROB_BITS) * p;
        let act = u32::from(active).wrapping_neg();
        let bit = (self.code >= bound) & active;
        let one = u32::from(bit).wrapping_neg(); // all ones when the bit is 1 (and active)
        let zero = !one & act;
        self.range = (bound & zero) | (self.range.wrapping_sub(bound) & one) | (self.range & !act);
        self.code = self.code.wrapping_sub(bound & one);
        *prob = adapted(p, rate, zero, one);
        self.normalize();
        bit
    }

    /// A dense context's change flags, as `RangeEncoder::order1_flags` codes
    /// them: each decision by `bit_unpredictable` under one of two
    /// probabilities, chosen by the decision before it (the first as after
    /// a `false`), both at the rate of one count. Read until `changes`
    /// decisions came out true, into `words` (bit `r % 64` of the
    /// `r / 64`-th word pushed is decision `r`); returns how many
    /// decisions that took. `None` when that would pass `max_flags` (a
    /// corrupt stream).
    ///
    /// The same arithmetic as `bit_unpredictable`, with the coder's state
    /// and both probabilities in locals: a decision through `&mut self` and
    /// a probability indexed in memory put the previous decision's stores
    /// on the next one's chain (about 20 cycles per decision).
    pub fn order1_flags(&mut self, changes: u64, max_flags: u64, words: &mut Vec<u64>) -> Option<u64> {
        let mut flags = Order1 { range: self.range, code: self.code, pos: self.pos, probs: Order1Probs::new() };
        let (mut left, mut rank) = (changes, 0u64);
        let mut result = Some(0);
        while left > 0 {
            if rank >= max_flags {
                result = None;
                break;
            }
            let in_word = 64.min(max_flags - rank) as u32;
            // The rates of a young context only in the first word.
            let word = if rank == 0 {
                flags.word(self.buf, in_word, &mut left, Rate::after)
            } else {
                flags.word(self.buf, in_word, &mut left, |_| Rate::SETTLED)
            };
            words.push(word.0);
            rank += u64::from(word.1);
            result = Some(rank);
        }
        (self.range, self.code, self.pos) = (flags.range, flags.code, flags.pos);
        result
    }

    pub fn direct(&mut self, bits: u32) -> u64 {
        let mut v = 0u64;
        for _ in 0..bits {
            self.range >>= 1;
            let b = if self.code >= self.range {
                self.code -= self.range;
                1
            } else {
                0
            };
            v = (v << 1) | b;
            self.normalize();
        }
        v
    }
}

/// The two probabilities of an order-1 run of flags: the one the previous
/// flag chose (`current`) and the other.
struct Order1Probs {
    current: u32,
    other: u32,
    previous: bool,
}

impl Order1Probs {
    fn new() -> Self {
        Order1Probs { current: u32::from(PROB_INIT), other: u32::from(PROB_INIT), previous: false }
    }

    /// After a flag `bit` coded on `current`, adapted to `adapted`: a
    /// change chooses the other probability next when the last flag was no
    /// change, and the other way round (the one just adapted becomes
    /// `other`). Selected, not indexed, so both stay in registers.
    #[inline(always)]
    fn update(&mut self, bit: bool, adapted: u32) {
        if bit != self.previous {
            (self.current, self.other) = (self.other, adapted);
        } else {
            self.current = adapted;
        }
        self.previous = bit;
    }
}

/// The state of `RangeEncoder::order1_flags`: the coder's range and low,
/// the two probabilities, and the flags coded so far (up to
/// `SETTLED_AFTER`).
struct Order1Writer {
    range: u32,
    low: u64,
    probs: Order1Probs,
    count: u16,
}

impl Order1Writer {
    /// `RangeEncoder::bit_unpredictable` of `bit` on the current
    /// probability, the encoder's bytes written through `to`.
    #[inline(always)]
    fn code(&mut self, to: &mut RangeEncoder, bit: bool) {
        let rate = if self.count < SETTLED_AFTER { Rate::advance(&mut self.count) } else { Rate::SETTLED };
        let p = self.probs.current;
        let bound = (self.range >> PROB_BITS) * p;
        let one = u32::from(bit).wrapping_neg();
        let zero = !one;
        self.low += u64::from(bound & one);
        self.range = (bound & zero) | (self.range.wrapping_sub(bound) & one);
        self.probs.update(bit, u32::from(adapted(p, rate, zero, one)));
        while self.range < TOP {
            self.range <<= 8;
            to.low = self.low;
            to.shift_low();
            self.low = to.low;
        }
    }
}

/// The state of `RangeDecoder::order1_flags`: the coder's, and the two
/// probabilities.
struct Order1 {
    range: u32,
    code: u32,
    pos: usize,
    probs: Order1Probs,
}

impl Order1 {
    /// Up to `n` decisions, the `i`-th at `rate(i)`, until `left` falls to
    /// zero: the word of their outcomes and how many were read.
    #[inline(always)]
    fn word(&mut self, buf: &[u8], n: u32, left: &mut u64, rate: impl Fn(u16) -> Rate) -> (u64, u32) {
        let mut word = 0u64;
        let mut i = 0;
        while i < n && *left > 0 {
            let p = self.probs.current;
            let bound = (self.range >> PROB_BITS) * p;
            let bit = self.code >= bound;
            let one = u32::from(bit).wrapping_neg();
            let zero = !one;
            self.range = (bound & zero) | (self.range.wrapping_sub(bound) & one);
            self.code = self.code.wrapping_sub(bound & one);
            self.probs.update(bit, u32::from(adapted(p, rate(i as u16), zero, one)));
            word |= u64::from(bit) << i;
            *left -= u64::from(bit);
            i += 1;
            while self.range < TOP {
                self.range <<= 8;
                // Past the end the stream reads as zeros; `overrun` tells.
                self.code = (self.code << 8) | buf.get(self.pos).map_or(0, |&b| u32::from(b));
                self.pos += 1;
            }
        }
        (word, i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_skewed_bits_and_direct_values() {
        let mut probs = [PROB_INIT; 4];
        let mut e = RangeEncoder::default();
        let mut x = 12345u64;
        let mut truth = Vec::new();
        for i in 0..20_000 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let bit = (x >> 33).is_multiple_of(10);
            e.bit(&mut probs[i % 4], bit, Rate::after(i as u16));
            e.direct(x >> 40, 7);
            truth.push((bit, (x >> 40) & 0x7f));
        }
        let out = e.finish();
        let mut probs = [PROB_INIT; 4];
        let mut d = RangeDecoder::new(&out).unwrap();
        for (i, (bit, v)) in truth.into_iter().enumerate() {
            assert_eq!(d.bit(&mut probs[i % 4], Rate::after(i as u16)), bit);
            assert_eq!(d.direct(7), v);
        }
        assert!(!d.overrun());
    }

    #[test]
    fn masked_bits_are_coded_only_when_active() {
        let mut probs = [PROB_INIT; 2];
        let mut e = RangeEncoder::default();
        let mut x = 99u64;
        let mut truth = Vec::new();
        for _ in 0..20_000 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let (active, bit) = (!(x >> 40).is_multiple_of(3), (x >> 50).is_multiple_of(4));
            e.bit_unpredictable(&mut probs[0], active, Rate::after(5));
            e.bit_masked(&mut probs[1], bit, active, Rate::after(40));
            truth.push((active, bit));
        }
        let out = e.finish();
        let mut probs = [PROB_INIT; 2];
        let mut d = RangeDecoder::new(&out).unwrap();
        for &(active, bit) in &truth {
            assert_eq!(d.bit_unpredictable(&mut probs[0], Rate::after(5)), active);
            if active {
                assert_eq!(d.bit(&mut probs[1], Rate::after(40)), bit);
            }
        }
        assert!(!d.overrun());
        // The masked decision read branch-free gives the same bits.
        let mut probs = [PROB_INIT; 2];
        let mut d = RangeDecoder::new(&out).unwrap();
        for &(active, bit) in &truth {
            assert_eq!(d.bit_unpredictable(&mut probs[0], Rate::after(5)), active);
            assert_eq!(d.bit_masked(&mut probs[1], active, Rate::after(40)), active && bit);
        }
        assert!(!d.overrun());
    }

    #[test]
    fn order1_flags_read_what_order1_decisions_wrote() {
        // Runs of changes: each flag under the probability its predecessor
        // chose; then a decision of another context after the run, read
        // from the state the reader handed back.
        for density in [2u64, 5, 50] {
            let mut x = density;
            let mut truth = Vec::new();
            for _ in 0..30_000 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let bit = if truth.last() == Some(&true) { !(x >> 40).is_multiple_of(3) } else { (x >> 40).is_multiple_of(density) };
                truth.push(bit);
            }
            // The flags end at the last change.
            let last = truth.iter().rposition(|&b| b).unwrap();
            truth.truncate(last + 1);
            let mut e = RangeEncoder::default();
            let (mut probs, mut previous, mut count) = ([PROB_INIT; 2], 0usize, 0u16);
            for &bit in &truth {
                e.bit_unpredictable(&mut probs[previous], bit, Rate::advance(&mut count));
                previous = usize::from(bit);
            }
            let mut other = PROB_INIT;
            e.bit(&mut other, true, Rate::after(0));
            let out = e.finish();
            // The encoder's twin, from the gaps, writes the same bytes.
            let mut gaps = vec![0u32];
            for &bit in &truth {
                if bit {
                    gaps.push(0);
                } else {
                    *gaps.last_mut().unwrap() += 1;
                }
            }
            gaps.pop();
            let mut twin = RangeEncoder::default();
            twin.order1_flags(&gaps);
            let mut other = PROB_INIT;
            twin.bit(&mut other, true, Rate::after(0));
            assert_eq!(twin.finish(), out, "density 1/{density}");
            let mut d = RangeDecoder::new(&out).unwrap();
            let changes = truth.iter().filter(|&&b| b).count() as u64;
            let mut words = Vec::new();
            assert_eq!(d.order1_flags(changes, 30_000, &mut words), Some(last as u64 + 1));
            assert_eq!(words.len(), (last + 1).div_ceil(64));
            let read: Vec<bool> = (0..=last).map(|r| words[r / 64] >> (r % 64) & 1 == 1).collect();
            assert_eq!(read, truth, "density 1/{density}");
            // Past the bound: refused.
            let mut d = RangeDecoder::new(&out).unwrap();
            assert_eq!(d.order1_flags(changes, last as u64, &mut Vec::new()), None);
            let mut d = RangeDecoder::new(&out).unwrap();
            assert_eq!(d.order1_flags(changes, 30_000, &mut Vec::new()), Some(last as u64 + 1));
            let mut other = PROB_INIT;
            assert!(d.bit(&mut other, Rate::after(0)));
            assert!(!d.overrun());
        }
    }

    #[test]
    fn rates_start_fast_and_settle_at_lzmas() {
        let shifts: Vec<u32> = (0..40).map(|n| Rate::after(n).0).collect();
        assert_eq!(&shifts[..8], &[1, 1, 2, 2, 2, 2, 3, 3]);
        assert_eq!(shifts[13..15], [3, 4]);
        assert_eq!(shifts[29..31], [4, 5]);
        assert!(shifts[30..].iter().all(|&s| s == 5));
        assert_eq!(Rate::SETTLED, Rate::after(SETTLED_AFTER));
        let mut count = 0u16;
        let advanced: Vec<u32> = (0..40).map(|_| Rate::advance(&mut count).0).collect();
        assert_eq!(advanced, shifts);
        assert_eq!(count, SETTLED_AFTER);
    }

    /// The bound the renormalisation relies on: whatever the rates and the
    /// outcomes, a probability stays within 1..=2047 (never certain), so a
    /// decision leaves at least 2^13 of the range and two steps restore it.
    #[test]
    fn probabilities_never_reach_certainty() {
        let mut x = 7u64;
        for pattern in 0..6u64 {
            for fixed_count in [None, Some(1u16), Some(0), Some(30)] {
                let mut p = PROB_INIT;
                let (mut lo, mut hi) = (u32::MAX, 0u32);
                for n in 0..5000u16 {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let one = match pattern {
                        0 => false,
                        1 => true,
                        2 => n < 200,
                        3 => n >= 29,
                        4 => (x >> 33).is_multiple_of(50),
                        _ => !(x >> 33).is_multiple_of(50),
                    };
                    // The schedule, or one rate throughout (counts 0 and 1:
                    // shift 1, the fastest; 30: LZMA's 5).
                    let rate = Rate::after(fixed_count.unwrap_or(n));
                    let mask = u32::MAX;
                    p = if one { adapted(p.into(), rate, 0, mask) } else { adapted(p.into(), rate, mask, 0) };
                    lo = lo.min(p.into());
                    hi = hi.max(p.into());
                }
                assert!(lo >= 1 && hi <= 2047, "pattern {pattern}, {fixed_count:?}: {lo}..={hi}");
            }
        }
        // Extreme probabilities still code and decode (two renormalisation
        // steps): a run of zeros at shift 1 then ones.
        let bits: Vec<bool> = (0..4000).map(|i| i % 1000 >= 990).collect();
        let mut prob = PROB_INIT;
        let mut e = RangeEncoder::default();
        for &b in &bits {
            e.bit(&mut prob, b, Rate::after(0));
        }
        let out = e.finish();
        let mut prob = PROB_INIT;
        let mut d = RangeDecoder::new(&out).unwrap();
        for &b in &bits {
            assert_eq!(d.bit(&mut prob, Rate::after(0)), b);
        }
        assert!(!d.overrun());
    }
}
