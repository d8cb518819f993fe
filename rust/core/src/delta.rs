//! Whole-checkpoint deltas: build one from two versions (streaming frames out
//! as chunks are encoded), validate one, and apply one in place with a base
//! check before any byte changes and a digest check after.

use std::collections::HashSet;

use std::sync::atomic::Ordering;

use crate::checkpoint::{digest_hex, digest_short, Digest, Layout};
use crate::digest::DigestSum;
use crate::codec::{self, ChangeKind, DecodedChunk, EncodeOptions, Mode};
use crate::error::{Error, Result};
use crate::format::{self, chunk_words, ChunkFrame, DeltaHeader, Frame, Trailer};

pub const DEFAULT_CHUNK_BYTES: u32 = 4 << 20;

#[derive(Clone, Copy, Debug)]
pub struct DiffOptions {
    pub chunk_bytes: u32,
    pub kind: ChangeKind,
    pub zstd_level: i32,
    pub mode: Mode,
    pub base_version: u64,
    pub target_version: u64,
    /// A dense delta: every element of the target as raw overwrites, with
    /// the all-zero base digest, so it applies to any target of the same
    /// layout (bootstrapping a receiver; the full-checkpoint reference).
    pub dense: bool,
    /// How many bytes of found and encoded changes the first pass (which
    /// finds every chunk's changes, for the header's target digest) may
    /// keep for the second (which emits the frames): while they fit, chunks
    /// are encoded straight after their changes are found; beyond, they
    /// are found again in the second pass. The delta's bytes are the same
    /// either way.
    pub keep_bytes: usize,
}

/// The base digest of a dense delta: "any base of this layout".
pub const ANY_BASE: Digest = [0u8; 16];

impl Default for DiffOptions {
    fn default() -> Self {
        DiffOptions {
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            kind: ChangeKind::Xor,
            zstd_level: 1,
            mode: Mode::Free,
            base_version: 0,
            target_version: 1,
            dense: false,
            keep_bytes: KEPT_CHANGES_BYTES,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TensorStats {
    pub name: String,
    pub words: u64,
    pub changed: u64,
    pub chunks: u32,
    pub payload_bytes: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeltaStats {
    pub base_digest: Digest,
    pub target_digest: Digest,
    pub base_version: u64,
    pub target_version: u64,
    pub total_words: u64,
    pub total_bytes: u64,
    pub changed: u64,
    pub chunks: u32,
    /// All bytes of the delta: preamble, header, frames, trailer.
    pub delta_bytes: u64,
    pub per_tensor: Vec<TensorStats>,
    pub encodings: [u32; codec::ENCODINGS.len()],
    /// Chunks by codec mode (`Mode as usize`: context-free, context-aware);
    /// a context-mode delta falls back per chunk to context-free coding.
    pub modes: [u32; 2],
}

/// One unit of work: chunk `start..start+len` (words) of tensor `tensor`.
#[derive(Clone, Copy, Debug)]
struct Unit {
    tensor: usize,
    start: u64,
    len: u64,
}

fn plan(layout: &Layout, chunk_bytes: u32) -> Result<Vec<Unit>> {
    let mut units = Vec::new();
    for (i, t) in layout.tensors().iter().enumerate() {
        let words = t.words()?;
        let k = chunk_words(chunk_bytes, t.dtype);
        let mut start = 0;
        while start < words {
            let len = k.min(words - start);
            units.push(Unit { tensor: i, start, len });
            start += len;
        }
    }
    Ok(units)
}

/// Build the delta from `old` to `new` (buffers in the layout's canonical
/// order). The delta's bytes go to `sink` in order as soon as they are
/// encoded (a chunk frame in three pieces: see `ChunkFrame::frame_parts`);
/// the work is spread over rayon's threads in batches so memory stays
/// bounded.
pub fn diff(
    layout: &Layout,
    old: &[&[u8]],
    new: &[&[u8]],
    opts: &DiffOptions,
    sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<DeltaStats> {
    diff_from(layout, old, new, None, opts, sink, progress)
}

/// The header of the delta with these digests and options (`base_digest`:
/// the base's checkpoint digest, or [`ANY_BASE`]).
pub fn make_header(layout: &Layout, base_digest: Digest, target_tensor_digests: &[Digest], opts: &DiffOptions) -> DeltaHeader {
    let target_digest = layout.checkpoint_digest(target_tensor_digests);
    let delta_id = DeltaHeader::compute_id(
        &base_digest,
        &target_digest,
        opts.base_version,
        opts.target_version,
        opts.chunk_bytes,
        &[opts.kind as u8, opts.mode as u8, opts.dense as u8],
    );
    DeltaHeader {
        delta_id,
        base_digest,
        target_digest,
        base_version: opts.base_version,
        target_version: opts.target_version,
        chunk_bytes: opts.chunk_bytes,
        layout: layout.clone(),
    }
}

/// `DiffOptions::keep_bytes` by default. The first pass encodes each chunk
/// right after finding its changes, while they are still in the core's
/// caches, and keeps the encoded chunk for the second pass while the found
/// changes (12 bytes each) and then the encoded chunks fit; beyond, chunks
/// are found and encoded in the second pass, as the frames stream out.
/// Encoding in the first pass saves reading the found changes back from
/// memory (the profile of fp32m 10->15: splitting the values into byte
/// planes 7.9 -> 3.6 % of the diff, the gap bytes 4.6 -> 3.1 %).
const KEPT_CHANGES_BYTES: usize = 256 << 20;

/// What the first pass keeps of a chunk for the second.
enum Found {
    /// Encoded already (`None`: nothing changed).
    Encoded(Option<codec::EncodedChunk>),
    /// Over the budget: the second pass finds and encodes the changes.
    Later,
}

/// [`diff`] with the base's tensor digests already known (a publisher keeps
/// them from the previous version): then nothing but the change scan reads
/// the unchanged bytes. The target digests are the base digests moved by
/// the changes (see [`crate::digest`]).
pub fn diff_from(
    layout: &Layout,
    old: &[&[u8]],
    new: &[&[u8]],
    base_digests: Option<&[Digest]>,
    opts: &DiffOptions,
    sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<DeltaStats> {
    diff_from_announced(layout, old, new, base_digests, opts, &mut |_| Ok(()), sink, progress)
}

/// [`diff_from`] that tells `announce` the delta's length in bytes before
/// the sink gets any, where it is known by then: where the first pass kept
/// every encoded chunk (see [`DiffOptions::keep_bytes`]), so that a caller
/// can make room for the whole delta once and have it written there.
#[allow(clippy::too_many_arguments)]
pub fn diff_from_announced(
    layout: &Layout,
    old: &[&[u8]],
    new: &[&[u8]],
    base_digests: Option<&[Digest]>,
    opts: &DiffOptions,
    announce: &mut dyn FnMut(u64) -> Result<()>,
    sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<DeltaStats> {
    if opts.chunk_bytes == 0 || opts.chunk_bytes > format::MAX_CHUNK_BYTES {
        return Err(Error::Invalid(format!("chunk size must be 1..={} bytes, got {}", format::MAX_CHUNK_BYTES, opts.chunk_bytes)));
    }
    layout.check_buffers(old.iter().map(|b| b.len()))?;
    layout.check_buffers(new.iter().map(|b| b.len()))?;
    if let Some(d) = base_digests {
        if d.len() != layout.len() {
            return Err(Error::Invalid(format!("{} base digests for {} tensors", d.len(), layout.len())));
        }
    }
    let units = plan(layout, opts.chunk_bytes)?;
    let width = |u: &Unit| layout.tensors()[u.tensor].dtype.word_bytes();
    let byte_range = |u: &Unit| (u.start as usize * width(u))..((u.start + u.len) as usize * width(u));

    // Pass 1: the digests. A dense delta names no base, so its target is
    // digested in full; otherwise the base digests (given or computed) move
    // by the changes, and the chunks are encoded for pass 2 while they fit.
    let enc = EncodeOptions { kind: opts.kind, zstd_level: opts.zstd_level };
    let batch = (rayon::current_num_threads() * 4).max(4);
    let total_bytes = layout.total_bytes();
    let model_of = |u: &Unit| {
        (opts.mode == Mode::Context).then(|| codec::context::ContextModel::for_dtype(layout.tensors()[u.tensor].dtype))
    };
    let (base_digest, new_d, mut kept) = if opts.dense {
        (ANY_BASE, layout.tensor_digests(new), Vec::new())
    } else {
        let old_d = match base_digests {
            Some(d) => d.to_vec(),
            None => layout.tensor_digests(old),
        };
        let budget = std::sync::atomic::AtomicUsize::new(opts.keep_bytes);
        let find_and_encode = |u: &Unit| -> Result<(DigestSum, Found)> {
            let r = byte_range(u);
            let (o, n) = (&old[u.tensor][r.clone()], &new[u.tensor][r]);
            let model = model_of(u);
            let (changes, moved) = codec::FoundChanges::find(o, n, width(u), enc.kind, model.as_ref(), Some(u.start))?;
            if changes.is_empty() {
                return Ok((moved, Found::Encoded(None)));
            }
            let cost = changes.len() * 12;
            if budget.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| left.checked_sub(cost)).is_err() {
                return Ok((moved, Found::Later));
            }
            let chunk = changes.encode(o, n, width(u), enc, model.as_ref());
            // Only the encoded payload stays.
            budget.fetch_add(cost.saturating_sub(chunk.payload.len()), Ordering::Relaxed);
            Ok((moved, Found::Encoded(Some(chunk))))
        };
        // In batches, so that progress moves: pass 1 reports the first half
        // of the checkpoint's bytes, pass 2 the second.
        let mut found: Vec<(DigestSum, Found)> = Vec::with_capacity(units.len());
        let mut scanned = 0u64;
        for group in units.chunks(batch) {
            for result in crate::exec::map_range(group.len(), |i| find_and_encode(&group[i])) {
                found.push(result?);
            }
            scanned += group.iter().map(|u| u.len * width(u) as u64).sum::<u64>();
            progress(scanned / 2, total_bytes);
        }
        let mut sums: Vec<DigestSum> = old_d.iter().map(DigestSum::from_digest).collect();
        let mut kept = Vec::with_capacity(units.len());
        for (u, (moved, found)) in units.iter().zip(found) {
            sums[u.tensor] = sums[u.tensor].plus(moved);
            kept.push(found);
        }
        (layout.checkpoint_digest(&old_d), sums.iter().map(DigestSum::digest).collect::<Vec<_>>(), kept)
    };
    let header = make_header(layout, base_digest, &new_d, opts);
    let target_digest = header.target_digest;
    let mut stats = DeltaStats {
        base_digest,
        target_digest,
        base_version: opts.base_version,
        target_version: opts.target_version,
        total_bytes: layout.total_bytes(),
        per_tensor: layout
            .tensors()
            .iter()
            .map(|t| Ok(TensorStats { name: t.name.clone(), words: t.words()?, ..Default::default() }))
            .collect::<Result<_>>()?,
        ..Default::default()
    };
    stats.total_words = stats.per_tensor.iter().map(|t| t.words).sum();
    let mut emit = |bytes: &[u8], stats: &mut DeltaStats| -> Result<()> {
        stats.delta_bytes += bytes.len() as u64;
        sink(bytes)
    };
    let (delta_tag, chunk_kind) = (header.tag(), if opts.dense { ChangeKind::Overwrite } else { opts.kind });
    let header_frame = header.to_frame();
    if !opts.dense && kept.iter().all(|k| matches!(k, Found::Encoded(_))) {
        // Every frame is known: the preamble, the header, the chunks in
        // order, the trailer.
        let chunks = units.iter().zip(&kept).filter_map(|(u, k)| match k {
            Found::Encoded(Some(c)) => Some((u, c)),
            _ => None,
        });
        let chunk_bytes: u64 = chunks.enumerate().map(|(seq, (u, c))| chunk_frame(delta_tag, chunk_kind, seq as u32, u, c).frame_len() as u64).sum();
        announce(format::PREAMBLE_LEN as u64 + header_frame.len() as u64 + chunk_bytes + Trailer::frame_len(layout.len()) as u64)?;
    }
    emit(&format::preamble(), &mut stats)?;
    emit(&header_frame, &mut stats)?;

    // Pass 2: encode what pass 1 did not, in batches, frames out in order.
    let mut done_bytes = 0u64;
    let mut seq = 0u32;
    for (k, group) in units.chunks(batch).enumerate() {
        // A dense delta keeps nothing: every chunk is done here.
        let mut group_kept: Vec<Found> = match kept.get_mut(k * batch..k * batch + group.len()) {
            Some(slots) => slots.iter_mut().map(|slot| std::mem::replace(slot, Found::Later)).collect(),
            None => (0..group.len()).map(|_| Found::Later).collect(),
        };
        let encoded: Vec<Result<Option<codec::EncodedChunk>>> =
            crate::exec::map_mut(&mut group_kept, |i, found| {
                let u = &group[i];
                if let Found::Encoded(chunk) = std::mem::replace(found, Found::Later) {
                    return Ok(chunk);
                }
                let w = width(u);
                let range = byte_range(u);
                if opts.dense {
                    return Ok(Some(codec::EncodedChunk {
                        encoding: codec::Encoding::Raw,
                        mode: Mode::Free,
                        n_changed: u.len as u32,
                        payload: new[u.tensor][range].to_vec(),
                    }));
                }
                let (o, n) = (&old[u.tensor][range.clone()], &new[u.tensor][range]);
                codec::encode_chunk_with_context(o, n, w, enc, model_of(u).as_ref())
            });
        for (u, e) in group.iter().zip(encoded) {
            let w = layout.tensors()[u.tensor].dtype.word_bytes() as u64;
            done_bytes += u.len * w;
            let Some(chunk) = e? else { continue };
            let frame = chunk_frame(delta_tag, chunk_kind, seq, u, &chunk);
            let frame_len = frame.frame_len() as u64;
            let t = &mut stats.per_tensor[u.tensor];
            t.changed += u64::from(frame.n_changed);
            t.chunks += 1;
            t.payload_bytes += frame_len;
            stats.changed += u64::from(frame.n_changed);
            stats.encodings[frame.encoding as usize] += 1;
            stats.modes[frame.mode as usize] += 1;
            seq = seq.checked_add(1).ok_or_else(|| Error::Invalid("more than 2^32 chunks: use a larger chunk size".into()))?;
            // In its three pieces: the payload goes to the sink as encoded.
            let (head, payload, crc) = frame.frame_parts();
            emit(&head, &mut stats)?;
            emit(payload, &mut stats)?;
            emit(&crc, &mut stats)?;
        }
        progress(total_bytes / 2 + done_bytes - done_bytes / 2, total_bytes);
    }
    stats.chunks = seq;
    let trailer = Trailer { delta_tag: header.tag(), n_chunks: seq, n_changed: stats.changed, tensor_digests: new_d };
    emit(&trailer.to_frame(), &mut stats)?;
    Ok(stats)
}

/// Unit `u`'s encoded chunk as frame `seq` of the delta tagged `delta_tag`.
fn chunk_frame<'c>(delta_tag: u64, kind: ChangeKind, seq: u32, u: &Unit, chunk: &'c codec::EncodedChunk) -> ChunkFrame<&'c [u8]> {
    ChunkFrame {
        delta_tag,
        seq,
        tensor: u.tensor as u32,
        start: u.start,
        len: u.len as u32,
        kind,
        encoding: chunk.encoding,
        mode: chunk.mode,
        n_changed: chunk.n_changed,
        payload: chunk.payload.as_slice(),
    }
}

/// A fully parsed and structurally validated delta. `read_delta` leaves
/// the chunk payloads in the bytes it parsed (`P = &[u8]`); `into_owned`
/// copies them out.
#[derive(Clone, Debug)]
pub struct Delta<P = Vec<u8>> {
    pub header: DeltaHeader,
    pub chunks: Vec<ChunkFrame<P>>,
    pub trailer: Trailer,
}

impl<'a> Delta<&'a [u8]> {
    /// The delta with its chunk payloads copied out of the parsed bytes.
    pub fn into_owned(self) -> Delta {
        self.map_payloads(<[u8]>::to_vec)
    }

    /// The delta with each chunk payload (a slice of the parsed bytes)
    /// turned into `f` of it: e.g. a `bytes::Bytes` of the same memory.
    pub fn map_payloads<Q>(self, mut f: impl FnMut(&'a [u8]) -> Q) -> Delta<Q> {
        let chunks = self.chunks.into_iter().map(|c| c.with_payload(f(c.payload))).collect();
        Delta { header: self.header, chunks, trailer: self.trailer }
    }
}

/// Check a chunk frame against its delta's header: identity, tensor index and
/// the chunk grid. Returns the chunk's byte range within its tensor.
pub fn check_chunk<P>(header: &DeltaHeader, chunk: &ChunkFrame<P>) -> Result<std::ops::Range<usize>> {
    if chunk.delta_tag != header.tag() {
        return Err(Error::ForeignFrame {
            frame: format!("chunk {}", chunk.seq),
            expected: format!("{:016x}", header.tag()),
            found: format!("{:016x}", chunk.delta_tag),
        });
    }
    let ctx = || format!("chunk {}", chunk.seq);
    let spec = header
        .layout
        .tensors()
        .get(chunk.tensor as usize)
        .ok_or_else(|| Error::corrupt(ctx(), format!("tensor index {} but the delta has {} tensors", chunk.tensor, header.layout.len())))?;
    let words = spec.words()?;
    let k = header.chunk_words(spec);
    if !chunk.start.is_multiple_of(k) || chunk.start >= words || u64::from(chunk.len) != k.min(words - chunk.start) {
        return Err(Error::corrupt(
            ctx(),
            format!("range {}+{} is off the chunk grid of tensor {} ({words} words, {k} per chunk)", chunk.start, chunk.len, spec.name),
        ));
    }
    if chunk.mode == Mode::Context && chunk.encoding != codec::Encoding::Sparse {
        return Err(Error::corrupt(ctx(), "context-mode chunks use the sparse encoding"));
    }
    let w = spec.dtype.word_bytes();
    Ok(chunk.start as usize * w..(chunk.start as usize + chunk.len as usize) * w)
}

/// Parse and validate a complete delta held in memory: preamble, every
/// frame's checksum, frame order, chunk identities, unique sequence numbers
/// and the trailer's count. Nothing is applied; the chunk payloads are not
/// copied (they stay in `bytes`).
pub fn read_delta(bytes: &[u8]) -> Result<Delta<&[u8]>> {
    let mut pos = format::parse_preamble(bytes)?
        .ok_or_else(|| Error::truncated("preamble", format::PREAMBLE_LEN as u64, bytes.len() as u64))?;
    let next = |pos: &mut usize, what: &str| -> Result<Frame<&[u8]>> {
        match format::parse_frame_in(&bytes[*pos..])? {
            Some((f, used)) => {
                *pos += used;
                Ok(f)
            }
            None => Err(Error::Incomplete { detail: format!("the delta ends inside {what} at byte {}", *pos) }),
        }
    };
    let header = match next(&mut pos, "the header")? {
        Frame::Header(h) => h,
        other => return Err(first_frame_not_the_header(&other)),
    };
    let mut chunks = Vec::new();
    let mut seen = HashSet::new();
    let trailer = loop {
        if pos == bytes.len() {
            return Err(Error::Incomplete { detail: format!("no trailer after {} chunks", chunks.len()) });
        }
        match next(&mut pos, "a chunk frame")? {
            Frame::Chunk(c) => {
                check_chunk(&header, &c)?;
                if !seen.insert((c.tensor, c.start)) {
                    return Err(Error::DuplicateChunk { seq: c.seq });
                }
                if c.seq as usize != chunks.len() {
                    return Err(Error::corrupt("delta", format!("chunk seq {} where {} was expected", c.seq, chunks.len())));
                }
                chunks.push(c);
            }
            Frame::Trailer(t) => break t,
            Frame::Header(_) => return Err(Error::corrupt("delta", "a second header frame")),
        }
    };
    if pos != bytes.len() {
        return Err(Error::corrupt("delta", format!("{} bytes after the trailer", bytes.len() - pos)));
    }
    check_trailer(&header, &trailer, chunks.len() as u32)?;
    Ok(Delta { header, chunks, trailer })
}

pub fn check_trailer(header: &DeltaHeader, trailer: &Trailer, chunks_seen: u32) -> Result<()> {
    if trailer.delta_tag != header.tag() {
        return Err(Error::ForeignFrame {
            frame: "the trailer".into(),
            expected: format!("{:016x}", header.tag()),
            found: format!("{:016x}", trailer.delta_tag),
        });
    }
    if trailer.n_chunks != chunks_seen {
        return Err(Error::Incomplete { detail: format!("the trailer counts {} chunks, {chunks_seen} arrived", trailer.n_chunks) });
    }
    if trailer.tensor_digests.len() != header.layout.len() {
        let (found, expected) = (trailer.tensor_digests.len(), header.layout.len());
        return Err(Error::corrupt("trailer", format!("{found} tensor digests where the tensor table has {expected} tensors")));
    }
    let found = header.layout.checkpoint_digest(&trailer.tensor_digests);
    if found != header.target_digest {
        return Err(Error::corrupt(
            "trailer",
            format!("its tensor digests hash to {}, not to the header's target digest {}", digest_hex(&found), digest_hex(&header.target_digest)),
        ));
    }
    Ok(())
}

/// What `apply` found and did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApplyOutcome {
    Applied { chunks: u32, changed: u64 },
    /// The target already holds the delta's target version; nothing written.
    AlreadyAtTarget,
}

/// Ensure the target (its layout and current tensor digests) is this
/// delta's base. Returns `Ok(true)` when it already is the target.
pub fn check_base(header: &DeltaHeader, layout: &Layout, digests: &[Digest]) -> Result<bool> {
    header.layout.ensure_same(layout, "target checkpoint")?;
    let found = layout.checkpoint_digest(digests);
    if found == header.target_digest {
        return Ok(true);
    }
    if found != header.base_digest && header.base_digest != ANY_BASE {
        return Err(Error::BaseMismatch {
            base_version: header.base_version,
            target_version: header.target_version,
            base_digest: digest_short(&header.base_digest),
            found: digest_short(&found),
        });
    }
    Ok(false)
}

/// Decode one chunk; a context-mode chunk reads `base`, the chunk's current
/// (base) bytes in the target.
pub fn decode_against(c: &ChunkFrame<impl AsRef<[u8]>>, range: &std::ops::Range<usize>, layout: &Layout, base: &[u8]) -> Result<DecodedChunk> {
    let dtype = layout.tensors()[c.tensor as usize].dtype;
    let w = dtype.word_bytes();
    let name = format!("chunk {}", c.seq);
    match c.mode {
        Mode::Free => codec::decode_chunk(c.payload.as_ref(), range.len() / w, w, c.encoding, c.n_changed, &name),
        Mode::Context => {
            let model = codec::context::ContextModel::for_dtype(dtype);
            codec::decode_chunk_context(c.payload.as_ref(), base, w, &model, c.n_changed, c.kind, &name)
        }
    }
}

/// Decode one chunk against its range of the target, `slice`, and write it
/// there: the decoded chunk, the words it replaced (overwrites, which are
/// captured before they are written), and the digest move. A context
/// chunk of XOR changes is written as it is decoded
/// (`codec::apply_chunk_context`). On an error nothing is written.
fn decode_and_write(c: &ChunkFrame<impl AsRef<[u8]>>, range: &std::ops::Range<usize>, layout: &Layout, slice: &mut [u8]) -> Result<(DecodedChunk, Option<DecodedChunk>, DigestSum)> {
    if c.mode == Mode::Context && c.kind == ChangeKind::Xor {
        let dtype = layout.tensors()[c.tensor as usize].dtype;
        let model = codec::context::ContextModel::for_dtype(dtype);
        let name = format!("chunk {}", c.seq);
        let (decoded, moved) = codec::apply_chunk_context(c.payload.as_ref(), slice, dtype.word_bytes(), &model, c.n_changed, c.start, &name)?;
        return Ok((decoded, None, moved));
    }
    let decoded = decode_against(c, range, layout, slice)?;
    let saved = (c.kind == ChangeKind::Overwrite).then(|| decoded.capture(slice));
    let moved = decoded.apply_tracked(slice, c.kind, c.start);
    Ok((decoded, saved, moved))
}

/// Split each tensor buffer into the disjoint byte ranges of `chunks`
/// (sorted by tensor, then start; ranges from `check_chunk`).
fn split_targets<'t, P>(
    targets: &'t mut [&mut [u8]],
    chunks: &[(&ChunkFrame<P>, std::ops::Range<usize>)],
) -> Vec<&'t mut [u8]> {
    let mut out = Vec::with_capacity(chunks.len());
    let mut rests: Vec<(usize, &'t mut [u8])> = targets.iter_mut().map(|t| (0usize, &mut **t)).collect();
    for (c, range) in chunks {
        let (consumed, rest) = &mut rests[c.tensor as usize];
        let tail = std::mem::take(rest);
        let (_, tail) = tail.split_at_mut(range.start - *consumed);
        let (mine, tail) = tail.split_at_mut(range.len());
        *consumed = range.end;
        *rest = tail;
        out.push(mine);
    }
    out
}

/// Apply a validated delta in place. Order: base check (nothing written on
/// a wrong base), then each chunk decoded and written in one task, all
/// chunks in parallel, then the target digests verified. On a chunk that
/// does not decode, or on a digest mismatch, the chunks written are undone
/// (XOR chunks applied again, overwritten words put back), the base's
/// digests are checked again, and the error names the chunk or tensors.
pub fn apply<P: AsRef<[u8]> + Sync>(delta: &Delta<P>, layout: &Layout, targets: &mut [&mut [u8]]) -> Result<ApplyOutcome> {
    apply_from(delta, layout, targets, None)
}

/// The target's tensor digests: the ones the caller vouches for, or a full pass.
fn base_digests_of(layout: &Layout, targets: &[&mut [u8]], known_base: Option<&[Digest]>) -> Result<Vec<Digest>> {
    match known_base {
        Some(d) if d.len() == layout.len() => Ok(d.to_vec()),
        Some(d) => Err(Error::Invalid(format!("{} known base digests for {} tensors", d.len(), layout.len()))),
        None => Ok(layout.tensor_digests(&targets.iter().map(|t| &**t).collect::<Vec<_>>())),
    }
}

/// [`apply`] with the target's tensor digests already known (a receiver
/// that committed them and vouches that nothing else wrote the target since):
/// no full pass over the target. The target digests are verified as the
/// known digests moved by the words each chunk wrote.
pub fn apply_from<P: AsRef<[u8]> + Sync>(delta: &Delta<P>, layout: &Layout, targets: &mut [&mut [u8]], known_base: Option<&[Digest]>) -> Result<ApplyOutcome> {
    layout.check_buffers(targets.iter().map(|t| t.len()))?;
    let digests = base_digests_of(layout, targets, known_base)?;
    if check_base(&delta.header, layout, &digests)? {
        return Ok(ApplyOutcome::AlreadyAtTarget);
    }
    let mut order: Vec<(&ChunkFrame<P>, std::ops::Range<usize>)> =
        delta.chunks.iter().map(|c| Ok((c, check_chunk(&delta.header, c)?))).collect::<Result<_>>()?;
    order.sort_by_key(|(c, _)| (c.tensor, c.start));
    // Each chunk's decoded positions and values are written while they are
    // still in cache, and their memory is reused by the next chunk's; the
    // apply holds one decoded chunk per thread, not the whole delta's
    // (decoding every chunk before writing any was 4 % slower on the
    // training pairs, paired `ab_timing`, and held 6 bytes per change).
    let mut slices = split_targets(targets, &order);
    let done: Vec<Result<(Undo, DigestSum)>> = crate::exec::map_mut(&mut slices, |i, slice| {
        let (c, range) = &order[i];
        let (decoded, saved, moved) = decode_and_write(c, range, layout, slice)?;
        let undo = match (saved, c.mode) {
            (Some(saved), _) => Undo::PutBack(saved),
            // A context chunk decodes against its base words, gone once it
            // is written: kept to be applied again.
            (None, Mode::Context) => Undo::ApplyAgain(decoded),
            (None, Mode::Free) => Undo::DecodeAgain,
        };
        Ok((undo, moved))
    });
    drop(slices);
    let failed = done.iter().any(Result::is_err);
    let bad: Vec<String> = if failed {
        Vec::new()
    } else {
        let mut sums: Vec<DigestSum> = digests.iter().map(DigestSum::from_digest).collect();
        for ((c, _), (_, moved)) in order.iter().zip(done.iter().flatten()) {
            sums[c.tensor as usize] = sums[c.tensor as usize].plus(*moved);
        }
        layout
            .tensors()
            .iter()
            .zip(sums.iter().zip(&delta.trailer.tensor_digests))
            .filter(|(_, (a, b))| a.digest() != **b)
            .map(|(t, _)| t.name.clone())
            .collect()
    };
    if !failed && bad.is_empty() {
        return Ok(ApplyOutcome::Applied { chunks: delta.chunks.len() as u32, changed: delta.trailer.n_changed });
    }
    let mut slices = split_targets(targets, &order);
    crate::exec::map_mut(&mut slices, |i, slice| {
        let (c, range) = &order[i];
        match &done[i] {
            Ok((Undo::PutBack(saved), _)) => saved.apply(slice, ChangeKind::Overwrite),
            Ok((Undo::ApplyAgain(decoded), _)) => decoded.apply(slice, ChangeKind::Xor),
            // A free-mode chunk decodes from its payload alone; should it
            // not decode now, the check of the base's digests below fails.
            Ok((Undo::DecodeAgain, _)) => {
                if let Ok(decoded) = decode_against(c, range, layout, slice) {
                    decoded.apply(slice, ChangeKind::Xor);
                }
            }
            Err(_) => {} // nothing of it was written
        }
    });
    drop(slices);
    let restored = layout.tensor_digests(&targets.iter().map(|t| &**t).collect::<Vec<_>>());
    if restored != digests {
        let lost: Vec<_> = layout.tensors().iter().zip(restored.iter().zip(&digests)).filter(|(_, (a, b))| a != b).collect();
        return Err(Error::RollbackFailed { count: lost.len(), first: lost[0].0.name.clone() });
    }
    match done.into_iter().find_map(Result::err) {
        Some(error) => Err(error),
        None => Err(Error::TargetMismatch { count: bad.len(), first: bad[0].clone(), tensors: bad }),
    }
}

/// How a chunk already written is undone when the apply fails.
enum Undo {
    /// Overwritten: the words it replaced.
    PutBack(DecodedChunk),
    /// XOR, context mode: its decoded masks, applied again.
    ApplyAgain(DecodedChunk),
    /// XOR, free mode: decoded again from its payload and applied again.
    DecodeAgain,
}

/// Summary of a delta for `dcr inspect`.
pub fn summarize<P: AsRef<[u8]>>(delta: &Delta<P>, delta_bytes: u64) -> DeltaStats {
    let layout = &delta.header.layout;
    let mut per_tensor: Vec<TensorStats> = layout
        .tensors()
        .iter()
        .map(|t| TensorStats { name: t.name.clone(), words: t.words().unwrap_or(0), ..Default::default() })
        .collect();
    let mut encodings = [0u32; codec::ENCODINGS.len()];
    let mut modes = [0u32; 2];
    for c in &delta.chunks {
        let t = &mut per_tensor[c.tensor as usize];
        t.changed += u64::from(c.n_changed);
        t.chunks += 1;
        t.payload_bytes += c.frame_len() as u64;
        encodings[c.encoding as usize] += 1;
        modes[c.mode as usize] += 1;
    }
    DeltaStats {
        base_digest: delta.header.base_digest,
        target_digest: delta.header.target_digest,
        base_version: delta.header.base_version,
        target_version: delta.header.target_version,
        total_words: per_tensor.iter().map(|t| t.words).sum(),
        total_bytes: layout.total_bytes(),
        changed: per_tensor.iter().map(|t| t.changed).sum(),
        chunks: delta.chunks.len() as u32,
        delta_bytes,
        per_tensor,
        encodings,
        modes,
    }
}

/// Bit-exact comparison of two checkpoints: the names of differing tensors
/// (layout differences are reported as errors).
pub fn compare(layout_a: &Layout, a: &[&[u8]], layout_b: &Layout, b: &[&[u8]]) -> Result<Vec<String>> {
    layout_a.ensure_same(layout_b, "second checkpoint")?;
    let differs: Vec<bool> = crate::exec::map_range(a.len().min(b.len()), |i| a[i] != b[i]);
    Ok(layout_a.tensors().iter().zip(differs).filter(|(_, d)| *d).map(|(t, _)| t.name.clone()).collect())
}

pub fn digest_string(d: &Digest) -> String {
    digest_hex(d)
}

/// Applies a delta chunk by chunk as its frames arrive (from a relay or
/// object storage), in place. The base is checked before the first byte
/// changes, each chunk is checked and decoded before it touches the target,
/// duplicates are refused, and `finish` verifies the trailer and the target
/// digests. Any failure can be undone with [`StreamApplier::rollback`]: XOR
/// chunks are re-applied, overwritten bytes put back.
pub struct StreamApplier<'t> {
    header: DeltaHeader,
    layout: Layout,
    targets: Vec<&'t mut [u8]>,
    base_digests: Vec<Digest>,
    /// Base digests moved by the words written so far.
    moved: Vec<DigestSum>,
    applied: Vec<AppliedChunk>,
    seen: HashSet<u32>,
    changed: u64,
}

/// A chunk written by a `StreamApplier`: tensor, byte range, kind, the
/// decoded changes and the bytes they replaced (overwrites).
type AppliedChunk = (usize, std::ops::Range<usize>, ChangeKind, DecodedChunk, Option<DecodedChunk>);

/// A delta's blobs: header blob, chunk frames, trailer frame.
pub type DeltaBlobs<'a> = (&'a [u8], Vec<&'a [u8]>, &'a [u8]);

/// Split a delta into the blobs a transport carries: the header blob
/// (preamble + header frame), each chunk frame, and the trailer frame.
pub fn split_frames(bytes: &[u8]) -> Result<DeltaBlobs<'_>> {
    let mut pos = format::parse_preamble(bytes)?
        .ok_or_else(|| Error::truncated("preamble", format::PREAMBLE_LEN as u64, bytes.len() as u64))?;
    let mut frames = Vec::new();
    while pos < bytes.len() {
        let (_, used) = format::parse_frame_in(&bytes[pos..])?
            .ok_or_else(|| Error::Incomplete { detail: format!("the delta ends inside a frame at byte {pos}") })?;
        frames.push(&bytes[pos..pos + used]);
        pos += used;
    }
    if frames.len() < 2 {
        return Err(Error::Incomplete { detail: "a delta needs a header and a trailer frame".into() });
    }
    let header_end = format::PREAMBLE_LEN + frames[0].len();
    let trailer = frames.pop().expect("two or more");
    frames.remove(0);
    Ok((&bytes[..header_end], frames, trailer))
}

fn parse_one<'b>(blob: &'b [u8], what: &str) -> Result<Frame<&'b [u8]>> {
    match format::parse_frame_in(blob)? {
        Some((f, used)) if used == blob.len() => Ok(f),
        Some((_, used)) => Err(Error::corrupt(what, format!("{} bytes after the frame", blob.len() - used))),
        None => Err(Error::Incomplete { detail: format!("{what} is cut short") }),
    }
}

/// The header at the front of a whole delta (preamble and header frame,
/// checksum verified), without reading the chunks: a receiver checks layout
/// and base before it decodes anything (which then validates the rest).
pub fn read_header(bytes: &[u8]) -> Result<DeltaHeader> {
    let pre = format::parse_preamble(bytes)?
        .ok_or_else(|| Error::truncated("preamble", format::PREAMBLE_LEN as u64, bytes.len() as u64))?;
    match format::parse_frame_in(&bytes[pre..])? {
        Some((Frame::Header(h), _)) => Ok(h),
        Some((other, _)) => Err(first_frame_not_the_header(&other)),
        None => Err(Error::Incomplete { detail: "the delta ends inside the header".into() }),
    }
}

/// The error for a delta that starts with `frame` where its header belongs.
fn first_frame_not_the_header<P>(frame: &Frame<P>) -> Error {
    Error::corrupt("delta", format!("the first frame is {}, not the header", frame_name(frame)))
}

/// `frame` as an error names it: "chunk 3", "the trailer", "a header".
fn frame_name<P>(frame: &Frame<P>) -> String {
    match frame {
        Frame::Chunk(c) => format!("chunk {}", c.seq),
        Frame::Trailer(_) => "the trailer".into(),
        Frame::Header(_) => "a header".into(),
    }
}

/// The header of a transport's header blob (preamble + header frame).
pub fn parse_header_blob(blob: &[u8]) -> Result<DeltaHeader> {
    let pre = format::parse_preamble(blob)?
        .ok_or_else(|| Error::truncated("preamble", format::PREAMBLE_LEN as u64, blob.len() as u64))?;
    match parse_one(&blob[pre..], "header frame")? {
        Frame::Header(h) => Ok(h),
        other => Err(Error::corrupt("header blob", format!("{} where the header was expected", frame_name(&other)))),
    }
}

impl<'t> StreamApplier<'t> {
    /// Start from the header blob. `Ok(None)`: the target already holds the
    /// delta's target version (nothing to do).
    pub fn begin(header_blob: &[u8], layout: &Layout, targets: Vec<&'t mut [u8]>) -> Result<Option<Self>> {
        Self::begin_from(header_blob, layout, targets, None)
    }

    /// [`StreamApplier::begin`] with the target's digests already known (see
    /// [`apply_from`]).
    pub fn begin_from(
        header_blob: &[u8],
        layout: &Layout,
        targets: Vec<&'t mut [u8]>,
        known_base: Option<&[Digest]>,
    ) -> Result<Option<Self>> {
        let header = parse_header_blob(header_blob)?;
        layout.check_buffers(targets.iter().map(|t| t.len()))?;
        let base_digests = base_digests_of(layout, &targets, known_base)?;
        if check_base(&header, layout, &base_digests)? {
            return Ok(None);
        }
        Ok(Some(StreamApplier {
            header,
            layout: layout.clone(),
            targets,
            moved: base_digests.iter().map(DigestSum::from_digest).collect(),
            base_digests,
            applied: Vec::new(),
            seen: HashSet::new(),
            changed: 0,
        }))
    }

    pub fn header(&self) -> &DeltaHeader {
        &self.header
    }

    /// Check, decode and apply one chunk frame.
    pub fn chunk(&mut self, blob: &[u8]) -> Result<()> {
        let c = match parse_one(blob, "chunk frame")? {
            Frame::Chunk(c) => c,
            other => return Err(Error::corrupt("chunk blob", format!("{} where a chunk frame was expected", frame_name(&other)))),
        };
        let range = check_chunk(&self.header, &c)?;
        if !self.seen.insert(c.seq) {
            return Err(Error::DuplicateChunk { seq: c.seq });
        }
        let t = c.tensor as usize;
        let slice = &mut self.targets[t][range.clone()];
        let (decoded, undo, moved) = decode_and_write(&c, &range, &self.layout, slice)?;
        self.moved[t] = self.moved[t].plus(moved);
        self.changed += u64::from(c.n_changed);
        self.applied.push((t, range, c.kind, decoded, undo));
        Ok(())
    }

    /// Verify the trailer and the target digests; on a mismatch the target
    /// is rolled back to its base and the error names the tensors.
    pub fn finish(mut self, trailer_blob: &[u8]) -> Result<ApplyOutcome> {
        let verdict = (|| {
            let trailer = match parse_one(trailer_blob, "trailer frame")? {
                Frame::Trailer(t) => t,
                other => return Err(Error::corrupt("trailer blob", format!("{} where the trailer was expected", frame_name(&other)))),
            };
            check_trailer(&self.header, &trailer, self.seen.len() as u32)?;
            let bad: Vec<String> = self
                .layout
                .tensors()
                .iter()
                .zip(self.moved.iter().zip(&trailer.tensor_digests))
                .filter(|(_, (a, b))| a.digest() != **b)
                .map(|(t, _)| t.name.clone())
                .collect();
            if bad.is_empty() {
                Ok(())
            } else {
                Err(Error::TargetMismatch { count: bad.len(), first: bad[0].clone(), tensors: bad })
            }
        })();
        match verdict {
            Ok(()) => Ok(ApplyOutcome::Applied { chunks: self.applied.len() as u32, changed: self.changed }),
            Err(e) => {
                self.undo()?;
                Err(e)
            }
        }
    }

    fn undo(&mut self) -> Result<()> {
        for (t, range, kind, decoded, undo) in self.applied.drain(..).rev() {
            let slice = &mut self.targets[t][range];
            match (kind, undo) {
                (ChangeKind::Xor, _) => decoded.apply(slice, ChangeKind::Xor),
                (ChangeKind::Overwrite, Some(u)) => u.apply(slice, ChangeKind::Overwrite),
                (ChangeKind::Overwrite, None) => unreachable!("overwrite chunks always capture"),
            }
        }
        let restored = self.layout.tensor_digests(&self.targets.iter().map(|t| &**t).collect::<Vec<_>>());
        if restored != self.base_digests {
            let lost: Vec<_> = self.layout.tensors().iter().zip(restored.iter().zip(&self.base_digests)).filter(|(_, (a, b))| a != b).collect();
            return Err(Error::RollbackFailed { count: lost.len(), first: lost[0].0.name.clone() });
        }
        Ok(())
    }

    /// Undo every applied chunk: the target holds its base again.
    pub fn rollback(mut self) -> Result<()> {
        self.undo()
    }
}
