"""Where the memory goes: each process's PSS and private memory in ``stats()``, and copy-on-read
named by the dataset's attribute, with real worker processes (fork: the start method whose
sharing copy-on-read undoes)."""

from __future__ import annotations

import gc
import re

import pytest
import torch

import aioload
from aioload._observe import memory as _memory
from tests.resources import Snapshot, assert_released

pytestmark = pytest.mark.timeout(120)

PATHS = 300_000


class Paths(torch.utils.data.Dataset):
    """A manifest of path strings, as a list (copied into every worker as it is read) or as an
    ``aioload.StringList`` (one buffer: nothing to copy)."""

    def __init__(self, kind):
        self.paths = kind(f"/data/train/class-{i % 1000:04d}/image-{i:08d}.jpg" for i in range(PATHS))
        self.labels = torch.arange(PATHS) % 1000

    def __len__(self) -> int:
        return PATHS

    def __getitem__(self, index: int):
        return len(self.paths[index]), self.labels[index]


@pytest.fixture(scope="module", autouse=True)
def warm():
    """One loader before any snapshot: lazily opened, process-wide handles (multiprocessing's
    shared heap, uvloop's) are then part of every baseline."""
    with aioload.DataLoader(list(range(8)), batch_size=4, num_workers=1, multiprocessing_context="fork") as loader:
        list(loader)


@pytest.fixture
def low_threshold(monkeypatch):
    """A worker growing past 2 MB over an epoch counts (300,000 strings copy about 20 MB), and
    an epoch is measured from its first batch however short it is."""
    monkeypatch.setattr(_memory, "GROWTH_WARNING", 2 * 2**20)
    monkeypatch.setattr(_memory, "OPEN_AFTER_S", 0.0)


def one_epoch(dataset) -> aioload.LoaderStats:
    with aioload.DataLoader(dataset, batch_size=1000, shuffle=True, num_workers=2,
                            multiprocessing_context="fork", seed=0) as loader:
        assert sum(len(lengths) for lengths, _ in loader) == PATHS
        return loader.stats()


def test_a_list_of_strings_copied_into_the_workers_is_named_by_attribute(low_threshold):
    before = Snapshot.take()
    with pytest.warns(aioload.CopyOnReadWarning) as caught:
        stats = one_epoch(Paths(list))
    assert len(caught) == 1
    warning = caught[0]
    assert warning.filename == __file__  # points at the loop that iterated
    assert re.fullmatch(
        r"aioload worker [01] \(pid \d+\) gained \d+ MB of private memory over epoch 0, and the dataset holds "
        r"large Python containers: dataset\.paths \(a list of 300,000 items\)\. Every worker copies such a "
        r"container page by page as it reads it \(each read changes its items' reference counts\): hold strings "
        r"in an aioload\.StringList, numbers in a numpy array, records in an Arrow table \(or numpy arrays per "
        r"field\)\. See docs/troubleshooting\.md \(\"Memory\"\)\.",
        str(warning.message),
    ), str(warning.message)
    assert stats.copy_on_read == "dataset.paths (300,000 items)"
    assert max(stats.worker_growth_bytes) > 2 * 2**20
    assert stats.verdict_category == "copy-on-read"
    assert_released(before)


def test_a_string_list_is_not_copied_and_not_warned_about(low_threshold):
    before = Snapshot.take()
    stats = one_epoch(Paths(aioload.StringList))  # filterwarnings = error: a warning fails this
    assert stats.copy_on_read == ""
    assert stats.verdict_category != "copy-on-read"
    assert_released(before)


def test_stats_give_each_process_pss_and_private_memory():
    with aioload.DataLoader(Paths(aioload.StringList), batch_size=1000, num_workers=2) as loader:
        it = iter(loader)
        next(it)
        stats = loader.stats()
        assert len(stats.worker_pss_bytes) == 2 and all(n > 0 for n in stats.worker_pss_bytes)
        assert all(0 < private <= peak for private, peak in zip(stats.worker_private_bytes,
                                                                   stats.worker_peak_pss_bytes))
        assert stats.process_pss_bytes > 0 and stats.process_peak_pss_bytes >= stats.process_pss_bytes
        assert "PSS: this process" in str(stats)
        del it
    assert loader.stats().worker_pss_bytes == ()  # no workers left to measure


@pytest.mark.unit
def test_the_walk_names_large_containers_through_attributes_and_small_containers():
    class Holder:
        __slots__ = ("rows",)

        def __init__(self):
            self.rows = list(range(_memory.LARGE))

    class Dataset(torch.utils.data.Dataset):
        def __init__(self):
            self.meta = {"files": {str(i): i for i in range(_memory.LARGE + 5)}, "name": "x"}
            self.holder = Holder()
            self.small = list(range(10))
            self.strings = aioload.StringList(str(i) for i in range(_memory.LARGE))
            self.tensor = torch.zeros(_memory.LARGE)

    found = _memory.large_containers(torch.utils.data.Subset(Dataset(), [0, 1]))
    assert found == [("dataset.dataset.meta['files']", "dict", _memory.LARGE + 5),
                     ("dataset.dataset.holder.rows", "list", _memory.LARGE)]


def test_a_short_epoch_costs_the_training_process_no_memory_measurement():
    """An epoch shorter than ``OPEN_AFTER_S`` is not measured (one-second epochs measured each
    cost ``aioload bench`` twice torch's main-process CPU per image); ``stats()`` still is."""
    with aioload.DataLoader(list(range(64)), batch_size=8, num_workers=2, persistent_workers=True) as loader:
        for _ in range(3):
            assert len(list(loader)) == 8
        window = loader._stats._memory
        assert window._spent == 0.0 and window._measured_at is None
        stats = loader.stats()
    assert stats.process_pss_bytes > 0 and len(stats.worker_pss_bytes) == 2


@pytest.mark.unit
def test_measurements_stop_once_they_took_their_share_of_the_time():
    window = _memory.MemoryWindow(list)
    assert window.affordable()
    window._spent = 1.0  # a second of measuring in a loader a moment old: past 1 %
    assert not window.affordable()


class Tracked(torch.utils.data.Dataset):
    """A million one-item lists (objects the garbage collector tracks: about 70 MB) that each
    read leaves alone; a read runs a full collection first, as a long epoch's allocations do
    sooner or later, and says how much this process's private memory grew over it."""

    def __init__(self):
        self.rows = [[i] for i in range(1_000_000)]

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int):
        before = _memory.rollup().private
        gc.collect()
        return _memory.rollup().private - before


def test_a_full_collection_in_a_fork_worker_copies_none_of_the_datasets_objects():
    # a collection writes to the header of every object it walks: walking the dataset's
    # objects inherited from the training process would copy each page of them into the worker
    with aioload.DataLoader(Tracked(), batch_size=None, num_workers=1, multiprocessing_context="fork") as loader:
        grown = [int(x) for x in loader]
    assert len(grown) == 2
    assert max(grown) < 8 * 2**20, f"a collection copied {max(grown) / 2**20:.0f} MB into the worker"
