"""Train on images read over HTTP: a list of URLs, retries, and a cache for later epochs.

    python examples/remote_images.py                      # a few steps
    python examples/remote_images.py --steps 40 --cache disk --cache-dir ~/.cache/aioload-remote

The script serves the embedded synthetic image folder with Python's own HTTP server on
127.0.0.1 (in a child process, standing in for a remote web server or object store; it ends
with this script, even one killed with SIGKILL), then
trains a tiny model reading the images by URL. Reads are many requests in flight on an
event loop (each worker's own with ``--cache none``; with a cache, which counts its hits in
one process, the loader's) over pooled keep-alive connections; failed requests (connection errors, timeouts,
429, 5xx) are retried with backoff. With ``--cache memory`` (the default) the second epoch
reads from RAM; with ``--cache disk`` from a local directory that survives restarts (its
entries are keyed by URL, and this script's server takes a new port each run, so a rerun
reads over HTTP again; real URLs stay the same). After each epoch the script says how many
reads went over HTTP and how many came from the cache, with the average time of each kind.
The same code reads ``s3://`` or ``gs://`` URLs where fsspec and its backend are installed.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms import v2

import aioload


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=64, help="synthetic images to generate and serve (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="training steps in all (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="images per batch (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=64, help="training crop size, px (default: %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="decode processes (default: %(default)s)")
    p.add_argument("--cache", choices=["memory", "disk", "none"], default="memory",
                   help="where later epochs read the images from (default: %(default)s)")
    p.add_argument("--cache-dir", default=None, help="for --cache disk (default: a folder in the data cache)")
    return p.parse_args()


def _end_with_parent(parent: int):
    """For the server's ``preexec_fn``: on Linux, the kernel sends the child SIGTERM when this
    process dies, by SIGKILL too (``prctl(PR_SET_PDEATHSIG)``); elsewhere this does nothing
    and the server is only stopped by ``finally`` below."""

    def arm() -> None:
        if not sys.platform.startswith("linux"):
            return
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # died before the signal was armed
            os._exit(1)

    return arm


# Python's own http.server, with room for 128 connections waiting to be accepted: its default
# of 5 drops the connections that the loader opens at once beyond that, and each dropped one
# waits a second before the kernel tries again (reads of 10 ms would show a tail of 1 s).
SERVER = ("import functools, http.server as s, sys; s.ThreadingHTTPServer.request_queue_size = 128; "
          "handler = functools.partial(s.SimpleHTTPRequestHandler, directory=sys.argv[1]); "
          "server = s.ThreadingHTTPServer(('127.0.0.1', 0), handler); "
          "print('Serving HTTP on 127.0.0.1 port', server.server_address[1], flush=True); server.serve_forever()")


def start_server(root) -> tuple[subprocess.Popen, str]:
    """Python's ``http.server`` on 127.0.0.1, on a free port, serving ``root``; it exits
    when this process does."""
    proc = subprocess.Popen([sys.executable, "-u", "-c", SERVER, str(root)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, preexec_fn=_end_with_parent(os.getpid()))
    line = proc.stdout.readline()  # "Serving HTTP on 127.0.0.1 port 40123"
    if " port " not in line:
        proc.kill()
        raise RuntimeError(f"the HTTP server did not start: {line!r}")
    port = int(line.split(" port ")[1].split()[0])
    return proc, f"http://127.0.0.1:{port}/"


class Reads:
    """Read latencies told apart by where the bytes came from, one epoch at a time.

    ``loader.stats()`` times every ``Dataset.read``, cache hits and HTTP requests alike, so its
    overall median mixes the two. Between epochs (when no read is running) the cache's counters
    say which kind each epoch's reads were: an epoch whose reads all missed went over HTTP, one
    whose reads all hit came from the cache."""

    def __init__(self, cache):
        self.cache = cache
        self.kinds: dict[str, list[float]] = {}  # kind -> [reads, seconds]
        self._stats = None
        self._hits = self._misses = 0

    def epoch(self, stats: aioload.LoaderStats) -> str:
        window = stats.since(self._stats) if self._stats is not None else stats
        self._stats = stats
        hits = misses = 0
        if self.cache is not None:
            now = self.cache.stats()
            hits, misses = now.hits - self._hits, now.misses - self._misses
            self._hits, self._misses = now.hits, now.misses
        if self.cache is None or hits == 0:
            kind = "over HTTP"
        elif misses == 0:
            kind = "from the cache"
        else:
            kind = f"mixed ({misses} over HTTP, {hits} from the cache)"
        total = self.kinds.setdefault(kind, [0, 0.0])
        total[0] += window.reads
        total[1] += window.read_s
        return f"{window.reads} {kind}, {self._mean_ms(window.reads, window.read_s)}"

    def total(self) -> str:
        return "; ".join(f"{n} {kind}, {self._mean_ms(n, s)}" for kind, (n, s) in self.kinds.items())

    @staticmethod
    def _mean_ms(reads: int, seconds: float) -> str:
        return f"{seconds / reads * 1e3:.2f} ms each on average" if reads else "none"


def model_for(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes),
    )


def main() -> None:
    args = arguments()
    root = aioload.make_data(n=args.images, classes=4)
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.jpg"))
    server, base = start_server(root)
    try:
        urls = [base + f for f in files]  # any list of URLs: http(s)://, s3://, gs://, ...
        labels = [classes.index(f.split("/")[0]) for f in files]
        if args.cache == "memory":
            cache = aioload.MemoryCache(512 << 20)  # raw JPEG bytes, in this process
        elif args.cache == "disk":
            cache = aioload.DiskCache(args.cache_dir or root.parent / "remote-example-cache", 1 << 30)
        else:
            cache = None
        storage = aioload.Storage(
            retry=aioload.RetryPolicy(attempts=5, timeout=10.0, backoff=0.2),  # per request
            cache=cache,
            connections_per_host=32,
        )
        size = args.image_size
        crop = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])
        ds = aioload.ImageFiles(urls, labels, transform=crop, decode_size=(size, size), storage=storage)

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch.manual_seed(0)
        model = model_for(len(classes)).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        normalize = aioload.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]).to(device)
        step = epoch = 0
        reads = Reads(cache)
        with aioload.DataLoader(ds, batch_size=args.batch_size, shuffle=True, drop_last=True, seed=0,
                                num_workers=args.workers, io_concurrency=32,
                                device=device if device.type == "cuda" else None) as loader:
            print(f"{len(ds)} images at {base}, {len(loader)} batches per epoch, on {device.type}", flush=True)
            while step < args.steps:
                for images, targets in loader:
                    logits = model(normalize(images.to(device, non_blocking=True)))
                    loss = F.cross_entropy(logits, targets.to(device, non_blocking=True))
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    step += 1
                    print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
                    if step == args.steps:
                        break
                print(f"epoch {epoch} reads: {reads.epoch(loader.stats())}", flush=True)
                epoch += 1
        print(f"reads: {reads.total()}", flush=True)
        if cache is not None:
            c = cache.stats()
            print(f"cache: {c.hits} hits, {c.misses} misses, {c.entries} objects, {c.bytes / 2**20:.1f} MiB",
                  flush=True)
    finally:
        server.terminate()
        server.wait(30)
        server.stdout.close()


if __name__ == "__main__":
    main()
