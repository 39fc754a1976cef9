"""benchmarks/overhead.py runs on its smallest settings and reports every row it promises.

Behaviour only (the rows, their fields, the JSON beside the table), never speed: the figures
are whatever this machine gives, and must only be present and sane (positive, finite).
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
SCRIPT = ROOT / "benchmarks" / "overhead.py"


def run_bench(args: list[str], tmp_path) -> tuple[str, dict]:
    out_json = tmp_path / "result.json"
    env = dict(os.environ, AIOLOAD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out_json)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(out_json.read_text())


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.timeout(300)
def test_split_case_reports_every_row(tmp_path):
    stdout, result = run_bench(["split", "--images", "32", "--batch-size", "8", "--workers", "1", "--rounds", "1",
                                "--latencies", "0", "--http-images", "16"], tmp_path)
    names = ["split Dataset (aiofiles read)", "ImageFolder (reads in workers)", "ImageFiles, HTTP 0 ms"]
    assert [row["row"] for row in result["rows"]] == names
    assert result["settings"]["workers"] == 1 and result["settings"]["images"] == 32
    assert "torch" in result["run"] and result["command"].startswith("python benchmarks/overhead.py split")
    assert positive(result["ceiling_img_s"])
    for row in result["rows"]:
        for key in ("aioload_img_s", "torch_img_s", "ratio", "aioload_of_ceiling", "torch_of_ceiling",
                    "aioload_cpu_ms_per_image", "torch_cpu_ms_per_image"):
            assert positive(row[key]), (row["row"], key, row[key])
        assert math.isclose(row["ratio"], row["aioload_img_s"] / row["torch_img_s"])
        # the engine's own thread does work in the main process on every path
        assert positive(row["aioload_threads_ms_per_image"]["engine"]), row
    # the rows with reads on the engine's loop (read_in_workers=False), beside them
    for row in (result["rows"][0], result["rows"][2]):
        assert positive(row["loader_reads_img_s"]) and positive(row["loader_reads_cpu_ms_per_image"]), row
    assert "loader_reads_img_s" not in result["rows"][1]  # ImageFolder has no such variant
    assert result["rows"][2]["images_per_epoch"] == 16
    table = stdout.split("## Split protocol")[1]
    for name in names:
        # the main table and the per-thread table, and the read_in_workers=False table
        assert table.count(name) == (2 if name.startswith("ImageFolder") else 3), name


@pytest.mark.timeout(300)
def test_interference_case_reports_every_row(tmp_path):
    stdout, result = run_bench(["interference", "--images", "64", "--step-batch", "2", "--steps", "6", "--warmup",
                                "2", "--rounds", "1", "--workers", "1", "--latency", "0", "--dispatch-ms", "1",
                                "--gpu-ms", "2"], tmp_path)
    names = ["synthetic batch", "torch DataLoader, split Dataset", "aioload, split Dataset",
             "aioload, split, reads on the loader", "torch DataLoader, ImageFolder", "aioload, ImageFolder",
             "aioload, ImageFiles HTTP 0 ms", "aioload, HTTP 0 ms, loader reads"]
    assert [row["row"] for row in result["rows"]] == names
    rows = {row["row"]: row for row in result["rows"]}
    assert rows["synthetic batch"]["of_synthetic"] == 1.0
    for row in result["rows"]:
        assert positive(row["steps_s"]) and positive(row["of_synthetic"]) and positive(row["cpu_ms_per_step"]), row
        assert row["wait_ms_per_step"] >= 0, row
    assert positive(result["work_iterations"])
    table = stdout.split("## A GIL-holding training loop")[1]
    for name in names:
        assert name in table


@pytest.mark.timeout(300)
def test_profile_records_the_main_process(tmp_path):
    # --step-ms: the loop holds the GIL 20 ms a batch, so --gil samples are certain to exist on a
    # busy machine too (the loader alone, with reads in the workers, may hold it for none of them)
    stdout, result = run_bench(["profile", "--row", "split", "--images", "64", "--batch-size", "8", "--workers", "1",
                                "--epochs", "2", "--gil", "--step-ms", "20", "-o", str(tmp_path / "prof.txt")],
                               tmp_path)
    assert (tmp_path / "prof.txt").stat().st_size > 0
    assert result["samples"] > 0 and result["images"] > 0
    shares = dict(result["threads"])
    assert set(shares) <= {"engine thread", "executor threads", "consumer (main thread)"}
    assert math.isclose(sum(shares.values()), 1.0)
    assert "self time (leaf function)" in stdout
