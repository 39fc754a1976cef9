"""WebDataset shards under ``torchrun``: each rank's epoch, and an exact mid-epoch resume from
any rank's state. Run by tests/test_shards_dist.py::

    torchrun --nproc-per-node 2 tests/frameworks/shards_run.py first PATTERN OUT   # epochs, then K steps and a save
    torchrun --nproc-per-node 2 tests/frameworks/shards_run.py rest PATTERN OUT    # each rank's state resumes all

Both modes run in each job: ``uniform`` (a range per sample, dealt by stride) and ``window``
(whole shards, ``window=2``, dealt in blocks). Every rank writes ``OUT/<phase>.rank<r>.json``:
per mode, the keys of every batch of two epochs (``full``), the batches before the save
(``first``), the loader's shard figures, and in ``rest`` the batches after loading the state
each rank saved (``rest_from_0``, ``rest_from_1``).
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

import aioload

BATCH, K, SEED = 4, 3, 5
MODES = {"uniform": None, "window": 2}


def keys(sample: dict) -> str:
    return sample["__key__"]


def make_loader(pattern: str, window) -> aioload.DataLoader:
    ds = aioload.WebDataset(pattern, decode=keys, window=window)
    return aioload.DataLoader(ds, batch_size=BATCH, shuffle=True, seed=SEED, num_workers=2)


def epochs(loader, count: int) -> list[list[list[str]]]:
    out = []
    for epoch in range(count):
        loader.set_epoch(epoch)
        out.append([list(batch) for batch in loader])
    return out


def first(pattern: str, out: str, rank: int) -> dict:
    result = {}
    for mode, window in MODES.items():
        with make_loader(pattern, window) as loader:
            full = epochs(loader, 2)
            stats = loader.stats()
        with make_loader(pattern, window) as loader:
            loader.set_epoch(1)
            seen = []
            for batch in loader:
                seen.append(list(batch))
                if len(seen) == K:
                    break
            with open(os.path.join(out, f"{mode}.state{rank}.json"), "w") as f:
                json.dump(loader.state_dict(), f)
        result[mode] = {"full": full, "first": seen, "fetches": stats.shard_fetches,
                        "requests_per_sample": stats.requests_per_sample, "len": len(loader)}
    return result


def rest(pattern: str, out: str, rank: int) -> dict:
    result = {}
    for mode, window in MODES.items():
        result[mode] = {}
        for source in (0, 1):  # every rank loads the same rank's state: frameworks save rank 0's
            with open(os.path.join(out, f"{mode}.state{source}.json")) as f:
                state = json.load(f)
            with make_loader(pattern, window) as loader:
                loader.load_state_dict(state)
                result[mode][f"rest_from_{source}"] = [list(batch) for batch in loader]
    return result


def main(phase: str, pattern: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = first(pattern, out, rank) if phase == "first" else rest(pattern, out, rank)
    dist.barrier()
    with open(os.path.join(out, f"{phase}.rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
