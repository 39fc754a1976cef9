"""PyTorch Lightning's ``Trainer`` over aioload loaders, on the CPU: one process, and
``strategy="ddp"`` with two ranks (gloo on 127.0.0.1) that Lightning launches itself.

The runs are tests/frameworks/lightning_run.py; each rank writes the sample indices of every
training step to a file, and these tests compare them. A checkpoint of the two-rank run also
resumes in one process (elastic resume: the rest of its epoch, dealt over one rank).
"""

from __future__ import annotations

import pytest

from tests.frameworks.launch import LAUNCH_TIMEOUT, SCRIPTS, Ranks, start

pytestmark = [pytest.mark.timeout(LAUNCH_TIMEOUT + 30), pytest.mark.slow]

SAMPLES, BATCH = 40, 4
CASES = [f"sharding/{built}/{uds}" for built in ("init", "hook") for uds in (True, False)]


def fit_runs(out, devices: int, workers: int, *extra: str) -> Ranks:
    job = start([str(SCRIPTS / "lightning_run.py"), str(out), "--devices", str(devices), "--workers", str(workers),
                 *extra])
    ranks = Ranks(job, out, devices)
    ranks.out = out  # type: ignore[attr-defined]
    return ranks


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> Ranks:
    return fit_runs(tmp_path_factory.mktemp("lightning-ddp"), devices=2, workers=1)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Ranks:
    # No worker processes: the loader loads in the training process, as torch's does.
    return fit_runs(tmp_path_factory.mktemp("lightning-one"), devices=1, workers=0)


def flat(steps: list[list[int]]) -> list[int]:
    return [i for batch in steps for i in batch]

@pytest.mark.parametrize("case", CASES)
def test_ddp_ranks_see_disjoint_halves_however_the_loader_was_built(ddp, case):
    a, b = (flat(steps) for steps in ddp.case(case))
    assert len(a) == len(b) == SAMPLES // 2
    assert not set(a) & set(b)
    assert sorted(a + b) == list(range(SAMPLES))


def test_ddp_resume_from_a_checkpoint_gives_the_uninterrupted_batches_on_every_rank(ddp):
    runs = zip(ddp.case("resume/full"), ddp.case("resume/first"), ddp.case("resume/rest"))
    for full, first, rest in runs:
        assert len(full) == 12 and len(first) == 7
        assert first + rest == full  # 5 steps an epoch: the checkpoint was 2 steps into the second
    assert ddp.case("resume/full")[0] != ddp.case("resume/full")[1]


def test_a_ddp_checkpoint_resumes_on_one_process_with_the_rest_of_its_epoch(ddp, tmp_path):
    ckpt = ddp.out / "checkpoints" / "step7.ckpt"
    one = fit_runs(tmp_path, 1, 1, "--elastic-from", str(ckpt))
    one.check_exit()
    (rest,) = one.case("elastic/rest")
    # The checkpoint is 2 steps into epoch 1 on each of 2 ranks: 8 samples each delivered. The
    # epoch's order over both ranks interleaves their shards (rank r holds positions r, r + 2,
    # ...), so what is left is that order from position 16 on, which one process takes in turn.
    epoch1 = [flat(steps[5:10]) for steps in ddp.case("resume/full")]
    left = [i for j in range(8, 20) for i in (epoch1[0][j], epoch1[1][j])]
    assert len(rest) == 5  # steps 8-12
    assert flat(rest) == left[:20]


def test_single_process_epochs_and_resume(single):
    for case in CASES:
        assert sorted(flat(single.case(case)[0])) == list(range(SAMPLES))
    (full,), (first,), (rest,) = (single.case(f"resume/{run}") for run in ("full", "first", "rest"))
    assert len(full) == 12  # 10 steps an epoch: the checkpoint at 7 is mid-epoch
    assert first + rest == full


def test_what_the_trainer_does_with_the_loader(ddp, single):
    # Lightning hands the loader object itself to the loop (it re-instantiates only instances
    # of torch's DataLoader), and seed_everything(workers=True) installs its worker_init_fn.
    for observed in [*ddp.case("observed"), *single.case("observed")]:
        assert observed == {"same_object": True, "type": "DataLoader", "worker_init_fn": "pl_worker_init_function"}


def test_the_runs_exit_cleanly(ddp, single):
    ddp.check_exit()
    single.check_exit()
