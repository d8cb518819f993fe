"""Trainer-side encoding: sharded (each rank diffs its own shards, dcr.trainer.
ShardedPublisher) against gather-then-diff (rank 0 gathers every full tensor
and diffs it with dcr.diff_tensors), on torch.distributed gloo processes.
(The deltas of the two methods are compared byte for byte.)

Per rank: encode wall time of one step and the peak resident memory it
added (VmHWM after resetting it through /proc/self/clear_refs); the deltas
of both methods are checked equal. Prints a table, writes JSON.

    python3 benches/bench_sharded.py [--worlds 1 2 4] [--mib 256] [--rate 0.03] [--mode free|context]
                                     [--out bench-out/sharded.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")
    return _rss("VmRSS")


def _worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import dcr
    from dcr import _core
    from dcr.trainer import ShardedPublisher
    from dcr.trainer import layouts as L

    n_tensors, rows, cols = args["tensors"], args["rows"], args["cols"]
    pl = L.Placements()
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(n_tensors)]
    g = torch.Generator().manual_seed(rank)
    local = {}
    for name in names:
        pl.add(*L.column_parallel(name, name, (rows, cols), rank, world))
        local[name] = (torch.randn((rows // world, cols), generator=g) * 0.02).to(torch.bfloat16)

    def step(seed: int) -> None:
        gs = torch.Generator().manual_seed(seed * 100 + rank)
        for t in local.values():
            b = t.view(torch.int16).reshape(-1)
            m = torch.rand(b.numel(), generator=gs) < args["rate"]
            b[m] += 1

    def gather() -> dict[str, torch.Tensor] | None:
        full = {}
        for name, t in local.items():
            parts = [torch.empty_like(t) for _ in range(world)] if rank == 0 else None
            dist.gather(t, parts, dst=0)
            if rank == 0:
                full[name] = torch.cat(parts)
        return full if rank == 0 else None

    result: dict = {"rank": rank, "world": world}
    # Sharded: a first publish warms up and commits version 1, the next one is measured.
    pub = ShardedPublisher(pl, mode=args["mode"])
    pub.start(local)
    step(1)
    pub.publish(local, _core.DeltaSink.file(Path(out) / "warm.delta") if rank == 0 else None)
    base_full = gather()  # for the gather-then-diff reference below (untimed)
    step(2)
    dist.barrier()
    before = _reset_peak()
    t0 = time.perf_counter()
    rep = pub.publish(local, _core.DeltaSink.file(Path(out) / "sharded.delta") if rank == 0 else None)
    result["sharded_s"] = time.perf_counter() - t0
    result["sharded_peak_added"] = _rss("VmHWM") - before
    result["changed"] = rep.changed
    result["delta_bytes"] = rep.delta_bytes
    result["stages"] = rep.seconds
    del pub

    # Gather-then-diff of the same step: rank 0 holds the gathered baseline,
    # gathers the new full tensors and diffs them.
    dist.barrier()
    before = _reset_peak()
    t0 = time.perf_counter()
    new_full = gather()
    if rank == 0:
        delta, stats = dcr.diff_tensors(base_full, new_full, base_version=1, target_version=2, mode=args["mode"])
        result["gather_changed"] = stats["changed_elements"]
        result["equal"] = delta == (Path(out) / "sharded.delta").read_bytes()
    result["gather_s"] = time.perf_counter() - t0
    result["gather_peak_added"] = _rss("VmHWM") - before
    result["full_bytes"] = n_tensors * rows * cols * 2
    result["shard_bytes"] = n_tensors * rows * cols * 2 // world
    Path(out, f"r{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torch's C++ threads sometimes abort at interpreter teardown


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--mib", type=int, default=256, help="canonical checkpoint size (bf16)")
    ap.add_argument("--rate", type=float, default=0.03)
    ap.add_argument("--mode", choices=["free", "context"], default="free", help="codec mode of both methods")
    ap.add_argument("--out", default="bench-out/sharded.json")
    a = ap.parse_args()
    cols = 4096
    rows = 4096
    n_tensors = max(1, a.mib * (1 << 20) // (rows * cols * 2))
    rows = a.mib * (1 << 20) // (n_tensors * cols * 2) // 4 * 4
    args = {"tensors": n_tensors, "rows": rows, "cols": cols, "rate": a.rate, "mode": a.mode}
    runs = []
    print(f"checkpoint {n_tensors} x [{rows}, {cols}] bf16 = {n_tensors * rows * cols * 2 / 2**20:.0f} MiB, "
          f"change rate {a.rate:.0%}, mode {a.mode}, gloo on {os.cpu_count()} cores")
    print(f"{'ranks':>5} {'shard MiB':>9} | {'sharded s':>9} {'peak+ MiB':>9} {'B/changed':>9} | {'gather+diff s':>13} "
          f"{'rank0 peak+ MiB':>15} | equal")
    for world in a.worlds:
        with tempfile.TemporaryDirectory() as d:
            mp.start_processes(_worker, args=(world, _port(), args, d), nprocs=world, join=True, start_method="spawn")
            rs = [json.loads(Path(d, f"r{r}.json").read_text()) for r in range(world)]
            same = bool(rs[0].get("equal"))
        r0 = rs[0]
        row = {
            "world": world,
            "shard_mib": r0["shard_bytes"] / 2**20,
            "sharded_s_max": max(r["sharded_s"] for r in rs),
            "sharded_peak_added_mib_max": max(r["sharded_peak_added"] for r in rs) / 2**20,
            "gather_diff_s": r0["gather_s"],
            "gather_peak_added_mib_rank0": r0["gather_peak_added"] / 2**20,
            "changed": r0["changed"],
            "delta_bytes": r0["delta_bytes"],
            "stages_rank0": r0["stages"],
            "per_rank": rs,
        }
        runs.append(row)
        print(f"{world:>5} {row['shard_mib']:>9.0f} | {row['sharded_s_max']:>9.2f} {row['sharded_peak_added_mib_max']:>9.1f} "
              f"{row['delta_bytes'] / max(row['changed'], 1):>9.3f} | "
              f"{row['gather_diff_s']:>13.2f} {row['gather_peak_added_mib_rank0']:>15.1f} | {same}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": args, "runs": runs}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
