"""The front end: both epoch iterators on their one base, the epoch context the loader hands
over, the lazy start, len(), close() and the end of a superseded epoch. No worker processes:
``num_workers=0`` loaders (a plain dataset loads in this thread; a split one reads on the
engine's thread and decodes here)."""

from __future__ import annotations

import ast
import gc
import pathlib

import anyio
import pytest

import aioload
from aioload._front.epoch import EpochContext, EpochIterator
from aioload._front.inprocess import InProcessIterator
from aioload._front.iterator import EngineIterator
from tests.conftest import aioload_threads
from tests.datasets import SlowReads, Squares

pytestmark = pytest.mark.unit  # no worker process, no thread pool: `pytest -m unit` runs these in seconds

PACKAGE = pathlib.Path(aioload.__file__).parent
FRONT = ("_front/epoch.py", "_front/iterator.py", "_front/inprocess.py", "_front/compat.py", "_front/resources.py")
SUPERSEDED = (r"^this epoch ended because iter\(\) was called on the same DataLoader again: an "
              r"aioload.DataLoader runs one epoch at a time; use two loaders to walk two epochs side by side$")


def plain(**kw) -> aioload.DataLoader:
    return aioload.DataLoader(Squares(10), batch_size=4, **kw)


def split(**kw) -> aioload.DataLoader:
    return aioload.DataLoader(SlowReads(10), batch_size=4, **kw)


def firsts(batches) -> list[int]:
    return [int(b[1][0]) for b in batches]


@pytest.mark.parametrize("name", FRONT)
def test_the_front_end_does_not_import_the_loader(name):
    """The circle is broken: the iterator modules know the loader only as an EpochSource."""
    tree = ast.parse((PACKAGE / name).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert "aioload._front.loader" not in imported


@pytest.mark.parametrize("make, kind", [(plain, InProcessIterator), (split, EngineIterator)])
def test_both_iterators_share_one_base(make, kind):
    with make() as loader:
        it = iter(loader)
        assert type(it) is kind and isinstance(it, EpochIterator)
        assert iter(it) is it and it.__aiter__() is it


@pytest.mark.parametrize("make", [plain, split])
def test_an_iterator_starts_its_epoch_at_the_first_next(make):
    with make(seed=3) as loader:
        threads = len(aioload_threads())
        before = loader.state_dict()
        probe = iter(loader)
        assert probe._ctx is None
        del probe
        gc.collect()
        assert loader.stats().epochs == 0 and loader.state_dict() == before
        assert loader._res.engine is None and len(aioload_threads()) == threads
        it = iter(loader)
        first = next(it)
        assert firsts([first]) == [0]
        ctx = it._ctx
        assert isinstance(ctx, EpochContext) and ctx.plan is not None and not ctx.superseded
        assert loader.stats().epochs == 1
        assert loader.state_dict()["progress"] is not None


def test_the_engine_epoch_context_holds_the_engine_and_its_queue():
    with split() as loader:
        it = iter(loader)
        next(it)
        ctx = it._ctx
        assert ctx.engine is loader._res.engine and ctx.ready is it._ready and ctx.resources is loader._res
        assert ctx.batches == 3 and ctx.budget is ctx.engine.budget


def test_the_in_process_epoch_context_has_no_engine():
    with plain() as loader:
        it = iter(loader)
        next(it)
        ctx = it._ctx
        assert (ctx.engine, ctx.ready, ctx.resources, ctx.transfer) == (None, None, None, None)
        assert loader._res.engine is None


@pytest.mark.parametrize("make", [plain, split])
def test_len_of_an_iterator_is_the_loaders(make):
    with make() as loader:
        it = iter(loader)
        assert len(it) == len(loader) == 3
        next(it)
        assert len(it) == 3
        assert len(list(it)) == 2


@pytest.mark.parametrize("make", [plain, split])
def test_a_closed_iterator_yields_nothing_more(make):
    with make() as loader:
        it = iter(loader)
        next(it)
        it.close()
        with pytest.raises(StopIteration):
            next(it)
        assert loader._res.engine is None
        assert len(list(loader)) == 3  # the loader goes on with a new epoch


def test_closing_an_iterator_before_it_started_starts_nothing():
    with split() as loader:
        it = iter(loader)
        it.close()
        with pytest.raises(StopIteration):
            next(it)
        assert loader.stats().epochs == 0 and loader._res.engine is None


def test_a_superseded_engine_epoch_says_why_it_ended():
    with split() as loader:
        first = iter(loader)
        next(first)
        assert firsts(loader) == [0, 4, 8]
        assert first._ctx.superseded
        with pytest.raises(aioload.LoaderClosedError, match=SUPERSEDED):
            next(first)
        with pytest.raises(StopIteration):  # and stays ended
            next(first)


def test_an_in_process_epoch_is_not_superseded():
    """num_workers=0 over a plain dataset keeps torch's behaviour: two iterators of one loader
    walk side by side."""
    with plain() as loader:
        first = iter(loader)
        assert firsts([next(first)]) == [0]
        assert firsts(loader) == [0, 4, 8]
        assert firsts(first) == [4, 8]


def test_closing_the_loader_during_an_epoch_says_so():
    with split() as loader:
        it = iter(loader)
        next(it)
        loader.close()
        with pytest.raises(aioload.LoaderClosedError, match=r"^the DataLoader was closed during iteration$"):
            next(it)


def test_a_dropped_engine_iterator_stops_its_engine():
    with split() as loader:
        it = iter(loader)
        next(it)
        engine = loader._res.engine
        assert engine is not None
        del it
        gc.collect()
        assert loader._res.engine is None and engine.clean


@pytest.mark.parametrize("make", [plain, split])
def test_async_iteration_shares_the_lazy_start_and_the_end(make):
    async def main(loader):
        probe = loader.__aiter__()
        del probe
        assert loader.stats().epochs == 0
        got = [batch async for batch in loader]
        return firsts(got), loader.stats().epochs, loader.stats().batches

    with make() as loader:
        assert anyio.run(main, loader) == ([0, 4, 8], 1, 3)


def test_a_superseded_epoch_ends_for_async_for_too():
    async def main(loader):
        first = loader.__aiter__()
        await first.__anext__()
        assert firsts([b async for b in loader]) == [0, 4, 8]
        with pytest.raises(aioload.LoaderClosedError, match=SUPERSEDED):
            await first.__anext__()

    with split() as loader:
        anyio.run(main, loader)


def test_each_epoch_counts_its_own_progress():
    """state_dict() counts the batches of the epoch in progress, through its context."""
    with plain() as loader:
        it = iter(loader)
        next(it)
        next(it)
        state = loader.state_dict()
        assert state["progress"] is not None and it._ctx.progress.taken == 2
        rest = plain()
        rest.load_state_dict(state)
        assert firsts(rest) == [8]
        rest.close()


def test_a_finished_epoch_context_does_not_outlive_its_iterator():
    """The loader keeps no strong reference to an epoch (its engine, queue and transfer go with
    its iterator), yet can still tell a running one that a newer epoch superseded it."""
    import weakref

    with split() as loader:
        it = iter(loader)
        next(it)
        ctx = weakref.ref(it._ctx)
        del it
        gc.collect()
        assert ctx() is None
