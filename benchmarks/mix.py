"""What mixing costs: ``aioload.Mix`` over three sources against one dataset of the same images.

    python benchmarks/mix.py                      # 1,024 images, 2 workers, 3 rounds
    python benchmarks/mix.py --images 256 --rounds 1 --json out.json

The generated ImageNet-like JPEGs of ``benchmarks/overhead.py`` (about 400x350 px), the same
transform (``RandomResizedCrop(224)`` + flip on uint8 tensors), batches of ``--batch-size``
and ``--workers`` worker processes for every row:

* ``torch DataLoader``: torch's loader over ``aioload.ImageFiles`` of every image (its
  ``__getitem__``), ``shuffle=True``;
* ``aioload, one dataset``: ``aioload.DataLoader`` over that same ``ImageFiles``, ``seed=0``;
* ``aioload, Mix of 3``: the images cut into three ``ImageFiles`` sources of 50, 30 and 20 %,
  mixed by weights 0.5 / 0.3 / 0.2 (an epoch then holds about every image once), ``seed=0``.

Each measurement is one epoch of a fresh loader; img/s and main-process CPU per image
(``time.process_time``, every thread of the process) count the batches after the first, as
``benchmarks/overhead.py`` measures them. Rounds are interleaved, the order alternating, and
medians are printed with the ratios: the mix against one dataset (the cost of mixing, which
should be within noise) and each aioload row against torch. Numbers from a shared machine are
noisy: compare within one run.
"""

from __future__ import annotations

import os
import sys

import torch

import aioload
from aioload._tools.bench import environment, median, script_main, script_parser

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # noqa: E402  (benchmarks/overhead.py: the data and measure())

TORCH, ONE, MIX = "torch DataLoader", "aioload, one dataset", "aioload, Mix of 3"
SHARES = (0.5, 0.3, 0.2)


def loaders(data: "overhead.Data", args) -> dict:
    files = aioload.ImageFiles(data.paths, data.labels, data.transform)
    cuts = [0]
    for share in SHARES:
        cuts.append(cuts[-1] + round(share * len(data.paths)))
    cuts[-1] = len(data.paths)
    sources = {f"part{i}": aioload.ImageFiles(data.paths[a:b], data.labels[a:b], data.transform)
               for i, (a, b) in enumerate(zip(cuts, cuts[1:]))}
    mix = aioload.Mix(sources, {name: len(source) for name, source in sources.items()})
    common = dict(batch_size=args.batch_size, num_workers=args.workers)
    return {
        TORCH: lambda: torch.utils.data.DataLoader(files, shuffle=True, **common),
        ONE: lambda: aioload.DataLoader(files, shuffle=True, seed=0, **common),
        MIX: lambda: aioload.DataLoader(mix, shuffle=True, seed=0, **common),
    }


def run(args) -> dict:
    data = overhead.Data(args.images, [])
    try:
        makers = loaders(data, args)
        rates: dict[str, list[float]] = {name: [] for name in makers}
        cpu: dict[str, list[float]] = {name: [] for name in makers}
        images: dict[str, list[int]] = {name: [] for name in makers}
        for round_ in range(args.rounds):
            names = list(makers) if round_ % 2 == 0 else list(reversed(makers))
            for name in names:
                overhead._progress(f"round {round_ + 1}/{args.rounds}: {name}")
                measured = overhead.measure(makers[name])
                rates[name].append(measured.rate)
                cpu[name].append(measured.ms_per_image(measured.cpu_s))
                images[name].append(measured.images)
    finally:
        data.close()
    return {"rows": {name: {"img_s": median(rates[name]), "cpu_ms_per_img": median(cpu[name]),
                            "images": median(images[name]), "img_s_rounds": rates[name]} for name in makers},
            "settings": {"images": args.images, "workers": args.workers, "batch_size": args.batch_size,
                         "rounds": args.rounds, "environment": environment()},
            "command": "python benchmarks/mix.py " + " ".join(sys.argv[1:])}


def report(result: dict) -> None:
    rows = result["rows"]
    s = result["settings"]
    print(f"\nmixing cost: {s['images']} images, batch {s['batch_size']}, {s['workers']} workers, "
          f"{s['rounds']} round(s); {s['environment']}")
    print(f"  {'loader':<24}{'img/s':>9}{'/ torch':>9}{'main CPU ms/img':>17}")
    torch_rate = rows[TORCH]["img_s"] or float("nan")
    for name, row in rows.items():
        print(f"  {name:<24}{row['img_s']:>9.1f}{row['img_s'] / torch_rate:>8.2f}x{row['cpu_ms_per_img']:>17.3f}")
    one, mix = rows[ONE], rows[MIX]
    result["mix_over_one"] = {"img_s": mix["img_s"] / one["img_s"],
                              "cpu_ms_per_img": mix["cpu_ms_per_img"] / one["cpu_ms_per_img"]}
    print(f"  Mix / one dataset: {result['mix_over_one']['img_s']:.2f}x img/s, "
          f"{result['mix_over_one']['cpu_ms_per_img']:.2f}x main-process CPU per image")


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--images", type=int, default=1024, help="generated JPEGs")
    parser.add_argument("--workers", type=int, default=2, help="worker processes of every loader")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are printed")
    return script_main(parser, argv, run, report)


if __name__ == "__main__":
    sys.exit(main())
