"""``aioload.Mix``: one dataset over several named sources, drawn by weight.

A sample's index is its place in the sources laid end to end (source ``s``'s sample ``i`` is
``offset[s] + i``); which indices an epoch visits, and in which order, is the loader's plan
(:mod:`aioload._mix.interleave`), never this dataset's ``__len__``. Reads and decodes go to the
source: a split source (``read``/``decode``) keeps its split, a plain map-style one is loaded
with ``__getitem__`` in the worker.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

import torch

from aioload._data.dataset import NOT_READY, Dataset, is_split
from aioload._mix.interleave import mixed_order, natural_length
from aioload._mix.weights import Schedule, Weights, check_weights, normalised
from aioload._base.seeding import derive_seed

EXHAUSTED = ("repeat", "stop")


class Mix(Dataset):
    """Several datasets drawn from at set proportions.

    ``sources``: ``{name: dataset}`` (map-style: aioload's own, ``aioload.WebDataset``, any
    torch dataset with ``__len__``, another ``Mix``); ``weights``: ``{name: weight}``, every
    source named, each >= 0, normalised. ``aioload.DataLoader`` draws each epoch's order from
    them: in every stretch of the epoch each source has its share to within a sample or two,
    and the order is a function of ``(seed, epoch, rank, world size, weight changes)`` only.
    ``loader.set_weights(...)`` changes them from the next batch on.

    * ``epoch_length`` -- samples per epoch over all ranks. ``None``: what the weights at the
      epoch's start imply without repeating any source (the epoch ends just before the first
      source would be drawn once more than it has samples).
    * ``exhausted`` -- what a source that runs out within the epoch does: ``"repeat"`` (the
      default: it starts a fresh order of its samples) or ``"stop"`` (the epoch ends there).
    * ``source_field`` -- a name, to tell which source each sample came from (for per-source
      loss curves): a dict sample gets that key, any other sample ``s`` becomes
      ``(s, source)``; ``source`` is the source's number in ``names``. ``None`` (default): off.
    * ``check_structure`` -- the first sample of each source (in each worker) is compared with
      the first of the others, and a source whose samples have another structure (other keys,
      tuple lengths, tensor dtypes or ranks) fails naming both sources, since a batch mixing
      them cannot be collated. Turn it off for a ``collate_fn`` that joins different structures.
    """

    deal = "stride"

    def __init__(self, sources: Mapping[str, Any], weights: Mapping[str, float], *, epoch_length: int | None = None,
                 exhausted: str = "repeat", source_field: str | None = None, check_structure: bool = True):
        if not isinstance(sources, Mapping) or not sources:
            raise TypeError("sources must be a non-empty dict of name to dataset")
        for name, source in sources.items():
            if not isinstance(name, str):
                raise TypeError(f"source names must be strings, got {name!r}")
            if isinstance(source, torch.utils.data.IterableDataset):
                raise TypeError(f"source {name!r} is an IterableDataset: a mix draws samples by index, so its "
                                "sources must be map-style (aioload.WebDataset for tar shards)")
            try:
                length = len(source)
            except TypeError:
                raise TypeError(f"source {name!r} has no len(): a mix needs map-style sources") from None
            if length == 0:
                raise ValueError(f"source {name!r} is empty")
        if exhausted not in EXHAUSTED:
            raise ValueError(f"exhausted must be 'repeat' or 'stop', got {exhausted!r}")
        if epoch_length is not None and (isinstance(epoch_length, bool) or not isinstance(epoch_length, int)
                                         or epoch_length < 1):
            raise ValueError(f"epoch_length must be an int >= 1 or None, got {epoch_length!r}")
        if source_field is not None and not isinstance(source_field, str):
            raise TypeError(f"source_field must be a string or None, got {source_field!r}")
        self.names = tuple(sources)
        self.sources = tuple(sources.values())
        self.lengths = tuple(len(s) for s in self.sources)
        self.offsets = tuple(sum(self.lengths[:i]) for i in range(len(self.lengths)))
        self.weights = check_weights(weights, self.names)
        self.epoch_length = epoch_length
        self.exhausted = exhausted
        self.source_field = source_field
        self.check_structure = check_structure
        self._split = tuple(is_split(s) for s in self.sources)
        self._seen: dict[int, Any] = {}  # source -> the structure of its first sample here
        self._seen_lock = threading.Lock()

    # -- the plan ---------------------------------------------------------------------------
    def __len__(self) -> int:
        """The samples of every source together (the index space), not an epoch's length."""
        return sum(self.lengths)

    def check_weights(self, weights) -> Weights:
        """``weights`` checked, in the order of :attr:`names`."""
        return check_weights(weights, self.names)

    def length_of_epoch(self, weights: Weights, seed: int, epoch: int, shuffle: bool) -> int:
        """The nominal length of an epoch that starts with ``weights``."""
        if self.epoch_length is not None:
            return self.epoch_length
        return natural_length(self.lengths, weights, derive_seed(seed, epoch, 0), shuffle)

    def mixed_order(self, seed: int, epoch: int, shuffle: bool, schedule: Schedule | None = None) -> torch.Tensor:
        """Epoch ``epoch``'s order over every rank, for the weight ``schedule`` (``None``: this
        mix's own weights throughout)."""
        if schedule is None:
            schedule = ((0, self.weights),)
        length = self.length_of_epoch(schedule[0][1], seed, epoch, shuffle)
        return mixed_order(self.lengths, lambda s, p: self._source_order(s, p, seed, epoch, shuffle), schedule,
                           length, seed, epoch, shuffle, stop=self.exhausted == "stop")

    def epoch_order(self, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
        return self.mixed_order(seed, epoch, shuffle)

    def _source_order(self, s: int, p: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
        """Pass ``p`` over source ``s``: its own order where it computes one, else seeded."""
        source, pass_seed = self.sources[s], derive_seed(seed, epoch, s, p)
        own = getattr(source, "mixed_order", None) or getattr(source, "epoch_order", None)
        if callable(own):
            return torch.as_tensor(own(pass_seed, epoch, shuffle), dtype=torch.int64).reshape(-1)
        if not shuffle:
            return torch.arange(self.lengths[s], dtype=torch.int64)
        return torch.randperm(self.lengths[s], generator=torch.Generator().manual_seed(pass_seed))

    def source_of(self, index: int) -> tuple[int, int]:
        """``(source number, index within it)`` of a sample."""
        if not 0 <= index < sum(self.lengths):
            raise IndexError(f"index {index} is out of range for a mix of {sum(self.lengths)} samples")
        s = len(self.offsets) - 1
        while self.offsets[s] > index:
            s -= 1
        return s, index - self.offsets[s]

    def will_read(self, indices) -> None:
        by_source: dict[int, list] = {}
        for index in indices:
            s, local = self.source_of(int(index))
            by_source.setdefault(s, []).append(local)
        for s, local in by_source.items():
            hint = getattr(self.sources[s], "will_read", None)
            if callable(hint):
                hint(local)

    def io_figures(self) -> dict[str, Any]:
        """The sources' own I/O figures for ``loader.stats()`` (a WebDataset's shard fetches),
        added up; ``shard_mode`` is ``"window"`` if any source fetches whole shards."""
        merged: dict[str, Any] = {}
        modes = set()
        for source in self.sources:
            figures = getattr(source, "io_figures", None)
            if not callable(figures):
                continue
            for name, value in figures().items():
                if name == "shard_mode":
                    modes.add(value)
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    merged[name] = merged.get(name, 0) + value
        if modes:
            merged["shard_mode"] = "window" if "window" in modes else sorted(modes)[0]
        return merged

    # -- loading ------------------------------------------------------------------------------
    @property
    def read_in_workers(self) -> bool:
        return all(getattr(src, "read_in_workers", True) for src, split in zip(self.sources, self._split) if split)

    def read_nowait(self, index: int) -> Any:
        s, local = self.source_of(index)
        if not self._split[s]:
            return s, local
        raw = self.sources[s].read_nowait(local)
        return NOT_READY if raw is NOT_READY else (s, raw)

    async def read(self, index: int) -> Any:
        s, local = self.source_of(index)
        if not self._split[s]:
            return s, local
        return s, await self.sources[s].read(local)

    def read_blocking(self, index: int) -> Any:
        s, local = self.source_of(index)
        if not self._split[s]:
            return s, local
        return s, self.sources[s].read_blocking(local)

    def decode(self, raw: Any) -> Any:
        s, item = raw
        source = self.sources[s]
        sample = source.decode(item) if self._split[s] else source[item]
        if self.check_structure:
            self._check(s, sample)
        if self.source_field is not None:
            if isinstance(sample, dict):
                sample = {**sample, self.source_field: s}
            else:
                sample = (sample, s)
        return sample

    def describe(self, index: int) -> str | None:
        s, local = self.source_of(index)
        describe = getattr(self.sources[s], "describe", None)
        where = describe(local) if callable(describe) else None
        return f"source {self.names[s]!r} sample {local}" + (f" ({where})" if where else "")

    def _check(self, s: int, sample) -> None:
        if s in self._seen:
            return
        shape = structure(sample)
        with self._seen_lock:
            for other, theirs in self._seen.items():
                if theirs != shape:
                    raise TypeError(
                        f"sources {self.names[other]!r} and {self.names[s]!r} of the mix give samples of "
                        f"different structure ({theirs} against {shape}): a batch that mixes them cannot "
                        "be collated; make their decode return the same structure, or pass "
                        "check_structure=False with a collate_fn that joins them"
                    )
            self._seen[s] = shape

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_seen"] = {}
        del state["_seen_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._seen_lock = threading.Lock()

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={w:.3g}" for n, w in zip(self.names, normalised(self.weights)))
        return f"Mix({parts}; {sum(self.lengths)} samples)"


def structure(sample) -> str:
    """What a collate needs to agree on between samples: containers, keys, lengths, and each
    leaf's kind (a tensor's dtype and rank, an array's, a number, a string)."""
    if isinstance(sample, dict):
        items = sorted(sample.items(), key=lambda kv: repr(kv[0]))
        return "{" + ", ".join(f"{k!r}: {structure(v)}" for k, v in items) + "}"
    if isinstance(sample, (tuple, list)):
        inner = ", ".join(structure(v) for v in sample)
        return f"({inner})" if isinstance(sample, tuple) else f"[{inner}]"
    if isinstance(sample, torch.Tensor):
        return f"tensor[{sample.dtype}, {sample.dim()}-d]"
    if hasattr(sample, "dtype") and hasattr(sample, "ndim"):
        return f"array[{sample.dtype}, {sample.ndim}-d]"
    if isinstance(sample, (bool, int, float)):
        return "number"
    if isinstance(sample, (str, bytes)):
        return type(sample).__name__
    return type(sample).__qualname__
