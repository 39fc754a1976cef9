"""Sampling: which indices an epoch visits, in which order, on which rank, and where a resumed
epoch picks up.

* :class:`ShardSampler` splits a map-style dataset between the ranks of ``torch.distributed``
  the way ``DistributedSampler`` does (equal lengths by padding or dropping the tail), with the
  order seeded by ``(seed, epoch)`` so that every rank agrees on it.
* :class:`Planner` turns the torch loader's samplers into one epoch's :class:`Plan` of numbered
  index batches, skipping those a saved state says were already delivered, and writes and
  checks that state (``loader.state_dict()``; the format lives in :mod:`aioload._resume`).
"""

from __future__ import annotations

import copy
import itertools
import math
import threading
from collections import deque
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, Sampler

from aioload import _resume
from aioload._ready import Delivered
from aioload._seeding import derive_seed, draw_base_seed
from aioload._spec import Plan


def distributed_rank() -> tuple[int, int] | None:
    """``(rank, world_size)`` when ``torch.distributed`` is initialised, else ``None``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


class ShardSampler(Sampler[int]):
    """This rank's share of ``range(length)``: ``DistributedSampler``'s split, seeded like aioload.

    The epoch's order (``randperm`` from a generator seeded with ``derive_seed(seed, epoch)``,
    or ``range`` without shuffling) is padded by repeating its head (or cut, with
    ``drop_last``) to a multiple of ``world_size``; rank ``r`` takes every ``world_size``-th
    index from ``r``. With one rank the order is that of an unsharded loader with ``seed=``.
    """

    def __init__(self, length: int, rank: int, world_size: int, *, shuffle: bool, drop_last: bool, seed: int):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        self.length = length
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0
        if drop_last:
            self.num_samples = length // world_size
        else:
            self.num_samples = math.ceil(length / world_size)
        self.total_size = self.num_samples * world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(derive_seed(self.seed, self.epoch))
            order = torch.randperm(self.length, generator=generator).tolist()
        else:
            order = list(range(self.length))
        if len(order) < self.total_size:
            order += (order * math.ceil(self.total_size / max(1, len(order))))[: self.total_size - len(order)]
        return iter(order[self.rank : self.total_size : self.world_size])

    def __repr__(self) -> str:
        return (f"ShardSampler(rank={self.rank}, world_size={self.world_size}, shuffle={self.shuffle}, "
                f"drop_last={self.drop_last}, seed={self.seed})")


def shard_sampler(shard: bool, dataset, sampler, batch_sampler, shuffle, drop_last: bool,
                  seed: int | None) -> ShardSampler | None:
    """The sampler that shards ``dataset`` between ranks, or ``None`` where no sharding applies:
    ``shard=False``, a sampler or batch sampler of the user's, an ``IterableDataset`` (which
    shards itself), or ``torch.distributed`` not initialised."""
    if not isinstance(shard, bool):
        raise TypeError(f"shard must be True or False, got {shard!r}")
    if not shard or sampler is not None or batch_sampler is not None:
        return None
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    ranks = distributed_rank()
    if ranks is None:
        return None
    rank, world_size = ranks
    return ShardSampler(len(dataset), rank, world_size, shuffle=bool(shuffle), drop_last=drop_last,
                        seed=0 if seed is None else seed)


class _Numbered:
    """The epoch's ``(seq, indices)`` pairs, minus those delivered before a resume.

    With ``record=True`` (samplers aioload cannot replay) it keeps the batches handed to the
    engine until they are delivered, and :meth:`remaining` can write out everything not yet
    delivered. The engine pulls from its own thread, hence the lock.
    """

    def __init__(self, pairs: Iterator, skip: Delivered, delivered: Delivered, record: bool, limit: int | None):
        self._pairs = pairs
        self._skip = skip
        self._delivered = delivered
        self._record = record
        self._limit = limit
        self._buffer: deque = deque()
        self._pulled: dict[int, Any] = {}
        self._lock = threading.Lock()

    def __iter__(self) -> "_Numbered":
        return self

    def __next__(self):
        with self._lock:
            while True:
                seq, indices = self._buffer.popleft() if self._buffer else next(self._pairs)
                if seq not in self._skip:
                    break
            if self._record:
                for old in [s for s in self._pulled if s in self._delivered]:
                    del self._pulled[old]
                self._pulled[seq] = indices
            return seq, indices

    def remaining(self) -> list:
        """Every ``(seq, indices)`` not yet delivered, in order; the engine goes on pulling
        the same batches from a buffer."""
        with self._lock:
            if self._limit is None:
                raise _resume.ResumeError(
                    "exact resume is impossible: this sampler cannot be replayed and has no len(), "
                    "so its remaining indices cannot be written out; give the sampler a __len__ "
                    "or use one of torch's samplers with seed="
                )
            self._buffer.extend(itertools.islice(self._pairs, max(0, self._limit + 1 - len(self._buffer))))
            if len(self._buffer) > self._limit:
                raise _resume.ResumeError(
                    f"exact resume is impossible: the sampler yields more than its len() of "
                    f"{self._limit} batches, so its remaining indices cannot be written out"
                )
            rest = [pair for pair in self._buffer if pair[0] not in self._skip]
            pending = [(s, b) for s, b in sorted(self._pulled.items()) if s not in self._delivered]
            return pending + rest


class EpochProgress:
    """What ``state_dict()`` needs about the epoch in progress."""

    def __init__(self, epoch: int, base_seed: int, rng: dict, delivered: Delivered,
                 batches: _Numbered | None, replayable: bool, iterable: bool):
        self.epoch = epoch
        self.base_seed = base_seed
        self.rng = rng
        self.delivered = delivered
        self.batches = batches
        self.replayable = replayable
        self.iterable = iterable


class Planner:
    """Makes each epoch's plan from the torch loader's samplers; saves and checks resume state."""

    def __init__(self, torch_loader, seed: int | None, seed_generator: torch.Generator | None, iterable: bool):
        self.torch = torch_loader
        self.seed = seed
        self.seed_generator = seed_generator
        self.iterable = iterable
        self._kept_base: tuple[int, int] | None = None  # (epoch, base seed) drawn for persistent workers

    # -- the plan -------------------------------------------------------------------------
    def plan(self, epoch: int, resume: dict | None, per_sample_seeds: bool,
             lazy: bool = False) -> tuple[Plan, EpochProgress]:
        """Epoch ``epoch``'s plan. ``resume`` (from :meth:`load`) replays a saved epoch: the
        generators get back their state at its start and delivered batches are skipped.
        ``lazy``: the caller's thread pulls every batch itself (torch's single-process loading,
        whose sampler first draws at the first ``next()``), so none is pulled here."""
        t = self.torch
        self._forward_epoch(epoch)
        if self.seed is not None:
            self.seed_generator.manual_seed(derive_seed(self.seed, epoch))
        generators = self.generators()
        saved = resume["rng"] if resume is not None else {}
        progress = resume.get("progress") if resume is not None else None
        with _resume.restored(saved, generators):
            start = _resume.snapshot(generators)
            if self.iterable:
                base = self._base_seed(epoch, progress)
                pairs = iter(())
            elif progress is not None and progress["batches"] is not None:
                base = self._base_seed(epoch, progress)
                pairs = iter(progress["batches"])
            else:
                sampler_iter = iter(t._index_sampler)
                base = self._base_seed(epoch, progress)
                # Pull the first batch here: a sampler that draws from the global RNG does so
                # in the caller's thread, in the order torch's DataLoader draws (a resumed
                # epoch draws inside this block, from the saved state).
                first = [] if lazy and not saved else list(itertools.islice(sampler_iter, 1))
                pairs = enumerate(itertools.chain(first, sampler_iter))
        if progress is not None:
            if progress["base_seed"] != base and progress["batches"] is None:
                raise _resume.ResumeError(
                    "this state does not replay: its epoch drew different seeds from this loader's "
                    "generator; load it into a loader built with the same generator seed, sampler and dataset"
                )
            base = progress["base_seed"]
            skip = Delivered(progress["delivered"]["below"], progress["delivered"]["also"])
        else:
            skip = Delivered()
        delivered = skip.copy()
        replayable = _replayable(t._index_sampler) and not (progress is not None and progress["batches"] is not None)
        numbered = _Numbered(pairs, skip, delivered, record=not replayable and not self.iterable,
                             limit=_len_or_none(t._index_sampler))
        plan = Plan(batches=numbered, base_seed=base, per_sample_seeds=per_sample_seeds, delivered=delivered)
        return plan, EpochProgress(epoch, base, start, delivered, numbered, replayable, self.iterable)

    def _forward_epoch(self, epoch: int) -> None:
        t = self.torch
        for target in (t.sampler, getattr(t.batch_sampler, "sampler", None)):
            if target is not None and hasattr(target, "set_epoch"):
                target.set_epoch(epoch)
                break

    def _base_seed(self, epoch: int, progress: dict | None = None) -> int:
        if self.seed is not None:
            return derive_seed(self.seed, epoch, 1)
        t = self.torch
        if t.persistent_workers and t.num_workers > 0:
            # torch draws the base seed once for persistent workers (it reuses their iterator);
            # later epochs derive theirs from it and draw nothing from the generator.
            if self._kept_base is None:
                self._kept_base = (epoch, self._first_kept_base(progress))
            first, base = self._kept_base
            return base if epoch == first else derive_seed(base, epoch)
        return draw_base_seed(t.generator)

    def _first_kept_base(self, progress: dict | None) -> int:
        """The base seed persistent workers keep. A resumed epoch that was not the first of
        its run drew none: the draw is taken back and the saved base seed kept."""
        gen = self.torch.generator
        state = gen.get_state() if gen is not None else torch.get_rng_state()
        base = draw_base_seed(gen)
        if progress is None or base == progress["base_seed"]:
            return base
        if gen is not None:
            gen.set_state(state)
        else:
            torch.set_rng_state(state)
        return progress["base_seed"]

    def generators(self) -> dict[str, torch.Generator | None]:
        """The generators an epoch's plan draws from, by role (``None``: torch's global RNG).
        With ``seed=`` the loader's own generator is reseeded every epoch and needs no saving."""
        found: dict[str, torch.Generator | None] = {}
        if self.seed is None:
            found["loader"] = self.torch.generator
        inner = _inner_sampler(self.torch._index_sampler)
        if type(inner) in _RANDOM_SAMPLERS:
            gen = inner.generator
            if gen is not self.seed_generator and not any(gen is g for g in found.values()):
                found["sampler"] = gen
        return found

    # -- state ------------------------------------------------------------------------------
    def config(self) -> dict:
        t = self.torch
        if self.seed is not None:
            base_seeds = "from seed"
        elif t.persistent_workers and t.num_workers > 0:
            base_seeds = "drawn once (persistent workers)"
        else:
            base_seeds = "drawn every epoch"
        return _resume.config(t, self.seed, self.generators(), base_seeds)

    def state_dict(self, next_epoch: int, progress: EpochProgress | None) -> dict:
        if progress is None or progress.delivered.complete:
            # Between epochs: the next one starts from the generators as they are now
            # (torch's global RNG excepted: that one is the training script's to save).
            gens = {role: g for role, g in self.generators().items() if g is not None}
            return _resume.pack(next_epoch, self.config(), _resume.snapshot(gens), None, self._kept_base)
        if progress.iterable:
            raise _resume.ResumeError(
                "exact resume of an IterableDataset in the middle of an epoch is impossible: aioload "
                "cannot know how far each worker's copy has read; save the state between epochs "
                "(after the loop ends), or use a map-style dataset"
            )
        batches = None if progress.replayable else progress.batches.remaining()
        return _resume.pack(progress.epoch, self.config(), progress.rng,
                            _resume.progress(progress.base_seed, progress.delivered, batches), self._kept_base)

    def load(self, state: dict) -> dict:
        """Check ``state`` against this loader; returns what :meth:`plan` resumes from."""
        resume = _resume.unpack(state, self.config())
        resume["saved"] = copy.deepcopy(state)
        kept = resume["kept_base"]
        if kept is not None and resume["progress"] is not None and kept[0] == resume["epoch"]:
            kept = None  # the replayed epoch draws it again, as the saved run did
        self._kept_base = kept
        return resume

    def resume_state(self, resume: dict) -> dict:
        """The state of a loader that loaded ``resume`` and has not iterated since."""
        return copy.deepcopy(resume["saved"])


_RANDOM_SAMPLERS = (
    torch.utils.data.RandomSampler,
    torch.utils.data.SubsetRandomSampler,
    torch.utils.data.WeightedRandomSampler,
)
_FIXED_SAMPLERS = (
    torch.utils.data.SequentialSampler,
    torch.utils.data.distributed.DistributedSampler,
    ShardSampler,
)


def _inner_sampler(index_sampler):
    if type(index_sampler) is BatchSampler:
        return index_sampler.sampler
    return index_sampler


def _replayable(index_sampler) -> bool:
    """Whether the epoch's order is a function of the generator states aioload saves: torch's
    own samplers and :class:`ShardSampler` (exact types: a subclass may draw elsewhere)."""
    return type(_inner_sampler(index_sampler)) in _RANDOM_SAMPLERS + _FIXED_SAMPLERS


def _len_or_none(index_sampler) -> int | None:
    try:
        return len(index_sampler)
    except TypeError:
        return None
