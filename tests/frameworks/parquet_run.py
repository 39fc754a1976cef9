"""``aioload.Parquet`` and ``aioload.PackedTokens`` over Parquet files under ``torchrun``: each
rank's epoch, and an exact mid-epoch resume from rank 0's state on the same and on another
number of ranks. Run by tests/test_parquet_dist.py::

    torchrun --nproc-per-node 2 tests/frameworks/parquet_run.py first DATA OUT  # the epoch, then K batches and a save
    torchrun --nproc-per-node 2 tests/frameworks/parquet_run.py rest DATA OUT   # rank 0's state resumes every rank
    torchrun --nproc-per-node 3 tests/frameworks/parquet_run.py rest DATA OUT   # ... on another world size

``DATA`` holds ``ids-*.parquet`` (an ``id`` column: a row is read as its id) and
``docs-*.parquet`` (an ``input_ids`` column of token ids, packed into rows of ``SEQ + 1``
tokens: a row is read as its ``input_ids``). Three kinds run in each job: ``uniform``
(Parquet, a row at a time dealt by stride), ``window`` (Parquet, ``window=2``, dealt in
blocks) and ``tokens`` (PackedTokens over Parquet). Every rank writes ``OUT/first.rank<r>.json``
(per kind: the batches of epoch 1, ``full``, and those delivered before the save, ``first``)
or ``OUT/rest<world>.rank<r>.json`` (per kind: the batches after loading rank 0's state);
rank 0 writes ``OUT/<kind>.state.json``.
"""

from __future__ import annotations

import glob
import json
import os
import sys

import torch.distributed as dist

import aioload

BATCH, K, SEED, SEQ, EPOCH = 4, 2, 5, 16, 1
KINDS = ("uniform", "window", "tokens")


def row_id(row: dict) -> int:
    return row["id"]


def dataset(kind: str, data: str):
    if kind == "tokens":
        docs = aioload.Parquet(sorted(glob.glob(os.path.join(data, "docs-*.parquet"))), columns=["input_ids"])
        return aioload.PackedTokens(docs, SEQ, column="input_ids")
    return aioload.Parquet(sorted(glob.glob(os.path.join(data, "ids-*.parquet"))), columns=["id"],
                           decode=row_id, window=2 if kind == "window" else None)


def make_loader(kind: str, data: str) -> aioload.DataLoader:
    return aioload.DataLoader(dataset(kind, data), batch_size=BATCH, shuffle=True, seed=SEED, num_workers=2)


def rows(batch) -> list:
    """A batch as JSON: the ids of its rows, or each row's token ids."""
    return batch["input_ids"].tolist() if isinstance(batch, dict) else batch.tolist()


def first(data: str, out: str, rank: int) -> dict:
    result = {}
    for kind in KINDS:
        with make_loader(kind, data) as loader:
            loader.set_epoch(EPOCH)
            full = [rows(batch) for batch in loader]
        with make_loader(kind, data) as loader:
            loader.set_epoch(EPOCH)
            seen = []
            for batch in loader:
                seen.append(rows(batch))
                if len(seen) == K:
                    break
            state = loader.state_dict()
        if rank == 0:  # frameworks save rank 0's state, and every rank loads it
            with open(os.path.join(out, f"{kind}.state.json"), "w") as f:
                json.dump(state, f)
        result[kind] = {"full": full, "first": seen}
    return result


def rest(data: str, out: str) -> dict:
    result = {}
    for kind in KINDS:
        with open(os.path.join(out, f"{kind}.state.json")) as f:
            state = json.load(f)
        with make_loader(kind, data) as loader:
            loader.load_state_dict(state)
            result[kind] = [rows(batch) for batch in loader]
    return result


def main(phase: str, data: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if phase == "first":
        result, name = first(data, out, rank), "first"
    else:
        result, name = rest(data, out), f"rest{world}"
    dist.barrier()
    with open(os.path.join(out, f"{name}.rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
