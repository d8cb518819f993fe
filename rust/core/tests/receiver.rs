//! Crash-safety tests of the resumable receiver: every write, sync, file
//! operation and target flush of two refits failed in turn (with and
//! without a crash of the machine), then resumed to a bit-exact target; torn
//! and corrupt journals; wrong-base, replayed and competing deltas; a full
//! disk; a delta that fails verification.

use std::path::{Path, PathBuf};

use dcr_core::checkpoint::{Layout, TensorSpec};
use dcr_core::codec::{ChangeKind, Mode};
use dcr_core::delta::{diff, read_delta, Delta, DiffOptions};
use dcr_core::dtype::DType;
use dcr_core::error::Error;
use dcr_core::journal::sim::{Crash, SimIo};
use dcr_core::journal::ChunkState;
use dcr_core::receiver::{self, refit, status, undo_path, MemTarget, RefitOptions, RefitOutcome, TargetCrash};

mod common;
use common::xorshift;

fn jpath() -> PathBuf {
    PathBuf::from("/data/model.safetensors.dcrj")
}

struct Fixture {
    layout: Layout,
    versions: Vec<Vec<Vec<u8>>>,
    deltas: Vec<Delta>,
}

/// Three versions of a small model (bf16, f32, u8 and a tensor that changes
/// completely, so dense chunks appear) and the deltas 0->1 and 1->2 with
/// 256-byte chunks (about 25 chunks each).
fn fixture(kind: ChangeKind) -> Fixture {
    fixture_mode(kind, Mode::Free)
}

fn fixture_mode(kind: ChangeKind, mode: Mode) -> Fixture {
    let specs = vec![
        TensorSpec {
            name: "a.weight".into(),
            dtype: DType::from_name("BF16").unwrap(),
            shape: if mode == Mode::Context { vec![256, 64] } else { vec![64, 32] },
        },
        TensorSpec { name: "b.bias".into(), dtype: DType::from_name("F32").unwrap(), shape: vec![300] },
        TensorSpec { name: "c.mask".into(), dtype: DType::from_name("U8").unwrap(), shape: vec![50] },
        TensorSpec { name: "d.scale".into(), dtype: DType::from_name("BF16").unwrap(), shape: vec![100] },
    ];
    let layout = Layout::new(specs).unwrap();
    let mut next = xorshift(0x5eed);
    let mut v0: Vec<Vec<u8>> =
        layout.tensors().iter().map(|t| (0..t.storage_bytes().unwrap()).map(|_| next() as u8).collect()).collect();
    if mode == Mode::Context {
        // bf16 weights spread over a few exponents, as trained weights are.
        v0[0] = (0..v0[0].len() as u32 / 2)
            .flat_map(|i| (0x3a00 + ((i.wrapping_mul(2654435761) >> 7) % 0x0600) as u16).to_le_bytes())
            .collect();
    }
    let step = |prev: &Vec<Vec<u8>>, next: &mut dyn FnMut() -> u64| -> Vec<Vec<u8>> {
        prev.iter()
            .enumerate()
            .map(|(i, t)| {
                if i == 0 && mode == Mode::Context {
                    // bf16 weights moved by a few ulps, as the context coder expects.
                    return t
                        .chunks_exact(2)
                        .flat_map(|w| {
                            let v = u16::from_le_bytes([w[0], w[1]]);
                            let v = if (v >> 7) == (0x3c00 >> 7) && next().is_multiple_of(3) { v + 1 } else { v };
                            v.to_le_bytes()
                        })
                        .collect();
                }
                t.iter().map(|&b| if i == 3 || next() % 100 < 4 { b ^ ((next() as u8) | 1) } else { b }).collect()
            })
            .collect()
    };
    let v1 = step(&v0, &mut next);
    let v2 = step(&v1, &mut next);
    let versions = vec![v0, v1, v2];
    let deltas = (0..2)
        .map(|i| {
            let opts = DiffOptions {
                chunk_bytes: if mode == Mode::Context { 2048 } else { 256 },
                kind,
                mode,
                base_version: i as u64,
                target_version: i as u64 + 1,
                ..Default::default()
            };
            let old: Vec<&[u8]> = versions[i].iter().map(Vec::as_slice).collect();
            let new: Vec<&[u8]> = versions[i + 1].iter().map(Vec::as_slice).collect();
            let mut out = Vec::new();
            diff(
                &layout,
                &old,
                &new,
                &opts,
                &mut |b| {
                    out.extend_from_slice(b);
                    Ok(())
                },
                &mut |_, _| {},
            )
            .unwrap();
            read_delta(&out).unwrap().into_owned()
        })
        .collect();
    Fixture { layout, versions, deltas }
}

fn opts() -> RefitOptions {
    // Only the first chunk's decoded changes kept: the others are decoded
    // again for their batch (and, on resume, against their pre-images).
    RefitOptions { batch_chunks: 4, batch_bytes: u64::MAX, keep_decoded_bytes: 1 }
}

fn target(f: &Fixture, v: usize) -> MemTarget {
    MemTarget::new(f.layout.clone(), f.versions[v].clone()).unwrap()
}

fn run(io: &SimIo, t: &mut MemTarget, d: &Delta) -> dcr_core::Result<RefitOutcome> {
    refit(&jpath(), io.clone(), d, t, &opts())
}

/// Applies the deltas in order; returns the index of the first that failed.
fn run_all(io: &SimIo, t: &mut MemTarget, f: &Fixture) -> Option<(usize, Error)> {
    for (i, d) in f.deltas.iter().enumerate() {
        if let Err(e) = run(io, t, d) {
            return Some((i, e));
        }
    }
    None
}

/// After a failure in delta `from`, resume and finish; the target must hold
/// the last version exactly (in memory and on "disk"), with a clean journal.
fn resume_and_check(io: &SimIo, t: &mut MemTarget, f: &Fixture, from: usize, label: &str) {
    for d in &f.deltas[from..] {
        match run(io, t, d) {
            Ok(_) => {}
            Err(e) => panic!("{label}: resuming delta {} failed: {e}", d.header.target_version),
        }
    }
    let last = f.versions.last().unwrap();
    assert!(&t.current == last, "{label}: target differs from the last version");
    assert!(&t.durable == last, "{label}: durable target differs from the last version");
    let s = status(&jpath(), io.clone()).unwrap();
    assert_eq!(s.state.committed.map(|c| c.version), Some(2), "{label}");
    assert!(s.state.refit.is_none(), "{label}: refit still in flight");
    assert!(io.file_bytes(&undo_path(&jpath())).is_none(), "{label}: undo file left behind");
    // Rerun after success: a no-op.
    let again = run(io, t, f.deltas.last().unwrap()).unwrap();
    assert!(matches!(again, RefitOutcome::AlreadyAtTarget { version: 2, .. }), "{label}: {again:?}");
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    Write,
    Sync,
    Op,
    PowerCut,
    Flush,
}

/// Injects one fault per run for n = 0, 1, ... until a run no longer hits
/// it; after each failure "crashes" in one of several ways and resumes.
fn fail_each(kind: ChangeKind, fault: Fault) -> u64 {
    fail_each_mode(kind, Mode::Free, fault)
}

fn fail_each_mode(kind: ChangeKind, mode: Mode, fault: Fault) -> u64 {
    let f = fixture_mode(kind, mode);
    let mut n = 0u64;
    loop {
        for mode in 0..4u64 {
            let io = SimIo::new();
            let mut t = target(&f, 0);
            match fault {
                Fault::Write => io.fail_write(n),
                Fault::Sync => io.fail_sync(n),
                Fault::Op => io.fail_op(n),
                Fault::PowerCut => io.power_cut_at_op(n),
                Fault::Flush => t.fail_flush(n),
            }
            let Some((failed, err)) = run_all(&io, &mut t, &f) else {
                assert!(n > 0, "{fault:?}: the refits issued none");
                assert_eq!(t.current, *f.versions.last().unwrap());
                return n;
            };
            let label = format!("{kind:?} {fault:?} #{n}, crash mode {mode}, failed in delta {failed}: {err}");
            match (fault, mode) {
                // The process died; the machine's page cache survived.
                (f, 0) if !matches!(f, Fault::PowerCut) => {
                    t.crash(TargetCrash::KeepAll);
                    io.clear_faults();
                }
                (_, 0) | (_, 1) => {
                    io.crash(Crash::DropUnsynced);
                    t.crash(TargetCrash::DropUnflushed);
                }
                (_, 2) => {
                    io.crash(Crash::KeepPending { ops: (n % 3) as usize, torn_bytes: 5 });
                    t.crash(TargetCrash::Mix(n + 7));
                }
                _ => {
                    io.crash(Crash::Reorder { mask: 0xa5a5_5a5a ^ n, torn_op: (n % 4) as usize, torn_bytes: 3 });
                    t.crash(TargetCrash::Mix(n * 31 + 1));
                }
            }
            resume_and_check(&io, &mut t, &f, failed, &label);
        }
        n += 1;
    }
}

#[test]
fn every_write_failed_in_turn_resumes_bit_exact() {
    assert!(fail_each(ChangeKind::Xor, Fault::Write) > 10);
}

#[test]
fn every_sync_failed_in_turn_resumes_bit_exact() {
    assert!(fail_each(ChangeKind::Xor, Fault::Sync) > 10);
}

#[test]
fn every_operation_failed_in_turn_resumes_bit_exact() {
    assert!(fail_each(ChangeKind::Xor, Fault::Op) > 20);
}

#[test]
fn a_power_cut_before_every_operation_resumes_bit_exact() {
    assert!(fail_each(ChangeKind::Xor, Fault::PowerCut) > 20);
}

#[test]
fn every_target_flush_failed_in_turn_resumes_bit_exact() {
    assert!(fail_each(ChangeKind::Xor, Fault::Flush) > 5);
}

#[test]
fn overwrite_deltas_resume_too() {
    assert!(fail_each(ChangeKind::Overwrite, Fault::Sync) > 10);
    assert!(fail_each(ChangeKind::Overwrite, Fault::PowerCut) > 20);
}

/// Many crashes in a row, at random operations, with random crash modes:
/// repairs of repairs, crashes during resumes, crashes in the commit.
#[test]
fn repeated_crashes_still_end_bit_exact() {
    let mut total = 0;
    for kind in [ChangeKind::Xor, ChangeKind::Overwrite] {
        let f = fixture(kind);
        for seed in 0..24u64 {
            let mut next = xorshift(seed * 7919 + 13);
            let io = SimIo::new();
            let mut t = target(&f, 0);
            let mut at = 0;
            let mut crashes = 0;
            while at < f.deltas.len() {
                assert!(crashes < 200, "seed {seed}: no progress");
                let armed = !next().is_multiple_of(4);
                if armed {
                    io.power_cut_at_op(io.counts().ops + 1 + next() % 60);
                }
                match run(&io, &mut t, &f.deltas[at]) {
                    Ok(_) => {
                        io.clear_faults();
                        at += 1;
                    }
                    Err(e) => {
                        assert!(armed, "seed {seed}: failed without a fault: {e}");
                        crashes += 1;
                        match next() % 3 {
                            0 => {
                                io.crash(Crash::DropUnsynced);
                                t.crash(TargetCrash::DropUnflushed);
                            }
                            1 => {
                                io.crash(Crash::KeepPending { ops: (next() % 4) as usize, torn_bytes: 6 });
                                t.crash(TargetCrash::Mix(next()));
                            }
                            _ => {
                                io.crash(Crash::Reorder {
                                    mask: next(),
                                    torn_op: (next() % 5) as usize,
                                    torn_bytes: 2,
                                });
                                t.crash(TargetCrash::Mix(next()));
                            }
                        }
                    }
                }
            }
            resume_and_check(&io, &mut t, &f, f.deltas.len(), &format!("{kind:?} seed {seed} ({crashes} crashes)"));
            total += crashes;
        }
    }
    assert!(total > 100, "only {total} crashes");
}

/// A refit of delta 0->1 interrupted after a few batches (a failed sync):
/// some chunks applied, some in progress, the rest not started.
fn interrupted(f: &Fixture) -> (SimIo, MemTarget) {
    let io = SimIo::new();
    let mut t = target(f, 0);
    // Journal creation 2 syncs, dense commit 2 + compaction 2, begin 2, undo
    // create 2; then per batch: undo 1, started 2, applied 2.
    io.fail_sync(10 + 5 * 2 + 3);
    assert!(run(&io, &mut t, &f.deltas[0]).is_err());
    io.clear_faults();
    let s = status(&jpath(), io.clone()).unwrap();
    let r = s.state.refit.expect("refit in flight");
    assert!(!r.applied().is_empty() && !r.needs_repair().is_empty() && !r.not_started().is_empty(), "{:?}", r.chunks);
    (io, t)
}

#[test]
fn status_reports_chunk_states_and_resume_repairs_in_progress_chunks() {
    let f = fixture(ChangeKind::Xor);
    let (io, mut t) = interrupted(&f);
    let r = status(&jpath(), io.clone()).unwrap().state.refit.unwrap();
    let (applied, repair) = (r.applied().len() as u32, r.needs_repair().len() as u32);
    match run(&io, &mut t, &f.deltas[0]).unwrap() {
        RefitOutcome::Committed(rep) => {
            assert!(rep.resumed);
            assert_eq!(rep.skipped, applied);
            assert_eq!(rep.repaired, repair);
            assert_eq!(rep.applied + rep.repaired + rep.skipped, rep.chunks);
        }
        o => panic!("{o:?}"),
    }
    assert_eq!(t.current, f.versions[1]);
}

#[test]
fn a_torn_journal_tail_is_cut_and_the_refit_resumes() {
    let f = fixture(ChangeKind::Xor);
    let (io, mut t) = interrupted(&f);
    let mut bytes = io.file_bytes(&jpath()).unwrap();
    bytes.extend_from_slice(&[5, 0, 0, 0, 3, 1, 0]); // a record cut short
    io.put_file_bytes(&jpath(), &bytes);
    let s = status(&jpath(), io.clone()).unwrap();
    assert!(s.torn_tail.is_some() && s.state.refit.is_some());
    match run(&io, &mut t, &f.deltas[0]).unwrap() {
        RefitOutcome::Committed(rep) => assert!(rep.torn_tail.is_some() && rep.resumed),
        o => panic!("{o:?}"),
    }
    resume_and_check(&io, &mut t, &f, 1, "torn tail");
}

#[test]
fn a_corrupt_journal_record_is_a_clear_error_and_nothing_is_touched() {
    let f = fixture(ChangeKind::Xor);
    let (io, mut t) = interrupted(&f);
    let mut bytes = io.file_bytes(&jpath()).unwrap();
    bytes[16 + 4 + 2] ^= 0x40; // inside the first record's payload
    io.put_file_bytes(&jpath(), &bytes);
    let before = t.current.clone();
    let e = run(&io, &mut t, &f.deltas[0]).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, Error::JournalCorrupt { offset: 16, .. }), "{m}");
    assert!(m.contains("model.safetensors.dcrj") && m.contains("dense refit"), "{m}");
    assert!(status(&jpath(), io.clone()).is_err());
    assert_eq!(t.current, before);
    assert_eq!(io.file_bytes(&jpath()).unwrap(), bytes, "the corrupt journal is kept as evidence");
}

#[test]
fn a_damaged_pre_image_is_a_clear_error() {
    let f = fixture(ChangeKind::Xor);
    let (io, mut t) = interrupted(&f);
    let up = undo_path(&jpath());
    let mut bytes = io.file_bytes(&up).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1; // the last entry belongs to a chunk in progress
    io.put_file_bytes(&up, &bytes);
    let before = t.current.clone();
    let m = run(&io, &mut t, &f.deltas[0]).unwrap_err().to_string();
    assert!(m.contains("pre-image of chunk") && m.contains(".undo"), "{m}");
    assert_eq!(t.current, before);
}

#[test]
fn a_wrong_base_delta_is_refused_untouched() {
    let f = fixture(ChangeKind::Xor);
    let io = SimIo::new();
    let mut t = target(&f, 0);
    let e = run(&io, &mut t, &f.deltas[1]).unwrap_err();
    assert!(matches!(e, Error::BaseMismatch { .. }), "{e}");
    assert!(e.to_string().contains("v1->v2"), "{e}");
    assert_eq!(t.current, f.versions[0]);
    assert!(status(&jpath(), io.clone()).unwrap().state.refit.is_none());
    // A garbage target is refused too.
    let mut junk = target(&f, 0);
    junk.current[0][0] ^= 1;
    let before = junk.current.clone();
    assert!(matches!(run(&io, &mut junk, &f.deltas[0]), Err(Error::BaseMismatch { .. })));
    assert_eq!(junk.current, before);
}

#[test]
fn a_replayed_old_delta_is_refused_untouched_and_a_repeat_is_a_no_op() {
    let f = fixture(ChangeKind::Xor);
    let io = SimIo::new();
    let mut t = target(&f, 0);
    assert!(run_all(&io, &mut t, &f).is_none());
    let e = run(&io, &mut t, &f.deltas[0]).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, Error::BaseMismatch { .. }) && m.contains("version 2 in its journal"), "{m}");
    assert_eq!(t.current, f.versions[2]);
    assert!(matches!(run(&io, &mut t, &f.deltas[1]).unwrap(), RefitOutcome::AlreadyAtTarget { version: 2, .. }));
    assert_eq!(t.current, f.versions[2]);
}

#[test]
fn another_delta_is_refused_while_a_touching_refit_is_in_flight() {
    let f = fixture(ChangeKind::Xor);
    let (io, mut t) = interrupted(&f);
    let before = t.current.clone();
    let e = run(&io, &mut t, &f.deltas[1]).unwrap_err();
    assert!(matches!(e, Error::JournalTransition { .. }) && e.to_string().contains("in flight"), "{e}");
    assert_eq!(t.current, before);
    resume_and_check(&io, &mut t, &f, 0, "after a refused competitor");
}

#[test]
fn a_dense_reload_ends_a_refit_in_flight() {
    let f = fixture(ChangeKind::Xor);
    // Reloaded with the base: delta 0->1 starts over.
    let (io, mut t) = interrupted(&f);
    t.current = f.versions[0].clone();
    let (io2, mut t2) = interrupted(&f);
    assert!(matches!(run(&io, &mut t, &f.deltas[0]).unwrap(), RefitOutcome::Committed(r) if !r.resumed));
    resume_and_check(&io, &mut t, &f, 1, "reloaded with v0");
    // Reloaded with v1: delta 1->2 is accepted although 0->1 was in flight.
    t2.current = f.versions[1].clone();
    assert!(matches!(run(&io2, &mut t2, &f.deltas[1]).unwrap(), RefitOutcome::Committed(_)));
    resume_and_check(&io2, &mut t2, &f, 1, "reloaded with v1");
}

#[test]
fn a_full_disk_fails_cleanly_and_resumes_after_space_is_freed() {
    let f = fixture(ChangeKind::Xor);
    let mut hit = 0;
    for room in (0..4000).step_by(97) {
        let io = SimIo::new();
        let mut t = target(&f, 0);
        // The journal exists and holds the base before space runs out.
        drop(dcr_core::journal::ReceiverJournal::open(jpath(), io.clone()).unwrap());
        io.set_capacity(Some(io.used_bytes() + room));
        if let Some((failed, e)) = run_all(&io, &mut t, &f) {
            assert!(e.is_disk_full(), "room {room}: {e}");
            assert!(e.to_string().contains("disk is full") || matches!(e, Error::JournalIo { .. }), "{e}");
            hit += 1;
            io.set_capacity(None);
            resume_and_check(&io, &mut t, &f, failed, &format!("room {room}"));
        }
    }
    assert!(hit > 5, "{hit}");
}

#[test]
fn a_delta_that_fails_verification_is_rolled_back_to_the_committed_version() {
    let f = fixture(ChangeKind::Xor);
    let mut bad = f.deltas[0].clone();
    // Claim a different result for one tensor (consistently in the header).
    bad.trailer.tensor_digests[1][0] ^= 1;
    bad.header.target_digest = f.layout.checkpoint_digest(&bad.trailer.tensor_digests);
    let io = SimIo::new();
    let mut t = target(&f, 0);
    let e = run(&io, &mut t, &bad).unwrap_err();
    assert!(matches!(e, Error::TargetMismatch { .. }) && e.to_string().contains("restored to its base"), "{e}");
    assert_eq!(t.current, f.versions[0]);
    assert_eq!(t.durable, f.versions[0]);
    let s = status(&jpath(), io.clone()).unwrap();
    assert_eq!(s.state.committed.map(|c| c.version), Some(0));
    assert!(s.state.refit.is_none() && s.state.target_is_committed());
    assert!(io.file_bytes(&undo_path(&jpath())).is_none());
    // It stays refused; the right delta goes through.
    assert!(run(&io, &mut t, &bad).is_err());
    assert_eq!(t.current, f.versions[0]);
    resume_and_check(&io, &mut t, &f, 0, "after a rollback");
}

#[test]
fn a_crash_during_a_rollback_finishes_the_rollback() {
    let f = fixture(ChangeKind::Xor);
    let mut bad = f.deltas[0].clone();
    bad.trailer.tensor_digests[0][3] ^= 1;
    bad.header.target_digest = f.layout.checkpoint_digest(&bad.trailer.tensor_digests);
    let io = SimIo::new();
    let mut t = target(&f, 0);
    let n_batches = f.deltas[0].chunks.len().div_ceil(4) as u64;
    t.fail_flush(n_batches); // the rollback's flush
    assert!(run(&io, &mut t, &bad).is_err());
    t.crash(TargetCrash::Mix(3));
    let s = status(&jpath(), io.clone()).unwrap();
    assert!(s.state.refit.as_ref().unwrap().chunks.iter().all(|&c| c == ChunkState::Applied));
    assert!(matches!(run(&io, &mut t, &bad), Err(Error::TargetMismatch { .. })));
    assert_eq!(t.current, f.versions[0]);
}

#[test]
fn files_on_disk_resume_and_report_status() {
    use dcr_core::files;
    let dir = tempfile::tempdir().unwrap();
    let f = fixture(ChangeKind::Xor);
    let write = |path: &Path, bufs: &Vec<Vec<u8>>| {
        let mut header = String::from("{");
        let mut off = 0;
        for (i, (t, b)) in f.layout.tensors().iter().zip(bufs).enumerate() {
            let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
            header += &format!(
                "{}\"{}\":{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                if i > 0 { "," } else { "" },
                t.name,
                t.dtype.name(),
                shape.join(","),
                off,
                off + b.len()
            );
            off += b.len();
        }
        header += "}";
        while header.len() % 8 != 0 {
            header.push(' ');
        }
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        for b in bufs {
            out.extend_from_slice(b);
        }
        std::fs::write(path, out).unwrap();
    };
    let (p0, p1, tgt) = (dir.path().join("v0.st"), dir.path().join("v1.st"), dir.path().join("replica.st"));
    write(&p0, &f.versions[0]);
    write(&p1, &f.versions[1]);
    write(&tgt, &f.versions[0]);
    let dp = dir.path().join("01.dcr");
    let o = DiffOptions { chunk_bytes: 256, base_version: 0, target_version: 1, ..Default::default() };
    files::diff_files(&p0, &p1, &dp, &o, &mut |_, _| {}).unwrap();
    let st = receiver::status_file(&tgt, None).unwrap();
    assert!(!st.exists && !receiver::default_journal_path(&tgt).exists(), "status creates nothing");
    let out = receiver::refit_file(&dp, &tgt, None, &RefitOptions { batch_chunks: 3, batch_bytes: 1 << 20, ..Default::default() }).unwrap();
    assert!(matches!(out, RefitOutcome::Committed(_)), "{out:?}");
    assert!(files::compare_files(&tgt, &p1).unwrap().is_empty());
    let st = receiver::status_file(&tgt, None).unwrap();
    assert_eq!(st.state.committed.unwrap().version, 1);
    assert!(st.undo_bytes.is_none());
    let again = receiver::refit_file(&dp, &tgt, None, &RefitOptions::default()).unwrap();
    assert!(matches!(again, RefitOutcome::AlreadyAtTarget { version: 1, .. }));
    // A second process on the same target is refused while the first runs.
    let held = receiver::RefitLock::acquire(&receiver::default_journal_path(&tgt)).unwrap();
    let e = receiver::refit_file(&dp, &tgt, None, &RefitOptions::default()).unwrap_err();
    assert!(e.to_string().contains("another process"), "{e}");
    drop(held);
    assert!(receiver::refit_file(&dp, &tgt, None, &RefitOptions::default()).is_ok());
}

/// The joint commit end to end: a sender publishes deltas from its baseline,
/// three receivers refit through their journals and report; one crashes,
/// lags behind, and catches up through the retained chain.
#[test]
fn joint_commit_with_a_lagging_receiver_that_catches_up() {
    use dcr_core::commit::{CatchUp, DeltaEntry, Ledger, Retention, Version};
    let f = fixture(ChangeKind::Xor);
    let ver = |d: &Delta, target: bool| {
        let h = &d.header;
        if target {
            Version { version: h.target_version, digest: h.target_digest }
        } else {
            Version { version: h.base_version, digest: h.base_digest }
        }
    };
    let entry = |i: usize| DeltaEntry {
        base: ver(&f.deltas[i], false),
        target: ver(&f.deltas[i], true),
        delta_id: f.deltas[i].header.delta_id,
        bytes: 1000,
        location: format!("d{i}"),
    };
    let mut ledger = Ledger::new(ver(&f.deltas[0], false), Retention::default());
    let names = ["r0", "r1", "r2"];
    let ios: Vec<SimIo> = names.iter().map(|_| SimIo::new()).collect();
    let mut targets: Vec<MemTarget> = names.iter().map(|_| target(&f, 0)).collect();
    for n in names {
        ledger.register(n, Some(ver(&f.deltas[0], false))).unwrap();
    }
    // Delta 0->1: r2 crashes mid-refit (power cut) and stays behind.
    assert_eq!(ledger.baseline(), entry(0).base);
    ledger.publish(entry(0)).unwrap();
    for (i, n) in names.iter().enumerate() {
        if i == 2 {
            ios[i].power_cut_at_op(40);
        }
        match run(&ios[i], &mut targets[i], &f.deltas[0]) {
            Ok(_) => ledger.report_commit(n, ver(&f.deltas[0], true)).unwrap(),
            Err(_) => {
                ios[i].crash(Crash::DropUnsynced);
                targets[i].crash(TargetCrash::DropUnflushed);
            }
        }
    }
    assert_eq!(ledger.pending(), vec!["r2".to_string()]);
    // The sender may not diff 1->2 while r2 holds the baseline at 0 ...
    assert!(ledger.publish(entry(1)).is_err());
    // ... so r2 is marked lagging, and 1->2 goes out.
    ledger.mark_lagging("r2").unwrap();
    assert_eq!(ledger.baseline(), entry(1).base);
    ledger.publish(entry(1)).unwrap();
    for (i, n) in names.iter().enumerate().take(2) {
        run(&ios[i], &mut targets[i], &f.deltas[1]).unwrap();
        ledger.report_commit(n, ver(&f.deltas[1], true)).unwrap();
    }
    assert!(ledger.collect_garbage().is_empty(), "r2 still needs 0->1");
    // r2 catches up through the chain: resume 0->1, then 1->2.
    let CatchUp::Deltas(plan) = ledger.catch_up("r2").unwrap() else { panic!() };
    assert_eq!(plan.iter().map(|d| d.location.as_str()).collect::<Vec<_>>(), ["d0", "d1"]);
    for d in &plan {
        let i: usize = d.location[1..].parse().unwrap();
        run(&ios[2], &mut targets[2], &f.deltas[i]).unwrap();
        ledger.report_commit("r2", d.target).unwrap();
    }
    assert!(!ledger.receivers()["r2"].lagging);
    assert_eq!(ledger.collect_garbage().len(), 2);
    for t in &targets {
        assert_eq!(t.current, f.versions[2]);
    }
}

/// Deltas built without explicit versions all say 0->1: the digests decide,
/// and the journal takes the delta's version numbers.
#[test]
fn deltas_with_default_version_numbers_chain_by_digest() {
    let f = fixture(ChangeKind::Xor);
    let mut second = f.deltas[1].clone();
    second.header.base_version = 0;
    second.header.target_version = 1;
    let io = SimIo::new();
    let mut t = target(&f, 0);
    run(&io, &mut t, &f.deltas[0]).unwrap();
    assert!(matches!(run(&io, &mut t, &second).unwrap(), RefitOutcome::Committed(_)));
    assert_eq!(t.current, f.versions[2]);
    assert!(matches!(run(&io, &mut t, &second).unwrap(), RefitOutcome::AlreadyAtTarget { version: 1, .. }));
    let e = run(&io, &mut t, &f.deltas[0]).unwrap_err();
    assert!(matches!(e, Error::BaseMismatch { .. }), "{e}");
    assert_eq!(t.current, f.versions[2]);
}

fn dense_delta(f: &Fixture, to: usize) -> Delta {
    let opts =
        DiffOptions { chunk_bytes: 256, dense: true, base_version: 0, target_version: to as u64, ..Default::default() };
    let old: Vec<&[u8]> = f.versions[0].iter().map(Vec::as_slice).collect();
    let new: Vec<&[u8]> = f.versions[to].iter().map(Vec::as_slice).collect();
    let mut out = Vec::new();
    diff(
        &f.layout,
        &old,
        &new,
        &opts,
        &mut |b| {
            out.extend_from_slice(b);
            Ok(())
        },
        &mut |_, _| {},
    )
    .unwrap();
    read_delta(&out).unwrap().into_owned()
}

/// A dense (any-base) delta bootstraps any target of the layout, keeps no
/// pre-images, and resumes after every failed sync by applying interrupted
/// chunks again (overwrites are idempotent).
#[test]
fn dense_deltas_apply_to_any_target_and_resume_without_pre_images() {
    let f = fixture(ChangeKind::Xor);
    let dense = dense_delta(&f, 2);
    let junk = || {
        let mut t = target(&f, 0);
        t.current[0][5] ^= 0x5a;
        t.durable = t.current.clone();
        t
    };
    let mut n = 0;
    loop {
        let io = SimIo::new();
        let mut t = junk();
        io.fail_sync(n);
        let Err(e) = run(&io, &mut t, &dense) else {
            assert!(n > 10);
            break;
        };
        assert!(io.file_bytes(&undo_path(&jpath())).is_none(), "sync #{n}: {e}: a dense refit wrote pre-images");
        if n % 2 == 0 {
            io.crash(Crash::DropUnsynced);
            t.crash(TargetCrash::Mix(n));
        } else {
            t.crash(TargetCrash::KeepAll);
            io.clear_faults();
        }
        match run(&io, &mut t, &dense) {
            Ok(_) => {}
            Err(e) => panic!("sync #{n}: resuming the dense refit failed: {e}"),
        }
        assert_eq!(t.current, f.versions[2], "sync #{n}");
        assert!(matches!(run(&io, &mut t, &dense).unwrap(), RefitOutcome::AlreadyAtTarget { .. }));
        n += 1;
    }
    // It also ends a refit in flight that left the target at neither version.
    let (io, mut t) = interrupted(&f);
    assert!(matches!(run(&io, &mut t, &f.deltas[1]), Err(Error::JournalTransition { .. })));
    assert!(matches!(run(&io, &mut t, &dense).unwrap(), RefitOutcome::Committed(_)));
    assert_eq!(t.current, f.versions[2]);
    // A dense delta whose result does not match its digests cannot be rolled
    // back: it is aborted, and a good dense delta repairs the target.
    let mut bad = dense.clone();
    bad.trailer.tensor_digests[2][0] ^= 1;
    bad.header.target_digest = f.layout.checkpoint_digest(&bad.trailer.tensor_digests);
    let io = SimIo::new();
    let mut t = junk();
    assert!(matches!(run(&io, &mut t, &bad), Err(Error::RollbackIncomplete { .. })));
    let s = status(&jpath(), io.clone()).unwrap();
    assert!(s.state.last_abort.is_some_and(|a| a.touched_chunks > 0));
    assert!(matches!(run(&io, &mut t, &f.deltas[0]), Err(Error::BaseMismatch { .. })));
    run(&io, &mut t, &dense).unwrap();
    assert_eq!(t.current, f.versions[2]);
    resume_and_check(&io, &mut t, &f, 2, "after a failed dense refit");
}

/// Context-mode chunks decode against their base bytes: an in-progress one
/// is decoded against the base rebuilt from its pre-image (which carries its
/// positions), and a roll-back never decodes against the new bytes.
#[test]
fn context_mode_deltas_resume_and_roll_back() {
    let f = fixture_mode(ChangeKind::Xor, Mode::Context);
    assert!(f.deltas[0].chunks.iter().any(|c| c.mode == Mode::Context), "the fixture has context-mode chunks");
    assert!(fail_each_mode(ChangeKind::Xor, Mode::Context, Fault::Sync) > 10);
    assert!(fail_each_mode(ChangeKind::Xor, Mode::Context, Fault::PowerCut) > 20);
    assert!(fail_each_mode(ChangeKind::Xor, Mode::Context, Fault::Flush) > 5);
    let mut bad = f.deltas[0].clone();
    bad.trailer.tensor_digests[0][1] ^= 1;
    bad.header.target_digest = f.layout.checkpoint_digest(&bad.trailer.tensor_digests);
    let io = SimIo::new();
    let mut t = target(&f, 0);
    assert!(matches!(run(&io, &mut t, &bad), Err(Error::TargetMismatch { .. })));
    assert_eq!(t.current, f.versions[0]);
    resume_and_check(&io, &mut t, &f, 0, "context mode after a roll-back");
}
