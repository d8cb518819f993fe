//! Time context-mode encode and decode of two safetensors files (one thread).
//! With `COLD=1` in the environment the caches are flushed (256 MiB written
//! elsewhere, not timed) before each timed encode and decode. With
//! `DECODE_ONLY=1` each repeat decodes 40 times (the time reported is per
//! decode), so that a profiler's samples are mostly the decoder's;
//! `ENCODE_ONLY=1` does the same for the encoder. `CHUNK` sets the bytes
//! per chunk (4 MiB, as `dcr diff`, by default).
use std::time::Instant;
use dcr_core::checkpoint::ReadOnlyCheckpoint;
use dcr_core::codec::{self, context::{self, ContextModel}, ChangeKind};

mod common;
use common::evict_caches;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let a = ReadOnlyCheckpoint::open(&args[1]).unwrap();
    let b = ReadOnlyCheckpoint::open(&args[2]).unwrap();
    let (ob, nb) = (a.buffers(), b.buffers());
    let total: usize = ob.iter().map(|x| x.len()).sum();
    let dtype = a.layout().tensors()[0].dtype;
    let model = ContextModel::for_dtype(dtype);
    let width = dtype.word_bytes();
    let mut best = [f64::MAX; 3];
    let chunk: usize = std::env::var("CHUNK").map_or(4 << 20, |c| c.parse().expect("CHUNK: bytes per chunk"));
    let (mut changed, mut payload) = (0usize, 0usize);
    for _ in 0..15 {
        evict_caches();
        let t = Instant::now();
        let mut enc = Vec::new();
        let encode_rounds = if std::env::var_os("ENCODE_ONLY").is_some() { 40 } else { 1 };
        for _ in 0..encode_rounds {
            enc.clear();
            for (o, n) in ob.iter().zip(&nb) {
                for (oc, nc) in o.chunks(chunk).zip(n.chunks(chunk)) {
                    let ch = codec::find_changes(oc, nc, width, ChangeKind::Xor).unwrap();
                    if !ch.positions.is_empty() {
                        enc.push((oc, ch.positions.len(), context::encode(oc, nc, &ch, &model, 1)));
                    }
                }
            }
        }
        let t_enc = t.elapsed().as_secs_f64() / encode_rounds as f64;
        changed = enc.iter().map(|e| e.1).sum();
        payload = enc.iter().map(|e| e.2.len()).sum();
        evict_caches();
        let t = Instant::now();
        let rounds = if std::env::var_os("DECODE_ONLY").is_some() { 40 } else { 1 };
        for (oc, m, p) in enc.iter().cycle().take(rounds * enc.len()) {
            context::decode(p, oc, &model, *m as u32, ChangeKind::Xor, "x").unwrap();
        }
        let t_dec = t.elapsed().as_secs_f64() / rounds as f64;
        let t = Instant::now();
        for (o, _) in ob.iter().zip(&nb) {
            for oc in o.chunks(4 << 20) {
                let mut seen = [0u32; 256];
                for w in oc.chunks_exact(2) {
                    seen[((u16::from_le_bytes([w[0], w[1]]) >> 7) & 0xff) as usize] += 1;
                }
                std::hint::black_box(seen);
            }
        }
        let t_hist = t.elapsed().as_secs_f64();
        best = [best[0].min(t_enc), best[1].min(t_dec), best[2].min(t_hist)];
    }
    let gb = |s: f64| total as f64 / s / 1e9;
    println!("context payload {payload} bytes for {changed} changed elements: {:.4} bytes per changed element", payload as f64 / changed as f64);
    println!("context encode {:.2} GB/s, decode {:.2} GB/s, plain histogram pass {:.2} GB/s", gb(best[0]), gb(best[1]), gb(best[2]));
    // Whole-delta apply, as dcr apply does it.
    use dcr_core::delta::{apply, diff, read_delta, DiffOptions};
    use dcr_core::codec::Mode;
    let mut bytes = Vec::new();
    let t = Instant::now();
    diff(a.layout(), &ob, &nb, &DiffOptions { mode: Mode::Context, ..Default::default() }, &mut |b| { bytes.extend_from_slice(b); Ok(()) }, &mut |_, _| {}).unwrap();
    let t_diff = t.elapsed().as_secs_f64();
    let delta = read_delta(&bytes).unwrap();
    let mut best_apply = f64::MAX;
    for _ in 0..5 {
        let mut tgt: Vec<Vec<u8>> = ob.iter().map(|b| b.to_vec()).collect();
        let mut views: Vec<&mut [u8]> = tgt.iter_mut().map(|v| v.as_mut_slice()).collect();
        let t = Instant::now();
        apply(&delta, a.layout(), &mut views).unwrap();
        best_apply = best_apply.min(t.elapsed().as_secs_f64());
    }
    println!("whole diff {:.2} GB/s, whole apply {:.2} GB/s ({} threads)", gb(t_diff), gb(best_apply), rayon::current_num_threads());
}
