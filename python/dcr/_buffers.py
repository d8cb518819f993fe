"""Zero-copy hand-off of numpy arrays and CPU torch tensors to the Rust core.

The core receives (data pointer, byte length) spans. It reads plain
contiguous CPU torch tensors itself (``rust/py/src/tensors.rs``); for
anything else it calls :func:`span_of`, which checks that the array is a
C-contiguous CPU array, names its dtype the safetensors way, and says what
to pass instead where it cannot be used.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

_NUMPY_DTYPES = {
    np.dtype("bool"): "BOOL",
    np.dtype("uint8"): "U8",
    np.dtype("int8"): "I8",
    np.dtype("int16"): "I16",
    np.dtype("uint16"): "U16",
    np.dtype("float16"): "F16",
    np.dtype("int32"): "I32",
    np.dtype("uint32"): "U32",
    np.dtype("float32"): "F32",
    np.dtype("complex64"): "C64",
    np.dtype("float64"): "F64",
    np.dtype("int64"): "I64",
    np.dtype("uint64"): "U64",
}

_TORCH_DTYPE_NAMES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e8m0fnu": "F8_E8M0",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "complex64": "C64",
    "float64": "F64",
    "int64": "I64",
    "uint64": "U64",
}


class Span(NamedTuple):
    name: str
    dtype: str
    shape: list[int]
    ptr: int
    nbytes: int
    owner: Any


_TORCH_DTYPES: dict[Any, str | None] = {}


def _torch_dtype_name(dtype: Any) -> str | None:
    """The safetensors name of a torch dtype (memoised: a refit passes
    hundreds of tensors of a handful of dtypes)."""
    try:
        return _TORCH_DTYPES[dtype]
    except KeyError:
        name = _TORCH_DTYPE_NAMES.get(str(dtype).removeprefix("torch."))
        _TORCH_DTYPES[dtype] = name
        return name


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def span_of(name: str, x: Any, *, writable: bool = False) -> Span:
    """Describe one tensor or array as a span, or raise a clear TypeError/ValueError."""
    if _is_torch(x):
        if not x.is_cpu:
            raise ValueError(
                f"tensor {name!r} is on {x.device}; the CPU path needs CPU tensors "
                "(GPU tensors go through dcr.cuda)"
            )
        if not x.is_contiguous():
            raise ValueError(f"tensor {name!r} is not contiguous; pass t.contiguous()")
        if x.is_conj() or x.is_neg():
            view = "conjugated" if x.is_conj() else "negated"
            raise ValueError(
                f"tensor {name!r} is a lazily {view} view: its memory holds other bits than its values; "
                "pass t.resolve_conj().resolve_neg()"
            )
        dtype_name = _torch_dtype_name(x.dtype)
        if dtype_name is None:
            raise TypeError(f"tensor {name!r} has dtype {x.dtype}, which safetensors cannot store")
        if writable and x.requires_grad and x.is_leaf:
            x = x.detach()
        return Span(name, dtype_name, list(x.shape), x.data_ptr(), x.nbytes, x)
    a = np.asarray(x) if not isinstance(x, np.ndarray) else x
    if not a.flags["C_CONTIGUOUS"]:
        raise ValueError(f"array {name!r} is not C-contiguous; pass np.ascontiguousarray(a)")
    if writable and not a.flags["WRITEABLE"]:
        raise ValueError(f"array {name!r} is read-only; pass a writable array")
    if a.dtype not in _NUMPY_DTYPES:
        raise TypeError(
            f"array {name!r} has dtype {a.dtype}; use a safetensors dtype (bf16 and fp8 via torch tensors)"
        )
    return Span(name, _NUMPY_DTYPES[a.dtype], list(a.shape), a.ctypes.data, a.nbytes, a)
