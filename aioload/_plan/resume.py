"""The saved state of a loader (``loader.state_dict()``): what it holds and how it is checked.

A state is plain data (dicts, lists or tuples, strings, ints, bools, ``None``), so
``json.dumps`` and ``torch.save(..., weights_only=True)`` both take it::

    {"aioload_state": 1,
     "epoch": 3,                          # the epoch in progress, or the next one
     "config": {...},                     # what must match in the loader that loads it
     "rng": {"loader": {"global": False, "state": "<base64>"}, ...},
     "kept_base": None | [0, 123],        # persistent workers without seed=: the first base seed
     "worker_streams": "new" | [{...}],   # optional, persistent workers without seed=, at an epoch's start
     "progress": None | {                 # None: saved between epochs
         "base_seed": 123,                # the epoch's augmentation seed
         "delivered": {"below": 40, "also": [42]},   # batch sequence numbers received
         "batches": None | [[41, [7, 3]], [43, [9, 1]], ...],  # not replayable: what is left
         "rank": None | 0,                # with "batches": the rank whose indices they are
         "inexact": None | "<why>",       # the position inside the epoch was not saved
         "order_seed": None | 7,          # the seed the epoch's order was computed from
         "segments": [[4, 10, []]]},      # earlier parts of the epoch on other world sizes
     "stateful": {...},                   # optional: an IterableDataset's copies (aioload._plan.stateful)
     "sampler": <sampler.state_dict()>}   # optional: a Stateful sampler's, at the epoch's start

``rng`` holds generator states at the start of the epoch in progress (between epochs: as the
next epoch will draw from them, torch's global RNG included where the loader draws from it), so
that replaying the sampler gives the same order.

``worker_streams`` (persistent workers without ``seed=``, in a state of an epoch's start or
saved between epochs) says what the workers' random streams are when that epoch starts:
``"new"``, new workers (seeded from the epoch's base seed, as the saved run's were), or one
record per worker (:func:`aioload._base.seeding.capture_streams`: its seed and its torch, ``random``
and numpy streams), the streams the saved run's persistent workers had gone on to.
Nothing in a state names the rank that saved it unless it lists that rank's own indices
(``batches``): under ``torch.distributed`` ranks move in lockstep through shards of equal
length, so one rank's state resumes every rank. ``config["world_size"]`` is the number of
ranks the order is split between. It must match, except for a loader whose order aioload
computes (its own sharding, with the epoch's ``order_seed`` known): there a state saved on
``N`` ranks loads on ``M``, the delivered batches become a *segment* (``[world_size, below,
also]``) and the rest of the epoch is dealt again over the ``M`` ranks
(:mod:`aioload._plan.elastic`).

The ``stateful`` entry holds the dataset's own states, which may be any value (a tensor, say):
it is checked by :func:`aioload._plan.stateful.check` and exempt from the plain-data rule. So is
``sampler``: the state a Stateful sampler (or batch sampler) returned from ``state_dict()`` at
the start of the epoch in progress (between epochs: now), before the epoch's ``iter()``. A
resumed epoch gives it back through ``load_state_dict()`` and replays the sampler from it,
skipping the delivered batches.

A state with ``inexact`` stands for the start of its epoch: saving never fails, and loading it
warns with :class:`ResumeWarning` (see docs/reproducibility.md).

:func:`unpack` checks every field before anything uses one, so that a malformed state fails
at ``load_state_dict()`` with a :class:`ResumeError` that names the field, never later.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import operator
import reprlib
from dataclasses import dataclass

import torch

from aioload._base.errors import ResumeError, ResumeWarning, a_kind
from aioload._plan.stateful import check as check_stateful
from aioload._plan.stateful import check_depth

VERSION = 1
MAX_DEPTH = 32  # a state needs 4 levels, plus the nesting of the sampler's indices
_SEED_MAX = 2**63 - 1  # base seeds are drawn as non-negative int64, or derived as 63-bit ints
_EPOCH_MAX = 2**63 - 1
_RNG_BYTES = torch.Generator().get_state().numel()
_PERSISTENT = "drawn once (persistent workers)"
_WORLD_MAX = 2**31 - 1  # torch.distributed numbers ranks with 32-bit ints

ITERABLE_MIDDLE = (
    "the position inside an epoch of an IterableDataset is not saved: aioload cannot know how "
    "far each worker's copy of the stream has read"
)


class Unsaveable(Exception):
    """Why the position inside an epoch cannot be saved exactly (the state then stands for the
    epoch's start, with this reason)."""


# -- generator states ---------------------------------------------------------------------
def snapshot(generators: dict) -> dict:
    """``{role: {"global": bool, "state": base64}}`` for each generator (``None``: global RNG)."""
    out = {}
    for role, gen in generators.items():
        state = torch.get_rng_state() if gen is None else gen.get_state()
        out[role] = {"global": gen is None, "state": base64.b64encode(state.numpy().tobytes()).decode("ascii")}
    return out


def rng_tensor(encoded: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(encoded, validate=True)), dtype=torch.uint8)


@contextlib.contextmanager
def restored(saved: dict, generators: dict):
    """Give each generator its saved state. A loader's own generators keep it (they go on as in
    the saved run); torch's global RNG gets it back only inside the block, so that the training
    script's own RNG state (its to save and restore) is left as it was."""
    keep = None
    for role, entry in saved.items():
        state = rng_tensor(entry["state"])
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
# No rank: each rank's shard has the same length and moves in lockstep, so a position saved on
# one rank holds on every rank (frameworks save one checkpoint, from rank 0).
_SAMPLER_FIELDS = ("num_replicas", "world_size", "shuffle", "seed", "drop_last", "replacement",
                   "num_samples", "batch_size")


def _describe(sampler) -> str:
    if callable(getattr(sampler, "order_seed", None)):
        # aioload's ShardByRank: described apart from the world it runs in, since its states
        # resume on another number of ranks (the world size is checked against the position)
        return f"ShardByRank(shuffle={sampler.shuffle}, drop_last={sampler.drop_last}, planned={sampler.planned})"
    fields = []
    for name in _SAMPLER_FIELDS:
        value = getattr(sampler, name, None)
        if isinstance(value, (bool, int)):
            fields.append(f"{name}={value}")
    inner = getattr(sampler, "sampler", None)
    if inner is not None and inner is not sampler:
        fields.insert(0, _describe(inner))
    return f"{type(sampler).__qualname__}({', '.join(fields)})"


def config(torch_loader, seed: int | None, generators: dict, base_seeds: str, world_size: int | None) -> dict:
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
        "world_size": world_size,
        **_sources(dataset),
    }


def _sources(dataset) -> dict:
    """An :class:`aioload.Mix`'s sources by name and length (a state must be loaded into a mix
    of the same sources)."""
    if not callable(getattr(dataset, "mixed_order", None)):
        return {}
    return {"sources": [[name, length] for name, length in zip(dataset.names, dataset.lengths)]}


_WORLD_MAY = {True: ", and so may the world size: this loader shards the dataset itself (elastic resume)",
              False: "; the world size may differ where the loader shards a map-style dataset itself, "
                     "docs/reproducibility.md"}
"""What a refused state's message says of the world size: ``elastic`` or not."""


def check_world(saved: int | None, mine: int | None, action: str, why: str = "") -> None:
    """Refuse to resume a position saved with another number of ranks (``why``: the reason a
    loader that could resume on another number of ranks cannot resume this state)."""
    if saved is None or mine is None or saved == mine:
        return
    if why:
        raise ResumeError(
            f"this state was saved with world_size={saved}, but this loader runs with world_size={mine}, "
            f"and {why}"
        )
    hint = ""
    if mine == 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        hint = (f"; torch.distributed is not initialised here: {action} after init_process_group() "
                "(the framework's setup) in each of the processes")
    raise ResumeError(
        f"this state was saved with world_size={saved}, but this loader runs with world_size={mine}: "
        f"each rank's shard, and so the saved position, depends on the number of ranks; resume on "
        f"{saved} process{'es' if saved > 1 else ''}{hint}"
    )


# -- packing ------------------------------------------------------------------------------
def progress(base_seed: int, delivered, batches: tuple | None, rank: int | None = None,
             inexact: str | None = None, order_seed: int | None = None, segments=()) -> dict:
    """The ``progress`` entry. ``batches`` is already plain data (see :func:`plain`); it may
    be shared by successive states of one epoch, so a state is to be treated as read-only.
    ``segments``: :class:`aioload._plan.elastic.Segment` s of the epoch run on other world sizes."""
    return {
        "base_seed": base_seed,
        "delivered": {"below": delivered.low, "also": sorted(delivered.above)},
        "batches": batches,
        "rank": rank,
        "inexact": inexact,
        "order_seed": order_seed,
        "segments": [[s.world_size, s.low, list(s.above)] for s in segments],
    }


NEW_WORKERS = "new"
"""``worker_streams`` of an epoch that starts new workers."""


def pack(epoch: int, cfg: dict, rng: dict, prog: dict | None, kept_base: tuple | None = None,
         mix: dict | None = None, worker_streams: str | tuple | None = None) -> dict:
    state = {"aioload_state": VERSION, "epoch": epoch, "config": cfg, "rng": rng, "progress": prog,
             "kept_base": None if kept_base is None else list(kept_base)}
    if mix is not None:
        state["mix"] = mix
    if worker_streams is not None:
        state["worker_streams"] = worker_streams if isinstance(worker_streams, str) else list(worker_streams)
    return state


def mix_entry(names, weights, schedule) -> dict:
    """An :class:`aioload.Mix`'s weights now and, mid-epoch, the epoch's schedule of them."""
    named = lambda w: dict(zip(names, w))  # noqa: E731
    return {"weights": named(weights),
            "schedule": None if schedule is None else [[start, named(w)] for start, w in schedule]}


def plain(indices):
    """Indices as JSON data: ints, strings and lists as they are, a tuple tagged as one."""
    if isinstance(indices, str):
        return indices
    if isinstance(indices, list):
        return [plain(i) for i in indices]
    if isinstance(indices, tuple):
        return {"tuple": [plain(i) for i in indices]}
    try:
        return operator.index(indices)
    except TypeError:
        raise Unsaveable(
            f"the sampler's index {reprlib.repr(indices)} ({type(indices).__name__}) cannot be saved: a "
            "sampler aioload cannot replay is saved as its remaining indices, which must be ints, "
            "strings, lists or tuples"
        ) from None


def _unplain(data):
    if isinstance(data, dict):
        return tuple(_unplain(i) for i in data["tuple"])
    if isinstance(data, (list, tuple)):
        return [_unplain(i) for i in data]
    return data


# -- checking a state ---------------------------------------------------------------------
@dataclass(frozen=True)
class Expected:
    """What a state a loader can load looks like."""

    config: dict  # the loader's own configuration (see config())
    batches: int | None  # batches in one of its epochs; None: its sampler has no len()
    iterable: bool  # an IterableDataset: no position inside an epoch
    batched: bool  # each sampler item is a batch of indices (torch's auto-collation)
    batch_size: int | None  # the most indices in a batch; None: any number
    rank: int  # this process's rank (0 outside torch.distributed)
    mix: tuple[str, ...] | None = None  # an aioload.Mix's source names: the state holds its weights
    listed: "Listed | None" = None  # a sampler given as a list of indices: the only ones a state may name
    # A loader whose order aioload computes resumes on another world size; the position in
    # each part of the epoch is then checked against that part's batches by the planner,
    # which knows the epoch's order (aioload._plan.sampling.Planner.load).
    elastic: bool = False


class Listed:
    """The indices of a sampler given as a sequence (a list, tuple or range of indices, or of
    batches of them, as torch accepts one): a state of its epoch names no other. Gathered when
    a state first asks, once per load."""

    def __init__(self, items):
        self.items = items
        self._found: frozenset | range | None = items if isinstance(items, range) else None

    def __contains__(self, index: int) -> bool:
        if self._found is None:
            found = set()
            for item in self.items:
                for i in item if isinstance(item, (list, tuple)) else (item,):
                    try:
                        found.add(operator.index(i))  # as plain() saves it: a numpy int, a 0-d tensor
                    except TypeError:
                        pass  # a key of another kind (a string): not an int index
            self._found = frozenset(found)
        return index in self._found

    def __str__(self) -> str:
        batches = len(self.items) and isinstance(self.items[0], (list, tuple))
        return f"a {type(self.items).__name__} of {len(self.items)} {'batches' if batches else 'indices'}"


def listed(sampler) -> Listed | None:
    """:class:`Listed` for a sampler given as a list, tuple or range, else ``None``."""
    return Listed(sampler) if type(sampler) in (list, tuple, range) else None


def _fail(path: str, problem: str) -> ResumeError:
    return ResumeError(f"cannot load this state: {path} {problem}; pass what loader.state_dict() returned")


def _check_plain(state) -> None:
    """Every value is plain data, nested at most MAX_DEPTH deep (walked without recursion)."""
    stack = [(state, "the state", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _fail(path, f"is nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise _fail(path, f"has the key {reprlib.repr(key)}: keys are strings")
                stack.append((item, key if path == "the state" else f"{path}.{key}", depth + 1))
        elif isinstance(value, (list, tuple)):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                raise _fail(path, f"is {value}: a state's numbers are finite")
        elif value is not None and not isinstance(value, (str, int)):
            raise _fail(path, f"is {a_kind(type(value).__name__)}: a state holds only dicts, lists, strings, "
                              "numbers, bools and None")


def _keys(value, path: str, required, optional=()) -> dict:
    if not isinstance(value, dict):
        raise _fail(path, f"must be a dict, got {type(value).__name__}")
    missing = [k for k in required if k not in value]
    if missing:
        raise _fail(path, f"has no {', '.join(repr(k) for k in missing)}")
    unknown = sorted(set(value) - set(required) - set(optional))
    if unknown:
        raise _fail(path, f"has unexpected keys {unknown}")
    return value


def _int(value, path: str, low: int, high: int | None, what: str = "") -> int:
    """``value``, an int in ``[low, high]`` (``high=None``: no upper bound)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(path, f"must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
        raise _fail(path, f"must be {bound}{what}, got {value}")
    return value


def _seq(value, path: str) -> list | tuple:
    if not isinstance(value, (list, tuple)):
        raise _fail(path, f"must be a list, got {type(value).__name__}")
    return value


def unpack(state, exp: Expected) -> dict:
    """Check every field of a saved state against the loader described by ``exp``; returns it
    with indices decoded. Raises :class:`ResumeError` naming the field that is wrong."""
    if not isinstance(state, dict) or type(state.get("aioload_state")) is not int or state["aioload_state"] != VERSION:
        raise ResumeError(
            f"not an aioload.DataLoader state of version {VERSION}: pass what loader.state_dict() returned"
        )
    _check_plain({key: value for key, value in state.items() if key not in ("stateful", "sampler")})
    _keys(state, "the state", ("aioload_state", "epoch", "config", "rng", "progress"),
          ("kept_base", "mix", "stateful", "sampler", "worker_streams"))
    cfg = _check_config(state["config"], exp)
    epoch = _int(state["epoch"], "epoch", 0, _EPOCH_MAX)
    prog = state["progress"]
    rng = _check_rng(state["rng"], exp.config["generators"], mid_epoch=prog is not None)
    kept = _check_kept(state.get("kept_base"), exp.config["base_seeds"])
    world = cfg.get("world_size")
    mix = _check_mix(state.get("mix"), exp.mix, mid_epoch=prog is not None)
    sampler = state.get("sampler")
    check_depth(sampler, "sampler")
    prog = None if prog is None else _check_progress(prog, exp, world)
    streams = _check_streams(state.get("worker_streams"), exp.config["base_seeds"], prog)
    return {"epoch": epoch, "rng": rng, "progress": prog,
            "kept_base": kept, "world_size": world, "mix": mix, "worker_streams": streams,
            "stateful": check_stateful(state.get("stateful"), exp.iterable, exp.batch_size if exp.batched else 1),
            "sampler": sampler}


def _check_mix(mix, names: tuple[str, ...] | None, mid_epoch: bool) -> dict | None:
    """A mix's weights (and, mid-epoch, the epoch's schedule), as tuples in source order."""
    if names is None:
        if mix is not None:
            raise _fail("mix", "must be absent: this loader's dataset is not an aioload.Mix")
        return None
    if mix is None:
        raise _fail("the state", "has no 'mix': this loader's dataset is an aioload.Mix, whose weights a state holds")
    _keys(mix, "mix", ("weights", "schedule"))
    weights = _weights(mix["weights"], "mix.weights", names)
    if mix["schedule"] is None:
        if mid_epoch:
            raise _fail("mix.schedule", "must be the epoch's weight changes, saved mid-epoch, got None")
        return {"weights": weights, "schedule": None}
    if not mid_epoch:
        raise _fail("mix.schedule", "must be None between epochs")
    entries = _seq(mix["schedule"], "mix.schedule")
    if not entries:
        raise _fail("mix.schedule", "must hold the weights the epoch started with")
    schedule, last = [], -1
    for i, entry in enumerate(entries):
        path = f"mix.schedule[{i}]"
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise _fail(path, "must be a [position, weights] pair")
        start = _int(entry[0], f"{path}[0]", 0, 0 if i == 0 else _EPOCH_MAX)
        if start <= last:
            raise _fail(f"{path}[0]", f"must be greater than the position before it ({last}), got {start}")
        last = start
        schedule.append((start, _weights(entry[1], f"{path}[1]", names)))
    return {"weights": weights, "schedule": tuple(schedule)}


def _weights(value, path: str, names: tuple[str, ...]) -> tuple[float, ...]:
    from aioload._mix.weights import check_weights

    try:
        return check_weights(value, names)
    except (TypeError, ValueError) as exc:
        raise _fail(path, f"is not the mix's weights ({exc})") from None


def _check_config(cfg, exp: Expected) -> dict:
    mine = exp.config
    # "world_size" is optional: states written before it existed lack it (their sampler
    # description still names the world size of a sharded loader).
    _keys(cfg, "config", [k for k in mine if k != "world_size"], ("world_size",))
    if "world_size" in cfg:
        if cfg["world_size"] is not None:
            _int(cfg["world_size"], "config.world_size", 1, _WORLD_MAX)
        if not exp.elastic:
            check_world(cfg["world_size"], mine["world_size"], "load_state_dict()")
    for key, value in mine.items():
        if key == "world_size" and exp.elastic:
            continue  # checked against the epoch's position (_check_progress)
        saved = cfg.get(key, value)
        if saved != value or type(saved) is not type(value):
            raise ResumeError(
                f"this state was saved by a loader with {key}={reprlib.repr(saved)}, but this loader has "
                f"{key}={value!r}: exact resume needs the same dataset, batching, sampler and seed "
                f"(num_workers, io_concurrency and in_order may differ{_WORLD_MAY[exp.elastic]}); load it into a "
                f"loader made as the one that saved it"
            )
    return cfg


def _check_rng(rng, roles: dict, mid_epoch: bool) -> dict:
    """Mid-epoch, every generator's state at the epoch's start; between epochs, those of the
    loader's own generators and, where the next epoch draws from it, torch's global RNG (a
    state written before it was saved there has none: the next epoch then draws from the
    global RNG as it is)."""
    wanted = [role for role, is_global in roles.items() if mid_epoch or not is_global]
    _keys(rng, "rng", wanted, [role for role in roles if role not in wanted])
    for role in rng:
        entry = _keys(rng[role], f"rng.{role}", ("global", "state"))
        if entry["global"] is not roles[role]:
            which = "torch's global RNG" if roles[role] else "a generator of its own"
            raise _fail(f"rng.{role}.global", f"must be {roles[role]}: this loader's {role!r} generator is {which}")
        _check_rng_state(entry["state"], f"rng.{role}.state")
    return rng


def _check_rng_state(encoded, path: str) -> None:
    if not isinstance(encoded, str):
        raise _fail(path, f"must be a base64 string, got {type(encoded).__name__}")
    try:
        state = rng_tensor(encoded)
    except (binascii.Error, ValueError) as exc:
        raise _fail(path, f"is not valid base64 ({exc})") from None
    if state.numel() != _RNG_BYTES:
        raise _fail(path, f"must decode to a generator state of {_RNG_BYTES} bytes, got {state.numel()}")
    try:
        torch.Generator().set_state(state)
    except RuntimeError as exc:
        raise _fail(path, f"is not a torch generator state ({exc})") from None


def _check_kept(kept, base_seeds: str) -> tuple | None:
    if kept is None:
        return None
    if base_seeds != _PERSISTENT:
        raise _fail("kept_base", f"must be None: this loader's base seeds are {base_seeds}")
    pair = _seq(kept, "kept_base")
    if len(pair) != 2:
        raise _fail("kept_base", f"must be [epoch, base seed], got {len(pair)} items")
    return (_int(pair[0], "kept_base[0]", 0, _EPOCH_MAX), _int(pair[1], "kept_base[1]", 0, _SEED_MAX))


def _check_streams(streams, base_seeds: str, prog) -> str | tuple | None:
    """``worker_streams``: ``"new"`` or one record per worker, in a state of an epoch's start."""
    if streams is None:
        return None
    if base_seeds != _PERSISTENT:
        raise _fail("worker_streams", f"must be absent: this loader's base seeds are {base_seeds}, and only "
                                      "persistent workers without seed= carry their streams")
    if prog is not None and (prog["delivered"]["below"] or prog["delivered"]["also"]):
        raise _fail("worker_streams", "must be absent in a state saved after its epoch delivered a batch")
    if streams == NEW_WORKERS:
        return streams
    records = _seq(streams, "worker_streams")
    if not records:
        raise _fail("worker_streams", f"must be {NEW_WORKERS!r} or one record per worker, got an empty list")
    from aioload._base.seeding import check_streams

    for i, record in enumerate(records):
        path = f"worker_streams[{i}]"
        _keys(record, path, ("seed", "torch", "random", "numpy"))
        _int(record["seed"], f"{path}.seed", 0, 2**64 - 1)
        try:
            check_streams(record)
        except (binascii.Error, ValueError, RuntimeError, TypeError) as exc:
            raise _fail(path, f"is not a worker's random streams ({exc})") from None
    return tuple(records)


def _check_progress(prog, exp: Expected, world: int | None) -> dict:
    _keys(prog, "progress", ("base_seed", "delivered", "batches"), ("rank", "inexact", "order_seed", "segments"))
    _int(prog["base_seed"], "progress.base_seed", 0, _SEED_MAX)
    order_seed = prog.get("order_seed")
    if order_seed is not None:
        _int(order_seed, "progress.order_seed", 0, _SEED_MAX)
    segments = _check_segments(prog.get("segments", []), exp)
    n = exp.batches
    # A sampler without len() is none that aioload replays (torch's and its own all have one),
    # and its rest cannot be written out: a state of its epoch delivered nothing, whatever it says
    # (an IterableDataset's, checked below, neither).
    of_n = f" (an epoch of this loader has {n} batches)" if n is not None else (
        " (this loader's sampler has no len(), so aioload can neither replay it nor write its rest out: "
        "a state of its epoch stands for the epoch's start)")
    top = n if n is not None else None if exp.iterable else 0
    if exp.elastic and world is not None and (segments or world != exp.config["world_size"]):
        top, of_n = _EPOCH_MAX, ""  # another world's position: the planner checks it against that world
    delivered = _keys(prog["delivered"], "progress.delivered", ("below", "also"))
    below = _int(delivered["below"], "progress.delivered.below", 0, top, of_n)
    also = _seq(delivered["also"], "progress.delivered.also")
    if also and top is not None and below >= top - 1:
        raise _fail("progress.delivered.also", f"must be empty after {below} batches{of_n}, got {reprlib.repr(also)}")
    for i, seq in enumerate(also):
        _int(seq, f"progress.delivered.also[{i}]", below + 1, None if top is None else top - 1, of_n)
    if len(set(also)) != len(also):
        raise _fail("progress.delivered.also", "lists a batch twice")
    inexact = prog.get("inexact")
    if inexact is not None and (not isinstance(inexact, str) or not inexact):
        raise _fail("progress.inexact", f"must be None or the reason, got {reprlib.repr(inexact)}")
    batches = prog["batches"]
    if (exp.iterable or inexact is not None) and (below or also or batches is not None):
        why = "an IterableDataset's epoch" if exp.iterable else "a state saved with progress.inexact"
        raise _fail("progress", f"must stand for the epoch's start: {why} resumes from its start only "
                                "(nothing delivered, no batches)")
    rank = prog.get("rank")
    if segments and (batches is not None or inexact is not None):
        raise _fail("progress.segments", "must be empty with progress.batches or progress.inexact")
    out = dict(prog, inexact=inexact, order_seed=order_seed, segments=segments)
    if batches is None:
        if rank is not None:
            raise _fail("progress.rank", "must be None without progress.batches")
        return dict(out, batches=None)
    if n is None:
        raise _fail("progress.batches", "must be None: this loader's sampler has no len(), so the rest of its "
                                        "epoch is never written out (such a state resumes by replaying the sampler)")
    decoded = _check_batches(batches, below, also, exp)
    if "rank" in prog and _int(rank, "progress.rank", 0, _WORLD_MAX - 1) != exp.rank:
        raise ResumeError(
            f"this state lists the remaining indices of rank {rank} (its sampler cannot be replayed, so "
            f"they were written out), but this is rank {exp.rank}: load into each rank the state it saved"
        )
    return dict(out, batches=decoded)


def _check_segments(segments, exp: Expected) -> list:
    """``[[world_size, below, also], ...]``, each within the batches of its part of the epoch."""
    seq = _seq(segments, "progress.segments")
    if seq and not exp.elastic:
        raise _fail("progress.segments", "must be empty: this loader's order is not computed by aioload "
                                         "(its own sharding), so it cannot resume on another world size")
    out: list = []
    for i, entry in enumerate(seq):
        path = f"progress.segments[{i}]"
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise _fail(path, "must be a [world_size, below, also] triple")
        world = _int(entry[0], f"{path}[0]", 1, _WORLD_MAX)
        below = _int(entry[1], f"{path}[1]", 0, _EPOCH_MAX)
        also = _seq(entry[2], f"{path}[2]")
        if not below and not also:  # so there are at most as many parts as samples in the epoch
            raise _fail(path, "delivers no batch: a part of the epoch is saved only once it delivered one")
        for j, number in enumerate(also):
            _int(number, f"{path}[2][{j}]", below + 1, _EPOCH_MAX)
        if len(set(also)) != len(also):
            raise _fail(f"{path}[2]", "lists a batch twice")
        out.append((world, below, tuple(sorted(also))))
    return out


def check_position(path: str, below: int, also, batches: int, world: int) -> None:
    """A position saved on ``world`` ranks, within the ``batches`` that part of the epoch has
    (called by the planner, which knows them)."""
    of_n = f" (that part of the epoch has {batches} batches on {world} rank{'s' if world > 1 else ''})"
    _int(below, f"{path}.below" if path.endswith("delivered") else f"{path}[1]", 0, batches, of_n)
    if also and below >= batches - 1:
        where = f"{path}.also" if path.endswith("delivered") else f"{path}[2]"
        raise _fail(where, f"must be empty after {below} batches{of_n}, got {reprlib.repr(list(also))}")
    for j, number in enumerate(also):
        where = f"{path}.also[{j}]" if path.endswith("delivered") else f"{path}[2][{j}]"
        _int(number, where, below + 1, batches - 1, of_n)


def _check_batches(batches, below: int, also, exp: Expected) -> list:
    """The remaining batches, which with the delivered ones (every batch below ``below``, and
    ``also``) must account for the epoch's batches from 0, each once; checked in the length of
    the lists, never of the epoch (``below`` may be millions)."""
    n = exp.batches
    of_n = "" if n is None else f" (an epoch of this loader has {n} batches)"
    out = []
    last = -1
    for i, pair in enumerate(_seq(batches, "progress.batches")):
        path = f"progress.batches[{i}]"
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise _fail(path, "must be a [sequence number, indices] pair")
        seq = _int(pair[0], f"{path}[0]", 0, None if n is None else n - 1, of_n)
        if seq <= last:
            raise _fail(f"{path}[0]", f"must be greater than the sequence number before it ({last}), got {seq}")
        last = seq
        _check_indices(pair[1], f"{path}[1]", exp)
        out.append((seq, _unplain(pair[1])))
    beyond = sorted(set(also) | {seq for seq, _ in out if seq >= below})  # what follows the batches below
    gap = next((below + i for i, seq in enumerate(beyond) if seq != below + i), None)
    if gap is not None:
        raise _fail("progress.batches", f"leaves out batch {gap}: with progress.delivered, it must account "
                                        "for every batch of the epoch from 0")
    if n is not None and n > 0 and not below and not beyond:
        raise _fail("progress.batches", f"is empty with nothing delivered: an epoch of this loader has {n} batches")
    return out


def _check_indices(value, path: str, exp: Expected) -> None:
    if not exp.batched:
        _check_index(value, path, exp)
        return
    if isinstance(value, dict):
        items = _tagged(value, path)
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        raise _fail(path, f"must be a batch (a list of indices), got {type(value).__name__}")
    if not items:
        raise _fail(path, "is an empty batch")
    if exp.batch_size is not None and len(items) > exp.batch_size:
        raise _fail(path, f"holds {len(items)} indices, more than this loader's batch_size={exp.batch_size}")
    for j, index in enumerate(items):
        _check_index(index, f"{path}[{j}]", exp)


def _check_index(value, path: str, exp: Expected) -> None:
    """A sample index: an int within the dataset, a string, a list of indices (passed to the
    dataset as one item, each of its ints an index within it too), or a tuple (a sampler's own
    key, passed as it is)."""
    if isinstance(value, bool):
        raise _fail(path, "must be an index, got a bool")
    if isinstance(value, int):
        length = exp.config["dataset_len"]
        if value < 0 or (length is not None and value >= length):
            bound = ("an index >= 0" if length is None
                     else f"an index in [0, {length - 1}] (the dataset has {length} samples)")
            raise _fail(path, f"must be {bound}, got {value}")
        if exp.listed is not None and value not in exp.listed:
            raise _fail(path, f"must be one of the indices of this loader's sampler ({exp.listed}), got {value}")
    elif isinstance(value, list):
        for j, item in enumerate(value):  # nested at most MAX_DEPTH deep (_check_plain)
            _check_index(item, f"{path}[{j}]", exp)
    elif isinstance(value, dict):
        _tagged(value, path)
    elif value is None:
        raise _fail(path, "must be an index, got None")


def _tagged(value: dict, path: str) -> list | tuple:
    """A tuple index, saved as ``{"tuple": [...]}``."""
    _keys(value, path, ("tuple",))
    return _seq(value["tuple"], f"{path}.tuple")
