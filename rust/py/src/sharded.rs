//! Bindings for composing one delta from many trainer ranks
//! (`dcr.trainer.publisher`), and the streaming sinks a delta is written to
//! while it is built (a file, a relay tree, object storage).

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use dcr_core::checkpoint::{digest_hex, Digest};
use dcr_core::codec::{Mode, SparseChanges};
use dcr_core::digest::DigestMoves;
use dcr_core::dtype::DType;
use dcr_core::error::Error;
use dcr_core::format::{self, DeltaHeader};
use dcr_core::net::{BlockingPublisher, PublishConfig};
use dcr_core::relay::PreSharedKey;
use dcr_core::objstore;
use dcr_core::sharded::{self, AffineBlock};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::errors::to_py;
use crate::{layout_of, slices, Span};

fn digest_of(b: &[u8], what: &str) -> PyResult<Digest> {
    b.try_into().map_err(|_| pyo3::exceptions::PyValueError::new_err(format!("{what}: a digest is 16 bytes, got {}", b.len())))
}

fn u64s(b: &[u8], what: &str) -> PyResult<Vec<u64>> {
    if !b.len().is_multiple_of(8) {
        return Err(pyo3::exceptions::PyValueError::new_err(format!("{what}: {} bytes is not a whole number of uint64", b.len())));
    }
    Ok(b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
}

fn word_bytes(dtype: &str) -> PyResult<usize> {
    Ok(DType::from_name(dtype).map_err(to_py)?.word_bytes())
}

/// Digest contribution (16 bytes) of one block of a local tensor (a memory
/// span of the whole local tensor) placed by an affine map into canonical
/// coordinates.
#[pyfunction]
#[pyo3(signature = (local, dtype, local_offset, shape, canonical_offset, canonical_strides))]
pub fn block_digest<'py>(
    py: Python<'py>,
    local: Span,
    dtype: &str,
    local_offset: u64,
    shape: Vec<u64>,
    canonical_offset: u64,
    canonical_strides: Vec<u64>,
) -> PyResult<Bound<'py, PyBytes>> {
    let w = word_bytes(dtype)?;
    crate::check_spans(&[local], false)?;
    let block = AffineBlock { local_offset, shape, canonical_offset, canonical_strides };
    let spans = [local];
    let s = slices(&spans);
    let d = py.detach(|| sharded::block_digest(s[0], w, &block)).map_err(to_py)?;
    Ok(PyBytes::new(py, &d.digest()))
}

/// How a tensor's digest moves (16 bytes, lane sums) when the words at
/// canonical element indices `elements` change from `old` to `new` (all
/// little-endian uint64 arrays as bytes).
#[pyfunction]
pub fn moved_digest<'py>(py: Python<'py>, dtype: &str, elements: &[u8], old: &[u8], new: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let w = word_bytes(dtype)?;
    let (e, o, n) = (u64s(elements, "elements")?, u64s(old, "old")?, u64s(new, "new")?);
    if e.len() != o.len() || e.len() != n.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!("{} elements, {} old and {} new words", e.len(), o.len(), n.len())));
    }
    let d = py.detach(|| {
        let mut moves = DigestMoves::new(w);
        for ((&element, &old), &new) in e.iter().zip(&o).zip(&n) {
            moves.word(element, old, new);
        }
        moves.finish()
    });
    Ok(PyBytes::new(py, &d.digest()))
}

/// Scan a run of a local tensor against its baseline and project the
/// changes into canonical coordinates through the pieces (parallel lists,
/// sorted by local offset). Returns (records: packed little-endian
/// (tensor u32, element u64, xor u64) per exported change, digest moves as
/// [(tensor, 16 bytes)], local positions uint32 LE, local XOR words uint64 LE).
#[pyfunction]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn scan_and_project<'py>(
    py: Python<'py>,
    old: Span,
    new: Span,
    dtype: &str,
    first_local: u64,
    tensors: Vec<u32>,
    local_offsets: Vec<u64>,
    shapes: Vec<Vec<u64>>,
    canonical_offsets: Vec<u64>,
    canonical_strides: Vec<Vec<u64>>,
) -> PyResult<(Bound<'py, PyBytes>, Vec<(u32, Bound<'py, PyBytes>)>, Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
    let w = word_bytes(dtype)?;
    let n = tensors.len();
    if [local_offsets.len(), shapes.len(), canonical_offsets.len(), canonical_strides.len()].iter().any(|&l| l != n) {
        return Err(pyo3::exceptions::PyValueError::new_err("piece lists must have the same length"));
    }
    if old.1 != new.1 {
        return Err(pyo3::exceptions::PyValueError::new_err(format!("old has {} bytes, new {}", old.1, new.1)));
    }
    crate::check_spans(&[old, new], false)?;
    let pieces: Vec<sharded::Piece> = (0..n)
        .map(|i| sharded::Piece {
            tensor: tensors[i],
            block: AffineBlock {
                local_offset: local_offsets[i],
                shape: shapes[i].clone(),
                canonical_offset: canonical_offsets[i],
                canonical_strides: canonical_strides[i].clone(),
            },
        })
        .collect();
    let spans = [old, new];
    let s = slices(&spans);
    let (records, local_pos, local_xor, moved) = py
        .detach(|| -> dcr_core::Result<_> {
            let pc = sharded::scan_and_project(s[0], s[1], w, first_local, &pieces)?;
            let mut rec = Vec::with_capacity(pc.tensor.len() * 20);
            for ((t, e), x) in pc.tensor.iter().zip(&pc.element).zip(&pc.xor) {
                rec.extend_from_slice(&t.to_le_bytes());
                rec.extend_from_slice(&e.to_le_bytes());
                rec.extend_from_slice(&x.to_le_bytes());
            }
            let pos: Vec<u8> = pc.local.positions.iter().flat_map(|p| p.to_le_bytes()).collect();
            let xor: Vec<u8> = pc.local.values.iter().flat_map(|v| v.to_le_bytes()).collect();
            Ok((rec, pos, xor, pc.moved))
        })
        .map_err(to_py)?;
    let moved = moved.into_iter().map(|(t, d)| (t, PyBytes::new(py, &d.digest()))).collect();
    Ok((PyBytes::new(py, &records), moved, PyBytes::new(py, &local_pos), PyBytes::new(py, &local_xor)))
}

/// Sort packed change records (the concatenation of `parts`, see
/// `scan_and_project`; spans of byte buffers the caller keeps alive) by
/// (global chunk id, element); returns the sorted records and their chunk
/// ids (uint64 LE).
#[pyfunction]
pub fn sort_records<'py>(
    py: Python<'py>,
    parts: Vec<Span>,
    chunk_words: Vec<u64>,
    first_chunk: Vec<u64>,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
    crate::check_spans(&parts, false)?;
    let views = slices(&parts);
    let (sorted, gids) = py.detach(|| sharded::sort_records(&views, &chunk_words, &first_chunk)).map_err(to_py)?;
    let g: Vec<u8> = gids.iter().flat_map(|g| g.to_le_bytes()).collect();
    Ok((PyBytes::new(py, &sorted), PyBytes::new(py, &g)))
}

/// XOR changes from packed `positions` (uint32 LE) and `xor` (uint64 LE words).
fn changes_of(positions: &[u8], xor: &[u8]) -> PyResult<SparseChanges> {
    if !positions.len().is_multiple_of(4) {
        return Err(pyo3::exceptions::PyValueError::new_err("positions: not a whole number of uint32"));
    }
    Ok(SparseChanges {
        positions: positions.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect(),
        values: u64s(xor, "xor")?,
    })
}

/// The header of a delta composed from many ranks' changes, and the frames
/// built against it.
#[pyclass(module = "dcr._core", frozen)]
pub struct ComposedDelta {
    header: DeltaHeader,
    blob: Vec<u8>,
    target_digests: Vec<Digest>,
    mode: Mode,
}

#[pymethods]
impl ComposedDelta {
    /// `names` must be in canonical (sorted) order; digests per tensor.
    #[new]
    #[pyo3(signature = (names, dtypes, shapes, base_digests, target_digests, *, chunk_bytes, base_version, target_version, mode="free"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        names: Vec<String>,
        dtypes: Vec<String>,
        shapes: Vec<Vec<u64>>,
        base_digests: Vec<Vec<u8>>,
        target_digests: Vec<Vec<u8>>,
        chunk_bytes: u32,
        base_version: u64,
        target_version: u64,
        mode: &str,
    ) -> PyResult<Self> {
        let mode = crate::parse_mode(mode)?;
        let (layout, order) = layout_of(names, dtypes, shapes)?;
        if order.iter().enumerate().any(|(i, &o)| i != o) {
            return Err(pyo3::exceptions::PyValueError::new_err("tensor names must be given in canonical (sorted) order"));
        }
        let base = base_digests.iter().map(|d| digest_of(d, "base digest")).collect::<PyResult<Vec<_>>>()?;
        let target = target_digests.iter().map(|d| digest_of(d, "target digest")).collect::<PyResult<Vec<_>>>()?;
        let (blob, header) =
            sharded::header_blob(&layout, &base, &target, chunk_bytes, base_version, target_version, mode).map_err(to_py)?;
        Ok(ComposedDelta { header, blob, target_digests: target, mode })
    }

    /// Preamble and header frame.
    fn header_blob<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.blob)
    }

    #[getter]
    fn base_digest(&self) -> String {
        digest_hex(&self.header.base_digest)
    }

    #[getter]
    fn target_digest(&self) -> String {
        digest_hex(&self.header.target_digest)
    }

    #[getter]
    fn delta_id(&self) -> String {
        digest_hex(&self.header.delta_id)
    }

    /// Words per chunk of tensor `tensor` (its index in canonical order).
    fn chunk_words(&self, tensor: usize) -> PyResult<u64> {
        let spec = self
            .header
            .layout
            .tensors()
            .get(tensor)
            .ok_or_else(|| pyo3::exceptions::PyIndexError::new_err(format!("tensor index {tensor} out of range")))?;
        Ok(self.header.chunk_words(spec))
    }

    /// The frame of one chunk from its XOR changes: `positions` (uint32 LE,
    /// relative to the chunk start, ascending) and `xor` (uint64 LE words).
    #[pyo3(signature = (seq, tensor, start, positions, xor, *, zstd_level=1))]
    #[allow(clippy::too_many_arguments)]
    fn chunk_frame<'py>(
        &self,
        py: Python<'py>,
        seq: u32,
        tensor: u32,
        start: u64,
        positions: &[u8],
        xor: &[u8],
        zstd_level: i32,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let changes = changes_of(positions, xor)?;
        let frame = py.detach(|| sharded::chunk_frame(&self.header, seq, tensor, start, changes, zstd_level)).map_err(to_py)?;
        Ok(PyBytes::new(py, &frame))
    }

    /// The frame of a chunk whose whole canonical base this rank holds
    /// (`base`: a (pointer, byte length) span of it), from its XOR changes:
    /// context-coded when smaller, as `diff(..., mode="context")` builds it.
    /// Only for a delta composed in the context mode.
    #[pyo3(signature = (seq, tensor, start, base, positions, xor, *, zstd_level=1))]
    #[allow(clippy::too_many_arguments)]
    fn context_chunk_frame<'py>(
        &self,
        py: Python<'py>,
        seq: u32,
        tensor: u32,
        start: u64,
        base: Span,
        positions: &[u8],
        xor: &[u8],
        zstd_level: i32,
    ) -> PyResult<Bound<'py, PyBytes>> {
        if self.mode != Mode::Context {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "context_chunk_frame needs a delta composed with mode=\"context\" (its id binds the mode)",
            ));
        }
        let spans = [base];
        crate::check_spans(&spans, false)?;
        let changes = changes_of(positions, xor)?;
        let views = slices(&spans);
        let frame = py
            .detach(|| sharded::context_chunk_frame(&self.header, seq, tensor, start, views[0], changes, zstd_level))
            .map_err(to_py)?;
        Ok(PyBytes::new(py, &frame))
    }

    fn trailer_frame<'py>(&self, py: Python<'py>, n_chunks: u32, n_changed: u64) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &sharded::trailer_frame(&self.header, n_chunks, n_changed, &self.target_digests))
    }
}

enum Dest {
    File { path: PathBuf, partial: PathBuf, file: std::fs::File },
    Relay { cfg: Box<PublishConfig>, version: u64, publisher: Option<BlockingPublisher>, expect_acks: usize, ack_timeout: Duration },
    Objstore { publisher: Box<objstore::Publisher> },
    Done,
}

/// Where a delta goes while it is built. Write the preamble + header blob
/// first, then each frame, the trailer last; `finish()` completes the
/// transfer (renames the file into place, waits for relay acks, commits the
/// object-storage manifest) and returns a report.
#[pyclass(module = "dcr._core")]
pub struct DeltaSink {
    dest: Dest,
    bytes: u64,
    frames: u32,
    trailer_seen: bool,
}

#[pymethods]
impl DeltaSink {
    /// Write to `path` (through `path.partial`, fsynced and renamed at finish).
    #[staticmethod]
    fn file(path: PathBuf) -> PyResult<Self> {
        let mut partial = path.clone().into_os_string();
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        let file = std::fs::File::create(&partial).map_err(|e| to_py(Error::io("create", &partial, e)))?;
        Ok(DeltaSink { dest: Dest::File { path, partial, file }, bytes: 0, frames: 0, trailer_seen: false })
    }

    /// Publish to a root relay (HOST:PORT) as version `version`.
    #[staticmethod]
    #[pyo3(signature = (to, version, *, key_file=None, standby=Vec::new(), expect_acks=0, ack_timeout_s=120.0))]
    fn relay(to: String, version: u64, key_file: Option<PathBuf>, standby: Vec<String>, expect_acks: usize, ack_timeout_s: f64) -> PyResult<Self> {
        let mut cfg = PublishConfig::new(to);
        cfg.key = key_file.map(PreSharedKey::from_file).transpose().map_err(to_py)?;
        cfg.standby = standby;
        Ok(DeltaSink {
            dest: Dest::Relay { cfg: Box::new(cfg), version, publisher: None, expect_acks, ack_timeout: Duration::from_secs_f64(ack_timeout_s) },
            bytes: 0,
            frames: 0,
            trailer_seen: false,
        })
    }

    /// Publish to object storage (s3://, gs://, az://, file:// URL) as
    /// version `version` (default: the newest committed + 1).
    #[staticmethod]
    #[pyo3(signature = (url, *, version=None, concurrency=objstore::DEFAULT_CONCURRENCY))]
    fn object_store(py: Python<'_>, url: String, version: Option<u64>, concurrency: usize) -> PyResult<Self> {
        let opts = objstore::PublishOptions { version, concurrency, ..Default::default() };
        let publisher = py
            .detach(|| {
                let store = objstore::Store::open(&url)?;
                objstore::Publisher::begin(&store, opts)
            })
            .map_err(to_py)?;
        Ok(DeltaSink { dest: Dest::Objstore { publisher: Box::new(publisher) }, bytes: 0, frames: 0, trailer_seen: false })
    }

    /// Write the next blob: the preamble + header first, then whole frames.
    fn write(&mut self, py: Python<'_>, blob: &[u8]) -> PyResult<()> {
        if self.trailer_seen {
            return Err(pyo3::exceptions::PyRuntimeError::new_err("the delta's trailer was already written; call finish()"));
        }
        let first = self.frames == 0;
        if first && format::parse_preamble(blob).map_err(to_py)?.is_none() {
            return Err(pyo3::exceptions::PyValueError::new_err("the first blob must be the preamble and header frame"));
        }
        let is_trailer = !first && blob.first() == Some(&format::TAG_TRAILER);
        py.detach(|| -> dcr_core::Result<()> {
            match &mut self.dest {
                Dest::File { partial, file, .. } => file.write_all(blob).map_err(|e| Error::io("write", &*partial, e)),
                Dest::Relay { cfg, version, publisher, .. } => {
                    if first {
                        *publisher = Some(BlockingPublisher::connect((**cfg).clone(), *version, bytes::Bytes::copy_from_slice(blob))?);
                        return Ok(());
                    }
                    let p = publisher.as_mut().ok_or(Error::Closed("publisher"))?;
                    if is_trailer {
                        p.finish(bytes::Bytes::copy_from_slice(blob)).map(|_| ())
                    } else {
                        p.send(bytes::Bytes::copy_from_slice(blob)).map(|_| ())
                    }
                }
                Dest::Objstore { publisher } => publisher.push(blob),
                Dest::Done => Err(Error::Closed("delta sink")),
            }
        })
        .map_err(to_py)?;
        self.bytes += blob.len() as u64;
        self.frames += 1;
        self.trailer_seen = is_trailer;
        Ok(())
    }

    /// Complete the transfer; returns a report (dict).
    fn finish<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        if !self.trailer_seen {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
                "finish() before the trailer: {} blobs written; write the trailer frame first (or abort())",
                self.frames
            )));
        }
        let dest = std::mem::replace(&mut self.dest, Dest::Done);
        let d = PyDict::new(py);
        d.set_item("bytes", self.bytes)?;
        d.set_item("frames", self.frames)?;
        match dest {
            Dest::File { path, partial, file } => {
                py.detach(|| -> dcr_core::Result<()> {
                    file.sync_all().map_err(|e| Error::io("fsync", &partial, e))?;
                    drop(file);
                    std::fs::rename(&partial, &path).map_err(|e| Error::io("rename", &path, e))?;
                    if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                        std::fs::File::open(dir).and_then(|f| f.sync_all()).map_err(|e| Error::io("fsync", dir, e))?;
                    }
                    Ok(())
                })
                .map_err(to_py)?;
                d.set_item("path", path)?;
            }
            Dest::Relay { version, mut publisher, expect_acks, ack_timeout, .. } => {
                let p = publisher.as_mut().ok_or_else(|| to_py(Error::Closed("publisher")))?;
                let acks = if expect_acks > 0 { Some(py.detach(|| p.wait_acks(expect_acks, ack_timeout)).map_err(to_py)?) } else { None };
                d.set_item("version", version)?;
                if let Some(a) = acks {
                    let committed = PyList::empty(py);
                    for x in &a.committed {
                        committed.append((x.node_id.as_str(), digest_hex(&x.digest)))?;
                    }
                    let failed = PyList::empty(py);
                    for x in &a.failed {
                        failed.append((x.node_id.as_str(), x.reason.as_str()))?;
                    }
                    d.set_item("all_committed", a.all_committed())?;
                    d.set_item("committed", committed)?;
                    d.set_item("failed", failed)?;
                }
                py.detach(move || drop(publisher));
            }
            Dest::Objstore { publisher } => {
                let s = py.detach(move || publisher.finish()).map_err(to_py)?;
                d.set_item("version", s.version)?;
                d.set_item("committed", s.committed)?;
                d.set_item("objects", s.objects)?;
            }
            Dest::Done => return Err(to_py(Error::Closed("delta sink"))),
        }
        Ok(d)
    }

    /// Give up: remove a partial file, close a relay stream without its
    /// trailer (receivers roll back), leave object storage uncommitted.
    fn abort(&mut self, py: Python<'_>) {
        let dest = std::mem::replace(&mut self.dest, Dest::Done);
        py.detach(move || match dest {
            Dest::File { partial, file, .. } => {
                drop(file);
                let _ = std::fs::remove_file(partial);
            }
            other => drop(other),
        });
    }
}
