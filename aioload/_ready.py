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


class Delivered:
    """Batch sequence numbers the consumer has received: every one below ``low``, and
    ``above``. Deliveries arrive nearly in order, so ``above`` holds at most about as many
    numbers as batches are in flight."""

    def __init__(self, low: int = 0, above=()):
        self.low = low
        self.above: set[int] = set()
        self.complete = False  # the consumer saw the end of the epoch
        for seq in above:
            self.add(seq)

    def add(self, seq: int) -> None:
        if seq < self.low:
            return
        self.above.add(seq)
        while self.low in self.above:
            self.above.remove(self.low)
            self.low += 1

    def __contains__(self, seq: int) -> bool:
        return seq < self.low or seq in self.above

    def __len__(self) -> int:
        return self.low + len(self.above)

    def copy(self) -> "Delivered":
        return Delivered(self.low, tuple(self.above))


class ReadyQueue:
    def __init__(self, in_order: bool, delivered: Delivered | None = None):
        self._cond = threading.Condition()
        self._items: dict[int, object] = {}
        self._next = 0
        self._in_order = in_order
        self.delivered = delivered if delivered is not None else Delivered()
        self._total: int | None = None
        self._fatal: BaseException | None = None
        self._listeners: list = []
        self.taken = 0

    def _notify(self) -> None:
        """Wake blocked threads and async waiters (call with the lock held)."""
        self._cond.notify_all()
        listeners, self._listeners = self._listeners, []
        for wake in listeners:
            wake()

    def when_ready(self, wake) -> bool:
        """Call ``wake()`` (from the engine's thread) once something changes; ``False`` if
        something can already be taken, in which case ``wake`` is not kept."""
        with self._cond:
            if self._can_take():
                return False
            self._listeners.append(wake)
            return True

    def _can_take(self) -> bool:
        """Whether :meth:`get_nowait` would return or raise rather than find nothing. In
        order, a later batch that is ready does not count: the awaited one may be stuck."""
        if self._fatal is not None or self._total is not None:
            return True  # the engine has put everything it will put
        if not self._in_order:
            return bool(self._items)
        seq = self._next
        while seq in self.delivered:
            seq += 1
        return seq in self._items

    def put(self, seq: int, item: object) -> None:
        with self._cond:
            self._items[seq] = item
            self._notify()

    def finish(self, total: int) -> None:
        """No sequence number at or beyond ``total`` will come."""
        with self._cond:
            self._total = total
            self._notify()

    def fail(self, exc: BaseException) -> None:
        """The engine broke: the consumer raises ``exc`` next (after nothing else)."""
        with self._cond:
            if self._fatal is None:
                self._fatal = exc
            self._notify()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def _pop(self):
        delivered = self.delivered
        if self._in_order:
            while True:
                while self._next in delivered:  # a resumed epoch's earlier batches
                    self._next += 1
                if self._next not in self._items:
                    return False, None
                item = self._items.pop(self._next)
                delivered.add(self._next)
                if item is not SKIP:
                    return True, item
        while self._items:
            seq = min(self._items)
            item = self._items.pop(seq)
            delivered.add(seq)
            if item is not SKIP:
                return True, item
        return False, None

    def _exhausted(self) -> bool:
        return self._total is not None and self.delivered.low >= self._total and not self._items

    def _try(self):
        found, item = self._pop()
        if found:
            self.taken += 1
            return True, item
        if self._fatal is not None:
            raise self._fatal
        if self._exhausted():
            self.delivered.complete = True
            raise EndOfEpoch
        return False, None

    def get_nowait(self):
        """``(True, item)``, or ``(False, None)`` when nothing is ready yet; raises like
        :meth:`get`."""
        with self._cond:
            return self._try()

    def get(self, timeout: float | None = None, poll: float = 0.1):
        """The next item; raises :class:`EndOfEpoch`, the engine's fatal error, or
        ``TimeoutError`` after ``timeout`` seconds. Waits in short steps so that Ctrl-C
        reaches the caller promptly."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                found, item = self._try()
                if found:
                    return item
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
