#!/usr/bin/env python3
"""Build, check and time dcr's CUDA kernels on one GPU; print a table, write JSON.

    PYTHONPATH=python python benches/gpu/bench_kernels.py --out bench-out/kernels.json

Steps: load/compile the kernels (reports where from and how long), check
every word width and both diff strategies bit for bit against the reference
path on small tensors, then on a --size-gib tensor of --dtype (default 1 GiB
of bf16) at each change fraction: check diff and apply against the
reference, and time

  copy      dst.copy_(src), the device-to-device bandwidth to compare with
            (bytes = 2 x size: read + write)
  diff      sparse_diff(old, new) per strategy (bytes = old + new read +
            positions and values written); 'onepass+upd' also sets old = new
            (+ the changed words written)
  apply     apply_xor / apply_overwrite of that diff (bytes = positions and
            values read + target words read and written); 'vs copy' there is
            how many times faster than a dense copy of the tensor

with CUDA events, median of --iters runs. Goal: diff >= 80% of copy
bandwidth. Exit status 0 = ran and all checks passed, 1 = a check failed,
2 = no CUDA device (nothing measured).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

DTYPES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "fp8": "float8_e4m3fn",
    "fp64": "float64",
    "int8": "int8",
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=1.0, help="tensor size in GiB (default 1)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--fracs", default="0.01,0.03,0.05", help="fractions of changed words")
    p.add_argument("--chunk-elems", type=int, default=1 << 20, help="codec chunk size in elements")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    p.add_argument(
        "--no-sweep",
        action="store_true",
        help="skip the tuning sweep (one-pass diff at the middle fraction for each DCR_VECS/DCR_MIN_BLOCKS setting)",
    )
    p.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="exercise this script on the CPU with the reference path (checks the script, measures nothing useful)",
    )
    return p.parse_args()


def main() -> int:
    args = parse()
    try:
        import torch
    except ImportError:
        print("bench_kernels: torch is not installed; nothing measured", file=sys.stderr)
        return 2
    dry = args.dry_run_cpu
    if not dry and not torch.cuda.is_available():
        print(
            "bench_kernels: no CUDA device (torch.cuda.is_available() is False); "
            "this benchmark needs a GPU, nothing measured",
            file=sys.stderr,
        )
        return 2
    import dcr.cuda as dc

    t_start = time.perf_counter()
    if dry:
        dev, impl, name, cap_s = torch.device("cpu"), "cpu", "cpu (dry run)", "-"
        origin, load_s = "reference", 0.0

        def sync() -> None:
            pass

        props = None
    else:
        dev, impl = torch.device("cuda", torch.cuda.current_device()), "cuda"
        props = torch.cuda.get_device_properties(dev)
        name, cap_s = props.name, f"{props.major}.{props.minor}"
        t0 = time.perf_counter()
        origin = dc.load_kernels(dev)
        load_s = time.perf_counter() - t0

        def sync() -> None:
            torch.cuda.synchronize(dev)

    print(f"device: {name} (capability {cap_s}), torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"kernels: loaded from {origin} in {load_s:.2f} s")

    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)
            print(f"CHECK FAILED: {what}", file=sys.stderr)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))

    # ---- small correctness sweep: every width, both strategies, odd sizes
    g = torch.Generator(device=dev).manual_seed(1234)
    t0 = time.perf_counter()
    small = ((1, 1), (5000, 64), (300_001, 4097)) if dry else ((1, 1), (5000, 64), (300_001, 4097), (2_000_003, 1 << 16))
    for wdt in (torch.uint8, torch.int16, torch.int32, torch.int64):
        for n, chunk in small:
            info = torch.iinfo(wdt)
            old = torch.randint(info.min, info.max, (n,), dtype=wdt, device=dev, generator=g)
            new = old.clone()
            idx = torch.randint(0, n, (max(1, n // 25),), device=dev, generator=g)
            new[idx] = new[idx] ^ 1
            want = dc.sparse_diff(old.clone(), new, chunk, impl="cpu", with_new=True)
            for strategy in ("onepass", "twopass"):
                got = dc.sparse_diff(old.clone(), new, chunk, impl=impl, with_new=True, strategy=strategy)
                check(all(same(x, y) for x, y in zip(got, want)), f"diff {wdt} n={n} chunk={chunk} {strategy}")
            t = old.clone()
            dc.apply_xor(t, chunk, want[0], want[1], want[2], impl=impl)
            check(same(t, new), f"apply_xor {wdt} n={n}")
            t = old.clone()
            dc.apply_overwrite(t, chunk, want[0], want[1], want[3], impl=impl)
            check(same(t, new), f"apply_overwrite {wdt} n={n}")
    sync()
    print(f"small checks: {'ok' if not failures else f'{len(failures)} FAILED'} ({time.perf_counter() - t0:.1f} s)")

    # ---- the big tensor
    dtype = getattr(torch, DTYPES[args.dtype])
    w = torch.empty((), dtype=dtype).element_size()
    wdt = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[w]
    n = int(args.size_gib * (1 << 30)) // w
    size = n * w
    info = torch.iinfo(wdt)
    pristine = torch.randint(info.min, info.max, (n,), dtype=wdt, device=dev, generator=g)

    def timed(fn, prep=None, iters: int = args.iters) -> float:
        """Median milliseconds of fn() (prep() runs untimed before each)."""
        times = []
        for i in range(iters + 2):
            if prep is not None:
                prep()
            if dry:
                t = time.perf_counter()
                fn()
                ms = 1e3 * (time.perf_counter() - t)
            else:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ms = a.elapsed_time(b)
            if i >= 2:  # warm-up
                times.append(ms)
        return statistics.median(times)

    dst = torch.empty_like(pristine)
    copy_ms = timed(lambda: dst.copy_(pristine))
    copy_gbps = 2 * size / copy_ms / 1e6
    del dst
    print(f"copy: {size / 2**30:.2f} GiB in {copy_ms:.3f} ms = {copy_gbps:.0f} GB/s (read+write)")

    rows: list[dict] = []

    def row(op: str, frac: float, ms: float, nbytes: int, total: int, **extra: object) -> None:
        gbps = nbytes / ms / 1e6
        rows.append(
            {"op": op, "frac": frac, "ms": ms, "bytes": nbytes, "GBps": gbps, "pct_of_copy": 100 * gbps / copy_gbps,
             "changed": total, **extra}
        )

    for frac in [float(f) for f in args.fracs.split(",")]:
        new = pristine.clone()
        k = int(frac * n)
        if k:
            idx = torch.randint(0, n, (k,), device=dev, generator=g)
            flip = torch.randint(1, 1 << min(8 * w - 1, 62), (k,), device=dev, generator=g).to(wdt)
            new[idx] = new[idx] ^ flip
            del idx, flip
        old = pristine.clone()
        want = dc.sparse_diff(old, new, args.chunk_elems, impl="cpu", with_new=True)
        total = want[1].numel()
        cap = total + total // 16 + 4096  # a caller's capacity hint from the last step
        out_bytes = total * (4 + w)
        for strategy in ("onepass", "twopass"):
            got = dc.sparse_diff(old, new, args.chunk_elems, impl=impl, strategy=strategy, capacity=cap)
            check(all(same(x, y) for x, y in zip(got, want[:3])), f"diff 1GiB frac={frac} {strategy}")
            del got
            ms = timed(lambda: dc.sparse_diff(old, new, args.chunk_elems, impl=impl, strategy=strategy, capacity=cap))
            row(f"diff {strategy}", frac, ms, 2 * size + out_bytes, total)
        ms = timed(
            lambda: dc.sparse_diff(old, new, args.chunk_elems, impl=impl, update_baseline=True, capacity=cap),
            prep=lambda: old.copy_(pristine),
        )
        check(same(old, new), f"diff update_baseline frac={frac}: old != new afterwards")
        row("diff onepass+upd", frac, ms, 2 * size + out_bytes + total * w, total)
        counts, positions, values, new_values = want
        target = pristine.clone()
        dc.apply_xor(target, args.chunk_elems, counts, positions, values, impl=impl)
        check(same(target, new), f"apply_xor frac={frac}")
        ms = timed(
            lambda: dc.apply_xor(target, args.chunk_elems, counts, positions, values, impl=impl, validate=False)
        )
        row("apply xor", frac, ms, total * (4 + 3 * w), total, x_faster_than_dense_copy=copy_ms / ms)
        target.copy_(pristine)
        dc.apply_overwrite(target, args.chunk_elems, counts, positions, new_values, impl=impl)
        check(same(target, new), f"apply_overwrite frac={frac}")
        ms = timed(
            lambda: dc.apply_overwrite(target, args.chunk_elems, counts, positions, new_values, impl=impl, validate=False)
        )
        row("apply overwrite", frac, ms, total * (4 + 2 * w), total, x_faster_than_dense_copy=copy_ms / ms)
        del new, old, want, target, counts, positions, values, new_values
        if not dry:
            torch.cuda.empty_cache()

    sweep: list[dict] = []
    if not args.no_sweep:
        fracs = [float(f) for f in args.fracs.split(",")]
        frac = fracs[len(fracs) // 2]
        new = pristine.clone()
        k = int(frac * n)
        if k:
            idx = torch.randint(0, n, (k,), device=dev, generator=g)
            new[idx] = new[idx] ^ 1
            del idx
        want = dc.sparse_diff(pristine, new, args.chunk_elems, impl="cpu")
        total = want[1].numel()
        cap = total + total // 16 + 4096
        saved = dc.configure()
        for vecs, min_blocks in ((4, 3), (4, 0), (4, 4), (2, 0), (2, 4), (1, 0)):
            dc.configure(vecs=vecs, min_blocks=min_blocks)
            t0 = time.perf_counter()
            try:
                if not dry:
                    dc.load_kernels(dev)
            except dc.KernelsUnavailable as e:
                print(f"sweep vecs={vecs} min_blocks={min_blocks}: {e}", file=sys.stderr)
                continue
            load = time.perf_counter() - t0
            regs = None
            if props is not None:
                try:
                    rep = dc.ptxas_report(f"{props.major}{props.minor}")
                    regs = rep.get(f"dcr_diff_onepass_w{w}", {}).get("registers")
                except Exception as e:  # informative only
                    print(f"ptxas report failed: {e}", file=sys.stderr)
            for strategy in ("onepass", "twopass"):
                got = dc.sparse_diff(pristine, new, args.chunk_elems, impl=impl, strategy=strategy, capacity=cap)
                check(all(same(x, y) for x, y in zip(got, want)), f"sweep vecs={vecs} min_blocks={min_blocks} {strategy}")
                del got
                ms = timed(
                    lambda: dc.sparse_diff(pristine, new, args.chunk_elems, impl=impl, strategy=strategy, capacity=cap)
                )
                gbps = (2 * size + total * (4 + w)) / ms / 1e6
                sweep.append(
                    {"vecs": vecs, "min_blocks": min_blocks, "strategy": strategy, "frac": frac, "ms": ms,
                     "GBps": gbps, "pct_of_copy": 100 * gbps / copy_gbps, "registers": regs, "load_s": load}
                )  # fmt: skip
        dc.configure(**saved)
        del new, want

    print()
    print(f"{args.dtype}, {size / 2**30:.2f} GiB, chunk {args.chunk_elems} elements, copy {copy_gbps:.0f} GB/s")
    print(f"{'op':<18} {'changed':>7} {'ms':>9} {'GB/s':>8} {'% copy':>7} {'vs copy':>8}")
    for r in rows:
        vs = f"{r['x_faster_than_dense_copy']:.1f}x" if "x_faster_than_dense_copy" in r else ""
        print(f"{r['op']:<18} {100 * r['frac']:>6.1f}% {r['ms']:>9.3f} {r['GBps']:>8.0f} {r['pct_of_copy']:>6.0f}% {vs:>8}")
    if sweep:
        print()
        print(f"tuning sweep at {100 * sweep[0]['frac']:.1f}% changed (default: vecs=4 min_blocks=3)")
        print(f"{'vecs':>4} {'min_blocks':>10} {'strategy':>8} {'regs':>5} {'ms':>9} {'GB/s':>8} {'% copy':>7}")
        for r in sweep:
            print(
                f"{r['vecs']:>4} {r['min_blocks']:>10} {r['strategy']:>8} {r['registers'] or '-':>5} {r['ms']:>9.3f} "
                f"{r['GBps']:>8.0f} {r['pct_of_copy']:>6.0f}%"
            )
        print()
    goal = [r for r in rows if r["op"] == "diff onepass"]
    met = bool(goal) and all(r["pct_of_copy"] >= 80 for r in goal)
    print(f"goal (diff onepass >= 80% of copy bandwidth): {'met' if met else 'NOT met'}")
    print(f"checks: {'all passed' if not failures else f'{len(failures)} FAILED: ' + '; '.join(failures)}")
    print(f"wall time {time.perf_counter() - t_start:.1f} s")

    result = {
        "device": name,
        "capability": cap_s,
        "dry_run_cpu": dry,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "kernels_from": origin,
        "kernel_load_s": load_s,
        "dtype": args.dtype,
        "size_bytes": size,
        "chunk_elems": args.chunk_elems,
        "iters": args.iters,
        "copy_ms": copy_ms,
        "copy_GBps": copy_gbps,
        "rows": rows,
        "sweep": sweep,
        "goal_met": met,
        "failures": failures,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
