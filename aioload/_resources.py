"""What a loader must release (its engine, worker pool and slots), kept apart from the loader
so a finalizer can reach it, and the hook that releases every loader at interpreter exit."""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from typing import TYPE_CHECKING

from aioload._spec import Shared

if TYPE_CHECKING:
    from aioload._engine import Engine
    from aioload._pool import WorkerPool

_LIVE: "weakref.WeakSet[_Resources]" = weakref.WeakSet()
_EXITING = False


class _Resources:
    """Everything a loader must release; kept apart from the loader so a finalizer can reach it."""

    def __init__(self):
        self.pool: WorkerPool | None = None
        self.engine: Engine | None = None
        self.shared = Shared()
        self.closed = False
        self.restarts = 0
        self.pid = os.getpid()  # a forked child (any worker process) inherits a copy: not its to close
        self.lost: str | None = None  # why the last pool was lost (a crash), until it is replaced
        self.workers = 0  # worker processes per pool, once one has been started
        self.epoch_state: dict | None = None
        self.executor = None  # an aioload._executor.ExecutorStage with executor=

    def stop_engine(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.stop()
            if not engine.clean:
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


def _finalize_loader(res: _Resources) -> None:
    if res.closed:
        return
    if res.workers and not _EXITING:  # it started processes, even if none runs right now
        warnings.warn(
            f"an aioload.DataLoader with {res.workers} worker processes was garbage "
            "collected without close(); use 'with aioload.DataLoader(...)' or call close()",
            ResourceWarning,
            stacklevel=2,
        )
    res.close()


def _close_all_at_exit() -> None:
    """Runs before the interpreter joins threads: stop every engine, then every pool."""
    global _EXITING
    _EXITING = True
    for res in list(_LIVE):
        if res.pid == os.getpid():
            res.close()


if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_close_all_at_exit)
else:  # pragma: no cover
    import atexit

    atexit.register(_close_all_at_exit)
