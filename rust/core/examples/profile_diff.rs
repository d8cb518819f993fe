//! Time the stages of a diff on two safetensors files (one thread).
use std::time::Instant;
use dcr_core::checkpoint::ReadOnlyCheckpoint;
use dcr_core::codec::{self, ChangeKind, EncodeOptions};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let a = ReadOnlyCheckpoint::open(&args[1]).unwrap();
    let b = ReadOnlyCheckpoint::open(&args[2]).unwrap();
    let (ob, nb) = (a.buffers(), b.buffers());
    let total: usize = ob.iter().map(|x| x.len()).sum();
    for _ in 0..25 {
        let t = Instant::now();
        let mut m = 0;
        for (o, n) in ob.iter().zip(&nb) {
            for (oc, nc) in o.chunks(4 << 20).zip(n.chunks(4 << 20)) {
                m += codec::find_changes(oc, nc, 2, ChangeKind::Xor).unwrap().positions.len();
            }
        }
        let scan = t.elapsed();
        let t = Instant::now();
        let mut bytes = 0;
        for (o, n) in ob.iter().zip(&nb) {
            for (oc, nc) in o.chunks(4 << 20).zip(n.chunks(4 << 20)) {
                if let Some(c) = codec::encode_chunk(oc, nc, 2, EncodeOptions::default()).unwrap() {
                    bytes += c.payload.len();
                }
            }
        }
        let enc = t.elapsed();
        println!("{total} bytes, {m} changed: scan {:?} ({:.2} GB/s), encode {:?} ({:.2} GB/s), {bytes} payload",
            scan, total as f64 / scan.as_secs_f64() / 1e9, enc, total as f64 / enc.as_secs_f64() / 1e9);
    }
}
