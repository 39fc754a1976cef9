"""Hugging Face Accelerate over aioload loaders under ``torchrun --nproc-per-node 2`` (gloo on
127.0.0.1), through ``aioload.integrations.accelerate``.

The runs are tests/frameworks/accelerate_run.py; each rank writes what its training loop saw
(indices, ``sync_gradients``, ``end_of_dataloader``, gathered values) to a file.
"""

from __future__ import annotations

import pytest

from tests.frameworks.launch import LAUNCH_TIMEOUT, Ranks, start, torchrun_args

pytestmark = [pytest.mark.timeout(LAUNCH_TIMEOUT + 30), pytest.mark.slow]

SAMPLES = 40


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Ranks:
    out = tmp_path_factory.mktemp("accelerate")
    found = Ranks(start(torchrun_args("accelerate_run.py", [str(out)])), out, world=2)
    found.out = out  # type: ignore[attr-defined]
    return found


def flat(steps: list) -> list[int]:
    return [i for step in steps for i in (step["indices"] if isinstance(step, dict) else step)]


@pytest.mark.parametrize("built", ["before", "after"])
def test_ranks_see_disjoint_halves_whether_built_before_or_after_the_accelerator(ranks, built):
    a, b = (flat(steps) for steps in ranks.case(built))
    assert len(a) == len(b) == SAMPLES // 2
    assert sorted(a + b) == list(range(SAMPLES))


def test_accumulation_steps_the_optimiser_at_the_end_of_every_epoch(ranks):
    # 5 batches an epoch and rank, 3 accumulation steps: the 5th batch syncs too.
    epoch = [False, False, True, False, True]
    cases = ("accumulate", "accumulate/iterable", "accumulate/bare", "prepare_returns_it")
    for steps, stream, bare, returned in zip(*(ranks.case(name) for name in cases)):
        assert [s["sync"] for s in steps] == epoch * 2
        assert [s["end"] for s in steps] == [False, False, False, False, True] * 2
        # no len(): found by reading one batch ahead
        assert [s["sync"] for s in stream] == epoch * 2
        assert [s["end"] for s in stream] == [False, False, False, False, True] * 2
        assert flat(stream) == list(range(20)) * 2
        # A loader given to nothing but accelerator.prepare() (which hands it back unchanged)
        # leaves Accelerate blind to the epoch's end: the last two batches never step.
        assert [s["sync"] for s in bare] == [False, False, True, False, False]
        assert returned is True


def test_gather_for_metrics_drops_the_repeated_sample_of_the_padded_shards(ranks):
    # 37 samples: 19 per rank, one of rank 1's repeats a sample of rank 0's.
    gathered = ranks.case("gather")
    for values in gathered:
        assert sorted(values) == list(range(37))
    assert gathered[0] == gathered[1]


def test_skip_first_batches_skips_within_the_epoch_and_keeps_the_epoch_end(ranks):
    for whole, skip in zip(ranks.case("accumulate"), ranks.case("skip")):
        whole_epoch = whole[:5]  # the same loader's epoch 0, not skipped
        skipped, following = skip["skipped"], skip["next"]
        assert [s["indices"] for s in skipped] == [s["indices"] for s in whole_epoch[2:]]
        assert [s["end"] for s in skipped] == [False, False, True]
        assert skipped[-1]["sync"] is True
        assert [s["indices"] for s in following] == [s["indices"] for s in whole[5:]]


def test_save_state_and_load_state_resume_every_rank_exactly(ranks):
    runs = [ranks.case(f"resume/{run}") for run in ("full", "first", "rest")]
    for full, first, rest in zip(*runs):
        assert len(full) == 12 and len(first) == 7  # stopped 2 batches into the second epoch
        assert [s["indices"] for s in first + rest] == [s["indices"] for s in full]
        assert [s["end"] for s in rest] == [False, False, True, False, False]
    assert flat(runs[0][0]) != flat(runs[0][1])


@pytest.mark.parametrize("world", [1, 3])
def test_a_two_rank_state_resumes_on_another_number_of_processes(ranks, world, tmp_path):
    state = ranks.out / "state"  # saved by the two-rank run at step 7: 2 batches into epoch 1
    job = start(torchrun_args("accelerate_run.py", [str(tmp_path), "--elastic-from", str(state)], nproc=world))
    assert job.returncode == 0, job.output
    import json

    runs = [json.loads((tmp_path / f"elastic.rank{r}.json").read_text()) for r in range(world)]
    # The rest of epoch 1: the two-rank epoch's batches after the first two of each rank
    # (24 of 40 samples), dealt over the new ranks; end_of_dataloader with each rank's last.
    full = [steps[5:10] for steps in ranks.case("resume/full")]
    rest = sorted(i for steps in full for step in steps[2:] for i in step["indices"])
    got = [flat(run["rest"]) for run in runs]
    share = -(-24 // world)
    assert all(len(g) == share for g in got)
    assert sorted(set(i for g in got for i in g)) == sorted(set(rest)) and sum(map(len, got)) == world * share
    for run in runs:
        ends = [s["end"] for s in run["rest"]]
        assert ends == [False] * (len(ends) - 1) + [True], ends
        # Accelerate counts accumulation steps on from its own saved step; the epoch's last
        # batch steps the optimiser whatever that count is, as it does with torch's loaders.
        assert run["rest"][-1]["sync"] is True


def test_the_run_exits_cleanly(ranks):
    ranks.check_exit()


def gathered_last_batch(length: int, world: int, batch: int, drop_last: bool):
    """The samples of an epoch split by torch's DistributedSampler (padded, not dropped) and
    batched with ``drop_last``: those before the last batch gathered over the ranks, and that
    batch (rank 0's part first, as ``gather`` puts it)."""
    from torch.utils.data import BatchSampler, DistributedSampler

    ranks = [list(BatchSampler(list(DistributedSampler(range(length), world, r, shuffle=False)), batch, drop_last))
             for r in range(world)]
    if not all(ranks):
        return None, None  # drop_last left a rank without a batch
    before = [i for r in ranks for b in r[:-1] for i in b]
    return before, [i for r in ranks for i in r[-1]]


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_remainder_cuts_exactly_the_repeats_where_a_cut_can(world):
    from torch.utils.data import DistributedSampler

    from aioload.integrations.accelerate import padded_remainder

    for length in range(world, 4 * world + 9):
        for batch in (1, 2, 3, 4):
            for drop_last in (False, True):
                sampler = DistributedSampler(range(length), world, 0, shuffle=False)
                remainder = padded_remainder(length, world, batch, drop_last, sampler.num_samples, sampler.total_size)
                before, last = gathered_last_batch(length, world, batch, drop_last)
                if last is None:
                    continue
                cuts = [n for n in range(len(last) + 1) if len(set(before + last[:n])) == len(before) + n
                        and set(before + last[:n]) == set(before + last)]
                case = (length, batch, drop_last, remainder, last)
                if remainder == -1:
                    assert not cuts, case  # -1 only where no cut can drop the repeats
                elif remainder == 0:
                    assert len(last) in cuts, case  # nothing to drop: keep the whole batch
                else:
                    assert remainder in cuts, case


def test_remainder_without_a_distributed_split_is_unknown():
    from aioload.integrations.accelerate import padded_remainder

    assert padded_remainder(37, 2, 4, False, 37, None) == -1  # a RandomSampler's num_samples
    assert padded_remainder(37, 1, 4, False, None, None) == 0


def test_accelerators_skip_first_batches_refuses_a_prepared_loader_instead_of_rebuilding_it():
    from accelerate.data_loader import skip_first_batches as accelerate_skip

    import aioload
    from aioload.integrations.accelerate import PreparedLoader, skip_first_batches

    with aioload.DataLoader(range(10), batch_size=2) as loader:
        prepared = PreparedLoader(loader)
        with pytest.raises(AttributeError, match=r"^a prepared aioload loader has no batch_sampler: to skip "
                                                 r"batches use aioload\.integrations\.accelerate\.skip_first_batches"):
            accelerate_skip(prepared, 2)
        assert getattr(prepared, "batch_sampler", None) is None
        assert [b.tolist() for b in skip_first_batches(prepared, 3)] == [[6, 7], [8, 9]]
        assert len(skip_first_batches(prepared, 3)) == 2
        with pytest.raises(ValueError, match=r"^num_batches must be an int >= 0, got -1$"):
            skip_first_batches(prepared, -1)


def test_a_prepared_loader_refuses_a_bare_loaders_state():
    import aioload
    from aioload.integrations.accelerate import PreparedLoader

    with aioload.DataLoader(range(10), batch_size=2) as loader:
        prepared = PreparedLoader(loader)
        with pytest.raises(ValueError, match=r"^not the state of a prepared loader: pass what "
                                             r"PreparedLoader\.state_dict\(\) returned"):
            prepared.load_state_dict(loader.state_dict())
        prepared.load_state_dict(prepared.state_dict())  # its own state loads


class _Key:
    """A sampler's key that a state cannot write out: the loader's state stands for its epoch's start."""

    def __init__(self, i: int):
        self.i = i


class _KeyedSampler:
    def __len__(self) -> int:
        return 12

    def __iter__(self):
        return iter([_Key(i) for i in range(12)])


class _Keyed:
    def __len__(self) -> int:
        return 12

    def __getitem__(self, key):
        return key.i


def test_after_an_inexact_resume_the_prepared_loader_counts_the_epoch_from_its_start():
    import aioload
    from aioload._plan.resume import ResumeWarning
    from aioload.integrations.accelerate import PreparedLoader

    def make():
        return PreparedLoader(aioload.DataLoader(_Keyed(), batch_size=2, sampler=_KeyedSampler()))

    prepared = make()
    for _, batch in zip(range(3), prepared):
        pass
    state = prepared.state_dict()
    prepared.loader.close()
    assert state["delivered"] == 3 and state["loader"]["progress"]["inexact"] is not None
    resumed = make()
    with pytest.warns(ResumeWarning, match="resumes epoch 0 from its start"):
        resumed.load_state_dict(state)
    ends = []
    for batch in resumed:
        ends.append(resumed.end_of_dataloader)
    resumed.loader.close()
    assert len(ends) == 6  # the whole epoch again, as the warning said
    assert ends == [False] * 5 + [True]  # its end where it is, not 3 batches early


def test_a_prepared_loaders_delivered_count_is_checked_at_load():
    import aioload
    from aioload._plan.resume import ResumeError
    from aioload.integrations.accelerate import PreparedLoader

    with aioload.DataLoader(range(12), batch_size=2) as loader:
        prepared = PreparedLoader(loader)
        for _, batch in zip(range(2), prepared):
            pass
        state = prepared.state_dict()
        assert state["delivered"] == 2
        for bad in ("x", True, -1, 100):
            with pytest.raises(ResumeError, match=r"^cannot load this state: delivered must be an int in \[0, 6\] "
                                                  r"\(an epoch has 6 batches\), the batches of the epoch in progress "
                                                  rf"the training loop received, got {bad!r}"):
                PreparedLoader(loader).load_state_dict(dict(state, delivered=bad))
        with pytest.raises(ResumeError, match=r"^cannot load this state: delivered is 5, but its loader state resumes "
                                              r"the epoch after 2 batches"):
            PreparedLoader(loader).load_state_dict(dict(state, delivered=5))
        again = PreparedLoader(loader)
        again.load_state_dict(state)
        ends = [again.end_of_dataloader for _ in again]
    assert ends == [False, False, False, True]  # batches 3-6 of 6


def test_use_stateful_dataloader_resumes_a_streaming_dataset_on_every_rank(tmp_path):
    # tests/frameworks/accelerate_stateful_run.py: a Hugging Face stream split by node, 12 batches
    # an epoch and rank; save_state after step 7, load_state in a new Accelerator.
    pytest.importorskip("datasets")
    from tests.hf_data import write_files

    paths = write_files(tmp_path / "data", "parquet", files=4, rows=24)
    out = tmp_path / "out"
    out.mkdir()
    job = start(torchrun_args("accelerate_stateful_run.py", [str(out), *paths]))
    assert job.returncode == 0, job.output
    runs = Ranks(job, out, world=2)
    full, first, rest = (runs.case(name) for name in ("full", "first", "rest"))
    for whole, head, tail in zip(full, first, rest):
        assert len(whole) == 20 and len(head) == 7 and len(tail) == 13
        assert [s["ids"] for s in head + tail] == [s["ids"] for s in whole]
        # the epoch's end is found by reading one batch ahead, in the resumed epoch too
        assert [s["end"] for s in tail] == [s["end"] for s in whole[7:]]
        assert [i for i, s in enumerate(whole) if s["end"]] == [11]
        assert [s["sync"] for s in head + tail] == [s["sync"] for s in whole]
    epoch0 = [sorted(i for s in whole[:12] for i in s["ids"]) for whole in full]
    assert not set(epoch0[0]) & set(epoch0[1])
    assert sorted(epoch0[0] + epoch0[1]) == sorted(f * 1000 + r for f in range(4) for r in range(24))
    # Accelerate's own stateful path ran beside the aioload loader's: it saved the torch loader it
    # prepared, and the aioload loader as a registered object.
    assert {"dl_state_dict.bin", "custom_checkpoint_0.pkl"} <= set(runs.case("files")[0])


def test_a_streams_state_names_every_ranks_position_and_refuses_another_world():
    import aioload
    from aioload._plan.resume import ResumeError
    from aioload.integrations.accelerate import PreparedLoader
    from tests.iterable_data import Plain

    with aioload.DataLoader(Plain([10]), batch_size=2) as loader:
        prepared = PreparedLoader(loader)
        state = prepared.state_dict()
        assert set(state) == {"loader", "delivered"}  # one process: nothing to gather
        two = dict(state, ranks=[state, state])
        with pytest.raises(ResumeError, match=r"^this state holds the positions of 2 ranks' streams, but this job "
                                              r"runs 1 process: an IterableDataset's position is each rank's own"):
            PreparedLoader(loader).load_state_dict(two)
        with pytest.raises(ResumeError, match=r"^cannot load this state: ranks must be a list of every rank's"):
            PreparedLoader(loader).load_state_dict(dict(state, ranks=[{"loader": 1}]))
        PreparedLoader(loader).load_state_dict(dict(state, ranks=[state]))


def test_a_checkpoint_while_the_loop_holds_a_batch_read_ahead_resumes_after_that_batch():
    # Without len() the prepared loader reads one batch ahead to find the epoch's end; a state
    # saved meanwhile is the loader's as of the batch the training loop has.
    import aioload
    from aioload.integrations.accelerate import PreparedLoader
    from tests.iterable_data import Counted

    def make():
        return PreparedLoader(aioload.DataLoader(Counted([10]), batch_size=2, num_workers=1))

    prepared = make()
    seen = []
    for batch in prepared:
        seen.append(batch.tolist())
        if len(seen) == 2:
            state = prepared.state_dict()
            break
    prepared.loader.close()
    assert state["delivered"] == 2
    resumed = make()
    resumed.load_state_dict(state)
    rest, ends = [], []
    for batch in resumed:
        rest.append(batch.tolist())
        ends.append(resumed.end_of_dataloader)
    resumed.loader.close()
    assert seen + rest == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert ends == [False, False, True]
