//! The crash-safe receiver: applies a delta in place to a target, recording
//! every chunk in the receiver journal before and after it touches the
//! target, so that a refit that dies at any point resumes exactly.
//!
//! [`delta::apply`](crate::delta::apply) stays the non-journaled core; this
//! module adds the journal, the pre-image ("undo") file and the resume rules
//! (see `docs/journal.md`, "Resuming a refit"):
//!
//! - Per batch of chunks: save the target's current bytes at the chunks'
//!   changed positions (their *pre-images*) to the undo file and sync it;
//!   `chunks_started`; apply the batch in parallel; flush the touched byte
//!   ranges of the target; `chunks_applied`.
//! - On resume, `Applied` chunks are skipped; `InProgress` chunks (fate
//!   unknown) are repaired in overwrite form: their pre-image is restored and
//!   the chunk applied once more, which writes exactly the new values whatever
//!   part of the earlier attempt landed, so it is idempotent and an XOR is
//!   never applied twice; `NotStarted` chunks are applied normally.
//! - When every chunk is applied, the target's digests are verified and the
//!   version commits. On a mismatch every chunk's pre-image is restored (also
//!   idempotent), the base is verified and recorded with `commit_dense`, and
//!   the refit fails with [`Error::TargetMismatch`]: the receiver stays at its
//!   committed version.
//!
//! The undo file holds only the changed positions' old values (for sparse
//! chunks) or the chunk's old bytes (for dense chunks): about the size of the
//! uncompressed delta, never a second copy of the model.

use std::collections::HashMap;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use crate::checkpoint::{digest_short, Digest, Layout, ReadOnlyCheckpoint, WritableCheckpoint};
use crate::codec::{self, DecodedChunk, Encoding, Mode};
use crate::delta::{check_chunk, decode_against, Delta, ANY_BASE};
use crate::format::ChunkFrame;
use crate::error::{Error, Result};
use crate::journal::file::scan;
use crate::journal::state::hex;
use crate::journal::{
    ChunkState, JournalFile, JournalIo, ReceiverJournal, ReceiverState, Record, RefitPlan, StdIo, TornTail,
};

/// Default journal path of a target: `<target>.dcrj` beside it.
pub fn default_journal_path(target: &Path) -> PathBuf {
    let mut name = target.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".dcrj");
    target.with_file_name(name)
}

/// The pre-image file of a journal: `<journal>.undo`.
pub fn undo_path(journal: &Path) -> PathBuf {
    let mut name = journal.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".undo");
    journal.with_file_name(name)
}

// ---------------------------------------------------------------- targets

/// What the receiver writes into: tensor buffers in the layout's canonical
/// order, and a way to make written byte ranges durable.
pub trait RefitTarget {
    fn layout(&self) -> &Layout;
    fn buffers(&self) -> Vec<&[u8]>;
    fn buffers_mut(&mut self) -> Vec<&mut [u8]>;
    /// Makes the bytes of the given (tensor index, byte range within the
    /// tensor) durable: after `Ok`, a crash cannot lose them. `ranges` are
    /// sorted by tensor, then start.
    fn flush_ranges(&mut self, ranges: &[(usize, Range<usize>)]) -> Result<()>;
}

/// Ranges of a mapped file closer than this are flushed by one `msync`.
const FLUSH_GAP: usize = 64 << 20;

impl RefitTarget for WritableCheckpoint {
    fn layout(&self) -> &Layout {
        crate::checkpoint::MappedCheckpoint::layout(self)
    }
    fn buffers(&self) -> Vec<&[u8]> {
        crate::checkpoint::MappedCheckpoint::buffers(self)
    }
    fn buffers_mut(&mut self) -> Vec<&mut [u8]> {
        WritableCheckpoint::buffers_mut(self)
    }
    fn flush_ranges(&mut self, ranges: &[(usize, Range<usize>)]) -> Result<()> {
        // One msync per run of nearby file ranges: msync writes only dirty
        // pages, and one call lets the kernel write a batch back at once
        // instead of waiting for each tensor in turn.
        let mut spans: Vec<(usize, Range<usize>)> =
            ranges.iter().filter(|(_, r)| !r.is_empty()).map(|(t, r)| self.file_range(*t, r.clone())).collect();
        spans.sort_by_key(|(file, r)| (*file, r.start));
        let mut merged: Vec<(usize, Range<usize>)> = Vec::new();
        for (file, r) in spans {
            match merged.last_mut() {
                Some((f, m)) if *f == file && r.start <= m.end.saturating_add(FLUSH_GAP) => m.end = m.end.max(r.end),
                _ => merged.push((file, r)),
            }
        }
        for (file, r) in merged {
            self.flush_file_range(file, r)?;
        }
        Ok(())
    }
}

/// How much of a [`MemTarget`]'s unflushed bytes survive [`MemTarget::crash`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetCrash {
    /// The process died but the machine did not: every write survives.
    KeepAll,
    /// Power cut: only flushed bytes survive.
    DropUnflushed,
    /// Power cut with torn pages: each unflushed byte survives or not at
    /// random (seeded).
    Mix(u64),
}

/// An in-memory target with a durable copy, for tests and simulations: a
/// flush copies ranges to the durable copy; a crash falls back to it.
#[derive(Debug, Clone)]
pub struct MemTarget {
    layout: Layout,
    pub current: Vec<Vec<u8>>,
    pub durable: Vec<Vec<u8>>,
    flushes: u64,
    fail_flush: Option<u64>,
}

impl MemTarget {
    pub fn new(layout: Layout, buffers: Vec<Vec<u8>>) -> Result<Self> {
        layout.check_buffers(buffers.iter().map(Vec::len))?;
        Ok(MemTarget { layout, durable: buffers.clone(), current: buffers, flushes: 0, fail_flush: None })
    }
    /// Number of `flush_ranges` calls so far.
    pub fn flushes(&self) -> u64 {
        self.flushes
    }
    /// Fails flush number `n` (0-based) once, flushing nothing.
    pub fn fail_flush(&mut self, n: u64) {
        self.fail_flush = Some(n);
    }
    pub fn crash(&mut self, mode: TargetCrash) {
        self.fail_flush = None;
        match mode {
            TargetCrash::KeepAll => {}
            TargetCrash::DropUnflushed => self.current = self.durable.clone(),
            TargetCrash::Mix(seed) => {
                let mut rng = seed | 1;
                for (c, d) in self.current.iter_mut().zip(&self.durable) {
                    for (cb, db) in c.iter_mut().zip(d) {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        if rng & 1 == 0 {
                            *cb = *db;
                        }
                    }
                }
            }
        }
        self.durable = self.current.clone();
    }
}

impl RefitTarget for MemTarget {
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn buffers(&self) -> Vec<&[u8]> {
        self.current.iter().map(Vec::as_slice).collect()
    }
    fn buffers_mut(&mut self) -> Vec<&mut [u8]> {
        self.current.iter_mut().map(Vec::as_mut_slice).collect()
    }
    fn flush_ranges(&mut self, ranges: &[(usize, Range<usize>)]) -> Result<()> {
        let n = self.flushes;
        self.flushes += 1;
        if self.fail_flush == Some(n) {
            self.fail_flush = None;
            return Err(Error::io(
                "flush",
                "<memory target>",
                std::io::Error::other(format!("simulated flush #{n} failure")),
            ));
        }
        for (t, r) in ranges {
            let (c, d) = (&self.current[*t], &mut self.durable[*t]);
            d[r.clone()].copy_from_slice(&c[r.clone()]);
        }
        Ok(())
    }
}

// ---------------------------------------------------------------- undo file

/// First 8 bytes of an undo file.
pub const UNDO_MAGIC: [u8; 8] = *b"DCRUNDO\0";
pub const UNDO_VERSION: u16 = 1;
/// `magic 8 | version u16 | flags u16 | delta_id [16] | crc32c u32`.
pub const UNDO_HEADER_LEN: usize = 32;
/// seq u32 | len u32 | ... | crc32c u32.
const UNDO_ENTRY_OVERHEAD: usize = 12;

fn undo_header(delta_id: &Digest) -> [u8; UNDO_HEADER_LEN] {
    let mut h = [0u8; UNDO_HEADER_LEN];
    h[..8].copy_from_slice(&UNDO_MAGIC);
    h[8..10].copy_from_slice(&UNDO_VERSION.to_le_bytes());
    h[12..28].copy_from_slice(delta_id);
    let crc = crate::checksum::crc32c(&h[..28]);
    h[28..].copy_from_slice(&crc.to_le_bytes());
    h
}

/// The pre-images of one refit: a header naming the delta, then entries
/// `seq | len | pre-image | crc32c`, appended and synced before the chunks
/// they belong to are recorded as started.
struct UndoLog<I: JournalIo> {
    io: I,
    path: PathBuf,
    file: I::File,
    end: u64,
}

/// Entries found in an undo file: seq -> byte range of its pre-image in `bytes`.
#[derive(Debug)]
struct UndoScan {
    bytes: Vec<u8>,
    entries: HashMap<u32, Range<usize>>,
    valid_end: usize,
}

fn undo_corrupt(path: &Path, offset: usize, detail: String) -> Error {
    Error::JournalCorrupt { path: path.to_path_buf(), offset: offset as u64, detail }
}

fn scan_undo(path: &Path, bytes: Vec<u8>, delta_id: &Digest) -> Result<UndoScan> {
    if bytes.len() < UNDO_HEADER_LEN || bytes[..8] != UNDO_MAGIC {
        return Err(undo_corrupt(path, 0, "not a dcr pre-image (undo) file: bad magic or too short".into()));
    }
    let version = u16::from_le_bytes([bytes[8], bytes[9]]);
    if version != UNDO_VERSION {
        return Err(Error::JournalVersion { path: path.to_path_buf(), found: version, supported: UNDO_VERSION });
    }
    let crc = u32::from_le_bytes(bytes[28..32].try_into().expect("4"));
    if crc != crate::checksum::crc32c(&bytes[..28]) {
        return Err(undo_corrupt(path, 28, "the header checksum does not match".into()));
    }
    if &bytes[12..28] != delta_id {
        return Err(undo_corrupt(
            path,
            12,
            format!(
                "it holds pre-images of delta {}, but the refit in flight is delta {}",
                hex(&bytes[12..28]),
                hex(delta_id)
            ),
        ));
    }
    let mut entries = HashMap::new();
    let mut pos = UNDO_HEADER_LEN;
    // Entries are appended whole and synced before use; scanning stops at the
    // first incomplete or unchecked entry (a torn tail of an append that was
    // never acknowledged).
    while bytes.len() - pos >= UNDO_ENTRY_OVERHEAD {
        let seq = u32::from_le_bytes(bytes[pos..pos + 4].try_into().expect("4"));
        let len = u32::from_le_bytes(bytes[pos + 4..pos + 8].try_into().expect("4")) as usize;
        let Some(end) = (pos + 8).checked_add(len).filter(|&e| e + 4 <= bytes.len()) else {
            break;
        };
        let crc = u32::from_le_bytes(bytes[end..end + 4].try_into().expect("4"));
        if crc != crate::checksum::crc32c(&bytes[pos..end]) {
            break;
        }
        entries.entry(seq).or_insert(pos + 8..end);
        pos = end + 4;
    }
    Ok(UndoScan { bytes, entries, valid_end: pos })
}

impl<I: JournalIo> UndoLog<I> {
    fn ioerr(path: &Path, op: &'static str, e: std::io::Error) -> Error {
        Error::JournalIo { path: path.to_path_buf(), op, source: e }
    }

    /// Creates a fresh undo file for `delta_id` (truncating an old one),
    /// durable with its directory entry when this returns.
    fn create(mut io: I, path: PathBuf, delta_id: &Digest) -> Result<Self> {
        let mut file = io.create(&path).map_err(|e| Self::ioerr(&path, "create undo file", e))?;
        let h = undo_header(delta_id);
        file.write_at(0, &h).map_err(|e| Self::ioerr(&path, "write undo header", e))?;
        file.sync_data().map_err(|e| Self::ioerr(&path, "sync undo file", e))?;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        io.sync_dir(&dir).map_err(|e| Self::ioerr(&path, "sync undo directory", e))?;
        Ok(UndoLog { io, path, file, end: UNDO_HEADER_LEN as u64 })
    }

    /// Opens the undo file of the refit in flight; every chunk in `needed`
    /// must have its pre-image there. The unchecked tail is cut off.
    fn open(mut io: I, path: PathBuf, delta_id: &Digest, needed: &[u32]) -> Result<(Self, UndoScan)> {
        let bytes = io.read(&path).map_err(|e| Self::ioerr(&path, "read undo file", e))?.ok_or_else(|| {
            undo_corrupt(
                &path,
                0,
                format!("the file is missing, but {} chunk(s) of the refit in flight touched the target and need their pre-images", needed.len()),
            )
        })?;
        let found = scan_undo(&path, bytes, delta_id)?;
        if let Some(&seq) = needed.iter().find(|s| !found.entries.contains_key(s)) {
            return Err(undo_corrupt(
                &path,
                found.valid_end,
                format!("the pre-image of chunk {seq} is missing or damaged, so the chunk cannot be repaired"),
            ));
        }
        let mut file = io.open(&path).map_err(|e| Self::ioerr(&path, "open undo file", e))?;
        if found.valid_end < found.bytes.len() {
            file.set_len(found.valid_end as u64).map_err(|e| Self::ioerr(&path, "truncate undo tail", e))?;
            file.sync_data().map_err(|e| Self::ioerr(&path, "sync undo file", e))?;
        }
        let end = found.valid_end as u64;
        Ok((UndoLog { io, path, file, end }, found))
    }

    /// Appends pre-images and syncs them.
    fn append(&mut self, entries: &[(u32, Vec<u8>)]) -> Result<()> {
        if entries.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::with_capacity(entries.iter().map(|(_, p)| p.len() + UNDO_ENTRY_OVERHEAD).sum());
        for (seq, pre) in entries {
            let start = buf.len();
            buf.extend_from_slice(&seq.to_le_bytes());
            buf.extend_from_slice(&(pre.len() as u32).to_le_bytes());
            buf.extend_from_slice(pre);
            let crc = crate::checksum::crc32c(&buf[start..]);
            buf.extend_from_slice(&crc.to_le_bytes());
        }
        if let Err(e) = self.file.write_at(self.end, &buf) {
            let _ = self.file.set_len(self.end);
            return Err(Self::ioerr(&self.path, "write pre-images", e));
        }
        self.file.sync_data().map_err(|e| Self::ioerr(&self.path, "sync pre-images", e))?;
        self.end += buf.len() as u64;
        Ok(())
    }

    fn read_all(&mut self, delta_id: &Digest) -> Result<UndoScan> {
        let bytes =
            self.io.read(&self.path).map_err(|e| Self::ioerr(&self.path, "read undo file", e))?.unwrap_or_default();
        scan_undo(&self.path, bytes, delta_id)
    }

    fn remove(mut self) {
        // Best effort: a stale undo file is ignored and replaced by the next refit.
        let _ = self.io.remove(&self.path);
    }
}

// ---------------------------------------------------------------- refit

/// Batching of the journaled apply.
#[derive(Clone, Copy, Debug)]
pub struct RefitOptions {
    /// At most this many chunks per batch (two journal batches, one undo
    /// append and one target flush each).
    pub batch_chunks: usize,
    /// At most about this many target bytes per batch.
    pub batch_bytes: u64,
    /// Every chunk is decoded before anything is written; the decoded
    /// changes of the first chunks (in target order) are kept for their
    /// batch up to about this many bytes, the others decoded again when
    /// their batch comes. So a refit holds a bounded amount of decoded
    /// changes (4 bytes of position and the word per change) whatever the
    /// delta's size, and a delta under the bound is decoded once.
    pub keep_decoded_bytes: u64,
}

impl Default for RefitOptions {
    fn default() -> Self {
        RefitOptions { batch_chunks: 256, batch_bytes: 256 << 20, keep_decoded_bytes: 256 << 20 }
    }
}

/// What a committed refit did in this call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefitReport {
    pub version: u64,
    pub digest: Digest,
    pub chunks: u32,
    /// Chunks applied from scratch in this call.
    pub applied: u32,
    /// In-progress chunks repaired (pre-image restored, applied once).
    pub repaired: u32,
    /// Chunks an earlier, interrupted call had already applied.
    pub skipped: u32,
    pub changed: u64,
    /// Whether this call resumed a refit an earlier call started.
    pub resumed: bool,
    /// A torn journal tail was cut off when the journal was opened.
    pub torn_tail: Option<TornTail>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RefitOutcome {
    Committed(RefitReport),
    /// The target already holds the delta's target version (checked by its
    /// digest); nothing was written to it.
    AlreadyAtTarget {
        version: u64,
        digest: Digest,
    },
}

/// A chunk checked and ready: its frame, target range and, while held,
/// its decoded changes.
struct Prepared<'d> {
    /// `frame.tensor` as an index.
    tensor: usize,
    range: Range<usize>,
    width: usize,
    frame: ChunkFrame<&'d [u8]>,
    /// Its changes, with the changed positions (words) of sparse encodings
    /// (`DecodedChunk::positions`; none where the chunk covers every word).
    /// `None` while not held (see `prepare`): decoded again for its batch.
    decoded: Option<DecodedChunk>,
}

/// Writes `values` (one `width`-byte word per position) at `positions`.
fn put_words(slice: &mut [u8], positions: &[u32], values: &[u8], width: usize) {
    for (i, &p) in positions.iter().enumerate() {
        slice[p as usize * width..][..width].copy_from_slice(&values[i * width..][..width]);
    }
}

/// The positions and values of a context-mode pre-image, bounds-checked
/// against a chunk of `len` bytes.
fn context_preimage(pre: &[u8], width: usize, len: usize) -> Option<(Vec<u32>, &[u8])> {
    if !pre.len().is_multiple_of(4 + width) {
        return None;
    }
    let m = pre.len() / (4 + width);
    let positions: Vec<u32> =
        pre[..4 * m].chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().expect("4"))).collect();
    positions.iter().all(|&p| (p as usize + 1) * width <= len).then_some((positions, &pre[4 * m..]))
}

impl Prepared<'_> {
    fn seq(&self) -> u32 {
        self.frame.seq
    }
    /// A context-mode chunk: decoding it reads the chunk's base bytes, so its
    /// pre-image also holds its positions (u32 LE, before the values).
    fn context(&self) -> bool {
        self.frame.mode == Mode::Context
    }
    /// Its decoded changes (held from `decode_again` to the end of its batch).
    fn changes(&self) -> &DecodedChunk {
        self.decoded.as_ref().expect("a batch's chunks are decoded before it runs")
    }
    fn preimage_len(&self) -> usize {
        match self.changes().positions() {
            Some(p) => p.len() * (self.width + if self.context() { 4 } else { 0 }),
            None => self.range.len(),
        }
    }
    fn capture(&self, slice: &[u8]) -> Vec<u8> {
        match self.changes().positions() {
            Some(ps) => {
                let w = self.width;
                let mut out = Vec::with_capacity(self.preimage_len());
                if self.context() {
                    ps.iter().for_each(|p| out.extend_from_slice(&p.to_le_bytes()));
                }
                for &p in ps {
                    out.extend_from_slice(&slice[p as usize * w..][..w]);
                }
                out
            }
            None => slice.to_vec(),
        }
    }
    /// Puts the pre-image back (its length was checked).
    fn restore(&self, slice: &mut [u8], pre: &[u8]) {
        match self.changes().positions() {
            Some(ps) => {
                let values = if self.context() { &pre[4 * ps.len()..] } else { pre };
                put_words(slice, ps, values, self.width);
            }
            None => slice.copy_from_slice(pre),
        }
    }
}

/// Where an in-progress chunk's pre-image is (the undo file read back, and
/// its path for errors), and which chunks are in progress.
type InFlight<'a> = (Option<(&'a UndoScan, &'a Path)>, &'a (dyn Fn(u32) -> bool + Sync));

/// Decodes chunks `seqs` against the target's current bytes `bufs`, all of
/// them (nothing is written unless every chunk decodes), a group of about
/// `DECODE_GROUP_BYTES` of target at a time, in target order. The decoded
/// changes of the first chunks are kept up to `keep_bytes`; the others are
/// dropped and decoded again for their batch (`decode_again`). An
/// in-progress context-mode chunk is decoded against its base rebuilt from
/// its pre-image (`in_flight`: its bytes in the target may be half-applied).
fn prepare<'d, P: AsRef<[u8]> + Sync>(
    delta: &'d Delta<P>,
    layout: &Layout,
    seqs: &[u32],
    bufs: &[&[u8]],
    in_flight: InFlight<'_>,
    keep_bytes: u64,
) -> Result<Vec<Prepared<'d>>> {
    const DECODE_GROUP_BYTES: usize = 64 << 20;
    let mut order: Vec<(ChunkFrame<&'d [u8]>, Range<usize>)> = seqs
        .iter()
        .map(|&seq| {
            let frame = delta.chunks[seq as usize].borrowed();
            let range = check_chunk(&delta.header, &frame)?;
            Ok((frame, range))
        })
        .collect::<Result<_>>()?;
    order.sort_by_key(|(frame, range)| (frame.tensor, range.start));
    let mut out: Vec<Prepared<'d>> = Vec::with_capacity(order.len());
    let mut kept = 0u64;
    let mut rest = &order[..];
    while !rest.is_empty() {
        let mut take = 0;
        let mut bytes = 0;
        while take < rest.len() && (take == 0 || bytes < DECODE_GROUP_BYTES) {
            bytes += rest[take].1.len();
            take += 1;
        }
        let (group, tail) = rest.split_at(take);
        rest = tail;
        let decoded: Vec<Prepared<'d>> = group
            .par_iter()
            .map(|(frame, range)| {
                let tensor = frame.tensor as usize;
                let mut p = Prepared {
                    tensor,
                    range: range.clone(),
                    width: layout.tensors()[tensor].dtype.word_bytes(),
                    frame: frame.clone(),
                    decoded: None,
                };
                p.decoded = Some(decode_prepared(&p, layout, &bufs[tensor][range.clone()], in_flight)?);
                Ok(p)
            })
            .collect::<Result<_>>()?;
        for mut p in decoded {
            if kept < keep_bytes {
                kept += p.changes().decoded_bytes() as u64;
            } else {
                p.decoded = None;
            }
            out.push(p);
        }
    }
    Ok(out)
}

/// Decodes `p`'s chunk against `current`, its bytes in the target.
fn decode_prepared(p: &Prepared<'_>, layout: &Layout, current: &[u8], (stored, in_progress): InFlight<'_>) -> Result<DecodedChunk> {
    let seq = p.seq();
    match stored {
        Some((s, upath)) if p.context() && in_progress(seq) => {
            let bad = || undo_corrupt(upath, 0, format!("the pre-image of context-mode chunk {seq} is damaged"));
            let pre = &s.bytes[s.entries.get(&seq).ok_or_else(bad)?.clone()];
            let (ps, values) = context_preimage(pre, p.width, p.range.len()).ok_or_else(bad)?;
            let mut base = current.to_vec();
            put_words(&mut base, &ps, values, p.width);
            let d = decode_against(&p.frame, &p.range, layout, &base)?;
            if d.positions() != Some(&ps[..]) {
                return Err(bad());
            }
            Ok(d)
        }
        _ => decode_against(&p.frame, &p.range, layout, current),
    }
}

/// Decodes the chunks of `batch` whose changes `prepare` did not keep,
/// against the target's bytes (which nothing has written there since).
fn decode_again(batch: &mut [Prepared<'_>], layout: &Layout, bufs: &[&[u8]], in_flight: InFlight<'_>) -> Result<()> {
    batch.par_iter_mut().filter(|p| p.decoded.is_none()).try_for_each(|p| {
        p.decoded = Some(decode_prepared(p, layout, &bufs[p.tensor][p.range.clone()], in_flight)?);
        Ok(())
    })
}

/// Disjoint mutable slices of `targets` for the (tensor, byte range) spans
/// (sorted by tensor, then start).
fn split<'t>(targets: Vec<&'t mut [u8]>, spans: &[(usize, Range<usize>)]) -> Vec<&'t mut [u8]> {
    let mut rests: Vec<(usize, &'t mut [u8])> = targets.into_iter().map(|t| (0usize, t)).collect();
    let mut out = Vec::with_capacity(spans.len());
    for (tensor, range) in spans {
        let (consumed, rest) = &mut rests[*tensor];
        let tail = std::mem::take(rest);
        let (_, tail) = tail.split_at_mut(range.start - *consumed);
        let (mine, tail) = tail.split_at_mut(range.len());
        *consumed = range.end;
        *rest = tail;
        out.push(mine);
    }
    out
}

fn transition(journal: &Path, op: &'static str, detail: String) -> Error {
    Error::JournalTransition { path: journal.to_path_buf(), op, detail }
}

/// Applies `delta` to `target` under the journal at `journal_path` (created
/// if missing), resuming the refit an earlier call left in flight. See the
/// module documentation for the protocol. After an error, call again (with
/// a fresh process or handle): the journal tells what to do.
///
/// Refused with the target untouched: a layout mismatch; a target whose
/// digest is neither the delta's base nor its target (wrong base, replayed
/// old delta); another delta while a refit that touched the target is in
/// flight (unless the target's digest shows it was reloaded densely); a
/// corrupt chunk payload (checked before anything is written).
pub fn refit<I: JournalIo + Clone, P: AsRef<[u8]> + Sync>(
    journal_path: &Path,
    io: I,
    delta: &Delta<P>,
    target: &mut dyn RefitTarget,
    opts: &RefitOptions,
) -> Result<RefitOutcome> {
    let h = &delta.header;
    let layout = target.layout().clone();
    h.layout.ensure_same(&layout, "target checkpoint")?;
    let (mut j, recovered) = ReceiverJournal::open(journal_path, io.clone())?;
    let upath = undo_path(journal_path);
    // A dense delta (`ANY_BASE`) overwrites every element, applies to any
    // target of its layout, and keeps no pre-images (they would be a second
    // copy of the model): an interrupted chunk is repaired by applying it
    // again, and a failed verification cannot be rolled back.
    let any_base = h.base_digest == ANY_BASE;
    let mut plan = RefitPlan {
        version: h.target_version,
        base_digest: h.base_digest,
        target_digest: h.target_digest,
        delta_id: h.delta_id,
        n_chunks: delta.chunks.len() as u32,
    };
    let same_refit = |p: &RefitPlan| {
        p.delta_id == plan.delta_id
            && p.version == plan.version
            && p.target_digest == plan.target_digest
            && p.n_chunks == plan.n_chunks
            && (any_base || p.base_digest == plan.base_digest)
    };

    // A refit in flight: resume it, or see whether the target's bits (a
    // dense reload, or writes lost in a power cut) say it can end.
    let mut resumed = false;
    let mut fresh_prepared = None;
    let mut hashed = None;
    if let Some(r) = j.state().refit.clone() {
        let found = layout.checkpoint_digest(&layout.tensor_digests(&target.buffers()));
        let same = same_refit(&r.plan);
        let mid_refit = found != r.plan.base_digest && found != h.target_digest;
        let whole = any_base || found == h.base_digest || found == h.target_digest;
        if same && ((r.touched() == 0 && found == r.plan.base_digest) || (r.touched() > 0 && mid_refit)) {
            resumed = true;
            plan = r.plan;
        } else if !same && r.touched() == 0 {
            j.abort(&format!("superseded by delta {} to version {}", hex(&h.delta_id), h.target_version))?;
        } else if !same && !whole {
            return Err(transition(
                journal_path,
                "refit",
                format!(
                    "the refit to version {} (delta {}) is in flight and has touched {} of its {} chunks: rerun with that delta to finish it (or to roll it back), or reload the target densely; delta {} to version {} was not applied and the target (digest {}) was not touched",
                    r.plan.version,
                    hex(&r.plan.delta_id),
                    r.touched(),
                    r.plan.n_chunks,
                    hex(&h.delta_id),
                    h.target_version,
                    digest_short(&found)
                ),
            ));
        }
        hashed = Some(found);
    }

    if !resumed {
        // The target's own bits say which version it holds (a dense commit
        // below ends a refit in flight that it replaced).
        let found = match hashed {
            Some(d) => d,
            None => layout.checkpoint_digest(&layout.tensor_digests(&target.buffers())),
        };
        let st = j.state().clone();
        // Whether the journal already records the target as this version.
        // Digests are the identity; a version number that differs is taken
        // from the delta (deltas built without explicit versions all say 0->1).
        let proven = |v: u64, d: &Digest| {
            st.target_is_committed() && st.committed.is_some_and(|c| &c.digest == d && c.version == v)
        };
        if found == h.target_digest {
            if !proven(h.target_version, &found) {
                j.commit_dense(h.target_version, found)?;
            }
            let _ = io.clone().remove(&upath);
            let version = j.state().committed.map_or(h.target_version, |c| c.version);
            return Ok(RefitOutcome::AlreadyAtTarget { version, digest: found });
        }
        if found != h.base_digest && !any_base {
            let found = match st.committed {
                Some(c) if c.digest == found => {
                    format!("{} (version {} in its journal)", digest_short(&found), c.version)
                }
                _ => digest_short(&found),
            };
            return Err(Error::BaseMismatch {
                base_version: h.base_version,
                target_version: h.target_version,
                base_digest: digest_short(&h.base_digest),
                found,
            });
        }
        // Decode (validate) every chunk before anything is recorded or written.
        let all: Vec<u32> = (0..plan.n_chunks).collect();
        fresh_prepared = Some(prepare(delta, &layout, &all, &target.buffers(), (None, &|_| false), opts.keep_decoded_bytes)?);
        if any_base && delta.chunks.iter().any(|c| c.kind != codec::ChangeKind::Overwrite) {
            return Err(Error::corrupt(
                "delta",
                "a dense (any-base) delta holds an XOR chunk; only overwrites apply to any base",
            ));
        }
        plan.base_digest = found;
        if !proven(h.base_version, &found) {
            // The target's digest proves it holds the base (first refit
            // under this journal, or after an abort or a dense reload).
            j.commit_dense(h.base_version, found)?;
        }
        j.begin_refit(plan)?;
    }

    let r = j.state().refit.clone().expect("a refit is in flight");
    let touched: Vec<u32> = (0..plan.n_chunks).filter(|&s| r.chunks[s as usize] != ChunkState::NotStarted).collect();
    let (mut undo, stored) = if any_base {
        (None, None)
    } else if touched.is_empty() {
        (Some(UndoLog::create(io.clone(), upath.clone(), &h.delta_id)?), None)
    } else {
        let (u, s) = UndoLog::open(io.clone(), upath.clone(), &h.delta_id, &touched)?;
        (Some(u), Some(s))
    };

    let todo: Vec<u32> = (0..plan.n_chunks).filter(|&s| r.chunks[s as usize] != ChunkState::Applied).collect();
    let skipped = plan.n_chunks - todo.len() as u32;
    let in_progress = |seq: u32| r.chunks[seq as usize] == ChunkState::InProgress;
    let in_flight: InFlight<'_> = (stored.as_ref().map(|s| (s, upath.as_path())), &in_progress);
    let mut prepared = match fresh_prepared {
        Some(p) => p,
        None => prepare(delta, &layout, &todo, &target.buffers(), in_flight, opts.keep_decoded_bytes)?,
    };
    let (mut applied, mut repaired) = (0u32, 0u32);

    // Batches in target order.
    let mut start = 0;
    while start < prepared.len() {
        let mut end = start;
        let mut bytes = 0u64;
        while end < prepared.len()
            && end - start < opts.batch_chunks.max(1)
            && (end == start || bytes < opts.batch_bytes)
        {
            bytes += prepared[end].range.len() as u64;
            end += 1;
        }
        decode_again(&mut prepared[start..end], &layout, &target.buffers(), in_flight)?;
        let batch: Vec<&Prepared<'_>> = prepared[start..end].iter().collect();
        let state = |p: &Prepared<'_>| r.chunks[p.seq() as usize];
        // 1. Pre-images of the chunks not started yet, durable first.
        let fresh: Vec<&Prepared<'_>> = batch.iter().copied().filter(|p| state(p) == ChunkState::NotStarted).collect();
        if let Some(undo) = undo.as_mut() {
            let entries: Vec<(u32, Vec<u8>)> = {
                let bufs = target.buffers();
                fresh.par_iter().map(|p| (p.seq(), p.capture(&bufs[p.tensor][p.range.clone()]))).collect()
            };
            undo.append(&entries)?;
        }
        let pre: HashMap<u32, &[u8]> = match &stored {
            Some(s) => batch
                .iter()
                .filter(|p| state(p) == ChunkState::InProgress)
                .map(|p| {
                    let r = s.entries[&p.seq()].clone();
                    let bytes = &s.bytes[r];
                    if bytes.len() != p.preimage_len() {
                        return Err(undo_corrupt(
                            &upath,
                            0,
                            format!(
                                "the pre-image of chunk {} has {} bytes, expected {}",
                                p.seq(),
                                bytes.len(),
                                p.preimage_len()
                            ),
                        ));
                    }
                    Ok((p.seq(), bytes))
                })
                .collect::<Result<_>>()?,
            None => HashMap::new(),
        };
        // 2. Record them started.
        let fresh_seqs: Vec<u32> = fresh.iter().map(|p| p.seq()).collect();
        if !fresh_seqs.is_empty() {
            j.chunks_started(&fresh_seqs)?;
        }
        // 3. Apply: in-progress chunks in overwrite form (pre-image restored,
        // then applied once), the others as they are.
        {
            let spans: Vec<(usize, Range<usize>)> = batch.iter().map(|p| (p.tensor, p.range.clone())).collect();
            let slices = split(target.buffers_mut(), &spans);
            slices.into_par_iter().zip(batch.par_iter()).for_each(|(slice, p)| {
                if let Some(old) = pre.get(&p.seq()) {
                    p.restore(slice, old);
                }
                p.changes().apply(slice, p.frame.kind);
            });
        }
        repaired += batch.iter().filter(|p| state(p) == ChunkState::InProgress).count() as u32;
        applied += fresh.len() as u32;
        // 4. Flush the touched ranges, 5. record them applied.
        let ranges: Vec<(usize, Range<usize>)> = batch.iter().map(|p| (p.tensor, p.range.clone())).collect();
        target.flush_ranges(&ranges)?;
        let seqs: Vec<u32> = batch.iter().map(|p| p.seq()).collect();
        j.chunks_applied(&seqs)?;
        // Their decoded changes are not needed again (a roll back decodes
        // from the payloads): memory back for the next batches.
        prepared[start..end].iter_mut().for_each(|p| p.decoded = None);
        start = end;
    }
    drop(stored);

    // Verify, then commit or roll back.
    let after = layout.tensor_digests(&target.buffers());
    let bad: Vec<String> = layout
        .tensors()
        .iter()
        .zip(after.iter().zip(&delta.trailer.tensor_digests))
        .filter(|(_, (a, b))| a != b)
        .map(|(t, _)| t.name.clone())
        .collect();
    if bad.is_empty() {
        j.commit(plan.version, plan.target_digest)?;
        if let Some(undo) = undo {
            undo.remove();
        }
        return Ok(RefitOutcome::Committed(RefitReport {
            version: plan.version,
            digest: plan.target_digest,
            chunks: plan.n_chunks,
            applied,
            repaired,
            skipped,
            changed: delta.trailer.n_changed,
            resumed,
            torn_tail: recovered.torn_tail,
        }));
    }
    let Some(mut undo) = undo else {
        let detail = format!(
            "the dense (any-base) delta keeps no pre-images, and its result does not match its own digests in {} tensor(s) (first: {})",
            bad.len(),
            bad[0]
        );
        j.abort(&detail)?;
        return Err(Error::RollbackIncomplete { detail });
    };
    roll_back(&mut j, &mut undo, delta, &layout, target, &plan)?;
    undo.remove();
    Err(Error::TargetMismatch { count: bad.len(), first: bad[0].clone(), tensors: bad })
}

/// Restores every chunk's pre-image (idempotent, so a crash in here is
/// repaired by running it again), verifies the base and records it.
fn roll_back<I: JournalIo + Clone, P: AsRef<[u8]> + Sync>(
    j: &mut ReceiverJournal<I>,
    undo: &mut UndoLog<I>,
    delta: &Delta<P>,
    layout: &Layout,
    target: &mut dyn RefitTarget,
    plan: &RefitPlan,
) -> Result<()> {
    let base_version = j.state().committed.map_or(delta.header.base_version, |c| c.version);
    let stored = undo.read_all(&plan.delta_id)?;
    let fail = |j: &mut ReceiverJournal<I>, detail: String| -> Result<()> {
        j.abort(&format!("roll back failed: {detail}"))?;
        Err(Error::RollbackIncomplete { detail })
    };
    // What to put back where, without decoding against the target (whose
    // bytes are the new ones now): a context-mode pre-image carries its
    // positions; a free-mode chunk's positions come from its payload alone.
    struct Restore {
        tensor: usize,
        range: Range<usize>,
        width: usize,
        positions: Option<Vec<u32>>,
        values: Range<usize>,
    }
    let mut ops = Vec::with_capacity(plan.n_chunks as usize);
    for frame in &delta.chunks {
        let seq = frame.seq;
        let range = check_chunk(&delta.header, frame)?;
        let tensor = frame.tensor as usize;
        let width = layout.tensors()[tensor].dtype.word_bytes();
        let missing = || format!("the pre-image of chunk {seq} is missing or damaged in {}", undo.path.display());
        let Some(entry) = stored.entries.get(&seq).cloned() else { return fail(j, missing()) };
        let pre = &stored.bytes[entry.clone()];
        let (positions, values) = if frame.mode == Mode::Context {
            let Some((ps, _)) = context_preimage(pre, width, range.len()) else { return fail(j, missing()) };
            let start = entry.start + 4 * ps.len();
            (Some(ps), start..entry.end)
        } else {
            match frame.encoding {
                Encoding::Dense | Encoding::Raw => (None, entry.clone()),
                Encoding::Sparse | Encoding::Bitmap | Encoding::Rice => {
                    let d = codec::decode_chunk(
                        frame.payload.as_ref(),
                        range.len() / width,
                        width,
                        frame.encoding,
                        frame.n_changed,
                        &format!("chunk {seq}"),
                    )?;
                    (d.into_positions(), entry.clone())
                }
            }
        };
        let want = positions.as_ref().map_or(range.len(), |p| p.len() * width);
        if values.len() != want {
            return fail(j, missing());
        }
        ops.push(Restore { tensor, range, width, positions, values });
    }
    ops.sort_by_key(|o| (o.tensor, o.range.start));
    let spans: Vec<(usize, Range<usize>)> = ops.iter().map(|o| (o.tensor, o.range.clone())).collect();
    {
        let slices = split(target.buffers_mut(), &spans);
        slices.into_par_iter().zip(ops.par_iter()).for_each(|(slice, o)| {
            let values = &stored.bytes[o.values.clone()];
            match &o.positions {
                Some(ps) => put_words(slice, ps, values, o.width),
                None => slice.copy_from_slice(values),
            }
        });
    }
    target.flush_ranges(&spans)?;
    let restored = layout.checkpoint_digest(&layout.tensor_digests(&target.buffers()));
    if restored != plan.base_digest {
        return fail(
            j,
            format!(
                "after restoring every pre-image the target has digest {}, not the base {}",
                hex(&restored),
                hex(&plan.base_digest)
            ),
        );
    }
    j.commit_dense(base_version, plan.base_digest)
}

// ---------------------------------------------------------------- status

/// What a receiver's journal says, read without changing anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceiverStatus {
    pub journal: PathBuf,
    /// Whether the journal file exists.
    pub exists: bool,
    pub state: ReceiverState,
    /// An uncommitted tail the next refit will cut off.
    pub torn_tail: Option<TornTail>,
    /// Size of the pre-image file, if there is one.
    pub undo_bytes: Option<u64>,
    /// Size of the spooled received delta (`spool_path`), if there is one:
    /// `dcr receive` finishes its refit on its next run.
    pub spool_bytes: Option<u64>,
}

/// Reads the journal at `journal_path` (and its undo file) read-only: no
/// torn tail is cut, nothing is created.
pub fn status<I: JournalIo>(journal_path: &Path, io: I) -> Result<ReceiverStatus> {
    status_inner(journal_path, io, None)
}

fn status_inner<I: JournalIo>(
    journal_path: &Path,
    mut io: I,
    undo_size: Option<Option<u64>>,
) -> Result<ReceiverStatus> {
    let ioerr = |op, e| Error::JournalIo { path: journal_path.to_path_buf(), op, source: e };
    let undo_bytes = match undo_size {
        Some(size) => size,
        None => io.read(&undo_path(journal_path)).map_err(|e| ioerr("read undo file", e))?.map(|b| b.len() as u64),
    };
    let Some(bytes) = io.read(journal_path).map_err(|e| ioerr("read", e))? else {
        return Ok(ReceiverStatus {
            journal: journal_path.to_path_buf(),
            exists: false,
            state: ReceiverState::default(),
            torn_tail: None,
            undo_bytes,
            spool_bytes: None,
        });
    };
    let found = scan(journal_path, &bytes)?;
    let mut state = ReceiverState::default();
    for raw in &found.records {
        let corrupt =
            |detail: String| Error::JournalCorrupt { path: journal_path.to_path_buf(), offset: raw.offset, detail };
        let rec =
            Record::decode(&raw.payload).map_err(|d| corrupt(format!("the record there cannot be decoded: {d}")))?;
        state.apply(&rec).map_err(|d| {
            corrupt(format!("the record there ({rec}) does not follow from the records before it: {d}"))
        })?;
    }
    Ok(ReceiverStatus { journal: journal_path.to_path_buf(), exists: true, state, torn_tail: found.torn, undo_bytes, spool_bytes: None })
}

// ---------------------------------------------------------------- files

/// The lock file of a journal: `<journal>.lock`.
pub fn lock_path(journal: &Path) -> PathBuf {
    let mut name = journal.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".lock");
    journal.with_file_name(name)
}

/// An exclusive advisory lock (`flock`) on `<journal>.lock`, held while a
/// refit runs, so that a second process applying to the same target fails
/// at once instead of racing the first (an XOR applied by both would undo
/// itself). The kernel drops it when its holder exits, killed or not.
#[derive(Debug)]
pub struct RefitLock {
    _file: std::fs::File,
}

impl RefitLock {
    pub fn acquire(journal: &Path) -> Result<Self> {
        let path = lock_path(journal);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io("open lock file", &path, e))?;
        #[cfg(unix)]
        {
            use std::os::fd::AsRawFd;
            // Safety: flock only takes a file descriptor that `file` owns and
            // keeps open; no memory is shared with the call.
            #[allow(unsafe_code)]
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::WouldBlock {
                    return Err(transition(
                        journal,
                        "refit",
                        format!(
                            "another process is applying a delta to this target (it holds {}): wait for it to finish, then rerun",
                            path.display()
                        ),
                    ));
                }
                return Err(Error::io("lock", &path, e));
            }
        }
        Ok(RefitLock { _file: file })
    }
}

/// Applies the delta file at `delta_path` in place to the safetensors file
/// `target`, journaled at `journal` (default `<target>.dcrj`).
pub fn refit_file(
    delta_path: &Path,
    target: &Path,
    journal: Option<&Path>,
    opts: &RefitOptions,
) -> Result<RefitOutcome> {
    let (delta, _) = crate::files::read_delta_file(delta_path)?;
    let mut ck = WritableCheckpoint::open_rw(target)?;
    let jpath = journal.map(Path::to_path_buf).unwrap_or_else(|| default_journal_path(target));
    let _lock = RefitLock::acquire(&jpath)?;
    refit(&jpath, StdIo, &delta, &mut ck, opts)
}

/// [`status`] of the receiver whose target is `target`.
pub fn status_file(target: &Path, journal: Option<&Path>) -> Result<ReceiverStatus> {
    let jpath = journal.map(Path::to_path_buf).unwrap_or_else(|| default_journal_path(target));
    // The undo file's and the spool's sizes from their metadata: they can be large.
    let size_of = |path: PathBuf, op: &'static str| match std::fs::metadata(&path) {
        Ok(m) => Ok(Some(m.len())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::JournalIo { path, op, source: e }),
    };
    let undo = size_of(undo_path(&jpath), "stat undo file")?;
    let spool = size_of(spool_path(&jpath), "stat spooled delta")?;
    let mut st = status_inner(&jpath, StdIo, Some(undo))?;
    st.spool_bytes = spool;
    Ok(st)
}

// ---------------------------------------------------------------- received deltas

/// The spooled delta of a received refit: `<journal>.delta`. It holds the
/// delta bytes a transport delivered (a relay tree, object storage) from
/// before the refit starts until it commits, so that a receiver killed
/// mid-apply resumes from its own disk, without the transport.
pub fn spool_path(journal: &Path) -> PathBuf {
    let mut name = journal.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".delta");
    journal.with_file_name(name)
}

fn remove_spool(spool: &Path) -> Result<()> {
    match std::fs::remove_file(spool) {
        Ok(()) => crate::files::sync_dir(spool.parent().unwrap_or(Path::new(""))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("remove spooled delta", spool, e)),
    }
}

/// A received delta being spooled as it arrives (a relay tree delivers it
/// frame by frame): written to a temporary sibling of the spool, then made
/// durable and applied through the journal by [`ReceivedSpool::refit`].
/// Holds the journal's lock from creation to the end of the refit, so no
/// other process applies to the target meanwhile. Dropped unfinished (an
/// error, a stream that ended early), it removes its temporary file: the
/// target was never touched.
pub struct ReceivedSpool {
    target: PathBuf,
    journal: PathBuf,
    tmp: PathBuf,
    out: Option<std::io::BufWriter<std::fs::File>>,
    _lock: RefitLock,
}

impl ReceivedSpool {
    /// Start spooling a delta for `target` (journal: `None` for
    /// `<target>.dcrj`).
    pub fn create(target: &Path, journal: Option<&Path>) -> Result<Self> {
        let journal = journal.map(Path::to_path_buf).unwrap_or_else(|| default_journal_path(target));
        let lock = RefitLock::acquire(&journal)?;
        let spool = spool_path(&journal);
        let mut name = spool.file_name().map(|n| n.to_os_string()).unwrap_or_default();
        name.push(".partial");
        let tmp = spool.with_file_name(name);
        let file = std::fs::File::create(&tmp).map_err(|e| Error::io("create", &tmp, e))?;
        Ok(ReceivedSpool {
            target: target.to_path_buf(),
            journal,
            tmp,
            out: Some(std::io::BufWriter::with_capacity(1 << 20, file)),
            _lock: lock,
        })
    }

    /// Append the next bytes of the delta (its preamble and header, a chunk
    /// frame, the trailer), in order.
    pub fn append(&mut self, bytes: &[u8]) -> Result<()> {
        let out = self.out.as_mut().expect("open until refit");
        out.write_all(bytes).map_err(|e| Error::io("write", &self.tmp, e))
    }

    /// Make the spool durable (fsync, rename, directory fsync), parse it (a
    /// corrupt or truncated delta is refused: the spool is removed, the
    /// target untouched) and apply it with [`refit`]; the spool is removed
    /// once the version commits, or when the refit fails before it began
    /// (nothing to resume).
    pub fn refit(mut self, opts: &RefitOptions) -> Result<RefitOutcome> {
        let spool = self.make_durable()?;
        let delta = match crate::files::read_delta_file(&spool) {
            Ok((delta, _)) => delta,
            Err(e) => {
                remove_spool(&spool)?;
                return Err(e);
            }
        };
        refit_spooled(&self.journal, &spool, &delta, &self.target, opts)
    }

    /// [`ReceivedSpool::refit`] of a delta the caller holds whole and
    /// parsed (`delta`, of the very bytes it appended): made durable the
    /// same way, applied from memory instead of read back.
    fn refit_parsed<P: AsRef<[u8]> + Sync>(mut self, delta: &Delta<P>, opts: &RefitOptions) -> Result<RefitOutcome> {
        let spool = self.make_durable()?;
        refit_spooled(&self.journal, &spool, delta, &self.target, opts)
    }

    /// The spool made durable: the file synced, renamed into place, the
    /// directory synced. Returns its path.
    fn make_durable(&mut self) -> Result<PathBuf> {
        let out = self.out.take().expect("open until refit");
        let file = out.into_inner().map_err(|e| Error::io("write", &self.tmp, e.into_error()))?;
        file.sync_all().map_err(|e| Error::io("sync", &self.tmp, e))?;
        drop(file);
        let spool = spool_path(&self.journal);
        std::fs::rename(&self.tmp, &spool).map_err(|e| Error::io("rename into place", &spool, e))?;
        crate::files::sync_dir(spool.parent().unwrap_or(Path::new("")))?;
        Ok(spool)
    }
}

impl Drop for ReceivedSpool {
    fn drop(&mut self) {
        if self.out.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Apply delta bytes that a transport delivered whole (object storage) to
/// the safetensors file `target`, journaled exactly like [`refit_file`]:
/// spooled durably beside the journal, applied by [`refit`] from `bytes`
/// (the spool is not read back: the delta is in memory once), the spool
/// removed once the version commits. A call that dies mid-apply leaves the
/// journal and the spool for [`resume_received`].
pub fn refit_received(bytes: &[u8], target: &Path, journal: Option<&Path>, opts: &RefitOptions) -> Result<RefitOutcome> {
    // Refused before anything is written: a corrupt delta, another layout.
    let delta = crate::delta::read_delta(bytes)?;
    delta.header.layout.ensure_same(ReadOnlyCheckpoint::open(target)?.layout(), "target checkpoint")?;
    let mut spool = ReceivedSpool::create(target, journal)?;
    spool.append(bytes)?;
    spool.refit_parsed(&delta, opts)
}

/// Finish a received refit that an earlier call started and did not commit
/// (killed, power lost), from its spooled delta. `Ok(None)` when there is
/// nothing to finish: no spool, or a spool of a refit that already ended or
/// never began (it is removed). A refit in flight without its spool is left
/// to [`refit`]'s rules (the next delta refuses or ends it).
pub fn resume_received(target: &Path, journal: Option<&Path>, opts: &RefitOptions) -> Result<Option<RefitOutcome>> {
    let jpath = journal.map(Path::to_path_buf).unwrap_or_else(|| default_journal_path(target));
    let spool = spool_path(&jpath);
    if !spool.exists() {
        return Ok(None);
    }
    let _lock = RefitLock::acquire(&jpath)?;
    let Some(in_flight) = status(&jpath, StdIo)?.state.refit.map(|r| r.plan.delta_id) else {
        remove_spool(&spool)?;
        return Ok(None);
    };
    let delta = match crate::files::read_delta_file(&spool) {
        Ok((delta, _)) => delta,
        Err(e) => {
            return Err(transition(
                &jpath,
                "resume",
                format!(
                    "a refit is in flight but its spooled delta {} cannot be read ({e}): rerun `dcr apply` with that \
                     delta to finish it, or reload the target densely",
                    spool.display()
                ),
            ))
        }
    };
    if delta.header.delta_id != in_flight {
        remove_spool(&spool)?;
        return Ok(None);
    }
    refit_spooled(&jpath, &spool, &delta, target, opts).map(Some)
}

/// [`refit`] of a spooled delta (the journal's lock held by the caller).
/// The spool is removed unless the refit failed and is still in flight
/// (it is what a later call resumes from); a refit that committed, or that
/// ended by rolling back, or that never began needs it no more.
fn refit_spooled<P: AsRef<[u8]> + Sync>(journal: &Path, spool: &Path, delta: &Delta<P>, target: &Path, opts: &RefitOptions) -> Result<RefitOutcome> {
    let mut ck = WritableCheckpoint::open_rw(target)?;
    let outcome = refit(journal, StdIo, delta, &mut ck, opts);
    let resumable =
        outcome.is_err() && status(journal, StdIo)?.state.refit.is_some_and(|r| r.plan.delta_id == delta.header.delta_id);
    if !resumable {
        remove_spool(spool)?;
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_ranges() {
        assert_eq!(default_journal_path(Path::new("/m/model.safetensors")), PathBuf::from("/m/model.safetensors.dcrj"));
        assert_eq!(undo_path(Path::new("/m/x.dcrj")), PathBuf::from("/m/x.dcrj.undo"));
        assert_eq!(spool_path(Path::new("/m/x.dcrj")), PathBuf::from("/m/x.dcrj.delta"));
    }

    #[test]
    fn undo_scan_stops_at_a_torn_entry_and_checks_the_delta() {
        let id = [3u8; 16];
        let mut b = undo_header(&id).to_vec();
        for (seq, pre) in [(0u32, vec![1u8, 2]), (5, vec![9; 7])] {
            let start = b.len();
            b.extend_from_slice(&seq.to_le_bytes());
            b.extend_from_slice(&(pre.len() as u32).to_le_bytes());
            b.extend_from_slice(&pre);
            let crc = crate::checksum::crc32c(&b[start..]);
            b.extend_from_slice(&crc.to_le_bytes());
        }
        let full = b.len();
        b.extend_from_slice(&[7, 0, 0, 0, 200, 0]); // torn
        let s = scan_undo(Path::new("u"), b.clone(), &id).unwrap();
        assert_eq!(s.valid_end, full);
        assert_eq!(&s.bytes[s.entries[&5].clone()], &[9; 7]);
        assert!(scan_undo(Path::new("u"), b.clone(), &[4; 16])
            .unwrap_err()
            .to_string()
            .contains("pre-images of delta"));
        b[full - 1] ^= 1; // damaged last entry: dropped from the index
        assert!(!scan_undo(Path::new("u"), b.clone(), &id).unwrap().entries.contains_key(&5));
        // A header that is not one, of another version, or damaged: refused
        // by what is wrong, at its offset.
        let refusal = |bytes: Vec<u8>| scan_undo(Path::new("u"), bytes, &id).unwrap_err().to_string();
        let e = refusal(b[..UNDO_HEADER_LEN - 1].to_vec());
        assert!(e.contains("not a dcr pre-image (undo) file") && e.contains("offset 0"), "{e}");
        let e = refusal([b"PK\x03\x04".as_slice(), &b[4..]].concat());
        assert!(e.contains("not a dcr pre-image (undo) file"), "{e}");
        let mut newer = b.clone();
        newer[8..10].copy_from_slice(&(UNDO_VERSION + 1).to_le_bytes());
        let e = refusal(newer);
        assert!(e.contains(&format!("format version {}", UNDO_VERSION + 1)) && e.contains(&format!("reads version {UNDO_VERSION}")), "{e}");
        let mut flipped = b;
        flipped[10] ^= 1; // the flags, under the header's checksum
        let e = refusal(flipped);
        assert!(e.contains("the header checksum does not match") && e.contains("offset 28"), "{e}");
    }
}
