"""Where a stuck epoch is held up: the samples of its oldest unfinished batch and the stage each
one is in (a read, a queue, a worker), put in words for the ``timeout=`` error.

The stages write what is in flight into one :class:`InFlight`; :class:`StuckReport` only reads
it (and the pool's progress cells), on the engine's loop, when the consumer has waited too long.
"""

from __future__ import annotations

from typing import Any, Callable

from aioload._engine.budget import where
from aioload._engine.spec import Mode, Reads
from aioload._workers import stacks as _stacks
from aioload._workers.worker import COLLATING


class InFlight:
    """What the epoch's stages are working on, for the stuck report. Written on the engine's
    loop only: the sampler stage (and the IterableDataset stage) open and close batches, the
    read stage (and an executor) say where each sample is."""

    __slots__ = ("batches", "samples")

    def __init__(self):
        # seq -> the batch's dataset indices: started, not yet handed to the ready queue
        self.batches: dict[int, list] = {}
        # dataset index -> its stage while it is not in a worker: "read", "waiting for a read
        # slot (...)", or the executor it was sent to
        self.samples: dict[Any, str] = {}


class StuckReport:
    """Where the oldest open batch of an epoch is held up. ``pool`` and ``session`` are
    ``None`` for an epoch without workers (``num_workers=0``, ``executor=``)."""

    def __init__(self, spec, pool, session, inflight: InFlight):
        self.spec = spec
        self.pool = pool
        self.session = session
        self.inflight = inflight
        # worker id -> pid of each worker that :meth:`where` found holding a sample (written
        # on the engine's loop, read by the thread that asked, after its answer)
        self.held: dict[int, int] = {}

    def where(self) -> list[tuple[Any, str]]:
        """``(index, stage)`` pairs for the oldest open batch (``index`` ``None`` when the
        stage holds the whole batch). On the engine's loop."""
        self.held = {}
        batches = self.inflight.batches
        if not batches:
            return []
        seq = min(batches)
        reading = self.inflight.samples
        stuck = [(i, reading[i]) for i in batches[seq] if i in reading]
        if self.session is not None:
            for indices, wid, task_id in self.session.requests_for(seq):
                stuck += self._in_worker(indices, wid)
        return list(dict.fromkeys(stuck))

    def _in_worker(self, indices: list, wid: int | None) -> list[tuple[Any, str]]:
        """Where a task of the awaited batch is: queued, or in a worker on a known sample
        (possibly of an earlier task that the worker is stuck on)."""
        if wid is None:
            ready = sum(self.pool.ready)
            waiting = ("waiting for a free worker" if ready == len(self.pool.ready) else
                       f"waiting for the workers to start ({ready} of {len(self.pool.ready)} ready)")
            return [(i, waiting) for i in indices] or [(None, waiting)]
        pid = self.pool.procs[wid].pid
        self.held[wid] = pid
        place = f"worker {wid} (pid {pid})"
        task_id, index = self.pool.current(wid)
        stage = self.stage()
        if task_id in self.session.tasks_of(wid):
            if index == COLLATING:
                return [(None, f"collate_fn in {place}")]
            if index >= 0:
                return [(index, f"{stage} in {place}")]
        return [(i, f"{stage} in {place}") for i in indices] or [(None, f"{stage} in {place}")]

    def stage(self) -> str:
        """What a worker does with a sample of this epoch."""
        if self.spec.mode is Mode.ITER:
            return "__iter__"
        if self.spec.reads is Reads.NONE:
            return "__getitem__"
        return "read or decode" if self.spec.reads is Reads.WORKERS else "decode"

    def describe(self, stuck: list[tuple[Any, str]]) -> str:
        return describe_stuck(stuck, self.spec.describe)

    def stacks(self) -> str:
        """Every thread's Python stack of each worker that :meth:`where` found holding a
        sample, one block per worker; ``""`` when none did. Blocking (about a tenth of a
        second per worker): from the consumer's thread, never the engine's loop."""
        return "".join(f"\n\nworker {wid} (pid {pid}), every thread's stack, most recent call first:\n"
                       f"{_stacks.take(pid)}" for wid, pid in sorted(self.held.items()))


def describe_stuck(stuck: list[tuple[Any, str]], describe: Callable[[Any], str] | None) -> str:
    """``stuck`` in words, one clause per stage; a lone sample gets its path or URL (from the
    dataset's ``describe``)."""
    stages: dict[str, list] = {}
    for index, stage in stuck:
        stages.setdefault(stage, []).append(index)
    parts = []
    for stage, indices in stages.items():
        known = [i for i in indices if i is not None]
        if not known:
            subject, verb = "the batch", "is"
        elif len(known) == 1:
            subject, verb = f"dataset index {known[0]}{where(describe, known[0])}", "is"
        else:
            subject, verb = f"dataset indices {known}", "are"
        parts.append(f"{subject} {verb} {'' if stage.startswith('waiting') else 'stuck in '}{stage}")
    return "; ".join(parts)
