//! Micro-benchmark of the change scan: cost per step and per change.
use std::time::Instant;
use dcr_core::codec::{find_changes, ChangeKind};
fn main() {
    let n = 4 << 20; // bytes (bf16: 2M words)
    let old: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    for rate in [0.0f64, 0.01, 0.03, 0.1] {
        let mut new = old.clone();
        // Random positions (xorshift), as in real deltas.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for i in 0..n / 2 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if ((x >> 11) as f64 / (1u64 << 53) as f64) < rate {
                new[i * 2] ^= 1;
            }
        }
        let t = Instant::now();
        let reps = 50;
        let mut m = 0;
        for _ in 0..reps {
            m += find_changes(&old, &new, 2, ChangeKind::Xor).unwrap().positions.len();
        }
        let dt = t.elapsed().as_secs_f64() / reps as f64;
        println!("rate {rate:.2}: {:.3} ms per 4 MiB ({:.2} GB/s), {} changes", dt * 1e3, n as f64 / dt / 1e9, m / reps);
    }
}
