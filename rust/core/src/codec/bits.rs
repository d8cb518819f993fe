//! Bit streams, least significant bit first.

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
    /// Append the `bits <= 56` low bits of `value`, least significant first.
    /// Branch-free in the common case: the pending bits are stored as one
    /// 8-byte word and the whole bytes among them counted as written.
    #[inline(always)]
    pub(super) fn put(&mut self, value: u64, bits: u32) {
        debug_assert!(bits <= 56 && self.n < 8);
        self.acc |= (value & ((1u64 << bits) - 1)) << self.n;
        self.n += bits;
        if self.len + 8 > self.buf.len() {
            self.buf.resize(2 * self.buf.len() + 8, 0);
        }
        self.buf[self.len..self.len + 8].copy_from_slice(&self.acc.to_le_bytes());
        let whole = self.n / 8;
        self.len += whole as usize;
        // `whole <= 7`: a shift by at most 56.
        self.acc >>= 8 * whole;
        self.n -= 8 * whole;
    }
    /// `put` of the `bits <= 31` low bits of each of `values`: several
    /// values at a time (as many as fit 56 bits), with the writer's state
    /// in registers for the whole loop (through `&mut self` it would go to
    /// memory and back per value, as the buffer's stores might alias it).
    pub(super) fn put_each(&mut self, values: &[u32], bits: u32) {
        match bits {
            0 => {}
            1..=7 => self.put_grouped::<8>(values, bits),
            8..=14 => self.put_grouped::<4>(values, bits),
            15..=28 => self.put_grouped::<2>(values, bits),
            _ => self.put_grouped::<1>(values, bits),
        }
    }

    #[inline(always)]
    fn put_grouped<const G: usize>(&mut self, values: &[u32], bits: u32) {
        debug_assert!(G as u32 * bits <= 56);
        let mask = (1u64 << bits) - 1;
        let mut sink = self.sink(values.len() * bits as usize);
        let groups = values.chunks_exact(G);
        let rest = groups.remainder();
        for group in groups.chain(rest.chunks(1)) {
            let mut word = 0u64;
            for (j, &v) in group.iter().enumerate() {
                word |= (u64::from(v) & mask) << (j as u32 * bits);
            }
            sink.put(word, group.len() as u32 * bits);
        }
        sink.finish();
    }

    /// A writer of at most `max_bits` more bits whose state is a local
    /// value (kept in registers through a loop, where through `&mut self`
    /// it would go to memory and back per value, as the buffer's stores
    /// might alias it); `BitSink::finish` hands it back.
    #[inline(always)]
    pub(super) fn sink(&mut self, max_bits: usize) -> BitSink<'_> {
        debug_assert!(self.n < 8);
        let need = self.len + max_bits.div_ceil(8) + 16;
        if self.buf.len() < need {
            self.buf.resize(need.max(2 * self.buf.len()), 0);
        }
        BitSink { acc: self.acc, n: self.n, len: self.len, buf: &mut self.buf[..], acc_out: &mut self.acc, n_out: &mut self.n, len_out: &mut self.len }
    }

    /// Zero bits up to the next byte boundary.
    pub(super) fn align_to_byte(&mut self) {
        self.put(0, (8 - self.n) % 8);
    }

    pub(super) fn finish(mut self) -> Vec<u8> {
        // The pending bits (fewer than 8) are already in `buf` past `len`.
        self.buf.truncate(self.len + usize::from(self.n > 0));
        self.buf
    }
}

/// `BitWriter::sink`.
pub(super) struct BitSink<'a> {
    acc: u64,
    n: u32,
    len: usize,
    buf: &'a mut [u8],
    acc_out: &'a mut u64,
    n_out: &'a mut u32,
    len_out: &'a mut usize,
}

impl BitSink<'_> {
    /// `BitWriter::put`, within the bits the sink was made for.
    #[inline(always)]
    pub(super) fn put(&mut self, value: u64, bits: u32) {
        debug_assert!(bits <= 56 && self.n < 8 && value >> bits == 0);
        self.acc |= value << self.n;
        self.n += bits;
        self.buf[self.len..self.len + 8].copy_from_slice(&self.acc.to_le_bytes());
        let whole = self.n / 8;
        self.len += whole as usize;
        // `whole <= 7`: a shift by at most 56.
        self.acc >>= 8 * whole;
        self.n -= 8 * whole;
    }

    /// Hand the state back to the writer.
    #[inline(always)]
    pub(super) fn finish(self) {
        (*self.acc_out, *self.n_out, *self.len_out) = (self.acc, self.n, self.len);
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
