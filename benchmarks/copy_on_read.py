"""Copy-on-read, side by side: a dataset holding N path strings (a list, a list of dicts, or an
aioload.StringList), W fork workers, one shuffled epoch of aioload and of torch's DataLoader.
Prints each worker's private memory gained over the epoch (USS, /proc/<pid>/smaps_rollup,
read just before the epoch ends), whether aioload warned (and what), and what aioload's
per-epoch memory measurement cost in the training process.

    flock /tmp/aioload-bench.lock python benchmarks/copy_on_read.py --paths 3000000 --workers 4

Memory: the parent holds the strings once (about 100 bytes each); each worker of each loader
copies up to the same again. The script refuses sizes whose estimate passes --limit-gb.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch

import aioload
from aioload._observe import memory as _memory


class Paths(torch.utils.data.Dataset):
    def __init__(self, n: int, kind: str):
        paths = (f"/data/train/class-{i % 1000:04d}/image-{i:08d}.jpg" for i in range(n))
        if kind == "list":
            self.paths = list(paths)
        elif kind == "dicts":
            self.paths = [{"path": p, "label": i % 1000} for i, p in enumerate(paths)]
        else:
            self.paths = aioload.StringList(paths)
        self.pids: set = set()

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        return len(self.paths[index]) if not isinstance(self.paths[index], dict) else len(self.paths[index]["path"])


class Watch:
    """Each worker's private memory at its first batch and just before the epoch ends (the
    last batch still to take)."""

    def __init__(self, pids):
        self.pids = pids
        self.base = {}

    def start(self):
        self.base = {pid: _memory.rollup(pid).private for pid in self.pids()}

    def grown(self):
        return [(_memory.rollup(pid).private - self.base.get(pid, 0)) / 1e6 for pid in self.pids()]


def epoch(loader, pids) -> list[float]:
    """One epoch; each worker's growth from its first batch to just before the last one."""
    watch = Watch(pids)
    n = len(loader)
    grown = []
    for i, _ in enumerate(loader):
        if i == 0:
            watch.start()
        if i == n - 1:
            grown = watch.grown()
    return grown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--paths", type=int, default=3_000_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--kind", choices=["list", "dicts", "stringlist"], default="list")
    parser.add_argument("--limit-gb", type=float, default=7.0)
    args = parser.parse_args()
    per_item = {"list": 100, "dicts": 400, "stringlist": 60}[args.kind]
    estimate = args.paths * per_item * (1 + args.workers) / 1e9
    if estimate > args.limit_gb:
        raise SystemExit(f"estimated {estimate:.1f} GB, past --limit-gb {args.limit_gb}: use fewer paths")
    ds = Paths(args.paths, args.kind)
    batch = 1000
    print(f"{args.paths:,} paths as {args.kind}, {args.workers} fork workers, batch {batch}, "
          f"load average {os.getloadavg()[0]:.2f}")

    # aioload, with the loader's own measurement timed
    spent = []
    close, open_ = _memory.MemoryWindow.close, _memory.MemoryWindow.open

    def timed(fn):
        def wrapper(self):
            t = time.perf_counter()
            try:
                return fn(self)
            finally:
                spent.append(time.perf_counter() - t)
        return wrapper

    _memory.MemoryWindow.close, _memory.MemoryWindow.open = timed(close), timed(open_)
    loader = aioload.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=args.workers,
                                multiprocessing_context="fork")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = time.perf_counter()
        ours = epoch(loader, lambda: [p.pid for p in loader._res.pool.procs])
        ours_s = time.perf_counter() - t
    stats = loader.stats()
    loader.close()
    _memory.MemoryWindow.close, _memory.MemoryWindow.open = close, open_
    named = [str(w.message).split(". Every")[0] for w in caught if issubclass(w.category, aioload.CopyOnReadWarning)]

    import multiprocessing

    torch_loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=args.workers,
                                               multiprocessing_context="fork", persistent_workers=True)
    warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
    t = time.perf_counter()
    theirs = epoch(torch_loader, lambda: sorted(p.pid for p in multiprocessing.active_children()))
    theirs_s = time.perf_counter() - t
    del torch_loader

    print(f"aioload: workers gained {', '.join(f'{g:.0f}' for g in ours)} MB over the epoch ({ours_s:.1f} s)")
    print(f"torch:   workers gained {', '.join(f'{g:.0f}' for g in theirs)} MB over the epoch ({theirs_s:.1f} s)")
    print(f"aioload/torch gain: {sum(ours) / max(1e-9, sum(theirs)):.2f}x")
    print(f"warned: {named[0] if named else 'no'}")
    print(f"stats: copy_on_read={stats.copy_on_read!r}, worker_growth_bytes={[round(g / 1e6) for g in stats.worker_growth_bytes]} MB")
    print(f"the loader's own measurement (open at the first batch + close at the end): "
          f"{' + '.join(f'{s * 1e3:.1f}' for s in spent)} ms in the training process")


if __name__ == "__main__":
    main()
