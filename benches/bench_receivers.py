"""Receiver apply time through each path, against a dense reload.

For each receiver (plain torch module, FP8-quantizing module, transformers
Qwen3-MoE with fused experts, vLLM CPU Llama in the plain and in the default
repacked layout) a delta at a given change rate is applied through
:class:`dcr.receivers.Receiver` (mapped XOR in place, shadow + loader for
transforming groups), and the same new checkpoint is loaded densely through
the runtime's own loader. Deltas alternate v0->v1 and v1->v0 so every timed
apply starts from the right base. Prints a table and writes JSON
(``bench-out/receivers.json``, schema ``dcr.bench.receivers/1``).

    python benches/bench_receivers.py                # all paths (vLLM rows if vLLM imports)
    python benches/bench_receivers.py --quick        # fewer repeats
    python benches/bench_receivers.py --paths torch,fp8

vLLM rows run in a child process each (one engine per process), with
``VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1``, under
``$DCR_VLLM_PYTHON`` when set (the environment ``.ci/install-vllm`` makes).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dcr._procs import env_importing_this_dcr

REPO = Path(__file__).resolve().parents[1]


def perturb(sd: dict[str, torch.Tensor], rate: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sd.items():
        n = v.clone()
        mask = torch.rand(v.shape, generator=g) < rate
        n[mask] = (n[mask].float() * 1.01 + 1e-4).to(v.dtype)
        out[k] = n
    return out


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    ts, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), out


def measure(name: str, make_recv: Callable[[], Any], dense_load: Callable[[dict], None], v0: dict, rate: float,
            repeats: int, extra: dict | None = None) -> dict:
    import dcr

    t = time.perf_counter()
    recv = make_recv()
    probe_s = time.perf_counter() - t
    v1 = perturb(v0, rate, 1)
    d01, st01 = dcr.diff_tensors(v0, v1, base_version=0, target_version=1)
    d10, _ = dcr.diff_tensors(v1, v0, base_version=1, target_version=0)
    state = {"at": 0}

    def apply(verify: bool) -> dict:
        d = d01 if state["at"] == 0 else d10
        s = recv.apply(d, verify=verify)
        state["at"] ^= 1
        return s

    apply(False)  # warm up (first-touch, lazy imports)
    t_apply, s = timed(lambda: apply(False), repeats)
    t_apply_v, _ = timed(lambda: apply(True), max(1, repeats // 2))
    if state["at"] == 1:
        apply(False)
    t_dense, _ = timed(lambda: dense_load(v1), repeats)
    numel = sum(v.numel() for v in v0.values())
    changed = st01.get("changed") or st01.get("n_changed") or s["mapped_changes"] + s["shadow_changes"]
    row = {
        "path": name,
        "elements": numel,
        "bytes": sum(v.numel() * v.element_size() for v in v0.values()),
        "rate": rate,
        "changed": int(changed),
        "delta_bytes": len(d01),
        "mapped_tensors": recv.placement.summary()["mapped"],
        "transforming_tensors": recv.placement.summary()["transforming"],
        "runs": recv.placement.summary()["runs"],
        "shadow_bytes": recv.shadow_bytes,
        "probe_s": probe_s,
        "apply_s": t_apply,
        "apply_verify_s": t_apply_v,
        "dense_s": t_dense,
        "speedup": t_dense / t_apply if t_apply else None,
        "reloaded_tensors": s["reloaded_tensors"],
    }
    row.update(extra or {})
    return row


# ------------------------------------------------------------------- paths


def path_torch(rate: float, repeats: int) -> dict:
    from dcr.receivers.torch_module import module_receiver

    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024) for _ in range(8)]
    m = torch.nn.Sequential(*layers).to(torch.bfloat16)
    v0 = {k: v.clone() for k, v in m.state_dict().items()}
    return measure("torch module (bf16, 8x1024^2)", lambda: module_receiver(m),
                   lambda sd: m.load_state_dict(sd), v0, rate, repeats)


def path_fp8(rate: float, repeats: int) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from test_receivers_placement import FP8Linear

    from dcr.receivers.torch_module import module_receiver

    m = torch.nn.Sequential(*[FP8Linear(1024, 1024, 128) for _ in range(4)])
    g = torch.Generator().manual_seed(0)
    v0 = {}
    for i in range(4):
        v0[f"{i}.weight"] = torch.randn(1024, 1024, generator=g).to(torch.bfloat16)
        v0[f"{i}.bias"] = torch.randn(1024, generator=g).to(torch.bfloat16)
    m.load_state_dict(v0)
    return measure("fp8 module (block 128, 4x1024^2)", lambda: module_receiver(m, v0),
                   lambda sd: m.load_state_dict(sd), v0, rate, repeats)


def path_transformers(rate: float, repeats: int) -> dict:
    import transformers

    from dcr.receivers.transformers import TransformersAdapter, canonical_state_dict, transformers_receiver

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
    )
    m = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    v0 = canonical_state_dict(m)
    ad = TransformersAdapter(m)
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        return measure("transformers Qwen3-MoE (fused experts)", lambda: transformers_receiver(m, v0),
                       lambda sd: ad.load(sd.items()), v0, rate, repeats)


def vllm_child(layout: str, rate: float, repeats: int, work: str) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import transformers
    from vllm import LLM

    from dcr.receivers.vllm import VllmAdapter, checkpoint_state_dict, plain_cpu_layout, vllm_receiver

    path = os.path.join(work, "llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    plain = layout == "plain"
    with plain_cpu_layout() if plain else contextlib.nullcontext():
        llm = LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256)
    v0 = checkpoint_state_dict(path)
    dense = VllmAdapter(llm, plain_layout=plain)
    dense._trace = None
    return measure(f"vLLM CPU Llama ({layout} layout)", lambda: vllm_receiver(llm, v0, plain_layout=plain),
                   lambda sd: dense.load(sd.items()), v0, rate, repeats)


def path_vllm(layout: str, rate: float, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as work:
        env = env_importing_this_dcr(Path(work) / "this-dcr")  # the child imports this dcr
        p = subprocess.run(
            [os.environ.get("DCR_VLLM_PYTHON") or sys.executable, __file__, "--vllm-child", layout,
             "--rate", str(rate), "--repeats", str(repeats), "--work", work],
            capture_output=True, text=True, timeout=900, env=env,
        )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
    if p.returncode or not lines:
        raise RuntimeError(f"vLLM child failed (rc {p.returncode}): {p.stderr[-2000:]}")
    return json.loads(lines[-1][4:])


PATHS: dict[str, Callable[[float, int], dict]] = {
    "torch": path_torch,
    "fp8": path_fp8,
    "transformers": path_transformers,
    "vllm-plain": lambda r, n: path_vllm("plain", r, n),
    "vllm-packed": lambda r, n: path_vllm("packed", r, n),
}


def print_table(rows: list[dict]) -> None:
    hdr = ("| path | elements | changed | delta B | mapped/transf. | shadow MiB | probe s | apply ms | "
           "apply+verify ms | dense reload ms | dense/apply |")
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in rows:
        print(
            f"| {r['path']} | {r['elements']:,} | {r['changed']:,} | {r['delta_bytes']:,} | "
            f"{r['mapped_tensors']}/{r['transforming_tensors']} | {r['shadow_bytes'] / 2**20:.2f} | "
            f"{r['probe_s']:.2f} | {r['apply_s'] * 1e3:.1f} | {r['apply_verify_s'] * 1e3:.1f} | "
            f"{r['dense_s'] * 1e3:.1f} | {r['speedup']:.1f}x |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of " + ",".join(PATHS))
    ap.add_argument("--rate", type=float, default=0.01, help="fraction of elements changed (default 0.01)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 repeats")
    ap.add_argument("--out", default=str(REPO / "bench-out" / "receivers.json"))
    ap.add_argument("--vllm-child", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    repeats = 2 if a.quick else a.repeats
    if a.vllm_child:
        print("ROW " + json.dumps(vllm_child(a.vllm_child, a.rate, repeats, a.work)))
        return 0
    rows, skipped = [], {}
    for name in a.paths.split(","):
        if name.startswith("vllm") and importlib.util.find_spec("vllm") is None and not os.environ.get("DCR_VLLM_PYTHON"):
            skipped[name] = "vLLM not installed"
            continue
        if name == "transformers" and importlib.util.find_spec("transformers") is None:
            skipped[name] = "transformers not installed"
            continue
        print(f"... {name}", file=sys.stderr, flush=True)
        rows.append(PATHS[name](a.rate, repeats))
    print_table(rows)
    for k, why in skipped.items():
        print(f"skipped {k}: {why}")
    out = {
        "schema": "dcr.bench.receivers/1",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "platform": platform.platform()},
        "rate": a.rate,
        "repeats": repeats,
        "rows": rows,
        "skipped": skipped,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
