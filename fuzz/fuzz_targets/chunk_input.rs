//! The input of the `decode_chunk` fuzz target: a header, then a body (see
//! `decode_chunk.rs`). Shared, as one file, by the target and by the seed
//! writer `rust/core/examples/fuzz_seeds.rs`, which writes what the target
//! reads; each uses part of it.
#![allow(dead_code)]

use dcr_core::codec::{ChangeKind, Encoding, ENCODINGS};
use dcr_core::dtype::DType;

/// The dtypes of each word width, the float first (the context model keys
/// on its exponent; integers have one context).
pub const DTYPES: [[&str; 2]; 4] = [["F8_E4M3", "U8"], ["BF16", "I16"], ["F32", "I32"], ["F64", "I64"]];

/// A xorshift64 generator from `seed` (any value: a zero seed is made odd).
pub fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed | 1;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The word width is `1 << width_code` bytes (0..=3).
    pub width_code: u8,
    /// The integer dtype of the width rather than the float.
    pub integer: bool,
    /// Context-mode payload (else free).
    pub context_mode: bool,
    pub kind: ChangeKind,
    /// Encode a seeded base and new version, then damage the payload by
    /// the body (else the body is the base words and the payload).
    pub encode_first: bool,
    /// Words in the chunk, 1..=65,536: chunks of 4096 changes and more
    /// code their context steps with tables (the vector kernels).
    pub n: usize,
    /// The seed of an encoded chunk's base and new words.
    pub seed: u32,
    /// The chunk's first element in its tensor, over 256.
    pub first_block: u8,
    /// About how many words in 256 an encoded chunk changes.
    pub density: u8,
    /// A given payload's change count and encoding (free mode).
    pub n_changed: u16,
    pub encoding: Encoding,
}

impl Header {
    pub const LEN: usize = 12;

    pub fn read(h: &[u8; Self::LEN]) -> Header {
        Header {
            width_code: h[0] & 3,
            integer: h[0] & 4 != 0,
            context_mode: h[0] & 8 != 0,
            kind: if h[0] & 16 != 0 { ChangeKind::Overwrite } else { ChangeKind::Xor },
            encode_first: h[0] & 32 != 0,
            n: usize::from(u16::from_le_bytes([h[1], h[2]])) + 1,
            seed: u32::from_le_bytes([h[3], h[4], h[5], h[6]]),
            first_block: h[7],
            density: h[8],
            n_changed: u16::from_le_bytes([h[9], h[10]]),
            encoding: ENCODINGS[usize::from(h[11]) % ENCODINGS.len()],
        }
    }

    /// The bytes `read` takes back to `self`; `n` is 1..=65,536.
    pub fn write(&self) -> [u8; Self::LEN] {
        let flags = self.width_code
            | u8::from(self.integer) << 2
            | u8::from(self.context_mode) << 3
            | u8::from(self.kind == ChangeKind::Overwrite) << 4
            | u8::from(self.encode_first) << 5;
        let n = u16::try_from(self.n - 1).expect("1..=65,536 words").to_le_bytes();
        let seed = self.seed.to_le_bytes();
        let n_changed = self.n_changed.to_le_bytes();
        [flags, n[0], n[1], seed[0], seed[1], seed[2], seed[3], self.first_block, self.density, n_changed[0], n_changed[1], self.encoding as u8]
    }

    pub fn width(&self) -> usize {
        1 << self.width_code
    }

    pub fn dtype(&self) -> DType {
        DType::from_name(DTYPES[usize::from(self.width_code)][usize::from(self.integer)]).expect("a dtype")
    }

    pub fn first(&self) -> u64 {
        u64::from(self.first_block) << 8
    }
}
