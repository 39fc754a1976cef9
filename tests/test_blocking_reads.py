"""A blocking call inside ``async def read`` (``time.sleep``, a synchronous HTTP client) holds
the event loop that runs the reads, so the other reads in flight and ``read_timeout`` wait:
the loader says so once, with a BlockingReadWarning naming the dataset's read and the fix,
wherever the reads run -- the loader's loop, a worker's, an executor's task."""

from __future__ import annotations

import concurrent.futures
import re
import warnings

import pytest
import torch

import aioload
from tests.executor_data import BlocksInRead, SleepsInRead

WHERE = {
    "loader": "on the loader's event loop",
    "workers": "in an aioload worker",
    "executor": "on ProcessPoolExecutor",
}


def load(where: str, dataset, **settings) -> list:
    kwargs = {"loader": dict(num_workers=2, read_in_workers=False), "workers": dict(num_workers=1),
              "executor": {}}[where] | settings
    with concurrent.futures.ProcessPoolExecutor(1) as pool:
        if where == "executor":
            kwargs["executor"] = pool
        with aioload.DataLoader(dataset, batch_size=6, **kwargs) as loader:
            return [i for batch in loader for i in batch.flatten().tolist()]


@pytest.mark.parametrize("where", ["loader", "workers", "executor"])
def test_a_read_that_blocks_its_loop_is_warned_about_once(where):
    with pytest.warns(aioload.BlockingReadWarning) as said:
        assert load(where, BlocksInRead(30, block=0.06)) == list(range(30))
    assert len(said) == 1
    message = str(said[0].message)
    assert message.startswith(f"tests.executor_data.BlocksInRead.read blocks its event loop {WHERE[where]}: ")
    assert "await asyncio.to_thread(f, ...)" in message and "async client" in message
    assert said[0].filename == __file__  # pointed at the loop that iterates the loader


@pytest.mark.parametrize("where", ["loader", "workers", "executor"])
def test_a_read_that_blocks_past_read_timeout_is_warned_about_at_once(where):
    # issue 32 item 14: two reads that block 1 s each and return, with read_timeout=0.2: too
    # few blocking reads for a habit, but the timeout the loader was asked to keep never fired
    with pytest.warns(aioload.BlockingReadWarning) as said:
        assert load(where, SleepsInRead(2, 1.0), read_timeout=0.2) == [0, 1]
    assert len(said) == 1
    message = str(said[0].message)
    assert re.match(rf"tests\.executor_data\.SleepsInRead\.read blocks its event loop {WHERE[where]}: a step of "
                    r"read\([01]\) ran \d+\.\d s without awaiting, longer than read_timeout=0\.2, which could not fire "
                    r"meanwhile", message), message
    assert "await asyncio.to_thread(f, ...)" in message and "async client" in message
    assert said[0].filename == __file__


def test_a_read_that_blocks_within_read_timeout_is_no_stall():
    with warnings.catch_warnings():
        warnings.simplefilter("error", aioload.BlockingReadWarning)
        assert load("workers", SleepsInRead(2, 0.06), read_timeout=5.0) == [0, 1]


@pytest.mark.parametrize("where", ["loader", "workers"])
def test_one_blocking_step_is_not_a_stall(where):
    # a first read that blocks once (a module imported, a client set up) is no habit: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", aioload.BlockingReadWarning)
        assert load(where, BlocksInRead(18, block=1.2, only_first=True)) == list(range(18))


def test_reads_that_await_are_not_warned_about():
    with warnings.catch_warnings():
        warnings.simplefilter("error", aioload.BlockingReadWarning)
        assert load("workers", BlocksInRead(60, block=0.0)) == list(range(60))


def test_the_warning_is_a_runtime_warning_that_can_be_filtered():
    assert issubclass(aioload.BlockingReadWarning, RuntimeWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=aioload.BlockingReadWarning)
        assert load("loader", BlocksInRead(30, block=0.06)) == list(range(30))
    assert torch.tensor(0).item() == 0


def test_one_step_longer_than_read_timeout_is_a_stall_by_itself():
    from aioload._reads import STALL_ALONE, StallMeter

    def found(timeout, steps):
        meter = StallMeter()
        meter.timeout = timeout
        for index, seconds in enumerate(steps):
            meter.begin()
            meter.step(seconds, index)
        return meter.take()

    stall = found(0.5, [0.01, 3.0])
    assert (stall.index, stall.longest_s, stall.overran) == (1, 3.0, 0.5)
    assert found(None, [0.01, 3.0]) is None  # without a timeout, one long step is no habit
    assert found(5.0, [3.0]) is None  # within the timeout
    assert found(0.06, [STALL_ALONE * 0.9]) is None  # a preempted step, not a blocking one
