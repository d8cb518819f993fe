//! Client-side connection state machines (subscriber/relay-child and
//! publisher): bytes in, bytes and events out, time passed in.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use super::auth::{ClientHandshake, PreSharedKey, Step};
use super::wire::{code, Ack, Framer, Message, Resume, Role, NONCE_LEN, PRE_AUTH_MAX_FRAME};
use crate::error::{Error, Result};

/// Where a receiver stands; survives reconnections so that a failover resumes
/// without applying anything twice or losing anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// Accept versions from this one on.
    pub from_version: u64,
    /// Keep receiving newer versions after an `End` (relays) or stop (receivers).
    pub follow: bool,
    /// Version being received.
    pub version: Option<u64>,
    /// Next chunk expected.
    pub next_seq: u32,
    /// Header of `version` delivered.
    pub have_header: bool,
    /// `End` of `version` delivered.
    pub ended: bool,
}

impl Cursor {
    /// A receiver of one version `>= from_version`.
    pub fn once(from_version: u64) -> Self {
        Cursor {
            from_version,
            follow: false,
            version: None,
            next_seq: 0,
            have_header: false,
            ended: false,
        }
    }

    /// A follower of every version `>= from_version` (relays).
    pub fn follow(from_version: u64) -> Self {
        Cursor {
            follow: true,
            ..Self::once(from_version)
        }
    }

    /// The `Subscribe` message for a (re)connection.
    pub fn subscribe_msg(&self) -> Message {
        let resume = match self.version {
            Some(v) if !self.ended => Some(Resume {
                version: v,
                next_seq: self.next_seq,
                have_header: self.have_header,
            }),
            _ => None,
        };
        Message::Subscribe {
            from_version: self.from_version,
            follow: self.follow,
            resume,
        }
    }

    /// Accept a stream message, checking order; `Ok(false)` for a duplicate to skip.
    pub fn accept(&mut self, m: &Message) -> Result<bool> {
        match m {
            Message::Header { version, .. } => {
                if *version < self.from_version {
                    return Err(Error::protocol(
                        format!("a version >= {}", self.from_version),
                        format!("Header of version {version}"),
                    ));
                }
                match self.version {
                    Some(v) if v == *version && !self.ended => {
                        if self.have_header {
                            return Ok(false);
                        }
                    }
                    Some(v) if !self.ended => {
                        return Err(Error::protocol(
                            format!("the rest of version {v}"),
                            format!("Header of version {version}"),
                        ));
                    }
                    Some(v) if *version <= v => {
                        return Err(Error::protocol(
                            format!("a version above {v}"),
                            format!("Header of version {version}"),
                        ));
                    }
                    _ => {
                        self.version = Some(*version);
                        self.next_seq = 0;
                        self.ended = false;
                    }
                }
                self.have_header = true;
                Ok(true)
            }
            Message::Chunk { version, seq, .. } => {
                self.check_open(*version, "Chunk")?;
                if *seq < self.next_seq {
                    return Ok(false);
                }
                if *seq > self.next_seq {
                    return Err(Error::protocol(
                        format!("chunk {} of version {version}", self.next_seq),
                        format!("chunk {seq}"),
                    ));
                }
                self.next_seq += 1;
                Ok(true)
            }
            Message::End { version, count, .. } => {
                self.check_open(*version, "End")?;
                if *count != self.next_seq {
                    return Err(Error::protocol(
                        format!("End after {} chunks", self.next_seq),
                        format!("End with count {count}"),
                    ));
                }
                self.ended = true;
                if self.follow {
                    self.from_version = version + 1;
                }
                Ok(true)
            }
            _ => Ok(true),
        }
    }

    fn check_open(&self, version: u64, what: &str) -> Result<()> {
        match self.version {
            Some(v) if v == version && self.have_header && !self.ended => Ok(()),
            _ => Err(Error::protocol(
                match self.version.filter(|_| !self.ended) {
                    Some(open) => format!("{what} of version {open}, the one open"),
                    None => format!("a Header before any {what} (no version is open)"),
                },
                format!("{what} of version {version}"),
            )),
        }
    }

    /// Whether a non-following receiver has its whole stream.
    pub fn is_complete(&self) -> bool {
        self.ended && !self.follow
    }
}

/// What a client connection reports to its driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The handshake completed.
    Authenticated,
    /// A stream message (Header, Chunk or End), in order and never twice.
    Stream(Message),
    /// An ack reached the publisher (publisher connections).
    Ack(Ack),
    /// The parent recorded our ack.
    AckReceived { version: u64, node_id: String },
}

#[derive(Debug)]
enum Kind {
    Receiver(Cursor),
    Publisher(PubState),
}

#[derive(Debug, Default)]
struct PubState {
    version: Option<u64>,
    next_seq: u32,
    ended: bool,
}

/// A client connection state machine.
#[derive(Debug)]
pub struct ClientConn {
    framer: Framer,
    hs: ClientHandshake,
    authed: bool,
    out: BytesMut,
    events: VecDeque<Event>,
    kind: Kind,
    idle_timeout: Option<Duration>,
    last_rx: Instant,
    pending_after_auth: Vec<Message>,
    max_frame: usize,
}

/// Settings of a client connection.
#[derive(Debug, Clone)]
pub struct ClientSettings {
    /// Pre-shared key, if any.
    pub key: Option<PreSharedKey>,
    /// Our node id (receivers: the id that appears in acks).
    pub node_id: String,
    /// Largest frame accepted.
    pub max_frame: usize,
    /// Give up on a parent silent for this long (it sends heartbeats when idle).
    pub idle_timeout: Option<Duration>,
}

impl ClientConn {
    fn new(
        s: &ClientSettings,
        role: Role,
        kind: Kind,
        nonce: [u8; NONCE_LEN],
        now: Instant,
    ) -> Self {
        let mut hs = ClientHandshake::new(s.key.clone(), role, s.node_id.clone(), nonce);
        let mut out = BytesMut::new();
        hs.start().encode(&mut out);
        ClientConn {
            framer: Framer::new(PRE_AUTH_MAX_FRAME.min(s.max_frame)),
            hs,
            authed: false,
            out,
            events: VecDeque::new(),
            kind,
            idle_timeout: s.idle_timeout,
            last_rx: now,
            pending_after_auth: vec![],
            max_frame: s.max_frame,
        }
    }

    /// A receiver (subscriber, or a relay's upstream link when `role` is `Relay`).
    /// It subscribes from `cursor` as soon as it is authenticated.
    pub fn receiver(
        s: &ClientSettings,
        role: Role,
        cursor: Cursor,
        nonce: [u8; NONCE_LEN],
        now: Instant,
    ) -> Self {
        let sub = cursor.subscribe_msg();
        let mut c = Self::new(s, role, Kind::Receiver(cursor), nonce, now);
        c.pending_after_auth.push(sub);
        c
    }

    /// An ack-only connection: authenticates, sends `ack`, expects `AckReceived`.
    pub fn acker(s: &ClientSettings, ack: Ack, nonce: [u8; NONCE_LEN], now: Instant) -> Self {
        let mut c = Self::new(
            s,
            Role::Subscriber,
            Kind::Receiver(Cursor::once(u64::MAX)),
            nonce,
            now,
        );
        c.pending_after_auth.push(Message::Ack(ack));
        c
    }

    /// A publisher connection to a root relay.
    pub fn publisher(s: &ClientSettings, nonce: [u8; NONCE_LEN], now: Instant) -> Self {
        Self::new(
            s,
            Role::Publisher,
            Kind::Publisher(PubState::default()),
            nonce,
            now,
        )
    }

    /// Whether the handshake completed.
    pub fn is_authenticated(&self) -> bool {
        self.authed
    }

    /// The receiver's cursor.
    pub fn cursor(&self) -> Option<&Cursor> {
        match &self.kind {
            Kind::Receiver(c) => Some(c),
            Kind::Publisher(_) => None,
        }
    }

    /// Feed received bytes.
    pub fn handle_input(&mut self, data: &[u8], now: Instant) -> Result<()> {
        self.framer.push(data);
        self.process(now)
    }

    /// The decoder's buffer, to read into directly; call [`ClientConn::process`] after.
    pub fn input_buf(&mut self) -> &mut BytesMut {
        self.framer.buf_mut()
    }

    /// Decode and handle whatever is buffered.
    pub fn process(&mut self, now: Instant) -> Result<()> {
        self.last_rx = now;
        while let Some(m) = self.framer.next_message()? {
            self.handle_message(m)?;
        }
        Ok(())
    }

    fn handle_message(&mut self, m: Message) -> Result<()> {
        if !self.authed {
            match self.hs.handle(m) {
                Ok(Step::Send(r)) => r.encode(&mut self.out),
                Ok(Step::Done(r)) => {
                    if let Some(r) = r {
                        r.encode(&mut self.out);
                    }
                    self.authed = true;
                    self.framer.set_max_frame(self.max_frame);
                    self.events.push_back(Event::Authenticated);
                    for p in std::mem::take(&mut self.pending_after_auth) {
                        p.encode(&mut self.out);
                    }
                }
                Err(e) => {
                    if let Error::AuthRefused {
                        side: "local",
                        reason,
                    } = &e
                    {
                        // Tell the server why, so it can log the refusal too.
                        Message::Error {
                            code: code::AUTH_REFUSED,
                            reason: reason.clone(),
                        }
                        .encode(&mut self.out);
                    }
                    return Err(e);
                }
            }
            return Ok(());
        }
        match m {
            Message::Heartbeat => Ok(()),
            Message::Error { code: c, reason } => Err(match c {
                code::RESUME_UNAVAILABLE => Error::ResumeUnavailable {
                    version: self.cursor().and_then(|c| c.version).unwrap_or(0),
                    seq: self.cursor().map_or(0, |c| c.next_seq),
                    reason,
                },
                code::AUTH_REFUSED => Error::AuthRefused {
                    side: "parent",
                    reason,
                },
                _ => Error::Remote { code: c, reason },
            }),
            Message::AckReceived { version, node_id } => {
                self.events
                    .push_back(Event::AckReceived { version, node_id });
                Ok(())
            }
            Message::Ack(a) if matches!(self.kind, Kind::Publisher(_)) => {
                self.events.push_back(Event::Ack(a));
                Ok(())
            }
            m @ (Message::Header { .. } | Message::Chunk { .. } | Message::End { .. }) => {
                match &mut self.kind {
                    Kind::Receiver(c) => {
                        if c.accept(&m)? {
                            self.events.push_back(Event::Stream(m));
                        }
                        Ok(())
                    }
                    Kind::Publisher(_) => Err(Error::protocol("acks from the relay", m.name())),
                }
            }
            other => Err(Error::protocol("a stream message or an ack", other.name())),
        }
    }

    /// Bytes to send, if any.
    pub fn poll_transmit(&mut self) -> Option<Bytes> {
        if self.out.is_empty() {
            None
        } else {
            Some(self.out.split().freeze())
        }
    }

    /// Next event, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When [`ClientConn::handle_timeout`] must be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.idle_timeout.map(|d| self.last_rx + d)
    }

    /// Restart the idle timer (after the application spent time in a callback:
    /// that is not the parent's silence).
    pub fn reset_idle(&mut self, now: Instant) {
        self.last_rx = now;
    }

    /// The clock reached [`ClientConn::poll_timeout`]: the parent is silent.
    pub fn handle_timeout(&mut self, now: Instant) -> Result<()> {
        if let Some(d) = self.idle_timeout {
            if now >= self.last_rx + d {
                return Err(Error::Timeout {
                    after_ms: d.as_millis() as u64,
                    during: "waiting for the parent (no data nor heartbeat)".into(),
                });
            }
        }
        Ok(())
    }

    /// Send an ack upward (receivers, after authentication).
    pub fn send_ack(&mut self, a: Ack) {
        let m = Message::Ack(a);
        if self.authed {
            m.encode(&mut self.out)
        } else {
            self.pending_after_auth.push(m)
        }
    }

    fn pub_state(&mut self) -> Result<&mut PubState> {
        match &mut self.kind {
            Kind::Publisher(p) => Ok(p),
            Kind::Receiver(_) => Err(Error::protocol(
                "a publisher connection",
                "a receiver connection",
            )),
        }
    }

    /// Publisher: start a version.
    pub fn send_header(&mut self, version: u64, blob: Bytes) -> Result<()> {
        let p = self.pub_state()?;
        if p.version.is_some() {
            return Err(Error::protocol(
                "one version per publisher connection",
                "a second header",
            ));
        }
        p.version = Some(version);
        self.queue_pub(Message::Header { version, blob });
        Ok(())
    }

    /// Publisher: the next chunk; returns its sequence number.
    pub fn send_chunk(&mut self, blob: Bytes) -> Result<u32> {
        let p = self.pub_state()?;
        let (Some(version), false) = (p.version, p.ended) else {
            return Err(Error::protocol(
                "a chunk after the header and before the end",
                "a chunk out of place",
            ));
        };
        let seq = p.next_seq;
        p.next_seq = p
            .next_seq
            .checked_add(1)
            .ok_or_else(|| Error::protocol("fewer than 2^32 chunks", "more"))?;
        self.queue_pub(Message::Chunk { version, seq, blob });
        Ok(seq)
    }

    /// Publisher: end the version; returns the chunk count.
    pub fn send_end(&mut self, trailer: Bytes) -> Result<u32> {
        let p = self.pub_state()?;
        let (Some(version), false) = (p.version, p.ended) else {
            return Err(Error::protocol(
                "an end after the header",
                "an end out of place",
            ));
        };
        p.ended = true;
        let count = p.next_seq;
        self.queue_pub(Message::End {
            version,
            count,
            trailer,
        });
        Ok(count)
    }

    fn queue_pub(&mut self, m: Message) {
        if self.authed {
            m.encode(&mut self.out)
        } else {
            self.pending_after_auth.push(m)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(version: u64) -> Message {
        Message::Header { version, blob: Bytes::from_static(b"h") }
    }
    fn chunk(version: u64, seq: u32) -> Message {
        Message::Chunk { version, seq, blob: Bytes::from_static(b"c") }
    }
    fn end(version: u64, count: u32) -> Message {
        Message::End { version, count, trailer: Bytes::from_static(b"t") }
    }

    /// A parent's stream out of order is refused by what was expected and
    /// what came; resent messages (after a failover) are skipped, not
    /// applied twice; a follower moves on to the next version after `End`.
    #[test]
    fn the_cursor_takes_a_stream_in_order_and_names_what_breaks_it() {
        let mut c = Cursor::follow(5);
        for m in [header(5), chunk(5, 0), chunk(5, 1)] {
            assert!(c.accept(&m).unwrap());
        }
        // Resent after a failover: skipped.
        assert!(!c.accept(&header(5)).unwrap());
        assert!(!c.accept(&chunk(5, 0)).unwrap());
        // The subscription a reconnection sends resumes at the next chunk.
        let Message::Subscribe { resume: Some(r), .. } = c.subscribe_msg() else { panic!("a resume") };
        assert_eq!((r.version, r.next_seq, r.have_header), (5, 2, true));
        let breaks = |c: &Cursor, m: Message, expected: &str, found: &str| {
            let e = c.clone().accept(&m).unwrap_err();
            assert!(matches!(&e, Error::Protocol { expected: x, found: f } if x == expected && f == found), "{e}");
        };
        breaks(&c, chunk(5, 3), "chunk 2 of version 5", "chunk 3");
        breaks(&c, chunk(6, 0), "Chunk of version 5, the one open", "Chunk of version 6");
        breaks(&c, header(6), "the rest of version 5", "Header of version 6");
        breaks(&c, end(5, 3), "End after 2 chunks", "End with count 3");
        breaks(&c, header(4), "a version >= 5", "Header of version 4");
        assert!(c.accept(&end(5, 2)).unwrap());
        // Ended: the follower takes only newer versions, from their header.
        assert_eq!(c.from_version, 6);
        breaks(&c, chunk(5, 2), "a Header before any Chunk (no version is open)", "Chunk of version 5");
        breaks(&c, end(5, 2), "a Header before any End (no version is open)", "End of version 5");
        breaks(&c, header(5), "a version >= 6", "Header of version 5");
        assert!(c.accept(&header(7)).unwrap());
        assert_eq!((c.version, c.next_seq), (Some(7), 0));
        // A receiver of one version that ended cannot be handed an older one.
        let mut once = Cursor::once(3);
        for m in [header(8), end(8, 0)] {
            assert!(once.accept(&m).unwrap());
        }
        breaks(&once, header(4), "a version above 8", "Header of version 4");
    }
}
