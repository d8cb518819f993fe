"""dcr.cuda: the reference path against an independent numpy oracle (CPU),
the impl selection logic, and CUDA-vs-reference bit for bit (GPU, skipped
without one)."""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dcr.cuda as dc  # noqa: E402
from dcr.cuda import _driver  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.bfloat16,
    torch.float16,
    torch.int16,
    torch.float32,
    torch.int32,
    torch.float64,
    torch.int64,
]
WORD_NP = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _ids(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def random_pair(
    dtype: torch.dtype, n: int, frac: float, seed: int, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bit patterns (NaN payloads, subnormals, -0.0 included) and a
    copy where about `frac` of the words got new random bits."""
    g = torch.Generator().manual_seed(seed)
    w = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * w,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw & 1  # a bool byte must be 0 or 1
    old = raw.view(dtype)
    new = old.clone()
    mask = torch.rand(n, generator=g) < frac
    k = int(mask.sum())
    if k:
        fresh = torch.randint(0, 256, (k * w,), dtype=torch.uint8, generator=g)
        if dtype == torch.bool:
            fresh = fresh & 1
        new_w = new.view(torch.uint8).view(-1, w)
        new_w[mask] = fresh.view(-1, w)
    return old.to(device), new.to(device)


def np_words(t: torch.Tensor) -> np.ndarray:
    w = t.element_size()
    b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return b.view(WORD_NP[w])


def np_oracle(old: torch.Tensor, new: torch.Tensor, chunk: int) -> tuple[np.ndarray, ...]:
    o, n = np_words(old), np_words(new)
    nchunks = -(-o.size // chunk)
    changed = np.flatnonzero(o != n)
    counts = np.bincount(changed // chunk, minlength=nchunks).astype(np.int64)
    return counts, (changed % chunk).astype(np.int64), (o ^ n)[changed], n[changed]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(np.array_equal(np_words(a), np_words(b)))


# ----------------------------------------------------------------- CPU twin


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("chunk", [1, 7, 64, 4096, 1 << 20])
def test_reference_matches_numpy_oracle(dtype: torch.dtype, chunk: int) -> None:
    old, new = random_pair(dtype, 3001, 0.05, seed=hash((str(dtype), chunk)) & 0xFFFF)
    counts, positions, values, new_values = dc.sparse_diff(old, new, chunk, impl="cpu", with_new=True)
    e_counts, e_pos, e_vals, e_new = np_oracle(old, new, chunk)
    assert counts.dtype == torch.int64 and positions.dtype == torch.int32
    assert values.element_size() == old.element_size() == new_values.element_size()
    np.testing.assert_array_equal(counts.numpy(), e_counts)
    np.testing.assert_array_equal(positions.numpy().astype(np.int64), e_pos)
    np.testing.assert_array_equal(np_words(values), e_vals)
    np.testing.assert_array_equal(np_words(new_values), e_new)
    # round trips: xor onto old, scatter new values onto old
    t = old.clone()
    dc.apply_xor(t, chunk, counts, positions, values, impl="cpu")
    assert same_bits(t, new)
    t = old.clone()
    dc.apply_overwrite(t, chunk, counts, positions, new_values, impl="cpu")
    assert same_bits(t, new)


def test_float_specials_are_bits_not_values() -> None:
    qnan = torch.tensor([0x7FC0], dtype=torch.int16).view(torch.bfloat16)
    payload = torch.tensor([0x7FC1], dtype=torch.int16).view(torch.bfloat16)
    old = torch.cat([torch.tensor([0.0, 1.0, 1e-40], dtype=torch.bfloat16), qnan, qnan])
    new = torch.cat([torch.tensor([-0.0, 1.0, 1e-40], dtype=torch.bfloat16), qnan, payload])
    counts, positions, values = dc.sparse_diff(old, new, 4, impl="cpu")
    # -0.0 vs 0.0 changed; equal NaNs unchanged although NaN != NaN; payloads differ
    assert counts.tolist() == [1, 1]
    assert positions.tolist() == [0, 0]
    assert values.view(torch.uint16).tolist() == [0x8000, 0x0001]
    f = torch.tensor([float("nan"), -0.0], dtype=torch.float32)
    c, _, _ = dc.sparse_diff(f, f.clone(), 8, impl="cpu")
    assert c.tolist() == [0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float64], ids=_ids)
def test_update_baseline(dtype: torch.dtype) -> None:
    old, new = random_pair(dtype, 5000, 0.03, seed=3)
    before = old.clone()
    counts, positions, values = dc.sparse_diff(old, new, 1000, impl="cpu", update_baseline=True)
    assert same_bits(old, new)
    dc.apply_xor(old, 1000, counts, positions, values, impl="cpu")  # xor again undoes
    assert same_bits(old, before)


def test_shapes_and_empty() -> None:
    a = torch.zeros(0, dtype=torch.float16)
    counts, positions, values = dc.sparse_diff(a, a.clone(), 16, impl="cpu")
    assert counts.numel() == 0 and positions.numel() == 0 and values.numel() == 0
    s_old, s_new = torch.tensor(1.5), torch.tensor(2.5)
    counts, positions, values = dc.sparse_diff(s_old, s_new, 16, impl="cpu")
    assert counts.tolist() == [1] and positions.tolist() == [0]
    m_old, m_new = random_pair(torch.float32, 64 * 33, 0.1, seed=9)
    c1 = dc.sparse_diff(m_old.view(64, 33), m_new.view(64, 33), 100, impl="cpu")
    c2 = dc.sparse_diff(m_old, m_new, 100, impl="cpu")
    assert all(torch.equal(x, y) for x, y in zip(c1, c2))


def test_chunk_starts_apply_into_ranges() -> None:
    # two ranges of a bigger flat buffer, each updated by its own chunk
    target = torch.zeros(100, dtype=torch.int32)
    counts = torch.tensor([2, 1])
    positions = torch.tensor([0, 3, 2], dtype=torch.int32)
    values = torch.tensor([5, 6, 7], dtype=torch.int32)
    dc.apply_overwrite(target, 10, counts, positions, values, impl="cpu", chunk_starts=torch.tensor([40, 90]))
    assert target.nonzero().reshape(-1).tolist() == [40, 43, 92]
    dc.apply_xor(target, 10, counts, positions, values, impl="cpu", chunk_starts=torch.tensor([40, 90]))
    assert int(target.abs().sum()) == 0


def test_apply_rejects_bad_entries() -> None:
    t = torch.zeros(10, dtype=torch.float32)
    v = torch.ones(1, dtype=torch.float32)
    with pytest.raises(ValueError, match="outside the target"):
        dc.apply_xor(t, 8, torch.tensor([0, 1]), torch.tensor([5], dtype=torch.int32), v, impl="cpu")
    with pytest.raises(ValueError, match=">= chunk_elems"):
        dc.apply_xor(t, 4, torch.tensor([1, 0, 0]), torch.tensor([4], dtype=torch.int32), v, impl="cpu")
    with pytest.raises(ValueError, match="sum to the number of entries"):
        dc.apply_xor(t, 4, torch.tensor([2, 0, 0]), torch.tensor([1], dtype=torch.int32), v, impl="cpu")
    with pytest.raises(ValueError, match="one 4-byte word per position"):
        dc.apply_xor(t, 4, torch.tensor([1]), torch.tensor([1], dtype=torch.int32), v.double(), impl="cpu")
    with pytest.raises(TypeError, match="int32/uint32"):
        dc.apply_xor(t, 4, torch.tensor([1]), torch.tensor([1]), v, impl="cpu")
    assert int(t.abs().sum()) == 0  # nothing was written


def test_diff_rejects_mismatches() -> None:
    a = torch.zeros(8, dtype=torch.float32)
    with pytest.raises(ValueError, match="same dtype and shape"):
        dc.sparse_diff(a, a.to(torch.int32), 4, impl="cpu")
    with pytest.raises(ValueError, match="same dtype and shape"):
        dc.sparse_diff(a, a[:4].clone(), 4, impl="cpu")
    with pytest.raises(ValueError, match="contiguous"):
        dc.sparse_diff(a.view(2, 4).t(), a.view(2, 4).t().clone(), 4, impl="cpu")
    with pytest.raises(ValueError, match="chunk_elems"):
        dc.sparse_diff(a, a.clone(), 0, impl="cpu")
    with pytest.raises(TypeError, match="only 1, 2, 4 and 8-byte"):
        z = torch.zeros(4, dtype=torch.complex128)
        dc.sparse_diff(z, z.clone(), 4, impl="cpu")
    with pytest.raises(ValueError, match="strategy"):
        dc.sparse_diff(a, a.clone(), 4, impl="cpu", strategy="fast")


# ----------------------------------------------------------------- impl selection


def test_auto_on_cpu_tensors_uses_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(idx: int) -> None:
        raise AssertionError("auto on CPU tensors must not try to load CUDA kernels")

    monkeypatch.setattr(dc, "_kernels", boom)
    old, new = random_pair(torch.bfloat16, 1000, 0.1, seed=1)
    got = dc.sparse_diff(old, new, 128)  # impl="auto"
    want = dc.sparse_diff(old, new, 128, impl="cpu")
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    t = old.clone()
    dc.apply_xor(t, 128, *got)
    assert same_bits(t, new)


def test_cuda_on_cpu_tensors_is_one_clear_error() -> None:
    a = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(dc.KernelsUnavailable, match=r"CUDA kernels requested but .*: use impl='cpu' or 'auto'"):
        dc.sparse_diff(a, a.clone(), 4, impl="cuda")
    with pytest.raises(dc.KernelsUnavailable, match="use impl='cpu' or 'auto'"):
        dc.apply_xor(a, 4, torch.tensor([0, 0]), torch.zeros(0, dtype=torch.int32), a[:0], impl="cuda")
    with pytest.raises(dc.KernelsUnavailable, match="use impl='cpu' or 'auto'"):
        dc.apply_overwrite(a, 4, torch.tensor([0, 0]), torch.zeros(0, dtype=torch.int32), a[:0], impl="cuda")


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA message")
def test_no_cuda_message_names_the_cause() -> None:
    a = torch.zeros(8)
    with pytest.raises(dc.KernelsUnavailable, match=r"torch.cuda.is_available\(\) is False"):
        dc.sparse_diff(a, a.clone(), 4, impl="cuda")
    with pytest.raises(dc.KernelsUnavailable, match="use impl='cpu' or 'auto'"):
        dc.load_kernels()
    assert dc.kernels_available() is False


def test_bad_impl_name() -> None:
    a = torch.zeros(8)
    with pytest.raises(ValueError, match="impl must be one of"):
        dc.sparse_diff(a, a.clone(), 4, impl="gpu")


def test_import_dcr_does_not_import_torch() -> None:
    code = "import sys, dcr, dcr.cuda; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_launcher_argument_checks() -> None:
    t = torch.zeros(4)
    args = [t, t, _driver.U64(4), _driver.U64(2), _driver.I32(1), t, t]
    dc._check_args("diff_count", args)
    with pytest.raises(TypeError, match="argument 2 should be u64"):
        dc._check_args("diff_count", [t, t, 4, *args[3:]])
    with pytest.raises(TypeError, match="7 arguments for 11"):
        dc._check_args("diff_compact", args)
    with pytest.raises(OverflowError):
        _driver.U64(-1)
    with pytest.raises(OverflowError):
        _driver.I32(1 << 31)
    assert _driver._c_arg(_driver.U64((1 << 64) - 1)).value == (1 << 64) - 1
    assert _driver._c_arg(None).value is None


def test_configure_validates() -> None:
    saved = dc.configure()
    try:
        with pytest.raises(ValueError, match="vecs must be 1, 2 or 4"):
            dc.configure(vecs=3)
        assert dc.configure(vecs=2)["vecs"] == 2
        assert dc.tile_bytes(2) == 8192
    finally:
        dc.configure(**saved)
    assert dc.configure() == saved


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setenv("DCR_CACHE", str(tmp_path))
    assert str(dc._cache_dir()).startswith(str(tmp_path))


# ----------------------------------------------------------------- GPU


def cuda_vs_reference(
    old: torch.Tensor, new: torch.Tensor, chunk: int, strategy: str, update: bool, **kw: object
) -> None:
    ref_old = old.clone()
    want = dc.sparse_diff(ref_old, new, chunk, impl="cpu", update_baseline=update, with_new=True)
    got_old = old.clone()
    got = dc.sparse_diff(got_old, new, chunk, impl="cuda", update_baseline=update, with_new=True, strategy=strategy, **kw)
    torch.cuda.synchronize()
    names = ("counts", "positions", "values", "new_values")
    for nm, g, w in zip(names, got, want):
        assert g.dtype == w.dtype, nm
        assert torch.equal(g, w), f"{nm} differ ({strategy}, chunk={chunk}, n={old.numel()}, {old.dtype})"
    assert same_bits(got_old, ref_old)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("strategy", ["onepass", "twopass"])
@pytest.mark.parametrize("n,chunk", [(1, 1), (1000, 64), (16384, 16384), (70001, 4097), (300_000, 1 << 20), (2_000_003, 65536)])
@pytest.mark.parametrize("update", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_diff_matches_reference(dtype: torch.dtype, strategy: str, n: int, chunk: int, update: bool) -> None:
    old, new = random_pair(dtype, n, 0.04, seed=n ^ chunk, device="cuda")
    cuda_vs_reference(old, new, chunk, strategy, update)


@pytest.mark.parametrize("frac", [0.0, 1e-5, 0.3, 1.0])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_diff_change_rates(frac: float) -> None:
    old, new = random_pair(torch.bfloat16, 1_500_000, frac, seed=11, device="cuda")
    for strategy in ("onepass", "twopass"):
        cuda_vs_reference(old, new, 1 << 16, strategy, True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_diff_many_tiles_lookback() -> None:
    # ~16k tiles: the decoupled look-back crosses many windows of 32
    g = torch.Generator(device="cuda").manual_seed(5)
    old = torch.randint(-(2**15), 2**15, (1 << 27,), dtype=torch.int16, device="cuda", generator=g).view(torch.bfloat16)
    new = old.clone()
    idx = torch.randint(0, old.numel(), (old.numel() // 33,), device="cuda", generator=g)
    new.view(torch.int16)[idx] ^= 0x0101
    for chunk in (1 << 20, 1000003):
        cuda_vs_reference(old, new, chunk, "onepass", False)
    a = dc.sparse_diff(old, new, 1 << 20, impl="cuda")
    b = dc.sparse_diff(old, new, 1 << 20, impl="cuda")
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # deterministic


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64], ids=_ids)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_misaligned_views(dtype: torch.dtype) -> None:
    base_old, base_new = random_pair(dtype, 200_001, 0.05, seed=2, device="cuda")
    for off in (1, 3):
        old, new = base_old[off:], base_new[off - 1 : -1] if off > 1 else base_new[1:]
        assert old.data_ptr() % 16 != 0 or new.data_ptr() % 16 != 0
        cuda_vs_reference(old, new, 5000, "onepass", False)
        cuda_vs_reference(old, new, 5000, "twopass", True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_onepass_capacity_overflow_reverts_and_reruns() -> None:
    old, new = random_pair(torch.float16, 500_000, 0.2, seed=8, device="cuda")
    for cap in (0, 10, 50_000):
        cuda_vs_reference(old, new, 30_000, "onepass", True, capacity=cap)
        cuda_vs_reference(old, new, 30_000, "onepass", False, capacity=cap)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_apply_matches_reference(dtype: torch.dtype) -> None:
    for n, chunk in ((1000, 7), (3_000_001, 1 << 16), (3_000_001, 1 << 22)):
        old, new = random_pair(dtype, n, 0.05, seed=n, device="cuda")
        counts, positions, values, new_values = dc.sparse_diff(old, new, chunk, impl="cpu", with_new=True)
        for fn, vals in ((dc.apply_xor, values), (dc.apply_overwrite, new_values)):
            t_gpu, t_ref = old.clone(), old.clone()
            fn(t_gpu, chunk, counts, positions, vals, impl="cuda")
            fn(t_ref, chunk, counts, positions, vals, impl="cpu")
            torch.cuda.synchronize()
            assert same_bits(t_gpu, t_ref) and same_bits(t_gpu, new), f"{fn.__name__} {n}/{chunk}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_apply_chunk_starts_and_bounds() -> None:
    target = torch.zeros(100, dtype=torch.int32, device="cuda")
    counts = torch.tensor([2, 0, 1], device="cuda")
    positions = torch.tensor([0, 3, 2], dtype=torch.int32, device="cuda")
    values = torch.tensor([5, 6, 7], dtype=torch.int32, device="cuda")
    starts = torch.tensor([40, 60, 90], device="cuda")
    dc.apply_overwrite(target, 10, counts, positions, values, impl="cuda", chunk_starts=starts)
    assert target.nonzero().reshape(-1).tolist() == [40, 43, 92]
    with pytest.raises(ValueError, match="outside the target"):
        dc.apply_xor(target, 10, counts, positions, values, impl="cuda", chunk_starts=starts + 9)
    with pytest.raises(ValueError, match="sum to the number of entries"):
        dc.apply_xor(target, 10, counts + 1, positions, values, impl="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_loader_reports_origin_and_caches(monkeypatch: pytest.MonkeyPatch, tmp_path: object, caplog: pytest.LogCaptureFixture) -> None:
    origin = dc.load_kernels("cuda")
    assert origin in ("prebuilt", "cache", "nvrtc", "nvrtc-ptx", "torch.cuda._compile_kernel", "load_inline")
    assert dc.kernels_available("cuda")
    # a fresh cache dir: compile, store, then load from the cache
    monkeypatch.setenv("DCR_CACHE", str(tmp_path))
    monkeypatch.setattr(dc, "_loaded", {})
    monkeypatch.setattr(dc, "_failed", {})
    assert dc.load_kernels("cuda") == "nvrtc"
    monkeypatch.setattr(dc, "_loaded", {})
    assert dc.load_kernels("cuda") == "cache"
    # a prebuilt CUBIN wins over the cache
    from pathlib import Path

    monkeypatch.setattr(dc, "PREBUILT_DIR", Path(str(tmp_path)) / "prebuilt")
    major, minor = torch.cuda.get_device_capability()
    dc.prebuild([f"{major}{minor}"])
    monkeypatch.setattr(dc, "_loaded", {})
    assert dc.load_kernels("cuda") == "prebuilt"
    old, new = random_pair(torch.bfloat16, 100_000, 0.05, seed=12, device="cuda")
    cuda_vs_reference(old, new, 4096, "onepass", True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_auto_falls_back_with_one_log_line(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(dc, "_loaded", {})
    monkeypatch.setattr(dc, "_failed", {torch.cuda.current_device(): "simulated failure"})
    monkeypatch.setattr(dc, "_warned", set())
    old, new = random_pair(torch.bfloat16, 10_000, 0.1, seed=4, device="cuda")
    with caplog.at_level(logging.WARNING, logger="dcr.cuda"):
        got = dc.sparse_diff(old, new, 1024)
        dc.sparse_diff(old, new, 1024)
    assert sum("simulated failure" in r.getMessage() for r in caplog.records) == 1
    want = dc.sparse_diff(old, new, 1024, impl="cpu")
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    with pytest.raises(dc.KernelsUnavailable, match="could not be loaded .*simulated failure"):
        dc.sparse_diff(old, new, 1024, impl="cuda")


@pytest.mark.parametrize("vecs,min_blocks", [(2, 0), (1, 0), (4, 4)])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_tuning_variants(vecs: int, min_blocks: int) -> None:
    saved = dc.configure()
    try:
        dc.configure(vecs=vecs, min_blocks=min_blocks)
        for dtype in (torch.uint8, torch.bfloat16, torch.float64):
            old, new = random_pair(dtype, 1_000_003, 0.05, seed=vecs, device="cuda")
            for strategy in ("onepass", "twopass"):
                cuda_vs_reference(old, new, 40_000, strategy, True)
            cuda_vs_reference(old, new, 40_000, "onepass", True, capacity=100)
    finally:
        dc.configure(**saved)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_runs_on_a_side_stream() -> None:
    old, new = random_pair(torch.bfloat16, 1_000_000, 0.05, seed=6, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = dc.sparse_diff(old, new, 1 << 16, impl="cuda")
    torch.cuda.synchronize()
    want = dc.sparse_diff(old, new, 1 << 16, impl="cpu")
    assert all(torch.equal(x, y) for x, y in zip(got, want))


# ----------------------------------------------------------------- CPU emulation of the kernels


@pytest.mark.slow
@pytest.mark.parametrize("vecs", [4, 2])
def test_kernels_emulated_on_cpu(tmp_path: object, vecs: int) -> None:
    """Compile cuda/dcr_kernels.cu as C++ with tests/cuda_emu/emu.h (threads
    for CUDA threads, a process per block, emulated warp intrinsics) and check
    every kernel against a serial reference. Catches logic errors in ranking,
    scan, look-back and chunk bookkeeping without a GPU."""
    import shutil
    from pathlib import Path

    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++/clang++) for the kernel emulation")
    here = Path(__file__).resolve().parent / "cuda_emu"
    src = dc.kernel_source_path()
    exe = Path(str(tmp_path)) / "emu"
    build = subprocess.run(
        [cxx, "-std=c++20", "-O1", "-pthread", f'-DDCR_KERNELS="{src}"', f"-DDCR_VECS={vecs}",
         str(here / "emu_main.cpp"), "-o", str(exe)],  # fmt: skip
        capture_output=True,
        text=True,
    )
    if build.returncode != 0 and "barrier" in build.stderr:
        pytest.skip(f"{cxx} lacks C++20 <barrier>: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe), "4"], capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    assert "PASSED: 0 failures" in run.stdout


# ----------------------------------------------------------------- the real launch path, emulated driver


@pytest.fixture(scope="module", params=[4, 2], ids=["vecs4", "vecs2"])
def fake_driver(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """tests/cuda_emu/fake_libcuda.cpp built as a shared library: the driver
    calls dcr.cuda._driver makes, with kernels emulated on host memory."""
    import shutil
    from pathlib import Path

    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++/clang++) for the emulated driver")
    vecs = request.param
    here = Path(__file__).resolve().parent / "cuda_emu"
    lib = tmp_path_factory.mktemp("fakecuda") / f"libfakecuda_v{vecs}.so"
    build = subprocess.run(
        [cxx, "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", f'-DDCR_KERNELS="{dc.kernel_source_path()}"',
         f"-DDCR_VECS={vecs}", str(here / "fake_libcuda.cpp"), "-o", str(lib)],
        capture_output=True, text=True,
    )  # fmt: skip
    if build.returncode != 0 and "barrier" in build.stderr:
        pytest.skip(f"{cxx} lacks C++20 <barrier>")
    assert build.returncode == 0, build.stderr[-4000:]
    return str(lib), vecs


@pytest.fixture
def emulated_cuda(fake_driver: tuple[str, int], monkeypatch: pytest.MonkeyPatch) -> object:
    """impl='cuda' on CPU tensors goes through dc._driver into the fake driver."""
    lib, vecs = fake_driver
    monkeypatch.setenv("DCR_LIBCUDA", lib)
    monkeypatch.setattr(_driver, "_libcuda", None)
    loaded = dc._Loaded(_driver.Module(b"fake image", 0), "emulated", vecs)
    real_select = dc._select

    def select(impl: str, tensors: list, what: str) -> object:
        return loaded if impl == "cuda" else real_select(impl, tensors, what)

    monkeypatch.setattr(dc, "_select", select)
    yield loaded
    monkeypatch.setattr(_driver, "_libcuda", None)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bool, torch.float8_e5m2, torch.bfloat16, torch.float32, torch.int64], ids=_ids)
def test_launch_path_on_emulated_driver(emulated_cuda: object, dtype: torch.dtype) -> None:
    w = torch.empty((), dtype=dtype).element_size()
    tile = emulated_cuda.tile_bytes // w  # type: ignore[attr-defined]
    for n, chunk, frac in ((1, 1, 1.0), (tile * 2 + 3, 1000, 0.05), (tile * 3, tile, 0.02), (5000, 1 << 20, 0.0)):
        old, new = random_pair(dtype, n, frac, seed=n + w)
        for strategy, capacity in (("onepass", None), ("twopass", None), ("onepass", 7)):
            for update in (False, True):
                ref_old, got_old = old.clone(), old.clone()
                want = dc.sparse_diff(ref_old, new, chunk, impl="cpu", update_baseline=update, with_new=True)
                got = dc.sparse_diff(
                    got_old, new, chunk, impl="cuda", update_baseline=update, with_new=True,
                    strategy=strategy, capacity=capacity,
                )  # fmt: skip
                for nm, g, e in zip(("counts", "positions", "values", "new_values"), got, want):
                    assert g.dtype == e.dtype and torch.equal(g, e), f"{nm}: n={n} chunk={chunk} {strategy} cap={capacity}"
                assert same_bits(got_old, ref_old)
        counts, positions, values, new_values = want
        t = old.clone()
        dc.apply_xor(t, chunk, counts, positions, values, impl="cuda")
        assert same_bits(t, new)
        t = old.clone()
        dc.apply_overwrite(t, chunk, counts, positions, new_values, impl="cuda")
        assert same_bits(t, new)


@pytest.mark.slow
def test_launch_path_apply_ranges_and_errors_on_emulated_driver(emulated_cuda: object) -> None:
    target = torch.zeros(100, dtype=torch.int32)
    counts = torch.tensor([2, 0, 1])
    positions = torch.tensor([0, 3, 2], dtype=torch.int32)
    values = torch.tensor([5, 6, 7], dtype=torch.int32)
    starts = torch.tensor([40, 60, 90])
    dc.apply_overwrite(target, 10, counts, positions, values, impl="cuda", chunk_starts=starts)
    assert target.nonzero().reshape(-1).tolist() == [40, 43, 92]
    with pytest.raises(ValueError, match="outside the target"):
        dc.apply_xor(target, 10, counts, positions, values, impl="cuda", chunk_starts=starts + 9)
    assert target[99].item() == 0  # the bad entry was skipped
    with pytest.raises(ValueError, match="sum to the number of entries"):
        dc.apply_xor(target, 10, counts + 1, positions, values, impl="cuda")
    with pytest.raises(ValueError, match="outside the target"):
        dc.apply_xor(target, 10, counts, torch.tensor([0, 3, 10], dtype=torch.int32), values, impl="cuda")
    # uint32 positions are accepted as they are
    t = torch.zeros(30, dtype=torch.int16)
    dc.apply_overwrite(t, 10, torch.tensor([1, 1]), torch.tensor([9, 0], dtype=torch.uint32),
                       torch.tensor([1, 2], dtype=torch.int16), impl="cuda")  # fmt: skip
    assert t.nonzero().reshape(-1).tolist() == [9, 10]


@pytest.mark.slow
def test_driver_errors_are_reported(emulated_cuda: object) -> None:
    m = emulated_cuda.module  # type: ignore[attr-defined]
    with pytest.raises(_driver.DriverError, match=r"cuModuleGetFunction\(dcr_nope\).*NOT_FOUND"):
        m.function("dcr_nope")
    with pytest.raises(_driver.DriverError, match=r"cuLaunchKernel"):
        m.launch("dcr_apply_xor_w4", 1, 128, [None] * 10, 0)  # the fake insists on 256 threads
    m.launch("dcr_apply_xor_w4", 0, 256, [], 0)  # an empty grid launches nothing
