//! State dicts (mappings of names to CPU torch tensors or numpy arrays)
//! described for the core without copying: each tensor's name, dtype,
//! shape and memory span, the owners kept referenced for the call.
//!
//! Contiguous CPU torch tensors are read here through torch's own
//! accessors (a refit describes every tensor of the model on each call);
//! anything else goes through `dcr._buffers.span_of`, which also raises
//! the errors that name what to pass instead.

use std::sync::Mutex;

use dcr_core::checkpoint::TensorSpec;
use dcr_core::dtype::DType;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyString, PyType};

use crate::errors::LayoutMismatchError;
use crate::Span;

/// A described state dict, in the mapping's order.
pub(crate) struct StateDict<'py> {
    pub names: Vec<Bound<'py, PyString>>,
    pub specs: Vec<TensorSpec>,
    pub spans: Vec<Span>,
    /// The tensors (or the arrays standing in for them), referenced until
    /// the core is done with their memory.
    _owners: Vec<Bound<'py, PyAny>>,
}

/// `(name, tensor)` of each entry of a mapping (a dict without an items
/// list).
fn for_each_item<'py>(tensors: &Bound<'py, PyAny>, mut f: impl FnMut(Bound<'py, PyAny>, Bound<'py, PyAny>) -> PyResult<()>) -> PyResult<()> {
    if let Ok(dict) = tensors.cast::<PyDict>() {
        for (k, v) in dict.iter() {
            f(k, v)?;
        }
        return Ok(());
    }
    for item in tensors.call_method0(intern!(tensors.py(), "items"))?.try_iter()? {
        let (k, v) = item?.extract::<(Bound<'py, PyAny>, Bound<'py, PyAny>)>()?;
        f(k, v)?;
    }
    Ok(())
}

/// `torch.Tensor` where torch is loaded (a numpy-only caller never imports it).
fn torch_tensor_type(py: Python<'_>) -> PyResult<Option<Bound<'_, PyType>>> {
    static TENSOR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    if let Some(t) = TENSOR.get(py) {
        return Ok(Some(t.bind(py).clone()));
    }
    let modules = py.import(intern!(py, "sys"))?.getattr(intern!(py, "modules"))?;
    let Some(torch) = modules.cast::<PyDict>()?.get_item(intern!(py, "torch"))? else { return Ok(None) };
    let Ok(tensor) = torch.getattr(intern!(py, "Tensor")) else { return Ok(None) };
    let tensor = tensor.cast_into::<PyType>()?;
    Ok(Some(TENSOR.get_or_init(py, || tensor.clone().unbind()).bind(py).clone()))
}

/// The dtype of a torch dtype object (`None` where safetensors cannot
/// store it), remembered by the object's identity: torch's dtypes are
/// singletons, and a model has a handful.
fn torch_dtype(dtype: &Bound<'_, PyAny>) -> PyResult<Option<DType>> {
    static SEEN: Mutex<Vec<(Py<PyAny>, Option<DType>)>> = Mutex::new(Vec::new());
    let py = dtype.py();
    if let Some(&(_, d)) = SEEN.lock().expect("dtype cache").iter().find(|(o, _)| o.as_ptr() == dtype.as_ptr()) {
        return Ok(d);
    }
    let name: Option<String> = buffers_module(py)?.getattr(intern!(py, "_torch_dtype_name"))?.call1((dtype,))?.extract()?;
    let d = name.and_then(|n| DType::from_name(&n).ok());
    SEEN.lock().expect("dtype cache").push((dtype.clone().unbind(), d));
    Ok(d)
}

fn buffers_module(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    py.import(intern!(py, "dcr._buffers"))
}

/// Describe every tensor of `tensors` (a mapping of names to CPU torch
/// tensors or numpy arrays); `writable` for tensors the core will write.
pub(crate) fn describe<'py>(tensors: &Bound<'py, PyAny>, writable: bool) -> PyResult<StateDict<'py>> {
    let n = tensors.len().unwrap_or(0);
    let mut out = StateDict { names: Vec::with_capacity(n), specs: Vec::with_capacity(n), spans: Vec::with_capacity(n), _owners: Vec::with_capacity(n) };
    each_tensor(tensors, writable, |name, dtype, shape, span, owner| {
        out.specs.push(TensorSpec { name: name.to_str()?.to_owned(), dtype, shape });
        out.names.push(name);
        out.spans.push(span);
        out._owners.push(owner);
        Ok(())
    })?;
    Ok(out)
}

/// `f(name, dtype, shape, span, owner)` for each tensor of `tensors`.
fn each_tensor<'py>(
    tensors: &Bound<'py, PyAny>,
    writable: bool,
    mut f: impl FnMut(Bound<'py, PyString>, DType, Vec<u64>, Span, Bound<'py, PyAny>) -> PyResult<()>,
) -> PyResult<()> {
    let py = tensors.py();
    let tensor_type = torch_tensor_type(py)?;
    for_each_item(tensors, |name, x| {
        let name = name.cast_into::<PyString>().map_err(|e| pyo3::exceptions::PyTypeError::new_err(format!("tensor names must be str, got {}", e.into_inner().get_type())))?;
        let fast = match &tensor_type {
            Some(t) if x.is_instance(t)? => torch_span(&x, writable)?,
            _ => None,
        };
        match fast {
            Some((dtype, shape, span)) => f(name, dtype, shape, span, x),
            None => {
                let kwargs = PyDict::new(py);
                kwargs.set_item(intern!(py, "writable"), writable)?;
                let s = buffers_module(py)?.getattr(intern!(py, "span_of"))?.call((&name, &x), Some(&kwargs))?;
                let (_, dtype, shape, ptr, nbytes, owner): (Bound<'py, PyAny>, String, Vec<u64>, usize, usize, Bound<'py, PyAny>) = s.extract()?;
                let dtype = DType::from_name(&dtype).map_err(crate::errors::to_py)?;
                f(name, dtype, shape, (ptr, nbytes), owner)
            }
        }
    })
}

/// A plain contiguous CPU tensor's dtype, shape, data pointer and byte
/// length; `None` for anything `span_of` must look at (another device, a
/// strided view, a leaf that needs grad where it will be written, a lazy
/// negated or conjugated view, a dtype that safetensors cannot store).
fn torch_span(x: &Bound<'_, PyAny>, writable: bool) -> PyResult<Option<(DType, Vec<u64>, Span)>> {
    let py = x.py();
    if !x.getattr(intern!(py, "is_cpu"))?.is_truthy()? || !x.call_method0(intern!(py, "is_contiguous"))?.is_truthy()? {
        return Ok(None);
    }
    if writable && x.getattr(intern!(py, "requires_grad"))?.is_truthy()? {
        return Ok(None);
    }
    // A lazily negated view's memory holds the other bits (as does a
    // conjugated one's, which only complex tensors can be).
    if x.call_method0(intern!(py, "is_neg"))?.is_truthy()? {
        return Ok(None);
    }
    let Some(dtype) = torch_dtype(&x.getattr(intern!(py, "dtype"))?)? else { return Ok(None) };
    if dtype.name() == "C64" {
        return Ok(None);
    }
    let shape: Vec<u64> = x.getattr(intern!(py, "shape"))?.extract()?;
    let ptr: usize = x.call_method0(intern!(py, "data_ptr"))?.extract()?;
    // A contiguous tensor's bytes: its elements times their width.
    let nbytes = shape
        .iter()
        .try_fold(dtype.word_bytes() as u64, |acc, &d| acc.checked_mul(d))
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| pyo3::exceptions::PyValueError::new_err(format!("tensor shape {shape:?} overflows a byte length")))?;
    Ok(Some((dtype, shape, (ptr, nbytes))))
}

/// The spans of `new`'s tensors in the order of `old`'s names, and their
/// owners; a different set of names, dtypes or shapes is refused.
pub(crate) fn spans_like<'py>(new: &Bound<'py, PyAny>, old: &StateDict<'py>) -> PyResult<(Vec<Span>, Vec<Bound<'py, PyAny>>)> {
    let py = new.py();
    if new.len()? != old.names.len() || old.names.iter().any(|n| !new.contains(n).unwrap_or(false)) {
        // The names on one side only, as Python writes them.
        let mut differ: Vec<Bound<'py, PyAny>> = Vec::new();
        for n in &old.names {
            if !new.contains(n)? {
                differ.push(n.clone().into_any());
            }
        }
        for_each_item(new, |k, _| {
            if !old.names.iter().any(|n| n.as_any().eq(&k).unwrap_or(false)) {
                differ.push(k);
            }
            Ok(())
        })?;
        let mut differ = differ.iter().map(|k| Ok(k.repr()?.to_string())).collect::<PyResult<Vec<String>>>()?;
        differ.sort();
        differ.truncate(5);
        return Err(LayoutMismatchError::new_err(format!(
            "old and new hold different tensor names (e.g. [{}]); pass matching state dicts",
            differ.join(", ")
        )));
    }
    let reordered = PyDict::new(py);
    for n in &old.names {
        reordered.set_item(n, new.get_item(n)?)?;
    }
    let mut spans = Vec::with_capacity(old.names.len());
    let mut owners = Vec::with_capacity(old.names.len());
    each_tensor(reordered.as_any(), false, |name, dtype, shape, span, owner| {
        let a = &old.specs[spans.len()];
        if a.dtype != dtype || a.shape != shape {
            return Err(LayoutMismatchError::new_err(format!(
                "tensor {}: old is {}{:?}, new is {}{:?}; shapes and dtypes must match",
                name.repr()?,
                a.dtype.name(),
                a.shape,
                dtype.name(),
                shape
            )));
        }
        spans.push(span);
        owners.push(owner);
        Ok(())
    })?;
    Ok((spans, owners))
}

/// The 16-byte digests `digests` (a mapping of names to bytes) holds for
/// `names`, in that order.
pub(crate) fn digests_for(digests: &Bound<'_, PyAny>, names: &[Bound<'_, PyString>]) -> PyResult<Vec<dcr_core::checkpoint::Digest>> {
    let py = digests.py();
    let mut out = Vec::with_capacity(names.len());
    let mut missing = Vec::new();
    for n in names {
        match digests.get_item(n) {
            Ok(d) => {
                // Bytes as kept, or any buffer (`bytes(d)`).
                let d = match d.cast_into::<PyBytes>() {
                    Ok(b) => b,
                    Err(e) => py.get_type::<PyBytes>().call1((e.into_inner(),))?.cast_into::<PyBytes>()?,
                };
                let d = d.as_bytes();
                out.push(d.try_into().map_err(|_| pyo3::exceptions::PyValueError::new_err(format!("the digest of tensor {n} has {} bytes; a tensor digest has 16", d.len())))?);
            }
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyKeyError>(py) => missing.push(n.to_str()?.to_owned()),
            Err(e) => return Err(e),
        }
    }
    if !missing.is_empty() {
        return Err(LayoutMismatchError::new_err(format!(
            "base_digests lacks {} tensors, e.g. {:?}; pass dcr.tensor_digests() of the same state dict",
            missing.len(),
            &missing[..missing.len().min(3)]
        )));
    }
    Ok(out)
}
