"""benchmarks/stateful_capture.py runs on its smallest setting and reports every row it
promises, each figure present and sane (behaviour only, never speed); and
benchmarks/torchdata_suite.py refuses a path that is not a torchdata checkout, saying why."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_the_capture_cost_has_a_row_per_kind_of_copy():
    done = run("benchmarks/stateful_capture.py", "--batches", "200")
    assert done.returncode == 0, done.stderr
    rows = {line[:22].strip(): line[22:].split() for line in done.stdout.splitlines()[1:]}
    assert sorted(rows) == ["HF-sized state", "not Stateful", "small state"]
    for figures in rows.values():
        assert len(figures) == 2 and all(math.isfinite(float(f)) and float(f) > 0 for f in figures)


def test_the_torchdata_suite_wants_a_checkout(tmp_path):
    done = run("benchmarks/torchdata_suite.py", str(tmp_path))
    assert done.returncode == 2
    assert "no test/stateful_dataloader/test_state_dict.py under" in done.stderr
