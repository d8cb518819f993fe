//! Thin Python bindings of dcr-core (module `dcr._core`). Every long call
//! releases the GIL; buffers are borrowed zero-copy through the buffer
//! protocol.
#![deny(unsafe_code)]

mod errors;
mod sharded;
mod tensors;
mod transport;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use dcr_core::checkpoint::{digest_hex, Layout, TensorSpec};
use dcr_core::codec::{self, ChangeKind, Mode, SparseChanges};
use dcr_core::delta::{self, ApplyOutcome, DeltaStats, DiffOptions};
use dcr_core::dtype::DType;
use dcr_core::files;
use dcr_core::objstore;
use dcr_core::receiver;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use pyo3::intern;

use errors::to_py;

/// Rayon pools by thread count, built once.
fn pool(threads: Option<usize>) -> PyResult<std::sync::Arc<rayon::ThreadPool>> {
    static POOLS: OnceLock<Mutex<HashMap<usize, std::sync::Arc<rayon::ThreadPool>>>> = OnceLock::new();
    let n = threads.unwrap_or(0);
    let mut pools = POOLS.get_or_init(Default::default).lock().expect("pool registry");
    if let Some(p) = pools.get(&n) {
        return Ok(p.clone());
    }
    let p = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("dcr-{i}"))
        .build()
        .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(format!("cannot start {n} worker threads: {e}")))?;
    let p = std::sync::Arc::new(p);
    pools.insert(n, p.clone());
    Ok(p)
}

/// Run `f` with the GIL released: on the calling thread alone when one
/// thread is asked for (no hand-off to a pool thread; `f` must run its
/// parallel loops through `dcr_core::exec`), else on a pool of `threads`
/// (all cores when `None`).
fn run_detached<R: Send>(py: Python<'_>, threads: Option<usize>, f: impl FnOnce() -> R + Send) -> PyResult<R> {
    if threads == Some(1) {
        return Ok(py.detach(|| dcr_core::exec::on_this_thread(f)));
    }
    let pool = pool(threads)?;
    Ok(py.detach(|| pool.install(f)))
}

fn parse_kind(kind: &str) -> PyResult<ChangeKind> {
    match kind {
        "xor" => Ok(ChangeKind::Xor),
        "overwrite" => Ok(ChangeKind::Overwrite),
        other => Err(pyo3::exceptions::PyValueError::new_err(format!("kind must be 'xor' or 'overwrite', got {other:?}"))),
    }
}

fn parse_mode(mode: &str) -> PyResult<Mode> {
    match mode {
        "free" => Ok(Mode::Free),
        "context" => Ok(Mode::Context),
        other => Err(pyo3::exceptions::PyValueError::new_err(format!("mode must be 'free' or 'context', got {other:?}"))),
    }
}

/// Progress callback called at most every few percent, with the GIL taken
/// only for the call.
fn progress_fn(cb: Option<Py<PyAny>>) -> impl FnMut(u64, u64) {
    let mut last = 0u64;
    move |done, total| {
        if let Some(cb) = &cb {
            if done == total || done.saturating_sub(last) >= total / 100 {
                last = done;
                Python::attach(|py| {
                    if let Err(e) = cb.call1(py, (done, total)) {
                        e.print(py);
                    }
                });
            }
        }
    }
}

fn stats_dict<'py>(py: Python<'py>, s: &DeltaStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item(intern!(py, "base_digest"), digest_hex(&s.base_digest))?;
    d.set_item(intern!(py, "target_digest"), digest_hex(&s.target_digest))?;
    d.set_item(intern!(py, "base_version"), s.base_version)?;
    d.set_item(intern!(py, "target_version"), s.target_version)?;
    d.set_item(intern!(py, "total_elements"), s.total_words)?;
    d.set_item(intern!(py, "checkpoint_bytes"), s.total_bytes)?;
    d.set_item(intern!(py, "changed_elements"), s.changed)?;
    d.set_item(intern!(py, "chunks"), s.chunks)?;
    d.set_item(intern!(py, "payload_bytes"), s.delta_bytes)?;
    d.set_item(intern!(py, "bytes_per_changed"), if s.changed > 0 { s.delta_bytes as f64 / s.changed as f64 } else { 0.0 })?;
    d.set_item(intern!(py, "change_rate"), if s.total_words > 0 { s.changed as f64 / s.total_words as f64 } else { 0.0 })?;
    let enc = PyDict::new(py);
    for (i, encoding) in dcr_core::codec::ENCODINGS.iter().enumerate() {
        enc.set_item(encoding.name(), s.encodings[i])?;
    }
    d.set_item(intern!(py, "encodings"), enc)?;
    let modes = PyDict::new(py);
    modes.set_item(intern!(py, "free"), s.modes[Mode::Free as usize])?;
    modes.set_item(intern!(py, "context"), s.modes[Mode::Context as usize])?;
    d.set_item(intern!(py, "modes"), modes)?;
    let per = PyList::empty(py);
    for t in &s.per_tensor {
        let td = PyDict::new(py);
        td.set_item(intern!(py, "name"), &t.name)?;
        td.set_item(intern!(py, "elements"), t.words)?;
        td.set_item(intern!(py, "changed_elements"), t.changed)?;
        td.set_item(intern!(py, "chunks"), t.chunks)?;
        td.set_item(intern!(py, "payload_bytes"), t.payload_bytes)?;
        per.append(td)?;
    }
    d.set_item(intern!(py, "tensors"), per)?;
    Ok(d)
}

pub(crate) fn outcome_dict<'py>(py: Python<'py>, o: &ApplyOutcome) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    match o {
        ApplyOutcome::Applied { chunks, changed } => {
            d.set_item("outcome", "applied")?;
            d.set_item("chunks", chunks)?;
            d.set_item("changed_elements", changed)?;
        }
        ApplyOutcome::AlreadyAtTarget => {
            d.set_item("outcome", "already_at_target")?;
            d.set_item("chunks", 0)?;
            d.set_item("changed_elements", 0)?;
        }
    }
    Ok(d)
}

/// Diff two checkpoints (safetensors files, or directories of shards) into a
/// delta file (written atomically).
#[pyfunction]
#[pyo3(signature = (old, new, out, *, chunk_bytes=delta::DEFAULT_CHUNK_BYTES, kind="xor", zstd_level=1, mode="free", base_version=0, target_version=1, dense=false, threads=None, progress=None))]
#[allow(clippy::too_many_arguments)]
fn diff_files<'py>(
    py: Python<'py>,
    old: PathBuf,
    new: PathBuf,
    out: PathBuf,
    chunk_bytes: u32,
    kind: &str,
    zstd_level: i32,
    mode: &str,
    base_version: u64,
    target_version: u64,
    dense: bool,
    threads: Option<usize>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = DiffOptions { chunk_bytes, kind: parse_kind(kind)?, zstd_level, mode: parse_mode(mode)?, base_version, target_version, dense, ..Default::default() };
    let pool = pool(threads)?;
    let mut cb = progress_fn(progress);
    let stats = py.detach(|| pool.install(|| files::diff_files(&old, &new, &out, &opts, &mut cb))).map_err(to_py)?;
    stats_dict(py, &stats)
}

/// Apply a delta file in place to a checkpoint (a safetensors file, or every
/// shard of a directory).
#[pyfunction]
#[pyo3(signature = (delta, target, *, threads=None))]
fn apply_file<'py>(py: Python<'py>, delta: PathBuf, target: PathBuf, threads: Option<usize>) -> PyResult<Bound<'py, PyDict>> {
    let pool = pool(threads)?;
    let outcome = py.detach(|| pool.install(|| files::apply_file(&delta, &target))).map_err(to_py)?;
    outcome_dict(py, &outcome)
}

/// Names of the tensors whose stored bits differ between two checkpoints
/// (files or shard directories, sharded alike or not).
#[pyfunction]
fn compare_files(py: Python<'_>, a: PathBuf, b: PathBuf) -> PyResult<Vec<String>> {
    py.detach(|| files::compare_files(&a, &b)).map_err(to_py)
}

/// Validate a delta file and summarise it.
#[pyfunction]
fn inspect_file<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let (delta, stats) = py.detach(|| files::inspect_file(&path)).map_err(to_py)?;
    let d = stats_dict(py, &stats)?;
    d.set_item("delta_id", digest_hex(&delta.header.delta_id))?;
    d.set_item("chunk_bytes", delta.header.chunk_bytes)?;
    d.set_item("format_version", dcr_core::format::FORMAT_VERSION)?;
    let kinds: Vec<&str> = delta.chunks.iter().map(|c| c.kind.name()).collect();
    d.set_item("kind", kinds.first().copied().unwrap_or("xor"))?;
    // A context-mode delta may code some chunks context-free (when that is
    // smaller); it reads as context as soon as one chunk is.
    let mode = if stats.modes[Mode::Context as usize] > 0 { Mode::Context } else { Mode::Free };
    d.set_item("mode", mode.name())?;
    Ok(d)
}

/// Checkpoint digest of a safetensors file or a directory of shards (hex).
#[pyfunction]
fn file_digest(py: Python<'_>, path: PathBuf) -> PyResult<String> {
    py.detach(|| {
        let ck = dcr_core::checkpoint::ReadOnlyCheckpoint::open(&path)?;
        Ok(digest_hex(&ck.checkpoint_digest()))
    })
    .map_err(to_py)
}

/// The safetensors files a checkpoint path names: the file itself, the
/// shards an index lists, or a directory's index's shards (else all its
/// `.safetensors` files), as `dcr diff` / `apply` read them.
#[pyfunction]
fn checkpoint_files(path: PathBuf) -> PyResult<Vec<PathBuf>> {
    Ok(dcr_core::checkpoint::checkpoint_files(&path).map_err(to_py)?.files)
}

// ------------------------------------------------------------ buffers

/// Raw memory spans handed over by the Python layer (`dcr._buffers`), which
/// takes them from numpy arrays or torch tensors, checks contiguity and
/// keeps the owners alive for the duration of the call. (The buffer protocol
/// is not in the stable ABI before CPython 3.11, and this wheel serves 3.10.)
pub(crate) type Span = (usize, usize);

fn check_spans(spans: &[Span], writable: bool) -> PyResult<()> {
    if spans.iter().any(|&(p, n)| n > 0 && p == 0) {
        return Err(pyo3::exceptions::PyValueError::new_err("null data pointer for a non-empty tensor"));
    }
    if writable {
        let mut s: Vec<Span> = spans.iter().copied().filter(|&(_, n)| n > 0).collect();
        s.sort();
        if s.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
            return Err(pyo3::exceptions::PyValueError::new_err("two target tensors share memory; pass distinct tensors"));
        }
    }
    Ok(())
}

fn slices(spans: &[Span]) -> Vec<&[u8]> {
    spans
        .iter()
        .map(|&(p, n)| {
            if n == 0 {
                return &[][..];
            }
            // Safety: `dcr._buffers` passes the data pointer and byte length of
            // a live, C-contiguous CPU array that it keeps referenced until
            // this call returns; the slices never escape the call.
            #[allow(unsafe_code)]
            unsafe {
                std::slice::from_raw_parts(p as *const u8, n)
            }
        })
        .collect()
}

// The spans are raw pointers into Python-owned memory, not borrows of
// `spans`: the lifetime only keeps the slices inside the call.
#[allow(clippy::mut_from_ref)]
fn slices_mut(spans: &[Span]) -> Vec<&mut [u8]> {
    spans
        .iter()
        .map(|&(p, n)| {
            if n == 0 {
                return &mut [][..];
            }
            // Safety: as in `slices`, plus the arrays are writable and were
            // checked pairwise disjoint by `check_spans`.
            #[allow(unsafe_code)]
            unsafe {
                std::slice::from_raw_parts_mut(p as *mut u8, n)
            }
        })
        .collect()
}

fn layout_of(names: Vec<String>, dtypes: Vec<String>, shapes: Vec<Vec<u64>>) -> PyResult<(Layout, Vec<usize>)> {
    if names.len() != dtypes.len() || names.len() != shapes.len() {
        return Err(pyo3::exceptions::PyValueError::new_err("names, dtypes and shapes must have the same length"));
    }
    let specs = names
        .into_iter()
        .zip(dtypes)
        .zip(shapes)
        .map(|((name, dtype), shape)| Ok(TensorSpec { name, dtype: DType::from_name(&dtype).map_err(to_py)?, shape }))
        .collect::<PyResult<Vec<_>>>()?;
    layout_of_specs(specs)
}

/// The canonical layout of tensors given in the caller's order, and that
/// order: `order[k]` is the caller's index of the layout's tensor `k`.
fn layout_of_specs(specs: Vec<TensorSpec>) -> PyResult<(Layout, Vec<usize>)> {
    let mut order: Vec<usize> = (0..specs.len()).collect();
    order.sort_by(|&a, &b| specs[a].name.cmp(&specs[b].name));
    let layout = Layout::new(specs).map_err(to_py)?;
    Ok((layout, order))
}

/// A described state dict's layout, its order (see `layout_of_specs`) and
/// the base digests the caller holds for it, in the layout's order.
fn layout_and_digests(sd: &mut tensors::StateDict<'_>, base_digests: Option<&Bound<'_, PyAny>>) -> PyResult<(Layout, Vec<usize>, Option<Vec<dcr_core::checkpoint::Digest>>)> {
    let (layout, order) = layout_of_specs(std::mem::take(&mut sd.specs))?;
    let known = match base_digests {
        Some(d) => {
            let given = tensors::digests_for(d, &sd.names)?;
            Some(order.iter().map(|&i| given[i]).collect())
        }
        None => None,
    };
    Ok((layout, order, known))
}

/// Diff two state dicts (names to CPU torch tensors or numpy arrays) into
/// delta bytes.
#[pyfunction]
#[pyo3(signature = (old, new, *, chunk_bytes=delta::DEFAULT_CHUNK_BYTES, kind="xor", zstd_level=1, mode="free", base_version=0, target_version=1, threads=None, base_digests=None))]
#[allow(clippy::too_many_arguments)]
fn diff_tensors<'py>(
    py: Python<'py>,
    old: &Bound<'py, PyAny>,
    new: &Bound<'py, PyAny>,
    chunk_bytes: u32,
    kind: &str,
    zstd_level: i32,
    mode: &str,
    base_version: u64,
    target_version: u64,
    threads: Option<usize>,
    base_digests: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyDict>)> {
    let opts = DiffOptions { chunk_bytes, kind: parse_kind(kind)?, zstd_level, mode: parse_mode(mode)?, base_version, target_version, dense: false, ..Default::default() };
    let mut olds = tensors::describe(old, false)?;
    let (new_spans, _new_owners) = tensors::spans_like(new, &olds)?;
    let (layout, order, known) = layout_and_digests(&mut olds, base_digests)?;
    check_spans(&olds.spans, false)?;
    check_spans(&new_spans, false)?;
    let (o, n) = (slices(&olds.spans), slices(&new_spans));
    let o: Vec<&[u8]> = order.iter().map(|&i| o[i]).collect();
    let n: Vec<&[u8]> = order.iter().map(|&i| n[i]).collect();
    let (bytes, stats) = run_detached(py, threads, || {
        let out = std::cell::RefCell::new(DeltaBytes::Growing(Vec::new()));
        let s = delta::diff_from_announced(&layout, &o, &n, known.as_deref(), &opts, &mut |len| out.borrow_mut().announce(len), &mut |b| out.borrow_mut().put(b), &mut |_, _| {})?;
        Ok((out.into_inner(), s))
    })?
    .map_err(to_py)?;
    Ok((bytes.finish(py)?, stats_dict(py, &stats)?))
}

/// Where `diff_tensors` writes a delta: straight into the Python `bytes`
/// it returns where the diff announces the delta's length first (a copy
/// of the delta less), else into a buffer copied into one at the end.
enum DeltaBytes {
    Growing(Vec<u8>),
    InPlace { bytes: Py<PyBytes>, at: usize, len: usize },
}

impl DeltaBytes {
    fn announce(&mut self, len: u64) -> dcr_core::Result<()> {
        let len = usize::try_from(len).map_err(|_| dcr_core::Error::Invalid(format!("a delta of {len} bytes does not fit in memory")))?;
        let bytes = Python::attach(|py| -> PyResult<Py<PyBytes>> {
            let size = pyo3::ffi::Py_ssize_t::try_from(len).map_err(|_| pyo3::exceptions::PyMemoryError::new_err(format!("{len} bytes")))?;
            // Safety: a null source asks for a new bytes object of `size`
            // uninitialised bytes (`finish` hands it out only once they
            // have all been written).
            #[allow(unsafe_code)]
            let obj = unsafe { Bound::from_owned_ptr_or_err(py, pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), size))? };
            Ok(obj.cast_into::<PyBytes>()?.unbind())
        })
        .map_err(|e| dcr_core::Error::Invalid(format!("cannot make room for the delta: {e}")))?;
        *self = DeltaBytes::InPlace { bytes, at: 0, len };
        Ok(())
    }

    fn put(&mut self, b: &[u8]) -> dcr_core::Result<()> {
        match self {
            DeltaBytes::Growing(v) => v.extend_from_slice(b),
            DeltaBytes::InPlace { bytes, at, len } => {
                if b.len() > *len - *at {
                    return Err(dcr_core::Error::Invalid(format!("the delta outgrew the {len} bytes announced")));
                }
                // Safety: the object is this writer's alone until `finish`
                // (no other reference exists, so no other thread reads it
                // while the GIL is released), and `at + b.len() <= len`,
                // its size.
                #[allow(unsafe_code)]
                unsafe {
                    let dst = pyo3::ffi::PyBytes_AsString(bytes.as_ptr()).cast::<u8>().add(*at);
                    std::ptr::copy_nonoverlapping(b.as_ptr(), dst, b.len());
                }
                *at += b.len();
            }
        }
        Ok(())
    }

    fn finish(self, py: Python<'_>) -> PyResult<Bound<'_, PyBytes>> {
        match self {
            DeltaBytes::Growing(v) => Ok(PyBytes::new(py, &v)),
            DeltaBytes::InPlace { bytes, at, len } if at == len => Ok(bytes.into_bound(py)),
            DeltaBytes::InPlace { at, len, .. } => Err(pyo3::exceptions::PyRuntimeError::new_err(format!("the delta came to {at} bytes, not the {len} announced"))),
        }
    }
}

/// Apply delta bytes in place to a state dict of writable tensors.
#[pyfunction]
#[pyo3(signature = (delta, tensors, *, threads=None, base_digests=None))]
fn apply_tensors<'py>(
    py: Python<'py>,
    delta: &[u8],
    tensors: &Bound<'py, PyAny>,
    threads: Option<usize>,
    base_digests: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let mut targets = tensors::describe(tensors, true)?;
    let (layout, order, known) = layout_and_digests(&mut targets, base_digests)?;
    check_spans(&targets.spans, true)?;
    let d = delta;
    let mut t = slices_mut(&targets.spans);
    let mut sorted: Vec<&mut [u8]> = Vec::with_capacity(t.len());
    let mut slots: Vec<Option<&mut [u8]>> = t.drain(..).map(Some).collect();
    for &i in &order {
        sorted.push(slots[i].take().expect("each index once"));
    }
    let outcome = run_detached(py, threads, || delta::apply_from(&delta::read_delta(d)?, &layout, &mut sorted, known.as_deref()))?
        .map_err(to_py)?;
    outcome_dict(py, &outcome)
}

/// A state dict's layout, its order (see `layout_of_specs`) and its
/// tensors' bytes in the layout's order, each checked against its size.
struct SortedTensors<'a> {
    layout: Layout,
    order: Vec<usize>,
    bytes: Vec<&'a [u8]>,
}

fn sorted_slices<'a>(sd: &'a mut tensors::StateDict<'_>) -> PyResult<SortedTensors<'a>> {
    let (layout, order) = layout_of_specs(std::mem::take(&mut sd.specs))?;
    check_spans(&sd.spans, false)?;
    let s = slices(&sd.spans);
    let bytes: Vec<&[u8]> = order.iter().map(|&i| s[i]).collect();
    layout.check_buffers(bytes.iter().map(|b| b.len())).map_err(to_py)?;
    Ok(SortedTensors { layout, order, bytes })
}

/// Each tensor's digest (16 bytes), by name.
#[pyfunction]
fn tensor_digests<'py>(py: Python<'py>, tensors: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
    let mut sd = tensors::describe(tensors, false)?;
    let SortedTensors { layout, order, bytes } = sorted_slices(&mut sd)?;
    let d = py.detach(|| layout.tensor_digests(&bytes));
    let out = PyDict::new(py);
    for (k, &i) in order.iter().enumerate() {
        out.set_item(&sd.names[i], PyBytes::new(py, &d[k]))?;
    }
    Ok(out)
}

/// Checkpoint digest (hex) of a state dict.
#[pyfunction]
fn digest_tensors(py: Python<'_>, tensors: &Bound<'_, PyAny>) -> PyResult<String> {
    let mut sd = tensors::describe(tensors, false)?;
    let SortedTensors { layout, bytes, .. } = sorted_slices(&mut sd)?;
    Ok(py.detach(|| digest_hex(&layout.checkpoint_digest(&layout.tensor_digests(&bytes)))))
}

/// The CPU reference of the GPU diff kernel: changed positions (uint32 LE
/// bytes) and value words (uint64 LE bytes) of one chunk (memory spans).
#[pyfunction]
#[pyo3(signature = (old, new, width, kind="xor"))]
fn find_changes<'py>(py: Python<'py>, old: Span, new: Span, width: usize, kind: &str) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
    let kind = parse_kind(kind)?;
    check_spans(&[old, new], false)?;
    let spans = [old, new];
    let s = slices(&spans);
    let ch = py.detach(|| codec::find_changes(s[0], s[1], width, kind)).map_err(to_py)?;
    let pos: Vec<u8> = ch.positions.iter().flat_map(|p| p.to_le_bytes()).collect();
    let val: Vec<u8> = ch.values.iter().flat_map(|p| p.to_le_bytes()).collect();
    Ok((PyBytes::new(py, &pos), PyBytes::new(py, &val)))
}

/// The CPU reference of the GPU apply kernels: apply positions (uint32 LE)
/// and value words (uint64 LE) in place.
#[pyfunction]
#[pyo3(signature = (target, width, positions, values, kind="xor"))]
fn apply_changes(py: Python<'_>, target: Span, width: usize, positions: &[u8], values: &[u8], kind: &str) -> PyResult<()> {
    let kind = parse_kind(kind)?;
    check_spans(&[target], true)?;
    let s = [positions, values];
    if !s[0].len().is_multiple_of(4) || !s[1].len().is_multiple_of(8) || s[0].len() / 4 != s[1].len() / 8 {
        return Err(pyo3::exceptions::PyValueError::new_err("positions must be uint32 and values uint64, of equal counts"));
    }
    let changes = SparseChanges {
        positions: s[0].chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4"))).collect(),
        values: s[1].chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8"))).collect(),
    };
    let spans = [target];
    let mut t = slices_mut(&spans);
    let target = &mut *t[0];
    py.detach(|| codec::apply_changes(target, width, kind, &changes)).map_err(to_py)
}

// ------------------------------------------------------------ resumable receiver

fn torn_dict<'py>(py: Python<'py>, t: &Option<dcr_core::journal::TornTail>) -> PyResult<Option<Bound<'py, PyDict>>> {
    let Some(t) = t else { return Ok(None) };
    let d = PyDict::new(py);
    d.set_item("offset", t.offset)?;
    d.set_item("bytes", t.len)?;
    d.set_item("reason", t.reason)?;
    Ok(Some(d))
}

/// Apply a delta file in place to a checkpoint (file or shard directory) under a crash-safe
/// journal (default `<target>.dcrj`): rerun after a crash to finish the
/// refit exactly; rerun after success is a no-op.
#[pyfunction]
#[pyo3(signature = (delta, target, *, journal=None, batch_chunks=256, threads=None))]
fn refit_file<'py>(
    py: Python<'py>,
    delta: PathBuf,
    target: PathBuf,
    journal: Option<PathBuf>,
    batch_chunks: usize,
    threads: Option<usize>,
) -> PyResult<Bound<'py, PyDict>> {
    let pool = pool(threads)?;
    let opts = receiver::RefitOptions { batch_chunks: batch_chunks.max(1), ..Default::default() };
    let jpath = journal.unwrap_or_else(|| receiver::default_journal_path(&target));
    let outcome =
        py.detach(|| pool.install(|| receiver::refit_file(&delta, &target, Some(&jpath), &opts))).map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("journal", jpath.to_string_lossy())?;
    match outcome {
        receiver::RefitOutcome::Committed(r) => {
            d.set_item("outcome", "committed")?;
            d.set_item("version", r.version)?;
            d.set_item("digest", digest_hex(&r.digest))?;
            d.set_item("chunks", r.chunks)?;
            d.set_item("applied", r.applied)?;
            d.set_item("repaired", r.repaired)?;
            d.set_item("skipped", r.skipped)?;
            d.set_item("changed_elements", r.changed)?;
            d.set_item("resumed", r.resumed)?;
            d.set_item("torn_tail", torn_dict(py, &r.torn_tail)?)?;
        }
        receiver::RefitOutcome::AlreadyAtTarget { version, digest } => {
            d.set_item("outcome", "already_at_target")?;
            d.set_item("version", version)?;
            d.set_item("digest", digest_hex(&digest))?;
            d.set_item("chunks", 0)?;
            d.set_item("applied", 0)?;
            d.set_item("repaired", 0)?;
            d.set_item("skipped", 0)?;
            d.set_item("changed_elements", 0)?;
            d.set_item("resumed", false)?;
            d.set_item("torn_tail", py.None())?;
        }
    }
    Ok(d)
}

/// What the receiver journal of `target` says (read-only): the committed
/// version and digest, the refit in flight with its chunk counts, the last
/// abort, a torn tail the next refit will cut.
#[pyfunction]
#[pyo3(signature = (target, *, journal=None))]
fn receiver_status<'py>(py: Python<'py>, target: PathBuf, journal: Option<PathBuf>) -> PyResult<Bound<'py, PyDict>> {
    let st = py.detach(|| receiver::status_file(&target, journal.as_deref())).map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("target", target.to_string_lossy())?;
    d.set_item("journal", st.journal.to_string_lossy())?;
    d.set_item("journal_exists", st.exists)?;
    match &st.state.committed {
        Some(c) => {
            let cd = PyDict::new(py);
            cd.set_item("version", c.version)?;
            cd.set_item("digest", digest_hex(&c.digest))?;
            d.set_item("committed", cd)?;
        }
        None => d.set_item("committed", py.None())?,
    }
    match &st.state.refit {
        Some(r) => {
            let rd = PyDict::new(py);
            rd.set_item("version", r.plan.version)?;
            rd.set_item("base_digest", digest_hex(&r.plan.base_digest))?;
            rd.set_item("target_digest", digest_hex(&r.plan.target_digest))?;
            rd.set_item("delta_id", digest_hex(&r.plan.delta_id))?;
            rd.set_item("chunks", r.plan.n_chunks)?;
            rd.set_item("applied", r.applied().len())?;
            rd.set_item("in_progress", r.needs_repair().len())?;
            rd.set_item("not_started", r.not_started().len())?;
            d.set_item("refit", rd)?;
        }
        None => d.set_item("refit", py.None())?,
    }
    match &st.state.last_abort {
        Some(a) => {
            let ad = PyDict::new(py);
            ad.set_item("version", a.version)?;
            ad.set_item("touched_chunks", a.touched_chunks)?;
            ad.set_item("reason", &a.reason)?;
            d.set_item("last_abort", ad)?;
        }
        None => d.set_item("last_abort", py.None())?,
    }
    d.set_item("target_is_committed", st.state.target_is_committed())?;
    d.set_item("torn_tail", torn_dict(py, &st.torn_tail)?)?;
    d.set_item("undo_bytes", st.undo_bytes)?;
    d.set_item("spool_bytes", st.spool_bytes)?;
    Ok(d)
}

/// A delta header as a dict (see `decode_delta`).
fn header_dict<'py>(py: Python<'py>, header: &dcr_core::format::DeltaHeader) -> PyResult<Bound<'py, PyDict>> {
    let h = PyDict::new(py);
    h.set_item("delta_id", digest_hex(&header.delta_id))?;
    h.set_item("base_digest", digest_hex(&header.base_digest))?;
    h.set_item("target_digest", digest_hex(&header.target_digest))?;
    h.set_item("base_version", header.base_version)?;
    h.set_item("target_version", header.target_version)?;
    let tensors = PyList::empty(py);
    for t in header.layout.tensors() {
        tensors.append((t.name.as_str(), t.dtype.name(), t.shape.clone()))?;
    }
    h.set_item("tensors", tensors)?;
    Ok(h)
}

/// The header of a delta, as `decode_delta` gives it, read from its
/// preamble and header frame alone (checksum verified): to check layout and
/// base before decoding. The chunks are validated when decoded.
#[pyfunction]
fn delta_header<'py>(py: Python<'py>, delta: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    header_dict(py, &delta::read_header(delta).map_err(to_py)?)
}

/// Parse, validate and decode a whole delta: its header and, per chunk,
/// (tensor name, start word, word width, kind, positions as uint32 LE bytes,
/// values as uint64 LE bytes). For integrations that place changes
/// themselves (serving-runtime loaders, GPU apply).
///
/// Context-coded chunks decode against the base: `base(name)` is called
/// (once per tensor that has such chunks) for the span of that tensor's
/// canonical base bytes, which the caller keeps alive until this returns.
/// Without `base` such chunks are refused.
#[pyfunction]
#[pyo3(signature = (delta, base=None))]
fn decode_delta<'py>(
    py: Python<'py>,
    delta: &[u8],
    base: Option<Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyList>)> {
    // Every frame's checksum and every chunk's place, without the GIL.
    let parsed = py.detach(|| delta::read_delta(delta)).map_err(to_py)?;
    let tensors = parsed.header.layout.tensors();
    // The canonical base of each tensor with context-coded chunks.
    let mut spans: HashMap<usize, Span> = HashMap::new();
    for c in parsed.chunks.iter().filter(|c| c.mode == Mode::Context) {
        let t = c.tensor as usize;
        if spans.contains_key(&t) {
            continue;
        }
        let Some(base) = &base else {
            return Err(to_py(dcr_core::Error::Invalid(format!(
                "chunk {} is context-coded and decodes only against its base: pass base= (the canonical base tensors), \
                 apply it with apply_tensors/apply_file, or build the delta with mode='free'",
                c.seq
            ))));
        };
        let span: Span = base.call1((tensors[t].name.as_str(),))?.extract()?;
        let bytes = tensors[t].numel().map_err(to_py)? as usize * tensors[t].dtype.word_bytes();
        if span.1 != bytes {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "base of {}: expected {bytes} bytes (its canonical size), got {}",
                tensors[t].name, span.1
            )));
        }
        check_spans(&[span], false)?;
        spans.insert(t, span);
    }
    type Decoded = (usize, u64, usize, &'static str, Vec<u8>, Vec<u8>);
    let chunks: Vec<Decoded> = py
        .detach(|| {
            parsed
                .chunks
                .iter()
                .map(|c| {
                    let range = delta::check_chunk(&parsed.header, c)?;
                    let t = c.tensor as usize;
                    // Context-free chunks read no base.
                    let span = [spans.get(&t).copied().unwrap_or((0, 0))];
                    let base = slices(&span)[0].get(range.clone()).unwrap_or(&[]);
                    let ch = delta::decode_against(c, &range, &parsed.header.layout, base)?.to_changes();
                    let pos: Vec<u8> = ch.positions.iter().flat_map(|p| p.to_le_bytes()).collect();
                    let val: Vec<u8> = ch.values.iter().flat_map(|v| v.to_le_bytes()).collect();
                    Ok((t, c.start, tensors[t].dtype.word_bytes(), c.kind.name(), pos, val))
                })
                .collect::<dcr_core::Result<_>>()
        })
        .map_err(to_py)?;
    let h = header_dict(py, &parsed.header)?;
    let list = PyList::empty(py);
    for (t, start, w, kind, pos, val) in chunks {
        list.append((tensors[t].name.as_str(), start, w, kind, PyBytes::new(py, &pos), PyBytes::new(py, &val)))?;
    }
    Ok((h, list))
}

// ------------------------------------------------------------ object storage
// (issue 8; dcr_core::objstore, layout in docs/objstore.md)

fn publish_dict<'py>(py: Python<'py>, s: &objstore::PublishSummary) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", s.version)?;
    d.set_item("committed", s.committed)?;
    d.set_item("objects", s.objects)?;
    d.set_item("object_bytes", s.object_bytes)?;
    d.set_item("multipart_objects", s.multipart_objects)?;
    d.set_item("manifest_bytes", s.manifest_bytes)?;
    d.set_item("delta_bytes", s.delta_bytes)?;
    d.set_item("delta_id", &s.delta_id)?;
    d.set_item("base_digest", &s.base_digest)?;
    d.set_item("target_digest", &s.target_digest)?;
    d.set_item("changed_elements", s.changed)?;
    Ok(d)
}

fn publish_opts(version: Option<u64>, concurrency: usize, multipart_bytes: usize, part_bytes: usize, commit: bool) -> objstore::PublishOptions {
    objstore::PublishOptions { version, concurrency, multipart_bytes, part_bytes, commit }
}

/// Publish a delta file to object storage as version `version` (default:
/// the newest committed + 1): content-addressed frame objects, then the
/// manifest by a conditional put. `progress(uploaded, total)` in bytes.
#[pyfunction]
#[pyo3(signature = (delta, url, *, version=None, concurrency=objstore::DEFAULT_CONCURRENCY, multipart_bytes=objstore::DEFAULT_MULTIPART_BYTES, part_bytes=objstore::DEFAULT_PART_BYTES, commit=true, progress=None))]
#[allow(clippy::too_many_arguments)]
fn objstore_publish<'py>(
    py: Python<'py>,
    delta: PathBuf,
    url: String,
    version: Option<u64>,
    concurrency: usize,
    multipart_bytes: usize,
    part_bytes: usize,
    commit: bool,
    progress: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = publish_opts(version, concurrency, multipart_bytes, part_bytes, commit);
    let mut cb = progress_fn(progress);
    let s = py
        .detach(|| {
            let store = objstore::Store::open(&url)?;
            objstore::publish_delta(&store, &delta, opts, &mut cb)
        })
        .map_err(to_py)?;
    publish_dict(py, &s)
}

/// Build the delta from `old` to `new` and publish it while it is built:
/// each frame's upload starts as soon as it is encoded.
#[pyfunction]
#[pyo3(signature = (old, new, url, *, version=None, chunk_bytes=delta::DEFAULT_CHUNK_BYTES, kind="xor", zstd_level=1, concurrency=objstore::DEFAULT_CONCURRENCY, multipart_bytes=objstore::DEFAULT_MULTIPART_BYTES, part_bytes=objstore::DEFAULT_PART_BYTES, commit=true, threads=None, progress=None))]
#[allow(clippy::too_many_arguments)]
fn objstore_publish_diff<'py>(
    py: Python<'py>,
    old: PathBuf,
    new: PathBuf,
    url: String,
    version: Option<u64>,
    chunk_bytes: u32,
    kind: &str,
    zstd_level: i32,
    concurrency: usize,
    multipart_bytes: usize,
    part_bytes: usize,
    commit: bool,
    threads: Option<usize>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let diff = DiffOptions { chunk_bytes, kind: parse_kind(kind)?, zstd_level, ..Default::default() };
    let opts = publish_opts(version, concurrency, multipart_bytes, part_bytes, commit);
    let pool = pool(threads)?;
    let mut cb = progress_fn(progress);
    let (s, stats) = py
        .detach(|| {
            let store = objstore::Store::open(&url)?;
            pool.install(|| objstore::publish_diff(&store, &old, &new, &diff, opts, &mut cb))
        })
        .map_err(to_py)?;
    let d = publish_dict(py, &s)?;
    d.set_item("stats", stats_dict(py, &stats)?)?;
    Ok(d)
}

/// Bring the safetensors file `target` (in place) to the newest committed
/// version at `url`, applying every version after the one it holds in
/// order; when it is already at the newest, wait up to `wait` seconds for
/// the next version (prefetching while it streams).
/// `progress(event, version, done, total)`: event "fetch" (bytes),
/// "applied" (chunks, changed elements), "waiting" (for `version`) or
/// "prefetched" (objects of the uncommitted `version` fetched so far).
#[pyfunction]
#[pyo3(signature = (target, url, *, receiver_id=None, wait=0.0, poll=0.2, concurrency=objstore::DEFAULT_CONCURRENCY, progress=None, journal=None))]
#[allow(clippy::too_many_arguments)]
fn objstore_receive<'py>(
    py: Python<'py>,
    target: PathBuf,
    url: String,
    receiver_id: Option<String>,
    wait: f64,
    poll: f64,
    concurrency: usize,
    progress: Option<Py<PyAny>>,
    journal: Option<PathBuf>,
) -> PyResult<Bound<'py, PyDict>> {
    if !(wait >= 0.0 && wait.is_finite() && poll > 0.0 && poll.is_finite()) {
        return Err(pyo3::exceptions::PyValueError::new_err(format!("wait must be >= 0 and poll > 0 seconds, got wait={wait} poll={poll}")));
    }
    let opts = objstore::ReceiveOptions {
        receiver_id,
        wait: std::time::Duration::from_secs_f64(wait),
        poll: std::time::Duration::from_secs_f64(poll),
        concurrency,
        journal,
    };
    // Not inside a rayon pool: a receiver waiting for the next version must
    // not hold a worker that a concurrent diff in this process needs.
    let mut events = move |e: objstore::ReceiveEvent| {
        if let Some(cb) = &progress {
            let args = match e {
                objstore::ReceiveEvent::Fetch { version, done, total } => ("fetch", version, done, total),
                objstore::ReceiveEvent::Applied { version, chunks, changed } => ("applied", version, u64::from(chunks), changed),
                objstore::ReceiveEvent::Resumed { version, chunks, changed } => ("resumed", version, u64::from(chunks), changed),
                objstore::ReceiveEvent::Waiting { next } => ("waiting", next, 0, 0),
                objstore::ReceiveEvent::Prefetched { version, objects } => ("prefetched", version, objects, 0),
            };
            Python::attach(|py| {
                if let Err(e) = cb.call1(py, args) {
                    e.print(py);
                }
            });
        }
    };
    let s = py
        .detach(|| {
            let store = objstore::Store::open(&url)?;
            objstore::receive(&store, &target, &opts, &mut events)
        })
        .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("applied", s.applied.clone())?;
    d.set_item("version", s.version)?;
    d.set_item("digest", &s.digest)?;
    d.set_item("fetched_bytes", s.fetched_bytes)?;
    d.set_item("prefetched", s.prefetched)?;
    d.set_item("refetched", s.refetched)?;
    Ok(d)
}

/// The committed versions at `url`: one dict per manifest, by version.
#[pyfunction]
fn objstore_versions<'py>(py: Python<'py>, url: String) -> PyResult<Bound<'py, PyList>> {
    let ms = py.detach(|| objstore::Store::open(&url)?.committed()).map_err(to_py)?;
    let out = PyList::empty(py);
    for m in ms {
        let d = PyDict::new(py);
        d.set_item("version", m.version)?;
        d.set_item("delta_id", &m.delta_id)?;
        d.set_item("base_digest", &m.base_digest)?;
        d.set_item("target_digest", &m.target_digest)?;
        d.set_item("objects", m.objects.len())?;
        d.set_item("object_bytes", m.objects.iter().map(|o| o.size).sum::<u64>())?;
        d.set_item("delta_bytes", m.delta_bytes)?;
        d.set_item("changed_elements", m.changed)?;
        d.set_item("published_unix_ms", m.published_unix_ms)?;
        out.append(d)?;
    }
    Ok(out)
}

/// Delete the versions every registered receiver has acknowledged (the
/// newest committed version always stays).
#[pyfunction]
#[pyo3(signature = (url, *, dry_run=false))]
fn objstore_gc<'py>(py: Python<'py>, url: String, dry_run: bool) -> PyResult<Bound<'py, PyDict>> {
    let s = py.detach(|| objstore::gc(&objstore::Store::open(&url)?, dry_run)).map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("deleted", s.deleted.clone())?;
    d.set_item("objects_deleted", s.objects_deleted)?;
    let r = PyDict::new(py);
    for (id, v) in &s.receivers {
        r.set_item(id, *v)?;
    }
    d.set_item("receivers", r)?;
    d.set_item("acknowledged_by_all", s.acknowledged_by_all)?;
    d.set_item("newest", s.newest)?;
    d.set_item("dry_run", dry_run)?;
    Ok(d)
}

#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("FORMAT_VERSION", dcr_core::format::FORMAT_VERSION)?;
    m.add("DEFAULT_CHUNK_BYTES", delta::DEFAULT_CHUNK_BYTES)?;
    errors::register(m)?;
    m.add_function(wrap_pyfunction!(diff_files, m)?)?;
    m.add_function(wrap_pyfunction!(apply_file, m)?)?;
    m.add_function(wrap_pyfunction!(compare_files, m)?)?;
    m.add_function(wrap_pyfunction!(inspect_file, m)?)?;
    m.add_function(wrap_pyfunction!(file_digest, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint_files, m)?)?;
    m.add_function(wrap_pyfunction!(diff_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(apply_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(digest_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_digests, m)?)?;
    m.add_function(wrap_pyfunction!(find_changes, m)?)?;
    m.add_function(wrap_pyfunction!(apply_changes, m)?)?;
    m.add_function(wrap_pyfunction!(refit_file, m)?)?;
    m.add_function(wrap_pyfunction!(receiver_status, m)?)?;
    m.add_function(wrap_pyfunction!(decode_delta, m)?)?;
    m.add_function(wrap_pyfunction!(delta_header, m)?)?;
    m.add_function(wrap_pyfunction!(sharded::block_digest, m)?)?;
    m.add_function(wrap_pyfunction!(sharded::moved_digest, m)?)?;
    m.add_function(wrap_pyfunction!(sharded::scan_and_project, m)?)?;
    m.add_function(wrap_pyfunction!(sharded::sort_records, m)?)?;
    m.add_class::<sharded::ComposedDelta>()?;
    m.add_class::<sharded::DeltaSink>()?;
    m.add_function(wrap_pyfunction!(transport::publish_delta, m)?)?;
    m.add_function(wrap_pyfunction!(transport::receive_delta, m)?)?;
    m.add_function(wrap_pyfunction!(transport::relay_main, m)?)?;
    // object storage (issue 8)
    m.add("OBJSTORE_SCHEMES", vec!["s3", "gs", "az", "file"])?;
    m.add_function(wrap_pyfunction!(objstore_publish, m)?)?;
    m.add_function(wrap_pyfunction!(objstore_publish_diff, m)?)?;
    m.add_function(wrap_pyfunction!(objstore_receive, m)?)?;
    m.add_function(wrap_pyfunction!(objstore_versions, m)?)?;
    m.add_function(wrap_pyfunction!(objstore_gc, m)?)?;
    Ok(())
}
