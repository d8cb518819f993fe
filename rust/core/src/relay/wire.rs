//! Wire messages and their framing.
//!
//! ```text
//! frame = len: u32 LE | kind: u8 | body: [u8; len - 1] | crc32c(kind | body): u32 LE
//! ```
//! Decoding is check-then-parse on a `BytesMut`: the length is bounded by
//! `max_frame` before anything is allocated, an incomplete frame returns
//! `Ok(None)`, and blobs are split off the buffer without copying.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::error::{Error, Result};

/// Protocol version carried in `Hello`.
pub const PROTO_VERSION: u16 = 1;
/// Bytes around a frame's body: length prefix and CRC.
pub const FRAME_OVERHEAD: usize = 8;
/// Default maximum frame length (kind + body): large enough for 16 MiB dense chunks.
pub const DEFAULT_MAX_FRAME: usize = 32 << 20;
/// Largest frame accepted before the peer is authenticated (handshake
/// messages are small; an unauthenticated peer cannot make us buffer more).
pub const PRE_AUTH_MAX_FRAME: usize = 16 * 1024;
/// Length of a handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Length of an HMAC-SHA256 proof.
pub const PROOF_LEN: usize = 32;
/// Length of a receiver digest in an ack.
pub const DIGEST_LEN: usize = 16;
/// Maximum length of a text field (node ids, reasons).
pub const MAX_TEXT: usize = 4096;

/// The delta id of a stream: the first 16 bytes of its header blob.
pub fn delta_id(header: &[u8]) -> Option<[u8; 16]> {
    header.get(..16).map(|b| b.try_into().expect("16 bytes"))
}

/// Lowercase hex of bytes (for logs).
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Who opens a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The trainer side, sending one version's stream to a root relay.
    Publisher = 0,
    /// A relay attaching to its parent.
    Relay = 1,
    /// A receiver (rollout server).
    Subscriber = 2,
}

impl Role {
    fn from_u8(v: u8) -> Result<Self> {
        Ok(match v {
            0 => Role::Publisher,
            1 => Role::Relay,
            2 => Role::Subscriber,
            _ => return Err(Error::protocol("role 0, 1 or 2", format!("role {v}"))),
        })
    }
}

/// Error codes carried by [`Message::Error`].
pub mod code {
    /// Credentials refused.
    pub const AUTH_REFUSED: u16 = 1;
    /// A resume asked for data the relay no longer holds.
    pub const RESUME_UNAVAILABLE: u16 = 2;
    /// Protocol violation.
    pub const PROTOCOL: u16 = 3;
    /// Connection cap reached.
    pub const BUSY: u16 = 4;
    /// The relay is shutting down.
    pub const SHUTTING_DOWN: u16 = 5;
    /// The role is not accepted here (e.g. a publisher on a non-root relay).
    pub const ROLE_REFUSED: u16 = 6;
}

/// Where a reconnecting receiver resumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    /// Version being received.
    pub version: u64,
    /// First sequence number not yet held.
    pub next_seq: u32,
    /// Whether the stream header was already delivered.
    pub have_header: bool,
}

/// A receiver's verdict on one version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ack {
    /// Version verified.
    pub version: u64,
    /// Receiver's node id.
    pub node_id: String,
    /// Digest of what it holds after applying.
    pub digest: [u8; DIGEST_LEN],
    /// Committed (`true`) or failed.
    pub ok: bool,
    /// Reason of a failure (empty when ok).
    pub reason: String,
}

/// Protocol messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Client → server, first message.
    Hello {
        proto: u16,
        role: Role,
        has_key: bool,
        node_id: String,
        nonce: [u8; NONCE_LEN],
    },
    /// Server → client: server nonce and proof of the key.
    ServerHello {
        has_key: bool,
        nonce: [u8; NONCE_LEN],
        proof: [u8; PROOF_LEN],
    },
    /// Client → server: proof of the key.
    ClientProof { proof: [u8; PROOF_LEN] },
    /// Server → client: authenticated; payload may flow.
    AuthOk,
    /// Either way: a fatal error; the sender closes afterwards.
    Error { code: u16, reason: String },
    /// Child → parent: what to stream.
    Subscribe {
        from_version: u64,
        follow: bool,
        resume: Option<Resume>,
    },
    /// Stream header of a version (opaque; first 16 bytes are the delta id).
    Header { version: u64, blob: Bytes },
    /// One chunk.
    Chunk { version: u64, seq: u32, blob: Bytes },
    /// End of a version: chunk count and opaque trailer.
    End {
        version: u64,
        count: u32,
        trailer: Bytes,
    },
    /// Child → parent (and up the tree): a receiver's verdict.
    Ack(Ack),
    /// Parent → child: an ack was recorded.
    AckReceived { version: u64, node_id: String },
    /// Keep-alive sent by an idle parent.
    Heartbeat,
}

mod kind {
    pub const HELLO: u8 = 1;
    pub const SERVER_HELLO: u8 = 2;
    pub const CLIENT_PROOF: u8 = 3;
    pub const AUTH_OK: u8 = 4;
    pub const ERROR: u8 = 5;
    pub const SUBSCRIBE: u8 = 10;
    pub const HEADER: u8 = 11;
    pub const CHUNK: u8 = 12;
    pub const END: u8 = 13;
    pub const ACK: u8 = 20;
    pub const ACK_RECEIVED: u8 = 21;
    pub const HEARTBEAT: u8 = 22;
}

impl Message {
    /// Short name for logs and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello { .. } => "Hello",
            Message::ServerHello { .. } => "ServerHello",
            Message::ClientProof { .. } => "ClientProof",
            Message::AuthOk => "AuthOk",
            Message::Error { .. } => "Error",
            Message::Subscribe { .. } => "Subscribe",
            Message::Header { .. } => "Header",
            Message::Chunk { .. } => "Chunk",
            Message::End { .. } => "End",
            Message::Ack(_) => "Ack",
            Message::AckReceived { .. } => "AckReceived",
            Message::Heartbeat => "Heartbeat",
        }
    }

    /// Bytes of payload (blobs) carried, for metrics.
    pub fn payload_len(&self) -> usize {
        match self {
            Message::Header { blob, .. } | Message::Chunk { blob, .. } => blob.len(),
            Message::End { trailer, .. } => trailer.len(),
            _ => 0,
        }
    }

    /// Append the framed message to `out`.
    pub fn encode(&self, out: &mut BytesMut) {
        let start = out.len();
        out.put_u32_le(0); // patched below
        match self {
            Message::Hello {
                proto,
                role,
                has_key,
                node_id,
                nonce,
            } => {
                out.put_u8(kind::HELLO);
                out.put_u16_le(*proto);
                out.put_u8(*role as u8);
                out.put_u8(*has_key as u8);
                put_text(out, node_id);
                out.put_slice(nonce);
            }
            Message::ServerHello {
                has_key,
                nonce,
                proof,
            } => {
                out.put_u8(kind::SERVER_HELLO);
                out.put_u8(*has_key as u8);
                out.put_slice(nonce);
                out.put_slice(proof);
            }
            Message::ClientProof { proof } => {
                out.put_u8(kind::CLIENT_PROOF);
                out.put_slice(proof);
            }
            Message::AuthOk => out.put_u8(kind::AUTH_OK),
            Message::Error { code, reason } => {
                out.put_u8(kind::ERROR);
                out.put_u16_le(*code);
                put_text(out, reason);
            }
            Message::Subscribe {
                from_version,
                follow,
                resume,
            } => {
                out.put_u8(kind::SUBSCRIBE);
                out.put_u64_le(*from_version);
                out.put_u8(*follow as u8);
                match resume {
                    None => out.put_u8(0),
                    Some(r) => {
                        out.put_u8(1);
                        out.put_u64_le(r.version);
                        out.put_u32_le(r.next_seq);
                        out.put_u8(r.have_header as u8);
                    }
                }
            }
            Message::Header { version, blob } => {
                out.put_u8(kind::HEADER);
                out.put_u64_le(*version);
                out.put_slice(blob);
            }
            Message::Chunk { version, seq, blob } => {
                out.put_u8(kind::CHUNK);
                out.put_u64_le(*version);
                out.put_u32_le(*seq);
                out.put_slice(blob);
            }
            Message::End {
                version,
                count,
                trailer,
            } => {
                out.put_u8(kind::END);
                out.put_u64_le(*version);
                out.put_u32_le(*count);
                out.put_slice(trailer);
            }
            Message::Ack(a) => {
                out.put_u8(kind::ACK);
                out.put_u64_le(a.version);
                put_text(out, &a.node_id);
                out.put_slice(&a.digest);
                out.put_u8(a.ok as u8);
                put_text(out, &a.reason);
            }
            Message::AckReceived { version, node_id } => {
                out.put_u8(kind::ACK_RECEIVED);
                out.put_u64_le(*version);
                put_text(out, node_id);
            }
            Message::Heartbeat => out.put_u8(kind::HEARTBEAT),
        }
        let body_len = out.len() - start - 4;
        let crc = crate::checksum::crc32c(&out[start + 4..]);
        out[start..start + 4].copy_from_slice(&(body_len as u32).to_le_bytes());
        out.put_u32_le(crc);
    }

    /// Encode into a fresh buffer.
    pub fn to_bytes(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(64 + self.payload_len());
        self.encode(&mut b);
        b.freeze()
    }
}

/// A framed message in three pieces, so a large blob is written to the
/// socket without being copied into a frame buffer.
#[derive(Debug, Clone)]
pub struct Parts {
    /// Length prefix, kind and fixed fields.
    pub head: Bytes,
    /// The blob (empty for messages without one).
    pub blob: Bytes,
    /// The rest: the CRC (and for blob-less messages, nothing else).
    pub tail: [u8; 4],
    /// Whether `tail` is to be written (messages without a blob carry their CRC in `head`).
    pub has_tail: bool,
}

impl Parts {
    /// Total bytes on the wire.
    pub fn len(&self) -> usize {
        self.head.len() + self.blob.len() + if self.has_tail { 4 } else { 0 }
    }
    /// Whether empty (never, for a real message).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Message {
    /// Frame the message without copying its blob.
    pub fn encode_parts(&self) -> Parts {
        let (blob, fixed): (&Bytes, Message) = match self {
            Message::Header { version, blob } => (
                blob,
                Message::Header {
                    version: *version,
                    blob: Bytes::new(),
                },
            ),
            Message::Chunk { version, seq, blob } => (
                blob,
                Message::Chunk {
                    version: *version,
                    seq: *seq,
                    blob: Bytes::new(),
                },
            ),
            Message::End {
                version,
                count,
                trailer,
            } => (
                trailer,
                Message::End {
                    version: *version,
                    count: *count,
                    trailer: Bytes::new(),
                },
            ),
            _ => {
                return Parts {
                    head: self.to_bytes(),
                    blob: Bytes::new(),
                    tail: [0; 4],
                    has_tail: false,
                }
            }
        };
        let mut head = BytesMut::with_capacity(32);
        fixed.encode(&mut head);
        head.truncate(head.len() - 4); // drop the CRC of the blob-less frame
        let body_len = head.len() - 4 + blob.len();
        head[0..4].copy_from_slice(&(body_len as u32).to_le_bytes());
        let crc = crate::checksum::crc32c_append(crate::checksum::crc32c(&head[4..]), blob);
        Parts {
            head: head.freeze(),
            blob: blob.clone(),
            tail: crc.to_le_bytes(),
            has_tail: true,
        }
    }
}

fn put_text(out: &mut BytesMut, s: &str) {
    let b = s.as_bytes();
    let n = b.len().min(MAX_TEXT);
    // Truncate on a char boundary.
    let mut n2 = n;
    while !s.is_char_boundary(n2) {
        n2 -= 1;
    }
    out.put_u16_le(n2 as u16);
    out.put_slice(&b[..n2]);
}

/// Decode one frame from the front of `buf`.
///
/// Returns `Ok(None)` when `buf` does not yet hold a whole frame (the caller
/// reads more), `Err` on a frame longer than `max_frame`, a bad CRC or a
/// malformed body. Consumes the frame's bytes on success.
pub fn decode(buf: &mut BytesMut, max_frame: usize) -> Result<Option<Message>> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if len == 0 {
        return Err(Error::protocol(
            "a frame of at least 1 byte",
            "an empty frame",
        ));
    }
    if len > max_frame {
        return Err(Error::FrameTooLarge {
            len: len as u64,
            max: max_frame as u64,
        });
    }
    let total = 4usize
        .checked_add(len)
        .and_then(|x| x.checked_add(4))
        .expect("bounded by max_frame");
    if buf.len() < total {
        // Reserve at most what this (bounded) frame needs.
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    let expected = u32::from_le_bytes(buf[4 + len..total].try_into().expect("4 bytes"));
    let found = crate::checksum::crc32c(&buf[4..4 + len]);
    if expected != found {
        return Err(Error::MessageChecksum { expected, found });
    }
    buf.advance(4);
    let mut body = buf.split_to(len).freeze();
    buf.advance(4);
    let k = body.get_u8();
    let msg = parse_body(k, &mut body)?;
    Ok(Some(msg))
}

struct Rd<'a>(&'a mut Bytes, u8);

impl Rd<'_> {
    fn need(&self, n: usize) -> Result<()> {
        if self.0.remaining() < n {
            return Err(Error::protocol(
                format!("{n} more bytes in a message of kind {}", self.1),
                format!("{} bytes", self.0.remaining()),
            ));
        }
        Ok(())
    }
    fn u8(&mut self) -> Result<u8> {
        self.need(1)?;
        Ok(self.0.get_u8())
    }
    fn bool(&mut self) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(Error::protocol("a flag 0 or 1", format!("{v}"))),
        }
    }
    fn u16(&mut self) -> Result<u16> {
        self.need(2)?;
        Ok(self.0.get_u16_le())
    }
    fn u32(&mut self) -> Result<u32> {
        self.need(4)?;
        Ok(self.0.get_u32_le())
    }
    fn u64(&mut self) -> Result<u64> {
        self.need(8)?;
        Ok(self.0.get_u64_le())
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N]> {
        self.need(N)?;
        let mut a = [0u8; N];
        self.0.copy_to_slice(&mut a);
        Ok(a)
    }
    fn text(&mut self) -> Result<String> {
        let n = self.u16()? as usize;
        if n > MAX_TEXT {
            return Err(Error::protocol(
                format!("a text field of at most {MAX_TEXT} bytes"),
                format!("{n} bytes"),
            ));
        }
        self.need(n)?;
        let b = self.0.split_to(n);
        String::from_utf8(b.to_vec()).map_err(|_| Error::protocol("UTF-8 text", "invalid UTF-8"))
    }
    fn rest(&mut self) -> Bytes {
        self.0.split_off(0)
    }
    fn done(&self) -> Result<()> {
        if self.0.has_remaining() {
            return Err(Error::protocol(
                format!("end of a message of kind {}", self.1),
                format!("{} trailing bytes", self.0.remaining()),
            ));
        }
        Ok(())
    }
}

fn parse_body(k: u8, body: &mut Bytes) -> Result<Message> {
    let mut r = Rd(body, k);
    let m = match k {
        kind::HELLO => Message::Hello {
            proto: r.u16()?,
            role: Role::from_u8(r.u8()?)?,
            has_key: r.bool()?,
            node_id: r.text()?,
            nonce: r.arr()?,
        },
        kind::SERVER_HELLO => Message::ServerHello {
            has_key: r.bool()?,
            nonce: r.arr()?,
            proof: r.arr()?,
        },
        kind::CLIENT_PROOF => Message::ClientProof { proof: r.arr()? },
        kind::AUTH_OK => Message::AuthOk,
        kind::ERROR => Message::Error {
            code: r.u16()?,
            reason: r.text()?,
        },
        kind::SUBSCRIBE => {
            let from_version = r.u64()?;
            let follow = r.bool()?;
            let resume = if r.bool()? {
                Some(Resume {
                    version: r.u64()?,
                    next_seq: r.u32()?,
                    have_header: r.bool()?,
                })
            } else {
                None
            };
            Message::Subscribe {
                from_version,
                follow,
                resume,
            }
        }
        kind::HEADER => {
            let version = r.u64()?;
            return Ok(Message::Header {
                version,
                blob: r.rest(),
            });
        }
        kind::CHUNK => {
            let version = r.u64()?;
            let seq = r.u32()?;
            return Ok(Message::Chunk {
                version,
                seq,
                blob: r.rest(),
            });
        }
        kind::END => {
            let version = r.u64()?;
            let count = r.u32()?;
            return Ok(Message::End {
                version,
                count,
                trailer: r.rest(),
            });
        }
        kind::ACK => Message::Ack(Ack {
            version: r.u64()?,
            node_id: r.text()?,
            digest: r.arr()?,
            ok: r.bool()?,
            reason: r.text()?,
        }),
        kind::ACK_RECEIVED => Message::AckReceived {
            version: r.u64()?,
            node_id: r.text()?,
        },
        kind::HEARTBEAT => Message::Heartbeat,
        other => {
            return Err(Error::protocol(
                "a known message kind",
                format!("kind {other}"),
            ))
        }
    };
    r.done()?;
    Ok(m)
}

/// Incremental decoder: push received bytes, pull messages.
#[derive(Debug)]
pub struct Framer {
    buf: BytesMut,
    max_frame: usize,
}

impl Framer {
    /// A decoder refusing frames longer than `max_frame`.
    pub fn new(max_frame: usize) -> Self {
        Framer {
            buf: BytesMut::with_capacity(8 * 1024),
            max_frame,
        }
    }
    /// Change the largest frame accepted (raised once the peer is authenticated).
    pub fn set_max_frame(&mut self, max_frame: usize) {
        self.max_frame = max_frame;
    }
    /// Append received bytes.
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }
    /// The buffer to read into directly (avoids a copy in the I/O layer).
    pub fn buf_mut(&mut self) -> &mut BytesMut {
        &mut self.buf
    }
    /// Next complete message, if any.
    pub fn next_message(&mut self) -> Result<Option<Message>> {
        decode(&mut self.buf, self.max_frame)
    }
    /// Bytes buffered and not yet decoded.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Message> {
        vec![
            Message::Hello {
                proto: 1,
                role: Role::Relay,
                has_key: true,
                node_id: "r1".into(),
                nonce: [7; 32],
            },
            Message::ServerHello {
                has_key: false,
                nonce: [1; 32],
                proof: [2; 32],
            },
            Message::ClientProof { proof: [3; 32] },
            Message::AuthOk,
            Message::Error {
                code: 2,
                reason: "gone".into(),
            },
            Message::Subscribe {
                from_version: 3,
                follow: true,
                resume: None,
            },
            Message::Subscribe {
                from_version: 0,
                follow: false,
                resume: Some(Resume {
                    version: 9,
                    next_seq: 4,
                    have_header: true,
                }),
            },
            Message::Header {
                version: 5,
                blob: Bytes::from_static(b"0123456789abcdefHDR"),
            },
            Message::Chunk {
                version: 5,
                seq: 0,
                blob: Bytes::new(),
            },
            Message::Chunk {
                version: 5,
                seq: 77,
                blob: Bytes::from(vec![9u8; 1000]),
            },
            Message::End {
                version: 5,
                count: 78,
                trailer: Bytes::from_static(b"tr"),
            },
            Message::Ack(Ack {
                version: 5,
                node_id: "s".into(),
                digest: [4; 16],
                ok: false,
                reason: "bad".into(),
            }),
            Message::AckReceived {
                version: 5,
                node_id: "s".into(),
            },
            Message::Heartbeat,
        ]
    }

    #[test]
    fn roundtrip_byte_by_byte() {
        let mut wire = BytesMut::new();
        for m in all() {
            m.encode(&mut wire);
        }
        let mut f = Framer::new(1 << 20);
        let mut got = vec![];
        for b in wire.iter() {
            f.push(&[*b]);
            while let Some(m) = f.next_message().unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got, all());
        assert_eq!(f.buffered(), 0);
    }

    #[test]
    fn parts_equal_encode() {
        for m in all() {
            let p = m.encode_parts();
            let mut v = p.head.to_vec();
            v.extend_from_slice(&p.blob);
            if p.has_tail {
                v.extend_from_slice(&p.tail);
            }
            assert_eq!(v, m.to_bytes().to_vec(), "{}", m.name());
        }
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(proptest::num::u8::ANY, 0..600), max in 1usize..512) {
            let mut f = Framer::new(max);
            f.push(&data);
            for _ in 0..data.len() + 1 {
                match f.next_message() {
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => break,
                }
            }
            proptest::prop_assert!(f.buf.capacity() <= 8 * 1024 + max + 16 + data.len());
        }

        #[test]
        fn flipped_bit_never_decodes_silently(seq in 0u32..1000, len in 0usize..300, bit in 0usize..8, pos in 0usize..10_000) {
            let m = Message::Chunk { version: 3, seq, blob: Bytes::from(vec![0xA5; len]) };
            let mut b = BytesMut::new();
            m.encode(&mut b);
            let i = pos % b.len();
            b[i] ^= 1 << bit;
            if let Ok(Some(got)) = decode(&mut b, 1 << 20) {
                proptest::prop_assert!(false, "corruption decoded as {got:?}");
            }
        }
    }

    #[test]
    fn oversized_length_refused_before_allocation() {
        let mut b = BytesMut::from(&[0xff, 0xff, 0xff, 0xff, 1][..]);
        let e = decode(&mut b, 1024).unwrap_err();
        assert!(
            matches!(
                e,
                Error::FrameTooLarge {
                    len: 0xffff_ffff,
                    max: 1024
                }
            ),
            "{e}"
        );
        assert!(b.capacity() < 1 << 20);
    }

    #[test]
    fn corrupted_byte_detected() {
        let mut b = BytesMut::new();
        Message::Chunk {
            version: 1,
            seq: 2,
            blob: Bytes::from(vec![5u8; 100]),
        }
        .encode(&mut b);
        b[50] ^= 0x10;
        assert!(matches!(
            decode(&mut b, 1024).unwrap_err(),
            Error::MessageChecksum { .. }
        ));
    }

    #[test]
    fn truncated_body_is_protocol_error() {
        // kind ACK_RECEIVED with only 3 body bytes, valid crc.
        let mut b = framed(&[kind::ACK_RECEIVED, 1, 2, 3]);
        assert!(matches!(
            decode(&mut b, 1024).unwrap_err(),
            Error::Protocol { .. }
        ));
    }

    /// `body` framed as a peer would send it: length, body, crc32c.
    fn framed(body: &[u8]) -> BytesMut {
        let mut out = BytesMut::new();
        out.put_u32_le(body.len() as u32);
        out.put_slice(body);
        out.put_u32_le(crate::checksum::crc32c(body));
        out
    }

    /// Messages that pass their checksum but whose fields are wrong (what a
    /// peer of another version or a buggy one sends) are each refused by
    /// what was expected and what came.
    #[test]
    fn well_framed_messages_with_bad_fields_are_refused_by_name() {
        let text = |n: usize, byte: u8| [&(n as u16).to_le_bytes()[..], &vec![byte; n]].concat();
        let hello = |role: u8| [&[kind::HELLO][..], &1u16.to_le_bytes(), &[role, 0], &text(1, b'n'), &[0; NONCE_LEN]].concat();
        decode(&mut framed(&hello(2)), 1 << 20).unwrap().expect("a valid Hello");
        let cases: Vec<(&str, BytesMut, &str)> = vec![
            ("an empty frame", BytesMut::from(&0u32.to_le_bytes()[..]), "found an empty frame"),
            ("an unknown kind", framed(&[200]), "expected a known message kind, found kind 200"),
            ("a role out of range", framed(&hello(7)), "expected role 0, 1 or 2, found role 7"),
            ("a flag out of range", framed(&[&[kind::SUBSCRIBE][..], &5u64.to_le_bytes(), &[2]].concat()), "expected a flag 0 or 1, found 2"),
            ("a text too long", framed(&[&[kind::ERROR][..], &1u16.to_le_bytes(), &text(MAX_TEXT + 1, b'x')].concat()), "at most 4096 bytes, found 4097 bytes"),
            ("text not UTF-8", framed(&[&[kind::ERROR][..], &1u16.to_le_bytes(), &text(2, 0xff)].concat()), "expected UTF-8 text, found invalid UTF-8"),
            ("bytes after a message", framed(&[kind::AUTH_OK, 0, 0]), "found 2 trailing bytes"),
            ("a message cut short", framed(&[&[kind::ACK][..], &5u64.to_le_bytes()[..4]].concat()), "expected 8 more bytes in a message of kind 20, found 4 bytes"),
        ];
        for (what, mut frame, expected) in cases {
            let e = decode(&mut frame, 1 << 20).unwrap_err().to_string();
            assert!(e.contains(expected), "{what}: {e}");
        }
    }
}
