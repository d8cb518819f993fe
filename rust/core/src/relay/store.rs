//! Retention of version streams at a relay: chunks in memory up to a byte
//! budget, then spilled (to disk through the [`Spill`] trait) or evicted.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io;

use bytes::Bytes;

use crate::error::{Error, Result};

/// Where a spilled chunk lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpillRef {
    /// Version the chunk belongs to.
    pub version: u64,
    /// Byte offset in the version's spill file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u32,
    /// CRC32C of the chunk, checked on read.
    pub crc: u32,
}

/// Storage for chunks beyond the memory budget (a file per version in
/// production, memory in tests; tests can fail the Nth write).
pub trait Spill: Send {
    /// Store a chunk.
    fn put(&mut self, version: u64, data: &[u8]) -> io::Result<SpillRef>;
    /// Read a chunk back.
    fn get(&mut self, r: &SpillRef) -> io::Result<Vec<u8>>;
    /// Forget a version.
    fn drop_version(&mut self, version: u64);
}

/// A [`Spill`] in memory (tests).
#[derive(Debug, Default)]
pub struct MemSpill {
    files: HashMap<u64, Vec<u8>>,
    /// Number of bytes currently spilled.
    pub bytes: usize,
}

impl Spill for MemSpill {
    fn put(&mut self, version: u64, data: &[u8]) -> io::Result<SpillRef> {
        let f = self.files.entry(version).or_default();
        let r = SpillRef {
            version,
            offset: f.len() as u64,
            len: data.len() as u32,
            crc: crate::checksum::crc32c(data),
        };
        f.extend_from_slice(data);
        self.bytes += data.len();
        Ok(r)
    }
    fn get(&mut self, r: &SpillRef) -> io::Result<Vec<u8>> {
        let f = self
            .files
            .get(&r.version)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no such version"))?;
        Ok(f[r.offset as usize..r.offset as usize + r.len as usize].to_vec())
    }
    fn drop_version(&mut self, version: u64) {
        if let Some(f) = self.files.remove(&version) {
            self.bytes -= f.len();
        }
    }
}

#[derive(Debug, Clone)]
enum Slot {
    Mem(Bytes),
    Spilled(SpillRef),
    Evicted,
}

/// One version's stream as held by a relay.
#[derive(Debug, Default)]
pub struct Stream {
    header: Option<Bytes>,
    slots: Vec<Slot>,
    end: Option<(u32, Bytes)>,
}

impl Stream {
    /// The stream header, once received.
    pub fn header(&self) -> Option<&Bytes> {
        self.header.as_ref()
    }
    /// Chunks received so far.
    pub fn received(&self) -> u32 {
        self.slots.len() as u32
    }
    /// `(count, trailer)` once the end was received.
    pub fn end(&self) -> Option<&(u32, Bytes)> {
        self.end.as_ref()
    }
}

/// Retention limits.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Chunk bytes kept in memory; beyond this the oldest chunks spill (or are evicted without a spill).
    pub retention_bytes: usize,
    /// Number of versions kept; the oldest is dropped when a newer one starts.
    pub keep_versions: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            retention_bytes: 256 << 20,
            keep_versions: 2,
        }
    }
}

/// A chunk lookup.
#[derive(Debug)]
pub enum Get {
    /// The chunk.
    Ready(Bytes),
    /// Not received yet.
    NotYet,
    /// No longer held.
    Gone(String),
}

/// All versions held by a relay.
pub struct Store {
    cfg: StoreConfig,
    versions: BTreeMap<u64, Stream>,
    mem_bytes: usize,
    mem_order: VecDeque<(u64, u32)>,
    spill: Option<Box<dyn Spill>>,
    /// Versions dropped so far (the highest), to tell "pruned" from "not yet".
    dropped_below: u64,
    /// Chunks spilled so far.
    pub spilled_chunks: u64,
    /// Chunks evicted so far.
    pub evicted_chunks: u64,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("versions", &self.versions.keys().collect::<Vec<_>>())
            .field("mem_bytes", &self.mem_bytes)
            .finish()
    }
}

impl Store {
    /// An empty store.
    pub fn new(cfg: StoreConfig, spill: Option<Box<dyn Spill>>) -> Self {
        Store {
            cfg,
            versions: BTreeMap::new(),
            mem_bytes: 0,
            mem_order: VecDeque::new(),
            spill,
            dropped_below: 0,
            spilled_chunks: 0,
            evicted_chunks: 0,
        }
    }

    /// Chunk bytes held in memory.
    pub fn mem_bytes(&self) -> usize {
        self.mem_bytes
    }

    /// A version's stream.
    pub fn stream(&self, version: u64) -> Option<&Stream> {
        self.versions.get(&version)
    }

    /// Versions held, ascending.
    pub fn versions(&self) -> impl Iterator<Item = u64> + '_ {
        self.versions.keys().copied()
    }

    /// Newest version held.
    pub fn latest(&self) -> Option<(u64, &Stream)> {
        self.versions.iter().next_back().map(|(v, s)| (*v, s))
    }

    /// Whether `version` was held and has been dropped (or is older than anything held).
    pub fn is_pruned(&self, version: u64) -> bool {
        version < self.dropped_below
    }

    /// Versions below this one were dropped.
    pub fn pruned_below(&self) -> u64 {
        self.dropped_below
    }

    /// Smallest version `>= from` whose header is held.
    pub fn first_from(&self, from: u64) -> Option<u64> {
        self.versions
            .range(from..)
            .find(|(_, s)| s.header.is_some())
            .map(|(v, _)| *v)
    }

    /// Start a version.
    ///
    /// A publisher that retries after a lost connection sends the stream
    /// again from the start: a header, chunks and end identical to what is
    /// held are accepted and ignored (a differing one is an error).
    pub fn put_header(&mut self, version: u64, blob: Bytes) -> Result<()> {
        if let Some(s) = self.versions.get(&version) {
            if s.header.as_ref() == Some(&blob) {
                return Ok(());
            }
            return Err(Error::protocol(
                format!("the header version {version} already has (a replay must be identical)"),
                "a different header: publish changed content under a new version",
            ));
        }
        if let Some((latest, _)) = self.latest() {
            if version <= latest {
                return Err(Error::protocol(
                    format!("a version above {latest} (the newest held)"),
                    format!("header of version {version}: versions must increase"),
                ));
            }
        }
        self.versions.insert(
            version,
            Stream {
                header: Some(blob),
                ..Default::default()
            },
        );
        while self.versions.len() > self.cfg.keep_versions.max(1) {
            let (&old, _) = self.versions.iter().next().expect("non-empty");
            self.drop_version(old);
        }
        Ok(())
    }

    /// Forget a version (its chunks, its spill); it counts as pruned afterwards.
    pub fn drop_version(&mut self, v: u64) {
        if let Some(s) = self.versions.remove(&v) {
            for slot in &s.slots {
                if let Slot::Mem(b) = slot {
                    self.mem_bytes -= b.len();
                }
            }
            if let Some(sp) = self.spill.as_mut() {
                sp.drop_version(v);
            }
        }
        self.mem_order.retain(|(x, _)| *x != v);
        self.dropped_below = self.dropped_below.max(v + 1);
    }

    /// Append a chunk; `seq` must be the next one of an open version.
    pub fn put_chunk(&mut self, version: u64, seq: u32, blob: Bytes) -> Result<()> {
        if let Some(s) = self.versions.get(&version) {
            if let Some(slot) = s.slots.get(seq as usize) {
                let same = match slot {
                    Slot::Mem(b) => *b == blob,
                    Slot::Spilled(r) => {
                        r.len as usize == blob.len() && r.crc == crate::checksum::crc32c(&blob)
                    }
                    Slot::Evicted => true, // cannot check; the original was delivered already
                };
                if same {
                    return Ok(());
                }
                return Err(Error::protocol(
                    format!(
                        "chunk {seq} of version {version} as held (a replay must be identical)"
                    ),
                    "different bytes: publish changed content under a new version",
                ));
            }
        }
        let s = self.open_stream(version, "Chunk")?;
        if seq != s.slots.len() as u32 {
            return Err(Error::protocol(
                format!("chunk {} of version {version}", s.slots.len()),
                format!("chunk {seq}"),
            ));
        }
        let n = blob.len();
        s.slots.push(Slot::Mem(blob));
        self.mem_bytes += n;
        self.mem_order.push_back((version, seq));
        if self.spill.is_some() {
            // Spilling loses nothing: do it right away.
            self.enforce_budget(&|_, _| false);
        }
        Ok(())
    }

    /// Close a version; `count` must equal the chunks received.
    pub fn put_end(&mut self, version: u64, count: u32, trailer: Bytes) -> Result<()> {
        if let Some(s) = self.versions.get(&version) {
            if s.end.as_ref() == Some(&(count, trailer.clone())) {
                return Ok(());
            }
        }
        let s = self.open_stream(version, "End")?;
        if count != s.slots.len() as u32 {
            return Err(Error::protocol(
                format!(
                    "End with count {} (chunks received for version {version})",
                    s.slots.len()
                ),
                format!("count {count}"),
            ));
        }
        s.end = Some((count, trailer));
        Ok(())
    }

    fn open_stream(&mut self, version: u64, what: &str) -> Result<&mut Stream> {
        match self.versions.get_mut(&version) {
            Some(s) if s.end.is_none() => Ok(s),
            Some(_) => Err(Error::protocol(
                format!("{what} of an open version"),
                format!("version {version} already ended"),
            )),
            None => Err(Error::protocol(
                format!("{what} of a started version"),
                format!("version {version} has no header here"),
            )),
        }
    }

    /// Whether chunks beyond the budget go to a spill (else they are evicted).
    pub fn has_spill(&self) -> bool {
        self.spill.is_some()
    }

    /// Whether chunks in memory exceed the retention budget.
    pub fn over_budget(&self) -> bool {
        self.mem_bytes > self.cfg.retention_bytes
    }

    /// Bring memory back under the budget: spill the oldest chunks, or
    /// without a spill evict them, stopping at the first chunk for which
    /// `needed(version, seq)` holds (chunks are visited oldest first).
    /// Returns whether memory is still over budget.
    pub fn evict(&mut self, needed: &dyn Fn(u64, u32) -> bool) -> bool {
        self.enforce_budget(needed)
    }

    fn enforce_budget(&mut self, needed: &dyn Fn(u64, u32) -> bool) -> bool {
        // Never push out the newest chunk: children being served cut-through need it.
        while self.mem_bytes > self.cfg.retention_bytes && self.mem_order.len() > 1 {
            let (v, seq) = *self.mem_order.front().expect("len > 1");
            if self.spill.is_none() && needed(v, seq) {
                return true;
            }
            self.mem_order.pop_front();
            let Some(s) = self.versions.get_mut(&v) else {
                continue;
            };
            let slot = &mut s.slots[seq as usize];
            let Slot::Mem(b) = slot else { continue };
            let n = b.len();
            let new = match self.spill.as_mut().map(|sp| sp.put(v, b)) {
                Some(Ok(r)) => {
                    self.spilled_chunks += 1;
                    Slot::Spilled(r)
                }
                Some(Err(e)) => {
                    tracing::warn!(version = v, seq, error = %e, "spill write failed; chunk evicted from retention");
                    self.evicted_chunks += 1;
                    Slot::Evicted
                }
                None => {
                    self.evicted_chunks += 1;
                    Slot::Evicted
                }
            };
            *slot = new;
            self.mem_bytes -= n;
        }
        self.over_budget()
    }

    /// Look a chunk up.
    pub fn get_chunk(&mut self, version: u64, seq: u32) -> Get {
        let Some(s) = self.versions.get(&version) else {
            return if self.is_pruned(version) {
                Get::Gone(format!("version {version} is no longer retained"))
            } else {
                Get::NotYet
            };
        };
        match s.slots.get(seq as usize) {
            None => Get::NotYet,
            Some(Slot::Mem(b)) => Get::Ready(b.clone()),
            Some(Slot::Evicted) => Get::Gone(format!(
                "chunk {seq} of version {version} was evicted from the retention window (raise --retention-bytes or set --spill-dir)"
            )),
            Some(Slot::Spilled(r)) => {
                let r = *r;
                let sp = self.spill.as_mut().expect("spilled implies a spill");
                match sp.get(&r) {
                    Ok(d) if crate::checksum::crc32c(&d) == r.crc => Get::Ready(Bytes::from(d)),
                    Ok(_) => Get::Gone(format!("spilled chunk {seq} of version {version} failed its checksum on read")),
                    Err(e) => Get::Gone(format!("reading spilled chunk {seq} of version {version}: {e}")),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(n: usize, x: u8) -> Bytes {
        Bytes::from(vec![x; n])
    }

    #[test]
    fn spills_beyond_budget_and_reads_back() {
        let mut s = Store::new(
            StoreConfig {
                retention_bytes: 250,
                keep_versions: 2,
            },
            Some(Box::<MemSpill>::default()),
        );
        s.put_header(1, Bytes::from_static(b"h")).unwrap();
        for i in 0..10u32 {
            s.put_chunk(1, i, blob(100, i as u8)).unwrap();
            assert!(s.mem_bytes() <= 250);
        }
        assert_eq!(s.spilled_chunks, 8);
        for i in 0..10u32 {
            match s.get_chunk(1, i) {
                Get::Ready(b) => assert_eq!(b, blob(100, i as u8)),
                o => panic!("{o:?}"),
            }
        }
        assert!(matches!(s.get_chunk(1, 10), Get::NotYet));
    }

    #[test]
    fn evicts_without_spill_and_keeps_newest() {
        let mut s = Store::new(
            StoreConfig {
                retention_bytes: 10,
                keep_versions: 2,
            },
            None,
        );
        s.put_header(1, Bytes::new()).unwrap();
        s.put_chunk(1, 0, blob(100, 0)).unwrap();
        s.put_chunk(1, 1, blob(100, 1)).unwrap();
        s.put_chunk(1, 2, blob(100, 2)).unwrap();
        // Nothing is evicted at insertion; chunks still needed stay.
        assert!(s.evict(&|_, seq| seq >= 1));
        assert!(matches!(s.get_chunk(1, 0), Get::Gone(_)));
        assert!(matches!(s.get_chunk(1, 1), Get::Ready(_)));
        assert!(
            s.evict(&|_, _| false),
            "the newest chunk alone is over budget"
        );
        assert!(matches!(s.get_chunk(1, 1), Get::Gone(_)));
        assert!(matches!(s.get_chunk(1, 2), Get::Ready(_)));
    }

    #[test]
    fn versions_pruned_and_ordered() {
        let mut s = Store::new(
            StoreConfig {
                retention_bytes: 1000,
                keep_versions: 2,
            },
            None,
        );
        for v in 1..=3 {
            s.put_header(v, Bytes::new()).unwrap();
            s.put_chunk(v, 0, blob(1, 1)).unwrap();
            s.put_end(v, 1, Bytes::new()).unwrap();
        }
        assert_eq!(s.versions().collect::<Vec<_>>(), vec![2, 3]);
        assert!(matches!(s.get_chunk(1, 0), Get::Gone(_)));
        assert!(matches!(s.get_chunk(4, 0), Get::NotYet));
        assert!(s.put_header(3, Bytes::from_static(b"other")).is_err());
        assert!(s.put_header(3, Bytes::new()).is_ok(), "identical replay");
        assert!(s.put_header(1, Bytes::new()).is_err(), "older than held");
        assert_eq!(s.mem_bytes(), 2);
    }

    #[test]
    fn gaps_and_bad_counts_refused() {
        let mut s = Store::new(StoreConfig::default(), None);
        assert!(s.put_chunk(1, 0, blob(1, 0)).is_err());
        s.put_header(1, Bytes::new()).unwrap();
        assert!(s.put_chunk(1, 1, blob(1, 0)).is_err());
        s.put_chunk(1, 0, blob(1, 0)).unwrap();
        assert!(s.put_end(1, 2, Bytes::new()).is_err());
        s.put_end(1, 1, Bytes::new()).unwrap();
        assert!(s.put_chunk(1, 1, blob(1, 0)).is_err());
        // A publisher's replay of identical content is accepted and ignored.
        s.put_header(1, Bytes::new()).unwrap();
        s.put_chunk(1, 0, blob(1, 0)).unwrap();
        s.put_end(1, 1, Bytes::new()).unwrap();
        assert!(s.put_chunk(1, 0, blob(1, 9)).is_err());
        assert!(s.put_end(1, 1, Bytes::from_static(b"x")).is_err());
    }
}
