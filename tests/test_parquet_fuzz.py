"""A differential fuzz test of Parquet reads against pyarrow: random files (pyarrow's writer
with random codecs, page sizes, v1/v2 pages, dictionaries on, off and given up, nulls, structs,
a list column, a page index or none; and a file ``datasets`` wrote), then random byte changes
in a page body, a page header, the page index or the footer. The rule, for uniform mode (pages
read by aioload) and window mode (row groups read by pyarrow): each row's value of a column is
exactly pyarrow's where pyarrow reads the row group, or a ``ParquetError`` that names the file
(and, for a row, its row group and the column that fails; a footer that cannot be read has
neither); never another exception, and each case's reads within 5 s of CPU and
64 MiB (Python's allocations, traced, and pyarrow's pool). One allowance: a value may also be
the file's value before the change. pyarrow reads a chunk's pages in a row and believes each
page's value count, so a count changed in one page shifts every later page's values, which
pyarrow returns; aioload reads each row's page where the page index says it is, and gives
those rows their written values (the page whose count changed fails its rows).

Seeded and replayable: ``AIOLOAD_FUZZ_SEED`` (default below) and ``AIOLOAD_FUZZ_CASES`` (how
many cases, each its own random stream ``seed-case``), within ``AIOLOAD_FUZZ_SECONDS`` of wall
time (cases past it are left for a longer run); ``AIOLOAD_FUZZ_CASE=n`` runs case ``n`` alone.
A failure prints the line that replays it.

Cases that found a fault are replayed by every run (``FOUND``), whatever the seed: seed 39's
case 85, a footer whose size statistics hold a level histogram of the wrong length, which
pyarrow's footer parser accepts and its reader reads, but asking pyarrow for that column
chunk's metadata ended the process (``std::terminate``: "Definition level histogram size
mismatch"); the chunks' byte ranges are read with aioload's own Thrift reader since.
"""

from __future__ import annotations

import math
import os
import random
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import aioload
from aioload._parquet.thrift import read_struct
from tests.parquet_data import image_samples, plain, rewrite_struct, write_datasets

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest.py: $AIOLOAD_CACHE of its own

SEED = int(os.environ.get("AIOLOAD_FUZZ_SEED", "40"))
CASES = int(os.environ.get("AIOLOAD_FUZZ_CASES", "400"))
SECONDS = float(os.environ.get("AIOLOAD_FUZZ_SECONDS", "20"))
ONLY = os.environ.get("AIOLOAD_FUZZ_CASE")
CPU_S, MEMORY = 5.0, 64 << 20
CODECS = ["none", "snappy", "gzip", "zstd", "brotli", "lz4"]
POOLS: list = []  # each case's pyarrow pool lives on: a buffer it allocated may be freed later


# -- the files ------------------------------------------------------------------------------------
def random_table(rng: random.Random) -> pa.Table:
    n = rng.randint(1, 120)
    null = rng.choice([0.0, 0.2, 0.9])

    def maybe(value):
        return None if rng.random() < null else value

    words = [f"w{rng.randint(0, rng.choice([3, 1000]))}" for _ in range(n)]
    image = [maybe({"bytes": maybe(rng.randbytes(rng.randint(0, 40))), "path": maybe(f"{i}.jpg")}) for i in range(n)]
    return pa.table({
        "id": pa.array(range(n), pa.int64()),
        "label": pa.array([maybe(rng.randint(-5, 5)) for _ in range(n)], pa.int32()),
        "word": pa.array([maybe(w) for w in words], pa.string()),
        "blob": pa.array([maybe(rng.randbytes(rng.randint(0, 30))) for _ in range(n)], pa.binary()),
        "score": pa.array([maybe(rng.random()) for _ in range(n)], pa.float32()),
        "flag": pa.array([maybe(rng.random() < 0.5) for _ in range(n)], pa.bool_()),
        "u": pa.array([maybe(rng.randint(0, 1 << 40)) for _ in range(n)], pa.uint64()),
        "image": pa.array(image, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        "tokens": [maybe([rng.randint(0, 9) for _ in range(rng.randint(0, 4))]) for _ in range(n)],
    })


def write_random(rng: random.Random, path: Path) -> None:
    table = random_table(rng)
    options = {"row_group_size": rng.randint(1, max(1, len(table))), "compression": rng.choice(CODECS),
               "write_page_index": rng.random() < 0.85, "data_page_version": rng.choice(["1.0", "2.0"]),
               "use_dictionary": rng.random() < 0.6, "write_statistics": rng.random() < 0.5}
    if rng.random() < 0.7:
        options["max_rows_per_page"] = rng.randint(1, 40)
    if options["use_dictionary"] and rng.random() < 0.3:
        options["dictionary_pagesize_limit"] = rng.choice([16, 64, 256])  # given up halfway
    pq.write_table(table, path, **options)


def _headers(data: bytes) -> list[tuple[int, int, int]]:
    """``(header start, body start, page end)`` of every page of every column chunk."""
    md = pq.read_metadata(pa.BufferReader(data))
    out = []
    for g in range(md.num_row_groups):
        for c in range(md.num_columns):
            column = md.row_group(g).column(c)
            at = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
            end = at + column.total_compressed_size
            while at < end:
                head, body = read_struct(data, at)
                out.append((at, body, body + head[3]))
                at = body + head[3]
    return out


def _page_index(data: bytes) -> list[tuple[int, int]]:
    length = int.from_bytes(data[-8:-4], "little")
    meta = read_struct(data[len(data) - 8 - length:len(data) - 8])[0]
    return [(column[k], column[k + 1]) for group in meta.get(4, []) for column in group[1]
            for k in (4, 6) if k in column and k + 1 in column]


def mutate(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """``data`` with one to three random changes in one kind of place, and what they were."""
    pages = _headers(data)
    index = _page_index(data)
    length = int.from_bytes(data[-8:-4], "little")
    places = ["page body", "page header", "footer"] + (["page index"] * 2 if index else [])
    place = rng.choice(places)
    done = []
    for _ in range(rng.randint(1, 3)):
        if place == "page header" and rng.random() < 0.5:  # an integer field given another value
            start, _, _ = rng.choice(pages)
            data, what = _rewrite_int(rng, data, start)
            done.append(what)
            continue
        if place == "page body":
            _, lo, hi = rng.choice(pages)
        elif place == "page header":
            lo, hi, _ = rng.choice(pages)
        elif place == "page index":
            lo, n = rng.choice(index)
            hi = lo + n
        else:
            lo, hi = len(data) - 8 - length, len(data) - 8
        if hi <= lo:
            continue
        at = rng.randrange(lo, hi)
        new = rng.choice([data[at] ^ (1 << rng.randrange(8)), rng.randrange(256), (data[at] + 1) % 256])
        data = data[:at] + bytes([new]) + data[at + 1:]
        done.append(f"byte {at}: {new:#04x}")
    return data, f"{place}: {', '.join(done)}"


def _rewrite_int(rng: random.Random, data: bytes, at: int) -> tuple[bytes, str]:
    try:
        head = read_struct(data, at)[0]
    except ValueError:  # an earlier change of this case broke it
        return data, f"header at {at} unreadable"
    fields = [(head, k) for k, v in head.items() if isinstance(v, int) and not isinstance(v, bool)]
    fields += [(v, k2) for v in head.values() if isinstance(v, dict)
               for k2, v2 in v.items() if isinstance(v2, int) and not isinstance(v2, bool)]
    if not fields:
        return data, "no int field"
    struct, key = rng.choice(fields)
    old = struct[key]
    for value in [old + rng.choice([-2, -1, 1, 2]), rng.randrange(1 << rng.choice([6, 13, 20, 31])), 0]:
        struct[key] = value
        try:
            return rewrite_struct(data, at, lambda s: s.update(head)), f"header at {at}: field {key} {old} -> {value}"
        except ValueError:  # another encoded length
            continue
    return data, "no same-length value"


# -- the rule ----------------------------------------------------------------------------------
def pyarrow_groups(path: Path, columns: list[str]) -> list[list[dict] | None]:
    """Each row group's rows as pyarrow reads them, or ``None`` where it refuses."""
    try:
        f = pq.ParquetFile(path)
    except Exception:
        return []
    out = []
    for g in range(f.metadata.num_row_groups):
        try:
            out.append(f.read_row_group(g, columns=columns).to_pylist())
        except Exception:
            out.append(None)
    return out


def same(a, b, numbers: bool = False) -> bool:
    """``a`` (aioload's) is ``b`` (pyarrow's), NaN equal to NaN; in a list of numbers
    (``numbers``), which aioload gives as a numpy array, by value, a null as NaN."""
    if numbers and isinstance(a, (int, float)) and (b is None or isinstance(b, (int, float))):
        return a == b or math.isnan(a) and (b is None or math.isnan(b))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or math.isnan(a) and math.isnan(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        numbers = all(x is None or isinstance(x, (int, float)) and not isinstance(x, bool) for x in b)
        return len(a) == len(b) and all(same(x, y, numbers) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def check_mode(path: Path, window, groups, clean) -> None:
    try:
        ds = aioload.Parquet(str(path), decode=lambda row: row, window=window)
    except aioload.ParquetError as exc:
        assert str(path) in str(exc), f"a ParquetError that does not name the file: {exc}"
        return
    for i in range(len(ds)):
        _, g, r = ds.locate(i)
        try:
            row = plain(ds[i])
        except aioload.ParquetError as exc:
            assert f"{path}, row group {g}" in str(exc), f"row {i}: a ParquetError that does not name the row: {exc}"
            assert ", column '" in str(exc), f"row {i}: a ParquetError that does not name the column: {exc}"
            continue
        expected = groups[g] if g < len(groups) else None
        if expected is None or r >= len(expected):
            continue
        written = clean[g][r] if g < len(clean) and r < len(clean[g]) else {}
        for k in ds.columns:
            assert same(row[k], expected[r][k]) or k in written and same(row[k], written[k]), \
                f"row {i} (row group {g}, row {r}), column {k!r}: {row[k]!r} where pyarrow reads {expected[r][k]!r}"


def run_case(case: int, base: Path, datasets_file: str, tmp: Path, seed: int = SEED) -> None:
    rng = random.Random(f"{seed}-{case}")
    path = tmp / f"case-{case}.parquet"
    if rng.random() < 0.15:
        base = Path(datasets_file)
    else:
        write_random(rng, base)
    data, what = mutate(rng, base.read_bytes())
    path.write_bytes(data)
    groups, clean = pyarrow_groups(path, None), pyarrow_groups(base, None)
    previous = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(previous)
    POOLS.append(pool)
    pa.set_memory_pool(pool)
    tracemalloc.start()
    started = time.process_time()
    try:
        for window in (None, 2):
            check_mode(path, window, groups, clean)
        cpu = time.process_time() - started
        peak = tracemalloc.get_traced_memory()[1]
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n  {what}") from None
    except Exception as exc:
        raise AssertionError(f"{type(exc).__name__}: {exc} (not a ParquetError)\n  {what}") from exc
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(previous)
    assert cpu < CPU_S, f"the reads took {cpu:.1f} s of CPU\n  {what}"
    assert peak < MEMORY and pool.max_memory() < MEMORY, \
        f"the reads took {peak >> 20} MiB (Python) and {pool.max_memory() >> 20} MiB (pyarrow)\n  {what}"
    path.unlink()


@pytest.fixture(scope="module")
def datasets_file(image_root, tmp_path_factory):
    samples = image_samples(image_root)[:12]
    return write_datasets(samples, tmp_path_factory.mktemp("fuzz-hf") / "train.parquet", batch_size=5)


FOUND = [(39, 85)]
"""``(seed, case)`` of the cases that found a fault, replayed by every run."""


@pytest.mark.parametrize("seed, case", FOUND)
def test_the_cases_that_found_a_fault_read_as_pyarrow_reads_them(datasets_file, tmp_path, seed, case):
    run_case(case, tmp_path / "base.parquet", datasets_file, tmp_path, seed=seed)


def test_corrupt_files_read_as_pyarrow_reads_them_or_fail_with_a_parquet_error(datasets_file, tmp_path):
    cases = [int(ONLY)] if ONLY is not None else range(CASES)
    deadline = time.monotonic() + SECONDS
    for case in cases:
        if ONLY is None and time.monotonic() > deadline:
            break
        try:
            run_case(case, tmp_path / "base.parquet", datasets_file, tmp_path)
        except AssertionError as exc:
            pytest.fail(f"case {case}: {exc}\n  replay: AIOLOAD_FUZZ_SEED={SEED} AIOLOAD_FUZZ_CASE={case} "
                        "python -m pytest tests/test_parquet_fuzz.py", pytrace=False)
