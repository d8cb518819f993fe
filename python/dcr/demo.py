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
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for r in rows:
        for i, (t0, t1) in enumerate(r["receiver_spans"]):
            ax.barh(i, t1 - t0, left=t0, color=f"C{r['step'] % 10}", edgecolor="k", linewidth=0.3)
    ax.set(xlabel="seconds since the first refit started", ylabel="receiver", title="Refit timeline per receiver (colour = step)")
    fig.tight_layout()
    fig.savefig(out / "refit_timeline.png", dpi=110)
    plt.close(fig)
    return ["change_and_payload.png", "refit_timeline.png"]


def run(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        print("dcr demo needs torch: pip install 'dcr[torch]'")
        return 2
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
    replicas = [work / f"receiver{r}.safetensors" for r in range(args.receivers)]
    for r in replicas:
        shutil.copyfile(base, r)
    full = base.stat().st_size
    print(f"dcr demo: {sum(p.numel() for p in model.parameters()):,} parameters, checkpoint {full / 2**20:.1f} MiB, "
          f"{args.receivers} receivers, regime {args.regime}, report in {out}")
    print(f"{'step':>4}  {'loss':>7}  {'changed %':>9}  {'payload':>10}  {'B/changed':>9}  {'vs full':>8}  {'encode s':>8}  {'refit s':>8}  verified")
    rows: list[dict[str, Any]] = []
    prev = base
    t_start = time.perf_counter()
    for s in range(1, args.steps + 1):
        loss = step()
        new = work / f"v{s}.safetensors"
        _export(torch, model, new, args.regime)
        delta = work / f"v{s - 1}-v{s}.dcr"
        t0 = time.perf_counter()
        stats = dcr.diff_files(prev, new, delta, base_version=s - 1, target_version=s, threads=args.threads)
        t_enc = time.perf_counter() - t0
        t0 = time.perf_counter()
        spans = []
        for r in replicas:
            a = time.perf_counter()
            dcr.apply_file(delta, r, threads=args.threads)
            spans.append((a - t_start, time.perf_counter() - t_start))
        t_refit = time.perf_counter() - t0
        ok = all(not dcr.compare_files(r, new) for r in replicas)
        rows.append({
            "step": s, "loss": loss, "change_rate": stats["change_rate"], "payload_bytes": stats["payload_bytes"],
            "bytes_per_changed": stats["bytes_per_changed"], "checkpoint_bytes": full, "encode_s": t_enc,
            "refit_s": t_refit, "verified": ok, "kind_rates": _kind_rates(stats), "receiver_spans": spans,
        })
        print(f"{s:>4}  {loss:>7.4f}  {100 * stats['change_rate']:>9.3f}  {stats['payload_bytes']:>10,}  "
              f"{stats['bytes_per_changed']:>9.3f}  {full / stats['payload_bytes']:>7.1f}x  {t_enc:>8.3f}  {t_refit:>8.3f}  "
              f"{'yes' if ok else 'NO'}")
        if not ok:
            print("dcr demo: a receiver differs from the dense export")
            return 1
        prev.unlink() if prev != base else None
        prev = new
    total_payload = sum(r["payload_bytes"] for r in rows)
    summary = {"steps": rows, "receivers": args.receivers, "regime": args.regime, "checkpoint_bytes": full,
               "payload_bytes_total": total_payload, "full_bytes_total": full * len(rows), "all_verified": True}
    summary["plots"] = _plots(out, rows)
    (out / "report.json").write_text(json.dumps(summary, indent=2))
    print(f"all {args.receivers} receivers bit-exact after {len(rows)} steps; sent {total_payload / 2**20:.2f} MiB "
          f"instead of {full * len(rows) / 2**20:.1f} MiB ({full * len(rows) / total_payload:.1f}x less); report {out / 'report.json'}")
    return 0
