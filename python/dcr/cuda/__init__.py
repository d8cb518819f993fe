"""CUDA kernels for dcr's sparse XOR delta (diff, apply) with a reference path.

Public API (all on torch tensors; torch is imported lazily, so importing
this module without torch installed is fine until a function is called):

    sparse_diff(old, new, chunk_elems, impl="auto", update_baseline=False,
                *, with_new=False, strategy="auto", capacity=None)
        -> (counts, positions, values)            # + new_values if with_new
    apply_xor(target, chunk_elems, counts, positions, values, impl="auto",
              *, chunk_starts=None, validate=True) -> target
    apply_overwrite(...same...) -> target
    compile_ptx(arch) -> str                      # NVRTC only, no GPU needed
    load_kernels(device=None) -> str              # which loader served them
    kernels_available(device=None) -> bool

Layout: the flat tensor is cut into chunks of ``chunk_elems`` elements;
``counts[c]`` entries belong to chunk c, in chunk order, each a position
inside its chunk (int32, bit-identical to the codec's uint32 since
chunk_elems <= 2**31) and a word of the tensor's width (uint8 / int16 /
int32 / int64 views: the bits of bool/fp8, bf16/fp16, fp32, fp64...).

Kernel loading (first CUDA call per device): prebuilt CUBIN shipped in
``dcr/cuda/_prebuilt/``, then the on-disk cache (``$DCR_CACHE/cuda`` or
``~/.cache/dcr/cuda``, keyed by a hash of the source, GPU arch, options and
NVRTC version), then a runtime compile with NVRTC (our ctypes binding of the
library in the nvidia-cuda-nvrtc wheel; failing that, the private
``torch.cuda._compile_kernel`` if this torch has it, then nvcc through
``torch.utils.cpp_extension.load_inline``). If all fail, impl="auto"
falls back to the reference path on the tensors' device and logs why once;
impl="cuda" raises.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _driver, _nvrtc
from ._nvrtc import NvrtcError, NvrtcNotFound, kernel_source, kernel_source_path
from ._reference import _cpu_apply_overwrite, _cpu_apply_xor, _cpu_sparse_diff

if TYPE_CHECKING:
    import torch

__all__ = [
    "sparse_diff",
    "apply_xor",
    "apply_overwrite",
    "compile_ptx",
    "load_kernels",
    "kernels_available",
    "KernelsUnavailable",
    "NvrtcError",
    "NvrtcNotFound",
    "KERNEL_NAMES",
    "configure",
    "prebuild",
    "kernel_source_path",
]

log = logging.getLogger("dcr.cuda")

WIDTHS = (1, 2, 4, 8)
KERNEL_KINDS = ("diff_count", "diff_compact", "diff_onepass", "apply_xor", "apply_overwrite")
KERNEL_NAMES = tuple(f"dcr_{k}_w{w}" for w in WIDTHS for k in KERNEL_KINDS)
BLOCK = 256  # DCR_BLOCK
APPLY_PER_BLOCK = 256 * 4  # DCR_BLOCK * DCR_APPLY_PER_THREAD
MAX_CHUNK_ELEMS = 1 << 31
IMPLS = ("auto", "cuda", "cpu")

# Kernel parameter lists, checked at every launch and against the PTX by
# tests/test_cuda_compile.py: "ptr" = tensor (or None for a null pointer),
# "u64" = _driver.U64, "i32" = _driver.I32.
_PTR, _U64, _I32 = "ptr", "u64", "i32"
SIGNATURES: dict[str, tuple[str, ...]] = {
    # old, new, n, chunk, aligned, tile_counts, chunk_counts
    "diff_count": (_PTR, _PTR, _U64, _U64, _I32, _PTR, _PTR),
    # old, new, n, chunk, aligned, tile_offsets, cap, positions, values, new_values, update_baseline
    "diff_compact": (_PTR, _PTR, _U64, _U64, _I32, _PTR, _U64, _PTR, _PTR, _PTR, _I32),
    # old, new, n, chunk, aligned, workspace, chunk_counts, cap, positions, values, new_values, update_baseline
    "diff_onepass": (_PTR, _PTR, _U64, _U64, _I32, _PTR, _PTR, _U64, _PTR, _PTR, _PTR, _I32),
    # target, n_target, chunk, chunk_starts, incl, nchunks, positions, values, total, error
    "apply_xor": (_PTR, _U64, _U64, _PTR, _PTR, _U64, _PTR, _PTR, _U64, _PTR),
    "apply_overwrite": (_PTR, _U64, _U64, _PTR, _PTR, _U64, _PTR, _PTR, _U64, _PTR),
}


def _check_args(kind: str, args: list[Any]) -> None:
    sig = SIGNATURES[kind]
    if len(args) != len(sig):
        raise TypeError(f"dcr_{kind}: {len(args)} arguments for {len(sig)} parameters")
    for i, (a, t) in enumerate(zip(args, sig)):
        ok = (
            (t == _U64 and isinstance(a, _driver.U64))
            or (t == _I32 and isinstance(a, _driver.I32))
            or (t == _PTR and (a is None or hasattr(a, "data_ptr")))
        )
        if not ok:
            raise TypeError(f"dcr_{kind}: argument {i} should be {t}, got {type(a).__name__}")


def _launch(k: Any, kind: str, width: int, grid: int, args: list[Any], stream: int) -> None:
    _check_args(kind, args)
    k.module.launch(f"dcr_{kind}_w{width}", grid, BLOCK, args, stream)


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    try:
        return int(v) if v else default
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {v!r}") from None


# Tuning knobs compiled into the kernels (-DDCR_VECS, -DDCR_MIN_BLOCKS; see
# dcr_kernels.cu). $DCR_CUDA_VECS / $DCR_CUDA_MIN_BLOCKS or configure().
_TUNING = {"vecs": _env_int("DCR_CUDA_VECS", 4), "min_blocks": _env_int("DCR_CUDA_MIN_BLOCKS", 3)}


def configure(*, vecs: int | None = None, min_blocks: int | None = None) -> dict[str, int]:
    """Set the kernel tuning used by later calls (each setting is compiled and
    cached separately); returns the current settings."""
    if vecs is not None:
        if vecs not in (1, 2, 4):
            raise ValueError(f"vecs must be 1, 2 or 4, got {vecs}")
        _TUNING["vecs"] = vecs
    if min_blocks is not None:
        if not 0 <= min_blocks <= 8:
            raise ValueError(f"min_blocks must be in [0, 8], got {min_blocks}")
        _TUNING["min_blocks"] = min_blocks
    return dict(_TUNING)


def _tuning() -> tuple[int, int]:
    configure(**_TUNING)  # validates values that came from the environment
    return _TUNING["vecs"], _TUNING["min_blocks"]


def _compile_options(vecs: int, min_blocks: int) -> tuple[str, ...]:
    return tuple(_nvrtc.DEFAULT_OPTIONS) + (f"-DDCR_VECS={vecs}", f"-DDCR_MIN_BLOCKS={min_blocks}")


def tile_bytes(vecs: int) -> int:
    """Bytes of each input one diff block handles (DCR_TILE_BYTES)."""
    return BLOCK * vecs * 16


class KernelsUnavailable(RuntimeError):
    """impl='cuda' was asked for but the CUDA kernels cannot run."""


# ----------------------------------------------------------------- helpers


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - exercised only without torch
        raise ImportError("dcr.cuda needs torch: pip install 'dcr[torch]'") from e
    return torch


def _word_dtype(width: int) -> Any:
    torch = _torch()
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]


def _words(t: torch.Tensor, what: str) -> torch.Tensor:
    """Flat integer view of a contiguous tensor's words (no copy)."""
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(t).__name__}")
    w = t.element_size()
    if w not in WIDTHS:
        raise TypeError(f"{what} has dtype {t.dtype} ({w}-byte words): only 1, 2, 4 and 8-byte words are supported")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (got strides {tuple(t.stride())}): call .contiguous() first")
    flat = t.reshape(-1)
    return flat if flat.dtype == _word_dtype(w) else flat.view(_word_dtype(w))


def _check_chunk(chunk_elems: int) -> int:
    if isinstance(chunk_elems, bool) or not isinstance(chunk_elems, int):
        raise TypeError(f"chunk_elems must be an int, not {type(chunk_elems).__name__}")
    if not 1 <= chunk_elems <= MAX_CHUNK_ELEMS:
        raise ValueError(f"chunk_elems must be in [1, 2**31], got {chunk_elems}")
    return chunk_elems


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


# ----------------------------------------------------------------- loading


def _cache_dir() -> Path:
    root = os.environ.get("DCR_CACHE")
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dcr"
    return base / "cuda"


def cache_key(
    arch: str, source: str | None = None, options: tuple[str, ...] | None = None, *, nvrtc: bool = True
) -> str:
    """Hash of kernel source + arch + options (+ the NVRTC version if loadable
    and ``nvrtc``; prebuilt images are keyed without it, since they are
    meant for machines whose NVRTC differs or is missing)."""
    src = kernel_source() if source is None else source
    if options is None:
        options = _compile_options(*_tuning())
    ver = "prebuilt"
    if nvrtc:
        try:
            ver = "%d.%d" % _nvrtc.nvrtc_version()
        except (NvrtcNotFound, NvrtcError):
            ver = "none"
    h = hashlib.sha256()
    for part in (src, arch, " ".join(options), ver, "dcr-kernels-abi-1"):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


PREBUILT_DIR = Path(__file__).resolve().parent / "_prebuilt"


def prebuilt_path(arch: str, options: tuple[str, ...] | None = None, source: str | None = None) -> Path:
    """Where a prebuilt CUBIN for sm_<arch> with these options is looked up."""
    if options is None:
        options = _compile_options(*_tuning())
    return PREBUILT_DIR / _image_name(arch, cache_key(arch, source, options, nvrtc=False))


def prebuild(archs: list[str] | tuple[str, ...] = ("80", "90"), out_dir: Path | None = None) -> list[Path]:
    """Compile CUBINs for ``archs`` with the current tuning into ``out_dir``
    (default: the package's _prebuilt/ folder, which the loader tries first).
    NVRTC only, no GPU needed; for wheels built for known GPUs."""
    options = _compile_options(*_tuning())
    source = kernel_source()
    written = []
    for arch in archs:
        num, _ = _nvrtc._normalise_arch(arch)
        target = prebuilt_path(num, options, source)
        if out_dir is not None:
            target = Path(out_dir) / target.name
        image = _nvrtc.compile_source(source, num, target="cubin", options=options)
        target.parent.mkdir(parents=True, exist_ok=True)
        _store_or_raise(target, image)
        written.append(target)
    return written


def _image_name(arch: str, key: str) -> str:
    return f"dcr_kernels-sm_{arch}-{key[:20]}.cubin"


def compile_ptx(arch: str | int = "compute_90") -> str:
    """Compile cuda/dcr_kernels.cu to PTX for ``arch`` (e.g. 'compute_80',
    'compute_90', 90) with NVRTC; no GPU needed. Raises NvrtcNotFound if the
    library is missing, NvrtcError (with the log) if the source is rejected."""
    return _nvrtc.compile_source(kernel_source(), arch, target="ptx", options=_compile_options(*_tuning())).decode()


def ptxas_report(arch: str | int = "90") -> dict[str, dict[str, int]]:
    """Registers, stack and spill bytes per kernel from ptxas for sm_<arch>
    (NVRTC only, no GPU needed): {kernel: {"registers", "stack", "spill_stores", "spill_loads"}}."""
    import re

    _, log_text = _nvrtc.compile_source(
        kernel_source(), arch, target="cubin", options=_compile_options(*_tuning()) + ("--ptxas-options=-v",),
        with_log=True,
    )  # fmt: skip
    out: dict[str, dict[str, int]] = {}
    pat = re.compile(
        r"Function properties for (\w+)\n.*?(\d+) bytes stack frame, (\d+) bytes spill stores, "
        r"(\d+) bytes spill loads.*?\n.*?Used (\d+) registers",
    )
    for m in pat.finditer(log_text):
        out[m.group(1)] = {
            "registers": int(m.group(5)),
            "stack": int(m.group(2)),
            "spill_stores": int(m.group(3)),
            "spill_loads": int(m.group(4)),
        }
    return out


class _TorchCompiled:
    """Kernels compiled one by one by torch.cuda._compile_kernel (private,
    guarded), launched through our typed launcher via their CUfunction."""

    def __init__(self, source: str, arch: str, device_index: int, options: tuple[str, ...]) -> None:
        self.source, self.arch, self.device_index, self.options = source, arch, device_index, options
        self.ctx = _driver.ensure_context(device_index)
        self._funcs: dict[str, Any] = {}

    def function(self, name: str) -> Any:
        f = self._funcs.get(name)
        if f is None:
            torch = _torch()
            k = torch.cuda._compile_kernel(
                self.source, name, compute_capability=self.arch, nvcc_options=list(self.options)
            )
            f = getattr(k, "func", None)
            if f is None:
                raise KernelsUnavailable("torch.cuda._compile_kernel returned no CUfunction handle (.func)")
            self._funcs[name] = f
        return f

    def launch(self, name: str, grid: int, block: int, args: Any, stream: int) -> None:
        _driver.Module.launch(self, name, grid, block, args, stream)  # type: ignore[arg-type]


class _Loaded:
    def __init__(self, module: Any, origin: str, vecs: int) -> None:
        self.module = module
        self.origin = origin
        self.tile_bytes = tile_bytes(vecs)


_load_lock = threading.Lock()
_loaded: dict[tuple[int, int, int], _Loaded] = {}  # (device, vecs, min_blocks)
_failed: dict[int, str] = {}  # device -> why nothing could be loaded
_warned: set[int] = set()


def _device_arch(device_index: int) -> str:
    torch = _torch()
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"{major}{minor}"


def _load(device_index: int, vecs: int, min_blocks: int) -> _Loaded:
    """Load the kernels for one device: prebuilt, cache, NVRTC, torch."""
    torch = _torch()
    reasons: list[str] = []
    options = _compile_options(vecs, min_blocks)
    with torch.cuda.device(device_index):
        torch.empty(1, device=f"cuda:{device_index}")  # make torch create the primary context
        arch = _device_arch(device_index)
        source = kernel_source()
        key = cache_key(arch, source, options)
        name = _image_name(arch, key)
        cands = [("prebuilt", prebuilt_path(arch, options, source)), ("cache", _cache_dir() / name)]
        for origin, path in cands:
            if path.is_file():
                try:
                    return _Loaded(_driver.Module(path.read_bytes(), device_index, what=str(path)), origin, vecs)
                except (OSError, _driver.DriverError) as e:
                    reasons.append(f"{origin} {path}: {e}")
        errors = (NvrtcNotFound, NvrtcError, OSError, _driver.DriverError, ValueError)
        try:
            image = _nvrtc.compile_source(source, arch, target="cubin", options=options)
            module = _driver.Module(image, device_index, what=f"sm_{arch} CUBIN")
            _store(_cache_dir() / name, image)
            return _Loaded(module, "nvrtc", vecs)
        except errors as e:
            reasons.append(f"NVRTC runtime compile (CUBIN): {e}")
        if _nvrtc_missing() is None:
            try:  # e.g. a CUBIN the driver rejects: let the driver JIT the PTX
                ptx = _nvrtc.compile_source(source, arch, target="ptx", options=options)
                return _Loaded(_driver.Module(ptx, device_index, what=f"compute_{arch} PTX"), "nvrtc-ptx", vecs)
            except errors as e:
                reasons.append(f"NVRTC runtime compile (PTX): {e}")
        if hasattr(torch.cuda, "_compile_kernel"):
            try:
                tc = _TorchCompiled(source, arch, device_index, options)
                tc.function("dcr_apply_xor_w1")  # compile one to see it works
                return _Loaded(tc, "torch.cuda._compile_kernel", vecs)
            except Exception as e:  # private API: any failure means "not usable"
                reasons.append(f"torch.cuda._compile_kernel: {type(e).__name__}: {e}")
        else:
            reasons.append("torch.cuda._compile_kernel: not in this torch")
        try:
            return _Loaded(_InlineModule(source, arch, options, key), "load_inline", vecs)
        except Exception as e:  # nvcc/ninja missing, build errors: not usable
            reasons.append(f"torch.utils.cpp_extension.load_inline: {type(e).__name__}: {str(e)[-2000:]}")
    raise KernelsUnavailable("; ".join(reasons))


class _InlineModule:
    """Last resort: build the kernels plus a small launcher with nvcc through
    torch.utils.cpp_extension.load_inline (needs a CUDA toolkit and ninja)."""

    def __init__(self, source: str, arch: str, options: tuple[str, ...], key: str) -> None:
        from torch.utils import cpp_extension

        if cpp_extension.CUDA_HOME is None:
            raise KernelsUnavailable("no CUDA toolkit (CUDA_HOME unset and no nvcc on PATH)")
        cases = "\n".join(f'    if (name == "{k}") return (const void*){k};' for k in KERNEL_NAMES)
        launcher = f"""
#include <string>
#include <vector>
#include <cuda_runtime.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>
static const void* dcr_kernel_ptr(const std::string& name) {{
{cases}
    return nullptr;
}}
void dcr_launch(const std::string& name, int64_t grid, int64_t block, std::vector<int64_t> values,
                std::vector<int64_t> bits) {{
    const void* f = dcr_kernel_ptr(name);
    TORCH_CHECK(f != nullptr, "dcr: no kernel named ", name);
    std::vector<unsigned long long> v64(values.size());
    std::vector<int> v32(values.size());
    std::vector<void*> args(values.size());
    for (size_t i = 0; i < values.size(); ++i) {{
        if (bits[i] == 32) {{ v32[i] = (int)values[i]; args[i] = &v32[i]; }}
        else {{ v64[i] = (unsigned long long)values[i]; args[i] = &v64[i]; }}
    }}
    cudaError_t e = cudaLaunchKernel(f, dim3((unsigned)grid), dim3((unsigned)block), args.data(), 0,
                                     c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(e == cudaSuccess, "dcr: launching ", name, " failed: ", cudaGetErrorString(e));
}}
"""
        self.ext = cpp_extension.load_inline(
            name=f"dcr_kernels_{key[:16]}",
            cpp_sources="void dcr_launch(const std::string& name, int64_t grid, int64_t block, "
            "std::vector<int64_t> values, std::vector<int64_t> bits);",
            cuda_sources=source + launcher,
            functions=["dcr_launch"],
            extra_cuda_cflags=[o for o in options if o.startswith("-D")]
            + [f"-gencode=arch=compute_{arch},code=sm_{arch}"],
            verbose=False,
        )

    def launch(self, name: str, grid: int, block: int, args: Any, stream: int) -> None:
        values, bits = [], []
        for a in args:
            c = _driver._c_arg(a)  # validates kinds
            bits.append(32 if isinstance(c, ctypes.c_int32) else 64)
            v = c.value or 0
            values.append(v - (1 << 64) if v >= 1 << 63 else v)
        if grid > 0:
            self.ext.dcr_launch(name, grid, block, values, bits)  # on torch's current stream


def _nvrtc_missing() -> NvrtcNotFound | None:
    try:
        _nvrtc.find_nvrtc()
    except NvrtcNotFound as e:
        return e
    return None


def _store_or_raise(path: Path, image: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(image)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _store(path: Path, image: bytes) -> None:
    try:
        _store_or_raise(path, image)
    except OSError as e:  # a read-only home is not an error, just no cache
        log.debug("dcr.cuda: could not cache %s: %s", path, e)


def _device_index(device: Any) -> int:
    torch = _torch()
    d = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if d.type != "cuda":
        raise ValueError(f"not a CUDA device: {d}")
    return d.index if d.index is not None else torch.cuda.current_device()


def _kernels(device_index: int) -> _Loaded:
    vecs, min_blocks = _tuning()
    key = (device_index, vecs, min_blocks)
    got = _loaded.get(key)
    if got is not None:
        return got
    with _load_lock:
        got = _loaded.get(key)
        if got is not None:
            return got
        if device_index in _failed:
            raise KernelsUnavailable(_failed[device_index])
        try:
            got = _load(device_index, vecs, min_blocks)
        except KernelsUnavailable as e:
            _failed[device_index] = str(e)
            raise
        log.info(
            "dcr.cuda: kernels for cuda:%d (vecs=%d, min_blocks=%d) loaded from %s",
            device_index, vecs, min_blocks, got.origin,
        )  # fmt: skip
        _loaded[key] = got
        return got


def load_kernels(device: Any = None) -> str:
    """Load (or compile) the kernels for a CUDA device now; returns where they
    came from ('prebuilt', 'cache', 'nvrtc', 'nvrtc-ptx', 'torch.cuda._compile_kernel', 'load_inline').
    Raises KernelsUnavailable with every reason."""
    torch = _torch()
    if not torch.cuda.is_available():
        raise KernelsUnavailable(
            "CUDA kernels requested but torch.cuda.is_available() is False: use impl='cpu' or 'auto'"
        )
    return _kernels(_device_index(device)).origin


def kernels_available(device: Any = None) -> bool:
    try:
        load_kernels(device)
    except KernelsUnavailable:
        return False
    return True


def _select(impl: str, tensors: list[torch.Tensor], what: str) -> _Loaded | None:
    """None means the reference path."""
    _check_impl(impl)
    devs = {t.device for t in tensors if t is not None}
    if len(devs) > 1:
        raise ValueError(f"{what}: all tensors must be on one device, got {sorted(map(str, devs))}")
    dev = devs.pop()
    if impl == "cpu":
        return None
    torch = _torch()
    if dev.type != "cuda":
        if impl == "cuda":
            why = (
                "torch.cuda.is_available() is False"
                if not torch.cuda.is_available()
                else f"the tensors are on {dev}, not a CUDA device"
            )
            raise KernelsUnavailable(f"CUDA kernels requested but {why}: use impl='cpu' or 'auto'")
        return None
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    try:
        return _kernels(idx)
    except KernelsUnavailable as e:
        if impl == "cuda":
            raise KernelsUnavailable(
                f"CUDA kernels requested but they could not be loaded for cuda:{idx} ({e}): use impl='cpu' or 'auto'"
            ) from e
        if idx not in _warned:
            _warned.add(idx)
            log.warning("dcr.cuda: CUDA kernels unavailable on cuda:%d, using the reference path: %s", idx, e)
        return None


def _on_device(dev: Any) -> tuple[Any, int]:
    """(context manager making dev current, torch's current stream handle).
    Host tensors only reach the launchers in tests, with the emulated driver
    (tests/cuda_emu/fake_libcuda.cpp)."""
    torch = _torch()
    if dev.type == "cuda":
        return torch.cuda.device(dev), torch.cuda.current_stream(dev).cuda_stream
    return contextlib.nullcontext(), 0


# ----------------------------------------------------------------- diff


def _default_capacity(n: int) -> int:
    return min(n, n // 8 + 4096)


def _cuda_sparse_diff(
    k: _Loaded,
    old_w: torch.Tensor,
    new_w: torch.Tensor,
    chunk_elems: int,
    update_baseline: bool,
    with_new: bool,
    strategy: str,
    capacity: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    torch = _torch()
    U64, I32 = _driver.U64, _driver.I32
    dev = old_w.device
    n = old_w.numel()
    w = old_w.element_size()
    nchunks = -(-n // chunk_elems)
    wd = old_w.dtype
    counts = torch.zeros(nchunks, dtype=torch.int64, device=dev)
    if n == 0:
        e = torch.empty(0, dtype=torch.int32, device=dev)
        v = torch.empty(0, dtype=wd, device=dev)
        return counts, e, v, (v.clone() if with_new else None)
    ntiles = -(-n // (k.tile_bytes // w))
    aligned = int(old_w.data_ptr() % 16 == 0 and new_w.data_ptr() % 16 == 0)
    ctx, stream = _on_device(dev)
    with ctx:
        if strategy == "twopass":
            tile_counts = torch.empty(ntiles, dtype=torch.int64, device=dev)
            _launch(
                k, "diff_count", w, ntiles,
                [old_w, new_w, U64(n), U64(chunk_elems), I32(aligned), tile_counts, counts], stream,
            )  # fmt: skip
            incl = torch.cumsum(tile_counts, 0)
            total = int(incl[-1])
            offsets = incl - tile_counts
            positions = torch.empty(total, dtype=torch.int32, device=dev)
            values = torch.empty(total, dtype=wd, device=dev)
            new_values = torch.empty(total, dtype=wd, device=dev) if with_new else None
            if total:
                _launch(
                    k, "diff_compact", w, ntiles,
                    [old_w, new_w, U64(n), U64(chunk_elems), I32(aligned), offsets, U64(total),
                     positions, values, new_values, I32(int(update_baseline))], stream,
                )  # fmt: skip
            return counts, positions, values, new_values
        cap = _default_capacity(n) if capacity is None else max(0, min(int(capacity), n))
        workspace = torch.zeros(1 + ntiles, dtype=torch.int64, device=dev)
        positions = torch.empty(cap, dtype=torch.int32, device=dev)
        values = torch.empty(cap, dtype=wd, device=dev)
        new_values = torch.empty(cap, dtype=wd, device=dev) if with_new else None
        _launch(
            k, "diff_onepass", w, ntiles,
            [old_w, new_w, U64(n), U64(chunk_elems), I32(aligned), workspace, counts, U64(cap),
             positions, values, new_values, I32(int(update_baseline))], stream,
        )  # fmt: skip
        total = int(counts.sum())
        if total > cap:
            # Overflow: only the first `cap` entries were written (and only
            # those baseline words updated). Undo them, then run again sized.
            if update_baseline and cap:
                kept = torch.clamp(torch.cumsum(counts, 0), max=cap)
                kept_counts = torch.diff(kept, prepend=kept.new_zeros(1))
                _cuda_apply(k, old_w, chunk_elems, kept_counts, positions, values, True, None, False)
            log.debug("dcr.cuda: diff capacity %d < %d changed words, rerunning", cap, total)
            return _cuda_sparse_diff(k, old_w, new_w, chunk_elems, update_baseline, with_new, "onepass", total)
        if cap > total + total // 4 + 4096:  # don't pin a much larger scratch
            positions, values = positions[:total].clone(), values[:total].clone()
            new_values = new_values[:total].clone() if new_values is not None else None
        else:
            positions, values = positions[:total], values[:total]
            new_values = new_values[:total] if new_values is not None else None
        return counts, positions, values, new_values


def sparse_diff(
    old: torch.Tensor,
    new: torch.Tensor,
    chunk_elems: int,
    impl: str = "auto",
    update_baseline: bool = False,
    *,
    with_new: bool = False,
    strategy: str = "auto",
    capacity: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Bitwise diff of two same-dtype, same-shape contiguous tensors.

    Returns (counts int64[nchunks], positions int32[total], values[total]),
    values being the XOR words (uint8/int16/int32/int64 by width); with
    ``with_new=True`` a fourth tensor holds the new words (for overwrite
    frames). ``update_baseline=True`` also sets old = new (only the changed
    words are written). ``strategy``: 'onepass' (decoupled look-back, the
    default) or 'twopass' (count, scan, compact); $DCR_CUDA_DIFF_STRATEGY
    overrides 'auto'. ``capacity``: scratch entries for the one-pass kernel
    (default n/8 + 4096; a larger diff costs a second pass).
    """
    torch = _torch()
    _check_chunk(chunk_elems)
    if strategy not in ("auto", "onepass", "twopass"):
        raise ValueError(f"strategy must be 'auto', 'onepass' or 'twopass', got {strategy!r}")
    for t, nm in ((old, "old"), (new, "new")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{nm} must be a torch.Tensor, not {type(t).__name__}")
    if old.dtype != new.dtype or old.shape != new.shape:
        raise ValueError(
            f"old and new must have the same dtype and shape: old is {old.dtype}{tuple(old.shape)}, "
            f"new is {new.dtype}{tuple(new.shape)}"
        )
    if update_baseline and old.data_ptr() == new.data_ptr() and old.numel():
        raise ValueError("old and new share memory: nothing to diff and update")
    k = _select(impl, [old, new], "sparse_diff")
    old_w, new_w = _words(old, "old"), _words(new, "new")
    if k is None:
        out = _cpu_sparse_diff(old_w, new_w, chunk_elems, update_baseline, with_new)
    else:
        if strategy == "auto":
            strategy = os.environ.get("DCR_CUDA_DIFF_STRATEGY", "onepass")
            if strategy not in ("onepass", "twopass"):
                raise ValueError(f"DCR_CUDA_DIFF_STRATEGY must be 'onepass' or 'twopass', got {strategy!r}")
        out = _cuda_sparse_diff(k, old_w, new_w, chunk_elems, update_baseline, with_new, strategy, capacity)
    counts, positions, values, new_values = out
    if with_new:
        assert new_values is not None
        return counts, positions, values, new_values
    return counts, positions, values


# ----------------------------------------------------------------- apply


def _cuda_apply(
    k: _Loaded,
    target_w: torch.Tensor,
    chunk_elems: int,
    counts: torch.Tensor,
    positions: torch.Tensor,
    values_w: torch.Tensor,
    xor: bool,
    chunk_starts: torch.Tensor | None,
    validate: bool,
) -> None:
    torch = _torch()
    U64 = _driver.U64
    dev = target_w.device
    total = positions.numel()
    nchunks = counts.numel()
    incl = torch.cumsum(counts.to(device=dev, dtype=torch.int64), 0)
    if validate and int(incl[-1] if nchunks else 0) != total:
        raise ValueError(
            f"counts must sum to the number of entries: sum(counts) = {int(incl[-1]) if nchunks else 0}, "
            f"positions has {total} entries"
        )
    if total == 0:
        return
    if nchunks == 0:
        raise ValueError(f"{total} entries but no chunks (counts is empty)")
    error = torch.zeros(1, dtype=torch.int32, device=dev)
    starts = None
    if chunk_starts is not None:
        starts = chunk_starts.to(device=dev, dtype=torch.int64).contiguous()
    w = target_w.element_size()
    grid = -(-total // APPLY_PER_BLOCK)
    kind = "apply_xor" if xor else "apply_overwrite"
    ctx, stream = _on_device(dev)
    with ctx:
        _launch(
            k, kind, w, grid,
            [target_w, U64(target_w.numel()), U64(0 if chunk_starts is not None else chunk_elems), starts,
             incl, U64(nchunks), positions, values_w, U64(total), error], stream,
        )  # fmt: skip
    if validate and int(error.item()):
        raise ValueError(
            f"some entries pointed outside the target ({target_w.numel()} elements) or past chunk_elems "
            f"({chunk_elems}); those were skipped, the others applied"
        )


def _apply(
    xor: bool,
    target: torch.Tensor,
    chunk_elems: int,
    counts: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    impl: str,
    chunk_starts: torch.Tensor | None,
    validate: bool,
) -> torch.Tensor:
    torch = _torch()
    _check_chunk(chunk_elems)
    what = "apply_xor" if xor else "apply_overwrite"
    for t, nm in ((counts, "counts"), (positions, "positions"), (values, "values")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {nm} must be a torch.Tensor, not {type(t).__name__}")
    if positions.dtype not in (torch.int32, torch.uint32) or positions.dim() != 1:
        raise TypeError(f"{what}: positions must be a 1-D int32/uint32 tensor, got {positions.dtype}{tuple(positions.shape)}")
    if counts.dim() != 1 or counts.dtype.is_floating_point or counts.dtype == torch.bool:
        raise TypeError(f"{what}: counts must be a 1-D integer tensor, got {counts.dtype}{tuple(counts.shape)}")
    if values.element_size() != target.element_size() or values.numel() != positions.numel():
        raise ValueError(
            f"{what}: values must hold one {target.element_size()}-byte word per position: got "
            f"{values.numel()} x {values.element_size()} bytes for {positions.numel()} positions"
        )
    if chunk_starts is not None and chunk_starts.numel() != counts.numel():
        raise ValueError(f"{what}: chunk_starts has {chunk_starts.numel()} entries, counts {counts.numel()}")
    target_w = _words(target, "target")
    values_w = _words(values.contiguous(), "values")
    positions = positions.contiguous()
    k = _select(impl, [target, positions, values], what)
    if k is None:
        fn = _cpu_apply_xor if xor else _cpu_apply_overwrite
        fn(target_w, chunk_elems, counts, positions, values_w, chunk_starts)
    else:
        _cuda_apply(k, target_w, chunk_elems, counts, positions, values_w, xor, chunk_starts, validate)
    return target


def apply_xor(
    target: torch.Tensor,
    chunk_elems: int,
    counts: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    impl: str = "auto",
    *,
    chunk_starts: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """In place ``target[start(c) + pos] ^= value`` for every entry; start(c)
    is ``c * chunk_elems`` or ``chunk_starts[c]`` (element offsets, for
    arbitrary ranges). Returns target. ``validate=False`` skips the checks
    that need a device sync (sum of counts, out-of-range entries; the kernel
    still never writes out of bounds)."""
    return _apply(True, target, chunk_elems, counts, positions, values, impl, chunk_starts, validate)


def apply_overwrite(
    target: torch.Tensor,
    chunk_elems: int,
    counts: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    impl: str = "auto",
    *,
    chunk_starts: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """In place ``target[start(c) + pos] = value`` (scatter); see apply_xor."""
    return _apply(False, target, chunk_elems, counts, positions, values, impl, chunk_starts, validate)
