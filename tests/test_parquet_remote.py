"""``aioload.Parquet`` over a real HTTP server on 127.0.0.1 (``tests/httpserver.py``): the rows
arrive as pyarrow reads them, each read asks only for the chunks of the columns asked for, a
footer is read once (then the cache answers), window mode fetches a row group at most once per
worker, 5xx answers are retried, and a file cut short after its footer was read fails the rows
it lost with the file, row group and row named (``on_error="skip"`` leaves them out)."""

from __future__ import annotations

import os
import re
import shutil
from collections import Counter

import pyarrow.parquet as pq
import pytest
import torch

import aioload
from tests.httpserver import serving_copy
from tests.parquet_data import image_samples, pil_pixels, reference, write_by_path, write_datasets, write_pyarrow

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest.py: $AIOLOAD_CACHE of its own

RETRY = aioload.RetryPolicy(attempts=3, backoff=0.01, timeout=10)
NAMES = [f"part-{n:03d}.parquet" for n in range(3)]


@pytest.fixture(scope="module")
def samples(image_root):
    return image_samples(image_root)


@pytest.fixture(scope="module")
def folder(samples, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-pq")
    write_pyarrow(samples, root, per_file=20, row_group_size=6)
    write_datasets(samples, root / "hf.parquet", batch_size=8)
    return root


@pytest.fixture(scope="module")
def by_path(image_root, tmp_path_factory):
    """A folder of images and a Parquet file of their paths relative to it (``datasets``')."""
    root = tmp_path_factory.mktemp("served-by-path")
    shutil.copytree(image_root, root / "images")
    relative = [os.path.relpath(p, image_root) for p, _ in aioload.ImageFolder(image_root).samples][::6]
    write_by_path([f"images/{p}" for p in relative], list(range(len(relative))), root / "paths.parquet", "datasets")
    return root, relative


@pytest.fixture
def server(folder, tmp_path):
    """A server of a copy of the files (tests may cut them)."""
    with serving_copy(folder, tmp_path) as s:
        yield s


def chunk_ranges(path, column: str) -> set[str]:
    """The Range header of every row group's chunk of ``column``."""
    md = pq.read_metadata(path)
    leaf = [md.schema.column(c).path for c in range(md.num_columns)].index(column)
    out = set()
    for g in range(md.num_row_groups):
        c = md.row_group(g).column(leaf)
        start = c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
        out.add(f"bytes={start}-{start + c.total_compressed_size - 1}")
    return out


def as_list(batch):
    return batch


def test_window_mode_over_http_asks_its_workers_to_read_a_window_ahead(server, folder):
    # each new window's row groups are fetched at once: behind latency a worker holding only the
    # next batch or two would wait for them at every window (locally the page cache serves them)
    urls = [server.url(name) for name in NAMES]
    groups = [md.row_group(g).num_rows for md in (pq.read_metadata(folder / n) for n in NAMES)
              for g in range(md.num_row_groups)]
    assert groups[:4] == [6, 6, 6, 2]  # 20 rows a file, row groups of 6
    assert aioload.Parquet(urls, window=2, storage=aioload.Storage(retry=RETRY)).rows_ahead == \
        int(2 * sum(groups) / len(groups))
    assert aioload.Parquet(urls, storage=aioload.Storage(retry=RETRY)).rows_ahead == 0
    assert aioload.Parquet([str(folder / name) for name in NAMES], window=2).rows_ahead == 0


@pytest.mark.parametrize("window", [None, 2])
def test_rows_over_http_ask_only_for_the_columns_asked_for(server, folder, window):
    urls = [server.url(n) for n in NAMES]
    ds = aioload.Parquet(urls, columns=["label"], window=window, storage=aioload.Storage(retry=RETRY))
    footers = list(server.ranges)
    assert len(footers) == 3  # one ranged read of each file's tail
    with aioload.DataLoader(ds, batch_size=4, shuffle=True, seed=0, num_workers=2, collate_fn=as_list) as dl:
        got = [row["label"] for batch in dl for row in batch]
    order = ds.epoch_order(0, 0, True).tolist()
    labels = [r["label"] for r in reference([str(folder / n) for n in NAMES], ["label"])]
    assert got == [labels[i] for i in order]
    asked = Counter(server.ranges[len(footers):])
    expected = set().union(*(chunk_ranges(folder / n, "label") for n in NAMES))
    assert set(asked) == expected  # every label chunk, and nothing of the images
    if window is not None:
        assert max(asked.values()) <= 2  # a row group at most once per worker


def test_a_footer_is_read_once_then_the_cache_answers(server):
    urls = [server.url(n) for n in NAMES]
    aioload.Parquet(urls)
    before = len(server.ranges)
    again = aioload.Parquet(urls)
    assert len(server.ranges) == before and len(again) == 48  # HEADs only: the versions


def test_a_datasets_file_over_http_decodes_its_images(server, samples):
    ds = aioload.Parquet(server.url("hf.parquet"), transform=lambda row: (row["image"], row["label"]))
    with aioload.DataLoader(ds, batch_size=6, num_workers=2, collate_fn=as_list) as dl:
        got = [sample for batch in dl for sample in batch]
    for (image, label), (_, data, target) in zip(got, samples, strict=True):
        assert torch.equal(image, aioload.decode_image(data)) and label == target


def test_images_stored_by_path_are_read_beside_the_file_over_http(by_path, tmp_path):
    root, relative = by_path
    with serving_copy(root, tmp_path) as server:
        ds = aioload.Parquet(server.url("paths.parquet"), storage=aioload.Storage(retry=RETRY))
        assert ds.images == ["image"]
        with aioload.DataLoader(ds, batch_size=3, num_workers=2, collate_fn=as_list) as dl:
            got = [row for batch in dl for row in batch]
        assert [row["label"] for row in got] == list(range(len(relative)))
        for row, rel in zip(got, relative, strict=True):
            assert torch.equal(row["image"], pil_pixels(root / "images" / rel))
        served = {name for name in server.requests if name.endswith(".jpg")}
        assert served == {f"images/{rel}" for rel in relative}  # through the server, beside the file


def test_5xx_answers_are_retried(server, folder):
    ds = aioload.Parquet([server.url(n) for n in NAMES], columns=["key"], storage=aioload.Storage(retry=RETRY))
    server.script_any(503, 503)
    with aioload.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=as_list) as dl:
        assert [r["key"] for b in dl for r in b] == [r["key"] for r in reference([str(folder / n) for n in NAMES],
                                                                                ["key"])]


def test_a_missing_file_is_named_at_once(server):
    with pytest.raises(FileNotFoundError, match=re.escape(f"Parquet file {server.url('part-009.parquet')} does "
                                                          "not exist")):
        aioload.Parquet([server.url(NAMES[0]), server.url("part-009.parquet")], storage=aioload.Storage(retry=RETRY))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name, window", [(NAMES[0], None), ("hf.parquet", None), ("hf.parquet", 2)])
def test_a_file_cut_short_after_its_footer_was_read_fails_the_rows_it_lost(server, samples, workers, name, window):
    # part-000 has no page index; datasets writes one (at the file's end, lost with the cut):
    # a uniform shuffle then reads the intact row groups whole, as window mode does
    url = server.url(name)
    ds = aioload.Parquet(url, columns=["key", "image"], decode=lambda row: row["key"], window=window,
                         storage=aioload.Storage(retry=RETRY))
    path = server.root_path / name
    md = pq.read_metadata(path)
    first = md.row_group(2).column(0)
    cut = first.dictionary_page_offset if first.has_dictionary_page else first.data_page_offset
    intact = sum(md.row_group(g).num_rows for g in range(2))  # rows of row groups 0 and 1
    # row groups 2 and up are lost, and the footer
    with open(path, "r+b") as f:
        f.truncate(cut)
    with aioload.DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=as_list) as dl:
        with pytest.raises(Exception) as info:
            [b for b in dl]
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert f"{url}, row group 2, row 0" in text and "shorter than its footer says" in text, text
    with aioload.DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=as_list, on_error="skip") as dl:
        assert [k for b in dl for k in b] == [k for k, _, _ in samples[:intact]]
        assert sorted(dl.stats().skipped) == list(range(intact, md.num_rows))


def test_a_footer_larger_than_the_tail_read_takes_a_second_read(server):
    import pyarrow as pa

    from aioload._parquet.footer import TAIL

    table = pa.table({f"c{i:03d}": list(range(400)) for i in range(60)})
    pq.write_table(table, server.root_path / "wide.parquet", row_group_size=10)  # 40 row groups x 60 chunks
    footer = int.from_bytes((server.root_path / "wide.parquet").read_bytes()[-8:-4], "little")
    assert footer > TAIL
    before = len(server.ranges)
    ds = aioload.Parquet(server.url("wide.parquet"), columns=["c007", "c059"], footer_cache=False)
    assert len(server.ranges) - before == 2  # the tail, then the rest of the footer
    assert len(ds) == 400 and ds[397] == {"c007": 397, "c059": 397}
