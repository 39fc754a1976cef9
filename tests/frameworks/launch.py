"""Running a framework's script as the training job would run: a subprocess (with the ranks
that it or torchrun starts), bounded by a hang guard and killed with all its children."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent
LAUNCH_TIMEOUT = 300  # two ranks importing torch and a framework on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job(NamedTuple):
    returncode: int
    output: str


def run(args: list[str], timeout: float = LAUNCH_TIMEOUT, env: dict | None = None, check: bool = True) -> str:
    """Run ``python ARGS`` in its own session (so that the ranks it launches are killed with it
    if it hangs); returns its output, and fails with it when the exit status is not 0."""
    job = start(args, timeout, env)
    if check:
        assert job.returncode == 0, job.output
    return job.output


def start(args: list[str], timeout: float = LAUNCH_TIMEOUT, env: dict | None = None) -> Job:
    """Run ``python ARGS`` as :func:`run` does; returns its exit status and output. A job
    still running after ``timeout`` seconds is killed and fails here, with its output."""
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
    return Job(proc.returncode, out)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def torchrun_args(script: str, args: list[str], nproc: int = 2) -> list[str]:
    """``-m torch.distributed.run --nproc-per-node NPROC script ARGS`` on 127.0.0.1."""
    return ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPTS / script), *args]


def torchrun(script: str, args: list[str], nproc: int = 2, timeout: float = LAUNCH_TIMEOUT) -> str:
    return run(torchrun_args(script, args, nproc), timeout=timeout)


class Ranks:
    """What each rank of a job wrote to ``<out>/rank<r>.json`` (one dict of cases per rank),
    with the job's output to fail with when a case is missing."""

    def __init__(self, job: Job, out: Path, world: int):
        self.job = job
        self.ranks = [json.loads(p.read_text()) if (p := out / f"rank{r}.json").exists() else {}
                      for r in range(world)]

    def case(self, name: str) -> list:
        """``name``'s result on every rank; fails with the job's output if a rank has none."""
        missing = [r for r, rank in enumerate(self.ranks) if name not in rank]
        assert not missing, f"rank(s) {missing} did not record {name!r}:\n{self.job.output}"
        return [rank[name] for rank in self.ranks]

    def check_exit(self) -> None:
        assert self.job.returncode == 0, self.job.output
