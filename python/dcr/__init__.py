"""dcr: bit-exact delta-compressed refit for RL weight sync.

Send only the stored bits that changed between two policy versions, and give
receivers exactly the bits a dense refit would.

File level::

    stats = dcr.diff_files("step_010.safetensors", "step_011.safetensors", "10-11.dcr")
    dcr.apply_file("10-11.dcr", "replica.safetensors")      # in place
    dcr.refit_file("10-11.dcr", "replica.safetensors")      # in place, crash-safe, resumable

A checkpoint path may also be a directory of shards (``model-00001-of-00004.
safetensors``, ..., with or without ``model.safetensors.index.json``) or its
index: the shards are one checkpoint, the union of their tensors.

Tensor level (numpy arrays or CPU torch tensors, bf16 included, zero copy)::

    delta, stats = dcr.diff_tensors(old_state_dict, new_state_dict)
    dcr.apply_tensors(delta, live_state_dict)                # in place
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dcr._core import (
    DEFAULT_CHUNK_BYTES,
    FORMAT_VERSION,
    BaseMismatchError,
    CheckpointError,
    CorruptDeltaError,
    DcrError,
    IncompleteDeltaError,
    JournalError,
    LayoutMismatchError,
    TransportError,
    UnsupportedFormatError,
    VerificationError,
    __version__,
    apply_file,
    compare_files,
    diff_files,
    file_digest,
    inspect_file,
    receiver_status,
    refit_file,
)
from dcr import _core

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FORMAT_VERSION",
    "BaseMismatchError",
    "CheckpointError",
    "CorruptDeltaError",
    "DcrError",
    "IncompleteDeltaError",
    "JournalError",
    "LayoutMismatchError",
    "TransportError",
    "UnsupportedFormatError",
    "VerificationError",
    "__version__",
    "apply_file",
    "apply_tensors",
    "compare_files",
    "diff_files",
    "diff_tensors",
    "digest_tensors",
    "tensor_digests",
    "file_digest",
    "inspect_file",
    "receiver_status",
    "refit_file",
]


def diff_tensors(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    kind: str = "xor",
    zstd_level: int = 1,
    mode: str = "free",
    base_version: int = 0,
    target_version: int = 1,
    threads: int | None = None,
    base_digests: Mapping[str, bytes] | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """Delta from ``old`` to ``new`` (same names, dtypes and shapes).

    Returns the delta bytes and its statistics. The GIL is released while the
    core works; the tensors are read in place. ``base_digests``: the tensor
    digests of ``old`` when known (:func:`tensor_digests` of the last
    committed version): then only the change scan reads the unchanged bytes.
    ``threads``: worker threads (default: every core); 1 works on the calling
    thread itself, with no hand-off to a pool.
    """
    return _core.diff_tensors(
        old,
        new,
        chunk_bytes=chunk_bytes,
        kind=kind,
        zstd_level=zstd_level,
        mode=mode,
        base_version=base_version,
        target_version=target_version,
        threads=threads,
        base_digests=base_digests,
    )


def apply_tensors(delta: bytes, tensors: Mapping[str, Any], *, threads: int | None = None,
                  base_digests: Mapping[str, bytes] | None = None) -> dict[str, Any]:
    """Apply ``delta`` in place to ``tensors`` (writable, contiguous).

    Refused before any byte changes when the tensors are not the delta's base;
    verified against the delta's target digests afterwards (and rolled back on
    a mismatch, or when a chunk does not decode). ``base_digests``: the
    tensors' digests when the caller vouches for them (kept from its last
    verified version and nothing else wrote the tensors since): the base check
    then reads no tensor bytes and the target digests are verified from the
    words the delta writes.
    ``threads`` as in :func:`diff_tensors`.
    """
    return _core.apply_tensors(bytes(delta), tensors, threads=threads, base_digests=base_digests)


def tensor_digests(tensors: Mapping[str, Any]) -> dict[str, bytes]:
    """Each tensor's digest (16 bytes; they add up over elements, see
    docs/format.md). Keep them with a committed version to diff or apply the
    next delta without digesting the whole checkpoint again."""
    return _core.tensor_digests(tensors)


def digest_tensors(tensors: Mapping[str, Any]) -> str:
    """Checkpoint digest (hex) of a state dict: equal digests mean equal bits."""
    return _core.digest_tensors(tensors)
