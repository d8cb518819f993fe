"""Receivers on a live vLLM engine (CPU build), each scenario in its own
process (``tests/_vllm_refit_check.py``): tiny Llama and Qwen3-MoE with
random weights, in vLLM's default CPU layout (linear weights repacked, a
transforming loader, where vLLM's packed CPU GEMMs run on the host; plain
on others, such as AVX2-only x86) and in the plain layout
(``plain_cpu_layout``). After
each of two chained delta refits every parameter and buffer, and greedy
generations, must equal a dense refit (``reload_weights`` with the full new
checkpoint) of the same engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcr._procs import env_importing_this_dcr

# vLLM may live in its own environment (.ci/install-vllm: its deps pin numpy < 2.4)
PYTHON = os.environ.get("DCR_VLLM_PYTHON") or sys.executable
SCRIPT = Path(__file__).with_name("_vllm_refit_check.py")


def _has_vllm() -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([PYTHON, "-c", probe], capture_output=True).returncode == 0


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _has_vllm(), reason=f"vLLM is not installed for {PYTHON} (see docs/receivers.md)"),
]


def run(kind: str, layout: str, tmp_path: Path) -> dict:
    p = subprocess.run(
        [PYTHON, str(SCRIPT), kind, layout, str(tmp_path)],
        capture_output=True, text=True, timeout=540, env=env_importing_this_dcr(tmp_path / "this-dcr"),
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("layout", ["packed", "plain"])
@pytest.mark.parametrize("kind", ["llama", "qwen3moe"])
def test_vllm_delta_refit_equals_dense(kind: str, layout: str, tmp_path: Path) -> None:
    r = run(kind, layout, tmp_path)
    tf = r["transforming"]
    if layout == "plain":
        assert r["repacked"] == [], r["repacked"]
    # vLLM's default CPU layout repacks the linears where its packed GEMMs
    # run on this CPU; elsewhere (AVX2-only x86, for one) it keeps them
    # plain, and the default layout is the plain one.
    repacked = bool(r["repacked"])
    if not repacked:
        assert tf == [] and r["shadow_bytes"] == 0
    else:
        # repacked linears (and lm_head/embedding with packed copies) go through reload_weights
        assert "lm_head.weight" in tf and "model.layers.0.self_attn.q_proj.weight" in tf
        assert "model.norm.weight" not in tf
    if kind == "llama":
        # probing + restore leaves the engine generating exactly as before
        assert r["gen_restored"]
    # the second step's delta is context-coded: decoded against the
    # engine's canonical base
    assert [s["context_chunks"] for s in r["steps"]] == [False, True]
    for s in r["steps"]:
        assert s["mismatched"] == [], s["mismatched"]
        assert s["compared"] > 20
        assert s["gen_equal"], (s["gen_delta"], s["gen_dense"])
        assert s["gen_changed"]
        assert (s["stats"]["reloaded_groups"] > 0) == repacked
