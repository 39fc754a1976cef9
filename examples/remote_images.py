"""Train on images read over HTTP: a list of URLs, retries, and a cache for later epochs.

    python examples/remote_images.py                      # a few steps
    python examples/remote_images.py --steps 40 --cache disk --cache-dir ~/.cache/aioload-remote

The script serves the embedded synthetic image folder with Python's own HTTP server on
127.0.0.1 (in a child process, standing in for a remote web server or object store; it ends
with this script, even one killed with SIGKILL), then
trains a tiny model reading the images by URL. Reads are many requests in flight on the
loader's event loop over pooled keep-alive connections; failed requests (connection errors,
timeouts, 429, 5xx) are retried with backoff. With ``--cache memory`` (the default) the
second epoch reads from RAM; with ``--cache disk`` from a local directory that survives
restarts. The same code reads ``s3://`` or ``gs://`` URLs where fsspec and its backend are
installed.
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
    p.add_argument("--images", type=int, default=64, help="synthetic images to generate and serve")
    p.add_argument("--steps", type=int, default=8, help="training steps in all")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="decode processes")
    p.add_argument("--cache", choices=["memory", "disk", "none"], default="memory")
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


def start_server(root) -> tuple[subprocess.Popen, str]:
    """``python -m http.server`` on 127.0.0.1, on a free port, serving ``root``; it exits
    when this process does."""
    proc = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1",
                             "--directory", str(root)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=_end_with_parent(os.getpid()))
    line = proc.stdout.readline()  # "Serving HTTP on 127.0.0.1 port 40123 (http://127.0.0.1:40123/) ..."
    if " port " not in line:
        proc.kill()
        raise RuntimeError(f"the HTTP server did not start: {line!r}")
    port = int(line.split(" port ")[1].split()[0])
    return proc, f"http://127.0.0.1:{port}/"


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
                epoch += 1
            stats = loader.stats()
        print(f"reads: {stats.reads}, p50 {stats.read_p50_ms:.1f} ms", flush=True)
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
