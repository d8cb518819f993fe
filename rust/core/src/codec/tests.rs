use super::*;
use proptest::prelude::*;

/// A xorshift64 stream: quick, reproducible test data (`seed` may be 0).
pub(super) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// old, new (a copy of old with changes at a chosen density), width.
fn chunk_pair() -> impl Strategy<Value = (Vec<u8>, Vec<u8>, usize)> {
    (prop::sample::select(vec![1usize, 2, 4, 8]), 0usize..3000, 0.0f64..1.0, any::<u64>()).prop_map(
        |(width, n, density, seed)| {
            let mut next = xorshift(seed);
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
    fn find_changes_matches_a_word_by_word_compare((old, new, width) in chunk_pair(), overwrite in any::<bool>()) {
        let kind = if overwrite { ChangeKind::Overwrite } else { ChangeKind::Xor };
        let mut expected = SparseChanges::default();
        for (i, (a, b)) in old.chunks_exact(width).zip(new.chunks_exact(width)).enumerate() {
            if a != b {
                expected.positions.push(i as u32);
                expected.values.push(match kind {
                    ChangeKind::Xor => read_word(a) ^ read_word(b),
                    ChangeKind::Overwrite => read_word(b),
                });
            }
        }
        prop_assert_eq!(&find_changes(&old, &new, width, kind).unwrap(), &expected);
        prop_assert_eq!(find_split_changes(&old, &new, width, kind, None).unwrap().0, split_of(&expected, width));
        for (scanner, positions) in every_scanner(&old, &new, width, 7) {
            let want: Vec<u32> = expected.positions.iter().map(|p| p + 7).collect();
            prop_assert_eq!(positions, want, "{} scan", scanner);
        }
    }

    #[test]
    fn tracked_scan_moves_the_digest_like_a_full_pass((old, new, width) in chunk_pair(), first in prop::sample::select(vec![0u64, 3, (1 << 32) - 40])) {
        let (changes, moved) = find_changes_tracked(&old, &new, width, ChangeKind::Xor, first).unwrap();
        prop_assert_eq!(&changes, &find_changes(&old, &new, width, ChangeKind::Xor).unwrap());
        let before = crate::digest::partial_digest(&old, width, first);
        let after = crate::digest::partial_digest(&new, width, first);
        prop_assert_eq!(before.plus(moved), after);
    }
}

/// Positions (plus `base`) of the words that differ, from each change scan
/// this CPU can run: the portable one always, the AVX2 and AVX-512 ones
/// where supported.
fn every_scanner(old: &[u8], new: &[u8], width: usize, base: u32) -> Vec<(&'static str, Vec<u32>)> {
    let mut out = Vec::new();
    let mut portable = Vec::new();
    match width {
        1 => super::scan::scan::<u8>(old, new, base, &mut portable),
        2 => super::scan::scan::<u16>(old, new, base, &mut portable),
        4 => super::scan::scan::<u32>(old, new, base, &mut portable),
        _ => super::scan::scan::<u64>(old, new, base, &mut portable),
    }
    out.push(("portable", portable));
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("popcnt") {
            let mut v = Vec::new();
            // Safety: the CPU supports AVX2 and POPCNT (checked just above).
            #[allow(unsafe_code)]
            unsafe {
                super::scan::scan_avx2::scan(old, new, width, base, &mut v)
            };
            out.push(("avx2", v));
        }
        if has!("avx512f") && has!("avx512bw") && has!("popcnt") {
            let mut v = Vec::new();
            // Safety: the CPU supports AVX-512 F/BW and POPCNT (checked just above).
            #[allow(unsafe_code)]
            unsafe {
                super::scan::scan_avx512::scan(old, new, width, base, &mut v)
            };
            out.push(("avx512", v));
        }
    }
    out
}

proptest! {
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

/// `changes` with their values as byte planes.
fn split_of(changes: &SparseChanges, width: usize) -> SplitChanges {
    SplitChanges {
        positions: changes.positions.clone(),
        planes: (0..width).map(|j| changes.values.iter().map(|&v| (v >> (8 * j)) as u8).collect()).collect(),
    }
}

/// Chunks of several scan stripes (128 KiB each) and many stage flushes
/// of the fused scan-and-gather kernel, whose tail is not a whole block:
/// every width, both kinds, sparse to dense, tracked and not, held to a
/// word-by-word compare and to the digest of a full pass.
#[test]
fn long_chunks_scan_like_a_word_by_word_compare() {
    for width in [1usize, 2, 4, 8] {
        let n = (300 << 10) / width + 37;
        let mut next = xorshift(width as u64 * 977);
        let old: Vec<u8> = (0..n * width).map(|_| next() as u8).collect();
        for per_million in [300u64, 60_000, 600_000] {
            let mut new = old.clone();
            for i in 0..n {
                if next() % 1_000_000 < per_million {
                    new[i * width + (next() as usize % width)] ^= 1 << (next() % 8);
                }
            }
            // A run of changes across a stripe's end and the last words.
            let stripe = (128 << 10) / width;
            for i in (stripe - 70..stripe + 70).chain(n - 40..n) {
                new[i * width] ^= 0x5a;
            }
            for kind in [ChangeKind::Xor, ChangeKind::Overwrite] {
                let mut expected = SparseChanges::default();
                for (i, (a, b)) in old.chunks_exact(width).zip(new.chunks_exact(width)).enumerate() {
                    if a != b {
                        expected.positions.push(i as u32);
                        expected.values.push(if kind == ChangeKind::Xor { read_word(a) ^ read_word(b) } else { read_word(b) });
                    }
                }
                let what = format!("width {width}, {per_million} per million, {kind:?}");
                assert_eq!(find_changes(&old, &new, width, kind).unwrap(), expected, "{what}");
                let first = 1000;
                let (tracked, moved) = find_changes_tracked(&old, &new, width, kind, first).unwrap();
                assert_eq!(tracked, expected, "{what}, tracked");
                let (before, after) = (crate::digest::partial_digest(&old, width, first), crate::digest::partial_digest(&new, width, first));
                assert_eq!(before.plus(moved), after, "{what}: digest move");
                let (split, split_moved) = find_split_changes(&old, &new, width, kind, Some(first)).unwrap();
                assert_eq!(split, split_of(&expected, width), "{what}, split");
                assert_eq!(split_moved, moved, "{what}, split: digest move");
                assert_eq!(find_split_changes(&old, &new, width, kind, None).unwrap().0, split, "{what}, split untracked");
            }
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
    // Regular gaps, which zstd's matches code in a few bytes where Rice
    // codes take bits per change, then gaps of 255 and more.
    let n = 1 << 16;
    let old = vec![0u8; n * 2];
    let mut new = old.clone();
    let mut changed: Vec<usize> = (0..n / 2).step_by(6).collect();
    changed.extend([n / 2 + 300, n / 2 + 20_000, n - 1]);
    for &p in &changed {
        new[p * 2] = 1;
    }
    let c = encode_chunk(&old, &new, 2, EncodeOptions::default()).unwrap().unwrap();
    assert_eq!(c.encoding, Encoding::Sparse);
    let mut t = old.clone();
    apply_chunk(&mut t, 2, ChangeKind::Xor, c.encoding, c.n_changed, &c.payload, "t").unwrap();
    assert_eq!(t, new);
}

#[test]
fn a_few_changes_pick_rice_with_far_gaps() {
    let n = 1 << 16;
    let old = vec![0u8; n * 2];
    let mut new = old.clone();
    for p in [0usize, 1, 300, 70_000 / 2, n - 1] {
        new[p * 2] = 1;
    }
    for kind in [ChangeKind::Xor, ChangeKind::Overwrite] {
        let c = encode_chunk(&old, &new, 2, EncodeOptions { kind, zstd_level: 1 }).unwrap().unwrap();
        assert_eq!(c.encoding, Encoding::Rice);
        let found = find_changes(&old, &new, 2, kind).unwrap();
        let span = u64::from(*found.positions.last().unwrap()) + 1;
        let gaps = super::position_gaps(&found.positions);
        let (k, bits) = super::rice::best_rice_parameter(&gaps, span, gaps.len() as u64);
        assert!(super::rice_positions(&gaps, k, bits).len() < super::sparse_positions(&gaps, 1).len());
        let mut t = old.clone();
        apply_chunk(&mut t, 2, kind, c.encoding, c.n_changed, &c.payload, "t").unwrap();
        assert_eq!(t, new);
        // Every cut and every flipped bit of the payload is refused or, where
        // the damage still decodes, never panics.
        for cut in 0..c.payload.len() {
            let mut t = old.clone();
            assert!(apply_chunk(&mut t, 2, kind, c.encoding, c.n_changed, &c.payload[..cut], "t").is_err(), "cut at {cut}");
            assert_eq!(t, old);
        }
        for bit in 0..c.payload.len() * 8 {
            let mut bad = c.payload.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            let mut t = old.clone();
            let _ = apply_chunk(&mut t, 2, kind, c.encoding, c.n_changed, &bad, "t");
        }
    }
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

/// Counts no chunk can hold, and a bitmap that marks an element past the
/// chunk's end, are refused by name before anything is decoded into them.
#[test]
fn impossible_counts_and_bitmaps_past_the_end_are_refused_by_name() {
    let refusal = |payload: &[u8], n: usize, encoding: Encoding, m: u32| match decode_chunk(payload, n, 2, encoding, m, "chunk 2") {
        Ok(_) => panic!("decoded: {m} changes of {n}, {encoding:?}"),
        Err(e) => e.to_string(),
    };
    let err = refusal(&[], 3, Encoding::Sparse, 4);
    assert!(err.contains("4 changed elements in a chunk of 3"), "{err}");
    let err = refusal(&[], 5, Encoding::Bitmap, 0);
    assert!(err.contains("0 changed elements in a chunk of 5"), "{err}");
    // 13 elements: bits 0 and 12 (or 13, past the end) of the bitmap set,
    // then the planes of the two changes' value bytes, the high byte's
    // first.
    let bitmap = |high: u8| {
        let mut payload = Vec::new();
        streams::put_stored(&mut payload, &[0x01, high]);
        streams::put_stored(&mut payload, &[7, 7]);
        streams::put_stored(&mut payload, &[1, 1]);
        payload
    };
    let Ok(inside) = decode_chunk(&bitmap(0x10), 13, 2, Encoding::Bitmap, 2, "chunk 2") else { panic!("bit 12 is inside") };
    let mut target = vec![0u8; 26];
    inside.apply(&mut target, ChangeKind::Overwrite);
    assert_eq!((target[0], target[1], target[24], target[25]), (1, 7, 1, 7));
    let err = refusal(&bitmap(0x20), 13, Encoding::Bitmap, 2);
    assert!(err.contains("chunk 2") && err.contains("bitmap marks elements past the chunk end"), "{err}");
}

// ------------------------------------------------------------ context mode

use crate::dtype::DType;
use context::ContextModel;

/// Every dtype of a word width (floats, integers and packed types).
fn dtypes_of_width(width: usize) -> Vec<DType> {
    DType::all().filter(|d| d.word_bytes() == width).collect()
}

/// Float-like chunks: the context field of each old word is drawn from a
/// narrow window (as in trained weights), the other bits at random; new
/// words are old words moved by a few representable steps or, now and
/// then, replaced by any bit pattern.
fn float_like_pair() -> impl Strategy<Value = (Vec<u8>, Vec<u8>, DType)> {
    (prop::sample::select(DType::all().collect::<Vec<_>>()), 0usize..5000, 0.0f64..1.0, any::<u64>()).prop_map(
        |(dtype, n, density, seed)| {
            let width = dtype.word_bytes();
            let (shift, bits) = match width {
                1 => (3, 4),
                2 => (7, 8),
                4 => (23, 8),
                _ => (52, 11),
            };
            let mut next = xorshift(seed);
            let word_mask = if width == 8 { u64::MAX } else { (1u64 << (8 * width)) - 1 };
            let field = ((1u64 << bits) - 1) << shift;
            let window = next() % ((1 << bits) - 6);
            let density = density * density * density;
            let mut old = Vec::with_capacity(n * width);
            let mut new = Vec::with_capacity(n * width);
            for _ in 0..n {
                let r = next();
                let o = ((r & !field) | (((window + r % 7) << shift) & field)) & word_mask;
                let x = next();
                let v = if (x % 1_000_000) as f64 / 1e6 >= density {
                    o
                } else if x.is_multiple_of(50) {
                    next() & word_mask
                } else {
                    // a few steps up or down in the word's own bits
                    let step = 1 + (x >> 20) % 3;
                    (if x & (1 << 40) != 0 { o.wrapping_add(step) } else { o.wrapping_sub(step) }) & word_mask
                };
                old.extend_from_slice(&o.to_le_bytes()[..width]);
                new.extend_from_slice(&v.to_le_bytes()[..width]);
            }
            (old, new, dtype)
        },
    )
}

fn context_round_trip(old: &[u8], new: &[u8], dtype: DType, kind: ChangeKind) -> std::result::Result<(), TestCaseError> {
    let width = dtype.word_bytes();
    let model = ContextModel::for_dtype(dtype);
    let found = find_changes(old, new, width, ChangeKind::Xor).unwrap();
    if found.positions.is_empty() {
        prop_assert_eq!(old, new);
        return Ok(());
    }
    let m = found.positions.len() as u32;
    let payload = context::encode(old, new, &found, &model, 1);
    let decoded = decode_chunk_context(&payload, old, width, &model, m, kind, "t").unwrap();
    let mut target = old.to_vec();
    decoded.apply(&mut target, kind);
    prop_assert_eq!(&target, &new);
    let reference = context::decode_reference(&payload, old, &model, m, kind, "t").unwrap();
    prop_assert_eq!(decoded.to_changes(), reference);
    // Both step codings, whatever the encoder would pick for this chunk.
    for steps in [context::StepCoding::Adaptive, context::StepCoding::Tables] {
        let payload = context::encode_with(old, new, &found, &model, 1, steps);
        let decoded = decode_chunk_context(&payload, old, width, &model, m, kind, "t").unwrap();
        let mut target = old.to_vec();
        decoded.apply(&mut target, kind);
        prop_assert_eq!(&target, &new, "{:?}", steps);
        prop_assert_eq!(decoded.to_changes(), context::decode_reference(&payload, old, &model, m, kind, "t").unwrap());
    }
    // The whole-chunk entry point picks the smaller mode and still round-trips.
    let c = encode_chunk_with_context(old, new, width, EncodeOptions { kind, zstd_level: 1 }, Some(&model)).unwrap().unwrap();
    let mut target = old.to_vec();
    match c.mode {
        Mode::Context => decode_chunk_context(&c.payload, old, width, &model, c.n_changed, kind, "t").unwrap().apply(&mut target, kind),
        Mode::Free => apply_chunk(&mut target, width, kind, c.encoding, c.n_changed, &c.payload, "t").unwrap(),
    }
    prop_assert_eq!(&target, &new);
    Ok(())
}

proptest! {
    #[test]
    fn context_round_trip_random_words((old, new, width) in chunk_pair(), pick in any::<usize>(), overwrite in any::<bool>()) {
        let dtypes = dtypes_of_width(width);
        let kind = if overwrite { ChangeKind::Overwrite } else { ChangeKind::Xor };
        context_round_trip(&old, &new, dtypes[pick % dtypes.len()], kind)?;
    }

    #[test]
    fn context_round_trip_float_like((old, new, dtype) in float_like_pair(), overwrite in any::<bool>()) {
        let kind = if overwrite { ChangeKind::Overwrite } else { ChangeKind::Xor };
        context_round_trip(&old, &new, dtype, kind)?;
    }

    #[test]
    fn context_corrupted_payload_never_panics((old, new, dtype) in float_like_pair(), flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..4), cut in any::<usize>(), miscount in -2i64..3, tables in any::<bool>()) {
        let width = dtype.word_bytes();
        let model = ContextModel::for_dtype(dtype);
        let found = find_changes(&old, &new, width, ChangeKind::Xor).unwrap();
        if !found.positions.is_empty() {
            let m = found.positions.len() as u32;
            let steps = if tables { context::StepCoding::Tables } else { context::StepCoding::Adaptive };
            let payload = context::encode_with(&old, &new, &found, &model, 1, steps);
            let mut bad = payload.clone();
            for (i, x) in flips {
                let i = i % bad.len();
                bad[i] ^= x | 1;
            }
            let fast = context::decode(&bad, &old, &model, m, ChangeKind::Xor, "t");
            let reference = context::decode_reference(&bad, &old, &model, m, ChangeKind::Xor, "t");
            // Both refuse, or both accept the same changes (a flip can hit
            // bits that no decoder reads, such as the padding of a stream).
            prop_assert_eq!(fast.as_ref().ok(), reference.as_ref().ok());
            let short = &payload[..cut % payload.len()];
            prop_assert!(context::decode(short, &old, &model, m, ChangeKind::Xor, "t").is_err());
            let count = (i64::from(m) + miscount).max(0) as u32;
            if count != m {
                prop_assert!(context::decode(&payload, &old, &model, count, ChangeKind::Xor, "t").is_err());
            }
        }
    }
}

#[test]
fn context_mode_special_patterns_are_exact() {
    // NaN payloads, -0.0/+0.0, subnormals, infinities, the largest finite
    // values and steps across zero, for every float width.
    let f32s: Vec<(u32, u32)> = vec![
        (0x7fc0_0001, 0x7fc0_0002),
        (0x0000_0000, 0x8000_0000),
        (0x8000_0000, 0x0000_0001),
        (0x0000_0001, 0x0000_0003),
        (0x7f80_0000, 0xff80_0000),
        (0x7f7f_ffff, 0x7f80_0000),
        (0xff7f_ffff, 0x7f7f_ffff),
        (0x3f80_0000, 0x3f80_0000),
        (0xffff_ffff, 0x0000_0000),
    ];
    for (dtype, width) in [(DType(safetensors::Dtype::F32), 4), (DType(safetensors::Dtype::BF16), 2), (DType(safetensors::Dtype::F64), 8), (DType(safetensors::Dtype::F8_E4M3), 1)] {
        let to_word = |v: u32| -> Vec<u8> {
            match width {
                4 => v.to_le_bytes().to_vec(),
                2 => ((v >> 16) as u16).to_le_bytes().to_vec(),
                8 => (((u64::from(v) & 0x8000_0000) << 32) | ((u64::from(v) & 0x7fff_ffff) << 29) | u64::from(v & 7)).to_le_bytes().to_vec(),
                _ => vec![(v >> 24) as u8],
            }
        };
        let old: Vec<u8> = f32s.iter().flat_map(|&(a, _)| to_word(a)).collect();
        let new: Vec<u8> = f32s.iter().flat_map(|&(_, b)| to_word(b)).collect();
        for kind in [ChangeKind::Xor, ChangeKind::Overwrite] {
            context_round_trip(&old, &new, dtype, kind).unwrap();
        }
    }
}

/// A diff keeps the changes of many chunks between its passes: the found
/// changes hold about what was found, not the room reserved while scanning.
#[test]
fn found_changes_do_not_hold_the_reserved_room() {
    let old = vec![0u8; 2 << 20];
    let mut new = old.clone();
    for i in (0..new.len()).step_by(4099) {
        new[i] = 1;
    }
    let ch = find_changes(&old, &new, 2, ChangeKind::Xor).unwrap();
    assert_eq!(ch.positions.len(), (2 << 20) / 4099 + 1);
    assert!(ch.positions.capacity() < 2 * ch.positions.len() + 64, "{}", ch.positions.capacity());
    assert!(ch.values.capacity() < 2 * ch.values.len() + 64, "{}", ch.values.capacity());
}

/// The vectorised scans (used when the CPU has AVX2 or AVX-512) and the
/// portable scan find the same changes, for every width, density and ragged
/// tail, and the whole search (scan by stripes, gather) agrees with them.
#[test]
fn vectorised_and_portable_scans_agree() {
    let mut rnd = xorshift(0x2545_F491_4F6C_DD1D);
    for width in [1usize, 2, 4, 8] {
        for words in [0usize, 1, 63, 64, 65, 1000, 4099, 20_000] {
            for per_mille in [0u64, 10, 300, 1000] {
                let old: Vec<u8> = (0..words * width).map(|_| rnd() as u8).collect();
                let mut new = old.clone();
                for i in 0..words {
                    if rnd() % 1000 < per_mille {
                        let b = (rnd() as usize) % width;
                        new[i * width + b] ^= 1 << (rnd() % 8);
                    }
                }
                let want: Vec<u32> = (0..words)
                    .filter(|&i| old[i * width..(i + 1) * width] != new[i * width..(i + 1) * width])
                    .map(|i| i as u32 + 100)
                    .collect();
                for (scanner, got) in every_scanner(&old, &new, width, 100) {
                    assert_eq!(got, want, "{scanner} scan, width {width}, {words} words, {per_mille}/1000");
                }
                for kind in [ChangeKind::Xor, ChangeKind::Overwrite] {
                    let got = find_changes(&old, &new, width, kind).unwrap();
                    let positions: Vec<u32> = want.iter().map(|p| p - 100).collect();
                    assert_eq!(got.positions, positions, "width {width}, {words} words, {per_mille}/1000");
                    for (&p, &v) in got.positions.iter().zip(&got.values) {
                        let (a, b) = (&old[p as usize * width..][..width], &new[p as usize * width..][..width]);
                        let expect = if kind == ChangeKind::Xor { read_word(a) ^ read_word(b) } else { read_word(b) };
                        assert_eq!(v, expect);
                    }
                }
            }
        }
    }
}

/// Each one-pass scan-and-gather kernel this CPU runs (AVX-512 VBMI2,
/// AVX2 with its digest moves by AES-NI and by VAES), called directly (the search runs only the widest): over the
/// stripe's whole blocks, the positions, the value words (whole and as
/// byte planes) and the digest move of a word-by-word compare, for words of
/// 1, 2 and 4 bytes, both kinds, tracked and not, densities that leave
/// blocks empty, partly and wholly changed, and enough changes for several
/// stage flushes with a partial last group.
#[cfg(target_arch = "x86_64")]
#[test]
fn one_pass_kernels_match_a_word_by_word_compare() {
    use super::scan::{scan_gather_avx2, scan_gather_avx512, Planes};
    let mut kernels: Vec<&str> = Vec::new();
    if scan_gather_avx2::available() {
        kernels.push("avx2");
    }
    if scan_gather_avx2::available() && crate::digest::avx2::vaes_available() {
        kernels.push("avx2 vaes");
    }
    if scan_gather_avx512::available() {
        kernels.push("avx512");
    }
    assert!(!kernels.is_empty() || !std::arch::is_x86_feature_detected!("avx2"), "an AVX2 CPU runs the AVX2 kernel");
    let mut next = xorshift(0x51ED_270B_2736_89A7);
    for width in [1usize, 2, 4] {
        for per_mille in [0u64, 5, 300, 1000] {
            let n = 64 * 97 + 21;
            let old: Vec<u8> = (0..n * width).map(|_| next() as u8).collect();
            let mut new = old.clone();
            for i in 0..n {
                if next() % 1000 < per_mille {
                    new[i * width + (next() as usize % width)] ^= 1 << (next() % 8);
                }
            }
            let scanned = n / 64 * 64;
            let base = 7u32;
            for kind in [ChangeKind::Xor, ChangeKind::Overwrite] {
                let mut expected = SparseChanges::default();
                for (i, (a, b)) in old.chunks_exact(width).zip(new.chunks_exact(width)).take(scanned).enumerate() {
                    if a != b {
                        expected.positions.push(base + i as u32);
                        expected.values.push(if kind == ChangeKind::Xor { read_word(a) ^ read_word(b) } else { read_word(b) });
                    }
                }
                for first in [None, Some(1000u64), Some((1 << 32) - n as u64 - 8)] {
                    let want_move = first.map_or(crate::digest::DigestSum::ZERO, |f| {
                        let at = f + u64::from(base);
                        crate::digest::partial_digest(&new[..scanned * width], width, at)
                            .minus(crate::digest::partial_digest(&old[..scanned * width], width, at))
                    });
                    for &kernel in &kernels {
                        let what = format!("{kernel}, width {width}, {per_mille}/1000, {kind:?}, first {first:?}");
                        let overwrite = kind == ChangeKind::Overwrite;
                        let f = first.unwrap_or(0) as u32;
                        let mut positions = vec![1u32, 2];
                        let mut words = vec![9u64, 9];
                        let mut planes = vec![vec![5u8]; width];
                        let mut plane_positions = Vec::new();
                        macro_rules! run {
                            ($k:ident :: $function:ident, $w:literal) => {{
                                // Safety: the CPU has what the kernel needs
                                // (`available`), the width is 1, 2 or 4 and the
                                // unit indices stay below 2^32.
                                #[allow(unsafe_code)]
                                unsafe {
                                    let r = if first.is_some() {
                                        $k::$function::<$w, true>(&old, &new, base, overwrite, f, &mut positions, &mut words)
                                    } else {
                                        $k::$function::<$w, false>(&old, &new, base, overwrite, f, &mut positions, &mut words)
                                    };
                                    let p = if first.is_some() {
                                        $k::$function::<$w, true>(&old, &new, base, overwrite, f, &mut plane_positions, &mut Planes(&mut planes))
                                    } else {
                                        $k::$function::<$w, false>(&old, &new, base, overwrite, f, &mut plane_positions, &mut Planes(&mut planes))
                                    };
                                    (r, p)
                                }
                            }};
                        }
                        let ((count, moved), (plane_count, plane_moved)) = match (kernel, width) {
                            ("avx2", 1) => run!(scan_gather_avx2::scan_and_gather_aesni, 1),
                            ("avx2", 2) => run!(scan_gather_avx2::scan_and_gather_aesni, 2),
                            ("avx2", _) => run!(scan_gather_avx2::scan_and_gather_aesni, 4),
                            ("avx2 vaes", 1) => run!(scan_gather_avx2::scan_and_gather_vaes, 1),
                            ("avx2 vaes", 2) => run!(scan_gather_avx2::scan_and_gather_vaes, 2),
                            ("avx2 vaes", _) => run!(scan_gather_avx2::scan_and_gather_vaes, 4),
                            (_, 1) => run!(scan_gather_avx512::scan_and_gather, 1),
                            (_, 2) => run!(scan_gather_avx512::scan_and_gather, 2),
                            (_, _) => run!(scan_gather_avx512::scan_and_gather, 4),
                        };
                        assert_eq!((count, plane_count), (scanned, scanned), "{what}: words scanned");
                        // What was in the outputs before stays in front.
                        assert_eq!(&positions[..2], &[1, 2], "{what}");
                        assert_eq!(&words[..2], &[9, 9], "{what}");
                        assert_eq!(&positions[2..], &expected.positions[..], "{what}: positions");
                        assert_eq!(&words[2..], &expected.values[..], "{what}: value words");
                        assert_eq!(plane_positions, expected.positions, "{what}: positions (planes)");
                        for (j, plane) in planes.iter().enumerate() {
                            let want: Vec<u8> = std::iter::once(5).chain(expected.values.iter().map(|&v| (v >> (8 * j)) as u8)).collect();
                            assert_eq!(plane, &want, "{what}: plane {j}");
                        }
                        assert_eq!((moved, plane_moved), (want_move, want_move), "{what}: digest move");
                    }
                }
            }
        }
    }
}

/// Gap streams (with escapes, out-of-range ends) decoded by the vector
/// prefix sum and by the portable one: the same positions or the same error.
#[test]
fn gap_streams_escape_every_long_gap_wherever_it_falls() {
    let mut next = xorshift(43);
    for case in 0..300 {
        let m = (next() % 400) as usize;
        // Gaps at and around the escape (254, 255, 256), far ones, runs of
        // escapes, and stretches with none, across the 64-gap blocks.
        let gaps: Vec<u32> = (0..m)
            .map(|i| match next() % 12 {
                0 => 254,
                1 => 255,
                2 => 256,
                3 => 255 + (next() % 70_000) as u32,
                4 if case % 2 == 0 && i % 64 > 60 => 1000,
                _ => (next() % 40) as u32,
            })
            .collect();
        let (bytes, overflow) = super::gap_streams(&gaps);
        let mut expected = Vec::new();
        for &g in gaps.iter().filter(|&&g| g >= 255) {
            streams::put_varint(&mut expected, u64::from(g - 255));
        }
        assert_eq!(bytes, gaps.iter().map(|&g| g.min(255) as u8).collect::<Vec<_>>(), "case {case}");
        assert_eq!(overflow, expected, "case {case}");
        // And back to the positions they came from.
        let positions: Vec<u32> = gaps.iter().scan(-1i64, |p, &g| {
            *p += i64::from(g) + 1;
            Some(*p as u32)
        }).collect();
        let n = positions.last().map_or(0, |&p| p as usize + 1);
        assert_eq!(positions_from_gaps(&bytes, &overflow, n, "t").unwrap(), positions, "case {case}");
    }
}

#[test]
fn vector_and_portable_gap_decoding_agree() {
    let mut next = xorshift(41);
    for case in 0..400 {
        let m = (next() % 300) as usize;
        let gaps: Vec<u8> = (0..m)
            .map(|_| match next() % 10 {
                0 => 254,
                1 if case % 3 == 0 => 255,
                _ => (next() % 40) as u8,
            })
            .collect();
        let escapes = gaps.iter().filter(|&&g| g == 255).count();
        let mut overflow = Vec::new();
        for _ in 0..escapes {
            streams::put_varint(&mut overflow, next() % 5000);
        }
        let span: u64 = gaps.iter().map(|&g| u64::from(g) + 1).sum::<u64>() + 5000 * escapes as u64;
        // Chunk ends around the last position: inside, exactly at it, short of it.
        let n = (span as usize).saturating_sub((next() % 64) as usize) + (next() % 3) as usize;
        let portable = positions_with(&gaps, &overflow, n, "t", prefix_block_portable, prefix_block_portable);
        let dispatched = positions_from_gaps(&gaps, &overflow, n, "t");
        match (&portable, &dispatched) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "case {case}"),
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "case {case}"),
            _ => panic!("case {case}: {portable:?} vs {dispatched:?}"),
        }
        // Both against the format's definition, a gap at a time.
        let mut reference = Ok(Vec::new());
        let (mut next, mut opos) = (0u64, 0usize);
        for &gap in &gaps {
            let gap = match gap {
                255 => match streams::get_varint(&overflow, &mut opos, 5) {
                    Some(more) => 255 + more,
                    None => {
                        reference = Err("ends early".to_string());
                        break;
                    }
                },
                g => u64::from(g),
            };
            if next + gap >= n as u64 {
                reference = Err(format!("position {} outside", next + gap));
                break;
            }
            if let Ok(r) = &mut reference {
                r.push((next + gap) as u32);
            }
            next += gap + 1;
        }
        if reference.is_ok() && opos != overflow.len() {
            reference = Err("unused bytes".to_string());
        }
        match (&reference, &portable) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "case {case}"),
            (Err(a), Err(b)) => assert!(b.to_string().contains(a.as_str()), "case {case}: {a} vs {b}"),
            _ => panic!("case {case}: {reference:?} vs {portable:?}"),
        }
        if let Ok(p) = &portable {
            assert!(p.windows(2).all(|w| w[0] < w[1]) && p.last().is_none_or(|&l| (l as usize) < n));
        }
    }
    // Large starting offsets; whole gaps (escapes replaced) up to 2^32 in
    // all, the chunk ending at, just short of and well short of the
    // block's end; each vector kernel this CPU runs against the portable
    // block.
    type Words = unsafe fn(&[u32; GAP_BLOCK], u64, u64, &mut [u32]) -> Option<u64>;
    type Bytes = unsafe fn(&[u8; GAP_BLOCK], u64, u64, &mut [u32]) -> Option<u64>;
    #[allow(unused_mut)]
    let mut kernels: Vec<(&str, Words, Bytes)> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            kernels.push(("avx512", super::prefix_words_avx512, super::prefix_bytes_avx512));
        }
        if super::avx2_available() {
            kernels.push(("avx2", super::prefix_words_avx2, super::prefix_bytes_avx2));
        }
    }
    for (name, words, bytes_kernel) in kernels {
        for start in [0u64, 1, 70_000, (1 << 31) - 9000] {
            for (at, big, cut) in [(5, 254, 0), (5, 1 << 20, 0), (5, (1 << 31) + 7, 0), (5, 1 << 20, 1), (5, 1 << 20, 1000), (20, 1 << 20, 0), (31, 1 << 20, 0)] {
                let mut g = [254u32; GAP_BLOCK];
                g[at] = big;
                let total: u64 = g.iter().map(|&x| u64::from(x) + 1).sum();
                let n = (start + total).min(1 << 32) - cut;
                let (mut a, mut b) = ([7u32; GAP_BLOCK], [7u32; GAP_BLOCK]);
                // Safety: the kernel's features were detected above.
                #[allow(unsafe_code)]
                let nb = unsafe { words(&g, start, n, &mut b) };
                let na = prefix_block_portable(&g, start, n, &mut a);
                assert_eq!(na, nb, "{name}: start {start} big {big} at {at} cut {cut}");
                assert_eq!(na.is_some(), start + total <= n);
                if na.is_some() {
                    assert_eq!(a, b, "{name}: start {start} big {big} at {at}");
                    assert_eq!(u64::from(a[GAP_BLOCK - 1]) + 1, start + total);
                }
            }
            // Gap bytes: every one the largest without an escape, then
            // irregular ones.
            let irregular: [u8; GAP_BLOCK] = std::array::from_fn(|i| (i * 37 % 251) as u8);
            for bytes in [[254u8; GAP_BLOCK], irregular] {
                let total: u64 = bytes.iter().map(|&x| u64::from(x) + 1).sum();
                for cut in [0, 1] {
                    let n = start + total - cut;
                    let (mut a, mut b) = ([7u32; GAP_BLOCK], [7u32; GAP_BLOCK]);
                    // Safety: the kernel's features were detected above.
                    #[allow(unsafe_code)]
                    let nb = unsafe { bytes_kernel(&bytes, start, n, &mut b) };
                    assert_eq!(prefix_block_portable(&bytes, start, n, &mut a), nb, "{name}: start {start} cut {cut}");
                    assert_eq!(nb.is_some(), cut == 0);
                    if nb.is_some() {
                        assert_eq!(a, b, "{name}: start {start}");
                    }
                }
            }
        }
    }
}

#[test]
fn huffman_bits_of_known_codes() {
    assert_eq!(super::huffman_bits(&[]), 0);
    assert_eq!(super::huffman_bits(&[7]), 0);
    // Codes of 3, 3, 2 and 1 bits.
    assert_eq!(super::huffman_bits(&[1, 1, 2, 4]), 14);
    assert_eq!(super::huffman_bits(&[5, 5, 5, 5]), 40);
}

/// Uniformly scattered changes (geometric gaps) are Rice-coded; gaps that
/// repeat a short pattern go to the gap bytes, which zstd codes in almost
/// nothing, and which the estimate says to try.
#[test]
fn geometric_gaps_pick_rice_and_repeating_gaps_pick_gap_bytes() {
    let n = 1 << 17;
    let mut next = xorshift(0x0dd_ba11);
    let scattered: Vec<u32> = (0..n as u32).filter(|_| next().is_multiple_of(33)).collect();
    let repeating: Vec<u32> = (0..n as u32).filter(|i| matches!(i % 16, 3 | 13)).collect();
    for (positions, expected) in [(scattered, Encoding::Rice), (repeating, Encoding::Sparse)] {
        let gaps = super::position_gaps(&positions);
        let span = u64::from(*positions.last().unwrap()) + 1;
        let (k, bits) = super::rice::best_rice_parameter(&gaps, span, gaps.len() as u64);
        let rice_len = super::rice_positions(&gaps, k, bits).len();
        if expected == Encoding::Sparse {
            assert!(super::gap_bytes_could_beat(&gaps, rice_len));
        }
        let old = vec![0u8; n];
        let mut new = old.clone();
        for &p in &positions {
            new[p as usize] = 1;
        }
        let c = encode_chunk(&old, &new, 1, EncodeOptions::default()).unwrap().unwrap();
        assert_eq!(c.encoding, expected);
        let mut t = old.clone();
        apply_chunk(&mut t, 1, ChangeKind::Xor, c.encoding, c.n_changed, &c.payload, "t").unwrap();
        assert_eq!(t, new);
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn ahead_covers_its_bytes_over_its_steps_within_its_cap() {
    let bytes = vec![0u8; 100_000];
    let lines = bytes.len().div_ceil(64);
    for steps in [1usize, 7, 64, 1000, 5000] {
        let mut ahead = Ahead::new(&bytes, steps);
        let per_step = lines.div_ceil(steps).min(Ahead::MAX_LINES_PER_STEP);
        assert_eq!(ahead.lines_per_step, per_step, "{steps} steps");
        let mut taken = 0;
        for _ in 0..steps {
            let before = ahead.next;
            ahead.step();
            taken += (ahead.next as usize - before as usize) / 64;
        }
        // Every line is fetched where the cap allows; never more than the
        // bytes' lines plus one step's rounding.
        if lines.div_ceil(steps) <= Ahead::MAX_LINES_PER_STEP {
            assert!(ahead.next >= ahead.end && taken >= lines, "{steps} steps: {taken} of {lines} lines");
        } else {
            assert_eq!(taken, steps * per_step, "{steps} steps");
        }
        assert!(taken < lines + per_step, "{steps} steps: {taken} lines for {lines}");
    }
    // No steps or no bytes: nothing to fetch.
    let mut none = Ahead::new(&bytes, 0);
    none.step();
    assert_eq!(none.next, bytes.as_ptr());
    let mut empty = Ahead::new(&[], 10);
    empty.step();
    assert_eq!(empty.lines_per_step, 0);
}
