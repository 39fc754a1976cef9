"""What torch's DataLoader lets code do with a loader, which frameworks rely on: assigning its
attributes, probing it with ``iter()``, subscripting the class, swapping it in for torch's,
seeing it in ``torch.profiler`` traces."""

from __future__ import annotations

import asyncio
import functools
import gc
import multiprocessing
import threading

import pytest
import torch

import aioload
from tests.datasets import SlowReads, Squares

_TAG = None  # set by _tag_worker in a worker process


def _tag_worker(worker_id: int, tag: str = "init") -> None:
    global _TAG
    _TAG = tag  # not the worker's id: which worker loads which batch is not compared here


class Tagged(torch.utils.data.Dataset):
    """Each sample is its index and what ``worker_init_fn`` left in the worker that loaded it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        return index, str(_TAG)


def _mine(batch):
    return ("mine", [index for index, _ in batch])


# ------------------------------------------------------------------- assignable attributes


def _assignments():
    """A valid value for every public attribute of torch's loader (and one invalid value for
    the attribute torch validates)."""
    return [
        ("batch_size", 4), ("drop_last", True), ("dataset", Tagged()), ("persistent_workers", False),
        ("sampler", torch.utils.data.SequentialSampler(range(8))), ("batch_sampler", None),
        ("num_workers", 1), ("collate_fn", _mine), ("timeout", 3), ("worker_init_fn", _tag_worker),
        ("multiprocessing_context", "spawn"), ("multiprocessing_context", "no-such-method"),
        ("generator", torch.Generator()), ("prefetch_factor", 4), ("pin_memory", True),
        ("pin_memory_device", ""), ("in_order", False), ("a_new_attribute", 1),
    ]


def _assign(loader, name, value) -> str:
    try:
        setattr(loader, name, value)
    except Exception as exc:  # noqa: BLE001 -- the outcome is compared with torch's
        return f"{type(exc).__name__}: {str(exc).replace(type(loader).__name__, 'DataLoader')}"
    read = getattr(loader, name)
    same = read is value or (name == "multiprocessing_context" and read is multiprocessing.get_context(value))
    return "assigned" if same else f"assigned, reads back {read!r}"


def test_attributes_assign_as_on_torch():
    """Each attribute torch's loader lets code assign after construction is assignable, and
    each it refuses raises torch's error: the oracle is torch's loader itself."""
    public = {n for n in vars(torch.utils.data.DataLoader(Tagged(), num_workers=2)) if not n.startswith("_")}
    public.add("multiprocessing_context")  # a property on torch's class
    assert public <= {name for name, _ in _assignments()}, "a new attribute of torch's DataLoader"
    for name, value in _assignments():
        torch_loader = torch.utils.data.DataLoader(Tagged(), batch_size=2, num_workers=2)
        expected = _assign(torch_loader, name, value)
        with aioload.DataLoader(Tagged(), batch_size=2, num_workers=2) as loader:
            assert _assign(loader, name, value) == expected, name


def test_a_generator_cannot_be_assigned_next_to_seed():
    """``seed=`` and ``generator`` exclude each other, assigned or passed (aioload's own rule:
    torch has no ``seed=``)."""
    with aioload.DataLoader(Tagged(), shuffle=True, seed=1) as loader:
        with pytest.raises(ValueError, match="^pass either seed or generator, not both: seed=S makes aioload "
                                             "seed a generator per epoch$"):
            loader.generator = torch.Generator()
        assert loader.generator is None


def test_an_assigned_generator_draws_the_order_as_in_torch():
    orders = []
    for loader_cls in (torch.utils.data.DataLoader, aioload.DataLoader):
        torch.manual_seed(0)  # the sampler was built without a generator: it draws its seed here
        loader = loader_cls(Tagged(), batch_size=4, shuffle=True, num_workers=2)
        loader.generator = torch.Generator().manual_seed(11)
        orders.append([_plain([batch[0] for batch in loader]), torch.get_rng_state()])
        getattr(loader, "close", lambda: None)()
    assert orders[1][0] == orders[0][0]
    assert torch.equal(orders[1][1], orders[0][1])  # the base seed came from the assigned generator


def _plain(value):
    """A batch as plain lists, to compare with ``==``."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _epochs(loader_cls, persistent: bool, change) -> list:
    """Two epochs, with ``change(loader)`` applied between them."""
    loader = loader_cls(Tagged(), batch_size=4, num_workers=2, persistent_workers=persistent)
    try:
        first = _plain(list(loader))
        change(loader)
        return [first, _plain(list(loader))]
    finally:
        getattr(loader, "close", lambda: None)()


_CHANGES = {
    "worker_init_fn": lambda loader: setattr(loader, "worker_init_fn", functools.partial(_tag_worker, tag="new")),
    "collate_fn": lambda loader: setattr(loader, "collate_fn", _mine),
    "num_workers": lambda loader: setattr(loader, "num_workers", 1),
}


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent"])
@pytest.mark.parametrize("change", sorted(_CHANGES))
def test_assigned_worker_settings_apply_as_in_torch(change, persistent):
    """A new value applies to the next pool of workers: every epoch after the change without
    persistent workers; persistent workers already running keep what they started with."""
    expected = _epochs(torch.utils.data.DataLoader, persistent, _CHANGES[change])
    assert _epochs(aioload.DataLoader, persistent, _CHANGES[change]) == expected


# Lightning 2.6 on torch >= 2.10 warns about its own use of torch's pytree API.
_LIGHTNING_OWN = "ignore:.isinstance.treespec, LeafSpec.. is deprecated:FutureWarning"


@pytest.mark.filterwarnings(_LIGHTNING_OWN)
def test_seed_everything_workers_sets_worker_init_fn():
    """``lightning.seed_everything(workers=True)`` makes the Trainer assign the loader's
    ``worker_init_fn``; training then runs with Lightning's seeding in the workers."""
    lightning = pytest.importorskip("lightning")
    from lightning.fabric.utilities.seed import pl_worker_init_function

    class Model(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: list[int] = []

        def training_step(self, batch, batch_idx):
            index, _ = batch
            self.seen.extend(index.tolist())
            return self.layer(index.float().unsqueeze(1)).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    lightning.seed_everything(7, workers=True, verbose=False)
    model = Model()
    with aioload.DataLoader(Tagged(), batch_size=4, num_workers=2) as loader:
        trainer = lightning.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, log_every_n_steps=1)
        trainer.fit(model, train_dataloaders=loader)
        assert loader.worker_init_fn.func is pl_worker_init_function
    assert sorted(model.seen) == list(range(8))


# ------------------------------------------------------------------- iter() as a probe


def _running() -> tuple[set, set]:
    """This process's threads and child processes."""
    return set(threading.enumerate()), {p.pid for p in multiprocessing.active_children()}


def _labels(loader) -> list[list[int]]:
    return [batch[1].tolist() for batch in loader]


_PROBED = [(Squares, 0), (Squares, 2), (SlowReads, 0), (SlowReads, 2)]


def _ids(case) -> str:
    return f"{case[0].__name__}-{case[1]}w"


@pytest.mark.parametrize("case", _PROBED, ids=_ids)
def test_an_iterator_never_advanced_starts_nothing(case):
    """What Lightning does with a loader it does not know: ``iter()`` once to check it, then
    drop the iterator. That starts no thread or process, draws nothing from torch's RNG,
    counts no epoch; the next epoch is the one it would have been without the probe."""
    dataset_cls, workers = case
    torch.manual_seed(3)
    with aioload.DataLoader(dataset_cls(20), batch_size=4, shuffle=True, num_workers=workers) as loader:
        reference = [_labels(loader), _labels(loader)]
    torch.manual_seed(3)
    with aioload.DataLoader(dataset_cls(20), batch_size=4, shuffle=True, num_workers=workers) as loader:
        before, rng = _running(), torch.get_rng_state()
        probe = iter(loader)
        assert _running() == before
        assert torch.equal(torch.get_rng_state(), rng)
        # a state taken now stands for the probed epoch's start, with the generator state that
        # epoch draws from (as torchdata's does after iter()): it resumes that epoch's order
        probed = loader.state_dict()
        del probe
        gc.collect()
        assert [_labels(loader), _labels(loader)] == reference
    torch.manual_seed(99)  # another global RNG: the state carries what the epoch draws from
    with aioload.DataLoader(dataset_cls(20), batch_size=4, shuffle=True, num_workers=workers) as loader:
        loader.load_state_dict(probed)
        assert _labels(loader) == reference[0]


def test_an_async_iterator_never_advanced_starts_nothing():
    async def main():
        with aioload.DataLoader(SlowReads(12), batch_size=4, num_workers=2) as loader:
            before = _running()
            probe = aiter(loader)
            assert _running() == before
            del probe
            return [batch[1].tolist() async for batch in loader]

    assert asyncio.run(main()) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterator_takes_its_epoch_when_it_starts(workers):
    """``set_epoch`` between ``iter()`` and the first ``next()`` applies to that iterator,
    as a ``DistributedSampler``'s does in torch (its order is drawn at the first ``next()``)."""
    with aioload.DataLoader(Squares(20), batch_size=4, shuffle=True, seed=1, num_workers=workers) as loader:
        loader.set_epoch(2)
        reference = _labels(loader)
    with aioload.DataLoader(Squares(20), batch_size=4, shuffle=True, seed=1, num_workers=workers) as loader:
        it = iter(loader)
        loader.set_epoch(2)
        assert [batch[1].tolist() for batch in it] == reference
        assert loader.state_dict()["epoch"] == 3


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_loaded_before_the_first_next_applies(workers):
    """``load_state_dict`` between ``iter()`` and the first ``next()``: that iterator resumes."""
    with aioload.DataLoader(Squares(20), batch_size=4, shuffle=True, seed=1, num_workers=workers) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        rest = [batch[1].tolist() for batch in it]
    with aioload.DataLoader(Squares(20), batch_size=4, shuffle=True, seed=1, num_workers=workers) as loader:
        it = iter(loader)
        loader.load_state_dict(state)
        assert [batch[1].tolist() for batch in it] == rest


@pytest.mark.parametrize("workers", [0, 2])
def test_a_probe_leaves_the_running_epoch_alone(workers):
    """A probe made while an epoch runs does not end it; an iterator that starts does."""
    with aioload.DataLoader(Squares(12), batch_size=4, num_workers=workers) as loader:
        it = iter(loader)
        first = next(it)[1].tolist()
        probe = iter(loader)
        assert [first] + [batch[1].tolist() for batch in it] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        assert [batch[1].tolist() for batch in probe] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_an_epoch_read_to_its_last_batch_keeps_the_workers():
    """Lightning takes ``len(loader)`` batches and drops the iterator without asking for the
    ``StopIteration``: that epoch ran to its end, and the next one keeps the workers."""
    from tests.conftest import child_pids

    with aioload.DataLoader(Squares(12), batch_size=4, num_workers=2) as loader:
        it = iter(loader)
        assert [next(it)[1].tolist() for _ in range(len(loader))] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        workers = sorted(child_pids())
        assert len(workers) == 2
        del it
        assert _labels(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        assert sorted(child_pids()) == workers


def test_a_closed_probe_never_starts():
    with aioload.DataLoader(Squares(8), batch_size=4, num_workers=2) as loader:
        before = _running()
        probe = iter(loader)
        assert _running() == before
        probe.close()
        assert list(probe) == []
        assert _running() == before
        assert _labels(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_probe_of_a_closed_loader_raises_when_it_starts():
    loader = aioload.DataLoader(Squares(8), batch_size=4, num_workers=2)
    probe = iter(loader)
    loader.close()
    with pytest.raises(aioload.LoaderClosedError,
                       match="^this DataLoader was closed; create a new one to iterate again$"):
        next(probe)


# ------------------------------------------------------------------- aioload in torch's place

_SWAPPED = """
import os, sys, warnings
import torch, torch.utils.data
import aioload
from tests.datasets import SlowReads, Squares

class Stream(torch.utils.data.IterableDataset):  # reports 2 samples, yields 3
    def __len__(self):
        return 2
    def __iter__(self):
        return iter(range(3))
    def __repr__(self):
        return "Stream()"

if sys.argv[1] == "swapped":  # what a program does to hand aioload to code it does not own
    torch.utils.data.DataLoader = torch.utils.data.dataloader.DataLoader = aioload.DataLoader
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for dataset, workers, kw in [(Squares(8), 0, {}), (SlowReads(8), 0, {}), (Squares(8), 2, {}),
                                 (Squares(8), 2, {"pin_memory": True}), (Squares(8), 0, {"pin_memory": True}),
                                 (Squares(8), os.cpu_count() + 1, {}), (Stream(), 0, {"batch_size": None})]:
        loader = aioload.DataLoader(dataset, num_workers=workers, batch_size=kw.pop("batch_size", 4), **kw)
        other = torch.utils.data.DataLoader(dataset, num_workers=workers, batch_size=loader.batch_size, **kw)
        for each in (loader, other):
            len(each)
            batches = [b[1].tolist() if isinstance(b, (list, tuple)) else int(b) for b in each]
            print(type(each).__module__, workers, batches)
            getattr(each, "close", lambda: None)()
for w in caught:
    print(w.category.__name__, str(w.message))
"""


def test_aioload_can_take_torchs_place(tmp_path):
    """``torch.utils.data.DataLoader = aioload.DataLoader`` (for third-party code that builds
    torch's loader) works: aioload keeps torch's class from import time. The batches and the
    warnings (too many workers, pinning, an IterableDataset longer than its length) are those
    of the same program without the swap, except that code asking torch for a loader gets aioload's."""
    import os
    import subprocess
    import sys

    script = tmp_path / "swapped.py"
    script.write_text(_SWAPPED)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    runs = {}
    for mode in ("plain", "swapped"):
        done = subprocess.run([sys.executable, str(script), mode], cwd=root, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[mode] = done.stdout.splitlines()
    expected = [line.replace("torch.utils.data.dataloader ", "aioload._front.loader ") for line in runs["plain"]]
    assert runs["swapped"] == expected
    warned = " ".join(line for line in expected if line.startswith("UserWarning"))
    assert all(text in warned for text in ("pin_memory", "worker processes", "Length of IterableDataset"))


# ------------------------------------------------------------------- torch.profiler ranges


def _ranges(loader_cls, workers: int, split: bool, run) -> list[str]:
    """The DataLoader ranges (``enumerate(DataLoader)#...``) a profiler records while ``run``
    iterates a 3-batch loader."""
    dataset = SlowReads(12) if split else Squares(12)
    loader = loader_cls(dataset, batch_size=4, num_workers=workers)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            batches = run(loader)
    finally:
        getattr(loader, "close", lambda: None)()
    assert batches == 3
    return [e.name for e in prof.events() if e.name.startswith("enumerate(DataLoader)#")]


def _sync(loader) -> int:
    return sum(1 for _ in loader)


def _async(loader) -> int:
    async def main():
        return sum([1 async for _ in loader])

    return asyncio.run(main())


@pytest.mark.parametrize("case", _PROBED, ids=_ids)
def test_each_batch_is_a_profiler_range(case):
    """As torch's iterators do, each ``next()`` is a ``record_function`` range (the last one,
    which ends the epoch, too), named for aioload and for what the training loop waits on."""
    dataset_cls, workers = case
    split = dataset_cls is SlowReads
    expected = len(_ranges(torch.utils.data.DataLoader, workers, split, _sync))
    assert expected == 4  # 3 batches, then the StopIteration
    name = ("enumerate(DataLoader)#aioload.DataLoader.__next__ (loading a batch in this process)"
            if workers == 0 and not split else
            "enumerate(DataLoader)#aioload.DataLoader.__next__ (waiting for a batch)")
    assert _ranges(aioload.DataLoader, workers, split, _sync) == [name] * expected
    assert _ranges(aioload.DataLoader, workers, split, _async) == [
        "enumerate(DataLoader)#aioload.DataLoader.__anext__ (waiting for a batch)"] * expected


# ------------------------------------------------------------------- ImageFolder subclasses


def _solid_png(value: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (7, 5), (value, value, value)).save(out, format="PNG")
    return out.getvalue()


def _image_folder():
    return aioload.ImageFolder  # imported on first use (torchvision)


class _Solid:
    """A read that returns other bytes than the file's: a solid 7x5 image of ``10 + target``."""

    async def read(self, index):
        _, target = await super().read(index)
        return _solid_png(10 + target), target


class _Gray:
    """A decode of its own over the bytes: the mean of the channels, as float."""

    def decode(self, raw):
        data, target = raw
        return aioload.decode_image(data).float().mean(0, keepdim=True), target


def _subclass(mixin):
    return type(f"{mixin.__name__.strip('_')}Folder", (mixin, _image_folder()), {})


@pytest.mark.parametrize("workers", [0, 2])
def test_an_imagefolder_subclass_reading_its_own_bytes(image_root, workers):
    """An overridden ``read`` is honoured by ``dataset[i]`` and by the loader alike."""
    dataset = _subclass(_Solid)(image_root)
    image, target = dataset[0]
    assert torch.equal(image, torch.full((3, 5, 7), 10 + target, dtype=torch.uint8))
    with aioload.DataLoader(dataset, batch_size=8, num_workers=workers) as loader:
        for images, targets in loader:
            assert torch.equal(images, (10 + targets).to(torch.uint8).view(-1, 1, 1, 1).expand(-1, 3, 5, 7))


@pytest.mark.parametrize("read_in", ["auto", "worker", "loop"])
@pytest.mark.parametrize("workers", [0, 2])
def test_an_imagefolder_subclass_decoding_the_bytes_itself(image_root, workers, read_in):
    """An overridden ``decode`` gets the file's bytes wherever the file is read, so
    ``dataset[i]`` and the loader give the same samples."""
    dataset = _subclass(_Gray)(image_root, read_in=read_in)
    expected = [dataset[i] for i in range(len(dataset))]
    assert expected[0][0].shape[0] == 1 and expected[0][0].dtype == torch.float32
    with aioload.DataLoader(dataset, batch_size=None, num_workers=workers) as loader:
        got = list(loader)
    assert len(got) == len(expected)
    for (image, target), (want, want_target) in zip(got, expected):
        assert target == want_target and torch.equal(image, want)


# ------------------------------------------------------------------- typing


def test_the_class_is_generic_like_torchs():
    """``DataLoader[T]`` works at run time, as torch's does."""
    alias = aioload.DataLoader[tuple[torch.Tensor, int]]
    with alias(Squares(4), batch_size=2) as loader:
        assert type(loader) is aioload.DataLoader
        assert len(list(loader)) == 2
    assert not isinstance(loader, torch.utils.data.DataLoader)  # on purpose: docs/migration.md


_TYPED = """
import torch
from torch import Tensor

import aioload


class Pairs(torch.utils.data.Dataset[tuple[Tensor, int]]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return torch.zeros(2), index


def make() -> aioload.DataLoader[tuple[Tensor, int]]:
    return aioload.DataLoader(Pairs(), batch_size=2)


with make() as loader:
    for images, labels in loader:
        pass
wrong: aioload.DataLoader[str] = aioload.DataLoader(Pairs())
"""


@pytest.mark.timeout(600)
def test_typed_code_checks(tmp_path):
    """Typed code written for torch's generic loader type-checks with aioload's; the sample
    type is inferred from the dataset, so a mismatch is reported (the last line)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "typed.py").write_text(_TYPED)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "--follow-imports", "silent",
         "--ignore-missing-imports", "--python-version", "3.11", "--no-error-summary", "typed.py"],
        cwd=tmp_path, env={**os.environ, "MYPYPATH": root}, capture_output=True, text=True, timeout=580,
    )
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    last = len(_TYPED.strip("\n").splitlines()) + 1  # the file starts with a newline
    assert len(errors) == 1, done.stdout + done.stderr
    assert errors[0].startswith(f'typed.py:{last}: error: Argument 1 to "DataLoader" has incompatible type "Pairs"; '
                                'expected "Dataset[str]"'), errors
