"""benchmarks/mix.py runs on its smallest settings and reports every row it promises.

Behaviour only (the rows, the ratios, the JSON), never speed: the figures must only be present
and sane (positive, finite), and each loader must have delivered the epoch it was given.
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
def test_every_row_and_the_ratio_of_mixing(tmp_path):
    out = tmp_path / "mix.json"
    env = dict(os.environ, AIOLOAD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mix.py"), "--images", "64", "--batch-size",
                           "8", "--workers", "1", "--rounds", "2", "--json", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert list(rows) == ["torch DataLoader", "aioload, one dataset", "aioload, Mix of 3"]
    for name, row in rows.items():
        assert positive(row["img_s"]) and positive(row["cpu_ms_per_img"]), (name, row)
        assert len(row["img_s_rounds"]) == 2
        # the first batch is not counted; the rest of the 64-image epoch is (the mix: about all)
        assert 48 <= row["images"] <= 56, (name, row["images"])
    ratio = result["mix_over_one"]
    assert math.isclose(ratio["img_s"], rows["aioload, Mix of 3"]["img_s"] / rows["aioload, one dataset"]["img_s"])
    assert "Mix / one dataset:" in done.stdout and result["command"].startswith("python benchmarks/mix.py --images 64")
