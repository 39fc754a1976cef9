"""One row's value out of one Parquet data page: aioload's page decoder against pyarrow's.

    python benchmarks/parquet_page_decode.py [--rows 100] [--repeat 2000] [--json out.json]

A uniform shuffle decodes one row out of each page it fetches. pyarrow decodes nothing
smaller than a row group, so its cost for a page is that of a file holding just that page: a
one-row-group, one-page file is written in memory (its footer parsed once and passed in, so
that only the page's decode is timed) and ``ParquetFile(...).read_row_group(0)`` plus the
row's ``as_py()`` is timed against :func:`aioload._parquet.values.leaf_value` on the same page
bytes, for an image page (PLAIN bytes, uncompressed, one row), a page of ``--rows`` labels
(dictionary-encoded, snappy) and of ``--rows`` strings (PLAIN, zstd). Prints microseconds per
row for both and their ratio.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time


def _files(rows: int) -> dict[str, tuple[bytes, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = {
        "image page (PLAIN bytes, 1 row, none)": (pa.table({"c": pa.array([os.urandom(100_000)], pa.binary())}),
                                                   {"compression": "none", "use_dictionary": False}),
        f"label page (dictionary, {rows} rows, snappy)": (pa.table({"c": pa.array([i % 10 for i in range(rows)],
                                                                                    pa.int64())}),
                                                           {"compression": "snappy"}),
        f"string page (PLAIN, {rows} rows, zstd)": (pa.table({"c": [f"key-{i:06d}" for i in range(rows)]}),
                                                     {"compression": "zstd", "use_dictionary": False}),
    }
    out = {}
    for name, (table, options) in tables.items():
        sink = io.BytesIO()
        pq.write_table(table, sink, row_group_size=rows, data_page_size=1 << 30, write_page_index=True, **options)
        out[name] = (sink.getvalue(), options)
    return out


def _time(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best * 1e6


def main() -> None:
    import pyarrow.parquet as pq

    from aioload._parquet.pageindex import FilePages
    from aioload._parquet.values import dictionary, leaf_value

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    results = []
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'page':45} {'aioload us/row':>15} {'pyarrow us/row':>15} {'pyarrow/aioload':>16}")
    for name, (data, _) in _files(args.rows).items():
        md = pq.read_metadata(io.BytesIO(data))
        column = md.row_group(0).column(0)
        assert md.num_row_groups == 1 and column.has_offset_index
        footer = data[len(data) - 8 - int.from_bytes(data[-8:-4], "little"):]
        plan = FilePages(footer, md.schema.to_arrow_schema(), ["c"])
        chunk = plan.chunks[0][0]
        leaf = plan.nodes["c"].leaf
        first = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
        page = data[first:column.data_page_offset + column.total_compressed_size - (column.data_page_offset - first)]
        # the dictionary as a reader keeps it: decoded once per fetched page
        entries = dictionary(page, 0, chunk.codec, leaf) if column.has_dictionary_page else None
        kept = None if entries is None else (lambda: entries)
        at, rows = column.data_page_offset - first, md.num_rows
        row = rows // 2
        expected = pq.read_table(io.BytesIO(data)).column(0)[row].as_py()
        if leaf_value(page, at, chunk.codec, row, leaf, kept, rows)[1] != expected:
            raise SystemExit(f"{name}: the page decoder's value differs from pyarrow's")
        ours = _time(lambda: leaf_value(page, at, chunk.codec, row, leaf, kept, rows), args.repeat)
        theirs = _time(lambda: pq.ParquetFile(io.BytesIO(data), metadata=md).read_row_group(0).column(0)[row].as_py(),
                       args.repeat)
        print(f"{name:45} {ours:15.1f} {theirs:15.1f} {theirs / ours:16.2f}")
        results.append({"page": name, "aioload_us_per_row": ours, "pyarrow_us_per_row": theirs})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average": os.getloadavg()[0], "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
