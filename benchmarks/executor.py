"""Batches made by an executor: the built-in pool against ProcessPoolExecutor, ThreadPoolExecutor
and a Dask cluster, locally and behind HTTP latency, on the same JPEGs with the same transform.

Every loader decodes the same synthetic ImageNet-like JPEGs (``aioload._data.synth``) with the
same transform (``RandomResizedCrop(224)`` + flip, ``aioload._tools.bench.rrc_flip``) and the same
number of worker processes or threads:

* ``built-in pool``: ``aioload.DataLoader(num_workers=W)``, shared-memory batch slots;
* ``ProcessPoolExecutor``: ``executor=ProcessPoolExecutor(W)`` (each process set to one torch
  thread, as the built-in workers are);
* ``ThreadPoolExecutor``: ``executor=ThreadPoolExecutor(W)``: decode in the trainer's process;
* ``Dask cluster``: ``executor=Client(address).get_executor()`` with a
  ``LocalCluster(n_workers=W, threads_per_worker=1, processes=True, host="127.0.0.1")``. The
  cluster runs in a process of its own (its scheduler too), as a cluster on other machines
  would: the trainer's process holds only the client;
* ``torch DataLoader`` (local case only): ``torch.utils.data.DataLoader(num_workers=W)`` on
  the same dataset, the reference ratio.

With an executor, ``num_workers`` is how many batches are in flight (``--in-flight``, 2 per
executor worker by default, as the built-in pool's ``prefetch_factor=2``).

Two cases: ``local`` (``aioload.ImageFolder`` on local files) and ``http 20ms``
(``aioload.ImageFiles`` over a local HTTP server on 127.0.0.1 that answers each GET after
``--latency-ms``; the server of ``benchmarks/remote.py``). With an executor the reads happen
where the decode runs (``read_on_executor=True``).

Columns: img/s (after the first batch), ratios to the built-in pool and to torch, the
trainer's CPU per batch (``time.process_time`` of this process over the epochs after the first
batch, per batch of ``--batch-size`` images: the engine, the client, result unpickling, and,
for threads, the decode itself), the bytes an executor sends back per batch
(``stats().executor_bytes / executor_tasks``) and a task's round trip p50
(``stats().task_p50_ms``). Rounds are interleaved and medians printed.

Run (the default: about 4 minutes on 2 shared vCPUs; ``--quick``: about a minute)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/executor.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/executor.py --quick

Numbers from a shared machine are noisy: compare the ratios within one run only.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import logging
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

LOADERS = ("built-in pool", "ProcessPoolExecutor", "ThreadPoolExecutor", "Dask cluster", "torch DataLoader")


# -- the cluster (runs as ``executor.py --cluster N``: a LocalCluster in a process of its own) --
def serve_cluster(workers: int) -> None:
    from distributed import LocalCluster

    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=":0", silence_logs=logging.CRITICAL) as cluster:
        print(f"address {cluster.scheduler_address}", flush=True)
        sys.stdin.read()  # until the benchmark closes stdin


class Cluster:
    """A Dask LocalCluster in a child process; ``executor`` is a client's ``get_executor()``."""

    def __init__(self, workers: int):
        from distributed import Client

        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--cluster", str(workers)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("address "):
            self.proc.kill()
            self.proc.wait(30)
            raise RuntimeError(f"the Dask cluster did not start: {line!r}")
        self.address = line.split()[1]
        self.client = Client(self.address, timeout=60)
        self.client.wait_for_workers(workers, timeout=120)
        self.executor = self.client.get_executor()

    def close(self) -> None:
        self.client.close()
        self.proc.stdin.close()
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:  # a cluster slow to stop on a loaded machine
            self.proc.terminate()
            self.proc.wait(30)
        self.proc.stdout.close()


def warm(seconds: float = 0.0) -> int:
    """Import what a task needs (run once in every executor process before measuring)."""
    import torchvision.transforms.v2  # noqa: F401

    import aioload.images  # noqa: F401

    time.sleep(seconds)
    return os.getpid()


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


# -- the loaders -----------------------------------------------------------------------------
def factories(dataset, executors: dict, args, with_torch: bool) -> dict:
    import torch

    import aioload

    common = dict(batch_size=args.batch_size, shuffle=True, drop_last=True)
    made = {"built-in pool": lambda: aioload.DataLoader(dataset, **common, num_workers=args.workers,
                                                        io_concurrency=64)}
    for name, executor in executors.items():
        made[name] = (lambda ex: lambda: aioload.DataLoader(dataset, **common, num_workers=args.in_flight,
                                                            executor=ex))(executor)
    if with_torch:
        made["torch DataLoader"] = lambda: torch.utils.data.DataLoader(dataset, **common, num_workers=args.workers)
    return made


def compare(made: dict, args, progress):
    """Interleaved rounds of ``args.epochs`` epochs per loader; a Comparison holding the runs."""
    from aioload._tools.bench import Comparison, measure

    comparison = Comparison(made)
    names = list(made)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            result = measure(name, made[name], epochs=args.epochs)
            comparison.runs.setdefault(name, []).append(result)
            progress(f"round {r + 1}/{args.rounds} {name:<20} {result.rate:8.1f} img/s  "
                     f"first batch {result.first_batch_s:6.2f} s  CPU {result.cpu_s:6.2f} s")
    return comparison


def _stage(name: str):
    """One image's work for ``--gil``: a function of the JPEG's bytes."""
    import io

    from aioload._tools.bench import rrc_flip
    from aioload.images import decode_image

    if name == "decode, torchvision":
        return decode_image
    if name == "decode, PIL":
        from PIL import Image

        return lambda data: Image.open(io.BytesIO(data)).convert("RGB").load()
    transform = rrc_flip()
    if name == "RRC+flip (v2)":
        return lambda image: transform(image)
    return lambda data: transform(decode_image(data))


GIL_STAGES = ("decode, torchvision", "decode, PIL", "RRC+flip (v2)", "decode + RRC+flip")


def _run_stage(share) -> int:
    name, items = share
    work = _stage(name)
    for item in items:
        work(item)
    return len(items)


def gil(paths: list[str], workers: int, repeat: int, rounds: int) -> str:
    """img/s of each stage in 1 thread, ``workers`` threads and ``workers`` processes (one torch
    thread each): how much of it runs outside the GIL."""
    import torch

    from aioload._tools.bench import ceiling_of, median
    from aioload.images import decode_image

    torch.set_num_threads(1)
    datas = []
    for path in paths:
        with open(path, "rb") as f:
            datas.append(f.read())
    datas = datas * repeat
    images = [decode_image(d) for d in datas]

    def threaded(name: str, items: list, n: int) -> float:
        shares = [(name, items[i::n]) for i in range(n)]
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            started = time.perf_counter()
            done = sum(pool.map(_run_stage, shares))
        return done / (time.perf_counter() - started)

    lines = [f"{'stage':<20} {'1 thread':>9} {f'{workers} threads':>10} {f'{workers} processes':>12} "
             f"{'threads/1':>9} {'threads/processes':>17}"]
    for name in GIL_STAGES:
        items = images if name == "RRC+flip (v2)" else datas
        one, many, procs = [], [], []
        for _ in range(rounds):
            one.append(threaded(name, items, 1))
            many.append(threaded(name, items, workers))
            procs.append(ceiling_of(_run_stage, [(name, items[i::workers]) for i in range(workers)]))
        one, many, procs = median(one), median(many), median(procs)
        lines.append(f"{name:<20} {one:>9.0f} {many:>10.0f} {procs:>12.0f} {many / one:>8.2f}x {many / procs:>16.2f}x")
    return "\n".join(lines)


def machine() -> str:
    model = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{platform.node()}: {os.cpu_count()} CPUs ({model or platform.machine()}), load average {load} at the start"


def rows(case: str, comparison, names: list[str], batch: int) -> list[tuple]:
    base = comparison.med("built-in pool", "rate")
    ref = comparison.med("torch DataLoader", "rate") if "torch DataLoader" in names else 0.0
    out = []
    for name in names:
        runs = comparison.runs[name]
        rate = comparison.med(name, "rate")
        cpu_ms = comparison.med(name, "cpu_ms_per_image") * batch
        stats = [r.stats for r in runs if r.stats is not None and getattr(r.stats, "executor_tasks", 0)]
        kb = p50 = None
        if stats:
            from aioload._tools.bench import median

            kb = median(s.executor_bytes / s.executor_tasks for s in stats) / 1024
            p50 = median(s.task_p50_ms for s in stats)
        out.append((case, name, rate, rate / base if base else 0.0, rate / ref if ref else None, cpu_ms, kb, p50))
    return out


def table(all_rows: list[tuple]) -> str:
    lines = [f"{'case':<10} {'loader':<20} {'img/s':>7} {'vs pool':>7} {'vs torch':>8} {'CPU ms/batch':>12} "
             f"{'KiB/batch':>9} {'task p50 ms':>11}"]
    for case, name, rate, vs_pool, vs_torch, cpu_ms, kb, p50 in all_rows:
        lines.append(f"{case:<10} {name:<20} {rate:>7.1f} {vs_pool:>6.2f}x "
                     f"{(f'{vs_torch:.2f}x' if vs_torch is not None else '-'):>8} {cpu_ms:>12.1f} "
                     f"{(f'{kb:.0f}' if kb is not None else '-'):>9} {(f'{p50:.0f}' if p50 is not None else '-'):>11}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 images, batches of 16, one round of one epoch")
    parser.add_argument("--images", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are printed")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per loader and round (counted after "
                        "the first batch)")
    parser.add_argument("--workers", type=int, default=2, help="processes or threads of every loader")
    parser.add_argument("--in-flight", type=int, default=0,
                        help="num_workers with an executor: batches in flight (default 2 per worker)")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="the HTTP server's delay per GET")
    parser.add_argument("--data", help="folder for the synthetic JPEGs (default: aioload's cache)")
    parser.add_argument("--gil", action="store_true", help="instead: img/s of decode and transform in 1 thread, "
                        "W threads and W processes (which stages release the GIL)")
    parser.add_argument("--cluster", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cluster:
        serve_cluster(args.cluster)
        return 0
    if args.quick:
        args.images, args.batch_size, args.rounds, args.epochs = 64, 16, 1, 1
    args.in_flight = args.in_flight or 2 * args.workers
    if args.images < 2 * args.batch_size:
        parser.error(f"--images {args.images} makes fewer than two batches of {args.batch_size}")
    # The executors' processes (the Dask cluster's too) import this checkout's aioload.
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    import remote  # benchmarks/remote.py: its HTTP server

    import aioload
    from aioload._tools.bench import environment, rrc_flip
    from aioload._storage.cachedir import cache_dir
    from aioload._data.synth import make_image_folder

    root = make_image_folder(args.data or cache_dir() / f"executor-bench-{args.images}", images=args.images,
                             classes=8, seed=0)
    names = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                   if f.endswith(".jpg"))
    labels = [int(n.split(os.sep)[0].rsplit("_", 1)[1]) for n in names]
    w = args.workers
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    if args.gil:
        print(machine(), flush=True)
        print(gil([os.path.join(root, n) for n in names], w, repeat=2 if args.quick else 4, rounds=args.rounds))
        print(f"img/s, medians of {args.rounds} round(s), {len(names)} JPEGs; one torch thread per thread or process")
        print(f"run: {' '.join([os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])])}, "
              f"started {started}")
        print(environment())
        return 0
    print(f"{len(names)} JPEGs (~400x350) in {root}, batch {args.batch_size}, {w} workers or threads, "
          f"{args.in_flight} batches in flight with an executor, {args.rounds} round(s) of {args.epochs} epoch(s), "
          f"HTTP latency {args.latency_ms:g} ms", flush=True)
    print(machine(), flush=True)

    t0 = time.perf_counter()

    def progress(line: str) -> None:
        print(f"  {time.perf_counter() - t0:6.1f} s  {line}", flush=True)

    all_rows = []
    with contextlib.ExitStack() as stack:
        processes = stack.enter_context(concurrent.futures.ProcessPoolExecutor(w, initializer=_one_thread))
        threads = stack.enter_context(concurrent.futures.ThreadPoolExecutor(w))
        # The pool's processes are forked now, before the Dask client starts its threads. What
        # a task imports is imported before the clock starts, as in a long run.
        list(concurrent.futures.as_completed([processes.submit(warm, 0.5) for _ in range(w)], timeout=300))
        cluster = Cluster(w)
        stack.callback(cluster.close)
        progress(f"Dask cluster at {cluster.address}")
        executors = {"ProcessPoolExecutor": processes, "ThreadPoolExecutor": threads, "Dask cluster": cluster.executor}
        cluster.client.run(warm)
        progress("executors ready")

        local = aioload.ImageFolder(str(root), transform=rrc_flip())
        made = factories(local, executors, args, with_torch=True)
        comparison = compare(made, args, progress)
        all_rows += rows("local", comparison, list(made), args.batch_size)

        server = remote.Server(str(root), args.latency_ms)
        stack.callback(server.close)
        case = f"http {args.latency_ms:g}ms"
        remote_ds = aioload.ImageFiles([server.base + n for n in names], labels, transform=rrc_flip())
        made = factories(remote_ds, executors, args, with_torch=False)
        comparison = compare(made, args, progress)
        all_rows += rows(case, comparison, list(made), args.batch_size)

    print()
    print(table(all_rows))
    print(f"img/s after the first batch, medians of {args.rounds} interleaved round(s); vs pool = / built-in pool, "
          f"vs torch = / torch DataLoader ({w} workers, local files); CPU ms/batch = the trainer process's CPU "
          f"time per batch of {args.batch_size}; KiB/batch = tensors an executor sends back per batch; "
          "task p50 = a batch's round trip on the executor")
    print(f"run: {' '.join([os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])])}, "
          f"started {started}")
    print(environment())
    return 0


if __name__ == "__main__":
    sys.exit(main())
