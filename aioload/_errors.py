"""Exceptions raised by aioload, and helpers that tag errors with where they came from."""

from __future__ import annotations

import pickle
import traceback

__all__ = [
    "DataLoaderTimeoutError",
    "LoaderClosedError",
    "TooManyErrorsError",
    "WorkerCrashedError",
]


class WorkerCrashedError(RuntimeError):
    """A worker process died (killed by a signal, out of memory, a segfault, ``os._exit``).

    ``worker_id``, ``exitcode`` and ``indices`` (the dataset indices it was working on) are
    attributes. The loader can be iterated again afterwards: a fresh pool is started.
    """

    def __init__(self, message: str, *, worker_id: int, exitcode: int | None, indices: list):
        super().__init__(message)
        self.worker_id = worker_id
        self.exitcode = exitcode
        self.indices = list(indices)

    def __reduce__(self):
        return (_rebuild_crash, (str(self), self.worker_id, self.exitcode, self.indices))


def _rebuild_crash(message, worker_id, exitcode, indices):
    return WorkerCrashedError(message, worker_id=worker_id, exitcode=exitcode, indices=indices)


class DataLoaderTimeoutError(RuntimeError, TimeoutError):
    """No batch arrived within ``timeout`` seconds.

    A ``RuntimeError`` (what torch's DataLoader raises) and a ``TimeoutError``.
    """


class LoaderClosedError(RuntimeError):
    """The loader was closed: iterating it again is a usage error, not a failure."""


class TooManyErrorsError(RuntimeError):
    """``on_error="skip"`` skipped more samples than ``max_errors`` allows."""


def describe_exit(exitcode: int | None) -> str:
    """Say in words how a process ended."""
    import signal

    if exitcode is None:
        return "is no longer answering"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def pack_exception(exc: BaseException) -> bytes:
    """Pickle an exception raised in a worker, keeping its type, message and traceback."""
    text = "".join(traceback.format_exception(exc))
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:
        blob = None
    return pickle.dumps((blob, type(exc).__qualname__, str(exc), text))


def unpack_exception(packed: bytes, where: str) -> BaseException:
    """Rebuild an exception packed by :func:`pack_exception`, with notes saying where it came from."""
    blob, type_name, message, text = pickle.loads(packed)
    exc = pickle.loads(blob) if blob is not None else RuntimeError(f"{type_name}: {message}")
    exc.add_note(where)
    exc.add_note("Original traceback:\n" + text.rstrip())
    return exc
