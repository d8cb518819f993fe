"""End to end over loopback: `dcr-relay` processes in a two-level tree,
`dcr receive` processes, `dcr publish`; every receiver bit-exact."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dcr
from conftest import kill_mid_refit, make_bf16_pair, write_bf16

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "dcr.cli"]


class Relay:
    def __init__(self, tmp: Path, name: str, *args: str) -> None:
        self.log = open(tmp / f"{name}.log", "w+")
        self.proc = subprocess.Popen(
            [*CLI, "relay", "--listen", "127.0.0.1:0", *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "LISTENING 127.0.0.1:PORT"
        assert line.startswith("LISTENING "), f"relay {name} did not start: {line!r}"
        self.addr = line.split()[1]

    def wait_for_log(self, needle: str, count: int, timeout: float = 30.0) -> None:
        """Block until the relay has logged `needle` `count` times (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.log.flush()
            self.log.seek(0)
            if self.log.read().count(needle) >= count:
                return
            time.sleep(0.05)
        raise AssertionError(f"relay did not log {needle!r} {count} times within {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


def _pair(tmp_path, shapes):
    old, new = make_bf16_pair(np.random.default_rng(7), shapes, 0.03)
    o = write_bf16(tmp_path / "old.safetensors", old)
    n = write_bf16(tmp_path / "new.safetensors", new)
    delta = tmp_path / "d.dcr"
    dcr.diff_files(o, n, delta, chunk_bytes=32 << 10, base_version=4, target_version=5)
    key = tmp_path / "key"
    key.write_bytes(b"0123456789abcdef-shared-secret")
    return o, n, delta, key


@pytest.fixture
def pair(tmp_path):
    return _pair(tmp_path, {f"layers.{i}.w": (256, 256) for i in range(8)} | {"embed": (1024, 128)})


@pytest.fixture
def big_pair(tmp_path):
    """About 8 MiB of bf16: a delta of ~150 KiB, several seconds through a 32 KiB/s link."""
    return _pair(tmp_path, {f"layers.{i}.w": (512, 512) for i in range(16)})


def start_receivers(tmp: Path, old: Path, parents: list[str], key: Path, n: int, tag: str, json_out: bool = False):
    procs = []
    for i in range(n):
        target = tmp / f"{tag}{i}.safetensors"
        shutil.copyfile(old, target)
        p = subprocess.Popen(
            [*CLI, "receive", str(target), "--from", ",".join(parents), "--key-file", str(key),
             "--receiver-id", f"{tag}{i}", "--timeout", "120", *(["--json"] if json_out else [])],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        procs.append((target, p))
    return procs


def test_two_level_tree_six_receivers_bit_exact_and_acked(tmp_path, pair):
    old, new, delta, key = pair
    root = Relay(tmp_path, "root", "--key-file", str(key))
    mids = [Relay(tmp_path, f"mid{i}", "--parent", root.addr, "--key-file", str(key)) for i in range(2)]
    try:
        receivers = []
        for i, mid in enumerate(mids):
            receivers += start_receivers(tmp_path, old, [mid.addr, root.addr], key, 3, f"r{i}_")
        pub = subprocess.run(
            [*CLI, "publish", str(delta), "--to", root.addr, "--key-file", str(key), "--expect-acks", "6",
             "--ack-timeout", "120"],
            capture_output=True, text=True, timeout=180,
        )
        assert pub.returncode == 0, pub.stderr + pub.stdout
        assert "6 of 6 receivers committed" in pub.stdout
        for target, p in receivers:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            assert "v5 applied" in out
            assert target.read_bytes() == new.read_bytes()
    finally:
        for r in [*mids, root]:
            r.stop()


def test_relay_killed_mid_stream_children_fail_over(tmp_path, big_pair):
    old, new, delta, key = big_pair
    root = Relay(tmp_path, "root", "--key-file", str(key))
    # A slow middle relay: its child links are limited to 32 KiB/s (after a
    # 64 KiB burst), so the stream takes seconds and the kill lands in its middle.
    slow = Relay(tmp_path, "slow", "--parent", root.addr, "--key-file", str(key), "--rate-limit", "32768")
    try:
        receivers = start_receivers(tmp_path, old, [slow.addr, root.addr], key, 2, "f", json_out=True)
        slow.wait_for_log("role=Subscriber", 2)
        pub = subprocess.Popen(
            [*CLI, "publish", str(delta), "--to", root.addr, "--key-file", str(key), "--expect-acks", "2",
             "--ack-timeout", "120"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        time.sleep(1.5)  # the kill point: about a third into the rate-limited stream
        slow.proc.kill()
        out, err = pub.communicate(timeout=180)
        assert pub.returncode == 0, err + out
        for target, p in receivers:
            rout, rerr = p.communicate(timeout=120)
            assert p.returncode == 0, rerr
            assert json.loads(rout)["failovers"] >= 1, "the receiver resumed from the root"
            assert target.read_bytes() == new.read_bytes()
    finally:
        slow.stop()
        root.stop()


def test_wrong_key_is_refused_and_target_untouched(tmp_path, pair):
    old, new, delta, key = pair
    root = Relay(tmp_path, "root", "--key-file", str(key))
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not-the-right-key-at-all")
    target = tmp_path / "t.safetensors"
    shutil.copyfile(old, target)
    try:
        r = subprocess.run(
            [*CLI, "receive", str(target), "--from", root.addr, "--key-file", str(bad), "--timeout", "20"],
            capture_output=True, text=True, timeout=60,
        )
        assert r.returncode == 2
        assert "authentication" in r.stderr.lower() or "refused" in r.stderr.lower(), r.stderr
        assert target.read_bytes() == old.read_bytes()
    finally:
        root.stop()


def test_receive_is_journaled_and_a_killed_receive_finishes_on_rerun(tmp_path, pair):
    """`dcr receive` spools each version and applies it through the receiver
    journal. A receiver SIGKILLed once a chunk of its refit has started
    finishes that version from its spool on the rerun (without the relay's
    help); receivers killed at random points (subscribing, receiving,
    spooling, applying) all end bit-exact at the new version on a rerun,
    with the journal recording it committed and the spool removed."""
    old, new, delta, key = pair
    root = Relay(tmp_path, "root", "--key-file", str(key))

    def cmd(target: Path, *extra: str) -> list[str]:
        return [*CLI, "receive", str(target), "--from", root.addr, "--key-file", str(key), "--timeout", "60",
                "--json", "--batch-chunks", "1", *extra]

    def rerun_and_check(target: Path) -> dict:
        r = subprocess.run(cmd(target), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["version"] == 5 and out["journaled"], out
        assert target.read_bytes() == new.read_bytes(), f"{target.name} is not bit-exact after the rerun"
        st = dcr.receiver_status(target)
        assert st["committed"]["version"] == 5 and st["refit"] is None and st["target_is_committed"], st
        assert not Path(str(target) + ".dcrj.delta").exists(), "the spool is removed once the version commits"
        return out

    try:
        pub = subprocess.run([*CLI, "publish", str(delta), "--to", root.addr, "--key-file", str(key)],
                             capture_output=True, text=True, timeout=120)
        assert pub.returncode == 0, pub.stderr + pub.stdout

        # Killed mid-apply: poll the journal, kill once a chunk has started.
        interrupted = 0
        for i in range(3):
            target = tmp_path / f"mid{i}.safetensors"
            shutil.copyfile(old, target)
            status = kill_mid_refit(cmd(target), target)
            if status == 0:
                continue  # finished before the kill: nothing to resume
            st = dcr.receiver_status(target)
            if st["refit"] is None:
                # The refit committed between the poll and the kill: a rerun
                # only tidies up (a spool left behind is removed).
                rerun_and_check(target)
                continue
            interrupted += 1
            assert Path(str(target) + ".dcrj.delta").exists(), "a refit in flight keeps its spooled delta"
            assert st["refit"]["version"] == 5 and st["spool_bytes"] == delta.stat().st_size, st
            text = subprocess.run([*CLI, "status", str(target)], capture_output=True, text=True, check=True).stdout
            assert "spooled" in text and "rerun `dcr receive`" in text, text
            assert rerun_and_check(target)["resumed"], "the rerun finishes the version from the spool"
        if interrupted == 0:
            pytest.skip("every receive finished before a chunk could be interrupted")

        # Killed anywhere: a rerun fetches again or resumes, and ends exact.
        rng = np.random.default_rng(3)
        probe = tmp_path / "probe.safetensors"
        shutil.copyfile(old, probe)
        t0 = time.perf_counter()
        rerun_and_check(probe)
        full = time.perf_counter() - t0
        for i in range(4):
            target = tmp_path / f"k{i}.safetensors"
            shutil.copyfile(old, target)
            p = subprocess.Popen(cmd(target), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(float(rng.uniform(0.3, 1.0)) * full)
            p.kill()
            p.wait()
            rerun_and_check(target)

        # Streaming apply stays available, without the journal.
        target = tmp_path / "stream.safetensors"
        shutil.copyfile(old, target)
        r = subprocess.run(cmd(target, "--no-journal"), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["journaled"] is False
        assert target.read_bytes() == new.read_bytes()
        assert not Path(str(target) + ".dcrj").exists()
    finally:
        root.stop()
