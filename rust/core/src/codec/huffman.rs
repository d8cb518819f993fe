//! Byte streams Huffman-coded straight into zstd frames.
//!
//! The free mode's low byte planes (and the sparse encoding's gap bytes)
//! are symbols with no repeats worth a match. zstd at its fastest level
//! still runs its match search over them, copies them into its sequence
//! store, counts them and builds and writes a Huffman table: about a
//! quarter of the free diff at fp32m 10->15. This writes the frame zstd
//! would, literals-only compressed blocks, directly: the bytes counted
//! (the few common values by compares, 64 at a time), one
//! length-limited code for the whole stream, and the codes looked up and
//! joined eight at a time in AVX-512 registers. Measured on the training
//! pairs' low planes (`examples/symbol_streams`, one thread, the Intel
//! Xeon host): 0.77 of zstd's time on the fp32-master 10->15 planes, 0.99
//! on the pure-bf16 10->11 ones (smaller streams, where the per-stream
//! table work weighs more); the free diff 0.96 of the time at 10->15, 0.97
//! at 12->15, 0.99 on one-step pairs; 0.02-0.11 % fewer bytes.
//!
//! The output is a plain zstd frame (without magic number, as `streams`
//! stores every zstd frame), so any zstd decoder reads it: the payload
//! format does not change. The parts of the zstd format written here
//! (RFC 8878): a frame header with a window descriptor and no content
//! size, checksum or dictionary; per block of up to 128 KiB a compressed
//! block holding a compressed (first block) or treeless (later blocks)
//! literals section and an empty sequences section; the Huffman tree as
//! weights, FSE-compressed or 4 bits each, whichever is shorter.

use super::bits::BitWriter;

/// The longest code: zstd's decoders take up to 12 bits; 11 is what zstd
/// itself writes for literals.
const MAX_CODE_BITS: usize = 11;
/// zstd's largest block, and so the most literals one block holds.
const BLOCK_MAX: usize = 128 << 10;
/// Blocks with fewer literals are one Huffman stream, others four (as zstd
/// does; four need at least 6).
const FOUR_STREAMS_FROM: usize = 256;
/// Literal block types (RFC 8878, 3.1.1.3.1.1).
const LITERALS_COMPRESSED: u64 = 2;
const LITERALS_TREELESS: u64 = 3;
/// Block type of a compressed block.
const BLOCK_COMPRESSED: u32 = 2;
/// The FSE accuracy log the Huffman weights are coded with (the largest
/// allowed; 5 saves a few bytes only for trees of a few dozen weights).
const WEIGHT_LOG: u32 = 6;
/// Weights are 0 (absent) to `MAX_CODE_BITS`.
const WEIGHT_SYMBOLS: usize = MAX_CODE_BITS + 1;

/// `data` as a zstd frame without magic number, Huffman-coded under one
/// code in literals-only blocks. `None` where that cannot be written or
/// would not be shorter than `data`: fewer than two distinct bytes, a
/// code whose description does not fit, a block that would code longer
/// than it is (the caller then gives `data` to zstd itself, or stores it).
pub(super) fn frame(data: &[u8]) -> Option<Vec<u8>> {
    let code = Code::new(&histogram(data))?;
    let tree = code.description()?;
    // Room for the streams as `put_stream` writes them (every code at the
    // longest length, plus slack), so that the frame never grows: each
    // growth copied what was written so far.
    let blocks = data.len().div_ceil(BLOCK_MAX);
    let mut out = Vec::with_capacity(data.len() * MAX_CODE_BITS / 8 + tree.len() + 96 * blocks.max(1) + 16);
    // Frame header descriptor: no content size, not single-segment, no
    // checksum, no dictionary; then the window, at least the largest block.
    out.push(0);
    out.push(window_descriptor(data.len().min(BLOCK_MAX)));
    for (b, block) in data.chunks(BLOCK_MAX).enumerate() {
        let header_at = out.len();
        out.extend_from_slice(&[0; 3]);
        let content_at = out.len();
        put_literals(&mut out, block, &code, (b == 0).then_some(tree.as_slice()))?;
        // The sequences section: no sequences.
        out.push(0);
        let size = out.len() - content_at;
        if size > block.len() {
            // A block may not be longer than the window or 128 KiB.
            return None;
        }
        let size = size as u32;
        let last = u32::from(b + 1 == blocks);
        out[header_at..content_at].copy_from_slice(&(last | BLOCK_COMPRESSED << 1 | size << 3).to_le_bytes()[..3]);
    }
    (out.len() < data.len()).then_some(out)
}

/// A window descriptor (exponent only) for a window of at least `bytes`.
fn window_descriptor(bytes: usize) -> u8 {
    let log = bytes.next_power_of_two().trailing_zeros().max(10);
    ((log - 10) << 3) as u8
}

/// A literals section: `block` coded with `code`, after the tree
/// description `tree` (the first block) or reusing the previous block's
/// (treeless). `None` if it would not be shorter than `block`.
fn put_literals(out: &mut Vec<u8>, block: &[u8], code: &Code, tree: Option<&[u8]>) -> Option<()> {
    let n = block.len();
    let four = n >= FOUR_STREAMS_FROM;
    // Size format: one stream with 10-bit sizes, or four with 10, 14 or 18.
    let (size_format, header_len, size_bits) = match n {
        _ if !four => (0u64, 3, 10),
        0..1024 => (1, 3, 10),
        1024..16384 => (2, 4, 14),
        _ => (3, 5, 18),
    };
    let header_at = out.len();
    out.extend_from_slice(&[0; 5][..header_len]);
    let body_at = out.len();
    if let Some(tree) = tree {
        out.extend_from_slice(tree);
    }
    if four {
        let segment = n.div_ceil(4);
        let jump_at = out.len();
        out.extend_from_slice(&[0; 6]);
        let mut sizes = [0usize; 4];
        for (k, part) in block.chunks(segment).enumerate() {
            sizes[k] = put_stream(out, part, code);
        }
        for k in 0..3 {
            // Each stream of at most 32 KiB codes to under 64 KiB.
            out[jump_at + 2 * k..jump_at + 2 * k + 2].copy_from_slice(&(sizes[k] as u16).to_le_bytes());
        }
    } else {
        put_stream(out, block, code);
    }
    let compressed = out.len() - body_at;
    if compressed >= n {
        return None;
    }
    let kind = if tree.is_some() { LITERALS_COMPRESSED } else { LITERALS_TREELESS };
    let header = kind | size_format << 2 | (n as u64) << 4 | (compressed as u64) << (4 + size_bits);
    out[header_at..body_at].copy_from_slice(&header.to_le_bytes()[..header_len]);
    Some(())
}

/// Append one Huffman stream of `symbols`; returns its length. Symbols are
/// written last to first, so that a decoder reading the stream from its
/// end gets them in order; a 1 bit after the last code marks the end.
#[allow(unsafe_code)]
fn put_stream(out: &mut Vec<u8>, symbols: &[u8], code: &Code) -> usize {
    let start = out.len();
    // Written in place of being zeroed first (the zeroing was 0.8 % of the
    // free diff at fp32m 10->15).
    let room = symbols.len() * MAX_CODE_BITS / 8 + 16;
    out.reserve(room);
    let mut w = StreamWriter { buf: &mut out.spare_capacity_mut()[..room], acc: 0, pending: 0, len: 0 };
    #[cfg(target_arch = "x86_64")]
    let symbols = if super::x86::vbmi_available() { avx512::put_backward(&mut w, symbols, code) } else { symbols };
    put_backward(&mut w, symbols, &code.entries);
    let len = w.finish();
    // Safety: the writer stored every byte of the stream (`StreamWriter`).
    unsafe { out.set_len(start + len) };
    len
}

/// A Huffman stream being written, least significant bit first, straight
/// into the frame. The codec's `BitWriter` sink appends the same way, but
/// owns its buffer and checks every store's bounds: the vector coder
/// through it took 0.52 ms against 0.43 on the fp32m 10->15 planes
/// (`examples/symbol_streams`), so the streams keep this writer, whose
/// state the vector coder holds in registers and stores without checks.
/// Each append stores 8 bytes at `len` and moves `len` by at most 7, so
/// the bytes before the stream's length have all been written.
struct StreamWriter<'a> {
    /// Room for every code plus 8 bytes.
    buf: &'a mut [std::mem::MaybeUninit<u8>],
    /// Bits not yet counted in `len` (`pending < 8` between calls).
    acc: u64,
    pending: u32,
    /// Whole bytes written.
    len: usize,
}

impl StreamWriter<'_> {
    /// Append the low `bits` bits of `word` (`bits <= 56`).
    #[inline(always)]
    fn put(&mut self, word: u64, bits: u32) {
        self.acc |= word << self.pending;
        self.pending += bits;
        for (d, b) in self.buf[self.len..self.len + 8].iter_mut().zip(self.acc.to_le_bytes()) {
            d.write(b);
        }
        let whole = self.pending / 8;
        self.len += whole as usize;
        self.acc >>= 8 * whole;
        self.pending -= 8 * whole;
    }

    /// The end mark; returns the stream's length.
    fn finish(mut self) -> usize {
        self.put(1, 1);
        self.len + usize::from(self.pending > 0)
    }
}

/// Append the codes of `symbols`, last to first, four per store.
fn put_backward(w: &mut StreamWriter<'_>, symbols: &[u8], entries: &[u32; 256]) {
    let head = symbols.len() % 4;
    let codes = |group: &[u8]| {
        let (mut word, mut bits) = (0u64, 0u32);
        for &s in group.iter().rev() {
            let e = entries[usize::from(s)];
            word |= u64::from(e & 0xFFFF) << bits;
            bits += e >> 16;
        }
        (word, bits)
    };
    for group in symbols[head..].rchunks_exact(4) {
        let (word, bits) = codes(group);
        w.put(word, bits);
    }
    let (word, bits) = codes(&symbols[..head]);
    w.put(word, bits);
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx512 {
    //! The count by compares, and the codes looked up (VBMI byte
    //! permutes) and joined into fours and then eights in AVX-512
    //! registers, 64 symbols per step; the writer then appends one word
    //! per eight codes (two where an eight takes more than 56 bits).
    use super::{Code, StreamWriter};
    use std::arch::x86_64::*;

    /// Append the codes of the whole 64-symbol blocks at the end of
    /// `symbols`, last to first; returns the symbols before them (fewer
    /// than 64, still to be written).
    pub(super) fn put_backward<'s>(w: &mut StreamWriter<'_>, symbols: &'s [u8], code: &Code) -> &'s [u8] {
        // Safety: the caller checked `x86::vbmi_available` (AVX-512 F, BW,
        // VBMI and BMI2).
        unsafe { put_backward_vbmi(w, symbols, code) }
    }

    /// Bytes counted one at a time to find the values to count by compares.
    pub(super) const SAMPLE: usize = 1024;
    /// How many values are counted by compares.
    const COMMON: usize = 8;
    /// Room for the other bytes between their counts.
    const OTHERS: usize = 4096;

    /// Per weight `w` (up to 11), the byte values of that weight as a
    /// 256-bit set, least significant first.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn weight_sets(weights: &[u8; 256]) -> [[u64; 4]; super::WEIGHT_SYMBOLS + 1] {
        let blocks: [__m512i; 4] = std::array::from_fn(|k| _mm512_loadu_si512(weights.as_ptr().add(64 * k).cast()));
        std::array::from_fn(|w| std::array::from_fn(|k| _mm512_cmpeq_epi8_mask(blocks[k], _mm512_set1_epi8(w as i8))))
    }

    /// `super::histogram` for streams where a few values are most of the
    /// bytes (the low byte planes: 1, 3, 7 and 15 are four fifths): the
    /// `COMMON` values most frequent in the first `SAMPLE` bytes are counted
    /// 64 bytes at a time by compares, the other bytes packed together and
    /// counted one at a time. Exact whatever the data; where the sample's
    /// common values are under half of it, counted one at a time.
    pub(super) fn histogram(data: &[u8]) -> [u32; 256] {
        // Safety: the caller checked `scan_gather_avx512::available`
        // (AVX-512 F, BW, VL, VBMI2 and POPCNT).
        unsafe { histogram_vbmi2(data) }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi2,popcnt")]
    unsafe fn histogram_vbmi2(data: &[u8]) -> [u32; 256] {
        let (sample, rest) = data.split_at(SAMPLE);
        let mut counts = super::histogram_scalar(sample);
        // The most frequent values of the sample, most frequent first.
        let mut common = [(0u32, 0u8); COMMON];
        for (s, &c) in counts.iter().enumerate() {
            if c > common[COMMON - 1].0 {
                let at = common.iter().position(|&(d, _)| c > d).expect("below the smallest kept");
                common.copy_within(at..COMMON - 1, at + 1);
                common[at] = (c, s as u8);
            }
        }
        if common.iter().map(|&(c, _)| c as usize).sum::<usize>() * 2 < SAMPLE {
            let others = super::histogram_scalar(rest);
            return std::array::from_fn(|s| counts[s] + others[s]);
        }
        // Fewer than `COMMON` values in the sample: the free slots compare
        // with the first value again, and their counts are not added.
        let used = common.iter().take_while(|&&(c, _)| c > 0).count();
        let values: [__m512i; COMMON] = std::array::from_fn(|k| _mm512_set1_epi8(common[if k < used { k } else { 0 }].1 as i8));
        let mut common_counts = [0u64; COMMON];
        let mut others = [0u8; OTHERS + 64];
        let mut n_others = 0;
        let mut blocks = rest.chunks_exact(64);
        for block in &mut blocks {
            let x = _mm512_loadu_si512(block.as_ptr().cast());
            let mut matched = 0u64;
            for k in 0..COMMON {
                let m = _mm512_cmpeq_epi8_mask(x, values[k]);
                common_counts[k] += u64::from(m.count_ones());
                matched |= m;
            }
            let other = !matched;
            _mm512_storeu_si512(others[n_others..].as_mut_ptr().cast(), _mm512_maskz_compress_epi8(other, x));
            n_others += other.count_ones() as usize;
            if n_others > OTHERS - 64 {
                add_counts(&mut counts, &others[..n_others]);
                n_others = 0;
            }
        }
        add_counts(&mut counts, &others[..n_others]);
        add_counts(&mut counts, blocks.remainder());
        for (k, &(_, s)) in common.iter().enumerate().take(used) {
            counts[usize::from(s)] += common_counts[k] as u32;
        }
        counts
    }

    fn add_counts(counts: &mut [u32; 256], bytes: &[u8]) {
        for (c, d) in counts.iter_mut().zip(super::histogram_scalar(bytes)) {
            *c += d;
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,bmi2")]
    unsafe fn put_backward_vbmi<'s>(w: &mut StreamWriter<'_>, symbols: &'s [u8], code: &Code) -> &'s [u8] {
        let head = symbols.len() % 64;
        let table = |bytes: &[u8; 256]| -> [__m512i; 4] { std::array::from_fn(|k| _mm512_loadu_si512(bytes[64 * k..].as_ptr().cast())) };
        let (len_table, lo, hi) = (table(&code.lengths), table(&code.low_bytes), table(&code.high_bytes));
        let lookup = |t: &[__m512i; 4], x: __m512i| {
            let high = _mm512_movepi8_mask(x);
            _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(t[0], x, t[1]), _mm512_permutex2var_epi8(t[2], x, t[3]))
        };
        let zero = _mm512_setzero_si512();
        // Per eight symbols: their codes joined and its length, the later
        // four's and the earlier four's.
        let mut parts = [[0u64; 8]; 6];
        // The writer's state in registers for the loop.
        let (mut acc, mut pending, mut len) = (w.acc, w.pending, w.len);
        debug_assert!(w.buf.len() >= len + (symbols.len() - head) * super::MAX_CODE_BITS / 8 + 8);
        let dst = w.buf.as_mut_ptr().cast::<u8>();
        for block in symbols[head..].chunks_exact(64).rev() {
            let x = _mm512_loadu_si512(block.as_ptr().cast());
            let (l, c0, c1) = (lookup(&len_table, x), lookup(&lo, x), lookup(&hi, x));
            // 16-bit codes and lengths: in each 128-bit lane, its symbols
            // 0-7 (`unpacklo`) and 8-15 (`unpackhi`).
            let halves = [
                (_mm512_unpacklo_epi8(c0, c1), _mm512_unpacklo_epi8(l, zero)),
                (_mm512_unpackhi_epi8(c0, c1), _mm512_unpackhi_epi8(l, zero)),
            ]
            .map(|(c16, l16)| {
                let later = _mm512_srli_epi32(l16, 16);
                let c32 = _mm512_or_si512(_mm512_srli_epi32(c16, 16), _mm512_sllv_epi32(_mm512_and_si512(c16, _mm512_set1_epi32(0xFFFF)), later));
                let l32 = _mm512_add_epi32(_mm512_and_si512(l16, _mm512_set1_epi32(0xFFFF)), later);
                let later = _mm512_srli_epi64(l32, 32);
                let c64 = _mm512_or_si512(_mm512_srli_epi64(c32, 32), _mm512_sllv_epi64(_mm512_and_si512(c32, _mm512_set1_epi64(0xFFFF_FFFF)), later));
                let l64 = _mm512_add_epi64(_mm512_and_si512(l32, _mm512_set1_epi64(0xFFFF_FFFF)), later);
                (c64, l64)
            });
            let ((ca, la), (cb, lb)) = (halves[0], halves[1]);
            // Quads 2j (`even`) and 2j + 1 (`odd`) in lane j, then joined
            // into eights where those take at most 56 bits (nearly always:
            // the codes that occur often are short).
            let (even, even_bits) = (_mm512_unpacklo_epi64(ca, cb), _mm512_unpacklo_epi64(la, lb));
            let (odd, odd_bits) = (_mm512_unpackhi_epi64(ca, cb), _mm512_unpackhi_epi64(la, lb));
            let eight = _mm512_or_si512(odd, _mm512_sllv_epi64(even, odd_bits));
            let eight_bits = _mm512_add_epi64(even_bits, odd_bits);
            for (array, v) in parts.iter_mut().zip([eight, eight_bits, odd, odd_bits, even, even_bits]) {
                _mm512_storeu_si512(array.as_mut_ptr().cast(), v);
            }
            // The last eight first; each appended on under 8 pending bits.
            let mut put = |word: u64, bits: u64| {
                acc |= word << pending;
                pending += bits as u32;
                // Safety: `put_stream` made room for every code plus 8 bytes.
                dst.add(len).cast::<u64>().write_unaligned(acc.to_le());
                len += (pending / 8) as usize;
                acc >>= pending & 56;
                pending &= 7;
            };
            for j in (0..8).rev() {
                if parts[1][j] <= 56 {
                    put(parts[0][j], parts[1][j]);
                } else {
                    put(parts[2][j], parts[3][j]);
                    put(parts[4][j], parts[5][j]);
                }
            }
        }
        (w.acc, w.pending, w.len) = (acc, pending, len);
        &symbols[..head]
    }
}

/// How often each byte value occurs.
fn histogram(data: &[u8]) -> [u32; 256] {
    #[cfg(target_arch = "x86_64")]
    if data.len() >= 4 * avx512::SAMPLE && super::scan::scan_gather_avx512::available() {
        return avx512::histogram(data);
    }
    histogram_scalar(data)
}

/// `histogram` one byte at a time (four tables, so that runs of one value
/// do not wait on one counter).
fn histogram_scalar(data: &[u8]) -> [u32; 256] {
    let (mut t0, mut t1, mut t2, mut t3) = ([0u32; 256], [0u32; 256], [0u32; 256], [0u32; 256]);
    let mut words = data.chunks_exact(8);
    for word in &mut words {
        let w = u64::from_le_bytes(word.try_into().expect("8 bytes"));
        let byte = |k: u32| ((w >> (8 * k)) & 0xFF) as usize;
        t0[byte(0)] += 1;
        t1[byte(1)] += 1;
        t2[byte(2)] += 1;
        t3[byte(3)] += 1;
        t0[byte(4)] += 1;
        t1[byte(5)] += 1;
        t2[byte(6)] += 1;
        t3[byte(7)] += 1;
    }
    for &b in words.remainder() {
        t0[usize::from(b)] += 1;
    }
    std::array::from_fn(|s| t0[s] + t1[s] + t2[s] + t3[s])
}

/// A Huffman code of bytes, in zstd's canonical form.
struct Code {
    /// Per byte value: its code in the low 16 bits, its length above (0 for
    /// values that do not occur).
    entries: [u32; 256],
    /// Per byte value: `table_log + 1 - length`, 0 for absent values.
    weights: [u8; 256],
    /// The largest byte value that occurs (its weight is implied).
    last: usize,
    /// `entries` split into byte tables, for the vector coder.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    lengths: [u8; 256],
    low_bytes: [u8; 256],
    high_bytes: [u8; 256],
}

impl Code {
    /// A length-limited Huffman code for `counts`; `None` if fewer than two
    /// values occur.
    fn new(counts: &[u32; 256]) -> Option<Code> {
        #[cfg(target_arch = "x86_64")]
        let vector = super::gather_x86::available();
        #[cfg(not(target_arch = "x86_64"))]
        let vector = false;
        Some(Code::from_lengths(code_lengths(counts)?, vector))
    }

    /// The code of these lengths (a complete code, two values or more),
    /// with the AVX-512 assignment where `vector` (the CPU has AVX-512 F
    /// and BW).
    fn from_lengths(lengths: [u8; 256], #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))] vector: bool) -> Code {
        let table_log = *lengths.iter().max().expect("256 lengths");
        let mut code = Code { entries: [0; 256], weights: [0; 256], last: 0, lengths, low_bytes: [0; 256], high_bytes: [0; 256] };
        // Codes as zstd's decoders assign them: table positions go to the
        // longest codes first (weight 1), within a weight to byte values
        // in increasing order; a value of weight w takes 2^(w-1) positions
        // and its code is its first position >> (w-1).
        for (s, &length) in lengths.iter().enumerate() {
            code.weights[s] = if length > 0 { table_log + 1 - length } else { 0 };
        }
        code.last = lengths.iter().rposition(|&l| l > 0).expect("two values occur");
        // Absent values (weight 0) take no positions and get code 0.
        let Code { entries, weights, low_bytes, high_bytes, .. } = &mut code;
        let mut assign = |s: usize, value: usize| {
            entries[s] = value as u32 | u32::from(lengths[s]) << 16;
            low_bytes[s] = value as u8;
            high_bytes[s] = (value >> 8) as u8;
        };
        #[cfg(target_arch = "x86_64")]
        if vector {
            // Each weight's values as a 256-bit set (one compare per 64
            // values), then each set's values in increasing order with
            // the next code in a register, where one counter per weight
            // in memory made a chain of the values of one weight (most
            // rare values share the longest codes): the codes of 255 values
            // from their lengths in about 0.55 us against 1.05.
            // Safety: the CPU has AVX-512 F and BW (just checked).
            #[allow(unsafe_code)]
            let sets = unsafe { avx512::weight_sets(weights) };
            let mut position = 0;
            for (w, set) in sets.iter().enumerate().take(usize::from(table_log) + 1).skip(1) {
                let mut value = position >> (w - 1);
                for (word, &bits) in set.iter().enumerate() {
                    let mut bits = bits;
                    while bits != 0 {
                        assign(64 * word + bits.trailing_zeros() as usize, value);
                        bits &= bits - 1;
                        value += 1;
                    }
                }
                position = value << (w - 1);
            }
            debug_assert_eq!(position, 1 << table_log, "a complete code");
            return code;
        }
        let mut per_weight = [0usize; WEIGHT_SYMBOLS + 1];
        for &w in weights.iter() {
            per_weight[usize::from(w)] += 1;
        }
        let mut next = [0usize; WEIGHT_SYMBOLS + 1];
        let mut position = 0;
        for w in 1..=usize::from(table_log) {
            next[w] = position;
            position += per_weight[w] << (w - 1);
        }
        debug_assert_eq!(position, 1 << table_log, "a complete code");
        for (s, &w) in weights.iter().enumerate() {
            if w > 0 {
                let w = usize::from(w);
                assign(s, next[w] >> (w - 1));
                next[w] += 1 << (w - 1);
            }
        }
        code
    }

    /// The Huffman tree description: the weights of byte values below
    /// `last`, FSE-compressed or 4 bits each, whichever is shorter and
    /// allowed (4 bits each describe at most 128 weights; FSE needs two
    /// distinct weights and under 128 bytes).
    fn description(&self) -> Option<Vec<u8>> {
        let weights = &self.weights[..self.last];
        let fse = fse_weights(weights).filter(|c| c.len() < 128).map(|c| {
            let mut d = Vec::with_capacity(c.len() + 1);
            d.push(c.len() as u8);
            d.extend_from_slice(&c);
            d
        });
        let direct = (weights.len() <= 128).then(|| {
            let mut d = Vec::with_capacity(1 + weights.len().div_ceil(2));
            d.push((127 + weights.len()) as u8);
            d.extend(weights.chunks(2).map(|p| p[0] << 4 | p.get(1).copied().unwrap_or(0)));
            d
        });
        match (fse, direct) {
            (Some(f), Some(d)) => Some(if f.len() < d.len() { f } else { d }),
            (f, d) => f.or(d),
        }
    }
}

/// Huffman code lengths for `counts`, none over `MAX_CODE_BITS` (0 for
/// absent values); `None` if fewer than two values occur.
fn code_lengths(counts: &[u32; 256]) -> Option<[u8; 256]> {
    let (leaves, n) = leaves_by_count(counts);
    if n < 2 {
        return None;
    }
    let leaves = &leaves[..n];
    // Two queues (leaves by count, internal nodes as made, also by
    // weight): each step joins the two lightest nodes.
    let mut weight = [0u64; 255];
    let mut leaf_parent = [0u8; 256];
    let mut node_parent = [0u8; 255];
    let (mut next_leaf, mut next_node) = (0, 0);
    for k in 0..n - 1 {
        for _ in 0..2 {
            if next_leaf < n && (next_node >= k || leaves[next_leaf] >> 8 <= weight[next_node]) {
                weight[k] += leaves[next_leaf] >> 8;
                leaf_parent[next_leaf] = k as u8;
                next_leaf += 1;
            } else {
                weight[k] += weight[next_node];
                node_parent[next_node] = k as u8;
                next_node += 1;
            }
        }
    }
    // Depths from the root (the last node made) down.
    let mut node_depth = [0u8; 255];
    for k in (0..n - 2).rev() {
        node_depth[k] = node_depth[usize::from(node_parent[k])] + 1;
    }
    // Counted by runs (leaves by count have non-increasing lengths but for
    // ties): one increment per leaf would wait on the one before it.
    let mut per_length = [0usize; 257];
    let mut deepest = 0;
    let (mut run_length, mut run) = (0, 0);
    for &p in &leaf_parent[..n] {
        let length = usize::from(node_depth[usize::from(p)]) + 1;
        if length != run_length {
            per_length[run_length] += run;
            (run_length, run) = (length, 0);
        }
        run += 1;
        deepest = deepest.max(length);
    }
    per_length[run_length] += run;
    limit_lengths(&mut per_length, deepest, leaves);
    // The rarest values get the longest codes.
    let mut lengths = [0u8; 256];
    let mut leaf = leaves.iter();
    for length in (1..=MAX_CODE_BITS).rev() {
        for _ in 0..per_length[length] {
            lengths[(leaf.next().expect("as many codes as values") & 0xFF) as usize] = length as u8;
        }
    }
    Some(lengths)
}

/// The values that occur, by count then value (the count above the byte),
/// and how many there are. Most counts of a plane's rare values are small:
/// those below 256 are placed by a counting sort, and only the values that
/// occur more often than that are sorted by comparison.
fn leaves_by_count(counts: &[u32; 256]) -> ([u64; 257], usize) {
    let mut per_count = [0u16; 257];
    for &c in counts {
        per_count[(c as usize).min(256)] += 1;
    }
    // Where each small count's values start, the larger counts after them
    // all; the absent values (count 0) all go to one slot past the rest.
    let mut at = [256u16; 257];
    let mut next = 0u16;
    for c in 1..=256 {
        at[c] = next;
        next += per_count[c];
    }
    let mut leaves = [0u64; 257];
    for (s, &c) in counts.iter().enumerate() {
        let bucket = (c as usize).min(256);
        leaves[usize::from(at[bucket])] = u64::from(c) << 8 | s as u64;
        at[bucket] += u16::from(c > 0);
    }
    let n = usize::from(next);
    leaves[n - usize::from(per_count[256])..n].sort_unstable();
    (leaves, n)
}

/// Cut the code lengths of a Huffman code (`per_length[l]` codes of length
/// `l`, none over `deepest`, the rarest values longest; `leaves` by count,
/// count above the byte) to `MAX_CODE_BITS` and make the code complete
/// again at little cost.
/// The cut leaves the Kraft sum over by `excess` units of 2^-MAX; each step
/// then lengthens by one the rarest code of the length whose lengthening
/// pays back the most units per bit of coded size (2^(MAX - l - 1) units for
/// the count of that code), among those that pay back no more than is
/// owed; a sum left under is made up by shortening the most frequent codes
/// that fit. Measured on the low byte planes of the training pairs: within
/// 0.1 % of an optimal length-limited code (package-merge), where dropping
/// the deepest codes to the limit and splitting the next shorter ones (as
/// deflate's encoders do) cost 4-9 %.
fn limit_lengths(per_length: &mut [usize; 257], deepest: usize, leaves: &[u64]) {
    const MAX: usize = MAX_CODE_BITS;
    for length in MAX + 1..=deepest {
        per_length[MAX] += per_length[length];
        per_length[length] = 0;
    }
    let mut excess: i64 = (1..=MAX).map(|l| (per_length[l] << (MAX - l)) as i64).sum::<i64>() - (1 << MAX);
    // `start[l]`: the index in `leaves` of the rarest code of length l (the
    // codes of one length are consecutive, longer ones first).
    let mut start = [0usize; MAX + 2];
    for l in (1..=MAX).rev() {
        start[l] = start[l + 1] + if l < MAX { per_length[l + 1] } else { 0 };
    }
    let count = |i: usize| leaves[i] >> 8;
    while excess > 0 {
        // (pays back no more than owed, units, count, length): the best.
        let mut best: Option<(bool, u64, u64, usize)> = None;
        for l in 1..MAX {
            if per_length[l] > 0 {
                let (units, cost) = (1u64 << (MAX - l - 1), count(start[l]));
                let fits = units as i64 <= excess;
                if best.is_none_or(|(f, u, c, _)| (fits, units * c) > (f, u * cost)) {
                    best = Some((fits, units, cost, l));
                }
            }
        }
        let (_, units, _, l) = best.expect("a code shorter than the limit while the sum is over");
        // The rarest of length l becomes the most frequent of length l + 1.
        per_length[l] -= 1;
        per_length[l + 1] += 1;
        start[l] += 1;
        excess -= units as i64;
    }
    while excess < 0 {
        let mut best: Option<(u64, usize, i64)> = None;
        for l in 2..=MAX {
            let units = 1i64 << (MAX - l);
            if per_length[l] > 0 && units <= -excess {
                let gain = count(start[l] + per_length[l] - 1);
                if best.is_none_or(|(g, _, _)| gain > g) {
                    best = Some((gain, l, units));
                }
            }
        }
        let (_, l, units) = best.expect("a code whose shortening fits what the sum is under");
        // The most frequent of length l becomes the rarest of length l - 1.
        per_length[l] -= 1;
        per_length[l - 1] += 1;
        start[l - 1] -= 1;
        excess += units;
    }
}

/// Huffman weights compressed by FSE (RFC 8878, 4.2.1.2): a table
/// description, then a bit stream of two interleaved states. `None` with
/// fewer than two weights or two distinct ones (FSE cannot code a single
/// symbol here).
fn fse_weights(weights: &[u8]) -> Option<Vec<u8>> {
    // Four sets of counts: neighbouring weights are often equal.
    let mut sets = [[0u32; WEIGHT_SYMBOLS + 4]; 4];
    let mut quads = weights.chunks_exact(4);
    for q in &mut quads {
        for k in 0..4 {
            sets[k][usize::from(q[k])] += 1;
        }
    }
    for &w in quads.remainder() {
        sets[0][usize::from(w)] += 1;
    }
    let counts: [u32; WEIGHT_SYMBOLS] = std::array::from_fn(|w| sets.iter().map(|set| set[w]).sum());
    if weights.len() < 2 || counts.iter().filter(|&&c| c > 0).count() < 2 {
        return None;
    }
    Some(fse_weights_at(weights, &counts, WEIGHT_LOG))
}

fn fse_weights_at(weights: &[u8], counts: &[u32; WEIGHT_SYMBOLS], log: u32) -> Vec<u8> {
    let norm = normalize(counts, weights.len() as u32, log);
    let mut out = BitWriter::with_capacity(128);
    put_table_description(&mut out, &norm, log);
    out.align_to_byte();
    // The decoding table as the decoder spreads it: state u decodes the
    // symbol spread there; the k-th state of symbol s (in increasing u)
    // reads `log - highbit(norm[s] + k)` bits and moves to
    // `((norm[s] + k) << bits) - size + those bits`. `states` lists each
    // symbol's states in increasing u, from `first[s]`.
    let size = 1usize << log;
    let step = (size >> 1) + (size >> 3) + 3;
    let mut symbol_at = [0u8; 64];
    let mut position = 0;
    for (s, &c) in norm.iter().enumerate() {
        for _ in 0..c {
            symbol_at[position] = s as u8;
            position = (position + step) & (size - 1);
        }
    }
    let mut first = [0usize; WEIGHT_SYMBOLS];
    let mut next = [0usize; WEIGHT_SYMBOLS];
    let mut total = 0;
    for s in 0..WEIGHT_SYMBOLS {
        (first[s], next[s]) = (total, total);
        total += norm[s] as usize;
    }
    // Each state plus `size`: the target the encoder starts from.
    let mut states = [0u32; 64];
    for (u, &s) in symbol_at[..size].iter().enumerate() {
        states[next[usize::from(s)]] = (u + size) as u32;
        next[usize::from(s)] += 1;
    }
    // Per symbol of count `c`: with `m = log - highbit(c - 1)` (`log` for
    // c = 1), a target reads `m` bits if it is at least `c << m` and `m -
    // 1` otherwise, which `(target + (m << 16) - (c << m)) >> 16` gives
    // (the difference stays within 16 bits); and the next state's index
    // is `(target >> read) - c` past the symbol's first.
    let highbit = |x: u32| 31 - x.leading_zeros();
    let read_delta: [u32; WEIGHT_SYMBOLS] = std::array::from_fn(|s| {
        let c = norm[s].max(1);
        let m = if c == 1 { log } else { log - highbit(c - 1) };
        (m << 16).wrapping_sub(c << m)
    });
    let index_base: [u32; WEIGHT_SYMBOLS] = std::array::from_fn(|s| (first[s] as u32).wrapping_sub(norm[s]));
    // Encoded last to first. The decoder starts with state 1 (even
    // indices) and state 2 (odd) read from the stream's end, and stops
    // when a state update runs past the stream's start: the last two
    // weights' states are each their symbol's first state, which reads at
    // least one bit (so the second to last one's update runs past), and no
    // bits are written for them.
    let n = weights.len();
    // Weight `i`'s bits (value, count) and the state before it: the state
    // the decoder goes to after weight i, plus `size` (the `target`), is
    // `(c + k) << read` plus the bits read, with `c + k` in [c, 2c).
    let step = |target: &mut u32, i: usize| -> (u64, u32) {
        let s = usize::from(weights[i]);
        let read = target.wrapping_add(read_delta[s]) >> 16;
        let value = u64::from(*target & ((1 << read) - 1));
        *target = states[((*target >> read).wrapping_add(index_base[s])) as usize];
        (value, read)
    };
    // The two states in registers, `a` for the weights of the parity of
    // `n - 3` (the first written) and `b` for the others, two weights'
    // bits per write, and each weight's bit count from one add (the
    // chains waited on an array slot, on the bit writer and on a count
    // found from the state's high bit): the description of 255 weights
    // in about 1.15 us against 1.65.
    let first_state = |i: usize| states[first[usize::from(weights[i])]];
    let (mut a, mut b) = (first_state(n - 1), first_state(n - 2));
    let mut sink = out.sink(n * log as usize + 2 * log as usize + 1);
    let mut i = n - 2;
    while i >= 2 {
        let (v1, r1) = step(&mut a, i - 1);
        let (v2, r2) = step(&mut b, i - 2);
        sink.put(v1 | v2 << r1, r1 + r2);
        i -= 2;
    }
    if i == 1 {
        let (v, r) = step(&mut a, 0);
        sink.put(v, r);
        std::mem::swap(&mut a, &mut b);
    }
    // `b` now holds the state of the weights of index 0's parity.
    let (even, odd) = (b - size as u32, a - size as u32);
    sink.put(u64::from(odd), log);
    sink.put(u64::from(even), log);
    sink.put(1, 1);
    sink.finish();
    out.finish()
}

/// `counts` (summing to `total`) scaled to sum to `2^log`, every symbol that
/// occurs keeping at least 1.
fn normalize(counts: &[u32; WEIGHT_SYMBOLS], total: u32, log: u32) -> [u32; WEIGHT_SYMBOLS] {
    let size = 1u32 << log;
    let mut norm: [u32; WEIGHT_SYMBOLS] =
        std::array::from_fn(|s| if counts[s] == 0 { 0 } else { ((counts[s] * size + total / 2) / total).max(1) });
    let mut sum: u32 = norm.iter().sum();
    while sum > size {
        let s = (0..WEIGHT_SYMBOLS).max_by_key(|&s| norm[s]).expect("symbols");
        norm[s] -= 1;
        sum -= 1;
    }
    while sum < size {
        let s = (0..WEIGHT_SYMBOLS).max_by_key(|&s| counts[s]).expect("symbols");
        norm[s] += 1;
        sum += 1;
    }
    norm
}

/// An FSE table description (RFC 8878, 4.1.1): the accuracy log, then each
/// symbol's count plus one in as few bits as the counts still to come
/// allow, a run of zero counts after a zero as 2-bit repeat codes.
fn put_table_description(out: &mut BitWriter, norm: &[u32; WEIGHT_SYMBOLS], log: u32) {
    out.put(u64::from(log - 5), 4);
    let mut remaining = (1i32 << log) + 1;
    let mut threshold = 1i32 << log;
    let mut nb_bits = log + 1;
    let mut s = 0;
    let mut previous_zero = false;
    while remaining > 1 {
        if previous_zero {
            let mut zeros = norm[s..].iter().take_while(|&&c| c == 0).count();
            s += zeros;
            while zeros >= 3 {
                out.put(3, 2);
                zeros -= 3;
            }
            out.put(zeros as u64, 2);
        }
        let count = norm[s] as i32;
        let largest_short = 2 * threshold - 1 - remaining;
        let mut value = count + 1;
        if value >= threshold {
            value += largest_short;
        }
        out.put(value as u64, if value < largest_short { nb_bits - 1 } else { nb_bits });
        remaining -= count;
        previous_zero = count == 0;
        s += 1;
        if remaining < threshold && remaining > 1 {
            nb_bits = 32 - (remaining as u32).leading_zeros();
            threshold = 1 << (nb_bits - 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn decompress(frame: &[u8], len: usize) -> Vec<u8> {
        let mut d = zstd::bulk::Decompressor::new().expect("decompressor");
        d.set_parameter(zstd::zstd_safe::DParameter::Format(zstd::zstd_safe::FrameFormat::Magicless)).expect("magicless");
        d.decompress(frame, len).expect("zstd decodes the frame")
    }

    /// Bytes drawn from a geometric-like distribution over `alphabet`
    /// values (skew: how fast the probabilities fall), from a seed.
    fn skewed(len: usize, alphabet: usize, skew: f64, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let u = (x >> 11) as f64 / (1u64 << 53) as f64;
                ((-(1.0 - u).ln() / skew) as usize % alphabet) as u8
            })
            .collect()
    }

    #[test]
    fn frames_decode_with_zstd_and_are_about_as_small_as_its_own() {
        for (len, alphabet, skew) in [(300, 256, 0.05), (5000, 256, 0.3), (70_000, 256, 0.2), (300_000, 256, 0.1), (1 << 20, 200, 0.02), (100, 3, 1.0), (40_000, 129, 0.01)] {
            let data = skewed(len, alphabet, skew, len as u64);
            let frame = frame(&data).expect("compressible");
            assert_eq!(decompress(&frame, len), data, "len {len} alphabet {alphabet}");
            let mut c = zstd::bulk::Compressor::new(1).expect("compressor");
            let theirs = c.compress(&data).expect("zstd");
            assert!(frame.len() <= theirs.len() + theirs.len() / 50 + 8, "len {len}: {} bytes against zstd's {}", frame.len(), theirs.len());
        }
    }

    #[test]
    fn a_single_value_or_incompressible_data_is_left_to_zstd() {
        assert!(frame(&[7; 1000]).is_none());
        let random = skewed(10_000, 256, 1e-9, 3);
        assert!(frame(&random).is_none(), "uniform bytes do not shrink");
    }

    #[test]
    fn codes_longer_than_the_limit_are_cut_and_stay_complete() {
        // Fibonacci-like counts make a Huffman code far deeper than 11.
        let mut counts = [0u32; 256];
        let (mut a, mut b) = (1u32, 1u32);
        for c in counts.iter_mut().take(30) {
            *c = a;
            (a, b) = (b, a.saturating_add(b));
        }
        let lengths = code_lengths(&counts).expect("a code");
        assert!(lengths.iter().all(|&l| usize::from(l) <= MAX_CODE_BITS));
        let kraft: usize = lengths.iter().filter(|&&l| l > 0).map(|&l| 1 << (MAX_CODE_BITS - usize::from(l))).sum();
        assert_eq!(kraft, 1 << MAX_CODE_BITS);
        let data: Vec<u8> = counts.iter().enumerate().flat_map(|(s, &c)| std::iter::repeat_n(s as u8, c.min(5000) as usize)).collect();
        let frame = frame(&data).expect("compressible");
        assert_eq!(decompress(&frame, data.len()), data);
    }

    #[test]
    fn both_code_assignments_agree() {
        for (len, alphabet, skew) in [(300, 256, 0.05), (5000, 256, 0.3), (70_000, 200, 0.02), (100, 3, 1.0), (40_000, 129, 0.01)] {
            let lengths = code_lengths(&histogram_scalar(&skewed(len, alphabet, skew, 7))).expect("a code");
            let portable = Code::from_lengths(lengths, false);
            let kraft: usize = lengths.iter().filter(|&&l| l > 0).map(|&l| 1 << (MAX_CODE_BITS - usize::from(l))).sum();
            assert_eq!(kraft, 1 << MAX_CODE_BITS);
            // Canonical: within a length, codes rise with the byte value.
            for a in 0..256 {
                for b in a + 1..256 {
                    if lengths[a] > 0 && lengths[a] == lengths[b] {
                        assert!(portable.entries[a] & 0xFFFF < portable.entries[b] & 0xFFFF, "values {a} and {b}");
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            if crate::codec::gather_x86::available() {
                let vector = Code::from_lengths(lengths, true);
                assert_eq!(vector.entries, portable.entries, "len {len}");
                assert_eq!((vector.low_bytes, vector.high_bytes, vector.weights, vector.last), (portable.low_bytes, portable.high_bytes, portable.weights, portable.last));
            }
        }
    }

    #[test]
    fn leaves_come_by_count_then_value() {
        let mut next = crate::codec::tests::xorshift(0x2545_F491_4F6C_DD1D);
        for round in 0..200 {
            // Absent values, ties, counts on both sides of 256 and far over.
            let counts: [u32; 256] = std::array::from_fn(|_| match next() % 8 {
                0 | 1 => 0,
                2 => 255 + (next() % 3) as u32,
                3 => (next() % 1_000_000) as u32,
                4 if round % 2 == 0 => u32::MAX - (next() % 2) as u32,
                _ => (next() % 6) as u32,
            });
            let mut want: Vec<u64> = counts.iter().enumerate().filter(|(_, &c)| c > 0).map(|(s, &c)| u64::from(c) << 8 | s as u64).collect();
            want.sort_unstable();
            let (leaves, n) = leaves_by_count(&counts);
            assert_eq!(&leaves[..n], &want[..], "round {round}");
        }
    }

    #[test]
    fn counts_are_exact_whatever_the_sample_says() {
        // Common values in the sample that are rare later, and the reverse;
        // lengths around the block size; no common values at all.
        let mut shifted = skewed(1024, 256, 0.5, 1);
        shifted.extend(skewed(50_000, 256, 0.5, 2).iter().map(|b| b.wrapping_add(100)));
        let uniform = skewed(9000, 256, 1e-9, 5);
        for data in [shifted, uniform, skewed(4096, 7, 1.0, 3), skewed(4096 + 63, 30, 0.2, 4), skewed(100_001, 256, 0.1, 6)] {
            assert_eq!(histogram(&data), histogram_scalar(&data), "{} bytes", data.len());
        }
    }

    /// One stream written by the scalar coder alone (what CPUs without
    /// AVX-512 VBMI run).
    #[allow(unsafe_code)]
    fn scalar_stream(symbols: &[u8], code: &Code) -> Vec<u8> {
        let mut out = vec![std::mem::MaybeUninit::new(0); symbols.len() * MAX_CODE_BITS / 8 + 16];
        let mut w = StreamWriter { buf: &mut out, acc: 0, pending: 0, len: 0 };
        put_backward(&mut w, symbols, &code.entries);
        let len = w.finish();
        // Safety: initialised above.
        out[..len].iter().map(|b| unsafe { b.assume_init() }).collect()
    }

    #[test]
    fn every_cpu_writes_the_same_bytes() {
        // The vector coder (where this CPU has it) against the scalar one,
        // and the vector count against the scalar one: a delta's bytes do
        // not depend on the encoding host.
        for (len, alphabet, skew) in [(64, 256, 0.1), (1000, 256, 0.3), (70_001, 256, 0.05), (4097, 12, 1.0), (30_000, 256, 0.002)] {
            let data = skewed(len, alphabet, skew, len as u64 + 7);
            let code = Code::new(&histogram(&data)).expect("two values");
            let mut vector = Vec::new();
            put_stream(&mut vector, &data, &code);
            assert_eq!(vector, scalar_stream(&data, &code), "{len} bytes");
            assert_eq!(histogram(&data), histogram_scalar(&data));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn any_frame_written_decodes_to_its_input(len in 16usize..400_000, alphabet in 2usize..=256, skew in 0.001f64..3.0, seed in any::<u64>()) {
            let data = skewed(len, alphabet, skew, seed);
            if let Some(frame) = frame(&data) {
                prop_assert!(frame.len() < data.len());
                prop_assert_eq!(decompress(&frame, len), data);
            }
        }
    }
}
