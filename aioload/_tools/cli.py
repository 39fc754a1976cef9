"""The aioload command line.

  aioload bench                aioload against torch's DataLoader, on local files and over HTTP
  aioload make-data DIR        a folder of synthetic ImageNet-like JPEGs to try a loader on
  aioload make-shards SRC DEST a class-per-folder tree as WebDataset tar shards, with their indexes
  aioload index URLS           index sidecars for shards written by other tools
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

EPILOG = """\
environment:
  AIOLOAD_CACHE   where generated data is kept (default: ~/.cache/aioload); aioload bench
                  and the examples make their images there once and reuse them
"""

SCENARIOS = {"local": "local folder", "http": "HTTP, {latency:g} ms round trip"}
PLOT_MISSING = "--plot needs matplotlib, which is not installed: pip install 'aioload[plot]'"


def _progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def _stats_text(stats) -> str:
    from aioload._observe.stats import format_stats

    return format_stats(stats)


def _bars(description: str, total: int | None):
    from aioload._observe.monitor import _tqdm

    return _tqdm()(total=total, desc=f"  {description}", unit="batch", leave=False, file=sys.stderr,
                   dynamic_ncols=True)


@dataclass
class Scenario:
    """One scenario's measured rounds: torch's and aioload's runs, and the ceiling's."""

    key: str
    title: str
    comparison: object
    ceiling: float | None = None


def _data(args) -> str:
    from aioload._tools.synth import default_root, is_complete, make_data

    if args.data is not None:
        return args.data
    root = default_root(args.images)
    if is_complete(root):
        _progress(f"using the {args.images} synthetic JPEGs made earlier in {root}")
    else:
        _progress(f"generating {args.images} synthetic ImageNet-like JPEGs in {root} "
                  "(once: later runs reuse them; AIOLOAD_CACHE moves them)")
    return str(make_data(root, args.images, quiet=False, processes=os.cpu_count() or 1))


def _measure(key: str, title: str, dataset, args, rounds_ceiling=None) -> Scenario:
    import torch

    from aioload import DataLoader
    from aioload._tools.bench import Comparison, median

    common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True)
    comparison = Comparison({
        "torch DataLoader": lambda: torch.utils.data.DataLoader(dataset, **common),
        "aioload DataLoader": lambda: DataLoader(dataset, **common, io_concurrency=args.io_concurrency,
                                                 queue_depth=args.queue_depth),
    }, step_s=args.step_ms / 1000.0, bar=_bars, total=len(dataset) // args.batch_size)
    extra = comparison.run(args.rounds, _progress, each_round=rounds_ceiling, label=f"{key:<6}")
    return Scenario(key, title, comparison, median(extra) if extra else None)


def _run_scenarios(args, root: str) -> list[Scenario] | int:
    from aioload._tools import bench as _bench
    from aioload._tools.bench import BenchImages, ceiling, rrc_flip
    from aioload._tools.benchhttp import HttpImages, Server

    transform = rrc_flip()
    local = BenchImages(root, transform)
    n = len(local)
    if n < args.batch_size * 2:
        print(f"error: {root} has {n} images; need at least {2 * args.batch_size} for batch size "
              f"{args.batch_size}", file=sys.stderr)
        return 2
    print(f"aioload bench: {n} images in {root}, batch {args.batch_size}, {args.workers} workers, "
          f"io_concurrency {args.io_concurrency}, queue_depth {args.queue_depth}, "
          f"training step {args.step_ms:g} ms, {args.rounds} interleaved rounds per scenario", flush=True)
    done = []
    for key in args.scenarios:
        title = SCENARIOS[key].format(latency=args.latency_ms)
        if key == "local":
            paths = [local.path(i) for i in range(n)]
            # the ceiling (decode + transform in a tight loop, one process per worker) is
            # measured in every round, between the two loaders
            done.append(_measure(key, title, local, args, lambda: ceiling(paths, transform, args.workers)))
            continue
        files = [os.path.relpath(path, root) for path, _ in local.samples]
        labels = [label for _, label in local.samples]
        with Server(root, args.latency_ms) as server:
            _bench.EXCLUDED_PIDS.add(server.proc.pid)
            try:
                done.append(_measure(key, title, HttpImages(server.base, files, labels, transform), args))
            finally:
                _bench.EXCLUDED_PIDS.discard(server.proc.pid)
    return done


ROWS = [  # label, Run attribute, format
    ("img/s after the first batch", "rate", "{:.1f}"),
    ("consumer waited, ms per batch", "wait_ms_per_batch", "{:.1f}"),
    ("consumer waited, % of the time", "wait_fraction", "{:.0%}"),
    ("time to first batch (s)", "first_batch_s", "{:.2f}"),
    ("main-process CPU ms/img", "cpu_ms_per_image", "{:.3f}"),
    ("memory MB (PSS, all procs)", "memory_mb", "{:.0f}"),
    ("/dev/shm MB (peak)", "shm_mb", "{:.1f}"),
]


def table(scenarios: list[Scenario]) -> str:
    """Medians of every round, one block of rows per scenario."""
    lines = [f"{'':32} {'torch':>10} {'aioload':>10} {'aioload/torch':>14}"]
    local_ceiling = next((s.ceiling for s in scenarios if s.ceiling), None)
    for s in scenarios:
        c = s.comparison
        lines.append(s.title)
        for label, attr, fmt in ROWS:
            t, a = c.med("torch DataLoader", attr), c.med("aioload DataLoader", attr)
            ratio = f"{a / t:.2f}x" if t and not fmt.endswith("%}") else ""  # no ratio of shares
            lines.append(f"  {label:30} {fmt.format(t):>10} {fmt.format(a):>10} {ratio:>14}".rstrip())
        rate = c.med("aioload DataLoader", "rate")
        if s.ceiling:
            lines.append(f"  {'ceiling img/s (no loader)':30} {s.ceiling:>10.1f} {'':>10} "
                         f"{'aioload ' + format(rate / s.ceiling, '.0%') + ' of it':>14}")
        elif local_ceiling:
            lines.append(f"  {'aioload img/s / local ceiling':30} {'':>10} {rate / local_ceiling:>10.0%}")
    return "\n".join(lines)


def bench(args: argparse.Namespace) -> int:
    from aioload._tools.bench import environment

    if args.plot is not None:
        from aioload._tools.benchplot import check

        problem = check(args.plot)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    root = _data(args)
    scenarios = _run_scenarios(args, root)
    if isinstance(scenarios, int):
        return scenarios
    print()
    print(table(scenarios))
    for s in scenarios:
        last = s.comparison.runs["aioload DataLoader"][-1].stats
        if last is not None:
            print(f"\naioload pipeline, {s.title} (its last round; loader.stats()):")
            print(_stats_text(last))
    if args.plot is not None:
        from aioload._tools.benchplot import plot

        plot(args.plot, scenarios)
        print(f"\nplot: {args.plot}")
    print(f"\nrun: {environment()}")
    print(f"command: aioload bench {' '.join(sys.argv[2:])}".rstrip())
    return 0


def make_data_command(args: argparse.Namespace) -> int:
    from aioload._tools.synth import is_complete, make_data

    if is_complete(args.dir):
        print(f"{args.dir} already holds a complete generated folder: nothing to do")
        return 0
    root = make_data(args.dir, args.images, classes=args.classes, seed=args.seed, quiet=False,
                     processes=os.cpu_count() or 1)
    print(f"{args.images} JPEGs in {args.classes} class folders under {root}")
    return 0


def _storage_options(text: str | None) -> dict:
    import json

    if text is None:
        return {}
    try:
        options = json.loads(text)
    except ValueError as exc:
        raise SystemExit(f"error: --storage-options is not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise SystemExit("error: --storage-options must be a JSON object, such as '{\"anon\": true}'")
    return options


def make_shards_command(args: argparse.Namespace) -> int:
    from aioload._shards.writer import convert_folder, folder_samples

    options = _storage_options(args.storage_options)
    total = len(folder_samples(args.src, options)[1])
    bar = None
    if sys.stderr.isatty():  # a bar on a terminal; a log or a pipe gets the summary alone
        from aioload._observe.monitor import _tqdm

        bar = _tqdm()(total=total, desc="  writing shards", unit="img", file=sys.stderr, dynamic_ncols=True)
    try:
        writer = convert_folder(args.src, args.dest, name=args.name, maxcount=args.maxcount, maxsize=args.maxsize,
                                shuffle_seed=args.shuffle, storage_options=options,
                                progress=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    print(f"{writer.total} samples in {len(writer.urls)} shards: {writer.urls[0]} ... {writer.urls[-1]}"
          if writer.urls else "no samples written")
    return 0


def index_command(args: argparse.Namespace) -> int:
    from aioload._shards.index import IndexCache, Indexer, default_cache_folder
    from aioload._shards.urls import shard_urls
    from aioload._shards.writer import write_sidecar
    from aioload._storage.scope import run_blocking
    from aioload._storage.storage import Storage, locate

    options = _storage_options(args.storage_options)
    storage = Storage(storage_options=options)
    urls = shard_urls(args.urls)
    indexed = run_blocking(lambda: Indexer(storage, IndexCache(default_cache_folder())).all(urls))
    for shard in indexed:
        faults = f", {len(shard.index.faults)} unreadable" if shard.index.faults else ""
        if shard.source == "sidecar":
            done = "its sidecar is up to date"
        elif locate(shard.url)[0] == "http" or args.cache_only:
            done = "indexed into the local cache only" + (" (HTTP takes no uploads)" if not args.cache_only else "")
        else:
            done = f"wrote {write_sidecar(shard.url, shard.index, options)}"
        print(f"{shard.url}: {len(shard.index)} samples{faults}; {done}")
    return 0


def _scenarios(text: str) -> list[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [c for c in chosen if c not in SCENARIOS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"scenarios are a comma-separated list of {', '.join(SCENARIOS)}, "
                                         f"got {text!r}")
    return list(dict.fromkeys(chosen))


def parser() -> argparse.ArgumentParser:
    help_fmt = argparse.RawDescriptionHelpFormatter
    top = argparse.ArgumentParser(prog="aioload", description=__doc__, epilog=EPILOG, formatter_class=help_fmt)
    sub = top.add_subparsers(dest="command", required=True, metavar="{bench,make-data,make-shards,index}")
    b = sub.add_parser(
        "bench", help="aioload against torch's DataLoader on local files and over HTTP", epilog=EPILOG,
        formatter_class=help_fmt,
        description="Measure torch's DataLoader and aioload's side by side, with the same dataset, transform\n"
                    "(RandomResizedCrop 224 + flip) and workers, in interleaved rounds, in two scenarios:\n"
                    "a local folder of JPEGs, and the same images behind an HTTP server on 127.0.0.1 that\n"
                    "answers each request after a round trip (the bench starts and stops it). Prints one\n"
                    "table of medians, then aioload's own statistics for each scenario.")
    cpus = os.cpu_count() or 2
    b.add_argument("--data", metavar="DIR",
                   help="an ImageFolder-style directory (default: synthetic JPEGs generated once in $AIOLOAD_CACHE)")
    b.add_argument("--images", type=int, default=1024,
                   help="how many synthetic images to generate, without --data (default: %(default)s)")
    b.add_argument("--scenarios", type=_scenarios, default=list(SCENARIOS), metavar="LIST",
                   help="which to run, comma-separated: local, http (default: local,http)")
    b.add_argument("--latency-ms", type=float, default=20.0,
                   help="the HTTP server's round trip per request, in ms (default: %(default)g)")
    b.add_argument("--workers", type=int, default=cpus,
                   help="worker processes, the same for both loaders (default: this machine's CPUs, %(default)s)")
    b.add_argument("--batch-size", type=int, default=64, help="images per batch (default: %(default)s)")
    b.add_argument("--io-concurrency", type=int, default=64,
                   help="aioload's reads in flight (default: %(default)s)")
    b.add_argument("--queue-depth", type=int, default=4,
                   help="aioload's finished batches buffered ahead of the consumer (default: %(default)s)")
    b.add_argument("--step-ms", type=float, default=0.0,
                   help="a simulated training step after each batch, in ms: a sleep, as while a GPU "
                        "works (default: %(default)g, the loaders' own speed)")
    b.add_argument("--rounds", "--epochs", dest="rounds", type=int, default=3,
                   help="interleaved rounds per scenario, each one epoch of each loader; the table "
                        "shows medians (default: %(default)s; --epochs is an older name)")
    b.add_argument("--plot", metavar="FILE",
                   help="also draw img/s and the consumer's waiting per loader and scenario into FILE "
                        "(.png or .svg; needs matplotlib: pip install 'aioload[plot]') (default: no plot)")
    m = sub.add_parser("make-data", help="make a folder of synthetic ImageNet-like JPEGs", epilog=EPILOG,
                       formatter_class=help_fmt,
                       description="Write synthetic ImageNet-like JPEGs (about 400x350 px) into DIR/class_NNN/,\n"
                                   "the layout aioload.ImageFolder and torchvision's ImageFolder read. The\n"
                                   "same arguments always make the same files; nothing is downloaded.\n"
                                   "From Python: aioload.make_data(DIR, n).")
    m.add_argument("dir", metavar="DIR", help="where to write the images (made if missing)")
    m.add_argument("--images", type=int, default=1024, help="how many images (default: %(default)s)")
    m.add_argument("--classes", type=int, default=8, help="how many class folders (default: %(default)s)")
    m.add_argument("--seed", type=int, default=0, help="the seed that picks every image (default: %(default)s)")
    s = sub.add_parser("make-shards", help="write a class-per-folder tree as WebDataset tar shards",
                       epilog=EPILOG, formatter_class=help_fmt,
                       description="Write the images of SRC (a class-per-folder tree, as ImageFolder reads it; a\n"
                                   "local folder or an fsspec URL) into DEST/NAME-000000.tar, ... with an index\n"
                                   "sidecar beside each shard. One sample per image: key CLASS/FILE, the image\n"
                                   "under its extension and its class index as 'cls'. Shards are class-sorted\n"
                                   "(ImageFolder's order) unless --shuffle. Read them with aioload.WebDataset.")
    s.add_argument("src", metavar="SRC", help="the class-per-folder tree")
    s.add_argument("dest", metavar="DEST", help="the folder (or fsspec URL) to write the shards into")
    s.add_argument("--name", default="train", help="the shards' name before the number (default: %(default)s)")
    s.add_argument("--maxcount", type=int, default=1000, help="samples per shard at most (default: %(default)s)")
    s.add_argument("--maxsize", type=float, default=3e9,
                   help="member bytes per shard before a new one starts (default: %(default)g)")
    s.add_argument("--shuffle", type=int, metavar="SEED", default=None,
                   help="shuffle the samples with this seed before writing (default: class by class)")
    s.add_argument("--storage-options", metavar="JSON", help="fsspec options for SRC and DEST, as a JSON object")
    x = sub.add_parser("index", help="write index sidecars for WebDataset tar shards", epilog=EPILOG,
                       formatter_class=help_fmt,
                       description="Index each shard (the byte range of every sample) and write the index beside\n"
                                   "it as SHARD.index.json, so that aioload.WebDataset does not read the shard to\n"
                                   "index it. URLS are paths, fsspec URLs or brace patterns\n"
                                   "('s3://bucket/train-{000000..000999}.tar'). HTTP shards, and every shard with\n"
                                   "--cache-only, are indexed into the local cache ($AIOLOAD_CACHE) instead.")
    x.add_argument("urls", metavar="URLS", nargs="+", help="shards: paths, URLs or brace patterns")
    x.add_argument("--cache-only", action="store_true", help="write no sidecars; fill the local cache only")
    x.add_argument("--storage-options", metavar="JSON", help="fsspec options (credentials, endpoint_url), as JSON")
    return top


def main(argv: list[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)
    positive = {"bench": ("workers", "batch_size", "io_concurrency", "queue_depth", "rounds", "images"),
                "make-data": ("images", "classes"), "make-shards": ("maxcount", "maxsize"), "index": ()}[args.command]
    for name in positive:
        if getattr(args, name) < 1:
            top.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.command == "make-data":
        return make_data_command(args)
    if args.command == "make-shards":
        return make_shards_command(args)
    if args.command == "index":
        return index_command(args)
    for name in ("latency_ms", "step_ms"):
        if getattr(args, name) < 0:
            top.error(f"--{name.replace('_', '-')} must be >= 0")
    try:
        return bench(args)
    except KeyboardInterrupt:
        print("\naioload bench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
