"""The bounded hand-off between the engine thread and the consumer.

Batches finish out of order (workers run in parallel); this buffer gives them back in sampler
order (``in_order=True``) or as they finish. It never blocks the engine: the engine only starts
a batch when it holds a permit, and the consumer returns a permit with every batch it takes, so
at most ``permits`` batches exist between the sampler and the training loop.
"""

from __future__ import annotations

import threading
import time

SKIP = object()
"""A sequence number that yields no batch (an IterableDataset worker that ran out)."""


class EndOfEpoch(Exception):
    pass


class ReadyQueue:
    def __init__(self, in_order: bool):
        self._cond = threading.Condition()
        self._items: dict[int, object] = {}
        self._next = 0
        self._in_order = in_order
        self._total: int | None = None
        self._fatal: BaseException | None = None
        self.taken = 0

    def put(self, seq: int, item: object) -> None:
        with self._cond:
            self._items[seq] = item
            self._cond.notify_all()

    def finish(self, total: int) -> None:
        """No sequence number at or beyond ``total`` will come."""
        with self._cond:
            self._total = total
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """The engine broke: the consumer raises ``exc`` next (after nothing else)."""
        with self._cond:
            if self._fatal is None:
                self._fatal = exc
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def _pop(self):
        if self._in_order:
            while self._next in self._items:
                item = self._items.pop(self._next)
                self._next += 1
                if item is not SKIP:
                    return True, item
            return False, None
        while self._items:
            seq = min(self._items)
            item = self._items.pop(seq)
            self._next += 1
            if item is not SKIP:
                return True, item
        return False, None

    def _exhausted(self) -> bool:
        return self._total is not None and self._next >= self._total and not self._items

    def get(self, timeout: float | None = None, poll: float = 0.1):
        """The next item; raises :class:`EndOfEpoch`, the engine's fatal error, or
        ``TimeoutError`` after ``timeout`` seconds. Waits in short steps so that Ctrl-C
        reaches the caller promptly."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                found, item = self._pop()
                if found:
                    self.taken += 1
                    return item
                if self._fatal is not None:
                    raise self._fatal
                if self._exhausted():
                    raise EndOfEpoch
                wait = poll
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    wait = min(wait, left)
                self._cond.wait(wait)

    def drain(self) -> list:
        """Remove and return what is buffered (used when an epoch is abandoned)."""
        with self._cond:
            items = list(self._items.values())
            self._items.clear()
            return items
