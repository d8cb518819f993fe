"""Reference implementations (the test oracle) in vectorised torch ops.

They run on whatever device the tensors live on, work on integer views of
the words (bit patterns, never float compares), and are the seam where the
Rust CPU path will be wired in later: keep the names and signatures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["_cpu_sparse_diff", "_cpu_apply_xor", "_cpu_apply_overwrite"]


def _cpu_sparse_diff(
    old_w: torch.Tensor,
    new_w: torch.Tensor,
    chunk_elems: int,
    update_baseline: bool = False,
    with_new: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """old_w/new_w: flat contiguous integer word views of equal width.

    Returns (counts int64[nchunks], positions int32[total], xor words[total],
    new words[total] or None); with update_baseline, old_w[changed] = new_w.
    """
    import torch

    n = old_w.numel()
    nchunks = -(-n // chunk_elems)
    x = torch.bitwise_xor(old_w, new_w)
    idx = torch.nonzero(x).reshape(-1)  # ascending global order
    chunk = torch.div(idx, chunk_elems, rounding_mode="floor")
    counts = torch.bincount(chunk, minlength=nchunks)
    positions = (idx - chunk * chunk_elems).to(torch.int32)
    values = x[idx]
    new_values = new_w[idx] if (with_new or update_baseline) else None
    if update_baseline and new_values is not None and idx.numel():
        old_w[idx] = new_values
    return counts, positions, values, (new_values if with_new else None)


def _entry_indices(
    n_target: int,
    chunk_elems: int,
    counts: torch.Tensor,
    positions: torch.Tensor,
    chunk_starts: torch.Tensor | None,
) -> torch.Tensor:
    import torch

    total = positions.numel()
    nchunks = counts.numel()
    if bool((counts < 0).any()) or int(counts.sum()) != total:
        raise ValueError(
            f"counts must be non-negative and sum to the number of entries: sum(counts) = "
            f"{int(counts.sum())}, positions has {total} entries"
        )
    dev = positions.device
    entry_chunk = torch.repeat_interleave(torch.arange(nchunks, device=dev), counts.to(dev))
    pos = positions.to(torch.int64)
    if chunk_starts is not None:
        starts = chunk_starts.to(device=dev, dtype=torch.int64)[entry_chunk]
    else:
        starts = entry_chunk * chunk_elems
        if bool((pos >= chunk_elems).any()):
            raise ValueError(
                f"a position is >= chunk_elems ({chunk_elems}): max position {int(pos.max())}"
            )
    idx = starts + pos
    if total and (bool((pos < 0).any()) or bool((idx < 0).any()) or int(idx.max()) >= n_target):
        raise ValueError(
            f"an entry points outside the target ({n_target} elements): "
            f"largest index {int(idx.max())}, smallest position {int(pos.min())}"
        )
    return idx


def _cpu_apply_xor(
    target_w: torch.Tensor,
    chunk_elems: int,
    counts: torch.Tensor,
    positions: torch.Tensor,
    values_w: torch.Tensor,
    chunk_starts: torch.Tensor | None = None,
) -> None:
    """In place: target_w[start(c) + pos] ^= value for every entry."""
    if positions.numel() == 0:
        _entry_indices(target_w.numel(), chunk_elems, counts, positions, chunk_starts)
        return
    idx = _entry_indices(target_w.numel(), chunk_elems, counts, positions, chunk_starts)
    target_w[idx] = target_w[idx] ^ values_w.to(target_w.device)


def _cpu_apply_overwrite(
    target_w: torch.Tensor,
    chunk_elems: int,
    counts: torch.Tensor,
    positions: torch.Tensor,
    values_w: torch.Tensor,
    chunk_starts: torch.Tensor | None = None,
) -> None:
    """In place: target_w[start(c) + pos] = value for every entry."""
    idx = _entry_indices(target_w.numel(), chunk_elems, counts, positions, chunk_starts)
    if idx.numel():
        target_w[idx] = values_w.to(target_w.device)
