"""Side-by-side measurements: aioload against torch's DataLoader on the same data and work.

Used by ``aioload bench`` and by the scripts in ``benchmarks/``. Every figure is a ratio
measured in one run (these machines are shared and noisy): rounds are interleaved, and the
median of each column is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from aioload._data.dataset import NOT_READY
from aioload.images import ImageFolder, decode_image, torchcodec_images


def rrc_flip():
    """The ImageNet training transform on uint8 tensors: RandomResizedCrop(224) + flip."""
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()])


class BenchImages(ImageFolder):
    """An ImageFolder whose every read first waits ``latency_ms`` (a simulated storage round
    trip): ``asyncio.sleep`` on aioload's event loop, ``time.sleep`` in a blocking read."""

    def __init__(self, root, transform=None, latency_ms: float = 0.0, **kwargs):
        super().__init__(root, transform, **kwargs)
        self.latency_s = latency_ms / 1000.0

    async def read(self, index):
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        return await super().read(index)

    def read_nowait(self, index):
        return NOT_READY if self.latency_s else self._local_file(index)

    def read_blocking(self, index):
        if self.latency_s:
            time.sleep(self.latency_s)
        return super().read_blocking(index)


# ----------------------------------------------------------------------------- measuring


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


EXCLUDED_PIDS: set[int] = set()
"""Children of this process that are not part of a loader (the bench's HTTP server): their
memory is not counted."""


def memory_mb() -> float:
    """Proportional set size of this process and its children (shared pages counted once),
    but for :data:`EXCLUDED_PIDS`."""
    pid = os.getpid()
    return sum(_pss_kb(p) for p in [pid, *_children(pid)] if p not in EXCLUDED_PIDS) / 1024


def shm_used_mb() -> float:
    """MB in use on /dev/shm, by every program (files unlinked but still open count too)."""
    try:
        return shutil.disk_usage("/dev/shm").used / 2**20
    except OSError:
        return 0.0


@dataclass
class Run:
    """One epoch of one loader. ``rate`` and ``wait_s`` cover the steady state: from the first
    batch to the last (the first batch's wait is ``first_batch_s``). ``shm_mb`` is the peak of
    /dev/shm in use above what was in use before the loader was made."""

    name: str
    images: int
    seconds: float
    first_batch_s: float
    cpu_s: float
    memory_mb: float
    shm_mb: float
    stats: object = None
    wait_s: float = 0.0
    batches: int = 0
    side_s: float | None = None  # the ``side_clock`` of measure() over the steady state

    @property
    def rate(self) -> float:
        """Images per second after the first batch (the figure ``LoaderStats`` calls
        ``steady_samples_per_s``)."""
        return self.images / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_ms_per_image(self) -> float:
        return self.cpu_s / max(1, self.images) * 1e3

    @property
    def wait_ms_per_batch(self) -> float:
        """How long the consumer waited inside ``next()`` for each batch after the first."""
        return self.wait_s / self.batches * 1e3 if self.batches else 0.0

    @property
    def wait_fraction(self) -> float:
        """The share of the steady state the consumer spent waiting for a batch."""
        return min(1.0, self.wait_s / self.seconds) if self.seconds > 0 else 0.0


def close_loader(loader) -> None:
    """Close a loader that has ``close()`` (aioload's); torch's has none."""
    close = getattr(loader, "close", None)
    if close is not None:
        close()


def _count(batch) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    return len(first) if hasattr(first, "__len__") else 1


def measure(name: str, make_loader: Callable, limit: int | None = None, epochs: int = 1,
            step_s: float = 0.0, bar=None, side_clock: Callable[[], float] | None = None) -> Run:
    """Iterate a fresh loader; throughput counts the batches after the first one (the first
    one's wait is reported as time to first batch). ``step_s`` is a simulated training step
    after each batch (a sleep: the GIL is released, as while a GPU works); ``bar`` (a tqdm
    bar, say) gets ``update(1)`` per batch; ``side_clock`` (another process's CPU seconds, say)
    is read when the steady state begins and when it ends, its difference in ``Run.side_s``."""
    gc.collect()
    shm_before = shm_used_mb()  # other programs' files on a shared machine are not this loader's
    loader = make_loader()
    images = batches = 0
    waited = 0.0
    peak_mem = 0.0
    peak_shm = shm_before
    cpu0 = time.process_time()
    # Reading memory figures (tens of ms for the PSS of a few processes) is not the loader's
    # work: its CPU and its wall time are left out. Meanwhile the loader fills its prefetch
    # queue, as both loaders do.
    probing = probing_wall = 0.0
    start = time.perf_counter()
    first = None
    steady_from = None
    side0 = side_s = None
    try:
        for epoch in range(epochs):
            batches_of = iter(loader)
            i = 0
            while True:
                asked = time.perf_counter()
                try:
                    batch = next(batches_of)
                except StopIteration:
                    break
                now = time.perf_counter()
                if first is None:
                    first = now - start
                    if side_clock is not None:
                        side0 = side_clock()
                    steady_from = time.perf_counter()
                    cpu0 = time.process_time()
                else:
                    waited += now - asked
                    images += _count(batch)
                    batches += 1
                if bar is not None:
                    bar.update(1)
                if i % 4 == 0:
                    probe0, wall0 = time.process_time(), time.perf_counter()
                    peak_shm = max(peak_shm, shm_used_mb())
                    if i == 8:
                        peak_mem = max(peak_mem, memory_mb())
                    probing += time.process_time() - probe0
                    probing_wall += time.perf_counter() - wall0
                del batch
                i += 1
                if step_s:
                    time.sleep(step_s)
                if limit is not None and images >= limit:
                    break
            del batches_of
        seconds = time.perf_counter() - steady_from - probing_wall if steady_from is not None else 0.0
        cpu = time.process_time() - cpu0 - probing
        if side0 is not None:
            side_s = side_clock() - side0
        peak_mem = max(peak_mem, memory_mb())
        stats = loader.stats() if hasattr(loader, "stats") else None
    finally:
        close_loader(loader)
        del loader
        gc.collect()
    return Run(name, images, seconds, first or 0.0, cpu, peak_mem, max(0.0, peak_shm - shm_before), stats, waited,
               batches, side_s)


def _timed(work: Callable, share, start, queue) -> None:
    torch.set_num_threads(1)
    start.wait()
    started = time.perf_counter()
    items = work(share)
    queue.put(items / (time.perf_counter() - started))


def ceiling_of(work: Callable, shares: list) -> float:
    """Items per second when ``work(share)`` (which returns how many items it did) runs for
    every share at once, one process each (forked: ``work`` need not be picklable), with no
    loader: the bound a loader approaches. The processes start together; the figure is the
    sum of their rates, so a share that ends early (a static split is never even) does not
    count as idle time, as it would not in a loader that balances its workers."""
    ctx = mp.get_context("fork")
    queue, start = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_timed, args=(work, share, start, queue)) for share in shares]
    for p in procs:
        p.start()
    start.set()
    total = sum(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return total


def _decode_files(share) -> int:
    paths, transform = share
    for path in paths:
        with open(path, "rb") as f:
            image = decode_image(f.read())
        if transform is not None:
            transform(image)
    return len(paths)


def ceiling(paths: list[str], transform, workers: int) -> float:
    """img/s of the same read+decode+transform in a tight loop, one process per worker (forked
    once the decoder is looked up here, as a loader's workers are: its import is no decoding)."""
    torchcodec_images()
    return ceiling_of(_decode_files, [(paths[w::workers], transform) for w in range(workers)])


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else 0.0


@dataclass
class Comparison:
    """Interleaved rounds of named loader factories; medians per column.

    ``bar(description, total)``, where given, makes a progress bar (tqdm's interface:
    ``update``, ``close``) for each loader's round; ``step_s`` is passed to :func:`measure`."""

    factories: dict[str, Callable]
    limit: int | None = None
    runs: dict[str, list[Run]] = field(default_factory=dict)
    step_s: float = 0.0
    bar: Callable | None = None
    total: int | None = None  # batches per round, for the bars

    def run(self, rounds: int, progress: Callable[[str], None] | None = None,
            each_round: Callable[[], float] | None = None, label: str = "") -> list[float]:
        """Run the rounds; ``each_round`` (the ceiling, say) is measured once per round between
        the loaders, so that it sees the same machine they do. Returns its values."""
        names = list(self.factories)
        extra = []
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for i, name in enumerate(order):
                if each_round is not None and i == len(order) // 2:
                    extra.append(each_round())
                title = f"round {r + 1}/{rounds} {label}{name}"
                bar = self.bar(title, self.total) if self.bar is not None else None
                try:
                    result = measure(name, self.factories[name], self.limit, step_s=self.step_s, bar=bar)
                finally:
                    if bar is not None:
                        bar.close()
                self.runs.setdefault(name, []).append(result)
                if progress:
                    progress(f"{title:<44} {result.rate:8.1f} img/s after the first batch, "
                             f"first batch {result.first_batch_s:5.2f} s")
        return extra

    def med(self, name: str, attr: str) -> float:
        return median(getattr(run, attr) for run in self.runs[name])


def environment() -> str:
    """How the run was made, printed under every table."""
    import torchvision

    return (f"python {sys.version.split()[0]}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
            f"{os.cpu_count()} CPUs, {sys.platform}, start method default, "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}")


def script_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark script's parser: its docstring's first paragraph, defaults in the help."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def script_main(parser: argparse.ArgumentParser, argv, run: Callable, report: Callable) -> int:
    """A benchmark script's ``main``: ``--json`` added last to ``parser``, the result of
    ``run(args)`` given to ``report`` (which may add to it), then written where ``--json`` says."""
    parser.add_argument("--json", help="also write the rows and settings to this file")
    args = parser.parse_args(argv)
    result = run(args)
    report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
