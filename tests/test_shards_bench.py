"""benchmarks/shards.py runs on its smallest settings and reports every row it promises.

Behaviour only (the rows, their fields, the goals' lines, the JSON beside the table), never
speed: the figures are whatever this machine gives, and must only be present and sane."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "shards.py"
pytestmark = pytest.mark.slow


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.timeout(400)
def test_every_row_in_every_scenario(tmp_path):
    out_json = tmp_path / "result.json"
    env = dict(os.environ, AIOLOAD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    args = ["--images", "64", "--classes", "4", "--shard-size", "16", "--batch-size", "8", "--latencies", "5",
            "--rounds", "1", "--workers", "1", "--window", "2", "--skip-batches", "1", "--io-concurrency", "8"]
    done = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out_json)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "Unclosed" not in done.stderr, done.stderr
    result = json.loads(out_json.read_text())
    local = ["aioload uniform", "aioload window=2", "webdataset", "LitData", "torch ImageFolder (files)"]
    remote = ["aioload uniform", "aioload window=2", "webdataset"]
    assert [(r["scenario"], r["row"]) for r in result["rows"]] == ([("local", n) for n in local]
                                                                   + [("5 ms", n) for n in remote])
    assert result["shards"] == 4 and positive(result["local_ceiling_img_s"])
    assert result["uniform_classes_per_batch"] == pytest.approx(4 - 4 * (3 / 4) ** 8, rel=0.1)
    for row in result["rows"]:
        for key in ("img_s", "of_local_ceiling", "cpu_ms_per_image", "memory_mb", "classes_per_batch"):
            assert positive(row[key]), (row["scenario"], row["row"], key)
        assert 1 <= row["classes_per_batch"] <= 4
    rows = {(r["scenario"], r["row"]): r for r in result["rows"]}
    # requests counted by the server: a range per sample, or a GET per shard (4 shards, 64 samples)
    assert rows["5 ms", "aioload uniform"]["requests_per_sample"] == pytest.approx(1.0)
    assert rows["5 ms", "aioload window=2"]["requests_per_sample"] == pytest.approx(4 / 64)
    assert rows["5 ms", "webdataset"]["requests_per_sample"] == pytest.approx(4 / 64)
    assert rows["5 ms", "aioload window=2"]["window_peak_mb"] > 0
    # behind HTTP: the CPUs the server took over the measured interval, and the rate against the
    # ceiling scaled to the CPUs it left (never a smaller share than against the whole ceiling)
    cpus = len(os.sched_getaffinity(0))
    for row in result["rows"]:
        if row["scenario"] == "local":
            assert row["server_cpus"] is None and row["of_ceiling_left"] is None
        else:
            assert 0 < row["server_cpus"] < cpus, row
            assert row["of_ceiling_left"] >= row["of_local_ceiling"], row
    assert "server CPUs" in done.stdout and "% ceiling left" in done.stdout
    assert rows["local", "LitData"]["disk_mb"] > 0
    assert "behind 20 ms" not in done.stdout  # no 20 ms scenario was asked for
    assert "class mix, aioload uniform:" in done.stdout and "x LitData's img/s (goal >= 1)" in done.stdout
    assert result["command"].startswith("python benchmarks/shards.py --images 64")
    assert "load average" in result["run"]
