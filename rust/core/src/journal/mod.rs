//! The receiver's crash-safe journal.
//!
//! A receiver applies a delta to its target weights chunk by chunk, mostly by
//! XOR. Applying an XOR twice undoes it, so after a crash the receiver must
//! know, for every chunk, whether it was applied. This module keeps that
//! knowledge on disk: [`ReceiverJournal`] records the committed version and
//! the refit in flight, and [`ReceiverJournal::open`] recovers them.
//!
//! # Layers
//! - [`io`]: the [`JournalIo`] trait over the few file operations used, with
//!   the real [`StdIo`]; [`sim`] holds [`SimIo`](sim::SimIo), a simulated
//!   file system that fails chosen writes or syncs, fills up, and crashes.
//! - [`file`]: the file format: a header, then checksummed records appended
//!   in batches, each batch closed by a commit marker (see `docs/journal.md`).
//! - [`state`]: the records and the receiver's state machine (no I/O).
//! - [`receiver`]: [`ReceiverJournal`], the state machine made durable.
//!
//! # Protocol for applying a refit
//! 1. [`begin_refit`](ReceiverJournal::begin_refit) with the delta's plan.
//! 2. For each chunk (or batch of chunks):
//!    1. [`chunk_started`](ReceiverJournal::chunk_started) (or
//!       `chunks_started`); it returns after the record is synced. Only
//!       then may the chunk's bytes touch the target.
//!    2. Apply the chunk, then flush the target's bytes for it (fsync/msync
//!       a file, or synchronize the device stream so the write is complete).
//!    3. [`chunk_applied`](ReceiverJournal::chunk_applied) (or
//!       `chunks_applied`).
//! 3. Verify the target's digest, then [`commit`](ReceiverJournal::commit)
//!    (which compacts the journal), or [`abort`](ReceiverJournal::abort).
//!
//! After a crash, [`RecoveredState`] gives each chunk of the refit in flight
//! as [`ChunkState::NotStarted`] (apply it normally),
//! [`ChunkState::InProgress`] (fate unknown: repair it with an overwrite of
//! its new values, which is idempotent, never by XORing it again; then
//! record it applied) or [`ChunkState::Applied`] (skip it).
//!
//! Every call that writes returns only after its records are durable; a call
//! that fails leaves the durable state either as before the call or as after
//! it, never in between, and a reopen tells which.
//!
//! ```
//! use dcr_core::journal::{ChunkState, ReceiverJournal, RefitPlan};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let path = dir.path().join("receiver.dcrj");
//! let (mut j, recovered) = ReceiverJournal::open_std(&path)?;
//! assert!(recovered.state.committed.is_none());
//! j.commit_dense(41, [0x41; 16])?; // weights loaded densely
//! j.begin_refit(RefitPlan {
//!     version: 42,
//!     base_digest: [0x41; 16],
//!     target_digest: [0x42; 16],
//!     delta_id: [7; 16],
//!     n_chunks: 3,
//! })?;
//! j.chunks_started(&[0, 1])?;
//! // ... XOR chunks 0 and 1 into the target, flush, then:
//! j.chunk_applied(0)?;
//! drop(j); // crash
//!
//! let (mut j, recovered) = ReceiverJournal::open_std(&path)?;
//! let refit = recovered.state.refit.unwrap();
//! assert_eq!(refit.chunks, [ChunkState::Applied, ChunkState::InProgress, ChunkState::NotStarted]);
//! // Chunk 1: repair by overwrite, never XOR again. Chunk 2: apply normally.
//! j.chunk_applied(1)?;
//! j.chunk_started(2)?;
//! j.chunk_applied(2)?;
//! j.commit(42, [0x42; 16])?; // after verifying the target's digest
//! assert_eq!(j.state().committed.unwrap().version, 42);
//! # Ok::<(), dcr_core::Error>(())
//! ```

pub mod file;
pub mod io;
pub mod receiver;
pub mod sim;
pub mod state;

pub use file::{Journal, TornTail, MAX_RECORD_LEN};
pub use io::{JournalFile, JournalIo, StdIo};
pub use receiver::{ReceiverJournal, RecoveredState};
pub use state::{AbortedRefit, ChunkState, CommittedVersion, Digest, ReceiverState, Record, RefitPlan, RefitState};
