"""A checkpoint pair of large bf16 tensors, tiled from two real snapshots.

The shared training pairs are of a small model whose largest tensor is
2 MiB, so every chunk of a delta fits in L2; real models' tensors are tens
or hundreds of MiB. This writes OLD and NEW checkpoints of ``--tensors``
bf16 tensors of ``--shape`` each, filled by repeating the words of two
snapshots (all their tensors in name order, concatenated): the same words at
the same places in both, so the changes and their rate are those of the
snapshot pair, spread over large tensors. The files repeat themselves, so
they say nothing of bytes for a codec that finds repeats (zstd); they are
for speed.

    python3 benches/make_large_pair.py --out bench-out/large            # fp32m 10 -> 15
    python3 benches/make_large_pair.py --out bench-out/large1 --new-step 11
    python3 benches/bench_codec.py --pair bench-out/large/old.safetensors \\
        bench-out/large/new.safetensors

Needs numpy only (the files are written as the format describes them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def tiled_words(words: np.ndarray, count: int) -> np.ndarray:
    """``count`` words: ``words`` repeated from its start."""
    if words.size == 0:
        raise ValueError("no words to tile")
    return np.resize(words, count)


def write_bf16(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file of bf16 tensors given as ``uint16`` bit patterns,
    in the order given (the format's header, then the data in that order)."""
    header: dict = {}
    offset = 0
    for name, bits in tensors.items():
        size = 2 * bits.size
        header[name] = {"dtype": "BF16", "shape": list(bits.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for bits in tensors.values():
            f.write(np.ascontiguousarray(bits, dtype="<u2").tobytes())


def make_pair(old_path: Path, new_path: Path, out: Path, tensors: int, shape: tuple[int, int]) -> tuple[int, int]:
    """Write ``out/old.safetensors`` and ``out/new.safetensors``; returns
    (elements, changed elements)."""
    old, new = C.load_raw(old_path), C.load_raw(new_path)
    if [t.name for t in old.tensors] != [t.name for t in new.tensors] or old.words.size != new.words.size:
        raise SystemExit(f"{new_path} has another tensor layout than {old_path}")
    rows, cols = shape
    n = rows * cols
    out.mkdir(parents=True, exist_ok=True)
    # Both snapshots' words in the same (name) order, so that the tiles line up.
    order = sorted(range(len(old.tensors)), key=lambda i: old.tensors[i].name)

    def flat(ck: C.RawCheckpoint) -> np.ndarray:
        return np.concatenate([ck.words[ck.tensors[i].start:ck.tensors[i].start + ck.tensors[i].count] for i in order])

    pair = []
    for ck, name in ((old, "old"), (new, "new")):
        words = tiled_words(flat(ck), tensors * n)
        write_bf16(out / f"{name}.safetensors",
                   {f"model.layers.{k}.mlp.up_proj.weight": words[k * n:(k + 1) * n].reshape(rows, cols) for k in range(tensors)})
        pair.append(words)
    return tensors * n, int(np.count_nonzero(pair[0] != pair[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for old.safetensors and new.safetensors")
    ap.add_argument("--data", type=Path, default=None, help="snapshot directory (default: the shared fp32-master run)")
    ap.add_argument("--old-step", type=int, default=10)
    ap.add_argument("--new-step", type=int, default=15)
    ap.add_argument("--tensors", type=int, default=4, help="how many tensors (default 4)")
    ap.add_argument("--shape", type=int, nargs=2, default=[2048, 4096], metavar=("ROWS", "COLS"),
                    help="each tensor's shape (default 2048 4096: 16 MiB of bf16)")
    args = ap.parse_args(argv)
    if args.tensors < 1 or min(args.shape) < 1:
        raise SystemExit("--tensors and --shape must be positive")
    data = args.data or C.data_dir() / "qwen-small-fp32m-3e-6"
    paths = [data / f"step_{s:03d}.safetensors" for s in (args.old_step, args.new_step)]
    for p in paths:
        if not p.is_file():
            raise SystemExit(f"{p}: no such snapshot (--data, --old-step, --new-step)")
    n, m = make_pair(paths[0], paths[1], args.out, args.tensors, tuple(args.shape))
    print(f"{args.out}/old.safetensors, new.safetensors: {args.tensors} x {args.shape[0]}x{args.shape[1]} bf16, "
          f"{m:,} of {n:,} elements changed ({100 * m / n:.2f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
