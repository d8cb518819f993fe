"""Train a small Qwen2-style policy for a few steps and write a safetensors
snapshot per chosen step: fresh, real checkpoint pairs for the codec bench.

The recipe follows the shared snapshots' (../shared/data/README.md): a
Qwen2ForCausalLM built from scratch, a GRPO-like policy-gradient loss on
128-token windows of Python source, AdamW with gradient clipping, and two
regimes: ``fp32master`` (fp32 weights and optimizer states, bf16 autocast,
snapshots rounded to bf16) and ``bf16`` (weights and states in bf16, the
snapshot is the weights themselves). Sizes, learning rate, seed and corpus
are options, so the pairs differ from the shared ones in every respect the
codec could have been tuned to.

    python3 benches/make_training_pairs.py --out bench-out/pairs/fp32m-1e-6 \\
        --regime fp32master --lr 1e-6 --snapshots 10 11 15
    python3 benches/bench_codec.py --pair bench-out/pairs/fp32m-1e-6/step_010.safetensors \\
        bench-out/pairs/fp32m-1e-6/step_011.safetensors

Needs torch and transformers (`pip install ".[test,demo]"` installs both).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path


def corpus_windows(source_dir: Path, vocab: int, window: int, limit_files: int):
    """Token-id windows of Python source: words and punctuation, the
    ``vocab - 1`` most frequent tokens plus one id for all others."""
    import torch

    files = sorted(source_dir.rglob("*.py"))[:limit_files]
    if not files:
        raise SystemExit(f"no Python files under {source_dir}: pass --corpus DIR")
    tokens: list[str] = []
    for f in files:
        tokens.extend(re.findall(r"[A-Za-z_]+|\d+|\S", f.read_text(errors="replace").lower()))
    common = [t for t, _ in Counter(tokens).most_common(vocab - 1)]
    ids = {t: i for i, t in enumerate(common)}
    other = vocab - 1
    stream = torch.tensor([ids.get(t, other) for t in tokens], dtype=torch.long)
    usable = stream.numel() // window * window
    return stream[:usable].view(-1, window)


def build_model(args):
    import torch
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.window, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, attention_dropout=0.0)
    torch.manual_seed(args.seed)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return cfg, model


def save_snapshot(model, path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for step_XXX.safetensors and training.json")
    ap.add_argument("--regime", choices=["fp32master", "bf16"], default="fp32master")
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--snapshots", type=int, nargs="+", default=[10, 11],
                    help="optimizer steps after which to write a snapshot")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--corpus", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                    help="directory of Python files (default: this interpreter's standard library)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    windows = corpus_windows(args.corpus, args.vocab, args.window, limit_files=400)
    cfg, model = build_model(args)
    if args.regime == "bf16":
        model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    rewarded = torch.randperm(args.vocab, generator=gen)[: args.vocab // 2]
    is_rewarded = torch.zeros(args.vocab, dtype=torch.bool)
    is_rewarded[rewarded] = True
    log = []
    last = max(args.snapshots)
    t0 = time.perf_counter()
    for step in range(1, last + 1):
        batch = windows[torch.randint(0, windows.shape[0], (args.batch,), generator=gen)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.regime == "fp32master"):
            logits = model(input_ids=batch).logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        actions = torch.multinomial(logp.exp().view(-1, args.vocab).detach(), 1, generator=gen).view(args.batch, -1)
        reward = is_rewarded[actions].float().mean(dim=1)
        adv = (reward - reward.mean()) / (reward.std() + 1e-6)
        chosen = logp.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        loss = -(adv.unsqueeze(1) * chosen).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        loss_value = float(loss.detach())
        log.append({"step": step, "loss": loss_value, "reward": float(reward.mean()), "grad_norm": grad_norm})
        if step in args.snapshots:
            save_snapshot(model, out / f"step_{step:03d}.safetensors")
        print(f"step {step}/{last}: loss {loss_value:+.4f} reward {float(reward.mean()):.3f} "
              f"grad norm {grad_norm:.3f} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    params = sum(p.numel() for p in model.parameters())
    (out / "training.json").write_text(json.dumps({
        "regime": args.regime, "lr": args.lr, "seed": args.seed, "params": params,
        "config": cfg.to_dict(), "snapshots": args.snapshots, "batch": args.batch, "window": args.window,
        "optimizer": {"name": "AdamW", "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                      "grad_clip_norm": 1.0},
        "steps": log}, indent=1, default=str) + "\n")
    print(f"wrote {len(args.snapshots)} snapshots of {params:,} parameters to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
