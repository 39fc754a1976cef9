"""What capturing a Stateful dataset's state with every batch costs, on the tiny-rows workload.

    python benchmarks/state_capture.py                    # 24,576 rows, 2 workers, 3 rounds (< 1 min)
    python benchmarks/state_capture.py --rounds 5 --state rng --json out.json

The rows of ``benchmarks/run.py``'s ``tiny`` suite (row i: 128 int64 tokens and a label;
almost no work per sample, so per-batch costs show), as an ``IterableDataset`` whose worker
``w`` of ``W`` yields the rows ``i % W == w`` in order, in batches of ``--batch-size``, with
``--workers`` worker processes for every row of the table:

* ``torch DataLoader``: torch's loader over the stream without state (the reference);
* ``torchdata, no state`` / ``torchdata, Stateful``: torchdata's ``StatefulDataLoader`` over the
  stream without state (it counts the items each worker yielded, to fast-forward) and over the
  same stream with ``state_dict()``/``load_state_dict()`` (its default: a snapshot every step);
* ``aioload, no state`` / ``aioload, Stateful``: ``aioload.DataLoader`` over the same two;
* ``..., state_dict() every batch``: the Stateful rows again with the training loop calling
  ``loader.state_dict()`` after every batch, as ``torchdata.nodes`` and a checkpoint hook
  that saves often do.

The state (``--state``): ``position``, the rows the worker's copy yielded (what a file reader
saves: a Hugging Face stream's state is a few such counters); ``rng``, that and the state of a
``torch.Generator`` of the dataset's own (5 kB, what a stream that shuffles saves).

Each measurement is one epoch of a fresh loader (``aioload._tools.bench.measure``: rows/s after
the first batch, main-process CPU per row); rounds are interleaved, the order alternating, and
medians printed, each against torch's DataLoader. The capture cost is the Stateful row against
the same loader's row without state: milliseconds per batch (``1/rate`` in batch time) and the
share of throughput lost. Numbers from a shared machine are noisy: compare within one run,
and read a cost within a few percent as none.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.utils.data import IterableDataset, get_worker_info

import aioload
from aioload._tools.bench import environment, measure, median, script_main, script_parser

TORCH = "torch DataLoader"
TD_PLAIN, TD_STATE, TD_SAVE = "torchdata, no state", "torchdata, Stateful", "torchdata, state_dict() every batch"
AIO_PLAIN, AIO_STATE, AIO_SAVE = "aioload, no state", "aioload, Stateful", "aioload, state_dict() every batch"


class TinyStream(IterableDataset):
    """The tiny rows as a stream: row i is 128 int64 tokens and a label, worker ``w`` of ``W``
    yields the rows ``i % W == w``."""

    def __init__(self, rows: int):
        self.rows = rows

    def _mine(self) -> range:
        info = get_worker_info()
        workers, wid = (1, 0) if info is None else (info.num_workers, info.id)
        return range(wid, self.rows, workers)

    def __iter__(self):
        for i in self._mine():
            yield torch.arange(i, i + 128, dtype=torch.int64), i % 7


class StatefulTinyStream(TinyStream):
    """The same stream, ``Stateful``: its state is how many rows its copy yielded (and, with
    ``rng``, a generator's state); a loaded state makes the next ``__iter__`` start there."""

    def __init__(self, rows: int, rng: bool = False):
        super().__init__(rows)
        self.done = 0
        self.start = 0
        self.generator = torch.Generator().manual_seed(0) if rng else None

    def __iter__(self):
        start, self.start = self.start, 0
        self.done = start
        for i in self._mine()[start:]:
            self.done += 1
            yield torch.arange(i, i + 128, dtype=torch.int64), i % 7

    def state_dict(self) -> dict:
        state = {"done": self.done}
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.start = state["done"]
        if self.generator is not None:
            self.generator.set_state(state["generator"])


class SavingEvery:
    """A loader whose every batch is followed by ``loader.state_dict()`` in the training loop."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        for batch in self.loader:
            yield batch
            self.loader.state_dict()

    def stats(self):
        return self.loader.stats() if hasattr(self.loader, "stats") else None

    def close(self) -> None:
        close = getattr(self.loader, "close", None)
        if close is not None:
            close()


def loaders(args) -> dict:
    import warnings

    from torchdata.stateful_dataloader import StatefulDataLoader

    # torchdata 0.11 calls torch.set_vital, which torch 2.14 deprecates, at each iterator's start
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)

    plain = TinyStream(args.rows)
    stateful = StatefulTinyStream(args.rows, rng=args.state == "rng")
    common = dict(batch_size=args.batch_size, num_workers=args.workers)
    return {
        TORCH: lambda: torch.utils.data.DataLoader(plain, **common),
        TD_PLAIN: lambda: StatefulDataLoader(plain, **common),
        TD_STATE: lambda: StatefulDataLoader(stateful, **common),
        TD_SAVE: lambda: SavingEvery(StatefulDataLoader(stateful, **common)),
        AIO_PLAIN: lambda: aioload.DataLoader(plain, **common),
        AIO_STATE: lambda: aioload.DataLoader(stateful, **common),
        AIO_SAVE: lambda: SavingEvery(aioload.DataLoader(stateful, **common)),
    }


def _progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def run(args) -> dict:
    makers = loaders(args)
    runs: dict[str, list] = {name: [] for name in makers}
    for round_ in range(args.rounds):
        names = list(makers) if round_ % 2 == 0 else list(reversed(makers))
        for name in names:
            measured = measure(name, makers[name])
            runs[name].append(measured)
            _progress(f"round {round_ + 1}/{args.rounds}: {name:<38} {measured.rate:10.0f} rows/s")
    rows = {}
    for name, measured in runs.items():
        rate = median(m.rate for m in measured)
        rows[name] = {"rows_s": rate, "ms_per_batch": args.batch_size / rate * 1e3 if rate else float("nan"),
                      "cpu_ms_per_row": median(m.cpu_ms_per_image for m in measured),
                      "rows": median(m.images for m in measured), "rows_s_rounds": [m.rate for m in measured]}
    return {"rows": rows, "capture": {
                "aioload": cost(rows[AIO_PLAIN], rows[AIO_STATE]),
                "aioload, state_dict() every batch": cost(rows[AIO_PLAIN], rows[AIO_SAVE]),
                "torchdata": cost(rows[TD_PLAIN], rows[TD_STATE]),
                "torchdata, state_dict() every batch": cost(rows[TD_PLAIN], rows[TD_SAVE])},
            "settings": {"rows": args.rows, "workers": args.workers, "batch_size": args.batch_size,
                         "rounds": args.rounds, "state": args.state, "environment": environment()},
            "command": "python benchmarks/state_capture.py " + " ".join(sys.argv[1:])}


def cost(without: dict, with_state: dict) -> dict:
    """What the state adds: ms per batch, and the share of throughput it takes."""
    return {"ms_per_batch": with_state["ms_per_batch"] - without["ms_per_batch"],
            "throughput_lost": 1 - with_state["rows_s"] / without["rows_s"]}


def report(result: dict) -> None:
    rows, s = result["rows"], result["settings"]
    print(f"\nstate capture: {s['rows']} tiny rows, batch {s['batch_size']}, {s['workers']} workers, state "
          f"{s['state']!r}, {s['rounds']} round(s); {s['environment']}\ncommand: {result['command']}")
    print(f"  {'loader':<38}{'rows/s':>10}{'/ torch':>9}{'ms/batch':>10}{'main CPU ms/row':>17}")
    base = rows[TORCH]["rows_s"] or float("nan")
    for name, row in rows.items():
        print(f"  {name:<38}{row['rows_s']:>10.0f}{row['rows_s'] / base:>8.2f}x{row['ms_per_batch']:>10.3f}"
              f"{row['cpu_ms_per_row']:>17.4f}")
    print("  capture cost (Stateful against the same loader without state):")
    for name, c in result["capture"].items():
        print(f"    {name:<38}{c['ms_per_batch']:+8.3f} ms/batch {c['throughput_lost']:+7.1%} of throughput")


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--rows", type=int, default=24576, help="rows in an epoch")
    parser.add_argument("--workers", type=int, default=2, help="worker processes of every loader")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are printed")
    parser.add_argument("--state", choices=["position", "rng"], default="position",
                        help="what the Stateful dataset saves (see the module's docstring)")
    return script_main(parser, argv, run, report)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
