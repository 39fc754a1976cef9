"""What loading a state saved after elastic resumes costs: the CPU of ``load_state_dict()`` and
of planning the resumed epoch, for states whose epoch holds many segments (parts run on other
numbers of ranks; see aioload/_plan/elastic.py).

    python benchmarks/elastic_state.py                     # the default cases
    python benchmarks/elastic_state.py --length 1000000 --segments 10 100 1000 8000

Cases (an epoch of ``--length`` samples, batches of ``--batch``, one process playing rank 0 of
torch's fake process group, as tests/test_unit_elastic.py does):

* ``stride``: ``N`` segments alternating 2 and 3 ranks, each delivering its first batch (a
  state's size grows ~12 bytes a segment: 8,000 segments is a 94 KiB state);
* ``fragmented``: a crafted state whose first segment, on ``length / 2`` ranks holding blocks
  of 2 samples, delivers one sample of each (every other position left), then ``N`` segments on
  one rank: the worst a state can do to the pieces what is left is kept in.

It prints, per case, the state's size, the CPU seconds (all threads) and wall seconds of loading
and planning, and what happened (``ok``, or the error the state was refused with). Run it on the
code before and after a change in one session to compare; CPU time is the figure (wall time
counts torch's threads once).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from tests.test_unit_elastic import Blocks  # noqa: E402
from tests.test_unit_sampling import make_planner  # noqa: E402


def rank_of(rank: int, world: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def state_with(length: int, batch: int, segments: list, dataset=None) -> dict:
    rank_of(0, 4)
    planner = make_planner(length, batch, shuffle=True, seed=5, dataset=dataset)
    _, progress = planner.plan(0, None, False)
    state = planner.state_dict(1, progress)
    state["progress"]["segments"] = segments
    state["progress"]["delivered"] = {"below": 0, "also": []}
    return state


def measure(name: str, length: int, batch: int, segments: list, dataset=None) -> None:
    state = state_with(length, batch, segments, dataset)
    size = len(json.dumps(state))
    rank_of(0, 2)
    fresh = make_planner(length, batch, shuffle=True, seed=5, dataset=dataset)
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        plan, _ = fresh.plan(0, fresh.load(state), False)
        next(iter(plan.batches))
        outcome = "ok"
    except Exception as exc:  # noqa: BLE001 - a refusal is an outcome to report
        outcome = f"{type(exc).__name__}: {str(exc)[:110]}"
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"| {name} | {len(segments):,} | {size / 1024:.1f} KiB | {cpu:.2f} | {wall:.2f} | {outcome} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--segments", type=int, nargs="+", default=[10, 100, 1000, 8000])
    parser.add_argument("--fragmented", type=int, nargs="+", default=[10, 100])
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')} python {platform.python_version()} torch {torch.__version__} "
          f"threads {torch.get_num_threads()} cpus {os.cpu_count()} load {os.getloadavg()[0]:.1f} "
          f"code {os.getcwd()} length {args.length:,} batch {args.batch}")
    print("| case | segments | state | CPU s | wall s | outcome |\n| --- | --- | --- | --- | --- | --- |")
    for n in args.segments:
        measure("stride", args.length, args.batch, [[3 if i % 2 else 2, 1, []] for i in range(n)])
    half = args.length // 2
    blocks = Blocks(args.length)
    for n in args.fragmented:
        measure("fragmented", args.length, 1, [[half, 1, []]] + [[1, 1, []]] * n, blocks)


if __name__ == "__main__":
    main()
