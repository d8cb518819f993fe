//! An adaptive binary range coder (the classic 11-bit-probability,
//! carry-propagating design of LZMA): each binary decision is coded with a
//! probability that adapts to what it has seen in its context.

pub const PROB_BITS: u32 = 11;
pub const PROB_INIT: u16 = 1 << (PROB_BITS - 1);
const MOVE_BITS: u32 = 5;
const TOP: u32 = 1 << 24;

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
    pub fn bit(&mut self, prob: &mut u16, bit: bool) {
        let p = u32::from(*prob);
        let bound = (self.range >> PROB_BITS) * p;
        if !bit {
            self.range = bound;
            *prob = (p + (((1 << PROB_BITS) - p) >> MOVE_BITS)) as u16;
        } else {
            self.low += u64::from(bound);
            self.range -= bound;
            *prob = (p - (p >> MOVE_BITS)) as u16;
        }
        self.normalize();
    }

    /// One renormalisation step always suffices (see
    /// `RangeDecoder::normalize`).
    #[inline(always)]
    fn normalize(&mut self) {
        if self.range < TOP {
            self.range <<= 8;
            self.shift_low();
        }
        debug_assert!(self.range >= TOP);
    }

    /// The same decision, branch-free: for coin tosses such as signs.
    #[inline(always)]
    pub fn bit_unpredictable(&mut self, prob: &mut u16, bit: bool) {
        self.bit_masked(prob, bit, true);
    }

    /// A branch-free decision coded only when `active` (otherwise nothing
    /// changes): the decoder reads it with `bit_masked` (or `bit` when it
    /// knows `active`).
    #[inline(always)]
    pub fn bit_masked(&mut self, prob: &mut u16, bit: bool, active: bool) {
        let p = u32::from(*prob);
        let bound = (self.range >> PROB_BITS) * p;
        let act = u32::from(active).wrapping_neg();
        let one = u32::from(bit).wrapping_neg() & act;
        let zero = !u32::from(bit).wrapping_neg() & act;
        self.low += u64::from(bound & one);
        self.range = (bound & zero) | (self.range.wrapping_sub(bound) & one) | (self.range & !act);
        let up = ((1 << PROB_BITS) - p) >> MOVE_BITS;
        let down = p >> MOVE_BITS;
        *prob = p.wrapping_add(up & zero).wrapping_sub(down & one) as u16;
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

    /// At most one byte is ever needed: before a decision `range >= 2^24`,
    /// and a probability stays within 31..=2017 (of 2048) under the update
    /// rule, so both outcomes leave `range >= (2^24 >> 11) * 31 > 2^16`; a
    /// direct bit halves the range, leaving `>= 2^23`.
    #[inline(always)]
    fn normalize(&mut self) {
        if self.range < TOP {
            self.range <<= 8;
            // Past the end the stream reads as zeros; `overrun` tells.
            let byte = self.buf.get(self.pos).map_or(0, |&b| u32::from(b));
            self.code = (self.code << 8) | byte;
            self.pos += 1;
        }
        debug_assert!(self.range >= TOP);
    }

    /// A decision whose outcome is usually the likely one: branches, which
    /// cost little when predicted (a short dependency chain).
    #[inline(always)]
    pub fn bit(&mut self, prob: &mut u16) -> bool {
        let p = u32::from(*prob);
        let bound = (self.range >> PROB_BITS) * p;
        let bit = if self.code < bound {
            self.range = bound;
            *prob = (p + (((1 << PROB_BITS) - p) >> MOVE_BITS)) as u16;
            false
        } else {
            self.code -= bound;
            self.range -= bound;
            *prob = (p - (p >> MOVE_BITS)) as u16;
            true
        };
        self.normalize();
        bit
    }

    /// The same decision, branch-free (both outcomes computed, one selected
    /// by a mask): for decisions close to a coin toss, such as signs.
    #[inline(always)]
    pub fn bit_unpredictable(&mut self, prob: &mut u16) -> bool {
        self.bit_masked(prob, true)
    }

    /// A decision read only when `active` (else `false`, nothing read), the
    /// decoder's side of `RangeEncoder::bit_masked`: branch-free, for a
    /// decision that follows an unpredictable one.
    #[inline(always)]
    pub fn bit_masked(&mut self, prob: &mut u16, active: bool) -> bool {
        let p = u32::from(*prob);
        let bound = (self.range >> PROB_BITS) * p;
        let act = u32::from(active).wrapping_neg();
        let bit = (self.code >= bound) & active;
        let one = u32::from(bit).wrapping_neg(); // all ones when the bit is 1 (and active)
        let zero = !one & act;
        self.range = (bound & zero) | (self.range.wrapping_sub(bound) & one) | (self.range & !act);
        self.code = self.code.wrapping_sub(bound & one);
        let up = ((1 << PROB_BITS) - p) >> MOVE_BITS;
        let down = p >> MOVE_BITS;
        *prob = p.wrapping_add(up & zero).wrapping_sub(down & one) as u16;
        self.normalize();
        bit
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
            e.bit(&mut probs[i % 4], bit);
            e.direct(x >> 40, 7);
            truth.push((bit, (x >> 40) & 0x7f));
        }
        let out = e.finish();
        let mut probs = [PROB_INIT; 4];
        let mut d = RangeDecoder::new(&out).unwrap();
        for (i, (bit, v)) in truth.into_iter().enumerate() {
            assert_eq!(d.bit(&mut probs[i % 4]), bit);
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
            e.bit_unpredictable(&mut probs[0], active);
            e.bit_masked(&mut probs[1], bit, active);
            truth.push((active, bit));
        }
        let out = e.finish();
        let mut probs = [PROB_INIT; 2];
        let mut d = RangeDecoder::new(&out).unwrap();
        for &(active, bit) in &truth {
            assert_eq!(d.bit_unpredictable(&mut probs[0]), active);
            if active {
                assert_eq!(d.bit(&mut probs[1]), bit);
            }
        }
        assert!(!d.overrun());
        // The masked decision read branch-free gives the same bits.
        let mut probs = [PROB_INIT; 2];
        let mut d = RangeDecoder::new(&out).unwrap();
        for &(active, bit) in &truth {
            assert_eq!(d.bit_unpredictable(&mut probs[0]), active);
            assert_eq!(d.bit_masked(&mut probs[1], active), active && bit);
        }
        assert!(!d.overrun());
    }
}
