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


def _follow(bar: Any) -> Any:
    """A `progress(done, total)` callback that moves `bar`."""

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    return progress


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def cmd_diff(args: argparse.Namespace) -> int:
    # A sharded checkpoint is a directory: the core reports the real total.
    total = os.path.getsize(args.new) if os.path.isfile(args.new) else 0
    bar = _bar(total, "diff", args.quiet or args.json)

    progress = _follow(bar)

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
        dense=args.dense,
        threads=args.threads,
        progress=progress,
    )
    bar.close()
    elapsed = time.perf_counter() - t0
    stats["seconds"] = elapsed
    # A delta written to stdout (`-o /dev/stdout`) keeps stdout to itself.
    report = sys.stderr if _is_stdout(args.output) else sys.stdout
    if args.json:
        print(json.dumps(stats, indent=2), file=report)
    elif not args.quiet:
        print(
            f"{args.output}: {stats['changed_elements']:,} of {stats['total_elements']:,} elements changed "
            f"({100 * stats['change_rate']:.3f} %), {_human(stats['payload_bytes'])} "
            f"({stats['bytes_per_changed']:.3f} B per changed element, "
            f"{_against_checkpoint(stats['payload_bytes'], stats['checkpoint_bytes'])}) "
            f"in {elapsed:.2f} s",
            file=report,
        )
    return 0


def _against_checkpoint(delta_bytes: int, checkpoint_bytes: int) -> str:
    """How the delta's size compares with the checkpoint's, in words."""
    if checkpoint_bytes == 0:
        return "the checkpoint holds no data"
    if delta_bytes <= checkpoint_bytes:
        return f"{checkpoint_bytes / max(delta_bytes, 1):.1f}x smaller than the checkpoint"
    return f"{delta_bytes / checkpoint_bytes:.1f}x the checkpoint's size: its header and digests outweigh so few changes"


def _is_stdout(path: str) -> bool:
    """Whether ``path`` is the file, pipe or terminal this process's stdout writes to."""
    try:
        a, b = os.stat(path), os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


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
        print("no journal: this target was never refitted by `dcr apply` or `dcr receive`")
        return 0
    c = st["committed"]
    print(f"committed version {c['version']}  digest {c['digest']}" if c else "committed: none")
    r = st["refit"]
    if r:
        print(
            f"refit in flight to version {r['version']} (delta {r['delta_id'][:16]}): {r['applied']} of "
            f"{r['chunks']} chunks applied, {r['in_progress']} in progress, {r['not_started']} not started; "
            + (f"its received delta is spooled ({st['spool_bytes']:,} B): rerun `dcr receive` to finish it"
               if st.get("spool_bytes") is not None else "rerun `dcr apply` with that delta to finish it")
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
    modes = ", ".join(f"{k} {v}" for k, v in info["modes"].items() if v)
    print(f"  kind {info['kind']}, mode {info['mode']}, chunk size {_human(info['chunk_bytes'])}; "
          f"chunks by mode: {modes or 'none'}; encodings: {enc or 'none'}")
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


def _publish_relay(args: argparse.Namespace) -> int:
    bar = _bar(os.path.getsize(args.delta), "publish", args.quiet or args.json)

    progress = _follow(bar)

    t0 = time.perf_counter()
    report = dcr._core.publish_delta(
        args.delta,
        args.to,
        key_file=args.key_file,
        version=args.version,
        expect_acks=args.expect_acks,
        ack_timeout_s=args.ack_timeout,
        standby=args.standby,
        progress=progress,
    )
    bar.close()
    report["seconds"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(report, indent=2))
    elif not args.quiet:
        print(
            f"published v{report['version']}: {report['chunks']} chunks, {_human(report['bytes'])} to {args.to} "
            f"in {report['seconds']:.2f} s"
        )
        if args.expect_acks:
            print(f"  {len(report['committed'])} of {args.expect_acks} receivers committed"
                  + "".join(f"\n  FAILED {n}: {r}" for n, r in report["failed"]))
    if args.expect_acks and not report["all_committed"]:
        return 1
    return 0


def _receive_relay(args: argparse.Namespace) -> int:
    parents = [p for p in args.source.split(",") if p]
    from tqdm import tqdm

    from_version = args.from_version
    for _ in range(max(args.follow, 1)):
        bar = tqdm(desc=f"receive v{from_version}+", unit=" chunks", disable=args.quiet or args.json or None, leave=False)

        def progress(done: int, _total: int, bar: Any = bar) -> None:
            bar.n = done
            bar.refresh()

        t0 = time.perf_counter()
        try:
            result = dcr._core.receive_delta(
                args.target,
                parents,
                key_file=args.key_file,
                receiver_id=args.receiver_id,
                from_version=from_version,
                timeout_s=args.timeout,
                progress=progress,
                journal=args.journal,
                journaled=not args.no_journal,
                batch_chunks=args.batch_chunks,
            )
        finally:
            bar.close()
        result["seconds"] = time.perf_counter() - t0
        result["finished_at"] = time.time()
        from_version = result["version"] + 1
        _report_receive(args, result)
    return 0


def _report_receive(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(result), flush=True)
    elif not args.quiet:
        if result.get("resumed"):
            print(f"{args.target}: finished v{result['version']} from its spooled delta (the earlier receive was "
                  f"interrupted mid-apply; {result['changed_elements']:,} elements); digests verified, committed",
                  flush=True)
        elif result["outcome"] == "already_at_target":
            print(f"{args.target} already holds v{result['version']}; committed")
        else:
            print(
                f"{args.target}: v{result['version']} applied from {result['parent']} ({result['chunks']} chunks, "
                f"{result['changed_elements']:,} elements, {result['failovers']} failovers) in {result['seconds']:.2f} s; "
                "digests verified, committed",
                flush=True,
            )


def cmd_relay(args: argparse.Namespace) -> int:
    return int(dcr._core.relay_main(["dcr-relay", *args.relay_args]))


def relay_entry() -> None:
    """The `dcr-relay` command installed with the package (same as the standalone binary)."""
    sys.exit(int(dcr._core.relay_main(["dcr-relay", *sys.argv[1:]])))


def cmd_bench_refit(args: argparse.Namespace) -> int:
    from dcr import benchrefit

    return benchrefit.run(args)


def cmd_project(args: argparse.Namespace) -> int:
    from dcr import projection

    return projection.run(args)


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
        f"file:///path) nor a relay address HOST:PORT"
    )


def cmd_publish(args: argparse.Namespace) -> int:
    """`dcr publish`: object storage for URLs, the relay tree for HOST:PORT."""
    if _is_objstore(args.to):
        return _publish_objstore(args)
    if "://" in args.to:
        raise _not_a_transport(args.to, "--to")
    return _publish_relay(args)


def cmd_receive(args: argparse.Namespace) -> int:
    """`dcr receive`: object storage for URLs, the relay tree for HOST:PORT[,...]."""
    if _is_objstore(args.source):
        if args.no_journal or args.batch_chunks != 256:
            raise ValueError(
                "--no-journal and --batch-chunks apply to receiving from relays; from object storage every "
                "version is applied through the journal whole (drop the flag)"
            )
        return _receive_objstore(args)
    if "://" in args.source:
        raise _not_a_transport(args.source, "--from")
    return _receive_relay(args)


def _publish_objstore(args: argparse.Namespace) -> int:
    from dcr import _core

    total = os.path.getsize(args.delta)
    bar = _bar(total, "publish", args.quiet or args.json)

    progress = _follow(bar)

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


def _receive_objstore(args: argparse.Namespace) -> int:
    src = args.source
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
        elif event == "resumed" and not quiet:
            tqdm.write(f"v{version}: finished the interrupted refit from its spooled delta ({done} chunks, "
                       f"{total:,} elements); digests verified")

    t0 = time.perf_counter()
    try:
        info = _core.objstore_receive(
            args.target, src, receiver_id=args.receiver_id, wait=args.wait, concurrency=args.concurrency,
            progress=progress, journal=args.journal,
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

    d = sub.add_parser("diff", help="build the delta from OLD to NEW (safetensors files, or directories of shards)")
    d.add_argument("old")
    d.add_argument("new")
    d.add_argument("-o", "--output", required=True, help="delta file to write (atomically)")
    d.add_argument("--mode", choices=["free", "context"], default="context",
                   help="codec mode (default: context, since every receiver reads its base; "
                        "free: decodable from the payload alone)")
    d.add_argument("--kind", choices=["xor", "overwrite"], default="xor", help="change kind (default: xor)")
    d.add_argument("--chunk-mib", type=float, default=4.0, help="chunk size in MiB of input (default 4)")
    d.add_argument("--level", type=int, default=1, help="zstd level of the payload streams (default 1)")
    d.add_argument("--base-version", type=int, default=0)
    d.add_argument("--target-version", type=int, default=1)
    d.add_argument(
        "--dense",
        action="store_true",
        help="a dense delta: all of NEW as overwrites, applicable to any target of the same layout "
        "(bootstraps a new receiver through the same transport; OLD only gives the layout)",
    )
    d.set_defaults(func=cmd_diff)

    a = sub.add_parser(
        "apply",
        help="apply DELTA in place to TARGET (a safetensors file or a directory of shards), crash-safe: "
        "rerun after a failure to finish",
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

    v = sub.add_parser("verify", help="bit-exact comparison of two checkpoints, files or shard directories (exit 1 when they differ)")
    v.add_argument("a")
    v.add_argument("b")
    v.set_defaults(func=cmd_verify)

    i = sub.add_parser("inspect", help="validate and describe a delta")
    i.add_argument("delta")
    i.add_argument("--all", action="store_true", help="list unchanged tensors too")
    i.set_defaults(func=cmd_inspect)

    pb = sub.add_parser("publish", help="publish a delta: stream it to a relay tree, or commit it to object storage")
    pb.add_argument("delta")
    pb.add_argument("--to", required=True, help="root relay HOST:PORT, or s3://bucket/prefix, gs://..., az://..., file:///path")
    pb.add_argument("--key-file", default=None, help="pre-shared key file of the relay tree")
    pb.add_argument("--version", type=int, default=None,
                    help="version to publish as (default: relay: the delta's target version; object storage: newest + 1)")
    pb.add_argument("--concurrency", type=int, default=8, help="object storage: uploads in flight (default 8)")
    pb.add_argument("--expect-acks", type=int, default=0, help="wait until this many receivers report (exit 1 unless all commit)")
    pb.add_argument("--ack-timeout", type=float, default=120.0)
    pb.add_argument("--standby", action="append", default=[], help="standby root HOST:PORT (repeatable)")
    pb.set_defaults(func=cmd_publish)

    rc = sub.add_parser("receive", help="receive deltas and apply them in place (exit 0 once committed / at the newest)")
    rc.add_argument("target")
    rc.add_argument("--from", dest="source", required=True,
                    help="parent relays HOST:PORT[,HOST:PORT...] in failover order, or an object-store URL")
    rc.add_argument("--key-file", default=None)
    rc.add_argument("--receiver-id", default=None, help="id in acks (object storage: registers it, holding back GC)")
    rc.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                    help="object storage: when at the newest, wait this long for the next version, prefetching it")
    rc.add_argument("--concurrency", type=int, default=8, help="object storage: downloads in flight (default 8)")
    rc.add_argument("--from-version", type=int, default=0, help="receive the first version >= this")
    rc.add_argument("--timeout", type=float, default=600.0)
    rc.add_argument("--follow", type=int, default=1, metavar="N", help="receive N successive versions, then exit")
    rc.add_argument("--journal", default=None,
                    help="receiver journal (default: TARGET.dcrj beside it); each version is spooled and applied "
                         "through it, so a receive killed mid-apply finishes on the next run")
    rc.add_argument("--batch-chunks", type=int, default=256,
                    help="relay: chunks per journal batch (two journal syncs and one target flush each; default 256)")
    rc.add_argument("--no-journal", action="store_true",
                    help="relay only: apply frames as they arrive, without the journal (a receive killed "
                         "mid-apply leaves the target partially applied)")
    rc.set_defaults(func=cmd_receive)

    rl = sub.add_parser("relay", help="run a relay node (same as the dcr-relay command)", add_help=False)
    rl.add_argument("relay_args", nargs=argparse.REMAINDER)
    rl.set_defaults(func=cmd_relay)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    br = bench.add_parser("refit", help="delta vs dense refit over bandwidth-limited loopback relay links")
    from dcr import benchrefit

    benchrefit.add_arguments(br)
    br.set_defaults(func=cmd_bench_refit)

    pj = sub.add_parser("project", help="project refit time to 30B-1T models from the rates measured here")
    from dcr import projection

    projection.add_arguments(pj)
    pj.set_defaults(func=cmd_project)

    m = sub.add_parser("demo", help="train a small model and refit replicas with deltas, verifying every bit")
    m.add_argument("--out", type=Path, default=None, help="report folder (default: a fresh folder it names)")
    m.add_argument("--steps", type=int, default=5)
    m.add_argument("--regime", choices=["fp32master", "bf16"], default="fp32master")
    m.add_argument("--receivers", type=int, default=3)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--fanout", type=int, default=2, help="relays under the root (0: receivers attach to the root)")
    m.add_argument("--link-mib-s", type=float, default=None, help="limit every relay child link (MiB/s)")
    m.add_argument("--mode", choices=["free", "context"], default="context", help="codec mode of the deltas")
    m.add_argument("--via", default=None, metavar="URL",
                   help="refit through object storage at URL (e.g. file:///tmp/bucket) instead of a relay tree")
    m.set_defaults(func=cmd_demo)

    ver = sub.add_parser("versions", help="list the committed versions at an object-store URL")
    ver.add_argument("url")
    ver.set_defaults(func=cmd_versions)

    gcp = sub.add_parser("gc", help="delete versions every registered receiver acknowledged (keeps the newest)")
    gcp.add_argument("url")
    gcp.add_argument("--dry-run", action="store_true")
    gcp.set_defaults(func=cmd_gc)

    for sp in (d, a, s, v, i, m, pb, rc, ver, gcp):
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.add_argument("-q", "--quiet", action="store_true")
        sp.add_argument("--threads", type=int, default=None, help="worker threads (default: all cores)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["relay"]:  # everything after `relay` belongs to dcr-relay
        return int(dcr._core.relay_main(["dcr-relay", *argv[1:]]))
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # The reader went away (`dcr inspect D | head`): stop quietly, as a
        # Unix filter does, without a second error at interpreter exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (dcr.DcrError, OSError, ValueError, TypeError) as e:  # ConnectionError, TimeoutError are OSErrors
        # The core's I/O errors carry their whole message as strerror; an
        # "[Errno N]" prefix adds nothing to it.
        core_io = isinstance(e, OSError) and e.strerror and e.filename is None and e.errno is not None
        print(f"dcr {args.command}: error: {e.strerror if core_io else e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dcr {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
