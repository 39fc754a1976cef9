"""benchmarks/shards.py runs on its smallest settings and reports every row it promises.

Behaviour only (the rows, their fields, the goals' lines, the JSON beside the table), never
speed: the figures are whatever this machine gives, and must only be present and sane."""

from __future__ import annotations

import os

import pytest

from tests.benchscripts import check_scenario_rows, run_benchmark

pytestmark = pytest.mark.slow


@pytest.mark.timeout(400)
def test_every_row_in_every_scenario(tmp_path):
    args = ["--images", "64", "--classes", "4", "--shard-size", "16", "--batch-size", "8", "--latencies", "5",
            "--rounds", "1", "--workers", "1", "--window", "2", "--skip-batches", "1", "--io-concurrency", "8"]
    done, result = run_benchmark("shards.py", args, tmp_path)
    local = ["aioload uniform", "aioload window=2", "webdataset", "LitData", "torch ImageFolder (files)"]
    remote = ["aioload uniform", "aioload window=2", "aioload window=2 loader-fetch", "webdataset"]
    rows = check_scenario_rows(result, local, remote)
    assert result["shards"] == 4
    # requests counted by the server: a range per sample (fewer where a task's samples lie together in a
    # shard and share one), or a GET per shard (4 shards, 64 samples)
    assert 0.5 <= rows["5 ms", "aioload uniform"]["requests_per_sample"] <= 1.0
    assert rows["5 ms", "aioload window=2"]["requests_per_sample"] == pytest.approx(4 / 64)
    assert rows["5 ms", "aioload window=2 loader-fetch"]["requests_per_sample"] == pytest.approx(4 / 64)
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
