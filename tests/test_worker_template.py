"""With ``spawn`` or ``forkserver``, the dataset reaches the workers once: one template process
unpickles it and forks every worker (:mod:`aioload._workers.template`). Everything a worker
does is kept (ids, seeds, ``worker_init_fn``, ``get_worker_info()``, persistent workers), and
where the template cannot be used the workers start as torch's do, ``stats()`` saying why."""

from __future__ import annotations

import functools
import gc
import os
import threading

import pytest
import torch

import aioload
from tests.resources import Snapshot, assert_released, gone, wait_until


class Counted(torch.utils.data.Dataset):
    """Appends this process's pid to ``tally`` each time a copy is unpickled."""

    def __init__(self, tally: str):
        self.tally = tally
        self.payload = list(range(10_000))

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        return torch.tensor([index, info.id, info.seed % 2**31, os.getpid(), gc.get_freeze_count()])

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        with open(self.tally, "a") as f:
            f.write(f"{os.getpid()}\n")


_IDLE = threading.Event()


class StartsAThread(Counted):
    """Its unpickling starts a thread: a process that did must not fork workers."""

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        threading.Thread(target=_IDLE.wait, daemon=True).start()


@pytest.fixture(scope="module", autouse=True)
def warm(tmp_path_factory):
    """One loader before any snapshot: lazily opened, process-wide handles are then part of
    every baseline."""
    with aioload.DataLoader(Counted(str(tmp_path_factory.mktemp("warm") / "tally")), batch_size=4,
                            num_workers=1, multiprocessing_context="fork") as loader:
        list(loader)


def record_init(path: str, worker_id: int) -> None:
    with open(path, "a") as f:
        f.write(f"{worker_id} {os.getpid()}\n")


def unpickled(tally) -> list[int]:
    return [int(line) for line in tally.read_text().split()] if tally.exists() else []


def rows(loader) -> list[list[int]]:
    return [row for batch in loader for row in batch.tolist()]


@pytest.mark.parametrize(("start_method", "explicit"), [("spawn", False), ("forkserver", True)],
                         indirect=["start_method"])
def test_the_dataset_is_unpickled_once_and_every_worker_is_forked_from_that_copy(tmp_path, start_method, explicit):
    before = Snapshot.take()  # after start_method's fixture: the interpreter's helpers are running
    tally, inits = tmp_path / "unpickled", tmp_path / "inits"
    kwargs = dict(multiprocessing_context=start_method) if explicit else {}
    loader = aioload.DataLoader(Counted(str(tally)), batch_size=4, num_workers=2, persistent_workers=True,
                                worker_init_fn=functools.partial(record_init, str(inits)), **kwargs)
    with loader:
        first, second = rows(loader), rows(loader)
        pool = loader._res.pool
        template, workers = pool.template.proc.pid, [proc.pid for proc in pool.procs]
        assert loader.stats().worker_start == \
            f"{start_method}: one process unpickled the dataset once, and each worker is forked from it"
    assert unpickled(tally) == [template]
    assert sorted(row[0] for row in first) == sorted(row[0] for row in second) == list(range(32))
    # each worker kept its id, its seed (the base seed + its id) and its pid over both epochs
    by_id = {row[1]: (row[2], row[3]) for row in first + second}
    assert sorted(by_id) == [0, 1] and len({(r[1], r[2], r[3]) for r in first + second}) == 2
    assert [by_id[wid][0] - by_id[0][0] for wid in range(2)] == [0, 1]
    assert sorted(pid for _, pid in by_id.values()) == sorted(workers) and template not in workers
    assert sorted(inits.read_text().split("\n")[:-1]) == sorted(f"{wid} {by_id[wid][1]}" for wid in range(2))
    assert all(row[4] > 0 for row in first)  # the template froze what it holds out of the collector's sight
    wait_until(lambda: all(gone(pid) for pid in workers + [template]), 10, "the workers and their template to exit")
    assert_released(before)


@pytest.mark.parametrize("start_method", ["spawn"], indirect=True)
def test_opting_out_starts_each_worker_with_its_own_copy_and_says_so(tmp_path, monkeypatch, start_method):
    monkeypatch.setenv("AIOLOAD_WORKER_TEMPLATE", "0")
    tally = tmp_path / "unpickled"
    with aioload.DataLoader(Counted(str(tally)), batch_size=4, num_workers=2) as loader:
        got = rows(loader)
        assert loader.stats().worker_start == \
            "spawn: each worker unpickles its own copy of the dataset (AIOLOAD_WORKER_TEMPLATE=0)"
    assert sorted(row[0] for row in got) == list(range(32))
    assert len(unpickled(tally)) == 2


@pytest.mark.parametrize("start_method", ["forkserver"], indirect=True)
def test_a_dataset_whose_unpickling_starts_a_thread_falls_back_and_says_why(tmp_path, start_method):
    before = Snapshot.take()
    tally = tmp_path / "unpickled"
    with aioload.DataLoader(StartsAThread(str(tally)), batch_size=4, num_workers=2) as loader:
        got = rows(loader)
        assert loader.stats().worker_start == ("forkserver: each worker unpickles its own copy of the dataset "
                                               "(unpickling the dataset started 1 thread(s), which a forked worker "
                                               "would not have)")
    assert sorted(row[0] for row in got) == list(range(32))
    assert len(unpickled(tally)) == 3  # the template's copy, then each worker's
    assert_released(before)


def test_fork_workers_are_forked_from_the_training_process(tmp_path):
    tally = tmp_path / "unpickled"
    with aioload.DataLoader(Counted(str(tally)), batch_size=4, num_workers=2,
                            multiprocessing_context="fork") as loader:
        rows(loader)
        assert loader.stats().worker_start == "fork: each worker is forked from the training process"
        assert loader._res.pool.template is None
    assert unpickled(tally) == []
