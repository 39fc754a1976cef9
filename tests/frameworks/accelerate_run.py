"""Hugging Face Accelerate over aioload loaders; run by tests/test_accelerate.py under
``torchrun --nproc-per-node 2`` (gloo on the CPU: ``Accelerator(cpu=True)``, without which
Accelerate on a machine without GPUs runs every rank as a one-process job).

Each rank writes ``OUT/rank<r>.json`` with, per case, what its training loop saw:

* ``before``, ``after``: one epoch's indices, the loader built before ``Accelerator()`` (no
  process group yet) or after it;
* ``accumulate``: two epochs of 5 batches with ``gradient_accumulation_steps=3`` under
  ``accelerator.accumulate(model)``: ``sync_gradients`` and ``end_of_dataloader`` per step;
  ``accumulate/iterable``: the same over an ``IterableDataset`` of 5 batches (no ``len()``);
* ``gather``: ``gather_for_metrics`` of every batch of an epoch of 37 samples (the shards are
  padded to 19 samples each with one repeat);
* ``skip``: ``skip_first_batches(loader, 2)`` of an epoch, then the next epoch whole;
* ``resume/full``: 12 steps (5 an epoch); ``resume/first``: 7 steps, then
  ``accelerator.save_state()``; ``resume/rest``: a new Accelerator and loader,
  ``load_state()``, on to step 12;
* ``elastic`` (``--elastic-from STATE``, another number of processes): the two-rank state
  loaded and the rest of its epoch trained, with ``sync_gradients`` and ``end_of_dataloader``;
* ``prepare_returns_it``: whether ``accelerator.prepare`` handed a bare aioload loader back;
  ``accumulate/bare``: the ``accumulate`` loop over such a bare loader, for comparison.

The loop in :func:`train` is the recipe in docs/integrations.md.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator

import aioload
from aioload.integrations.accelerate import prepare, skip_first_batches


class Indices(aioload.Dataset):
    """Sample ``i`` is ``i``; ``read`` runs on the loader's event loop, ``decode`` in a worker."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def read(self, index: int) -> int:
        return index

    def decode(self, raw: int) -> int:
        return raw


class Stream(torch.utils.data.IterableDataset):
    """20 samples on every rank, and no ``len()``: the end of an epoch is found by reading ahead."""

    def __iter__(self):
        return iter(range(20))


def make_loader(n: int = 40, workers: int = 1) -> aioload.DataLoader:
    return aioload.DataLoader(Indices(n), batch_size=4, shuffle=True, seed=0, num_workers=workers)


def model_and_optimizer(accelerator: Accelerator):
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return accelerator.prepare(model, optimizer)


def train(accelerator: Accelerator, loader, steps: int, first_epoch: int = 0, done: int = 0) -> list[dict]:
    """The recipe: the prepared loader's batches under ``accumulate``, until ``steps`` steps."""
    model, optimizer = model_and_optimizer(accelerator)
    seen = []
    epoch = first_epoch
    while done < steps:
        loader.set_epoch(epoch)
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(batch.float().view(-1, 1)).pow(2).mean()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            seen.append({"indices": batch.tolist(), "sync": accelerator.sync_gradients,
                         "end": accelerator.gradient_state.end_of_dataloader})
            done += 1
            if done == steps:
                break
        else:
            epoch += 1
    return seen


def elastic(out: str, state: str) -> None:
    """``elastic/rest``: the two-rank run's ``save_state`` at step 7 (2 batches into epoch 1),
    loaded by a job of another size, which trains the rest of that epoch."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    loader = prepare(accelerator, make_loader())
    accelerator.load_state(state)
    model, optimizer = model_and_optimizer(accelerator)
    loader.set_epoch(1)  # the saved epoch (a training script keeps it in its checkpoint)
    rest = []
    for batch in loader:  # the rest of epoch 1, as it resumes on this world
        with accelerator.accumulate(model):
            accelerator.backward(model(batch.float().view(-1, 1)).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        rest.append({"indices": batch.tolist(), "sync": accelerator.sync_gradients,
                     "end": accelerator.gradient_state.end_of_dataloader})
    with open(os.path.join(out, f"elastic.rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"rest": rest, "len": len(loader)}, f)
    accelerator.end_training()


def main(out: str) -> None:
    result: dict = {}
    rank = int(os.environ["RANK"])

    def write() -> None:  # after every case: a failing case leaves the others to read
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)

    early = make_loader()  # no process group yet: torchrun's environment only
    accelerator = Accelerator(cpu=True)
    result["prepare_returns_it"] = accelerator.prepare(early) is early
    for name, loader in (("before", early), ("after", make_loader())):
        result[name] = [s["indices"] for s in train(accelerator, prepare(accelerator, loader), steps=len(loader))]

    write()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    result["accumulate"] = train(accelerator, prepare(accelerator, make_loader()), steps=10)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    stream = aioload.DataLoader(Stream(), batch_size=4, num_workers=1)
    result["accumulate/iterable"] = train(accelerator, prepare(accelerator, stream), steps=10)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    result["accumulate/bare"] = train(accelerator, make_loader(), steps=5)  # without prepare()

    accelerator = Accelerator(cpu=True)
    loader = prepare(accelerator, make_loader(n=37))
    gathered = []
    for batch in loader:
        gathered += accelerator.gather_for_metrics(batch).tolist()
    result["gather"] = gathered
    write()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    loader = prepare(accelerator, make_loader())
    skipped = train(accelerator, skip_first_batches(loader, 2), steps=3)
    result["skip"] = {"skipped": skipped, "next": train(accelerator, loader, steps=5, first_epoch=1)}
    write()

    accelerator = Accelerator(cpu=True)
    result["resume/full"] = train(accelerator, prepare(accelerator, make_loader()), steps=12)
    accelerator = Accelerator(cpu=True, project_dir=out)
    result["resume/first"] = train(accelerator, prepare(accelerator, make_loader()), steps=7)
    accelerator.save_state(os.path.join(out, "state"))
    # The main process writes the loader's state after the others return from save_state;
    # a resumed job is a new process, here the same one loads it at once.
    accelerator.wait_for_everyone()
    accelerator = Accelerator(cpu=True, project_dir=out)
    loader = prepare(accelerator, make_loader())
    accelerator.load_state(os.path.join(out, "state"))
    done = 7  # the training script's own step count (saved with its checkpoint)
    result["resume/rest"] = train(accelerator, loader, steps=12, first_epoch=done // len(loader), done=done)

    write()
    accelerator.end_training()


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[2] == "--elastic-from":
        elastic(sys.argv[1], sys.argv[3])
    else:
        main(sys.argv[1])
