"""The aioload command line: ``aioload bench`` (aioload against torch's DataLoader, on local
files and over HTTP), ``aioload make-data DIR`` (a folder of synthetic ImageNet-like JPEGs to
try a loader on), ``aioload make-shards SRC DEST`` (a class-per-folder tree as WebDataset tar
shards, with their indexes) and ``aioload index URLS`` (index sidecars for shards written by
other tools). ``aioload --help`` lists the commands from their parsers' ``help``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass, field

DESCRIPTION = ("The aioload command line: measure aioload against torch's DataLoader, make data to try a\n"
               "loader on, write and index WebDataset tar shards. aioload COMMAND --help lists a command's\n"
               "options.")

EPILOG = """\
environment:
  AIOLOAD_CACHE   where generated data is kept (default: ~/.cache/aioload); aioload bench
                  and the examples make their images there once and reuse them, and
                  aioload.WebDataset keeps its shard indexes there (shard-index/)
"""

SCENARIOS = {"local": "local folder", "http": "HTTP, {latency:g} ms round trip"}


def _progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def _stats_text(stats) -> str:
    from aioload._observe.stats import format_stats

    return format_stats(stats)


def _bars(description: str, total: int | None):
    from aioload._observe.monitor import tqdm_class

    # disable=None: a bar on a terminal only; in a log or a pipe, the round's line says enough
    return tqdm_class()(total=total, desc=f"  {description}", unit="batch", leave=False, file=sys.stderr,
                   dynamic_ncols=True, disable=None)


@dataclass
class Scenario:
    """One scenario's measured rounds: torch's and aioload's runs, and the ceiling's."""

    key: str
    title: str
    comparison: object
    workers: int
    ceilings: list[float] = field(default_factory=list)  # one per round, measured between the loaders

    @property
    def ceiling(self) -> float | None:
        """The median of the rounds' ceilings (``None`` where none was measured)."""
        return statistics.median(self.ceilings) if self.ceilings else None


def _data(args) -> str:
    from aioload._data.synth import default_root, is_complete, make_data

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
    from aioload._tools.bench import Comparison

    common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True)
    comparison = Comparison({
        "torch DataLoader": lambda: torch.utils.data.DataLoader(dataset, **common),
        "aioload DataLoader": lambda: DataLoader(dataset, **common, io_concurrency=args.io_concurrency,
                                                 queue_depth=args.queue_depth),
    }, step_s=args.step_ms / 1000.0, bar=_bars, total=len(dataset) // args.batch_size)
    ceilings = comparison.run(args.rounds, _progress, each_round=rounds_ceiling, label=f"{key:<6}")
    return Scenario(key, title, comparison, args.workers, ceilings)


def _local_images(root: str):
    """The bench's dataset over ``root``, or ``None`` after one line saying what is wrong with it."""
    from aioload._tools.bench import BenchImages, rrc_flip

    try:
        return BenchImages(root, rrc_flip())
    except FileNotFoundError as exc:  # torchvision's find_classes or make_dataset: no folder, no classes, no images
        print(f"error: aioload bench: {_data_problem(root, exc)}", file=sys.stderr)
        return None


def _run_scenarios(args, root: str, local) -> list[Scenario] | int:
    from aioload._tools import bench as _bench
    from aioload._tools.bench import ceiling
    from aioload._tools.benchhttp import HttpImages, Server

    transform = local.transform
    n = len(local)
    if n < args.batch_size * 2:
        print(f"error: {root} has {n} images; need at least {2 * args.batch_size} for batch size "
              f"{args.batch_size}", file=sys.stderr)
        return 2
    depth = args.queue_depth
    if depth is None:
        from aioload._front.loader import default_queue_depth

        depth = f"{default_queue_depth(None, args.workers)} (the loader's default)"
    print(f"aioload bench: {n} images in {root}, batch {args.batch_size}, {args.workers} workers, "
          f"io_concurrency {args.io_concurrency}, queue_depth {depth}, "
          f"training step {args.step_ms:g} ms, {_plural(args.rounds, 'interleaved round')} per scenario", flush=True)
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


DATA_LAYOUT = "class folders of images (DIR/CLASS/IMAGE.jpg, as ImageFolder reads them)"


def _data_problem(root: str, exc: FileNotFoundError) -> str:
    """What is wrong with ``--data root``, and the fix, in one line."""
    if not os.path.isdir(root):
        return f"--data {root} is not a folder: give it {DATA_LAYOUT}, or leave --data out for generated JPEGs"
    names = os.listdir(root)
    if any(name.endswith(".parquet") for name in names):
        return (f"--data {root} holds Parquet files, and aioload bench reads {DATA_LAYOUT}; "
                "python benchmarks/parquet.py measures Parquet, or aioload make-data DIR writes a folder to measure")
    found = str(exc).rstrip(".")
    return f"--data {root}: {found[0].lower()}{found[1:]}; aioload bench reads {DATA_LAYOUT}"


ROWS = [  # label, Run attribute, format, what a zero reads as (None: the number)
    ("img/s after the first batch", "rate", "{:.1f}", None),
    ("consumer waited, ms per batch", "wait_ms_per_batch", "{:.1f}", None),
    ("time to first batch (s)", "first_batch_s", "{:.2f}", None),
    ("main-process CPU ms/img", "cpu_ms_per_image", "{:.3f}", None),
    ("memory MB (PSS, all procs)", "memory_mb", "{:.0f}", None),
    ("/dev/shm MB (peak)", "shm_mb", "{:.1f}", "none"),
]
STEP_ROW = ("training step idle, % of time", "wait_fraction", "{:.0%}", None)
"""Shown with ``--step-ms``: the share of the time the simulated training step stood waiting
for a batch. Without a step the consumer does nothing but wait, so any loader waits about
100 % of the time and the row would say nothing."""

LOADERS = ("torch DataLoader", "aioload DataLoader")

NOISE = 0.05
"""How far above the ceiling plus the first batches' head start a share may be and still
read as "at the ceiling" (the ceiling's own rounds spread by 5-15 % on a shared machine)."""


def _is_zero(value: float, fmt: str) -> bool:
    """Zero as the table shows it (/dev/shm is shared: other programs' files come and go)."""
    return fmt.format(value) == fmt.format(0)


def _cell(value: float, fmt: str, zero: str | None) -> str:
    return zero if zero is not None and _is_zero(value, fmt) else fmt.format(value)


def _ratio(torch_value: float, aioload_value: float, fmt: str) -> str:
    """``aioload/torch``; none for shares, and none against (or of) zero."""
    if fmt.endswith("%}") or _is_zero(torch_value, fmt) or _is_zero(aioload_value, fmt):
        return ""
    return f"{aioload_value / torch_value:.2f}x"


def _efficiency(rate: float, ceiling: float) -> tuple[str, str]:
    """``rate`` as a share of ``ceiling``, and ``"*"`` where it is above it (see :func:`ceiling_note`)."""
    share = rate / ceiling
    return f"{share:.0%}", "*" if share > 1 else ""


def table(scenarios: list[Scenario], step: bool = False) -> str:
    """Medians of every round, one block of rows per scenario; a note under it where aioload
    measured above the ceiling."""
    lines = [f"{'':32} {'torch':>10} {'aioload':>10} {'aioload/torch':>14}"]
    local = next((s for s in scenarios if s.ceiling), None)
    highest = 0.0  # aioload's largest share of the ceiling
    for s in scenarios:
        c = s.comparison
        lines.append(s.title)
        rows = ROWS[:2] + ([STEP_ROW] if step else []) + ROWS[2:]
        for label, attr, fmt, zero in rows:
            t, a = (c.med(name, attr) for name in LOADERS)
            lines.append(f"  {label:30} {_cell(t, fmt, zero):>10} {_cell(a, fmt, zero):>10} "
                         f"{_ratio(t, a, fmt):>14}".rstrip())
        rate = c.med(LOADERS[1], "rate")
        if s.ceiling:
            share, mark = _efficiency(rate, s.ceiling)
            lines.append(f"  {'ceiling img/s (decode alone)':30} {s.ceiling:>10.1f} {'':>10} "
                         f"{'aioload ' + share + mark + ' of it':>14}")
        elif local is not None:
            share, mark = _efficiency(rate, local.ceiling)
            lines.append(f"  {'aioload img/s / local ceiling':30} {'':>10} {share:>10}{mark}")
        if local is not None:
            highest = max(highest, rate / local.ceiling)
    if highest > 1:
        lines.append(ceiling_note(local, highest))
    return "\n".join(lines)


def _workers(n: int) -> str:
    return _plural(n, "worker")


def ceiling_note(local: Scenario, highest: float) -> str:
    """Why a loader can measure above the ceiling (``highest``: the largest share measured)."""
    low, high = min(local.ceilings), max(local.ceilings)
    batches = max(run.batches for run in local.comparison.runs[LOADERS[1]]) + 1
    head_start = (batches - 1) / max(1, batches - local.workers) - 1
    verdict = ("Read it as: at the ceiling." if highest <= 1 + head_start + NOISE else
               "This far above it, the machine's load changed during the run: measure again when it is quieter.")
    return textwrap.fill(
        f"* above 100 %: the ceiling is the same decode + transform in one process per worker, no "
        f"loader, measured between the loaders in each round ({low:.0f}-{high:.0f} img/s here), so it "
        f"moves with the machine's load; and img/s after the first batch starts its clock when the "
        f"other workers' first batches are nearly done (up to {head_start:.0%} more on {batches}-batch "
        f"epochs with {_workers(local.workers)}). {verdict}",
        width=96, initial_indent="  ", subsequent_indent="    ")


def summary(scenarios: list[Scenario], args: argparse.Namespace) -> str:
    """One line: aioload against torch in each scenario, and against the ceiling."""
    local = next((s for s in scenarios if s.ceiling), None)
    parts = []
    for s in scenarios:
        t, a = (s.comparison.med(name, "rate") for name in LOADERS)
        ratio = f"{a / t:.2f}x" + (" torch's img/s" if not parts else "") if t else "no torch figure"
        where = "on local files" if s.key == "local" else f"behind {args.latency_ms:g} ms of HTTP latency"
        ceiling = ""
        if local is not None:
            ceiling = f" ({_efficiency(a, local.ceiling)[0]} of the {'local ' if s is not local else ''}ceiling)"
        parts.append(f"{ratio} {where}{ceiling}")
    return f"summary: aioload delivered {' and '.join(parts)}, with {_workers(args.workers)} each"


def next_step(args: argparse.Namespace) -> str:
    """What to run next, given what this run measured."""
    step = "--step-ms 30 adds a 30 ms training step to each batch, and the table shows how long it stood idle"
    if args.data is None:
        return ("next: aioload bench --data DIR measures your own images (class folders of JPEGs, as "
                "ImageFolder reads)" + ("" if args.step_ms else f"; {step}"))
    if not args.step_ms:
        return f"next: {step}"
    return "next: put aioload.DataLoader into your training loop (README.md: the one-line change)"


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} m {seconds} s" if minutes else f"{seconds} s"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def bench(args: argparse.Namespace) -> int:
    from aioload._tools.bench import environment

    if args.plot is not None:
        from aioload._tools.benchplot import check

        problem = check(args.plot)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    run, started = environment(), time.monotonic()  # its time stamp: the start
    root = _data(args)
    local = _local_images(root)
    if local is None:
        return 2
    print(f"run: {run}", flush=True)
    scenarios = _run_scenarios(args, root, local)
    if isinstance(scenarios, int):
        return scenarios
    print()
    print(table(scenarios, step=args.step_ms > 0))
    for s in scenarios:
        last = s.comparison.runs[LOADERS[1]][-1].stats
        if last is not None:
            print(f"\naioload pipeline, {s.title} (its last round; loader.stats()):")
            print(_stats_text(last))
    if args.plot is not None:
        from aioload._tools.benchplot import plot

        plot(args.plot, scenarios)
        print(f"\nplot: {args.plot}")
    print(f"\nrun: {run}, took {_duration(time.monotonic() - started)}")
    print(f"command: aioload bench {' '.join(sys.argv[2:])}".rstrip())
    print()
    print(summary(scenarios, args))
    print(next_step(args))
    return 0


def make_data_command(args: argparse.Namespace) -> int:
    from aioload._data.synth import made_with, make_data

    if args.format == "parquet":
        from aioload._data.synth import make_parquet

        root = make_parquet(args.dir, args.images, classes=args.classes, seed=args.seed, quiet=False,
                            processes=os.cpu_count() or 1)
        print(f"{args.images} JPEGs in {args.classes} classes as Parquet files under {root}")
        return 0
    before = made_with(args.dir)
    if before == {"images": args.images, "classes": args.classes, "seed": args.seed}:
        print(f"{args.dir} already holds these {args.images} generated JPEGs: nothing to do")
        return 0
    root = make_data(args.dir, args.images, classes=args.classes, seed=args.seed, quiet=False,
                     processes=os.cpu_count() or 1)
    was = f" (it held {before['images']})" if before is not None else ""
    print(f"{args.images} JPEGs in {args.classes} class folders under {root}{was}")
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


def _shard_files(dest: str, options: dict) -> tuple[list[str], list[str]]:
    """What the output folder ``dest`` holds: ``(every entry, the shards and sidecars among them)``."""
    from aioload._shards.index import SIDECAR
    from aioload._storage.storage import locate

    kind, where = locate(dest)
    if kind == "http":
        return [], []  # the writer refuses HTTP with its own message
    if kind == "local":
        if not os.path.isdir(where):
            return [], []
        entries = [os.path.join(where, name) for name in sorted(os.listdir(where))]
    else:
        import fsspec

        fs, path = fsspec.core.url_to_fs(dest, **options)
        try:
            entries = sorted(fs.ls(path, detail=False))
        except FileNotFoundError:
            return [], []
    return entries, [e for e in entries if e.endswith((".tar", ".tar" + SIDECAR))]


def _remove(paths: list[str], dest: str, options: dict) -> None:
    from aioload._storage.storage import locate

    if locate(dest)[0] == "local":
        for path in paths:
            os.remove(path)
        return
    import fsspec

    fsspec.core.url_to_fs(dest, **options)[0].rm(paths)


def make_shards_command(args: argparse.Namespace) -> int:
    from aioload._shards.writer import convert_folder, folder_keys, folder_samples
    from aioload._storage.storage import locate

    options = _storage_options(args.storage_options)
    kind, src = locate(args.src)
    if kind == "local" and not os.path.isdir(src):
        raise ValueError(f"{args.src} is not a folder: SRC is a class-per-folder tree (SRC/CLASS/IMAGE.jpg, as "
                         "ImageFolder reads it)")
    entries, shards = _shard_files(args.dest, options)
    if entries and not args.overwrite:
        raise ValueError(f"{args.dest} is not empty ({len(entries)} entries, such as "
                         f"{os.path.basename(entries[0].rstrip('/'))}): shards written beside old ones would be read "
                         "with them; write into an empty folder, or pass --overwrite to remove the shards there first")
    samples = folder_samples(args.src, options)[1]
    folder_keys(args.src, samples)  # two files of one sample key: a ValueError naming both, before anything is written
    total = len(samples)
    if shards:
        _remove(shards, args.dest, options)
        print(f"removed {len(shards)} old shard files (shards and their index sidecars) from {args.dest}")
    bar = None
    if sys.stderr.isatty():  # a bar on a terminal; a log or a pipe gets the summary alone
        from aioload._observe.monitor import tqdm_class

        bar = tqdm_class()(total=total, desc="  writing shards", unit="img", file=sys.stderr, dynamic_ncols=True)
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
        if shard.source == "sidecar" or (shard.source == "cache" and _sidecar_holds(storage, shard)):
            done = "its sidecar is up to date"
        elif locate(shard.url)[0] == "http" or args.cache_only:
            done = "indexed into the local cache only" + (" (HTTP takes no uploads)" if not args.cache_only else "")
        else:
            done = f"wrote {write_sidecar(shard.url, shard.index, options)}"
        print(f"{shard.url}: {len(shard.index)} samples{faults}; {done}")
    return 0


def _sidecar_holds(storage, shard) -> bool:
    """Whether the sidecar beside ``shard`` (an index found in the local cache) already holds
    its index, byte for byte: then a run after a ``--cache-only`` one, or a second run, touches
    nothing."""
    from aioload._shards.index import SIDECAR
    from aioload._storage.storage import locate

    if locate(shard.url)[0] == "http":
        return False
    try:
        return storage.read_bytes_blocking(shard.url + SIDECAR) == shard.index.to_json().encode()
    except OSError:  # none yet, or unreadable: write it
        return False


def _scenarios(text: str) -> list[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [c for c in chosen if c not in SCENARIOS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"scenarios are a comma-separated list of {', '.join(SCENARIOS)}, "
                                         f"got {text!r}")
    return list(dict.fromkeys(chosen))


class _TopHelp(argparse.RawDescriptionHelpFormatter):
    """argparse aligns the commands' help as if the command names were not indented below
    COMMAND, and wraps the longest one onto a line of its own: count their indent."""

    def add_argument(self, action):
        if isinstance(action.choices, dict):  # the commands
            self._indent()
            super().add_argument(action)
            self._dedent()
        else:
            super().add_argument(action)


def parser() -> argparse.ArgumentParser:
    from aioload import __version__

    help_fmt = argparse.RawDescriptionHelpFormatter
    top = argparse.ArgumentParser(prog="aioload", description=DESCRIPTION, epilog=EPILOG, formatter_class=_TopHelp)
    top.add_argument("--version", action="version", version=f"aioload {__version__}")
    # the commands are listed once, by argparse, from each add_parser's help
    sub = top.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    b = sub.add_parser(
        "bench", help="aioload against torch's DataLoader on local files and over HTTP", epilog=EPILOG,
        formatter_class=help_fmt,
        description="Measure torch's DataLoader and aioload's side by side, with the same dataset, transform\n"
                    "(RandomResizedCrop 224 + flip) and workers, in interleaved rounds, in two scenarios:\n"
                    "a local folder of JPEGs, and the same images behind an HTTP server on 127.0.0.1 that\n"
                    "answers each request after a round trip (the bench starts and stops it). Prints one\n"
                    "table of medians, aioload's own statistics for each scenario, and a one-line summary.\n"
                    "Progress bars are drawn on a terminal only; each round's result is a line on stderr.")
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
    b.add_argument("--io-concurrency", type=_int_or_auto, default="auto",
                   help="aioload's reads in flight: a number, or auto (the loader's default: each worker's "
                        "limit grows while its decoding waits on reads held at it) (default: %(default)s)")
    b.add_argument("--queue-depth", type=int, default=None,
                   help="aioload's finished batches buffered ahead of the consumer (default: the loader's "
                        "own, max(2, 2 x workers / 2): 2 with 2 workers)")
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
    m.add_argument("--format", choices=("folder", "parquet"), default="folder",
                   help="folder: class folders of JPEGs; parquet: the same images in Parquet files, as the "
                        "Hugging Face Hub keeps image sets (image and label columns, a page per image and a page index, "
                        "so that a uniform shuffle reads one page per row; needs pyarrow) "
                        "(default: %(default)s)")
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
    s.add_argument("--overwrite", action="store_true",
                   help="write into a DEST that is not empty, removing the shards (.tar) and index sidecars "
                        "there first; without it a DEST that holds anything is refused")
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


def _int_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)
    positive = {"bench": ("workers", "batch_size", "io_concurrency", "queue_depth", "rounds", "images"),
                "make-data": ("images", "classes"), "make-shards": ("maxcount", "maxsize"), "index": ()}[args.command]
    for name in positive:
        if getattr(args, name) not in ("auto", None) and getattr(args, name) < 1:
            top.error(f"--{name.replace('_', '-')} must be >= 1")
    commands = {"make-data": make_data_command, "make-shards": make_shards_command, "index": index_command}
    if args.command in commands:
        try:
            return commands[args.command](args)
        except (OSError, ValueError, ImportError) as exc:
            # a path missing or unreadable, an argument or a file the library refuses, an extra not
            # installed: the message names it, and a traceback would only bury it
            print(f"error: aioload {args.command}: {exc}", file=sys.stderr)
            return 1
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
