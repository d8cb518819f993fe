//! The receiver's journal: [`ReceiverState`] kept durable in a [`Journal`].

use std::path::Path;

use super::file::{Journal, TornTail};
use super::io::{JournalIo, StdIo};
use super::state::{clip_reason, hex, Digest, ReceiverState, Record, RefitPlan};
use crate::error::{Error, Result};

/// What [`ReceiverJournal::open`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveredState {
    /// The receiver's state as of the last committed record.
    pub state: ReceiverState,
    /// The uncommitted tail that was cut off, if any (informational: it
    /// held only records whose call never returned `Ok`).
    pub torn_tail: Option<TornTail>,
    /// Number of records replayed.
    pub records: usize,
}

/// The crash-safe journal of one receiver. See the [module
/// documentation](super) for the protocol.
#[derive(Debug)]
pub struct ReceiverJournal<I: JournalIo = StdIo> {
    journal: Journal<I>,
    state: ReceiverState,
}

impl ReceiverJournal<StdIo> {
    /// Opens (or creates) the journal at `path` on the real file system.
    pub fn open_std(path: impl AsRef<Path>) -> Result<(Self, RecoveredState)> {
        Self::open(path, StdIo)
    }
}

impl<I: JournalIo> ReceiverJournal<I> {
    /// Opens the journal at `path`, creating an empty one if there is none,
    /// and replays it. A torn tail is cut off (and the cut synced); a
    /// corrupt committed record is an error naming the byte offset.
    pub fn open(path: impl AsRef<Path>, io: I) -> Result<(Self, RecoveredState)> {
        let (journal, scan) = Journal::open(path, io)?;
        let mut state = ReceiverState::default();
        for raw in &scan.records {
            let corrupt = |detail: String| Error::JournalCorrupt {
                path: journal.path().to_path_buf(),
                offset: raw.offset,
                detail,
            };
            let rec = Record::decode(&raw.payload)
                .map_err(|d| corrupt(format!("the record there has a valid checksum but cannot be decoded: {d}")))?;
            state.apply(&rec).map_err(|d| {
                corrupt(format!("the record there ({rec}) does not follow from the records before it: {d}"))
            })?;
        }
        let recovered = RecoveredState { state: state.clone(), torn_tail: scan.torn, records: scan.records.len() };
        Ok((ReceiverJournal { journal, state }, recovered))
    }

    /// The current (durable) state.
    pub fn state(&self) -> &ReceiverState {
        &self.state
    }

    /// The underlying journal file.
    pub fn journal(&self) -> &Journal<I> {
        &self.journal
    }

    fn refuse(&self, op: &'static str, detail: String) -> Error {
        Error::JournalTransition { path: self.journal.path().to_path_buf(), op, detail }
    }

    /// Appends `recs` as one batch and applies them to the state; they were
    /// already checked.
    fn append(&mut self, recs: &[Record]) -> Result<()> {
        let payloads: Vec<Vec<u8>> = recs.iter().map(Record::encode).collect();
        self.journal.append_batch(&payloads)?;
        for r in recs {
            self.state.apply(r).expect("records are checked before they are written");
        }
        Ok(())
    }

    /// Appends one checked record, then compacts. `durable` describes the
    /// record for the error if only the compaction fails.
    fn append_and_compact(&mut self, op: &'static str, rec: Record, durable: String) -> Result<()> {
        self.state.check(&rec).map_err(|d| self.refuse(op, d))?;
        self.append(std::slice::from_ref(&rec))?;
        self.compact().map_err(|e| Error::JournalCompact {
            path: self.journal.path().to_path_buf(),
            durable,
            source: Box::new(e),
        })
    }

    /// Rewrites the journal to hold only the current state (temp file, sync,
    /// rename, directory sync). Done by every terminal transition; call it
    /// again after a [`Error::JournalCompact`].
    pub fn compact(&mut self) -> Result<()> {
        let payloads: Vec<Vec<u8>> = self.state.to_records().iter().map(Record::encode).collect();
        self.journal.rewrite(&payloads)
    }

    /// Records that the target holds `version` with checkpoint digest
    /// `digest` after a dense load (or after verifying the target's digest
    /// when recovering from an aborted refit). Ends any refit in flight.
    pub fn commit_dense(&mut self, version: u64, digest: Digest) -> Result<()> {
        let durable = format!("the dense commit of version {version}");
        self.append_and_compact("commit_dense", Record::Committed { version, digest }, durable)
    }

    /// Records the start of a refit. Durable when this returns; no chunk may
    /// touch the target before [`chunk_started`](Self::chunk_started).
    /// Refused unless `plan.base_digest` is the committed digest and
    /// `plan.version` is newer than the committed version.
    pub fn begin_refit(&mut self, plan: RefitPlan) -> Result<()> {
        let rec = Record::RefitBegin(plan);
        self.state.check(&rec).map_err(|d| self.refuse("begin_refit", d))?;
        self.append(&[rec])
    }

    /// Records that chunk `seq` is about to touch the target. Must return
    /// `Ok` before any of the chunk's bytes are written to the target.
    pub fn chunk_started(&mut self, seq: u32) -> Result<()> {
        self.chunks_started(&[seq])
    }

    /// [`chunk_started`](Self::chunk_started) for many chunks with one batch
    /// (two syncs in all). All-or-nothing after a crash.
    pub fn chunks_started(&mut self, seqs: &[u32]) -> Result<()> {
        let recs: Vec<Record> = seqs.iter().map(|&seq| Record::ChunkStarted { seq }).collect();
        for r in &recs {
            self.state.check(r).map_err(|d| self.refuse("chunk_started", d))?;
        }
        self.append(&recs)
    }

    /// Records that chunk `seq` is in the target. Call only after the
    /// target's bytes for the chunk were flushed (to disk, or to device
    /// memory that a crash of this process cannot lose) and after its
    /// `chunk_started` returned `Ok`.
    pub fn chunk_applied(&mut self, seq: u32) -> Result<()> {
        self.chunks_applied(&[seq])
    }

    /// [`chunk_applied`](Self::chunk_applied) for many chunks with one batch.
    pub fn chunks_applied(&mut self, seqs: &[u32]) -> Result<()> {
        let recs: Vec<Record> = seqs.iter().map(|&seq| Record::ChunkApplied { seq }).collect();
        let mut seen = std::collections::HashSet::with_capacity(seqs.len());
        for (r, &seq) in recs.iter().zip(seqs) {
            self.state.check(r).map_err(|d| self.refuse("chunk_applied", d))?;
            if !seen.insert(seq) {
                return Err(self.refuse("chunk_applied", format!("chunk {seq} appears twice in one batch")));
            }
        }
        self.append(&recs)
    }

    /// Commits the refit in flight once the target's digest `digest` was
    /// verified: every chunk must be recorded applied, and `version` and
    /// `digest` must be the plan's. The commit is durable when the
    /// `RefitCommitted` record is; the journal is then compacted down to a
    /// single `Committed` record. If only the compaction fails, the error is
    /// [`Error::JournalCompact`] and the commit stands.
    pub fn commit(&mut self, version: u64, digest: Digest) -> Result<()> {
        let durable = format!("the commit of version {version} (digest {})", hex(&digest));
        self.append_and_compact("commit", Record::RefitCommitted { version, digest }, durable)
    }

    /// Abandons the refit in flight. If any chunk was started, the target no
    /// longer holds the committed version: the next `begin_refit` is refused
    /// until [`commit_dense`](Self::commit_dense) records a verified or
    /// reloaded target. Compacts like `commit`.
    pub fn abort(&mut self, reason: &str) -> Result<()> {
        let Some(r) = &self.state.refit else {
            return Err(self.refuse("abort", "no refit is in flight, so there is nothing to abort".into()));
        };
        let version = r.plan.version;
        let rec = Record::RefitAborted { version, touched_chunks: r.touched(), reason: clip_reason(reason) };
        self.append_and_compact("abort", rec, format!("the abort of the refit to version {version}"))
    }
}
