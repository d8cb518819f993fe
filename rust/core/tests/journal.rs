//! Crash-safety tests of the receiver journal: every write, every sync and
//! every file operation failed in turn; torn tails; corruption; a full disk;
//! random crash points.

use std::path::PathBuf;

use dcr_core::error::Error;
use dcr_core::journal::sim::{Crash, SimIo};
use dcr_core::journal::{ChunkState, Digest, JournalIo, ReceiverJournal, ReceiverState, RefitPlan, StdIo};
use proptest::prelude::*;

fn d(x: u8) -> Digest {
    [x; 16]
}

fn jpath() -> PathBuf {
    PathBuf::from("/data/receiver.dcrj")
}

fn plan(version: u64, base: u8, target: u8, n_chunks: u32) -> RefitPlan {
    RefitPlan {
        version,
        base_digest: d(base),
        target_digest: d(target),
        delta_id: [version as u8 ^ 0x5a; 16],
        n_chunks,
    }
}

#[derive(Debug, Clone)]
enum Op {
    Open,
    Dense(u64, u8),
    Begin(RefitPlan),
    Started(Vec<u32>),
    Applied(Vec<u32>),
    Commit(u64, u8),
    Abort(&'static str),
    Compact,
}

fn apply<I: JournalIo>(j: &mut ReceiverJournal<I>, op: &Op) -> dcr_core::Result<()> {
    match op {
        Op::Open => unreachable!("handled by the driver"),
        Op::Dense(v, x) => j.commit_dense(*v, d(*x)),
        Op::Begin(p) => j.begin_refit(*p),
        Op::Started(s) if s.len() == 1 => j.chunk_started(s[0]),
        Op::Started(s) => j.chunks_started(s),
        Op::Applied(s) if s.len() == 1 => j.chunk_applied(s[0]),
        Op::Applied(s) => j.chunks_applied(s),
        Op::Commit(v, x) => j.commit(*v, d(*x)),
        Op::Abort(r) => j.abort(r),
        Op::Compact => j.compact(),
    }
}

/// Two refits, an abort that touched the target, a dense recovery and a
/// third refit, with single and batched chunk records.
fn scenario() -> Vec<Op> {
    vec![
        Op::Open,
        Op::Dense(1, 1),
        Op::Begin(plan(2, 1, 2, 4)),
        Op::Started(vec![0, 1]),
        Op::Applied(vec![0]),
        Op::Started(vec![2]),
        Op::Applied(vec![1, 2]),
        Op::Started(vec![3]),
        Op::Applied(vec![3]),
        Op::Commit(2, 2),
        Op::Begin(plan(3, 2, 3, 2)),
        Op::Started(vec![0]),
        Op::Abort("target digest mismatch"),
        Op::Dense(2, 2),
        Op::Begin(plan(4, 2, 4, 1)),
        Op::Compact,
        Op::Started(vec![0]),
        Op::Applied(vec![0]),
        Op::Commit(4, 4),
    ]
}

/// Runs `ops` from the start on `io`; returns the journal (if open worked)
/// and the index of the first op that failed.
fn run(io: &SimIo, ops: &[Op]) -> (Option<ReceiverJournal<SimIo>>, Option<usize>) {
    let mut j = match ReceiverJournal::open(jpath(), io.clone()) {
        Ok((j, _)) => j,
        Err(_) => return (None, Some(0)),
    };
    for (i, op) in ops.iter().enumerate().skip(1) {
        if apply(&mut j, op).is_err() {
            return (Some(j), Some(i));
        }
    }
    (Some(j), None)
}

/// The state after each prefix: `states[0]` is before anything, and
/// `states[i + 1]` is after op `i`. Also checks on the way that every
/// acknowledged op survives a crash that drops everything unsynced.
fn expected_states(ops: &[Op]) -> Vec<ReceiverState> {
    let io = SimIo::new();
    let (mut j, _) = ReceiverJournal::open(jpath(), io.clone()).unwrap();
    let mut states = vec![ReceiverState::default(), j.state().clone()];
    for op in &ops[1..] {
        apply(&mut j, op).unwrap_or_else(|e| panic!("{op:?}: {e}"));
        states.push(j.state().clone());
        let (_, rec) = ReceiverJournal::open(jpath(), io.crashed_copy(Crash::DropUnsynced)).unwrap();
        assert_eq!(&rec.state, j.state(), "acknowledged {op:?} was lost in a crash");
    }
    states
}

/// After op `failed` failed and the machine possibly crashed, the journal
/// must reopen to the state before or after that op, and the rest of the
/// ops must then go through.
fn check_recovery(io: SimIo, ops: &[Op], states: &[ReceiverState], failed: usize, label: &str) {
    let (mut j, rec) = ReceiverJournal::open(jpath(), io.clone())
        .unwrap_or_else(|e| panic!("{label}: reopen after a failure of op {failed} ({:?}) failed: {e}", ops[failed]));
    let next = if rec.state == states[failed] {
        failed
    } else if rec.state == states[failed + 1] {
        failed + 1
    } else {
        panic!(
            "{label}: after a failure of op {failed} ({:?}) the journal recovered\n{:#?}\nwhich is neither the old state\n{:#?}\nnor the new\n{:#?}",
            ops[failed], rec.state, states[failed], states[failed + 1]
        );
    };
    for op in &ops[next.max(1)..] {
        apply(&mut j, op).unwrap_or_else(|e| panic!("{label}: after recovery, {op:?} failed: {e}"));
    }
    assert_eq!(j.state(), states.last().unwrap(), "{label}: final state");
    assert_eq!(io.paths(), vec![jpath()], "{label}: stray files");
}

/// Injects one fault per run, for every `n` until a run no longer hits it,
/// and checks recovery with and without several kinds of crash.
fn fail_each(kind: &str, inject: impl Fn(&SimIo, u64)) -> u64 {
    let ops = scenario();
    let states = expected_states(&ops);
    let mut n = 0;
    loop {
        let io = SimIo::new();
        inject(&io, n);
        let (j, failed) = run(&io, &ops);
        drop(j);
        let Some(failed) = failed else {
            // The fault is past the end of the scenario: no op failed.
            assert!(n > 0, "{kind}: the scenario issued none");
            return n;
        };
        let pending = io.pending_ops();
        let label = format!("{kind} #{n}");
        let mut crashes =
            vec![("no crash", Crash::KeepPending { ops: usize::MAX, torn_bytes: 0 }), ("crash", Crash::DropUnsynced)];
        for ops in 0..pending {
            crashes.push(("crash keeping a prefix", Crash::KeepPending { ops, torn_bytes: 7 }));
            // Out of order: everything but op `ops`, or only op `ops`.
            crashes.push(("crash reordering", Crash::Reorder { mask: !(1 << ops), torn_op: ops, torn_bytes: 9 }));
            crashes.push(("crash reordering", Crash::Reorder { mask: 1 << ops, torn_op: usize::MAX, torn_bytes: 0 }));
        }
        crashes.push(("crash reordering", Crash::Reorder { mask: 0x5555_5555_5555_5555, torn_op: 0, torn_bytes: 5 }));
        crashes.push(("crash reordering", Crash::Reorder { mask: 0xaaaa_aaaa_aaaa_aaaa, torn_op: 1, torn_bytes: 5 }));
        for (what, mode) in crashes {
            check_recovery(io.crashed_copy(mode), &ops, &states, failed, &format!("{label}, {what} {mode:?}"));
        }
        n += 1;
    }
}

#[test]
fn every_write_failed_in_turn_recovers_old_or_new() {
    let n = fail_each("write", |io, n| io.fail_write(n));
    assert!(n >= 30, "only {n} writes");
}

#[test]
fn every_sync_failed_in_turn_recovers_old_or_new() {
    let n = fail_each("sync", |io, n| io.fail_sync(n));
    assert!(n >= 30, "only {n} syncs");
}

#[test]
fn every_operation_failed_in_turn_recovers_old_or_new() {
    let n = fail_each("operation", |io, n| io.fail_op(n));
    assert!(n >= 100, "only {n} operations");
}

#[test]
fn a_power_cut_before_every_operation_recovers_old_or_new() {
    fail_each("power cut", |io, n| io.power_cut_at_op(n));
}

#[test]
fn recovered_refit_reports_each_chunks_state() {
    let io = SimIo::new();
    let (mut j, rec) = ReceiverJournal::open(jpath(), io.clone()).unwrap();
    assert_eq!(rec.state, ReceiverState::default());
    j.commit_dense(10, d(10)).unwrap();
    j.begin_refit(plan(11, 10, 11, 5)).unwrap();
    j.chunks_started(&[0, 1, 2]).unwrap();
    j.chunks_applied(&[0, 2]).unwrap();
    drop(j);
    io.crash(Crash::DropUnsynced);
    let (mut j, rec) = ReceiverJournal::open(jpath(), io.clone()).unwrap();
    let committed = rec.state.committed.unwrap();
    assert_eq!((committed.version, committed.digest), (10, d(10)));
    let refit = rec.state.refit.as_ref().unwrap();
    assert_eq!(refit.plan, plan(11, 10, 11, 5));
    use ChunkState::*;
    assert_eq!(refit.chunks, vec![Applied, InProgress, Applied, NotStarted, NotStarted]);
    assert_eq!(refit.needs_repair(), vec![1]);
    assert_eq!(refit.not_started(), vec![3, 4]);
    assert!(!rec.state.target_is_committed());
    // Applying an applied chunk again is refused: its XOR would undo it.
    let e = j.chunk_started(0).unwrap_err();
    assert!(matches!(e, Error::JournalTransition { .. }) && e.to_string().contains("undo"), "{e}");
    // Committing early is refused and names the missing chunks.
    let e = j.commit(11, d(11)).unwrap_err().to_string();
    assert!(e.contains("3 of 5 chunks") && e.contains("first: 1, 3, 4"), "{e}");
    // Repair chunk 1 by overwrite, apply the rest, commit.
    j.chunk_applied(1).unwrap();
    j.chunks_started(&[3, 4]).unwrap();
    j.chunks_applied(&[4, 3]).unwrap();
    let e = j.commit(11, d(99)).unwrap_err().to_string();
    assert!(e.contains("must produce") && e.contains(&"0b".repeat(16)), "{e}");
    j.commit(11, d(11)).unwrap();
    drop(j);
    // The commit compacted the journal down to one record.
    let (j, rec) = ReceiverJournal::open(jpath(), io.crashed_copy(Crash::DropUnsynced)).unwrap();
    assert_eq!(rec.records, 1);
    assert_eq!(j.journal().committed_len(), 16 + 12 + 25);
    assert!(rec.state.refit.is_none() && rec.state.target_is_committed());
    assert_eq!(rec.state.committed.unwrap().version, 11);
}

#[test]
fn a_refused_transition_writes_nothing() {
    let io = SimIo::new();
    let (mut j, _) = ReceiverJournal::open(jpath(), io.clone()).unwrap();
    let refused = |j: &mut ReceiverJournal<SimIo>, op: Op, needle: &str| {
        let before = io.counts();
        let e = apply(j, &op).unwrap_err();
        assert!(matches!(e, Error::JournalTransition { .. }), "{op:?}: {e:?}");
        assert!(e.to_string().contains(needle), "{op:?}: {e}");
        assert_eq!(io.counts(), before, "{op:?} touched the file");
    };
    refused(&mut j, Op::Begin(plan(2, 1, 2, 1)), "commit_dense");
    refused(&mut j, Op::Abort("x"), "nothing to abort");
    refused(&mut j, Op::Started(vec![0]), "begin_refit");
    j.commit_dense(1, d(1)).unwrap();
    refused(&mut j, Op::Begin(plan(2, 7, 2, 1)), &"07".repeat(16));
    refused(&mut j, Op::Begin(plan(1, 1, 2, 1)), "newer version");
    j.begin_refit(plan(2, 1, 2, 3)).unwrap();
    // A batch with one bad member is refused whole.
    refused(&mut j, Op::Started(vec![0, 1, 3]), "chunk 3 does not exist");
    j.chunk_started(0).unwrap();
    refused(&mut j, Op::Applied(vec![0, 0]), "twice");
    refused(&mut j, Op::Applied(vec![0, 1]), "never recorded as started");
    refused(&mut j, Op::Commit(2, 2), "not recorded as applied");
    assert_eq!(
        j.state().refit.as_ref().unwrap().chunks,
        vec![ChunkState::InProgress, ChunkState::NotStarted, ChunkState::NotStarted]
    );
}

#[test]
fn a_torn_tail_is_truncated_and_appending_goes_on_std_io() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.dcrj");
    let (mut j, rec) = ReceiverJournal::open_std(&path).unwrap();
    assert!(rec.torn_tail.is_none());
    j.commit_dense(1, d(1)).unwrap();
    j.begin_refit(plan(2, 1, 2, 8)).unwrap();
    j.chunk_started(0).unwrap();
    let old_state = j.state().clone();
    let old = std::fs::read(&path).unwrap();
    j.chunks_started(&[1, 2, 3]).unwrap();
    let new_state = j.state().clone();
    let new = std::fs::read(&path).unwrap();
    drop(j);
    assert!(new.len() > old.len() && new.starts_with(&old));
    // Every cut inside the last batch is a torn tail, and so is a batch
    // whose commit marker is zeros.
    let mut zeroed = new.clone();
    let n = zeroed.len();
    zeroed[n - 4..].fill(0);
    let tails: Vec<Vec<u8>> = (old.len() + 1..new.len()).map(|cut| new[..cut].to_vec()).chain([zeroed]).collect();
    for tail in tails {
        std::fs::write(&path, &tail).unwrap();
        let (mut j, rec) = ReceiverJournal::open_std(&path).unwrap();
        assert_eq!(rec.state, old_state, "tail of {} bytes", tail.len());
        let torn = rec.torn_tail.expect("a torn tail");
        assert_eq!((torn.offset, torn.len), (old.len() as u64, (tail.len() - old.len()) as u64));
        assert_eq!(std::fs::read(&path).unwrap(), old, "the tail was cut off");
        // And the journal goes on.
        j.chunks_started(&[1, 2, 3]).unwrap();
        drop(j);
        let (_, rec) = ReceiverJournal::open_std(&path).unwrap();
        assert_eq!(rec.state, new_state);
        assert!(rec.torn_tail.is_none());
        assert_eq!(std::fs::read(&path).unwrap(), new);
    }
}

#[test]
fn a_corrupt_committed_record_is_a_hard_error_with_its_offset() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.dcrj");
    let (mut j, _) = ReceiverJournal::open_std(&path).unwrap();
    j.commit_dense(1, d(1)).unwrap();
    j.begin_refit(plan(2, 1, 2, 8)).unwrap();
    let rec_offset = std::fs::metadata(&path).unwrap().len();
    j.chunks_started(&[5, 6]).unwrap();
    j.chunk_applied(5).unwrap();
    drop(j);
    let good = std::fs::read(&path).unwrap();
    // Flip a payload byte of the first ChunkStarted record (a CONT record
    // in a committed batch): the tag byte is at rec_offset + 4.
    for (at, what) in [(rec_offset as usize + 5, "payload"), (rec_offset as usize + 4 + 5 + 1, "crc")] {
        let mut bad = good.clone();
        bad[at] ^= 0x10;
        std::fs::write(&path, &bad).unwrap();
        let e = ReceiverJournal::open_std(&path).unwrap_err();
        match &e {
            Error::JournalCorrupt { path: p, offset, .. } => {
                assert_eq!(p, &path);
                assert_eq!(*offset, rec_offset, "{what}");
            }
            other => panic!("{what}: expected JournalCorrupt, got {other:?}"),
        }
        let m = e.to_string();
        assert!(m.contains(&path.display().to_string()) && m.contains(&format!("offset {rec_offset}")), "{m}");
        assert!(m.contains("crc32c") && m.contains("move it aside") && m.contains("dense refit"), "{m}");
        // Nothing was truncated: the evidence stays.
        assert_eq!(std::fs::read(&path).unwrap(), bad);
    }
    // A record with a valid checksum that does not follow from the ones
    // before it (a ChunkApplied for a chunk never started) is an error too.
    let (mut j, _) = {
        std::fs::write(&path, &good).unwrap();
        ReceiverJournal::open_std(&path).unwrap()
    };
    j.commit_dense(1, d(1)).unwrap();
    drop(j);
    let mut raw = dcr_core::journal::Journal::open(&path, StdIo).unwrap().0;
    raw.append(&dcr_core::journal::Record::ChunkApplied { seq: 3 }.encode()).unwrap();
    drop(raw);
    let e = ReceiverJournal::open_std(&path).unwrap_err().to_string();
    assert!(e.contains("offset 53") && e.contains("ChunkApplied(3)") && e.contains("no refit is in flight"), "{e}");
}

#[test]
fn a_wrong_version_or_foreign_file_is_refused() {
    let io = SimIo::new();
    let (j, _) = ReceiverJournal::open(jpath(), io.clone()).unwrap();
    drop(j);
    let good = io.file_bytes(&jpath()).unwrap();
    // Version 1 (written with the digests of delta format 8 and earlier)
    // and a future version.
    for version in [1u8, 7] {
        let mut b = good.clone();
        b[8] = version;
        io.put_file_bytes(&jpath(), &b);
        let e = ReceiverJournal::open(jpath(), io.clone()).unwrap_err();
        assert!(matches!(e, Error::JournalVersion { found, supported: 2, .. } if found == u16::from(version)), "{e}");
    }
    io.put_file_bytes(&jpath(), b"{\"not\": \"a journal\"}");
    let e = ReceiverJournal::open(jpath(), io.clone()).unwrap_err().to_string();
    assert!(e.contains("not a dcr journal") && e.contains("offset 0"), "{e}");
}

#[test]
fn enospc_is_clear_and_loses_nothing_committed() {
    let io = SimIo::new();
    let (mut j, _) = ReceiverJournal::open(jpath(), io.clone()).unwrap();
    j.commit_dense(1, d(1)).unwrap();
    j.begin_refit(plan(2, 1, 2, 100)).unwrap();
    io.set_capacity(Some(io.used_bytes() + 200));
    let mut acknowledged = 0;
    let err = loop {
        match j.chunk_started(acknowledged) {
            Ok(()) => acknowledged += 1,
            Err(e) => break e,
        }
    };
    assert!(acknowledged >= 5, "{acknowledged}");
    assert!(err.is_disk_full(), "{err:?}");
    let m = err.to_string();
    assert!(m.contains("disk is full") && m.contains("free space") && m.contains("intact"), "{m}");
    let before = j.state().clone();
    assert_eq!(before.refit.as_ref().unwrap().touched(), acknowledged);
    // Nothing acknowledged is lost, with or without a crash.
    for copy in
        [io.crashed_copy(Crash::DropUnsynced), io.crashed_copy(Crash::KeepPending { ops: usize::MAX, torn_bytes: 0 })]
    {
        let (_, rec) = ReceiverJournal::open(jpath(), copy).unwrap();
        assert_eq!(rec.state, before);
    }
    // The handle survives a failed write: free space and go on.
    io.set_capacity(None);
    j.chunk_started(acknowledged).unwrap();
    for s in 0..=acknowledged {
        j.chunk_applied(s).unwrap();
    }
    drop(j);

    // A commit whose compaction runs out of space is still a commit.
    let io = SimIo::new();
    let (mut j, _) = ReceiverJournal::open(jpath(), io.clone()).unwrap();
    j.commit_dense(1, d(1)).unwrap();
    j.begin_refit(plan(2, 1, 2, 1)).unwrap();
    j.chunk_started(0).unwrap();
    j.chunk_applied(0).unwrap();
    // Room for the RefitCommitted record (12 + 25 bytes), not for the
    // compacted copy (16 + 12 + 25 bytes).
    io.set_capacity(Some(io.used_bytes() + 37 + 10));
    let e = j.commit(2, d(2)).unwrap_err();
    assert!(matches!(e, Error::JournalCompact { .. }) && e.is_disk_full(), "{e:?}");
    let m = e.to_string();
    assert!(m.contains("commit of version 2") && m.contains("is durable") && m.contains("disk is full"), "{m}");
    assert_eq!(j.state().committed.unwrap().version, 2);
    assert_eq!(io.paths(), vec![jpath()], "the temp file was removed");
    let (_, rec) = ReceiverJournal::open(jpath(), io.crashed_copy(Crash::DropUnsynced)).unwrap();
    assert_eq!(rec.state.committed.unwrap().version, 2);
    io.set_capacity(None);
    j.compact().unwrap();
    assert_eq!(j.journal().committed_len(), 16 + 12 + 25);
    // Reopening on a full disk works as long as nothing must grow.
    drop(j);
    io.set_capacity(Some(io.used_bytes()));
    let (mut j, rec) = ReceiverJournal::open(jpath(), io.clone()).unwrap();
    assert_eq!(rec.state.committed.unwrap().version, 2);
    assert!(j.begin_refit(plan(3, 2, 3, 1)).unwrap_err().is_disk_full());
}

#[test]
fn a_poisoned_handle_says_to_reopen() {
    let io = SimIo::new();
    let (mut j, _) = ReceiverJournal::open(jpath(), io.clone()).unwrap();
    j.commit_dense(1, d(1)).unwrap();
    io.fail_sync(io.counts().syncs);
    let e = j.begin_refit(plan(2, 1, 2, 1)).unwrap_err().to_string();
    assert!(e.contains("sync records failed"), "{e}");
    let e = j.begin_refit(plan(2, 1, 2, 1)).unwrap_err();
    assert!(matches!(e, Error::JournalPoisoned { .. }) && e.to_string().contains("reopen the journal"), "{e}");
    drop(j);
    let (mut j, rec) = ReceiverJournal::open(jpath(), io.clone()).unwrap();
    assert!(rec.state.refit.is_none());
    j.begin_refit(plan(2, 1, 2, 1)).unwrap();
}

#[test]
fn std_io_survives_a_reopen_cycle_with_compaction() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.dcrj");
    let ops = scenario();
    let states = expected_states(&ops);
    let (mut j, _) = ReceiverJournal::open_std(&path).unwrap();
    for (i, op) in ops.iter().enumerate().skip(1) {
        apply(&mut j, op).unwrap();
        drop(j);
        let (j2, rec) = ReceiverJournal::open_std(&path).unwrap();
        assert_eq!(rec.state, states[i + 1], "after {op:?}");
        assert!(rec.torn_tail.is_none());
        j = j2;
    }
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("r.dcrj")]);
}

fn random_ops(n_chunks: u32, batches: &[usize], abort: bool) -> Vec<Op> {
    let mut ops = vec![Op::Open, Op::Dense(1, 1), Op::Begin(plan(2, 1, 2, n_chunks))];
    let mut seq = 0u32;
    let mut bi = 0;
    while seq < n_chunks {
        let size = batches[bi % batches.len()].min((n_chunks - seq) as usize) as u32;
        bi += 1;
        let s: Vec<u32> = (seq..seq + size).collect();
        ops.push(Op::Started(s.clone()));
        ops.push(Op::Applied(s.into_iter().rev().collect()));
        seq += size;
        if abort && seq >= n_chunks / 2 {
            ops.push(Op::Abort("random abort"));
            ops.push(Op::Dense(1, 1));
            ops.push(Op::Begin(plan(3, 1, 3, 1)));
            ops.push(Op::Started(vec![0]));
            ops.push(Op::Applied(vec![0]));
            ops.push(Op::Commit(3, 3));
            return ops;
        }
    }
    ops.push(Op::Commit(2, 2));
    ops
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Cut the power before a random operation, crash keeping a random
    /// prefix of what was pending and a torn part of the next write: the
    /// journal reopens to the state before or after the interrupted op.
    #[test]
    fn random_crash_points_recover_old_or_new(
        n_chunks in 1u32..10,
        batches in proptest::collection::vec(1usize..4, 1..4),
        abort in any::<bool>(),
        cut in 0u64..400,
        keep in 0usize..64,
        torn in 0usize..80,
        reorder in proptest::option::of(any::<u64>()),
    ) {
        let ops = random_ops(n_chunks, &batches, abort);
        let states = expected_states(&ops);
        let io = SimIo::new();
        io.power_cut_at_op(cut);
        let (j, failed) = run(&io, &ops);
        drop(j);
        let keep = keep.min(io.pending_ops());
        io.crash(match reorder {
            None => Crash::KeepPending { ops: keep, torn_bytes: torn },
            Some(mask) => Crash::Reorder { mask, torn_op: keep, torn_bytes: torn },
        });
        match failed {
            Some(failed) => check_recovery(io, &ops, &states, failed, &format!("cut {cut}, keep {keep}, torn {torn}")),
            None => {
                let (_, rec) = ReceiverJournal::open(jpath(), io).unwrap();
                prop_assert_eq!(&rec.state, states.last().unwrap());
            }
        }
    }

    /// Random bytes after a valid journal never make open panic; they are
    /// either a torn tail or a clean corruption error.
    #[test]
    fn garbage_tails_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..64)) {
        let io = SimIo::new();
        let (mut j, _) = ReceiverJournal::open(jpath(), io.clone()).unwrap();
        j.commit_dense(1, d(1)).unwrap();
        let state = j.state().clone();
        drop(j);
        let mut b = io.file_bytes(&jpath()).unwrap();
        let len = b.len();
        b.extend_from_slice(&tail);
        io.put_file_bytes(&jpath(), &b);
        match ReceiverJournal::open(jpath(), io.clone()) {
            Ok((_, rec)) => {
                prop_assert_eq!(rec.state, state);
                prop_assert_eq!(io.file_bytes(&jpath()).unwrap().len(), len);
            }
            Err(Error::JournalCorrupt { offset, .. }) => prop_assert!(offset >= len as u64),
            Err(e) => prop_assert!(false, "unexpected error {}", e),
        }
    }
}

fn any_op() -> impl Strategy<Value = Op> {
    let seqs = proptest::collection::vec(0u32..5, 1..4);
    prop_oneof![
        (1u64..4, 1u8..4).prop_map(|(v, x)| Op::Dense(v, x)),
        (1u64..5, 1u8..4, 1u8..5, 1u32..5).prop_map(|(v, b, t, n)| Op::Begin(plan(v, b, t, n))),
        seqs.clone().prop_map(Op::Started),
        seqs.prop_map(Op::Applied),
        (1u64..5, 1u8..5).prop_map(|(v, x)| Op::Commit(v, x)),
        Just(Op::Abort("random")),
        Just(Op::Compact),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Random calls, many of them refused: after every call, a crash that
    /// drops everything unsynced recovers exactly the handle's state, and a
    /// refused call changes nothing.
    #[test]
    fn random_calls_keep_disk_and_memory_in_step(ops in proptest::collection::vec(any_op(), 1..40)) {
        let io = SimIo::new();
        let (mut j, _) = ReceiverJournal::open(jpath(), io.clone()).unwrap();
        for op in &ops {
            let before = j.state().clone();
            match apply(&mut j, op) {
                Ok(()) => {}
                Err(Error::JournalTransition { .. }) => prop_assert_eq!(j.state(), &before),
                Err(e) => prop_assert!(false, "{:?}: unexpected error {}", op, e),
            }
            let (_, rec) = ReceiverJournal::open(jpath(), io.crashed_copy(Crash::DropUnsynced)).unwrap();
            prop_assert_eq!(&rec.state, j.state(), "after {:?}", op);
            prop_assert!(rec.torn_tail.is_none());
        }
    }
}
