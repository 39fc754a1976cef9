"""load_state_dict() checks the whole state: a malformed or impossible state is refused there,
with a ResumeError naming the field, never later (at the next iteration, as a KeyError, an
AttributeError, a binascii.Error or a RecursionError), and never accepted to deliver batches
that do not exist.

The fuzz takes real saved states, breaks each field in turn (dropped, of the wrong type,
corrupt, nested too deep, out of range), and checks that each broken state is either refused
at load with a ResumeError or loads and then iterates cleanly, within the dataset.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import reprlib
import warnings

import pytest
import torch

import aioload
from aioload._plan.resume import ResumeError, ResumeWarning
from aioload._plan.stateful import FastForwardWarning
from tests.random_data import Shuffled, Stream

N, BATCH = 10, 3
PER_EPOCH = 4


class Ints(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        if isinstance(i, int):
            if not 0 <= i < N:
                raise IndexError(f"index {i} is out of range")
            return i
        return 0  # a key of another kind (a sampler's own), accepted as a keyed dataset would


class Pairs(torch.utils.data.Sampler):
    """A batch sampler aioload cannot replay, whose batches are tuples: saved with tags."""

    def __len__(self) -> int:
        return 3

    def __iter__(self):
        return iter([(0, 1), (2, 3, 4), (5,)])


def saved(make, k: int, finish: bool = False, after: int = 0) -> dict:
    """A real state: ``k`` batches taken (and the epoch run to its end with ``finish``), after
    ``after`` whole epochs."""
    with make() as loader:
        for _ in range(after):
            list(loader)
        iterator = iter(loader)
        for _ in range(k):
            next(iterator)
        if finish:
            list(iterator)
        return json.loads(json.dumps(loader.state_dict()))


MAKERS = {
    "seeded": lambda: aioload.DataLoader(Ints(), batch_size=BATCH, shuffle=True, seed=1),
    "generator": lambda: aioload.DataLoader(Ints(), batch_size=BATCH, shuffle=True,
                                            generator=torch.Generator().manual_seed(2)),
    "global-rng": lambda: aioload.DataLoader(Ints(), batch_size=BATCH, shuffle=True),
    "written": lambda: aioload.DataLoader(Ints(), batch_size=BATCH, sampler=Shuffled(N)),
    "tuples": lambda: aioload.DataLoader(Ints(), batch_sampler=Pairs()),
    "unbatched": lambda: aioload.DataLoader(Ints(), batch_size=None, sampler=Shuffled(N)),
    "persistent": lambda: aioload.DataLoader(Ints(), batch_size=BATCH, shuffle=True, num_workers=1,
                                             persistent_workers=True, generator=torch.Generator().manual_seed(3)),
    "iterable": lambda: aioload.DataLoader(Stream(N), batch_size=BATCH),
}
STATES = {
    "seeded": (lambda: saved(MAKERS["seeded"], 2)),
    "seeded-between": (lambda: saved(MAKERS["seeded"], PER_EPOCH, finish=True)),
    "generator": (lambda: saved(MAKERS["generator"], 1)),
    "global-rng": (lambda: saved(MAKERS["global-rng"], 3)),
    "written": (lambda: saved(MAKERS["written"], 1)),
    "tuples": (lambda: saved(MAKERS["tuples"], 1)),
    "unbatched": (lambda: saved(MAKERS["unbatched"], 4)),
    "persistent": (lambda: saved(MAKERS["persistent"], 1, after=1)),
    "iterable": (lambda: saved(MAKERS["iterable"], 1)),
}
MAKER_OF = {name: MAKERS[name.split("-")[0] if name != "global-rng" else name] for name in STATES}


def deep(levels: int = 2000):
    value: list = [0]
    for _ in range(levels):
        value = [value]
    return value


BAD_VALUES = [None, True, -1, 2**64, 10**6, -(10**6), "x", 1.5, [], {}, [[0]], {"tuple": "x"}, deep()]


def paths(value, prefix=()):
    """Every place in a state: dict keys, and the first and last items of lists."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list) and value:
        for i in sorted({0, len(value) - 1}):
            yield from paths(value[i], (*prefix, i))


def replaced(state, path, value=None, drop=False):
    state = copy.deepcopy(state)
    target = state
    for step in path[:-1]:
        target = target[step]
    if drop:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return state


def mutations(state):
    for path in paths(state):
        if not path:
            continue
        here = state
        for step in path:
            here = here[step]
        if isinstance(path[-1], str):
            yield path, "dropped", replaced(state, path, drop=True)
        for bad in BAD_VALUES:
            yield path, reprlib.repr(bad), replaced(state, path, bad)
        if isinstance(here, str) and len(here) > 100:  # a generator state in base64
            yield path, "truncated", replaced(state, path, here[:-8])
            yield path, "not base64", replaced(state, path, here[:-8] + "!!!!!!!!")
            yield path, "zeroed", replaced(state, path, "A" * len(here))


def resumes_cleanly(loader, name: str) -> None:
    """A state that loaded: the next iteration runs without error, within the dataset."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResumeWarning)
        batches = [b.tolist() if isinstance(b, torch.Tensor) else b for b in loader]
    seen = [i for b in batches for i in (b if isinstance(b, list) else [b])]
    assert all(0 <= i < N for i in seen), (name, batches)
    assert len(batches) <= max(PER_EPOCH, N), (name, batches)


@pytest.mark.parametrize("name", list(STATES))
def test_every_broken_field_is_refused_at_load_or_harmless(name):
    state = STATES[name]()
    refused = accepted = 0
    with MAKER_OF[name]() as loader:
        for path, how, broken in mutations(state):
            label = f"{name}: {'.'.join(map(str, path))} {how}"
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ResumeWarning)
                    loader.load_state_dict(broken)
            except ResumeError as exc:
                assert str(exc), label
                refused += 1
                continue
            except Exception as exc:  # noqa: BLE001 - any other error is the bug under test
                raise AssertionError(f"{label}: {type(exc).__name__}: {exc}") from exc
            accepted += 1
            try:
                resumes_cleanly(loader, label)
            except AssertionError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise AssertionError(f"{label} loaded, then failed: {type(exc).__name__}: {exc}") from exc
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResumeWarning)
            loader.load_state_dict(state)  # the real state still loads into the same loader
    assert refused > accepted  # nearly every break is refused; the rest are states that can be


# -- the cases of the audit, one by one, with the message each gives -----------------------
def loaded(state, make=MAKERS["seeded"]):
    with make() as loader:
        loader.load_state_dict(state)
        return [b.tolist() for b in loader]


def refused(state, message: str, make=MAKERS["seeded"]) -> None:
    with make() as loader:
        with pytest.raises(ResumeError, match=f"^cannot load this state: {message}; pass what "
                                              r"loader.state_dict\(\) returned$"):
            loader.load_state_dict(state)


def test_a_missing_or_mistyped_field_is_named():
    state = STATES["seeded"]()
    refused(replaced(state, ("config",), drop=True), "the state has no 'config'")
    refused(replaced(state, ("config",), []), "config must be a dict, got list")
    refused(replaced(state, ("progress", "delivered"), drop=True), "progress has no 'delivered'")
    refused(replaced(state, ("progress", "delivered", "below"), "2"),
            "progress.delivered.below must be an int, got str")
    refused(replaced(state, ("epoch",), 1.0), "epoch must be an int, got float")
    refused(replaced(state, ("epoch",), float("nan")), "epoch is nan: a state's numbers are finite")
    refused(replaced(state, ("epoch",), b"1"), r"epoch is a bytes: a state holds only dicts, lists, strings, "
                                              r"numbers, bools and None")
    refused(replaced(state, ("progress", "surprise"), 1), r"progress has unexpected keys \['surprise'\]")


def test_corrupt_generator_states_are_named():
    state = STATES["generator"]()
    encoded = state["rng"]["loader"]["state"]
    refused(replaced(state, ("rng", "loader", "state"), encoded[:-3] + "*=="),
            r"rng.loader.state is not valid base64 \(.*\)", MAKERS["generator"])
    refused(replaced(state, ("rng", "loader", "state"), encoded[:-8]),
            r"rng.loader.state (is not valid base64 \(.*\)|must decode to a generator state of 5056 bytes, got \d+)",
            MAKERS["generator"])
    refused(replaced(state, ("rng", "loader", "state"), base64.b64encode(bytes(5056)).decode()),
            r"rng.loader.state is not a torch generator state \(.*\)", MAKERS["generator"])
    refused(replaced(state, ("rng", "loader", "global"), True),
            "rng.loader.global must be False: this loader's 'loader' generator is a generator of its own",
            MAKERS["generator"])


def test_deep_nesting_is_refused_without_recursing():
    state = STATES["written"]()
    refused(replaced(state, ("progress", "batches", 0, 1), deep()),
            r"progress.batches\[0\]\[1\](\[0\])+ is nested deeper than 32 levels", MAKERS["written"])
    refused(replaced(state, ("config", "generators"), {"loader": deep()}),
            r"config.generators.loader(\[0\])+ is nested deeper than 32 levels")


def test_impossible_positions_are_refused_and_possible_ones_resume():
    state = STATES["seeded"]()
    with MAKERS["seeded"]() as loader:
        full = [b.tolist() for b in loader]
    # The checks refuse only what cannot be: a real state, and a legal edit of one, still load.
    assert loaded(state) == full[2:]
    assert loaded(replaced(state, ("progress", "delivered"), {"below": 1, "also": [3]})) == [full[1], full[2]]
    written = STATES["written"]()
    rest = loaded(written, MAKERS["written"])
    assert [i for b in rest for i in b] == [i for _, b in written["progress"]["batches"] for i in b]
    refused(replaced(state, ("progress", "delivered", "below"), 100),
            r"progress.delivered.below must be an int in \[0, 4\] \(an epoch of this loader has 4 batches\), got 100")
    refused(replaced(state, ("progress", "delivered", "also"), [7]),
            r"progress.delivered.also\[0\] must be an int in \[3, 3\] \(an epoch of this loader has 4 batches\), got 7")
    refused(replaced(state, ("progress", "delivered", "also"), [3, 3]), "progress.delivered.also lists a batch twice")
    refused(replaced(state, ("epoch",), -1), r"epoch must be an int in \[0, 9223372036854775807\], got -1")
    refused(replaced(state, ("progress", "base_seed"), 2**64),
            r"progress.base_seed must be an int in \[0, 9223372036854775807\], got 18446744073709551616")


def test_indices_outside_the_dataset_are_refused():
    state = STATES["written"]()
    first = state["progress"]["batches"][0][1]
    for bad in (10**6, -(10**6), N):
        refused(replaced(state, ("progress", "batches", 0, 1), [bad, *first[1:]]),
                rf"progress.batches\[0\]\[1\]\[0\] must be an index in \[0, 9\] \(the dataset has 10 samples\), "
                rf"got {bad}", MAKERS["written"])
    refused(replaced(state, ("progress", "batches", 0, 1), [0, 1, 2, 3]),
            r"progress.batches\[0\]\[1\] holds 4 indices, more than this loader's batch_size=3", MAKERS["written"])
    refused(replaced(state, ("progress", "batches", 0, 1), []),
            r"progress.batches\[0\]\[1\] is an empty batch", MAKERS["written"])


def test_an_empty_or_gapped_epoch_is_refused():
    state = STATES["written"]()
    assert state["progress"]["delivered"] == {"below": 1, "also": []}
    refused(replaced(replaced(state, ("progress", "delivered", "below"), 0), ("progress", "batches"), []),
            "progress.batches is empty with nothing delivered: an epoch of this loader has 4 batches",
            MAKERS["written"])
    refused(replaced(state, ("progress", "batches"), state["progress"]["batches"][1:]),
            "progress.batches leaves out batch 1: with progress.delivered, it must account for every batch "
            "of the epoch from 0", MAKERS["written"])
    refused(replaced(state, ("progress", "batches"), state["progress"]["batches"][::-1]),
            r"progress.batches\[1\]\[0\] must be greater than the sequence number before it \(3\), got 2",
            MAKERS["written"])


def test_an_iterable_datasets_position_is_its_copies_not_delivered_batches():
    state = STATES["iterable"]()
    assert state["progress"]["inexact"] is None and state["progress"]["delivered"] == {"below": 0, "also": []}
    assert state["stateful"]["taken"] != [0] * len(state["stateful"]["taken"])
    refused(replaced(state, ("progress", "delivered", "below"), 1),
            r"progress must stand for the epoch's start: an IterableDataset's epoch resumes from its start only "
            r"\(nothing delivered, no batches\)", MAKERS["iterable"])
    refused(replaced(state, ("stateful", "taken", 0), -1), r"stateful.taken\[0\] must be an int >= 0, got -1",
            MAKERS["iterable"])
    refused(replaced(state, ("stateful", "next_worker"), 5),
            r"stateful.next_worker must be < 1 \(the saved workers\), got 5", MAKERS["iterable"])


def test_an_iterable_copys_taken_items_are_whole_batches_until_it_runs_out():
    state = STATES["iterable"]()
    assert state["stateful"]["taken"] == [BATCH]
    refused(replaced(state, ("stateful", "taken", 0), BATCH + 2),  # would drop 2 items on resume
            rf"stateful.taken\[0\] must be a whole number of batches of {BATCH} \(worker 0 has not run out\), "
            rf"got {BATCH + 2}", MAKERS["iterable"])
    with pytest.warns(FastForwardWarning, match="drops the items it delivered before the save, 6 in all"):
        assert loaded(replaced(state, ("stateful", "taken", 0), 2 * BATCH), MAKERS["iterable"])  # whole batches
    ended = saved(MAKERS["iterable"], -(-N // BATCH))  # the last batch is partial: the copy ran out
    assert ended["stateful"]["taken"] == [N] and N % BATCH
    assert loaded(ended, MAKERS["iterable"]) == []


# -- positions a crafted state may claim: bounded, and checked without building the epoch -----------
class Endless(torch.utils.data.Sampler):
    """A sampler without len(): its states stand for the epoch's start (nothing can be written out)."""

    def __iter__(self):
        return iter(range(N))


class Lazy(torch.utils.data.Sampler):
    """A sampler aioload cannot replay, of any length, that builds nothing to start."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(range(self.n))


class Many(Ints):
    def __len__(self) -> int:
        return 4 * 10**6


NO_LEN = (r"\(this loader's sampler has no len\(\), so aioload can neither replay it nor write its rest out: a "
          r"state of its epoch stands for the epoch's start\)")


def peak_rss_growth_kb(action) -> int:
    """How far this process's peak RSS rose above its RSS while ``action()`` ran (the peak is
    reset first, through /proc/self/clear_refs)."""
    from tests.resources import status_kb

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status_kb("self", "VmRSS")
    action()
    return status_kb("self", "VmHWM") - before


def test_a_sampler_without_len_has_no_position_a_state_can_resume():
    # issue 32 item 15: such a sampler is never replayed and its rest never written out, so
    # whatever a state says was delivered (10**7 batches: once a set of them, then silently
    # accepted below a bound of 2**32) cannot be; it is refused at load, in little memory.
    make = lambda: aioload.DataLoader(Ints(), batch_size=BATCH, sampler=Endless())  # noqa: E731
    state = saved(make, 1)
    assert state["progress"]["inexact"] is not None and state["progress"]["batches"] is None
    exact = replaced(state, ("progress", "inexact"), None)
    with make() as loader:
        def load_late():
            with pytest.raises(ResumeError, match=rf"^cannot load this state: progress.delivered.below must be an int "
                                                  rf"in \[0, 0\] {NO_LEN}, got 10000000; "):
                loader.load_state_dict(replaced(exact, ("progress", "delivered", "below"), 10**7))

        assert peak_rss_growth_kb(load_late) < 100 * 1024
    for below in (1, 10**12):
        refused(replaced(exact, ("progress", "delivered", "below"), below),
                rf"progress.delivered.below must be an int in \[0, 0\] {NO_LEN}, got {below}", make)
    refused(replaced(exact, ("progress", "delivered", "also"), [2**40]),
            rf"progress.delivered.also must be empty after 0 batches {NO_LEN}, got \[1099511627776\]", make)
    listed = replaced(exact, ("progress", "batches"), [[0, [0, 1, 2]]])
    refused(listed, r"progress.batches must be None: this loader's sampler has no len\(\), so the rest of its "
                    r"epoch is never written out \(such a state resumes by replaying the sampler\)", make)
    with make() as loader:  # the state it saves (the epoch's start) loads, and replays the epoch
        with pytest.warns(ResumeWarning, match="resumes epoch 0 from its start"):
            loader.load_state_dict(state)
        assert [i for b in loader for i in b.tolist()] == list(range(N))
        loader.load_state_dict(exact)  # nothing delivered: also the epoch's start
        assert [i for b in loader for i in b.tolist()] == list(range(N))


def test_a_position_late_in_a_long_epoch_is_checked_in_little_memory():
    import tracemalloc

    make = lambda: aioload.DataLoader(Many(), batch_size=1, sampler=Lazy(4 * 10**6))  # noqa: E731
    with make() as loader:
        config = loader._planner.config()
    small = saved(lambda: aioload.DataLoader(Ints(), batch_size=1, sampler=Lazy(N)), 1)
    state = replaced(small, ("config",), config)
    last = 4 * 10**6 - 1
    state["progress"]["delivered"] = {"below": last, "also": []}
    state["progress"]["batches"] = [[last, [7]]]
    with make() as loader:
        tracemalloc.start()
        try:
            loader.load_state_dict(state)  # the epoch's last batch is all that is left
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert [b.tolist() for b in loader] == [[7]]
    assert peak < 8 << 20, f"checking the state took {peak >> 20} MiB"  # not a set of 4 million batches
    gapped = replaced(state, ("progress", "delivered", "below"), last - 1)
    refused(gapped, r"progress.batches leaves out batch 3999998: with progress.delivered, it must account for every "
                    r"batch of the epoch from 0", make)


def test_indices_inside_nested_lists_are_checked_against_the_dataset():
    make = lambda: aioload.DataLoader(Ints(), batch_size=None, sampler=Lazy(N))  # noqa: E731
    state = saved(make, 2)
    first = state["progress"]["batches"][0]
    for bad in (-3, 10**9, N):
        refused(replaced(state, ("progress", "batches", 0, 1), [bad]),
                rf"progress.batches\[0\]\[1\]\[0\] must be an index in \[0, 9\] \(the dataset has 10 samples\), "
                rf"got {bad}", make)
        refused(replaced(state, ("progress", "batches", 0, 1), [[1, bad]]),
                rf"progress.batches\[0\]\[1\]\[0\]\[1\] must be an index in \[0, 9\] .*, got {bad}", make)
    with make() as loader:  # a list index within the dataset loads, and reaches the dataset as a list
        loader.load_state_dict(replaced(state, ("progress", "batches", 0, 1), [3, 4]))
        assert list(loader)[0] == 0 and first[0] == 2


# -- a sampler given as a list: its indices are the only ones a state may name ------------------
class Twenty(torch.utils.data.Dataset):
    """20 samples, with or without len()."""

    def __init__(self, sized: bool):
        self.sized = sized

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("no len()")
        return 20

    def __getitem__(self, i):
        if not 0 <= i < 20:
            raise IndexError(f"index {i} is out of range")
        return i


LISTED = {
    "sampler": dict(batch_size=4, sampler=list(range(19, -1, -1))),
    "batch_sampler": dict(batch_sampler=[[i, i + 1] for i in range(0, 20, 2)]),
    "unbatched": dict(batch_size=None, sampler=list(range(20))),
}


@pytest.mark.parametrize("sized", [True, False], ids=["len", "no-len"])
@pytest.mark.parametrize("kind", list(LISTED))
def test_indices_outside_a_listed_sampler_are_refused_at_load(kind, sized):
    # issue 32 item 17: 10**6 and -10**6 for 20 samples, refused at load whether the dataset
    # says its length or only the sampler's list does (once they reached __getitem__)
    make = lambda: aioload.DataLoader(Twenty(sized), **LISTED[kind])  # noqa: E731
    state = saved(make, 1)
    where = ("progress", "batches", 0, 1) if kind == "unbatched" else ("progress", "batches", 0, 1, 0)
    path = re.escape("".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in where)[1:])
    for bad in (10**6, -(10**6)):
        rule = ("an index in [0, 19] (the dataset has 20 samples)" if sized
                else "an index >= 0" if bad < 0 else "one of the indices of this loader's sampler "
                + ("(a list of 10 batches)" if kind == "batch_sampler" else "(a list of 20 indices)"))
        refused(replaced(state, where, bad), rf"{path} must be {re.escape(rule)}, got {bad}", make)
    with make() as loader:  # the state as saved loads, and resumes within the list
        loader.load_state_dict(state)
        rest = [i for b in loader for i in (b.tolist() if isinstance(b, torch.Tensor) else [b])]
    assert len(rest) == 20 - (1 if kind == "unbatched" else 4 if kind == "sampler" else 2)


@pytest.mark.parametrize("ints", [int, torch.tensor], ids=["int", "tensor"])
def test_an_index_of_the_dataset_that_a_listed_sampler_does_not_hold_is_refused(ints):
    # a list of numbers of another int type (0-d tensors, numpy ints) is saved, and checked, as ints
    make = lambda: aioload.DataLoader(Twenty(True), batch_size=2,  # noqa: E731
                                      sampler=[ints(i) for i in (3, 1, 4, 5, 9, 2, 6)])
    state = saved(make, 1)
    refused(replaced(state, ("progress", "batches", 0, 1, 0), 7),
            r"progress.batches\[0\]\[1\]\[0\] must be one of the indices of this loader's sampler \(a list of 7 "
            r"indices\), got 7", make)
    loaded_rest = loaded(state, make)
    assert [i for b in loaded_rest for i in b] == [4, 5, 9, 2, 6]
