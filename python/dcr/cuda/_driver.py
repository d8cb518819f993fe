"""Minimal CUDA driver API through ctypes: load a CUBIN/PTX image into the
current device's primary context and launch kernels on torch's current
stream with correctly typed (64-bit) arguments.

torch's own launcher (``torch.cuda._compile_kernel(...)(args=...)``) passes
every Python int as a 32-bit C ``int``; our kernels take 64-bit sizes, so
we launch through ``cuLaunchKernel`` ourselves.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Sequence

__all__ = ["DriverError", "Module", "U64", "I32", "Ptr"]


class DriverError(RuntimeError):
    pass


_lock = threading.Lock()
_libcuda: ctypes.CDLL | None = None


def libcuda() -> ctypes.CDLL:
    global _libcuda
    with _lock:
        if _libcuda is None:
            # $DCR_LIBCUDA: tests point this at an emulated driver
            path = os.environ.get("DCR_LIBCUDA") or "libcuda.so.1"
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                raise DriverError(f"the CUDA driver library {path} could not be loaded: {e}") from e
            vp, pvp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
            lib.cuInit.argtypes = [ctypes.c_uint]
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            lib.cuCtxGetCurrent.argtypes = [pvp]
            lib.cuCtxSetCurrent.argtypes = [vp]
            lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
            lib.cuDevicePrimaryCtxRetain.argtypes = [pvp, ctypes.c_int]
            lib.cuModuleLoadData.argtypes = [pvp, ctypes.c_char_p]
            lib.cuModuleGetFunction.argtypes = [pvp, vp, ctypes.c_char_p]
            lib.cuLaunchKernel.argtypes = [
                vp,
                ctypes.c_uint,
                ctypes.c_uint,
                ctypes.c_uint,
                ctypes.c_uint,
                ctypes.c_uint,
                ctypes.c_uint,
                ctypes.c_uint,
                vp,
                pvp,
                pvp,
            ]
            for f in (
                lib.cuInit,
                lib.cuGetErrorString,
                lib.cuCtxGetCurrent,
                lib.cuCtxSetCurrent,
                lib.cuDeviceGet,
                lib.cuDevicePrimaryCtxRetain,
                lib.cuModuleLoadData,
                lib.cuModuleGetFunction,
                lib.cuLaunchKernel,
            ):
                f.restype = ctypes.c_int
            _libcuda = lib
        return _libcuda


def check(rc: int, what: str) -> None:
    if rc == 0:
        return
    s = ctypes.c_char_p()
    libcuda().cuGetErrorString(rc, ctypes.byref(s))
    raise DriverError(f"{what} failed with CUDA error {rc} ({s.value.decode() if s.value else 'unknown'})")


def ensure_context(device_index: int) -> ctypes.c_void_p:
    """Make device's primary context current on this thread (torch uses the
    same primary context), return it."""
    lib = libcuda()
    check(lib.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value), "cuDevicePrimaryCtxRetain")
    cur = ctypes.c_void_p()
    check(lib.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
    if cur.value != ctx.value:
        check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


class U64:
    __slots__ = ("v",)

    def __init__(self, v: int) -> None:
        if v < 0 or v >= 1 << 64:
            raise OverflowError(f"{v} does not fit an unsigned 64-bit kernel argument")
        self.v = v


class I32:
    __slots__ = ("v",)

    def __init__(self, v: int) -> None:
        if v < -(1 << 31) or v >= 1 << 31:
            raise OverflowError(f"{v} does not fit a 32-bit kernel argument")
        self.v = v


class Ptr:
    """A device pointer; 0 is a null pointer."""

    __slots__ = ("v",)

    def __init__(self, v: int) -> None:
        self.v = v


def _c_arg(a: Any) -> ctypes._SimpleCData:
    if isinstance(a, U64):
        return ctypes.c_uint64(a.v)
    if isinstance(a, I32):
        return ctypes.c_int32(a.v)
    if isinstance(a, Ptr):
        return ctypes.c_void_p(a.v)
    if hasattr(a, "data_ptr"):  # a torch tensor
        return ctypes.c_void_p(a.data_ptr())
    if a is None:
        return ctypes.c_void_p(0)
    raise TypeError(f"kernel arguments must be U64, I32, Ptr, a tensor or None, not {type(a).__name__}")


class Module:
    """A loaded CUDA module (one per device/context)."""

    def __init__(self, image: bytes, device_index: int, *, what: str = "module") -> None:
        lib = libcuda()
        self.device_index = device_index
        self.ctx = ensure_context(device_index)
        self._mod = ctypes.c_void_p()
        data = image if image.endswith(b"\0") or not image.lstrip().startswith(b"//") else image + b"\0"
        check(lib.cuModuleLoadData(ctypes.byref(self._mod), data), f"cuModuleLoadData({what})")
        self._funcs: dict[str, ctypes.c_void_p] = {}

    def function(self, name: str) -> ctypes.c_void_p:
        f = self._funcs.get(name)
        if f is None:
            f = ctypes.c_void_p()
            check(libcuda().cuModuleGetFunction(ctypes.byref(f), self._mod, name.encode()), f"cuModuleGetFunction({name})")
            self._funcs[name] = f
        return f

    def launch(self, name: str, grid: int, block: int, args: Sequence[Any], stream: int) -> None:
        if grid <= 0:
            return
        if grid >= 1 << 31:
            raise OverflowError(f"grid of {grid} blocks is too large for {name}")
        lib = libcuda()
        f = self.function(name)
        cargs = [_c_arg(a) for a in args]
        params = (ctypes.c_void_p * len(cargs))(*[ctypes.addressof(c) for c in cargs])
        cur = ctypes.c_void_p()
        check(lib.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
        if cur.value != self.ctx.value:
            check(lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        check(
            lib.cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, ctypes.c_void_p(stream), params, None),
            f"cuLaunchKernel({name})",
        )
