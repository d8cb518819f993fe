//! What each tensor's chunk costs to encode alone, with its change count,
//! so that the costs paid once per chunk (a Huffman code and its
//! description, the estimates) show beside those paid per change:
//! `cargo run --release -p dcr-core --example chunk_costs OLD NEW [REPEATS]
//! [NAME]` prints, per tensor (or only those whose names contain NAME), its
//! bytes, changed elements, payload bytes and the median time of REPEATS
//! encodes (`codec::encode_chunk`, the free mode, no digest moves), on the
//! calling thread. Each tensor is encoded REPEATS times in a row, so its
//! inputs stay in the caches: the per-change figures of the small tensors
//! are those of warm caches, not of a refit.
use std::time::Instant;

use dcr_core::checkpoint::ReadOnlyCheckpoint;
use dcr_core::codec::{self, EncodeOptions};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let a = ReadOnlyCheckpoint::open(&args[1]).unwrap();
    let b = ReadOnlyCheckpoint::open(&args[2]).unwrap();
    let repeats: usize = args.get(3).map_or(101, |r| r.parse().expect("REPEATS: a count"));
    let only = args.get(4).cloned().unwrap_or_default();
    let layout = a.layout().clone();
    let (ob, nb) = (a.buffers(), b.buffers());
    let mut total = 0.0;
    println!("{:>9} {:>8} {:>8} {:>10}  tensor", "bytes", "changed", "payload", "us");
    dcr_core::exec::on_this_thread(|| {
        for (t, (o, n)) in layout.tensors().iter().zip(ob.iter().zip(&nb)) {
            if !t.name.contains(only.as_str()) {
                continue;
            }
            let w = t.dtype.word_bytes();
            let (mut times, mut changed, mut payload) = (Vec::with_capacity(repeats), 0, 0);
            for _ in 0..repeats {
                let start = Instant::now();
                let chunk = codec::encode_chunk(o, n, w, EncodeOptions::default()).unwrap();
                times.push(start.elapsed().as_secs_f64() * 1e6);
                if let Some(c) = chunk {
                    (changed, payload) = (c.n_changed, c.payload.len());
                }
            }
            times.sort_by(f64::total_cmp);
            let median = times[times.len() / 2];
            total += median;
            println!("{:>9} {:>8} {:>8} {:>10.2}  {}", o.len(), changed, payload, median, t.name);
        }
    });
    println!("total {total:.1} us");
}
