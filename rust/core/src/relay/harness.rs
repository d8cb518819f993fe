//! Deterministic multi-peer harness: publisher, relays and subscribers as
//! state machines, with byte pipes between them and no sockets or clock.

use std::time::Instant;

use bytes::{Bytes, BytesMut};

use super::auth::PreSharedKey;
use super::client::{ClientConn, ClientSettings, Cursor, Event};
use super::hub::{ChildId, ChildPoll, Hub};
use super::server::{ServerConn, ServerEvent};
use super::store::{MemSpill, Store, StoreConfig};
use super::wire::{code, Ack, Message, Role};
use crate::error::Error;

const KEY: &[u8] = b"harness-key-0123456789";

fn key() -> Option<PreSharedKey> {
    Some(PreSharedKey::new(KEY).unwrap())
}

fn settings(id: &str, key: Option<PreSharedKey>) -> ClientSettings {
    ClientSettings {
        key,
        node_id: id.into(),
        max_frame: 1 << 20,
        idle_timeout: None,
    }
}

struct Link {
    c2s: BytesMut,
    s2c: BytesMut,
    server: ServerConn,
    child: Option<ChildId>,
    publisher_version: Option<u64>,
    ack_idx: usize,
    closed: bool,
    /// Messages a child link may carry per tick (models a slow child).
    budget: usize,
    /// Flip one byte of the server→client stream at this offset.
    corrupt_at: Option<usize>,
    s2c_sent: usize,
    error: Option<String>,
}

struct RelayNode {
    hub: Hub,
    links: Vec<Link>,
    /// (client conn, parent relay, link index at the parent, acks forwarded)
    up: Option<(ClientConn, usize, usize, usize)>,
}

struct Sub {
    conn: ClientConn,
    at: (usize, usize),
    got: Vec<Message>,
    cursor: Cursor,
    error: Option<Error>,
    acked: Vec<(u64, String)>,
}

struct World {
    relays: Vec<RelayNode>,
    subs: Vec<Sub>,
    publ: Option<(ClientConn, usize, usize)>,
    pub_acks: Vec<Ack>,
    /// Feed bytes in pieces of this size (exercises partial frames).
    mtu: usize,
    now: Instant,
}

impl World {
    fn new(mtu: usize) -> Self {
        World {
            relays: vec![],
            subs: vec![],
            publ: None,
            pub_acks: vec![],
            mtu,
            now: Instant::now(),
        }
    }

    fn relay(&mut self, retention: usize, spill: bool) -> usize {
        let sp: Option<Box<dyn super::store::Spill>> = if spill {
            Some(Box::<MemSpill>::default())
        } else {
            None
        };
        let store = Store::new(
            StoreConfig {
                retention_bytes: retention,
                keep_versions: 2,
            },
            sp,
        );
        self.relays.push(RelayNode {
            hub: Hub::new(store),
            links: vec![],
            up: None,
        });
        self.relays.len() - 1
    }

    fn link(&mut self, relay: usize, server_key: Option<PreSharedKey>) -> usize {
        let r = &mut self.relays[relay];
        r.links.push(Link {
            c2s: BytesMut::new(),
            s2c: BytesMut::new(),
            server: ServerConn::new(server_key, 1 << 20, [9; 32]),
            child: None,
            publisher_version: None,
            ack_idx: 0,
            closed: false,
            budget: usize::MAX,
            corrupt_at: None,
            s2c_sent: 0,
            error: None,
        });
        r.links.len() - 1
    }

    fn attach_relay(&mut self, child: usize, parent: usize) {
        let l = self.link(parent, key());
        let (from, resume) = self.relays[child].hub.upstream_resume();
        let mut cur = Cursor::follow(from);
        if let Some(r) = resume {
            cur.version = Some(r.version);
            cur.next_seq = r.next_seq;
            cur.have_header = true;
        }
        let conn = ClientConn::receiver(
            &settings(&format!("relay-{child}"), key()),
            Role::Relay,
            cur,
            [child as u8; 32],
            self.now,
        );
        self.relays[child].up = Some((conn, parent, l, 0));
    }

    fn add_sub(&mut self, parent: usize, k: Option<PreSharedKey>) -> usize {
        let l = self.link(parent, key());
        let cursor = Cursor::once(0);
        let id = format!("sub-{}", self.subs.len());
        let conn = ClientConn::receiver(
            &settings(&id, k),
            Role::Subscriber,
            cursor.clone(),
            [1; 32],
            self.now,
        );
        self.subs.push(Sub {
            conn,
            at: (parent, l),
            got: vec![],
            cursor,
            error: None,
            acked: vec![],
        });
        self.subs.len() - 1
    }

    /// Failover: reconnect subscriber `s` to `parent`, resuming from its cursor.
    fn move_sub(&mut self, s: usize, parent: usize) {
        let old = self.subs[s].at;
        self.relays[old.0].links[old.1].closed = true;
        let l = self.link(parent, key());
        let id = format!("sub-{s}");
        let cur = self.subs[s].cursor.clone();
        self.subs[s].conn = ClientConn::receiver(
            &settings(&id, key()),
            Role::Subscriber,
            cur,
            [2; 32],
            self.now,
        );
        self.subs[s].at = (parent, l);
        self.subs[s].error = None;
    }

    fn publisher(&mut self, root: usize) {
        let l = self.link(root, key());
        self.publ = Some((
            ClientConn::publisher(&settings("pub", key()), [3; 32], self.now),
            root,
            l,
        ));
    }

    fn feed<F: FnMut(&[u8]) -> crate::error::Result<()>>(
        buf: &mut BytesMut,
        mtu: usize,
        mut f: F,
    ) -> crate::error::Result<()> {
        while !buf.is_empty() {
            let n = mtu.min(buf.len());
            let piece = buf.split_to(n);
            f(&piece)?;
        }
        Ok(())
    }

    /// One round of every peer; returns whether any byte moved.
    fn tick(&mut self) -> bool {
        let mut moved = false;
        let now = self.now;
        let mtu = self.mtu;
        // Clients transmit.
        if let Some((c, r, l)) = &mut self.publ {
            while let Some(b) = c.poll_transmit() {
                self.relays[*r].links[*l].c2s.extend_from_slice(&b);
                moved = true;
            }
        }
        for s in &mut self.subs {
            while let Some(b) = s.conn.poll_transmit() {
                self.relays[s.at.0].links[s.at.1].c2s.extend_from_slice(&b);
                moved = true;
            }
        }
        for i in 0..self.relays.len() {
            if let Some((c, p, l, _)) = &mut self.relays[i].up {
                let (p, l) = (*p, *l);
                let mut out = vec![];
                while let Some(b) = c.poll_transmit() {
                    out.push(b);
                }
                for b in out {
                    self.relays[p].links[l].c2s.extend_from_slice(&b);
                    moved = true;
                }
            }
        }
        // Relays serve.
        for r in &mut self.relays {
            for link in &mut r.links {
                if link.closed {
                    continue;
                }
                let mut c2s = std::mem::take(&mut link.c2s);
                if let Err(e) = Self::feed(&mut c2s, mtu, |p| link.server.handle_input(p)) {
                    link.error = Some(e.to_string());
                    link.closed = true;
                }
                while let Some(ev) = link.server.poll_event() {
                    match ev {
                        ServerEvent::Authenticated(peer) => match peer.role {
                            Role::Publisher => link.publisher_version = Some(u64::MAX),
                            _ => link.child = Some(r.hub.add_child(peer.node_id)),
                        },
                        ServerEvent::Message(m) => match m {
                            Message::Subscribe {
                                from_version,
                                follow,
                                resume,
                            } => {
                                if let Err(e) = r.hub.subscribe(
                                    link.child.unwrap(),
                                    from_version,
                                    follow,
                                    resume,
                                ) {
                                    link.server.send(&Message::Error {
                                        code: code::RESUME_UNAVAILABLE,
                                        reason: e.to_string(),
                                    });
                                    link.closed = true;
                                }
                            }
                            Message::Ack(a) => {
                                let ack_msg = Message::AckReceived {
                                    version: a.version,
                                    node_id: a.node_id.clone(),
                                };
                                r.hub.on_ack(a);
                                link.server.send(&ack_msg);
                            }
                            m @ (Message::Header { .. }
                            | Message::Chunk { .. }
                            | Message::End { .. }) => {
                                if let Message::Header { version, .. } = &m {
                                    link.publisher_version = Some(*version);
                                }
                                r.hub.on_upstream(m).unwrap();
                            }
                            other => panic!("unexpected {other:?}"),
                        },
                    }
                }
            }
            // Backpressure: no clock here, so nothing is ever force-evicted.
            r.hub.relieve();
            // Children pull from the hub; publishers get their acks.
            for link in &mut r.links {
                if let (Some(id), false) = (link.child, link.closed) {
                    let mut n = 0;
                    while n < link.budget {
                        match r.hub.poll_child(id) {
                            ChildPoll::Send(m) => link.server.send(&m),
                            ChildPoll::Wait | ChildPoll::Done => break,
                            ChildPoll::Fail(e) => {
                                link.server.send(&Message::Error {
                                    code: code::RESUME_UNAVAILABLE,
                                    reason: e.to_string(),
                                });
                                link.closed = true;
                                break;
                            }
                        }
                        n += 1;
                    }
                }
                if let (Some(v), false) = (link.publisher_version, link.closed) {
                    let (acks, next) = r.hub.acks_since(link.ack_idx);
                    link.ack_idx = next;
                    for a in acks.into_iter().filter(|a| a.version == v) {
                        link.server.send(&Message::Ack(a));
                    }
                }
                while let Some(b) = link.server.poll_transmit() {
                    let start = link.s2c_sent;
                    link.s2c_sent += b.len();
                    link.s2c.extend_from_slice(&b);
                    if let Some(at) = link.corrupt_at {
                        if at >= start && at < link.s2c_sent {
                            let i = link.s2c.len() - (link.s2c_sent - at);
                            link.s2c[i] ^= 0x40;
                            link.corrupt_at = None;
                        }
                    }
                    moved = true;
                }
            }
        }
        // Clients receive.
        if let Some((c, r, l)) = &mut self.publ {
            let mut s2c = std::mem::take(&mut self.relays[*r].links[*l].s2c);
            Self::feed(&mut s2c, mtu, |p| c.handle_input(p, now)).unwrap();
            while let Some(ev) = c.poll_event() {
                if let Event::Ack(a) = ev {
                    self.pub_acks.push(a);
                }
            }
        }
        for s in &mut self.subs {
            let link = &mut self.relays[s.at.0].links[s.at.1];
            if s.error.is_some() {
                link.s2c.clear();
                continue;
            }
            let mut s2c = std::mem::take(&mut link.s2c);
            if let Err(e) = Self::feed(&mut s2c, mtu, |p| s.conn.handle_input(p, now)) {
                s.error = Some(e);
            }
            while let Some(ev) = s.conn.poll_event() {
                match ev {
                    Event::Stream(m) => {
                        s.cursor.accept(&m).unwrap();
                        s.got.push(m);
                    }
                    Event::AckReceived { version, node_id } => s.acked.push((version, node_id)),
                    _ => {}
                }
            }
        }
        for i in 0..self.relays.len() {
            let Some((_, p, l, _)) = &self.relays[i].up else {
                continue;
            };
            let (p, l) = (*p, *l);
            let mut s2c = std::mem::take(&mut self.relays[p].links[l].s2c);
            let node = &mut self.relays[i];
            let (c, _, _, ack_idx) = node.up.as_mut().unwrap();
            Self::feed(&mut s2c, mtu, |b| c.handle_input(b, now)).unwrap();
            while let Some(ev) = c.poll_event() {
                if let Event::Stream(m) = ev {
                    node.hub.on_upstream(m).unwrap();
                }
            }
            let (acks, next) = node.hub.acks_since(*ack_idx);
            *ack_idx = next;
            for a in acks {
                c.send_ack(a);
            }
        }
        moved
    }

    fn settle(&mut self) {
        for _ in 0..10_000 {
            if !self.tick() {
                return;
            }
        }
        panic!("harness did not settle");
    }
}

fn chunks(n: usize) -> Vec<Bytes> {
    (0..n)
        .map(|i| Bytes::from(vec![(i % 251) as u8; 100 + (i * 37) % 300]))
        .collect()
}

fn check_stream(got: &[Message], version: u64, data: &[Bytes], trailer: &[u8]) {
    assert!(
        matches!(&got[0], Message::Header { version: v, .. } if *v == version),
        "{:?}",
        got.first()
    );
    for (i, d) in data.iter().enumerate() {
        match &got[1 + i] {
            Message::Chunk {
                version: v,
                seq,
                blob,
            } => {
                assert_eq!((*v, *seq as usize), (version, i));
                assert_eq!(blob, d);
            }
            o => panic!("chunk {i}: {o:?}"),
        }
    }
    assert_eq!(got.len(), data.len() + 2, "exactly once");
    assert!(
        matches!(&got[data.len() + 1], Message::End { count, trailer: t, .. } if *count as usize == data.len() && t == trailer)
    );
}

fn ack(v: u64, id: &str, ok: bool) -> Ack {
    Ack {
        version: v,
        node_id: id.into(),
        digest: [7; 16],
        ok,
        reason: if ok {
            String::new()
        } else {
            "digest mismatch".into()
        },
    }
}

#[test]
fn three_peer_tree_streams_cut_through_and_collects_acks() {
    let mut w = World::new(7);
    let root = w.relay(1 << 20, false);
    let mid = w.relay(1 << 20, false);
    w.attach_relay(mid, root);
    let s0 = w.add_sub(root, key());
    let s1 = w.add_sub(mid, key());
    let s2 = w.add_sub(mid, key());
    w.publisher(root);
    w.settle();
    let data = chunks(20);
    let p = &mut w.publ.as_mut().unwrap().0;
    p.send_header(5, Bytes::from_static(b"0123456789abcdef-hdr"))
        .unwrap();
    // Cut-through: each chunk reaches the leaves before the next is produced.
    for (i, d) in data.iter().enumerate() {
        let seq = w.publ.as_mut().unwrap().0.send_chunk(d.clone()).unwrap();
        assert_eq!(seq as usize, i);
        w.settle();
        for s in [s0, s1, s2] {
            assert_eq!(
                w.subs[s].got.len(),
                i + 2,
                "sub {s} has chunk {i} before the publisher sends more"
            );
        }
    }
    w.publ
        .as_mut()
        .unwrap()
        .0
        .send_end(Bytes::from_static(b"trailer"))
        .unwrap();
    w.settle();
    for s in [s0, s1, s2] {
        check_stream(&w.subs[s].got, 5, &data, b"trailer");
        assert!(w.subs[s].cursor.is_complete());
    }
    // Acks flow up through the mid relay to the publisher.
    w.subs[s0].conn.send_ack(ack(5, "sub-0", true));
    w.subs[s1].conn.send_ack(ack(5, "sub-1", true));
    w.subs[s2].conn.send_ack(ack(5, "sub-2", false));
    w.settle();
    let mut ids: Vec<_> = w
        .pub_acks
        .iter()
        .map(|a| (a.node_id.clone(), a.ok))
        .collect();
    ids.sort();
    assert_eq!(
        ids,
        vec![
            ("sub-0".into(), true),
            ("sub-1".into(), true),
            ("sub-2".into(), false)
        ]
    );
    assert_eq!(w.subs[s2].acked, vec![(5, "sub-2".to_string())]);
}

#[test]
fn failover_resumes_without_duplicates() {
    let mut w = World::new(1000);
    let root = w.relay(1 << 20, false);
    let a = w.relay(1 << 20, false);
    w.attach_relay(a, root);
    let s = w.add_sub(a, key());
    w.publisher(root);
    w.settle();
    let data = chunks(10);
    w.publ
        .as_mut()
        .unwrap()
        .0
        .send_header(1, Bytes::from_static(b"h"))
        .unwrap();
    for d in &data[..6] {
        w.publ.as_mut().unwrap().0.send_chunk(d.clone()).unwrap();
    }
    w.settle();
    assert_eq!(w.subs[s].got.len(), 7);
    // Relay `a` dies; the subscriber re-attaches to the root and resumes at seq 6.
    w.move_sub(s, root);
    for d in &data[6..] {
        w.publ.as_mut().unwrap().0.send_chunk(d.clone()).unwrap();
    }
    w.publ.as_mut().unwrap().0.send_end(Bytes::new()).unwrap();
    w.settle();
    check_stream(&w.subs[s].got, 1, &data, b"");
    assert_eq!(w.relays[root].hub.resumes, 1);
}

#[test]
fn slow_child_does_not_stall_siblings() {
    let mut w = World::new(512);
    let root = w.relay(1 << 20, true);
    let fast = w.add_sub(root, key());
    let slow = w.add_sub(root, key());
    w.publisher(root);
    w.settle();
    w.relays[root].links[w.subs[slow].at.1].budget = 0;
    let data = chunks(30);
    let p = &mut w.publ.as_mut().unwrap().0;
    p.send_header(2, Bytes::from_static(b"h")).unwrap();
    for d in &data {
        p.send_chunk(d.clone()).unwrap();
    }
    p.send_end(Bytes::new()).unwrap();
    w.settle();
    check_stream(&w.subs[fast].got, 2, &data, b"");
    assert!(w.subs[slow].got.is_empty());
    assert_eq!(w.relays[root].hub.max_lag(), 30);
    w.relays[root].links[w.subs[slow].at.1].budget = 1;
    w.settle();
    check_stream(&w.subs[slow].got, 2, &data, b"");
}

#[test]
fn late_child_reads_spilled_retention() {
    let mut w = World::new(4096);
    let root = w.relay(1000, true);
    w.publisher(root);
    w.settle();
    let data = chunks(40);
    let p = &mut w.publ.as_mut().unwrap().0;
    p.send_header(3, Bytes::from_static(b"h")).unwrap();
    for d in &data {
        p.send_chunk(d.clone()).unwrap();
    }
    p.send_end(Bytes::new()).unwrap();
    w.settle();
    assert!(w.relays[root].hub.store().mem_bytes() <= 1000 + 400);
    assert!(w.relays[root].hub.store().spilled_chunks > 30);
    let s = w.add_sub(root, key());
    w.settle();
    check_stream(&w.subs[s].got, 3, &data, b"");
}

#[test]
fn evicted_resume_is_refused_so_receiver_tries_elsewhere() {
    let mut w = World::new(4096);
    let root = w.relay(500, false);
    w.publisher(root);
    w.settle();
    let data = chunks(20);
    let p = &mut w.publ.as_mut().unwrap().0;
    p.send_header(3, Bytes::from_static(b"h")).unwrap();
    for d in &data {
        p.send_chunk(d.clone()).unwrap();
    }
    w.settle();
    let s = w.add_sub(root, key());
    w.settle();
    assert!(
        matches!(w.subs[s].error, Some(Error::ResumeUnavailable { .. })),
        "{:?}",
        w.subs[s].error
    );
    assert_eq!(w.subs[s].got.len(), 1, "only the header was delivered");
}

#[test]
fn corrupted_byte_detected_and_refetched_from_other_parent() {
    let mut w = World::new(64);
    let root = w.relay(1 << 20, false);
    let bad = w.relay(1 << 20, false);
    w.attach_relay(bad, root);
    let s = w.add_sub(bad, key());
    w.publisher(root);
    w.settle();
    let l = w.subs[s].at.1;
    let sent = w.relays[bad].links[l].s2c_sent;
    w.relays[bad].links[l].corrupt_at = Some(sent + 700);
    let data = chunks(12);
    let p = &mut w.publ.as_mut().unwrap().0;
    p.send_header(9, Bytes::from_static(b"h")).unwrap();
    for d in &data {
        p.send_chunk(d.clone()).unwrap();
    }
    p.send_end(Bytes::new()).unwrap();
    w.settle();
    assert!(
        matches!(w.subs[s].error, Some(Error::MessageChecksum { .. })),
        "{:?}",
        w.subs[s].error
    );
    let partial = w.subs[s].got.len();
    assert!(partial > 1 && partial < 14, "{partial}");
    w.move_sub(s, root);
    w.settle();
    check_stream(&w.subs[s].got, 9, &data, b"");
}

#[test]
fn wrong_key_refused_before_any_payload() {
    let mut w = World::new(16);
    let root = w.relay(1 << 20, false);
    w.publisher(root);
    let s = w.add_sub(
        root,
        Some(PreSharedKey::new(b"some-other-key-0123456").unwrap()),
    );
    let n = w.add_sub(root, None);
    w.settle();
    let p = &mut w.publ.as_mut().unwrap().0;
    p.send_header(1, Bytes::from_static(b"h")).unwrap();
    p.send_chunk(Bytes::from_static(b"secret")).unwrap();
    p.send_end(Bytes::new()).unwrap();
    w.settle();
    assert!(
        matches!(
            w.subs[s].error,
            Some(Error::AuthRefused { side: "local", .. })
        ),
        "{:?}",
        w.subs[s].error
    );
    assert!(
        matches!(
            w.subs[n].error,
            Some(Error::AuthRefused { side: "parent", .. })
        ),
        "{:?}",
        w.subs[n].error
    );
    for x in [s, n] {
        assert!(w.subs[x].got.is_empty());
        let link = &w.relays[root].links[w.subs[x].at.1];
        assert!(
            link.error.as_deref().unwrap_or("").contains("refused"),
            "{:?}",
            link.error
        );
    }
}

#[test]
fn follower_relay_carries_successive_versions() {
    let mut w = World::new(300);
    let root = w.relay(1 << 20, false);
    let mid = w.relay(1 << 20, false);
    w.attach_relay(mid, root);
    w.settle();
    for v in 1..=3u64 {
        w.publisher(root);
        let data = chunks(5 + v as usize);
        let p = &mut w.publ.as_mut().unwrap().0;
        p.send_header(v, Bytes::from(vec![v as u8; 16])).unwrap();
        for d in &data {
            p.send_chunk(d.clone()).unwrap();
        }
        p.send_end(Bytes::new()).unwrap();
        let s = w.add_sub(mid, key());
        w.subs[s].conn = ClientConn::receiver(
            &settings("x", key()),
            Role::Subscriber,
            Cursor::once(v),
            [5; 32],
            w.now,
        );
        w.subs[s].cursor = Cursor::once(v);
        w.settle();
        check_stream(&w.subs[s].got, v, &data, b"");
    }
    assert_eq!(
        w.relays[mid].hub.store().versions().collect::<Vec<_>>(),
        vec![2, 3]
    );
}

#[test]
fn resume_of_a_version_the_relay_skipped_is_refused() {
    let mut w = World::new(4096);
    let root = w.relay(1 << 20, false);
    w.publisher(root);
    w.settle();
    let p = &mut w.publ.as_mut().unwrap().0;
    p.send_header(8, Bytes::from_static(b"h")).unwrap();
    p.send_end(Bytes::new()).unwrap();
    w.settle();
    let s = w.add_sub(root, key());
    let mut cur = Cursor::once(0);
    cur.version = Some(7);
    cur.next_seq = 3;
    cur.have_header = true;
    w.subs[s].conn = ClientConn::receiver(
        &settings("x", key()),
        Role::Subscriber,
        cur.clone(),
        [5; 32],
        w.now,
    );
    w.subs[s].cursor = cur;
    w.settle();
    assert!(
        matches!(w.subs[s].error, Some(Error::ResumeUnavailable { .. })),
        "{:?}",
        w.subs[s].error
    );
}

#[test]
fn abandoned_partial_version_sends_children_elsewhere() {
    let mut w = World::new(4096);
    let root = w.relay(1 << 20, false);
    let s = w.add_sub(root, key());
    w.publisher(root);
    w.settle();
    let p = &mut w.publ.as_mut().unwrap().0;
    p.send_header(4, Bytes::from_static(b"h")).unwrap();
    p.send_chunk(Bytes::from_static(b"c0")).unwrap();
    w.settle();
    assert_eq!(w.subs[s].got.len(), 2);
    assert_eq!(w.relays[root].hub.abandon_partial(), Some(4));
    assert_eq!(w.relays[root].hub.upstream_resume(), (5, None));
    w.settle();
    assert!(
        matches!(w.subs[s].error, Some(Error::ResumeUnavailable { .. })),
        "{:?}",
        w.subs[s].error
    );
}

#[test]
fn without_spill_lagging_child_holds_chunks_and_signals_backpressure() {
    let mut w = World::new(4096);
    let root = w.relay(1000, false);
    let fast = w.add_sub(root, key());
    let slow = w.add_sub(root, key());
    w.publisher(root);
    w.settle();
    let sl = w.subs[slow].at.1;
    w.relays[root].links[sl].budget = 2; // header + chunk 0, then stuck
    w.settle();
    w.relays[root].links[sl].budget = 0;
    let data = chunks(20);
    let p = &mut w.publ.as_mut().unwrap().0;
    p.send_header(1, Bytes::from_static(b"h")).unwrap();
    for d in &data {
        p.send_chunk(d.clone()).unwrap();
    }
    p.send_end(Bytes::new()).unwrap();
    w.settle();
    check_stream(&w.subs[fast].got, 1, &data, b"");
    // Memory is over budget, but nothing the slow child needs was evicted:
    // the hub asks the driver to stop reading upstream.
    assert!(w.relays[root].hub.relieve(), "backpressure requested");
    assert!(w.relays[root].hub.store().mem_bytes() > 1000);
    assert_eq!(w.relays[root].hub.store().evicted_chunks, 0);
    w.relays[root].links[sl].budget = usize::MAX;
    w.settle();
    check_stream(&w.subs[slow].got, 1, &data, b"");
    assert!(
        !w.relays[root].hub.relieve(),
        "room again once the slow child caught up"
    );
    assert!(w.relays[root].hub.store().mem_bytes() <= 1000 + 400);
}

#[test]
fn unauthenticated_peer_cannot_announce_a_large_frame() {
    let mut s = ServerConn::new(key(), 64 << 20, [1; 32]);
    // A 1 MiB frame announced before the handshake is refused outright.
    let e = s.handle_input(&(1u32 << 20).to_le_bytes()).unwrap_err();
    assert!(matches!(e, Error::FrameTooLarge { max: 16384, .. }), "{e}");
}
