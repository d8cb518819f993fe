//! A/B timing in one process: the apply of the delta from OLD to NEW (or,
//! with `STAGE=diff` in the environment, the diff; with `STAGE=digest`, the
//! full digest pass over OLD, both variants' digests required equal), base
//! digests known, one thread, with `codec::AB_SWITCH` off (A) and on (B) in alternate repeats;
//! prints both medians and the median of the paired ratios B/A. Build with
//! the switch: `cargo run --release -p dcr-core --features ab-switch
//! --example ab_timing OLD NEW [REPEATS]` (`MODE=context` for that mode).
//! With `COLD=1` each repeat starts with the caches evicted (see
//! `common::evict_caches`). With `DELTAS=2` the apply of each variant
//! applies the delta written with the switch as it is (for encoder
//! choices that change the payload). The code under study reads `codec::AB_SWITCH`
//! to pick its variant; an A/A run (nothing reads it) shows the harness's
//! own spread (+-1 %).
use std::sync::atomic::Ordering;
use std::time::Instant;

use dcr_core::checkpoint::ReadOnlyCheckpoint;
use dcr_core::codec;
use dcr_core::delta::{self, DiffOptions};

mod common;
use common::evict_caches;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let a = ReadOnlyCheckpoint::open(&args[1]).unwrap();
    let b = ReadOnlyCheckpoint::open(&args[2]).unwrap();
    let repeats: usize = args.get(3).map_or(200, |r| r.parse().unwrap());
    let layout = a.layout().clone();
    let (ob, nb) = (a.buffers(), b.buffers());
    let context = std::env::var("MODE").is_ok_and(|m| m == "context");
    let opts = DiffOptions { mode: if context { codec::Mode::Context } else { codec::Mode::Free }, ..Default::default() };
    // With `DELTAS=2` each variant applies the delta its own encoder
    // wrote (the switch on while the second was written): for encoder
    // choices that change the payload.
    let two = std::env::var("DELTAS").is_ok_and(|d| d == "2");
    let encoded: Vec<Vec<u8>> = (0..1 + usize::from(two))
        .map(|variant| {
            codec::AB_SWITCH.store(variant == 1, Ordering::Relaxed);
            let mut bytes = Vec::new();
            delta::diff(&layout, &ob, &nb, &opts, &mut |f| {
                bytes.extend_from_slice(f);
                Ok(())
            }, &mut |_, _| {}).unwrap();
            bytes
        })
        .collect();
    if two {
        println!("delta bytes: A {}, B {}", encoded[0].len(), encoded[1].len());
    }
    let parsed: Vec<_> = encoded.iter().map(|bytes| delta::read_delta(bytes).unwrap()).collect();
    let base = layout.tensor_digests(&ob);
    let mut work: Vec<Vec<u8>> = ob.iter().map(|x| x.to_vec()).collect();
    let mut times = [Vec::new(), Vec::new()];
    let stage = std::env::var("STAGE").unwrap_or_default();
    let mut digests: [Vec<_>; 2] = [Vec::new(), Vec::new()];
    for r in 0..2 * repeats {
        let variant = r % 2;
        codec::AB_SWITCH.store(variant == 1, Ordering::Relaxed);
        for (w, o) in work.iter_mut().zip(&ob) {
            w.copy_from_slice(o);
        }
        let mut targets: Vec<&mut [u8]> = work.iter_mut().map(|w| &mut w[..]).collect();
        evict_caches();
        let t = Instant::now();
        if stage == "digest" {
            digests[variant] = dcr_core::exec::on_this_thread(|| layout.tensor_digests(&ob));
        } else if stage == "diff" {
            let mut n = 0usize;
            dcr_core::exec::on_this_thread(|| delta::diff_from(&layout, &ob, &nb, Some(&base), &opts, &mut |f| {
                n += f.len();
                Ok(())
            }, &mut |_, _| {}).unwrap());
            std::hint::black_box(n);
        } else {
            let parsed = &parsed[variant.min(parsed.len() - 1)];
            dcr_core::exec::on_this_thread(|| delta::apply_from(parsed, &layout, &mut targets, Some(&base)).unwrap());
        }
        times[variant].push(t.elapsed().as_secs_f64() * 1e3);
    }
    assert_eq!(digests[0], digests[1], "the variants' digests differ");
    let ratios: Vec<f64> = times[1].iter().zip(&times[0]).map(|(b, a)| b / a).collect();
    let med = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[0])
    };
    let (a, amin) = med(&times[0]);
    let (b, bmin) = med(&times[1]);
    println!("A median {a:.3} ms (min {amin:.3}), B median {b:.3} ms (min {bmin:.3}), median paired B/A {:.4}", med(&ratios).0);
}
