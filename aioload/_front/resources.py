"""What a loader must release (its engine, worker pool and slots), kept apart from the loader
so a finalizer can reach it, and the hooks that release every loader when its process exits."""

from __future__ import annotations

import multiprocessing.util
import os
import sys
import threading
import warnings
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aioload._engine.engine import Engine
    from aioload._engine.executor import ExecutorStage
    from aioload._engine.spec import Shared
    from aioload._workers.pool import WorkerPool

LIVE: "weakref.WeakSet[Resources]" = weakref.WeakSet()
_EXITING = False


class Resources:
    """Everything a loader must release; kept apart from the loader so a finalizer can reach it.
    ``shared``: what outlives an epoch (the layout, the slot pool), made by the loader."""

    def __init__(self, shared: Shared):
        self.pool: WorkerPool | None = None
        self.engine: Engine | None = None
        self.shared = shared
        self.closed = False
        self.restarts = 0
        self.pid = os.getpid()  # a forked child (any worker process) inherits a copy: not its to close
        self.lost: str | None = None  # why the last pool was lost (a crash), until it is replaced
        self.workers = 0  # worker processes per pool, once one has been started
        self.executor: ExecutorStage | None = None  # with executor=
        self.made_at = _caller()  # the user's line that made the loader, for the unclosed warning
        watch_exit()

    def started_here(self) -> bool:
        """Whether this process made the loader or started its worker pool (a loader inherited
        by a forked child belongs to the parent, unless the child iterated it itself)."""
        pool = self.pool
        return self.pid == os.getpid() or (pool is not None and pool.owner == os.getpid())

    def stop_engine(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.stop()
            if not engine.clean:
                self.discard_pool()

    def end_epoch(self, engine: Engine, *, exhausted: bool, persistent: bool, superseded: bool) -> None:
        """An epoch's iterator is finished or dropped. Workers are kept for the next epoch when
        it ran to its end (``exhausted``, or with ``persistent_workers=True``); an epoch left
        early (``break``, an exception, Ctrl-C) also stops them, so nothing keeps running
        behind an abandoned loop. A ``superseded`` epoch's pool belongs to the newer epoch."""
        if not exhausted and not persistent and not superseded:
            engine.drain_timeout = 0  # the workers go anyway: do not wait for their tasks
        engine.stop()
        if superseded:
            return  # a newer epoch owns the pool now; stop_engine() already judged it
        if self.engine is engine:
            self.engine = None
        if not engine.clean or (not exhausted and not persistent):
            self.discard_pool()

    def discard_pool(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None and not pool.closed and not pool.alive():
            self.lost = str(pool.broken) if pool.broken is not None else "a worker process died"
        slots, self.shared.slots = self.shared.slots, None
        if slots is not None:
            slots.close()
        if pool is not None:
            pool.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.stop_engine()
        self.discard_pool()
        if self.executor is not None:
            self.executor.close()


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _caller() -> tuple[str, int]:
    """``(file, line)`` of the first frame outside aioload: the code that made the loader."""
    frame = sys._getframe(1)
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno


def finalize_loader(res: Resources) -> None:
    if res.closed:
        return
    if res.workers and not _EXITING:  # it started processes, even if none runs right now
        # A finalizer runs wherever the collector does (weakref.py's frame): the warning points
        # at the line that made the loader instead, where the fix goes.
        filename, lineno = res.made_at
        warnings.warn_explicit(
            f"an aioload.DataLoader with {res.workers} worker processes (made at {filename}:{lineno}) was garbage "
            "collected without close(); use 'with aioload.DataLoader(...)' or call close()",
            ResourceWarning, filename, lineno, module=os.path.splitext(os.path.basename(filename))[0],
        )
    res.close()


def _close_all_at_exit() -> None:
    """Stop every engine, then every pool, of the loaders this process started. Idempotent:
    it runs from whichever exit hook comes first (see :func:`watch_exit`)."""
    global _EXITING
    _EXITING = True
    for res in list(LIVE):
        if res.started_here():
            res.close()


# NOTE [exit hooks]: a main interpreter runs threading's exit hooks, then joins the threads
# that are not daemons, then runs ``atexit``: the threading hook stops the engine threads
# before that join. A ``multiprocessing`` child never runs ``atexit``: its last act is
# ``multiprocessing.util._exit_function``, which runs the finalizers that have an exit priority
# and then joins every child process that is not a daemon, the loader's workers among them, and
# workers that are never told to stop are joined forever. A ``Finalize`` with an exit priority
# stops them first. The child clears the finalizers it inherited when it starts, so the hook
# is registered again in every process that makes a loader or starts a pool.
_exit_hook: multiprocessing.util.Finalize | None = None


def watch_exit() -> None:
    """Make sure this process stops its loaders on the way out, also as a multiprocessing child."""
    global _exit_hook
    if _exit_hook is None or not _exit_hook.still_active():
        _exit_hook = multiprocessing.util.Finalize(None, _close_all_at_exit, exitpriority=100)


if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_close_all_at_exit)
else:  # pragma: no cover
    import atexit

    atexit.register(_close_all_at_exit)
