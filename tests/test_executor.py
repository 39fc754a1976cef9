"""executor=: the decode stage on a concurrent.futures.Executor -- the standard library's pools
and a real Dask cluster (a scheduler and two worker processes on 127.0.0.1)."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import time

import pytest
import torch

import aioload
from aioload._engine import executor as _executor
from aioload._engine import executor_process
from tests.executor_data import Augmented, KillsItsProcess, Pids, PlainAugmented, Unpickled, getpid
from tests.httpserver import Server

distributed = pytest.importorskip("distributed")  # in the test extra; a real cluster below


def run(dataset, epochs: int = 2, **kwargs) -> list:
    kwargs.setdefault("batch_size", 8)
    with aioload.DataLoader(dataset, **kwargs) as loader:
        return [list(loader) for _ in range(epochs)]


def assert_same(got, expected) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        elif isinstance(b, dict):
            assert list(a) == list(b)
            for key in b:
                assert_same(a[key], b[key])
        elif isinstance(b, (list, tuple)):
            assert type(a) is type(b)
            assert_same(list(a), list(b))
        else:
            assert a == b


@pytest.fixture(scope="module")
def dask():
    """A scheduler and two worker processes on 127.0.0.1, with a client and its executor."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=":0", silence_logs=logging.CRITICAL) as cluster, \
            distributed.Client(cluster) as client:
        yield client


def nothing_left(client, deadline: float = 30.0) -> None:
    """The cluster holds no task and no result, and no worker keeps a loader's dataset."""
    end = time.monotonic() + deadline
    while True:
        busy = {w: t for w, t in client.processing().items() if t}
        keys = client.who_has()
        tokens = {w: t for w, t in client.run(_executor.known_tokens).items() if t}
        if not busy and not keys and not tokens:
            return
        assert time.monotonic() < end, f"left on the cluster: processing {busy}, keys {list(keys)}, datasets {tokens}"
        time.sleep(0.05)


# -- the same batches as the built-in pool --------------------------------------------------------
@pytest.mark.parametrize("kind", ["processes", "dask"])
@pytest.mark.parametrize("dataset", [Augmented(37), PlainAugmented(37)], ids=["split", "plain"])
def test_seeded_batches_equal_the_built_in_pools(kind, dataset, request):
    executor = request.getfixturevalue(kind)
    if kind == "dask":
        executor = executor.get_executor()
    expected = run(dataset, shuffle=True, seed=5, num_workers=2)
    got = run(dataset, shuffle=True, seed=5, executor=executor)
    assert len(got[0]) == 5
    for epoch_got, epoch_expected in zip(got, expected):
        assert_same(epoch_got, epoch_expected)


def test_threads_give_the_built_in_pools_batches_without_random_draws(threads):
    expected = run(Pids(30), num_workers=2)
    got = run(Pids(30), executor=threads)
    for epoch_got, epoch_expected in zip(got, expected):
        assert [b[1].tolist() for b in epoch_got] == [b[1].tolist() for b in epoch_expected]
        assert {pid for b in epoch_got for pid in b[2].tolist()} == {os.getpid()}  # no pickling, no process


def test_threads_refuse_seed_since_they_share_the_generators(threads):
    with pytest.raises(ValueError, match=r"^seed= seeds each sample's random draws .* with a ThreadPoolExecutor "
                                         r"leave seed=None$"):
        aioload.DataLoader(Augmented(8), executor=threads, seed=1)


def test_batches_are_made_by_the_executors_processes(processes):
    pids = {pid for epoch in run(Pids(40), executor=processes, epochs=1) for pid in epoch[0][2].tolist()}
    assert os.getpid() not in pids and pids


# -- the dataset travels once ---------------------------------------------------------------------
def test_the_dataset_reaches_each_process_once_and_is_dropped_on_close(tmp_path):
    log = tmp_path / "unpickled"
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        with aioload.DataLoader(Unpickled(80, str(log)), batch_size=4, executor=pool) as loader:
            for _ in range(2):
                assert sum(len(b[1]) for b in loader) == 80  # 40 tasks
            held = [pool.submit(_executor.known_tokens).result() for _ in range(4)]
            token = loader._res.executor.token
        pids = log.read_text().split()
    assert len(pids) == len(set(pids)) <= 2, f"the dataset was unpickled {len(pids)} times in {set(pids)}"
    assert all(token in tokens for tokens in held)


def test_threads_share_the_dataset_and_forget_it_on_close(threads):
    dataset = Augmented(16)
    with aioload.DataLoader(dataset, batch_size=4, executor=threads) as loader:
        list(loader)
        token = loader._res.executor.token
        assert executor_process._known[token][0] is dataset  # the trainer's own object: nothing pickled
    assert token not in _executor.known_tokens()


def test_dask_workers_drop_the_dataset_when_the_loader_closes(dask):
    with aioload.DataLoader(Augmented(24), batch_size=4, executor=dask.get_executor()) as loader:
        list(loader)
        token = loader._res.executor.token
        assert any(token in tokens for tokens in dask.run(_executor.known_tokens).values())
    nothing_left(dask)


# -- errors, skips, resume ------------------------------------------------------------------------
def test_a_failing_sample_raises_with_its_index(processes):
    with aioload.DataLoader(Augmented(16, bad={6}), batch_size=4, executor=processes) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(ValueError, match=r"^sample 6 is broken") as info:
            next(it)
    assert ("while running decode for dataset index 6 on ProcessPoolExecutor; on_error='skip' leaves such samples "
            "out and goes on") in info.value.__notes__


def test_failing_samples_are_skipped_with_on_error_skip(processes):
    with aioload.DataLoader(Augmented(16, bad={2, 9}), batch_size=4, executor=processes, on_error="skip") as loader:
        seen = [i for _, indices in loader for i in indices.tolist()]
        stats = loader.stats()
    assert seen == [i for i in range(16) if i not in (2, 9)]
    assert sorted(stats.skipped) == [2, 9]


def test_state_dict_resumes_exactly(processes):
    kwargs = dict(batch_size=4, shuffle=True, seed=11, executor=processes)
    (full,) = run(Augmented(40), epochs=1, **kwargs)
    with aioload.DataLoader(Augmented(40), **kwargs) as loader:
        head = []
        for batch in loader:
            head.append(batch)
            if len(head) == 3:
                break
        state = loader.state_dict()
    with aioload.DataLoader(Augmented(40), **kwargs) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    assert_same(head + rest, full)


# -- faults ---------------------------------------------------------------------------------------
def test_a_process_pool_whose_process_dies_raises_naming_the_indices():
    with concurrent.futures.ProcessPoolExecutor(1) as pool:
        with aioload.DataLoader(KillsItsProcess(12, victim=5), batch_size=4, executor=pool) as loader:
            it = iter(loader)
            next(it)
            with pytest.raises(_executor.ExecutorWorkerLost, match=r"a process of ProcessPoolExecutor died while "
                                                                   r"loading dataset indices \[4, 5, 6, 7\]"):
                next(it)


def test_a_dask_worker_killed_mid_epoch_is_replaced_and_the_epoch_completes(dask):
    pids = list(dask.run(getpid).values())
    seen = []
    with aioload.DataLoader(Augmented(48, delay=0.05), batch_size=4, executor=dask.get_executor(),
                            seed=1) as loader:
        for _, indices in loader:
            if not seen:  # the first batch is here: the next batches' tasks are running
                os.kill(pids[0], signal.SIGKILL)
            seen += indices.tolist()
    assert seen == list(range(48))  # every sample exactly once, in order
    dask.wait_for_workers(2, timeout=60)  # the nanny restarts the one that was killed
    nothing_left(dask)


def test_a_stopped_scheduler_raises_within_timeout_naming_its_address():
    cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                                       dashboard_address=":0", silence_logs=logging.CRITICAL)
    client = distributed.Client(cluster)
    address = cluster.scheduler_address
    try:
        client.wait_for_workers(1, timeout=120)
        with aioload.DataLoader(Augmented(400, delay=0.02), batch_size=4, executor=client.get_executor(),
                                timeout=30) as loader:
            it = iter(loader)
            next(it)
            cluster.close()  # the scheduler and its worker stop
            with pytest.raises((aioload.DataLoaderTimeoutError, _executor.ExecutorWorkerLost)) as info:
                for _ in it:
                    pass
        assert address in str(info.value)
    finally:
        client.close()
        cluster.close()


@pytest.mark.parametrize("kind", ["processes", "dask"])
def test_breaking_out_cancels_the_outstanding_tasks(kind, request):
    executor = request.getfixturevalue(kind)
    ex = executor.get_executor() if kind == "dask" else executor
    with aioload.DataLoader(Augmented(200, delay=0.01), batch_size=4, executor=ex, num_workers=2,
                            queue_depth=8) as loader:
        for _ in loader:
            break
        stage = loader._res.executor
        assert not stage.outstanding
    if kind == "dask":
        nothing_left(executor)
    else:  # the pool's queue is empty: a new task starts at once
        assert executor.submit(getpid).result(timeout=30) > 0


# -- where reads happen ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def image_server(image_root):
    with Server(image_root) as server:
        yield server


def _urls(server, image_root) -> list[str]:
    return [server.url(os.path.relpath(p, image_root)) for p, _ in aioload.ImageFolder(image_root).samples]


def test_urls_are_read_by_the_executor_not_the_trainer(dask, image_server, image_root):
    from torchvision.transforms import v2

    urls = _urls(image_server, image_root)[:16]
    before = sum(image_server.requests.values())
    ds = aioload.ImageFiles(urls, labels=list(range(16)), transform=v2.CenterCrop(32))
    expected = run(ds, epochs=1, num_workers=1)[0]
    after_reference = sum(image_server.requests.values())
    with aioload.DataLoader(ds, batch_size=8, executor=dask.get_executor()) as loader:
        got = list(loader)
        stats = loader.stats()
    assert_same(got, expected)
    assert stats.reads == 16 and stats.bytes_read > 0  # counted as the workers' reads are, though read there
    assert sum(image_server.requests.values()) - after_reference == 16 == after_reference - before


def test_a_dataset_can_read_on_the_trainer_instead(processes, image_server, image_root):
    from torchvision.transforms import v2

    urls = _urls(image_server, image_root)[:8]
    ds = aioload.ImageFiles(urls, transform=v2.CenterCrop(32))
    with aioload.DataLoader(ds, batch_size=4, executor=processes, read_on_executor=False) as loader:
        got = list(loader)
        stats = loader.stats()
    assert [b.shape for b in got] == [(4, 3, 32, 32)] * 2
    assert stats.reads == 8 and stats.bytes_read > 0


# -- arguments ------------------------------------------------------------------------------------
def test_arguments_are_checked():
    with pytest.raises(TypeError, match=r"^executor must be a concurrent.futures.Executor"):
        aioload.DataLoader(Augmented(4), executor=object())
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with pytest.raises(ValueError, match=r"^executor= loads batches of a map-style dataset"):
            aioload.DataLoader(Stream(), executor=pool)


# -- statistics -----------------------------------------------------------------------------------
def test_stats_say_what_the_executor_did(dask):
    with aioload.DataLoader(Augmented(40), batch_size=8, executor=dask.get_executor()) as loader:
        for _ in range(2):
            list(loader)
        s = loader.stats()
    assert s.executor == f"the Dask cluster at {dask.scheduler.address}"
    assert s.executor_tasks == 10 and s.batches == 10 and s.decoded == 80
    # each batch brings back 8 x 4 float32 values and 8 int64 labels
    assert s.executor_bytes == 10 * (8 * 4 * 4 + 8 * 8) == 1920
    assert 0 < s.task_p50_ms <= s.task_p99_ms
    assert s.num_workers == 2  # tasks in flight: the cluster's two worker threads
    # the consumer only waits: data-bound, and the advice is about the executor
    assert s.verdict.startswith("data-bound") and "executor" in s.verdict and "async read" not in s.verdict
    text = str(s)
    assert f"the Dask cluster at {dask.scheduler.address}: 10 tasks" in text and "192 B back per batch" in text
