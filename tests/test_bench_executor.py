"""benchmarks/executor.py runs end to end on a few images and prints its table: every loader
in both cases, with the bytes each executor sent back per batch (behaviour, not speed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("distributed")  # in the test extra: the benchmark's Dask cluster

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "executor.py"
NUMBER = r"\d+(?:\.\d+)?"


def run(*args: str, tmp_path: Path) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--data", str(tmp_path / "jpegs"), *args], env=env,
                          capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
    return proc.stdout


def test_the_table_has_every_loader_in_both_cases_with_the_bytes_per_batch(tmp_path):
    out = run("--images", "16", "--batch-size", "4", "--rounds", "1", "--epochs", "1", "--latency-ms", "5",
              tmp_path=tmp_path)
    rows = {}
    for line in out.splitlines():
        found = re.match(r"(local|http 5ms)\s+(built-in pool|ProcessPoolExecutor|ThreadPoolExecutor|Dask cluster|"
                         r"torch DataLoader)\s+(.*)$", line)
        if found:
            rows[found[1], found[2]] = found[3].split()
    executors = ("ProcessPoolExecutor", "ThreadPoolExecutor", "Dask cluster")
    assert set(rows) == {(case, name) for case in ("local", "http 5ms")
                         for name in ("built-in pool", *executors)} | {("local", "torch DataLoader")}, out
    # batches of 4 RandomResizedCrop(224) uint8 images and 4 int64 labels: 588 KiB each
    expected_kib = round((4 * 3 * 224 * 224 + 4 * 8) / 1024)
    for (case, name), cells in rows.items():
        rate, vs_pool, vs_torch, cpu_ms, kib, p50 = cells
        assert float(rate) > 0 and re.fullmatch(NUMBER + "x", vs_pool) and float(cpu_ms) >= 0, (case, name, cells)
        assert (vs_torch != "-") == (case == "local"), (case, name, cells)
        if name in executors:
            assert int(kib) == expected_kib and float(p50) > 0, (case, name, cells)
        else:
            assert kib == "-" and p50 == "-", (case, name, cells)
    assert rows["local", "built-in pool"][1] == "1.00x" and rows["local", "torch DataLoader"][2] == "1.00x"
    assert "run: benchmarks/executor.py --data" in out and re.search(r"\d+ CPUs", out), out  # how it was run


def test_the_dataset_cost_table_counts_the_sends_and_the_unpickling(tmp_path):
    script = ROOT / "benchmarks" / "executor_dataset.py"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script), "--mib", "1", "--samples", "16", "--in-flight", "8"], env=env,
                          capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split("  ")[0]: line.split() for line in proc.stdout.splitlines()
            if line.startswith(("process pool", "Dask"))}
    assert set(rows) == {"process pool", "Dask"}, proc.stdout
    pool, dask = rows["process pool"], rows["Dask"]
    # the pool's processes take the dataset from shared memory: no task carries it; the Dask
    # cluster gets it once, as a plugin; each process unpickles it once, no large graph is sent
    assert pool[3:5] == ["0", "0"] and pool[5] == pool[7] == "2" and pool[8] == "0", proc.stdout
    assert dask[2:4] == ["1", "1"] and dask[4] == dask[6] == "2" and dask[7] == "0", proc.stdout
    assert "run: benchmarks/executor_dataset.py" in proc.stdout
