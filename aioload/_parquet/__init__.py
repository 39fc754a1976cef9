"""Parquet files as a map-style dataset: footers read once (``footer``), the epoch's order over
rows or a window of row groups (``order``), row groups fetched by range and kept a while in
each worker (``rowgroups``), and the dataset users make (``dataset``)."""
