//! Bindings of the relay-tree transport: publish a delta file to a root
//! relay, receive one into a safetensors file (journaled, or applied as
//! frames arrive),
//! and run a relay in this process.

use std::path::PathBuf;
use std::time::Duration;

use dcr_core::checkpoint::digest_hex;
use dcr_core::delta::split_frames;
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
/// Journaled (the default): the delta is spooled beside the journal as it
/// arrives and applied through it, so a receiver killed mid-apply finishes
/// the version on its next call, from its own disk (`resumed` in the
/// result), before it subscribes again. `journaled=False` applies the frames
/// as they arrive and rolls back on any failure it sees, but a killed
/// process leaves the file partially applied (`dcr_core::net::receive_file`).
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
    let mode = if journaled {
        net::ApplyMode::Journaled {
            journal,
            opts: receiver::RefitOptions { batch_chunks: batch_chunks.max(1), ..Default::default() },
        }
    } else {
        net::ApplyMode::Streaming
    };
    let received = py
        .detach(|| {
            // done = chunks received so far; the total is unknown until the end (0).
            net::receive_into_file(&target, cfg, &mode, &mut |seq| report_progress(&progress, u64::from(seq) + 1, 0))
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

/// Run a relay with `dcr-relay` command-line arguments until SIGINT/SIGTERM;
/// returns its exit code.
#[pyfunction]
pub fn relay_main(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| dcr_relay::main_with_args(argv))
}
