"""Parquet files as a map-style dataset: footers read once (``footer``), the epoch's order over
rows or a window of row groups (``order``), row groups fetched by range and kept a while in
each worker (``rowgroups``); in a uniform shuffle, where the files have a page index, only the
pages a row needs (``pageindex``: which bytes; ``pages``: fetched and kept; ``values``: the
row's values out of them; ``codecs``: a page decompressed to exactly its claimed size;
``thrift``: the compact protocol their headers and the footer are written in); and the
dataset users make (``dataset``)."""
