"""What capturing a worker's state costs per batch (the Stateful protocol, aioload._plan.stateful).

    python benchmarks/stateful_capture.py [--batches N]

For each kind of IterableDataset copy, the work the protocol adds to one batch, timed in this
process without a loader around it (each figure the best of 5 runs of N batches, in
microseconds per batch):

* ``capture``: the worker's side, ``CopyState.note`` (``state_dict()`` of the dataset and of
  its iterator, where they are Stateful) and pickling the note into the reply;
* ``apply``: the consumer's side, unpickling the note and ``Copies.note`` (keeping the record).

Kinds: a copy that is not Stateful (the note is three fields), a small state (a position and
an epoch, as most hand-written datasets keep), and a state the size of a Hugging Face streaming
dataset's (a few nested dicts of shard and example indices). The batch itself is not part of
the figure: compare it with the time a batch takes to make (tiny rows, ``benchmarks/run.py``).
"""

from __future__ import annotations

import argparse
import pickle
import time

from aioload._plan.stateful import Copies
from aioload._workers.state import CopyState


class Plain:
    def __iter__(self):
        return iter(range(10**9))


class Small(Plain):
    def __init__(self):
        self.position, self.epoch = 0, 0

    def state_dict(self):
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.position, self.epoch = state["position"], state["epoch"]


class HubLike(Small):
    """A state shaped like ``datasets.IterableDataset.state_dict()``: examples iterable states
    nested a few levels, shard and example indices, a shuffle's RNG position."""

    def state_dict(self):
        inner = {"shard_idx": 3, "shard_example_idx": self.position, "type": "ArrowExamplesIterable"}
        return {"examples_iterable": {"examples_iterable": {"examples_iterable": inner, "previous_state": inner,
                                                            "batch_idx": 7, "num_chunks_since_previous_state": 2,
                                                            "cropped_chunk_length": 0, "type": "MappedExamplesIterable"},
                                      "bit_generator_state": {"state": 123456789, "inc": 987654321},
                                      "bit_generator_index_offset": 40, "type": "BufferShuffledExamplesIterable"},
                "epoch": self.epoch}


def best(fn, batches: int, repeat: int = 5) -> float:
    """Microseconds per batch, the best of ``repeat`` runs."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn(batches)
        times.append(time.perf_counter() - started)
    return min(times) / batches * 1e6


def measure(dataset, batches: int) -> tuple[float, float]:
    copy = CopyState(0, dataset)
    copies = Copies(1)

    def capture(n: int) -> None:
        for _ in range(n):
            pickle.dumps(copy.note(4), protocol=pickle.HIGHEST_PROTOCOL)

    blob = pickle.dumps(copy.note(4), protocol=pickle.HIGHEST_PROTOCOL)

    def apply(n: int) -> None:
        for _ in range(n):
            copies.note(0, pickle.loads(blob))

    return best(capture, batches), best(apply, batches)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20000)
    args = parser.parse_args(argv)
    print(f"{'copy':<22} {'capture us/batch':>17} {'apply us/batch':>15}")
    for name, dataset in (("not Stateful", Plain()), ("small state", Small()), ("HF-sized state", HubLike())):
        capture, apply = measure(dataset, args.batches)
        print(f"{name:<22} {capture:>17.2f} {apply:>15.2f}")


if __name__ == "__main__":
    main()
