"""Round trips through the Python API: every dtype, every bit pattern, zero copy."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dcr

TORCH_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def random_bits(gen: torch.Generator, dtype: torch.dtype, n: int) -> torch.Tensor:
    """Arbitrary stored bit patterns of `dtype` (NaN payloads, -0.0, subnormals, inf included)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen, dtype=torch.uint8).bool()
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * width,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.bool:
        return bool(torch.equal(a, b))
    v = INT_VIEW[a.element_size()]
    return bool(torch.equal(a.view(v), b.view(v)))


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=5),
    dtypes=st.lists(st.sampled_from(TORCH_DTYPES), min_size=5, max_size=5),
    rate=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
    chunk_bytes=st.sampled_from([64, 1000, 4096, 1 << 22]),
    kind=st.sampled_from(["xor", "overwrite"]),
)
def test_apply_of_diff_reproduces_new_bit_for_bit(sizes, dtypes, rate, seed, chunk_bytes, kind):
    gen = torch.Generator().manual_seed(seed)
    old, new = {}, {}
    for i, n in enumerate(sizes):
        dt = dtypes[i]
        o = random_bits(gen, dt, n)
        fresh = random_bits(gen, dt, n)
        mask = torch.rand(n, generator=gen) < rate * rate
        w = o.clone()
        if dt == torch.bool:
            w[mask] = fresh[mask]
        else:  # on integer views: fp8 has no masked fill
            v = INT_VIEW[w.element_size()]
            w.view(v)[mask] = fresh.view(v)[mask]
        old[f"t{i}"], new[f"t{i}"] = o, w
    delta, stats = dcr.diff_tensors(old, new, chunk_bytes=chunk_bytes, kind=kind)
    target = {k: v.clone() for k, v in old.items()}
    dcr.apply_tensors(delta, target)
    for k in new:
        assert bits_equal(target[k], new[k]), k
    changed = sum(int((~(old[k].view(torch.uint8) == new[k].view(torch.uint8))).any()) for k in old)
    assert (stats["changed_elements"] > 0) == (changed > 0)
    assert dcr.digest_tensors(target) == dcr.digest_tensors(new) == stats["target_digest"]


def test_special_float_bits_survive():
    specials = torch.tensor([0x7FC1, 0xFFC1, 0x8000, 0x0000, 0x0001, 0x807F, 0x7F80, 0xFF80], dtype=torch.int32).to(torch.uint16).view(torch.int16)
    old = {"w": specials.view(torch.bfloat16).clone()}
    new = {"w": specials.flip(0).view(torch.bfloat16).clone()}
    delta, stats = dcr.diff_tensors(old, new)
    assert stats["changed_elements"] == 8
    tgt = {"w": old["w"].clone()}
    dcr.apply_tensors(delta, tgt)
    assert torch.equal(tgt["w"].view(torch.int16), new["w"].view(torch.int16))


def test_numpy_arrays_zero_copy_in_place(rng):
    old = {"a": rng.standard_normal(10_000).astype(np.float32), "b": rng.integers(0, 9, 77).astype(np.int64)}
    new = {k: v.copy() for k, v in old.items()}
    new["a"][::97] += 1.0
    delta, _ = dcr.diff_tensors(old, new)
    target = {k: v.copy() for k, v in old.items()}
    ptr = target["a"].ctypes.data
    dcr.apply_tensors(delta, target)
    assert target["a"].ctypes.data == ptr  # applied in place
    assert target["a"].tobytes() == new["a"].tobytes() and target["b"].tobytes() == new["b"].tobytes()


def test_wrong_base_refused_before_any_byte_changes(rng):
    old = {"a": rng.standard_normal(1000).astype(np.float32)}
    new = {"a": old["a"] + 1}
    delta, _ = dcr.diff_tensors(old, new)
    other = {"a": old["a"] * 2}
    before = other["a"].copy()
    with pytest.raises(dcr.BaseMismatchError, match="dense refit"):
        dcr.apply_tensors(delta, other)
    assert other["a"].tobytes() == before.tobytes()


def test_layout_mismatch_is_named():
    old = {"a": np.zeros(10, np.float32)}
    with pytest.raises(dcr.LayoutMismatchError, match="'a'"):
        dcr.diff_tensors(old, {"a": np.zeros(11, np.float32)})
    delta, _ = dcr.diff_tensors(old, {"a": np.ones(10, np.float32)})
    with pytest.raises(dcr.LayoutMismatchError):
        dcr.apply_tensors(delta, {"a": np.zeros(10, np.float64)})
    # A torch tensor's shape (a torch.Size) against an array's (a list):
    # equal shapes diff, and a mismatch names both as lists.
    t = {"a": torch.zeros(2, 5)}
    _, stats = dcr.diff_tensors(t, {"a": np.ones((2, 5), np.float32)})
    assert stats["changed_elements"] == 10
    with pytest.raises(dcr.LayoutMismatchError, match=r"old is F32\[2, 5\], new is F32\[10\]"):
        dcr.diff_tensors(t, {"a": np.ones(10, np.float32)})


def test_bad_inputs_give_clear_errors():
    with pytest.raises(ValueError, match="not C-contiguous"):
        dcr.diff_tensors({"a": np.zeros((4, 4))[:, 1]}, {"a": np.zeros(4)})
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    delta, _ = dcr.diff_tensors({"a": np.zeros(4, np.float32)}, {"a": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match="read-only"):
        dcr.apply_tensors(delta, {"a": ro})
    shared = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="share memory"):
        dcr.apply_tensors(delta, {"a": shared[:4], "b": shared[:4]})


def test_torch_state_dicts_of_every_kind_are_read_in_place():
    """The core reads plain contiguous CPU tensors itself; parameters,
    non-dict mappings, leaves that need grad and views go their own ways."""
    import types

    gen = torch.Generator().manual_seed(5)
    old = {
        "p": torch.nn.Parameter(random_bits(gen, torch.bfloat16, 300), requires_grad=False),
        "g": torch.nn.Parameter(torch.randn(64, generator=gen)),  # a leaf that needs grad
        "i": random_bits(gen, torch.int32, 50),
        "n": np.arange(40, dtype=np.int16),
    }
    new = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v.copy()) for k, v in old.items()}
    with torch.no_grad():
        new["p"].view(torch.int16)[::7] ^= 1
        new["g"][::3] += 1.0
    new["i"][5] += 1
    new["n"][::4] += 2
    # A read-only mapping in another order: the names, not the order, pair them.
    delta, stats = dcr.diff_tensors(types.MappingProxyType(old), dict(reversed(list(new.items()))))
    assert stats["changed_elements"] == 43 + 22 + 1 + 10
    assert dcr.tensor_digests(old) == dcr.tensor_digests(types.MappingProxyType(dict(old)))
    target = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v.copy()) for k, v in old.items()}
    target["g"] = torch.nn.Parameter(target["g"])  # written in place through its data
    pointers = {k: v.data_ptr() for k, v in target.items() if isinstance(v, torch.Tensor)}
    dcr.apply_tensors(delta, target, base_digests=dcr.tensor_digests(old))
    assert {k: v.data_ptr() for k, v in target.items() if isinstance(v, torch.Tensor)} == pointers
    for k in ("p", "g", "i"):
        assert bits_equal(target[k].detach(), new[k].detach()), k
    assert target["n"].tobytes() == new["n"].tobytes()
    assert dcr.digest_tensors(target) == dcr.digest_tensors(new)

    with pytest.raises(ValueError, match="'v' is not contiguous"):
        dcr.diff_tensors({"v": torch.zeros(4, 4)[:, 1]}, {"v": torch.zeros(4)})
    # Views whose memory holds other bits than their values are refused.
    c = torch.randn(4, dtype=torch.complex64, generator=gen)
    with pytest.raises(ValueError, match="'c' is a lazily conjugated view"):
        dcr.diff_tensors({"c": c.conj()}, {"c": c})
    n = torch.randn(4, generator=gen)
    with pytest.raises(ValueError, match="'n' is a lazily negated view"):
        dcr.tensor_digests({"n": torch._neg_view(n)})
    target_n = {"n": torch._neg_view(n.clone())}
    delta_n, _ = dcr.diff_tensors({"n": n}, {"n": n + 1})
    with pytest.raises(ValueError, match="negated"):
        dcr.apply_tensors(delta_n, target_n)
    assert torch.equal(target_n["n"], -n)  # untouched
    # Plain complex tensors (read through span_of) round-trip.
    target_c = {"c": c.clone()}
    delta_c, _ = dcr.diff_tensors({"c": c}, {"c": c * 2})
    dcr.apply_tensors(delta_c, target_c)
    assert torch.equal(target_c["c"].view(torch.int64), (c * 2).view(torch.int64))
    with pytest.raises(TypeError, match="tensor names must be str"):
        dcr.tensor_digests({3: torch.zeros(2)})
    with pytest.raises(TypeError, match="cannot store"):
        dcr.tensor_digests({"c": torch.zeros(2, dtype=torch.complex128)})
    with pytest.raises(dcr.LayoutMismatchError, match=r"different tensor names \(e.g. \['b', 'c'\]\)"):
        dcr.diff_tensors({"a": torch.zeros(2), "b": torch.zeros(2)}, {"a": torch.zeros(2), "c": torch.zeros(2)})
    with pytest.raises(dcr.LayoutMismatchError, match=r"'a': old is BF16\[2\], new is F32\[2\]"):
        dcr.diff_tensors({"a": torch.zeros(2, dtype=torch.bfloat16)}, {"a": torch.zeros(2)})


def test_gil_is_released_during_work(rng):
    """Another Python thread keeps running while a large diff runs."""
    old = {"a": rng.integers(0, 2**16, 8_000_000, dtype=np.uint16)}
    new = {"a": old["a"] ^ (rng.random(8_000_000) < 0.03).astype(np.uint16)}
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(1)

    t = threading.Thread(target=ticker)
    t.start()
    try:
        for _ in range(3):
            dcr.diff_tensors(old, new, threads=1)
    finally:
        stop.set()
        t.join()
    assert len(ticks) > 100


def test_known_base_digests_give_the_same_delta_and_a_verified_apply():
    """A publisher/receiver that kept the committed version's tensor digests
    skips the full digest pass; the delta is byte-identical, the apply is
    verified from the written words, and digests of another version are
    refused before any byte changes."""
    import torch

    g = torch.Generator().manual_seed(0)
    old = {f"t{i}": torch.randn(300, 70, generator=g).to(torch.bfloat16) for i in range(3)}
    new = {k: v.clone() for k, v in old.items()}
    for v in new.values():
        b = v.view(torch.int16).reshape(-1)
        b[::29] += 1
    digests = dcr.tensor_digests(old)
    assert set(digests) == set(old) and all(len(d) == 16 for d in digests.values())
    plain, _ = dcr.diff_tensors(old, new)
    known, _ = dcr.diff_tensors(old, new, base_digests=digests)
    assert known == plain
    target = {k: v.clone() for k, v in old.items()}
    dcr.apply_tensors(known, target, base_digests=digests)
    assert all(torch.equal(target[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
    wrong = dcr.tensor_digests(new)
    again = {k: v.clone() for k, v in old.items()}
    with pytest.raises(dcr.BaseMismatchError):
        dcr.apply_tensors(known, again, base_digests={**digests, "t1": wrong["t1"]})
    assert all(torch.equal(again[k].view(torch.int16), old[k].view(torch.int16)) for k in old)
    # Digests in any bytes-like form give the same delta; a missing or
    # malformed one is named.
    as_views = {k: memoryview(bytearray(d)) if k == "t0" else bytearray(d) for k, d in digests.items()}
    assert dcr.diff_tensors(old, new, base_digests=as_views)[0] == plain
    with pytest.raises(dcr.LayoutMismatchError, match="lacks 1 tensors.*t2"):
        dcr.diff_tensors(old, new, base_digests={k: d for k, d in digests.items() if k != "t2"})
    with pytest.raises(ValueError, match="tensor t1 has 15 bytes; a tensor digest has 16"):
        dcr.diff_tensors(old, new, base_digests={**digests, "t1": digests["t1"][:15]})


def test_one_thread_runs_on_the_calling_thread_with_the_same_bytes(rng, tmp_path):
    """threads=1 does all the work on the calling thread (no pool thread is
    started) and builds the same delta as a pool; the applies agree."""
    import subprocess
    import sys

    old = {f"t{i}": rng.integers(0, 2**16, 300_000, dtype=np.uint16) for i in range(4)}
    new = {k: v ^ (rng.random(v.size) < 0.03).astype(np.uint16) for k, v in old.items()}
    one, _ = dcr.diff_tensors(old, new, threads=1, mode="context")
    pooled, _ = dcr.diff_tensors(old, new, threads=2, mode="context")
    assert one == pooled
    a = {k: v.copy() for k, v in old.items()}
    b = {k: v.copy() for k, v in old.items()}
    dcr.apply_tensors(one, a, threads=1)
    dcr.apply_tensors(one, b)
    assert all(np.array_equal(a[k], new[k]) and np.array_equal(b[k], new[k]) for k in new)

    # In a fresh process, one-thread calls start no dcr worker thread.
    script = tmp_path / "one_thread.py"
    script.write_text(
        "import os, numpy as np, dcr\n"
        "old = {'w': np.arange(1 << 20, dtype=np.uint16)}\n"
        "new = {'w': old['w'] ^ (np.arange(1 << 20) % 31 == 0).astype(np.uint16)}\n"
        "d, _ = dcr.diff_tensors(old, new, threads=1)\n"
        "dcr.apply_tensors(d, old, threads=1)\n"
        "assert np.array_equal(old['w'], new['w'])\n"
        "names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')]\n"
        "print(sum(n.startswith('dcr-') for n in names))\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0", out.stdout + out.stderr
