"""Images behind HTTP with latency: aioload (ImageFiles over URLs) against torch's DataLoader.

A local HTTP server (``aioload._tools.benchserver``, the one ``aioload bench`` uses, in its own
process) answers every GET after L ms, as an object store or a remote web server would. Both loaders decode the same
JPEGs with the same function (``aioload.decode_image``) and the same transform
(``RandomResizedCrop(224)`` + flip from ``torchvision.transforms.v2``), with the same number
of worker processes:

* aioload: ``ImageFiles(urls)``; reads are ``io_concurrency`` requests in flight on the
  loader's event loop (one pooled keep-alive session), decode runs in the workers;
* torch: a Dataset whose ``__getitem__`` does a blocking GET (``urllib``) then decodes, so
  each worker has one request in flight;
* torch with 16 workers: the usual remedy (more processes), with its memory.

Printed per latency (0, 5, 20, 50 ms): img/s of each, aioload's ratio to each, the CPU
ceiling (the same decode+transform in a tight loop, one process per worker, no I/O) and
aioload's efficiency against it, and the total RSS (parent + worker processes, from /proc)
of aioload and of torch with 16 workers. Throughput counts images after the first batch.

Run (``--quick``: about a minute on 2 vCPUs; the full run: a few minutes)::

    .venv/bin/python benchmarks/remote.py --quick
    .venv/bin/python benchmarks/remote.py --images 512 --rounds 3

Numbers from a shared machine are noisy: compare the ratios within one run only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings


# -- the server: the bench's (one asyncio loop in a process of its own; ``Server(root, latency_ms)``,
# its ``base`` URL, ``close()``)
from aioload._tools.benchhttp import Server  # noqa: E402


# -- the loaders -----------------------------------------------------------------------------
def transform():
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()])


class BlockingGet:
    """The classic recipe: a map-style Dataset doing one blocking GET per sample."""

    def __init__(self, urls, labels, transform):
        self.urls, self.labels, self.transform = urls, labels, transform

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, index):
        import urllib.request

        import aioload

        with urllib.request.urlopen(self.urls[index], timeout=60) as resp:
            data = resp.read()
        return self.transform(aioload.decode_image(data)), self.labels[index]


def make_aioload(urls, labels, workers: int, batch: int):
    import aioload

    ds = aioload.ImageFiles(urls, labels, transform=transform())
    return aioload.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, io_concurrency=64)


def make_torch(urls, labels, workers: int, batch: int):
    import torch

    ds = BlockingGet(urls, labels, transform())
    return torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers)


# -- measuring -------------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _field_kb(path: str, name: str) -> int:
    try:
        with open(path) as f:
            return next(int(line.split()[1]) for line in f if line.startswith(name))
    except (OSError, StopIteration):
        return 0


def memory_mb(exclude: set[int]) -> tuple[float, float]:
    """(RSS, PSS) of this process and its children (the server excluded), in MiB. RSS counts
    pages shared by forked workers once per process; PSS splits them among the sharers."""
    pid = os.getpid()
    procs = [p for p in [pid, *_children(pid)] if p not in exclude]
    rss = sum(_field_kb(f"/proc/{p}/status", "VmRSS:") for p in procs)
    pss = sum(_field_kb(f"/proc/{p}/smaps_rollup", "Pss:") for p in procs)
    return rss / 1024, pss / 1024


def measure(make, exclude: set[int]) -> tuple[float, float, float]:
    """(img/s after the first batch, peak RSS, peak PSS in MiB) over one epoch."""
    loader = make()
    images, rss, pss, start = 0, 0.0, 0.0, None
    try:
        for i, (batch, _) in enumerate(loader):
            if start is None:
                start = time.perf_counter()
            else:
                images += len(batch)
            if i % 2 == 1:
                now = memory_mb(exclude)
                rss, pss = max(rss, now[0]), max(pss, now[1])
        seconds = time.perf_counter() - start
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    return images / seconds, rss, pss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="128 images, batches of 16, one round")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; medians are printed")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 2))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--latencies", default="0,5,20,50", help="milliseconds, comma-separated")
    args = parser.parse_args()
    if args.quick:
        args.images, args.rounds, args.batch_size = 128, 1, 16
    warnings.filterwarnings("ignore", message="This DataLoader will create 16 worker processes")

    import torch

    from aioload._tools.bench import ceiling
    from aioload._storage.cachedir import cache_dir
    from aioload._data.synth import make_image_folder

    root = make_image_folder(cache_dir() / f"remote-bench-{args.images}", images=args.images, classes=8, seed=0)
    names = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                   if f.endswith(".jpg"))
    labels = [int(n.split("/")[0].rsplit("_", 1)[1]) for n in names]
    w, b = args.workers, args.batch_size
    ceil = ceiling([os.path.join(root, n) for n in names], transform(), w)
    print(f"{len(names)} JPEGs (~400x350), batch {b}, {w} workers, {args.rounds} round(s); "
          f"CPU ceiling {ceil:.0f} img/s ({w} processes, decode+RandomResizedCrop(224)+flip, no I/O)")
    header = (f"{'latency':>8} {'aioload':>8} {'torch':>8} {'ratio':>6} {'torch16':>8} {'ratio16':>7} "
              f"{'eff.':>5} {'RSS aioload':>12} {'RSS torch16':>12} {'PSS aioload':>12} {'PSS torch16':>12}")
    print(header)
    for latency in [float(x) for x in args.latencies.split(",")]:
        server = Server(str(root), latency)
        urls = [server.base + n for n in names]
        makers = {
            "aioload": lambda: make_aioload(urls, labels, w, b),
            "torch": lambda: make_torch(urls, labels, w, b),
            "torch16": lambda: make_torch(urls, labels, 16, b),
        }
        results: dict[str, list] = {k: [] for k in makers}
        try:
            for r in range(args.rounds):
                for name in (makers if r % 2 == 0 else list(makers)[::-1]):
                    results[name].append(measure(makers[name], {server.proc.pid}))
        finally:
            server.close()
        rate = {k: statistics.median(x[0] for x in v) for k, v in results.items()}
        rss = {k: statistics.median(x[1] for x in v) for k, v in results.items()}
        pss = {k: statistics.median(x[2] for x in v) for k, v in results.items()}
        print(f"{latency:>6.0f}ms {rate['aioload']:>8.1f} {rate['torch']:>8.1f} {rate['aioload'] / rate['torch']:>5.1f}x "
              f"{rate['torch16']:>8.1f} {rate['aioload'] / rate['torch16']:>6.1f}x {rate['aioload'] / ceil:>5.0%} "
              f"{rss['aioload']:>8.0f} MiB {rss['torch16']:>8.0f} MiB {pss['aioload']:>8.0f} MiB {pss['torch16']:>8.0f} MiB",
              flush=True)
    print("img/s after the first batch; ratio = aioload / torch (same workers), ratio16 = aioload / torch "
          "with 16 workers; eff. = aioload / CPU ceiling; RSS and PSS: parent + workers, peak during the epoch")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
