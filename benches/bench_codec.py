#!/usr/bin/env python3
"""Codec baselines for dcr: bytes per changed element and single-core speed.

Inputs: the real checkpoint pairs of the data README (fp32m 10->11, 11->12,
12->15, 10->15; bf16 10->11) and synthetic 1%/3%/5% deltas of fp32m step_010
(uniform random positions, ulp steps drawn from the real fp32m 10->11 pair).

Methods (all single-threaded; speeds are MB of checkpoint per second, MB = 1e6
bytes, checkpoint bytes = size of the NEW safetensors file, best of N runs):

  a  int32 index + bf16 value + zstd-3    (idx array then value array)
  b  LEB128 gaps + XOR words + zstd-3     (u64 count, varints, u16 XOR words)
  c  dense XOR of the checkpoint + zstd-1 / zstd-3
  d  zstd CLI --patch-from=OLD --long -3 -T1 (time includes the process)
  e  NEW file through zstd-1 (python zstandard, in process): speed reference
  f  entropy bounds: i.i.d. and side-information (kind, old exponent)
  g  dcr.diff_files / dcr.apply_file (mode="free", threads=1), if importable

Python baselines a-c time the in-memory codec (two uint16 arrays -> payload ->
new array); d and g include file I/O (page cache). Every decode/apply is
checked bit for bit against NEW.

    python benches/bench_codec.py [--quick] [--repeats N] [--mem-repeats N] [--pairs ID,...] [--out PATH]

Any other pair of bf16 checkpoints of one layout runs the same rows with
``--pair OLD NEW`` (repeatable; only those pairs unless ``--pairs`` also
names some), for example the fresh training pairs that
``benches/make_training_pairs.py`` writes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SCHEMA = "dcr.bench.codec/1"
SEED = 20261130
FP32M = "qwen-small-fp32m-3e-6"
BF16 = "qwen-small-bf16-1e-5"
REAL_PAIRS = [  # (id, label, directory, old step, new step)
    ("fp32m-10-11", "fp32m 10->11", FP32M, 10, 11),
    ("fp32m-11-12", "fp32m 11->12", FP32M, 11, 12),
    ("fp32m-12-15", "fp32m 12->15", FP32M, 12, 15),
    ("fp32m-10-15", "fp32m 10->15", FP32M, 10, 15),
    ("bf16-10-11", "bf16 10->11", BF16, 10, 11),
]
SYNTHETIC_RATES = [("syn-1pct", 0.01), ("syn-3pct", 0.03), ("syn-5pct", 0.05)]
ENCODE_TARGET = 4.0  # dcr encode speed / zstd-1 compress speed
APPLY_TARGET = 6.0   # dcr apply speed / zstd-1 decompress speed
# Untimed runs of a method before each of its timed runs in the interleaved
# rounds, in seconds of its own work (`time_interleaved`).
INTERLEAVED_WARMUP_S = 0.020


def step_path(directory: str, step: int) -> Path:
    return C.data_dir() / directory / f"step_{step:03d}.safetensors"


# --------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------


def best_of(fn: Callable[[], object], repeats: int, setup: Callable[[], None] | None = None,
            check: Callable[[object], None] | None = None, min_seconds: float = 0.0):
    """Run ``fn`` ``repeats`` times, and on until its timed runs have taken
    ``min_seconds`` in all; min seconds and the last result.

    ``setup`` runs untimed before each run, ``check(result)`` untimed after each.
    """
    best, spent, runs = float("inf"), 0.0, 0
    result = None
    while runs < repeats or spent < min_seconds:
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        result = fn()
        took = time.perf_counter() - t0
        best, spent, runs = min(best, took), spent + took, runs + 1
        if check is not None:
            check(result)
    return best, result


# --------------------------------------------------------------------------
# baselines a-c, e (in process)
# --------------------------------------------------------------------------


class Codec:
    """encode(old_words, new_words) -> payload; decode(old_words, payload) -> new_words."""

    key = ""
    label = ""

    def encode(self, old: np.ndarray, new: np.ndarray) -> bytes:
        raise NotImplementedError

    def decode(self, old: np.ndarray, payload: bytes) -> np.ndarray:
        raise NotImplementedError


class IndexValueZstd(Codec):
    key, label = "a_idx32_val16_zstd3", "a. int32 idx + bf16 value + zstd-3"

    def __init__(self) -> None:
        self.cctx = zstandard.ZstdCompressor(level=3)
        self.dctx = zstandard.ZstdDecompressor()

    def encode(self, old, new):
        idx = np.flatnonzero(old != new).astype("<i4")
        return self.cctx.compress(idx.tobytes() + new[idx].astype("<u2").tobytes())

    def decode(self, old, payload):
        raw = self.dctx.decompress(payload)
        m = len(raw) // 6
        idx = np.frombuffer(raw, dtype="<i4", count=m)
        vals = np.frombuffer(raw, dtype="<u2", offset=4 * m)
        out = old.copy()
        out[idx] = vals
        return out


class GapXorZstd(Codec):
    key, label = "b_leb128gap_xor16_zstd3", "b. LEB128 gaps + XOR words + zstd-3"

    def __init__(self) -> None:
        self.cctx = zstandard.ZstdCompressor(level=3)
        self.dctx = zstandard.ZstdDecompressor()

    def encode(self, old, new):
        x = old ^ new
        idx = np.flatnonzero(x)
        gaps = np.diff(idx, prepend=-1) - 1  # unchanged elements skipped before each change
        body = (np.array([idx.size], dtype="<u8").tobytes() + C.leb128_encode(gaps)
                + x[idx].astype("<u2").tobytes())
        return self.cctx.compress(body)

    def decode(self, old, payload):
        raw = self.dctx.decompress(payload)
        m = int(np.frombuffer(raw, dtype="<u8", count=1)[0])
        words = np.frombuffer(raw, dtype="<u2", offset=len(raw) - 2 * m)
        gaps = C.leb128_decode(memoryview(raw)[8 : len(raw) - 2 * m], count=m)
        idx = np.cumsum(gaps.astype(np.int64) + 1) - 1
        out = old.copy()
        out[idx] ^= words
        return out


class DenseXorZstd(Codec):
    def __init__(self, level: int) -> None:
        self.key = f"c_dense_xor_zstd{level}"
        self.label = f"c. dense XOR + zstd-{level}"
        self.cctx = zstandard.ZstdCompressor(level=level)
        self.dctx = zstandard.ZstdDecompressor()

    def encode(self, old, new):
        return self.cctx.compress((old ^ new).tobytes())

    def decode(self, old, payload):
        return old ^ np.frombuffer(self.dctx.decompress(payload), dtype="<u2")


def time_codec(codec: Codec, old: np.ndarray, new: np.ndarray, repeats: int) -> dict:
    t_enc, payload = best_of(lambda: codec.encode(old, new), repeats)
    t_dec, got = best_of(lambda: codec.decode(old, payload), repeats)
    if not np.array_equal(got, new):
        raise AssertionError(f"{codec.label}: decode does not reproduce NEW bit for bit")
    return {"payload_bytes": len(payload), "encode_s": t_enc, "decode_s": t_dec, "verified": True}


def time_full_zstd1(new_file: bytes, repeats: int, min_seconds: float = 0.0) -> dict:
    cctx = zstandard.ZstdCompressor(level=1)  # threads=0: single-threaded, in process
    dctx = zstandard.ZstdDecompressor()
    t_enc, payload = best_of(lambda: cctx.compress(new_file), repeats, min_seconds=min_seconds)
    t_dec, got = best_of(lambda: dctx.decompress(payload), repeats, min_seconds=min_seconds)
    if got != new_file:
        raise AssertionError("zstd-1 reference: round trip differs from NEW")
    return {"payload_bytes": len(payload), "encode_s": t_enc, "decode_s": t_dec, "verified": True}


# --------------------------------------------------------------------------
# d: zstd CLI patch-from
# --------------------------------------------------------------------------


def zstd_cli_version() -> str:
    exe = shutil.which("zstd")
    if exe is None:
        return ""
    out = subprocess.run([exe, "-V"], capture_output=True, text=True).stdout
    m = re.search(r"v(\d+\.\d+\.\d+)", out)
    return m.group(1) if m else out.strip()


def time_zstd_patch(old_path: Path, new_path: Path, work: Path, repeats: int) -> dict:
    exe = shutil.which("zstd")
    if exe is None:
        raise FileNotFoundError("zstd CLI not found on PATH (needed for baseline d)")
    patch = work / "patch.zst"
    out = work / "patch.out"
    enc = [exe, "-q", "-f", "-T1", "-3", "--long", f"--patch-from={old_path}", str(new_path), "-o", str(patch)]
    dec = [exe, "-d", "-q", "-f", "--long", f"--patch-from={old_path}", str(patch), "-o", str(out)]
    t_enc, _ = best_of(lambda: subprocess.run(enc, check=True), repeats)
    t_dec, _ = best_of(lambda: subprocess.run(dec, check=True), repeats)
    if out.read_bytes() != new_path.read_bytes():
        raise AssertionError("zstd --patch-from: decoded file differs from NEW")
    return {"payload_bytes": patch.stat().st_size, "encode_s": t_enc, "decode_s": t_dec, "verified": True}


# --------------------------------------------------------------------------
# g: dcr
# --------------------------------------------------------------------------


def load_dcr():
    """(module, None) if dcr exposes diff_files and apply_file, else (None, reason)."""
    try:
        dcr = importlib.import_module("dcr")
    except Exception as e:  # ImportError, or a broken build raising something else
        return None, f"import dcr failed ({type(e).__name__}: {e})"
    missing = [a for a in ("diff_files", "apply_file") if not callable(getattr(dcr, a, None))]
    if missing:
        where = getattr(dcr, "__file__", "?")
        return None, f"dcr ({where}) has no {' / '.join(missing)}"
    return dcr, None


def time_dcr(dcr, old_path: Path, new_path: Path, work: Path, m: int, repeats: int) -> dict:
    delta = work / "delta.dcr"

    def clear_delta():
        if delta.exists():
            delta.unlink()

    t_enc, stats = best_of(
        lambda: dcr.diff_files(str(old_path), str(new_path), str(delta), mode="free", threads=1),
        repeats, setup=clear_delta)
    for k in ("changed_elements", "payload_bytes", "bytes_per_changed"):
        if k not in stats:
            raise KeyError(f"dcr.diff_files returned no '{k}' (got keys {sorted(stats)})")
    target = work / "target.safetensors"

    def fresh_target():
        shutil.copyfile(old_path, target)
        os.chmod(target, 0o644)

    want = new_path.read_bytes()

    def verify(_):
        if target.read_bytes() != want:
            raise AssertionError(f"dcr.apply_file: {target} differs from NEW {new_path} after applying "
                                 f"{delta} to a copy of OLD {old_path}: dcr is not bit-exact here")

    t_dec, _ = best_of(lambda: dcr.apply_file(str(delta), str(target), threads=1),
                       repeats, setup=fresh_target, check=verify)
    warnings = []
    if int(stats["changed_elements"]) != m:
        warnings.append(f"dcr reports changed_elements={stats['changed_elements']}, the benchmark counts {m}")
    return {
        "payload_bytes": int(stats["payload_bytes"]),
        "encode_s": t_enc,
        "decode_s": t_dec,
        "verified": True,
        "delta_file_bytes": delta.stat().st_size,
        "dcr_changed_elements": int(stats["changed_elements"]),
        "dcr_bytes_per_changed": float(stats["bytes_per_changed"]),
        "warnings": warnings,
    }


class DcrInMemory:
    """dcr.diff_tensors / dcr.apply_tensors on in-memory bf16 tensors, one
    thread (no file I/O, no fsync). ``known``: the steady state of a
    publisher and a receiver that keep the committed version's tensor
    digests (dcr.tensor_digests, computed here, outside any timing)."""

    def __init__(self, dcr, inp, mode: str = "free", known: bool = False):
        import torch  # bf16 tensors, so that dcr sees the dtype (context mode keys on bf16 exponents)

        def bf16(words):
            return torch.from_numpy(np.array(words, copy=True).view(np.int16)).view(torch.bfloat16)

        self.dcr, self.mode, self.torch = dcr, mode, torch
        self.old = {t.name: bf16(inp.old.words[t.start:t.start + t.count]) for t in inp.old.tensors}
        self.new = {t.name: bf16(inp.new_words[t.start:t.start + t.count]) for t in inp.old.tensors}
        self.digests = dcr.tensor_digests(self.old) if known else None
        self.work: dict = {}

    def diff(self):
        return self.dcr.diff_tensors(self.old, self.new, threads=1, mode=self.mode, base_digests=self.digests)

    def fresh(self) -> None:
        """The target back to the base (untimed), in place: a receiver's
        weights are long-lived buffers that each refit overwrites. Fresh
        copies (`clone`) made the next apply 0.15-0.2 ms slower at fp32m
        10->15 than a copy into the same tensors (benches/RESULTS.md,
        forty-third session)."""
        if not self.work:
            self.work = {k: v.clone() for k, v in self.old.items()}
        for k, v in self.old.items():
            self.work[k].copy_(v)

    def apply(self, delta: bytes) -> None:
        self.dcr.apply_tensors(delta, self.work, threads=1, base_digests=self.digests)

    def verify(self, _=None) -> None:
        for k, v in self.new.items():
            if not self.torch.equal(self.work[k].view(self.torch.int16), v.view(self.torch.int16)):
                raise AssertionError(f"dcr.apply_tensors: tensor {k} differs from NEW: dcr is not bit-exact here")


def time_dcr_mem(dcr, inp, m: int, repeats: int, mode: str = "free", known: bool = False,
                 min_seconds: float = 0.0) -> dict:
    """dcr in memory (`DcrInMemory`): timed like baselines a-c."""
    d = DcrInMemory(dcr, inp, mode, known)
    t_enc, (delta, stats) = best_of(d.diff, repeats, min_seconds=min_seconds)
    t_dec, _ = best_of(lambda: d.apply(delta), repeats, setup=d.fresh, check=d.verify, min_seconds=min_seconds)
    return {
        "payload_bytes": len(delta),
        "encode_s": t_enc,
        "decode_s": t_dec,
        "verified": True,
        "dcr_changed_elements": int(stats["changed_elements"]),
        "dcr_bytes_per_changed": float(stats["bytes_per_changed"]),
        "warnings": [] if int(stats["changed_elements"]) == m else [f"dcr counts {stats['changed_elements']} changes, the benchmark {m}"],
    }


def time_interleaved(dcr, inp, new_file: bytes, rounds: int) -> dict:
    """The speed targets' ratios from interleaved rounds: each round times,
    one after the other, zstd-1 compressing the NEW file, the dcr diff
    (free, committed digests kept), zstd-1 decompressing and the dcr
    apply, each right after at least `INTERLEAVED_WARMUP_S` of untimed
    runs of itself (two runs of zstd-1, about ten of dcr's); the
    ratios are of the fastest time of each. Both sides of a ratio thus
    see the same stretches of a host whose speed moves within seconds,
    where the rows above time each method in a block of its own, seconds
    apart.

    The warm-up is measured in time, the same for both sides, and longer
    than the hosts' memory takes to speed up again after a core did
    little with it: after 20 ms of `zstd -1`, a busy loop or a sleep,
    eight reads of the same 20 MB took 1.58, 1.44, 1.11, 0.89, 0.77,
    0.76, ... ms with the data in L3 all along, and diffs at fp32m 10->15
    after two `zstd -1` runs 3.83, 3.38, 2.92, 2.74, 2.67, 2.66, ... ms,
    steady after about 12 ms of their own work (benches/RESULTS.md,
    forty-third session). `zstd -1` works in its own caches and barely
    moves. With one untimed run each, the timed diff took 1.2-1.5x its
    block-row time; with 10 ms of warm-up 1.08-1.17x at 10->15."""
    d = DcrInMemory(dcr, inp, "free", known=True)
    cctx, dctx = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    compressed = cctx.compress(new_file)
    delta, _ = d.diff()
    best = {"zstd1_compress": float("inf"), "dcr_diff": float("inf"), "zstd1_decompress": float("inf"), "dcr_apply": float("inf")}
    for _ in range(rounds):
        for key, fn, setup in (("zstd1_compress", lambda: cctx.compress(new_file), None),
                               ("dcr_diff", d.diff, None),
                               ("zstd1_decompress", lambda: dctx.decompress(compressed), None),
                               ("dcr_apply", lambda: d.apply(delta), d.fresh)):
            warm_from = time.perf_counter()
            while True:
                if setup is not None:
                    setup()
                fn()
                if time.perf_counter() - warm_from >= INTERLEAVED_WARMUP_S:
                    break
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t0)
        d.verify()
    return {
        "encode_vs_zstd1_compress": best["zstd1_compress"] / best["dcr_diff"],
        "apply_vs_zstd1_decompress": best["zstd1_decompress"] / best["dcr_apply"],
        "apply_vs_zstd1_compress": best["zstd1_compress"] / best["dcr_apply"],
        "rounds": rounds,
        "warmup_s": INTERLEAVED_WARMUP_S,
        "best_s": best,
    }


def time_vs_block_rows(best_s: dict, block_row: dict) -> dict:
    """How much slower dcr's fastest interleaved diff and apply were than
    the same calls in their block row: near 1 where the host served the
    inputs as fast as in the back-to-back repeats, more where its caches
    lost them or its memory had slowed down during the other method's
    turn (benches/RESULTS.md, thirty-ninth and forty-third sessions).
    `zstd -1`, bound by its own work, barely moves either way, so this
    says how much of an interleaved ratio is the host's memory."""
    return {"diff": best_s["dcr_diff"] / block_row["encode_s"], "apply": best_s["dcr_apply"] / block_row["decode_s"]}


# --------------------------------------------------------------------------
# one input
# --------------------------------------------------------------------------


@dataclass
class Input:
    id: str
    label: str
    kind: str  # "real" | "synthetic"
    old_path: Path
    new_path: Path
    old: C.RawCheckpoint
    new_words: np.ndarray
    extra: dict = field(default_factory=dict)


def bounds(inp: Input, kinds: np.ndarray) -> dict:
    old, new = inp.old.words, inp.new_words
    x = old ^ new
    idx = np.flatnonzero(x)
    n, m = old.size, idx.size
    if m == 0:
        return {"iid_bits": 0.0, "side_info_bits": 0.0}
    xw = x[idx]
    ulp = C.ulp_delta(old[idx], new[idx])
    iid_bits = C.iid_bound_total_bits(n, xw)
    side_bits = C.side_info_bound_total_bits(C.dcr_context(kinds, old), idx, ulp)
    return {
        "iid_bits": iid_bits,
        "side_info_bits": side_bits,
        "position_bits_per_changed": n * C.binary_entropy(m / n) / m,
        "xor_word_entropy_bits": C.plugin_entropy(xw),
        "ulp_delta_entropy_bits": C.plugin_entropy(ulp),
        "distinct_xor_words": int(np.unique(xw).size),
        "distinct_ulp_deltas": int(np.unique(ulp).size),
    }


def run_input(inp: Input, kinds: np.ndarray, dcr, repeats: int, work: Path, mem_repeats: int,
              mem_seconds: float = 0.0) -> dict:
    old, new = inp.old.words, inp.new_words
    n = old.size
    changed = old != new
    m = int(changed.sum())
    ckpt_bytes = inp.new_path.stat().st_size
    by_kind = {}
    for i, k in enumerate(C.KINDS):
        sel = kinds == i
        if sel.any():
            by_kind[k] = float(changed[sel].mean())

    b = bounds(inp, kinds)
    rows = []

    def row(key, label, res=None, bytes_total=None):
        total = res["payload_bytes"] if res is not None else bytes_total
        r = {"method": key, "label": label, "payload_bytes": total,
             "bytes_per_changed": total / m if m else None}
        if res is not None:
            r.update({k: v for k, v in res.items() if k != "payload_bytes"})
            r["encode_mb_s"] = ckpt_bytes / res["encode_s"] / 1e6
            r["decode_mb_s"] = ckpt_bytes / res["decode_s"] / 1e6
        else:
            r.update({"encode_s": None, "decode_s": None, "encode_mb_s": None, "decode_mb_s": None})
        rows.append(r)
        return r

    for codec in (IndexValueZstd(), GapXorZstd(), DenseXorZstd(1), DenseXorZstd(3)):
        row(codec.key, codec.label, time_codec(codec, old, new, repeats))
    row("d_zstd_cli_patch_from_long3", "d. zstd --patch-from --long -3 (CLI)",
        time_zstd_patch(inp.old_path, inp.new_path, work, repeats))
    ref = row("e_full_new_zstd1", "e. full NEW file, zstd-1 (reference)",
              time_full_zstd1(inp.new_path.read_bytes(), mem_repeats, mem_seconds))
    row("f_iid_bound", "f. i.i.d. entropy bound", bytes_total=b["iid_bits"] / 8)
    row("f_side_info_bound", "f. side-info bound (kind, old exp)", bytes_total=b["side_info_bits"] / 8)
    ratios = None
    if dcr is not None:
        row("g_dcr_files_t1", "g. dcr diff_files/apply_file (files, fsync, 1 thr)",
            time_dcr(dcr, inp.old_path, inp.new_path, work, m, repeats))
        row("g_dcr_free_t1", "g. dcr diff/apply in memory (free, digests computed, 1 thr)",
            time_dcr_mem(dcr, inp, m, mem_repeats, min_seconds=mem_seconds))
        d = row("g_dcr_free_known_t1", "g. dcr diff/apply in memory (free, committed digests kept, 1 thr)",
                time_dcr_mem(dcr, inp, m, mem_repeats, known=True, min_seconds=mem_seconds))
        row("h_dcr_context_t1", "h. dcr diff/apply in memory (context, committed digests kept, 1 thr)",
            time_dcr_mem(dcr, inp, m, mem_repeats, mode="context", known=True, min_seconds=mem_seconds))
        ratios = {
            "encode_vs_zstd1_compress": d["encode_mb_s"] / ref["encode_mb_s"],
            "apply_vs_zstd1_decompress": d["decode_mb_s"] / ref["decode_mb_s"],
            "apply_vs_zstd1_compress": d["decode_mb_s"] / ref["encode_mb_s"],
            "encode_target": ENCODE_TARGET,
            "apply_target": APPLY_TARGET,
            # The same ratios with both sides timed in alternation.
            "interleaved": time_interleaved(dcr, inp, inp.new_path.read_bytes(), mem_repeats),
        }
        ratios["interleaved"]["dcr_time_vs_block_rows"] = time_vs_block_rows(ratios["interleaved"]["best_s"], d)
        ratios["encode_meets_target"] = ratios["encode_vs_zstd1_compress"] >= ENCODE_TARGET
        ratios["apply_meets_target"] = ratios["apply_vs_zstd1_decompress"] >= APPLY_TARGET
    iid_total = b["iid_bits"] / 8
    for r in rows:
        r["ratio_to_iid"] = r["payload_bytes"] / iid_total if iid_total else None
        side_total = b["side_info_bits"] / 8
        r["ratio_to_side_info"] = r["payload_bytes"] / side_total if side_total else None

    return {
        "id": inp.id,
        "label": inp.label,
        "kind": inp.kind,
        "old": str(inp.old_path),
        "new": str(inp.new_path) if inp.kind == "real" else None,
        **inp.extra,
        "n_elements": int(n),
        "changed_elements": m,
        "change_rate": m / n,
        "change_rate_by_kind": by_kind,
        "checkpoint_bytes": ckpt_bytes,
        "bounds": {
            "iid_bytes_per_changed": b["iid_bits"] / 8 / m if m else None,
            "side_info_bytes_per_changed": b["side_info_bits"] / 8 / m if m else None,
            **{k: v for k, v in b.items() if k not in ("iid_bits", "side_info_bits")},
        },
        "methods": rows,
        "dcr_speed_ratios": ratios,
    }


# --------------------------------------------------------------------------
# printing
# --------------------------------------------------------------------------


def fmt(v, spec):
    """format(v, spec), or a dash padded to the spec's width when v is None."""
    if v is not None:
        return format(v, spec)
    width = re.match(r"\d*", spec).group()
    return "-".rjust(int(width) if width else 1)


def print_input(res: dict) -> None:
    print(f"\n== {res['label']} ({res['kind']}): {res['changed_elements']:,} of {res['n_elements']:,} "
          f"elements changed ({100 * res['change_rate']:.3f} %), checkpoint {res['checkpoint_bytes']:,} B")
    print("   change rate by kind: " + ", ".join(f"{k} {100 * v:.3f}%" for k, v in res["change_rate_by_kind"].items()))
    hdr = f"{'method':<44} {'B/changed':>10} {'x iid':>7} {'total bytes':>12} {'enc MB/s':>9} {'dec MB/s':>9}"
    print(hdr)
    print("-" * len(hdr))
    for r in res["methods"]:
        print(f"{r['label']:<44} {fmt(r['bytes_per_changed'], '10.3f')} {fmt(r['ratio_to_iid'], '7.2f')} "
              f"{r['payload_bytes']:>12,.0f} {fmt(r['encode_mb_s'], '9.0f')} {fmt(r['decode_mb_s'], '9.0f')}")
        for w in r.get("warnings", []):
            print(f"   WARNING: {w}")
    q = res["dcr_speed_ratios"]
    if q is not None:
        print(f"   dcr vs zstd-1: encode {q['encode_vs_zstd1_compress']:.2f}x compress (target >= {ENCODE_TARGET:g}x, "
              f"{'met' if q['encode_meets_target'] else 'NOT met'}); apply {q['apply_vs_zstd1_decompress']:.2f}x "
              f"decompress (target >= {APPLY_TARGET:g}x, {'met' if q['apply_meets_target'] else 'NOT met'}); "
              f"apply {q['apply_vs_zstd1_compress']:.2f}x compress")
        v = q["interleaved"]
        slower = v["dcr_time_vs_block_rows"]
        print(f"   interleaved with zstd-1 (same stretches of the host): encode {v['encode_vs_zstd1_compress']:.2f}x, "
              f"apply {v['apply_vs_zstd1_decompress']:.2f}x decompress (dcr's diff {slower['diff']:.2f}x and apply "
              f"{slower['apply']:.2f}x its block-row time: 1 where the host's memory served it as fast as there)")


SUMMARY_COLS = [  # (method key, short header)
    ("a_idx32_val16_zstd3", "a idx+val"),
    ("b_leb128gap_xor16_zstd3", "b gap+xor"),
    ("c_dense_xor_zstd1", "c xor z1"),
    ("c_dense_xor_zstd3", "c xor z3"),
    ("d_zstd_cli_patch_from_long3", "d patch"),
    ("g_dcr_free_t1", "g dcr mem"),
    ("g_dcr_free_known_t1", "g dcr kept"),
    ("g_dcr_files_t1", "g dcr files"),
    ("h_dcr_context_t1", "h dcr ctx"),
]


def print_summary(results: list[dict], dcr_note: str | None) -> None:
    by = {res["id"]: {r["method"]: r for r in res["methods"]} for res in results}
    cols = [(k, h) for k, h in SUMMARY_COLS if any(k in b for b in by.values())]

    def get(res, key, field):
        r = by[res["id"]].get(key)
        return None if r is None else r[field]

    print("\n== Summary: bytes per changed element")
    hdr = f"{'input':<14} {'rate %':>7} {'iid':>6} {'side':>6} " + " ".join(f"{h:>9}" for _, h in cols)
    print(hdr)
    print("-" * len(hdr))
    for res in results:
        b = res["bounds"]
        print(f"{res['label']:<14} {100 * res['change_rate']:7.3f} {fmt(b['iid_bytes_per_changed'], '6.3f')} "
              f"{fmt(b['side_info_bytes_per_changed'], '6.3f')} "
              + " ".join(fmt(get(res, k, "bytes_per_changed"), "9.3f") for k, _ in cols))
    print("\n== Summary: encode / decode MB/s of checkpoint, one core")
    scols = cols + [("e_full_new_zstd1", "e zstd-1")]
    hdr = f"{'input':<14} " + " ".join(f"{h:>13}" for _, h in scols)
    print(hdr)
    print("-" * len(hdr))
    for res in results:
        cells = [f"{fmt(get(res, k, 'encode_mb_s'), '.0f')}/{fmt(get(res, k, 'decode_mb_s'), '.0f')}".rjust(13)
                 for k, _ in scols]
        print(f"{res['label']:<14} " + " ".join(cells))
    ratios = [(res["label"], res["dcr_speed_ratios"]) for res in results if res["dcr_speed_ratios"]]
    if ratios:
        print("\n== dcr speed vs zstd-1 of the full NEW file "
              f"(targets: encode >= {ENCODE_TARGET:g}x compress, apply >= {APPLY_TARGET:g}x decompress; "
              "then the same timed in interleaved rounds)")
        for label, q in ratios:
            v = q["interleaved"]
            print(f"{label:<14} encode {q['encode_vs_zstd1_compress']:6.2f}x   apply {q['apply_vs_zstd1_decompress']:6.2f}x"
                  f"   (apply vs compress {q['apply_vs_zstd1_compress']:.2f}x)"
                  f"   interleaved: encode {v['encode_vs_zstd1_compress']:5.2f}x   apply {v['apply_vs_zstd1_decompress']:5.2f}x")
    if dcr_note:
        print(f"\n{dcr_note}")


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def select(ids: list[str], pattern: str | None) -> list[str]:
    if not pattern:
        return ids
    wanted = [p.strip().lower() for p in pattern.split(",") if p.strip()]
    chosen = [i for i in ids if any(w in i for w in wanted)]
    unmatched = [w for w in wanted if not any(w in i for i in ids)]
    if unmatched:
        raise SystemExit(f"--pairs: {', '.join(unmatched)} matches no input; inputs are {', '.join(ids)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    all_ids = [p[0] for p in REAL_PAIRS] + [s[0] for s in SYNTHETIC_RATES]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one timing run per method instead of best of 3")
    ap.add_argument("--repeats", type=int, help="timing runs per method, best kept (default 3; 1 with --quick)")
    ap.add_argument("--mem-repeats", type=int,
                    help="timing runs of the in-memory rows that take milliseconds (zstd-1 reference and dcr "
                         "in memory, the rows the speed ratios compare), best kept (default 15; 1 with --quick): "
                         "on a shared host a best of 3 of a 2 ms call is mostly noise")
    ap.add_argument("--mem-seconds", type=float,
                    help="the in-memory rows also run on until their timed runs have taken this long "
                         "(default 0.15; 0 with --quick), so that a 2 ms call draws its fastest from as long a "
                         "stretch of the host as a 10 ms one does from its repeats")
    ap.add_argument("--pairs", help="comma-separated input ids or substrings (ids: " + ", ".join(all_ids) + ")")
    ap.add_argument("--pair", nargs=2, action="append", default=[], metavar=("OLD", "NEW"),
                    help="another pair of bf16 safetensors checkpoints of one layout (repeatable); "
                         "alone it replaces the shared pairs, with --pairs it adds to them")
    ap.add_argument("--out", default=str(C.REPO_ROOT / "bench-out" / "codec.json"), help="JSON output path")
    args = ap.parse_args(argv)
    repeats = args.repeats if args.repeats else (1 if args.quick else 3)
    mem_repeats = args.mem_repeats if args.mem_repeats else (1 if args.quick else 15)
    mem_seconds = args.mem_seconds if args.mem_seconds is not None else (0.0 if args.quick else 0.15)
    if repeats < 1 or mem_repeats < 1:
        raise SystemExit("--repeats and --mem-repeats must be at least 1")
    if mem_seconds < 0:
        raise SystemExit("--mem-seconds must not be negative")
    chosen = [] if args.pair and not args.pairs else select(all_ids, args.pairs)
    own_pairs = [(Path(a), Path(b)) for a, b in args.pair]
    for path in (p for pair in own_pairs for p in pair):
        if not path.is_file():
            raise SystemExit(f"--pair: {path} is not a file")

    data = C.data_dir()
    if chosen and not (data / FP32M).is_dir():
        raise SystemExit(f"checkpoint data not found under {data}: set DCR_DATA to the directory holding {FP32M}/")

    dcr, reason = load_dcr()
    dcr_note = None
    if dcr is None:
        dcr_note = f"dcr rows skipped: {reason}"
        print(dcr_note)
    else:
        print(f"dcr: {getattr(dcr, '__file__', '?')} version {getattr(dcr, '__version__', '?')}")

    t_start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="dcr-bench-codec-") as tmp:
        work = Path(tmp)
        inputs = []  # (input, tensor kind of every element)
        for i, (old_path, new_path) in enumerate(own_pairs):
            try:
                old, new = C.load_raw(old_path), C.load_raw(new_path)
            except ValueError as e:
                raise SystemExit(f"--pair: {e}") from None
            if new.tensors != old.tensors:
                raise SystemExit(f"--pair: {new_path} has another tensor layout than {old_path}: "
                                 "a delta needs two versions of one layout")
            other = next((t for t in old.tensors if t.dtype != "BF16"), None)
            if other is not None:
                raise SystemExit(f"--pair: {old_path}: tensor {other.name} is {other.dtype}; the bounds and "
                                 "baselines here read bf16 words only (dcr itself codes every dtype)")
            label = f"{old_path.parent.name}/{old_path.stem} -> {new_path.stem}"
            inputs.append((Input(f"pair-{i + 1}", label, "real", old.path, new.path, old, new.words), C.kind_ids(old)))
        base = C.load_raw(step_path(FP32M, 10)) if chosen else None
        kinds = C.kind_ids(base) if base is not None else None
        for pid, label, directory, a, b in REAL_PAIRS:
            if pid in chosen:
                old = base if (directory, a) == (FP32M, 10) else C.load_raw(step_path(directory, a))
                new = C.load_raw(step_path(directory, b))
                for ck in (old, new):
                    if ck.tensors != base.tensors:  # kinds are computed once, from base
                        raise SystemExit(f"{ck.path}: tensor layout differs from {base.path}")
                inputs.append((Input(pid, label, "real", old.path, new.path, old, new.words), kinds))
        syn = [(sid, r) for sid, r in SYNTHETIC_RATES if sid in chosen]
        if syn:
            pool = C.ulp_step_pool(base.words, C.load_raw(step_path(FP32M, 11)).words)
            for sid, rate in syn:
                seed = SEED + int(round(rate * 10000))
                words, _ = C.synthetic_new(base.words, rate, pool, seed)
                newp = work / f"{sid}.safetensors"
                newp.write_bytes(base.header + words.astype("<u2").tobytes())
                inputs.append((Input(sid, f"synthetic {rate:.0%}", "synthetic", base.path, newp, base, words,
                                     {"synthetic": {"rate": rate, "seed": seed,
                                                    "step_pool": f"{FP32M} 10->11 ulp deltas, sign flips excluded",
                                                    "step_pool_size": int(pool.size)}}), kinds))
        for inp, inp_kinds in inputs:
            res = run_input(inp, inp_kinds, dcr, repeats, work, mem_repeats, mem_seconds)
            results.append(res)
            print_input(res)

    print_summary(results, dcr_note)
    elapsed = time.perf_counter() - t_start
    doc = {
        "schema": SCHEMA,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name] + (sys.argv[1:] if argv is None else argv)),
        "machine": {
            "platform": platform.platform(),
            "cpu_model": C.cpu_model(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "zstandard": zstandard.__version__,
            "zstd_library": ".".join(map(str, zstandard.ZSTD_VERSION)),
            "zstd_cli": zstd_cli_version(),
        },
        "config": {
            "repeats": repeats,
            "mem_repeats": mem_repeats,
            "mem_seconds": mem_seconds,
            "interleaved_warmup_s": INTERLEAVED_WARMUP_S,
            "timing": "best of repeats (the in-memory rows: and of mem_seconds of runs), time.perf_counter, single thread",
            "mb": 1_000_000,
            "checkpoint_bytes": "size of the NEW safetensors file",
            "bytes_per_changed": "payload bytes / changed 16-bit elements",
            "seed": SEED,
            "data_dir": str(data),
            "elapsed_s": elapsed,
        },
        "dcr": {"available": dcr is not None, "skip_reason": reason,
                "module": getattr(dcr, "__file__", None) if dcr else None},
        "inputs": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote {out} ({elapsed:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
