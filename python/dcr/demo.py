"""`dcr demo`: train a small transformer on the CPU with real optimizer steps
and, after each step, refit receiver replicas with a dcr delta instead of the
full checkpoint, verifying every replica bit for bit against a dense export."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import dcr
from dcr._procs import Proc


def _model(torch: Any, vocab: int, hidden: int, layers: int, seed: int) -> Any:
    torch.manual_seed(seed)
    nn = torch.nn

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, hidden)
            layer = nn.TransformerEncoderLayer(hidden, nhead=4, dim_feedforward=4 * hidden, batch_first=True, norm_first=True)
            self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(hidden)
            self.lm_head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, tokens: Any) -> Any:
            n = tokens.shape[1]
            mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
            return self.lm_head(self.norm(self.layers(self.embed_tokens(tokens), mask=mask, is_causal=True)))

    return TinyLM()


def _export(torch: Any, model: Any, path: Path, regime: str) -> None:
    from safetensors.torch import save_file

    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(path), metadata={"format": "pt"})


def _kind(name: str) -> str:
    if "embed" in name:
        return "embed"
    if "lm_head" in name:
        return "lm_head"
    if name.endswith("bias"):
        return "bias"
    if "norm" in name:
        return "norm"
    if "attn" in name:
        return "attn"
    if "linear" in name or "mlp" in name:
        return "mlp"
    return "other"


def _kind_rates(stats: dict[str, Any]) -> dict[str, float]:
    tot: dict[str, list[int]] = {}
    for t in stats["tensors"]:
        k = tot.setdefault(_kind(t["name"]), [0, 0])
        k[0] += t["changed_elements"]
        k[1] += t["elements"]
    return {k: c / n for k, (c, n) in tot.items() if n}


def _plots(out: Path, rows: list[dict[str, Any]]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot(steps, [100 * r["change_rate"] for r in rows], "o-", label="all", color="k")
    for kind in sorted({k for r in rows for k in r["kind_rates"]}):
        ax[0].plot(steps, [100 * r["kind_rates"].get(kind, 0) for r in rows], ".--", label=kind)
    ax[0].set(xlabel="optimizer step", ylabel="elements whose bits changed (%)", title="Change rate per step")
    ax[0].legend(fontsize=8)
    for a in ax:
        a.set_xticks(steps)
    ax[1].bar(steps, [r["checkpoint_bytes"] / 2**20 for r in rows], color="#ccc", label="full checkpoint")
    ax[1].bar(steps, [r["payload_bytes"] / 2**20 for r in rows], color="tab:blue", label="dcr delta")
    ax[1].set(xlabel="optimizer step", ylabel="MiB sent per receiver", title="Payload against the full checkpoint")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(out / "change_and_payload.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    n_steps = len(rows)
    for k, r in enumerate(rows):
        for i, (t0, t1) in enumerate(r["receiver_spans"]):
            y = i + (k - (n_steps - 1) / 2) * 0.8 / max(n_steps, 1)
            ax.barh(y, 1000 * (t1 - t0), left=0, height=0.8 / max(n_steps, 1), color=f"C{k % 10}",
                    label=f"step {r['step']}" if i == 0 else None)
    n_recv = len(rows[0]["receiver_spans"]) if rows else 0
    ax.set_yticks(range(n_recv), [f"receiver {i}" for i in range(n_recv)])
    ax.set(xlabel="milliseconds from the start of the publish to the receiver's commit",
           title="Refit timeline per receiver and step")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "refit_timeline.png", dpi=110)
    plt.close(fig)
    return ["change_and_payload.png", "refit_timeline.png"]


def _refit_loop(args: argparse.Namespace, torch: Any, model: Any, step: Any, base: Path, full: int, work: Path,
                where: str, refit: Any) -> list[dict[str, Any]] | None:
    """Train a step, export it, diff it against the previous version, then
    `refit(step, delta, new) -> (spans, acks, ok)`; print a table row per step.
    Returns the rows, or None when a receiver is not bit-exact."""
    print(f"dcr demo: a {sum(p.numel() for p in model.parameters()):,}-parameter transformer trained on the CPU "
          f"({args.regime}), checkpoint {full / 2**20:.1f} MiB; {args.receivers} receiver processes {where}")
    print(f"{'step':>4}  {'loss':>7}  {'changed %':>9}  {'payload':>10}  {'B/changed':>9}  {'vs full':>8}  "
          f"{'encode s':>8}  {'refit s':>8}  verified")
    rows: list[dict[str, Any]] = []
    prev = base
    for s in range(1, args.steps + 1):
        loss = step()
        new = work / f"v{s}.safetensors"
        _export(torch, model, new, args.regime)
        delta = work / f"v{s - 1}-v{s}.dcr"
        t0 = time.perf_counter()
        stats = dcr.diff_files(prev, new, delta, mode=args.mode, base_version=s - 1, target_version=s,
                               threads=args.threads)
        t_enc = time.perf_counter() - t0
        t0 = time.perf_counter()
        spans, acks, ok = refit(s, delta, new)
        t_refit = time.perf_counter() - t0
        rows.append({
            "step": s, "loss": loss, "change_rate": stats["change_rate"], "payload_bytes": stats["payload_bytes"],
            "bytes_per_changed": stats["bytes_per_changed"], "checkpoint_bytes": full, "encode_s": t_enc,
            "refit_s": t_refit, "verified": ok, "kind_rates": _kind_rates(stats), "receiver_spans": spans,
            "acks": acks,
        })
        print(f"{s:>4}  {loss:>7.4f}  {100 * stats['change_rate']:>9.3f}  {stats['payload_bytes']:>10,}  "
              f"{stats['bytes_per_changed']:>9.3f}  {full / stats['payload_bytes']:>7.1f}x  {t_enc:>8.3f}  "
              f"{t_refit:>8.3f}  {'yes' if ok else 'NO'}", flush=True)
        if not ok:
            print(f"dcr demo: step {s}: a receiver differs from the dense export")
            return None
        if prev != base:
            prev.unlink()
        prev = new
    return rows


def _run_via_objstore(args: argparse.Namespace, torch: Any, model: Any, step: Any, base: Path, full: int,
                      out: Path, work: Path) -> int:
    """The same loop through object storage: each version's chunks and manifest
    go to `--via URL`; every receiver process applies what is committed."""
    import subprocess
    import sys

    url = args.via
    replicas = [work / f"receiver{r}.safetensors" for r in range(args.receivers)]
    for path in replicas:
        shutil.copyfile(base, path)

    def refit(s: int, delta: Path, new: Path) -> tuple[list[tuple[float, float]], list[Any], bool]:
        t0 = time.perf_counter()
        dcr._core.objstore_publish(delta, url, version=s)
        procs = [subprocess.Popen([sys.executable, "-m", "dcr.cli", "receive", str(r), "--from", url,
                                   "--receiver-id", f"receiver{i}", "--json"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i, r in enumerate(replicas)]
        spans, results = [], []
        for p in procs:
            o, e = p.communicate(timeout=300)
            spans.append((0.0, time.perf_counter() - t0))
            if p.returncode != 0:
                print(f"dcr demo: step {s}: a receiver failed: {e.strip()}")
                return spans, [], False
            results.append(json.loads(o))
        want = dcr.file_digest(new)
        ok = all(r["version"] == s for r in results) and all(not dcr.compare_files(r, new) for r in replicas) \
            and all(dcr.file_digest(r) == want for r in replicas)
        return spans, [(f"receiver{i}", r["digest"]) for i, r in enumerate(results)], ok

    rows = _refit_loop(args, torch, model, step, base, full, work, f"reading {url}; report in {out}", refit)
    return 1 if rows is None else _summary(args, out, rows, full, transport=url)


def _summary(args: argparse.Namespace, out: Path, rows: list[dict[str, Any]], full: int, transport: str) -> int:
    total_payload = sum(r["payload_bytes"] for r in rows)
    summary = {"steps": rows, "receivers": args.receivers, "transport": transport, "regime": args.regime,
               "mode": args.mode, "checkpoint_bytes": full, "payload_bytes_total": total_payload,
               "full_bytes_total": full * len(rows), "all_verified": all(r["verified"] for r in rows)}
    summary["plots"] = _plots(out, rows)
    (out / "report.json").write_text(json.dumps(summary, indent=2))
    print(f"all {args.receivers} receivers bit-exact against the dense export after each of {len(rows)} steps; "
          f"sent {total_payload / 2**20:.2f} MiB instead of {full * len(rows) / 2**20:.1f} MiB "
          f"({full * len(rows) / total_payload:.1f}x less)")
    print(f"report: {out / 'report.json'}" + "".join(f", {out / p}" for p in summary["plots"]))
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        print("dcr demo needs torch: pip install 'dcr[torch]'")
        return 2
    import os
    import sys

    out = args.out or Path(tempfile.mkdtemp(prefix="dcr-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    work.mkdir(exist_ok=True)
    torch.set_num_threads(max(1, (args.threads or 2)))
    vocab, hidden, layers = 2048, 256, 4
    model = _model(torch, vocab, hidden, layers, args.seed)
    if args.regime == "bf16":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5 if args.regime == "bf16" else 3e-6, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, vocab, (8, 64), generator=gen)

    def step() -> float:
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())

    for _ in range(3):  # past Adam's first, larger steps
        step()
    base = work / "v0.safetensors"
    _export(torch, model, base, args.regime)
    full = base.stat().st_size

    # The relay tree and the receivers: separate processes on loopback.
    cli = [sys.executable, "-m", "dcr.cli"]
    key = work / "tree.key"
    key.write_bytes(os.urandom(32))
    limit = ["--rate-limit", str(int(args.link_mib_s * (1 << 20)))] if args.link_mib_s else []
    procs: list[Proc] = []
    if args.via:
        return _run_via_objstore(args, torch, model, step, base, full, out, work)
    try:
        root = Proc([*cli, "relay", "--listen", "127.0.0.1:0", "--key-file", str(key), *limit], work / "relay-root.log")
        procs.append(root)
        root_addr = root.listening()
        leaves = [(root, root_addr)]
        for i in range(args.fanout):
            r = Proc([*cli, "relay", "--listen", "127.0.0.1:0", "--parent", root_addr, "--key-file", str(key), *limit],
                     work / f"relay-{i}.log")
            procs.append(r)
            leaves.append((r, r.listening()))
        if args.fanout:
            leaves = leaves[1:]
        replicas = [work / f"receiver{r}.safetensors" for r in range(args.receivers)]
        receivers = []
        per_leaf: dict[int, int] = {}
        for k, path in enumerate(replicas):
            shutil.copyfile(base, path)
            leaf = k % len(leaves)
            per_leaf[leaf] = per_leaf.get(leaf, 0) + 1
            p = Proc([*cli, "receive", str(path), "--from", f"{leaves[leaf][1]},{root_addr}", "--key-file", str(key),
                      "--receiver-id", f"receiver{k}", "--follow", str(args.steps), "--json"], work / f"receiver{k}.log")
            procs.append(p)
            receivers.append(p)
        for leaf, count in per_leaf.items():
            leaves[leaf][0].wait_log("role=Subscriber", count)
        tree = f"a root relay and {args.fanout} relays under it" if args.fanout else "one relay"
        t_start = time.time()

        def refit(s: int, delta: Path, new: Path) -> tuple[list[tuple[float, float]], list[Any], bool]:
            t_pub = time.time()
            report = dcr._core.publish_delta(delta, root_addr, key_file=str(key), expect_acks=args.receivers,
                                             ack_timeout_s=300.0)
            spans = [(t_pub - t_start, json.loads(p.line())["finished_at"] - t_start) for p in receivers]
            want = dcr.file_digest(new)
            ok = (report["all_committed"] and all(d == want for _, d in report["committed"])
                  and all(not dcr.compare_files(r, new) for r in replicas))
            if not ok:
                print(f"dcr demo: step {s}: {report}")
            return spans, report["committed"], ok

        rows = _refit_loop(args, torch, model, step, base, full, work, f"behind {tree}; report in {out}", refit)
    finally:
        for p in procs:
            p.stop()
    return 1 if rows is None else _summary(args, out, rows, full, transport=f"relay tree (fanout {args.fanout})")
