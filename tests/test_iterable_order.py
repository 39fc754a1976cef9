"""An IterableDataset's batches come in torch's order: round-robin over the workers that still
have data, each worker's items in its own order, whatever the timing of the workers' starts."""

from __future__ import annotations

import pytest
import torch

import aioload
from tests.stateful_data import Uneven, identity

SIZES = [0, 100, 37]  # one worker has nothing: its first reply ends it while the others start
RUNS = 16  # each with fresh workers: the order broke in about one first epoch in four


def torch_order(batch_size):
    loader = torch.utils.data.DataLoader(Uneven(SIZES), num_workers=3, batch_size=batch_size, collate_fn=identity)
    return list(loader)


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("batch_size", [None, 4])
def test_an_empty_worker_does_not_reorder_the_others_items(batch_size):
    expected = torch_order(batch_size)
    wrong = []
    for run in range(RUNS):
        with aioload.DataLoader(Uneven(SIZES), num_workers=3, batch_size=batch_size, collate_fn=identity) as loader:
            if list(loader) != expected:
                wrong.append(run)
    assert wrong == []
