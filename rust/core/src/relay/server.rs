//! Server-side connection state machine of a relay: handshake, then the
//! authenticated peer's messages handed to the driver (which feeds the [`Hub`](super::hub::Hub)).

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};

use super::auth::{refusal, Peer, PreSharedKey, ServerHandshake, Step};
use super::wire::{Framer, Message, NONCE_LEN, PRE_AUTH_MAX_FRAME};
use crate::error::Result;

/// What a server connection reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerEvent {
    /// The peer is authenticated.
    Authenticated(Peer),
    /// A message from the authenticated peer.
    Message(Message),
}

/// A relay's view of one incoming connection.
#[derive(Debug)]
pub struct ServerConn {
    framer: Framer,
    hs: ServerHandshake,
    authed: bool,
    out: BytesMut,
    events: VecDeque<ServerEvent>,
    max_frame: usize,
}

impl ServerConn {
    /// A connection expecting a `Hello`.
    pub fn new(key: Option<PreSharedKey>, max_frame: usize, nonce: [u8; NONCE_LEN]) -> Self {
        ServerConn {
            framer: Framer::new(PRE_AUTH_MAX_FRAME.min(max_frame)),
            hs: ServerHandshake::new(key, nonce),
            authed: false,
            out: BytesMut::new(),
            events: VecDeque::new(),
            max_frame,
        }
    }

    /// Whether the peer is authenticated.
    pub fn is_authenticated(&self) -> bool {
        self.authed
    }

    /// The decoder's buffer, to read into directly; call [`ServerConn::process`] after.
    pub fn input_buf(&mut self) -> &mut BytesMut {
        self.framer.buf_mut()
    }

    /// Feed received bytes.
    pub fn handle_input(&mut self, data: &[u8]) -> Result<()> {
        self.framer.push(data);
        self.process()
    }

    /// Decode and handle whatever is buffered. On an error the caller sends
    /// [`ServerConn::poll_transmit`] (a refusal) and closes.
    pub fn process(&mut self) -> Result<()> {
        while let Some(m) = self.framer.next_message()? {
            if self.authed {
                self.events.push_back(ServerEvent::Message(m));
                continue;
            }
            match self.hs.handle(m) {
                Ok(Step::Send(r)) => r.encode(&mut self.out),
                Ok(Step::Done(r)) => {
                    if let Some(r) = r {
                        r.encode(&mut self.out);
                    }
                    self.authed = true;
                    self.framer.set_max_frame(self.max_frame);
                    let peer = self.hs.peer().cloned().expect("done implies a peer");
                    self.events.push_back(ServerEvent::Authenticated(peer));
                }
                Err(e) => {
                    refusal(&e).encode(&mut self.out);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Queue a message to the peer.
    pub fn send(&mut self, m: &Message) {
        m.encode(&mut self.out);
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
    pub fn poll_event(&mut self) -> Option<ServerEvent> {
        self.events.pop_front()
    }
}
