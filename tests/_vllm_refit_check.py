"""One vLLM (CPU) refit scenario, run in its own process by
test_receivers_vllm.py (vLLM owns process-global state and emits warnings
at import that the suite's ``filterwarnings = error`` would turn fatal).

    python tests/_vllm_refit_check.py {llama|qwen3moe} {packed|plain} WORKDIR

Builds a tiny model with random bf16 weights, starts an in-process engine,
learns placement through its loader, applies two chained deltas, and after
each compares every parameter and buffer, and greedy generations, with a
dense refit (``reload_weights`` with the full new checkpoint) of the same
engine. Prints one JSON line."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402


def build(kind: str, path: str) -> None:
    torch.manual_seed(0)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
            tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(cfg)
    else:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(
            vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            num_experts=4, num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False,
        )
        model = Qwen3MoeForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path)


def step(old: dict[str, torch.Tensor], seed: int, rate: float = 0.03) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    new = {}
    for k, v in old.items():
        n = v.clone()
        mask = torch.rand(v.shape, generator=g) < rate
        n[mask] = (n[mask].float() * 1.25 + 0.004).to(v.dtype)
        new[k] = n
    return new


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()


def main() -> None:
    kind, layout, work = sys.argv[1], sys.argv[2], sys.argv[3]
    path = os.path.join(work, kind)
    build(kind, path)

    import dcr
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from dcr.receivers.vllm import VllmAdapter, checkpoint_state_dict, live_model, plain_cpu_layout, vllm_receiver

    plain = layout == "plain"
    with plain_cpu_layout() if plain else contextlib.nullcontext():
        llm = LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                  max_model_len=128, seed=0)
    # The linears whose GEMM vLLM's CPU dispatch bound to a repacked copy
    # of the weight (a closure over it), looked at on the engine itself
    # before dcr probes it: vLLM repacks only where its CPU kernels run
    # (oneDNN or its own packed GEMM), and keeps plain `F.linear` elsewhere.
    repacked = sorted(
        name for name, module in live_model(llm).named_modules()
        if getattr(getattr(module, "cpu_linear", None), "__closure__", None)
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in ([1, 2, 3, 4], [7, 9, 11], [200, 5, 17, 33, 2])]
    sp = SamplingParams(temperature=0, max_tokens=8)

    def gen() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]

    def state() -> dict[str, torch.Tensor]:
        m = live_model(llm)
        out = {"P:" + k: bits(v) for k, v in m.named_parameters(remove_duplicate=False)}
        out |= {"B:" + k: bits(v) for k, v in m.named_buffers(remove_duplicate=False)}
        return out

    v0 = checkpoint_state_dict(path)
    g_start = gen()
    t = time.perf_counter()
    recv = vllm_receiver(llm, plain_layout=plain)
    probe_s = time.perf_counter() - t
    res = {
        "kind": kind,
        "layout": layout,
        "placement": recv.placement.summary(),
        "repacked": repacked,
        "transforming": sorted(recv.placement.transforming()),
        "shadow_bytes": recv.shadow_bytes,
        "probe_s": probe_s,
        "gen_restored": gen() == g_start,
        "steps": [],
    }
    dense = VllmAdapter(llm, plain_layout=plain)
    dense._trace = None
    cur = v0
    for i in (1, 2):
        new = step(cur, seed=i)
        # the first step context-free, the second context-coded (decoded
        # against the receiver's canonical base)
        mode = "free" if i == 1 else "context"
        delta, dst = dcr.diff_tensors(cur, new, base_version=i - 1, target_version=i, mode=mode)
        st = recv.apply(delta, verify=True)
        s_delta, g_delta = state(), gen()
        dense.load(new.items())  # the dense refit of the same engine
        s_dense, g_dense = state(), gen()
        mismatched = sorted(k for k in s_dense if k not in s_delta or not torch.equal(s_delta[k], s_dense[k]))
        res["steps"].append({
            "stats": st,
            "mode": mode,
            "context_chunks": dst["modes"]["context"] > 0,
            "mismatched": mismatched,
            "compared": len(s_dense),
            "gen_delta": g_delta,
            "gen_dense": g_dense,
            "gen_equal": g_delta == g_dense,
            "gen_changed": g_delta != g_start,
        })
        cur = new
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
