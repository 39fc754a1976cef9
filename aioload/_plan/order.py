"""The epoch's order over every rank: a pure function of ``(seed, epoch)``.

A dataset may compute its own order (``epoch_order(seed, epoch, shuffle)``: WebDataset shards
drawn through a window, a mixture of sources); any other map-style dataset is visited in a
``randperm`` seeded with ``derive_seed(seed, epoch)``, or in index order without shuffling.
Nothing here draws from a global generator, so every rank, and a resumed run, computes the
same order from the same two numbers.
"""

from __future__ import annotations

import torch

from aioload._base.seeding import derive_seed

STRIDE = "stride"
BLOCKS = "blocks"
DEALS = (STRIDE, BLOCKS)


def has_own_order(dataset) -> bool:
    """Whether ``dataset`` computes its epoch order itself (``epoch_order``)."""
    return callable(getattr(dataset, "epoch_order", None))


def deal_of(dataset) -> str:
    """How the dataset's order is split between ranks: ``"stride"`` (rank ``r`` takes every
    ``world_size``-th sample, as ``DistributedSampler``) or ``"blocks"`` (a contiguous run
    each, which keeps a rank on its own shards)."""
    deal = getattr(dataset, "deal", STRIDE)
    if deal not in DEALS:
        raise ValueError(f"{type(dataset).__name__}.deal must be 'stride' or 'blocks', got {deal!r}")
    return deal


def epoch_order(dataset, length: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """Epoch ``epoch``'s order over every rank, as a 1-D int64 tensor holding each index of
    ``range(length)`` once."""
    if has_own_order(dataset):
        order = torch.as_tensor(dataset.epoch_order(seed, epoch, shuffle), dtype=torch.int64).reshape(-1)
        _check_permutation(dataset, order, length)
        return order
    if not shuffle:
        return torch.arange(length, dtype=torch.int64)
    generator = torch.Generator()
    generator.manual_seed(derive_seed(seed, epoch))
    return torch.randperm(length, generator=generator)


def _check_permutation(dataset, order: torch.Tensor, length: int) -> None:
    name = type(dataset).__name__
    if order.numel() != length:
        raise ValueError(f"{name}.epoch_order returned {order.numel()} indices for a dataset of {length} "
                         "samples: it must return each index of range(len(dataset)) exactly once")
    if length and (int(order.min()) < 0 or int(order.max()) >= length
                   or bool((torch.bincount(order, minlength=length) != 1).any())):
        raise ValueError(f"{name}.epoch_order must return each index of range({length}) exactly once")
