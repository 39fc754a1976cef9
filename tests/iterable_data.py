"""IterableDatasets for the resume tests (module level, so every start method imports them).

Each splits its items between torch's workers by ``get_worker_info()``: worker ``w`` of ``W``
yields ``range(1000 * w, 1000 * w + sizes[w])`` (so ``sizes`` may leave a worker empty, or
give one far more than the others); in the loading process (no workers) it yields every
share, one after the other. ``sizes`` needs one entry per worker.

- :class:`Plain` has no state: a loader resumes it by running ``__iter__`` again and dropping
  what each worker had delivered (fast-forward).
- :class:`Counted` is ``Stateful`` itself (``state_dict`` / ``load_state_dict`` on the
  dataset, as a Hugging Face ``IterableDataset`` is): its state is how far its worker's copy
  has read, and a loaded state makes the next ``__iter__`` start there; ``starts`` lists where
  each ``__iter__`` of this copy began.
- :class:`CountedIter` keeps the state on the iterator ``__iter__`` returns instead.
- :class:`Noisy` draws a number from torch's global RNG with each item (seeded per worker by
  the loader, as torch's DataLoader seeds it): resumed exactly only if the worker's RNG goes
  on as it would have.
"""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset, get_worker_info


def share(sizes: list[int]) -> list[int]:
    """This process's items: its worker's share, or every share without workers."""
    info = get_worker_info()
    if info is None:
        return [i for w, size in enumerate(sizes) for i in range(1000 * w, 1000 * w + size)]
    if info.num_workers != len(sizes):
        raise ValueError(f"sizes {sizes} name {len(sizes)} workers, the loader runs {info.num_workers}")
    return list(range(1000 * info.id, 1000 * info.id + sizes[info.id]))


class Plain(IterableDataset):
    def __init__(self, sizes: list[int]):
        self.sizes = list(sizes)

    def __iter__(self):
        return iter(share(self.sizes))


class Counted(IterableDataset):
    def __init__(self, sizes: list[int]):
        self.sizes = list(sizes)
        self.done = 0  # items the current iterator has yielded
        self.resume_at = 0  # where the next __iter__ starts (a loaded state)
        self.starts: list[int] = []

    def __iter__(self):
        start, self.resume_at = self.resume_at, 0
        self.starts.append(start)
        self.done = start
        for item in share(self.sizes)[start:]:
            self.done += 1
            yield item

    def state_dict(self) -> dict:
        return {"done": self.done}

    def load_state_dict(self, state: dict) -> None:
        self.resume_at = state["done"]


class _Reader:
    def __init__(self, items: list[int], start: int):
        self.items, self.pos = items, start

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if self.pos >= len(self.items):
            raise StopIteration
        self.pos += 1
        return self.items[self.pos - 1]

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


class CountedIter(IterableDataset):
    def __init__(self, sizes: list[int]):
        self.sizes = list(sizes)

    def __iter__(self):
        return _Reader(share(self.sizes), 0)


class Noisy(IterableDataset):
    def __init__(self, sizes: list[int]):
        self.sizes = list(sizes)

    def __iter__(self):
        for item in share(self.sizes):
            yield {"item": item, "noise": torch.randint(0, 2**31, ())}


def items(batch) -> list[int] | int:
    """A batch's items (one item with ``batch_size=None``, which leaves it uncollated)."""
    if isinstance(batch, dict):
        return [torch.as_tensor(batch["item"]).tolist(), torch.as_tensor(batch["noise"]).tolist()]
    return torch.as_tensor(batch).tolist()
