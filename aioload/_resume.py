"""The saved state of a loader (``loader.state_dict()``): what it holds and how it is checked.

A state is plain data (dicts, lists, strings, ints, bools, ``None``), so ``json.dumps`` and
``torch.save(..., weights_only=True)`` both take it::

    {"aioload_state": 1,
     "epoch": 3,                          # the epoch in progress, or the next one
     "config": {...},                     # what must match in the loader that loads it
     "rng": {"loader": {"global": False, "state": "<base64>"}, ...},
     "kept_base": None | [0, 123],        # persistent workers without seed=: the first base seed
     "progress": None | {                 # None: saved between epochs
         "base_seed": 123,                # the epoch's augmentation seed
         "delivered": {"below": 40, "also": [42]},   # batch sequence numbers received
         "batches": None | [[41, [7, 3]], [43, [9, 1]], ...]}}  # not replayable: what is left

``rng`` holds generator states at the start of the epoch in progress (between epochs: as they
are now, torch's global RNG excepted), so that replaying the sampler gives the same order.
"""

from __future__ import annotations

import base64
import contextlib
import operator

import torch

VERSION = 1


class ResumeError(ValueError):
    """A state cannot be saved or loaded exactly; the message says why and what to do."""


# -- generator states ---------------------------------------------------------------------
def snapshot(generators: dict) -> dict:
    """``{role: {"global": bool, "state": base64}}`` for each generator (``None``: global RNG)."""
    out = {}
    for role, gen in generators.items():
        state = torch.get_rng_state() if gen is None else gen.get_state()
        out[role] = {"global": gen is None, "state": base64.b64encode(state.numpy().tobytes()).decode("ascii")}
    return out


@contextlib.contextmanager
def restored(saved: dict, generators: dict):
    """Give each generator its saved state. A loader's own generators keep it (they go on as in
    the saved run); torch's global RNG gets it back only inside the block, so that the training
    script's own RNG state (its to save and restore) is left as it was."""
    keep = None
    for role, entry in saved.items():
        state = torch.frombuffer(bytearray(base64.b64decode(entry["state"])), dtype=torch.uint8)
        gen = generators[role]
        if gen is None:
            keep = torch.get_rng_state()
            torch.set_rng_state(state)
        else:
            gen.set_state(state)
    try:
        yield
    finally:
        if keep is not None:
            torch.set_rng_state(keep)


# -- what must match ----------------------------------------------------------------------
_SAMPLER_FIELDS = ("num_replicas", "world_size", "rank", "shuffle", "seed", "drop_last", "replacement",
                   "num_samples", "batch_size")


def _describe(sampler) -> str:
    fields = []
    for name in _SAMPLER_FIELDS:
        value = getattr(sampler, name, None)
        if isinstance(value, (bool, int)):
            fields.append(f"{name}={value}")
    inner = getattr(sampler, "sampler", None)
    if inner is not None and inner is not sampler:
        fields.insert(0, _describe(inner))
    return f"{type(sampler).__qualname__}({', '.join(fields)})"


def config(torch_loader, seed: int | None, generators: dict, base_seeds: str) -> dict:
    dataset = torch_loader.dataset
    try:
        length = len(dataset)
    except TypeError:
        length = None
    return {
        "dataset_len": length,
        "batch_size": torch_loader.batch_size,
        "drop_last": torch_loader.drop_last,
        "sampler": _describe(torch_loader._index_sampler),
        "seed": seed,
        "base_seeds": base_seeds,
        "generators": {role: gen is None for role, gen in generators.items()},
    }


# -- packing ------------------------------------------------------------------------------
def progress(base_seed: int, delivered, batches: list | None) -> dict:
    return {
        "base_seed": base_seed,
        "delivered": {"below": delivered.low, "also": sorted(delivered.above)},
        "batches": None if batches is None else [[seq, _plain(indices)] for seq, indices in batches],
    }


def pack(epoch: int, cfg: dict, rng: dict, prog: dict | None, kept_base: tuple | None = None) -> dict:
    return {"aioload_state": VERSION, "epoch": epoch, "config": cfg, "rng": rng, "progress": prog,
            "kept_base": None if kept_base is None else list(kept_base)}


def unpack(state, cfg: dict) -> dict:
    """Check a saved state against this loader's ``cfg``; returns it with indices decoded."""
    if not isinstance(state, dict) or state.get("aioload_state") != VERSION:
        raise ResumeError(
            f"not an aioload.DataLoader state of version {VERSION}: pass what loader.state_dict() returned"
        )
    for key, mine in cfg.items():
        saved = state["config"].get(key)
        if saved != mine:
            raise ResumeError(
                f"this state was saved by a loader with {key}={saved!r}, but this loader has "
                f"{key}={mine!r}: exact resume needs the same dataset, batching, sampler, seed and "
                "ranks (num_workers, io_concurrency and in_order may differ)"
            )
    prog = state["progress"]
    if prog is not None:
        batches = prog["batches"]
        prog = dict(prog, batches=None if batches is None else [(seq, _unplain(b)) for seq, b in batches])
    kept = state.get("kept_base")
    return {"epoch": state["epoch"], "rng": state["rng"], "progress": prog,
            "kept_base": None if kept is None else tuple(kept)}


def _plain(indices):
    """Indices as JSON data: ints, strings and lists as they are, a tuple tagged as one."""
    if isinstance(indices, str):
        return indices
    if isinstance(indices, list):
        return [_plain(i) for i in indices]
    if isinstance(indices, tuple):
        return {"tuple": [_plain(i) for i in indices]}
    try:
        return operator.index(indices)
    except TypeError:
        raise ResumeError(
            f"cannot save the sampler's index {indices!r} ({type(indices).__name__}): a sampler aioload "
            "cannot replay is saved as its remaining indices, which must be ints, strings, lists or tuples"
        ) from None


def _unplain(data):
    if isinstance(data, dict):
        return tuple(_unplain(i) for i in data["tuple"])
    if isinstance(data, list):
        return [_unplain(i) for i in data]
    return data
