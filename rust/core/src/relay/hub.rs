//! The relay's shared state: the retained streams, a cursor per child and
//! the ack log. No I/O: the network layer feeds upstream messages in and
//! pulls, per child, the next message that child should get.
//!
//! Each child reads the shared store through its own cursor, so a slow child
//! lags behind without holding up its siblings or the upstream link; the only
//! per-child memory is its cursor (and its socket buffer).

use std::collections::{HashMap, HashSet, VecDeque};

use bytes::Bytes;

use super::store::{Get, Store};
use super::wire::{Ack, Message, Resume};
use crate::error::{Error, Result};

/// Identifies a child connection within a hub.
pub type ChildId = u64;

#[derive(Debug, Clone)]
struct Child {
    node_id: String,
    subscribed: bool,
    from_version: u64,
    follow: bool,
    version: Option<u64>,
    next_seq: u32,
    header_sent: bool,
}

/// What a child's sender should do next.
#[derive(Debug)]
pub enum ChildPoll {
    /// Send this message.
    Send(Message),
    /// Nothing to send until the hub changes.
    Wait,
    /// The child got its whole (non-follow) stream.
    Done,
    /// The child cannot be served; send an error and close.
    Fail(Error),
}

/// Relay state shared by all connections of one relay.
#[derive(Debug)]
pub struct Hub {
    store: Store,
    children: HashMap<ChildId, Child>,
    next_id: ChildId,
    ack_seen: HashSet<(u64, String)>,
    ack_log: VecDeque<Ack>,
    ack_base: usize,
    /// Resume requests served.
    pub resumes: u64,
}

impl Hub {
    /// A hub over a store.
    pub fn new(store: Store) -> Self {
        Hub {
            store,
            children: HashMap::new(),
            next_id: 1,
            ack_seen: HashSet::new(),
            ack_log: VecDeque::new(),
            ack_base: 0,
            resumes: 0,
        }
    }

    /// The retained streams.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Register a child connection (after authentication).
    pub fn add_child(&mut self, node_id: impl Into<String>) -> ChildId {
        let id = self.next_id;
        self.next_id += 1;
        self.children.insert(
            id,
            Child {
                node_id: node_id.into(),
                subscribed: false,
                from_version: 0,
                follow: false,
                version: None,
                next_seq: 0,
                header_sent: false,
            },
        );
        id
    }

    /// Forget a child.
    pub fn remove_child(&mut self, id: ChildId) {
        self.children.remove(&id);
    }

    /// Number of children.
    pub fn children(&self) -> usize {
        self.children.len()
    }

    /// A child's `Subscribe`.
    pub fn subscribe(
        &mut self,
        id: ChildId,
        from_version: u64,
        follow: bool,
        resume: Option<Resume>,
    ) -> Result<()> {
        if let Some(r) = resume {
            if self.store.is_pruned(r.version) {
                return Err(Error::ResumeUnavailable {
                    version: r.version,
                    seq: r.next_seq,
                    reason: "this relay no longer retains that version".into(),
                });
            }
            if let Some(s) = self.store.stream(r.version) {
                if let Some((count, _)) = s.end() {
                    if r.next_seq > *count {
                        return Err(Error::ResumeUnavailable {
                            version: r.version,
                            seq: r.next_seq,
                            reason: format!("the version has only {count} chunks"),
                        });
                    }
                }
            }
            self.resumes += 1;
        }
        let c = self.children.get_mut(&id).ok_or(Error::Closed("child"))?;
        if c.subscribed {
            return Err(Error::protocol(
                "one Subscribe per connection",
                "a second Subscribe",
            ));
        }
        c.subscribed = true;
        c.from_version = from_version;
        c.follow = follow;
        if let Some(r) = resume {
            c.version = Some(r.version);
            c.next_seq = r.next_seq;
            c.header_sent = r.have_header;
        }
        Ok(())
    }

    /// Next message for a child.
    pub fn poll_child(&mut self, id: ChildId) -> ChildPoll {
        let Some(c) = self.children.get_mut(&id) else {
            return ChildPoll::Fail(Error::Closed("child"));
        };
        if !c.subscribed {
            return ChildPoll::Wait;
        }
        if c.next_seq == u32::MAX {
            return ChildPoll::Done;
        }
        let v = match c.version {
            Some(v) => v,
            None => match self.store.first_from(c.from_version) {
                Some(v) => {
                    c.version = Some(v);
                    c.next_seq = 0;
                    c.header_sent = false;
                    v
                }
                None => return ChildPoll::Wait,
            },
        };
        let Some(s) = self.store.stream(v) else {
            let skipped = self.store.latest().is_some_and(|(l, _)| l > v);
            if self.store.is_pruned(v) || skipped {
                return ChildPoll::Fail(Error::ResumeUnavailable {
                    version: v,
                    seq: c.next_seq,
                    reason: "this relay does not hold that version (pruned or never received)"
                        .into(),
                });
            }
            return ChildPoll::Wait;
        };
        if !c.header_sent {
            let Some(h) = s.header() else {
                return ChildPoll::Wait;
            };
            c.header_sent = true;
            return ChildPoll::Send(Message::Header {
                version: v,
                blob: h.clone(),
            });
        }
        if c.next_seq < s.received() {
            let seq = c.next_seq;
            return match self.store.get_chunk(v, seq) {
                Get::Ready(blob) => {
                    c.next_seq += 1;
                    ChildPoll::Send(Message::Chunk {
                        version: v,
                        seq,
                        blob,
                    })
                }
                Get::NotYet => ChildPoll::Wait,
                Get::Gone(reason) => ChildPoll::Fail(Error::ResumeUnavailable {
                    version: v,
                    seq,
                    reason,
                }),
            };
        }
        match s.end() {
            Some((count, trailer)) if c.next_seq == *count => {
                debug_assert!(*count != u32::MAX);
                let msg = Message::End {
                    version: v,
                    count: *count,
                    trailer: trailer.clone(),
                };
                if c.follow {
                    c.from_version = v + 1;
                    c.version = None;
                } else {
                    c.next_seq = u32::MAX; // marks done
                }
                ChildPoll::Send(msg)
            }
            _ => ChildPoll::Wait,
        }
    }

    /// Oldest `(version, seq)` some subscribed child still has to be sent.
    fn oldest_needed(&self) -> Option<(u64, u32)> {
        self.children
            .values()
            .filter(|c| c.subscribed && c.next_seq != u32::MAX)
            .filter_map(|c| match c.version {
                Some(v) => Some((v, if c.header_sent { c.next_seq } else { 0 })),
                None => self.store.first_from(c.from_version).map(|v| (v, 0)),
            })
            .min()
    }

    /// Bring retention memory under budget without dropping anything a
    /// connected child still needs (spilling loses nothing, so with a spill
    /// this always succeeds). Returns `true` while memory stays over budget:
    /// the caller then stops reading upstream (backpressure) until children
    /// progress, or gives up on them with [`Hub::force_relieve`].
    pub fn relieve(&mut self) -> bool {
        if !self.store.over_budget() {
            return false;
        }
        let min = self.oldest_needed();
        self.store.evict(&|v, s| min.is_some_and(|m| (v, s) >= m))
    }

    /// Evict down to the budget even if lagging children needed those
    /// chunks (they get "resume unavailable" and move to another parent).
    pub fn force_relieve(&mut self) {
        self.store.evict(&|_, _| false);
    }

    /// How many chunks a child is behind the newest chunk of its version.
    pub fn lag(&self, id: ChildId) -> Option<u64> {
        let c = self.children.get(&id)?;
        if c.next_seq == u32::MAX {
            return Some(0);
        }
        let v = c
            .version
            .or_else(|| self.store.first_from(c.from_version))?;
        let s = self.store.stream(v)?;
        Some(u64::from(
            s.received().saturating_sub(c.next_seq.min(s.received())),
        ))
    }

    /// Largest lag over all children.
    pub fn max_lag(&self) -> u64 {
        self.children
            .keys()
            .filter_map(|id| self.lag(*id))
            .max()
            .unwrap_or(0)
    }

    /// A stream message from the publisher or the parent.
    pub fn on_upstream(&mut self, m: Message) -> Result<()> {
        match m {
            Message::Header { version, blob } => self.store.put_header(version, blob),
            Message::Chunk { version, seq, blob } => self.store.put_chunk(version, seq, blob),
            Message::End {
                version,
                count,
                trailer,
            } => self.store.put_end(version, count, trailer),
            Message::Heartbeat | Message::AckReceived { .. } => Ok(()),
            other => Err(Error::protocol(
                "Header, Chunk or End from upstream",
                other.name(),
            )),
        }
    }

    /// Where this relay's own upstream link resumes: `(from_version, resume)`.
    pub fn upstream_resume(&self) -> (u64, Option<Resume>) {
        match self.store.latest() {
            None => (self.store.pruned_below(), None),
            Some((v, s)) if s.end().is_some() => (v + 1, None),
            Some((v, s)) => (
                v,
                Some(Resume {
                    version: v,
                    next_seq: s.received(),
                    have_header: true,
                }),
            ),
        }
    }

    /// Give up the newest version if it is incomplete (no parent can resume
    /// it any more): its children are told to go elsewhere and the upstream
    /// link follows from the next version.
    pub fn abandon_partial(&mut self) -> Option<u64> {
        let (v, s) = self.store.latest()?;
        if s.end().is_some() {
            return None;
        }
        self.store.drop_version(v);
        Some(v)
    }

    /// Record a receiver's ack; `true` if it was new.
    pub fn on_ack(&mut self, a: Ack) -> bool {
        if !self.ack_seen.insert((a.version, a.node_id.clone())) {
            return false;
        }
        self.ack_log.push_back(a);
        // Bound the log: forget acks of versions older than anything retained.
        if let Some(oldest) = self.store.versions().next() {
            while self.ack_log.front().is_some_and(|f| f.version < oldest) && self.ack_log.len() > 1
            {
                let f = self.ack_log.pop_front().expect("non-empty");
                self.ack_seen.remove(&(f.version, f.node_id));
                self.ack_base += 1;
            }
        }
        true
    }

    /// Acks recorded from index `from` on (indices are stable), and the next index.
    pub fn acks_since(&self, from: usize) -> (Vec<Ack>, usize) {
        let start = (from.max(self.ack_base) - self.ack_base).min(self.ack_log.len());
        let v: Vec<Ack> = self.ack_log.range(start..).cloned().collect();
        (v, self.ack_base + self.ack_log.len())
    }

    /// The node id a child announced.
    pub fn child_node(&self, id: ChildId) -> Option<&str> {
        self.children.get(&id).map(|c| c.node_id.as_str())
    }
}

/// Convenience for tests and tools: a header blob whose first 16 bytes are the delta id.
pub fn header_with_id(delta_id: [u8; 16], rest: &[u8]) -> Bytes {
    let mut v = delta_id.to_vec();
    v.extend_from_slice(rest);
    Bytes::from(v)
}
