//! HMAC-SHA256 challenge–response over a pre-shared key.
//!
//! ```text
//! client → Hello{role, has_key, node_id, nonce_c}
//! server → ServerHello{has_key, nonce_s, proof_s = HMAC(k, "dcr-relay/1 server" | T)}
//! client → ClientProof{proof_c = HMAC(k, "dcr-relay/1 client" | T)}
//! server → AuthOk                      (or Error{AUTH_REFUSED, reason})
//! T = proto | role | nonce_c | nonce_s | node_id
//! ```
//! Both sides prove the key before any payload byte flows; a node with a key
//! refuses a peer without one. Without keys on both sides the exchange still
//! runs (proofs are zero) so the framing is the same.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::wire::{code, Message, Role, NONCE_LEN, PROOF_LEN, PROTO_VERSION};
use crate::error::{Error, Result};

/// Minimum key length accepted.
pub const MIN_KEY_LEN: usize = 16;

/// A pre-shared key. `Debug` never prints it.
#[derive(Clone, PartialEq, Eq)]
pub struct PreSharedKey(Arc<[u8]>);

impl fmt::Debug for PreSharedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PreSharedKey({} bytes)", self.0.len())
    }
}

impl PreSharedKey {
    /// A key from raw bytes (at least [`MIN_KEY_LEN`]).
    pub fn new(bytes: impl AsRef<[u8]>) -> Result<Self> {
        let b = bytes.as_ref();
        if b.len() < MIN_KEY_LEN {
            return Err(Error::Config(format!(
                "pre-shared key of at least {MIN_KEY_LEN} bytes expected, found {} bytes: generate one with `head -c 32 /dev/urandom | base64 > key`",
                b.len()
            )));
        }
        Ok(PreSharedKey(Arc::from(b)))
    }

    /// Read a key file; surrounding whitespace (a trailing newline) is ignored.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let p = path.as_ref();
        let data = std::fs::read(p)
            .map_err(|e| Error::net_io(format!("reading key file {}", p.display()), e))?;
        let s = data.trim_ascii();
        Self::new(s).map_err(|e| Error::Config(format!("key file {}: {e}", p.display())))
    }

    fn proof(&self, label: &[u8], t: &Transcript<'_>) -> [u8; PROOF_LEN] {
        let mut m = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(label);
        t.feed(&mut m);
        m.finalize().into_bytes().into()
    }

    fn verify(&self, label: &[u8], t: &Transcript<'_>, proof: &[u8]) -> bool {
        let mut m = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(label);
        t.feed(&mut m);
        m.verify_slice(proof).is_ok()
    }
}

const SERVER_LABEL: &[u8] = b"dcr-relay/1 server";
const CLIENT_LABEL: &[u8] = b"dcr-relay/1 client";

struct Transcript<'a> {
    role: Role,
    nonce_c: &'a [u8; NONCE_LEN],
    nonce_s: &'a [u8; NONCE_LEN],
    node_id: &'a str,
}

impl Transcript<'_> {
    fn feed(&self, m: &mut Hmac<Sha256>) {
        m.update(&PROTO_VERSION.to_le_bytes());
        m.update(&[self.role as u8]);
        m.update(self.nonce_c);
        m.update(self.nonce_s);
        m.update(&(self.node_id.len() as u32).to_le_bytes());
        m.update(self.node_id.as_bytes());
    }
}

/// Fresh random nonce.
pub fn random_nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).expect("the OS random source is available");
    n
}

/// Outcome of feeding a message to a handshake.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Send this and wait for the next message.
    Send(Message),
    /// Send this (if any); the handshake is complete.
    Done(Option<Message>),
}

#[derive(Debug, PartialEq, Eq)]
enum CState {
    Start,
    SentHello,
    SentProof,
    Done,
}

/// Client half of the handshake (publisher, relay child, subscriber).
#[derive(Debug)]
pub struct ClientHandshake {
    key: Option<PreSharedKey>,
    role: Role,
    node_id: String,
    nonce: [u8; NONCE_LEN],
    state: CState,
}

impl ClientHandshake {
    /// A client handshake with a given nonce (use [`random_nonce`] outside tests).
    pub fn new(
        key: Option<PreSharedKey>,
        role: Role,
        node_id: impl Into<String>,
        nonce: [u8; NONCE_LEN],
    ) -> Self {
        ClientHandshake {
            key,
            role,
            node_id: node_id.into(),
            nonce,
            state: CState::Start,
        }
    }

    /// The first message (Hello).
    pub fn start(&mut self) -> Message {
        assert_eq!(self.state, CState::Start, "start() called twice");
        self.state = CState::SentHello;
        Message::Hello {
            proto: PROTO_VERSION,
            role: self.role,
            has_key: self.key.is_some(),
            node_id: self.node_id.clone(),
            nonce: self.nonce,
        }
    }

    /// Whether `AuthOk` was received.
    pub fn is_done(&self) -> bool {
        self.state == CState::Done
    }

    /// Feed a message from the server.
    pub fn handle(&mut self, m: Message) -> Result<Step> {
        if let Message::Error { code: c, reason } = &m {
            let side = "parent";
            return Err(if *c == code::AUTH_REFUSED {
                Error::AuthRefused {
                    side,
                    reason: reason.clone(),
                }
            } else {
                Error::Remote {
                    code: *c,
                    reason: reason.clone(),
                }
            });
        }
        match (&self.state, m) {
            (
                CState::SentHello,
                Message::ServerHello {
                    has_key,
                    nonce,
                    proof,
                },
            ) => {
                let t = Transcript {
                    role: self.role,
                    nonce_c: &self.nonce,
                    nonce_s: &nonce,
                    node_id: &self.node_id,
                };
                let my = match (&self.key, has_key) {
                    (Some(k), true) => {
                        if !k.verify(SERVER_LABEL, &t, &proof) {
                            return Err(Error::AuthRefused {
                                side: "local",
                                reason: "the parent's proof does not match our pre-shared key: the parent has a different key; check --key-file on both ends".into(),
                            });
                        }
                        k.proof(CLIENT_LABEL, &t)
                    }
                    (Some(_), false) => {
                        return Err(Error::AuthRefused {
                            side: "local",
                            reason: "we hold a pre-shared key but the parent has none: refusing an unauthenticated parent; give it the same --key-file".into(),
                        })
                    }
                    (None, _) => [0u8; PROOF_LEN],
                };
                self.state = CState::SentProof;
                Ok(Step::Send(Message::ClientProof { proof: my }))
            }
            (CState::SentProof, Message::AuthOk) => {
                self.state = CState::Done;
                Ok(Step::Done(None))
            }
            (s, m) => Err(Error::protocol(
                format!("handshake message in state {s:?}"),
                m.name(),
            )),
        }
    }
}

#[derive(Debug)]
enum SState {
    WaitHello,
    WaitProof {
        role: Role,
        node_id: String,
        nonce_c: [u8; NONCE_LEN],
        client_has_key: bool,
    },
    Done,
}

/// Who the server authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// The client's role.
    pub role: Role,
    /// The node id it announced (authenticated by the proof when keys are used).
    pub node_id: String,
}

/// Server half of the handshake (relay).
#[derive(Debug)]
pub struct ServerHandshake {
    key: Option<PreSharedKey>,
    nonce: [u8; NONCE_LEN],
    state: SState,
    peer: Option<Peer>,
}

impl ServerHandshake {
    /// A server handshake with a given nonce.
    pub fn new(key: Option<PreSharedKey>, nonce: [u8; NONCE_LEN]) -> Self {
        ServerHandshake {
            key,
            nonce,
            state: SState::WaitHello,
            peer: None,
        }
    }

    /// The authenticated peer, once done.
    pub fn peer(&self) -> Option<&Peer> {
        self.peer.as_ref()
    }

    /// Feed a message from the client. On `Err(AuthRefused)` the caller
    /// sends [`refusal`] and closes.
    pub fn handle(&mut self, m: Message) -> Result<Step> {
        if let Message::Error { reason, .. } = &m {
            return Err(Error::AuthRefused {
                side: "peer",
                reason: format!("the client refused this relay: {reason}"),
            });
        }
        match (&self.state, m) {
            (
                SState::WaitHello,
                Message::Hello {
                    proto,
                    role,
                    has_key,
                    node_id,
                    nonce,
                },
            ) => {
                if proto != PROTO_VERSION {
                    return Err(Error::protocol(
                        format!("protocol version {PROTO_VERSION}"),
                        format!("version {proto}"),
                    ));
                }
                if self.key.is_some() && !has_key {
                    return Err(Error::AuthRefused {
                        side: "local",
                        reason: format!("{role:?} {node_id:?} presented no pre-shared key; this relay requires one (--key-file)"),
                    });
                }
                let t = Transcript {
                    role,
                    nonce_c: &nonce,
                    nonce_s: &self.nonce,
                    node_id: &node_id,
                };
                let proof = self
                    .key
                    .as_ref()
                    .map(|k| k.proof(SERVER_LABEL, &t))
                    .unwrap_or([0; PROOF_LEN]);
                let reply = Message::ServerHello {
                    has_key: self.key.is_some(),
                    nonce: self.nonce,
                    proof,
                };
                self.state = SState::WaitProof {
                    role,
                    node_id,
                    nonce_c: nonce,
                    client_has_key: has_key,
                };
                Ok(Step::Send(reply))
            }
            (
                SState::WaitProof {
                    role,
                    node_id,
                    nonce_c,
                    client_has_key,
                },
                Message::ClientProof { proof },
            ) => {
                if let Some(k) = &self.key {
                    let t = Transcript {
                        role: *role,
                        nonce_c,
                        nonce_s: &self.nonce,
                        node_id,
                    };
                    if !k.verify(CLIENT_LABEL, &t, &proof) {
                        return Err(Error::AuthRefused {
                            side: "local",
                            reason: format!("{role:?} {node_id:?} sent a proof that does not match our pre-shared key (wrong key)"),
                        });
                    }
                } else if *client_has_key {
                    // The client refuses us itself; it will not send a proof. Reaching here
                    // means it ignored the mismatch: still fine for an unkeyed relay.
                }
                self.peer = Some(Peer {
                    role: *role,
                    node_id: node_id.clone(),
                });
                self.state = SState::Done;
                Ok(Step::Done(Some(Message::AuthOk)))
            }
            (s, m) => Err(Error::protocol(
                format!("handshake message in state {s:?}"),
                m.name(),
            )),
        }
    }
}

/// The message a server sends before closing on a handshake error.
pub fn refusal(e: &Error) -> Message {
    match e {
        Error::AuthRefused { reason, .. } => Message::Error {
            code: code::AUTH_REFUSED,
            reason: reason.clone(),
        },
        other => Message::Error {
            code: code::PROTOCOL,
            reason: other.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(ck: Option<&[u8]>, sk: Option<&[u8]>) -> (Result<()>, Result<()>) {
        let ck = ck.map(|k| PreSharedKey::new(k).unwrap());
        let sk = sk.map(|k| PreSharedKey::new(k).unwrap());
        let mut c = ClientHandshake::new(ck, Role::Subscriber, "sub-1", [1; 32]);
        let mut s = ServerHandshake::new(sk, [2; 32]);
        let hello = c.start();
        let sh = match s.handle(hello) {
            Ok(Step::Send(m)) => m,
            Ok(_) => unreachable!(),
            Err(e) => {
                let r = refusal(&e);
                return (c.handle(r).map(|_| ()), Err(e));
            }
        };
        let proof = match c.handle(sh) {
            Ok(Step::Send(m)) => m,
            Ok(_) => unreachable!(),
            Err(e) => return (Err(e), Ok(())),
        };
        match s.handle(proof) {
            Ok(Step::Done(Some(ok))) => {
                assert_eq!(c.handle(ok).unwrap(), Step::Done(None));
                assert!(c.is_done());
                assert_eq!(s.peer().unwrap().node_id, "sub-1");
                (Ok(()), Ok(()))
            }
            Ok(_) => unreachable!(),
            Err(e) => {
                let r = refusal(&e);
                (c.handle(r).map(|_| ()), Err(e))
            }
        }
    }

    const K1: &[u8] = b"0123456789abcdef-key-one";
    const K2: &[u8] = b"0123456789abcdef-key-two";

    #[test]
    fn same_key_accepted() {
        let (c, s) = run(Some(K1), Some(K1));
        c.unwrap();
        s.unwrap();
    }

    #[test]
    fn no_keys_accepted() {
        let (c, s) = run(None, None);
        c.unwrap();
        s.unwrap();
    }

    #[test]
    fn wrong_key_refused_by_client_first() {
        // The server proves first, so a client with another key refuses the server.
        let (c, s) = run(Some(K2), Some(K1));
        assert!(
            matches!(c, Err(Error::AuthRefused { side: "local", .. })),
            "{c:?}"
        );
        s.unwrap();
    }

    #[test]
    fn missing_key_refused_by_server() {
        let (c, s) = run(None, Some(K1));
        assert!(
            matches!(c, Err(Error::AuthRefused { side: "parent", .. })),
            "{c:?}"
        );
        assert!(
            matches!(s, Err(Error::AuthRefused { side: "local", .. })),
            "{s:?}"
        );
    }

    #[test]
    fn keyed_client_refuses_unkeyed_server() {
        let (c, _) = run(Some(K1), None);
        assert!(
            matches!(c, Err(Error::AuthRefused { side: "local", .. })),
            "{c:?}"
        );
    }

    #[test]
    fn forged_client_proof_refused() {
        let k = PreSharedKey::new(K1).unwrap();
        let mut s = ServerHandshake::new(Some(k), [2; 32]);
        let hello = Message::Hello {
            proto: 1,
            role: Role::Relay,
            has_key: true,
            node_id: "x".into(),
            nonce: [3; 32],
        };
        assert!(matches!(s.handle(hello).unwrap(), Step::Send(_)));
        let e = s
            .handle(Message::ClientProof { proof: [0; 32] })
            .unwrap_err();
        assert!(matches!(e, Error::AuthRefused { .. }));
    }

    #[test]
    fn short_key_rejected() {
        assert!(PreSharedKey::new(b"short").is_err());
    }
}
