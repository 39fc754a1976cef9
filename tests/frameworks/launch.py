"""Running a framework's script as the training job would run: a subprocess (with the ranks
that it or torchrun starts), bounded by a hang guard and killed with all its children.

A job still running at its time limit is sent SIGABRT first: ``PYTHONFAULTHANDLER=1`` makes
every Python process of it print all its threads' stacks, so a hang fails with where it hung.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent
LAUNCH_TIMEOUT = 300  # two ranks importing torch and a framework on a busy 2-core machine
FAILED_RANK_GRACE = 20  # seconds the other ranks get to finish once one has failed
STACK_DUMP_WAIT = 5  # seconds given to print the stacks after SIGABRT


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
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **(env or {}))
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    hung = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hung = True
        _dump_stacks([proc])
    finally:
        _signal_group(proc.pid, signal.SIGKILL)  # whatever is left of the job: ranks, their workers
    if hung:
        out, _ = proc.communicate()
        raise AssertionError(f"still running after {timeout} s, killed:\n{out}")
    return Job(proc.returncode, out)


def run_ranks(script: Path, args: list[str], world: int = 2, timeout: float = LAUNCH_TIMEOUT) -> list[str]:
    """Start ``world`` processes running ``script ARGS`` with the environment torchrun gives its
    ranks; returns their outputs, and fails with all of them if any rank fails or hangs.

    Each rank writes to a file of its own, never to a pipe: a rank blocked on a full pipe
    while another is being waited for would stop in a collective the other waits in. Once a
    rank has failed, the others get ``FAILED_RANK_GRACE`` seconds (they may be waiting for it
    in a collective); ranks still running then, or at ``timeout``, print their stacks and are
    killed with their workers.
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        paths = [Path(logs) / f"rank{rank}.log" for rank in range(world)]
        procs = []
        try:
            for rank, path in enumerate(paths):
                env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                           WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
                with open(path, "wb") as log:
                    procs.append(subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, env=env,
                                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            problem = _wait_ranks(procs, timeout)
        finally:
            for proc in procs:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        outputs = [path.read_text(errors="replace") for path in paths]
    failed = [rank for rank, proc in enumerate(procs) if proc.returncode != 0]
    assert problem is None and not failed, (problem or f"rank(s) {failed} failed") + "".join(
        f"\n--- rank {rank} (exit status {proc.returncode}) ---\n{out}"
        for rank, (proc, out) in enumerate(zip(procs, outputs)))
    return outputs


def _wait_ranks(procs: list[subprocess.Popen], timeout: float) -> str | None:
    """Wait until every rank has exited; returns what went wrong when some had to be stopped
    (after their stacks were printed)."""
    deadline, why = time.monotonic() + timeout, f"still running after {timeout} s"
    while running := [rank for rank, proc in enumerate(procs) if proc.poll() is None]:
        now = time.monotonic()
        if any(proc.returncode for proc in procs) and now + FAILED_RANK_GRACE < deadline:
            deadline, why = now + FAILED_RANK_GRACE, f"still running {FAILED_RANK_GRACE} s after a rank failed"
        if now >= deadline:
            _dump_stacks([procs[rank] for rank in running])
            return f"rank(s) {running} {why}; their stacks follow"
        time.sleep(0.2)  # a handful of processes, watched for minutes: polling costs nothing here
    return None


def _dump_stacks(procs: list[subprocess.Popen]) -> None:
    """SIGABRT to each process's group: with ``PYTHONFAULTHANDLER=1`` every Python process of
    it prints all its threads' stacks and exits; given ``STACK_DUMP_WAIT`` seconds to do so."""
    for proc in procs:
        _signal_group(proc.pid, signal.SIGABRT)
    for proc in procs:
        try:
            proc.wait(STACK_DUMP_WAIT)
        except subprocess.TimeoutExpired:
            pass


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def torchrun_args(script: str, args: list[str], nproc: int = 2) -> list[str]:
    """``-m torch.distributed.run --nproc-per-node NPROC script ARGS`` on 127.0.0.1 (``script``
    relative to tests/frameworks, or absolute)."""
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
