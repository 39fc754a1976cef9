"""executor= keeps the loader's promises as the built-in workers do: seeded batches on threaded
Dask workers, un-batched items, read_timeout, collate_fn and worker_init_fn, the dataset sent
once per process, batches that cannot come back, and a closed loader's dataset let go."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pickle

import pytest
import torch

import aioload
from aioload._engine import executor as _executor
from tests.executor_data import (Augmented, Big, InitLog, LocalObjects, SlowRead, TwoDraws, WorkerInfoSeen,
                                 collate_with_lock, datasets_alive, failing_init, keep_objects, tagged_collate,
                                 tokens_held)

distributed = pytest.importorskip("distributed")  # in the test extra; real clusters below


def run(dataset, epochs: int = 1, **kwargs) -> list:
    kwargs.setdefault("batch_size", 4)
    with aioload.DataLoader(dataset, **kwargs) as loader:
        return [list(loader) for _ in range(epochs)]


def cluster(workers: int, threads: int):
    return distributed.LocalCluster(n_workers=workers, threads_per_worker=threads, processes=True, host="127.0.0.1",
                                    dashboard_address=":0", silence_logs=logging.CRITICAL)


@pytest.fixture(scope="module")
def threaded_dask():
    """One worker process running two tasks at once (two threads): what LocalCluster() and
    `dask worker` give on a machine with several cores."""
    with cluster(1, 2) as c, distributed.Client(c) as client:
        yield client


@pytest.fixture(scope="module")
def dask():
    with cluster(2, 1) as c, distributed.Client(c) as client:
        yield client


def executor_of(kind: str, request):
    found = request.getfixturevalue(kind)
    return found.get_executor() if kind.endswith("dask") else found


# -- 1. seed= on a worker with several threads -----------------------------------------------------
@pytest.mark.parametrize("kind", ["threaded_dask", "processes"])
def test_seeded_batches_on_a_threaded_dask_worker_equal_the_built_in_pools(kind, request):
    if kind == "threaded_dask":
        assert list(request.getfixturevalue(kind).nthreads().values()) == [2]
    expected = run(TwoDraws(16), epochs=2, shuffle=True, seed=3, num_workers=2)
    got = run(TwoDraws(16), epochs=2, shuffle=True, seed=3, executor=executor_of(kind, request), num_workers=4)
    for epoch_got, epoch_expected in zip(got, expected):
        assert len(epoch_got) == len(epoch_expected) == 4
        for (x, i), (y, j) in zip(epoch_got, epoch_expected):
            assert torch.equal(i, j)
            assert torch.equal(x, y), f"samples {i.tolist()}: the draws differ from the built-in pool's"


# -- 2. batch_size=None ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["processes", "threads", "dask"])
def test_batch_size_none_gives_torchs_unbatched_items(kind, request):
    ds = Augmented(6)
    expected = list(torch.utils.data.DataLoader(ds, batch_size=None))
    (got,) = run(ds, batch_size=None, executor=executor_of(kind, request))
    assert len(got) == 6
    for (x, i), (y, j) in zip(got, expected):
        assert isinstance(i, int) and i == j  # torch's default_convert leaves a Python int as it is
        assert x.shape == y.shape == (4,) and torch.equal(x.floor(), y.floor())


# -- 3. read_timeout where the executor reads ------------------------------------------------------
@pytest.mark.parametrize("kind", ["processes", "threads", "dask"])
def test_read_timeout_fails_a_slow_read_on_the_executor(kind, request):
    with aioload.DataLoader(SlowRead(12, slow={5}), batch_size=4, executor=executor_of(kind, request),
                            read_timeout=0.5) as loader:
        it = iter(loader)
        assert next(it).tolist() == [[0], [1], [2], [3]]
        with pytest.raises(aioload.DataLoaderTimeoutError,
                           match=r"^dataset.read\(5\) did not return within read_timeout=0.5 seconds") as info:
            next(it)
        assert next(it).tolist() == [[8], [9], [10], [11]]  # the epoch goes on, as with the built-in workers
    where = _executor.where_is(executor_of(kind, request))
    assert info.value.__notes__[0] == f"while reading dataset index 5 (mem://slow/5) on {where}"


@pytest.mark.parametrize("kind", ["processes", "threads", "dask"])
def test_on_error_skip_skips_a_slow_read_on_the_executor(kind, request):
    with aioload.DataLoader(SlowRead(12, slow={2, 9}), batch_size=4, executor=executor_of(kind, request),
                            read_timeout=0.5, on_error="skip") as loader:
        seen = [i for batch in loader for i in batch.flatten().tolist()]
        stats = loader.stats()
    assert seen == [i for i in range(12) if i not in (2, 9)]
    assert sorted(stats.skipped) == [2, 9]
    assert stats.reads == 12  # the executor's reads, counted as the workers' are


# -- 4. collate_fn set after construction, worker_init_fn ----------------------------------------
@pytest.mark.parametrize("kind", ["processes", "threads", "dask"])
def test_a_collate_fn_set_after_construction_is_used(kind, request):
    with aioload.DataLoader(Augmented(8), batch_size=4, executor=executor_of(kind, request)) as loader:
        assert [type(b) for b in loader] == [list, list]  # default_collate of (tensor, int) samples
        loader.collate_fn = tagged_collate
        batches = list(loader)
    assert [b[1] for b in batches] == ["tagged", "tagged"] and batches[0][0].shape == (4, 4)


@pytest.mark.parametrize("kind", ["processes", "dask"])
def test_worker_init_fn_runs_once_per_process_and_tasks_see_their_worker_info(kind, request, tmp_path):
    log = tmp_path / "init"
    executor = executor_of(kind, request)
    with aioload.DataLoader(WorkerInfoSeen(24), batch_size=2, executor=executor, num_workers=4,
                            worker_init_fn=InitLog(str(log))) as loader:
        rows = torch.cat([b for _ in range(2) for b in loader]).tolist()
    lines = [line.split() for line in log.read_text().splitlines()]
    pids = [int(pid) for pid, *_ in lines]
    assert len(pids) == len(set(pids)) and set(pids) <= {row[3] for row in rows} | set(pids)
    ids = {int(pid): int(wid) for pid, wid, *_ in lines}
    for pid, wid, info_id, workers, seed in lines:
        assert wid == info_id and int(workers) == 2 and int(seed) >= int(wid)  # torch's WorkerInfo, filled in
    assert sorted(ids.values()) == list(range(len(ids)))  # ids 0, 1, ... one per process
    for index, wid, workers, pid in rows:
        assert pid in ids and wid == ids[pid] and workers == 2, (index, wid, pid)  # get_worker_info() in decode


def test_threads_refuse_worker_init_fn(threads):
    with pytest.raises(ValueError, match=r"^worker_init_fn sets up a worker process, and a ThreadPoolExecutor runs "
                                         r"its tasks in the training process itself"):
        aioload.DataLoader(Augmented(8), executor=threads, worker_init_fn=failing_init)


def test_a_failing_worker_init_fn_fails_the_epoch_naming_it(processes):
    with aioload.DataLoader(Augmented(8), batch_size=4, executor=processes, worker_init_fn=failing_init,
                            on_error="skip") as loader:
        with pytest.raises(ConnectionError, match=r"^worker_init_fn could not connect in worker \d") as info:
            list(loader)
    assert info.value.__notes__[0] == "raised by worker_init_fn in a process of ProcessPoolExecutor"


# -- 5. the dataset once per process ---------------------------------------------------------------
class _Sends:
    """Counts the pickled datasets an executor's submit() carries, and the plugins registered."""

    def __init__(self, executor, client=None):
        self.blobs: list[int] = []
        submit = executor.submit

        def counting(fn, *args, **kwargs):
            if kwargs.get("blob") is not None:
                self.blobs.append(len(kwargs["blob"]))
            return submit(fn, *args, **kwargs)

        executor.submit = counting
        if client is not None:
            register = client.register_plugin

            def registering(plugin, *args, **kwargs):
                self.blobs.append(len(pickle.dumps(plugin)))
                return register(plugin, *args, **kwargs)

            client.register_plugin = registering


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_process_pool_gets_the_dataset_once_per_process_not_per_task(start, tmp_path):
    import multiprocessing

    log = tmp_path / "unpickled"
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context(start)) as pool:
        sends = _Sends(pool)
        with aioload.DataLoader(Big(64, mib=4, log=str(log)), batch_size=2, executor=pool, num_workers=16) as loader:
            assert sum(len(b[1]) for b in loader) == 64
            pids = set(pool._processes)
    unpickled = log.read_text().split()
    assert len(unpickled) == len(set(unpickled)) and set(map(int, unpickled)) <= pids  # once in each process
    # 16 tasks in flight: none carried a copy (each process took it from shared memory)
    assert len(sends.blobs) <= 2, f"tasks carried the dataset {len(sends.blobs)} times to 2 processes"


def test_a_dask_cluster_is_sent_the_dataset_once_without_a_large_graph(tmp_path):
    import warnings

    with cluster(2, 1) as c, distributed.Client(c) as client:
        executor = client.get_executor()
        sends = _Sends(executor, client)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # dask's "Sending large graph" is a UserWarning
            with aioload.DataLoader(Big(64, mib=4), batch_size=2, executor=executor, num_workers=16) as loader:
                assert sum(len(b[1]) for b in loader) == 64
                held = client.run(_executor.known_tokens)
                token = loader._res.executor.token
    assert len(sends.blobs) == 1 and sends.blobs[0] > 4 << 20  # one plugin, which each worker gets once
    assert all(token in tokens for tokens in held.values()) and len(held) == 2


# -- 6. a batch that cannot come back --------------------------------------------------------------
def test_a_batch_that_cannot_be_pickled_back_names_its_indices_and_the_executor(processes):
    with aioload.DataLoader(LocalObjects(12), batch_size=4, executor=processes, collate_fn=keep_objects) as loader:
        with pytest.raises(TypeError, match=r"^the batch of dataset indices \[0, 1, 2, 3\] cannot be pickled to "
                                            r"travel back from ProcessPoolExecutor to the training process "
                                            r"\(AttributeError: Can't (pickle|get) local object"):
            next(iter(loader))


@pytest.mark.parametrize("kind", ["processes", "dask"])
def test_on_error_skip_skips_a_batch_that_cannot_come_back(kind, request):
    with aioload.DataLoader(Augmented(12), batch_size=4, executor=executor_of(kind, request),
                            collate_fn=collate_with_lock, on_error="skip") as loader:
        batches = list(loader)
        stats = loader.stats()
    assert batches == [] and sorted(stats.skipped) == list(range(12))


# -- 13. a closed loader's dataset is let go -------------------------------------------------------
def every_process(pool, fn, *args) -> dict:
    """``fn(*args)``'s answer in each process of ``pool`` (each task holds its process a moment)."""
    answers: dict = {}
    while set(pool._processes) - set(answers):
        for future in [pool.submit(fn, *args) for _ in set(pool._processes) - set(answers)]:
            pid, answer = future.result(timeout=60)
            answers[pid] = answer
    return answers


@pytest.mark.parametrize("trial", range(8))
def test_closing_the_loader_drops_its_dataset_in_every_process_of_a_pool(trial):
    with concurrent.futures.ProcessPoolExecutor(4) as pool:
        with aioload.DataLoader(Augmented(64), batch_size=2, executor=pool, num_workers=8) as loader:
            list(loader)
            token = loader._res.executor.token
            assert any(token in tokens for tokens in every_process(pool, tokens_held, 0.05).values())
        left = {pid: tokens for pid, tokens in every_process(pool, tokens_held, 0.05).items()
                if token in tokens}
    assert left == {}, f"processes {sorted(left)} kept the closed loader's dataset"


def pool_started_before_any_dataset(context: str) -> concurrent.futures.ProcessPoolExecutor:
    """A two-process pool whose processes hold nothing of the training process's datasets: a
    forked process keeps a copy of whatever its parent held when it started (nothing can free
    it there), so with ``fork`` they start now, before the test makes any."""
    import multiprocessing

    pool = concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context(context))
    if context == "fork":
        pool.submit(os.getpid).result()  # a fork pool starts all its processes at its first task
    return pool


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_no_process_of_a_pool_keeps_the_dataset_of_a_closed_loader(context):
    # issue 32 item 16: four loaders of a 20 MiB dataset, each closed after an epoch. The last
    # task's get_worker_info() kept its loader's dataset in each process (0 of 4 trials passed).
    with pool_started_before_any_dataset(context) as pool:
        for _ in range(4):
            with aioload.DataLoader(Big(16, 20), batch_size=4, executor=pool) as loader:
                assert len(list(loader)) == 4
                assert sum(every_process(pool, datasets_alive, 0.05).values()) >= 1  # it was there
            assert every_process(pool, datasets_alive, 0.05) == dict.fromkeys(pool._processes, 0)


def memfds(pid: int) -> list[str]:
    """The shared copies of a dataset that process ``pid`` holds a descriptor of."""
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:aioload-dataset"):
            held.append(target)
    return held


def test_no_process_keeps_the_shared_copy_of_a_closed_loaders_dataset():
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        with aioload.DataLoader(Augmented(32), batch_size=2, executor=pool, num_workers=8) as loader:
            list(loader)
            assert memfds(os.getpid())  # the trainer holds it while the loader lives
        assert memfds(os.getpid()) == []
        for pid in pool._processes:  # forked after it was made, each took it and let its copy go
            assert memfds(pid) == [], f"process {pid} still holds the dataset's shared memory"
