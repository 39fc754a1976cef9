"""Worker start-up, side by side with torch's DataLoader: fork, spawn and forkserver.

A map-style dataset holding a large structure of Python objects (a list of ints and a dict of
str keys: 0.25 GB is 2.5M ints and 1M keys), ``num_workers`` workers (16 by default), persistent.
Each cell (loader x start method x dataset size) runs in a fresh interpreter, in a process group
of its own, watched from here: past ``--limit-gb`` of memory its whole group is killed and the
cell reads "killed past N GB" (torch's 1 GB ``spawn`` case needs about 19 GB).

Measured per cell:

* ``first``: seconds from ``iter(loader)`` to the first batch (workers started, dataset sent);
* ``epoch 2``: seconds to the second epoch's first batch (persistent workers: no start);
* ``start GB``: the machine's memory for the start, as the sum of PSS (proportional set size:
  each shared page divided among the processes that map it) over every process of the cell,
  workers, template and forkserver included, at the first batch, less the training process's
  own PSS before ``iter()``;
* ``peak GB``: the highest sum of PSS over the cell's processes that the watchdog saw;
* ``worker PSS MB``: each worker's PSS after the second epoch (median; what a worker costs once
  its dataset's pages are shared);
* for aioload, ``worker_start`` (``LoaderStats``).

``--nothing-copied`` measures a worker's fixed cost instead: a dataset whose storage is one
numpy array (nothing is copied on read), so that a worker's PSS is what the worker itself costs.

``--unfrozen`` adds a row per aioload cell whose workers call ``gc.unfreeze()`` first: the
template's ``gc.freeze()`` measured, as the garbage collector's writes to the dataset's pages
once each worker runs a full collection (every worker runs one before its first sample).

    flock /tmp/aioload-bench.lock python benchmarks/startup.py             # the full table
    flock /tmp/aioload-bench.lock python benchmarks/startup.py --workers 4 --sizes 0.05
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import time

from aioload._tools.bench import _pss_kb as pss_kb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1 << 30


# -- the cell: runs in a fresh interpreter --------------------------------------------------------

class Objects:
    """A map-style dataset over a large structure of Python objects, ``gb`` GB of it (a torch
    ``Dataset`` is a plain class: no base needed for either loader)."""

    def __init__(self, gb: float, n: int):
        self.ints = list(range(int(10_000_000 * gb)))
        self.keys = {f"key-{i:012d}": i for i in range(int(4_000_000 * gb))}
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        import torch

        if not getattr(self, "collected", False):  # a full collection in each worker, once
            self.collected = True
            gc.collect()
        return torch.tensor(index)


class Storage:
    """A map-style dataset whose storage is one numpy array: nothing is copied on read."""

    def __init__(self, gb: float, n: int):
        import numpy as np

        self.data = np.arange(int(gb * GB) // 8, dtype=np.int64)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        import torch

        return torch.tensor(int(self.data[index]))


def unfreeze(worker_id: int) -> None:
    gc.unfreeze()


def group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry))
    return found


def group_pss_gb(pgid: int) -> float:
    return sum(pss_kb(pid) for pid in group(pgid)) / (1 << 20)


def cell(loader_name: str, method: str, gb: float, workers: int, storage: bool, unfrozen: bool) -> dict:
    import torch

    import aioload

    n = workers * 16
    dataset = (Storage if storage else Objects)(gb, n)
    gc.collect()
    own = pss_kb(os.getpid()) / (1 << 20)
    kwargs = dict(batch_size=1, num_workers=workers, multiprocessing_context=method, persistent_workers=True)
    if unfrozen:
        kwargs["worker_init_fn"] = unfreeze
    cls = aioload.DataLoader if loader_name == "aioload" else torch.utils.data.DataLoader
    loader = cls(dataset, **kwargs)
    started = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - started
    start_gb = group_pss_gb(os.getpgid(0)) - own
    for _ in it:
        pass
    started = time.perf_counter()
    it = iter(loader)
    next(it)
    second = time.perf_counter() - started
    for _ in it:
        pass
    if loader_name == "aioload":
        pids = [proc.pid for proc in loader._res.pool.procs]
        how = getattr(loader.stats(), "worker_start", "")  # an older aioload, to compare, has none
    else:
        pids = [proc.pid for proc in it._workers]
        how = ""
    per_worker = sorted(pss_kb(pid) / 1024 for pid in pids)
    result = dict(first_s=first, second_s=second, start_gb=start_gb, worker_pss_mb=per_worker[len(per_worker) // 2],
                  trainer_gb=own, worker_start=how)
    if loader_name == "aioload":
        loader.close()
    else:
        del it, loader
    return result


# -- the table: this process runs each cell and watches its memory ------------------------------

def run_cell(args, loader_name: str, method: str, gb: float, unfrozen: bool = False) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--cell", loader_name, method, str(gb),
               "--workers", str(args.workers)]
    if args.nothing_copied:
        command.append("--nothing-copied")
    if unfrozen:
        command.append("--unfrozen")
    # an aioload given on PYTHONPATH (an older checkout, to compare) comes before this one
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), ROOT) if p))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    peak, verdict = 0.0, None
    deadline = time.monotonic() + args.timeout
    while proc.poll() is None:
        peak = max(peak, group_pss_gb(proc.pid))
        if peak > args.limit_gb:
            verdict = f"killed past {args.limit_gb:g} GB"
        elif time.monotonic() > deadline:
            verdict = f"no batch within {args.timeout:g} s"
        if verdict:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.25)
    out, err = proc.communicate()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever the cell left (a forkserver, a tracker)
    except ProcessLookupError:
        pass
    if verdict is None and proc.returncode != 0:
        verdict = f"failed ({proc.returncode}): {err.strip().splitlines()[-1] if err.strip() else ''}"
    if verdict:
        return dict(verdict=verdict, peak_gb=peak)
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_gb"] = peak
    return result


def row(name: str, method: str, gb: float, r: dict) -> str:
    if "verdict" in r:
        return f"| {name} | {method} | {gb:g} | {r['verdict']} | | | {r['peak_gb']:.1f} | | |"
    return (f"| {name} | {method} | {gb:g} | {r['first_s']:.1f} | {r['second_s']:.2f} | {r['start_gb']:.2f} | "
            f"{r['peak_gb']:.1f} | {r['worker_pss_mb']:.0f} | {r['worker_start']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--sizes", default="0.25,1", help="dataset sizes in GB, comma-separated")
    parser.add_argument("--methods", default="fork,spawn,forkserver")
    parser.add_argument("--loaders", default="torch,aioload")
    parser.add_argument("--limit-gb", type=float, default=10.0, help="kill a cell whose processes pass this")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds a cell may take")
    parser.add_argument("--nothing-copied", action="store_true", help="a numpy-backed dataset: a worker's fixed cost")
    parser.add_argument("--unfrozen", action="store_true", help="add aioload rows whose workers undo gc.freeze()")
    parser.add_argument("--json", help="write every cell's figures here")
    parser.add_argument("--cell", nargs=3, metavar=("LOADER", "METHOD", "GB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        loader_name, method, gb = args.cell
        print(json.dumps(cell(loader_name, method, float(gb), args.workers, args.nothing_copied, args.unfrozen)))
        return
    print(f"{args.workers} workers; load average {os.getloadavg()[0]:.2f}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    print("| loader | start method | dataset GB | first batch s | epoch 2 first batch s | start GB (PSS) | "
          "peak GB (PSS) | worker PSS MB | how workers started |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    results = []
    for gb in (float(s) for s in args.sizes.split(",")):
        for method in args.methods.split(","):
            for name in args.loaders.split(","):
                variants = [False] + ([True] if args.unfrozen and name == "aioload" and method != "fork" else [])
                for unfrozen in variants:
                    r = run_cell(args, name, method, gb, unfrozen)
                    label = name + (" (gc.unfreeze)" if unfrozen else "")
                    results.append(dict(loader=label, method=method, gb=gb, **r))
                    print(row(label, method, gb, r), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
