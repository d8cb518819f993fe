"""Receivers on Hugging Face transformers models, placed through
transformers' own checkpoint conversion: Llama (names as in the checkpoint)
and Qwen3-MoE (experts fused in memory: 3-D gate_up_proj/down_proj built
from per-expert checkpoint tensors). Compared bit for bit, parameters and
buffers and logits, with a dense refit through the same loader."""

from __future__ import annotations

import pytest
import torch

import dcr

transformers = pytest.importorskip("transformers")

from dcr.receivers.torch_module import module_storage  # noqa: E402
from dcr.receivers.transformers import TransformersAdapter, canonical_state_dict, transformers_receiver  # noqa: E402


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )
        return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )
    return transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()


def step(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sd.items():
        n = v.clone()
        mask = torch.rand(v.shape, generator=g) < 0.03
        n[mask] = (n[mask].float() * 1.25 + 0.004).to(v.dtype)
        out[k] = n
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3moe"])
def test_transformers_delta_refit_equals_dense(kind: str) -> None:
    model, dense = tiny(kind), tiny(kind)
    v0 = canonical_state_dict(model)
    if kind == "qwen3moe":
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in v0
        assert "model.layers.0.mlp.experts.gate_up_proj" in module_storage(model)
    recv = transformers_receiver(model)
    assert recv.placement.transforming() == []
    if kind == "qwen3moe":
        tables = recv.placement.tensors["model.layers.0.mlp.experts.2.up_proj.weight"].tables
        assert [t.target for t in tables] == ["model.layers.0.mlp.experts.gate_up_proj"]
    x = torch.tensor([[1, 5, 9, 33, 2]])
    cur = v0
    for i in (1, 2):
        new = step(cur, i)
        # the first step context-free, the second context-coded (decoded
        # against the receiver's canonical base)
        mode = "free" if i == 1 else "context"
        delta, st = dcr.diff_tensors(cur, new, base_version=i - 1, target_version=i, mode=mode)
        assert (st["modes"]["context"] > 0) == (mode == "context")
        recv.apply(delta)
        TransformersAdapter(dense).load(new.items())
        a, b = module_storage(model), module_storage(dense)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(bits(a[k]), bits(b[k])), k
        with torch.no_grad():
            assert torch.equal(bits(model(x).logits), bits(dense(x).logits))
        assert recv.digest() == dcr.digest_tensors(new)
        cur = new
