"""Fault injection: every failure ends in a clear error or a skipped sample, never a hang or a leak.

Samples are real files; faults are real (a deleted file, garbage bytes, a worker that kills
itself, a read that never returns); Ctrl-C and interpreter exit run in a child interpreter.
Each test has its own deadline, and loaders get ``timeout=`` where a hang would otherwise
wait for the global per-test timeout.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import multiprocessing
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import traceback
import warnings

import pytest
import torch

import aioload
from tests.faulty import (
    CollateFailsOn, FaultyBatchedDataset, FaultyDataset, FaultyMapDataset, HeldDataset, failing_init, hanging_init, sample_path,
    write_samples,
)
from tests.resources import Snapshot, aioload_threads, assert_released, gone, wait_until

pytestmark = pytest.mark.timeout(60)

N = 40
BATCH = 8
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module", autouse=True)
def warm(tmp_path_factory):
    """One loader before any snapshot: lazily opened, process-wide handles (multiprocessing's
    shared heap, uvloop's) are then part of every baseline."""
    root = tmp_path_factory.mktemp("warm")
    write_samples(root, 8)
    with aioload.DataLoader(FaultyDataset(root, 8), batch_size=4, num_workers=1) as loader:
        list(loader)


@pytest.fixture
def make(tmp_path):
    """``make(faults, dataset=FaultyDataset, once=False)``: the dataset over fresh files."""

    def build(faults=None, dataset=FaultyDataset, once=False, n=N):
        root = tmp_path / "data"
        write_samples(root, n, faults)
        flag = None
        if once:
            flag = str(tmp_path / "fire-once")
            open(flag, "w").close()
        return dataset(root, n, faults, once=flag)

    return build


@pytest.fixture
def before():
    return Snapshot.take()


def indices(batch) -> list[int]:
    return batch[:, 0].tolist()


def collect(loader) -> list[int]:
    return [i for batch in loader for i in indices(batch)]


def note_matching(exc: BaseException, pattern: str) -> str:
    notes = getattr(exc, "__notes__", [])
    for note in notes:
        if re.fullmatch(pattern, note, re.S):
            return note
    raise AssertionError(f"no note matches {pattern!r}: {notes}")


# -- an error in the dataset reaches the consumer, intact and located --------------------------

PATH = r"\(.*sample-00013\.bin\)"
SKIP = re.escape("; on_error='skip' leaves such samples out and goes on")  # the remedy, when not skipping

ERRORS = [
    pytest.param("missing", FaultyDataset, 2, FileNotFoundError, r"\[Errno 2\] No such file or directory: .*sample-00013\.bin'",
                 rf"while reading dataset index 13 {PATH} in an aioload worker", id="read-missing-file"),
    pytest.param("read-error", FaultyDataset, 2, OSError, r"injected read failure for index 13",
                 rf"while reading dataset index 13 {PATH} in an aioload worker", id="read-raises"),
    pytest.param("corrupt", FaultyDataset, 2, ValueError, r"sample 13 is corrupt: bad header or length 24",
                 rf"while running decode for dataset index 13 {PATH} in an aioload worker{SKIP}", id="decode-corrupt-file"),
    pytest.param("decode-error", FaultyDataset, 2, ValueError, r"decode failed on purpose for index 13",
                 rf"while running decode for dataset index 13 {PATH} in an aioload worker{SKIP}", id="decode-raises"),
    pytest.param("decode-error", FaultyMapDataset, 2, ValueError, r"decode failed on purpose for index 13",
                 rf"while running __getitem__ for dataset index 13 {PATH} in an aioload worker{SKIP}", id="getitem-raises"),
    pytest.param("missing", FaultyDataset, 0, FileNotFoundError, r"\[Errno 2\] No such file or directory: .*sample-00013\.bin'",
                 rf"while reading dataset index 13 {PATH}", id="read-missing-file-no-workers"),
    pytest.param("decode-error", FaultyDataset, 0, ValueError, r"decode failed on purpose for index 13",
                 rf"while running decode for dataset index 13 {PATH}{SKIP}", id="decode-raises-no-workers"),
    pytest.param("decode-error", FaultyMapDataset, 0, ValueError, r"decode failed on purpose for index 13",
                 rf"while running __getitem__ for dataset index 13 {PATH}{SKIP}", id="getitem-raises-no-workers"),
]


@pytest.mark.parametrize("fault, dataset, workers, kind, message, where", ERRORS)
def test_error_keeps_its_type_message_and_traceback_and_names_index_path_and_stage(
        make, before, fault, dataset, workers, kind, message, where):
    ds = make({13: fault}, dataset)
    with aioload.DataLoader(ds, batch_size=BATCH, num_workers=workers) as loader:
        it = iter(loader)
        assert indices(next(it)) == list(range(0, 8))
        with pytest.raises(kind) as info:
            next(it)
        assert type(info.value) is kind
        assert re.fullmatch(message, str(info.value))
        note_matching(info.value, where)
        text = "".join(traceback.format_exception(info.value))
        assert "faulty.py" in text  # the frame that raised, from the worker or the engine thread
        # torch's behaviour: the failed batch is reported, the epoch goes on
        assert indices(next(it)) == list(range(16, 24))
        assert [indices(b) for b in it] == [list(range(24, 32)), list(range(32, 40))]
    assert_released(before)


def test_worker_traceback_shows_the_line_that_raised(make):
    with aioload.DataLoader(make({3: "decode-error"}), batch_size=BATCH, num_workers=2) as loader:
        with pytest.raises(ValueError) as info:
            list(loader)
    note = note_matching(info.value, r"Original traceback:\n.*")
    assert 'raise ValueError(f"decode failed on purpose for index {index}")' in note
    assert re.search(r'File ".*faulty\.py", line \d+, in crash', note)


class Undescribed(FaultyDataset):
    describe = aioload.Dataset.describe  # knows no path: notes name the index alone


@pytest.mark.parametrize("fault, where", [
    ("read-error", "while reading dataset index 13 in an aioload worker"),
    ("decode-error", "while running decode for dataset index 13 in an aioload worker; on_error='skip' leaves such "
                     "samples out and goes on"),
])
def test_note_without_a_path_names_the_index(make, fault, where):
    with aioload.DataLoader(make({13: fault}, Undescribed), batch_size=BATCH, num_workers=2, timeout=20) as loader:
        with pytest.raises(Exception) as info:
            collect(loader)
    note_matching(info.value, re.escape(where))


def test_exception_that_cannot_be_unpickled_keeps_its_name_and_message(make):
    with aioload.DataLoader(make({5: "strict-error"}), batch_size=BATCH, num_workers=2) as loader:
        with pytest.raises(RuntimeError) as info:
            list(loader)
    assert str(info.value) == "StrictError: sample 5 rejected: strict on purpose"
    note_matching(info.value, rf"while running decode for dataset index 5 {PATH.replace('13', '05')} in an aioload worker{SKIP}")
    note_matching(info.value, r"Original traceback:\n.*faulty\.StrictError: sample 5 rejected: strict on purpose")


@pytest.mark.parametrize("workers", [0, 2])
def test_collate_fn_error_names_the_batch(make, before, workers):
    with aioload.DataLoader(make(), batch_size=BATCH, num_workers=workers, collate_fn=CollateFailsOn(13)) as loader:
        it = iter(loader)
        assert indices(next(it)) == list(range(8))
        with pytest.raises(KeyError) as info:
            next(it)
        assert info.value.args == ("collate refused a batch holding sample 13",)
        suffix = " in an aioload worker" if workers else ""
        note_matching(info.value, rf"while running collate_fn for the batch of dataset indices \[8, 9, 10, 11, 12, 13, 14, 15\]{suffix}")
        assert len(list(it)) == 3
    assert_released(before)


@pytest.mark.parametrize("start_method", ["fork", "forkserver"], indirect=True)
def test_worker_init_fn_error_reaches_the_consumer(make, start_method, before):
    loader = aioload.DataLoader(make(), batch_size=BATCH, num_workers=2, worker_init_fn=failing_init, timeout=20)
    with loader:
        with pytest.raises(ConnectionError) as info:
            list(loader)
        assert str(info.value) == "worker_init_fn failed in worker 1 on purpose"
        note_matching(info.value, r"raised by worker_init_fn in worker 1")
        note_matching(info.value, r"Original traceback:\n.*in failing_init\n.*")
    assert_released(before)


# -- a worker that dies ---------------------------------------------------------------------

CRASHES = [
    pytest.param("kill", FaultyDataset, -signal.SIGKILL, "is killed by signal: Killed", "was killed by SIGKILL",
                 id="sigkill"),
    pytest.param("segv", FaultyDataset, -signal.SIGSEGV, "is killed by signal: Segmentation fault",
                 "was killed by SIGSEGV", id="sigsegv"),
    pytest.param("ctypes-segv", FaultyDataset, -signal.SIGSEGV, "is killed by signal: Segmentation fault",
                 "was killed by SIGSEGV", id="null-pointer"),
    pytest.param("exit", FaultyDataset, 3, "exited unexpectedly with exit code 3", "exited with code 3", id="os-exit"),
    pytest.param("kill", FaultyMapDataset, -signal.SIGKILL, "is killed by signal: Killed", "was killed by SIGKILL",
                 id="sigkill-getitem"),
]


# every crash with fork, and two of them with the start methods whose workers a template forks
# (the interpreter's default: forkserver from Python 3.14 on Linux, spawn on macOS)
CRASHES_BY_START = [pytest.param("fork", *case.values, id=case.id) for case in CRASHES] + [
    pytest.param(method, *case.values, id=f"{case.id}-{method}")
    for method, case in (("forkserver", CRASHES[0]), ("spawn", CRASHES[3]))]


@pytest.mark.parametrize("start_method, fault, dataset, exitcode, torch_how, how", CRASHES_BY_START,
                         indirect=["start_method"])
def test_worker_crash_raises_worker_crashed_error_then_a_fresh_pool_serves(make, start_method, before, fault, dataset,
                                                                          exitcode, torch_how, how):
    ds = make({13: fault}, dataset, once=True)
    with aioload.DataLoader(ds, batch_size=BATCH, num_workers=2, timeout=20) as loader:
        with pytest.raises(aioload.WorkerCrashedError) as info:
            collect(loader)
        exc = info.value
        assert exc.exitcode == exitcode
        assert exc.worker_id in (0, 1)
        assert 13 in exc.indices
        assert isinstance(exc.pid, int) and gone(exc.pid)
        # torch's own words first (torch's DataLoader says "DataLoader worker (pid 123) is
        # killed by signal: Killed. "), then aioload's
        assert re.fullmatch(
            rf"DataLoader worker \(pid {exc.pid}\) {torch_how}\. aioload worker {exc.worker_id} {how} while "
            rf"working on dataset indices \[[\d, ]*\b13\b[\d, ]*\]\. If it ran out of memory, lower num_workers "
            r"or batch_size; if it crashed in native code, check those samples\.",
            str(exc),
        )
        assert loader.stats().worker_restarts == 0
        # the next epoch runs on a fresh pool (the fault fired once) and delivers everything
        assert sorted(collect(loader)) == list(range(N))
        assert loader.stats().worker_restarts == 1
    del info, exc  # its traceback holds collect()'s frame, and so the last batch it received
    assert_released(before)


def test_crashed_loader_can_be_closed_without_iterating_again(make, before):
    with aioload.DataLoader(make({2: "kill"}), batch_size=BATCH, num_workers=2, timeout=20) as loader:
        with pytest.raises(aioload.WorkerCrashedError):
            collect(loader)
    assert_released(before)


@pytest.mark.parametrize("start_method", ["fork", "spawn"], indirect=True)
def test_worker_killed_between_epochs_is_replaced(make, start_method, before, caplog):
    with aioload.DataLoader(make(), batch_size=BATCH, num_workers=2, timeout=20) as loader:
        assert sorted(collect(loader)) == list(range(N))
        workers = loader._res.pool.procs
        assert len(workers) == 2
        os.kill(workers[0].pid, signal.SIGKILL)
        # exited for good: a worker with threads (its reads' loop) shows as a zombie while its
        # other threads are still being torn down, before waitpid can collect it
        wait_until(lambda: workers[0].exitcode is not None, 10, "the killed worker to exit")
        with caplog.at_level(logging.WARNING, logger="aioload"):
            assert sorted(collect(loader)) == list(range(N))
        assert loader.stats().worker_restarts == 1
        assert "starting a fresh pool of 2 workers; the last one was lost: a worker process died" in caplog.messages
    assert_released(before)


# -- a read or decode that never returns --------------------------------------------------------

READ_ADVICE = r"Set read_timeout= to bound each read, or raise timeout= if batches are just slow\."
NO_READ_ADVICE = r"Raise timeout= if batches are just slow\."
SLEEPING = r'File ".*faulty\.py", line \d+ in crash\n  File ".*faulty\.py", line \d+ in '  # crash, then its caller
WAITING_FOR_READS = r'File ".*reads\.py", line \d+ in wait'  # the worker's decoding waits for its reads
HANGS = [
    pytest.param("decode-hang", FaultyDataset, {}, r"read or decode in worker [01] \(pid \d+\)", READ_ADVICE,
                 SLEEPING + "decode", id="decode"),
    pytest.param("decode-hang", FaultyMapDataset, {}, r"__getitem__ in worker [01] \(pid \d+\)", NO_READ_ADVICE,
                 SLEEPING + "__getitem__", id="getitem"),
    pytest.param("gil-hang", FaultyMapDataset, {}, r"__getitem__ in worker [01] \(pid \d+\)", NO_READ_ADVICE,
                 SLEEPING + "__getitem__", id="getitem-in-c-holding-the-gil"),
    pytest.param("read-hang", FaultyDataset, {}, r"read or decode in worker [01] \(pid \d+\)", READ_ADVICE,
                 WAITING_FOR_READS, id="read-in-worker"),
    pytest.param("read-hang", FaultyDataset, {"read_in_workers": False}, r"read", READ_ADVICE, None, id="read"),
    pytest.param("decode-hang", FaultyDataset, {"read_in_workers": False}, r"decode in worker [01] \(pid \d+\)",
                 READ_ADVICE, SLEEPING + "decode", id="decode-after-loader-read"),
]


@pytest.mark.parametrize("fault, dataset, options, stage, advice, frame", HANGS)
def test_timeout_names_the_stuck_index_and_stage(make, before, fault, dataset, options, stage, advice, frame):
    ds = make({13: fault}, dataset)
    with aioload.DataLoader(ds, batch_size=BATCH, num_workers=2, timeout=3, **options) as loader:
        it = iter(loader)
        assert indices(next(it)) == list(range(8))
        with pytest.raises(aioload.DataLoaderTimeoutError) as info:
            next(it)
    exc = info.value
    assert isinstance(exc, TimeoutError) and isinstance(exc, RuntimeError)
    summary, _, stacks = str(exc).partition("\n\n")
    assert re.fullmatch(
        rf"DataLoader timed out after 3 seconds waiting for a batch: dataset index 13 {PATH} is stuck in "
        rf"{stage}\. {advice}",
        summary,
    )
    assert [index for index, _ in exc.stuck] == [13]
    assert re.fullmatch(stage, exc.stuck[0][1])
    if frame is None:  # stuck in the training process's own loop: no worker holds it
        assert stacks == ""
    else:  # the stuck worker's stack, every thread's: the frame it is stuck in, first
        wid, pid = re.search(r"worker (\d+) \(pid (\d+)\)", exc.stuck[0][1]).groups()
        assert stacks.startswith(f"worker {wid} (pid {pid}), every thread's stack, most recent call first:\n"), stacks
        assert re.search(frame, stacks), stacks
    del it
    assert_released(before)  # the stuck worker was stopped


async def _batches_async(loader) -> list:
    return [batch async for batch in loader]


@pytest.mark.parametrize("iterate", [list, lambda loader: asyncio.run(_batches_async(loader))], ids=["for", "async-for"])
def test_a_long_stall_warns_once_with_the_stuck_workers_stack_and_goes_on_waiting(tmp_path, before, monkeypatch,
                                                                                   iterate):
    release = tmp_path / "release"
    warned = []

    def shown(message, category, filename, lineno, file=None, line=None):
        warned.append((message, filename))
        release.touch()  # the warning came: let the held sample go

    monkeypatch.setattr("warnings.showwarning", shown)
    with warnings.catch_warnings():
        warnings.simplefilter("always", aioload.StalledWarning)
        with aioload.DataLoader(HeldDataset(16, 9, release), batch_size=4, num_workers=2, stall_warning=0.5) as loader:
            assert [b.tolist() for b in iterate(loader)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert len(warned) == 1, warned
    message, filename = warned[0]
    assert isinstance(message, aioload.StalledWarning) and filename == __file__  # points at the loop (or its coroutine)
    summary, _, stacks = str(message).partition("\n\n")
    assert re.fullmatch(r"DataLoader has waited 0\.5 seconds for a batch: dataset index 9 is stuck in __getitem__ in "
                        r"worker ([01]) \(pid (\d+)\)\. It goes on waiting; set timeout= to fail instead, or "
                        r"stall_warning=None to silence this\.", summary), summary
    wid, pid = re.search(r"worker (\d) \(pid (\d+)\)", summary).groups()
    assert stacks.startswith(f"worker {wid} (pid {pid}), every thread's stack, most recent call first:\n"), stacks
    assert re.search(r'File ".*faulty\.py", line \d+ in __getitem__', stacks), stacks
    assert_released(before)


def test_stall_warning_is_a_positive_number_of_seconds_or_none(tmp_path, before):
    release = tmp_path / "release"
    release.touch()
    with aioload.DataLoader(HeldDataset(16, 9, release), batch_size=4, num_workers=2, stall_warning=None) as loader:
        assert len(list(loader)) == 4  # filterwarnings = error: a warning would fail this
    with pytest.raises(ValueError, match=r"^stall_warning must be > 0 seconds \(None turns the warning off\), got 0$"):
        aioload.DataLoader(HeldDataset(16, 9, release), stall_warning=0)
    with pytest.raises(TypeError, match=r"^stall_warning must be a number of seconds or None, got 'soon'$"):
        aioload.DataLoader(HeldDataset(16, 9, release), stall_warning="soon")
    assert_released(before)


def test_timeout_while_workers_start(make, before):
    with aioload.DataLoader(make(), batch_size=BATCH, num_workers=2, timeout=2, worker_init_fn=hanging_init) as loader:
        with pytest.raises(aioload.DataLoaderTimeoutError) as info:
            next(iter(loader))
    message = str(info.value)
    assert re.fullmatch(
        r"DataLoader timed out after 2 seconds waiting for a batch: (dataset index 0 \(.*sample-00000\.bin\) is|"
        r"dataset indices \[0, 1, 2, 3, 4, 5, 6, 7\] are) waiting for the workers to start \(0 of 2 ready\)\. "
        r"Set read_timeout= to bound each read, or raise timeout= if batches are just slow\.",
        message,
    ), message
    del info
    assert_released(before)  # workers stuck in worker_init_fn are stopped too


def test_timeout_in_async_iteration(make, before):
    async def main():
        loader = aioload.DataLoader(make({9: "decode-hang"}), batch_size=BATCH, num_workers=2, timeout=3)
        async with loader:
            seen = []
            with pytest.raises(aioload.DataLoaderTimeoutError, match=r"dataset index 9 .* is stuck in read or decode"):
                async for batch in loader:
                    seen.append(indices(batch))
            assert seen == [list(range(8))]

    asyncio.run(main())
    assert_released(before)


def test_read_timeout_fails_the_sample(make, before):
    with aioload.DataLoader(make({13: "read-hang"}), batch_size=BATCH, num_workers=2, read_timeout=0.5, timeout=20) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(aioload.DataLoaderTimeoutError) as info:
            next(it)
        assert str(info.value) == (
            "dataset.read(13) did not return within read_timeout=0.5 seconds; raise read_timeout if the "
            "storage is just slow, or use on_error='skip' to leave such samples out"
        )
        assert info.value.stuck == [(13, "read")]
        note_matching(info.value, rf"while reading dataset index 13 {PATH} in an aioload worker")
        assert len(list(it)) == 3
    assert_released(before)


@pytest.mark.parametrize("workers", [0, 2])
def test_read_timeout_with_skip_leaves_the_sample_out(make, workers):
    kwargs = {"timeout": 20} if workers else {}
    ds = make({13: "read-hang", 30: "read-hang"})
    with aioload.DataLoader(ds, batch_size=BATCH, num_workers=workers, read_timeout=0.3, on_error="skip", **kwargs) as loader:
        assert sorted(collect(loader)) == [i for i in range(N) if i not in (13, 30)]
        assert sorted(loader.stats().skipped) == [13, 30]


def test_read_blocked_in_a_thread_does_not_hold_the_loader(make, before):
    """A named pipe that nobody writes: ``open`` blocks in the read's thread and cannot be
    interrupted. read_timeout gives up on it, the epoch ends, the loader closes."""
    ds = make()
    fifo = sample_path(ds.root, 13)
    os.unlink(fifo)
    os.mkfifo(fifo)
    try:
        with aioload.DataLoader(ds, batch_size=BATCH, num_workers=2, read_timeout=0.5, on_error="skip",
                                timeout=20) as loader:
            for _ in range(2):
                assert sorted(collect(loader)) == [i for i in range(N) if i != 13]
    finally:
        try:  # a writer comes and goes: the blocked opens return and read end-of-file
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # no reader was blocked
    assert_released(before)


# -- on_error="skip" ----------------------------------------------------------------------------

WHOLE_BATCH = {i: "corrupt" for i in range(32, 40)}
SKIP_CASES = [
    pytest.param(FaultyDataset, 2, None, {3: "missing", 9: "corrupt", 10: "decode-error", 21: "read-error"}, id="split-workers"),
    pytest.param(FaultyDataset, 2, torch.stack, {3: "missing", 9: "corrupt", 10: "decode-error", 21: "read-error"},
                 id="split-workers-collate_fn"),
    pytest.param(FaultyDataset, 0, None, {3: "missing", 9: "corrupt", 10: "decode-error", 21: "read-error"}, id="split-no-workers"),
    pytest.param(FaultyMapDataset, 2, None, {3: "missing", 9: "corrupt", 10: "decode-error", 21: "strict-error"}, id="getitem-workers"),
    pytest.param(FaultyMapDataset, 0, None, {3: "missing", 9: "corrupt", 10: "decode-error", 21: "strict-error"}, id="getitem-no-workers"),
]


@pytest.mark.parametrize("dataset, workers, collate_fn, faults", SKIP_CASES)
def test_skip_delivers_every_other_sample_exactly_once(make, before, caplog, dataset, workers, collate_fn, faults):
    faults = {**faults, **WHOLE_BATCH}
    ds = make(faults, dataset)
    kwargs = {"timeout": 20} if workers else {}
    with caplog.at_level(logging.WARNING, logger="aioload"):
        with aioload.DataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=collate_fn,
                                on_error="skip", **kwargs) as loader:
            batches = [indices(b) for b in loader]
            stats = loader.stats()
    delivered = [i for b in batches for i in b]
    counts = collections.Counter(delivered)
    assert sorted(counts) == [i for i in range(N) if i not in faults]
    assert set(counts.values()) == {1}
    # batches that held a failed sample arrive short; the batch that failed whole does not arrive
    assert [len(b) for b in batches] == [7, 6, 7, 8]
    assert sorted(stats.skipped) == sorted(faults)
    skipped_logs = [r for r in caplog.records if r.name == "aioload" and "skipped dataset index" in r.getMessage()]
    assert sorted(int(re.search(r"index (\d+)", r.getMessage()).group(1)) for r in skipped_logs) == sorted(faults)
    assert all(r.levelno == logging.WARNING for r in skipped_logs)
    assert_released(before)


def test_skip_log_line_names_index_error_and_where(make, caplog):
    with caplog.at_level(logging.WARNING, logger="aioload"):
        with aioload.DataLoader(make({9: "corrupt"}), batch_size=BATCH, num_workers=2, on_error="skip") as loader:
            collect(loader)
    (line,) = [m for m in caplog.messages if "skipped" in m]
    assert re.fullmatch(
        rf"on_error='skip': skipped dataset index 9: ValueError: sample 9 is corrupt: bad header or length 24 "
        rf"while running decode for dataset index 9 {PATH.replace('13', '09')} in an aioload worker",
        line,
    )


def test_skip_collate_fn_failure_skips_that_batch(make):
    with aioload.DataLoader(make(), batch_size=BATCH, num_workers=2, collate_fn=CollateFailsOn(13),
                            on_error="skip", timeout=20) as loader:
        assert collect(loader) == [i for i in range(N) if not 8 <= i < 16]
        assert loader.stats().skipped == tuple(range(8, 16))


def test_getitems_failure_names_and_skips_its_whole_chunk(make, caplog):
    ds = make({13: "decode-error"}, FaultyBatchedDataset)
    with aioload.DataLoader(ds, batch_size=BATCH, num_workers=2, timeout=20) as loader:
        with pytest.raises(ValueError) as info:
            collect(loader)
    assert str(info.value) == "decode failed on purpose for index 13"
    note = note_matching(info.value, r"while running __getitems__ for dataset indices \[[\d, ]+\] in an aioload worker")
    chunk = [int(i) for i in re.search(r"\[([\d, ]+)\]", note).group(1).split(", ")]
    assert 13 in chunk and set(chunk) <= set(range(8, 16))
    del info
    with aioload.DataLoader(ds, batch_size=BATCH, num_workers=2, on_error="skip", timeout=20) as loader:
        delivered = collect(loader)
        skipped = loader.stats().skipped
    assert 13 in skipped and set(skipped) <= set(range(8, 16))
    assert sorted(delivered) == sorted(set(range(N)) - set(skipped))


MAX_ERRORS = [
    pytest.param(2, 2, "max_errors=2", id="count"),
    pytest.param(0.05, 0, "max_errors=0.05 (2 of this epoch's 40 samples)", id="fraction"),
    pytest.param(2, 0, "max_errors=2", id="count-no-workers"),
]


@pytest.mark.parametrize("max_errors, workers, bound", MAX_ERRORS)
def test_max_errors_turns_too_many_skips_into_an_error(make, before, max_errors, workers, bound):
    ds = make({5: "corrupt", 17: "missing", 26: "decode-error"})
    kwargs = {"timeout": 20} if workers else {}
    with aioload.DataLoader(ds, batch_size=BATCH, num_workers=workers, on_error="skip", max_errors=max_errors, **kwargs) as loader:
        for _ in range(2):  # every epoch has its own budget
            with pytest.raises(aioload.TooManyErrorsError) as info:
                collect(loader)
            assert str(info.value) == (
                f"3 samples failed this epoch, more than {bound} allows; the last failure is chained "
                "below. Fix or remove the failing samples, or raise max_errors."
            )
            # the cause is the failure that went over the bound: whichever came third
            assert isinstance(info.value.__cause__, (ValueError, FileNotFoundError))
            note_matching(info.value.__cause__, r"while (reading|running decode for) dataset index (5|17|26) .*")
    del info  # its traceback holds collect()'s frame, and so the last batch it received
    assert_released(before)


@pytest.mark.parametrize("max_errors", [3, 0.1])
def test_max_errors_allows_up_to_its_bound(make, max_errors):
    ds = make({5: "corrupt", 17: "missing", 26: "decode-error"})
    with aioload.DataLoader(ds, batch_size=BATCH, num_workers=2, on_error="skip", max_errors=max_errors, timeout=20) as loader:
        assert len(collect(loader)) == N - 3


# -- invalid arguments fail at construction -------------------------------------------------------

INVALID = [
    (dict(batch_size=0), ValueError, "batch_size should be a positive integer value, but got batch_size=0"),
    (dict(num_workers=-1), ValueError,
     "num_workers option should be non-negative; use num_workers=0 to disable multiprocessing."),
    (dict(timeout=-1), ValueError, "timeout option should be non-negative"),
    (dict(io_concurrency=0), ValueError, "io_concurrency must be >= 1, got 0"),
    (dict(queue_depth=0), ValueError, "queue_depth must be >= 1, got 0"),
    (dict(on_error="ignore"), ValueError, "on_error must be 'raise' or 'skip', got 'ignore'"),
    (dict(on_error="skip", max_errors=-1), ValueError, "max_errors must be >= 0 when it is a count, got -1"),
    (dict(on_error="skip", max_errors=1.5), ValueError,
     "max_errors must be between 0 and 1 when it is a fraction of the epoch, got 1.5; pass an int to give a count"),
    (dict(on_error="skip", max_errors="3"), TypeError,
     "max_errors must be None, an int >= 0 (a count of samples) or a float between 0 and 1 (a fraction of "
     "the epoch), got '3'"),
    (dict(on_error="skip", max_errors=True), TypeError,
     "max_errors must be None, an int >= 0 (a count of samples) or a float between 0 and 1 (a fraction of "
     "the epoch), got True"),
    (dict(max_errors=3), ValueError, "max_errors=3 bounds skipped samples, which needs on_error='skip' (got on_error='raise')"),
    (dict(read_timeout=0), ValueError, "read_timeout must be > 0 seconds or None, got 0"),
    (dict(read_timeout=-1.0), ValueError, "read_timeout must be > 0 seconds or None, got -1.0"),
    (dict(read_timeout="1"), TypeError, "read_timeout must be a number of seconds or None, got '1'"),
]


@pytest.mark.parametrize("kwargs, kind, message", INVALID, ids=[str(k) for k, _, _ in INVALID])
def test_invalid_argument_is_refused_at_construction(make, before, kwargs, kind, message):
    with pytest.raises(kind, match=f"^{re.escape(message)}$"):
        aioload.DataLoader(make(), **{"num_workers": 2, **kwargs})
    assert_released(before)  # nothing was started


def test_read_timeout_needs_an_async_read(make):
    with pytest.raises(ValueError, match=re.escape(
            "read_timeout bounds Dataset.read, and this dataset has no 'async def read' (it is loaded with "
            "__getitem__ in the workers); use timeout= instead") + "$"):
        aioload.DataLoader(make(dataset=FaultyMapDataset), num_workers=2, read_timeout=1.0)


def test_skip_needs_a_map_style_dataset():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(ValueError, match=re.escape(
            "on_error='skip' needs a map-style dataset: an IterableDataset's iterator cannot go on after "
            "it raised; catch errors inside __iter__ instead") + "$"):
        aioload.DataLoader(Stream(), num_workers=2, on_error="skip")


# -- leaving a loop early, forgetting to close, Ctrl-C, interpreter exit ----------------------------

def test_break_stops_the_engine_at_once(make, before):
    with aioload.DataLoader(make(), batch_size=4, num_workers=2, timeout=20) as loader:
        for step, batch in enumerate(loader):
            if step == 1:
                break
        del batch  # a batch the training loop keeps holds its slot's memory, as it should
        wait_until(lambda: not aioload_threads(), 5, "the engine thread to stop after break")
        assert sorted(collect(loader)) == list(range(N))
    assert_released(before)


def test_exception_in_the_training_loop_releases_everything(make, before):
    with pytest.raises(ZeroDivisionError):
        with aioload.DataLoader(make(), batch_size=4, num_workers=2, timeout=20) as loader:
            for step, batch in enumerate(loader):
                if step == 2:
                    del batch
                    1 / 0
    assert_released(before)


def test_exception_in_the_training_loop_then_close(make, before):
    loader = aioload.DataLoader(make(), batch_size=4, num_workers=2, timeout=20)
    try:
        for step, batch in enumerate(loader):
            if step == 2:
                del batch
                raise KeyError("training step failed")
    except KeyError:
        pass
    loader.close()
    loader.close()  # idempotent
    assert_released(before)


def test_unclosed_loader_warns_and_releases_everything_when_collected(make, before):
    loader, made_at = aioload.DataLoader(make(), batch_size=4, num_workers=2, timeout=20), sys._getframe().f_lineno
    it = iter(loader)
    next(it)
    with pytest.warns(ResourceWarning, match="garbage collected without close()") as caught:
        del it, loader
        gc.collect()
    # it points at the line that made the loader, not into weakref.py where the collector runs
    assert (caught[0].filename, caught[0].lineno) == (__file__, made_at)
    assert f"(made at {__file__}:{made_at})" in str(caught[0].message)
    assert_released(before)


CHILD = textwrap.dedent("""
    import multiprocessing, os, signal, sys, threading, time
    # Ctrl-C raises KeyboardInterrupt here even where the suite runs as a background job, whose
    # children start with SIGINT ignored (and Python then leaves it ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {root_dir!r})
    import aioload
    from tests.faulty import FaultyDataset

    mode = sys.argv[1]
    kept = []

    def announce(loaders):
        # each loader's workers, then the processes they were forked from (spawn, forkserver)
        pools = [loader._res.pool for loader in loaders]
        workers = [p.pid for pool in pools for p in pool.procs]
        templates = [pool.template.proc.pid for pool in pools if pool.template is not None]
        print(" ".join(map(str, workers)), "|", " ".join(map(str, templates)), flush=True)

    def announce_waiting(loader):
        # Ctrl-C is sent once the training thread blocks on the batch whose sample hangs: one
        # that lands while a finalizer runs (a batch freed between steps) is reported by Python
        # as "Exception ignored" and lost, as any program's would be
        main = threading.main_thread().ident
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            frame, names = sys._current_frames().get(main), []
            while frame is not None:
                names.append(frame.f_code.co_name)
                frame = frame.f_back
            if names[:1] == ["wait"] and "__next__" in names:
                break
            time.sleep(0.01)
        announce([loader])

    def train(loader):
        for epoch in range(1000):
            for step, batch in enumerate(loader):
                if epoch == 0 and step == 0:
                    if mode == "two":  # a second loader's workers are forked beside the first's
                        other = aioload.DataLoader(FaultyDataset({root!r}, 40, {{}}), batch_size=4, num_workers=2)
                        kept.append(iter(other))  # an epoch running: its pool stays
                        next(kept[-1])
                        announce([loader, other])
                    elif mode == "waiting":  # once the consumer waits for the stuck batch
                        threading.Thread(target=announce_waiting, args=(loader,), daemon=True).start()
                    else:
                        announce([loader])
                if mode == "exit" and step == 2:
                    sys.exit(0)  # interpreter exit with the loader open and an epoch running
                time.sleep(0.01)  # the training step

    if __name__ == "__main__":  # spawn and forkserver run this module again in the template
        if len(sys.argv) > 2:
            multiprocessing.set_start_method(sys.argv[2])  # the interpreter's default, as 3.14 sets it
        faults = {{8: "decode-hang"}} if mode == "waiting" else {{}}
        loader = aioload.DataLoader(FaultyDataset({root!r}, 40, faults), batch_size=4, num_workers=2)
        if mode == "with":
            with loader:
                train(loader)
        else:
            train(loader)
""")


@pytest.fixture
def child_programs():
    """The child programs a test starts, each in a process group of its own with its workers:
    whatever the test's end (a failed assertion, its timeout), none is left behind, since
    later tests count processes."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=10)


def run_child(tmp_path, make, child_programs, mode: str, workers: int = 2,
              method: str | None = None) -> tuple[subprocess.Popen, list[int]]:
    """The child program running, and its workers' pids and their templates' (with ``method``,
    the child's default start method)."""
    make()
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root_dir=os.path.dirname(TESTS_DIR), root=str(tmp_path / "data")))
    proc = subprocess.Popen([sys.executable, str(script), mode, *([method] if method else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    child_programs.append(proc)
    ready, _, _ = select.select([proc.stdout], [], [], 45)
    line = proc.stdout.readline() if ready else ""
    if not line:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"the child did not report its workers within 45 s; stderr:\n{err}")
    forked, templates = ([int(pid) for pid in part.split()] for part in line.split("|"))
    assert len(forked) == workers and len(templates) == (0 if method in (None, "fork") else workers // 2)
    return proc, forked + templates


def finished(proc: subprocess.Popen, timeout: float = 15.0) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the child did not exit within {timeout} s; stderr:\n{err}")
    return proc.returncode, err


@pytest.mark.parametrize("mode, method", [("with", None), ("waiting", None), ("with", "spawn"),
                                          ("waiting", "forkserver")])
def test_ctrl_c_stops_workers_and_exits(tmp_path, make, child_programs, mode, method):
    """Ctrl-C goes to the whole foreground process group, workers included, as a terminal does;
    in "waiting" the consumer is blocked on a batch whose worker is stuck."""
    proc, workers = run_child(tmp_path, make, child_programs, mode, method=method)
    os.killpg(proc.pid, signal.SIGINT)
    code, err = finished(proc)
    assert code != 0
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    assert "Exception ignored" not in err and "Warning" not in err, err
    wait_until(lambda: all(gone(pid) for pid in workers), 10, "the workers to exit after Ctrl-C")


@pytest.mark.parametrize("method", [None, "forkserver"])
def test_interpreter_exit_while_iterating_stops_workers(tmp_path, make, child_programs, method):
    proc, workers = run_child(tmp_path, make, child_programs, "exit", method=method)
    code, err = finished(proc)
    assert (code, err) == (0, "")
    wait_until(lambda: all(gone(pid) for pid in workers), 10, "the workers to exit with the interpreter")


def _socket_inodes(pid: int) -> set[str]:
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:"):
                held.add(link)
    return held


def test_a_loaders_workers_hold_no_socket_of_another_loader(make, before):
    """A worker forked for one loader closes the other loaders' sockets it inherited: else a
    worker stuck in user code would keep the other pool's workers from seeing the end of
    stream when the process is killed."""
    dataset = make()
    with aioload.DataLoader(dataset, batch_size=4, num_workers=1) as a, \
            aioload.DataLoader(dataset, batch_size=4, num_workers=1) as b:
        first, second = iter(a), iter(b)  # a's pool exists when b's worker is forked
        next(first)
        next(second)
        ours = {f"socket:[{os.fstat(s.fileno()).st_ino}]" for s in a._res.pool.socks + a._res.pool.ctrls}
        assert ours <= _socket_inodes(os.getpid())
        for proc in b._res.pool.procs:
            assert not ours & _socket_inodes(proc.pid)
        del first, second
    assert_released(before)


@pytest.mark.parametrize("mode, count, method", [("with", 2, None), ("two", 4, None), ("with", 2, "spawn"),
                                                 ("two", 4, "forkserver")])
def test_workers_exit_when_the_loader_process_is_killed(tmp_path, make, child_programs, mode, count, method):
    """With two loaders, the second pool's workers were forked holding the first pool's
    sockets: they must not keep the first pool's workers from seeing the end of stream. With
    spawn or forkserver, the workers' template ends with the training process too."""
    proc, workers = run_child(tmp_path, make, child_programs, mode, count, method)
    proc.kill()
    finished(proc)
    wait_until(lambda: all(gone(pid) for pid in workers), 10, "orphaned workers to exit")


class _OddFails(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 60

    def __getitem__(self, i):
        if i % 2:
            raise ValueError(f"sample {i} is corrupt")
        return torch.tensor([i])


@pytest.mark.parametrize("workers", [0, 2])
def test_skipped_indices_are_counted_all_but_kept_only_up_to_a_bound(workers, monkeypatch):
    from aioload._observe import stats as _stats
    monkeypatch.setattr(_stats, "SKIPPED_KEPT", 10)
    with aioload.DataLoader(_OddFails(), batch_size=4, num_workers=workers, on_error="skip") as loader:
        before = loader.stats()
        for _ in range(2):
            assert sorted(int(i) for batch in loader for i in batch) == list(range(0, 60, 2))
        stats = loader.stats()
    assert stats.skipped_total == 60, "every skipped sample is counted, over both epochs"
    assert len(stats.skipped) == 10 and set(stats.skipped) <= set(range(1, 60, 2))
    assert stats.since(before).skipped_total == 60
    assert "skipped          60 (indices" in str(stats)


def test_an_error_while_reading_replies_reaches_the_consumer_and_the_next_epoch_works(monkeypatch):
    """The engine's reply callback failing (here a reply it cannot parse) ends the epoch with
    that error, promptly, and leaves nothing behind that keeps the next epoch from running."""
    from aioload._workers import wire as _wire
    real = _wire.Reader.read_available
    calls = {"n": 0}

    def flaky(self):
        calls["n"] += 1
        if calls["n"] == 6:
            raise EOFError("reply cut short on purpose")
        return real(self)

    with aioload.DataLoader(_OddFails(), batch_size=2, num_workers=2, on_error="skip", timeout=20) as loader:
        monkeypatch.setattr(_wire.Reader, "read_available", flaky)
        with pytest.raises(EOFError, match="cut short on purpose"):
            for _ in loader:
                pass
        monkeypatch.setattr(_wire.Reader, "read_available", real)
        assert sorted(int(i) for batch in loader for i in batch) == list(range(0, 60, 2))


def test_a_fork_taken_while_another_thread_computes_a_layout_property_does_not_deadlock():
    """The deterministic form of a hang seen once in 20 runs with two loaders: on Python 3.11
    ``functools.cached_property`` holds one lock per property for all instances, so a worker
    forked while another loader's engine was inside ``LeafSpec.nbytes`` waited for ever.
    Layout properties are memoised without a lock; a child forked mid-computation can use
    them at once."""
    import threading

    from aioload._handoff.layout import LeafSpec, _memo

    assert type(LeafSpec.__dict__["nbytes"]) is _memo and type(LeafSpec.__dict__["torch_dtype"]) is _memo
    parent = os.getpid()
    inside, release = threading.Event(), threading.Event()

    class Slow:
        @_memo
        def value(self):
            if os.getpid() == parent:
                inside.set()
                release.wait(30)  # the parent's thread stays inside while the child is forked
            return LeafSpec("t", "torch.int64", (3,)).nbytes

    holder = threading.Thread(target=lambda: Slow().value)
    holder.start()
    try:
        assert inside.wait(10)
        ctx = multiprocessing.get_context("fork")
        child = ctx.Process(target=lambda: os._exit(0 if Slow().value == 24 else 1))
        child.start()
        child.join(20)
        stuck = child.is_alive()
        if stuck:
            child.kill()
            child.join()
        assert not stuck, "the forked child waited on a lock held by the parent's thread"
        assert child.exitcode == 0
    finally:
        release.set()
        holder.join(10)
