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
    result = dcr.apply_file(args.delta, args.target, threads=args.threads)
    elapsed = time.perf_counter() - t0
    result["seconds"] = elapsed
    if args.json:
        print(json.dumps(result, indent=2))
    elif not args.quiet:
        if result["outcome"] == "already_at_target":
            print(f"{args.target} is already at the delta's target version; nothing to do")
        else:
            print(
                f"{args.target}: applied {result['chunks']} chunks ({result['changed_elements']:,} elements) "
                f"in {elapsed:.2f} s; digests verified"
            )
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


# ---------------------------------------------------------------- object storage
# `dcr publish/receive` dispatch on the URL scheme: s3://, gs://, az://,
# file:// go to object storage (docs/objstore.md); HOST:PORT is the relay
# transport's.

_OBJSTORE_SCHEMES = ("s3://", "s3a://", "gs://", "az://", "abfs://", "abfss://", "azure://", "file://")


def _is_objstore(url: str) -> bool:
    return url.startswith(_OBJSTORE_SCHEMES)


def _not_a_transport(url: str, flag: str) -> ValueError:
    return ValueError(
        f"{flag} {url!r}: not an object-store URL (s3://bucket/prefix, gs://bucket/prefix, az://container/prefix, "
        f"file:///path); a relay address HOST:PORT needs the relay transport, which this build does not have"
    )


def cmd_publish(args: argparse.Namespace) -> int:
    if not _is_objstore(args.to):
        raise _not_a_transport(args.to, "--to")
    from dcr import _core

    total = os.path.getsize(args.delta)
    bar = _bar(total, "publish", args.quiet or args.json)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    t0 = time.perf_counter()
    try:
        info = _core.objstore_publish(
            args.delta, args.to, version=args.version, concurrency=args.concurrency, progress=progress
        )
    finally:
        bar.close()
    info["seconds"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(info, indent=2))
    elif not args.quiet:
        print(
            f"{args.to}: committed v{info['version']} ({info['objects']} objects, {_human(info['object_bytes'])}, "
            f"target {info['target_digest'][:16]}) in {info['seconds']:.2f} s"
        )
    return 0


def cmd_receive(args: argparse.Namespace) -> int:
    src = getattr(args, "from")
    if not _is_objstore(src):
        raise _not_a_transport(src, "--from")
    from tqdm import tqdm

    from dcr import _core

    quiet = args.quiet or args.json
    bars: dict[int, Any] = {}

    def progress(event: str, version: int, done: int, total: int) -> None:
        if event == "fetch":
            bar = bars.get(version)
            if bar is None:
                bar = bars[version] = tqdm(
                    total=total, desc=f"v{version}", unit="B", unit_scale=True, unit_divisor=1024,
                    disable=quiet or None, leave=False,
                )
            bar.n = done
            bar.refresh()
        elif event == "waiting" and not quiet and not bars:
            tqdm.write(f"at the newest committed version; waiting up to {args.wait:g} s for v{version}")
        elif event == "applied":
            bar = bars.pop(version, None)
            if bar is not None:
                bar.close()
            if not quiet:
                tqdm.write(f"v{version}: applied {done} chunks ({total:,} elements); digests verified")

    t0 = time.perf_counter()
    try:
        info = _core.objstore_receive(
            args.target, src, receiver_id=args.receiver_id, wait=args.wait, concurrency=args.concurrency,
            progress=progress,
        )
    finally:
        for bar in bars.values():
            bar.close()
    info["seconds"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(info, indent=2))
    elif not args.quiet:
        at = f"v{info['version']}" if info["version"] is not None else "the base of v1"
        if info["applied"]:
            print(f"{args.target}: now at {at} (applied {len(info['applied'])} version(s), fetched "
                  f"{_human(info['fetched_bytes'])}) in {info['seconds']:.2f} s; newest committed")
        else:
            print(f"{args.target}: at {at}, the newest committed version at {src}; nothing to do")
    return 0


def cmd_versions(args: argparse.Namespace) -> int:
    if not _is_objstore(args.url):
        raise _not_a_transport(args.url, "URL")
    from dcr import _core

    vs = _core.objstore_versions(args.url)
    if args.json:
        print(json.dumps(vs, indent=2))
        return 0
    if not vs:
        print(f"{args.url}: no committed version")
    for v in vs:
        print(f"v{v['version']:<6} {v['base_digest'][:16]} -> {v['target_digest'][:16]}  "
              f"{v['objects']:>6} objects  {_human(v['object_bytes']):>10}  {v['changed_elements']:,} changed")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    if not _is_objstore(args.url):
        raise _not_a_transport(args.url, "URL")
    from dcr import _core

    info = _core.objstore_gc(args.url, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(info, indent=2))
    elif not args.quiet:
        verb = "would delete" if args.dry_run else "deleted"
        gone = ", ".join(f"v{v}" for v in info["deleted"]) or "nothing"
        print(f"{args.url}: {verb} {gone}; every registered receiver acknowledged up to "
              f"{info['acknowledged_by_all']}, newest v{info['newest']} kept")
    return 0


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

    a = sub.add_parser("apply", help="apply DELTA in place to TARGET (a safetensors file)")
    a.add_argument("delta")
    a.add_argument("target")
    a.set_defaults(func=cmd_apply)

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

    pub = sub.add_parser("publish", help="publish DELTA as the next version to object storage (s3://, gs://, az://, file://)")
    pub.add_argument("delta")
    pub.add_argument("--to", required=True, metavar="URL", help="s3://bucket/prefix, gs://..., az://..., file:///path")
    pub.add_argument("--version", type=int, default=None, dest="version",
                     help="version number to commit (default: the newest committed + 1)")
    pub.add_argument("--concurrency", type=int, default=8, help="uploads in flight (default 8)")
    pub.set_defaults(func=cmd_publish)

    rec = sub.add_parser("receive", help="apply every committed version after TARGET's own, in order (in place)")
    rec.add_argument("target")
    rec.add_argument("--from", required=True, metavar="URL", help="s3://bucket/prefix, gs://..., az://..., file:///path")
    rec.add_argument("--receiver-id", default=None, help="register and acknowledge versions under this id (holds back GC)")
    rec.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                     help="when already at the newest, wait this long for the next version, prefetching it while it streams (default 0: exit at once)")
    rec.add_argument("--concurrency", type=int, default=8, help="downloads in flight (default 8)")
    rec.set_defaults(func=cmd_receive)

    ver = sub.add_parser("versions", help="list the committed versions at an object-store URL")
    ver.add_argument("url")
    ver.set_defaults(func=cmd_versions)

    gcp = sub.add_parser("gc", help="delete versions every registered receiver acknowledged (keeps the newest)")
    gcp.add_argument("url")
    gcp.add_argument("--dry-run", action="store_true")
    gcp.set_defaults(func=cmd_gc)

    for sp in (d, a, v, i, m, pub, rec, ver, gcp):
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
