"""Hugging Face ``transformers.Trainer`` over an aioload loader (the recipe in
docs/integrations.md): ``get_train_dataloader`` returns the loader, a callback saves its state
into each checkpoint, and ``train(resume_from_checkpoint=...)`` goes on exactly where it stopped.

The run is tests/frameworks/hf_trainer_run.py, in a process of its own.
"""

from __future__ import annotations

import json

import pytest

from tests.frameworks.launch import LAUNCH_TIMEOUT, SCRIPTS, run

pytestmark = [pytest.mark.timeout(LAUNCH_TIMEOUT + 30), pytest.mark.slow]


def test_trainer_resumes_the_loader_from_its_checkpoint(tmp_path):
    run([str(SCRIPTS / "hf_trainer_run.py"), str(tmp_path)])
    result = json.loads((tmp_path / "result.json").read_text())
    full, first, rest = (result[run]["seen"] for run in ("full", "first", "rest"))
    assert len(full) == 12 and len(first) == 7  # 10 steps an epoch: stopped mid-epoch
    assert sorted(i for batch in full[:10] for i in batch) == list(range(40))
    assert full[10:] != full[:2]  # the second epoch is reshuffled
    assert first + rest == full
    # Every batch came from the aioload loader: the Trainer's own skipping (without
    # ignore_data_skip) would have loaded the rest of the resumed epoch with a torch DataLoader.
    assert [result[run]["delivered"] for run in ("full", "first", "rest")] == [12, 7, 5]
    assert (tmp_path / "first" / "checkpoint-7" / "aioload_loader.pt").is_file()


@pytest.fixture(scope="module")
def streamed(tmp_path_factory) -> dict:
    """tests/frameworks/hf_trainer_run.py --stream: a Hugging Face stream of 2 Parquet files
    (40 rows, 2 workers: 10 batches an epoch, no len()), 14 steps, a checkpoint at step 7."""
    pytest.importorskip("datasets")
    from tests.hf_data import write_files

    out = tmp_path_factory.mktemp("trainer-stream")
    paths = write_files(out / "data", "parquet", files=2, rows=20)
    run([str(SCRIPTS / "hf_trainer_run.py"), str(out), "--stream", *paths])
    return json.loads((out / "result.json").read_text())


def test_trainer_resumes_a_streaming_dataset_mid_epoch_from_its_checkpoint(streamed):
    full, first, rest = (streamed[run]["seen"] for run in ("full", "first", "rest"))
    assert len(full) == 14 and len(first) == 7 and len(rest) == 7
    assert sorted(i for batch in full[:10] for i in batch) == sorted(f * 1000 + r for f in range(2) for r in range(20))
    assert first + rest[:3] == full[:10]  # the rest of the interrupted epoch
    assert [streamed[run]["delivered"] for run in ("full", "first", "rest")] == [14, 7, 7]


def test_trainer_runs_the_epoch_after_a_resumed_streaming_one_whole(streamed):
    # The Trainer calls loader.set_epoch(1) and iterates again: the stream's copies must start
    # epoch 1 from its beginning, not from the position loaded for epoch 0.
    full, rest = streamed["full"]["seen"], streamed["rest"]["seen"]
    assert rest[3:] == full[10:]
