"""Where a stuck epoch is held up: the samples of its oldest unfinished batch and the stage each
one is in (a read, a queue, a worker), asked of the engine's loop and put in words."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from aioload._worker import COLLATING


class StuckReport:
    """Where the epoch of :class:`~aioload._engine.Engine` is held up, for the ``timeout=`` error."""

    def outstanding(self, timeout: float = 1.0) -> list[tuple[Any, str]] | None:
        """Where the oldest unfinished batch is held up: ``(index, stage)`` pairs, asked of
        the engine's own loop. ``None`` when the loop does not answer within ``timeout``
        (something blocks it, such as a blocking call inside ``async def read``)."""
        loop = self._loop
        if loop is None or not self.running:
            return []
        answer: concurrent.futures.Future = concurrent.futures.Future()

        def ask() -> None:
            try:
                answer.set_result(self._outstanding())
            except BaseException as exc:  # noqa: BLE001 - reported to the asking thread
                answer.set_exception(exc)

        try:
            loop.call_soon_threadsafe(ask)
            return answer.result(timeout)
        except RuntimeError:
            return []  # the loop has already finished
        except concurrent.futures.TimeoutError:
            return None

    def _outstanding(self) -> list[tuple[Any, str]]:
        if not self._open:
            return []
        seq = min(self._open)
        stuck = [(i, self._reading[i]) for i in self._open[seq] if i in self._reading]
        if self._session is not None:
            for indices, wid, task_id in self._session.requests_for(seq):
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
        where = f"worker {wid} (pid {self.pool.procs[wid].pid})"
        task_id, index = self.pool.current(wid)
        if task_id in self._session.tasks_of(wid):
            if index == COLLATING:
                return [(None, f"collate_fn in {where}")]
            if index >= 0:
                return [(index, f"{self._stage()} in {where}")]
        return [(i, f"{self._stage()} in {where}") for i in indices] or [(None, f"{self._stage()} in {where}")]

    def _stage(self) -> str:
        if self.spec.mode == "iter":
            return "__iter__"
        return "decode" if self.spec.split else "__getitem__"

    def describe_stuck(self, stuck: list[tuple[Any, str]]) -> str:
        """``stuck`` in words, one clause per stage; a lone sample gets its path or URL."""
        stages: dict[str, list] = {}
        for index, stage in stuck:
            stages.setdefault(stage, []).append(index)
        parts = []
        for stage, indices in stages.items():
            known = [i for i in indices if i is not None]
            if not known:
                subject, verb = "the batch", "is"
            elif len(known) == 1:
                subject, verb = f"dataset index {known[0]}{self._where(known[0])}", "is"
            else:
                subject, verb = f"dataset indices {known}", "are"
            parts.append(f"{subject} {verb} {'' if stage.startswith('waiting') else 'stuck in '}{stage}")
        return "; ".join(parts)
