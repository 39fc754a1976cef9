"""One rank of the sharding test; run by tests/test_distributed.py under torchrun (gloo, CPU).

Each rank iterates several loaders for two epochs and writes what it saw to
``<out>/rank<r>.json``: ``{case: {"len": len(loader), "epochs": [[index, ...], ...]}}``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import aioload


class Indices(aioload.Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def read(self, i):
        return i

    def decode(self, raw):
        return raw


def seen(loader) -> dict:
    epochs = []
    for _ in range(2):
        epochs.append([i for batch in loader for i in batch.tolist()])
    return {"len": len(loader), "epochs": epochs}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cases = {
        "even-shuffled": dict(n=38, shuffle=True, seed=5, num_workers=0),
        "padded-shuffled": dict(n=37, shuffle=True, num_workers=1),
        "dropped-sequential": dict(n=37, drop_last=True, num_workers=0),
        "unsharded": dict(n=37, shard=False, num_workers=0),
    }
    result = {}
    for name, kwargs in cases.items():
        n = kwargs.pop("n")
        with aioload.DataLoader(Indices(n), batch_size=4, **kwargs) as loader:
            result[name] = seen(loader)
    ds = Indices(37)
    sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=True, seed=2)
    with aioload.DataLoader(ds, batch_size=4, sampler=sampler) as loader:
        result["distributed-sampler"] = seen(loader)
    with aioload.DataLoader(Indices(38), batch_size=4, shuffle=True, seed=5, num_workers=1) as loader:
        iterator = iter(loader)
        head = [i for _ in range(2) for i in next(iterator).tolist()]
        state = json.loads(json.dumps(loader.state_dict()))
    with aioload.DataLoader(Indices(38), batch_size=4, shuffle=True, seed=5, num_workers=0) as loader:
        loader.load_state_dict(state)
        result["resumed"] = {"head": head, "rest": [i for batch in loader for i in batch.tolist()]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
