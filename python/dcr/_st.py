"""Minimal safetensors writer for raw tensors (dtype name, shape, bytes), so
that bf16 checkpoints can be written without torch. Layout as the format
specifies: u64 header length, JSON header, 8-byte aligned data."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping

import numpy as np


def save_raw(path: str | os.PathLike[str], tensors: Mapping[str, tuple[str, list[int], np.ndarray]]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    items = sorted(tensors.items())
    for name, (dtype, shape, data) in items:
        n = data.nbytes
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, (_, _, data) in items:
            f.write(np.ascontiguousarray(data).view(np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 bit patterns (round to nearest even; NaNs stay NaN)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return rounded
