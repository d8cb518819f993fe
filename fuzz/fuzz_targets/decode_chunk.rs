//! Chunk payloads straight into the decoders, past the frame checksum that
//! keeps damaged bytes away from them in a delta: what a buggy or hostile
//! peer that computes a valid crc32c could send. The SIMD decoders and the
//! apply kernels read and write through raw pointers, so under the address
//! sanitizer this is the check that no payload makes them leave their
//! buffers.
//!
//! Each input is a header of twelve bytes (`chunk_input.rs`) and a body. The header picks the
//! word width, the dtype (so the context model), the mode, the change kind,
//! the chunk's length and where it starts in its tensor. Then either
//!
//! - the body is the chunk's base words and then the payload (with the
//!   encoding and change count from the header): `examples/fuzz_seeds.rs`
//!   of `dcr-core` writes valid ones to start from, or
//! - a base and a new version are made from a seed in the header, encoded,
//!   and the payload damaged by the body: (offset, XOR byte) triples and a
//!   cut.
//!
//! What must hold: no panic, no out-of-bounds access; an undamaged payload
//! gives exactly the new words; the fast context decoder and its portable
//! reference accept the same payloads and return the same changes; and a
//! chunk that decodes applies with a digest move equal to the difference of
//! the full digests of the target before and after.
//!
//! Run (from the repository root):
//!
//! ```text
//! cargo run --release -p dcr-core --example fuzz_seeds -- fuzz/corpus/decode_chunk
//! cargo +nightly fuzz run -O -a decode_chunk -- -len_control=0 -max_len=400000
//! ```
#![no_main]

use dcr_core::codec::context::{self, ContextModel};
use dcr_core::codec::{self, EncodeOptions, Mode};
use dcr_core::digest::partial_digest;
use libfuzzer_sys::fuzz_target;

mod chunk_input;
use chunk_input::{xorshift, Header};

/// Base words like a model's weights: most share a few exponents (the top
/// byte near that of 0.02), some are anything (NaN payloads, infinities,
/// subnormals, zeros of both signs).
fn base_words(n: usize, width: usize, seed: u64) -> Vec<u8> {
    let mut next = xorshift(seed);
    let mut out = Vec::with_capacity(n * width);
    for _ in 0..n {
        let r = next();
        let mut word = next().to_le_bytes();
        match r % 8 {
            0 => {}
            1 => word = [0; 8],
            _ => word[width - 1] = 0x3C ^ (r >> 8) as u8 & 0x83,
        }
        out.extend_from_slice(&word[..width]);
    }
    out
}

/// `base` with changes at about `density / 256` of its words: small steps
/// of the integer word (an optimizer's ulps), now and then any bits.
fn new_words(base: &[u8], width: usize, density: u8, seed: u64) -> Vec<u8> {
    let mut next = xorshift(seed ^ 0x9E37_79B9_7F4A_7C15);
    let mut new = base.to_vec();
    for word in new.chunks_exact_mut(width) {
        let r = next();
        if (r & 0xFF) as u8 >= density {
            continue;
        }
        let mut bytes = [0u8; 8];
        bytes[..width].copy_from_slice(word);
        let v = u64::from_le_bytes(bytes);
        let v = match (r >> 8) % 4 {
            0 => v ^ (r >> 16),
            1 => v.wrapping_sub((r >> 16) % 5 + 1),
            _ => v.wrapping_add((r >> 16) % 5 + 1),
        };
        word.copy_from_slice(&v.to_le_bytes()[..width]);
    }
    new
}

fuzz_target!(|data: &[u8]| {
    let Some((head, body)) = data.split_first_chunk::<{ Header::LEN }>() else { return };
    let h = Header::read(head);
    let (n, width, kind) = (h.n, h.width(), h.kind);
    let model = ContextModel::for_dtype(h.dtype());
    let (base, payload, n_changed, encoding, expected) = if h.encode_first {
        let base = base_words(n, width, u64::from(h.seed));
        let new = new_words(&base, width, h.density, u64::from(h.seed));
        let opts = EncodeOptions { kind, zstd_level: 1 };
        let Some(chunk) = codec::encode_chunk_with_context(&base, &new, width, opts, h.context_mode.then_some(&model)).expect("encodes")
        else {
            assert_eq!(base, new, "no chunk only when nothing changed");
            return;
        };
        assert!(h.context_mode || chunk.mode == Mode::Free, "a context chunk without a model");
        let mut payload = chunk.payload;
        let mut damaged = false;
        let mut triples = body.chunks_exact(3);
        for t in &mut triples {
            if t[2] != 0 && !payload.is_empty() {
                let at = usize::from(u16::from_le_bytes([t[0], t[1]])) % payload.len();
                payload[at] ^= t[2];
                damaged = true;
            }
        }
        if let [cut, ..] = triples.remainder() {
            let keep = payload.len() * usize::from(*cut) / 256;
            damaged |= keep < payload.len();
            payload.truncate(keep);
        }
        let encoding = (chunk.mode == Mode::Free).then_some(chunk.encoding);
        (base, payload, chunk.n_changed, encoding, (!damaged).then_some(new))
    } else {
        let Some((base, payload)) = body.split_at_checked(n * width) else { return };
        (base.to_vec(), payload.to_vec(), u32::from(h.n_changed), (!h.context_mode).then_some(h.encoding), None)
    };

    let decoded = match encoding {
        Some(encoding) => codec::decode_chunk(&payload, n, width, encoding, n_changed, "fuzz"),
        None => {
            let fast = context::decode(&payload, &base, &model, n_changed, kind, "fuzz");
            let reference = context::decode_reference(&payload, &base, &model, n_changed, kind, "fuzz");
            assert_eq!(fast.as_ref().ok(), reference.as_ref().ok(), "the fast context decoder and its reference disagree");
            codec::decode_chunk_context(&payload, &base, width, &model, n_changed, kind, "fuzz")
        }
    };
    let Ok(decoded) = decoded else {
        assert!(expected.is_none(), "an undamaged payload was refused");
        return;
    };
    let mut target = base.clone();
    let moved = decoded.apply_tracked(&mut target, kind, h.first());
    let before = partial_digest(&base, width, h.first());
    let after = partial_digest(&target, width, h.first());
    assert_eq!(before.plus(moved), after, "the apply's digest move differs from the full digests' difference");
    if let Some(new) = expected {
        assert_eq!(target, new, "an undamaged payload did not give the new words");
    }
});
