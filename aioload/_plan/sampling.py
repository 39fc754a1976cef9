"""Sampling: which indices an epoch visits, in which order, on which rank, and where a resumed
epoch picks up.

* :class:`ShardSampler` splits a map-style dataset between the ranks of ``torch.distributed``
  the way ``DistributedSampler`` does (equal lengths by padding or dropping the tail), with the
  order seeded by ``(seed, epoch)`` so that every rank agrees on it.
* :class:`ShardByRank`, a loader's default sampler, chooses between torch's own sampler and
  this rank's :class:`ShardSampler` each epoch, from ``torch.distributed`` as it is then.
* :class:`Planner` turns the torch loader's samplers into one epoch's :class:`Plan` of numbered
  index batches, skipping those a saved state says were already delivered, and writes and
  checks that state (``loader.state_dict()``; the format lives in :mod:`aioload._plan.resume`).
"""

from __future__ import annotations

import copy
import itertools
import threading
import warnings
from collections import deque
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler

from aioload._plan import resume as _resume
from aioload._plan import stateful as _stateful
from aioload._engine.ready import Delivered
from aioload._engine.spec import EndStreams, Plan
from aioload._plan.deal import Deal
from aioload._plan.elastic import Segment, TooManyPieces, rest_of_epoch, rest_runs
from aioload._mix.tally import SourceTally
from aioload._mix.weights import with_change
from aioload._plan.order import STRIDE, deal_of, epoch_order, has_own_order
from aioload._base.seeding import derive_seed, draw_base_seed


def distributed_rank() -> tuple[int, int] | None:
    """``(rank, world_size)`` when ``torch.distributed`` is initialised, else ``None``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


class ShardSampler(Sampler[int]):
    """This rank's share of an epoch's computed order: ``DistributedSampler``'s split, seeded like aioload.

    The epoch's order is ``order(seed, epoch)`` where given (a dataset that computes its own,
    see :class:`ShardByRank`), else a ``randperm`` from a generator seeded with
    ``derive_seed(seed, epoch)``, or ``range`` without shuffling. It is padded by repeating its
    head (or cut, with ``drop_last``) to a multiple of ``world_size``, and dealt as
    :class:`aioload._plan.deal.Deal` says: with ``deal="stride"`` rank ``r`` takes every
    ``world_size``-th index from ``r``; with ``"blocks"`` the ``r``-th contiguous run. With one
    rank the order is that of an unsharded loader with ``seed=``.
    """

    def __init__(self, length: int, rank: int, world_size: int, *, shuffle: bool, drop_last: bool, seed: int,
                 order=None, deal: str = STRIDE):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        self.length = length
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0
        self._order = order
        self.deal = Deal(world_size, 1, drop_last, deal)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, seed: int, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s order over every rank, from the order seed ``seed``."""
        if self._order is not None:
            return self._order(seed, epoch)
        return epoch_order(None, self.length, seed, epoch, self.shuffle)

    def epoch_length(self) -> int:
        """Samples in this epoch's order over every rank."""
        return self.length if self._order is None else self.order(self.seed, self.epoch).numel()

    @property
    def num_samples(self) -> int:
        return self.deal.per_rank(self.epoch_length())

    @property
    def total_size(self) -> int:
        return self.num_samples * self.world_size

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        order = self.order(self.seed, self.epoch)
        return iter(order[self.deal.positions(order.numel(), self.rank)].tolist())

    def __repr__(self) -> str:
        return (f"ShardSampler(rank={self.rank}, world_size={self.world_size}, shuffle={self.shuffle}, "
                f"drop_last={self.drop_last}, seed={self.seed})")


class ShardByRank(Sampler[int]):
    """The sampler of a map-style loader with ``shard=True`` and no sampler of the user's.

    What it yields is decided each time it is iterated (the loader does so when it makes an
    epoch's plan), from ``torch.distributed`` as it is then: in one process, the sampler
    torch's DataLoader would have built (``RandomSampler`` with the loader's generator, or
    ``SequentialSampler``); under ``torch.distributed``, this rank's :class:`ShardSampler`. A
    loader built before ``init_process_group`` (before ``Accelerator()``, or in a Lightning
    data module's ``__init__``) therefore shards as soon as the group exists. ``len()``
    follows the current world the same way, so it may change once the group is initialised.

    A dataset that computes its own order (``epoch_order``: WebDataset shards, an
    :class:`aioload.Mix`) is always visited through a :class:`ShardSampler`, with one rank in
    one process (or with ``shard=False``), its order seeded with ``seed=`` (0 without it, as
    ``DistributedSampler``). A mix's order also follows its weight :attr:`schedule`, which the
    loader keeps (``set_weights``, resume).
    """

    def __init__(self, dataset, *, shuffle: bool, drop_last: bool, seed: int | None, generator,
                 distributed: bool = True):
        self.dataset = dataset
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.user_seed = seed
        self.seed = 0 if seed is None else seed  # DistributedSampler's default seed
        self.epoch = 0
        self.distributed = distributed  # False: one rank whatever the world (shard=False)
        self.planned = has_own_order(dataset)
        self.mix = callable(getattr(dataset, "mixed_order", None))
        self.weights = dataset.weights if self.mix else None  # in force now (between epochs: from the next on)
        self.schedule = ((0, self.weights),) if self.mix else None  # the epoch in progress
        self.local: Sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
        self._shards: ShardSampler | None = None
        self._orders: dict = {}  # (seed, epoch, schedule) -> order, the last few

    def ranks(self) -> tuple[int, int] | None:
        """``(rank, world_size)`` this sampler deals for; ``None``: torch's own sampler."""
        ranks = distributed_rank() if self.distributed else None
        if ranks is None:
            return (0, 1) if self.planned else None
        return ranks

    def active(self) -> Sampler:
        """The sampler for the world as it is now."""
        ranks = self.ranks()
        if ranks is None:
            return self.local
        rank, world_size = ranks
        length = len(self.dataset)
        shards = self._shards
        if shards is None or (shards.rank, shards.world_size, shards.length) != (rank, world_size, length):
            shards = self._shards = ShardSampler(
                length, rank, world_size, shuffle=self.shuffle, drop_last=self.drop_last, seed=self.seed,
                order=self.order if self.planned else None, deal=deal_of(self.dataset) if self.planned else STRIDE)
        shards.set_epoch(self.epoch)
        return shards

    @property
    def world_size(self) -> int:
        ranks = self.ranks()
        return 1 if ranks is None else ranks[1]

    def order_seed(self) -> int | None:
        """The seed the epoch's order is computed from; ``None`` where torch's ``RandomSampler``
        draws it from the loader's generator (one process, shuffled, no ``seed=``)."""
        if self.ranks() is not None or not self.shuffle:
            return self.seed
        return self.user_seed  # RandomSampler over the generator seeded from (seed, epoch)

    def order(self, seed: int, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s order over every rank, from the order seed ``seed``."""
        key = (seed, epoch, self.schedule)
        found = self._orders.get(key)
        if found is None:
            if self.mix:
                found = self.dataset.mixed_order(seed, epoch, self.shuffle, self.schedule)
            else:
                found = epoch_order(self.dataset if self.planned else None, len(self.dataset), seed, epoch,
                                    self.shuffle)
            if len(self._orders) >= 4:
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = found
        return found

    def deal(self, world_size: int, batch_size: int, drop_last: bool) -> Deal:
        return Deal(world_size, batch_size, drop_last, deal_of(self.dataset) if self.planned else STRIDE)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.active())

    def __iter__(self) -> Iterator[int]:
        return iter(self.active())

    def __repr__(self) -> str:
        return f"ShardByRank({self.active()!r})"


def shard_sampler(shard: bool, dataset, sampler, batch_sampler, shuffle, drop_last: bool,
                  seed: int | None, generator) -> ShardByRank | None:
    """The sampler that shards ``dataset`` between ranks once ``torch.distributed`` is
    initialised, or ``None`` where no sharding applies: ``shard=False``, a sampler or batch
    sampler of the user's, or an ``IterableDataset`` (which shards itself)."""
    if not isinstance(shard, bool):
        raise TypeError(f"shard must be True or False, got {shard!r}")
    if sampler is not None or batch_sampler is not None:
        return None
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    if not shard and not has_own_order(dataset):
        return None
    return ShardByRank(dataset, shuffle=bool(shuffle), drop_last=drop_last, seed=seed, generator=generator,
                       distributed=shard)


class _Numbered:
    """The epoch's ``(seq, indices)`` pairs, minus those delivered before a resume.

    With ``record=True`` (samplers aioload cannot replay) it keeps the batches handed to the
    engine until they are delivered, and :meth:`written` writes out everything not yet
    delivered. The engine pulls from its own thread, hence the lock.
    """

    def __init__(self, pairs: Iterator, skip: Delivered, delivered: Delivered, record: bool, limit: int | None,
                 tally=None):
        self._tally = tally  # called with each (seq, indices) pulled: a mix counts its sources
        self._pairs = pairs
        self._skip = skip
        self._delivered = delivered
        self._record = record
        self._limit = limit
        self._buffer: deque = deque()
        self._pulled: dict[int, Any] = {}
        self._lock = threading.Lock()
        # What the first written() returned (or why it could not): later calls return it again.
        self._written: tuple | _resume.Unsaveable | None = None

    def __iter__(self) -> "_Numbered":
        return self

    def __next__(self):
        with self._lock:
            while True:
                seq, indices = self._buffer.popleft() if self._buffer else next(self._pairs)
                if seq not in self._skip:
                    break
            if self._tally is not None:
                self._tally(seq, indices)
            if self._record and self._written is None:
                for old in [s for s in self._pulled if s in self._delivered]:
                    del self._pulled[old]
                self._pulled[seq] = indices
            return seq, indices

    def written(self) -> tuple:
        """Every ``(seq, indices)`` not delivered when first asked, in order, as plain data;
        raises :class:`~aioload._plan.resume.Unsaveable` where they cannot be written out.

        The first call draws the rest of the epoch from the sampler (the engine goes on pulling
        the same batches from a buffer); later calls return the same tuple, so that saving a
        state after every batch costs nothing per call. The delivered set saved beside it says
        which of these batches the resumed loader skips.
        """
        with self._lock:
            if self._written is None:
                self._written = self._write()
                self._pulled.clear()
            if isinstance(self._written, _resume.Unsaveable):
                raise self._written
            return self._written

    def _write(self) -> tuple | _resume.Unsaveable:
        if self._limit is None:
            return _resume.Unsaveable(
                "the sampler cannot be replayed and has no len(), so the rest of its epoch cannot be "
                "written out; give the sampler a __len__, or use one of torch's samplers"
            )
        self._buffer.extend(itertools.islice(self._pairs, max(0, self._limit + 1 - len(self._buffer))))
        if len(self._buffer) > self._limit:
            return _resume.Unsaveable(
                f"the sampler yields more than its len() of {self._limit} batches, so the rest of "
                "its epoch cannot be written out"
            )
        rest = [pair for pair in self._buffer if pair[0] not in self._skip]
        pending = [(s, b) for s, b in sorted(self._pulled.items()) if s not in self._delivered]
        try:
            return tuple((seq, _resume.plain(indices)) for seq, indices in pending + rest)
        except _resume.Unsaveable as exc:
            return exc


class EpochProgress:
    """What ``state_dict()`` needs about the epoch in progress."""

    def __init__(self, epoch: int, base_seed: int, rng: dict, delivered: Delivered,
                 batches: _Numbered | None, replayable: bool, iterable: bool,
                 segments: tuple[Segment, ...] = (), order_seed=None, copies: _stateful.Copies | None = None):
        self.epoch = epoch
        self.copies = copies  # an IterableDataset's copies as of the last delivered batch
        self.segments = segments  # the parts of this epoch run on other world sizes (elastic resume)
        # The seed the epoch's order was computed from: an int, None, or a callable that asks
        # the sampler (which draws it when the first batch is pulled).
        self._order_seed = order_seed
        self.base_seed = base_seed
        self.rng = rng
        self.delivered = delivered
        self.batches = batches
        self.replayable = replayable
        self.iterable = iterable
        self.taken = 0  # batches the consumer received (an IterableDataset's are not numbered)

    @property
    def order_seed(self) -> int | None:
        seed = self._order_seed
        return seed() if callable(seed) else seed


class Planner:
    """Makes each epoch's plan from the torch loader's samplers; saves and checks resume state."""

    def __init__(self, torch_loader, seed: int | None, seed_generator: torch.Generator | None, iterable: bool):
        self.torch = torch_loader
        self.seed = seed
        self.seed_generator = seed_generator
        self.iterable = iterable
        self.in_order = True  # the loader's: whether its batches come in their workers' turn (set before plan())
        self._kept_base: tuple[int, int] | None = None  # (epoch, base seed) drawn for persistent workers
        self.last_copies: _stateful.Copies | None = None  # an IterableDataset's, from its last epoch
        self.sampler_start: Any = None  # a Stateful sampler's state at the start of the epoch in progress
        # torch's global RNG as a state of the next epoch's start saved it (between epochs, or
        # after iter()): that epoch draws from it, as the state says it does (see _start_rng)
        self._pinned: dict | None = None  # its {"global": True, "state": base64} entry
        self.end_streams: EndStreams | None = None  # persistent workers' streams after the last epoch
        mix = self._mix()
        self.tally = SourceTally(mix.dataset.names, mix.dataset.offsets) if mix is not None else None

    # -- the plan -------------------------------------------------------------------------
    def plan(self, epoch: int, resume: dict | None, per_sample_seeds: bool,
             lazy: bool = False, streams: bool = False) -> tuple[Plan, EpochProgress]:
        """Epoch ``epoch``'s plan. ``resume`` (from :meth:`load`) replays a saved epoch: the
        generators get back their state at its start and delivered batches are skipped.
        ``lazy``: the caller's thread pulls every batch itself (torch's single-process loading,
        whose sampler first draws at the first ``next()``), so none is pulled here.
        ``streams``: persistent workers (without ``seed=``) report their random streams at the
        epoch's end, for a state saved before the next one."""
        t = self.torch
        # The world may have changed since the state was loaded (init_process_group ran in
        # between): each rank's shard, and so the saved position, depends on its size.
        elastic = self._elastic(resume) if resume is not None else None
        self._forward_epoch(epoch)
        self._schedule_epoch(epoch, resume, elastic)
        if self.seed is not None:
            self.seed_generator.manual_seed(derive_seed(self.seed, epoch))
        generators = self.generators()
        pinned, self._pinned = self._pinned, None
        if resume is not None:
            saved = resume["rng"]
        else:  # a state of this epoch's start was saved: it draws from the global RNG that state holds
            saved = {role: pinned for role, g in generators.items() if g is None and pinned is not None}
        early = (resume is not None and resume.get("stateful") is not None and t.num_workers == 0
                 and resume["stateful"]["num_workers"] == 0
                 and (not self.iterable or (lazy and resume.get("progress") is not None and not _taken(resume))))
        if early:
            # A Stateful dataset loaded here (map-style; an iterable's before its first batch) gets
            # its state first: torch's global RNG, if that is what it holds, is then restored
            # around the plan's own draws below, and goes on from after them
            _stateful.load_dataset_state(t.dataset, resume["stateful"]["workers"]["worker_0"])
        progress = resume.get("progress") if resume is not None else None
        sampler = self._stateful_sampler()
        if sampler is not None:
            # its own state at the epoch's start, before the epoch's iter(): a resumed epoch gives
            # it back first, and the sampler is replayed from it
            if resume is not None and resume.get("sampler") is not None:
                sampler.load_state_dict(copy.deepcopy(resume["sampler"]))
            self.sampler_start = copy.deepcopy(sampler.state_dict())
        global_before = torch.get_rng_state() if any(entry["global"] for entry in saved.values()) else None
        with _resume.restored(saved, generators):
            start = _resume.snapshot(generators)
            if self.iterable:
                base = self._base_seed(epoch, progress)
                pairs = iter(())
            elif progress is not None and progress["batches"] is not None:
                base = self._base_seed(epoch, progress)
                pairs = iter(progress["batches"])
            elif elastic is not None:
                # The rest of an epoch begun on another world size: computed, not sampled (the
                # base seed is drawn as the saved run drew it; the sampler draws nothing).
                base = self._base_seed(epoch, progress)
                pairs = enumerate(self._rest_of_epoch(epoch, progress["order_seed"], elastic[0]))
            else:
                sampler_iter = iter(t._index_sampler)
                base = self._base_seed(epoch, progress)
                # Pull the first batch here: a sampler that draws from the global RNG does so
                # in the caller's thread, in the order torch's DataLoader draws (a resumed
                # epoch draws inside this block, from the saved state).
                first = [] if lazy and not saved else list(itertools.islice(sampler_iter, 1))
                pairs = enumerate(itertools.chain(first, sampler_iter))
            drawn = torch.get_rng_state() if any(entry["global"] for entry in saved.values()) else None
        at_start = progress is None or (not progress["delivered"]["below"] and not progress["delivered"]["also"]
                                        and not progress["segments"] and not _taken(resume))
        if drawn is not None and at_start:
            # A state of this epoch's start (saved between epochs or after iter()): the saved
            # run's epoch drew from that global RNG and went on from after its draws, and so does
            # this one, in process (the samples draw from it too) or where nothing else drew
            # from it since (a training script that restored its own RNG with the state);
            # otherwise the global RNG stays as the script left it
            global_saved = next(entry for entry in saved.values() if entry["global"])
            if lazy or torch.equal(global_before, _resume.rng_tensor(global_saved["state"])):
                torch.set_rng_state(drawn)
        if progress is not None:
            if progress["base_seed"] != base and progress["batches"] is None and progress["inexact"] is None:
                raise _resume.ResumeError(
                    "this state does not replay: its epoch drew different seeds from this loader's "
                    "generator; load it into a loader built with the same generator seed, sampler and dataset"
                )
            base = progress["base_seed"]
            skip = elastic[1] if elastic is not None else Delivered(progress["delivered"]["below"],
                                                                    progress["delivered"]["also"])
        else:
            skip = Delivered()
        delivered = skip.copy()
        pairs = self._announce(pairs, skip)
        replayable = ((_replayable(t._index_sampler) or sampler is not None)
                      and not (progress is not None and progress["batches"] is not None))
        numbered = _Numbered(pairs, skip, delivered, record=not replayable and not self.iterable,
                             limit=_len_or_none(t._index_sampler), tally=self.tally.pulled if self.tally else None)
        plan = Plan(batches=numbered, base_seed=base, per_sample_seeds=per_sample_seeds, delivered=delivered,
                    epoch=epoch)
        if streams:
            plan.streams = self.end_streams = EndStreams()
            given = resume.get("worker_streams") if resume is not None else None
            plan.new_workers = given == _resume.NEW_WORKERS
            if given is not None and not plan.new_workers and len(given) == t.num_workers:
                plan.set_streams = given
        copies = None
        if self.iterable or _stateful.is_stateful(t.dataset):
            entry = resume.get("stateful") if resume is not None else None
            ranks = distributed_rank()
            plan.copies, plan.first_worker, copies = _stateful.resume_plan(
                entry, progress is not None, t.num_workers, epoch, 1 if ranks is None else ranks[1],
                iterable=self.iterable, carry=t.persistent_workers or t.num_workers == 0,
                buffered=self.iterable and _stateful.drops_buffered_rows(t.dataset), in_order=self.in_order)
            self.last_copies = copies
            if early and self.iterable and plan.copies:  # its state is loaded already (above)
                first = plan.copies[0]
                plan.copies = (first._replace(record=dict(first.record, dataset_state=None)),)
        if elastic is not None:
            segments, order_seed = elastic[0], progress["order_seed"]
        else:
            segments, order_seed = (), self._order_seed_now
        return plan, EpochProgress(epoch, base, start, delivered, numbered, replayable, self.iterable,
                                   segments=segments, order_seed=order_seed, copies=copies)

    def _announce(self, pairs, skip: Delivered):
        """Tell a dataset that computes its order which indices this rank will read in the
        epoch, in order (``will_read``: shards fetched ahead of need); returns the pairs."""
        shards = self._shards()
        will_read = getattr(self.torch.dataset, "will_read", None)
        if shards is None or not shards.planned or not callable(will_read):
            return pairs
        pairs = list(pairs)
        batched = self.torch._auto_collation
        will_read([i for seq, b in pairs if seq not in skip for i in (b if batched else [b])])
        return iter(pairs)

    # -- elastic resume -----------------------------------------------------------------------
    def _shards(self) -> "ShardByRank | None":
        """aioload's own sharding, whose order is computed: the sampler whose states resume on
        another world size."""
        outer = self.torch._index_sampler
        sampler = outer.sampler if type(outer) is BatchSampler else outer
        return sampler if isinstance(sampler, ShardByRank) else None

    def _deal(self, world_size: int) -> Deal:
        t = self.torch
        batch = t.batch_size if t._auto_collation else 1
        return self._shards().deal(world_size, batch, t.drop_last if t._auto_collation else False)

    def _elastic(self, resume: dict) -> tuple[tuple[Segment, ...], Delivered] | None:
        """Where ``resume``'s epoch was run on other world sizes: its segments and the batches
        already delivered on this one; ``None`` where the saved position holds as it is.
        Refuses a state saved on another world size that this loader cannot split again."""
        saved, mine = resume["world_size"], self.world_size()
        progress = resume["progress"]
        shards = self._shards()
        if shards is None:
            _resume.check_world(saved, mine, "iterate")
            return None
        if progress is None or progress["batches"] is not None or progress["inexact"] is not None:
            return None  # between epochs (or the epoch's start): the next one is dealt on this world
        segments = tuple(Segment(*entry) for entry in progress["segments"])
        delivered = Delivered(progress["delivered"]["below"], progress["delivered"]["also"])
        if saved == mine or saved is None:
            return (segments, delivered) if segments else None
        if progress["order_seed"] is None:
            _resume.check_world(saved, mine, "iterate", why=(
                "its epoch was shuffled by torch's RandomSampler from the loader's generator in one "
                "process, an order the ranks cannot compute; pass seed= to resume on another number of "
                "ranks, or resume on 1 process"))
        if len(delivered):
            segments += (Segment(saved, delivered.low, tuple(sorted(delivered.above))),)
        return segments, Delivered()

    def _rest_of_epoch(self, epoch: int, order_seed: int, segments) -> list:
        """This rank's batches of what ``segments`` left of epoch ``epoch``."""
        t = self.torch
        shards = self._shards()
        order = shards.order(order_seed, epoch)
        rest = rest_of_epoch(order.numel(), segments, self._deal)
        rank, world = shards.ranks() or (0, 1)
        deal = self._deal(world)
        mine = rest[deal.positions(rest.numel(), rank)[: deal.kept(rest.numel())]]
        indices = order[mine].tolist()
        if not t._auto_collation:
            return indices
        size = t.batch_size
        return [indices[i : i + size] for i in range(0, len(indices), size)]

    def position(self, resume: dict | None) -> tuple[int, int | None]:
        """``(batches delivered, batches in all)`` on this rank of the epoch the next iteration
        runs: the loaded state's epoch as it resumes on the world there is now (the rest of an
        epoch dealt again over another world size has batches of its own), else a whole epoch.
        ``None`` in all where the sampler has no ``len()``."""
        length = _len_or_none(self.torch._index_sampler)
        progress = resume["progress"] if resume is not None else None
        if progress is None or self.iterable:
            return 0, length
        elastic = self._elastic(resume)
        if elastic is None:
            delivered = progress["delivered"]
            return delivered["below"] + len(delivered["also"]), length
        segments, delivered = elastic
        starts, ends = rest_runs(self._shards().order(progress["order_seed"], resume["epoch"]).numel(), segments,
                                 self._deal)
        rest = int((ends - starts).sum())
        _, world = self._shards().ranks() or (0, 1)
        return len(delivered), self._deal(world).batches(rest)

    def _check_elastic(self, resume: dict) -> None:
        """A position saved on other world sizes, checked against the batches each part of its
        epoch had there (the part's length follows from the epoch's order and the parts before)."""
        progress = resume["progress"]
        saved = resume["world_size"]
        if progress is None or saved is None or (saved == self.world_size() and not progress["segments"]):
            return
        if progress["order_seed"] is None:
            return  # refused by _elastic() with the reason
        length = self._shards().order(progress["order_seed"], resume["epoch"]).numel()

        def check(i: int, segment: Segment, left: int) -> None:  # left: what the parts before left
            _resume.check_position(f"progress.segments[{i}]", segment.low, segment.above,
                                   self._deal(segment.world_size).batches(left), segment.world_size)

        segments = [Segment(world, below, tuple(also)) for world, below, also in progress["segments"]]
        try:
            runs = rest_runs(length, segments, self._deal, check)
        except TooManyPieces as exc:
            raise _resume._fail(f"progress.segments[{exc.index}]", (
                f"cuts what is left of epoch {resume['epoch']} more finely than a run resumed on other numbers of "
                f"ranks does ({exc.work:,} pieces and positions handled, past a budget of {exc.budget:,})")) from None
        rest = int((runs[1] - runs[0]).sum())
        delivered = progress["delivered"]
        _resume.check_position("progress.delivered", delivered["below"], delivered["also"],
                               self._deal(saved).batches(rest), saved)

    def _order_seed_now(self) -> int | None:
        shards = self._shards()
        return shards.order_seed() if shards is not None else None

    def _forward_epoch(self, epoch: int) -> None:
        """The sampler's ``set_epoch``, and an ``IterableDataset``'s here, in the training
        process, before any worker's copy looks at its epoch (see
        :func:`aioload._workers.state.forward_epoch`)."""
        t = self.torch
        if self.iterable:
            _stateful.forward_epoch(t.dataset, epoch)
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
    def world_size(self) -> int | None:
        """The number of ranks this loader's order is split between, where it is split:
        aioload's own sharding (1 while ``torch.distributed`` is not initialised), or a
        ``DistributedSampler``/``ShardSampler`` of the user's. ``None``: every rank alike."""
        outer = self.torch._index_sampler
        sampler = outer.sampler if type(outer) is BatchSampler else outer
        if isinstance(sampler, (ShardByRank, ShardSampler)):
            return sampler.world_size
        if isinstance(sampler, torch.utils.data.distributed.DistributedSampler):
            return sampler.num_replicas
        return None

    # -- mixtures -----------------------------------------------------------------------------
    def _mix(self) -> "ShardByRank | None":
        """The sampler of an :class:`aioload.Mix` drawn by the loader's own plan (it keeps the
        weights in force and the epoch's schedule of them)."""
        shards = self._shards()
        return shards if shards is not None and shards.mix else None

    def _schedule_epoch(self, epoch: int, resume: dict | None, elastic) -> None:
        """The weight schedule the epoch being planned draws with: a resumed epoch's own, else
        the weights in force now from its start; a change asked for before a loaded state was
        iterated takes effect at the first batch the resumed epoch delivers."""
        shards = self._mix()
        if shards is None:
            return
        progress = resume["progress"] if resume is not None else None
        if progress is None:
            shards.schedule = ((0, shards.weights),)
            return
        shards.schedule = resume["mix"]["schedule"]
        pending = resume.get("pending_weights")
        if pending is not None:
            if elastic is not None:
                segments, delivered = elastic
            else:
                segments = tuple(Segment(*e) for e in progress["segments"])
                delivered = Delivered(progress["delivered"]["below"], progress["delivered"]["also"])
            at = self._next_position(epoch, progress["order_seed"], segments, delivered)
            shards.schedule = with_change(shards.schedule, at, pending)

    def _next_position(self, epoch: int, order_seed: int, segments, delivered: Delivered) -> int:
        """Where in the epoch's order the next batch this rank has not delivered begins (for a
        mix, dealt by stride: every rank's batches from there on lie at or after it)."""
        shards = self._shards()
        length = shards.order(order_seed, epoch).numel()
        rest = rest_of_epoch(length, segments, self._deal)
        k = max(delivered.above) + 1 if delivered.above else delivered.low
        _, world = shards.ranks() or (0, 1)
        deal = self._deal(world)
        start = k * deal.batch_size * world
        return int(rest[start]) if start < rest.numel() else length

    def set_weights(self, weights, progress: EpochProgress | None, resume: dict | None) -> bool:
        """A mix's weights from the next batch the consumer has not received; returns whether
        the epoch in progress must be made again from there (its batches in flight were drawn
        with the old weights)."""
        shards = self._mix()
        shards.weights = weights
        if resume is not None:
            if resume["progress"] is not None:
                resume["pending_weights"] = weights
            return False
        if progress is None or progress.delivered.complete:
            return False  # between epochs: the next one starts with them
        at = self._next_position(progress.epoch, progress.order_seed, progress.segments, progress.delivered)
        shards.schedule = with_change(shards.schedule, at, weights)
        return True

    def _mix_state(self, mid_epoch: bool) -> dict | None:
        shards = self._mix()
        if shards is None:
            return None
        return _resume.mix_entry(shards.dataset.names, shards.weights, shards.schedule if mid_epoch else None)

    def config(self) -> dict:
        t = self.torch
        if self.seed is not None:
            base_seeds = "from seed"
        elif t.persistent_workers and t.num_workers > 0:
            base_seeds = "drawn once (persistent workers)"
        else:
            base_seeds = "drawn every epoch"
        return _resume.config(t, self.seed, self.generators(), base_seeds, self.world_size())

    def state_dict(self, next_epoch: int, progress: EpochProgress | None, workers=None) -> dict:
        """The state now. ``workers``: between epochs, the next epoch's workers' random streams
        (``worker_streams``, see :mod:`aioload._plan.resume`), or ``None``."""
        if progress is None or progress.delivered.complete:
            # Between epochs: the next one starts from the generators as they are now, torch's
            # global RNG included where the loader draws from it (pinned: the next epoch draws
            # from it as saved here, whatever else draws from it in between)
            state = _resume.pack(next_epoch, self.config(), self._start_rng(), None, self._kept_base,
                                 mix=self._mix_state(False), worker_streams=workers)
            copies = self.last_copies
            if copies is not None and copies.stateful():  # the copies' own states (an epoch counter)
                state["stateful"] = copies.entry()
            self._add_sampler_state(state, None)
            return state
        state = _resume.pack(progress.epoch, self.config(), progress.rng, self._position(progress), self._kept_base,
                             mix=self._mix_state(True))
        if progress.copies is not None and progress.copies.started():
            state["stateful"] = progress.copies.entry()
        self._add_sampler_state(state, self.sampler_start)
        return state

    def _stateful_sampler(self):
        """The loader's sampler (or batch sampler) where it is Stateful (``state_dict`` and
        ``load_state_dict``), else ``None``."""
        if self.iterable:
            return None
        index_sampler = self.torch._index_sampler
        for sampler in (index_sampler, _user_sampler(index_sampler)):
            if _stateful.is_stateful(sampler):
                return sampler
        return None

    def _add_sampler_state(self, state: dict, at_start) -> None:
        """A Stateful sampler's own state, under ``"sampler"``: ``at_start`` (its state at the
        start of the epoch in progress), or between epochs its state now (the next epoch's start)."""
        sampler = self._stateful_sampler()
        if sampler is not None:
            state["sampler"] = copy.deepcopy(sampler.state_dict()) if at_start is None else copy.deepcopy(at_start)

    def _position(self, progress: EpochProgress) -> dict:
        """Where the epoch in progress is. Where that cannot be saved exactly, the state
        stands for the epoch's start and says why (see docs/reproducibility.md): saving never
        fails, and loading such a state warns."""
        if progress.iterable:
            if progress.taken == 0 or progress.copies is not None:  # the copies hold the position
                return _resume.progress(progress.base_seed, Delivered(), None)
            return _resume.progress(progress.base_seed, Delivered(), None, inexact=_resume.ITERABLE_MIDDLE)
        if progress.replayable:
            return _resume.progress(progress.base_seed, progress.delivered, None, order_seed=progress.order_seed,
                                    segments=progress.segments)
        try:
            batches = progress.batches.written()
        except _resume.Unsaveable as exc:
            return _resume.progress(progress.base_seed, Delivered(), None, inexact=str(exc))
        return _resume.progress(progress.base_seed, progress.delivered, batches, rank=_rank())

    def _start_rng(self, pin: bool = True) -> dict:
        """Every generator's state now, for a state of the next epoch's start; torch's global
        RNG as pinned (``pin``: pinned now, where it is not yet)."""
        gens = self.generators()
        rng = _resume.snapshot({role: g for role, g in gens.items() if g is not None})
        shared = [role for role, g in gens.items() if g is None]
        if shared:
            pinned = self._pinned if self._pinned is not None else _resume.snapshot({"global": None})["global"]
            if pin:
                self._pinned = pinned
            rng.update({role: pinned for role in shared})
        return {role: rng[role] for role in gens}

    def start_state(self, epoch: int, workers=None, pin: bool = True) -> dict:
        """The state of epoch ``epoch`` made ready by ``iter()`` but not started (its first
        ``next()`` draws the base seed and the sampler's order): every generator's state now,
        torch's global RNG included, as torch's iterator holds the seed it drew at ``iter()``, so
        that a resumed run draws that epoch's order again; and, for an IterableDataset that is
        Stateful and loaded in process, its state now. ``workers``: as :meth:`state_dict`'s;
        ``pin``: the epoch draws from torch's global RNG as saved here."""
        rng = self._start_rng(pin)
        base = self._peek_base(epoch, rng)
        state = _resume.pack(epoch, self.config(), rng,
                             _resume.progress(base, Delivered(), None, order_seed=self._order_seed_now()),
                             self._kept_base, mix=None, worker_streams=workers)
        mix = self._mix()
        if mix is not None:
            state["mix"] = _resume.mix_entry(mix.dataset.names, mix.weights, ((0, mix.weights),))
        dataset = self.torch.dataset
        # in process, the copy is the dataset itself; workers' copies are pickled from it and
        # seeded in the worker, which a state taken here would undo (its random state, say)
        if self.iterable and self.torch.num_workers == 0 and _stateful.is_stateful(dataset):
            ranks = distributed_rank()
            state["stateful"] = _stateful.initial_entry(dataset.state_dict(), self.torch.num_workers,
                                                        1 if ranks is None else ranks[1])
        self._add_sampler_state(state, None)  # its epoch's iter() has not run yet
        return state

    def _peek_base(self, epoch: int, rng: dict) -> int:
        """The base seed :meth:`plan` will draw for ``epoch`` from the generators in ``rng``,
        drawn from a copy (nothing is drawn from the generators themselves)."""
        if self.seed is not None:
            return derive_seed(self.seed, epoch, 1)
        t = self.torch
        if t.persistent_workers and t.num_workers > 0 and self._kept_base is not None:
            first, base = self._kept_base
            return base if epoch == first else derive_seed(base, epoch)
        scratch = torch.Generator()
        scratch.set_state(_resume.rng_tensor(rng["loader"]["state"]))
        return draw_base_seed(scratch)

    def expected(self) -> _resume.Expected:
        """What a state this loader can load looks like (see :func:`aioload._plan.resume.unpack`)."""
        t = self.torch
        return _resume.Expected(
            config=self.config(), batches=_len_or_none(t._index_sampler), iterable=self.iterable,
            batched=t._auto_collation, batch_size=t.batch_size if t._auto_collation else None,
            rank=_rank(), elastic=self._shards() is not None, listed=_resume.listed(_user_sampler(t._index_sampler)),
            mix=self._mix().dataset.names if self._mix() is not None else None,
        )

    def load(self, state) -> dict:
        """Check ``state`` against this loader; returns what :meth:`plan` resumes from."""
        resume = _resume.unpack(state, self.expected())  # every field, before anything uses one
        prog = resume["progress"]
        if prog is not None and prog["batches"] is None and prog["inexact"] is None:
            replayed = self._replayed_base(resume)
            if replayed is not None and replayed != prog["base_seed"]:
                raise _resume.ResumeError(
                    f"cannot load this state: progress.base_seed is {prog['base_seed']}, but replaying its "
                    f"epoch from the saved seed and generator states gives {replayed}; pass what "
                    "loader.state_dict() returned"
                )
        if resume["world_size"] != self.world_size():
            self._elastic(resume)  # refuses here a position no other world size can resume
        self._check_elastic(resume)
        if self._mix() is not None:
            self._mix().weights = resume["mix"]["weights"]
        resume["saved"] = copy.deepcopy(state)
        self._pinned = None  # the loaded state's generator states replace a pinned global RNG
        if prog is not None and prog["inexact"] is not None:
            warnings.warn(
                f"this state resumes epoch {resume['epoch']} from its start, not from where it was saved: "
                f"{prog['inexact']}. Batches delivered in that epoch before the save are delivered again",
                _resume.ResumeWarning, stacklevel=3,
            )
        kept = resume["kept_base"]
        if kept is not None and resume["progress"] is not None and kept[0] == resume["epoch"]:
            kept = None  # the replayed epoch draws it again, as the saved run did
        self._kept_base = kept
        return resume

    def _replayed_base(self, resume: dict) -> int | None:
        """The base seed :meth:`plan` draws when it replays ``resume``'s epoch (the first draw
        from the loader's restored generator: torch's samplers draw later), where it is known
        before iterating; ``None`` where the saved one is taken as it is."""
        epoch = resume["epoch"]
        if self.seed is not None:
            return derive_seed(self.seed, epoch, 1)
        t = self.torch
        if t.persistent_workers and t.num_workers > 0:
            kept = resume["kept_base"]
            return derive_seed(kept[1], epoch) if kept is not None and kept[0] != epoch else None
        entry = resume["rng"].get("loader")
        if entry is None:
            return None
        scratch = torch.Generator()
        scratch.set_state(_resume.rng_tensor(entry["state"]))
        return draw_base_seed(scratch)

    def resume_state(self, resume: dict) -> dict:
        """The state of a loader that loaded ``resume`` and has not iterated since."""
        return copy.deepcopy(resume["saved"])


def _taken(resume: dict) -> bool:
    """Whether a resumed IterableDataset's copies had delivered anything."""
    entry = resume.get("stateful")
    return entry is not None and any(entry["taken"])


def _rank() -> int:
    ranks = distributed_rank()
    return 0 if ranks is None else ranks[0]


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
    """The sampler that decides the order: inside torch's ``BatchSampler``, and for
    :class:`ShardByRank` the one it uses in the world as it is now."""
    inner = index_sampler.sampler if type(index_sampler) is BatchSampler else index_sampler
    return inner.active() if isinstance(inner, ShardByRank) else inner


def _user_sampler(index_sampler):
    """The sampler (or batch sampler) the loader was given: the one inside torch's ``BatchSampler``."""
    return index_sampler.sampler if type(index_sampler) is BatchSampler else index_sampler


def _replayable(index_sampler) -> bool:
    """Whether the epoch's order is a function of the generator states aioload saves: torch's
    own samplers and :class:`ShardSampler` (exact types: a subclass may draw elsewhere)."""
    return type(_inner_sampler(index_sampler)) in _RANDOM_SAMPLERS + _FIXED_SAMPLERS


def _len_or_none(index_sampler) -> int | None:
    try:
        return len(index_sampler)
    except TypeError:
        return None
