"""Stage 2, reads: ``await dataset.read(i)`` on the engine's loop, at most ``io_concurrency`` at
once and each within ``read_timeout``; what ``dataset.read_nowait`` has at hand skips the loop."""

from __future__ import annotations

import asyncio
import time

from aioload._workers import wire as _wire
from aioload._engine.budget import where
from aioload._dataset import NOT_READY, Dataset
from aioload._errors import DataLoaderTimeoutError
from aioload._engine.spec import Ready


class ReadStage:
    """One epoch's reads. ``io`` (a :class:`~aioload._engine.limiter.Limiter`) bounds the reads in
    flight; each read says where it is in ``inflight.samples`` (for the stuck report);
    ``pickled``: what ``read`` returns goes to a worker process, so it must pickle."""

    def __init__(self, spec, stats, budget, io, inflight, *, pickled: bool):
        self.spec = spec
        self.stats = stats
        self.budget = budget
        self.io = io
        self.inflight = inflight
        self.pickled = pickled
        # The workers are sent bare indices (they pair them with None): a dataset without a
        # read stage is loaded by __getitem__, and one marked read_in_workers reads there.
        self.bare = not spec.split or spec.read_in_workers
        nowait = getattr(spec.dataset, "read_nowait", None)
        # None unless the dataset overrides read_nowait (the base class's has nothing at hand)
        self.nowait = None if getattr(nowait, "__func__", None) is Dataset.read_nowait else nowait

    def where(self, index) -> str:
        """`` (path)`` when the dataset's ``describe`` knows where ``index`` lives."""
        return where(self.spec.describe, index)

    async def _read(self, index):
        reading = self.inflight.samples
        reading[index] = f"waiting for a read slot (io_concurrency={self.spec.io_concurrency})"
        try:
            async with self.io:
                reading[index] = "read"
                self.stats.read_started()
                started = time.perf_counter()
                try:
                    raw = await self._read_within(index)
                except Exception as exc:
                    self.stats.read_done(time.perf_counter() - started, 0)
                    exc.add_note(f"while reading dataset index {index}{self.where(index)}")
                    raise
                self.stats.read_done(time.perf_counter() - started, raw_nbytes(raw))
                return raw
        finally:
            reading.pop(index, None)

    async def _read_within(self, index):
        return await read_within(self.spec.dataset, index, self.spec.read_timeout)

    async def items(self, indices) -> list:
        """``(index, raw)`` pairs; the indices themselves when the dataset has no read stage
        or its workers read (``bare``: the worker pairs them with ``None``; a plain list
        pickles at a third of the cost). With ``on_error="skip"`` failed reads are left out and
        recorded."""
        if self.bare:
            return indices
        results = self._read_nowait(indices)
        waiting = [i for i, r in zip(indices, results) if r is NOT_READY]
        if waiting:
            read = iter(await asyncio.gather(*(self._read(i) for i in waiting), return_exceptions=True))
            results = [next(read) if r is NOT_READY else r for r in results]
        items = []
        pickled = self.pickled
        for index, result in zip(indices, results):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError) or not isinstance(result, Exception):
                    raise result
                self.budget.failed([index], result)
                continue
            if pickled and (bad := _wire.unpicklable(result)) is not None:
                self.budget.failed([index], self._unpicklable(index, result, *bad))
                continue
            items.append((index, result))
        return items

    def _unpicklable(self, index, result, part, error: Exception) -> TypeError:
        what = f"a {_type_name(result)}"
        if part is not result:
            what += f" holding a {_type_name(part)}"
        exc = TypeError(
            f"dataset.read({index!r}) returned {what}, which cannot be pickled to reach a worker "
            f"process ({type(error).__name__}: {error}). read() runs in the loader's process and "
            "decode() in a worker: return bytes, numbers, strings, arrays or tensors from read(), "
            "and open files, locks or clients in decode()"
        )
        exc.__cause__ = error
        exc.add_note(f"while reading dataset index {index}{self.where(index)}")
        return exc

    def _read_nowait(self, indices) -> list:
        """What ``dataset.read_nowait`` has at hand for each index (``NOT_READY`` for the
        rest): a local file the worker will open needs no trip through the event loop."""
        nowait = self.nowait
        if nowait is None:
            return [NOT_READY] * len(indices)
        results = []
        for index in indices:
            try:
                raw = nowait(index)
            except Exception as exc:  # noqa: BLE001 - reported like a failed read
                exc.add_note(f"while reading dataset index {index}{self.where(index)}")
                raw = exc
            if raw is not NOT_READY:
                self.stats.read_started()
                self.stats.read_done(0.0, 0)
            results.append(raw)
        return results

    def batch_indices(self, indices) -> list:
        """The indices of one batch: a batch sampler's list (or tuple, or tensor), or, without
        automatic batching, the one index the sampler gave (which may itself be a list)."""
        return list(indices) if self.spec.auto_collation else [indices]

    async def read_only(self, indices) -> Ready:
        """``num_workers=0`` with a split dataset: the batch's reads, decoded by the consumer."""
        items = await self.items(self.batch_indices(indices))
        return Ready(batch=indices, samples=len(items), raw=items)


async def read_within(dataset, index, limit: float | None):
    """``await dataset.read(index)``, failing with :class:`DataLoaderTimeoutError` after
    ``limit`` seconds (``read_timeout``; ``None``: no limit). The engine's loop and a worker's
    both read through this."""
    if limit is None:
        return await dataset.read(index)
    try:
        async with asyncio.timeout(limit):
            return await dataset.read(index)
    except TimeoutError:
        raise DataLoaderTimeoutError(
            f"dataset.read({index!r}) did not return within read_timeout={limit} seconds; "
            "raise read_timeout if the storage is just slow, or use on_error='skip' to leave "
            "such samples out",
            stuck=[(index, "read")],
        ) from None


def raw_nbytes(raw) -> int:
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return len(raw)
    if isinstance(raw, tuple) and raw and isinstance(raw[0], (bytes, bytearray, memoryview)):
        return len(raw[0])
    return 0


def _type_name(value) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
