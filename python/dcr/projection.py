"""`dcr project`: project refit time to 30B-1T models from rates measured here.

The model (every assumption is printed with the table):

- payload = parameters x change rate x bytes per changed element (measured by
  `benches/bench_codec.py` on real training deltas, context or free mode);
- the delta streams while it is built (cut-through relays, chunked frames),
  so a refit takes the slowest of its pipelined stages, plus one chunk's
  transfer per relay hop:
    encode   = checkpoint bytes / (encode rate per core x trainer cores),
    transfer = payload / link bandwidth x relay efficiency (measured dense
               refit time / ideal, `benches/bench_refit.py`),
    apply    = checkpoint bytes per receiver / (apply rate per core x cores),
  every receiver having its own link below its relay (tree fan-out keeps
  each link's load one stream);
- the full-checkpoint reference sends parameters x 2 bytes (bf16) over the
  same link with the same efficiency.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PAPER = {"params": 1e12, "rate": 0.03, "gbit_s": 2e12 * 8 / (87.5 * 60) / 1e9, "full_s": 87.5 * 60, "delta_s": 150.0}


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def calibrate(codec_json: Path, refit_json: Path) -> dict[str, Any]:
    """Measured inputs, each with where it came from; defaults are marked as such."""
    cal: dict[str, Any] = {}
    codec = _load(codec_json)
    if codec:
        real = [i for i in codec["inputs"] if i["kind"] == "real" and i["id"].startswith("fp32m")]
        def pick(method: str, key: str) -> list[float]:
            return [m[key] for i in real for m in i["methods"] if m["method"] == method and m.get(key)]
        for mode, method in (("context", "h_dcr_context_t1"), ("free", "g_dcr_free_t1")):
            bpc = pick(method, "bytes_per_changed")
            enc = pick(method, "encode_mb_s")
            app = pick(method, "decode_mb_s")
            if bpc:
                cal[mode] = {
                    "bytes_per_changed": max(bpc),
                    "encode_bytes_per_s_per_core": 1e6 * min(enc),
                    "apply_bytes_per_s_per_core": 1e6 * min(app),
                    "source": f"{codec_json} method {method}: worst of the fp32-master pairs",
                }
    refit = _load(refit_json)
    if refit:
        dense = [r["ratio_to_ideal"] for r in refit["rows"] if r["what"] == "dense"]
        if dense:
            cal["relay_efficiency"] = {"value": max(dense), "source": f"{refit_json}: worst dense refit time / ideal"}
    cal.setdefault("relay_efficiency", {"value": 1.1, "source": "default (no refit benchmark JSON found)"})
    for mode in ("context", "free"):
        cal.setdefault(mode, {"bytes_per_changed": 1.3 if mode == "free" else 0.85,
                              "encode_bytes_per_s_per_core": 5e8, "apply_bytes_per_s_per_core": 5e8,
                              "source": "default (no codec benchmark JSON found)"})
    return cal


def project(params: float, rate: float, gbit_s: float, mode: dict[str, Any], efficiency: float, *,
            trainer_cores: int, receiver_cores: int, receivers_share: float, hops: int,
            chunk_bytes: float) -> dict[str, float]:
    link = gbit_s * 1e9 / 8
    ckpt = params * 2
    payload = params * rate * mode["bytes_per_changed"]
    encode = ckpt / (mode["encode_bytes_per_s_per_core"] * trainer_cores)
    transfer = payload / link * efficiency
    apply = ckpt * receivers_share / (mode["apply_bytes_per_s_per_core"] * receiver_cores)
    latency = hops * chunk_bytes / link
    delta = max(encode, transfer, apply) + latency
    full = ckpt / link * efficiency
    return {"payload_bytes": payload, "encode_s": encode, "transfer_s": transfer, "apply_s": apply,
            "hop_latency_s": latency, "refit_s": delta, "full_s": full, "speedup": full / delta}


def run(args: argparse.Namespace) -> int:
    cal = calibrate(Path(args.codec_json), Path(args.refit_json))
    eff = cal["relay_efficiency"]["value"]
    rows = []
    print("Inputs (measured here unless marked default):")
    for mode in ("context", "free"):
        m = cal[mode]
        print(f"  {mode:>7}: {m['bytes_per_changed']:.3f} B per changed element, encode "
              f"{m['encode_bytes_per_s_per_core'] / 1e9:.2f} GB/s/core, apply {m['apply_bytes_per_s_per_core'] / 1e9:.2f} "
              f"GB/s/core  [{m['source']}]")
    print(f"  relay efficiency {eff:.2f}x of payload/bandwidth  [{cal['relay_efficiency']['source']}]")
    print(f"Assumptions: bf16 checkpoint (2 B/param); link {args.gbit_s:g} Gbit/s per tree link; "
          f"{args.trainer_cores} trainer CPU cores encode in parallel (one per rank); each receiver applies "
          f"{100 * args.receiver_share:g} % of the model on {args.receiver_cores} cores; {args.hops} relay hops, "
          f"{args.chunk_mib:g} MiB chunks; GPU kernels not measured here (no GPU), CPU rates used.\n")
    print(f"{'model':>6} {'rate':>5} {'mode':>8} {'payload GB':>10} {'encode s':>9} {'transfer s':>10} {'apply s':>8} "
          f"{'refit s':>8} {'full min':>8} {'speedup':>8}")
    for params in args.params:
        for rate in args.rates:
            for mode in ("context", "free"):
                r = project(params, rate, args.gbit_s, cal[mode], eff, trainer_cores=args.trainer_cores,
                            receiver_cores=args.receiver_cores, receivers_share=args.receiver_share, hops=args.hops,
                            chunk_bytes=args.chunk_mib * (1 << 20))
                r.update({"params": params, "rate": rate, "mode": mode, "gbit_s": args.gbit_s})
                rows.append(r)
                print(f"{params / 1e9:>5.0f}B {100 * rate:>4.0f}% {mode:>8} {r['payload_bytes'] / 1e9:>10.1f} "
                      f"{r['encode_s']:>9.1f} {r['transfer_s']:>10.1f} {r['apply_s']:>8.1f} {r['refit_s']:>8.1f} "
                      f"{r['full_s'] / 60:>8.1f} {r['speedup']:>7.1f}x")
    one = next((r for r in rows if r["params"] == 1e12 and r["rate"] == 0.03 and r["mode"] == "context"), None)
    print(f"\nPaper's reference point (NeMo-DCR): 1T at 3 %, about {PAPER['gbit_s']:.2f} Gbit/s between regions: "
          f"{PAPER['full_s'] / 60:.1f} min for the full checkpoint, {PAPER['delta_s']:.0f} s for its delta refit.")
    if one:
        print(f"This projection at the same point and {args.gbit_s:g} Gbit/s: full {one['full_s'] / 60:.1f} min, "
              f"dcr context-mode delta {one['refit_s']:.0f} s ({one['payload_bytes'] / 1e9:.1f} GB).")
    doc = {"schema": "dcr.projection/1", "command": " ".join(sys.argv), "calibration": cal,
           "assumptions": {k: v for k, v in vars(args).items() if k != "func"}, "paper": PAPER, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.out}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=float, nargs="+", default=[30e9, 70e9, 235e9, 671e9, 1e12])
    p.add_argument("--rates", type=float, nargs="+", default=[0.01, 0.03, 0.05])
    p.add_argument("--gbit-s", type=float, default=round(PAPER["gbit_s"], 2), help="bandwidth of each link")
    p.add_argument("--trainer-cores", type=int, default=256, help="CPU cores encoding in parallel on the trainer")
    p.add_argument("--receiver-cores", type=int, default=16, help="CPU cores applying on each receiver")
    p.add_argument("--receiver-share", type=float, default=1.0 / 8, help="fraction of the model one receiver host applies")
    p.add_argument("--hops", type=int, default=2)
    p.add_argument("--chunk-mib", type=float, default=4.0)
    p.add_argument("--codec-json", default="bench-out/codec.json")
    p.add_argument("--refit-json", default="bench-out/refit.json")
    p.add_argument("--out", default="bench-out/projection.json")
