"""Loaders compared locally and behind HTTP latency, as ``benchmarks/shards.py`` and
``benchmarks/parquet.py`` do: a latency server per scenario, rounds interleaved over the
scenarios and their rows with the local ceiling measured in each, each row's medians, the
table, the distinct classes per batch against a uniform shuffle's, and how the run was made.

A script gives what differs: its data, its rows per scenario (``name -> factory(epoch)``) and
the fields only its rows have."""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from aioload._tools import bench
from aioload._tools.bench import Run, ceiling, environment, measure, median, rrc_flip
from aioload._tools.benchhttp import Server
from aioload.images import decode_image

COLUMNS = [("img/s", "img_s", "{:.0f}"), ("% ceiling", "of_local_ceiling", "{:.0%}"),
           ("server CPUs", "server_cpus", "{:.2f}"), ("% ceiling left", "of_ceiling_left", "{:.0%}"),
           ("main CPU ms/img", "cpu_ms_per_image", "{:.3f}"), ("req/sample", "requests_per_sample", "{:.3f}"),
           ("peak MB (PSS)", "memory_mb", "{:.0f}"), ("disk MB", "disk_mb", "{:.1f}"),
           ("classes/batch", "classes_per_batch", "{:.2f}")]
"""The table's columns: title, the row's key, its format. ``server CPUs``: the CPUs the latency
server took from the loaders over the measured interval (it shares the machine with them);
``% ceiling left``: the rate as a share of the ceiling scaled to the CPUs left to the loaders,
so what the loader itself loses."""

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


_TRANSFORM = None


def decode_pair(jpg, cls):
    """The one decode every row runs: JPEG bytes -> RandomResizedCrop(224) + flip, and the class."""
    global _TRANSFORM
    if _TRANSFORM is None:
        _TRANSFORM = rrc_flip()
    return _TRANSFORM(decode_image(jpg)), int(cls)


def aioload_loader(ds, args, epoch: int):
    """aioload's loader of a row: a shuffle seeded by the epoch, ``args``' batches, workers and
    reads at once. The loader plans the epoch from the dataset's order (``epoch_order``) and
    tells it what it will read (``will_read``), as for any dataset that computes its order."""
    from aioload import DataLoader

    return DataLoader(ds, shuffle=True, seed=epoch, batch_size=args.batch_size, num_workers=args.workers,
                      drop_last=True, io_concurrency=args.io_concurrency)


class Recorded:
    """A loader whose batches are counted after the first ``skip`` (the read-ahead buffers)
    and whose labels are kept: the distinct classes in each full batch."""

    def __init__(self, loader, skip: int, batch_size: int):
        self.loader, self.skip, self.batch_size = loader, skip, batch_size
        self.classes: list[int] = []

    def __iter__(self):
        for i, (images, labels) in enumerate(self.loader):
            if len(labels) == self.batch_size:
                self.classes.append(len(set(labels.tolist())))
            if i >= self.skip:
                yield images, labels
            del images

    def stats(self):
        stats = getattr(self.loader, "stats", None)
        return stats() if stats is not None else None

    def close(self) -> None:
        bench.close_loader(self.loader)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def uniform_classes(labels: list[int], batch: int, trials: int = 20) -> float:
    """Distinct classes per full batch of a uniform shuffle of ``labels`` (the reference)."""
    g = torch.Generator().manual_seed(0)
    counts = []
    tensor = torch.tensor(labels)
    for _ in range(trials):
        order = tensor[torch.randperm(len(labels), generator=g)]
        for i in range(0, len(order) - batch + 1, batch):
            counts.append(len(set(order[i:i + batch].tolist())))
    return statistics.fmean(counts)


def progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def check_images(args) -> None:
    if args.images < (args.skip_batches + 2) * args.batch_size:
        raise SystemExit(f"--images {args.images}: at least {args.skip_batches + 2} batches of {args.batch_size} "
                         "are needed")


def run_scenarios(args, served: Path, rows_for: Callable[[str, str | None], dict], paths: list[str],
                  extra: Callable[[str, Run], dict], width: int) -> tuple[list[dict], list[float]]:
    """Each row of each scenario (``local`` and one per ``args.latencies``, the folder
    ``served`` behind a latency server) in ``args.rounds`` interleaved rounds, the local ceiling
    of ``paths`` measured at the start of each. ``rows_for(scenario, base)`` gives the rows
    (``base``: the server's URL, None locally); ``extra(name, run)`` a row's own fields.
    Returns the rows with each field's median over the rounds, and the ceilings."""
    scenarios = (["local"] if not args.no_local else []) + [f"{x:g} ms" for x in args.latencies]
    servers: dict[str, Server] = {}
    results: dict[tuple[str, str], list] = collections.defaultdict(list)
    ceilings: list[float] = []
    try:
        for latency in args.latencies:
            server = Server(served, latency, mb_per_s=args.mb_per_s)
            servers[f"{latency:g} ms"] = server
            bench.EXCLUDED_PIDS.add(server.proc.pid)
        rows = {s: rows_for(s, servers[s].base if s in servers else None) for s in scenarios}
        transform = rrc_flip()
        per_epoch = args.images // args.batch_size * args.batch_size  # the samples an epoch reads (drop_last)
        for r in range(args.rounds):
            ceilings.append(ceiling(paths, transform, args.workers))
            progress(f"round {r + 1}/{args.rounds}: local ceiling {ceilings[-1]:.1f} img/s")
            for scenario in (scenarios if r % 2 == 0 else scenarios[::-1]):
                names = list(rows[scenario])
                for name in (names if r % 2 == 0 else names[::-1]):
                    server = servers.get(scenario)
                    before = server.requests() if server is not None else 0
                    box = {}

                    def make(name=name, scenario=scenario, box=box, r=r):
                        box["loader"] = Recorded(rows[scenario][name](r), args.skip_batches, args.batch_size)
                        return box["loader"]

                    result = measure(name, make, side_clock=server.cpu_seconds if server is not None else None)
                    asked = server.requests() - before if server is not None else 0
                    server_cpus = result.side_s / result.seconds if result.side_s is not None and result.seconds else None
                    left = max(0.0, CPUS - server_cpus) / CPUS if server_cpus is not None else None
                    loader = box["loader"]
                    results[scenario, name].append({
                        "img_s": result.rate, "of_local_ceiling": result.rate / ceilings[-1] if ceilings[-1] else 0.0,
                        "server_cpus": server_cpus,
                        "of_ceiling_left": result.rate / (ceilings[-1] * left) if left and ceilings[-1] else None,
                        "cpu_ms_per_image": result.cpu_ms_per_image, "memory_mb": result.memory_mb,
                        "classes_per_batch": statistics.fmean(loader.classes or [0]),
                        "requests_per_sample": asked / per_epoch if server is not None else 0.0,
                        **extra(name, result),
                    })
                    served = f", server {server_cpus:.2f} CPUs" if server_cpus is not None else ""
                    progress(f"round {r + 1}/{args.rounds} {scenario:>6} {name:<{width}} {result.rate:8.1f} img/s, "
                             f"main CPU {result.cpu_ms_per_image:.3f} ms/img, classes/batch "
                             f"{results[scenario, name][-1]['classes_per_batch']:.2f}{served}")
    finally:
        for server in servers.values():
            bench.EXCLUDED_PIDS.discard(server.proc.pid)
            server.close()
    out = []
    for scenario in scenarios:
        for name in rows[scenario]:
            runs = results[scenario, name]
            row = {"scenario": scenario, "row": name, "rounds_img_s": [x["img_s"] for x in runs]}
            for key in runs[0]:
                values = [x[key] for x in runs if x[key] is not None]
                row[key] = median(values) if values else None
            out.append(row)
    return out, ceilings


def print_table(result: dict, args, columns: list, width: int) -> None:
    """The rows under ``columns`` (a field that is None shows ``-``), then the local ceiling
    and a uniform shuffle's classes per batch."""
    print(f"{'scenario':>8}  {'row':{width}}" + "".join(f" {title:>15}" for title, _, _ in columns))
    for row in result["rows"]:
        cells = "".join(f" {fmt.format(row[key]) if row[key] is not None else '-':>15}" for _, key, fmt in columns)
        print(f"{row['scenario']:>8}  {row['row']:{width}}{cells}")
    print(f"\nlocal ceiling (the same decode in {args.workers} bare processes): {result['local_ceiling_img_s']:.0f} img/s "
          f"(rounds: {', '.join(f'{c:.0f}' for c in result['ceilings'])}); a uniform shuffle gives "
          f"{result['uniform_classes_per_batch']:.2f} classes per batch of {args.batch_size}")


def class_mix(result: dict, uniform: str, excluded: str, goal: str) -> list[str]:
    """The goals' lines on the class mix: each local row's classes per batch against a uniform
    shuffle's (``goal`` said beside the ``uniform`` row), but ``excluded``'s."""
    reference = result["uniform_classes_per_batch"]
    lines = []
    for row in result["rows"]:
        name = row["row"]
        if row["scenario"] == "local" and name != excluded:
            lines.append(f"class mix, {name}: {row['classes_per_batch']:.2f} classes per batch, "
                         f"{row['classes_per_batch'] / reference - 1:+.1%} against a uniform shuffle's {reference:.2f}"
                         + (f" (goal: {goal})" if name == uniform else ""))
    return lines


def load_average() -> tuple[float, float, float]:
    return os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)


def main(title: str, script: str, args, argv, run: Callable[[object], dict],
         print_result: Callable[[dict, object], None]) -> int:
    """Run a script's ``run(args)`` and print its result, with how the run was made (the
    environment, the load before and after, the command) above and below; ``--json`` also
    writes all of it to a file."""
    command = f"python {script} " + " ".join(sys.argv[1:] if argv is None else argv)
    load = load_average()
    run_info = f"{environment()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start"
    print(f"# {title}\n\nrun: {run_info}\ncommand: {command}", flush=True)
    started = time.perf_counter()
    result = run(args)
    print_result(result, args)
    print(f"\ntook {time.perf_counter() - started:.0f} s; load average {load_average()[0]:.2f} at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": run_info, "command": command, "settings": vars(args), **result}, f, indent=1)
    return 0
