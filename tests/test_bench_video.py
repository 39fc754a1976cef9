"""benchmarks/video.py runs on its smallest settings and reports every row it promises.

Behaviour only (the rows, their fields, the ratios, the frame check, the JSON beside the
table), never speed: the figures are whatever this machine gives, and must only be present and
sane (positive, finite).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "video.py"


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.timeout(300)
def test_every_row_locally_and_behind_latency(tmp_path):
    out_json = tmp_path / "result.json"
    env = dict(os.environ, AIOLOAD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    args = ["--videos", "8", "--frames", "32", "--size", "64x80", "--clip", "8", "--crop", "48", "--clips-per-video",
            "2", "--batch-size", "4", "--workers", "1", "--rounds", "1", "--latencies", "0,5"]
    done = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out_json)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "Unclosed" not in done.stderr, done.stderr
    result = json.loads(out_json.read_text())
    assert result["command"] == "python benchmarks/video.py " + " ".join(args + ["--json", str(out_json)])
    assert "torchcodec 0." in result["run"] and "PyAV" in result["run"] and "load average" in result["run"]
    local, remote = result["scenarios"]
    assert (local["latency_ms"], remote["latency_ms"]) == (0.0, 5.0)
    loaders = ["aioload VideoFiles", "torch DataLoader, torchcodec", "torch DataLoader, PyAV"]
    assert [row["row"] for row in local["rows"]] == loaders + ["decode loop, torchcodec", "decode loop, PyAV"]
    assert [row["row"] for row in remote["rows"]] == loaders
    for scenario in (local, remote):
        assert scenario["checked_clips"] == 8 * 3  # three uniform clips of every video, bit for bit
        rows = {row["row"]: row for row in scenario["rows"]}
        ours = rows["aioload VideoFiles"]["clips_s"]
        for name, row in rows.items():
            assert positive(row["clips_s"]) and math.isclose(row["aioload_over_row"], ours / row["clips_s"]), name
            if name in loaders:
                assert positive(row["cpu_ms_per_clip"]) and positive(row["peak_mb"]), name
                assert len(row["rounds_clips_s"]) == 1
    assert "## Local files" in done.stdout and "## Behind 5 ms of HTTP latency" in done.stdout
    assert done.stdout.count("frames equal to torchcodec's own decode, bit for bit: 24 clips") == 2
