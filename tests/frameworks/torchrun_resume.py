"""Plain ``torchrun`` resume: rank 0 saves its ``loader.state_dict()`` with ``torch.save``, every
rank loads that one file. Run twice by tests/test_torchrun_resume.py::

    torchrun --nproc-per-node 2 tests/frameworks/torchrun_resume.py first OUT  # full run, then 7 steps and a save
    torchrun --nproc-per-node 2 tests/frameworks/torchrun_resume.py rest OUT   # load, on to step 12

Each rank writes ``OUT/<phase>.rank<r>.json``: the indices of every step. 40 samples, batches
of 4: 5 steps an epoch and rank, so step 7 is in the middle of the second epoch.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import aioload

STEPS, STOP = 12, 7


class Indices(aioload.Dataset):
    def __len__(self) -> int:
        return 40

    async def read(self, index: int) -> int:
        return index

    def decode(self, raw: int) -> int:
        return raw


def make_loader() -> aioload.DataLoader:
    # No seed=: the order comes from torch's global RNG, seeded alike on every rank.
    return aioload.DataLoader(Indices(), batch_size=4, shuffle=True, num_workers=2)


def train(loader: aioload.DataLoader, steps: int, epoch: int = 0, step: int = 0) -> list[list[int]]:
    """The recipe's loop: ``set_epoch`` every epoch (it keeps a loaded mid-epoch state)."""
    seen = []
    while step < steps:
        loader.set_epoch(epoch)
        for batch in loader:
            seen.append(batch.tolist())
            step += 1
            if step == steps:
                break
        else:
            epoch += 1
    return seen


def main(phase: str, out: str) -> None:
    torch.manual_seed(0)
    loader = make_loader()  # before the process group: aioload shards when an epoch starts
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    path = os.path.join(out, "checkpoint.pt")
    result = {}
    if phase == "first":
        with loader:
            result["full"] = train(loader, STEPS)
        torch.manual_seed(0)
        with make_loader() as loader:
            result["first"] = train(loader, STOP)
            state = loader.state_dict()
        if rank == 0:  # one checkpoint, written by rank 0
            torch.save({"loader": state, "step": STOP}, path)
    else:
        with loader:
            ckpt = torch.load(path, weights_only=True)
            loader.load_state_dict(ckpt["loader"])
            step = ckpt["step"]
            result["rest"] = train(loader, STEPS, epoch=step // len(loader), step=step)
    with open(os.path.join(out, f"{phase}.rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
