"""Recovery benchmark: how long a crash-safe `dcr apply` takes to finish a
refit after it was SIGKILLed mid-way, against a plain refit.

A ~100 MB bf16 checkpoint (50 tensors of 1024x1024) and a copy with about 1 %
of its elements changed (low mantissa bits, like an RL step) are written to
a scratch folder, the delta between them is built with `dcr diff`, then:

* ``plain``: `dcr apply` on a fresh copy of the base (journaled, the
  default, with ``--batch-chunks`` chunks per batch, and with every chunk in
  one batch), and the non-journaled in-process ``dcr.apply_file``;
* ``resume@F``: `dcr apply` on a fresh copy, SIGKILLed as soon as the
  journal shows at least a fraction F of the chunks started (the last batch
  usually still in progress), then rerun to
  completion; the rerun's time is the recovery time;
* ``no-op``: `dcr apply` again on a finished target.

Every finished target is compared bit for bit with the new version. Times are
the CLI's in-process ``seconds`` (interpreter start-up excluded; it is in the
``wall`` column); ``peak MiB`` is the `dcr apply` process's peak resident
memory (its VmHWM, read every 2 ms while it runs: the interpreter, the
mapped target pages it touched, the delta and what the refit holds). Prints a table and writes JSON
(schema ``dcr.bench.recovery/1``) to ``bench-out/recovery.json``.

    python benches/bench_recovery.py [--repeats 3] [--chunk-mib 1] [--batch-chunks 8]
    python benches/bench_recovery.py --tensors 512 --rate 0.4 --fractions none   # 1 GiB, 40 % changed
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import dcr
from dcr import _st

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "dcr.cli"]


def make_model(root: Path, n_tensors: int, rate: float, seed: int) -> tuple[Path, Path]:
    rng = np.random.default_rng(seed)
    old: dict[str, tuple[str, list[int], np.ndarray]] = {}
    new: dict[str, tuple[str, list[int], np.ndarray]] = {}
    for i in range(n_tensors):
        bits = _st.f32_to_bf16_bits(rng.standard_normal(1 << 20, dtype=np.float32) * np.float32(0.02))
        changed = bits.copy()
        idx = rng.choice(bits.size, size=int(bits.size * rate), replace=False)
        changed[idx] ^= rng.integers(1, 8, size=idx.size, dtype=np.uint16)  # a few ulps
        old[f"layers.{i:02d}.weight"] = ("BF16", [1024, 1024], bits)
        new[f"layers.{i:02d}.weight"] = ("BF16", [1024, 1024], changed)
    a, b = root / "base.safetensors", root / "new.safetensors"
    _st.save_raw(a, old)
    _st.save_raw(b, new)
    return a, b


def fresh_target(base: Path, root: Path) -> Path:
    t = root / "replica.safetensors"
    for p in root.glob("replica.safetensors*"):
        p.unlink()
    shutil.copy(base, t)
    return t


def peak_rss_mib(pid: int) -> float | None:
    """The process's peak resident memory so far (VmHWM: that of its own
    program image, where ``ru_maxrss`` of a child also counts the parent it
    was forked from), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def cli_apply(delta: Path, target: Path, batch_chunks: int) -> tuple[dict[str, Any], float]:
    """`dcr apply --json`: its result, with ``peak_rss_mib`` added (its peak
    resident memory, read while it runs), and the wall time."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [*CLI, "apply", str(delta), str(target), "--batch-chunks", str(batch_chunks), "--json"],
            stdout=out,
            stderr=err,
            text=True,
        )
        peak = 0.0
        while proc.poll() is None:
            # A zombie (exited, not yet reaped) has no VmHWM line: the last
            # read before it is the peak, up to the last 2 ms.
            peak = max(peak, peak_rss_mib(proc.pid) or 0.0)
            time.sleep(0.002)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"dcr apply exited {proc.returncode}: {err.read().strip()}")
        res = json.loads(out.read())
    return {**res, "peak_rss_mib": peak}, wall


def kill_at(delta: Path, target: Path, batch_chunks: int, fraction: float) -> dict[str, Any]:
    """Start `dcr apply`, SIGKILL it once the journal shows `fraction` of the chunks started."""
    proc = subprocess.Popen(
        [*CLI, "apply", str(delta), str(target), "--batch-chunks", str(batch_chunks), "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    st: dict[str, Any] = {}
    while proc.poll() is None:
        try:
            st = dcr.receiver_status(target)
        except (dcr.DcrError, OSError):
            st = {}
        r = st.get("refit")
        if r and r["applied"] + r["in_progress"] >= max(1.0, fraction * r["chunks"]):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.001)
    proc.wait()
    if proc.returncode == 0:
        return {"killed": False}
    r = dcr.receiver_status(target)["refit"] or {}
    return {"killed": True, **{k: r.get(k) for k in ("chunks", "applied", "in_progress", "not_started")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=50, help="1024x1024 bf16 tensors (2 MiB each; default 50)")
    ap.add_argument("--rate", type=float, default=0.01, help="fraction of elements changed (default 0.01)")
    ap.add_argument("--chunk-mib", type=float, default=1.0)
    ap.add_argument("--batch-chunks", type=int, default=8)
    ap.add_argument("--fractions", default="0.25,0.5,0.75", help="kill points, comma-separated, or 'none'")
    ap.add_argument("--out", type=Path, default=REPO / "bench-out" / "recovery.json")
    ap.add_argument("--scratch", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args()
    fractions = [] if args.fractions == "none" else [float(f) for f in args.fractions.split(",")]

    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        root = Path(tmp)
        base, new = make_model(root, args.tensors, args.rate, seed=20261130)
        delta = root / "delta.dcr"
        subprocess.run(
            [*CLI, "diff", str(base), str(new), "-o", str(delta), "--chunk-mib", str(args.chunk_mib), "-q"],
            check=True,
        )
        info = dcr.inspect_file(delta)
        one_batch = "plain (journaled, 1 batch)"
        rows: dict[str, list[dict[str, Any]]] = {
            "plain (journaled)": [],
            one_batch: [],
            "plain (no journal)": [],
            "no-op rerun": [],
        }
        rows.update({f"resume after kill @{int(f * 100)}%": [] for f in fractions})

        def check(target: Path) -> None:
            differing = dcr.compare_files(target, new)
            if differing:
                raise SystemExit(f"BUG: target differs from the new version in {differing}")

        for _ in range(args.repeats):
            t = fresh_target(base, root)
            res, wall = cli_apply(delta, t, args.batch_chunks)
            check(t)
            rows["plain (journaled)"].append({"seconds": res["seconds"], "wall": wall, "chunks": res["chunks"], "peak_rss_mib": res["peak_rss_mib"]})
            res, wall = cli_apply(delta, t, args.batch_chunks)
            assert res["outcome"] == "already_at_target"
            rows["no-op rerun"].append({"seconds": res["seconds"], "wall": wall, "peak_rss_mib": res["peak_rss_mib"]})

            t = fresh_target(base, root)
            res, wall = cli_apply(delta, t, 1 << 20)
            check(t)
            rows[one_batch].append({"seconds": res["seconds"], "wall": wall, "chunks": res["chunks"], "peak_rss_mib": res["peak_rss_mib"]})

            t = fresh_target(base, root)
            t0 = time.perf_counter()
            dcr.apply_file(delta, t)
            el = time.perf_counter() - t0
            check(t)
            rows["plain (no journal)"].append({"seconds": el, "wall": el})

            for f in fractions:
                t = fresh_target(base, root)
                k = kill_at(delta, t, args.batch_chunks, f)
                res, wall = cli_apply(delta, t, args.batch_chunks)
                check(t)
                rows[f"resume after kill @{int(f * 100)}%"].append(
                    {
                        "seconds": res["seconds"],
                        "wall": wall,
                        "peak_rss_mib": res["peak_rss_mib"],
                        "at_kill": k,
                        "skipped": res["skipped"],
                        "repaired": res["repaired"],
                        "applied": res["applied"],
                    }
                )

    plain = statistics.median(r["seconds"] for r in rows["plain (journaled)"])
    print(
        f"checkpoint {info['checkpoint_bytes'] / 1e6:.1f} MB, {info['changed_elements']:,} changed elements "
        f"({100 * info['change_rate']:.2f} %), delta {info['payload_bytes'] / 1e6:.2f} MB in {info['chunks']} chunks "
        f"of {args.chunk_mib} MiB, {args.batch_chunks} chunks per journaled batch; median of {args.repeats}\n"
    )
    hdr = f"{'run':<28} {'seconds':>8} {'x plain':>8} {'wall s':>7} {'peak MiB':>9}  {'at kill: applied/in progress/not started':<42} {'then: skipped/repaired/applied'}"
    print(hdr)
    print("-" * len(hdr))
    summary: dict[str, Any] = {}
    for name, rs in rows.items():
        if not rs:
            continue
        sec = statistics.median(r["seconds"] for r in rs)
        wall = statistics.median(r["wall"] for r in rs)
        # In-process rows (no journal) have no process of their own.
        peaks = [r["peak_rss_mib"] for r in rs if "peak_rss_mib" in r]
        peak = max(peaks) if peaks else None
        kill = then = ""
        if "at_kill" in rs[0]:
            ks = [r["at_kill"] for r in rs if r["at_kill"]["killed"]]
            kill = ", ".join(f"{k['applied']}/{k['in_progress']}/{k['not_started']}" for k in ks) or "finished first"
            then = ", ".join(f"{r['skipped']}/{r['repaired']}/{r['applied']}" for r in rs)
        peak_cell = f"{peak:>9.1f}" if peak is not None else f"{'-':>9}"
        print(f"{name:<28} {sec:>8.3f} {sec / plain:>8.2f} {wall:>7.2f} {peak_cell}  {kill:<42} {then}")
        summary[name] = {"median_seconds": sec, "median_wall": wall, "ratio_to_plain": sec / plain, "max_peak_rss_mib": peak, "runs": rs}

    doc = {
        "schema": "dcr.bench.recovery/1",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_avg": os.getloadavg(),
        },
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "delta": {k: info[k] for k in ("checkpoint_bytes", "changed_elements", "change_rate", "payload_bytes", "chunks")},
        "results": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
