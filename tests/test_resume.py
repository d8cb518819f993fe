"""Crash-safe `dcr apply`: SIGKILL the process at random points, rerun it to
completion, and check every refit ends bit-exact at the new version."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import dcr
from conftest import kill_mid_refit, kill_once_refit_started

CLI = [sys.executable, "-m", "dcr.cli"]
KILLS = 100


def _checkpoints(root: Path, n_versions: int = 3) -> list[Path]:
    """A ~2 MiB float32 model and versions with about 1 % of elements changed per step."""
    rng = np.random.default_rng(7)
    state = {f"layers.{i}.weight": rng.standard_normal((256, 512)).astype(np.float32) for i in range(4)}
    state["norm.bias"] = rng.standard_normal(1000).astype(np.float32)
    paths = []
    for v in range(n_versions):
        if v:
            for arr in state.values():
                mask = rng.random(arr.shape) < 0.01
                arr[mask] += np.float32(1e-3)
        p = root / f"v{v}.safetensors"
        save_file(state, str(p))
        paths.append(p)
    return paths


def _diff(old: Path, new: Path, out: Path, base: int, target: int) -> Path:
    cmd = [*CLI, "diff", str(old), str(new), "-o", str(out), "--chunk-mib", "0.0625"]
    subprocess.run([*cmd, "--base-version", str(base), "--target-version", str(target), "-q"], check=True)
    return out


def _apply(delta: Path, target: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "apply", str(delta), str(target), "--batch-chunks", "2", *extra], capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[Path]]:
    root = tmp_path_factory.mktemp("resume")
    versions = _checkpoints(root)
    deltas = [_diff(versions[i], versions[i + 1], root / f"d{i}{i + 1}.dcr", i, i + 1) for i in range(2)]
    return versions, deltas


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_apply_is_resumable_under_sigkill(model: tuple[list[Path], list[Path]], tmp_path: Path) -> None:
    versions, deltas = model
    base, new, delta = versions[0], versions[1], deltas[0]

    # Calibrate the kill window: process start, then the refit itself. Every
    # fifth run of a worker is instead killed as soon as its journal shows a
    # chunk under way, so that refits are cut whatever the host's load does
    # to the timing (two processes at once start slower than the probe).
    probe = tmp_path / "probe.safetensors"
    shutil.copy(base, probe)
    t0 = time.perf_counter()
    assert _apply(delta, probe).returncode == 0
    full = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert "target version 1" in _apply(delta, probe).stdout
    noop = time.perf_counter() - t0
    lo, hi = 0.6 * noop, 1.2 * max(full, noop + 0.05)

    lock = threading.Lock()
    stats = {"kills": 0, "mid_refit": 0, "episodes": 0}
    failures: list[str] = []

    def worker(wid: int) -> None:
        try:
            episodes(wid)
        except Exception as e:  # noqa: BLE001 - reported through `failures`
            failures.append(f"worker {wid}: {type(e).__name__}: {e}")

    def episodes(wid: int) -> None:
        rnd = random.Random(1000 + wid)
        runs = 0
        target = tmp_path / f"w{wid}" / "replica.safetensors"
        target.parent.mkdir()
        while True:
            with lock:
                if stats["kills"] >= KILLS or failures:
                    return
            shutil.copy(base, target)
            for p in target.parent.glob("replica.safetensors.dcrj*"):
                p.unlink()
            while True:  # one episode: kill until a run completes
                with subprocess.Popen(
                    [*CLI, "apply", str(delta), str(target), "--batch-chunks", "2", "-q"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                ) as proc:
                    with lock:
                        # Enough kills: let the runs of this episode finish.
                        delay = rnd.uniform(lo, hi) if stats["kills"] < KILLS else None
                    runs += 1
                    if delay is not None and runs % 5 == 0:
                        killed = kill_once_refit_started(proc, target)
                        _, err = proc.communicate()
                    else:
                        try:
                            _, err = proc.communicate(timeout=delay)
                        except subprocess.TimeoutExpired:
                            proc.send_signal(signal.SIGKILL)
                            proc.communicate()
                            killed = True
                        else:
                            killed = False
                if killed:
                    st = dcr.receiver_status(target)
                    with lock:
                        stats["kills"] += 1
                        if st["refit"] and st["refit"]["applied"] + st["refit"]["in_progress"] > 0:
                            stats["mid_refit"] += 1
                    continue
                if proc.returncode != 0:
                    failures.append(f"worker {wid}: rerun failed with {proc.returncode}: {err}")
                    return
                break
            differing = dcr.compare_files(target, new)
            if differing:
                failures.append(f"worker {wid}: after resuming, tensors differ: {differing}")
                return
            with lock:
                n_done = stats["episodes"]
            # A second apply is a no-op (checked on some episodes: each costs a process start).
            again = _apply(delta, target) if n_done % 4 == 0 else None
            if again is not None and (again.returncode != 0 or "target version 1" not in again.stdout):
                failures.append(f"worker {wid}: second apply was not a no-op: {again.stdout} {again.stderr}")
                return
            st = dcr.receiver_status(target)
            if st["committed"]["version"] != 1 or st["refit"] is not None or st["undo_bytes"] is not None:
                failures.append(f"worker {wid}: unexpected status after the refit: {st}")
                return
            with lock:
                stats["episodes"] += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert stats["kills"] >= KILLS, stats
    print(f"resume under SIGKILL: {stats}, kill window {lo:.2f}..{hi:.2f} s")
    assert stats["mid_refit"] >= 5, f"too few kills landed inside a refit: {stats} (window {lo:.2f}..{hi:.2f} s)"


def test_apply_refuses_wrong_base_and_replayed_deltas_untouched(
    model: tuple[list[Path], list[Path]], tmp_path: Path
) -> None:
    versions, deltas = model
    target = tmp_path / "replica.safetensors"
    shutil.copy(versions[0], target)
    before = target.read_bytes()
    wrong = _apply(deltas[1], target)
    assert wrong.returncode == 2 and "needs base digest" in wrong.stderr, wrong.stderr
    assert target.read_bytes() == before
    for d in deltas:
        assert _apply(d, target).returncode == 0
    assert not dcr.compare_files(target, versions[2])
    at_v2 = target.read_bytes()
    replay = _apply(deltas[0], target)
    assert replay.returncode == 2 and "version 2 in its journal" in replay.stderr, replay.stderr
    assert target.read_bytes() == at_v2
    again = _apply(deltas[1], target, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["outcome"] == "already_at_target"


def test_status_reports_a_refit_in_flight(model: tuple[list[Path], list[Path]], tmp_path: Path) -> None:
    versions, deltas = model
    target = tmp_path / "replica.safetensors"
    shutil.copy(versions[0], target)
    out = subprocess.run([*CLI, "status", str(target)], capture_output=True, text=True, check=True).stdout
    assert "never refitted" in out
    # Leave a refit in flight by killing the first run as soon as a chunk was started.
    status = kill_mid_refit([*CLI, "apply", str(deltas[0]), str(target), "--batch-chunks", "1", "-q"], target)
    if status == 0:
        pytest.skip("the refit finished before it could be interrupted")
    js = json.loads(
        subprocess.run([*CLI, "status", str(target), "--json"], capture_output=True, text=True, check=True).stdout
    )
    r = js["refit"]
    assert js["committed"]["version"] == 0 and r["version"] == 1
    assert r["applied"] + r["in_progress"] + r["not_started"] == r["chunks"]
    text = subprocess.run([*CLI, "status", str(target)], capture_output=True, text=True, check=True).stdout
    assert "refit in flight to version 1" in text
    done = _apply(deltas[0], target)
    assert done.returncode == 0 and "committed" in done.stdout, done.stdout + done.stderr
    assert not dcr.compare_files(target, versions[1])
