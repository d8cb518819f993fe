from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_data() -> Path:
    env = os.environ.get("DCR_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data"


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def make_bf16_pair(rng: np.random.Generator, shapes: dict[str, tuple[int, ...]], rate: float):
    """Two bf16 'checkpoints' (name -> uint16 bits) where `rate` of the
    elements moved by a few ulps, as an optimizer step does."""
    from dcr._st import f32_to_bf16_bits

    old, new = {}, {}
    for name, shape in shapes.items():
        w = rng.normal(0, 0.02, size=shape).astype(np.float32)
        o = f32_to_bf16_bits(w)
        n = o.copy()
        mask = rng.random(size=shape) < rate
        steps = rng.choice(np.array([1, 1, 1, 2, 3, -1, -1, -2], dtype=np.int16), size=shape)
        n[mask] = (o[mask].astype(np.int32) + steps[mask]).astype(np.uint16)
        old[name], new[name] = o, n
    return old, new


def write_bf16(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    from dcr._st import save_raw

    save_raw(path, {k: ("BF16", list(v.shape), v) for k, v in tensors.items()})
    return path


@pytest.fixture
def ckpt_pair(tmp_path: Path, rng: np.random.Generator):
    shapes = {
        "model.embed_tokens.weight": (512, 64),
        "model.layers.0.self_attn.q_proj.weight": (64, 64),
        "model.layers.0.self_attn.q_proj.bias": (64,),
        "model.layers.0.mlp.up_proj.weight": (176, 64),
        "model.norm.weight": (64,),
        "lm_head.weight": (512, 64),
    }
    old, new = make_bf16_pair(rng, shapes, 0.03)
    return write_bf16(tmp_path / "old.safetensors", old), write_bf16(tmp_path / "new.safetensors", new)


def kill_once_refit_started(proc: subprocess.Popen, target: Path, timeout: float = 60) -> bool:
    """Poll the journal of `target` while `proc` (a `dcr apply` or `dcr
    receive` into it) runs, and SIGKILL it as soon as a chunk of a refit has
    started. True when it was killed, False when it finished (or `timeout`
    passed) first; the caller collects its exit."""
    import dcr

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            st = dcr.receiver_status(target)
        except dcr.DcrError:
            st = {}
        if st.get("refit") and st["refit"]["applied"] + st["refit"]["in_progress"] > 0:
            proc.kill()
            return True
        time.sleep(0.001)
    return False


def kill_mid_refit(cmd: list[str], target: Path, timeout: float = 60) -> int:
    """Run `cmd` (a `dcr apply` or `dcr receive` into `target`) and SIGKILL it
    as soon as a chunk of a refit has started. Returns the exit status:
    negative when killed, 0 when the command finished first."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_once_refit_started(proc, target, timeout)
    return proc.wait()
