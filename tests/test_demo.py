"""`dcr demo` end to end: real training steps, relay and receiver processes, every receiver verified."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_runs_and_verifies_every_receiver(tmp_path):
    out = tmp_path / "report"
    r = subprocess.run(
        [sys.executable, "-m", "dcr.cli", "demo", "--steps", "2", "--receivers", "2", "--fanout", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all 2 receivers bit-exact" in r.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["all_verified"] and len(report["steps"]) == 2
    for step in report["steps"]:
        assert step["verified"] and 0 < step["change_rate"] < 0.5
        assert step["payload_bytes"] * 10 < step["checkpoint_bytes"]
        assert len(step["acks"]) == 2
    assert report["plots"] == ["change_and_payload.png", "refit_timeline.png"]
    for plot in report["plots"]:
        assert (out / plot).stat().st_size > 10_000


def test_demo_through_object_storage(tmp_path):
    out = tmp_path / "report"
    url = (tmp_path / "bucket").as_uri()
    r = subprocess.run(
        [sys.executable, "-m", "dcr.cli", "demo", "--steps", "2", "--receivers", "2", "--via", url, "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["transport"] == url and report["all_verified"]
    assert [len(s["acks"]) for s in report["steps"]] == [2, 2]
