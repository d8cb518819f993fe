"""NVRTC through ctypes: compile ``cuda/dcr_kernels.cu`` without nvcc or a GPU.

Needs only the NVRTC shared library, which the CUDA builds of torch pull in
as the ``nvidia-cuda-nvrtc`` wheel (``nvidia/cu13/lib/libnvrtc.so.13`` for
CUDA 13, ``nvidia/cuda_nvrtc/lib/libnvrtc.so.12`` for CUDA 12). No torch
import happens here.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import site
import sys
import threading
from pathlib import Path
from typing import Any

__all__ = [
    "NvrtcError",
    "NvrtcNotFound",
    "find_nvrtc",
    "nvrtc_version",
    "compile_source",
    "kernel_source_path",
    "kernel_source",
    "KERNEL_SOURCE_NAME",
    "DEFAULT_OPTIONS",
]

KERNEL_SOURCE_NAME = "dcr_kernels.cu"
# Options for every compile; part of the cache key.
DEFAULT_OPTIONS: tuple[str, ...] = ("-std=c++17",)


class NvrtcNotFound(RuntimeError):
    """The NVRTC shared library could not be found or loaded."""


class NvrtcError(RuntimeError):
    """NVRTC rejected the source; the message carries the compile log."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: str | None = None


def _site_dirs() -> list[str]:
    dirs: list[str] = []
    try:
        dirs.extend(site.getsitepackages())
    except AttributeError:  # virtualenv's old site.py
        pass
    try:
        dirs.append(site.getusersitepackages())
    except AttributeError:
        pass
    dirs.extend(p for p in sys.path if p and os.path.isdir(p))
    seen: set[str] = set()
    out = []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def _major_of(path: str) -> int:
    m = re.search(r"libnvrtc\.so\.(\d+)", os.path.basename(path))
    return int(m.group(1)) if m else -1


def candidate_paths() -> list[str]:
    """NVRTC libraries that could be loaded, best first."""
    cands: list[str] = []
    env = os.environ.get("DCR_NVRTC_LIB")
    if env:
        cands.append(env)
    for d in _site_dirs():
        for pattern in (
            "nvidia/cu*/lib/libnvrtc.so*",
            "nvidia/cuda_nvrtc/lib/libnvrtc.so*",
        ):
            cands.extend(sorted(glob.glob(os.path.join(d, pattern))))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root:
            cands.extend(sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*"))))
            cands.extend(sorted(glob.glob(os.path.join(root, "lib", "libnvrtc.so*"))))
    cands.extend(sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*")))
    # libnvrtc-builtins is loaded by libnvrtc itself; .alt is the variant
    # with a different C++ ABI for the host compiler integration.
    cands = [
        c
        for c in cands
        if "builtins" not in os.path.basename(c) and ".alt." not in os.path.basename(c)
    ]
    # the major version torch was built with first (a CUBIN from a newer
    # NVRTC may not load on the driver torch runs on), then newest first
    want = _torch_cuda_major()
    order = {c: i for i, c in reversed(list(enumerate(cands)))}
    uniq = sorted(order, key=lambda c: (_major_of(c) != want, -_major_of(c), order[c]))
    if env and env in uniq:
        uniq.remove(env)
        uniq.insert(0, env)
    return uniq


def _torch_cuda_major() -> int:
    torch = sys.modules.get("torch")  # only if the caller already imported it
    ver = getattr(getattr(torch, "version", None), "cuda", None)
    try:
        return int(str(ver).split(".")[0])
    except ValueError:
        return -1


def find_nvrtc() -> ctypes.CDLL:
    """Load NVRTC (once). Raises NvrtcNotFound with every path tried."""
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            return _lib
        tried: list[str] = []
        for path in candidate_paths() + ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]:
            try:
                _preload_builtins(path)
                lib = ctypes.CDLL(path)
                lib.nvrtcVersion  # noqa: B018 - symbol check
            except (OSError, AttributeError) as e:
                tried.append(f"{path}: {e}")
                continue
            _configure(lib)
            _lib, _lib_path = lib, path
            return lib
        raise NvrtcNotFound(
            "the NVRTC library (libnvrtc.so) was not found; it ships in the "
            "'nvidia-cuda-nvrtc' wheel that CUDA builds of torch depend on "
            "(pip install nvidia-cuda-nvrtc), or set DCR_NVRTC_LIB=/path/to/libnvrtc.so. Tried:\n  "
            + "\n  ".join(tried)
        )


def _preload_builtins(path: str) -> None:
    """libnvrtc dlopen()s libnvrtc-builtins.so.X.Y by bare name at compile
    time; the wheels set no RPATH for it, so load it first from the same
    folder (a library already loaded satisfies a dlopen by soname)."""
    folder = os.path.dirname(path)
    if not folder:
        return
    for b in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so*"))):
        if ".alt." in os.path.basename(b):
            continue
        try:
            ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue


def nvrtc_path() -> str | None:
    find_nvrtc()
    return _lib_path


def _configure(lib: ctypes.CDLL) -> None:
    c_size_p = ctypes.POINTER(ctypes.c_size_t)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
    lib.nvrtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    lib.nvrtcCreateProgram.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.nvrtcGetProgramLogSize.argtypes = [ctypes.c_void_p, c_size_p]
    lib.nvrtcGetProgramLog.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nvrtcGetPTXSize.argtypes = [ctypes.c_void_p, c_size_p]
    lib.nvrtcGetPTX.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nvrtcGetCUBINSize.argtypes = [ctypes.c_void_p, c_size_p]
    lib.nvrtcGetCUBIN.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    for name in (
        "nvrtcVersion",
        "nvrtcCreateProgram",
        "nvrtcDestroyProgram",
        "nvrtcCompileProgram",
        "nvrtcGetProgramLogSize",
        "nvrtcGetProgramLog",
        "nvrtcGetPTXSize",
        "nvrtcGetPTX",
        "nvrtcGetCUBINSize",
        "nvrtcGetCUBIN",
    ):
        getattr(lib, name).restype = ctypes.c_int


def nvrtc_version() -> tuple[int, int]:
    lib = find_nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        msg = lib.nvrtcGetErrorString(rc)
        raise NvrtcError(f"{what} failed: {msg.decode() if msg else rc}")


def kernel_source_path() -> Path:
    """Where ``dcr_kernels.cu`` is: $DCR_CUDA_SOURCE, package data, or the repo's cuda/."""
    env = os.environ.get("DCR_CUDA_SOURCE")
    here = Path(__file__).resolve().parent
    cands = ([Path(env)] if env else []) + [
        here / KERNEL_SOURCE_NAME,  # a wheel that ships it as package data
        here.parents[2] / "cuda" / KERNEL_SOURCE_NAME,  # repo checkout: python/dcr/cuda -> cuda/
    ]
    for c in cands:
        if c.is_file():
            return c
    raise FileNotFoundError(
        f"{KERNEL_SOURCE_NAME} not found (looked in {', '.join(map(str, cands))}); "
        "set DCR_CUDA_SOURCE to its path"
    )


def kernel_source() -> str:
    return kernel_source_path().read_text(encoding="utf-8")


def _normalise_arch(arch: str | int) -> tuple[str, str]:
    """'90', 90, 'sm_90', 'compute_90', '9.0' -> ('90', 'sm'|'compute'|'')."""
    a = str(arch).strip()
    kind = ""
    for prefix in ("sm_", "compute_"):
        if a.startswith(prefix):
            kind = prefix[:-1]
            a = a[len(prefix) :]
    a = a.replace(".", "")
    if not re.fullmatch(r"\d{2,3}[af]?", a):
        raise ValueError(f"bad GPU architecture {arch!r}: expected e.g. 'compute_90', 'sm_80' or '90'")
    return a, kind


def compile_source(
    source: str,
    arch: str | int,
    *,
    target: str = "ptx",
    options: tuple[str, ...] | list[str] = DEFAULT_OPTIONS,
    name: str = KERNEL_SOURCE_NAME,
    with_log: bool = False,
) -> Any:
    """Compile CUDA C++ ``source`` with NVRTC.

    ``target="ptx"`` compiles for ``compute_<arch>`` and returns PTX text
    (bytes, no trailing NUL); ``target="cubin"`` compiles for ``sm_<arch>``
    and returns the CUBIN image; ``with_log=True`` returns (image, log).
    Raises NvrtcError with the compile log.
    """
    if target not in ("ptx", "cubin"):
        raise ValueError(f"target must be 'ptx' or 'cubin', not {target!r}")
    num, _ = _normalise_arch(arch)
    gpu_arch = f"{'compute' if target == 'ptx' else 'sm'}_{num}"
    lib = find_nvrtc()
    prog = ctypes.c_void_p()
    _check(
        lib,
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        opts = [f"--gpu-architecture={gpu_arch}".encode()] + [o.encode() for o in options]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        log_size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size))
        log_buf = ctypes.create_string_buffer(max(log_size.value, 1))
        lib.nvrtcGetProgramLog(prog, log_buf)
        log = log_buf.value.decode(errors="replace")
        if rc != 0:
            err = lib.nvrtcGetErrorString(rc)
            raise NvrtcError(
                f"NVRTC could not compile {name} for {gpu_arch} "
                f"({err.decode() if err else rc}):\n{log}",
                log,
            )
        size = ctypes.c_size_t()
        if target == "ptx":
            _check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
            buf = ctypes.create_string_buffer(size.value)
            _check(lib, lib.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
            image = buf.raw.rstrip(b"\0")
        else:
            _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            buf = ctypes.create_string_buffer(size.value)
            _check(lib, lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
            image = buf.raw
        return (image, log) if with_log else image
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
