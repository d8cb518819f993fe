"""NVRTC compile check of cuda/dcr_kernels.cu; runs on a CPU-only machine.

Skips only when the NVRTC library (nvidia-cuda-nvrtc wheel) is not
installed at all.
"""

from __future__ import annotations

import re

import pytest

from dcr.cuda import _nvrtc

try:
    _nvrtc.find_nvrtc()
    _NVRTC_MISSING = ""
except _nvrtc.NvrtcNotFound as e:
    _NVRTC_MISSING = str(e).splitlines()[0]

pytestmark = pytest.mark.skipif(bool(_NVRTC_MISSING), reason=f"NVRTC not installed: {_NVRTC_MISSING}")

ARCHS = ("compute_80", "compute_90")


@pytest.fixture(scope="module", params=ARCHS)
def ptx(request: pytest.FixtureRequest) -> tuple[str, str]:
    from dcr.cuda import compile_ptx

    return request.param, compile_ptx(request.param)


def test_every_kernel_has_an_entry(ptx: tuple[str, str]) -> None:
    from dcr.cuda import KERNEL_NAMES

    arch, text = ptx
    assert f".target sm_{arch.split('_')[1]}" in text
    entries = set(re.findall(r"^\.visible \.entry (\w+)\(", text, flags=re.M))
    missing = [k for k in KERNEL_NAMES if k not in entries]
    assert not missing, f"{arch}: kernels missing from PTX: {missing}"
    assert len(KERNEL_NAMES) == 20


def test_no_local_memory_arrays(ptx: tuple[str, str]) -> None:
    # register arrays indexed dynamically would land in local memory
    arch, text = ptx
    assert ".local" not in text, f"{arch}: PTX declares local memory"


def test_kernel_parameters_match_the_launcher(ptx: tuple[str, str]) -> None:
    # the Python launcher passes U64 / I32 / pointers as SIGNATURES says
    from dcr.cuda import SIGNATURES, WIDTHS

    _, text = ptx
    ptx_type = {"ptr": "u64", "u64": "u64", "i32": "u32"}
    for kind, sig in SIGNATURES.items():
        for w in WIDTHS:
            m = re.search(rf"\.entry dcr_{kind}_w{w}\((.*?)\)", text, flags=re.S)
            assert m is not None, f"dcr_{kind}_w{w}"
            params = re.findall(r"\.param \.(\w+)", m.group(1))
            assert params == [ptx_type[t] for t in sig], f"dcr_{kind}_w{w}: {params}"


@pytest.mark.parametrize("arch", ["90", "80"])
def test_cubin_without_spills(arch: str) -> None:
    # the runtime path compiles a CUBIN; ptxas must keep everything in
    # registers (spills would cost bandwidth) within the occupancy budget
    from dcr.cuda import KERNEL_NAMES, ptxas_report

    report = ptxas_report(arch)
    assert sorted(report) == sorted(KERNEL_NAMES)
    for name, r in report.items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{name} spills: {r}"
        assert r["registers"] <= 80, f"{name} uses {r['registers']} registers (3 blocks/SM need <= 80)"
    image = _nvrtc.compile_source(_nvrtc.kernel_source(), "90", target="cubin")
    assert image[:4] == b"\x7fELF"


@pytest.mark.parametrize("vecs,min_blocks", [(1, 0), (2, 0), (2, 4)])
def test_tuning_variants_compile(vecs: int, min_blocks: int) -> None:
    from dcr.cuda import _compile_options

    ptx = _nvrtc.compile_source(
        _nvrtc.kernel_source(), "compute_90", options=_compile_options(vecs, min_blocks)
    ).decode()
    assert ptx.count(".visible .entry") == 20
    with pytest.raises(_nvrtc.NvrtcError, match="DCR_VECS must be 1, 2 or 4"):
        _nvrtc.compile_source(_nvrtc.kernel_source(), "compute_90", options=_compile_options(3, 0))


def test_compile_error_carries_the_log() -> None:
    with pytest.raises(_nvrtc.NvrtcError) as ei:
        _nvrtc.compile_source('extern "C" __global__ void broken() { undeclared_thing(); }', "compute_90")
    assert "undeclared_thing" in str(ei.value)
    assert "undeclared_thing" in ei.value.log


def test_arch_spellings() -> None:
    assert _nvrtc._normalise_arch("sm_90") == ("90", "sm")
    assert _nvrtc._normalise_arch("compute_80") == ("80", "compute")
    assert _nvrtc._normalise_arch(90) == ("90", "")
    assert _nvrtc._normalise_arch("9.0") == ("90", "")
    with pytest.raises(ValueError, match="bad GPU architecture"):
        _nvrtc._normalise_arch("hopper")


def test_cache_key_depends_on_source_and_arch() -> None:
    from dcr.cuda import cache_key

    a = cache_key("90")
    assert a == cache_key("90")
    assert a != cache_key("80")
    assert a != cache_key("90", source=_nvrtc.kernel_source() + "\n// edited\n")
    assert a != cache_key("90", options=("-DDCR_VECS=2",))


def test_prebuild_writes_what_the_loader_looks_for(tmp_path: object) -> None:
    from pathlib import Path

    from dcr.cuda import prebuild, prebuilt_path

    out = Path(str(tmp_path))
    (written,) = prebuild(["sm_90"], out)
    assert written.name == prebuilt_path("90").name
    assert written.read_bytes()[:4] == b"\x7fELF"
    assert "-sm_90-" in written.name
    assert prebuilt_path("90").parent.name == "_prebuilt"
