"""Tests for the benchmark helpers (benches/_common.py) and bench_codec's dcr checks."""

from __future__ import annotations

import json
import math
import shutil
import struct
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))
import _common as C  # noqa: E402

ALL = np.arange(65536, dtype=np.uint32).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------- entropy


def test_entropy_of_known_distribution():
    # p = 1/2, 1/4, 1/8, 1/8 -> 1.75 bits
    assert C.entropy_bits(np.array([4, 2, 1, 1])) == pytest.approx(1.75, abs=1e-12)
    assert C.entropy_bits(np.array([0, 4, 0, 2, 1, 1])) == pytest.approx(1.75, abs=1e-12)
    assert C.entropy_bits(np.full(256, 7)) == pytest.approx(8.0, abs=1e-12)
    assert C.entropy_bits(np.array([5])) == 0.0
    vals = np.array([3, 3, 3, 3, -1, -1, 9, 12])
    assert C.plugin_entropy(vals) == pytest.approx(1.75, abs=1e-12)


def test_binary_entropy():
    assert C.binary_entropy(0.5) == pytest.approx(1.0, abs=1e-15)
    assert C.binary_entropy(0.0) == 0.0
    assert C.binary_entropy(1.0) == 0.0
    assert C.binary_entropy(0.11) == pytest.approx(0.4999160, abs=1e-6)
    p = np.array([0.0, 0.01, 0.25, 0.75, 1.0])
    h = C.binary_entropy(p)
    assert h == pytest.approx([0.0, 0.0807931, 0.8112781, 0.8112781, 0.0], abs=1e-6)
    with pytest.raises(ValueError):
        C.binary_entropy(1.5)


def test_conditional_entropy():
    # context 0: symbols {1, 1, 2, 2} -> 1 bit each; context 5: {7, 7, 7} -> 0
    ctx = np.array([0, 0, 0, 0, 5, 5, 5])
    sym = np.array([1, 1, 2, 2, 7, 7, 7])
    assert C.conditional_entropy_total_bits(ctx, sym) == pytest.approx(4.0, abs=1e-12)
    # one context: m * H(sym)
    sym2 = np.array([0, 1, 2, 3, 0, 1, 2, 3])
    assert C.conditional_entropy_total_bits(np.zeros(8, int), sym2) == pytest.approx(16.0, abs=1e-12)


# ---------------------------------------------------------------- ulp mapping


def test_ordinal_round_trip_all_patterns():
    o = C.bf16_ordinal(ALL)
    assert o.dtype == np.int32
    assert np.array_equal(C.bf16_from_ordinal(o), ALL)
    # a bijection onto [-32768, 32767]
    assert np.array_equal(np.sort(o), np.arange(-32768, 32768))


def test_ordinal_monotone_over_all_non_nan_patterns():
    f = bf16_to_f32(ALL)
    keep = ~np.isnan(f)
    bits, vals = ALL[keep], f[keep]
    order = np.argsort(C.bf16_ordinal(bits), kind="stable")
    v = vals[order]
    o = C.bf16_ordinal(bits)[order]
    assert np.all(np.diff(o) > 0)
    dv = np.diff(v.astype(np.float64))
    assert np.all(dv >= 0)
    # the only tie is -0 then +0, one step apart
    ties = np.flatnonzero(dv == 0)
    assert len(ties) == 1
    assert bits[order][ties[0]] == 0x8000 and bits[order][ties[0] + 1] == 0x0000
    # non-NaN patterns form one contiguous run of ordinals: -inf .. +inf
    assert o[0] == C.bf16_ordinal(np.array([0xFF80], np.uint16))[0]
    assert o[-1] == C.bf16_ordinal(np.array([0x7F80], np.uint16))[0]
    assert o[-1] - o[0] + 1 == o.size


def test_ulp_delta_examples():
    u16 = lambda *xs: np.array(xs, dtype=np.uint16)  # noqa: E731
    assert list(C.bf16_ordinal(u16(0x0000, 0x8000, 0x0001, 0x8001))) == [0, -1, 1, -2]
    one, next_one, prev_one = u16(0x3F80), u16(0x3F81), u16(0x3F7F)
    assert C.ulp_delta(one, next_one)[0] == 1
    assert C.ulp_delta(one, prev_one)[0] == -1
    # -1.0 -> next value towards zero is one step up
    assert C.ulp_delta(u16(0xBF80), u16(0xBF7F))[0] == 1
    # -min subnormal -> +min subnormal: -> -0 -> +0 -> +min = 3 steps
    assert C.ulp_delta(u16(0x8001), u16(0x0001))[0] == 3
    # largest possible distance
    assert C.ulp_delta(u16(0xFFFF), u16(0x7FFF))[0] == 65535
    assert C.bf16_exponent(u16(0x3F80))[0] == 127


def test_from_ordinal_rejects_out_of_range():
    with pytest.raises(ValueError):
        C.bf16_from_ordinal(np.array([32768]))


# ---------------------------------------------------------------- bounds


def test_bounds_on_hand_made_example():
    # 8 elements, two tensors of kind 0 and 1 (4 each), all old values 1.0.
    old = np.full(8, 0x3F80, dtype=np.uint16)
    new = old.copy()
    new[1] = 0x3F81  # +1 ulp, XOR 0x0001
    new[2] = 0x3F7F  # -1 ulp, XOR 0x00FF
    kinds = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    idx = np.flatnonzero(old != new)
    xw = (old ^ new)[idx]
    # i.i.d.: 8 * h(2/8) + 2 * H({0x0001, 0x00FF}) = 8 * 0.811278... + 2 * 1
    expect_iid = 8 * (-(0.25 * math.log2(0.25) + 0.75 * math.log2(0.75))) + 2.0
    assert C.iid_bound_total_bits(8, xw) == pytest.approx(expect_iid, abs=1e-12)
    # side information: context (0, 127) holds 4 elements with 2 changes (+1, -1):
    # 4 * h(1/2) + 2 * 1 bit = 6; context (1, 127): 4 elements, no change: 0.
    ctx = C.dcr_context(kinds, old)
    assert set(ctx.tolist()) == {127, 256 + 127}
    deltas = C.ulp_delta(old[idx], new[idx])
    assert list(deltas) == [1, -1]
    assert C.side_info_bound_total_bits(ctx, idx, deltas) == pytest.approx(6.0, abs=1e-12)
    # no context at all: one context of 8 with 2 changes = the iid position cost + 2 bits
    assert C.side_info_bound_total_bits(np.zeros(8, int), idx, deltas) == pytest.approx(expect_iid, abs=1e-12)


def test_iid_bound_rejects_more_changes_than_elements():
    with pytest.raises(ValueError):
        C.iid_bound_total_bits(2, np.array([1, 2, 3], dtype=np.uint16))


# ---------------------------------------------------------------- LEB128


def test_leb128_known_encodings_and_round_trip():
    assert C.leb128_encode(np.array([0])) == b"\x00"
    assert C.leb128_encode(np.array([127])) == b"\x7f"
    assert C.leb128_encode(np.array([128])) == b"\x80\x01"
    assert C.leb128_encode(np.array([300])) == b"\xac\x02"
    assert C.leb128_encode(np.array([624485])) == b"\xe5\x8e\x26"
    vals = np.array([0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**35 + 5, 2**63 - 1, 2**64 - 1],
                    dtype=np.uint64)
    enc = C.leb128_encode(vals)
    assert np.array_equal(C.leb128_decode(enc, count=vals.size), vals)
    rng = np.random.default_rng(1)
    r = rng.integers(0, 2**40, size=1000) >> rng.integers(0, 40, size=1000)
    assert np.array_equal(C.leb128_decode(C.leb128_encode(r)), r.astype(np.uint64))
    with pytest.raises(ValueError):
        C.leb128_decode(b"\x80")
    with pytest.raises(ValueError):
        C.leb128_decode(b"\x01\x02", count=3)


# ---------------------------------------------------------------- safetensors, kinds


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    meta: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, (dtype, shape, data) in tensors.items():
        meta[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(meta).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(d for _, _, d in tensors.values()))


def test_load_raw_matches_torch(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(7, 5, generator=g).bfloat16(),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(3, generator=g).bfloat16(),
        "lm_head.weight": torch.randn(2, 3, 4, generator=g).bfloat16(),
    }
    p = tmp_path / "t.safetensors"
    save_file(tensors, str(p), metadata={"format": "pt"})
    raw = C.load_raw(p)
    assert raw.file_bytes == p.stat().st_size
    assert raw.header + raw.words.astype("<u2").tobytes() == p.read_bytes()
    loaded = load_file(str(p))
    for t in raw.tensors:
        ref = loaded[t.name].reshape(-1).view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(raw.words[t.start : t.start + t.count], ref), t.name
    kinds = C.kind_ids(raw)
    for t in raw.tensors:
        assert set(kinds[t.start : t.start + t.count].tolist()) == {C.KINDS.index(C.tensor_kind(t.name))}


def test_load_raw_rejects_bad_files(tmp_path):
    p = tmp_path / "f32.safetensors"
    write_safetensors(p, {"w": ("F32", (2,), b"\x00" * 8)})
    with pytest.raises(ValueError, match="2-byte"):
        C.load_raw(p)
    p = tmp_path / "gap.safetensors"
    meta = {"w": {"dtype": "BF16", "shape": [2], "data_offsets": [2, 6]}}
    h = json.dumps(meta).encode()
    p.write_bytes(struct.pack("<Q", len(h)) + h + b"\x00" * 6)
    with pytest.raises(ValueError, match="gap"):
        C.load_raw(p)


def test_tensor_kinds():
    k = C.tensor_kind
    assert k("model.embed_tokens.weight") == "embed"
    assert k("lm_head.weight") == "lm_head"
    assert k("model.layers.3.self_attn.k_proj.bias") == "bias"
    assert k("model.layers.3.self_attn.o_proj.weight") == "attn"
    assert k("model.layers.0.mlp.down_proj.weight") == "mlp"
    assert k("model.layers.0.input_layernorm.weight") == "norm"
    assert k("model.layers.0.post_attention_layernorm.weight") == "norm"
    assert k("model.norm.weight") == "norm"


# ---------------------------------------------------------------- synthetic deltas


def test_synthetic_new_is_exact_and_deterministic():
    rng = np.random.default_rng(3)
    old = (rng.standard_normal(20000).astype(np.float32) * 0.02).view(np.uint32)
    old = (old >> 16).astype(np.uint16)
    pool = np.array([1, -1, 1, -1, 2, -3, 40], dtype=np.int32)
    new, idx = C.synthetic_new(old, 0.05, pool, seed=7)
    assert idx.size == 1000
    assert np.array_equal(np.flatnonzero(old != new), idx)
    assert set(C.ulp_delta(old[idx], new[idx]).tolist()) <= set(pool.tolist())
    assert not np.any(((old ^ new) & 0x8000)[idx])  # no sign flips
    again, _ = C.synthetic_new(old, 0.05, pool, seed=7)
    assert np.array_equal(new, again)
    other, _ = C.synthetic_new(old, 0.05, pool, seed=8)
    assert not np.array_equal(new, other)


def test_ulp_step_pool_drops_sign_flips():
    old = np.array([0x3F80, 0x0001, 0x4000, 0x1234], dtype=np.uint16)
    new = np.array([0x3F81, 0x8001, 0x4000, 0x1230], dtype=np.uint16)
    assert sorted(C.ulp_step_pool(old, new).tolist()) == [-4, 1]


# ---------------------------------------------------------------- bench_codec's dcr rows


def _fake_dcr(corrupt: bool) -> types.ModuleType:
    """A stand-in for dcr.diff_files / dcr.apply_file built on numpy (whole-file XOR)."""
    mod = types.ModuleType("dcr")

    def diff_files(old_path, new_path, out_path, mode="free", threads=1):
        a, b = Path(old_path).read_bytes(), Path(new_path).read_bytes()
        x = np.frombuffer(a, np.uint8) ^ np.frombuffer(b, np.uint8)
        Path(out_path).write_bytes(x.tobytes())
        m = int((C.load_raw(old_path).words != C.load_raw(new_path).words).sum())
        return {"changed_elements": m, "payload_bytes": x.size, "bytes_per_changed": x.size / max(m, 1)}

    def apply_file(delta_path, target_path, threads=1):
        t = np.frombuffer(Path(target_path).read_bytes(), np.uint8)
        d = np.frombuffer(Path(delta_path).read_bytes(), np.uint8)
        out = t ^ d
        if corrupt:
            out[-1] ^= 1
        Path(target_path).write_bytes(out.tobytes())

    mod.diff_files, mod.apply_file = diff_files, apply_file
    return mod


@pytest.fixture
def bench_codec():
    pytest.importorskip("zstandard")
    import bench_codec

    return bench_codec


def _pair(tmp_path: Path) -> tuple[Path, Path, int]:
    old = np.arange(64, dtype=np.uint16) + 0x3F00
    new = old.copy()
    new[[3, 40]] ^= 1
    po, pn = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    write_safetensors(po, {"w": ("BF16", (64,), old.tobytes())})
    write_safetensors(pn, {"w": ("BF16", (64,), new.tobytes())})
    return po, pn, 2


def test_dcr_rows_verify_apply(tmp_path, bench_codec):
    po, pn, m = _pair(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    res = bench_codec.time_dcr(_fake_dcr(corrupt=False), po, pn, work, m, repeats=2)
    assert res["verified"] and res["payload_bytes"] == pn.stat().st_size and res["warnings"] == []
    with pytest.raises(AssertionError, match="not bit-exact"):
        bench_codec.time_dcr(_fake_dcr(corrupt=True), po, pn, work, m, repeats=1)
    res = bench_codec.time_dcr(_fake_dcr(corrupt=False), po, pn, work, m + 1, repeats=1)
    assert res["warnings"]


def test_load_dcr_reports_missing_api(monkeypatch, bench_codec):
    monkeypatch.setitem(sys.modules, "dcr", types.ModuleType("dcr"))
    mod, reason = bench_codec.load_dcr()
    assert mod is None and "diff_files" in reason and "apply_file" in reason
    monkeypatch.setitem(sys.modules, "dcr", _fake_dcr(corrupt=False))
    mod, reason = bench_codec.load_dcr()
    assert mod is not None and reason is None


def test_python_baselines_round_trip(bench_codec):
    rng = np.random.default_rng(5)
    old = rng.integers(0, 2**16, size=5000, dtype=np.uint16)
    new = old.copy()
    idx = rng.choice(old.size, 300, replace=False)
    new[idx] ^= rng.integers(1, 2**16, size=300, dtype=np.uint16)
    new[0] ^= 0x8000  # change at position 0 (gap 0) and at the last element
    new[-1] ^= 1
    for codec in (bench_codec.IndexValueZstd(), bench_codec.GapXorZstd(),
                  bench_codec.DenseXorZstd(1), bench_codec.DenseXorZstd(3)):
        assert np.array_equal(codec.decode(old, codec.encode(old, new)), new), codec.label
        assert np.array_equal(codec.decode(old, codec.encode(old, old)), old), codec.label


def test_bench_codec_smoke(tmp_path, bench_codec, capsys):
    """One real pair and one synthetic input, one timing run: JSON written, rows verified."""
    if not (C.data_dir() / bench_codec.FP32M / "step_011.safetensors").is_file():
        pytest.skip(f"checkpoint data not found under {C.data_dir()} (set DCR_DATA)")
    out = tmp_path / "codec.json"
    assert bench_codec.main(["--quick", "--pairs", "fp32m-10-11,syn-1pct", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == bench_codec.SCHEMA
    assert [i["id"] for i in doc["inputs"]] == ["fp32m-10-11", "syn-1pct"]
    real, syn = doc["inputs"]
    assert real["changed_elements"] == 145_482  # the data README's table
    assert syn["changed_elements"] == round(0.01 * syn["n_elements"])
    for inp in doc["inputs"]:
        rows = {r["method"]: r for r in inp["methods"]}
        assert rows["f_iid_bound"]["ratio_to_iid"] == pytest.approx(1.0)
        assert 0 < inp["bounds"]["side_info_bytes_per_changed"] <= inp["bounds"]["iid_bytes_per_changed"]
        for key in ("a_idx32_val16_zstd3", "b_leb128gap_xor16_zstd3", "c_dense_xor_zstd1",
                    "d_zstd_cli_patch_from_long3", "e_full_new_zstd1"):
            assert rows[key]["verified"] and rows[key]["encode_mb_s"] > 0
    if not doc["dcr"]["available"]:
        assert "dcr rows skipped" in capsys.readouterr().out
    else:
        for inp in doc["inputs"]:
            v = inp["dcr_speed_ratios"]["interleaved"]
            row = {r["method"]: r for r in inp["methods"]}["g_dcr_free_known_t1"]
            assert v["dcr_time_vs_block_rows"] == {"diff": pytest.approx(v["best_s"]["dcr_diff"] / row["encode_s"]),
                                                   "apply": pytest.approx(v["best_s"]["dcr_apply"] / row["decode_s"])}
        assert "its block-row time" in capsys.readouterr().out


def test_time_vs_block_rows_divides_the_interleaved_best_by_the_row(bench_codec):
    best = {"zstd1_compress": 9e-3, "dcr_diff": 3e-3, "zstd1_decompress": 9e-3, "dcr_apply": 1.5e-3}
    row = {"encode_s": 2e-3, "decode_s": 1.2e-3}
    assert bench_codec.time_vs_block_rows(best, row) == {"diff": pytest.approx(1.5), "apply": pytest.approx(1.25)}


def _float_like_pair(tmp_path: Path, rate: float) -> tuple[Path, Path, int]:
    """Two bf16 checkpoints of one Qwen-style layout: small weights, a
    fraction ``rate`` of them moved by one or two ulps."""
    rng = np.random.default_rng(11)
    layout = {"model.layers.0.mlp.up_proj.weight": (64, 256), "model.layers.0.self_attn.q_proj.bias": (64,),
              "model.norm.weight": (64,)}
    old_t, new_t, changed = {}, {}, 0
    for name, shape in layout.items():
        n = int(np.prod(shape))
        w = (rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        moved = w.copy()
        if "norm" not in name:
            idx = rng.choice(n, int(rate * n), replace=False)
            moved[idx] += rng.integers(1, 3, idx.size).astype(np.uint16)
            changed += int((moved != w).sum())
        old_t[name] = ("BF16", shape, w.tobytes())
        new_t[name] = ("BF16", shape, moved.tobytes())
    po, pn = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    write_safetensors(po, old_t)
    write_safetensors(pn, new_t)
    return po, pn, changed


def test_bench_codec_on_a_pair_of_ones_own(tmp_path, bench_codec):
    """--pair runs every row on any two checkpoints of one layout, without the shared data."""
    if shutil.which("zstd") is None:
        pytest.skip("the zstd CLI (baseline d) is not on PATH")
    po, pn, m = _float_like_pair(tmp_path, 0.03)
    out = tmp_path / "codec.json"
    assert bench_codec.main(["--quick", "--pair", str(po), str(pn), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    [inp] = doc["inputs"]
    assert inp["id"] == "pair-1" and inp["kind"] == "real" and inp["changed_elements"] == m
    assert inp["change_rate_by_kind"]["norm"] == 0 and inp["change_rate_by_kind"]["mlp"] > 0
    rows = {r["method"]: r for r in inp["methods"]}
    assert rows["f_iid_bound"]["payload_bytes"] > 0
    for key in ("a_idx32_val16_zstd3", "b_leb128gap_xor16_zstd3", "d_zstd_cli_patch_from_long3"):
        assert rows[key]["verified"], key
    if doc["dcr"]["available"]:
        assert rows["h_dcr_context_t1"]["verified"] and rows["g_dcr_free_known_t1"]["verified"]


def test_bench_codec_refuses_a_bad_pair(tmp_path, bench_codec):
    po, pn, _ = _float_like_pair(tmp_path, 0.03)
    with pytest.raises(SystemExit, match="is not a file"):
        bench_codec.main(["--pair", str(po), str(tmp_path / "missing.safetensors"), "--out", str(tmp_path / "x.json")])
    other = tmp_path / "other.safetensors"
    write_safetensors(other, {"w": ("BF16", (4,), bytes(8))})
    with pytest.raises(SystemExit, match="another tensor layout"):
        bench_codec.main(["--pair", str(po), str(other), "--out", str(tmp_path / "x.json")])
    half_a, half_b = tmp_path / "f16a.safetensors", tmp_path / "f16b.safetensors"
    write_safetensors(half_a, {"w": ("F16", (4,), bytes(8))})
    write_safetensors(half_b, {"w": ("F16", (4,), bytes(range(8)))})
    with pytest.raises(SystemExit, match="tensor w is F16"):
        bench_codec.main(["--pair", str(half_a), str(half_b), "--out", str(tmp_path / "x.json")])


def test_make_training_pairs_writes_consecutive_real_steps(tmp_path):
    """A tiny policy trained for two steps in each regime: snapshots of one
    layout, bf16, that differ in some but not all elements."""
    pytest.importorskip("transformers")
    import make_training_pairs

    for regime, lr in (("fp32master", 1e-4), ("bf16", 1e-3)):
        out = tmp_path / regime
        assert make_training_pairs.main([
            "--out", str(out), "--regime", regime, "--lr", str(lr), "--snapshots", "1", "2",
            "--hidden", "32", "--intermediate", "64", "--layers", "1", "--heads", "2", "--kv-heads", "1",
            "--vocab", "256", "--window", "16", "--batch", "2"]) == 0
        a, b = C.load_raw(out / "step_001.safetensors"), C.load_raw(out / "step_002.safetensors")
        assert a.tensors == b.tensors and {t.dtype for t in a.tensors} == {"BF16"}
        assert "lm_head.weight" in {t.name for t in a.tensors}
        changed = float((a.words != b.words).mean())
        assert 0 < changed < 1, (regime, changed)
        log = json.loads((out / "training.json").read_text())
        assert log["regime"] == regime and [s["step"] for s in log["steps"]] == [1, 2]


# ---------------------------------------------------------------- large pairs


def test_large_pair_tiles_both_snapshots_in_name_order(tmp_path):
    import make_large_pair as L

    rng = np.random.default_rng(7)
    # Out of name order in the file, so that the tiles must follow the names.
    old = {"b.weight": rng.integers(0, 65536, (3, 5), dtype=np.uint16), "a.weight": rng.integers(0, 65536, (7,), dtype=np.uint16)}
    new = {k: v.copy() for k, v in old.items()}
    new["a.weight"][[1, 4]] ^= 1
    new["b.weight"][2, 3] ^= 0x8000
    L.write_bf16(tmp_path / "o.safetensors", old)
    L.write_bf16(tmp_path / "n.safetensors", new)
    n, m = L.make_pair(tmp_path / "o.safetensors", tmp_path / "n.safetensors", tmp_path / "out", 3, (4, 6))
    assert n == 72
    for name, src in (("old", old), ("new", new)):
        raw = C.load_raw(tmp_path / "out" / f"{name}.safetensors")
        assert [(t.name, t.dtype, t.shape) for t in raw.tensors] == [(f"model.layers.{k}.mlp.up_proj.weight", "BF16", (4, 6)) for k in range(3)]
        flat = np.concatenate([src["a.weight"].reshape(-1), src["b.weight"].reshape(-1)])
        assert np.array_equal(raw.words, np.resize(flat, 72)), name
    # 22 words tile 72 three times and 6 more: the 3 changes in each whole
    # tile, and the first 6 words' one (a.weight[1], a.weight[4]).
    assert m == 3 * 3 + 2
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    t = load_file(str(tmp_path / "out" / "new.safetensors"))
    assert all(v.dtype == torch.bfloat16 and tuple(v.shape) == (4, 6) for v in t.values())


def test_large_pair_refuses_snapshots_of_two_layouts(tmp_path):
    import make_large_pair as L

    L.write_bf16(tmp_path / "o.safetensors", {"a": np.zeros(4, dtype=np.uint16)})
    L.write_bf16(tmp_path / "n.safetensors", {"b": np.zeros(4, dtype=np.uint16)})
    with pytest.raises(SystemExit, match="another tensor layout"):
        L.make_pair(tmp_path / "o.safetensors", tmp_path / "n.safetensors", tmp_path / "out", 1, (2, 2))


def test_best_of_runs_on_until_its_runs_took_min_seconds(bench_codec):
    """At least `repeats` runs, then on until the timed runs add up to
    `min_seconds`, and not one run more."""
    took = []

    def fn():
        t0 = time.perf_counter()
        time.sleep(0.002)
        took.append(time.perf_counter() - t0)
        return len(took)

    best, last = bench_codec.best_of(fn, 3, min_seconds=0.03)
    assert last == len(took) > 3
    assert sum(took[:-1]) < 0.03 <= sum(took) + 0.001 * len(took)
    assert best >= min(took)
    took.clear()
    bench_codec.best_of(fn, 3)
    assert len(took) == 3
