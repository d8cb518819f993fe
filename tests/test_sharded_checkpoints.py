"""Sharded checkpoints: a directory of safetensors shards (with or without
`model.safetensors.index.json`), or its index, is one checkpoint to every
file command, whatever the partition into files."""

from __future__ import annotations

import json
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dcr
from dcr._st import save_raw
from conftest import kill_mid_refit, shared_data

CLI = [sys.executable, "-m", "dcr.cli"]


def _read_raw(path: Path) -> dict[str, tuple[str, list[int], np.ndarray]]:
    """Every tensor of a safetensors file as (dtype, shape, raw bytes)."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    data = np.frombuffer(blob, dtype=np.uint8, offset=8 + n)
    return {
        name: (t["dtype"], t["shape"], data[t["data_offsets"][0] : t["data_offsets"][1]])
        for name, t in header.items()
        if name != "__metadata__"
    }


def shard(src: Path, dst: Path, n: int, *, index: bool = True) -> Path:
    """Split `src` into `n` shards the Hugging Face way (names dealt round robin)."""
    tensors = _read_raw(src)
    dst.mkdir(parents=True)
    weight_map = {}
    for k in range(n):
        fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        part = {name: tensors[name] for name in sorted(tensors)[k::n]}
        save_raw(dst / fname, part)
        weight_map.update(dict.fromkeys(part, fname))
    if index:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True)


def shard_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix == ".safetensors"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A real training pair from the shared data when present, else a
    generated one of about the same size (8 MB in 24 tensors, 3 % changed)."""
    root = tmp_path_factory.mktemp("sharded")
    data = shared_data() / "qwen-small-fp32m-3e-6"
    if (data / "step_011.safetensors").exists():
        return data / "step_010.safetensors", data / "step_011.safetensors", root
    from conftest import make_bf16_pair, write_bf16

    shapes = {f"model.layers.{i}.mlp.up_proj.weight": (512, 640) for i in range(12)}
    shapes |= {f"model.layers.{i}.self_attn.q_proj.bias": (64,) for i in range(12)}
    old, new = make_bf16_pair(np.random.default_rng(11), shapes, 0.03)
    return write_bf16(root / "old.safetensors", old), write_bf16(root / "new.safetensors", new), root


def test_a_shard_directory_diffs_and_applies_like_the_consolidated_file(pair, tmp_path):
    old, new, _ = pair
    old_dir, new_dir = shard(old, tmp_path / "old", 3), shard(new, tmp_path / "new", 3)
    from_dirs, from_files = tmp_path / "dirs.dcr", tmp_path / "files.dcr"
    assert cli("diff", old_dir, new_dir, "-o", from_dirs, "-q").returncode == 0
    assert cli("diff", old, new, "-o", from_files, "-q").returncode == 0
    # One canonical layout (names in order), so the very same delta.
    assert from_dirs.read_bytes() == from_files.read_bytes()

    replica = tmp_path / "replica"
    shutil.copytree(old_dir, replica)
    applied = cli("apply", from_dirs, replica)
    assert applied.returncode == 0, applied.stderr
    assert "refit to version 1 committed" in applied.stdout
    assert cli("verify", replica, new_dir).returncode == 0
    assert cli("verify", replica, new).returncode == 0
    # Each shard holds exactly its own tensors of NEW, and the journal lies
    # beside the directory, not in it.
    assert shard_bytes(replica) == shard_bytes(new_dir)
    assert (tmp_path / "replica.dcrj").exists()
    status = json.loads(cli("status", replica, "--json").stdout)
    assert status["committed"]["version"] == 1 and status["target_is_committed"]
    assert dcr.file_digest(replica) == dcr.file_digest(new)

    # The delta built from shards applies to a consolidated copy too.
    single = tmp_path / "single.safetensors"
    shutil.copy(old, single)
    assert cli("apply", from_dirs, single).returncode == 0
    assert not dcr.compare_files(single, new)


def test_partitions_may_differ_and_an_index_path_or_no_index_works(pair, tmp_path):
    old, new, _ = pair
    old_dir = shard(old, tmp_path / "old3", 3, index=False)
    new_dir = shard(new, tmp_path / "new2", 2)
    delta = tmp_path / "d.dcr"
    r = cli("diff", old_dir, new_dir / "model.safetensors.index.json", "-o", delta, "-q")
    assert r.returncode == 0, r.stderr
    replica = shard(old, tmp_path / "replica4", 4)
    assert cli("apply", delta, replica / "model.safetensors.index.json", "-q").returncode == 0
    assert cli("verify", replica, new).returncode == 0
    assert cli("verify", replica, new_dir).returncode == 0
    assert dcr.compare_files(replica, old_dir)  # and it did change


def test_bad_deltas_and_stale_indexes_leave_every_shard_untouched(pair, tmp_path):
    old, new, _ = pair
    old_dir, new_dir = shard(old, tmp_path / "old", 3), shard(new, tmp_path / "new", 3)
    delta = tmp_path / "d.dcr"
    assert cli("diff", old_dir, new_dir, "-o", delta, "-q").returncode == 0
    replica = shutil.copytree(old_dir, tmp_path / "replica")
    before = shard_bytes(replica)

    corrupt = bytearray(delta.read_bytes())
    corrupt[len(corrupt) // 2] ^= 0x40
    bad = tmp_path / "bad.dcr"
    bad.write_bytes(bytes(corrupt))
    r = cli("apply", bad, replica)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert shard_bytes(replica) == before

    # The index says a tensor lives in another shard: refused before anything is read or written.
    index = replica / "model.safetensors.index.json"
    good_index = index.read_text()
    wm = json.loads(good_index)
    name = sorted(wm["weight_map"])[0]
    wm["weight_map"][name] = "model-00003-of-00003.safetensors"
    index.write_text(json.dumps(wm))
    r = cli("apply", delta, replica)
    assert r.returncode == 2 and "the index is stale" in r.stderr and name in r.stderr, r.stderr
    assert shard_bytes(replica) == before

    # A tensor in two shards (a leftover file) is refused, naming both files.
    index.write_text(good_index)
    index.unlink()
    first = replica / "model-00001-of-00003.safetensors"
    shutil.copy(first, replica / "leftover.safetensors")
    r = cli("verify", replica, new)
    assert r.returncode == 2 and "stored twice" in r.stderr and "leftover.safetensors" in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_refit_killed_mid_way_resumes_across_shards(pair, tmp_path):
    old, new, _ = pair
    old_dir, new_dir = shard(old, tmp_path / "old", 4), shard(new, tmp_path / "new", 4)
    delta = tmp_path / "d.dcr"
    assert cli("diff", old_dir, new_dir, "-o", delta, "--chunk-mib", "0.0625", "-q").returncode == 0
    landed = 0
    for attempt in range(6):
        replica = shutil.copytree(old_dir, tmp_path / f"replica{attempt}")
        status = kill_mid_refit([*CLI, "apply", str(delta), str(replica), "--batch-chunks", "1", "-q"], replica)
        if status == -signal.SIGKILL:
            landed += 1
            st = dcr.receiver_status(replica)
            # The base was adopted as version 0; the refit to 1 is in flight.
            assert st["refit"]["version"] == 1 and st["committed"]["version"] == 0, st
        rerun = cli("apply", delta, replica)
        assert rerun.returncode == 0, rerun.stderr
        assert shard_bytes(replica) == shard_bytes(new_dir)
        assert dcr.receiver_status(replica)["committed"]["version"] == 1
        if landed >= 2:
            break
    assert landed >= 1, "no kill landed inside a refit"
