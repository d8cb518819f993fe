//! Valid inputs for the `decode_chunk` fuzz target (`fuzz/fuzz_targets/`)
//! to start from: one chunk per word width, dtype family, mode, change kind
//! and change density, each written as the target's header (`chunk_input.rs`, shared),
//! the chunk's base words and its payload, so that the fuzzer mutates
//! payloads every decoder accepts (and the base the context decoder reads).
//!
//! Run: `cargo run --release -p dcr-core --example fuzz_seeds -- fuzz/corpus/decode_chunk`

use dcr_core::codec::context::ContextModel;
use dcr_core::codec::{self, ChangeKind, EncodeOptions, Mode};
use std::path::PathBuf;

#[path = "../../../fuzz/fuzz_targets/chunk_input.rs"]
mod chunk_input;
use chunk_input::{xorshift, Header};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(std::env::args().nth(1).ok_or("usage: fuzz_seeds CORPUS_DIR")?);
    std::fs::create_dir_all(&dir)?;
    let mut next = xorshift(0x2545_F491_4F6C_DD1D);
    let mut written = 0;
    for width_code in 0..4u8 {
        for integer in [false, true] {
            let shape = Header {
                width_code,
                integer,
                context_mode: false,
                kind: ChangeKind::Xor,
                encode_first: false,
                n: 1,
                seed: 0,
                first_block: 0,
                density: 0,
                n_changed: 0,
                encoding: codec::Encoding::Raw,
            };
            let (width, dtype) = (shape.width(), shape.dtype());
            let model = ContextModel::for_dtype(dtype);
            // 20,000 words: 4096 changes and more at the higher densities,
            // where the context mode codes its steps with tables.
            for n in [40usize, 700, 4096, 20_000] {
                // Weights near 0.02 in the top byte, anything below it.
                let base: Vec<u8> = (0..n)
                    .flat_map(|_| {
                        let mut w = next().to_le_bytes();
                        w[width - 1] = 0x3C ^ (w[width - 1] & 0x83);
                        w.into_iter().take(width)
                    })
                    .collect();
                for per_256 in [2u64, 20, 90, 250] {
                    let mut new = base.clone();
                    for word in new.chunks_exact_mut(width) {
                        if next() % 256 < per_256 {
                            word[0] = word[0].wrapping_add(1 + (next() % 3) as u8);
                        }
                    }
                    for context in [false, true] {
                        for kind in [ChangeKind::Xor, ChangeKind::Overwrite] {
                            let opts = EncodeOptions { kind, zstd_level: 1 };
                            let Some(chunk) = codec::encode_chunk_with_context(&base, &new, width, opts, context.then_some(&model))? else {
                                continue;
                            };
                            let header = Header {
                                context_mode: chunk.mode == Mode::Context,
                                kind,
                                n,
                                n_changed: u16::try_from(chunk.n_changed)?,
                                encoding: chunk.encoding,
                                ..shape
                            };
                            let bytes = header.write();
                            assert_eq!(Header::read(&bytes), header, "the fuzz target reads back what is written");
                            let mut input = bytes.to_vec();
                            input.extend_from_slice(&base);
                            input.extend_from_slice(&chunk.payload);
                            let file = format!("seed-{}-{n}-{per_256}-{}-{}", dtype.name(), chunk.mode.name(), kind.name());
                            std::fs::write(dir.join(file), input)?;
                            written += 1;
                        }
                    }
                }
            }
        }
    }
    println!("{written} seeds in {}", dir.display());
    Ok(())
}
