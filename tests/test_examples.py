"""Every example runs for a few steps on the embedded default data, so none of them rots."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_example(args: list[str], tmp_path, timeout: float = 240) -> str:
    env = dict(os.environ, AIOLOAD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_train_folder(tmp_path):
    out = run_example([str(ROOT / "examples/train_folder.py"), "--steps", "6", "--workers", "1"], tmp_path)
    assert "done: 6 steps" in out


def test_train_async(tmp_path):
    out = run_example([str(ROOT / "examples/train_async.py"), "--steps", "4", "--workers", "1"], tmp_path)
    assert "done: 4 steps" in out
    ticks = int(out.split("heartbeat ticked ")[1].split()[0])
    assert ticks > 0, "the event loop kept running during training"


def test_bench_command_runs(tmp_path):
    out = run_example(["-m", "aioload", "bench", "--images", "96", "--batch-size", "16", "--workers", "1",
                       "--rounds", "1"], tmp_path, timeout=400)
    assert "img/s (median)" in out and "aioload/torch" in out


def test_benchmark_suite_runs(tmp_path):
    """The benchmark script itself, on its smallest workload: it must not rot."""
    out = run_example([str(ROOT / "benchmarks/run.py"), "--suite", "tiny", "--quick", "--rows", "2048",
                       "--workers", "1"], tmp_path, timeout=400)
    table = out.split("## Tiny samples")[1]
    for name in ("torch DataLoader, 0 workers", "torch DataLoader, 1 workers", "aioload DataLoader, 1 workers"):
        assert name in table
