"""Elastic resume under real ``torchrun`` ranks: save on one number of ranks, resume on another.
Run by tests/test_elastic.py::

    torchrun --nproc-per-node W tests/frameworks/elastic_run.py OUT [--save K] [--resume STATE --tag T]

``--save K``: an uninterrupted two-epoch run (``OUT/full.W.rank<r>.json``), then a fresh loader
that delivers K batches, changes a mix's weights after the first, and rank 0 writes its state to
``OUT/state.W.json``. ``--resume STATE``: every rank loads that file and runs the rest of its
epoch and the next one (``OUT/resume.T.rank<r>.json``). Each file holds, per dataset kind, the
batches of each epoch as lists of indices: a map-style dataset, a mix, and (when
``AIOLOAD_ELASTIC_SHARDS`` names them) WebDataset shards read in window mode, whose order is
dealt in contiguous blocks.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import aioload

N, BATCH, SEED = 48, 2, 3
LATER = {"a": 1.0, "b": 3.0}


class Indices(aioload.Dataset):
    def __init__(self, n: int, offset: int = 0):
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    async def read(self, index: int) -> int:
        return index

    def decode(self, raw: int) -> int:
        return raw + self.offset


def datasets() -> dict:
    found = {
        "map": Indices(N),
        "mix": aioload.Mix({"a": Indices(40), "b": Indices(30, offset=1000)}, {"a": 1.0, "b": 1.0}),
    }
    shards = os.environ.get("AIOLOAD_ELASTIC_SHARDS")
    if shards:  # tar shards of N samples whose "idx" member is the sample's number
        found["shards"] = aioload.WebDataset(shards, decode=index_of, window=2)
    return found


def index_of(sample: dict) -> int:
    return int(sample["idx"])


def write_shards(root: str) -> str:
    """N samples in shards of 6, written by aioload.ShardWriter; their URL pattern."""
    with aioload.ShardWriter(os.path.join(root, "part-%03d.tar"), maxcount=6) as sink:
        for i in range(N):
            sink.write({"__key__": f"{i:04d}", "idx": i})
    return os.path.join(root, "part-{000..%03d}.tar" % (N // 6 - 1))


def loader_of(dataset) -> aioload.DataLoader:
    return aioload.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=1, seed=SEED)


def epoch(loader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def save(out: str, k: int, world: int) -> None:
    rank = dist.get_rank()
    full, states = {}, {}
    for kind, dataset in datasets().items():
        with loader_of(dataset) as loader:
            got = []
            for e in range(2):
                batches = []
                for step, batch in enumerate(loader):
                    batches.append(batch.tolist())
                    if kind == "mix" and e == 0 and step == 0:
                        loader.set_weights(LATER)
                got.append(batches)
            full[kind] = got
        with loader_of(dataset) as loader:
            for step, _ in enumerate(loader):
                if kind == "mix" and step == 0:
                    loader.set_weights(LATER)
                if step == k - 1:
                    break
            states[kind] = loader.state_dict()
    with open(os.path.join(out, f"full.{world}.rank{rank}.json"), "w") as f:
        json.dump(full, f)
    if rank == 0:
        with open(os.path.join(out, f"state.{world}.json"), "w") as f:
            json.dump(states, f)


def resume(out: str, path: str, tag: str) -> None:
    with open(path) as f:
        states = json.load(f)
    got = {}
    for kind, dataset in datasets().items():
        with loader_of(dataset) as loader:
            loader.load_state_dict(states[kind])
            got[kind] = [epoch(loader), epoch(loader)]
    with open(os.path.join(out, f"resume.{tag}.rank{dist.get_rank()}.json"), "w") as f:
        json.dump(got, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--save", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--tag")
    args = parser.parse_args()
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    try:
        if args.resume:
            resume(args.out, args.resume, args.tag)
        if args.save:
            save(args.out, args.save, dist.get_world_size())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
