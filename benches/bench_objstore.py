"""Refit through object storage: dcr (delta objects + manifest) against a
dense upload and download of the full checkpoint, through a local S3 API
server (moto's, on loopback) and a local folder (file://).

    python3 benches/bench_objstore.py                 # ~64 MiB pair, best of 3
    python3 benches/bench_objstore.py --mib 100 --repeats 1 --rate 0.03

Rows, per store:
  dense            upload the new checkpoint, download it on the receiver
                   (S3: boto3 multipart, 8 MiB parts, 8 threads; file: copy)
  dcr diff         build the delta file (no transfer)
  dcr publish      upload frames as objects + manifest (8 uploads in flight)
  dcr receive      list, fetch objects (8 in flight), verify, apply in place
  dcr refit        diff + publish + receive
  dcr stream       diff and upload in one pass (publish_diff) + receive

Prints a table and writes JSON (schema dcr.bench.objstore/1) to
bench-out/objstore.json. Wall-clock numbers on a shared machine are noisy:
the load average is recorded next to them. No test asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def make_pair(dirpath: Path, mib: float, rate: float, seed: int) -> tuple[Path, Path, int, int]:
    """A bf16 checkpoint of about `mib` MiB (a few large matrices and small
    vectors) and a new version with `rate` of the elements moved by 1-3 ulps."""
    from dcr._st import f32_to_bf16_bits, save_raw

    rng = np.random.default_rng(seed)
    elems = int(mib * (1 << 20) / 2)
    d = 1024
    rows = max(1, elems // (8 * d))
    shapes = {f"model.layers.{i}.mlp.{k}.weight": (rows, d) for i in range(2) for k in ("up_proj", "down_proj", "gate_proj", "q_proj")}
    shapes["model.norm.weight"] = (d,)
    old, new = {}, {}
    n_changed = 0
    total = 0
    for name, shape in shapes.items():
        o = f32_to_bf16_bits(rng.normal(0, 0.02, size=shape).astype(np.float32))
        n = o.copy()
        mask = rng.random(size=shape) < rate
        steps = rng.choice(np.array([1, 1, 1, 2, 3, -1, -1, -2], dtype=np.int32), size=int(mask.sum()))
        n[mask] = (o[mask].astype(np.int32) + steps).astype(np.uint16)
        n_changed += int((n != o).sum())
        total += o.size
        old[name] = ("BF16", list(shape), o)
        new[name] = ("BF16", list(shape), n)
    po, pn = dirpath / "old.safetensors", dirpath / "new.safetensors"
    save_raw(po, old)
    save_raw(pn, new)
    return po, pn, n_changed, total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moto:
    """moto's S3 server as a separate process on loopback."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.endpoint = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("moto server did not start within 60 s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run_store(kind: str, old: Path, new: Path, work: Path, repeats: int, s3=None, endpoint: str = "") -> dict:
    from dcr import _core

    import dcr

    size = new.stat().st_size
    best: dict[str, float] = {}
    info: dict = {}

    def keep(name: str, secs: float) -> None:
        best[name] = min(best.get(name, float("inf")), secs)

    for rep in range(repeats):
        tag = f"r{rep}-{uuid.uuid4().hex[:8]}"
        if kind == "s3":
            bucket = f"bench-{tag}"
            s3.create_bucket(Bucket=bucket)
            url = f"s3://{bucket}/refit"
        else:
            url = (work / f"store-{tag}").as_uri()

        # dense: the full checkpoint up, then down
        recv = work / f"dense-{tag}.safetensors"
        if kind == "s3":
            from boto3.s3.transfer import TransferConfig

            cfg = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20, max_concurrency=8)
            up, _ = timed(lambda: s3.upload_file(str(new), bucket, "dense/new.safetensors", Config=cfg))
            down, _ = timed(lambda: s3.download_file(bucket, "dense/new.safetensors", str(recv), Config=cfg))
        else:
            dense_dir = work / f"dense-store-{tag}"
            dense_dir.mkdir()
            up, _ = timed(lambda: shutil.copyfile(new, dense_dir / "new.safetensors"))
            down, _ = timed(lambda: shutil.copyfile(dense_dir / "new.safetensors", recv))
        assert recv.read_bytes() == new.read_bytes()
        recv.unlink()
        keep("dense upload", up)
        keep("dense download", down)
        keep("dense total", up + down)

        # dcr: diff, publish, receive
        delta = work / f"{tag}.dcr"
        t_diff, stats = timed(lambda: dcr.diff_files(old, new, delta))
        t_pub, pub = timed(lambda: _core.objstore_publish(delta, url))
        target = work / f"target-{tag}.safetensors"
        shutil.copyfile(old, target)
        t_recv, rec = timed(lambda: _core.objstore_receive(target, url))
        assert rec["applied"] == [1], rec
        assert _core.compare_files(target, new) == [], "receiver is not bit-exact"
        keep("dcr diff", t_diff)
        keep("dcr publish", t_pub)
        keep("dcr receive", t_recv)
        keep("dcr refit", t_diff + t_pub + t_recv)

        # dcr stream: build and upload in one pass, as version 2 of a fresh prefix
        url2 = url + "-stream"
        if kind == "file":
            url2 = (work / f"store-{tag}-stream").as_uri()
        t_stream, spub = timed(lambda: _core.objstore_publish_diff(old, new, url2))
        shutil.copyfile(old, target)
        t_recv2, rec2 = timed(lambda: _core.objstore_receive(target, url2))
        assert rec2["applied"] == [1] and _core.compare_files(target, new) == []
        keep("dcr stream publish", t_stream)
        keep("dcr stream refit", t_stream + t_recv2)
        target.unlink()
        delta.unlink()
        info = {
            "delta_bytes": stats["payload_bytes"],
            "objects": pub["objects"],
            "object_bytes": pub["object_bytes"],
            "manifest_bytes": pub["manifest_bytes"],
            "fetched_bytes": rec["fetched_bytes"],
            "changed_elements": stats["changed_elements"],
            "bytes_per_changed": stats["bytes_per_changed"],
        }
    return {"seconds": best, "checkpoint_bytes": size, **info,
            "speedup_refit_vs_dense": best["dense total"] / best["dcr refit"],
            "speedup_transfer_vs_dense": best["dense total"] / (best["dcr publish"] + best["dcr receive"]),
            "speedup_stream_vs_dense": best["dense total"] / best["dcr stream refit"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=64.0, help="checkpoint size in MiB (default 64)")
    ap.add_argument("--rate", type=float, default=0.03, help="fraction of elements changed (default 0.03)")
    ap.add_argument("--repeats", type=int, default=3, help="best of N (default 3)")
    ap.add_argument("--stores", default="s3,file", help="comma list of s3,file (default both)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "bench-out" / "objstore.json")
    args = ap.parse_args(argv)

    import dcr

    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="dcr-bench-objstore-") as tmp:
        work = Path(tmp)
        old, new, n_changed, total = make_pair(work, args.mib, args.rate, args.seed)
        print(f"checkpoint: {new.stat().st_size / 2**20:.1f} MiB, {total:,} bf16 elements, "
              f"{n_changed:,} changed ({100 * n_changed / total:.2f} %)")
        stores = [s.strip() for s in args.stores.split(",") if s.strip()]
        if "s3" in stores:
            import boto3

            moto = Moto()
            env = {
                "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": moto.endpoint, "AWS_ALLOW_HTTP": "true",
            }
            os.environ.update(env)
            try:
                s3 = boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1",
                                  aws_access_key_id="testing", aws_secret_access_key="testing")
                results["s3"] = run_store("s3", old, new, work, args.repeats, s3=s3, endpoint=moto.endpoint)
            finally:
                moto.stop()
        if "file" in stores:
            results["file"] = run_store("file", old, new, work, args.repeats)

    rows = ["dense upload", "dense download", "dense total", "dcr diff", "dcr publish", "dcr receive", "dcr refit",
            "dcr stream publish", "dcr stream refit"]
    print()
    print("| step | " + " | ".join(f"{s} (s)" for s in results) + " |")
    print("|---|" + "---|" * len(results))
    for r in rows:
        print(f"| {r} | " + " | ".join(f"{results[s]['seconds'][r]:.3f}" for s in results) + " |")
    for key, label in [("speedup_refit_vs_dense", "dense / dcr refit"),
                       ("speedup_transfer_vs_dense", "dense / (publish + receive)"),
                       ("speedup_stream_vs_dense", "dense / stream refit")]:
        print(f"| {label} | " + " | ".join(f"{results[s][key]:.1f}x" for s in results) + " |")
    for s, r in results.items():
        print(f"{s}: delta {r['delta_bytes'] / 2**20:.2f} MiB in {r['objects']} objects + "
              f"{r['manifest_bytes']:,} B manifest; checkpoint {r['checkpoint_bytes'] / 2**20:.1f} MiB "
              f"({r['checkpoint_bytes'] / r['delta_bytes']:.1f}x); {r['bytes_per_changed']:.3f} B per changed element")

    doc = {
        "schema": "dcr.bench.objstore/1",
        "command": "python3 benches/bench_objstore.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "dcr_version": dcr.__version__,
        "unix_time": time.time(),
        "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "checkpoint": {"mib": args.mib, "rate": args.rate, "elements": total, "changed": n_changed, "seed": args.seed},
        "repeats": args.repeats,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
