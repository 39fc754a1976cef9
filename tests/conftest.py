"""Shared fixtures: small real datasets on disk and leak checks."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import threading

import pytest

from aioload._tools.synth import make_image_folder


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
