"""The mistakes the spawn and forkserver start methods punish, each reported with its fix: a
main module whose code is not under ``if __name__ == "__main__":`` (each worker runs it again),
and what a worker must be sent but cannot be pickled (a lambda ``collate_fn``, say)."""

from __future__ import annotations

import multiprocessing.resource_tracker
import os
import pickle
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import aioload
from tests.resources import Snapshot, assert_released

ROOT = Path(__file__).resolve().parent.parent

UNGUARDED = textwrap.dedent("""
    import torch
    import aioload

    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.tensor(i * i)

    loader = aioload.DataLoader(Squares(), batch_size=4, num_workers=1, multiprocessing_context={method!r})
    print([batch.tolist() for batch in loader])
""")


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_main_module_without_the_main_guard_is_named_with_the_fix(tmp_path, method):
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED.format(method=method))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=tmp_path)
    assert done.returncode == 1 and done.stdout == "", done.stdout + done.stderr
    last = done.stderr.rstrip().splitlines()[-1]
    assert re.fullmatch(
        r"aioload\._base\.errors\.WorkerCrashedError: DataLoader worker \(pid \d+\) exited unexpectedly with exit code 1\. "
        rf"aioload worker 0 exited with code 1 before it started\. With the '{method}' start method each worker "
        rf"first runs the main module \({re.escape(str(script))}\) again, its top-level code included: where that "
        r"code iterates a DataLoader, the worker tries to start workers of its own and fails \(its error is printed "
        r"above\)\. Put the program's code under 'if __name__ == \"__main__\":', as torch's DataLoader also requires "
        r"with this start method\.", last), last


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor(i * i)


class Locked(Squares):
    def __init__(self):
        self.lock = threading.Lock()


def _nested():
    def init(worker_id):
        pass

    return init


FUNCTION_FIX = "make it a function defined at the top level of a module (not a lambda, nor a function defined inside another)"


@pytest.mark.parametrize(("method", "kwargs", "named", "fix"), [
    ("forkserver", {"collate_fn": lambda batch: torch.stack(batch)}, "collate_fn", FUNCTION_FIX),
    ("spawn", {"worker_init_fn": _nested()}, "worker_init_fn", FUNCTION_FIX),
    ("forkserver", {"dataset": Locked()}, "dataset",
     "make it an instance of a class defined at the top level of a module, holding no open file, lock, client or "
     "lambda (open those in the worker, on first use)"),
])
def test_what_a_worker_cannot_be_sent_is_named_with_the_fix(method, kwargs, named, fix):
    # the interpreter's resource tracker (its pipe held for good) is started by the first spawn
    # of a session: not the loader's to release
    multiprocessing.resource_tracker.ensure_running()
    before = Snapshot.take()
    dataset = kwargs.pop("dataset", Squares())
    with aioload.DataLoader(dataset, batch_size=4, num_workers=1, multiprocessing_context=method, **kwargs) as loader:
        with pytest.raises(TypeError) as caught:
            next(iter(loader))
    message = str(caught.value)
    assert message.startswith(f"{named} ") and f" cannot be pickled, and the {method!r} start method sends it to " \
        "every worker (" in message, message
    assert message.endswith(f"): {fix}, or use multiprocessing_context='fork' where the platform has it"), message
    assert caught.value.__cause__ is not None  # pickle's own error, chained
    # what torch lets through from pickle (PicklingError for a lambda, AttributeError for a
    # function defined inside another) catches it too, as docs/migration.md promises
    assert isinstance(caught.value, pickle.PicklingError)
    with pytest.raises(type(caught.value.__cause__)):
        raise caught.value
    assert_released(before)
