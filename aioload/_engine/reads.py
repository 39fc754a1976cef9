"""Stage 2, reads: ``await dataset.read(i)`` on the engine's loop, through the one read core
(:class:`aioload._data.reads.BatchReads`): ``read_nowait`` first, at most ``io_concurrency`` in flight,
each within ``read_timeout``, every step timed for the stall warning."""

from __future__ import annotations

from aioload._engine.budget import where
from aioload._engine.spec import Ready, Reads
from aioload._base.errors import BlockingReadWarning, a_kind
from aioload._data.reads import BatchReads, FailedRead, StallMeter, Watch, stall_message, unpicklable


class _EngineWatch(Watch):
    """Where each read is (for the stuck report) and the statistics of reads in flight."""

    __slots__ = ("samples", "stats", "slot")

    def __init__(self, inflight, stats, io_concurrency):
        self.samples = inflight.samples
        self.stats = stats
        self.slot = f"waiting for a read slot (io_concurrency={io_concurrency})"

    def at_hand(self, index) -> None:
        self.stats.read_started()
        self.stats.read_done(0.0, 0)

    def waiting(self, index) -> None:
        self.samples[index] = self.slot

    def started(self, index) -> None:
        self.samples[index] = "read"
        self.stats.read_started()

    def finished(self, index, seconds: float, nbytes: int) -> None:
        self.stats.read_done(seconds, nbytes)

    def ended(self, index) -> None:
        self.samples.pop(index, None)


class ReadStage:
    """One epoch's reads. ``io`` (a :class:`~aioload._data.limiter.Limiter`) bounds the reads in
    flight; each read says where it is in ``inflight.samples`` (for the stuck report);
    ``pickled``: what ``read`` returns goes to a worker process, so it must pickle."""

    def __init__(self, spec, stats, budget, io, inflight, *, pickled: bool):
        self.spec = spec
        self.stats = stats
        self.budget = budget
        self.io = io
        self.inflight = inflight
        self.pickled = pickled
        self.core = BatchReads(spec.dataset, bound=io, read_timeout=spec.read_timeout,
                               watch=_EngineWatch(inflight, stats, spec.io_concurrency), meter=StallMeter())

    def where(self, index) -> str:
        """`` (path)`` when the dataset's ``describe`` knows where ``index`` lives."""
        return where(self.spec.describe, index)

    async def items(self, indices) -> list:
        """``(index, raw)`` pairs; the indices themselves unless the reads run here
        (``Spec.reads``: without a read stage the worker pairs them with ``None``, and a worker
        that reads pairs them with what it read; a plain list pickles at a third of the
        cost). With ``on_error="skip"`` failed reads are left out and recorded."""
        if self.spec.reads is not Reads.ENGINE:
            return indices
        core = self.core
        results, _, _ = await core.read(indices)
        stall = core.meter.take()
        if stall is not None:
            self.stats.read_stalled(BlockingReadWarning(stall_message(stall, self.spec.dataset,
                                                                      "on the loader's event loop")))
        items = []
        pickled = self.pickled
        for index, result in zip(indices, results):
            if isinstance(result, FailedRead):
                self.budget.failed([index], result.error)
                continue
            if pickled and (bad := unpicklable(result)) is not None:
                self.budget.failed([index], self._unpicklable(index, result, *bad))
                continue
            items.append((index, result))
        return items

    def _unpicklable(self, index, result, part, error: Exception) -> TypeError:
        what = a_kind(_type_name(result))
        if part is not result:
            what += f" holding {a_kind(_type_name(part))}"
        exc = TypeError(
            f"dataset.read({index!r}) returned {what}, which cannot be pickled to reach a worker "
            f"process ({type(error).__name__}: {error}). read() runs in the loader's process and "
            "decode() in a worker: return bytes, numbers, strings, arrays or tensors from read(), "
            "and open files, locks or clients in decode()"
        )
        exc.__cause__ = error
        exc.add_note(f"while reading dataset index {index}{self.where(index)}")
        return exc

    async def read_only(self, indices) -> Ready:
        """``num_workers=0`` with a split dataset: the batch's reads, decoded by the consumer."""
        items = await self.items(self.spec.batch_indices(indices))
        return Ready(batch=indices, samples=len(items), raw=items)


def _type_name(value) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
