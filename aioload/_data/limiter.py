"""A resizable async limiter: an ``asyncio.Semaphore`` whose bound can change while it runs.

The engine bounds reads in flight and batches in flight with it, and a worker that reads its
samples bounds its reads in flight; the autotuner and a worker's read policy move those
bounds. Lowering the limit never interrupts a holder: new acquirers wait until enough holders
have released. Waiters are served first come, first served. It also keeps how long acquirers
have waited behind the limit (:meth:`Limiter.bound_seconds`), the evidence that it binds.
"""

from __future__ import annotations

import asyncio
import collections
import time


class Limiter:
    """At most ``limit`` holders at once; ``set_limit`` resizes it on the fly.

    Same interface as ``asyncio.Semaphore`` (``acquire``, ``release``, ``async with``) plus
    :meth:`set_limit`, :attr:`in_use` and :meth:`bound_seconds`. One event loop only (which
    :meth:`bound_seconds` may be read from any thread).
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self._limit = limit
        self._in_use = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._bound_s = 0.0  # seconds during which someone waited behind the limit, up to _since
        self._since: float | None = None  # when the current run of waiting began

    def bound_seconds(self) -> float:
        """Seconds, since this limiter was made, during which at least one acquirer waited
        behind the limit."""
        since = self._since
        return self._bound_s + (time.perf_counter() - since if since is not None else 0.0)

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def in_use(self) -> int:
        return self._in_use

    def locked(self) -> bool:
        return self._in_use >= self._limit

    def set_limit(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self._limit = limit
        self._wake()

    async def acquire(self) -> bool:
        if self._in_use < self._limit and not self._waiters:
            self._in_use += 1
            return True
        future = asyncio.get_running_loop().create_future()
        if self._since is None:
            self._since = time.perf_counter()
        self._waiters.append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # the permit was granted just as we were cancelled
            else:
                self._discard(future)
            raise
        return True

    def release(self) -> None:
        """Give a permit back. As with ``asyncio.Semaphore``, a release without an acquire
        adds a permit (``in_use`` goes below zero)."""
        self._in_use -= 1
        self._wake()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc_info) -> None:
        self.release()

    def _wake(self) -> None:
        while self._waiters and self._in_use < self._limit:
            future = self._waiters.popleft()
            if not future.done():
                self._in_use += 1
                future.set_result(None)
        self._settle()

    def _discard(self, future: asyncio.Future) -> None:
        try:
            self._waiters.remove(future)
        except ValueError:
            pass
        self._settle()

    def _settle(self) -> None:
        """Close the current run of waiting once nobody waits any more."""
        if not self._waiters and self._since is not None:
            self._bound_s += time.perf_counter() - self._since
            self._since = None
