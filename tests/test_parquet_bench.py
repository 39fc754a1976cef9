"""benchmarks/parquet.py runs on its smallest settings and reports every row it promises.

Behaviour only (the rows, their fields, the goals' lines, the JSON beside the table), never
speed: the figures are whatever this machine gives, and must only be present and sane."""

from __future__ import annotations

import pytest

from tests.benchscripts import check_scenario_rows, run_benchmark

pytestmark = pytest.mark.slow


@pytest.mark.timeout(400)
def test_every_row_in_every_scenario(tmp_path):
    args = ["--images", "64", "--classes", "4", "--rows-per-file", "32", "--batch-size", "8", "--latencies", "5",
            "--rounds", "1", "--workers", "1", "--window", "2", "--skip-batches", "1", "--io-concurrency", "8"]
    done, result = run_benchmark("parquet.py", args, tmp_path)
    local = ["aioload uniform", "aioload window=2", "datasets streaming", "datasets Arrow", "LitData",
             "torch ImageFolder (files)"]
    remote = ["aioload uniform", "aioload window=2", "datasets streaming"]
    rows = check_scenario_rows(result, local, remote)
    assert result["files"] == 2
    # one worker, a cache that holds every row group: each of the 2 files' row group fetched once
    assert rows["5 ms", "aioload window=2"]["requests_per_sample"] == pytest.approx(2 / 64)
    assert rows["local", "datasets Arrow"]["disk_mb"] > 0
    assert "behind 20 ms" not in done.stdout  # no 20 ms scenario was asked for
    assert "class mix, aioload uniform:" in done.stdout and "x LitData's img/s (goal >= 1)" in done.stdout
    assert result["command"].startswith("python benchmarks/parquet.py --images 64")
