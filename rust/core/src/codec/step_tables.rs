//! Table-coded ulp steps of the context-aware mode, used for chunks with
//! many changes: a static model per chunk (a table of step classes for each
//! busy context, one shared table for the rest) and sixteen interleaved
//! rANS states. Decoding a step is then a table lookup and a multiply on
//! one of sixteen independent chains, where the adaptive range coder takes
//! two or more binary decisions, each waiting on the one before; with
//! AVX-512 the sixteen are decoded together (`avx512`), and with AVX2 eight
//! (`avx2`).
//!
//! - **Classes.** A magnitude `v = |step| - 1` below 2 is its own class.
//!   Above, the class is `2 * (nb - 1) + b`: `nb` is the bit length of `v`
//!   and `b` the bit below its leading one. The `nb - 2` bits under those
//!   are stored raw, in a bit stream of their own (they are close to
//!   uniform). Words of `w` bytes have `16 * w` classes.
//! - **Tables.** The class counts of each table, each count rounded to its
//!   leading bit and the three bits below it (exact below 16), Elias-gamma
//!   coded. Both sides turn the rounded counts into frequencies summing to
//!   4096 by the same integer rule (`frequencies`).
//! - **rANS.** 32-bit states kept in `[2^16, 2^32)`, 16-bit renormalisation;
//!   change `j` is coded by state `j % 16`. The encoder runs backwards; the
//!   stream holds the sixteen final states, then the 16-bit words in the order
//!   the decoder reads them. Every state must end where the encoder began
//!   (`2^16`), and every word and raw bit must be used.
//!
//! `docs/format.md` has the byte layout.

use super::bits::{BitReader, BitWriter};
use super::streams::{get_varint, put_varint};
use crate::error::{Error, Result};

/// Zero bytes after the rANS words: one vector of sixteen words.
const WORDS_PADDING: usize = 2 * LANES;
/// Frequencies sum to `1 << SCALE_BITS`.
const SCALE_BITS: u32 = 12;
const SCALE: u32 = 1 << SCALE_BITS;
/// The lower bound of a normalised state, and every state's start and end.
const STATE_LOW: u32 = 1 << 16;
/// Interleaved states: as many as the 32-bit lanes of an AVX-512 vector,
/// so that `avx512` decodes sixteen changes per step.
pub(super) const LANES: usize = 16;
/// A context with fewer changes uses the shared table (with more, it may
/// have one of its own: `keep_paying_tables`).
const OWN_TABLE_MIN_CHANGES: u64 = 32;
/// At most this many contexts have a table of their own in one chunk.
const MAX_OWN_TABLES: usize = 64;
/// Bits kept below a count's leading bit.
const COUNT_TOP_BITS: u32 = 3;
/// No count in a table has more bits (a chunk has fewer than 2^32 changes).
const MAX_COUNT_BITS: u32 = 33;

/// Step classes of `width`-byte words.
fn classes(width: usize) -> usize {
    16 * width
}

/// Zero bytes after the slot classes (for 4-byte gathers of the last).
const SLOT_CLASS_PADDING: usize = 3;

/// Classes of a table, as bits of an index: words of 8 bytes have 128.
const CLASS_BITS: u32 = 7;
const _: () = assert!(16 * 8 <= 1 << CLASS_BITS);

/// Whether the decoder builds the one-gather slot entries of the AVX-512
/// kernel.
fn wide_slots_wanted() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The class of magnitude `v` and how many raw bits follow it.
#[inline(always)]
fn class_of(v: u64) -> (usize, u32) {
    if v < 2 {
        (v as usize, 0)
    } else {
        let nb = 64 - v.leading_zeros();
        ((2 * (nb - 1) + ((v >> (nb - 2)) & 1) as u32) as usize, nb - 2)
    }
}

/// How many raw bits follow class `class`.
#[inline(always)]
fn raw_bits(class: usize) -> u32 {
    if class < 4 {
        0
    } else {
        class as u32 / 2 - 1
    }
}

/// The magnitude of class `class` with raw bits `raw`.
#[inline(always)]
fn magnitude(class: usize, raw: u64) -> u64 {
    if class < 2 {
        class as u64
    } else {
        let nb = class as u32 / 2 + 1;
        (1u64 << (nb - 1)) | (((class & 1) as u64) << (nb - 2)) | raw
    }
}

/// `k` as a table stores it: its leading bit and the `COUNT_TOP_BITS`
/// bits below, plus half of what was cut (exact below 16).
fn rounded_count(k: u64) -> u64 {
    let nb = 64 - k.leading_zeros();
    if nb <= COUNT_TOP_BITS + 1 {
        return k;
    }
    let cut = nb - 1 - COUNT_TOP_BITS;
    ((k >> cut) << cut) | (1 << (cut - 1))
}

/// Elias gamma code of `x >= 1`: as many ones as the bits below the
/// leading one, a zero, then those bits.
fn put_gamma(w: &mut BitWriter, x: u64) {
    debug_assert!(x >= 1);
    let low_bits = 63 - x.leading_zeros();
    for _ in 0..low_bits {
        w.put(1, 1);
    }
    w.put(0, 1);
    put_wide(w, x, low_bits);
}

/// The `bits <= 64` low bits of `value`.
fn put_wide(w: &mut BitWriter, value: u64, bits: u32) {
    if bits > 32 {
        w.put(value, 32);
        w.put(value >> 32, bits - 32);
    } else {
        w.put(value, bits);
    }
}

fn get_wide(r: &mut BitReader<'_>, bits: u32) -> Option<u64> {
    if bits > 32 {
        let low = r.get(32)?;
        Some(low | r.get(bits - 32)? << 32)
    } else {
        r.get(bits)
    }
}

/// A gamma code of at most `max_bits` bits below its leading one.
fn get_gamma(r: &mut BitReader<'_>, max_bits: u32) -> Option<u64> {
    let mut low_bits = 0;
    while r.get(1)? == 1 {
        low_bits += 1;
        if low_bits > max_bits {
            return None;
        }
    }
    Some((1u64 << low_bits) | get_wide(r, low_bits)?)
}

/// A count, as `rounded_count` keeps it: its bit length (gamma coded, plus
/// one) then up to `COUNT_TOP_BITS` bits below the leading one.
fn put_count(w: &mut BitWriter, k: u64) {
    let nb = 64 - k.leading_zeros();
    put_gamma(w, u64::from(nb) + 1);
    if nb >= 2 {
        let kept = (nb - 1).min(COUNT_TOP_BITS);
        w.put(k >> (nb - 1 - kept), kept);
    }
}

fn get_count(r: &mut BitReader<'_>) -> Option<u64> {
    let nb = get_gamma(r, 6)? as u32 - 1;
    if nb > MAX_COUNT_BITS {
        return None;
    }
    if nb < 2 {
        return Some(u64::from(nb));
    }
    let kept = (nb - 1).min(COUNT_TOP_BITS);
    let top = r.get(kept)?;
    let k = (1u64 << (nb - 1)) | (top << (nb - 1 - kept));
    Some(if nb - 1 > kept { k | 1 << (nb - 2 - kept) } else { k })
}

/// A table: how many classes it lists (gamma coded, plus one; zero for an
/// empty table), then their counts.
fn put_table(w: &mut BitWriter, counts: &[u64]) {
    let listed = counts.iter().rposition(|&k| k > 0).map_or(0, |last| last + 1);
    put_gamma(w, listed as u64 + 1);
    for &k in &counts[..listed] {
        put_count(w, k);
    }
}

/// Frequencies summing to `SCALE` for the classes with a nonzero count, in
/// proportion to `counts` (rounded counts); zero elsewhere. Returns false
/// when every count is zero. Each listed class gets at least 1; the
/// rounding error goes to (or is taken from) the largest frequencies
/// first, ties to the lower class.
fn frequencies(counts: &[u64], freqs: &mut [u32]) -> bool {
    let total: u128 = counts.iter().map(|&k| u128::from(k)).sum();
    if total == 0 {
        freqs.fill(0);
        return false;
    }
    let mut sum = 0u32;
    for (f, &k) in freqs.iter_mut().zip(counts) {
        *f = if k == 0 { 0 } else { ((u128::from(k) * u128::from(SCALE) + total / 2) / total).max(1) as u32 };
        sum += *f;
    }
    if sum < SCALE {
        let largest = (0..freqs.len()).max_by_key(|&i| (freqs[i], std::cmp::Reverse(i))).expect("a class");
        freqs[largest] += SCALE - sum;
    } else if sum > SCALE {
        let mut order: Vec<usize> = (0..freqs.len()).collect();
        order.sort_by_key(|&i| (std::cmp::Reverse(freqs[i]), i));
        let mut excess = sum - SCALE;
        for i in order {
            let take = excess.min(freqs[i].saturating_sub(1));
            freqs[i] -= take;
            excess -= take;
            if excess == 0 {
                break;
            }
        }
    }
    true
}

/// Whether a chunk of `elements` elements with `changes` changes codes its
/// steps with tables: from `TABLE_STEPS_MIN_CHANGES` changes, or from
/// `DENSE_TABLE_STEPS_MIN_CHANGES` where at least one element in
/// `DENSE_ELEMENTS_PER_CHANGE` changes. The adaptive coder makes a few
/// binary decisions per change, one after another (about 25 ns a change
/// on the hosts measured): a chunk changed that densely would decode at
/// about 2.5 GB/s of checkpoint or less with it. Measured on the training
/// pairs, against tables from 4096 changes only: the context apply of
/// fp32m 10->15 (its key and value projections, 16,384 elements with about
/// 1,600 changes each, now table-coded) 0.94-0.98 of the time, 12->15
/// 0.93-0.99, for 0.26 % and 0.42 % more payload; the one-step pairs
/// unchanged.
pub(super) fn worth_it(changes: usize, elements: usize) -> bool {
    changes >= TABLE_STEPS_MIN_CHANGES || (changes >= DENSE_TABLE_STEPS_MIN_CHANGES && changes * DENSE_ELEMENTS_PER_CHANGE >= elements)
}

/// Below this many changes in a chunk, the tables would cost more than the
/// adaptive coder's learning (unless the changes are dense, see
/// `worth_it`).
const TABLE_STEPS_MIN_CHANGES: usize = 4096;
/// Dense chunks use tables from this many changes...
const DENSE_TABLE_STEPS_MIN_CHANGES: usize = 1024;
/// ... where one element in this many or more changed.
const DENSE_ELEMENTS_PER_CHANGE: usize = 16;

/// Append the three sections (tables, raw bits, rANS words; each a varint
/// length then its bytes) coding the magnitudes `magnitudes` of changes in
/// contexts `contexts`, for `width`-byte words; `per_context[c]` is how
/// many of the changes are in context `c` (one entry per context).
pub(super) fn encode(contexts: &[u16], magnitudes: &[u64], per_context: &[u64], width: usize, out: &mut Vec<u8>) {
    let nclass = classes(width);
    let nctx = per_context.len();
    let mut own: Vec<usize> = (0..nctx).filter(|&c| per_context[c] >= OWN_TABLE_MIN_CHANGES).collect();
    if own.len() > MAX_OWN_TABLES {
        own.sort_by_key(|&c| (std::cmp::Reverse(per_context[c]), c));
        own.truncate(MAX_OWN_TABLES);
        own.sort_unstable();
    }
    let shared = own.len();
    let mut table_of = vec![shared as u16; nctx];
    for (t, &c) in own.iter().enumerate() {
        table_of[c] = t as u16;
    }
    // Classes, their counts per table, and the raw bits in change order.
    let ntables = shared + 1;
    let nsymbols = ntables * nclass;
    let mut symbols = vec![0u32; contexts.len()];
    let mut raw = BitWriter::new();
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if width <= 4 {
        type Kernel = unsafe fn(&[u16], &[u64], &[u32], &mut [u32], &mut BitWriter);
        let kernel: Option<Kernel> = if avx512::classify_available() {
            Some(avx512::classify)
        } else if crate::codec::avx2_available() {
            Some(avx2::classify)
        } else {
            None
        };
        if let Some(kernel) = kernel {
            let first_symbol: Vec<u32> = table_of.iter().map(|&t| u32::from(t) * nclass as u32).collect();
            done = contexts.len() / LANES * LANES;
            // Safety: the CPU has what the kernel needs (checked just
            // above), and the magnitudes of words of at most 4 bytes are
            // below 2^32.
            #[allow(unsafe_code)]
            unsafe {
                kernel(&contexts[..done], &magnitudes[..done], &first_symbol, &mut symbols[..done], &mut raw)
            };
        }
    }
    for ((&c, &v), symbol) in contexts.iter().zip(magnitudes).zip(symbols.iter_mut()).skip(done) {
        let (class, bits) = class_of(v);
        *symbol = (usize::from(table_of[usize::from(c)]) * nclass + class) as u32;
        if bits > 0 {
            put_wide(&mut raw, v, bits);
        }
    }
    let candidate_counts = super::counts(symbols.iter().map(|&symbol| symbol as usize), nsymbols);
    // The tables kept, and each candidate's table among them.
    let (own, table_of_candidate, counts) = keep_paying_tables(&own, &candidate_counts, nclass);
    let shared = own.len();
    let ntables = shared + 1;
    let mut tables = BitWriter::new();
    put_gamma(&mut tables, own.len() as u64 + 1);
    let mut next = 0usize;
    for (t, &c) in own.iter().enumerate() {
        put_gamma(&mut tables, (c - next) as u64 + 1);
        next = c + 1;
        put_table(&mut tables, &counts[t * nclass..(t + 1) * nclass]);
    }
    put_table(&mut tables, &counts[shared * nclass..]);
    // Frequencies and starts from the counts as the decoder will read them.
    let rounded: Vec<u64> = counts.iter().map(|&k| rounded_count(k)).collect();
    let mut freqs = vec![0u32; ntables * nclass];
    let mut table_coders = Vec::with_capacity(ntables * nclass);
    let mut table_starts = Vec::with_capacity(ntables * nclass);
    for t in 0..ntables {
        let range = t * nclass..(t + 1) * nclass;
        frequencies(&rounded[range.clone()], &mut freqs[range.clone()]);
        let mut start = 0;
        for &f in &freqs[range] {
            table_coders.push(SymbolCoder::new(f, start));
            table_starts.push(start);
            start += f;
        }
    }
    // The coders by the symbols as first numbered (a candidate's table and
    // class), so that the symbols need no second pass.
    let coder_of = |symbol: usize| table_of_candidate[symbol / nclass] * nclass + symbol % nclass;
    let coders = RansCoders {
        scalar: (0..nsymbols).map(|symbol| table_coders[coder_of(symbol)]).collect(),
        frequency_and_start: (0..nsymbols).map(|symbol| freqs[coder_of(symbol)] | table_starts[coder_of(symbol)] << 16).collect(),
    };
    let (states, words) = coders.encode(&symbols, true);
    let mut rans = Vec::with_capacity(4 * LANES + 2 * words.len());
    for x in states {
        rans.extend_from_slice(&x.to_le_bytes());
    }
    for w in words.iter().rev() {
        rans.extend_from_slice(&w.to_le_bytes());
    }
    for section in [tables.finish(), raw.finish(), rans] {
        put_varint(out, section.len() as u64);
        out.extend_from_slice(&section);
    }
}

/// Which of the candidate contexts (`candidates`, ascending, each with
/// a table of its own in `counts`, the shared table last) keep their own
/// table: those whose changes cost fewer bits with it, its description
/// included, than in the shared table (which their counts then join,
/// changing its cost too). Candidates are weighed from the fewest changes
/// up. Returns the contexts kept, each candidate's table (and the shared
/// table's) among the kept ones, and the kept tables' counts (the shared
/// table last).
///
/// A table of its own is worth its description only when its
/// context's frequencies differ enough from the shared ones; and each
/// costs the decoder a table of `SCALE` entries to build and gather from
/// (measured: a table for every context of 32 changes or more made the
/// context apply 2-3 % slower than keeping only those of 256 or more, for
/// 0.1-0.5 % of the payload).
fn keep_paying_tables(candidates: &[usize], counts: &[u64], nclass: usize) -> (Vec<usize>, Vec<usize>, Vec<u64>) {
    let shared_at = candidates.len() * nclass;
    let mut shared: Vec<u64> = counts[shared_at..shared_at + nclass].to_vec();
    let table = |t: usize| &counts[t * nclass..(t + 1) * nclass];
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by_key(|&t| table(t).iter().sum::<u64>());
    let mut kept = vec![true; candidates.len()];
    let mut joined = vec![0u64; nclass];
    for t in order {
        let own = table(t);
        for ((j, &s), &k) in joined.iter_mut().zip(&shared).zip(own) {
            *j = s + k;
        }
        let own_bits = coded_bits(own) + table_bits(own) + OWN_TABLE_EXTRA_BITS;
        let merged_extra = coded_bits(&joined) + table_bits(&joined) - coded_bits(&shared) - table_bits(&shared);
        if merged_extra <= own_bits {
            kept[t] = false;
            std::mem::swap(&mut shared, &mut joined);
        }
    }
    let own: Vec<usize> = candidates.iter().zip(&kept).filter(|(_, &k)| k).map(|(&c, _)| c).collect();
    let mut table_of = Vec::with_capacity(candidates.len() + 1);
    let mut next = 0;
    for &k in &kept {
        table_of.push(if k { next } else { own.len() });
        next += usize::from(k);
    }
    table_of.push(own.len());
    let mut out = Vec::with_capacity((own.len() + 1) * nclass);
    for (t, _) in kept.iter().enumerate().filter(|(_, &k)| k) {
        out.extend_from_slice(table(t));
    }
    out.extend_from_slice(&shared);
    (own, table_of, out)
}

/// Bits a context's own table costs beyond its counts: its context (a
/// gamma code, a few bits) and what the decoder spends on it, counted as
/// bits: `SCALE` slot entries to build and, while decoding, one more table
/// in the cache to gather from. Measured on the training pairs (context
/// apply, paired, against a table for every context of 32 changes or
/// more): 0 made the payloads 0.02-0.07 % smaller and the apply 1.3-2.3 %
/// faster; 128 (kept) 2.6-3 % faster (7.7 % at fp32m 11->12) for
/// 0.02-0.17 % more payload; 400 3.4-6 % faster for 0.4-1.5 %; 2000,
/// which drops nearly every table, 6-14 % faster for 4-8 %.
const OWN_TABLE_EXTRA_BITS: f64 = 128.0;

/// Bits of the changes of these class counts coded with frequencies in
/// proportion to them (their plug-in entropy, in total).
fn coded_bits(counts: &[u64]) -> f64 {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return 0.0;
    }
    let t = total as f64;
    counts.iter().filter(|&&k| k > 0).map(|&k| k as f64 * (t / k as f64).log2()).sum()
}

/// Bits `put_table` writes for these counts.
fn table_bits(counts: &[u64]) -> f64 {
    let gamma = |x: u64| f64::from(2 * (63 - x.leading_zeros()) + 1);
    let listed = counts.iter().rposition(|&k| k > 0).map_or(0, |last| last + 1);
    let count_bits = |k: u64| {
        let nb = 64 - k.leading_zeros();
        gamma(u64::from(nb) + 1) + f64::from((nb.max(1) - 1).min(COUNT_TOP_BITS))
    };
    gamma(listed as u64 + 1) + counts[..listed].iter().map(|&k| count_bits(k)).sum::<f64>()
}

/// The rANS coders of a chunk's symbols: each symbol's `SymbolCoder`, and
/// its frequency and start (`f | start << 16`) for the vector kernel.
struct RansCoders {
    scalar: Vec<SymbolCoder>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    frequency_and_start: Vec<u32>,
}

impl RansCoders {
    /// The final states and the words shed, in the order they were shed,
    /// of `symbols` coded backwards, symbol `j` by state `j % LANES`;
    /// with the vector kernel where `vector` and the CPU runs it.
    fn encode(&self, symbols: &[u32], vector: bool) -> ([u32; LANES], Vec<u16>) {
        let mut states = [STATE_LOW; LANES];
        // At most one word shed per symbol: each is written, and kept when
        // shed, without a branch on it (the context diff 0.98-0.985 of the
        // time at fp32m 10->15 and bf16 10->11, paired, against a branch:
        // about one symbol in five sheds); the vector kernel writes sixteen
        // at a time.
        let mut words = vec![0u16; symbols.len() + LANES];
        let mut shed = 0;
        // The last, partial group first, then whole groups from the last
        // down.
        let whole = symbols.len() / LANES * LANES;
        for (j, &symbol) in symbols.iter().enumerate().skip(whole).rev() {
            self.scalar[symbol as usize].put(&mut states[j % LANES], &mut words, &mut shed);
        }
        let scalar_from = if vector && self.vector_groups(&symbols[..whole], &mut states, &mut words, &mut shed) { 0 } else { whole };
        for (j, &symbol) in symbols[..scalar_from].iter().enumerate().rev() {
            self.scalar[symbol as usize].put(&mut states[j % LANES], &mut words, &mut shed);
        }
        words.truncate(shed);
        (states, words)
    }

    /// The whole groups `symbols` by the vector kernel, where the CPU runs
    /// it (returns whether it did).
    #[cfg(target_arch = "x86_64")]
    fn vector_groups(&self, symbols: &[u32], states: &mut [u32; LANES], words: &mut [u16], shed: &mut usize) -> bool {
        if !avx512::available() {
            return false;
        }
        let reciprocals: Vec<f64> = self.frequency_and_start.iter().map(|&p| 1.0 / f64::from((p & 0xFFFF).max(1))).collect();
        // Safety: the CPU has what the kernel needs (checked just above),
        // every symbol indexes both tables, every symbol coded has a
        // frequency of at least 1, and `words` has room for sixteen past
        // every word kept.
        #[allow(unsafe_code)]
        unsafe {
            avx512::rans_groups(symbols, &self.frequency_and_start, &reciprocals, states, words, shed)
        };
        true
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn vector_groups(&self, _: &[u32], _: &mut [u32; LANES], _: &mut [u16], _: &mut usize) -> bool {
        false
    }
}

/// How the rANS encoder codes one symbol of frequency `f` and start `s`:
/// `x -> (x / f) * 2^12 + x % f + s`, with the division done as a
/// multiply by a reciprocal (a 32-bit division waits 12 or more cycles).
#[derive(Clone, Copy, Debug)]
struct SymbolCoder {
    /// A state at or above this (`f << 20`) sheds 16 bits first, so that
    /// the coded state stays below 2^32.
    shed_from: u64,
    /// `x / f` is the high half of `x * reciprocal` (for `f = 1`, that is
    /// `x - 1`, made up for by `bias`).
    reciprocal: u64,
    bias: u32,
    /// `2^12 - f`: the coded state is `x + bias + (x / f) * complement`.
    complement: u32,
}

impl SymbolCoder {
    fn new(f: u32, start: u32) -> Self {
        assert!(f <= SCALE, "a frequency is at most the scale");
        // For `f >= 2`, `floor(2^64 / f) + 1` exceeds `2^64 / f` by at most
        // one part in `2^64 / f`; for `x < 2^32` that moves `x / f` by less
        // than `2^-32`, never across an integer (its fraction is at most
        // `1 - 1 / f`), so the high half is exactly `floor(x / f)`.
        let (reciprocal, bias) = match f {
            0 => (0, start), // never coded
            1 => (u64::MAX, start + SCALE - 1),
            _ => ((u64::MAX / u64::from(f)) + 1, start),
        };
        SymbolCoder { shed_from: u64::from(f) << (32 - SCALE_BITS), reciprocal, bias, complement: SCALE - f }
    }

    /// Code this symbol into the state `x`, shedding its low 16 bits
    /// first when needed: the word is always written at `words[*shed]`, and
    /// kept (`*shed` advanced) only when shed.
    #[inline(always)]
    fn put(&self, x: &mut u32, words: &mut [u16], shed: &mut usize) {
        let sheds = u64::from(*x) >= self.shed_from;
        words[*shed] = *x as u16;
        *shed += usize::from(sheds);
        let y = *x >> (16 * u32::from(sheds));
        let quotient = ((u128::from(y) * u128::from(self.reciprocal)) >> 64) as u32;
        *x = y.wrapping_add(self.bias).wrapping_add(quotient.wrapping_mul(self.complement));
    }
}

/// The three sections of a table-coded payload, from `payload[*pos..]`.
pub(super) struct Sections<'a> {
    tables: &'a [u8],
    raw: &'a [u8],
    rans: &'a [u8],
}

#[cfg(test)]
impl<'a> Sections<'a> {
    /// The rANS section: the states, then the words.
    pub(super) fn rans(&self) -> &'a [u8] {
        self.rans
    }
}

/// Split off the three sections at `payload[*pos..]`, advancing `pos`.
pub(super) fn sections<'a>(payload: &'a [u8], pos: &mut usize, context: &str) -> Result<Sections<'a>> {
    let mut next = |name: &str| -> Result<&'a [u8]> {
        let len = get_varint(payload, pos, 10).ok_or_else(|| Error::corrupt(context, format!("step {name} length missing")))?;
        let rest = payload.len() - *pos;
        if len > rest as u64 {
            return Err(Error::truncated(format!("{context}, step {name}"), len, rest as u64));
        }
        let section = &payload[*pos..*pos + len as usize];
        *pos += len as usize;
        Ok(section)
    };
    Ok(Sections { tables: next("tables")?, raw: next("raw bits")?, rans: next("rANS words")? })
}

/// The decoder of table-coded steps: one chunk's tables, states and
/// streams.
pub(super) struct Decoder {
    /// Per context, its table.
    table_of: Vec<u16>,
    /// Per table, the class each of its `SCALE` slots decodes to: one byte
    /// a slot, so that the busy tables of a chunk (up to 65, 4 KiB each)
    /// stay in the core's L2 cache.
    slot_class: Vec<u8>,
    /// Per table and class (`table << CLASS_BITS | class`), the class's
    /// first slot (bits 12-23) and its frequency less one (low 12 bits).
    class_entry: Vec<u32>,
    /// For the AVX-512 kernel only (empty elsewhere): per table, each
    /// slot's class (top 8 bits), its offset from the class's first slot
    /// (12 bits) and the class's frequency less one (low 12 bits), so that
    /// one gather finds all three.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    slots: Vec<u32>,
    states: [u32; LANES],
    /// The rANS words, then `WORDS_PADDING` zero bytes (read, never used:
    /// by the vector loads of `avx512`, and once a corrupt stream runs
    /// past its end).
    words: Vec<u8>,
    words_len: usize,
    pos: usize,
    raw: RawBits,
}

/// The raw bits below the step classes, read eight bytes at a time with no
/// branch: past the end it reads zeros, and `finish` refuses the payload.
struct RawBits {
    /// The section, then eight zero bytes.
    bytes: Vec<u8>,
    /// Bits read so far.
    bit: usize,
}

impl RawBits {
    fn new(section: &[u8]) -> Self {
        let mut bytes = Vec::with_capacity(section.len() + 8);
        bytes.extend_from_slice(section);
        bytes.extend_from_slice(&[0; 8]);
        RawBits { bytes, bit: 0 }
    }

    /// The `bits <= 64` bits at bit `*bit`, advancing it.
    #[inline(always)]
    fn take_at(&self, bit: &mut usize, bits: u32) -> u64 {
        if bits > 56 {
            let low = self.narrow(bit, 32);
            return low | self.narrow(bit, bits - 32) << 32;
        }
        self.narrow(bit, bits)
    }

    /// `take_at` for `bits <= 56`: one unaligned load.
    #[inline(always)]
    fn narrow(&self, bit: &mut usize, bits: u32) -> u64 {
        let at = (*bit / 8).min(self.bytes.len() - 8);
        // SAFETY: `bytes` ends with eight padding bytes, so `at + 8` is at
        // most its length.
        #[allow(unsafe_code)]
        let word = u64::from_le_bytes(unsafe { self.bytes.get_unchecked(at..at + 8) }.try_into().expect("8 bytes"));
        let shift = *bit % 8;
        *bit += bits as usize;
        (word >> shift) & ((1u64 << bits) - 1)
    }

    /// Whether exactly the section's bits were read, give or take the
    /// padding of its last byte.
    fn used_up(&self) -> bool {
        let len = 8 * (self.bytes.len() - 8);
        self.bit <= len && self.bit + 8 > len
    }
}

/// Append the wide slot entries of a class with frequency `f` (`1..=SCALE`):
/// `class << 24 | offset << 12 | (f - 1)` for each offset below `f`. By
/// sixteen a store where the CPU has AVX-512 (`wide_slots_wanted`), where
/// the compiler's loop took two 16-byte stores per eight entries: a chunk's
/// ten or so tables of 4096 entries are about 4 % of the context apply at
/// fp32m 10->15.
fn push_slots(slots: &mut Vec<u32>, class: u32, f: u32) {
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        // Safety: the CPU has AVX-512 F (just checked).
        #[allow(unsafe_code)]
        unsafe {
            avx512::push_slots(slots, class, f)
        };
        return;
    }
    slots.extend((0..f).map(|offset| class << 24 | offset << 12 | (f - 1)));
}

impl Decoder {
    /// Read the tables for `nctx` contexts of `width`-byte words.
    pub(super) fn new(sections: &Sections<'_>, nctx: usize, width: usize, context: &str) -> Result<Self> {
        let bad = |detail: &str| Error::corrupt(context, format!("step tables: {detail}"));
        let nclass = classes(width);
        let mut r = BitReader::new(sections.tables);
        let own = get_gamma(&mut r, 7).ok_or_else(|| bad("table count missing"))? as usize - 1;
        if own > MAX_OWN_TABLES.min(nctx) {
            return Err(bad(&format!("{own} contexts with tables of their own (at most {})", MAX_OWN_TABLES.min(nctx))));
        }
        let ntables = own + 1;
        let mut table_of = vec![own as u16; nctx];
        let mut counts = vec![0u64; nclass];
        let mut freqs = vec![0u32; nclass];
        // Every slot of every table is written below, in order: no zeroing.
        let mut slot_class = Vec::with_capacity(ntables << SCALE_BITS);
        let mut class_entry = vec![0u32; ntables << CLASS_BITS];
        let wide_slots = wide_slots_wanted();
        let mut slots = Vec::with_capacity(if wide_slots { ntables << SCALE_BITS } else { 0 });
        let mut next = 0usize;
        for t in 0..ntables {
            if t < own {
                let skip = get_gamma(&mut r, 16).ok_or_else(|| bad("context missing"))? as usize - 1;
                let c = next.checked_add(skip).filter(|&c| c < nctx).ok_or_else(|| bad("contexts out of order or range"))?;
                table_of[c] = t as u16;
                next = c + 1;
            }
            let listed = get_gamma(&mut r, 8).ok_or_else(|| bad("class count missing"))? as usize - 1;
            if listed > nclass {
                return Err(bad(&format!("{listed} classes listed, at most {nclass} for these words")));
            }
            if listed == 0 && t < own {
                return Err(bad("a context's own table is empty"));
            }
            counts.fill(0);
            for k in counts.iter_mut().take(listed) {
                *k = get_count(&mut r).ok_or_else(|| bad("count missing or too large"))?;
            }
            if !frequencies(&counts, &mut freqs) {
                // The shared table of a chunk whose every change has a
                // table of its own: no valid stream uses it; decode it as
                // a table of class 0 alone.
                freqs[0] = SCALE;
            }
            let mut first = 0u32;
            for (class, &f) in freqs.iter().enumerate().filter(|(_, &f)| f > 0) {
                slot_class.resize(slot_class.len() + f as usize, class as u8);
                class_entry[t << CLASS_BITS | class] = first << 12 | (f - 1);
                if wide_slots {
                    push_slots(&mut slots, class as u32, f);
                }
                first += f;
            }
            debug_assert_eq!(slot_class.len(), (t + 1) << SCALE_BITS);
        }
        // Read by the 4-byte gathers of `avx2`, never used.
        slot_class.extend_from_slice(&[0; SLOT_CLASS_PADDING]);
        if r.unread_bits() >= 8 {
            return Err(bad("bytes left after the last table"));
        }
        if sections.rans.len() < 4 * LANES || !sections.rans.len().is_multiple_of(2) {
            return Err(bad("rANS stream shorter than its states or of odd length"));
        }
        let (head, stream) = sections.rans.split_at(4 * LANES);
        let states = std::array::from_fn(|l| u32::from_le_bytes(head[4 * l..4 * l + 4].try_into().expect("4 bytes")));
        let mut words = Vec::with_capacity(stream.len() + WORDS_PADDING);
        words.extend_from_slice(stream);
        words.extend_from_slice(&[0; WORDS_PADDING]);
        Ok(Decoder { table_of, slot_class, class_entry, slots, states, words, words_len: stream.len(), pos: 0, raw: RawBits::new(sections.raw) })
    }

    /// The magnitudes of the next four changes, in contexts `ctx`, coded
    /// by states `lane..lane + 4` (`lane` a multiple of 4). The streams'
    /// positions are kept in locals for the four, so that only the states'
    /// own chains remain.
    #[inline(always)]
    pub(super) fn decode4(&mut self, lane: usize, ctx: [usize; 4]) -> [u64; 4] {
        let mut pos = self.pos;
        let mut bit = self.raw.bit;
        let out = [
            self.step(lane, ctx[0], &mut pos, &mut bit),
            self.step(lane + 1, ctx[1], &mut pos, &mut bit),
            self.step(lane + 2, ctx[2], &mut pos, &mut bit),
            self.step(lane + 3, ctx[3], &mut pos, &mut bit),
        ];
        self.pos = pos;
        self.raw.bit = bit;
        out
    }

    /// The magnitude of the next change, in context `ctx`, coded by state
    /// `lane` (the change's index modulo 4).
    #[inline(always)]
    pub(super) fn decode(&mut self, lane: usize, ctx: usize) -> u64 {
        let (mut pos, mut bit) = (self.pos, self.raw.bit);
        let v = self.step(lane, ctx, &mut pos, &mut bit);
        self.pos = pos;
        self.raw.bit = bit;
        v
    }

    #[inline(always)]
    #[allow(unsafe_code)]
    fn step(&mut self, lane: usize, ctx: usize, pos: &mut usize, bit: &mut usize) -> u64 {
        let t = usize::from(self.table_of[ctx]);
        let x = self.states[lane];
        let slot = x & (SCALE - 1);
        // SAFETY: `new` built `table_of` with tables below `ntables`,
        // `slot_class` with `ntables << SCALE_BITS` entries and
        // `class_entry` with `ntables << CLASS_BITS`; `slot < SCALE` and
        // every class is below `classes(width) <= 1 << CLASS_BITS`.
        let class = usize::from(unsafe { *self.slot_class.get_unchecked(t << SCALE_BITS | slot as usize) });
        let entry = unsafe { *self.class_entry.get_unchecked(t << CLASS_BITS | class) };
        let x = ((entry & 0xfff) + 1) * (x >> SCALE_BITS) + slot - (entry >> 12);
        // Renormalise without a branch: shift in the next word when the
        // state fell below its range.
        let at = (*pos).min(self.words_len);
        // SAFETY: `words` holds `words_len + WORDS_PADDING` bytes and `at <= words_len`.
        let word = u32::from(u16::from_le_bytes(unsafe { [*self.words.get_unchecked(at), *self.words.get_unchecked(at + 1)] }));
        let low = u32::from(x < STATE_LOW);
        self.states[lane] = x << (16 * low) | word & low.wrapping_neg();
        *pos += 2 * low as usize;
        if class < 4 {
            return magnitude(class, 0);
        }
        magnitude(class, self.raw.take_at(bit, raw_bits(class)))
    }

    /// Check that the streams ended where they should: every state back
    /// at its start, every word read, no raw bits missing or left over.
    pub(super) fn finish(&self, context: &str) -> Result<()> {
        let bad = |detail: &str| Err(Error::corrupt(context, format!("table-coded steps: {detail}")));
        if self.pos != self.words_len {
            return bad(&format!("{} rANS bytes read of {}", self.pos, self.words_len));
        }
        if self.states != [STATE_LOW; LANES] {
            return bad("rANS states do not end where the encoder began");
        }
        if !self.raw.used_up() {
            return bad("raw bits missing or left over");
        }
        Ok(())
    }
}

/// The vector kernels that decode table-coded steps in groups of sixteen.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum GroupKernel {
    /// `avx512::decode_groups_vbmi`: tables by byte permutes.
    Avx512Vbmi,
    /// `avx512::decode_groups`: tables gathered.
    Avx512,
    /// `avx2::decode_groups`: eight lanes at a time.
    Avx2,
}

/// The group kernels this CPU runs for `steps`, widest first.
#[cfg(target_arch = "x86_64")]
pub(super) fn group_kernels_here(steps: &Decoder) -> Vec<GroupKernel> {
    let mut kernels = Vec::new();
    if avx512::vbmi_available(steps) {
        kernels.push(GroupKernel::Avx512Vbmi);
    }
    if avx512::available() {
        kernels.push(GroupKernel::Avx512);
    }
    if crate::codec::avx2_available() {
        kernels.push(GroupKernel::Avx2);
    }
    kernels
}

/// Decode the steps of the leading changes at `positions` (the next of
/// the stream, against the chunk `old` of `width`-byte words; signs from
/// bit `j % 8` of `signs[j / 8]`) into `planes` (byte `j` of each value
/// word in `planes[j]`, `width` planes as long as `positions`), with the widest vector
/// kernel this CPU runs, in whole groups of sixteen. Returns how many
/// changes it took (none where no kernel runs or fits) and whether one of
/// them leaves its element as it was (a corrupt payload); `Decoder::step`
/// takes the rest.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(super) fn decode_leading_groups(
    steps: &mut Decoder,
    old: &[u8],
    width: usize,
    positions: &[u32],
    signs: &[u8],
    model: crate::codec::gather_x86::StepModel32,
    xor: bool,
    planes: &mut [Vec<u8>],
) -> (usize, bool) {
    match group_kernels_here(steps).first() {
        Some(&kernel) => decode_leading_groups_with(kernel, steps, old, width, positions, signs, model, xor, planes),
        None => (0, false),
    }
}

/// `decode_leading_groups` with a given kernel, one of
/// `group_kernels_here` (the tests hold each to `Decoder::step`).
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[allow(clippy::too_many_arguments)]
pub(super) fn decode_leading_groups_with(
    kernel: GroupKernel,
    steps: &mut Decoder,
    old: &[u8],
    width: usize,
    positions: &[u32],
    signs: &[u8],
    model: crate::codec::gather_x86::StepModel32,
    xor: bool,
    planes: &mut [Vec<u8>],
) -> (usize, bool) {
    assert!(group_kernels_here(steps).contains(&kernel), "the caller picks a kernel this CPU runs");
    assert!(planes.len() == width && planes.iter().all(|p| p.len() == positions.len()), "one plane per byte of a word, a byte per change in each");
    let wide_head = || crate::codec::gather_x86::kernel_prefix(positions, width, old.len(), 0) / LANES * LANES;
    let head = match kernel {
        GroupKernel::Avx512Vbmi | GroupKernel::Avx512 => wide_head(),
        GroupKernel::Avx2 => avx2::kernel_prefix(positions, width, old.len()),
    };
    if head == 0 {
        return (0, false);
    }
    let slot = match width {
        1 => 0,
        2 => 1,
        _ => 2,
    };
    let (positions, mut heads): (&[u32], Vec<&mut [u8]>) = (&positions[..head], planes.iter_mut().map(|p| &mut p[..head]).collect());
    // Safety: the kernel's `kernel_prefix` took only positions whose loads
    // stay in `old` (so `width` is 1, 2 or 4), and the CPU has what the
    // kernel needs (checked just above).
    #[allow(clippy::type_complexity)]
    let unchanged = unsafe {
        type Wide = unsafe fn(&mut Decoder, &[u8], &[u32], &[u8], crate::codec::gather_x86::StepModel32, bool, &mut [&mut [u8]]) -> bool;
        match kernel {
            GroupKernel::Avx512Vbmi | GroupKernel::Avx512 => {
                let kernels: [Wide; 3] = if kernel == GroupKernel::Avx512Vbmi {
                    [avx512::decode_groups_vbmi::<1>, avx512::decode_groups_vbmi::<2>, avx512::decode_groups_vbmi::<4>]
                } else {
                    [avx512::decode_groups::<1>, avx512::decode_groups::<2>, avx512::decode_groups::<4>]
                };
                kernels[slot](steps, old, positions, signs, model, xor, &mut heads)
            }
            GroupKernel::Avx2 => {
                // Eight lanes at a time into words, then split.
                let mut values = vec![0u64; head];
                let kernels = [avx2::decode_groups::<1>, avx2::decode_groups::<2>, avx2::decode_groups::<4>];
                let unchanged = kernels[slot](steps, old, positions, signs, model, xor, &mut values);
                for (head, plane) in heads.iter_mut().zip(super::planes_of(&values, width)) {
                    head.copy_from_slice(&plane);
                }
                unchanged
            }
        }
    };
    (head, unchanged)
}

/// The in-place step decoding of a chunk's XOR changes, where this CPU has
/// its kernel (AVX-512 VBMI and VAES) for `steps`: `decode_leading_groups`
/// that also writes the new words of the changes it takes into the chunk
/// it decodes against and adds up their digest moves. The changes come a
/// few at a time (as a segmented expansion finds them).
#[cfg(target_arch = "x86_64")]
pub(super) struct InPlaceGroups {
    /// The chunk's first element in its tensor.
    first: u32,
    /// Changes taken (and written) so far, a whole number of groups.
    pub(super) taken: usize,
    /// Whether one of them leaves its element as it was.
    pub(super) unchanged: bool,
    pub(super) moved: crate::digest::DigestSum,
}

#[cfg(target_arch = "x86_64")]
impl InPlaceGroups {
    /// `None` where this CPU has no such kernel for `steps`, or an
    /// element's index in its tensor (`first` and on, `n` elements) could
    /// reach 2^32.
    pub(super) fn new(steps: &Decoder, first: u64, n: usize) -> Option<Self> {
        if !avx512::vbmi_available(steps) || !crate::digest::avx512::available() || first + n as u64 > 1 << 32 {
            return None;
        }
        Some(InPlaceGroups { first: first as u32, taken: 0, unchanged: false, moved: crate::digest::DigestSum::ZERO })
    }

    /// Decode and write the whole groups of `positions` (the chunk's
    /// changes found so far, of `width`-byte words) after those already
    /// taken, as far as their 4-byte loads stay inside `target`; their
    /// steps' signs from `signs`, their value words into `planes` (one per
    /// byte of a word, a byte per change of the chunk). The bytes `ahead`
    /// of `target` (the next segment, which the expansion reads next) are
    /// fetched into L2 meanwhile.
    #[allow(unsafe_code)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn take(
        &mut self,
        steps: &mut Decoder,
        target: &mut [u8],
        width: usize,
        positions: &[u32],
        signs: &[u8],
        model: crate::codec::gather_x86::StepModel32,
        planes: &mut [Vec<u8>],
        ahead: std::ops::Range<usize>,
    ) {
        let from = self.taken;
        let fresh = &positions[from..];
        let head = crate::codec::gather_x86::kernel_prefix(fresh, width, target.len(), 0) / LANES * LANES;
        if head == 0 {
            return;
        }
        assert!(planes.len() == width && planes.iter().all(|p| p.len() >= from + head), "one plane per byte of a word, a byte per change in each");
        let mut heads: Vec<&mut [u8]> = planes.iter_mut().map(|p| &mut p[from..from + head]).collect();
        // Whole groups taken so far: the signs of the next start at a byte.
        let signs = &signs[from / 8..];
        let ahead = crate::codec::Ahead::new(target.get(ahead).unwrap_or_default(), head / LANES);
        // Safety: `kernel_prefix` took only positions whose loads stay in
        // `target` (so `width` is 1, 2 or 4); `new` found AVX-512 VBMI and
        // VAES, tables that fit the byte lookups, and every element's index
        // in its tensor below 2^32.
        let (unchanged, moved) = unsafe {
            match width {
                1 => avx512::decode_groups_vbmi_in_place::<1>(steps, target, self.first, &fresh[..head], signs, model, &mut heads, ahead),
                2 => avx512::decode_groups_vbmi_in_place::<2>(steps, target, self.first, &fresh[..head], signs, model, &mut heads, ahead),
                _ => avx512::decode_groups_vbmi_in_place::<4>(steps, target, self.first, &fresh[..head], signs, model, &mut heads, ahead),
            }
        };
        self.taken += head;
        self.unchanged |= unchanged;
        self.moved = self.moved.plus(moved);
    }
}

/// The vector kernels' checks of their arguments: whole groups of sixteen
/// changes, one value and one sign bit per change, a table for every
/// context.
#[cfg(target_arch = "x86_64")]
fn check_groups(steps: &Decoder, positions: &[u32], signs: &[u8], model: crate::codec::gather_x86::StepModel32, values: usize) {
    let n = positions.len();
    assert!(
        n.is_multiple_of(LANES) && values == n && signs.len() * 8 >= n && steps.table_of.len() > model.mask as usize,
        "whole groups, one value and one sign per change, a table for every context"
    );
}

/// AVX-512 decoding of table-coded steps, sixteen changes per step, one
/// per rANS state: per block of changes, first each change's old word and
/// table (gathered, or with VBMI looked up by byte permutes), then the
/// states' chain, which gathers each change's slot entry; the sixteen
/// renormalisations fed by one expand of the next words, the raw bits
/// found from a prefix sum of their lengths (out of one 64-bit load per
/// eight lanes where they fit), and the new words made in the words' high
/// bits (as `gather_x86::survey_steps` makes the steps). `Decoder::step`
/// is the reference the tests hold it to.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(super) mod avx512 {
    use std::arch::x86_64::*;

    use std::sync::OnceLock;

    use super::{class_of, Decoder, LANES, SCALE, SCALE_BITS, SLOT_CLASS_PADDING, STATE_LOW};
    use crate::codec::bits::BitWriter;
    use crate::codec::gather_x86::{self, gather_words, prefix_sum, HighWords, StepModel32};
    use crate::digest::avx512::{add_moves, moves_sum, zero_moves, MoveAcc};

    /// Changes per block of `decode_groups`: their old words and tables
    /// are gathered first, then their states' chain runs.
    const BLOCK: usize = 256;
    const _: () = assert!(BLOCK.is_multiple_of(LANES));

    /// Whether this CPU runs `decode_groups`.
    pub(in crate::codec) fn available() -> bool {
        gather_x86::available()
    }

    /// `super::push_slots` by sixteen entries a store.
    ///
    /// # Safety
    /// `available()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn push_slots(slots: &mut Vec<u32>, class: u32, f: u32) {
        let f = f as usize;
        slots.reserve(f);
        let at = slots.len();
        let spare = &mut slots.spare_capacity_mut()[..f];
        let step = _mm512_set1_epi32(16 << 12);
        let mut entry = _mm512_add_epi32(
            _mm512_set1_epi32((class << 24 | (f as u32 - 1)) as i32),
            _mm512_setr_epi32(0, 1 << 12, 2 << 12, 3 << 12, 4 << 12, 5 << 12, 6 << 12, 7 << 12, 8 << 12, 9 << 12, 10 << 12, 11 << 12, 12 << 12, 13 << 12, 14 << 12, 15 << 12),
        );
        for k in (0..f).step_by(16) {
            let lanes = (f - k).min(16);
            // Safety: lanes `k..k + lanes` are within `spare` (`f` long).
            unsafe { _mm512_mask_storeu_epi32(spare.as_mut_ptr().add(k).cast(), (1u32 << lanes).wrapping_sub(1) as u16, entry) };
            entry = _mm512_add_epi32(entry, step);
        }
        // Safety: the `f` entries past `at` were written just above.
        unsafe { slots.set_len(at + f) };
    }

    /// The rANS encoder's whole groups of sixteen symbols, from the last
    /// group down (each group's lanes from 15 down, as the scalar encoder
    /// takes them): symbol `s` has frequency `packed[s] & 0xFFFF` and start
    /// `packed[s] >> 16`, and `reciprocals[s]` is the frequency's inverse.
    /// The quotient `x / f` comes from a double-precision product: for
    /// `x < 2^32` and `f <= 2^12` it is exact but where `x / f` is a whole
    /// number, which it may miss by one from below, made up for by one
    /// compare. Words shed are appended at `words[*shed..]` in the scalar
    /// encoder's order (sixteen written every group). The context diff at
    /// fp32m 10->15 0.973 of the time, paired, against the scalar loop
    /// (about five cycles a symbol); at the one-step pairs, whose chunks
    /// have fewer changes per table, within 0.5 %.
    ///
    /// # Safety
    /// `available()`; `symbols.len()` is a multiple of 16; every
    /// symbol below `packed.len() == reciprocals.len()`, each with a
    /// frequency of at least 1; `words.len() >= *shed + symbols.len() + 16`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn rans_groups(symbols: &[u32], packed: &[u32], reciprocals: &[f64], states: &mut [u32; LANES], words: &mut [u16], shed: &mut usize) {
        assert!(symbols.len().is_multiple_of(LANES) && packed.len() == reciprocals.len() && words.len() >= *shed + symbols.len() + LANES);
        let reverse = _mm512_setr_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        let low16 = _mm512_set1_epi32(0xFFFF);
        let complement_of = _mm512_set1_epi32(SCALE as i32);
        let mut x = _mm512_loadu_si512(states.as_ptr().cast());
        let mut at = *shed;
        for group in symbols.chunks_exact(LANES).rev() {
            let sym = _mm512_loadu_si512(group.as_ptr().cast());
            let info = _mm512_i32gather_epi32::<4>(sym, packed.as_ptr().cast());
            let f = _mm512_and_si512(info, low16);
            let start = _mm512_srli_epi32::<16>(info);
            // Shed where `x >= f << 20`, i.e. `x >> 20 >= f`: the low
            // sixteen bits, lane 15 first.
            let sheds = _mm512_cmpge_epu32_mask(_mm512_srli_epi32::<20>(x), f);
            let kept = _mm512_maskz_compress_epi32(sheds.reverse_bits(), _mm512_permutexvar_epi32(reverse, x));
            _mm256_storeu_si256(words.as_mut_ptr().add(at).cast(), _mm512_cvtepi32_epi16(kept));
            at += sheds.count_ones() as usize;
            let y = _mm512_mask_srli_epi32(x, sheds, x, 16);
            // q = y / f, from the low and high eight lanes in doubles.
            let r_low = _mm512_i32gather_pd::<8>(_mm512_castsi512_si256(sym), reciprocals.as_ptr().cast());
            let r_high = _mm512_i32gather_pd::<8>(_mm512_extracti64x4_epi64::<1>(sym), reciprocals.as_ptr().cast());
            let q_low = _mm512_cvttpd_epu32(_mm512_mul_pd(_mm512_cvtepu32_pd(_mm512_castsi512_si256(y)), r_low));
            let q_high = _mm512_cvttpd_epu32(_mm512_mul_pd(_mm512_cvtepu32_pd(_mm512_extracti64x4_epi64::<1>(y)), r_high));
            let mut q = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q_low), q_high);
            let short = _mm512_cmpge_epu32_mask(_mm512_sub_epi32(y, _mm512_mullo_epi32(q, f)), f);
            q = _mm512_mask_add_epi32(q, short, q, _mm512_set1_epi32(1));
            // x = q * 2^12 + y % f + start = y + start + q * (2^12 - f).
            x = _mm512_add_epi32(_mm512_add_epi32(y, start), _mm512_mullo_epi32(q, _mm512_sub_epi32(complement_of, f)));
        }
        _mm512_storeu_si512(states.as_mut_ptr().cast(), x);
        *shed = at;
    }

    /// Whether this CPU runs `classify` (AVX-512 CD's leading zero counts).
    pub(in crate::codec) fn classify_available() -> bool {
        static CLASSIFY: OnceLock<bool> = OnceLock::new();
        *CLASSIFY.get_or_init(|| available() && is_x86_feature_detected!("avx512cd"))
    }

    /// The encoder's first pass, sixteen changes per step: change `j`'s
    /// symbol is `first_symbol[contexts[j]]` (its table's first) plus the
    /// class of `magnitudes[j]`, and its raw bits go to `raw`, in change
    /// order. Only the few changes with raw bits take a scalar step.
    ///
    /// # Safety
    /// `classify_available()`; every magnitude is below 2^32 (words of at
    /// most 4 bytes); `contexts.len()` is a multiple of 16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd")]
    pub(in crate::codec) unsafe fn classify(contexts: &[u16], magnitudes: &[u64], first_symbol: &[u32], symbols: &mut [u32], raw: &mut BitWriter) {
        let n = contexts.len();
        assert!(
            n.is_multiple_of(LANES) && magnitudes.len() == n && symbols.len() == n && contexts.iter().all(|&c| usize::from(c) < first_symbol.len()),
            "whole groups, one magnitude and symbol per change, a table for every context"
        );
        let (ones, twos) = (_mm512_set1_epi32(1), _mm512_set1_epi32(2));
        for ((contexts, magnitudes), symbols) in contexts.chunks_exact(LANES).zip(magnitudes.chunks_exact(LANES)).zip(symbols.chunks_exact_mut(LANES)) {
            let context = _mm512_cvtepu16_epi32(_mm256_loadu_si256(contexts.as_ptr().cast()));
            let low = _mm512_cvtepi64_epi32(_mm512_loadu_si512(magnitudes.as_ptr().cast()));
            let high = _mm512_cvtepi64_epi32(_mm512_loadu_si512(magnitudes.as_ptr().add(8).cast()));
            let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high);
            let first = _mm512_i32gather_epi32::<4>(context, first_symbol.as_ptr().cast());
            // `class_of`: below 2 the magnitude itself, else twice its bit
            // length less one plus the bit below its leading one.
            let length = _mm512_sub_epi32(_mm512_set1_epi32(32), _mm512_lzcnt_epi32(v));
            let below_top = _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_sub_epi32(length, twos)), ones);
            let class = _mm512_add_epi32(_mm512_add_epi32(length, length), _mm512_sub_epi32(below_top, twos));
            let small = _mm512_cmplt_epu32_mask(v, twos);
            let class = _mm512_mask_mov_epi32(class, small, v);
            _mm512_storeu_si512(symbols.as_mut_ptr().cast(), _mm512_add_epi32(first, class));
            // Classes from 4 up carry raw bits.
            let mut with_raw = _mm512_cmpge_epu32_mask(v, _mm512_set1_epi32(4));
            while with_raw != 0 {
                let lane = with_raw.trailing_zeros() as usize;
                let (_, bits) = class_of(magnitudes[lane]);
                raw.put(magnitudes[lane], bits);
                with_raw &= with_raw - 1;
            }
        }
    }

    /// The `bits[k]` bits at bit `at[k]` of `raw` (which ends with eight
    /// padding bytes; a byte offset past its last eight bytes is clamped,
    /// as `RawBits::narrow` clamps it) for eight lanes.
    #[inline(always)]
    unsafe fn raw_bits8(raw: &[u8], at: __m256i, bits: __m256i) -> __m256i {
        let last = _mm256_set1_epi32((raw.len() - 8) as i32);
        let bytes = _mm256_min_epu32(_mm256_srli_epi32::<3>(at), last);
        let words = _mm512_i32gather_epi64::<1>(bytes, raw.as_ptr().cast());
        let shift = _mm512_cvtepu32_epi64(_mm256_and_si256(at, _mm256_set1_epi32(7)));
        let one = _mm512_set1_epi64(1);
        let mask = _mm512_sub_epi64(_mm512_sllv_epi64(one, _mm512_cvtepu32_epi64(bits)), one);
        _mm512_cvtepi64_epi32(_mm512_and_si512(_mm512_srlv_epi64(words, shift), mask))
    }

    /// Eight lanes' raw bits, `bits` of them in all from bit `base + from`
    /// of `raw`: lane `k` takes `lengths[k]` bits at `base + starts[k]`.
    #[inline(always)]
    unsafe fn raw_half(raw: &[u8], base: usize, from: usize, bits: usize, starts: __m256i, lengths: __m256i) -> __m256i {
        if bits <= 56 {
            raw_window8(raw, base + from, _mm256_sub_epi32(starts, _mm256_set1_epi32(from as i32)), lengths)
        } else {
            raw_bits8(raw, _mm256_add_epi32(_mm256_set1_epi32(base as i32), starts), lengths)
        }
    }

    /// `raw_bits8` where the eight fields lie within the 56 bits from bit
    /// `from` of `raw`: lane `k` takes `bits[k]` bits at `from + at[k]`,
    /// all out of one 64-bit load (clamped as `raw_bits8` clamps).
    #[inline(always)]
    unsafe fn raw_window8(raw: &[u8], from: usize, at: __m256i, bits: __m256i) -> __m256i {
        let byte = (from / 8).min(raw.len() - 8);
        // Safety: `raw` holds eight bytes from `byte`.
        let window = u64::from_le_bytes(unsafe { raw.get_unchecked(byte..byte + 8) }.try_into().expect("8 bytes")) >> (from % 8);
        let one = _mm512_set1_epi64(1);
        let mask = _mm512_sub_epi64(_mm512_sllv_epi64(one, _mm512_cvtepu32_epi64(bits)), one);
        _mm512_cvtepi64_epi32(_mm512_and_si512(_mm512_srlv_epi64(_mm512_set1_epi64(window as i64), _mm512_cvtepu32_epi64(at)), mask))
    }

    /// Decode the steps of the changes at `positions` (a whole number of
    /// groups of sixteen, the next of the stream) against `old`, their signs
    /// from bit `j % 8` of `signs[j / 8]`, into `planes` (byte `j` of each
    /// value word, an XOR mask or the new word unless `xor`, in plane `j`:
    /// how a chunk is applied, so no pass splits the words afterwards; the
    /// context apply 0.95-0.97 of the time at fp32m 10->15, 0.92-0.97 at
    /// bf16 10->11, against words stored and split). Returns whether a change leaves its
    /// element as it was (a corrupt payload).
    ///
    /// # Safety
    /// `gather_x86::fits(positions, W, old.len(), 0)`, `W` is 1, 2 or 4, and
    /// the CPU has AVX-512 F, BW and VL (`available()`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(in crate::codec) unsafe fn decode_groups<const W: i32>(
        steps: &mut Decoder,
        old: &[u8],
        positions: &[u32],
        signs: &[u8],
        model: StepModel32,
        xor: bool,
        planes: &mut [&mut [u8]],
    ) -> bool {
        // Safety: the caller's CPU has what this needs.
        unsafe { groups::<W, false, _>(steps, old.as_ptr(), positions, signs, model, xor, planes, &mut PlanesOnly) }
    }

    /// `decode_groups` with each change's table by byte permutes of a
    /// table of 256 bytes instead of a gather: may only run where
    /// `vbmi_available(steps)`.
    ///
    /// # Safety
    /// As for `decode_groups`, and the CPU has AVX-512 VBMI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    pub(in crate::codec) unsafe fn decode_groups_vbmi<const W: i32>(
        steps: &mut Decoder,
        old: &[u8],
        positions: &[u32],
        signs: &[u8],
        model: StepModel32,
        xor: bool,
        planes: &mut [&mut [u8]],
    ) -> bool {
        // Safety: the caller's CPU has what this needs.
        unsafe { groups::<W, true, _>(steps, old.as_ptr(), positions, signs, model, xor, planes, &mut PlanesOnly) }
    }

    /// `decode_groups_vbmi` of XOR changes that also writes each group's
    /// new words into `target` (the chunk, which is also the base read)
    /// while they are in registers, and returns their digest move
    /// (`first`: the chunk's first element in its tensor), so that no pass
    /// gathers the old words again to apply the planes (the planes are
    /// still written: they undo the chunk). Returns whether a change leaves
    /// its element as it was, as `decode_groups` does.
    ///
    /// # Safety
    /// As for `decode_groups_vbmi` with `old` the target, and the CPU has
    /// VAES (`digest::avx512::available`); `first + position` is below
    /// 2^32 for every position.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,aes,vaes")]
    pub(in crate::codec) unsafe fn decode_groups_vbmi_in_place<const W: i32>(
        steps: &mut Decoder,
        target: &mut [u8],
        first: u32,
        positions: &[u32],
        signs: &[u8],
        model: StepModel32,
        planes: &mut [&mut [u8]],
        ahead: crate::codec::Ahead,
    ) -> (bool, crate::digest::DigestSum) {
        let out = target.as_mut_ptr();
        let mut sink = InPlace { out, first: _mm512_set1_epi32(first as i32), moves: zero_moves(), ahead };
        // Safety: the caller's CPU has what this needs; the base read and
        // the words written are the same chunk, each change's word read
        // (in its group's block) before it is written.
        let unchanged = unsafe { groups::<W, true, _>(steps, out.cast_const(), positions, signs, model, true, planes, &mut sink) };
        (unchanged, moves_sum(&sink.moves))
    }

    /// What becomes of each group's decoded words besides the planes.
    trait GroupSink {
        /// The group at `positions` (their vector `vp`): old words `vo`,
        /// new words `vn`.
        unsafe fn group<const W: i32>(&mut self, positions: &[u32], vp: __m512i, vo: __m512i, vn: __m512i);
    }

    /// Nothing more: the planes are the result.
    struct PlanesOnly;

    impl GroupSink for PlanesOnly {
        #[inline(always)]
        unsafe fn group<const W: i32>(&mut self, _: &[u32], _: __m512i, _: __m512i, _: __m512i) {}
    }

    /// The new words stored into the chunk at `out`, one by one (a 32-bit
    /// scatter would also write the neighbouring words, which may belong to
    /// a chunk another thread is writing), and their digest moves added up;
    /// a group's share of `ahead` fetched. The decoder's chain of table
    /// gathers leaves the core's loads idle enough for it: with the next
    /// segment fetched while a segment decodes, the context apply of large
    /// tensors (64 MiB, 4 MiB chunks) took 0.81-0.87 of the time, where the
    /// expansion of each segment had waited on memory.
    struct InPlace {
        out: *mut u8,
        /// The chunk's first element in its tensor, in every lane.
        first: __m512i,
        moves: MoveAcc,
        ahead: crate::codec::Ahead,
    }

    impl GroupSink for InPlace {
        #[inline(always)]
        unsafe fn group<const W: i32>(&mut self, positions: &[u32], vp: __m512i, vo: __m512i, vn: __m512i) {
            self.ahead.step();
            add_moves(&mut self.moves, _mm512_add_epi32(self.first, vp), vo, vn);
            let mut words = [0u32; LANES];
            _mm512_storeu_si512(words.as_mut_ptr().cast(), vn);
            let group: &[u32; LANES] = positions.try_into().expect("a whole group");
            for k in 0..LANES {
                let p = group[k] as usize;
                match W {
                    1 => self.out.add(p).write(words[k] as u8),
                    2 => self.out.add(2 * p).cast::<u16>().write_unaligned(words[k] as u16),
                    _ => self.out.add(4 * p).cast::<u32>().write_unaligned(words[k]),
                }
            }
        }
    }

    /// Whether `decode_groups_vbmi` can run here for `steps`: the CPU has
    /// AVX-512 VBMI and every context's table fits in a byte.
    pub(in crate::codec) fn vbmi_available(steps: &Decoder) -> bool {
        crate::codec::x86::vbmi_available() && steps.table_of.len() <= 256 && steps.table_of.iter().all(|&t| t <= 0xFF)
    }

    /// The body of both AVX-512 step decoders, inlined into each.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn groups<const W: i32, const VBMI: bool, S: GroupSink>(
        steps: &mut Decoder,
        old: *const u8,
        positions: &[u32],
        signs: &[u8],
        model: StepModel32,
        xor: bool,
        planes: &mut [&mut [u8]],
        sink: &mut S,
    ) -> bool {
        assert!(planes.len() == W as usize && planes.iter().all(|p| p.len() == positions.len()), "a plane per byte of a word, a byte per change in each");
        super::check_groups(steps, positions, signs, model, positions.len());
        // Each context's table as a byte, four vectors of 64 (VBMI).
        let mut by_byte = [_mm512_setzero_si512(); 4];
        if VBMI {
            let table_bytes: [u8; 256] = std::array::from_fn(|c| steps.table_of.get(c).map_or(0, |&t| t as u8));
            by_byte = std::array::from_fn(|i| _mm512_loadu_si512(table_bytes.as_ptr().add(64 * i).cast()));
        }
        assert_eq!(steps.slots.len() + SLOT_CLASS_PADDING, steps.slot_class.len(), "the decoder built the wide slot entries");
        // Each context's table, as the first of its slots (gathered where
        // not looked up by `by_byte`).
        let table_of: Vec<u32> = if VBMI { Vec::new() } else { steps.table_of.iter().map(|&t| u32::from(t) << SCALE_BITS).collect() };
        let raw = &steps.raw.bytes[..];
        // Bit offsets in 32-bit lanes: the base is clamped to the end of
        // the raw bits (reads there are clamped anyway; a stream read that
        // far is refused by `finish`, which counts `bit` in full), and to
        // 2^30, which leaves room for the lanes' offsets.
        let raw_end = (8 * raw.len()).min(1 << 30);
        let high = HighWords::new::<W>(model.float);
        let shift = _mm_cvtsi32_si128(model.shift as i32);
        let context_mask = _mm512_set1_epi32(model.mask as i32);
        let (zero, ones, twos) = (_mm512_setzero_si512(), _mm512_set1_epi32(1), _mm512_set1_epi32(2));
        let low12 = _mm512_set1_epi32((SCALE - 1) as i32);
        let state_low = _mm512_set1_epi32(STATE_LOW as i32);
        let mut x = _mm512_loadu_si512(steps.states.as_ptr().cast());
        let (mut pos, mut bit) = (steps.pos, steps.raw.bit);
        let mut unchanged: __mmask16 = 0;
        // Per block of changes, first their old words and tables (gathers
        // that do not wait on the states, so that many are in flight),
        // then the states' chain, which waits on one gather per group.
        let (mut olds, mut tables) = ([0u32; BLOCK], [0u32; BLOCK]);
        for (b, block) in positions.chunks(BLOCK).enumerate() {
            for (k, group) in block.chunks_exact(LANES).enumerate() {
                let vp = _mm512_loadu_si512(group.as_ptr().cast());
                let vo = gather_words::<W>(old, 0xFFFF, vp);
                let context = _mm512_and_si512(_mm512_srl_epi32(vo, shift), context_mask);
                _mm512_storeu_si512(olds.as_mut_ptr().add(LANES * k).cast(), vo);
                let table = if VBMI {
                    // Each byte of `context` looked up; the low one is
                    // the context (below 256), the others are zero.
                    // Safety: `VBMI` only in `decode_groups_vbmi`, whose
                    // CPU has VBMI.
                    let table = _mm512_and_si512(crate::codec::x86::lookup_bytes(&by_byte, context), _mm512_set1_epi32(0xFF));
                    _mm512_slli_epi32::<SCALE_BITS>(table)
                } else {
                    _mm512_i32gather_epi32::<4>(context, table_of.as_ptr().cast())
                };
                _mm512_storeu_si512(tables.as_mut_ptr().add(LANES * k).cast(), table);
            }
            for k in 0..block.len() / LANES {
                let g = b * (BLOCK / LANES) + k;
                let vo = _mm512_loadu_si512(olds.as_ptr().add(LANES * k).cast());
                let table = _mm512_loadu_si512(tables.as_ptr().add(LANES * k).cast());
                let entry = _mm512_i32gather_epi32::<4>(_mm512_or_si512(table, _mm512_and_si512(x, low12)), steps.slots.as_ptr().cast());
                let class = _mm512_srli_epi32::<24>(entry);
                let frequency = _mm512_add_epi32(_mm512_and_si512(entry, low12), ones);
                x = _mm512_add_epi32(_mm512_mullo_epi32(frequency, _mm512_srli_epi32::<SCALE_BITS>(x)), _mm512_and_si512(_mm512_srli_epi32::<12>(entry), low12));
                // Renormalise: the states that fell low take the next words,
                // in lane order.
                let low = _mm512_cmplt_epu32_mask(x, state_low);
                let at = pos.min(steps.words_len);
                // Safety: `words` holds `words_len` bytes and 32 of padding.
                let next = _mm512_cvtepu16_epi32(_mm256_loadu_si256(steps.words.as_ptr().add(at).cast()));
                x = _mm512_mask_or_epi32(x, low, _mm512_slli_epi32::<16>(x), _mm512_maskz_expand_epi32(low, next));
                pos += 2 * low.count_ones() as usize;
                // The raw bits below the classes that have them.
                let raw_lengths = _mm512_max_epi32(_mm512_sub_epi32(_mm512_srli_epi32::<1>(class), ones), zero);
                let mut below = zero;
                if _mm512_test_epi32_mask(raw_lengths, raw_lengths) != 0 {
                    let base = bit.min(raw_end);
                    let sums = prefix_sum(raw_lengths);
                    let starts = _mm512_sub_epi32(sums, raw_lengths);
                    // The raw bits of the first eight lanes, and of all sixteen.
                    let first = _mm_extract_epi32::<3>(_mm512_extracti32x4_epi32::<1>(sums)) as usize;
                    let total = _mm_extract_epi32::<3>(_mm512_extracti32x4_epi32::<3>(sums)) as usize;
                    // Each half's bits from the one 64-bit load at its first
                    // bit where they fit in 56 (nearly always), else gathered,
                    // each lane's from its own byte.
                    let low_half = raw_half(raw, base, 0, first, _mm512_castsi512_si256(starts), _mm512_castsi512_si256(raw_lengths));
                    let high_half = raw_half(raw, base, first, total - first, _mm512_extracti64x4_epi64::<1>(starts), _mm512_extracti64x4_epi64::<1>(raw_lengths));
                    below = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low_half), high_half);
                    bit += total;
                }
                // The magnitude: the class itself below 2, else its top two
                // bits shifted over the raw ones (`magnitude`).
                let top = _mm512_sllv_epi32(_mm512_or_si512(twos, _mm512_and_si512(class, ones)), _mm512_sub_epi32(_mm512_srli_epi32::<1>(class), ones));
                let magnitude = _mm512_mask_mov_epi32(_mm512_or_si512(top, below), _mm512_cmplt_epu32_mask(class, twos), class);
                let negative = u16::from_le_bytes([signs[2 * g], signs[2 * g + 1]]);
                let size = _mm512_add_epi32(magnitude, ones);
                let step = _mm512_mask_sub_epi32(size, negative, zero, size);
                let new = high.down(high.ordinal(_mm512_add_epi32(high.ordinal(high.up(vo)), high.up(step))), false);
                unchanged |= _mm512_cmpeq_epi32_mask(new, vo);
                let group = &positions[LANES * g..LANES * g + LANES];
                sink.group::<W>(group, _mm512_loadu_si512(group.as_ptr().cast()), vo, new);
                let value = if xor { _mm512_xor_si512(vo, new) } else { new };
                // Byte `j` of the sixteen words to plane `j`.
                for (j, plane) in planes.iter_mut().enumerate() {
                    // Safety: `LANES * g + LANES <= positions.len()`, each
                    // plane's length (asserted above).
                    _mm_storeu_si128(plane.as_mut_ptr().add(LANES * g).cast(), _mm512_cvtepi32_epi8(_mm512_srl_epi32(value, _mm_cvtsi32_si128(8 * j as i32))));
                }
            }
        }
        _mm512_storeu_si512(steps.states.as_mut_ptr().cast(), x);
        steps.pos = pos;
        steps.raw.bit = bit;
        unchanged != 0
    }
}

/// AVX2 decoding of table-coded steps, for x86 CPUs without AVX-512:
/// eight changes per step, one per rANS state (each group of sixteen in
/// two halves). Each change's old word, table, slot class and class entry
/// are gathered; the renormalisations take the next words through a
/// permutation looked up by the mask of the states that fell low; the raw
/// bits come from a prefix sum of their lengths and two 64-bit gathers.
/// `Decoder::step` is the reference the tests hold it to.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(super) mod avx2 {
    use std::arch::x86_64::*;

    use super::{BitWriter, Decoder, CLASS_BITS, LANES, SCALE, SCALE_BITS, STATE_LOW};

    // A state fell low when its top sixteen bits are zero.
    const _: () = assert!(STATE_LOW == 1 << 16);
    use crate::codec::gather_x86::StepModel32;

    /// How many of the leading `positions` (ascending) `decode_groups`
    /// takes for a chunk of `len` bytes of `width`-byte words: whole groups
    /// of sixteen whose 4-byte loads stay inside the chunk, at positions
    /// that are valid signed 32-bit gather indices.
    pub(in crate::codec) fn kernel_prefix(positions: &[u32], width: usize, len: usize) -> usize {
        if width > 4 {
            return 0;
        }
        let fit = positions.partition_point(|&p| p < 1 << 31 && p as usize * width + 4 <= len);
        fit / LANES * LANES
    }

    /// For each mask of eight lanes, lane `k`'s source among the next
    /// words (a nibble each): the rank of bit `k` among the mask's set
    /// bits. Lanes outside the mask are not used.
    const EXPAND: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut mask = 0;
        while mask < 256 {
            let (mut lane, mut rank, mut packed) = (0, 0u32, 0u32);
            while lane < 8 {
                if mask >> lane & 1 == 1 {
                    packed |= rank << (4 * lane);
                    rank += 1;
                }
                lane += 1;
            }
            table[mask] = packed;
            mask += 1;
        }
        table
    };

    /// `super::avx512::classify` eight changes at a time: each change's
    /// symbol (its table's first plus the class of its magnitude) and its
    /// raw bits, in change order. The bit length comes from the exponent
    /// of each 16-bit half converted to a float (exact below 2^24); the
    /// eight raw fields go to `raw` as one write where they fit in 56 bits
    /// (nearly always), else one by one.
    ///
    /// # Safety
    /// The CPU has AVX2 (`codec::avx2_available`); every magnitude is below
    /// 2^32 (words of at most 4 bytes); `contexts.len()` is a multiple of
    /// 16.
    #[target_feature(enable = "avx2")]
    pub(in crate::codec) unsafe fn classify(contexts: &[u16], magnitudes: &[u64], first_symbol: &[u32], symbols: &mut [u32], raw: &mut BitWriter) {
        let n = contexts.len();
        assert!(
            n.is_multiple_of(LANES) && magnitudes.len() == n && symbols.len() == n && !first_symbol.is_empty() && first_symbol.len() <= 1 << 16,
            "whole groups, one magnitude and symbol per change, a table for every context"
        );
        debug_assert!(contexts.iter().all(|&c| usize::from(c) < first_symbol.len()));
        // Every gather index in range without a pass over the contexts: the
        // survey's contexts are below the model's count, which is
        // `first_symbol.len()`.
        let last_context = _mm256_set1_epi32(first_symbol.len() as i32 - 1);
        let (zero, ones, twos) = (_mm256_setzero_si256(), _mm256_set1_epi32(1), _mm256_set1_epi32(2));
        let low_halves = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
        let lane3 = _mm256_set1_epi32(3);
        // The bit length of each lane (below 2^16): the exponent of its
        // float, less the bias, plus one (nonsense for 0, never used).
        let length16 = |x: __m256i| _mm256_sub_epi32(_mm256_srli_epi32::<23>(_mm256_castps_si256(_mm256_cvtepi32_ps(x))), _mm256_set1_epi32(126));
        for ((contexts, magnitudes), symbols) in contexts.chunks_exact(8).zip(magnitudes.chunks_exact(8)).zip(symbols.chunks_exact_mut(8)) {
            let context = _mm256_min_epu32(_mm256_cvtepu16_epi32(_mm_loadu_si128(contexts.as_ptr().cast())), last_context);
            // The low halves of the eight 64-bit magnitudes.
            let pick = |i: usize| _mm256_permutevar8x32_epi32(_mm256_loadu_si256(magnitudes.as_ptr().add(i).cast()), low_halves);
            let v = _mm256_blend_epi32::<0xF0>(pick(0), pick(4));
            let first = _mm256_i32gather_epi32::<4>(first_symbol.as_ptr().cast(), context);
            // `class_of`: below 2 the magnitude itself, else twice its bit
            // length less one plus the bit below its leading one.
            let high = _mm256_srli_epi32::<16>(v);
            let high_zero = _mm256_cmpeq_epi32(high, zero);
            let length = _mm256_blendv_epi8(_mm256_add_epi32(length16(high), _mm256_set1_epi32(16)), length16(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF))), high_zero);
            let below_top = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_sub_epi32(length, twos)), ones);
            let class = _mm256_add_epi32(_mm256_add_epi32(length, length), _mm256_sub_epi32(below_top, twos));
            let small = _mm256_cmpeq_epi32(_mm256_srli_epi32::<1>(v), zero);
            let class = _mm256_blendv_epi8(class, v, small);
            _mm256_storeu_si256(symbols.as_mut_ptr().cast(), _mm256_add_epi32(first, class));
            // Classes from 4 up carry `class / 2 - 1` raw bits: the
            // magnitude's bits below its top two.
            let raw_lengths = _mm256_max_epi32(_mm256_sub_epi32(_mm256_srli_epi32::<1>(class), ones), zero);
            if _mm256_testz_si256(raw_lengths, raw_lengths) != 0 {
                continue;
            }
            let fields = _mm256_and_si256(v, _mm256_sub_epi32(_mm256_sllv_epi32(ones, raw_lengths), ones));
            let mut sums = _mm256_add_epi32(raw_lengths, _mm256_slli_si256::<4>(raw_lengths));
            sums = _mm256_add_epi32(sums, _mm256_slli_si256::<8>(sums));
            sums = _mm256_add_epi32(sums, _mm256_blend_epi32::<0xF0>(zero, _mm256_permutevar8x32_epi32(sums, lane3)));
            let total = _mm256_extract_epi32::<7>(sums) as u32;
            if total <= 56 {
                // Each field shifted to its offset in one 64-bit word.
                let starts = _mm256_sub_epi32(sums, raw_lengths);
                let half = |k: usize| {
                    let take = |x: __m256i| if k == 0 { _mm256_castsi256_si128(x) } else { _mm256_extracti128_si256::<1>(x) };
                    _mm256_sllv_epi64(_mm256_cvtepu32_epi64(take(fields)), _mm256_cvtepu32_epi64(take(starts)))
                };
                let both = _mm256_or_si256(half(0), half(1));
                let pair = _mm_or_si128(_mm256_castsi256_si128(both), _mm256_extracti128_si256::<1>(both));
                let word = (_mm_cvtsi128_si64(pair) | _mm_extract_epi64::<1>(pair)) as u64;
                raw.put(word, total);
            } else {
                let mut lengths = [0u32; 8];
                _mm256_storeu_si256(lengths.as_mut_ptr().cast(), raw_lengths);
                for (&length, &m) in lengths.iter().zip(magnitudes) {
                    if length > 0 {
                        raw.put(m, length);
                    }
                }
            }
        }
    }

    /// Changes per block of `decode_groups` (a whole number of groups).
    const BLOCK: usize = 256;
    const _: () = assert!(BLOCK.is_multiple_of(LANES));

    /// Decode the steps of the changes at `positions` as
    /// `super::avx512::decode_groups` does, eight lanes at a time.
    ///
    /// # Safety
    /// The CPU has AVX2 (`codec::avx2_available`); `W` is 1, 2 or 4; `positions`
    /// is a `kernel_prefix` of a chunk's positions for `old` and `W`.
    #[target_feature(enable = "avx2")]
    pub(in crate::codec) unsafe fn decode_groups<const W: i32>(
        steps: &mut Decoder,
        old: &[u8],
        positions: &[u32],
        signs: &[u8],
        model: StepModel32,
        xor: bool,
        values: &mut [u64],
    ) -> bool {
        super::check_groups(steps, positions, signs, model, values.len());
        assert!(
            positions.last().is_none_or(|&p| p < 1 << 31 && p as usize * W as usize + 4 <= old.len()),
            "every 4-byte load inside the chunk"
        );
        let table_of: Vec<u32> = steps.table_of.iter().map(|&t| u32::from(t)).collect();
        let raw = &steps.raw.bytes[..];
        // Bit offsets in 32-bit lanes, clamped as in `avx512`.
        let raw_end = (8 * raw.len()).min(1 << 30);
        let last_raw_byte = _mm256_set1_epi32((raw.len() - 8) as i32);
        let up = _mm_cvtsi32_si128(32 - 8 * W);
        let below_sign = (i32::MAX >> (32 - 8 * W)) << (32 - 8 * W);
        let flip = _mm256_set1_epi32(if model.float { below_sign } else { 0 });
        let ordinal = |high: __m256i| _mm256_xor_si256(high, _mm256_and_si256(_mm256_srai_epi32::<31>(high), flip));
        let word_mask = _mm256_set1_epi32(if W == 4 { -1 } else { (1 << (8 * W)) - 1 });
        let shift = _mm_cvtsi32_si128(model.shift as i32);
        let context_mask = _mm256_set1_epi32(model.mask as i32);
        let (zero, ones, twos) = (_mm256_setzero_si256(), _mm256_set1_epi32(1), _mm256_set1_epi32(2));
        let low12 = _mm256_set1_epi32((SCALE - 1) as i32);
        let nibbles = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let sign_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        let lane3 = _mm256_set1_epi32(3);
        let mut states = [_mm256_loadu_si256(steps.states.as_ptr().cast()), _mm256_loadu_si256(steps.states.as_ptr().add(8).cast())];
        let (mut pos, mut bit) = (steps.pos, steps.raw.bit);
        let mut unchanged = zero;
        // Per block of changes, first their old words and tables (loads
        // that do not wait on the states, so that many are in flight),
        // then the states' chains.
        let (mut olds, mut tables) = ([0u32; BLOCK], [0u32; BLOCK]);
        for (b, block) in positions.chunks(BLOCK).enumerate() {
            for (k, half) in block.chunks_exact(8).enumerate() {
                let vp = _mm256_loadu_si256(half.as_ptr().cast());
                let vo = _mm256_and_si256(_mm256_i32gather_epi32::<W>(old.as_ptr().cast(), vp), word_mask);
                let context = _mm256_and_si256(_mm256_srl_epi32(vo, shift), context_mask);
                _mm256_storeu_si256(olds.as_mut_ptr().add(8 * k).cast(), vo);
                _mm256_storeu_si256(tables.as_mut_ptr().add(8 * k).cast(), _mm256_i32gather_epi32::<4>(table_of.as_ptr().cast(), context));
            }
            for (k, out) in values[b * BLOCK..][..block.len()].chunks_exact_mut(8).enumerate() {
                let h = b * (BLOCK / 8) + k;
                // The next block's words, asked for while this block's
                // chain runs (the expansion read the chunk long before, so
                // they are no longer near: 0.92-0.98 of the context apply's
                // time at one optimizer step, 0.93-0.99 at several, paired,
                // on a Zen 3).
                crate::codec::prefetch_words(old.as_ptr(), W as usize, positions, (b + 1) * BLOCK + 8 * k, 8);
                let x = states[h % 2];
                let vo = _mm256_loadu_si256(olds.as_ptr().add(8 * k).cast());
                let table = _mm256_loadu_si256(tables.as_ptr().add(8 * k).cast());
                let slot = _mm256_and_si256(x, low12);
                let class_at = _mm256_or_si256(_mm256_slli_epi32::<{ SCALE_BITS as i32 }>(table), slot);
                let class = _mm256_and_si256(_mm256_i32gather_epi32::<1>(steps.slot_class.as_ptr().cast(), class_at), _mm256_set1_epi32(0xFF));
                let entry_at = _mm256_or_si256(_mm256_slli_epi32::<{ CLASS_BITS as i32 }>(table), class);
                let entry = _mm256_i32gather_epi32::<4>(steps.class_entry.as_ptr().cast(), entry_at);
                let frequency = _mm256_add_epi32(_mm256_and_si256(entry, low12), ones);
                let x = _mm256_add_epi32(_mm256_mullo_epi32(frequency, _mm256_srli_epi32::<{ SCALE_BITS as i32 }>(x)), _mm256_sub_epi32(slot, _mm256_srli_epi32::<12>(entry)));
                // Renormalise: the states that fell low take the next words,
                // in lane order.
                let low = _mm256_cmpeq_epi32(_mm256_srli_epi32::<16>(x), zero);
                let low_mask = _mm256_movemask_ps(_mm256_castsi256_ps(low)) as usize;
                let at = pos.min(steps.words_len);
                // Safety: `words` holds `words_len` bytes and 32 of padding.
                let next = _mm256_cvtepu16_epi32(_mm_loadu_si128(steps.words.as_ptr().add(at).cast()));
                let source = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(EXPAND[low_mask] as i32), nibbles), _mm256_set1_epi32(7));
                let shifted_in = _mm256_or_si256(_mm256_slli_epi32::<16>(x), _mm256_permutevar8x32_epi32(next, source));
                states[h % 2] = _mm256_blendv_epi8(x, shifted_in, low);
                pos += 2 * low_mask.count_ones() as usize;
                // The raw bits below the classes that have them.
                let raw_lengths = _mm256_max_epi32(_mm256_sub_epi32(_mm256_srli_epi32::<1>(class), ones), zero);
                let mut below = zero;
                if _mm256_testz_si256(raw_lengths, raw_lengths) == 0 {
                    let mut sums = _mm256_add_epi32(raw_lengths, _mm256_slli_si256::<4>(raw_lengths));
                    sums = _mm256_add_epi32(sums, _mm256_slli_si256::<8>(sums));
                    sums = _mm256_add_epi32(sums, _mm256_blend_epi32::<0xF0>(zero, _mm256_permutevar8x32_epi32(sums, lane3)));
                    let total = _mm256_extract_epi32::<7>(sums);
                    let base = bit.min(raw_end);
                    let starts = _mm256_sub_epi32(sums, raw_lengths);
                    // Each lane's bits from one 64-bit word per lane: where
                    // the group's raw bits fit in 56 (nearly always), all
                    // from the one load at `base`; else gathered, each
                    // lane's from its own byte.
                    let (words, bit_shift): ([__m256i; 2], __m256i) = if total <= 56 {
                        let at = (base / 8).min(raw.len() - 8);
                        // Safety: `raw` holds eight bytes from `at`.
                        let window = u64::from_le_bytes(unsafe { raw.get_unchecked(at..at + 8) }.try_into().expect("8 bytes")) >> (base % 8);
                        let window = _mm256_set1_epi64x(window as i64);
                        ([window; 2], starts)
                    } else {
                        let at = _mm256_add_epi32(_mm256_set1_epi32(base as i32), starts);
                        let bytes = _mm256_min_epu32(_mm256_srli_epi32::<3>(at), last_raw_byte);
                        let gather = |v: __m128i| _mm256_i32gather_epi64::<1>(raw.as_ptr().cast(), v);
                        ([gather(_mm256_castsi256_si128(bytes)), gather(_mm256_extracti128_si256::<1>(bytes))], _mm256_and_si256(at, _mm256_set1_epi32(7)))
                    };
                    let take = |k: usize| {
                        let pick = |v: __m256i| if k == 0 { _mm256_castsi256_si128(v) } else { _mm256_extracti128_si256::<1>(v) };
                        let one = _mm256_set1_epi64x(1);
                        let mask = _mm256_sub_epi64(_mm256_sllv_epi64(one, _mm256_cvtepu32_epi64(pick(raw_lengths))), one);
                        let bits = _mm256_and_si256(_mm256_srlv_epi64(words[k], _mm256_cvtepu32_epi64(pick(bit_shift))), mask);
                        // The low halves of the four 64-bit lanes.
                        _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(bits, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)))
                    };
                    below = _mm256_set_m128i(take(1), take(0));
                    bit += total as usize;
                }
                // The magnitude: the class itself below 2, else its top two
                // bits shifted over the raw ones (`super::magnitude`).
                let top = _mm256_sllv_epi32(_mm256_or_si256(twos, _mm256_and_si256(class, ones)), _mm256_sub_epi32(_mm256_srli_epi32::<1>(class), ones));
                let magnitude = _mm256_blendv_epi8(_mm256_or_si256(top, below), class, _mm256_cmpgt_epi32(twos, class));
                let negative = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(i32::from(signs[h])), sign_bits), sign_bits);
                let size = _mm256_add_epi32(magnitude, ones);
                let step = _mm256_sub_epi32(_mm256_xor_si256(size, negative), negative);
                let moved = ordinal(_mm256_add_epi32(ordinal(_mm256_sll_epi32(vo, up)), _mm256_sll_epi32(step, up)));
                let new = _mm256_srl_epi32(moved, up);
                unchanged = _mm256_or_si256(unchanged, _mm256_cmpeq_epi32(new, vo));
                let value = if xor { _mm256_xor_si256(vo, new) } else { new };
                _mm256_storeu_si256(out.as_mut_ptr().cast(), _mm256_cvtepu32_epi64(_mm256_castsi256_si128(value)));
                _mm256_storeu_si256(out.as_mut_ptr().add(4).cast(), _mm256_cvtepu32_epi64(_mm256_extracti128_si256::<1>(value)));
            }
        }
        _mm256_storeu_si256(steps.states.as_mut_ptr().cast(), states[0]);
        _mm256_storeu_si256(steps.states.as_mut_ptr().add(8).cast(), states[1]);
        steps.pos = pos;
        steps.raw.bit = bit;
        _mm256_testz_si256(unchanged, unchanged) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::tests::xorshift;

    #[test]
    fn classes_and_raw_bits_rebuild_every_magnitude() {
        let mut next = xorshift(7);
        let mut values: Vec<u64> = (0..300).collect();
        values.extend((1..64).flat_map(|b| [(1u64 << b) - 1, 1u64 << b, (1u64 << b) + 1]));
        values.extend((0..2000).map(|_| next() >> (next() % 64)));
        values.push(u64::MAX);
        for v in values {
            let (class, bits) = class_of(v);
            assert!(class < classes(8), "{v}: class {class}");
            assert_eq!(raw_bits(class), bits, "{v}");
            let raw = if bits == 0 { 0 } else { v & ((1u64 << bits) - 1) };
            assert_eq!(magnitude(class, raw), v);
        }
        // A word of w bytes never needs a class at or above 16 w.
        for w in [1usize, 2, 4] {
            assert_eq!(class_of((1u64 << (8 * w)) - 1).0, classes(w) - 1);
        }
    }

    #[test]
    fn counts_read_back_rounded_and_frequencies_sum_to_the_scale() {
        let mut next = xorshift(3);
        let mut w = BitWriter::new();
        let ks: Vec<u64> = (0..40).chain((0..200).map(|_| next() >> (31 + next() % 33))).collect();
        for &k in &ks {
            put_count(&mut w, k);
        }
        let bytes = w.finish();
        let mut r = BitReader::new(&bytes);
        for &k in &ks {
            let got = get_count(&mut r).unwrap();
            assert_eq!(got, rounded_count(k), "{k}");
            assert!(got.abs_diff(k) * 16 <= k, "{k} rounded to {got}");
        }
        for trial in 0..500 {
            let n = 1 + (next() % 128) as usize;
            let counts: Vec<u64> = (0..n).map(|i| if next().is_multiple_of(3) || (trial % 7 == 0 && i > 0) { 0 } else { next() >> (next() % 64) }).collect();
            let mut freqs = vec![0u32; n];
            let any = frequencies(&counts, &mut freqs);
            assert_eq!(any, counts.iter().any(|&k| k > 0));
            if any {
                assert_eq!(freqs.iter().sum::<u32>(), SCALE);
                for (&k, &f) in counts.iter().zip(&freqs) {
                    assert_eq!(k > 0, f > 0, "{counts:?} -> {freqs:?}");
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn classify_kernels_match_the_scalar_classes() {
        type Kernel = unsafe fn(&[u16], &[u64], &[u32], &mut [u32], &mut BitWriter);
        let mut kernels: Vec<(&str, Kernel)> = Vec::new();
        if avx512::classify_available() {
            kernels.push(("avx512", avx512::classify));
        }
        if crate::codec::avx2_available() {
            kernels.push(("avx2", avx2::classify));
        }
        let mut next = xorshift(5);
        let edges = [0u64, 1, 2, 3, 4, 5, 7, 8, 0xFFFF, 0x1_0000, 0x1_FFFF, (1 << 24) - 1, 1 << 24, (1 << 31) - 1, 1 << 31, u64::from(u32::MAX)];
        let n = 16 * 200;
        // Runs of small magnitudes too, whose groups' raw bits fit one
        // write, between groups of large ones, which do not.
        let magnitudes: Vec<u64> = (0..n)
            .map(|i| match i / 64 % 3 {
                0 if i % 3 == 0 => edges[i / 3 % edges.len()],
                0 => (next() & 0xFFFF_FFFF) >> (next() % 32),
                1 => next() % 12,
                _ => next() % 300,
            })
            .collect();
        let contexts: Vec<u16> = (0..n).map(|_| (next() % 5) as u16).collect();
        let first_symbol = [0u32, 64, 128, 192, 256];
        let mut expected_raw = BitWriter::new();
        for &v in &magnitudes {
            let (_, bits) = class_of(v);
            if bits > 0 {
                put_wide(&mut expected_raw, v, bits);
            }
        }
        let expected_raw = expected_raw.finish();
        for (name, kernel) in kernels {
            let mut symbols = vec![0u32; n];
            let mut raw = BitWriter::new();
            // Safety: the CPU has what the kernel needs (checked above);
            // the magnitudes are below 2^32.
            #[allow(unsafe_code)]
            unsafe {
                kernel(&contexts, &magnitudes, &first_symbol, &mut symbols, &mut raw)
            };
            for j in 0..n {
                let (class, _) = class_of(magnitudes[j]);
                assert_eq!(symbols[j], first_symbol[usize::from(contexts[j])] + class as u32, "{name}: magnitude {}", magnitudes[j]);
            }
            assert_eq!(raw.finish(), expected_raw, "{name}");
        }
    }

    #[test]
    fn vector_rans_encoder_matches_the_scalar_one() {
        // Tables of every shape a chunk meets: one class of the whole scale
        // (never sheds), classes of frequency 1, skewed and flat ones; and
        // symbol counts that leave a partial last group or none.
        let mut next = xorshift(23);
        for trial in 0..60 {
            let nclass = 32;
            let ntables = 1 + trial % 4;
            let mut freqs = vec![0u32; ntables * nclass];
            let mut starts = vec![0u32; ntables * nclass];
            for t in 0..ntables {
                let counts: Vec<u64> = (0..nclass)
                    .map(|c| match (trial + t) % 4 {
                        0 => u64::from(c == 3),
                        1 => if c < 3 { 1 } else if c == 5 { 1 << 30 } else { 0 },
                        2 => next() % 1000 * u64::from(next().is_multiple_of(2)),
                        _ => 1 + next() % 5,
                    })
                    .collect();
                if !frequencies(&counts, &mut freqs[t * nclass..(t + 1) * nclass]) {
                    freqs[t * nclass] = SCALE;
                }
                let mut start = 0;
                for c in 0..nclass {
                    starts[t * nclass + c] = start;
                    start += freqs[t * nclass + c];
                }
            }
            let coders = RansCoders {
                scalar: freqs.iter().zip(&starts).map(|(&f, &s)| SymbolCoder::new(f, s)).collect(),
                frequency_and_start: freqs.iter().zip(&starts).map(|(&f, &s)| f | s << 16).collect(),
            };
            let usable: Vec<u32> = (0..freqs.len() as u32).filter(|&s| freqs[s as usize] > 0).collect();
            let m = [0, 15, 16, 17, 160, 1000 + trial * 37][trial % 6];
            let symbols: Vec<u32> = (0..m).map(|_| usable[next() as usize % usable.len()]).collect();
            let scalar = coders.encode(&symbols, false);
            assert_eq!(coders.encode(&symbols, true), scalar, "trial {trial}: {m} symbols");
        }
    }

    #[test]
    fn reciprocal_coding_is_the_division() {
        // Every frequency, with the states a coder meets: from 2^16 up to
        // just below the shedding bound, edges and random ones between.
        let mut next = xorshift(11);
        for f in 1..=SCALE {
            let start = (next() % u64::from(SCALE - f + 1)) as u32;
            let coder = SymbolCoder::new(f, start);
            let top = (u64::from(f) << (32 - SCALE_BITS)) - 1;
            let mut states: Vec<u64> = vec![u64::from(STATE_LOW), u64::from(STATE_LOW) + 1, top, top - 1, top - u64::from(f)];
            states.extend((0..64).map(|_| u64::from(STATE_LOW) + next() % (top - u64::from(STATE_LOW))));
            for x in states {
                let mut coded = x as u32;
                let (mut words, mut shed) = ([0u16; 1], 0);
                coder.put(&mut coded, &mut words, &mut shed);
                assert_eq!(shed, 0, "f {f}, x {x}: no shedding below the bound");
                let x = x as u32;
                assert_eq!(coded, ((x / f) << SCALE_BITS) + x % f + start, "f {f}, x {x}");
            }
            // At the bound it sheds 16 bits first.
            let before = (top + 1).min(u64::from(u32::MAX)) as u32;
            let mut coded = before;
            let (mut words, mut shed) = ([0u16; 1], 0);
            coder.put(&mut coded, &mut words, &mut shed);
            let sheds = top < u64::from(u32::MAX);
            assert_eq!(shed, usize::from(sheds), "f {f}");
            if sheds {
                // The low 16 bits went out, the rest was coded.
                let (kept, x) = (words[0], before >> 16);
                assert_eq!((kept, coded), (before as u16, ((x / f) << SCALE_BITS) + x % f + start), "f {f}");
            }
        }
    }

    /// How many of `contexts` are each context, as the encoder is given.
    fn per_context(contexts: &[u16], nctx: usize) -> Vec<u64> {
        let mut counts = vec![0u64; nctx];
        for &c in contexts {
            counts[usize::from(c)] += 1;
        }
        counts
    }

    /// Code `magnitudes` in `contexts` and decode them back.
    fn round_trip(contexts: &[u16], magnitudes: &[u64], nctx: usize, width: usize) -> Vec<u8> {
        let mut out = Vec::new();
        encode(contexts, magnitudes, &per_context(contexts, nctx), width, &mut out);
        let mut pos = 0;
        let s = sections(&out, &mut pos, "t").unwrap();
        assert_eq!(pos, out.len());
        let mut d = Decoder::new(&s, nctx, width, "t").unwrap();
        for (j, (&c, &v)) in contexts.iter().zip(magnitudes).enumerate() {
            assert_eq!(d.decode(j % LANES, usize::from(c)), v, "change {j}");
        }
        d.finish("t").unwrap();
        out
    }

    fn random_steps(next: &mut impl FnMut() -> u64, m: usize, nctx: usize, width: usize) -> (Vec<u16>, Vec<u64>) {
        let busy = 1 + next() as usize % nctx;
        let contexts: Vec<u16> = (0..m).map(|_| (if next().is_multiple_of(4) { next() as usize % nctx } else { next() as usize % busy }) as u16).collect();
        let top = 8 * width as u32;
        let magnitudes = contexts
            .iter()
            .map(|&c| match next() % 8 {
                0..=3 => 0,
                4 | 5 => 1,
                6 => next() % (u64::from(c) % 50 + 2),
                _ => (next() >> (64 - top)).max(2) >> (next() % u64::from(top)),
            })
            .collect();
        (contexts, magnitudes)
    }

    #[test]
    fn random_chunks_round_trip_for_every_width() {
        let mut next = xorshift(11);
        for trial in 0..60 {
            let width = [1usize, 2, 4, 8][trial % 4];
            let nctx = [1usize, 3, 16, 256, 2048][trial % 5];
            let m = [0usize, 1, 3, 4, 5, 100, 5000, 20_000][trial % 8];
            let (contexts, magnitudes) = random_steps(&mut next, m, nctx, width);
            round_trip(&contexts, &magnitudes, nctx, width);
        }
    }

    #[test]
    fn one_class_tables_cost_nothing_per_step() {
        // Every change one ulp: each table has a single class of frequency
        // 4096, and the rANS stream is only its states (4 bytes each).
        let contexts: Vec<u16> = (0..10_000).map(|j| (j % 3) as u16).collect();
        let out = round_trip(&contexts, &vec![0; 10_000], 4, 2);
        assert!(out.len() < 4 * LANES + 10, "{} bytes", out.len());
    }

    /// How many contexts have a table of their own in an encoded payload.
    fn own_tables(out: &[u8]) -> u64 {
        let mut pos = 0;
        let s = sections(out, &mut pos, "t").unwrap();
        get_gamma(&mut BitReader::new(s.tables), 7).unwrap() - 1
    }

    #[test]
    fn contexts_keep_a_table_of_their_own_only_where_it_pays() {
        let mut next = xorshift(17);
        // Eight busy contexts drawing from one distribution: a table of
        // their own saves nothing; the shared one codes them all.
        let contexts: Vec<u16> = (0..40_000).map(|j| (j % 8) as u16).collect();
        let alike: Vec<u64> = contexts.iter().map(|_| [0, 0, 0, 1, 1, 2, 3, 5][next() as usize % 8]).collect();
        assert_eq!(own_tables(&round_trip(&contexts, &alike, 8, 2)), 0);
        // Each context its own class (and so frequencies far from the
        // mixture): all but the one weighed first, which would have had
        // nothing to share with, keep theirs.
        let distinct: Vec<u64> = contexts.iter().map(|&c| magnitude(usize::from(c) + 1, 0)).collect();
        assert_eq!(own_tables(&round_trip(&contexts, &distinct, 8, 2)), 7);
        // More such contexts than tables: the busiest `MAX_OWN_TABLES`
        // keep theirs, the rest share one (the most tables a payload may
        // have, decoded).
        let contexts: Vec<u16> = (0..70 * 300).map(|j| (j % 70) as u16).chain((0..64 * 100).map(|j| (j % 64) as u16)).collect();
        let distinct: Vec<u64> = contexts.iter().map(|&c| magnitude(usize::from(c) % 32, next() & 1)).collect();
        assert_eq!(own_tables(&round_trip(&contexts, &distinct, 70, 2)), MAX_OWN_TABLES as u64);
    }

    #[test]
    fn more_busy_contexts_than_tables_share_the_rest() {
        let mut next = xorshift(5);
        let contexts: Vec<u16> = (0..40_000).map(|j| (j % 200) as u16).collect();
        let magnitudes: Vec<u64> = contexts.iter().map(|&c| next() % (u64::from(c) + 2)).collect();
        round_trip(&contexts, &magnitudes, 256, 2);
    }

    #[test]
    fn damaged_sections_are_refused_without_panics() {
        let mut next = xorshift(9);
        let (contexts, magnitudes) = random_steps(&mut next, 3000, 16, 2);
        let mut out = Vec::new();
        encode(&contexts, &magnitudes, &per_context(&contexts, 16), 2, &mut out);
        let mut refused = 0;
        for trial in 0..400 {
            let mut bad = out.clone();
            if trial % 2 == 0 {
                let i = next() as usize % bad.len();
                bad[i] ^= 1 << (next() % 8);
            } else {
                bad.truncate(next() as usize % bad.len());
            }
            let decoded = (|| -> Result<Vec<u64>> {
                let mut pos = 0;
                let s = sections(&bad, &mut pos, "t")?;
                let mut d = Decoder::new(&s, 16, 2, "t")?;
                let got: Vec<u64> = contexts.iter().enumerate().map(|(j, &c)| d.decode(j % LANES, usize::from(c))).collect();
                d.finish("t")?;
                Ok(got)
            })();
            // Raw bits carry no redundancy (the chunk's checksum and the
            // target digests catch those flips); what matters here is that
            // nothing panics and that most damage is seen.
            refused += usize::from(decoded.is_err());
        }
        assert!(refused > 200, "only {refused} of 400 damaged sections refused");
    }

    /// Sections re-framed with one part wrong are each refused by what is
    /// wrong: too many tables of their own, a rANS stream shorter than its
    /// states or of odd length, raw bits left over or missing, rANS words
    /// left unread.
    #[test]
    fn sections_with_a_part_wrong_are_refused_by_name() {
        let mut next = xorshift(21);
        let (nctx, width) = (16, 2);
        let (contexts, magnitudes) = random_steps(&mut next, 3000, nctx, width);
        let out = round_trip(&contexts, &magnitudes, nctx, width);
        let mut pos = 0;
        let good = sections(&out, &mut pos, "t").unwrap();
        assert!(!good.raw.is_empty(), "some steps have raw bits");
        let framed = |tables: &[u8], raw: &[u8], rans: &[u8]| {
            let mut b = Vec::new();
            for part in [tables, raw, rans] {
                put_varint(&mut b, part.len() as u64);
                b.extend_from_slice(part);
            }
            b
        };
        let decoded = |bytes: &[u8]| -> Result<()> {
            let mut pos = 0;
            let s = sections(bytes, &mut pos, "t")?;
            let mut d = Decoder::new(&s, nctx, width, "t")?;
            for (j, &c) in contexts.iter().enumerate() {
                d.decode(j % LANES, usize::from(c));
            }
            d.finish("t")
        };
        decoded(&framed(good.tables, good.raw, good.rans)).unwrap();
        let too_many = {
            let mut w = BitWriter::new();
            put_gamma(&mut w, nctx as u64 + 2);
            w.finish()
        };
        let longer_raw = [good.raw, &[0xff]].concat();
        let longer_rans = [good.rans, &[0, 0]].concat();
        let unread = format!("{} rANS bytes read of {}", good.rans.len() - 4 * LANES, longer_rans.len() - 4 * LANES);
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("tables for more contexts than there are", framed(&too_many, good.raw, good.rans), "17 contexts with tables of their own (at most 16)"),
            ("states cut", framed(good.tables, good.raw, &good.rans[..4 * LANES - 2]), "rANS stream shorter than its states or of odd length"),
            ("an odd rANS stream", framed(good.tables, good.raw, &good.rans[..good.rans.len() - 1]), "rANS stream shorter than its states or of odd length"),
            ("a raw byte left over", framed(good.tables, &longer_raw, good.rans), "raw bits missing or left over"),
            ("raw bits missing", framed(good.tables, &good.raw[..good.raw.len() - 1], good.rans), "raw bits missing or left over"),
            ("rANS words left unread", framed(good.tables, good.raw, &longer_rans), &unread),
        ];
        for (what, bytes, expected) in cases {
            let err = decoded(&bytes).err().unwrap_or_else(|| panic!("{what}: decoded"));
            assert!(err.to_string().contains(expected), "{what}: {err}");
        }
    }
}
