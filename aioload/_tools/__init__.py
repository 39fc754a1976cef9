"""The ``aioload`` command and what it runs: ``cli``, ``bench`` (side by side with torch's
DataLoader) with ``benchhttp``/``benchserver``/``benchplot`` and
``benchscenarios`` (the shards' and Parquet benchmarks' common run).
"""
