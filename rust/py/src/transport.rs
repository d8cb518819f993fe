//! Bindings of the relay-tree transport: publish a delta file to a root
//! relay, receive one into a safetensors file (journaled, or applied as
//! frames arrive),
//! and run a relay in this process.

use std::path::PathBuf;
use std::time::Duration;

use dcr_core::checkpoint::{digest_hex, WritableCheckpoint};
use dcr_core::delta::{split_frames, ApplyOutcome, StreamApplier};
use dcr_core::net::{self, PublishConfig, SubscribeConfig};
use dcr_core::receiver;
use dcr_core::relay::PreSharedKey;
use dcr_core::Error;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::to_py;

fn key(path: Option<PathBuf>) -> dcr_core::Result<Option<PreSharedKey>> {
    path.map(PreSharedKey::from_file).transpose()
}

/// Publish a delta file to a root relay (HOST:PORT), chunk by chunk, and
/// optionally wait for `expect_acks` receivers to report.
#[pyfunction]
#[pyo3(signature = (delta, to, *, key_file=None, version=None, expect_acks=0, ack_timeout_s=120.0, standby=Vec::new(), progress=None))]
#[allow(clippy::too_many_arguments)]
pub fn publish_delta<'py>(
    py: Python<'py>,
    delta: PathBuf,
    to: String,
    key_file: Option<PathBuf>,
    version: Option<u64>,
    expect_acks: usize,
    ack_timeout_s: f64,
    standby: Vec<String>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let report = py
        .detach(|| -> dcr_core::Result<_> {
            let bytes = std::fs::read(&delta).map_err(|e| Error::io("read", &delta, e))?;
            let parsed = dcr_core::delta::read_delta(&bytes)?;
            let (header, chunks, trailer) = split_frames(&bytes)?;
            let mut cfg = PublishConfig::new(to);
            cfg.key = key(key_file)?;
            cfg.standby = standby;
            let version = version.unwrap_or(parsed.header.target_version);
            let total: u64 = chunks.iter().map(|c| c.len() as u64).sum();
            let mut sent = 0u64;
            let frames = chunks.iter().map(move |c| {
                sent += c.len() as u64;
                report_progress(&progress, sent, total);
                bytes::Bytes::copy_from_slice(c)
            });
            net::publish_stream(
                cfg,
                version,
                bytes::Bytes::copy_from_slice(header),
                frames,
                bytes::Bytes::copy_from_slice(trailer),
                expect_acks,
                Duration::from_secs_f64(ack_timeout_s),
            )
        })
        .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("version", report.version)?;
    d.set_item("chunks", report.chunks)?;
    d.set_item("bytes", report.bytes)?;
    let committed = PyList::empty(py);
    for a in &report.acks.committed {
        committed.append((a.node_id.as_str(), digest_hex(&a.digest)))?;
    }
    let failed = PyList::empty(py);
    for a in &report.acks.failed {
        failed.append((a.node_id.as_str(), a.reason.as_str()))?;
    }
    d.set_item("committed", committed)?;
    d.set_item("failed", failed)?;
    d.set_item("all_committed", report.acks.all_committed())?;
    Ok(d)
}

/// Call `progress(done, total)` (bytes) with the GIL taken for the call only.
fn report_progress(progress: &Option<Py<PyAny>>, done: u64, total: u64) {
    if let Some(cb) = progress {
        Python::attach(|py| {
            if let Err(e) = cb.call1(py, (done, total)) {
                e.print(py);
            }
        });
    }
}

/// Receive one version from a relay tree (parents in failover order) into a
/// safetensors file, then report the verdict (digest, ok/failed) up the tree.
///
/// Journaled (the default): the delta is received whole, spooled beside the
/// journal and applied through it (`receiver::refit_received`), so a
/// receiver killed mid-apply finishes the version on its next call, from its
/// own disk (`resumed` in the result), before it subscribes again.
/// `journaled=False` applies the frames as they arrive and rolls back on any
/// failure it sees, but a killed process leaves the file partially applied.
#[pyfunction]
#[pyo3(signature = (target, parents, *, key_file=None, receiver_id=None, from_version=0, timeout_s=600.0, progress=None, journal=None, journaled=true, batch_chunks=256))]
#[allow(clippy::too_many_arguments)]
pub fn receive_delta<'py>(
    py: Python<'py>,
    target: PathBuf,
    parents: Vec<String>,
    key_file: Option<PathBuf>,
    receiver_id: Option<String>,
    from_version: u64,
    timeout_s: f64,
    progress: Option<Py<PyAny>>,
    journal: Option<PathBuf>,
    journaled: bool,
    batch_chunks: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let mut cfg = SubscribeConfig::new(parents);
    cfg.key = key(key_file).map_err(to_py)?;
    if let Some(id) = receiver_id {
        cfg.node_id = id;
    }
    cfg.from_version = from_version;
    cfg.timeout = Some(Duration::from_secs_f64(timeout_s));
    let received = py
        .detach(|| -> dcr_core::Result<Received> {
            if !journaled {
                return receive_streaming(&target, cfg, &progress);
            }
            let opts = receiver::RefitOptions { batch_chunks: batch_chunks.max(1), ..Default::default() };
            if let Some(done) = receiver::resume_received(&target, journal.as_deref(), &opts)? {
                return Ok(Received { outcome: refit_outcome(&done), resumed: true, version: refit_version(&done), failovers: 0, parent: None });
            }
            receive_journaled(&target, journal.as_deref(), cfg, &progress, &opts)
        })
        .map_err(to_py)?;
    let d = crate::outcome_dict(py, &received.outcome)?;
    d.set_item("version", received.version)?;
    d.set_item("failovers", received.failovers)?;
    d.set_item("parent", received.parent)?;
    d.set_item("resumed", received.resumed)?;
    d.set_item("journaled", journaled)?;
    Ok(d)
}

/// What one `receive_delta` call did.
struct Received {
    outcome: ApplyOutcome,
    /// A version an interrupted call had started was finished from its spool
    /// (no subscription, no acknowledgement: the tree has moved on).
    resumed: bool,
    version: u64,
    failovers: u32,
    parent: Option<String>,
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
    target: &std::path::Path,
    journal: Option<&std::path::Path>,
    cfg: SubscribeConfig,
    progress: &Option<Py<PyAny>>,
    opts: &receiver::RefitOptions,
) -> dcr_core::Result<Received> {
    // A delta for another model is refused at its header, before the rest
    // is received.
    let layout = dcr_core::checkpoint::ReadOnlyCheckpoint::open(target)?.layout().clone();
    let spool = std::cell::RefCell::new(receiver::ReceivedSpool::create(target, journal)?);
    let refused = std::cell::RefCell::new(None::<Error>);
    let keep = |r: dcr_core::Result<()>| {
        if let Err(e) = r {
            refused.borrow_mut().get_or_insert(e);
        }
    };
    let mut sub = net::subscribe(
        cfg,
        |_, header| {
            let checked = dcr_core::delta::parse_header_blob(header).and_then(|h| h.layout.ensure_same(&layout, "target checkpoint"));
            keep(checked.and_then(|()| spool.borrow_mut().append(header)));
            Ok(())
        },
        |_, seq, blob| {
            report_progress(progress, u64::from(seq) + 1, 0);
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
        Err(_) => dcr_core::checkpoint::ReadOnlyCheckpoint::open(target)?.checkpoint_digest(),
    };
    let (ok, reason) = match &outcome {
        Ok(_) => (true, String::new()),
        Err(e) => (false, e.to_string()),
    };
    let ack = sub.ack(digest, ok, &reason, Duration::from_secs(30));
    let outcome = outcome?;
    ack?;
    Ok(Received {
        outcome: refit_outcome(&outcome),
        resumed: false,
        version: sub.delivered.version,
        failovers: sub.delivered.failovers,
        parent: Some(sub.delivered.parent.clone()),
    })
}

/// Apply the frames as they arrive (not journaled), roll back on a failure.
fn receive_streaming(target: &std::path::Path, cfg: SubscribeConfig, progress: &Option<Py<PyAny>>) -> dcr_core::Result<Received> {
    let mut ck = WritableCheckpoint::open_rw(target)?;
    let layout = ck.layout().clone();
    let result = std::cell::RefCell::new(None::<dcr_core::Result<ApplyOutcome>>);
    let target_digest = std::cell::Cell::new(None::<dcr_core::checkpoint::Digest>);
    let outcome;
    let mut sub;
    {
        let applier = std::cell::RefCell::new(None::<StreamApplier<'_>>);
        let buffers = std::cell::RefCell::new(Some(ck.buffers_mut()));
        let received = net::subscribe(
            cfg,
            |_, header| {
                let views = buffers.borrow_mut().take().ok_or("a second header")?;
                if let Ok(h) = dcr_core::delta::parse_header_blob(header) {
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
                report_progress(progress, u64::from(seq) + 1, 0);
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
    Ok(Received {
        outcome,
        resumed: false,
        version: sub.delivered.version,
        failovers: sub.delivered.failovers,
        parent: Some(sub.delivered.parent.clone()),
    })
}

/// Run a relay with `dcr-relay` command-line arguments until SIGINT/SIGTERM;
/// returns its exit code.
#[pyfunction]
pub fn relay_main(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| dcr_relay::main_with_args(argv))
}
