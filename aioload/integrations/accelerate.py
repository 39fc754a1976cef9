"""Hugging Face Accelerate's epoch-end hooks for an ``aioload.DataLoader``.

``accelerator.prepare()`` rebuilds instances of torch's DataLoader as its own ``DataLoaderShard``
and hands anything else back as it is, so an aioload loader passed through it trains, but
Accelerate never learns where an epoch ends: ``gradient_state.end_of_dataloader`` stays False,
``accumulate()`` does not step the optimiser on an epoch's last batches, and
``gather_for_metrics`` cannot drop the samples repeated to even out the ranks' shards.
:func:`prepare` gives the loader those hooks::

    from aioload.integrations.accelerate import prepare

    accelerator = Accelerator(gradient_accumulation_steps=4)
    loader = prepare(accelerator, aioload.DataLoader(dataset, batch_size=32, shuffle=True, seed=0))
    model, optimizer = accelerator.prepare(model, optimizer)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            with accelerator.accumulate(model): ...

It also registers the loader for ``accelerator.save_state()``/``load_state()``: a resumed run
continues on every rank at the batch where the saved one stopped, with no batches to skip,
also on another number of processes (the rest of the epoch is dealt over them, and
``end_of_dataloader`` comes with its last batch there). Over an ``IterableDataset`` each rank's
position is its own: the saved state holds every rank's and resumes on as many processes.
``accelerator.skip_first_batches`` would rebuild the loader as a torch DataLoader; use this
module's :func:`skip_first_batches` where skipping is still wanted.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

import torch
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState

from aioload._plan.resume import ResumeError

__all__ = ["PreparedLoader", "padded_remainder", "prepare", "skip_first_batches"]


class PreparedLoader(DataLoaderStateMixin):
    """An aioload loader that tells Accelerate's ``GradientState`` where each epoch ends.

    While it is iterated it is the gradient state's active loader (accelerate's own
    ``DataLoaderStateMixin.begin``/``end``); ``end_of_dataloader`` turns True with the epoch's
    last batch, found from ``len(loader)`` and the batches already delivered (a resumed epoch
    counts those of the saved run). A loader without a length (an ``IterableDataset``) is read
    one batch ahead instead. ``remainder`` is the number of real samples in the last batch
    gathered over the ranks, where the shards were padded with repeated samples and those
    repeats are the tail of that gathered batch (always with two ranks), else ``-1``.

    Everything else (``len()``, ``set_epoch``, ``dataset``, ``batch_size``, ``stats()``, any
    attribute but ``batch_sampler``) is the loader's; ``state_dict()`` is the loader's state and
    the count of batches delivered in the epoch in progress. ``batch_sampler`` is refused, so
    that ``accelerator.skip_first_batches`` fails instead of rebuilding the loader as torch's.
    """

    def __init__(self, loader, accelerator=None):
        self.loader = loader
        self.gradient_state = accelerator.gradient_state if accelerator is not None else GradientState()
        self._num_processes = accelerator.num_processes if accelerator is not None else 1
        self._delivered = 0  # batches of the epoch in progress handed to the training loop
        self._resume_at: tuple[Any, int] | None = None  # (epoch, delivered) of a loaded state
        # Read one batch ahead (no len()), the loader has delivered a batch the training loop
        # has not received yet: its state as of the batch the loop has, else None.
        self._held_back: dict | None = None

    # -- the loader's own surface ---------------------------------------------------------
    def __getattr__(self, name: str):
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        if name == "batch_sampler":
            # What accelerate's skip_first_batches rebuilds a torch DataLoader from.
            raise AttributeError(
                "a prepared aioload loader has no batch_sampler: to skip batches use "
                "aioload.integrations.accelerate.skip_first_batches(loader, n), not "
                "accelerator.skip_first_batches (which would load them with a torch DataLoader); "
                "the aioload loader's own is loader.loader.batch_sampler"
            )
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)
        if self._resume_at is not None and self._resume_at[0] != epoch:
            self._resume_at = None  # another epoch than the loaded one: it starts afresh

    def state_dict(self) -> dict:
        """The loader's state and the batches of the epoch in progress delivered. Over an
        ``IterableDataset`` under ``torch.distributed``, where each rank's position in its own
        stream is its own, ``ranks`` also holds every rank's (gathered here: a collective, which
        ``save_state`` calls on every process), since Accelerate writes what rank 0 returns."""
        loader_state = self._held_back if self._held_back is not None else self.loader.state_dict()
        state = {"loader": loader_state, "delivered": self._delivered}
        world = _stream_world(self.loader)
        if world > 1:
            ranks: list = [None] * world
            torch.distributed.all_gather_object(ranks, state)
            state = dict(state, ranks=ranks)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`'s output. ``delivered`` must be where the loader's own
        state resumes (checked here, with a :class:`ResumeError` naming it); a loader state
        that can only restart its epoch (it warns ``ResumeWarning``) restarts this count too,
        so that ``end_of_dataloader`` comes with the epoch's real last batch."""
        if not isinstance(state, dict) or set(state) - {"ranks"} != {"loader", "delivered"}:
            raise ResumeError(
                "not the state of a prepared loader: pass what PreparedLoader.state_dict() returned "
                "(a bare loader's own state goes to loader.loader.load_state_dict)"
            )
        if "ranks" in state:
            state = _own_rank(state["ranks"])
        # A state saved on another number of ranks counts that world's batches (elastic resume:
        # the rest of the epoch is dealt again here); it is checked against its loader state.
        same_world = _saved_world(state["loader"]) in (None, self._num_processes)
        delivered = _check_delivered(state["delivered"], _length(self.loader) if same_world else None)
        at = _resumes_after(state["loader"], isinstance(self.loader.dataset, torch.utils.data.IterableDataset))
        if isinstance(at, int) and at != delivered:
            raise ResumeError(
                f"cannot load this state: delivered is {delivered}, but its loader state resumes the epoch after "
                f"{at} batches; pass what PreparedLoader.state_dict() returned"
            )
        self.loader.load_state_dict(state["loader"])
        if at is None:  # the loader restarts the epoch (or its state left the position unknown)
            delivered = 0
        self._resume_at = (state["loader"].get("epoch"), delivered)
        self._delivered = delivered

    # -- one epoch --------------------------------------------------------------------------
    def __iter__(self) -> Iterator:
        total = _length(self.loader)
        start = 0
        if self._resume_at is not None:
            start = self._resume_at[1]
            position = getattr(self.loader, "_epoch_position", None)
            if callable(position) and total is not None:
                start, total = position()  # the loaded epoch as it resumes on this world
        self._resume_at = None
        self._delivered = start
        self._held_back = None
        self.begin()  # resets end_of_dataloader, makes this the gradient state's active loader
        self.remainder = self._padded_remainder()
        try:
            batches = iter(self.loader)
            if total is None:
                yield from self._read_ahead(batches)
            else:
                for batch in batches:
                    self._delivered += 1
                    self.end_of_dataloader = self._delivered >= total
                    yield batch
            self._delivered = 0  # the epoch ran to its end
            self._held_back = None
        finally:
            self.end()

    def _read_ahead(self, batches: Iterator) -> Iterator:
        """Hold one batch back to know that the one before it was the last. The loader's state
        is taken with each batch, before the next is read: a checkpoint saved while the
        training loop holds a batch resumes after that batch, not after the one read ahead."""
        try:
            held = next(batches)
        except StopIteration:
            return
        held_state = self.loader.state_dict()
        for batch in batches:
            self._delivered += 1
            self._held_back = held_state
            yield held
            held, held_state = batch, self.loader.state_dict()
        self._delivered += 1
        self.end_of_dataloader = True
        self._held_back = held_state
        yield held

    def _padded_remainder(self) -> int:
        """What ``gather_for_metrics`` keeps of the last batch gathered over the ranks."""
        sampler = getattr(self.loader, "sampler", None)
        try:
            length = len(self.loader.dataset)
        except TypeError:
            return -1
        return padded_remainder(length, self._num_processes, self.loader.batch_size or 1, self.loader.drop_last,
                                getattr(sampler, "num_samples", None), getattr(sampler, "total_size", None))


def padded_remainder(length: int, world: int, batch_size: int, drop_last: bool,
                     per_rank: int | None, total_size: int | None) -> int:
    """Accelerate's ``remainder`` for an epoch split like ``DistributedSampler`` does: each of
    ``world`` ranks takes ``per_rank`` of ``total_size`` positions, the last ``total_size -
    length`` of which repeat the first samples. Accelerate keeps the first ``remainder`` items
    of the last batch gathered over the ranks (0: all of them); ``-1`` where no such cut drops
    exactly the repeats (or the split is not DistributedSampler's)."""
    if world == 1:
        return 0  # nothing padded
    if not isinstance(total_size, int) or not isinstance(per_rank, int) or total_size != per_rank * world:
        return -1  # not sharded like DistributedSampler: where repeats are is unknown
    padded = total_size - length
    last = per_rank % batch_size or batch_size  # samples in each rank's last batch
    if padded <= 0 or (drop_last and per_rank % batch_size):
        return 0  # no repeats, or they went with the dropped last batch
    # The repeats are the last sample of ranks world-padded .. world-1: the tail of the
    # gathered batch only if there is one of them or one sample per rank.
    if padded == 1 or last == 1:
        return world * last - padded
    return -1


def _check_delivered(delivered, total: int | None) -> int:
    if isinstance(delivered, bool) or not isinstance(delivered, int) or delivered < 0 or (
            total is not None and delivered > total):
        bound = "an int >= 0" if total is None else f"an int in [0, {total}] (an epoch has {total} batches)"
        raise ResumeError(f"cannot load this state: delivered must be {bound}, the batches of the epoch in progress "
                          f"the training loop received, got {delivered!r}; pass what PreparedLoader.state_dict() "
                          "returned")
    return delivered


_IN_PLACE = "in place"
"""What :func:`_resumes_after` says of an ``IterableDataset``'s state saved mid-epoch: it
resumes where it was saved, a position held as the items each worker's copy delivered (the
state's ``stateful`` entry), which is no count of batches to check ``delivered`` against."""


def _resumes_after(loader_state, iterable: bool) -> int | str | None:
    """How many batches of its epoch a loader state says were delivered: 0 between epochs,
    ``None`` where it restarts its epoch (``progress.inexact``) or cannot say (a malformed state,
    which the loader refuses with its own error), :data:`_IN_PLACE` mid-epoch over an
    ``IterableDataset`` (``iterable``)."""
    if not isinstance(loader_state, dict) or "progress" not in loader_state:
        return None
    progress = loader_state["progress"]
    if progress is None:
        return 0
    if not isinstance(progress, dict) or progress.get("inexact") is not None:
        return None
    if iterable:
        return _IN_PLACE
    delivered = progress.get("delivered")
    if not isinstance(delivered, dict):
        return None
    below, also = delivered.get("below"), delivered.get("also")
    if type(below) is not int or not isinstance(also, (list, tuple)):
        return None
    return below + len(also)


def _saved_world(loader_state) -> int | None:
    """The number of ranks a loader state was saved on (``None``: not said)."""
    config = loader_state.get("config") if isinstance(loader_state, dict) else None
    world = config.get("world_size") if isinstance(config, dict) else None
    return world if isinstance(world, int) and not isinstance(world, bool) else None


def _stream_world(loader) -> int:
    """The number of ranks whose positions a state must hold: the world size for a loader over
    an ``IterableDataset`` under ``torch.distributed`` (each rank reads a stream of its own),
    else 1 (the ranks of a map-style loader move in lockstep: rank 0's position is every rank's)."""
    from torch.utils.data import IterableDataset

    dist = torch.distributed
    if not isinstance(loader.dataset, IterableDataset) or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def _own_rank(ranks) -> dict:
    """This rank's entry of a state's ``ranks``, checked against the world it resumes in."""
    world = _stream_world_here()
    if not isinstance(ranks, (list, tuple)) or not all(isinstance(r, dict) and set(r) == {"loader", "delivered"}
                                                       for r in ranks):
        raise ResumeError("cannot load this state: ranks must be a list of every rank's {'loader', 'delivered'}; "
                          "pass what PreparedLoader.state_dict() returned")
    if len(ranks) != world:
        raise ResumeError(
            f"this state holds the positions of {len(ranks)} ranks' streams, but this job runs {world} "
            f"process{'es' if world > 1 else ''}: an IterableDataset's position is each rank's own (its share of "
            f"the stream), so it resumes on the same number of processes only; resume on {len(ranks)}"
        )
    return ranks[torch.distributed.get_rank() if world > 1 else 0]


def _stream_world_here() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _length(loader) -> int | None:
    """Batches in an epoch, or ``None`` where ``len()`` is not exact (an IterableDataset's)."""
    from torch.utils.data import IterableDataset

    if isinstance(loader.dataset, IterableDataset):
        return None
    try:
        return len(loader)
    except TypeError:
        return None


def prepare(accelerator, loader) -> PreparedLoader:
    """``loader`` with Accelerate's epoch-end hooks, registered for ``save_state``/``load_state``.

    Pass the model and optimiser to ``accelerator.prepare`` as usual, and the loader here
    instead: ``accelerator.prepare`` would hand an aioload loader back unchanged. The loader
    shards itself between the ranks (see docs/reproducibility.md), and ``device=`` puts
    batches where the model is (``device=accelerator.device``).
    """
    prepared = PreparedLoader(loader, accelerator)
    accelerator.register_for_checkpointing(prepared)
    return prepared


class _Skipped:
    """The rest of an epoch after its first ``count`` batches (see :func:`skip_first_batches`)."""

    def __init__(self, loader, count: int):
        self.loader = loader
        self.count = count

    def __getattr__(self, name: str):
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return max(0, len(self.loader) - self.count)

    def __iter__(self) -> Iterator:
        return itertools.islice(iter(self.loader), self.count, None)


def skip_first_batches(loader, num_batches: int = 0) -> _Skipped:
    """The next epoch of ``loader`` (an aioload loader or a :class:`PreparedLoader`) without its
    first ``num_batches`` batches, for the first epoch of a resumed run, as
    ``accelerator.skip_first_batches`` does for torch's loaders (which rebuilds anything else
    as a torch DataLoader). The skipped batches are still loaded: a loader registered by
    :func:`prepare` needs no skipping at all, since ``load_state`` puts it where it stopped.
    Do not skip after ``load_state`` restored the loader: that skips twice."""
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
        raise ValueError(f"num_batches must be an int >= 0, got {num_batches!r}")
    return _Skipped(loader, num_batches)

