"""Resumption checked generically, as torchdata's ``run_test_save_load_state`` does it: run a
loader uninterrupted, then the same run stopped after ``k`` batches, saved through a
checkpoint, loaded into a new loader (and stopped and saved again, for a second resume), and
compare what the pieces delivered with the whole.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Callable, Iterable

import torch


@contextlib.contextmanager
def may_fast_forward():
    """A resumed epoch that may, or may not, fast-forward a copy (and say so with a
    ``FastForwardWarning``): what the test checks is the batches, not the way there."""
    from aioload._plan.stateful import FastForwardWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FastForwardWarning)
        yield


def roundtrip(state: dict) -> dict:
    """What survives a checkpoint: ``torch.save``, then ``torch.load(weights_only=True)``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def piece(make: Callable, key: Callable, epochs: int, state: dict | None = None, stop: int | None = None,
          loading=contextlib.nullcontext, first: int = 0,
          on_epoch: Callable | None = None) -> tuple[list, dict | None, int]:
    """From a new loader (``state`` loaded into it; the load and the run inside ``loading()``,
    since a resumed epoch says what it costs when it starts), iterate epochs
    ``first`` to ``epochs - 1`` (``on_epoch(loader, epoch)`` before each: the training loop's
    ``set_epoch``), stopping after ``stop`` batches (``None``: to the end). Returns what it
    delivered (``key`` of each batch), the checkpoint saved at the stop (``None`` without one):
    the loader's state and torch's global RNG state, which a training script saves and restores
    (the loader draws each epoch's seeds from it without ``seed=``), and the epoch the stop fell in."""
    seen: list = []
    with make() as loader, (loading() if state is not None else contextlib.nullcontext()):
        if state is not None:
            torch.set_rng_state(state["torch_rng"])  # the training script's own, from its checkpoint
            loader.load_state_dict(state["loader"])
        for epoch in range(first, epochs):
            if on_epoch is not None:
                on_epoch(loader, epoch)
            for batch in loader:
                seen.append(key(batch))
                if stop is not None and len(seen) == stop:
                    return seen, roundtrip({"loader": loader.state_dict(), "torch_rng": torch.get_rng_state()}), epoch
    return seen, None, epochs


def resumed(make: Callable, key: Callable, stops: Iterable[int], epochs: int = 1,
            loading=contextlib.nullcontext, on_epoch: Callable | None = None) -> list:
    """What a run of ``epochs`` epochs delivers when it is stopped after ``stops[0]`` batches,
    resumed in a new loader and stopped again after ``stops[1]`` more, and so on, then resumed
    to its end: the pieces' batches, in the order they came. A resumed piece starts at the
    epoch its state was saved in (the training script's own count, saved with its checkpoint)."""
    stops = list(stops)
    seen, state, epoch = piece(make, key, epochs, stop=stops[0], on_epoch=on_epoch)
    for stop in stops[1:] + [None]:
        if state is None:
            raise AssertionError(f"the run ended after {len(seen)} batches, before the stop at {stop}")
        more, state, epoch = piece(make, key, epochs, state, stop, loading, epoch, on_epoch)
        seen += more
    return seen


def uninterrupted(make: Callable, key: Callable, epochs: int = 1, on_epoch: Callable | None = None) -> list:
    return piece(make, key, epochs, on_epoch=on_epoch)[0]
