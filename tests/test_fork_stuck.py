"""A worker forked from a training process that has other threads can stay stuck in the fork
itself, before it runs any code: a lock another thread held at the fork stays held in the child
(CPython before 3.11.8 takes one after every fork, gh-112275; DDP's gloo threads triggered it
under Lightning). The pool kills such a worker and forks it again; one that stays stuck every
time fails with an error that says why and what to do, and nothing is left behind.

The stuck fork is made with an ``os.register_at_fork`` hook that never returns in the child,
in a process of its own (a hook cannot be taken back)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.benchscripts import ROOT

pytestmark = pytest.mark.timeout(120)

SCRIPT = r"""
import os, sys, time, warnings
import aioload
import aioload._workers.pool as pool

pool.FORK_START_S = 1.0
marker, mode = sys.argv[1], sys.argv[2]


def stuck():  # in the child, as one deadlocked on a lock inherited held
    if mode == "always" or not os.path.exists(marker):
        open(marker, "a").close()
        while True:
            time.sleep(60)


if __name__ == "__main__":
    os.register_at_fork(after_in_child=stuck)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with aioload.DataLoader(list(range(40)), batch_size=8, num_workers=2,
                                    multiprocessing_context="fork") as loader:
                print("ROWS", sorted(int(x) for batch in loader for x in batch) == list(range(40)))
        except RuntimeError as exc:
            print("ERROR", exc)
    print("WARNINGS", sum("stuck in the fork" in str(w.message) for w in caught))
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        print("CHILDREN", len(f.read().split()))
"""


def run(tmp_path, mode: str) -> str:
    script = tmp_path / "stuck_fork.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "marker"), mode], cwd=ROOT,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done.stdout


def test_a_worker_stuck_in_the_fork_is_forked_again_and_the_epoch_is_whole(tmp_path):
    out = run(tmp_path, "once")
    assert "ROWS True" in out
    assert "WARNINGS 1" in out
    assert "CHILDREN 0" in out


def test_a_worker_stuck_in_every_fork_fails_the_loader_naming_the_cause_and_the_fix(tmp_path):
    out = run(tmp_path, "always")
    assert "ERROR aioload worker" in out and "forked 3 times" in out and "gh-112275" in out
    assert "multiprocessing_context='forkserver'" in out
    assert "WARNINGS 4" in out  # each of the 2 workers killed and forked again twice before the third try fails
    assert "CHILDREN 0" in out
