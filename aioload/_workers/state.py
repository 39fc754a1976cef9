"""The Stateful protocol inside a worker (or, with ``num_workers=0``, the training process):
capturing the state of one copy of an ``IterableDataset`` after a batch, and giving it back
before the copy yields anything.

An object is *Stateful* when it has callable ``state_dict`` and ``load_state_dict`` (torchdata's
``Stateful`` protocol, which Hugging Face ``datasets.IterableDataset`` follows). For an
iterable, the dataset and the iterator ``iter(dataset)`` returns are each asked, once per
epoch, when the iterator is made: where neither is Stateful nothing is captured (a batch's
reply carries no state and costs nothing more), and a resumed copy is fast-forwarded instead,
by dropping the items it already delivered.

A map-style dataset that is Stateful (its random state, say) has its state captured the same
way after each task, and given back when a resumed epoch starts (:func:`load_dataset_state`).

A copy's state is a record, the shape of one worker's entry in
torchdata's ``StatefulDataLoader`` state, so that a record written by either loader reads the
same::

    {"worker_id": 1,
     "dataset_state": <dataset.state_dict()> | None,     # None: not Stateful, or it is its own iterator
     "fetcher_state": {"dataset_iter_state": <iterator.state_dict()> | None,
                       "fetcher_ended": False}}           # the copy ran out

Restoring follows torchdata's order: the dataset's state, then ``iter(dataset)``, then the
iterator's state. What the values hold is the dataset's business: they are passed on as they
are (tensors included), never inspected.

Before any of that, at each epoch's start, a copy with a callable ``set_epoch`` (a Hugging Face
streaming dataset, a webdataset-like one) gets ``set_epoch(epoch)`` with the loader's epoch, as
Accelerate's loader and the Hugging Face ``Trainer`` call it: a new shuffle each epoch, and a
state saved in another epoch is not applied (``datasets`` applies a loaded state only while its
epoch is the state's).

A Hugging Face ``datasets.IterableDataset`` shuffled with a buffer (``.shuffle(buffer_size=)``)
has ``state_dict()`` and ``load_state_dict()``, but its state drops the rows held in the buffer
(its own docstring says so) and fails to load in a worker; its order is a function of its seed
and epoch, so replaying it is exact: it is not taken as Stateful here
(:func:`drops_buffered_rows`), and a resumed copy is fast-forwarded.
"""

from __future__ import annotations

from typing import Any

from aioload._workers.messages import CopyNote


def is_stateful(obj) -> bool:
    """Whether ``obj`` follows the Stateful protocol (``state_dict`` and ``load_state_dict``)
    with a state that resumes it exactly (not a shuffle buffer's: :func:`drops_buffered_rows`)."""
    return (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
            and not drops_buffered_rows(obj))


_CHAIN_LIMIT = 256  # examples iterables looked at in one dataset's chain (a cycle stops there too)


def drops_buffered_rows(obj) -> bool:
    """Whether ``obj`` is a Hugging Face ``datasets.IterableDataset`` whose examples pass a
    shuffle buffer (a ``BufferShuffledExamplesIterable`` in its ``_ex_iterable`` chain), whose
    state loses the rows the buffer holds. Found by class name, without importing ``datasets``."""
    todo, seen = [getattr(obj, "_ex_iterable", None)], 0
    while todo and seen < _CHAIN_LIMIT:
        node = todo.pop()
        if node is None:
            continue
        seen += 1
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return True
        todo.append(getattr(node, "ex_iterable", None))
        more = getattr(node, "ex_iterables", None)  # interleaved or concatenated sources
        if isinstance(more, (list, tuple)):
            todo.extend(more)
    return False


def forward_epoch(dataset, epoch: int) -> None:
    """``dataset.set_epoch(epoch)`` where the copy has a callable ``set_epoch``, unless its
    ``epoch`` says it is there already.

    A Hugging Face streaming dataset keeps its epoch in a tensor in shared memory, shared by the
    training process's dataset and every worker's copy, and its ``set_epoch`` adds the
    difference in place (``_epoch += epoch - _epoch``): two workers setting the same epoch at
    once could both add it (epoch 1 became 2, another shuffle of its files). The training
    process sets it first (:meth:`aioload._plan.sampling.Planner.plan`), so a copy that shares it
    finds it set and leaves it; a copy of its own gets it here."""
    set_epoch = getattr(dataset, "set_epoch", None)
    if not callable(set_epoch):
        return
    current = getattr(dataset, "epoch", None)
    if isinstance(current, int) and not isinstance(current, bool) and current == epoch:
        return
    set_epoch(epoch)


def record(worker_id: int, dataset, iterator, ended: bool) -> dict:
    """The state of one copy now (see the module docstring)."""
    own = iterator is dataset
    return {
        "worker_id": worker_id,
        "dataset_state": dataset.state_dict() if not own and is_stateful(dataset) else None,
        "fetcher_state": {"dataset_iter_state": iterator.state_dict() if is_stateful(iterator) else None,
                          "fetcher_ended": ended},
    }


class CopyState:
    """One copy of an iterable in one epoch: its iterator, whether to capture its state, and
    whether it ran out. Made when the epoch's first batch is asked of the copy: it gets
    ``set_epoch(epoch)`` first, then ``resume`` (a :class:`~aioload._workers.messages.ResumeCopy`)
    gives it the saved state."""

    __slots__ = ("worker_id", "dataset", "iterator", "capture", "ended", "restart")

    def __init__(self, worker_id: int, dataset, resume=None, epoch: int = 0):
        self.worker_id = worker_id
        self.dataset = dataset
        forward_epoch(dataset, epoch)
        saved = resume.record if resume is not None else None
        fetcher = (saved or {}).get("fetcher_state") or {}
        if resume is not None and resume.fresh:  # a new epoch after the saved one: a new iterator
            fetcher = {}
        # A state carried over from the last epoch's end that leaves the copy nothing to yield
        # was the end of that epoch's stream: the live copy's next __iter__ started the stream
        # again, and so does this one (see batch())
        self.restart = False
        if saved is not None and saved.get("dataset_state") is not None and is_stateful(dataset):
            dataset.load_state_dict(saved["dataset_state"])
            self.restart = resume.fresh
        self.iterator: Any = iter(dataset)
        self.capture = is_stateful(dataset) or is_stateful(self.iterator)
        self.ended = bool(fetcher.get("fetcher_ended", False))
        if saved is not None and fetcher.get("dataset_iter_state") is not None and is_stateful(self.iterator):
            self.iterator.load_state_dict(fetcher["dataset_iter_state"])
        elif resume is not None and resume.skip and not self.capture and not self.ended:
            # Not Stateful: drop what was delivered before the save (its cost is the warning's)
            self.iterator = _dropped(self.iterator, resume.skip)

    def note(self, taken: int) -> CopyNote:
        """What a task did to the copy (a :class:`~aioload._workers.messages.CopyNote`): its
        record only where something in it is Stateful (the only cost of the protocol)."""
        state = record(self.worker_id, self.dataset, self.iterator, self.ended) if self.capture else None
        return CopyNote(state, self.ended, taken)

    def batch(self, batch_size: int | None, drop_last: bool) -> list | None:
        """The next batch's items (one item for ``batch_size=None``); ``None`` once the copy has
        run out (as torch's fetcher: an iterator that ended is not asked again)."""
        if self.ended:
            return None
        items = self._take(batch_size or 1)
        if self.restart:
            self.restart = False
            if not items:  # the carried state was the end of the last epoch's stream
                self.ended = False
                self.iterator = iter(self.dataset)
                items = self._take(batch_size or 1)
        if not items or (batch_size is not None and drop_last and len(items) < batch_size):
            return None
        return items

    def _take(self, count: int) -> list:
        # next() each time: islice would call iter() on the iterator, and an iterator that is its
        # own dataset may start over in __iter__
        items, step = [], self.iterator.__next__
        try:
            for _ in range(count):
                items.append(step())
        except StopIteration:
            self.ended = True
        return items


def dataset_note(worker_id: int, dataset) -> CopyNote:
    """A map-style dataset's state after a task (the record's ``dataset_state``)."""
    return CopyNote(record(worker_id, dataset, None, False), False, 0)


def load_dataset_state(dataset, saved: dict | None) -> None:
    """Give a map-style dataset (a worker's copy, or in process the dataset) its saved state."""
    if saved is not None and saved.get("dataset_state") is not None and is_stateful(dataset):
        dataset.load_state_dict(saved["dataset_state"])


def _dropped(iterator, count: int):
    """``iterator`` past its first ``count`` items (fewer where it runs out first)."""
    step = iterator.__next__
    try:
        for _ in range(count):
            step()
    except StopIteration:
        pass
    return iterator
