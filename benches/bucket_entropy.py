"""What coding positions per bucket of neighbouring exponents costs against
one context per exponent (the context mode's position model, format v4).

For each 4 MiB chunk of each bf16 tensor of a checkpoint pair, the plug-in
entropy of the changed flags conditioned on the old value's exponent, then
conditioned on the best partition of the exponents into at most K runs of
neighbours (a dynamic program over each chunk), in bits per changed element:

    python3 benches/bucket_entropy.py OLD NEW [--buckets 2 3 4 6 8] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

CHUNK_ELEMENTS = 2 << 20  # 4 MiB of bf16


def bf16_words(path: Path) -> dict[str, np.ndarray]:
    """Each BF16 tensor of a safetensors file as its raw 16-bit words."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    base = 8 + header_len
    out = {}
    for name, meta in header.items():
        if name == "__metadata__" or meta["dtype"] != "BF16":
            continue
        begin, end = meta["data_offsets"]
        out[name] = np.frombuffer(raw[base + begin : base + end], dtype=np.uint16)
    return out


def flag_bits(elements: np.ndarray, changes: np.ndarray) -> float:
    """Plug-in entropy, in bits, of `changes` flags among `elements` per group."""
    n = elements.astype(np.float64)
    m = changes.astype(np.float64)
    mixed = (m > 0) & (m < n)
    p = m[mixed] / n[mixed]
    return float(-(m[mixed] * np.log2(p) + (n[mixed] - m[mixed]) * np.log2(1 - p)).sum())


def best_partition_bits(elements: np.ndarray, changes: np.ndarray, k_max: int) -> float:
    """Fewest flag bits over partitions of the present exponents into at most
    `k_max` runs of neighbours."""
    present = np.flatnonzero(elements)
    n = np.concatenate([[0], np.cumsum(elements[present])]).astype(np.float64)
    m = np.concatenate([[0], np.cumsum(changes[present])]).astype(np.float64)
    count = len(present)

    def run(a: int, b: int) -> float:
        return flag_bits(np.array([n[b] - n[a]]), np.array([m[b] - m[a]]))

    cost = np.full((k_max + 1, count + 1), np.inf)
    cost[0][0] = 0.0
    for k in range(1, k_max + 1):
        for b in range(1, count + 1):
            cost[k][b] = min((cost[k - 1][a] + run(a, b) for a in range(k - 1, b)), default=np.inf)
    return float(cost[1:, count].min())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--buckets", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    old, new = bf16_words(args.old), bf16_words(args.new)
    totals = {"per exponent": 0.0, "one context": 0.0, **{f"{k} buckets": 0.0 for k in args.buckets}}
    changed = 0
    for name, o in old.items():
        for start in range(0, len(o), CHUNK_ELEMENTS):
            oc, nc = o[start : start + CHUNK_ELEMENTS], new[name][start : start + CHUNK_ELEMENTS]
            flags = oc != nc
            if not flags.any():
                continue
            changed += int(flags.sum())
            exponent = (oc >> 7) & 0xFF
            elements = np.bincount(exponent, minlength=256)
            changes = np.bincount(exponent[flags], minlength=256)
            totals["per exponent"] += flag_bits(elements, changes)
            totals["one context"] += flag_bits(np.array([elements.sum()]), np.array([changes.sum()]))
            for k in args.buckets:
                totals[f"{k} buckets"] += best_partition_bits(elements, changes, k)
    rows = {key: bits / max(changed, 1) for key, bits in totals.items()}
    print(f"{args.old} -> {args.new}: {changed:,} changed elements")
    print(f"{'positions conditioned on':<28} bits per changed element")
    for key, value in rows.items():
        print(f"{key:<28} {value:8.3f}")
    if args.out:
        args.out.write_text(json.dumps({"old": str(args.old), "new": str(args.new), "changed": changed, "bits_per_changed": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
