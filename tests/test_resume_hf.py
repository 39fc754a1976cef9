"""A Hugging Face streaming ``datasets.IterableDataset`` (local Parquet and JSON-lines files,
``.shuffle(seed, buffer_size)``, ``.map``, ``split_dataset_by_node``) resumes mid-epoch with
the batches an uninterrupted run delivers, with and without workers, once and again from a
resumed run (datasets #8308), and under two torchrun ranks (tests/frameworks/hf_stream_run.py).

Hugging Face's own state (``IterableDataset.state_dict()``, what torchdata's
``StatefulDataLoader`` saves in each worker) loses the rows held in a shuffle buffer: "examples
from shuffle buffers are lost when resuming and the buffers are refilled with new data" (its
docstring), and with workers it fails to load (an IndexError inside ``datasets``). The shuffled
cases here hold aioload to the uninterrupted run all the same, whichever way it gets there
(replaying the stream, a ``FastForwardWarning`` then saying what that cost, is allowed).
"""

from __future__ import annotations

import json

import pytest
import torch

import aioload
from aioload._plan.stateful import FastForwardWarning, drops_buffered_rows, is_stateful
from tests.frameworks.launch import LAUNCH_TIMEOUT, SCRIPTS, run_ranks
from tests.hf_data import Replayed, ids, stream, write_files
from tests.resumption import may_fast_forward, resumed, roundtrip, uninterrupted

pytest.importorskip("datasets")
pytestmark = pytest.mark.timeout(240)

ROWS = 24  # per file; 4 files: 96 rows, 24 batches of 4 (2 workers: 2 files and 12 batches each)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    return {
        "parquet": write_files(root / "parquet", "parquet", files=4, rows=ROWS),
        "json": write_files(root / "json", "json", files=4, rows=ROWS),
        "parquet3": write_files(root / "parquet3", "parquet", files=3, rows=ROWS),
    }


def factory(paths, shuffle: bool, workers: int, **kwargs):
    kwargs.setdefault("batch_size", 4)
    rank = kwargs.pop("rank", None)
    world = kwargs.pop("world", 1)

    def make():
        return aioload.DataLoader(stream(paths, shuffle, rank=rank, world=world), num_workers=workers, **kwargs)

    return make


def set_dataset_epoch(loader, epoch: int) -> None:
    """What a training loop over a shuffled stream does each epoch: a new shuffle of the files
    and the buffer (the dataset shares its epoch with persistent workers)."""
    loader.dataset.set_epoch(epoch)


@pytest.mark.parametrize("kind", ["parquet", "json"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_streaming_dataset_resumes_mid_epoch_with_the_uninterrupted_batches(files, kind, shuffle, workers):
    make = factory(files[kind], shuffle, workers)
    full = uninterrupted(make, ids)
    assert sorted(i for batch in full for i in batch) == sorted(f * 1000 + r for f in range(4) for r in range(ROWS))
    # stopped after 5 batches (rows left in the shuffle buffer), resumed, stopped again after 9
    # more (in another file), resumed to the end
    assert resumed(make, ids, [5, 9], loading=may_fast_forward) == full


def test_the_uninterrupted_run_is_torchs(files):
    # The reference the resumed runs are held to is what torch's DataLoader makes of the stream.
    torch_loader = torch.utils.data.DataLoader(stream(files["parquet"], shuffle=True), batch_size=4, num_workers=2)
    assert uninterrupted(factory(files["parquet"], True, 2), ids) == [ids(b) for b in torch_loader]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shuffled_stream_without_its_own_state_resumes_by_replaying_it(files, workers):
    # The way docs/reproducibility.md gives to resume a shuffle buffer exactly: the stream behind
    # a dataset that has no state of its own, which the loader fast-forwards.
    def make():
        return aioload.DataLoader(Replayed(stream(files["parquet"], shuffle=True)), batch_size=4, num_workers=workers)

    full = uninterrupted(make, ids, epochs=2, on_epoch=set_dataset_epoch)
    expect = lambda: pytest.warns(FastForwardWarning, match="by fast-forwarding")  # noqa: E731
    assert resumed(make, ids, [5, 9 + len(full) // 2], epochs=2, on_epoch=set_dataset_epoch, loading=expect) == full


def test_a_shuffle_buffers_own_state_is_not_taken_as_exact(files):
    # Its state drops the buffered rows: the stream is replayed (its order is its seed and epoch's)
    for rank in (None, 0):
        assert drops_buffered_rows(stream(files["parquet"], shuffle=True, rank=rank, world=2))
        assert not is_stateful(stream(files["parquet"], shuffle=True, rank=rank, world=2))
        assert is_stateful(stream(files["parquet"], shuffle=False, rank=rank, world=2))
    assert not drops_buffered_rows(Replayed(stream(files["parquet"], shuffle=True)))


@pytest.mark.parametrize("workers", [0, 2])
def test_resuming_a_shuffle_buffer_says_why_it_replays(files, workers):
    make = factory(files["parquet"], True, workers)
    full = uninterrupted(make, ids)
    expect = lambda: pytest.warns(FastForwardWarning, match=r"shuffled with a buffer by fast-forwarding: its "  # noqa: E731
                                  r"state_dict\(\) does not hold the rows in its shuffle buffer")
    assert resumed(make, ids, [5], loading=expect) == full


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
def test_a_reshuffled_stream_resumes_in_its_second_epoch(files, persistent):
    make = factory(files["parquet"], True, 2, persistent_workers=persistent)
    full = uninterrupted(make, ids, epochs=2, on_epoch=set_dataset_epoch)
    per_epoch = len(full) // 2
    assert full[:per_epoch] != full[per_epoch:]  # set_epoch reshuffled it
    each_epoch = dict(epochs=2, on_epoch=set_dataset_epoch, loading=may_fast_forward)
    assert resumed(make, ids, [per_epoch + 3, 6], **each_epoch) == full
    assert resumed(make, ids, [4, per_epoch], **each_epoch) == full  # saved in each epoch


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_between_epochs_resumes_the_next_epoch_whole(files, workers):
    # The stream's state after its epoch ran out says "at the end" of epoch 0; the next epoch's
    # copies (the dataset itself in process) get set_epoch(1) from the loader, so it does not apply.
    make = factory(files["parquet"], False, workers)
    full = uninterrupted(make, ids, epochs=2)
    with make() as loader:
        first = [ids(b) for b in loader]
        state = roundtrip(loader.state_dict())
    with make() as loader:
        loader.load_state_dict(state)
        assert first + [ids(b) for b in loader] == full


@pytest.mark.parametrize("workers", [0, 2])
def test_the_epoch_after_a_resumed_one_is_whole(files, workers):
    # Two epochs, no set_epoch of the loop's own (the loop torch's DataLoader users write): the
    # resumed copies loaded the saved position, and the next epoch must not start there again
    # (datasets applies a loaded state to every later __iter__ of the same epoch number; the
    # loader's set_epoch on each epoch's copies moves them on).
    make = factory(files["parquet"], False, workers)
    full = uninterrupted(make, ids, epochs=2)
    assert resumed(make, ids, [5], epochs=2) == full


@pytest.mark.parametrize("batch_size", [None, 3])
def test_row_by_row_and_odd_batches_resume(files, batch_size):
    make = factory(files["json"], True, 2, batch_size=batch_size)
    full = uninterrupted(make, ids)
    assert resumed(make, ids, [11 if batch_size is None else 7], loading=may_fast_forward) == full


@pytest.mark.parametrize("name", ["parquet", "parquet3"], ids=["files-per-rank", "rows-per-rank"])
def test_each_nodes_split_resumes_on_its_own(files, name):
    # split_dataset_by_node: 4 files on 2 ranks give each rank 2 files; 3 files give each rank
    # every other row of all of them.
    seen = []
    for rank in (0, 1):
        make = factory(files[name], True, 2, rank=rank, world=2)
        full = uninterrupted(make, ids)
        assert resumed(make, ids, [3, 4], loading=may_fast_forward) == full
        seen += [i for batch in full for i in batch]
    files_written = 4 if name == "parquet" else 3
    assert sorted(seen) == sorted(f * 1000 + r for f in range(files_written) for r in range(ROWS))


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_two_torchrun_ranks_resume_their_own_streams(files, tmp_path, shuffle):
    run_ranks(SCRIPTS / "hf_stream_run.py", [str(tmp_path), *(["--shuffle"] if shuffle else []), *files["parquet"]],
              world=2)
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for run in runs:
        assert len(run["full"]) == 24  # 2 epochs of 12 batches: 48 rows of its 2 files, 2 workers
        assert run["first"] + run["second"] + run["rest"] == run["full"], run
        assert len(run["first"]) == 7 and len(run["second"]) == 9
    epoch0 = [sorted(i for batch in run["full"][:12] for i in batch) for run in runs]
    assert not set(epoch0[0]) & set(epoch0[1])
    assert sorted(epoch0[0] + epoch0[1]) == sorted(f * 1000 + r for f in range(4) for r in range(ROWS))
