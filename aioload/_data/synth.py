"""The embedded default data: a folder of ImageNet-like synthetic JPEGs, made locally.

``aioload.make_data(root, n)`` (and ``aioload make-data DIR``) makes one anywhere; with no
``root`` it lands in the data cache, ``$AIOLOAD_CACHE`` (default ``~/.cache/aioload``), where
``aioload bench`` and the examples find it again.

Each image is a smooth random colour field with mid-frequency structure and fine grain, at
ImageNet's typical size (about 400x350, varied) and JPEG quality 85-95, so that it decodes at
the cost of a real photo and compresses to a realistic size. Generation is seeded: the same
arguments always give the same files. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from aioload._storage.cachedir import cache_dir

DEFAULT_IMAGES = 1024
DEFAULT_CLASSES = 8


def _image(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    from PIL import Image

    def field(cells_x: int, cells_y: int, channels: int, amplitude: float) -> np.ndarray:
        small = rng.uniform(0, 255, size=(cells_y, cells_x, channels)).astype(np.uint8)
        mode = "RGB" if channels == 3 else "L"
        up = Image.fromarray(small if channels == 3 else small[..., 0], mode).resize((width, height), Image.BICUBIC)
        arr = np.asarray(up, dtype=np.float32)
        if channels == 1:
            arr = arr[..., None]
        return (arr - 127.5) * amplitude

    base = field(rng.integers(3, 7), rng.integers(3, 7), 3, 0.9) + 127.5
    detail = field(rng.integers(24, 48), rng.integers(24, 48), 1, 0.35)
    grain = rng.normal(0, 13, size=(height, width, 1)).astype(np.float32)
    return np.clip(base + detail + grain, 0, 255).astype(np.uint8)


def _name(classes: int, i: int) -> str:
    return f"class_{i % classes:03d}/img_{i:06d}.jpg"


def _jpeg(seed: int, i: int, out) -> None:
    """Image ``i``'s JPEG, written to ``out`` (a path or a file object)."""
    from PIL import Image

    rng = np.random.default_rng([seed, i])
    width, height = int(rng.integers(330, 500)), int(rng.integers(280, 420))
    quality = int(rng.integers(85, 96))
    pixels = _image(rng, width, height)
    Image.fromarray(pixels).save(out, format="JPEG", quality=quality)


def _write(root: Path, classes: int, seed: int, i: int) -> None:
    path = root / _name(classes, i)
    if path.exists():
        return
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    _jpeg(seed, i, tmp)
    os.replace(tmp, path)


def _write_range(args) -> int:
    root, classes, seed, indices = args
    for i in indices:
        _write(root, classes, seed, i)
    return len(indices)


class _Report:
    """``generated k/n images`` on stderr as the folder fills, at most once per tenth of it:
    lines, not a bar, so that a log or a pipe gets ten of them at most, as a terminal does."""

    def __init__(self, images: int, quiet: bool):
        self.images, self.quiet, self.shown = images, quiet, 0

    def __call__(self, done: int) -> None:
        tenth = done * 10 // self.images
        if not self.quiet and tenth > self.shown:
            self.shown = tenth
            print(f"  generated {done}/{self.images} images", file=sys.stderr, flush=True)


def default_root(images: int = DEFAULT_IMAGES, classes: int = DEFAULT_CLASSES, seed: int = 0) -> Path:
    """Where :func:`make_data` puts a folder when it is given none: in :func:`cache_dir`."""
    return cache_dir() / f"imagenet-like-{images}-{classes}-s{seed}"


_ASKED = ("images", "classes", "seed")
"""What a generated folder's ``.complete`` marker records (JSON): the arguments that made it."""


def made_with(root: str | os.PathLike) -> dict[str, int] | None:
    """What a folder that :func:`make_data` finished was made with (``images``, ``classes``,
    ``seed``, from its ``.complete`` marker), or ``None``: unfinished, or marked by an older
    aioload whose marker says nothing."""
    try:
        made = json.loads((Path(root) / ".complete").read_text())
    except (OSError, ValueError):
        return None
    return made if isinstance(made, dict) and set(made) == set(_ASKED) else None


def is_complete(root: str | os.PathLike) -> bool:
    """``root`` holds a folder that :func:`make_data` finished (it is reused as it is)."""
    return made_with(root) is not None


def make_data(root: str | os.PathLike | None = None, n: int = DEFAULT_IMAGES, *,
              classes: int = DEFAULT_CLASSES, seed: int = 0, processes: int = 1,
              quiet: bool = True) -> Path:
    """Make (once) a folder of ``n`` synthetic ImageNet-like JPEGs for trying a loader.

    The layout is ``aioload.ImageFolder``'s (and torchvision's): ``root/class_000/img_000000.jpg``
    and so on, ``classes`` class folders, image ``i`` in class ``i % classes``. Images are about
    400x350 px at JPEG quality 85-95, so they decode at the cost of real photos. Nothing is
    downloaded; the files depend only on ``(seed, i)``, whatever ``processes`` makes them.

    ``root=None`` puts the folder in the data cache: ``$AIOLOAD_CACHE`` if set, else
    ``~/.cache/aioload``. A folder already complete with these arguments is reused as it is
    (nothing is written); a partial one is completed; one made with another ``n`` is grown or
    cut to ``n`` (image ``i`` is the same file either way); one made with other ``classes`` or
    ``seed`` is refused (``ValueError``). ``processes`` writes with that many processes;
    ``quiet=False`` prints progress on stderr. Returns the folder.
    """
    for name, value in (("n", n), ("classes", classes), ("processes", processes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"make_data: {name} must be an int >= 1, got {value!r}")
    return make_image_folder(root, images=n, classes=classes, seed=seed, quiet=quiet, processes=processes)


def make_image_folder(root: str | os.PathLike | None = None, images: int = DEFAULT_IMAGES,
                      classes: int = DEFAULT_CLASSES, seed: int = 0, quiet: bool = True,
                      processes: int = 1) -> Path:
    """Create (once) ``images`` JPEGs in ``classes`` class folders under ``root`` (the
    implementation of :func:`make_data`, without its argument checks).

    Returns the folder. An existing complete folder is reused; a partial one is completed; one
    of another size is grown or cut (see :func:`make_data`).
    Image ``i`` depends only on ``(seed, i)``, so ``processes > 1`` makes the same files.
    """
    root = Path(root) if root is not None else default_root(images, classes, seed)
    asked = dict(zip(_ASKED, (images, classes, seed)))
    made = made_with(root)
    if made == asked:
        return root
    if made is not None and (made["classes"], made["seed"]) != (classes, seed):
        raise ValueError(f"{root} holds {made['images']} generated JPEGs made with classes={made['classes']}, "
                         f"seed={made['seed']}, not classes={classes}, seed={seed}: make these in another "
                         f"folder, or delete {root} first")
    marker = root / ".complete"
    marker.unlink(missing_ok=True)  # unfinished until every image below is written
    if made is not None and made["images"] > images:  # fewer asked for than made: remove the rest
        for i in range(images, made["images"]):
            (root / _name(classes, i)).unlink(missing_ok=True)
        if not quiet:
            print(f"  removed {made['images'] - images} images, past the {images} asked for", file=sys.stderr,
                  flush=True)
    for c in range(classes):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    missing = [i for i in range(images) if not (root / _name(classes, i)).exists()]
    step = 256
    ranges = [(root, classes, seed, missing[lo:lo + step]) for lo in range(0, len(missing), step)]
    report = _Report(len(missing), quiet)  # only the images written count: those already there are kept
    done = 0
    if processes > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(processes) as pool:
            for written in pool.imap_unordered(_write_range, ranges):
                done += written
                report(done)
    else:
        for args in ranges:
            done += _write_range(args)
            report(done)
    marker.write_text(json.dumps(asked))
    return root


# -- the same images as Parquet ------------------------------------------------------------------
PARQUET_ROWS_PER_GROUP = 100
"""Rows per row group of :func:`make_parquet`'s files: what ``datasets`` and the Hub's Parquet
conversion write for image sets."""

PARQUET_WRITE_OPTIONS = {
    "write_page_index": True, "data_page_size": 1 << 10, "write_batch_size": 1,
    "use_dictionary": ["label"], "column_encoding": {"image.bytes": "PLAIN", "image.path": "PLAIN"},
    "compression": {"image.bytes": "none", "image.path": "none", "label": "snappy"},
}
"""How :func:`make_parquet` writes: with a page index, and a page per image (pages are cut
between write batches of one row once they pass 1 KiB), so that a uniform shuffle fetches
one image's page per row (``docs/parquet.md``); the images stored as ``datasets`` stores them
(PLAIN, not compressed again)."""


def _jpegs(args) -> list[bytes]:
    import io

    seed, indices = args
    out = []
    for i in indices:
        buf = io.BytesIO()
        _jpeg(seed, i, buf)
        out.append(buf.getvalue())
    return out


def make_parquet(root: str | os.PathLike, images: int = DEFAULT_IMAGES, classes: int = DEFAULT_CLASSES,
                 seed: int = 0, quiet: bool = True, processes: int = 1, rows_per_file: int = 1024) -> Path:
    """Write (once) :func:`make_data`'s images as Parquet files ``root/train-NNNNN-of-NNNNN.parquet``,
    laid out as the Hub's image sets are: an ``image`` column of ``{"bytes", "path"}`` and a
    ``label`` column, marked ``Image`` and ``ClassLabel`` in ``datasets``' metadata, row groups
    of :data:`PARQUET_ROWS_PER_GROUP` rows, a page per image and a page index
    (:data:`PARQUET_WRITE_OPTIONS`). The rows are sorted by class (class 0's images
    first), as a folder's are, so that a loader's shuffle shows in its batches. Needs pyarrow."""
    import json

    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError("writing Parquet needs pyarrow: pip install 'aioload[parquet]'") from exc
    root = Path(root)
    marker = root / ".complete"
    if marker.exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    order = [i for c in range(classes) for i in range(c, images, classes)]  # class by class
    features = {"image": {"_type": "Image"},
                "label": {"names": [f"class_{c:03d}" for c in range(classes)], "_type": "ClassLabel"}}
    schema = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                        ("label", pa.int64())],
                       metadata={"huggingface": json.dumps({"info": {"features": features}})})
    files = -(-images // rows_per_file)
    report = _Report(images, quiet)
    step = 64
    jobs = [(seed, order[lo:lo + step]) for lo in range(0, images, step)]
    pool = None
    if processes > 1:
        import multiprocessing as mp

        pool = mp.get_context("fork").Pool(processes)
    try:
        made = pool.imap(_jpegs, jobs) if pool is not None else map(_jpegs, jobs)
        pending: list[bytes] = []
        written = 0
        for n in range(files):
            rows = order[n * rows_per_file:(n + 1) * rows_per_file]
            while len(pending) < len(rows):
                pending.extend(next(made))
                report(written + len(pending))
            data, pending = pending[:len(rows)], pending[len(rows):]
            table = pa.table({"image": [{"bytes": d, "path": f"img_{i:06d}.jpg"} for d, i in zip(data, rows)],
                              "label": [i % classes for i in rows]}, schema=schema)
            path = root / f"train-{n:05d}-of-{files:05d}.parquet"
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            pq.write_table(table, tmp, row_group_size=PARQUET_ROWS_PER_GROUP, **PARQUET_WRITE_OPTIONS)
            os.replace(tmp, path)
            written += len(rows)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    marker.touch()
    return root
