"""benchmarks/parquet.py runs on its smallest settings and reports every row it promises.

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
SCRIPT = ROOT / "benchmarks" / "parquet.py"
pytestmark = pytest.mark.slow


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.timeout(400)
def test_every_row_in_every_scenario(tmp_path):
    pytest.importorskip("polars")  # LitData's Parquet reader
    out_json = tmp_path / "result.json"
    env = dict(os.environ, AIOLOAD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    args = ["--images", "64", "--classes", "4", "--rows-per-file", "32", "--batch-size", "8", "--latencies", "5",
            "--rounds", "1", "--workers", "1", "--window", "2", "--skip-batches", "1", "--io-concurrency", "8"]
    done = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out_json)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "Unclosed" not in done.stderr, done.stderr
    result = json.loads(out_json.read_text())
    local = ["aioload uniform", "aioload window=2", "datasets streaming", "datasets Arrow", "LitData",
             "torch ImageFolder (files)"]
    remote = ["aioload uniform", "aioload window=2", "datasets streaming"]
    assert [(r["scenario"], r["row"]) for r in result["rows"]] == ([("local", n) for n in local]
                                                                   + [("5 ms", n) for n in remote])
    assert result["files"] == 2 and positive(result["local_ceiling_img_s"])
    assert result["uniform_classes_per_batch"] == pytest.approx(4 - 4 * (3 / 4) ** 8, rel=0.1)
    for row in result["rows"]:
        for key in ("img_s", "of_local_ceiling", "cpu_ms_per_image", "memory_mb", "classes_per_batch"):
            assert positive(row[key]), (row["scenario"], row["row"], key)
        assert 1 <= row["classes_per_batch"] <= 4
    rows = {(r["scenario"], r["row"]): r for r in result["rows"]}
    # one worker, a cache that holds every row group: each of the 2 files' row group fetched once
    assert rows["5 ms", "aioload window=2"]["requests_per_sample"] == pytest.approx(2 / 64)
    assert rows["local", "datasets Arrow"]["disk_mb"] > 0
    assert "behind 20 ms" not in done.stdout  # no 20 ms scenario was asked for
    assert "class mix, aioload uniform:" in done.stdout and "x LitData's img/s (goal >= 1)" in done.stdout
    assert result["command"].startswith("python benchmarks/parquet.py --images 64")
