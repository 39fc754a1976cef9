"""aioload's benchmark suite: every workload side by side with torch's DataLoader, in one run.

    python benchmarks/run.py            # all suites, 3 interleaved rounds each
    python benchmarks/run.py --quick    # 1 round, smaller data
    python benchmarks/run.py --suite tiny --rounds 5

Suites (same dataset object, same transform, same worker count for both loaders; medians of
interleaved rounds; throughput counts batches after the first, whose wait is reported as time
to first batch):

* ``imagenet``: ImageNet-like JPEGs, RandomResizedCrop(224) + flip, batch 64; plus the ceiling
  (the same read + decode + transform in a tight loop, one process per worker, no loader).
* ``tiny``: a plain map-style Dataset of 128-token rows, batch 256: per-batch overhead; plus
  its ceiling (the same ``__getitem__`` + ``default_collate`` in a tight loop, one process per
  worker, no loader).
* ``classic``: the tutorial recipe (torchvision ImageFolder + PIL + Resize(256) +
  CenterCrop(224) + ToTensor + Normalize) on torch's DataLoader, against aioload.ImageFolder +
  the same geometry with ``transforms.v2`` on uint8 (normalisation belongs on the GPU with
  ``aioload.transforms.Normalize``; it is not run here, where there is none).

Each table also reports main-process CPU per image, memory (PSS of the parent and its workers)
and /dev/shm use.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import aioload
from aioload._tools.bench import BenchImages, Comparison, ceiling, ceiling_of, environment, median, rrc_flip
from aioload._data.synth import make_image_folder


class TinyRows(torch.utils.data.Dataset):
    """Row i: 128 int64 tokens and a label; almost no work per sample."""

    def __init__(self, n: int = 65536):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.arange(i, i + 128, dtype=torch.int64), i % 7


def _progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def table(title: str, comparison: Comparison, baseline: str, extra: dict | None = None) -> None:
    names = list(comparison.factories)
    print(f"\n## {title}\n")
    print(f"{'loader':34} {'img/s':>9} {'ratio':>7} {'1st batch s':>11} {'main CPU ms/img':>15} "
          f"{'PSS MB':>8} {'shm MB':>7}")
    base = comparison.med(baseline, "rate")
    for name in names:
        rate = comparison.med(name, "rate")
        print(f"{name:34} {rate:9.1f} {rate / base:6.2f}x {comparison.med(name, 'first_batch_s'):11.2f} "
              f"{comparison.med(name, 'cpu_ms_per_image'):15.4f} {comparison.med(name, 'memory_mb'):8.0f} "
              f"{comparison.med(name, 'shm_mb'):7.1f}")
    for label, value in (extra or {}).items():
        print(f"{label:34} {value}")


def imagenet(args) -> None:
    root = make_image_folder(images=args.images, processes=os.cpu_count() or 1)
    dataset = BenchImages(root, rrc_flip())
    common = dict(batch_size=64, shuffle=True, num_workers=args.workers, drop_last=True)
    comparison = Comparison({
        "torch DataLoader": lambda: torch.utils.data.DataLoader(dataset, **common),
        "aioload DataLoader": lambda: aioload.DataLoader(dataset, **common),
    })
    paths = [dataset.path(i) for i in range(len(dataset))]
    ceil = median(comparison.run(args.rounds, _progress,
                                 each_round=lambda: ceiling(paths, dataset.transform, args.workers)))
    a = comparison.med("aioload DataLoader", "rate")
    t = comparison.med("torch DataLoader", "rate")
    table(f"ImageNet-like JPEGs, RandomResizedCrop(224) + flip, batch 64, {args.workers} workers, "
          f"{len(dataset)} images", comparison, "torch DataLoader",
          {"ceiling (no loader) img/s": f"{ceil:.1f}",
           "aioload / ceiling": f"{a / ceil:.0%}", "torch / ceiling": f"{t / ceil:.0%}"})


def tiny(args) -> None:
    dataset = TinyRows(args.rows)
    common = dict(batch_size=256, shuffle=True, drop_last=True)
    comparison = Comparison({
        "torch DataLoader, 0 workers": lambda: torch.utils.data.DataLoader(dataset, **common),
        f"torch DataLoader, {args.workers} workers": lambda: torch.utils.data.DataLoader(
            dataset, num_workers=args.workers, **common),
        f"aioload DataLoader, {args.workers} workers": lambda: aioload.DataLoader(
            dataset, num_workers=args.workers, **common),
    })
    # the ceiling: the same __getitem__ + default_collate in a tight loop, one process per worker
    order = torch.randperm(len(dataset)).tolist()
    batches = [order[i : i + 256] for i in range(0, len(order) - 255, 256)]
    ceil = median(comparison.run(args.rounds, _progress, each_round=lambda: ceiling_of(
        _collate_rows, [(dataset, batches[w :: args.workers]) for w in range(args.workers)])))
    a = comparison.med(f"aioload DataLoader, {args.workers} workers", "rate")
    t = comparison.med(f"torch DataLoader, {args.workers} workers", "rate")
    table(f"Tiny samples: 128-token rows, batch 256, {len(dataset)} rows (rates are rows/s)",
          comparison, f"torch DataLoader, {args.workers} workers",
          {"ceiling (no loader) rows/s": f"{ceil:.1f}",
           "aioload / ceiling": f"{a / ceil:.0%}", "torch / ceiling": f"{t / ceil:.0%}"})


def _collate_rows(share) -> int:
    dataset, batches = share
    for batch in batches:
        torch.utils.data.default_collate([dataset[i] for i in batch])
    return sum(len(batch) for batch in batches)


def classic(args) -> None:
    import torchvision
    from torchvision import transforms as T
    from torchvision.transforms import v2

    root = make_image_folder(images=args.images, processes=os.cpu_count() or 1)
    pil = torchvision.datasets.ImageFolder(root, T.Compose([
        T.Resize(256), T.CenterCrop(224), T.ToTensor(),
        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]))
    ours = aioload.ImageFolder(root, v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224)]))
    common = dict(batch_size=64, shuffle=True, num_workers=args.workers, drop_last=True)
    comparison = Comparison({
        "torchvision ImageFolder + PIL": lambda: torch.utils.data.DataLoader(pil, **common),
        "aioload ImageFolder + v2 uint8": lambda: aioload.DataLoader(ours, **common),
    })
    comparison.run(args.rounds, _progress)
    table(f"Out of the box: the tutorial recipe, batch 64, {args.workers} workers", comparison,
          "torchvision ImageFolder + PIL")


SUITES = {"imagenet": imagenet, "tiny": tiny, "classic": classic}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), action="append")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--quick", action="store_true", help="1 round, fewer rows and images")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.rows, args.images = 1, min(args.rows, 16384), min(args.images, 512)
    print(f"# aioload benchmarks\n\nrun: {environment()}\ncommand: python benchmarks/run.py "
          f"{' '.join(sys.argv[1:])}".rstrip())
    for name in args.suite or list(SUITES):
        SUITES[name](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
