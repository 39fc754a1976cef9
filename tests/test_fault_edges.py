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
import re
import signal
import textwrap
import threading
import time

import pytest
import torch

import aioload
from tests.faulty import FaultyMapDataset, write_samples
from tests.resources import children, gone, wait_until

pytestmark = pytest.mark.timeout(120)

N = 40
HANG_GUARD = 60.0
"""Seconds a child gets to exit; it needs a few (spawn imports torch twice on a busy machine)."""


# -- a loader inside a multiprocessing child --------------------------------------------------

_KEPT: list = []
"""What a child keeps alive until it exits (an iterator in the middle of its epoch)."""


def _worker_pids(loader=None) -> list[int]:
    """``loader``'s workers (a worker that its template has not forked yet included), else this
    process's: multiprocessing's children of that name, and those that a template forked (spawn
    and forkserver; a spawned child's loaders use spawn too)."""
    if loader is not None and loader._res.pool is not None:
        return [proc.pid for proc in loader._res.pool.procs]
    found = []
    for proc in multiprocessing.active_children():
        if proc.name.startswith("aioload-worker"):
            found.append(proc.pid)
        elif proc.name == "aioload-template":
            found += sorted(children(proc.pid))
    return found


def _stall_then_raise(root, conn) -> None:
    """Iterate a loader whose worker stalls on the first sample: ``timeout=1`` raises, and the
    exception ends the child."""
    loader = aioload.DataLoader(FaultyMapDataset(root, N, {0: "decode-hang"}), batch_size=4,
                                num_workers=2, timeout=1)
    try:
        for _ in loader:
            pass
    finally:
        conn.send(_worker_pids(loader))


def _return_mid_epoch(root, conn) -> None:
    """Take one batch, keep the iterator (and so the epoch) alive, and return."""
    loader = aioload.DataLoader(FaultyMapDataset(root, N), batch_size=4, num_workers=2, timeout=60)
    _KEPT.append(iter(loader))
    next(_KEPT[-1])
    conn.send(_worker_pids(loader))


@contextlib.contextmanager
def _loader_child(method: str, target, *args):
    """A multiprocessing child (started by ``method``) running ``target(*args, conn)``, which
    sends its loader's worker pids on ``conn``: yields the child and those pids. The child is
    killed in the end, and its workers with it, whatever the test found."""
    ctx = multiprocessing.get_context(method)
    ours, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=target, args=(*args, theirs))
    workers: list[int] = []
    try:
        child.start()
        theirs.close()
        assert ours.poll(HANG_GUARD), "the child never reported its workers"
        workers += ours.recv()
        yield child, workers
    finally:
        if child.is_alive():
            child.kill()
        if child.pid is not None:
            child.join(10)
        for pid in workers:  # what a failed test left running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        ours.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("target, exitcode", [(_stall_then_raise, 1), (_return_mid_epoch, 0)],
                         ids=["raises", "returns-mid-epoch"])
def test_a_multiprocessing_child_that_used_a_loader_exits(tmp_path, method, target, exitcode):
    """A multiprocessing child runs no ``atexit`` hook and joins its children before exiting:
    the loader's workers must be stopped by then, or the child never exits."""
    write_samples(tmp_path, N)
    with _loader_child(method, target, str(tmp_path)) as (child, workers):
        assert len(workers) == 2
        child.join(HANG_GUARD)
        assert not child.is_alive(), f"the child was still alive {HANG_GUARD} s after its loader finished"
        assert child.exitcode == exitcode
        wait_until(lambda: all(gone(pid) for pid in workers), 10, "the child's workers to exit")


def _hang_in_decode(root, flag, method, conn) -> None:
    """Iterate a loader (workers started by ``method``) whose worker hangs decoding sample 0,
    from a thread; report the workers once the hang began (its flag file is gone), then wait."""
    loader = aioload.DataLoader(FaultyMapDataset(root, N, {0: "decode-hang"}, once=flag), batch_size=4,
                                num_workers=2, multiprocessing_context=method)
    threading.Thread(target=lambda: next(iter(loader)), daemon=True).start()
    deadline = time.monotonic() + HANG_GUARD
    while os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)
    conn.send(_worker_pids(loader))
    time.sleep(3600)


@pytest.mark.timeout(3 * HANG_GUARD)
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_a_worker_stuck_in_decode_ends_with_a_killed_training_process(tmp_path, method):
    # SIGKILL leaves no time to stop the workers; one that waits on its socket sees it close, but
    # one blocked in a decode that never returns must notice its training process is gone too.
    write_samples(tmp_path, N)
    flag = tmp_path / "hang-once"
    flag.touch()
    # a spawned child: a forked one would inherit this process's forkserver state (and any lock
    # another thread held at the fork), and its forkserver loader could hang before it starts
    with _loader_child("spawn", _hang_in_decode, str(tmp_path), str(flag), method) as (child, workers):
        assert len(workers) == 2 and not flag.exists(), "no worker began the decode that hangs"
        os.kill(child.pid, signal.SIGKILL)
        child.join(HANG_GUARD)
        wait_until(lambda: all(gone(pid) for pid in workers), 10, "the workers of a killed process to exit")


# -- aioload's errors across process boundaries ------------------------------------------------

def _exception_classes() -> list[type[BaseException]]:
    """Every exception class an aioload module defines under a public name (the exported
    ones, their subclasses, and those raised from behind the public API, such as
    ``ResumeError``)."""
    import importlib
    import pkgutil

    found = {}
    for info in pkgutil.walk_packages(aioload.__path__, "aioload."):
        if info.name == "aioload.__main__":
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (isinstance(value, type) and issubclass(value, BaseException) and not name.startswith("_")
                    and value.__module__.startswith("aioload")):
                found[value.__qualname__] = value
    return [found[name] for name in sorted(found)]


EXCEPTIONS = _exception_classes()
EXPORTED = [getattr(aioload, name) for name in aioload.__all__
            if isinstance(getattr(aioload, name), type) and issubclass(getattr(aioload, name), BaseException)]


def test_the_exception_list_holds_every_exported_one():
    assert len(EXPORTED) >= 5  # the four of _errors and RemoteReadError
    assert set(EXPORTED) <= set(EXCEPTIONS)
    assert {"ResumeError", "RemoteNotFoundError"} <= {cls.__name__ for cls in EXCEPTIONS}


def _full(cls: type[BaseException]) -> BaseException:
    """An instance with every attribute its class has beyond the message."""
    message = f"{cls.__name__} happened on purpose"
    if cls is aioload.WorkerCrashedError:
        return cls(message, worker_id=1, pid=4242, exitcode=-11, indices=[3, 4])
    if cls is aioload.DataLoaderTimeoutError:
        return cls(message, stuck=[(7, "read")])
    if issubclass(cls, aioload.RemoteReadError):
        return cls(message, "http://127.0.0.1:1/x.jpg", 5, 503)
    return cls(message)


@pytest.mark.parametrize("cls", EXCEPTIONS, ids=lambda cls: cls.__name__)
def test_every_aioload_exception_is_made_from_a_message_and_survives_pickling(cls):
    import pickle

    bare = cls("just a message")
    assert str(bare) == "just a message"
    for exc in (bare, _full(cls)):
        exc.add_note("while doing something")
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is cls
        assert str(back) == str(exc)
        assert vars(back) == vars(exc)  # the attributes and the notes


@pytest.mark.parametrize("cls", EXCEPTIONS, ids=lambda cls: cls.__name__)
def test_every_aioload_exception_survives_torchs_exception_wrapper(cls):
    """``ExceptionWrapper.reraise`` (frameworks and torch's own test helpers carry errors
    between processes with it) rebuilds the error as ``type(message)``; where that fails it
    raises a ``RuntimeError`` instead, losing the type."""
    import pickle
    import sys

    from torch._utils import ExceptionWrapper

    original = _full(cls)
    try:
        raise original
    except BaseException:
        wrapper = pickle.loads(pickle.dumps(ExceptionWrapper(sys.exc_info(), where="in a child process")))
    with pytest.raises(cls) as info:
        wrapper.reraise()
    assert type(info.value) is cls
    assert str(info.value).startswith(f"Caught {cls.__name__} in a child process.\nOriginal Traceback")
    assert str(original) in str(info.value)


TORCH_CRASH = r"DataLoader worker \(pid(s)? ([\w\s,]+)\) is killed by signal: "
"""What torch's own tests match in a crashed worker's error (test_dataloader.py)."""


def _crash_in_a_child(root, conn) -> None:
    """What torch's test helper does: run the loader, send whatever it raised to the parent,
    whole and wrapped in an ``ExceptionWrapper``."""
    import sys

    from torch._utils import ExceptionWrapper

    from tests.faulty import FaultyDataset

    with aioload.DataLoader(FaultyDataset(root, N, {13: "segv"}), batch_size=4, num_workers=2,
                            timeout=30) as loader:
        try:
            list(loader)
        except Exception as exc:  # noqa: BLE001 - sent to the parent, which checks it
            conn.send((exc, ExceptionWrapper(sys.exc_info(), where="in a training process")))
        else:
            conn.send(None)


def test_a_crashed_workers_error_reaches_another_process_whole_and_in_torchs_words(tmp_path):
    from tests.faulty import write_samples as write

    write(tmp_path, N)
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_crash_in_a_child, args=(str(tmp_path), theirs))
    try:
        child.start()
        theirs.close()
        assert ours.poll(HANG_GUARD), "the child sent nothing"
        sent = ours.recv()
        child.join(HANG_GUARD)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
        if child.pid is not None:
            child.join(10)
        ours.close()
    assert sent is not None, "the loader did not raise"
    exc, wrapper = sent
    assert type(exc) is aioload.WorkerCrashedError
    assert (exc.exitcode, exc.worker_id in (0, 1), 13 in exc.indices) == (-signal.SIGSEGV, True, True)
    assert str(exc).startswith(f"DataLoader worker (pid {exc.pid}) is killed by signal: Segmentation fault. ")
    assert re.search(TORCH_CRASH, str(exc))
    with pytest.raises(aioload.WorkerCrashedError, match=TORCH_CRASH) as info:
        wrapper.reraise()
    assert str(exc) in str(info.value)


# -- what a crashed worker leaves on stderr ------------------------------------------------------

CRASHING_CHILD = textwrap.dedent("""\
    import ctypes, sys
    sys.path.insert(0, {root_dir!r})
    import torch, aioload
    from tests.faulty import FaultyMapDataset

    class NullPointer(torch.utils.data.Dataset):  # a native crash nobody planned
        def __len__(self):
            return 8

        def __getitem__(self, index):
            return ctypes.string_at(0)

    def crash(dataset):
        with aioload.DataLoader(dataset, batch_size=4, num_workers=1, timeout=30) as loader:
            try:
                list(loader)
            except aioload.WorkerCrashedError as exc:
                print(exc.exitcode, file=sys.stderr, flush=True)

    crash(FaultyMapDataset({data!r}, 8, {{2: "ctypes-segv"}}))
    print("--- unplanned ---", file=sys.stderr, flush=True)
    crash(NullPointer())
""")


def test_a_deliberate_crash_prints_no_dump_and_a_real_one_still_does(tmp_path):
    """With ``faulthandler`` on (``python -X faulthandler``, as pytest turns it on), a worker
    that segfaults writes its stacks to the stderr it inherited. The fault-injection datasets
    switch that off for their own crashes, so that a passing test run stays clean; aioload
    must not hide the dump of a real crash from the user."""
    import subprocess
    import sys

    write_samples(tmp_path / "data", 8)
    script = tmp_path / "child.py"
    script.write_text(CRASHING_CHILD.format(root_dir=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                            data=str(tmp_path / "data")))
    done = subprocess.run([sys.executable, "-X", "faulthandler", str(script)], capture_output=True, text=True,
                          timeout=HANG_GUARD)
    assert done.returncode == 0, done.stderr
    planned, unplanned = done.stderr.split("--- unplanned ---\n")
    assert planned == f"{-signal.SIGSEGV}\n"
    assert "Fatal Python error: Segmentation fault" in unplanned
    assert unplanned.rstrip().endswith(f"{-signal.SIGSEGV}")


# -- indices and read results a worker cannot take -----------------------------------------------

HUGE = 2**64
"""A sampler index that no int64 holds."""


class _Listed(torch.utils.data.Dataset):
    """Samples from a Python list: an index it cannot hold raises list's own ``IndexError``."""

    def __init__(self, n: int = 16):
        self.values = list(range(n))

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index):
        return torch.tensor([self.values[index]])


class _ListedSplit(aioload.Dataset):
    """The same through the split protocol: read on the loader's loop, decode in a worker.
    ``unpicklable`` indices read as a tuple holding a lock."""

    def __init__(self, n: int = 16, unpicklable=()):
        self.values = list(range(n))
        self.unpicklable = set(unpicklable)

    def __len__(self) -> int:
        return len(self.values)

    async def read(self, index):
        return (index, threading.Lock()) if index in self.unpicklable else (index, None)

    def decode(self, raw):
        return torch.tensor([self.values[raw[0]]])


SAMPLER = [*range(8), HUGE, *range(8, 16)]


def _values(loader) -> list[int]:
    return [int(v) for batch in loader for v in batch]


@pytest.mark.parametrize("dataset", [_Listed, _ListedSplit], ids=["getitem", "read-decode"])
def test_an_index_no_int64_holds_is_the_datasets_error_and_the_pool_goes_on(dataset):
    """torch hands such an index to the dataset as it is; so does aioload, whose workers
    note the index they are on in an int64 and crashed on this one."""
    with aioload.DataLoader(dataset(), batch_size=4, sampler=SAMPLER, num_workers=2, timeout=30) as loader:
        for _ in range(2):
            batches = iter(loader)
            assert _values([next(batches), next(batches)]) == list(range(8))
            pids = _worker_pids()
            with pytest.raises(IndexError) as info:
                next(batches)
            assert str(info.value) == "cannot fit 'int' into an index-sized integer"
            stage = "__getitem__" if dataset is _Listed else "decode"
            assert info.value.__notes__[0].startswith(f"while running {stage} for dataset index {HUGE}")
            del info
            assert _values(batches) == list(range(11, 16))  # the epoch goes on after a failed batch
            assert _worker_pids() == pids
        assert loader.stats().worker_restarts == 0


@pytest.mark.parametrize("dataset", [_Listed, _ListedSplit], ids=["getitem", "read-decode"])
def test_an_index_no_int64_holds_is_skipped_with_on_error_skip(dataset, caplog):
    import logging

    with aioload.DataLoader(dataset(), batch_size=4, sampler=SAMPLER, num_workers=2, timeout=30,
                            on_error="skip") as loader:
        pids = None
        with caplog.at_level(logging.WARNING, logger="aioload"):
            for _ in range(2):
                assert sorted(_values(loader)) == list(range(16))
                pids = pids or _worker_pids()
                assert _worker_pids() == pids
        stats = loader.stats()
    assert stats.skipped == (HUGE, HUGE) and stats.worker_restarts == 0
    assert [m.split(" while ")[0] for m in caplog.messages] == [
        f"on_error='skip': skipped dataset index {HUGE}: IndexError: cannot fit 'int' into an index-sized integer"] * 2


UNPICKLABLE = (r"dataset\.read\(5\) returned a tuple holding a _thread\.lock, which cannot be pickled to reach "
               r"a worker process \(TypeError: cannot pickle '_thread\.lock' object\)\. read\(\) runs in the "
               r"loader's process and decode\(\) in a worker: return bytes, numbers, strings, arrays or "
               r"tensors from read\(\), and open files, locks or clients in decode\(\)")


def test_a_read_result_that_cannot_be_pickled_names_the_index_and_the_type():
    with aioload.DataLoader(_ListedSplit(unpicklable={5}), batch_size=4, num_workers=2, timeout=30,
                            read_in_workers=False) as loader:
        batches = iter(loader)
        assert next(batches).tolist() == [[0], [1], [2], [3]]
        with pytest.raises(TypeError) as info:
            next(batches)
        assert re.fullmatch(UNPICKLABLE, str(info.value))
        assert info.value.__notes__ == ["while reading dataset index 5"]
        assert isinstance(info.value.__cause__, TypeError)
        pids = _worker_pids()
        # the epoch goes on (as after any failed batch), and the next one runs on the same pool
        assert _values(batches) == list(range(8, 16))
        with pytest.raises(TypeError) as info:
            _values(loader)
        assert re.fullmatch(UNPICKLABLE, str(info.value))
        del info
        assert _worker_pids() == pids and loader.stats().worker_restarts == 0


def test_a_read_result_that_cannot_be_pickled_is_skipped_and_counted(caplog):
    import logging

    with aioload.DataLoader(_ListedSplit(unpicklable={5, 9}), batch_size=4, num_workers=2, timeout=30, read_in_workers=False,
                            on_error="skip") as loader:
        pids = None
        with caplog.at_level(logging.WARNING, logger="aioload"):
            for _ in range(2):
                assert sorted(_values(loader)) == sorted(set(range(16)) - {5, 9})
                pids = pids or _worker_pids()
                assert _worker_pids() == pids
        stats = loader.stats()
    assert stats.skipped_total == 4 and sorted(stats.skipped) == [5, 5, 9, 9]
    assert stats.worker_restarts == 0
    assert sum("skipped dataset index 5: TypeError: dataset.read(5) returned a tuple holding a _thread.lock"
               in message for message in caplog.messages) == 2


def test_a_sampler_index_that_cannot_be_pickled_fails_its_batch_and_the_pool_goes_on():
    """No worker can be sent such a task: its batch fails at once, naming the indices, and
    the worker it was meant for stays free (no drain to wait for, no new pool)."""
    odd = threading.Lock()
    sampler = [*range(4), odd, *range(4, 8)]
    with aioload.DataLoader(_Listed(), batch_size=4, sampler=sampler, num_workers=2, timeout=30) as loader:
        batches = iter(loader)
        assert next(batches).tolist() == [[0], [1], [2], [3]]
        pids = _worker_pids()
        with pytest.raises(TypeError, match=r"^the task for dataset indices \[<unlocked _thread\.lock object") as info:
            next(batches)
        assert "cannot be pickled to reach a worker process (TypeError: cannot pickle '_thread.lock' object)" \
            in str(info.value)
        del info, batches
        assert sorted(_values(aioload.DataLoader(_Listed(), batch_size=4, num_workers=0))) == list(range(16))
        with pytest.raises(TypeError, match="cannot be pickled to reach a worker process"):
            _values(loader)
        assert _worker_pids() == pids and loader.stats().worker_restarts == 0


def test_a_readers_buffer_grown_for_a_large_message_is_given_back():
    import socket

    from aioload._workers import wire as _wire
    ours, theirs = socket.socketpair()
    with ours, theirs:
        reader = _wire.Reader(theirs)
        initial = reader.capacity
        large = b"x" * (16 * initial)

        def send_and_receive(message):
            sender = threading.Thread(target=_wire.send_blocking, args=(ours, message))
            sender.start()
            assert reader.recv_blocking() == message
            sender.join()

        send_and_receive(large)
        assert reader.capacity >= len(large)
        # a stream of large messages keeps the buffer ...
        for _ in range(2 * _wire.SHRINK_AFTER):
            send_and_receive(large)
        assert reader.capacity >= len(large)
        # ... and once only small ones come, it goes back to its first size
        for i in range(_wire.SHRINK_AFTER):
            send_and_receive(("task", i))
        assert reader.capacity == initial
        send_and_receive(large)  # and it grows again when needed
        assert reader.capacity >= len(large)
