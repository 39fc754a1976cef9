"""benchmarks/range_cpu.py runs on its smallest settings, for this checkout and another given
beside it, and reports both measurements for each, with the server's CPU beside them; over
shards and over Parquet files (a page a row).

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
    for row in rounds["loader"] + rounds["client"]:
        assert positive(row["server_ms_per_sample"])
    assert "worker ms/sample" in done.stdout and "client ms/read" in done.stdout and "server ms/read" in done.stdout


@pytest.mark.timeout(400)
def test_parquet_rows_each_cost_their_page(tmp_path):
    args = ["--format", "parquet", "--images", "64", "--classes", "4", "--rows-per-file", "16", "--batch-size", "8",
            "--latency", "5", "--rounds", "1", "--workers", "1", "--io-concurrency", "8"]
    done, result = run_benchmark("range_cpu.py", args, tmp_path)
    rounds = result["rounds"][str(ROOT)]
    for row in rounds["loader"] + rounds["client"]:
        assert row["samples"] == 56
        assert positive(row["server_ms_per_sample"])
    (client,) = rounds["client"]
    assert positive(client["client_ms_per_request"])
    # a row's image page (make-data's images: tens of KB), and one request a row beyond the few
    # that set the dataset up (page indexes, small columns), never a row group's chunk
    assert 5 < client["kb_per_request"] < 200
    assert 1.0 <= client["requests_per_sample"] <= 1.6
    assert "Parquet files of 16 rows" in done.stdout
