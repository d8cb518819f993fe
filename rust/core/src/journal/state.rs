//! The receiver's state and the records that change it: a pure state
//! machine, free of I/O, that both the live journal and recovery drive.

use std::fmt;

/// A 16-byte checkpoint (or delta) digest.
pub type Digest = [u8; 16];

/// Largest chunk count of one refit (bounds the per-chunk state vector that
/// a `RefitBegin` record allocates).
pub const MAX_CHUNKS: u32 = 1 << 24;
/// Longest abort reason kept, in bytes; longer ones are cut at a character
/// boundary.
pub const MAX_REASON_LEN: usize = 4096;

/// Lowercase hex of a digest, for messages.
pub fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// The version the receiver's target holds, proven by its digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CommittedVersion {
    pub version: u64,
    pub digest: Digest,
}

/// What a refit will do: take the target from `base_digest` (the committed
/// version) to `version` with digest `target_digest` by applying the
/// `n_chunks` chunks of delta `delta_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RefitPlan {
    pub version: u64,
    pub base_digest: Digest,
    pub target_digest: Digest,
    pub delta_id: Digest,
    pub n_chunks: u32,
}

/// What is known about one chunk of the refit in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ChunkState {
    /// Its bytes have not touched the target.
    NotStarted,
    /// It may have been applied partly, fully or not at all: repair it with
    /// an overwrite (idempotent), never by XORing it again.
    InProgress,
    /// Its bytes are in the target and were flushed.
    Applied,
}

/// The refit in flight and the state of each of its chunks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefitState {
    pub plan: RefitPlan,
    /// Indexed by chunk sequence number; `len() == plan.n_chunks`.
    pub chunks: Vec<ChunkState>,
}

impl RefitState {
    fn new(plan: RefitPlan) -> Self {
        RefitState { plan, chunks: vec![ChunkState::NotStarted; plan.n_chunks as usize] }
    }

    fn seqs(&self, want: ChunkState) -> Vec<u32> {
        (0..self.chunks.len() as u32).filter(|&s| self.chunks[s as usize] == want).collect()
    }

    /// Chunks whose fate is unknown: repair each with an overwrite, then
    /// record it applied.
    pub fn needs_repair(&self) -> Vec<u32> {
        self.seqs(ChunkState::InProgress)
    }

    /// Chunks not yet started.
    pub fn not_started(&self) -> Vec<u32> {
        self.seqs(ChunkState::NotStarted)
    }

    /// Chunks applied.
    pub fn applied(&self) -> Vec<u32> {
        self.seqs(ChunkState::Applied)
    }

    /// Chunks that may have changed the target (in progress or applied).
    pub fn touched(&self) -> u32 {
        self.chunks.iter().filter(|&&c| c != ChunkState::NotStarted).count() as u32
    }

    /// Whether every chunk is applied.
    pub fn complete(&self) -> bool {
        self.chunks.iter().all(|&c| c == ChunkState::Applied)
    }
}

/// The last refit that was abandoned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbortedRefit {
    pub version: u64,
    /// Chunks that were in progress or applied when it was aborted. If not
    /// zero, the target no longer holds the committed version: verify its
    /// digest or do a dense refit, then record it with `commit_dense`.
    pub touched_chunks: u32,
    pub reason: String,
}

/// Everything the journal knows about the receiver.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReceiverState {
    /// The version the target holds; `None` until the first dense commit.
    pub committed: Option<CommittedVersion>,
    /// The refit in flight, if any.
    pub refit: Option<RefitState>,
    /// The last aborted refit since the last commit, if any.
    pub last_abort: Option<AbortedRefit>,
}

impl ReceiverState {
    /// Whether the target is known to hold exactly the committed version:
    /// no refit in flight has touched it and no aborted one did.
    pub fn target_is_committed(&self) -> bool {
        self.committed.is_some()
            && self.refit.as_ref().is_none_or(|r| r.touched() == 0)
            && self.last_abort.as_ref().is_none_or(|a| a.touched_chunks == 0)
    }
}

/// A journal record. The encoding is a tag byte and fixed little-endian
/// fields (see `docs/journal.md`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// The target holds `version` (a dense load, or the first record of a
    /// compacted journal). Ends any refit and clears the last abort.
    Committed { version: u64, digest: Digest },
    /// A refit starts; all chunks are `NotStarted`.
    RefitBegin(RefitPlan),
    /// Chunk `seq` may touch the target from now on.
    ChunkStarted { seq: u32 },
    /// Chunk `seq` is in the target and flushed.
    ChunkApplied { seq: u32 },
    /// The refit to `version` is abandoned. Standalone (no refit in flight)
    /// only in a compacted journal.
    RefitAborted { version: u64, touched_chunks: u32, reason: String },
    /// The refit in flight is committed: the target holds `version`.
    RefitCommitted { version: u64, digest: Digest },
}

const TAG_COMMITTED: u8 = 1;
const TAG_REFIT_BEGIN: u8 = 2;
const TAG_CHUNK_STARTED: u8 = 3;
const TAG_CHUNK_APPLIED: u8 = 4;
const TAG_REFIT_ABORTED: u8 = 5;
const TAG_REFIT_COMMITTED: u8 = 6;

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if self.0.len() < n {
            return Err(format!("needs {n} more bytes, {} left", self.0.len()));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn digest(&mut self) -> Result<Digest, String> {
        Ok(self.take(16)?.try_into().unwrap())
    }
}

impl Record {
    /// Compact binary encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64);
        match self {
            Record::Committed { version, digest } => {
                b.push(TAG_COMMITTED);
                b.extend_from_slice(&version.to_le_bytes());
                b.extend_from_slice(digest);
            }
            Record::RefitBegin(p) => {
                b.push(TAG_REFIT_BEGIN);
                b.extend_from_slice(&p.version.to_le_bytes());
                b.extend_from_slice(&p.base_digest);
                b.extend_from_slice(&p.target_digest);
                b.extend_from_slice(&p.delta_id);
                b.extend_from_slice(&p.n_chunks.to_le_bytes());
            }
            Record::ChunkStarted { seq } => {
                b.push(TAG_CHUNK_STARTED);
                b.extend_from_slice(&seq.to_le_bytes());
            }
            Record::ChunkApplied { seq } => {
                b.push(TAG_CHUNK_APPLIED);
                b.extend_from_slice(&seq.to_le_bytes());
            }
            Record::RefitAborted { version, touched_chunks, reason } => {
                b.push(TAG_REFIT_ABORTED);
                b.extend_from_slice(&version.to_le_bytes());
                b.extend_from_slice(&touched_chunks.to_le_bytes());
                b.extend_from_slice(reason.as_bytes());
            }
            Record::RefitCommitted { version, digest } => {
                b.push(TAG_REFIT_COMMITTED);
                b.extend_from_slice(&version.to_le_bytes());
                b.extend_from_slice(digest);
            }
        }
        b
    }

    /// Decodes a payload; the error says what is wrong with it.
    pub fn decode(payload: &[u8]) -> Result<Record, String> {
        let Some((&tag, rest)) = payload.split_first() else {
            return Err("the record payload is empty, expected a tag byte".into());
        };
        let mut r = Reader(rest);
        let rec = match tag {
            TAG_COMMITTED => Record::Committed { version: r.u64()?, digest: r.digest()? },
            TAG_REFIT_BEGIN => Record::RefitBegin(RefitPlan {
                version: r.u64()?,
                base_digest: r.digest()?,
                target_digest: r.digest()?,
                delta_id: r.digest()?,
                n_chunks: r.u32()?,
            }),
            TAG_CHUNK_STARTED => Record::ChunkStarted { seq: r.u32()? },
            TAG_CHUNK_APPLIED => Record::ChunkApplied { seq: r.u32()? },
            TAG_REFIT_ABORTED => {
                let version = r.u64()?;
                let touched_chunks = r.u32()?;
                let reason = std::str::from_utf8(r.take(r.0.len())?)
                    .map_err(|e| format!("abort reason is not UTF-8: {e}"))?
                    .to_owned();
                Record::RefitAborted { version, touched_chunks, reason }
            }
            TAG_REFIT_COMMITTED => Record::RefitCommitted { version: r.u64()?, digest: r.digest()? },
            t => return Err(format!("unknown record tag {t}, expected 1..=6 (written by a newer dcr?)")),
        };
        if !r.0.is_empty() {
            return Err(format!("{} trailing bytes after a record with tag {tag}", r.0.len()));
        }
        Ok(rec)
    }
}

impl fmt::Display for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Record::Committed { version, digest } => write!(f, "Committed(v{version}, {})", hex(digest)),
            Record::RefitBegin(p) => write!(f, "RefitBegin(v{}, {} chunks)", p.version, p.n_chunks),
            Record::ChunkStarted { seq } => write!(f, "ChunkStarted({seq})"),
            Record::ChunkApplied { seq } => write!(f, "ChunkApplied({seq})"),
            Record::RefitAborted { version, .. } => write!(f, "RefitAborted(v{version})"),
            Record::RefitCommitted { version, digest } => write!(f, "RefitCommitted(v{version}, {})", hex(digest)),
        }
    }
}

/// Cuts `reason` to at most [`MAX_REASON_LEN`] bytes at a character boundary.
pub fn clip_reason(reason: &str) -> String {
    let mut end = reason.len().min(MAX_REASON_LEN);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason[..end].to_owned()
}

fn refit_label(r: &RefitState) -> String {
    format!("refit to version {} (delta {})", r.plan.version, hex(&r.plan.delta_id))
}

impl ReceiverState {
    fn in_flight(&self, what: &str) -> Result<&RefitState, String> {
        self.refit
            .as_ref()
            .ok_or_else(|| format!("no refit is in flight, so there is nothing to {what}: call begin_refit first"))
    }

    fn chunk(&self, seq: u32, what: &str) -> Result<ChunkState, String> {
        let r = self.in_flight(what)?;
        r.chunks.get(seq as usize).copied().ok_or_else(|| {
            format!("chunk {seq} does not exist: the {} has chunks 0..{}", refit_label(r), r.plan.n_chunks)
        })
    }

    /// Checks that `rec` may follow the current state, without changing it.
    /// The error says what is wrong and what to do.
    pub fn check(&self, rec: &Record) -> Result<(), String> {
        match rec {
            Record::Committed { .. } => Ok(()),
            Record::RefitBegin(p) => {
                if let Some(r) = &self.refit {
                    return Err(format!("the {} is still in flight: commit or abort it first", refit_label(r)));
                }
                let Some(c) = &self.committed else {
                    return Err("no version is committed yet: load the weights densely and call commit_dense first".into());
                };
                if p.base_digest != c.digest {
                    return Err(format!(
                        "the delta needs base digest {}, but the receiver holds version {} (digest {}): apply the deltas in order from version {}, or do a dense refit",
                        hex(&p.base_digest), c.version, hex(&c.digest), c.version
                    ));
                }
                if p.version <= c.version {
                    return Err(format!(
                        "the refit targets version {}, but version {} is already committed: a refit must move to a newer version",
                        p.version, c.version
                    ));
                }
                if let Some(a) = &self.last_abort {
                    if a.touched_chunks > 0 {
                        return Err(format!(
                            "the aborted refit to version {} touched {} chunk(s), so the target no longer holds version {}: verify its digest or reload it densely, then call commit_dense",
                            a.version, a.touched_chunks, c.version
                        ));
                    }
                }
                if p.n_chunks > MAX_CHUNKS {
                    return Err(format!("the refit has {} chunks, but the limit is {MAX_CHUNKS}: split the delta", p.n_chunks));
                }
                Ok(())
            }
            Record::ChunkStarted { seq } => match self.chunk(*seq, "start a chunk of")? {
                ChunkState::Applied => Err(format!(
                    "chunk {seq} is already applied: applying its XOR again would undo it; skip it"
                )),
                _ => Ok(()),
            },
            Record::ChunkApplied { seq } => match self.chunk(*seq, "apply a chunk of")? {
                ChunkState::InProgress => Ok(()),
                ChunkState::NotStarted => Err(format!(
                    "chunk {seq} was never recorded as started: record chunk_started (durably) before its bytes touch the target"
                )),
                ChunkState::Applied => Err(format!("chunk {seq} is already recorded as applied")),
            },
            Record::RefitAborted { version, touched_chunks, .. } => match &self.refit {
                Some(r) if r.plan.version != *version => Err(format!(
                    "the abort names version {version}, but the {} is in flight",
                    refit_label(r)
                )),
                Some(r) if r.touched() != *touched_chunks => Err(format!(
                    "the abort says {touched_chunks} chunk(s) were touched, but the journal has {}",
                    r.touched()
                )),
                // Standalone: the compacted form of an abort.
                _ => Ok(()),
            },
            Record::RefitCommitted { version, digest } => {
                let r = self.in_flight("commit")?;
                if r.plan.version != *version {
                    return Err(format!("the {} is in flight, not one to version {version}", refit_label(r)));
                }
                if r.plan.target_digest != *digest {
                    return Err(format!(
                        "the target's digest is {}, but the refit to version {version} must produce {}: do not commit; repair the chunks or abort and do a dense refit",
                        hex(digest), hex(&r.plan.target_digest)
                    ));
                }
                if !r.complete() {
                    let missing: Vec<u32> = (0..r.plan.n_chunks).filter(|&s| r.chunks[s as usize] != ChunkState::Applied).collect();
                    let first: Vec<String> = missing.iter().take(5).map(u32::to_string).collect();
                    return Err(format!(
                        "{} of {} chunks are not recorded as applied (first: {}): apply them (repair those in progress by overwrite) before committing",
                        missing.len(), r.plan.n_chunks, first.join(", ")
                    ));
                }
                Ok(())
            }
        }
    }

    /// Applies `rec` after [`check`](Self::check)ing it; on error the state
    /// is unchanged.
    pub fn apply(&mut self, rec: &Record) -> Result<(), String> {
        self.check(rec)?;
        match rec {
            Record::Committed { version, digest } => {
                self.committed = Some(CommittedVersion { version: *version, digest: *digest });
                self.refit = None;
                self.last_abort = None;
            }
            Record::RefitBegin(p) => {
                self.refit = Some(RefitState::new(*p));
                self.last_abort = None;
            }
            Record::ChunkStarted { seq } => {
                self.refit.as_mut().expect("checked").chunks[*seq as usize] = ChunkState::InProgress;
            }
            Record::ChunkApplied { seq } => {
                self.refit.as_mut().expect("checked").chunks[*seq as usize] = ChunkState::Applied;
            }
            Record::RefitAborted { version, touched_chunks, reason } => {
                self.refit = None;
                self.last_abort =
                    Some(AbortedRefit { version: *version, touched_chunks: *touched_chunks, reason: reason.clone() });
            }
            Record::RefitCommitted { version, digest } => {
                self.committed = Some(CommittedVersion { version: *version, digest: *digest });
                self.refit = None;
                self.last_abort = None;
            }
        }
        Ok(())
    }

    /// The shortest record list that rebuilds this state from nothing: what
    /// compaction writes.
    pub fn to_records(&self) -> Vec<Record> {
        let mut out = Vec::new();
        if let Some(c) = &self.committed {
            out.push(Record::Committed { version: c.version, digest: c.digest });
        }
        if let Some(a) = &self.last_abort {
            out.push(Record::RefitAborted {
                version: a.version,
                touched_chunks: a.touched_chunks,
                reason: a.reason.clone(),
            });
        }
        if let Some(r) = &self.refit {
            out.push(Record::RefitBegin(r.plan));
            for (seq, &c) in r.chunks.iter().enumerate() {
                let seq = seq as u32;
                if c != ChunkState::NotStarted {
                    out.push(Record::ChunkStarted { seq });
                }
                if c == ChunkState::Applied {
                    out.push(Record::ChunkApplied { seq });
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(version: u64, base: u8, n: u32) -> RefitPlan {
        RefitPlan {
            version,
            base_digest: [base; 16],
            target_digest: [version as u8; 16],
            delta_id: [0xd; 16],
            n_chunks: n,
        }
    }

    fn all_records() -> Vec<Record> {
        vec![
            Record::Committed { version: 7, digest: [1; 16] },
            Record::RefitBegin(plan(8, 1, 3)),
            Record::ChunkStarted { seq: 2 },
            Record::ChunkApplied { seq: u32::MAX },
            Record::RefitAborted { version: 8, touched_chunks: 1, reason: "délta refused".into() },
            Record::RefitAborted { version: 8, touched_chunks: 0, reason: String::new() },
            Record::RefitCommitted { version: u64::MAX, digest: [0xff; 16] },
        ]
    }

    #[test]
    fn records_roundtrip_and_reject_garbage() {
        for r in all_records() {
            let b = r.encode();
            assert_eq!(Record::decode(&b).unwrap(), r);
            // Every strict prefix fails (the abort reason may be cut short,
            // but not its fixed fields).
            let fixed = if matches!(r, Record::RefitAborted { .. }) { 13 } else { b.len() };
            for cut in 0..fixed {
                assert!(Record::decode(&b[..cut]).is_err(), "{r} cut at {cut}");
            }
            let mut long = b.clone();
            long.push(0);
            if !matches!(r, Record::RefitAborted { .. }) {
                assert!(Record::decode(&long).unwrap_err().contains("trailing"));
            }
        }
        assert!(Record::decode(&[99, 0]).unwrap_err().contains("unknown record tag 99"));
        assert!(Record::decode(&[TAG_REFIT_ABORTED, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff]).is_err());
        assert_eq!(Record::ChunkStarted { seq: 1 }.encode().len(), 5);
    }

    #[test]
    fn refit_lifecycle() {
        let mut s = ReceiverState::default();
        assert!(s.apply(&Record::RefitBegin(plan(2, 1, 2))).unwrap_err().contains("commit_dense"));
        s.apply(&Record::Committed { version: 1, digest: [1; 16] }).unwrap();
        assert!(s.target_is_committed());
        assert!(s.check(&Record::RefitBegin(plan(2, 9, 2))).unwrap_err().contains("base digest"));
        assert!(s.check(&Record::RefitBegin(plan(1, 1, 2))).unwrap_err().contains("newer"));
        assert!(s.check(&Record::RefitBegin(plan(2, 1, MAX_CHUNKS + 1))).is_err());
        s.apply(&Record::RefitBegin(plan(2, 1, 2))).unwrap();
        assert!(s.check(&Record::RefitBegin(plan(3, 1, 2))).unwrap_err().contains("still in flight"));
        assert!(s.check(&Record::ChunkApplied { seq: 0 }).unwrap_err().contains("never recorded as started"));
        assert!(s.check(&Record::ChunkStarted { seq: 2 }).unwrap_err().contains("does not exist"));
        s.apply(&Record::ChunkStarted { seq: 0 }).unwrap();
        assert!(!s.target_is_committed());
        s.apply(&Record::ChunkStarted { seq: 0 }).unwrap(); // restart for a repair
        s.apply(&Record::ChunkApplied { seq: 0 }).unwrap();
        assert!(s.check(&Record::ChunkStarted { seq: 0 }).unwrap_err().contains("undo"));
        assert!(s.check(&Record::ChunkApplied { seq: 0 }).is_err());
        let err = s.check(&Record::RefitCommitted { version: 2, digest: [2; 16] }).unwrap_err();
        assert!(err.contains("1 of 2 chunks") && err.contains("first: 1"), "{err}");
        s.apply(&Record::ChunkStarted { seq: 1 }).unwrap();
        assert_eq!(s.refit.as_ref().unwrap().needs_repair(), vec![1]);
        s.apply(&Record::ChunkApplied { seq: 1 }).unwrap();
        assert!(s.check(&Record::RefitCommitted { version: 2, digest: [3; 16] }).unwrap_err().contains("must produce"));
        assert!(s.check(&Record::RefitCommitted { version: 3, digest: [2; 16] }).is_err());
        s.apply(&Record::RefitCommitted { version: 2, digest: [2; 16] }).unwrap();
        assert_eq!(s.committed, Some(CommittedVersion { version: 2, digest: [2; 16] }));
        assert!(s.refit.is_none() && s.target_is_committed());
    }

    #[test]
    fn a_touching_abort_blocks_the_next_refit_until_a_dense_commit() {
        let mut s = ReceiverState::default();
        s.apply(&Record::Committed { version: 1, digest: [1; 16] }).unwrap();
        s.apply(&Record::RefitBegin(plan(2, 1, 2))).unwrap();
        s.apply(&Record::ChunkStarted { seq: 1 }).unwrap();
        assert!(s.check(&Record::RefitAborted { version: 2, touched_chunks: 0, reason: String::new() }).is_err());
        s.apply(&Record::RefitAborted { version: 2, touched_chunks: 1, reason: "x".into() }).unwrap();
        assert!(!s.target_is_committed());
        assert!(s.check(&Record::RefitBegin(plan(2, 1, 2))).unwrap_err().contains("touched 1 chunk"));
        s.apply(&Record::Committed { version: 1, digest: [1; 16] }).unwrap();
        s.apply(&Record::RefitBegin(plan(2, 1, 2))).unwrap();
    }

    #[test]
    fn to_records_rebuilds_the_state() {
        let mut s = ReceiverState::default();
        let replay = |s: &ReceiverState| {
            let mut t = ReceiverState::default();
            for r in s.to_records() {
                t.apply(&r).unwrap();
            }
            assert_eq!(&t, s);
        };
        replay(&s);
        s.apply(&Record::Committed { version: 1, digest: [1; 16] }).unwrap();
        s.apply(&Record::RefitBegin(plan(2, 1, 4))).unwrap();
        s.apply(&Record::RefitAborted { version: 2, touched_chunks: 0, reason: "no".into() }).unwrap();
        replay(&s);
        s.apply(&Record::RefitBegin(plan(3, 1, 4))).unwrap();
        for r in [Record::ChunkStarted { seq: 1 }, Record::ChunkStarted { seq: 3 }, Record::ChunkApplied { seq: 3 }] {
            s.apply(&r).unwrap();
        }
        replay(&s);
        s.apply(&Record::RefitAborted { version: 3, touched_chunks: 2, reason: "gpu fault".into() }).unwrap();
        replay(&s);
    }

    #[test]
    fn clip_reason_respects_char_boundaries() {
        let long = "é".repeat(MAX_REASON_LEN);
        let c = clip_reason(&long);
        assert!(c.len() <= MAX_REASON_LEN && c.len() >= MAX_REASON_LEN - 1);
        assert_eq!(clip_reason("short"), "short");
    }
}
