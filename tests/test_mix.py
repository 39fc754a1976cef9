"""``aioload.Mix``: sources drawn by weight, weight changes mid-epoch, exact resume.

Real loaders with worker processes over small split datasets whose samples say which source
and index they are; the reference for a resumed run is the uninterrupted run itself.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

import aioload
from aioload._plan.resume import ResumeError

WEIGHTS = {"web": 0.6, "code": 0.25, "books": 0.15}


class Source(aioload.Dataset):
    """``n`` samples ``tensor([tag, index])``, read on the event loop, decoded in a worker."""

    def __init__(self, n: int, tag: int):
        self.n, self.tag = n, tag

    def __len__(self) -> int:
        return self.n

    async def read(self, index):
        return index

    def decode(self, raw):
        return torch.tensor([self.tag, raw])


class Plain(torch.utils.data.Dataset):
    """A plain torch dataset (``__getitem__`` only) as a source."""

    def __init__(self, n: int, tag: int):
        self.n, self.tag = n, tag

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        return torch.tensor([self.tag, index])


def mix(sizes=(6000, 3000, 2000), weights=WEIGHTS, **kwargs) -> aioload.Mix:
    return aioload.Mix({name: Source(n, tag) for tag, (name, n) in enumerate(zip(WEIGHTS, sizes))}, weights,
                       **kwargs)


def rows(loader, stop_after: int | None = None, change: dict | None = None) -> list[list[list[int]]]:
    """The batches as lists; with ``change``, ``{batch number: weights}`` set after that batch."""
    got = []
    for k, batch in enumerate(loader):
        got.append(batch.tolist())
        if change and k in change:
            loader.set_weights(change[k])
        if stop_after is not None and k == stop_after:
            break
    return got


def sources(batches) -> Counter:
    return Counter(row[0] for batch in batches for row in batch)


def test_proportions_hold_over_the_epoch_and_in_every_window():
    with aioload.DataLoader(mix(), batch_size=100, shuffle=True, num_workers=2, seed=1) as loader:
        batches = rows(loader)
    flat = [row for batch in batches for row in batch]
    assert len(flat) == 10_000  # web runs out first: 6,000 / 0.6
    share = dict(zip(range(3), WEIGHTS.values()))
    # The bound tested: within 3 samples of the weight in every prefix of 1,000 (1 % of 10,000
    # would allow 100; an i.i.d. draw misses by 40 on average at w = 0.25).
    for end in range(1000, 10_001, 1000):
        counts = Counter(row[0] for row in flat[:end])
        for s, w in share.items():
            assert abs(counts[s] - w * end) <= 3, (end, s, counts[s])
    # each source's samples appear at most once (no source repeats in the default length)
    assert len({tuple(row) for row in flat}) == len(flat)


def test_the_order_is_the_same_at_any_worker_count_and_across_runs():
    runs = []
    for workers in (0, 1, 2):
        loader = aioload.DataLoader(mix((300, 150, 100)), batch_size=16, shuffle=True, num_workers=workers, seed=4)
        with loader:
            runs.append([rows(loader) for _ in range(2)])
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][0] != runs[0][1], "each epoch draws its own order"


def test_a_weight_change_applies_from_the_next_batch_and_is_resumed_exactly():
    def make():
        return aioload.DataLoader(mix((600, 300, 200)), batch_size=10, shuffle=True, num_workers=2, seed=1)

    k, later = 20, {"web": 0, "code": 1, "books": 1}
    with make() as loader:
        full = rows(loader, change={k: later})
    assert sources(full[: k + 1])[0] > 100 and sources(full[k + 1 :])[0] == 0  # web is off after batch k
    assert abs(sources(full[k + 1 :])[1] - sources(full[k + 1 :])[2]) <= 2
    with make() as loader:
        head = rows(loader, stop_after=k + 5, change={k: later})
        state = json.loads(json.dumps(loader.state_dict()))
    assert head == full[: k + 6]
    assert state["mix"]["schedule"] == [[0, WEIGHTS], [(k + 1) * 10, {"web": 0.0, "code": 1.0, "books": 1.0}]]
    with make() as loader:
        loader.load_state_dict(state)
        assert rows(loader) == full[k + 6 :]
        # the next epoch starts with the weights in force at the end of this one
        with make() as fresh:
            fresh.set_weights(later)
            fresh.set_epoch(1)
            assert rows(loader) == rows(fresh)


def test_a_change_made_after_loading_a_state_applies_from_its_first_batch():
    def make():
        return aioload.DataLoader(mix((600, 300, 200)), batch_size=10, shuffle=True, num_workers=1, seed=2)

    later = {"web": 1, "code": 0, "books": 0}
    with make() as loader:
        full = rows(loader, change={7: later})
    with make() as loader:
        rows(loader, stop_after=7)
        state = loader.state_dict()
    with make() as loader:
        loader.load_state_dict(state)
        loader.set_weights(later)
        assert rows(loader) == full[8:]


def test_between_epochs_a_change_applies_to_the_next_epoch():
    with aioload.DataLoader(mix((600, 300, 200)), batch_size=50, shuffle=True, seed=3) as loader:
        rows(loader)
        loader.set_weights({"web": 0, "code": 0, "books": 1})
        assert set(sources(rows(loader))) == {2}


def test_stats_count_the_samples_delivered_from_each_source():
    with aioload.DataLoader(mix((600, 300, 200)), batch_size=10, shuffle=True, num_workers=2, seed=5) as loader:
        got = rows(loader, stop_after=30, change={9: {"web": 1, "code": 1, "books": 0}})
        per_source = loader.stats().per_source
    counted = sources(got)
    assert per_source == {name: counted[tag] for tag, name in enumerate(WEIGHTS)}
    assert sum(per_source.values()) == 310


def test_source_field_says_where_each_sample_came_from():
    plain = aioload.Mix({"a": Plain(40, 0), "b": Source(40, 1)}, {"a": 1, "b": 1}, source_field="source")
    with aioload.DataLoader(plain, batch_size=8, shuffle=True, num_workers=2, seed=0) as loader:
        for samples, source in loader:
            assert torch.equal(samples[:, 0], source)  # the tag each source writes is its number
    keyed = aioload.Mix({"a": DictSource(10, 0), "b": DictSource(10, 1)}, {"a": 1, "b": 3}, source_field="src")
    with aioload.DataLoader(keyed, batch_size=4, shuffle=True, seed=0) as loader:
        for batch in loader:
            assert torch.equal(batch["tag"], batch["src"])


class DictSource(Source):
    def decode(self, raw):
        return {"tag": self.tag, "x": torch.tensor([raw])}


@pytest.mark.parametrize("exhausted,length,expected", [("repeat", 1000, 1000), ("stop", 1000, 666)])
def test_a_source_that_runs_out_repeats_or_stops_the_epoch(exhausted, length, expected):
    small = mix((400, 300, 200), {"web": 0.6, "code": 0.25, "books": 0.15}, epoch_length=length,
                exhausted=exhausted)
    with aioload.DataLoader(small, batch_size=10, shuffle=True, seed=0) as loader:
        flat = [tuple(row) for batch in rows(loader) for row in batch]
        assert len(loader) == math.ceil(expected / 10)
    assert abs(len(flat) - expected) <= 2  # web's 400 samples last about 400 / 0.6 draws
    repeats = Counter(flat)
    if exhausted == "repeat":
        web = [row for row in flat if row[0] == 0]
        assert len(web) == 600 and max(repeats.values()) == 2
        assert sorted(set(web)) == [(0, i) for i in range(400)]  # every web sample, then again
    else:
        assert max(repeats.values()) == 1


def test_a_mix_of_sources_with_different_structures_names_both():
    class Pairs(Source):
        def decode(self, raw):
            return torch.tensor([self.tag, raw]), raw

    bad = aioload.Mix({"images": Source(20, 0), "pairs": Pairs(20, 1)}, {"images": 1, "pairs": 1})
    with aioload.DataLoader(bad, batch_size=8, shuffle=True, num_workers=1, seed=0) as loader:
        with pytest.raises(TypeError, match=r"sources 'images' and 'pairs' of the mix give samples of different "
                                            r"structure \(tensor\[torch.int64, 1-d\] against \(tensor\[torch.int64, "
                                            r"1-d\], number\)\)"):
            list(loader)


@pytest.mark.parametrize("weights,error,message", [
    ({"web": -1, "code": 1, "books": 1}, ValueError,
     "the weight of source 'web' must be a finite number >= 0, got -1"),
    ({"web": float("nan"), "code": 1, "books": 1}, ValueError, "the weight of source 'web' must be a finite number"),
    ({"web": 0, "code": 0, "books": 0}, ValueError, "weights must not all be zero"),
    ({"web": 1, "code": 1, "books": 1, "news": 1}, ValueError,
     "weights name 'news', which is not a source of this mix"),
    ({"web": 1, "code": 1}, ValueError,
     r"weights must give every source a weight \(0 leaves one out\); missing: \['books'\]"),
    ({"web": "1", "code": 1, "books": 1}, TypeError, "the weight of source 'web' must be a number, got '1'"),
])
def test_bad_weights_are_refused_where_they_are_given(weights, error, message):
    with pytest.raises(error, match=message):
        mix(weights=weights)
    with aioload.DataLoader(mix(), batch_size=10, shuffle=True, seed=0) as loader:
        with pytest.raises(error, match=message):
            loader.set_weights(weights)


def test_bad_sources_are_refused():
    with pytest.raises(TypeError, match="source 'stream' is an IterableDataset"):
        aioload.Mix({"stream": Stream(), "ok": Source(3, 0)}, {"stream": 1, "ok": 1})
    with pytest.raises(ValueError, match="source 'empty' is empty"):
        aioload.Mix({"empty": Source(0, 0)}, {"empty": 1})
    with pytest.raises(ValueError, match="exhausted must be 'repeat' or 'stop', got 'wrap'"):
        mix(exhausted="wrap")


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_a_state_saved_with_other_sources_is_refused():
    with aioload.DataLoader(mix((600, 300, 200)), batch_size=10, shuffle=True, seed=0) as loader:
        rows(loader, stop_after=2)
        state = loader.state_dict()
    other = aioload.Mix({"web": Source(600, 0), "code": Source(300, 1), "news": Source(200, 2)},
                        {"web": 1, "code": 1, "news": 1})
    with aioload.DataLoader(other, batch_size=10, shuffle=True, seed=0) as loader:
        with pytest.raises(ResumeError, match=r"this state was saved by a loader with sources=\[\['web', 600\], "
                                              r"\['code', 300\], \['books', 200\]\], but this loader has sources="):
            loader.load_state_dict(state)
    with aioload.DataLoader(Source(1100, 0), batch_size=10, shuffle=True, seed=0) as loader:
        with pytest.raises(ResumeError, match=r"config has unexpected keys \['sources'\]"):
            loader.load_state_dict(state)


def test_set_weights_needs_a_mix():
    with aioload.DataLoader(Source(10, 0), batch_size=2) as loader:
        with pytest.raises(TypeError, match="set_weights changes the weights of an aioload.Mix drawn by the "
                                            "loader's own sampler; this loader's dataset is a Source"):
            loader.set_weights({"a": 1})
