"""Uniform mode's page reader believes no header: each of an audit's findings, reproduced on a
file pyarrow wrote and then corrupted (or on the bytes the reader parses), fails its row with
a ``ParquetError`` that names the file, the row group and the column, or is read as pyarrow
reads it, within bounded time and memory. What pyarrow refuses, aioload refuses too."""

from __future__ import annotations

import io
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import aioload
from aioload._parquet import values
from aioload._parquet import thrift
from aioload._parquet.thrift import ThriftError, read_struct
from tests.parquet_data import compact, rewrite_struct

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest.py: $AIOLOAD_CACHE of its own


def write(path: Path, table: pa.Table, **options) -> bytes:
    options = {"row_group_size": len(table), "write_page_index": True, "write_statistics": False, **options}
    pq.write_table(table, path, **options)
    return path.read_bytes()


def footer(data: bytes) -> dict:
    length = int.from_bytes(data[-8:-4], "little")
    return read_struct(data[len(data) - 8 - length:len(data) - 8])[0]


def chunk_meta(data: bytes, leaf: int, group: int = 0) -> tuple[dict, dict]:
    """``(column chunk, its ColumnMetaData)`` of a leaf, as the footer holds them."""
    column = footer(data)[4][group][1][leaf]
    return column, column[3]


def corrupt_rows(path: Path, columns: list[str], rows) -> None:
    """Each row either raises a ParquetError naming the file, row group and column, or is pyarrow's."""
    ds = aioload.Parquet(str(path), columns=columns, decode=lambda row: row)
    for r in rows:
        with pytest.raises(aioload.ParquetError, match=re.escape(f"{path}, row group 0, row {r}, column")):
            ds[r]


# -- 1. a page that decompresses to less than its header claims --------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("codec", ["snappy", "gzip", "brotli", "lz4_raw", "zstd"])
def test_a_page_decompresses_to_exactly_the_size_its_header_claims(codec):
    raw = np.arange(100, dtype=np.int64).tobytes()
    body = pa.compress(raw, codec=codec, asbytes=True)
    assert bytes(values._decompress(body, codec, len(raw))) == raw
    for claim in (len(raw) + 1, 2 * len(raw), len(raw) - 1):
        with pytest.raises(values.PageError, match=f"the {codec} page"):
            values._decompress(body, codec, claim)
    with pytest.raises(values.PageError, match=r"claims 1099511627776 bytes decompressed, outside \[0, 2147483647\]"):
        values._decompress(body, codec, 1 << 40)  # 1 TiB was allocated


@pytest.mark.parametrize("codec", ["snappy", "gzip", "brotli", "lz4", "zstd"])
def test_a_page_header_claiming_more_bytes_than_its_page_holds_fails_its_rows(tmp_path, codec):
    path = tmp_path / "claims.parquet"
    data = write(path, pa.table({"x": pa.array(range(0, 2000, 10), pa.int64())}), compression=codec,
                 use_dictionary=False, max_rows_per_page=100)
    _, meta = chunk_meta(data, 0)

    def claim_more(head):  # 800 bytes of values: claim 2 more (the same varint length)
        head[2] += 2

    path.write_bytes(rewrite_struct(data, meta[9], claim_more))
    with pytest.raises(OSError):
        pq.read_table(path)  # pyarrow refuses the file ("Page didn't decompress to expected size")
    corrupt_rows(path, ["x"], [0, 99])
    ds = aioload.Parquet(str(path), columns=["x"], decode=lambda row: row)
    assert ds[150] == {"x": 1500}  # the other page is whole


# -- 2. a dictionary page that claims more entries than its bytes hold -------------------------
def test_a_dictionary_page_claiming_more_entries_than_it_holds_fails_its_rows(tmp_path):
    path = tmp_path / "dictionary.parquet"
    words = np.random.default_rng(0).integers(0, 10, 200_000)  # a chunk past 64 KiB: read a page per row
    data = write(path, pa.table({"s": [f"word-{i}" for i in words]}), compression="none")
    _, meta = chunk_meta(data, 0)
    assert meta[7] > 64 << 10
    data = rewrite_struct(data, meta[11], lambda head: head[7].update({1: 20}))
    path.write_bytes(data)
    with pytest.raises(OSError):
        pq.read_table(path)
    corrupt_rows(path, ["s"], [0, 150_000])


@pytest.mark.unit
def test_a_dictionary_page_claiming_2_31_entries_is_refused_from_its_bytes():
    leaf = values.Leaf(0, "s", values.BYTE_ARRAY, 0, 0, "str")
    body = b"".join(len(w).to_bytes(4, "little") + w for w in [b"a", b"bb"])
    page = compact({1: values.DICTIONARY_PAGE, 2: len(body), 3: len(body), 7: {1: (1 << 31) - 1, 2: 0}}) + body
    with pytest.raises(values.PageError, match=r"claims 2147483647 entries and its 11 bytes hold at most 2$"):
        values.dictionary(page, 0, None, leaf)  # refused before any entry is read (the old reader grew it past 1.5 GiB)
    page = compact({1: values.DICTIONARY_PAGE, 2: len(body), 3: len(body), 7: {1: 2, 2: 0}}) + body
    assert values.dictionary(page, 0, None, leaf) == ["a", "bb"]


# -- 3. a page index whose first rows do not match the pages' value counts ---------------------
def test_a_page_index_off_by_one_fails_the_rows_instead_of_shifting_them(tmp_path):
    path = tmp_path / "index.parquet"
    table = pa.table({"x": pa.array(range(300), pa.int64()), "y": pa.array(range(300), pa.int64())})
    data = write(path, table, use_dictionary=False, max_rows_per_page=100, compression="none")
    column, _ = chunk_meta(data, 0)
    data = rewrite_struct(data, column[4], lambda index: index[1][1].update({3: 101}))  # page 1 from row 101
    path.write_bytes(data)
    assert pq.read_table(path).equals(table)  # pyarrow reads rows without the page index
    ds = aioload.Parquet(str(path), decode=lambda row: row)
    with pytest.raises(aioload.ParquetError, match=re.escape(f"{path}, row group 0, row 150, column 'x': a page "
                                                             "cannot be decoded (PageError: the page holds 100 "
                                                             "values and the page index gives it 99 rows)")):
        ds[150]
    with pytest.raises(aioload.ParquetError, match=re.escape(f"{path}, row group 0, row 50, column 'x'")):
        ds[50]  # page 0 now claims rows 0-100 of the index
    assert ds[250] == {"x": 250, "y": 250}


def test_a_page_index_out_of_order_or_outside_its_chunk_is_refused(tmp_path):
    path = tmp_path / "index.parquet"
    table = pa.table({"x": pa.array(range(300), pa.int64())})
    clean = write(path, table, use_dictionary=False, max_rows_per_page=100, compression="none")
    column, _ = chunk_meta(clean, 0)
    for change, problem in [(lambda index: index[1][2].update({3: 99}), "not increasing from 0"),
                            (lambda index: index[1][0].update({3: 1}), "not increasing from 0"),
                            (lambda index: index[1][2].update({2: index[1][2][2] + 500}), "do not lie in order")]:
        path.write_bytes(rewrite_struct(clean, column[4], change))
        ds = aioload.Parquet(str(path), decode=lambda row: row)
        with pytest.raises(aioload.ParquetError, match=re.escape(f"{path}, row group 0, row 0") + ".*" + re.escape(
                "row group 0, column 'x': the offset index's") + f".*{problem}"):
            ds[0]


# -- 5. booleans inside a map take a byte each ------------------------------------------------
@pytest.mark.unit
def test_a_thrift_map_of_booleans_reads_a_byte_per_boolean():
    data = bytes([0x1B, 2, 0x11, 1, 2, 2, 1, 0x15, 14, 0])  # {1: map<bool, bool> of 2, 2: i32 7}
    assert read_struct(data) == ({1: {True: False, False: True}, 2: 7}, len(data))
    huge = bytes([0x1B]) + bytes([0xFF] * 8 + [0x7F]) + bytes([0x11, 0])  # 2**63 entries in 12 bytes: hung
    with pytest.raises(ThriftError, match="claims 9223372036854775807 elements, more than its 2 remaining bytes"):
        read_struct(huge)


# -- 6. one RLE run of many values is never expanded ------------------------------------------
def test_a_page_of_one_long_run_reads_a_row_in_bounded_memory(tmp_path):
    path = tmp_path / "run.parquet"
    rows = 1 << 22
    table = pa.table({"x": pa.nulls(rows, pa.int64()), "k": pa.array(np.arange(rows) % 2 == 0)})
    write(path, table, max_rows_per_page=rows, data_page_size=1 << 30, compression="none")
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).total_compressed_size < 100  # one page, one run
    ds = aioload.Parquet(str(path), columns=["x"], decode=lambda row: row)
    tracemalloc.start()
    try:
        assert [ds[i] for i in (0, rows // 2, rows - 1)] == [{"x": None}] * 3
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20  # the old reader expanded the run: 8 bytes a row, then a Python list of them


@pytest.mark.unit
def test_a_hybrid_run_is_read_at_a_slot_without_expanding_it():
    run = bytes([0xFE, 0xFF, 0xFF, 0xFF, 0x0F, 1])  # an RLE run of 2**31 - 1 ones, bit width 1
    assert values.hybrid_at(memoryview(run), 1, (1 << 31) - 2, 1) == (1, (1 << 31) - 2)
    packed = bytes([0x03, 0b10110010])  # one bit-packed group of 8 values
    assert values.hybrid_at(memoryview(packed), 1, 7, 1) == (1, 3)
    with pytest.raises(values.PageError, match="stop after 8 values, before value 8"):
        values.hybrid_at(memoryview(packed), 1, 8, 1)
    with pytest.raises(values.PageError, match="bit width of 40, more than 32"):
        values.hybrid_at(memoryview(packed), 40, 0, 1)


# -- 8. errors that say what broke ------------------------------------------------------------
@pytest.mark.unit
def test_a_deeply_nested_struct_or_a_long_varint_is_a_thrift_error():
    nested = bytes([0x1C]) * 5000 + bytes(5001)  # field 1: a struct, 5,000 deep
    with pytest.raises(ThriftError, match=f"nests deeper than {thrift.MAX_DEPTH} levels"):
        read_struct(nested)
    varint = bytes([0x15]) + bytes([0x80] * 20000) + bytes([1, 0])  # an i32 of 20,000 bytes
    with pytest.raises(ThriftError, match="longer than an i64's 10 bytes"):
        read_struct(varint)
    with pytest.raises(ThriftError, match="an i32 of 4294967296 at byte 6 is outside its type's range"):
        read_struct(bytes([0x15]) + compact({1: 1 << 32})[1:])


def test_a_corrupt_zstd_page_fails_its_row_naming_the_column(tmp_path):
    path = tmp_path / "zstd.parquet"
    table = pa.table({"x": [f"value-{i}" for i in range(200)]})
    data = bytearray(write(path, table, compression="zstd", use_dictionary=False, max_rows_per_page=100))
    _, meta = chunk_meta(bytes(data), 0)
    head, body = values.header(bytes(data), meta[9])
    for at in range(body + 8, body + head[3] - 4):  # the frame's blocks, not its header
        data[at] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(OSError):
        pq.read_table(path)
    with pytest.raises(aioload.ParquetError, match=re.escape(f"{path}, row group 0, row 3, column 'x': a page cannot "
                                                             "be decoded (PageError: the zstd page")):
        aioload.Parquet(str(path), decode=lambda row: row)[3]
    assert aioload.Parquet(str(path), decode=lambda row: row)[150] == {"x": "value-150"}  # the other page is whole
