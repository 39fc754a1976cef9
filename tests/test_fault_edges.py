"""Failures at the edges of a loader's life: a loader inside a multiprocessing child, errors
that cross process boundaries, indices and read results a worker cannot take, and what a
deliberate crash leaves on stderr.

Every child process has a hang guard and is killed in a ``finally``, its workers with it, so a
regression fails the test instead of leaking processes into later ones.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal

import pytest

import aioload
from tests.faulty import FaultyMapDataset, write_samples
from tests.resources import gone, wait_until

pytestmark = pytest.mark.timeout(120)

N = 40
HANG_GUARD = 60.0
"""Seconds a child gets to exit; it needs a few (spawn imports torch twice on a busy machine)."""


# -- a loader inside a multiprocessing child --------------------------------------------------

_KEPT: list = []
"""What a child keeps alive until it exits (an iterator in the middle of its epoch)."""


def _worker_pids() -> list[int]:
    return [p.pid for p in multiprocessing.active_children() if p.name.startswith("aioload-worker")]


def _stall_then_raise(root, conn) -> None:
    """Iterate a loader whose worker stalls on the first sample: ``timeout=1`` raises, and the
    exception ends the child."""
    loader = aioload.DataLoader(FaultyMapDataset(root, N, {0: "decode-hang"}), batch_size=4,
                                num_workers=2, timeout=1)
    try:
        for _ in loader:
            pass
    finally:
        conn.send(_worker_pids())


def _return_mid_epoch(root, conn) -> None:
    """Take one batch, keep the iterator (and so the epoch) alive, and return."""
    loader = aioload.DataLoader(FaultyMapDataset(root, N), batch_size=4, num_workers=2, timeout=60)
    _KEPT.append(iter(loader))
    next(_KEPT[-1])
    conn.send(_worker_pids())


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("target, exitcode", [(_stall_then_raise, 1), (_return_mid_epoch, 0)],
                         ids=["raises", "returns-mid-epoch"])
def test_a_multiprocessing_child_that_used_a_loader_exits(tmp_path, method, target, exitcode):
    """A multiprocessing child runs no ``atexit`` hook and joins its children before exiting:
    the loader's workers must be stopped by then, or the child never exits."""
    write_samples(tmp_path, N)
    ctx = multiprocessing.get_context(method)
    ours, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=target, args=(str(tmp_path), theirs))
    workers: list[int] = []
    try:
        child.start()
        theirs.close()
        assert ours.poll(HANG_GUARD), "the child never reported its workers"
        workers = ours.recv()
        assert len(workers) == 2
        child.join(HANG_GUARD)
        assert not child.is_alive(), f"the child was still alive {HANG_GUARD} s after its loader finished"
        assert child.exitcode == exitcode
        wait_until(lambda: all(gone(pid) for pid in workers), 10, "the child's workers to exit")
    finally:
        if child.is_alive():
            child.kill()
        if child.pid is not None:
            child.join(10)
        for pid in workers:  # a worker stuck in decode-hang outlives a killed child
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        ours.close()
