"""Exceptions raised by aioload, and helpers that tag errors with where they came from."""

from __future__ import annotations

import os
import pickle
import traceback

from aioload._storage.redact import redact

__all__ = [
    "BlockingReadWarning",
    "DataLoaderTimeoutError",
    "LoaderClosedError",
    "TooManyErrorsError",
    "WorkerCrashedError",
]


class _Rebuildable:
    """Pickles as ``cls(message)`` plus the instance's attributes (notes included), so that an
    aioload error crosses a process boundary whole; each class can also be rebuilt from a
    message alone (``type(exc)(message)``, as torch's ``ExceptionWrapper.reraise`` does)."""

    def __reduce__(self):
        return (type(self), self.args, self.__dict__)


class WorkerCrashedError(_Rebuildable, RuntimeError):
    """A worker process died (killed by a signal, out of memory, a segfault, ``os._exit``).

    The message starts as torch's does (``DataLoader worker (pid N) is killed by signal:
    Segmentation fault.``) and goes on with which worker it was and the dataset indices it was
    working on. ``worker_id``, ``pid``, ``exitcode`` and ``indices`` are attributes (``None``
    and ``[]`` when the error was made from a message alone). The loader can be iterated again
    afterwards: a fresh pool is started.
    """

    def __init__(self, message: str, *, worker_id: int | None = None, pid: int | None = None,
                 exitcode: int | None = None, indices: list | tuple = ()):
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode
        self.indices = list(indices)


class DataLoaderTimeoutError(_Rebuildable, RuntimeError, TimeoutError):
    """No batch arrived within ``timeout`` seconds, or a read took longer than ``read_timeout``.

    A ``RuntimeError`` (what torch's DataLoader raises) and a ``TimeoutError``. ``stuck`` lists
    ``(index, stage)`` pairs: the dataset indices that had not come through, and where they were
    (``"read"``, ``"decode in worker 1 (pid 123)"``, ...).
    """

    def __init__(self, message: str, *, stuck: list | tuple = ()):
        super().__init__(message)
        self.stuck = list(stuck)


class UnpicklableError(_Rebuildable, TypeError, pickle.PicklingError, AttributeError):
    """What a ``spawn`` or ``forkserver`` worker must be sent cannot be pickled: the message
    names it (``collate_fn``, ``worker_init_fn``, the dataset) and the fix, pickle's own error
    is the ``__cause__``. torch's DataLoader lets pickle's error through: a
    ``pickle.PicklingError`` for a lambda, an ``AttributeError`` for a function defined inside
    another; this is both (and a ``TypeError``, as for an object holding a lock), so an
    ``except`` written for torch catches it."""


class LoaderClosedError(_Rebuildable, RuntimeError):
    """The loader was closed: iterating it again is a usage error, not a failure."""


class TooManyErrorsError(_Rebuildable, RuntimeError):
    """``on_error="skip"`` skipped more samples than ``max_errors`` allows in one epoch; the
    last failure is its ``__cause__``."""


class ResumeError(ValueError):
    """A state cannot be loaded, or cannot resume this loader; the message says why and what to do."""


class ResumeWarning(UserWarning):
    """A loaded state resumes from the start of its epoch, not from where it was saved."""


class BlockingReadWarning(RuntimeWarning):
    """A dataset's ``async def read`` blocks its event loop: steps of it run long without
    awaiting (``time.sleep``, a synchronous HTTP client), so the other reads in flight and
    ``read_timeout`` wait. Warned once per loader, from the thread that iterates it; see
    docs/troubleshooting.md."""


class StalledWarning(RuntimeWarning):
    """Without ``timeout=``, the training loop has waited for one batch longer than
    ``stall_warning=`` seconds: the message names the samples held up, where (the worker and
    its pid) and each such worker's Python stack. Warned once per epoch; the loader goes on
    waiting, as torch's does. See docs/troubleshooting.md ("A stuck worker")."""


class CopyOnReadWarning(RuntimeWarning):
    """A worker's private memory grew past a threshold over an epoch while the dataset holds
    large Python containers (lists, dicts, tuples, sets), which each worker copies page by page
    as it reads them (reference counts): the message names them, with their sizes, and the cure.
    Warned once per loader; see docs/troubleshooting.md ("Memory")."""


def a_kind(name: str) -> str:
    """``name`` after its article, for messages: ``an ImageFolder``, ``a Mix``, ``an int``."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def where(describe, index) -> str:
    """`` (path)`` for error notes when the dataset can say where ``index`` lives, else ``""``."""
    if describe is None or isinstance(index, list):
        return ""
    try:
        found = describe(index)
    except Exception:  # noqa: BLE001 - a note must never hide the real error
        return ""
    return "" if found is None else f" ({redact(str(found))})"  # a URL's credentials never shown


SKIP_HINT = "; on_error='skip' leaves such samples out and goes on"
"""Appended to the note of a sample whose decode (or ``__getitem__``) failed and was raised."""


def crash_message(pid: int | None, exitcode: int | None) -> str:
    """How a dead worker is reported, worded as torch words it (log filters and code match
    ``DataLoader worker (pid N) is killed by signal: ...``)."""
    import signal

    if exitcode is None:
        return f"DataLoader worker (pid {pid}) closed its connection and is still running."
    if exitcode < 0:
        try:
            name = signal.strsignal(-exitcode) or f"Unknown signal {-exitcode}"
        except ValueError:
            name = f"Unknown signal {-exitcode}"
        return f"DataLoader worker (pid {pid}) is killed by signal: {name}."
    return f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {exitcode}."


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
    """Pickle an exception raised in a worker, keeping its type, message, notes and traceback
    (whose text leaves the notes out: they travel with the exception, and said twice they would
    read as two)."""
    notes = exc.__dict__.pop("__notes__", None)
    try:
        text = "".join(traceback.format_exception(exc))
    finally:
        if notes is not None:
            exc.__notes__ = notes
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:
        blob = None
    return pickle.dumps((blob, type(exc).__qualname__, str(exc), text))


def unpack_exception(packed: bytes, where: str | None) -> BaseException:
    """Rebuild an exception packed by :func:`pack_exception`, with notes saying where it came
    from (``where``, unless ``None``: its own notes say so already) and its traceback."""
    blob, type_name, message, text = pickle.loads(packed)
    exc = pickle.loads(blob) if blob is not None else RuntimeError(f"{type_name}: {message}")
    if where is not None:
        exc.add_note(where)
    exc.add_note("Original traceback:\n" + text.rstrip())
    return exc


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def forget_locals(exc: BaseException) -> BaseException:
    """Clear the local variables of aioload's own finished frames in ``exc``'s tracebacks (its
    cause, context and group members included) before it is handed to the consumer.

    Those frames hold slots, views and batches; a user who keeps the exception (a log, a
    notebook's last traceback) must not keep that shared memory. File names and line numbers
    stay, so the traceback prints as before; the frames of the user's own code are untouched.
    """
    pending: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while pending:
        err = pending.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        tb = err.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
                try:
                    tb.tb_frame.clear()
                except RuntimeError:
                    pass  # a frame still running (the one handing the error over)
            tb = tb.tb_next
        pending += [err.__cause__, err.__context__]
        if isinstance(err, BaseExceptionGroup):
            pending += err.exceptions
    return exc
