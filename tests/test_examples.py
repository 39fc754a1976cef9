"""Every example runs for a few steps on the embedded default data, so none of them rots."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

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
def test_help_keeps_the_docstring_lines_and_shows_every_default(tmp_path, script, kept):
    out = run_example([str(ROOT / "examples" / script), "--help"], tmp_path, timeout=60)
    assert kept in out
    options = out.split("\noptions:\n")[1]
    entries = re.split(r"\n(?=  -)", options.strip("\n"))  # one per option, its help wrapped below it
    assert len(entries) > 2
    for entry in entries:
        if not entry.startswith("  -h, --help"):
            assert "(default: " in " ".join(entry.split()), entry


def run_ddp_alone(args: list[str], tmp_path) -> str:
    """``examples/ddp_train.py`` started with plain python (no torchrun): a world of one rank."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(AIOLOAD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "examples/ddp_train.py"), "--workers", "1", "--images", "32",
                           *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def batches_of(out: str) -> dict[int, str]:
    """step -> the digest of its batch, from the example's step lines."""
    return {int(step): digest for step, digest in re.findall(r"^rank 0 epoch \d+ step (\d+) batch (\w+) ", out, re.M)}


def test_ddp_example_without_torchrun_runs_as_one_process_and_resumes(tmp_path):
    # 32 images in batches of 8: 4 steps an epoch, so the interrupted run stops mid-epoch 0
    # and the resumed one finishes it and goes into epoch 1
    whole = run_ddp_alone(["--steps", "6"], tmp_path)
    assert "not started by torchrun (no RANK in the environment): running as a single process" in whole
    assert "\n1 rank on cpu, 32 images, 4 batches per rank and epoch\n" in whole
    assert sorted(batches_of(whole)) == [1, 2, 3, 4, 5, 6] and "saved" not in whole and "resumed" not in whole
    first = run_ddp_alone(["--steps", "3", "--checkpoint", "ckpt.pt"], tmp_path)
    assert first.endswith("saved step 3, epoch 0 to ckpt.pt: --resume ckpt.pt goes on from there\n"), first
    rest = run_ddp_alone(["--steps", "6", "--resume", "ckpt.pt"], tmp_path)
    assert "\nresumed from ckpt.pt: step 3, epoch 0\n" in rest
    resumed = batches_of(rest)
    assert sorted(resumed) == [4, 5, 6]
    assert resumed == {step: digest for step, digest in batches_of(whole).items() if step > 3}


WRITES = """
import runpy, sys
class Writes:  # records every write to stdout, one repr a line on stderr
    def __init__(self, out):
        self.out = out
    def write(self, text):
        sys.__stderr__.write(f"write {text!r}\\n")
        return self.out.write(text)
    def __getattr__(self, name):
        return getattr(self.out, name)
sys.stdout = Writes(sys.stdout)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_ddp_example_writes_each_line_whole(tmp_path):
    # ranks share one terminal: a line written in two pieces (print writes the newline apart) is
    # glued to another rank's where output is unbuffered (python -u, PYTHONUNBUFFERED)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(AIOLOAD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, "-c", WRITES, str(ROOT / "examples/ddp_train.py"), "--workers", "1",
                           "--images", "32", "--steps", "2"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    writes = [ast.literal_eval(line[len("write "):]) for line in done.stderr.splitlines() if line.startswith("write ")]
    assert len(writes) == len(done.stdout.splitlines()) >= 4, done.stdout
    assert all(text.endswith("\n") and text.count("\n") == 1 for text in writes), writes


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


def test_train_async_trains_the_steps_asked_for_across_epochs(tmp_path):
    # 256 images in batches of 32 make 8 steps per epoch: 12 steps take a second epoch
    out = run_example([str(ROOT / "examples/train_async.py"), "--steps", "12", "--workers", "1"], tmp_path)
    assert "done: 12 steps in 2 epochs, loss " in out
    beat = re.search(r"heartbeat ticked (\d+) times; its longest gap: ([\d.]+) ms while awaiting a batch, "
                     r"([\d.]+) ms during a training step$", out, re.M)
    assert beat is not None, out
    assert int(beat[1]) > 0, "the event loop kept running during training"


def test_remote_example_tells_http_reads_from_cache_hits(tmp_path):
    # 64 images in batches of 16: 8 steps are two epochs, the first over HTTP, the second from
    # the memory cache
    out = run_example([str(ROOT / "examples/remote_images.py"), "--steps", "8", "--workers", "1"], tmp_path)
    http = re.search(r"^epoch 0 reads: 64 over HTTP, ([\d.]+) ms each on average$", out, re.M)
    cached = re.search(r"^epoch 1 reads: 64 from the cache, ([\d.]+) ms each on average$", out, re.M)
    assert http and cached, out
    assert re.search(r"^reads: 64 over HTTP, [\d.]+ ms each on average; 64 from the cache, [\d.]+ ms each on average$",
                     out, re.M), out
    assert "cache: 64 hits, 64 misses, 64 objects" in out


def test_benchmark_suite_runs(tmp_path):
    """The benchmark script itself, on its smallest workload: it must not rot."""
    out = run_example([str(ROOT / "benchmarks/run.py"), "--suite", "tiny", "--quick", "--rows", "2048",
                       "--workers", "1"], tmp_path, timeout=400)
    table = out.split("## Tiny samples")[1]
    for name in ("torch DataLoader, 0 workers", "torch DataLoader, 1 workers", "aioload DataLoader, 1 workers"):
        assert name in table
