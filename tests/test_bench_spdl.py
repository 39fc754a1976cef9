"""benchmarks/spdl_compare.py runs on its smallest settings and reports every row it promises.

Behaviour only (the rows, their fields, the ratios, the JSON beside the table), never speed:
the figures are whatever this machine gives, and must only be present and sane (positive,
finite). SPDL is in the test extra, so its rows are always run.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import aioload

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "spdl_compare.py"


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.timeout(300)
def test_every_row_at_every_latency(tmp_path):
    out_json = tmp_path / "result.json"
    env = dict(os.environ, AIOLOAD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    args = ["--latencies", "0,5", "--images", "32", "--batch-size", "8", "--workers", "1", "--io-concurrency", "4",
            "--skip-batches", "1", "--rounds", "2"]
    done = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out_json)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "Unclosed" not in done.stderr, done.stderr
    result = json.loads(out_json.read_text())

    names = ["aioload ImageFiles"]
    if "read_in_workers" in inspect.signature(aioload.DataLoader).parameters:
        names.append("aioload, read_in_workers=False")
    names += ["SPDL, thread pool", "SPDL, process pool", "torch DataLoader"]
    assert result["read_in_workers_row"] == (len(names) == 5)
    assert [(row["latency_ms"], row["row"]) for row in result["rows"]] == [(lat, n) for lat in (0.0, 5.0) for n in names]

    assert "spdl 0." in result["run"] and "torch" in result["run"] and "CPUs" in result["run"]
    assert result["command"].startswith("python benchmarks/spdl_compare.py --latencies 0,5")
    assert result["settings"]["workers"] == 1 and result["settings"]["batch_size"] == 8
    for latency in (0.0, 5.0):
        rows = {row["row"]: row for row in result["rows"] if row["latency_ms"] == latency}
        base = rows["aioload ImageFiles"]["img_s"]
        assert rows["aioload ImageFiles"]["aioload_over_row"] == 1.0
        for name, row in rows.items():
            for key in ("img_s", "aioload_over_row", "cpu_ms_per_image"):
                assert positive(row[key]), (latency, name, key, row[key])
            assert math.isclose(row["aioload_over_row"], base / row["img_s"]), (latency, name)
            assert len(row["rounds_img_s"]) == 2 and all(positive(x) for x in row["rounds_img_s"])
            assert math.isclose(row["img_s"], sorted(row["rounds_img_s"])[0] / 2 + sorted(row["rounds_img_s"])[1] / 2)

    table = done.stdout.split("## Images behind HTTP latency")[1]
    for name in names:
        assert table.count(name) >= 2, name  # once per latency
