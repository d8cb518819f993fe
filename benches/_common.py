"""Shared helpers for the dcr benchmarks (numpy only, no torch).

* locating the checkpoint data (``DCR_DATA`` or ``<repo>/../shared/data``);
* loading a safetensors file raw, every 2-byte element as ``uint16``;
* tensor kinds (embed, lm_head, attn, mlp, norm, bias) as in the data README;
* the bf16 ulp mapping (bits <-> monotone integer ordinal);
* plug-in entropies and the two entropy bounds used by ``bench_codec.py``;
* vectorised LEB128 varints.

Everything is vectorised so a 5M-element checkpoint takes milliseconds.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo; "unknown" elsewhere): speeds
    and the ratios against zstd move with it, so every result records it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def data_dir() -> Path:
    """The checkpoint data: ``$DCR_DATA`` if set, else ``<repo>/../shared/data``."""
    env = os.environ.get("DCR_DATA")
    return Path(env) if env else (REPO_ROOT.parent / "shared" / "data").resolve()


# --------------------------------------------------------------------------
# safetensors, raw
# --------------------------------------------------------------------------

_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # first element, in 16-bit words of the data region
    count: int  # number of elements


@dataclass(frozen=True)
class RawCheckpoint:
    """A safetensors file whose tensors are all 2-byte types, as one flat array.

    ``words`` is the whole data region as little-endian ``uint16`` (tensors in
    file order, which is offset order); ``header`` is the file's first
    ``8 + header_len`` bytes, so ``header + words.tobytes()`` rebuilds the file.
    """

    path: Path
    header: bytes
    tensors: tuple[TensorInfo, ...]
    words: np.ndarray

    @property
    def file_bytes(self) -> int:
        return len(self.header) + self.words.nbytes


def load_raw(path: str | os.PathLike) -> RawCheckpoint:
    """Read a safetensors file without torch; every element as ``uint16``.

    Raises ``ValueError`` for a malformed header, a tensor that is not 2 bytes
    wide, or a data region that the tensors do not tile exactly.
    """
    path = Path(path)
    buf = path.read_bytes()
    if len(buf) < 8:
        raise ValueError(f"{path}: {len(buf)} bytes, expected at least 8 for a safetensors header")
    (hlen,) = struct.unpack("<Q", buf[:8])
    if 8 + hlen > len(buf):
        raise ValueError(f"{path}: header length {hlen} runs past the file end ({len(buf)} bytes)")
    meta = json.loads(buf[8 : 8 + hlen])
    entries = []
    for name, t in meta.items():
        if name == "__metadata__":
            continue
        width = _DTYPE_BYTES.get(t["dtype"])
        if width != 2:
            raise ValueError(f"{path}: tensor {name} has dtype {t['dtype']}; only 2-byte dtypes load as uint16")
        b, e = t["data_offsets"]
        count = int(np.prod(t["shape"], dtype=np.int64))
        if e - b != 2 * count:
            raise ValueError(f"{path}: tensor {name} spans {e - b} bytes, shape {t['shape']} needs {2 * count}")
        entries.append((b, e, name, t["dtype"], tuple(t["shape"]), count))
    entries.sort()
    data_len = len(buf) - 8 - hlen
    pos = 0
    tensors = []
    for b, e, name, dtype, shape, count in entries:
        if b != pos:
            raise ValueError(f"{path}: tensor {name} starts at byte {b}, expected {pos} (gap or overlap)")
        tensors.append(TensorInfo(name, dtype, shape, b // 2, count))
        pos = e
    if pos != data_len:
        raise ValueError(f"{path}: tensors cover {pos} bytes of a {data_len}-byte data region")
    words = np.frombuffer(buf, dtype="<u2", offset=8 + hlen).astype(np.uint16, copy=False)
    return RawCheckpoint(path, buf[: 8 + hlen], tuple(tensors), words)


# --------------------------------------------------------------------------
# tensor kinds
# --------------------------------------------------------------------------

KINDS = ("embed", "lm_head", "attn", "mlp", "norm", "bias", "other")


def tensor_kind(name: str) -> str:
    """embed / lm_head / attn / mlp / norm / bias (the data README's types)."""
    if "embed_tokens" in name:
        return "embed"
    if name.startswith("lm_head"):
        return "lm_head"
    if name.endswith(".bias"):
        return "bias"
    if "norm" in name:
        return "norm"
    if ".self_attn." in name:
        return "attn"
    if ".mlp." in name:
        return "mlp"
    return "other"


def kind_ids(ckpt: RawCheckpoint) -> np.ndarray:
    """Per-element index into ``KINDS`` (uint8, same length as ``ckpt.words``)."""
    ids = np.array([KINDS.index(tensor_kind(t.name)) for t in ckpt.tensors], dtype=np.uint8)
    counts = np.array([t.count for t in ckpt.tensors], dtype=np.int64)
    return np.repeat(ids, counts)


# --------------------------------------------------------------------------
# bf16 ulp mapping
# --------------------------------------------------------------------------
#
# ordinal(bits): read the 16 bits as int16 s; ordinal = s if s >= 0 else s ^ 0x7fff.
# Non-negative patterns keep their value (+0 -> 0, +inf -> 0x7f80, NaNs above);
# a negative pattern with magnitude bits m maps to -1 - m (-0 -> -1, -min
# subnormal -> -2, ..., -inf -> -0x7f81, negative NaNs below). This is the usual
# sign-magnitude -> two's-complement ordering: a bijection of all 65536 patterns
# onto [-32768, 32767], strictly increasing in the float value over the non-NaN
# patterns, with -0 and +0 one step apart (-0 < +0). The map is its own inverse.
# A ulp delta is ordinal(new) - ordinal(old): the signed number of representable
# bf16 steps between the two values, exact for every pattern pair (range
# [-65535, 65535]).


def bf16_ordinal(bits: np.ndarray) -> np.ndarray:
    """Monotone integer for each bf16 bit pattern (int32, in [-32768, 32767])."""
    s = np.asarray(bits, dtype=np.uint16).view(np.int16).astype(np.int32)
    return s ^ ((s >> 15) & 0x7FFF)


def bf16_from_ordinal(ordinal: np.ndarray) -> np.ndarray:
    """Inverse of ``bf16_ordinal`` (ordinal must lie in [-32768, 32767])."""
    o = np.asarray(ordinal, dtype=np.int32)
    if o.size and (o.min() < -32768 or o.max() > 32767):
        raise ValueError("bf16 ordinal out of range [-32768, 32767]")
    s = o ^ ((o >> 15) & 0x7FFF)
    return s.astype(np.int16).view(np.uint16)


def ulp_delta(old_bits: np.ndarray, new_bits: np.ndarray) -> np.ndarray:
    """Signed distance in bf16 steps from old to new (int32)."""
    return bf16_ordinal(new_bits) - bf16_ordinal(old_bits)


def bf16_exponent(bits: np.ndarray) -> np.ndarray:
    """The 8 exponent bits of each bf16 pattern (0..255)."""
    return ((np.asarray(bits, dtype=np.uint16) >> 7) & 0xFF).astype(np.int32)


# --------------------------------------------------------------------------
# entropy
# --------------------------------------------------------------------------


def entropy_bits(counts: np.ndarray) -> float:
    """Plug-in Shannon entropy (bits per symbol) of a histogram; zero bins ignored."""
    c = np.asarray(counts, dtype=np.float64)
    c = c[c > 0]
    total = c.sum()
    if total == 0:
        return 0.0
    p = c / total
    return float(-(p * np.log2(p)).sum())


def plugin_entropy(values: np.ndarray) -> float:
    """Plug-in entropy (bits per symbol) of the empirical distribution of ``values``."""
    values = np.asarray(values)
    if values.size == 0:
        return 0.0
    _, counts = np.unique(values, return_counts=True)
    return entropy_bits(counts)


def binary_entropy(p: np.ndarray | float) -> np.ndarray | float:
    """h(p) in bits, elementwise, with h(0) = h(1) = 0 (no warnings)."""
    arr = np.asarray(p, dtype=np.float64)
    if np.any((arr < 0) | (arr > 1)):
        raise ValueError("binary_entropy needs 0 <= p <= 1")
    q = np.clip(arr, 1e-300, 1.0)
    r = np.clip(1.0 - arr, 1e-300, 1.0)
    h = -(arr * np.log2(q) + (1.0 - arr) * np.log2(r))
    h = np.where((arr == 0) | (arr == 1), 0.0, h)
    return float(h) if np.ndim(p) == 0 else h


def conditional_entropy_total_bits(context: np.ndarray, symbols: np.ndarray) -> float:
    """sum_c m_c * H(symbol | context = c), plug-in, in bits (m_c = samples in c)."""
    context = np.asarray(context, dtype=np.int64)
    symbols = np.asarray(symbols, dtype=np.int64)
    if context.shape != symbols.shape:
        raise ValueError("context and symbols must have the same shape")
    if context.size == 0:
        return 0.0
    pairs = np.stack([context, symbols], axis=1)
    uniq, counts = np.unique(pairs, axis=0, return_counts=True)
    ctx_u, ctx_inv = np.unique(uniq[:, 0], return_inverse=True)
    m_c = np.bincount(ctx_inv, weights=counts).astype(np.float64)
    cnt = counts.astype(np.float64)
    return float(-(cnt * np.log2(cnt / m_c[ctx_inv])).sum())


def iid_bound_total_bits(n: int, xor_words: np.ndarray) -> float:
    """i.i.d. bound in bits: n*h(m/n) + m*H(xor words), m = len(xor_words).

    Positions as independent Bernoulli(p = m/n) flags over all n elements,
    changed values as i.i.d. draws from the plug-in XOR-word distribution.
    """
    m = int(np.asarray(xor_words).size)
    if n <= 0 or m > n:
        raise ValueError(f"need 0 <= m <= n, got m={m} n={n}")
    return float(n * binary_entropy(m / n) + m * plugin_entropy(xor_words))


def side_info_bound_total_bits(context_all: np.ndarray, changed_idx: np.ndarray,
                               symbols: np.ndarray) -> float:
    """Side-information bound in bits, given a context for every element.

    sum over contexts c of  n_c * h(m_c / n_c) + m_c * H(symbol | c),
    where n_c = elements in c, m_c = changed elements in c (positions
    ``changed_idx``, whose symbols are ``symbols``).
    """
    context_all = np.asarray(context_all, dtype=np.int64)
    changed_idx = np.asarray(changed_idx, dtype=np.int64)
    if context_all.size == 0:
        return 0.0
    if context_all.min() < 0:
        raise ValueError("contexts must be non-negative integers")
    k = int(context_all.max()) + 1
    n_c = np.bincount(context_all, minlength=k).astype(np.float64)
    ctx_changed = context_all[changed_idx]
    m_c = np.bincount(ctx_changed, minlength=k).astype(np.float64)
    present = n_c > 0
    positions = float((n_c[present] * binary_entropy(m_c[present] / n_c[present])).sum())
    return positions + conditional_entropy_total_bits(ctx_changed, symbols)


def dcr_context(kinds: np.ndarray, old_bits: np.ndarray) -> np.ndarray:
    """Context id (tensor kind, old exponent bits) = kind * 256 + exponent."""
    return np.asarray(kinds, dtype=np.int64) * 256 + bf16_exponent(old_bits)


# --------------------------------------------------------------------------
# LEB128 varints (unsigned), vectorised
# --------------------------------------------------------------------------


def leb128_encode(values: np.ndarray) -> bytes:
    """Unsigned LEB128: 7 bits per byte, low group first, high bit = more follows."""
    v = np.asarray(values)
    if v.size == 0:
        return b""
    if v.min() < 0:
        raise ValueError("leb128_encode takes non-negative integers")
    v = v.astype(np.uint64)
    nbytes = np.ones(v.size, dtype=np.int64)
    for k in range(1, 10):
        nbytes += v >= np.uint64(1 << (7 * k))
    rep = np.repeat(v, nbytes)
    starts = np.cumsum(nbytes) - nbytes
    j = np.arange(rep.size, dtype=np.int64) - np.repeat(starts, nbytes)
    out = ((rep >> (7 * j).astype(np.uint64)) & np.uint64(0x7F)).astype(np.uint8)
    last = np.cumsum(nbytes) - 1
    cont = np.ones(rep.size, dtype=bool)
    cont[last] = False
    out[cont] |= 0x80
    return out.tobytes()


def leb128_decode(data: bytes | np.ndarray, count: int | None = None) -> np.ndarray:
    """Decode a run of unsigned LEB128 varints (uint64). ``count`` checks the number."""
    b = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else np.asarray(data, dtype=np.uint8)
    if b.size == 0:
        out = np.zeros(0, dtype=np.uint64)
    else:
        if b[-1] & 0x80:
            raise ValueError("leb128_decode: truncated varint at end of input")
        ends = np.flatnonzero((b & 0x80) == 0)
        starts = np.concatenate(([0], ends[:-1] + 1))
        lens = ends - starts + 1
        if lens.max() > 10:
            raise ValueError("leb128_decode: varint longer than 10 bytes")
        j = np.arange(b.size, dtype=np.int64) - np.repeat(starts, lens)
        parts = (b & 0x7F).astype(np.uint64) << (7 * j).astype(np.uint64)
        out = np.add.reduceat(parts, starts)
    if count is not None and out.size != count:
        raise ValueError(f"leb128_decode: {out.size} varints, expected {count}")
    return out


# --------------------------------------------------------------------------
# synthetic deltas
# --------------------------------------------------------------------------

BF16_MAX_FINITE = 0x7F7F  # largest finite magnitude pattern


def ulp_step_pool(old_bits: np.ndarray, new_bits: np.ndarray) -> np.ndarray:
    """The ulp deltas of the changed elements of a real pair, sign flips left out.

    Returns an int32 array (one entry per changed element whose sign bit did not
    change) to draw synthetic steps from; every entry is nonzero.
    """
    old_bits = np.asarray(old_bits, dtype=np.uint16)
    new_bits = np.asarray(new_bits, dtype=np.uint16)
    idx = np.flatnonzero(old_bits != new_bits)
    o, n = old_bits[idx], new_bits[idx]
    same_sign = ((o ^ n) & 0x8000) == 0
    return ulp_delta(o[same_sign], n[same_sign])


def synthetic_new(old_bits: np.ndarray, rate: float, step_pool: np.ndarray,
                  seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A new version of ``old_bits`` with round(rate * n) elements changed.

    Positions are a uniform random set (without replacement); each chosen
    element moves by a step drawn from ``step_pool`` (ulps, nonzero). A step
    that would flip the sign or leave the finite range is redrawn, so every
    chosen element changes and no NaN/inf appears. Deterministic in ``seed``.
    Returns (new_bits, sorted changed positions).
    """
    old_bits = np.asarray(old_bits, dtype=np.uint16)
    pool = np.asarray(step_pool, dtype=np.int32)
    if pool.size == 0 or np.any(pool == 0):
        raise ValueError("step_pool must be non-empty and hold nonzero steps")
    rng = np.random.default_rng(seed)
    n = old_bits.size
    m = int(round(rate * n))
    idx = np.sort(rng.choice(n, size=m, replace=False))
    o = bf16_ordinal(old_bits[idx])
    lo = np.where(o >= 0, 0, -1 - BF16_MAX_FINITE)
    hi = np.where(o >= 0, BF16_MAX_FINITE, -1)
    steps = rng.choice(pool, size=m)
    for _ in range(100):
        t = o + steps
        bad = (t < lo) | (t > hi)
        if not bad.any():
            break
        steps[bad] = rng.choice(pool, size=int(bad.sum()))
    else:
        raise ValueError("synthetic_new: could not place every step inside the finite, same-sign range")
    new_bits = old_bits.copy()
    new_bits[idx] = bf16_from_ordinal(o + steps)
    return new_bits, idx
