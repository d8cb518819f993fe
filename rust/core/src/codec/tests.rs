use super::*;
use proptest::prelude::*;

/// old, new (a copy of old with changes at a chosen density), width.
fn chunk_pair() -> impl Strategy<Value = (Vec<u8>, Vec<u8>, usize)> {
    (prop::sample::select(vec![1usize, 2, 4, 8]), 0usize..3000, 0.0f64..1.0, any::<u64>()).prop_map(
        |(width, n, density, seed)| {
            let mut rng = seed | 1;
            let mut next = move || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            let old: Vec<u8> = (0..n * width).map(|_| next() as u8).collect();
            let mut new = old.clone();
            let density = density * density; // favour sparse deltas
            for i in 0..n {
                if (next() % 1_000_000) as f64 / 1e6 < density {
                    // flip low bits like an optimizer step, sometimes any bits
                    let r = next();
                    let k = 1 + (r % width as u64) as usize;
                    for b in &mut new[i * width..i * width + k] {
                        *b ^= (r >> 8) as u8 | 1;
                    }
                }
            }
            (old, new, width)
        },
    )
}

proptest! {
    #[test]
    fn xor_round_trip((old, new, width) in chunk_pair(), level in prop::sample::select(vec![-1i32, 1, 3])) {
        let opts = EncodeOptions { kind: ChangeKind::Xor, zstd_level: level };
        let mut target = old.clone();
        match encode_chunk(&old, &new, width, opts).unwrap() {
            None => prop_assert_eq!(&old, &new),
            Some(c) => {
                apply_chunk(&mut target, width, ChangeKind::Xor, c.encoding, c.n_changed, &c.payload, "t").unwrap();
                prop_assert_eq!(&target, &new);
                // XOR is self-inverse: applying again restores the base.
                apply_chunk(&mut target, width, ChangeKind::Xor, c.encoding, c.n_changed, &c.payload, "t").unwrap();
                prop_assert_eq!(&target, &old);
            }
        }
    }

    #[test]
    fn overwrite_round_trip_is_idempotent((old, new, width) in chunk_pair()) {
        let opts = EncodeOptions { kind: ChangeKind::Overwrite, zstd_level: 1 };
        if let Some(c) = encode_chunk(&old, &new, width, opts).unwrap() {
            let mut target = old.clone();
            for _ in 0..2 {
                apply_chunk(&mut target, width, ChangeKind::Overwrite, c.encoding, c.n_changed, &c.payload, "t").unwrap();
                prop_assert_eq!(&target, &new);
            }
            // An overwrite also repairs a partially applied chunk.
            let mut partial = old.clone();
            let half = partial.len() / 2;
            partial[..half].copy_from_slice(&new[..half]);
            apply_chunk(&mut partial, width, ChangeKind::Overwrite, c.encoding, c.n_changed, &c.payload, "t").unwrap();
            prop_assert_eq!(&partial, &new);
        }
    }

    #[test]
    fn decoded_changes_match_scan((old, new, width) in chunk_pair()) {
        let found = find_changes(&old, &new, width, ChangeKind::Xor).unwrap();
        if let Some(c) = encode_chunk(&old, &new, width, EncodeOptions::default()).unwrap() {
            prop_assert_eq!(c.n_changed as usize, found.positions.len());
            let d = decode_chunk(&c.payload, old.len() / width, width, c.encoding, c.n_changed, "t").unwrap();
            let mut got = d.to_changes();
            if matches!(c.encoding, Encoding::Dense | Encoding::Raw) {
                let keep: Vec<bool> = got.values.iter().map(|&v| v != 0).collect();
                got.positions = got.positions.iter().zip(&keep).filter(|(_, k)| **k).map(|(p, _)| *p).collect();
                got.values.retain(|&v| v != 0);
            }
            prop_assert_eq!(got, found);
        }
    }

    #[test]
    fn corrupted_payload_never_panics((old, new, width) in chunk_pair(), flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..4), cut in any::<usize>()) {
        if let Some(c) = encode_chunk(&old, &new, width, EncodeOptions::default()).unwrap() {
            let mut bad = c.payload.clone();
            for (i, x) in flips {
                let i = i % bad.len();
                bad[i] ^= x | 1;
            }
            let mut target = old.clone();
            let _ = apply_chunk(&mut target, width, ChangeKind::Xor, c.encoding, c.n_changed, &bad, "t");
            let short = &c.payload[..cut % c.payload.len()];
            let mut target2 = old.clone();
            prop_assert!(apply_chunk(&mut target2, width, ChangeKind::Xor, c.encoding, c.n_changed, short, "t").is_err());
            prop_assert_eq!(&target2, &old, "a refused payload writes nothing");
        }
    }
}

#[test]
fn special_float_patterns_are_exact() {
    // NaN payloads, -0.0/+0.0, subnormals, infinities as f32 and bf16 words.
    let old_f32: Vec<u32> = vec![0x7fc0_0001, 0x0000_0000, 0x0000_0001, 0x7f80_0000, 0x3f80_0000];
    let new_f32: Vec<u32> = vec![0x7fc0_0002, 0x8000_0000, 0x0000_0003, 0xff80_0000, 0x3f80_0000];
    let old: Vec<u8> = old_f32.iter().flat_map(|v| v.to_le_bytes()).collect();
    let new: Vec<u8> = new_f32.iter().flat_map(|v| v.to_le_bytes()).collect();
    for kind in [ChangeKind::Xor, ChangeKind::Overwrite] {
        let c = encode_chunk(&old, &new, 4, EncodeOptions { kind, zstd_level: 1 }).unwrap().unwrap();
        assert_eq!(c.n_changed, 4);
        let mut t = old.clone();
        apply_chunk(&mut t, 4, kind, c.encoding, c.n_changed, &c.payload, "t").unwrap();
        assert_eq!(t, new);
    }
}

#[test]
fn sparse_chunk_picks_sparse_and_large_gaps_escape() {
    let n = 1 << 16;
    let old = vec![0u8; n * 2];
    let mut new = old.clone();
    for p in [0usize, 1, 300, 70_000 / 2, n - 1] {
        new[p * 2] = 1;
    }
    let c = encode_chunk(&old, &new, 2, EncodeOptions::default()).unwrap().unwrap();
    assert_eq!(c.encoding, Encoding::Sparse);
    let mut t = old.clone();
    apply_chunk(&mut t, 2, ChangeKind::Xor, c.encoding, c.n_changed, &c.payload, "t").unwrap();
    assert_eq!(t, new);
}

#[test]
fn wrong_changed_count_is_refused() {
    let old = vec![0u8; 64];
    let mut new = old.clone();
    new[4] = 9;
    let c = encode_chunk(&old, &new, 2, EncodeOptions::default()).unwrap().unwrap();
    let mut t = old.clone();
    let err = apply_chunk(&mut t, 2, ChangeKind::Xor, c.encoding, c.n_changed + 1, &c.payload, "chunk 7").unwrap_err();
    assert!(err.to_string().contains("chunk 7"), "{err}");
    assert_eq!(t, old);
}

/// The vectorised scan (used when the CPU has AVX2) and the portable scan
/// find the same changes, for every width, density and ragged tail.
#[test]
fn vectorised_and_portable_scans_agree() {
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut rnd = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for width in [1usize, 2, 4, 8] {
        for words in [0usize, 1, 63, 64, 65, 1000, 4099] {
            for per_mille in [0u64, 10, 300, 1000] {
                let old: Vec<u8> = (0..words * width).map(|_| rnd() as u8).collect();
                let mut new = old.clone();
                for i in 0..words {
                    if rnd() % 1000 < per_mille {
                        let b = (rnd() as usize) % width;
                        new[i * width + b] ^= 1 << (rnd() % 8);
                    }
                }
                for kind in [ChangeKind::Xor, ChangeKind::Overwrite] {
                    let got = find_changes(&old, &new, width, kind).unwrap();
                    let mut want = SparseChanges::default();
                    match width {
                        1 => super::scan::<u8>(&old, &new, kind, &mut want),
                        2 => super::scan::<u16>(&old, &new, kind, &mut want),
                        4 => super::scan::<u32>(&old, &new, kind, &mut want),
                        _ => super::scan::<u64>(&old, &new, kind, &mut want),
                    }
                    assert_eq!(got, want, "width {width}, {words} words, {per_mille}/1000");
                }
            }
        }
    }
}
