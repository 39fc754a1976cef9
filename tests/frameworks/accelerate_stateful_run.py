"""Accelerate with ``DataLoaderConfiguration(use_stateful_dataloader=True)`` over an aioload
loader that streams a Hugging Face dataset; run by tests/test_accelerate.py under
``torchrun --nproc-per-node 2`` (gloo, ``Accelerator(cpu=True)``)::

    torchrun --nproc-per-node 2 tests/frameworks/accelerate_stateful_run.py OUT FILE...

With ``use_stateful_dataloader=True`` Accelerate builds the torch loaders it prepares on
torchdata's ``StatefulDataLoader`` and saves their state in ``save_state`` (``dl_state_dict.bin``)
instead of skipping batches on resume; a training script written for it calls ``load_state``
and no ``skip_first_batches``. The aioload loader goes through
``aioload.integrations.accelerate.prepare`` beside such a torch loader. Each rank streams its
``split_dataset_by_node`` share of the Parquet FILEs (in file order, 2 workers; a shuffle
buffer's own resume is tests/test_resume_hf.py's): 12 batches an epoch and rank. It writes ``OUT/rank<r>.json`` with, per step,
the row ids, ``sync_gradients`` and ``end_of_dataloader`` (``gradient_accumulation_steps=3``)
of 20 steps uninterrupted (``full``), of 7 steps then ``save_state`` (``first``), and of a new
Accelerator and loader after ``load_state``, on to step 20 (``rest``).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration

import aioload
from aioload.integrations.accelerate import prepare
from tests.hf_data import ids, stream

STEPS, STOP = 20, 7


def accelerator(out: str) -> Accelerator:
    return Accelerator(cpu=True, gradient_accumulation_steps=3, project_dir=out,
                       dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))


def loaders(acc: Accelerator, paths: list[str]):
    """The aioload loader over this rank's share, and a torch loader Accelerate prepares (on
    torchdata's StatefulDataLoader) beside it, as a script's evaluation loader would be."""
    dataset = stream(paths, rank=acc.process_index, world=acc.num_processes)
    loader = prepare(acc, aioload.DataLoader(dataset, batch_size=4, num_workers=2))
    side = acc.prepare(torch.utils.data.DataLoader(list(range(16)), batch_size=2))
    return loader, side


def train(acc: Accelerator, loader, steps: int, epoch: int = 0, done: int = 0) -> tuple[list[dict], int]:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    seen = []
    while done < steps:
        loader.set_epoch(epoch)
        loader.dataset.set_epoch(epoch)  # the stream's own epoch (its reshuffle, where it shuffles)
        for batch in loader:
            with acc.accumulate(model):
                acc.backward(model(batch["double"].float().view(-1, 1)).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
            seen.append({"ids": ids(batch), "sync": acc.sync_gradients, "end": acc.gradient_state.end_of_dataloader})
            done += 1
            if done == steps:
                break
        else:
            epoch += 1
    return seen, epoch


def main(out: str, paths: list[str]) -> None:
    result: dict = {}
    acc = accelerator(out)
    result["full"], _ = train(acc, loaders(acc, paths)[0], STEPS)

    acc = accelerator(out)
    result["first"], epoch = train(acc, loaders(acc, paths)[0], STOP)
    acc.save_state(os.path.join(out, "state"))
    acc.wait_for_everyone()  # the main process writes after the others returned

    acc = accelerator(out)
    loader, _ = loaders(acc, paths)
    acc.load_state(os.path.join(out, "state"))
    result["rest"], _ = train(acc, loader, STEPS, epoch=epoch, done=STOP)  # the script's own step and epoch
    result["files"] = sorted(os.listdir(os.path.join(out, "state")))
    with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
        json.dump(result, f)
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
