"""``on_error``: what a failed sample does to the epoch.

With ``on_error="raise"`` (the default, torch's behaviour) the error reaches the consumer in
place of the batch that held the sample. With ``on_error="skip"`` the sample is left out of
its batch, logged on the ``"aioload"`` logger and recorded in ``loader.stats().skipped``; the
batch is delivered short (a batch whose every sample failed is not delivered at all).
``max_errors`` bounds the skips of one epoch: a count, or a float fraction of the epoch's
samples. One skip past the bound ends the epoch with :class:`TooManyErrorsError`.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Callable

from torch.utils.data import BatchSampler

from aioload._base.errors import SKIP_HINT, TooManyErrorsError, forget_locals, where

logger = logging.getLogger("aioload")

ON_ERROR = ("raise", "skip")


def check_max_errors(max_errors, on_error: str) -> None:
    """Validate ``max_errors`` against ``on_error`` at construction."""
    if max_errors is None:
        return
    if isinstance(max_errors, bool) or not isinstance(max_errors, (int, float)):
        raise TypeError(
            "max_errors must be None, an int >= 0 (a count of samples) or a float between 0 and 1 "
            f"(a fraction of the epoch), got {max_errors!r}"
        )
    if isinstance(max_errors, int) and max_errors < 0:
        raise ValueError(f"max_errors must be >= 0 when it is a count, got {max_errors}")
    if isinstance(max_errors, float) and not 0.0 < max_errors < 1.0:
        raise ValueError(
            f"max_errors must be between 0 and 1 when it is a fraction of the epoch, got {max_errors}; "
            "pass an int to give a count"
        )
    if on_error != "skip":
        raise ValueError(
            f"max_errors={max_errors!r} bounds skipped samples, which needs on_error='skip' "
            f"(got on_error={on_error!r})"
        )


def epoch_samples(torch_loader) -> int | None:
    """How many samples one epoch asks for (the base of a fractional ``max_errors``)."""
    try:
        if torch_loader._auto_collation:
            batches = torch_loader.batch_sampler
            if isinstance(batches, BatchSampler) and not batches.drop_last:
                return len(batches.sampler)
            if isinstance(batches, BatchSampler):
                return len(batches) * batches.batch_size
            return len(torch_loader.dataset)
        return len(torch_loader.sampler)
    except TypeError:
        return None


class ErrorBudget:
    """One epoch's failed samples. Thread-safe: the engine thread and the consumer (decode
    with ``num_workers=0``) both report to it."""

    def __init__(self, on_error: str, max_errors: int | float | None, samples: int | None,
                 record: Callable[[list], None]):
        self.skip = on_error == "skip"
        self.max_errors = max_errors
        self.samples = samples
        if max_errors is None or (isinstance(max_errors, float) and samples is None):
            self.limit = None
        elif isinstance(max_errors, float):
            self.limit = math.floor(max_errors * samples)
        else:
            self.limit = max_errors
        self._record = record
        self._lock = threading.Lock()
        self.count = 0

    def failed(self, indices: list, exc: BaseException) -> None:
        """``indices`` failed with ``exc``: raise it (``on_error="raise"``), or record and log
        the skip, raising :class:`TooManyErrorsError` once the epoch is over its bound."""
        if not self.skip:
            raise exc
        with self._lock:
            self.count += len(indices)
            count = self.count
            self._record(indices)
        # A log handler may keep the record (and so the error) for long: the loader's frames
        # in its traceback must not keep batches or slots alive with it.
        forget_locals(exc)
        where = getattr(exc, "__notes__", None) or [""]
        logger.warning("on_error='skip': skipped dataset %s %s: %s: %s %s",
                       "index" if len(indices) == 1 else "indices",
                       indices[0] if len(indices) == 1 else indices, type(exc).__name__, str(exc), where[0])
        logger.debug("the skipped sample's error", exc_info=exc)
        if self.limit is not None and count > self.limit:
            raise TooManyErrorsError(self._too_many(count)) from exc

    def _too_many(self, count: int) -> str:
        bound = f"max_errors={self.max_errors!r}"
        if isinstance(self.max_errors, float):
            bound += f" ({self.limit} of this epoch's {self.samples} samples)"
        return (f"{count} samples failed this epoch, more than {bound} allows; the last failure "
                "is chained below. Fix or remove the failing samples, or raise max_errors.")


SAMPLE_STAGES = ("decode", "__getitem__")
"""The stages whose failure is one sample's, which ``on_error="skip"`` leaves out."""

SKIPPED = object()
"""What :func:`run_in_process` returns for a sample that failed and was skipped."""


class AllSkipped(Exception):
    """Every sample of a batch was skipped (``on_error="skip"``): the batch is not delivered.
    Raised where a batch is finished in the consumer's thread (``num_workers=0``, a GPU
    decode), caught by the iterator, which goes on to the next batch."""


def run_in_process(budget: ErrorBudget, describe, stage: str, indices: list, fn, *args):
    """Run ``fn(*args)``, one stage of the samples ``indices``, in this process (``num_workers=0``).

    A failure gets the same note a worker's would, then is raised or skipped by ``budget``;
    a skipped failure returns :data:`SKIPPED`."""
    try:
        return fn(*args)
    except Exception as exc:
        if len(indices) == 1:
            hint = "" if budget.skip or stage not in SAMPLE_STAGES else SKIP_HINT
            exc.add_note(f"while running {stage} for dataset index {indices[0]}{where(describe, indices[0])}{hint}")
        else:
            exc.add_note(f"while running {stage} for the batch of dataset indices {indices}")
        budget.failed(indices, exc)
        return SKIPPED

