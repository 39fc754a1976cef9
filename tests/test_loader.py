"""Core behaviour: delivery, length, order, async iteration, early exit, errors."""

from __future__ import annotations

import asyncio
import collections
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest
import torch

import aioload
from aioload._engine import decode as _decode
from aioload._workers.pool import PER_WORKER_TASKS
from tests.conftest import aioload_threads, child_pids
from tests.datasets import FailsAt, SlowReads, SlowSquares, Squares


ROOT = Path(__file__).resolve().parent.parent


def flat_labels(batches, pos=1):
    return [int(v) for b in batches for v in b[pos]]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("dataset", [Squares(103), SlowReads(57)], ids=["plain", "split"])
def test_every_sample_exactly_once_per_epoch(dataset, num_workers):
    with aioload.DataLoader(dataset, batch_size=10, shuffle=True, num_workers=num_workers) as loader:
        for _ in range(2):
            labels = flat_labels(list(loader))
            assert sorted(labels) == list(range(len(dataset)))


def _limits_seen(loader) -> tuple[int, list[tuple[int, int]]]:
    """One epoch: samples delivered, and (permits, slot pool target) after every batch."""
    samples, seen = 0, []
    for batch in loader:
        samples += len(batch[0])
        slots = loader._res.shared.slots
        seen.append((loader._res.engine._permits.limit, slots.target if slots is not None else None))
    return samples, seen


def test_whole_batches_keep_what_each_worker_holds_in_flight_and_queue_depth_on_top():
    # torch's dispatch (in order, no seed=): each batch goes whole to its worker, which holds
    # PER_WORKER_TASKS of them; queue_depth finished batches come on top of those, from the start.
    held = 2 * PER_WORKER_TASKS + 2
    with aioload.DataLoader(SlowSquares(80, 0.002), batch_size=8, num_workers=2, queue_depth=2) as loader:
        samples, seen = _limits_seen(loader)
        assert samples == 80 and set(seen) == {(held, held + 1)}


def test_quick_batches_get_more_batches_in_flight(monkeypatch):
    # With seed= a batch is split across the workers, one batch per worker in flight; batches
    # measured to decode within WHOLE_BATCH_SECONDS go to one worker whole, and once that is
    # measured each worker gets PER_WORKER_TASKS of them in flight (queue_depth on top), and
    # the slot pool keeps as many slots. The line is moved far above any batch's time, so that
    # what is tested is the switch, not this machine's speed.
    monkeypatch.setattr(_decode, "WHOLE_BATCH_SECONDS", 60.0)
    quick = 2 * PER_WORKER_TASKS + 2
    with aioload.DataLoader(Squares(400), batch_size=8, num_workers=2, queue_depth=2, seed=0) as loader:
        samples, seen = _limits_seen(loader)
        assert samples == 400 and loader._res.shared.quick
        assert seen[-1] == (quick, quick + 1)  # 2 + 2 before the first batch was timed
        samples, seen = _limits_seen(loader)  # the next epoch starts with them
        assert samples == 400 and set(seen) == {(quick, quick + 1)}


def test_slow_batches_keep_one_batch_per_worker_in_flight(monkeypatch):
    # 8 samples of 5 ms: a batch of 40 ms or more, far above the (lowered) line, is split across
    # the workers (seed=); no more batches in flight.
    monkeypatch.setattr(_decode, "WHOLE_BATCH_SECONDS", 0.001)
    with aioload.DataLoader(SlowSquares(80, 0.005), batch_size=8, num_workers=2, queue_depth=2, seed=0) as loader:
        samples, seen = _limits_seen(loader)
        assert samples == 80 and not loader._res.shared.quick
        assert {permits for permits, _ in seen} == {2 + 2}


def test_out_of_order_delivery_still_delivers_everything_once():
    with aioload.DataLoader(SlowReads(64, delay=0.001), batch_size=4, num_workers=2, in_order=False) as loader:
        labels = flat_labels(list(loader))
    assert collections.Counter(labels) == collections.Counter(range(64))


@pytest.mark.parametrize("drop_last, expected", [(False, 11), (True, 10)])
def test_len_matches_batches(drop_last, expected):
    with aioload.DataLoader(Squares(103), batch_size=10, num_workers=2, drop_last=drop_last) as loader:
        assert len(loader) == expected
        assert len(list(loader)) == expected
        assert len(loader) == expected


def test_batches_match_torch_without_shuffle():
    dataset = Squares(45)
    reference = list(torch.utils.data.DataLoader(dataset, batch_size=8))
    with aioload.DataLoader(dataset, batch_size=8, num_workers=2) as loader:
        got = list(loader)
    assert len(got) == len(reference)
    for ours, theirs in zip(got, reference):
        assert torch.equal(ours[0], theirs[0])
        assert torch.equal(ours[1], theirs[1])
        assert ours[2] == theirs[2]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers, reads", [(1, 1), (3, 256)])
def test_order_depends_on_seed_only(workers, reads):
    def order(num_workers, io_concurrency, seed=7):
        with aioload.DataLoader(SlowReads(50), batch_size=6, shuffle=True, num_workers=num_workers,
                                io_concurrency=io_concurrency, seed=seed) as loader:
            return [flat_labels(list(loader)) for _ in range(2)]

    baseline = order(2, 16)
    assert order(workers, reads) == baseline
    assert baseline[0] != baseline[1], "each epoch reshuffles"
    assert order(2, 16, seed=8) != baseline


class GatedReads(SlowReads):
    """Reads that wait for the caller's event loop: sample ``i`` is read only once the caller's
    ticker has ticked more than ``i`` times. A consumer that blocked its own event loop while
    waiting for a batch would stop the ticker, and the reads would end in ``read_timeout``."""

    def __init__(self, n: int, ticks: list):
        super().__init__(n)
        self.ticks = ticks

    async def read(self, i):
        while self.ticks[0] <= i:
            await asyncio.sleep(0.001)
        return i


def _ticking(loader, backend: str, backend_options=None, ticks=None):
    """Iterate with ``async for`` while a coroutine of the caller's loop ticks; return
    (batches, ticks)."""
    ticks = ticks if ticks is not None else [0]

    async def main():
        batches = []

        async def ticker():
            while True:
                await anyio.sleep(0.001)
                ticks[0] += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            async for batch in loader:
                batches.append(batch)
            tg.cancel_scope.cancel()
        return batches, ticks[0]

    return anyio.run(main, backend=backend, backend_options=backend_options or {})


@pytest.mark.parametrize(
    "backend, options",
    [("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {})],
    ids=["asyncio", "uvloop", "trio"],
)
def test_async_iteration_never_blocks_the_event_loop(backend, options):
    # Each read waits for a tick of the caller's loop: the epoch can only end if the caller's
    # loop keeps running while `async for` waits for batches.
    ticks = [0]
    # the reads wait on this process's ticker: they must run on the loader's loop here
    with aioload.DataLoader(GatedReads(20, ticks), batch_size=5, num_workers=1, io_concurrency=1,
                            read_timeout=60, read_in_workers=False) as loader:
        batches, ticked = _ticking(loader, backend, options, ticks)
    assert flat_labels(batches) == list(range(20))
    assert ticked > 19


class ThreadOfIter(torch.utils.data.Sampler):
    """A sequential sampler that notes the thread each epoch's ``iter()`` runs in."""

    def __init__(self, n: int):
        self.n, self.threads = n, []

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.threads.append(threading.get_ident())
        return iter(range(self.n))


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_for_starts_its_epoch_off_the_event_loop(backend):
    # the epoch's start (its order, the workers, the engine's thread: 0.1-0.3 s) runs in a
    # thread, not on the loop that awaits the first batch
    sampler = ThreadOfIter(20)

    async def main(loader):
        return threading.get_ident(), [batch async for batch in loader]

    with aioload.DataLoader(Squares(20), batch_size=5, sampler=sampler, num_workers=1) as loader:
        loop_thread, batches = anyio.run(main, loader, backend=backend)
    assert flat_labels(batches) == list(range(20))
    assert len(sampler.threads) == 1 and sampler.threads[0] != loop_thread


def test_a_loader_built_in_a_thread_is_iterated_on_the_loop():
    # README's recipe for async code: build the loader off the loop, keep the workers across a break
    async def main():
        loader = await asyncio.to_thread(aioload.DataLoader, Squares(20), batch_size=5, num_workers=1,
                                         persistent_workers=True)
        async with loader:
            async for batch in loader:
                break
            return batch, [b async for b in loader], loader

    first, rest, loader = asyncio.run(main())
    assert first[1].tolist() == [0, 1, 2, 3, 4] and flat_labels(rest) == list(range(20))
    assert loader.closed


def test_async_with_closes_the_loader():
    async def main():
        async with aioload.DataLoader(Squares(20), batch_size=5, num_workers=1) as loader:
            first = None
            async for batch in loader:
                first = batch
                break
        return loader, first

    loader, first = asyncio.run(main())
    assert loader.closed
    assert first[1].tolist() == [0, 1, 2, 3, 4]


def _wait_until(predicate, deadline: float = 10.0) -> bool:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_break_stops_engine_thread_and_workers():
    loader = aioload.DataLoader(SlowReads(200), batch_size=4, num_workers=2)
    try:
        for i, _ in enumerate(loader):
            if i == 2:
                break
        assert _wait_until(lambda: not aioload_threads()), aioload_threads()
        assert _wait_until(lambda: not child_pids()), child_pids()
        # and the loader still works afterwards
        assert sorted(flat_labels(list(loader))) == list(range(200))
    finally:
        loader.close()
    assert _wait_until(lambda: not child_pids())


def test_exception_in_training_loop_stops_everything():
    loader = aioload.DataLoader(SlowReads(200), batch_size=4, num_workers=2)

    def train():
        for i, _ in enumerate(loader):
            if i == 3:
                raise KeyError("loss is nan")

    with pytest.raises(KeyError):
        train()
    assert _wait_until(lambda: not aioload_threads())
    assert _wait_until(lambda: not child_pids())
    loader.close()


def test_close_is_idempotent_and_iteration_after_close_is_an_error():
    loader = aioload.DataLoader(Squares(10), batch_size=5, num_workers=1)
    assert len(list(loader)) == 2
    loader.close()
    loader.close()
    assert not child_pids()
    with pytest.raises(aioload.LoaderClosedError, match="^this DataLoader was closed; create a new one to iterate again$"):
        iter(loader)


def test_decode_error_carries_type_message_index_and_path():
    with aioload.DataLoader(FailsAt(bad_decode=7), batch_size=4, num_workers=2) as loader:
        it = iter(loader)
        assert next(it).flatten().tolist() == [0, 1, 2, 3]
        with pytest.raises(ValueError) as info:
            next(it)
        assert str(info.value) == "corrupt sample 7"
        notes = "\n".join(info.value.__notes__)
        assert "dataset index 7 (/data/sample_7.bin)" in notes
        assert "decode" in notes
        assert "Original traceback" in notes and "raise ValueError" in notes
        # the epoch goes on after a failed batch, like torch's DataLoader
        assert next(it).flatten().tolist() == [8, 9, 10, 11]


def test_read_error_names_the_index_and_path():
    with aioload.DataLoader(FailsAt(bad_decode=-1, bad_read=5), batch_size=4, num_workers=1) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(OSError) as info:
            next(it)
        assert str(info.value) == "cannot read sample 5"
    assert "while reading dataset index 5 (/data/sample_5.bin) in an aioload worker" in info.value.__notes__


_NO_CUDA = """
import warnings, torch, aioload
from tests.datasets import Squares
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    with aioload.DataLoader(Squares(8), batch_size=4, num_workers=1, **{kwargs}) as loader:
        batches = list(loader)
print(len(batches), sorted({{str(t.device) for b in batches for t in b if isinstance(t, torch.Tensor)}}))
for w in said:
    print(w.category.__name__, w.message)
"""


def _without_cuda(kwargs: str) -> list[str]:
    """Run a loader in a process that sees no CUDA device, whatever this machine has."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _NO_CUDA.format(kwargs=kwargs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and not done.stderr, done.stderr
    return done.stdout.splitlines()


def test_pin_memory_without_cuda_warns_like_torch():
    first, *said = _without_cuda("dict(pin_memory=True)")
    assert first == "2 ['cpu']"
    assert any(line.startswith("UserWarning 'pin_memory' argument is set as true but no accelerator is found")
               for line in said), said


def test_device_cuda_without_cuda_warns_and_stays_on_cpu():
    first, *said = _without_cuda("dict(device='cuda')")
    assert first == "2 ['cpu']"
    assert said == ["UserWarning device='cuda' was requested but CUDA is not available: batches stay on the CPU."]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_cuda_delivers_the_cpu_batches_on_the_device():
    with aioload.DataLoader(Squares(24), batch_size=4, num_workers=2) as loader:
        expected = list(loader)
    with aioload.DataLoader(Squares(24), batch_size=4, num_workers=2, device="cuda") as loader:
        got = [batch for batch in loader if all(t.device.type == "cuda" for t in batch[:2])]
    assert len(got) == len(expected)
    for (x, i, names), (ex, ei, enames) in zip(got, expected):
        assert torch.equal(x.cpu(), ex) and torch.equal(i.cpu(), ei) and names == enames


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"io_concurrency": 0}, ValueError, "io_concurrency must be >= 1, got 0"),
        ({"queue_depth": 0}, ValueError, "queue_depth must be >= 1, got 0"),
        ({"io_concurrency": 2.5}, TypeError, "io_concurrency must be an int >= 1, got 2.5"),
        ({"on_error": "ignore"}, ValueError, "on_error must be 'raise' or 'skip', got 'ignore'"),
        ({"seed": 1, "generator": torch.Generator()}, ValueError,
         "pass either seed or generator, not both: seed=S makes aioload seed a generator per epoch"),
    ],
)
def test_bad_arguments_are_rejected_at_construction(kwargs, error, message):
    with pytest.raises(error, match=f"^{message.replace('(', '[(]').replace(')', '[)]')}$"):
        aioload.DataLoader(Squares(8), **kwargs)


class _SlowLogged(aioload.Dataset):
    """Every decode of the second batch on appends its index to ``log`` and takes 0.2 s."""

    def __init__(self, log):
        self.log = str(log)

    def __len__(self):
        return 64

    async def read(self, index):
        return index

    def decode(self, index):
        if index >= 4:
            with open(self.log, "a") as f:
                f.write(f"{index}\n")
            time.sleep(0.2)
        return torch.tensor(index)


def test_an_epoch_left_early_stops_its_workers_after_the_sample_in_hand(tmp_path):
    """Leaving an epoch (``break``, no persistent workers) stops the pool: each worker ends the
    sample it is decoding and starts no other, instead of decoding its queued tasks first."""
    log = tmp_path / "decoded"
    log.touch()
    with aioload.DataLoader(_SlowLogged(log), batch_size=4, num_workers=2, seed=0) as loader:
        for batch in loader:
            assert batch.tolist() == [0, 1, 2, 3]
            with open(log, "a") as f:
                f.write("break\n")
            break
    decoded = log.read_text().split()
    after = decoded[decoded.index("break") + 1:]
    # a worker may start one sample while Shutdown is on its way; before, each decoded its
    # queued tasks (0.2 s a sample, six of them here) until the pool's 2 s wait ran out
    assert len(after) <= 2, decoded  # at most one per worker
