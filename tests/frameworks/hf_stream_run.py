"""A Hugging Face streaming dataset resumed under two torchrun ranks; run by
tests/test_resume_hf.py through ``run_ranks`` (torchrun's environment, gloo)::

    python tests/frameworks/hf_stream_run.py OUT [--shuffle] FILE...   # as each rank

Each rank streams its ``split_dataset_by_node`` share of the Parquet FILEs (with ``--shuffle``
shuffled with a buffer and reshuffled each epoch) through an aioload loader with 2 workers, and writes
``OUT/rank<r>.json``: the row ids of every batch of two epochs uninterrupted (``full``); of a
run stopped after 7 batches (``first``), whose every rank's state is gathered into one
checkpoint that rank 0 writes; of a new loader that loads its own rank's state from it and
stops again after 9 more batches, in the second epoch (``second``, checkpointed the same
way); and of a third loader resumed from that to the end (``rest``).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import aioload
from tests.hf_data import ids, stream
from tests.resumption import piece

EPOCHS = 2


def checkpoint(state: dict, path: str) -> dict:
    """Every rank's state in one file (an iterable's position is each rank's own), written by
    rank 0; returns this rank's state as a resumed job reads it back."""
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    if dist.get_rank() == 0:
        torch.save({"loaders": states}, path)
    dist.barrier()
    return torch.load(path, weights_only=True)["loaders"][dist.get_rank()]


def main(out: str, paths: list[str], shuffle: bool) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def make():
        return aioload.DataLoader(stream(paths, shuffle=shuffle, rank=rank, world=world), batch_size=4, num_workers=2)

    def on_epoch(loader, epoch):
        loader.dataset.set_epoch(epoch)

    result = {"full": piece(make, ids, EPOCHS, on_epoch=on_epoch)[0]}
    result["first"], state, epoch = piece(make, ids, EPOCHS, stop=7, on_epoch=on_epoch)
    state = checkpoint(state, os.path.join(out, "first.pt"))
    result["second"], state, epoch = piece(make, ids, EPOCHS, state, 9, first=epoch, on_epoch=on_epoch)
    state = checkpoint(state, os.path.join(out, "second.pt"))
    result["rest"] = piece(make, ids, EPOCHS, state, first=epoch, on_epoch=on_epoch)[0]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    shuffled = sys.argv[2] == "--shuffle"
    main(sys.argv[1], sys.argv[3 if shuffled else 2:], shuffled)
