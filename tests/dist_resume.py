"""One rank of the construction-order and resume tests; run by tests/test_resume_ddp.py with
the environment torchrun gives its ranks (gloo, CPU, 127.0.0.1).

Loaders are built before ``init_process_group`` and after it; each case's result (or the error
it raised, as ``{"error": "Type: message"}``) goes to ``<out>/rank<r>.json``. Collective calls
stay outside the cases, so that a case failing on one rank cannot leave the other waiting.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import aioload

EPOCHS = 2


class Indices(aioload.Dataset):
    """The split protocol: ``read`` returns the index, ``decode`` passes it on."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def read(self, i):
        return i

    def decode(self, raw):
        return raw


class Plain(torch.utils.data.Dataset):
    """A plain map-style dataset (``__getitem__``), loaded in the caller's thread with no workers."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return i


class Listed(torch.utils.data.Sampler):
    """A sampler aioload cannot replay (not one of torch's), with a len(): its rest is saved as
    indices, which are this rank's own."""

    def __init__(self, indices: list[int]):
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self):
        return iter(self.indices)


def flat(batch) -> list[int]:
    return batch.tolist()


def epochs(loader, count: int = EPOCHS) -> list[list[list[int]]]:
    return [[flat(b) for b in loader] for _ in range(count)]


def guarded(fn):
    try:
        return fn()
    except Exception as exc:  # recorded for the test to report, on this rank only
        return {"error": f"{type(exc).__name__}: {exc}"}


def take(loader, k: int) -> list[list[int]]:
    """The first ``k`` batches, across epochs; the loader is left where the k-th was delivered."""
    got: list[list[int]] = []
    while True:
        for batch in loader:
            got.append(flat(batch))
            if len(got) == k:
                return got


def share_rank0(state: dict) -> dict:
    """What a framework's checkpoint holds: rank 0's state, read back by every rank."""
    box = [json.loads(json.dumps(state)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# Each resume case: (make a loader, batches taken before saving, make the resumed loader).
RESUME_CASES = {
    "seeded": (lambda: aioload.DataLoader(Indices(20), batch_size=3, shuffle=True, seed=3, num_workers=1), 2,
               lambda: aioload.DataLoader(Indices(20), batch_size=3, shuffle=True, seed=3)),
    "seeded-next-epoch": (lambda: aioload.DataLoader(Indices(20), batch_size=3, shuffle=True, seed=3), 5,
                          lambda: aioload.DataLoader(Indices(20), batch_size=3, shuffle=True, seed=3, num_workers=1)),
    "global-rng": (lambda: aioload.DataLoader(Plain(22), batch_size=4, shuffle=True), 3,
                   lambda: aioload.DataLoader(Plain(22), batch_size=4, shuffle=True)),
    "own-generators": (
        lambda: aioload.DataLoader(Indices(20), batch_size=3, shuffle=True,
                                   generator=torch.Generator().manual_seed(10 + dist.get_rank())), 1,
        lambda: aioload.DataLoader(Indices(20), batch_size=3, shuffle=True,
                                   generator=torch.Generator().manual_seed(10 + dist.get_rank()))),
    "distributed-sampler": (
        lambda: aioload.DataLoader(Indices(22), batch_size=2, seed=1,
                                   sampler=torch.utils.data.distributed.DistributedSampler(range(22), seed=7)), 4,
        lambda: aioload.DataLoader(Indices(22), batch_size=2, seed=1,
                                   sampler=torch.utils.data.distributed.DistributedSampler(range(22), seed=7))),
}


def resume_case(make, k: int, make_resumed, before: aioload.DataLoader | None = None) -> dict:
    torch.manual_seed(0)  # as a framework's seed_everything does on every rank
    with make() as loader:
        full = epochs(loader)
    torch.manual_seed(0)
    with (before if before is not None else make()) as loader:
        head = take(loader, k)
        state = loader.state_dict()
    state = share_rank0(state)

    def resumed():
        with make_resumed() as loader:
            loader.load_state_dict(state)
            epoch = state["epoch"]
            return {"epoch": epoch, "rest": [[flat(b) for b in loader] for _ in range(epoch, EPOCHS)]}

    return {"full": full, "head": head, **guarded(resumed)}


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    result: dict = {}
    # -- built before torch.distributed exists --------------------------------------------
    early = {
        "split-shuffled": aioload.DataLoader(Indices(20), batch_size=3, shuffle=True, seed=3, num_workers=1),
        "plain-padded": aioload.DataLoader(Plain(21), batch_size=4),
        "plain-dropped": aioload.DataLoader(Plain(21), batch_size=4, shuffle=True, drop_last=True),
    }
    lengths = {name: len(loader) for name, loader in early.items()}
    resumed_early = aioload.DataLoader(Indices(20), batch_size=3, shuffle=True, seed=3)
    with aioload.DataLoader(Indices(20), batch_size=3, shuffle=True, seed=3) as one:
        take(one, 2)
        one_process_state = json.loads(json.dumps(one.state_dict()))
    loaded_early = aioload.DataLoader(Indices(20), batch_size=3, shuffle=True, seed=3)
    loaded_early.load_state_dict(one_process_state)  # one process so far: accepted

    dist.init_process_group("gloo")
    for name, loader in early.items():
        with loader:
            result[name] = {"len_before": lengths[name], "len_after": len(loader), "epochs": epochs(loader)}

    # -- one checkpoint, from rank 0, resumes every rank -----------------------------------
    for name, (make, k, make_resumed) in RESUME_CASES.items():
        result[f"resume-{name}"] = resume_case(make, k, make_resumed)
    result["resume-built-early"] = resume_case(*RESUME_CASES["seeded"], before=resumed_early)

    # -- what cannot resume --------------------------------------------------------------
    def load(state, **kwargs):
        with aioload.DataLoader(Indices(20), **{"batch_size": 3, "shuffle": True, "seed": 3, **kwargs}) as loader:
            loader.load_state_dict(state)
            return {"loaded": [flat(b) for b in loader]}

    result["load-one-process-state"] = guarded(lambda: load(one_process_state))
    with loaded_early:  # the world changed between load_state_dict() and the epoch
        result["iterate-one-process-state"] = guarded(lambda: {"loaded": [flat(b) for b in loaded_early]})
    with aioload.DataLoader(Indices(20), batch_size=3, shuffle=True, seed=3) as two:
        take(two, 2)
        two_process_state = json.loads(json.dumps(two.state_dict()))
    own = list(range(rank, 20, 2))
    with aioload.DataLoader(Indices(20), batch_size=3, sampler=Listed(own), seed=3) as listed:
        take(listed, 1)
        listed_state = share_rank0(listed.state_dict())
    result["load-other-ranks-indices"] = guarded(lambda: load(listed_state, shuffle=False, sampler=Listed(own)))
    dist.barrier()
    dist.destroy_process_group()
    result["load-two-process-state-alone"] = guarded(lambda: load(two_process_state))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
