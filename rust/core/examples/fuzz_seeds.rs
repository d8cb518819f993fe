//! Valid inputs for the `decode_chunk` fuzz target (`fuzz/fuzz_targets/`)
//! to start from: one chunk per word width, dtype family, mode, change kind
//! and change density, each written as the target's eleven header bytes,
//! the chunk's base words and its payload, so that the fuzzer mutates
//! payloads every decoder accepts (and the base the context decoder reads).
//!
//! Run: `cargo run --release -p dcr-core --example fuzz_seeds -- fuzz/corpus/decode_chunk`

use dcr_core::codec::context::ContextModel;
use dcr_core::codec::{self, ChangeKind, EncodeOptions, Mode};
use dcr_core::dtype::DType;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(std::env::args().nth(1).ok_or("usage: fuzz_seeds CORPUS_DIR")?);
    std::fs::create_dir_all(&dir)?;
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut written = 0;
    for (width_code, names) in [["F8_E4M3", "U8"], ["BF16", "I16"], ["F32", "I32"], ["F64", "I64"]].iter().enumerate() {
        let width = 1usize << width_code;
        for (int_code, name) in names.iter().enumerate() {
            let model = ContextModel::for_dtype(DType::from_name(name)?);
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
                            let is_context = chunk.mode == Mode::Context;
                            let flags = width_code as u8 | (int_code as u8) << 2 | u8::from(is_context) << 3 | u8::from(kind == ChangeKind::Overwrite) << 4;
                            let mut input = vec![flags];
                            input.extend_from_slice(&(n as u16 - 1).to_le_bytes());
                            input.extend_from_slice(&[0; 5]); // seed (unused here) and the chunk's start
                            input.extend_from_slice(&u16::try_from(chunk.n_changed)?.to_le_bytes());
                            input.push(chunk.encoding as u8);
                            input.extend_from_slice(&base);
                            input.extend_from_slice(&chunk.payload);
                            let file = format!("seed-{name}-{n}-{per_256}-{}-{}", chunk.mode.name(), kind.name());
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
