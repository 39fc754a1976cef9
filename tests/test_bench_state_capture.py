"""benchmarks/state_capture.py runs on its smallest settings and reports every row it promises.

Behaviour only (the rows, the capture costs, the JSON), never speed: the figures must only be
present and sane, and each loader must have delivered the epoch it was given.
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
@pytest.mark.parametrize("state", ["position", "rng"])
def test_every_row_and_the_capture_cost(tmp_path, state):
    out = tmp_path / "state.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "state_capture.py"), "--rows", "2048",
                           "--batch-size", "64", "--workers", "2", "--rounds", "1", "--state", state,
                           "--json", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "Warning" not in done.stderr, done.stderr
    result = json.loads(out.read_text())
    assert list(result["rows"]) == [
        "torch DataLoader", "torchdata, no state", "torchdata, Stateful", "torchdata, state_dict() every batch",
        "aioload, no state", "aioload, Stateful", "aioload, state_dict() every batch"]
    for name, row in result["rows"].items():
        assert positive(row["rows_s"]) and positive(row["ms_per_batch"]), (name, row)
        assert row["rows"] == 2048 - 64, (name, row)  # the epoch, less the first batch (time to first batch)
    assert set(result["capture"]) == {"aioload", "aioload, state_dict() every batch", "torchdata",
                                      "torchdata, state_dict() every batch"}
    for c in result["capture"].values():
        assert math.isfinite(c["ms_per_batch"]) and c["throughput_lost"] < 1
    assert result["settings"]["state"] == state and "torch" in result["settings"]["environment"]
    assert "capture cost" in done.stdout
