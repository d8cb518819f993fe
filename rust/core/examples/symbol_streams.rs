//! Time the free mode's symbol streams against zstd on real low byte
//! planes: for each tensor of OLD / NEW with 64 changed words or more, the
//! low byte of the XOR word at each changed position (what the free mode's
//! encoder codes as a symbol stream), then `streams::put_symbols` at the
//! default level against zstd at its fastest level with literals
//! Huffman-coded (what `put_symbols` called before it wrote the frames
//! itself). One thread, best of the repeats; prints the times, ns per byte
//! and the bytes each wrote.
//! `cargo run --release -p dcr-core --example symbol_streams OLD NEW [REPEATS]`
use std::time::Instant;

use dcr_core::checkpoint::ReadOnlyCheckpoint;
use dcr_core::codec::streams;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let a = ReadOnlyCheckpoint::open(&args[1]).unwrap();
    let b = ReadOnlyCheckpoint::open(&args[2]).unwrap();
    let repeats: usize = args.get(3).map_or(50, |r| r.parse().unwrap());
    let planes: Vec<Vec<u8>> = a
        .layout()
        .tensors()
        .iter()
        .zip(a.buffers().into_iter().zip(b.buffers()))
        .filter_map(|(t, (old, new))| {
            let w = t.dtype.word_bytes();
            let plane: Vec<u8> = old.chunks_exact(w).zip(new.chunks_exact(w)).filter(|(o, n)| o != n).map(|(o, n)| o[0] ^ n[0]).collect();
            (plane.len() >= 64).then_some(plane)
        })
        .collect();
    let total: usize = planes.iter().map(Vec::len).sum();
    let mut zstd = zstd::bulk::Compressor::new(zstd::zstd_safe::min_c_level()).unwrap();
    for p in [
        zstd::zstd_safe::CParameter::LiteralCompressionMode(zstd::zstd_safe::ParamSwitch::Enable),
        zstd::zstd_safe::CParameter::Format(zstd::zstd_safe::FrameFormat::Magicless),
        zstd::zstd_safe::CParameter::ContentSizeFlag(false),
    ] {
        zstd.set_parameter(p).unwrap();
    }
    let time = |name: &str, f: &mut dyn FnMut() -> usize| {
        let mut best = f64::MAX;
        let mut bytes = 0;
        for _ in 0..repeats {
            let t = Instant::now();
            bytes = f();
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!("{name:24} {:7.3} ms  {:5.3} ns/byte  {bytes} bytes", best * 1e3, best * 1e9 / total as f64);
    };
    println!("{} streams, {total} bytes", planes.len());
    time("put_symbols", &mut || {
        let mut out = Vec::new();
        for p in &planes {
            streams::put_symbols(&mut out, p, 1);
        }
        out.len()
    });
    time("zstd, fastest level", &mut || planes.iter().map(|p| zstd.compress(p).unwrap().len()).sum());
}
