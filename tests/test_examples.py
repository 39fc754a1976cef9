"""Every example runs for a few steps on the embedded default data, so none of them rots."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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
    assert "done: 6 steps in 1 epoch\n" in out


def test_train_folder_trains_the_steps_asked_for_across_epochs(tmp_path):
    # 256 images in batches of 32 make 8 steps per epoch: 10 steps take a second epoch
    out = run_example([str(ROOT / "examples/train_folder.py"), "--steps", "10", "--workers", "1"], tmp_path)
    assert "done: 10 steps in 2 epochs" in out


def test_train_video(tmp_path):
    out = run_example([str(ROOT / "examples/train_video.py"), "--steps", "3", "--workers", "1", "--batch-size", "4"],
                      tmp_path)
    assert "done: 3 steps in 1 epoch\n" in out and "epoch 0: " in out


def test_examples_use_only_the_public_api():
    for script in sorted((ROOT / "examples").glob("*.py")):
        text = script.read_text()
        assert "aioload._" not in text and "from aioload import _" not in text, script.name


@pytest.mark.parametrize(("script", "kept"), [
    ("train_async.py", "\n\n    python examples/train_async.py\n\nThe loader never blocks"),
    ("train_folder.py", "\n    python examples/train_folder.py --data DIR --steps 0 --epochs 10 --model resnet18\n"),
    ("ddp_train.py", "\n    torchrun --nproc-per-node 2 examples/ddp_train.py --steps 6 --resume ckpt.pt\n"),
    ("remote_images.py", "\n    python examples/remote_images.py --steps 40 --cache disk"),
    ("train_video.py", "\n    python examples/train_video.py --data DIR --steps 0 --epochs 5 --clips-per-video 4\n"),
])
def test_help_keeps_the_docstring_lines(tmp_path, script, kept):
    out = run_example([str(ROOT / "examples" / script), "--help"], tmp_path, timeout=60)
    assert kept in out


def test_ddp_example_without_torchrun_runs_as_one_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(AIOLOAD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "examples/ddp_train.py"), "--steps", "2", "--workers", "1",
                           "--images", "32"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not started by torchrun (no RANK in the environment): running as a single process" in done.stdout
    assert "1 ranks on cpu" in done.stdout and "rank 0 epoch 0 step 2 " in done.stdout


def _children_of(pid: int) -> list[tuple[int, str]]:
    """``(pid, command line)`` of each live child of ``pid``, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != b"Z":
            found.append((int(entry), cmdline))
    return found


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_remote_example_server_ends_when_the_example_is_killed(tmp_path):
    env = dict(os.environ, AIOLOAD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-u", str(ROOT / "examples/remote_images.py"), "--steps", "100000",
                             "--images", "16", "--batch-size", "4", "--workers", "1", "--cache", "none"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    servers: list[int] = []
    try:
        lines = []
        while not any(" images at http://127.0.0.1:" in line for line in lines):  # the server is up
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        servers += [pid for pid, cmd in _children_of(proc.pid) if "http.server" in cmd]
        assert len(servers) == 1, _children_of(proc.pid)
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 30  # a hang guard, not a timing
        while running(servers[0]):
            assert time.monotonic() < deadline, "the example's HTTP server outlived the example"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
        for pid in servers:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_train_async(tmp_path):
    out = run_example([str(ROOT / "examples/train_async.py"), "--steps", "4", "--workers", "1"], tmp_path)
    assert "done: 4 steps" in out
    ticks = int(out.split("heartbeat ticked ")[1].split()[0])
    assert ticks > 0, "the event loop kept running during training"


def test_benchmark_suite_runs(tmp_path):
    """The benchmark script itself, on its smallest workload: it must not rot."""
    out = run_example([str(ROOT / "benchmarks/run.py"), "--suite", "tiny", "--quick", "--rows", "2048",
                       "--workers", "1"], tmp_path, timeout=400)
    table = out.split("## Tiny samples")[1]
    for name in ("torch DataLoader, 0 workers", "torch DataLoader, 1 workers", "aioload DataLoader, 1 workers"):
        assert name in table
