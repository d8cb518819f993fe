//! A/B timing of the full digest pass (`Layout::tensor_digests`, one
//! thread) in one process: `codec::AB_SWITCH` off (A) and on (B) in
//! alternate repeats, the digests of both required equal; prints both
//! medians and the median of the paired ratios B/A. Build with the switch:
//! `cargo run --release -p dcr-core --features ab-switch --example
//! ab_digest CHECKPOINT REPEATS`. The code under study reads the switch to
//! pick its variant (an A/A run shows the harness's own spread).
use std::sync::atomic::Ordering;
use std::time::Instant;
use dcr_core::checkpoint::ReadOnlyCheckpoint;
use dcr_core::codec;
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let a = ReadOnlyCheckpoint::open(&args[1]).unwrap();
    let reps: usize = args[2].parse().unwrap();
    let layout = a.layout().clone();
    let bufs = a.buffers();
    let mut t = [Vec::new(), Vec::new()];
    let mut ratios = Vec::new();
    let mut out = [Vec::new(), Vec::new()];
    for r in 0..2 * reps {
        let v = r % 2;
        codec::AB_SWITCH.store(v == 1, Ordering::Relaxed);
        let t0 = Instant::now();
        let d = dcr_core::exec::on_this_thread(|| layout.tensor_digests(&bufs));
        t[v].push(t0.elapsed().as_secs_f64());
        out[v] = d;
        if v == 1 { ratios.push(t[1].last().unwrap() / t[0].last().unwrap()); }
    }
    assert_eq!(out[0], out[1], "digests differ");
    for x in t.iter_mut() { x.sort_by(|a, b| a.partial_cmp(b).unwrap()); }
    ratios.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!("A {:.3} ms B {:.3} ms paired B/A {:.4}", t[0][reps / 2] * 1e3, t[1][reps / 2] * 1e3, ratios[reps / 2]);
}
