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

from dcr import _buffers
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
    if old.keys() != new.keys():
        missing = sorted(set(old) ^ set(new))[:5]
        raise LayoutMismatchError(f"old and new hold different tensor names (e.g. {missing}); pass matching state dicts")
    olds = _buffers.describe(old)
    news = _buffers.describe({k: new[k] for k in old})
    names, dtypes, shapes, old_spans, _ = olds
    _, new_dtypes, new_shapes, new_spans, _ = news
    if dtypes != new_dtypes or shapes != new_shapes:  # whole lists first: a refit's layouts match
        for n, a, b, sa, sb in zip(names, dtypes, new_dtypes, shapes, new_shapes):
            if a != b or (sa != sb and list(sa) != list(sb)):  # torch.Size or list
                raise LayoutMismatchError(f"tensor {n!r}: old is {a}{list(sa)}, new is {b}{list(sb)}; shapes and dtypes must match")
    delta, stats = _core.diff_buffers(
        names,
        dtypes,
        shapes,
        old_spans,
        new_spans,
        chunk_bytes=chunk_bytes,
        kind=kind,
        zstd_level=zstd_level,
        mode=mode,
        base_version=base_version,
        target_version=target_version,
        threads=threads,
        base_digests=_digest_list(base_digests, names),
    )
    del olds, news  # owners stay referenced until here
    return delta, stats


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
    described = _buffers.describe(tensors, writable=True)
    names, dtypes, shapes, ptrs, _ = described
    result = _core.apply_buffers(bytes(delta), names, dtypes, shapes, ptrs, threads=threads,
                                 base_digests=_digest_list(base_digests, names))
    del described
    return result


def _digest_list(digests: Mapping[str, bytes] | None, names: list[str]) -> list[bytes] | None:
    if digests is None:
        return None
    try:
        return [bytes(digests[n]) for n in names]
    except KeyError:
        missing = [n for n in names if n not in digests]
        raise LayoutMismatchError(f"base_digests lacks {len(missing)} tensors, e.g. {missing[:3]}; "
                                  "pass dcr.tensor_digests() of the same state dict") from None


def tensor_digests(tensors: Mapping[str, Any]) -> dict[str, bytes]:
    """Each tensor's digest (16 bytes; they add up over elements, see
    docs/format.md). Keep them with a committed version to diff or apply the
    next delta without digesting the whole checkpoint again."""
    described = _buffers.describe(tensors)
    names, dtypes, shapes, ptrs, _ = described
    out = _core.tensor_digest_buffers(names, dtypes, shapes, ptrs)
    del described
    return dict(zip(names, out))


def digest_tensors(tensors: Mapping[str, Any]) -> str:
    """Checkpoint digest (hex) of a state dict: equal digests mean equal bits."""
    described = _buffers.describe(tensors)
    names, dtypes, shapes, ptrs, _ = described
    digest = _core.digest_buffers(names, dtypes, shapes, ptrs)
    del described
    return digest
