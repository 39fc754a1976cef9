"""The Stateful protocol on the loader's side: what ``loader.state_dict()`` holds of each
worker's copy of an ``IterableDataset``, and how a resumed epoch hands it back.

Every batch of an iterable epoch carries what its task did to the copy that made it (a
:class:`~aioload._workers.messages.CopyNote`, made in the worker by
:mod:`aioload._workers.state`): the copy's state after the batch's items where the dataset or
its iterator is Stateful, whether the copy ran out, how many items it drew. :class:`Copies`
applies those notes in the order the training loop receives the batches, so the state is that
of the last delivered batch, exact at every step, however far the workers have run ahead.

The state's ``"stateful"`` entry (a key of the state beside ``progress``)::

    {"num_workers": 3,                  # the saved epoch's workers (0: loaded in process)
     "world_size": 1,                   # torch.distributed's ranks (1 outside it)
     "next_worker": 1,                  # the worker the epoch's next batch comes from
     "taken": [0, 40, 39],              # items each copy delivered in the epoch
     "in_order": True,                  # the epoch's batches came in turn (optional; see below)
     "workers": {"worker_0": {"worker_id": 0, "dataset_state": ..., "fetcher_state":
                              {"dataset_iter_state": ..., "fetcher_ended": True}}, ...}}

``in_order`` is true where the epoch's batches reached the training loop in their workers' turn
(``in_order=True``, no batch lost to an error): then ``taken`` fixes ``next_worker`` (the
workers still running delivered the same number of batches, one more for those before
``next_worker``), and a state whose ``next_worker`` does not match is refused. It is false
where any worker may have delivered last, and absent in states that predate it (and in one
converted from torchdata's), which are not cross-checked.

A map-style dataset that is Stateful has the same entry, of which only each worker's
``dataset_state`` is used: the state after the last delivered batch that worker made (torch's
round-robin dispatch gives batch ``i`` to worker ``i mod N``, so a resumed epoch hands each
worker its batches and the state it had for them). Its batches resume from the plan as always.

Each ``workers`` record has the shape of one worker's entry in torchdata's
``StatefulDataLoader`` state (see docs/migration.md); its ``dataset_state`` and
``dataset_iter_state`` are the dataset's own values, kept as they are (tensors included). Mid
epoch, a resumed copy loads its record before it yields anything; a copy that is not Stateful
is fast-forwarded instead, dropping its ``taken`` items (:class:`FastForwardWarning` names that
cost). Between epochs (``progress`` is ``None``) only the ``dataset_state`` s apply, to the
copies of the next epoch (an epoch counter, a shuffle seed), and only where the copies would
have lived on: persistent workers, or ``num_workers=0`` (torch's fresh workers get fresh copies);
a copy that a carried state leaves with nothing to yield (the end of the last epoch's stream)
starts its stream again, as the live copy did. A state saved with another number
of workers resumes its epoch from the start (:class:`~aioload._plan.resume.ResumeWarning`): each
worker's copy holds its own part of the stream; so does one saved with another number of ranks
(a rank's copies hold that rank's part: each rank loads the state it saved).
"""

from __future__ import annotations

import reprlib
import warnings

from aioload._base.errors import ResumeError, ResumeWarning
from aioload._workers.messages import CopyNote, ResumeCopy
from aioload._workers.state import drops_buffered_rows, forward_epoch, is_stateful, load_dataset_state

__all__ = ["Copies", "FastForwardWarning", "check", "drops_buffered_rows", "forward_epoch", "initial_entry",
           "is_stateful", "load_dataset_state", "resume_plan"]


class FastForwardWarning(ResumeWarning):
    """A resumed IterableDataset that is not Stateful is fast-forwarded: its copies run
    ``__iter__`` again and drop the items delivered before the save."""


def bare(worker_id: int, ended: bool) -> dict:
    """The record of a copy with nothing Stateful in it."""
    return {"worker_id": worker_id, "dataset_state": None,
            "fetcher_state": {"dataset_iter_state": None, "fetcher_ended": ended}}


def _has_state(record: dict) -> bool:
    return record["dataset_state"] is not None or record["fetcher_state"]["dataset_iter_state"] is not None


class Copies:
    """The copies of an IterableDataset in the epoch in progress, as of the last batch the
    consumer received (``num_workers=0``: the one copy in this process)."""

    def __init__(self, num_workers: int, world_size: int = 1, in_order: bool | None = True):
        n = max(1, num_workers)
        self.num_workers = num_workers
        self.world_size = world_size
        # whether the batches so far came in their workers' turn (None: not known, a state
        # without the field resumed): the batches of ``in_order=True`` do, until one is lost
        self.in_order = in_order
        self.records: list[dict | None] = [None] * n  # each copy's last Stateful record
        self.taken = [0] * n
        self.ended = [False] * n
        self.last: int | None = None  # the worker of the last batch delivered

    @classmethod
    def resumed(cls, entry: dict, fresh: bool, in_order: bool | None = True) -> "Copies":
        """The copies as ``entry`` saved them (``fresh``: a new epoch after it), for a loader
        with ``in_order``: the batches of its epoch go on in turn where the saved ones came so."""
        kept = in_order if fresh else (in_order and entry.get("in_order"))
        copies = cls(entry["num_workers"], entry["world_size"], kept)
        for wid in range(len(copies.records)):
            record = entry["workers"][f"worker_{wid}"]
            copies.records[wid] = record if _has_state(record) else None
            if not fresh:
                copies.taken[wid] = entry["taken"][wid]
                copies.ended[wid] = record["fetcher_state"]["fetcher_ended"]
        if not fresh:
            nxt = entry["next_worker"]
            copies.last = (nxt - 1) % len(copies.records)
        return copies

    def apply(self, notes) -> None:
        """``(worker id, CopyNote)`` pairs, in the order the consumer passed their batches."""
        for wid, note in notes:
            self.note(wid, note)

    def note(self, wid: int, note: CopyNote | None) -> None:
        if note is None:  # a batch of worker ``wid`` lost to an error: its turn passed uncounted
            if self.in_order:
                self.in_order = False
            return
        self.taken[wid] += note.taken
        self.ended[wid] = note.ended
        if note.record is not None:
            self.records[wid] = note.record
        if note.taken:
            self.last = wid

    def started(self) -> bool:
        """Whether any copy has delivered (or run out, or had its state captured) in this epoch."""
        return self.last is not None or any(self.ended) or self.stateful()

    def stateful(self) -> bool:
        return any(record is not None for record in self.records)

    def entry(self) -> dict:
        """The state's ``"stateful"`` entry (see the module docstring)."""
        n = len(self.records)
        workers = {}
        for wid, record in enumerate(self.records):
            if record is None:
                record = bare(wid, self.ended[wid])
            elif record["fetcher_state"]["fetcher_ended"] != self.ended[wid]:
                record = dict(record, fetcher_state=dict(record["fetcher_state"], fetcher_ended=self.ended[wid]))
            workers[f"worker_{wid}"] = record
        entry = {"num_workers": self.num_workers, "world_size": self.world_size,
                 "next_worker": 0 if self.last is None else (self.last + 1) % n, "taken": list(self.taken),
                 "workers": workers}
        if self.in_order is not None:
            entry["in_order"] = self.in_order
        return entry


def initial_entry(dataset_state, num_workers: int, world_size: int) -> dict:
    """The entry of an epoch not started yet: every copy starts from the dataset's state."""
    n = max(1, num_workers)
    workers = {f"worker_{w}": dict(bare(w, False), dataset_state=dataset_state) for w in range(n)}
    return {"num_workers": num_workers, "world_size": world_size, "next_worker": 0, "taken": [0] * n,
            "workers": workers, "in_order": True}


def resume_plan(entry: dict | None, mid_epoch: bool, num_workers: int, epoch: int, world_size: int = 1,
                iterable: bool = True, carry: bool = True, buffered: bool = False, in_order: bool = True):
    """What a resumed iterable epoch starts from: ``(copies, first worker, Copies)`` where
    ``copies`` is one :class:`~aioload._workers.messages.ResumeCopy` (or ``None``) per worker,
    or ``(None, 0, Copies(num_workers))`` where nothing applies. Warns where the epoch cannot
    resume exactly (another number of workers). ``buffered``: the dataset has a state that drops
    its shuffle buffer's rows (:func:`drops_buffered_rows`), which the fast-forward warning says.
    ``in_order``: the loader's (whether its batches come in their workers' turn; a map-style
    dataset's batches resume from the plan, whatever worker made them, so it is not recorded)."""
    in_order = in_order if iterable else None
    fresh = Copies(num_workers, world_size, in_order)
    if entry is None or (not mid_epoch and not carry):
        # between epochs, the copies' states carry over only where the copies do: persistent
        # workers, or the dataset itself in process (torch gives fresh workers fresh copies)
        return None, 0, fresh
    if not iterable:  # a map-style dataset's states: its batches resume from the plan, exactly
        return _map_plan(entry, mid_epoch, num_workers, world_size)
    if entry["world_size"] != world_size:
        if mid_epoch:
            warnings.warn(
                f"this state resumes epoch {epoch} from its start, not from where it was saved: it was saved on "
                f"{entry['world_size']} ranks and this loader runs on {world_size}, and each rank's copies of an "
                "IterableDataset hold that rank's part of the stream. Batches delivered in that epoch before the "
                "save are delivered again", ResumeWarning, stacklevel=5)
        return None, 0, fresh
    if entry["num_workers"] != num_workers:
        if mid_epoch:
            warnings.warn(
                f"this state resumes epoch {epoch} from its start, not from where it was saved: it was saved with "
                f"num_workers={entry['num_workers']} and this loader has num_workers={num_workers}, and each "
                "worker's copy of an IterableDataset holds its own part of the stream. Batches delivered in that "
                f"epoch before the save are delivered again; resume with num_workers={entry['num_workers']} to "
                "continue where it was", ResumeWarning, stacklevel=5)
        return None, 0, fresh
    warn_fast_forward(entry, mid_epoch, epoch, buffered)
    copies = Copies.resumed(entry, fresh=not mid_epoch, in_order=in_order)
    sent = []
    for wid in range(len(copies.records)):
        record = entry["workers"][f"worker_{wid}"]
        if not mid_epoch:
            sent.append(ResumeCopy(record, 0, True) if _has_state(record) else None)
        else:
            sent.append(ResumeCopy(record, entry["taken"][wid], False))
    first = entry["next_worker"] if mid_epoch else 0
    return tuple(sent), first, copies


def _map_plan(entry: dict, mid_epoch: bool, num_workers: int, world_size: int):
    """A Stateful map-style dataset: each worker's copy (or the dataset, in process) gets the
    state it had after the last batch it made that was delivered."""
    if entry["num_workers"] != num_workers or entry["world_size"] != world_size:
        warnings.warn(
            f"the dataset's own state, saved for each of num_workers={entry['num_workers']} on "
            f"{entry['world_size']} rank(s), is not given back to this loader's num_workers={num_workers} on "
            f"{world_size} rank(s): its batches resume exactly, but what the dataset draws from its state "
            "(a random state, say) starts afresh", ResumeWarning, stacklevel=5)
        return None, 0, Copies(num_workers, world_size, None)
    copies = Copies.resumed(entry, fresh=not mid_epoch, in_order=None)
    sent = tuple(ResumeCopy(entry["workers"][f"worker_{w}"], 0, not mid_epoch) for w in range(len(copies.records)))
    return sent, 0, copies


def warn_fast_forward(entry: dict | None, mid_epoch: bool, epoch: int, buffered: bool = False) -> None:
    """Name the cost of resuming the copies that are not Stateful: the items they drop."""
    if entry is None or not mid_epoch:
        return
    dropped = [(int(name.split("_")[1]), entry["taken"][int(name.split("_")[1])])
               for name, record in entry["workers"].items()
               if not _has_state(record) and not record["fetcher_state"]["fetcher_ended"]]
    dropped = [(wid, count) for wid, count in dropped if count]
    if not dropped:
        return
    total = sum(count for _, count in dropped)
    each = ", ".join(f"worker {wid}: {count}" for wid, count in dropped)
    if buffered:
        warnings.warn(
            f"this state resumes epoch {epoch} of a Hugging Face IterableDataset shuffled with a buffer by "
            "fast-forwarding: its state_dict() does not hold the rows in its shuffle buffer (they would be lost), "
            f"so each copy runs __iter__ again, in the same order (its seed and epoch), and drops the items it "
            f"delivered before the save, {total} in all ({each}), which costs as much as loading them did (the "
            "exact resume; loading the dataset's own state would lose the buffered rows)",
            FastForwardWarning, stacklevel=6)
        return
    warnings.warn(
        f"this state resumes epoch {epoch} of an IterableDataset that has no state_dict()/load_state_dict() (nor "
        f"has its iterator) by fast-forwarding: each copy runs __iter__ again and drops the items it delivered "
        f"before the save, {total} in all ({each}), which costs as much as loading them did. Give the dataset or "
        "its iterator state_dict() and load_state_dict() to resume without that", FastForwardWarning, stacklevel=6)


# -- checking a saved entry ---------------------------------------------------------------
def _fail(path: str, problem: str) -> ResumeError:
    return ResumeError(f"cannot load this state: {path} {problem}; pass what loader.state_dict() returned")


_COUNT_MAX = 2**63 - 1  # items a copy may have delivered (what one iterator can be advanced by)


def _count(value, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _fail(path, f"must be an int >= 0, got {reprlib.repr(value)}")
    if value > _COUNT_MAX:
        raise _fail(path, f"must be an int in [0, {_COUNT_MAX}], got {value}")
    return value


def check(entry, iterable: bool, batch_size: int | None = None) -> dict | None:
    """The state's ``"stateful"`` entry, checked field by field (the dataset's own values
    excepted: they are the dataset's to check when it loads them), and an IterableDataset's
    ``taken`` against its batches (:func:`_check_position`; ``batch_size``: the items of a
    full batch, ``None``: unknown). A map-style dataset's entry has the same shape (its records'
    ``dataset_state`` only)."""
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise _fail("stateful", f"must be a dict, got {type(entry).__name__}")
    wanted = {"num_workers", "world_size", "next_worker", "taken", "workers"}
    if not wanted <= set(entry) <= wanted | {"in_order"}:
        raise _fail("stateful", f"must have the keys {sorted(wanted)} (and 'in_order' in a state saved by "
                                f"this version), got {sorted(map(str, entry))}")
    if "in_order" in entry and not isinstance(entry["in_order"], bool):
        raise _fail("stateful.in_order", f"must be a bool, got {reprlib.repr(entry['in_order'])}")
    workers = _count(entry["num_workers"], "stateful.num_workers")
    if _count(entry["world_size"], "stateful.world_size") < 1:
        raise _fail("stateful.world_size", "must be an int >= 1, got 0")
    n = max(1, workers)
    nxt = _count(entry["next_worker"], "stateful.next_worker")
    if nxt >= n:
        raise _fail("stateful.next_worker", f"must be < {n} (the saved workers), got {nxt}")
    taken = entry["taken"]
    if not isinstance(taken, (list, tuple)) or len(taken) != n:
        raise _fail("stateful.taken", f"must be a list of {n} counts, got {reprlib.repr(taken)}")
    for i, count in enumerate(taken):
        _count(count, f"stateful.taken[{i}]")
    records = entry["workers"]
    names = [f"worker_{i}" for i in range(n)]
    if not isinstance(records, dict) or sorted(records) != sorted(names):
        raise _fail("stateful.workers", f"must map {names} to records, got {reprlib.repr(records)}")
    for name in names:
        _check_record(records[name], f"stateful.workers.{name}", int(name.split("_")[1]))
    if iterable:
        _check_position(entry, batch_size)
    return entry


def _check_position(entry: dict, batch_size: int | None) -> None:
    """``taken`` against the batches it counts: a copy's items come in batches of
    ``batch_size``, and only the batch that ran it out may be partial, so a copy still running
    has taken a whole number of batches (an edit that adds a few items to ``taken`` would drop
    them on resume). Where the batches came in turn (``in_order``), ``next_worker`` against
    ``taken`` (:func:`_check_turn`)."""
    if batch_size is None:
        return
    for w, taken in enumerate(entry["taken"]):
        if taken % batch_size and not entry["workers"][f"worker_{w}"]["fetcher_state"]["fetcher_ended"]:
            raise _fail(f"stateful.taken[{w}]", f"must be a whole number of batches of {batch_size} (worker {w} has "
                                                f"not run out), got {taken}")
    if entry.get("in_order"):
        _check_turn(entry, batch_size)


def _check_turn(entry: dict, batch_size: int) -> None:
    """Batches delivered in turn: worker 0, 1, ... round and round, skipping the copies that
    ran out, from the epoch's start (a resumed epoch goes on from ``next_worker``). So the
    copies still running delivered ``m + 1`` batches each below ``next_worker`` and ``m`` from
    it on; a copy that ran out stopped where it did. An edited ``next_worker`` (or a batch added
    to one copy's ``taken``) would reorder the resumed epoch: refused, naming the turns that fit.
    Linear in the workers."""
    counts = [(w, taken // batch_size) for w, taken in enumerate(entry["taken"])
              if not entry["workers"][f"worker_{w}"]["fetcher_state"]["fetcher_ended"]]
    if not counts:
        return
    n, nxt = len(entry["taken"]), entry["next_worker"]
    top = counts[0][1]
    drop = next((i for i, (_, c) in enumerate(counts) if c != top), len(counts))
    rest = {c for _, c in counts[drop:]}
    if rest and rest != {top - 1}:
        raise _fail("stateful.taken", f"must count the batches of workers that delivered in turn (in_order=True): "
                                      f"the workers still running delivered the same number of batches, one more for "
                                      f"those before next_worker, got {reprlib.repr(list(entry['taken']))} "
                                      f"in batches of {batch_size}")
    if rest:  # after the last worker with `top` batches, up to the first with one fewer
        fits = range(counts[drop - 1][0] + 1, counts[drop][0] + 1)
    else:  # every running copy delivered as many: the turn is at a round's start
        fits = [w for w in range(n) if w <= counts[0][0] or w > counts[-1][0]]
    if nxt not in fits:
        shown = (f"in [{fits.start}, {fits.stop - 1}]" if isinstance(fits, range) and len(fits) > 1
                 else " or ".join(map(str, fits)) if len(fits) <= 4 else f"one of {reprlib.repr(list(fits))}")
        raise _fail("stateful.next_worker", f"must be {shown} (in_order=True: the workers delivered in turn, and "
                                            f"stateful.taken {reprlib.repr(list(entry['taken']))} in batches of "
                                            f"{batch_size} says whose turn is next), got {nxt}")


def _check_record(record, path: str, wid: int) -> None:
    if not isinstance(record, dict) or {"worker_id", "dataset_state", "fetcher_state"} - set(record):
        raise _fail(path, "must be a dict with 'worker_id', 'dataset_state' and 'fetcher_state'")
    if record["worker_id"] != wid or isinstance(record["worker_id"], bool):
        raise _fail(f"{path}.worker_id", f"must be {wid}, got {reprlib.repr(record['worker_id'])}")
    fetcher = record["fetcher_state"]
    if not isinstance(fetcher, dict) or {"dataset_iter_state", "fetcher_ended"} - set(fetcher):
        raise _fail(f"{path}.fetcher_state", "must be a dict with 'dataset_iter_state' and 'fetcher_ended'")
    if not isinstance(fetcher["fetcher_ended"], bool):
        raise _fail(f"{path}.fetcher_state.fetcher_ended", f"must be a bool, got {reprlib.repr(fetcher['fetcher_ended'])}")
    check_depth(record["dataset_state"], f"{path}.dataset_state")
    check_depth(fetcher["dataset_iter_state"], f"{path}.fetcher_state.dataset_iter_state")


VALUE_DEPTH = 64
"""How deep a dataset's own state may nest its dicts, lists and tuples (a state is copied and
saved by recursive code, which a deeper one would overflow)."""


def check_depth(value, path: str) -> None:
    """``value`` nests containers at most :data:`VALUE_DEPTH` deep (walked without recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > VALUE_DEPTH:
            raise _fail(path, f"is nested deeper than {VALUE_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)


# -- a torchdata StatefulDataLoader state -------------------------------------------------
def from_torchdata(state, start: dict, iterable: bool, num_workers: int, world_size: int) -> dict:
    """The aioload state that resumes what torchdata's ``StatefulDataLoader`` saved in
    ``state``, for an IterableDataset: ``start`` (the loader's state of its next epoch's start,
    :meth:`aioload._plan.sampling.Planner.start_state`) with each worker's record taken over as it
    is. What torchdata does not save per worker (the items a copy delivered) is taken as 0, so a
    copy that is not Stateful starts its stream again."""
    if not iterable:
        raise ResumeError(
            "a torchdata StatefulDataLoader state of a map-style dataset does not convert: its position is a "
            "count of torchdata's own sampler (torchdata replaces torch's RandomSampler), not an order aioload "
            "can compute; resume from an aioload state, or restart the epoch")
    if not isinstance(state, dict):
        raise ResumeError(f"not a torchdata StatefulDataLoader state: a dict is needed, got {type(state).__name__}")
    if "_snapshot" in state:  # workers
        snapshot = state["_snapshot"]
        main, records = snapshot["_main_snapshot"], snapshot["_worker_snapshots"]
        saved_workers = main["_num_workers"]
        last = snapshot.get("_last_yielded_worker_id")
        taken_any = snapshot.get("_snapshot_step", 0) > 0
    elif "fetcher_state" in state:  # in process
        saved_workers, last = 0, 0
        records = {"worker_0": {"worker_id": 0, "dataset_state": state.get("dataset_state"),
                                "fetcher_state": state["fetcher_state"]}}
        taken_any = state.get("_num_yielded", 0) > 0
    else:
        raise ResumeError("not a torchdata StatefulDataLoader state: it has neither '_snapshot' (workers) nor "
                          "'fetcher_state' (num_workers=0)")
    if saved_workers != num_workers:
        raise ResumeError(f"this torchdata state was saved with num_workers={saved_workers}; convert it for a "
                          f"loader with num_workers={saved_workers}")
    n = max(1, num_workers)
    workers = {}
    for wid in range(n):
        record = records.get(f"worker_{wid}") or bare(wid, False)
        fetcher = record.get("fetcher_state") or {"dataset_iter_state": None, "fetcher_ended": False}
        workers[f"worker_{wid}"] = {"worker_id": wid, "dataset_state": record.get("dataset_state"),
                                    "fetcher_state": {"dataset_iter_state": fetcher.get("dataset_iter_state"),
                                                      "fetcher_ended": bool(fetcher.get("fetcher_ended", False))}}
    out = dict(start)
    out["stateful"] = {"num_workers": num_workers, "world_size": world_size,
                       "next_worker": 0 if last is None or not taken_any else (last + 1) % n,
                       "taken": [0] * n, "workers": workers}
    check(out["stateful"], iterable)
    return out
