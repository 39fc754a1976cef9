"""Autotuning against a sweep of fixed settings, across storage latencies.

A split dataset whose ``read`` sleeps L ms (``asyncio.sleep``, like a remote object store
answering after L ms) and whose ``decode`` burns a fixed amount of CPU time. For each L, the
loader runs with a sweep of fixed ``io_concurrency`` values (1, 4, 16, 64, 256) at the default
``queue_depth``, then a sweep of ``queue_depth`` at the best ``io_concurrency``, then with
``io_concurrency="auto", queue_depth="auto"``. Every run gets the same warm-up (not counted,
and the time auto has to learn), then counts samples for a fixed time.

Printed per latency: img/s of every setting, the best fixed one, the default fixed
setting (``io_concurrency=64``, default ``queue_depth``), and auto's ratio to both. The goal
is auto >= 90% of the best fixed setting, and above the default where that is not the best.

Run (about 4 minutes; ``--quick`` about 1 minute: io_concurrency 4, 64, 256 only, no
queue_depth sweep, shorter runs)::

    .venv/bin/python benchmarks/autotune.py
    .venv/bin/python benchmarks/autotune.py --quick
    .venv/bin/python benchmarks/autotune.py --quick --latencies 200 --decode-ms 0.1

The last one is storage slower than the default ``io_concurrency=64`` can cover (64 reads
in flight at 200 ms serve at most 320 samples/s), with light decode: where "auto" must grow.
Last results are in ``docs/stats.md``.

Numbers from a shared machine are noisy: compare ratios within one run only, and use
``--repeat 3`` (interleaved rounds, median) where other work competes for the CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import torch

import aioload

DEFAULT_IO = 64


class SleepyStore(aioload.Dataset):
    """``read`` waits ``latency_ms``; ``decode`` burns ``decode_ms`` of CPU time."""

    def __init__(self, n: int, latency_ms: float, decode_ms: float, size: int = 4096):
        self.n, self.latency_ms, self.decode_ms, self.size = n, latency_ms, decode_ms, size

    def __len__(self) -> int:
        return self.n

    async def read(self, index: int):
        if self.latency_ms:
            await asyncio.sleep(self.latency_ms / 1e3)
        return bytes(self.size), index % 10

    def decode(self, raw):
        data, label = raw
        end = time.thread_time() + self.decode_ms / 1e3
        while time.thread_time() < end:
            pass
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), label


def measure(dataset, args, **knobs) -> tuple[float, aioload.LoaderStats]:
    """Samples/s after ``args.warmup`` seconds, over ``args.seconds`` seconds."""
    with aioload.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                            **knobs) as loader:
        start = time.perf_counter()
        counted = None
        samples = 0
        while True:
            for images, _ in loader:
                now = time.perf_counter()
                if counted is None and now - start >= args.warmup:
                    counted = now
                elif counted is not None:
                    samples += len(images)
                    if now - counted >= args.seconds:
                        return samples / (now - counted), loader.stats()
                if args.step_ms:
                    time.sleep(args.step_ms / 1e3)


def rounds(dataset, args, settings: dict[str, dict]) -> tuple[dict[str, float], dict]:
    """Run every setting ``args.repeat`` times, interleaved (so that load from other work
    falls on all of them alike); the median samples/s of each, and each one's last stats."""
    rates: dict[str, list[float]] = {label: [] for label in settings}
    stats = {}
    for _ in range(args.repeat):
        for label, knobs in settings.items():
            rate, stats[label] = measure(dataset, args, **knobs)
            rates[label].append(rate)
    medians = {label: statistics.median(r) for label, r in rates.items()}
    for label, rate in medians.items():
        print(f"  {label:34} {rate:9.1f} img/s", flush=True)
    return medians, stats


def sweep(latency_ms: float, args) -> dict:
    dataset = SleepyStore(args.samples, latency_ms, args.decode_ms)
    results, _ = rounds(dataset, args, {f"io_concurrency={io}": {"io_concurrency": io} for io in args.io})
    best_io = max(args.io, key=lambda io: results[f"io_concurrency={io}"])
    settings = {f"io_concurrency={best_io}, queue_depth={d}": {"io_concurrency": best_io, "queue_depth": d}
                for d in args.depth}
    settings["auto"] = {"io_concurrency": "auto", "queue_depth": "auto"}
    more, stats = rounds(dataset, args, settings)
    results.update(more)
    auto = stats["auto"]
    fixed = {k: v for k, v in results.items() if k != "auto"}
    best = max(fixed, key=fixed.get)
    default = f"io_concurrency={DEFAULT_IO}"
    if default not in fixed:
        default = None
    print(f"  best fixed: {best} ({fixed[best]:.1f} img/s)")
    print(f"  auto settled at io_concurrency={auto.io_concurrency}, queue_depth={auto.queue_depth}: "
          f"{results['auto'] / fixed[best]:.0%} of the best", end="")
    if default is not None:
        print(f", {results['auto'] / fixed[default]:.2f}x the default ({default})", end="")
    print()
    print("  auto's last stats:")
    print("    " + str(auto).replace("\n", "\n    "))
    return {"best": fixed[best], "auto": results["auto"], "default": fixed.get(default)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer settings, shorter runs")
    parser.add_argument("--latencies", type=float, nargs="+", default=None, help="read latencies in ms")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 2))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--decode-ms", type=float, default=1.0, help="CPU time of one decode")
    parser.add_argument("--step-ms", type=float, default=0.0, help="simulated training step per batch")
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=1, help="interleaved rounds per setting (median)")
    args = parser.parse_args(argv)
    if args.quick:
        args.latencies = args.latencies or [0.0, 5.0, 50.0]
        args.io, args.depth = [4, 64, 256], []
        args.warmup, args.seconds = 2.0, 2.0
    else:
        args.latencies = args.latencies or [0.0, 5.0, 50.0]
        args.io, args.depth = [1, 4, 16, 64, 256], [2, 4, 8]
        args.warmup, args.seconds = 3.0, 4.0
    print(f"autotune benchmark: batch {args.batch_size}, {args.workers} workers, decode {args.decode_ms:g} ms CPU, "
          f"warm-up {args.warmup:g} s, measured {args.seconds:g} s per setting", flush=True)
    summary = {}
    for latency in args.latencies:
        print(f"\nread latency {latency:g} ms", flush=True)
        summary[latency] = sweep(latency, args)
    print("\nlatency ms   best fixed img/s   auto img/s   auto/best   auto/default")
    for latency, r in summary.items():
        default = f"{r['auto'] / r['default']:.2f}x" if r["default"] else "-"
        print(f"{latency:10g} {r['best']:18.1f} {r['auto']:12.1f} {r['auto'] / r['best']:11.0%} {default:>14}")
    print(f"\ncommand: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
