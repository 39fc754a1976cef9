"""benchmarks/range_cpu.py runs on its smallest settings, for this checkout and another given
beside it, and reports both measurements for each.

Behaviour only (the rows, their fields, the JSON beside the table), never speed."""

from __future__ import annotations

import pytest

from tests.benchscripts import ROOT, positive, run_benchmark

pytestmark = pytest.mark.slow


@pytest.mark.timeout(400)
def test_both_measurements_for_each_checkout(tmp_path):
    args = ["--images", "64", "--classes", "4", "--shard-size", "16", "--batch-size", "8", "--latency", "5",
            "--rounds", "1", "--workers", "1", "--io-concurrency", "8", "--trees", f"{ROOT},{ROOT}"]
    done, result = run_benchmark("range_cpu.py", args, tmp_path)
    assert result["trees"] == [str(ROOT), str(ROOT)]
    rounds = result["rounds"][str(ROOT)]
    assert len(rounds["loader"]) == len(rounds["client"]) == 2  # the same checkout twice, one round each
    for row in rounds["loader"]:
        assert row["samples"] == 56  # every batch after the first: 64 // 8 - 1 batches of 8
        assert all(positive(row[k]) for k in ("worker_ms_per_sample", "samples_per_s", "requests_per_sample"))
    for row in rounds["client"]:
        assert row["samples"] == 56  # every sample after the first batch
        assert all(positive(row[k]) for k in ("client_ms_per_request", "requests_per_s", "kb_per_request"))
        assert row["requests_per_sample"] <= 1.5
    assert "worker ms/sample" in done.stdout and "client ms/read" in done.stdout
