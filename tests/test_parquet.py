"""``aioload.Parquet`` over local files and a local fsspec store: rows written by pyarrow and
by ``datasets`` come out as pyarrow reads them (images decoded as ``decode_image`` does),
every row once an epoch with 0 and 2 workers, only the columns asked for, row groups fetched
once in window mode, and the errors: not Parquet, a missing column, a row group or an image
that fails to decode (``on_error="skip"`` leaves their rows out)."""

from __future__ import annotations

import os
import re
import shutil
import sys

import pytest
import torch

import aioload
import numpy as np

from tests.parquet_data import image_samples, pil_pixels, plain, reference, write_by_path, write_datasets, write_pyarrow

COLUMNS = ["key", "label", "tokens"]


@pytest.fixture(scope="module")
def samples(image_root):
    return image_samples(image_root)  # 48 images, class by class


@pytest.fixture(scope="module")
def files(samples, tmp_path_factory):
    return write_pyarrow(samples, tmp_path_factory.mktemp("pq") / "pyarrow", per_file=20, row_group_size=6)


pytestmark = pytest.mark.usefixtures("private_cache")  # footers kept in the test's own folder


def rows_of(loader) -> list[dict]:
    return [row for batch in loader for row in batch]


def as_list(batch):
    return batch


def test_the_files_rows_are_the_dataset_in_order(files):
    ds = aioload.Parquet(files, columns=COLUMNS)
    assert len(ds) == 48 and ds.row_group_rows == [6, 6, 6, 2] * 2 + [6, 2]
    assert [plain(ds[i]) for i in range(len(ds))] == reference(files, COLUMNS)
    tokens = ds[3]["tokens"]  # a list of numbers is a numpy array, writable (no warning from torch)
    assert isinstance(tokens, np.ndarray) and tokens.dtype == np.int64 and tokens.flags.writeable
    assert plain(ds[-1]) == plain(ds[47]) and ds.locate(21) == (files[1], 0, 1)
    assert ds.describe(47) == f"{files[2]}, row group 1, row 1"
    assert ds.read_column("label").to_pylist() == [r["label"] for r in reference(files, ["label"])]
    with pytest.raises(IndexError, match="^index 48 is out of range for a Parquet dataset of 48 rows$"):
        ds[48]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("window", [None, 2])
def test_every_row_once_an_epoch_through_the_loader(files, workers, window):
    ds = aioload.Parquet(files, columns=COLUMNS, window=window)
    expected = sorted(reference(files, COLUMNS), key=lambda r: r["key"])
    with aioload.DataLoader(ds, batch_size=5, shuffle=True, seed=3, num_workers=workers, collate_fn=as_list) as dl:
        for epoch in range(2):
            dl.set_epoch(epoch)
            got = [plain(r) for r in rows_of(dl)]
            assert sorted(got, key=lambda r: r["key"]) == expected
            order = ds.epoch_order(3, epoch, True).tolist()
            assert [r["key"] for r in got] == [ds[i]["key"] for i in order]  # the dataset's order


def test_images_decode_as_decode_image_does_and_transform_sees_the_row(files, samples):
    ds = aioload.Parquet(files, columns=["image", "label"], images=["image"],
                         transform=lambda row: (row["image"], row["label"]))
    for i in (0, 25, 47):
        image, label = ds[i]
        assert torch.equal(image, aioload.decode_image(samples[i][1])) and label == samples[i][2]


def test_a_file_written_by_datasets_decodes_its_image_feature(samples, tmp_path):
    path = write_datasets(samples, tmp_path / "hf" / "train.parquet", batch_size=8)
    ds = aioload.Parquet(path)  # the Image feature is read from the file's metadata
    assert ds.images == ["image"] and ds.columns == ["image", "label", "key"] and len(ds) == 48
    with aioload.DataLoader(ds, batch_size=8, num_workers=2, shuffle=True, seed=0, collate_fn=as_list) as dl:
        got = {row["key"]: row for row in rows_of(dl)}
    for key, data, label in samples:
        assert torch.equal(got[key]["image"], aioload.decode_image(data)) and got[key]["label"] == label
    raw = aioload.Parquet(path, columns=["image"], decode=lambda row: row["image"])
    assert raw[5] == {"bytes": samples[5][1], "path": None}  # decode= sees the struct as stored


@pytest.mark.parametrize("writer", ["datasets", "pyarrow"])
@pytest.mark.parametrize("window", [None, 2])
def test_images_stored_by_path_are_read_from_it_relative_to_the_file_or_absolute(image_root, tmp_path, writer, window):
    paths = [p for p, _ in aioload.ImageFolder(image_root).samples][::4]  # 12 images, 3 classes
    images = tmp_path / "data" / "images"
    shutil.copytree(image_root, images)
    relative = [os.path.relpath(p, image_root) for p in paths]
    local = write_by_path([os.path.join("images", p) for p in relative], list(range(12)),
                          tmp_path / "data" / "relative.parquet", writer)
    absolute = write_by_path(paths, list(range(12)), tmp_path / "elsewhere" / "absolute.parquet", writer)
    for path, folder in ((local, images), (absolute, image_root)):
        ds = aioload.Parquet(path, images=["image"], window=window)
        with aioload.DataLoader(ds, batch_size=5, num_workers=2, shuffle=True, seed=0, collate_fn=as_list) as dl:
            got = {row["label"]: row["image"] for row in rows_of(dl)}
        assert sorted(got) == list(range(12))
        for label, rel in enumerate(relative):
            assert torch.equal(got[label], pil_pixels(folder / rel)), (path, rel)


def test_an_image_path_that_cannot_be_read_names_the_row_column_and_fix(image_root, tmp_path):
    paths = [p for p, _ in aioload.ImageFolder(image_root).samples][:6]
    path = write_by_path([os.path.relpath(p, image_root) for p in paths], list(range(6)),
                         tmp_path / "gone.parquet", "pyarrow")
    ds = aioload.Parquet(path, images=["image"])
    missing = os.path.join(tmp_path, os.path.relpath(paths[3], image_root))
    with pytest.raises(aioload.ParquetError, match="^" + re.escape(
            f"{path}, row group 0, row 3, column 'image': the value holds no bytes, only the path "
            f"{os.path.relpath(paths[3], image_root)!r}, and {missing} cannot be read (FileNotFoundError: ")
            + ".*" + re.escape("); put the file there (a relative path is read beside the Parquet file), or write "
                               "its bytes into the Parquet file (datasets: embed_table_storage before to_parquet)")
            + "$"):
        ds[3]


def test_a_folder_or_a_glob_is_its_parquet_files_sorted(files):
    folder = files[0].rsplit("/", 1)[0]
    assert list(aioload.Parquet(folder, columns=["key"]).urls) == files
    assert list(aioload.Parquet(folder + "/part-00[12].parquet", columns=["key"]).urls) == files[1:]
    with pytest.raises(FileNotFoundError, match=f"^no file matches {re.escape(folder)}/none-\\*.parquet$"):
        aioload.Parquet(folder + "/none-*.parquet")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_local_fsspec_store(files, workers):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    urls = []
    for n, path in enumerate(files):
        with open(path, "rb") as src:
            fs.pipe(f"/pq-{workers}/part-{n}.parquet", src.read())
        urls.append(f"memory://pq-{workers}/part-{n}.parquet")
    ds = aioload.Parquet(urls, columns=COLUMNS, footer_cache=False)
    assert len(ds) == 48
    assert list(aioload.Parquet(f"memory://pq-{workers}/part-*.parquet", footer_cache=False).urls) == \
        [f"memory:///pq-{workers}/part-{n}.parquet" for n in range(3)]  # a glob, listed by fsspec
    with aioload.DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=as_list) as dl:
        assert [plain(r) for r in rows_of(dl)] == reference(files, COLUMNS)  # in order without shuffle


def test_window_mode_fetches_each_row_group_once(files):
    ds = aioload.Parquet(files, columns=["key"], window=2, cache_bytes=0)
    # one read at a time: reads of a row group in flight together share its fetch
    with aioload.DataLoader(ds, batch_size=4, shuffle=True, seed=1, collate_fn=as_list, io_concurrency=1) as dl:
        assert len(rows_of(dl)) == 48
    assert ds._cache.fetches == len(ds.row_group_rows)  # 10 row groups, 48 rows
    uniform = aioload.Parquet(files, columns=["key"], cache_bytes=0)
    with aioload.DataLoader(uniform, batch_size=4, shuffle=True, seed=1, collate_fn=as_list, io_concurrency=1) as dl:
        assert len(rows_of(dl)) == 48
    assert uniform._cache.fetches > 2 * len(ds.row_group_rows)  # a uniform shuffle: nearly a fetch a row


@pytest.mark.unit
def test_layout_locates_rows_across_files_and_empty_ones():
    from aioload._parquet.order import Layout

    layout = Layout([np.array([3, 2]), np.array([], dtype=np.int64), np.array([4])])
    assert len(layout) == 9
    assert [layout.locate(i) for i in (0, 2, 3, 4, 5, 8)] == [(0, 0, 0), (0, 0, 2), (0, 1, 0), (0, 1, 1), (2, 0, 0),
                                                                (2, 0, 3)]


# -- errors -------------------------------------------------------------------------------------
def test_a_file_that_is_not_parquet_is_named(files, tmp_path):
    bad = tmp_path / "notes.parquet"
    bad.write_text("key,label\na,1\n")
    with pytest.raises(aioload.ParquetError, match=f"^{re.escape(str(bad))} is not a Parquet file: it does not end "
                                                   "with the magic bytes b'PAR1'"):
        aioload.Parquet([files[0], str(bad)])


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="Parquet file .*nothing.parquet does not exist"):
        aioload.Parquet(str(tmp_path / "nothing.parquet"))


def test_a_missing_column_names_the_file_and_its_columns(files):
    with pytest.raises(aioload.ParquetError, match=re.escape(f"{files[0]} has no column 'caption' (its columns: "
                                                             "key, image, label, tokens); pass columns= that every "
                                                             "file has")):
        aioload.Parquet(files, columns=["key", "caption"])


def pq_column(path: str, name: str) -> int:
    import pyarrow.parquet as pq

    return pq.read_schema(path).get_field_index(name)


def corrupt_row_group(path: str, group: int, column: int = 0) -> None:
    """Overwrite the first bytes (a page header) of row group ``group``'s chunk of column
    ``column`` (0: ``key``)."""
    import pyarrow.parquet as pq

    chunk = pq.read_metadata(path).row_group(group).column(column)
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\xff" * 16)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_row_group_that_fails_to_decode_names_its_rows_or_skips_them(samples, tmp_path, workers):
    files = write_pyarrow(samples, tmp_path / "bad", per_file=48, row_group_size=10)
    label = pq_column(files[0], "label")
    corrupt_row_group(files[0], 2, label)  # rows 20-29, in their label column
    ds = aioload.Parquet(files, columns=["key", "label"])
    with aioload.DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=as_list) as dl:
        with pytest.raises(aioload.ParquetError, match=re.escape(f"{files[0]}, row group 2, row 0, column 'label': the "
                                                                 "row group cannot be decoded (")):
            rows_of(dl)
    with aioload.DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=as_list, on_error="skip") as dl:
        got = [r["key"] for r in rows_of(dl)]
        assert got == [k for k, _, _ in samples[:20] + samples[30:]]
        assert sorted(dl.stats().skipped) == list(range(20, 30))


def test_an_image_that_fails_to_decode_names_its_row_and_column(samples, tmp_path):
    broken = list(samples)
    broken[7] = (broken[7][0], b"\xff\xd8\xff not a jpeg", broken[7][2])
    files = write_pyarrow(broken, tmp_path / "img", per_file=48, row_group_size=5)
    ds = aioload.Parquet(files, columns=["image", "label"], images=["image"])
    with pytest.raises(aioload.ParquetError, match=re.escape(f"{files[0]}, row group 1, row 2, column 'image': the "
                                                             "image cannot be decoded (")):
        ds[7]
    with aioload.DataLoader(ds, batch_size=6, num_workers=2, on_error="skip",
                            collate_fn=lambda b: [r["label"] for r in b]) as dl:
        assert [x for b in dl for x in b] == [t for i, (_, _, t) in enumerate(samples) if i != 7]


def test_bad_arguments_are_refused(files):
    with pytest.raises(ValueError, match="^window must be an int >= 1 or None, got 0$"):
        aioload.Parquet(files, window=0)
    with pytest.raises(TypeError, match="^columns must be a column name or a non-empty list of them, got \\[\\]$"):
        aioload.Parquet(files, columns=[])
    with pytest.raises(ValueError, match="^transform runs after the default decode: pass decode= or transform=, "
                                         "not both$"):
        aioload.Parquet(files, decode=dict, transform=dict)


def test_hf_urls_without_huggingface_hub_name_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ImportError, match="^hf:// URLs are read through huggingface_hub's filesystem: pip install "
                                          r'"aioload\[hf\]"$'):
        aioload.Parquet("hf://datasets/someone/something/train.parquet")
    with pytest.raises(ImportError, match="^hf:// URLs are read through huggingface_hub's filesystem"):
        aioload.Parquet("hf://datasets/someone/something@~parquet/default/train/*.parquet")  # before listing


def test_without_pyarrow_aioload_imports_and_parquet_names_the_extra(files):
    import subprocess

    code = ("import sys\n"
            "sys.modules['pyarrow'] = None  # as if it were not installed\n"
            "import aioload\n"
            "try:\n"
            f"    aioload.Parquet({files[0]!r})\n"
            "except ImportError as exc:\n"
            "    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "aioload.Parquet needs pyarrow: pip install 'aioload[parquet]'\n"


def test_make_data_writes_the_images_as_parquet_sorted_by_class(tmp_path, capsys):
    from aioload._tools import cli as _cli
    from aioload._data.synth import make_data

    target = tmp_path / "pq"
    assert _cli.main(["make-data", str(target), "--images", "12", "--classes", "3", "--format", "parquet"]) == 0
    assert "12 JPEGs in 3 classes as Parquet files under" in capsys.readouterr().out
    ds = aioload.Parquet(target)
    assert ds.images == ["image"] and len(ds) == 12
    folder = make_data(tmp_path / "jpeg", 12, classes=3)  # the same images as the folder's
    rows = [ds[i] for i in range(12)]
    assert [r["label"] for r in rows] == [0] * 4 + [1] * 4 + [2] * 4
    jpeg = aioload.decode_image((folder / "class_001" / "img_000001.jpg").read_bytes())
    assert torch.equal(rows[4]["image"], jpeg)


def test_reads_stay_in_the_workers_with_a_storage_cache(files):
    # a read's result is its whole row group: sending it from the training process for every
    # row would cost the row group's bytes per row
    storage = aioload.Storage(cache=aioload.MemoryCache(64 << 20))
    ds = aioload.Parquet(files, columns=COLUMNS, storage=storage)
    assert ds.read_in_workers
    footers = storage.cache.stats().misses  # the footers' reads, here
    with aioload.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=as_list) as dl:
        assert [plain(r) for r in rows_of(dl)] == reference(files, COLUMNS)
    assert storage.cache.stats().misses == footers  # this process's copy of the cache read no row group


def wav(freq: float, rate: int = 8000) -> bytes:
    """One second of a sine as a 16-bit mono WAV."""
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        t = np.arange(rate) / rate
        w.writeframes((np.sin(2 * np.pi * freq * t) * 10000).astype("<i2").tobytes())
    return buf.getvalue()


def test_a_datasets_audio_column_decodes_as_decode_audio_does(tmp_path):
    import datasets

    datasets.disable_progress_bars()
    sounds = [wav(f) for f in (220, 440, 880)]
    features = datasets.Features({"audio": datasets.Audio(), "label": datasets.Value("int64")})
    datasets.Dataset.from_dict({"audio": [{"bytes": s, "path": None} for s in sounds], "label": [0, 1, 2]},
                               features=features).to_parquet(str(tmp_path / "audio.parquet"))
    args = dict(sample_rate=8000, seconds=0.5, crops="uniform")
    ds = aioload.Parquet(tmp_path / "audio.parquet", audio=args)
    assert ds.sounds == ["audio"]
    with aioload.DataLoader(ds, batch_size=3, num_workers=2) as dl:
        (batch,) = list(dl)
    for i, sound in enumerate(sounds):
        assert torch.equal(batch["audio"][i], aioload.decode_audio(sound, **args))
    assert batch["label"].tolist() == [0, 1, 2]
    assert isinstance(aioload.Parquet(tmp_path / "audio.parquet")[0]["audio"], dict)  # no audio=: left encoded
