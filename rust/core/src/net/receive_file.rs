//! Receiving one version from a relay tree into a safetensors file
//! (`dcr receive`): journaled by default (the delta spooled beside the
//! receiver journal as it arrives, then applied through it, so that a
//! receiver killed mid-apply finishes the version from its own disk), or
//! applied frame by frame as it arrives (not crash-safe). Either way the
//! verdict (digest, ok or failed) goes up the tree for the joint commit.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{subscribe, SubscribeConfig};
use crate::checkpoint::WritableCheckpoint;
use crate::delta::{ApplyOutcome, StreamApplier};
use crate::error::{Error, Result};
use crate::receiver;

/// How a received version reaches the target file.
#[derive(Clone, Debug)]
pub enum ApplyMode {
    /// Spooled beside the journal (`None`: `<target>.dcrj`) and applied
    /// through it; a refit left in flight by a killed receiver is finished
    /// first, from its spool.
    Journaled { journal: Option<PathBuf>, opts: receiver::RefitOptions },
    /// Each chunk applied as it arrives, rolled back on any failure seen;
    /// a killed process leaves the file partially applied.
    Streaming,
}

/// Receive one version (the first at or after `cfg.from_version`) into the
/// safetensors file `target` and report the verdict up the tree.
/// `progress` is called with each chunk's sequence number as it arrives.
pub fn receive_into_file(target: &Path, cfg: SubscribeConfig, mode: &ApplyMode, progress: &mut dyn FnMut(u32)) -> Result<FileReceipt> {
    match mode {
        ApplyMode::Streaming => receive_streaming(target, cfg, progress),
        ApplyMode::Journaled { journal, opts } => {
            if let Some(done) = receiver::resume_received(target, journal.as_deref(), opts)? {
                return Ok(FileReceipt {
                    outcome: refit_outcome(&done),
                    resumed: true,
                    version: refit_version(&done),
                    failovers: 0,
                    parent: None,
                });
            }
            receive_journaled(target, journal.as_deref(), cfg, progress, opts)
        }
    }
}

/// What one [`receive_into_file`] call did.
#[derive(Debug)]
pub struct FileReceipt {
    pub outcome: ApplyOutcome,
    /// A version an interrupted call had started was finished from its spool
    /// (no subscription, no acknowledgement: the tree has moved on).
    pub resumed: bool,
    pub version: u64,
    pub failovers: u32,
    pub parent: Option<String>,
}

fn refit_outcome(o: &receiver::RefitOutcome) -> ApplyOutcome {
    match o {
        receiver::RefitOutcome::Committed(r) => ApplyOutcome::Applied { chunks: r.chunks, changed: r.changed },
        receiver::RefitOutcome::AlreadyAtTarget { .. } => ApplyOutcome::AlreadyAtTarget,
    }
}

fn refit_version(o: &receiver::RefitOutcome) -> u64 {
    match o {
        receiver::RefitOutcome::Committed(r) => r.version,
        receiver::RefitOutcome::AlreadyAtTarget { version, .. } => *version,
    }
}

/// The delta of one version spooled to disk as it arrives, then the
/// journaled refit, then the ack.
fn receive_journaled(
    target: &Path,
    journal: Option<&Path>,
    cfg: SubscribeConfig,
    progress: &mut dyn FnMut(u32),
    opts: &receiver::RefitOptions,
) -> Result<FileReceipt> {
    // A delta for another model is refused at its header, before the rest
    // is received.
    let layout = crate::checkpoint::ReadOnlyCheckpoint::open(target)?.layout().clone();
    let spool = std::cell::RefCell::new(receiver::ReceivedSpool::create(target, journal)?);
    let refused = std::cell::RefCell::new(None::<Error>);
    let keep = |r: crate::Result<()>| {
        if let Err(e) = r {
            refused.borrow_mut().get_or_insert(e);
        }
    };
    let mut sub = subscribe(
        cfg,
        |_, header| {
            let checked = crate::delta::parse_header_blob(header).and_then(|h| h.layout.ensure_same(&layout, "target checkpoint"));
            keep(checked.and_then(|()| spool.borrow_mut().append(header)));
            Ok(())
        },
        |_, seq, blob| {
            progress(seq);
            if refused.borrow().is_none() {
                keep(spool.borrow_mut().append(blob));
            }
            Ok(())
        },
        |_, _, trailer| {
            if refused.borrow().is_none() {
                keep(spool.borrow_mut().append(trailer));
            }
            Ok(())
        },
    )?;
    let outcome = match refused.into_inner() {
        Some(e) => Err(e),
        None => spool.into_inner().refit(opts),
    };
    // The verdict goes up the tree whatever it is (joint commit): a committed
    // refit holds exactly the delta's target; otherwise report what the
    // target holds.
    let digest = match &outcome {
        Ok(receiver::RefitOutcome::Committed(r)) => r.digest,
        Ok(receiver::RefitOutcome::AlreadyAtTarget { digest, .. }) => *digest,
        Err(_) => crate::checkpoint::ReadOnlyCheckpoint::open(target)?.checkpoint_digest(),
    };
    let (ok, reason) = match &outcome {
        Ok(_) => (true, String::new()),
        Err(e) => (false, e.to_string()),
    };
    let ack = sub.ack(digest, ok, &reason, Duration::from_secs(30));
    let outcome = outcome?;
    ack?;
    Ok(FileReceipt {
        outcome: refit_outcome(&outcome),
        resumed: false,
        version: sub.delivered.version,
        failovers: sub.delivered.failovers,
        parent: Some(sub.delivered.parent.clone()),
    })
}

/// Apply the frames as they arrive (not journaled), roll back on a failure.
fn receive_streaming(target: &Path, cfg: SubscribeConfig, progress: &mut dyn FnMut(u32)) -> Result<FileReceipt> {
    let mut ck = WritableCheckpoint::open_rw(target)?;
    let layout = ck.layout().clone();
    let result = std::cell::RefCell::new(None::<crate::Result<ApplyOutcome>>);
    let target_digest = std::cell::Cell::new(None::<crate::checkpoint::Digest>);
    let outcome;
    let mut sub;
    {
        let applier = std::cell::RefCell::new(None::<StreamApplier<'_>>);
        let buffers = std::cell::RefCell::new(Some(ck.buffers_mut()));
        let received = subscribe(
            cfg,
            |_, header| {
                let views = buffers.borrow_mut().take().ok_or("a second header")?;
                if let Ok(h) = crate::delta::parse_header_blob(header) {
                    target_digest.set(Some(h.target_digest));
                }
                match StreamApplier::begin(header, &layout, views) {
                    Ok(Some(a)) => *applier.borrow_mut() = Some(a),
                    Ok(None) => *result.borrow_mut() = Some(Ok(ApplyOutcome::AlreadyAtTarget)),
                    Err(e) => *result.borrow_mut() = Some(Err(e)),
                }
                Ok(())
            },
            |_, seq, blob| {
                // done = chunks received so far; the total is unknown until the end (0).
                progress(seq);
                if let Some(a) = applier.borrow_mut().as_mut() {
                    if let Err(e) = a.chunk(blob) {
                        *result.borrow_mut() = Some(Err(e));
                    }
                }
                Ok(())
            },
            |_, _, trailer| {
                if let Some(a) = applier.borrow_mut().take() {
                    let r = match result.borrow_mut().take() {
                        Some(Err(e)) => a.rollback().and(Err(e)),
                        _ => a.finish(trailer),
                    };
                    *result.borrow_mut() = Some(r);
                }
                Ok(())
            },
        );
        if let Some(a) = applier.borrow_mut().take() {
            a.rollback()?; // the stream ended early: back to the base
        }
        sub = received?;
        outcome = result.borrow_mut().take().unwrap_or_else(|| {
            Err(Error::Incomplete { detail: "the stream ended without a trailer".into() })
        });
    }
    ck.flush()?;
    // A verified refit holds exactly the delta's target (its digests were
    // checked tensor by tensor); otherwise report what the target holds.
    let digest = match (&outcome, target_digest.get()) {
        (Ok(_), Some(d)) => d,
        _ => ck.checkpoint_digest(),
    };
    let (ok, reason) = match &outcome {
        Ok(_) => (true, String::new()),
        Err(e) => (false, e.to_string()),
    };
    // The verdict goes up the tree whatever it is (joint commit).
    let ack = sub.ack(digest, ok, &reason, Duration::from_secs(30));
    let outcome = outcome?;
    ack?;
    Ok(FileReceipt {
        outcome,
        resumed: false,
        version: sub.delivered.version,
        failovers: sub.delivered.failovers,
        parent: Some(sub.delivered.parent.clone()),
    })
}

