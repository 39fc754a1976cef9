"""The CPU a range request costs in uniform mode, in the processes that make it and in the
server that answers it: the read path alone, without decoding.

    python benchmarks/range_cpu.py                          # this checkout, 3 rounds
    python benchmarks/range_cpu.py --trees /tmp/base,.      # another checkout beside this one, interleaved
    python benchmarks/range_cpu.py --no-shuffle             # samples in order: a task's reads lie together
    python benchmarks/range_cpu.py --format parquet --images 4000 --scale 1.45   # a page a row: parquet.py's photos

With ``--format parquet`` the data is ``benchmarks/parquet.py``'s instead (``--images`` in
class-sorted files of ``--rows-per-file`` rows, a page per image; ``--scale`` as there) and the
dataset ``aioload.Parquet(files, columns=["image", "label"], decode=...)``: a row's read is its
image's page, fetched by range through the page index.

The data is ``benchmarks/shards.py``'s (``--images`` synthetic JPEGs in class-sorted shards of
``--shard-size``, made once in ``$AIOLOAD_CACHE``), served by ``aioload._tools.benchserver`` on
127.0.0.1 (each request answered after ``--latency`` ms, each body paced to ``--mb-per-s``).
Two measurements, each in a process of its own with the checkout's ``aioload`` first on the
path, so that checkouts are compared in one run, rounds interleaved:

* ``loader``: ``aioload.WebDataset(shards, decode=...)`` in uniform mode, in
  ``aioload.DataLoader`` with ``--workers`` workers and ``--io-concurrency``, one shuffled epoch;
  ``decode`` returns a constant, so what the workers do per sample is the read (the range
  request in their event loop's thread) and the members taken out of it (the tar headers
  parsed and checked, each member's bytes copied), plus the task's hand-off. Printed: the
  workers' CPU seconds (``/proc/<pid>/task/*/schedstat``, every thread) per sample.
* ``client``: ``dataset.read(i)`` of every sample of the same order, in batches of
  ``--batch-size``, ``--io-concurrency`` at once on one uvloop loop in a process of its own (no
  loader, no workers): the process's CPU seconds per request, the read path alone.

Beside each: the requests the server answered per sample read (every request of the child,
the few that set the dataset up included): below 1 where reads shared a request; and the
server's CPU per sample (its process's, from its ``/__cpu__``): on this machine it comes out of
the CPUs the loader has, as a real store's would not.
Medians over ``--rounds``; the machine's noise moves the absolute figures, compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` (all its threads), 0 once it is gone: each thread's time on a CPU
    from ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds: a small run uses a few clock ticks,
    which ``/proc/<pid>/stat`` counts in, so it read 0 or 10 ms for 56 samples), or where that
    is missing, user + system ticks from ``/proc/<pid>/stat``."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                    total += int(f.read().split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
    except (OSError, ValueError, IndexError):
        total = 0
    if total > 0:
        return total / 1e9
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def constant(sample) -> int:
    """The decode of the ``loader`` measurement: nothing beyond taking the members apart."""
    return 0


# ----------------------------------------------------------------------------- one measurement (a child)


def dataset(pattern: str, args):
    """The dataset of a measurement: the shards' (``pattern``: their brace pattern) or the Parquet
    files' (``pattern``: their URLs, as JSON)."""
    import aioload

    storage = aioload.Storage(connections_per_host=max(64, args.io_concurrency))
    if args.format == "parquet":
        return aioload.Parquet(json.loads(pattern), columns=["image", "label"], decode=constant, storage=storage)
    return aioload.WebDataset(pattern, decode=constant, storage=storage)


def _nbytes(raw) -> int:
    """The bytes a read returned: a shard member's, or a Parquet row's pages."""
    if isinstance(raw, tuple) and len(raw) == 3 and hasattr(raw[2], "pieces"):  # Parquet: (chunks, index, pages)
        return sum(piece.nbytes for piece in raw[2].pieces.values())
    return len(raw[0])


def measure_loader(pattern: str, args) -> dict:
    import aioload

    ds = dataset(pattern, args)
    loader = aioload.DataLoader(ds, batch_size=args.batch_size, shuffle=not args.no_shuffle, seed=1,
                                num_workers=args.workers, io_concurrency=args.io_concurrency, persistent_workers=True)
    try:
        it = iter(loader)
        next(it)  # the workers have started and read a batch: measured from here
        workers = _children(os.getpid())
        cpu0 = {pid: _cpu_seconds(pid) for pid in workers}
        main0, started, samples = time.process_time(), time.perf_counter(), 0
        for batch in it:
            samples += len(batch)
        wall = time.perf_counter() - started
        worker_s = sum(_cpu_seconds(pid) - cpu0[pid] for pid in workers)
        main_s = time.process_time() - main0
    finally:
        loader.close()
    return {"samples": samples, "worker_ms_per_sample": 1e3 * worker_s / samples,
            "main_ms_per_sample": 1e3 * main_s / samples, "samples_per_s": samples / wall}


def measure_client(pattern: str, args) -> dict:
    import torch
    import uvloop

    ds = dataset(pattern, args)
    order = (list(range(len(ds))) if args.no_shuffle
             else torch.randperm(len(ds), generator=torch.Generator().manual_seed(1)).tolist())
    batches = [order[i:i + args.batch_size] for i in range(0, len(order), args.batch_size)]

    async def main() -> dict:
        bound = asyncio.Semaphore(args.io_concurrency)

        async def one(index):
            async with bound:
                return await ds.read(index)

        async def batch(indices):
            return await asyncio.gather(*(one(i) for i in indices))

        await batch(batches[0])  # connections opened: measured from here
        cpu0, started, requests, nbytes = time.process_time(), time.perf_counter(), 0, 0
        ahead = max(1, args.io_concurrency // args.batch_size)  # batches read at once, as a loader would
        pending: list = []
        for indices in batches[1:]:
            pending.append(asyncio.ensure_future(batch(indices)))
            if len(pending) > ahead:
                done = await pending.pop(0)
                requests += len(done)
                nbytes += sum(map(_nbytes, done))
        for task in pending:
            done = await task
            requests += len(done)
            nbytes += sum(map(_nbytes, done))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - started
        return {"samples": requests, "client_ms_per_request": 1e3 * cpu / requests, "requests_per_s": requests / wall,
                "kb_per_request": nbytes / requests / 1e3}

    return uvloop.run(main())


# ----------------------------------------------------------------------------- the run (the parent)


def run_child(tree: str, what: str, pattern: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = [sys.executable, str(HERE), "--child", what, "--pattern", pattern, "--format", args.format,
           "--workers", str(args.workers),
           "--batch-size", str(args.batch_size), "--io-concurrency", str(args.io_concurrency)]
    if args.no_shuffle:
        cmd.append("--no-shuffle")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    if done.returncode != 0:
        raise SystemExit(f"the {what} measurement of {tree} failed:\n{done.stdout}{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args) -> dict:
    sys.path.insert(0, str(HERE.parent))
    from aioload._tools.benchhttp import Server

    if args.format == "parquet":
        import parquet

        data = parquet.Data(args.images, args.classes, args.rows_per_file, args.scale)
        root = data.folder
    else:
        from shards import Data

        data = Data(args.images, args.classes, args.shard_size)
        root = data.shards
    trees = args.trees or [str(HERE.parent.parent)]
    results: dict = {tree: {"loader": [], "client": []} for tree in trees}
    with_server = Server(root, args.latency, mb_per_s=args.mb_per_s)
    try:
        pattern = (json.dumps(data.urls(with_server.base)) if args.format == "parquet"
                   else data.pattern(with_server.base))
        for r in range(args.rounds):
            order = trees if r % 2 == 0 else trees[::-1]
            for tree in order:
                for what in args.measure:
                    before, cpu_before = with_server.requests(), with_server.cpu_seconds()
                    row = run_child(tree, what, pattern, args)
                    # every request of the child (its reads, and the few that set the dataset up), per sample read
                    row["requests_per_sample"] = (with_server.requests() - before) / row["samples"]
                    row["server_ms_per_sample"] = 1e3 * (with_server.cpu_seconds() - cpu_before) / row["samples"]
                    results[tree][what].append(row)
                    shown = ", ".join(f"{k} {v:.4g}" for k, v in row.items())
                    print(f"  round {r + 1}/{args.rounds} {tree} {what}: {shown}", file=sys.stderr, flush=True)
    finally:
        with_server.close()
    medians = {tree: {what: {key: statistics.median(row[key] for row in rows) for key in rows[0]}
                      for what, rows in kinds.items() if rows}
               for tree, kinds in results.items()}
    return {"trees": trees, "rounds": results, "medians": medians}


def print_result(result: dict, args) -> None:
    order = "in order" if args.no_shuffle else "shuffled"
    data = (f"Parquet files of {args.rows_per_file} rows, a page an image (x{args.scale:g} make-data's sides)"
            if args.format == "parquet" else f"shards of {args.shard_size}")
    print(f"\n## Range requests: {args.images} images in {data}, {order}, behind "
          f"{args.latency:g} ms, {args.workers} workers, {args.io_concurrency} in flight, "
          f"{args.rounds} rounds (medians)\n")
    print(f"{'checkout':40} {'worker ms/sample':>17} {'main ms/sample':>15} {'samples/s':>10} {'req/sample':>11} "
          f"{'server ms/sample':>17} {'client ms/read':>15} {'reads/s':>8} {'req/read':>9} {'KB/read':>8} "
          f"{'server ms/read':>15}")
    for tree in result["trees"]:
        m = result["medians"][tree]
        loader, client = m.get("loader", {}), m.get("client", {})

        def cell(d, key, fmt):
            return fmt.format(d[key]) if key in d else "-"
        print(f"{tree:40} {cell(loader, 'worker_ms_per_sample', '{:.4f}'):>17} "
              f"{cell(loader, 'main_ms_per_sample', '{:.4f}'):>15} {cell(loader, 'samples_per_s', '{:.0f}'):>10} "
              f"{cell(loader, 'requests_per_sample', '{:.3f}'):>11} {cell(loader, 'server_ms_per_sample', '{:.4f}'):>17} "
              f"{cell(client, 'client_ms_per_request', '{:.4f}'):>15} {cell(client, 'requests_per_s', '{:.0f}'):>8} "
              f"{cell(client, 'requests_per_sample', '{:.3f}'):>9} {cell(client, 'kb_per_request', '{:.1f}'):>8} "
              f"{cell(client, 'server_ms_per_sample', '{:.4f}'):>15}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1600)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--shard-size", type=int, default=40)
    parser.add_argument("--format", choices=["shards", "parquet"], default="shards",
                        help="the data: benchmarks/shards.py's shards (default) or benchmarks/parquet.py's files")
    parser.add_argument("--rows-per-file", type=int, default=256, help="with --format parquet (default: 256, as parquet.py)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="with --format parquet: each side of the photos that many times make-data's (default: 1)")
    parser.add_argument("--latency", type=float, default=20.0, help="the server's latency in ms (default: 20)")
    parser.add_argument("--mb-per-s", type=float, default=200.0, help="each response's pace (default: 200)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--io-concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-shuffle", action="store_true", help="read the samples in order (default: shuffled)")
    parser.add_argument("--measure", type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
                        default=["loader", "client"], help="loader, client or both (default)")
    parser.add_argument("--trees", type=lambda t: [x.strip() for x in t.split(",") if x.strip()], default=None,
                        help="checkouts to measure, comma-separated (default: this one)")
    parser.add_argument("--child-timeout", type=float, default=600.0)
    parser.add_argument("--json", help="also write the rounds and medians to this file")
    parser.add_argument("--child", choices=["loader", "client"], help=argparse.SUPPRESS)
    parser.add_argument("--pattern", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        measure = measure_loader if args.child == "loader" else measure_client
        print(json.dumps(measure(args.pattern, args)))
        return 0
    unknown = [m for m in args.measure if m not in ("loader", "client")]
    if unknown:
        parser.error(f"--measure takes loader and client, got {', '.join(unknown)}")
    result = run(args)
    print_result(result, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
