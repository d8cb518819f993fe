"""Placement maps from trainer shards to canonical checkpoint coordinates
(dcr.trainer.layouts): Megatron-style builders against reference shardings
written here from Megatron's layout, DTensor/FSDP2 on real gloo process
groups, transformers' fused MoE against what save_pretrained writes."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from dcr.trainer import layouts as L
from dcr.trainer import (
    CanonicalTensor,
    LocalPlacement,
    Piece,
    Placements,
    column_parallel,
    dtensor_placement,
    fused_qkv,
    gated_fc1,
    module_placements,
    project,
    replicated,
    row_parallel,
    stacked_experts,
    transformers_placements,
    vocab_padded_size,
    vocab_parallel,
)

# ---------------------------------------------------------------- helpers


def bits(a: np.ndarray) -> np.ndarray:
    """Random float32 tensors compared as their stored bits."""
    return np.ascontiguousarray(a).view(np.uint32)


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def assemble(ranks: list[tuple[Placements, dict[str, np.ndarray]]]) -> tuple[dict[str, np.ndarray], dict]:
    """Scatter every rank's local values through its pieces (project() over
    all local indices) into canonical buffers; count writes per element."""
    canon: dict[str, CanonicalTensor] = {}
    for pl, _ in ranks:
        pl.validate()
        canon.update(pl.canonical)
    buf = {n: np.zeros(c.numel, dtype=np.uint32) for n, c in canon.items()}
    cnt = {n: np.zeros(c.numel, dtype=np.int64) for n, c in canon.items()}
    for pl, values in ranks:
        for lp in pl.local:
            local = bits(values[lp.local_name]).reshape(-1)
            assert local.size == lp.local_numel, lp.local_name
            names, flat, keep = project(lp, np.arange(local.size), return_mask=True)
            vals = local[keep]
            for i, n in enumerate(lp.canonical_names):
                sel = names == i
                buf[n][flat[sel]] = vals[sel]
                np.add.at(cnt[n], flat[sel], 1)
    return {n: buf[n].reshape(canon[n].shape) for n in buf}, cnt


def assert_exact(ranks, full: dict[str, np.ndarray]) -> None:
    got, cnt = assemble(ranks)
    assert set(got) == set(full)
    for n, ref in full.items():
        assert (cnt[n] == 1).all(), f"{n}: elements written {np.bincount(cnt[n])} times (0,1,2,...)"
        np.testing.assert_array_equal(got[n], bits(ref).reshape(ref.shape), err_msg=n)


def one(built) -> Placements:
    return Placements().add(*built)


# ---------------------------------------------------------------- core: project / validate / compress


def test_project_maps_pieces_and_drops_uncovered_indices():
    lp = LocalPlacement("x", (4, 6), (
        Piece("a", 2, (3, 2), 100, (10, 1)),   # local 2..7 -> a[100,101,110,111,120,121]
        Piece("b", 12, (5,), 7, (3,)),         # local 12..16 -> b[7,10,13,16,19]
    ))
    Placements(canonical={"a": CanonicalTensor("a", (200,), torch.float32),
                          "b": CanonicalTensor("b", (20,), torch.float32)}, local=[lp]).validate()
    idx = np.array([0, 2, 3, 4, 7, 8, 11, 12, 16, 17, 23, 5], dtype=np.int64)
    names, flat, keep = project(lp, idx, return_mask=True)
    assert lp.canonical_names == ("a", "b")
    np.testing.assert_array_equal(keep, [0, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0, 1])
    np.testing.assert_array_equal(names, [0, 0, 0, 0, 1, 1, 0])
    np.testing.assert_array_equal(flat, [100, 101, 110, 121, 7, 19, 111])
    e_names, e_flat = project(LocalPlacement("y", (3,), ()), idx)
    assert e_names.size == e_flat.size == 0


@pytest.mark.parametrize("piece, msg", [
    (Piece("a", 20, (5,), 0, (1,)), "outside the local tensor"),
    (Piece("a", 3, (5,), 0, (1,)), "overlaps"),
    (Piece("a", 10, (2, 3), 5, (4, 1)), "outside a"),
    (Piece("zz", 10, (2,), 0, (1,)), "not declared"),
    (Piece("a", 10, (2,), 0, (0,)), "positive"),
])
def test_validate_rejects_bad_pieces(piece, msg):
    pl = Placements(canonical={"a": CanonicalTensor("a", (8,), torch.float32)},
                    local=[LocalPlacement("x", (24,), (Piece("a", 0, (8,), 0, (1,)), piece))])
    with pytest.raises(ValueError, match=msg):
        pl.validate()


def _check_compress(cid: np.ndarray, cflat: np.ndarray, names: list[str]) -> tuple[Piece, ...]:
    pieces = L._compress(cid, cflat, names)
    lp = LocalPlacement("x", (cid.size,), pieces)
    got_n, got_f, keep = project(lp, np.arange(cid.size), return_mask=True)
    np.testing.assert_array_equal(keep, cid >= 0)
    np.testing.assert_array_equal(np.array(lp.canonical_names)[got_n], np.array(names)[cid[cid >= 0]])
    np.testing.assert_array_equal(got_f, cflat[cid >= 0])
    return pieces


def test_compress_transposed_stack_gives_one_piece_per_row_block():
    # local [E, H, 2F] holding canonical gate_e/up_e [F, H]: local (e, h, k*F+f) -> (e,k)[f*H + h]
    E, H, F = 3, 5, 4
    e, h, kf = np.meshgrid(np.arange(E), np.arange(H), np.arange(2 * F), indexing="ij")
    k, f = kf // F, kf % F
    pieces = _check_compress((e * 2 + k).reshape(-1), (f * H + h).reshape(-1), [f"t{i}" for i in range(2 * E)])
    assert len(pieces) == E * H * 2  # one per local row of F elements: local runs are contiguous
    # a single projection transposes into one 2-D piece per expert
    e, h, f = np.meshgrid(np.arange(E), np.arange(H), np.arange(F), indexing="ij")
    pieces = _check_compress(e.reshape(-1), (f * H + h).reshape(-1), ["a", "b", "c"])
    assert [p.shape for p in pieces] == [(H, F)] * E


@pytest.mark.parametrize("seed", range(4))
def test_compress_is_exact_on_arbitrary_maps(seed):
    rng = np.random.default_rng(seed)
    n = 500
    cid = rng.integers(-1, 3, size=n)
    cid = np.sort(cid) if seed % 2 else cid  # long runs or chaos
    cflat = np.full(n, -1)
    for c in range(3):
        m = cid == c
        cflat[m] = rng.permutation(1000)[: m.sum()] if seed < 2 else np.arange(m.sum()) * (c + 1)
    _check_compress(cid, cflat, ["a", "b", "c"])


# ---------------------------------------------------------------- Megatron-style builders


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_and_row_parallel(rng, tp):
    W, b = rand(rng, 8, 12), rand(rng, 8)
    ranks = []
    for r in range(tp):
        pl = Placements()
        pl.add(*column_parallel("fc.weight", "m.up.weight", W.shape, r, tp, dtype=torch.float32))
        pl.add(*column_parallel("fc.bias", "m.up.bias", b.shape, r, tp, dtype=torch.float32))
        pl.add(*row_parallel("proj.weight", "m.down.weight", W.shape, r, tp, dtype=torch.float32))
        pl.add(*replicated("proj.bias", "m.down.bias", b.shape, owner=r == 0, dtype=torch.float32))
        assert all(len(lp.pieces) == (lp.local_name != "proj.bias" or r == 0) for lp in pl.local)
        rows, cols = np.split(W, tp, axis=0)[r], np.split(W, tp, axis=1)[r]
        ranks.append((pl, {"fc.weight": rows, "fc.bias": np.split(b, tp)[r],
                           "proj.weight": cols, "proj.bias": b}))
    assert_exact(ranks, {"m.up.weight": W, "m.up.bias": b, "m.down.weight": W, "m.down.bias": b})


def megatron_qkv(q, k, v, ng, tp):
    """Megatron's linear_qkv: per KV group g the rows [q heads of g, k_g, v_g],
    groups in order, then split evenly over tensor-parallel ranks."""
    tail = q.shape[1:]
    qg = q.reshape(ng, -1, *tail)
    kg = k.reshape(ng, -1, *tail)
    vg = v.reshape(ng, -1, *tail)
    fused = np.concatenate([qg, kg, vg], axis=1).reshape(-1, *tail)
    return np.split(fused, tp, axis=0)


@pytest.mark.parametrize("nh, ng, tp", [(8, 4, 2), (8, 2, 2), (8, 8, 4), (6, 2, 1), (12, 4, 4)])
def test_fused_qkv(rng, nh, ng, tp):
    hd, H = 3, 5
    q, k, v = rand(rng, nh * hd, H), rand(rng, ng * hd, H), rand(rng, ng * hd, H)
    qb, kb, vb = rand(rng, nh * hd), rand(rng, ng * hd), rand(rng, ng * hd)
    w_loc, b_loc = megatron_qkv(q, k, v, ng, tp), megatron_qkv(qb, kb, vb, ng, tp)
    ranks = []
    for r in range(tp):
        pl = Placements()
        kw = dict(num_heads=nh, num_kv_heads=ng, head_dim=hd, tp_rank=r, tp_size=tp, dtype=torch.float32)
        pl.add(*fused_qkv("qkv.w", "q.weight", "k.weight", "v.weight", hidden_size=H, **kw))
        pl.add(*fused_qkv("qkv.b", "q.bias", "k.bias", "v.bias", hidden_size=None, **kw))
        assert len(pl.local[0].pieces) == 3 * ng // tp
        ranks.append((pl, {"qkv.w": w_loc[r], "qkv.b": b_loc[r]}))
    assert_exact(ranks, {"q.weight": q, "k.weight": k, "v.weight": v, "q.bias": qb, "k.bias": kb, "v.bias": vb})


def test_fused_qkv_refuses_more_ranks_than_kv_heads():
    with pytest.raises(ValueError, match="num_kv_heads 2 must be a multiple of tp_size 4"):
        fused_qkv("qkv", "q", "k", "v", num_heads=8, num_kv_heads=2, head_dim=4, hidden_size=8,
                  tp_rank=0, tp_size=4)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_gated_fc1(rng, tp):
    F, H = 6, 4
    gate, up, gb, ub = rand(rng, F, H), rand(rng, F, H), rand(rng, F), rand(rng, F)
    ranks = []
    for r in range(tp):
        pl = Placements()
        pl.add(*gated_fc1("fc1.w", "gate.weight", "up.weight", (F, H), r, tp, dtype=torch.float32))
        pl.add(*gated_fc1("fc1.b", "gate.bias", "up.bias", (F,), r, tp, dtype=torch.float32))
        local_w = np.concatenate([np.split(gate, tp)[r], np.split(up, tp)[r]])  # [gate_shard; up_shard]
        local_b = np.concatenate([np.split(gb, tp)[r], np.split(ub, tp)[r]])
        ranks.append((pl, {"fc1.w": local_w, "fc1.b": local_b}))
    assert_exact(ranks, {"gate.weight": gate, "up.weight": up, "gate.bias": gb, "up.bias": ub})


@pytest.mark.parametrize("V, tp, div", [(1000, 4, 128), (50, 2, 8), (10, 4, 8), (64, 2, 32)])
def test_vocab_parallel_never_exports_padding(rng, V, tp, div):
    H = 3
    padded = vocab_padded_size(V, tp, div)
    assert padded % (div * tp) == 0 and padded - V < div * tp
    E = rand(rng, V, H)
    table = np.concatenate([E, np.full((padded - V, H), np.nan, dtype=np.float32)])  # padding rows
    ranks, exported = [], 0
    for r in range(tp):
        pl = one(vocab_parallel("embedding.word_embeddings.weight", "model.embed_tokens.weight", V, H, r, tp,
                                divisible_by=div, dtype=torch.float32))
        lp = pl.local[0]
        assert lp.local_shape == (padded // tp, H) and len(lp.pieces) <= 1
        exported += sum(p.numel for p in lp.pieces)
        ranks.append((pl, {lp.local_name: np.split(table, tp)[r]}))
    assert exported == V * H
    assert_exact(ranks, {"model.embed_tokens.weight": E})


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_stacked_experts(rng, ep):
    E, F, H = 8, 3, 4
    tmpl = "model.layers.0.mlp.experts.{e}.{proj}.weight"
    gate = [rand(rng, F, H) for _ in range(E)]
    up = [rand(rng, F, H) for _ in range(E)]
    down = [rand(rng, H, F) for _ in range(E)]
    el = E // ep
    ranks = []
    for r in range(ep):
        mine = range(r * el, (r + 1) * el)
        kw = dict(num_experts=E, ep_rank=r, ep_size=ep, dtype=torch.float32)
        pl = Placements()
        # transformers-style fused storage: gate_up [E, 2F, H], down [E, H, F]
        pl.add(*stacked_experts("gate_up", tmpl, ("gate_proj", "up_proj"), out_features=F, in_features=H, **kw))
        pl.add(*stacked_experts("down", tmpl, ("down_proj",), out_features=H, in_features=F, **kw))
        # Megatron GroupedMLP: weight1 viewed [E, H, 2F] (glu halves on the last dim), weight2 viewed [E, F, H]
        t = "mg." + tmpl
        pl.add(*stacked_experts("weight1", t, ("gate_proj", "up_proj"), out_features=F, in_features=H,
                                transposed=True, local_shape=(H, el * 2 * F), **kw))
        pl.add(*stacked_experts("weight2", t, ("down_proj",), out_features=H, in_features=F, transposed=True, **kw))
        n = {lp.local_name: len(lp.pieces) for lp in pl.local}
        assert n == {"gate_up": 2 * el, "down": el, "weight1": 2 * el * H, "weight2": el}
        ranks.append((pl, {
            "gate_up": np.stack([np.concatenate([gate[e], up[e]]) for e in mine]),
            "down": np.stack([down[e] for e in mine]),
            "weight1": np.stack([np.concatenate([gate[e].T, up[e].T], axis=1) for e in mine]).reshape(H, -1),
            "weight2": np.stack([down[e].T for e in mine]),
        }))
    full = {}
    for pre in ("", "mg."):
        for e in range(E):
            for proj, w in (("gate_proj", gate[e]), ("up_proj", up[e]), ("down_proj", down[e])):
                full[pre + tmpl.format(e=e, proj=proj)] = w
    assert_exact(ranks, full)


def test_builders_check_their_arguments():
    with pytest.raises(ValueError, match="split evenly"):
        column_parallel("w", "c", (10, 4), 0, 3)
    with pytest.raises(ValueError, match="tp_rank 2 outside"):
        row_parallel("w", "c", (4, 4), 2, 2)
    with pytest.raises(ValueError, match="num_experts = 6 must split evenly over 4"):
        stacked_experts("w", "{e}.{proj}", ("a",), num_experts=6, out_features=2, in_features=2, ep_rank=0,
                        ep_size=4)
    pl = one(column_parallel("w", "c", (4, 4), 0, 2))
    with pytest.raises(ValueError, match="builders disagree"):
        pl.add(*column_parallel("w2", "c", (4, 8), 0, 2))


# ---------------------------------------------------------------- DTensor / FSDP2 on gloo


def _cases(world: int):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if world == 2:
        return [
            ("s0", (2,), [Shard(0)], (6, 4)),
            ("s1", (2,), [Shard(1)], (3, 6)),
            ("s0_uneven", (2,), [Shard(0)], (5, 3)),
            ("s1_uneven", (2,), [Shard(1)], (4, 7)),
            ("rep", (2,), [Replicate()], (4, 3)),
            ("vec", (2,), [Shard(0)], (7,)),
            ("scalar", (2,), [Replicate()], ()),
        ]
    return [
        ("s0_empty_rank", (4,), [Shard(0)], (3, 5)),
        ("s1_4", (4,), [Shard(1)], (2, 9)),
        ("mesh_s0_s1", (2, 2), [Shard(0), Shard(1)], (6, 4)),
        ("mesh_s0_rep", (2, 2), [Shard(0), Replicate()], (5, 3)),
        ("mesh_rep_s1", (2, 2), [Replicate(), Shard(1)], (4, 6)),
        ("mesh_s1_s1_uneven", (2, 2), [Shard(1), Shard(1)], (3, 10)),
        ("mesh_3d", (2, 2), [Shard(1), Shard(0)], (4, 6, 2)),
        ("mesh_strided", (2, 2), [_StridedShard(0, split_factor=2), Shard(0)], (8, 3)),
        ("mesh_strided_cols", (2, 2), [_StridedShard(1, split_factor=2), Shard(1)], (3, 8)),
    ]


def _dtensor_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        for i, (name, mesh_shape, placements, shape) in enumerate(_cases(world)):
            mesh = init_device_mesh("cpu", mesh_shape)
            full = torch.randn(shape, generator=torch.Generator().manual_seed(i))
            dt = distribute_tensor(full, mesh, placements)
            lp, c = dtensor_placement(f"local.{name}", dt, canonical_name=name)
            assert c == CanonicalTensor(name, shape, torch.float32)
            results[name] = (lp, dt.to_local(), dt.full_tensor())
        # FSDP2: fully_shard a small module (uneven dim-0 shards), plus a plain buffer
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 6))
        model.register_buffer("scale", torch.arange(4.0))
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        pl = module_placements(model)
        for k, t in model.state_dict().items():
            lp = pl.by_local_name()[k]
            local = t.to_local() if hasattr(t, "to_local") else t
            results["fsdp." + k] = (lp, local, t.full_tensor() if hasattr(t, "full_tensor") else t)
            assert pl.canonical[k].shape == tuple(t.shape)
        saved = {}
        for name, (lp, local, full) in results.items():
            flat = local.contiguous().reshape(-1).numpy()
            idx, cflat, keep = project(lp, np.arange(flat.size), return_mask=True)
            assert set(idx.tolist()) <= {0}
            saved[f"{name}|flat"] = cflat
            saved[f"{name}|vals"] = flat[keep]
            saved[f"{name}|npieces"] = np.array([len(lp.pieces)])
            if rank == 0:
                saved[f"{name}|full"] = full.numpy()
        np.savez(Path(out) / f"rank{rank}.npz", **saved)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Skip the interpreter's teardown: torch's C++ threads destroyed at exit
    # sometimes abort a finished process ("terminate called without an
    # active exception").
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_placements_on_gloo(tmp_path, world):
    import torch.multiprocessing as mp

    mp.spawn(_dtensor_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(world)]
    names = sorted({k.split("|")[0] for k in ranks[0]})
    assert len(names) == len(_cases(world)) + 5  # + FSDP2: two weights, two biases, a buffer
    for name in names:
        full = ranks[0][f"{name}|full"]
        buf = np.zeros(full.size, dtype=np.uint32)
        cnt = np.zeros(full.size, dtype=np.int64)
        for d in ranks:
            buf[d[f"{name}|flat"]] = bits(d[f"{name}|vals"])
            np.add.at(cnt, d[f"{name}|flat"], 1)
            assert d[f"{name}|npieces"][0] <= 2, name  # one box (two for a strided split)
        assert (cnt == 1).all(), f"{name}: elements written {np.bincount(cnt)} times"
        np.testing.assert_array_equal(buf, bits(full).reshape(-1), err_msg=name)


# ---------------------------------------------------------------- transformers fused MoE


def _moe_config(kind: str):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=False)
    if kind == "qwen2_moe":
        return Qwen2MoeConfig(intermediate_size=24, moe_intermediate_size=8, shared_expert_intermediate_size=12,
                              num_experts=4, num_experts_per_tok=2, **common)
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(intermediate_size=24, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                              head_dim=4, **common)
    return MixtralConfig(intermediate_size=8, num_local_experts=3, num_experts_per_tok=2, **common)


PROJS = ("gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_transformers_fused_moe_matches_save_pretrained(tmp_path, kind):
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_moe_config(kind)).to(torch.float32)
    model.save_pretrained(tmp_path / "before")
    pl = transformers_placements(model)  # structural: computed before the weights change
    experts = model.model.layers[1].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj[1, 3:7, :] += 1.0  # gate rows of expert 1
        experts.gate_up_proj[2, -1, :5] -= 2.0  # last up row of expert 2
        experts.down_proj[0, :, 2] *= 3.0
        model.model.norm.weight += 0.5
        model.model.layers[0].mlp.gate.weight.mul_(-1)  # Mixtral: renamed to block_sparse_moe.gate
    model.save_pretrained(tmp_path / "after")
    after = load_file(tmp_path / "after" / "model.safetensors")
    before = load_file(tmp_path / "before" / "model.safetensors")

    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    got, cnt = assemble([(pl, {lp.local_name: sd[lp.local_name] for lp in pl.local})])
    assert set(got) == set(after)
    for n, ref in after.items():
        assert (cnt[n] == 1).all(), n
        assert pl.canonical[n].dtype == torch.float32 and pl.canonical[n].shape == ref.shape
        np.testing.assert_array_equal(got[n], bits(ref), err_msg=n)
    changed = {n for n in after if not np.array_equal(after[n], before[n])}
    moe, (g, u, d) = ("block_sparse_moe", ("w1", "w3", "w2")) if kind == "mixtral" else ("mlp", PROJS)
    assert changed == {f"model.layers.1.{moe}.experts.1.{g}.weight", f"model.layers.1.{moe}.experts.2.{u}.weight",
                       f"model.layers.1.{moe}.experts.0.{d}.weight", f"model.layers.0.{moe}.gate.weight",
                       "model.norm.weight"}

    by = pl.by_local_name()
    E = experts.gate_up_proj.shape[0]
    gu = by["model.layers.1.mlp.experts.gate_up_proj"]
    assert len(gu.pieces) == 2 * E and len(by["model.layers.1.mlp.experts.down_proj"].pieces) == E
    assert [p.canonical for p in gu.pieces[2:4]] == [f"model.layers.1.{moe}.experts.1.{g}.weight",
                                                     f"model.layers.1.{moe}.experts.1.{u}.weight"]
    assert all(len(lp.pieces) == 1 for k, lp in by.items() if "experts" not in k)
