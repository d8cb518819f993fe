//! Joint commit bookkeeping of the publishing side: which version each
//! registered receiver committed, the baseline the next delta is diffed
//! against, the retained chain of deltas that receivers behind catch up
//! through, and when a delta can be deleted.
//!
//! [`Ledger`] is free of I/O and of the clock; [`LedgerStore`] keeps it in a
//! small JSON file written atomically.
//!
//! # Rules
//! - Versions form one chain: every published delta goes from the
//!   *baseline* to a new head.
//! - The baseline is the last version committed by every *active*
//!   registered receiver (the joint commit). A delta based anywhere else is
//!   refused, so a failed refit can never be swallowed while the sender moves
//!   on: if no receiver committed the head, the next delta is built from the
//!   version they hold, and the head is *superseded* (dropped from the chain;
//!   a receiver that did commit it is told to do a dense refit).
//! - A receiver that does not commit in time can be marked *lagging*
//!   ([`Ledger::mark_lagging`]): it no longer holds the baseline back, and it
//!   catches up through the retained chain ([`Ledger::catch_up`]) or by a
//!   dense refit. Committing the head makes it active again.
//! - A delta is retained until every registered receiver whose version is
//!   on the chain has committed past it ([`Ledger::collect_garbage`]), or
//!   until the retention limits drop it (receivers that needed it are then
//!   told to do a dense refit).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::checkpoint::{digest_hex, Digest};
use crate::error::{Error, Result};

/// A version and the digest that proves it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Version {
    pub version: u64,
    #[serde(with = "hex16")]
    pub digest: Digest,
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "v{} ({})", self.version, &digest_hex(&self.digest)[..12])
    }
}

/// A published delta.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaEntry {
    pub base: Version,
    pub target: Version,
    #[serde(with = "hex16")]
    pub delta_id: Digest,
    /// Size in bytes (for the retention limit).
    pub bytes: u64,
    /// Where receivers fetch it (a path, URL or object key).
    pub location: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReceiverEntry {
    /// The version it last committed; `None` until it reports one.
    pub committed: Option<Version>,
    /// Excluded from the joint commit until it commits the head.
    pub lagging: bool,
}

/// Limits on the retained chain; the oldest deltas go first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retention {
    pub max_deltas: usize,
    pub max_bytes: u64,
}

impl Default for Retention {
    fn default() -> Self {
        Retention { max_deltas: 64, max_bytes: u64::MAX }
    }
}

/// What a receiver must do to reach the head.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CatchUp {
    UpToDate,
    /// Apply these deltas, in order.
    Deltas(Vec<DeltaEntry>),
    /// No retained chain leads from its version to the head.
    Dense {
        head: Version,
        reason: String,
    },
}

/// The publishing side's view of its receivers. See the module docs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ledger {
    head: Version,
    /// Retained deltas, consecutive: `chain[i].target == chain[i + 1].base`,
    /// the last one's target is the head.
    chain: Vec<DeltaEntry>,
    /// Every version published (or the genesis), by number.
    #[serde(with = "versions_map")]
    versions: BTreeMap<u64, Digest>,
    /// Versions dropped from the chain because the joint commit never
    /// reached them.
    superseded: BTreeSet<u64>,
    receivers: BTreeMap<String, ReceiverEntry>,
    retention: Retention,
}

fn refused(op: &'static str, detail: String) -> Error {
    Error::LedgerRefused { op, detail }
}

impl Ledger {
    /// A ledger whose receivers start from `genesis` (loaded densely).
    pub fn new(genesis: Version, retention: Retention) -> Self {
        Ledger {
            head: genesis,
            chain: Vec::new(),
            versions: BTreeMap::from([(genesis.version, genesis.digest)]),
            superseded: BTreeSet::new(),
            receivers: BTreeMap::new(),
            retention,
        }
    }

    pub fn head(&self) -> Version {
        self.head
    }
    pub fn chain(&self) -> &[DeltaEntry] {
        &self.chain
    }
    pub fn receivers(&self) -> &BTreeMap<String, ReceiverEntry> {
        &self.receivers
    }

    fn known(&self, op: &'static str, v: &Version) -> Result<()> {
        match self.versions.get(&v.version) {
            Some(d) if d == &v.digest => Ok(()),
            Some(d) => Err(refused(
                op,
                format!(
                    "version {} has digest {} here, but {} was reported: the receiver holds different bits than the sender published; do a dense refit",
                    v.version,
                    digest_hex(d),
                    digest_hex(&v.digest)
                ),
            )),
            None => Err(refused(op, format!("version {} was never published here", v.version))),
        }
    }

    /// Registers a receiver holding `committed` (a published version), or
    /// nothing yet (it must load densely; it is lagging until it commits).
    pub fn register(&mut self, name: &str, committed: Option<Version>) -> Result<()> {
        if self.receivers.contains_key(name) {
            return Err(refused("register", format!("receiver {name:?} is already registered")));
        }
        if let Some(v) = &committed {
            self.known("register", v)?;
        }
        let lagging = committed.is_none_or(|c| c != self.head);
        self.receivers.insert(name.to_string(), ReceiverEntry { committed, lagging });
        Ok(())
    }

    pub fn unregister(&mut self, name: &str) -> Result<ReceiverEntry> {
        self.receivers.remove(name).ok_or_else(|| refused("unregister", format!("no receiver {name:?}")))
    }

    /// Records that `name` committed `v` (after its digests verified, by a
    /// refit or a dense load). A receiver never moves back.
    pub fn report_commit(&mut self, name: &str, v: Version) -> Result<()> {
        self.known("report_commit", &v)?;
        let head = self.head;
        let r = self
            .receivers
            .get_mut(name)
            .ok_or_else(|| refused("report_commit", format!("no receiver {name:?}: register it first")))?;
        if let Some(c) = r.committed {
            if v.version < c.version {
                return Err(refused(
                    "report_commit",
                    format!("receiver {name:?} already committed v{}, it cannot go back to v{}", c.version, v.version),
                ));
            }
        }
        r.committed = Some(v);
        if v == head {
            r.lagging = false;
        }
        Ok(())
    }

    /// Excludes `name` from the joint commit until it commits the head.
    pub fn mark_lagging(&mut self, name: &str) -> Result<()> {
        let r = self.receivers.get_mut(name).ok_or_else(|| refused("mark_lagging", format!("no receiver {name:?}")))?;
        r.lagging = true;
        Ok(())
    }

    fn active(&self) -> impl Iterator<Item = (&String, &ReceiverEntry)> {
        self.receivers.iter().filter(|(_, r)| !r.lagging)
    }

    /// The version the next delta must be diffed against: the last version
    /// every active receiver committed (the head when there are none).
    pub fn baseline(&self) -> Version {
        let on_chain =
            |c: &Version| self.versions.get(&c.version) == Some(&c.digest) && !self.superseded.contains(&c.version);
        self.active()
            .filter_map(|(_, r)| r.committed.filter(on_chain))
            .min_by_key(|c| c.version)
            .map_or(self.head, |c| if c.version > self.head.version { self.head } else { c })
    }

    /// Active receivers that have not committed the head yet.
    pub fn pending(&self) -> Vec<String> {
        self.active().filter(|(_, r)| r.committed != Some(self.head)).map(|(n, _)| n.clone()).collect()
    }

    /// Publishes a delta from the baseline to a new version. Refused unless
    /// its base is the baseline and its target is newer than the head. If the
    /// baseline is behind the head (no joint commit of the head), the
    /// versions after the baseline are superseded and returned.
    pub fn publish(&mut self, delta: DeltaEntry) -> Result<Vec<u64>> {
        let base = self.baseline();
        if delta.base != base {
            let pending = self.pending();
            return Err(refused(
                "publish",
                format!(
                    "the delta is based on {}, but the baseline (the last version every active receiver committed) is {}{}: diff the new version against {} instead",
                    delta.base,
                    base,
                    if pending.is_empty() { String::new() } else { format!("; waiting for {pending:?} to commit {}", self.head) },
                    base
                ),
            ));
        }
        if delta.target.version <= self.head.version {
            return Err(refused(
                "publish",
                format!(
                    "the delta targets v{}, but v{} is already published: versions must increase",
                    delta.target.version, self.head.version
                ),
            ));
        }
        let mut superseded = Vec::new();
        while self.chain.last().is_some_and(|d| d.target.version > base.version) {
            let d = self.chain.pop().expect("checked");
            superseded.push(d.target.version);
            self.superseded.insert(d.target.version);
        }
        superseded.reverse();
        self.versions.insert(delta.target.version, delta.target.digest);
        self.head = delta.target;
        self.chain.push(delta);
        Ok(superseded)
    }

    /// What `name` must do to reach the head.
    pub fn catch_up(&self, name: &str) -> Result<CatchUp> {
        let r = self.receivers.get(name).ok_or_else(|| refused("catch_up", format!("no receiver {name:?}")))?;
        let Some(c) = r.committed else {
            return Ok(CatchUp::Dense { head: self.head, reason: "it has not committed any version".into() });
        };
        if c == self.head {
            return Ok(CatchUp::UpToDate);
        }
        if self.superseded.contains(&c.version) {
            return Ok(CatchUp::Dense {
                head: self.head,
                reason: format!("its v{} was superseded: the other receivers never committed it", c.version),
            });
        }
        match self.chain.iter().position(|d| d.base == c) {
            Some(i) => Ok(CatchUp::Deltas(self.chain[i..].to_vec())),
            None => Ok(CatchUp::Dense {
                head: self.head,
                reason: format!("the deltas after v{} are no longer retained", c.version),
            }),
        }
    }

    /// Drops the deltas no registered receiver needs any more (every one
    /// whose version is on the chain has committed past them), then the
    /// oldest ones beyond the retention limits. Returns what was dropped, so
    /// the caller can delete the stored deltas.
    pub fn collect_garbage(&mut self) -> Vec<DeltaEntry> {
        let on_chain = |c: &Version| {
            self.versions.get(&c.version) == Some(&c.digest)
                && !self.superseded.contains(&c.version)
                && (c == &self.head || self.chain.iter().any(|d| &d.base == c))
        };
        let oldest_needed =
            self.receivers.values().filter_map(|r| r.committed.filter(|c| on_chain(c))).map(|c| c.version).min();
        let mut keep_from = match oldest_needed {
            Some(v) => self.chain.iter().position(|d| d.base.version >= v).unwrap_or(self.chain.len()),
            None => self.chain.len(),
        };
        let len = |from: usize| self.chain.len() - from;
        let bytes = |from: usize| self.chain[from..].iter().map(|d| d.bytes).sum::<u64>();
        while keep_from < self.chain.len()
            && (len(keep_from) > self.retention.max_deltas || bytes(keep_from) > self.retention.max_bytes)
        {
            keep_from += 1;
        }
        self.chain.drain(..keep_from).collect()
    }
}

/// The ledger in a JSON file, replaced atomically on every save.
pub struct LedgerStore {
    path: PathBuf,
}

const LEDGER_FORMAT: &str = "dcr.ledger/1";

#[derive(Serialize, Deserialize)]
struct LedgerFile {
    format: String,
    ledger: Ledger,
}

impl LedgerStore {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        LedgerStore { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The stored ledger, or `None` if the file does not exist.
    pub fn load(&self) -> Result<Option<Ledger>> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io("read", &self.path, e)),
        };
        let corrupt = |detail: String| Error::LedgerCorrupt { path: self.path.clone(), detail };
        let f: LedgerFile = serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
        if f.format != LEDGER_FORMAT {
            return Err(corrupt(format!("format is {:?}, this dcr reads {LEDGER_FORMAT:?}", f.format)));
        }
        Ok(Some(f.ledger))
    }

    /// Writes the ledger atomically (temp file, fsync, rename, directory fsync).
    pub fn save(&self, ledger: &Ledger) -> Result<()> {
        let f = LedgerFile { format: LEDGER_FORMAT.into(), ledger: ledger.clone() };
        let json =
            serde_json::to_vec_pretty(&f).map_err(|e| Error::Invalid(format!("cannot encode the ledger: {e}")))?;
        crate::files::write_atomically(&self.path, |w| {
            w.write_all(&json).map_err(|e| Error::io("write", &self.path, e))
        })
    }
}

mod hex16 {
    use serde::{de::Error as _, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &[u8; 16], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&crate::checkpoint::digest_hex(d))
    }

    pub fn parse(h: &str) -> Option<[u8; 16]> {
        if h.len() != 32 || !h.is_ascii() {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&h[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(out)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 16], D::Error> {
        let h = String::deserialize(d)?;
        parse(&h).ok_or_else(|| D::Error::custom(format!("expected 32 hex digits, found {h:?}")))
    }
}

mod versions_map {
    use std::collections::BTreeMap;

    use serde::{de::Error as _, Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(m: &BTreeMap<u64, [u8; 16]>, s: S) -> Result<S::Ok, S::Error> {
        let v: BTreeMap<String, String> =
            m.iter().map(|(k, d)| (k.to_string(), crate::checkpoint::digest_hex(d))).collect();
        v.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<u64, [u8; 16]>, D::Error> {
        let v = BTreeMap::<String, String>::deserialize(d)?;
        v.into_iter()
            .map(|(k, h)| {
                let k = k.parse().map_err(|_| D::Error::custom(format!("version {k:?} is not a number")))?;
                let d = super::hex16::parse(&h).ok_or_else(|| D::Error::custom(format!("bad digest {h:?}")))?;
                Ok((k, d))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(n: u64) -> Version {
        Version { version: n, digest: [n as u8 ^ 0xa5; 16] }
    }

    fn delta(a: u64, b: u64) -> DeltaEntry {
        DeltaEntry {
            base: v(a),
            target: v(b),
            delta_id: [(a * 16 + b) as u8; 16],
            bytes: 100,
            location: format!("{a}-{b}.dcr"),
        }
    }

    fn ledger(names: &[&str]) -> Ledger {
        let mut l = Ledger::new(v(0), Retention::default());
        for n in names {
            l.register(n, Some(v(0))).unwrap();
        }
        l
    }

    fn targets(c: CatchUp) -> Vec<u64> {
        match c {
            CatchUp::Deltas(ds) => ds.iter().map(|d| d.target.version).collect(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_baseline_advances_only_with_the_joint_commit() {
        let mut l = ledger(&["a", "b"]);
        assert_eq!(l.baseline(), v(0));
        assert!(l.publish(delta(0, 1)).unwrap().is_empty());
        l.report_commit("a", v(1)).unwrap();
        assert_eq!(l.baseline(), v(0), "b has not committed v1");
        assert_eq!(l.pending(), vec!["b".to_string()]);
        let e = l.publish(delta(1, 2)).unwrap_err().to_string();
        assert!(e.contains("baseline") && e.contains("v0") && e.contains("\"b\""), "{e}");
        l.report_commit("b", v(1)).unwrap();
        assert_eq!(l.baseline(), v(1));
        l.publish(delta(1, 2)).unwrap();
        assert_eq!(l.head(), v(2));
        // Versions must increase; bases must be the baseline.
        l.report_commit("a", v(2)).unwrap();
        l.report_commit("b", v(2)).unwrap();
        assert!(l.publish(delta(2, 2)).unwrap_err().to_string().contains("increase"));
        assert!(l.publish(delta(1, 3)).is_err());
    }

    #[test]
    fn a_head_nobody_committed_is_superseded() {
        let mut l = ledger(&["a", "b"]);
        l.publish(delta(0, 1)).unwrap();
        // Both failed verification and stayed at v0: v2 is diffed against v0.
        assert_eq!(l.publish(delta(0, 2)).unwrap(), vec![1]);
        assert_eq!(l.chain().len(), 1);
        assert_eq!(targets(l.catch_up("a").unwrap()), vec![2]);
        // A late report of v1 is recorded but leads to a dense refit.
        l.report_commit("a", v(1)).unwrap();
        assert!(matches!(l.catch_up("a").unwrap(), CatchUp::Dense { reason, .. } if reason.contains("superseded")));
    }

    #[test]
    fn a_lagging_receiver_catches_up_through_the_chain_and_holds_gc_back() {
        let mut l = ledger(&["a", "slow"]);
        l.publish(delta(0, 1)).unwrap();
        l.report_commit("a", v(1)).unwrap();
        l.mark_lagging("slow").unwrap();
        assert_eq!(l.baseline(), v(1));
        for (x, y) in [(1, 2), (2, 3)] {
            l.publish(delta(x, y)).unwrap();
            l.report_commit("a", v(y)).unwrap();
            assert!(l.collect_garbage().is_empty(), "slow still needs 0->1");
        }
        assert_eq!(targets(l.catch_up("slow").unwrap()), vec![1, 2, 3]);
        assert_eq!(l.catch_up("a").unwrap(), CatchUp::UpToDate);
        // It applies two of them: the first two can go.
        l.report_commit("slow", v(2)).unwrap();
        assert!(l.receivers()["slow"].lagging);
        let gone: Vec<u64> = l.collect_garbage().iter().map(|d| d.target.version).collect();
        assert_eq!(gone, vec![1, 2]);
        assert_eq!(targets(l.catch_up("slow").unwrap()), vec![3]);
        l.report_commit("slow", v(3)).unwrap();
        assert!(!l.receivers()["slow"].lagging, "committing the head rejoins");
        assert_eq!(l.collect_garbage().len(), 1);
        assert!(l.chain().is_empty());
    }

    #[test]
    fn retention_limits_drop_the_oldest_and_send_laggards_to_a_dense_refit() {
        let mut l = Ledger::new(v(0), Retention { max_deltas: 2, max_bytes: u64::MAX });
        l.register("a", Some(v(0))).unwrap();
        l.register("b", Some(v(0))).unwrap();
        l.mark_lagging("b").unwrap();
        for i in 0..4 {
            l.publish(delta(i, i + 1)).unwrap();
            l.report_commit("a", v(i + 1)).unwrap();
        }
        let gone: Vec<u64> = l.collect_garbage().iter().map(|d| d.target.version).collect();
        assert_eq!(gone, vec![1, 2]);
        assert!(matches!(l.catch_up("b").unwrap(), CatchUp::Dense { head, .. } if head == v(4)));
        // A dense refit to the head brings it back.
        l.report_commit("b", v(4)).unwrap();
        assert_eq!(l.catch_up("b").unwrap(), CatchUp::UpToDate);
        assert_eq!(l.collect_garbage().len(), 2);
    }

    #[test]
    fn reports_are_checked_against_what_was_published() {
        let mut l = ledger(&["a"]);
        l.publish(delta(0, 1)).unwrap();
        let mut wrong = v(1);
        wrong.digest[0] ^= 1;
        assert!(l.report_commit("a", wrong).unwrap_err().to_string().contains("different bits"));
        assert!(l.report_commit("a", v(7)).unwrap_err().to_string().contains("never published"));
        assert!(l.report_commit("nobody", v(1)).is_err());
        l.report_commit("a", v(1)).unwrap();
        assert!(l.report_commit("a", v(0)).unwrap_err().to_string().contains("cannot go back"));
        assert!(l.register("a", None).is_err());
        l.register("new", None).unwrap();
        assert!(matches!(l.catch_up("new").unwrap(), CatchUp::Dense { .. }));
        assert_eq!(l.baseline(), v(1), "a receiver with no version does not hold the baseline back");
        l.unregister("new").unwrap();
        assert!(l.unregister("new").is_err());
    }

    #[test]
    fn the_store_round_trips_and_refuses_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let store = LedgerStore::new(dir.path().join("ledger.json"));
        assert!(store.load().unwrap().is_none());
        let mut l = ledger(&["a", "b"]);
        l.publish(delta(0, 1)).unwrap();
        l.report_commit("a", v(1)).unwrap();
        store.save(&l).unwrap();
        assert_eq!(store.load().unwrap().unwrap(), l);
        let text = std::fs::read_to_string(store.path()).unwrap();
        assert!(text.contains("dcr.ledger/1") && text.contains(&digest_hex(&v(1).digest)));
        std::fs::write(store.path(), text.replace("dcr.ledger/1", "dcr.ledger/9")).unwrap();
        assert!(store.load().unwrap_err().to_string().contains("dcr.ledger/9"));
        std::fs::write(store.path(), "{").unwrap();
        assert!(matches!(store.load(), Err(Error::LedgerCorrupt { .. })));
    }
}
