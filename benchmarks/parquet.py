"""Images in Parquet: aioload.Parquet against Hugging Face ``datasets`` (streaming and its
map-style Arrow cache) and LitData's Parquet reader, locally and behind HTTP latency.

    python benchmarks/parquet.py                 # 2,048 images in 8 class-sorted files; local and 20 ms
    python benchmarks/parquet.py --images 512 --rounds 1 --json out.json
    python benchmarks/parquet.py --images 4000 --scale 1.45   # 4,000 photos of about 136 KiB
    python benchmarks/parquet.py --images 4000 --scale 1.45 --writer datasets --cache-mb 16 --latencies ""
    python benchmarks/parquet.py --images 4000 --scale 1.45 --no-decode      # the per-row cost alone

With ``--scale`` (each side of the photos that many times make-data's) or ``--writer datasets``
the photos are made here instead (once, in ``$AIOLOAD_CACHE/parquet-bench-photos-...``, with
as many processes as CPUs), then written as Parquet files sorted by class: as make-data lays
them out (``--writer aioload``: a page per image), or by ``datasets``' ``to_parquet`` with its
defaults (``--writer datasets``: one row group a file here, content-defined pages of
256 KiB-1 MiB, several photos each, and a page index). ``--no-decode``: every row yields its
image's byte count instead of the decoded crop (no ``torch ImageFolder`` row then), so the
table shows what each loader costs per row.

The data: ``aioload make-data --format parquet``'s files (``aioload._data.synth.make_parquet``):
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

import numpy as np
import torch

import aioload
from aioload._tools import benchscenarios
from aioload._tools.bench import BenchImages, median, rrc_flip
from aioload._tools.benchscenarios import COLUMNS, aioload_loader, decode_pair, folder_bytes, uniform_classes
from aioload._storage.cachedir import cache_dir
from aioload._data.synth import PARQUET_ROWS_PER_GROUP, PARQUET_WRITE_OPTIONS, make_image_folder, make_parquet
from aioload._data.synth import _image as synth_image

UNIFORM = "aioload uniform"
STREAMING = "datasets streaming"
ARROW = "datasets Arrow"
LITDATA = "LitData"
TORCH_FILES = "torch ImageFolder (files)"

class Decode:
    """What every row does with a Parquet row: its JPEG decoded, cropped and flipped
    (``decode_pair``), or with ``--no-decode`` only its byte count (the loaders' own per-row
    cost, without the decode that hides it). An object, so that it travels to spawned workers."""

    def __init__(self, decode: bool = True):
        self.decode = decode

    def __call__(self, row):
        if self.decode:
            return decode_pair(row["image"]["bytes"], row["label"])
        return torch.tensor(len(row["image"]["bytes"])), int(row["label"])


# ----------------------------------------------------------------------------- the data


def _photo(args) -> None:
    """Photos ``lo..hi`` of a folder: ``make-data``'s images with each side ``scale`` times as long."""
    from PIL import Image

    root, classes, scale, lo, hi = args
    for i in range(lo, hi):
        path = root / f"class_{i % classes:03d}" / f"img_{i:06d}.jpg"
        if path.exists():
            continue
        rng = np.random.default_rng([0, i])
        width, height = int(rng.integers(330, 500) * scale), int(rng.integers(280, 420) * scale)
        quality = int(rng.integers(85, 96))
        tmp = path.with_suffix(".tmp")
        Image.fromarray(synth_image(rng, width, height)).save(tmp, format="JPEG", quality=quality)
        os.replace(tmp, path)


def make_photos(root: Path, images: int, classes: int, scale: float) -> Path:
    """(Once) a folder of larger photos in ``make-data``'s layout (``--scale 1.45``: about 144 KiB)."""
    if (root / ".complete").exists():
        return root
    for c in range(classes):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    import multiprocessing as mp

    jobs = [(root, classes, scale, lo, min(lo + 100, images)) for lo in range(0, images, 100)]
    with mp.get_context("fork").Pool(os.cpu_count() or 1) as pool:
        for done, _ in enumerate(pool.imap_unordered(_photo, jobs), 1):
            benchscenarios.progress(f"photos: {min(done * 100, images)}/{images}")
    (root / ".complete").touch()
    return root


def write_parquet(photos: Path, root: Path, classes: int, rows_per_file: int, writer: str) -> Path:
    """(Once) the photos as Parquet files sorted by class, as ``make-data`` lays them out
    (``writer="aioload"``: a page per image) or as ``datasets``' ``to_parquet`` writes them by
    default (``"datasets"``: pages of 256 KiB-1 MiB, several images each)."""
    import datasets

    if (root / ".complete").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    datasets.disable_progress_bars()
    folder = aioload.ImageFolder(photos)
    samples = sorted(folder.samples, key=lambda s: (s[1], s[0]))  # class by class
    files = -(-len(samples) // rows_per_file)
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=[f"class_{c:03d}" for c in range(classes)])})
    for n in range(files):
        part = samples[n * rows_per_file:(n + 1) * rows_per_file]
        rows = {"image": [{"bytes": Path(p).read_bytes(), "path": os.path.basename(p)} for p, _ in part],
                "label": [c for _, c in part]}
        path = root / f"train-{n:05d}-of-{files:05d}.parquet"
        ds = datasets.Dataset.from_dict(rows, features=features)
        if writer == "datasets":
            ds.to_parquet(str(path))
        else:
            import pyarrow.parquet as pq

            pq.write_table(ds.data.table, path, row_group_size=PARQUET_ROWS_PER_GROUP, **PARQUET_WRITE_OPTIONS)
    (root / ".complete").touch()
    return root


class Data:
    """The Parquet files, LitData's index of a copy of them, and the same images as files."""

    def __init__(self, images: int, classes: int, rows_per_file: int, scale: float = 1.0, writer: str = "aioload"):
        processes = os.cpu_count() or 1
        if scale == 1.0 and writer == "aioload":  # make-data's images and files
            base = cache_dir() / f"parquet-bench-paged-{images}-{classes}-{rows_per_file}"
            self.folder = make_parquet(base / "parquet", images, classes=classes, seed=0, processes=processes,
                                       rows_per_file=rows_per_file, quiet=False)
            self.root = make_image_folder(base / "images", images=images, classes=classes, seed=0,
                                          processes=processes)
        else:
            base = cache_dir() / f"parquet-bench-photos-{images}-{classes}-x{scale:g}"
            self.root = make_photos(base / "images", images, classes, scale)
            self.folder = write_parquet(self.root, base / f"{writer}-{rows_per_file}", classes, rows_per_file, writer)
            base = self.folder  # LitData's copy and datasets' Arrow cache, beside each set of files
        self.base = base
        self.files = sorted(p.name for p in self.folder.glob("*.parquet"))
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

    def __init__(self, urls: list[str], seed: int, decode: Decode):
        self.urls, self.seed, self.decode = urls, seed, decode

    def __iter__(self):
        import datasets

        datasets.disable_progress_bars()
        ds = datasets.load_dataset("parquet", data_files=self.urls, split="train", streaming=True)
        ds = ds.cast_column("image", datasets.Image(decode=False)).shuffle(seed=self.seed, buffer_size=1000)
        for row in ds:
            yield self.decode(row)


class Arrow(torch.utils.data.Dataset):
    """``datasets``' map-style dataset (memory-mapped Arrow) with the same decode."""

    def __init__(self, ds, decode: Decode):
        self.ds, self.decode = ds, decode

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index):
        return self.decode(self.ds[index])


try:
    import litdata
    from litdata.streaming.item_loader import ParquetLoader
except ImportError:  # pragma: no cover - the LitData row needs it
    litdata = None
else:
    class LitRows(litdata.StreamingDataset):
        """LitData's StreamingDataset over Parquet with the same decode."""

        def __init__(self, *args, decode: Decode, **kwargs):
            super().__init__(*args, **kwargs)
            self.decode = decode

        def __getitem__(self, index):
            return self.decode(super().__getitem__(index))


def rows_for(scenario: str, data: Data, base: str | None, args) -> dict:
    """name -> factory(epoch) of the loader, for one scenario."""
    urls = data.urls(base)
    storage = aioload.Storage(connections_per_host=max(64, args.io_concurrency))
    cache = int(args.cache_mb * 2**20)
    decode = Decode(not args.no_decode)
    uniform = aioload.Parquet(urls, columns=["image", "label"], decode=decode, storage=storage,
                              cache_bytes=cache)
    window = aioload.Parquet(urls, columns=["image", "label"], decode=decode, storage=storage,
                             window=args.window, cache_bytes=cache)
    torch_loader = torch.utils.data.DataLoader
    rows = {
        UNIFORM: lambda epoch: aioload_loader(uniform, args, epoch),
        f"aioload window={args.window}": lambda epoch: aioload_loader(window, args, epoch),
        STREAMING: lambda epoch: torch_loader(Streaming(urls, epoch, decode), batch_size=args.batch_size,
                                              num_workers=args.workers, drop_last=True),
    }
    if scenario == "local":
        arrow = Arrow(data.arrow(), decode)
        rows[ARROW] = lambda epoch: torch_loader(arrow, batch_size=args.batch_size, shuffle=True,
                                                 num_workers=args.workers, drop_last=True)
        if litdata is not None:
            folder = str(data.litdata_folder())
            rows[LITDATA] = lambda epoch: litdata.StreamingDataLoader(
                LitRows(folder, item_loader=ParquetLoader(), shuffle=True, seed=epoch, decode=decode),
                batch_size=args.batch_size, num_workers=args.workers, drop_last=True,
                multiprocessing_context="spawn")  # LitData refuses fork with its Parquet reader (polars' threads)
        if not args.no_decode:
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
    data = Data(args.images, args.classes, args.rows_per_file, args.scale, args.writer)
    out, ceilings = benchscenarios.run_scenarios(
        args, data.folder, lambda s, base: rows_for(s, data, base, args), data.paths(),
        lambda name, result: {"disk_mb": extra_disk(name, data) / 1e6}, width=26)
    return {"rows": out, "local_ceiling_img_s": median(ceilings), "ceilings": ceilings,
            "uniform_classes_per_batch": uniform_classes(data.labels, args.batch_size), "files": len(data.files)}


def print_result(result: dict, args) -> None:
    what = "byte count (no decode)" if args.no_decode else "RandomResizedCrop(224) + flip"
    print(f"\n## Parquet: {args.images} images (x{args.scale:g} make-data's sides) in {result['files']} class-sorted "
          f"files written as {args.writer} writes them, {args.classes} classes; {what}, batch {args.batch_size}, "
          f"{args.workers} workers, "
          f"{args.rounds} rounds; aioload's row group cache {args.cache_mb:g} MB a worker; HTTP paced to "
          f"{args.mb_per_s:g} MB/s per response\n")
    benchscenarios.print_table(result, args, COLUMNS, width=26)
    print_goals(result)


def print_goals(result: dict) -> None:
    rows = {(r["scenario"], r["row"]): r for r in result["rows"]}
    lines = []
    for name in [n for (s, n) in rows if n.startswith("aioload") and s == "local"]:
        row = rows["local", name]
        lit = 1.2 if name == UNIFORM else 1.0  # issue 39's goals
        for other, goal in ((STREAMING, 1.5), (LITDATA, lit), (ARROW, None), (TORCH_FILES, None)):
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
    parser.add_argument("--scale", type=float, default=1.0,
                        help="each side of the photos this many times make-data's (1.45: photos of about 144 KiB)")
    parser.add_argument("--writer", choices=["aioload", "datasets"], default="aioload",
                        help="how the files are written: make-data's layout (a page per image), or datasets' "
                             "to_parquet defaults (pages of 256 KiB-1 MiB)")
    parser.add_argument("--no-decode", action="store_true",
                        help="rows yield their image's byte count instead of decoding it: the loaders' per-row cost")
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
