"""Tar shards: aioload's two modes against webdataset's pipeline and LitData, locally and
behind HTTP latency.

    python benchmarks/shards.py                  # 4,000 images in 40 class-sorted shards; local, 20, 50 ms
    python benchmarks/shards.py --images 800 --latencies 20 --rounds 1 --json out.json

The data: ``--images`` synthetic ImageNet-like JPEGs (``aioload._data.synth``) in
``--classes`` class folders, written class by class (ImageFolder's order) by
``webdataset.ShardWriter`` into shards of ``--shard-size`` samples (``jpg`` + ``cls``), so
each shard holds one class: a loader that shuffles poorly shows it in the classes per batch.
LitData reads its own format: the same samples, in the same order, converted by
``litdata.optimize`` into chunks of ``--shard-size`` items. Everything is made once, in
``$AIOLOAD_CACHE``.

Every row decodes with ``aioload.decode_image`` and applies ``RandomResizedCrop(224)`` + flip
on uint8 tensors, in batches of ``--batch-size`` with ``--workers`` worker processes:

* ``aioload uniform``: ``aioload.WebDataset(shards)``, a uniform shuffle, one range request per
  sample (read in the workers);
* ``aioload window=K``: ``aioload.WebDataset(shards, window=K)``, whole shards fetched once,
  samples drawn from K shards at a time, each shard received by a worker;
* ``aioload window=K loader-fetch`` (behind HTTP): the same with ``window_fetch="loader"``, each
  shard received on the loader's event loop, in the training process;
* ``webdataset``: ``wds.WebDataset(shards, shardshuffle=len(shards), workersplitter=split_by_worker)
  .shuffle(1000).map(decode)`` in ``torch.utils.data.DataLoader`` (its recommended recipe; over
  HTTP it reads each shard with ``curl``);
* ``LitData``: ``litdata.StreamingDataset(chunks, shuffle=True)`` in its ``StreamingDataLoader``,
  on the local chunks only (it reads from object stores, not from a latency server);
* ``torch ImageFolder (files)``: torch's DataLoader over the same images as loose local files,
  locally only: the reference for main-process CPU per image.

Scenarios: ``local`` (shards on this disk) and, for each of ``--latencies``, the shards behind
``aioload._tools.benchserver`` on 127.0.0.1 (each request answered after L ms, each body paced
to ``--mb-per-s``; Range supported). Columns: img/s after the first ``--skip-batches`` + 1
batches; the share of the local ceiling (the same decode + transform on the local files in
``--workers`` bare processes, measured at the start of every round; the median of each round's
ratio, so that a machine busier in one round than another does not skew it); behind HTTP, the
CPUs the server process used over the measured interval (its CPU seconds over the interval's
wall time: it shares the machine's CPUs with the loaders) and the rate as a share of the
ceiling scaled to the CPUs left to the loaders (``ceiling x (CPUs - server's) / CPUs``): what
the loader itself loses, the server's share set aside; main-process CPU
ms per image
(``time.process_time``, every thread of the training process); storage requests per sample
(counted by the server, per sample of the epoch); peak memory (PSS of the training process and its workers); disk the
loader needs beyond the shards (LitData's converted copy; aioload's index cache); distinct
classes per batch (a uniform shuffle's figure is printed beside it). Rounds are interleaved
and medians are printed. Numbers from a shared machine are noisy: compare within one run.
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
from aioload._data.synth import make_image_folder

UNIFORM = "aioload uniform"
WEBDATASET = "webdataset"
LITDATA = "LitData"
TORCH_FILES = "torch ImageFolder (files)"

def decode_sample(sample):
    return decode_pair(sample["jpg"], sample["cls"])


# ----------------------------------------------------------------------------- the data


class Data:
    """The images, their webdataset shards and LitData's chunks, made once in the cache."""

    def __init__(self, images: int, classes: int, shard_size: int):
        base = cache_dir() / f"shards-bench-{images}-{classes}-{shard_size}"
        self.root = make_image_folder(base / "images", images=images, classes=classes, seed=0,
                                      processes=os.cpu_count() or 1)
        folder = aioload.ImageFolder(self.root)
        self.samples = [(p, t) for p, t in folder.samples]
        self.labels = [t for _, t in self.samples]
        self.shards = base / "wds"
        self.shard_count = -(-images // shard_size)
        self.pattern_name = f"wds-{{000000..{self.shard_count - 1:06d}}}.tar"
        if not (self.shards / ".complete").exists():
            self._write_shards(shard_size)
        self.chunks = base / "litdata"
        self.shard_size = shard_size

    def _write_shards(self, shard_size: int) -> None:
        import webdataset as wds

        shutil.rmtree(self.shards, ignore_errors=True)
        self.shards.mkdir(parents=True)
        with wds.ShardWriter(str(self.shards / "wds-%06d.tar"), maxcount=shard_size, verbose=0) as w:
            for path, target in self.samples:
                rel = os.path.relpath(path, self.root)[:-4]
                w.write({"__key__": rel, "jpg": Path(path).read_bytes(), "cls": target})
        (self.shards / ".complete").touch()

    def litdata_chunks(self) -> Path:
        """LitData's own copy (made on first use: ``litdata.optimize`` runs in processes)."""
        if not (self.chunks / ".complete").exists():
            import multiprocessing

            import litdata

            shutil.rmtree(self.chunks, ignore_errors=True)
            method = multiprocessing.get_start_method(allow_none=True)
            try:
                litdata.optimize(fn=_litdata_item, inputs=self.samples, output_dir=str(self.chunks),
                                 chunk_size=self.shard_size, num_workers=1, mode="overwrite")
            finally:  # optimize sets "spawn" for the whole process; the loaders measured use the default
                multiprocessing.set_start_method(method, force=True)
            (self.chunks / ".complete").touch()
        return self.chunks

    def pattern(self, base: str | None) -> str:
        return (base if base is not None else str(self.shards) + "/") + self.pattern_name

    def paths(self) -> list[str]:
        return [p for p, _ in self.samples]


def _litdata_item(sample):
    path, target = sample
    return {"jpg": Path(path).read_bytes(), "cls": target}


# ----------------------------------------------------------------------------- the loaders


try:
    import litdata
except ImportError:  # pragma: no cover - the LitData row needs it
    litdata = None
else:
    class LitImages(litdata.StreamingDataset):
        """LitData's StreamingDataset with the same decode."""

        def __getitem__(self, index):
            item = super().__getitem__(index)
            return decode_pair(item["jpg"], item["cls"])


def webdataset_loader(pattern: str, args, epoch: int):
    import webdataset as wds

    shards = len(wds.shardlists.expand_urls(pattern))
    ds = (wds.WebDataset(pattern, shardshuffle=shards, seed=epoch, workersplitter=wds.split_by_worker,
                         nodesplitter=None, empty_check=False)
          .shuffle(1000).map(decode_sample))
    return torch.utils.data.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers, drop_last=True)


def rows_for(scenario: str, data: Data, base: str | None, args) -> dict:
    """name -> factory(epoch) of the loader, for one scenario."""
    pattern = data.pattern(base)
    storage = aioload.Storage(connections_per_host=max(64, args.io_concurrency))
    uniform = aioload.WebDataset(pattern, decode=decode_sample, storage=storage)
    window = aioload.WebDataset(pattern, decode=decode_sample, window=args.window, storage=storage)
    rows = {
        UNIFORM: lambda epoch: aioload_loader(uniform, args, epoch),
        f"aioload window={args.window}": lambda epoch: aioload_loader(window, args, epoch),
    }
    if scenario != "local":  # the same, each shard received on the loader's loop (training process)
        here = aioload.WebDataset(pattern, decode=decode_sample, window=args.window, window_fetch="loader",
                                  storage=storage)
        rows[f"aioload window={args.window} loader-fetch"] = lambda epoch: aioload_loader(here, args, epoch)
    rows[WEBDATASET] = lambda epoch: webdataset_loader(pattern, args, epoch)
    if scenario == "local" and litdata is not None:
        chunks = data.litdata_chunks()
        rows[LITDATA] = lambda epoch: litdata.StreamingDataLoader(
            LitImages(str(chunks), shuffle=True, seed=epoch), batch_size=args.batch_size,
            num_workers=args.workers, drop_last=True)
    if scenario == "local":
        files = BenchImages(data.root, rrc_flip())
        rows[TORCH_FILES] = lambda epoch: torch.utils.data.DataLoader(
            files, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True)
    if args.rows:
        rows = {name: make for name, make in rows.items() if any(word in name for word in args.rows)}
    return rows


def extra_disk(name: str, data: Data) -> int:
    if name == LITDATA:
        return folder_bytes(data.chunks)
    if name.startswith("aioload"):
        return folder_bytes(cache_dir() / "shard-index")
    return 0


# ----------------------------------------------------------------------------- running


def run(args) -> dict:
    data = Data(args.images, args.classes, args.shard_size)
    benchscenarios.check_images(args)

    def extra(name, result):
        stats = result.stats
        return {"aioload_requests_per_sample": getattr(stats, "requests_per_sample", None),
                "window_peak_mb": (getattr(stats, "shard_window_peak_bytes", 0) or 0) / 1e6,
                "disk_mb": extra_disk(name, data) / 1e6}

    out, ceilings = benchscenarios.run_scenarios(args, data.shards, lambda s, base: rows_for(s, data, base, args),
                                                 data.paths(), extra, width=32)
    return {"rows": out, "local_ceiling_img_s": median(ceilings), "ceilings": ceilings,
            "uniform_classes_per_batch": uniform_classes(data.labels, args.batch_size),
            "shards": data.shard_count}


def print_result(result: dict, args) -> None:
    print(f"\n## Shards: {args.images} images in {result['shards']} class-sorted shards of {args.shard_size}, "
          f"{args.classes} classes; RandomResizedCrop(224) + flip, batch {args.batch_size}, {args.workers} workers, "
          f"{args.rounds} rounds; HTTP paced to {args.mb_per_s:g} MB/s per response\n")
    benchscenarios.print_table(result, args, COLUMNS, width=32)
    print_goals(result)


def print_goals(result: dict) -> None:
    rows = {(r["scenario"], r["row"]): r for r in result["rows"]}
    lines = []
    for name in [n for (s, n) in rows if n.startswith("aioload") and s == "20 ms"]:
        row = rows["20 ms", name]
        left = row["of_ceiling_left"]
        beside = (f"; {left:.0%} of it scaled to the CPUs the server left ({row['server_cpus']:.2f} of "
                  f"{benchscenarios.CPUS} "
                  "taken by the server)") if left is not None else ""
        lines.append(f"behind 20 ms, {name}: {row['of_local_ceiling']:.0%} of the local ceiling (goal >= 90%){beside}")
    lit = rows.get(("local", LITDATA))
    for name in [n for (s, n) in rows if n.startswith("aioload") and s == "local"]:
        row = rows["local", name]
        if lit is not None:
            lines.append(f"locally, {name}: {row['img_s'] / lit['img_s']:.2f}x LitData's img/s (goal >= 1)")
        torch_row = rows.get(("local", TORCH_FILES))
        if torch_row is not None:
            lines.append(f"locally, {name}: main-process CPU {row['cpu_ms_per_image']:.3f} ms/img, torch on files "
                         f"{torch_row['cpu_ms_per_image']:.3f} (goal: no more)")
    lines += benchscenarios.class_mix(result, UNIFORM, TORCH_FILES, "within 2%")
    print("\n" + "\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--shard-size", type=int, default=100, help="samples per shard (and per LitData chunk)")
    parser.add_argument("--latencies", type=lambda t: [float(x) for x in t.split(",") if x.strip()], default=[20.0, 50.0],
                        help="HTTP latencies in ms, comma-separated (default: 20,50)")
    parser.add_argument("--no-local", action="store_true", help="skip the local scenario")
    parser.add_argument("--mb-per-s", type=float, default=200.0, help="each HTTP response's pace (default: 200)")
    parser.add_argument("--window", type=int, default=8, help="aioload's window mode: shards open at a time")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--io-concurrency", type=int, default=64)
    parser.add_argument("--skip-batches", type=int, default=2,
                        help="batches not counted after the first one (the read-ahead buffers)")
    parser.add_argument("--rows", type=lambda t: [x.strip() for x in t.split(",") if x.strip()], default=None,
                        help="only the rows whose name holds one of these words, comma-separated (e.g. window)")
    parser.add_argument("--json", help="also write the rows and settings to this file")
    args = parser.parse_args(argv)
    return benchscenarios.main("Tar shards: aioload, webdataset, LitData", "benchmarks/shards.py", args, argv, run,
                               print_result)


if __name__ == "__main__":
    sys.exit(main())
