"""What the loader costs the training process: main-process CPU per image, and the step rate
a GIL-holding training loop keeps.

    python benchmarks/overhead.py split          # the split-protocol case (and ImageFolder, HTTP)
    python benchmarks/overhead.py interference   # the training-loop interference case
    python benchmarks/overhead.py profile --row split -o prof.txt   # py-spy on the main process

Both cases use the same dataset object, the same transform (``RandomResizedCrop(224)`` + flip
on uint8 tensors) and the same number of worker processes for torch's DataLoader and aioload;
rounds are interleaved (the order of the loaders alternates) and medians are printed.

``split``: one row per way of reading, each with torch's DataLoader beside it:

* ``split Dataset``: a dataset written as ``aioload.Dataset``'s docstring shows, an
  ``async def read`` that opens the local JPEG with ``aiofiles`` and returns its bytes and
  label, and a ``decode`` (in a worker) that decodes and transforms. Torch's DataLoader runs
  the same object's ``__getitem__`` (a blocking read, as the docstring advises, then
  ``decode``).
* ``ImageFolder``: ``aioload.ImageFolder``, whose workers read local files themselves; torch
  runs its ``__getitem__``.
* ``ImageFiles, HTTP L ms``: ``aioload.ImageFiles`` over URLs of a local HTTP server (the one
  of ``benchmarks/remote.py``) that answers each GET after L ms; torch runs the classic recipe
  of ``remote.py`` (one blocking ``urllib`` GET per sample, then the same decode and
  transform). These epochs are cut short at ``--http-images`` images (both loaders, with
  ``persistent_workers=True``): torch's two workers need seconds per hundred images at 50 ms.

Columns: img/s of each loader after the first batch, aioload / torch, each against the
ceiling (the same read + decode + transform in a tight loop, one process per worker, no loader,
measured once per round between the loaders), and main-process CPU ms per image
(``time.process_time``: every thread of the loader's process) of each; then aioload's
main-process CPU split by thread (the consumer, the engine's event-loop thread, the executor
threads that ``aiofiles`` and blocking reads hop to), from each thread's CPU clock.

``interference``: a training loop whose every step holds the GIL for ``--dispatch-ms`` of
pure-Python work (a model's dispatch), then sleeps ``--gpu-ms`` (its "GPU", the GIL
released), fed with batches of ``--step-batch`` images. Its steps/s is reported as a share of
the same loop fed one synthetic batch over and over (measured in every round). The loaders
are meant to feed faster than the loop consumes: the ``wait ms/step`` column (time the loop
spends in ``next()``) shows whether they did; a row with a large wait measures the loader,
not the interference.

``profile``: runs one aioload row alone for ``--epochs`` epochs and records the main process
with ``py-spy`` (started on this process after the first batch, stopped after the last), then
prints the functions that hold the largest shares of the samples (self time, per thread, and
a few inclusive groups). ``--step-ms`` gives the loop a step's worth of pure-Python work per
batch, as a training loop has.

``--json PATH`` writes the rows and the run's settings as JSON too.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

import aioload
from aioload._tools.bench import ceiling, environment, median, rrc_flip
from aioload._storage.cachedir import cache_dir
from aioload._data.synth import make_image_folder

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import remote  # noqa: E402  (benchmarks/remote.py: the HTTP server and the classic blocking-GET recipe)


# ----------------------------------------------------------------------------- the datasets


class SplitJPEGs(aioload.Dataset):
    """Local JPEGs, written as ``aioload.Dataset``'s docstring shows: ``read`` is the I/O (on
    the loader's event loop, through aiofiles), ``decode`` the CPU work (in a worker)."""

    def __init__(self, samples: list[tuple[str, int]], transform, decode_size: tuple[int, int] | None = None):
        self.samples, self.transform, self.decode_size = samples, transform, decode_size

    def __len__(self) -> int:
        return len(self.samples)

    async def read(self, index):
        import aiofiles

        path, label = self.samples[index]
        async with aiofiles.open(path, "rb") as f:
            return await f.read(), label

    def read_blocking(self, index):
        # the docstring's advice: a blocking read is cheaper than ``read`` on a fresh event loop
        path, label = self.samples[index]
        with open(path, "rb") as f:
            return f.read(), label

    def decode(self, raw):
        data, label = raw
        return self.transform(aioload.decode_image(data, self.decode_size)), label


# ----------------------------------------------------------------------------- measuring


def _thread_clocks() -> dict[int, tuple[str, float]]:
    """CPU seconds of every live Python thread of this process, by thread ident."""
    import threading

    out = {}
    for thread in threading.enumerate():
        try:
            out[thread.ident] = (thread.name, time.clock_gettime(time.pthread_getcpuclockid(thread.ident)))
        except (OSError, TypeError, AttributeError):
            continue
    return out


def _group(name: str) -> str:
    """A thread's role from its name: ``aioload-io_3`` (the engine loop's default executor),
    ``asyncio_3`` and ``ThreadPoolExecutor-0_1`` are executor threads, where aiofiles' calls
    and blocking reads hop to."""
    if name == "MainThread":
        return "consumer"
    if name == "aioload-engine":
        return "engine"
    if name.startswith(("aioload-io", "asyncio_", "ThreadPoolExecutor")):
        return "executor"
    return re.sub(r"[-_]?\d+$", "", name) or "other"


@dataclass
class Run:
    images: int
    seconds: float
    cpu_s: float
    threads_s: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def ms_per_image(self, cpu_s: float) -> float:
        return cpu_s / max(1, self.images) * 1e3


def measure(make_loader, limit: int | None = None) -> Run:
    """One epoch of a fresh loader (cut short after ``limit`` images): img/s and main-process
    CPU count the batches after the first one, as ``aioload._tools.bench.measure`` does."""
    gc.collect()
    loader = make_loader()
    images, start, cpu0, clocks0, probing = 0, None, 0.0, {}, 0.0
    latest: dict[int, tuple[str, float]] = {}
    try:
        for batch in loader:
            if start is None:
                start, cpu0, clocks0 = time.perf_counter(), time.process_time(), _thread_clocks()
            else:
                images += len(batch[0])
                # the loader's threads may stop with the epoch: read their clocks at every batch
                # (the reading's own CPU, tens of microseconds, is left out of the figures)
                probe0 = time.process_time()
                latest.update(_thread_clocks())
                probing += time.process_time() - probe0
            del batch
            if limit is not None and images >= limit:
                break
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0 - probing
        threads: dict[str, float] = collections.defaultdict(float)
        for ident, (name, now) in latest.items():
            before = clocks0.get(ident)
            threads[_group(name)] += now - (before[1] if before and before[0] == name else 0.0)
        threads["consumer"] = threads.get("consumer", 0.0) - probing
        # threads that ended between two readings, and work after the last batch's reading
        threads["unattributed"] = cpu - sum(threads.values())
    finally:
        _close(loader)
        del loader
        gc.collect()
    return Run(images, seconds, cpu, dict(threads))


def _close(loader) -> None:
    """Close an aioload loader (torch's has nothing to close)."""
    close = getattr(loader, "close", None)
    if close is not None:
        close()


def _progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


class Data:
    """The generated JPEGs, the transform, and the HTTP servers (one per latency)."""

    def __init__(self, images: int, latencies: list[float], crop: int = 224):
        self.root = make_image_folder(cache_dir() / f"overhead-bench-{images}", images=images, classes=8,
                                      seed=0, processes=os.cpu_count() or 1)
        if crop == 224:
            self.transform, self.decode_size = rrc_flip(), None
        else:  # a cheaper decode: JPEGs decoded at reduced scale, a smaller crop
            from torchvision.transforms import v2

            self.transform = v2.Compose([v2.RandomResizedCrop(crop, antialias=True), v2.RandomHorizontalFlip()])
            self.decode_size = (crop, crop)
        self.folder = aioload.ImageFolder(self.root, self.transform, decode_size=self.decode_size)
        self.samples = self.folder.samples
        self.paths = [p for p, _ in self.samples]
        self.labels = [t for _, t in self.samples]
        self.split = SplitJPEGs(self.samples, self.transform, self.decode_size)
        self.servers: dict[float, remote.Server] = {}
        try:
            for latency in latencies:
                self.servers[latency] = remote.Server(str(self.root), latency)
        except BaseException:
            self.close()
            raise

    def urls(self, latency: float) -> list[str]:
        base = self.servers[latency].base
        return [base + os.path.relpath(p, self.root) for p in self.paths]

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        self.servers.clear()


# ----------------------------------------------------------------------------- the split case


def split_rows(data: Data, args) -> dict[str, dict]:
    """name -> {"torch": factory, "aioload": factory, "limit": images or None}."""
    common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True)
    before = args.loader_reads  # also aioload with read_in_workers=False: reads on the engine's loop
    rows = {
        "split Dataset (aiofiles read)": {
            "torch": lambda: torch.utils.data.DataLoader(data.split, **common),
            "aioload": lambda: aioload.DataLoader(data.split, **common), "limit": None,
            "loader reads": (lambda: aioload.DataLoader(data.split, read_in_workers=False, **common)) if before else None},
        "ImageFolder (reads in workers)": {
            "torch": lambda: torch.utils.data.DataLoader(data.folder, **common),
            "aioload": lambda: aioload.DataLoader(data.folder, **common), "limit": None},
    }
    cut = dict(common, persistent_workers=True)
    for latency in data.servers:
        urls = data.urls(latency)
        files = aioload.ImageFiles(urls, data.labels, transform=data.transform)
        recipe = remote.BlockingGet(urls, data.labels, data.transform)
        rows[f"ImageFiles, HTTP {latency:g} ms"] = {
            "torch": lambda recipe=recipe: torch.utils.data.DataLoader(recipe, **cut),
            "aioload": lambda files=files: aioload.DataLoader(files, io_concurrency=args.io_concurrency, **cut),
            "limit": args.http_images,
            "loader reads": (lambda files=files: aioload.DataLoader(files, io_concurrency=args.io_concurrency,
                                                                    read_in_workers=False, **cut)) if before else None}
    return rows


def split_case(args) -> dict:
    data = Data(args.images, [float(x) for x in args.latencies.split(",") if x != ""])
    try:
        rows = split_rows(data, args)
        runs: dict[tuple[str, str], list[Run]] = collections.defaultdict(list)
        ceilings = []
        for r in range(args.rounds):
            names = list(rows) if r % 2 == 0 else list(rows)[::-1]
            for i, name in enumerate(names):
                if i == len(names) // 2:
                    ceilings.append(ceiling(data.paths, data.transform, args.workers))
                    _progress(f"round {r + 1}/{args.rounds} ceiling {ceilings[-1]:8.1f} img/s")
                order = ["torch", "aioload"] + (["loader reads"] if rows[name].get("loader reads") else [])
                for loader in (order if (r + i) % 2 == 0 else order[::-1]):
                    result = measure(rows[name][loader], rows[name]["limit"])
                    runs[name, loader].append(result)
                    _progress(f"round {r + 1}/{args.rounds} {name:<32} {loader:<8} {result.rate:8.1f} img/s "
                              f"main CPU {result.ms_per_image(result.cpu_s):.3f} ms/img")
    finally:
        data.close()
    ceil = median(ceilings)
    out = []
    for name in rows:
        a, t = runs[name, "aioload"], runs[name, "torch"]
        rate_a, rate_t = median(x.rate for x in a), median(x.rate for x in t)
        groups = sorted({g for x in a for g in x.threads_s})
        out.append({
            "row": name, "images_per_epoch": rows[name]["limit"] or args.images,
            "aioload_img_s": rate_a, "torch_img_s": rate_t, "ratio": rate_a / rate_t if rate_t else 0.0,
            "aioload_of_ceiling": rate_a / ceil if ceil else 0.0, "torch_of_ceiling": rate_t / ceil if ceil else 0.0,
            "aioload_cpu_ms_per_image": median(x.ms_per_image(x.cpu_s) for x in a),
            "torch_cpu_ms_per_image": median(x.ms_per_image(x.cpu_s) for x in t),
            "aioload_threads_ms_per_image": {g: median(x.ms_per_image(x.threads_s.get(g, 0.0)) for x in a)
                                             for g in groups},
        })
        if runs.get((name, "loader reads")):
            b = runs[name, "loader reads"]
            out[-1]["loader_reads_img_s"] = median(x.rate for x in b)
            out[-1]["loader_reads_cpu_ms_per_image"] = median(x.ms_per_image(x.cpu_s) for x in b)
    return {"case": "split", "ceiling_img_s": ceil, "ceilings": ceilings, "rows": out}


def print_split(result: dict, args) -> None:
    print(f"\n## Split protocol and built-in datasets: RandomResizedCrop(224) + flip, batch {args.batch_size}, "
          f"{args.workers} workers, {args.images} images ({args.http_images} per HTTP epoch), "
          f"{args.rounds} rounds\n")
    print(f"ceiling (no loader, {args.workers} processes): {result['ceiling_img_s']:.1f} img/s "
          f"(per round: {', '.join(f'{c:.0f}' for c in result['ceilings'])})\n")
    print(f"{'row':32} {'aioload':>8} {'torch':>8} {'ratio':>6} {'aio/ceil':>8} {'torch/ceil':>10} "
          f"{'aio CPU ms/img':>14} {'torch CPU ms/img':>16}")
    for row in result["rows"]:
        print(f"{row['row']:32} {row['aioload_img_s']:8.1f} {row['torch_img_s']:8.1f} {row['ratio']:5.2f}x "
              f"{row['aioload_of_ceiling']:8.0%} {row['torch_of_ceiling']:10.0%} "
              f"{row['aioload_cpu_ms_per_image']:14.3f} {row['torch_cpu_ms_per_image']:16.3f}")
    before = [row for row in result["rows"] if "loader_reads_img_s" in row]
    if before:
        print("\nthe same rows with read_in_workers=False (reads on the engine's loop in the training process):\n")
        print(f"{'row':32} {'img/s':>8} {'of torch':>8} {'of ceil':>8} {'main CPU ms/img':>15}")
        ceil = result["ceiling_img_s"]
        for row in before:
            rate = row["loader_reads_img_s"]
            print(f"{row['row']:32} {rate:8.1f} {rate / row['torch_img_s']:7.2f}x {rate / ceil if ceil else 0:8.0%} "
                  f"{row['loader_reads_cpu_ms_per_image']:15.3f}")
    print("\naioload's main-process CPU by thread, ms per image (medians):\n")
    groups = sorted({g for row in result["rows"] for g in row["aioload_threads_ms_per_image"]})
    print(f"{'row':32} " + " ".join(f"{g:>10}" for g in groups))
    for row in result["rows"]:
        per = row["aioload_threads_ms_per_image"]
        print(f"{row['row']:32} " + " ".join(f"{per.get(g, 0.0):10.3f}" for g in groups))
    print("\nimg/s after the first batch; ratio = aioload / torch (same dataset object, transform, workers; "
          "HTTP rows: torch runs remote.py's blocking-GET recipe); CPU = time.process_time of the loader's "
          "process, all threads")


# ----------------------------------------------------------------------------- the interference case


def python_work(n: int) -> int:
    """Pure-Python work that holds the GIL throughout, like a model's dispatch in eager mode."""
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def calibrate(ms: float) -> int:
    """The iterations of :func:`python_work` that take ``ms`` on this machine now (the
    fastest of several tries, so that a busy moment does not inflate the work)."""
    n, best = 20000, float("inf")
    for _ in range(7):
        start = time.perf_counter()
        python_work(n)
        best = min(best, time.perf_counter() - start)
    return max(1, int(n * ms / 1000 / best))


@dataclass
class Steps:
    steps: int
    seconds: float
    wait_s: float
    cpu_s: float

    @property
    def rate(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0


def train(batches, steps: int, warmup: int, work: int, gpu_s: float) -> Steps:
    """The training loop: per step, ``work`` iterations of Python holding the GIL, then the
    "GPU" (a sleep, the GIL released). Counts ``steps`` steps after ``warmup``."""
    it = iter(batches)
    wait = 0.0
    start = cpu0 = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            start, cpu0, wait = time.perf_counter(), time.process_time(), 0.0
        t0 = time.perf_counter()
        batch = next(it)
        wait += time.perf_counter() - t0
        python_work(work)
        time.sleep(gpu_s)
        del batch
    result = Steps(steps, time.perf_counter() - start, wait, time.process_time() - cpu0)
    del it
    return result


def _synthetic(batch: int):
    sample = (torch.zeros(batch, 3, 224, 224, dtype=torch.uint8), torch.zeros(batch, dtype=torch.int64))
    while True:
        yield sample


def interference_rows(data: Data, args) -> dict:
    # every epoch is cut short (the loop stops after warmup + steps), so persistent_workers=True
    common = dict(batch_size=args.step_batch, shuffle=True, num_workers=args.workers, drop_last=True,
                  persistent_workers=True)
    rows = {
        "synthetic batch": lambda: _synthetic(args.step_batch),
        "torch DataLoader, split Dataset": lambda: torch.utils.data.DataLoader(data.split, **common),
        "aioload, split Dataset": lambda: aioload.DataLoader(data.split, **common),
        **({"aioload, split, reads on the loader": lambda: aioload.DataLoader(data.split, read_in_workers=False,
                                                                             **common)}
           if args.loader_reads else {}),
        "torch DataLoader, ImageFolder": lambda: torch.utils.data.DataLoader(data.folder, **common),
        "aioload, ImageFolder": lambda: aioload.DataLoader(data.folder, **common),
    }
    for latency in data.servers:
        files = aioload.ImageFiles(data.urls(latency), data.labels, transform=data.transform,
                                   decode_size=data.decode_size)
        rows[f"aioload, ImageFiles HTTP {latency:g} ms"] = (
            lambda files=files: aioload.DataLoader(files, io_concurrency=args.io_concurrency, **common))
        if args.loader_reads:
            rows[f"aioload, HTTP {latency:g} ms, loader reads"] = (
                lambda files=files: aioload.DataLoader(files, io_concurrency=args.io_concurrency,
                                                       read_in_workers=False, **common))
    return rows


def interference_case(args) -> dict:
    data = Data(args.images, [float(args.latency)] if args.latency is not None else [], args.crop)
    needed = args.warmup + args.steps
    if needed * args.step_batch > args.images:
        raise SystemExit(f"--images {args.images} is too few for {needed} steps of {args.step_batch} images")
    work = calibrate(args.dispatch_ms)
    try:
        rows = interference_rows(data, args)
        runs: dict[str, list[Steps]] = collections.defaultdict(list)
        for r in range(args.rounds):
            for name in (list(rows) if r % 2 == 0 else list(rows)[::-1]):
                gc.collect()
                loader = rows[name]()
                try:
                    result = train(loader, args.steps, args.warmup, work, args.gpu_ms / 1000)
                finally:
                    _close(loader)
                    del loader
                    gc.collect()
                runs[name].append(result)
                _progress(f"round {r + 1}/{args.rounds} {name:<34} {result.rate:7.1f} steps/s "
                          f"wait {result.wait_s / result.steps * 1e3:6.2f} ms/step")
    finally:
        data.close()
    # each round's share against that round's synthetic rate, then the median of the shares
    synthetic = runs["synthetic batch"]
    out = []
    for name, results in runs.items():
        out.append({
            "row": name, "steps_s": median(x.rate for x in results),
            "of_synthetic": median(x.rate / s.rate for x, s in zip(results, synthetic)),
            "wait_ms_per_step": median(x.wait_s / x.steps * 1e3 for x in results),
            "cpu_ms_per_step": median(x.cpu_s / x.steps * 1e3 for x in results),
        })
    return {"case": "interference", "work_iterations": work, "rows": out}


def print_interference(result: dict, args) -> None:
    print(f"\n## A GIL-holding training loop: {args.dispatch_ms:g} ms of Python dispatch + {args.gpu_ms:g} ms "
          f"of \"GPU\" (sleep) per step, batches of {args.step_batch}, RandomResizedCrop({args.crop}) + flip"
          f"{' (reduced-scale decode)' if args.crop != 224 else ''}, {args.workers} workers, "
          f"{args.steps} steps after {args.warmup}, {args.rounds} rounds\n")
    print(f"{'loader':36} {'steps/s':>8} {'of synthetic':>12} {'wait ms/step':>12} {'main CPU ms/step':>16}")
    for row in result["rows"]:
        print(f"{row['row']:36} {row['steps_s']:8.1f} {row['of_synthetic']:12.1%} {row['wait_ms_per_step']:12.2f} "
              f"{row['cpu_ms_per_step']:16.2f}")
    print(f"\nof synthetic: each round's steps/s over the same round's synthetic-batch steps/s, median; "
          f"wait: time in next() per step (near 0 when the loader feeds faster than the loop consumes); "
          f"dispatch = {result['work_iterations']} iterations of python_work, calibrated at start")


# ----------------------------------------------------------------------------- profiling


def profile_case(args) -> dict:
    latency = float(args.latency) if args.row == "http" else None
    data = Data(args.images, [latency] if latency is not None else [])
    try:
        common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True,
                      persistent_workers=True)
        if args.row == "split":
            loader = aioload.DataLoader(data.split, **common)
        elif args.row == "folder":
            loader = aioload.DataLoader(data.folder, **common)
        else:
            files = aioload.ImageFiles(data.urls(latency), data.labels, transform=data.transform)
            loader = aioload.DataLoader(files, io_concurrency=args.io_concurrency, **common)
        spy = None
        images = 0
        work = calibrate(args.step_ms) if args.step_ms > 0 else 0
        try:
            for epoch in range(args.epochs):
                for batch in loader:
                    python_work(work)  # a training step's Python-side work, with --step-ms
                    if spy is None:
                        # the py-spy installed beside this Python (a venv's bin/), else the one on PATH
                        beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
                        command = [beside if os.path.exists(beside) else "py-spy", "record", "--pid", str(os.getpid()), "--rate", str(args.rate),
                                   "--format", "raw", "--threads", "--output", args.output]
                        if args.nonblocking:
                            command.append("--nonblocking")
                        if args.native:
                            command.append("--native")
                        if args.gil:
                            command.append("--gil")
                        spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                        time.sleep(1.0)  # py-spy attaches
                        start, cpu0 = time.perf_counter(), time.process_time()
                        spy_start = start
                    else:
                        images += len(batch[0])
                    del batch
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
        finally:
            if spy is not None:
                spy_seconds = time.perf_counter() - spy_start
                spy.send_signal(signal.SIGINT)
                _, err = spy.communicate(timeout=60)
                if spy.returncode not in (0, -signal.SIGINT) or not os.path.exists(args.output):
                    raise RuntimeError(f"py-spy failed ({spy.returncode}): {err}")
            loader.close()
    finally:
        data.close()
    summary = summarise(args.output, args.top)
    summary.update(case="profile", row=args.row, images=images, seconds=seconds,
                   cpu_ms_per_image=cpu / max(1, images) * 1e3, img_s=images / seconds,
                   recorded_s=spy_seconds, expected_samples=int(spy_seconds * args.rate))
    return summary


def _frame(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``."""
    m = re.match(r"(.*?) \((.*?)(?::\d+)?\)$", frame.strip())
    if not m:
        return frame.strip()
    return f"{m.group(1)} ({os.path.basename(m.group(2))})"


GROUPS = {  # inclusive: a sample counts once in a group when any frame of its stack matches
    "dataset read + aiofiles (open/read/close up to the executor hop)": ("aiofiles/", "SplitJPEGs.read"),
    "executor hand-off (run_in_executor, wrap_future, the pool's threads)": (
        "concurrent/futures/", "asyncio/futures.py", "base_futures.py", "run_in_executor"),
    "aiohttp client": ("aiohttp/",),
    "aioload read stage and storage (_reads, _storage, _http, _limiter)": (
        "aioload/_engine/reads.py", "aioload/_storage/storage.py", "aioload/_storage/http.py", "aioload/_engine/limiter.py"),
    "aioload worker hand-off (_pool, _wire: tasks out, replies in)": ("aioload/_workers/pool.py", "aioload/_workers/wire.py"),
    "aioload batch bookkeeping (_decode, _slots, _slotread, _slotwrite, _chunks)": (
        "aioload/_engine/decode.py", "aioload/_handoff/slots.py", "aioload/_handoff/layout.py", "aioload/_handoff/views.py",
        "aioload/_handoff/writers.py", "aioload/_handoff/chunks.py", "aioload/_handoff/tree.py"),
    "aioload ready queue and consumer (_ready, _iterator, _loader)": (
        "aioload/_engine/ready.py", "aioload/_front/iterator.py", "aioload/_front/epoch.py",
        "aioload/_front/loader.py"),
    "aioload statistics (_stats)": ("aioload/_observe/stats.py",),
}
LOOP_ONLY = "event loop's own C code (uvloop; no Python frame below Engine._run)"


def _role(frames: list[str]) -> str:
    if any("Engine._run" in x for x in frames):
        return "engine thread"
    if any("concurrent/futures/thread.py" in x for x in frames):
        return "executor threads"
    return "consumer (main thread)"


def summarise(path: str, top: int = 15) -> dict:
    """Shares of py-spy's raw samples (``frame;frame;... count`` per line, root first)."""
    total = 0
    roles: collections.Counter = collections.Counter()
    self_time: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    groups: collections.Counter = collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = [x for x in stack.split(";") if not x.startswith(("thread (", "process "))]
            python = [x for x in frames if ".py:" in x or ".py)" in x]
            total += n
            roles[_role(frames)] += n
            named = [_frame(x) for x in frames]
            if named:
                self_time[named[-1]] += n
            for name in set(named):
                inclusive[name] += n
            for group, needles in GROUPS.items():
                if any(any(needle in x for needle in needles) for x in frames):
                    groups[group] += n
            if python and "Engine._run" in python[-1]:
                groups[LOOP_ONLY] += n
    share = (lambda n: n / total if total else 0.0)
    return {
        "samples": total, "file": path,
        "threads": [(k, share(v)) for k, v in roles.most_common()],
        "self": [(k, share(v)) for k, v in self_time.most_common(top)],
        "inclusive": [(k, share(v)) for k, v in inclusive.most_common(top)],
        "groups": [(k, share(v)) for k, v in groups.most_common()],
    }


def print_profile(result: dict, args) -> None:
    print(f"\n## py-spy on the main process: aioload, row {result['row']}, {args.epochs} epochs of {args.images} "
          f"images, batch {args.batch_size}, {args.workers} workers, {args.rate} samples/s"
          f"{', --gil' if args.gil else ''}\n")
    print(f"{result['img_s']:.1f} img/s, main-process CPU {result['cpu_ms_per_image']:.3f} ms/img, "
          f"{result['samples']} samples in {result['file']} ({result['recorded_s']:.1f} s recorded: "
          f"{result['expected_samples']} samples at {args.rate}/s if every sample found a thread "
          f"{'holding the GIL' if args.gil else 'running'})\n")
    for title, key in (("threads (share of samples, by the stack's root)", "threads"), ("self time (leaf function)", "self"),
                       ("inclusive (function on the stack)", "inclusive"), ("groups (inclusive)", "groups")):
        print(f"{title}:")
        for name, value in result[key]:
            print(f"  {value:6.1%}  {name}")
        print()


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=["split", "interference", "profile"])
    parser.add_argument("--images", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--io-concurrency", type=lambda text: text if text == "auto" else int(text), default="auto",
                        help="aioload's reads in flight: a number, or auto (the loader's default)")
    parser.add_argument("--latencies", default="0,20,50", help="split: HTTP latencies in ms, comma-separated "
                                                               "('' for none)")
    parser.add_argument("--http-images", type=int, default=256, help="split: images per HTTP epoch")
    parser.add_argument("--latency", type=float, default=20.0,
                        help="interference and profile --row http: the HTTP latency in ms")
    parser.add_argument("--no-http", action="store_true", help="interference: leave out the HTTP row")
    parser.add_argument("--no-loader-reads", dest="loader_reads", action="store_false",
                        help="split and interference: leave out the rows of aioload with read_in_workers=False "
                             "(reads on the engine's loop in the training process, as before the reads moved "
                             "into the workers)")
    parser.add_argument("--dispatch-ms", type=float, default=2.0)
    parser.add_argument("--gpu-ms", type=float, default=8.0)
    parser.add_argument("--step-batch", type=int, default=4, help="interference: images per training step")
    parser.add_argument("--crop", type=int, default=224,
                        help="interference: RandomResizedCrop size; below 224 the JPEGs are also decoded at "
                             "reduced scale (decode_size), so that a busy machine's workers can keep ahead")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--row", choices=["split", "folder", "http"], default="split", help="profile: which row")
    parser.add_argument("--epochs", type=int, default=3, help="profile: epochs to record")
    parser.add_argument("--rate", type=int, default=200, help="profile: py-spy samples per second")
    parser.add_argument("--gil", action="store_true", help="profile: only samples holding the GIL")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="profile: pure-Python work per batch in the training loop (a step's dispatch)")
    parser.add_argument("--nonblocking", action="store_true", help="profile: py-spy does not pause the process")
    parser.add_argument("--native", action="store_true", help="profile: C frames too (py-spy --native)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("-o", "--output", default="overhead-profile.txt", help="profile: py-spy's raw output")
    parser.add_argument("--json", help="also write the rows and settings to this file")
    args = parser.parse_args(argv)
    if args.case == "interference" and args.no_http:
        args.latency = None
    command = "python benchmarks/overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"# aioload: what the loader costs the training process\n\nrun: {environment()}\ncommand: {command}")
    if args.case == "split":
        result = split_case(args)
        print_split(result, args)
    elif args.case == "interference":
        result = interference_case(args)
        print_interference(result, args)
    else:
        result = profile_case(args)
        print_profile(result, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": environment(), "command": command, "settings": vars(args), **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
