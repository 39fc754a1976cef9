"""Running a framework's script as the training job would run: a subprocess (with the ranks
that it or torchrun starts), bounded by a hang guard and killed with all its children."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent
LAUNCH_TIMEOUT = 300  # two ranks importing torch and a framework on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str], timeout: float = LAUNCH_TIMEOUT, env: dict | None = None) -> str:
    """Run ``python ARGS`` in its own session (so that the ranks it launches are killed with it
    if it hangs); returns its output, and fails with it when the exit status is not 0."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), **(env or {}))
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    hung = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hung = True
    finally:
        _kill_group(proc.pid)  # whatever is left of the job: ranks, their workers
    if hung:
        out, _ = proc.communicate()
        raise AssertionError(f"still running after {timeout} s, killed:\n{out}")
    assert proc.returncode == 0, out
    return out


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def torchrun(script: str, args: list[str], nproc: int = 2, timeout: float = LAUNCH_TIMEOUT) -> str:
    """``python -m torch.distributed.run --nproc-per-node NPROC script ARGS`` on 127.0.0.1."""
    return run(["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPTS / script),
                *args], timeout=timeout)
