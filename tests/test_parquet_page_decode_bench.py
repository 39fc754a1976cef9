"""benchmarks/parquet_page_decode.py runs on its smallest settings: each page's row decoded by
aioload's page decoder (checked against pyarrow's value by the script) and by pyarrow.

Behaviour only (the rows and their fields), never speed."""

from __future__ import annotations

import pytest

from tests.benchscripts import positive, run_benchmark

pytestmark = pytest.mark.slow


def test_each_page_is_decoded_both_ways(tmp_path):
    done, result = run_benchmark("parquet_page_decode.py", ["--rows", "10", "--repeat", "2"], tmp_path, timeout=100)
    assert [row["page"] for row in result["rows"]] == ["image page (PLAIN bytes, 1 row, none)",
                                                       "label page (dictionary, 10 rows, snappy)",
                                                       "string page (PLAIN, 10 rows, zstd)"]
    assert all(positive(row[k]) for row in result["rows"] for k in ("aioload_us_per_row", "pyarrow_us_per_row"))
    assert "pyarrow/aioload" in done.stdout
