"""The `dcr` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import dcr


def _bar(total: int, desc: str, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=quiet or None, leave=False)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def cmd_diff(args: argparse.Namespace) -> int:
    total = os.path.getsize(args.new)
    bar = _bar(total, "diff", args.quiet or args.json)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    t0 = time.perf_counter()
    stats = dcr.diff_files(
        args.old,
        args.new,
        args.output,
        chunk_bytes=int(args.chunk_mib * (1 << 20)),
        kind=args.kind,
        zstd_level=args.level,
        mode=args.mode,
        base_version=args.base_version,
        target_version=args.target_version,
        threads=args.threads,
        progress=progress,
    )
    bar.close()
    elapsed = time.perf_counter() - t0
    stats["seconds"] = elapsed
    if args.json:
        print(json.dumps(stats, indent=2))
    elif not args.quiet:
        print(
            f"{args.output}: {stats['changed_elements']:,} of {stats['total_elements']:,} elements changed "
            f"({100 * stats['change_rate']:.3f} %), {_human(stats['payload_bytes'])} "
            f"({stats['bytes_per_changed']:.3f} B per changed element, "
            f"{stats['checkpoint_bytes'] / max(stats['payload_bytes'], 1):.1f}x smaller than the checkpoint) "
            f"in {elapsed:.2f} s"
        )
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    result = dcr.refit_file(
        args.delta, args.target, journal=args.journal, batch_chunks=args.batch_chunks, threads=args.threads
    )
    elapsed = time.perf_counter() - t0
    result["seconds"] = elapsed
    if args.json:
        print(json.dumps(result, indent=2))
    elif not args.quiet:
        if result["outcome"] == "already_at_target":
            print(
                f"{args.target} is already at the delta's target version {result['version']} "
                f"(digest {result['digest'][:16]}); nothing to do"
            )
        else:
            resumed = ""
            if result["resumed"]:
                resumed = (
                    f" (resumed: {result['skipped']} chunks already applied, "
                    f"{result['repaired']} in-progress chunks repaired)"
                )
            print(
                f"{args.target}: refit to version {result['version']} committed: applied {result['applied']} of "
                f"{result['chunks']} chunks{resumed}, {result['changed_elements']:,} elements, in {elapsed:.2f} s; "
                f"digests verified"
            )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    st = dcr.receiver_status(args.target, journal=args.journal)
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"target  {st['target']}")
    print(f"journal {st['journal']}")
    if not st["journal_exists"]:
        print("no journal: this target was never refitted by `dcr apply`")
        return 0
    c = st["committed"]
    print(f"committed version {c['version']}  digest {c['digest']}" if c else "committed: none")
    r = st["refit"]
    if r:
        print(
            f"refit in flight to version {r['version']} (delta {r['delta_id'][:16]}): {r['applied']} of "
            f"{r['chunks']} chunks applied, {r['in_progress']} in progress, {r['not_started']} not started; "
            f"rerun `dcr apply` with that delta to finish it"
        )
    else:
        print("no refit in flight")
    a = st["last_abort"]
    if a:
        print(f"last refit aborted: version {a['version']}, {a['touched_chunks']} chunk(s) touched: {a['reason']}")
    if not st["target_is_committed"] and not r:
        print("the target holds neither version: reload it densely (then `dcr apply` adopts it by its digest)")
    if st["torn_tail"]:
        t = st["torn_tail"]
        print(f"torn journal tail of {t['bytes']} B at byte {t['offset']} ({t['reason']}); the next apply cuts it off")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    differing = dcr.compare_files(args.a, args.b)
    if args.json:
        print(json.dumps({"identical": not differing, "differing_tensors": differing}, indent=2))
    elif differing:
        shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
        print(f"{args.a} and {args.b} differ in {len(differing)} tensor(s): {shown}")
    elif not args.quiet:
        print(f"{args.a} and {args.b} are bit-identical")
    return 1 if differing else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    info = dcr.inspect_file(args.delta)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"delta {args.delta}  (format v{info['format_version']}, id {info['delta_id'][:16]})")
    print(f"  base   v{info['base_version']}  {info['base_digest']}")
    print(f"  target v{info['target_version']}  {info['target_digest']}")
    print(
        f"  {info['changed_elements']:,} of {info['total_elements']:,} elements changed "
        f"({100 * info['change_rate']:.3f} %) in {info['chunks']} chunks; "
        f"{_human(info['payload_bytes'])} = {info['bytes_per_changed']:.3f} B per changed element; "
        f"checkpoint {_human(info['checkpoint_bytes'])}"
    )
    enc = ", ".join(f"{k} {v}" for k, v in info["encodings"].items() if v)
    print(f"  kind {info['kind']}, mode {info['mode']}, chunk size {_human(info['chunk_bytes'])}; encodings: {enc or 'none'}")
    rows = [t for t in info["tensors"] if t["changed_elements"] or args.all]
    width = max([len(t["name"]) for t in rows] + [6])
    print(f"\n  {'tensor':<{width}}  {'elements':>12}  {'changed':>10}  {'rate %':>7}  {'bytes':>10}  {'B/chg':>6}")
    for t in rows:
        rate = 100 * t["changed_elements"] / max(t["elements"], 1)
        bpc = t["payload_bytes"] / t["changed_elements"] if t["changed_elements"] else 0.0
        print(
            f"  {t['name']:<{width}}  {t['elements']:>12,}  {t['changed_elements']:>10,}  {rate:>7.3f}  "
            f"{t['payload_bytes']:>10,}  {bpc:>6.2f}"
        )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from dcr import demo

    return demo.run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dcr", description="Bit-exact delta-compressed refit.")
    p.add_argument("--version", action="version", version=f"dcr {dcr.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("diff", help="build the delta from OLD to NEW (safetensors files)")
    d.add_argument("old")
    d.add_argument("new")
    d.add_argument("-o", "--output", required=True, help="delta file to write (atomically)")
    d.add_argument("--mode", choices=["free", "context"], default="free", help="codec mode (default: free)")
    d.add_argument("--kind", choices=["xor", "overwrite"], default="xor", help="change kind (default: xor)")
    d.add_argument("--chunk-mib", type=float, default=4.0, help="chunk size in MiB of input (default 4)")
    d.add_argument("--level", type=int, default=1, help="zstd level of the payload streams (default 1)")
    d.add_argument("--base-version", type=int, default=0)
    d.add_argument("--target-version", type=int, default=1)
    d.set_defaults(func=cmd_diff)

    a = sub.add_parser(
        "apply",
        help="apply DELTA in place to TARGET (a safetensors file), crash-safe: rerun after a failure to finish",
    )
    a.add_argument("delta")
    a.add_argument("target")
    a.add_argument("--journal", default=None, help="receiver journal (default: TARGET.dcrj beside it)")
    a.add_argument("--batch-chunks", type=int, default=256, help="chunks per journaled batch (default 256)")
    a.set_defaults(func=cmd_apply)

    s = sub.add_parser("status", help="the receiver's committed version and any refit in flight")
    s.add_argument("target")
    s.add_argument("--journal", default=None, help="receiver journal (default: TARGET.dcrj beside it)")
    s.set_defaults(func=cmd_status)

    v = sub.add_parser("verify", help="bit-exact comparison of two safetensors files (exit 1 when they differ)")
    v.add_argument("a")
    v.add_argument("b")
    v.set_defaults(func=cmd_verify)

    i = sub.add_parser("inspect", help="validate and describe a delta")
    i.add_argument("delta")
    i.add_argument("--all", action="store_true", help="list unchanged tensors too")
    i.set_defaults(func=cmd_inspect)

    m = sub.add_parser("demo", help="train a small model and refit replicas with deltas, verifying every bit")
    m.add_argument("--out", type=Path, default=None, help="report folder (default: a fresh folder it names)")
    m.add_argument("--steps", type=int, default=5)
    m.add_argument("--regime", choices=["fp32master", "bf16"], default="fp32master")
    m.add_argument("--receivers", type=int, default=3)
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_demo)

    for sp in (d, a, s, v, i, m):
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.add_argument("-q", "--quiet", action="store_true")
        sp.add_argument("--threads", type=int, default=None, help="worker threads (default: all cores)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (dcr.DcrError, OSError, ValueError, TypeError) as e:
        print(f"dcr {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dcr {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
