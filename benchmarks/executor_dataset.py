"""What it costs to get the dataset to an executor's processes: the bytes sent, where it is
unpickled, and the epoch times, for a large dataset and many batches in flight.

A loader with ``executor=`` must give each executor process the pickled dataset (and
``collate_fn``) once. This measures, for each code tree given with ``--code`` (several: the
same run compares versions of aioload side by side, each in a process of its own with that
tree first on ``PYTHONPATH``) and each executor:

* ``process pool``: ``concurrent.futures.ProcessPoolExecutor(--processes)``;
* ``Dask``: a ``distributed.LocalCluster(n_workers=--processes, threads_per_worker=1,
  processes=True, host="127.0.0.1")`` and its ``client.get_executor()``;

with a dataset that pickles to ``--mib`` MiB (random bytes it holds; its samples are small),
``num_workers=--in-flight`` batches in flight, batches of ``--batch-size``, two epochs:

* ``sent MiB``: the dataset's bytes carried by ``executor.submit`` calls and by registered
  Dask plugins, counted in the trainer by wrapping both;
* ``unpickled``: how many times an executor process unpickled the dataset (each appends its
  pid to a file), and in how many processes;
* ``large graph``: Dask's "Sending large graph" warnings;
* ``epoch 1 s``, ``epoch 2 s``: wall time of each epoch (the first includes the sends).

Run (about a minute on 2 shared vCPUs)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/executor_dataset.py --code $PWD --code /path/to/older/tree

Timings on a shared machine are noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def payload_class():
    """The dataset, made in a module the executor's processes import by name (this one)."""
    import torch

    import aioload

    class Payload(aioload.Dataset):
        def __init__(self, n: int, mib: int, log: str):
            self.n, self.log = n, log
            self.blob = os.urandom(mib << 20)

        def __len__(self) -> int:
            return self.n

        async def read(self, index):
            return index

        def decode(self, index):
            return torch.full((4,), float(index))

        def __setstate__(self, state):
            self.__dict__.update(state)
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()}\n")

    Payload.__module__, Payload.__qualname__ = "executor_dataset", "Payload"
    return Payload


if __name__ != "__main__":  # imported by name (in an executor process, or by the child below)
    Payload = payload_class()


def measure(kind: str, args) -> dict:
    """One loader's two epochs on a fresh executor of ``kind``: the figures of the table."""
    import concurrent.futures
    import logging
    import pickle

    import aioload
    from executor_dataset import Payload

    log = tempfile.NamedTemporaryFile(prefix="aioload-unpickled-", delete=False).name
    sent: list[int] = []
    dataset = Payload(args.samples, args.mib, log)

    def counting(submit):
        def wrapped(fn, *a, **kw):
            if kw.get("blob") is not None:
                sent.append(len(kw["blob"]))
            return submit(fn, *a, **kw)
        return wrapped

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        if kind == "process pool":
            executor = concurrent.futures.ProcessPoolExecutor(args.processes)
            cluster = client = None
        else:
            import distributed

            cluster = distributed.LocalCluster(n_workers=args.processes, threads_per_worker=1, processes=True,
                                               host="127.0.0.1", dashboard_address=":0",
                                               silence_logs=logging.CRITICAL)
            client = distributed.Client(cluster)
            executor = client.get_executor()
            register = getattr(client, "register_plugin", None)
            if register is not None:
                def registering(plugin, *a, **kw):
                    sent.append(len(pickle.dumps(plugin)))
                    return register(plugin, *a, **kw)
                client.register_plugin = registering
        executor.submit = counting(executor.submit)
        times = []
        try:
            with aioload.DataLoader(dataset, batch_size=args.batch_size, executor=executor,
                                    num_workers=args.in_flight) as loader:
                for _ in range(2):
                    started = time.perf_counter()
                    assert sum(len(b) for b in loader) == args.samples
                    times.append(time.perf_counter() - started)
        finally:
            if client is not None:
                client.close()
                cluster.close()
            else:
                executor.shutdown()
    pids = open(log).read().split()
    os.unlink(log)
    large = sum("large graph" in str(w.message) for w in said)
    return {"sent_mib": sum(sent) / 2**20, "sends": len(sent), "unpickled": len(pids), "processes": len(set(pids)),
            "large_graph": large, "epoch1": times[0], "epoch2": times[1]}


def child(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kind")
    for name in ("mib", "processes", "in-flight", "batch-size", "samples"):
        p.add_argument(f"--{name}", type=int)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.kind, args)), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code", action="append", help="an aioload source tree to measure (repeatable; default: this one)")
    p.add_argument("--mib", type=int, default=50, help="the dataset's pickled size (default 50)")
    p.add_argument("--processes", type=int, default=2, help="executor processes (default 2)")
    p.add_argument("--in-flight", type=int, default=16, help="num_workers: batches in flight (default 16)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--samples", type=int, default=128)
    args = p.parse_args()
    codes = args.code or [ROOT]
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    rows = []
    for kind in ("process pool", "Dask"):
        for code in codes:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([code, HERE]))
            cmd = [sys.executable, os.path.join(HERE, "executor_dataset.py"), "--child", "--kind", kind,
                   "--mib", str(args.mib), "--processes", str(args.processes), "--in-flight", str(args.in_flight),
                   "--batch-size", str(args.batch_size), "--samples", str(args.samples)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise SystemExit(f"{kind} with {code} failed:\n{done.stdout}\n{done.stderr}")
            rows.append((kind, code, json.loads(done.stdout.strip().splitlines()[-1])))
    print(f"{'executor':<13} {'code':<28} {'sent MiB':>9} {'sends':>6} {'unpickled':>10} {'large graph':>12} "
          f"{'epoch 1 s':>10} {'epoch 2 s':>10}")
    for kind, code, r in rows:
        print(f"{kind:<13} {code[-28:]:<28} {r['sent_mib']:>9.0f} {r['sends']:>6} "
              f"{r['unpickled']:>4} in {r['processes']:<3} {r['large_graph']:>12} {r['epoch1']:>10.2f} "
              f"{r['epoch2']:>10.2f}")
    print(f"dataset {args.mib} MiB, {args.processes} executor processes, num_workers={args.in_flight} batches in "
          f"flight, batch {args.batch_size}, {args.samples} samples, 2 epochs")
    print(f"run: benchmarks/executor_dataset.py, started {started}; python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
    else:
        main()
