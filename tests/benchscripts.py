"""A script of ``benchmarks/`` run on its smallest settings, as its smoke test does: in a
subprocess with this checkout first on the path and a cache of its own, its JSON read back."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def run_benchmark(script: str, args: list[str], tmp_path: Path, timeout: float = 380):
    """Run ``benchmarks/<script>`` with ``args`` and ``--json``; check that it exited cleanly
    (status 0, no traceback, nothing unclosed) and return its output and its JSON."""
    out_json = tmp_path / "result.json"
    env = dict(os.environ, AIOLOAD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out_json)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "Unclosed" not in done.stderr, done.stderr
    return done, json.loads(out_json.read_text())


def check_scenario_rows(result: dict, local: list[str], remote: list[str]) -> dict:
    """The rows are ``local`` then ``remote`` (the ``5 ms`` scenario), each with positive
    figures and 1 to 4 classes per batch (4 classes, batches of 8), a uniform shuffle's figure
    beside them; returns the rows by (scenario, row)."""
    assert [(r["scenario"], r["row"]) for r in result["rows"]] == ([("local", n) for n in local]
                                                                   + [("5 ms", n) for n in remote])
    assert positive(result["local_ceiling_img_s"])
    assert result["uniform_classes_per_batch"] == pytest.approx(4 - 4 * (3 / 4) ** 8, rel=0.1)
    for row in result["rows"]:
        for key in ("img_s", "of_local_ceiling", "cpu_ms_per_image", "memory_mb", "classes_per_batch"):
            assert positive(row[key]), (row["scenario"], row["row"], key)
        assert 1 <= row["classes_per_batch"] <= 4
    return {(r["scenario"], r["row"]): r for r in result["rows"]}
