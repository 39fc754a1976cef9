"""aioload against SPDL (and torch's DataLoader) on images behind HTTP latency.

    python benchmarks/spdl_compare.py                         # latencies 0, 20, 50 ms
    python benchmarks/spdl_compare.py --latencies 20 --images 256 --rounds 1 --json out.json

The same generated JPEGs are served by the HTTP server of ``benchmarks/remote.py`` (aiohttp in
its own process, files in memory), which answers every GET after L ms; every loader decodes
the bytes with ``aioload.decode_image`` and applies the same transform
(``RandomResizedCrop(224)`` + flip on uint8 tensors, as ``benchmarks/overhead.py``), in
batches of ``--batch-size`` with ``--workers`` decode workers and ``--io-concurrency`` reads in
flight where the loader keeps several:

* ``aioload ImageFiles``: ``aioload.DataLoader(ImageFiles(urls), num_workers=W)`` with its
  default settings;
* ``aioload, read_in_workers=False``: the same with the reads on the training process's event
  loop; the row is left out where ``aioload.DataLoader`` has no such keyword;
* ``SPDL, thread pool``: ``spdl.pipeline.PipelineBuilder``: an async source of shuffled
  indices, an async fetch stage (aiohttp, one session, ``concurrency=io_concurrency``), the
  decode + transform as a ``pipe`` stage on a ``ThreadPoolExecutor(W)`` (so decoding runs in
  the training process), ``aggregate(batch_size)`` and a collate stage (``torch.stack``);
* ``SPDL, process pool``: the same with the decode stage on a ``ProcessPoolExecutor(W)``
  (processes with one intra-op thread each, as torch's workers; each returns a numpy array,
  pickled back; the collate stage makes the tensors);
* ``torch DataLoader``: ``remote.py``'s classic recipe, one blocking ``urllib`` GET per sample
  in ``__getitem__``, then the same decode and transform, ``num_workers=W``.

Each measurement is one epoch of a fresh loader over ``--images`` images (shuffled, the last
partial batch dropped); img/s and main-process CPU (``time.process_time``: every thread of
the process running the loop) count the batches after the first ``--skip-batches`` + 1
(``overhead.py``'s ``measure`` after the skipped ones: every loader holds a few batches read
ahead when its first batch arrives, and counting those would flatter the slow loaders). Rounds are interleaved, the order of the loaders alternates from round to round,
and medians are printed: img/s, aioload's (default settings) img/s over each row's, and CPU ms
per image in the main process. ``--json PATH`` writes the rows and the run's settings too.
Numbers from a shared machine are noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import inspect
import json
import os
import sys
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from importlib import metadata
from typing import Callable

import torch

import aioload
from aioload._tools.bench import environment, median, rrc_flip

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # noqa: E402  (benchmarks/overhead.py: the data, the servers, measure())
import remote  # noqa: E402  (benchmarks/remote.py: the classic blocking-GET recipe)

AIOLOAD = "aioload ImageFiles"
AIOLOAD_LOOP = "aioload, read_in_workers=False"
SPDL_THREADS = "SPDL, thread pool"
SPDL_PROCESSES = "SPDL, process pool"
TORCH = "torch DataLoader"


# ----------------------------------------------------------------------------- SPDL

_TRANSFORM = None


def _decode(item):
    """SPDL's decode stage in a thread: bytes -> transformed uint8 tensor."""
    global _TRANSFORM
    if _TRANSFORM is None:
        _TRANSFORM = rrc_flip()
    data, label = item
    return _TRANSFORM(aioload.decode_image(data)), label


def _decode_to_numpy(item):
    """The same in a process, returning a numpy array: a tensor result would travel back
    through torch's shared-memory reducers (one file descriptor per tensor), about 3x slower
    for these 150 kB images than a pickled array."""
    image, label = _decode(item)
    return image.numpy(), label


def _one_thread() -> None:
    """A pool process's initializer: one intra-op thread, as torch's and aioload's workers run."""
    torch.set_num_threads(1)


def _warm(_):
    """Starts a pool's process and builds its transform before the pipeline's threads exist."""
    global _TRANSFORM
    if _TRANSFORM is None:
        _TRANSFORM = rrc_flip()
    return os.getpid()


def _collate(items):
    images, labels = zip(*items)
    return torch.stack([torch.as_tensor(x) for x in images]), torch.tensor(labels)


class SpdlLoader:
    """One epoch of an SPDL pipeline: fetch (async, aiohttp) -> decode + transform (on
    ``executor``) -> aggregate -> collate -> sink. Iterate once, then ``close()``."""

    def __init__(self, urls: list[str], labels: list[int], *, batch_size: int, workers: int,
                 io_concurrency: int, processes: bool):
        from spdl.pipeline import PipelineBuilder

        self.urls, self.labels = urls, labels
        self.order = torch.randperm(len(urls)).tolist()
        self.executor: Executor
        if processes:
            self.executor = ProcessPoolExecutor(workers, initializer=_one_thread)
            list(self.executor.map(_warm, range(workers)))
        else:
            self.executor = ThreadPoolExecutor(workers, thread_name_prefix="spdl-decode")
        self.io_concurrency = io_concurrency
        self.session = None
        self.fetched = 0
        self.all_fetched: asyncio.Event | None = None
        self.pipeline = (
            PipelineBuilder()
            .add_source(self._source())
            .pipe(self._fetch, concurrency=io_concurrency, name="fetch")
            # two tasks per worker keep each busy across the hand-off to the next item
            .pipe(_decode_to_numpy if processes else _decode, executor=self.executor, concurrency=2 * workers, name="decode")
            .aggregate(batch_size, drop_last=True)
            .pipe(_collate, name="collate")
            .add_sink(3)
            .build(num_threads=2)
        )
        self.started = False

    async def _source(self):
        # The source owns the HTTP session, so that it is closed on the pipeline's own loop:
        # after the last fetch at the end of an epoch, or when the pipeline is stopped early.
        import aiohttp

        self.all_fetched = asyncio.Event()
        connector = aiohttp.TCPConnector(limit=self.io_concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:
            self.session = session
            for index in self.order:
                yield index
            await self.all_fetched.wait()

    async def _fetch(self, index: int):
        try:
            async with self.session.get(self.urls[index]) as resp:
                resp.raise_for_status()
                return await resp.read(), self.labels[index]
        finally:
            self.fetched += 1
            if self.fetched == len(self.order):
                self.all_fetched.set()

    def __iter__(self):
        self.started = True
        self.pipeline.start(timeout=120)
        yield from self.pipeline.get_iterator(timeout=120)

    def close(self) -> None:
        try:
            if self.started:
                self.pipeline.stop(timeout=120)
        finally:
            self.executor.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------- the rows


class Skip:
    """A loader whose first ``batches`` batches are consumed unseen: ``overhead.measure``
    starts its clock at the first batch it sees, and by then every loader holds a few batches
    read ahead (torch's ``prefetch_factor`` per worker, aioload's ready queue, SPDL's sink);
    skipping past them measures the steady rate, not the emptying of those buffers."""

    def __init__(self, loader, batches: int):
        self.loader, self.batches = loader, batches

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if i >= self.batches:
                yield batch
            del batch

    def close(self) -> None:
        overhead._close(self.loader)


def has_read_in_workers() -> bool:
    return "read_in_workers" in inspect.signature(aioload.DataLoader).parameters


def loaders(data: overhead.Data, latency: float, args) -> dict[str, Callable]:
    urls = data.urls(latency)
    files = aioload.ImageFiles(urls, data.labels, transform=data.transform)
    common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True)
    spdl = dict(batch_size=args.batch_size, workers=args.workers, io_concurrency=args.io_concurrency)
    rows = {AIOLOAD: lambda: aioload.DataLoader(files, io_concurrency=args.io_concurrency, **common)}
    if has_read_in_workers():
        rows[AIOLOAD_LOOP] = lambda: aioload.DataLoader(files, io_concurrency=args.io_concurrency,
                                                        read_in_workers=False, **common)
    rows[SPDL_THREADS] = lambda: SpdlLoader(urls, data.labels, processes=False, **spdl)
    rows[SPDL_PROCESSES] = lambda: SpdlLoader(urls, data.labels, processes=True, **spdl)
    recipe = remote.BlockingGet(urls, data.labels, data.transform)
    rows[TORCH] = lambda: torch.utils.data.DataLoader(recipe, **common)
    return rows


def run(args) -> dict:
    latencies = [float(x) for x in args.latencies.split(",") if x.strip() != ""]
    if not latencies:
        raise SystemExit("--latencies: give at least one latency in ms")
    if args.images < (args.skip_batches + 2) * args.batch_size:
        raise SystemExit(f"--images {args.images}: at least {args.skip_batches + 2} batches of {args.batch_size} "
                         f"are needed (--skip-batches {args.skip_batches} and the first one are not counted)")
    data = overhead.Data(args.images, latencies)
    runs: dict[tuple[float, str], list[overhead.Run]] = collections.defaultdict(list)
    try:
        rows = {latency: loaders(data, latency, args) for latency in latencies}
        for r in range(args.rounds):
            for latency in (latencies if r % 2 == 0 else latencies[::-1]):
                names = list(rows[latency])
                for name in (names if r % 2 == 0 else names[::-1]):
                    make = rows[latency][name]
                    result = overhead.measure(lambda make=make: Skip(make(), args.skip_batches))
                    runs[latency, name].append(result)
                    overhead._progress(f"round {r + 1}/{args.rounds} HTTP {latency:g} ms {name:<32} "
                                       f"{result.rate:8.1f} img/s main CPU {result.ms_per_image(result.cpu_s):.3f} "
                                       f"ms/img")
    finally:
        data.close()
    out = []
    for latency in latencies:
        base = median(x.rate for x in runs[latency, AIOLOAD])
        for name in rows[latency]:
            rate = median(x.rate for x in runs[latency, name])
            out.append({
                "latency_ms": latency, "row": name, "img_s": rate,
                "aioload_over_row": base / rate if rate else 0.0,
                "cpu_ms_per_image": median(x.ms_per_image(x.cpu_s) for x in runs[latency, name]),
                "rounds_img_s": [x.rate for x in runs[latency, name]],
            })
    return {"rows": out}


def versions() -> str:
    found = []
    for name in ("aioload", "spdl", "spdl_core", "spdl_io", "aiohttp"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


def print_result(result: dict, args) -> None:
    print(f"\n## Images behind HTTP latency: aioload, SPDL, torch; RandomResizedCrop(224) + flip, "
          f"batch {args.batch_size}, {args.workers} workers, {args.io_concurrency} reads in flight, "
          f"{args.images} images per epoch, {args.rounds} rounds\n")
    print(f"{'latency':>7}  {'row':32} {'img/s':>8} {'aioload/row':>11} {'main CPU ms/img':>15}")
    for row in result["rows"]:
        print(f"{row['latency_ms']:5g} ms  {row['row']:32} {row['img_s']:8.1f} {row['aioload_over_row']:10.2f}x "
              f"{row['cpu_ms_per_image']:15.3f}")
    print(f"\nimg/s after the first {args.skip_batches + 1} batches, medians; aioload/row = the '{AIOLOAD}' "
          f"row's img/s over this row's (same latency); main CPU = time.process_time of the process running the loop, all threads "
          f"(SPDL's thread pool decodes there)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latencies", default="0,20,50", help="HTTP latencies in ms, comma-separated")
    parser.add_argument("--images", type=int, default=768, help="images per epoch (one epoch per measurement)")
    parser.add_argument("--skip-batches", type=int, default=4,
                        help="batches not counted before the first counted one (the read-ahead buffers)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--io-concurrency", type=int, default=64)
    parser.add_argument("--json", help="also write the rows and settings to this file")
    args = parser.parse_args(argv)
    command = "python benchmarks/spdl_compare.py " + " ".join(sys.argv[1:] if argv is None else argv)
    run_info = f"{environment()}; {versions()}"
    print(f"# aioload against SPDL behind HTTP latency\n\nrun: {run_info}\ncommand: {command}")
    result = run(args)
    print_result(result, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": run_info, "command": command, "settings": vars(args),
                       "read_in_workers_row": has_read_in_workers(), **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
