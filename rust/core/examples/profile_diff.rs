//! Time the stages of a diff and an apply on two safetensors files, on the
//! calling thread (`exec::on_this_thread`, what `threads=1` means from
//! Python; a one-thread pool would add a wake-up of its worker to every
//! timed call): `cargo run --release -p dcr-core --example profile_diff OLD NEW`.
//! Prints the median of the repeats for each stage, in GB/s of checkpoint.
//! `... OLD NEW REPEATS STAGE` runs only the stages whose names contain STAGE.
//! `MODE=context` in the environment times the context mode's delta (its
//! `decode` stage reads each chunk's base words in OLD).
//! With `COLD=1` in the environment each repeat first writes 256 MiB
//! elsewhere (not timed), so that it starts with nothing of the inputs in
//! the caches, as a refit does.
use std::time::{Duration, Instant};

use dcr_core::checkpoint::ReadOnlyCheckpoint;
use dcr_core::codec::{self, ChangeKind, EncodeOptions};
use dcr_core::delta::{self, DiffOptions};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

mod common;
use common::evict_caches;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let a = ReadOnlyCheckpoint::open(&args[1]).unwrap();
    let b = ReadOnlyCheckpoint::open(&args[2]).unwrap();
    let repeats: usize = args.get(3).map_or(15, |r| r.parse().unwrap());
    // An optional fourth argument runs only the stages whose names contain it
    // (for `perf record`).
    let only = args.get(4).cloned().unwrap_or_default();
    let layout = a.layout().clone();
    let (ob, nb) = (a.buffers(), b.buffers());
    let total: usize = ob.iter().map(|x| x.len()).sum();
    let base_digests = layout.tensor_digests(&ob);
    // `MODE=context` in the environment: the context mode's delta.
    let context = std::env::var("MODE").is_ok_and(|m| m == "context");
    // `CHUNK=BYTES` in the environment: the delta's chunk size.
    let chunk_bytes = std::env::var("CHUNK").map_or(delta::DEFAULT_CHUNK_BYTES, |c| c.parse().expect("CHUNK: bytes per chunk"));
    let opts = DiffOptions { mode: if context { codec::Mode::Context } else { codec::Mode::Free }, chunk_bytes, ..Default::default() };
    let mut delta_bytes = Vec::new();
    delta::diff(&layout, &ob, &nb, &opts, &mut |f| {
        let _: () = delta_bytes.extend_from_slice(f);
        Ok(())
    }, &mut |_, _| {}).unwrap();
    let parsed = delta::read_delta(&delta_bytes).unwrap();

    let mut stages: Vec<(&str, Vec<Duration>)> = Vec::new();
    let mut time = |name: &'static str, f: &mut dyn FnMut()| {
        if !name.contains(only.as_str()) {
            return;
        }
        let mut v = Vec::new();
        for _ in 0..repeats {
            evict_caches();
            let t = Instant::now();
            f();
            v.push(t.elapsed());
        }
        stages.push((name, v));
    };
    dcr_core::exec::on_this_thread(|| {
        time("read old + new (bound)", &mut || {
            let mut acc = 0u64;
            for (o, n) in ob.iter().zip(&nb) {
                for (x, y) in o.chunks_exact(8).zip(n.chunks_exact(8)) {
                    acc |= u64::from_le_bytes(x.try_into().unwrap()) ^ u64::from_le_bytes(y.try_into().unwrap());
                }
            }
            std::hint::black_box(acc);
        });
        time("digest (full pass)", &mut || {
            std::hint::black_box(layout.tensor_digests(&ob));
        });
        time("change scan", &mut || {
            for (t, (o, n)) in layout.tensors().iter().zip(ob.iter().zip(&nb)) {
                let w = t.dtype.word_bytes();
                for (oc, nc) in o.chunks(4 << 20).zip(n.chunks(4 << 20)) {
                    std::hint::black_box(codec::find_changes(oc, nc, w, ChangeKind::Xor).unwrap());
                }
            }
        });
        time("scan + chunk encode", &mut || {
            for (t, (o, n)) in layout.tensors().iter().zip(ob.iter().zip(&nb)) {
                let w = t.dtype.word_bytes();
                for (oc, nc) in o.chunks(4 << 20).zip(n.chunks(4 << 20)) {
                    std::hint::black_box(codec::encode_chunk(oc, nc, w, EncodeOptions::default()).unwrap());
                }
            }
        });
        time("diff, base digests known", &mut || {
            let mut n = 0usize;
            delta::diff_from(&layout, &ob, &nb, Some(&base_digests), &opts, &mut |f| {
                let _: () = n += f.len();
                Ok(())
            }, &mut |_, _| {}).unwrap();
        });
        time("diff, base digested", &mut || {
            let mut n = 0usize;
            delta::diff(&layout, &ob, &nb, &opts, &mut |f| {
                let _: () = n += f.len();
                Ok(())
            }, &mut |_, _| {}).unwrap();
        });
    });
    // Parsing the delta bytes (frames, checksums), which every apply does first.
    time("apply: read delta (parse, checksums)", &mut || {
        std::hint::black_box(delta::read_delta(&delta_bytes).unwrap());
    });
    // Decoding alone (entropy decoding and positions), no target written;
    // a context chunk reads its base words in OLD.
    let decode = |c: &dcr_core::format::ChunkFrame<&[u8]>| {
        let w = layout.tensors()[c.tensor as usize].dtype.word_bytes();
        let at = c.start as usize * w;
        let range = at..at + c.len as usize * w;
        delta::decode_against(c, &range, &layout, &ob[c.tensor as usize][range.clone()]).unwrap()
    };
    time("apply: decode chunks only", &mut || {
        for c in &parsed.chunks {
            std::hint::black_box(decode(c));
        }
    });
    // Apply: each repeat starts from a fresh copy of the base (copy not timed).
    let mut work: Vec<Vec<u8>> = ob.iter().map(|b| b.to_vec()).collect();
    // The write alone: chunks decoded beforehand (not timed), then written
    // in place with their digest moves, as the apply's second phase does.
    if "apply: write decoded chunks".contains(only.as_str()) {
        let decoded: Vec<_> = parsed.chunks.iter().map(decode).collect();
        let mut v = Vec::new();
        for _ in 0..repeats {
            for (w, o) in work.iter_mut().zip(&ob) {
                w.copy_from_slice(o);
            }
            evict_caches();
            let t = Instant::now();
            for (c, d) in parsed.chunks.iter().zip(&decoded) {
                let w = layout.tensors()[c.tensor as usize].dtype.word_bytes();
                let at = c.start as usize * w;
                let slice = &mut work[c.tensor as usize][at..at + c.len as usize * w];
                std::hint::black_box(d.apply_tracked(slice, c.kind, c.start));
            }
            v.push(t.elapsed());
        }
        stages.push(("apply: write decoded chunks", v));
    }
    let mut time_apply = |name: &'static str, known: bool| {
        if !name.contains(only.as_str()) {
            return;
        }
        let mut v = Vec::new();
        for _ in 0..repeats {
            for (w, o) in work.iter_mut().zip(&ob) {
                w.copy_from_slice(o);
            }
            let mut targets: Vec<&mut [u8]> = work.iter_mut().map(|w| &mut w[..]).collect();
            evict_caches();
            let t = Instant::now();
            dcr_core::exec::on_this_thread(|| delta::apply_from(&parsed, &layout, &mut targets, known.then_some(&base_digests[..])).unwrap());
            v.push(t.elapsed());
        }
        stages.push((name, v));
    };
    time_apply("apply, base digests known", true);
    time_apply("apply, base digested", false);

    println!("{} tensors, {total} bytes, {} changed, delta {} bytes; one thread, median of {repeats}", layout.len(), parsed.trailer.n_changed, delta_bytes.len());
    for (name, v) in stages {
        let least = *v.iter().min().expect("at least one repeat");
        let m = median(v);
        println!(
            "  {name:<28} {:>9.3} ms  {:>6.2} GB/s  (fastest {:.3} ms)",
            m.as_secs_f64() * 1e3,
            total as f64 / m.as_secs_f64() / 1e9,
            least.as_secs_f64() * 1e3
        );
    }
}
