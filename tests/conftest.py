"""Shared fixtures: small real datasets on disk and leak checks; tests marked ``serial`` run
alone when the suite runs in several processes (pytest-xdist)."""

from __future__ import annotations

import concurrent.futures
import fcntl
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import threading

import pytest

from aioload._data.synth import make_image_folder


@pytest.fixture(scope="session")
def image_root(tmp_path_factory):
    """A small ImageFolder tree of real JPEGs (3 classes), made once per test session."""
    return make_image_folder(tmp_path_factory.mktemp("images"), images=48, classes=3, seed=1)


def aioload_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("aioload")]


def child_pids() -> list[int]:
    """Live aioload worker processes of this process (multiprocessing's own helpers, such as
    the forkserver, are not counted)."""
    return [p.pid for p in multiprocessing.active_children() if p.name.startswith("aioload-worker")]


@pytest.fixture(scope="module")
def processes():
    """A two-process ``ProcessPoolExecutor`` for the tests of one module (``executor=``)."""
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        yield pool


@pytest.fixture(scope="module")
def threads():
    """A two-thread ``ThreadPoolExecutor`` for the tests of one module (``executor=``)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        yield pool


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """``$AIOLOAD_CACHE`` in the test's own folder: no index or footer kept by another test."""
    monkeypatch.setenv("AIOLOAD_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def start_method(request):
    """The interpreter's default start method during the test (the test's ``start_method``
    parameter, given with ``indirect=True``), as Python 3.14 makes ``forkserver`` the default on
    Linux and macOS has only ``spawn``; the one before is restored after."""
    previous = multiprocessing.get_start_method(allow_none=True)
    if request.param != "fork":
        # the interpreter's helpers, started by its first spawn or forkserver child and kept for
        # the session: a test that compares snapshots takes its own after this fixture
        multiprocessing.resource_tracker.ensure_running()
        if request.param == "forkserver":
            multiprocessing.forkserver.ensure_running()
    multiprocessing.set_start_method(request.param, force=True)
    yield request.param
    multiprocessing.set_start_method(previous, force=True)


# ----------------------------------------------------------------------------- serial tests
# Under pytest-xdist (pyproject's addopts run the suite in several processes) a test marked
# ``serial`` reads or makes machine-wide state that another process's test changes (every
# entry of /dev/shm, a benchmark's machine-wide figures): it runs while no other test runs.
# Every test holds a shared lock on one file for the run; a serial test holds it exclusively.
# A second lock, the gate, is taken briefly by every test before the first, and held by a
# serial test until it ends: a serial test waiting for the tests in progress to finish is not
# overtaken by the tests that would start after them.


_LOCKS = pytest.StashKey[tuple]()


def _run_locks(config) -> tuple[int, int] | None:
    """This worker's descriptors of the gate and the lock, opened once; ``None`` in a run of one
    process, where nothing runs beside a test."""
    if not hasattr(config, "workerinput"):
        return None
    if _LOCKS not in config.stash:
        # the run's base temporary folder (each worker's is a folder in it): pytest removes it
        # with the run's other folders
        run = config._tmp_path_factory.getbasetemp().parent
        config.stash[_LOCKS] = tuple(os.open(run / name, os.O_RDWR | os.O_CREAT, 0o600)
                                     for name in ("serial.gate", "serial.lock"))
    return config.stash[_LOCKS]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    locks = _run_locks(item.config)
    if locks is None:
        yield
        return
    gate, lock = locks
    serial = item.get_closest_marker("serial") is not None
    fcntl.flock(gate, fcntl.LOCK_EX)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
    finally:
        if not serial:
            fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        if serial:
            fcntl.flock(gate, fcntl.LOCK_UN)


def pytest_collection_modifyitems(config, items):
    """In a parallel run, the files with a ``slow`` test are handed out first (each in its own
    order), so that the last minutes are not one process's long file while the others idle."""
    if not hasattr(config, "workerinput"):
        return
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order within a file stays


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Each process of a parallel run keeps what aioload caches (shard indexes, Parquet footers)
    in a folder of its own, ``$AIOLOAD_CACHE`` for it and its children: no two processes write
    ~/.cache/aioload at once, and no test finds what another process's test left there."""
    if hasattr(session.config, "workerinput"):
        os.environ["AIOLOAD_CACHE"] = str(session.config._tmp_path_factory.getbasetemp() / "aioload-cache")


def pytest_unconfigure(config):
    for fd in config.stash.get(_LOCKS, ()):
        os.close(fd)
