"""Affine placement maps from trainer shards to canonical checkpoint coordinates.

A trainer rank holds *local* tensors (FSDP2/DTensor shards, Megatron
tensor-parallel slices, fused QKV or gate/up blocks, stacked experts,
transformers' fused MoE tensors). Each local tensor is described by a
:class:`LocalPlacement`: a few :class:`Piece` s, each a contiguous run of the
local tensor that lands on an affine (offset + strides) set of elements of one
*canonical* tensor, a tensor of the Hugging Face checkpoint. Changed local
positions are then projected to (canonical tensor, flat index) with
:func:`project` without gathering any full tensor.

Rules every builder keeps:

* a local element belongs to at most one piece; one that belongs to none
  (vocabulary padding) is never exported;
* over all ranks every canonical element is exported exactly once: a
  replicated tensor is exported by one replica only (mesh coordinate 0 along
  each replicated mesh dimension, ``tp_rank == 0``, global rank 0), the
  others get a placement with no pieces;
* pieces are few and large: one per contiguous block, rows merged into an
  N-d piece whenever the map stays affine, dimensions merged when contiguous.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

__all__ = [
    "CanonicalTensor",
    "LocalPlacement",
    "Piece",
    "Placements",
    "column_parallel",
    "dtensor_placement",
    "fused_qkv",
    "gated_fc1",
    "identity",
    "module_placements",
    "project",
    "replicated",
    "row_parallel",
    "stacked_experts",
    "transformers_placements",
    "vocab_parallel",
    "vocab_padded_size",
]


# --------------------------------------------------------------------------
# data model
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class CanonicalTensor:
    name: str  # Hugging Face checkpoint name
    shape: tuple[int, ...]
    dtype: torch.dtype  # canonical (checkpoint) dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Piece:
    """A contiguous run of a rank's local tensor, read row-major with `shape`:
    local flat element index  local_offset + ravel(u, shape)
    maps to canonical flat element index
    canonical_offset + sum(u[d] * canonical_strides[d]) of tensor `canonical`."""

    canonical: str
    local_offset: int
    shape: tuple[int, ...]
    canonical_offset: int
    canonical_strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class LocalPlacement:
    local_name: str  # name of the rank's local (contiguous) tensor, e.g. Megatron param name
    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]  # disjoint; local elements in no piece (e.g. vocab padding) are not exported;
    # EMPTY on a rank that holds a replica it does not own (only one replica contributes)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def canonical_names(self) -> tuple[str, ...]:
        """Distinct canonical tensors of the pieces, in order of first
        appearance; :func:`project` returns indices into this tuple."""
        return tuple(dict.fromkeys(p.canonical for p in self.pieces))

    @cached_property
    def _table(self) -> dict[str, np.ndarray]:
        """Pieces sorted by local offset as numpy arrays for :func:`project`;
        shapes and strides are left-padded to a common rank (size 1, stride 0)."""
        order = sorted(range(len(self.pieces)), key=lambda i: self.pieces[i].local_offset)
        ps = [self.pieces[i] for i in order]
        names = {n: i for i, n in enumerate(self.canonical_names)}
        nd = max((len(p.shape) for p in ps), default=1)
        shp = np.ones((len(ps), nd), dtype=np.int64)
        std = np.zeros((len(ps), nd), dtype=np.int64)
        for i, p in enumerate(ps):
            shp[i, nd - len(p.shape):] = p.shape
            std[i, nd - len(p.shape):] = p.canonical_strides
        return {
            "start": np.array([p.local_offset for p in ps], dtype=np.int64),
            "end": np.array([p.local_offset + p.numel for p in ps], dtype=np.int64),
            "name": np.array([names[p.canonical] for p in ps], dtype=np.int64),
            "coff": np.array([p.canonical_offset for p in ps], dtype=np.int64),
            "shape": shp,
            "strides": std,
        }


@dataclass
class Placements:
    """Every local tensor of one rank and the canonical tensors they land in."""

    local: list[LocalPlacement] = field(default_factory=list)
    canonical: dict[str, CanonicalTensor] = field(default_factory=dict)

    def add(self, placement: LocalPlacement, canonical: CanonicalTensor | Iterable[CanonicalTensor]) -> Placements:
        """Append a builder's result; a canonical tensor named twice must agree."""
        for c in [canonical] if isinstance(canonical, CanonicalTensor) else canonical:
            old = self.canonical.setdefault(c.name, c)
            if old != c:
                raise ValueError(f"canonical tensor {c.name} declared as {old.shape}/{old.dtype} "
                                 f"and as {c.shape}/{c.dtype}: builders disagree on the checkpoint layout")
        self.local.append(placement)
        return self

    def by_local_name(self) -> dict[str, LocalPlacement]:
        return {p.local_name: p for p in self.local}

    def validate(self) -> Placements:
        """Check local names are unique, every piece lies inside its local and
        canonical tensor, and the pieces of a local tensor are disjoint."""
        seen: set[str] = set()
        for lp in self.local:
            if lp.local_name in seen:
                raise ValueError(f"local tensor {lp.local_name} is placed twice")
            seen.add(lp.local_name)
            n = lp.local_numel
            end_prev, prev = 0, None
            for p in sorted(lp.pieces, key=lambda p: p.local_offset):
                where = f"{lp.local_name} piece at local offset {p.local_offset} -> {p.canonical}"
                c = self.canonical.get(p.canonical)
                if c is None:
                    raise ValueError(f"{where}: canonical tensor not declared")
                if len(p.shape) != len(p.canonical_strides) or not p.shape:
                    raise ValueError(f"{where}: shape {p.shape} and strides {p.canonical_strides} "
                                     "need the same non-zero rank")
                if any(s < 1 for s in p.shape) or any(st < 1 for st in p.canonical_strides):
                    raise ValueError(f"{where}: shape {p.shape} and strides {p.canonical_strides} must be positive")
                if p.local_offset < 0 or p.local_offset + p.numel > n:
                    raise ValueError(f"{where}: local run [{p.local_offset}, {p.local_offset + p.numel}) "
                                     f"outside the local tensor of {n} elements {lp.local_shape}")
                if p.local_offset < end_prev:
                    raise ValueError(f"{where}: overlaps the piece at local offset {prev}")
                last = p.canonical_offset + sum((s - 1) * st for s, st in zip(p.shape, p.canonical_strides))
                if p.canonical_offset < 0 or last >= c.numel:
                    raise ValueError(f"{where}: canonical span [{p.canonical_offset}, {last}] outside "
                                     f"{c.name} of {c.numel} elements {c.shape}")
                end_prev, prev = p.local_offset + p.numel, p.local_offset
        return self


def project(placement: LocalPlacement, local_flat_indices: np.ndarray, *,
            return_mask: bool = False) -> tuple[np.ndarray, ...]:
    """Map local flat element indices to canonical coordinates.

    Returns ``(name_index, canonical_flat)``: int64 arrays, ``name_index``
    indexing ``placement.canonical_names``, in the order of the input with
    indices that fall in no piece dropped. ``return_mask=True`` appends the
    boolean mask of the kept inputs (to select the matching values)."""
    idx = np.asarray(local_flat_indices, dtype=np.int64).reshape(-1)
    t = placement._table
    if t["start"].size == 0:
        empty = np.empty(0, dtype=np.int64)
        return (empty, empty.copy(), np.zeros(idx.shape, dtype=bool)) if return_mask else (empty, empty.copy())
    r = np.searchsorted(t["start"], idx, side="right") - 1
    np.maximum(r, 0, out=r)
    keep = (idx >= t["start"][r]) & (idx < t["end"][r])
    r = r[keep]
    rem = idx[keep] - t["start"][r]
    out = t["coff"][r].copy()
    shp, std = t["shape"], t["strides"]
    for d in range(shp.shape[1] - 1, -1, -1):
        s = shp[r, d]
        out += (rem % s) * std[r, d]
        rem //= s
    res = (t["name"][r], out)
    return (*res, keep) if return_mask else res


# --------------------------------------------------------------------------
# piece algebra
# --------------------------------------------------------------------------


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def _simplify(shape: Sequence[int], strides: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Drop size-1 dimensions and merge dimension d into d+1 where the
    canonical side is contiguous across them (strides[d] == shape[d+1]*strides[d+1])."""
    dims = [(s, st) for s, st in zip(shape, strides) if s != 1]
    out: list[tuple[int, int]] = []
    for s, st in reversed(dims):
        if out and st == out[-1][0] * out[-1][1]:
            out[-1] = (out[-1][0] * s, out[-1][1])
        else:
            out.append((s, st))
    out.reverse()
    if not out:
        return (1,), (1,)
    return tuple(s for s, _ in out), tuple(st for _, st in out)


def _piece(canonical: str, local_offset: int, shape: Sequence[int], canonical_offset: int,
           strides: Sequence[int]) -> Piece:
    shp, std = _simplify(shape, strides)
    return Piece(canonical, int(local_offset), shp, int(canonical_offset), std)


def _merge(pieces: Iterable[Piece]) -> tuple[Piece, ...]:
    """Merge runs of consecutive pieces (same canonical tensor, shape and
    strides, locally adjacent, constant positive canonical offset step) into
    one piece with one more dimension, until nothing merges."""
    ps = sorted(pieces, key=lambda p: p.local_offset)
    while True:
        out: list[Piece] = []
        i = 0
        while i < len(ps):
            a, j = ps[i], i + 1
            step = ps[j].canonical_offset - a.canonical_offset if j < len(ps) else 0
            while (j < len(ps) and step > 0 and ps[j].canonical == a.canonical and ps[j].shape == a.shape
                   and ps[j].canonical_strides == a.canonical_strides
                   and ps[j].local_offset == ps[j - 1].local_offset + a.numel
                   and ps[j].canonical_offset - ps[j - 1].canonical_offset == step):
                j += 1
            if j - i > 1:
                out.append(_piece(a.canonical, a.local_offset, (j - i, *a.shape), a.canonical_offset,
                                  (step, *a.canonical_strides)))
            else:
                out.append(a)
            i = j
        if len(out) == len(ps):
            return tuple(out)
        ps = out


def _box_pieces(canonical: str, index: Sequence[np.ndarray], global_shape: Sequence[int],
                local_offset: int = 0, canonical_offset: int = 0) -> list[Piece]:
    """Pieces of a local tensor that holds the Cartesian product of the global
    indices ``index[d]`` along each dimension (row-major, contiguous)."""
    if any(len(ix) == 0 for ix in index):
        return []
    if not index:  # 0-d tensor
        return [_piece(canonical, local_offset, (1,), canonical_offset, (1,))]
    gstr = _strides(global_shape)
    runs = [_runs_1d(np.asarray(ix, dtype=np.int64)) for ix in index]  # (start position, len, first, step)
    lshape = [len(ix) for ix in index]
    lstr = _strides(lshape)
    nd = len(index)
    k = max((d for d in range(nd) if len(runs[d]) > 1), default=0)  # dims after k are one run each
    tail_shape = [r[0][1] for r in runs[k + 1:]]
    tail_str = [r[0][3] * gstr[k + 1 + i] for i, r in enumerate(runs[k + 1:])]
    tail_off = sum(r[0][2] * gstr[k + 1 + i] for i, r in enumerate(runs[k + 1:]))
    out = []
    for lead in np.ndindex(*lshape[:k]):
        loff = local_offset + sum(u * lstr[d] for d, u in enumerate(lead))
        coff = canonical_offset + tail_off + sum(int(index[d][u]) * gstr[d] for d, u in enumerate(lead))
        for pos, n, first, step in runs[k]:
            out.append(_piece(canonical, loff + pos * lstr[k], (n, *tail_shape), coff + first * gstr[k],
                              (step * gstr[k], *tail_str)))
    return list(_merge(out))


def _runs_1d(ix: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Split an index sequence into arithmetic runs with positive step:
    (position, length, first value, step)."""
    starts = _segment(np.zeros(len(ix), dtype=bool), ix)
    ends = np.append(starts[1:], len(ix))
    out = []
    for s, e in zip(starts.tolist(), ends.tolist()):
        step = int(ix[s + 1] - ix[s]) if e - s > 1 else 1
        out.append((s, e - s, int(ix[s]), step))
    return out


def _segment(brk: np.ndarray, val: np.ndarray) -> np.ndarray:
    """Start positions of the runs a greedy left-to-right scan cuts ``val``
    into: arithmetic runs with a positive step, a new run also wherever
    ``brk`` is set. Element i continues the run of i-1 unless forced (brk,
    step <= 0) or its step differs from the step into i-1 while i-1 is not
    itself a run start; chains of such differing steps alternate, which is
    what makes the scan vectorisable."""
    n = len(val)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    forced = brk.copy()
    forced[0] = True
    if n > 2:
        step = np.diff(val)  # step[i-1]: into element i
        forced[1:] |= step <= 0
        cand = np.zeros(n, dtype=bool)
        cand[2:] = step[1:] != step[:-1]
        cand &= ~forced
        start = forced.copy()
        ci = np.flatnonzero(cand)
        if ci.size:
            first = np.ones(ci.size, dtype=bool)  # first element of each chain of candidates
            first[1:] = ci[1:] != ci[:-1] + 1
            b = ci[first][np.cumsum(first) - 1]
            before = forced[b - 1]  # the element before a chain is final: forced, or continuing a run
            start[ci] = ((ci - b) % 2 == 0) != before
        return np.flatnonzero(start)
    if n == 2:
        forced[1] |= val[1] <= val[0]
    return np.flatnonzero(forced)


def _compress(cid: np.ndarray, cflat: np.ndarray, names: Sequence[str]) -> tuple[Piece, ...]:
    """Pieces of a local tensor from dense per-element maps: local flat i goes
    to element ``cflat[i]`` of canonical ``names[cid[i]]`` (cid -1: not exported)."""
    n = len(cid)
    if n == 0:
        return ()
    brk = np.zeros(n, dtype=bool)
    brk[1:] = cid[1:] != cid[:-1]
    st = _segment(brk, cflat)
    ln = np.diff(np.append(st, n))
    first = cflat[st]
    step = np.where(ln > 1, cflat[np.minimum(st + 1, n - 1)] - first, 1)
    rid = cid[st]
    keep = rid >= 0
    st, ln, first, step, rid = st[keep], ln[keep], first[keep], step[keep], rid[keep]
    if st.size == 0:
        return ()
    # level 2: stack equal, adjacent runs whose canonical starts step evenly
    b2 = np.zeros(st.size, dtype=bool)
    b2[1:] = ((rid[1:] != rid[:-1]) | (ln[1:] != ln[:-1]) | (step[1:] != step[:-1])
              | (st[1:] != st[:-1] + ln[:-1]))
    g = _segment(b2, first)
    cnt = np.diff(np.append(g, st.size))
    delta = np.where(cnt > 1, first[np.minimum(g + 1, st.size - 1)] - first[g], 1)
    pieces = [
        _piece(names[c], s, (k, m), f, (dl, sp))
        for c, s, k, m, f, dl, sp in zip(rid[g].tolist(), st[g].tolist(), cnt.tolist(), ln[g].tolist(),
                                         first[g].tolist(), delta.tolist(), step[g].tolist())
    ]
    return _merge(pieces)


# --------------------------------------------------------------------------
# plain and Megatron-style declarative builders
# --------------------------------------------------------------------------

Built = tuple[LocalPlacement, tuple[CanonicalTensor, ...]]


def _shape(shape: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(s) for s in shape)


def _split(n: int, parts: int, what: str) -> int:
    if parts < 1 or n % parts:
        raise ValueError(f"{what} = {n} must split evenly over {parts} ranks")
    return n // parts


def _check_rank(rank: int, size: int, what: str) -> None:
    if not 0 <= rank < size:
        raise ValueError(f"{what}_rank {rank} outside [0, {what}_size={size})")


def identity(local_name: str, canonical_name: str, shape: Sequence[int], *,
             dtype: torch.dtype = torch.bfloat16) -> Built:
    """A local tensor that *is* the canonical tensor (one piece)."""
    shape = _shape(shape)
    c = CanonicalTensor(canonical_name, shape, dtype)
    pieces = (_piece(canonical_name, 0, (c.numel,), 0, (1,)),) if c.numel else ()
    return LocalPlacement(local_name, shape, pieces), (c,)


def replicated(local_name: str, canonical_name: str, shape: Sequence[int], *, owner: bool,
               dtype: torch.dtype = torch.bfloat16) -> Built:
    """A full copy on every rank (layer norms, row-parallel biases); only the
    ``owner`` (say ``tp_rank == 0``) exports it."""
    lp, c = identity(local_name, canonical_name, shape, dtype=dtype)
    return (lp if owner else LocalPlacement(local_name, lp.local_shape, ())), c


def column_parallel(local_name: str, canonical_name: str, shape: Sequence[int], tp_rank: int, tp_size: int, *,
                    dtype: torch.dtype = torch.bfloat16) -> Built:
    """Megatron ColumnParallelLinear: weight [out, in] (or bias [out]) split
    along dim 0; rank r holds rows [r*out/tp, (r+1)*out/tp)."""
    shape = _shape(shape)
    _check_rank(tp_rank, tp_size, "tp")
    rows = _split(shape[0], tp_size, f"{canonical_name} dim 0")
    lshape = (rows, *shape[1:])
    box = [np.arange(tp_rank * rows, (tp_rank + 1) * rows)] + [np.arange(s) for s in shape[1:]]
    return (LocalPlacement(local_name, lshape, tuple(_box_pieces(canonical_name, box, shape))),
            (CanonicalTensor(canonical_name, shape, dtype),))


def row_parallel(local_name: str, canonical_name: str, shape: Sequence[int], tp_rank: int, tp_size: int, *,
                 dtype: torch.dtype = torch.bfloat16) -> Built:
    """Megatron RowParallelLinear weight [out, in] split along dim 1; rank r
    holds columns [r*in/tp, (r+1)*in/tp). (Its bias is :func:`replicated`.)"""
    shape = _shape(shape)
    if len(shape) != 2:
        raise ValueError(f"row_parallel({canonical_name}) expects a 2-D weight, got {shape}")
    _check_rank(tp_rank, tp_size, "tp")
    cols = _split(shape[1], tp_size, f"{canonical_name} dim 1")
    box = [np.arange(shape[0]), np.arange(tp_rank * cols, (tp_rank + 1) * cols)]
    return (LocalPlacement(local_name, (shape[0], cols), tuple(_box_pieces(canonical_name, box, shape))),
            (CanonicalTensor(canonical_name, shape, dtype),))


def fused_qkv(local_name: str, q_name: str, k_name: str, v_name: str, *, num_heads: int, num_kv_heads: int,
              head_dim: int, hidden_size: int | None, tp_rank: int, tp_size: int,
              dtype: torch.dtype = torch.bfloat16) -> Built:
    """Megatron ``linear_qkv`` with grouped KV heads (``hidden_size=None`` for
    the bias). The full fused weight is [groups * (q_per_group + 2) * head_dim,
    hidden] where, for each KV group g, rows are [q heads of g, k head g,
    v head g]; it is column-parallel, so rank r holds groups
    [r*groups/tp, (r+1)*groups/tp). Canonical: q_proj [heads*hd, hidden],
    k_proj / v_proj [kv_heads*hd, hidden], q head h in group h // q_per_group.
    """
    _check_rank(tp_rank, tp_size, "tp")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if num_kv_heads % tp_size:
        raise ValueError(f"num_kv_heads {num_kv_heads} must be a multiple of tp_size {tp_size}: Megatron "
                         "requires num_query_groups % tensor_model_parallel_size == 0 (KV heads are not "
                         "replicated across tensor-parallel ranks); use a tp_size that divides num_kv_heads")
    qpg = num_heads // num_kv_heads
    groups = num_kv_heads // tp_size
    row = 1 if hidden_size is None else hidden_size
    tail = () if hidden_size is None else (hidden_size,)
    canon = (CanonicalTensor(q_name, (num_heads * head_dim, *tail), dtype),
             CanonicalTensor(k_name, (num_kv_heads * head_dim, *tail), dtype),
             CanonicalTensor(v_name, (num_kv_heads * head_dim, *tail), dtype))
    block = (qpg + 2) * head_dim * row  # local elements per group
    pieces = []
    for j in range(groups):
        g = tp_rank * groups + j
        base = j * block
        pieces.append(_piece(q_name, base, (qpg * head_dim * row,), g * qpg * head_dim * row, (1,)))
        pieces.append(_piece(k_name, base + qpg * head_dim * row, (head_dim * row,), g * head_dim * row, (1,)))
        pieces.append(_piece(v_name, base + (qpg + 1) * head_dim * row, (head_dim * row,), g * head_dim * row,
                             (1,)))
    lshape = (groups * (qpg + 2) * head_dim, *tail)
    return LocalPlacement(local_name, lshape, tuple(pieces)), canon


def gated_fc1(local_name: str, gate_name: str, up_name: str, shape: Sequence[int], tp_rank: int, tp_size: int, *,
              dtype: torch.dtype = torch.bfloat16) -> Built:
    """Megatron ``linear_fc1`` of a gated MLP (SwiGLU): canonical gate_proj and
    up_proj are ``shape`` = [ffn, hidden] (or [ffn] for biases); rank r holds
    [gate rows r*ffn/tp..; up rows r*ffn/tp..] stacked, i.e. local
    [2*ffn/tp, hidden] (Megatron chunks the local output in two for the GLU)."""
    shape = _shape(shape)
    _check_rank(tp_rank, tp_size, "tp")
    rows = _split(shape[0], tp_size, f"{gate_name} dim 0")
    row = math.prod(shape[1:])
    n = rows * row
    pieces = (_piece(gate_name, 0, (n,), tp_rank * n, (1,)), _piece(up_name, n, (n,), tp_rank * n, (1,)))
    return (LocalPlacement(local_name, (2 * rows, *shape[1:]), pieces),
            (CanonicalTensor(gate_name, shape, dtype), CanonicalTensor(up_name, shape, dtype)))


def vocab_padded_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron's ``_vocab_size_with_padding``: round up to a multiple of
    ``make_vocab_size_divisible_by * tensor_model_parallel_size``."""
    m = divisible_by * tp_size
    return -(-vocab_size // m) * m


def vocab_parallel(local_name: str, canonical_name: str, vocab_size: int, hidden_size: int, tp_rank: int,
                   tp_size: int, *, padded_vocab_size: int | None = None, divisible_by: int = 128,
                   dtype: torch.dtype = torch.bfloat16) -> Built:
    """VocabParallelEmbedding / vocab-parallel output layer: the table is
    padded to ``padded_vocab_size`` rows (default :func:`vocab_padded_size`)
    and split along rows; padding rows (>= vocab_size) are exported nowhere."""
    _check_rank(tp_rank, tp_size, "tp")
    padded = vocab_padded_size(vocab_size, tp_size, divisible_by) if padded_vocab_size is None else padded_vocab_size
    if padded < vocab_size:
        raise ValueError(f"padded vocabulary {padded} is smaller than the checkpoint's {vocab_size} rows")
    rows = _split(padded, tp_size, f"{canonical_name} padded vocabulary")
    lo, hi = tp_rank * rows, min((tp_rank + 1) * rows, vocab_size)
    pieces = (_piece(canonical_name, 0, ((hi - lo) * hidden_size,), lo * hidden_size, (1,)),) if hi > lo else ()
    return (LocalPlacement(local_name, (rows, hidden_size), pieces),
            (CanonicalTensor(canonical_name, (vocab_size, hidden_size), dtype),))


def stacked_experts(local_name: str, template: str, projs: Sequence[str], *, num_experts: int, out_features: int,
                    in_features: int, ep_rank: int, ep_size: int, transposed: bool = False,
                    local_shape: Sequence[int] | None = None, dtype: torch.dtype = torch.bfloat16) -> Built:
    """Expert-parallel stacked experts. Rank r holds experts
    [r*E/ep, (r+1)*E/ep) (Megatron's ``local_expert_indices``) as one tensor:

    * ``transposed=False``: [E_local, len(projs)*out, in], the projections
      stacked along dim 1 (transformers' ``gate_up_proj`` [E, 2F, H],
      ``down_proj`` [E, H, F]);
    * ``transposed=True``: [E_local, in, len(projs)*out], the projections
      concatenated along the last dim (Megatron GroupedMLP ``weight1`` viewed
      as [E_local, H, 2F] and ``weight2`` as [E_local, F, H]; GPT-OSS style).

    Canonical tensors are ``template.format(e=expert, proj=name)`` of shape
    [out, in], e.g. ``"model.layers.3.mlp.experts.{e}.{proj}.weight"`` with
    projs ``("gate_proj", "up_proj")``. A transposed tensor fusing several
    projections gives one piece per (expert, projection, input row): each
    local row holds ``out`` contiguous elements of a canonical column.

    ``local_shape`` overrides the reported shape when the parameter is
    declared otherwise with the same row-major order (GroupedMLP's
    ``weight1`` is declared [H, E_local*2F] and only viewed as [E_local, H, 2F]).
    """
    _check_rank(ep_rank, ep_size, "ep")
    el = _split(num_experts, ep_size, "num_experts")
    np_, o, i_ = len(projs), out_features, in_features
    canon, pieces = [], []
    for j in range(el):
        e = ep_rank * el + j
        base = j * np_ * o * i_
        for k, proj in enumerate(projs):
            name = template.format(e=e, proj=proj)
            canon.append(CanonicalTensor(name, (o, i_), dtype))
            if not transposed:
                pieces.append(_piece(name, base + k * o * i_, (o * i_,), 0, (1,)))
            elif np_ == 1:
                pieces.append(_piece(name, base, (i_, o), 0, (1, i_)))
            else:
                pieces.extend(_piece(name, base + h * np_ * o + k * o, (o,), h, (i_,)) for h in range(i_))
    lshape: tuple[int, ...] = (el, i_, np_ * o) if transposed else (el, np_ * o, i_)
    if local_shape is not None:
        if math.prod(local_shape) != math.prod(lshape):
            raise ValueError(f"{local_name}: local_shape {tuple(local_shape)} does not hold the "
                             f"{math.prod(lshape)} elements of {lshape}")
        lshape = _shape(local_shape)
    pieces.sort(key=lambda p: p.local_offset)
    return LocalPlacement(local_name, lshape, tuple(pieces)), tuple(canon)


# --------------------------------------------------------------------------
# DTensor / FSDP2
# --------------------------------------------------------------------------


def _dtensor_types() -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    strided: Any
    try:
        from torch.distributed.tensor.placement_types import _StridedShard as strided
    except ImportError:  # older torch: no strided shards
        strided = ()
    return DTensor, Shard, Replicate, Partial, strided


def _dtensor_index(dt: Any) -> list[np.ndarray]:
    """Global indices along each dimension held by this rank's local tensor."""
    DTensor, Shard, Replicate, Partial, Strided = _dtensor_types()
    mesh, placements, gshape = dt.device_mesh, tuple(dt.placements), tuple(dt.shape)
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(f"DTensor placements {placements} hold partial sums: no rank holds canonical values; "
                         "reduce (redistribute to Replicate/Shard) before exporting")
    if Strided and any(isinstance(p, Strided) for p in placements):
        # Per dimension, let DTensor itself split an index vector without
        # communication (src_data_rank=None): public API, handles split_factor.
        from torch.distributed.tensor import distribute_tensor

        index = []
        for d, n in enumerate(gshape):
            sub = []
            for p in placements:
                if isinstance(p, (Shard, Strided)) and p.dim == d:
                    sub.append(type(p)(0, split_factor=p.split_factor) if isinstance(p, Strided) else Shard(0))
                else:
                    sub.append(Replicate())
            loc = distribute_tensor(torch.arange(n), mesh, sub, src_data_rank=None).to_local()
            index.append(loc.numpy().astype(np.int64))
        return index
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError as e:  # pragma: no cover - depends on the torch build
        raise ImportError(
            "dcr needs torch.distributed.tensor._utils.compute_local_shape_and_global_offset (private torch API, "
            f"present in torch 2.4-2.13) to place DTensor shards; this torch {torch.__version__} moved it: "
            "update dcr.trainer.layouts._dtensor_index") from e
    for p in placements:
        if not isinstance(p, (Shard, Replicate)):
            raise ValueError(f"unsupported DTensor placement {p!r} in {placements}")
    lshape, offset = compute_local_shape_and_global_offset(gshape, mesh, placements)
    return [np.arange(o, o + s, dtype=np.int64) for o, s in zip(offset, lshape)]


def dtensor_placement(name: str, dt: Any, canonical_name: str | None = None,
                      canonical_dtype: torch.dtype | None = None) -> tuple[LocalPlacement, CanonicalTensor]:
    """Placement of this rank's local shard of DTensor ``dt`` (FSDP2,
    ``distribute_tensor``, TP plans): Shard (uneven included), _StridedShard,
    Replicate (owned by mesh coordinate 0 along every replicated mesh
    dimension), any mesh rank. The local tensor is ``dt.to_local()``."""
    DTensor, Shard, Replicate, Partial, Strided = _dtensor_types()
    if not isinstance(dt, DTensor):
        raise TypeError(f"{name}: expected a DTensor, got {type(dt).__name__}")
    canonical_name = name if canonical_name is None else canonical_name
    gshape = tuple(dt.shape)
    canon = CanonicalTensor(canonical_name, gshape, dt.dtype if canonical_dtype is None else canonical_dtype)
    local = dt.to_local()
    lshape = tuple(local.shape)
    coord = dt.device_mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh
        return LocalPlacement(name, lshape, ()), canon
    index = _dtensor_index(dt)
    if tuple(len(ix) for ix in index) != lshape:
        raise ValueError(f"{name}: DTensor {dt.placements} on mesh {tuple(dt.device_mesh.shape)} should hold a "
                         f"local shard of shape {tuple(len(ix) for ix in index)} but to_local() is {lshape}")
    if not local.is_contiguous():
        raise ValueError(f"{name}: local shard {lshape} with strides {tuple(local.stride())} is not contiguous")
    owner = all(c == 0 for c, p in zip(coord, dt.placements) if isinstance(p, Replicate))
    pieces = tuple(_box_pieces(canonical_name, index, gshape)) if owner else ()
    return LocalPlacement(name, lshape, pieces), canon


def module_placements(module: torch.nn.Module, *, rename: Any = None) -> Placements:
    """Placements of every parameter and persistent buffer of a module whose
    tensors are DTensors (FSDP2 ``fully_shard``, TP plans). Plain tensors
    count as replicated on every rank and are exported by global rank 0.
    ``rename(name) -> canonical name`` maps module names to checkpoint names
    (default: unchanged, minus torch.compile / activation-checkpoint wrappers)."""
    DTensor = _dtensor_types()[0]
    rank0 = True
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank0 = torch.distributed.get_rank() == 0
    rename = rename or _strip_wrappers
    out = Placements()
    for name, t in module.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue
        cname = rename(name)
        if isinstance(t, DTensor):
            lp, c = dtensor_placement(name, t, cname)
            out.add(lp, c)
        else:
            out.add(*replicated(name, cname, t.shape, owner=rank0, dtype=t.dtype))
    return out.validate()


_WRAPPERS = re.compile(r"(^|\.)(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")


def _strip_wrappers(name: str) -> str:
    return _WRAPPERS.sub(r"\1", name)


# --------------------------------------------------------------------------
# transformers fused MoE
# --------------------------------------------------------------------------


def _reverse_groups(model: Any, names: Sequence[str]) -> tuple[dict[str, str], list[list[str]]]:
    """Group in-memory names as ``revert_weight_conversion`` (used by
    ``save_pretrained``) does: names a reversed WeightConverter combines form
    one group; every other name is renamed on its own. Returns
    (renamed identity names, converter groups)."""
    from transformers.core_model_loading import (
        PrefixChange,
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    wc = getattr(model, "_weight_conversions", None)
    if wc is None:  # same defaults as revert_weight_conversion
        from transformers.conversion_mapping import get_model_conversion_mapping

        wc = [x for x in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(x, PrefixChange)]
    if not wc:
        return {n: n for n in names}, []
    rev = [c.reverse_transform() for c in list(wc)[::-1]]
    renamings = [r for r in rev if isinstance(r, WeightRenaming)]
    converters = [r for r in rev if isinstance(r, WeightConverter)]
    plain: dict[str, str] = {}
    groups: dict[str, list[str]] = {}
    for n in sorted(names, key=dot_natural_key):
        renamed, pattern = rename_source_key(n, renamings, converters, reverse=True)
        if pattern is None:
            plain[n] = renamed
        else:
            groups.setdefault(renamed, []).append(n)
    return plain, list(groups.values())


def _saved_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The state dict ``save_pretrained`` starts from: ignored keys and tied
    duplicates removed (transformers' own helper where it exists)."""
    sd = dict(model.state_dict())
    for k in getattr(model, "_keys_to_ignore_on_save", None) or ():
        sd.pop(k, None)
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:
        seen: set[Any] = set()
        for k in list(sd):
            key = (sd[k].untyped_storage().data_ptr(), sd[k].storage_offset(), tuple(sd[k].shape))
            if key in seen:
                del sd[k]
            seen.add(key)
        return sd
    return remove_tied_weights_from_state_dict(sd, model)


def transformers_placements(model: Any, *, probe_elements: int = 1 << 27) -> Placements:
    """Placements of a transformers ``PreTrainedModel``'s in-memory tensors
    (state-dict names) into its checkpoint, as ``save_pretrained`` writes it.

    Tensors that transformers' weight conversion only renames get one
    identity piece under the renamed checkpoint name. Tensors a
    WeightConverter fuses (MoE experts stacked by MergeModulelist, gate/up by
    Concatenate, Transpose, ...) are placed by running transformers' own
    ``revert_weight_conversion`` on *probe* tensors whose int64 values are
    element indices, then compressing the index maps into pieces; the
    conversion ops only move elements, so the probe shows exactly where each
    element goes. Converter groups are probed in batches of about
    ``probe_elements`` elements (8 bytes each, twice)."""
    from transformers.core_model_loading import revert_weight_conversion

    DTensor = _dtensor_types()[0] if torch.distributed.is_available() else ()
    sd = _saved_state_dict(model)
    for k, t in sd.items():
        if DTensor and isinstance(t, DTensor):
            raise NotImplementedError(f"{k} is a DTensor: transformers_placements places unsharded models; "
                                      "place sharded ones with module_placements (in-memory names)")
    plain, groups = _reverse_groups(model, list(sd))
    out = Placements()
    for k, cname in plain.items():
        out.add(*identity(k, cname, sd[k].shape, dtype=sd[k].dtype))
    batch: list[str] = []
    size = 0
    for g in groups + [[]]:
        n = sum(sd[k].numel() for k in g)
        if batch and (not g or size + n > probe_elements):
            _probe_batch(model, sd, batch, out, revert_weight_conversion)
            batch, size = [], 0
        batch.extend(g)
        size += n
    return out.validate()


def _probe_batch(model: Any, sd: Mapping[str, torch.Tensor], names: Sequence[str], out: Placements,
                 revert: Any) -> None:
    bases = np.cumsum([0] + [sd[k].numel() for k in names])
    probe = {k: torch.arange(int(bases[i]), int(bases[i + 1]), dtype=torch.int64).view(sd[k].shape)
             for i, k in enumerate(names)}
    conv = revert(model, probe)
    total = int(bases[-1])
    cid = np.full(total, -1, dtype=np.int64)
    cflat = np.full(total, -1, dtype=np.int64)
    cnames: list[str] = []
    canon: list[CanonicalTensor] = []
    written = 0  # outputs == inputs and every input placed: one-to-one (duplicates inside a tensor included)
    for cname, t in conv.items():
        t = t[0] if isinstance(t, list) else t
        if t.dtype != torch.int64:
            raise ValueError(f"transformers' conversion to {cname} computes ({t.dtype} result on an int64 probe): "
                             "not a pure placement; send its values as overwrites instead")
        v = t.reshape(-1).numpy()
        written += v.size
        if written > total or (v.size and (v.min() < 0 or v.max() >= total or (cid[v] >= 0).any())):
            raise ValueError(f"transformers' conversion to {cname} duplicates or invents elements: "
                             "not a one-to-one placement")
        src = names[int(np.searchsorted(bases, v[0], side="right")) - 1] if v.size else names[0]
        cid[v] = len(cnames)
        cflat[v] = np.arange(v.size, dtype=np.int64)
        cnames.append(cname)
        canon.append(CanonicalTensor(cname, tuple(t.shape), sd[src].dtype))
    if (cid < 0).any():  # with written <= total this also rules out duplicates
        miss = names[int(np.searchsorted(bases, np.flatnonzero(cid < 0)[0], side="right")) - 1]
        raise ValueError(f"transformers' conversion drops elements of {miss}: save_pretrained would not write them")
    for i, k in enumerate(names):
        lo, hi = int(bases[i]), int(bases[i + 1])
        pieces = _compress(cid[lo:hi], cflat[lo:hi], cnames)
        used = {p.canonical for p in pieces}
        out.add(LocalPlacement(k, tuple(sd[k].shape), pieces), [c for c in canon if c.name in used])
