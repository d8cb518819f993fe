"""`dcr bench refit`: delta refits against dense full-checkpoint refits over
bandwidth-limited loopback links, through real `dcr-relay` and `dcr receive`
processes.

Every relay limits each of its child links to `--link-mib-s` (a token bucket
in the relay), so a link behaves like a WAN link of that bandwidth. For each
topology (a star: one relay feeding every receiver; a tree: a root feeding
`fanout` relays that feed the receivers) and receiver count, the receivers
stay up while a chain of versions is published: deltas at 1 %, 3 % and 5 %
change, then a dense refit of the full checkpoint. Refit time = from the
start of the publish until every receiver has verified and acknowledged.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import dcr
from dcr._procs import Proc
from dcr._st import f32_to_bf16_bits, save_raw

CLI = [sys.executable, "-m", "dcr.cli"]
RATES = (0.01, 0.03, 0.05)


def make_versions(work: Path, mib: float, seed: int) -> tuple[list[Path], int]:
    """v0 and v1..v3 (each RATES[i] of the elements moved by a few ulps from
    the previous version), bf16 tensors of 1 Mi elements."""
    rng = np.random.default_rng(seed)
    n_tensors = max(1, int(mib * (1 << 20) / 2 / (1 << 20)))
    cur = {f"layers.{i}.weight": f32_to_bf16_bits(rng.normal(0, 0.02, 1 << 20).astype(np.float32)) for i in range(n_tensors)}
    paths = []
    for v, rate in enumerate((0.0, *RATES)):
        if rate:
            nxt = {}
            for k, w in cur.items():
                w = w.copy()
                idx = rng.random(w.size) < rate
                step = rng.choice(np.array([1, 1, 1, -1, -1, 2, -2], dtype=np.int32), size=int(idx.sum()))
                w[idx] = (w[idx].astype(np.int32) + step).astype(np.uint16)
                nxt[k] = w
            cur = nxt
        p = work / f"v{v}.safetensors"
        save_raw(p, {k: ("BF16", [w.size], w) for k, w in cur.items()})
        paths.append(p)
    return paths, n_tensors * (1 << 21)


def run_topology(work: Path, versions: list[Path], deltas: list[Path], dense: Path | None, topology: str,
                 receivers: int, fanout: int, link: int, key: Path, journaled: bool = True) -> list[dict[str, Any]]:
    relays: list[Proc] = []
    subs: list[Proc] = []
    rows = []
    try:
        root = Proc([*CLI, "relay", "--listen", "127.0.0.1:0", "--key-file", str(key), "--rate-limit", str(link)],
                    work / f"{topology}{receivers}-root.log")
        relays.append(root)
        root_addr = root.listening()
        leaves = [(root, root_addr)]
        if topology == "tree":
            leaves = []
            for i in range(min(fanout, receivers)):
                r = Proc([*CLI, "relay", "--listen", "127.0.0.1:0", "--parent", root_addr, "--key-file", str(key),
                          "--rate-limit", str(link)], work / f"{topology}{receivers}-mid{i}.log")
                relays.append(r)
                leaves.append((r, r.listening()))
        n_versions = len(deltas) + (1 if dense else 0)
        per_leaf: dict[int, int] = {}
        for i in range(receivers):
            target = work / f"{topology}{receivers}-r{i}.safetensors"
            shutil.copyfile(versions[0], target)
            leaf = i % len(leaves)
            per_leaf[leaf] = per_leaf.get(leaf, 0) + 1
            subs.append(Proc([*CLI, "receive", str(target), "--from", f"{leaves[leaf][1]},{root_addr}",
                              "--key-file", str(key), "--receiver-id", f"r{i}", "--follow", str(n_versions),
                              "--json", "--timeout", "600", *([] if journaled else ["--no-journal"])],
                             work / f"{topology}{receivers}-r{i}.log"))
        for leaf, count in per_leaf.items():
            leaves[leaf][0].wait_log("role=Subscriber", count)
        plan = [(f"delta {int(100 * r)}%", d, versions[i + 1]) for i, (r, d) in enumerate(zip(RATES, deltas))]
        if dense:
            plan.append(("dense", dense, versions[-1]))
        for label, delta, expect in plan:
            size = delta.stat().st_size
            t0 = time.perf_counter()
            report = dcr._core.publish_delta(delta, root_addr, key_file=str(key), expect_acks=receivers,
                                             ack_timeout_s=900.0)
            elapsed = time.perf_counter() - t0
            if not report["all_committed"]:
                raise RuntimeError(f"{label}: not every receiver committed: {report}")
            hops = 2 if topology == "tree" else 1
            rows.append({
                "topology": topology, "receivers": receivers, "what": label, "payload_bytes": size,
                "link_bytes_per_s": link, "hops": hops, "refit_s": elapsed,
                "ideal_s": size / link, "ratio_to_ideal": elapsed / (size / link),
            })
        for p in subs:
            assert p.p.stdout is not None
            p.p.wait(timeout=120)
        for i in range(receivers):
            target = work / f"{topology}{receivers}-r{i}.safetensors"
            if target.read_bytes() != versions[-1].read_bytes():
                raise RuntimeError(f"receiver {i} is not bit-exact at the last version")
    finally:
        for p in subs + relays:
            p.stop()
    return rows


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    link = int(args.link_mib_s * (1 << 20))
    all_rows: list[dict[str, Any]] = []
    # Receivers' targets in memory (/dev/shm) when available: rollout servers
    # apply into (GPU) memory, and 16 receivers syncing files to this host's
    # one disk would measure the disk, not the transport.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and not args.on_disk else None
    with tempfile.TemporaryDirectory(prefix="dcr-bench-refit-", dir=shm) as tmp:
        work = Path(tmp)
        key = work / "key"
        key.write_bytes(os.urandom(32))
        for mib in args.sizes:
            versions, ck_bytes = make_versions(work, mib, seed=int(mib))
            deltas = []
            for i in range(len(RATES)):
                d = work / f"d{i}.dcr"
                dcr.diff_files(versions[i], versions[i + 1], d, mode=args.mode, base_version=i, target_version=i + 1)
                deltas.append(d)
            dense = work / "dense.dcr"
            dcr.diff_files(versions[-1], versions[-1], dense, dense=True, base_version=len(RATES), target_version=len(RATES) + 1)
            # The dense refit publishes v3's bytes again as v4 (a dense delta applies to any base).
            for topology in args.topologies:
                for n in args.receivers:
                    with_dense = not args.no_dense and (args.dense_all or n == args.receivers[0])
                    print(f"[{mib:g} MiB, {topology}, {n} receivers] ...", flush=True)
                    rows = run_topology(work, versions, deltas, dense if with_dense else None, topology, n,
                                        args.fanout, link, key, journaled=not args.no_journal)
                    for r in rows:
                        r["checkpoint_bytes"] = ck_bytes
                        r["model_mib"] = mib
                    all_rows += rows
    dense_by = {(r["model_mib"], r["topology"], r["receivers"]): r["refit_s"] for r in all_rows if r["what"] == "dense"}
    print(f"\nlinks limited to {args.link_mib_s:g} MiB/s per child link; refit = publish start -> every receiver acked")
    print(f"{'MiB':>5} {'topology':>8} {'recv':>4} {'what':>9} {'payload':>11} {'refit s':>8} {'ideal s':>8} "
          f"{'x ideal':>7} {'vs dense':>8}")
    for r in all_rows:
        dref = dense_by.get((r["model_mib"], r["topology"], r["receivers"])) or next(
            (v for (m, t, _), v in dense_by.items() if m == r["model_mib"] and t == r["topology"]), None)
        r["speedup_vs_dense"] = dref / r["refit_s"] if dref and r["what"] != "dense" else None
        sp = f"{r['speedup_vs_dense']:.1f}x" if r["speedup_vs_dense"] else "-"
        print(f"{r['model_mib']:>5g} {r['topology']:>8} {r['receivers']:>4} {r['what']:>9} {r['payload_bytes']:>11,} "
              f"{r['refit_s']:>8.2f} {r['ideal_s']:>8.2f} {r['ratio_to_ideal']:>7.2f} {sp:>8}")
    doc = {
        "schema": "dcr.bench.refit/1",
        "command": " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "config": {"link_bytes_per_s": link, "sizes_mib": args.sizes, "receivers": args.receivers,
                   "topologies": args.topologies, "fanout": args.fanout, "mode": args.mode},
        "rows": all_rows,
    }
    out.write_text(json.dumps(doc, indent=2))
    if args.plot:
        _plot(all_rows, out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for (topo, what), style in [(("star", "delta 3%"), "o-"), (("tree", "delta 3%"), "s-"),
                                (("star", "dense"), "o--"), (("tree", "dense"), "s--")]:
        pts = sorted((r["receivers"], r["refit_s"]) for r in rows if r["topology"] == topo and r["what"] == what)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{what}, {topo}")
    ax.set(xscale="log", yscale="log", xlabel="receivers", ylabel="refit time (s)",
           title="Refit over rate-limited loopback links")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=float, nargs="+", default=[4.0, 16.0], help="checkpoint sizes in MiB (growing)")
    p.add_argument("--receivers", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--topologies", nargs="+", default=["star", "tree"], choices=["star", "tree"])
    p.add_argument("--fanout", type=int, default=4, help="relays under the root in a tree")
    p.add_argument("--link-mib-s", type=float, default=2.0, help="bandwidth of every child link (MiB/s)")
    p.add_argument("--mode", choices=["free", "context"], default="context")
    p.add_argument("--dense-all", action="store_true", help="run the dense reference for every receiver count")
    p.add_argument("--no-dense", action="store_true", help="skip the dense reference (deltas only)")
    p.add_argument("--plot", action="store_true", help="write a PNG next to the JSON")
    p.add_argument("--no-journal", action="store_true",
                   help="receivers apply frames as they arrive (`dcr receive --no-journal`) instead of spooling "
                        "each version and applying it through the journal")
    p.add_argument("--on-disk", action="store_true", help="keep receiver files on disk instead of /dev/shm")
    p.add_argument("--out", default="bench-out/refit.json")
