"""Placement learned from a serving runtime's own loader, and the apply path.

A runtime fuses, slices, shards and sometimes transforms checkpoint tensors
as it loads them. Rather than re-implementing its rules, :func:`learn_placement`
runs the runtime's loader once on *probe* tensors whose stored bits encode
each canonical element's index, then reads every parameter and buffer back:

* index passes: a canonical element with global index ``g`` (numbered per
  element width) carries digit ``p`` of ``g`` (8*width bits per digit) in pass
  ``p``, through an integer view, so a bf16 model of up to 4 G elements needs
  two passes (low and high 16 bits);
* verify passes: the element carries a hash of ``g``. A storage element whose
  decoded index is valid *and* holds the hash received the canonical bits
  unchanged; every other written element is "corrupt" (the loader computed);
* before each pass all storage is filled with all-ones bits, so an element
  the loader did not write decodes to the sentinel and is "untouched".

Canonical tensors and storage tensors are joined into *groups* (connected
components of "lands in" and the adapter's own "feeds" edges). A group is
bit-preserving when the loader only moved bits: no corrupt element, no
derived copy the probe cannot see (the adapter reports those, e.g. vLLM's CPU
packed weights), every canonical element placed somewhere, dtypes equal. Its
canonical tensors get an index map compressed as affine runs. Every other
group is *transforming*: a delta touching it is applied to a canonical CPU
shadow of the group's tensors, and the whole group is pushed back through the
runtime's loader, so derived buffers (scales, packed copies) come out exactly
as a dense refit makes them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

import dcr
from dcr import _core

__all__ = [
    "Adapter",
    "Placement",
    "Receiver",
    "RunTable",
    "TensorPlacement",
    "learn_placement",
]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_NO_PROBE_DTYPES = {torch.bool}  # stored bits other than 0/1 are undefined behaviour


class Adapter(Protocol):
    """What a runtime integration provides to :class:`Receiver`.

    ``storage()`` lists the live parameters and buffers by name (re-read after
    every load: some loaders replace tensors). ``load(items)`` is the
    runtime's own dense loader on (canonical name, tensor) pairs; it must
    accept any *group* of tensors on its own. ``restore(base)`` puts the real
    weights back after probing. ``edges(names)`` names, per canonical tensor,
    the storage tensors it may feed (from the loader's trace or module
    structure); ``hidden()`` names storage tensors whose module keeps a
    derived copy the probe cannot read (packed weights)."""

    def storage(self) -> dict[str, torch.Tensor]: ...
    def load(self, items: Iterable[tuple[str, torch.Tensor]]) -> None: ...
    def restore(self, base: Mapping[str, torch.Tensor]) -> None: ...
    def edges(self, names: list[str]) -> dict[str, set[str]]: ...
    def hidden(self) -> set[str]: ...


# --------------------------------------------------------------------------
# index maps
# --------------------------------------------------------------------------


@dataclass
class RunTable:
    """Affine runs of one canonical tensor into one storage tensor: canonical
    ``[c0, c0+n)`` lands at flat storage offsets ``s0 + k*step``. Runs of a
    table are disjoint and sorted by ``c0``; a canonical element placed twice
    in the same storage tensor (KV-head replication) goes into a second table."""

    target: str
    c0: torch.Tensor  # int64
    n: torch.Tensor
    s0: torch.Tensor
    step: torch.Tensor

    @property
    def runs(self) -> int:
        return int(self.c0.numel())

    @property
    def elements(self) -> int:
        return int(self.n.sum())

    def lookup(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mask of canonical positions this table covers, their storage offsets)."""
        if self._np is None:
            self._np = tuple(t.numpy() for t in (self.c0, self.n, self.s0, self.step))
        c0, n, s0, st = self._np
        if c0.size == 1:  # one run: pure arithmetic
            off = pos - c0[0]
            hit = (off >= 0) & (off < n[0])
            return hit, s0[0] + off[hit] * st[0]
        r = np.searchsorted(c0, pos, side="right") - 1
        np.maximum(r, 0, out=r)
        off = pos - c0[r]
        hit = (off >= 0) & (off < n[r])
        return hit, s0[r[hit]] + off[hit] * st[r[hit]]

    def expand(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (canonical index, storage offset) pair of the table."""
        c0, n, s0, st = (t.numpy() for t in (self.c0, self.n, self.s0, self.step))
        run = np.repeat(np.arange(c0.size), n)
        k = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
        return c0[run] + k, s0[run] + k * st[run]

    _np: tuple[np.ndarray, ...] | None = field(default=None, repr=False, compare=False)


def _runs_from_pairs(c: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Compress (c, s) pairs, c strictly increasing, into affine runs
    (vectorised: split where the canonical index jumps or the storage step
    changes, then let a pair stranded at a step change join the next run)."""
    m = int(c.numel())
    if m == 0:
        z = torch.zeros(0, dtype=torch.int64)
        return z, z, z, z
    start = torch.ones(m, dtype=torch.bool)
    if m > 1:
        dc = c[1:] - c[:-1]
        ds = s[1:] - s[:-1]
        ok = dc == 1
        start[1:] = ~ok
        if m > 2:
            start[2:] |= ds[1:] != ds[:-1]
    idx = torch.nonzero(start).flatten()
    n = torch.diff(idx, append=torch.tensor([m]))
    step = torch.ones_like(idx)
    multi = n > 1
    if m > 1:
        step[multi] = s[idx[multi] + 1] - s[idx[multi]]
    c0, s0 = c[idx].clone(), s[idx].clone()
    # a singleton left at a step change joins the run after it when it fits
    if c0.numel() > 1:
        join = torch.zeros_like(n, dtype=torch.bool)
        join[:-1] = (n[:-1] == 1) & (n[1:] > 1) & (c0[1:] - c0[:-1] == 1) & (s0[1:] - s0[:-1] == step[1:])
        if bool(join.any()):
            nxt = torch.nonzero(join).flatten() + 1
            c0[nxt], s0[nxt], n[nxt] = c0[nxt - 1], s0[nxt - 1], n[nxt] + 1
            keep = ~join
            c0, n, s0, step = c0[keep], n[keep], s0[keep], step[keep]
    return c0, n, s0, step


@dataclass
class TensorPlacement:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    group: int
    transforming: bool
    reason: str = ""
    tables: list[RunTable] = field(default_factory=list)
    complete: bool = True  # every canonical element is held somewhere (False on a TP shard)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


@dataclass
class Placement:
    """Per canonical tensor: an index map into storage, or 'transforming'."""

    tensors: dict[str, TensorPlacement]
    groups: dict[int, list[str]]  # group id -> canonical names
    probe_seconds: float = 0.0
    written: set[str] = field(default_factory=set)  # storage tensors the loader writes

    def transforming(self) -> list[str]:
        return [n for n, t in self.tensors.items() if t.transforming]

    def summary(self) -> dict[str, Any]:
        mapped = [t for t in self.tensors.values() if not t.transforming]
        return {
            "tensors": len(self.tensors),
            "mapped": len(mapped),
            "transforming": len(self.tensors) - len(mapped),
            "runs": sum(tb.runs for t in mapped for tb in t.tables),
            "mapped_elements": sum(t.numel for t in mapped),
            "probe_seconds": round(self.probe_seconds, 3),
        }


# --------------------------------------------------------------------------
# probing
# --------------------------------------------------------------------------


def _width(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _int_view(t: torch.Tensor) -> torch.Tensor:
    """The whole underlying storage of ``t`` as a flat integer tensor of t's width."""
    w = t.element_size()
    st = t.untyped_storage()
    flat = torch.empty(0, dtype=_INT_VIEW[w], device=t.device)
    flat.set_(st, 0, (st.nbytes() // w,), (1,))
    return flat


def _storage_offsets(t: torch.Tensor) -> torch.Tensor:
    """Flat storage element offsets of t's elements, in t's logical order (int64, CPU)."""
    if t.is_contiguous():
        return torch.arange(t.numel(), dtype=torch.int64) + t.storage_offset()
    base = torch.arange(t.storage_offset() + 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())), dtype=torch.int64)
    return torch.as_strided(base, tuple(t.shape), tuple(t.stride()), t.storage_offset()).reshape(-1)


def _hash(g: torch.Tensor) -> torch.Tensor:
    return ((g + 0x5BD1E995) * _GOLDEN) >> 29


def _digit(v: torch.Tensor, p: int, w: int) -> torch.Tensor:
    bits = 8 * w
    if bits * p >= 64:
        return torch.zeros_like(v)
    d = (v >> (bits * p)) if p else v
    return d & ((1 << bits) - 1) if bits < 64 else d


def _to_width(d: torch.Tensor, w: int) -> torch.Tensor:
    """int64 digits in [0, 2**(8w)) -> the integer view dtype of width w (bit pattern kept)."""
    if w == 8:
        return d
    if w == 1:
        return d.to(torch.uint8)
    half = 1 << (8 * w - 1)
    return torch.where(d >= half, d - 2 * half, d).to(_INT_VIEW[w])


def _from_width(x: torch.Tensor, w: int) -> torch.Tensor:
    x = x.to(torch.int64)
    return x & ((1 << (8 * w)) - 1) if w < 8 else x


@dataclass
class _Layout:
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    widths: list[int]
    offsets: list[int]  # global index of element 0, within its width class
    totals: dict[int, int]

    @classmethod
    def of(cls, base: Mapping[str, torch.Tensor]) -> _Layout:
        names, dtypes, shapes, widths, offsets, totals = [], [], [], [], [], {}
        for k, v in base.items():
            w = v.element_size()
            names.append(k), dtypes.append(v.dtype), shapes.append(tuple(v.shape)), widths.append(w)
            offsets.append(totals.get(w, 0) if v.dtype not in _NO_PROBE_DTYPES else -1)
            if v.dtype not in _NO_PROBE_DTYPES:
                totals[w] = totals.get(w, 0) + v.numel()
        return cls(names, dtypes, shapes, widths, offsets, totals)

    def index_passes(self, w: int) -> int:
        return max(1, -(-(self.totals.get(w, 0) + 1).bit_length() // (8 * w)))


def _probe_items(layout: _Layout, kind: str, p: int) -> Iterator[tuple[str, torch.Tensor]]:
    for name, dt, shape, w, off in zip(layout.names, layout.dtypes, layout.shapes, layout.widths, layout.offsets):
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if off < 0:
            yield name, torch.zeros(shape, dtype=dt)
            continue
        g = torch.arange(off, off + n, dtype=torch.int64)
        v = _hash(g) if kind == "verify" else g
        yield name, _to_width(_digit(v, p, w), w).view(dt).reshape(shape)


def learn_placement(
    adapter: Adapter,
    base: Mapping[str, torch.Tensor],
    *,
    allow_unplaced: bool = False,
) -> Placement:
    """Probe ``adapter``'s loader once and return the placement of every
    canonical tensor of ``base`` (which only supplies names, dtypes and
    shapes here). The runtime's storage holds probe values afterwards: call
    ``adapter.restore(base)``; :class:`Receiver` does.

    ``allow_unplaced``: canonical elements that land nowhere are not taken
    as transformed (a tensor-parallel rank holds only its shard)."""
    t0 = time.perf_counter()
    layout = _Layout.of(base)
    widths = sorted(set(layout.totals) | {1, 2, 4, 8})
    n_index = max(layout.index_passes(w) for w in widths)
    n_verify = 2 if 1 in layout.totals else 1
    passes = [("index", p) for p in range(n_index)] + [("verify", p) for p in range(n_verify)]

    acc: dict[str, dict[str, torch.Tensor]] = {}  # storage name -> accumulators
    for kind, p in passes:
        for t in adapter.storage().values():
            if t.numel() and t.element_size() in _INT_VIEW:
                _int_view(t).fill_(255 if t.element_size() == 1 else -1)  # sentinel: untouched elements stay all-ones
        adapter.load(_probe_items(layout, kind, p))
        for sname, t in adapter.storage().items():
            w = t.element_size()
            if w not in _INT_VIEW:
                continue
            flat = _int_view(t)
            offs = _storage_offsets(t)
            x = _from_width(flat[offs.to(flat.device)].cpu(), w)
            a = acc.setdefault(
                sname,
                {
                    "offs": offs,
                    "g": torch.zeros_like(x),
                    "ones": torch.ones_like(x, dtype=torch.bool),
                    "high": torch.zeros_like(x, dtype=torch.bool),
                    "bad": torch.zeros_like(x, dtype=torch.bool),
                },
            )
            if a["offs"].numel() != offs.numel() or not torch.equal(a["offs"], offs):
                raise dcr.LayoutMismatchError(
                    f"storage tensor {sname!r} changed shape or layout between probe passes; "
                    "the loader must keep parameter shapes stable"
                )
            mask = (1 << (8 * w)) - 1 if w < 8 else -1
            if kind == "index":
                a["ones"] &= x == mask
                if 8 * w * p < 64 and p < layout.index_passes(w):
                    a["g"] |= x << (8 * w * p)
                else:
                    a["high"] |= x != 0
            else:
                a["bad"] |= x != _digit(_hash(a["g"]), p, w)
    edges = adapter.edges(layout.names)
    hidden = adapter.hidden()
    storage_dtypes = {k: v.dtype for k, v in adapter.storage().items()}

    # where each canonical element landed
    pairs: dict[int, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    corrupt: set[str] = set()
    lands: dict[str, set[str]] = {}
    class_index: dict[int, tuple[np.ndarray, list[int]]] = {}
    for w in set(layout.widths):
        ids = [i for i, (ww, o) in enumerate(zip(layout.widths, layout.offsets)) if ww == w and o >= 0]
        class_index[w] = (np.array([layout.offsets[i] for i in ids], dtype=np.int64), ids)
    for sname, a in acc.items():
        w = _width(storage_dtypes[sname])
        touched = ~a["ones"]
        total = layout.totals.get(w, 0)
        ok = touched & ~a["high"] & ~a["bad"] & (a["g"] >= 0) & (a["g"] < total)
        if bool((touched & ~ok).any()):
            corrupt.add(sname)
        if not bool(ok.any()):
            continue
        g = a["g"][ok]
        so = a["offs"][ok]
        starts, ids = class_index[w]
        ti = np.searchsorted(starts, g.numpy(), side="right") - 1
        for k in np.unique(ti).tolist():
            i = ids[k]
            sel = torch.from_numpy(ti == k)
            name = layout.names[i]
            lands.setdefault(name, set()).add(sname)
            if storage_dtypes[sname] != layout.dtypes[i]:
                corrupt.add(sname)
            pairs.setdefault(i, []).append((sname, g[sel] - layout.offsets[i], so[sel]))

    # groups: canonical names and storage names joined by landing and feeding edges
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra

    for name in layout.names:
        find("c:" + name)
        for s in lands.get(name, set()) | edges.get(name, set()):
            union("c:" + name, "s:" + s)
    comp_bad: dict[str, str] = {}
    for s in corrupt:
        comp_bad.setdefault(find("s:" + s), f"storage {s!r} holds values the loader computed")
    for s in hidden:
        if "s:" + s in parent:
            comp_bad.setdefault(find("s:" + s), f"storage {s!r} has a derived copy (packed/repacked) the probe cannot read")

    tensors: dict[str, TensorPlacement] = {}
    complete: dict[str, bool] = {}
    for i, name in enumerate(layout.names):
        shape, dt = layout.shapes[i], layout.dtypes[i]
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if layout.offsets[i] < 0:
            comp_bad.setdefault(find("c:" + name), f"{dt} tensors are not probed")
        placed = torch.zeros(numel, dtype=torch.bool)
        for _, c, _ in pairs.get(i, []):
            placed[c] = True
        complete[name] = bool(placed.all())
        if not allow_unplaced and not bool(placed.all()) and numel:
            why = "no element reached parameter or buffer storage" if not bool(placed.any()) else "some elements were not placed"
            comp_bad.setdefault(find("c:" + name), f"{name}: {why}")
    roots = {find("c:" + n) for n in layout.names}
    gid = {r: k for k, r in enumerate(sorted(roots))}
    groups: dict[int, list[str]] = {}
    for i, name in enumerate(layout.names):
        r = find("c:" + name)
        g = gid[r]
        groups.setdefault(g, []).append(name)
        tp = TensorPlacement(name, layout.dtypes[i], layout.shapes[i], g, r in comp_bad, comp_bad.get(r, ""))
        if not tp.transforming:
            tp.tables = _tables(pairs.get(i, []))
            tp.complete = complete[name]
        tensors[name] = tp
    written = {k for k, a in acc.items() if not bool(a["ones"].all())}
    return Placement(tensors, groups, time.perf_counter() - t0, written)


def _tables(pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> list[RunTable]:
    out = []
    for sname, c, s in pairs:
        order = torch.from_numpy(np.lexsort((s.numpy(), c.numpy())))
        c, s = c[order], s[order]
        # rank of each pair among equal canonical indices: replication -> layers
        first = torch.ones_like(c, dtype=torch.bool)
        first[1:] = c[1:] != c[:-1]
        start_of = torch.cummax(torch.where(first, torch.arange(c.numel()), 0), 0).values
        rank = torch.arange(c.numel()) - start_of
        for layer in range(int(rank.max()) + 1 if c.numel() else 0):
            sel = rank == layer
            c0, n, s0, st = _runs_from_pairs(c[sel], s[sel])
            out.append(RunTable(sname, c0, n, s0, st))
    return out


# --------------------------------------------------------------------------
# receiver
# --------------------------------------------------------------------------


def scatter_on_device(dst: torch.Tensor, offs: np.ndarray, values: np.ndarray, kind: str, impl: str = "auto") -> None:
    """``dst.view(-1)[offs] ^= values`` (or ``= values``) for a device tensor of
    integer words: the dcr CUDA apply kernels (one chunk spanning the tensor),
    with torch indexing beyond their 2^31-element chunk limit."""
    flat = dst.reshape(-1)
    o = torch.from_numpy(np.ascontiguousarray(offs)).to(dst.device, non_blocking=True)
    tv = torch.from_numpy(np.ascontiguousarray(values)).to(dst.device, non_blocking=True)
    if 0 < flat.numel() < (1 << 31):
        from dcr import cuda as dcr_cuda

        counts = torch.tensor([o.numel()], dtype=torch.int64, device=dst.device)
        fn = dcr_cuda.apply_xor if kind == "xor" else dcr_cuda.apply_overwrite
        fn(flat, flat.numel(), counts, o.to(torch.int32), tv.view(flat.dtype), impl)
        return
    if kind == "xor":
        flat[o] = flat[o] ^ tv
    else:
        flat[o] = tv


def _np_values(values: bytes, w: int) -> np.ndarray:
    v = np.frombuffer(values, dtype="<u8")
    return v.astype(_NP_UINT[w]).view(_NP_INT[w]) if w < 8 else v.astype(np.int64)


class Receiver:
    """Applies dcr deltas to a live runtime through a learned :class:`Placement`.

    ``base`` is the canonical checkpoint the runtime holds now (name ->
    tensor, checkpoint names). It supplies the canonical layout, restores the
    runtime after probing, and seeds the CPU shadow of transforming groups
    (their canonical values, needed to rebuild them; memory = the bytes of
    those tensors only). Bit-preserving tensors keep no copy.
    """

    def __init__(
        self,
        adapter: Adapter,
        base: Mapping[str, torch.Tensor],
        *,
        allow_unplaced: bool = False,
        placement: Placement | None = None,
    ) -> None:
        self.adapter = adapter
        if placement is None:
            # the probe overwrites all storage: keep what the loader never writes
            # (rotary caches, KV scales, ...), reload the rest through the loader
            saved = {k: v.to("cpu", copy=True) for k, v in adapter.storage().items()}
            placement = learn_placement(adapter, base, allow_unplaced=allow_unplaced)
            adapter.restore(base)
            with torch.no_grad():
                for k, v in adapter.storage().items():
                    if k not in placement.written and k in saved and saved[k].shape == v.shape:
                        v.copy_(saved[k])
            del saved
        self.placement = placement
        self.shadow: dict[str, torch.Tensor] = {
            n: base[n].detach().to("cpu", copy=True).contiguous() for n in self.placement.transforming()
        }
        self._layout = [(n, base[n].dtype, tuple(base[n].shape)) for n in base]
        self._dtypes = {n: (dt, shape) for n, dt, shape in self._layout}
        self._tables_gpu: dict[tuple[str, int], RunTable] = {}

    @property
    def shadow_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shadow.values())

    # ---- reading canonical values back -------------------------------------

    def canonical_state(self) -> dict[str, torch.Tensor]:
        """The canonical checkpoint as the runtime holds it: mapped tensors
        gathered from live storage, transforming ones from the shadow."""
        storage = self.adapter.storage()
        return {name: self._canonical_tensor(name, storage) for name, _, _ in self._layout}

    def _canonical_tensor(self, name: str, storage: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One canonical tensor (CPU, contiguous) as the runtime holds it."""
        tp = self.placement.tensors[name]
        if tp.transforming:
            return self.shadow[name]
        if not tp.complete:
            raise dcr.LayoutMismatchError(
                f"{name}: this receiver holds only part of the tensor (a tensor-parallel shard), so it has no "
                "canonical value: apply with verify=False and check shards another way, and build deltas for it "
                "with mode='free' (context-coded chunks decode against the whole base tensor)"
            )
        dt, shape = self._dtypes[name]
        w = _width(dt)
        flat = torch.empty(tp.numel, dtype=_INT_VIEW[w])
        for tb in tp.tables:
            src = _int_view(storage[tb.target])
            c, so = tb.expand()
            if src.device.type == "cpu":
                flat.numpy()[c] = src.numpy()[so]
            else:
                flat[torch.from_numpy(c)] = src[torch.from_numpy(so).to(src.device)].cpu()
        return flat.view(dt).reshape(shape)

    def digest(self) -> str:
        return dcr.digest_tensors(self.canonical_state())

    # ---- apply -------------------------------------------------------------

    def apply(self, delta: bytes, *, verify: bool = True) -> dict[str, Any]:
        """Apply ``delta`` in place. With ``verify`` the runtime's canonical
        digest is checked against the delta's base before (refused on a
        mismatch, nothing written) and its target after."""
        t0 = time.perf_counter()
        delta = bytes(delta)
        header = _core.delta_header(delta)
        theirs = {n: tuple(s) for n, _, s in header["tensors"]}
        mine = {n: shape for n, _, shape in self._layout}
        if theirs != mine:
            odd = sorted(set(theirs.items()) ^ set(mine.items()))[:3]
            raise dcr.LayoutMismatchError(
                f"delta covers {len(theirs)} tensors, this receiver holds {len(mine)}; they differ in names or "
                f"shapes (e.g. {odd}): build the receiver from the checkpoint the trainer diffs"
            )
        # Canonical base tensors: all of them to check the base digest, and
        # those with context-coded chunks (which decode against them).
        storage = self.adapter.storage()
        base: dict[str, torch.Tensor] = {}
        if verify:
            base = self.canonical_state()
            have = dcr.digest_tensors(base)
            if have != header["base_digest"]:
                raise dcr.BaseMismatchError(
                    f"delta {header['base_version']}->{header['target_version']} needs base digest "
                    f"{header['base_digest'][:12]}..., receiver holds digest {have[:12]}...: "
                    "fetch the missing deltas first or do a dense refit"
                )

        def base_of(name: str) -> tuple[int, int]:
            if name not in base:
                base[name] = self._canonical_tensor(name, storage)
            t = base[name]
            return t.data_ptr(), t.numel() * t.element_size()

        _, chunks = _core.decode_delta(delta, base=base_of)
        del base
        t1 = time.perf_counter()
        dirty_groups: set[int] = set()
        n_mapped = n_shadow = 0
        for name, start, w, kind, pos_b, val_b in chunks:
            tp = self.placement.tensors[name]
            if tp.transforming:
                sh = self.shadow[name]
                span = (sh.data_ptr() + start * w, (sh.numel() - start) * w)
                _core.apply_changes(span, w, pos_b, val_b, kind)
                dirty_groups.add(tp.group)
                n_shadow += len(pos_b) // 4
                continue
            pos = np.frombuffer(pos_b, dtype="<u4").astype(np.int64)
            pos += start
            vals = _np_values(val_b, w)
            n_mapped += int(pos.size)
            for tb in tp.tables:
                hit, offs = tb.lookup(pos)
                v = vals if bool(hit.all()) else vals[hit]
                dst = _int_view(storage[tb.target])
                if dst.device.type == "cpu":
                    d = dst.numpy()  # single-threaded numpy: no OpenMP barrier per small op
                    if kind == "xor":
                        d[offs] ^= v
                    else:
                        d[offs] = v
                    continue
                scatter_on_device(dst, offs, v, kind)
        t2 = time.perf_counter()
        # every dirty group whole, in one pass of the runtime's loader
        reloaded = [n for g in sorted(dirty_groups) for n in self.placement.groups[g]]
        if reloaded:
            self.adapter.load((n, self.shadow[n]) for n in reloaded)
        t3 = time.perf_counter()
        if verify:
            have = self.digest()
            if have != header["target_digest"]:
                raise dcr.VerificationError(
                    f"after delta {header['base_version']}->{header['target_version']} the receiver's digest is "
                    f"{have[:12]}..., expected {header['target_digest'][:12]}...: do a dense refit"
                )
        t4 = time.perf_counter()
        return {
            "base_version": header["base_version"],
            "target_version": header["target_version"],
            "chunks": len(chunks),
            "mapped_changes": n_mapped,
            "shadow_changes": n_shadow,
            "reloaded_tensors": len(reloaded),
            "reloaded_groups": len(dirty_groups),
            "seconds": {
                "verify_base": t1 - t0,
                "mapped": t2 - t1,
                "reload": t3 - t2,
                "verify_target": t4 - t3,
                "total": t4 - t0,
            },
        }
