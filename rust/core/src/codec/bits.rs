//! Bit streams (least significant bit first) and Rice codes of gaps: the
//! positions of the context-aware mode, and of small chunks in the
//! context-free mode, where a Rice code beats zstd's Huffman table.

pub(super) struct BitWriter {
    /// The whole bytes written so far, then at least 8 bytes of slack that
    /// every `put` may overwrite.
    buf: Vec<u8>,
    /// Whole bytes written.
    len: usize,
    /// Bits not yet in whole bytes (`n < 8` between calls).
    acc: u64,
    n: u32,
}

impl BitWriter {
    pub(super) fn new() -> Self {
        Self::with_capacity(0)
    }
    /// A writer with room for about `bytes` bytes before it grows.
    pub(super) fn with_capacity(bytes: usize) -> Self {
        BitWriter { buf: vec![0; bytes + 8], len: 0, acc: 0, n: 0 }
    }
    /// Append the `bits <= 32` low bits of `value`, least significant first.
    /// Branch-free in the common case: the pending bits are stored as one
    /// 8-byte word and the whole bytes among them counted as written.
    #[inline(always)]
    pub(super) fn put(&mut self, value: u64, bits: u32) {
        debug_assert!(bits <= 32 && self.n < 8);
        self.acc |= (value & ((1u64 << bits) - 1)) << self.n;
        self.n += bits;
        if self.len + 8 > self.buf.len() {
            self.buf.resize(2 * self.buf.len() + 8, 0);
        }
        self.buf[self.len..self.len + 8].copy_from_slice(&self.acc.to_le_bytes());
        let whole = self.n / 8;
        self.len += whole as usize;
        // `whole <= 4`: a shift by at most 32.
        self.acc >>= 8 * whole;
        self.n -= 8 * whole;
    }
    pub(super) fn finish(mut self) -> Vec<u8> {
        // The pending bits (fewer than 8) are already in `buf` past `len`.
        self.buf.truncate(self.len + usize::from(self.n > 0));
        self.buf
    }
}

#[derive(Clone, Copy)]
pub(super) struct BitReader<'a> {
    buf: &'a [u8],
    pos: usize,
    acc: u64,
    n: u32,
}

impl<'a> BitReader<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        BitReader { buf, pos: 0, acc: 0, n: 0 }
    }
    /// Top up `acc` to more than 55 bits while the buffer lasts. Bits of
    /// `acc` above `n` may hold the bytes that follow (never anything
    /// else), so OR-ing those bytes in again leaves them unchanged. Away
    /// from the end of the buffer this is branch-free: eight bytes are
    /// loaded and as many whole bytes as fit are counted (`n <= 63` there).
    #[inline(always)]
    fn refill(&mut self) {
        if let Some(next) = self.buf.get(self.pos..self.pos + 8) {
            let bytes = u64::from_le_bytes(next.try_into().expect("8 bytes"));
            self.acc |= bytes << self.n;
            let take = (63 - self.n) / 8;
            self.pos += take as usize;
            self.n += take * 8;
            return;
        }
        while self.n <= 56 && self.pos < self.buf.len() {
            self.acc |= u64::from(self.buf[self.pos]) << self.n;
            self.pos += 1;
            self.n += 8;
        }
    }
    /// Bits of the buffer not yet read.
    pub(super) fn unread_bits(&self) -> usize {
        (self.buf.len() - self.pos) * 8 + self.n as usize
    }
    #[inline(always)]
    pub(super) fn get(&mut self, bits: u32) -> Option<u64> {
        if self.n < bits {
            self.refill();
            if self.n < bits {
                return None;
            }
        }
        let v = self.acc & ((1u64 << bits) - 1);
        self.acc >>= bits;
        self.n -= bits;
        Some(v)
    }
}

const RICE_ESCAPE: u64 = 32;

#[inline(always)]
pub(super) fn put_rice(w: &mut BitWriter, g: u64, k: u32) {
    let q = g >> k;
    if q >= RICE_ESCAPE {
        w.put((1 << RICE_ESCAPE) - 1, RICE_ESCAPE as u32);
        w.put(g, 32);
    } else if q as u32 + 1 + k <= 32 {
        // q ones, a zero, then the k low bits: one write
        let low = g & ((1u64 << k) - 1);
        w.put(((1u64 << q) - 1) | (low << (q + 1)), q as u32 + 1 + k);
    } else {
        w.put((1u64 << q) - 1, q as u32 + 1);
        w.put(g, k);
    }
}

#[inline(always)]
pub(super) fn get_rice(r: &mut BitReader<'_>, k: u32) -> Option<u64> {
    // Fast path: the unary part and its terminating zero are among the
    // buffered bits.
    r.refill();
    let ones = (!r.acc).trailing_zeros();
    let used = ones + 1 + k; // at most 31 + 1 + 31 bits
    if u64::from(ones) < RICE_ESCAPE && used <= r.n {
        let low = (r.acc >> (ones + 1)) & ((1u64 << k) - 1);
        r.acc >>= used;
        r.n -= used;
        return Some((u64::from(ones) << k) | low);
    }
    let mut q = 0u64;
    while r.get(1)? == 1 {
        q += 1;
        if q == RICE_ESCAPE {
            return r.get(32);
        }
    }
    let low = if k > 0 { r.get(k)? } else { 0 };
    Some((q << k) | low)
}

/// The next two Rice codes (parameter `k`) when both lie among the
/// buffered bits after a refill, as they do unless a code is long; else
/// `None` and nothing is read (the caller reads one with `get_rice`). One
/// refill for two codes, and the second code's bits are found from the
/// first's end without going through the reader's state: a shorter chain
/// of dependent instructions per code than two calls of `get_rice`.
#[inline(always)]
pub(super) fn get_rice_pair(r: &mut BitReader<'_>, k: u32) -> Option<(u64, u64)> {
    r.refill();
    let acc = r.acc;
    let ones1 = (!acc).trailing_zeros();
    // Below the escape, `used1 <= 31 + 1 + 31`: the shifts stay below 64.
    if u64::from(ones1) >= RICE_ESCAPE {
        return None;
    }
    let used1 = ones1 + 1 + k;
    let rest = acc >> used1;
    let ones2 = (!rest).trailing_zeros();
    let used2 = ones2 + 1 + k;
    // Bits of `acc` past `n` are not the stream's yet: both codes must end
    // at or before it.
    if u64::from(ones2) >= RICE_ESCAPE || used1 + used2 > r.n {
        return None;
    }
    let mask = (1u64 << k) - 1;
    let first = (u64::from(ones1) << k) | ((acc >> (ones1 + 1)) & mask);
    let second = (u64::from(ones2) << k) | ((rest >> (ones2 + 1)) & mask);
    r.acc = rest >> used2;
    r.n -= used1 + used2;
    Some((first, second))
}

/// Read `count` Rice-coded gaps (parameter `k`) as ascending values
/// appended to `out`: the first is its gap, each next one the previous
/// plus one plus its gap (positions in a chunk, or ranks in a bucket).
/// Returns the value after the last; `Err` names what is wrong when the
/// stream ends early or a value would reach `limit` (at most 2^32).
pub(super) fn read_ascending(original: &mut BitReader<'_>, k: u32, count: u64, limit: u64, out: &mut Vec<u32>) -> Result<u64, &'static str> {
    debug_assert!(limit <= 1 << 32);
    // At most `limit` values fit: a larger count is refused as it runs
    // past the limit, never allocated for.
    let count = count.min(limit + 1) as usize;
    // The slots are made first, so that the loop calls nothing and the
    // reader's state stays in registers.
    let start = out.len();
    out.resize(start + count, 0);
    let slots = &mut out[start..];
    // A copy of the reader, written back at the end: stores to `r` in the
    // loop would not be moved out of it.
    let mut reader = *original;
    let r = &mut reader;
    let mut next = 0u64;
    let mut take = |at: usize, gap: u64| -> Result<(), &'static str> {
        // No overflow: `next <= limit` and a gap is below 2^36.
        let value = next + gap;
        if value >= limit {
            return Err("positions beyond the chunk's elements");
        }
        slots[at] = value as u32;
        next = value + 1;
        Ok(())
    };
    // Two codes at a time while both are buffered, else one.
    let mut at = 0;
    while at < count {
        if at + 1 < count {
            if let Some((first, second)) = get_rice_pair(r, k) {
                take(at, first)?;
                take(at + 1, second)?;
                at += 2;
                continue;
            }
        }
        take(at, get_rice(r, k).ok_or("position stream ends early")?)?;
        at += 1;
    }
    *original = reader;
    Ok(next)
}

/// The bits of the gaps as Rice codes with parameters `k0`, `k0 + 1` and
/// `k0 + 2` (all below 32), in one pass. Summed in 32-bit lanes over
/// blocks (at most 64 bits a code), which the compiler vectorises.
fn rice_costs(gaps: &[u32], k0: u32) -> [u64; 3] {
    let mut costs = [0u64; 3];
    for block in gaps.chunks(1 << 16) {
        let mut sums = [0u32; 3];
        for &g in block {
            for (i, sum) in sums.iter_mut().enumerate() {
                let k = k0 + i as u32;
                let q = g >> k;
                *sum += if u64::from(q) >= RICE_ESCAPE { RICE_ESCAPE as u32 + 32 } else { q + 1 + k };
            }
        }
        for (cost, sum) in costs.iter_mut().zip(sums) {
            *cost += u64::from(sum);
        }
    }
    costs
}

/// The Rice parameter that codes `gaps` (of `m` changes over `span`
/// elements) in the fewest bits, and those bits: three candidates around
/// the one the mean gap suggests.
pub(super) fn best_rice_parameter(gaps: &[u32], span: u64, m: u64) -> (u32, u64) {
    let mean = (span - m) as f64 / m as f64;
    let guess = if mean > 1.0 { (mean * std::f64::consts::LN_2).log2().max(0.0) as u32 } else { 0 };
    let k0 = guess.saturating_sub(1).min(29);
    let costs = rice_costs(gaps, k0);
    let best = (0..3).min_by_key(|&i| costs[i]).expect("three candidates");
    (k0 + best as u32, costs[best])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rice_round_trip_with_escape() {
        let gaps = [0u64, 1, 5, 200, 1 << 31, 3];
        let mut w = BitWriter::new();
        for &g in &gaps {
            put_rice(&mut w, g, 2);
        }
        let buf = w.finish();
        let mut r = BitReader::new(&buf);
        for &g in &gaps {
            assert_eq!(get_rice(&mut r, 2), Some(g));
        }
    }

    /// Pairs where both codes are buffered, single codes otherwise, read
    /// back the gaps of every parameter, long codes and escapes included,
    /// up to the stream's end, and a pair never reads past it.
    #[test]
    fn rice_pairs_read_what_single_codes_read() {
        let mut next = super::super::tests::xorshift(0x2545_f491_4f6c_dd1d);
        for k in [0u32, 1, 3, 7, 12, 20, 31] {
            for len in [0usize, 1, 2, 3, 9, 100, 1000] {
                // Gaps below 2^32, as in a chunk (an escape holds 32 bits).
                let gaps: Vec<u64> = (0..len)
                    .map(|_| match next() % 16 {
                        0 => next() % (1 << 32),         // escapes and long unary parts
                        1 => ((next() % 40) << k) % (1 << 32), // long unary parts
                        _ => next() % (4u64 << k),
                    })
                    .collect();
                let mut w = BitWriter::new();
                for &g in &gaps {
                    put_rice(&mut w, g, k);
                }
                let buf = w.finish();
                let mut r = BitReader::new(&buf);
                let mut read = Vec::new();
                while read.len() < len {
                    if len - read.len() >= 2 {
                        if let Some((a, b)) = get_rice_pair(&mut r, k) {
                            read.extend([a, b]);
                            continue;
                        }
                    }
                    read.push(get_rice(&mut r, k).expect("every code is in the stream"));
                }
                assert_eq!(read, gaps, "k {k}, {len} gaps");
                assert!(r.unread_bits() < 8, "k {k}: the stream is read to its last byte");
                // Past the end a pair reads at most the last byte's padding
                // (zero bits, which small parameters read as codes).
                let _ = get_rice_pair(&mut r, k);
                assert!(r.unread_bits() < 8, "k {k}: a pair read past the stream's end");
            }
        }
    }
}
