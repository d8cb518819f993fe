"""Receivers on plain torch modules and state dicts: placement learned by
probing the loader, XOR/overwrite apply in place, transforming (FP8) modules
rebuilt through their own loader; everything compared bit for bit with a
dense refit of the same module."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import dcr
from dcr.receivers import Receiver, learn_placement
from dcr.receivers.placement import _runs_from_pairs
from dcr.receivers.torch_module import ModuleAdapter, module_receiver, module_storage, state_dict_receiver

FP8 = torch.float8_e4m3fn


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).cpu()


def assert_same_storage(a: torch.nn.Module, b: torch.nn.Module) -> int:
    sa, sb = module_storage(a), module_storage(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert torch.equal(bits(sa[k]), bits(sb[k])), f"{k} differs from the dense refit"
    return len(sa)


def perturb(sd: dict[str, torch.Tensor], seed: int, rate: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sd.items():
        n = v.clone()
        mask = torch.rand(v.shape, generator=g) < rate
        if v.dtype in (torch.int64, torch.int32, torch.uint8):
            n[mask] += 3
        elif v.dtype == FP8:
            n.view(torch.uint8)[mask] ^= 0x05
        else:
            n[mask] = (n[mask].float() * 1.5 + 0.01).to(v.dtype)
        out[k] = n
    return out


# ---------------------------------------------------------------- index maps


def test_runs_compress_affine_and_random() -> None:
    c = torch.arange(0, 1000, dtype=torch.int64)
    s = torch.cat([torch.arange(500) * 3 + 7, torch.arange(500) + 10_000])
    c0, n, s0, st = _runs_from_pairs(c, s)
    assert c0.numel() <= 3 and int(n.sum()) == 1000
    # expand and check
    got = torch.cat([s0[i] + torch.arange(n[i]) * st[i] for i in range(c0.numel())])
    assert torch.equal(got, s)
    r = torch.randperm(5000)[:300].sort().values
    rs = torch.randint(0, 1 << 30, (300,))
    c0, n, s0, st = _runs_from_pairs(r, rs)
    got_c = torch.cat([c0[i] + torch.arange(n[i]) for i in range(c0.numel())])
    got_s = torch.cat([s0[i] + torch.arange(n[i]) * st[i] for i in range(c0.numel())])
    assert torch.equal(got_c, r) and torch.equal(got_s, rs)


# ---------------------------------------------------------------- state dicts


def test_state_dict_every_dtype_bit_exact() -> None:
    torch.manual_seed(0)
    sd = {
        "bf16": torch.randn(33, 17).to(torch.bfloat16),
        "f16": torch.randn(40).to(torch.float16),
        "f32": torch.randn(8, 8),
        "f64": torch.randn(5, dtype=torch.float64),
        "i64": torch.arange(12, dtype=torch.int64),
        "i32": torch.arange(70_000, dtype=torch.int32),
        "u8": torch.arange(300, dtype=torch.int64).to(torch.uint8),
        "fp8": torch.randn(64, 16).to(FP8),
        "scalar": torch.tensor(2.5),
    }
    sd["f32"][0, 0] = float("nan")
    sd["f32"][0, 1] = -0.0
    live = {k: v.clone() for k, v in sd.items()}
    recv = state_dict_receiver(live)
    assert recv.placement.transforming() == []
    assert all(len(t.tables) == 1 and t.tables[0].runs == 1 for t in recv.placement.tensors.values())
    new = perturb(sd, 1)
    new["f32"][3, 3] = float("-nan")
    new["f16"][0] = -0.0
    delta, _ = dcr.diff_tensors(sd, new)
    recv.apply(delta)
    for k in sd:
        assert torch.equal(bits(live[k]), bits(new[k])), k


def test_overwrite_delta_and_refused_base() -> None:
    torch.manual_seed(1)
    sd = {"w": torch.randn(64, 64).to(torch.bfloat16), "b": torch.randn(64)}
    live = {k: v.clone() for k, v in sd.items()}
    recv = state_dict_receiver(live)
    v1 = perturb(sd, 2)
    v2 = perturb(v1, 3)
    d12, _ = dcr.diff_tensors(v1, v2, base_version=1, target_version=2)
    before = {k: v.clone() for k, v in live.items()}
    with pytest.raises(dcr.BaseMismatchError, match="needs base digest"):
        recv.apply(d12)
    assert all(torch.equal(bits(live[k]), bits(before[k])) for k in live)
    d01, _ = dcr.diff_tensors(sd, v1, kind="overwrite")
    recv.apply(d01)
    recv.apply(d12)
    assert all(torch.equal(bits(live[k]), bits(v2[k])) for k in live)
    assert recv.digest() == dcr.digest_tensors(v2)


# ---------------------------------------------------------------- fused/sliced loaders


class FusedAttention(torch.nn.Module):
    """A loader that fuses q/k/v into one parameter (k and v heads
    replicated twice, as vLLM does when TP > kv heads), stores o transposed
    and keeps a non-persistent cache the loader never writes."""

    def __init__(self, d: int = 32, kv: int = 8) -> None:
        super().__init__()
        self.d, self.kv = d, kv
        self.qkv = torch.nn.Parameter(torch.zeros(d + 4 * kv, d, dtype=torch.bfloat16), requires_grad=False)
        self.o_t = torch.nn.Parameter(torch.zeros(d, d, dtype=torch.bfloat16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.ones(d, dtype=torch.float32), requires_grad=False)
        self.register_buffer("rope", torch.randn(16, 4), persistent=False)

    def _load_from_state_dict(self, sd, prefix, meta, strict, missing, unexpected, errors):  # noqa: ANN001
        d, kv = self.d, self.kv
        with torch.no_grad():
            if prefix + "q.weight" in sd:
                self.qkv[:d].copy_(sd[prefix + "q.weight"])
            for i, name in enumerate(("k", "v")):
                if prefix + name + ".weight" in sd:
                    w = sd[prefix + name + ".weight"]
                    lo = d + 2 * kv * i
                    self.qkv[lo : lo + kv].copy_(w)
                    self.qkv[lo + kv : lo + 2 * kv].copy_(w)  # replica
            if prefix + "o.weight" in sd:
                self.o_t.copy_(sd[prefix + "o.weight"].t())
            if prefix + "norm" in sd:
                self.norm.copy_(sd[prefix + "norm"])


def fused_module(v0: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module holding a FusedAttention, loaded with `v0` through its loader."""
    m = torch.nn.Module()
    m.attn = FusedAttention()
    m.load_state_dict(v0, strict=False)
    return m


def fused_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "attn.q.weight": r(32, 32).to(torch.bfloat16),
        "attn.k.weight": r(8, 32).to(torch.bfloat16),
        "attn.v.weight": r(8, 32).to(torch.bfloat16),
        "attn.o.weight": r(32, 32).to(torch.bfloat16),
        "attn.norm": r(32),
    }


def test_fused_sliced_replicated_loader_bit_exact() -> None:
    v0 = fused_checkpoint(0)
    m = fused_module(v0)
    dense = copy.deepcopy(m)
    rope = m.attn.rope.clone()
    recv = module_receiver(m, v0)
    assert torch.equal(m.attn.rope, rope), "probing must leave storage the loader never writes as it was"
    p = recv.placement.tensors
    assert recv.placement.transforming() == []
    assert [tb.target for tb in p["attn.k.weight"].tables] == ["attn.qkv", "attn.qkv"]  # replicated
    assert p["attn.q.weight"].tables[0].runs == 1
    assert p["attn.o.weight"].tables[0].runs == 32  # transposed: one run per column
    assert p["attn.q.weight"].group == p["attn.k.weight"].group == p["attn.v.weight"].group
    v1 = perturb(v0, 5)
    delta, _ = dcr.diff_tensors(v0, v1)
    recv.apply(delta)
    dense.load_state_dict(v1, strict=False)
    assert assert_same_storage(m, dense) == 4


# ---------------------------------------------------------------- FP8 receivers


def quantize_fp8(w: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch FP8 (e4m3) quantization with a per-tensor or per-block scale."""
    w = w.float()
    fmax = torch.finfo(FP8).max
    if block is None:
        scale = w.abs().amax().clamp(min=1e-12) / fmax
        return (w / scale).clamp(-fmax, fmax).to(FP8), scale.reshape(())
    o, i = w.shape
    blocks = w.reshape(o // block, block, i // block, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / fmax
    q = (blocks / scale[:, None, :, None]).clamp(-fmax, fmax).to(FP8).reshape(o, i)
    return q, scale


class FP8Linear(torch.nn.Module):
    """Loads a bf16 checkpoint weight and stores it quantized (transforming)."""

    def __init__(self, out_f: int, in_f: int, block: int | None) -> None:
        super().__init__()
        self.block = block
        self.weight = torch.nn.Parameter(torch.zeros(out_f, in_f, dtype=FP8), requires_grad=False)
        shape = () if block is None else (out_f // block, in_f // block)
        self.weight_scale = torch.nn.Parameter(torch.ones(shape), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(out_f, dtype=torch.bfloat16), requires_grad=False)

    def _load_from_state_dict(self, sd, prefix, meta, strict, missing, unexpected, errors):  # noqa: ANN001
        with torch.no_grad():
            if prefix + "weight" in sd:
                q, s = quantize_fp8(sd[prefix + "weight"], self.block)
                self.weight.copy_(q)
                self.weight_scale.copy_(s)
            if prefix + "bias" in sd:
                self.bias.copy_(sd[prefix + "bias"])


def fp8_model() -> torch.nn.Module:
    m = torch.nn.Module()
    m.per_tensor = FP8Linear(64, 32, None)
    m.per_block = FP8Linear(64, 32, 16)
    m.norm = torch.nn.LayerNorm(32, dtype=torch.bfloat16)
    return m


def fp8_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "per_tensor.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "per_tensor.bias": torch.randn(64, generator=g).to(torch.bfloat16),
        "per_block.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "per_block.bias": torch.randn(64, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(32, generator=g).to(torch.bfloat16),
        "norm.bias": torch.randn(32, generator=g).to(torch.bfloat16),
    }


def test_fp8_quantizing_loader_is_transforming_and_exact() -> None:
    m = fp8_model()
    v0 = fp8_checkpoint(0)
    m.load_state_dict(v0)
    dense = copy.deepcopy(m)
    recv = module_receiver(m, v0)
    assert sorted(recv.placement.transforming()) == [
        "per_block.bias", "per_block.weight", "per_tensor.bias", "per_tensor.weight"
    ]
    assert "quantize" not in recv.placement.tensors["per_tensor.weight"].reason  # reason names storage
    assert recv.shadow_bytes == 2 * (64 * 32 + 64) * 2
    assert_same_storage(m, dense)  # probing restored the real weights
    cur = v0
    for seed in (1, 2):
        new = perturb(cur, seed)
        delta, _ = dcr.diff_tensors(cur, new, base_version=seed - 1, target_version=seed)
        st = recv.apply(delta)
        assert st["reloaded_groups"] == 2 and st["mapped_changes"] > 0
        dense.load_state_dict(new)
        assert_same_storage(m, dense)  # fp8 weights and scales included
        cur = new


def test_fp8_checkpoint_with_scales_is_bit_preserving() -> None:
    """An FP8 checkpoint (weights + scale_inv, DeepSeek style) copied as is:
    1-byte probes, placed and XOR-applied like any other tensor."""
    m = torch.nn.Module()
    m.lin = torch.nn.Module()
    m.lin.weight = torch.nn.Parameter(torch.zeros(128, 64, dtype=FP8), requires_grad=False)
    m.lin.weight_scale_inv = torch.nn.Parameter(torch.zeros(1, 1), requires_grad=False)
    g = torch.Generator().manual_seed(0)
    v0 = {"lin.weight": torch.randn(128, 64, generator=g).to(FP8), "lin.weight_scale_inv": torch.rand(1, 1, generator=g)}
    m.load_state_dict(v0)
    recv = module_receiver(m)
    assert recv.placement.transforming() == []
    dense = copy.deepcopy(m)
    v1 = perturb(v0, 4)
    delta, _ = dcr.diff_tensors(v0, v1)
    assert recv.apply(delta)["reloaded_groups"] == 0
    dense.load_state_dict(v1)
    assert_same_storage(m, dense)


def test_learn_placement_without_restore_reports_layout() -> None:
    m = torch.nn.Linear(8, 4).to(torch.bfloat16)
    base = {k: v.clone() for k, v in m.state_dict().items()}
    pl = learn_placement(ModuleAdapter(m), base)
    s = pl.summary()
    assert s["mapped"] == 2 and s["transforming"] == 0 and s["mapped_elements"] == 36
    Receiver(ModuleAdapter(m), base, placement=pl)  # a stored placement is reused without probing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_module_mapped_apply() -> None:
    v0 = fused_checkpoint(0)
    m = fused_module(v0)
    m.cuda()
    dense = copy.deepcopy(m)
    recv = module_receiver(m, v0)
    v1 = perturb(v0, 7)
    delta, _ = dcr.diff_tensors(v0, v1)
    recv.apply(delta)
    dense.load_state_dict(v1, strict=False)
    assert all(t.device.type == "cuda" for t in module_storage(m).values())
    assert_same_storage(m, dense)


class RankShard(torch.nn.Module):
    """Rank 1 of a 2-way tensor-parallel column split: keeps rows [n/2, n)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(16, 8, dtype=torch.bfloat16), requires_grad=False)

    def _load_from_state_dict(self, sd, prefix, meta, strict, missing, unexpected, errors):  # noqa: ANN001
        if prefix + "weight" in sd:
            with torch.no_grad():
                self.weight.copy_(sd[prefix + "weight"].narrow(0, 16, 16))


def test_tensor_parallel_narrowing_with_allow_unplaced() -> None:
    m = torch.nn.Module()
    m.proj = RankShard()
    v0 = {"proj.weight": torch.randn(32, 8).to(torch.bfloat16)}
    m.load_state_dict(v0, strict=False)
    # by default an element that lands nowhere is taken as transformed
    strict = module_receiver(copy.deepcopy(m), v0)
    assert strict.placement.transforming() == ["proj.weight"]
    recv = module_receiver(m, v0, allow_unplaced=True)
    tp = recv.placement.tensors["proj.weight"]
    assert not tp.transforming and tp.tables[0].elements == 128 and tp.tables[0].runs == 1
    dense = copy.deepcopy(m)
    v1 = perturb(v0, 9, rate=0.3)
    delta, _ = dcr.diff_tensors(v0, v1)
    recv.apply(delta, verify=False)  # this rank cannot hold the whole checkpoint's digest
    dense.load_state_dict(v1, strict=False)
    assert_same_storage(m, dense)
    with pytest.raises(dcr.LayoutMismatchError, match="tensor-parallel shard"):
        recv.digest()


class DerivedLoader(torch.nn.Module):
    """Loaders that keep the dtype but compute (``A = -exp(A_log)``) or cast
    (bf16 checkpoint -> fp32 parameter): both must come out transforming."""

    def __init__(self) -> None:
        super().__init__()
        self.A = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16), requires_grad=False)
        self.w32 = torch.nn.Parameter(torch.zeros(16, 16), requires_grad=False)
        self.plain = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16), requires_grad=False)

    def _load_from_state_dict(self, sd, prefix, meta, strict, missing, unexpected, errors):  # noqa: ANN001
        with torch.no_grad():
            if prefix + "A_log" in sd:
                self.A.copy_(-torch.exp(sd[prefix + "A_log"].float()))
            if prefix + "w" in sd:
                self.w32.copy_(sd[prefix + "w"])
            if prefix + "plain" in sd:
                self.plain.copy_(sd[prefix + "plain"])


def test_computing_and_casting_loaders_are_transforming() -> None:
    m = torch.nn.Module()
    m.mix = DerivedLoader()
    g = torch.Generator().manual_seed(0)
    v0 = {
        "mix.A_log": torch.randn(64, generator=g).to(torch.bfloat16),
        "mix.w": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "mix.plain": torch.randn(8, generator=g).to(torch.bfloat16),
    }
    m.load_state_dict(v0, strict=False)
    dense = copy.deepcopy(m)
    recv = module_receiver(m, v0)
    # one module, one group: the plain tensor rides along with its module's transforming siblings
    assert sorted(recv.placement.transforming()) == ["mix.A_log", "mix.plain", "mix.w"]
    assert "computed" in recv.placement.tensors["mix.A_log"].reason
    v1 = perturb(v0, 11, rate=0.2)
    delta, _ = dcr.diff_tensors(v0, v1)
    recv.apply(delta)
    dense.load_state_dict(v1, strict=False)
    assert_same_storage(m, dense)


@pytest.mark.parametrize("kind", ["xor", "overwrite"])
@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.uint8, torch.int64])
def test_device_scatter_matches_numpy(kind, dtype):
    """Receivers scatter into GPU storage through the dcr CUDA apply kernels;
    their reference path (the CPU twin) gives the numpy result."""
    from dcr.receivers.placement import scatter_on_device

    rng = np.random.default_rng(5)
    info = np.iinfo(torch.empty(0, dtype=dtype).numpy().dtype)
    base = rng.integers(info.min, info.max, size=(64, 33), dtype=torch.empty(0, dtype=dtype).numpy().dtype)
    offs = np.sort(rng.choice(base.size, size=300, replace=False)).astype(np.int64)
    vals = rng.integers(info.min, info.max, size=300, dtype=base.dtype)
    want = base.copy().reshape(-1)
    if kind == "xor":
        want[offs] ^= vals
    else:
        want[offs] = vals
    got = torch.from_numpy(base.copy())
    scatter_on_device(got, offs, vals, kind, impl="cpu")
    assert np.array_equal(got.numpy().reshape(-1), want)


# ---------------------------------------------------------------- context-coded deltas


def nudge(sd: dict[str, torch.Tensor], seed: int, rate: float = 0.05) -> dict[str, torch.Tensor]:
    """A training-like step: a few elements move by one to three
    representable values (the regime the context mode codes best)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sd.items():
        n = v.clone()
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[v.element_size()]
        flat = n.view(view).reshape(-1)
        mask = torch.rand(flat.shape, generator=g) < rate
        step = torch.randint(1, 4, flat.shape, generator=g).to(view)
        flat[mask] += step[mask]  # one to three steps away in the magnitude's bit pattern
        out[k] = n
    return out


def test_context_deltas_apply_through_the_loader_bit_exact() -> None:
    # mapped tensors (fused, sliced, replicated, transposed) and transforming
    # ones (FP8 quantizing loader, rebuilt from the shadow)
    v0 = fused_checkpoint(0)
    m = fused_module(v0)
    dense = copy.deepcopy(m)
    recv = module_receiver(m, v0)
    f = fp8_model()
    w0 = fp8_checkpoint(0)
    f.load_state_dict(w0)
    fdense = copy.deepcopy(f)
    frecv = module_receiver(f, w0)
    for step in (1, 2):
        v1, w1 = nudge(v0, step), nudge(w0, 10 + step)
        delta, st = dcr.diff_tensors(v0, v1, mode="context", base_version=step - 1, target_version=step)
        fdelta, fst = dcr.diff_tensors(w0, w1, mode="context", base_version=step - 1, target_version=step)
        assert st["modes"]["context"] > 0 and fst["modes"]["context"] > 0
        # without the base, a context-coded chunk cannot be decoded
        with pytest.raises(ValueError, match="context-coded.*base="):
            dcr._core.decode_delta(delta)
        recv.apply(delta)
        dense.load_state_dict(v1, strict=False)
        assert_same_storage(m, dense)
        assert frecv.apply(fdelta)["reloaded_groups"] == 2
        fdense.load_state_dict(w1)
        assert_same_storage(f, fdense)
        v0, w0 = v1, w1
    assert recv.digest() == dcr.digest_tensors(v0)


def test_context_delta_on_a_wrong_base_is_refused_before_decoding() -> None:
    torch.manual_seed(3)
    sd = {"w": torch.randn(128, 64).to(torch.bfloat16)}
    live = {k: v.clone() for k, v in sd.items()}
    recv = state_dict_receiver(live)
    v1 = nudge(sd, 4)
    v2 = nudge(v1, 5)
    d12, st = dcr.diff_tensors(v1, v2, mode="context", base_version=1, target_version=2)
    assert st["modes"]["context"] > 0
    before = live["w"].clone()
    with pytest.raises(dcr.BaseMismatchError, match="needs base digest"):
        recv.apply(d12)
    assert torch.equal(bits(live["w"]), bits(before))


def test_context_delta_on_a_tensor_parallel_shard_asks_for_free_mode() -> None:
    m = torch.nn.Module()
    m.proj = RankShard()
    v0 = {"proj.weight": torch.randn(32, 8).to(torch.bfloat16)}
    m.load_state_dict(v0, strict=False)
    recv = module_receiver(m, v0, allow_unplaced=True)
    v1 = nudge(v0, 9, rate=0.3)
    delta, st = dcr.diff_tensors(v0, v1, mode="context")
    assert st["modes"]["context"] > 0
    before = {k: v.clone() for k, v in module_storage(m).items()}
    with pytest.raises(dcr.LayoutMismatchError, match="mode='free'"):
        recv.apply(delta, verify=False)
    assert all(torch.equal(bits(v), bits(before[k])) for k, v in module_storage(m).items())
    dense = copy.deepcopy(m)
    dense.load_state_dict(v1, strict=False)
    free, _ = dcr.diff_tensors(v0, v1, mode="free")
    recv.apply(free, verify=False)
    assert_same_storage(m, dense)
