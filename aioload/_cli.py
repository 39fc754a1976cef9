"""``aioload`` command line: ``aioload bench`` compares aioload with torch's DataLoader."""

from __future__ import annotations

import argparse
import os
import sys

import torch


def _progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def _stats_text(stats) -> str:
    try:
        from aioload._stats import format_stats
    except ImportError:
        return repr(stats)
    return format_stats(stats)


def bench(args: argparse.Namespace) -> int:
    from aioload import DataLoader
    from aioload._bench import BenchImages, Comparison, ceiling, environment, median, rrc_flip
    from aioload._synth import make_image_folder

    if args.data is None:
        _progress(f"preparing {args.images} synthetic ImageNet-like JPEGs (made once, then cached)")
        root = make_image_folder(images=args.images, quiet=False, processes=os.cpu_count() or 1)
    else:
        root = args.data
    transform = rrc_flip()
    dataset = BenchImages(root, transform, latency_ms=args.latency_ms)
    n = len(dataset)
    if n < args.batch_size * 2:
        print(f"error: {root} has {n} images; need at least {2 * args.batch_size} for batch size {args.batch_size}",
              file=sys.stderr)
        return 2
    w = args.workers
    common = dict(batch_size=args.batch_size, shuffle=True, num_workers=w, drop_last=True)

    def torch_loader():
        return torch.utils.data.DataLoader(dataset, **common)

    def aioload_loader():
        return DataLoader(dataset, **common, io_concurrency=args.io_concurrency, queue_depth=args.queue_depth)

    print(f"aioload bench: {n} images in {root}, batch {args.batch_size}, {w} workers, "
          f"io_concurrency {args.io_concurrency}, queue_depth {args.queue_depth}, "
          f"simulated latency {args.latency_ms:g} ms, {args.rounds} interleaved rounds", flush=True)
    comparison = Comparison({"torch DataLoader": torch_loader, "aioload DataLoader": aioload_loader})
    paths = [dataset.path(i) for i in range(n)]
    ceil = None
    if args.latency_ms == 0:  # the ceiling (decode + transform in a tight loop, one process per
        # worker) is measured in every round, between the two loaders
        ceil = median(comparison.run(args.rounds, _progress, each_round=lambda: ceiling(paths, transform, w)))
    else:
        comparison.run(args.rounds, _progress)

    t_rate, a_rate = comparison.med("torch DataLoader", "rate"), comparison.med("aioload DataLoader", "rate")
    rows = [
        ("img/s (median)", t_rate, a_rate, "{:.1f}"),
        ("time to first batch (s)", comparison.med("torch DataLoader", "first_batch_s"),
         comparison.med("aioload DataLoader", "first_batch_s"), "{:.2f}"),
        ("main-process CPU ms/img", comparison.med("torch DataLoader", "cpu_ms_per_image"),
         comparison.med("aioload DataLoader", "cpu_ms_per_image"), "{:.3f}"),
        ("memory MB (PSS, all procs)", comparison.med("torch DataLoader", "memory_mb"),
         comparison.med("aioload DataLoader", "memory_mb"), "{:.0f}"),
        ("/dev/shm MB (peak)", comparison.med("torch DataLoader", "shm_mb"),
         comparison.med("aioload DataLoader", "shm_mb"), "{:.1f}"),
    ]
    print()
    print(f"{'':28} {'torch':>12} {'aioload':>12} {'aioload/torch':>14}")
    for label, t, a, fmt in rows:
        ratio = f"{a / t:.2f}x" if t else "-"
        print(f"{label:28} {fmt.format(t):>12} {fmt.format(a):>12} {ratio:>14}")
    if ceil is not None:
        print(f"{'ceiling img/s (no loader)':28} {ceil:>12.1f} {'':>12} "
              f"{'aioload ' + format(a_rate / ceil * 100, '.0f') + '% of it':>14}")
    print()
    last = comparison.runs["aioload DataLoader"][-1].stats
    if last is not None:
        print("aioload pipeline (last round):")
        print(_stats_text(last))
    print(f"\nrun: {environment()}")
    print(f"command: aioload bench {' '.join(sys.argv[2:])}".rstrip())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aioload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="compare aioload with torch's DataLoader on a folder of JPEGs")
    b.add_argument("--data", help="an ImageFolder-style directory (default: generated synthetic JPEGs)")
    b.add_argument("--images", type=int, default=1024, help="synthetic images to generate (default 1024)")
    b.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="worker processes for both loaders")
    b.add_argument("--batch-size", type=int, default=64)
    b.add_argument("--io-concurrency", type=int, default=64)
    b.add_argument("--queue-depth", type=int, default=4)
    b.add_argument("--latency-ms", type=float, default=0.0,
                   help="simulated storage round trip added to every read, for both loaders")
    b.add_argument("--rounds", "--epochs", dest="rounds", type=int, default=3,
                   help="interleaved rounds: each runs one epoch of each loader (--epochs is an older name)")
    args = parser.parse_args(argv)
    for name in ("workers", "batch_size", "io_concurrency", "queue_depth", "rounds", "images"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.latency_ms < 0:
        parser.error("--latency-ms must be >= 0")
    return bench(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
