"""Images in Parquet: aioload.Parquet against Hugging Face ``datasets`` (streaming and its
map-style Arrow cache) and LitData's Parquet reader, locally and behind HTTP latency.

    python benchmarks/parquet.py                 # 2,048 images in 8 class-sorted files; local and 20 ms
    python benchmarks/parquet.py --images 512 --rounds 1 --json out.json

The data: ``aioload make-data --format parquet``'s files (``aioload._tools.synth.make_parquet``):
``--images`` synthetic ImageNet-like JPEGs in ``--classes`` classes, laid out as the Hub's image
sets (an ``image`` struct ``{"bytes", "path"}`` and a ``label`` column, ``datasets``' ``Image``
feature, row groups of 100 rows, a page per image and a page index), ``--rows-per-file`` rows a
file, sorted by class: a loader that shuffles poorly shows it in the classes per batch. Made once, in ``$AIOLOAD_CACHE``, with the
same images as loose JPEGs for the ceiling and torch's row.

Every row decodes with ``aioload.decode_image`` and applies ``RandomResizedCrop(224)`` + flip
on uint8 tensors, in batches of ``--batch-size`` with ``--workers`` worker processes:

* ``aioload uniform``: ``aioload.Parquet(files, columns=["image", "label"], decode=...)``, a
  uniform shuffle over rows: through the page index, each row's image page fetched in the
  worker that decodes it (and each row group's small label and path chunks once per worker),
  kept in each worker's cache of ``--cache-mb`` (smaller than the data, as for a real set);
* ``aioload window=K``: the same with ``window=K``, rows drawn from K row groups at a time;
* ``datasets streaming``: ``load_dataset("parquet", data_files=files, streaming=True)
  .shuffle(seed, buffer_size=1000)`` (its recipe: files shuffled, a buffer of 1,000 rows),
  the image column cast to ``Image(decode=False)`` so that the decode is the same, iterated
  in torch's DataLoader (``datasets`` splits the files between the workers);
* ``datasets Arrow``: ``load_dataset("parquet", data_files=files)`` (converted once into its
  Arrow cache: the disk column), indexed by torch's DataLoader with ``shuffle=True``; local only;
* ``LitData``: ``litdata.StreamingDataset(folder, item_loader=ParquetLoader(), shuffle=True)``
  in its ``StreamingDataLoader`` after ``litdata.index_parquet_dataset`` (its ``index.json``);
  local only (it reads object stores, not a latency server); its workers are spawned, as it
  requires with this reader (polars' threads do not survive ``fork``), and start each epoch;
* ``torch ImageFolder (files)``: torch's DataLoader over the same images as loose local files,
  the reference for main-process CPU per image.

Scenarios: ``local``, and for each of ``--latencies`` the files behind
``aioload._tools.benchserver`` on 127.0.0.1 (each request answered after L ms, each body paced
to ``--mb-per-s``; Range supported). Columns as in ``benchmarks/shards.py``: img/s after the
first ``--skip-batches`` + 1 batches; the share of the local ceiling (the same decode +
transform on the loose files in ``--workers`` bare processes); main-process CPU ms per image;
storage requests per sample (counted by the server); peak memory (PSS); disk beyond the
files; distinct classes per batch (a uniform shuffle's figure is printed beside it). Numbers
from a shared machine are noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch

import aioload
from aioload._tools import benchscenarios
from aioload._tools.bench import BenchImages, median, rrc_flip
from aioload._tools.benchscenarios import COLUMNS, aioload_loader, decode_pair, folder_bytes, uniform_classes
from aioload._storage.cachedir import cache_dir
from aioload._tools.synth import make_image_folder, make_parquet

UNIFORM = "aioload uniform"
STREAMING = "datasets streaming"
ARROW = "datasets Arrow"
LITDATA = "LitData"
TORCH_FILES = "torch ImageFolder (files)"

def decode_row(row):
    return decode_pair(row["image"]["bytes"], row["label"])


# ----------------------------------------------------------------------------- the data


class Data:
    """The Parquet files, LitData's index of a copy of them, and the same images as files."""

    def __init__(self, images: int, classes: int, rows_per_file: int):
        base = cache_dir() / f"parquet-bench-paged-{images}-{classes}-{rows_per_file}"
        processes = os.cpu_count() or 1
        self.base = base
        self.folder = make_parquet(base / "parquet", images, classes=classes, seed=0, processes=processes,
                                   rows_per_file=rows_per_file, quiet=False)
        self.files = sorted(p.name for p in self.folder.glob("*.parquet"))
        self.root = make_image_folder(base / "images", images=images, classes=classes, seed=0, processes=processes)
        self.labels = [int(x) for x in aioload.Parquet(self.folder, columns=["label"]).read_column("label").to_pylist()]

    def paths(self) -> list[str]:
        return [p for p, _ in aioload.ImageFolder(self.root).samples]

    def urls(self, base: str | None) -> list[str]:
        return [(base if base is not None else str(self.folder) + "/") + name for name in self.files]

    def litdata_folder(self) -> Path:
        """A copy of the files with LitData's ``index.json`` beside them (made on first use)."""
        folder = self.base / "litdata"
        if not (folder / "index.json").exists():
            import litdata

            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            for name in self.files:
                os.link(self.folder / name, folder / name)
            litdata.index_parquet_dataset(str(folder))
        return folder

    def arrow(self):
        """``datasets``' map-style dataset of the files (its Arrow cache made on first use)."""
        import datasets

        ds = datasets.load_dataset("parquet", data_files=self.urls(None), split="train",
                                   cache_dir=str(self.base / "hf-cache"))
        return ds.cast_column("image", datasets.Image(decode=False))


# ----------------------------------------------------------------------------- the loaders


class Streaming(torch.utils.data.IterableDataset):
    """``datasets``' streaming recipe with the same decode; ``datasets`` gives each of torch's
    workers its share of the files."""

    def __init__(self, urls: list[str], seed: int):
        self.urls, self.seed = urls, seed

    def __iter__(self):
        import datasets

        datasets.disable_progress_bars()
        ds = datasets.load_dataset("parquet", data_files=self.urls, split="train", streaming=True)
        ds = ds.cast_column("image", datasets.Image(decode=False)).shuffle(seed=self.seed, buffer_size=1000)
        for row in ds:
            yield decode_row(row)


class Arrow(torch.utils.data.Dataset):
    """``datasets``' map-style dataset (memory-mapped Arrow) with the same decode."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index):
        return decode_row(self.ds[index])


try:
    import litdata
    from litdata.streaming.item_loader import ParquetLoader
except ImportError:  # pragma: no cover - the LitData row needs it
    litdata = None
else:
    class LitRows(litdata.StreamingDataset):
        """LitData's StreamingDataset over Parquet with the same decode."""

        def __getitem__(self, index):
            return decode_row(super().__getitem__(index))


def rows_for(scenario: str, data: Data, base: str | None, args) -> dict:
    """name -> factory(epoch) of the loader, for one scenario."""
    urls = data.urls(base)
    storage = aioload.Storage(connections_per_host=max(64, args.io_concurrency))
    cache = int(args.cache_mb * 2**20)
    uniform = aioload.Parquet(urls, columns=["image", "label"], decode=decode_row, storage=storage,
                              cache_bytes=cache)
    window = aioload.Parquet(urls, columns=["image", "label"], decode=decode_row, storage=storage,
                             window=args.window, cache_bytes=cache)
    torch_loader = torch.utils.data.DataLoader
    rows = {
        UNIFORM: lambda epoch: aioload_loader(uniform, args, epoch),
        f"aioload window={args.window}": lambda epoch: aioload_loader(window, args, epoch),
        STREAMING: lambda epoch: torch_loader(Streaming(urls, epoch), batch_size=args.batch_size,
                                              num_workers=args.workers, drop_last=True),
    }
    if scenario == "local":
        arrow = Arrow(data.arrow())
        rows[ARROW] = lambda epoch: torch_loader(arrow, batch_size=args.batch_size, shuffle=True,
                                                 num_workers=args.workers, drop_last=True)
        if litdata is not None:
            folder = str(data.litdata_folder())
            rows[LITDATA] = lambda epoch: litdata.StreamingDataLoader(
                LitRows(folder, item_loader=ParquetLoader(), shuffle=True, seed=epoch),
                batch_size=args.batch_size, num_workers=args.workers, drop_last=True,
                multiprocessing_context="spawn")  # LitData refuses fork with its Parquet reader (polars' threads)
        files = BenchImages(data.root, rrc_flip())
        rows[TORCH_FILES] = lambda epoch: torch_loader(files, batch_size=args.batch_size, shuffle=True,
                                                       num_workers=args.workers, drop_last=True)
    return rows


def extra_disk(name: str, data: Data) -> int:
    if name == ARROW:
        return folder_bytes(data.base / "hf-cache")
    if name == LITDATA:
        return (data.base / "litdata" / "index.json").stat().st_size
    if name.startswith("aioload"):
        return folder_bytes(cache_dir() / "parquet-footer")
    return 0


# ----------------------------------------------------------------------------- running


def run(args) -> dict:
    benchscenarios.check_images(args)
    data = Data(args.images, args.classes, args.rows_per_file)
    out, ceilings = benchscenarios.run_scenarios(
        args, data.folder, lambda s, base: rows_for(s, data, base, args), data.paths(),
        lambda name, result: {"disk_mb": extra_disk(name, data) / 1e6}, width=26)
    return {"rows": out, "local_ceiling_img_s": median(ceilings), "ceilings": ceilings,
            "uniform_classes_per_batch": uniform_classes(data.labels, args.batch_size), "files": len(data.files)}


def print_result(result: dict, args) -> None:
    print(f"\n## Parquet: {args.images} images in {result['files']} class-sorted files, row groups of 100 rows, "
          f"{args.classes} classes; RandomResizedCrop(224) + flip, batch {args.batch_size}, {args.workers} workers, "
          f"{args.rounds} rounds; aioload's row group cache {args.cache_mb:g} MB a worker; HTTP paced to "
          f"{args.mb_per_s:g} MB/s per response\n")
    benchscenarios.print_table(result, args, COLUMNS, width=26)
    print_goals(result)


def print_goals(result: dict) -> None:
    rows = {(r["scenario"], r["row"]): r for r in result["rows"]}
    lines = []
    for name in [n for (s, n) in rows if n.startswith("aioload") and s == "local"]:
        row = rows["local", name]
        for other, goal in ((STREAMING, 1.5), (LITDATA, 1.0), (ARROW, None), (TORCH_FILES, None)):
            if ("local", other) in rows and rows["local", other]["img_s"]:
                ratio = row["img_s"] / rows["local", other]["img_s"]
                lines.append(f"locally, {name}: {ratio:.2f}x {other}'s img/s"
                             + (f" (goal >= {goal:g})" if goal else ""))
        remote = rows.get(("20 ms", name))
        if remote is not None and row["img_s"]:
            lines.append(f"behind 20 ms, {name}: {remote['img_s'] / row['img_s']:.0%} of its local img/s (goal >= 90%)")
    lines += benchscenarios.class_mix(result, UNIFORM, TORCH_FILES, "within 1%")
    print("\n" + "\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--rows-per-file", type=int, default=256)
    parser.add_argument("--latencies", type=lambda t: [float(x) for x in t.split(",") if x.strip()], default=[20.0],
                        help="HTTP latencies in ms, comma-separated (default: 20)")
    parser.add_argument("--no-local", action="store_true", help="skip the local scenario")
    parser.add_argument("--mb-per-s", type=float, default=200.0, help="each HTTP response's pace (default: 200)")
    parser.add_argument("--window", type=int, default=8, help="aioload's window mode: row groups open at a time")
    parser.add_argument("--cache-mb", type=float, default=64.0,
                        help="aioload's row group (and page) cache per worker (default: 64, a few row groups)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--io-concurrency", type=int, default=64)
    parser.add_argument("--skip-batches", type=int, default=2,
                        help="batches not counted after the first one (the read-ahead buffers)")
    parser.add_argument("--json", help="also write the rows and settings to this file")
    args = parser.parse_args(argv)
    return benchscenarios.main("Images in Parquet: aioload, datasets, LitData, torch", "benchmarks/parquet.py", args,
                               argv, run, print_result)


if __name__ == "__main__":
    sys.exit(main())
