"""A blocking call inside ``async def read`` (``time.sleep``, a synchronous HTTP client) holds
the event loop that runs the reads, so the other reads in flight and ``read_timeout`` wait:
the loader says so once, with a BlockingReadWarning naming the dataset's read and the fix,
wherever the reads run -- the loader's loop, a worker's, an executor's task."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import time
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
    from aioload._data.reads import STALL_ALONE, StallMeter

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


class BlocksOnce(aioload.Dataset):
    """Every read awaits, but read ``blocker`` blocks its loop ``seconds`` first."""

    def __init__(self, n: int, blocker: int, seconds: float):
        self.n, self.blocker, self.seconds = n, blocker, seconds

    def __len__(self) -> int:
        return self.n

    async def read(self, i):
        if i == self.blocker:
            time.sleep(self.seconds)
            return i
        await asyncio.sleep(0)
        return i


def test_a_step_past_read_timeout_is_seen_beyond_the_reads_a_meter_samples():
    from aioload._data.reads import STALL_SAMPLE, BatchReads

    # after the first STALL_SAMPLE ** 2 reads a meter times one in STALL_SAMPLE; with read_timeout
    # every read is timed, so the one that blocks is found whichever it is
    n = STALL_SAMPLE * STALL_SAMPLE + 3 * STALL_SAMPLE
    blocker = n - STALL_SAMPLE // 2  # not one the sample times
    core = BatchReads(BlocksOnce(n, blocker, 0.4), bound=asyncio.Semaphore(8), read_timeout=0.3)
    raws, _, _ = asyncio.run(core.read(list(range(n))))
    assert raws == list(range(n))
    stall = core.meter.take()
    assert stall is not None and (stall.index, stall.overran) == (blocker, 0.3)
