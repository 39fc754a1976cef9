"""WebDataset tar shards, in the order data moves: ``urls`` (brace patterns and lists),
``tar`` (headers, PAX and GNU long names, member offsets), ``probe`` (a shard's size and
version), ``index`` (each sample's byte range: from a cache, a sidecar or one pass),
``order`` (the epoch's order, uniform or from a window of shards: a pure function of the
seed), ``window`` (window mode's fetcher of whole shards, bounded, ahead of need),
``coalesce`` (uniform mode's range reads that lie close in one shard, joined into one request),
``dataset`` (``aioload.WebDataset``), ``decoders`` (what the default ``decode`` makes of each
member, by extension) and ``writer`` (``aioload.ShardWriter``, shards with their sidecars).
"""
