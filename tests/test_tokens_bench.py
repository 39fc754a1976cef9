"""benchmarks/tokens.py runs on its smallest settings and reports every row it promises.

Behaviour only (the rows, the ratios, the JSON), never speed: the figures must only be present
and sane (positive, finite), and each loader must have delivered the rows it was asked for.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.timeout(300)
def test_every_row_the_training_rate_and_the_ratios(tmp_path):
    out = tmp_path / "tokens.json"
    env = dict(os.environ, AIOLOAD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tokens.py"), "--documents", "120",
                           "--seq-len", "64", "--vocab", "500", "--rows", "64", "--batch-size", "8", "--workers", "1",
                           "--rounds", "2", "--steps", "1", "--json", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert list(rows) == ["torch DataLoader", "aioload"]
    for name, row in rows.items():
        assert positive(row["rows_s"]) and positive(row["cpu_ms_per_row"]), (name, row)
        assert len(row["rows_s_rounds"]) == 2
        assert row["rows"] == 64, (name, row["rows"])  # the first batch is not counted; 8 batches after it
    assert positive(result["training_rows_s"])
    summary = result["summary"]
    assert math.isclose(summary["aioload_over_training"], rows["aioload"]["rows_s"] / result["training_rows_s"])
    assert math.isclose(summary["cpu_over_torch"],
                        rows["aioload"]["cpu_ms_per_row"] / rows["torch DataLoader"]["cpu_ms_per_row"])
    assert result["packed"]["rows"] > 64 and 0 <= result["packed"]["tail"] < 65
    assert "aioload / training step:" in done.stdout
    assert result["command"].startswith("python benchmarks/tokens.py --documents 120")
