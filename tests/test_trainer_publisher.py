"""Sharded encoding (dcr.trainer.ShardedPublisher) on real torch.distributed
gloo process groups: the delta composed by 2-4 ranks, each scanning only its
own shards, equals byte for byte the delta of the gathered checkpoint, and
applies to the old checkpoint to give the new one."""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dcr
from dcr import _core
from dcr.trainer import layouts as L

CHUNK = 4096  # small chunks: many owners per tensor


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(fn, world: int, *args) -> None:
    mp.start_processes(fn, args=(world, _port(), *args), nprocs=world, join=True, start_method="spawn")


def _init(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _finish() -> None:
    """Leave the group together, then exit without the interpreter's
    teardown: torch's C++ threads (gloo, FSDP2's device mesh) destroyed in
    arbitrary order at exit sometimes abort the process ("terminate called
    without an active exception") after its work and files are done."""
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _step(full: dict[str, torch.Tensor], rate: float, seed: int) -> dict[str, torch.Tensor]:
    """A training-like update: ``rate`` of the elements move by a few ulps,
    plus a sign flip, a -0/+0 flip and a NaN payload change somewhere."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in full.items():
        b = _bits(v.clone()).reshape(-1)
        m = torch.rand(b.numel(), generator=g) < rate
        step = torch.randint(1, 4, (b.numel(),), generator=g, dtype=torch.int64).to(b.dtype)
        b[m] += step[m]
        if b.numel() > 3:
            b[1] ^= torch.tensor(1, dtype=torch.int64).to(b.dtype) << (8 * v.element_size() - 1)
        out[k] = b.view(v.dtype).reshape(v.shape)
    return out


def _model(dims: dict[str, int]) -> dict[str, torch.Tensor]:
    """Canonical (Hugging Face named) tensors of a small GQA + MoE layer, bf16."""
    H, nh, nkv, hd, F, V, E, EF = (dims[k] for k in ("H", "nh", "nkv", "hd", "F", "V", "E", "EF"))
    g = torch.Generator().manual_seed(1)
    shapes = {
        "model.embed_tokens.weight": (V, H),
        "model.layers.0.input_layernorm.weight": (H,),
        "model.layers.0.self_attn.q_proj.weight": (nh * hd, H),
        "model.layers.0.self_attn.k_proj.weight": (nkv * hd, H),
        "model.layers.0.self_attn.v_proj.weight": (nkv * hd, H),
        "model.layers.0.self_attn.o_proj.weight": (H, nh * hd),
        "model.layers.0.mlp.gate_proj.weight": (F, H),
        "model.layers.0.mlp.up_proj.weight": (F, H),
        "model.layers.0.mlp.down_proj.weight": (H, F),
        "lm_head.weight": (V, H),
    }
    for e in range(E):
        for p, s in (("gate_proj", (EF, H)), ("up_proj", (EF, H)), ("down_proj", (H, EF))):
            shapes[f"model.layers.1.mlp.experts.{e}.{p}.weight"] = s
    return {k: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}


def _megatron_placements(dims: dict[str, int], tp: int, rank: int) -> L.Placements:
    """Megatron-style TP (= EP) layout of `_model` for one rank."""
    H, nh, nkv, hd, F, V, E, EF = (dims[k] for k in ("H", "nh", "nkv", "hd", "F", "V", "E", "EF"))
    pre = "model.layers.0."
    pl = L.Placements()
    pl.add(*L.vocab_parallel("embedding", "model.embed_tokens.weight", V, H, rank, tp, divisible_by=8))
    pl.add(*L.replicated("ln", pre + "input_layernorm.weight", (H,), owner=rank == 0))
    pl.add(*L.fused_qkv("qkv", pre + "self_attn.q_proj.weight", pre + "self_attn.k_proj.weight",
                        pre + "self_attn.v_proj.weight", num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                        hidden_size=H, tp_rank=rank, tp_size=tp))
    pl.add(*L.row_parallel("proj", pre + "self_attn.o_proj.weight", (H, nh * hd), rank, tp))
    pl.add(*L.gated_fc1("fc1", pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight", (F, H), rank, tp))
    pl.add(*L.row_parallel("fc2", pre + "mlp.down_proj.weight", (H, F), rank, tp))
    pl.add(*L.vocab_parallel("output", "lm_head.weight", V, H, rank, tp, divisible_by=8))
    pl.add(*L.stacked_experts("experts.fc1", "model.layers.1.mlp.experts.{e}.{proj}.weight", ("gate_proj", "up_proj"),
                              num_experts=E, out_features=EF, in_features=H, ep_rank=rank, ep_size=tp))
    pl.add(*L.stacked_experts("experts.fc2", "model.layers.1.mlp.experts.{e}.{proj}.weight", ("down_proj",),
                              num_experts=E, out_features=H, in_features=EF, ep_rank=rank, ep_size=tp))
    return pl.validate()


def _locals_from(full: dict[str, torch.Tensor], pl: L.Placements, dtype: torch.dtype | None = None
                 ) -> dict[str, torch.Tensor]:
    """Each local tensor filled from the canonical tensors through its pieces
    (the pieces themselves are checked against Megatron's own slicing in
    test_trainer_layouts.py); padding rows get junk the encoder must ignore."""
    out = {}
    for lp in pl.local:
        some = full[next(iter(pl.canonical))] if not lp.pieces else full[lp.pieces[0].canonical]
        t = torch.full((lp.local_numel,), 7.0, dtype=dtype or some.dtype)
        for p in lp.pieces:
            src = full[p.canonical].reshape(-1)
            idx = torch.as_strided(torch.arange(src.numel()), p.shape, p.canonical_strides, p.canonical_offset)
            t[p.local_offset:p.local_offset + p.numel] = src[idx.reshape(-1)].to(t.dtype)
        out[lp.local_name] = t.reshape(lp.local_shape)
    return out


DIMS = dict(H=64, nh=8, nkv=4, hd=8, F=96, V=100, E=4, EF=32)


def _megatron_worker(rank: int, world: int, port: int, out: str, master: bool, mode: str) -> None:
    try:
        _init(rank, world, port)
        from dcr.trainer import ShardedPublisher

        old = _model(DIMS)
        if master:  # fp32 master weights: the checkpoint is their bf16 cast
            g = torch.Generator().manual_seed(5)
            old32 = {k: v.float() + torch.randn(v.shape, generator=g) * 1e-5 for k, v in old.items()}
            new32 = {k: v + (torch.rand(v.shape, generator=g) < 0.05) * 3e-4 for k, v in old32.items()}
            old = {k: v.to(torch.bfloat16) for k, v in old32.items()}
            new = {k: v.to(torch.bfloat16) for k, v in new32.items()}
        else:
            new = _step(old, 0.03, seed=2)
        pl = _megatron_placements(DIMS, world, rank)
        if master:
            loc_old = _locals_from(old32, pl, torch.float32)
            loc_new = _locals_from(new32, pl, torch.float32)
        else:
            loc_old, loc_new = _locals_from(old, pl), _locals_from(new, pl)
        pub = ShardedPublisher(pl, chunk_bytes=CHUNK, round_bytes=16 << 10, mode=mode)
        base = pub.start(loc_old, version=3)
        sink = _core.DeltaSink.file(Path(out) / "sharded.delta") if rank == 0 else None
        report = pub.publish(loc_new, sink)
        # A second step from the advanced baseline.
        newer = _step(new, 0.02, seed=9) if not master else None
        sink2 = _core.DeltaSink.file(Path(out) / "sharded2.delta") if rank == 0 else None
        report2 = pub.publish(_locals_from(newer, pl) if newer is not None else loc_new, sink2)
        if rank == 0:
            torch.save({"old": old, "new": new, "newer": newer}, Path(out) / "full.pt")
            (Path(out) / "report.json").write_text(json.dumps({
                "base": base, "target": report.target_digest, "changed": report.changed,
                "chunks": report.chunks, "committed": report.committed, "bytes": report.delta_bytes,
                "v2": [report2.base_version, report2.target_version, report2.changed],
            }))
        _finish()
    except Exception:
        (Path(out) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


@pytest.mark.parametrize("world,master,mode", [(2, False, "free"), (4, False, "free"), (2, True, "free"),
                                               (2, False, "context")])
def test_megatron_sharded_delta_equals_gathered_delta(tmp_path, world, master, mode):
    _spawn(_megatron_worker, world, str(tmp_path), master, mode)
    full = torch.load(tmp_path / "full.pt")
    rep = json.loads((tmp_path / "report.json").read_text())
    gathered, stats = dcr.diff_tensors(full["old"], full["new"], chunk_bytes=CHUNK, base_version=3, target_version=4)
    sharded = (tmp_path / "sharded.delta").read_bytes()
    assert stats["changed_elements"] > 100 and rep["changed"] == stats["changed_elements"]
    assert rep["base"] == dcr.digest_tensors(full["old"]) and rep["target"] == dcr.digest_tensors(full["new"])
    if mode == "free":
        assert sharded == gathered, "the composed delta differs from the gathered checkpoint's delta"
    else:  # the chunks of column-parallel rows, vocab rows and experts are whole on one rank
        info = dcr.inspect_file(tmp_path / "sharded.delta")
        assert info["mode"] == "context" and info["chunks"] == stats["chunks"], info
    assert rep["committed"] and rep["bytes"] == len(sharded)
    target = {k: v.clone() for k, v in full["old"].items()}
    dcr.apply_tensors(sharded, target)
    assert all(torch.equal(_bits(target[k]), _bits(full["new"][k])) for k in target)
    # The second publish diffs from the committed version 4.
    assert rep["v2"][:2] == [4, 5]
    if full["newer"] is not None:
        second, _ = dcr.diff_tensors(full["new"], full["newer"], chunk_bytes=CHUNK, base_version=4, target_version=5)
        if mode == "free":
            assert (tmp_path / "sharded2.delta").read_bytes() == second
        target2 = {k: v.clone() for k, v in full["new"].items()}
        dcr.apply_tensors((tmp_path / "sharded2.delta").read_bytes(), target2)
        assert all(torch.equal(_bits(target2[k]), _bits(full["newer"][k])) for k in target2)
    else:
        assert rep["v2"][2] == 0  # nothing changed since version 4


def _dtensor_worker(rank: int, world: int, port: int, out: str) -> None:
    try:
        _init(rank, world, port)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from dcr.trainer import ShardedPublisher

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(33, 70), torch.nn.GELU(), torch.nn.Linear(70, 17)).to(torch.bfloat16)
        model.register_buffer("scale", torch.arange(5, dtype=torch.bfloat16))
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model, mesh=mesh)
        pl = L.module_placements(model)
        full_old = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in model.state_dict().items()}
        pub = ShardedPublisher(pl, chunk_bytes=256)
        pub.start(model)
        with torch.no_grad():  # an "optimizer step" on each rank's own shard
            g = torch.Generator().manual_seed(10 + rank)
            for p in model.parameters():
                loc = p.to_local()
                b = _bits(loc).reshape(-1)
                m = torch.rand(b.numel(), generator=g) < 0.05
                b[m] += 1
        full_new = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in model.state_dict().items()}
        sink = _core.DeltaSink.file(Path(out) / "fsdp.delta") if rank == 0 else None
        pub.publish(model, sink)
        if rank == 0:
            torch.save({"old": full_old, "new": full_new}, Path(out) / "full.pt")
        _finish()
    except Exception:
        (Path(out) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_sharded_delta_equals_gathered_delta(tmp_path, world):
    _spawn(_dtensor_worker, world, str(tmp_path))
    full = torch.load(tmp_path / "full.pt")
    gathered, stats = dcr.diff_tensors(full["old"], full["new"], chunk_bytes=256, base_version=0, target_version=1)
    assert stats["changed_elements"] > 0
    assert (tmp_path / "fsdp.delta").read_bytes() == gathered


CONTEXT_CHUNK = 12 << 10  # 6144 bf16 words: dim-0 shards of 2 ranks split one chunk of each tensor


def _context_worker(rank: int, world: int, port: int, out: str) -> None:
    """FSDP2 (dim-0 shards) of bf16 linears; mode="context" publishes."""
    try:
        _init(rank, world, port)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from dcr.trainer import ShardedPublisher

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)).to(torch.bfloat16)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        pl = L.module_placements(model)
        full_old = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        pub = ShardedPublisher(pl, chunk_bytes=CONTEXT_CHUNK, mode="context")
        pub.start(model)
        with torch.no_grad():  # one ulp up or down on 6 % of each rank's shard
            g = torch.Generator().manual_seed(10 + rank)
            for p in model.parameters():
                b = _bits(p.to_local()).reshape(-1)
                m = torch.rand(b.numel(), generator=g) < 0.06
                b[m] += torch.where(torch.rand(b.numel(), generator=g) < 0.5, 1, -1).to(b.dtype)[m]
        full_new = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        sink = _core.DeltaSink.file(Path(out) / "context.delta") if rank == 0 else None
        report = pub.publish(model, sink)
        whole = torch.tensor([len(pub.whole_chunks)])
        dist.all_reduce(whole)
        if rank == 0:
            torch.save({"old": full_old, "new": full_new, "whole": int(whole),
                        "committed": report.committed}, Path(out) / "full.pt")
        _finish()
    except Exception:
        (Path(out) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


@pytest.mark.parametrize("world", [1, 2])
def test_context_mode_codes_the_chunks_a_rank_holds_whole(tmp_path, world):
    _spawn(_context_worker, world, str(tmp_path))
    full = torch.load(tmp_path / "full.pt")
    sharded = (tmp_path / "context.delta").read_bytes()
    kw = dict(chunk_bytes=CONTEXT_CHUNK, base_version=0, target_version=1)
    context, stats = dcr.diff_tensors(full["old"], full["new"], mode="context", **kw)
    free, _ = dcr.diff_tensors(full["old"], full["new"], mode="free", **kw)
    info = dcr.inspect_file(tmp_path / "context.delta")
    assert full["committed"] and info["changed_elements"] == stats["changed_elements"] > 1000
    assert info["modes"]["context"] > 0
    if world == 1:  # every chunk is whole on the one rank: the single-process delta
        assert sharded == context
    else:
        # The chunks that straddle the two shards stay context-free, the rest match.
        assert info["modes"]["free"] >= 1 and len(context) <= len(sharded) < len(free)
        total = sum(-(-v.numel() * 2 // CONTEXT_CHUNK) for v in full["old"].values())
        assert info["modes"]["context"] <= full["whole"] < total
    target = {k: v.clone() for k, v in full["old"].items()}
    dcr.apply_tensors(sharded, target)
    assert all(torch.equal(_bits(target[k]), _bits(full["new"][k])) for k in target)


def _rss_worker(rank: int, world: int, port: int, out: str) -> None:
    try:
        _init(rank, world, port)
        from dcr.trainer import ShardedPublisher

        rows, cols = 16384, 2048  # 64 MiB of bf16 canonical; each rank holds 1/world
        pl = L.Placements()
        pl.add(*L.column_parallel("w", "w", (rows, cols), rank, world))
        local = torch.zeros((rows // world, cols), dtype=torch.bfloat16)
        pub = ShardedPublisher(pl, chunk_bytes=1 << 20)
        pub.start({"w": local})
        b = _bits(local).reshape(-1)
        b[::33] += 1  # 3 % change; a first publish warms the allocator up
        pub.publish({"w": local}, _core.DeltaSink.file(Path(out) / "warm.delta") if rank == 0 else None)
        b[5::33] += 1
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS
        before = _rss("VmRSS")
        import tracemalloc  # numpy reports its buffers to tracemalloc

        tracemalloc.start()
        sink = _core.DeltaSink.file(Path(out) / "big.delta") if rank == 0 else None
        pub.publish({"w": local}, sink)
        traced = tracemalloc.get_traced_memory()[1]
        peak = _rss("VmHWM")
        (Path(out) / f"rss{rank}.json").write_text(json.dumps({"growth": peak - before, "traced": traced,
                                                               "full": rows * cols * 2}))
        _finish()
    except Exception:
        (Path(out) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_no_rank_allocates_a_full_copy_of_a_sharded_tensor(tmp_path):
    world = 4
    _spawn(_rss_worker, world, str(tmp_path))
    for r in range(world):
        m = json.loads((tmp_path / f"rss{r}.json").read_text())
        # A full copy alone would add 64 MiB to the process; the changes
        # (3 % of the shard), their records and the frames stay far below.
        assert m["growth"] < m["full"], f"rank {r} grew by {m['growth']} bytes during publish"
        assert m["traced"] < m["full"] // 2, f"rank {r} allocated {m['traced']} bytes of arrays at once"


def test_cuda_scan_path_matches_the_cpu_scan(monkeypatch):
    """The GPU branch (dcr.cuda.sparse_diff) on its CPU reference returns the
    same positions and XOR words as the Rust scan."""
    from dcr import cuda as dcr_cuda
    from dcr.trainer.publisher import ShardedPublisher

    g = torch.Generator().manual_seed(3)
    old = torch.randn(10_000, generator=g).to(torch.bfloat16)
    new = _step({"x": old}, 0.05, seed=4)["x"]
    pos, xor = ShardedPublisher._changed_words(old, new, 2)
    counts, positions, values = dcr_cuda.sparse_diff(old, new, old.numel(), impl="cpu")
    assert np.array_equal(positions.numpy().astype(np.uint32), pos)
    assert np.array_equal(values.numpy().astype(np.int64).view(np.uint64) & np.uint64(0xFFFF), xor)
    assert int(counts.sum()) == pos.size > 0


def test_transformers_fused_moe_round_trips_through_checkpoint_names(tmp_path):
    """A transformers MoE model holds its experts fused in memory; the delta
    encoded from the in-memory tensors applies to the checkpoint that
    save_pretrained wrote and gives the checkpoint save_pretrained writes
    after the step, bit for bit."""
    _spawn(_moe_worker, 1, str(tmp_path))
    from safetensors.torch import load_file

    old = load_file(str(tmp_path / "before" / "model.safetensors"))
    new = load_file(str(tmp_path / "after" / "model.safetensors"))
    assert any("experts.1.gate_proj" in k for k in old)  # checkpoint names, per expert
    target = {k: v.clone() for k, v in old.items()}
    dcr.apply_tensors((tmp_path / "moe.delta").read_bytes(), target)
    assert set(target) == set(new)
    assert all(torch.equal(_bits(target[k]), _bits(new[k])) for k in new)
    assert not all(torch.equal(_bits(old[k]), _bits(new[k])) for k in new)


def _moe_worker(rank: int, world: int, port: int, out: str) -> None:
    try:
        _init(rank, world, port)
        from transformers import AutoModelForCausalLM, Qwen3MoeConfig

        from dcr.trainer import ShardedPublisher

        torch.manual_seed(0)
        cfg = Qwen3MoeConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=24, moe_intermediate_size=8, num_experts=4,
                             num_experts_per_tok=2, head_dim=4, tie_word_embeddings=False)
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
        model.save_pretrained(Path(out) / "before")
        pub = ShardedPublisher(L.transformers_placements(model), chunk_bytes=512)
        pub.start(model)
        experts = model.model.layers[1].mlp.experts
        with torch.no_grad():
            experts.gate_up_proj[1, 3:7, :] += 0.01
            experts.down_proj[2, :, 1] *= 1.5
            model.model.layers[0].self_attn.q_proj.weight[0, :4] += 0.5
        model.save_pretrained(Path(out) / "after")
        report = pub.publish(model, _core.DeltaSink.file(Path(out) / "moe.delta"))
        assert report.changed > 0 and report.committed
        _finish()
    except Exception:
        (Path(out) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def _save(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def _transport_worker(rank: int, world: int, port: int, out: str, how: str, where: str, key: str) -> None:
    try:
        _init(rank, world, port)
        from dcr.trainer import ShardedPublisher

        old = _model(DIMS)
        new = _step(old, 0.03, seed=2)
        pl = _megatron_placements(DIMS, world, rank)
        pub = ShardedPublisher(pl, chunk_bytes=CHUNK)
        pub.start(_locals_from(old, pl), version=3)
        sink = None
        if rank == 0:
            if how == "relay":
                sink = _core.DeltaSink.relay(where, 4, key_file=key, expect_acks=2, ack_timeout_s=60.0)
            else:
                sink = _core.DeltaSink.object_store(where, version=4)
        report = pub.publish(_locals_from(new, pl), sink)
        if rank == 0:
            (Path(out) / "report.json").write_text(json.dumps({"committed": report.committed, "sink": report.sink}))
        _finish()
    except Exception:
        (Path(out) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


@pytest.mark.slow
def test_sharded_publish_streams_through_a_relay_tree_to_receivers(tmp_path):
    """Rank 0 streams the composed frames into a real dcr-relay process; two
    `dcr receive` processes apply them to their safetensors files; their acks
    make the joint commit."""
    import shutil
    import subprocess
    import sys

    from test_relay_cli import Relay

    old_path = _save(_model(DIMS), tmp_path / "old.safetensors")
    new_full = _step(_model(DIMS), 0.03, seed=2)
    key = tmp_path / "key"
    key.write_bytes(b"0123456789abcdef-shared-secret")
    root = Relay(tmp_path, "root", "--key-file", str(key))
    procs = []
    try:
        for i in range(2):
            target = tmp_path / f"replica{i}.safetensors"
            shutil.copyfile(old_path, target)
            procs.append((target, subprocess.Popen(
                [sys.executable, "-m", "dcr.cli", "receive", str(target), "--from", root.addr, "--key-file", str(key),
                 "--receiver-id", f"r{i}", "--timeout", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True)))
        time.sleep(1.0)  # the receivers subscribe
        _spawn(_transport_worker, 2, str(tmp_path), "relay", root.addr, str(key))
        rep = json.loads((tmp_path / "report.json").read_text())
        assert rep["committed"] and rep["sink"]["all_committed"], rep
        want = _save(new_full, tmp_path / "new.safetensors").read_bytes()
        for target, p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            assert target.read_bytes() == want
    finally:
        root.stop()
        for _, p in procs:
            if p.poll() is None:
                p.kill()


def test_sharded_publish_to_object_storage_then_receive(tmp_path):
    """Frames go to a file:// object store as they are built; the manifest
    commits the version; `dcr receive` brings a replica to it bit for bit."""
    from dcr.cli import main

    old_path = _save(_model(DIMS), tmp_path / "replica.safetensors")
    store = (tmp_path / "store").as_uri()
    _spawn(_transport_worker, 2, str(tmp_path), "objstore", store, "")
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["committed"] and rep["sink"]["committed"] is True
    assert main(["receive", str(old_path), "--from", store]) == 0
    want = _save(_step(_model(DIMS), 0.03, seed=2), tmp_path / "new.safetensors").read_bytes()
    assert old_path.read_bytes() == want


def _gpu_worker(rank: int, world: int, port: int, out: str) -> None:
    try:
        _init(rank, world, port)
        from dcr.trainer import ShardedPublisher

        old = _model(DIMS)
        new = _step(old, 0.03, seed=2)
        pl = _megatron_placements(DIMS, world, rank)
        dev = f"cuda:{rank % torch.cuda.device_count()}"
        loc_old = {k: v.to(dev) for k, v in _locals_from(old, pl).items()}
        loc_new = {k: v.to(dev) for k, v in _locals_from(new, pl).items()}
        pub = ShardedPublisher(pl, chunk_bytes=CHUNK, baseline_device="same")
        pub.start(loc_old, version=3)
        pub.publish(loc_new, _core.DeltaSink.file(Path(out) / "gpu.delta") if rank == 0 else None)
        if rank == 0:
            torch.save({"old": old, "new": new}, Path(out) / "full.pt")
        _finish()
    except Exception:
        (Path(out) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_sharded_delta_equals_gathered_delta(tmp_path):
    """GPU twin of test_megatron_sharded_delta_equals_gathered_delta: local
    tensors and baselines on the GPU, changes compacted by the dcr CUDA diff
    kernel; the CPU twin is the Megatron test above plus
    test_cuda_scan_path_matches_the_cpu_scan."""
    _spawn(_gpu_worker, 2, str(tmp_path))
    full = torch.load(tmp_path / "full.pt")
    gathered, _ = dcr.diff_tensors(full["old"], full["new"], chunk_bytes=CHUNK, base_version=3, target_version=4)
    assert (tmp_path / "gpu.delta").read_bytes() == gathered
