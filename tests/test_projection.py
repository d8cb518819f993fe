from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcr import projection


def test_projection_is_the_slowest_pipelined_stage_plus_hop_latency():
    mode = {"bytes_per_changed": 1.0, "encode_bytes_per_s_per_core": 1e9, "apply_bytes_per_s_per_core": 1e9}
    r = projection.project(1e12, 0.03, 8.0, mode, 1.0, trainer_cores=100, receiver_cores=10,
                           receivers_share=0.1, hops=2, chunk_bytes=1e6)
    assert r["payload_bytes"] == pytest.approx(3e10)
    assert r["transfer_s"] == pytest.approx(30.0)          # 30 GB at 1 GB/s
    assert r["encode_s"] == pytest.approx(20.0)            # 2 TB / (1 GB/s x 100)
    assert r["apply_s"] == pytest.approx(20.0)             # 0.2 TB / (1 GB/s x 10)
    assert r["refit_s"] == pytest.approx(30.0 + 2e-3)
    assert r["full_s"] == pytest.approx(2000.0)


def test_calibration_reads_benchmark_json_and_says_where_from(tmp_path: Path):
    codec = {"inputs": [{"kind": "real", "id": "fp32m-10-11", "methods": [
        {"method": "h_dcr_context_t1", "bytes_per_changed": 0.84, "encode_mb_s": 700.0, "decode_mb_s": 800.0},
        {"method": "g_dcr_free_t1", "bytes_per_changed": 1.28, "encode_mb_s": 1500.0, "decode_mb_s": 4000.0}]}]}
    refit = {"rows": [{"what": "dense", "ratio_to_ideal": 1.05}, {"what": "delta 3%", "ratio_to_ideal": 3.0}]}
    (tmp_path / "c.json").write_text(json.dumps(codec))
    (tmp_path / "r.json").write_text(json.dumps(refit))
    cal = projection.calibrate(tmp_path / "c.json", tmp_path / "r.json")
    assert cal["context"]["bytes_per_changed"] == 0.84
    assert cal["free"]["apply_bytes_per_s_per_core"] == 4e9
    assert cal["relay_efficiency"]["value"] == 1.05
    assert "c.json" in cal["context"]["source"]
    missing = projection.calibrate(tmp_path / "none.json", tmp_path / "none.json")
    assert "default" in missing["context"]["source"]
