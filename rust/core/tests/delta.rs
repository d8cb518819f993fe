use dcr_core::checkpoint::{Layout, TensorSpec};
use dcr_core::codec::{ChangeKind, Mode};
use dcr_core::delta::{apply, diff, diff_from_announced, read_delta, read_header, ApplyOutcome, DiffOptions};
use dcr_core::dtype::DType;
use dcr_core::Error;
use proptest::prelude::*;

mod common;
use common::xorshift;

#[derive(Debug)]
struct Pair {
    layout: Layout,
    old: Vec<Vec<u8>>,
    new: Vec<Vec<u8>>,
}

fn pair() -> impl Strategy<Value = Pair> {
    let tensor = (prop::sample::select(DType::all().collect::<Vec<_>>()), prop::collection::vec(1u64..40, 0..3), 0.0f64..0.3);
    (prop::collection::vec(tensor, 1..6), any::<u64>()).prop_map(|(ts, seed)| {
        let mut next = xorshift(seed);
        let specs: Vec<TensorSpec> = ts
            .iter()
            .enumerate()
            .map(|(i, (d, shape, _))| TensorSpec { name: format!("t{i}"), dtype: *d, shape: shape.clone() })
            .collect();
        let mut old = Vec::new();
        let mut new = Vec::new();
        for (spec, (_, _, density)) in specs.iter().zip(&ts) {
            let n = spec.storage_bytes().unwrap() as usize;
            let o: Vec<u8> = (0..n).map(|_| next() as u8).collect();
            let mut w = o.clone();
            for b in w.iter_mut() {
                if (next() % 1000) as f64 / 1000.0 < *density {
                    *b ^= (next() as u8) | 1;
                }
            }
            old.push(o);
            new.push(w);
        }
        Pair { layout: Layout::new(specs).unwrap(), old, new }
    })
}

fn encode(p: &Pair, opts: &DiffOptions) -> Vec<u8> {
    let mut out = Vec::new();
    let old: Vec<&[u8]> = p.old.iter().map(|v| v.as_slice()).collect();
    let new: Vec<&[u8]> = p.new.iter().map(|v| v.as_slice()).collect();
    diff(&p.layout, &old, &new, opts, &mut |b| { out.extend_from_slice(b); Ok(()) }, &mut |_, _| {}).unwrap();
    out
}

fn apply_to(bytes: &[u8], layout: &Layout, target: &mut [Vec<u8>]) -> dcr_core::Result<ApplyOutcome> {
    let delta = read_delta(bytes)?;
    let mut views: Vec<&mut [u8]> = target.iter_mut().map(|v| v.as_mut_slice()).collect();
    apply(&delta, layout, &mut views)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn apply_of_diff_reproduces_new(p in pair(), chunk in prop::sample::select(vec![1u32, 7, 64, 4096]), overwrite in any::<bool>(), context in any::<bool>()) {
        let kind = if overwrite { ChangeKind::Overwrite } else { ChangeKind::Xor };
        let mode = if context { Mode::Context } else { Mode::Free };
        let bytes = encode(&p, &DiffOptions { chunk_bytes: chunk, kind, mode, ..Default::default() });
        let mut target = p.old.clone();
        let out = apply_to(&bytes, &p.layout, &mut target).unwrap();
        prop_assert_eq!(&target, &p.new);
        if p.old == p.new {
            prop_assert_eq!(out, ApplyOutcome::AlreadyAtTarget);
        }
        // A second apply is a no-op.
        prop_assert_eq!(apply_to(&bytes, &p.layout, &mut target).unwrap(), ApplyOutcome::AlreadyAtTarget);
        prop_assert_eq!(&target, &p.new);
    }

    #[test]
    fn the_bytes_kept_between_the_passes_change_nothing_in_the_delta(p in pair(), keep in prop::sample::select(vec![0usize, 100, 3000]), context in any::<bool>()) {
        let mode = if context { Mode::Context } else { Mode::Free };
        let all = encode(&p, &DiffOptions { chunk_bytes: 64, mode, ..Default::default() });
        let old: Vec<&[u8]> = p.old.iter().map(|v| v.as_slice()).collect();
        let new: Vec<&[u8]> = p.new.iter().map(|v| v.as_slice()).collect();
        let (some, mut seen) = (std::cell::RefCell::new(Vec::new()), Vec::new());
        let opts = DiffOptions { chunk_bytes: 64, mode, keep_bytes: keep, ..Default::default() };
        // The length, where announced, comes before the first byte and is the delta's.
        let mut announced = None;
        diff_from_announced(&p.layout, &old, &new, None, &opts, &mut |len| {
            assert!(some.borrow().is_empty() && announced.is_none());
            announced = Some(len);
            Ok(())
        }, &mut |b| { some.borrow_mut().extend_from_slice(b); Ok(()) }, &mut |done, total| seen.push((done, total))).unwrap();
        let some = some.into_inner();
        prop_assert_eq!(&some, &all);
        prop_assert!(announced.is_none_or(|len| len == all.len() as u64));
        // Every chunk is kept between the passes by default, so the length is known.
        let mut by_default = None;
        diff_from_announced(&p.layout, &old, &new, None, &DiffOptions { chunk_bytes: 64, mode, ..Default::default() }, &mut |len| { by_default = Some(len); Ok(()) }, &mut |_| Ok(()), &mut |_, _| {}).unwrap();
        prop_assert_eq!(by_default, Some(all.len() as u64));
        // Progress only moves forward and ends at the checkpoint's bytes.
        let total = p.layout.total_bytes();
        prop_assert!(seen.windows(2).all(|w| w[0].0 <= w[1].0));
        prop_assert!(seen.iter().all(|&(d, t)| t == total && d <= total));
        prop_assert_eq!(seen.last().map(|s| s.0), Some(total));
    }

    #[test]
    fn mutated_or_truncated_delta_never_applies_wrong_bits(p in pair(), pos in any::<usize>(), x in 1u8..=255, cut in any::<usize>(), context in any::<bool>()) {
        let mode = if context { Mode::Context } else { Mode::Free };
        let bytes = encode(&p, &DiffOptions { chunk_bytes: 64, mode, ..Default::default() });
        let mut bad = bytes.clone();
        let i = pos % bad.len();
        bad[i] ^= x;
        let mut target = p.old.clone();
        match apply_to(&bad, &p.layout, &mut target) {
            Ok(_) => prop_assert_eq!(&target, &p.new),
            Err(_) => prop_assert_eq!(&target, &p.old),
        }
        let short = &bytes[..cut % bytes.len()];
        let mut target = p.old.clone();
        prop_assert!(apply_to(short, &p.layout, &mut target).is_err());
        prop_assert_eq!(&target, &p.old);
    }
}

/// One bf16 tensor of 64 elements, all bytes 1, one byte changed.
fn one_change() -> Pair {
    let specs = vec![TensorSpec { name: "w".into(), dtype: DType::from_name("BF16").unwrap(), shape: vec![64] }];
    let old = vec![vec![1u8; 128]];
    let mut new = old.clone();
    new[0][10] = 7;
    Pair { layout: Layout::new(specs).unwrap(), old, new }
}

#[test]
fn wrong_base_is_refused_before_any_write() {
    let p = one_change();
    let layout = p.layout.clone();
    let bytes = encode(&p, &DiffOptions::default());
    let mut other = vec![vec![2u8; 128]];
    let err = apply_to(&bytes, &layout, &mut other).unwrap_err();
    assert!(matches!(err, Error::BaseMismatch { .. }), "{err}");
    assert!(err.to_string().contains("dense refit"), "{err}");
    assert_eq!(other, vec![vec![2u8; 128]]);
}

#[test]
fn chunk_spliced_from_another_delta_is_refused() {
    let specs = vec![TensorSpec { name: "w".into(), dtype: DType::from_name("F32").unwrap(), shape: vec![256] }];
    let layout = Layout::new(specs).unwrap();
    let old = vec![vec![0u8; 1024]];
    let mut a = old.clone();
    a[0][0] = 1;
    let mut b = old.clone();
    b[0][0] = 2;
    let da = encode(&Pair { layout: layout.clone(), old: old.clone(), new: a }, &DiffOptions::default());
    let db = encode(&Pair { layout: layout.clone(), old: old.clone(), new: b }, &DiffOptions::default());
    // Same structure, so the chunk frames sit at the same offsets: splice b's chunk into a.
    let ha = dcr_core::format::PREAMBLE_LEN + header_len(&da);
    let ca = frame_len(&da[ha..]);
    let cb = frame_len(&db[ha..]);
    let mut spliced = da[..ha].to_vec();
    spliced.extend_from_slice(&db[ha..ha + cb]);
    spliced.extend_from_slice(&da[ha + ca..]);
    let err = read_delta(&spliced).unwrap_err();
    assert!(matches!(err, Error::ForeignFrame { .. }), "{err}");
}

/// Two tensors, "a" (3000 bf16) and "b" (700 f32), several chunks each
/// at small chunk sizes.
fn bf16_and_f32_layout() -> Layout {
    Layout::new(vec![
        TensorSpec { name: "a".into(), dtype: DType::from_name("BF16").unwrap(), shape: vec![3000] },
        TensorSpec { name: "b".into(), dtype: DType::from_name("F32").unwrap(), shape: vec![700] },
    ])
    .unwrap()
}

/// A chunk that passes its checksum but does not decode (its payload cut
/// short after the checks, as a bug in an encoder could make it) fails the
/// apply after other chunks were written: those are undone, every bit of
/// the target is the base's again, and the error names the chunk. For both
/// change kinds and both modes (each undone its own way).
#[test]
fn a_chunk_that_does_not_decode_leaves_the_base_after_others_were_written() {
    let layout = bf16_and_f32_layout();
    let mut next = xorshift(0x5eed_0000_1234_5678);
    // Weights of a trained layer (small floats) moved by one to three ulps
    // at every seventh element, which the context mode codes in context.
    let mut weight = || ((next() % 2000) as f32 / 20000.0 - 0.05).to_bits();
    let a: Vec<u16> = (0..3000).map(|_| (weight() >> 16) as u16).collect();
    let b: Vec<u32> = (0..700).map(|_| weight()).collect();
    let step = |k: usize| if k.is_multiple_of(7) { 1 + (k % 3) as u16 } else { 0 };
    let old = vec![a.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(), b.iter().flat_map(|x| x.to_le_bytes()).collect()];
    let new = vec![
        a.iter().enumerate().flat_map(|(k, x)| x.wrapping_add(step(k)).to_le_bytes()).collect::<Vec<u8>>(),
        b.iter().enumerate().flat_map(|(k, x)| x.wrapping_add(u32::from(step(k))).to_le_bytes()).collect(),
    ];
    let p = Pair { layout: layout.clone(), old: old.clone(), new };
    for kind in [ChangeKind::Xor, ChangeKind::Overwrite] {
        for mode in [Mode::Free, Mode::Context] {
            let bytes = encode(&p, &DiffOptions { chunk_bytes: 1024, kind, mode, ..Default::default() });
            let mut delta = read_delta(&bytes).unwrap();
            assert!(delta.chunks.len() > 4, "{kind:?} {mode:?}: {} chunks", delta.chunks.len());
            assert!(delta.chunks.iter().all(|c| c.n_changed > 0), "{kind:?} {mode:?}: a chunk without changes");
            if mode == Mode::Context && kind == ChangeKind::Xor {
                assert!(delta.chunks.iter().any(|c| c.mode == Mode::Context), "no chunk coded in context");
            }
            // The last chunk of the last tensor: every other chunk is
            // written before it on one thread, and alongside it on more.
            let last = delta.chunks.iter().enumerate().max_by_key(|(_, c)| (c.tensor, c.start)).unwrap().0;
            let seq = delta.chunks[last].seq;
            delta.chunks[last].payload = &delta.chunks[last].payload[..1];
            let mut target = old.clone();
            let mut views: Vec<&mut [u8]> = target.iter_mut().map(|v| v.as_mut_slice()).collect();
            let err = apply(&delta, &layout, &mut views).unwrap_err();
            assert!(err.to_string().contains(&format!("chunk {seq}")), "{kind:?} {mode:?}: {err}");
            assert!(target == old, "{kind:?} {mode:?}: the target is not its base after the failed apply");
            // The same delta without the cut applies.
            let mut target = old.clone();
            assert!(apply_to(&bytes, &layout, &mut target).is_ok());
            assert!(target == p.new, "{kind:?} {mode:?}");
        }
    }
}

fn frame_len(b: &[u8]) -> usize {
    9 + u32::from_le_bytes(b[1..5].try_into().unwrap()) as usize
}
fn header_len(b: &[u8]) -> usize {
    frame_len(&b[dcr_core::format::PREAMBLE_LEN..])
}

#[test]
fn read_header_checks_the_header_frame_only() {
    let bytes = encode(&one_change(), &DiffOptions::default());
    let whole = read_delta(&bytes).unwrap().header;
    assert_eq!(read_header(&bytes).unwrap(), whole);
    // A corrupt chunk is left for the decode to refuse; the header still reads.
    let h = dcr_core::format::PREAMBLE_LEN + header_len(&bytes);
    let mut bad_chunk = bytes.clone();
    bad_chunk[h + 12] ^= 0x40;
    assert!(read_delta(&bad_chunk).is_err());
    assert_eq!(read_header(&bad_chunk).unwrap(), whole);
    // A corrupt or cut header is refused.
    let mut bad_header = bytes.clone();
    bad_header[dcr_core::format::PREAMBLE_LEN + 12] ^= 0x40;
    assert!(matches!(read_header(&bad_header).unwrap_err(), Error::Checksum { .. }));
    assert!(read_header(&bytes[..h - 1]).is_err());
}

#[test]
fn oversized_frame_length_is_refused_without_allocating() {
    let mut bytes = dcr_core::format::preamble().to_vec();
    bytes.push(b'H');
    bytes.extend_from_slice(&u32::MAX.to_le_bytes());
    let err = read_delta(&bytes).unwrap_err();
    assert!(matches!(err, Error::TooLarge { .. }), "{err}");
}

#[test]
fn unknown_version_is_named() {
    // Version 8 (the digests before AES rounds) and a future version.
    for version in [8u8, 10] {
        let mut bytes = dcr_core::format::preamble().to_vec();
        bytes[8] = version;
        let err = read_delta(&bytes).unwrap_err();
        assert!(err.to_string().contains(&format!("version {version} is not supported")), "{err}");
    }
}

#[test]
fn context_mode_refuses_a_base_that_differs_in_one_bit() {
    let specs = vec![TensorSpec { name: "w".into(), dtype: DType::from_name("BF16").unwrap(), shape: vec![4096] }];
    let layout = Layout::new(specs).unwrap();
    // bf16 words spread over several exponents; only one exponent's elements
    // move (by one ulp): the context mode captures exactly that.
    let words: Vec<u16> = (0..4096u32).map(|i| 0x3a00 + ((i.wrapping_mul(2654435761) >> 7) % 0x0600) as u16).collect();
    let old: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let new: Vec<u8> = words
        .iter()
        .enumerate()
        .map(|(i, &w)| if (w >> 7) == (0x3c00 >> 7) && i % 3 == 0 { w + 1 } else { w })
        .flat_map(|w| w.to_le_bytes())
        .collect();
    let p = Pair { layout: layout.clone(), old: vec![old.clone()], new: vec![new.clone()] };
    let bytes = encode(&p, &DiffOptions { mode: Mode::Context, ..Default::default() });
    let delta = read_delta(&bytes).unwrap();
    assert!(delta.chunks.iter().any(|c| c.mode == Mode::Context), "the context mode is chosen here");
    let mut other = vec![old.clone()];
    other[0][1001] ^= 0x80;
    let before = other.clone();
    let err = apply_to(&bytes, &layout, &mut other).unwrap_err();
    assert!(matches!(err, Error::BaseMismatch { .. }), "{err}");
    assert_eq!(other, before);
    let mut ok = vec![old];
    apply_to(&bytes, &layout, &mut ok).unwrap();
    assert_eq!(ok, vec![new]);
}

#[test]
fn stream_applier_applies_frame_by_frame_and_rolls_back() {
    use dcr_core::delta::{split_frames, StreamApplier};
    let specs = vec![
        TensorSpec { name: "a".into(), dtype: DType::from_name("BF16").unwrap(), shape: vec![3000] },
        TensorSpec { name: "b".into(), dtype: DType::from_name("F32").unwrap(), shape: vec![500] },
    ];
    let layout = Layout::new(specs).unwrap();
    let old = vec![vec![7u8; 6000], vec![1u8; 2000]];
    let mut new = old.clone();
    for i in (0..6000).step_by(37) {
        new[0][i] ^= 3;
    }
    new[1][100] = 9;
    let p = Pair { layout: layout.clone(), old: old.clone(), new: new.clone() };
    let bytes = encode(&p, &DiffOptions { chunk_bytes: 512, ..Default::default() });
    let (header, chunks, trailer) = split_frames(&bytes).unwrap();
    assert!(chunks.len() > 3);
    // Streamed in order: exact.
    let mut t = old.clone();
    {
        let views: Vec<&mut [u8]> = t.iter_mut().map(|v| v.as_mut_slice()).collect();
        let mut s = StreamApplier::begin(header, &layout, views).unwrap().unwrap();
        for c in &chunks {
            s.chunk(c).unwrap();
        }
        assert!(matches!(s.chunk(chunks[0]).unwrap_err(), Error::DuplicateChunk { .. }));
        // Blobs of the wrong kind, with bytes after the frame, or cut short:
        // refused by what they are, nothing applied.
        let refusal = |s: &mut StreamApplier, blob: &[u8]| s.chunk(blob).unwrap_err().to_string();
        let e = refusal(&mut s, trailer);
        assert!(e.contains("the trailer where a chunk frame was expected"), "{e}");
        let e = refusal(&mut s, &[chunks[1], &[0]].concat());
        assert!(e.contains("1 bytes after the frame"), "{e}");
        let e = refusal(&mut s, &chunks[1][..chunks[1].len() - 1]);
        assert!(e.contains("chunk frame is cut short"), "{e}");
        let e = dcr_core::delta::parse_header_blob(&[&header[..dcr_core::format::PREAMBLE_LEN], chunks[1]].concat()).unwrap_err().to_string();
        assert!(e.contains("chunk 1 where the header was expected"), "{e}");
        s.finish(trailer).unwrap();
    }
    assert_eq!(t, new);
    // A missing chunk: the trailer's count refuses it and the base comes back.
    let mut t = old.clone();
    {
        let views: Vec<&mut [u8]> = t.iter_mut().map(|v| v.as_mut_slice()).collect();
        let mut s = StreamApplier::begin(header, &layout, views).unwrap().unwrap();
        for c in &chunks[1..] {
            s.chunk(c).unwrap();
        }
        assert!(matches!(s.finish(trailer).unwrap_err(), Error::Incomplete { .. }));
    }
    assert_eq!(t, old);
    // A chunk handed over as the trailer: refused, and the base comes back.
    let mut t = old.clone();
    {
        let views: Vec<&mut [u8]> = t.iter_mut().map(|v| v.as_mut_slice()).collect();
        let mut s = StreamApplier::begin(header, &layout, views).unwrap().unwrap();
        s.chunk(chunks[0]).unwrap();
        let e = s.finish(chunks[1]).unwrap_err().to_string();
        assert!(e.contains("chunk 1 where the trailer was expected"), "{e}");
    }
    assert_eq!(t, old);
    // Already at the target: nothing to do.
    let mut t = new.clone();
    let views: Vec<&mut [u8]> = t.iter_mut().map(|v| v.as_mut_slice()).collect();
    assert!(StreamApplier::begin(header, &layout, views).unwrap().is_none());
}

/// A delta cut into its preamble and frames, to be put back together in
/// another order (frames as written, checksums intact).
fn frames_of(bytes: &[u8]) -> (Vec<u8>, Vec<Vec<u8>>) {
    let mut pos = dcr_core::format::PREAMBLE_LEN;
    let mut frames = Vec::new();
    while pos < bytes.len() {
        let len = frame_len(&bytes[pos..]);
        frames.push(bytes[pos..pos + len].to_vec());
        pos += len;
    }
    (bytes[..dcr_core::format::PREAMBLE_LEN].to_vec(), frames)
}

fn joined(preamble: &[u8], frames: &[Vec<u8>]) -> Vec<u8> {
    let mut out = preamble.to_vec();
    frames.iter().for_each(|f| out.extend_from_slice(f));
    out
}

/// Frames that each pass their checksum, put together wrongly (a chunk
/// replayed, reordered or lost, a frame from another delta, a trailer
/// re-framed with other digests, the stream cut), are each refused with
/// the error that names what was expected and what was found, and the
/// target is left as it was; the frames in their order still apply.
#[test]
fn frames_put_together_wrongly_are_refused_by_name() {
    use dcr_core::format::{parse_frame, Frame};
    let layout = bf16_and_f32_layout();
    let mut next = xorshift(0xf4a3_e5d1_0b2c_9987);
    let old: Vec<Vec<u8>> = [6000usize, 2800].iter().map(|&n| (0..n).map(|_| next() as u8).collect()).collect();
    let moved = |every: usize| -> Vec<Vec<u8>> {
        old.iter().map(|t| t.iter().enumerate().map(|(i, &b)| if i % every == 0 { b ^ 0x11 } else { b }).collect()).collect()
    };
    let opts = DiffOptions { chunk_bytes: 1024, ..Default::default() };
    let p = Pair { layout: layout.clone(), old: old.clone(), new: moved(7) };
    let bytes = encode(&p, &opts);
    let other = encode(&Pair { layout: layout.clone(), old: old.clone(), new: moved(5) }, &opts);
    let (preamble, frames) = frames_of(&bytes);
    let (_, other_frames) = frames_of(&other);
    let n_chunks = frames.len() - 2;
    assert_eq!(n_chunks, 9, "chunks of 1024 bytes: 6 of a, 3 of b");
    let (header, chunks, trailer) = (&frames[0], &frames[1..=n_chunks], &frames[n_chunks + 1]);
    let with = |parts: &[&[Vec<u8>]]| -> Vec<u8> { joined(&preamble, &parts.concat()) };
    let reframed_trailer = |edit: &dyn Fn(&mut dcr_core::format::Trailer)| -> Vec<u8> {
        let Some((Frame::Trailer(mut t), _)) = parse_frame(trailer).unwrap() else { panic!("the last frame is the trailer") };
        edit(&mut t);
        t.to_frame()
    };
    let reframed_chunk = |i: usize, edit: &dyn Fn(&mut dcr_core::format::ChunkFrame)| -> Vec<u8> {
        let Some((Frame::Chunk(mut c), _)) = parse_frame(&chunks[i]).unwrap() else { panic!("frame {i} is a chunk") };
        edit(&mut c);
        c.to_frame()
    };
    let swapped = {
        let mut c = chunks.to_vec();
        c.swap(0, 1);
        c
    };
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("a chunk replayed", with(&[&frames[..3], &frames[2..]]), "chunk 1 was already applied"),
        ("two chunks swapped", with(&[&frames[..1], &swapped, &frames[n_chunks + 1..]]), "chunk seq 1 where 0 was expected"),
        ("a chunk lost", with(&[&frames[..2], &frames[3..]]), "chunk seq 2 where 1 was expected"),
        ("the last chunk lost", with(&[&frames[..n_chunks], &frames[n_chunks + 1..]]), "the trailer counts 9 chunks, 8 arrived"),
        ("no trailer", with(&[&frames[..n_chunks + 1]]), "no trailer after 9 chunks"),
        ("cut inside a frame", bytes[..bytes.len() - trailer.len() - 3].to_vec(), "ends inside a chunk frame"),
        ("no header", with(&[chunks, std::slice::from_ref(trailer)]), "the first frame is chunk 0, not the header"),
        ("a second header", with(&[&frames[..3], std::slice::from_ref(header), &frames[3..]]), "a second header frame"),
        ("the trailer twice", with(&[&frames, std::slice::from_ref(trailer)]), "bytes after the trailer"),
        ("another delta's chunk", with(&[&frames[..4], &other_frames[4..5], &frames[5..]]), "chunk 3 belongs to delta"),
        ("another delta's trailer", with(&[&frames[..n_chunks + 1], &other_frames[other_frames.len() - 1..]]), "the trailer belongs to delta"),
        (
            "a tensor digest changed",
            with(&[&frames[..n_chunks + 1], &[reframed_trailer(&|t| t.tensor_digests[1][0] ^= 1)]]),
            "not to the header's target digest",
        ),
        (
            "a tensor digest left out",
            with(&[&frames[..n_chunks + 1], &[reframed_trailer(&|t| { t.tensor_digests.pop(); })]]),
            "1 tensor digests where the tensor table has 2 tensors",
        ),
        (
            "a chunk moved off the grid",
            with(&[&frames[..2], &[reframed_chunk(1, &|c| c.start += 1)], &frames[3..]]),
            "range 513+512 is off the chunk grid of tensor a",
        ),
        (
            "a chunk of a tensor the delta lacks",
            with(&[&frames[..2], &[reframed_chunk(1, &|c| c.tensor = 2)], &frames[3..]]),
            "tensor index 2 but the delta has 2 tensors",
        ),
        ("not a delta", b"PK\x03\x04 a zip file, not a delta".to_vec(), "not a dcr delta"),
        ("an unknown frame tag", with(&[&frames[..1], &[vec![b'Z', 0, 0, 0, 0, 0, 0, 0, 0]], &frames[1..]]), "unknown frame tag code 90"),
    ];
    for (what, bad, expected) in cases {
        let mut target = old.clone();
        let err = apply_to(&bad, &layout, &mut target).err().unwrap_or_else(|| panic!("{what}: applied"));
        assert!(err.to_string().contains(expected), "{what}: {err}");
        assert!(target == old, "{what}: the target changed");
    }
    // The header alone is read the same way (a receiver reads it first).
    let err = read_header(&with(&[chunks, std::slice::from_ref(trailer)])).unwrap_err();
    assert!(err.to_string().contains("the first frame is chunk 0, not the header"), "{err}");
    let mut target = old.clone();
    apply_to(&joined(&preamble, &frames), &layout, &mut target).unwrap();
    assert!(target == p.new);
}

/// `read_delta` leaves each chunk payload where it lies in the bytes it
/// parsed (no second copy of a delta held in memory), and those frames are
/// the ones a stream parser hands on owned; `read_delta_file` likewise keeps
/// them in the one buffer it read.
#[test]
fn a_parsed_delta_borrows_its_payloads_from_the_bytes() {
    use dcr_core::format::{parse_frame, Frame};
    let layout = bf16_and_f32_layout();
    let old: Vec<Vec<u8>> = layout.tensors().iter().map(|t| vec![3u8; t.storage_bytes().unwrap() as usize]).collect();
    let new: Vec<Vec<u8>> = old.iter().map(|o| o.iter().enumerate().map(|(i, &b)| if i % 7 == 0 { b ^ 0x41 } else { b }).collect()).collect();
    let p = Pair { layout, old, new };
    let bytes = encode(&p, &DiffOptions { chunk_bytes: 256, ..Default::default() });
    let delta = read_delta(&bytes).unwrap();
    assert!(delta.chunks.len() > 2, "{} chunks", delta.chunks.len());
    let within = bytes.as_ptr_range();
    for c in &delta.chunks {
        let range = c.payload.as_ptr_range();
        assert!(within.start <= range.start && range.end <= within.end, "chunk {}'s payload is not in the parsed bytes", c.seq);
    }
    let (_, frames) = frames_of(&bytes);
    let streamed: Vec<_> = frames[1..frames.len() - 1]
        .iter()
        .map(|f| match parse_frame(f).unwrap() {
            Some((Frame::Chunk(c), _)) => c,
            other => panic!("a chunk frame, got {other:?}"),
        })
        .collect();
    assert_eq!(delta.clone().into_owned().chunks, streamed);

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.dcr");
    std::fs::write(&path, &bytes).unwrap();
    let (from_file, len) = dcr_core::files::read_delta_file(&path).unwrap();
    assert_eq!(len, bytes.len() as u64);
    assert_eq!(from_file.chunks.iter().map(|c| c.borrowed()).collect::<Vec<_>>(), delta.chunks);
    // One buffer: each payload starts where the file puts it, the frame
    // around it (checksum, tag, length, fields) after the one before.
    for pair in from_file.chunks.windows(2) {
        let gap = pair[1].payload.as_ptr() as usize - pair[0].payload.as_ptr_range().end as usize;
        assert_eq!(gap, pair[1].frame_len() - pair[1].payload.len(), "chunk {} is not beside chunk {}", pair[1].seq, pair[0].seq);
    }
}
