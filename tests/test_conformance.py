"""aioload.DataLoader against torch.utils.data.DataLoader, case by case.

Every scenario runs once with each loader class (the ``loader_cls`` parameter). torch's run is
the reference: it is recorded, and aioload's run of the same scenario must be equal to it --
batches element-wise with the same container and element types, errors with the same type and
original message, warnings with the same category and text, ``len`` before and after.
Both runs start from the same global RNG state.

Datasets and functions used inside worker processes live in ``tests.conformance_data``, a module
that imports only torch and numpy, so that spawn and forkserver workers import them cheaply.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import multiprocessing
import random
import re
import time
import warnings
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, SequentialSampler, SubsetRandomSampler, WeightedRandomSampler

import aioload
from tests.conformance_data import (
    CustomBatch,
    Dies,
    Faulty,
    FailingStream,
    InfoStream,
    ListIndexed,
    PaddedBatches,
    Range,
    SampleError,
    Samples,
    SizedRange,
    Uneven,
    WorkerProbe,
    as_list,
    broken_collate,
    failing_init,
    make_error,
    numpy_collate,
    record_init,
    shard_range,
)

TorchLoader = torch.utils.data.DataLoader
HAS_IN_ORDER = "in_order" in TorchLoader.__init__.__code__.co_varnames


@pytest.fixture(params=[TorchLoader, aioload.DataLoader], ids=["torch", "aioload"])
def loader_cls(request):
    return request.param


# ------------------------------------------------------------------------------ datasets


class SplitSquares(aioload.Dataset):
    """The split protocol; torch's loader uses its ``__getitem__``."""

    def __len__(self):
        return 8

    async def read(self, index):
        return index.to_bytes(2, "little")

    def decode(self, raw):
        i = int.from_bytes(raw, "little")
        return {"x": torch.tensor([i, i * i]), "i": i}


# ------------------------------------------------------------------------------ harness


@dataclasses.dataclass
class Raised:
    """An exception, reduced to what both loaders must agree on."""

    type: type
    message: str


def original_message(exc: BaseException) -> str:
    """The message the exception was raised with. torch re-raises a worker's exception with
    "Caught X in DataLoader worker process N. Original Traceback ..." and the original
    message as the traceback's last line; aioload keeps the message and adds notes."""
    text = str(exc)
    if text.startswith("Caught ") and "Original Traceback" in text:
        last = text.rstrip().splitlines()[-1]
        return last.split(": ", 1)[1] if ": " in last else ""
    return text


def raised(exc: BaseException) -> Raised:
    return Raised(type(exc), original_message(exc))


@contextlib.contextmanager
def opened(loader_cls, *args, **kwargs):
    """A loader of either class, closed afterwards when it can be (torch's cannot)."""
    loader = loader_cls(*args, **kwargs)
    try:
        yield loader
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()


def epoch(loader, stop_on_error: bool = False, limit: int = 64) -> list:
    """One epoch: every batch, and every error in its place. As in torch, iteration goes on
    after a batch failed."""
    events = []
    it = iter(loader)
    for _ in range(limit):
        try:
            events.append(next(it))
        except StopIteration:
            return events
        except Exception as exc:  # noqa: BLE001 - recorded and compared
            events.append(raised(exc))
            if stop_on_error:
                return events
    raise AssertionError(f"the epoch did not end after {limit} batches")


def batches(loader_cls, *args, epochs: int = 1, **kwargs) -> dict:
    """``len`` before, each epoch's events, ``len`` after."""
    with opened(loader_cls, *args, **kwargs) as loader:
        out = {"len_before": _len(loader)}
        out["epochs"] = [epoch(loader) for _ in range(epochs)]
        out["len_after"] = _len(loader)
        return out


def _len(obj):
    try:
        return len(obj)
    except TypeError as exc:
        return raised(exc)


@dataclasses.dataclass
class Observation:
    result: Any
    warnings: list


def observe(scenario: Callable, loader_cls, args: tuple) -> Observation:
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = scenario(loader_cls, *args)
        except Exception as exc:  # noqa: BLE001 - compared like any other result
            result = raised(exc)
    # A ResourceWarning may come from an object of an earlier test collected right now: it is
    # not compared, but raised again for pytest (filterwarnings=error makes a leak fail).
    said = [w for w in caught if not issubclass(w.category, ResourceWarning)]
    for w in caught:
        if issubclass(w.category, ResourceWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return Observation(result, [(w.category, _ADDRESS.sub("at 0x...", str(w.message))) for w in said])


_REFERENCE: dict = {}
_ADDRESS = re.compile(r"at 0x[0-9a-f]+")  # object addresses in messages (each run has its own objects)


def conform(loader_cls, scenario: Callable, *args) -> Observation:
    """Run ``scenario`` with ``loader_cls``; torch's run is recorded as the reference and
    every other loader's run must be equal to it."""
    key = (scenario.__name__, repr(args))
    observed = observe(scenario, loader_cls, args)
    if loader_cls is TorchLoader:
        _REFERENCE[key] = observed
        return observed
    if key not in _REFERENCE:
        _REFERENCE[key] = observe(scenario, TorchLoader, args)
    assert_same(observed, _REFERENCE[key], scenario.__name__)
    return observed


def assert_same(actual, expected, path: str) -> None:
    """Equal values of the same types, all the way down."""
    assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        assert torch.equal(actual, expected), f"{path}: {actual} != {expected}"
    elif isinstance(expected, np.ndarray):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        assert np.array_equal(actual, expected), f"{path}: {actual} != {expected}"
    elif isinstance(expected, collections.abc.Mapping):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}[{i}]")
    elif dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        for field in dataclasses.fields(expected):
            assert_same(getattr(actual, field.name), getattr(expected, field.name), f"{path}.{field.name}")
    elif hasattr(expected, "__dict__") and not isinstance(expected, type):
        assert_same(vars(actual), vars(expected), f"{path}.__dict__")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


# ------------------------------------------------------------------------------ batches

SAMPLE_KINDS = [
    "tensor", "int", "float", "bool", "str", "bytes", "numpy", "numpy_scalar", "numpy_0d",
    "dict", "ordered_dict", "tuple", "list", "namedtuple", "nested", "dtypes", "empty",
    "strided", "scalar_tensor",
]
WORKER_KINDS = ["tensor", "numpy", "dict", "namedtuple", "nested", "dtypes", "empty", "strided", "str"]


def load_samples(loader_cls, kind, batch_size, num_workers):
    return batches(loader_cls, Samples(kind), batch_size=batch_size, num_workers=num_workers)


@pytest.mark.parametrize("kind", SAMPLE_KINDS)
def test_default_collate_in_process(loader_cls, kind):
    conform(loader_cls, load_samples, kind, 3, 0)


@pytest.mark.parametrize("kind", WORKER_KINDS)
def test_default_collate_in_workers(loader_cls, kind):
    conform(loader_cls, load_samples, kind, 3, 2)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["tensor", "numpy", "dict", "int", "str", "nested"])
def test_no_automatic_batching(loader_cls, kind, num_workers):
    """batch_size=None: each sample goes through default_convert, one at a time."""
    conform(loader_cls, load_samples, kind, None, num_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["ragged", "ragged_list", "opaque", "str_array"])
def test_collate_errors(loader_cls, kind, num_workers):
    """Samples default_collate rejects: every batch fails with torch's error, the epoch goes on."""
    obs = conform(loader_cls, load_samples, kind, 3, num_workers)
    assert any(isinstance(e, Raised) for e in obs.result["epochs"][0])


def sampling(loader_cls, case: str, num_workers: int):
    ds = Samples("tensor", n=10)
    kw: dict = {"num_workers": num_workers}
    if case == "drop_last":
        kw.update(batch_size=3, drop_last=True)
    elif case == "shuffle_generator":
        kw.update(batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    elif case == "shuffle_global_rng":
        kw.update(batch_size=4, shuffle=True)
    elif case == "subset_random_sampler":
        kw.update(batch_size=2, sampler=SubsetRandomSampler([1, 3, 5, 7, 9]))
    elif case == "weighted_sampler":
        kw.update(batch_size=3, sampler=WeightedRandomSampler([0.1] * 5 + [1.0] * 5, 8))
    elif case == "plain_list_sampler":
        kw.update(batch_size=2, sampler=[9, 0, 4, 4, 2])
    elif case == "batch_sampler_lists":
        kw.update(batch_sampler=[[0, 1], [5], [2, 3, 4, 8, 9], [7]])
    elif case == "batch_sampler_tuples":
        kw.update(batch_sampler=[(3, 2), (1, 0, 9)])
    elif case == "batch_sampler_object":
        kw.update(batch_sampler=BatchSampler(SequentialSampler(range(10)), 4, drop_last=False))
    elif case == "batch_size_none_with_batch_sampler_as_sampler":
        ds = ListIndexed()
        kw.update(batch_size=None, sampler=BatchSampler(SequentialSampler(range(10)), 3, False))
    else:
        raise ValueError(case)
    return batches(loader_cls, ds, epochs=2, **kw)


SAMPLING_CASES = [
    "drop_last", "shuffle_generator", "shuffle_global_rng", "subset_random_sampler",
    "weighted_sampler", "plain_list_sampler", "batch_sampler_lists", "batch_sampler_tuples",
    "batch_sampler_object", "batch_size_none_with_batch_sampler_as_sampler",
]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("case", SAMPLING_CASES)
def test_sampling(loader_cls, case, num_workers):
    """Two epochs: the order, the batches and what is drawn from the RNGs match torch."""
    conform(loader_cls, sampling, case, num_workers)


# ------------------------------------------------------------------------------ collate_fn


def collating(loader_cls, case: str, num_workers: int):
    if case == "as_list":
        return batches(loader_cls, Samples("dict"), batch_size=3, collate_fn=as_list, num_workers=num_workers)
    if case == "numpy":
        return batches(loader_cls, Samples("numpy"), batch_size=3, collate_fn=numpy_collate, num_workers=num_workers)
    if case == "custom_batch":
        return batches(loader_cls, Samples("tuple"), batch_size=3, collate_fn=CustomBatch, num_workers=num_workers)
    if case == "broken":
        return batches(loader_cls, Samples("int"), batch_size=3, collate_fn=broken_collate, num_workers=num_workers)
    if case == "default_collate_explicit":
        return batches(loader_cls, Samples("nested"), batch_size=3, num_workers=num_workers,
                       collate_fn=torch.utils.data.default_collate)
    if case == "no_batching":
        return batches(loader_cls, Samples("list"), batch_size=None, collate_fn=as_list, num_workers=num_workers)
    raise ValueError(case)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("case", ["as_list", "numpy", "custom_batch", "broken", "default_collate_explicit",
                                  "no_batching"])
def test_collate_fn(loader_cls, case, num_workers):
    conform(loader_cls, collating, case, num_workers)


def batched_fetch(loader_cls, collate_fn, num_workers):
    return batches(loader_cls, PaddedBatches(), batch_size=4, collate_fn=collate_fn, num_workers=num_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("collate_fn", [None, as_list], ids=["default_collate", "as_list"])
def test_getitems_gets_the_whole_batch(loader_cls, collate_fn, num_workers):
    """``__getitems__`` is called once per batch with all of its indices."""
    conform(loader_cls, batched_fetch, collate_fn, num_workers)


def split_dataset(loader_cls, num_workers):
    return batches(loader_cls, SplitSquares(), batch_size=3, num_workers=num_workers, epochs=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_split_dataset_runs_in_both(loader_cls, num_workers):
    """An aioload.Dataset is also a torch Dataset: the same batches either way."""
    conform(loader_cls, split_dataset, num_workers)


# ------------------------------------------------------------------------------ IterableDataset


def iterable(loader_cls, case: str, num_workers: int):
    if case == "sharded_in_iter":
        return batches(loader_cls, Range(0, 11), batch_size=3, num_workers=num_workers, epochs=2)
    if case == "sharded_by_worker_init_fn":
        return batches(loader_cls, Range(0, 11, shard=False), batch_size=3, num_workers=num_workers,
                       worker_init_fn=shard_range if num_workers else None)
    if case == "unsharded_duplicates":
        return batches(loader_cls, Range(0, 5, shard=False), batch_size=2, num_workers=num_workers)
    if case == "uneven":
        return batches(loader_cls, Uneven(), batch_size=2, num_workers=num_workers)
    if case == "drop_last":
        return batches(loader_cls, Range(0, 11), batch_size=3, drop_last=True, num_workers=num_workers)
    if case == "no_batching":
        return batches(loader_cls, Range(0, 5), batch_size=None, num_workers=num_workers)
    if case == "error":
        return batches(loader_cls, FailingStream(), batch_size=None, num_workers=num_workers)
    raise ValueError(case)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("case", ["sharded_in_iter", "sharded_by_worker_init_fn", "unsharded_duplicates",
                                  "uneven", "drop_last", "no_batching", "error"])
def test_iterable_dataset(loader_cls, case, num_workers):
    conform(loader_cls, iterable, case, num_workers)


def iterable_length(loader_cls, reported, num_workers, batch_size, call_len):
    with opened(loader_cls, SizedRange(0, 6, shard=False, reported=reported), batch_size=batch_size,
                num_workers=num_workers) as loader:
        length = len(loader) if call_len else None
        return {"len": length, "epoch": epoch(loader)}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("reported,batch_size,call_len", [(4, None, True), (4, None, False), (2, 2, True)])
def test_iterable_length_warnings(loader_cls, reported, num_workers, batch_size, call_len):
    """Fetching more than ``len(loader)`` said warns, once per extra batch, as torch does."""
    obs = conform(loader_cls, iterable_length, reported, num_workers, batch_size, call_len)
    assert bool(obs.warnings) == call_len


def worker_view(loader_cls, num_workers, persistent, init):
    kw = {"persistent_workers": True} if persistent else {}
    return batches(loader_cls, InfoStream(), batch_size=None, num_workers=num_workers, epochs=2,
                   worker_init_fn=record_init if init else None, **kw)


@pytest.mark.parametrize("num_workers,persistent,init", [
    (0, False, False), (2, False, False), (2, True, True), (1, True, False),
])
def test_worker_info_and_seeds(loader_cls, num_workers, persistent, init):
    """Inside workers get_worker_info() gives the id, num_workers, seed and the worker's own
    dataset copy; torch, random and numpy are seeded from torch's base seed as torch seeds
    them, worker_init_fn runs after seeding, and persistent workers keep their RNG streams."""
    obs = conform(loader_cls, worker_view, num_workers, persistent, init)
    first = obs.result["epochs"][0]
    assert sorted({item["id"] for item in first}) == (list(range(num_workers)) if num_workers else [-1])


def worker_probe(loader_cls):
    with opened(loader_cls, WorkerProbe(), batch_size=2, num_workers=2, worker_init_fn=record_init,
                collate_fn=as_list) as loader:
        return [sample for batch in loader for sample in batch]


def test_map_style_worker_info(loader_cls):
    """Map-style datasets see the same worker info and worker_init_fn state as in torch (which
    worker serves which batch is a scheduling detail, so the set of views is compared)."""
    observed = observe(worker_probe, loader_cls, ())
    reference = observe(worker_probe, TorchLoader, ())
    assert [s[0] for s in observed.result] == list(range(8))
    views = {tuple(_plain(v) for v in s[1:]) for s in observed.result}
    assert views <= {tuple(_plain(v) for v in s[1:]) for s in reference.result}
    assert all(view[0] in (0, 1) and view[1] == 2 for view in views)


def _plain(value):
    if isinstance(value, torch.Tensor):
        return _plain(value.tolist())
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value


# ------------------------------------------------------------------------------ errors


def failing(loader_cls, kind, num_workers, batch_size):
    return batches(loader_cls, Faulty(kind, bad=(3, 6)), batch_size=batch_size, num_workers=num_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["value", "key", "custom"])
@pytest.mark.parametrize("batch_size", [2, None])
def test_dataset_errors(loader_cls, kind, num_workers, batch_size):
    """The dataset's exception comes out with its type and message, in place of its batch;
    the batches after it still arrive."""
    obs = conform(loader_cls, failing, kind, num_workers, batch_size)
    errors = [e for e in obs.result["epochs"][0] if isinstance(e, Raised)]
    assert len(errors) == 2 and errors[0].type is type(make_error(kind, 3))


def init_fails(loader_cls):
    with opened(loader_cls, Samples("int"), batch_size=2, num_workers=1, worker_init_fn=failing_init) as loader:
        return epoch(loader, stop_on_error=True)[0]


def test_worker_init_fn_error(loader_cls):
    obs = conform(loader_cls, init_fails)
    assert obs.result == Raised(SampleError, "worker 0 could not open its database")


def worker_dies(loader_cls):
    with opened(loader_cls, Dies(), batch_size=2, num_workers=1) as loader:
        try:
            next(iter(loader))
        except RuntimeError as exc:
            return {"raised": "RuntimeError", "says_exited": "exited" in str(exc)}
    return "no error"


def test_dead_worker_is_reported(loader_cls):
    """A worker that exits mid-batch raises a RuntimeError naming the exit, never hangs."""
    obs = conform(loader_cls, worker_dies)
    assert obs.result == {"raised": "RuntimeError", "says_exited": True}


# ------------------------------------------------------------------------------ arguments

INVALID = {
    "shuffle_and_sampler": dict(shuffle=True, sampler=[0, 1]),
    "batch_sampler_and_batch_size": dict(batch_sampler=[[0]], batch_size=2),
    "batch_sampler_and_shuffle": dict(batch_sampler=[[0]], shuffle=True),
    "batch_sampler_and_sampler": dict(batch_sampler=[[0]], sampler=[0]),
    "batch_sampler_and_drop_last": dict(batch_sampler=[[0]], drop_last=True),
    "no_batching_and_drop_last": dict(batch_size=None, drop_last=True),
    "zero_batch_size": dict(batch_size=0),
    "bool_batch_size": dict(batch_size=True),
    "negative_workers": dict(num_workers=-1),
    "negative_timeout": dict(num_workers=1, timeout=-1),
    "prefetch_without_workers": dict(prefetch_factor=2),
    "negative_prefetch": dict(num_workers=1, prefetch_factor=-1),
    "persistent_without_workers": dict(persistent_workers=True),
    "unknown_start_method": dict(num_workers=1, multiprocessing_context="teleport"),
    "context_without_workers": dict(multiprocessing_context="spawn"),
    "bad_context_type": dict(num_workers=1, multiprocessing_context=3.5),
    "iterable_and_shuffle": dict(shuffle=True, iterable=True),
    "iterable_and_sampler": dict(sampler=[0], iterable=True),
    "iterable_and_batch_sampler": dict(batch_sampler=[[0]], iterable=True),
}


def construct(loader_cls, case):
    kw = dict(INVALID[case])
    dataset = Range(0, 4) if kw.pop("iterable", False) else Samples("int")
    with opened(loader_cls, dataset, **kw):
        return "accepted"


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_arguments(loader_cls, case):
    """Rejected combinations raise torch's exception type with torch's message."""
    obs = conform(loader_cls, construct, case)
    assert isinstance(obs.result, Raised)


def attributes(loader_cls):
    gen = torch.Generator()
    with opened(loader_cls, Samples("int"), batch_size=3, shuffle=True, num_workers=1, drop_last=True,
                generator=gen, timeout=5, persistent_workers=True, prefetch_factor=3) as loader:
        out = {
            name: getattr(loader, name)
            for name in ("batch_size", "drop_last", "num_workers", "timeout", "prefetch_factor",
                         "persistent_workers", "pin_memory", "pin_memory_device", "worker_init_fn")
        }
        out["generator_is_users"] = loader.generator is gen
        out["sampler"] = type(loader.sampler).__name__
        out["batch_sampler"] = type(loader.batch_sampler).__name__
        out["collate_fn"] = loader.collate_fn.__name__
        out["dataset_kind"] = type(loader.dataset).__name__
        for name in ("batch_size", "sampler", "batch_sampler", "drop_last", "dataset", "persistent_workers"):
            try:
                setattr(loader, name, None)
                out[f"set_{name}"] = "allowed"
            except Exception as exc:  # noqa: BLE001
                out[f"set_{name}"] = raised(exc)
        return out


def test_attributes(loader_cls):
    """The loader exposes torch's attributes, and refuses to change the ones torch refuses."""
    conform(loader_cls, attributes)


# ------------------------------------------------------------------------------ pinning


def pinning(loader_cls, case, num_workers):
    if case == "plain":
        return batches(loader_cls, Samples("dict"), batch_size=3, pin_memory=True, num_workers=num_workers,
                       epochs=2)
    if case == "custom_batch":
        return batches(loader_cls, Samples("tuple"), batch_size=3, pin_memory=True, collate_fn=CustomBatch,
                       num_workers=num_workers)
    if case == "device":
        return batches(loader_cls, Samples("tensor"), batch_size=3, pin_memory=True, pin_memory_device="cuda",
                       num_workers=num_workers)
    if case == "device_without_pinning":
        return batches(loader_cls, Samples("tensor"), batch_size=3, pin_memory_device="cuda",
                       num_workers=num_workers)
    raise ValueError(case)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("case", ["plain", "custom_batch", "device", "device_without_pinning"])
def test_pin_memory(loader_cls, case, num_workers):
    """Same batches, and the same warnings when no accelerator can pin (per iteration, as torch)."""
    conform(loader_cls, pinning, case, num_workers)


# ------------------------------------------------------------------------------ worker options


def options(loader_cls, case):
    kw: dict = {"batch_size": 3, "num_workers": 2}
    if case == "persistent":
        kw.update(persistent_workers=True, shuffle=True)
    elif case == "prefetch_factor":
        kw.update(prefetch_factor=1)
    elif case == "timeout":
        kw.update(timeout=60)
    elif case == "init_fn":
        kw.update(worker_init_fn=record_init, batch_size=2)
    elif case == "fork_context_object":
        kw.update(multiprocessing_context=multiprocessing.get_context("fork"))
    elif case == "in_order":
        kw.update(in_order=True)
    else:
        raise ValueError(case)
    dataset = Samples("nested", n=10) if case != "init_fn" else Samples("tensor", n=10)
    return batches(loader_cls, dataset, epochs=2, **kw)


@pytest.mark.parametrize("case", ["persistent", "prefetch_factor", "timeout", "init_fn", "fork_context_object",
                                  "in_order"])
def test_worker_options(loader_cls, case):
    if case == "in_order" and not HAS_IN_ORDER:
        pytest.skip("this torch has no in_order argument")
    conform(loader_cls, options, case)


def out_of_order(loader_cls):
    with opened(loader_cls, Samples("tensor", n=10), batch_size=2, num_workers=2, in_order=False) as loader:
        got = [b for b in loader]
    return sorted(got, key=lambda b: b[0, 0].item())


@pytest.mark.skipif(not HAS_IN_ORDER, reason="this torch has no in_order argument")
def test_in_order_false_delivers_every_batch(loader_cls):
    conform(loader_cls, out_of_order)


def forkserver_workers(loader_cls):
    return batches(loader_cls, Samples("nested", n=6), batch_size=3, num_workers=1,
                   multiprocessing_context="forkserver", worker_init_fn=record_init)


def test_forkserver_workers(loader_cls):
    """Workers started by a fork server import the dataset by name and load the same batches."""
    conform(loader_cls, forkserver_workers)


def spawn_workers(loader_cls):
    return batches(loader_cls, InfoStream(), batch_size=None, num_workers=1, multiprocessing_context="spawn",
                   worker_init_fn=record_init)


def test_spawn_workers(loader_cls):
    """Spawned workers: the same worker info, seeds and worker_init_fn state as torch's."""
    conform(loader_cls, spawn_workers)


# ------------------------------------------------------------------------------ lifetime


def lifetime(loader_cls, case, num_workers):
    kw = {"batch_size": 3, "shuffle": True, "num_workers": num_workers}
    if case == "break_then_again":
        with opened(loader_cls, Samples("tensor", n=10), **kw) as loader:
            first = []
            for batch in loader:
                first.append(batch)
                if len(first) == 2:
                    break
            return {"first": first, "again": epoch(loader), "len": len(loader)}
    if case == "two_loaders_interleaved":
        # a's own generator: torch draws each loader's base seed at iter(), aioload at the first
        # next() (docs/migration.md), which orders the draws of two global-RNG loaders differently
        with opened(loader_cls, Samples("tensor", n=10), **kw, generator=torch.Generator().manual_seed(5)) as a, \
                opened(loader_cls, Samples("dict", n=8), batch_size=2, num_workers=num_workers) as b:
            return {"zip": list(zip(a, b)), "a": epoch(a), "b": epoch(b)}
    if case == "iterator_len":
        with opened(loader_cls, Samples("tensor", n=10), **kw) as loader:
            it = iter(loader)
            before = len(it)
            got = [next(it), next(it)]
            return {"before": before, "after": len(it), "got": got, "rest": list(it)}
    raise ValueError(case)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("case", ["break_then_again", "two_loaders_interleaved", "iterator_len"])
def test_lifetime(loader_cls, case, num_workers):
    conform(loader_cls, lifetime, case, num_workers)


# ------------------------------------------------------------------------------ documented differences
# aioload's own behaviour where docs/migration.md says it differs from torch's on purpose.


def test_a_second_iter_ends_the_running_epoch():
    with aioload.DataLoader(Samples("int", n=6), batch_size=2, num_workers=1) as loader:
        first = iter(loader)
        next(first)
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
        with pytest.raises(aioload.LoaderClosedError, match=r"^this epoch ended because iter\(\) was called on "
                           r"the same DataLoader again: an aioload.DataLoader runs one epoch at a time; "
                           r"use two loaders to walk two epochs side by side$"):
            next(first)


def test_a_superseded_epoch_whose_batches_were_all_made_does_not_hang():
    """The first epoch's engine has made every batch before the second iter() lets them go:
    asking the first iterator again must raise, not wait for batches that are gone."""
    with aioload.DataLoader(Samples("int", n=6), batch_size=2, num_workers=1) as loader:
        first = iter(loader)
        next(first)
        deadline = time.monotonic() + 30
        while len(first._ready) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(first._ready) == 2  # batches 1 and 2 are made and waiting
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
        with pytest.raises(aioload.LoaderClosedError, match=r"^this epoch ended because iter\(\) was called"):
            next(first)


def test_timeout_without_workers_is_refused():
    with pytest.raises(ValueError, match=r"^timeout applies to worker processes: use it with num_workers > 0$"):
        aioload.DataLoader(Samples("int"), timeout=5)


def test_workers_outlive_a_finished_epoch():
    """worker_init_fn runs once per worker process: the pool is kept between full epochs."""
    with aioload.DataLoader(InfoStream(), batch_size=None, num_workers=1, worker_init_fn=record_init) as loader:
        epochs = [list(loader) for _ in range(2)]
    inits = {tuple(item["init"]) for items in epochs for item in items}
    assert len(inits) == 1
