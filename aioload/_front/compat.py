"""What torch's DataLoader shows besides batches: its warnings (too many workers, pinning that
cannot happen, an IterableDataset longer than its reported length), worded as the installed
torch words them, and its ``torch.profiler`` range around each batch."""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import warnings
import torch
from torch.autograd.profiler import record_function

from aioload._handoff import device as _device
# Profiler ranges around each batch, as torch's iterators have: the "enumerate(DataLoader)#"
# prefix is what profile viewers (TensorBoard's profiler plugin) count as data loading; the
# rest says it is aioload's and what the training loop was doing.
WAITING = "enumerate(DataLoader)#aioload.DataLoader.__next__ (waiting for a batch)"
WAITING_ASYNC = "enumerate(DataLoader)#aioload.DataLoader.__anext__ (waiting for a batch)"
LOADING = "enumerate(DataLoader)#aioload.DataLoader.__next__ (loading a batch in this process)"
_profiling = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)
_NO_RANGE = contextlib.nullcontext()


def profiled(name: str):
    """torch's ``record_function(name)`` while a profiler runs, else nothing. torch's
    iterators build the range for every batch; without a profiler that costs several times
    more than asking whether one runs (``python benchmarks/profiler_range.py``)."""
    return record_function(name) if _profiling() else _NO_RANGE


def len_called(torch_loader, iterable: bool) -> int | None:
    """What ``len(loader)`` reported for an IterableDataset before this epoch began (torch
    compares each epoch against the length known when its iterator was made)."""
    return getattr(torch_loader, "_IterableDataset_len_called", None) if iterable else None


@functools.cache
def _torch_source(method: str) -> str:
    """The source of a method of torch's DataLoader iterator, where some warnings' wording
    differs between torch releases ("" when the source is not installed)."""
    try:
        return inspect.getsource(getattr(torch.utils.data.dataloader._BaseDataLoaderIter, method))
    except (AttributeError, OSError, TypeError):
        return ""


def _length_gap() -> str:
    """torch's length warning joins the length and "(when accessing" with a space in some
    releases and without one in others: use the installed torch's text."""
    joined = re.search(r'\}\(when accessing|\}"\s*f?"\(when accessing', _torch_source("__next__"))
    return "" if joined else " "


def warn_as_torch_iterator(torch_loader, check_workers: bool, pin_memory: bool) -> None:
    """The warnings torch's DataLoader gives when it makes an iterator: too many workers for
    the CPUs (``check_workers``), and pinning that cannot happen. Called by the loader's
    ``__iter__`` (the warnings point at its caller)."""
    if check_workers:
        torch_loader.check_worker_number_rationality()
    if not pin_memory:
        return
    device = getattr(torch_loader, "pin_memory_device", "")
    if device and "pin_memory_device is deprecated" in _torch_source("__init__"):
        warnings.warn(
            "pin_memory_device is deprecated, the current accelerator will be used as the device,"
            f"ignore pin_memory_device='{device}'.",
            stacklevel=3,
        )
    if not _device.pin_available():
        warnings.warn(_device.PIN_WARNING, stacklevel=3)


def warn_iterable_length(dataset, num_workers: int, yielded: int, called: int | None) -> None:
    """torch's warning when an IterableDataset yields more than its reported length."""
    if called is not None and yielded > called:
        warnings.warn(
            f"Length of IterableDataset {dataset} was reported to be {called}{_length_gap()}"
            f"(when accessing len(dataloader)), but {yielded} samples have been fetched. "
            + ("For multiprocessing data-loading, this could be caused by not properly configuring the "
               "IterableDataset replica at each worker. Please see "
               "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples."
               if num_workers > 0 else ""),
            stacklevel=3,
        )
