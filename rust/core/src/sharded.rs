//! One delta from the changes of many trainer ranks.
//!
//! Each rank scans only its own shard and projects its changed positions
//! into canonical coordinates (an affine map per contiguous block of the
//! shard, see `dcr.trainer.layouts`). The pieces here let the ranks compose
//! the very delta a single process would build from the gathered
//! checkpoint, byte for byte:
//!
//! - digests: a rank digests its own blocks ([`block_digest`]) and moves
//!   digests by its own changes ([`DigestMoves`]); the sums of all ranks are
//!   the gathered tensor's digests;
//! - chunks: the changes of one canonical chunk, collected from every rank by
//!   the chunk's owner, encode to the same frame as in [`crate::delta::diff`]
//!   ([`chunk_frame`]);
//! - header and trailer from the summed digests ([`header_blob`],
//!   [`trailer_frame`]).
//!
//! The XOR kind is composed. The context mode reads the base values of the
//! whole chunk: a rank that holds a chunk's whole canonical range encodes it
//! from its own baseline ([`context_chunk_frame`], the frame the single
//! process would build); a chunk spread over ranks stays context-free.

use crate::checkpoint::{Digest, Layout};
use crate::codec::{self, ChangeKind, EncodeOptions, Mode, SparseChanges};
use crate::delta::{make_header, DiffOptions};
use crate::digest::{partial_digest, DigestMoves, DigestSum};
use crate::error::{Error, Result};
use crate::format::{self, ChunkFrame, DeltaHeader, Trailer};

/// A block of a rank's local tensor, read row-major with `shape` from element
/// `local_offset`, placed at canonical element
/// `canonical_offset + sum(u[d] * canonical_strides[d])`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AffineBlock {
    pub local_offset: u64,
    pub shape: Vec<u64>,
    pub canonical_offset: u64,
    pub canonical_strides: Vec<u64>,
}

impl AffineBlock {
    fn numel(&self) -> Result<u64> {
        self.shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::Invalid(format!("block shape {:?} overflows", self.shape)))
    }
}

/// The digest contribution of one block of a local tensor (`local`: the
/// whole local tensor's bytes, words of `word_bytes`).
pub fn block_digest(local: &[u8], word_bytes: usize, block: &AffineBlock) -> Result<DigestSum> {
    let rank = block.shape.len();
    if block.canonical_strides.len() != rank {
        return Err(Error::Invalid(format!("block has shape {:?} but strides {:?}", block.shape, block.canonical_strides)));
    }
    let n = block.numel()?;
    let end = block.local_offset.checked_add(n).filter(|&e| e * word_bytes as u64 <= local.len() as u64).ok_or_else(|| {
        Error::Invalid(format!(
            "block of {n} elements at {} runs past a local tensor of {} elements",
            block.local_offset,
            local.len() / word_bytes
        ))
    })?;
    let words = &local[block.local_offset as usize * word_bytes..end as usize * word_bytes];
    if n == 0 {
        return Ok(DigestSum::ZERO);
    }
    if rank == 0 {
        return Ok(partial_digest(words, word_bytes, block.canonical_offset));
    }
    // Rows along the last dimension: contiguous canonical runs when its
    // stride is 1, else element by element.
    let row = block.shape[rank - 1] as usize;
    let inner_stride = block.canonical_strides[rank - 1];
    let mut sum = DigestSum::ZERO;
    let mut index = vec![0u64; rank.saturating_sub(1)];
    for r in 0..(n as usize / row) {
        let start = block.canonical_offset + index.iter().zip(&block.canonical_strides).map(|(i, s)| i * s).sum::<u64>();
        let bytes = &words[r * row * word_bytes..(r + 1) * row * word_bytes];
        if inner_stride == 1 {
            sum = sum.plus(partial_digest(bytes, word_bytes, start));
        } else {
            for (k, w) in bytes.chunks_exact(word_bytes).enumerate() {
                let mut b = [0u8; 8];
                b[..word_bytes].copy_from_slice(w);
                sum.add_word(word_bytes, start + k as u64 * inner_stride, u64::from_le_bytes(b));
            }
        }
        for d in (0..index.len()).rev() {
            index[d] += 1;
            if index[d] < block.shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
    Ok(sum)
}

/// A block of a local tensor and the canonical tensor it lands in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub tensor: u32,
    pub block: AffineBlock,
}

/// The changes of one scanned run of a local tensor, in canonical
/// coordinates, and what the scan saw locally.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProjectedChanges {
    /// Per exported change: canonical tensor, element index, XOR word.
    pub tensor: Vec<u32>,
    pub element: Vec<u64>,
    pub xor: Vec<u64>,
    /// How each touched canonical tensor's digest moves.
    pub moved: Vec<(u32, DigestSum)>,
    /// Every change by its position in the run (exported or padding): the
    /// baseline update at the commit.
    pub local: SparseChanges,
}

/// Scan `old` against `new` (elements `first_local..` of a local tensor,
/// words of `width`), project each change through `pieces` (sorted by
/// local offset, disjoint; changes in no piece are not exported) and move
/// the digests.
pub fn scan_and_project(old: &[u8], new: &[u8], width: usize, first_local: u64, pieces: &[Piece]) -> Result<ProjectedChanges> {
    if pieces.windows(2).any(|w| w[0].block.local_offset + w[0].block.numel().unwrap_or(u64::MAX) > w[1].block.local_offset) {
        return Err(Error::Invalid("pieces must be sorted by local offset and disjoint".into()));
    }
    for p in pieces {
        if p.block.shape.len() != p.block.canonical_strides.len() || p.block.shape.contains(&0) {
            return Err(Error::Invalid(format!("piece at local offset {} has shape {:?} and strides {:?}", p.block.local_offset, p.block.shape, p.block.canonical_strides)));
        }
    }
    let local = codec::find_changes(old, new, width, ChangeKind::Xor)?;
    let mut out = ProjectedChanges { local: SparseChanges::default(), ..Default::default() };
    let mut per_tensor: Vec<(u32, DigestMoves)> = Vec::new();
    let mut k = 0usize; // current piece
    for (&p, &x) in local.positions.iter().zip(&local.values) {
        let at = first_local + u64::from(p);
        while k < pieces.len() && pieces[k].block.local_offset + pieces[k].block.numel()? <= at {
            k += 1;
        }
        let Some(piece) = pieces.get(k).filter(|q| q.block.local_offset <= at) else { continue };
        let mut rem = at - piece.block.local_offset;
        let mut element = piece.block.canonical_offset;
        for (&dim, &stride) in piece.block.shape.iter().zip(&piece.block.canonical_strides).rev() {
            element += (rem % dim) * stride;
            rem /= dim;
        }
        let mut w = [0u8; 8];
        w[..width].copy_from_slice(&old[p as usize * width..(p as usize + 1) * width]);
        let o = u64::from_le_bytes(w);
        if per_tensor.last().is_none_or(|(t, _)| *t != piece.tensor) {
            per_tensor.push((piece.tensor, DigestMoves::new(width)));
        }
        per_tensor.last_mut().expect("just pushed").1.word(element, o, o ^ x);
        out.tensor.push(piece.tensor);
        out.element.push(element);
        out.xor.push(x);
    }
    let mut moved: Vec<(u32, DigestSum)> = Vec::new();
    for (t, moves) in per_tensor {
        let d = moves.finish();
        match moved.iter_mut().find(|(u, _)| *u == t) {
            Some((_, s)) => *s = s.plus(d),
            None => moved.push((t, d)),
        }
    }
    out.moved = moved;
    out.local = local;
    Ok(out)
}

/// One change on its way to its chunk's owner, as the ranks exchange it:
/// packed little-endian tensor u32, element u64, XOR word u64.
pub const RECORD_BYTES: usize = 20;

/// Sort packed change records (the concatenation of `parts`) by (global
/// chunk id, element) and return them with their chunk ids. Chunk `c` of
/// tensor `t` has id `first_chunk[t] + c`; `chunk_words[t]` is the tensor's
/// chunk size. Records already in order (one scan's runs usually are) are
/// only concatenated.
pub fn sort_records(parts: &[&[u8]], chunk_words: &[u64], first_chunk: &[u64]) -> Result<(Vec<u8>, Vec<u64>)> {
    use rayon::prelude::*;
    let total: usize = parts.iter().map(|p| p.len()).sum();
    if let Some(p) = parts.iter().find(|p| p.len() % RECORD_BYTES != 0) {
        return Err(Error::Invalid(format!("{} bytes is not a whole number of {RECORD_BYTES}-byte records", p.len())));
    }
    let key = |r: &[u8]| -> Result<(u64, u64)> {
        let t = u32::from_le_bytes(r[..4].try_into().expect("4 bytes"));
        let e = u64::from_le_bytes(r[4..12].try_into().expect("8 bytes"));
        match (chunk_words.get(t as usize), first_chunk.get(t as usize)) {
            (Some(&k), Some(&f)) => Ok((f + e / k.max(1), e)),
            _ => Err(Error::Invalid(format!("a record names tensor {t} of {}", chunk_words.len()))),
        }
    };
    let mut gids = Vec::with_capacity(total / RECORD_BYTES);
    let mut sorted = true;
    let mut prev = (0u64, 0u64);
    for p in parts {
        for r in p.chunks_exact(RECORD_BYTES) {
            let k = key(r)?;
            sorted &= gids.is_empty() || prev <= k;
            prev = k;
            gids.push(k.0);
        }
    }
    let mut out = Vec::with_capacity(total);
    if sorted {
        for p in parts {
            out.extend_from_slice(p);
        }
        return Ok((out, gids));
    }
    let all: Vec<&[u8]> = parts.iter().flat_map(|p| p.chunks_exact(RECORD_BYTES)).collect();
    let mut keyed: Vec<(u64, u64, u32)> = all.iter().enumerate().map(|(i, r)| key(r).map(|(g, e)| (g, e, i as u32))).collect::<Result<_>>()?;
    keyed.par_sort_unstable();
    for &(_, _, i) in &keyed {
        out.extend_from_slice(all[i as usize]);
    }
    Ok((out, keyed.into_iter().map(|(g, _, _)| g).collect()))
}

fn composed_options(chunk_bytes: u32, base_version: u64, target_version: u64, mode: Mode) -> DiffOptions {
    DiffOptions { chunk_bytes, kind: ChangeKind::Xor, mode, base_version, target_version, ..Default::default() }
}

/// Preamble and header frame of the composed delta, and its header. `mode`
/// is the delta's codec mode (it enters the delta id as in [`crate::delta::diff`]).
pub fn header_blob(
    layout: &Layout,
    base_digests: &[Digest],
    target_digests: &[Digest],
    chunk_bytes: u32,
    base_version: u64,
    target_version: u64,
    mode: Mode,
) -> Result<(Vec<u8>, DeltaHeader)> {
    if base_digests.len() != layout.len() || target_digests.len() != layout.len() {
        return Err(Error::Invalid(format!(
            "{} base and {} target digests for {} tensors",
            base_digests.len(),
            target_digests.len(),
            layout.len()
        )));
    }
    if chunk_bytes == 0 || chunk_bytes > format::MAX_CHUNK_BYTES {
        return Err(Error::Invalid(format!("chunk size must be 1..={} bytes, got {chunk_bytes}", format::MAX_CHUNK_BYTES)));
    }
    let opts = composed_options(chunk_bytes, base_version, target_version, mode);
    let header = make_header(layout, layout.checkpoint_digest(base_digests), target_digests, &opts);
    let mut blob = format::preamble().to_vec();
    blob.extend_from_slice(&header.to_frame());
    Ok((blob, header))
}

/// Check a chunk's coordinates and XOR changes against the header; returns
/// the tensor's word width and the chunk's length in words.
fn check_chunk_changes(header: &DeltaHeader, seq: u32, tensor: u32, start: u64, changes: &SparseChanges) -> Result<(usize, usize)> {
    let spec = header
        .layout
        .tensors()
        .get(tensor as usize)
        .ok_or_else(|| Error::Invalid(format!("tensor index {tensor} but the delta has {} tensors", header.layout.len())))?;
    let width = spec.dtype.word_bytes();
    let k = header.chunk_words(spec);
    let words = spec.words()?;
    if !start.is_multiple_of(k) || start >= words {
        return Err(Error::Invalid(format!("chunk start {start} is off the grid of {} ({words} words, {k} per chunk)", spec.name)));
    }
    let len = k.min(words - start) as usize;
    if changes.positions.is_empty() || changes.positions.len() != changes.values.len() {
        return Err(Error::Invalid(format!("chunk {seq}: {} positions and {} values (need as many, at least one)", changes.positions.len(), changes.values.len())));
    }
    let mask = if width == 8 { u64::MAX } else { (1u64 << (8 * width)) - 1 };
    let mut prev = None;
    for (&p, &v) in changes.positions.iter().zip(&changes.values) {
        if p as usize >= len || prev.is_some_and(|q| q >= p) || v == 0 || v & !mask != 0 {
            return Err(Error::Invalid(format!(
                "chunk {seq} of {}: positions must ascend below {len} with non-zero {width}-byte XOR words (position {p}, word {v:#x})",
                spec.name
            )));
        }
        prev = Some(p);
    }
    Ok((width, len))
}

fn frame_of(header: &DeltaHeader, seq: u32, tensor: u32, start: u64, len: usize, enc: codec::EncodedChunk) -> Vec<u8> {
    ChunkFrame {
        delta_tag: header.tag(),
        seq,
        tensor,
        start,
        len: len as u32,
        kind: ChangeKind::Xor,
        encoding: enc.encoding,
        mode: enc.mode,
        n_changed: enc.n_changed,
        payload: enc.payload,
    }
    .to_frame()
}

/// The frame of chunk `start..start+len` (words) of tensor `tensor`, from
/// its XOR changes gathered from every rank (`positions` relative to the
/// chunk start, ascending, unique; `xor` non-zero words).
pub fn chunk_frame(header: &DeltaHeader, seq: u32, tensor: u32, start: u64, changes: SparseChanges, zstd_level: i32) -> Result<Vec<u8>> {
    let (width, len) = check_chunk_changes(header, seq, tensor, start, &changes)?;
    let dense = || {
        let mut out = vec![0u8; len * width];
        for (&p, &v) in changes.positions.iter().zip(&changes.values) {
            out[p as usize * width..(p as usize + 1) * width].copy_from_slice(&v.to_le_bytes()[..width]);
        }
        out
    };
    let opts = EncodeOptions { kind: ChangeKind::Xor, zstd_level };
    let enc = codec::encode_changes(&changes, len, width, opts, dense);
    Ok(frame_of(header, seq, tensor, start, len, enc))
}

/// The frame of a chunk whose whole base one rank holds (`base`: the
/// chunk's canonical base bytes), from its XOR changes: context-coded when
/// that is smaller, exactly as [`crate::delta::diff`] in the context mode
/// encodes the chunk.
pub fn context_chunk_frame(
    header: &DeltaHeader,
    seq: u32,
    tensor: u32,
    start: u64,
    base: &[u8],
    changes: SparseChanges,
    zstd_level: i32,
) -> Result<Vec<u8>> {
    let (width, len) = check_chunk_changes(header, seq, tensor, start, &changes)?;
    if base.len() != len * width {
        return Err(Error::Invalid(format!("chunk {seq}: base of {} bytes for a chunk of {len} words of {width} bytes", base.len())));
    }
    let mut new = base.to_vec();
    for (&p, &v) in changes.positions.iter().zip(&changes.values) {
        let word = &mut new[p as usize * width..(p as usize + 1) * width];
        for (b, x) in word.iter_mut().zip(v.to_le_bytes()) {
            *b ^= x;
        }
    }
    let model = codec::context::ContextModel::for_dtype(header.layout.tensors()[tensor as usize].dtype);
    let opts = EncodeOptions { kind: ChangeKind::Xor, zstd_level };
    let enc = codec::encode_found(base, &new, width, opts, Some(&model), changes);
    Ok(frame_of(header, seq, tensor, start, len, enc))
}

/// The trailer frame of the composed delta.
pub fn trailer_frame(header: &DeltaHeader, n_chunks: u32, n_changed: u64, target_digests: &[Digest]) -> Vec<u8> {
    Trailer { delta_tag: header.tag(), n_chunks, n_changed, tensor_digests: target_digests.to_vec() }.to_frame()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::TensorSpec;
    use crate::dtype::DType;

    fn layout() -> Layout {
        Layout::new(vec![
            TensorSpec { name: "a".into(), dtype: DType(safetensors::Dtype::BF16), shape: vec![6, 10] },
            TensorSpec { name: "b".into(), dtype: DType(safetensors::Dtype::F32), shape: vec![7] },
        ])
        .unwrap()
    }

    fn words(n: usize, w: usize, seed: u8) -> Vec<u8> {
        (0..n * w).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    #[test]
    fn column_shards_compose_to_the_gathered_digest_and_delta() {
        let layout = layout();
        let old_a = words(60, 2, 1);
        let mut new_a = old_a.clone();
        for e in [3usize, 4, 17, 18, 35, 59] {
            new_a[2 * e] ^= 0x5A;
        }
        let old_b = words(7, 4, 9);
        let new_b = old_b.clone();
        let mut gathered = Vec::new();
        let opts = DiffOptions { chunk_bytes: 16, ..Default::default() };
        crate::delta::diff(&layout, &[&old_a, &old_b], &[&new_a, &new_b], &opts, &mut |f| {
            let _: () = gathered.extend_from_slice(f);
            Ok(())
        }, &mut |_, _| {}).unwrap();

        // Two ranks hold column halves (Shard(1)) of `a`: local [6, 5] each.
        let shard = |full: &[u8], r: usize| -> Vec<u8> {
            (0..6).flat_map(|row| full[(row * 10 + r * 5) * 2..(row * 10 + r * 5 + 5) * 2].to_vec()).collect()
        };
        let block = |r: usize| AffineBlock { local_offset: 0, shape: vec![6, 5], canonical_offset: r as u64 * 5, canonical_strides: vec![10, 1] };
        let base: DigestSum = (0..2).map(|r| block_digest(&shard(&old_a, r), 2, &block(r)).unwrap()).fold(DigestSum::ZERO, DigestSum::plus);
        assert_eq!(base.digest(), crate::digest::tensor_digest(&old_a, 2));
        // Transposed view of the same block: canonical strides (1, 10) over local [5, 6].
        let mut t_local = Vec::new();
        for c in 0..5usize {
            for row in 0..6usize {
                t_local.extend_from_slice(&old_a[(row * 10 + c) * 2..(row * 10 + c) * 2 + 2]);
            }
        }
        let t = AffineBlock { local_offset: 0, shape: vec![5, 6], canonical_offset: 0, canonical_strides: vec![1, 10] };
        assert_eq!(block_digest(&t_local, 2, &t).unwrap(), block_digest(&shard(&old_a, 0), 2, &block(0)).unwrap());

        let mut all: Vec<(u64, u64, u64)> = Vec::new(); // canonical index, old, new
        for r in 0..2 {
            let (o, n) = (shard(&old_a, r), shard(&new_a, r));
            for k in 0..30usize {
                let (ow, nw) = (u16::from_le_bytes([o[2 * k], o[2 * k + 1]]), u16::from_le_bytes([n[2 * k], n[2 * k + 1]]));
                if ow != nw {
                    all.push(((k / 5 * 10 + r * 5 + k % 5) as u64, ow.into(), nw.into()));
                }
            }
        }
        all.sort();
        let mut moves = DigestMoves::new(2);
        for &(e, o, n) in &all {
            moves.word(e, o, n);
        }
        let moved = moves.finish();
        let target = [base.plus(moved).digest(), crate::digest::tensor_digest(&old_b, 4)];
        let base_d = [base.digest(), crate::digest::tensor_digest(&old_b, 4)];
        let (mut composed, header) = header_blob(&layout, &base_d, &target, 16, 0, 1, Mode::Free).unwrap();
        let k = 8u64; // 16-byte chunks of bf16
        let mut seq = 0;
        let mut n_changed = 0;
        for c in 0..(60 / k + 1) {
            let ch: Vec<_> = all.iter().filter(|e| e.0 / k == c).collect();
            if ch.is_empty() {
                continue;
            }
            let changes = SparseChanges {
                positions: ch.iter().map(|e| (e.0 - c * k) as u32).collect(),
                values: ch.iter().map(|e| e.1 ^ e.2).collect(),
            };
            n_changed += ch.len() as u64;
            composed.extend_from_slice(&chunk_frame(&header, seq, 0, c * k, changes, 1).unwrap());
            seq += 1;
        }
        composed.extend_from_slice(&trailer_frame(&header, seq, n_changed, &target));
        assert_eq!(composed, gathered);
    }

    #[test]
    fn a_rank_holding_whole_chunks_composes_the_context_delta() {
        let layout = Layout::new(vec![TensorSpec { name: "w".into(), dtype: DType(safetensors::Dtype::BF16), shape: vec![16, 512] }]).unwrap();
        let n = 16 * 512;
        // Weights of a few exponents; about 8 % move by one ulp.
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let old: Vec<u16> = (0..n).map(|_| 0x3C00 + (rnd() % 0x300) as u16).collect();
        let new: Vec<u16> = old.iter().map(|&w| if rnd() % 12 == 0 { w + 1 } else { w }).collect();
        let (old_b, new_b): (Vec<u8>, Vec<u8>) =
            (old.iter().flat_map(|w| w.to_le_bytes()).collect(), new.iter().flat_map(|w| w.to_le_bytes()).collect());
        let opts = DiffOptions { chunk_bytes: 4096, mode: Mode::Context, ..Default::default() };
        let mut single = Vec::new();
        crate::delta::diff(&layout, &[&old_b], &[&new_b], &opts, &mut |f| {
            let _: () = single.extend_from_slice(f);
            Ok(())
        }, &mut |_, _| {}).unwrap();

        let digest = |b: &[u8]| crate::digest::tensor_digest(b, 2);
        let (mut composed, header) = header_blob(&layout, &[digest(&old_b)], &[digest(&new_b)], 4096, 0, 1, Mode::Context).unwrap();
        let k = 2048usize;
        let mut n_changed = 0u64;
        for c in 0..n / k {
            let changes = SparseChanges {
                positions: (0..k).filter(|&i| old[c * k + i] != new[c * k + i]).map(|i| i as u32).collect(),
                values: (0..k).filter(|&i| old[c * k + i] != new[c * k + i]).map(|i| u64::from(old[c * k + i] ^ new[c * k + i])).collect(),
            };
            n_changed += changes.positions.len() as u64;
            let base = &old_b[c * k * 2..(c + 1) * k * 2];
            composed.extend_from_slice(&context_chunk_frame(&header, c as u32, 0, (c * k) as u64, base, changes, 1).unwrap());
        }
        composed.extend_from_slice(&trailer_frame(&header, (n / k) as u32, n_changed, &[digest(&new_b)]));
        assert_eq!(composed, single);
        let parsed = crate::delta::read_delta(&composed).unwrap();
        assert!(parsed.chunks.iter().all(|c| c.mode == Mode::Context), "every chunk is context-coded");

        // A base of the wrong length is refused.
        let one = SparseChanges { positions: vec![0], values: vec![1] };
        assert!(context_chunk_frame(&header, 0, 0, 0, &old_b[..10], one, 1).is_err());
    }
}
