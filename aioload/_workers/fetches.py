"""Window mode's shards fetched by the workers, so that the training process receives none.

A shard fetched on the loader's event loop costs the training process the receive itself: the
kernel copies each byte from the socket into the shard's memfd there, about 0.4 ms of its CPU
per MB (benchmarks/shards.py). With workers, the window (:mod:`aioload._shards.window`) still
decides everything in the training process -- which shard, when, when it is freed -- but asks
a worker to do the receiving:

* the pool sends :class:`~aioload._workers.messages.FetchShard` to the worker with the fewest
  fetches in flight (:meth:`aioload._workers.pool.PoolSession.fetch`);
* the worker's receiving thread starts the fetch on a loop of its own (:class:`ShardFetches`,
  a thread beside the one that decodes), which receives the shard straight into a memfd of the
  worker's making (``_storage.storage.read_into``);
* the worker sends the memfd on its control socket, then
  :class:`~aioload._workers.messages.Fetched`, and closes its own descriptor and mapping: the
  shard then lives in the training process alone, as one it had received itself
  (:func:`aioload._handoff.shared.adopt`), and goes to whichever worker decodes its samples as
  any shared bytes do.

The window finds this service in the context of the task it runs in (:func:`offer`,
:func:`offered`): the engine offers its pool session's ``fetch`` to the epoch's tasks when the
loader started its workers with ``fetch_shards`` (``WebDataset(window=k)`` behind a network,
``window_fetch="workers"``, the default). A loader without workers, or a dataset that asks
for it (``window_fetch="loader"``), receives on the loader's loop as before.

An epoch that ends early tells the workers to cancel their fetches
(:class:`~aioload._workers.messages.CancelReads`); each is answered all the same, and the
pool waits for those answers before the epoch's end, so a memfd is never left on a socket.
A late answer (the epoch gave up waiting) is read by the next epoch's session, whose ids never
repeat an earlier one's, and its memfd is closed.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Awaitable, Callable

from aioload._base.errors import pack_exception
from aioload._handoff.shared import Memory
from aioload._workers.messages import FetchShard
from aioload._workers.reads import WorkerLoop

NAME = "aioload-shard"
"""The memfds' name (as the window's own: leak checks look for it)."""

Fetch = Callable[[str, object], Awaitable[object]]
_offered: contextvars.ContextVar[Fetch | None] = contextvars.ContextVar("aioload_shard_fetch", default=None)


def offer(fetch: Fetch) -> None:
    """The epoch's tasks (those the calling task starts from now on, and their own) fetch
    shards with ``fetch(url, storage)``, a :class:`~aioload._handoff.shared.SharedBytes` of the
    whole shard. A context variable, not a registry: nothing outlives the epoch's tasks."""
    _offered.set(fetch)


def offered() -> Fetch | None:
    """The fetch offered to this task, else ``None`` (receive on this loop)."""
    return _offered.get()


class ShardFetches(WorkerLoop):
    """A worker's fetches, on an event loop of their own (a thread beside the one that decodes),
    started with the worker and closed with it. ``answer(fetch_id, size, memory, packed)``
    sends a fetch's end to the pool (from this loop's thread): the memfd (``memory``) first,
    then the message."""

    thread_name = "aioload-worker-fetch"

    def __init__(self, answer: Callable[[int, int, Memory | None, bytes | None], None]):
        self._answer = answer
        self._storages: dict[tuple, object] = {}  # storage_key -> the storage its fetches share
        self._tasks: set[asyncio.Task] = set()
        super().__init__()

    def start(self, msg: FetchShard) -> None:
        """Start ``msg``'s fetch (from the worker's receiving thread)."""
        self._loop.call_soon_threadsafe(self._begin, msg)

    def _begin(self, msg: FetchShard) -> None:
        task = self._loop.create_task(self._fetch(msg), name=f"aioload-worker-fetch-{msg.fetch_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fetch(self, msg: FetchShard) -> None:
        from aioload._storage.storage import read_into

        storage = self._storages.setdefault(msg.storage_key, msg.storage)
        made: list[Memory] = []

        def into(size: int) -> memoryview:
            for memory in made:  # a retry's: the failed attempt's memfd goes
                memory.close()
            made.clear()
            made.append(Memory(size, NAME))
            return memoryview(made[0].map)[:size]

        try:
            size = await read_into(storage, msg.url, into)
            self._answer(msg.fetch_id, size, made[0], None)
        except asyncio.CancelledError:
            self._answer(msg.fetch_id, -1, None, pack_exception(asyncio.CancelledError("the epoch ended")))
        except Exception as exc:  # noqa: BLE001 - the window reports it for each read of the shard
            self._answer(msg.fetch_id, -1, None, pack_exception(exc))
        finally:
            for memory in made:
                memory.close()

    def cancel(self) -> None:
        """Cancel every fetch in flight (each is still answered); from the receiving thread."""
        try:
            self._loop.call_soon_threadsafe(self._cancel_all)
        except RuntimeError:
            pass  # the loop is closed: nothing is in flight

    def _cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
