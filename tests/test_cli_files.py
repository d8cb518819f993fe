"""The `dcr` command line and file-level diff/apply, including hostile deltas."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dcr
from dcr.cli import main
from conftest import shared_data


def run_cli(*args: str) -> tuple[int, str, str]:
    p = subprocess.run([sys.executable, "-m", "dcr.cli", *args], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def test_round_trip_through_the_installed_command(ckpt_pair, tmp_path):
    old, new = ckpt_pair
    delta = tmp_path / "d.dcr"
    exe = shutil.which("dcr")
    assert exe, "the dcr command is installed with the package"
    subprocess.run([exe, "diff", str(old), str(new), "-o", str(delta), "-q"], check=True, timeout=120)
    target = tmp_path / "t.safetensors"
    shutil.copyfile(old, target)
    subprocess.run([exe, "apply", str(delta), str(target), "-q"], check=True, timeout=120)
    assert subprocess.run([exe, "verify", str(target), str(new), "-q"], timeout=120).returncode == 0
    assert target.read_bytes() == new.read_bytes()


def test_second_apply_is_a_noop(ckpt_pair, tmp_path, capsys):
    old, new = ckpt_pair
    delta, target = tmp_path / "d.dcr", tmp_path / "t.safetensors"
    assert main(["diff", str(old), str(new), "-o", str(delta), "-q"]) == 0
    shutil.copyfile(old, target)
    assert main(["apply", str(delta), str(target)]) == 0
    capsys.readouterr()
    assert main(["apply", str(delta), str(target)]) == 0
    assert "already at the delta's target version" in capsys.readouterr().out
    assert target.read_bytes() == new.read_bytes()


def test_verify_names_differing_tensors(ckpt_pair, capsys):
    old, new = ckpt_pair
    assert main(["verify", str(old), str(new)]) == 1
    out = capsys.readouterr().out
    assert "differ in" in out and "lm_head.weight" in out
    assert main(["verify", str(old), str(old), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"identical": True, "differing_tensors": []}


def test_inspect_json_fields(ckpt_pair, tmp_path, capsys):
    old, new = ckpt_pair
    delta = tmp_path / "d.dcr"
    main(["diff", str(old), str(new), "-o", str(delta), "-q"])
    capsys.readouterr()
    assert main(["inspect", str(delta), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["payload_bytes"] == delta.stat().st_size
    assert info["changed_elements"] > 0
    assert info["bytes_per_changed"] == pytest.approx(info["payload_bytes"] / info["changed_elements"])
    per = {t["name"]: t for t in info["tensors"]}
    assert sum(t["changed_elements"] for t in per.values()) == info["changed_elements"]
    assert per["lm_head.weight"]["elements"] == 512 * 64
    # `dcr diff` codes in context mode by default, each chunk falling back
    # to context-free coding only when that is smaller
    assert info["mode"] == "context"
    assert sum(info["modes"].values()) == info["chunks"] == sum(info["encodings"].values())
    assert info["modes"]["context"] > 0
    assert main(["inspect", str(delta)]) == 0
    out = capsys.readouterr().out
    assert "B/chg" in out and f"context {info['modes']['context']}" in out
    free = tmp_path / "free.dcr"
    main(["diff", str(old), str(new), "-o", str(free), "-q", "--mode", "free"])
    capsys.readouterr()
    assert main(["inspect", str(free), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["modes"] == {"free": info["chunks"], "context": 0}


def test_wrong_base_is_refused_with_one_line_and_target_untouched(ckpt_pair, tmp_path):
    old, new = ckpt_pair
    delta = tmp_path / "d.dcr"
    main(["diff", str(old), str(new), "-o", str(delta), "-q"])
    target = tmp_path / "t.safetensors"
    data = bytearray(old.read_bytes())
    data[-1] ^= 0x01  # a third version: neither the delta's base nor its target
    target.write_bytes(bytes(data))
    before = target.read_bytes()
    code, out, err = run_cli("apply", str(delta), str(target))
    assert code == 2
    assert err.count("\n") == 1 and "needs base" in err and "dense refit" in err
    assert target.read_bytes() == before


def test_a_delta_streams_through_a_pipe(ckpt_pair, tmp_path):
    """`-o /dev/stdout` writes the delta into the pipe (the report goes to
    stderr), and `dcr apply /dev/stdin` reads one from a pipe."""
    old, new = ckpt_pair
    made = subprocess.run([sys.executable, "-m", "dcr.cli", "diff", str(old), str(new), "-o", "/dev/stdout"],
                          capture_output=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert made.stdout[:8] == b"DCRDELTA" and b"elements changed" in made.stderr
    target = tmp_path / "t.safetensors"
    shutil.copyfile(old, target)
    applied = subprocess.run([sys.executable, "-m", "dcr.cli", "apply", "/dev/stdin", str(target), "-q"],
                             input=made.stdout, capture_output=True, timeout=120)
    assert applied.returncode == 0, applied.stderr
    assert target.read_bytes() == new.read_bytes()


@pytest.mark.skipif(not Path("/dev/full").is_char_device(), reason="needs Linux's /dev/full")
def test_a_full_device_is_one_clear_error_and_stays_a_device(ckpt_pair):
    old, new = ckpt_pair
    code, out, err = run_cli("diff", str(old), str(new), "-o", "/dev/full")
    assert code == 2 and out == ""
    assert err.startswith("dcr diff: error: write /dev/full") and "device is full" in err and "[Errno" not in err
    assert len(err.strip().splitlines()) == 1
    assert Path("/dev/full").is_char_device()


def test_a_truncated_checkpoint_is_named_as_such(ckpt_pair, tmp_path):
    old, new = ckpt_pair
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(new.read_bytes()[: new.stat().st_size // 2])
    code, _, err = run_cli("diff", str(old), str(cut), "-o", str(tmp_path / "d.dcr"))
    assert code == 2 and "cut.safetensors" in err and "truncated file" in err, err
    assert not (tmp_path / "d.dcr").exists()


def test_missing_files_and_non_deltas_are_clear(ckpt_pair, tmp_path):
    old, new = ckpt_pair
    code, _, err = run_cli("apply", str(tmp_path / "nope.dcr"), str(old))
    assert code == 2 and "nope.dcr" in err
    with pytest.raises(FileNotFoundError):
        dcr.apply_file(tmp_path / "nope.dcr", old)
    with pytest.raises(dcr.CorruptDeltaError, match="not a dcr delta"):
        dcr.apply_file(old, new)  # a safetensors file is no delta
    with pytest.raises(dcr.CheckpointError):
        dcr.diff_files(tmp_path / "x", tmp_path / "y", tmp_path / "z") if False else dcr.compare_files(
            _write(tmp_path / "junk.safetensors", b"\x08" + b"\x00" * 7 + b"{bad json"), old
        )


def _write(p: Path, data: bytes) -> Path:
    p.write_bytes(data)
    return p


def _delta_and_target(tmp_path: Path, old: Path, new: Path) -> tuple[bytes, Path]:
    delta = tmp_path / "base.dcr"
    dcr.diff_files(old, new, delta, chunk_bytes=4096)
    return delta.read_bytes(), delta


@pytest.fixture(scope="module")
def real_pair(tmp_path_factory):
    """A real training pair from the shared data when present, else a generated one."""
    d = shared_data() / "qwen-small-fp32m-3e-6"
    if (d / "step_010.safetensors").exists():
        return d / "step_010.safetensors", d / "step_011.safetensors"
    import numpy as np
    from conftest import make_bf16_pair, write_bf16

    tmp = tmp_path_factory.mktemp("pair")
    o, n = make_bf16_pair(np.random.default_rng(5), {"a": (256, 256), "b": (1024,)}, 0.03)
    return write_bf16(tmp / "o.safetensors", o), write_bf16(tmp / "n.safetensors", n)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_truncated_or_spliced_deltas_never_apply_wrong_bits(real_pair, tmp_path_factory, data):
    old, new = real_pair
    tmp = tmp_path_factory.mktemp("mut")
    good, _ = _delta_and_target(tmp, old, new)
    how = data.draw(st.sampled_from(["flip", "truncate", "splice", "extend"]))
    if how == "flip":
        bad = bytearray(good)
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(bad) - 1))
            bad[i] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        bad = bytearray(good[: data.draw(st.integers(0, len(good) - 1))])
    elif how == "splice":
        a = data.draw(st.integers(0, len(good) - 1))
        b = data.draw(st.integers(a, len(good)))
        c = data.draw(st.integers(0, len(good) - 1))
        bad = bytearray(good[:c] + good[a:b] + good[c:])
    else:
        bad = bytearray(good + good[10 : 10 + data.draw(st.integers(1, 500))])
    if bytes(bad) == good:
        return
    path = tmp / "bad.dcr"
    path.write_bytes(bytes(bad))
    target = tmp / "t.safetensors"
    shutil.copyfile(old, target)
    before = target.read_bytes()
    try:
        dcr.apply_file(path, target)
    except dcr.DcrError as e:
        assert str(e), "errors carry a message"
        assert target.read_bytes() == before, "a refused delta leaves the target as it was"
    else:
        assert target.read_bytes() == new.read_bytes(), "an accepted delta must give exactly NEW"


def test_replayed_old_delta_is_refused(real_pair, tmp_path):
    old, new = real_pair
    d01, d12 = tmp_path / "d01.dcr", tmp_path / "d12.dcr"
    v2 = tmp_path / "v2.safetensors"
    data = bytearray(new.read_bytes())
    data[-2] ^= 0x40
    v2.write_bytes(bytes(data))
    dcr.diff_files(old, new, d01, base_version=0, target_version=1)
    dcr.diff_files(new, v2, d12, base_version=1, target_version=2)
    target = tmp_path / "t.safetensors"
    shutil.copyfile(old, target)
    dcr.apply_file(d01, target)
    dcr.apply_file(d12, target)
    assert target.read_bytes() == v2.read_bytes()
    with pytest.raises(dcr.BaseMismatchError, match="v0->v1"):
        dcr.apply_file(d01, target)  # replay of an old delta
    assert target.read_bytes() == v2.read_bytes()


def test_real_pair_round_trip_and_size(real_pair, tmp_path):
    old, new = real_pair
    delta = tmp_path / "d.dcr"
    stats = dcr.diff_files(old, new, delta)
    target = tmp_path / "t.safetensors"
    shutil.copyfile(old, target)
    assert dcr.apply_file(delta, target)["outcome"] == "applied"
    assert dcr.compare_files(target, new) == []
    assert target.read_bytes() == new.read_bytes()
    # far below the 6 B of an int32 index + bf16 value per changed element
    assert stats["bytes_per_changed"] < 1.6


def test_progress_callback_reports_completion(real_pair, tmp_path):
    old, new = real_pair
    seen = []
    dcr.diff_files(old, new, tmp_path / "d.dcr", progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1] > 0


def test_dense_delta_bootstraps_any_target_of_the_layout(ckpt_pair, tmp_path):
    old, new = ckpt_pair
    full = tmp_path / "full.dcr"
    stats = dcr.diff_files(old, new, full, dense=True)
    assert stats["changed_elements"] == stats["total_elements"]
    junk = tmp_path / "junk.safetensors"
    data = bytearray(old.read_bytes())
    for i in range(len(data) - 1, len(data) - 2000, -3):
        data[i] ^= 0x5A  # neither OLD nor NEW
    junk.write_bytes(bytes(data))
    assert dcr.apply_file(full, junk)["outcome"] == "applied"
    assert junk.read_bytes() == new.read_bytes()
