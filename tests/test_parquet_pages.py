"""A uniform shuffle reads by page where the files have a page index: every row comes out as
pyarrow reads it, with and without a page index, snappy, zstd, gzip or no compression, with
and without dictionaries (and a dictionary given up halfway, as pyarrow does when it grows),
v1 and v2 data pages, nulls at every level of a struct, strings, numbers, booleans, and a list
column and columns of delta encodings (read with their row group) beside them, the same rows as
window mode gives; files written by ``datasets``; over the HTTP
test server, a row costs its image's page, never its row group's image chunk; a corrupt page
fails its row with the file, row and column named."""

from __future__ import annotations

import os
import re
from pathlib import Path
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import aioload
from aioload._data.synth import PARQUET_WRITE_OPTIONS
from tests.httpserver import serving_copy
from tests.parquet_data import image_samples, plain, reference, write_datasets

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest.py: $AIOLOAD_CACHE of its own

RETRY = aioload.RetryPolicy(attempts=3, backoff=0.01, timeout=10)

VARIANTS = {
    "no page index": {},
    "page index, snappy, dictionaries": {"write_page_index": True},
    "a page a row, zstd": {"write_page_index": True, "max_rows_per_page": 1, "compression": "zstd"},
    "3 rows a page, no compression, no dictionary": {"write_page_index": True, "max_rows_per_page": 3,
                                                     "compression": "none", "use_dictionary": False},
    "v2 pages, gzip": {"write_page_index": True, "max_rows_per_page": 2, "data_page_version": "2.0",
                       "compression": "gzip"},
    "a dictionary given up halfway": {"write_page_index": True, "max_rows_per_page": 4,
                                      "dictionary_pagesize_limit": 4000},
    "as make-data writes": PARQUET_WRITE_OPTIONS,
    # encodings the page decoder does not know: those columns are read with their row group
    "delta encodings": {"write_page_index": True, "max_rows_per_page": 2, "use_dictionary": False,
                        "column_encoding": {"key": "DELTA_LENGTH_BYTE_ARRAY", "label": "DELTA_BINARY_PACKED",
                                            "score": "BYTE_STREAM_SPLIT"}},
}


@pytest.fixture(scope="module")
def samples(image_root):
    return image_samples(image_root)


def table_of(samples) -> pa.Table:
    """The images as ``datasets`` lays them out, with nulls at each level, and more types."""
    n = len(samples)
    image = [None if i % 11 == 3 else {"bytes": None if i % 7 == 5 else d, "path": f"{k}.jpg" if i % 3 else None}
             for i, (k, d, _) in enumerate(samples)]
    return pa.table({"image": pa.array(image, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                     "label": [t for _, _, t in samples],
                     "key": [k if i % 5 else None for i, (k, _, _) in enumerate(samples)],
                     "score": pa.array([i / 4 for i in range(n)], pa.float32()),
                     "id": pa.array(range(n), pa.uint32()),
                     "flag": [None if i % 9 == 0 else i % 2 == 0 for i in range(n)],
                     "tokens": [[ord(c) for c in k] for k, _, _ in samples]})


@pytest.fixture(scope="module")
def written(samples, tmp_path_factory):
    root = tmp_path_factory.mktemp("pages")
    table = table_of(samples)
    paths = {}
    for name, options in VARIANTS.items():
        options = dict(options)
        if name == "as make-data writes":
            options["use_dictionary"] = ["label"]  # the options name make-data's columns
            options["column_encoding"] = {"image.bytes": "PLAIN"}
            options["compression"] = {"image.bytes": "none", "image.path": "none", "label": "snappy"}
        path = root / f"{name.replace(' ', '-').replace(',', '')}.parquet"
        pq.write_table(table, path, row_group_size=20, **options)
        paths[name] = str(path)
    return paths


def as_list(batch):
    return batch


def rows(ds) -> list[dict]:
    return [plain(ds[i]) for i in range(len(ds))]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_row_is_what_pyarrow_reads(written, variant):
    path = written[variant]
    ds = aioload.Parquet(path, decode=lambda row: row)
    assert rows(ds) == reference([path], ds.columns)
    ranks = aioload.Parquet(path, decode=lambda row: row, window=2)  # window mode: row groups, pyarrow
    assert rows(ranks) == rows(ds)


@pytest.mark.parametrize("variant", ["a dictionary given up halfway", "v2 pages, gzip"])
def test_a_shuffled_epoch_with_workers_is_the_rows_pyarrow_reads_in_the_order(written, variant):
    path = written[variant]
    ds = aioload.Parquet(path, columns=["image", "key", "tokens"], decode=lambda row: row)
    expected = reference([path], ["image", "key", "tokens"])
    with aioload.DataLoader(ds, batch_size=7, shuffle=True, seed=5, num_workers=2, collate_fn=as_list) as dl:
        got = [plain(r) for b in dl for r in b]
    assert got == [expected[i] for i in ds.epoch_order(5, 0, True).tolist()]


def test_a_datasets_file_reads_by_page_with_the_rows_pyarrow_reads(samples, tmp_path):
    path = write_datasets(samples, tmp_path / "hf" / "train.parquet", batch_size=8)
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).has_offset_index  # datasets writes a page index
    ds = aioload.Parquet(path, decode=lambda row: row)
    assert rows(ds) == reference([path], ds.columns)


def _span(header: str) -> tuple[int, int]:
    a, b = header.removeprefix("bytes=").split("-")
    return int(a), int(b) - int(a) + 1


def test_over_http_a_row_costs_its_page_not_its_row_group(written, samples, tmp_path):
    folder = tmp_path / "www-src"
    folder.mkdir()
    os.link(written["as make-data writes"], folder / "train.parquet")
    with serving_copy(folder, tmp_path) as server:
        url = server.url("train.parquet")
        ds = aioload.Parquet(url, columns=["image", "label"], decode=lambda row: row,
                             storage=aioload.Storage(retry=RETRY))
        before = len(server.ranges)
        with aioload.DataLoader(ds, batch_size=6, shuffle=True, seed=1, num_workers=2, collate_fn=as_list) as dl:
            got = [plain(r) for b in dl for r in b]
        asked = [_span(r) for r in server.ranges[before:]]
    url_path = folder / "train.parquet"
    expected = reference([str(url_path)], ["image", "label"])
    assert got == [expected[i] for i in ds.epoch_order(1, 0, True).tolist()]
    md = pq.read_metadata(folder / "train.parquet")
    images = {md.row_group(g).column(0).data_page_offset: md.row_group(g).column(0).total_compressed_size
              for g in range(md.num_row_groups)}
    assert not any(images.get(offset) == length for offset, length in asked)  # no image chunk, ever
    # a range at most once per worker (a page holds one image, and the rows without one beside it), a
    # request per row and, per worker, the page index and each row group's label and path chunks
    assert max(Counter(asked).values()) <= 2 and sum(n for _, n in set(asked)) < os.path.getsize(url_path)
    assert len(asked) <= len(samples) + 2 * (1 + 2 * md.num_row_groups)


def test_a_corrupt_page_fails_its_row_naming_the_file_row_and_column(written, samples, tmp_path):
    path = tmp_path / "corrupt.parquet"
    data = bytearray(Path(written["as make-data writes"]).read_bytes())
    at = data.find(samples[2][1])  # row 2's image: its PLAIN length prefix now claims more than the page
    data[at - 4:at] = (1 << 30).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    ds = aioload.Parquet(str(path), columns=["image", "label"], decode=lambda row: row)
    assert plain(ds[1]) == reference([written["as make-data writes"]], ["image", "label"])[1]
    with pytest.raises(aioload.ParquetError, match=re.escape(f"{path}, row group 0, row 2, column 'image': a page "
                                                             "cannot be decoded (PageError: value 0 runs past")):
        ds[2]
    with aioload.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=as_list, on_error="skip") as dl:
        assert len([r for b in dl for r in b]) == len(samples) - 1
        assert list(dl.stats().skipped) == [2]


def test_a_page_is_let_go_once_every_row_of_it_has_been_read(written, tmp_path):
    """An epoch reads a row once: a page whose rows have all been read in this process leaves
    its cache (a page of one image as soon as its row is read), and one with a row still to
    come stays. Counted in requests to the HTTP server: a row of a page let go costs one more."""
    folder = tmp_path / "www-src"
    folder.mkdir()
    os.link(written["3 rows a page, no compression, no dictionary"], folder / "three.parquet")
    os.link(written["a page a row, zstd"], folder / "one.parquet")
    with serving_copy(folder, tmp_path) as server:
        three, one = (aioload.Parquet(server.url(name), columns=["image"], decode=lambda row: row,
                                      storage=aioload.Storage(retry=RETRY))
                      for name in ("three.parquet", "one.parquet"))

        def requests(ds, row: int) -> int:
            before = len(server.ranges)
            assert plain(ds[row]) == reference([str(folder / Path(ds.urls[0]).name)], ["image"])[row]
            return len(server.ranges) - before

        assert requests(three, 0) >= 1  # the page index, the path chunk, the page of rows 0-2
        assert requests(three, 1) == 0 and requests(three, 2) == 0  # the page stays while a row of it is to come
        assert requests(three, 0) == 1  # all three read: it was let go
        assert requests(three, 4) == 1 and requests(three, 4) == 0  # rows 3 and 5 to come: kept
        assert requests(one, 6) >= 1 and requests(one, 7) == 1
        assert requests(one, 6) == 1  # a page of one row goes as soon as its row is read
