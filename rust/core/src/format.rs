//! The delta wire and file format (see docs/format.md).
//!
//! ```text
//! delta   := preamble frame(Header) frame(Chunk)* frame(Trailer)
//! preamble:= "DCRDELTA" version:u16le
//! frame   := tag:u8 body_len:u32le body crc32c(tag || body_len || body):u32le
//! ```
//! Parsing is check-then-parse: `parse_frame` returns `Ok(None)` while the
//! buffer holds less than a whole frame, refuses a body length above
//! `MAX_FRAME_BODY` before reading it, and verifies the checksum before any
//! field is interpreted.

use crate::checkpoint::{Digest, Layout, TensorSpec};
use crate::codec::{ChangeKind, Encoding, Mode};
use crate::dtype::DType;
use crate::error::{Error, Result};

pub const MAGIC: &[u8; 8] = b"DCRDELTA";
pub const FORMAT_VERSION: u16 = 9;
pub const PREAMBLE_LEN: usize = 10;
/// Largest frame body accepted (a chunk's payload is bounded by its input
/// range, at most `MAX_CHUNK_BYTES`, plus stream headers).
pub const MAX_FRAME_BODY: usize = 64 << 20;
/// Largest chunk input range.
pub const MAX_CHUNK_BYTES: u32 = 32 << 20;
pub const MAX_TENSORS: u32 = 4_000_000;
const MAX_NAME: usize = 4096;
/// Largest decoded tensor table (about 1M tensors with long names).
const MAX_TABLE: usize = 256 << 20;
const MAX_DIMS: usize = 16;

const TAG_HEADER: u8 = b'H';
const TAG_CHUNK: u8 = b'C';
pub const TAG_TRAILER: u8 = b'T';
const FRAME_OVERHEAD: usize = 1 + 4 + 4;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeltaHeader {
    /// Identity of this delta: a hash over its base, target and parameters.
    pub delta_id: Digest,
    pub base_digest: Digest,
    pub target_digest: Digest,
    pub base_version: u64,
    pub target_version: u64,
    /// Chunk grid: chunk c of a tensor covers words [c*k, (c+1)*k) with
    /// k = max(1, chunk_bytes / word_bytes).
    pub chunk_bytes: u32,
    pub layout: Layout,
}

/// A chunk frame. Its payload is owned (`Vec<u8>`, as a stream reader
/// hands it on) or borrowed from the bytes it was parsed from (`&[u8]`,
/// what [`parse_frame_in`] and `delta::read_delta` give: a delta held in
/// memory is not copied a second time).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkFrame<P = Vec<u8>> {
    pub delta_tag: u64,
    pub seq: u32,
    pub tensor: u32,
    pub start: u64,
    pub len: u32,
    pub kind: ChangeKind,
    pub encoding: Encoding,
    pub mode: Mode,
    pub n_changed: u32,
    pub payload: P,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trailer {
    pub delta_tag: u64,
    pub n_chunks: u32,
    pub n_changed: u64,
    pub tensor_digests: Vec<Digest>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame<P = Vec<u8>> {
    Header(DeltaHeader),
    Chunk(ChunkFrame<P>),
    Trailer(Trailer),
}

impl Frame<&[u8]> {
    /// The frame with its payload copied out of the parsed bytes.
    pub fn into_owned(self) -> Frame {
        match self {
            Frame::Header(h) => Frame::Header(h),
            Frame::Chunk(c) => Frame::Chunk(c.into_owned()),
            Frame::Trailer(t) => Frame::Trailer(t),
        }
    }
}

impl DeltaHeader {
    /// The first 8 bytes of `delta_id`, carried by every chunk and the trailer
    /// so frames spliced from another delta are refused.
    pub fn tag(&self) -> u64 {
        u64::from_le_bytes(self.delta_id[..8].try_into().expect("8 bytes"))
    }

    pub fn chunk_words(&self, spec: &TensorSpec) -> u64 {
        chunk_words(self.chunk_bytes, spec.dtype)
    }

    pub fn compute_id(
        base: &Digest,
        target: &Digest,
        base_version: u64,
        target_version: u64,
        chunk_bytes: u32,
        extra: &[u8],
    ) -> Digest {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(b"dcr-delta-v3");
        h.update(base);
        h.update(target);
        h.update(&base_version.to_le_bytes());
        h.update(&target_version.to_le_bytes());
        h.update(&chunk_bytes.to_le_bytes());
        h.update(extra);
        h.digest128().to_le_bytes()
    }
}

pub fn chunk_words(chunk_bytes: u32, dtype: DType) -> u64 {
    (u64::from(chunk_bytes) / dtype.word_bytes() as u64).max(1)
}

// ---------------------------------------------------------------- writing

pub fn preamble() -> [u8; PREAMBLE_LEN] {
    let mut p = [0u8; PREAMBLE_LEN];
    p[..8].copy_from_slice(MAGIC);
    p[8..].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    p
}

fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
    frame_built(tag, body.len(), |out| out.extend_from_slice(body))
}

/// A frame whose body of `body_len` bytes `put_body` appends, built in
/// place (no body assembled first and then copied).
fn frame_built(tag: u8, body_len: usize, put_body: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = Vec::with_capacity(body_len + FRAME_OVERHEAD);
    out.push(tag);
    out.extend_from_slice(&(body_len as u32).to_le_bytes());
    put_body(&mut out);
    assert_eq!(out.len(), 5 + body_len, "a frame body of the length announced");
    let crc = crate::checksum::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

thread_local! {
    /// The last tensor table this thread compressed, and its stream.
    static LAST_TABLE: std::cell::RefCell<(Vec<u8>, Vec<u8>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Append the tensor table as a stream (see `DeltaHeader::to_frame`). A
/// publisher diffs one layout version after version: its table's stream is
/// kept and reused while the table stays the same (compressing it took
/// about 13 us of each diff for this repository's 51 tensors).
fn put_tensor_table(out: &mut Vec<u8>, table: &[u8]) {
    LAST_TABLE.with(|cell| {
        let (last_table, stream) = &mut *cell.borrow_mut();
        if last_table.as_slice() != table {
            last_table.clear();
            last_table.extend_from_slice(table);
            stream.clear();
            crate::codec::streams::put_stream(stream, table, 3);
        }
        out.extend_from_slice(stream);
    })
}

impl DeltaHeader {
    pub fn to_frame(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&self.delta_id);
        b.extend_from_slice(&self.base_digest);
        b.extend_from_slice(&self.target_digest);
        b.extend_from_slice(&self.base_version.to_le_bytes());
        b.extend_from_slice(&self.target_version.to_le_bytes());
        b.extend_from_slice(&self.chunk_bytes.to_le_bytes());
        b.extend_from_slice(&(self.layout.len() as u32).to_le_bytes());
        let mut table = Vec::new();
        for t in self.layout.tensors() {
            table.extend_from_slice(&(t.name.len() as u16).to_le_bytes());
            table.extend_from_slice(t.name.as_bytes());
            table.push(t.dtype.code());
            table.push(t.shape.len() as u8);
            for d in &t.shape {
                table.extend_from_slice(&d.to_le_bytes());
            }
        }
        // The tensor table (names repeat heavily) is one stream, zstd when
        // smaller. Level 3: level 9 took 1 % of a small model's whole diff
        // (its larger match tables, set up for each header) for 20 bytes
        // less (this repository's 51 tensors: 304 against 284 bytes), and
        // on an 80-layer table it came out larger (1,421 against 1,252).
        put_tensor_table(&mut b, &table);
        frame(TAG_HEADER, &b)
    }
}

impl<P> ChunkFrame<P> {
    /// The same frame with another payload.
    pub fn with_payload<Q>(&self, payload: Q) -> ChunkFrame<Q> {
        let ChunkFrame { delta_tag, seq, tensor, start, len, kind, encoding, mode, n_changed, payload: _ } = *self;
        ChunkFrame { delta_tag, seq, tensor, start, len, kind, encoding, mode, n_changed, payload }
    }
}

impl ChunkFrame<&[u8]> {
    /// The frame with its payload copied out of the parsed bytes.
    pub fn into_owned(self) -> ChunkFrame {
        self.with_payload(self.payload.to_vec())
    }
}

impl<P: AsRef<[u8]>> ChunkFrame<P> {
    /// The frame with its payload borrowed.
    pub fn borrowed(&self) -> ChunkFrame<&[u8]> {
        self.with_payload(self.payload.as_ref())
    }

    /// The delta tag, then varints and one byte of codes (kind, encoding,
    /// mode): 15-20 bytes for a typical chunk, so that a small tensor's
    /// chunk costs little more than its payload. The payload is the rest of
    /// the body.
    pub fn to_frame(&self) -> Vec<u8> {
        frame_built(TAG_CHUNK, self.frame_len() - FRAME_OVERHEAD, |b| {
            self.put_fields(b);
            b.extend_from_slice(self.payload.as_ref());
        })
    }

    /// The frame as three pieces, in order: the tag, length and fields; the
    /// payload (`self.payload`, not copied); the checksum. For a writer
    /// that appends them where they go, so that the payload is copied once
    /// (`to_frame` copies it into the frame first).
    pub fn frame_parts(&self) -> (Vec<u8>, &[u8], [u8; 4]) {
        let mut head = Vec::with_capacity(40);
        head.push(TAG_CHUNK);
        head.extend_from_slice(&((self.frame_len() - FRAME_OVERHEAD) as u32).to_le_bytes());
        self.put_fields(&mut head);
        let crc = crate::checksum::crc32c_append(crate::checksum::crc32c(&head), self.payload.as_ref());
        (head, self.payload.as_ref(), crc.to_le_bytes())
    }

    fn put_fields(&self, b: &mut Vec<u8>) {
        use crate::codec::streams::put_varint;
        b.extend_from_slice(&self.delta_tag.to_le_bytes());
        put_varint(b, self.seq.into());
        put_varint(b, self.tensor.into());
        put_varint(b, self.start);
        put_varint(b, self.len.into());
        b.push(self.kind as u8 | (self.encoding as u8) << 2 | (self.mode as u8) << 5);
        put_varint(b, self.n_changed.into());
    }

    /// Bytes of this chunk's frame (what `to_frame` returns).
    pub fn frame_len(&self) -> usize {
        let varint_len = |v: u64| (64 - (v | 1).leading_zeros() as usize).div_ceil(7);
        let fields = 8
            + varint_len(self.seq.into())
            + varint_len(self.tensor.into())
            + varint_len(self.start)
            + varint_len(self.len.into())
            + 1
            + varint_len(self.n_changed.into());
        FRAME_OVERHEAD + fields + self.payload.as_ref().len()
    }
}

impl Trailer {
    /// Bytes of the frame of a trailer over `n_tensors` tensors (its
    /// fields are fixed-size): what `to_frame` returns.
    pub fn frame_len(n_tensors: usize) -> usize {
        FRAME_OVERHEAD + 8 + 4 + 8 + 4 + 16 * n_tensors
    }

    pub fn to_frame(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&self.delta_tag.to_le_bytes());
        b.extend_from_slice(&self.n_chunks.to_le_bytes());
        b.extend_from_slice(&self.n_changed.to_le_bytes());
        b.extend_from_slice(&(self.tensor_digests.len() as u32).to_le_bytes());
        for d in &self.tensor_digests {
            b.extend_from_slice(d);
        }
        frame(TAG_TRAILER, &b)
    }
}

// ---------------------------------------------------------------- parsing

/// Bounded little-endian reader over a frame body.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    context: &'static str,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| {
            Error::truncated(self.context, n as u64, (self.buf.len() - self.pos) as u64)
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn digest(&mut self) -> Result<Digest> {
        Ok(self.take(16)?.try_into().expect("16"))
    }
    /// A LEB128 varint that must fit in `T`.
    fn varint<T: TryFrom<u64>>(&mut self, field: &str) -> Result<T> {
        let v = crate::codec::streams::get_varint(self.buf, &mut self.pos, 10)
            .ok_or_else(|| Error::corrupt(self.context, format!("{field} is cut off or longer than 10 bytes")))?;
        T::try_from(v).map_err(|_| Error::corrupt(self.context, format!("{field} {v} is out of range")))
    }
    fn done(&self) -> Result<()> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(Error::corrupt(self.context, format!("{} unexpected trailing bytes", self.buf.len() - self.pos)))
        }
    }
}

/// Check the preamble. `Ok(None)` when fewer than `PREAMBLE_LEN` bytes are
/// available.
pub fn parse_preamble(buf: &[u8]) -> Result<Option<usize>> {
    let have = buf.len().min(8);
    if buf[..have] != MAGIC[..have] {
        return Err(Error::BadMagic {
            expected: String::from_utf8_lossy(MAGIC).into(),
            found: String::from_utf8_lossy(&buf[..have]).escape_debug().to_string(),
        });
    }
    if buf.len() < PREAMBLE_LEN {
        return Ok(None);
    }
    let version = u16::from_le_bytes([buf[8], buf[9]]);
    if version != FORMAT_VERSION {
        return Err(Error::UnsupportedVersion { found: version, supported: FORMAT_VERSION });
    }
    Ok(Some(PREAMBLE_LEN))
}

/// Parse one frame from the front of `buf`. `Ok(None)` means incomplete:
/// read more bytes and call again.
pub fn parse_frame(buf: &[u8]) -> Result<Option<(Frame, usize)>> {
    Ok(parse_frame_in(buf)?.map(|(frame, used)| (frame.into_owned(), used)))
}

/// A frame parsed in place (its payload borrowed) and the bytes it took.
pub type FrameIn<'a> = (Frame<&'a [u8]>, usize);

/// [`parse_frame`] with a chunk's payload borrowed from `buf`.
pub fn parse_frame_in(buf: &[u8]) -> Result<Option<FrameIn<'_>>> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let tag = buf[0];
    if ![TAG_HEADER, TAG_CHUNK, TAG_TRAILER].contains(&tag) {
        return Err(Error::UnknownCode { what: "frame tag", code: tag, context: "delta stream".into() });
    }
    let body_len = u32::from_le_bytes(buf[1..5].try_into().expect("4")) as usize;
    if body_len > MAX_FRAME_BODY {
        return Err(Error::TooLarge { context: "frame body".into(), len: body_len as u64, max: MAX_FRAME_BODY as u64 });
    }
    let total = FRAME_OVERHEAD + body_len;
    if buf.len() < total {
        return Ok(None);
    }
    let stored = u32::from_le_bytes(buf[5 + body_len..total].try_into().expect("4"));
    let computed = crate::checksum::crc32c(&buf[..5 + body_len]);
    let body = &buf[5..5 + body_len];
    if stored != computed {
        let context = match tag {
            TAG_CHUNK => match crate::codec::streams::get_varint(body, &mut 8, 5) {
                Some(seq) => format!("chunk frame (seq {seq} if intact)"),
                None => "chunk frame".into(),
            },
            TAG_HEADER => "header frame".into(),
            _ => "trailer frame".into(),
        };
        return Err(Error::Checksum { context, expected: stored, found: computed });
    }
    let frame = match tag {
        TAG_HEADER => Frame::Header(parse_header(body)?),
        TAG_CHUNK => Frame::Chunk(parse_chunk(body)?),
        _ => Frame::Trailer(parse_trailer(body)?),
    };
    Ok(Some((frame, total)))
}

fn parse_header(body: &[u8]) -> Result<DeltaHeader> {
    let mut c = Cursor { buf: body, pos: 0, context: "header frame" };
    let delta_id = c.digest()?;
    let base_digest = c.digest()?;
    let target_digest = c.digest()?;
    let base_version = c.u64()?;
    let target_version = c.u64()?;
    let chunk_bytes = c.u32()?;
    if chunk_bytes == 0 {
        return Err(Error::corrupt("header frame", format!("chunk size 0 where 1..={MAX_CHUNK_BYTES} bytes were expected")));
    }
    if chunk_bytes > MAX_CHUNK_BYTES {
        return Err(Error::TooLarge { context: "chunk size".into(), len: chunk_bytes.into(), max: MAX_CHUNK_BYTES.into() });
    }
    let n = c.u32()?;
    if n > MAX_TENSORS {
        return Err(Error::TooLarge { context: "tensor count".into(), len: n.into(), max: MAX_TENSORS.into() });
    }
    // Each entry takes at least 4 bytes and at most 4 + MAX_NAME + 8 * MAX_DIMS.
    let max_table = ((n as usize) * (4 + MAX_NAME + 8 * MAX_DIMS)).min(MAX_TABLE);
    let mut streams = crate::codec::streams::StreamReader::new(&body[c.pos..], "header frame");
    let table = streams.next("tensor table", 4 * n as usize, max_table)?;
    streams.finish()?;
    let mut c = Cursor { buf: &table, pos: 0, context: "tensor table" };
    let mut tensors = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let name_len = c.u16()? as usize;
        if name_len > MAX_NAME {
            return Err(Error::TooLarge { context: "tensor name".into(), len: name_len as u64, max: MAX_NAME as u64 });
        }
        let name = std::str::from_utf8(c.take(name_len)?)
            .map_err(|_| Error::corrupt("header frame", "tensor name is not UTF-8"))?
            .to_string();
        let dtype = DType::from_code(c.u8()?)?;
        let ndim = c.u8()? as usize;
        if ndim > MAX_DIMS {
            return Err(Error::TooLarge { context: format!("rank of tensor {name}"), len: ndim as u64, max: MAX_DIMS as u64 });
        }
        let shape = (0..ndim).map(|_| c.u64()).collect::<Result<Vec<_>>>()?;
        tensors.push(TensorSpec { name, dtype, shape });
    }
    c.done()?;
    let sorted = tensors.windows(2).all(|w| w[0].name < w[1].name);
    let layout = Layout::new(tensors)?;
    if !sorted {
        return Err(Error::corrupt("header frame", "tensor table is not in canonical (sorted, unique) order"));
    }
    Ok(DeltaHeader { delta_id, base_digest, target_digest, base_version, target_version, chunk_bytes, layout })
}

fn parse_chunk(body: &[u8]) -> Result<ChunkFrame<&[u8]>> {
    let mut c = Cursor { buf: body, pos: 0, context: "chunk frame" };
    let delta_tag = c.u64()?;
    let seq: u32 = c.varint("sequence number")?;
    let tensor = c.varint("tensor index")?;
    let start = c.varint("start")?;
    let len = c.varint("length")?;
    let ctx = format!("chunk {seq}");
    let codes = c.u8()?;
    if codes & 0x80 != 0 {
        return Err(Error::UnknownCode { what: "chunk code byte (reserved bit set)", code: codes, context: ctx });
    }
    let kind = ChangeKind::from_code(codes & 3, &ctx)?;
    let encoding = Encoding::from_code((codes >> 2) & 7, &ctx)?;
    let mode = Mode::from_code((codes >> 5) & 3, &ctx)?;
    let n_changed = c.varint("changed count")?;
    let payload = c.take(body.len() - c.pos)?;
    Ok(ChunkFrame { delta_tag, seq, tensor, start, len, kind, encoding, mode, n_changed, payload })
}

fn parse_trailer(body: &[u8]) -> Result<Trailer> {
    let mut c = Cursor { buf: body, pos: 0, context: "trailer frame" };
    let delta_tag = c.u64()?;
    let n_chunks = c.u32()?;
    let n_changed = c.u64()?;
    let n = c.u32()?;
    if n > MAX_TENSORS || (n as usize).saturating_mul(16) > body.len() {
        return Err(Error::corrupt("trailer frame", format!("claims {n} tensor digests in {} bytes", body.len())));
    }
    let tensor_digests = (0..n).map(|_| c.digest()).collect::<Result<Vec<_>>>()?;
    c.done()?;
    Ok(Trailer { delta_tag, n_chunks, n_changed, tensor_digests })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(seq: u32, tensor: u32, start: u64, len: u32, n_changed: u32, payload: Vec<u8>) -> ChunkFrame {
        ChunkFrame {
            delta_tag: 0x0123_4567_89ab_cdef,
            seq,
            tensor,
            start,
            len,
            kind: ChangeKind::Overwrite,
            encoding: Encoding::Bitmap,
            mode: Mode::Context,
            n_changed,
            payload,
        }
    }

    #[test]
    fn chunk_frames_round_trip_at_the_field_limits_and_know_their_length() {
        for c in [
            chunk(0, 0, 0, 1, 1, vec![]),
            chunk(127, 128, 16383, 16384, 300, vec![7; 1000]),
            chunk(u32::MAX, u32::MAX, u64::MAX, u32::MAX, u32::MAX, vec![0xff; 3]),
        ] {
            let bytes = c.to_frame();
            assert_eq!(bytes.len(), c.frame_len());
            // The diff writes the frame in three pieces: the same bytes.
            let (head, payload, crc) = c.frame_parts();
            assert_eq!([&head[..], payload, &crc[..]].concat(), bytes);
            let (parsed, used) = parse_frame(&bytes).unwrap().unwrap();
            assert_eq!(used, bytes.len());
            assert_eq!(parsed, Frame::Chunk(c));
        }
        // A small chunk's fields: the tag, one byte per small varint, the code byte.
        let small = chunk(3, 5, 0, 256, 2, vec![1, 2, 3]);
        assert_eq!(small.frame_len(), FRAME_OVERHEAD + 8 + 1 + 1 + 1 + 2 + 1 + 1 + 3);
    }

    /// A frame around `body` with a valid checksum, so the field checks are
    /// what refuses it.
    fn chunk_with_body(body: &[u8]) -> Vec<u8> {
        frame(TAG_CHUNK, body)
    }

    #[test]
    fn bad_chunk_fields_are_refused_by_name() {
        let good = chunk(9, 1, 0, 64, 2, vec![5, 6]).to_frame();
        let body = &good[5..good.len() - 4];
        // body: tag(8) seq tensor start len codes n_changed payload
        let codes_at = 8 + 4;
        let mut reserved = body.to_vec();
        reserved[codes_at] |= 0x80;
        let e = parse_frame(&chunk_with_body(&reserved)).unwrap_err().to_string();
        assert!(e.contains("reserved bit"), "{e}");
        let mut encoding = body.to_vec();
        encoding[codes_at] = (encoding[codes_at] & !(7 << 2)) | (6 << 2);
        let e = parse_frame(&chunk_with_body(&encoding)).unwrap_err().to_string();
        assert!(e.contains("encoding") && e.contains('6'), "{e}");
        // A varint that runs past the body, and one too large for its field.
        let e = parse_frame(&chunk_with_body(&body[..9])).unwrap_err().to_string();
        assert!(e.contains("cut off"), "{e}");
        let mut huge = body[..8].to_vec();
        huge.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x7f]); // seq = 2^35 - 1
        huge.extend_from_slice(&body[9..]);
        let e = parse_frame(&chunk_with_body(&huge)).unwrap_err().to_string();
        assert!(e.contains("sequence number") && e.contains("out of range"), "{e}");
    }

    /// A header frame's body: digests and versions (zeros), `chunk_bytes`,
    /// `n` and the tensor table as one stream, entries (name bytes, dtype
    /// code, shape) written as given with `extra` bytes after them.
    fn header_frame(chunk_bytes: u32, n: u32, entries: &[(&[u8], u8, &[u64])], extra: &[u8]) -> Vec<u8> {
        let mut b = vec![0u8; 3 * 16 + 8 + 8];
        b.extend_from_slice(&chunk_bytes.to_le_bytes());
        b.extend_from_slice(&n.to_le_bytes());
        let mut table = Vec::new();
        for (name, code, shape) in entries {
            table.extend_from_slice(&(name.len() as u16).to_le_bytes());
            table.extend_from_slice(name);
            table.push(*code);
            table.push(shape.len() as u8);
            shape.iter().for_each(|d| table.extend_from_slice(&d.to_le_bytes()));
        }
        table.extend_from_slice(extra);
        crate::codec::streams::put_stream(&mut b, &table, 3);
        frame(TAG_HEADER, &b)
    }

    /// The tensor table's stream is reused only while the table stays the
    /// same: headers of two layouts, in turn on one thread, each read back
    /// as written.
    #[test]
    fn headers_of_alternating_layouts_read_back_as_written() {
        let bf16 = DType::from_name("BF16").unwrap();
        let layout = |names: &[&str]| {
            Layout::new(names.iter().map(|n| TensorSpec { name: n.to_string(), dtype: bf16, shape: vec![2, 3] }).collect()).unwrap()
        };
        let (a, b) = (layout(&["x", "y"]), layout(&["x", "z", "w"]));
        for l in [&a, &b, &a, &a, &b] {
            let h = DeltaHeader { delta_id: [1; 16], base_digest: [2; 16], target_digest: [3; 16], base_version: 4, target_version: 5, chunk_bytes: 64, layout: l.clone() };
            let Some((Frame::Header(back), _)) = parse_frame(&h.to_frame()).unwrap() else { panic!("a header") };
            assert_eq!(back, h);
        }
    }

    /// Header and trailer fields past their limits or out of order are
    /// refused by name, before anything is sized by them; the same frames
    /// within the limits parse.
    #[test]
    fn bad_header_and_trailer_fields_are_refused_by_name() {
        let bf16 = DType::from_name("BF16").unwrap().code();
        let (a, b): (&[u8], &[u8]) = (b"a", b"b");
        let two = [(a, bf16, &[4u64, 2][..]), (b, bf16, &[3u64][..])];
        let Some((Frame::Header(h), _)) = parse_frame(&header_frame(1024, 2, &two, &[])).unwrap() else { panic!("a header") };
        assert_eq!(h.layout.len(), 2);
        let long_name = vec![b'x'; MAX_NAME + 1];
        let not_utf8: &[u8] = &[0xff, 0xfe];
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("no chunk size", header_frame(0, 2, &two, &[]), "chunk size 0 where 1..=33554432 bytes were expected"),
            ("chunks too large", header_frame(MAX_CHUNK_BYTES + 1, 2, &two, &[]), "chunk size: length 33554433"),
            ("too many tensors", header_frame(1024, MAX_TENSORS + 1, &two, &[]), "tensor count: length 4000001"),
            ("more tensors than entries", header_frame(1024, 3, &two, &[]), "tensor table"),
            ("bytes after the entries", header_frame(1024, 2, &two, &[0]), "1 unexpected trailing bytes"),
            ("a name too long", header_frame(1024, 1, &[(&long_name, bf16, &[1])], &[]), "tensor name: length 4097"),
            ("a name not UTF-8", header_frame(1024, 1, &[(not_utf8, bf16, &[1])], &[]), "tensor name is not UTF-8"),
            ("too many dimensions", header_frame(1024, 1, &[(a, bf16, &[1; MAX_DIMS + 1])], &[]), "rank of tensor a: length 17"),
            ("an unknown dtype", header_frame(1024, 1, &[(a, 0xee, &[1])], &[]), "238"),
            ("names out of order", header_frame(1024, 2, &[two[1], two[0]], &[]), "not in canonical (sorted, unique) order"),
        ];
        for (what, frame, expected) in cases {
            let err = parse_frame(&frame).err().unwrap_or_else(|| panic!("{what}: parsed"));
            assert!(err.to_string().contains(expected), "{what}: {err}");
        }
        // A trailer that claims more digests than its body holds, and one
        // with bytes after its digests.
        let trailer = Trailer { delta_tag: 7, n_chunks: 1, n_changed: 1, tensor_digests: vec![[3u8; 16]; 2] }.to_frame();
        assert_eq!(trailer.len(), Trailer::frame_len(2));
        assert!(matches!(parse_frame(&trailer).unwrap(), Some((Frame::Trailer(t), _)) if t.tensor_digests.len() == 2));
        let body = &trailer[5..trailer.len() - 4];
        let mut claims = body.to_vec();
        claims[20..24].copy_from_slice(&1000u32.to_le_bytes());
        let err = parse_frame(&frame(TAG_TRAILER, &claims)).unwrap_err().to_string();
        assert!(err.contains("claims 1000 tensor digests in 56 bytes"), "{err}");
        let mut longer = body.to_vec();
        longer.push(0);
        let err = parse_frame(&frame(TAG_TRAILER, &longer)).unwrap_err().to_string();
        assert!(err.contains("1 unexpected trailing bytes"), "{err}");
    }
}
